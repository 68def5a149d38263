//! Page-interleaved sharding (DOMAIN.md section 3): ownership math, the rotated owner allocator
//! and owner-local index resolution.

mod allocator;
mod placement;
mod resolve;

pub use allocator::{AllocRequest, Allocation, ChainStart, ShardAllocator};
pub use placement::Placement;
pub use resolve::{
    resolve_owned, scratch_rows, scratch_rows_device, ResolveMode, Resolved, Resolver,
};
