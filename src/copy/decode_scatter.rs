//! Scatters into a decode context-parallel layout as plain data (docs/dcp.md, "The kernel"): the
//! only builder of `kvs_decode_scatter_params` and its tables. A [`DecodeScatterPlan`] names the
//! source pages of one prefill rank's chunk (by sequence page) and every decode rank's pages of
//! the request; `kvs_decode_scatter` (cuda/decode_scatter.cu, or its CPU twin) places each token's
//! row by the [`DecodeLayout`] and moves it, every (component, layer) and every decode rank in
//! one launch ([`TableStore::launch_scatter`]).
//!
//! A plan is checked in full against the source and every destination when it is built: every
//! source page in its space, sequence pages distinct, every rank's pages in its space and
//! distinct, every row a token below the end can land on registered by its rank, the
//! destinations' memory disjoint, every component packed on every side. The kernel re-checks
//! the indices it reads against the same limits.

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
    /// (local source page, sequence page) of each page moved; sequence pages distinct.
    pub entries: Vec<(LocalPage, u64)>,
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

/// A scatter as plain data, checked against its source and destinations (module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeScatterPlan {
    src: (SpaceId, AddressSpace),
    dsts: Vec<(SpaceId, AddressSpace)>,
    layout: DecodeLayout,
    end_token: u64,
    src_limit: u64,
    /// Row format of each component index of the spaces.
    components: Vec<abi::kvs_row_component>,
    /// The latent section's pairs, then the state section's.
    pairs: Vec<abi::kvs_decode_pair>,
    kv_pairs: usize,
    /// Base of pair `k` on rank `d` at `k * ranks + d`.
    dst_bases: Vec<u64>,
    /// Per rank: its page ids for each section, and its pool's pages.
    ranks: Vec<(Vec<LocalPage>, Vec<LocalPage>, u64)>,
    entries: Vec<abi::kvs_decode_entry>,
    state_entries: Vec<abi::kvs_decode_entry>,
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

/// The row format of every component, checked the same in `src` and every destination, and
/// packed (a decode scatter moves packed blocks).
fn row_formats(
    src: &dyn BlockSpace,
    dsts: &[&dyn BlockSpace],
) -> Result<Vec<abi::kvs_row_component>> {
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
    Ok(components)
}

/// Every section's entries: in the source, sequence pages distinct and addressable.
fn check_entries(src_limit: u64, sections: [&ScatterSection; 2]) -> Result<()> {
    for section in sections {
        if let Some(&(bad, _)) = section.entries.iter().find(|(p, _)| p.0 >= src_limit) {
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
    Ok(())
}

/// Pairs: the latent section's components, then the state section's, every stored layer;
/// the destinations' bases of each pair, rank by rank; how many pairs are the latent section's.
fn pairs_of(
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

/// Decode rank `d`'s pages (`limit` in its pool): in the pool, distinct, and covering every
/// row a token of the sections can land on (up to `reach`, of the sections `used`).
fn check_rank(
    layout: DecodeLayout,
    d: u32,
    rank: &ScatterRank,
    limit: u64,
    reach: (u64, u64),
    used: (bool, bool),
) -> Result<(Vec<LocalPage>, Vec<LocalPage>, u64)> {
    for (what, pages, reach, used) in [
        ("destination page", &rank.pages, reach.0, used.0),
        ("destination state page", &rank.state_pages, reach.1, used.1),
    ] {
        if let Some(bad) = pages.iter().find(|p| p.0 >= limit) {
            return Err(Error::OutOfRange {
                what: "decode rank page",
                index: i64::try_from(bad.0).unwrap_or(i64::MAX),
                limit,
            });
        }
        check_distinct(pages.iter().map(|p| p.0), what)?;
        let needed = if used { layout.pages_on(d, reach) } else { 0 };
        if (pages.len() as u64) < needed {
            return Err(Error::InvalidArgument(format!(
                "decode rank {d} registered {} {what}s; tokens up to {reach} need {needed} on it",
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
    Ok((rank.pages.clone(), rank.state_pages.clone(), limit))
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
        if dsts.len() != m || ranks.len() != m {
            return Err(Error::InvalidArgument(format!(
                "a scatter over {layout}: {} destinations and {} ranks' pages",
                dsts.len(),
                ranks.len()
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
        let components = row_formats(src, dsts)?;
        let src_limit = src.pages();
        check_entries(src_limit, [&kv, &state])?;
        let (pairs, dst_bases, kv_pairs) = pairs_of(src, dsts, &kv, &state)?;
        let (kv_rows, kv_reach) = reach(&kv.entries, end_token);
        let (state_rows, state_reach) = reach(&state.entries, end_token);
        let mut rank_pages = Vec::with_capacity(m);
        for (d, (rank, dst)) in (0u32..).zip(ranks.iter().zip(dsts)) {
            let used = (!kv.components.is_empty(), !state.components.is_empty());
            rank_pages.push(check_rank(
                layout,
                d,
                rank,
                dst.pages(),
                (kv_reach, state_reach),
                used,
            )?);
        }
        check_disjoint(dsts)?;
        let row_bytes = |section: &ScatterSection| -> u64 {
            section
                .components
                .iter()
                .filter_map(|&c| layouts.iter().position(|l| l.component == c))
                .map(|c| u64::from(components[c].row_bytes) * layouts[c].layers() as u64)
                .sum()
        };
        let bytes = kv_rows
            .mul_or(row_bytes(&kv), || "bytes of a scatter".into())?
            .add_or(
                state_rows.mul_or(row_bytes(&state), || "bytes of a scatter".into())?,
                || "bytes of a scatter".into(),
            )?;
        let entries = |section: &ScatterSection| {
            section
                .entries
                .iter()
                .map(|&(page, position)| abi::kvs_decode_entry {
                    // Below the source's page count, itself far below 2^63.
                    page: page.0 as i64,
                    position,
                })
                .collect()
        };
        Ok(Self {
            src: (src.id(), src.address_space()),
            dsts: dsts.iter().map(|d| (d.id(), d.address_space())).collect(),
            layout,
            end_token,
            src_limit,
            components,
            kv_pairs,
            dst_bases,
            ranks: rank_pages,
            entries: if kv.components.is_empty() {
                Vec::new()
            } else {
                entries(&kv)
            },
            state_entries: if state.components.is_empty() {
                Vec::new()
            } else {
                entries(&state)
            },
            pairs,
            bytes,
        })
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
    }

    /// The tables at device address `at`, and the launch parameters that point into them:
    /// pairs, destination bases, rank descriptors, each rank's page lists, entries, state
    /// entries, little-endian as the kernel reads them.
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
            src_limit: self.src_limit,
            end_token: self.end_token,
            num_pairs: self.pairs.len() as u32,
            num_kv_pairs: self.kv_pairs as u32,
            num_ranks: self.layout.ranks(),
            interleave: self.layout.interleave(),
            num_components: self.components.len() as u32,
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

/// Refuses destinations whose layers overlap (two ranks given the same pool, say): two tokens
/// would race for one row.
fn check_disjoint(dsts: &[&dyn BlockSpace]) -> Result<()> {
    let mut ranges: Vec<(u64, u64, usize)> = Vec::new();
    for (d, dst) in dsts.iter().enumerate() {
        for (c, l) in dst.components().iter().enumerate() {
            let bytes = dst.pages().saturating_mul(l.block_bytes as u64);
            for layer in 0..dst.layer_count(c) {
                let base = dst.base(c, layer);
                ranges.push((base, base.saturating_add(bytes), d));
            }
        }
    }
    ranges.sort_unstable();
    match ranges
        .windows(2)
        .find(|w| w[1].0 < w[0].1 && w[0].2 != w[1].2)
    {
        Some(w) => Err(Error::InvalidArgument(format!(
            "decode ranks {} and {} were given overlapping memory",
            w[0].2.min(w[1].2),
            w[0].2.max(w[1].2)
        ))),
        None => Ok(()),
    }
}

impl fmt::Display for DecodeScatterPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "scatter into {}: {} + {} pages x {} + {} layer pairs up to token {}, {} bytes",
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
