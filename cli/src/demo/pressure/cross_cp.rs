//! The storage step's reload into a CP group of another size (feature `nixl`): the seeded
//! prefix, as the N writer ranks left it on disk, reloaded into a CP group of 2N ranks through
//! the library's path (docs/storage.md, "Reloading with another parallelism") and checked byte
//! for byte against the unsharded reference.
//!
//! The plan ([`ReloadPlan`]) takes the writers (N ranks from the seeded chain's start owner b)
//! and the readers (2N ranks from b + 1, so that a reader's pages come from another writer's
//! files than its own number's where N > 1: the keys name no rank). Each reader rank here opens
//! the step's directory read-only, loads exactly the pages the plan gives it into a host pool of
//! its own ([`load_reads_sync`]), and [`reload`] moves them into a device pool of its own (its
//! pages after the padding page) on the scenario's stream; the step waits for the returned
//! events. Reader `d`'s `k`-th page (plan order) must equal the reference's page at the
//! sequence position the plan gives.
//!
//! - **Every rank in this process** (the demo): every reader rank is here, and one [`reload`]
//!   call runs the whole plan.
//! - **One rank per process** (`kvshard pd --scenario pressure`): prefill rank `r`'s process
//!   hosts readers `r` and `r + N`, so the readers spread over the processes, each reading the
//!   shared directory once every rank's snapshot found the whole prefix there. [`reload`] takes
//!   every reader rank of its plan in one call (it maps no other process's pools), so each
//!   reader here reloads its pages as a plan of their own, one unsharded writer into one
//!   unsharded reader: the pages are kept whole, and that is the one launch the whole plan
//!   enqueues for that rank (its pages from its host pool into its pages, in order).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use kvshard::chain::RequestChain;
use kvshard::copy::{Method, ScatterRank, Staging};
use kvshard::hicache::{
    load_reads_sync, reload, CacheNode, HostLayout, HostPool, PrefixSource, ReaderRank, Reload,
};
use kvshard::index::LocalPage;
use kvshard::key::PageKey;
use kvshard::pool::disk::{DiskConfig, DiskStore, LoadOutcome};
use kvshard::pool::DevicePool;
use kvshard::shard::{CpGroup, Placement, Reader, ReloadPlan};
use kvshard::{Error, Result};

use super::gather::read_in_order;
use super::scenario::Scenario;
use super::storage::STORAGE_TIMEOUT;
use crate::overflow;
use crate::synth::POISON;

/// One reader rank of the wider group, in this process.
struct Hosted {
    /// The sequence pages it reads and keeps, in plan order.
    positions: Vec<u64>,
    /// The host pool it loads them into (at its `reader.pages`, page 0 left alone).
    host: Arc<HostPool>,
    /// Its read-only store on the step's directory, on `host`.
    store: DiskStore,
    /// Its stream, its device pool and its pages there (the same page numbers as the host's).
    reader: ReaderRank,
}

impl Scenario {
    /// Reloads the prefix (`seed_node`'s pages, stored under `keys` in `dir` by the group's
    /// writers, `slots` slots per file) into a CP group of twice the group's size, the reader
    /// ranks of this process's ranks (module docs), and checks it against the reference's pages
    /// of `seed_ref`. Returns the report's line.
    pub(super) fn reload_into_wider_group(
        &self,
        dir: &Path,
        slots: u64,
        seed_node: &CacheNode,
        seed_ref: &RequestChain,
        keys: &[PageKey],
    ) -> Result<String> {
        let plan = self.wider_plan(seed_node)?;
        let n = plan.writers().ranks();
        let mut ranks: Vec<u32> = self
            .controllers
            .iter()
            .flat_map(|c| [c.device().rank(), c.device().rank() + n])
            .collect();
        ranks.sort_unstable();
        let setup = Instant::now();
        let mut hosted = ranks
            .iter()
            .map(|&d| self.open_reader(&plan, d, dir, slots))
            .collect::<Result<Vec<_>>>()?;
        let setup_ms = setup.elapsed().as_secs_f64() * 1e3;
        let started = Instant::now();
        for (h, &d) in hosted.iter_mut().zip(&ranks) {
            let found = load_reads_sync(&plan, d, &mut h.store, keys, &h.reader.pages.pages)?;
            if found.iter().any(|f| *f != LoadOutcome::Loaded) {
                return Err(Error::Verification(format!(
                    "storage: reader rank {d} of {} found on disk {found:?}",
                    plan.reader()
                )));
            }
        }
        let done = self.reload_hosted(&plan, &hosted)?;
        for event in done.iter().flat_map(Reload::events) {
            self.b.wait_event_sync(event)?;
        }
        let ms = started.elapsed().as_secs_f64() * 1e3;
        drop(done);
        let check_ms = self.check_readers(&plan, &hosted, seed_ref)?;
        let here: usize = hosted.iter().map(|h| h.positions.len()).sum();
        let bytes = here as f64 * self.g.page_bytes() as f64;
        Ok(format!(
            "storage: the CP{n}-written prefix reloaded into CP{} (disk -> host -> device, reader ranks {ranks:?} here, {here} of its {} pages, each page read by one reader, at most {} by one): byte-identical to the unsharded reference ({:.1} MB in {ms:.1} ms, {:.2} GB/s; stores opened and pools made in {setup_ms:.1} ms, verified in {check_ms:.1} ms)",
            plan.reader().ranks(),
            plan.pages(),
            plan.busiest(),
            bytes / 1e6,
            bytes / ms.max(1e-3) / 1e6,
        ))
    }

    /// The plan: the prefix's writers (the group, from the seeded chain's start owner; every
    /// page owned round-robin from it) into 2N readers from the next rank.
    fn wider_plan(&self, seed_node: &CacheNode) -> Result<ReloadPlan> {
        let n = self.placement.shard();
        let pages = &seed_node.device_pages;
        let first = pages.first().ok_or_else(|| {
            Error::InvalidArgument("storage: the seeded prefix has no page to reload".into())
        })?;
        let writers = CpGroup::new(n, self.placement.owner(*first))?;
        if let Some(p) =
            (0..pages.len()).find(|&p| self.placement.owner(pages[p]) != writers.owner(p as u64))
        {
            return Err(Error::Verification(format!(
                "storage: page {p} of the seeded prefix is on rank {}, not on rank {} of {writers}",
                self.placement.owner(pages[p]),
                writers.owner(p as u64)
            )));
        }
        let wide = n
            .checked_mul(2)
            .ok_or_else(|| overflow(format!("a CP group of twice {n} ranks")))?;
        let readers = CpGroup::new(wide, (writers.start() + 1) % wide)?;
        ReloadPlan::new(writers, Reader::Cp(readers), pages.len() as u64)
    }

    /// Reader rank `d` of `plan`: a host pool for the pages the plan gives it (poisoned), a
    /// read-only store on `dir` over it, and its device pool (poisoned, so a page the reload
    /// misses shows), the pages at 1.. in both (after the padding page).
    fn open_reader(&self, plan: &ReloadPlan, d: u32, dir: &Path, slots: u64) -> Result<Hosted> {
        let bk = self.b.as_ref();
        let positions: Vec<u64> = plan.reads_of(d).map(|r| r.position).collect();
        let k = positions.len() as u64;
        let pages: Vec<LocalPage> = (1..=k).map(LocalPage).collect();
        let host = Arc::new(HostPool::new(
            bk,
            &self.g,
            k + 1,
            HostLayout::PageFirstDirect,
        )?);
        host.fill(bk, POISON)?;
        let writers = plan.writers().ranks();
        // A read-only store writes nothing; its writer number only names it.
        let mut cfg = DiskConfig::new(dir, d % writers, writers, slots);
        cfg.read_only = true;
        cfg.timeout = STORAGE_TIMEOUT;
        let store = DiskStore::open(host.clone(), self.b.clone(), cfg)?;
        let placement = Placement::new(plan.reader().ranks())?;
        let pool = Arc::new(DevicePool::allocate(bk, &self.g, placement, d, k + 1)?);
        pool.fill(bk, POISON)?;
        Ok(Hosted {
            positions,
            host,
            store,
            reader: ReaderRank {
                backend: self.b.clone(),
                pool,
                pages: ScatterRank {
                    // Kept whole: the indexer state goes with the page.
                    state_pages: pages.clone(),
                    pages,
                },
            },
        })
    }

    /// Enqueues the reload of `hosted` (in rank order): the whole plan in one call where every
    /// reader rank is here, else each reader's pages as a plan of their own (module docs).
    fn reload_hosted(&self, plan: &ReloadPlan, hosted: &[Hosted]) -> Result<Vec<Reload>> {
        let method = Method::Kernel(self.launch());
        if hosted.len() == plan.reader().ranks() as usize {
            let mut source = PrefixSource {
                pools: hosted.iter().map(|h| h.host.clone()).collect(),
                pages: vec![(0, LocalPage(0)); plan.pages() as usize],
            };
            for (i, h) in hosted.iter().enumerate() {
                for (&p, &page) in h.positions.iter().zip(&h.reader.pages.pages) {
                    source.pages[p as usize] = (i, page);
                }
            }
            let readers: Vec<ReaderRank> = hosted.iter().map(|h| h.reader.clone()).collect();
            return Ok(vec![reload(plan, &source, &readers, method)?]);
        }
        hosted
            .iter()
            .map(|h| {
                let one = Reader::Cp(CpGroup::unsharded());
                let own = ReloadPlan::new(CpGroup::unsharded(), one, h.positions.len() as u64)?;
                let source = PrefixSource {
                    pools: vec![h.host.clone()],
                    pages: h.reader.pages.pages.iter().map(|&p| (0, p)).collect(),
                };
                reload(&own, &source, std::slice::from_ref(&h.reader), method)
            })
            .collect()
    }

    /// Byte for byte: each reader's pages, in order, against the reference's pages of
    /// `seed_ref` at the positions the plan gave it. Returns the milliseconds the check took.
    fn check_readers(
        &self,
        plan: &ReloadPlan,
        hosted: &[Hosted],
        seed_ref: &RequestChain,
    ) -> Result<f64> {
        let bk = self.b.as_ref();
        let started = Instant::now();
        let launch = self.launch();
        let reference_pages = seed_ref.pages()?;
        let most = hosted.iter().map(|h| h.positions.len()).max().unwrap_or(0);
        let staging = Arc::new(Staging::new(bk, &self.g, most.max(1) as u64)?);
        for h in hosted.iter().filter(|h| !h.positions.is_empty()) {
            let theirs = h
                .positions
                .iter()
                .map(|&p| {
                    reference_pages
                        .get(p as usize)
                        .map(|r| Placement::unsharded().local(*r))
                        .ok_or(Error::OutOfRange {
                            what: "page of the seeded prefix's reference",
                            index: i64::try_from(p).unwrap_or(i64::MAX),
                            limit: reference_pages.len() as u64,
                        })
                })
                .collect::<Result<Vec<_>>>()?;
            let mine = h.reader.pages.pages.clone();
            let got = read_in_order(bk, h.reader.pool.clone(), mine, &staging, launch)?;
            let want = read_in_order(bk, self.reference.clone(), theirs, &staging, launch)?;
            if got != want {
                return Err(Error::Verification(format!(
                    "storage: reader rank {} of {}: the prefix reloaded from disk differs from the reference",
                    h.reader.pool.rank(),
                    plan.reader()
                )));
            }
        }
        Ok(started.elapsed().as_secs_f64() * 1e3)
    }
}
