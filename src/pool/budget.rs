//! Memory budgeting of one rank (DOMAIN.md section 4): the per-layer scratch slots attention
//! reads are taken out of the byte budget first, then the rest becomes pool pages.

use std::fmt;

use crate::error::{Error, Result};
use crate::geometry::{CacheGeometry, INDEXER_ROW_BYTES, PAGE_SIZE};
use crate::shard::Placement;

/// What a rank's memory must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetRequest {
    /// Bytes available for scratch plus pool on this rank.
    pub bytes: u64,
    /// Longest context a request may have (tokens).
    pub context_len: u64,
    /// Most prefix tokens one chunk's attention reads (bounded by the context).
    pub prefix_budget: u64,
    /// Prefill chunk size (tokens).
    pub chunk_size: u64,
}

/// How a rank's memory is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Rows of one scratch slot: `prefix + align(chunk, 64) + one trash page`.
    pub scratch_rows: u64,
    /// Bytes of all scratch slots (double-buffered by layer parity, doubled with the draft).
    pub scratch_bytes: u64,
    /// Bytes of one page across every layer and component of target and draft.
    pub page_bytes: u64,
    /// Physical pages per layer the rest of the budget holds (page 0 is padding).
    pub pages: u64,
    /// Bytes the pool takes.
    pub pool_bytes: u64,
    /// Logical token capacity of the shard group (N x physical slots).
    pub logical_capacity: u64,
}

impl Budget {
    /// Splits `req.bytes` for `geometry` sharded by `placement`: scratch
    /// `2 * rows * (row_bytes + 132)` per pool (doubled when the draft is present) first, then
    /// as many whole pages as fit.
    pub fn plan(
        req: &BudgetRequest,
        geometry: &CacheGeometry,
        placement: Placement,
    ) -> Result<Budget> {
        geometry.validate()?;
        let page = PAGE_SIZE as u64;
        let prefix = req.prefix_budget.min(req.context_len);
        let scratch_rows = prefix + req.chunk_size.next_multiple_of(page) + page;
        let per_pool = 2 * scratch_rows * (geometry.target.row_bytes() + INDEXER_ROW_BYTES) as u64;
        let scratch_bytes = per_pool * if geometry.draft.is_some() { 2 } else { 1 };
        let page_bytes = geometry.page_bytes() as u64;
        let Some(rest) = req.bytes.checked_sub(scratch_bytes) else {
            return Err(Error::BudgetTooSmall(format!(
                "{} bytes cannot hold the scratch slots: {scratch_rows} rows x 2 x ({} + {INDEXER_ROW_BYTES}) bytes{} = {scratch_bytes} bytes",
                req.bytes,
                geometry.target.row_bytes(),
                if geometry.draft.is_some() { " x 2 (draft)" } else { "" },
            )));
        };
        let pages = rest / page_bytes;
        if pages < 2 {
            return Err(Error::BudgetTooSmall(format!(
                "{rest} bytes left after {scratch_bytes} bytes of scratch hold {pages} pages of {page_bytes} bytes; \
                 each of the {} owners needs its padding page and at least one real page",
                placement.shard()
            )));
        }
        Ok(Budget {
            scratch_rows,
            scratch_bytes,
            page_bytes,
            pages,
            pool_bytes: pages * page_bytes,
            logical_capacity: placement.logical_capacity(pages * page),
        })
    }
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "scratch {:.2} GB ({} rows/slot), pool {:.2} GB = {} pages x {} B, logical capacity {} tokens",
            self.scratch_bytes as f64 / 1e9,
            self.scratch_rows,
            self.pool_bytes as f64 / 1e9,
            self.pages,
            self.page_bytes,
            self.logical_capacity
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{LatentLayout, PoolGeometry};

    fn geometry(draft: bool) -> CacheGeometry {
        let target = PoolGeometry::new(LatentLayout::Fp8Trtllm, 61);
        if draft {
            CacheGeometry::with_draft(target)
        } else {
            CacheGeometry::target_only(target)
        }
    }

    #[test]
    fn scratch_comes_first_and_doubles_with_the_draft() {
        let req = BudgetRequest {
            bytes: 80 << 30,
            context_len: 1 << 20,
            prefix_budget: 1 << 20,
            chunk_size: 16_100,
        };
        let cp8 = Placement::new(8).unwrap();
        let without = Budget::plan(&req, &geometry(false), cp8).unwrap();
        let with = Budget::plan(&req, &geometry(true), cp8).unwrap();
        // rows = 1M prefix + 16,100 rounded up to 16,128 + 64 trash.
        assert_eq!(without.scratch_rows, (1 << 20) + 16_128 + 64);
        assert_eq!(without.scratch_bytes, 2 * without.scratch_rows * 708);
        assert_eq!(with.scratch_bytes, 2 * without.scratch_bytes);
        assert_eq!(with.page_bytes, 62 * (36_864 + 8448));
        assert_eq!(
            with.pages,
            (req.bytes - with.scratch_bytes) / with.page_bytes
        );
        assert_eq!(with.logical_capacity, 8 * with.pages * 64);
    }

    #[test]
    fn too_small_budgets_name_the_numbers() {
        let req = BudgetRequest {
            bytes: 1 << 20,
            context_len: 4096,
            prefix_budget: 4096,
            chunk_size: 1024,
        };
        let err = Budget::plan(&req, &geometry(true), Placement::unsharded())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cannot hold the scratch") && err.contains("x 2 (draft)"),
            "{err}"
        );
        let req = BudgetRequest {
            bytes: 5 << 20,
            context_len: 64,
            prefix_budget: 64,
            chunk_size: 64,
        };
        let err = Budget::plan(&req, &geometry(false), Placement::new(2).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("hold 1 pages of 2764032 bytes") && err.contains("2 owners"),
            "{err}"
        );
    }
}
