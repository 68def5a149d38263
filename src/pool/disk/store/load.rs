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
            let (layout, bases) = (&self.layout, self.bases.as_slice());
            let checked =
                check_and_unpack(round, items, src, (slot_bytes, page_bytes), |data, page| {
                    // SAFETY: as in `write_all`: the host pool's queued work on these pages has run
                    // (waited for above), the slot's bytes checked; `check_and_unpack` unpacks
                    // into a page from one thread at a time.
                    unsafe { layout.unpack(bases, data, page) }
                });
            for (&(w, slot, _, i), loaded) in round.iter().zip(checked) {
                if loaded {
                    out[i] = LoadOutcome::Loaded;
                    self.stats.loaded_pages += 1;
                    continue;
                }
                out[i] = LoadOutcome::Corrupt;
                self.stats.corrupt_pages += 1;
                if writing == Some(w) {
                    corrupt_own.push(Record::Free {
                        slot,
                        key: items[i].0,
                    });
                }
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

/// Threads that check and unpack a round's pages at most. A page's CRC and its copy into the
/// host pool are host CPU work (about 1 ms a 2.7 MB page on one core: H200 host, 2026-12-03,
/// dd7c92c) that the next round's reads overlap, except the last round's, which one thread
/// left to run after every read had ended; four threads shorten that tail fourfold.
const UNPACK_THREADS: usize = 4;

/// Checks each slot of `round` (staged in `src` at `slot_bytes` strides, `page_bytes` of page
/// each) against its commit's CRC and unpacks those that match into their host pages with
/// `unpack`; returns per slot whether it was loaded. The pages are shared out over up to
/// [`UNPACK_THREADS`] threads, unless a host page is named twice (then one thread unpacks
/// them in order, the later slot's bytes landing last, as a single pass would).
fn check_and_unpack<F>(
    round: &[(u32, u64, u32, usize)],
    items: &[(PageKey, LocalPage)],
    src: &[u8],
    (slot_bytes, page_bytes): (usize, usize),
    unpack: F,
) -> Vec<bool>
where
    F: Fn(&[u8], LocalPage) + Sync,
{
    let one = |j: usize| {
        let (_, _, crc, i) = round[j];
        let (key, page) = items[i];
        let data = &src[j * slot_bytes..j * slot_bytes + page_bytes];
        let ok = page_crc(&key, data) == crc;
        if ok {
            unpack(data, page);
        }
        ok
    };
    let distinct = {
        let mut pages: Vec<u64> = round.iter().map(|f| items[f.3].1 .0).collect();
        pages.sort_unstable();
        pages.windows(2).all(|w| w[0] != w[1])
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(UNPACK_THREADS)
        .min(round.len());
    if !distinct || threads <= 1 {
        return (0..round.len()).map(one).collect();
    }
    let per = round.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> = (0..round.len())
            .step_by(per)
            .map(|from| {
                let one = &one;
                s.spawn(move || {
                    (from..(from + per).min(round.len()))
                        .map(one)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts
            .into_iter()
            // A checking thread only computes CRCs and copies bytes within bounds checked
            // above; a panic there is a bug, resumed here as it would have been inline.
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// The checksum a commit record holds: CRC-32C of the key, then the page's bytes (so a slot
/// reused for another key never checks as the old one).
fn page_crc(key: &PageKey, page: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(key.bytes()), page)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn key(n: u8) -> PageKey {
        PageKey::from_bytes(&[n; crate::key::KEY_BYTES]).unwrap()
    }

    /// A staged round: its items, the staging bytes and the round's slots.
    type Staged = (
        Vec<(PageKey, LocalPage)>,
        Vec<u8>,
        Vec<(u32, u64, u32, usize)>,
    );

    /// Slots of 16 bytes (12 of page): slot j holds bytes j, for the host page of item j.
    fn staged(n: usize, pages: &[u64]) -> Staged {
        let mut src = vec![0u8; n * 16];
        let mut round = Vec::new();
        let items: Vec<_> = (0..n)
            .map(|j| (key(j as u8), LocalPage(pages[j])))
            .collect();
        for j in 0..n {
            src[j * 16..j * 16 + 12].fill(j as u8);
            round.push((
                0,
                j as u64,
                page_crc(&items[j].0, &src[j * 16..j * 16 + 12]),
                j,
            ));
        }
        (items, src, round)
    }

    #[test]
    fn every_page_checked_and_only_matching_ones_unpacked() {
        let n = 37;
        let pages: Vec<u64> = (1..=n as u64).collect();
        let (items, mut src, round) = staged(n, &pages);
        // Damage slots 3 and 36 (one in the first share, one in the last).
        src[3 * 16] ^= 1;
        src[36 * 16 + 11] ^= 0x80;
        let got = Mutex::new(Vec::new());
        let loaded = check_and_unpack(&round, &items, &src, (16, 12), |data, page| {
            got.lock().unwrap().push((page.0, data.to_vec()));
        });
        let want: Vec<bool> = (0..n).map(|j| j != 3 && j != 36).collect();
        assert_eq!(loaded, want);
        let mut got = got.into_inner().unwrap();
        got.sort();
        let expect: Vec<(u64, Vec<u8>)> = (0..n)
            .filter(|&j| want[j])
            .map(|j| (pages[j], vec![j as u8; 12]))
            .collect();
        assert_eq!(got, expect);
    }

    #[test]
    fn a_host_page_named_twice_is_unpacked_in_round_order() {
        let pages = [5, 6, 5, 7, 5, 8, 9, 10];
        let (items, src, round) = staged(pages.len(), &pages);
        let got = Mutex::new(Vec::new());
        let loaded = check_and_unpack(&round, &items, &src, (16, 12), |data, page| {
            got.lock().unwrap().push((page.0, data[0]));
        });
        assert!(loaded.iter().all(|&l| l));
        let order: Vec<u8> = got
            .into_inner()
            .unwrap()
            .into_iter()
            .filter(|&(p, _)| p == 5)
            .map(|(_, b)| b)
            .collect();
        assert_eq!(order, vec![0, 2, 4]);
    }
}
