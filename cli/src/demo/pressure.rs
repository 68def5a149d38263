//! The seed's accuracy scenario under memory pressure, for one process or many.
//!
//! `kvshard demo --scenario pressure` holds every CP rank in one process ([`run_pressure`]);
//! `kvshard pd --scenario pressure` runs each rank and each decode in a process of its own, and
//! every one of them drives this same scenario (`run_scenario`) with what it holds: its
//! `Local` ranks (all, one, or none for a decode), how their send buffers reach the other
//! ranks (`AllGather`) and what happens to each prefilled chunk and prompt (`Prompts`).
//! Every process keeps the unsharded reference and the group's allocator (both deterministic),
//! so every process makes the same admissions and evictions, and the synthetic KV of a chunk is
//! a function of the seed, the cache node and the chunk's first token, the same everywhere.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use kvshard::backend::{i64s_from_bytes, upload_i64s_sync, Backend, Buffer, KernelFamily, Launch};
use kvshard::chain::RequestChain;
use kvshard::copy::{BlockCopy, BlockCopyPlan, BlockSpace, PageSelection, ScratchTable, Staging};
use kvshard::geometry::{CacheGeometry, PAGE_SIZE};
use kvshard::hicache::{CacheNode, HiCacheController, Route};
use kvshard::index::{LocalPage, LogicalPage, ModelLayer, Slot, StoredLayer};
use kvshard::ipc::group::GroupMemory;
use kvshard::pool::{ChunkStaging, DevicePool, OwnedRowWrite};
use kvshard::shard::{
    evict_until_allocatable, Admission, AdmissionLimits, Candidate, Decision, Deferral, GatherPlan,
    GatherRequest, Placement, ScratchLayout, ShardAllocator,
};
use kvshard::transfer::ChunkEnd;
use kvshard::{Error, Result};

use super::{
    decode_pool, on_all_ranks, send_all, write_through_controllers, SendShape, StreamFactory,
    Summary,
};
use crate::measure::{time_sync, timed_waits, Moved};
use crate::overflow;
use crate::scenario::PressureConfig;
use crate::synth::{self, POISON};

#[cfg(feature = "nixl")]
pub(crate) mod storage;

/// The cache node of the seeded prefix.
pub const SEED_NODE: u64 = 1;
/// Prompt 1's cache node, and its P/D request id.
pub const PROMPT_1: u64 = 2;
/// Prompt 2's cache node, and its P/D request id.
pub const PROMPT_2: u64 = 3;

/// How the ranks' packed send buffers reach every rank's attention scratch.
pub(crate) enum AllGather {
    /// Every rank is in this process: device copies land each owner's send buffer in every
    /// rank's scratch (on one device, the all-gather emulated).
    InProcess,
    /// One rank per process, the processes sharing this group memory: a rank's packed send
    /// buffer goes through its slot in host shared memory, and every rank copies the others'
    /// to its device and lands them as the in-process copies do. The CPU twin's all-gather, and
    /// the one for ranks that share a GPU (which NCCL refuses).
    HostStaged(GroupMemory),
    /// NCCL between ranks on distinct GPUs: per layer, the pack and one `ncclAllGather` per
    /// component land every rank's block straight in every scratch.
    #[cfg(feature = "nccl")]
    Nccl {
        /// This rank's communicator.
        group: kvshard::nccl::NcclGroup,
        /// The scenario's backend, as NCCL needs it (its stream).
        cuda: Arc<kvshard::backend::cuda::CudaBackend>,
    },
}

impl AllGather {
    /// How the report names it.
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            AllGather::InProcess => "the all-gather emulated by device copies in one process",
            AllGather::HostStaged(_) => {
                "the all-gather staged through host shared memory between the rank processes"
            }
            #[cfg(feature = "nccl")]
            AllGather::Nccl { .. } => "the all-gather over NCCL between the rank processes",
        }
    }
}

impl std::fmt::Debug for AllGather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

/// What one process of the scenario holds.
#[derive(Debug)]
pub(crate) struct Local {
    /// The CP ranks' pools that live here, [`PressureConfig::pages_per_rank`] pages each on the
    /// scenario's backend: every rank (the demo), one (a rank process) or none (a decode).
    pub(crate) pools: Vec<Arc<DevicePool>>,
    /// How their send buffers reach the other ranks.
    pub(crate) all_gather: AllGather,
    /// The storage step's directory, made private by the parent of a rank process (`None`:
    /// every rank is here and the step makes its own, or no rank is).
    pub(crate) storage_dir: Option<std::path::PathBuf>,
}

/// What a process does with the prompts (the seed is cached, never sent).
pub(crate) trait Prompts {
    /// The chunk of prompt `request` ending at `end` is written to every local pool (enqueued
    /// on the scenario's stream); `chain` holds the prompt's pages so far.
    fn chunk_written(
        &mut self,
        s: &Scenario,
        request: u64,
        chain: &RequestChain,
        end: ChunkEnd,
    ) -> Result<()>;

    /// Prompt `request` is prefilled, its pages `chain` in the group's pools and `ref_chain` in
    /// the reference; returns what the report says about it.
    fn prompt_done(
        &mut self,
        s: &Scenario,
        request: u64,
        chain: &RequestChain,
        ref_chain: &RequestChain,
    ) -> Result<String>;
}

/// The scratch side of the gather: a send buffer per rank of the group (local ranks pack into
/// theirs; the others' arrive by the all-gather), a scratch slot per local rank, the page
/// table, and two staging buffers verification reads pages in chain order into.
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
        cfg: &PressureConfig,
        layout: ScratchLayout,
        logical_pages: u64,
        local: usize,
    ) -> Result<Self> {
        let bk = b.as_ref();
        let g = cfg.shape.geometry();
        let staging = |pages: u64| Staging::new(bk, &g, pages).map(Arc::new);
        let send_pages = cfg.send_pages()?;
        Ok(Self {
            sends: (0..cfg.shape.ranks)
                .map(|_| staging(send_pages))
                .collect::<Result<_>>()?,
            scratch: (0..local)
                .map(|_| staging(layout.pages()))
                .collect::<Result<_>>()?,
            table: ScratchTable::new(
                b.clone(),
                logical_pages,
                usize::try_from(layout.pages()).map_err(|_| overflow("scratch pages"))?,
            )?,
            want: staging(layout.prefix_pages().max(1))?,
            got: staging(layout.prefix_pages().max(1))?,
            layout,
        })
    }
}

/// What one prefill moved: owned-row writes, and for gathered prefixes the pack, the all-gather
/// and the page table; with the wall time of setup and verification apart.
#[derive(Debug, Default)]
struct PrefillReport {
    chunks: usize,
    writes: Moved,
    /// The packs and the landings together (in one process they interleave layer by layer on
    /// one stream, so one pair of events times both).
    gather: Moved,
    packed: u64,
    gathered: u64,
    /// Wall time of the host-staged exchanges between the processes.
    exchange_ms: f64,
    table_ms: f64,
    gathers: usize,
    evicted: Vec<String>,
    setup_ms: f64,
    verify_ms: f64,
}

/// Everything the scenario keeps between its stages, in one process.
pub(crate) struct Scenario {
    b: Arc<dyn Backend>,
    g: CacheGeometry,
    placement: Placement,
    route: Route,
    limits: AdmissionLimits,
    seed: u64,
    ranks: Vec<Arc<DevicePool>>,
    reference: Arc<DevicePool>,
    staging: Arc<ChunkStaging>,
    writes: Vec<OwnedRowWrite>,
    ref_write: OwnedRowWrite,
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
    all_gather: AllGather,
}

impl Scenario {
    /// The unsharded reference pool (it never evicts).
    pub(crate) fn reference(&self) -> &Arc<DevicePool> {
        &self.reference
    }

    /// The grid of the scenario's device-to-device block copies: enough CTAs to fill an H200
    /// (copies between device buffers are bandwidth-bound, not bytes-in-flight-bound).
    fn launch(&self) -> Launch {
        Launch {
            ctas: 128,
            threads: self.b.max_threads(KernelFamily::Copy),
        }
    }

    /// Evicts least recently used nodes until the allocator admits `needed` tokens: every
    /// local rank's controller drops the node (it is on the host), its pages are poisoned and
    /// freed.
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
                c.evict_sync(&node, &compute, route)?;
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

    /// Prefills tokens `from..to` of cache node `node` (`chain` in the group's pools, `ref_chain`
    /// in the reference), chunk by chunk, each chunk admitted alone in a scheduling pass
    /// (evicting when the pool defers it); with `gather`, every chunk with a cached prefix
    /// first reads it through the gather plan. A prompt's `prompts` hears of every chunk
    /// written.
    #[allow(clippy::too_many_arguments)]
    fn prefill(
        &mut self,
        node: u64,
        mut prompts: Option<&mut dyn Prompts>,
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
            let prefix_pages = chain.page_count();
            chain.grow_to(&mut self.alloc, end)?;
            ref_chain.grow_to(&mut self.ref_alloc, end)?;
            // The chunk's KV: random bytes in every layer of the staging, the same in every
            // process (seeded by the node and the chunk's first token).
            let mut rng = synth::seeded(&[self.seed, node, done as u64]);
            let random = synth::bytes(&mut rng, self.staging.buffer().len());
            bk.write_sync(self.staging.buffer(), 0, &random)?;
            report.setup_ms += setup.elapsed().as_secs_f64() * 1e3;
            if gather && prefix_pages > 0 {
                self.gather_prefix(chain, ref_chain, prefix_pages, &mut report)?;
            }
            for (w, pool) in self.writes.iter().zip(&self.ranks) {
                let (slots, ms) = write_chunk(bk, w, chain, done..end, &mut report.setup_ms)?;
                let owned = slots
                    .iter()
                    .filter(|&&s| self.placement.slot_owner(s) == pool.rank())
                    .count();
                report.writes.add(owned as u64 * w.row_bytes(), ms);
            }
            write_chunk(
                bk,
                &self.ref_write,
                ref_chain,
                done..end,
                &mut report.setup_ms,
            )?;
            report.chunks += 1;
            done = end;
            if let Some(prompts) = prompts.as_deref_mut() {
                let at = if end == to {
                    ChunkEnd::Final(end)
                } else {
                    ChunkEnd::Partial(end)
                };
                prompts.chunk_written(self, node, chain, at)?;
            }
        }
        Ok(report)
    }

    /// Reads the first `prefix_pages` pages of `chain` into every local rank's scratch through
    /// a gather plan (pack, then the all-gather, layer by layer), builds the page table with
    /// the kernel, and checks the scratch read through it against the reference's pages of
    /// `ref_chain`.
    fn gather_prefix(
        &mut self,
        chain: &RequestChain,
        ref_chain: &RequestChain,
        prefix_pages: usize,
        report: &mut PrefillReport,
    ) -> Result<()> {
        let launch = self.launch();
        let b = self.b.clone();
        let bk = b.as_ref();
        let (Some(rig), all_gather) = (self.gather.as_mut(), &mut self.all_gather) else {
            return Ok(());
        };
        let setup = Instant::now();
        let request = GatherRequest::of_chain(chain, prefix_pages)?;
        let logical = self
            .alloc
            .placement()
            .logical_pages(self.alloc.pages_per_rank())?;
        let plan = GatherPlan::new(self.placement, rig.layout, logical, &[request])?;
        report.setup_ms += setup.elapsed().as_secs_f64() * 1e3;
        let table_ms = time_sync(bk, || rig.table.build(&plan))?;
        let layers = (0..self.g.model_layers()).map(ModelLayer);
        match all_gather {
            AllGather::InProcess => {
                let setup = Instant::now();
                let (packs, landings) = device_copies(bk, &plan, &self.ranks, rig)?;
                report.setup_ms += setup.elapsed().as_secs_f64() * 1e3;
                let ms = time_sync(bk, || {
                    for m in layers {
                        for copy in packs.iter().chain(&landings) {
                            copy.run_layer(bk, m, launch)?;
                        }
                    }
                    Ok(())
                })?;
                report.add_gather(&packs, &landings, ms);
            }
            AllGather::HostStaged(group) => {
                let setup = Instant::now();
                let (packs, landings) = device_copies(bk, &plan, &self.ranks, rig)?;
                report.setup_ms += setup.elapsed().as_secs_f64() * 1e3;
                let pack_ms = time_sync(bk, || packs.iter().try_for_each(|c| c.run(bk, launch)))?;
                let exchange = Instant::now();
                // Only the block's pages of each stored layer travel: the send buffers are
                // sized for the longest prefix the scratch holds.
                let own = group.rank();
                let mine = block_regions(&rig.sends[own as usize], plan.block())?;
                let mut bytes = Vec::with_capacity(mine.iter().map(Buffer::len).sum());
                for region in &mine {
                    bytes.extend(bk.read_sync(region, 0, region.len())?);
                }
                group.write_slot(&bytes)?;
                group.barrier_sync()?;
                for owner in (0..group.ranks()).filter(|&o| o != own) {
                    group.read_slot(owner, &mut bytes)?;
                    let mut at = 0;
                    for region in block_regions(&rig.sends[owner as usize], plan.block())? {
                        bk.write_sync(&region, 0, &bytes[at..at + region.len()])?;
                        at += region.len();
                    }
                }
                // Nobody packs the next prefix into its slot before every rank has read this one.
                group.barrier_sync()?;
                report.exchange_ms += exchange.elapsed().as_secs_f64() * 1e3;
                let land_ms =
                    time_sync(bk, || landings.iter().try_for_each(|c| c.run(bk, launch)))?;
                report.add_gather(&packs, &landings, pack_ms + land_ms);
            }
            #[cfg(feature = "nccl")]
            AllGather::Nccl { group, cuda } => {
                let setup = Instant::now();
                let (pool, scratch) = match (self.ranks.as_slice(), rig.scratch.as_slice()) {
                    ([pool], [scratch]) => (pool.clone(), scratch.clone()),
                    _ => {
                        return Err(Error::InvalidArgument(
                            "an NCCL rank holds exactly one pool".into(),
                        ))
                    }
                };
                let cp = kvshard::nccl::CpGather::prepare_sync(cuda, &plan, pool, scratch)?;
                report.setup_ms += setup.elapsed().as_secs_f64() * 1e3;
                let ms = time_sync(bk, || {
                    layers
                        .clone()
                        .try_for_each(|m| cp.run_layer(cuda, group, m, launch.ctas))
                })?;
                let gathered: u64 = layers.map(|m| cp.layer_bytes(m)).sum();
                report.gather.add(gathered, ms);
                report.gathered += gathered;
            }
        }
        bk.synchronize()?;
        report.table_ms += table_ms;
        report.gathers += 1;

        let verify = Instant::now();
        let table_bytes = logical
            .checked_mul(8)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| overflow(format!("the table of {logical} pages")))?;
        let table = i64s_from_bytes(&bk.read_sync(rig.table.table(), 0, table_bytes)?);
        let prefix = &chain.pages()?[..prefix_pages];
        let mut scratch_pages = Vec::with_capacity(prefix_pages);
        for page in prefix {
            let s = usize::try_from(page.0)
                .ok()
                .and_then(|p| table.get(p))
                .copied()
                .ok_or_else(|| overflow(format!("{page} in the page table")))?;
            scratch_pages.push(LocalPage(s as u64));
        }
        let ref_pages: Vec<LocalPage> = ref_chain.pages()?[..prefix_pages]
            .iter()
            .map(|p| LocalPage(p.0))
            .collect();
        let want = read_in_order(bk, self.reference.clone(), ref_pages, &rig.want, launch)?;
        for (pool, scratch) in self.ranks.iter().zip(&rig.scratch) {
            let got = read_in_order(bk, scratch.clone(), scratch_pages.clone(), &rig.got, launch)?;
            if got != want {
                return Err(Error::Verification(format!(
                    "rank {}'s scratch read through the page table differs from the reference's {prefix_pages} prefix pages",
                    pool.rank()
                )));
            }
        }
        report.verify_ms += verify.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }
}

impl PrefillReport {
    fn add_gather(&mut self, packs: &[BlockCopy], landings: &[BlockCopy], ms: f64) {
        let packed: u64 = packs.iter().map(BlockCopy::bytes).sum();
        let gathered: u64 = landings.iter().map(BlockCopy::bytes).sum();
        self.gather.add(packed + gathered, ms);
        self.packed += packed;
        self.gathered += gathered;
    }
}

/// Writes the staged chunk's rows of tokens `tokens` of `chain` through `w`; returns the
/// chunk's slots and the milliseconds the write took on the device (the slots' upload goes to
/// `setup_ms`).
fn write_chunk(
    bk: &dyn Backend,
    w: &OwnedRowWrite,
    chain: &RequestChain,
    tokens: std::ops::Range<usize>,
    setup_ms: &mut f64,
) -> Result<(Vec<Slot>, f64)> {
    let setup = Instant::now();
    let n = tokens.len();
    let slots = chain.slots(tokens)?;
    // Uploaded before the timed window, so it times the write alone. The slots are the
    // chain's own: a rejected one would fail the synchronize below.
    let raw: Vec<i64> = slots.iter().map(|s| s.0 as i64).collect();
    let device_slots = upload_i64s_sync(bk, &raw)?;
    *setup_ms += setup.elapsed().as_secs_f64() * 1e3;
    let ms = time_sync(bk, || w.run(bk, &device_slots, n, w.launch(bk, n)))?;
    bk.synchronize()?;
    Ok((slots, ms))
}

/// The first `pages` pages of every stored layer of `staging`, component by component: where a
/// send buffer holds a block of that many pages.
fn block_regions(staging: &Staging, pages: u64) -> Result<Vec<Buffer>> {
    let mut regions = Vec::new();
    for comp in staging.components() {
        for layer in 0..comp.layers() {
            let bytes = usize::try_from(pages)
                .ok()
                .and_then(|p| p.checked_mul(comp.block_bytes))
                .ok_or_else(|| overflow(format!("a block of {pages} pages")))?;
            regions.push(
                staging
                    .layer(comp.component, StoredLayer(layer))?
                    .slice(0, bytes)?,
            );
        }
    }
    Ok(regions)
}

/// The device copies of a gather: each local rank's pack into its send buffer, and the landing
/// of every owner's send buffer in every local rank's scratch.
fn device_copies(
    bk: &dyn Backend,
    plan: &GatherPlan,
    ranks: &[Arc<DevicePool>],
    rig: &GatherRig,
) -> Result<(Vec<BlockCopy>, Vec<BlockCopy>)> {
    let packs = ranks
        .iter()
        .map(|pool| {
            let send = &rig.sends[pool.rank() as usize];
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
    Ok((packs, landings))
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

impl Scenario {
    /// Backs `node` up on every local rank (write-through on its first access) and awaits the
    /// acks.
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
            moved.bytes += c.ack_backups_sync(1)?.iter().map(|a| a.bytes).sum::<u64>();
        }
        moved.ms = ms;
        Ok(moved)
    }

    /// Loads backed-up node `node` into device pages `pages` on every local rank.
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
            moved.bytes += c.ack_loads_sync(1)?.iter().map(|a| a.bytes).sum::<u64>();
        }
        moved.ms = ms;
        Ok(moved)
    }
}

/// The demo's P/D, in one process: once a prompt is prefilled every rank sends it whole into a
/// decode pool, the reference into another, and the two must be byte-identical.
struct CheckedSend {
    tokens: usize,
    chunk: usize,
}

impl Prompts for CheckedSend {
    fn chunk_written(&mut self, _: &Scenario, _: u64, _: &RequestChain, _: ChunkEnd) -> Result<()> {
        Ok(())
    }

    fn prompt_done(
        &mut self,
        s: &Scenario,
        _: u64,
        chain: &RequestChain,
        ref_chain: &RequestChain,
    ) -> Result<String> {
        let bk = s.b.as_ref();
        let shape = SendShape {
            geometry: &s.g,
            tokens: self.tokens,
            chunk: self.chunk,
        };
        let (decode, decode_space) = decode_pool(bk, &s.g, self.tokens)?;
        let (expected, expected_space) = decode_pool(bk, &s.g, self.tokens)?;
        let sent = send_all(&s.b, &s.ranks, chain, &decode_space, &shape)?;
        send_all(
            &s.b,
            std::slice::from_ref(&s.reference),
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
        Ok(format!(
            "P/D sent {sent}, decode pool byte-identical to the unsharded reference (verified in {:.1} ms)",
            check.elapsed().as_secs_f64() * 1e3
        ))
    }
}

fn evicted(report: &PrefillReport) -> String {
    if report.evicted.is_empty() {
        "evicting nothing".into()
    } else {
        format!("evicting {}", report.evicted.join(", "))
    }
}

/// Runs the pressure scenario ([`PressureConfig`]) with every rank in this process on `b`,
/// making further streams of the same device with `streams`, with the HiCache route `route`.
/// Every stage reports its transfers' time measured with events on the device and their GB/s;
/// setup and verification apart.
pub fn run_pressure(
    b: Arc<dyn Backend>,
    streams: StreamFactory<'_>,
    cfg: &PressureConfig,
    route: Route,
) -> Result<Summary> {
    let per_rank = cfg.pages_per_rank()?;
    let g = cfg.shape.geometry();
    let placement = cfg.shape.placement()?;
    let pools = (0..cfg.shape.ranks)
        .map(|r| DevicePool::allocate(b.as_ref(), &g, placement, r, per_rank).map(Arc::new))
        .collect::<Result<_>>()?;
    let local = Local {
        pools,
        all_gather: AllGather::InProcess,
        storage_dir: None,
    };
    let mut prompts = CheckedSend {
        tokens: cfg.prompt_tokens,
        chunk: cfg.chunk,
    };
    Ok(run_scenario(b, streams, cfg, route, local, &mut prompts)?.summary)
}

/// What one process's run of the scenario reports.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// The report's lines.
    pub(crate) summary: Summary,
    /// The prefix's reload from the host, over the local ranks.
    pub(crate) reload: Moved,
    /// When the reload started and ended, on the wall clock.
    pub(crate) reload_window: (SystemTime, SystemTime),
}

/// Runs the scenario in one process holding `local` (module docs), on `b`, making further
/// streams of the same device with `streams`, with the HiCache route `route`; `prompts` sees
/// every prompt chunk and prompt prefilled.
pub(crate) fn run_scenario(
    b: Arc<dyn Backend>,
    streams: StreamFactory<'_>,
    cfg: &PressureConfig,
    route: Route,
    local: Local,
    prompts: &mut dyn Prompts,
) -> Result<Outcome> {
    let mut out = Summary::default();
    let waits = timed_waits();
    let per_rank = cfg.pages_per_rank()?;
    let bk = b.as_ref();
    let g = cfg.shape.geometry();
    let placement = cfg.shape.placement()?;
    let unsharded = Placement::unsharded();
    let host_pages = per_rank
        .checked_mul(cfg.host_factor)
        .ok_or_else(|| overflow(format!("{per_rank} pages x {}", cfg.host_factor)))?;
    check_local(cfg, &local, per_rank)?;
    #[cfg(feature = "nixl")]
    let storage_dir = local.storage_dir.clone();
    out.say(format!(
        "kvshard pressure scenario on the {} backend: {} ({} of its ranks here), {} logical slots ({} pages per rank), two {}-token prompts ({} tokens together), a seeded prefix of {} tokens, host pools {}x larger ({} pages per rank); {} B per page, chunks of {}",
        bk.name(),
        cfg.shape,
        local.pools.len(),
        cfg.logical_slots,
        per_rank,
        cfg.prompt_tokens,
        2 * cfg.prompt_tokens,
        cfg.prefix_tokens,
        cfg.host_factor,
        host_pages,
        g.page_bytes(),
        cfg.chunk
    ));

    let setup = Instant::now();
    let ranks = local.pools;
    for pool in &ranks {
        pool.fill(bk, POISON)?;
    }
    // The reference never evicts: room for the prefix and both prompts.
    let ref_pages = cfg.reference_pages();
    let reference = Arc::new(DevicePool::allocate(bk, &g, unsharded, 0, ref_pages)?);
    let staging = Arc::new(ChunkStaging::new(bk, &reference, cfg.chunk)?);
    let write =
        |p: &Arc<DevicePool>| OwnedRowWrite::prepare_sync(bk, staging.clone(), p.clone(), |_| true);
    let writes = ranks.iter().map(write).collect::<Result<_>>()?;
    let ref_write = write(&reference)?;
    let controllers = write_through_controllers(bk, &g, &ranks, host_pages, streams, route)?;
    let (limits, layout) = cfg.scratch()?;
    let gather = match layout {
        Some(layout) if !ranks.is_empty() => Some(GatherRig::new(
            &b,
            cfg,
            layout,
            placement.logical_pages(per_rank)?,
            ranks.len(),
        )?),
        _ => None,
    };
    let poison = Arc::new(Staging::new(bk, &g, 1)?);
    bk.fill(poison.buffer(), POISON)?;
    let scratch_note = match &gather {
        Some(rig) => format!(
            ", scratch slots of {} pages (prefix region {} pages)",
            rig.layout.pages(),
            rig.layout.prefix_pages()
        ),
        None => ", no scratch".into(),
    };
    let mut s = Scenario {
        b: b.clone(),
        g: g.clone(),
        placement,
        route,
        limits,
        seed: cfg.shape.seed,
        ranks,
        reference,
        staging,
        writes,
        ref_write,
        alloc: ShardAllocator::new(placement, per_rank)?,
        ref_alloc: ShardAllocator::new(unsharded, ref_pages)?,
        controllers,
        evictable: VecDeque::new(),
        poison,
        gather,
        all_gather: local.all_gather,
    };
    let local_ranks = !s.ranks.is_empty();
    out.say(format!(
        "setup: device pools, the reference, host pools, staging{scratch_note}: {:.1} ms",
        setup.elapsed().as_secs_f64() * 1e3
    ));

    // 1. The seeded prefix, written through to the host, its backup awaited.
    let mut seed = RequestChain::new(placement);
    let mut seed_ref = RequestChain::new(unsharded);
    let r = s.prefill(
        SEED_NODE,
        None,
        &mut seed,
        &mut seed_ref,
        0,
        cfg.prefix_tokens,
        false,
    )?;
    let seed_node = CacheNode::of_chain(&seed, SEED_NODE, 0..seed.page_count())?;
    let backup = s.backup(&seed_node)?;
    s.evictable.push_back(seed_node.clone());
    out.say(format!(
        "seed: {} tokens in {} chunks, owned-row writes {}; written through to the host, backup awaited: {backup} (setup {:.1} ms)",
        cfg.prefix_tokens, r.chunks, r.writes, r.setup_ms
    ));

    // 2. Prompt 1: a prompt of its own; the pool makes room by evicting the prefix.
    let mut p1 = RequestChain::new(placement);
    let mut p1_ref = RequestChain::new(unsharded);
    let r = s.prefill(
        PROMPT_1,
        Some(&mut *prompts),
        &mut p1,
        &mut p1_ref,
        0,
        cfg.prompt_tokens,
        false,
    )?;
    if r.evicted.is_empty() {
        return Err(Error::Verification(
            "prompt 1 evicted nothing: there was no pressure".into(),
        ));
    }
    let sent = prompts.prompt_done(&s, PROMPT_1, &p1, &p1_ref)?;
    let p1_node = CacheNode::of_chain(&p1, PROMPT_1, 0..p1.page_count())?;
    let backup = s.backup(&p1_node)?;
    s.evictable.push_back(p1_node);
    out.say(format!(
        "prompt 1: {} tokens in {} chunks, {}; owned-row writes {}; {sent}; backup {backup} (setup {:.1} ms)",
        cfg.prompt_tokens,
        r.chunks,
        evicted(&r),
        r.writes,
        r.setup_ms
    ));

    // 3. Prompt 2: the seeded prefix, now on the host only, then new tokens. Reloading the
    // prefix needs room: prompt 1 goes.
    let mut room = PrefillReport::default();
    let stride = u64::from(cfg.shape.ranks) * PAGE_SIZE as u64;
    s.make_room(cfg.prefix_tokens as u64 + stride, &mut room)?;
    let pages = s.alloc.alloc_matching(&seed_node.device_pages)?;
    let reload_start = SystemTime::now();
    let load = s.load(seed_node.id, &pages)?;
    let reload_window = (reload_start, SystemTime::now());
    if local_ranks && load.bytes == 0 {
        return Err(Error::Verification(
            "the prefix was not reloaded from the host: H2D did not grow".into(),
        ));
    }
    let start_owner = seed.start_owner().unwrap_or(0);
    let mut p2 = RequestChain::cached(&s.alloc, start_owner, pages.clone())?;
    let mut p2_ref = RequestChain::cached(&s.ref_alloc, 0, seed_ref.pages()?.to_vec())?;
    let r = s.prefill(
        PROMPT_2,
        Some(&mut *prompts),
        &mut p2,
        &mut p2_ref,
        cfg.prefix_tokens,
        cfg.prompt_tokens,
        true,
    )?;
    let sent = prompts.prompt_done(&s, PROMPT_2, &p2, &p2_ref)?;
    let p2_node = CacheNode::of_chain(&p2, PROMPT_2, seed.page_count()..p2.page_count())?;
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
        let exchange = if r.exchange_ms > 0.0 {
            format!(" (host exchange {:.1} ms wall)", r.exchange_ms)
        } else {
            String::new()
        };
        out.say(format!(
            "prompt 2: before each of {} chunks its prefix was gathered ({layers} layers): the local ranks packed their send lists ({} bytes) and {} landed every rank's block in the local scratch, owner-major ({} bytes): {}{exchange}, {:.3} ms per layer; page tables built by kvs_scratch_table in {:.2} ms; every local scratch read through the page table equals the reference's prefix pages (verified in {:.1} ms; setup {:.1} ms)",
            r.gathers,
            r.packed,
            s.all_gather.describe(),
            r.gathered,
            r.gather,
            r.gather.ms / (r.gathers.max(1) * layers.max(1)) as f64,
            r.table_ms,
            r.verify_ms,
            r.setup_ms
        ));
    }
    out.say(format!(
        "prompt 2: {sent}; backup of its new pages {backup}"
    ));
    // The steady state an engine lives in: every write, gather, send, backup and load above
    // was enqueued inside a timed stretch, and none of those calls may block the host.
    let waits = timed_waits() - waits;
    if waits.waits != 0 {
        return Err(Error::Verification(format!(
            "{} host waits while enqueueing {} stretches of steady-state work (writes, gathers, sends, backups, loads): only _sync calls may wait",
            waits.waits, waits.stretches
        )));
    }
    out.say(format!(
        "steady state: {} stretches of writes, gathers, sends, backups and loads enqueued with 0 host waits (only the _sync calls around them waited)",
        waits.stretches
    ));
    // 4. The storage tier below the host pools (feature `nixl`), on every process holding
    // ranks (every rank here, or one rank per process sharing the directory).
    #[cfg(feature = "nixl")]
    if s.ranks.is_empty() {
        out.say("storage: not run here: a decode holds no CP rank".into());
    } else {
        let shared = storage_dir.as_deref();
        for line in s.storage_step(&seed_node, &seed_ref, cfg.prefix_tokens, shared)? {
            out.say(line);
        }
    }
    #[cfg(not(feature = "nixl"))]
    out.say("storage: SKIPPED, built without the `nixl` feature (the storage tier runs on NIXL's POSIX backend)".into());
    out.say("pressure scenario: every check passed".into());
    Ok(Outcome {
        summary: out,
        reload: load,
        reload_window,
    })
}

/// Checks what a process holds fits the scenario: local pools of the group's shape, each rank
/// once; a host-staged all-gather's group of the same ranks, holding exactly its own rank's
/// pool, with slots that hold a send buffer.
fn check_local(cfg: &PressureConfig, local: &Local, per_rank: u64) -> Result<()> {
    let bad = |why: String| Err(Error::InvalidArgument(format!("pressure scenario: {why}")));
    let g = cfg.shape.geometry();
    let mut seen = std::collections::HashSet::new();
    for pool in &local.pools {
        if pool.placement().shard() != cfg.shape.ranks
            || pool.pages() != per_rank
            || pool.geometry() != &g
            || !seen.insert(pool.rank())
        {
            return bad(format!(
                "a pool of rank {} of {} with {} pages (each of the {} ranks once, {per_rank} pages, the scenario's geometry)",
                pool.rank(),
                pool.placement().shard(),
                pool.pages(),
                cfg.shape.ranks
            ));
        }
    }
    // A shared storage directory is for rank processes of a group run; with every rank (or
    // none) here there is nothing to share it with.
    if local.storage_dir.is_some() && seen.len() != 1 {
        return bad("a shared storage directory is for a process holding one rank".into());
    }
    let send_bytes = cfg.send_bytes()?;
    match &local.all_gather {
        AllGather::InProcess
            if !local.pools.is_empty() && seen.len() != cfg.shape.ranks as usize =>
        {
            bad("an in-process all-gather needs every rank in the process".into())
        }
        AllGather::HostStaged(group)
            if group.ranks() != cfg.shape.ranks
                || seen.len() != 1
                || !seen.contains(&group.rank())
                || group.slot_bytes() < send_bytes =>
        {
            bad(format!(
                "a host-staged group of {} ranks with {}-byte slots, as rank {}, for ranks {seen:?} ({} bytes per send buffer)",
                group.ranks(),
                group.slot_bytes(),
                group.rank(),
                send_bytes
            ))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshard::backend::cpu::CpuBackend;

    use crate::scenario::Platform;

    struct Nothing;

    impl Prompts for Nothing {
        fn chunk_written(
            &mut self,
            _: &Scenario,
            _: u64,
            _: &RequestChain,
            _: ChunkEnd,
        ) -> Result<()> {
            Ok(())
        }

        fn prompt_done(
            &mut self,
            _: &Scenario,
            _: u64,
            _: &RequestChain,
            _: &RequestChain,
        ) -> Result<String> {
            Ok(String::new())
        }
    }

    /// Runs the scenario holding `local` on a fresh CPU backend.
    fn run_holding(
        cfg: &PressureConfig,
        local: impl FnOnce(&Arc<dyn Backend>) -> Local,
    ) -> Result<Outcome> {
        let cpu = CpuBackend::new();
        let b: Arc<dyn Backend> = Arc::new(cpu.new_stream());
        let streams = || -> Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
        let local = local(&b);
        run_scenario(b, &streams, cfg, Platform::Cpu.route(), local, &mut Nothing)
    }

    fn pool(b: &Arc<dyn Backend>, cfg: &PressureConfig, rank: u32, pages: u64) -> Arc<DevicePool> {
        let placement = cfg.shape.placement().unwrap();
        let g = cfg.shape.geometry();
        Arc::new(DevicePool::allocate(b.as_ref(), &g, placement, rank, pages).unwrap())
    }

    #[test]
    fn a_process_holding_what_the_scenario_cannot_use_is_refused_before_it_runs() {
        let cfg = PressureConfig::default_for(Platform::Cpu);
        let per_rank = cfg.pages_per_rank().unwrap();
        let refused = |e: Result<Outcome>| {
            assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
        };
        // In one process the landings read every rank's send buffer: every rank must be there.
        refused(run_holding(&cfg, |b| Local {
            pools: vec![pool(b, &cfg, 0, per_rank)],
            all_gather: AllGather::InProcess,
            storage_dir: None,
        }));
        // A pool of another size, or a rank twice.
        refused(run_holding(&cfg, |b| Local {
            pools: vec![pool(b, &cfg, 0, per_rank + 1), pool(b, &cfg, 1, per_rank)],
            all_gather: AllGather::InProcess,
            storage_dir: None,
        }));
        refused(run_holding(&cfg, |b| Local {
            pools: vec![pool(b, &cfg, 0, per_rank), pool(b, &cfg, 0, per_rank)],
            all_gather: AllGather::InProcess,
            storage_dir: None,
        }));
        // A host-staged group where this process is another rank, or whose slots are short.
        let slot = cfg.send_bytes().unwrap();
        for (rank, slot_bytes) in [(1, slot), (0, slot - 1)] {
            let shm = GroupMemory::create(cfg.shape.ranks, slot_bytes).unwrap();
            let group = GroupMemory::join(
                &shm.proc_path(),
                rank,
                cfg.shape.ranks,
                slot_bytes,
                std::time::Duration::from_millis(100),
            )
            .unwrap();
            refused(run_holding(&cfg, |b| Local {
                pools: vec![pool(b, &cfg, 0, per_rank)],
                all_gather: AllGather::HostStaged(group),
                storage_dir: None,
            }));
        }
    }

    #[test]
    fn a_decode_holding_no_rank_replays_the_reference_alone() {
        let cfg = PressureConfig::default_for(Platform::Cpu);
        let outcome = run_holding(&cfg, |_| Local {
            pools: Vec::new(),
            all_gather: AllGather::InProcess,
            storage_dir: None,
        })
        .unwrap();
        assert_eq!(outcome.reload.bytes, 0);
        assert_eq!(
            outcome.summary.lines.last().map(String::as_str),
            Some("pressure scenario: every check passed")
        );
    }
}
