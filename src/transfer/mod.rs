//! P/D transfer (docs/design.md, "P/D"): the KV cache of a request moves from the N sharded
//! prefill ranks of a context-parallel group to one unsharded decode pool.
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
//! - [`plan`]: pairs source and destination pages by logical page position, keeps this rank's
//!   positions, resolves owner-local source pages, coalesces runs (the copy layer's
//!   [`OwnedRuns`](crate::copy::OwnedRuns)) and lists the layers they apply to; validates both
//!   sides' geometry and every page before any byte moves.
//! - [`transport`]: the [`Transport`] and [`Completion`] traits every transport implements;
//!   [`exec`]: the in-process [`BackendTransport`] (also what sends into a decode pool of
//!   another process mapped into this one, [`BackendTransport::peer`]) and the
//!   [`DescriptorBatch`] of absolute ranges network engines take.
//! - send, receive, status: the per-rank [`Sender`], the decode-side [`Receiver`] that completes
//!   a request only once every rank has reported its final chunk, fails it on any failure, and
//!   reports it [`Overdue`] when its deadline passes first, and the one [`ChunkStatus`] both
//!   speak.
//! - [`endpoint`]: the cross-process protocol as library types, [`DecodeEndpoint`] and
//!   [`PrefillEndpoint`], over the control channel of [`crate::ipc`].
//! - [`stats`]: the counters every transport keeps (bytes, descriptors, post and transfer time,
//!   failures), named after the metrics vLLM's NIXL connector and KVBM export.
//! - `nixl` (feature `nixl`): the transport on NVIDIA's NIXL, for prefill and decode on
//!   different hosts.

pub mod endpoint;
pub mod exec;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod plan;
mod receive;
mod send;
pub mod stats;
mod status;
pub mod transport;

use std::fmt;
use std::ops::AddAssign;

pub use crate::copy::Method;
pub use endpoint::{DecodeEndpoint, DecodeEvent, PrefillEndpoint, PrefillEvent, CHUNK_EVENTS};
pub use exec::{
    block_copies, kernel_pieces, BackendTransport, CallCounts, DescriptorBatch, KERNEL_PIECE_BYTES,
};
pub use plan::{
    ChunkRange, Descriptor, PoolLayout, PrefillRank, Registration, Section, SectionComponent,
    SendPlan,
};
pub use receive::{
    Finished, MissingChunks, Outcome, Overdue, Progress, RankFailure, Receiver, DEFAULT_DEADLINE,
    MAX_PREFILL_RANKS,
};
pub use send::{ChunkEnd, PendingChunk, Sender};
pub use stats::{Metric, MetricKind, Posted, StatsSnapshot, TimeSnapshot, TransferStats};
pub use status::{ChunkResult, ChunkStatus};
pub use transport::{Completion, Transport};

use crate::geometry::Component;

/// Bytes per cache component (target latent, target indexer, draft latent, draft indexer):
/// what a chunk, a rank or a request moved. Each byte counted was read once and written once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ComponentBytes {
    /// Indexed like [`Component::ALL`].
    bytes: [u64; 4],
}

fn slot(component: Component) -> usize {
    match component {
        Component::TargetLatent => 0,
        Component::TargetIndexer => 1,
        Component::DraftLatent => 2,
        Component::DraftIndexer => 3,
    }
}

impl ComponentBytes {
    /// Bytes of `component`.
    pub fn get(&self, component: Component) -> u64 {
        self.bytes[slot(component)]
    }

    /// Counts `bytes` more of `component` (saturating: a byte counter never wraps).
    pub fn add(&mut self, component: Component, bytes: u64) {
        let slot = &mut self.bytes[slot(component)];
        *slot = slot.saturating_add(bytes);
    }

    /// Bytes of every component together (saturating).
    pub fn total(&self) -> u64 {
        self.bytes.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }
}

impl AddAssign for ComponentBytes {
    fn add_assign(&mut self, other: Self) {
        for (a, b) in self.bytes.iter_mut().zip(other.bytes) {
            *a = a.saturating_add(b);
        }
    }
}

impl fmt::Display for ComponentBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} B", self.total())?;
        let mut parts = Component::ALL
            .iter()
            .filter(|&&c| self.get(c) > 0)
            .peekable();
        if parts.peek().is_some() {
            f.write_str(" (")?;
            let mut first = true;
            for &c in parts {
                if !first {
                    f.write_str(", ")?;
                }
                first = false;
                write!(f, "{c} {}", self.get(c))?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn component_bytes_add_up_and_print_only_what_moved() {
        let mut a = ComponentBytes::default();
        assert_eq!(a.to_string(), "0 B");
        a.add(Component::TargetLatent, 10);
        a.add(Component::DraftIndexer, 5);
        let mut b = a;
        b += a;
        assert_eq!(b.get(Component::TargetLatent), 20);
        assert_eq!(b.get(Component::TargetIndexer), 0);
        assert_eq!(b.total(), 30);
        assert_eq!(b.to_string(), "30 B (target latent 20, draft indexer 10)");
    }
}
