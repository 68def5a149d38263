//! The L3 stage's worker and its vocabulary (feature `nixl`): the thread that owns the
//! [`DiskStore`] and runs its jobs in order, what the controller keeps of the operations in
//! flight, and the policies and acks engines see. The controller's storage calls are in
//! `storage.rs`, on top of this.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::index::{LocalPage, LogicalPage};
use crate::key::PageKey;
use crate::pool::disk::{DiskStore, LoadOutcome, Snapshot, StoreReport};

/// When nodes on the host are written to storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoragePolicy {
    /// As soon as the node's backup to the host is acked (and its keys are known).
    WriteThrough,
    /// Only when the node leaves the host ([`HiCacheController::evict_host_sync`](super::HiCacheController::evict_host_sync)).
    WriteBack,
}

/// What a storage operation was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageOp {
    /// Host -> storage.
    Store,
    /// Storage -> host.
    Prefetch,
}

/// A completed storage operation, acked in submission order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageAck {
    /// Queue index (0, 1, 2, ... per controller, identical on every rank).
    pub index: u64,
    /// The node.
    pub node: u64,
    /// Which operation.
    pub op: StorageOp,
    /// This rank's pages of the node the operation covered.
    pub pages: usize,
    /// Whether every one of them made it: stored (or already present), or loaded. An
    /// incomplete prefetch left the node off the host.
    pub complete: bool,
    /// Pages of a store already present in storage (written by any rank), not rewritten.
    pub present: usize,
}

pub(super) enum Job {
    Store(Vec<(PageKey, LocalPage)>),
    Load(Vec<(PageKey, LocalPage)>),
    Snapshot,
    Lookup(Vec<PageKey>, Snapshot),
}

pub(super) enum Reply {
    Stored(Result<StoreReport>),
    Loaded(Result<Vec<LoadOutcome>>),
    Snapshot(Result<Snapshot>),
    Lookup(Result<usize>),
}

/// A submitted operation waiting for its reply.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) ack: StorageAck,
    /// Logical host pages a prefetch took (given back when it misses).
    pub(super) host_pages: Vec<LogicalPage>,
}

/// The worker thread owning the store, and the operations in flight.
pub(super) struct StorageStage {
    pub(super) jobs: Option<Sender<Job>>,
    pub(super) replies: Receiver<Reply>,
    pub(super) thread: Option<JoinHandle<()>>,
    pub(super) policy: StoragePolicy,
    pub(super) timeout: Duration,
    pub(super) keys: HashMap<u64, Vec<PageKey>>,
    pub(super) pending: VecDeque<Pending>,
    /// Replies received for the oldest pending operations, in order.
    pub(super) done: VecDeque<Reply>,
    pub(super) next: u64,
    /// A write-through that could not be submitted from inside `ack_backups_sync` (whose acks
    /// must still reach the caller): reported by the next storage call.
    pub(super) failed: Option<String>,
}

impl std::fmt::Debug for StorageStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageStage")
            .field("policy", &self.policy)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl Drop for StorageStage {
    fn drop(&mut self) {
        // Closing the queue ends the worker after the jobs already sent (their host pages are
        // the pool's, which the worker's store keeps alive); the join waits for them, each
        // bounded by the store's own deadline.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl StorageStage {
    pub(super) fn new(
        mut store: DiskStore,
        policy: StoragePolicy,
        timeout: Duration,
    ) -> Result<Self> {
        let (jobs, inbox) = channel::<Job>();
        let (outbox, replies) = channel::<Reply>();
        let thread = std::thread::Builder::new()
            .name("kvshard-l3".into())
            .spawn(move || {
                for job in inbox {
                    let reply = match job {
                        Job::Store(items) => Reply::Stored(store.store_sync(&items)),
                        Job::Load(items) => Reply::Loaded(store.load_sync(&items)),
                        Job::Snapshot => Reply::Snapshot(store.snapshot()),
                        Job::Lookup(keys, snap) => Reply::Lookup(store.lookup(&keys, &snap)),
                    };
                    if outbox.send(reply).is_err() {
                        break;
                    }
                }
            })
            .map_err(|source| Error::Os {
                call: "spawn the storage worker",
                source,
            })?;
        Ok(Self {
            jobs: Some(jobs),
            replies,
            thread: Some(thread),
            policy,
            timeout,
            keys: HashMap::new(),
            pending: VecDeque::new(),
            done: VecDeque::new(),
            next: 0,
            failed: None,
        })
    }

    pub(super) fn send(&self, job: Job) -> Result<()> {
        self.jobs
            .as_ref()
            .and_then(|j| j.send(job).ok())
            .ok_or_else(|| Error::HiCache("the storage worker has stopped".into()))
    }

    /// Moves every reply that has arrived into `done`, without waiting.
    pub(super) fn drain(&mut self) {
        while let Ok(r) = self.replies.try_recv() {
            self.done.push_back(r);
        }
    }

    /// Waits (until the stage's deadline) for the next reply.
    pub(super) fn recv_sync(&mut self, what: &str) -> Result<Reply> {
        let started = Instant::now();
        match self.replies.recv_timeout(self.timeout) {
            Ok(r) => Ok(r),
            Err(RecvTimeoutError::Timeout) => Err(Error::Timeout {
                what: format!("the storage worker ({what})"),
                waited: started.elapsed(),
            }),
            Err(RecvTimeoutError::Disconnected) => {
                Err(Error::HiCache("the storage worker has stopped".into()))
            }
        }
    }

    /// Sends a query and waits for its answer, keeping the replies of operations queued before
    /// it for their acks.
    pub(super) fn query_sync(&mut self, job: Job, what: &str) -> Result<Reply> {
        self.send(job)?;
        self.drain();
        while self.done.len() < self.pending.len() {
            let r = self.recv_sync(what)?;
            self.done.push_back(r);
        }
        // Everything before the query has replied: the next reply is the query's.
        let r = match self.done.len() > self.pending.len() {
            true => self.done.pop_back(),
            false => None,
        };
        match r {
            Some(r) => Ok(r),
            None => self.recv_sync(what),
        }
    }
}
