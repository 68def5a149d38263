//! Runs a [`ReloadPlan`] (docs/storage.md, "Reloading with another parallelism"): a prefix
//! cached in host pools (the pages HiCache backed up, or the pages a `DiskStore` loaded) moved
//! into the device pools of a group of another parallelism. Each reader rank enqueues on its
//! own stream, per host pool it reads from, one launch:
//!
//! - where the reader keeps pages whole (a CP group, an unsharded server, a decode layout of
//!   whole pages): a HiCache load ([`HostTransfer`]) of its pages from the host pool into its
//!   pages of the prefix (any host layout and any method a load takes; every component of a
//!   page to one page);
//! - where rows of a page spread over the decode ranks: one `kvs_decode_scatter` of the pages
//!   it reads into every decode rank's rows (the copy layer's [`DecodeScatterPlan`]; the host
//!   pool's blocks packed: `layer_first`), read through the host pool's
//!   device alias as a block copy reads it, the other ranks' pools mapped into its address
//!   space.
//!
//! Nothing here waits: the launches are ordered after other streams' work on the pools by
//! their usage records, and the caller waits for the returned events (or any later work on the
//! pools follows them by itself).

use std::sync::Arc;

use super::direct::{check_direct, HostTransfer};
use super::transfer_plan::TransferPlan;
use crate::backend::{Backend, Event, KernelFamily, Launch};
use crate::copy::{
    BlockSpace, DecodeScatterPlan, Direction, Layers, Method, ScatterRank, ScatterSection,
    TableStore,
};
use crate::error::{Error, Result};
use crate::index::LocalPage;
use crate::pool::host::HostPool;
use crate::pool::DevicePool;
use crate::shard::{Reader, ReloadPlan};

const PAGE: u64 = crate::geometry::PAGE_SIZE as u64;

/// Where the prefix's pages are: host pools, and per sequence page the pool (an index into
/// `pools`) and its page there.
#[derive(Debug, Clone)]
pub struct PrefixSource {
    /// The host pools holding pages of the prefix.
    pub pools: Vec<Arc<HostPool>>,
    /// Per sequence page: (index into `pools`, page of that pool).
    pub pages: Vec<(usize, LocalPage)>,
}

/// One reader rank: the stream it enqueues on, its device pool and its pages of the prefix
/// ([`ReloadPlan::pages_on`] of them, its first local page first).
#[derive(Clone)]
pub struct ReaderRank {
    /// The rank's stream.
    pub backend: Arc<dyn Backend>,
    /// Its device pool.
    pub pool: Arc<DevicePool>,
    /// Its pages of the prefix: latent (`pages`) and indexer state (`state_pages`: the same
    /// pages, or empty, where pages are kept whole; a decode rank may register others).
    pub pages: ScatterRank,
}

impl std::fmt::Debug for ReaderRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReaderRank")
            .field("backend", &self.backend.name())
            .field("pages", &self.pages)
            .finish()
    }
}

/// A reload enqueued: what keeps its launches' tables and spaces until they have run, and
/// their events.
#[derive(Debug)]
pub struct Reload {
    _stores: Vec<TableStore>,
    _transfers: Vec<HostTransfer>,
    events: Vec<Event>,
    bytes: u64,
}

impl Reload {
    /// One event per reader rank that enqueued anything, on its stream after its last launch.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Bytes the launches move (each read once and written once).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Enqueues `plan` from `source` into `readers` (one per reader rank, in rank order) with
/// `method`: pages kept whole move as a HiCache load ([`HostTransfer`], any method it takes);
/// rows scattered take [`Method::Kernel`] (anything else is [`Error::UnsupportedMethod`]): its
/// CTAs, of its threads up to what the decode kernels take (so a HiCache load's host-I/O shape,
/// [`Method::host_io`], serves both).
/// Everything is checked before anything is enqueued: the source names every page of the plan
/// once, in its pools; each reader holds exactly its share of pages, in its pool; and every
/// transfer and scatter is checked against its pools.
pub fn reload(
    plan: &ReloadPlan,
    source: &PrefixSource,
    readers: &[ReaderRank],
    method: Method,
) -> Result<Reload> {
    check(plan, source, readers)?;
    let kernel = match method {
        Method::Kernel(launch) => Some(launch),
        _ => None,
    };
    let unsupported = || Error::UnsupportedMethod {
        method: method.to_string(),
        route: "a reload scattering rows over decode ranks",
        accepts: "Kernel",
    };
    if plan.scatters() {
        kernel.ok_or_else(unsupported)?;
    } else {
        check_direct(method)?;
    }
    // Every launch planned (and so checked) before the first is enqueued.
    let mut planned = Vec::new();
    for d in 0..readers.len() {
        for (p, pool) in source.pools.iter().enumerate() {
            let entries: Vec<(LocalPage, u64)> = plan
                .reads_of(d as u32)
                .filter(|r| source.pages[r.position as usize].0 == p)
                .map(|r| (source.pages[r.position as usize].1, r.position))
                .collect();
            if !entries.is_empty() {
                planned.push(plan_one(plan, readers, d, pool.clone(), &entries)?);
            }
        }
    }
    let mut stores: Vec<TableStore> = readers
        .iter()
        .map(|r| TableStore::new(r.backend.clone()))
        .collect();
    let mut transfers = Vec::new();
    let mut enqueued = vec![false; readers.len()];
    let mut bytes = 0;
    for one in planned {
        match one {
            Planned::Load(d, mut transfer) => {
                let backend = readers[d].backend.as_ref();
                bytes += transfer.bytes(Layers::All)?;
                if kernel.is_some() {
                    transfer.prepare_kernel(backend, &mut Vec::new())?;
                }
                transfer.run(backend, method, Layers::All)?;
                transfers.push(*transfer);
                enqueued[d] = true;
            }
            Planned::Scatter(d, scatter, src, dsts) => {
                let launch = kernel.ok_or_else(unsupported)?;
                let launch = Launch {
                    threads: launch
                        .threads
                        .min(readers[d].backend.max_threads(KernelFamily::DecodeScatter)),
                    ..launch
                };
                bytes += scatter.bytes();
                enqueued[d] |= stores[d]
                    .launch_scatter(&scatter, &src, &dsts, launch)?
                    .is_some();
            }
        }
    }
    // One event per rank that enqueued anything, after its last launch.
    let events = readers
        .iter()
        .zip(enqueued)
        .filter(|(_, e)| *e)
        .map(|(r, _)| r.backend.record())
        .collect::<Result<Vec<_>>>()?;
    Ok(Reload {
        _stores: stores,
        _transfers: transfers,
        events,
        bytes,
    })
}

/// One reader rank's launch from one host pool, planned.
enum Planned {
    Load(usize, Box<HostTransfer>),
    Scatter(
        usize,
        Box<DecodeScatterPlan>,
        Arc<dyn BlockSpace>,
        Vec<Arc<dyn BlockSpace>>,
    ),
}

/// Plans reader `d`'s launch of `entries` ((host page, sequence page)) from `pool`.
fn plan_one(
    plan: &ReloadPlan,
    readers: &[ReaderRank],
    d: usize,
    pool: Arc<HostPool>,
    entries: &[(LocalPage, u64)],
) -> Result<Planned> {
    let reader = &readers[d];
    match plan.reader() {
        Reader::Decode(layout) if plan.scatters() => {
            let src: Arc<dyn BlockSpace> = pool;
            let dsts: Vec<Arc<dyn BlockSpace>> = readers
                .iter()
                .map(|r| r.pool.clone() as Arc<dyn BlockSpace>)
                .collect();
            let refs: Vec<&dyn BlockSpace> = dsts.iter().map(|s| s.as_ref()).collect();
            let section = |indexer: bool| ScatterSection {
                components: reader
                    .pool
                    .components()
                    .iter()
                    .map(|c| c.component)
                    .filter(|c| c.is_indexer() == indexer)
                    .collect(),
                entries: entries.to_vec(),
            };
            let ranks: Vec<ScatterRank> = readers.iter().map(|r| r.pages.clone()).collect();
            let scatter = DecodeScatterPlan::new(
                src.as_ref(),
                &refs,
                layout,
                plan.tokens(),
                section(false),
                section(true),
                &ranks,
            )?;
            Ok(Planned::Scatter(d, Box::new(scatter), src, dsts))
        }
        _ => {
            // Whole pages: sequence page P is the keeping rank's page `first / 64`. A HiCache
            // load pairs logical pages of one placement; the host pool's local pages are named
            // as the reader rank's logical pages of its device pool's placement (the host pool
            // may be another group's: only its local pages matter).
            let (placement, rank) = (reader.pool.placement(), reader.pool.rank());
            let logical = |page: LocalPage| {
                placement.logical(rank, page).ok_or_else(|| {
                    Error::overflow(format!("logical page of local page {}", page.0))
                })
            };
            let pages = &reader.pages.pages;
            let device = entries
                .iter()
                .map(|&(_, position)| {
                    logical(pages[(plan.keeps(position)[0].first / PAGE) as usize])
                })
                .collect::<Result<Vec<_>>>()?;
            let host = entries
                .iter()
                .map(|&(page, _)| logical(page))
                .collect::<Result<Vec<_>>>()?;
            let transfer_plan = TransferPlan::new(
                placement,
                rank,
                &device,
                &host,
                reader.pool.pages(),
                pool.pages(),
            )?;
            let transfer =
                HostTransfer::new(reader.pool.clone(), pool, transfer_plan, Direction::Load)?;
            Ok(Planned::Load(d, Box::new(transfer)))
        }
    }
}

/// The checks of [`reload`] the copy layer does not make.
fn check(plan: &ReloadPlan, source: &PrefixSource, readers: &[ReaderRank]) -> Result<()> {
    if readers.len() != plan.reader().ranks() as usize {
        return Err(Error::InvalidArgument(format!(
            "a reload into {}: {} reader ranks given",
            plan.reader(),
            readers.len()
        )));
    }
    if source.pages.len() as u64 != plan.pages() {
        return Err(Error::InvalidArgument(format!(
            "a reload of {} pages: the source names {}",
            plan.pages(),
            source.pages.len()
        )));
    }
    for &(p, page) in &source.pages {
        let pool = source.pools.get(p).ok_or(Error::OutOfRange {
            what: "reload source pool",
            index: i64::try_from(p).unwrap_or(i64::MAX),
            limit: source.pools.len() as u64,
        })?;
        if page.0 >= pool.pages() {
            return Err(Error::OutOfRange {
                what: "reload source page",
                index: i64::try_from(page.0).unwrap_or(i64::MAX),
                limit: pool.pages(),
            });
        }
    }
    for p in 0..source.pools.len() {
        crate::copy::check_distinct(
            source
                .pages
                .iter()
                .filter(|&&(q, _)| q == p)
                .map(|&(_, page)| page.0),
            "reload source page",
        )?;
    }
    for (d, reader) in readers.iter().enumerate() {
        let want = plan.pages_on(d as u32) as usize;
        let ScatterRank { pages, state_pages } = &reader.pages;
        // A whole-page copy moves every component of a page to one page.
        let whole = !plan.scatters() && !state_pages.is_empty() && state_pages != pages;
        let state_ok = state_pages.is_empty() || state_pages.len() == want;
        if pages.len() != want || !state_ok || whole {
            return Err(Error::InvalidArgument(format!(
                "reader rank {d} of {} holds {want} pages of the prefix; given {} pages and {} \
                 state pages{}",
                plan.reader(),
                pages.len(),
                state_pages.len(),
                if whole {
                    " (pages kept whole: the state pages must be the same pages)"
                } else {
                    ""
                }
            )));
        }
        if let Some(bad) = pages
            .iter()
            .chain(state_pages)
            .find(|p| p.0 >= reader.pool.pages())
        {
            return Err(Error::OutOfRange {
                what: "reader rank page",
                index: i64::try_from(bad.0).unwrap_or(i64::MAX),
                limit: reader.pool.pages(),
            });
        }
    }
    Ok(())
}

/// Loads the pages reader rank `rank` reads from its `store` into its host pool (the store's),
/// at `host_pages` (one per page it reads, in sequence order; `keys` the prefix's, one per
/// page): the disk half of a reload, after which the reader's host pool is the
/// [`PrefixSource`] of those pages. Returns what each load found; a page not loaded leaves its
/// host page untouched and must not be reloaded. Blocks (`_sync`) as
/// [`DiskStore::load_sync`](crate::pool::disk::DiskStore::load_sync) does.
#[cfg(feature = "nixl")]
pub fn load_reads_sync(
    plan: &ReloadPlan,
    rank: u32,
    store: &mut crate::pool::disk::DiskStore,
    keys: &[crate::key::PageKey],
    host_pages: &[LocalPage],
) -> Result<Vec<crate::pool::disk::LoadOutcome>> {
    plan.reader()
        .ranks()
        .checked_sub(1)
        .filter(|&last| rank <= last)
        .ok_or(Error::OutOfRange {
            what: "reader rank",
            index: i64::from(rank),
            limit: u64::from(plan.reader().ranks()),
        })?;
    if keys.len() as u64 != plan.pages() {
        return Err(Error::InvalidArgument(format!(
            "a reload of {} pages given {} keys",
            plan.pages(),
            keys.len()
        )));
    }
    let items: Vec<(crate::key::PageKey, LocalPage)> = plan
        .reads_of(rank)
        .map(|r| keys[r.position as usize])
        .zip(host_pages.iter().copied())
        .collect();
    let reads = plan.reads_of(rank).count();
    if host_pages.len() != reads {
        return Err(Error::InvalidArgument(format!(
            "reader rank {rank} reads {reads} pages; given {} host pages",
            host_pages.len()
        )));
    }
    store.load_sync(&items)
}
