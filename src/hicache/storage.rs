//! The L3 stage of the HiCache controller (feature `nixl`): host pool <-> storage tier
//! ([`DiskStore`]), on a worker thread that owns the store, so that no call blocks the host
//! except those named `_sync`, and each of those has a deadline.
//!
//! - **Writes** (L2 -> L3) store a node's host pages that this rank owns (each page is written
//!   once, by its owner: a page-sharded host pool holds only its rank's pages). Under
//!   [`StoragePolicy::WriteThrough`] a node is stored as soon as its backup to the host is acked
//!   (the host bytes are complete then); under [`StoragePolicy::WriteBack`] only when it leaves
//!   the host ([`HiCacheController::evict_host_sync`], which waits for the write before freeing
//!   the host pages). [`HiCacheController::store`] stores a node explicitly.
//! - **Prefetch** (L3 -> L2) takes host pages for a node from the host allocator and loads its
//!   pages into them ahead of a load; once acked complete, the node is on the host and
//!   [`HiCacheController::load`] moves it to the device with per-layer readiness as ever. A
//!   prefetch that missed a page of this rank (absent, or failing its checksum) acks
//!   incomplete and gives its host pages back: the group takes the minimum, as for hits.
//! - **Acks** are FIFO, per controller, with the same indices on every rank: a rank that owns
//!   none of a node's pages submits an empty operation, acked in turn like the others.
//!   [`HiCacheController::poll_storage`] counts completed operations from the oldest;
//!   [`HiCacheController::ack_storage_sync`] pops them.
//! - **Lookups** ([`HiCacheController::storage_lookup_sync`]) run on the worker after every
//!   operation submitted before them, against a [`Snapshot`] the group agreed on
//!   ([`HiCacheController::storage_snapshot_sync`] on one rank).

use std::time::Duration;

use super::controller::{CacheNode, HiCacheController, HostNode};
use super::storage_stage::{
    Job, Pending, Reply, StorageAck, StorageOp, StoragePolicy, StorageStage,
};
use crate::error::{Error, Result};
use crate::index::{LocalPage, LogicalPage};
use crate::key::PageKey;
use crate::pool::disk::{DiskStore, LoadOutcome, Snapshot};

impl HiCacheController {
    /// Puts `store` (opened for this controller's host pool) below the host pool, written to
    /// under `policy`; every `_sync` storage call waits at most `timeout` (more than zero, at
    /// most [`MAX_TIMEOUT`](crate::pool::disk::MAX_TIMEOUT): else [`Error::InvalidArgument`]).
    pub fn attach_storage(
        &mut self,
        store: DiskStore,
        policy: StoragePolicy,
        timeout: Duration,
    ) -> Result<()> {
        crate::pool::disk::check_timeout(timeout, "the controller's storage timeout")?;
        if !std::sync::Arc::ptr_eq(store.host(), self.host()) {
            return Err(Error::InvalidArgument(
                "the store was opened for another host pool than the controller's".into(),
            ));
        }
        if self.storage.is_some() {
            return Err(Error::HiCache("storage is already attached".into()));
        }
        self.storage = Some(StorageStage::new(store, policy, timeout)?);
        Ok(())
    }

    fn stage(&mut self) -> Result<&mut StorageStage> {
        let stage = self
            .storage
            .as_mut()
            .ok_or_else(|| Error::HiCache("no storage attached".into()))?;
        match stage.failed.take() {
            Some(why) => Err(Error::HiCache(format!(
                "an earlier write-through failed: {why}"
            ))),
            None => Ok(stage),
        }
    }

    /// Gives `node` its storage keys, one per page in chain order (what SGLang's page-hash chain
    /// gives; [`PageKey::chain`]). Needed before the node is stored or prefetched; under
    /// write-through, a node whose backup is already acked is stored now.
    pub fn set_keys(&mut self, node: u64, keys: Vec<PageKey>) -> Result<()> {
        let policy = self.stage()?.policy;
        self.stage()?.keys.insert(node, keys);
        if policy == StoragePolicy::WriteThrough && self.host_pages(node).is_some() {
            self.store(node)?;
        }
        Ok(())
    }

    /// Called by [`HiCacheController::ack_backups_sync`] for each node acked on the host. A
    /// store that cannot be submitted does not lose the backup acks: the next storage call
    /// reports it.
    pub(super) fn on_backup_acked(&mut self, node: u64) {
        let due = self
            .storage
            .as_ref()
            .is_some_and(|s| s.policy == StoragePolicy::WriteThrough && s.keys.contains_key(&node));
        if due {
            if let Err(e) = self.store(node) {
                if let Some(stage) = self.storage.as_mut() {
                    stage
                        .failed
                        .get_or_insert_with(|| format!("node {node}: {e}"));
                }
            }
        }
    }

    /// This rank's (key, local host page) pairs of `host_pages` with `keys`.
    fn owned_items(
        &self,
        host_pages: &[LogicalPage],
        keys: &[PageKey],
    ) -> Result<Vec<(PageKey, LocalPage)>> {
        if keys.len() != host_pages.len() {
            return Err(Error::InvalidArgument(format!(
                "{} keys for {} pages",
                keys.len(),
                host_pages.len()
            )));
        }
        let placement = self.device().placement();
        let rank = self.device().rank();
        Ok(host_pages
            .iter()
            .zip(keys)
            .filter(|(p, _)| placement.owner(**p) == rank)
            .map(|(p, k)| (*k, placement.local(*p)))
            .collect())
    }

    /// Writes acked host node `node`'s pages of this rank to storage (none: an empty operation,
    /// acked in turn). Returns the queue index.
    pub fn store(&mut self, node: u64) -> Result<u64> {
        let host_pages = self
            .host_pages(node)
            .ok_or_else(|| Error::HiCache(format!("node {node} has no acked backup to store")))?
            .to_vec();
        let keys = self
            .stage()?
            .keys
            .get(&node)
            .cloned()
            .ok_or_else(|| Error::HiCache(format!("node {node} has no storage keys")))?;
        let items = self.owned_items(&host_pages, &keys)?;
        let stage = self.stage()?;
        let index = stage.next;
        stage.send(Job::Store(items.clone()))?;
        stage.next += 1;
        stage.pending.push_back(Pending {
            ack: StorageAck {
                index,
                node,
                op: StorageOp::Store,
                pages: items.len(),
                complete: false,
                present: 0,
            },
            host_pages: Vec::new(),
        });
        Ok(index)
    }

    /// Loads `node` (whose `keys` are given) from storage into host pages taken from the host
    /// allocator as [`CacheNode::alloc_host_pages`] says, ahead of a [`HiCacheController::load`].
    /// Once acked complete the node is on the host. Returns the queue index. Refused, with
    /// nothing taken, while the node is on the host or a storage operation of it is pending (a
    /// second prefetch before the first's ack would take a second set of host pages for it).
    /// The worker's load waits for the work queued on those host pages (their last reads and
    /// writes, on any stream) before it writes them, as [`DiskStore::load_sync`] does.
    pub fn prefetch(&mut self, node: &CacheNode, keys: Vec<PageKey>) -> Result<u64> {
        if self.host_nodes.contains_key(&node.id) {
            return Err(Error::HiCache(format!(
                "node {} is already on the host",
                node.id
            )));
        }
        if self.storage_busy(node.id) {
            return Err(Error::HiCache(format!(
                "node {} has a storage operation pending: ack it first",
                node.id
            )));
        }
        self.stage()?;
        let host_pages = node.alloc_host_pages(&mut self.allocator)?;
        let items = match self.owned_items(&host_pages, &keys) {
            Ok(items) => items,
            Err(e) => {
                self.allocator.free(&host_pages)?;
                return Err(e);
            }
        };
        let stage = self.stage()?;
        if let Err(e) = stage.send(Job::Load(items.clone())) {
            self.allocator.free(&host_pages)?;
            return Err(e);
        }
        let index = stage.next;
        stage.next += 1;
        stage.keys.insert(node.id, keys);
        stage.pending.push_back(Pending {
            ack: StorageAck {
                index,
                node: node.id,
                op: StorageOp::Prefetch,
                pages: items.len(),
                complete: false,
                present: 0,
            },
            host_pages,
        });
        Ok(index)
    }

    /// How many storage operations, from the oldest, have completed (what the shard group
    /// takes the minimum of before acking).
    pub fn poll_storage(&mut self) -> Result<usize> {
        let stage = self.stage()?;
        stage.drain();
        Ok(stage.done.len().min(stage.pending.len()))
    }

    /// Pops the `count` oldest storage operations, in order, waiting for them (each wait
    /// bounded by the stage's timeout). A completed prefetch puts its node on the host; one
    /// that missed gives its host pages back. A failed operation is an error after the
    /// operations before it were acked (they are lost with it: the caller reacts to the error).
    pub fn ack_storage_sync(&mut self, count: usize) -> Result<Vec<StorageAck>> {
        let pending = self.stage()?.pending.len();
        if count > pending {
            return Err(Error::HiCache(format!(
                "{count} storage acks asked for, {pending} operations pending"
            )));
        }
        let mut acks = Vec::with_capacity(count);
        for _ in 0..count {
            let stage = self.stage()?;
            let reply = match stage.done.pop_front() {
                Some(r) => r,
                None => stage.recv_sync("an operation to ack")?,
            };
            let Some(Pending {
                mut ack,
                host_pages,
            }) = stage.pending.pop_front()
            else {
                break;
            };
            match reply {
                Reply::Stored(r) => {
                    let r = r?;
                    ack.present = r.present;
                    ack.complete = r.written + r.present == ack.pages;
                }
                Reply::Loaded(r) => {
                    let outcomes = match r {
                        Ok(o) => o,
                        Err(e) => {
                            self.allocator.free(&host_pages)?;
                            return Err(e);
                        }
                    };
                    ack.complete = outcomes.iter().all(|o| *o == LoadOutcome::Loaded);
                    if ack.complete {
                        self.host_nodes.insert(
                            ack.node,
                            HostNode {
                                host_pages,
                                acked: true,
                            },
                        );
                    } else {
                        self.allocator.free(&host_pages)?;
                    }
                }
                Reply::Snapshot(_) | Reply::Lookup(_) => {
                    return Err(Error::HiCache("a query's reply in the ack queue".into()))
                }
            }
            acks.push(ack);
        }
        Ok(acks)
    }

    /// `node` is leaving the host pool: under write-back it is stored first (blocking, bounded
    /// by the stage's timeout), and every storage ack up to its own is popped and returned;
    /// then its host pages go back to the allocator. Refused while a transfer of the node is
    /// in flight.
    pub fn evict_host_sync(&mut self, node: u64) -> Result<Vec<StorageAck>> {
        let mut acks = Vec::new();
        if let Some(stage) = self.storage.as_ref() {
            let write_back =
                stage.policy == StoragePolicy::WriteBack && stage.keys.contains_key(&node);
            if write_back && self.host_pages(node).is_some() {
                self.store(node)?;
            }
            let last = self
                .stage()?
                .pending
                .iter()
                .rposition(|p| p.ack.node == node);
            if let Some(at) = last {
                acks = self.ack_storage_sync(at + 1)?;
            }
        }
        self.free_host(node)?;
        if let Some(stage) = self.storage.as_mut() {
            stage.keys.remove(&node);
        }
        Ok(acks)
    }

    /// Whether a storage operation of `node` is pending (its host pages are in use).
    pub(super) fn storage_busy(&self, node: u64) -> bool {
        self.storage
            .as_ref()
            .is_some_and(|s| s.pending.iter().any(|p| p.ack.node == node))
    }

    /// Takes a snapshot of the group's storage (one rank takes it; every rank looks up with
    /// it), after every operation submitted before.
    pub fn storage_snapshot_sync(&mut self) -> Result<Snapshot> {
        match self.stage()?.query_sync(Job::Snapshot, "a snapshot")? {
            Reply::Snapshot(s) => s,
            _ => Err(Error::HiCache(
                "the storage worker answered out of order".into(),
            )),
        }
    }

    /// How many leading keys of `keys` are in storage as of `snapshot` (the same on every rank
    /// for the same snapshot), after every operation submitted before.
    pub fn storage_lookup_sync(&mut self, keys: &[PageKey], snapshot: &Snapshot) -> Result<usize> {
        let job = Job::Lookup(keys.to_vec(), snapshot.clone());
        match self.stage()?.query_sync(job, "a lookup")? {
            Reply::Lookup(n) => n,
            _ => Err(Error::HiCache(
                "the storage worker answered out of order".into(),
            )),
        }
    }
}
