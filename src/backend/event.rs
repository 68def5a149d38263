//! Points in a stream: an [`Event`] of the CPU twin (an operation count of one of its streams)
//! or of CUDA (a pooled driver event), comparable and queried without waiting.

use std::sync::Arc;

use super::StreamId;
use crate::error::{Error, Result};
use crate::gpu::PooledEvent;

/// A point in a backend's stream that other streams of the same device can wait for. Two
/// events are equal when they are the same point of the same stream (clones of one record).
#[derive(Debug, Clone)]
pub struct Event(pub(crate) EventInner);

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (
                EventInner::Cpu {
                    arena, stream, seq, ..
                },
                EventInner::Cpu {
                    arena: a,
                    stream: s,
                    seq: q,
                    ..
                },
            ) => (arena, stream, seq) == (a, s, q),
            (EventInner::Cuda { event: a, .. }, EventInner::Cuda { event: b, .. }) => {
                Arc::ptr_eq(a, b)
            }
            _ => false,
        }
    }
}

impl Event {
    /// An event that never completes: what stands for work whose own event could not be
    /// recorded, so the memory it uses is never freed under it.
    pub(crate) fn never() -> Event {
        Event(EventInner::Cpu {
            arena: u64::MAX,
            stream: u64::MAX,
            seq: u64::MAX,
            progress: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            at: None,
        })
    }

    /// The stream the event was recorded on.
    pub fn stream_id(&self) -> StreamId {
        match &self.0 {
            EventInner::Cpu { arena, stream, .. } => StreamId::Cpu {
                arena: *arena,
                stream: *stream,
            },
            EventInner::Cuda { stream, .. } => StreamId::Cuda(*stream),
        }
    }

    /// Whether the work before the event has completed, asked without waiting. A CUDA error
    /// (a context whose work failed for good) is returned as it is.
    pub fn is_complete(&self) -> Result<bool> {
        match &self.0 {
            EventInner::Cpu { progress, seq, .. } => {
                Ok(progress.load(std::sync::atomic::Ordering::Acquire) >= *seq)
            }
            EventInner::Cuda { event, .. } => event
                .try_is_complete()
                .map_err(Error::driver("cuEventQuery")),
        }
    }
}

/// What an event is on each backend.
#[derive(Debug, Clone)]
pub(crate) enum EventInner {
    /// The CPU backend: operation `seq` of stream `stream` of arena `arena`; a timed event also
    /// holds when the stream reached it, stamped by an operation of its own. `progress` is how
    /// many operations the stream has run, so completion is known without the arena's lock.
    Cpu {
        arena: u64,
        stream: u64,
        seq: u64,
        progress: Arc<std::sync::atomic::AtomicU64>,
        at: Option<Arc<std::sync::OnceLock<std::time::Instant>>>,
    },
    /// A CUDA event, and the stream (by its handle) it was recorded on.
    Cuda {
        event: Arc<PooledEvent>,
        stream: u64,
    },
}
