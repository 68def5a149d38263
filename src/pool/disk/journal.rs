//! The journal of one writer rank: a 64-byte header, then fixed 96-byte records appended in
//! order, each with its own CRC-32C. A `Commit` record says a slot holds a key's page, with the
//! page's checksum, and is appended only after the slot's data is durable; a `Free` record says
//! a slot no longer holds its key, and is durable before the slot is overwritten. Replaying the
//! records in order rebuilds the index (`index.rs`).
//!
//! **Damage and torn tails** (the rule of databases' logs: only what follows the last valid
//! record may be cut). A record that fails its checksum, or names a slot past the slot file, or
//! a `Skip` of more positions than any journal holds, is *bad*. Bad records after the last valid
//! one are the torn tail a killed writer left: its own open cuts them (they were never
//! committed: their batch's sync never returned), and readers wait for them to become whole.
//! A bad record with a valid one after it is *damage*: it is skipped as one position (every
//! rank counts it alike) and counted (`DiskStats::damaged_records`), or refused with
//! [`StorageFailure::Corrupt`] under [`Damaged::Refuse`]; nothing after it is ever cut.
//!
//! Records have logical positions (what snapshots count): one each, but a `Skip` record stands
//! for `count` positions. **Compaction** rewrites a journal grown past a bound from the live
//! index: each live `Commit` at its original position, the dead positions between them as
//! `Skip`s, so every position (and so every snapshot taken since) means what it meant. It writes
//! `wNNNN.journal.compact` (created exclusively, after removing any entry of that name, so a
//! link planted there is never followed), syncs it, renames it over the journal and syncs the
//! directory: a process killed before the rename leaves the old journal (and a stray file,
//! removed at the next open); after it, the new one, whole. Readers notice the new file
//! (another inode) once they have read the old one to its end, and replay the writer again from
//! the new file: their entries of that writer are rebuilt, so every rank agrees on every
//! snapshot taken since the compaction (an older snapshot no longer sees pages freed before
//! it).
//!
//! Every read is bounded: records are read [`CHUNK_RECORDS`] at a time wherever the journal
//! is, and a reader of another rank's journal remembers where it stopped, so a snapshot reads
//! only what was appended since (a bad tail it already read is not read again while the file
//! stays as it was).
//!
//! ```text
//! header: "KVSJRNL1" | u32 version | u32 writer | u64 page bytes | u64 slot bytes | u64 slots
//!         | 20 zero bytes | u32 CRC-32C of bytes 0..60
//! record: "KVSR" | u8 kind (1 commit, 2 free, 3 skip) | 3 zero bytes | u64 slot (skip: count)
//!         | 64-byte key (skip: zeros) | u32 page CRC-32C | 4 zero bytes
//!         | u32 CRC-32C of bytes 0..88 | 4 zero bytes
//! ```

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::dir::{How, StoreDir};
use super::slots::storage;
use super::types::Damaged;
use crate::error::{Error, Result, StorageFailure};
use crate::key::{PageKey, KEY_BYTES};

/// Bytes of the header.
pub(super) const HEADER_BYTES: u64 = 64;
/// Bytes of one record.
pub(super) const RECORD_BYTES: u64 = 96;
/// Records one read takes (192 KiB): what bounds a reader's memory, whatever the file's size.
pub(super) const CHUNK_RECORDS: usize = 2048;
/// The most positions one `Skip` stands for: far more than any journal ever held (2^48
/// records are 27 PB of journal), so a larger count is damage, and positions never overflow.
const MAX_SKIP: u64 = 1 << 48;
const MAGIC: &[u8; 8] = b"KVSJRNL1";
const RECORD_MAGIC: &[u8; 4] = b"KVSR";
const VERSION: u32 = 1;

/// What a journal's header pins: a reader must agree on every field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub writer: u32,
    pub page_bytes: u64,
    pub slot_bytes: u64,
    pub slots: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES as usize] {
        let mut b = [0u8; HEADER_BYTES as usize];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.writer.to_le_bytes());
        b[16..24].copy_from_slice(&self.page_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.slot_bytes.to_le_bytes());
        b[32..40].copy_from_slice(&self.slots.to_le_bytes());
        let crc = crc32c::crc32c(&b[..60]);
        b[60..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default());
        (b.len() == HEADER_BYTES as usize
            && &b[..8] == MAGIC
            && u32_at(8) == VERSION
            && u32_at(60) == crc32c::crc32c(&b[..60]))
        .then(|| Self {
            writer: u32_at(12),
            page_bytes: u64_at(16),
            slot_bytes: u64_at(24),
            slots: u64_at(32),
        })
    }
}

/// One journal record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Record {
    /// `slot` holds `key`'s page, whose bytes have CRC-32C `crc` (over the key, then the page).
    Commit { slot: u64, key: PageKey, crc: u32 },
    /// `slot` no longer holds `key`.
    Free { slot: u64, key: PageKey },
    /// `count` positions whose records compaction dropped (their pages long freed).
    Skip { count: u64 },
}

impl Record {
    pub(super) fn encode(&self) -> [u8; RECORD_BYTES as usize] {
        let mut b = [0u8; RECORD_BYTES as usize];
        b[..4].copy_from_slice(RECORD_MAGIC);
        let (kind, slot, key, crc) = match *self {
            Self::Commit { slot, key, crc } => (1u8, slot, Some(key), crc),
            Self::Free { slot, key } => (2u8, slot, Some(key), 0),
            Self::Skip { count } => (3u8, count, None, 0),
        };
        b[4] = kind;
        b[8..16].copy_from_slice(&slot.to_le_bytes());
        if let Some(key) = key {
            b[16..16 + KEY_BYTES].copy_from_slice(key.bytes());
        }
        b[80..84].copy_from_slice(&crc.to_le_bytes());
        let check = crc32c::crc32c(&b[..88]);
        b[88..92].copy_from_slice(&check.to_le_bytes());
        b
    }

    /// The record in `b`, or `None` when it is bad: another length, magic or kind, a failed
    /// checksum, a commit or free of a slot not below `slots`, a `Skip` of none or of more
    /// than [`MAX_SKIP`] positions.
    fn decode(b: &[u8], slots: u64) -> Option<Self> {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default());
        if b.len() != RECORD_BYTES as usize
            || &b[..4] != RECORD_MAGIC
            || u32_at(88) != crc32c::crc32c(&b[..88])
        {
            return None;
        }
        let slot = u64::from_le_bytes(b[8..16].try_into().ok()?);
        let key = PageKey::from_bytes(&b[16..16 + KEY_BYTES]).ok()?;
        match b[4] {
            1 if slot < slots => Some(Self::Commit {
                slot,
                key,
                crc: u32_at(80),
            }),
            2 if slot < slots => Some(Self::Free { slot, key }),
            3 if slot > 0 && slot <= MAX_SKIP => Some(Self::Skip { count: slot }),
            _ => None,
        }
    }

    /// Logical positions the record stands for.
    pub fn span(&self) -> u64 {
        match *self {
            Self::Skip { count } => count,
            _ => 1,
        }
    }
}

/// What one record place of a journal holds, as replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Item {
    /// A valid record.
    Record(Record),
    /// A damaged record (module docs): one position that says nothing.
    Damaged,
}

impl Item {
    /// Logical positions it stands for.
    pub fn span(&self) -> u64 {
        match self {
            Self::Record(r) => r.span(),
            Self::Damaged => 1,
        }
    }
}

/// The name of writer `writer`'s journal in the store's directory.
pub(super) fn name(writer: u32) -> String {
    format!("w{writer:04}.journal")
}

/// Where a compaction of writer `writer`'s journal is written before its rename.
fn compact_name(writer: u32) -> String {
    format!("w{writer:04}.journal.compact")
}

/// A live commit compaction keeps: (position, slot, key, page CRC).
pub(super) type Live = (u64, u64, PageKey, u32);

/// The records of a compacted journal of `total` positions keeping `live` (sorted by position,
/// each below `total`): each commit at its position, `Skip`s between (none longer than
/// [`MAX_SKIP`]).
pub(super) fn compacted(live: &[Live], total: u64) -> Vec<Record> {
    let mut out = Vec::with_capacity(2 * live.len() + 1);
    let mut at = 0;
    let skip = |out: &mut Vec<Record>, mut count: u64| {
        while count > 0 {
            let n = count.min(MAX_SKIP);
            out.push(Record::Skip { count: n });
            count -= n;
        }
    };
    for &(position, slot, key, crc) in live {
        if position > at {
            skip(&mut out, position - at);
        }
        out.push(Record::Commit { slot, key, crc });
        at = position + 1;
    }
    if total > at {
        skip(&mut out, total - at);
    }
    out
}

/// Reads up to `buf.len()` bytes of `file` at `offset` (fewer only at its end).
fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Reads the whole records of `file` from record place `from` on, [`CHUNK_RECORDS`] at a
/// time, handing each to `each` (its place, and the record or `None` when bad) while `each`
/// returns true. Returns the place after the last record handed over, and whether the file's
/// end was reached (bytes of a partial record there are not handed over).
fn scan(
    file: &File,
    path: &Path,
    slots: u64,
    from: u64,
    mut each: impl FnMut(u64, Option<Record>) -> bool,
) -> Result<(u64, bool)> {
    let mut buf = vec![0u8; CHUNK_RECORDS * RECORD_BYTES as usize];
    let mut at = from;
    loop {
        let offset = at
            .checked_mul(RECORD_BYTES)
            .and_then(|b| b.checked_add(HEADER_BYTES))
            .ok_or_else(|| Error::overflow("a journal offset"))?;
        let n = read_full_at(file, &mut buf, offset)
            .map_err(|e| storage(path, StorageFailure::Io, e))?;
        for b in buf[..n].chunks_exact(RECORD_BYTES as usize) {
            if !each(at, Record::decode(b, slots)) {
                return Ok((at, false));
            }
            at += 1;
        }
        if n < buf.len() {
            return Ok((at, true));
        }
    }
}

/// The error of damage met under [`Damaged::Refuse`].
fn corrupt(path: &Path, place: u64) -> Error {
    storage(
        path,
        StorageFailure::Corrupt,
        format!(
            "record {place} is damaged (a failed checksum or a slot past the file) and valid records follow it; DiskConfig::damaged is Refuse"
        ),
    )
}

/// Reads the header of journal `name` in `dir`: `None` when there is none yet (absent, or
/// shorter than a header: created by a writer killed before its header was durable).
pub(super) fn read_header(dir: &StoreDir, name: &str) -> Result<Option<Header>> {
    let Some(file) = dir.open_file(name, How::READ)? else {
        return Ok(None);
    };
    let path = dir.file_path(name);
    let mut b = [0u8; HEADER_BYTES as usize];
    let n = read_full_at(&file, &mut b, 0).map_err(|e| storage(&path, StorageFailure::Io, e))?;
    if n < b.len() {
        return Ok(None);
    }
    Header::decode(&b)
        .map(Some)
        .ok_or_else(|| storage(&path, StorageFailure::Format, "no valid journal header"))
}

/// What opening a writer's own journal found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Opened {
    /// Damaged records skipped.
    pub damaged: u64,
    /// Records (whole or partial) cut from the tail.
    pub torn: u64,
}

/// A writer's own journal, open for appending.
#[derive(Debug)]
pub(super) struct Journal {
    file: File,
    path: PathBuf,
    writer: u32,
    header: Header,
    /// Record places in the file (valid or damaged; a `Skip` counts one).
    records: u64,
}

impl Journal {
    /// Opens writer `header.writer`'s journal in `dir` (creating it with `header` when absent)
    /// and hands every record place to `apply`, in order (module docs: damage is skipped and
    /// counted, or refused under [`Damaged::Refuse`]); the torn tail is cut so the next append
    /// follows the last valid record.
    pub fn open(
        dir: &StoreDir,
        header: Header,
        damaged: Damaged,
        apply: &mut dyn FnMut(Item),
    ) -> Result<(Self, Opened)> {
        let writer = header.writer;
        let name = name(writer);
        let path = dir.file_path(&name);
        // A compaction killed before its rename: the journal is the old one, whole.
        dir.remove(&compact_name(writer))?;
        let file = dir
            .open_file(&name, How::WRITE)?
            .ok_or_else(|| storage(&path, StorageFailure::Open, "not created"))?;
        let len = file
            .metadata()
            .map_err(|e| storage(&path, StorageFailure::Io, e))?
            .len();
        let journal = |file, records| Self {
            file,
            path: path.clone(),
            writer,
            header,
            records,
        };
        if len < HEADER_BYTES {
            // New (or a header that never reached the disk: no record can follow it).
            file.set_len(0)
                .and_then(|()| file.write_all_at(&header.encode(), 0))
                .and_then(|()| file.sync_all())
                .map_err(|e| storage(&path, io_failure(&e), e))?;
            dir.sync()?;
            return Ok((journal(file, 0), Opened::default()));
        }
        match read_header(dir, &name)? {
            Some(found) if found == header => {}
            found => {
                return Err(storage(
                    &path,
                    StorageFailure::Format,
                    format!("the journal says {found:?}, this store is {header:?}"),
                ))
            }
        }
        let (mut good, mut bad_run) = (0u64, 0u64);
        let mut opened = Opened::default();
        let mut refused = None;
        scan(&file, &path, header.slots, 0, |place, record| {
            match record {
                Some(r) => {
                    if bad_run > 0 {
                        if damaged == Damaged::Refuse {
                            refused = Some(place - bad_run);
                            return false;
                        }
                        (0..bad_run).for_each(|_| apply(Item::Damaged));
                        opened.damaged += bad_run;
                        bad_run = 0;
                    }
                    apply(Item::Record(r));
                    good = place + 1;
                }
                None => bad_run += 1,
            }
            true
        })?;
        if let Some(place) = refused {
            return Err(corrupt(&path, place));
        }
        let end = HEADER_BYTES + good * RECORD_BYTES;
        if len > end {
            // The torn tail (a process killed mid-append): cut so appends stay in step.
            opened.torn = (len - end).div_ceil(RECORD_BYTES);
            file.set_len(end)
                .and_then(|()| file.sync_all())
                .map_err(|e| storage(&path, StorageFailure::Io, e))?;
        }
        Ok((journal(file, good), opened))
    }

    /// Record places in the file (a `Skip` or a damaged record counts one).
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Rewrites the journal as `records` (what [`compacted`] makes of the live index), crash-safe
    /// and link-safe (module docs): written beside it, synced, renamed over it, the directory
    /// synced.
    pub fn compact_sync(&mut self, dir: &StoreDir, records: &[Record]) -> Result<()> {
        let tmp = compact_name(self.writer);
        let tmp_path = dir.file_path(&tmp);
        // Whatever is there (a stray file, or a link someone planted) goes first; the file is
        // then created exclusively, so nothing made in between is written through.
        dir.remove(&tmp)?;
        let file = dir
            .open_file(
                &tmp,
                How {
                    exclusive: true,
                    ..How::WRITE
                },
            )?
            .ok_or_else(|| storage(&tmp_path, StorageFailure::Open, "not created"))?;
        let written = (|| -> std::io::Result<()> {
            file.write_all_at(&self.header.encode(), 0)?;
            let mut at = HEADER_BYTES;
            for chunk in records.chunks(CHUNK_RECORDS) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|r| r.encode()).collect();
                file.write_all_at(&bytes, at)?;
                at += bytes.len() as u64;
            }
            file.sync_all()
        })();
        if let Err(e) = written {
            let _ = dir.remove(&tmp);
            return Err(storage(&tmp_path, io_failure(&e), e));
        }
        dir.rename(&tmp, &name(self.writer))?;
        dir.sync()?;
        self.file = file;
        self.records = records.len() as u64;
        Ok(())
    }

    /// Appends `records` and makes them durable (one `fdatasync`). Returns how many of them
    /// are in the file: all, or, when the write or the sync failed (with the error), the whole
    /// records that made it before a partial one, which is cut. Those stay (other ranks may
    /// have read them already, and positions must mean the same to everyone): the caller
    /// applies them as it would the whole batch.
    pub fn append_sync(&mut self, records: &[Record]) -> (usize, Result<()>) {
        if records.is_empty() {
            return (0, Ok(()));
        }
        let bytes: Vec<u8> = records.iter().flat_map(|r| r.encode()).collect();
        let end = HEADER_BYTES + self.records * RECORD_BYTES;
        match self
            .file
            .write_all_at(&bytes, end)
            .and_then(|()| self.file.sync_data())
        {
            Ok(()) => {
                self.records += records.len() as u64;
                (records.len(), Ok(()))
            }
            Err(e) => {
                let len = self.file.metadata().map_or(end, |m| m.len());
                let kept = (len.saturating_sub(end) / RECORD_BYTES).min(records.len() as u64);
                // A partial record must not stay in front of the next batch.
                let _ = self.file.set_len(end + kept * RECORD_BYTES);
                self.records += kept;
                (kept as usize, Err(storage(&self.path, io_failure(&e), e)))
            }
        }
    }
}

/// A step of [`Tail::read_new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// The writer compacted its journal: what the reader has of it is to be forgotten; its
    /// records come again from position 0.
    Restart,
    /// The next record place.
    Item(Item),
}

/// What a reader remembers of a file that ended in a bad run: its length and modification
/// time then (while they stay the same, the run is not read again).
type Seen = (u64, i64, i64);

/// A reader of another writer's journal, from where it last stopped: a record being appended,
/// or the torn tail of a killed writer, is not handed over until (unless) it is whole, and a
/// bad run is handed over as damage only once a valid record follows it.
#[derive(Debug)]
pub(super) struct Tail {
    file: File,
    name: String,
    path: PathBuf,
    slots: u64,
    /// Record places of `file` consumed so far.
    read: u64,
    /// Logical positions handed over so far.
    records: u64,
    /// Positions of a `Skip` cut at a limit, still to hand over.
    carry: u64,
    /// The file as it was when it ended in a bad run, left for a valid record to follow.
    pending: Option<Seen>,
}

impl Tail {
    /// Opens writer journal `name` of `dir` if it exists (`None` when the writer has not
    /// started), and checks its header is `expected`.
    pub fn open(dir: &StoreDir, name: &str, expected: Header) -> Result<Option<Self>> {
        let path = dir.file_path(name);
        match read_header(dir, name)? {
            None => Ok(None),
            Some(h) if h == expected => {
                let Some(file) = dir.open_file(name, How::READ)? else {
                    return Ok(None);
                };
                Ok(Some(Self {
                    file,
                    name: name.into(),
                    path,
                    slots: expected.slots,
                    read: 0,
                    records: 0,
                    carry: 0,
                    pending: None,
                }))
            }
            Some(found) => Err(storage(
                &path,
                StorageFailure::Format,
                format!("the journal says {found:?}, this store expects {expected:?}"),
            )),
        }
    }

    /// Logical positions handed over so far.
    #[cfg(test)]
    pub fn records(&self) -> u64 {
        self.records
    }

    fn seen(&self) -> Result<Seen> {
        let st = rustix::fs::fstat(self.file.as_fd())
            .map_err(|e| storage(&self.path, StorageFailure::Io, e))?;
        Ok((
            st.st_size as u64,
            st.st_mtime as i64,
            st.st_mtime_nsec as i64,
        ))
    }

    /// Hands the record places after those already handed over to `sink`, up to logical
    /// position `limit` (`None`: all that are whole now); a `Skip` crossing the limit is cut
    /// there. Damage (a bad run with a valid record after it) is handed over as
    /// [`Item::Damaged`] places, or refused under [`Damaged::Refuse`]. Once the file is read to
    /// its end and the journal's name names another file (a compaction), reads that one from
    /// its start, after a [`Step::Restart`]. `dir` is the store's directory. Records go to
    /// `sink` as they are read: memory stays bounded whatever the journal's size.
    pub fn read_new(
        &mut self,
        dir: &StoreDir,
        limit: Option<u64>,
        damaged: Damaged,
        sink: &mut dyn FnMut(Step),
    ) -> Result<()> {
        let want = |records: u64| limit.is_none_or(|l| records < l);
        for pass in 0..2 {
            // The rest of a Skip cut at an earlier limit.
            if self.carry > 0 && want(self.records) {
                let count = std::mem::take(&mut self.carry);
                let skip = Item::Record(Record::Skip { count });
                hand(&mut self.records, &mut self.carry, limit, skip, sink);
            }
            if !want(self.records) || self.carry > 0 {
                return Ok(());
            }
            let seen = self.seen()?;
            let at_end = match self.pending {
                // A bad run at the end, and the file as it was: nothing new to read.
                Some(p) if p == seen => true,
                _ => {
                    let (mut records, mut carry, mut read) = (self.records, 0u64, self.read);
                    let (mut bad_run, mut refused) = (0u64, None);
                    let scanned =
                        scan(&self.file, &self.path, self.slots, self.read, |place, r| {
                            if !want(records) || carry > 0 {
                                return false;
                            }
                            let Some(r) = r else {
                                bad_run += 1;
                                return true;
                            };
                            if bad_run > 0 {
                                if damaged == Damaged::Refuse {
                                    refused = Some(place - bad_run);
                                    return false;
                                }
                                while bad_run > 0 && want(records) {
                                    hand(&mut records, &mut carry, limit, Item::Damaged, sink);
                                    read += 1;
                                    bad_run -= 1;
                                }
                                if !want(records) {
                                    // The limit fell inside the run: the rest is read again.
                                    return false;
                                }
                            }
                            hand(&mut records, &mut carry, limit, Item::Record(r), sink);
                            read += 1;
                            true
                        });
                    (self.records, self.carry, self.read) = (records, carry, read);
                    let (_, end) = scanned?;
                    if let Some(place) = refused {
                        return Err(corrupt(&self.path, place));
                    }
                    // A bad run at the end is left until a valid record follows it (a torn
                    // tail, or a record being appended).
                    self.pending = (end && bad_run > 0).then_some(seen);
                    end
                }
            };
            // Read to the end of a file the journal's name no longer names: a compaction
            // replaced it; replay the writer from the new one's start (once per call).
            if pass == 1 || !at_end || !want(self.records) || !self.replaced(dir)? {
                return Ok(());
            }
            self.reopen(dir)?;
            sink(Step::Restart);
        }
        Ok(())
    }

    /// Whether the journal's name now names another file than the one open.
    fn replaced(&self, dir: &StoreDir) -> Result<bool> {
        let open = rustix::fs::fstat(self.file.as_fd())
            .map_err(|e| storage(&self.path, StorageFailure::Io, e))?;
        Ok(match dir.identity(&self.name)? {
            Some(now) => now != (open.st_dev, open.st_ino),
            None => false,
        })
    }

    /// Opens the file the journal's name names now, from its first record, after checking its
    /// header is the one of the file it replaces.
    fn reopen(&mut self, dir: &StoreDir) -> Result<()> {
        let file = dir
            .open_file(&self.name, How::READ)?
            .ok_or_else(|| storage(&self.path, StorageFailure::Open, "the journal is gone"))?;
        let mut theirs = [0u8; HEADER_BYTES as usize];
        let mut mine = [0u8; HEADER_BYTES as usize];
        read_full_at(&file, &mut theirs, 0)
            .and_then(|_| read_full_at(&self.file, &mut mine, 0))
            .map_err(|e| storage(&self.path, StorageFailure::Io, e))?;
        if Header::decode(&theirs).is_none() || theirs != mine {
            return Err(storage(
                &self.path,
                StorageFailure::Format,
                "the compacted journal's header differs from the one it replaced",
            ));
        }
        self.file = file;
        (self.read, self.records, self.carry, self.pending) = (0, 0, 0, None);
        Ok(())
    }
}

/// Hands `item` to `sink` at position `*records`, cutting a `Skip` at `limit` (its rest goes to
/// `*carry`).
fn hand(
    records: &mut u64,
    carry: &mut u64,
    limit: Option<u64>,
    item: Item,
    sink: &mut dyn FnMut(Step),
) {
    let room = limit.map_or(u64::MAX, |l| l.saturating_sub(*records));
    let n = item.span().min(room);
    if n < item.span() {
        *carry = item.span() - n;
    }
    sink(Step::Item(match item {
        Item::Record(Record::Skip { .. }) => Item::Record(Record::Skip { count: n }),
        other => other,
    }));
    *records = records.saturating_add(n);
}

/// Full disk or quota: [`StorageFailure::Full`]; anything else an I/O failure.
pub(super) fn io_failure(e: &std::io::Error) -> StorageFailure {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => StorageFailure::Full,
        _ => StorageFailure::Io,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> PageKey {
        PageKey::from_bytes(&[i; KEY_BYTES]).unwrap()
    }

    fn header(writer: u32) -> Header {
        Header {
            writer,
            page_bytes: 100,
            slot_bytes: 4096,
            slots: 8,
        }
    }

    /// A fresh directory of its own for one test.
    fn scratch(test: &str) -> (PathBuf, StoreDir) {
        let path = std::env::temp_dir().join(format!("kvshard-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        let dir = StoreDir::open(&path, true).unwrap();
        (path, dir)
    }

    /// What a reader hands over, as a list (a restart as `None`).
    fn read(tail: &mut Tail, dir: &StoreDir, limit: Option<u64>) -> Vec<Option<Item>> {
        let mut out = Vec::new();
        tail.read_new(dir, limit, Damaged::Skip, &mut |step| {
            out.push(match step {
                Step::Restart => None,
                Step::Item(i) => Some(i),
            })
        })
        .unwrap();
        out
    }

    fn items(records: &[Record]) -> Vec<Option<Item>> {
        records.iter().map(|r| Some(Item::Record(*r))).collect()
    }

    fn open(dir: &StoreDir, h: Header, damaged: Damaged) -> Result<(Journal, Vec<Item>, Opened)> {
        let mut got = Vec::new();
        let (j, opened) = Journal::open(dir, h, damaged, &mut |i| got.push(i))?;
        Ok((j, got, opened))
    }

    #[test]
    fn compaction_keeps_positions_and_skips_are_cut_at_limits() {
        let (path, dir) = scratch("compact");
        let h = header(0);
        // Live commits at positions 3 and 4 of 7.
        let live = [(3, 1, key(3), 30), (4, 2, key(4), 40)];
        let recs = compacted(&live, 7);
        assert_eq!(
            recs,
            vec![
                Record::Skip { count: 3 },
                Record::Commit {
                    slot: 1,
                    key: key(3),
                    crc: 30
                },
                Record::Commit {
                    slot: 2,
                    key: key(4),
                    crc: 40
                },
                Record::Skip { count: 2 },
            ]
        );
        let (mut j, _, _) = open(&dir, h, Damaged::Skip).unwrap();
        j.append_sync(&[Record::Free {
            slot: 0,
            key: key(9),
        }])
        .1
        .unwrap();
        // A reader of the old file, one position in.
        let mut tail = Tail::open(&dir, &name(0), h).unwrap().unwrap();
        assert_eq!(read(&mut tail, &dir, None).len(), 1);
        j.compact_sync(&dir, &recs).unwrap();
        assert_eq!(j.records(), 4);
        // The reader restarts in the new file, a Skip cut at each limit.
        let mut want = vec![None];
        want.extend(items(&[Record::Skip { count: 2 }]));
        assert_eq!(read(&mut tail, &dir, Some(2)), want);
        assert_eq!(
            read(&mut tail, &dir, Some(4)),
            items(&[Record::Skip { count: 1 }, recs[1]])
        );
        assert_eq!(read(&mut tail, &dir, None), items(&recs[2..]));
        assert_eq!(tail.records(), 7);
        // Reopened: the same records, and a stray compaction file is removed.
        std::fs::write(path.join(compact_name(0)), b"half").unwrap();
        let (j, got, _) = open(&dir, h, Damaged::Skip).unwrap();
        assert_eq!(j.records(), 4);
        assert_eq!(
            got,
            recs.iter().map(|r| Item::Record(*r)).collect::<Vec<_>>()
        );
        assert!(!path.join(compact_name(0)).exists());
        // A Skip longer than any journal is split (each piece a valid record).
        let far = compacted(&[(3 * MAX_SKIP, 0, key(1), 1)], 3 * MAX_SKIP + 1);
        assert_eq!(far.len(), 4);
        assert!(far
            .iter()
            .all(|r| Record::decode(&r.encode(), 8) == Some(*r)));
        std::fs::remove_dir_all(&path).unwrap();
    }

    // Old behaviour: a record failing its checksum in the middle of a journal was taken for a
    // torn tail: the writer's next open cut the journal there, deleting every later commit
    // without an error or a counter.
    #[test]
    fn only_what_follows_the_last_valid_record_is_a_torn_tail() {
        let (path, dir) = scratch("journal");
        let h = header(3);
        let recs = [
            Record::Commit {
                slot: 1,
                key: key(1),
                crc: 7,
            },
            Record::Free {
                slot: 1,
                key: key(1),
            },
            Record::Commit {
                slot: 1,
                key: key(2),
                crc: 9,
            },
        ];
        let (mut j, got, _) = open(&dir, h, Damaged::Skip).unwrap();
        assert!(got.is_empty());
        j.append_sync(&recs).1.unwrap();
        drop(j);
        let file = path.join(name(3));
        // Half a record more: the tail a killed process leaves.
        let mut bytes = std::fs::read(&file).unwrap();
        bytes.extend_from_slice(&recs[0].encode()[..50]);
        std::fs::write(&file, &bytes).unwrap();
        let mut tail = Tail::open(&dir, &name(3), h).unwrap().unwrap();
        assert_eq!(read(&mut tail, &dir, Some(2)), items(&recs[..2]));
        assert_eq!(read(&mut tail, &dir, None), items(&recs[2..]));
        assert_eq!(tail.records(), 3);
        let (_j, got, opened) = open(&dir, h, Damaged::Skip).unwrap();
        assert_eq!(
            got,
            recs.iter().map(|r| Item::Record(*r)).collect::<Vec<_>>()
        );
        assert_eq!(
            opened,
            Opened {
                damaged: 0,
                torn: 1
            }
        );
        let len = HEADER_BYTES + 3 * RECORD_BYTES;
        assert_eq!(std::fs::metadata(&file).unwrap().len(), len);
        // A flipped byte in record 1, with record 2 valid after it: damage, not a tail. Every
        // reader skips it as one position and counts it; nothing after it is cut.
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[(HEADER_BYTES + RECORD_BYTES + 20) as usize] ^= 1;
        std::fs::write(&file, &bytes).unwrap();
        let damaged = vec![
            Some(Item::Record(recs[0])),
            Some(Item::Damaged),
            Some(Item::Record(recs[2])),
        ];
        let mut tail = Tail::open(&dir, &name(3), h).unwrap().unwrap();
        assert_eq!(read(&mut tail, &dir, None), damaged);
        let (_j, got, opened) = open(&dir, h, Damaged::Skip).unwrap();
        assert_eq!(got, damaged.iter().map(|i| i.unwrap()).collect::<Vec<_>>());
        assert_eq!(
            opened,
            Opened {
                damaged: 1,
                torn: 0
            }
        );
        assert_eq!(std::fs::metadata(&file).unwrap().len(), len, "nothing cut");
        // Refused when asked to, naming the record, and nothing changed on disk.
        match open(&dir, h, Damaged::Refuse) {
            Err(Error::Storage {
                failure: StorageFailure::Corrupt,
                reason,
                ..
            }) => assert!(reason.contains("record 1"), "{reason}"),
            other => panic!("a damaged journal opened under Refuse: {other:?}"),
        }
        let mut tail = Tail::open(&dir, &name(3), h).unwrap().unwrap();
        assert!(matches!(
            tail.read_new(&dir, None, Damaged::Refuse, &mut |_| {}),
            Err(Error::Storage {
                failure: StorageFailure::Corrupt,
                ..
            })
        ));
        assert_eq!(std::fs::read(&file).unwrap(), bytes);
        // Damaged at the end only: a reader waits for it (a record being appended, or the
        // tail of a killed writer); once a valid record follows, it is damage.
        let (mut j, _, _) = open(&dir, h, Damaged::Skip).unwrap();
        let mut tail = Tail::open(&dir, &name(3), h).unwrap().unwrap();
        assert_eq!(read(&mut tail, &dir, None).len(), 3);
        let mut bytes = std::fs::read(&file).unwrap();
        bytes.extend_from_slice(&[0xEE; RECORD_BYTES as usize]);
        std::fs::write(&file, &bytes).unwrap();
        assert!(read(&mut tail, &dir, None).is_empty());
        assert!(read(&mut tail, &dir, None).is_empty());
        // (The writer, open before the damage, appends after its own last record.)
        let more = Record::Free {
            slot: 1,
            key: key(2),
        };
        let mut bytes = std::fs::read(&file).unwrap();
        bytes.extend_from_slice(&more.encode());
        std::fs::write(&file, &bytes).unwrap();
        assert_eq!(
            read(&mut tail, &dir, None),
            vec![Some(Item::Damaged), Some(Item::Record(more))]
        );
        j.append_sync(&[]).1.unwrap();
        // Another slot size is refused; a record naming a slot past the file is bad.
        assert!(matches!(
            open(
                &dir,
                Header {
                    slot_bytes: 8192,
                    ..h
                },
                Damaged::Skip
            ),
            Err(Error::Storage {
                failure: StorageFailure::Format,
                ..
            })
        ));
        let past = Record::Commit {
            slot: 8,
            key: key(1),
            crc: 0,
        };
        assert_eq!(Record::decode(&past.encode(), 8), None);
        assert_eq!(Record::decode(&past.encode(), 9), Some(past));
        let huge = Record::Skip {
            count: MAX_SKIP + 1,
        };
        assert_eq!(Record::decode(&huge.encode(), 8), None);
        std::fs::remove_dir_all(&path).unwrap();
    }

    // Old behaviour: another rank's journal was read whole at every snapshot (a 512 MiB
    // file: half a GB of memory and seconds per snapshot) when it did not end in a whole
    // valid record.
    #[test]
    fn a_reader_reads_a_bad_tail_once_while_the_file_stays_as_it_was() {
        let (path, dir) = scratch("tail-once");
        let h = header(1);
        let (mut j, _, _) = open(&dir, h, Damaged::Skip).unwrap();
        let commit = Record::Commit {
            slot: 2,
            key: key(5),
            crc: 1,
        };
        j.append_sync(&[commit]).1.unwrap();
        drop(j);
        let file = path.join(name(1));
        // A long run of garbage after it: more than one read's worth.
        let mut bytes = std::fs::read(&file).unwrap();
        bytes.resize(
            bytes.len() + 3 * CHUNK_RECORDS * RECORD_BYTES as usize + 7,
            0x5A,
        );
        std::fs::write(&file, &bytes).unwrap();
        let mut tail = Tail::open(&dir, &name(1), h).unwrap().unwrap();
        assert_eq!(read(&mut tail, &dir, None), items(&[commit]));
        let seen = tail.pending;
        assert!(seen.is_some());
        // Unchanged: not read again (its state says so), and nothing handed over.
        assert!(read(&mut tail, &dir, None).is_empty());
        assert_eq!(tail.pending, seen);
        std::fs::remove_dir_all(&path).unwrap();
    }
}
