//! Device memory shared between processes on one host.
//!
//! - [`ExportableMemory`]: a CUDA VMM allocation (`cuMemCreate`) that can be exported as a POSIX
//!   file descriptor and, where the device and system allow it, as a fabric handle; mapped
//!   read/write for the owning device. [`ImportedMemory`] maps it in another process.
//! - [`IpcMemHandle`] / [`IpcMapping`]: legacy CUDA IPC for plain `cuMemAlloc` (`cudaMalloc`)
//!   buffers an engine already has.
//! - [`IpcEvent`]: an interprocess event, recorded by one process and waited on by another.
//!
//! Every type owns its driver handle and releases it on drop, without waiting on the dropping
//! thread. The mappings reach the rest of kvshard only as what a usage record keeps alive (an
//! exported pool's [`crate::backend::Buffer`], an imported pool's `RemoteSpace`), and a usage
//! record drops what it keeps only once every event of the work queued on it has completed
//! (`backend::usage`). So no launch of this process still queued touches a range unmapped here,
//! and kvshard never waits for the device to unmap (it used to: `cuCtxSynchronize`, a wait for
//! every stream of the engine). The unmap, release and close calls themselves may wait for the
//! device by the driver's choice, so they run on kvshard's reaper thread (`super::reaper`).
//! Work of *other* processes is the protocol's business (the P/D endpoints in
//! `transfer::endpoint` order it).
//!
//! Legacy IPC shares `cuMemAlloc` memory only: memory of a stream-ordered pool (kvshard's own
//! device memory, `super::mempool`) has no legacy handle, so a pool kvshard allocates for
//! sharing that way is allocated registrable (`DevicePool::allocate_registrable`).

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, DriverError};

use super::Stream;
use crate::error::{Error, Result};

/// Bytes of a fabric, IPC memory or IPC event handle.
pub const HANDLE_BYTES: usize = 64;

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
const FABRIC: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;

const VMM_SUPPORTED: sys::CUdevice_attribute =
    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED;
const POSIX_FD_SUPPORTED: sys::CUdevice_attribute =
    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
const FABRIC_SUPPORTED: sys::CUdevice_attribute =
    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED;
/// Where the driver's IMEX channel device nodes are; a process needs access to one to allocate
/// or import memory with fabric handles.
const IMEX_CHANNELS: &str = "/dev/nvidia-caps-imex-channels";

fn imex_channel_present() -> bool {
    std::fs::read_dir(IMEX_CHANNELS).is_ok_and(|mut entries| {
        entries.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("channel")))
    })
}

fn bind(ctx: &Arc<CudaContext>) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(Error::driver("cuCtxSetCurrent"))
}

fn ordinal(ctx: &Arc<CudaContext>) -> Result<i32> {
    i32::try_from(ctx.ordinal())
        .map_err(|_| Error::InvalidArgument(format!("device ordinal {}", ctx.ordinal())))
}

fn attribute(ctx: &Arc<CudaContext>, attr: sys::CUdevice_attribute) -> Result<i32> {
    ctx.attribute(attr)
        .map_err(Error::driver("cuDeviceGetAttribute"))
}

/// Device-resident, pinned allocation properties on the context's device.
fn properties(ordinal: i32, types: sys::CUmemAllocationHandleType) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: types,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The allocation granularity (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`) for `types` on the context's
/// device: every size and mapping offset is a multiple of it (2 MiB on current GPUs).
pub fn granularity(ctx: &Arc<CudaContext>, types: sys::CUmemAllocationHandleType) -> Result<usize> {
    let prop = properties(ordinal(ctx)?, types);
    let mut granularity = 0usize;
    // SAFETY: both pointers are valid for the call; the driver only writes `granularity`.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()
    .map_err(Error::driver("cuMemGetAllocationGranularity"))?;
    Ok(granularity.max(1))
}

/// A physical allocation handle mapped read/write for the context's device at an address range
/// of its own. Drop undoes exactly the steps that succeeded: unmap, release the handle, free the
/// address range.
#[derive(Debug)]
struct Mapping {
    ctx: Arc<CudaContext>,
    handle: sys::CUmemGenericAllocationHandle,
    ptr: sys::CUdeviceptr,
    size: usize,
    reserved: bool,
    mapped: bool,
}

impl Mapping {
    /// Takes ownership of `handle` (released on drop, on every error path too), reserves `size`
    /// bytes aligned to `align`, maps the handle there and grants the context's device
    /// read/write access. The context must be current.
    fn new(
        ctx: &Arc<CudaContext>,
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
        align: usize,
    ) -> Result<Self> {
        let mut m = Mapping {
            ctx: ctx.clone(),
            handle,
            ptr: 0,
            size,
            reserved: false,
            mapped: false,
        };
        // SAFETY: reserves a fresh range (no fixed address requested); freed in Drop.
        unsafe { sys::cuMemAddressReserve(&mut m.ptr, size, align, 0, 0) }
            .result()
            .map_err(Error::driver("cuMemAddressReserve"))?;
        m.reserved = true;
        // SAFETY: the range was just reserved with this size; the handle is live and at least
        // `size` bytes (the driver refuses a mapping past its end).
        unsafe { sys::cuMemMap(m.ptr, size, 0, handle, 0) }
            .result()
            .map_err(Error::driver("cuMemMap"))?;
        m.mapped = true;
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal(ctx)?,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole range is mapped; `access` is one valid descriptor.
        unsafe { sys::cuMemSetAccess(m.ptr, size, &access, 1) }
            .result()
            .map_err(Error::driver("cuMemSetAccess"))?;
        Ok(m)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // On the reaper thread, like every free that may wait for the device (the module docs).
        let (ctx, handle, ptr, size) = (self.ctx.clone(), self.handle, self.ptr, self.size);
        let (mapped, reserved) = (self.mapped, self.reserved);
        super::reaper::defer(move || {
            if ctx.bind_to_thread().is_err() {
                return;
            }
            if mapped {
                // SAFETY: mapped by `new` at this range and unmapped once; this process's work
                // that could use it has completed (the usage record that kept this mapping
                // dropped it only then, see the module docs).
                let _ = unsafe { sys::cuMemUnmap(ptr, size) }.result();
            }
            // SAFETY: the handle was owned by the mapping and is released once; the physical
            // memory goes when the last mapping of it (in any process) is gone.
            let _ = unsafe { sys::cuMemRelease(handle) }.result();
            if reserved {
                // SAFETY: reserved by `new` with this size, and nothing is mapped there any more.
                let _ = unsafe { sys::cuMemAddressFree(ptr, size) }.result();
            }
        });
    }
}

/// The shareable handle types an [`ExportableMemory`] can be exported through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandleTypes {
    /// A POSIX file descriptor ([`ExportableMemory::export_fd`]); always true.
    pub posix_fd: bool,
    /// A fabric handle ([`ExportableMemory::fabric_handle`]).
    pub fabric: bool,
}

/// Device memory another process can map: a CUDA VMM allocation mapped read/write for the
/// owning device, exportable as a POSIX file descriptor and, where allowed, as a fabric handle.
#[derive(Debug)]
pub struct ExportableMemory {
    mapping: Mapping,
    requested: usize,
    fabric: std::result::Result<[u8; HANDLE_BYTES], String>,
}

impl ExportableMemory {
    /// Allocates at least `bytes` (rounded up to the granularity) on the context's device.
    ///
    /// Asks for the POSIX fd and fabric handle types together where the device reports fabric
    /// support and an IMEX channel exists; if the driver refuses fabric all the same ("operation
    /// not permitted"), it allocates with the POSIX fd type alone. Without fabric,
    /// [`ExportableMemory::fabric_absent`] says why.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "exportable memory of 0 bytes".into(),
            ));
        }
        bind(ctx)?;
        let unsupported = |call| Error::Driver {
            call,
            source: DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED),
        };
        if attribute(ctx, VMM_SUPPORTED)? == 0 {
            return Err(unsupported(
                "cuMemCreate (device has no virtual memory management)",
            ));
        }
        if attribute(ctx, POSIX_FD_SUPPORTED)? == 0 {
            return Err(unsupported("cuMemCreate (device has no POSIX fd handles)"));
        }
        let requested = bytes;
        let no_fabric = if attribute(ctx, FABRIC_SUPPORTED)? == 0 {
            Some("the device reports no fabric handle support".to_string())
        } else if !imex_channel_present() {
            // Asking anyway would only fail with "operation not permitted", an API error that
            // compute-sanitizer reports in every run.
            Some(format!(
                "no IMEX channel ({IMEX_CHANNELS}/channel*): fabric handles need one"
            ))
        } else {
            None
        };
        if let Some(why) = no_fabric {
            let mapping = create(ctx, bytes, POSIX_FD)?;
            return Ok(Self {
                mapping,
                requested,
                fabric: Err(why),
            });
        }
        match create(ctx, bytes, POSIX_FD | FABRIC) {
            Ok(mapping) => {
                let fabric = export_fabric(mapping.handle)
                    .map_err(|e| format!("cuMemExportToShareableHandle(FABRIC) refused: {e}"));
                Ok(Self {
                    mapping,
                    requested,
                    fabric,
                })
            }
            Err(refused) => {
                let mapping = create(ctx, bytes, POSIX_FD)?;
                Ok(Self {
                    mapping,
                    requested,
                    fabric: Err(format!(
                        "fabric allocation refused ({refused}; an IMEX channel is needed), \
                         POSIX fd only"
                    )),
                })
            }
        }
    }

    /// Device address of the mapping in this process.
    pub fn ptr(&self) -> u64 {
        self.mapping.ptr
    }

    /// Bytes allocated and mapped (the request rounded up to the granularity): the size an
    /// importer must map.
    pub fn len(&self) -> usize {
        self.mapping.size
    }

    /// Always false: an allocation holds at least one granule.
    pub fn is_empty(&self) -> bool {
        self.mapping.size == 0
    }

    /// Bytes asked for.
    pub fn requested_len(&self) -> usize {
        self.requested
    }

    /// The handle types this allocation can be exported through.
    pub fn handle_types(&self) -> HandleTypes {
        HandleTypes {
            posix_fd: true,
            fabric: self.fabric.is_ok(),
        }
    }

    /// Why the allocation has no fabric handle (`None` when it has one).
    pub fn fabric_absent(&self) -> Option<&str> {
        self.fabric.as_ref().err().map(String::as_str)
    }

    /// A new POSIX file descriptor for the allocation (`cuMemExportToShareableHandle`), to send
    /// to another process; each call exports a new one.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        bind(&self.mapping.ctx)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for the POSIX fd type the driver writes one int to the pointer.
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                self.mapping.handle,
                POSIX_FD,
                0,
            )
        }
        .result()
        .map_err(Error::driver("cuMemExportToShareableHandle"))?;
        if fd < 0 {
            return Err(Error::InvalidArgument(format!(
                "cuMemExportToShareableHandle returned descriptor {fd}"
            )));
        }
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The fabric handle exported when the memory was allocated, if fabric was allowed.
    pub fn fabric_handle(&self) -> Option<[u8; HANDLE_BYTES]> {
        self.fabric.as_ref().ok().copied()
    }
}

/// Creates an allocation of at least `bytes` with the handle `types` and maps it; the context
/// must be current.
fn create(
    ctx: &Arc<CudaContext>,
    bytes: usize,
    types: sys::CUmemAllocationHandleType,
) -> Result<Mapping> {
    let granularity = granularity(ctx, types)?;
    let size = bytes
        .checked_next_multiple_of(granularity)
        .ok_or_else(|| Error::InvalidArgument(format!("exportable memory of {bytes} bytes")))?;
    let prop = properties(ordinal(ctx)?, types);
    let mut handle = 0;
    // SAFETY: `prop` describes pinned device memory on this context's device; the handle is
    // owned by the Mapping below from here on.
    unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }
        .result()
        .map_err(Error::driver("cuMemCreate"))?;
    Mapping::new(ctx, handle, size, granularity)
}

fn export_fabric(
    handle: sys::CUmemGenericAllocationHandle,
) -> std::result::Result<[u8; HANDLE_BYTES], DriverError> {
    let mut fabric = sys::CUmemFabricHandle {
        data: [0; HANDLE_BYTES],
    };
    // SAFETY: for the fabric type the driver writes one CUmemFabricHandle to the pointer.
    unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fabric as *mut sys::CUmemFabricHandle).cast(),
            handle,
            FABRIC,
            0,
        )
    }
    .result()?;
    Ok(fabric.data)
}

/// Another process's [`ExportableMemory`], mapped read/write for this context's device.
#[derive(Debug)]
pub struct ImportedMemory {
    mapping: Mapping,
}

impl ImportedMemory {
    /// Imports the allocation behind a POSIX descriptor from [`ExportableMemory::export_fd`]
    /// and maps `size` bytes of it (the exporter's [`ExportableMemory::len`]). The descriptor
    /// stays the caller's; it may be closed once this returns.
    pub fn from_fd(ctx: &Arc<CudaContext>, fd: BorrowedFd<'_>, size: usize) -> Result<Self> {
        let align = import_granularity(ctx, POSIX_FD, size)?;
        let mut handle = 0;
        // SAFETY: for the POSIX fd type the driver reads the descriptor from the pointer value
        // itself (a documented convention) and does not take ownership of it.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                POSIX_FD,
            )
        }
        .result()
        .map_err(Error::driver("cuMemImportFromShareableHandle"))?;
        Ok(Self {
            mapping: Mapping::new(ctx, handle, size, align)?,
        })
    }

    /// Imports the allocation behind a fabric handle from [`ExportableMemory::fabric_handle`]
    /// and maps `size` bytes of it.
    pub fn from_fabric(
        ctx: &Arc<CudaContext>,
        fabric: &[u8; HANDLE_BYTES],
        size: usize,
    ) -> Result<Self> {
        let align = import_granularity(ctx, FABRIC, size)?;
        let mut shared = sys::CUmemFabricHandle { data: *fabric };
        let mut handle = 0;
        // SAFETY: for the fabric type the driver reads one CUmemFabricHandle from the pointer.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                (&mut shared as *mut sys::CUmemFabricHandle).cast(),
                FABRIC,
            )
        }
        .result()
        .map_err(Error::driver("cuMemImportFromShareableHandle"))?;
        Ok(Self {
            mapping: Mapping::new(ctx, handle, size, align)?,
        })
    }

    /// Device address of the mapping in this process.
    pub fn ptr(&self) -> u64 {
        self.mapping.ptr
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.mapping.size
    }

    /// Always false: a mapping holds at least one granule.
    pub fn is_empty(&self) -> bool {
        self.mapping.size == 0
    }
}

/// Binds the context and checks an import size: non-zero and a whole number of granules (the
/// exporter rounded it so; anything else is a size from another allocation or a bad message).
fn import_granularity(
    ctx: &Arc<CudaContext>,
    types: sys::CUmemAllocationHandleType,
    size: usize,
) -> Result<usize> {
    bind(ctx)?;
    let granularity = granularity(ctx, types)?;
    if size == 0 || size % granularity != 0 {
        return Err(Error::InvalidArgument(format!(
            "imported memory of {size} bytes: must be a non-zero multiple of the granularity \
             {granularity} (the exporter's len())"
        )));
    }
    Ok(granularity)
}

/// A legacy CUDA IPC handle (`cuIpcGetMemHandle`) of a `cuMemAlloc` allocation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle {
    bytes: [u8; HANDLE_BYTES],
}

impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMemHandle").finish_non_exhaustive()
    }
}

impl IpcMemHandle {
    /// The handle of the allocation starting at `ptr`, which must be the base address of a
    /// `cuMemAlloc`/`cudaMalloc` allocation of this context (VMM memory has no legacy handle:
    /// export it with [`ExportableMemory`]). Returns the handle and the allocation's size.
    pub fn of(ctx: &Arc<CudaContext>, ptr: u64) -> Result<(Self, usize)> {
        bind(ctx)?;
        if super::mempool::from_a_pool(ptr)? {
            return Err(Error::InvalidArgument(format!(
                "{ptr:#x} is memory of a stream-ordered pool (kvshard's device memory, or \
                 cudaMallocAsync's), which legacy IPC cannot share: allocate it with cuMemAlloc \
                 (DevicePool::allocate_registrable)"
            )));
        }
        let (base, size) = address_range(ptr)?;
        if base != ptr {
            return Err(Error::InvalidArgument(format!(
                "{ptr:#x} is inside the allocation at {base:#x}: a legacy IPC handle shares a \
                 whole allocation, from its base"
            )));
        }
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; HANDLE_BYTES],
        };
        // SAFETY: the driver writes one handle to the pointer.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) }
            .result()
            .map_err(Error::driver("cuIpcGetMemHandle"))?;
        Ok((
            Self {
                bytes: handle.reserved.map(|b| b as u8),
            },
            size,
        ))
    }

    /// A handle received from another process.
    pub fn from_bytes(bytes: [u8; HANDLE_BYTES]) -> Self {
        Self { bytes }
    }

    /// The handle's bytes, to send.
    pub fn to_bytes(&self) -> [u8; HANDLE_BYTES] {
        self.bytes
    }
}

/// The `cuMemAlloc` allocation (base address and bytes) device address `ptr` lies in: what a
/// legacy IPC handle shares, since an engine's buffer may be a piece of a larger allocation
/// (PyTorch's caching allocator hands out such pieces).
pub fn allocation_of(ctx: &Arc<CudaContext>, ptr: u64) -> Result<(u64, usize)> {
    bind(ctx)?;
    address_range(ptr)
}

fn address_range(ptr: u64) -> Result<(u64, usize)> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: the driver writes the two outputs; an address it does not know is an error.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(Error::driver("cuMemGetAddressRange"))?;
    Ok((base, size))
}

/// Another process's `cuMemAlloc` allocation opened through its [`IpcMemHandle`]; closed on
/// drop.
#[derive(Debug)]
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl IpcMapping {
    /// Opens `handle` in this context (`cuIpcOpenMemHandle`, peer access enabled lazily when the
    /// allocation is on another device) and checks the allocation holds at least `len` bytes.
    ///
    /// The driver refuses to open a handle in the process that made it.
    pub fn open(ctx: &Arc<CudaContext>, handle: &IpcMemHandle, len: usize) -> Result<Self> {
        bind(ctx)?;
        let raw = sys::CUipcMemHandle {
            reserved: handle.bytes.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        // SAFETY: the driver writes the mapped address; the mapping is closed once, in Drop.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(Error::driver("cuIpcOpenMemHandle"))?;
        // Owned from here on, so the size check below closes it on failure.
        let mapping = Self {
            ctx: ctx.clone(),
            ptr,
            len,
        };
        let (_, size) = address_range(ptr)?;
        if size < len {
            return Err(Error::InvalidArgument(format!(
                "IPC allocation holds {size} bytes, {len} expected"
            )));
        }
        Ok(mapping)
    }

    /// Device address of the allocation in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes the opener asked for (the allocation may be larger).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the opener asked for no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let (ctx, ptr) = (self.ctx.clone(), self.ptr);
        super::reaper::defer(move || {
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: opened by `open` and closed once; this process's work that could use
                // it has completed (the usage record that kept this mapping dropped it only
                // then).
                let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) }.result();
            }
        });
    }
}

/// An interprocess CUDA event (`CU_EVENT_INTERPROCESS`, no timing): created here and shared by
/// its [`IpcEvent::handle`], or opened from another process's handle. Destroyed on drop.
#[derive(Debug)]
pub struct IpcEvent {
    ctx: Arc<CudaContext>,
    event: sys::CUevent,
}

// SAFETY: a driver event handle may be used from any thread; every use binds the context first.
unsafe impl Send for IpcEvent {}
// SAFETY: see Send; the driver serializes concurrent calls on one event.
unsafe impl Sync for IpcEvent {}

impl IpcEvent {
    /// A new interprocess event on the context.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        bind(ctx)?;
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        let mut event = std::ptr::null_mut();
        // SAFETY: valid flags (interprocess requires timing disabled); destroyed once in Drop.
        unsafe { sys::cuEventCreate(&mut event, flags) }
            .result()
            .map_err(Error::driver("cuEventCreate"))?;
        Ok(Self {
            ctx: ctx.clone(),
            event,
        })
    }

    /// Opens another process's event from its handle.
    ///
    /// The driver refuses to open a handle in the process that made it.
    pub fn open(ctx: &Arc<CudaContext>, handle: &[u8; HANDLE_BYTES]) -> Result<Self> {
        bind(ctx)?;
        let raw = sys::CUipcEventHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut event = std::ptr::null_mut();
        // SAFETY: the driver writes the opened event; it is destroyed once in Drop, which is
        // how opened events are released.
        unsafe { sys::cuIpcOpenEventHandle(&mut event, raw) }
            .result()
            .map_err(Error::driver("cuIpcOpenEventHandle"))?;
        Ok(Self {
            ctx: ctx.clone(),
            event,
        })
    }

    /// The handle another process opens this event with.
    pub fn handle(&self) -> Result<[u8; HANDLE_BYTES]> {
        bind(&self.ctx)?;
        let mut handle = sys::CUipcEventHandle {
            reserved: [0; HANDLE_BYTES],
        };
        // SAFETY: the event is live; the driver writes one handle.
        unsafe { sys::cuIpcGetEventHandle(&mut handle, self.event) }
            .result()
            .map_err(Error::driver("cuIpcGetEventHandle"))?;
        Ok(handle.reserved.map(|b| b as u8))
    }

    /// Records the event at this point of `stream` (a stream of the same context).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: the event and stream are live handles of this context.
        unsafe { sys::cuEventRecord(self.event, stream.raw()) }
            .result()
            .map_err(Error::driver("cuEventRecord"))
    }

    /// Makes later work on `stream` wait for the event's latest record (in whichever process).
    pub fn wait(&self, stream: &Stream) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: the event and stream are live handles of this context.
        unsafe { sys::cuStreamWaitEvent(stream.raw(), self.event, 0) }
            .result()
            .map_err(Error::driver("cuStreamWaitEvent"))
    }

    /// Whether the work before the event's latest record has completed.
    pub fn query(&self) -> Result<bool> {
        bind(&self.ctx)?;
        // SAFETY: the event is live.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(Error::Driver {
                call: "cuEventQuery",
                source: DriverError(other),
            }),
        }
    }

    /// Blocks the calling thread until the work before the event's latest record has completed.
    pub fn synchronize(&self) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: the event is live.
        unsafe { sys::cuEventSynchronize(self.event) }
            .result()
            .map_err(Error::driver("cuEventSynchronize"))
    }

    /// The raw event, to pass to other libraries (valid while `self` lives).
    pub fn raw(&self) -> sys::CUevent {
        self.event
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: created or opened by this value and destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.event) }.result();
        }
    }
}
