//! What a [`DiskStore`](super::DiskStore) is opened with and what its calls report: its
//! settings, the snapshot a CP group agrees on, a load's outcome per page, a store's report
//! and the counters.

use std::path::PathBuf;
use std::time::Duration;

use super::io::QueueChoice;

/// Settings of a [`DiskStore`](super::DiskStore). Every rank of a CP group opens the same
/// directory with the same `writers` and `slots`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    /// The CP group's directory (created if missing): one slot file and one journal per rank.
    pub dir: PathBuf,
    /// This rank (it writes `w{writer}.slots` and `w{writer}.journal`).
    pub writer: u32,
    /// Ranks of the CP group.
    pub writers: u32,
    /// Slots of each rank's file (pages it can hold); reclaimed least recently used first.
    pub slots: u64,
    /// Slots of each of the two staging buffers: pages one round of I/O moves (larger
    /// batches take rounds, one packed or unpacked while the other's I/O is in flight).
    pub staging_slots: usize,
    /// Largest descriptor: a run of adjacent slots is split above this many bytes (at least one
    /// slot per descriptor).
    pub max_io_bytes: u64,
    /// Which kernel queue NIXL's POSIX backend uses.
    pub queue: QueueChoice,
    /// Deadline of every call that waits for I/O.
    pub timeout: Duration,
    /// Open without write access (a rank that only reads): nothing is created, every writer's
    /// journal is replayed at open and on each snapshot, lookups and loads are served, and a
    /// store is a [`StorageFailure::ReadOnly`](crate::error::StorageFailure::ReadOnly) error.
    /// `writer` is then only this rank's name; it writes nothing.
    pub read_only: bool,
    /// Write every slot of a newly created slot file once (zeros) at open, so that the first
    /// fill overwrites written blocks instead of converting the filesystem's unwritten extents
    /// as it goes; open then takes the time of writing the whole file. A process killed during
    /// it leaves a file of the full length, not written again (only the first fill's speed
    /// depends on it).
    pub zero_fill: bool,
    /// Records this rank's journal may hold before a store compacts it (keeping only its live
    /// pages' commits, positions unchanged: `DiskStore::compact_journal_sync`).
    pub journal_records: u64,
}

impl DiskConfig {
    /// Rank `writer` of `writers` in `dir`, `slots` slots each: 32 staging slots, descriptors up
    /// to 8 MiB, io_uring (libaio where blocked), 30 s per call, read and write, no zero fill, the journal compacted past 4 records per slot (+ 1,024).
    pub fn new(dir: impl Into<PathBuf>, writer: u32, writers: u32, slots: u64) -> Self {
        Self {
            dir: dir.into(),
            writer,
            writers,
            slots,
            staging_slots: 32,
            max_io_bytes: 8 << 20,
            queue: QueueChoice::Auto,
            timeout: Duration::from_secs(30),
            read_only: false,
            zero_fill: false,
            journal_records: slots.saturating_mul(4).saturating_add(1024),
        }
    }
}

/// A CP group's agreed view of the storage: per writer rank, the journal records it covers.
/// One rank takes it ([`DiskStore::snapshot`](super::DiskStore::snapshot)) and the others use
/// it, so every rank's lookup answers the same.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Snapshot {
    records: Vec<u64>,
}

impl Snapshot {
    /// A snapshot from its per-writer record counts (as another rank sent them).
    pub fn from_records(records: Vec<u64>) -> Self {
        Self { records }
    }

    /// Per writer rank, the journal records covered.
    pub fn records(&self) -> &[u64] {
        &self.records
    }
}

/// What happened to one page of a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoadOutcome {
    /// Its bytes are in the host page.
    Loaded,
    /// The store does not hold it (the host page is untouched).
    Missing,
    /// Its slot failed its checksum (flipped bytes, or reused since the lookup): a miss, counted
    /// in [`DiskStats::corrupt_pages`]; the host page is untouched.
    Corrupt,
}

/// What one store call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreReport {
    /// Pages written and committed.
    pub written: usize,
    /// Pages already present (written by any rank), not written again.
    pub present: usize,
    /// Slots reclaimed from older pages to make room.
    pub evicted: usize,
    /// New pages not written because the batch had more new pages than the file has slots.
    pub dropped: usize,
}

/// Counters of a store since it opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskStats {
    /// Pages written.
    pub stored_pages: u64,
    /// Pages loaded.
    pub loaded_pages: u64,
    /// Loads that found a slot failing its checksum.
    pub corrupt_pages: u64,
    /// Slots reclaimed.
    pub evicted_pages: u64,
    /// Descriptors (one I/O each) posted to write.
    pub write_ios: u64,
    /// Descriptors posted to read.
    pub read_ios: u64,
}
