//! Admission of a CP prefill batch (docs/design.md, "Prefill"), as SGLang schedules it: which
//! waiting requests join the next batch and how much of each is prefilled now, so that the
//! batch's gather fits the attention scratch ([`crate::shard::GatherPlan`]) and its pages fit
//! the pool; and [`evict_until_allocatable`], which calls the engine's eviction until the
//! allocator can take a request.
//!
//! Per request of a scheduling pass (page size 64, N ranks):
//!
//! - `block += ceil((prefix_len / 64) / N)`, `chunk_pages += ceil(extend_len / 64)`;
//! - the request is deferred if `N * block * 64 > max_prefix_tokens` (the owner-major prefix
//!   region would overflow) or its chunk's pages do not fit `chunk_tokens`; a request whose
//!   chunk does not fit whole is chunked instead when at least one page of room is left, the
//!   continuing chunk ending on a page boundary of the request (`prefix_len + extend_len` a
//!   multiple of 64: the rest of the prefix's last page, then whole pages), so the next
//!   chunk's prefix is whole pages, what the allocator extends a chain after;
//! - every admitted request reserves `N * 64` tokens of the pool on top of its chunk (the last
//!   partial round of owners a chain may cost), and is deferred when the pool's admission
//!   capacity cannot cover that;
//! - the first request of a pass that exceeds a scratch region alone can never be admitted: an
//!   [`Error::NeverAdmissible`] instead of a deferral that would come back every pass. (A pool
//!   deferral never is: eviction can make room.)

use std::fmt;

use crate::error::{Checked, Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::shard::{Placement, ShardAllocator};

// Defined with the error type, which carries it (`Error::EvictionStalled`).
pub use crate::error::causes::EvictionStall;

const PAGE: u64 = PAGE_SIZE as u64;

/// The scratch limits of one batch. Unsharded engines (N = 1) have no scratch and pass
/// `u64::MAX` as `max_prefix_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AdmissionLimits {
    /// Tokens of the prefix region of a scratch slot (`crate::pool::Budget::max_prefix_tokens`).
    pub max_prefix_tokens: u64,
    /// Tokens one batch may prefill (the chunk region, the chunked-prefill size).
    pub chunk_tokens: u64,
}

/// A waiting request as a scheduling pass sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Candidate {
    /// Tokens of its cached prefix (matched in the radix tree, or prefilled by earlier chunks).
    pub prefix_len: u64,
    /// Tokens it still has to prefill.
    pub extend_len: u64,
}

/// Why a request waits for a later pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Deferral {
    /// The batch's prefix region would need `needed` tokens (`N * block * 64`) of `limit`.
    PrefixRegion {
        /// Tokens the region would need with the request.
        needed: u64,
        /// Tokens it holds.
        limit: u64,
    },
    /// Not one more page of chunk fits: the chunks would need `needed` tokens of `limit`.
    ChunkRegion {
        /// Tokens (whole pages) the chunks would need with the request.
        needed: u64,
        /// The chunk tokens of a batch.
        limit: u64,
    },
    /// The pool cannot take it: the batch would reserve `needed` tokens of the `available`
    /// admission capacity (evict, [`evict_until_allocatable`], then try again).
    Pool {
        /// Tokens the batch would reserve with the request (its overhead included).
        needed: u64,
        /// The pool's admission capacity.
        available: u64,
    },
}

impl fmt::Display for Deferral {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PrefixRegion { needed, limit } => {
                write!(f, "prefix region: {needed} of {limit} tokens")
            }
            Self::ChunkRegion { needed, limit } => {
                write!(f, "chunk region: {needed} of {limit} tokens")
            }
            Self::Pool { needed, available } => {
                write!(f, "pool: {needed} of {available} tokens")
            }
        }
    }
}

/// What becomes of an offered request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// It joins the batch with `extend_len` tokens prefilled now.
    Admit {
        /// Tokens prefilled in this batch.
        extend_len: u64,
        /// Whether that is the rest of the request; otherwise a continuing chunk, ending on a
        /// page boundary of the request (`prefix_len + extend_len` a multiple of 64), and the
        /// remainder waits for a later pass.
        last: bool,
    },
    /// It waits.
    Defer(Deferral),
}

/// One scheduling pass: requests are offered in priority order and admitted while the batch
/// fits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    placement: Placement,
    limits: AdmissionLimits,
    capacity: u64,
    block: u64,
    chunk_pages: u64,
    reserved: u64,
    admitted: usize,
    offered: usize,
}

impl Admission {
    /// A pass for a shard group of `placement` under `limits`, with the pool able to admit
    /// `capacity` tokens (`ShardAllocator::admission_capacity`, taken when the pass starts).
    pub fn new(placement: Placement, limits: AdmissionLimits, capacity: u64) -> Self {
        Self {
            placement,
            limits,
            capacity,
            block: 0,
            chunk_pages: 0,
            reserved: 0,
            admitted: 0,
            offered: 0,
        }
    }

    /// Offers the next request. Admitted, it counts towards the batch; deferred, the batch is
    /// unchanged. An [`Error::NeverAdmissible`] when the batch is still empty and the request
    /// alone exceeds a scratch region; an [`Error::Overflow`] when a count overflows.
    pub fn offer(&mut self, candidate: Candidate) -> Result<Decision> {
        let request = self.offered;
        self.offered += 1;
        let shard = u64::from(self.placement.shard());
        let limits = self.limits;
        let first = self.admitted == 0;
        let never = |what, needed, limit| Error::NeverAdmissible {
            request,
            what,
            needed,
            limit,
        };

        let block = self
            .block
            .add_or((candidate.prefix_len / PAGE).div_ceil(shard), || {
                format!("prefix pages per owner with request {request}")
            })?;
        let prefix_needed = block
            .mul_or(shard, || format!("prefix pages with request {request}"))?
            .mul_or(PAGE, || format!("prefix tokens with request {request}"))?;
        if prefix_needed > limits.max_prefix_tokens {
            if first {
                return Err(never(
                    "prefix region",
                    prefix_needed,
                    limits.max_prefix_tokens,
                ));
            }
            return Ok(Decision::Defer(Deferral::PrefixRegion {
                needed: prefix_needed,
                limit: limits.max_prefix_tokens,
            }));
        }

        // The admitted chunks' pages fit the chunk tokens (so this never saturates).
        let room = limits.chunk_tokens.saturating_sub(self.chunk_pages * PAGE);
        let whole = candidate.extend_len.div_ceil(PAGE);
        let fits = whole.checked_mul(PAGE).is_some_and(|tokens| tokens <= room);
        let (extend_len, last) = if fits {
            (candidate.extend_len, true)
        } else {
            // A continuing chunk ends on a page boundary of the request, so the next chunk's
            // prefix is whole pages: the rest of the prefix's last page, then whole pages, in
            // as many chunk pages as the room holds (shorter than the request, which needs
            // more pages than that).
            let pages = room / PAGE;
            let head = (PAGE - candidate.prefix_len % PAGE) % PAGE;
            let floored = match (head, pages) {
                (_, 0) => 0,
                (0, p) => p * PAGE,
                (h, p) => h + (p - 1) * PAGE,
            };
            if floored == 0 {
                let needed = self
                    .chunk_pages
                    .add_or(whole, || format!("chunk pages with request {request}"))?
                    .saturating_mul(PAGE);
                if first {
                    return Err(never("chunk region", needed, limits.chunk_tokens));
                }
                return Ok(Decision::Defer(Deferral::ChunkRegion {
                    needed,
                    limit: limits.chunk_tokens,
                }));
            }
            (floored, false)
        };

        let reserved = self
            .reserved
            .add_or(extend_len, || {
                format!("tokens reserved with request {request}")
            })?
            .add_or(shard * PAGE, || {
                format!("tokens reserved with request {request}")
            })?;
        if reserved > self.capacity {
            return Ok(Decision::Defer(Deferral::Pool {
                needed: reserved,
                available: self.capacity,
            }));
        }

        self.block = block;
        // Fits: at most the chunk tokens' pages.
        self.chunk_pages += extend_len.div_ceil(PAGE);
        self.reserved = reserved;
        self.admitted += 1;
        Ok(Decision::Admit { extend_len, last })
    }

    /// Prefix pages per owner of the batch so far: `sum ceil((prefix_len / 64) / N)`.
    pub fn block(&self) -> u64 {
        self.block
    }

    /// Chunk pages of the batch so far.
    pub fn chunk_pages(&self) -> u64 {
        self.chunk_pages
    }

    /// Tokens of the pool the batch reserves: its chunks plus `N * 64` per request.
    pub fn reserved_tokens(&self) -> u64 {
        self.reserved
    }

    /// Requests admitted so far.
    pub fn admitted(&self) -> usize {
        self.admitted
    }
}

/// What [`evict_until_allocatable`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Eviction {
    /// Calls of the eviction callback.
    pub calls: usize,
    /// Pages they freed.
    pub pages_freed: usize,
    /// The admission capacity reached.
    pub capacity: u64,
}

/// Calls `evict` (the engine's eviction: it frees pages of `allocator`, e.g. the device pages
/// of the least recently used radix-tree leaves) until `allocator.admission_capacity()` covers
/// `needed` tokens (a request's tokens plus `request_overhead()`, or an [`Admission`]'s
/// [`Deferral::Pool`] `needed`). Every rank runs it identically on its identical allocator.
/// Stops with [`Error::EvictionStalled`] when even an empty pool could not, or when a call
/// frees nothing; an error of `evict` is returned as it is.
pub fn evict_until_allocatable(
    allocator: &mut ShardAllocator,
    needed: u64,
    mut evict: impl FnMut(&mut ShardAllocator) -> Result<()>,
) -> Result<Eviction> {
    let shard = u64::from(allocator.placement().shard());
    // The allocator holds a state byte per logical page, so this cannot saturate in practice.
    let most = (allocator.pages_per_rank() - 1)
        .saturating_mul(shard)
        .saturating_mul(PAGE);
    let stalled = |allocator: &ShardAllocator, reason| Error::EvictionStalled {
        needed,
        capacity: allocator.admission_capacity(),
        reason,
    };
    if needed > most {
        return Err(stalled(allocator, EvictionStall::NeverFits { most }));
    }
    let start = allocator.total_free();
    let mut calls = 0;
    while allocator.admission_capacity() < needed {
        let before = allocator.total_free();
        evict(allocator)?;
        calls += 1;
        // Each call must free a page: free pages are bounded, so the loop ends.
        if allocator.total_free() <= before {
            return Err(stalled(allocator, EvictionStall::NothingFreed { calls }));
        }
    }
    Ok(Eviction {
        calls,
        pages_freed: allocator.total_free().saturating_sub(start),
        capacity: allocator.admission_capacity(),
    })
}
