//! The plan's checks (the module docs list them): the destinations and the end token, the
//! components' row formats, the sections' entries, each rank's pages, the destinations' memory
//! disjoint, the spaces a launch is given.

use std::sync::Arc;

use super::super::block_copy_plan::check_distinct;
use super::super::space::{check_same_components, BlockSpace};
use super::{DecodeScatterPlan, Mode, ScatterRank, ScatterSection, Targets, PAGE};
use crate::abi;
use crate::backend::{check_space, Backend};
use crate::error::{Error, Result};
use crate::geometry::{INDEXER_PAGE_BYTES, INDEXER_ROW_BYTES, PAGE_SIZE};
use crate::index::LocalPage;
use crate::shard::DecodeLayout;

/// Checks the destinations are one per rank the tables hold, and the end token is one the
/// kernel can address.
pub(super) fn check_targets(
    dsts: &[&dyn BlockSpace],
    layout: DecodeLayout,
    end_token: u64,
    targets: &Targets,
) -> Result<()> {
    let table_ranks = match *targets {
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
    Ok(())
}

/// The kernel's row format of a component laid out as `layout` is.
pub(super) fn row_format(
    layout: &crate::geometry::ComponentLayout,
) -> Result<abi::kvs_row_component> {
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

/// The row format of each component of `src`, checked to be laid out alike and packed on
/// every side.
pub(super) fn row_formats(
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

/// Checks every section's entries: in the source of `src_limit` pages (an unpack reads none),
/// sequence pages distinct and addressable.
pub(super) fn check_entries(
    src_limit: u64,
    sections: [&ScatterSection; 2],
    mode: Mode,
) -> Result<()> {
    for section in sections {
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
    Ok(())
}

/// Checks one rank's page lists: in its pool of `limit` pages, distinct, as many as the rows of
/// each used section reach (`needed`), the two lists of one length where both are given.
pub(super) fn check_rank_pages(
    d: u32,
    rank: &ScatterRank,
    limit: u64,
    needed: [u64; 2],
) -> Result<()> {
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

/// Checks the memory each destination's pages can be written in is disjoint from every other
/// destination's ([`check_disjoint`]): a dense region holds each section's components at the
/// section's pages.
pub(super) fn check_written_disjoint(
    src: &dyn BlockSpace,
    dsts: &[&dyn BlockSpace],
    pairs: &[abi::kvs_decode_pair],
    kv: &ScatterSection,
    targets: &Targets,
    ranks: &[(Vec<LocalPage>, Vec<LocalPage>, u64)],
    dense: &[[u64; 2]],
) -> Result<()> {
    let layouts = src.components();
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
        let Targets::Dense = *targets else {
            return ranks[d].2.saturating_mul(block);
        };
        let rows = dense[d][usize::from(!kv_components.contains(&c))];
        if layouts[c].component.is_indexer() {
            rows.div_ceil(PAGE).saturating_mul(block)
        } else {
            rows.saturating_mul(layouts[c].row_bytes as u64)
        }
    };
    check_disjoint(dsts, &moved, &extent)
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
    // Each destination's written ranges: (start, end, rank), one per (component, layer).
    let ranges = |d: usize| {
        let dst = dsts[d];
        moved
            .iter()
            .map(move |&c| (c, extent(d, c)))
            // A component holding nothing overlaps nothing.
            .filter(|&(_, bytes)| bytes != 0)
            .flat_map(move |(c, bytes)| {
                (0..dst.layer_count(c)).map(move |layer| {
                    let base = dst.base(c, layer);
                    (base, base.saturating_add(bytes), d)
                })
            })
    };
    // Every destination's ranges within one span (its own pool, as a rule): spans apart are
    // ranges apart, for a sort of one span a rank instead of one range a (component, layer)
    // and rank on every chunk's plan.
    let mut spans: Vec<(u64, u64, usize)> = (0..dsts.len())
        .filter_map(|d| ranges(d).reduce(|a, b| (a.0.min(b.0), a.1.max(b.1), d)))
        .collect();
    if first_overlap(&mut spans).is_none() {
        return Ok(());
    }
    let mut all: Vec<(u64, u64, usize)> = (0..dsts.len()).flat_map(ranges).collect();
    match first_overlap(&mut all) {
        Some((a, b)) => Err(Error::InvalidArgument(format!(
            "decode ranks {} and {} were given overlapping memory",
            a.min(b),
            a.max(b)
        ))),
        None => Ok(()),
    }
}

/// Sorts `ranges` (start, end, rank) and names the ranks of the first two of different ranks
/// that overlap.
fn first_overlap(ranges: &mut [(u64, u64, usize)]) -> Option<(usize, usize)> {
    ranges.sort_unstable();
    // The range reaching furthest so far, and its rank: a range starting before its end
    // overlaps it (two earlier ranges of different ranks reaching past this one's start would
    // have overlapped each other first).
    let mut furthest: Option<(u64, usize)> = None;
    for &(start, end, d) in ranges.iter() {
        match furthest {
            Some((reach, owner)) if start < reach && owner != d => return Some((owner, d)),
            Some((reach, _)) if reach >= end => {}
            _ => furthest = Some((end, d)),
        }
    }
    None
}

impl DecodeScatterPlan {
    /// Checks `src` and `dsts` are the spaces this plan was made for, in `backend`'s address
    /// space.
    pub(super) fn check_spaces(
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
