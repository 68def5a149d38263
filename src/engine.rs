//! The front door: what an engine that embeds kvshard needs, in one `use kvshard::engine::*`.
//!
//! Everything a forward pass's flow touches is here (examples/engine.rs uses nothing else:
//! CP2 prefill ranks, chunked prefill with per-layer quantized staging rows, owned-row writes,
//! P/D to a decode pool, a HiCache round trip, a second request on the cached prefix, zero
//! host waits per chunk):
//!
//! - memory and streams: a [`Backend`] per stream ([`CpuBackend`], in the [`StreamOrder`] of
//!   its choice, or [`CudaBackend`] on a [`Gpu`]), [`Buffer`], [`Event`], [`MemoryKind`], a
//!   kernel's [`Launch`] shape and the one [`Method`] vocabulary of how bytes move;
//!   [`enqueue_i64s`] puts slot indices (int64) on the device without waiting, ordered by the
//!   buffer's usage record; [`sync_counts`] checks that only `_sync` calls block;
//! - the cache's shape and indices: [`CacheGeometry`], [`PoolGeometry`], [`Model`] (the
//!   presets), [`LatentLayout`], [`IndexerScale`], [`Component`], [`PAGE_SIZE`],
//!   [`LogicalPage`], [`LocalPage`], [`Slot`], [`ModelLayer`], [`StoredLayer`];
//! - sharding and scheduling: [`Placement`], [`ShardAllocator`], [`RequestChain`],
//!   [`Admission`], [`Budget`];
//! - the forward pass's writes: the quantizers ([`quantize_latent`], [`quantize_indexer`],
//!   their input rows [`LATENT_INPUT_ROW_BYTES`] and [`INDEXER_INPUT_ROW_BYTES`], the checked
//!   `_sync` forms) into a [`ChunkStaging`] layer by layer ([`ChunkStaging::layer`]), then an
//!   [`OwnedRowWrite`] into the [`DevicePool`] ([`PoolBuffers`] and [`RawBuffer`] wrap the
//!   engine's own); the reference codecs the kernels are held to ([`quantize_latent_row`],
//!   [`quantize_indexer_row`], [`encode_e4m3`], [`decode_e4m3`], on [`bf16`] values);
//! - P/D and the engine's loop: [`Sender`], [`ChunkEnd`], [`PendingChunk`], [`PrefillLoop`]
//!   (its [`PrefillStep`]), [`Receiver`] (its [`ReceiveStep`]: [`Finished`] requests and their
//!   [`Outcome`], what is [`Overdue`]), [`Registration`], [`PoolLayout`], [`RemoteSpace`],
//!   [`BackendTransport`], [`Transport`], [`ChunkStatus`], [`DEFAULT_DEADLINE`], and the
//!   cross-process [`PrefillEndpoint`] / [`DecodeEndpoint`]; into a decode server sharded by
//!   token: [`DecodeLayout`], [`DecodeRegistration`], [`DecodeRank`] ([`Sender::open_decode`]);
//! - HiCache: [`HiCacheController`] (its [`HiCacheStep`] of [`BackupAck`]s and [`LoadAck`]s),
//!   [`HostPool`], [`HostLayout`], [`CacheNode`], [`Route`], [`Streams`], [`WritePolicy`],
//!   [`LoadHandle`];
//! - [`Error`] and [`Result`].
//!
//! Each item keeps its one home module (`kvshard::pool::DevicePool` and so on), where its
//! neighbours live; this module only gathers them. What an engine does not need (planning
//! internals, executor pieces: [`crate::advanced`]) is not here.
//!
//! The engine's loop is one call per scheduling step on each side: [`PrefillLoop::step`]
//! (every chunk in flight, in any order, failures, drops, kernel-reported errors),
//! [`Receiver::step`] (statuses in any order, deadlines) and [`HiCacheController::step`] (every
//! completed backup and load). None of them waits; docs/design.md, "The engine's loop".

pub use crate::backend::cpu::{CpuBackend, StreamOrder};
pub use crate::backend::cuda::CudaBackend;
pub use crate::backend::{
    enqueue_i64s, sync_counts, Backend, Buffer, Event, Launch, MemoryKind, SyncCounts,
};
pub use crate::chain::RequestChain;
pub use crate::copy::{Method, RemoteSpace};
pub use crate::fp8::{decode_e4m3, encode_e4m3, quantize_indexer_row, quantize_latent_row};
pub use crate::geometry::{
    CacheGeometry, Component, IndexerScale, LatentLayout, Model, PoolGeometry, PAGE_SIZE,
};
pub use crate::gpu::Gpu;
pub use crate::hicache::{
    BackupAck, CacheNode, HiCacheController, HiCacheStep, HostLayout, HostPool, LoadAck,
    LoadHandle, Route, Streams, WritePolicy,
};
pub use crate::index::{LocalPage, LogicalPage, ModelLayer, Slot, StoredLayer};
pub use crate::pool::{Budget, ChunkStaging, DevicePool, OwnedRowWrite, PoolBuffers, RawBuffer};
pub use crate::quantize::{
    quantize_indexer, quantize_indexer_checked_sync, quantize_latent, quantize_latent_checked_sync,
    INDEXER_INPUT_ROW_BYTES, LATENT_INPUT_ROW_BYTES,
};
pub use crate::shard::{Admission, DecodeLayout, Placement, ShardAllocator};
pub use crate::transfer::{
    BackendTransport, ChunkEnd, ChunkStatus, DecodeEndpoint, DecodeRank, DecodeRegistration,
    Finished, Outcome, Overdue, PendingChunk, PoolLayout, PrefillEndpoint, PrefillLoop,
    PrefillStep, ReceiveStep, Receiver, Registration, Sender, Transport, DEFAULT_DEADLINE,
};
pub use crate::{Error, Result};
/// The bf16 values the reference codecs take (the `half` crate's, which kvshard builds on).
pub use half::bf16;
