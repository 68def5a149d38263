//! Page-interleaved ownership math (docs/design.md, "Ownership"): which rank of an N-way shard group
//! owns a logical page or slot, and where it lives in that rank's physical pool. The device
//! twins are `page_owner`, `local_page` and `local_row` in `cuda/common.cuh`.

use crate::error::{Checked, Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::index::{LocalPage, LogicalPage, Slot};

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

    /// Checks `rank` is a rank of the group.
    pub fn check_rank(&self, rank: u32) -> Result<()> {
        if rank >= self.shard {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of a shard group of {}",
                self.shard
            )));
        }
        Ok(())
    }

    /// Owner of logical page `page`: `page % N`.
    pub fn owner(&self, page: LogicalPage) -> u32 {
        (page.0 % u64::from(self.shard)) as u32
    }

    /// Owner of logical token slot `slot`.
    pub fn slot_owner(&self, slot: Slot) -> u32 {
        self.owner(slot.page())
    }

    /// Local page of logical page `page` on its owner: `page / N`.
    pub fn local(&self, page: LogicalPage) -> LocalPage {
        LocalPage(page.0 / u64::from(self.shard))
    }

    /// Local row of logical slot `slot` on its owner: `(slot / (N*64)) * 64 + slot % 64`.
    pub fn local_row(&self, slot: Slot) -> u64 {
        let page = PAGE_SIZE as u64;
        (slot.0 / (u64::from(self.shard) * page)) * page + slot.0 % page
    }

    /// Logical page of local page `local` on `rank` (the inverse of [`Self::local`]), or `None`
    /// when it does not fit the index space.
    pub fn logical(&self, rank: u32, local: LocalPage) -> Option<LogicalPage> {
        local
            .0
            .checked_mul(u64::from(self.shard))?
            .checked_add(u64::from(rank))
            .map(LogicalPage)
    }

    /// Whether logical page `page` is one of the reserved padding pages `0..N` (local page 0).
    pub fn is_reserved(&self, page: LogicalPage) -> bool {
        page.0 < u64::from(self.shard)
    }

    /// Logical pages of a group whose ranks each hold `physical_pages` pages.
    pub fn logical_pages(&self, physical_pages: u64) -> Result<u64> {
        physical_pages.mul_or(u64::from(self.shard), || {
            format!(
                "logical pages of {physical_pages} pages per rank x {} ranks",
                self.shard
            )
        })
    }

    /// Logical token slots of a group whose ranks each hold `physical_pages` pages
    /// (e.g. CP2 turns 128 pages = 8,192 physical slots per rank into 16,384 logical ones).
    pub fn logical_capacity(&self, physical_pages: u64) -> Result<u64> {
        self.logical_pages(physical_pages)?
            .mul_or(PAGE_SIZE as u64, || {
                format!(
                    "logical slots of {physical_pages} pages per rank x {} ranks",
                    self.shard
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_local_page_and_row() {
        let p = Placement::new(4).unwrap();
        assert_eq!(p.owner(LogicalPage(13)), 1);
        assert_eq!(p.local(LogicalPage(13)), LocalPage(3));
        assert_eq!(p.logical(1, LocalPage(3)), Some(LogicalPage(13)));
        assert_eq!(p.logical(1, LocalPage(u64::MAX)), None);
        // Slot 13*64 + 5 is row 5 of local page 3.
        assert_eq!(p.slot_owner(Slot(13 * 64 + 5)), 1);
        assert_eq!(p.local_row(Slot(13 * 64 + 5)), 3 * 64 + 5);
        assert!(p.is_reserved(LogicalPage(3)) && !p.is_reserved(LogicalPage(4)));
        assert_eq!(
            Placement::new(2).unwrap().logical_capacity(128).unwrap(),
            16_384
        );
        assert!(Placement::new(2)
            .unwrap()
            .logical_capacity(u64::MAX / 64)
            .is_err());
        assert!(Placement::new(0).is_err());
    }

    #[test]
    fn local_rows_of_a_rank_are_dense() {
        // Every local row of every rank is hit exactly once by the logical slots.
        let p = Placement::new(3).unwrap();
        let pages = 5u64;
        let mut seen = vec![vec![false; (pages * 64) as usize]; 3];
        for slot in 0..p.logical_capacity(pages).unwrap() {
            let row = p.local_row(Slot(slot)) as usize;
            let cell = &mut seen[p.slot_owner(Slot(slot)) as usize][row];
            assert!(!*cell);
            *cell = true;
        }
        assert!(seen.iter().flatten().all(|&b| b));
    }
}
