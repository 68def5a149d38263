//! P/D transfer (docs/design.md, "P/D"): the KV cache of a request moves from the N sharded
//! prefill ranks of a context-parallel group to one unsharded decode pool, or to the M ranks
//! of a decode server sharded by token (decode context parallelism, docs/dcp.md:
//! [`DecodeRegistration`], [`DecodePlan`], [`Sender::open_decode`]).
//!
//! ```text
//! decode                       every prefill rank r (of N)
//! ──────                       ───────────────────────────
//! Registration ──(wire)──────> Sender::open(registration, RemoteSpace)
//!                              per chunk: SendPlan (plain data, CPU, no backend)
//!                                         Transport::submit -> Completion (kernel, copy
//!                                         engine, CPU reference, peer map, NIXL, ...)
//!                              PendingChunk::poll / wait_sync -> ChunkStatus, or
//!                              Err(ChunkFailed); a chunk dropped undelivered: Sender::send /
//!                              take_dropped report it
//! Receiver::receive <─(wire)── ChunkStatus (bytes per component, or the failure)
//! Finished: after one final status from each of the N ranks
//! Receiver::expire: Overdue (Error::TransferDeadline) when the deadline passes first
//! ```
//!
//! - `plan`: pairs source and destination pages by logical page position, keeps this rank's
//!   positions, resolves owner-local source pages, coalesces runs (the copy layer's
//!   [`OwnedRuns`](crate::copy::OwnedRuns)) and lists the layers they apply to; validates both
//!   sides' geometry and every page before any byte moves.
//! - `transport`: the [`Transport`] and [`Completion`] traits every transport implements;
//!   `backend_transport`: the in-process [`BackendTransport`] (also what sends into a decode pool of
//!   another process mapped into this one, [`BackendTransport::peer`]) and the
//!   [`DescriptorBatch`] of absolute ranges network engines take.
//! - `sender`, `receiver`, `chunk_status`: the per-rank [`Sender`], the decode-side [`Receiver`] that completes
//!   a request only once every rank has reported its final chunk, fails it on any failure, and
//!   reports it [`Overdue`] when its deadline passes first, and the one [`ChunkStatus`] both
//!   speak (with its [`ComponentBytes`], defined at the bottom of the crate, below `ipc`, so the
//!   control channel and NIXL's notifications carry it as it is).
//! - `endpoint`: the cross-process protocol as library types, [`DecodeEndpoint`] and
//!   [`PrefillEndpoint`], over the control channel of [`crate::ipc`].
//! - `prefill_loop`: [`PrefillLoop`], the prefill side of the engine's loop: every chunk in
//!   flight polled in any order each step, failures held until nothing else of the request
//!   moves, kernel-reported errors; the decode side's step is [`Receiver::step`].
//! - `stats`: the counters every transport keeps (bytes, descriptors, post and transfer time,
//!   failures), named after the metrics vLLM's NIXL connector and KVBM export.
//! - `bounce`: whole-chunk bounce buffers ([`BounceBuffer`]) for engines that post one
//!   descriptor per chunk and rank (Mooncake's, through the Python package): the pack of a
//!   chunk's owned blocks into one contiguous range, and the decode side's scatter.
//! - `decode_bounce`: the same route into a decode server sharded by token: each decode rank's
//!   rows of a chunk packed densely into one region ([`DenseChunk`] says how), one range per
//!   decode rank, unpacked there into its pages.
//! - `nixl` (feature `nixl`): the transport on NVIDIA's NIXL, for prefill and decode on
//!   different hosts.
//! - `mooncake`: the transport on a transfer engine that moves raw ranges and carries no
//!   notification (Mooncake's, driven from Python): the engine-facing sender, the side
//!   channel's frames and the decode side that checks them.
//! - `stream_transport`: [`StreamTransport`], in-process, each chunk on the stream its caller names.

pub(crate) mod backend_transport;
mod bounce;
mod decode_bounce;
pub(crate) mod endpoint;
pub mod mooncake;
#[cfg(feature = "nixl")]
pub mod nixl;
pub(crate) mod plan;
mod prefill_loop;
mod receiver;
mod sender;
pub(crate) mod stats;
mod stream_transport;
pub(crate) mod transport;

pub use crate::chunk_status::{ChunkResult, ChunkStatus, ComponentBytes};
pub use backend_transport::{BackendTransport, CallCounts, DescriptorBatch};
pub use bounce::{BounceBuffer, Packed, PackedSection};
pub use decode_bounce::{
    region_layout, region_of, DenseBounce, DenseChunk, DensePacked, DenseSection,
};
pub use endpoint::{DecodeEndpoint, DecodeEvent, PrefillEndpoint, PrefillEvent, CHUNK_EVENTS};
pub use plan::{
    ChunkRange, DecodePlan, DecodeRank, DecodeRegistration, DecodeSection, Descriptor, PoolLayout,
    PrefillRank, Registration, Section, SectionComponent, SendPlan,
};
pub use prefill_loop::{PrefillLoop, PrefillStep};
pub use receiver::{
    Finished, MissingChunks, Outcome, Overdue, Progress, RankFailure, ReceiveStep, Receiver,
    DEFAULT_DEADLINE, MAX_CHUNKS_AHEAD, MAX_PREFILL_RANKS,
};
pub use sender::{ChunkEnd, PendingChunk, Sender};
pub use stats::{Metric, MetricKind, Posted, StatsSnapshot, TimeSnapshot, TransferStats};
pub use stream_transport::{StreamChoice, StreamTransport};
pub use transport::{Completion, Transport};
