//! The events a [`Gpu`](super::Gpu) keeps for reuse: a [`PooledEvent`] goes back to its device's pool when
//! dropped.

use std::ops::Deref;
use std::sync::{Mutex, Weak};

use cudarc::driver::CudaEvent;

use crate::lock::lock;

/// Most events of each kind a [`Gpu`](super::Gpu) keeps for reuse; more are destroyed when dropped.
const POOLED_EVENTS: usize = 1024;

/// Events no one holds any more, kept for reuse: every enqueue records a few (stream order,
/// usage records, completions), and creating and destroying a CUDA event each time costs more
/// host time than recording one (two driver calls and two context binds more).
#[derive(Default)]
pub(super) struct EventPool {
    timed: Vec<CudaEvent>,
    untimed: Vec<CudaEvent>,
}

impl EventPool {
    pub(super) fn kind(&mut self, timing: bool) -> &mut Vec<CudaEvent> {
        if timing {
            &mut self.timed
        } else {
            &mut self.untimed
        }
    }
}

/// An event of a [`Gpu`](super::Gpu)'s pool ([`Gpu::pooled_event`](super::Gpu::pooled_event)): a [`CudaEvent`] that goes back to the
/// pool when dropped. Reuse is safe: it is dropped only when no one holds it, and a later
/// record replaces what it tracked (a stream wait enqueued earlier keeps the point it named).
pub struct PooledEvent {
    pub(super) event: Option<CudaEvent>,
    pub(super) timing: bool,
    pub(super) pool: Weak<Mutex<EventPool>>,
}

impl Deref for PooledEvent {
    type Target = CudaEvent;

    fn deref(&self) -> &CudaEvent {
        // Some from creation until `drop` takes it.
        self.event
            .as_ref()
            .unwrap_or_else(|| unreachable!("a pooled event is held until dropped"))
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        let (Some(event), Some(pool)) = (self.event.take(), self.pool.upgrade()) else {
            return;
        };
        let mut pool = lock(&pool);
        let kind = pool.kind(self.timing);
        if kind.len() < POOLED_EVENTS {
            kind.push(event);
        }
    }
}

impl std::fmt::Debug for PooledEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledEvent")
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}
