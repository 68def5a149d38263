//! An SGLang-like engine embedding kvshard, its forward pass's flow end to end, with
//! `kvshard::engine` alone:
//!
//! 1. two context-parallel prefill ranks (CP2) and an unsharded decode pool;
//! 2. a prompt prefilled chunk by chunk: per layer the forward pass's bf16 rows go through the
//!    quantizers into each rank's chunk staging, then each rank's owned-row write persists the
//!    rows it owns, and each chunk is sent P/D as soon as it is written;
//! 3. the engine's loop (`PrefillLoop::step`, `Receiver::step`) delivers every chunk's status
//!    and finishes the request; nothing per chunk waits on the host;
//! 4. a HiCache round trip: backup (write-through), eviction, a reload into new pages that the
//!    attention stream consumes layer by layer;
//! 5. a second request on the cached prefix: only its new tokens are prefilled, its prefix is
//!    sent from the reloaded pages;
//! 6. the decode pool checked against an independent reference: plain CPU code quantizing the
//!    same rows with the reference codecs.
//!
//! `cargo run --release --example engine` runs it on the CPU twin with a 4-layer model;
//! tests/engine_example.rs runs it on the CPU twin in adversarial stream order and, on a GPU,
//! as DeepSeek-V3.2 (61 layers and its MTP draft), held to zero host waits per chunk and none
//! outside its `_sync` calls.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

// Everything from the front door: an engine needs nothing else.
use kvshard::engine::{
    bf16, enqueue_i64s, quantize_indexer, quantize_indexer_row, quantize_latent,
    quantize_latent_row, sync_counts, Backend, BackendTransport, Buffer, CacheGeometry, CacheNode,
    ChunkEnd, ChunkStaging, Component, CpuBackend, DevicePool, Error, HiCacheController,
    HostLayout, HostPool, IndexerScale, LatentLayout, LocalPage, LogicalPage, MemoryKind, Model,
    ModelLayer, OwnedRowWrite, Placement, PoolGeometry, PoolLayout, PrefillLoop, Receiver,
    Registration, RemoteSpace, RequestChain, Result, Route, Sender, ShardAllocator, StoredLayer,
    Streams, WritePolicy, INDEXER_INPUT_ROW_BYTES, LATENT_INPUT_ROW_BYTES, PAGE_SIZE,
};

/// The indexer's scales as the sharded path stores them.
const SCALE: IndexerScale = IndexerScale::Ue8m0;
/// How long the engine lets the loop take to finish a request or an ack.
const PATIENCE: Duration = Duration::from_secs(120);

/// What a run is made of: the cache, pages per pool, and the two prompts.
pub struct Shape {
    /// The cache (target layers and the MTP draft).
    pub geometry: CacheGeometry,
    /// Pages of each prefill rank's pool, of its host pool, and of the decode pool.
    pub pages: u64,
    /// Tokens per prefill chunk.
    pub chunk: usize,
    /// Tokens of the first prompt.
    pub prompt: usize,
    /// Tokens of the second, which starts with the first's cached whole pages.
    pub second: usize,
}

impl Shape {
    /// A 4-layer model (layer 2 reuses another layer's indexer) and its draft: the CPU twin.
    pub fn small() -> Self {
        Self {
            geometry: CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
                LatentLayout::Fp8Trtllm,
                vec![true, true, false, true],
            )),
            pages: 64,
            chunk: 256,
            prompt: 1000,
            second: 1400,
        }
    }

    /// DeepSeek-V3.2, 61 layers and its MTP draft: a GPU.
    pub fn deepseek() -> Self {
        Self {
            geometry: Model::DeepseekV32.geometry(LatentLayout::Fp8Trtllm, true),
            ..Self::small()
        }
    }
}

/// What a run saw.
#[derive(Debug)]
pub struct Report {
    /// Host-blocking waits of each prefill chunk (forward pass, writes, send, loop steps).
    pub waits_per_chunk: Vec<u64>,
    /// Host-blocking waits of the whole flow outside its `_sync` calls: none, as the naming
    /// rule says (only `_sync` calls and `synchronize` block).
    pub waits_outside_sync: u64,
    /// Tokens of both requests checked on the decode side against the reference.
    pub tokens_checked: usize,
    /// Pages reloaded from the host cache into new device pages.
    pub pages_reloaded: usize,
}

/// One CP rank: the staging its forward pass writes, the owned-row write of that staging into
/// the rank's pool, and its HiCache controller (both hold the pool).
struct Rank {
    staging: Arc<ChunkStaging>,
    write: OwnedRowWrite,
    hicache: HiCacheController,
}

/// The forward pass's output for token `position` of prompt `origin` at model layer `layer`:
/// its latent row (576 bf16) and its indexer key (128 bf16). Deterministic, so the reference
/// computes the same rows.
fn forward(origin: u64, layer: usize, position: usize, elements: usize) -> Vec<bf16> {
    (0..elements)
        .map(|e| {
            let mut x = origin ^ ((layer as u64) << 40) ^ ((position as u64) << 12) ^ e as u64;
            x = (x ^ (x >> 31)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            x ^= x >> 29;
            // Mostly small values, now and then a large one that sets a tile's scale.
            let v = (x % 2001) as f32 / 250.0 - 4.0;
            bf16::from_f32(if x % 97 == 0 { v * 60.0 } else { v })
        })
        .collect()
}

fn bytes_of(values: &[bf16]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The engine: its streams, ranks, decode pool and loop.
struct Engine<'a> {
    shape: &'a Shape,
    new_stream: &'a dyn Fn() -> Result<Arc<dyn Backend>>,
    compute: Arc<dyn Backend>,
    cp: Placement,
    ranks: Vec<Rank>,
    alloc: ShardAllocator,
    decode: Arc<DevicePool>,
    decode_stream: Arc<dyn Backend>,
    decode_alloc: ShardAllocator,
    prefill: PrefillLoop,
    receiver: Receiver,
    /// Device buffers the forward pass fills: staging rows `0..chunk`, the chunk's logical
    /// slots, one layer's latent rows and indexer keys.
    rows: Buffer,
    slots: Buffer,
    latent_in: Buffer,
    keys_in: Buffer,
    waits: Vec<u64>,
    /// Host waits inside the flow's `_sync` calls ([`counted`]).
    in_sync: u64,
}

/// Runs a `_sync` call, adding the host waits it made to `into`: the flow's other calls make
/// none, which [`Report::waits_outside_sync`] holds them to.
fn counted<T>(into: &mut u64, call: impl FnOnce() -> Result<T>) -> Result<T> {
    let before = sync_counts();
    let out = call();
    *into += (sync_counts() - before).host_blocking;
    out
}

impl<'a> Engine<'a> {
    fn new(new_stream: &'a dyn Fn() -> Result<Arc<dyn Backend>>, shape: &'a Shape) -> Result<Self> {
        let g = &shape.geometry;
        let compute = new_stream()?;
        let b = compute.as_ref();
        let cp = Placement::new(2)?;
        let mut ranks = Vec::new();
        let mut prefill = PrefillLoop::new();
        let mut in_sync = 0;
        for r in 0..cp.shard() {
            let pool = Arc::new(DevicePool::allocate(b, g, cp, r, shape.pages)?);
            let staging = Arc::new(ChunkStaging::new(b, &pool, shape.chunk)?);
            // Set-up: prepares the launch's tables once, waiting for their upload.
            let write = counted(&mut in_sync, || {
                OwnedRowWrite::prepare_sync(b, staging.clone(), pool.clone(), |_| true)
            })?;
            let host = Arc::new(HostPool::new(b, g, shape.pages, HostLayout::PageFirst)?);
            let streams = Streams::each(new_stream)?;
            let hicache =
                HiCacheController::new(pool.clone(), host, streams, WritePolicy::WriteThrough)?;
            let transport = BackendTransport::new(new_stream()?);
            prefill.add(Sender::new(pool.clone(), Box::new(transport)))?;
            ranks.push(Rank {
                staging,
                write,
                hicache,
            });
        }
        prefill.watch(compute.clone());
        let decode_stream = new_stream()?;
        let unsharded = Placement::unsharded();
        let decode = Arc::new(DevicePool::allocate(
            decode_stream.as_ref(),
            g,
            unsharded,
            0,
            shape.pages,
        )?);
        let int64s = |n: usize| b.alloc(8 * n, MemoryKind::Device);
        let (rows, slots) = (int64s(shape.chunk)?, int64s(shape.chunk)?);
        enqueue_i64s(b, &rows, &(0..shape.chunk as i64).collect::<Vec<_>>())?;
        Ok(Self {
            shape,
            new_stream,
            alloc: ShardAllocator::new(cp, shape.pages)?,
            decode_alloc: ShardAllocator::new(unsharded, shape.pages)?,
            latent_in: b.alloc(shape.chunk * LATENT_INPUT_ROW_BYTES, MemoryKind::Device)?,
            keys_in: b.alloc(shape.chunk * INDEXER_INPUT_ROW_BYTES, MemoryKind::Device)?,
            rows,
            slots,
            compute,
            cp,
            ranks,
            decode,
            decode_stream,
            prefill,
            receiver: Receiver::new(),
            waits: Vec::new(),
            in_sync,
        })
    }

    /// Registers `request` of `tokens` tokens with the decode side and opens it on every rank.
    fn open(&mut self, request: u64, tokens: usize) -> Result<RequestChain> {
        let mut chain = RequestChain::new(Placement::unsharded());
        chain.grow_to(&mut self.decode_alloc, tokens)?;
        let registration =
            Registration::of_chain(&chain, request, PoolLayout::of(&self.decode), 0)?;
        self.receiver
            .register(registration.clone(), self.cp.shard())?;
        let dst = Arc::new(RemoteSpace::of(
            self.decode.clone(),
            self.shape.geometry.clone(),
        )?);
        for r in 0..self.cp.shard() {
            self.prefill
                .sender(r)?
                .open(registration.clone(), dst.clone())?;
        }
        Ok(chain)
    }

    /// Prefills tokens `from..to` of `request` (its pages in `chain`) chunk by chunk, as a
    /// forward pass does, and sends each chunk P/D; `origin` says whose rows a position holds.
    fn prefill(
        &mut self,
        request: u64,
        chain: &mut RequestChain,
        from: usize,
        to: usize,
        origin: &dyn Fn(usize) -> u64,
    ) -> Result<()> {
        let mut start = from;
        while start < to {
            let end = (start + self.shape.chunk).min(to);
            let waits = sync_counts();
            chain.grow_to(&mut self.alloc, end)?;
            for layer in 0..self.shape.geometry.model_layers() {
                self.forward_layer(ModelLayer(layer), start..end, origin)?;
            }
            // The chunk's slots on the device (ordered after the last chunk's write read
            // them), then each rank persists the rows it owns.
            let slots: Vec<i64> = chain
                .slots(start..end)?
                .iter()
                .map(|s| s.0 as i64)
                .collect();
            enqueue_i64s(self.compute.as_ref(), &self.slots, &slots)?;
            for rank in &self.ranks {
                let launch = rank.write.launch(self.compute.as_ref(), end - start);
                rank.write
                    .run(self.compute.as_ref(), &self.slots, end - start, launch)?;
            }
            // Sent as soon as written: the transfer streams wait for the writes on the device.
            let at = if end == to {
                ChunkEnd::Final(end)
            } else {
                ChunkEnd::Partial(end)
            };
            for r in 0..self.cp.shard() {
                self.prefill.send(r, request, chain.pages()?, at)?;
            }
            self.step()?;
            self.waits.push((sync_counts() - waits).host_blocking);
            start = end;
        }
        Ok(())
    }

    /// Model layer `layer` of the forward pass over tokens `tokens`: its rows, quantized into
    /// each rank's staging (the layer's latent rows, and its indexer keys where it has some).
    fn forward_layer(
        &self,
        layer: ModelLayer,
        tokens: std::ops::Range<usize>,
        origin: &dyn Fn(usize) -> u64,
    ) -> Result<()> {
        let b = self.compute.as_ref();
        let n = tokens.len();
        let latent = self.shape.geometry.target.latent;
        for c in self.shape.geometry.components() {
            let Some(stored) = c.stored_layer(layer) else {
                continue;
            };
            let elements = if c.component.is_indexer() {
                INDEXER_INPUT_ROW_BYTES
            } else {
                LATENT_INPUT_ROW_BYTES
            } / 2;
            let rows: Vec<u8> = tokens
                .clone()
                .flat_map(|t| bytes_of(&forward(origin(t), layer.0, t, elements)))
                .collect();
            let input = if c.component.is_indexer() {
                &self.keys_in
            } else {
                &self.latent_in
            };
            // Ordered after the last quantizer read the buffer: no wait.
            b.enqueue_write(input, 0, &rows)?;
            for rank in &self.ranks {
                let dst = rank.staging.layer(c.component, stored)?;
                if c.component.is_indexer() {
                    quantize_indexer(b, SCALE, input, &self.rows, n, &dst)?;
                } else {
                    quantize_latent(b, latent, input, &self.rows, n, &dst)?;
                }
            }
        }
        Ok(())
    }

    /// One step of the engine's loop: the prefill side's statuses to the decode side; any
    /// kernel-reported error, refused status or overdue request is the run's error.
    fn step(&mut self) -> Result<Vec<u64>> {
        let sent = self.prefill.step();
        if let Some(e) = sent.kernel_errors.into_iter().next() {
            return Err(e);
        }
        let got = self.receiver.step(sent.statuses);
        if let Some(e) = got.refused.into_iter().next() {
            return Err(e);
        }
        if let Some(o) = got.overdue.into_iter().next() {
            return Err(o.into());
        }
        let mut done = Vec::new();
        for f in got.finished {
            if !f.is_completed() {
                return Err(Error::Transfer {
                    request: f.request(),
                    reason: format!("{:?}", f.outcome),
                });
            }
            done.push(f.request());
        }
        Ok(done)
    }

    /// Steps the loop until `request` finished on the decode side (the engine would schedule
    /// other work between steps).
    fn finish(&mut self, request: u64) -> Result<()> {
        let give_up = Instant::now() + PATIENCE;
        while self.receiver.progress(request).is_some() {
            if Instant::now() > give_up {
                return Err(Error::Transfer {
                    request,
                    reason: "not finished in time".into(),
                });
            }
            self.step()?;
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// The HiCache round trip of `chain`'s whole pages on every rank: backed up, evicted (the
    /// engine frees the device pages), reloaded into new pages the attention stream reads
    /// layer by layer. Returns the chain of the reloaded pages, the cached prefix.
    fn hicache_round_trip(&mut self, chain: &RequestChain) -> Result<RequestChain> {
        let node = CacheNode::of_chain(chain, 7, 0..self.shape.prompt / PAGE_SIZE)?;
        let compute = self.compute.record()?;
        for rank in &mut self.ranks {
            rank.hicache.access(&node, &compute, Route::Auto)?;
        }
        self.hicache_acks(|r| r.hicache.pending_backups())?;
        for rank in &mut self.ranks {
            // Backed up already (acked by the steps): nothing to wait for.
            counted(&mut self.in_sync, || {
                rank.hicache.evict_sync(&node, &compute, Route::Auto)
            })?;
        }
        let start_owner = chain.start_owner().unwrap_or(0);
        chain.free(&mut self.alloc)?;
        let reloaded = self.alloc.alloc_matching(&node.device_pages)?;
        let attention = (self.new_stream)()?;
        for rank in &mut self.ranks {
            let handle = rank.hicache.load(node.id, &reloaded, None, Route::Auto)?;
            for layer in 0..self.shape.geometry.model_layers() {
                // The attention of `layer` would run on `attention` right after this wait.
                handle.wait_layer(attention.as_ref(), ModelLayer(layer))?;
            }
        }
        self.hicache_acks(|r| r.hicache.pending_loads())?;
        RequestChain::cached(&self.alloc, start_owner, reloaded)
    }

    /// Steps every rank's controller until `pending` says nothing is left to ack.
    fn hicache_acks(&mut self, pending: impl Fn(&Rank) -> usize) -> Result<()> {
        let give_up = Instant::now() + PATIENCE;
        while self.ranks.iter().any(|r| pending(r) > 0) {
            if Instant::now() > give_up {
                return Err(Error::HiCache(
                    "acks not in within the engine's patience".into(),
                ));
            }
            for rank in &mut self.ranks {
                if let Some(e) = rank.hicache.step()?.kernel_errors.into_iter().next() {
                    return Err(e);
                }
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// Checks every token of a request on the decode side (`chain`: its decode pages) against
    /// the reference: plain CPU code quantizing the forward pass's rows with the reference
    /// codecs. Returns the tokens checked.
    fn check(
        &mut self,
        request: u64,
        chain: &RequestChain,
        tokens: usize,
        origin: &dyn Fn(usize) -> u64,
    ) -> Result<usize> {
        let g = &self.shape.geometry;
        let mut blocks: HashMap<(Component, StoredLayer, LogicalPage), Vec<u8>> = HashMap::new();
        for t in 0..tokens {
            let page = chain.pages()?[t / PAGE_SIZE];
            let o = t % PAGE_SIZE;
            for c in g.components() {
                for (s, layer) in c.model_layers.iter().enumerate() {
                    let key = (c.component, StoredLayer(s), page);
                    let block = match blocks.entry(key) {
                        Entry::Occupied(read) => read.into_mut(),
                        Entry::Vacant(unread) => unread.insert(counted(&mut self.in_sync, || {
                            self.decode.read_block_sync(
                                self.decode_stream.as_ref(),
                                c.component,
                                StoredLayer(s),
                                LocalPage(page.0),
                            )
                        })?),
                    };
                    let (got, want) = if c.component.is_indexer() {
                        // A page-major block: 64 tokens' key codes, then their 64 f32 scales.
                        let keys = forward(origin(t), layer.0, t, INDEXER_INPUT_ROW_BYTES / 2);
                        let mut codes = vec![0u8; keys.len()];
                        let scale = quantize_indexer_row(&keys, SCALE, &mut codes)?;
                        codes.extend(scale.to_le_bytes());
                        let (k, scales) = (keys.len(), PAGE_SIZE * keys.len());
                        let mut got = block[o * k..(o + 1) * k].to_vec();
                        got.extend(&block[scales + 4 * o..scales + 4 * o + 4]);
                        (got, codes)
                    } else {
                        let input = forward(origin(t), layer.0, t, LATENT_INPUT_ROW_BYTES / 2);
                        let mut row = vec![0u8; c.row_bytes];
                        quantize_latent_row(g.target.latent, &input, &mut row)?;
                        (block[o * c.row_bytes..(o + 1) * c.row_bytes].to_vec(), row)
                    };
                    if got != want {
                        return Err(Error::Transfer {
                            request,
                            reason: format!("the decode's {} of token {t} at {layer} differs from the reference", c.component),
                        });
                    }
                }
            }
        }
        Ok(tokens)
    }
}

/// The whole flow (module docs) on streams `new_stream` makes, all of one device.
pub fn run(new_stream: &dyn Fn() -> Result<Arc<dyn Backend>>, shape: &Shape) -> Result<Report> {
    let start = sync_counts();
    let mut engine = Engine::new(new_stream, shape)?;
    // The first prompt: prefilled, sent, finished by the loop.
    let mut first = RequestChain::new(engine.cp);
    let decode_first = engine.open(1, shape.prompt)?;
    engine.prefill(1, &mut first, 0, shape.prompt, &|_| 1)?;
    engine.finish(1)?;
    // Its whole pages through the host cache and back, then the second prompt on them.
    let mut second = engine.hicache_round_trip(&first)?;
    let pages_reloaded = second.page_count();
    let prefix = pages_reloaded * PAGE_SIZE;
    let decode_second = engine.open(2, shape.second)?;
    let origin = move |t: usize| if t < prefix { 1 } else { 2 };
    engine.prefill(2, &mut second, prefix, shape.second, &origin)?;
    engine.finish(2)?;
    let tokens_checked = engine.check(1, &decode_first, shape.prompt, &|_| 1)?
        + engine.check(2, &decode_second, shape.second, &origin)?;
    let waits = (sync_counts() - start).host_blocking;
    Ok(Report {
        waits_outside_sync: waits.saturating_sub(engine.in_sync),
        waits_per_chunk: engine.waits,
        tokens_checked,
        pages_reloaded,
    })
}

fn main() -> Result<()> {
    let cpu = CpuBackend::new();
    let new_stream = || -> Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
    let report = run(&new_stream, &Shape::small())?;
    println!(
        "{} tokens of two requests on the decode side, byte-identical to the reference; {} pages reloaded from the host cache",
        report.tokens_checked, report.pages_reloaded
    );
    println!("host waits per prefill chunk: {:?}", report.waits_per_chunk);
    if report.waits_per_chunk.iter().any(|&w| w > 0) || report.waits_outside_sync > 0 {
        return Err(Error::InvalidArgument(format!(
            "a prefill chunk, or a call not named _sync, waited on the host ({} waits outside _sync calls)",
            report.waits_outside_sync
        )));
    }
    Ok(())
}
