//! An engine's existing cache buffers, described for [`DevicePool::wrap`](super::DevicePool::wrap):
//! one [`RawBuffer`] per stored layer of each component ([`PoolBuffers`]).

use crate::error::{Checked, Result};
use crate::geometry::{CacheGeometry, Component};

/// One engine buffer: its device address and its size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawBuffer {
    /// Device address (16-byte aligned).
    pub addr: u64,
    /// Bytes the buffer holds.
    pub bytes: u64,
}

/// An engine's existing cache buffers, one per stored layer of each component.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolBuffers {
    /// Target latent buffer of each target layer.
    pub target_latent: Vec<RawBuffer>,
    /// Target indexer buffer of each target layer that has an indexer, in layer order.
    pub target_indexer: Vec<RawBuffer>,
    /// Draft latent buffer (with a draft).
    pub draft_latent: Vec<RawBuffer>,
    /// Draft indexer buffer (with a draft).
    pub draft_indexer: Vec<RawBuffer>,
}

impl PoolBuffers {
    /// The buffers of `component`.
    pub fn of(&self, component: Component) -> &[RawBuffer] {
        match component {
            Component::TargetLatent => &self.target_latent,
            Component::TargetIndexer => &self.target_indexer,
            Component::DraftLatent => &self.draft_latent,
            Component::DraftIndexer => &self.draft_indexer,
        }
    }

    /// Bytes each buffer of `component` must hold for `pages` pages, or an overflow.
    pub fn required_bytes(
        geometry: &CacheGeometry,
        component: Component,
        pages: u64,
    ) -> Result<u64> {
        let block = geometry
            .components()
            .iter()
            .find(|c| c.component == component)
            .map_or(0, |c| c.block_bytes as u64);
        pages.mul_or(block, || format!("bytes of {pages} pages of {component}"))
    }

    /// The most whole pages every buffer holds (engines size buffers in tokens: a buffer of
    /// `64 * p + 10` tokens holds `p` pages), or `None` when a component has no buffers.
    pub fn pages_covered(&self, geometry: &CacheGeometry) -> Option<u64> {
        geometry
            .components()
            .iter()
            .map(|c| {
                self.of(c.component)
                    .iter()
                    .map(|b| b.bytes / c.block_bytes as u64)
                    .min()
            })
            .try_fold(u64::MAX, |acc, p| p.map(|p| acc.min(p)))
    }
}
