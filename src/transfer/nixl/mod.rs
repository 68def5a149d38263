//! P/D across hosts on NVIDIA's NIXL (feature `nixl`): the prefill ranks' [`NixlTransport`]
//! writes each chunk into the decode pool through NIXL (UCX underneath: RDMA, NVLink/CUDA IPC,
//! TCP), and the decode side's [`NixlTarget`] turns NIXL's notifications into the chunk
//! statuses its [`Receiver`](super::Receiver) completes requests from, unchanged.
//!
//! ```text
//! decode: NixlTarget (pool + bounce slots per rank)       prefill rank r: NixlTransport
//!   peer_info(r) ──────────── NixlPeer (control channel) ───────────> connect(peer) -> RemoteSpace
//!   connect(r, peer) <─────── NixlPeer (its agent, geometry) ──────── peer_info()
//!   register(registration) ── Register (the engine's) ──────────────> Sender::open(.., RemoteSpace)
//!                                                                     Sender::send: one NIXL write
//!   poll(): notices ─> scatter bounced sections ─> Receiver <──────── per chunk (indices into
//!           (in chunk order per rank)           <── notification ──   lists prepared once), its
//!                                                                     notice riding on it
//!           SlotFree(slot) ─────────────── notification ────────────> the slot may be reused
//! ```
//!
//! **Registration.** Each side registers its pool once (its allocation, or the engine's layer
//! buffers): DRAM on the CPU backend (the arena's allocations are host memory), VRAM on a GPU.
//! The decode side also registers its bounce slots (`slots` per prefill rank), the prefill side
//! its own. Agents meet over the control channel ([`crate::ipc`]) with a
//! [`NixlPeer`](crate::ipc::wire::NixlPeer) message each way: agent metadata, geometry (checked
//! against one's own before any byte moves: the wrong geometry refuses the peer on both
//! sides) and the addresses to write to.
//!
//! **Descriptor lists.** On connecting, a prefill rank prepares two lists once: its pool's
//! (page, layer) blocks followed by every prefix of its bounce slots, and the same of the decode
//! side (the decode's pool blocks, and the slots kept for this rank). A chunk is then one
//! transfer request made by indices into the two lists (`makeXferReq`), with the chunk's notice
//! as its notification: writes (push), never reads.
//!
//! **Few descriptors.** Per section (the chunk's latent KV; the final chunk's indexer state):
//! - *coalesced*: the block indices of every owned page, run by run; NIXL merges the blocks of
//!   a run that are contiguous on both sides, so one descriptor per run and layer is posted.
//!   A rank's owned pages sit N apart on the decode side, so for N > 1 a run is one page;
//! - *bounce*: the rank packs its owned pages of the section into a registered slot with a
//!   block copy (page-major: the k pages of a component are contiguous whatever k is), posts one
//!   descriptor per component into the matching slot of the decode side, and the decode
//!   scatters the slot into its pages with a block copy once the notice arrives, then frees
//!   the slot with a `SlotFree` notice;
//! - *per block*: one descriptor per (page, layer), unmerged: the field's practice, a baseline.
//!
//! [`NixlMode::Auto`] picks per chunk: bounce when a slot is free on both sides, every section
//! fits a slot, and the coalesced plan's mean descriptor is under
//! [`NixlConfig::bounce_below`] bytes (512 KiB by default). Why that rule: posting costs about
//! a microsecond per descriptor, and a packing or scattering copy costs about `bytes / 1 TB/s`
//! on an H200 on each side, so the bounce pays off when descriptors are small: 36 KB latent
//! blocks (one page per run, N > 1) bounce; runs of tens of pages (N = 1) go coalesced. The
//! constants are first estimates, for the lead's GPU measurement to confirm (BENCHMARKS.md).
//!
//! **Completion.** Every chunk produces exactly one notice, sent by NIXL with the chunk's
//! transfer (so it arrives only after the bytes have landed), alone for a chunk that moved
//! nothing (the empty final chunk), or alone as a failure. The decode side orders notices per
//! (request, rank) by chunk before they reach the [`Receiver`](super::Receiver), whose
//! one-final-status-per-rank rule then works unchanged.
//!
//! **Decode context parallelism.** A decode server sharded by token (docs/dcp.md) is M
//! decode ranks, each a [`NixlTarget`] of its own; a prefill rank reaches them through a
//! [`NixlDecodeTransport`] (one connection per decode rank). Each chunk is packed, per decode
//! rank, densely into a bounce slot of that rank's connection (one `kvs_decode_scatter`
//! launch for all of them) and posted as one descriptor per decode rank from a list segment
//! of whole-slot prefixes; the decode rank unpacks it into its pages with the same kernel
//! (its notice, `Dense`, says how) before its receiver sees the status.
//!
//! **Failures.** A transfer NIXL reports failed, or that has not landed within
//! [`NixlConfig::transfer_timeout`], fails its chunk on the prefill side and sends a failure
//! notice; a peer whose control channel reports it gone ([`NixlTransport::peer_gone`],
//! [`NixlTarget::rank_gone_sync`]) fails every open request with it on this side, within the
//! channel's liveness timeout; a request still missing a rank's last status at its
//! [`NixlConfig::deadline`] (a notice lost, a final chunk never sent) is reported by
//! [`NixlTarget::expire`], naming the ranks and the chunks that arrived; a geometry mismatch refuses the peer on both sides, and every
//! request involving it fails. Requests with other peers continue. Nothing leaks: requests,
//! prepared lists, registrations and remote metadata are released when done or when their
//! peer goes; a request still moving when its completion is dropped is kept until NIXL is done
//! with it.

mod agent;
mod chunks;
mod config;
mod connection;
mod decode_group;
mod initiator;
mod lists;
mod notice;
mod peer_geometry;
mod registration;
mod target;

pub use agent::load;
pub use config::{NixlConfig, NixlMode};
pub use decode_group::NixlDecodeTransport;
pub use initiator::NixlTransport;
pub(crate) use peer_geometry::{geometry_of, wire_geometry};
pub use registration::NixlBackend;
pub use target::NixlTarget;
