//! An opened GPU ([`Gpu`]): the device's primary context, its properties ([`DeviceInfo`]), the
//! embedded kernel module loaded once, and the launches and events everything above uses.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaEvent};

use super::events::{EventPool, PooledEvent};
use super::memory::DeviceAllocation;
use super::mempool::MemPool;
use super::module::{self, Kernel, KernelFn, Module};
use super::stream::Stream;
use crate::error::{Error, Result};
use crate::lock::lock;

/// Architectures whose code this build embeds (`None` when built without kernels).
pub fn embedded_archs() -> Option<&'static str> {
    module::FATBIN.map(|_| module::ARCHS)
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only probes for the shared library; loads nothing else.
    unsafe { sys::is_culib_present() }
}

/// Static facts about an opened device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Device memory in bytes.
    pub total_memory: usize,
    /// PCI bus id, as NVML expects it.
    pub pci_bus_id: String,
}

/// An opened GPU: primary context plus the embedded kernels.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    module: Module,
    info: DeviceInfo,
    events: Arc<Mutex<EventPool>>,
    /// kvshard's stream-ordered memory pool of this device, made at the first allocation, or
    /// why there is none.
    mempool: OnceLock<std::result::Result<Arc<MemPool>, String>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("info", &self.info).finish()
    }
}

impl Gpu {
    /// Opens GPU `ordinal`: checks the kernels are embedded and the driver is present, retains
    /// the primary context and loads the kernel module.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        let fatbin = module::FATBIN.ok_or(Error::KernelsMissing)?;
        if !driver_present() {
            return Err(Error::NoDriver);
        }
        cudarc::driver::result::init().map_err(Error::driver("cuInit"))?;
        let count = cudarc::driver::result::device::get_count()
            .map_err(Error::driver("cuDeviceGetCount"))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(Error::NoGpu { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(Error::driver("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: cudarc's event tracking orders its own `CudaSlice`s across streams, and
        // kvshard makes none (its memory and ordering are `backend::usage`'s). With tracking
        // on, the context's first `new_stream` would synchronize the whole context: a wait
        // for the engine's work behind its back.
        unsafe { ctx.disable_event_tracking() };
        let info = device_info(&ctx, ordinal)?;
        let module = Module::load(&ctx, fatbin)?;
        Ok(Arc::new(Gpu {
            ctx,
            module,
            info,
            events: Arc::default(),
            mempool: OnceLock::new(),
        }))
    }

    /// Allocates `len` bytes (at least one) of device memory from kvshard's stream-ordered pool
    /// of this device, ready for every stream and the host when this returns, and freed with
    /// `cuMemFreeAsync`, which never waits (`mempool`). On a device without stream-ordered
    /// allocation ([`Gpu::stream_ordered_absent`] says why), from `cuMemAlloc`, freed on
    /// kvshard's reaper thread.
    pub fn alloc_device(&self, len: usize) -> Result<DeviceAllocation> {
        match self.mempool() {
            Ok(pool) => DeviceAllocation::stream_ordered(pool, len),
            Err(_) => DeviceAllocation::new(&self.ctx, len),
        }
    }

    /// Why this device's memory does not come from a stream-ordered pool (`None` when it
    /// does).
    pub fn stream_ordered_absent(&self) -> Option<&str> {
        self.mempool().err().map(String::as_str)
    }

    fn mempool(&self) -> std::result::Result<&Arc<MemPool>, &String> {
        self.mempool
            .get_or_init(|| MemPool::new(&self.ctx))
            .as_ref()
    }

    /// Device facts.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The cudarc context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("cuCtxSetCurrent"))
    }

    /// A new non-blocking stream owned by kvshard.
    pub fn new_stream(&self) -> Result<Stream> {
        let inner = self
            .ctx
            .new_stream()
            .map_err(Error::driver("cuStreamCreate"))?;
        Ok(Stream { inner })
    }

    /// Wraps a stream the engine owns; kvshard enqueues on it and never destroys it.
    ///
    /// # Safety
    /// `raw` must be a valid stream of this device's primary context, and must outlive the
    /// returned [`Stream`] and everything enqueued through it.
    pub unsafe fn borrow_stream(&self, raw: sys::CUstream) -> Stream {
        // SAFETY: the caller guarantees `raw` is a live stream of this context (see above).
        let inner = unsafe { self.ctx.wrap_borrowed_stream(raw) };
        Stream { inner }
    }

    /// An event from this device's pool (a new one when the pool has none of the kind);
    /// `timing` enables elapsed-time queries. It goes back to the pool when dropped.
    pub fn pooled_event(&self, timing: bool) -> Result<PooledEvent> {
        let reused = lock(&self.events).kind(timing).pop();
        let event = match reused {
            Some(e) => e,
            None => self.new_event(timing)?,
        };
        Ok(PooledEvent {
            event: Some(event),
            timing,
            pool: Arc::downgrade(&self.events),
        })
    }

    /// A new event; `timing` enables elapsed-time queries.
    pub fn new_event(&self, timing: bool) -> Result<CudaEvent> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        self.ctx
            .new_event(Some(flags))
            .map_err(Error::driver("cuEventCreate"))
    }

    /// The most threads per CTA `kernel` can be launched with on this device: what its loaded
    /// cubin allows (launch bounds and registers), which may differ by architecture.
    pub fn max_threads(&self, kernel: Kernel) -> u32 {
        self.module.max_threads(kernel)
    }

    /// Launches `kernel` with its by-value parameter struct (`()` for a kernel without one).
    /// A CTA larger than [`Gpu::max_threads`] allows is refused with
    /// [`Error::InvalidArgument`] before anything is enqueued.
    ///
    /// # Safety
    /// Every address in `params` must be valid for what the kernel does with it until the launch
    /// completes on `stream`.
    pub(crate) unsafe fn launch<P>(
        &self,
        kernel: KernelFn<P>,
        grid: u32,
        block: u32,
        stream: &Stream,
        params: &P,
    ) -> Result<()> {
        let allowed = self.max_threads(kernel.kernel());
        if block > allowed {
            return Err(Error::InvalidArgument(format!(
                "{}: CTA of {block} threads asked, {allowed} allowed by its cubin on this device",
                kernel.name()
            )));
        }
        self.bind()?;
        // The parameter structs are never zero-sized; `()` stands for no parameter at all.
        let mut args: Vec<*mut std::ffi::c_void> = if std::mem::size_of::<P>() == 0 {
            Vec::new()
        } else {
            vec![params as *const P as *mut std::ffi::c_void]
        };
        // SAFETY: the function belongs to the loaded module and `P` is the struct it takes (the
        // `kernels` table ties them); address validity is the caller's contract above; `args`
        // outlives the call, and the driver copies the parameter values before cuLaunchKernel
        // returns.
        unsafe {
            cudarc::driver::result::launch_kernel(
                self.module.function(kernel.kernel()),
                (grid.max(1), 1, 1),
                (block, 1, 1),
                0,
                stream.raw(),
                &mut args,
            )
        }
        .map_err(|source| Error::Driver {
            call: kernel.name(),
            source,
        })
    }

    /// Largest number of CTAs of `block` threads of `kernel` resident on one SM.
    pub fn occupancy(&self, kernel: Kernel, block: u32) -> Result<u32> {
        self.bind()?;
        // SAFETY: the function belongs to the loaded module of this (current) context.
        let n = unsafe {
            cudarc::driver::result::occupancy::max_active_block_per_multiprocessor(
                self.module.function(kernel),
                block as i32,
                0,
            )
        }
        .map_err(Error::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        Ok(n.max(0) as u32)
    }
}

fn device_info(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<DeviceInfo> {
    use sys::CUdevice_attribute::*;
    let attr = |a| {
        ctx.attribute(a)
            .map_err(Error::driver("cuDeviceGetAttribute"))
    };
    let mut bus = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer is valid for its length and the device handle comes from the context.
    unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, ctx.cu_device()) }
        .result()
        .map_err(Error::driver("cuDeviceGetPCIBusId"))?;
    // SAFETY: the driver wrote a NUL-terminated string into `bus`.
    let pci_bus_id = unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name().map_err(Error::driver("cuDeviceGetName"))?,
        compute_capability: (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        sm_count: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32,
        total_memory: ctx.total_mem().map_err(Error::driver("cuDeviceTotalMem"))?,
        pci_bus_id,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::abi;
    use crate::gpu::{kernels, RESOURCE_USAGE};

    #[test]
    fn resource_usage_lists_every_kernel_of_every_cubin_without_spills() {
        let Some(archs) = embedded_archs() else {
            return;
        };
        let rows: Vec<Vec<&str>> = RESOURCE_USAGE
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().collect())
            .collect();
        for arch in archs.split(',').filter(|a| a.starts_with("sm_")) {
            for kernel in Kernel::ALL {
                let row = rows
                    .iter()
                    .find(|w| w.len() == 7 && w[0] == kernel.name() && w[1] == arch)
                    .unwrap_or_else(|| panic!("no row for {} on {arch}", kernel.name()));
                assert_eq!(&row[3..6], ["0", "0", "0"], "{} on {arch}", kernel.name());
            }
        }
        // And the fatbin holds nothing the table does not list: the benchmark kernels are in it
        // only with feature `bench-kernels`.
        for row in &rows {
            assert!(
                Kernel::ALL.iter().any(|k| k.name() == row[0]),
                "{} is in the fatbin but not in the kernel table",
                row[0]
            );
        }
    }

    #[test]
    fn gpu_abi_launch_shapes_fit_and_larger_ctas_are_refused() {
        let gpu = match Gpu::open(0) {
            Ok(gpu) => gpu,
            Err(why) => {
                assert!(
                    std::env::var_os("KVSHARD_REQUIRE_GPU").is_none(),
                    "KVSHARD_REQUIRE_GPU is set but no GPU is usable: {why}"
                );
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED gpu_abi_launch_shapes_fit_and_larger_ctas_are_refused on the GPU: {why}"
                );
                return;
            }
        };
        let shapes = [
            (Kernel::QuantizeLatent, abi::KVS_ELEMENTWISE_THREADS),
            (Kernel::QuantizeIndexer, abi::KVS_ELEMENTWISE_THREADS),
            (Kernel::ScratchRows, abi::KVS_ELEMENTWISE_THREADS),
            (Kernel::ResolveTokens, abi::KVS_RESOLVE_THREADS),
            (Kernel::ResolveTokensPow2, abi::KVS_RESOLVE_THREADS),
            (Kernel::ResolvePages, abi::KVS_RESOLVE_THREADS),
            (Kernel::ResolvePagesPow2, abi::KVS_RESOLVE_THREADS),
            (Kernel::CopyBlocks, abi::KVS_COPY_THREADS),
            (Kernel::CopyBlocksInline, abi::KVS_COPY_THREADS),
            (Kernel::CopyRanges, abi::KVS_COPY_THREADS),
            (Kernel::WriteRows, abi::KVS_WRITE_THREADS),
            (Kernel::DecodeScatterPages, abi::KVS_DECODE_THREADS),
            (Kernel::DecodeScatterRows576, abi::KVS_DECODE_THREADS),
            (Kernel::DecodeScatterRows656, abi::KVS_DECODE_THREADS),
            (Kernel::DecodeScatterRows1152, abi::KVS_DECODE_THREADS),
            (Kernel::DecodePackRows576, abi::KVS_DECODE_THREADS),
            (Kernel::DecodePackRows656, abi::KVS_DECODE_THREADS),
            (Kernel::DecodePackRows1152, abi::KVS_DECODE_THREADS),
            (Kernel::DecodeUnpackRows576, abi::KVS_DECODE_THREADS),
            (Kernel::DecodeUnpackRows656, abi::KVS_DECODE_THREADS),
            (Kernel::DecodeUnpackRows1152, abi::KVS_DECODE_THREADS),
        ];
        for (kernel, threads) in shapes {
            let allowed = gpu.max_threads(kernel);
            assert!(
                allowed >= threads,
                "{}: {allowed} < {threads}",
                kernel.name()
            );
        }
        let stream = gpu.new_stream().unwrap();
        let allowed = gpu.max_threads(Kernel::CopyRanges);
        // An empty range table: the launch reads and writes nothing, status reporting off.
        let nothing = abi::kvs_copy_ranges_params::default();
        // SAFETY: with no ranges the kernel touches no memory.
        unsafe { gpu.launch(kernels::COPY_RANGES, 1, allowed, &stream, &nothing) }.unwrap();
        // SAFETY: as above (and it is refused before reaching the driver).
        let refused =
            unsafe { gpu.launch(kernels::COPY_RANGES, 1, allowed + 32, &stream, &nothing) };
        match refused {
            Err(Error::InvalidArgument(why)) => assert!(
                why.contains("kvs_copy_ranges") && why.contains(&format!("{}", allowed + 32)),
                "{why}"
            ),
            other => panic!(
                "a CTA of {} threads was not refused: {other:?}",
                allowed + 32
            ),
        }
        stream.synchronize().unwrap();
    }
}
