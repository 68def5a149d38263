//! Gather plans of a CP prefill batch (docs/design.md, "Prefill"), as SGLang builds them: which
//! cached prefix pages each rank contributes to the per-layer all-gather, where every gathered
//! page lands in the attention scratch, and the scratch page table (logical page -> scratch
//! page) the attention kernel reads. Pure data, identical on every rank, checked in full before
//! it is built.
//!
//! With page size 64, N ranks, and request `i` holding a page-aligned cached prefix of `K_i`
//! pages followed by the pages of its current chunk:
//!
//! - the prefix region of the scratch holds `block = sum_i ceil(K_i / N)` pages per owner,
//!   owner-major: a prefix page owned by rank `o` lands on scratch page `o * block + k`, `k` its
//!   index among the batch's prefix pages of owner `o` ordered by local page;
//! - chunk page `j` of the batch (requests in order, each request's chunk pages in chain order)
//!   lands on scratch page `max_prefix_tokens / 64 + j`;
//! - every other logical page maps to the trash page, the scratch's last;
//! - rank `o`'s send list is its prefix pages' local pages ascending, padded with local page 0
//!   to `block` entries, so an all-gather of the N send buffers (rank-major) fills exactly the
//!   owner-major prefix region.
//!
//! A prefix page several requests of the batch share (a common cached prefix) is one page of
//! its owner's list: it is gathered once and the table maps it once. Owners must be cyclic along
//! every chain: position `P` of a chain with start owner `b` is owned by `(b + P) % N`, or the
//! per-owner counts (and the region size) would not hold.
//!
//! The pack of a send list into a rank's contiguous send buffer is a block copy of the copy
//! layer ([`GatherPlan::pack_plan`]); the table is built by [`GatherPlan::page_table`] on the
//! CPU and by `kvs_scratch_table` on a backend (`crate::copy::ScratchTable`).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt;

use crate::error::{Checked, Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::index::{LocalPage, LogicalPage};
use crate::shard::Placement;

const PAGE: u64 = PAGE_SIZE as u64;

/// The pages of one per-layer scratch slot: `[prefix region | chunk region | trash page]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScratchLayout {
    prefix_pages: u64,
    chunk_pages: u64,
}

impl ScratchLayout {
    /// The slot of a budget whose prefix region holds `max_prefix_tokens` tokens (a multiple of
    /// 64: `crate::pool::Budget::max_prefix_tokens`) and whose chunk region holds
    /// `chunk_tokens` tokens, rounded up to whole pages. Its rows equal the budget's
    /// `scratch_rows` for the same chunk size.
    pub fn new(max_prefix_tokens: u64, chunk_tokens: u64) -> Result<Self> {
        if max_prefix_tokens % PAGE != 0 {
            return Err(Error::InvalidArgument(format!(
                "a prefix region of {max_prefix_tokens} tokens is not whole pages of {PAGE}"
            )));
        }
        let layout = Self {
            prefix_pages: max_prefix_tokens / PAGE,
            chunk_pages: chunk_tokens.div_ceil(PAGE),
        };
        // Every row index and table entry must fit an int64 (the kernels' index type).
        let rows = layout
            .prefix_pages
            .add_or(layout.chunk_pages, || "scratch pages".into())?
            .add_or(1, || "scratch pages".into())?
            .mul_or(PAGE, || "scratch rows".into())?;
        if i64::try_from(rows).is_err() {
            return Err(Error::overflow(format!("{rows} scratch rows as an int64")));
        }
        Ok(layout)
    }

    /// Pages of the prefix region: `max_prefix_tokens / 64`, the first chunk page.
    pub fn prefix_pages(&self) -> u64 {
        self.prefix_pages
    }

    /// Pages of the chunk region.
    pub fn chunk_pages(&self) -> u64 {
        self.chunk_pages
    }

    /// The trash page: the slot's last page, what every unmapped logical page maps to.
    pub fn trash_page(&self) -> u64 {
        self.prefix_pages + self.chunk_pages
    }

    /// Pages of the slot, the trash page included.
    pub fn pages(&self) -> u64 {
        self.trash_page() + 1
    }

    /// Rows of the slot.
    pub fn rows(&self) -> u64 {
        self.pages() * PAGE
    }
}

/// One request of a batch as the gather sees it: its chain's start owner, its cached prefix
/// (chain positions `0..K`) and its current chunk's pages (positions `K..`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherRequest<'a> {
    /// Owner of the chain's position 0.
    pub start_owner: u32,
    /// Logical pages of the cached prefix, in chain order.
    pub prefix: &'a [LogicalPage],
    /// Logical pages of the current chunk, in chain order, right after the prefix.
    pub chunk: &'a [LogicalPage],
}

/// A batch's gather plan: per rank its send list, per mapped logical page its scratch page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherPlan {
    placement: Placement,
    layout: ScratchLayout,
    logical_pages: u64,
    block: u64,
    /// The batch's distinct prefix pages as (owner, local page), ascending: each owner's run is
    /// its send list before padding. Nothing is kept per rank, so a plan's size follows the
    /// batch, not the shard size.
    prefix: Vec<(u32, LocalPage)>,
    /// Every mapped logical page and its scratch page, ascending by logical page.
    pages: Vec<LogicalPage>,
    scratch: Vec<u64>,
    /// Chunk pages of the batch.
    chunk_count: usize,
}

/// Where a page was first seen while checking a batch: its flat position over the batch's
/// pages, its request, and whether it is a chunk page.
#[derive(Debug, Clone, Copy)]
struct Seen {
    position: usize,
    request: usize,
    chunk: bool,
}

/// An empty vector with room for `n` values, or an [`Error::OutOfMemory`]: sizes come from
/// callers (a shard size, a table length), and a failed allocation must not abort.
fn room<T>(n: u64, what: &str) -> Result<Vec<T>> {
    let oom = || Error::OutOfMemory {
        what: what.to_string(),
        bytes: n.saturating_mul(std::mem::size_of::<T>() as u64),
        memory: "host",
    };
    let n = usize::try_from(n).map_err(|_| oom())?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| oom())?;
    Ok(v)
}

/// `n` copies of `value`, or an [`Error::OutOfMemory`].
fn filled<T: Clone>(n: u64, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = room(n, what)?;
    // Fits: `room` reserved `n` elements, so `n` is a usize.
    v.resize(n as usize, value);
    Ok(v)
}

impl GatherPlan {
    /// Plans the gather of `requests` for a shard group of `placement` whose logical index
    /// space holds `logical_pages` pages (the page table's length), into scratch slots shaped
    /// `layout`. Checks every page first, identically on every rank: in range, not a reserved
    /// padding page, owned along its chain's rotation, chunk pages distinct from every other
    /// page of the batch, no page twice in one chain; then that the batch fits the prefix and
    /// chunk regions ([`Error::ScratchOverflow`]).
    pub fn new(
        placement: Placement,
        layout: ScratchLayout,
        logical_pages: u64,
        requests: &[GatherRequest<'_>],
    ) -> Result<Self> {
        let shard = u64::from(placement.shard());
        let mut block = 0u64;
        let mut seen: HashMap<u64, Seen> = HashMap::new();
        let mut prefix: Vec<(u32, LocalPage)> = Vec::new();
        let mut chunk_pages = Vec::new();
        let mut position = 0usize;
        for (request, r) in requests.iter().enumerate() {
            placement.check_rank(r.start_owner)?;
            let k = r.prefix.len() as u64;
            block = block.add_or(k.div_ceil(shard), || {
                format!("prefix pages per owner of request {request}")
            })?;
            let chain = r.prefix.iter().map(|&p| (p, false));
            for (at, (page, chunk)) in chain.chain(r.chunk.iter().map(|&p| (p, true))).enumerate() {
                check_page(placement, logical_pages, r.start_owner, at, page)?;
                let this = Seen {
                    position,
                    request,
                    chunk,
                };
                match seen.entry(page.0) {
                    // A prefix page shared by the prefixes of two requests is gathered once.
                    Entry::Occupied(first)
                        if !chunk && !first.get().chunk && first.get().request != request => {}
                    Entry::Occupied(first) => {
                        return Err(Error::DuplicatePage {
                            what: "gathered logical page",
                            page: page.0,
                            first: first.get().position,
                            second: position,
                        })
                    }
                    Entry::Vacant(slot) => {
                        slot.insert(this);
                        if chunk {
                            chunk_pages.push(page);
                        } else {
                            prefix.push((placement.owner(page), placement.local(page)));
                        }
                    }
                }
                position += 1;
            }
        }
        let prefix_needed = block.mul_or(shard, || {
            format!("prefix region of {block} pages per owner")
        })?;
        if prefix_needed > layout.prefix_pages {
            return Err(Error::ScratchOverflow {
                region: "prefix",
                needed: prefix_needed.saturating_mul(PAGE),
                limit: layout.prefix_pages * PAGE,
            });
        }
        let chunk_needed = chunk_pages.len() as u64;
        if chunk_needed > layout.chunk_pages {
            return Err(Error::ScratchOverflow {
                region: "chunk",
                needed: chunk_needed.saturating_mul(PAGE),
                limit: layout.chunk_pages * PAGE,
            });
        }
        prefix.sort_unstable();
        let mut mapped: Vec<(LogicalPage, u64)> =
            room(seen.len() as u64, "the gather plan's page map")?;
        let mut k = 0u64;
        for (i, &(owner, local)) in prefix.iter().enumerate() {
            k = match i.checked_sub(1).map(|before| prefix[before].0) {
                Some(previous) if previous == owner => k + 1,
                _ => 0,
            };
            // At most ceil(K_i / N) prefix pages of each request belong to one owner (the
            // rotation was checked above), so an owner's distinct pages fit its block.
            if k >= block {
                return Err(Error::InvalidArgument(format!(
                    "owner {owner} holds more prefix pages of the batch than its block of {block}"
                )));
            }
            // In range: the page was checked below `logical_pages`, and the scratch page lies
            // in the prefix region, which was checked to hold `N * block` pages.
            let logical = local.0 * shard + u64::from(owner);
            mapped.push((LogicalPage(logical), u64::from(owner) * block + k));
        }
        for (j, &page) in chunk_pages.iter().enumerate() {
            mapped.push((page, layout.prefix_pages + j as u64));
        }
        mapped.sort_unstable_by_key(|&(page, _)| page);
        let (pages, scratch) = mapped.into_iter().unzip();
        Ok(Self {
            placement,
            layout,
            logical_pages,
            block,
            prefix,
            pages,
            scratch,
            chunk_count: chunk_pages.len(),
        })
    }

    /// Sharding of the group.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The scratch slot's shape.
    pub fn layout(&self) -> ScratchLayout {
        self.layout
    }

    /// Logical pages of the group: the page table's length.
    pub fn logical_pages(&self) -> u64 {
        self.logical_pages
    }

    /// Pages per owner in the prefix region: `sum_i ceil(K_i / N)`, the length of every send
    /// list.
    pub fn block(&self) -> u64 {
        self.block
    }

    /// Pages the all-gather fills: `N * block`, the start of the prefix region.
    pub fn gathered_pages(&self) -> u64 {
        // Fits: checked against the prefix region when the plan was made.
        self.block * u64::from(self.placement.shard())
    }

    /// Rank `rank`'s send list: its owned prefix pages' local pages ascending, padded with
    /// local page 0 to [`Self::block`] entries.
    pub fn send_list(&self, rank: u32) -> Result<Vec<LocalPage>> {
        let owned = self.owned(rank)?;
        let mut list = room(self.block, "a gather send list")?;
        list.extend(owned.iter().map(|&(_, local)| local));
        // Fits: `room` reserved `block` entries, at least the owned ones.
        list.resize(self.block as usize, LocalPage(0));
        Ok(list)
    }

    /// How many entries of rank `rank`'s send list are its pages (the rest is padding).
    pub fn owned_pages(&self, rank: u32) -> Result<usize> {
        self.owned(rank).map(<[_]>::len)
    }

    /// Rank `rank`'s run of the sorted prefix pages.
    fn owned(&self, rank: u32) -> Result<&[(u32, LocalPage)]> {
        self.placement.check_rank(rank)?;
        let start = self.prefix.partition_point(|&(owner, _)| owner < rank);
        let end = self.prefix.partition_point(|&(owner, _)| owner <= rank);
        Ok(&self.prefix[start..end])
    }

    /// Distinct prefix pages of the batch.
    pub fn prefix_pages(&self) -> usize {
        self.prefix.len()
    }

    /// Chunk pages of the batch.
    pub fn chunk_pages(&self) -> usize {
        self.chunk_count
    }

    /// Every mapped logical page, ascending (what `kvs_scratch_table` searches).
    pub fn mapped_pages(&self) -> &[LogicalPage] {
        &self.pages
    }

    /// The scratch page of each of [`Self::mapped_pages`].
    pub fn mapped_scratch_pages(&self) -> &[u64] {
        &self.scratch
    }

    /// The scratch page logical page `page` maps to: its place in the prefix or chunk region,
    /// else the trash page.
    pub fn scratch_page(&self, page: LogicalPage) -> u64 {
        match self.pages.binary_search(&page) {
            Ok(i) => self.scratch[i],
            Err(_) => self.layout.trash_page(),
        }
    }

    /// The scratch page table: for every logical page of the group, its scratch page (the
    /// trash page when unmapped), as the int64s the attention kernel and `kvs_scratch_rows`
    /// read.
    pub fn page_table(&self) -> Result<Vec<i64>> {
        // Fits: the layout's rows fit an int64.
        let mut table = filled(
            self.logical_pages,
            self.layout.trash_page() as i64,
            "a scratch page table",
        )?;
        for (page, &scratch) in self.pages.iter().zip(&self.scratch) {
            // In range: every page was checked below `logical_pages`.
            table[page.0 as usize] = scratch as i64;
        }
        Ok(table)
    }
}

/// Checks page `page` at chain position `at` of a chain starting at owner `start_owner`.
fn check_page(
    placement: Placement,
    logical_pages: u64,
    start_owner: u32,
    at: usize,
    page: LogicalPage,
) -> Result<()> {
    if page.0 >= logical_pages {
        return Err(Error::OutOfRange {
            what: "gathered logical page",
            index: i64::try_from(page.0).unwrap_or(i64::MAX),
            limit: logical_pages,
        });
    }
    if placement.is_reserved(page) {
        return Err(Error::ReservedPage {
            page: page.0,
            shard: placement.shard(),
        });
    }
    let shard = u64::from(placement.shard());
    let expected = ((u64::from(start_owner) + at as u64 % shard) % shard) as u32;
    if placement.owner(page) != expected {
        return Err(Error::WrongOwner {
            page: page.0,
            owner: placement.owner(page),
            expected,
        });
    }
    Ok(())
}

impl fmt::Display for GatherPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.layout;
        write!(
            f,
            "gather of {} prefix pages into {} x {} pages (prefix region {}), {} chunk pages at {}.. (region {}), trash page {}; sends:",
            self.prefix.len(),
            self.placement.shard(),
            self.block,
            l.prefix_pages,
            self.chunk_count,
            l.prefix_pages,
            l.chunk_pages,
            l.trash_page()
        )?;
        // The first ranks only: a plan's text must not grow with the shard size.
        const SHOWN: u32 = 8;
        for rank in 0..self.placement.shard().min(SHOWN) {
            let owned = self.owned(rank).map_or(0, <[_]>::len) as u64;
            write!(
                f,
                " rank {rank} {owned} + {} padding",
                self.block.saturating_sub(owned)
            )?;
        }
        if self.placement.shard() > SHOWN {
            write!(f, " ...")?;
        }
        Ok(())
    }
}
