//! Memory budgeting of one rank (docs/design.md, "Prefill"): the per-layer scratch slots
//! attention reads are taken out of the byte budget first, then the rest becomes pool pages.
//!
//! A scratch slot holds `[prefix | current chunk | one trash page]` rows, with the formula
//! SGLang upstream uses: `rows = C * align(context_len, N * 64) + align(chunk, 64) + 64`, where
//! `C` is how many contexts' prefixes one batch may hold ([`DEFAULT_CONTEXTS`] upstream). The
//! prefix region is whole pages of every owner, so a page-granular gather never writes past it.
//! Scratch bytes are `2 * rows * (row_bytes + 132)` (double-buffered by layer parity, the DSA
//! indexer row included), doubled with the MTP draft. Unsharded (N = 1) there is no scratch.

use std::fmt;

use crate::error::{Checked, Error, Result};
use crate::geometry::{CacheGeometry, INDEXER_ROW_BYTES, PAGE_SIZE};
use crate::shard::Placement;

/// Contexts whose prefixes one batch's scratch may hold, as SGLang upstream sizes it.
pub const DEFAULT_CONTEXTS: u64 = 8;

/// What a rank's memory must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetRequest {
    /// Bytes available for scratch plus pool on this rank.
    pub bytes: u64,
    /// Longest context a request may have (tokens).
    pub context_len: u64,
    /// Prefill chunk size (tokens).
    pub chunk_size: u64,
    /// Contexts whose prefixes one batch may hold (`C`; [`DEFAULT_CONTEXTS`]); at least 1.
    pub contexts: u64,
}

impl BudgetRequest {
    /// A request with SGLang's default of [`DEFAULT_CONTEXTS`] contexts per batch.
    pub fn new(bytes: u64, context_len: u64, chunk_size: u64) -> Self {
        Self {
            bytes,
            context_len,
            chunk_size,
            contexts: DEFAULT_CONTEXTS,
        }
    }

    /// Refuses a request that sizes nothing, at any shard size ([`Error::OutOfBounds`]): 0
    /// contexts per batch (a scratch that holds no prefix at all), a 0-token context (no
    /// request), a 0-token chunk (a prefill that never advances).
    pub fn validate(&self) -> Result<()> {
        if self.contexts == 0 {
            return Err(Error::out_of_bounds(
                "a budget's contexts per batch",
                0,
                format!(
                    "at least 1: a batch holds at least one context's prefix (SGLang sizes the \
                     scratch for {DEFAULT_CONTEXTS})"
                ),
            ));
        }
        if self.context_len == 0 {
            return Err(Error::out_of_bounds(
                "a budget's context length",
                "0 tokens",
                "at least 1 token: a request holds at least one",
            ));
        }
        if self.chunk_size == 0 {
            return Err(Error::out_of_bounds(
                "a budget's chunk size",
                "0 tokens",
                "at least 1 token: a prefill chunk prefills at least one",
            ));
        }
        Ok(())
    }
}

/// How a rank's memory is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Rows of one scratch slot (0 unsharded).
    pub scratch_rows: u64,
    /// Tokens of the prefix region of a slot: `C * align(context_len, N * 64)`, whole pages of
    /// every owner.
    pub max_prefix_tokens: u64,
    /// Bytes of all scratch slots.
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

fn align(value: u64, to: u64, what: &str) -> Result<u64> {
    value
        .checked_next_multiple_of(to)
        .ok_or_else(|| Error::overflow(format!("{what} {value} rounded up to {to}")))
}

impl Budget {
    /// Scratch rows and the prefix tokens of one slot for `req` at shard size `shard` (both 0
    /// unsharded). A request that sizes nothing (0 contexts per batch, a 0-token context or
    /// chunk) is refused at any shard size ([`BudgetRequest::validate`]).
    pub fn scratch(req: &BudgetRequest, shard: u32) -> Result<(u64, u64)> {
        req.validate()?;
        if shard <= 1 {
            return Ok((0, 0));
        }
        let page = PAGE_SIZE as u64;
        let stride = u64::from(shard) * page;
        let prefix = align(req.context_len, stride, "context length")?
            .mul_or(req.contexts, || {
                format!("{} contexts of {} tokens", req.contexts, req.context_len)
            })?;
        let rows = prefix
            .add_or(align(req.chunk_size, page, "chunk size")?, || {
                format!("scratch rows of a {}-token chunk", req.chunk_size)
            })?
            .add_or(page, || "scratch rows".into())?;
        Ok((rows, prefix))
    }

    /// Splits `req.bytes` for `geometry` sharded by `placement`: scratch first, then as many
    /// whole pages as fit. A request that sizes nothing is refused as [`Budget::scratch`]
    /// says.
    pub fn plan(
        req: &BudgetRequest,
        geometry: &CacheGeometry,
        placement: Placement,
    ) -> Result<Budget> {
        geometry.validate()?;
        let (scratch_rows, max_prefix_tokens) = Self::scratch(req, placement.shard())?;
        let row = (geometry.target.row_bytes() + INDEXER_ROW_BYTES) as u64;
        let pools = if geometry.draft.is_some() { 2 } else { 1 };
        let scratch_bytes = scratch_rows.mul_or(2 * row * pools, || {
            format!("scratch bytes of {scratch_rows} rows")
        })?;
        let page_bytes = geometry.page_bytes_checked()? as u64;
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
            max_prefix_tokens,
            scratch_bytes,
            page_bytes,
            pages,
            // Fits: at most `rest` bytes.
            pool_bytes: pages * page_bytes,
            logical_capacity: placement.logical_capacity(pages)?,
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
        let req = BudgetRequest::new(80 << 30, 1 << 17, 16_100);
        let cp8 = Placement::new(8).unwrap();
        let without = Budget::plan(&req, &geometry(false), cp8).unwrap();
        let with = Budget::plan(&req, &geometry(true), cp8).unwrap();
        // rows = 8 contexts x 128K (already a multiple of 8 x 64) + 16,100 rounded up to 16,128
        // + 64 trash.
        assert_eq!(without.max_prefix_tokens, 8 << 17);
        assert_eq!(without.scratch_rows, (8 << 17) + 16_128 + 64);
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
    fn the_prefix_region_is_whole_pages_of_every_owner() {
        // A 4,097-token context needs 4,160 rows at N = 1... but N = 1 has no scratch at all.
        let mut req = BudgetRequest::new(1 << 40, 4097, 64);
        req.contexts = 1;
        assert_eq!(Budget::scratch(&req, 1).unwrap(), (0, 0));
        // N = 2: pages come in rounds of 2, so the prefix holds 4,224 tokens (66 pages).
        let (rows, prefix) = Budget::scratch(&req, 2).unwrap();
        assert_eq!(prefix, 4224);
        assert_eq!(rows, 4224 + 64 + 64);
        assert!(prefix >= 4097_u64.div_ceil(64) * 64);
    }

    // Old behaviour: a 0-token context or chunk was planned (unsharded without a word; sharded
    // as a scratch of one trash page, or of contexts with no tokens); now each is refused with
    // the typed error at every shard size, as 0 contexts per batch is.
    #[test]
    fn a_budget_for_no_context_no_tokens_or_no_chunk_is_refused_at_every_shard_size() {
        let good = BudgetRequest::new(80 << 30, 4096, 1024);
        for what in ["contexts per batch", "context length", "chunk size"] {
            let mut req = good.clone();
            match what {
                "contexts per batch" => req.contexts = 0,
                "context length" => req.context_len = 0,
                _ => req.chunk_size = 0,
            }
            for shard in [1, 2, 8] {
                let placement = Placement::new(shard).unwrap();
                for e in [
                    Budget::plan(&req, &geometry(true), placement).unwrap_err(),
                    Budget::scratch(&req, shard).unwrap_err(),
                    req.validate().unwrap_err(),
                ] {
                    assert!(
                        matches!(&e, Error::OutOfBounds { what: w, .. } if w.contains(what)),
                        "N={shard}: {e}"
                    );
                    assert!(e.to_string().contains("at least 1"), "{e}");
                }
            }
        }
        // One context of one token, and a chunk of one, are the least a budget sizes.
        let mut req = good;
        req.contexts = 1;
        let (rows, prefix) = Budget::scratch(&req, 2).unwrap();
        assert_eq!((rows, prefix), (4096 + 1024 + 64, 4096));
        assert!(Budget::plan(&req, &geometry(true), Placement::new(2).unwrap()).is_ok());
        let least = BudgetRequest {
            contexts: 1,
            ..BudgetRequest::new(80 << 30, 1, 1)
        };
        assert_eq!(Budget::scratch(&least, 2).unwrap(), (128 + 64 + 64, 128));
    }

    #[test]
    fn too_small_budgets_name_the_numbers_and_huge_ones_overflow_cleanly() {
        let req = BudgetRequest::new(1 << 20, 4096, 1024);
        let err = Budget::plan(&req, &geometry(true), Placement::new(2).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cannot hold the scratch") && err.contains("x 2 (draft)"),
            "{err}"
        );
        let req = BudgetRequest::new(5 << 20, 64, 64);
        let err = Budget::plan(&req, &geometry(false), Placement::unsharded())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("hold 1 pages of 2764032 bytes") && err.contains("1 owners"),
            "{err}"
        );
        for (context, chunk) in [(1 << 61, 64), (64, u64::MAX)] {
            let req = BudgetRequest::new(u64::MAX, context, chunk);
            let e = Budget::plan(&req, &geometry(true), Placement::new(8).unwrap()).unwrap_err();
            assert!(matches!(e, Error::Overflow { .. }), "{e}");
        }
    }
}
