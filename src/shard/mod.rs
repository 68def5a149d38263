//! Page-interleaved sharding (DOMAIN.md section 3): ownership math, the rotated owner allocator
//! and owner-local index resolution.

mod placement;

pub use placement::Placement;
