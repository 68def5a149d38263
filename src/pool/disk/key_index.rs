//! The index: key -> slot, rebuilt from the writers' journals, and the LRU order of this rank's
//! own slots.
//!
//! Every entry remembers the journal position of its `Commit` record and, once freed, of its
//! `Free` record, so that presence can be asked *as of a snapshot* (per writer, a count of
//! records): an entry is visible in a snapshot when its commit is inside it and its free is
//! not. A lookup is then a pure function of the keys and the snapshot, whatever else this rank
//! has replayed since: every rank of the CP group that asks with the same snapshot gets the
//! same answer. Among several visible entries of one key (two ranks wrote it concurrently) the
//! lowest writer's, then the earliest, is the one read.

use std::collections::{BTreeSet, HashMap};

use lru::LruCache;

use super::journal::Record;
use crate::key::PageKey;

/// Where a visible page lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub writer: u32,
    pub slot: u64,
    pub crc: u32,
    committed: u64,
    freed: Option<u64>,
}

impl Entry {
    fn visible(&self, snapshot: Option<&[u64]>) -> bool {
        match snapshot {
            None => self.freed.is_none(),
            Some(s) => {
                let at = s.get(self.writer as usize).copied().unwrap_or(0);
                self.committed < at && self.freed.is_none_or(|f| f >= at)
            }
        }
    }
}

/// The index of one rank.
#[derive(Debug)]
pub(super) struct Index {
    keys: HashMap<PageKey, Vec<Entry>>,
    /// Per writer: records applied.
    replayed: Vec<u64>,
    own: u32,
    /// This rank's slots: the key each holds.
    slots: Vec<Option<PageKey>>,
    /// This rank's free slots, lowest first (so new pages of a batch tend to be adjacent).
    free: BTreeSet<u64>,
    /// This rank's occupied slots, least recently used first.
    lru: LruCache<u64, ()>,
}

impl Index {
    /// An empty index of `writers` writers, this rank `own` with `slots` slots.
    pub fn new(writers: u32, own: u32, slots: u64) -> Self {
        Self {
            keys: HashMap::new(),
            replayed: vec![0; writers as usize],
            own,
            slots: vec![None; slots as usize],
            free: BTreeSet::new(),
            lru: LruCache::unbounded(),
        }
    }

    /// Records applied per writer (this rank's view, at least as new as any snapshot it took).
    pub fn replayed(&self) -> &[u64] {
        &self.replayed
    }

    /// Applies writer `writer`'s next record.
    pub fn apply(&mut self, writer: u32, record: Record) {
        let w = writer as usize;
        let at = self.replayed[w];
        self.replayed[w] += record.span();
        let own = writer == self.own;
        match record {
            // Positions of records a compaction dropped: nothing to do but count them.
            Record::Skip { .. } => {}
            Record::Commit { slot, key, crc } => {
                if own {
                    if let Some(old) = self.slots.get(slot as usize).copied().flatten() {
                        // Never written by kvshard (a Free precedes every reuse); if a journal
                        // says so anyway, the slot holds the newer key only.
                        self.free_entry(writer, slot, old, at);
                    }
                    if let Some(s) = self.slots.get_mut(slot as usize) {
                        *s = Some(key);
                        self.free.remove(&slot);
                        self.lru.put(slot, ());
                    }
                }
                self.keys.entry(key).or_default().push(Entry {
                    writer,
                    slot,
                    crc,
                    committed: at,
                    freed: None,
                });
            }
            Record::Free { slot, key } => {
                self.free_entry(writer, slot, key, at);
                // The slot is not put on the free list: it was freed to be rewritten (it is the
                // batch's now) or because it is damaged ([`Index::release`] frees it then); at
                // open, [`Index::finish_open`] collects every slot no record holds.
                if own && (slot as usize) < self.slots.len() {
                    self.slots[slot as usize] = None;
                    self.lru.pop(&slot);
                }
            }
        }
    }

    fn free_entry(&mut self, writer: u32, slot: u64, key: PageKey, at: u64) {
        if let Some(v) = self.keys.get_mut(&key) {
            for e in v.iter_mut() {
                if e.writer == writer && e.slot == slot && e.freed.is_none() {
                    e.freed = Some(at);
                }
            }
        }
    }

    /// After the own journal has been replayed at open: every slot no record holds is free,
    /// slot 0 included (slots count from 0; host page 0 is the one that is padding).
    pub fn finish_open(&mut self) {
        self.free = (0..self.slots.len() as u64)
            .filter(|&s| self.slots[s as usize].is_none())
            .collect();
    }

    /// Where `key`'s page is, as of `snapshot` (`None`: everything replayed), marking it
    /// recently used when it is one of this rank's slots.
    pub fn find(&mut self, key: &PageKey, snapshot: Option<&[u64]>) -> Option<Entry> {
        let e = self
            .keys
            .get(key)?
            .iter()
            .filter(|e| e.visible(snapshot))
            .min_by_key(|e| (e.writer, e.committed))
            .copied()?;
        if e.writer == self.own {
            self.lru.promote(&e.slot);
        }
        Some(e)
    }

    /// Drops entries freed before `snapshot` (no later snapshot can see them).
    pub fn prune(&mut self, snapshot: &[u64]) {
        self.keys.retain(|_, v| {
            v.retain(|e| {
                let at = snapshot.get(e.writer as usize).copied().unwrap_or(0);
                e.freed.is_none_or(|f| f >= at)
            });
            !v.is_empty()
        });
    }

    /// A slot for a new page of this rank: a free one, else the least recently used one, with
    /// the key it held (whose `Free` record must be durable before the slot is written).
    /// `None` when every slot is reserved by the batch being written.
    pub fn allocate(&mut self) -> Option<(u64, Option<PageKey>)> {
        if let Some(s) = self.free.pop_first() {
            return Some((s, None));
        }
        let (slot, ()) = self.lru.pop_lru()?;
        let old = self.slots[slot as usize];
        Some((slot, old))
    }

    /// Gives back a slot [`Index::allocate`] handed out that was never committed (its write
    /// failed): it is free again, whatever it held before (that key's `Free` is written).
    pub fn release(&mut self, slot: u64) {
        if (slot as usize) < self.slots.len() && self.slots[slot as usize].is_none() {
            self.free.insert(slot);
        }
    }

    /// Forgets every entry of writer `writer` (another rank's) and its replayed count, before
    /// its compacted journal is replayed from the start.
    pub fn forget(&mut self, writer: u32) {
        if writer == self.own {
            return;
        }
        self.keys.retain(|_, v| {
            v.retain(|e| e.writer != writer);
            !v.is_empty()
        });
        if let Some(r) = self.replayed.get_mut(writer as usize) {
            *r = 0;
        }
    }

    /// This rank's live commits (position, slot, key, page CRC), by position: what a compacted
    /// journal keeps.
    pub fn live_own(&self) -> Vec<super::journal::Live> {
        let mut live: Vec<super::journal::Live> = self
            .keys
            .iter()
            .flat_map(|(k, v)| {
                v.iter()
                    .filter(|e| e.writer == self.own && e.freed.is_none())
                    .map(move |e| (e.committed, e.slot, *k, e.crc))
            })
            .collect();
        live.sort_unstable_by_key(|l| l.0);
        live
    }

    /// Occupied slots of this rank.
    pub fn used(&self) -> u64 {
        self.lru.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::KEY_BYTES;

    fn key(i: u8) -> PageKey {
        PageKey::from_bytes(&[i; KEY_BYTES]).unwrap()
    }

    #[test]
    fn presence_is_a_function_of_the_snapshot() {
        let mut ix = Index::new(2, 0, 2);
        ix.finish_open();
        // Writer 1: commit A (record 0), free A (1), commit B in the same slot (2).
        ix.apply(
            1,
            Record::Commit {
                slot: 5,
                key: key(1),
                crc: 1,
            },
        );
        ix.apply(
            1,
            Record::Free {
                slot: 5,
                key: key(1),
            },
        );
        ix.apply(
            1,
            Record::Commit {
                slot: 5,
                key: key(2),
                crc: 2,
            },
        );
        assert_eq!(ix.find(&key(1), Some(&[0, 0])), None);
        assert_eq!(ix.find(&key(1), Some(&[0, 1])).unwrap().crc, 1);
        assert_eq!(ix.find(&key(1), Some(&[0, 2])), None);
        assert_eq!(ix.find(&key(2), Some(&[0, 2])), None);
        assert_eq!(ix.find(&key(2), Some(&[0, 3])).unwrap().slot, 5);
        assert_eq!(ix.find(&key(1), None), None);
        // The same key written by writer 0 too: the lowest writer's entry is read.
        ix.apply(
            0,
            Record::Commit {
                slot: 1,
                key: key(2),
                crc: 3,
            },
        );
        assert_eq!(ix.find(&key(2), Some(&[1, 3])).unwrap().writer, 0);
        assert_eq!(ix.find(&key(2), Some(&[0, 3])).unwrap().writer, 1);
        ix.prune(&[1, 3]);
        assert_eq!(ix.find(&key(1), Some(&[0, 1])), None, "pruned");
    }

    #[test]
    fn own_slots_are_reclaimed_least_recently_used_first() {
        let mut ix = Index::new(1, 0, 3);
        ix.finish_open();
        for i in 0..3u8 {
            let (slot, old) = ix.allocate().unwrap();
            assert_eq!((slot, old), (u64::from(i), None));
            ix.apply(
                0,
                Record::Commit {
                    slot,
                    key: key(i),
                    crc: 0,
                },
            );
        }
        assert_eq!(ix.used(), 3);
        // Key 0 used again: key 1's slot is the least recently used.
        assert!(ix.find(&key(0), None).is_some());
        let (slot, old) = ix.allocate().unwrap();
        assert_eq!((slot, old), (1, Some(key(1))));
        ix.apply(0, Record::Free { slot, key: key(1) });
        assert_eq!(ix.find(&key(1), None), None);
        ix.release(slot);
        assert_eq!(ix.allocate(), Some((1, None)));
    }
}
