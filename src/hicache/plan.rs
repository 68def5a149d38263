//! Owner-aware transfer planning: pure CPU work, done before anything is enqueued.
//!
//! A HiCache operation names logical device pages and logical host pages, paired by position,
//! identically on every rank of the shard group. Each rank keeps the pairs it owns and maps both
//! sides to its local pages (`l / N`) before the transfer's first copy is enqueued. Every pair
//! is checked first, owned or not, so all ranks accept or refuse the same operation: pages must
//! be in range, not reserved (`0..N`), owned by the same rank on both sides, and used once per
//! side. A rank that owns nothing gets an empty plan that is still submitted, so acks and
//! layer-ready signals stay in step across ranks.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::shard::Placement;

/// A stretch of pairs where the local device page and the local host page both advance by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Run {
    /// First local device page.
    pub device: u64,
    /// First local host page.
    pub host: u64,
    /// Pages in the run (at least one).
    pub pages: u64,
}

/// One rank's share of a HiCache operation, in local pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPlan {
    placement: Placement,
    rank: u32,
    requested: usize,
    positions: Vec<usize>,
    device_pages: Vec<u64>,
    host_pages: Vec<u64>,
    runs: Vec<Run>,
}

impl TransferPlan {
    /// Plans rank `rank`'s share of moving logical pages `device[i] <-> host[i]`, where each
    /// rank's device pool holds `device_pages` pages and its host pool `host_pages`.
    pub fn new(
        placement: Placement,
        rank: u32,
        device: &[u64],
        host: &[u64],
        device_pages: u64,
        host_pages: u64,
    ) -> Result<Self> {
        if rank >= placement.shard() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of shard size {}",
                placement.shard()
            )));
        }
        if device.len() != host.len() {
            return Err(Error::HiCache(format!(
                "{} device pages paired with {} host pages",
                device.len(),
                host.len()
            )));
        }
        let device_limit = placement.logical_pages(device_pages);
        let host_limit = placement.logical_pages(host_pages);
        let mut device_seen = HashMap::with_capacity(device.len());
        let mut host_seen = HashMap::with_capacity(host.len());
        let mut plan = Self {
            placement,
            rank,
            requested: device.len(),
            positions: Vec::new(),
            device_pages: Vec::new(),
            host_pages: Vec::new(),
            runs: Vec::new(),
        };
        for (i, (&d, &h)) in device.iter().zip(host).enumerate() {
            check_page(placement, d, device_limit, "logical device page")?;
            check_page(placement, h, host_limit, "logical host page")?;
            let owner = placement.owner(d);
            if placement.owner(h) != owner {
                return Err(Error::WrongOwner {
                    page: h,
                    owner: placement.owner(h),
                    expected: owner,
                });
            }
            for (seen, page, side) in [(&mut device_seen, d, "device"), (&mut host_seen, h, "host")]
            {
                if let Some(first) = seen.insert(page, i) {
                    return Err(Error::HiCache(format!(
                        "logical {side} page {page} appears at positions {first} and {i}"
                    )));
                }
            }
            if owner == rank {
                plan.push(i, placement.local_page(d), placement.local_page(h));
            }
        }
        Ok(plan)
    }

    fn push(&mut self, position: usize, device: u64, host: u64) {
        self.positions.push(position);
        self.device_pages.push(device);
        self.host_pages.push(host);
        match self.runs.last_mut() {
            Some(run) if run.device + run.pages == device && run.host + run.pages == host => {
                run.pages += 1;
            }
            _ => self.runs.push(Run {
                device,
                host,
                pages: 1,
            }),
        }
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
        self.positions.len()
    }

    /// Whether this rank moves nothing (it still submits the operation).
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Positions in the operation of the pairs this rank moves, ascending.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// Local device page of each moved pair.
    pub fn device_pages(&self) -> &[u64] {
        &self.device_pages
    }

    /// Local host page of each moved pair.
    pub fn host_pages(&self) -> &[u64] {
        &self.host_pages
    }

    /// Moved pairs coalesced into runs, in pair order.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }
}

fn check_page(placement: Placement, page: u64, limit: u64, what: &'static str) -> Result<()> {
    if page >= limit {
        return Err(Error::OutOfRange {
            what,
            index: i64::try_from(page).unwrap_or(i64::MAX),
            limit,
        });
    }
    if placement.is_reserved(page) {
        return Err(Error::ReservedPage {
            page,
            shard: placement.shard(),
        });
    }
    Ok(())
}

/// The logical pages of `tokens` logical token slots that must form whole, aligned pages:
/// `tokens[64k..64k+64]` must be `64p, 64p + 1, ..., 64p + 63` for some page `p`.
pub fn pages_of_tokens(tokens: &[u64]) -> Result<Vec<u64>> {
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
            let first = chunk[0];
            let whole = first % page == 0
                && chunk
                    .iter()
                    .zip(first..)
                    .all(|(&slot, expected)| slot == expected);
            if whole {
                Ok(first / page)
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

    #[test]
    fn runs_coalesce_where_both_sides_advance() {
        let p = Placement::new(2).unwrap();
        // Rank 0 owns even pages; local pages are l / 2.
        let device = [4, 6, 8, 12, 5, 14];
        let host = [10, 12, 14, 16, 3, 20];
        let plan = TransferPlan::new(p, 0, &device, &host, 10, 20).unwrap();
        assert_eq!(plan.positions(), &[0, 1, 2, 3, 5]);
        assert_eq!(plan.device_pages(), &[2, 3, 4, 6, 7]);
        assert_eq!(plan.host_pages(), &[5, 6, 7, 8, 10]);
        assert_eq!(
            plan.runs(),
            &[
                Run {
                    device: 2,
                    host: 5,
                    pages: 3
                },
                Run {
                    device: 6,
                    host: 8,
                    pages: 1
                },
                Run {
                    device: 7,
                    host: 10,
                    pages: 1
                },
            ]
        );
        let other = TransferPlan::new(p, 1, &device, &host, 10, 20).unwrap();
        assert_eq!(other.positions(), &[4]);
        assert_eq!(other.requested(), 6);
    }

    #[test]
    fn tokens_must_be_whole_aligned_pages() {
        let tokens: Vec<u64> = (128..256).collect();
        assert_eq!(pages_of_tokens(&tokens).unwrap(), vec![2, 3]);
        assert!(matches!(
            pages_of_tokens(&tokens[..100]),
            Err(Error::MisalignedPrefix { tokens: 100, .. })
        ));
        let shifted: Vec<u64> = (130..194).collect();
        assert!(pages_of_tokens(&shifted).is_err());
        let mut gap = tokens.clone();
        gap[70] += 1;
        assert!(pages_of_tokens(&gap)
            .unwrap_err()
            .to_string()
            .contains("64..128"));
    }
}
