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
//!
//! The index also knows which key each writer's slot holds: a `Commit` into a slot that still
//! holds another entry frees that entry at the commit's position. kvshard always writes a `Free`
//! first, so this only matters when that `Free` was lost to damage: a damaged `Free` never
//! brings an evicted key back as present. Memory follows the slots in use, not the file's
//! size: this rank's free slots are kept as ranges.

use std::collections::{BTreeMap, HashMap};

use lru::LruCache;

use super::journal::{Item, Record};
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

/// Free slots as ranges `start -> end` (end exclusive), disjoint and not touching.
#[derive(Debug, Default)]
struct FreeSlots(BTreeMap<u64, u64>);

impl FreeSlots {
    /// Every slot of `0..slots` but `held` (sorted).
    fn all_but(slots: u64, held: impl IntoIterator<Item = u64>) -> Self {
        let mut free = BTreeMap::new();
        let mut at = 0;
        for h in held {
            if h > at {
                free.insert(at, h);
            }
            at = h + 1;
        }
        if slots > at {
            free.insert(at, slots);
        }
        Self(free)
    }

    /// Takes the lowest free slot.
    fn pop_first(&mut self) -> Option<u64> {
        let (start, end) = self.0.pop_first()?;
        if start + 1 < end {
            self.0.insert(start + 1, end);
        }
        Some(start)
    }

    /// The range holding `slot`, if free.
    fn range_of(&self, slot: u64) -> Option<(u64, u64)> {
        self.0
            .range(..=slot)
            .next_back()
            .filter(|(_, &end)| slot < end)
            .map(|(&s, &e)| (s, e))
    }

    /// Marks `slot` free (merging it with its neighbours).
    fn insert(&mut self, slot: u64) {
        if self.range_of(slot).is_some() {
            return;
        }
        let mut start = slot;
        let mut end = slot + 1;
        if let Some((&s, &e)) = self.0.range(..slot).next_back() {
            if e == slot {
                start = s;
                self.0.remove(&s);
            }
        }
        if let Some(e) = self.0.remove(&end) {
            end = e;
        }
        self.0.insert(start, end);
    }

    /// Marks `slot` used.
    fn remove(&mut self, slot: u64) {
        if let Some((s, e)) = self.range_of(slot) {
            self.0.remove(&s);
            if s < slot {
                self.0.insert(s, slot);
            }
            if slot + 1 < e {
                self.0.insert(slot + 1, e);
            }
        }
    }
}

/// The index of one rank.
#[derive(Debug)]
pub(super) struct Index {
    keys: HashMap<PageKey, Vec<Entry>>,
    /// Per writer: record positions applied.
    replayed: Vec<u64>,
    own: u32,
    /// Slots of each writer's file: how many this rank's file has.
    slots: u64,
    /// Per (writer, slot) in use: the key it holds.
    held: HashMap<(u32, u64), PageKey>,
    /// This rank's free slots, lowest first (so new pages of a batch tend to be adjacent).
    free: FreeSlots,
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
            slots,
            held: HashMap::new(),
            free: FreeSlots::default(),
            lru: LruCache::unbounded(),
        }
    }

    /// Records applied per writer (this rank's view, at least as new as any snapshot it took).
    pub fn replayed(&self) -> &[u64] {
        &self.replayed
    }

    /// Applies writer `writer`'s next record place (a damaged one only counts its position).
    pub fn apply(&mut self, writer: u32, item: Item) {
        let w = writer as usize;
        let at = self.replayed[w];
        self.replayed[w] = at.saturating_add(item.span());
        let own = writer == self.own;
        let record = match item {
            Item::Record(r) => r,
            Item::Damaged => return,
        };
        match record {
            // Positions of records a compaction dropped: nothing to do but count them.
            Record::Skip { .. } => {}
            Record::Commit { slot, key, crc } => {
                if slot >= self.slots {
                    return;
                }
                if let Some(old) = self.held.insert((writer, slot), key) {
                    // Never written by kvshard (a Free precedes every reuse); where a journal
                    // says so anyway (its Free damaged), the slot holds the newer key only.
                    self.free_entry(writer, slot, old, at);
                }
                if own {
                    self.free.remove(slot);
                    self.lru.put(slot, ());
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
                if self.held.get(&(writer, slot)) == Some(&key) {
                    self.held.remove(&(writer, slot));
                    if own {
                        self.lru.pop(&slot);
                    }
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
        let own = self.own;
        let mut held: Vec<u64> = self
            .held
            .keys()
            .filter(|(w, _)| *w == own)
            .map(|&(_, s)| s)
            .collect();
        held.sort_unstable();
        self.free = FreeSlots::all_but(self.slots, held);
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
        let old = self.held.get(&(self.own, slot)).copied();
        Some((slot, old))
    }

    /// Gives back a slot [`Index::allocate`] handed out whose batch failed: free again when it
    /// holds nothing (its old key's `Free` was applied, or it had none), else back in the LRU
    /// order with the page it still holds (its `Free`, or the new page's `Commit`, made it to
    /// the journal or not: the index says which), so no slot is lost.
    pub fn release(&mut self, slot: u64) {
        if slot >= self.slots {
            return;
        }
        if self.held.contains_key(&(self.own, slot)) {
            if !self.lru.contains(&slot) {
                self.lru.put(slot, ());
            }
        } else {
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
        self.held.retain(|&(w, _), _| w != writer);
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

    fn commit(slot: u64, k: u8, crc: u32) -> Item {
        Item::Record(Record::Commit {
            slot,
            key: key(k),
            crc,
        })
    }

    fn free(slot: u64, k: u8) -> Item {
        Item::Record(Record::Free { slot, key: key(k) })
    }

    #[test]
    fn presence_is_a_function_of_the_snapshot() {
        let mut ix = Index::new(2, 0, 8);
        ix.finish_open();
        // Writer 1: commit A (record 0), free A (1), commit B in the same slot (2).
        ix.apply(1, commit(5, 1, 1));
        ix.apply(1, free(5, 1));
        ix.apply(1, commit(5, 2, 2));
        assert_eq!(ix.find(&key(1), Some(&[0, 0])), None);
        assert_eq!(ix.find(&key(1), Some(&[0, 1])).unwrap().crc, 1);
        assert_eq!(ix.find(&key(1), Some(&[0, 2])), None);
        assert_eq!(ix.find(&key(2), Some(&[0, 2])), None);
        assert_eq!(ix.find(&key(2), Some(&[0, 3])).unwrap().slot, 5);
        assert_eq!(ix.find(&key(1), None), None);
        // The same key written by writer 0 too: the lowest writer's entry is read.
        ix.apply(0, commit(1, 2, 3));
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
            ix.apply(0, commit(slot, i, 0));
        }
        assert_eq!(ix.used(), 3);
        // Key 0 used again: key 1's slot is the least recently used.
        assert!(ix.find(&key(0), None).is_some());
        let (slot, old) = ix.allocate().unwrap();
        assert_eq!((slot, old), (1, Some(key(1))));
        ix.apply(0, free(slot, 1));
        assert_eq!(ix.find(&key(1), None), None);
        ix.release(slot);
        assert_eq!(ix.allocate(), Some((1, None)));
    }

    // Old behaviour: a damaged Free record of an evicted page was skipped and the page, whose
    // slot then held another key's bytes, was present again.
    #[test]
    fn a_lost_free_never_brings_an_evicted_key_back() {
        for own in [0, 1] {
            let mut ix = Index::new(2, own, 4);
            ix.finish_open();
            // Writer 1: commit A into slot 2; its Free is damaged; commit B into slot 2.
            ix.apply(1, commit(2, 1, 1));
            ix.apply(1, Item::Damaged);
            ix.apply(1, commit(2, 2, 2));
            assert_eq!(ix.replayed(), &[0, 3]);
            assert_eq!(ix.find(&key(1), None), None, "rank {own}");
            assert_eq!(ix.find(&key(1), Some(&[0, 2])).unwrap().slot, 2);
            assert_eq!(ix.find(&key(1), Some(&[0, 3])), None);
            assert_eq!(ix.find(&key(2), None).unwrap().slot, 2);
            // Records naming a slot past the file are never entries.
            ix.apply(1, commit(4, 3, 3));
            assert_eq!(ix.find(&key(3), None), None);
        }
    }

    #[test]
    fn free_slots_are_ranges_whatever_the_file_size() {
        let mut ix = Index::new(1, 0, u64::MAX / 2);
        ix.apply(0, commit(7, 1, 0));
        ix.apply(0, commit(9, 2, 0));
        ix.finish_open();
        let taken: Vec<u64> = (0..9).map(|_| ix.allocate().unwrap().0).collect();
        assert_eq!(taken, vec![0, 1, 2, 3, 4, 5, 6, 8, 10]);
        ix.release(4);
        ix.release(3);
        ix.release(5);
        ix.release(7);
        assert_eq!(ix.allocate(), Some((3, None)));
        assert_eq!(ix.allocate(), Some((4, None)));
        assert_eq!(ix.allocate(), Some((5, None)));
        assert_eq!(ix.allocate(), Some((11, None)));
    }
}
