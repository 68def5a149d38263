//! What NIXL registers and addresses: the backend a side runs on and how NIXL sees its memory
//! ([`NixlBackend`]), the regions of a pool, and the page-major bounce slots ([`BounceSpace`]).

use std::fmt;
use std::sync::Arc;

use nixl_sys::RegistrationHandle;

use super::agent::{Agent, Memory};
use crate::abi;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::{AddressSpace, Backend, Buffer};
use crate::copy::space::{sealed, REGION_ALIGN};
use crate::copy::{BlockSpace, SpaceId};
use crate::error::{Checked, Error, Result};
use crate::geometry::{CacheGeometry, Component, ComponentLayout};
use crate::pool::DevicePool;

/// The backend a NIXL side runs its block copies (bounce packing and scattering) on, which also
/// says how NIXL sees the side's memory.
#[derive(Clone)]
pub enum NixlBackend {
    /// The CPU twin, in immediate mode: its allocations are host memory (NIXL DRAM), registered
    /// at their process addresses ([`CpuBackend::host_address`]).
    Cpu(Arc<CpuBackend>),
    /// A CUDA backend: device memory of its GPU (NIXL VRAM), registered at its device
    /// addresses.
    Cuda(Arc<CudaBackend>),
}

impl fmt::Debug for NixlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu(_) => f.write_str("NixlBackend::Cpu"),
            Self::Cuda(b) => write!(f, "NixlBackend::Cuda({})", b.address_space()),
        }
    }
}

impl NixlBackend {
    /// The backend, to run copies on.
    pub fn backend(&self) -> Arc<dyn Backend> {
        match self {
            Self::Cpu(b) => b.clone(),
            Self::Cuda(b) => b.clone(),
        }
    }

    /// Refuses a deferred CPU backend: its work runs only when something waits for it, and
    /// NIXL reads and writes its memory without waiting for anything.
    pub(crate) fn check(&self) -> Result<()> {
        match self {
            Self::Cpu(b) if b.is_deferred() => Err(Error::InvalidArgument(
                "NIXL on the CPU backend needs an immediate-mode backend (CpuBackend::new)".into(),
            )),
            _ => Ok(()),
        }
    }

    pub(crate) fn memory(&self) -> Memory {
        match self {
            Self::Cpu(_) => Memory {
                vram: false,
                device: 0,
            },
            Self::Cuda(b) => Memory {
                vram: true,
                device: match b.address_space() {
                    AddressSpace::Cuda(ordinal) => ordinal as u64,
                    _ => 0,
                },
            },
        }
    }

    /// The address NIXL uses for `[addr, addr + len)` of this backend's memory.
    pub(crate) fn nixl_address(&self, addr: u64, len: usize) -> Result<u64> {
        match self {
            Self::Cpu(b) => Ok(b.host_address(addr, len)? as u64),
            Self::Cuda(_) => Ok(addr),
        }
    }

    /// Registers `[addr, addr + len)` of this backend's memory with `agent`, at the address
    /// NIXL sees it by; deregistered when the handle drops.
    ///
    /// # Safety
    /// The range must stay valid until the handle has been dropped.
    pub(crate) unsafe fn register(
        &self,
        agent: &Agent,
        addr: u64,
        len: usize,
    ) -> Result<RegistrationHandle> {
        if let Self::Cuda(b) = self {
            // UCX's cuda_ipc shares VRAM with legacy IPC handles, which memory of a
            // stream-ordered pool has none of: UCX would move it through host bounce buffers,
            // or fail, instead of over NVLink.
            b.gpu().bind()?;
            if crate::gpu::mempool::from_a_pool(addr)? {
                return Err(Error::InvalidArgument(format!(
                    "NIXL registration of VRAM at {addr:#x}: memory of a stream-ordered pool \
                     (kvshard's device memory, or cudaMallocAsync's) is not what UCX's cuda_ipc \
                     takes; allocate the pool with DevicePool::allocate_registrable"
                )));
            }
        }
        let at = self.nixl_address(addr, len)?;
        // SAFETY: memory of this backend, of the kind `memory()` says; the caller keeps it
        // valid until the handle has dropped.
        unsafe { agent.register(at as usize, len, self.memory()) }
    }

    /// Registers every region of `pool` (memory of this backend) with `agent`.
    ///
    /// # Safety
    /// The caller holds `pool` until every returned handle has been dropped.
    pub(crate) unsafe fn register_pool(
        &self,
        agent: &Agent,
        pool: &DevicePool,
    ) -> Result<Vec<RegistrationHandle>> {
        pool_regions(pool)?
            .into_iter()
            // SAFETY: the pool's memory (its allocation, or buffers `wrap`'s contract keeps
            // valid while the pool lives), which the caller holds for as long as the handles.
            .map(|(addr, len)| unsafe { self.register(agent, addr, len) })
            .collect()
    }

    /// Checks `space` is memory of this backend.
    pub(crate) fn check_space(&self, space: &dyn BlockSpace, what: &str) -> Result<()> {
        crate::backend::check_space(self.backend().address_space(), space.address_space(), what)
    }
}

/// The contiguous regions holding every layer buffer of `pool` (kvshard's own allocation, or
/// the engine's layer buffers with adjacent ones merged), as (address, bytes) of its backend.
fn pool_regions(pool: &DevicePool) -> Result<Vec<(u64, usize)>> {
    if let Some(storage) = pool.storage() {
        return Ok(vec![(storage.addr(), storage.len())]);
    }
    let mut ranges = Vec::new();
    for c in pool.geometry().components() {
        let bytes = crate::error::to_usize(
            pool.pages().mul_or(c.block_bytes as u64, || {
                format!("{} layer bytes", c.component)
            })?,
            || format!("{} layer bytes", c.component),
        )?;
        for &base in pool.layer_bases(c.component)? {
            ranges.push((base, bytes));
        }
    }
    ranges.sort_unstable();
    let mut merged: Vec<(u64, usize)> = Vec::new();
    for (addr, len) in ranges {
        match merged.last_mut() {
            Some((a, l)) if *a + *l as u64 >= addr => {
                let end = (addr + len as u64).max(*a + *l as u64);
                *l = (end - *a) as usize;
            }
            _ => merged.push((addr, len)),
        }
    }
    Ok(merged)
}

/// One bounce slot: `pages` pages of every component, **page-major** per component
/// (`[component][page][layer][block]`), so the first `k` pages of a component are one
/// contiguous range whatever `k` is: a chunk's packed pages move as one descriptor per
/// component, and descriptor lists of every prefix length can be prepared once.
pub(crate) struct BounceSpace {
    id: SpaceId,
    components: Vec<ComponentLayout>,
    pages: u64,
    /// Byte offset of each component's region in the buffer.
    regions: Vec<usize>,
    buffer: Buffer,
}

impl fmt::Debug for BounceSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BounceSpace")
            .field("id", &self.id)
            .field("pages", &self.pages)
            .field("bytes", &self.buffer.len())
            .finish_non_exhaustive()
    }
}

impl BounceSpace {
    /// Each component's offset in a slot of `pages` pages of `geometry`, and the slot's bytes
    /// (both sides compute the same from the same geometry).
    pub fn layout(geometry: &CacheGeometry, pages: u64) -> Result<(Vec<usize>, usize)> {
        let what = || format!("a bounce slot of {pages} pages");
        let pages = crate::error::to_usize(pages, what)?;
        let mut offset = 0usize;
        let mut regions = Vec::new();
        for c in geometry.components() {
            regions.push(offset);
            offset = pages
                .mul_or(c.page_bytes(), what)?
                .add_or(offset, what)?
                .checked_next_multiple_of(REGION_ALIGN)
                .ok_or_else(|| Error::overflow(what()))?;
        }
        Ok((regions, offset))
    }

    /// `slots` slots of `pages` pages each, in one allocation of `backend`'s device memory that
    /// NIXL can register ([`Backend::alloc_registrable`]).
    pub fn allocate(
        backend: &dyn Backend,
        geometry: &CacheGeometry,
        pages: u64,
        slots: usize,
    ) -> Result<(Buffer, Vec<Arc<BounceSpace>>)> {
        geometry.validate()?;
        let (regions, bytes) = Self::layout(geometry, pages)?;
        let total = bytes.mul_or(slots, || format!("{slots} bounce slots"))?;
        let buffer = backend.alloc_registrable(total.max(1))?;
        let spaces = (0..slots)
            .map(|s| {
                Ok(Arc::new(BounceSpace {
                    id: SpaceId::next(),
                    components: geometry.components(),
                    pages,
                    regions: regions.clone(),
                    buffer: buffer.slice(s * bytes, bytes)?,
                }))
            })
            .collect::<Result<_>>()?;
        Ok((buffer, spaces))
    }

    /// Address (of the backend) and bytes of the first `pages` pages of component index `c`.
    pub fn prefix(&self, c: usize, pages: u64) -> (u64, u64) {
        let comp = &self.components[c];
        (
            self.buffer.addr() + self.regions[c] as u64,
            pages * comp.page_bytes() as u64,
        )
    }

    /// The slot's address (of the backend).
    pub fn addr(&self) -> u64 {
        self.buffer.addr()
    }

    /// The slot's memory, whole (a dense region of a decode context-parallel chunk lies at its
    /// start).
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }
}

impl sealed::Sealed for BounceSpace {
    fn base(&self, c: usize, layer: usize) -> u64 {
        self.buffer.addr()
            + self.regions[c] as u64
            + (layer * self.components[c].block_bytes) as u64
    }

    fn side(&self, c: usize) -> abi::kvs_block_side {
        let comp = &self.components[c];
        abi::kvs_block_side {
            page_stride: comp.page_bytes() as u64,
            row_stride: comp.row_bytes as u64,
        }
    }

    fn layer_count(&self, c: usize) -> usize {
        self.components[c].layers()
    }

    fn usage(&self) -> &crate::backend::Usage {
        self.buffer.usage()
    }
}

impl BlockSpace for BounceSpace {
    fn id(&self) -> SpaceId {
        self.id
    }

    fn address_space(&self) -> AddressSpace {
        self.buffer.space()
    }

    fn components(&self) -> &[ComponentLayout] {
        &self.components
    }

    fn pages(&self) -> u64 {
        self.pages
    }
}

/// The index of `component` in `geometry.components()`.
pub(crate) fn component_index(
    components: &[ComponentLayout],
    component: Component,
) -> Result<usize> {
    components
        .iter()
        .position(|c| c.component == component)
        .ok_or_else(|| Error::InvalidArgument(format!("the cache holds no {component}")))
}
