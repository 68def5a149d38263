//! Cross-process building blocks for prefill/decode disaggregation on one host.
//!
//! Prefill and decode run as separate processes, one per GPU. The decode process allocates its KV
//! pool as exportable memory ([`crate::gpu::vmm`] on a GPU, [`shm::SharedMemory`] on the CPU twin;
//! [`shared_pool::ExportedPool`]) and publishes it over a [`channel::Channel`]; each prefill process
//! imports and maps it ([`shared_pool::ImportedPool`]) and writes pages straight into it, then reports
//! every chunk back over the same channel. The P/D protocol on top of these messages, as library
//! types, is `crate::transfer::endpoint`.
//!
//! # The control channel protocol
//!
//! One Unix-domain stream socket per prefill process; the decode side listens
//! ([`channel::Listener`]), prefill processes connect ([`channel::Channel::connect`]).
//!
//! **Frames.** Every frame is a 12-byte header followed by the payload (all little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `KVSC` ([`wire::MAGIC`]) |
//! | 4..6 | protocol version ([`wire::VERSION`]) |
//! | 6..8 | number of file descriptors attached to the frame (at most [`wire::MAX_FDS`]) |
//! | 8..12 | payload length in bytes (at most [`wire::MAX_PAYLOAD_BYTES`]) |
//!
//! File descriptors travel as `SCM_RIGHTS` ancillary data of the frame's first bytes. The
//! payload is one [`wire::Message`] in the [postcard] format (its variant order is part of the
//! protocol: new messages are appended, anything else bumps [`wire::VERSION`]). A receiver checks
//! the header before it reads the payload, so a peer cannot make it allocate past the cap, and
//! refuses trailing bytes, unknown variants and descriptor counts a message does not call for
//! ([`ProtocolError`](wire::ProtocolError)); after a violation the connection is dropped.
//!
//! **Handshake.** Both sides send [`wire::Message::Hello`] first (version, role, rank, shard) and
//! read the peer's; a frame of another version or a first message that is not `Hello` ends the
//! connection.
//!
//! **Messages.** `PublishPool` (decode → prefill: the pool's id and memory kind, regions,
//! per-component layer offsets, page stride and pages, and its geometry, postcard-encoded by
//! `shared_pool::encode_geometry`; one descriptor per region for the fd kinds), `Register` (decode →
//! prefill: a request's pool, cached prefix, destination pages after it and indexer-state pages
//! from position 0), `Chunk` (prefill → decode: the rank's `ChunkStatus` as it is: request, rank,
//! chunk, and the bytes per component and whether it was final, or the failure), `EventHandle` (a CUDA interprocess event), `Abort`, `Heartbeat`,
//! `Bye`,
//! `NixlPeer` (either way: a NIXL agent's metadata, geometry and the memory the peer may
//! address; see `transfer::nixl`).
//!
//! A session, per prefill rank:
//!
//! ```text
//! decode (Listener)                              prefill rank r (Channel::connect, retrying)
//!        <──────────── Hello { version, role, rank, shard } ────────────>   both ways
//! PublishPool { regions, components, .. } ──>    import and map each region (fds attached)
//!                                           <──  EventHandle x E (GPU: the rank's events)
//! Register { request, pool, pages, .. } ────>    write the request's chunks into the pool
//!                                           <──  Chunk(ChunkStatus { request, rank, chunk, .. })
//! Abort { request, reason }               <──>   either way, any time
//! Bye                                     <──>   either way; then the connection closes
//! Heartbeat                               <──>   every 100 ms both ways, from the channel itself
//! ```
//!
//! **Liveness.** A peer that exits or is killed is seen at once (end of stream). Each side also
//! sends a `Heartbeat` every [`channel::Liveness::heartbeat`] from a thread of its own, and a
//! peer silent for [`channel::Liveness::timeout`] (default 750 ms) is reported as
//! [`Error::PeerGone`](crate::Error::PeerGone), so a stopped or hung process is detected
//! within a second; so is one that stops reading (sends time out after the same limit).
//!
//! [postcard]: https://postcard.jamesmunns.com/wire-format

pub(crate) mod channel;
pub mod group;
mod link;
mod proc_stat;
pub(crate) mod shared_pool;
pub(crate) mod shm;
pub mod wire;

pub use channel::{recv_any, Channel, Listener, Liveness, Received};
pub(crate) use proc_stat::proc_stat;
pub use shared_pool::{ExportedPool, ImportedPool, PeerBackend};
pub use shm::SharedMemory;
