//! HiCache (docs/design.md, "HiCache"): each rank's pinned host pool backing its device pool,
//! and the transfers between them.
//!
//! ```text
//! logical device pages + logical host pages (same on every rank)
//!        │  plan: keep this rank's pairs, check owners/range/reserved, map to local pages
//!        v
//!   TransferPlan ──> HostTransfer (one rank, one direction)
//!                      ├── direct: a Method (block kernel with ready counters, copy engine,
//!                      │           per-block and batched baselines)
//!                      └── staged: copy engine into device staging + a relayout
//!                                         │
//!                                         v
//!                   HiCacheController (a Route per call: Direct or Staged): load stream
//!                   (per-layer readiness), backup stream (waits for compute, FIFO acks),
//!                   relayout streams, write policies
//! ```
//!
//! - [`HostPool`] (defined in `pool/host`, public here) in the `layer_first`, `page_first` and `page_first_direct`
//!   layouts, allocated pinned (optionally next to the GPU, see [`NumaPlacement`]) or wrapping
//!   engine memory registered in page-aligned chunks;
//! - `transfer_plan`: [`TransferPlan`], the owner-aware, pure part of every transfer;
//! - `direct`: [`HostTransfer`] straight between the pools with a [`Method`](crate::copy::Method);
//! - `staged`: the staged pipeline ([`StagedIo`], a kernel or copy-engine relayout);
//! - `reload`: [`reload`], a prefix cached by one CP group loaded by a group of another
//!   parallelism (a [`crate::shard::ReloadPlan`] run: block copies, or decode scatters);
//! - `layer_ready`: [`LayerReady`], how a consumer waits for one layer;
//! - `controller`: [`HiCacheController`], streams, acks and write policies;
//! - `storage` (feature `nixl`): the L3 stage below the host pool (write-through and
//!   write-back to a `pool::disk::DiskStore`, prefetch ahead of a load,
//!   FIFO acks), on a worker thread.
//!
//! The host allocator is a [`crate::shard::ShardAllocator`] over the host pool's pages (same
//! placement as the device): `alloc_matching` gives host pages of the device pages' owner
//! classes; the controller owns one.

mod acks;
mod controller;
mod direct;
mod layer_ready;
mod reload;
mod route;
mod staged;
#[cfg(feature = "nixl")]
mod storage;
#[cfg(feature = "nixl")]
mod storage_stage;
mod transfer_plan;

pub use acks::{BackupAck, HiCacheStep, LoadAck, LoadHandle};
pub use controller::{CacheNode, HiCacheController, Streams, WritePolicy, DEFAULT_STAGING_PAGES};
pub use direct::HostTransfer;
// The host pools are defined with the device pools (`pool/host`); HiCache is where engines
// meet them, so this is their public path.
pub use crate::pool::host::{
    DraftPacking, HostBufferLayout, HostFormat, HostLayout, HostMemory, HostPool, HostRegion,
    LayoutStrides, NumaPlacement, RegisteredRegion,
};
pub use layer_ready::LayerReady;
#[cfg(feature = "nixl")]
pub use reload::load_reads_sync;
pub use reload::{reload, PrefixSource, ReaderRank, Reload};
pub use route::{Route, AUTO_RELAYOUT_CTAS, AUTO_STAGED_PAGES};
pub use staged::StagedIo;
#[cfg(feature = "nixl")]
pub use storage_stage::{StorageAck, StorageOp, StoragePolicy};
pub use transfer_plan::{pages_of_tokens, TransferPlan};
