//! The journal of one writer rank: a 64-byte header, then fixed 96-byte records appended in
//! order, each with its own CRC-32C. A `Commit` record says a slot holds a key's page, with the
//! page's checksum, and is appended only after the slot's data is durable; a `Free` record says
//! a slot no longer holds its key, and is durable before the slot is overwritten. Replaying the
//! records in order rebuilds the index (`index.rs`); a record that does not check (the tail a
//! killed process left half-written) ends the journal there.
//!
//! Records have logical positions (what snapshots count): one each, but a `Skip` record stands
//! for `count` positions. **Compaction** rewrites a journal grown past a bound from the live
//! index: each live `Commit` at its original position, the dead positions between them as
//! `Skip`s, so every position (and so every snapshot taken since) means what it meant. It writes
//! `wNNNN.journal.compact`, syncs it, renames it over the journal and syncs the directory: a
//! process killed before the rename leaves the old journal (and a stray file, removed at the
//! next open); after it, the new one, whole. Readers notice the new file (another inode) once
//! they have read the old one to its end, and replay the writer again from the new file: their
//! entries of that writer are rebuilt, so every rank agrees on every snapshot taken since the
//! compaction (an older snapshot no longer sees pages freed before it).
//!
//! ```text
//! header: "KVSJRNL1" | u32 version | u32 writer | u64 page bytes | u64 slot bytes | u64 slots
//!         | 20 zero bytes | u32 CRC-32C of bytes 0..60
//! record: "KVSR" | u8 kind (1 commit, 2 free, 3 skip) | 3 zero bytes | u64 slot (skip: count)
//!         | 64-byte key (skip: zeros) | u32 page CRC-32C | 4 zero bytes
//!         | u32 CRC-32C of bytes 0..88 | 4 zero bytes
//! ```

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::slots::storage;
use crate::error::{Result, StorageFailure};
use crate::key::{PageKey, KEY_BYTES};

/// Bytes of the header.
pub(super) const HEADER_BYTES: u64 = 64;
/// Bytes of one record.
pub(super) const RECORD_BYTES: u64 = 96;
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
    fn encode(&self) -> [u8; RECORD_BYTES as usize] {
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

    fn decode(b: &[u8]) -> Option<Self> {
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
            1 => Some(Self::Commit {
                slot,
                key,
                crc: u32_at(80),
            }),
            2 => Some(Self::Free { slot, key }),
            3 if slot > 0 => Some(Self::Skip { count: slot }),
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

/// The path of writer `writer`'s journal in `dir`.
pub(super) fn path(dir: &Path, writer: u32) -> PathBuf {
    dir.join(format!("w{writer:04}.journal"))
}

/// Where a compaction of the journal at `path` is written before its rename.
fn compact_path(path: &Path) -> PathBuf {
    path.with_extension("journal.compact")
}

/// A live commit compaction keeps: (position, slot, key, page CRC).
pub(super) type Live = (u64, u64, PageKey, u32);

/// The records of a compacted journal of `total` positions keeping `live` (sorted by position,
/// each below `total`): each commit at its position, `Skip`s between.
pub(super) fn compacted(live: &[Live], total: u64) -> Vec<Record> {
    let mut out = Vec::with_capacity(2 * live.len() + 1);
    let mut at = 0;
    for &(position, slot, key, crc) in live {
        if position > at {
            out.push(Record::Skip {
                count: position - at,
            });
        }
        out.push(Record::Commit { slot, key, crc });
        at = position + 1;
    }
    if total > at {
        out.push(Record::Skip { count: total - at });
    }
    out
}

/// A writer's own journal, open for appending.
#[derive(Debug)]
pub(super) struct Journal {
    file: File,
    path: PathBuf,
    header: Header,
    /// Valid records in the file.
    records: u64,
}

impl Journal {
    /// Opens (creating it with `header` when absent) the journal at `path`: the records that
    /// check, in order; a torn tail is cut off so the next append follows the last good record.
    pub fn open(path: &Path, header: Header) -> Result<(Self, Vec<Record>)> {
        // A compaction killed before its rename: the journal is the old one, whole.
        let _ = std::fs::remove_file(compact_path(path));
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| storage(path, StorageFailure::Open, e))?;
        let len = file
            .metadata()
            .map_err(|e| storage(path, StorageFailure::Io, e))?
            .len();
        if len < HEADER_BYTES {
            // New (or a header that never reached the disk: no record can follow it).
            file.set_len(0)
                .and_then(|()| file.write_all(&header.encode()))
                .and_then(|()| file.sync_all())
                .map_err(|e| storage(path, io_failure(&e), e))?;
            sync_dir(path)?;
            return Ok((
                Self {
                    file,
                    path: path.into(),
                    header,
                    records: 0,
                },
                Vec::new(),
            ));
        }
        let (found, records) = read(&mut file, path, u64::MAX)?;
        if found != header {
            return Err(storage(
                path,
                StorageFailure::Format,
                format!("the journal says {found:?}, this store is {header:?}"),
            ));
        }
        let count = records.len() as u64;
        if len != HEADER_BYTES + count * RECORD_BYTES {
            // A torn tail (a process killed mid-append): cut it so appends stay in step.
            file.set_len(HEADER_BYTES + count * RECORD_BYTES)
                .and_then(|()| file.sync_all())
                .map_err(|e| storage(path, StorageFailure::Io, e))?;
        }
        file.seek(SeekFrom::End(0))
            .map_err(|e| storage(path, StorageFailure::Io, e))?;
        Ok((
            Self {
                file,
                path: path.into(),
                header,
                records: count,
            },
            records,
        ))
    }

    /// Records in the file (a `Skip` counts one).
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Rewrites the journal as `records` (what [`compacted`] makes of the live index), crash-safe
    /// (module docs): written beside it, synced, renamed over it, the directory synced.
    pub fn compact_sync(&mut self, records: &[Record]) -> Result<()> {
        let tmp = compact_path(&self.path);
        let mut bytes = self.header.encode().to_vec();
        bytes.extend(records.iter().flat_map(|r| r.encode()));
        let written = (|| -> std::io::Result<File> {
            let mut f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            Ok(f)
        })();
        let file = match written {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(storage(&tmp, io_failure(&e), e));
            }
        };
        std::fs::rename(&tmp, &self.path).map_err(|e| storage(&self.path, io_failure(&e), e))?;
        sync_dir(&self.path)?;
        self.file = file;
        self.file
            .seek(SeekFrom::End(0))
            .map_err(|e| storage(&self.path, StorageFailure::Io, e))?;
        self.records = records.len() as u64;
        Ok(())
    }

    /// Appends `records` and makes them durable (one `fdatasync`).
    pub fn append_sync(&mut self, records: &[Record]) -> Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let bytes: Vec<u8> = records.iter().flat_map(|r| r.encode()).collect();
        if let Err(e) = self
            .file
            .write_all(&bytes)
            .and_then(|()| self.file.sync_data())
        {
            // Put the file back where the last good record ends: a half-written batch must not
            // stay in front of the next one.
            let _ = self
                .file
                .set_len(HEADER_BYTES + self.records * RECORD_BYTES)
                .and_then(|()| self.file.seek(SeekFrom::End(0)).map(|_| ()));
            return Err(storage(&self.path, io_failure(&e), e));
        }
        self.records += records.len() as u64;
        Ok(())
    }
}

/// Reads writer journal `path`: its header and its first `limit` records that check (stopping
/// at the first that does not).
fn read(file: &mut File, path: &Path, limit: u64) -> Result<(Header, Vec<Record>)> {
    let mut bytes = Vec::new();
    file.seek(SeekFrom::Start(0))
        .and_then(|_| file.read_to_end(&mut bytes))
        .map_err(|e| storage(path, StorageFailure::Io, e))?;
    let header = bytes
        .get(..HEADER_BYTES as usize)
        .and_then(Header::decode)
        .ok_or_else(|| storage(path, StorageFailure::Format, "no valid journal header"))?;
    let records = decode_all(&bytes[HEADER_BYTES as usize..], limit);
    Ok((header, records))
}

fn decode_all(bytes: &[u8], limit: u64) -> Vec<Record> {
    bytes
        .chunks_exact(RECORD_BYTES as usize)
        .take(usize::try_from(limit).unwrap_or(usize::MAX))
        .map_while(Record::decode)
        .collect()
}

/// A reader of another writer's journal, from where it last stopped: only records that check
/// are returned, so a record being appended, or the torn tail of a killed writer, is not seen
/// until (unless) it is whole.
#[derive(Debug)]
pub(super) struct Tail {
    file: File,
    path: PathBuf,
    /// Records of `file` consumed so far.
    read: u64,
    /// Logical positions returned so far.
    records: u64,
    /// Positions of a `Skip` cut at a limit, still to return.
    carry: u64,
}

impl Tail {
    /// Opens writer journal `path` if it exists (`None` when the writer has not started), and
    /// checks its header is `expected` but for the writer rank.
    pub fn open(path: &Path, expected: Header) -> Result<Option<Self>> {
        let mut file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(storage(path, StorageFailure::Open, e)),
        };
        let mut b = [0u8; HEADER_BYTES as usize];
        if file.read_exact(&mut b).is_err() {
            // Created, its header not written yet: as if absent.
            return Ok(None);
        }
        match Header::decode(&b) {
            Some(h) if h == expected => Ok(Some(Self {
                file,
                path: path.into(),
                read: 0,
                records: 0,
                carry: 0,
            })),
            found => Err(storage(
                path,
                StorageFailure::Format,
                format!("the journal says {found:?}, this store expects {expected:?}"),
            )),
        }
    }

    /// Logical positions returned so far.
    #[cfg(test)]
    pub fn records(&self) -> u64 {
        self.records
    }

    /// The records after those already returned, up to logical position `limit` (`None`: all
    /// that are whole now); a `Skip` crossing the limit is cut there. Once the file is read to
    /// its end and the journal's path names another file (a compaction), reads that one from
    /// its start: then the first value is true and the records are the writer's from position
    /// 0 (the caller forgets what it had of the writer first).
    pub fn read_new(&mut self, limit: Option<u64>) -> Result<(bool, Vec<Record>)> {
        let mut out = Vec::new();
        let mut restarted = false;
        let want = |records: u64| limit.is_none_or(|l| records < l);
        let take = |this: &mut Self, r: Record, out: &mut Vec<Record>| {
            let room = limit.map_or(u64::MAX, |l| l - this.records);
            let n = r.span().min(room);
            if n < r.span() {
                this.carry = r.span() - n;
            }
            out.push(match r {
                Record::Skip { .. } => Record::Skip { count: n },
                r => r,
            });
            this.records += n;
        };
        for pass in 0..2 {
            // The rest of a Skip cut at an earlier limit, or crossing the point a reopened
            // file was positioned at.
            if self.carry > 0 && want(self.records) {
                let r = Record::Skip { count: self.carry };
                self.carry = 0;
                take(self, r, &mut out);
            }
            if !want(self.records) || self.carry > 0 {
                break;
            }
            let mut bytes = Vec::new();
            self.file
                .seek(SeekFrom::Start(HEADER_BYTES + self.read * RECORD_BYTES))
                .and_then(|_| self.file.read_to_end(&mut bytes))
                .map_err(|e| storage(&self.path, StorageFailure::Io, e))?;
            let records = decode_all(&bytes, u64::MAX);
            let whole = bytes.len() as u64 % RECORD_BYTES == 0
                && records.len() as u64 == bytes.len() as u64 / RECORD_BYTES;
            let mut consumed = 0;
            for r in records.iter().copied() {
                if !want(self.records) {
                    break;
                }
                self.read += 1;
                consumed += 1;
                take(self, r, &mut out);
            }
            // Read to the end of a file the journal's path no longer names: a compaction
            // replaced it; replay the writer from the new one's start (once per call).
            let at_end = whole && consumed == records.len();
            if pass == 1 || !at_end || !self.replaced()? {
                break;
            }
            self.reopen()?;
            out.clear();
            restarted = true;
        }
        Ok((restarted, out))
    }

    /// Whether the journal's path now names another file than the one open.
    fn replaced(&self) -> Result<bool> {
        use std::os::unix::fs::MetadataExt;
        let open = self
            .file
            .metadata()
            .map_err(|e| storage(&self.path, StorageFailure::Io, e))?;
        Ok(match std::fs::metadata(&self.path) {
            Ok(now) => (now.dev(), now.ino()) != (open.dev(), open.ino()),
            Err(_) => false,
        })
    }

    /// Opens the file the journal's path names now, from its first record, after checking its
    /// header is the one of the file it replaces.
    fn reopen(&mut self) -> Result<()> {
        let mut file =
            File::open(&self.path).map_err(|e| storage(&self.path, StorageFailure::Open, e))?;
        let mut theirs = [0u8; HEADER_BYTES as usize];
        let mut mine = [0u8; HEADER_BYTES as usize];
        file.read_exact(&mut theirs)
            .and_then(|()| self.file.seek(SeekFrom::Start(0)).map(|_| ()))
            .and_then(|()| self.file.read_exact(&mut mine))
            .map_err(|e| storage(&self.path, StorageFailure::Io, e))?;
        if Header::decode(&theirs).is_none() || theirs != mine {
            return Err(storage(
                &self.path,
                StorageFailure::Format,
                "the compacted journal's header differs from the one it replaced",
            ));
        }
        self.file = file;
        (self.read, self.records, self.carry) = (0, 0, 0);
        Ok(())
    }
}

/// Full disk or quota: [`StorageFailure::Full`]; anything else an I/O failure.
pub(super) fn io_failure(e: &std::io::Error) -> StorageFailure {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => StorageFailure::Full,
        _ => StorageFailure::Io,
    }
}

/// Makes a new file's name durable (its directory synced).
fn sync_dir(path: &Path) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| storage(dir, StorageFailure::Io, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> PageKey {
        PageKey::from_bytes(&[i; KEY_BYTES]).unwrap()
    }

    #[test]
    fn compaction_keeps_positions_and_skips_are_cut_at_limits() {
        let dir = std::env::temp_dir().join(format!("kvshard-compact-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = path(&dir, 0);
        let _ = std::fs::remove_file(&p);
        let h = Header {
            writer: 0,
            page_bytes: 100,
            slot_bytes: 4096,
            slots: 8,
        };
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
        let (mut j, _) = Journal::open(&p, h).unwrap();
        j.append_sync(&[Record::Free {
            slot: 0,
            key: key(9),
        }])
        .unwrap();
        // A reader of the old file, one position in.
        let mut tail = Tail::open(&p, h).unwrap().unwrap();
        assert_eq!(tail.read_new(None).unwrap().1.len(), 1);
        j.compact_sync(&recs).unwrap();
        assert_eq!(j.records(), 4);
        // The reader restarts in the new file, a Skip cut at each limit.
        assert_eq!(
            tail.read_new(Some(2)).unwrap(),
            (true, vec![Record::Skip { count: 2 }])
        );
        assert_eq!(
            tail.read_new(Some(4)).unwrap(),
            (false, vec![Record::Skip { count: 1 }, recs[1]])
        );
        assert_eq!(tail.read_new(None).unwrap(), (false, recs[2..].to_vec()));
        assert_eq!(tail.records(), 7);
        // Reopened: the same records, and a stray compaction file is removed.
        std::fs::write(compact_path(&p), b"half").unwrap();
        let (j, got) = Journal::open(&p, h).unwrap();
        assert_eq!((j.records(), got), (4, recs));
        assert!(!compact_path(&p).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn records_survive_reopen_and_a_torn_tail_is_cut() {
        let dir = std::env::temp_dir().join(format!("kvshard-journal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = path(&dir, 3);
        let _ = std::fs::remove_file(&p);
        let h = Header {
            writer: 3,
            page_bytes: 100,
            slot_bytes: 4096,
            slots: 8,
        };
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
        let (mut j, got) = Journal::open(&p, h).unwrap();
        assert!(got.is_empty());
        j.append_sync(&recs).unwrap();
        drop(j);
        // Half a record more: the tail a killed process leaves.
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(&recs[0].encode()[..50]).unwrap();
        drop(f);
        let mut tail = Tail::open(&p, h).unwrap().unwrap();
        assert_eq!(tail.read_new(Some(2)).unwrap(), (false, recs[..2].to_vec()));
        assert_eq!(tail.read_new(None).unwrap(), (false, recs[2..].to_vec()));
        assert_eq!(tail.records(), 3);
        let (_j, got) = Journal::open(&p, h).unwrap();
        assert_eq!(got, recs);
        assert_eq!(
            std::fs::metadata(&p).unwrap().len(),
            HEADER_BYTES + 3 * RECORD_BYTES
        );
        // A flipped byte in record 1 ends the journal there.
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[(HEADER_BYTES + RECORD_BYTES + 20) as usize] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let mut tail = Tail::open(&p, h).unwrap().unwrap();
        assert_eq!(tail.read_new(None).unwrap(), (false, recs[..1].to_vec()));
        // Another slot size is refused.
        assert!(matches!(
            Journal::open(
                &p,
                Header {
                    slot_bytes: 8192,
                    ..h
                }
            ),
            Err(crate::Error::Storage {
                failure: StorageFailure::Format,
                ..
            })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
