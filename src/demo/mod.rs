//! The end-to-end job `kvshard demo` runs: one request through every stage of the data plane,
//! on whichever backend is there, checking the bytes at every hand-off.
//!
//! 1. The N prefill ranks of a CP group grow a request's page chain chunk by chunk with the
//!    rotated-owner allocator; an unsharded reference prefill does the same for itself.
//! 2. Each chunk's KV (random bf16 rows, FP8-quantized by the quantizer kernels into the chunk
//!    staging) is persisted by every rank's owned-row write path and by the reference.
//! 3. P/D: every rank sends every chunk (plus the indexer state with the final one) to a decode
//!    pool; the decode pool must equal the one the unsharded reference sends.
//! 4. HiCache: every rank's controller backs the request's pages up (write-through), the pages
//!    are evicted (poisoned and freed), reloaded into newly allocated pages of the same owners,
//!    and sent again: the decode pool must still be identical.
//!
//! [`run_pressure`] runs the seed's accuracy scenario under memory pressure instead
//! ([`PressureConfig`], module [`pressure`]): admission and eviction, a prefix reloaded from the
//! host, and the CP gather of prefixes into the attention scratch.
//!
//! Every stage reports its transfers' own time, measured with events on the device, and their
//! GB/s, apart from the setup and the verification around them.

pub mod pressure;

use std::sync::Arc;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::backend::{Backend, Event, MemoryKind};
use crate::chain::RequestChain;
use crate::copy::RemoteSpace;
use crate::error::{Error, Result};
use crate::geometry::{
    CacheGeometry, Component, IndexerScale, LatentLayout, PoolGeometry, PAGE_SIZE,
};
use crate::hicache::{
    HiCacheController, HostLayout, HostPool, Relayout, Route, Streams, WritePolicy,
};
use crate::index::{ModelLayer, StoredLayer};
use crate::pool::{ChunkStaging, DevicePool, OwnedRowWrite};
use crate::quantize::{
    quantize_indexer_checked_sync, quantize_latent_checked_sync, INDEXER_INPUT_ROW_BYTES,
    LATENT_INPUT_ROW_BYTES,
};
use crate::shard::{Placement, ShardAllocator};
use crate::synth::{self, POISON};
use crate::transfer::{BackendTransport, ChunkEnd, PoolLayout, Receiver, Sender};

pub use pressure::{run_pressure, PressureConfig};

/// What the demo runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// CP shard size N.
    pub ranks: u32,
    /// Target layers (every fourth one shares its indexer).
    pub layers: usize,
    /// Whether the single-layer MTP draft pool is present.
    pub draft: bool,
    /// Request length in tokens.
    pub tokens: usize,
    /// Prefill chunk size in tokens (a multiple of 64).
    pub chunk: usize,
    /// Seed of the synthetic KV.
    pub seed: u64,
}

impl Config {
    /// The default for a backend: production shape on the GPU, a small one on the CPU reference.
    pub fn default_for(gpu: bool) -> Self {
        if gpu {
            Self {
                ranks: 4,
                layers: 61,
                draft: true,
                tokens: 16_000,
                chunk: 4096,
                seed: 7,
            }
        } else {
            Self {
                ranks: 4,
                layers: 4,
                draft: true,
                tokens: 1000,
                chunk: 256,
                seed: 7,
            }
        }
    }

    /// The geometry the demo runs: every fourth target layer shares its indexer.
    pub fn geometry(&self) -> CacheGeometry {
        demo_geometry(self.layers, self.draft)
    }

    /// Physical pages each prefill rank's pool and host pool hold.
    pub fn pages_per_rank(&self) -> u64 {
        (self
            .tokens
            .div_ceil(PAGE_SIZE)
            .div_ceil(self.ranks.max(1) as usize)
            + 2) as u64
    }
}

/// `layers` FP8 target layers, every fourth sharing its indexer, and the MTP draft if `draft`.
pub(crate) fn demo_geometry(layers: usize, draft: bool) -> CacheGeometry {
    let target = PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        (0..layers).map(|i| i % 4 != 3).collect(),
    );
    if draft {
        CacheGeometry::with_draft(target)
    } else {
        CacheGeometry::target_only(target)
    }
}

/// What the demo did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// Lines of the report, in order.
    pub lines: Vec<String>,
}

impl Summary {
    pub(crate) fn say(&mut self, line: String) {
        println!("{line}");
        self.lines.push(line);
    }
}

/// Makes a new stream of the demo's device.
pub type StreamFactory<'a> = &'a dyn Fn() -> Result<Arc<dyn Backend>>;

pub(crate) fn gbps(bytes: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        bytes as f64 / ms / 1e6
    } else {
        0.0
    }
}

/// Times the transfers `work` enqueues on `b` with events; returns the milliseconds.
pub(crate) fn timed(b: &dyn Backend, work: impl FnOnce() -> Result<()>) -> Result<f64> {
    let start = b.record_timed()?;
    work()?;
    let end = b.record_timed()?;
    b.wait_event_sync(&end)?;
    b.elapsed_ms(&start, &end)
}

/// The shape of a P/D send: the cache's geometry, the request's tokens, the chunk size.
pub(crate) struct SendShape<'a> {
    pub(crate) geometry: &'a CacheGeometry,
    pub(crate) tokens: usize,
    pub(crate) chunk: usize,
}

/// Runs `work` on every rank's controller, every controller's `stream` starting after an event
/// of `b` that `b` then waits for all of them after: the elapsed time (events on the device)
/// covers every rank's transfer, the ranks running concurrently.
pub(crate) fn on_all_ranks(
    b: &dyn Backend,
    controllers: &mut [HiCacheController],
    stream: fn(&Streams) -> &Arc<dyn Backend>,
    work: &mut dyn FnMut(&mut HiCacheController, &Event) -> Result<()>,
) -> Result<f64> {
    let start = b.record_timed()?;
    for c in controllers.iter_mut() {
        work(c, &start)?;
        b.wait(&stream(c.streams()).record()?)?;
    }
    let end = b.record_timed()?;
    b.wait_event_sync(&end)?;
    b.elapsed_ms(&start, &end)
}

/// Sends the whole request from every pool of `pools` (each with chain `chain`) into `decode`,
/// on `b`; returns the bytes moved and the milliseconds the transfers took.
pub(crate) fn send_all(
    b: &Arc<dyn Backend>,
    pools: &[Arc<DevicePool>],
    chain: &RequestChain,
    decode: &Arc<RemoteSpace>,
    shape: &SendShape<'_>,
) -> Result<(u64, f64)> {
    let g = shape.geometry.clone();
    let mut decode_alloc = ShardAllocator::new(
        Placement::unsharded(),
        crate::copy::BlockSpace::pages(decode.as_ref()),
    )?;
    let mut decode_chain = RequestChain::new(Placement::unsharded());
    decode_chain.grow_to(&mut decode_alloc, shape.tokens)?;
    let reg = decode_chain.registration(
        1,
        PoolLayout::packed(g, crate::copy::BlockSpace::pages(decode.as_ref())),
        0,
    )?;
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), pools.len() as u32)?;
    let mut senders: Vec<Sender> = pools
        .iter()
        .map(|p| Sender::new(p.clone(), Box::new(BackendTransport::new(b.clone()))))
        .collect();
    for s in &mut senders {
        s.open(reg.clone(), decode.clone())?;
    }
    let mut finished = None;
    let ms = timed(b.as_ref(), || {
        let mut end = 0;
        while end < shape.tokens {
            end = (end + shape.chunk).min(shape.tokens);
            let last = end == shape.tokens;
            let mut pending = Vec::with_capacity(senders.len());
            for s in &mut senders {
                let at = if last {
                    ChunkEnd::Final(end)
                } else {
                    ChunkEnd::Partial(end)
                };
                pending.push(s.send(reg.request, chain.pages()?, at)?);
            }
            for p in pending {
                if let Some(f) = receiver.receive(p.wait_sync()?)? {
                    finished = Some(f);
                }
            }
        }
        Ok(())
    })?;
    let f = finished.ok_or_else(|| Error::Transfer {
        request: reg.request,
        reason: "no final status from every rank".into(),
    })?;
    if !f.is_completed() {
        return Err(Error::Transfer {
            request: reg.request,
            reason: "request failed".into(),
        });
    }
    Ok((f.total_bytes().total(), ms))
}

/// A decode pool for a request of `tokens` tokens, poisoned, and the destination that
/// describes it.
pub(crate) fn decode_pool(
    b: &dyn Backend,
    g: &CacheGeometry,
    tokens: usize,
) -> Result<(Arc<DevicePool>, Arc<RemoteSpace>)> {
    let pages = tokens.div_ceil(PAGE_SIZE) as u64 + 2;
    let pool = Arc::new(DevicePool::allocate(
        b,
        g,
        Placement::unsharded(),
        0,
        pages,
    )?);
    pool.fill(b, POISON)?;
    let space = Arc::new(RemoteSpace::of(pool.clone(), g.clone())?);
    Ok((pool, space))
}

/// A write-through HiCache controller per rank pool, each with a page_first_direct host pool of
/// `host_pages` pages and its own streams.
pub(crate) fn write_through_controllers(
    bk: &dyn Backend,
    g: &CacheGeometry,
    ranks: &[Arc<DevicePool>],
    host_pages: u64,
    streams: StreamFactory<'_>,
) -> Result<Vec<HiCacheController>> {
    ranks
        .iter()
        .map(|pool| {
            let host = Arc::new(HostPool::new(
                bk,
                g,
                host_pages,
                HostLayout::PageFirstDirect,
            )?);
            let s = Streams {
                load: streams()?,
                backup: streams()?,
                load_relayout: streams()?,
                backup_relayout: streams()?,
                tables: streams()?,
            };
            HiCacheController::new(pool.clone(), host, s, WritePolicy::WriteThrough)
        })
        .collect()
}

/// Runs the demo on `b`, making further streams of the same device with `streams`, and with
/// the HiCache route `route`.
pub fn run(
    b: Arc<dyn Backend>,
    streams: StreamFactory<'_>,
    cfg: &Config,
    route: Route,
) -> Result<Summary> {
    let mut out = Summary::default();
    if cfg.chunk == 0 || cfg.chunk % PAGE_SIZE != 0 || cfg.tokens == 0 {
        return Err(Error::InvalidArgument(format!(
            "chunk of {} tokens (a non-zero multiple of 64) for {} tokens",
            cfg.chunk, cfg.tokens
        )));
    }
    let bk = b.as_ref();
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let g = cfg.geometry();
    let placement = Placement::new(cfg.ranks)?;
    let pages = cfg.tokens.div_ceil(PAGE_SIZE);
    let per_rank = cfg.pages_per_rank();
    out.say(format!(
        "kvshard demo on the {} backend: {} tokens, chunks of {}, CP{} ({} layers{}, {} indexer layers, {} B per page)",
        bk.name(),
        cfg.tokens,
        cfg.chunk,
        cfg.ranks,
        cfg.layers,
        if cfg.draft { " + MTP draft" } else { "" },
        g.target.num_indexer_layers(),
        g.page_bytes()
    ));

    // 1 + 2: allocate and prefill, chunk by chunk.
    let setup = Instant::now();
    let ranks: Vec<Arc<DevicePool>> = (0..cfg.ranks)
        .map(|r| DevicePool::allocate(bk, &g, placement, r, per_rank).map(Arc::new))
        .collect::<Result<_>>()?;
    let reference = Arc::new(DevicePool::allocate(
        bk,
        &g,
        Placement::unsharded(),
        0,
        pages as u64 + 2,
    )?);
    let mut alloc = ShardAllocator::new(placement, per_rank)?;
    let mut ref_alloc = ShardAllocator::new(Placement::unsharded(), pages as u64 + 2)?;
    let (mut chain, mut ref_chain) = (
        RequestChain::new(placement),
        RequestChain::new(Placement::unsharded()),
    );
    let staging = Arc::new(ChunkStaging::new(bk, &reference, cfg.chunk)?);
    let writes: Vec<OwnedRowWrite> = ranks
        .iter()
        .chain(std::iter::once(&reference))
        .map(|p| OwnedRowWrite::prepare_sync(bk, staging.clone(), p.clone(), |_| true))
        .collect::<Result<_>>()?;
    let setup_ms = setup.elapsed().as_secs_f64() * 1e3;
    let (mut written, mut write_ms) = (0u64, 0.0);
    let mut begin = 0;
    while begin < cfg.tokens {
        let end = (begin + cfg.chunk).min(cfg.tokens);
        let n = end - begin;
        chain.grow_to(&mut alloc, end)?;
        ref_chain.grow_to(&mut ref_alloc, end)?;
        // The chunk's KV: random bytes in every layer, FP8-quantized random rows in layer 0.
        bk.write_sync(
            staging.buffer(),
            0,
            &synth::bytes(&mut rng, staging.buffer().len()),
        )?;
        let rows: Vec<i64> = (0..n as i64).collect();
        let latent_in = bk.alloc(n * LATENT_INPUT_ROW_BYTES, MemoryKind::Device)?;
        bk.write_sync(
            &latent_in,
            0,
            &synth::bf16_bytes(&mut rng, n * LATENT_INPUT_ROW_BYTES / 2),
        )?;
        quantize_latent_checked_sync(
            bk,
            LatentLayout::Fp8Trtllm,
            &latent_in,
            &rows,
            &staging.layer(Component::TargetLatent, StoredLayer(0))?,
        )?;
        let keys_in = bk.alloc(n * INDEXER_INPUT_ROW_BYTES, MemoryKind::Device)?;
        bk.write_sync(
            &keys_in,
            0,
            &synth::bf16_bytes(&mut rng, n * INDEXER_INPUT_ROW_BYTES / 2),
        )?;
        quantize_indexer_checked_sync(
            bk,
            IndexerScale::Ue8m0,
            &keys_in,
            &rows,
            &staging.layer(Component::TargetIndexer, StoredLayer(0))?,
        )?;
        for (r, w) in writes.iter().enumerate() {
            let sharded = r < ranks.len();
            let slots = if sharded {
                chain.slots(begin..end)?
            } else {
                ref_chain.slots(begin..end)?
            };
            write_ms += timed(bk, || w.run_checked_sync(bk, &slots, w.launch(bk, n)))?;
            if sharded {
                let owned = slots
                    .iter()
                    .filter(|&&s| placement.slot_owner(s) == r as u32)
                    .count();
                written += owned as u64 * w.row_bytes();
            }
        }
        begin = end;
    }
    let owners: Vec<u32> = chain.pages()?.iter().map(|&p| placement.owner(p)).collect();
    out.say(format!(
        "prefill: {} pages, start owner {}, owners {:?}{}; owned-row writes moved {} bytes in {:.2} ms ({:.1} GB/s); setup {:.1} ms",
        chain.page_count(),
        chain.start_owner().unwrap_or(0),
        &owners[..owners.len().min(12)],
        if owners.len() > 12 { " ..." } else { "" },
        written,
        write_ms,
        gbps(written, write_ms),
        setup_ms
    ));

    // 3: P/D to an unsharded decode pool, against the unsharded reference.
    let shape = SendShape {
        geometry: &g,
        tokens: cfg.tokens,
        chunk: cfg.chunk,
    };
    let (decode, decode_space) = decode_pool(bk, &g, cfg.tokens)?;
    let (expected, expected_space) = decode_pool(bk, &g, cfg.tokens)?;
    let (sent, pd_ms) = send_all(&b, &ranks, &chain, &decode_space, &shape)?;
    send_all(
        &b,
        std::slice::from_ref(&reference),
        &ref_chain,
        &expected_space,
        &shape,
    )?;
    let check = Instant::now();
    let want = expected.snapshot_sync(bk)?;
    if decode.snapshot_sync(bk)? != want {
        return Err(Error::Transfer {
            request: 1,
            reason: "decode pool differs from what an unsharded prefill sends".into(),
        });
    }
    out.say(format!(
        "P/D: {} ranks sent {} bytes in {:.2} ms ({:.1} GB/s); decode pool byte-identical to the unsharded reference (verified in {:.1} ms)",
        cfg.ranks,
        sent,
        pd_ms,
        gbps(sent, pd_ms),
        check.elapsed().as_secs_f64() * 1e3
    ));

    // 4: HiCache: write-through backups, eviction, reload into new pages, resend.
    let mut controllers = write_through_controllers(bk, &g, &ranks, per_rank, streams)?;
    let node = chain.cache_node(1, 0..chain.page_count())?;
    let backup_ms = on_all_ranks(bk, &mut controllers, |s| &s.backup, &mut |c, start| {
        c.access(&node, start, route).map(|_| ())
    })?;
    let mut backed_up = 0u64;
    for c in &mut controllers {
        backed_up += c.ack_backups_sync(1)?.iter().map(|a| a.bytes).sum::<u64>();
    }
    let compute = bk.record()?;
    for (c, pool) in controllers.iter_mut().zip(&ranks) {
        c.evict_sync(&node, &compute, route)?;
        pool.fill(bk, POISON)?;
    }
    chain.free(&mut alloc)?;
    let pages = alloc.alloc_matching(&node.device_pages)?;
    let reloaded = RequestChain::cached(&alloc, chain.start_owner().unwrap_or(0), pages)?;
    let load_ms = on_all_ranks(bk, &mut controllers, |s| &s.load, &mut |c, start| {
        let handle = c.load(node.id, reloaded.pages()?, Some(start), route)?;
        handle.wait_layer(bk, ModelLayer(0))
    })?;
    let mut loaded = 0u64;
    for c in &mut controllers {
        loaded += c.ack_loads_sync(1)?.iter().map(|a| a.bytes).sum::<u64>();
    }
    let (again, again_space) = decode_pool(bk, &g, cfg.tokens)?;
    send_all(&b, &ranks, &reloaded, &again_space, &shape)?;
    if again.snapshot_sync(bk)? != want {
        return Err(Error::HiCache(
            "after backup, eviction and reload the decode pool differs from the reference".into(),
        ));
    }
    out.say(format!(
        "HiCache ({route}): {} pages backed up by every rank, {} bytes in {:.2} ms ({:.1} GB/s), evicted, reloaded into new pages of the same owners, {} bytes in {:.2} ms ({:.1} GB/s); resent decode pool byte-identical",
        chain.page_count(),
        backed_up,
        backup_ms,
        gbps(backed_up, backup_ms),
        loaded,
        load_ms,
        gbps(loaded, load_ms)
    ));
    out.say("demo: every check passed".into());
    Ok(out)
}

/// The HiCache route the demo uses on a backend: the staged copy engine on a GPU (what measured
/// best for bulk transfers next to compute), the plain copy engine on the CPU reference.
pub fn default_route(gpu: bool) -> Route {
    if gpu {
        Route::Staged(Relayout::CopyEngine)
    } else {
        Route::Direct(crate::hicache::IoBackend::CopyEngine)
    }
}
