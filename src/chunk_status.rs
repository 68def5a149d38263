//! What a chunk's sender tells the decode side: one [`ChunkStatus`] per (request, rank, chunk),
//! and the [`ComponentBytes`] it counts. The one shape of a chunk status: carried as it is in
//! process, over the control channel (`ipc::wire::Message::Chunk`) and in NIXL notifications.
//!
//! It sits at the bottom of the crate (it uses only `geometry` and `error`) so that both `ipc`
//! and `transfer` can carry it; the module is private, and its public path is `transfer`'s
//! re-export (`kvshard::transfer::ChunkStatus`). Its serde encoding is part of both wire
//! formats: changing a field here bumps the control channel's `VERSION` and the NIXL notice's.

use std::fmt;
use std::ops::AddAssign;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::geometry::Component;

/// Bytes per cache component (target latent, target indexer, draft latent, draft indexer):
/// what a chunk, a rank or a request moved. Each byte counted was read once and written once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
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

/// What happened to one chunk on one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChunkResult {
    /// The chunk's bytes landed.
    Sent {
        /// Bytes this rank moved for the chunk, per component (zero when it owned nothing).
        bytes: ComponentBytes,
        /// Whether this was the request's final chunk.
        last: bool,
    },
    /// The chunk failed, and with it the request; the rank sends nothing more for it.
    Failed {
        /// Why (the error, as it travels over the wire).
        reason: String,
    },
}

/// One rank's report on one chunk of one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkStatus {
    /// Request id.
    pub request: u64,
    /// The reporting prefill rank.
    pub rank: u32,
    /// Index of the chunk in the request's send order.
    pub chunk: u32,
    /// What happened.
    pub result: ChunkResult,
}

impl ChunkStatus {
    /// Whether this is the rank's last status for the request (final chunk sent, or failure).
    pub fn is_terminal(&self) -> bool {
        match self.result {
            ChunkResult::Sent { last, .. } => last,
            ChunkResult::Failed { .. } => true,
        }
    }

    /// The failed status an [`Error::ChunkFailed`] stands for (what the decode side must hear),
    /// or `None` for any other error.
    pub fn from_error(error: &Error) -> Option<ChunkStatus> {
        match error {
            Error::ChunkFailed {
                request,
                rank,
                chunk,
                reason,
            } => Some(ChunkStatus {
                request: *request,
                rank: *rank,
                chunk: *chunk,
                result: ChunkResult::Failed {
                    reason: reason.clone(),
                },
            }),
            _ => None,
        }
    }
}

impl fmt::Display for ChunkStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "request {} rank {} chunk {}: ",
            self.request, self.rank, self.chunk
        )?;
        match &self.result {
            ChunkResult::Sent { bytes, last } => {
                write!(f, "sent {bytes}{}", if *last { " (final)" } else { "" })
            }
            ChunkResult::Failed { reason } => write!(f, "failed: {reason}"),
        }
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

    #[test]
    fn statuses_round_trip_as_they_are() {
        let mut bytes = ComponentBytes::default();
        bytes.add(Component::TargetLatent, 7);
        bytes.add(Component::DraftIndexer, 1 << 40);
        for result in [
            ChunkResult::Sent { bytes, last: true },
            ChunkResult::Failed {
                reason: "no".into(),
            },
        ] {
            let status = ChunkStatus {
                request: 9,
                rank: 2,
                chunk: 4,
                result,
            };
            let encoded = postcard::to_allocvec(&status).unwrap();
            assert_eq!(
                postcard::from_bytes::<ChunkStatus>(&encoded).unwrap(),
                status
            );
        }
    }
}
