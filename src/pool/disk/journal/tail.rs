//! A reader of another writer rank's journal, from where it last stopped (the journal's
//! module docs: torn tails, damage, compaction).

use std::fs::File;
use std::os::fd::AsFd;
use std::path::PathBuf;

use super::super::dir::{How, StoreDir};
use super::super::slots::storage;
use super::super::types::Damaged;
use super::records::{Header, Item, Record, HEADER_BYTES};
use super::scan::{corrupt, read_full_at, read_header, scan};
use crate::error::{Result, StorageFailure};

/// A step of [`Tail::read_new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pool::disk) enum Step {
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
pub(in crate::pool::disk) struct Tail {
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

    /// The file as it was when it ended in a bad run (read again only once it changes).
    #[cfg(test)]
    pub fn pending(&self) -> Option<Seen> {
        self.pending
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
