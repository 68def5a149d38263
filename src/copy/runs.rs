//! The owner-run primitive every sharded transfer starts from: pair source and destination
//! pages by position, keep the pairs this rank owns, map them to local pages, and coalesce runs
//! where both sides advance by one. P/D send plans and HiCache transfer plans are both built on
//! it; validation of the pages (range, reserved, duplicates, owners) is theirs, done before.

use std::fmt;

use crate::index::{LocalPage, LogicalPage};
use crate::shard::Placement;

/// `pages` consecutive pages moving from local page `src` to local page `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Run {
    /// First source page.
    pub src: LocalPage,
    /// First destination page.
    pub dst: LocalPage,
    /// Pages in the run (at least one).
    pub pages: u64,
}

/// One rank's share of a list of (source, destination) page pairs, in position order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnedRuns {
    positions: Vec<usize>,
    src: Vec<LocalPage>,
    dst: Vec<LocalPage>,
    runs: Vec<Run>,
}

impl OwnedRuns {
    /// Pairs `src[i]` with `dst[i]` by position `i`, keeps the pairs whose source `rank` owns
    /// under `placement`, maps the source to its local page and the destination with
    /// `dst_local`, and coalesces. Pairs beyond the shorter list are ignored: callers check the
    /// lengths first.
    pub fn new<D: Copy>(
        placement: Placement,
        rank: u32,
        src: &[LogicalPage],
        dst: &[D],
        dst_local: impl Fn(D) -> LocalPage,
    ) -> Self {
        let mut out = Self::default();
        for (i, (&s, &d)) in src.iter().zip(dst).enumerate() {
            if placement.owner(s) == rank {
                out.push(i, placement.local(s), dst_local(d));
            }
        }
        out
    }

    /// Every pair of two lists of local pages, coalesced (an unsharded pair list).
    pub fn local(src: &[LocalPage], dst: &[LocalPage]) -> Self {
        let mut out = Self::default();
        for (i, (&s, &d)) in src.iter().zip(dst).enumerate() {
            out.push(i, s, d);
        }
        out
    }

    fn push(&mut self, position: usize, src: LocalPage, dst: LocalPage) {
        self.positions.push(position);
        self.src.push(src);
        self.dst.push(dst);
        match self.runs.last_mut() {
            Some(run)
                if run.src.0.checked_add(run.pages) == Some(src.0)
                    && run.dst.0.checked_add(run.pages) == Some(dst.0) =>
            {
                run.pages += 1;
            }
            _ => self.runs.push(Run { src, dst, pages: 1 }),
        }
    }

    /// Positions of the kept pairs, ascending.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// Local source page of each kept pair.
    pub fn src_pages(&self) -> &[LocalPage] {
        &self.src
    }

    /// Local destination page of each kept pair.
    pub fn dst_pages(&self) -> &[LocalPage] {
        &self.dst
    }

    /// The kept pairs coalesced into runs, in pair order.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Pairs kept.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether no pair was kept.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// One past the highest page of each side, or `None` when nothing is kept.
    pub fn page_ends(&self) -> Option<(u64, u64)> {
        let src = self.src.iter().map(|p| p.0).max()?;
        let dst = self.dst.iter().map(|p| p.0).max()?;
        Some((src.saturating_add(1), dst.saturating_add(1)))
    }
}

impl fmt::Display for OwnedRuns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} pages in {} runs", self.len(), self.runs.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(src: u64, dst: u64, pages: u64) -> Run {
        Run {
            src: LocalPage(src),
            dst: LocalPage(dst),
            pages,
        }
    }

    #[test]
    fn pairs_filter_map_and_coalesce() {
        let p = Placement::new(2).unwrap();
        // Rank 0 owns even source pages; destinations are logical pages of the same placement.
        let src = [4, 6, 8, 12, 5, 14].map(LogicalPage);
        let dst = [10, 12, 14, 16, 3, 20].map(LogicalPage);
        let r = OwnedRuns::new(p, 0, &src, &dst, |d| p.local(d));
        assert_eq!(r.positions(), &[0, 1, 2, 3, 5]);
        assert_eq!(r.src_pages(), &[2, 3, 4, 6, 7].map(LocalPage));
        assert_eq!(r.dst_pages(), &[5, 6, 7, 8, 10].map(LocalPage));
        assert_eq!(r.runs(), &[run(2, 5, 3), run(6, 8, 1), run(7, 10, 1)]);
        assert_eq!(r.page_ends(), Some((8, 11)));
        let other = OwnedRuns::new(p, 1, &src, &dst, |d| p.local(d));
        assert_eq!(other.positions(), &[4]);
        assert_eq!(other.to_string(), "1 pages in 1 runs");
        // Unsharded destinations are local pages already.
        let pd = OwnedRuns::new(p, 0, &src[..3], &[100, 101, 103].map(LocalPage), |d| d);
        assert_eq!(pd.runs(), &[run(2, 100, 2), run(4, 103, 1)]);
    }

    #[test]
    fn runs_never_wrap() {
        let r = OwnedRuns::local(
            &[LocalPage(u64::MAX), LocalPage(0)],
            &[LocalPage(1), LocalPage(2)],
        );
        assert_eq!(r.runs().len(), 2);
    }
}
