//! What a send plan is made for: the prefill rank ([`PrefillRank`]), the decode side's
//! registration of the request ([`Registration`], checked alone before it is accepted) and the
//! chunk ([`ChunkRange`]). Plain data both sides exchange and check; the plan itself is built in
//! `build`.

use crate::chain::RequestChain;
use crate::copy::check_distinct;
use crate::error::{Checked, Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::index::LocalPage;
use crate::pool::DevicePool;
use crate::shard::Placement;

use super::PoolLayout;

/// The prefill rank a plan is made for: its place in the shard group and its pool's layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillRank {
    /// Sharding of the prefill group (N).
    pub placement: Placement,
    /// This rank.
    pub rank: u32,
    /// This rank's pool.
    pub layout: PoolLayout,
}

impl PrefillRank {
    /// The rank `pool` belongs to.
    pub fn of(pool: &DevicePool) -> Self {
        Self {
            placement: pool.placement(),
            rank: pool.rank(),
            layout: PoolLayout::of(pool),
        }
    }
}

/// What the decode side registered for one request; it sends the same registration to every
/// prefill rank of the group. Decode is unsharded: its page ids are pages of its own pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// Request id.
    pub request: u64,
    /// The decode pool.
    pub layout: PoolLayout,
    /// Leading pages of the sequence the decode already holds (its cached prefix): they are
    /// never sent, and chunks start after them.
    pub prefix_pages: usize,
    /// Destination page of each sequence position from `prefix_pages` on (all distinct).
    pub pages: Vec<LocalPage>,
    /// Destination page of the indexer state of each sequence position from 0 on (all
    /// distinct; the state goes with the final chunk, for the whole sequence).
    pub state_pages: Vec<LocalPage>,
}

impl Registration {
    /// The registration of `chain` as a decode side's (unsharded) chain: the request's pages
    /// after the decode's cached `prefix_pages` go to the chain's pages, the indexer state of
    /// every position to the same pages. Refused for a sharded or stale chain, or a prefix
    /// longer than the chain.
    pub fn of_chain(
        chain: &RequestChain,
        request: u64,
        layout: PoolLayout,
        prefix_pages: usize,
    ) -> Result<Self> {
        let placement = chain.placement();
        if placement.shard() != 1 {
            return Err(Error::InvalidArgument(format!(
                "a registration describes an unsharded decode chain; this one is sharded {} ways",
                placement.shard()
            )));
        }
        let pages = chain.pages()?;
        if prefix_pages > pages.len() {
            return Err(Error::OutOfRange {
                what: "cached prefix pages",
                index: prefix_pages as i64,
                limit: pages.len() as u64 + 1,
            });
        }
        prefix_pages.mul_or(PAGE_SIZE, || {
            format!("tokens of {prefix_pages} cached pages")
        })?;
        let local: Vec<LocalPage> = pages.iter().map(|&p| placement.local(p)).collect();
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

    /// Checks what a registration can be checked for alone: destination pages in the decode
    /// pool, not its padding page 0, and each list free of repeats (two positions landing on
    /// one page would lose one of them while the status says sent). Senders and receivers both
    /// call it before accepting a registration.
    pub fn validate(&self) -> Result<()> {
        let request = self.request;
        let transfer = |e: Error| Error::Transfer {
            request,
            reason: e.to_string(),
        };
        for (what, pages) in [
            ("destination page", &self.pages),
            ("destination state page", &self.state_pages),
        ] {
            check_distinct(pages.iter().map(|p| p.0), what).map_err(transfer)?;
            if let Some((position, page)) = pages
                .iter()
                .enumerate()
                .find(|(_, p)| p.0 == 0 || p.0 >= self.layout.pages)
            {
                let reason = if page.0 == 0 {
                    format!("{what} 0 at position {position} is the decode pool's padding page")
                } else {
                    format!(
                        "{what} {} at position {position} out of range (the decode pool holds {} pages)",
                        page.0, self.layout.pages
                    )
                };
                return Err(Error::Transfer { request, reason });
            }
        }
        self.prefix_pages
            .add_or(self.pages.len(), || {
                format!("registered pages of request {request}")
            })
            .and_then(|p| {
                p.mul_or(PAGE_SIZE, || {
                    format!("registered tokens of request {request}")
                })
            })?;
        Ok(())
    }

    /// Tokens of the decode's cached prefix.
    pub fn prefix_tokens(&self) -> Result<usize> {
        self.prefix_pages.mul_or(PAGE_SIZE, || {
            format!("tokens of a {}-page prefix", self.prefix_pages)
        })
    }
}

/// One chunk of a request: tokens `[start, end)`, numbered in send order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRange {
    /// Position of the chunk in the request's send order (0, 1, ...).
    pub index: u32,
    /// First token; page-aligned (the previous chunk's floored end, or the decode's prefix).
    pub start: usize,
    /// End of the tokens prefilled so far. A non-final chunk sends only its whole pages: its
    /// end is floored to a page and the partial page goes with a later chunk.
    pub end: usize,
    /// Whether this is the request's final chunk.
    pub last: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
    use crate::shard::ShardAllocator;

    #[test]
    fn an_unsharded_chain_registers_its_pages() {
        let p = Placement::unsharded();
        let mut alloc = ShardAllocator::new(p, 10).unwrap();
        let mut chain = RequestChain::new(p);
        chain.grow_to(&mut alloc, 200).unwrap();
        let g = CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2));
        let layout = PoolLayout::packed(g, 10);
        let reg = Registration::of_chain(&chain, 3, layout.clone(), 1).unwrap();
        assert_eq!(reg.pages.len(), 3);
        assert_eq!(reg.state_pages.len(), 4);
        assert!(Registration::of_chain(&chain, 3, layout.clone(), 5).is_err());
        let sharded = Placement::new(2).unwrap();
        let mut alloc = ShardAllocator::new(sharded, 10).unwrap();
        let mut chain = RequestChain::new(sharded);
        chain.grow_to(&mut alloc, 200).unwrap();
        assert!(Registration::of_chain(&chain, 3, layout, 0).is_err());
    }
}
