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

mod records;
mod scan;
mod tail;
mod writer;

pub(super) use records::{compacted, name, Header, Item, Live, Record};
pub(super) use scan::read_header;
pub(super) use tail::{Step, Tail};
pub(super) use writer::{io_failure, Journal};

/// The journal's tests: compaction, torn tails and damage, bounded reads.
#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::super::dir::StoreDir;
    use super::super::types::Damaged;
    use super::records::{compact_name, CHUNK_RECORDS, HEADER_BYTES, MAX_SKIP, RECORD_BYTES};
    use super::writer::Opened;
    use super::{compacted, name, Header, Item, Journal, Record, Step, Tail};
    use crate::error::{Error, Result, StorageFailure};
    use crate::key::{PageKey, KEY_BYTES};

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
        a_torn_tail_is_waited_for_then_cut(&dir, h, &file, &recs);
        let bytes = a_damaged_record_is_skipped_and_nothing_cut(&dir, h, &file, &recs);
        damage_is_refused_when_asked_to(&dir, h, &file, &bytes);
        damage_at_the_end_waits_for_a_valid_record(&dir, h, &file);
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

    /// Half a record more (the tail a killed process leaves): a reader waits for it, the writer's
    /// open cuts it.
    fn a_torn_tail_is_waited_for_then_cut(dir: &StoreDir, h: Header, file: &Path, recs: &[Record]) {
        let mut bytes = std::fs::read(file).unwrap();
        bytes.extend_from_slice(&recs[0].encode()[..50]);
        std::fs::write(file, &bytes).unwrap();
        let mut tail = Tail::open(dir, &name(3), h).unwrap().unwrap();
        assert_eq!(read(&mut tail, dir, Some(2)), items(&recs[..2]));
        assert_eq!(read(&mut tail, dir, None), items(&recs[2..]));
        assert_eq!(tail.records(), 3);
        let (_j, got, opened) = open(dir, h, Damaged::Skip).unwrap();
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
        assert_eq!(std::fs::metadata(file).unwrap().len(), len);
    }

    /// A flipped byte in record 1, with record 2 valid after it: damage, not a tail. Every
    /// reader skips it as one position and counts it; nothing after it is cut. Returns the
    /// journal's bytes.
    fn a_damaged_record_is_skipped_and_nothing_cut(
        dir: &StoreDir,
        h: Header,
        file: &Path,
        recs: &[Record],
    ) -> Vec<u8> {
        let mut bytes = std::fs::read(file).unwrap();
        bytes[(HEADER_BYTES + RECORD_BYTES + 20) as usize] ^= 1;
        std::fs::write(file, &bytes).unwrap();
        let damaged = vec![
            Some(Item::Record(recs[0])),
            Some(Item::Damaged),
            Some(Item::Record(recs[2])),
        ];
        let mut tail = Tail::open(dir, &name(3), h).unwrap().unwrap();
        assert_eq!(read(&mut tail, dir, None), damaged);
        let (_j, got, opened) = open(dir, h, Damaged::Skip).unwrap();
        assert_eq!(got, damaged.iter().map(|i| i.unwrap()).collect::<Vec<_>>());
        assert_eq!(
            opened,
            Opened {
                damaged: 1,
                torn: 0
            }
        );
        let len = HEADER_BYTES + 3 * RECORD_BYTES;
        assert_eq!(std::fs::metadata(file).unwrap().len(), len, "nothing cut");
        bytes
    }

    /// Refused when asked to, naming the record, and nothing changed on disk (still `bytes`).
    fn damage_is_refused_when_asked_to(dir: &StoreDir, h: Header, file: &Path, bytes: &[u8]) {
        match open(dir, h, Damaged::Refuse) {
            Err(Error::Storage {
                failure: StorageFailure::Corrupt,
                reason,
                ..
            }) => assert!(reason.contains("record 1"), "{reason}"),
            other => panic!("a damaged journal opened under Refuse: {other:?}"),
        }
        let mut tail = Tail::open(dir, &name(3), h).unwrap().unwrap();
        assert!(matches!(
            tail.read_new(dir, None, Damaged::Refuse, &mut |_| {}),
            Err(Error::Storage {
                failure: StorageFailure::Corrupt,
                ..
            })
        ));
        assert_eq!(std::fs::read(file).unwrap(), bytes);
    }

    /// Damaged at the end only: a reader waits for it (a record being appended, or the tail of a
    /// killed writer); once a valid record follows, it is damage.
    fn damage_at_the_end_waits_for_a_valid_record(dir: &StoreDir, h: Header, file: &Path) {
        let (mut j, _, _) = open(dir, h, Damaged::Skip).unwrap();
        let mut tail = Tail::open(dir, &name(3), h).unwrap().unwrap();
        assert_eq!(read(&mut tail, dir, None).len(), 3);
        let mut bytes = std::fs::read(file).unwrap();
        bytes.extend_from_slice(&[0xEE; RECORD_BYTES as usize]);
        std::fs::write(file, &bytes).unwrap();
        assert!(read(&mut tail, dir, None).is_empty());
        assert!(read(&mut tail, dir, None).is_empty());
        // (The writer, open before the damage, appends after its own last record.)
        let more = Record::Free {
            slot: 1,
            key: key(2),
        };
        let mut bytes = std::fs::read(file).unwrap();
        bytes.extend_from_slice(&more.encode());
        std::fs::write(file, &bytes).unwrap();
        assert_eq!(
            read(&mut tail, dir, None),
            vec![Some(Item::Damaged), Some(Item::Record(more))]
        );
        j.append_sync(&[]).1.unwrap();
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
        let seen = tail.pending();
        assert!(seen.is_some());
        // Unchanged: not read again (its state says so), and nothing handed over.
        assert!(read(&mut tail, &dir, None).is_empty());
        assert_eq!(tail.pending(), seen);
        std::fs::remove_dir_all(&path).unwrap();
    }
}
