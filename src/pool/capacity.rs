//! The capacity planner: what a CP group's GPU (L1), pinned host (L2) and disk (L3) tiers hold
//! for a model, and how long a prefix takes to come back from each, from copy ceilings the
//! caller measured or knows. Pure arithmetic on plain data; nothing is allocated.
//!
//! - **GPU (L1)**: each rank's bytes split by [`Budget::plan`] (the attention scratch first,
//!   then whole pages), so the planner and a pool sized by the budget agree to the page.
//! - **Host (L2)**: each rank's host pool holds whole pages of the same bytes as its device
//!   pool (page 0 of each rank is padding in both), given in bytes or as a multiple of the
//!   device pool's pages (the pressure scenario's "host cache 4x larger").
//! - **Disk (L3)**: one store shared by the CP group (a page's key holds no rank, so any rank
//!   reads any page). A slot holds one whole page, every component of it (target latent of every
//!   layer, the draft's layer, indexer keys and scales), padded to the direct-I/O alignment.
//!
//! A prefix of `T` tokens is `ceil(T / 64)` pages; with page interleaving the busiest rank owns
//! `ceil(pages / N)` of them, and the ranks move their own pages at once, so a tier's reload time
//! is the busiest rank's bytes over that rank's ceiling: D2D for L1, pinned H2D for L2. From L3
//! the whole prefix's slots are read from the shared disk at its aggregate ceiling into L2, then
//! loaded into L1 as from L2 (prefetch, then load: the two times add up).

use std::fmt;

use crate::error::{Checked, Error, Result};
use crate::geometry::{CacheGeometry, PAGE_SIZE};
use crate::pool::budget::{Budget, BudgetRequest};
use crate::shard::Placement;

/// The direct-I/O alignment slots are padded to when the device does not say
/// (`statx` `STATX_DIOALIGN`): 4 KiB.
pub const DEFAULT_DIO_ALIGN: u64 = 4096;

/// The prefixes (in tokens) whose reload times a plan reports unless asked for others: 16K and
/// 128K.
pub const DEFAULT_PREFIXES: [u64; 2] = [16_384, 131_072];

/// How large each rank's host (L2) cache is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCapacity {
    /// Bytes of pinned host memory per rank for pages.
    Bytes(u64),
    /// This many times the pages of the rank's device pool.
    Factor(u64),
}

/// Copy ceilings in GB/s (10^9 bytes per second), each `None` where unknown (its reload times
/// are then unknown too).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ceilings {
    /// Device-to-device copy of one GPU.
    pub d2d_gbps: Option<f64>,
    /// Pinned host-to-device copy of one GPU.
    pub h2d_gbps: Option<f64>,
    /// Reads from the CP group's disk store, all ranks together.
    pub disk_gbps: Option<f64>,
}

/// What to plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityRequest {
    /// The cache of one rank.
    pub geometry: CacheGeometry,
    /// CP ranks N (1 = unsharded, no scratch).
    pub cp: u32,
    /// Each rank's GPU memory for scratch and pool, and what sizes the scratch.
    pub gpu: BudgetRequest,
    /// Each rank's host cache.
    pub host: HostCapacity,
    /// Bytes of the CP group's disk store.
    pub disk_bytes: u64,
    /// Direct-I/O alignment of the disk ([`DEFAULT_DIO_ALIGN`]): a power of two.
    pub dio_align: u64,
    /// The ceilings reload times are computed from.
    pub ceilings: Ceilings,
    /// Prefix lengths in tokens whose reload times to report ([`DEFAULT_PREFIXES`]).
    pub prefixes: Vec<u64>,
}

/// A tier of the cache hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Device memory of each rank (L1).
    Gpu,
    /// Pinned host memory of each rank (L2).
    Host,
    /// The disk store the CP group shares (L3).
    Disk,
}

impl Tier {
    /// The tiers, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Host, Tier::Disk];
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Gpu => "GPU (L1)",
            Tier::Host => "host (L2)",
            Tier::Disk => "disk (L3)",
        })
    }
}

/// What one tier holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierCapacity {
    /// Which tier.
    pub tier: Tier,
    /// Bytes its pages take: per rank for GPU and host, the whole store for the disk.
    pub bytes: u64,
    /// Pages per rank, the padding page included (`None` for the shared disk).
    pub pages_per_rank: Option<u64>,
    /// Pages of the CP group: logical pages (N x per rank) for GPU and host, slots for the
    /// disk.
    pub pages: u64,
    /// Tokens it can cache: the pages without each rank's padding page, 64 tokens each.
    pub tokens: u64,
}

/// How long a prefix takes to come back from one tier.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierReload {
    /// From which tier.
    pub tier: Tier,
    /// Whether the tier can hold the prefix at all.
    pub fits: bool,
    /// Seconds until the prefix is in GPU memory (`None` without the ceilings it needs).
    pub seconds: Option<f64>,
}

/// The reload of one prefix.
#[derive(Debug, Clone, PartialEq)]
pub struct Reload {
    /// Tokens of the prefix.
    pub tokens: u64,
    /// Its pages.
    pub pages: u64,
    /// Pages of the busiest rank: `ceil(pages / N)`.
    pub pages_per_rank: u64,
    /// Bytes the busiest rank moves into GPU memory.
    pub bytes_per_rank: u64,
    /// Bytes read from the disk store: every slot of the prefix.
    pub disk_bytes: u64,
    /// One entry per tier, in [`Tier::ALL`] order.
    pub tiers: Vec<TierReload>,
}

/// A capacity plan.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityPlan {
    /// How each rank's GPU memory splits: the scratch budget, pages, logical GPU slots.
    pub budget: Budget,
    /// Bytes of one L3 slot: a page of every component, padded to the direct-I/O alignment.
    pub slot_bytes: u64,
    /// What each tier holds, in [`Tier::ALL`] order.
    pub tiers: Vec<TierCapacity>,
    /// The prefixes' reload times, in the order asked.
    pub reloads: Vec<Reload>,
}

/// Bytes of one L3 slot of `geometry`: one page of every component, rounded up to `align` (a
/// power of two).
pub fn slot_bytes(geometry: &CacheGeometry, align: u64) -> Result<u64> {
    if !align.is_power_of_two() {
        return Err(Error::InvalidArgument(format!(
            "a direct-I/O alignment of {align} bytes (a power of two, such as {DEFAULT_DIO_ALIGN})"
        )));
    }
    let page = geometry.page_bytes_checked()? as u64;
    page.checked_next_multiple_of(align)
        .ok_or_else(|| Error::overflow(format!("a page of {page} bytes padded to {align}")))
}

/// Refuses a ceiling that is no positive, finite speed.
fn check_ceiling(name: &str, gbps: Option<f64>) -> Result<()> {
    match gbps {
        Some(g) if !(g.is_finite() && g > 0.0) => Err(Error::InvalidArgument(format!(
            "a {name} ceiling of {g} GB/s (a positive speed, or none)"
        ))),
        _ => Ok(()),
    }
}

/// Seconds to move `bytes` at `gbps`.
fn seconds(bytes: u64, gbps: Option<f64>) -> Option<f64> {
    gbps.map(|g| bytes as f64 / (g * 1e9))
}

impl CapacityPlan {
    /// Plans `req`. Refuses, before computing anything, a CP group of 0 ranks, a ceiling that is
    /// no speed, a non-power-of-two alignment and an empty prefix
    /// ([`Error::InvalidArgument`]); then memory that cannot hold what it must
    /// ([`Error::BudgetTooSmall`]: the GPU's scratch and two pages, a host pool of two pages,
    /// a disk of one slot); sizes past `u64` are [`Error::Overflow`].
    pub fn plan(req: &CapacityRequest) -> Result<CapacityPlan> {
        if req.cp == 0 {
            return Err(Error::InvalidArgument(
                "a CP group of 0 ranks: --cp is at least 1 (1 = unsharded)".into(),
            ));
        }
        let placement = Placement::new(req.cp)?;
        check_ceiling("D2D", req.ceilings.d2d_gbps)?;
        check_ceiling("pinned H2D", req.ceilings.h2d_gbps)?;
        check_ceiling("disk", req.ceilings.disk_gbps)?;
        if let Some(&bad) = req.prefixes.iter().find(|&&t| t == 0) {
            return Err(Error::InvalidArgument(format!(
                "a prefix of {bad} tokens: a reload moves at least one token"
            )));
        }
        let slot_bytes = slot_bytes(&req.geometry, req.dio_align)?;
        let budget = Budget::plan(&req.gpu, &req.geometry, placement).map_err(|e| match e {
            Error::BudgetTooSmall(why) => {
                Error::BudgetTooSmall(format!("GPU memory per rank: {why}"))
            }
            other => other,
        })?;
        let page = budget.page_bytes;
        let n = u64::from(req.cp);
        let token = PAGE_SIZE as u64;

        let host_pages = match req.host {
            HostCapacity::Bytes(bytes) => bytes / page,
            HostCapacity::Factor(f) => budget
                .pages
                .mul_or(f, || format!("host pages: {} pages x {f}", budget.pages))?,
        };
        if host_pages < 2 {
            return Err(Error::BudgetTooSmall(format!(
                "host memory per rank holds {host_pages} pages of {page} bytes; a host pool needs \
                 its padding page and at least one real page"
            )));
        }
        let slots = req.disk_bytes / slot_bytes;
        if slots == 0 {
            return Err(Error::BudgetTooSmall(format!(
                "a disk store of {} bytes holds no slot of {slot_bytes} bytes (one page of \
                 {page} bytes, padded to {} bytes)",
                req.disk_bytes, req.dio_align
            )));
        }
        let ranked = |tier, pages: u64| -> Result<TierCapacity> {
            let what = || format!("{tier}: {pages} pages per rank x {n} ranks");
            Ok(TierCapacity {
                tier,
                bytes: pages.mul_or(page, what)?,
                pages_per_rank: Some(pages),
                pages: pages.mul_or(n, what)?,
                // At least 2 pages per rank: the padding page leaves one or more.
                tokens: (pages - 1).mul_or(n, what)?.mul_or(token, what)?,
            })
        };
        let disk_what = || format!("{slots} slots of {slot_bytes} bytes");
        let tiers = vec![
            ranked(Tier::Gpu, budget.pages)?,
            ranked(Tier::Host, host_pages)?,
            TierCapacity {
                tier: Tier::Disk,
                bytes: slots.mul_or(slot_bytes, disk_what)?,
                pages_per_rank: None,
                pages: slots,
                tokens: slots.mul_or(token, disk_what)?,
            },
        ];

        let c = req.ceilings;
        let reloads = req
            .prefixes
            .iter()
            .map(|&tokens| {
                let pages = tokens.div_ceil(token);
                let pages_per_rank = pages.div_ceil(n);
                let what = || format!("a prefix of {tokens} tokens");
                let bytes_per_rank = pages_per_rank.mul_or(page, what)?;
                let disk_bytes = pages.mul_or(slot_bytes, what)?;
                let from_host = seconds(bytes_per_rank, c.h2d_gbps);
                let holds = |t: &TierCapacity| match t.pages_per_rank {
                    Some(per_rank) => pages_per_rank < per_rank,
                    None => pages <= t.pages,
                };
                let tiers = tiers
                    .iter()
                    .map(|t| TierReload {
                        tier: t.tier,
                        fits: holds(t),
                        seconds: match t.tier {
                            Tier::Gpu => seconds(bytes_per_rank, c.d2d_gbps),
                            Tier::Host => from_host,
                            Tier::Disk => seconds(disk_bytes, c.disk_gbps)
                                .zip(from_host)
                                .map(|(read, load)| read + load),
                        },
                    })
                    .collect();
                Ok(Reload {
                    tokens,
                    pages,
                    pages_per_rank,
                    bytes_per_rank,
                    disk_bytes,
                    tiers,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CapacityPlan {
            budget,
            slot_bytes,
            tiers,
            reloads,
        })
    }

    /// What `tier` holds (`None` only in a plan not built by [`CapacityPlan::plan`]).
    pub fn tier(&self, tier: Tier) -> Option<&TierCapacity> {
        self.tiers.iter().find(|t| t.tier == tier)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{LatentLayout, Model};

    fn request(cp: u32) -> CapacityRequest {
        CapacityRequest {
            geometry: Model::DeepseekV32.geometry(LatentLayout::Fp8Trtllm, true),
            cp,
            gpu: BudgetRequest::new(40_000_000_000, 131_072, 8192),
            host: HostCapacity::Factor(4),
            disk_bytes: 1_000_000_000_000,
            dio_align: DEFAULT_DIO_ALIGN,
            ceilings: Ceilings {
                d2d_gbps: Some(2000.0),
                h2d_gbps: Some(50.0),
                disk_gbps: Some(5.0),
            },
            prefixes: DEFAULT_PREFIXES.to_vec(),
        }
    }

    #[test]
    fn tiers_and_reloads_follow_the_budget_by_hand() {
        let plan = CapacityPlan::plan(&request(2)).unwrap();
        // 62 latent blocks + 62 indexer blocks; padded to 4 KiB.
        let page = 62 * (36_864 + 8448);
        assert_eq!(plan.budget.page_bytes, page);
        assert_eq!(plan.slot_bytes, page.next_multiple_of(4096));
        // Scratch: 8 x 128K + 8,192 + 64 rows, x 2 (parity) x 708 B x 2 (draft).
        let rows = 8 * 131_072 + 8192 + 64;
        assert_eq!(plan.budget.scratch_bytes, rows * 2 * 708 * 2);
        let gpu_pages = (40_000_000_000 - rows * 2 * 708 * 2) / page;
        let gpu = plan.tier(Tier::Gpu).unwrap();
        assert_eq!(gpu.pages_per_rank, Some(gpu_pages));
        assert_eq!(
            (gpu.pages, gpu.tokens),
            (2 * gpu_pages, (gpu_pages - 1) * 128)
        );
        let host = plan.tier(Tier::Host).unwrap();
        assert_eq!(host.pages_per_rank, Some(4 * gpu_pages));
        assert_eq!(host.bytes, 4 * gpu_pages * page);
        let disk = plan.tier(Tier::Disk).unwrap();
        assert_eq!(disk.pages, 1_000_000_000_000 / plan.slot_bytes);
        assert_eq!(disk.tokens, disk.pages * 64);

        let r = &plan.reloads[0];
        // 16K tokens: 256 pages, 128 on each rank.
        assert_eq!((r.pages, r.pages_per_rank), (256, 128));
        assert_eq!(r.bytes_per_rank, 128 * page);
        let s = |t: usize| r.tiers[t].seconds.unwrap();
        assert!((s(0) - (128 * page) as f64 / 2000e9).abs() < 1e-12);
        assert!((s(1) - (128 * page) as f64 / 50e9).abs() < 1e-12);
        let disk_read = (256 * plan.slot_bytes) as f64 / 5e9;
        assert!((s(2) - (disk_read + s(1))).abs() < 1e-12);
        assert!(r.tiers.iter().all(|t| t.fits));
    }

    #[test]
    fn unknown_ceilings_give_unknown_times_and_odd_prefixes_round_up() {
        let mut req = request(3);
        req.ceilings = Ceilings {
            h2d_gbps: Some(50.0),
            ..Ceilings::default()
        };
        req.prefixes = vec![65];
        let plan = CapacityPlan::plan(&req).unwrap();
        let r = &plan.reloads[0];
        // 65 tokens are 2 pages; 3 ranks: the busiest has 1.
        assert_eq!((r.pages, r.pages_per_rank), (2, 1));
        let secs: Vec<_> = r.tiers.iter().map(|t| t.seconds.is_some()).collect();
        assert_eq!(secs, [false, true, false]);
    }

    #[test]
    fn a_prefix_larger_than_a_tier_does_not_fit_it() {
        let mut req = request(1);
        req.gpu = BudgetRequest::new(100 * 2_809_344, 4096, 1024);
        req.host = HostCapacity::Bytes(1000 * 2_809_344);
        let plan = CapacityPlan::plan(&req).unwrap();
        assert_eq!(plan.budget.scratch_bytes, 0);
        let fits: Vec<_> = plan.reloads[0].tiers.iter().map(|t| t.fits).collect();
        // 256 pages: not in 100 GPU pages, in 1,000 host pages and the disk.
        assert_eq!(fits, [false, true, true]);
    }

    #[test]
    fn impossible_inputs_are_typed_errors() {
        let invalid = |req: CapacityRequest, says: &str| {
            let e = CapacityPlan::plan(&req).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            assert!(e.to_string().contains(says), "{e}");
        };
        invalid(request(0), "0 ranks");
        let mut r = request(2);
        r.ceilings.h2d_gbps = Some(0.0);
        invalid(r, "pinned H2D ceiling");
        let mut r = request(2);
        r.ceilings.disk_gbps = Some(f64::NAN);
        invalid(r, "disk ceiling");
        let mut r = request(2);
        r.dio_align = 3000;
        invalid(r, "power of two");
        let mut r = request(2);
        r.prefixes = vec![16_384, 0];
        invalid(r, "prefix of 0 tokens");

        let small = |req: CapacityRequest, says: &str| {
            let e = CapacityPlan::plan(&req).unwrap_err();
            assert!(matches!(e, Error::BudgetTooSmall(_)), "{e}");
            assert!(e.to_string().contains(says), "{e}");
        };
        let mut r = request(2);
        r.gpu.bytes = 1 << 30;
        small(r, "GPU memory per rank");
        let mut r = request(1);
        r.gpu.bytes = 2_809_344;
        small(r, "GPU memory per rank");
        let mut r = request(2);
        r.host = HostCapacity::Bytes(2_809_344);
        small(r, "host memory per rank holds 1 pages");
        let mut r = request(2);
        r.host = HostCapacity::Factor(0);
        small(r, "holds 0 pages");
        let mut r = request(2);
        r.disk_bytes = 2_809_344;
        small(r, "holds no slot of 2809856 bytes");
        let mut r = request(2);
        r.host = HostCapacity::Factor(u64::MAX);
        assert!(matches!(
            CapacityPlan::plan(&r).unwrap_err(),
            Error::Overflow { .. }
        ));
    }
}
