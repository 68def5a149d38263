//! A request's page chain: its start owner and logical pages, and everything an engine derives
//! from them (slots, the HiCache node, the P/D registration, host pages for a backup), so no
//! engine recomputes the owner rotation by hand.
//!
//! Position `P` of a chain with start owner `b` is owned by `(b + P) % N`. A chain grows through
//! the rotated-owner allocator every rank runs identically ([`ShardAllocator`]), so every rank's
//! copy of a chain holds the same pages.

use std::ops::Range;

use crate::error::{Checked, Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::hicache::CacheNode;
use crate::index::{LocalPage, LogicalPage, Slot};
use crate::shard::{AllocRequest, ChainStart, Placement, ShardAllocator};
use crate::transfer::{PoolLayout, Registration};

/// One request's chain of logical pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestChain {
    placement: Placement,
    start_owner: Option<u32>,
    pages: Vec<LogicalPage>,
}

impl RequestChain {
    /// An empty chain: its first allocation picks the start owner.
    pub fn new(placement: Placement) -> Self {
        Self {
            placement,
            start_owner: None,
            pages: Vec::new(),
        }
    }

    /// A chain continuing a cached prefix (pages matched in the radix tree) whose position 0 is
    /// owned by `start_owner`. Refused when the pages are not owned along the rotation.
    pub fn cached(placement: Placement, start_owner: u32, pages: Vec<LogicalPage>) -> Result<Self> {
        placement.check_rank(start_owner)?;
        let shard = u64::from(placement.shard());
        for (position, &page) in pages.iter().enumerate() {
            let expected = ((u64::from(start_owner) + position as u64 % shard) % shard) as u32;
            if placement.owner(page) != expected {
                return Err(Error::WrongOwner {
                    page: page.0,
                    owner: placement.owner(page),
                    expected,
                });
            }
        }
        Ok(Self {
            placement,
            start_owner: Some(start_owner),
            pages,
        })
    }

    /// The chain's start owner (`None` before its first page).
    pub fn start_owner(&self) -> Option<u32> {
        self.start_owner
    }

    /// The chain's logical pages, in position order.
    pub fn pages(&self) -> &[LogicalPage] {
        &self.pages
    }

    /// Tokens the chain's pages hold.
    pub fn capacity(&self) -> usize {
        self.pages.len().saturating_mul(PAGE_SIZE)
    }

    /// Grows the chain to hold `tokens` tokens through `allocator` (all-or-nothing: on error the
    /// chain and the allocator are unchanged); returns the new pages.
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
        self.start_owner = Some(a.start_owner);
        self.pages.extend(a.pages);
        Ok(&self.pages[before..])
    }

    /// The logical slots of tokens `tokens` of the chain (what the owned-row write and the
    /// quantizers take).
    pub fn slots(&self, tokens: Range<usize>) -> Result<Vec<Slot>> {
        if tokens.start > tokens.end || tokens.end > self.capacity() {
            return Err(Error::OutOfRange {
                what: "chain token",
                index: tokens.end as i64,
                limit: self.capacity() as u64 + 1,
            });
        }
        tokens
            .map(|t| {
                self.pages[t / PAGE_SIZE]
                    .slot(t % PAGE_SIZE)
                    .ok_or_else(|| Error::overflow(format!("slot of chain token {t}")))
            })
            .collect()
    }

    /// The owner of the chain's position `position` (`None` before the first page).
    fn owner_at(&self, position: usize) -> Option<u32> {
        let shard = u64::from(self.placement.shard());
        self.start_owner
            .map(|b| ((u64::from(b) + position as u64 % shard) % shard) as u32)
    }

    /// The HiCache node of positions `pages` of the chain, with id `id`. It has a shard owner
    /// (the owner of its first page) only when the cache is sharded.
    pub fn cache_node(&self, id: u64, pages: Range<usize>) -> Result<CacheNode> {
        let device_pages = self
            .pages
            .get(pages.clone())
            .ok_or(Error::OutOfRange {
                what: "chain page",
                index: pages.end as i64,
                limit: self.pages.len() as u64 + 1,
            })?
            .to_vec();
        let start_owner = if self.placement.shard() > 1 {
            self.owner_at(pages.start)
        } else {
            None
        };
        Ok(CacheNode {
            id,
            device_pages,
            start_owner,
        })
    }

    /// The HiCache node of positions `pages` (with id `id`) and the host pages its backup gets
    /// from the host allocator `host` ([`CacheNode::alloc_host_pages`]).
    pub fn backup_pages(
        &self,
        id: u64,
        pages: Range<usize>,
        host: &mut ShardAllocator,
    ) -> Result<(CacheNode, Vec<LogicalPage>)> {
        let node = self.cache_node(id, pages)?;
        let host_pages = node.alloc_host_pages(host)?;
        Ok((node, host_pages))
    }

    /// The P/D registration of this chain as a decode side's (unsharded) chain: the request's
    /// pages after the decode's cached `prefix_pages` go to this chain's pages, the indexer
    /// state of every position to the same pages.
    pub fn registration(
        &self,
        request: u64,
        layout: PoolLayout,
        prefix_pages: usize,
    ) -> Result<Registration> {
        if self.placement.shard() != 1 {
            return Err(Error::InvalidArgument(format!(
                "a registration describes an unsharded decode chain; this one is sharded {} ways",
                self.placement.shard()
            )));
        }
        if prefix_pages > self.pages.len() {
            return Err(Error::OutOfRange {
                what: "cached prefix pages",
                index: prefix_pages as i64,
                limit: self.pages.len() as u64 + 1,
            });
        }
        let local: Vec<LocalPage> = self
            .pages
            .iter()
            .map(|&p| self.placement.local(p))
            .collect();
        prefix_pages.mul_or(PAGE_SIZE, || {
            format!("tokens of {prefix_pages} cached pages")
        })?;
        let registration = Registration {
            request,
            layout,
            prefix_pages,
            pages: local[prefix_pages..].to_vec(),
            state_pages: local,
        };
        registration.validate()?;
        Ok(registration)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry};

    #[test]
    fn a_chain_grows_along_its_owner_rotation() {
        let p = Placement::new(3).unwrap();
        let mut alloc = ShardAllocator::new(p, 10).unwrap();
        let mut chain = RequestChain::new(p);
        let first = chain.grow_to(&mut alloc, 100).unwrap().to_vec();
        assert_eq!(first.len(), 2);
        let b = chain.start_owner().unwrap();
        chain.grow_to(&mut alloc, 300).unwrap();
        assert_eq!(chain.pages().len(), 5);
        for (i, &page) in chain.pages().iter().enumerate() {
            assert_eq!(p.owner(page), (b + i as u32) % 3);
        }
        let slots = chain.slots(62..66).unwrap();
        assert_eq!(slots[1].page(), chain.pages()[0]);
        assert_eq!(slots[2].page(), chain.pages()[1]);
        assert!(chain.slots(0..321).is_err());
        let node = chain.cache_node(7, 1..3).unwrap();
        assert_eq!(node.start_owner, Some((b + 1) % 3));
        // A chain claimed cached with pages off the rotation is refused.
        assert!(RequestChain::cached(p, (b + 1) % 3, chain.pages().to_vec()).is_err());
        assert!(RequestChain::cached(p, b, chain.pages().to_vec()).is_ok());
    }

    #[test]
    fn an_unsharded_chain_registers_its_pages() {
        let p = Placement::unsharded();
        let mut alloc = ShardAllocator::new(p, 10).unwrap();
        let mut chain = RequestChain::new(p);
        chain.grow_to(&mut alloc, 200).unwrap();
        let g = CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2));
        let reg = chain.registration(3, PoolLayout::packed(g, 10), 1).unwrap();
        assert_eq!(reg.pages.len(), 3);
        assert_eq!(reg.state_pages.len(), 4);
        assert_eq!(chain.cache_node(1, 0..2).unwrap().start_owner, None);
    }
}
