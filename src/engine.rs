//! The front door: what an engine that embeds kvshard needs, in one `use kvshard::engine::*`.
//!
//! It re-exports the types of the engine's own loop (examples/engine.rs uses nothing else):
//!
//! - memory and streams: a [`Backend`] per stream ([`CpuBackend`] or [`CudaBackend`] on a
//!   [`Gpu`]), [`Buffer`], [`Event`], [`MemoryKind`], a kernel's [`Launch`] shape and the one
//!   [`Method`] vocabulary of how bytes move; [`sync_counts`] to check that only `_sync` calls
//!   block;
//! - the cache's shape and indices: [`CacheGeometry`], [`PoolGeometry`], [`LatentLayout`],
//!   [`Component`], [`PAGE_SIZE`], [`LogicalPage`], [`LocalPage`], [`Slot`], [`ModelLayer`];
//! - sharding and scheduling: [`Placement`], [`ShardAllocator`], [`RequestChain`],
//!   [`Admission`], [`Budget`];
//! - the device pool and its writes: [`DevicePool`], [`PoolBuffers`], [`RawBuffer`],
//!   [`ChunkStaging`], [`OwnedRowWrite`];
//! - P/D: [`Sender`], [`ChunkEnd`], [`Receiver`], [`Registration`], [`PoolLayout`],
//!   [`RemoteSpace`], [`BackendTransport`], [`Transport`], [`ChunkStatus`], [`DEFAULT_DEADLINE`],
//!   and the cross-process [`PrefillEndpoint`] / [`DecodeEndpoint`]; into a decode server sharded
//!   by token: [`DecodeLayout`], [`DecodeRegistration`], [`DecodeRank`] ([`Sender::open_decode`]);
//! - HiCache: [`HiCacheController`], [`HostPool`], [`HostLayout`], [`CacheNode`], [`Route`],
//!   [`Streams`], [`WritePolicy`], [`LoadHandle`];
//! - [`Error`] and [`Result`].
//!
//! Each item keeps its one home module (`kvshard::pool::DevicePool` and so on), where its
//! neighbours live; this module only gathers them. What an engine does not need (planning
//! internals, executor pieces: [`crate::advanced`]) is not here.

pub use crate::backend::cpu::CpuBackend;
pub use crate::backend::cuda::CudaBackend;
pub use crate::backend::{sync_counts, Backend, Buffer, Event, Launch, MemoryKind, SyncCounts};
pub use crate::chain::RequestChain;
pub use crate::copy::{Method, RemoteSpace};
pub use crate::geometry::{CacheGeometry, Component, LatentLayout, PoolGeometry, PAGE_SIZE};
pub use crate::gpu::Gpu;
pub use crate::hicache::{
    CacheNode, HiCacheController, HostLayout, HostPool, LoadHandle, Route, Streams, WritePolicy,
};
pub use crate::index::{LocalPage, LogicalPage, ModelLayer, Slot};
pub use crate::pool::{Budget, ChunkStaging, DevicePool, OwnedRowWrite, PoolBuffers, RawBuffer};
pub use crate::shard::{Admission, DecodeLayout, Placement, ShardAllocator};
pub use crate::transfer::{
    BackendTransport, ChunkEnd, ChunkStatus, DecodeEndpoint, DecodeRank, DecodeRegistration,
    PoolLayout, PrefillEndpoint, Receiver, Registration, Sender, Transport, DEFAULT_DEADLINE,
};
pub use crate::{Error, Result};
