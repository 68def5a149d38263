//! What a [`HiCacheController`](super::HiCacheController) hands back: the FIFO acks of backups
//! and loads ([`BackupAck`], [`LoadAck`]), a load's per-layer [`LoadHandle`], what one step of
//! the engine's loop found ([`HiCacheStep`]), and the submitted work kept until it is acked.

use super::direct::HostTransfer;
use super::layer_ready::LayerReady;
use crate::backend::{Backend, Event};
use crate::error::{Error, Result};
use crate::index::{LogicalPage, ModelLayer};

/// What one [`HiCacheController::step`](super::HiCacheController::step) found.
#[derive(Debug, Default)]
pub struct HiCacheStep {
    /// Backups completed since the last step, in submission order.
    pub backups: Vec<BackupAck>,
    /// Loads completed since the last step, in submission order.
    pub loads: Vec<LoadAck>,
    /// Inputs a kernel rejected on the controller's streams since the last step
    /// ([`Error::KernelRejected`]), or a stream that could not be asked.
    pub kernel_errors: Vec<Error>,
}

/// A completed backup, acked in submission order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupAck {
    /// Logical queue index (0, 1, 2, ... per controller, identical on every rank).
    pub index: u64,
    /// The node backed up.
    pub node: u64,
    /// The start owner the backup was given.
    pub start_owner: Option<u32>,
    /// Logical host pages now holding the node.
    pub host_pages: Vec<LogicalPage>,
    /// Bytes this rank moved.
    pub bytes: u64,
}

/// A completed load, acked in submission order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadAck {
    /// Logical queue index (0, 1, 2, ... per controller, identical on every rank).
    pub index: u64,
    /// The node loaded.
    pub node: u64,
    /// Bytes this rank moved.
    pub bytes: u64,
}

/// A submitted load: per model layer, how a consumer waits for that layer only. The MTP draft's
/// layer is ready with target layer 0, as in SGLang's host pool.
#[derive(Debug)]
pub struct LoadHandle {
    pub(super) index: u64,
    pub(super) layers: Vec<LayerReady>,
}

impl LoadHandle {
    /// Logical queue index of the load.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// Readiness of each model layer (target layers, then the draft's, which is layer 0's).
    pub fn layers(&self) -> &[LayerReady] {
        &self.layers
    }

    /// Makes later work on `consumer` wait until model layer `layer` has landed, and no longer.
    pub fn wait_layer(&self, consumer: &dyn Backend, layer: ModelLayer) -> Result<()> {
        self.layers
            .get(layer.0)
            .ok_or(Error::OutOfRange {
                what: "model layer",
                index: layer.0 as i64,
                limit: self.layers.len() as u64,
            })?
            .wait(consumer)
    }
}

/// Submitted work kept until acked: its ack, its completion event, and the transfer whose
/// tables the device may still be reading.
#[derive(Debug)]
pub(super) struct Pending<A> {
    pub(super) ack: A,
    pub(super) done: Event,
    pub(super) transfer: HostTransfer,
}
