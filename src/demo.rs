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
//! ([`PressureConfig`]): admission and eviction, a prefix reloaded from the host, and the CP
//! gather of prefixes into the attention scratch.
//!
//! Every stage reports its transfers' own time, measured with events on the device, and their
//! GB/s, apart from the setup and the verification around them.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::backend::{Backend, Event, KernelFamily, Launch, MemoryKind};
use crate::chain::RequestChain;
use crate::copy::{
    BlockCopy, BlockCopyPlan, BlockSpace, PageSelection, RemoteSpace, ScratchTable, Staging,
};
use crate::error::{Checked, Error, Result};
use crate::geometry::{
    CacheGeometry, Component, IndexerScale, LatentLayout, PoolGeometry, PAGE_SIZE,
};
use crate::hicache::{
    CacheNode, HiCacheController, HostLayout, HostPool, Relayout, Route, Streams, WritePolicy,
};
use crate::index::{LocalPage, LogicalPage, ModelLayer, StoredLayer};
use crate::pool::{Budget, BudgetRequest, ChunkStaging, DevicePool, OwnedRowWrite};
use crate::quantize::{
    quantize_indexer_checked_sync, quantize_latent_checked_sync, INDEXER_INPUT_ROW_BYTES,
    LATENT_INPUT_ROW_BYTES,
};
use crate::shard::{
    evict_until_allocatable, Admission, AdmissionLimits, Candidate, Decision, Deferral, GatherPlan,
    GatherRequest, Placement, ScratchLayout, ShardAllocator,
};
use crate::synth::{self, POISON};
use crate::transfer::{BackendTransport, ChunkEnd, PoolLayout, Receiver, Sender};

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
fn demo_geometry(layers: usize, draft: bool) -> CacheGeometry {
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
    fn say(&mut self, line: String) {
        println!("{line}");
        self.lines.push(line);
    }
}

/// Makes a new stream of the demo's device.
pub type StreamFactory<'a> = &'a dyn Fn() -> Result<Arc<dyn Backend>>;

fn gbps(bytes: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        bytes as f64 / ms / 1e6
    } else {
        0.0
    }
}

/// Times the transfers `work` enqueues on `b` with events; returns the milliseconds.
fn timed(b: &dyn Backend, work: impl FnOnce() -> Result<()>) -> Result<f64> {
    let start = b.record_timed()?;
    work()?;
    let end = b.record_timed()?;
    b.wait_event_sync(&end)?;
    b.elapsed_ms(&start, &end)
}

/// The shape of a P/D send: the cache's geometry, the request's tokens, the chunk size.
struct SendShape<'a> {
    geometry: &'a CacheGeometry,
    tokens: usize,
    chunk: usize,
}

/// Runs `work` on every rank's controller, every controller's `stream` starting after an event
/// of `b` that `b` then waits for all of them after: the elapsed time (events on the device)
/// covers every rank's transfer, the ranks running concurrently.
fn on_all_ranks(
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
fn send_all(
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
                pending.push(s.send(reg.request, chain.pages(), at)?);
            }
            for p in pending {
                if let Some(f) = receiver.receive(p.wait()?)? {
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
fn decode_pool(
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
fn write_through_controllers(
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
    let owners: Vec<u32> = chain.pages().iter().map(|&p| placement.owner(p)).collect();
    out.say(format!(
        "prefill: {} pages, start owner {}, owners {:?}{}; owned-row writes moved {} bytes in {:.2} ms ({:.1} GB/s); setup {:.1} ms",
        chain.pages().len(),
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
    let node = chain.cache_node(1, 0..chain.pages().len())?;
    let backup_ms = on_all_ranks(bk, &mut controllers, |s| &s.backup, &mut |c, start| {
        c.access(&node, start, route).map(|_| ())
    })?;
    let mut backed_up = 0u64;
    for c in &mut controllers {
        backed_up += c.ack_backups(1)?.iter().map(|a| a.bytes).sum::<u64>();
    }
    let compute = bk.record()?;
    for (c, pool) in controllers.iter_mut().zip(&ranks) {
        c.evict(&node, &compute, route)?;
        pool.fill(bk, POISON)?;
    }
    alloc.free(chain.pages())?;
    let reloaded = RequestChain::cached(
        placement,
        chain.start_owner().unwrap_or(0),
        alloc.alloc_matching(chain.pages())?,
    )?;
    let load_ms = on_all_ranks(bk, &mut controllers, |s| &s.load, &mut |c, start| {
        let handle = c.load(node.id, reloaded.pages(), Some(start), route)?;
        handle.wait_layer(bk, ModelLayer(0))
    })?;
    let mut loaded = 0u64;
    for c in &mut controllers {
        loaded += c.ack_loads(1)?.iter().map(|a| a.bytes).sum::<u64>();
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
        chain.pages().len(),
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

// ---------------------------------------------------------------------------------------------
// The pressure scenario.
// ---------------------------------------------------------------------------------------------

/// What `kvshard demo --scenario pressure` runs: the seed's accuracy scenario scaled to the
/// machine. A seeded prefix is prefilled and written through to the host (its backup awaited);
/// then two prompts, which together exceed the CP group's logical GPU slots but fit, with the
/// prefix, in a host cache `host_factor` times larger, are prefilled chunk by chunk, every chunk
/// admitted as SGLang schedules it. The first (a prompt of its own) forces the prefix out of
/// the GPU; the second (the prefix, then new tokens) forces the first out and reloads the
/// prefix from the host (H2D grows), and every one of its chunks reads its prefix through the
/// gather plan: each rank packs its send list, device copies land the send buffers in every
/// rank's scratch owner-major (the all-gather, emulated on one device), and the scratch read
/// through the page table must equal the unsharded reference's pages in chain order. Both
/// prompts are sent P/D; every decode pool must be byte-identical to what an unsharded
/// reference prefill (which never evicts) sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PressureConfig {
    /// CP shard size N.
    pub ranks: u32,
    /// Target layers (every fourth one shares its indexer).
    pub layers: usize,
    /// Whether the single-layer MTP draft pool is present.
    pub draft: bool,
    /// Logical token slots of the CP group's device pools (N x physical slots).
    pub logical_slots: u64,
    /// Tokens of each prompt (the second one's seeded prefix included).
    pub prompt_tokens: usize,
    /// Tokens of the seeded prefix (a multiple of 64, shorter than a prompt).
    pub prefix_tokens: usize,
    /// Prefill chunk size in tokens (a multiple of 64).
    pub chunk: usize,
    /// How many times the device pools' pages each host pool holds.
    pub host_factor: u64,
    /// Seed of the synthetic KV.
    pub seed: u64,
}

impl PressureConfig {
    /// The seed's shape (CP2, 16,384 logical slots, two 12,288-token prompts, a 4,096-token
    /// prefix, a host cache 4x larger): on the GPU with 61 layers and the draft; on the CPU
    /// reference with 2 layers and the draft, so it runs in seconds.
    pub fn default_for(gpu: bool) -> Self {
        Self {
            ranks: 2,
            layers: if gpu { 61 } else { 2 },
            draft: true,
            logical_slots: 16_384,
            prompt_tokens: 12_288,
            prefix_tokens: 4_096,
            chunk: 2_048,
            host_factor: 4,
            seed: 11,
        }
    }

    /// The geometry the scenario runs: every fourth target layer shares its indexer.
    pub fn geometry(&self) -> CacheGeometry {
        demo_geometry(self.layers, self.draft)
    }

    /// Physical pages per rank, after checking the scenario is what it claims: page-aligned
    /// sizes; one prompt fits the empty device pools; the prefix and a prompt do not (so the
    /// prompts force evictions); the host pools hold the prefix and both prompts.
    pub fn pages_per_rank(&self) -> Result<u64> {
        let invalid =
            |why: String| Err(Error::InvalidArgument(format!("pressure scenario: {why}")));
        let page = PAGE_SIZE as u64;
        let stride = u64::from(self.ranks.max(1)) * page;
        if self.chunk == 0 || self.chunk % PAGE_SIZE != 0 {
            return invalid(format!(
                "chunks of {} tokens (a non-zero multiple of 64)",
                self.chunk
            ));
        }
        if self.prefix_tokens == 0
            || self.prefix_tokens % PAGE_SIZE != 0
            || self.prefix_tokens >= self.prompt_tokens
        {
            return invalid(format!(
                "a prefix of {} tokens (a non-zero multiple of 64, shorter than the {}-token prompts)",
                self.prefix_tokens, self.prompt_tokens
            ));
        }
        if self.logical_slots % stride != 0 || self.logical_slots / stride < 2 {
            return invalid(format!(
                "{} logical slots are not whole pages of {} ranks (a multiple of {stride}), at least 2 each",
                self.logical_slots, self.ranks
            ));
        }
        let per_rank = self.logical_slots / stride;
        // What an allocator of `pages` pages per rank admits when empty, and what a request of
        // `tokens` tokens reserves.
        let admits = |pages: u64| (pages - 1).saturating_mul(stride);
        let reserve = |tokens: usize| (tokens as u64).saturating_add(stride);
        if reserve(self.prompt_tokens) > admits(per_rank) {
            return invalid(format!(
                "a {}-token prompt does not fit {} logical slots",
                self.prompt_tokens, self.logical_slots
            ));
        }
        if reserve(self.prefix_tokens + self.prompt_tokens) <= admits(per_rank) {
            return invalid(format!(
                "the prefix and a prompt fit {} logical slots together: nothing would be evicted",
                self.logical_slots
            ));
        }
        let host = per_rank.saturating_mul(self.host_factor);
        let backed_up = reserve(self.prefix_tokens)
            .saturating_add(reserve(self.prompt_tokens))
            .saturating_add(reserve(self.prompt_tokens - self.prefix_tokens));
        if host < 2 || backed_up > admits(host) {
            return invalid(format!(
                "host pools of {host} pages per rank do not hold the prefix and both prompts"
            ));
        }
        Ok(per_rank)
    }
}

/// The scratch side of the gather: per rank a send buffer and a scratch slot, the page table,
/// and two staging buffers verification reads pages in chain order into.
struct GatherRig {
    layout: ScratchLayout,
    sends: Vec<Arc<Staging>>,
    scratch: Vec<Arc<Staging>>,
    table: ScratchTable,
    want: Arc<Staging>,
    got: Arc<Staging>,
}

impl GatherRig {
    fn new(
        b: &Arc<dyn Backend>,
        g: &CacheGeometry,
        placement: Placement,
        layout: ScratchLayout,
        logical_pages: u64,
    ) -> Result<Self> {
        let bk = b.as_ref();
        let shard = u64::from(placement.shard());
        // A block never exceeds the prefix region's share of one owner.
        let block = (layout.prefix_pages() / shard).max(1);
        let staging = |pages: u64| Staging::new(bk, g, pages).map(Arc::new);
        Ok(Self {
            sends: (0..shard).map(|_| staging(block)).collect::<Result<_>>()?,
            scratch: (0..shard)
                .map(|_| staging(layout.pages()))
                .collect::<Result<_>>()?,
            table: ScratchTable::new(
                b.clone(),
                logical_pages,
                usize::try_from(layout.pages()).map_err(|_| Error::overflow("scratch pages"))?,
            )?,
            want: staging(layout.prefix_pages().max(1))?,
            got: staging(layout.prefix_pages().max(1))?,
            layout,
        })
    }
}

/// Bytes and device milliseconds of one kind of transfer, summed over a stage.
#[derive(Debug, Clone, Copy, Default)]
struct Moved {
    bytes: u64,
    ms: f64,
}

impl Moved {
    fn add(&mut self, bytes: u64, ms: f64) {
        self.bytes += bytes;
        self.ms += ms;
    }
}

impl std::fmt::Display for Moved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes in {:.2} ms ({:.1} GB/s)",
            self.bytes,
            self.ms,
            gbps(self.bytes, self.ms)
        )
    }
}

/// What one prefill moved: owned-row writes, and for gathered prefixes the pack, the emulated
/// all-gather and the page table; with the wall time of setup and verification apart.
#[derive(Debug, Default)]
struct PrefillReport {
    chunks: usize,
    writes: Moved,
    /// The packs and the emulated all-gathers together: they interleave layer by layer on one
    /// stream, so one pair of events times both.
    gather: Moved,
    packed: u64,
    gathered: u64,
    table_ms: f64,
    gathers: usize,
    evicted: Vec<String>,
    setup_ms: f64,
    verify_ms: f64,
}

/// Everything the pressure scenario keeps between its stages.
struct Pressure {
    b: Arc<dyn Backend>,
    g: CacheGeometry,
    placement: Placement,
    route: Route,
    limits: AdmissionLimits,
    ranks: Vec<Arc<DevicePool>>,
    reference: Arc<DevicePool>,
    staging: Arc<ChunkStaging>,
    writes: Vec<OwnedRowWrite>,
    alloc: ShardAllocator,
    ref_alloc: ShardAllocator,
    controllers: Vec<HiCacheController>,
    /// Cached nodes whose pages are on the device and unlocked, least recently used first:
    /// what the engine's eviction takes.
    evictable: VecDeque<CacheNode>,
    /// A page of poison every evicted page is overwritten with, so a page reused without its
    /// data being reloaded shows.
    poison: Arc<Staging>,
    gather: Option<GatherRig>,
    rng: StdRng,
}

impl Pressure {
    /// The grid of the scenario's device-to-device block copies: enough CTAs to fill an H200
    /// (copies between device buffers are bandwidth-bound, not bytes-in-flight-bound).
    fn launch(&self) -> Launch {
        Launch {
            ctas: 128,
            threads: self.b.max_threads(KernelFamily::Copy),
        }
    }

    /// Evicts least recently used nodes until the allocator admits `needed` tokens: every
    /// rank's controller drops the node (it is on the host), its pages are poisoned and freed.
    fn make_room(&mut self, needed: u64, report: &mut PrefillReport) -> Result<()> {
        let b = self.b.clone();
        let bk = b.as_ref();
        let launch = self.launch();
        let (controllers, evictable, ranks, poison, route) = (
            &mut self.controllers,
            &mut self.evictable,
            &self.ranks,
            &self.poison,
            self.route,
        );
        let placement = self.placement;
        evict_until_allocatable(&mut self.alloc, needed, |alloc| {
            let Some(node) = evictable.pop_front() else {
                return Ok(());
            };
            let compute = bk.record()?;
            for c in controllers.iter_mut() {
                c.evict(&node, &compute, route)?;
            }
            for pool in ranks {
                let pages = node.device_pages.clone();
                let plan = BlockCopyPlan::new(
                    poison.as_ref(),
                    PageSelection::Local(vec![LocalPage(0); pages.len()]),
                    pool.as_ref(),
                    PageSelection::Logical {
                        pages,
                        placement,
                        rank: pool.rank(),
                    },
                    node.device_pages.len(),
                )?;
                BlockCopy::prepare_sync(bk, plan, poison.clone(), pool.clone(), None)?
                    .run(bk, launch)?;
            }
            bk.synchronize()?;
            alloc.free(&node.device_pages)?;
            report.evicted.push(format!(
                "node {} ({} pages)",
                node.id,
                node.device_pages.len()
            ));
            Ok(())
        })?;
        Ok(())
    }

    /// Prefills tokens `from..to` of `chain` (and of `ref_chain` on the unsharded reference),
    /// chunk by chunk, each chunk admitted alone in a scheduling pass (evicting when the pool
    /// defers it); with `gather`, every chunk with a cached prefix first reads it through the
    /// gather plan.
    fn prefill(
        &mut self,
        chain: &mut RequestChain,
        ref_chain: &mut RequestChain,
        from: usize,
        to: usize,
        gather: bool,
    ) -> Result<PrefillReport> {
        let mut report = PrefillReport::default();
        let b = self.b.clone();
        let bk = b.as_ref();
        let mut done = from;
        while done < to {
            let setup = Instant::now();
            let extend = loop {
                let mut pass =
                    Admission::new(self.placement, self.limits, self.alloc.admission_capacity());
                let candidate = Candidate {
                    prefix_len: done as u64,
                    extend_len: (to - done) as u64,
                };
                match pass.offer(candidate)? {
                    Decision::Admit { extend_len, .. } => break extend_len as usize,
                    Decision::Defer(Deferral::Pool { needed, .. }) => {
                        self.make_room(needed, &mut report)?
                    }
                    Decision::Defer(other) => {
                        return Err(Error::InvalidArgument(format!(
                            "a lone request was deferred ({other})"
                        )))
                    }
                }
            };
            let end = done + extend;
            let prefix_pages = chain.pages().len();
            chain.grow_to(&mut self.alloc, end)?;
            ref_chain.grow_to(&mut self.ref_alloc, end)?;
            // The chunk's KV: random bytes in every layer of the staging.
            let random = synth::bytes(&mut self.rng, self.staging.buffer().len());
            bk.write_sync(self.staging.buffer(), 0, &random)?;
            report.setup_ms += setup.elapsed().as_secs_f64() * 1e3;
            if gather && prefix_pages > 0 {
                self.gather_prefix(chain, ref_chain, prefix_pages, &mut report)?;
            }
            let n = end - done;
            for (r, w) in self.writes.iter().enumerate() {
                let sharded = r < self.ranks.len();
                let setup = Instant::now();
                let slots = if sharded {
                    chain.slots(done..end)?
                } else {
                    ref_chain.slots(done..end)?
                };
                // Uploaded before the timed window, so it times the write alone. The slots
                // are the chains' own: a rejected one would fail the synchronize below.
                let raw: Vec<i64> = slots.iter().map(|s| s.0 as i64).collect();
                let device_slots = crate::backend::upload_i64s_sync(bk, &raw)?;
                report.setup_ms += setup.elapsed().as_secs_f64() * 1e3;
                let ms = timed(bk, || w.run(bk, &device_slots, n, w.launch(bk, n)))?;
                bk.synchronize()?;
                if sharded {
                    let owned = slots
                        .iter()
                        .filter(|&&s| self.placement.slot_owner(s) == r as u32)
                        .count();
                    report.writes.add(owned as u64 * w.row_bytes(), ms);
                }
            }
            report.chunks += 1;
            done = end;
        }
        Ok(report)
    }

    /// Reads the first `prefix_pages` pages of `chain` into every rank's scratch through a
    /// gather plan (pack, then the all-gather emulated by device copies, layer by layer), builds
    /// the page table with the kernel, and checks the scratch read through it against the
    /// reference's pages of `ref_chain`.
    fn gather_prefix(
        &mut self,
        chain: &RequestChain,
        ref_chain: &RequestChain,
        prefix_pages: usize,
        report: &mut PrefillReport,
    ) -> Result<()> {
        let launch = self.launch();
        let Some(rig) = self.gather.as_mut() else {
            return Ok(());
        };
        let b = self.b.clone();
        let bk = b.as_ref();
        let setup = Instant::now();
        let request = GatherRequest::of_chain(chain, prefix_pages)?;
        let logical = self
            .alloc
            .placement()
            .logical_pages(self.alloc.pages_per_rank())?;
        let plan = GatherPlan::new(self.placement, rig.layout, logical, &[request])?;
        let packs = self
            .ranks
            .iter()
            .zip(&rig.sends)
            .map(|(pool, send)| {
                let p = plan.pack_plan(pool, send, |_| true)?;
                BlockCopy::prepare_sync(bk, p, pool.clone(), send.clone(), None)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut landings = Vec::new();
        for scratch in &rig.scratch {
            for (owner, send) in rig.sends.iter().enumerate() {
                let p = plan.landing_plan(owner as u32, send, scratch)?;
                landings.push(BlockCopy::prepare_sync(
                    bk,
                    p,
                    send.clone(),
                    scratch.clone(),
                    None,
                )?);
            }
        }
        report.setup_ms += setup.elapsed().as_secs_f64() * 1e3;

        let table_ms = timed(bk, || rig.table.build(&plan))?;
        let ms = timed(bk, || {
            for m in (0..self.g.model_layers()).map(ModelLayer) {
                for copy in &packs {
                    copy.run_layer(bk, m, launch)?;
                }
                for copy in &landings {
                    copy.run_layer(bk, m, launch)?;
                }
            }
            Ok(())
        })?;
        let packed: u64 = packs.iter().map(BlockCopy::bytes).sum();
        let gathered: u64 = landings.iter().map(BlockCopy::bytes).sum();
        bk.synchronize()?;
        report.gather.add(packed + gathered, ms);
        report.packed += packed;
        report.gathered += gathered;
        report.table_ms += table_ms;
        report.gathers += 1;

        let verify = Instant::now();
        let table = crate::backend::i64s_from_bytes(&bk.read_sync(
            rig.table.table(),
            0,
            crate::error::to_usize(logical.saturating_mul(8), || "table bytes".into())?,
        )?);
        let prefix = &chain.pages()[..prefix_pages];
        let mut scratch_pages = Vec::with_capacity(prefix_pages);
        for page in prefix {
            let s = usize::try_from(page.0)
                .ok()
                .and_then(|p| table.get(p))
                .copied()
                .ok_or_else(|| Error::overflow(format!("{page} in the page table")))?;
            scratch_pages.push(LocalPage(s as u64));
        }
        let ref_pages: Vec<LocalPage> = ref_chain.pages()[..prefix_pages]
            .iter()
            .map(|p| LocalPage(p.0))
            .collect();
        let want = read_in_order(bk, self.reference.clone(), ref_pages, &rig.want, launch)?;
        for (r, scratch) in rig.scratch.iter().enumerate() {
            let got = read_in_order(bk, scratch.clone(), scratch_pages.clone(), &rig.got, launch)?;
            if got != want {
                return Err(Error::Verification(format!(
                    "rank {r}'s scratch read through the page table differs from the reference's {prefix_pages} prefix pages"
                )));
            }
        }
        report.verify_ms += verify.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }
}

/// Copies pages `pages` of `src` into `dst` (entry `j` to page `j`, the rest poisoned) and reads
/// `dst` back whole.
fn read_in_order(
    b: &dyn Backend,
    src: Arc<dyn BlockSpace>,
    pages: Vec<LocalPage>,
    dst: &Arc<Staging>,
    launch: Launch,
) -> Result<Vec<u8>> {
    b.fill(dst.buffer(), POISON)?;
    let n = pages.len();
    let plan = BlockCopyPlan::new(
        src.as_ref(),
        PageSelection::Local(pages),
        dst.as_ref(),
        PageSelection::Positions,
        n,
    )?;
    BlockCopy::prepare_sync(b, plan, src, dst.clone(), None)?.run(b, launch)?;
    b.read_sync(dst.buffer(), 0, dst.buffer().len())
}

impl Pressure {
    /// Backs `node` up on every rank (write-through on its first access) and awaits the acks.
    fn backup(&mut self, node: &CacheNode) -> Result<Moved> {
        let b = self.b.clone();
        let route = self.route;
        let ms = on_all_ranks(
            b.as_ref(),
            &mut self.controllers,
            |s| &s.backup,
            &mut |c, start| c.access(node, start, route).map(|_| ()),
        )?;
        let mut moved = Moved::default();
        for c in &mut self.controllers {
            moved.bytes += c.ack_backups(1)?.iter().map(|a| a.bytes).sum::<u64>();
        }
        moved.ms = ms;
        Ok(moved)
    }

    /// Loads backed-up node `node` into device pages `pages` on every rank.
    fn load(&mut self, node: u64, pages: &[LogicalPage]) -> Result<Moved> {
        let b = self.b.clone();
        let bk = b.as_ref();
        let route = self.route;
        let ms = on_all_ranks(bk, &mut self.controllers, |s| &s.load, &mut |c, start| {
            c.load(node, pages, Some(start), route)?
                .wait_layer(bk, ModelLayer(0))
        })?;
        let mut moved = Moved::default();
        for c in &mut self.controllers {
            moved.bytes += c.ack_loads(1)?.iter().map(|a| a.bytes).sum::<u64>();
        }
        moved.ms = ms;
        Ok(moved)
    }

    /// Sends `chain` P/D from every rank and `ref_chain` from the reference, each into a decode
    /// pool of its own, and checks the two are byte-identical; returns what the ranks sent and
    /// the milliseconds verification took.
    fn send_and_check(
        &self,
        chain: &RequestChain,
        ref_chain: &RequestChain,
        tokens: usize,
        chunk: usize,
    ) -> Result<(Moved, f64)> {
        let bk = self.b.as_ref();
        let shape = SendShape {
            geometry: &self.g,
            tokens,
            chunk,
        };
        let (decode, decode_space) = decode_pool(bk, &self.g, tokens)?;
        let (expected, expected_space) = decode_pool(bk, &self.g, tokens)?;
        let (bytes, ms) = send_all(&self.b, &self.ranks, chain, &decode_space, &shape)?;
        send_all(
            &self.b,
            std::slice::from_ref(&self.reference),
            ref_chain,
            &expected_space,
            &shape,
        )?;
        let check = Instant::now();
        if decode.snapshot_sync(bk)? != expected.snapshot_sync(bk)? {
            return Err(Error::Verification(
                "the decode pool differs from what the unsharded reference sends".into(),
            ));
        }
        Ok((Moved { bytes, ms }, check.elapsed().as_secs_f64() * 1e3))
    }
}

fn evicted(report: &PrefillReport) -> String {
    if report.evicted.is_empty() {
        "evicting nothing".into()
    } else {
        format!("evicting {}", report.evicted.join(", "))
    }
}

/// Runs the pressure scenario ([`PressureConfig`]) on `b`, making further streams of the same
/// device with `streams`, with the HiCache route `route`. Every stage reports its transfers'
/// time measured with events on the device and their GB/s; setup and verification apart.
pub fn run_pressure(
    b: Arc<dyn Backend>,
    streams: StreamFactory<'_>,
    cfg: &PressureConfig,
    route: Route,
) -> Result<Summary> {
    let mut out = Summary::default();
    let per_rank = cfg.pages_per_rank()?;
    let bk = b.as_ref();
    let g = cfg.geometry();
    let placement = Placement::new(cfg.ranks)?;
    let unsharded = Placement::unsharded();
    let host_pages = per_rank.mul_or(cfg.host_factor, || "host pages".into())?;
    out.say(format!(
        "kvshard demo (pressure) on the {} backend: CP{}, {} logical slots ({} pages per rank), two {}-token prompts ({} tokens together), a seeded prefix of {} tokens, host pools {}x larger ({} pages per rank); {} layers{}, {} B per page, chunks of {}",
        bk.name(),
        cfg.ranks,
        cfg.logical_slots,
        per_rank,
        cfg.prompt_tokens,
        2 * cfg.prompt_tokens,
        cfg.prefix_tokens,
        cfg.host_factor,
        host_pages,
        cfg.layers,
        if cfg.draft { " + MTP draft" } else { "" },
        g.page_bytes(),
        cfg.chunk
    ));

    let setup = Instant::now();
    let ranks: Vec<Arc<DevicePool>> = (0..cfg.ranks)
        .map(|r| DevicePool::allocate(bk, &g, placement, r, per_rank).map(Arc::new))
        .collect::<Result<_>>()?;
    for pool in &ranks {
        pool.fill(bk, POISON)?;
    }
    // The reference never evicts: room for the prefix and both prompts.
    let ref_pages = (cfg.prefix_tokens + 2 * cfg.prompt_tokens).div_ceil(PAGE_SIZE) as u64 + 2;
    let reference = Arc::new(DevicePool::allocate(bk, &g, unsharded, 0, ref_pages)?);
    let staging = Arc::new(ChunkStaging::new(bk, &reference, cfg.chunk)?);
    let writes = ranks
        .iter()
        .chain(std::iter::once(&reference))
        .map(|p| OwnedRowWrite::prepare_sync(bk, staging.clone(), p.clone(), |_| true))
        .collect::<Result<_>>()?;
    let controllers = write_through_controllers(bk, &g, &ranks, host_pages, streams)?;
    // One request per batch here: the scratch holds one context's prefix (C = 1).
    let mut budget = BudgetRequest::new(u64::MAX, cfg.prompt_tokens as u64, cfg.chunk as u64);
    budget.contexts = 1;
    let (_, max_prefix) = Budget::scratch(&budget, cfg.ranks)?;
    let chunk_tokens = cfg.chunk as u64;
    let (limits, gather) = if cfg.ranks > 1 {
        let layout = ScratchLayout::new(max_prefix, chunk_tokens)?;
        let logical = placement.logical_pages(per_rank)?;
        let limits = AdmissionLimits {
            max_prefix_tokens: max_prefix,
            chunk_tokens,
        };
        (
            limits,
            Some(GatherRig::new(&b, &g, placement, layout, logical)?),
        )
    } else {
        // Unsharded attention reads the pool itself: no scratch, no gather.
        let limits = AdmissionLimits {
            max_prefix_tokens: u64::MAX,
            chunk_tokens,
        };
        (limits, None)
    };
    let poison = Arc::new(Staging::new(bk, &g, 1)?);
    bk.fill(poison.buffer(), POISON)?;
    let scratch_note = match &gather {
        Some(rig) => format!(
            ", scratch slots of {} pages (prefix region {} pages)",
            rig.layout.pages(),
            rig.layout.prefix_pages()
        ),
        None => ", no scratch (unsharded)".into(),
    };
    let mut s = Pressure {
        b: b.clone(),
        g: g.clone(),
        placement,
        route,
        limits,
        ranks,
        reference,
        staging,
        writes,
        alloc: ShardAllocator::new(placement, per_rank)?,
        ref_alloc: ShardAllocator::new(unsharded, ref_pages)?,
        controllers,
        evictable: VecDeque::new(),
        poison,
        gather,
        rng: StdRng::seed_from_u64(cfg.seed),
    };
    out.say(format!(
        "setup: device pools, the reference, host pools, staging{scratch_note}: {:.1} ms",
        setup.elapsed().as_secs_f64() * 1e3
    ));

    // 1. The seeded prefix, written through to the host, its backup awaited.
    let mut seed = RequestChain::new(placement);
    let mut seed_ref = RequestChain::new(unsharded);
    let r = s.prefill(&mut seed, &mut seed_ref, 0, cfg.prefix_tokens, false)?;
    let seed_node = seed.cache_node(1, 0..seed.pages().len())?;
    let backup = s.backup(&seed_node)?;
    s.evictable.push_back(seed_node.clone());
    out.say(format!(
        "seed: {} tokens in {} chunks, owned-row writes {}; written through to the host, backup awaited: {backup} (setup {:.1} ms)",
        cfg.prefix_tokens, r.chunks, r.writes, r.setup_ms
    ));

    // 2. Prompt 1: a prompt of its own; the pool makes room by evicting the prefix.
    let mut p1 = RequestChain::new(placement);
    let mut p1_ref = RequestChain::new(unsharded);
    let r = s.prefill(&mut p1, &mut p1_ref, 0, cfg.prompt_tokens, false)?;
    if r.evicted.is_empty() {
        return Err(Error::Verification(
            "prompt 1 evicted nothing: there was no pressure".into(),
        ));
    }
    let (sent, verify_ms) = s.send_and_check(&p1, &p1_ref, cfg.prompt_tokens, cfg.chunk)?;
    let p1_node = p1.cache_node(2, 0..p1.pages().len())?;
    let backup = s.backup(&p1_node)?;
    s.evictable.push_back(p1_node);
    out.say(format!(
        "prompt 1: {} tokens in {} chunks, {}; owned-row writes {}; P/D sent {sent}, decode pool byte-identical to the unsharded reference (verified in {verify_ms:.1} ms); backup {backup} (setup {:.1} ms)",
        cfg.prompt_tokens,
        r.chunks,
        evicted(&r),
        r.writes,
        r.setup_ms
    ));

    // 3. Prompt 2: the seeded prefix, now on the host only, then new tokens. Reloading the
    // prefix needs room: prompt 1 goes.
    let mut room = PrefillReport::default();
    let stride = u64::from(cfg.ranks) * PAGE_SIZE as u64;
    s.make_room(cfg.prefix_tokens as u64 + stride, &mut room)?;
    let pages = s.alloc.alloc_matching(&seed_node.device_pages)?;
    let load = s.load(seed_node.id, &pages)?;
    if load.bytes == 0 {
        return Err(Error::Verification(
            "the prefix was not reloaded from the host: H2D did not grow".into(),
        ));
    }
    let start_owner = seed.start_owner().unwrap_or(0);
    let mut p2 = RequestChain::cached(placement, start_owner, pages.clone())?;
    let mut p2_ref = RequestChain::cached(unsharded, 0, seed_ref.pages().to_vec())?;
    let r = s.prefill(
        &mut p2,
        &mut p2_ref,
        cfg.prefix_tokens,
        cfg.prompt_tokens,
        true,
    )?;
    let (sent, pd_verify_ms) = s.send_and_check(&p2, &p2_ref, cfg.prompt_tokens, cfg.chunk)?;
    let p2_node = p2.cache_node(3, seed.pages().len()..p2.pages().len())?;
    let backup = s.backup(&p2_node)?;
    s.evictable.push_back(CacheNode {
        device_pages: pages,
        ..seed_node
    });
    s.evictable.push_back(p2_node);
    out.say(format!(
        "prompt 2: the seeded prefix matched on the host only; making room {}; reloaded H2D into new pages of the same owners: {load}",
        evicted(&room)
    ));
    out.say(format!(
        "prompt 2: H2D grew from 0 to {} bytes; {} new tokens in {} chunks, owned-row writes {}",
        load.bytes,
        cfg.prompt_tokens - cfg.prefix_tokens,
        r.chunks,
        r.writes
    ));
    if s.gather.is_some() {
        let layers = g.model_layers();
        out.say(format!(
            "prompt 2: before each of {} chunks its prefix was gathered layer by layer ({layers} layers): every rank packed its send list ({} bytes) and device copies landed the send buffers in every rank's scratch, owner-major ({} bytes, the all-gather emulated on one device): {}, {:.3} ms per layer; page tables built by kvs_scratch_table in {:.2} ms; every rank's scratch read through the page table equals the reference's prefix pages (verified in {:.1} ms; setup {:.1} ms)",
            r.gathers,
            r.packed,
            r.gathered,
            r.gather,
            r.gather.ms / (r.gathers.max(1) * layers.max(1)) as f64,
            r.table_ms,
            r.verify_ms,
            r.setup_ms
        ));
    }
    out.say(format!(
        "prompt 2: P/D sent {sent}, decode pool byte-identical to the unsharded reference (verified in {pd_verify_ms:.1} ms); backup of its new pages {backup}"
    ));
    out.say("pressure demo: every check passed".into());
    Ok(out)
}
