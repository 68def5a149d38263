//! The rotated-owner page allocator (docs/design.md, "Ownership"). Every rank of a shard group runs an
//! identical copy on identical inputs, so all of them agree on every logical page without
//! talking to each other: the allocator is deterministic and free of hashing or clocks.
//!
//! Layout: one free stack per owner class `c` (logical pages `l >= N` with `l % N == c`), one
//! release list per class, and one generation per logical page. Stacks make alloc and free
//! O(pages); the generations let free tell a double free from a page that was never handed out,
//! and let a [`RequestChain`](crate::chain::RequestChain) tell its pages from pages freed and
//! handed out again since it took them (docs/design.md, "Ownership").
//! A fresh class stack holds its pages highest at the bottom, so a fresh allocator hands out
//! each class's lowest pages first.
//!
//! Release order (SGLang 0.5.23's `PageInterleavePoolAllocator` with `need_sort`, as its P/D
//! prefill builds it: `free` and `merge_and_sort_free`): freed pages go to their class's release
//! list, not back onto the stack, and when any class's stack is short of what an allocation
//! (`alloc`, `alloc_batch`, `alloc_matching`: SGLang's `alloc_extend` and `alloc_cyclic`) takes
//! from it, every class's release list is merged into its stack, each stack sorted so that pages
//! come out in ascending order again. Pushed straight back, a freed chain would come out
//! last-freed-first, in descending local order, and the transfers of the pages reusing it (P/D
//! descriptors, HiCache runs) would stop coalescing. Released pages are free: they count in
//! every free count. The differential tests (python/tests/test_sglang_differential_cpu.py) see
//! SGLang's allocator hand out the same pages, call for call.
//!
//! Every multi-page operation is all-or-nothing: it validates and counts first, and touches the
//! stacks only once the whole operation is known to succeed.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::index::LogicalPage;
use crate::shard::Placement;

/// Where the pages of a request sit in their chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChainStart {
    /// A new chain; the allocator picks its start owner.
    New,
    /// Continues a chain whose start owner is `start_owner` after a page-aligned prefix of
    /// `prefix_tokens` tokens.
    Extend {
        /// The chain's start owner `b` (position 0 of the chain is owned by `b`).
        start_owner: u32,
        /// Tokens already in the chain; a multiple of the page size.
        prefix_tokens: usize,
    },
}

/// One chain's worth of pages to allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllocRequest {
    /// Where the new pages go in their chain.
    pub chain: ChainStart,
    /// Pages to allocate.
    pub pages: usize,
}

/// Pages handed out for one [`AllocRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Allocation {
    /// The chain's start owner `b` (for [`ChainStart::Extend`], the one given).
    pub start_owner: u32,
    /// Chain position of `pages[0]`: the prefix length in pages (0 for a new chain).
    pub first_position: usize,
    /// Logical pages in chain-position order: `pages[i]` sits at position `first_position + i`
    /// and is owned by `(start_owner + first_position + i) % N`.
    pub pages: Vec<LogicalPage>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PageState {
    NeverAllocated,
    Allocated,
    Freed,
}

impl PageState {
    /// The state a page's generation encodes: every alloc and every free bumps it by one, so it
    /// is 0 before the first alloc, odd while allocated and even (> 0) once freed.
    fn of(generation: u64) -> Self {
        match generation {
            0 => Self::NeverAllocated,
            g if g % 2 == 1 => Self::Allocated,
            _ => Self::Freed,
        }
    }
}

/// Source of allocator identities: [`ShardAllocator::new`] and every clone take the next one, so
/// no two allocators of the process share one.
static NEXT_ALLOCATOR_ID: AtomicU64 = AtomicU64::new(1);

/// One allocator's identity and the generation of each of its logical pages ([`PageState::of`]).
///
/// Shared, behind an `Arc`, by the allocator (its only writer) and the chains grown through it,
/// so a chain checks that its pages are still its own with `&self` alone (docs/design.md,
/// "Ownership"). The generations are atomics only because of that sharing: the allocator's
/// `&mut self` already orders its writes, so every access is relaxed.
pub(crate) struct PageGenerations {
    id: u64,
    /// Indexed by logical page.
    pages: Vec<AtomicU64>,
}

impl PageGenerations {
    /// The allocator's identity (what [`Error::ForeignAllocator`] names).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The generation of `page` now (0, never handed out, for a page beyond the allocator).
    pub(crate) fn get(&self, page: LogicalPage) -> u64 {
        usize::try_from(page.0)
            .ok()
            .and_then(|p| self.pages.get(p))
            .map_or(0, |g| g.load(Ordering::Relaxed))
    }

    /// Moves `page` (in range: the allocator checked it) to its next generation. Wrapping: a
    /// page would need 2^64 allocs and frees to get there.
    fn bump(&self, page: LogicalPage) {
        let g = &self.pages[page.0 as usize];
        g.store(g.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// Undoes [`Self::bump`] of `page` (a failed all-or-nothing free).
    fn unbump(&self, page: LogicalPage) {
        let g = &self.pages[page.0 as usize];
        g.store(g.load(Ordering::Relaxed).wrapping_sub(1), Ordering::Relaxed);
    }
}

/// Identities are compared (what a chain's equality needs): two handles are equal when they are
/// the same allocator's.
impl PartialEq for PageGenerations {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for PageGenerations {}

impl fmt::Debug for PageGenerations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "allocator #{} ({} pages)", self.id, self.pages.len())
    }
}

/// The logical-level rotated-owner page allocator every rank of a shard group runs identically.
///
/// Each allocator has an identity of its own, and the chains grown through it belong to it
/// ([`RequestChain`](crate::chain::RequestChain)). A clone is a replica: given the same calls it
/// hands out the same pages (so every rank may run its own copy), but it gets a new identity, and
/// a chain belongs to the copy it grew through: pages freed in one copy are not freed in another,
/// so a chain checked against another copy's pages would be checked against the wrong facts.
///
/// Clones compare equal exactly when they would hand out and free the same pages from then on
/// (identities aside), which is what the all-or-nothing guarantees are tested against.
#[derive(Debug)]
pub struct ShardAllocator {
    placement: Placement,
    pages_per_rank: u64,
    /// Free logical pages of each owner class; the next page handed out is the last.
    free: Vec<Vec<LogicalPage>>,
    /// Pages of each owner class freed since its last merge (in any order: a merge sorts).
    released: Vec<Vec<LogicalPage>>,
    /// The identity and page generations, shared with the chains grown through this allocator.
    generations: Arc<PageGenerations>,
}

impl PartialEq for ShardAllocator {
    fn eq(&self, other: &Self) -> bool {
        self.placement == other.placement
            && self.pages_per_rank == other.pages_per_rank
            && self.free == other.free
            && self.released == other.released
            && self.generations.pages.len() == other.generations.pages.len()
            && self
                .generations
                .pages
                .iter()
                .zip(&other.generations.pages)
                .all(|(a, b)| a.load(Ordering::Relaxed) == b.load(Ordering::Relaxed))
    }
}

impl Eq for ShardAllocator {}

impl Clone for ShardAllocator {
    /// Keeps each free stack's and release list's full capacity (a derived clone would trim it
    /// to the length), so frees and merges on the clone never reallocate, as on the original;
    /// copies the page generations under a new identity (see [`ShardAllocator`]).
    fn clone(&self) -> Self {
        let keep_capacity = |lists: &[Vec<LogicalPage>]| {
            lists
                .iter()
                .map(|list| {
                    let mut copy = Vec::with_capacity(list.capacity());
                    copy.extend_from_slice(list);
                    copy
                })
                .collect()
        };
        Self {
            placement: self.placement,
            pages_per_rank: self.pages_per_rank,
            free: keep_capacity(&self.free),
            released: keep_capacity(&self.released),
            generations: Arc::new(PageGenerations {
                id: NEXT_ALLOCATOR_ID.fetch_add(1, Ordering::Relaxed),
                pages: self
                    .generations
                    .pages
                    .iter()
                    .map(|g| AtomicU64::new(g.load(Ordering::Relaxed)))
                    .collect(),
            }),
        }
    }
}

fn reserve<T>(v: &mut Vec<T>, n: usize, what: &str) -> Result<()> {
    v.try_reserve_exact(n)
        .map_err(|e| Error::InvalidArgument(format!("cannot hold {n} {what}: {e}")))
}

impl ShardAllocator {
    /// An allocator for a group of `placement.shard()` ranks that each hold `pages_per_rank`
    /// physical pages. Local page 0 of every rank (logical pages `0..N`) is the reserved padding
    /// page and never handed out, so `pages_per_rank` must be at least 2.
    pub fn new(placement: Placement, pages_per_rank: u64) -> Result<Self> {
        if pages_per_rank < 2 {
            return Err(Error::InvalidArgument(format!(
                "{pages_per_rank} pages per rank (need at least 2: local page 0 is reserved)"
            )));
        }
        let shard = u64::from(placement.shard());
        let total = pages_per_rank
            .checked_mul(shard)
            .and_then(|t| usize::try_from(t).ok())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{pages_per_rank} pages per rank x {shard} ranks does not fit in memory"
                ))
            })?;
        let mut generations = Vec::new();
        reserve(&mut generations, total, "page generations")?;
        generations.resize_with(total, || AtomicU64::new(0));
        let mut free = Vec::new();
        let mut released = Vec::new();
        reserve(&mut free, shard as usize, "owner classes")?;
        reserve(&mut released, shard as usize, "owner classes")?;
        for class in 0..placement.shard() {
            // Both lists hold every page of the class at full capacity, so neither a free nor a
            // merge ever allocates (nor fails to). Fits: the product with `shard` fit in usize
            // above.
            let mut stack = Vec::new();
            reserve(&mut stack, (pages_per_rank - 1) as usize, "free pages")?;
            stack.extend(
                (1..pages_per_rank)
                    .rev()
                    .map(|local| LogicalPage(local * shard + u64::from(class))),
            );
            free.push(stack);
            let mut release = Vec::new();
            reserve(
                &mut release,
                (pages_per_rank - 1) as usize,
                "released pages",
            )?;
            released.push(release);
        }
        Ok(Self {
            placement,
            pages_per_rank,
            free,
            released,
            generations: Arc::new(PageGenerations {
                id: NEXT_ALLOCATOR_ID.fetch_add(1, Ordering::Relaxed),
                pages: generations,
            }),
        })
    }

    /// The identity and page generations a chain grown through this allocator keeps.
    pub(crate) fn generations(&self) -> &Arc<PageGenerations> {
        &self.generations
    }

    /// The generation of `page`, which must be handed out now: a page beyond the allocator, a
    /// reserved page, or one never handed out or freed since is refused.
    pub(crate) fn allocated_generation(&self, page: LogicalPage) -> Result<u64> {
        self.check_page(page)?;
        let generation = self.generations.get(page);
        match PageState::of(generation) {
            PageState::Allocated => Ok(generation),
            _ => Err(Error::NotAllocated { page: page.0 }),
        }
    }

    /// The placement the allocator serves.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Physical pages each rank holds (including its reserved page 0).
    pub fn pages_per_rank(&self) -> u64 {
        self.pages_per_rank
    }

    /// Free pages of owner class `owner` (released ones included); 0 for an owner outside the
    /// group.
    pub fn free_pages(&self, owner: u32) -> usize {
        self.class_free(owner as usize)
    }

    /// Free pages over all owner classes.
    pub fn total_free(&self) -> usize {
        (0..self.free.len()).map(|c| self.class_free(c)).sum()
    }

    /// Freed pages of owner class `owner` waiting in its release list for the next merge; 0
    /// for an owner outside the group.
    pub fn released_pages(&self, owner: u32) -> usize {
        self.released.get(owner as usize).map_or(0, Vec::len)
    }

    /// Tokens the group can still admit whatever start owners new chains get:
    /// `N * 64 * min_r(free_r)`.
    pub fn admission_capacity(&self) -> u64 {
        let min_free = (0..self.free.len())
            .map(|c| self.class_free(c))
            .min()
            .unwrap_or(0) as u64;
        self.token_stride() * min_free
    }

    /// Free pages of class index `class`: its stack and its release list.
    fn class_free(&self, class: usize) -> usize {
        self.free.get(class).map_or(0, Vec::len) + self.released.get(class).map_or(0, Vec::len)
    }

    /// Moves class `class`'s release list into its stack and sorts the stack descending, so it
    /// hands out its lowest page next (the stack's top is its last element). No allocation: the
    /// stack holds every page of the class at full capacity.
    fn merge(&mut self, class: usize) {
        let (Some(stack), Some(released)) =
            (self.free.get_mut(class), self.released.get_mut(class))
        else {
            return;
        };
        if released.is_empty() {
            return;
        }
        stack.append(released);
        stack.sort_unstable_by(|a, b| b.cmp(a));
    }

    /// Merges every class's release list when any class's stack holds fewer pages than `taken`
    /// takes from it (SGLang's `merge_and_sort_free`, which merges the whole allocator).
    fn merge_short(&mut self, taken: &[usize]) {
        let short = taken.iter().enumerate().any(|(class, &needed)| {
            self.free
                .get(class)
                .is_some_and(|stack| stack.len() < needed)
        });
        if short {
            for class in 0..self.free.len() {
                self.merge(class);
            }
        }
    }

    /// Tokens each admitted request reserves on top of its own length: `N * 64`, the rounding
    /// a chain's last partial round of owners may cost.
    pub fn request_overhead(&self) -> u64 {
        self.token_stride()
    }

    fn token_stride(&self) -> u64 {
        u64::from(self.placement.shard()) * PAGE_SIZE as u64
    }

    /// Allocates one request's pages; on error nothing changes.
    pub fn alloc(&mut self, request: AllocRequest) -> Result<Allocation> {
        let mut taken = vec![0usize; self.free.len()];
        let plan = self.plan(&request, &mut taken)?;
        self.check_supply(&taken)?;
        self.merge_short(&taken);
        Ok(self.commit(&request, plan))
    }

    /// Allocates every request, in order, or none of them.
    ///
    /// A [`ChainStart::New`] request starts at the owner with the most free pages (ties: the
    /// lowest rank), counting the pages the earlier requests of this batch take. The batch
    /// commits only if every owner class can supply what the whole batch needs from it;
    /// otherwise it fails with [`Error::Exhausted`] for the lowest short class and nothing
    /// changes. When a class's stack is short of the batch's share, every release list is
    /// merged first, as SGLang's `alloc_extend` does.
    pub fn alloc_batch(&mut self, requests: &[AllocRequest]) -> Result<Vec<Allocation>> {
        let mut taken = vec![0usize; self.free.len()];
        let plans = requests
            .iter()
            .map(|request| self.plan(request, &mut taken))
            .collect::<Result<Vec<_>>>()?;
        self.check_supply(&taken)?;
        self.merge_short(&taken);
        Ok(requests
            .iter()
            .zip(plans)
            .map(|(request, plan)| self.commit(request, plan))
            .collect())
    }

    /// Allocates one new page per page of `pages`, of the same owner class (`page % N`), so a
    /// copy of each page lands on the rank that holds the original. The given pages may belong
    /// to another pool of the same placement (host copies of device pages), so only their class
    /// matters; reserved padding pages have nothing to copy and are refused. All or nothing.
    /// When a class's stack is short of what the call takes from it, every release list is
    /// merged first (once the call is known to succeed), as SGLang's `alloc_cyclic` does for a
    /// HiCache load-back: the pages handed out are SGLang's, page for page.
    pub fn alloc_matching(&mut self, pages: &[LogicalPage]) -> Result<Vec<LogicalPage>> {
        let mut by_class = vec![Vec::new(); self.free.len()];
        for (i, &page) in pages.iter().enumerate() {
            if self.placement.is_reserved(page) {
                return Err(self.reserved(page));
            }
            by_class[self.placement.owner(page) as usize].push(i);
        }
        let taken: Vec<usize> = by_class.iter().map(Vec::len).collect();
        self.check_supply(&taken)?;
        self.merge_short(&taken);
        let mut out = vec![LogicalPage(0); pages.len()];
        for (stack, positions) in self.free.iter_mut().zip(&by_class) {
            let at = stack.len().saturating_sub(positions.len());
            for (&i, page) in positions.iter().zip(stack.drain(at..).rev()) {
                out[i] = page;
            }
        }
        self.mark_allocated(&out);
        Ok(out)
    }

    /// Returns every page of `pages` to its owner class's release list, or none of them: a page
    /// out of range, reserved, never handed out, already free, or given twice fails the whole
    /// call.
    ///
    /// Raw pages are what an engine that tracks pages itself frees (radix-tree nodes, SGLang's
    /// release list); a page freed and handed to another request since cannot be told from the
    /// one it was. A chain's pages are freed through [`RequestChain::free`], which refuses a
    /// stale chain.
    ///
    /// [`RequestChain::free`]: crate::chain::RequestChain::free
    pub fn free(&mut self, pages: &[LogicalPage]) -> Result<()> {
        // Marking pages freed as we go catches duplicates within the call; on error the marks
        // made so far are undone, and they all belonged to distinct pages that were allocated.
        for (i, &page) in pages.iter().enumerate() {
            if let Err(e) = self.mark_freed(page) {
                for &done in &pages[..i] {
                    self.generations.unbump(done);
                }
                return Err(e);
            }
        }
        for &page in pages {
            let class = self.placement.owner(page) as usize;
            // No reallocation: the list was made with room for every page of its class.
            self.released[class].push(page);
        }
        Ok(())
    }

    /// Whether logical page `page` is currently handed out.
    pub fn is_allocated(&self, page: LogicalPage) -> bool {
        PageState::of(self.generations.get(page)) == PageState::Allocated
    }

    /// Refuses a page beyond the allocator or a reserved one.
    fn check_page(&self, page: LogicalPage) -> Result<()> {
        let limit = self.generations.pages.len() as u64;
        if page.0 >= limit {
            return Err(Error::OutOfRange {
                what: "logical page",
                index: i64::try_from(page.0).unwrap_or(i64::MAX),
                limit,
            });
        }
        if self.placement.is_reserved(page) {
            return Err(self.reserved(page));
        }
        Ok(())
    }

    fn mark_freed(&mut self, page: LogicalPage) -> Result<()> {
        self.check_page(page)?;
        match PageState::of(self.generations.get(page)) {
            PageState::Allocated => {
                self.generations.bump(page);
                Ok(())
            }
            PageState::Freed => Err(Error::DoubleFree { page: page.0 }),
            PageState::NeverAllocated => Err(Error::NeverAllocated { page: page.0 }),
        }
    }

    fn reserved(&self, page: LogicalPage) -> Error {
        Error::ReservedPage {
            page: page.0,
            shard: self.placement.shard(),
        }
    }

    /// Owner `steps` positions after `owner`.
    fn rotate(&self, owner: u32, steps: usize) -> u32 {
        let shard = u64::from(self.placement.shard());
        ((u64::from(owner) + steps as u64 % shard) % shard) as u32
    }

    /// The owner with the most free pages once `taken` are gone; ties go to the lowest rank.
    fn emptiest_owner(&self, taken: &[usize]) -> u32 {
        let mut best = 0;
        let mut best_left = i128::MIN;
        for (owner, &t) in taken.iter().enumerate() {
            // Signed: an over-drawn class (the batch will fail) must still rank below the rest.
            let left = self.class_free(owner) as i128 - t as i128;
            if left > best_left {
                best = owner as u32;
                best_left = left;
            }
        }
        best
    }

    fn check_supply(&self, taken: &[usize]) -> Result<()> {
        for (owner, &needed) in taken.iter().enumerate() {
            let free = self.class_free(owner);
            if needed > free {
                return Err(Error::Exhausted {
                    owner: owner as u32,
                    needed,
                    free,
                });
            }
        }
        Ok(())
    }

    /// Start owner and first position of `request`, adding what it needs from each class to
    /// `taken` (the needs of the earlier requests of its batch).
    fn plan(&self, request: &AllocRequest, taken: &mut [usize]) -> Result<Plan> {
        let shard = self.placement.shard();
        let (start_owner, first_position) = match request.chain {
            ChainStart::New => (self.emptiest_owner(taken), 0),
            ChainStart::Extend {
                start_owner,
                prefix_tokens,
            } => {
                if start_owner >= shard {
                    return Err(Error::InvalidArgument(format!(
                        "start owner {start_owner} of a shard of {shard}"
                    )));
                }
                if prefix_tokens % PAGE_SIZE != 0 {
                    return Err(Error::MisalignedPrefix {
                        tokens: prefix_tokens,
                        page_size: PAGE_SIZE,
                    });
                }
                (start_owner, prefix_tokens / PAGE_SIZE)
            }
        };
        let start = self.rotate(start_owner, first_position);
        for (class, t) in taken.iter_mut().enumerate() {
            *t = t.saturating_add(class_share(class as u32, start, request.pages, shard));
        }
        Ok(Plan {
            start_owner,
            first_position,
            start,
        })
    }

    /// Hands out the pages of a planned request. Only called once [`Self::check_supply`] has
    /// passed for the whole operation and [`Self::merge_short`] has merged every class whose
    /// stack was short of it, so every stack holds at least the share taken from it.
    fn commit(&mut self, request: &AllocRequest, plan: Plan) -> Allocation {
        let shard = self.free.len();
        let mut pages = vec![LogicalPage(0); request.pages];
        for (class, stack) in self.free.iter_mut().enumerate() {
            let share = class_share(class as u32, plan.start, request.pages, shard as u32);
            // Positions of this class: every N-th one from its first along the chain.
            let first = (class + shard - plan.start as usize) % shard;
            let at = stack.len().saturating_sub(share);
            for (slot, page) in pages
                .iter_mut()
                .skip(first)
                .step_by(shard)
                .zip(stack.drain(at..).rev())
            {
                *slot = page;
            }
        }
        self.mark_allocated(&pages);
        Allocation {
            start_owner: plan.start_owner,
            first_position: plan.first_position,
            pages,
        }
    }

    fn mark_allocated(&mut self, pages: &[LogicalPage]) {
        for &page in pages {
            self.generations.bump(page);
        }
    }
}

/// Where a request's pages go, decided before anything is handed out.
#[derive(Debug, Clone, Copy)]
struct Plan {
    start_owner: u32,
    first_position: usize,
    /// Owner of the first new page.
    start: u32,
}

/// Pages class `class` contributes to `pages` new pages starting at owner `start` of a shard of
/// `shard`: one per full round of owners, plus one if the last partial round reaches it.
fn class_share(class: u32, start: u32, pages: usize, shard: u32) -> usize {
    let shard_len = shard as usize;
    let distance = (class as usize + shard_len - start as usize) % shard_len;
    pages / shard_len + usize::from(distance < pages % shard_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(raw: &[u64]) -> Vec<LogicalPage> {
        raw.iter().map(|&p| LogicalPage(p)).collect()
    }

    #[test]
    fn freed_pages_come_back_in_ascending_order() {
        let mut a = ShardAllocator::new(Placement::new(2).unwrap(), 6).unwrap();
        let chain = a
            .alloc(AllocRequest {
                chain: ChainStart::New,
                pages: 6,
            })
            .unwrap();
        assert_eq!(chain.pages, pages(&[2, 3, 4, 5, 6, 7]));
        a.free(&chain.pages).unwrap();
        // Released, not yet merged: still free, and the stack's own pages go first.
        assert_eq!((a.free_pages(0), a.released_pages(0)), (5, 3));
        let small = a
            .alloc(AllocRequest {
                chain: ChainStart::New,
                pages: 4,
            })
            .unwrap();
        assert_eq!(small.pages, pages(&[8, 9, 10, 11]));
        // Class 0 has 0 pages left on its stack for 2: merged, lowest first (last-freed-first
        // would give 6, 4).
        let next = a
            .alloc(AllocRequest {
                chain: ChainStart::Extend {
                    start_owner: 0,
                    prefix_tokens: 0,
                },
                pages: 4,
            })
            .unwrap();
        assert_eq!(next.pages, pages(&[2, 3, 4, 5]));
        a.free(&[LogicalPage(9), LogicalPage(3), LogicalPage(11)])
            .unwrap();
        // Matching merges every class first.
        assert_eq!(
            a.alloc_matching(&pages(&[1001, 1003, 1005])).unwrap(),
            pages(&[3, 7, 9])
        );
        assert_eq!(a.released_pages(1), 0);
    }

    #[test]
    fn class_share_matches_counting_positions() {
        for shard in 1..=5u32 {
            for start in 0..shard {
                for pages in 0..3 * shard as usize + 2 {
                    for class in 0..shard {
                        let counted = (0..pages)
                            .filter(|j| (start as usize + j) % shard as usize == class as usize)
                            .count();
                        assert_eq!(class_share(class, start, pages, shard), counted);
                    }
                }
            }
        }
    }
}
