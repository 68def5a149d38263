//! What a chunk's sender tells the decode side: one [`ChunkStatus`] per (request, rank, chunk),
//! carried as it is in process, over the control channel and in NIXL notifications.

use std::fmt;

use super::ComponentBytes;
use crate::error::Error;

/// What happened to one chunk on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
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
#[derive(Debug, Clone, PartialEq, Eq)]
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
