//! The CUDA backend: launches the embedded kernels and copy-engine copies on one stream (owned,
//! or borrowed from the engine). Nothing here synchronizes the stream except the `_sync`
//! methods and `synchronize`, which say so.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{result, sys};

use super::status_word::StatusTracker;
use super::{
    check, count_host_sync, ordered, sweep, AddressSpace, Backend, Buffer, Copy2d, Event,
    EventInner, KernelFamily, Launch, MemoryKind, StreamId, Usage,
};
use crate::abi;
use crate::error::{Error, Result};
use crate::gpu::memory::{registration_cuts, DeviceAllocation, PinnedAllocation};
use crate::gpu::{kernels, Gpu, KernelFn, PooledEvent, Stream};
use crate::lock::lock;

/// Threads per CTA of the element-wise kernels (quantizers, scratch translation and tables).
const THREADS: u32 = 256;
/// Bytes of the device pattern host buffers are filled from.
const FILL_CHUNK: usize = 16 << 20;
/// Most entries handed to one `cuMemcpyBatchAsync` call.
const BATCH_LIMIT: usize = 32 * 1024;

/// A CUDA backend bound to one stream of one GPU.
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    stream: Stream,
    status_word: Arc<DeviceAllocation>,
    status: Mutex<StatusTracker>,
    /// Where [`Backend::poll_kernel_status`] copies the status word to, in stream order, and
    /// the copy in flight: its event and the last launch it covers. Locked after `status`.
    status_copy: Arc<PinnedAllocation>,
    status_snapshot: Mutex<Option<(PooledEvent, u64)>>,
    /// `kvs_copy_blocks`' work-queue counter (`kvs_work_queue`) and its value after everything
    /// enqueued so far: launches on this one stream each add their unit count to it.
    work_counter: Arc<DeviceAllocation>,
    work_base: Mutex<u64>,
    /// Keeps the status word and the work counter, which every launch may write, and the GPU
    /// (its module) until the stream has passed the last work enqueued before the backend was
    /// dropped.
    own: Usage,
    /// Device memory host fills copy from (the driver refuses memsets of registered host
    /// memory through its device alias); reused, and rewritten in stream order, by every fill.
    pattern: Mutex<Option<Buffer>>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Marks where the stream is now on `own`, so the memory launches write outlives them.
        let _ = ordered(self, &[], &[&self.own], || Ok(()));
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("gpu", &self.gpu.info().name)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// A backend on a new stream of `gpu`.
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        let stream = gpu.new_stream()?;
        Self::with_stream(gpu, stream)
    }

    /// A backend enqueuing on `stream` (which may be the engine's, see [`Gpu::borrow_stream`]).
    ///
    /// Creating one clears its two status words on the stream, without waiting: later work on
    /// the stream follows the clears.
    pub fn with_stream(gpu: Arc<Gpu>, stream: Stream) -> Result<Self> {
        let status_word = Arc::new(gpu.alloc_device(8)?);
        let work_counter = Arc::new(gpu.alloc_device(8)?);
        for word in [&status_word, &work_counter] {
            // SAFETY: an 8-byte allocation just made on this device; the stream is live.
            unsafe { result::memset_d8_async(word.ptr(), 0, 8, stream.raw()) }
                .map_err(Error::driver("cuMemsetD8Async"))?;
        }
        let status = Mutex::new(StatusTracker::new(status_word.ptr()));
        let status_copy = Arc::new(
            PinnedAllocation::new(gpu.context(), 8).map_err(|e| oom(e, 8, "pinned host"))?,
        );
        // The Gpu too: its module holds the kernels queued launches run.
        let own = Usage::new(Some(Box::new((
            status_word.clone(),
            work_counter.clone(),
            status_copy.clone(),
            gpu.clone(),
        ))));
        Ok(Self {
            gpu,
            stream,
            status_word,
            status,
            status_copy,
            status_snapshot: Mutex::new(None),
            work_counter,
            work_base: Mutex::new(0),
            own,
            pattern: Mutex::new(None),
        })
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The stream this backend enqueues on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The status a new launch of `kernel` reports through, and the tracker held until the
    /// launch is enqueued: [`Backend::poll_kernel_status`] then never counts a launch begun and
    /// not yet enqueued as covered by its copy of the word.
    fn begin<P>(
        &self,
        kernel: KernelFn<P>,
    ) -> Result<(MutexGuard<'_, StatusTracker>, abi::kvs_status)> {
        let mut tracker = lock(&self.status);
        if tracker.needs_clear() {
            // SAFETY: our own 8-byte status word; stream-ordered before the next launch.
            unsafe { result::memset_d8_async(self.status_word.ptr(), 0, 8, self.stream.raw()) }
                .map_err(Error::driver("cuMemsetD8Async"))?;
            tracker.cleared();
        }
        let status = tracker.begin(kernel.name());
        Ok((tracker, status))
    }

    /// CTAs for `units` units of work at `per_cta` units per CTA, capped to a few waves.
    fn grid(&self, units: u64, per_cta: u64) -> u32 {
        let cap = u64::from(self.gpu.info().sm_count) * 16;
        units.div_ceil(per_cta).clamp(1, cap) as u32
    }

    /// Enqueues the copy of `data` into `dst` at `offset` (checked by the caller), staged so
    /// the caller may reuse `data` at once.
    fn enqueue_bytes(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        let at = dst.slice(offset, data.len())?.addr();
        self.gpu.bind()?;
        // From pageable memory the driver stages the bytes before cuMemcpyAsync returns; from
        // pinned or registered memory the copy would read them later, so such data is first
        // copied into pageable memory of our own. cuPointerGetAttributes (unlike the singular
        // query) answers "no memory type" for pageable memory instead of failing.
        let mut memory_type = 0u32;
        let mut attribute = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
        let mut out = [(&mut memory_type as *mut u32).cast::<std::ffi::c_void>()];
        // SAFETY: one attribute, whose 4-byte value is written into `memory_type`.
        unsafe {
            sys::cuPointerGetAttributes(1, &mut attribute, out.as_mut_ptr(), data.as_ptr() as u64)
        }
        .result()
        .map_err(Error::driver("cuPointerGetAttributes"))?;
        let pageable;
        let src: &[u8] = if memory_type != 0 {
            pageable = data.to_vec();
            &pageable
        } else {
            data
        };
        for (dst, src, len) in cut_at_registrations(at, src.as_ptr() as u64, src.len() as u64) {
            // SAFETY: `at` spans data.len() bytes of a live buffer of this device (checked
            // above); the source is pageable host memory the driver stages before returning.
            unsafe { sys::cuMemcpyAsync(dst, src, len as usize, self.stream.raw()) }
                .result()
                .map_err(Error::driver("cuMemcpyAsync"))?;
        }
        Ok(())
    }

    /// Launches a block copy (`header` is its `kvs_copy_blocks_params`, status already set)
    /// with this backend's work queue: warps take their later units from its counter; every
    /// launch adds its unit count to it, and launches on this one stream see it in order
    /// (kvs_work_queue).
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    unsafe fn launch_blocks<P>(
        &self,
        kernel: KernelFn<P>,
        launch: Launch,
        params: &mut P,
        header: fn(&mut P) -> &mut abi::kvs_copy_blocks_params,
    ) -> Result<()> {
        let h = header(params);
        let units = h.num_pages * u64::from(h.num_pairs);
        // SAFETY: forwarded contract.
        unsafe { self.launch_queued(kernel, launch, params, units, |p| &mut header(p).work) }
    }

    /// Launches a kernel of `units` work units that takes them from this backend's work queue
    /// (`kvs_work_queue`, at `work(params)`): its counter, and its value after every launch
    /// before on this one stream.
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    unsafe fn launch_queued<P>(
        &self,
        kernel: KernelFn<P>,
        launch: Launch,
        params: &mut P,
        units: u64,
        work: impl Fn(&mut P) -> &mut abi::kvs_work_queue,
    ) -> Result<()> {
        let mut base = lock(&self.work_base);
        *work(params) = abi::kvs_work_queue {
            counter: self.work_counter.ptr(),
            base: *base,
        };
        // SAFETY: forwarded contract; the counter is ours.
        unsafe { self.launch(kernel, launch.ctas, launch.threads, params)? };
        *base += units;
        Ok(())
    }

    /// # Safety
    /// As [`Gpu::launch`].
    unsafe fn launch<P>(
        &self,
        kernel: KernelFn<P>,
        grid: u32,
        block: u32,
        params: &P,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.gpu.launch(kernel, grid, block, &self.stream, params) }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn stream_id(&self) -> StreamId {
        StreamId::Cuda(self.stream.raw() as u64)
    }

    fn address_space(&self) -> AddressSpace {
        AddressSpace::Cuda(self.gpu.info().ordinal)
    }

    fn max_threads(&self, family: KernelFamily) -> u32 {
        let kernel = match family {
            KernelFamily::Copy => crate::gpu::Kernel::CopyBlocks,
            KernelFamily::WriteRows => crate::gpu::Kernel::WriteRows,
            // The four take the same budget (cuda/decode_scatter.cu); the pages kernel stands
            // for them.
            KernelFamily::DecodeScatter => crate::gpu::Kernel::DecodeScatterPages,
        };
        self.gpu
            .max_threads(kernel)
            .min(super::compiled_max_threads(family))
    }

    fn alloc(&self, len: usize, kind: MemoryKind) -> Result<Buffer> {
        let memory = match kind {
            MemoryKind::Device => "device",
            MemoryKind::PinnedHost => "pinned host",
        };
        let oom = |e| oom(e, len, memory);
        sweep();
        let space = self.address_space();
        Ok(match kind {
            MemoryKind::Device => {
                let a = self.gpu.alloc_device(len).map_err(oom)?;
                Buffer::owned(a.ptr(), len, kind, space, Arc::new(a))
            }
            MemoryKind::PinnedHost => {
                let a = PinnedAllocation::new(self.gpu.context(), len).map_err(oom)?;
                Buffer::owned(a.device_ptr(), len, kind, space, Arc::new(a))
            }
        })
    }

    fn alloc_registrable(&self, len: usize) -> Result<Buffer> {
        sweep();
        let a =
            DeviceAllocation::new(self.gpu.context(), len).map_err(|e| oom(e, len, "device"))?;
        Ok(Buffer::owned(
            a.ptr(),
            len,
            MemoryKind::Device,
            self.address_space(),
            Arc::new(a),
        ))
    }

    fn write_sync(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.enqueue_write(dst, offset, data)?;
        self.stream.synchronize()
    }

    fn enqueue_write(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.check(dst, "write destination")?;
        if data.is_empty() {
            return Ok(());
        }
        ordered(self, &[], &[dst.usage()], || {
            self.enqueue_bytes(dst, offset, data)
        })
    }

    fn read_sync(&self, src: &Buffer, offset: usize, len: usize) -> Result<Vec<u8>> {
        self.check(src, "read source")?;
        let at = src.slice(offset, len)?.addr();
        let mut out = vec![0u8; len];
        if len == 0 {
            return Ok(out);
        }
        self.gpu.bind()?;
        ordered(self, &[src.usage()], &[], || {
            for (dst, src, len) in cut_at_registrations(out.as_mut_ptr() as u64, at, len as u64) {
                // SAFETY: `out` holds len bytes and outlives the copy (we synchronize before
                // returning); the source is device memory or pinned host memory of this
                // device, resolved by unified addressing.
                unsafe { sys::cuMemcpyAsync(dst, src, len as usize, self.stream.raw()) }
                    .result()
                    .map_err(Error::driver("cuMemcpyAsync"))?;
            }
            Ok(())
        })?;
        self.stream.synchronize()?;
        Ok(out)
    }

    fn fill(&self, dst: &Buffer, byte: u8) -> Result<()> {
        self.check(dst, "fill destination")?;
        self.gpu.bind()?;
        if dst.kind() == MemoryKind::Device {
            return ordered(self, &[], &[dst.usage()], || {
                // SAFETY: the range is the whole live buffer.
                unsafe { result::memset_d8_async(dst.addr(), byte, dst.len(), self.stream.raw()) }
                    .map_err(Error::driver("cuMemsetD8Async"))
            });
        }
        // Host buffers are filled by copying from a device pattern, all in stream order: a
        // later fill rewrites the pattern only after this one's copies have read it.
        let mut pattern = lock(&self.pattern);
        let want = FILL_CHUNK.min(dst.len()).max(1);
        if pattern.as_ref().is_none_or(|p| p.len() < want) {
            *pattern = Some(self.alloc(FILL_CHUNK, MemoryKind::Device)?);
        }
        let Some(p) = pattern.as_ref() else {
            return Ok(());
        };
        ordered(self, &[], &[p.usage(), dst.usage()], || {
            // SAFETY: our own pattern allocation of at least `want` bytes.
            unsafe { result::memset_d8_async(p.addr(), byte, want, self.stream.raw()) }
                .map_err(Error::driver("cuMemsetD8Async"))?;
            let mut done = 0;
            while done < dst.len() {
                let len = want.min(dst.len() - done);
                // SAFETY: both ranges are inside live buffers, kept until the stream has passed
                // the copy (the usages record it).
                unsafe { self.memcpy(dst.addr() + done as u64, p.addr(), len)? };
                done += len;
            }
            Ok(())
        })
    }
    fn synchronize(&self) -> Result<()> {
        self.gpu.bind()?;
        self.stream.synchronize()?;
        sweep();
        let mut tracker = lock(&self.status);
        if !tracker.has_pending() {
            return Ok(());
        }
        let mut word = 0u64;
        // SAFETY: reads our own 8-byte status word into a local; the stream is idle.
        unsafe {
            result::memcpy_dtoh_sync(std::slice::from_mut(&mut word), self.status_word.ptr())
        }
        .map_err(Error::driver("cuMemcpyDtoH"))?;
        // The word was read whole: a copy still marked in flight covers nothing left.
        *lock(&self.status_snapshot) = None;
        tracker.check(word)
    }

    fn poll_kernel_status(&self) -> Result<()> {
        let mut tracker = lock(&self.status);
        let mut snapshot = lock(&self.status_snapshot);
        let mut found = Ok(());
        if let Some((copied, through)) = snapshot.as_ref() {
            if !copied
                .try_is_complete()
                .map_err(Error::driver("cuEventQuery"))?
            {
                return Ok(());
            }
            // SAFETY: the pinned word the copy before `copied` wrote, and that copy has
            // completed; the next copy into it is queued only below, after this read.
            let word =
                unsafe { std::ptr::read_volatile(self.status_copy.host_ptr().cast::<u64>()) };
            found = tracker.check_through(word, *through);
            *snapshot = None;
        }
        if let Some(through) = tracker.last_pending() {
            self.gpu.bind()?;
            // SAFETY: our own 8-byte status word into our own 8-byte pinned word (through its
            // device alias); `own` keeps both until the stream has passed the backend's last
            // work, this copy included. Queued behind every launch begun so far (each holds
            // the tracker until it is enqueued).
            unsafe {
                sys::cuMemcpyAsync(
                    self.status_copy.device_ptr(),
                    self.status_word.ptr(),
                    8,
                    self.stream.raw(),
                )
            }
            .result()
            .map_err(Error::driver("cuMemcpyAsync"))?;
            let copied = self.gpu.pooled_event(false)?;
            self.stream.record(&copied)?;
            *snapshot = Some((copied, through));
        }
        found
    }

    fn record(&self) -> Result<Event> {
        let e = self.gpu.pooled_event(false)?;
        self.stream.record(&e)?;
        Ok(Event(EventInner::Cuda {
            event: Arc::new(e),
            stream: self.stream.raw() as u64,
        }))
    }

    fn record_timed(&self) -> Result<Event> {
        let e = self.gpu.pooled_event(true)?;
        self.stream.record(&e)?;
        Ok(Event(EventInner::Cuda {
            event: Arc::new(e),
            stream: self.stream.raw() as u64,
        }))
    }

    fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f64> {
        match (&start.0, &end.0) {
            (EventInner::Cuda { event: a, .. }, EventInner::Cuda { event: b, .. }) => a
                .elapsed_ms(b)
                .map(f64::from)
                .map_err(Error::driver("cuEventElapsedTime")),
            _ => Err(Error::InvalidArgument(
                "elapsed time between events of another backend".into(),
            )),
        }
    }

    fn wait(&self, event: &Event) -> Result<()> {
        match &event.0 {
            EventInner::Cuda { event, .. } => self.stream.wait(event),
            EventInner::Cpu { .. } => Err(Error::ForeignMemory {
                what: "an event".into(),
                owner: "a CPU backend".into(),
                user: self.address_space().to_string(),
            }),
        }
    }

    fn is_done(&self, event: &Event) -> Result<bool> {
        match &event.0 {
            EventInner::Cuda { event, .. } => event
                .try_is_complete()
                .map_err(Error::driver("cuEventQuery")),
            EventInner::Cpu { .. } => Err(Error::ForeignMemory {
                what: "an event".into(),
                owner: "a CPU backend".into(),
                user: self.address_space().to_string(),
            }),
        }
    }

    fn wait_event_sync(&self, event: &Event) -> Result<()> {
        match &event.0 {
            EventInner::Cuda { event, .. } => {
                count_host_sync();
                event
                    .synchronize()
                    .map_err(Error::driver("cuEventSynchronize"))
            }
            EventInner::Cpu { .. } => Err(Error::ForeignMemory {
                what: "an event".into(),
                owner: "a CPU backend".into(),
                user: self.address_space().to_string(),
            }),
        }
    }

    unsafe fn wait_counter(&self, addr: u64, value: u32) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.stream.wait_value_geq(addr, value) }
    }

    unsafe fn quantize_latent(&self, mut p: abi::kvs_quantize_latent_params) -> Result<()> {
        check::quantize_latent(&p)?;
        if p.num_tokens == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin(kernels::QUANTIZE_LATENT)?;
        p.status = status;
        let grid = self.grid(p.num_tokens, u64::from(THREADS / 32));
        // SAFETY: parameter type matches the kernel; addresses are the caller's contract.
        unsafe { self.launch(kernels::QUANTIZE_LATENT, grid, THREADS, &p) }
    }

    unsafe fn quantize_indexer(&self, mut p: abi::kvs_quantize_indexer_params) -> Result<()> {
        check::quantize_indexer(&p)?;
        if p.num_tokens == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin(kernels::QUANTIZE_INDEXER)?;
        p.status = status;
        let grid = self.grid(p.num_tokens, u64::from(THREADS / 16));
        // SAFETY: as above.
        unsafe { self.launch(kernels::QUANTIZE_INDEXER, grid, THREADS, &p) }
    }

    unsafe fn resolve(&self, mut p: abi::kvs_resolve_params) -> Result<()> {
        check::resolve(&p)?;
        if p.num_entries == 0 {
            return Ok(());
        }
        let kernel = super::resolve_kernel(&p);
        let (_launching, status) = self.begin(kernel)?;
        p.status = status;
        // One CTA per tile: a tile is a node of the tree, and tile ids are CTA ids.
        let grid = super::resolve_tiles(p.num_entries) as u32;
        // SAFETY: as above; tile_state holds two trees of `state_tiles >= grid` nodes (checked
        // above; the size is the caller's contract).
        unsafe { self.launch(kernel, grid, 256, &p) }
    }

    unsafe fn scratch_rows(&self, mut p: abi::kvs_scratch_rows_params) -> Result<()> {
        if p.num_slots == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin(kernels::SCRATCH_ROWS)?;
        p.status = status;
        let grid = self.grid(p.num_slots, u64::from(THREADS));
        // SAFETY: as above.
        unsafe { self.launch(kernels::SCRATCH_ROWS, grid, THREADS, &p) }
    }

    unsafe fn scratch_table(&self, mut p: abi::kvs_scratch_table_params) -> Result<()> {
        check::scratch_table(&p)?;
        let threads = u64::max(p.table_len, p.num_entries);
        if threads == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin(kernels::SCRATCH_TABLE)?;
        p.status = status;
        let grid = self.grid(threads, u64::from(THREADS));
        // SAFETY: as above.
        unsafe { self.launch(kernels::SCRATCH_TABLE, grid, THREADS, &p) }
    }

    unsafe fn copy_blocks(&self, mut p: abi::kvs_copy_blocks_params, launch: Launch) -> Result<()> {
        check::copy_blocks(&p)?;
        launch.validate(self.max_threads(KernelFamily::Copy))?;
        if p.num_pages == 0 || p.num_pairs == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin(kernels::COPY_BLOCKS)?;
        p.status = status;
        // SAFETY: forwarded contract.
        unsafe { self.launch_blocks(kernels::COPY_BLOCKS, launch, &mut p, |p| p) }
    }

    unsafe fn copy_blocks_inline(
        &self,
        p: &abi::kvs_copy_blocks_inline_params,
        launch: Launch,
    ) -> Result<()> {
        check::copy_blocks_inline(p)?;
        launch.validate(self.max_threads(KernelFamily::Copy))?;
        if p.copy.num_pages == 0 || p.copy.num_pairs == 0 {
            return Ok(());
        }
        // The header is set in place in a copy of the caller's struct: the driver copies the
        // parameters before cuLaunchKernel returns, so one copy per launch, on the stack.
        let mut p = *p;
        let (_launching, status) = self.begin(kernels::COPY_BLOCKS_INLINE)?;
        p.copy.status = status;
        // SAFETY: forwarded contract; the tables are inside `p` (checked above).
        unsafe { self.launch_blocks(kernels::COPY_BLOCKS_INLINE, launch, &mut p, |p| &mut p.copy) }
    }

    unsafe fn write_rows(&self, mut p: abi::kvs_write_rows_params, launch: Launch) -> Result<()> {
        check::write_rows(&p)?;
        launch.validate(self.max_threads(KernelFamily::WriteRows))?;
        if p.num_slots == 0 || p.num_pairs == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin(kernels::WRITE_ROWS)?;
        p.status = status;
        // Grid-stride units, no work queue: most units of a sharded write are skipped after one
        // slot read, and warps racing one counter for them measured slower than a grid of one
        // warp per unit (BENCHMARKS.md).
        p.work = abi::kvs_work_queue::default();
        // SAFETY: as above.
        unsafe { self.launch(kernels::WRITE_ROWS, launch.ctas, launch.threads, &p) }
    }

    unsafe fn decode_scatter(
        &self,
        mut p: abi::kvs_decode_scatter_params,
        launch: Launch,
    ) -> Result<()> {
        check::decode_scatter(&p)?;
        launch.validate(self.max_threads(KernelFamily::DecodeScatter))?;
        // Checked above: no overflow.
        let units = super::launch::decode_scatter_units(&p).unwrap_or(0);
        if units == 0 {
            return Ok(());
        }
        let kernel = super::decode_scatter_kernel(&p);
        let (_launching, status) = self.begin(kernel)?;
        p.status = status;
        // SAFETY: forwarded contract.
        unsafe { self.launch_queued(kernel, launch, &mut p, units, |p| &mut p.work) }
    }

    unsafe fn copy_ranges(&self, mut p: abi::kvs_copy_ranges_params, launch: Launch) -> Result<()> {
        launch.validate(self.max_threads(KernelFamily::Copy))?;
        if p.num_ranges == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin(kernels::COPY_RANGES)?;
        p.status = status;
        // SAFETY: as above.
        unsafe { self.launch(kernels::COPY_RANGES, launch.ctas, launch.threads, &p) }
    }

    unsafe fn memcpy(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        for (dst, src, len) in cut_at_registrations(dst, src, len as u64) {
            // SAFETY: unified addressing resolves both sides; ranges are the caller's contract,
            // and no piece spans two host registrations.
            unsafe { sys::cuMemcpyAsync(dst, src, len as usize, self.stream.raw()) }
                .result()
                .map_err(Error::driver("cuMemcpyAsync"))?;
        }
        Ok(())
    }

    unsafe fn memcpy_2d(&self, c: &Copy2d) -> Result<()> {
        if c.width == 0 || c.height == 0 {
            return Ok(());
        }
        let span = |pitch: u64| pitch * (c.height - 1) + c.width;
        if !registration_cuts(c.src, span(c.src_pitch)).is_empty()
            || !registration_cuts(c.dst, span(c.dst_pitch)).is_empty()
        {
            // A 2D copy must lie inside one registration: move its rows as one batch instead.
            let rows: Vec<abi::kvs_range> = (0..c.height)
                .map(|r| abi::kvs_range {
                    src: c.src + r * c.src_pitch,
                    dst: c.dst + r * c.dst_pitch,
                    bytes: c.width,
                })
                .collect();
            // SAFETY: forwarded contract (every row is valid memory of this backend).
            return unsafe { self.memcpy_batch(&rows) };
        }
        self.gpu.bind()?;
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            srcHost: std::ptr::null(),
            srcDevice: c.src,
            srcArray: std::ptr::null_mut(),
            srcPitch: c.src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            dstHost: std::ptr::null_mut(),
            dstDevice: c.dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: c.dst_pitch as usize,
            WidthInBytes: c.width as usize,
            Height: c.height as usize,
        };
        // SAFETY: the descriptor is fully initialised; row ranges are the caller's contract.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, self.stream.raw()) }
            .result()
            .map_err(Error::driver("cuMemcpy2DAsync"))
    }

    unsafe fn memcpy_batch(&self, ranges: &[abi::kvs_range]) -> Result<()> {
        self.gpu.bind()?;
        // The driver crashed (not errored) on one call of ~250K entries on driver 580; batches
        // go to it in slices of BATCH_LIMIT entries, which changes nothing about the ordering.
        let pieces: Vec<(u64, u64, u64)> = ranges
            .iter()
            .flat_map(|r| cut_at_registrations(r.dst, r.src, r.bytes))
            .collect();
        for ranges in pieces.chunks(BATCH_LIMIT) {
            let mut dsts: Vec<u64> = ranges.iter().map(|r| r.0).collect();
            let mut srcs: Vec<u64> = ranges.iter().map(|r| r.1).collect();
            let mut sizes: Vec<usize> = ranges.iter().map(|r| r.2 as usize).collect();
            // SAFETY: an all-zero CUmemcpyAttributes is a valid value (location hints
            // "invalid", which the driver ignores for device and pinned memory).
            let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            let mut attr_index = 0usize;
            // SAFETY: the arrays hold `ranges.len()` entries and live across the call (the
            // driver reads them before returning); one attribute set applies from index 0.
            unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    ranges.len(),
                    &mut attrs,
                    &mut attr_index,
                    1,
                    self.stream.raw(),
                )
            }
            .result()
            .map_err(Error::driver("cuMemcpyBatchAsync"))?;
        }
        Ok(())
    }
}

/// A driver's out-of-memory answer to an allocation of `len` bytes of `memory` as
/// [`Error::OutOfMemory`]; any other error as it is.
fn oom(e: Error, len: usize, memory: &'static str) -> Error {
    match e {
        Error::Driver { source, .. }
            if source.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY =>
        {
            Error::OutOfMemory {
                what: "a CUDA allocation".into(),
                bytes: len as u64,
                memory,
            }
        }
        other => other,
    }
}

/// `len` bytes from `src` to `dst` as pieces `(dst, src, len)` that cross no host-registration
/// boundary on either side (one piece in the common, unregistered case).
fn cut_at_registrations(dst: u64, src: u64, len: u64) -> Vec<(u64, u64, u64)> {
    let mut cuts = registration_cuts(src, len);
    cuts.extend(registration_cuts(dst, len));
    cuts.sort_unstable();
    cuts.dedup();
    let mut pieces = Vec::with_capacity(cuts.len() + 1);
    let mut at = 0;
    for cut in cuts.into_iter().chain(std::iter::once(len)) {
        if cut > at {
            pieces.push((dst + at, src + at, cut - at));
            at = cut;
        }
    }
    pieces
}
