//! [`DiskStore`]: one rank's view of its CP group's storage directory.

use std::fs::File;
use std::sync::Arc;
use std::time::Instant;

use super::dir::{How, StoreDir, WriterLock};
use super::io::{FileIo, Io, IoQueue, Posted};
use super::journal::{self, Header, Item, Journal, Step, Tail};
use super::key_index::Index;
use super::slots::{check_page, runs, storage, SlotLayout};
use super::types::{DiskConfig, DiskStats, Snapshot};
use crate::backend::Backend;
use crate::error::{Error, Result, StorageFailure};
use crate::index::LocalPage;
use crate::key::PageKey;
use crate::pool::host::HostPool;

/// One rank's storage tier below its host pool (the module docs tell the design).
pub struct DiskStore {
    config: DiskConfig,
    host: Arc<HostPool>,
    /// The host pool's backend: what the store's waits for queued work ask.
    backend: Arc<dyn Backend>,
    /// Process address of each host buffer.
    bases: Vec<usize>,
    layout: SlotLayout,
    header: Header,
    io: FileIo,
    dir: StoreDir,
    /// This rank's journal, slot file (for syncing the data it wrote) and writer lock; `None`
    /// read-only.
    journal: Option<Journal>,
    own_data: Option<File>,
    _lock: Option<WriterLock>,
    /// Per writer: its journal reader (peers), and its slot file's index in `io`.
    tails: Vec<Option<Tail>>,
    files: Vec<Option<usize>>,
    index: Index,
    stats: DiskStats,
}

mod load;
mod open;
mod storing;

impl std::fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStore")
            .field("dir", &self.dir.path())
            .field("writer", &self.config.writer)
            .field("writers", &self.config.writers)
            .field("read_only", &self.config.read_only)
            .field("slot_bytes", &self.layout.slot_bytes())
            .field("used_slots", &self.index.used())
            .field("io", &self.io)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// The name of writer `writer`'s slot file.
fn data_name(writer: u32) -> String {
    format!("w{writer:04}.slots")
}

/// The error of a write asked of a read-only store.
fn read_only(dir: &std::path::Path) -> Error {
    storage(
        dir,
        StorageFailure::ReadOnly,
        "this store was opened read-only (DiskConfig::read_only)",
    )
}

/// The rank an index of a read-only store calls its own: none of the writers.
const NO_WRITER: u32 = u32::MAX;

/// A slot file opened for direct I/O, read and write (created when absent), or read only.
const DATA_WRITE: How = How {
    write: true,
    create: true,
    exclusive: false,
    direct: true,
};
const DATA_READ: How = How {
    write: false,
    create: false,
    exclusive: false,
    direct: true,
};

impl DiskStore {
    /// Whether `w` is this rank writing (its records are in the index from its own journal,
    /// never replayed from disk).
    fn writes(&self, w: u32) -> bool {
        !self.config.read_only && w == self.config.writer
    }

    /// Whether this store was opened read-only.
    pub fn read_only(&self) -> bool {
        self.config.read_only
    }

    /// The queue NIXL's POSIX backend runs on (libaio says why io_uring was not used).
    pub fn io_queue(&self) -> &IoQueue {
        self.io.queue()
    }

    /// Bytes of one slot (a page of every component, padded to the direct-I/O alignment).
    pub fn slot_bytes(&self) -> u64 {
        self.layout.slot_bytes()
    }

    /// Bytes of one page's data.
    pub fn page_bytes(&self) -> u64 {
        self.layout.page_bytes()
    }

    /// Slots of this rank holding a page.
    pub fn used_slots(&self) -> u64 {
        self.index.used()
    }

    /// Counters since open.
    pub fn stats(&self) -> DiskStats {
        self.stats
    }

    /// The host pool this store reads and writes.
    pub fn host(&self) -> &Arc<HostPool> {
        &self.host
    }

    /// Takes a snapshot: reads what every other rank has committed since the last one (only
    /// whole records that check) and returns the per-writer counts. One rank takes it; the
    /// others pass it to [`DiskStore::lookup`].
    pub fn snapshot(&mut self) -> Result<Snapshot> {
        for w in 0..self.config.writers {
            if !self.writes(w) {
                self.catch_up(w, None)?;
            }
        }
        Ok(Snapshot::from_records(self.index.replayed().to_vec()))
    }

    /// Replays writer `w`'s journal up to `limit` records (`None`: all whole ones), counting
    /// the damaged records it skips.
    fn catch_up(&mut self, w: u32, limit: Option<u64>) -> Result<()> {
        let wi = w as usize;
        if self.tails[wi].is_none() {
            let expected = Header {
                writer: w,
                ..self.header
            };
            self.tails[wi] = Tail::open(&self.dir, &journal::name(w), expected)?;
        }
        let (index, stats) = (&mut self.index, &mut self.stats);
        if let Some(tail) = self.tails[wi].as_mut() {
            tail.read_new(
                &self.dir,
                limit,
                self.config.damaged,
                &mut |step| match step {
                    // The writer compacted its journal: its entries come again from the new file.
                    Step::Restart => index.forget(w),
                    Step::Item(item) => {
                        if item == Item::Damaged {
                            stats.damaged_records += 1;
                        }
                        index.apply(w, item)
                    }
                },
            )?;
        }
        Ok(())
    }

    /// Brings the index up to `snapshot` (records taken by another rank) and forgets entries
    /// no later snapshot can see. Snapshots are used in the order they were taken: an older
    /// one afterwards can only miss more.
    pub fn refresh(&mut self, snapshot: &Snapshot) -> Result<()> {
        let want = snapshot.records();
        if want.len() != self.config.writers as usize {
            return Err(Error::InvalidArgument(format!(
                "a snapshot of {} writers for a group of {}",
                want.len(),
                self.config.writers
            )));
        }
        for w in 0..self.config.writers {
            if self.index.replayed()[w as usize] < want[w as usize] {
                if !self.writes(w) {
                    self.catch_up(w, Some(want[w as usize]))?;
                }
                if self.index.replayed()[w as usize] < want[w as usize] {
                    return Err(storage(
                        &self.dir.file_path(&journal::name(w)),
                        StorageFailure::Format,
                        format!(
                            "the snapshot covers {} records, the journal has {}",
                            want[w as usize],
                            self.index.replayed()[w as usize]
                        ),
                    ));
                }
            }
        }
        self.index.prune(want);
        Ok(())
    }

    /// Per key, whether its page is present as of `snapshot` (a pure function of the keys and
    /// the snapshot: every rank answers the same).
    pub fn exists(&mut self, keys: &[PageKey], snapshot: &Snapshot) -> Result<Vec<bool>> {
        self.refresh(snapshot)?;
        Ok(keys
            .iter()
            .map(|k| self.index.find(k, Some(snapshot.records())).is_some())
            .collect())
    }

    /// How many leading keys of `keys` (a chain) are present as of `snapshot`.
    pub fn lookup(&mut self, keys: &[PageKey], snapshot: &Snapshot) -> Result<usize> {
        self.refresh(snapshot)?;
        Ok(keys
            .iter()
            .take_while(|k| self.index.find(k, Some(snapshot.records())).is_some())
            .count())
    }

    fn check_pages(&self, items: &[(PageKey, LocalPage)]) -> Result<()> {
        items
            .iter()
            .try_for_each(|&(_, p)| check_page(&self.host, p))
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.config.timeout
    }

    /// Slots per descriptor.
    fn run_cap(&self) -> u64 {
        (self.config.max_io_bytes / self.layout.slot_bytes()).max(1)
    }

    /// The descriptors of `slots` (sorted) of file `file`, staged from byte `staging` on.
    fn ios(&self, slots: &[u64], file: usize, staging: usize) -> Vec<Io> {
        let slot_bytes = self.layout.slot_bytes();
        runs(slots, self.run_cap())
            .into_iter()
            .map(|(first, n, at)| Io {
                staging: staging as u64 + at as u64 * slot_bytes,
                file,
                offset: first * slot_bytes,
                bytes: n * slot_bytes,
            })
            .collect()
    }

    /// Waits for `posted` (after an error of another request: bounded, its own error dropped)
    /// and returns `error`.
    fn settle(&mut self, posted: Option<Posted>, deadline: Instant, error: Error) -> Error {
        let _ = self.io.wait_sync(posted, deadline);
        error
    }

    /// Rewrites this rank's journal from its live index (the module docs of `journal.rs` tell
    /// how, crash-safe); done by stores once the journal holds more than
    /// [`DiskConfig::journal_records`] records. Every position keeps its meaning, so snapshots
    /// and the other ranks' replays stay valid. A read-only store refuses
    /// ([`StorageFailure::ReadOnly`]).
    pub fn compact_journal_sync(&mut self) -> Result<()> {
        let Some(journal) = self.journal.as_mut() else {
            return Err(read_only(&self.config.dir));
        };
        let total = self.index.replayed()[self.config.writer as usize];
        let records = journal::compacted(&self.index.live_own(), total);
        journal.compact_sync(&self.dir, &records)
    }

    /// Records in this rank's journal file (`None` read-only).
    pub fn journal_records(&self) -> Option<u64> {
        self.journal.as_ref().map(|j| j.records())
    }
}
