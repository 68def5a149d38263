//! Page-interleaved sharding (docs/design.md, "Ownership"): ownership math, the rotated owner
//! allocator and the owner-local resolution reference. Pure CPU math: nothing here touches a
//! backend.

mod allocator;
mod placement;
mod resolve;

pub use allocator::{AllocRequest, Allocation, ChainStart, ShardAllocator};
pub use placement::Placement;
pub use resolve::{resolve_owned, scratch_rows, ResolveMode, Resolved};
