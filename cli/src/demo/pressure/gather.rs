//! The CP gather of a cached prefix into every local rank's attention scratch: the local ranks
//! pack their pages of it, the all-gather lands every rank's in every scratch (in one process,
//! through host shared memory, or over NCCL), the page table is built by the kernel, and each
//! scratch read through it is checked against the reference.

use std::sync::Arc;
use std::time::Instant;

use kvshard::backend::{i64s_from_bytes, Backend, Buffer, Launch};
use kvshard::chain::RequestChain;
use kvshard::copy::{BlockCopy, BlockCopyPlan, BlockSpace, PageSelection, ScratchTable, Staging};
use kvshard::index::{LocalPage, ModelLayer, StoredLayer};
use kvshard::ipc::group::GroupMemory;
use kvshard::pool::DevicePool;
use kvshard::shard::{GatherPlan, ScratchLayout};
use kvshard::Result;

use super::report::{copy_launch, PrefillReport};
use super::AllGather;
use crate::measure::time_sync;
use crate::overflow;
use crate::scenario::PressureConfig;
use crate::synth::POISON;

/// The scratch side of the gather: a send buffer per rank of the group (local ranks pack into
/// theirs; the others' arrive by the all-gather), a scratch slot per local rank, the page
/// table, and two staging buffers verification reads pages in chain order into.
pub(super) struct GatherRig {
    pub(super) layout: ScratchLayout,
    pub(super) sends: Vec<Arc<Staging>>,
    pub(super) scratch: Vec<Arc<Staging>>,
    pub(super) table: ScratchTable,
    pub(super) want: Arc<Staging>,
    pub(super) got: Arc<Staging>,
}

impl GatherRig {
    pub(super) fn new(
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

/// Packs every local rank's part of the prefix and lands every rank's in every local scratch
/// by `all_gather`, layer by layer, timed on the device into `report`.
pub(super) fn all_gather_prefix(
    bk: &dyn Backend,
    all_gather: &mut AllGather,
    plan: GatherPlan,
    ranks: &[Arc<DevicePool>],
    rig: &GatherRig,
    layers: usize,
    report: &mut PrefillReport,
) -> Result<()> {
    let launch = copy_launch(bk);
    let layers = (0..layers).map(ModelLayer);
    match all_gather {
        AllGather::InProcess => {
            let setup = Instant::now();
            let (packs, landings) = device_copies(bk, &plan, ranks, rig)?;
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
            let (packs, landings) = device_copies(bk, &plan, ranks, rig)?;
            report.setup_ms += setup.elapsed().as_secs_f64() * 1e3;
            let pack_ms = time_sync(bk, || packs.iter().try_for_each(|c| c.run(bk, launch)))?;
            let exchange = Instant::now();
            exchange_host_staged(bk, group, rig, &plan)?;
            report.exchange_ms += exchange.elapsed().as_secs_f64() * 1e3;
            let land_ms = time_sync(bk, || landings.iter().try_for_each(|c| c.run(bk, launch)))?;
            report.add_gather(&packs, &landings, pack_ms + land_ms);
        }
        #[cfg(feature = "nccl")]
        AllGather::Nccl { group, cuda } => {
            let setup = Instant::now();
            let (pool, scratch) = match (ranks, rig.scratch.as_slice()) {
                ([pool], [scratch]) => (pool.clone(), scratch.clone()),
                _ => {
                    return Err(kvshard::Error::InvalidArgument(
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
    Ok(())
}

/// The host-staged all-gather's exchange: this rank's packed block (the first pages of every
/// stored layer of its send buffer) through its slot of the group's shared memory, and every
/// other rank's block from theirs into its send buffer here.
fn exchange_host_staged(
    bk: &dyn Backend,
    group: &mut GroupMemory,
    rig: &GatherRig,
    plan: &GatherPlan,
) -> Result<()> {
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
    Ok(())
}

/// The scratch page each of the first `prefix_pages` pages of `chain` is at, read back from the
/// page table the kernel built (of `logical` pages).
pub(super) fn scratch_pages(
    bk: &dyn Backend,
    rig: &GatherRig,
    logical: u64,
    chain: &RequestChain,
    prefix_pages: usize,
) -> Result<Vec<LocalPage>> {
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
    Ok(scratch_pages)
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
pub(super) fn read_in_order(
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
