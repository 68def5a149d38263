//! Page-interleaved sharding (docs/design.md, "Ownership" and "Prefill"): ownership math, the
//! rotated owner allocator, the owner-local resolution reference, and a CP prefill batch's
//! admission and gather plan; and how a decode server sharded by token places a request
//! (`DecodeLayout`, docs/dcp.md), and which rank reloads which page of a cached prefix
//! (`ReloadPlan`, docs/storage.md). Pure CPU math: nothing here touches a backend.

mod admission;
mod allocator;
mod decode_layout;
mod gather;
mod placement;
mod reload_plan;
mod resolve;

pub use admission::{
    evict_until_allocatable, Admission, AdmissionLimits, Candidate, Decision, Deferral, Eviction,
    EvictionStall,
};
pub(crate) use allocator::PageGenerations;
pub use allocator::{AllocRequest, Allocation, ChainStart, ShardAllocator};
pub use decode_layout::{DecodeLayout, DecodeRow, DenseRows, MAX_DECODE_RANKS};
pub use gather::{GatherPlan, GatherRequest, ScratchLayout};
pub use placement::Placement;
pub use reload_plan::{CpGroup, Keep, PageRead, Reader, ReloadPlan};
pub use resolve::{resolve_owned, scratch_rows, ResolveMode, Resolved};
