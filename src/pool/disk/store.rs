//! [`DiskStore`]: one rank's view of its CP group's storage directory.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use super::dir::{How, StoreDir, WriterLock};
use super::io::{FileIo, Io, IoQueue, Posted};
use super::journal::{self, Header, Item, Journal, Record, Step, Tail};
use super::key_index::Index;
use super::order::wait_for_queued_sync;
use super::slots::{check_page, dio_align, runs, storage, SlotLayout};
use super::types::{DiskConfig, DiskStats, LoadOutcome, Snapshot, StoreReport, MAX_STAGING_BYTES};
use crate::backend::Backend;
use crate::copy::BlockSpace;
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
    /// Opens rank `config.writer`'s store for pages of `host`: creates the directory (mode
    /// 0700), the journal and the preallocated slot file if missing, takes the rank's writer
    /// lock, replays the journal (a torn tail is cut; damage is skipped and counted, or refused:
    /// [`DiskConfig::damaged`]), and registers the file and the staging memory with NIXL.
    /// `backend` is the host pool's (any stream of its device): a pinned pool on CUDA knows its
    /// buffers' host addresses, a pool on the CPU twin has them from its arena
    /// ([`Backend::host_view`]); the store's `_sync` calls ask it about the work queued on the
    /// pages they name.
    ///
    /// Every file is opened relative to the directory without following a link, and the
    /// directory and its files must be this user's alone (docs/storage.md, "The directory").
    /// The settings are checked before anything is opened ([`DiskConfig::validate`]), and the
    /// slot file is sized only after the journal (when there is one) agreed on the geometry.
    ///
    /// Read-only ([`DiskConfig::read_only`]), nothing is created or written and no lock is
    /// taken: the directory must hold a writer's slot file (the slots' alignment is read from
    /// it), and every writer's journal is replayed (each must agree on the slot size and count).
    ///
    /// Errors, with nothing in the host or device pools touched: [`Error::InvalidArgument`]
    /// (a setting out of its bounds), [`StorageFailure::Open`] (the directory or a file cannot
    /// be made, or the filesystem refuses direct I/O; read-only, the directory holds no slot
    /// file), [`StorageFailure::Untrusted`] (a link, or something another user could write),
    /// [`StorageFailure::Locked`] (another store writes this rank here, its process named),
    /// [`StorageFailure::Full`] (the slots do not fit the free space), [`StorageFailure::Format`]
    /// (the files there are of another slot size, slot count or rank: refused before the slot
    /// file grows), [`StorageFailure::Corrupt`] (damage under [`Damaged::Refuse`]),
    /// [`StorageFailure::Register`] (NIXL has no POSIX backend or refuses the file).
    ///
    /// [`Damaged::Refuse`]: super::Damaged::Refuse
    pub fn open(
        host: Arc<HostPool>,
        backend: Arc<dyn Backend>,
        config: DiskConfig,
    ) -> Result<Self> {
        config.validate()?;
        crate::backend::check_space(backend.address_space(), host.address_space(), "host pool")?;
        let bases = (0..host.buffer_layouts().len())
            .map(|b| {
                let m = host.buffer_memory(b)?;
                match (host.host_ptr(b)?, backend.host_view(m.addr(), m.len())?) {
                    (Some(p), _) => Ok(p as usize),
                    (None, Some(p)) => Ok(p),
                    (None, None) => Err(Error::InvalidArgument(
                        "the host pool's buffers have no host address (device memory?)".into(),
                    )),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let dir = StoreDir::open(&config.dir, !config.read_only)?;
        let lock = match config.read_only {
            true => None,
            false => Some(dir.lock_writer(config.writer)?),
        };
        // This rank's slot file (created empty: nothing grows before the checks below), or,
        // read-only, the first writer's there: its alignment is the directory's.
        let (own_data, probe) = if config.read_only {
            let mut found = None;
            for w in 0..config.writers {
                if let Some(f) = dir.open_file(&data_name(w), How::READ)? {
                    found = Some(f);
                    break;
                }
            }
            let probe = found.ok_or_else(|| {
                storage(
                    dir.path(),
                    StorageFailure::Open,
                    "no writer's slot file here to open read-only",
                )
            })?;
            (None, probe)
        } else {
            let name = data_name(config.writer);
            let f = dir.open_file(&name, DATA_WRITE)?.ok_or_else(|| {
                storage(&dir.file_path(&name), StorageFailure::Open, "not created")
            })?;
            let probe = f
                .try_clone()
                .map_err(|e| storage(&dir.file_path(&name), StorageFailure::Open, e))?;
            (Some(f), probe)
        };
        let (mem_align, offset_align) = dio_align(probe.as_fd());
        drop(probe);
        let layout = SlotLayout::new(&host, mem_align.max(offset_align))?;
        let bytes = config
            .slots
            .checked_mul(layout.slot_bytes())
            .ok_or_else(|| Error::overflow(format!("{} slots", config.slots)))?;
        let staging = (config.staging_slots as u64)
            .checked_mul(2 * layout.slot_bytes())
            .filter(|&b| b <= MAX_STAGING_BYTES)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} staging slots of {} B: two buffers of them exceed {MAX_STAGING_BYTES} B",
                    config.staging_slots,
                    layout.slot_bytes()
                ))
            })? as usize;
        let header = Header {
            writer: config.writer,
            page_bytes: layout.page_bytes(),
            slot_bytes: layout.slot_bytes(),
            slots: config.slots,
        };
        let mut stats = DiskStats::default();
        let (journal, mut index, fresh) = match &own_data {
            None => (
                None,
                Index::new(config.writers, NO_WRITER, config.slots),
                false,
            ),
            Some(f) => {
                // Another geometry is refused before the slot file grows.
                let name = journal::name(config.writer);
                if let Some(found) = journal::read_header(&dir, &name)? {
                    if found != header {
                        return Err(storage(
                            &dir.file_path(&name),
                            StorageFailure::Format,
                            format!("the journal says {found:?}, this store is {header:?}"),
                        ));
                    }
                }
                let fresh = preallocate(f, &dir, &data_name(config.writer), bytes)?;
                let mut index = Index::new(config.writers, config.writer, config.slots);
                let (journal, opened) = Journal::open(&dir, header, config.damaged, &mut |i| {
                    index.apply(config.writer, i)
                })?;
                stats.damaged_records = opened.damaged;
                stats.torn_records = opened.torn;
                (Some(journal), index, fresh)
            }
        };
        index.finish_open();
        let name = format!(
            "kvshard-disk-{}-w{}-{:x}",
            std::process::id(),
            config.writer,
            Arc::as_ptr(&host) as usize
        );
        let mut io = FileIo::new(&name, config.queue, staging, mem_align as usize)?;
        let mut files = vec![None; config.writers as usize];
        if let Some(f) = &own_data {
            let path = dir.file_path(&data_name(config.writer));
            let fd: OwnedFd = f
                .try_clone()
                .map_err(|e| storage(&path, StorageFailure::Open, e))?
                .into();
            files[config.writer as usize] = Some(io.add_file(fd, bytes, &path)?);
        }
        let mut store = Self {
            tails: (0..config.writers).map(|_| None).collect(),
            files,
            config,
            host,
            backend,
            bases,
            layout,
            header,
            io,
            dir,
            journal,
            own_data,
            _lock: lock,
            index,
            stats,
        };
        if store.config.read_only {
            for w in 0..store.config.writers {
                store.catch_up(w, None)?;
            }
        }
        if fresh && store.config.zero_fill {
            store.zero_fill_sync()?;
        }
        Ok(store)
    }

    /// Writes zeros over every slot of this rank's new file ([`DiskConfig::zero_fill`]), a
    /// staging buffer's worth of coalesced descriptors at a time, then syncs it.
    fn zero_fill_sync(&mut self) -> Result<()> {
        let deadline = self.deadline();
        let slot_bytes = self.layout.slot_bytes() as usize;
        let per = 2 * self.config.staging_slots;
        self.io.staging(0, per * slot_bytes)?.fill(0);
        let file = self.files[self.config.writer as usize].unwrap_or_default();
        let slots: Vec<u64> = (0..self.config.slots).collect();
        for chunk in slots.chunks(per) {
            let ios = self.ios(chunk, file, 0);
            let posted = self.io.post(true, &ios)?;
            self.io.wait_sync(posted, deadline)?;
        }
        let data = self.dir.file_path(&data_name(self.config.writer));
        self.own_data
            .as_ref()
            .ok_or_else(|| read_only(&self.config.dir))?
            .sync_data()
            .map_err(|e| storage(&data, journal::io_failure(&e), e))
    }

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

    /// Writes the pages `items` (key, host page) of the host pool that no rank has stored yet:
    /// this rank's owned pages (each page written once, by its owner). Slots are taken for
    /// every page first (free ones, else least recently used ones, whose `Free` records are
    /// made durable before any slot is written); pages are then packed with their checksums
    /// into one staging buffer while the other's round of coalesced writes is in flight; one
    /// `fdatasync`, then the `Commit` records. A page is present only once its commit is
    /// durable. An empty batch does nothing and succeeds.
    ///
    /// Ordered like any kvshard work on the host pool (its usage record): the pages are read
    /// only after every write queued on them, on any stream, has run (a backup still queued
    /// behind other work), the call blocking until then (within its deadline:
    /// [`Error::Timeout`], nothing written). Work enqueued after this call returns is
    /// ordered after it by construction: its reads of the pages have ended.
    ///
    /// A read-only store refuses with [`StorageFailure::ReadOnly`], writing nothing.
    pub fn store_sync(&mut self, items: &[(PageKey, LocalPage)]) -> Result<StoreReport> {
        if self.config.read_only {
            return Err(read_only(&self.config.dir));
        }
        self.check_pages(items)?;
        let deadline = self.deadline();
        let mut report = StoreReport::default();
        let mut seen = std::collections::HashSet::with_capacity(items.len());
        let mut todo: Vec<(PageKey, LocalPage)> = Vec::with_capacity(items.len());
        for &(k, p) in items {
            if self.index.find(&k, None).is_some() || !seen.insert(k) {
                report.present += 1;
            } else {
                todo.push((k, p));
            }
        }
        let pages: Vec<LocalPage> = todo.iter().map(|&(_, p)| p).collect();
        wait_for_queued_sync(self.backend.as_ref(), &self.host, &pages, false, deadline)?;
        let mut frees = Vec::new();
        let mut batch: Vec<(u64, PageKey, LocalPage)> = Vec::with_capacity(todo.len());
        for &(k, p) in &todo {
            let Some((slot, old)) = self.index.allocate() else {
                break;
            };
            if let Some(old) = old {
                frees.push(Record::Free { slot, key: old });
            }
            batch.push((slot, k, p));
        }
        report.dropped = todo.len() - batch.len();
        if let Err(e) = self.write_all(&frees, &mut batch, deadline) {
            for &(slot, _, _) in &batch {
                self.index.release(slot);
            }
            return Err(e);
        }
        report.evicted = frees.len();
        report.written = batch.len();
        self.stats.evicted_pages += frees.len() as u64;
        self.stats.stored_pages += batch.len() as u64;
        Ok(report)
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

    fn write_all(
        &mut self,
        frees: &[Record],
        batch: &mut [(u64, PageKey, LocalPage)],
        deadline: Instant,
    ) -> Result<()> {
        let own = self.config.writer;
        let dir = self.config.dir.clone();
        self.append_sync(frees)?;
        batch.sort_by_key(|b| b.0);
        let slot_bytes = self.layout.slot_bytes() as usize;
        let per = self.config.staging_slots;
        let file = self.files[own as usize].unwrap_or_default();
        let mut commits = Vec::with_capacity(batch.len());
        let mut in_flight: Option<Posted> = None;
        for (round, chunk) in batch.chunks(per).enumerate() {
            // Two staging buffers: this round packs one while the last round's writes drain
            // from the other.
            let half = (round % 2) * per * slot_bytes;
            let packed = (|| -> Result<()> {
                let dst = self.io.staging(half, chunk.len() * slot_bytes)?;
                for (i, &(slot, key, page)) in chunk.iter().enumerate() {
                    let d = &mut dst[i * slot_bytes..(i + 1) * slot_bytes];
                    // SAFETY: `bases` are this pool's buffers (resolved at open), `page` was
                    // checked; the caller keeps transfers off the pages meanwhile.
                    let crc = unsafe {
                        self.layout
                            .pack(&self.bases, page, d, crc32c::crc32c(key.bytes()))
                    };
                    commits.push(Record::Commit { slot, key, crc });
                }
                Ok(())
            })();
            if let Err(e) = packed {
                return Err(self.settle(in_flight, deadline, e));
            }
            let slots: Vec<u64> = chunk.iter().map(|b| b.0).collect();
            let ios = self.ios(&slots, file, half);
            let posted = match self.io.post(true, &ios) {
                Ok(p) => p,
                Err(e) => return Err(self.settle(in_flight, deadline, e)),
            };
            self.stats.write_ios += ios.len() as u64;
            if let Err(e) = self.io.wait_sync(in_flight.take(), deadline) {
                return Err(self.settle(posted, deadline, e));
            }
            in_flight = posted;
        }
        self.io.wait_sync(in_flight, deadline)?;
        let data = self.dir.file_path(&data_name(own));
        self.own_data
            .as_ref()
            .ok_or_else(|| read_only(&dir))?
            .sync_data()
            .map_err(|e| storage(&data, journal::io_failure(&e), e))?;
        self.append_sync(&commits)?;
        if self
            .journal
            .as_ref()
            .is_some_and(|j| j.records() > self.config.journal_records)
        {
            self.compact_journal_sync()?;
        }
        Ok(())
    }

    /// Appends `records` to this rank's journal and applies to the index those that are in it
    /// (all, or after a failed write the whole ones that made it: they are on disk, other
    /// ranks may have read them, so this rank's view must count them too).
    fn append_sync(&mut self, records: &[Record]) -> Result<()> {
        let Some(journal) = self.journal.as_mut() else {
            return Err(read_only(&self.config.dir));
        };
        let (kept, appended) = journal.append_sync(records);
        for &r in &records[..kept] {
            self.index.apply(self.config.writer, Item::Record(r));
        }
        appended
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

    /// Loads the pages `items` (key, host page) into the host pool from whichever rank wrote
    /// them: per page [`LoadOutcome::Loaded`], [`LoadOutcome::Missing`] or
    /// [`LoadOutcome::Corrupt`] (a checksum mismatch: a miss, counted; a damaged slot of this
    /// rank is freed). Only loaded pages' host bytes change. Every file is opened and
    /// registered before any byte moves, so a file that cannot be is an error with the host
    /// pool untouched. Rounds alternate between two staging buffers: one is checked and
    /// unpacked while the next round's reads fill the other.
    ///
    /// Ordered like any kvshard work on the host pool (its usage record): the pages it may
    /// write (those the store holds) are written only after every read and write queued on
    /// them, on any stream, has run (a load to the device still reading them), the call
    /// blocking until then (within its deadline: [`Error::Timeout`], the host pool untouched).
    /// Work enqueued after this call returns sees the loaded bytes: its writes have ended.
    pub fn load_sync(&mut self, items: &[(PageKey, LocalPage)]) -> Result<Vec<LoadOutcome>> {
        self.check_pages(items)?;
        let deadline = self.deadline();
        let mut out = vec![LoadOutcome::Missing; items.len()];
        // (writer, slot, crc, item)
        let mut found: Vec<(u32, u64, u32, usize)> = Vec::new();
        for (i, (k, _)) in items.iter().enumerate() {
            if let Some(e) = self.index.find(k, None) {
                found.push((e.writer, e.slot, e.crc, i));
            }
        }
        for w in found
            .iter()
            .map(|f| f.0)
            .collect::<std::collections::BTreeSet<_>>()
        {
            self.open_file(w)?;
        }
        let pages: Vec<LocalPage> = found.iter().map(|f| items[f.3].1).collect();
        wait_for_queued_sync(self.backend.as_ref(), &self.host, &pages, true, deadline)?;
        found.sort_by_key(|f| (f.0, f.1));
        let slot_bytes = self.layout.slot_bytes() as usize;
        let page_bytes = self.layout.page_bytes() as usize;
        let per = self.config.staging_slots;
        let rounds: Vec<&[(u32, u64, u32, usize)]> = found.chunks(per).collect();
        let mut corrupt_own = Vec::new();
        let writing = (!self.config.read_only).then_some(self.config.writer);
        let mut next = match rounds.first() {
            Some(r) => self.post_reads(r, 0)?,
            None => None,
        };
        for (k, round) in rounds.iter().enumerate() {
            let current = next.take();
            if let Some(r) = rounds.get(k + 1) {
                match self.post_reads(r, ((k + 1) % 2) * per * slot_bytes) {
                    Ok(p) => next = p,
                    Err(e) => return Err(self.settle(current, deadline, e)),
                }
            }
            if let Err(e) = self.io.wait_sync(current, deadline) {
                return Err(self.settle(next, deadline, e));
            }
            let half = (k % 2) * per * slot_bytes;
            let src = match self.io.staging(half, round.len() * slot_bytes) {
                Ok(s) => s,
                Err(e) => return Err(self.settle(next, deadline, e)),
            };
            for (j, &(w, slot, crc, i)) in round.iter().enumerate() {
                let page_data = &src[j * slot_bytes..j * slot_bytes + page_bytes];
                let (key, page) = items[i];
                if page_crc(&key, page_data) != crc {
                    out[i] = LoadOutcome::Corrupt;
                    self.stats.corrupt_pages += 1;
                    if writing == Some(w) {
                        corrupt_own.push(Record::Free { slot, key });
                    }
                    continue;
                }
                // SAFETY: as in `write_all`; the slot's bytes checked.
                unsafe { self.layout.unpack(&self.bases, page_data, page) };
                out[i] = LoadOutcome::Loaded;
                self.stats.loaded_pages += 1;
            }
        }
        // Damaged slots of this rank leave the index for every rank (their Free records). Where
        // a record cannot be written its slot stays, a counted miss at every load: the
        // outcomes (host pages already written) are what this call reports.
        corrupt_own.dedup();
        if !corrupt_own.is_empty() {
            let _ = self.append_sync(&corrupt_own);
            for r in corrupt_own {
                if let Record::Free { slot, .. } = r {
                    self.index.release(slot);
                }
            }
        }
        Ok(out)
    }

    /// Posts the reads of `round` (sorted by writer and slot) into staging from byte `half` on.
    fn post_reads(
        &mut self,
        round: &[(u32, u64, u32, usize)],
        half: usize,
    ) -> Result<Option<Posted>> {
        let slot_bytes = self.layout.slot_bytes() as usize;
        let mut ios = Vec::new();
        let mut from = 0;
        while from < round.len() {
            let w = round[from].0;
            let end = from + round[from..].iter().take_while(|f| f.0 == w).count();
            let slots: Vec<u64> = round[from..end].iter().map(|f| f.1).collect();
            let file = self.files[w as usize].unwrap_or_default();
            ios.extend(self.ios(&slots, file, half + from * slot_bytes));
            from = end;
        }
        self.stats.read_ios += ios.len() as u64;
        self.io.post(false, &ios)
    }

    /// Opens and registers writer `w`'s slot file (once).
    fn open_file(&mut self, w: u32) -> Result<()> {
        if self.files[w as usize].is_some() {
            return Ok(());
        }
        let name = data_name(w);
        let path = self.dir.file_path(&name);
        let file = self
            .dir
            .open_file(&name, DATA_READ)?
            .ok_or_else(|| storage(&path, StorageFailure::Open, "no slot file"))?;
        let len = file
            .metadata()
            .map_err(|e| storage(&path, StorageFailure::Io, e))?
            .len();
        let want = self.header.slots * self.header.slot_bytes;
        if len < want {
            return Err(storage(
                &path,
                StorageFailure::Format,
                format!("{len} B, {want} B expected"),
            ));
        }
        let index = self.io.add_file(file.into(), want, &path)?;
        self.files[w as usize] = Some(index);
        Ok(())
    }
}

/// The checksum a commit record holds: CRC-32C of the key, then the page's bytes (so a slot
/// reused for another key never checks as the old one).
fn page_crc(key: &PageKey, page: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(key.bytes()), page)
}

/// Makes `file` (entry `name` of `dir`) hold `bytes` bytes of allocated blocks, refusing
/// (before writing anything) when the filesystem has less room than the part still to
/// allocate. Whether it grew the file.
fn preallocate(file: &File, dir: &StoreDir, name: &str, bytes: u64) -> Result<bool> {
    let path = dir.file_path(name);
    let have = file
        .metadata()
        .map_err(|e| storage(&path, StorageFailure::Io, e))?
        .len();
    if have >= bytes {
        return Ok(false);
    }
    let free = dir.free_bytes()?;
    if bytes - have > free {
        return Err(storage(
            &path,
            StorageFailure::Full,
            format!("{} B of slots asked for, {free} B free", bytes - have),
        ));
    }
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, bytes) {
        Ok(()) => Ok(true),
        // A filesystem without fallocate: a sparse file of the right length.
        Err(rustix::io::Errno::OPNOTSUPP) => file
            .set_len(bytes)
            .map(|()| true)
            .map_err(|e| storage(&path, journal::io_failure(&e), e)),
        Err(e) => {
            let _ = file.set_len(have);
            let e = std::io::Error::from(e);
            Err(storage(&path, journal::io_failure(&e), e))
        }
    }
}
