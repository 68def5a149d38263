//! Decode context parallelism as data (docs/dcp.md, "Layouts"): how a decode server sharded over
//! `M` ranks places the tokens of a request, `I` tokens at a time, and where each token lands
//! among a rank's own pages. Pure CPU math, the twin of the placement `kvs_decode_scatter`
//! computes on the device (cuda/decode_scatter.cu).
//!
//! Token `t` of a request (its position in the sequence, from 0) lives on decode rank
//! `(t / I) % M`, as that rank's local token `(t / (I M)) I + t % I`: the rank's tokens of the
//! request, counted in sequence order. A rank keeps its local tokens in pages of 64 like any
//! pool, local token `k` in the rank's `k / 64`-th page of the request at row `k % 64`; which
//! pages those are is the rank's own business (what it registers).
//!
//! - `I = 1`, `M > 1`: vLLM's decode context parallelism by default and SGLang's DSA DCP
//!   (token `t` on rank `t % M`);
//! - `I` a block or a page: vLLM's `cp_kv_cache_interleave_size` set to the block size (what its
//!   P/D asks for), TensorRT-LLM Helix's round-robin blocks;
//! - `M = 1`: the unsharded decode (every token on rank 0, local token `t`).
//!
//! vLLM computes the same placement per "virtual block" of `block_size x M` tokens; where the
//! interleave divides the block size (vLLM requires it) that equals the formula above.

use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;

/// Most ranks a decode layout may have: far above any decode context-parallel group, and a bound
/// on the per-rank tables a scatter launch carries (`cuda/abi.h`'s `KVS_DECODE_MAX_RANKS`).
pub const MAX_DECODE_RANKS: u32 = crate::abi::KVS_DECODE_MAX_RANKS;

const PAGE: u64 = PAGE_SIZE as u64;

/// Where one token of a request lives under a [`DecodeLayout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeRow {
    /// The decode rank holding it.
    pub rank: u32,
    /// Its index among that rank's tokens of the request, in sequence order.
    pub local: u64,
}

impl DecodeRow {
    /// Which of the rank's pages of the request holds it (an index into the pages the rank
    /// registered for the request, from its first).
    pub fn page_index(&self) -> u64 {
        self.local / PAGE
    }

    /// Its row inside that page.
    pub fn row(&self) -> u64 {
        self.local % PAGE
    }
}

/// How a decode server shards a request's KV cache: over `ranks` ranks (M), `interleave` tokens
/// (I) at a time (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeLayout {
    ranks: u32,
    interleave: u32,
}

impl DecodeLayout {
    /// `ranks` decode ranks (1 to [`MAX_DECODE_RANKS`]) taking `interleave` consecutive tokens
    /// each in turn (at least 1).
    pub fn new(ranks: u32, interleave: u32) -> Result<Self> {
        if ranks == 0 || ranks > MAX_DECODE_RANKS || interleave == 0 {
            return Err(Error::InvalidDecodeLayout { ranks, interleave });
        }
        Ok(Self { ranks, interleave })
    }

    /// The unsharded decode: one rank holding every token.
    pub fn unsharded() -> Self {
        Self {
            ranks: 1,
            interleave: 1,
        }
    }

    /// Decode ranks (M).
    pub fn ranks(&self) -> u32 {
        self.ranks
    }

    /// Consecutive tokens one rank takes before the next rank's turn (I).
    pub fn interleave(&self) -> u32 {
        self.interleave
    }

    /// Whether every page of the sequence lands whole on one rank, as one whole page of that
    /// rank at the same rows (one rank, or an interleave of whole pages): a scatter then moves
    /// pages, not rows.
    pub fn is_page_granular(&self) -> bool {
        self.ranks == 1 || u64::from(self.interleave) % PAGE == 0
    }

    /// Checks `rank` is a rank of the layout.
    pub fn check_rank(&self, rank: u32) -> Result<()> {
        if rank >= self.ranks {
            return Err(Error::OutOfRange {
                what: "decode rank",
                index: i64::from(rank),
                limit: u64::from(self.ranks),
            });
        }
        Ok(())
    }

    /// Where token `token` of a request lives.
    pub fn place(&self, token: u64) -> DecodeRow {
        let (i, m) = (u64::from(self.interleave), u64::from(self.ranks));
        let group = token / i;
        DecodeRow {
            rank: (group % m) as u32,
            // At most `token`: no overflow.
            local: (group / m) * i + token % i,
        }
    }

    /// The token living on `rank` as its local token `local` (the inverse of
    /// [`DecodeLayout::place`]), or `None` for a rank outside the layout or a token past
    /// `u64::MAX`.
    pub fn token(&self, rank: u32, local: u64) -> Option<u64> {
        if rank >= self.ranks {
            return None;
        }
        let i = u64::from(self.interleave);
        (local / i)
            .checked_mul(u64::from(self.ranks))?
            .checked_add(u64::from(rank))?
            .checked_mul(i)?
            .checked_add(local % i)
    }

    /// How many of tokens `0..tokens` live on `rank` (0 for a rank outside the layout): the
    /// rank's local tokens of a request of `tokens` tokens.
    pub fn tokens_on(&self, rank: u32, tokens: u64) -> u64 {
        if rank >= self.ranks {
            return 0;
        }
        let i = u64::from(self.interleave);
        // A round gives every rank `i` tokens; the last, partial round gives them in rank order.
        let round = i * u64::from(self.ranks);
        let before = u64::from(rank) * i;
        (tokens / round) * i + (tokens % round).saturating_sub(before).min(i)
    }

    /// Pages `rank` holds of a request of `tokens` tokens: what it registers for it.
    pub fn pages_on(&self, rank: u32, tokens: u64) -> u64 {
        self.tokens_on(rank, tokens).div_ceil(PAGE)
    }

    /// `rank`'s local tokens of sequence page `position` below token `end`: `[first, first +
    /// rows)`. A page's tokens on one rank are consecutive local tokens of it (a rank counts
    /// its tokens in sequence order).
    pub fn page_rows(&self, rank: u32, position: u64, end: u64) -> (u64, u64) {
        let start = position.saturating_mul(PAGE).min(end);
        let stop = position.saturating_add(1).saturating_mul(PAGE).min(end);
        let first = self.tokens_on(rank, start);
        (first, self.tokens_on(rank, stop) - first)
    }

    /// `rank`'s rows of tokens below `end` in sequence pages `positions`, packed densely in that
    /// order (docs/dcp.md, "Over NIXL and Mooncake": what the bounce route moves to one decode
    /// rank as one range).
    pub fn dense_rows(&self, rank: u32, end: u64, positions: &[u64]) -> DenseRows {
        let mut rows = 0u64;
        let shifts = positions
            .iter()
            .map(|&position| {
                let (first, n) = self.page_rows(rank, position, end);
                // Modulo 2^64: the dense row of local token k is k - shift whatever the order.
                let shift = first.wrapping_sub(rows);
                rows += n;
                shift
            })
            .collect();
        DenseRows { shifts, rows }
    }
}

/// One rank's rows of some sequence pages packed densely, page after page
/// ([`DecodeLayout::dense_rows`]): the layout of what the bounce route carries to a decode rank,
/// which both sides compute from the same pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenseRows {
    /// Per page, in the order given: the shift `kvs_decode_scatter` subtracts (modulo 2^64) from
    /// a row's local token to find its dense row (the page's first local token on the rank
    /// minus the dense rows before it).
    pub shifts: Vec<u64>,
    /// Rows of all the pages.
    pub rows: u64,
}

impl DenseRows {
    /// Pages of 64 rows the dense rows fill.
    pub fn pages(&self) -> u64 {
        self.rows.div_ceil(PAGE)
    }
}

impl std::fmt::Display for DecodeLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} decode ranks x {} tokens interleaved",
            self.ranks, self.interleave
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_engines_layouts() {
        // vLLM's default DCP and SGLang's DSA DCP: token t on rank t % M, local token t / M.
        let dcp = DecodeLayout::new(4, 1).unwrap();
        assert_eq!(dcp.place(13), DecodeRow { rank: 1, local: 3 });
        // An interleave of a page (Helix's round-robin blocks, vLLM's interleave at the block
        // size): whole pages in turn, at the same rows.
        let pages = DecodeLayout::new(2, 64).unwrap();
        assert!(pages.is_page_granular() && !dcp.is_page_granular());
        assert_eq!(pages.place(3 * 64 + 5), DecodeRow { rank: 1, local: 69 });
        assert_eq!(pages.place(3 * 64 + 5).page_index(), 1);
        assert_eq!(pages.place(3 * 64 + 5).row(), 5);
        // Unsharded: everything on rank 0 as it is, whatever the interleave.
        let one = DecodeLayout::new(1, 7).unwrap();
        assert!(one.is_page_granular());
        assert_eq!(
            one.place(1000),
            DecodeRow {
                rank: 0,
                local: 1000
            }
        );
        assert_eq!(DecodeLayout::unsharded().pages_on(0, 65), 2);
        // 65 tokens over 2 ranks one by one: rank 0 holds 33 (one page), rank 1 32.
        let two = DecodeLayout::new(2, 1).unwrap();
        assert_eq!((two.tokens_on(0, 65), two.tokens_on(1, 65)), (33, 32));
        assert_eq!((two.pages_on(0, 129), two.pages_on(1, 129)), (2, 1));
        assert_eq!(two.tokens_on(2, 65), 0);
        assert!(two.check_rank(2).is_err() && two.check_rank(1).is_ok());
        assert_eq!(two.token(2, 0), None);
        assert_eq!(
            DecodeLayout::new(3, u32::MAX).unwrap().token(2, u64::MAX),
            None
        );
        for (m, i) in [(0, 1), (1, 0), (MAX_DECODE_RANKS + 1, 1)] {
            assert!(matches!(
                DecodeLayout::new(m, i),
                Err(Error::InvalidDecodeLayout { .. })
            ));
        }
        assert_eq!(
            DecodeLayout::new(4, 64).unwrap().to_string(),
            "4 decode ranks x 64 tokens interleaved"
        );
    }

    fn layouts() -> impl Strategy<Value = DecodeLayout> {
        (
            1..=9u32,
            prop_oneof![
                1..=130u32,
                prop::sample::select(vec![64u32, 128, 192, 4096])
            ],
        )
            .prop_map(|(m, i)| DecodeLayout::new(m, i).unwrap())
    }

    proptest! {
        #[test]
        fn every_token_has_exactly_one_rank_and_row_and_local_rows_are_dense(
            layout in layouts(),
            tokens in 0..3000u64,
        ) {
            let m = layout.ranks() as usize;
            // Local tokens of each rank, in sequence order.
            let mut seen: Vec<Vec<u64>> = vec![Vec::new(); m];
            for t in 0..tokens {
                let at = layout.place(t);
                prop_assert!(at.rank < layout.ranks());
                prop_assert_eq!(layout.token(at.rank, at.local), Some(t));
                seen[at.rank as usize].push(at.local);
            }
            for (rank, locals) in seen.iter().enumerate() {
                // Dense: a rank's tokens are its local tokens 0, 1, 2, ... in sequence order,
                // so they fill its pages from the first, row by row.
                let dense: Vec<u64> = (0..locals.len() as u64).collect();
                prop_assert_eq!(locals, &dense);
                prop_assert_eq!(layout.tokens_on(rank as u32, tokens), locals.len() as u64);
                prop_assert_eq!(
                    layout.pages_on(rank as u32, tokens),
                    (locals.len() as u64).div_ceil(PAGE)
                );
            }
            prop_assert_eq!(
                (0..layout.ranks()).map(|r| layout.tokens_on(r, tokens)).sum::<u64>(),
                tokens
            );
        }

        #[test]
        fn a_page_granular_layout_moves_whole_pages(layout in layouts(), page in 0..200u64) {
            let whole = |page: u64| {
                let first = layout.place(page * PAGE);
                first.row() == 0
                    && (0..PAGE).all(|o| {
                        layout.place(page * PAGE + o)
                            == DecodeRow { rank: first.rank, local: first.local + o }
                    })
            };
            if layout.is_page_granular() {
                prop_assert!(whole(page));
            } else {
                // Tokens I - 1 and I share a page and not a rank.
                prop_assert!(!whole(u64::from(layout.interleave()) / PAGE));
            }
        }

        #[test]
        fn dense_rows_hold_each_pages_rows_of_the_rank_once_in_order(
            layout in layouts(),
            end in 1..2000u64,
            mut positions in prop::collection::vec(0..40u64, 0..12),
            shuffled in any::<bool>(),
        ) {
            positions.sort_unstable();
            positions.dedup();
            if shuffled {
                positions.reverse();
            }
            for rank in 0..layout.ranks() {
                let dense = layout.dense_rows(rank, end, &positions);
                prop_assert_eq!(dense.shifts.len(), positions.len());
                // Every token of the pages below the end on the rank, dense row by dense row.
                let mut next = 0u64;
                for (&position, &shift) in positions.iter().zip(&dense.shifts) {
                    for t in position * PAGE..((position + 1) * PAGE).min(end) {
                        let at = layout.place(t);
                        if at.rank == rank {
                            prop_assert_eq!(at.local.wrapping_sub(shift), next);
                            next += 1;
                        }
                    }
                }
                prop_assert_eq!(dense.rows, next);
                prop_assert_eq!(dense.pages(), next.div_ceil(PAGE));
            }
        }

        #[test]
        fn placement_survives_extreme_tokens(
            layout in layouts(),
            token in prop::sample::select(vec![u64::MAX, u64::MAX - 1, 1u64 << 63, (1 << 40) + 3]),
        ) {
            let at = layout.place(token);
            prop_assert!(at.local <= token);
            prop_assert_eq!(layout.token(at.rank, at.local), Some(token));
            prop_assert!(layout.tokens_on(at.rank, token) <= token);
        }
    }
}
