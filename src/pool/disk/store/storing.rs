//! Storing pages: slots taken (least recently used ones freed first), pages packed with their
//! checksums into staging while the last round's writes drain, one sync, then the commits.

use std::time::Instant;

use super::super::io::Posted;
use super::super::journal::{self, Item, Record};
use super::super::order::wait_for_queued_sync;
use super::super::slots::storage;
use super::super::types::StoreReport;
use super::{data_name, read_only, DiskStore};
use crate::error::Result;
use crate::index::LocalPage;
use crate::key::PageKey;

impl DiskStore {
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
    ///
    /// [`Error::Timeout`]: crate::Error::Timeout
    /// [`StorageFailure::ReadOnly`]: crate::error::StorageFailure::ReadOnly
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
    pub(super) fn append_sync(&mut self, records: &[Record]) -> Result<()> {
        let Some(journal) = self.journal.as_mut() else {
            return Err(read_only(&self.config.dir));
        };
        let (kept, appended) = journal.append_sync(records);
        for &r in &records[..kept] {
            self.index.apply(self.config.writer, Item::Record(r));
        }
        appended
    }
}
