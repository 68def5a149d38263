//! P/D on a transfer engine that moves raw ranges and carries no notification (Mooncake's
//! `TransferEngine`, driven from Python by `kvshard.mooncake`; docs/mooncake.md): kvshard plans
//! every chunk, the engine moves it, and the chunk statuses ride a side channel of their own.
//!
//! ```text
//! decode: MooncakeReceiver                              prefill rank r: MooncakeSender
//!   pool, `slots` BounceBuffers per rank                  pool, one BounceBuffer per slot
//!   join(Hi) -> Hello (engine, layer bases, slots) ──────> DecodeTarget
//!   register(registration) ─── Register ─────────────────> open
//!                                                         send: plan -> MooncakeChunk (lists,
//!                                                         or one range packed into a slot)
//!                          <── the engine's write ─────── posted by the engine
//!   feed(bytes): scatter, order, <── Status ───────────── once the engine reported it landed
//!   poll(): Receiver -> Finished     (slot, sections)
//!   Free(slot, request, chunk) ──────────────────────────> bounce_free: the slot may take a chunk
//!   expire(): Overdue, Abort ────────────────────────────> the rank gives the request up,
//!                          <── Aborted ────────────────── once nothing of it is in flight
//! ```
//!
//! - `frames`: the side channel's frames and the [`FrameReader`](frames::FrameReader) that checks
//!   them (what the fuzz target `mooncake_frames` feeds).
//! - `prefill_side`: the prefill side, [`MooncakeSender`]: a [`Sender`](super::Sender) whose transport
//!   hands each chunk to the engine ([`MooncakeChunk`], `prefill_side/chunk.rs`) instead of moving
//!   it, into unsharded decodes or decode context-parallel ranks.
//! - `decode_side`: the decode side, [`MooncakeReceiver`]: bounce scatters, per-rank chunk order,
//!   every status checked before use, gone ranks and deadlines; `decode_side/dense.rs` a decode
//!   context-parallel rank's shares and the checked unpacking of its dense regions.
//! - `addresses`: addresses as the engine registers them ([`EngineAddresses`]).

mod addresses;
mod decode_side;
pub mod frames;
mod prefill_side;

pub use addresses::{merged, pool_memory, EngineAddresses, PoolMemory};
pub use decode_side::{MooncakeReceiver, SideCounters, MAX_HELD_STATUSES, MAX_SLOTS};
pub use prefill_side::{
    DecodePart, DecodeTarget, MooncakeChunk, MooncakeConfig, MooncakeMode, MooncakeSender,
};
