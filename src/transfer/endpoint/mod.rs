//! P/D across processes on one host: the decode process publishes its pool(s) and per-request
//! registrations over the control channel ([`crate::ipc`]), N prefill processes attach, map the
//! pool and write every chunk straight into it ([`BackendTransport::peer`](crate::transfer::BackendTransport::peer)), and chunk completions flow
//! back. [`DecodeEndpoint`] and [`PrefillEndpoint`] are the two sides of that protocol as library
//! types; an engine with a bootstrap of its own can replace them and drive the same pieces
//! itself ([`ExportedPool`](crate::ipc::ExportedPool), [`ImportedPool`](crate::ipc::ImportedPool), [`BackendTransport::peer`](crate::transfer::BackendTransport::peer), [`Sender`](crate::transfer::Sender), [`Receiver`](crate::transfer::Receiver)).
//!
//! # The protocol
//!
//! One Unix-domain socket per prefill rank, framed messages of [`crate::ipc::wire`]:
//!
//! ```text
//! decode (DecodeEndpoint::bind)                 prefill rank r of N (PrefillEndpoint::connect)
//!   <─────────────── Hello { role, rank r, shard N } ───────────────>   both ways
//!                                          <──  EventHandle x E (GPU only: the rank's ring of
//!                                               interprocess events, before any Chunk)
//!   PublishPool { pool, memory, regions, .. } ──>  map the pool (fds by SCM_RIGHTS, or fabric
//!                                                  or IPC handles), check its geometry
//!   Register { request, pool, pages, .. } ────>  the request's destination pages
//!                                          <──  Chunk(ChunkStatus { request, rank, chunk, .. })
//!                                               per chunk, in order, the final one included
//!                                               (an empty final chunk when r owns nothing)
//!   Abort { request, reason } ────────────────>  answered by a failed Chunk
//!   (heartbeats both ways; EOF or 750 ms of silence: the peer is gone)
//! ```
//!
//! - **Completion.** A rank reports every chunk of every request, in order, including chunks it
//!   owns nothing of; a failure (a plan that does not validate, an abort) is a `Chunk` whose
//!   status is [`ChunkResult::Failed`](crate::transfer::ChunkResult::Failed), the rank's last
//!   status for the request. The decode completes a request
//!   only after one final status from each of the N ranks ([`Receiver`](crate::transfer::Receiver)), exactly as in-process.
//!   A repeated status, or one of a request no longer open (a late answer to a request that
//!   failed), is dropped and counted ([`DecodeEndpoint::dropped_statuses`]), never taken twice.
//! - **Ordering with events (GPU).** A rank that sent E event handles records event `k mod E`
//!   on its stream right before its k-th `Chunk` (counting every `Chunk` it sends, in
//!   order) and sends the `Chunk` at once, without waiting for the copy; the decode takes
//!   the status only once that event has completed. A later record of the same event completes
//!   later in the same stream, so waiting for a newer record is never wrong, only later. A rank
//!   without events (the CPU twin) sends a `Chunk` only once the chunk has landed.
//! - **Failures.** A rank that exits, is killed, or falls silent is gone within a second (the
//!   channel's end of stream or liveness timeout): every open request it was sending fails on
//!   the decode side, whose other ranks are told to abort it. A failed request's pages are
//!   handed back ([`DecodeEvent::Finished`]) once no rank can write them any more: every live
//!   rank has answered and the process of every gone rank has exited (a hung process keeps them
//!   held until it does). When the decode is gone, a prefill fails every request it was sending,
//!   waits for its own copies to land and unmaps the pools ([`PrefillEvent::Closed`]); the engine
//!   then frees the requests' pages.
//! - **Deadlines.** Every request is due [`DecodeEndpoint::deadline`] after its registration
//!   ([`DEFAULT_DEADLINE`](super::DEFAULT_DEADLINE) unless [`DecodeEndpoint::set_deadline`]
//!   says otherwise). A request still missing a rank's last status then (a final chunk never
//!   sent, a rank alive but silent about it) is reported as [`DecodeEvent::Overdue`], naming the
//!   ranks and the chunks that did arrive, and those ranks are told to abort it; it is handed
//!   back, failed, once they have answered (or are gone and have exited), as any failed request.
//!   A rank answers once none of its chunks of the request waits to be reported: with a failed
//!   status if it is still sending it, with an `Abort` of its own if it is done with it (its
//!   last status was lost on the way), which the decode takes as the rank's failed last status.

mod decode;
mod prefill;

pub use decode::{DecodeEndpoint, DecodeEvent};
pub use prefill::{PrefillEndpoint, PrefillEvent, CHUNK_EVENTS};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_can_move_to_other_threads() {
        fn send<T: Send>() {}
        send::<DecodeEndpoint>();
        send::<PrefillEndpoint>();
    }
}
