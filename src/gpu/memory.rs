//! Owned device memory and pinned host memory.
//!
//! No free here waits on the caller's thread. These allocations reach the rest of kvshard only
//! inside a [`crate::backend::Buffer`], whose usage record drops the allocation only after
//! every event of the work queued on it has completed (`backend::usage`), so no launch still
//! queued can touch memory freed here. Then:
//!
//! - device memory from kvshard's stream-ordered pool (`DeviceAllocation::stream_ordered`,
//!   what `Backend::alloc` hands out) goes back with `cuMemFreeAsync` on the pool's own stream,
//!   which waits for nothing (`super::mempool`);
//! - `cuMemAlloc` memory ([`DeviceAllocation::new`]: what legacy IPC, UCX and GPUDirect
//!   register) and pinned host memory (`cuMemHostAlloc`) go to kvshard's cache for reuse
//!   (`super::reuse`): their driver frees may wait for the whole device and hold every other
//!   thread's CUDA calls meanwhile, so they are made only by calls named `_sync`;
//! - registrations of the engine's host memory (`cuMemHostUnregister`: the engine frees that
//!   memory afterwards, so it cannot wait in a cache) are undone on kvshard's reaper thread
//!   (`super::reaper`): the caller's drop returns at once, though the driver may hold other
//!   threads' CUDA calls while the unregistration waits for the device.
//!
//! Host memory the GPU reads or writes directly is addressed through its *device alias*, which
//! the driver gives (`cuMemHostGetDevicePointer`); kvshard never assumes it equals the host
//! address. Memory an engine already pinned elsewhere can be registered in chunks that never
//! split a page ([`HostRegistration`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext};

use super::mempool::MemPool;
use super::reaper;
use super::reuse::{self, Block, Kind};
use crate::error::{Error, Result};
use crate::lock::lock;

/// A device allocation, given up on drop without waiting: from kvshard's stream-ordered pool
/// (freed with `cuMemFreeAsync`), or from `cuMemAlloc` (kept for reuse, `super::reuse`). Nothing waits for work using it at the drop:
/// that work must have completed (what every `unsafe` call handed its address promises;
/// kvshard's own buffers drop theirs only then).
#[derive(Debug)]
pub struct DeviceAllocation {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The stream-ordered pool it came from; `None` for `cuMemAlloc` memory.
    pool: Option<Arc<MemPool>>,
}

impl DeviceAllocation {
    /// Allocates `len` bytes (at least one) of device memory with `cuMemAlloc`, 256-byte
    /// aligned: memory legacy CUDA IPC can share and UCX or GPUDirect can register. A block
    /// of it given up earlier is reused when one fits (`super::reuse`); dropped, it goes back
    /// there, since its driver free may wait for the whole device.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let len = len.max(1);
        if let Some(b) = reuse::take(Kind::Device, ctx.cu_ctx() as usize, len) {
            return Ok(Self {
                ctx: ctx.clone(),
                ptr: b.device,
                len: b.len,
                pool: None,
            });
        }
        // SAFETY: plain allocation in the current context (bound by `allocate`); freed once,
        // by `reuse` callers.
        let ptr = allocate(ctx, "cuMemAlloc", || unsafe { result::malloc_sync(len) })?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            len,
            pool: None,
        })
    }

    /// Allocates `len` bytes (at least one) from `pool`, ready for every stream when this
    /// returns; freed with `cuMemFreeAsync`, which never waits.
    pub(crate) fn stream_ordered(pool: &Arc<MemPool>, len: usize) -> Result<Self> {
        let ptr = pool.alloc(len)?;
        Ok(Self {
            ctx: pool.context().clone(),
            ptr,
            len,
            pool: Some(pool.clone()),
        })
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether it came from kvshard's stream-ordered pool (else from `cuMemAlloc`).
    pub fn is_stream_ordered(&self) -> bool {
        self.pool.is_some()
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        let ptr = self.ptr;
        match &self.pool {
            // SAFETY: allocated from this pool, freed once; the work queued on it has completed
            // (its usage record drops it only then, see the module docs).
            Some(pool) => unsafe { pool.free(ptr) },
            // The work queued on it has completed (see the module docs): kept for reuse.
            None => reuse::keep(Block {
                kind: Kind::Device,
                ctx: self.ctx.cu_ctx() as usize,
                context: Some(self.ctx.clone()),
                len: self.len,
                host: 0,
                device: ptr,
            }),
        }
    }
}

/// Pinned, device-mapped host memory from `cuMemHostAlloc`, kept for reuse when dropped
/// (`super::reuse`; work using it must have completed, as for [`DeviceAllocation`]).
#[derive(Debug)]
pub struct PinnedAllocation {
    ctx: Arc<CudaContext>,
    host: *mut u8,
    device: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: the allocation is plain memory owned by this value; access goes through the driver or
// through explicit copies, never through shared references the type hands out.
unsafe impl Send for PinnedAllocation {}
// SAFETY: see Send.
unsafe impl Sync for PinnedAllocation {}

impl PinnedAllocation {
    /// Allocates `len` bytes of pinned host memory mapped into the device's address space.
    ///
    /// The pages are allocated by the thread that calls this, so Linux's first-touch policy
    /// places them on that thread's NUMA node: call it from a thread bound to the GPU's node.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let len = len.max(1);
        if let Some(b) = reuse::take(Kind::PinnedHost, ctx.cu_ctx() as usize, len) {
            return Ok(Self {
                ctx: ctx.clone(),
                host: b.host as *mut u8,
                device: b.device,
                len: b.len,
            });
        }
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocation with valid flags in the current context (bound by `allocate`);
        // freed once, by `reuse` callers.
        let host = allocate(ctx, "cuMemHostAlloc", || unsafe {
            result::malloc_host(len, flags)
        })?;
        let mut device = 0;
        // SAFETY: `host` is a live mapped allocation; the driver writes the alias to `device`.
        let alias = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }.result();
        if let Err(e) = alias {
            // SAFETY: `host` came from cuMemHostAlloc above and is not used afterwards.
            let _ = unsafe { result::free_host(host) };
            return Err(Error::driver("cuMemHostGetDevicePointer")(e));
        }
        Ok(Self {
            ctx: ctx.clone(),
            host: host.cast(),
            device,
            len,
        })
    }

    /// Host address.
    pub fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// The device alias the driver gave for this memory.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedAllocation {
    fn drop(&mut self) {
        // The work queued on it has completed (see the module docs): kept for reuse.
        reuse::keep(Block {
            kind: Kind::PinnedHost,
            ctx: self.ctx.cu_ctx() as usize,
            context: Some(self.ctx.clone()),
            len: self.len,
            host: self.host as usize,
            device: self.device,
        });
    }
}

/// Runs the driver allocation `alloc` (named `call`) with `ctx` bound; where the device or the
/// host is full, gives the cache's blocks back to the driver (`release_sync`) and runs it once
/// more.
fn allocate<T>(
    ctx: &Arc<CudaContext>,
    call: &'static str,
    alloc: impl Fn() -> std::result::Result<T, result::DriverError>,
) -> Result<T> {
    ctx.bind_to_thread()
        .map_err(Error::driver("cuCtxSetCurrent"))?;
    match alloc() {
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY && release_sync() > 0 => {
            // release_sync bound the cached blocks' contexts.
            ctx.bind_to_thread()
                .map_err(Error::driver("cuCtxSetCurrent"))?;
            alloc().map_err(Error::driver(call))
        }
        other => other.map_err(Error::driver(call)),
    }
}

/// Gives every block kvshard's cache holds (`super::reuse`) back to the driver, on this thread:
/// each free may wait for the whole device. Returns how many were freed.
pub(crate) fn release_sync() -> usize {
    let blocks = reuse::take_all();
    for b in &blocks {
        let Some(ctx) = &b.context else { continue };
        if ctx.bind_to_thread().is_err() {
            continue;
        }
        match b.kind {
            // SAFETY: allocated by cuMemAlloc in this context, given up (its work completed)
            // and taken out of the cache: freed exactly once.
            Kind::Device => drop(unsafe { result::free_sync(b.device) }),
            // SAFETY: allocated by cuMemHostAlloc, given up and taken out of the cache.
            Kind::PinnedHost => drop(unsafe { result::free_host(b.host as *mut std::ffi::c_void) }),
        }
    }
    blocks.len()
}

/// Device-alias ranges `[start, end)` of every live registration chunk, by start. The driver
/// refuses a copy-engine copy whose range spans two registrations, so copies are cut at these
/// boundaries ([`registration_cuts`]).
static CHUNKS: Mutex<BTreeMap<u64, u64>> = Mutex::new(BTreeMap::new());

fn chunks() -> std::sync::MutexGuard<'static, BTreeMap<u64, u64>> {
    lock(&CHUNKS)
}

/// Offsets inside `[addr, addr + len)` where the range crosses from one registration chunk into
/// another (or out of one), in increasing order; empty when no copy needs cutting.
pub(crate) fn registration_cuts(addr: u64, len: u64) -> Vec<u64> {
    let map = chunks();
    if map.is_empty() || len == 0 {
        return Vec::new();
    }
    let end = addr + len;
    let mut cuts = Vec::new();
    let before = map.range(..=addr).next_back().map(|(&s, &e)| (s, e));
    for (s, e) in before
        .into_iter()
        .chain(map.range(addr + 1..end).map(|(&s, &e)| (s, e)))
    {
        for boundary in [s, e] {
            if boundary > addr && boundary < end {
                cuts.push(boundary - addr);
            }
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    cuts
}

/// Host memory owned by the engine, registered (pinned and mapped) with the driver in chunks.
///
/// Registration chunks end on page boundaries, so no page straddles two registrations, and each
/// chunk's device alias is asked of the driver separately: [`HostRegistration::device_ptr`]
/// translates any host address inside the range.
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    host: usize,
    /// (host start, device alias, bytes) per chunk, in address order.
    chunks: Vec<(usize, u64, usize)>,
    /// What holds the memory, let go only after the unregistration ([`HostRegistration::owned_by`]).
    owner: Option<Arc<dyn Send + Sync>>,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration")
            .field("host", &format_args!("{:#x}", self.host))
            .field("chunks", &self.chunks.len())
            .finish_non_exhaustive()
    }
}

impl HostRegistration {
    /// Registers `[host, host + len)` in chunks of at most `max_chunk` bytes, each a whole
    /// number of `page_bytes` pages.
    ///
    /// Dropped, the chunks are unregistered on kvshard's reaper thread (`cuMemHostUnregister`
    /// may wait for the whole device), shortly after: `backend::wait_for_frees_sync` waits for
    /// it.
    ///
    /// # Safety
    /// The range must be valid, writable host memory that is not registered already and
    /// outlives the registration and its unregistration: held by the registration's owner
    /// ([`HostRegistration::owned_by`]), or freed or registered again only once
    /// `backend::wait_for_frees_sync` has returned after the drop.
    pub unsafe fn new(
        ctx: &Arc<CudaContext>,
        host: *mut u8,
        len: usize,
        page_bytes: usize,
        max_chunk: usize,
    ) -> Result<Self> {
        if page_bytes == 0 || len % page_bytes != 0 || max_chunk < page_bytes {
            return Err(Error::InvalidArgument(format!(
                "host registration of {len} bytes: must be whole pages of {page_bytes} bytes, chunks of at least one page (got {max_chunk})"
            )));
        }
        ctx.bind_to_thread()
            .map_err(Error::driver("cuCtxSetCurrent"))?;
        let chunk = max_chunk / page_bytes * page_bytes;
        let mut reg = Self {
            ctx: ctx.clone(),
            host: host as usize,
            chunks: Vec::new(),
            owner: None,
        };
        let mut offset = 0;
        while offset < len {
            let bytes = chunk.min(len - offset);
            let start = host as usize + offset;
            let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
            // SAFETY: the caller guarantees the range; the chunk lies inside it. On error, Drop
            // unregisters the chunks registered so far.
            unsafe { sys::cuMemHostRegister_v2(start as *mut _, bytes, flags) }
                .result()
                .map_err(Error::driver("cuMemHostRegister"))?;
            let mut device = 0;
            // SAFETY: the chunk was just registered with DEVICEMAP.
            let alias =
                unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, start as *mut _, 0) }
                    .result();
            reg.chunks.push((start, device, bytes));
            alias.map_err(Error::driver("cuMemHostGetDevicePointer"))?;
            chunks().insert(device, device + bytes as u64);
            offset += bytes;
        }
        Ok(reg)
    }

    /// Registered chunks: (host address, device alias, bytes).
    pub fn chunks(&self) -> &[(usize, u64, usize)] {
        &self.chunks
    }

    /// Has the registration hold `owner` (what holds the memory) and let go of it only after
    /// the memory is unregistered, on the reaper thread: the memory then outlives its
    /// unregistration however early its other holders let go.
    pub fn owned_by(mut self, owner: Arc<dyn Send + Sync>) -> Self {
        self.owner = Some(owner);
        self
    }

    /// The device alias of a host address inside the registered range.
    pub fn device_ptr(&self, host: *const u8) -> Option<u64> {
        let h = host as usize;
        self.chunks
            .iter()
            .find(|(start, _, bytes)| h >= *start && h < start + bytes)
            .map(|(start, dev, _)| dev + (h - start) as u64)
    }

    /// First registered host address.
    pub fn host_ptr(&self) -> usize {
        self.host
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        for (_, device, _) in &self.chunks {
            chunks().remove(device);
        }
        let ctx = self.ctx.clone();
        let starts: Vec<usize> = self.chunks.iter().map(|&(start, _, _)| start).collect();
        let owner = self.owner.take();
        reaper::defer(move || {
            if ctx.bind_to_thread().is_ok() {
                for start in starts {
                    // SAFETY: each chunk was registered by `new` and is unregistered once,
                    // after the work queued on it has completed (its usage record drops it
                    // only then); the memory is still valid (`new`'s contract, or `owner`).
                    let _ = unsafe { sys::cuMemHostUnregister(start as *mut _) }.result();
                }
            }
            drop(owner);
        });
    }
}

/// Host memory the engine registered with the driver itself (`cudaHostRegister`, as SGLang's
/// host pools do): kvshard asks the driver for each registration's device alias and records its
/// range, so copy-engine copies are cut where registrations meet, and never
/// unregisters it.
#[derive(Debug)]
pub struct ForeignRegistration {
    /// (host start, device alias, bytes) per registration, in address order.
    chunks: Vec<(usize, u64, usize)>,
}

impl ForeignRegistration {
    /// Takes the registrations `ranges` (`(host address, bytes)`, each one registration) as
    /// they are, asking the driver for each one's device alias; memory the driver does not know
    /// as registered is refused.
    ///
    /// # Safety
    /// Each range must be host memory registered with `ctx` (exactly one registration per
    /// range), and stay registered and valid while this value and all work using it are alive.
    pub unsafe fn new(ctx: &Arc<CudaContext>, ranges: &[(usize, usize)]) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(Error::driver("cuCtxSetCurrent"))?;
        let mut reg = Self { chunks: Vec::new() };
        for &(start, bytes) in ranges {
            let mut device = 0;
            // SAFETY: the caller guarantees the range is registered memory of this context; the
            // driver only reads the pointer's value and writes the alias to `device`.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, start as *mut _, 0) }
                .result()
                .map_err(Error::driver(
                    "cuMemHostGetDevicePointer (is the memory registered with this GPU's context?)",
                ))?;
            reg.chunks.push((start, device, bytes));
            chunks().insert(device, device + bytes as u64);
        }
        Ok(reg)
    }

    /// Registrations: (host address, device alias, bytes).
    pub fn chunks(&self) -> &[(usize, u64, usize)] {
        &self.chunks
    }
}

impl Drop for ForeignRegistration {
    fn drop(&mut self) {
        // The engine unregisters its memory itself; only kvshard's record of it goes.
        for (_, device, _) in &self.chunks {
            chunks().remove(device);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_cut_where_registrations_meet() {
        // Two adjacent chunks far from anything a real registration could use.
        let (a, b, c) = (1u64 << 60, (1u64 << 60) + 1000, (1u64 << 60) + 3000);
        chunks().insert(a, b);
        chunks().insert(b, c);
        assert_eq!(
            registration_cuts(a + 100, 200),
            Vec::<u64>::new(),
            "inside one chunk"
        );
        assert_eq!(
            registration_cuts(a + 500, 1000),
            vec![500],
            "across the shared boundary"
        );
        assert_eq!(
            registration_cuts(a - 50, 3100),
            vec![50, 1050, 3050],
            "over both, out the end"
        );
        assert_eq!(
            registration_cuts(c + 10, 10),
            Vec::<u64>::new(),
            "outside every chunk"
        );
        chunks().remove(&a);
        chunks().remove(&b);
    }
}
