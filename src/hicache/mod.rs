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
//! - [`host_pool`]: [`HostPool`] in the `layer_first`, `page_first` and `page_first_direct`
//!   layouts, allocated pinned (optionally next to the GPU, see [`NumaPlacement`]) or wrapping
//!   engine memory registered in page-aligned chunks;
//! - [`plan`]: [`TransferPlan`], the owner-aware, pure part of every transfer;
//! - [`direct`]: [`HostTransfer`] straight between the pools with a [`Method`];
//! - [`staged`]: the staged pipeline ([`StagedIo`], a kernel or copy-engine relayout);
//! - [`signals`]: [`LayerReady`], how a consumer waits for one layer;
//! - [`controller`]: [`HiCacheController`], streams, acks and write policies.
//!
//! The host allocator is a [`crate::shard::ShardAllocator`] over the host pool's pages (same
//! placement as the device): `alloc_matching` gives host pages of the device pages' owner
//! classes; the controller owns one.

pub mod controller;
pub mod direct;
/// The host pools, defined with the device pools (`pool/host`) and re-exported here, where
/// HiCache and engines use them.
pub mod host_pool {
    pub use crate::pool::host::{
        DraftPacking, HostBufferLayout, HostFormat, HostLayout, HostMemory, HostPool, HostRegion,
        LayoutStrides, NumaPlacement, RegisteredRegion,
    };
}
pub mod plan;
pub mod signals;
pub mod staged;

pub use crate::copy::{CounterWait, Direction, IoCalls, LayerSignals, Layers, Method};
pub use controller::{
    BackupAck, CacheNode, HiCacheController, LoadAck, LoadHandle, Route, Streams, WritePolicy,
    DEFAULT_STAGING_PAGES,
};
pub use direct::HostTransfer;
pub use host_pool::{HostLayout, HostPool, HostRegion, LayoutStrides, NumaPlacement};
pub use plan::{pages_of_tokens, TransferPlan};
pub use signals::LayerReady;
pub use staged::StagedIo;
