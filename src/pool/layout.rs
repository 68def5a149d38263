//! How a pool stores its pages, as one side of a transfer registers it with the other.

use crate::copy::BlockSpace;
use crate::geometry::CacheGeometry;

/// How one side of a transfer stores its pages, as it registers them with the other side (the
/// decode side's layout arrives over the wire, so nothing here is trusted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLayout {
    /// Geometry of the side's cache.
    pub geometry: CacheGeometry,
    /// Pages per layer (an unsharded decode pool: its pages; a prefill rank: its local pages).
    pub pages: u64,
    /// Bytes between consecutive pages of one layer, per component of
    /// [`CacheGeometry::components`], in that order: the "item length" engines register.
    /// Transfers move whole pages of packed layers, so each must equal the component's block.
    pub page_strides: Vec<u64>,
}

impl PoolLayout {
    /// A side storing `pages` pages per layer of every component packed (page `p` of a layer
    /// at `p * block_bytes`), as every [`DevicePool`](super::DevicePool) does.
    pub fn packed(geometry: CacheGeometry, pages: u64) -> Self {
        let page_strides = geometry
            .components()
            .iter()
            .map(|c| c.block_bytes as u64)
            .collect();
        Self {
            geometry,
            pages,
            page_strides,
        }
    }

    /// The layout of `pool`.
    pub fn of(pool: &super::DevicePool) -> Self {
        Self::packed(pool.geometry().clone(), pool.pages())
    }
}
