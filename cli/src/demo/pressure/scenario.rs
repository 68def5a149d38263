//! [`Scenario`]: what the pressure scenario keeps between its steps in one process, how it is
//! set up, and what its steps do with it: prefill chunk by chunk under admission (evicting
//! least recently used nodes to make room), back a node up, load one back.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use kvshard::backend::{upload_i64s_sync, Backend, Launch};
use kvshard::chain::RequestChain;
use kvshard::copy::{BlockCopy, BlockCopyPlan, PageSelection, Staging};
use kvshard::geometry::CacheGeometry;
use kvshard::hicache::{CacheNode, HiCacheController, Route};
use kvshard::index::{LocalPage, LogicalPage, ModelLayer, Slot};
use kvshard::pool::{ChunkStaging, DevicePool, OwnedRowWrite};
use kvshard::shard::{
    evict_until_allocatable, Admission, AdmissionLimits, Candidate, Decision, Deferral, GatherPlan,
    GatherRequest, Placement, ShardAllocator,
};
use kvshard::transfer::ChunkEnd;
use kvshard::{Error, Result};

use super::super::{on_all_ranks, write_through_controllers, StreamFactory, Summary};
use super::gather::{all_gather_prefix, read_in_order, scratch_pages, GatherRig};
use super::local::check_local;
use super::report::{copy_launch, PrefillReport};
use super::{AllGather, Local, Prompts};
use crate::measure::{time_sync, Moved};
use crate::overflow;
use crate::scenario::PressureConfig;
use crate::synth::{self, POISON};

/// Everything the scenario keeps between its stages, in one process.
pub(crate) struct Scenario {
    pub(super) b: Arc<dyn Backend>,
    pub(super) g: CacheGeometry,
    pub(super) placement: Placement,
    pub(super) route: Route,
    pub(super) limits: AdmissionLimits,
    pub(super) seed: u64,
    pub(super) ranks: Vec<Arc<DevicePool>>,
    pub(super) reference: Arc<DevicePool>,
    pub(super) staging: Arc<ChunkStaging>,
    pub(super) writes: Vec<OwnedRowWrite>,
    pub(super) ref_write: OwnedRowWrite,
    pub(super) alloc: ShardAllocator,
    pub(super) ref_alloc: ShardAllocator,
    pub(super) controllers: Vec<HiCacheController>,
    /// Cached nodes whose pages are on the device and unlocked, least recently used first:
    /// what the engine's eviction takes.
    pub(super) evictable: VecDeque<CacheNode>,
    /// A page of poison every evicted page is overwritten with, so a page reused without its
    /// data being reloaded shows.
    pub(super) poison: Arc<Staging>,
    pub(super) gather: Option<GatherRig>,
    pub(super) all_gather: AllGather,
}

impl Scenario {
    /// Sets the scenario up in a process holding `local` (checked first: [`check_local`]) on
    /// `b`, making further streams with `streams`, with the HiCache route `route`: the local
    /// pools poisoned, the unsharded reference, the chunk staging and every owned-row write,
    /// the write-through controllers, the gather's scratch, a page of poison. Says what runs
    /// and what the setup took.
    pub(super) fn set_up(
        b: Arc<dyn Backend>,
        streams: StreamFactory<'_>,
        cfg: &PressureConfig,
        route: Route,
        local: Local,
        out: &mut Summary,
    ) -> Result<Self> {
        let per_rank = cfg.pages_per_rank()?;
        let bk = b.as_ref();
        let g = cfg.shape.geometry();
        let placement = cfg.shape.placement()?;
        let unsharded = Placement::unsharded();
        let host_pages = per_rank
            .checked_mul(cfg.host_factor)
            .ok_or_else(|| overflow(format!("{per_rank} pages x {}", cfg.host_factor)))?;
        check_local(cfg, &local, per_rank)?;
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
        let write = |p: &Arc<DevicePool>| {
            OwnedRowWrite::prepare_sync(bk, staging.clone(), p.clone(), |_| true)
        };
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
        let s = Scenario {
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
        out.say(format!(
            "setup: device pools, the reference, host pools, staging{scratch_note}: {:.1} ms",
            setup.elapsed().as_secs_f64() * 1e3
        ));
        Ok(s)
    }

    /// The unsharded reference pool (it never evicts).
    pub(crate) fn reference(&self) -> &Arc<DevicePool> {
        &self.reference
    }

    /// The grid of the scenario's block copies ([`copy_launch`]).
    pub(super) fn launch(&self) -> Launch {
        copy_launch(self.b.as_ref())
    }

    /// Evicts least recently used nodes until the allocator admits `needed` tokens: every
    /// local rank's controller drops the node (it is on the host), its pages are poisoned and
    /// freed.
    pub(super) fn make_room(&mut self, needed: u64, report: &mut PrefillReport) -> Result<()> {
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
    pub(super) fn prefill(
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

    /// Backs `node` up on every local rank (write-through on its first access) and awaits the
    /// acks.
    pub(super) fn backup(&mut self, node: &CacheNode) -> Result<Moved> {
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
    pub(super) fn load(&mut self, node: u64, pages: &[LogicalPage]) -> Result<Moved> {
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

impl Scenario {
    /// Reads the first `prefix_pages` pages of `chain` into every local rank's scratch through
    /// a gather plan (pack, then the all-gather, layer by layer), builds the page table with
    /// the kernel, and checks the scratch read through it against the reference's pages of
    /// `ref_chain`.
    pub(super) fn gather_prefix(
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
        let layers = self.g.model_layers();
        all_gather_prefix(bk, all_gather, plan, &self.ranks, rig, layers, report)?;
        bk.synchronize()?;
        report.table_ms += table_ms;
        report.gathers += 1;

        let verify = Instant::now();
        let scratch_pages = scratch_pages(bk, rig, logical, chain, prefix_pages)?;
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
