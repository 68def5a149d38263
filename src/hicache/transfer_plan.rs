//! Owner-aware transfer planning: pure CPU work, done before anything is enqueued.
//!
//! A HiCache operation names logical device pages and logical host pages, paired by position,
//! identically on every rank of the shard group. Each rank keeps the pairs it owns and maps both
//! sides to its local pages (`l / N`) before the transfer's first copy is enqueued. Every pair
//! is checked first, owned or not, so all ranks accept or refuse the same operation: pages must
//! be in range, not reserved (`0..N`), owned by the same rank on both sides, and used once per
//! side. A rank that owns nothing gets an empty plan that is still submitted, so acks and
//! layer-ready signals stay in step across ranks.

use crate::copy::check_distinct;
use crate::copy::{OwnedRuns, Run};
use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::index::{LocalPage, LogicalPage, Slot};
use crate::shard::Placement;

/// One rank's share of a HiCache operation, in local pages: the copy layer's owner runs of
/// (device, host) pairs, `src` being the device side and `dst` the host side of each run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPlan {
    placement: Placement,
    rank: u32,
    requested: usize,
    owned: OwnedRuns,
}

impl TransferPlan {
    /// Plans rank `rank`'s share of moving logical pages `device[i] <-> host[i]`, where each
    /// rank's device pool holds `device_pages` pages and its host pool `host_pages`.
    pub fn new(
        placement: Placement,
        rank: u32,
        device: &[LogicalPage],
        host: &[LogicalPage],
        device_pages: u64,
        host_pages: u64,
    ) -> Result<Self> {
        placement.check_rank(rank)?;
        if device.len() != host.len() {
            return Err(Error::HiCache(format!(
                "{} device pages paired with {} host pages",
                device.len(),
                host.len()
            )));
        }
        let device_limit = placement.logical_pages(device_pages)?;
        let host_limit = placement.logical_pages(host_pages)?;
        for (&d, &h) in device.iter().zip(host) {
            check_page(placement, d, device_limit, "logical device page")?;
            check_page(placement, h, host_limit, "logical host page")?;
            let owner = placement.owner(d);
            if placement.owner(h) != owner {
                return Err(Error::WrongOwner {
                    page: h.0,
                    owner: placement.owner(h),
                    expected: owner,
                });
            }
        }
        check_distinct(device.iter().map(|p| p.0), "logical device page")?;
        check_distinct(host.iter().map(|p| p.0), "logical host page")?;
        Ok(Self {
            placement,
            rank,
            requested: device.len(),
            owned: OwnedRuns::new(placement, rank, device, host, |h| placement.local(h)),
        })
    }

    /// Sharding of both sides.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The rank this plan is for.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Pairs in the whole operation (every rank's).
    pub fn requested(&self) -> usize {
        self.requested
    }

    /// Pairs this rank moves.
    pub fn len(&self) -> usize {
        self.owned.len()
    }

    /// Whether this rank moves nothing (it still submits the operation).
    pub fn is_empty(&self) -> bool {
        self.owned.is_empty()
    }

    /// Positions in the operation of the pairs this rank moves, ascending.
    pub fn positions(&self) -> &[usize] {
        self.owned.positions()
    }

    /// Local device page of each moved pair.
    pub fn device_pages(&self) -> &[LocalPage] {
        self.owned.src_pages()
    }

    /// Local host page of each moved pair.
    pub fn host_pages(&self) -> &[LocalPage] {
        self.owned.dst_pages()
    }

    /// Moved pairs coalesced into runs (`src` device, `dst` host), in pair order.
    pub fn runs(&self) -> &[Run] {
        self.owned.runs()
    }
}

fn check_page(
    placement: Placement,
    page: LogicalPage,
    limit: u64,
    what: &'static str,
) -> Result<()> {
    if page.0 >= limit {
        return Err(Error::OutOfRange {
            what,
            index: i64::try_from(page.0).unwrap_or(i64::MAX),
            limit,
        });
    }
    if placement.is_reserved(page) {
        return Err(Error::ReservedPage {
            page: page.0,
            shard: placement.shard(),
        });
    }
    Ok(())
}

/// The logical pages of `tokens` logical token slots that must form whole, aligned pages:
/// `tokens[64k..64k+64]` must be `64p, 64p + 1, ..., 64p + 63` for some page `p`.
pub fn pages_of_tokens(tokens: &[Slot]) -> Result<Vec<LogicalPage>> {
    let page = PAGE_SIZE as u64;
    if tokens.len() % PAGE_SIZE != 0 {
        return Err(Error::MisalignedPrefix {
            tokens: tokens.len(),
            page_size: PAGE_SIZE,
        });
    }
    tokens
        .chunks_exact(PAGE_SIZE)
        .enumerate()
        .map(|(k, chunk)| {
            let first = chunk[0].0;
            let whole = first % page == 0
                && chunk
                    .iter()
                    .zip(first..)
                    .all(|(&slot, expected)| slot.0 == expected);
            if whole {
                Ok(LogicalPage(first / page))
            } else {
                Err(Error::HiCache(format!(
                    "token slots {}..{} are not one whole, aligned page (they start at slot {first})",
                    k * PAGE_SIZE,
                    (k + 1) * PAGE_SIZE
                )))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(pages: &[u64]) -> Vec<LogicalPage> {
        pages.iter().map(|&p| LogicalPage(p)).collect()
    }

    #[test]
    fn each_rank_keeps_its_pairs_in_local_pages() {
        let p = Placement::new(2).unwrap();
        // Rank 0 owns even pages; local pages are l / 2.
        let (device, host) = (lp(&[4, 6, 8, 12, 5, 14]), lp(&[10, 12, 14, 16, 3, 20]));
        let plan = TransferPlan::new(p, 0, &device, &host, 10, 20).unwrap();
        assert_eq!(plan.positions(), &[0, 1, 2, 3, 5]);
        assert_eq!(plan.device_pages(), &[2, 3, 4, 6, 7].map(LocalPage));
        assert_eq!(plan.host_pages(), &[5, 6, 7, 8, 10].map(LocalPage));
        assert_eq!(plan.runs().len(), 3);
        let other = TransferPlan::new(p, 1, &device, &host, 10, 20).unwrap();
        assert_eq!(other.positions(), &[4]);
        assert_eq!(other.requested(), 6);
    }

    #[test]
    fn every_rank_refuses_the_same_bad_operation() {
        let p = Placement::new(2).unwrap();
        for rank in 0..2 {
            let plan = |d: &[u64], h: &[u64]| TransferPlan::new(p, rank, &lp(d), &lp(h), 10, 10);
            assert!(matches!(
                plan(&[4, 5], &[6, 8]),
                Err(Error::WrongOwner { page: 8, .. })
            ));
            assert!(matches!(
                plan(&[4, 1], &[6, 9]),
                Err(Error::ReservedPage { page: 1, .. })
            ));
            assert!(matches!(
                plan(&[4, 20], &[6, 8]),
                Err(Error::OutOfRange { .. })
            ));
            assert!(matches!(
                plan(&[4, 6], &[8, 8]),
                Err(Error::DuplicatePage {
                    page: 8,
                    first: 0,
                    second: 1,
                    ..
                })
            ));
            assert!(matches!(
                plan(&[4, 4], &[8, 6]),
                Err(Error::DuplicatePage { page: 4, .. })
            ));
            assert!(plan(&[4], &[8, 6]).is_err());
        }
    }

    #[test]
    fn tokens_must_be_whole_aligned_pages() {
        let tokens: Vec<Slot> = (128..256).map(Slot).collect();
        assert_eq!(pages_of_tokens(&tokens).unwrap(), lp(&[2, 3]));
        assert!(matches!(
            pages_of_tokens(&tokens[..100]),
            Err(Error::MisalignedPrefix { tokens: 100, .. })
        ));
        let shifted: Vec<Slot> = (130..194).map(Slot).collect();
        assert!(pages_of_tokens(&shifted).is_err());
        let mut gap = tokens.clone();
        gap[70].0 += 1;
        assert!(pages_of_tokens(&gap)
            .unwrap_err()
            .to_string()
            .contains("64..128"));
    }
}
