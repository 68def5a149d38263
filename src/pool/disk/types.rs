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
    /// What a journal record that fails its checksum (or names a slot past the file) with
    /// valid records after it does: kept past, counted ([`Damaged::Skip`], the default) or
    /// refused ([`Damaged::Refuse`]). Only what follows the last valid record is a torn tail.
    pub damaged: Damaged,
}

/// What the store does with a damaged journal record: one that fails its checksum or names a
/// slot past the slot file, followed by valid records (so not the torn tail of a killed
/// writer). The records around it are kept either way and nothing past it is ever cut; RocksDB
/// calls these its WAL recovery modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Damaged {
    /// The record is skipped (one position, so every rank counts positions alike) and counted
    /// in [`DiskStats::damaged_records`]; the page it named is a miss. The store keeps serving.
    #[default]
    Skip,
    /// The open (this rank's journal) or the snapshot (another rank's) that meets it fails with
    /// [`StorageFailure::Corrupt`](crate::error::StorageFailure::Corrupt), naming the record;
    /// nothing is changed on disk.
    Refuse,
}

/// Most writer ranks a store directory takes ([`DiskConfig::writers`]): each rank opens and
/// registers every other rank's files, so the bound keeps that finite.
pub const MAX_WRITERS: u32 = 1024;

/// The longest deadline a store takes ([`DiskConfig::timeout`], and the controller's storage
/// timeout): a day; anything longer is a hang by another name.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// The largest staging memory a store allocates (two buffers of
/// [`DiskConfig::staging_slots`] slots, zeroed, so all of it is resident): 1 GiB, several
/// times what the default 32 slots of a 78-layer page take.
pub const MAX_STAGING_BYTES: u64 = 1 << 30;

/// Checks a timeout is a usable deadline: more than zero, at most [`MAX_TIMEOUT`]. `what`
/// names it in the error.
pub fn check_timeout(timeout: Duration, what: &str) -> crate::error::Result<()> {
    if timeout.is_zero() || timeout > MAX_TIMEOUT {
        return Err(crate::error::Error::InvalidArgument(format!(
            "{what} of {timeout:?}: expected more than zero and at most {MAX_TIMEOUT:?}"
        )));
    }
    Ok(())
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
            damaged: Damaged::Skip,
        }
    }

    /// Checks every setting that needs no filesystem, before anything is opened or allocated:
    /// `writer` below `writers` (at most [`MAX_WRITERS`]), at least one slot and one staging
    /// slot, the timeout ([`check_timeout`]). Sizes that depend on the page (the slot file,
    /// the staging memory) are checked by the open once the slot size is known.
    pub fn validate(&self) -> crate::error::Result<()> {
        use crate::error::Error;
        if self.writers == 0 || self.writers > MAX_WRITERS || self.writer >= self.writers {
            return Err(Error::InvalidArgument(format!(
                "storage writer {} of {} writers (1..={MAX_WRITERS} writers, the writer below them)",
                self.writer, self.writers
            )));
        }
        if self.slots == 0 || self.staging_slots == 0 {
            return Err(Error::InvalidArgument(
                "a store needs at least one slot and one staging slot".into(),
            ));
        }
        check_timeout(self.timeout, "a storage timeout")
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
    /// Journal records skipped as damaged ([`Damaged`]): a record of this rank's journal (at
    /// open) or of another rank's (at a snapshot) that fails its checksum or names a slot past
    /// the file, with valid records after it. Each may be a page lost (a miss, never a wrong
    /// hit).
    pub damaged_records: u64,
    /// Records (whole or partial) cut from the tail of this rank's journal at open: what
    /// followed the last valid record, a batch a killed writer was appending (never committed).
    pub torn_records: u64,
}
