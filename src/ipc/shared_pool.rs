//! KV pools shared between processes: the decode side allocates (or shares) its pool as memory
//! another process can map, describes it in a [`PublishPool`] message, and a prefill process
//! maps it into its own backend's address space, where it becomes a
//! [`RemoteSpace`] its copy kernels write straight into.
//!
//! | backend | exported as | [`PoolSharing`] | imported with |
//! |---|---|---|---|
//! | CUDA, kvshard's pool | one VMM allocation (`cuMemCreate`), fabric handle where the device and an IMEX channel allow it | `CudaFabric`, else `CudaVmmFd` | `cuMemImportFromShareableHandle`, `cuMemMap`, `cuMemSetAccess` for the importing GPU |
//! | CUDA, engine buffers (`cudaMalloc`) | one legacy IPC handle per allocation the layers lie in | `CudaIpc` | `cuIpcOpenMemHandle` (peer access enabled for the importing GPU) |
//! | CPU twin | one sealed memfd, adopted into the CPU backend's arena | `CpuMemfd` | `mmap` of the memfd, adopted into the importer's arena |
//!
//! The importing GPU may be the exporter's (two processes on one device) or a peer: access is
//! granted to the importing device, so its kernels write the exporter's memory over NVLink.
//! An import checks the published geometry against the layout it describes and every region's
//! size before mapping anything, and unmaps on drop (after this process's work on the device
//! has finished).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::shm::SharedMemory;
use super::wire::Message;
use super::wire::{self, Handle64, LayerAt, PoolSharing, PublishPool, Region};
use crate::backend::cpu::{CpuBackend, HostBytes};
use crate::backend::cuda::CudaBackend;
use crate::backend::{AddressSpace, Backend, Buffer, MemoryKind as BufferKind};
use crate::copy::{BlockSpace, RemoteSpace};
use crate::error::{Error, Result};
use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use crate::gpu::vmm::{self, ExportableMemory, ImportedMemory, IpcMapping, IpcMemHandle};
use crate::pool::{DevicePool, PoolLayout};
use crate::shard::Placement;

/// Where a process keeps its pools and maps another process's: the CPU twin's arena, or one GPU
/// (a stream of it: transfers enqueue there).
#[derive(Clone)]
pub enum PeerBackend {
    /// The CPU reference backend: pools in shared memory (memfd).
    Cpu(Arc<CpuBackend>),
    /// A GPU: pools in exportable VMM memory, or engine buffers shared by legacy IPC.
    Cuda(Arc<CudaBackend>),
}

impl std::fmt::Debug for PeerBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerBackend({})", self.address_space())
    }
}

impl PeerBackend {
    /// The backend, as pools, copies and transports take it.
    pub fn backend(&self) -> Arc<dyn Backend> {
        match self {
            Self::Cpu(b) => b.clone(),
            Self::Cuda(b) => b.clone(),
        }
    }

    /// The address space pools and imports of this backend live in.
    pub fn address_space(&self) -> AddressSpace {
        match self {
            Self::Cpu(b) => b.address_space(),
            Self::Cuda(b) => b.address_space(),
        }
    }
}

/// A mapping of a memfd in the CPU backend's arena. Another process maps the same pages.
struct MemfdBytes(SharedMemory);

impl HostBytes for MemfdBytes {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is live and `len` bytes long for as long as `self`. The arena
        // touches it only under its device lock, so this process never writes it while the slice
        // lives. Another process may write pages of it meanwhile: what each process touches is
        // the P/D protocol's business (a prefill writes a request's destination pages only while
        // the request is open; the decode reads them only after every rank's final status, which
        // arrives over a socket: the system calls order the accesses), as with any memory shared
        // between processes.
        unsafe { self.0.as_slice() }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` rules out every other access in this process.
        unsafe { self.0.as_mut_slice() }
    }
}

/// The geometry as it travels in [`PublishPool::geometry`] (postcard).
#[derive(Debug, Serialize, Deserialize)]
struct GeometryWire {
    target: PoolWire,
    draft: Option<PoolWire>,
}

#[derive(Debug, Serialize, Deserialize)]
struct PoolWire {
    /// The kernel ABI code of the latent layout.
    latent: u32,
    page_size: u64,
    indexer_head_dim: u64,
    indexer_quant_block: u64,
    indexer_layers: Vec<bool>,
}

impl PoolWire {
    fn of(p: &PoolGeometry) -> Self {
        Self {
            latent: p.latent.abi(),
            page_size: p.page_size as u64,
            indexer_head_dim: p.indexer_head_dim as u64,
            indexer_quant_block: p.indexer_quant_block as u64,
            indexer_layers: p.indexer_layers.clone(),
        }
    }

    fn geometry(&self) -> Result<PoolGeometry> {
        let latent = LatentLayout::ALL
            .into_iter()
            .find(|l| l.abi() == self.latent)
            .ok_or_else(|| {
                Error::InvalidGeometry(format!("unknown latent layout code {}", self.latent))
            })?;
        let size = |v: u64, what: &str| {
            usize::try_from(v)
                .map_err(|_| Error::InvalidGeometry(format!("{what} {v} does not fit this host")))
        };
        Ok(PoolGeometry {
            latent,
            page_size: size(self.page_size, "page size")?,
            indexer_head_dim: size(self.indexer_head_dim, "indexer head dim")?,
            indexer_quant_block: size(self.indexer_quant_block, "indexer quant block")?,
            indexer_layers: self.indexer_layers.clone(),
        })
    }
}

/// `geometry` as [`PublishPool::geometry`] carries it.
pub fn encode_geometry(geometry: &CacheGeometry) -> Result<Vec<u8>> {
    let wire = GeometryWire {
        target: PoolWire::of(&geometry.target),
        draft: geometry.draft.as_ref().map(PoolWire::of),
    };
    postcard::to_allocvec(&wire)
        .map_err(|e| Error::InvalidArgument(format!("cannot encode the geometry: {e}")))
}

/// The geometry a [`PublishPool::geometry`] describes, validated.
pub fn decode_geometry(bytes: &[u8]) -> Result<CacheGeometry> {
    let wire: GeometryWire = postcard::from_bytes(bytes)
        .map_err(|e| Error::InvalidGeometry(format!("undecodable published geometry: {e}")))?;
    let geometry = CacheGeometry {
        target: wire.target.geometry()?,
        draft: wire.draft.as_ref().map(PoolWire::geometry).transpose()?,
    };
    geometry.validate()?;
    Ok(geometry)
}

/// How an exported pool's memory is shared.
enum Sharing {
    /// The CPU twin: a descriptor of the memfd the pool was allocated in.
    Memfd { fd: OwnedFd, bytes: u64 },
    /// One VMM allocation.
    Vmm(Arc<ExportableMemory>),
    /// Legacy IPC handles of the `cuMemAlloc` allocations the layers lie in.
    Ipc(Vec<(IpcMemHandle, u64)>),
}

/// A pool other processes can map: allocated as exportable memory, or an existing pool in
/// `cuMemAlloc` memory shared with legacy IPC handles. Publish it with
/// [`ExportedPool::publication`] (what `transfer::DecodeEndpoint::publish` sends).
pub struct ExportedPool {
    pool: Arc<DevicePool>,
    sharing: Sharing,
    /// Per component (of the pool), per stored layer: where its page 0 is.
    layers: Vec<Vec<LayerAt>>,
    fabric_absent: Option<String>,
}

impl std::fmt::Debug for ExportedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportedPool")
            .field("pool", &self.pool)
            .field("memory", &self.memory())
            .finish_non_exhaustive()
    }
}

impl ExportedPool {
    /// Allocates a pool like [`DevicePool::allocate`] in memory other processes can map: one
    /// exportable VMM allocation on a GPU (its size rounded up to the allocation granularity),
    /// one sealed memfd on the CPU twin.
    pub fn allocate(
        backend: &PeerBackend,
        geometry: &CacheGeometry,
        placement: Placement,
        rank: u32,
        pages: u64,
    ) -> Result<Self> {
        match backend {
            PeerBackend::Cpu(cpu) => {
                let mut fd = None;
                let pool = DevicePool::allocate_with(geometry, placement, rank, pages, |total| {
                    let shm = SharedMemory::create("kvshard-pd-pool", total.max(1))?;
                    fd = Some(shm.export_fd()?);
                    cpu.adopt(Box::new(MemfdBytes(shm)), BufferKind::Device)
                })?;
                let fd = fd.ok_or_else(|| {
                    Error::InvalidArgument("the pool allocation made no memfd".into())
                })?;
                let bytes = pool_bytes(&pool)?;
                Self::single_region(pool, Sharing::Memfd { fd, bytes }, None)
            }
            PeerBackend::Cuda(cuda) => {
                let ctx = cuda.gpu().context().clone();
                let space = cuda.address_space();
                let mut memory = None;
                let pool = DevicePool::allocate_with(geometry, placement, rank, pages, |total| {
                    let mem = Arc::new(ExportableMemory::new(&ctx, total.max(1))?);
                    let buffer =
                        Buffer::owned(mem.ptr(), mem.len(), BufferKind::Device, space, mem.clone());
                    memory = Some(mem);
                    Ok(buffer)
                })?;
                let memory = memory.ok_or_else(|| {
                    Error::InvalidArgument("the pool allocation made no VMM memory".into())
                })?;
                let absent = memory.fabric_absent().map(str::to_string);
                Self::single_region(pool, Sharing::Vmm(memory), absent)
            }
        }
    }

    /// Shares `pool` (its layers in `cuMemAlloc`/`cudaMalloc` memory of `backend`'s GPU: an
    /// engine's buffers wrapped with [`DevicePool::wrap`], or a pool kvshard allocated there)
    /// through one legacy IPC handle per allocation its layers lie in.
    pub fn share_ipc(backend: &CudaBackend, pool: Arc<DevicePool>) -> Result<Self> {
        crate::backend::check_space(backend.address_space(), pool.address_space(), "the pool")?;
        let ctx = backend.gpu().context();
        let mut allocations: Vec<(u64, u64)> = Vec::new();
        let mut handles = Vec::new();
        let mut layers = Vec::new();
        for comp in pool.components() {
            let extent = pool.pages() * comp.block_bytes as u64;
            let mut at = Vec::with_capacity(comp.layers());
            for &base in pool.layer_bases(comp.component)? {
                let (start, size) = vmm::allocation_of(ctx, base)?;
                let region = match allocations.iter().position(|&(s, _)| s == start) {
                    Some(r) => r,
                    None => {
                        let (handle, _) = IpcMemHandle::of(ctx, start)?;
                        handles.push((handle, size as u64));
                        allocations.push((start, size as u64));
                        allocations.len() - 1
                    }
                };
                let offset = base - start;
                if offset + extent > size as u64 {
                    return Err(Error::InvalidArgument(format!(
                        "{} layer at {base:#x}: {extent} bytes run past its allocation at {start:#x} of {size} bytes",
                        comp.component
                    )));
                }
                at.push(LayerAt {
                    region: region as u32,
                    offset,
                });
            }
            layers.push(at);
        }
        Ok(Self {
            pool,
            sharing: Sharing::Ipc(handles),
            layers,
            fabric_absent: Some("legacy IPC handles share cudaMalloc memory".into()),
        })
    }

    /// A pool in one allocation (`storage`), every layer an offset into it.
    fn single_region(
        pool: DevicePool,
        sharing: Sharing,
        fabric_absent: Option<String>,
    ) -> Result<Self> {
        let start = pool
            .storage()
            .map(Buffer::addr)
            .ok_or_else(|| Error::InvalidArgument("an allocated pool has no storage".into()))?;
        let mut layers = Vec::new();
        for comp in pool.components() {
            let bases = pool.layer_bases(comp.component)?;
            layers.push(
                bases
                    .iter()
                    .map(|&b| LayerAt {
                        region: 0,
                        offset: b - start,
                    })
                    .collect(),
            );
        }
        Ok(Self {
            pool: Arc::new(pool),
            sharing,
            layers,
            fabric_absent,
        })
    }

    /// The pool, as this process uses it.
    pub fn pool(&self) -> &Arc<DevicePool> {
        &self.pool
    }

    /// How the pool is published: fabric handles where the allocation has one (they work across
    /// hosts of an NVLink domain and need no descriptor passing), else POSIX descriptors.
    pub fn memory(&self) -> PoolSharing {
        match &self.sharing {
            Sharing::Memfd { .. } => PoolSharing::CpuMemfd,
            Sharing::Vmm(m) if m.fabric_handle().is_some() => PoolSharing::CudaFabric,
            Sharing::Vmm(_) => PoolSharing::CudaVmmFd,
            Sharing::Ipc(_) => PoolSharing::CudaIpc,
        }
    }

    /// Why the pool is not published with fabric handles (`None` when it is).
    pub fn fabric_absent(&self) -> Option<&str> {
        match &self.sharing {
            Sharing::Memfd { .. } => Some("the CPU twin shares a memfd"),
            _ => self.fabric_absent.as_deref(),
        }
    }

    /// The [`PublishPool`] message for this pool under id `pool`, and the descriptors to attach
    /// (exported anew for each publication; the receiver gets duplicates).
    pub fn publication(&self, pool: u64) -> Result<(Message, Vec<OwnedFd>)> {
        let mut fds = Vec::new();
        let regions = match &self.sharing {
            Sharing::Memfd { fd, bytes } => {
                fds.push(fd.try_clone().map_err(|source| Error::Os {
                    call: "fcntl(F_DUPFD_CLOEXEC)",
                    source,
                })?);
                vec![Region {
                    bytes: *bytes,
                    handle: None,
                }]
            }
            Sharing::Vmm(m) => {
                let handle = m.fabric_handle().map(Handle64);
                if handle.is_none() {
                    fds.push(m.export_fd()?);
                }
                vec![Region {
                    bytes: m.len() as u64,
                    handle,
                }]
            }
            Sharing::Ipc(handles) => handles
                .iter()
                .map(|(h, bytes)| Region {
                    bytes: *bytes,
                    handle: Some(Handle64(h.to_bytes())),
                })
                .collect(),
        };
        let components = self
            .pool
            .components()
            .iter()
            .zip(&self.layers)
            .map(|(c, layers)| wire::PublishedComponent {
                name: c.component.to_string(),
                layers: layers.clone(),
                page_stride: c.block_bytes as u64,
                pages: self.pool.pages(),
            })
            .collect();
        let msg = Message::PublishPool(PublishPool {
            pool,
            memory: self.memory(),
            regions,
            components,
            geometry: encode_geometry(self.pool.geometry())?,
        });
        Ok((msg, fds))
    }
}

/// Bytes of a pool's one allocation.
fn pool_bytes(pool: &DevicePool) -> Result<u64> {
    pool.storage()
        .map(|s| s.len() as u64)
        .ok_or_else(|| Error::InvalidArgument("an allocated pool has no storage".into()))
}

/// What keeps an imported pool mapped: dropped last by the [`RemoteSpace`] and every copy that
/// used it.
enum Mapped {
    /// A memfd mapping adopted into the CPU arena (unmapped when the buffer's last share goes).
    Cpu(Buffer),
    /// A VMM import (unmapped on drop, after this process's work on the device).
    Vmm(ImportedMemory),
    /// A legacy IPC mapping (closed on drop, after this process's work on the device).
    Ipc(IpcMapping),
}

/// Another process's published pool, mapped into this process's backend: the destination its
/// transports write into.
pub struct ImportedPool {
    pool: u64,
    geometry: CacheGeometry,
    pages: u64,
    memory: PoolSharing,
    space: Arc<RemoteSpace>,
}

impl std::fmt::Debug for ImportedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedPool")
            .field("pool", &self.pool)
            .field("memory", &self.memory)
            .field("pages", &self.pages)
            .field("space", &self.space)
            .finish_non_exhaustive()
    }
}

impl ImportedPool {
    /// Maps the pool `publication` describes (with the descriptors that came with it, in
    /// order) into `backend`'s address space. Refused before anything is mapped when the
    /// geometry does not decode, its components differ from the published layout, or the
    /// memory kind is not one `backend` can map; a region whose size the exporter's memory does
    /// not have is refused by the import itself.
    pub fn import(
        backend: &PeerBackend,
        publication: &PublishPool,
        fds: Vec<OwnedFd>,
    ) -> Result<Self> {
        Message::PublishPool(publication.clone())
            .check(fds.len())
            .map_err(|violation| Error::Protocol {
                rank: None,
                violation,
            })?;
        let geometry = decode_geometry(&publication.geometry)?;
        let pages = check_components(&geometry, publication)?;
        let mapped = map_regions(backend, publication, fds)?;
        let addrs: Vec<u64> = mapped.iter().map(Mapped::addr).collect();
        let bases = publication
            .components
            .iter()
            .map(|c| {
                c.layers
                    .iter()
                    .map(|l| addrs[l.region as usize] + l.offset)
                    .collect()
            })
            .collect();
        let keep: Arc<dyn Send + Sync> = Arc::new(mapped);
        // SAFETY: every layer range lies inside its region (PublishPool::check bounded
        // `offset + pages * page_stride` by the region's bytes, and check_components tied the
        // strides to the geometry's blocks), each region is mapped read-write into `backend`'s
        // address space at `addrs` (an arena allocation, or a device mapping whose access was
        // granted to this backend's GPU), and `keep` holds the mappings for as long as the
        // space and every copy keeping it alive exist.
        let space = unsafe {
            RemoteSpace::from_raw(
                backend.address_space(),
                geometry.clone(),
                pages,
                bases,
                keep,
            )?
        };
        Ok(Self {
            pool: publication.pool,
            geometry,
            pages,
            memory: publication.memory,
            space: Arc::new(space),
        })
    }

    /// The publisher's id of the pool.
    pub fn id(&self) -> u64 {
        self.pool
    }

    /// The pool's geometry.
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    /// Pages per layer.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// How the pool's memory was shared.
    pub fn memory(&self) -> PoolSharing {
        self.memory
    }

    /// The layout registrations for this pool describe.
    pub fn layout(&self) -> PoolLayout {
        PoolLayout::packed(self.geometry.clone(), self.pages)
    }

    /// The pool as a destination of this process's copies (it keeps the mappings).
    pub fn space(&self) -> &Arc<RemoteSpace> {
        &self.space
    }
}

impl Mapped {
    fn addr(&self) -> u64 {
        match self {
            Self::Cpu(b) => b.addr(),
            Self::Vmm(m) => m.ptr(),
            Self::Ipc(m) => m.ptr(),
        }
    }
}

/// Checks the published components are exactly the geometry's, packed, all of one page count;
/// returns the page count.
fn check_components(geometry: &CacheGeometry, p: &PublishPool) -> Result<u64> {
    let expected = geometry.components();
    let mismatch = |what: String, expected: String, got: String| Error::GeometryMismatch {
        what: format!("published pool {}: {what}", p.pool),
        expected,
        got,
    };
    if expected.len() != p.components.len() {
        return Err(mismatch(
            "components".into(),
            expected.len().to_string(),
            p.components.len().to_string(),
        ));
    }
    let pages = p.components.first().map_or(0, |c| c.pages);
    for (e, c) in expected.iter().zip(&p.components) {
        let name = e.component.to_string();
        if c.name != name {
            return Err(mismatch("component".into(), name, c.name.clone()));
        }
        if c.layers.len() != e.layers() {
            return Err(mismatch(
                format!("{name} layers"),
                e.layers().to_string(),
                c.layers.len().to_string(),
            ));
        }
        if c.page_stride != e.block_bytes as u64 {
            return Err(mismatch(
                format!("{name} page stride (packed blocks)"),
                e.block_bytes.to_string(),
                c.page_stride.to_string(),
            ));
        }
        if c.pages != pages {
            return Err(mismatch(
                format!("{name} pages"),
                pages.to_string(),
                c.pages.to_string(),
            ));
        }
        if let Some(bad) = c.layers.iter().find(|l| l.offset % 16 != 0) {
            return Err(Error::InvalidArgument(format!(
                "published pool {}: {name} layer at offset {} is not 16-byte aligned",
                p.pool, bad.offset
            )));
        }
    }
    if pages < 2 {
        return Err(Error::InvalidArgument(format!(
            "published pool {} holds {pages} pages (a pool has at least 2: page 0 is padding)",
            p.pool
        )));
    }
    Ok(pages)
}

/// Maps every region of `p` into `backend`, in order.
fn map_regions(backend: &PeerBackend, p: &PublishPool, fds: Vec<OwnedFd>) -> Result<Vec<Mapped>> {
    let refuse = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "published pool {} is {:?} memory, which {} cannot map: {why}",
            p.pool,
            p.memory,
            backend.address_space()
        )))
    };
    let size =
        |r: &Region| crate::error::to_usize(r.bytes, || format!("a region of {} bytes", r.bytes));
    let mut fds = fds.into_iter();
    let mut mapped = Vec::with_capacity(p.regions.len());
    for r in &p.regions {
        let bytes = size(r)?;
        mapped.push(match (backend, p.memory) {
            (PeerBackend::Cpu(cpu), PoolSharing::CpuMemfd) => {
                let fd = next_fd(&mut fds)?;
                let shm = SharedMemory::from_fd(fd, bytes)?;
                Mapped::Cpu(cpu.adopt(Box::new(MemfdBytes(shm)), BufferKind::Device)?)
            }
            (PeerBackend::Cuda(cuda), PoolSharing::CudaVmmFd) => {
                let fd = next_fd(&mut fds)?;
                let ctx = cuda.gpu().context();
                Mapped::Vmm(ImportedMemory::from_fd(ctx, fd.as_fd(), bytes)?)
            }
            (PeerBackend::Cuda(cuda), PoolSharing::CudaFabric) => {
                let handle = region_handle(p, r)?;
                Mapped::Vmm(ImportedMemory::from_fabric(
                    cuda.gpu().context(),
                    &handle.0,
                    bytes,
                )?)
            }
            (PeerBackend::Cuda(cuda), PoolSharing::CudaIpc) => {
                let handle = region_handle(p, r)?;
                Mapped::Ipc(IpcMapping::open(
                    cuda.gpu().context(),
                    &IpcMemHandle::from_bytes(handle.0),
                    bytes,
                )?)
            }
            (PeerBackend::Cpu(_), _) => return refuse("the CPU twin maps memfds only"),
            (PeerBackend::Cuda(_), PoolSharing::CpuMemfd) => {
                return refuse("a GPU maps device memory only")
            }
        });
    }
    Ok(mapped)
}

fn next_fd(fds: &mut impl Iterator<Item = OwnedFd>) -> Result<OwnedFd> {
    fds.next().ok_or_else(|| {
        Error::InvalidArgument("a published region came without its descriptor".into())
    })
}

fn region_handle(p: &PublishPool, r: &Region) -> Result<Handle64> {
    r.handle.ok_or_else(|| {
        Error::InvalidArgument(format!(
            "published pool {}: a {:?} region without its handle",
            p.pool, p.memory
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Component;
    use crate::index::{LocalPage, StoredLayer};

    fn geometry() -> CacheGeometry {
        CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Scaled,
            vec![true, false, true],
        ))
    }

    #[test]
    fn geometry_round_trips_and_garbage_is_refused() {
        let g = geometry();
        assert_eq!(decode_geometry(&encode_geometry(&g).unwrap()).unwrap(), g);
        assert!(matches!(
            decode_geometry(b"\xff\xff"),
            Err(Error::InvalidGeometry(_))
        ));
    }

    #[test]
    fn a_memfd_pool_is_imported_into_another_arena_and_written_through_it() {
        let decode = Arc::new(CpuBackend::new());
        let exported = ExportedPool::allocate(
            &PeerBackend::Cpu(decode.clone()),
            &geometry(),
            Placement::unsharded(),
            0,
            5,
        )
        .unwrap();
        assert_eq!(exported.memory(), PoolSharing::CpuMemfd);
        let (msg, fds) = exported.publication(3).unwrap();
        let Message::PublishPool(p) = msg else {
            panic!("{msg:?}")
        };
        // A second arena stands for the other process: the memfd is mapped a second time.
        let prefill = Arc::new(CpuBackend::new());
        let imported = ImportedPool::import(&PeerBackend::Cpu(prefill.clone()), &p, fds).unwrap();
        assert_eq!(imported.pages(), 5);
        assert_eq!(imported.geometry(), &geometry());
        let space = imported.space();
        assert_eq!(space.address_space(), prefill.address_space());
        let at = space
            .block_addr(Component::DraftIndexer, StoredLayer(0), LocalPage(4))
            .unwrap();
        let block = exported.pool().geometry().components()[3].block_bytes;
        // SAFETY: one block of the imported space, in the prefill arena.
        let buffer =
            unsafe { Buffer::from_raw(at, block, BufferKind::Device, space.address_space()) };
        prefill.write_sync(&buffer, 0, &vec![0x5a; block]).unwrap();
        let seen = exported
            .pool()
            .read_block_sync(
                decode.as_ref(),
                Component::DraftIndexer,
                StoredLayer(0),
                LocalPage(4),
            )
            .unwrap();
        assert_eq!(seen, vec![0x5a; block]);
    }

    #[test]
    fn imports_check_the_layout_against_the_geometry() {
        let cpu = Arc::new(CpuBackend::new());
        let exported = ExportedPool::allocate(
            &PeerBackend::Cpu(cpu.clone()),
            &geometry(),
            Placement::unsharded(),
            0,
            4,
        )
        .unwrap();
        let publication = |edit: &dyn Fn(&mut PublishPool)| {
            let (msg, fds) = exported.publication(1).unwrap();
            let Message::PublishPool(mut p) = msg else {
                panic!("{msg:?}")
            };
            edit(&mut p);
            ImportedPool::import(&PeerBackend::Cpu(cpu.clone()), &p, fds)
        };
        assert!(publication(&|_| {}).is_ok());
        let e =
            publication(&|p| p.components[1].layers.pop().map(|_| ()).unwrap_or(())).unwrap_err();
        assert!(matches!(e, Error::GeometryMismatch { .. }), "{e}");
        let e = publication(&|p| p.components[0].page_stride = 576 * 64).unwrap_err();
        assert!(e.to_string().contains("page stride"), "{e}");
        let e = publication(&|p| p.components.swap(0, 2)).unwrap_err();
        assert!(matches!(e, Error::GeometryMismatch { .. }), "{e}");
        let e = publication(&|p| {
            p.geometry = encode_geometry(&CacheGeometry::target_only(geometry().target)).unwrap()
        })
        .unwrap_err();
        assert!(matches!(e, Error::GeometryMismatch { .. }), "{e}");
        let e = publication(&|p| p.regions[0].bytes += 4096).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
}
