//! Sharded device pools of one rank.
//!
//! A [`DevicePool`] holds the four components of a DSA cache (target latent, target indexer,
//! draft latent, draft indexer; docs/design.md, "Byte layouts") for `pages` physical pages:
//! per component and stored layer a buffer of `pages` packed blocks, page `p` at
//! `base + p * block_bytes`. Pools kvshard allocates put every component in one allocation with
//! a uniform layer stride (so a page across all layers is one 2D copy); pools wrapping an
//! engine's buffers take whatever per-layer addresses the engine has, each checked to hold the
//! pool's pages.
//!
//! A pool is a [`BlockSpace`](crate::copy::BlockSpace); engines share it as `Arc<DevicePool>` between the objects that
//! use it (writer, sender, HiCache controller).

mod budget;
pub mod capacity;
mod device_pool;
#[cfg(feature = "nixl")]
pub mod disk;
mod engine_buffers;
mod gather_copies;
pub(crate) mod host;
pub(crate) mod layout;
mod write;

pub use budget::{Budget, BudgetRequest, DEFAULT_CONTEXTS};
pub use device_pool::DevicePool;
pub use engine_buffers::{PoolBuffers, RawBuffer};
pub(crate) use layout::PoolLayout;
pub use write::{ChunkStaging, OwnedRowWrite};
