//! How a consumer learns that one model layer of a load has landed: an event recorded after the
//! layer's copies, or a ready counter of a signalled one-launch load reaching its target.

use crate::backend::{Backend, Event};
use crate::copy::CounterWait;
use crate::error::Result;

/// Readiness of one model layer of a load.
#[derive(Debug, Clone)]
pub enum LayerReady {
    /// An event recorded on the load stream after the layer's copies.
    Event(Event),
    /// A ready counter reaching a target (one-launch loads).
    Counter(CounterWait),
}

impl LayerReady {
    /// Makes later work on `consumer` wait for this layer only (no host involvement).
    pub fn wait(&self, consumer: &dyn Backend) -> Result<()> {
        match self {
            Self::Event(e) => consumer.wait(e),
            Self::Counter(c) => c.wait(consumer),
        }
    }
}
