//! Per-layer ready counters: a signalled block copy counts every finished (page, layer pair)
//! unit into the u32 counter of the pair's model layer, so one launch can publish each layer's
//! completion on its own, and a consumer stream waits for one layer with no host involvement.

use crate::backend::{kept, Backend, Buffer, Event};
use crate::error::{Checked, Error, Result};
use crate::index::ModelLayer;

/// Per-model-layer u32 ready counters that signalled launches count into.
///
/// Counters only grow: each signalled run adds its units to the targets kept here, so the
/// target of a layer covers every run counted so far. Runs that count into one set of
/// counters must be enqueued on one stream, in the order they were counted.
#[derive(Debug)]
pub struct LayerSignals {
    counters: Buffer,
    /// Where `backend`'s stream had zeroed the counters: every wait on them waits for it first.
    zeroed: Event,
    targets: Vec<u32>,
}

impl LayerSignals {
    /// Counters for `model_layers` layers in `backend`'s device memory, zeroed on its stream
    /// without waiting: the launches that count into them are ordered after the zeroing by
    /// their usage record, and every wait on them ([`CounterWait::wait`]) makes its stream wait
    /// for it on the device first.
    pub fn new(backend: &dyn Backend, model_layers: usize) -> Result<Self> {
        let bytes = model_layers
            .max(1)
            .mul_or(4, || format!("ready counters of {model_layers} layers"))?;
        let mut targets = Vec::new();
        targets
            .try_reserve_exact(model_layers)
            .map_err(|_| Error::OutOfMemory {
                what: format!("the ready targets of {model_layers} layers"),
                bytes: bytes as u64,
                memory: "host",
            })?;
        targets.resize(model_layers, 0);
        // `cuMemAlloc` memory: stream memory operations (`cuStreamWaitValue32`, the
        // consumer's wait) refuse memory of a stream-ordered pool (invalid argument, H200).
        let counters = backend.alloc_registrable(bytes)?;
        // Zeroed on the device (no host copy of the counters' size), not waited for.
        backend.fill(&counters, 0)?;
        let zeroed = backend.record()?;
        Ok(Self {
            counters,
            zeroed,
            targets,
        })
    }

    /// Model layers counted.
    pub fn layers(&self) -> usize {
        self.targets.len()
    }

    /// The counters, one little-endian u32 per model layer.
    pub fn counters(&self) -> &Buffer {
        &self.counters
    }

    /// What model layer `layer`'s counter reaches once every counted run has landed it.
    pub fn target(&self, layer: ModelLayer) -> Result<u32> {
        self.targets.get(layer.0).copied().ok_or(Error::OutOfRange {
            what: "model layer",
            index: layer.0 as i64,
            limit: self.targets.len() as u64,
        })
    }

    /// Adds a run's units per layer; returns the readiness of each layer after that run.
    pub(crate) fn count(&mut self, units: &[u32]) -> Vec<CounterWait> {
        self.targets
            .iter_mut()
            .zip(units)
            .enumerate()
            .map(|(layer, (target, &n))| {
                *target = target.wrapping_add(n);
                CounterWait {
                    counters: self.counters.clone(),
                    zeroed: self.zeroed.clone(),
                    layer: ModelLayer(layer),
                    target: *target,
                }
            })
            .collect()
    }
}

/// "Model layer `layer` has landed" as a counter value to wait for.
#[derive(Debug, Clone)]
pub struct CounterWait {
    counters: Buffer,
    zeroed: Event,
    layer: ModelLayer,
    target: u32,
}

impl CounterWait {
    /// Makes later work on `consumer` wait until the layer has landed (no host involvement).
    pub fn wait(&self, consumer: &dyn Backend) -> Result<()> {
        consumer.check(&self.counters, "ready counters")?;
        let addr = self.counters.at(4 * self.layer.0)?;
        // The counter holds what it counts only once it was zeroed (long since, as a rule:
        // then no wait is enqueued).
        if !self.zeroed.is_complete()? {
            consumer.wait(&self.zeroed)?;
        }
        // Recorded on the counters' usage without waiting for their writer (the copy that
        // counts into them is what this waits for, layer by layer).
        kept(consumer, &[self.counters.usage()], || {
            // SAFETY: `addr` is a 4-byte aligned u32 inside the counters allocation (256-byte
            // aligned base, 4 bytes per layer, checked by `at`) of the consumer's address
            // space (checked above), which its usage keeps until the wait is over.
            unsafe { consumer.wait_counter(addr, self.target) }
        })
    }

    /// The model layer.
    pub fn layer(&self) -> ModelLayer {
        self.layer
    }

    /// The counter value that means the layer has landed.
    pub fn target(&self) -> u32 {
        self.target
    }
}
