//! Reloading a cached prefix with another parallelism (docs/storage.md, "Reloading with another
//! parallelism"): which reader rank reads which page of a prefix cached by N page-sharded
//! writer ranks, and which rows of it each reader rank keeps. Pure CPU math.
//!
//! The cache's keys name no rank (a page's key is its namespace and its token chain), and a
//! host page or a storage slot holds a whole page, every component: what N ranks wrote, any
//! group can read. What depends on the reader is the page to rank assignment:
//!
//! - a CP group of N' ranks with start owner b' (an unsharded server is N' = 1): rank
//!   `(b' + P) % N'` reads sequence page `P` and keeps it whole, as its `P / N'`-th page of the
//!   prefix;
//! - a decode group sharded by token ([`DecodeLayout`], M ranks, interleave I) whose layout keeps
//!   pages whole: the rank holding the page reads it and keeps it whole;
//! - a decode group whose layout spreads a page's rows over several ranks (I below a page, M >
//!   1): each page is read once, by rank `P % M` (round-robin), and its rows go to every rank
//!   that holds some (`kvs_decode_scatter`), rather than every rank reading every page (M times
//!   the reads).
//!
//! Either way a reader rank keeps its local tokens in pages of 64 from its first page of the
//! prefix, local token `k` at row `k % 64` of its `k / 64`-th page, as every pool does.

use std::fmt;

use super::decode_layout::{DecodeLayout, DecodeRow};
use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;

const PAGE: u64 = PAGE_SIZE as u64;

/// A page-sharded CP group: `ranks` ranks, sequence page `P` of a chain on rank
/// `(start + P) % ranks` (docs/design.md, "Ownership").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CpGroup {
    ranks: u32,
    start: u32,
}

impl CpGroup {
    /// `ranks` ranks (at least 1), the chain's first page on rank `start` (below `ranks`).
    pub fn new(ranks: u32, start: u32) -> Result<Self> {
        if ranks == 0 {
            return Err(Error::InvalidArgument(
                "a CP group needs at least one rank".into(),
            ));
        }
        if start >= ranks {
            return Err(Error::OutOfRange {
                what: "CP start owner",
                index: i64::from(start),
                limit: u64::from(ranks),
            });
        }
        Ok(Self { ranks, start })
    }

    /// One rank holding every page.
    pub fn unsharded() -> Self {
        Self { ranks: 1, start: 0 }
    }

    /// Ranks (N).
    pub fn ranks(&self) -> u32 {
        self.ranks
    }

    /// The rank owning the chain's first page (b).
    pub fn start(&self) -> u32 {
        self.start
    }

    /// The rank owning sequence page `position`.
    pub fn owner(&self, position: u64) -> u32 {
        // Below `ranks`.
        ((u64::from(self.start) + position % u64::from(self.ranks)) % u64::from(self.ranks)) as u32
    }

    /// Which of its owner's pages of the chain `position` is, from the owner's first: the
    /// pages of one owner are `ranks` apart and its first is below `ranks`.
    pub fn index(&self, position: u64) -> u64 {
        position / u64::from(self.ranks)
    }

    /// Pages `rank` owns among sequence pages `0..pages`.
    pub fn pages_on(&self, rank: u32, pages: u64) -> u64 {
        if rank >= self.ranks {
            return 0;
        }
        let n = u64::from(self.ranks);
        let first = (u64::from(rank) + n - u64::from(self.start)) % n;
        pages.saturating_sub(first).div_ceil(n)
    }
}

impl fmt::Display for CpGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CP{} from rank {}", self.ranks, self.start)
    }
}

/// The group that reloads a prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reader {
    /// Page-sharded CP ranks (one rank: an unsharded server).
    Cp(CpGroup),
    /// A decode group sharded by token.
    Decode(DecodeLayout),
}

impl Reader {
    /// Ranks of the group.
    pub fn ranks(&self) -> u32 {
        match self {
            Self::Cp(g) => g.ranks(),
            Self::Decode(l) => l.ranks(),
        }
    }

    /// Where token `token` of the prefix lives: its rank and its local token there.
    pub fn place(&self, token: u64) -> DecodeRow {
        match self {
            Self::Cp(g) => {
                let position = token / PAGE;
                DecodeRow {
                    rank: g.owner(position),
                    local: g.index(position) * PAGE + token % PAGE,
                }
            }
            Self::Decode(l) => l.place(token),
        }
    }

    /// Whether every page lands whole on one rank (rows in place).
    pub fn keeps_pages_whole(&self) -> bool {
        match self {
            Self::Cp(_) => true,
            Self::Decode(l) => l.is_page_granular(),
        }
    }
}

impl fmt::Display for Reader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cp(g) => g.fmt(f),
            Self::Decode(l) => l.fmt(f),
        }
    }
}

/// One page read: sequence page `position`, held by writer rank `writer`, read by reader rank
/// `reader`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRead {
    /// The sequence page.
    pub position: u64,
    /// The writer rank whose host pool or slot file holds it.
    pub writer: u32,
    /// The reader rank that reads it.
    pub reader: u32,
}

/// Rows of one read page a reader rank keeps: its local tokens `first..first + rows`, the page's
/// tokens the reader's layout places on `rank`, in sequence order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Keep {
    /// The reader rank keeping them.
    pub rank: u32,
    /// Its first local token among them.
    pub first: u64,
    /// How many.
    pub rows: u64,
}

/// Which reader rank reads which page of a cached prefix and which rows each keeps (module
/// docs). Plain data, checked when built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadPlan {
    writers: CpGroup,
    reader: Reader,
    reads: Vec<PageRead>,
}

impl ReloadPlan {
    /// Plans reloading the first `pages` whole pages of a chain `writers` cached into `reader`
    /// (at most 2^32 tokens: what a decode scatter places).
    pub fn new(writers: CpGroup, reader: Reader, pages: u64) -> Result<Self> {
        let limit = crate::abi::KVS_DECODE_MAX_TOKENS / PAGE;
        if pages > limit {
            return Err(Error::OutOfRange {
                what: "pages of a reloaded prefix",
                index: i64::try_from(pages).unwrap_or(i64::MAX),
                limit: limit + 1,
            });
        }
        let m = u64::from(reader.ranks());
        let reads = (0..pages)
            .map(|position| PageRead {
                position,
                writer: writers.owner(position),
                reader: if reader.keeps_pages_whole() {
                    reader.place(position * PAGE).rank
                } else {
                    // Below m.
                    (position % m) as u32
                },
            })
            .collect();
        Ok(Self {
            writers,
            reader,
            reads,
        })
    }

    /// The group that cached the prefix.
    pub fn writers(&self) -> CpGroup {
        self.writers
    }

    /// The group that reloads it.
    pub fn reader(&self) -> Reader {
        self.reader
    }

    /// Pages of the prefix.
    pub fn pages(&self) -> u64 {
        self.reads.len() as u64
    }

    /// Tokens of the prefix.
    pub fn tokens(&self) -> u64 {
        self.pages() * PAGE
    }

    /// Every page's read, by sequence page: each page read exactly once by the group.
    pub fn reads(&self) -> &[PageRead] {
        &self.reads
    }

    /// The pages reader rank `rank` reads, by sequence page.
    pub fn reads_of(&self, rank: u32) -> impl Iterator<Item = &PageRead> + '_ {
        self.reads.iter().filter(move |r| r.reader == rank)
    }

    /// Whether a page's rows go to several ranks (each read page is scattered to them).
    pub fn scatters(&self) -> bool {
        !self.reader.keeps_pages_whole()
    }

    /// The rows of sequence page `position` each reader rank keeps (ranks keeping none left
    /// out), in rank order.
    pub fn keeps(&self, position: u64) -> Vec<Keep> {
        match self.reader {
            Reader::Cp(g) => vec![Keep {
                rank: g.owner(position),
                first: g.index(position) * PAGE,
                rows: PAGE,
            }],
            Reader::Decode(l) => (0..l.ranks())
                .filter_map(|rank| {
                    let (first, rows) = l.page_rows(rank, position, self.tokens());
                    (rows > 0).then_some(Keep { rank, first, rows })
                })
                .collect(),
        }
    }

    /// Pages reader rank `rank` holds of the prefix: what it registers for it.
    pub fn pages_on(&self, rank: u32) -> u64 {
        match self.reader {
            Reader::Cp(g) => g.pages_on(rank, self.pages()),
            Reader::Decode(l) => l.pages_on(rank, self.tokens()),
        }
    }

    /// Most pages one reader rank reads: what bounds the reload's time on a tier whose every
    /// rank reads at the same ceiling.
    pub fn busiest(&self) -> u64 {
        let mut per = vec![0u64; self.reader.ranks() as usize];
        for r in &self.reads {
            per[r.reader as usize] += 1;
        }
        per.into_iter().max().unwrap_or(0)
    }
}

impl fmt::Display for ReloadPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "reload of {} pages cached by {} into {}: {}, at most {} pages read by one rank",
            self.pages(),
            self.writers,
            self.reader,
            if self.scatters() {
                "each page read once and scattered by rows"
            } else {
                "each rank reads its own pages"
            },
            self.busiest()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_cp2_prefix_into_cp4_an_unsharded_server_and_dcp() {
        let cp2 = CpGroup::new(2, 1).unwrap();
        // CP4 from rank 3: pages 0..6 on ranks 3, 0, 1, 2, 3, 0.
        let plan = ReloadPlan::new(cp2, Reader::Cp(CpGroup::new(4, 3).unwrap()), 6).unwrap();
        let readers: Vec<u32> = plan.reads().iter().map(|r| r.reader).collect();
        let writers: Vec<u32> = plan.reads().iter().map(|r| r.writer).collect();
        assert_eq!(readers, [3, 0, 1, 2, 3, 0]);
        assert_eq!(writers, [1, 0, 1, 0, 1, 0]);
        assert_eq!(
            plan.keeps(4),
            [Keep {
                rank: 3,
                first: 64,
                rows: 64
            }]
        );
        assert_eq!(
            (plan.pages_on(3), plan.pages_on(1), plan.busiest()),
            (2, 1, 2)
        );
        // Unsharded: one rank reads everything.
        let one = ReloadPlan::new(cp2, Reader::Cp(CpGroup::unsharded()), 6).unwrap();
        assert!(one.reads().iter().all(|r| r.reader == 0));
        assert_eq!(one.busiest(), 6);
        // DCP 2 at I = 1: page 3 read by rank 1, its rows to both ranks, 32 each.
        let dcp =
            ReloadPlan::new(cp2, Reader::Decode(DecodeLayout::new(2, 1).unwrap()), 6).unwrap();
        assert!(dcp.scatters());
        assert_eq!(dcp.reads()[3].reader, 1);
        assert_eq!(
            dcp.keeps(3),
            [
                Keep {
                    rank: 0,
                    first: 96,
                    rows: 32
                },
                Keep {
                    rank: 1,
                    first: 96,
                    rows: 32
                }
            ]
        );
        assert_eq!(dcp.busiest(), 3);
        assert_eq!(
            dcp.to_string(),
            "reload of 6 pages cached by CP2 from rank 1 into 2 decode ranks x 1 tokens \
             interleaved: each page read once and scattered by rows, at most 3 pages read by one rank"
        );
        assert!(CpGroup::new(0, 0).is_err() && CpGroup::new(2, 2).is_err());
        assert!(ReloadPlan::new(cp2, Reader::Cp(cp2), 1 << 26).is_ok());
        assert!(matches!(
            ReloadPlan::new(cp2, Reader::Cp(cp2), (1 << 26) + 1),
            Err(Error::OutOfRange { .. })
        ));
    }

    fn groups() -> impl Strategy<Value = CpGroup> {
        (1..=9u32)
            .prop_flat_map(|n| (Just(n), 0..n))
            .prop_map(|(n, b)| CpGroup::new(n, b).unwrap())
    }

    fn readers() -> impl Strategy<Value = Reader> {
        prop_oneof![
            groups().prop_map(Reader::Cp),
            (
                1..=9u32,
                prop::sample::select(vec![1u32, 2, 3, 16, 48, 64, 100, 128, 192])
            )
                .prop_map(|(m, i)| Reader::Decode(DecodeLayout::new(m, i).unwrap())),
        ]
    }

    proptest! {
        #[test]
        fn every_token_lands_once_on_its_reader_and_every_page_is_read_once(
            writers in groups(),
            reader in readers(),
            pages in 0..300u64,
        ) {
            let plan = ReloadPlan::new(writers, reader, pages).unwrap();
            let m = reader.ranks();
            // Every page read exactly once, from its writer, by a rank of the group.
            let positions: Vec<u64> = plan.reads().iter().map(|r| r.position).collect();
            prop_assert_eq!(positions, (0..pages).collect::<Vec<_>>());
            let mut per_rank = vec![0u64; m as usize];
            for read in plan.reads() {
                prop_assert_eq!(read.writer, writers.owner(read.position));
                prop_assert!(read.reader < m);
                per_rank[read.reader as usize] += 1;
                let keeps = plan.keeps(read.position);
                if reader.keeps_pages_whole() {
                    // The rank keeping the page whole reads it itself.
                    prop_assert_eq!(keeps.len(), 1);
                    prop_assert_eq!(keeps[0].rank, read.reader);
                    prop_assert_eq!(keeps[0].rows, PAGE);
                    prop_assert_eq!(keeps[0].first % PAGE, 0);
                } else {
                    prop_assert_eq!(u64::from(read.reader), read.position % u64::from(m));
                }
            }
            prop_assert_eq!(per_rank.iter().max().copied().unwrap_or(0), plan.busiest());
            // Every token of the prefix kept exactly once, where the reader's layout puts it:
            // walking each page's keeps in order gives each rank's tokens in sequence order.
            let mut locals: Vec<Vec<u64>> = vec![Vec::new(); m as usize];
            let mut next = vec![0u64; m as usize];
            for position in 0..pages {
                let keeps = plan.keeps(position);
                for token in position * PAGE..(position + 1) * PAGE {
                    let at = reader.place(token);
                    let keep = keeps.iter().find(|k| k.rank == at.rank);
                    prop_assert!(keep.is_some(), "token {} kept by no rank", token);
                    let keep = keep.unwrap();
                    prop_assert!((keep.first..keep.first + keep.rows).contains(&at.local));
                    locals[at.rank as usize].push(at.local);
                }
                // A page's rows on a rank follow its rows of the pages before.
                for k in &keeps {
                    prop_assert_eq!(k.first, next[k.rank as usize]);
                    next[k.rank as usize] = k.first + k.rows;
                }
                prop_assert_eq!(keeps.iter().map(|k| k.rows).sum::<u64>(), PAGE);
            }
            for (rank, l) in locals.iter_mut().enumerate() {
                let n = l.len() as u64;
                l.sort_unstable();
                // Each rank's local tokens are exactly 0, 1, 2, ...: none twice, none missing,
                // filling the pages it registers.
                prop_assert_eq!(&*l, &(0..n).collect::<Vec<_>>());
                prop_assert_eq!(plan.pages_on(rank as u32), n.div_ceil(PAGE));
            }
        }
    }
}
