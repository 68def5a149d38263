//! Loading pages from whichever rank wrote them: every file opened and registered first, rounds
//! of reads alternating between two staging buffers, each slot checked before it is unpacked.

use super::super::io::Posted;
use super::super::journal::Record;
use super::super::order::wait_for_queued_sync;
use super::super::slots::storage;
use super::super::types::LoadOutcome;
use super::{data_name, DiskStore, DATA_READ};
use crate::error::{Result, StorageFailure};
use crate::index::LocalPage;
use crate::key::PageKey;

impl DiskStore {
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
    ///
    /// [`Error::Timeout`]: crate::Error::Timeout
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
