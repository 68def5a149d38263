//! Page-interleaved ownership math (DOMAIN.md section 3): which rank of an N-way shard group
//! owns a logical page or slot, and where it lives in that rank's physical pool. The device
//! twins are `page_owner`, `local_page` and `local_row` in `cuda/common.cuh`.

use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;

/// Sharding of the logical index space over `shard` ranks, page by page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Placement {
    shard: u32,
}

impl Placement {
    /// Placement over `shard` ranks (1 = unsharded).
    pub fn new(shard: u32) -> Result<Self> {
        if shard == 0 {
            return Err(Error::InvalidArgument(
                "shard size must be at least 1".into(),
            ));
        }
        Ok(Self { shard })
    }

    /// An unsharded placement (decode servers, single-rank prefill).
    pub fn unsharded() -> Self {
        Self { shard: 1 }
    }

    /// Shard size N.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        PAGE_SIZE
    }

    /// Owner of logical page `page`: `page % N`.
    pub fn owner(&self, page: u64) -> u32 {
        (page % u64::from(self.shard)) as u32
    }

    /// Owner of logical token slot `slot`.
    pub fn slot_owner(&self, slot: u64) -> u32 {
        self.owner(slot / PAGE_SIZE as u64)
    }

    /// Local page of logical page `page` on its owner: `page / N`.
    pub fn local_page(&self, page: u64) -> u64 {
        page / u64::from(self.shard)
    }

    /// Local row of logical slot `slot` on its owner: `(slot / (N*64)) * 64 + slot % 64`.
    pub fn local_row(&self, slot: u64) -> u64 {
        let page = PAGE_SIZE as u64;
        (slot / (u64::from(self.shard) * page)) * page + slot % page
    }

    /// Logical page of local page `local` on `rank` (the inverse of [`Self::local_page`]).
    pub fn logical_page(&self, rank: u32, local: u64) -> u64 {
        local * u64::from(self.shard) + u64::from(rank)
    }

    /// Whether logical page `page` is one of the reserved padding pages `0..N` (local page 0).
    pub fn is_reserved(&self, page: u64) -> bool {
        page < u64::from(self.shard)
    }

    /// Logical pages of a group whose ranks each hold `physical_pages` pages.
    pub fn logical_pages(&self, physical_pages: u64) -> u64 {
        physical_pages * u64::from(self.shard)
    }

    /// Logical token slots of a group whose ranks each hold `physical_slots` slots
    /// (e.g. CP2 turns 8,192 physical slots into 16,384 logical ones).
    pub fn logical_capacity(&self, physical_slots: u64) -> u64 {
        physical_slots * u64::from(self.shard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_local_page_and_row() {
        let p = Placement::new(4).unwrap();
        assert_eq!(p.owner(13), 1);
        assert_eq!(p.local_page(13), 3);
        assert_eq!(p.logical_page(1, 3), 13);
        // Slot 13*64 + 5 is row 5 of local page 3.
        assert_eq!(p.slot_owner(13 * 64 + 5), 1);
        assert_eq!(p.local_row(13 * 64 + 5), 3 * 64 + 5);
        assert!(p.is_reserved(3) && !p.is_reserved(4));
        assert_eq!(Placement::new(2).unwrap().logical_capacity(8192), 16_384);
        assert!(Placement::new(0).is_err());
    }

    #[test]
    fn local_rows_of_a_rank_are_dense() {
        // Every local row of every rank is hit exactly once by the logical slots.
        let p = Placement::new(3).unwrap();
        let pages = 5u64;
        let mut seen = vec![vec![false; (pages * 64) as usize]; 3];
        for slot in 0..p.logical_capacity(pages * 64) {
            let row = p.local_row(slot) as usize;
            let cell = &mut seen[p.slot_owner(slot) as usize][row];
            assert!(!*cell);
            *cell = true;
        }
        assert!(seen.iter().flatten().all(|&b| b));
    }
}
