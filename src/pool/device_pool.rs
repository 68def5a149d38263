//! [`DevicePool`]: one rank's device pool (the module docs of [`super`] describe its layout),
//! allocated by kvshard or wrapping an engine's buffers, and a [`BlockSpace`] the copy layer
//! moves its pages through.

use std::fmt;

use crate::abi;
use crate::backend::{AddressSpace, Backend, Buffer, MemoryKind, Usage};
use crate::copy::space::{packed_regions, sealed};
use crate::copy::{BlockSpace, SpaceId};
use crate::error::{Checked, Error, Result};
use crate::geometry::{CacheGeometry, Component, ComponentLayout};
use crate::index::{LocalPage, StoredLayer};
use crate::shard::Placement;

use super::PoolBuffers;

/// One rank's device pool.
pub struct DevicePool {
    id: SpaceId,
    space: AddressSpace,
    geometry: CacheGeometry,
    placement: Placement,
    rank: u32,
    pages: u64,
    logical_capacity: u64,
    components: Vec<ComponentLayout>,
    /// Per component, per stored layer.
    bases: Vec<Vec<u64>>,
    /// The allocation behind the pool when kvshard made it.
    storage: Option<Buffer>,
    /// The work queued on the pool: the storage's own record, or one of its own for an
    /// engine's buffers (the engine keeps their memory).
    usage: Usage,
}

impl fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevicePool")
            .field("id", &self.id)
            .field("space", &self.space)
            .field("rank", &self.rank)
            .field("shard", &self.placement.shard())
            .field("pages", &self.pages)
            .field("owned", &self.storage.is_some())
            .finish_non_exhaustive()
    }
}

impl DevicePool {
    /// Allocates a pool of `pages` physical pages per layer for `rank` of `placement`, in one
    /// allocation of `backend`'s device memory (on CUDA, from kvshard's stream-ordered pool:
    /// dropping the pool never waits for the device). Memory a transport registers by address
    /// (NIXL over UCX, legacy CUDA IPC, GPUDirect) is [`DevicePool::allocate_registrable`]'s.
    pub fn allocate(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        placement: Placement,
        rank: u32,
        pages: u64,
    ) -> Result<Self> {
        Self::allocate_with(geometry, placement, rank, pages, |total| {
            backend.alloc(total, MemoryKind::Device)
        })
    }

    /// [`DevicePool::allocate`] in memory other libraries can register or share by address
    /// ([`Backend::alloc_registrable`]: `cuMemAlloc` on CUDA): what NIXL registers for UCX's
    /// `cuda_ipc`, what `ipc::ExportedPool::share_ipc` shares with legacy CUDA IPC, what
    /// GPUDirect RDMA registers. Its free may wait for the whole device (the driver's choice);
    /// kvshard makes it on its reaper thread, never the dropping one.
    pub fn allocate_registrable(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        placement: Placement,
        rank: u32,
        pages: u64,
    ) -> Result<Self> {
        Self::allocate_with(geometry, placement, rank, pages, |total| {
            backend.alloc_registrable(total)
        })
    }

    /// [`DevicePool::allocate`] with the one allocation made by `alloc`, given the bytes the
    /// pool needs: memory other processes can map (`ipc::ExportedPool`). The pool belongs to
    /// the address space of the buffer `alloc` returns, which must hold at least those bytes.
    pub(crate) fn allocate_with(
        geometry: &CacheGeometry,
        placement: Placement,
        rank: u32,
        pages: u64,
        alloc: impl FnOnce(usize) -> Result<Buffer>,
    ) -> Result<Self> {
        let logical_capacity = Self::check(geometry, placement, rank, pages)?;
        let components = geometry.components();
        let (regions, total) = packed_regions(&components, pages)?;
        let storage = alloc(total)?;
        if storage.len() < total {
            return Err(Error::InvalidArgument(format!(
                "a pool of {total} bytes given an allocation of {}",
                storage.len()
            )));
        }
        let bases = regions
            .iter()
            .zip(&components)
            .map(|(&(offset, stride), c)| {
                (0..c.layers())
                    .map(|l| storage.addr() + (offset + l * stride) as u64)
                    .collect()
            })
            .collect();
        Ok(Self {
            id: SpaceId::next(),
            space: storage.space(),
            geometry: geometry.clone(),
            placement,
            rank,
            pages,
            logical_capacity,
            components,
            bases,
            usage: storage.usage().clone(),
            storage: Some(storage),
        })
    }

    /// Wraps buffers an engine already owns, without copying. Every buffer must hold at least
    /// `pages` blocks of its component ([`PoolBuffers::required_bytes`]); a larger one (an
    /// engine's token-sized buffer) is used for its first `pages` pages.
    ///
    /// # Safety
    /// Every buffer must be device memory of `backend`'s address space, of at least the bytes
    /// it claims, valid while the pool and any work using it are alive.
    pub unsafe fn wrap(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        placement: Placement,
        rank: u32,
        pages: u64,
        buffers: &PoolBuffers,
    ) -> Result<Self> {
        let logical_capacity = Self::check(geometry, placement, rank, pages)?;
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
            let need = PoolBuffers::required_bytes(geometry, c.component, pages)?;
            for (layer, b) in given.iter().enumerate() {
                if b.addr == 0 || b.addr % 16 != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "{} buffer of stored layer {layer} at {:#x}: must be a non-null 16-byte aligned device address",
                        c.component, b.addr
                    )));
                }
                if b.bytes < need {
                    return Err(Error::InvalidArgument(format!(
                        "{} buffer of stored layer {layer} holds {} bytes; {pages} pages of {} B blocks need {need}",
                        c.component, b.bytes, c.block_bytes
                    )));
                }
                if b.addr.checked_add(need).is_none() {
                    return Err(Error::overflow(format!(
                        "{} buffer of stored layer {layer} at {:#x} + {need} bytes",
                        c.component, b.addr
                    )));
                }
            }
            bases.push(given.iter().map(|b| b.addr).collect());
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
        Ok(Self {
            id: SpaceId::next(),
            space: backend.address_space(),
            geometry: geometry.clone(),
            placement,
            rank,
            pages,
            logical_capacity,
            components,
            bases,
            storage: None,
            usage: Usage::new(None),
        })
    }

    /// Checks the pool's parameters; returns its logical token capacity.
    fn check(geometry: &CacheGeometry, placement: Placement, rank: u32, pages: u64) -> Result<u64> {
        geometry.validate()?;
        placement.check_rank(rank)?;
        if pages < 2 {
            return Err(Error::InvalidArgument(format!(
                "a pool needs at least 2 pages per layer (page 0 is padding), got {pages}"
            )));
        }
        (geometry.page_bytes_checked()? as u64)
            .mul_or(pages, || format!("bytes of {pages} pages of the cache"))?;
        placement.logical_capacity(pages)
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
        self.logical_capacity / crate::geometry::PAGE_SIZE as u64
    }

    /// Logical token capacity of the shard group (N x physical slots).
    pub fn logical_capacity(&self) -> u64 {
        self.logical_capacity
    }

    /// Base addresses of `component`, one per stored layer.
    pub fn layer_bases(&self, component: Component) -> Result<&[u64]> {
        Ok(&self.bases[self.component_index(component)?])
    }

    /// Distance between consecutive stored layers of `component`, when uniform (pools kvshard
    /// allocates; engine buffers usually are not).
    pub fn layer_stride(&self, component: Component) -> Result<Option<u64>> {
        Ok(sealed::Sealed::layer_stride(
            self,
            self.component_index(component)?,
        ))
    }

    /// The allocation behind the pool, when kvshard made it.
    pub fn storage(&self) -> Option<&Buffer> {
        self.storage.as_ref()
    }

    /// Keeps `owner` alive until the pool and all work queued on it are gone
    /// ([`Usage::keep_alive`]): what holds the engine memory a wrapped pool lends (its
    /// tensors), which must outlive kvshard's queued work however early the engine drops the
    /// pool.
    pub fn keep_alive(&self, owner: Box<dyn Send + Sync>) {
        self.usage.keep_alive(owner);
    }

    /// One stored layer of `component` as a buffer of `pages` blocks.
    fn layer_buffer(&self, c: usize, layer: usize) -> Buffer {
        let len = self.pages as usize * self.components[c].block_bytes;
        // SAFETY: the range is one layer buffer of this pool (allocated, or promised by
        // `wrap`'s contract to hold `pages` blocks), alive as long as the pool.
        let raw =
            unsafe { Buffer::from_raw(self.bases[c][layer], len, MemoryKind::Device, self.space) };
        // Work on the layer is work on the pool: it reports to the pool's usage.
        raw.tracked_by(&self.usage)
    }

    /// The bytes of block (`layer`, `page`) of `component`, read after prior work on
    /// `backend`'s stream (waits for it).
    pub fn read_block_sync(
        &self,
        backend: &dyn Backend,
        component: Component,
        layer: StoredLayer,
        page: LocalPage,
    ) -> Result<Vec<u8>> {
        let addr = self.block_addr(component, layer, page)?;
        let c = self.component_index(component)?;
        let block = self.components[c].block_bytes;
        let buffer = self.layer_buffer(c, layer.0);
        let offset = usize::try_from(addr - buffer.addr())
            .map_err(|_| Error::overflow(format!("offset of {page}")))?;
        backend.read_sync(&buffer, offset, block)
    }

    /// The bytes of each page of `pages`: every block of the page, component by component,
    /// layer by layer (what verification compares). Waits for `backend`'s stream.
    pub fn read_pages_sync(
        &self,
        backend: &dyn Backend,
        pages: &[LocalPage],
    ) -> Result<Vec<Vec<u8>>> {
        pages
            .iter()
            .map(|&page| {
                let mut out = Vec::new();
                for comp in &self.components {
                    for layer in 0..comp.layers() {
                        out.extend(self.read_block_sync(
                            backend,
                            comp.component,
                            StoredLayer(layer),
                            page,
                        )?);
                    }
                }
                Ok(out)
            })
            .collect()
    }

    /// Every block of the pool, component by component, layer by layer, page by page: what
    /// byte-identity tests compare. Waits for `backend`'s stream.
    pub fn snapshot_sync(&self, backend: &dyn Backend) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for (c, comp) in self.components.iter().enumerate() {
            for layer in 0..comp.layers() {
                let buffer = self.layer_buffer(c, layer);
                out.extend(backend.read_sync(&buffer, 0, buffer.len())?);
            }
        }
        Ok(out)
    }

    /// Fills every layer buffer with `byte` (stream-ordered).
    pub fn fill(&self, backend: &dyn Backend, byte: u8) -> Result<()> {
        for (c, comp) in self.components.iter().enumerate() {
            for layer in 0..comp.layers() {
                backend.fill(&self.layer_buffer(c, layer), byte)?;
            }
        }
        Ok(())
    }
}

impl sealed::Sealed for DevicePool {
    fn base(&self, c: usize, layer: usize) -> u64 {
        self.bases[c][layer]
    }

    fn side(&self, c: usize) -> abi::kvs_block_side {
        self.components[c].packed_side()
    }

    fn layer_count(&self, c: usize) -> usize {
        self.bases[c].len()
    }

    fn usage(&self) -> &Usage {
        &self.usage
    }
}

crate::copy::space::block_space!(DevicePool);
