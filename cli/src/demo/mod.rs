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
//! GB/s ([`crate::measure`]), apart from the setup and the verification around them.
//!
//! [`PressureConfig`]: crate::scenario::PressureConfig

pub mod pressure;

use std::sync::Arc;
use std::time::Instant;

use kvshard::backend::{Backend, Event, MemoryKind};
use kvshard::chain::RequestChain;
use kvshard::copy::{BlockSpace, RemoteSpace};
use kvshard::geometry::{CacheGeometry, Component, IndexerScale, LatentLayout, PAGE_SIZE};
use kvshard::hicache::{
    CacheNode, HiCacheController, HostLayout, HostPool, Route, Streams, WritePolicy,
};
use kvshard::index::{ModelLayer, Slot, StoredLayer};
use kvshard::pool::{ChunkStaging, DevicePool, OwnedRowWrite};
use kvshard::quantize::{
    quantize_indexer_checked_sync, quantize_latent_checked_sync, INDEXER_INPUT_ROW_BYTES,
    LATENT_INPUT_ROW_BYTES,
};
use kvshard::shard::{Placement, ShardAllocator};
use kvshard::transfer::{BackendTransport, ChunkEnd, PoolLayout, Receiver, Registration, Sender};
use kvshard::{Error, Result};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::measure::{time_forked_sync, time_sync, Moved};
use crate::scenario::{Platform, Shape};
use crate::synth::{self, POISON};

pub use pressure::run_pressure;

/// What the demo runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The cache and the CP group.
    pub shape: Shape,
    /// Request length in tokens.
    pub tokens: usize,
    /// Prefill chunk size in tokens (a multiple of 64).
    pub chunk: usize,
}

impl Config {
    /// The default for a platform: CP4 and the production shape on a GPU, a small one on the
    /// CPU twin.
    pub fn default_for(platform: Platform) -> Self {
        let gpu = platform.is_gpu();
        Self {
            shape: Shape {
                ranks: 4,
                layers: if gpu { 61 } else { 4 },
                draft: true,
                seed: 7,
            },
            tokens: if gpu { 16_000 } else { 1000 },
            chunk: if gpu { 4096 } else { 256 },
        }
    }

    /// Checks the run before anything is allocated: the shape's bounds, and a request of whole
    /// chunks of whole pages.
    pub fn check(&self) -> Result<()> {
        self.shape.check()?;
        if self.chunk == 0 || self.chunk % PAGE_SIZE != 0 || self.tokens == 0 {
            return Err(Error::InvalidArgument(format!(
                "chunks of {} tokens (a non-zero multiple of 64) for {} tokens",
                self.chunk, self.tokens
            )));
        }
        Ok(())
    }

    /// Physical pages each prefill rank's pool and host pool hold.
    pub fn pages_per_rank(&self) -> u64 {
        (self
            .tokens
            .div_ceil(PAGE_SIZE)
            .div_ceil(self.shape.ranks.max(1) as usize)
            + 2) as u64
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

/// The shape of a P/D send: the cache's geometry, the request's tokens, the chunk size.
pub(crate) struct SendShape<'a> {
    pub(crate) geometry: &'a CacheGeometry,
    pub(crate) tokens: usize,
    pub(crate) chunk: usize,
}

/// Runs `work` on every rank's controller, every controller's `stream` starting after an event
/// of `b`, which waits for all of them after: the elapsed time (events on the device) covers
/// every rank's transfer, the ranks running concurrently.
pub(crate) fn on_all_ranks(
    b: &dyn Backend,
    controllers: &mut [HiCacheController],
    stream: fn(&Streams) -> &Arc<dyn Backend>,
    work: &mut dyn FnMut(&mut HiCacheController, &Event) -> Result<()>,
) -> Result<f64> {
    time_forked_sync(b, |start| {
        controllers
            .iter_mut()
            .map(|c| {
                work(c, start)?;
                stream(c.streams()).record()
            })
            .collect()
    })
}

/// Sends the whole request from every pool of `pools` (each with chain `chain`) into `decode`,
/// on `b`; returns what the transfers moved, timed on `b`'s stream.
pub(crate) fn send_all(
    b: &Arc<dyn Backend>,
    pools: &[Arc<DevicePool>],
    chain: &RequestChain,
    decode: &Arc<RemoteSpace>,
    shape: &SendShape<'_>,
) -> Result<Moved> {
    let g = shape.geometry.clone();
    let mut decode_alloc = ShardAllocator::new(Placement::unsharded(), decode.pages())?;
    let mut decode_chain = RequestChain::new(Placement::unsharded());
    decode_chain.grow_to(&mut decode_alloc, shape.tokens)?;
    let reg = Registration::of_chain(&decode_chain, 1, PoolLayout::packed(g, decode.pages()), 0)?;
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), pools.len() as u32)?;
    let mut senders: Vec<Sender> = pools
        .iter()
        .map(|p| Sender::new(p.clone(), Box::new(BackendTransport::new(b.clone()))))
        .collect();
    for s in &mut senders {
        s.open(reg.clone(), decode.clone())?;
    }
    // Every chunk is enqueued inside the timed stretch, and only then are the chunks' statuses
    // awaited (the events of the timing cover the sends: they run on `b`).
    let mut pending = Vec::new();
    let ms = time_sync(b.as_ref(), || {
        let mut end = 0;
        while end < shape.tokens {
            end = (end + shape.chunk).min(shape.tokens);
            let last = end == shape.tokens;
            for s in &mut senders {
                let at = if last {
                    ChunkEnd::Final(end)
                } else {
                    ChunkEnd::Partial(end)
                };
                pending.push(s.send(reg.request, chain.pages()?, at)?);
            }
        }
        Ok(())
    })?;
    let mut finished = None;
    for p in pending {
        if let Some(f) = receiver.receive(p.wait_sync()?)? {
            finished = Some(f);
        }
    }
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
    Ok(Moved {
        bytes: f.total_bytes().total(),
        ms,
    })
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
/// `host_pages` pages and its own streams; for a staged `route`, its staging made up front, as
/// an engine makes it at startup (so no timed backup or load allocates it).
pub(crate) fn write_through_controllers(
    bk: &dyn Backend,
    g: &CacheGeometry,
    ranks: &[Arc<DevicePool>],
    host_pages: u64,
    streams: StreamFactory<'_>,
    route: Route,
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
            let s = Streams::each(streams)?;
            let mut c = HiCacheController::new(pool.clone(), host, s, WritePolicy::WriteThrough)?;
            if matches!(route, Route::Staged(_)) {
                c.prepare_staging()?;
            }
            Ok(c)
        })
        .collect()
}

/// Sends `ranks`' chain P/D to a fresh unsharded decode pool and the unsharded `reference`'s
/// to another, and checks the two byte for byte: what the ranks moved, the decode pool's
/// bytes, and the milliseconds the check took.
fn send_checked(
    b: &Arc<dyn Backend>,
    ranks: (&[Arc<DevicePool>], &RequestChain),
    reference: (&Arc<DevicePool>, &RequestChain),
    shape: &SendShape<'_>,
) -> Result<(Moved, Vec<u8>, f64)> {
    let bk = b.as_ref();
    let (decode, decode_space) = decode_pool(bk, shape.geometry, shape.tokens)?;
    let (expected, expected_space) = decode_pool(bk, shape.geometry, shape.tokens)?;
    let sent = send_all(b, ranks.0, ranks.1, &decode_space, shape)?;
    send_all(
        b,
        std::slice::from_ref(reference.0),
        reference.1,
        &expected_space,
        shape,
    )?;
    let check = Instant::now();
    let want = expected.snapshot_sync(bk)?;
    if decode.snapshot_sync(bk)? != want {
        return Err(Error::Verification(
            "the decode pool differs from what the unsharded reference sends".into(),
        ));
    }
    Ok((sent, want, check.elapsed().as_secs_f64() * 1e3))
}

/// A forward pass's output for a chunk of `n` tokens in `staging`: random bytes in every
/// layer, FP8-quantized random rows in layer 0.
fn forward_pass(
    bk: &dyn Backend,
    rng: &mut StdRng,
    staging: &ChunkStaging,
    n: usize,
) -> Result<()> {
    bk.write_sync(
        staging.buffer(),
        0,
        &synth::bytes(rng, staging.buffer().len()),
    )?;
    let rows: Vec<i64> = (0..n as i64).collect();
    let latent_in = bk.alloc(n * LATENT_INPUT_ROW_BYTES, MemoryKind::Device)?;
    bk.write_sync(
        &latent_in,
        0,
        &synth::bf16_bytes(rng, n * LATENT_INPUT_ROW_BYTES / 2),
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
        &synth::bf16_bytes(rng, n * INDEXER_INPUT_ROW_BYTES / 2),
    )?;
    quantize_indexer_checked_sync(
        bk,
        IndexerScale::Ue8m0,
        &keys_in,
        &rows,
        &staging.layer(Component::TargetIndexer, StoredLayer(0))?,
    )?;
    Ok(())
}

/// Backs `chain`'s pages up on every rank (write-through), evicts them (the pools poisoned),
/// and reloads them into new pages of the same owners: the reloaded chain, and what the
/// backups and the loads moved.
fn hicache_round_trip(
    bk: &dyn Backend,
    mut controllers: Vec<HiCacheController>,
    ranks: &[Arc<DevicePool>],
    chain: &mut RequestChain,
    alloc: &mut ShardAllocator,
    route: Route,
) -> Result<(RequestChain, Moved, Moved)> {
    let node = CacheNode::of_chain(chain, 1, 0..chain.page_count())?;
    let ms = on_all_ranks(bk, &mut controllers, |s| &s.backup, &mut |c, start| {
        c.access(&node, start, route).map(|_| ())
    })?;
    let mut backed_up = Moved { bytes: 0, ms };
    for c in &mut controllers {
        backed_up.bytes += c.ack_backups_sync(1)?.iter().map(|a| a.bytes).sum::<u64>();
    }
    let compute = bk.record()?;
    for (c, pool) in controllers.iter_mut().zip(ranks) {
        c.evict_sync(&node, &compute, route)?;
        pool.fill(bk, POISON)?;
    }
    chain.free(alloc)?;
    let pages = alloc.alloc_matching(&node.device_pages)?;
    let reloaded = RequestChain::cached(alloc, chain.start_owner().unwrap_or(0), pages)?;
    let ms = on_all_ranks(bk, &mut controllers, |s| &s.load, &mut |c, start| {
        let handle = c.load(node.id, reloaded.pages()?, Some(start), route)?;
        handle.wait_layer(bk, ModelLayer(0))
    })?;
    let mut loaded = Moved { bytes: 0, ms };
    for c in &mut controllers {
        loaded.bytes += c.ack_loads_sync(1)?.iter().map(|a| a.bytes).sum::<u64>();
    }
    Ok((reloaded, backed_up, loaded))
}

/// Each rank's owned-row write of the chunk at `slots` (the last write, the unsharded
/// reference's, at `slots.1`), each waited for and timed; what the ranks moved is added to
/// `moved`.
fn write_owned(
    bk: &dyn Backend,
    writes: &[OwnedRowWrite],
    placement: Placement,
    slots: (&[Slot], &[Slot]),
    moved: &mut Moved,
) -> Result<()> {
    let ranks = writes.len() - 1;
    for (r, w) in writes.iter().enumerate() {
        let sharded = r < ranks;
        let slots = if sharded { slots.0 } else { slots.1 };
        let ms = time_sync(bk, || {
            w.run_checked_sync(bk, slots, w.launch(bk, slots.len()))
        })?;
        if sharded {
            let owned = slots
                .iter()
                .filter(|&&s| placement.slot_owner(s) == r as u32)
                .count();
            moved.add(owned as u64 * w.row_bytes(), ms);
        }
    }
    Ok(())
}

/// Runs the demo on `b`, making further streams of the same device with `streams`, and with
/// the HiCache route `route`: the steps of the module docs, each checking the bytes it hands on.
pub fn run(
    b: Arc<dyn Backend>,
    streams: StreamFactory<'_>,
    cfg: &Config,
    route: Route,
) -> Result<Summary> {
    let mut out = Summary::default();
    cfg.check()?;
    let mut prefilled = prefill(b.as_ref(), cfg, &mut out)?;
    let decoded = pd(&b, cfg, &prefilled, &mut out)?;
    hicache(&b, streams, cfg, route, &mut prefilled, &decoded, &mut out)?;
    out.say("demo: every check passed".into());
    Ok(out)
}

/// What the prefill leaves: the ranks' pools and the unsharded reference, the ranks' allocator,
/// and the request's chain in each.
struct Prefilled {
    ranks: Vec<Arc<DevicePool>>,
    reference: Arc<DevicePool>,
    alloc: ShardAllocator,
    chain: RequestChain,
    ref_chain: RequestChain,
}

/// 1 + 2: says what runs, allocates the ranks' pools and the reference, and prefills the
/// request chunk by chunk: each chunk's forward pass into the staging, then every rank's
/// owned-row write and the reference's.
fn prefill(bk: &dyn Backend, cfg: &Config, out: &mut Summary) -> Result<Prefilled> {
    let mut rng = StdRng::seed_from_u64(cfg.shape.seed);
    let g = cfg.shape.geometry();
    let placement = cfg.shape.placement()?;
    let pages = cfg.tokens.div_ceil(PAGE_SIZE);
    let per_rank = cfg.pages_per_rank();
    out.say(format!(
        "kvshard demo on the {} backend: {} tokens, chunks of {}, {} ({} indexer layers, {} B per page)",
        bk.name(),
        cfg.tokens,
        cfg.chunk,
        cfg.shape,
        g.target.num_indexer_layers(),
        g.page_bytes()
    ));

    let setup = Instant::now();
    let ranks: Vec<Arc<DevicePool>> = (0..cfg.shape.ranks)
        .map(|r| DevicePool::allocate(bk, &g, placement, r, per_rank).map(Arc::new))
        .collect::<Result<_>>()?;
    let reference = Arc::new(DevicePool::allocate(
        bk,
        &g,
        Placement::unsharded(),
        0,
        pages as u64 + 2,
    )?);
    // Poisoned like the decode pools: P/D sends a request's last page whole, rows past its
    // last token included, so those rows must hold the same bytes in every rank's pool and
    // the reference (memory reused from an earlier run holds anything).
    for pool in ranks.iter().chain(std::iter::once(&reference)) {
        pool.fill(bk, POISON)?;
    }
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
    let mut writes_moved = Moved::default();
    let mut begin = 0;
    while begin < cfg.tokens {
        let end = (begin + cfg.chunk).min(cfg.tokens);
        let n = end - begin;
        chain.grow_to(&mut alloc, end)?;
        ref_chain.grow_to(&mut ref_alloc, end)?;
        forward_pass(bk, &mut rng, &staging, n)?;
        let slots = chain.slots(begin..end)?;
        let ref_slots = ref_chain.slots(begin..end)?;
        write_owned(
            bk,
            &writes,
            placement,
            (&slots, &ref_slots),
            &mut writes_moved,
        )?;
        begin = end;
    }
    let owners: Vec<u32> = chain.pages()?.iter().map(|&p| placement.owner(p)).collect();
    out.say(format!(
        "prefill: {} pages, start owner {}, owners {:?}{}; owned-row writes moved {writes_moved}; setup {:.1} ms",
        chain.page_count(),
        chain.start_owner().unwrap_or(0),
        &owners[..owners.len().min(12)],
        if owners.len() > 12 { " ..." } else { "" },
        setup_ms
    ));
    Ok(Prefilled {
        ranks,
        reference,
        alloc,
        chain,
        ref_chain,
    })
}

/// 3: P/D to an unsharded decode pool, checked against what the unsharded reference sends;
/// returns the decode pool's bytes.
fn pd(b: &Arc<dyn Backend>, cfg: &Config, p: &Prefilled, out: &mut Summary) -> Result<Vec<u8>> {
    let g = cfg.shape.geometry();
    let shape = SendShape {
        geometry: &g,
        tokens: cfg.tokens,
        chunk: cfg.chunk,
    };
    let (sent, want, check_ms) = send_checked(
        b,
        (&p.ranks, &p.chain),
        (&p.reference, &p.ref_chain),
        &shape,
    )?;
    out.say(format!(
        "P/D: {} ranks sent {sent}; decode pool byte-identical to the unsharded reference (verified in {:.1} ms)",
        cfg.shape.ranks,
        check_ms
    ));
    Ok(want)
}

/// 4: HiCache: every rank's write-through backups, the pages evicted (poisoned), reloaded into
/// new pages of the same owners and resent: the decode pool must equal `want` again.
fn hicache(
    b: &Arc<dyn Backend>,
    streams: StreamFactory<'_>,
    cfg: &Config,
    route: Route,
    p: &mut Prefilled,
    want: &[u8],
    out: &mut Summary,
) -> Result<()> {
    let bk = b.as_ref();
    let g = cfg.shape.geometry();
    let shape = SendShape {
        geometry: &g,
        tokens: cfg.tokens,
        chunk: cfg.chunk,
    };
    let controllers =
        write_through_controllers(bk, &g, &p.ranks, cfg.pages_per_rank(), streams, route)?;
    let (reloaded, backed_up, loaded) =
        hicache_round_trip(bk, controllers, &p.ranks, &mut p.chain, &mut p.alloc, route)?;
    let (again, again_space) = decode_pool(bk, &g, cfg.tokens)?;
    send_all(b, &p.ranks, &reloaded, &again_space, &shape)?;
    if again.snapshot_sync(bk)? != want {
        return Err(Error::HiCache(
            "after backup, eviction and reload the decode pool differs from the reference".into(),
        ));
    }
    out.say(format!(
        "HiCache ({route}): {} pages backed up by every rank, {backed_up}, evicted, reloaded into new pages of the same owners, {loaded}; resent decode pool byte-identical",
        p.chain.page_count(),
    ));
    Ok(())
}
