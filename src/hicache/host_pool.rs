//! One rank's host pool (docs/design.md, "HiCache"): per component, one pinned buffer of `pages` pages
//! in one of three layouts. The pool is a [`BlockSpace`], so the block-copy kernel reads and
//! writes it through its device alias with no code of its own; the copy-engine programs
//! ([`crate::copy::engine`]) use the same address math.
//!
//! Per component with `L` stored layers, blocks of `B` bytes made of `rows` rows of `R` bytes
//! (latent: 64 rows of the latent row; indexer: one 8,448-byte row per block):
//!
//! | layout | shape | layer base | page stride | row stride |
//! |---|---|---|---|---|
//! | [`HostLayout::LayerFirst`] | `[L][pages][B]` | `l * pages * B` | `B` | `R` |
//! | [`HostLayout::PageFirstDirect`] | `[pages][L][B]` | `l * B` | `L * B` | `R` |
//! | [`HostLayout::PageFirst`], latent | `[pages * 64][L][R]` | `l * R` | `64 * L * R` | `L * R` |
//! | [`HostLayout::PageFirst`], indexer | `[pages][L][B]` | `l * B` | `L * B` | `B` |
//!
//! Every layout takes `pages * L * B` bytes per component. Local page 0 is the padding page,
//! as on the device: a pool has at least two pages.

use std::sync::Arc;

use crate::abi;
use crate::backend::cuda::CudaBackend;
use crate::backend::{AddressSpace, Backend, Buffer, MemoryKind};
use crate::copy::space::sealed;
use crate::copy::{BlockSpace, SpaceId};
use crate::error::{Checked, Error, Result};
use crate::geometry::{CacheGeometry, Component, ComponentLayout};
use crate::gpu::memory::HostRegistration;
use crate::gpu::{topology, Gpu};
use crate::index::{LocalPage, StoredLayer};

/// Registration chunks are whole multiples of this as well as of a page, so two chunks never
/// share an OS page (4 KiB on x86 hosts, up to 64 KiB on Arm servers).
const OS_PAGE_GRAIN: usize = 64 << 10;

/// Alignment a registered region must start at (the smallest OS page).
const REGION_ALIGN: usize = 4096;

/// How a host pool orders the blocks of one component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostLayout {
    /// `[L][pages][block]`: the device pool's order; one layer's pages are contiguous.
    LayerFirst,
    /// `[pages * 64 tokens][L][row]` (indexer: `[pages][L][8448]`): token-major, SGLang's
    /// default and what its storage backends read. One page of all layers is one contiguous run,
    /// but one layer's rows inside it are `L * row` bytes apart.
    PageFirst,
    /// `[pages][L][block]`: page-granular; one page of all layers is one contiguous run and every
    /// (page, layer) block is contiguous.
    PageFirstDirect,
}

impl HostLayout {
    /// Every layout, for tests and benchmarks that cover each.
    pub const ALL: [HostLayout; 3] = [Self::LayerFirst, Self::PageFirst, Self::PageFirstDirect];

    /// Where the blocks of `component` sit in a pool of `pages` pages in this layout (pools
    /// that hold their bytes never overflow these; see [`HostPool`]).
    pub fn strides(self, component: &ComponentLayout, pages: u64) -> LayoutStrides {
        let layers = component.layers() as u64;
        let block = component.block_bytes as u64;
        let row = component.row_bytes as u64;
        let token_major = self == Self::PageFirst && component.rows > 1;
        match self {
            Self::LayerFirst => LayoutStrides {
                layer_stride: pages.saturating_mul(block),
                page_stride: block,
                row_stride: row,
            },
            _ if token_major => LayoutStrides {
                layer_stride: row,
                page_stride: layers.saturating_mul(block),
                row_stride: layers.saturating_mul(row),
            },
            _ => LayoutStrides {
                layer_stride: block,
                page_stride: layers.saturating_mul(block),
                row_stride: row,
            },
        }
    }

    /// The contiguous unit of one page of `component` that registration chunks must not split:
    /// one block for [`HostLayout::LayerFirst`], one page of every layer otherwise.
    pub fn page_unit(self, component: &ComponentLayout) -> usize {
        match self {
            Self::LayerFirst => component.block_bytes,
            Self::PageFirst | Self::PageFirstDirect => component.page_bytes(),
        }
    }
}

impl std::fmt::Display for HostLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::LayerFirst => "layer_first",
            Self::PageFirst => "page_first",
            Self::PageFirstDirect => "page_first_direct",
        })
    }
}

/// Byte distances inside one component of a host pool (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutStrides {
    /// Between (layer `l`, page 0) and (layer `l + 1`, page 0).
    pub layer_stride: u64,
    /// Between consecutive pages of one layer.
    pub page_stride: u64,
    /// Between consecutive rows of one block.
    pub row_stride: u64,
}

/// Where a host pool's pages were placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NumaPlacement {
    /// Allocated by the calling thread, wherever its memory policy puts pages.
    CallerThread,
    /// Allocated by a thread NVML bound to the GPU's CPUs (Linux first touch puts the pages on
    /// their node); `node` is the GPU's NUMA node where NVML reports one.
    GpuLocal {
        /// The GPU's NUMA node.
        node: Option<u32>,
    },
    /// Placement was asked for but NVML is not usable; the pool was allocated anyway.
    Unplaced(String),
}

/// Engine-owned host memory for one component of a [`HostPool::register`]ed pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRegion {
    /// First byte (host address).
    pub host: *mut u8,
    /// Bytes; must be exactly the component's size in the pool's layout.
    pub len: usize,
}

/// One rank's pinned host pool: per component, `pages` pages in one [`HostLayout`]. Engines
/// share it as `Arc<HostPool>` with the HiCache controller.
#[derive(Debug)]
pub struct HostPool {
    id: SpaceId,
    space: AddressSpace,
    geometry: CacheGeometry,
    layout: HostLayout,
    pages: u64,
    components: Vec<ComponentLayout>,
    strides: Vec<LayoutStrides>,
    /// One per component; addresses are device aliases.
    buffers: Vec<Buffer>,
    numa: NumaPlacement,
}

impl HostPool {
    /// Allocates a pool of `pages` pages per component through `backend` (pinned, device-mapped
    /// host memory on CUDA: `cuMemHostAlloc`, addressed through the alias the driver gives).
    ///
    /// Pages land on the NUMA node of the calling thread; [`HostPool::new_numa_local`] places
    /// them next to the GPU instead.
    pub fn new(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        pages: u64,
        layout: HostLayout,
    ) -> Result<Self> {
        let components = Self::check(geometry, pages)?;
        Self::allocate(
            backend,
            geometry,
            layout,
            pages,
            components,
            MemoryKind::PinnedHost,
        )
    }

    /// One `kind` buffer per component, sized for `pages` pages.
    fn allocate(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        layout: HostLayout,
        pages: u64,
        components: Vec<ComponentLayout>,
        kind: MemoryKind,
    ) -> Result<Self> {
        let buffers = components
            .iter()
            .map(|c| backend.alloc(Self::component_bytes(c, pages)?, kind))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::assemble(
            backend.address_space(),
            geometry,
            layout,
            pages,
            components,
            buffers,
            NumaPlacement::CallerThread,
        ))
    }

    /// As [`HostPool::new`], allocating from a new thread that NVML binds to the CPUs nearest
    /// the GPU, so `cuMemHostAlloc`'s first touch puts the pinned pages on the GPU's NUMA node
    /// (the caller's own affinity is untouched). Without NVML the pool is allocated anyway and
    /// [`HostPool::numa`] says why it is not placed. A process started under another memory
    /// policy (`numactl --interleave`) keeps it.
    pub fn new_numa_local(
        backend: &CudaBackend,
        geometry: &CacheGeometry,
        pages: u64,
        layout: HostLayout,
    ) -> Result<Self> {
        let bus = backend.gpu().info().pci_bus_id.as_str();
        let placement = match topology::topology(bus) {
            Ok(t) => NumaPlacement::GpuLocal { node: t.numa_node },
            Err(why) => NumaPlacement::Unplaced(why),
        };
        let mut pool = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    topology::on_gpu_numa_node(bus, || Self::new(backend, geometry, pages, layout))
                })
                .join()
        })
        .map_err(|_| Error::HiCache("the NUMA-local allocation thread panicked".into()))??;
        pool.numa = placement;
        Ok(pool)
    }

    /// Wraps host memory the engine owns, one region per component (in
    /// [`CacheGeometry::components`] order), registering each with the driver in chunks of
    /// about `max_chunk` bytes that never split a page ([`HostLayout::page_unit`]) nor share an
    /// OS page (chunks are also multiples of 64 KiB, so a chunk may exceed `max_chunk` when one
    /// such multiple does). Each chunk's device alias is asked of the driver; the chunks of a
    /// region must form one contiguous device range (they do under unified addressing), else
    /// the pool is refused, because the copy paths address a component linearly.
    ///
    /// # Safety
    /// Every region must be valid, writable host memory, 4 KiB aligned, not registered already,
    /// that outlives the pool and all work using it.
    pub unsafe fn register(
        gpu: &Arc<Gpu>,
        geometry: &CacheGeometry,
        pages: u64,
        layout: HostLayout,
        regions: &[HostRegion],
        max_chunk: usize,
    ) -> Result<Self> {
        let components = Self::check(geometry, pages)?;
        let space = AddressSpace::Cuda(gpu.info().ordinal);
        if regions.len() != components.len() {
            return Err(Error::GeometryMismatch {
                what: "host regions".into(),
                expected: components.len().to_string(),
                got: regions.len().to_string(),
            });
        }
        let mut buffers = Vec::with_capacity(components.len());
        for (c, region) in components.iter().zip(regions) {
            let len = Self::component_bytes(c, pages)?;
            if region.len != len
                || region.host.is_null()
                || region.host as usize % REGION_ALIGN != 0
            {
                return Err(Error::HiCache(format!(
                    "{} region at {:p} of {} bytes: needs a non-null {REGION_ALIGN}-byte aligned region of {len} bytes ({layout}, {pages} pages)",
                    c.component, region.host, region.len
                )));
            }
            let unit = layout.page_unit(c);
            let grain = unit / gcd(unit, OS_PAGE_GRAIN) * OS_PAGE_GRAIN;
            let chunk = (max_chunk / grain).max(1) * grain;
            // SAFETY: the caller guarantees the region (see above).
            let reg =
                unsafe { HostRegistration::new(gpu.context(), region.host, len, unit, chunk) }?;
            let base = reg
                .chunks()
                .first()
                .map(|&(_, alias, _)| alias)
                .ok_or_else(|| {
                    Error::HiCache(format!("{} region registered no chunk", c.component))
                })?;
            let mut expected = base;
            for &(host, alias, bytes) in reg.chunks() {
                if alias != expected {
                    return Err(Error::HiCache(format!(
                        "{}: the driver mapped the chunk at host {host:#x} to device {alias:#x}, \
                         not {expected:#x}: the registered region is not one contiguous device range",
                        c.component
                    )));
                }
                expected = alias + bytes as u64;
            }
            buffers.push(Buffer::owned(
                base,
                len,
                MemoryKind::PinnedHost,
                space,
                Arc::new(reg),
            ));
        }
        Ok(Self::assemble(
            space,
            geometry,
            layout,
            pages,
            components,
            buffers,
            NumaPlacement::CallerThread,
        ))
    }

    /// Device memory laid out exactly like `like` for `pages` pages: where the staged copy-engine
    /// path lands host runs so that each copy-engine copy is one large contiguous run.
    pub(crate) fn device_mirror(
        backend: &dyn Backend,
        like: &HostPool,
        pages: u64,
    ) -> Result<Self> {
        Self::allocate(
            backend,
            &like.geometry,
            like.layout,
            pages,
            like.components.clone(),
            MemoryKind::Device,
        )
    }

    fn check(geometry: &CacheGeometry, pages: u64) -> Result<Vec<ComponentLayout>> {
        geometry.validate()?;
        if pages < 2 {
            return Err(Error::InvalidArgument(format!(
                "a host pool needs at least 2 pages (page 0 is padding), got {pages}"
            )));
        }
        Ok(geometry.components())
    }

    fn component_bytes(c: &ComponentLayout, pages: u64) -> Result<usize> {
        let what = || format!("bytes of {pages} host pages of {}", c.component);
        let bytes = c
            .layers()
            .mul_or(c.block_bytes, what)?
            .mul_or(crate::error::to_usize(pages, what)?, what)?;
        // The strides of every layout must fit too (a page-major row stride is layers x row).
        u64::try_from(bytes).map_err(|_| Error::overflow(what()))?;
        Ok(bytes)
    }

    fn assemble(
        space: AddressSpace,
        geometry: &CacheGeometry,
        layout: HostLayout,
        pages: u64,
        components: Vec<ComponentLayout>,
        buffers: Vec<Buffer>,
        numa: NumaPlacement,
    ) -> Self {
        let strides = components
            .iter()
            .map(|c| layout.strides(c, pages))
            .collect();
        Self {
            id: SpaceId::next(),
            space,
            geometry: geometry.clone(),
            layout,
            pages,
            components,
            strides,
            buffers,
            numa,
        }
    }

    /// Cache geometry.
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    /// Layout of every component.
    pub fn layout(&self) -> HostLayout {
        self.layout
    }

    /// Strides of `component`.
    pub fn strides(&self, component: Component) -> Result<LayoutStrides> {
        Ok(self.strides[self.component_index(component)?])
    }

    /// The buffer of `component`.
    pub fn buffer(&self, component: Component) -> Result<&Buffer> {
        Ok(&self.buffers[self.component_index(component)?])
    }

    /// Bytes of the whole pool.
    pub fn bytes(&self) -> usize {
        self.buffers.iter().map(Buffer::len).sum()
    }

    /// Where the pool's pages were placed.
    pub fn numa(&self) -> &NumaPlacement {
        &self.numa
    }

    /// Address (device alias) of row `row` of block (`layer`, `page`) of `component`.
    pub fn row_addr(
        &self,
        component: Component,
        layer: StoredLayer,
        page: LocalPage,
        row: usize,
    ) -> Result<u64> {
        let c = self.component_index(component)?;
        let s = self.strides[c];
        let comp = &self.components[c];
        let (layer, page) = (layer.0, page.0);
        for (what, index, limit) in [
            ("layer", layer as u64, comp.layers() as u64),
            ("host page", page, self.pages),
            ("row", row as u64, comp.rows as u64),
        ] {
            if index >= limit {
                return Err(Error::OutOfRange {
                    what,
                    index: index as i64,
                    limit,
                });
            }
        }
        Ok(self.buffers[c].addr()
            + layer as u64 * s.layer_stride
            + page * s.page_stride
            + row as u64 * s.row_stride)
    }

    /// Every block of the pool in canonical order (component, layer, page, rows in order), the
    /// same bytes whatever the layout: what byte-identity tests compare.
    pub fn snapshot_sync(&self, backend: &dyn Backend) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.bytes());
        for (c, comp) in self.components.iter().enumerate() {
            let raw = backend.read_sync(&self.buffers[c], 0, self.buffers[c].len())?;
            let s = self.strides[c];
            for l in 0..comp.layers() as u64 {
                for p in 0..self.pages {
                    for r in 0..comp.rows as u64 {
                        let at =
                            (l * s.layer_stride + p * s.page_stride + r * s.row_stride) as usize;
                        out.extend_from_slice(&raw[at..at + comp.row_bytes]);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Sets every byte of the pool to `byte` (stream-ordered on `backend`).
    pub fn fill(&self, backend: &dyn Backend, byte: u8) -> Result<()> {
        self.buffers.iter().try_for_each(|b| backend.fill(b, byte))
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl sealed::Sealed for HostPool {
    fn base(&self, c: usize, layer: usize) -> u64 {
        self.buffers[c].addr() + layer as u64 * self.strides[c].layer_stride
    }

    fn side(&self, c: usize) -> abi::kvs_block_side {
        abi::kvs_block_side {
            page_stride: self.strides[c].page_stride,
            row_stride: self.strides[c].row_stride,
        }
    }

    fn layer_count(&self, c: usize) -> usize {
        self.components[c].layers()
    }
}

crate::copy::space::block_space!(HostPool);
