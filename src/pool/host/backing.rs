//! Where a host pool's memory comes from: pinned allocations (NUMA-placed or not), engine
//! memory kvshard registers, memory the engine registered itself, or any memory of a backend's
//! address space; the device aliases always come from the driver.

use std::sync::Arc;

use crate::backend::cuda::CudaBackend;
use crate::backend::{AddressSpace, Backend, Buffer, MemoryKind, Usage};
use crate::copy::SpaceId;
use crate::error::{Error, Result};
use crate::geometry::{CacheGeometry, ComponentLayout};
use crate::gpu::memory::{ForeignRegistration, HostRegistration};
use crate::gpu::{topology, Gpu};

use super::host_pool::HostBuf;
use super::*;

/// Registration chunks are whole multiples of this as well as of a page, so two chunks never
/// share an OS page (4 KiB on x86 hosts, up to 64 KiB on Arm servers).
const OS_PAGE_GRAIN: usize = 64 << 10;

/// Alignment a registered region must start at (the smallest OS page).
const REGION_ALIGN: usize = 4096;

/// Alignment every host buffer must have: the copy kernels move 16-byte words.
const BUFFER_ALIGN: u64 = 16;

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
    /// The engine's memory, wherever it put it.
    Engine,
}

/// Engine-owned host memory for one buffer of a [`HostPool::register`]ed pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRegion {
    /// First byte (host address).
    pub host: *mut u8,
    /// Bytes; must be exactly the buffer's size in the pool's format.
    pub len: usize,
}

/// Engine-owned host memory the engine registered with the driver itself, for one buffer of a
/// [`HostPool::adopt_registered`] pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredRegion {
    /// First byte (host address).
    pub host: *mut u8,
    /// Bytes; must be exactly the buffer's size in the pool's format.
    pub len: usize,
    /// The registrations covering it, `(host address, bytes)` in address order, each exactly
    /// one `cudaHostRegister` call (SGLang keeps them on the tensor as
    /// `_sglang_cuda_host_registered_ranges`); empty when the region is one registration.
    pub registrations: Vec<(usize, usize)>,
}

/// Memory of a backend's address space for one buffer of a [`HostPool::wrap`]ped pool.
#[derive(Debug, Clone)]
pub struct HostMemory {
    /// The buffer, in the backend's address space (a device alias on CUDA).
    pub memory: Buffer,
    /// Its host address, where the caller knows it.
    pub host: Option<*mut u8>,
}

// SAFETY: the raw host addresses are plain numbers here (never dereferenced by the pool); the
// memory they name is owned by the buffers' allocations, which are Send + Sync.
unsafe impl Send for HostMemory {}
// SAFETY: see Send.
unsafe impl Sync for HostMemory {}

impl HostPool {
    /// Allocates a pool of `pages` pages in kvshard's format ([`HostFormat::kvshard`]) through
    /// `backend` (pinned, device-mapped host memory on CUDA: `cuMemHostAlloc`, addressed
    /// through the alias the driver gives).
    ///
    /// Pages land on the NUMA node of the calling thread; [`HostPool::new_numa_local`] places
    /// them next to the GPU instead.
    pub fn new(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        pages: u64,
        layout: HostLayout,
    ) -> Result<Self> {
        Self::new_with(backend, geometry, pages, HostFormat::kvshard(layout))
    }

    /// As [`HostPool::new`], in any [`HostFormat`] (SGLang's: [`HostFormat::sglang`]).
    pub fn new_with(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        pages: u64,
        format: HostFormat,
    ) -> Result<Self> {
        let components = Self::check(geometry, pages)?;
        Self::allocate(
            backend,
            geometry,
            components,
            format,
            pages,
            MemoryKind::PinnedHost,
        )
    }

    /// One `kind` buffer per buffer of the format, sized for `pages` pages.
    fn allocate(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        components: Vec<ComponentLayout>,
        format: HostFormat,
        pages: u64,
        kind: MemoryKind,
    ) -> Result<Self> {
        let (layouts, slots) = format.plan(&components, pages)?;
        let mut buffers = Vec::with_capacity(layouts.len());
        for layout in layouts {
            let memory = backend.alloc(layout.bytes, kind)?;
            let host = match (kind, memory.space()) {
                (MemoryKind::PinnedHost, AddressSpace::Cuda(_)) => host_address(&memory),
                _ => None,
            };
            buffers.push(HostBuf {
                layout,
                memory,
                host,
            });
        }
        Ok(Self::assemble(
            backend.address_space(),
            geometry,
            format,
            pages,
            components,
            slots,
            buffers,
            NumaPlacement::CallerThread,
        ))
    }

    /// As [`HostPool::new_with`], allocating from a new thread that NVML binds to the CPUs
    /// nearest the GPU, so `cuMemHostAlloc`'s first touch puts the pinned pages on the GPU's
    /// NUMA node (the caller's own affinity is untouched). Without NVML the pool is allocated
    /// anyway and [`HostPool::numa`] says why it is not placed. A process started under another
    /// memory policy (`numactl --interleave`) keeps it.
    pub fn new_numa_local(
        backend: &CudaBackend,
        geometry: &CacheGeometry,
        pages: u64,
        format: impl Into<HostFormat>,
    ) -> Result<Self> {
        let format = format.into();
        let bus = backend.gpu().info().pci_bus_id.as_str();
        let placement = match topology::topology(bus) {
            Ok(t) => NumaPlacement::GpuLocal { node: t.numa_node },
            Err(why) => NumaPlacement::Unplaced(why),
        };
        let mut pool = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    topology::on_gpu_numa_node(bus, || {
                        Self::new_with(backend, geometry, pages, format)
                    })
                })
                .join()
        })
        .map_err(|_| Error::HiCache("the NUMA-local allocation thread panicked".into()))??;
        pool.numa = placement;
        Ok(pool)
    }

    /// Wraps host memory the engine owns in kvshard's format, one region per component (in
    /// [`CacheGeometry::components`] order): [`HostPool::register_with`] with
    /// [`HostFormat::kvshard`].
    ///
    /// # Safety
    /// As [`HostPool::register_with`].
    pub unsafe fn register(
        gpu: &Arc<Gpu>,
        geometry: &CacheGeometry,
        pages: u64,
        layout: HostLayout,
        regions: &[HostRegion],
        max_chunk: usize,
    ) -> Result<Self> {
        // SAFETY: forwarded contract.
        unsafe {
            Self::register_with(
                gpu,
                geometry,
                pages,
                HostFormat::kvshard(layout),
                regions,
                max_chunk,
            )
        }
    }

    /// Wraps host memory the engine owns, one region per buffer of `format`
    /// ([`HostFormat::buffers`] order), registering each with the driver in chunks of about
    /// `max_chunk` bytes that never split a page ([`HostLayout::buffer_page_unit`]) nor share
    /// an OS page (chunks are also multiples of 64 KiB, so a chunk may exceed `max_chunk` when
    /// one such multiple does). Each chunk's device alias is asked of the driver; the chunks of
    /// a region must form one contiguous device range (they do under unified addressing), else
    /// the pool is refused, because the copy paths address a buffer linearly.
    ///
    /// Dropped, the pool's registrations are undone on kvshard's reaper thread once its work
    /// has completed (`cuMemHostUnregister` may wait for the whole device).
    ///
    /// # Safety
    /// Every region must be valid, writable host memory, 4 KiB aligned, not registered already,
    /// that outlives the pool, all work using it and its unregistration: free or register it
    /// again only after `backend::wait_for_frees_sync` has returned, or hand what holds it to
    /// [`HostPool::register_with_owner`].
    pub unsafe fn register_with(
        gpu: &Arc<Gpu>,
        geometry: &CacheGeometry,
        pages: u64,
        format: HostFormat,
        regions: &[HostRegion],
        max_chunk: usize,
    ) -> Result<Self> {
        // SAFETY: forwarded contract; nothing more to hold.
        unsafe { Self::register_with_owner(gpu, geometry, pages, format, regions, max_chunk, None) }
    }

    /// [`HostPool::register_with`], holding `owner` (what holds the regions' memory: the
    /// engine's tensors) until the registrations are undone, after the pool and all work
    /// using it are gone.
    ///
    /// # Safety
    /// As [`HostPool::register_with`], where `owner` (when given) keeps every region valid for
    /// as long as it lives.
    pub unsafe fn register_with_owner(
        gpu: &Arc<Gpu>,
        geometry: &CacheGeometry,
        pages: u64,
        format: HostFormat,
        regions: &[HostRegion],
        max_chunk: usize,
        owner: Option<Arc<dyn Send + Sync>>,
    ) -> Result<Self> {
        let space = AddressSpace::Cuda(gpu.info().ordinal);
        Self::engine_buffers(
            space,
            geometry,
            pages,
            format,
            regions.iter(),
            |layout, name, region| {
                let len = layout.bytes;
                if region.len != len
                    || region.host.is_null()
                    || region.host as usize % REGION_ALIGN != 0
                {
                    return Err(Error::HiCache(format!(
                    "{name} region at {:p} of {} bytes: needs a non-null {REGION_ALIGN}-byte aligned region of {len} bytes ({format}, {pages} pages)",
                    region.host, region.len
                )));
                }
                let unit = format
                    .layout
                    .buffer_page_unit(layout.layers, layout.block_bytes);
                let grain = unit / gcd(unit, OS_PAGE_GRAIN) * OS_PAGE_GRAIN;
                let chunk = (max_chunk / grain).max(1) * grain;
                // SAFETY: the caller guarantees the region (see above).
                let mut reg =
                    unsafe { HostRegistration::new(gpu.context(), region.host, len, unit, chunk) }?;
                if let Some(owner) = &owner {
                    reg = reg.owned_by(owner.clone());
                }
                let base = linear_alias(name, reg.chunks())?;
                let memory = Buffer::owned(base, len, MemoryKind::PinnedHost, space, Arc::new(reg));
                Ok((memory, Some(region.host as usize)))
            },
        )
    }

    /// Wraps host memory the engine already registered with the driver (`cudaHostRegister`,
    /// as SGLang's host pools do), one region per buffer of `format` ([`HostFormat::buffers`]
    /// order). kvshard asks the driver for the device alias of each registration (refusing
    /// memory the driver does not know), requires the aliases of a region to form one
    /// contiguous device range, records the registrations so no copy-engine copy spans two of
    /// them, and never unregisters them.
    ///
    /// # Safety
    /// Every region must be valid, writable host memory, 16-byte aligned, registered with this
    /// GPU's context exactly as its `registrations` say (the whole region when they are empty),
    /// and stay registered and valid while the pool and all work using it are alive.
    pub unsafe fn adopt_registered(
        gpu: &Arc<Gpu>,
        geometry: &CacheGeometry,
        pages: u64,
        format: HostFormat,
        regions: &[RegisteredRegion],
    ) -> Result<Self> {
        let space = AddressSpace::Cuda(gpu.info().ordinal);
        Self::engine_buffers(
            space,
            geometry,
            pages,
            format,
            regions.iter(),
            |layout, name, region| {
                let len = layout.bytes;
                let start = region.host as usize;
                if region.len != len || start == 0 || start as u64 % BUFFER_ALIGN != 0 {
                    return Err(Error::HiCache(format!(
                    "{name} region at {start:#x} of {} bytes: needs a non-null {BUFFER_ALIGN}-byte aligned region of {len} bytes ({format}, {pages} pages)",
                    region.len
                )));
                }
                let ranges = if region.registrations.is_empty() {
                    vec![(start, len)]
                } else {
                    region.registrations.clone()
                };
                let mut at = start;
                for &(host, bytes) in &ranges {
                    if host != at || bytes == 0 {
                        return Err(Error::HiCache(format!(
                        "{name} region [{start:#x}, +{len}): registration ({host:#x}, {bytes} bytes) does not continue at {at:#x}; the registrations must tile the region in order"
                    )));
                    }
                    at += bytes;
                }
                if at != start + len {
                    return Err(Error::HiCache(format!(
                        "{name} region [{start:#x}, +{len}): its registrations end at {at:#x}"
                    )));
                }
                // SAFETY: the caller guarantees each range is one live registration of this context
                // (see above).
                let reg = unsafe { ForeignRegistration::new(gpu.context(), &ranges) }?;
                let base = linear_alias(name, reg.chunks())?;
                let memory = Buffer::owned(base, len, MemoryKind::PinnedHost, space, Arc::new(reg));
                Ok((memory, Some(start)))
            },
        )
    }

    /// Wraps memory of `backend`'s address space, one buffer per buffer of `format`
    /// ([`HostFormat::buffers`] order), each exactly the buffer's size and 16-byte aligned: the
    /// CPU backend's memory (engine memory a `CpuBackend::adopt`ed), or device-visible memory a
    /// caller mapped itself.
    ///
    /// # Safety
    /// Every buffer must be memory kernels of `backend`'s address space may read and write
    /// (for CUDA: a device alias of pinned or registered host memory), valid while the pool and
    /// all work using it are alive; every `host` given must be that memory's host address.
    pub unsafe fn wrap(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        pages: u64,
        format: HostFormat,
        memory: Vec<HostMemory>,
    ) -> Result<Self> {
        let space = backend.address_space();
        Self::engine_buffers(
            space,
            geometry,
            pages,
            format,
            memory.into_iter(),
            |layout, name, m| {
                backend.check(&m.memory, name)?;
                if m.memory.len() != layout.bytes || m.memory.addr() % BUFFER_ALIGN != 0 {
                    return Err(Error::HiCache(format!(
                    "{name} buffer at {:#x} of {} bytes: needs a {BUFFER_ALIGN}-byte aligned buffer of {} bytes ({format}, {pages} pages)",
                    m.memory.addr(),
                    m.memory.len(),
                    layout.bytes
                )));
                }
                Ok((m.memory, m.host.map(|h| h as usize)))
            },
        )
    }

    /// A pool of the engine's memory in `space`, one buffer per buffer of `format`, each made
    /// by `buffer` from its layout, its name and the caller's region for it (checked, and
    /// registered where that is needed): the buffer and its host address, if any.
    fn engine_buffers<R>(
        space: AddressSpace,
        geometry: &CacheGeometry,
        pages: u64,
        format: HostFormat,
        regions: impl ExactSizeIterator<Item = R>,
        mut buffer: impl FnMut(&HostBufferLayout, &str, R) -> Result<(Buffer, Option<usize>)>,
    ) -> Result<Self> {
        let components = Self::check(geometry, pages)?;
        let (layouts, slots) = format.plan(&components, pages)?;
        check_region_count(layouts.len(), regions.len())?;
        let mut buffers = Vec::with_capacity(layouts.len());
        for (layout, region) in layouts.into_iter().zip(regions) {
            let (memory, host) = buffer(&layout, &buffer_name(&layout), region)?;
            buffers.push(HostBuf {
                layout,
                memory,
                host,
            });
        }
        Ok(Self::assemble(
            space,
            geometry,
            format,
            pages,
            components,
            slots,
            buffers,
            NumaPlacement::Engine,
        ))
    }

    /// Device memory laid out exactly like `like` for `pages` pages: where the staged copy-engine
    /// path lands host runs so that each copy-engine copy is one large contiguous run. The
    /// staged path moves a page-major buffer's pages as contiguous runs of whole component
    /// pages, which a packed draft interleaves; such pools are refused (their direct routes
    /// serve them).
    pub(crate) fn device_mirror(
        backend: &dyn Backend,
        like: &HostPool,
        pages: u64,
    ) -> Result<Self> {
        let packed = like.buffers.len() < like.components.len();
        if packed && like.format.layout != HostLayout::LayerFirst {
            return Err(Error::HiCache(format!(
                "the staged route does not serve a {} host pool (a packed draft interleaves the target's pages); use a direct route",
                like.format
            )));
        }
        // A mirror stages a run of the transfer's pages, page 0 included: no padding page, so
        // one page is a valid staging.
        if pages == 0 {
            return Err(Error::InvalidArgument("staging of 0 pages".into()));
        }
        Self::allocate(
            backend,
            &like.geometry,
            like.components.clone(),
            HostFormat::kvshard(like.format.layout),
            pages,
            MemoryKind::Device,
        )
    }

    pub(super) fn check(geometry: &CacheGeometry, pages: u64) -> Result<Vec<ComponentLayout>> {
        geometry.validate()?;
        if pages < 2 {
            return Err(Error::InvalidArgument(format!(
                "a host pool needs at least 2 pages (page 0 is padding), got {pages}"
            )));
        }
        Ok(geometry.components())
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        space: AddressSpace,
        geometry: &CacheGeometry,
        format: HostFormat,
        pages: u64,
        components: Vec<ComponentLayout>,
        slots: Vec<(usize, usize)>,
        mut buffers: Vec<HostBuf>,
        numa: NumaPlacement,
    ) -> Self {
        // One record for the whole pool, holding every buffer's memory until the work queued
        // on the pool has completed; the buffers the pool hands out report to it too.
        let kept: Vec<Buffer> = buffers.iter().map(|b| b.memory.clone()).collect();
        let usage = Usage::new(Some(Box::new(kept)));
        for b in &mut buffers {
            b.memory = b.memory.tracked_by(&usage);
        }
        Self {
            usage,
            id: SpaceId::next(),
            space,
            geometry: geometry.clone(),
            format,
            pages,
            components,
            slots,
            buffers,
            numa,
        }
    }
}

/// Refuses a region list of the wrong length.
fn check_region_count(buffers: usize, given: usize) -> Result<()> {
    if buffers != given {
        return Err(Error::GeometryMismatch {
            what: "host regions (one per buffer of the format)".into(),
            expected: buffers.to_string(),
            got: given.to_string(),
        });
    }
    Ok(())
}

/// A buffer's name in errors: its components.
fn buffer_name(layout: &HostBufferLayout) -> String {
    let names: Vec<String> = layout.components.iter().map(|c| c.to_string()).collect();
    names.join(" + ")
}

/// The device alias of a region registered as `chunks` (host, alias, bytes), which must be one
/// contiguous device range because the copy paths address a buffer linearly.
fn linear_alias(name: &str, chunks: &[(usize, u64, usize)]) -> Result<u64> {
    let base = chunks
        .first()
        .map(|&(_, alias, _)| alias)
        .ok_or_else(|| Error::HiCache(format!("{name} region registered no chunk")))?;
    let mut expected = base;
    for &(host, alias, bytes) in chunks {
        if alias != expected {
            return Err(Error::HiCache(format!(
                "{name}: the driver mapped the chunk at host {host:#x} to device {alias:#x}, \
                 not {expected:#x}: the registered region is not one contiguous device range"
            )));
        }
        expected = alias + bytes as u64;
    }
    Ok(base)
}

/// The host address of pinned memory kvshard allocated, asked of the driver through its device
/// alias (`None` when the driver does not say).
fn host_address(memory: &Buffer) -> Option<usize> {
    if memory.is_empty() {
        return None;
    }
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: one pointer-sized attribute written into `host`; the alias belongs to a live
    // allocation of the device whose context the allocation just made current on this thread.
    let asked = unsafe {
        cudarc::driver::sys::cuPointerGetAttribute(
            (&mut host as *mut *mut std::ffi::c_void).cast(),
            cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_HOST_POINTER,
            memory.addr(),
        )
    };
    (asked == cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS && !host.is_null())
        .then_some(host as usize)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
