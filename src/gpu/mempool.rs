//! kvshard's stream-ordered memory pool of one device: where its device memory comes from.
//!
//! `cuMemFree` of `cuMemAlloc` memory may synchronize the whole device, so an engine dropping
//! a kvshard pool would wait for every stream of the process (measured on the H200: 55-61 ms
//! behind 40 matmuls queued on a torch stream). Memory from a pool of CUDA's stream-ordered
//! allocator is given back with `cuMemFreeAsync`, which is enqueued like a launch and never
//! waits. kvshard frees memory only once its own work has completed (`backend::usage`), so the
//! free can go on a stream of kvshard's own that holds nothing else: the pool's **stream**, a
//! non-blocking stream (no implicit order with the legacy default stream, torch's default)
//! that only ever carries this pool's allocations and frees.
//!
//! - The pool is kvshard's (`cuMemPoolCreate`), not the device's default pool, so no other
//!   library's frees are in it: an allocation never inherits a dependency on another stream's
//!   work (the driver may make an allocation wait for the free that released its memory).
//! - An allocation is enqueued on the pool's stream and that stream is synchronized before the
//!   address is handed out, so any stream (and the host) may use the memory at once. The stream
//!   holds only allocations and frees of memory whose work has completed: the wait is for the
//!   allocation itself, never for anyone's work.
//! - The release threshold stays CUDA's default (0): memory the pool holds beyond what is
//!   allocated goes back to the device at the next synchronization; [`trim_all_sync`] does it at
//!   once.
//! - Memory from such a pool cannot be shared with legacy CUDA IPC (`cuIpcGetMemHandle`), and
//!   UCX's `cuda_ipc` (NIXL's VRAM transport) and GPUDirect RDMA or Storage do not take it:
//!   memory for them is allocated with `cuMemAlloc` (`backend::Backend::alloc_registrable`),
//!   whose free goes through the reaper thread (`super::reaper`).

use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::{sys, CudaContext};

use crate::error::{Error, Result};
use crate::lock::lock;

/// A stream-ordered memory pool on one device, with the stream its allocations and frees are
/// enqueued on. Destroyed when the last allocation from it and its [`super::Gpu`] are gone.
#[derive(Debug)]
pub(crate) struct MemPool {
    ctx: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
    stream: sys::CUstream,
}

// SAFETY: both handles are driver objects usable from any thread of the process; every call
// binds the context first, and the driver serializes calls on one stream.
unsafe impl Send for MemPool {}
// SAFETY: see Send.
unsafe impl Sync for MemPool {}

/// Every live pool, for [`trim_all_sync`].
static POOLS: Mutex<Vec<Weak<MemPool>>> = Mutex::new(Vec::new());

impl MemPool {
    /// A pool on the context's device, or why there is none (a device without stream-ordered
    /// allocation: its memory then comes from `cuMemAlloc`).
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> std::result::Result<Arc<Self>, String> {
        Self::create(ctx)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| {
                "the device does not support stream-ordered allocation (memory pools)".to_string()
            })
    }

    fn create(ctx: &Arc<CudaContext>) -> Result<Option<Arc<Self>>> {
        ctx.bind_to_thread()
            .map_err(Error::driver("cuCtxSetCurrent"))?;
        let supported = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
            .map_err(Error::driver("cuDeviceGetAttribute"))?;
        if supported == 0 {
            return Ok(None);
        }
        let ordinal = i32::try_from(ctx.ordinal())
            .map_err(|_| Error::InvalidArgument(format!("device ordinal {}", ctx.ordinal())))?;
        // SAFETY: an all-zero CUmemPoolProps is a valid value (zero is the first variant of
        // each enum in it, no size limit, no usage flags); the fields that matter are set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        };
        let mut pool = std::ptr::null_mut();
        // SAFETY: `props` describes device memory of this context's device; the pool is
        // destroyed once, in Drop.
        unsafe { sys::cuMemPoolCreate(&mut pool, &props) }
            .result()
            .map_err(Error::driver("cuMemPoolCreate"))?;
        let mut stream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: a new stream of the current context; destroyed once, in Drop.
        let created = unsafe { sys::cuStreamCreate(&mut stream, flags) }.result();
        if let Err(e) = created {
            // SAFETY: the pool was just made and nothing was allocated from it.
            let _ = unsafe { sys::cuMemPoolDestroy(pool) }.result();
            return Err(Error::driver("cuStreamCreate")(e));
        }
        let made = Arc::new(Self {
            ctx: ctx.clone(),
            pool,
            stream,
        });
        let mut pools = lock(&POOLS);
        pools.retain(|p| p.strong_count() > 0);
        pools.push(Arc::downgrade(&made));
        Ok(Some(made))
    }

    /// The context the pool belongs to.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Allocates `len` bytes (at least one), ready for every stream and the host when this
    /// returns.
    pub(crate) fn alloc(&self, len: usize) -> Result<sys::CUdeviceptr> {
        self.bind()?;
        let mut ptr = 0;
        // SAFETY: the pool and stream are live handles of the current context.
        unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, len.max(1), self.pool, self.stream) }
            .result()
            .map_err(Error::driver("cuMemAllocFromPoolAsync"))?;
        // The pool's stream holds nothing but allocations and frees of memory whose work has
        // completed, so this waits for the allocation alone (not counted as a host wait for
        // work: there is none).
        // SAFETY: a live stream of the current context.
        let ready = unsafe { sys::cuStreamSynchronize(self.stream) }.result();
        if let Err(e) = ready {
            // SAFETY: allocated just above from this pool; never handed out.
            let _ = unsafe { sys::cuMemFreeAsync(ptr, self.stream) }.result();
            return Err(Error::driver("cuStreamSynchronize (allocation stream)")(e));
        }
        Ok(ptr)
    }

    /// Gives `ptr` back to the pool, stream-ordered on the pool's stream: returns at once.
    ///
    /// # Safety
    /// `ptr` must come from [`MemPool::alloc`] of this pool, be freed once, and no work may
    /// use it any more (the work queued on it has completed).
    pub(crate) unsafe fn free(&self, ptr: sys::CUdeviceptr) {
        if self.bind().is_ok() {
            // SAFETY: the caller's contract; the stream waits for nothing, so the memory is
            // back in the pool as soon as the stream reaches the free.
            let _ = unsafe { sys::cuMemFreeAsync(ptr, self.stream) }.result();
        }
    }

    /// Waits for the pool's stream (its frees), then hands every byte the pool holds beyond
    /// its live allocations back to the device.
    fn trim_sync(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: a live stream of the current context.
        unsafe { sys::cuStreamSynchronize(self.stream) }
            .result()
            .map_err(Error::driver("cuStreamSynchronize (allocation stream)"))?;
        // SAFETY: a live pool of the current context.
        unsafe { sys::cuMemPoolTrimTo(self.pool, 0) }
            .result()
            .map_err(Error::driver("cuMemPoolTrimTo"))
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("cuCtxSetCurrent"))
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // Neither waits: the driver destroys the stream once its frees are done, and the pool
        // once nothing allocated from it is left.
        // SAFETY: created by `create`, destroyed once; nothing enqueues on it any more (every
        // allocation holds the pool, so none is left).
        let _ = unsafe { sys::cuStreamDestroy_v2(self.stream) }.result();
        // SAFETY: as above.
        let _ = unsafe { sys::cuMemPoolDestroy(self.pool) }.result();
    }
}

/// Hands the memory every live pool holds beyond its allocations back to the device, after
/// the pools' frees are done (a wait on kvshard's allocation streams only).
pub(crate) fn trim_all_sync() -> Result<()> {
    let pools: Vec<Arc<MemPool>> = lock(&POOLS).iter().filter_map(Weak::upgrade).collect();
    for pool in pools {
        pool.trim_sync()?;
    }
    Ok(())
}

/// Whether device address `addr` lies in memory from a stream-ordered pool (kvshard's, or
/// another library's: PyTorch's `cudaMallocAsync` backend): memory legacy CUDA IPC, UCX's
/// `cuda_ipc` and GPUDirect do not take. The context must be current.
pub(crate) fn from_a_pool(addr: u64) -> Result<bool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut attribute = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE;
    let mut out = [(&mut pool as *mut sys::CUmemoryPool).cast::<std::ffi::c_void>()];
    // SAFETY: one pointer-sized attribute, written into `pool`. The plural query (unlike the
    // singular one) answers NULL for memory of no pool instead of failing.
    unsafe { sys::cuPointerGetAttributes(1, &mut attribute, out.as_mut_ptr(), addr) }
        .result()
        .map_err(Error::driver("cuPointerGetAttributes(MEMPOOL_HANDLE)"))?;
    Ok(!pool.is_null())
}
