//! Sharded device pools of one rank, and the block spaces copies move pages between.
//!
//! A [`DevicePool`] holds the four components of DOMAIN.md section 2 (target latent, target
//! indexer, draft latent, draft indexer) for `pages` physical pages: per component and layer a
//! buffer of `pages` blocks, page `p` at `base + p * block_bytes`. Pools kvshard allocates put
//! every component in one allocation with a uniform layer stride (so a page across all layers
//! is one 2D copy); pools wrapping an engine's buffers take whatever per-layer addresses the
//! engine has. Either way the per-layer base addresses are kept in a device-side table
//! ([`DevicePool::layer_table`]).
//!
//! [`BlockSpace`] is what a copy needs to know of one side: layer bases and strides. Pools,
//! contiguous [`Staging`] buffers and the HiCache host pools implement it.

mod budget;
mod copy;
mod write;

pub use budget::{Budget, BudgetRequest};
pub use copy::{BlockCopy, BlockCopyPlan, PageList, PageSelection};
pub use write::{ChunkStaging, OwnedRowWrite};

use crate::abi;
use crate::backend::{Backend, Buffer, MemoryKind};
use crate::error::{Error, Result};
use crate::geometry::{CacheGeometry, Component, ComponentLayout};
use crate::shard::Placement;

/// Alignment of every component region kvshard allocates.
const REGION_ALIGN: usize = 256;

/// Something pages can be copied out of or into: per component, per layer, `pages()` blocks.
pub trait BlockSpace {
    /// Components present, in [`Component::ALL`] order.
    fn components(&self) -> &[ComponentLayout];
    /// Pages each layer holds.
    fn pages(&self) -> u64;
    /// Address of (layer `layer`, page 0) of component index `c` (an index into `components()`).
    fn layer_base(&self, c: usize, layer: usize) -> u64;
    /// How pages and rows of component index `c` are strided; packed blocks unless the space
    /// lays them out otherwise.
    fn block_side(&self, c: usize) -> abi::kvs_block_side {
        self.components()[c].packed_side()
    }
}

/// Checks two block spaces hold the same components with the same block shapes.
pub(crate) fn check_same_components(a: &[ComponentLayout], b: &[ComponentLayout]) -> Result<()> {
    if a.len() != b.len() {
        return Err(Error::GeometryMismatch {
            what: "components".into(),
            expected: a.len().to_string(),
            got: b.len().to_string(),
        });
    }
    for (x, y) in a.iter().zip(b) {
        if x != y {
            return Err(Error::GeometryMismatch {
                what: format!("{}", x.component),
                expected: format!("{:?}", x),
                got: format!("{:?}", y),
            });
        }
    }
    Ok(())
}

/// Byte offsets of each component region and its layer stride in one packed allocation of
/// `pages` pages per layer.
fn packed_regions(components: &[ComponentLayout], pages: u64) -> (Vec<(usize, usize)>, usize) {
    let mut offset = 0usize;
    let mut regions = Vec::with_capacity(components.len());
    for c in components {
        let stride = (pages as usize * c.block_bytes).next_multiple_of(REGION_ALIGN);
        regions.push((offset, stride));
        offset += stride * c.layers();
    }
    (regions, offset)
}

/// Device addresses of an engine's existing cache buffers, one per stored layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolBuffers {
    /// Target latent buffer of each target layer.
    pub target_latent: Vec<u64>,
    /// Target indexer buffer of each target layer that has an indexer, in layer order.
    pub target_indexer: Vec<u64>,
    /// Draft latent buffer (with a draft).
    pub draft_latent: Vec<u64>,
    /// Draft indexer buffer (with a draft).
    pub draft_indexer: Vec<u64>,
}

impl PoolBuffers {
    fn of(&self, c: Component) -> &[u64] {
        match c {
            Component::TargetLatent => &self.target_latent,
            Component::TargetIndexer => &self.target_indexer,
            Component::DraftLatent => &self.draft_latent,
            Component::DraftIndexer => &self.draft_indexer,
        }
    }
}

/// One rank's device pool.
#[derive(Debug)]
pub struct DevicePool {
    geometry: CacheGeometry,
    placement: Placement,
    rank: u32,
    pages: u64,
    components: Vec<ComponentLayout>,
    /// Per component, per stored layer.
    bases: Vec<Vec<u64>>,
    table: Buffer,
    /// The allocation behind the pool when kvshard made it.
    storage: Option<Buffer>,
}

impl DevicePool {
    /// Allocates a pool of `pages` physical pages per layer for `rank` of `placement`.
    pub fn allocate<B: Backend>(
        backend: &B,
        geometry: &CacheGeometry,
        placement: Placement,
        rank: u32,
        pages: u64,
    ) -> Result<Self> {
        Self::check(geometry, placement, rank, pages)?;
        let components = geometry.components();
        let (regions, total) = packed_regions(&components, pages);
        let storage = backend.alloc(total, MemoryKind::Device)?;
        let bases = regions
            .iter()
            .zip(&components)
            .map(|(&(offset, stride), c)| {
                (0..c.layers())
                    .map(|l| storage.addr() + (offset + l * stride) as u64)
                    .collect()
            })
            .collect();
        Self::finish(
            backend,
            geometry,
            placement,
            rank,
            pages,
            components,
            bases,
            Some(storage),
        )
    }

    /// Wraps buffers an engine already owns, without copying.
    ///
    /// # Safety
    /// Every address in `buffers` must be device memory of `backend`'s device holding `pages`
    /// blocks of its component, 16-byte aligned, valid while the pool and work using it live.
    pub unsafe fn wrap<B: Backend>(
        backend: &B,
        geometry: &CacheGeometry,
        placement: Placement,
        rank: u32,
        pages: u64,
        buffers: &PoolBuffers,
    ) -> Result<Self> {
        Self::check(geometry, placement, rank, pages)?;
        let components = geometry.components();
        let mut bases = Vec::with_capacity(components.len());
        for c in &components {
            let given = buffers.of(c.component);
            if given.len() != c.layers() {
                return Err(Error::GeometryMismatch {
                    what: format!("{} buffers", c.component),
                    expected: c.layers().to_string(),
                    got: given.len().to_string(),
                });
            }
            if let Some(bad) = given.iter().find(|&&a| a == 0 || a % 16 != 0) {
                return Err(Error::InvalidArgument(format!(
                    "{} buffer at {bad:#x}: must be a non-null 16-byte aligned device address",
                    c.component
                )));
            }
            bases.push(given.to_vec());
        }
        for c in Component::ALL {
            if !components.iter().any(|l| l.component == c) && !buffers.of(c).is_empty() {
                return Err(Error::GeometryMismatch {
                    what: format!("{c} buffers"),
                    expected: "0".into(),
                    got: buffers.of(c).len().to_string(),
                });
            }
        }
        Self::finish(
            backend, geometry, placement, rank, pages, components, bases, None,
        )
    }

    fn check(geometry: &CacheGeometry, placement: Placement, rank: u32, pages: u64) -> Result<()> {
        geometry.validate()?;
        if rank >= placement.shard() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of shard size {}",
                placement.shard()
            )));
        }
        if pages < 2 {
            return Err(Error::InvalidArgument(format!(
                "a pool needs at least 2 pages per layer (page 0 is padding), got {pages}"
            )));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn finish<B: Backend>(
        backend: &B,
        geometry: &CacheGeometry,
        placement: Placement,
        rank: u32,
        pages: u64,
        components: Vec<ComponentLayout>,
        bases: Vec<Vec<u64>>,
        storage: Option<Buffer>,
    ) -> Result<Self> {
        let flat: Vec<u8> = bases
            .iter()
            .flatten()
            .flat_map(|a| a.to_le_bytes())
            .collect();
        let table = backend.alloc(flat.len(), MemoryKind::Device)?;
        backend.write(&table, 0, &flat)?;
        Ok(Self {
            geometry: geometry.clone(),
            placement,
            rank,
            pages,
            components,
            bases,
            table,
            storage,
        })
    }

    /// Cache geometry.
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    /// Sharding of the logical index space.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// This pool's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Logical pages of the whole shard group (N x physical pages).
    pub fn logical_pages(&self) -> u64 {
        self.placement.logical_pages(self.pages)
    }

    /// Logical token capacity of the shard group.
    pub fn logical_capacity(&self) -> u64 {
        self.placement
            .logical_capacity(self.pages * self.placement.page_size() as u64)
    }

    /// Base addresses of component index `c`, one per stored layer.
    pub fn layer_bases(&self, c: usize) -> &[u64] {
        &self.bases[c]
    }

    /// Distance between consecutive layers of component index `c`, when uniform.
    pub fn layer_stride(&self, c: usize) -> Option<u64> {
        let b = &self.bases[c];
        let stride = b.get(1).map(|x| x.wrapping_sub(b[0]))?;
        b.windows(2)
            .all(|w| w[1].wrapping_sub(w[0]) == stride)
            .then_some(stride)
    }

    /// The device-side table of every layer base, component after component.
    pub fn layer_table(&self) -> &Buffer {
        &self.table
    }

    /// The allocation behind the pool, when kvshard made it.
    pub fn storage(&self) -> Option<&Buffer> {
        self.storage.as_ref()
    }

    /// Address of block (`layer`, local `page`) of component index `c`.
    pub fn block_addr(&self, c: usize, layer: usize, page: u64) -> Result<u64> {
        let comp = self.components.get(c).ok_or(Error::OutOfRange {
            what: "component",
            index: c as i64,
            limit: self.components.len() as u64,
        })?;
        if layer >= comp.layers() || page >= self.pages {
            return Err(Error::OutOfRange {
                what: "block",
                index: if layer >= comp.layers() {
                    layer as i64
                } else {
                    page as i64
                },
                limit: if layer >= comp.layers() {
                    comp.layers() as u64
                } else {
                    self.pages
                },
            });
        }
        Ok(self.bases[c][layer] + page * comp.block_bytes as u64)
    }

    /// Every block of the pool, component by component, layer by layer, page by page: what
    /// byte-identity tests compare.
    pub fn snapshot<B: Backend>(&self, backend: &B) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for (c, comp) in self.components.iter().enumerate() {
            for &base in &self.bases[c] {
                // SAFETY: the range is one layer buffer of this pool (contract of allocate/wrap).
                let layer = unsafe {
                    Buffer::from_raw(
                        base,
                        self.pages as usize * comp.block_bytes,
                        MemoryKind::Device,
                    )
                };
                out.extend(backend.read(&layer, 0, layer.len())?);
            }
        }
        Ok(out)
    }

    /// Fills every layer buffer with `byte` (stream-ordered).
    pub fn fill<B: Backend>(&self, backend: &B, byte: u8) -> Result<()> {
        for (c, comp) in self.components.iter().enumerate() {
            for &base in &self.bases[c] {
                // SAFETY: as in snapshot.
                let layer = unsafe {
                    Buffer::from_raw(
                        base,
                        self.pages as usize * comp.block_bytes,
                        MemoryKind::Device,
                    )
                };
                backend.fill(&layer, byte)?;
            }
        }
        Ok(())
    }
}

impl BlockSpace for DevicePool {
    fn components(&self) -> &[ComponentLayout] {
        &self.components
    }

    fn pages(&self) -> u64 {
        self.pages
    }

    fn layer_base(&self, c: usize, layer: usize) -> u64 {
        self.bases[c][layer]
    }
}

/// A contiguous staging buffer: per component, per layer, `pages` blocks (`[L][pages][block]`).
#[derive(Debug)]
pub struct Staging {
    components: Vec<ComponentLayout>,
    pages: u64,
    regions: Vec<(usize, usize)>,
    buffer: Buffer,
}

impl Staging {
    /// A staging buffer for `pages` pages of every component of `geometry`.
    pub fn new<B: Backend>(backend: &B, geometry: &CacheGeometry, pages: u64) -> Result<Self> {
        geometry.validate()?;
        let components = geometry.components();
        let (regions, total) = packed_regions(&components, pages);
        let buffer = backend.alloc(total, MemoryKind::Device)?;
        Ok(Self {
            components,
            pages,
            regions,
            buffer,
        })
    }

    /// The whole buffer.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }
}

impl BlockSpace for Staging {
    fn components(&self) -> &[ComponentLayout] {
        &self.components
    }

    fn pages(&self) -> u64 {
        self.pages
    }

    fn layer_base(&self, c: usize, layer: usize) -> u64 {
        let (offset, stride) = self.regions[c];
        self.buffer.addr() + (offset + layer * stride) as u64
    }
}
