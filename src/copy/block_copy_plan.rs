//! Block copies between block spaces as plain data: the only place a
//! `kvs_copy_blocks_params` and its pair table are built. Gathers and scatters between pools
//! and staging, P/D sends into a decode pool, and HiCache's kernel paths (direct, signalled,
//! staged relayouts) all describe what moves as a [`BlockCopyPlan`]; `copy::block_copy` uploads
//! and runs it.
//!
//! A plan is plain data with private fields, checked in full against both spaces when it is
//! built (every page in range, destinations distinct, same components) and immutable after.

use std::fmt;
use std::ops::Range;

use super::space::{check_same_components, BlockSpace, SpaceId};
use crate::abi;
use crate::backend::{check_space, AddressSpace, Backend, Pages};
use crate::error::{Error, Result};
use crate::geometry::Component;
use crate::index::{LocalPage, LogicalPage, ModelLayer};
use crate::shard::Placement;

/// Bytes of one `kvs_layer_pair` in a table.
const PAIR_BYTES: usize = std::mem::size_of::<abi::kvs_layer_pair>();

/// Which page of one side entry `j` of a copy addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PageSelection {
    /// Entry `j` is page `j` (a staging buffer filled in entry order).
    Positions,
    /// Entry `j` is local page `pages[j]` of the space.
    Local(Vec<LocalPage>),
    /// Entry `j` is logical page `pages[j]`: it moves only if `rank` owns it, to its local page
    /// `pages[j] / N`. Reserved pages `0..N` are refused.
    Logical {
        /// Logical pages.
        pages: Vec<LogicalPage>,
        /// Sharding of the pages.
        placement: Placement,
        /// The rank whose pages move.
        rank: u32,
    },
}

/// One side's checked page selection and the bound its pages respect.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PageList {
    selection: PageSelection,
    limit: u64,
}

impl PageList {
    /// The local pages entries `entries` name, for the usages: positions and logical pages (and
    /// a range past the list) count as the whole space.
    fn touched(&self, entries: Range<usize>) -> Pages {
        match &self.selection {
            PageSelection::Local(pages) => pages
                .get(entries)
                .map_or(Pages::All, |p| Pages::of(p.iter().map(|p| p.0))),
            PageSelection::Positions | PageSelection::Logical { .. } => Pages::All,
        }
    }

    fn new(
        selection: PageSelection,
        space: &dyn BlockSpace,
        entries: usize,
        side: &'static str,
        distinct: bool,
    ) -> Result<Self> {
        let limit = space.pages();
        match &selection {
            // Checked per launch: a staged transfer runs a long plan in windows of at most
            // `limit` entries (BlockCopy::run_entries).
            PageSelection::Positions => {}
            PageSelection::Local(pages) => {
                check_len(pages.len(), entries, side)?;
                if let Some(bad) = pages.iter().find(|p| p.0 >= limit) {
                    return Err(Error::OutOfRange {
                        what: "local page",
                        index: i64::try_from(bad.0).unwrap_or(i64::MAX),
                        limit,
                    });
                }
                if distinct {
                    check_distinct(pages.iter().map(|p| p.0), side)?;
                }
            }
            PageSelection::Logical {
                pages,
                placement,
                rank,
            } => {
                check_len(pages.len(), entries, side)?;
                placement.check_rank(*rank)?;
                let logical = placement.logical_pages(limit)?;
                for &page in pages {
                    if page.0 >= logical {
                        return Err(Error::OutOfRange {
                            what: "logical page",
                            index: i64::try_from(page.0).unwrap_or(i64::MAX),
                            limit: logical,
                        });
                    }
                    if placement.is_reserved(page) {
                        return Err(Error::ReservedPage {
                            page: page.0,
                            shard: placement.shard(),
                        });
                    }
                }
                if distinct {
                    check_distinct(pages.iter().map(|p| p.0), side)?;
                }
            }
        }
        Ok(Self { selection, limit })
    }

    /// Whether entry `j` moves as far as this side is concerned.
    fn moves(&self, j: usize) -> bool {
        match &self.selection {
            PageSelection::Positions | PageSelection::Local(_) => true,
            PageSelection::Logical {
                pages,
                placement,
                rank,
            } => placement.owner(pages[j]) == *rank,
        }
    }

    /// The kernel's view of this list, its ids at `ids` (0 when it has none).
    fn abi(&self, ids: u64) -> abi::kvs_page_list {
        let (kind, shard, rank) = match &self.selection {
            PageSelection::Positions => (abi::KVS_INDEX_POSITION, 1, 0),
            PageSelection::Local(_) => (abi::KVS_INDEX_LOCAL, 1, 0),
            PageSelection::Logical {
                placement, rank, ..
            } => (abi::KVS_INDEX_LOGICAL, placement.shard(), *rank),
        };
        abi::kvs_page_list {
            ids,
            limit: self.limit,
            kind,
            shard,
            rank,
            reserved: 0,
        }
    }

    /// The ids the kernel reads, as little-endian int64s appended to `out`.
    fn extend_ids(&self, out: &mut Vec<u8>) {
        match &self.selection {
            PageSelection::Positions => {}
            // Pages were checked below the space's page count, itself far below 2^63.
            PageSelection::Local(pages) => {
                out.extend(pages.iter().flat_map(|p| (p.0 as i64).to_le_bytes()))
            }
            PageSelection::Logical { pages, .. } => {
                out.extend(pages.iter().flat_map(|p| (p.0 as i64).to_le_bytes()))
            }
        }
    }

    fn has_ids(&self) -> bool {
        !matches!(self.selection, PageSelection::Positions)
    }
}

fn check_len(got: usize, entries: usize, side: &str) -> Result<()> {
    if got != entries {
        return Err(Error::InvalidArgument(format!(
            "{side}: {got} pages for {entries} entries"
        )));
    }
    Ok(())
}

/// Refuses a page listed twice: two entries would write one block, racing on the GPU, and one
/// position's data would be lost. A list in increasing order (what a fresh allocator hands out)
/// passes in one pass; any other is sorted, with no hashing on the hot path of planning every
/// chunk, and a repeat's two positions are found only once one is known.
pub(crate) fn check_distinct(
    pages: impl Iterator<Item = u64> + Clone,
    what: &'static str,
) -> Result<()> {
    if pages.clone().is_sorted_by(|a, b| a < b) {
        return Ok(());
    }
    let mut sorted: Vec<u64> = pages.clone().collect();
    sorted.sort_unstable();
    let Some(page) = sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]) else {
        return Ok(());
    };
    let mut at = pages
        .enumerate()
        .filter(|&(_, p)| p == page)
        .map(|(i, _)| i);
    let first = at.next().unwrap_or(0);
    Err(Error::DuplicatePage {
        what,
        page,
        first,
        second: at.next().unwrap_or(first),
    })
}

/// A block copy as plain data: what moves where, checked against both spaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCopyPlan {
    src: (SpaceId, AddressSpace),
    dst: (SpaceId, AddressSpace),
    /// Model layers of the cache (the index space of signals).
    pub(super) model_layers: usize,
    /// Per component index of the spaces: rows and strides on each side (rows merged when both
    /// sides are contiguous, so the kernel's hot path has no division).
    components: Vec<abi::kvs_block_component>,
    /// Bytes of one block of each component.
    block_bytes: Vec<u64>,
    /// Every (component, layer) moved; `signal` is the model layer.
    pub(super) pairs: Vec<abi::kvs_layer_pair>,
    pub(super) entries: usize,
    src_pages: PageList,
    dst_pages: PageList,
    moved: usize,
}

impl BlockCopyPlan {
    /// Plans copying `entries` pages of every component and layer from `src` to `dst`, pairs in
    /// component-then-layer order. Every page is checked against its space; destination pages
    /// must be distinct.
    pub fn new(
        src: &dyn BlockSpace,
        src_pages: PageSelection,
        dst: &dyn BlockSpace,
        dst_pages: PageSelection,
        entries: usize,
    ) -> Result<Self> {
        check_same_components(src.components(), dst.components())?;
        let src_pages = PageList::new(src_pages, src, entries, "source", false)?;
        let dst_pages = PageList::new(dst_pages, dst, entries, "destination", true)?;
        let mut components = Vec::new();
        let mut block_bytes = Vec::new();
        let mut pairs = Vec::new();
        let mut model_layers = 0;
        for (c, layout) in src.components().iter().enumerate() {
            let (s, d) = (src.side(c), dst.side(c));
            let row = layout.row_bytes as u64;
            let contiguous = s.row_stride == row && d.row_stride == row;
            components.push(abi::kvs_block_component {
                rows: if contiguous { 1 } else { layout.rows as u32 },
                row_bytes: if contiguous {
                    layout.block_bytes
                } else {
                    layout.row_bytes
                } as u32,
                src: s,
                dst: d,
            });
            block_bytes.push(layout.block_bytes as u64);
            for (l, &model_layer) in layout.model_layers.iter().enumerate() {
                model_layers = model_layers.max(model_layer.0 + 1);
                pairs.push(abi::kvs_layer_pair {
                    src: src.base(c, l),
                    dst: dst.base(c, l),
                    component: c as u32,
                    signal: model_layer.0 as u32,
                });
            }
        }
        let moved = (0..entries)
            .filter(|&j| src_pages.moves(j) && dst_pages.moves(j))
            .count();
        Ok(Self {
            src: (src.id(), src.address_space()),
            dst: (dst.id(), dst.address_space()),
            model_layers,
            components,
            block_bytes,
            pairs,
            entries,
            src_pages,
            dst_pages,
            moved,
        })
    }

    /// Keeps only the pairs of `components` (a P/D section: the latent KV, or the indexer
    /// state).
    pub fn only_components(mut self, src: &dyn BlockSpace, components: &[Component]) -> Self {
        let keep: Vec<bool> = src
            .components()
            .iter()
            .map(|c| components.contains(&c.component))
            .collect();
        self.pairs
            .retain(|p| keep.get(p.component as usize).copied().unwrap_or(false));
        self
    }

    /// Orders the pairs layer by layer (model layer 0's pairs first), so a launch finishes the
    /// layers roughly in order and each layer's pairs are one range ([`Self::layer_pairs`]).
    pub fn layer_major(mut self) -> Self {
        self.pairs.sort_by_key(|p| p.signal);
        self
    }

    /// Makes the pairs of each model layer `m` count towards the ready signal of `f(m)` (a
    /// HiCache load signals the MTP draft's layer with target layer 0); orders and per-layer
    /// ranges follow the signal.
    pub fn map_signals(mut self, f: impl Fn(ModelLayer) -> ModelLayer) -> Self {
        for p in &mut self.pairs {
            let to = f(ModelLayer(p.signal as usize)).0;
            if to < self.model_layers {
                p.signal = to as u32;
            }
        }
        self
    }

    /// Keeps only the pairs of model layers `keep` accepts (one layer during its forward).
    pub fn retain_layers(mut self, keep: impl Fn(ModelLayer) -> bool) -> Self {
        self.pairs.retain(|p| keep(ModelLayer(p.signal as usize)));
        self
    }

    /// Entries (pages) of the copy.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Entries that actually move (owned on every logical side).
    pub fn moved_entries(&self) -> usize {
        self.moved
    }

    /// (component, layer) pairs each entry moves.
    pub fn pairs(&self) -> usize {
        self.pairs.len()
    }

    /// (page, layer pair) blocks of the copy: the units `kvs_copy_blocks` deals to its warps
    /// ([`Method::for_blocks`](crate::copy::Method::for_blocks) picks a grid from them).
    pub fn blocks(&self) -> u64 {
        (self.entries as u64).saturating_mul(self.pairs.len() as u64)
    }

    /// Bytes of one entry across every pair.
    pub fn entry_bytes(&self) -> u64 {
        self.pairs
            .iter()
            .map(|p| self.block_bytes[p.component as usize])
            .sum()
    }

    /// Bytes the copy moves (each moved byte is read once and written once).
    pub fn bytes(&self) -> u64 {
        self.moved as u64 * self.entry_bytes()
    }

    /// The range of pairs of each model layer (empty for a layer the copy does not move); the
    /// ranges are exact once the plan is [`Self::layer_major`].
    pub fn layer_pairs(&self) -> Vec<Range<usize>> {
        let mut out = vec![0..0; self.model_layers];
        for (k, p) in self.pairs.iter().enumerate() {
            let r = &mut out[p.signal as usize];
            if r.start == r.end {
                *r = k..k + 1;
            } else {
                r.end = k + 1;
            }
        }
        out
    }

    /// Units each ready signal counts once the copy is done: per model layer,
    /// `entries x pairs of that layer` (every unit counts, moved or skipped).
    pub fn signal_units(&self) -> Result<Vec<u32>> {
        let mut t = vec![0u32; self.model_layers];
        for p in &self.pairs {
            let slot = &mut t[p.signal as usize];
            *slot = u32::try_from(self.entries)
                .ok()
                .and_then(|e| slot.checked_add(e))
                .filter(|&units| units < 1 << 31)
                .ok_or_else(|| {
                    Error::overflow(format!(
                        "ready-counter units of model layer {} ({} entries)",
                        p.signal, self.entries
                    ))
                })?;
        }
        Ok(t)
    }

    /// Model layers of the cache the plan was made for.
    pub fn model_layers(&self) -> usize {
        self.model_layers
    }

    /// Bytes of device memory the plan's tables take (the pair table, then the id lists).
    pub fn table_bytes(&self) -> usize {
        let ids = usize::from(self.src_pages.has_ids()) + usize::from(self.dst_pages.has_ids());
        PAIR_BYTES * self.pairs.len() + 8 * ids * self.entries
    }

    /// The pair table, then the source ids, then the destination ids, as the kernel reads them;
    /// and the offsets of the two id lists in it.
    pub(super) fn tables(&self) -> (Vec<u8>, u64, u64) {
        let mut bytes = Vec::with_capacity(PAIR_BYTES * self.pairs.len() + 16 * self.entries);
        for p in &self.pairs {
            bytes.extend_from_slice(&p.src.to_le_bytes());
            bytes.extend_from_slice(&p.dst.to_le_bytes());
            bytes.extend_from_slice(&p.component.to_le_bytes());
            bytes.extend_from_slice(&p.signal.to_le_bytes());
        }
        let src_at = bytes.len() as u64;
        self.src_pages.extend_ids(&mut bytes);
        let dst_at = bytes.len() as u64;
        self.dst_pages.extend_ids(&mut bytes);
        (bytes, src_at, dst_at)
    }

    /// The pages entries `entries` touch on the source and the destination side, for the
    /// usages ([`Pages::All`] where the plan names positions or logical pages).
    pub(crate) fn touched(&self, entries: Range<usize>) -> (Pages, Pages) {
        (
            self.src_pages.touched(entries.clone()),
            self.dst_pages.touched(entries),
        )
    }

    /// The launch parameters of the whole copy with its tables carried inline
    /// (`kvs_copy_blocks_inline`: the same bytes as [`Self::tables`], at byte offsets of the
    /// parameters' own table), or `None` when the tables take more than
    /// [`abi::KVS_COPY_INLINE_BYTES`] and must be uploaded.
    pub(super) fn inline_params(&self) -> Option<abi::kvs_copy_blocks_inline_params> {
        if self.table_bytes() > abi::KVS_COPY_INLINE_BYTES as usize {
            return None;
        }
        let (bytes, src_at, dst_at) = self.tables();
        let mut table = [0u64; abi::KVS_COPY_INLINE_BYTES as usize / 8];
        // Pairs (24 bytes) and ids (8) are whole words, little-endian as the kernel reads them.
        for (word, b) in table.iter_mut().zip(bytes.chunks_exact(8)) {
            *word = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        }
        Some(abi::kvs_copy_blocks_inline_params {
            copy: self.params(0, (src_at, dst_at), 0..self.pairs.len(), 0..self.entries, 0),
            table,
        })
    }

    /// The launch parameters, tables at `tables`, for pairs `pairs` and entries `entries`.
    pub(super) fn params(
        &self,
        tables: u64,
        (src_at, dst_at): (u64, u64),
        pairs: Range<usize>,
        entries: Range<usize>,
        signals: u64,
    ) -> abi::kvs_copy_blocks_params {
        let mut components =
            [abi::kvs_block_component::default(); abi::KVS_MAX_COMPONENTS as usize];
        components[..self.components.len()].copy_from_slice(&self.components);
        let list = |list: &PageList, at: u64| {
            let ids = if list.has_ids() {
                tables + at + 8 * entries.start as u64
            } else {
                0
            };
            list.abi(ids)
        };
        abi::kvs_copy_blocks_params {
            components,
            pairs: tables + (PAIR_BYTES * pairs.start) as u64,
            num_pages: entries.len() as u64,
            src_pages: list(&self.src_pages, src_at),
            dst_pages: list(&self.dst_pages, dst_at),
            signals,
            num_pairs: pairs.len() as u32,
            num_components: self.components.len() as u32,
            work: abi::kvs_work_queue::default(),
            status: abi::kvs_status::default(),
        }
    }

    /// Checks a launch of `entries` entries fits every positions side (position `j` of a launch
    /// is page `j`).
    pub(super) fn check_window(&self, entries: usize) -> Result<()> {
        for list in [&self.src_pages, &self.dst_pages] {
            if !list.has_ids() && entries as u64 > list.limit {
                return Err(Error::OutOfRange {
                    what: "staging position",
                    index: entries as i64 - 1,
                    limit: list.limit,
                });
            }
        }
        Ok(())
    }

    /// Checks `src` and `dst` are the spaces this plan was made for, and that `backend` runs in
    /// their address space.
    pub(super) fn check_spaces(
        &self,
        backend: &dyn Backend,
        src: &dyn BlockSpace,
        dst: &dyn BlockSpace,
    ) -> Result<()> {
        for (side, (id, _), space) in [("source", self.src, src), ("destination", self.dst, dst)] {
            if space.id() != id {
                return Err(Error::InvalidArgument(format!(
                    "copy planned for {side} {id} used with {}",
                    space.id()
                )));
            }
            check_space(backend.address_space(), space.address_space(), side)?;
        }
        Ok(())
    }
}

impl fmt::Display for BlockCopyPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} entries ({} move) x {} layer pairs, {} bytes",
            self.entries,
            self.moved,
            self.pairs.len(),
            self.bytes()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::check_distinct;
    use crate::error::Error;

    /// Increasing lists take the one-pass path, any other the sort; a repeat is named by its
    /// page and its first two positions either way.
    #[test]
    fn check_distinct_names_the_first_repeat_of_any_order() {
        for pages in [&[][..], &[7], &[1, 2, 9, 40], &[40, 9, 2, 1], &[3, 1, 2]] {
            assert!(
                check_distinct(pages.iter().copied(), "page").is_ok(),
                "{pages:?}"
            );
        }
        for (pages, (page, first, second)) in [
            (&[1, 2, 3, 3][..], (3, 2, 3)),
            (&[5, 1, 5, 1, 5], (1, 1, 3)),
            (&[9, 4, 8, 4], (4, 1, 3)),
        ] {
            let e = check_distinct(pages.iter().copied(), "page").unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::DuplicatePage { what: "page", page: p, first: f, second: s }
                        if (p, f, s) == (page, first, second)
                ),
                "{pages:?}: {e}"
            );
        }
    }
}
