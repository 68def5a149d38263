//! The pressure scenario's storage step (feature `nixl`): the seeded prefix leaves the host
//! pools for the storage tier (written back by each page's owner), comes back L3 -> L2 -> L1
//! into new device pages of the same owners, and is checked byte for byte against the
//! unsharded reference; then, as the writers left it on disk, it is reloaded into a CP group of
//! twice the size and checked again (`cross_cp.rs`).
//!
//! - **Every rank in this process** (the demo): the directory is the step's own, private (a
//!   random name, mode 0700, removed when the step ends); rank 0's snapshot reaches the
//!   others as a value.
//! - **One rank per process** (`kvshard pd --scenario pressure`): the ranks share the private
//!   directory their parent made ([`group_directory`]) and named to them (`--storage-dir`);
//!   the parent removes it. Each rank writes its own pages, then replays the others' journals
//!   (its own snapshots, read-only on their files) until the whole prefix is there: with
//!   nothing else written, every rank's snapshot covers the same records (each says which), so
//!   their lookups agree by construction. Every rank reloads the whole prefix's pages it owns,
//!   any rank's file read, checked against its own replay of the reference.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kvshard::chain::RequestChain;
use kvshard::copy::Staging;
use kvshard::geometry::{IndexerScale, PAGE_SIZE};
use kvshard::hicache::{CacheNode, StorageAck, StoragePolicy};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::key::{Namespace, PageKey};
use kvshard::pool::disk::{DiskConfig, DiskStore, Snapshot};
use kvshard::shard::Placement;
use kvshard::{Error, Result};

use super::gather::read_in_order;
use super::report::{evicted, PrefillReport};
use super::scenario::Scenario;
use crate::measure::Moved;

/// Where the step's directories are made: `KVSHARD_STORAGE_DIR`, else the system's temporary
/// directory (it must be a filesystem with O_DIRECT; tmpfs before Linux 6.6 is not).
fn base() -> PathBuf {
    std::env::var_os("KVSHARD_STORAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

/// The private directory the rank processes of a `kvshard pd` run share: made by the parent
/// before it starts them (each gets its path), removed with everything in it when dropped.
pub(crate) fn group_directory() -> Result<tempfile::TempDir> {
    crate::storage_bench::private_dir(&base(), "kvshard-pressure-l3-group-")
}

/// How long a rank waits for the other ranks' pages to be committed.
const WAIT_FOR_GROUP: std::time::Duration = std::time::Duration::from_secs(60);

/// The deadline of every store's I/O and of the controllers' storage waits.
pub(super) const STORAGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Slots of each rank's file for a prefix of `pages` pages (room to spare): what the writers
/// open with and what a reader of their files must open with.
fn slots_for(pages: u64) -> u64 {
    pages + 8
}

/// The step's directory: with every rank in this process (`in_process`) its own private one,
/// removed when the returned guard drops however the step ends; else the one the ranks'
/// parent made (`shared`).
fn step_directory(
    in_process: bool,
    shared: Option<&Path>,
) -> Result<(Option<tempfile::TempDir>, PathBuf)> {
    let own = match in_process {
        true => Some(crate::storage_bench::private_dir(
            &base(),
            "kvshard-pressure-l3-",
        )?),
        false => None,
    };
    let dir = match (&own, shared) {
        (Some(own), _) => own.path().to_path_buf(),
        (None, Some(shared)) => shared.to_path_buf(),
        (None, None) => {
            return Err(Error::InvalidArgument(
                "the storage step of a rank process needs the directory its parent made (--storage-dir)".into(),
            ))
        }
    };
    Ok((own, dir))
}

impl Scenario {
    /// The storage step (module docs); returns what it reports. `shared` is the directory a
    /// parent made for its rank processes (`None`: every rank is here, the step makes its own).
    pub(super) fn storage_step(
        &mut self,
        seed_node: &CacheNode,
        seed_ref: &RequestChain,
        prefix_tokens: usize,
        shared: Option<&Path>,
    ) -> Result<Vec<String>> {
        if let Err(e) = kvshard::transfer::nixl::load() {
            return Ok(vec![format!("storage: SKIPPED, no NIXL runtime ({e})")]);
        }
        let in_process = self.controllers.len() == self.placement.shard() as usize;
        let (_own, dir) = step_directory(in_process, shared)?;
        let pages = seed_node.device_pages.len() as u64;
        // The prefix's pages the ranks here own (each writes those).
        let owned = seed_node
            .device_pages
            .iter()
            .filter(|p| {
                self.controllers
                    .iter()
                    .any(|c| self.placement.owner(**p) == c.device().rank())
            })
            .count();
        let (keys, queue) = self.attach_stores(&dir, seed_node, prefix_tokens)?;
        let store_ms = self.evict_to_storage(seed_node, owned)?;
        let (snapshot, waited_ms) = self.agree_on_storage(&keys, pages)?;
        let (new, room, prefetch_ms, load) =
            self.reload_from_storage(seed_node, &keys, prefix_tokens)?;
        let check_ms = self.check_reloaded(&new, seed_ref)?;
        let wider =
            self.reload_into_wider_group(&dir, slots_for(pages), seed_node, seed_ref, &keys)?;
        self.evictable.push_back(CacheNode {
            device_pages: new,
            ..seed_node.clone()
        });
        let bytes = owned as u64 * self.g.page_bytes() as u64;
        let agreed = if in_process {
            format!("rank 0's snapshot finds all {pages} pages on every rank")
        } else {
            format!(
                "rank {}'s snapshot ({:?} records per writer, {waited_ms:.1} ms after its own writes) finds all {pages} pages",
                self.controllers[0].device().rank(),
                snapshot.records()
            )
        };
        Ok(vec![
            format!(
                "storage: the {pages}-page prefix evicted from the host pools to storage (NIXL POSIX on {queue}), each rank writing the pages it owns: {:.1} MB here in {store_ms:.1} ms ({:.2} GB/s); {agreed}",
                bytes as f64 / 1e6,
                bytes as f64 / store_ms.max(1e-3) / 1e6
            ),
            format!(
                "storage: reloaded L3 -> L2 ({prefetch_ms:.1} ms, {:.2} GB/s) -> L1 ({load}) into new pages of the same owners, making room {}; byte-identical to the unsharded reference (verified in {check_ms:.1} ms)",
                bytes as f64 / prefetch_ms.max(1e-3) / 1e6,
                evicted(&room)
            ),
            wider,
        ])
    }

    /// Opens a store in `dir` for every local rank's host pool and attaches it (write-back),
    /// the prefix's keys (`prefix_tokens` seeded token ids) set on `seed_node`. Returns the keys
    /// and the I/O queue the stores run on.
    fn attach_stores(
        &mut self,
        dir: &Path,
        seed_node: &CacheNode,
        prefix_tokens: usize,
    ) -> Result<(Vec<PageKey>, String)> {
        let b = self.b.clone();
        let writers = self.placement.shard();
        let pages = seed_node.device_pages.len() as u64;
        // The demo has no tokenizer: seeded synthetic token ids stand for the prefix's.
        let tokens: Vec<u32> = (0..prefix_tokens as u64)
            .map(|i| (self.seed.wrapping_mul(0x9E37_79B9).wrapping_add(i * 7919)) as u32)
            .collect();
        let ns = Namespace::new(&self.g, IndexerScale::Ue8m0, b"kvshard-pressure")?;
        let keys = PageKey::chain(&ns, &tokens, None);
        let mut queue = String::new();
        for c in self.controllers.iter_mut() {
            let host = c.host().clone();
            let rank = c.device().rank();
            let mut cfg = DiskConfig::new(dir, rank, writers, slots_for(pages));
            cfg.timeout = STORAGE_TIMEOUT;
            let store = DiskStore::open(host, b.clone(), cfg)?;
            queue = store.io_queue().to_string();
            c.attach_storage(store, StoragePolicy::WriteBack, STORAGE_TIMEOUT)?;
            c.set_keys(seed_node.id, keys.clone())?;
        }
        Ok((keys, queue))
    }

    /// L2 -> L3: the prefix leaves every host pool, each rank writing the pages it owns
    /// (`owned` here, all of them written and the prefix gone from the host, or an error).
    /// Returns the milliseconds it took.
    fn evict_to_storage(&mut self, seed_node: &CacheNode, owned: usize) -> Result<f64> {
        let started = Instant::now();
        let mut acks: Vec<StorageAck> = Vec::new();
        for c in self.controllers.iter_mut() {
            acks.extend(c.evict_host_sync(seed_node.id)?);
        }
        let store_ms = started.elapsed().as_secs_f64() * 1e3;
        let written: usize = acks.iter().map(|a| a.pages).sum();
        if written != owned || acks.iter().any(|a| !a.complete) {
            return Err(Error::Verification(format!(
                "storage: {written} of the {owned} prefix pages owned here written back ({acks:?})"
            )));
        }
        if self
            .controllers
            .iter()
            .any(|c| c.host_pages(seed_node.id).is_some())
        {
            return Err(Error::Verification(
                "storage: the prefix is still on the host after its eviction".into(),
            ));
        }
        Ok(store_ms)
    }

    /// Every rank agrees the whole prefix (`pages` pages of `keys`) is in storage: the first
    /// rank here takes snapshots (replaying the other writers' journals) until it covers the
    /// prefix, which with every rank here is at once; across processes, once every rank has
    /// written. Returns the snapshot and how long the wait took.
    fn agree_on_storage(&mut self, keys: &[PageKey], pages: u64) -> Result<(Snapshot, f64)> {
        let waited = Instant::now();
        let snapshot = loop {
            let snapshot = self.controllers[0].storage_snapshot_sync()?;
            let hit = self.controllers[0].storage_lookup_sync(keys, &snapshot)?;
            if hit as u64 == pages {
                break snapshot;
            }
            if waited.elapsed() > WAIT_FOR_GROUP {
                return Err(Error::Verification(format!(
                    "storage: after {WAIT_FOR_GROUP:?} rank {}'s snapshot ({:?} records per writer) finds {hit} of {pages} prefix pages",
                    self.controllers[0].device().rank(),
                    snapshot.records()
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        };
        let waited_ms = waited.elapsed().as_secs_f64() * 1e3;
        for c in self.controllers.iter_mut() {
            let hit = c.storage_lookup_sync(keys, &snapshot)?;
            if hit as u64 != pages {
                return Err(Error::Verification(format!(
                    "storage: rank {} finds {hit} of {pages} prefix pages",
                    c.device().rank()
                )));
            }
        }
        Ok((snapshot, waited_ms))
    }

    /// L3 -> L2 -> L1 into new device pages of the same owners (room made first): the new
    /// pages, what making room evicted, the prefetch's milliseconds and the load.
    fn reload_from_storage(
        &mut self,
        seed_node: &CacheNode,
        keys: &[PageKey],
        prefix_tokens: usize,
    ) -> Result<(Vec<LogicalPage>, PrefillReport, f64, Moved)> {
        let mut room = PrefillReport::default();
        let stride = u64::from(self.placement.shard()) * PAGE_SIZE as u64;
        self.make_room(prefix_tokens as u64 + stride, &mut room)?;
        let new = self.alloc.alloc_matching(&seed_node.device_pages)?;
        let node = CacheNode {
            device_pages: new.clone(),
            ..seed_node.clone()
        };
        let started = Instant::now();
        for c in self.controllers.iter_mut() {
            c.prefetch(&node, keys.to_vec())?;
        }
        for c in self.controllers.iter_mut() {
            let ack = c.ack_storage_sync(1)?;
            if !ack.iter().all(|a| a.complete) {
                return Err(Error::Verification(format!(
                    "storage: rank {} prefetched the prefix incompletely ({ack:?})",
                    c.device().rank()
                )));
            }
        }
        let prefetch_ms = started.elapsed().as_secs_f64() * 1e3;
        let load = self.load(seed_node.id, &new)?;
        Ok((new, room, prefetch_ms, load))
    }

    /// Byte for byte against the reference (`seed_ref`), rank by rank: the prefix reloaded into
    /// pages `new`. Returns the milliseconds the check took.
    fn check_reloaded(&self, new: &[LogicalPage], seed_ref: &RequestChain) -> Result<f64> {
        let b = self.b.clone();
        let bk = b.as_ref();
        let check = Instant::now();
        let launch = self.launch();
        let reference_pages = seed_ref.pages()?.to_vec();
        for pool in &self.ranks {
            let (mine, theirs): (Vec<LocalPage>, Vec<LocalPage>) = new
                .iter()
                .zip(&reference_pages)
                .filter(|(p, _)| self.placement.owner(**p) == pool.rank())
                .map(|(p, r)| (self.placement.local(*p), Placement::unsharded().local(*r)))
                .unzip();
            if mine.is_empty() {
                continue;
            }
            let staging = Arc::new(Staging::new(bk, &self.g, mine.len() as u64)?);
            let got = read_in_order(bk, pool.clone(), mine, &staging, launch)?;
            let want = read_in_order(bk, self.reference.clone(), theirs, &staging, launch)?;
            if got != want {
                return Err(Error::Verification(format!(
                    "storage: rank {}'s prefix reloaded from storage differs from the reference",
                    pool.rank()
                )));
            }
        }
        let check_ms = check.elapsed().as_secs_f64() * 1e3;
        Ok(check_ms)
    }
}
