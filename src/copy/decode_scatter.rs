//! Scatters into a decode context-parallel layout as plain data (docs/dcp.md, "The kernel"): the
//! only builder of `kvs_decode_scatter_params` and its tables. A [`DecodeScatterPlan`] names the
//! source pages of one prefill rank's chunk (by sequence page) and every decode rank's pages of
//! the request; `kvs_decode_scatter` (cuda/decode_scatter.cu, or its CPU twin) places each token's
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

use std::fmt;
use std::sync::Arc;

use super::block_copy::TableStore;
use super::block_copy_plan::check_distinct;
use super::space::{check_same_components, BlockSpace, SpaceId};
use crate::abi;
use crate::backend::{check_space, AddressSpace, Backend, Event, Launch};
use crate::error::{Checked, Error, Result};
use crate::geometry::{Component, INDEXER_PAGE_BYTES, INDEXER_ROW_BYTES, PAGE_SIZE};
use crate::index::LocalPage;
use crate::shard::DecodeLayout;

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

/// The kernel's row format of a component laid out as `layout` is.
fn row_format(layout: &crate::geometry::ComponentLayout) -> Result<abi::kvs_row_component> {
    let indexer = layout.component.is_indexer();
    let ok = if indexer {
        layout.rows == 1 && layout.block_bytes == INDEXER_PAGE_BYTES
    } else {
        layout.rows == PAGE_SIZE && layout.block_bytes == PAGE_SIZE * layout.row_bytes
    };
    if !ok {
        return Err(Error::InvalidArgument(format!(
            "a decode scatter moves 64-row latent blocks and 8448-byte indexer pages; {} blocks are {} rows of {} B",
            layout.component, layout.rows, layout.row_bytes
        )));
    }
    Ok(if indexer {
        abi::kvs_row_component {
            kind: abi::KVS_ROWS_INDEXER,
            row_bytes: INDEXER_ROW_BYTES as u32,
        }
    } else {
        abi::kvs_row_component {
            kind: abi::KVS_ROWS_LATENT,
            row_bytes: layout.row_bytes as u32,
        }
    })
}

/// Tokens of `entries` below `end_token`, and the tokens up to which their rows reach (the end,
/// or the end of the last entry's page).
fn reach(entries: &[(LocalPage, u64)], end_token: u64) -> (u64, u64) {
    let rows: u64 = entries
        .iter()
        .map(|&(_, p)| end_token.saturating_sub(p * PAGE).min(PAGE))
        .sum();
    let last = entries.iter().map(|&(_, p)| p).max();
    let reach = last.map_or(0, |p| (p * PAGE).saturating_add(PAGE).min(end_token));
    (rows, reach)
}

/// The entries of a section as the kernel reads them (none when it moves no component).
fn kernel_entries(section: &ScatterSection) -> Vec<abi::kvs_decode_entry> {
    if section.components.is_empty() {
        return Vec::new();
    }
    section
        .entries
        .iter()
        .map(|&(page, position)| abi::kvs_decode_entry {
            // Below the source's page count (checked; an unpack's are never read), itself far
            // below 2^63.
            page: i64::try_from(page.0).unwrap_or(i64::MAX),
            position,
        })
        .collect()
}

/// The sequence pages a section moves (none when it moves no component).
fn moved_positions(section: &ScatterSection) -> Vec<u64> {
    if section.components.is_empty() {
        Vec::new()
    } else {
        section.positions()
    }
}

/// Checks one rank's page lists: in its pool of `limit` pages, distinct, as many as the rows of
/// each used section reach (`needed`), the two lists of one length where both are given.
fn check_rank_pages(d: u32, rank: &ScatterRank, limit: u64, needed: [u64; 2]) -> Result<()> {
    for ((what, pages), needed) in [
        ("destination page", &rank.pages),
        ("destination state page", &rank.state_pages),
    ]
    .into_iter()
    .zip(needed)
    {
        if let Some(bad) = pages.iter().find(|p| p.0 >= limit) {
            return Err(Error::OutOfRange {
                what: "decode rank page",
                index: i64::try_from(bad.0).unwrap_or(i64::MAX),
                limit,
            });
        }
        check_distinct(pages.iter().map(|p| p.0), what)?;
        if (pages.len() as u64) < needed {
            return Err(Error::InvalidArgument(format!(
                "decode rank {d} registered {} {what}s; its rows of the scatter need {needed}",
                pages.len()
            )));
        }
    }
    // One bound (the descriptor's num_pages) serves both lists.
    if !rank.pages.is_empty()
        && !rank.state_pages.is_empty()
        && rank.pages.len() != rank.state_pages.len()
    {
        return Err(Error::InvalidArgument(format!(
            "decode rank {d} registered {} pages and {} state pages",
            rank.pages.len(),
            rank.state_pages.len()
        )));
    }
    Ok(())
}

/// The page list of a dense region's section of `own` pages: pages `0..own`, then padding ids
/// (`u64::MAX`, which the kernel reads as a negative id: skipped) up to `len`.
fn dense_pages(own: u64, len: u64) -> Vec<LocalPage> {
    (0..len)
        .map(|p| LocalPage(if p < own { p } else { u64::MAX }))
        .collect()
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
        layout.check_rank(rank)?;
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
        layout.check_rank(rank)?;
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

    /// Everything the constructors share: the checks of the module docs, the tables.
    fn build(
        src: &dyn BlockSpace,
        dsts: &[&dyn BlockSpace],
        layout: DecodeLayout,
        end_token: u64,
        [kv, state]: [ScatterSection; 2],
        mode: Mode,
        targets: Targets,
    ) -> Result<Self> {
        let table_ranks = match targets {
            Targets::One(..) => 1,
            Targets::Every(_) | Targets::Dense => layout.ranks() as usize,
        };
        if dsts.len() != table_ranks {
            return Err(Error::InvalidArgument(format!(
                "a scatter over {layout} into {} destinations, not {table_ranks}",
                dsts.len()
            )));
        }
        if end_token > abi::KVS_DECODE_MAX_TOKENS {
            return Err(Error::OutOfRange {
                what: "scatter end token",
                index: i64::try_from(end_token).unwrap_or(i64::MAX),
                limit: abi::KVS_DECODE_MAX_TOKENS + 1,
            });
        }
        let layouts = src.components();
        for dst in dsts {
            check_same_components(layouts, dst.components())?;
        }
        let mut components = Vec::with_capacity(layouts.len());
        for (c, l) in layouts.iter().enumerate() {
            let packed = l.packed_side();
            if src.side(c) != packed || dsts.iter().any(|d| d.side(c) != packed) {
                return Err(Error::InvalidArgument(format!(
                    "a decode scatter moves packed blocks; a side strides {} otherwise",
                    l.component
                )));
            }
            components.push(row_format(l)?);
        }
        // Every section's entries: in the source (an unpack reads none), sequence pages distinct
        // and addressable.
        let src_limit = src.pages();
        for section in [&kv, &state] {
            let bad = section.entries.iter().find(|(p, _)| p.0 >= src_limit);
            if let (Some(&(bad, _)), false) = (bad, mode == Mode::Unpack) {
                return Err(Error::OutOfRange {
                    what: "scatter source page",
                    index: i64::try_from(bad.0).unwrap_or(i64::MAX),
                    limit: src_limit,
                });
            }
            if let Some(&(_, bad)) = section
                .entries
                .iter()
                .find(|(_, p)| p.checked_mul(PAGE).is_none())
            {
                return Err(Error::overflow(format!(
                    "the first token of sequence page {bad}"
                )));
            }
            check_distinct(section.entries.iter().map(|&(_, p)| p), "sequence page")?;
        }
        let (pairs, dst_bases, kv_pairs) = Self::pairs(src, dsts, &kv, &state)?;
        let positions = [moved_positions(&kv), moved_positions(&state)];
        let (ranks, shifts, rows, dense) = Self::ranks(
            src_limit, dsts, layout, end_token, &positions, mode, &targets,
        )?;
        // The memory each destination's pages can be written in: a dense region holds each
        // section's components at the section's pages.
        let mut moved: Vec<usize> = pairs.iter().map(|p| p.component as usize).collect();
        moved.dedup();
        let kv_components: Vec<usize> = kv
            .components
            .iter()
            .filter_map(|&c| src.component_index(c).ok())
            .collect();
        // What a layer of component `c` on destination `d` may be written in: its pages, or in
        // a dense region the rank's rows of the component's section (a latent layer's rows are
        // contiguous there; indexer rows fill whole pages).
        let extent = |d: usize, c: usize| -> u64 {
            let block = layouts[c].block_bytes as u64;
            let Targets::Dense = targets else {
                return ranks[d].2.saturating_mul(block);
            };
            let rows = dense[d][usize::from(!kv_components.contains(&c))];
            if layouts[c].component.is_indexer() {
                rows.div_ceil(PAGE).saturating_mul(block)
            } else {
                rows.saturating_mul(layouts[c].row_bytes as u64)
            }
        };
        check_disjoint(dsts, &moved, &extent)?;
        let row_bytes = |section: &ScatterSection| -> u64 {
            section
                .components
                .iter()
                .filter_map(|&c| layouts.iter().position(|l| l.component == c))
                .map(|c| u64::from(components[c].row_bytes) * layouts[c].layers() as u64)
                .sum()
        };
        let what = || "bytes of a scatter".to_string();
        let bytes = rows[0]
            .mul_or(row_bytes(&kv), what)?
            .add_or(rows[1].mul_or(row_bytes(&state), what)?, what)?;
        Ok(Self {
            src: (src.id(), src.address_space()),
            dsts: dsts.iter().map(|d| (d.id(), d.address_space())).collect(),
            layout,
            end_token,
            src_limit,
            mode,
            one_rank: match targets {
                Targets::One(rank, _) => Some(rank),
                Targets::Every(_) | Targets::Dense => None,
            },
            components,
            kv_pairs,
            dst_bases,
            ranks,
            entries: kernel_entries(&kv),
            state_entries: kernel_entries(&state),
            shifts,
            pairs,
            bytes,
        })
    }

    /// The pairs (the latent section's components, then the state section's, every stored
    /// layer), the destinations' bases of each, and how many are the latent section's.
    fn pairs(
        src: &dyn BlockSpace,
        dsts: &[&dyn BlockSpace],
        kv: &ScatterSection,
        state: &ScatterSection,
    ) -> Result<(Vec<abi::kvs_decode_pair>, Vec<u64>, usize)> {
        let mut pairs = Vec::new();
        let mut dst_bases = Vec::new();
        let mut kv_pairs = 0;
        let mut moved = Vec::new();
        for (section, is_kv) in [(kv, true), (state, false)] {
            for &component in &section.components {
                if moved.contains(&component) {
                    return Err(Error::InvalidArgument(format!(
                        "a scatter moves {component} twice"
                    )));
                }
                moved.push(component);
                let c = src.component_index(component)?;
                for layer in 0..src.layer_count(c) {
                    pairs.push(abi::kvs_decode_pair {
                        src: src.base(c, layer),
                        component: c as u32,
                        reserved: 0,
                    });
                    dst_bases.extend(dsts.iter().map(|d| d.base(c, layer)));
                    kv_pairs += usize::from(is_kv);
                }
            }
        }
        u32::try_from(pairs.len())
            .map_err(|_| Error::overflow(format!("{} scatter pairs", pairs.len())))?;
        Ok((pairs, dst_bases, kv_pairs))
    }

    /// The tables' ranks (their page lists, checked against their spaces and covering every row
    /// that can land on them), the shifts a packing or unpacking reads, the rows moved per
    /// section, and a packing's rows per rank and section.
    #[allow(clippy::type_complexity)]
    fn ranks(
        src_limit: u64,
        dsts: &[&dyn BlockSpace],
        layout: DecodeLayout,
        end_token: u64,
        positions: &[Vec<u64>; 2],
        mode: Mode,
        targets: &Targets,
    ) -> Result<(
        Vec<(Vec<LocalPage>, Vec<LocalPage>, u64)>,
        Vec<u64>,
        [u64; 2],
        Vec<[u64; 2]>,
    )> {
        let reach_of = |positions: &Vec<u64>| {
            let entries: Vec<(LocalPage, u64)> =
                positions.iter().map(|&p| (LocalPage(0), p)).collect();
            reach(&entries, end_token)
        };
        let (kv_rows, kv_reach) = reach_of(&positions[0]);
        let (state_rows, state_reach) = reach_of(&positions[1]);
        let dense = |rank: u32| {
            positions
                .each_ref()
                .map(|p| layout.dense_rows(rank, end_token, p))
        };
        let mut out = Vec::with_capacity(dsts.len());
        let mut shifts = Vec::new();
        let mut dense_rows = Vec::new();
        let rows = match *targets {
            Targets::Every(ranks) => {
                for (d, (rank, dst)) in (0u32..).zip(ranks.iter().zip(dsts)) {
                    let needed = [
                        layout.pages_on(d, kv_reach) * u64::from(!positions[0].is_empty()),
                        layout.pages_on(d, state_reach) * u64::from(!positions[1].is_empty()),
                    ];
                    check_rank_pages(d, rank, dst.pages(), needed)?;
                    out.push((rank.pages.clone(), rank.state_pages.clone(), dst.pages()));
                }
                [kv_rows, state_rows]
            }
            Targets::Dense => {
                let m = layout.ranks() as usize;
                let entries = positions[0].len() + positions[1].len();
                shifts = vec![0u64; entries * m];
                for (d, dst) in (0u32..).zip(dsts) {
                    let [kv, state] = dense(d);
                    for (j, &shift) in kv.shifts.iter().chain(&state.shifts).enumerate() {
                        shifts[j * m + d as usize] = shift;
                    }
                    dense_rows.push([kv.rows, state.rows]);
                    let pages = kv.pages().max(state.pages());
                    if pages > dst.pages() {
                        return Err(Error::InvalidArgument(format!(
                            "decode rank {d}'s rows take {pages} pages of its region, which holds {}",
                            dst.pages()
                        )));
                    }
                    // Both lists as long as the longer (one bound serves both), each section's
                    // own pages first and padding after: no row lands past its section's pages.
                    let list = |used: bool, own: u64| {
                        if used {
                            dense_pages(own, pages)
                        } else {
                            Vec::new()
                        }
                    };
                    out.push((
                        list(!positions[0].is_empty(), kv.pages()),
                        list(!positions[1].is_empty(), state.pages()),
                        dst.pages(),
                    ));
                }
                [kv_rows, state_rows]
            }
            Targets::One(rank, pages) => {
                let [kv, state] = dense(rank);
                if mode == Mode::Unpack {
                    let most = kv.pages().max(state.pages());
                    if most > src_limit {
                        return Err(Error::InvalidArgument(format!(
                            "decode rank {rank}'s rows take {most} pages of the packed source, which holds {src_limit}"
                        )));
                    }
                    shifts = kv.shifts.iter().chain(&state.shifts).copied().collect();
                }
                let needed = [
                    layout.pages_on(rank, kv_reach) * u64::from(!positions[0].is_empty()),
                    layout.pages_on(rank, state_reach) * u64::from(!positions[1].is_empty()),
                ];
                check_rank_pages(rank, pages, dsts[0].pages(), needed)?;
                out.push((
                    pages.pages.clone(),
                    pages.state_pages.clone(),
                    dsts[0].pages(),
                ));
                [kv.rows, state.rows]
            }
        };
        Ok((out, shifts, rows, dense_rows))
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

    /// Work units of the launch: (pair, source page) of each section.
    pub fn units(&self) -> u64 {
        let state_pairs = (self.pairs.len() - self.kv_pairs) as u64;
        self.kv_pairs as u64 * self.entries.len() as u64
            + state_pairs * self.state_entries.len() as u64
    }

    /// Whether the scatter moves nothing.
    pub fn is_empty(&self) -> bool {
        self.units() == 0 || self.bytes == 0
    }

    /// Bytes of the tables the launch uploads.
    pub fn table_bytes(&self) -> usize {
        let ids: usize = self.ranks.iter().map(|r| r.0.len() + r.1.len()).sum();
        16 * self.pairs.len()
            + 8 * self.dst_bases.len()
            + 32 * self.ranks.len()
            + 8 * ids
            + 16 * (self.entries.len() + self.state_entries.len())
            + 8 * self.shifts.len()
    }

    /// The tables at device address `at`, and the launch parameters that point into them:
    /// pairs, destination bases, rank descriptors, each rank's page lists, entries, state
    /// entries, shifts, little-endian as the kernel reads them.
    fn tables(&self, at: u64) -> (Vec<u8>, abi::kvs_decode_scatter_params) {
        let mut out = Vec::with_capacity(self.table_bytes());
        let word = |out: &mut Vec<u8>, w: u64| out.extend_from_slice(&w.to_le_bytes());
        for p in &self.pairs {
            word(&mut out, p.src);
            out.extend_from_slice(&p.component.to_le_bytes());
            out.extend_from_slice(&p.reserved.to_le_bytes());
        }
        let bases_at = out.len() as u64;
        for &b in &self.dst_bases {
            word(&mut out, b);
        }
        let ranks_at = out.len() as u64;
        // The page lists follow the rank descriptors.
        let mut lists_at = ranks_at + 32 * self.ranks.len() as u64;
        for (pages, state_pages, limit) in &self.ranks {
            let state_at = lists_at + 8 * pages.len() as u64;
            word(&mut out, at + lists_at);
            word(
                &mut out,
                if state_pages.is_empty() {
                    0
                } else {
                    at + state_at
                },
            );
            // The two lists have the same length where both are given (checked); an empty one
            // is never read: no row of its section lands on the rank (checked).
            word(&mut out, pages.len().max(state_pages.len()) as u64);
            word(&mut out, *limit);
            lists_at = state_at + 8 * state_pages.len() as u64;
        }
        for (pages, state_pages, _) in &self.ranks {
            for p in pages.iter().chain(state_pages) {
                word(&mut out, p.0);
            }
        }
        let entries_at = out.len() as u64;
        for e in self.entries.iter().chain(&self.state_entries) {
            word(&mut out, e.page as u64);
            word(&mut out, e.position);
        }
        let state_at = entries_at + 16 * self.entries.len() as u64;
        let shifts_at = out.len() as u64;
        for &shift in &self.shifts {
            word(&mut out, shift);
        }
        let mut components = [abi::kvs_row_component::default(); abi::KVS_MAX_COMPONENTS as usize];
        components[..self.components.len()].copy_from_slice(&self.components);
        let params = abi::kvs_decode_scatter_params {
            components,
            pairs: at,
            dst_bases: at + bases_at,
            ranks: at + ranks_at,
            entries: at + entries_at,
            num_entries: self.entries.len() as u64,
            state_entries: at + state_at,
            num_state_entries: self.state_entries.len() as u64,
            shifts: match self.mode {
                Mode::Direct => 0,
                Mode::Pack | Mode::Unpack => at + shifts_at,
            },
            src_limit: self.src_limit,
            end_token: self.end_token,
            num_pairs: self.pairs.len() as u32,
            num_kv_pairs: self.kv_pairs as u32,
            num_ranks: self.layout.ranks(),
            interleave: self.layout.interleave(),
            num_components: self.components.len() as u32,
            mode: self.mode.abi(),
            one_rank: u32::from(self.one_rank.is_some()),
            rank: self.one_rank.unwrap_or(0),
            ..Default::default()
        };
        (out, params)
    }

    /// Checks `src` and `dsts` are the spaces this plan was made for, in `backend`'s address
    /// space.
    fn check_spaces(
        &self,
        backend: &dyn Backend,
        src: &dyn BlockSpace,
        dsts: &[Arc<dyn BlockSpace>],
    ) -> Result<()> {
        if dsts.len() != self.dsts.len() {
            return Err(Error::InvalidArgument(format!(
                "a scatter planned for {} decode ranks used with {}",
                self.dsts.len(),
                dsts.len()
            )));
        }
        let sides = std::iter::once(("source", self.src, src)).chain(
            self.dsts
                .iter()
                .zip(dsts)
                .map(|(&d, s)| ("destination", d, s.as_ref())),
        );
        for (side, (id, _), space) in sides {
            if space.id() != id {
                return Err(Error::InvalidArgument(format!(
                    "scatter planned for {side} {id} used with {}",
                    space.id()
                )));
            }
            check_space(backend.address_space(), space.address_space(), side)?;
        }
        Ok(())
    }
}

/// Refuses destinations whose memory the scatter writes overlaps (two ranks given the same
/// pool, say): two tokens would race for one row. `moved` are the component indices of the
/// pairs; `extent(d, c)` the bytes from each layer's base of component `c` the scatter may write
/// on destination `d`.
fn check_disjoint(
    dsts: &[&dyn BlockSpace],
    moved: &[usize],
    extent: &dyn Fn(usize, usize) -> u64,
) -> Result<()> {
    let mut ranges: Vec<(u64, u64, usize)> = Vec::new();
    for (d, dst) in dsts.iter().enumerate() {
        for &c in moved {
            let bytes = extent(d, c);
            if bytes == 0 {
                // Holds nothing: overlaps nothing.
                continue;
            }
            for layer in 0..dst.layer_count(c) {
                let base = dst.base(c, layer);
                ranges.push((base, base.saturating_add(bytes), d));
            }
        }
    }
    ranges.sort_unstable();
    // The range reaching furthest so far, and its rank: a range starting before its end
    // overlaps it (two earlier ranges of different ranks reaching past this one's start would
    // have overlapped each other first).
    let mut furthest: Option<(u64, usize)> = None;
    for &(start, end, d) in &ranges {
        match furthest {
            Some((reach, owner)) if start < reach && owner != d => {
                return Err(Error::InvalidArgument(format!(
                    "decode ranks {} and {} were given overlapping memory",
                    owner.min(d),
                    owner.max(d)
                )))
            }
            Some((reach, _)) if reach >= end => {}
            _ => furthest = Some((end, d)),
        }
    }
    Ok(())
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

impl TableStore {
    /// Launches `plan` once: its tables uploaded (stream-ordered), then `kvs_decode_scatter`
    /// with grid `launch`. `src` and `dsts` must be the plan's spaces, in the store's address
    /// space; they are kept until the launch has run. Returns the launch's event, as
    /// [`TableStore::launch`] does (`None` when the plan moves nothing).
    pub fn launch_scatter(
        &mut self,
        plan: &DecodeScatterPlan,
        src: &Arc<dyn BlockSpace>,
        dsts: &[Arc<dyn BlockSpace>],
        launch: Launch,
    ) -> Result<Option<Event>> {
        plan.check_spaces(self.backend().as_ref(), src.as_ref(), dsts)?;
        if plan.is_empty() {
            return Ok(None);
        }
        let writes: Vec<&Arc<dyn BlockSpace>> = dsts.iter().collect();
        // Built with the tables, once their address is known; read by the launch after.
        let params = std::cell::Cell::new(None);
        let event = self.launch_built(
            plan.table_bytes(),
            |at| {
                let (bytes, p) = plan.tables(at);
                params.set(Some(p));
                bytes
            },
            &[src],
            &writes,
            |backend, _| {
                let p = params.get().ok_or_else(|| {
                    Error::InvalidArgument("scatter tables were not built".into())
                })?;
                // SAFETY: the pairs' bases are layers of the plan's spaces (checked to be these
                // and in the backend's address space), kept alive until the launch has run by
                // the store and their usages, which also order it after other streams' work on
                // them; every source page, rank page and the rows the tokens below the end
                // land on were checked against those spaces when the plan was built, and the
                // kernel re-checks them against the same limits; the tables are the store's
                // own device memory, just written in stream order, holding every pair, base,
                // rank, page and entry the parameters name.
                unsafe { backend.decode_scatter(p, launch) }
            },
        )?;
        Ok(Some(event))
    }
}
