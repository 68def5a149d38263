//! Block spaces: what a copy needs to know of one side (layer bases, strides, pages), and the
//! spaces kvshard itself provides: [`Staging`] and [`RemoteSpace`] here, `DevicePool` and
//! `HostPool` in their modules.
//!
//! Unsafe code (the copy kernels' parameters) trusts what a space says about its memory, so
//! [`BlockSpace`] is sealed: only kvshard's own types implement it, each built from memory it
//! allocated, or from raw addresses through an `unsafe` constructor whose `# Safety` section
//! the caller signs.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::abi;
use crate::backend::{AddressSpace, Backend, Buffer, MemoryKind, Usage};
use crate::error::{Checked, Error, Result};
use crate::geometry::{CacheGeometry, Component, ComponentLayout};
use crate::index::{LocalPage, StoredLayer};

/// Identity of a block space, unique in the process: a copy plan remembers the ids of the
/// spaces it was built for, and a prepared copy refuses any other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpaceId(u64);

impl SpaceId {
    pub(crate) fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for SpaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "space #{}", self.0)
    }
}

pub(crate) mod sealed {
    use crate::abi;

    /// The raw address math of a space. Callers inside the crate pass only component indices
    /// below `components().len()` and stored layers below that component's layer count.
    pub trait Sealed {
        /// Address of (stored layer `layer`, page 0) of component index `c`.
        fn base(&self, c: usize, layer: usize) -> u64;
        /// How pages and rows of component index `c` are strided.
        fn side(&self, c: usize) -> abi::kvs_block_side;
        /// Number of stored layers of component index `c`.
        fn layer_count(&self, c: usize) -> usize;
        /// The record of the work queued on the space's memory, which keeps that memory until
        /// the work has completed: every launch that touches the space reports to it.
        fn usage(&self) -> &crate::backend::Usage;
        /// The distance between consecutive stored layers of component index `c`, when it is
        /// one stride (pools kvshard allocates, host pools); `None` for engine buffers at
        /// arbitrary addresses, or a single layer.
        fn layer_stride(&self, c: usize) -> Option<u64> {
            let n = self.layer_count(c);
            if n < 2 {
                return None;
            }
            let stride = self.base(c, 1).checked_sub(self.base(c, 0))?;
            (2..n)
                .all(|l| self.base(c, l).checked_sub(self.base(c, l - 1)) == Some(stride))
                .then_some(stride)
        }
    }
}

/// Something pages can be copied out of or into: per component, per stored layer, `pages()`
/// blocks. Sealed: implemented by `DevicePool`, `HostPool`, [`Staging`] and [`RemoteSpace`].
pub trait BlockSpace: sealed::Sealed + Send + Sync + fmt::Debug {
    /// The space's identity.
    fn id(&self) -> SpaceId;

    /// The address space its memory belongs to (what a backend must run in to touch it).
    fn address_space(&self) -> AddressSpace;

    /// Components present, in [`Component::ALL`] order.
    fn components(&self) -> &[ComponentLayout];

    /// Pages each layer holds.
    fn pages(&self) -> u64;

    /// Index of `component` among [`BlockSpace::components`], or an error naming it.
    fn component_index(&self, component: Component) -> Result<usize> {
        self.components()
            .iter()
            .position(|c| c.component == component)
            .ok_or_else(|| Error::InvalidArgument(format!("the space holds no {component}")))
    }

    /// Address of (`layer`, local `page`) of `component`, checked against the space.
    fn block_addr(&self, component: Component, layer: StoredLayer, page: LocalPage) -> Result<u64> {
        let c = self.component_index(component)?;
        self.components()[c].check_layer(layer)?;
        if page.0 >= self.pages() {
            return Err(Error::OutOfRange {
                what: "local page",
                index: i64::try_from(page.0).unwrap_or(i64::MAX),
                limit: self.pages(),
            });
        }
        // In range: the space holds `pages` pages of this layer at this stride.
        Ok(self.base(c, layer.0) + page.0 * self.side(c).page_stride)
    }
}

/// Implements [`BlockSpace`] for a type that keeps its identity, address space, components and
/// page count in fields named `id`, `space`, `components` and `pages`.
macro_rules! block_space {
    ($ty:ty) => {
        impl $crate::copy::BlockSpace for $ty {
            fn id(&self) -> $crate::copy::SpaceId {
                self.id
            }

            fn address_space(&self) -> $crate::backend::AddressSpace {
                self.space
            }

            fn components(&self) -> &[$crate::geometry::ComponentLayout] {
                &self.components
            }

            fn pages(&self) -> u64 {
                self.pages
            }
        }
    };
}
pub(crate) use block_space;

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
                expected: format!("{x:?}"),
                got: format!("{y:?}"),
            });
        }
    }
    Ok(())
}

/// Alignment of every component region kvshard lays out.
pub(crate) const REGION_ALIGN: usize = 256;

/// Byte offset of each component region and its layer stride in one packed allocation of
/// `pages` pages per layer (`[component][layer][page][block]`), and the total, or an overflow.
pub(crate) fn packed_regions(
    components: &[ComponentLayout],
    pages: u64,
) -> Result<(Vec<(usize, usize)>, usize)> {
    let what = |c: &ComponentLayout| format!("{pages} pages of {} blocks", c.component);
    layer_regions(components, what, |c| {
        crate::error::to_usize(pages, || what(c))?.mul_or(c.block_bytes, || what(c))
    })
}

/// Byte offset of each component region and its layer stride in one allocation holding every
/// stored layer of every component back to back, `layer_bytes(c)` per layer of `c` rounded up
/// to [`REGION_ALIGN`], and the total; an overflow names `what(c)`.
pub(crate) fn layer_regions(
    components: &[ComponentLayout],
    what: impl Fn(&ComponentLayout) -> String,
    layer_bytes: impl Fn(&ComponentLayout) -> Result<usize>,
) -> Result<(Vec<(usize, usize)>, usize)> {
    let mut offset = 0usize;
    let mut regions = Vec::with_capacity(components.len());
    for c in components {
        let stride = layer_bytes(c)?
            .checked_next_multiple_of(REGION_ALIGN)
            .ok_or_else(|| Error::overflow(what(c)))?;
        regions.push((offset, stride));
        offset = stride
            .mul_or(c.layers(), || what(c))?
            .add_or(offset, || what(c))?;
    }
    Ok((regions, offset))
}

/// A contiguous staging buffer: per component, per stored layer, `pages` packed blocks
/// (`[component][layer][page][block]`). What a gather fills and a scatter empties, a rank's
/// send buffer, and the device side of staged host I/O.
#[derive(Debug)]
pub struct Staging {
    id: SpaceId,
    space: AddressSpace,
    components: Vec<ComponentLayout>,
    pages: u64,
    regions: Vec<(usize, usize)>,
    buffer: Buffer,
}

impl Staging {
    /// Staging for `pages` pages of every component of `geometry`, in `backend`'s device memory.
    pub fn new(backend: &dyn Backend, geometry: &CacheGeometry, pages: u64) -> Result<Self> {
        geometry.validate()?;
        Self::for_components(backend, geometry.components(), pages, MemoryKind::Device)
    }

    /// Bytes a staging of `pages` pages of `geometry` holds (what [`Staging::new`] allocates).
    pub fn required_bytes(geometry: &CacheGeometry, pages: u64) -> Result<usize> {
        geometry.validate()?;
        packed_regions(&geometry.components(), pages).map(|(_, total)| total)
    }

    pub(crate) fn for_components(
        backend: &dyn Backend,
        components: Vec<ComponentLayout>,
        pages: u64,
        kind: MemoryKind,
    ) -> Result<Self> {
        let (regions, total) = packed_regions(&components, pages)?;
        let buffer = backend.alloc(total, kind)?;
        Ok(Self {
            id: SpaceId::next(),
            space: backend.address_space(),
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

    /// The bytes of one stored layer of `component`: `pages` packed blocks.
    pub fn layer(&self, component: Component, layer: StoredLayer) -> Result<Buffer> {
        let c = self.component_index(component)?;
        let comp = &self.components[c];
        comp.check_layer(layer)?;
        let (offset, stride) = self.regions[c];
        // In range: packed_regions laid out `layers` strides of at least pages * block bytes.
        self.buffer.slice(
            offset + layer.0 * stride,
            self.pages as usize * comp.block_bytes,
        )
    }
}

impl sealed::Sealed for Staging {
    fn base(&self, c: usize, layer: usize) -> u64 {
        let (offset, stride) = self.regions[c];
        self.buffer.addr() + (offset + layer * stride) as u64
    }

    fn layer_count(&self, c: usize) -> usize {
        self.components[c].layers()
    }

    fn side(&self, c: usize) -> abi::kvs_block_side {
        self.components[c].packed_side()
    }

    fn usage(&self) -> &Usage {
        self.buffer.usage()
    }
}

block_space!(Staging);

/// A destination registered by another side of a transfer: the base address of every stored
/// layer of every component, and the layout they follow (packed blocks of `pages` pages per
/// layer), as addresses this process's kernels can use. Transports fill it in: in-process from a
/// pool of this process ([`RemoteSpace::of`]), peer-mapped or NIXL-registered memory through
/// [`RemoteSpace::from_raw`].
#[derive(Clone)]
pub struct RemoteSpace {
    id: SpaceId,
    space: AddressSpace,
    geometry: CacheGeometry,
    components: Vec<ComponentLayout>,
    pages: u64,
    /// Per component, per stored layer.
    bases: Vec<Vec<u64>>,
    /// The work queued on the destination; it holds whatever keeps the memory mapped (the
    /// pool itself, a peer mapping) until that work has completed.
    usage: Usage,
}

impl fmt::Debug for RemoteSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteSpace")
            .field("id", &self.id)
            .field("space", &self.space)
            .field("pages", &self.pages)
            .finish_non_exhaustive()
    }
}

impl RemoteSpace {
    /// The destination `space` describes, in this process: it shares `space`'s usage, which
    /// keeps the memory alive while work through either is queued.
    pub fn of<S: BlockSpace + 'static>(space: Arc<S>, geometry: CacheGeometry) -> Result<Self> {
        geometry.validate()?;
        check_same_components(&geometry.components(), space.components())?;
        let components = space.components().to_vec();
        for (c, comp) in components.iter().enumerate() {
            if space.side(c) != comp.packed_side() {
                return Err(Error::InvalidArgument(format!(
                    "a remote destination stores packed blocks; this space strides {} pages {} B apart",
                    comp.component,
                    space.side(c).page_stride
                )));
            }
        }
        let bases = components
            .iter()
            .enumerate()
            .map(|(c, comp)| (0..comp.layers()).map(|l| space.base(c, l)).collect())
            .collect();
        Ok(Self {
            id: SpaceId::next(),
            space: space.address_space(),
            geometry,
            pages: space.pages(),
            components,
            bases,
            // The space's own record: the destination is the same memory, so work through
            // either is ordered with work through the other, and kept as the space's memory is.
            usage: space.usage().clone(),
        })
    }

    /// A destination at raw addresses: `bases[c][l]` is stored layer `l` of component `c` of
    /// `geometry.components()`, holding `pages` packed blocks.
    ///
    /// # Safety
    /// Every `[base, base + pages * block_bytes)` must be memory of `space` (mapped into this
    /// process, writable by its kernels) that stays valid while the returned value, its clones
    /// and any work using them are alive; `keep` may hold whatever guarantees that.
    pub unsafe fn from_raw(
        space: AddressSpace,
        geometry: CacheGeometry,
        pages: u64,
        bases: Vec<Vec<u64>>,
        keep: Arc<dyn Send + Sync>,
    ) -> Result<Self> {
        geometry.validate()?;
        let components = geometry.components();
        if bases.len() != components.len() {
            return Err(Error::GeometryMismatch {
                what: "remote components".into(),
                expected: components.len().to_string(),
                got: bases.len().to_string(),
            });
        }
        for (comp, layers) in components.iter().zip(&bases) {
            if layers.len() != comp.layers() {
                return Err(Error::GeometryMismatch {
                    what: format!("remote {} layers", comp.component),
                    expected: comp.layers().to_string(),
                    got: layers.len().to_string(),
                });
            }
            if let Some(bad) = layers.iter().find(|&&a| a == 0 || a % 16 != 0) {
                return Err(Error::InvalidArgument(format!(
                    "remote {} layer at {bad:#x}: must be a non-null 16-byte aligned address",
                    comp.component
                )));
            }
            let bytes = pages.mul_or(comp.block_bytes as u64, || {
                format!("{pages} remote pages of {}", comp.component)
            })?;
            if let Some(bad) = layers.iter().find(|&&a| a.checked_add(bytes).is_none()) {
                return Err(Error::overflow(format!(
                    "remote {} layer at {bad:#x} + {bytes} bytes",
                    comp.component
                )));
            }
        }
        Ok(Self {
            id: SpaceId::next(),
            space,
            geometry,
            pages,
            components,
            bases,
            usage: Usage::new(Some(Box::new(keep))),
        })
    }

    /// A destination in another process (another host), described by the addresses its owner
    /// registered with a transfer engine: `bases[c][l]` is stored layer `l` of component `c` of
    /// `geometry.components()`, holding `pages` packed blocks, as the remote side addresses it.
    ///
    /// Safe, unlike [`RemoteSpace::from_raw`]: its address space is a fresh
    /// [`AddressSpace::Remote`] that no backend runs in, so no kernel or copy of this process
    /// ever dereferences these addresses (every one checks the space first); only a transfer
    /// engine reads them, as offsets into memory the remote side registered. The shape is
    /// checked as for `from_raw`.
    pub fn unmapped(geometry: CacheGeometry, pages: u64, bases: Vec<Vec<u64>>) -> Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let space = AddressSpace::Remote(NEXT.fetch_add(1, Ordering::Relaxed));
        // SAFETY: the space is one no backend belongs to (above), so the contract of
        // `from_raw` (memory kernels of this process may write) is never relied on.
        unsafe { Self::from_raw(space, geometry, pages, bases, Arc::new(())) }
    }

    /// The destination's cache geometry.
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }
}

impl sealed::Sealed for RemoteSpace {
    fn base(&self, c: usize, layer: usize) -> u64 {
        self.bases[c][layer]
    }

    fn layer_count(&self, c: usize) -> usize {
        self.bases[c].len()
    }

    fn side(&self, c: usize) -> abi::kvs_block_side {
        self.components[c].packed_side()
    }

    fn usage(&self) -> &Usage {
        &self.usage
    }
}

block_space!(RemoteSpace);
