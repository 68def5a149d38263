//! HiCache (DOMAIN.md section 6): each rank's pinned host pool backing its device pool, and the
//! transfers between them.
//!
//! ```text
//! logical device pages + logical host pages (same on every rank)
//!        │  plan: keep this rank's pairs, check owners/range/reserved, map to local pages
//!        v
//!   TransferPlan ──> HostTransfer (one rank, one direction) ──> run on an IoBackend
//!                                                  │  SM kernel (zero-copy, ready counters)
//!                                                  │  copy engine (coalesced 2D / batch)
//!                                                  │  or run_staged: copy engine + relayout
//!                                                  v
//!                              HiCacheController (a Route per call: Direct or Staged):
//!                              load stream (per-layer readiness), backup stream (waits for
//!                              compute, FIFO acks), relayout streams, write policies
//! ```
//!
//! - [`host_pool`]: [`HostPool`] in the `layer_first`, `page_first` and `page_first_direct`
//!   layouts, allocated pinned (optionally next to the GPU, see [`NumaPlacement`]) or wrapping
//!   engine memory registered in page-aligned chunks;
//! - [`plan`]: [`TransferPlan`], the owner-aware, pure part of every transfer;
//! - [`io`]: [`HostTransfer`], one rank's transfer on any [`IoBackend`];
//! - [`controller`]: [`HiCacheController`], streams, acks and write policies, each transfer on
//!   a [`Route`]: direct on an [`IoBackend`] or staged through device staging ([`Relayout`]).
//!
//! The host allocator is a [`crate::shard::ShardAllocator`] over the host pool's pages (same
//! placement as the device): `alloc_matching` gives host pages of the device pages' owner
//! classes; the controller owns one.

pub mod controller;
pub mod host_pool;
pub mod io;
pub mod plan;

pub use controller::{
    BackupAck, CacheNode, HiCacheController, LoadAck, LoadHandle, Route, Streams, WritePolicy,
    DEFAULT_STAGING_PAGES,
};
pub use host_pool::{HostLayout, HostPool, HostRegion, LayoutStrides, NumaPlacement};
pub use io::{
    CounterWait, Direction, HostTransfer, IoBackend, IoCalls, LayerReady, LayerSignals, Layers,
    Relayout, StagedIo,
};
pub use plan::{pages_of_tokens, Run, TransferPlan};
