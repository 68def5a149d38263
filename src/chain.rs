//! A request's page chain: its start owner and logical pages, and what an engine derives from
//! them (slots, the owner of each position, a cached prefix's gather request), so no engine
//! recomputes the owner rotation by hand. The layers above build their views of a chain from
//! it: the HiCache node (`hicache::CacheNode::of_chain`) and the P/D registration
//! (`transfer::Registration::of_chain`).
//!
//! Position `P` of a chain with start owner `b` is owned by `(b + P) % N`. A chain grows through
//! the rotated-owner allocator every rank runs identically ([`ShardAllocator`]), so every rank's
//! copy of a chain holds the same pages.
//!
//! A chain belongs to its allocator (docs/design.md, "Ownership"): it keeps the allocator's
//! identity and the generation of each page it took, and everything that hands out its pages or
//! slots, grows it or frees it first checks that every page concerned is still the one it took.
//! A stale chain (a page freed since, maybe handed to another request) is refused with
//! [`Error::StaleChain`], another allocator with [`Error::ForeignAllocator`].

use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::index::{LogicalPage, Slot};
use crate::shard::{
    AllocRequest, ChainStart, GatherRequest, PageGenerations, Placement, ShardAllocator,
};

/// One request's chain of logical pages, bound to the allocator they came from.
///
/// Clones share the binding: once one frees the pages, every copy is stale.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestChain {
    placement: Placement,
    start_owner: Option<u32>,
    pages: Vec<LogicalPage>,
    /// `generations[i]`: the generation of `pages[i]` when the chain took it.
    generations: Vec<u64>,
    /// The allocator the pages came from (`None` before the first page): its identity and its
    /// pages' generations now.
    allocator: Option<Arc<PageGenerations>>,
}

impl RequestChain {
    /// An empty chain: its first allocation picks the start owner and binds it to its allocator.
    pub fn new(placement: Placement) -> Self {
        Self {
            placement,
            start_owner: None,
            pages: Vec::new(),
            generations: Vec::new(),
            allocator: None,
        }
    }

    /// A chain continuing a cached prefix (pages matched in the radix tree, handed out by
    /// `allocator` and still allocated) whose position 0 is owned by `start_owner`. Refused when
    /// the pages are not owned along the rotation ([`Error::WrongOwner`]), when one appears
    /// twice ([`Error::DuplicatePage`]), or when `allocator` does not hold one of them now
    /// ([`Error::NotAllocated`], or [`Error::OutOfRange`] / [`Error::ReservedPage`] for a page
    /// it never could hand out).
    pub fn cached(
        allocator: &ShardAllocator,
        start_owner: u32,
        pages: Vec<LogicalPage>,
    ) -> Result<Self> {
        let placement = allocator.placement();
        placement.check_rank(start_owner)?;
        let shard = u64::from(placement.shard());
        let mut generations = Vec::with_capacity(pages.len());
        for (position, &page) in pages.iter().enumerate() {
            let expected = ((u64::from(start_owner) + position as u64 % shard) % shard) as u32;
            if placement.owner(page) != expected {
                return Err(Error::WrongOwner {
                    page: page.0,
                    owner: placement.owner(page),
                    expected,
                });
            }
            generations.push(allocator.allocated_generation(page)?);
        }
        // Two positions on one page would write each other's rows: sorted by page, a repeat
        // sits next to its first occurrence.
        let mut sorted: Vec<(LogicalPage, usize)> = pages.iter().copied().zip(0..).collect();
        sorted.sort_unstable();
        if let Some(pair) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::DuplicatePage {
                what: "cached chain page",
                page: pair[0].0 .0,
                first: pair[0].1,
                second: pair[1].1,
            });
        }
        Ok(Self {
            placement,
            start_owner: Some(start_owner),
            pages,
            generations,
            allocator: Some(allocator.generations().clone()),
        })
    }

    /// The chain's start owner (`None` before its first page).
    pub fn start_owner(&self) -> Option<u32> {
        self.start_owner
    }

    /// The chain's logical pages, in position order; refused ([`Error::StaleChain`]) once one
    /// of them was freed since the chain took it.
    pub fn pages(&self) -> Result<&[LogicalPage]> {
        self.check(0..self.pages.len())?;
        Ok(&self.pages)
    }

    /// Pages in the chain, stale or not (a count hands out no page).
    pub fn page_count(&self) -> usize {
        self.pages.len()
    }

    /// Tokens the chain's pages hold.
    pub fn capacity(&self) -> usize {
        self.pages.len().saturating_mul(PAGE_SIZE)
    }

    /// Refuses `allocator` unless it is the one the chain's pages came from.
    fn check_allocator(&self, allocator: &ShardAllocator) -> Result<()> {
        match &self.allocator {
            Some(own) if own.id() != allocator.generations().id() => Err(Error::ForeignAllocator {
                chain: own.id(),
                allocator: allocator.generations().id(),
            }),
            _ => Ok(()),
        }
    }

    /// Refuses the chain when a page at one of `positions` (in range) was freed since the chain
    /// took it: its generation moved on.
    fn check(&self, positions: Range<usize>) -> Result<()> {
        let Some(allocator) = &self.allocator else {
            // No page yet: nothing to be stale.
            return Ok(());
        };
        let start = positions.start;
        let pages = self.pages[positions.clone()].iter();
        for (i, (&page, &taken)) in pages.zip(&self.generations[positions]).enumerate() {
            let current = allocator.get(page);
            if current != taken {
                return Err(Error::StaleChain {
                    page: page.0,
                    position: start + i,
                    taken,
                    current,
                });
            }
        }
        Ok(())
    }

    /// Grows the chain to hold `tokens` tokens through `allocator` (all-or-nothing: on error the
    /// chain and the allocator are unchanged); returns the new pages. Refused for a stale chain
    /// and for another allocator than the one the chain's pages came from.
    pub fn grow_to(
        &mut self,
        allocator: &mut ShardAllocator,
        tokens: usize,
    ) -> Result<&[LogicalPage]> {
        if allocator.placement() != self.placement {
            return Err(Error::InvalidArgument(format!(
                "an allocator of shard size {} for a chain of shard size {}",
                allocator.placement().shard(),
                self.placement.shard()
            )));
        }
        self.check_allocator(allocator)?;
        self.check(0..self.pages.len())?;
        let need = tokens.div_ceil(PAGE_SIZE).saturating_sub(self.pages.len());
        let before = self.pages.len();
        if need == 0 {
            return Ok(&self.pages[before..]);
        }
        let chain = match self.start_owner {
            None => ChainStart::New,
            Some(start_owner) => ChainStart::Extend {
                start_owner,
                prefix_tokens: self.capacity(),
            },
        };
        let a = allocator.alloc(AllocRequest { chain, pages: need })?;
        let table = allocator.generations();
        self.generations
            .extend(a.pages.iter().map(|&page| table.get(page)));
        self.allocator.get_or_insert_with(|| table.clone());
        self.start_owner = Some(a.start_owner);
        self.pages.extend(a.pages);
        Ok(&self.pages[before..])
    }

    /// Frees the chain's pages in `allocator`, all or none; the chain and every copy of it are
    /// stale from then on. Refused for a stale chain (its pages may be another request's now:
    /// a second free of the chain is one) and for another allocator than the one the pages came
    /// from.
    pub fn free(&self, allocator: &mut ShardAllocator) -> Result<()> {
        self.check_allocator(allocator)?;
        self.check(0..self.pages.len())?;
        allocator.free(&self.pages)
    }

    /// The logical slots of tokens `tokens` of the chain (what the owned-row write and the
    /// quantizers take); refused for a stale chain.
    pub fn slots(&self, tokens: Range<usize>) -> Result<Vec<Slot>> {
        if tokens.start > tokens.end || tokens.end > self.capacity() {
            return Err(Error::OutOfRange {
                what: "chain token",
                index: tokens.end as i64,
                limit: self.capacity() as u64 + 1,
            });
        }
        self.check(tokens.start / PAGE_SIZE..tokens.end.div_ceil(PAGE_SIZE))?;
        tokens
            .map(|t| {
                self.pages[t / PAGE_SIZE]
                    .slot(t % PAGE_SIZE)
                    .ok_or_else(|| Error::overflow(format!("slot of chain token {t}")))
            })
            .collect()
    }

    /// The placement the chain's pages are sharded by.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The pages at positions `pages`, refused when the range passes the chain's end
    /// ([`Error::OutOfRange`]) or one of them was freed since the chain took it
    /// ([`Error::StaleChain`]).
    pub fn pages_at(&self, pages: Range<usize>) -> Result<&[LogicalPage]> {
        let got = self.pages.get(pages.clone()).ok_or(Error::OutOfRange {
            what: "chain page",
            index: pages.end as i64,
            limit: self.pages.len() as u64 + 1,
        })?;
        self.check(pages)?;
        Ok(got)
    }

    /// The owner of the chain's position `position` (`None` before the first page).
    pub fn owner_at(&self, position: usize) -> Option<u32> {
        let shard = u64::from(self.placement.shard());
        self.start_owner
            .map(|b| ((u64::from(b) + position as u64 % shard) % shard) as u32)
    }
}

impl<'a> GatherRequest<'a> {
    /// The request of `chain` whose first `prefix_pages` pages are its cached prefix and whose
    /// remaining pages are its current chunk (an engine grows the chain for the chunk first).
    /// Refused for a stale chain ([`RequestChain::pages`]).
    pub fn of_chain(chain: &'a RequestChain, prefix_pages: usize) -> Result<Self> {
        let pages = chain.pages()?;
        if prefix_pages > pages.len() {
            return Err(Error::OutOfRange {
                what: "cached prefix pages",
                index: i64::try_from(prefix_pages).unwrap_or(i64::MAX),
                limit: pages.len() as u64 + 1,
            });
        }
        let (prefix, chunk) = pages.split_at(prefix_pages);
        Ok(Self {
            // An empty chain has no owner yet and nothing to check.
            start_owner: chain.start_owner().unwrap_or(0),
            prefix,
            chunk,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_grows_along_its_owner_rotation() {
        let p = Placement::new(3).unwrap();
        let mut alloc = ShardAllocator::new(p, 10).unwrap();
        let mut chain = RequestChain::new(p);
        let first = chain.grow_to(&mut alloc, 100).unwrap().to_vec();
        assert_eq!(first.len(), 2);
        let b = chain.start_owner().unwrap();
        chain.grow_to(&mut alloc, 300).unwrap();
        assert_eq!(chain.pages().unwrap().len(), 5);
        for (i, &page) in chain.pages().unwrap().iter().enumerate() {
            assert_eq!(p.owner(page), (b + i as u32) % 3);
        }
        let slots = chain.slots(62..66).unwrap();
        assert_eq!(slots[1].page(), chain.pages().unwrap()[0]);
        assert_eq!(slots[2].page(), chain.pages().unwrap()[1]);
        assert!(chain.slots(0..321).is_err());
        assert_eq!(chain.owner_at(1), Some((b + 1) % 3));
        assert_eq!(chain.pages_at(1..3).unwrap(), &chain.pages().unwrap()[1..3]);
        assert!(chain.pages_at(4..6).is_err());
        // A chain claimed cached with pages off the rotation is refused.
        assert!(
            RequestChain::cached(&alloc, (b + 1) % 3, chain.pages().unwrap().to_vec()).is_err()
        );
        assert!(RequestChain::cached(&alloc, b, chain.pages().unwrap().to_vec()).is_ok());
    }
}
