//! Scatters into a decode context-parallel layout as plain data (docs/dcp.md, "The kernel"): the
//! only builder of `kvs_decode_scatter_params` and its tables. A [`DecodeScatterPlan`] names the
//! source pages of one prefill rank's chunk (by sequence page) and every decode rank's pages of
//! the request; `kvs_decode_scatter` (a kernel of cuda/, or its CPU twin) places each token's
//! row by the [`DecodeLayout`] and moves it, every (component, layer) and every decode rank in
//! one launch ([`TableStore::launch_scatter`]).
//!
//! The same kernel moves rows for the bounce route (docs/dcp.md, "Over NIXL and Mooncake"):
//! [`DecodeScatterPlan::pack`] packs every decode rank's rows of a chunk densely into a region of
//! its own ([`DenseRows`](crate::shard::DenseRows): one contiguous range per decode rank), [`DecodeScatterPlan::unpack`]
//! moves one decode rank's rows out of such a region into its pages, and
//! [`DecodeScatterPlan::one_rank`] moves one decode rank's rows straight from whole source pages
//! (a cached prefix reloaded into a decode rank).
//!
//! A plan is checked in full against the source and every destination when it is built: every
//! source page in its space, sequence pages distinct, every rank's pages in its space and
//! distinct, every row a token below the end can land on registered by its rank (or inside its
//! dense region), the destinations' memory disjoint, every component packed on every side. The
//! kernel re-checks the indices it reads against the same limits.
//!
//! [`TableStore::launch_scatter`]: super::TableStore::launch_scatter

use std::fmt;

use super::space::{BlockSpace, SpaceId};
use crate::abi;
use crate::backend::AddressSpace;
use crate::error::{Error, Result};
use crate::geometry::{Component, PAGE_SIZE};
use crate::index::LocalPage;
use crate::shard::DecodeLayout;

mod checks;
mod ranks;
mod scatter_build;
mod tables;

const PAGE: u64 = PAGE_SIZE as u64;

/// One section of a scatter: the components it moves, and the source pages it moves them from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScatterSection {
    /// Components moved (each in one section at most).
    pub components: Vec<Component>,
    /// (local source page, sequence page) of each page moved; sequence pages distinct. An
    /// unpack reads no source page (give any: the dense rows follow the sequence pages).
    pub entries: Vec<(LocalPage, u64)>,
}

impl ScatterSection {
    /// The sequence pages of the entries, in order.
    pub fn positions(&self) -> Vec<u64> {
        self.entries.iter().map(|&(_, p)| p).collect()
    }
}

/// One decode rank's pages of the request: the page holding each of its local pages, for the
/// latent section (`pages`) and the state section (`state_pages`; empty when no state moves).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScatterRank {
    /// Page of each local page, for the latent section.
    pub pages: Vec<LocalPage>,
    /// Page of each local page, for the state section.
    pub state_pages: Vec<LocalPage>,
}

/// How a scatter addresses its rows (cuda/abi.h, `KVS_DECODE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Source pages to the ranks' pages.
    Direct,
    /// Source pages to each rank's dense region.
    Pack,
    /// One rank's dense region to its pages.
    Unpack,
}

impl Mode {
    fn abi(self) -> u32 {
        match self {
            Self::Direct => abi::KVS_DECODE_DIRECT,
            Self::Pack => abi::KVS_DECODE_PACK,
            Self::Unpack => abi::KVS_DECODE_UNPACK,
        }
    }
}

/// The ranks a scatter writes: every rank of the layout with its pages, every rank into its
/// dense region, or one rank with its pages.
enum Targets<'a> {
    Every(&'a [ScatterRank]),
    Dense,
    One(u32, &'a ScatterRank),
}

/// A scatter as plain data, checked against its source and destinations (module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeScatterPlan {
    src: (SpaceId, AddressSpace),
    dsts: Vec<(SpaceId, AddressSpace)>,
    layout: DecodeLayout,
    end_token: u64,
    src_limit: u64,
    mode: Mode,
    /// The one rank whose rows move (the tables hold it alone), or every rank's.
    one_rank: Option<u32>,
    /// Row format of each component index of the spaces.
    components: Vec<abi::kvs_row_component>,
    /// The latent section's pairs, then the state section's.
    pairs: Vec<abi::kvs_decode_pair>,
    kv_pairs: usize,
    /// Base of pair `k` on the tables' rank `s` at `k * T + s`.
    dst_bases: Vec<u64>,
    /// Per rank of the tables: its page ids for each section, and its pool's pages.
    ranks: Vec<(Vec<LocalPage>, Vec<LocalPage>, u64)>,
    entries: Vec<abi::kvs_decode_entry>,
    state_entries: Vec<abi::kvs_decode_entry>,
    /// Packing and unpacking: the shift of (entry, rank of the tables) at `position * T + s`.
    shifts: Vec<u64>,
    bytes: u64,
}

impl DecodeScatterPlan {
    /// Plans scattering `kv` and `state` from `src` into `dsts` (one destination per rank of
    /// `layout`, `ranks` their pages), the rows of tokens below `end_token` (at most
    /// [`abi::KVS_DECODE_MAX_TOKENS`]). Everything is checked here (module docs).
    pub fn new(
        src: &dyn BlockSpace,
        dsts: &[&dyn BlockSpace],
        layout: DecodeLayout,
        end_token: u64,
        kv: ScatterSection,
        state: ScatterSection,
        ranks: &[ScatterRank],
    ) -> Result<Self> {
        let m = layout.ranks() as usize;
        if ranks.len() != m {
            return Err(Error::InvalidArgument(format!(
                "a scatter over {layout}: {} ranks' pages",
                ranks.len()
            )));
        }
        Self::build(
            src,
            dsts,
            layout,
            end_token,
            [kv, state],
            Mode::Direct,
            Targets::Every(ranks),
        )
    }

    /// Plans moving decode rank `rank`'s rows alone of `kv` and `state` from whole source pages
    /// of `src` into `dst` (the rank's pool, `pages` its pages of the request): a prefix cached
    /// whole reloaded into one rank of a decode server sharded by token.
    #[allow(clippy::too_many_arguments)]
    pub fn one_rank(
        src: &dyn BlockSpace,
        dst: &dyn BlockSpace,
        layout: DecodeLayout,
        rank: u32,
        end_token: u64,
        kv: ScatterSection,
        state: ScatterSection,
        pages: &ScatterRank,
    ) -> Result<Self> {
        Self::build(
            src,
            &[dst],
            layout,
            end_token,
            [kv, state],
            Mode::Direct,
            Targets::One(rank, pages),
        )
    }

    /// Plans packing every decode rank's rows of `kv` and `state` from `src` into its own
    /// region `dsts[d]`, densely: the rank's rows of each section in sequence order from the
    /// region's page 0 ([`DecodeLayout::dense_rows`] of the section's sequence pages), which
    /// must hold them.
    pub fn pack(
        src: &dyn BlockSpace,
        dsts: &[&dyn BlockSpace],
        layout: DecodeLayout,
        end_token: u64,
        kv: ScatterSection,
        state: ScatterSection,
    ) -> Result<Self> {
        Self::build(
            src,
            dsts,
            layout,
            end_token,
            [kv, state],
            Mode::Pack,
            Targets::Dense,
        )
    }

    /// Plans moving decode rank `rank`'s rows of `kv` and `state` out of `src`, where
    /// [`DecodeScatterPlan::pack`] put them (the same sections' sequence pages), into `dst` (the
    /// rank's pool, `pages` its pages of the request). The entries' source pages are not read.
    #[allow(clippy::too_many_arguments)]
    pub fn unpack(
        src: &dyn BlockSpace,
        dst: &dyn BlockSpace,
        layout: DecodeLayout,
        rank: u32,
        end_token: u64,
        kv: ScatterSection,
        state: ScatterSection,
        pages: &ScatterRank,
    ) -> Result<Self> {
        Self::build(
            src,
            &[dst],
            layout,
            end_token,
            [kv, state],
            Mode::Unpack,
            Targets::One(rank, pages),
        )
    }

    /// The decode layout.
    pub fn layout(&self) -> DecodeLayout {
        self.layout
    }

    /// Bytes the scatter moves (rows of tokens below the end, every layer; each byte read once
    /// and written once).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The launch's (pair, source page) units of each section: its work units, save that a
    /// rows kernel cuts each latent one into slices (the backend counts those for its queue).
    pub fn units(&self) -> u64 {
        let state_pairs = (self.pairs.len() - self.kv_pairs) as u64;
        self.kv_pairs as u64 * self.entries.len() as u64
            + state_pairs * self.state_entries.len() as u64
    }

    /// Whether the scatter moves nothing.
    pub fn is_empty(&self) -> bool {
        self.units() == 0 || self.bytes == 0
    }
}

impl fmt::Display for DecodeScatterPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} into {}: {} + {} pages x {} + {} layer pairs up to token {}, {} bytes",
            match (self.mode, self.one_rank) {
                (Mode::Direct, None) => "scatter".to_string(),
                (Mode::Direct, Some(r)) => format!("scatter of rank {r}'s rows"),
                (Mode::Pack, _) => "dense packing".to_string(),
                (Mode::Unpack, r) => format!("unpacking of rank {}'s rows", r.unwrap_or(0)),
            },
            self.layout,
            self.entries.len(),
            self.state_entries.len(),
            self.kv_pairs,
            self.pairs.len() - self.kv_pairs,
            self.end_token,
            self.bytes
        )
    }
}
