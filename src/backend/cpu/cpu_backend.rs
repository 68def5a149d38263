//! [`CpuBackend`]: one stream of an arena, implementing [`Backend`] with the twins (the module
//! docs of [`super`] describe the orders its streams run in).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use super::allocation::{adopt_in, alloc_in};
use super::arena::*;
use super::streams::*;
use super::twins::*;
use crate::abi;
use crate::backend::status_word::StatusTracker;
use crate::backend::{
    check, count_host_sync, ordered, sweep, AddressSpace, Backend, Buffer, Copy2d, Event,
    EventInner, KernelFamily, Launch, MemoryKind, StreamId,
};
use crate::error::{Error, Result};
use crate::lock::lock;

/// The CPU reference backend: one stream of an arena.
pub struct CpuBackend {
    device: Arc<Mutex<Device>>,
    arena: u64,
    stream: usize,
    status: Mutex<StatusTracker>,
    /// Keeps the status word's allocation alive.
    status_word: Option<Buffer>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("arena", &self.arena)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A backend with a fresh arena, in the order `KVSHARD_CPU_STREAMS` names (immediate when
    /// unset; an unreadable value is reported on stderr and runs immediate).
    pub fn new() -> Self {
        let order = StreamOrder::from_env().unwrap_or_else(|e| {
            eprintln!("kvshard: {e}; running the CPU backend in immediate order");
            StreamOrder::Immediate
        });
        Self::with_order(order)
    }

    /// A backend with a fresh arena, in deferred order (see the module docs): work runs only
    /// when something waits for it, so ordering between streams is observable.
    pub fn deferred() -> Self {
        Self::with_order(StreamOrder::Deferred)
    }

    /// A backend with a fresh arena in `order`.
    pub fn with_order(order: StreamOrder) -> Self {
        let id = NEXT_ARENA.fetch_add(1, Ordering::Relaxed);
        let device = Arc::new(Mutex::new(Device {
            arena: Arena {
                id,
                allocs: BTreeMap::new(),
                next: window_start(id),
                used: 0,
                limit: machine_memory().unwrap_or(u64::MAX),
            },
            streams: Vec::new(),
            order,
            coin: match order {
                StreamOrder::Adversarial(seed) => seed,
                _ => 0,
            },
        }));
        Self::stream_of(device, id)
    }

    /// Another stream of the same arena, like a second stream of the same device: buffers of
    /// either are valid in both; each keeps its own kernel status.
    pub fn new_stream(&self) -> Self {
        Self::stream_of(self.device.clone(), self.arena)
    }

    fn stream_of(device: Arc<Mutex<Device>>, arena: u64) -> Self {
        let stream = {
            let mut d = lock(&device);
            d.streams.push(StreamState::default());
            d.streams.len() - 1
        };
        // Only an arena whose window is used up (a billion allocations) has no room for the
        // word; its kernels then run without reporting rejected inputs.
        let status_word = alloc_in(&device, 8, MemoryKind::Device, arena).ok();
        Self {
            status: Mutex::new(StatusTracker::new(
                status_word.as_ref().map_or(0, Buffer::addr),
            )),
            device,
            arena,
            stream,
            status_word,
        }
    }

    /// Makes memory mapped from elsewhere (shared memory another process exported) an
    /// allocation of this arena, so the twins read and write it like memory they allocated; it
    /// is dropped (unmapped) when the last buffer sharing it goes.
    pub(crate) fn adopt(&self, bytes: Box<dyn HostBytes>, kind: MemoryKind) -> Result<Buffer> {
        adopt_in(&self.device, bytes, kind, self.arena)
    }

    /// Makes the caller's `len` bytes at `ptr` an allocation of this arena, without copying:
    /// the returned buffer works like one [`Backend::alloc`] made (kernels and plans address it
    /// through the arena), while the bytes stay where they are, so the caller (an engine's NumPy
    /// arrays) sees every write. `keep` is dropped when the last clone of the buffer is.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid, writable memory that stays valid until `keep` is
    /// dropped, and that nothing else reads or writes while work of this arena uses it (as
    /// device memory must not be touched while a kernel uses it).
    pub unsafe fn adopt_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        kind: MemoryKind,
        keep: Arc<dyn Send + Sync>,
    ) -> Result<Buffer> {
        if ptr.is_null() && len > 0 {
            return Err(Error::InvalidArgument(
                "CPU backend: adopting a null pointer".into(),
            ));
        }
        let bytes: Box<dyn HostBytes> = Box::new(Adopted {
            ptr,
            len,
            _keep: keep,
        });
        adopt_in(&self.device, bytes, kind, self.arena)
    }

    /// The host address of the first byte of `buffer` (memory of this arena), for handing the
    /// bytes to the engine without a copy (a NumPy view). The address stays valid while the
    /// buffer (or a clone) is alive: an allocation's bytes never move. Nothing is run first: a
    /// deferred arena's queued work has not touched them yet.
    pub fn host_ptr(&self, buffer: &Buffer) -> Result<*mut u8> {
        self.check(buffer, "buffer")?;
        let mut d = self.dev();
        Ok(d.arena.bytes_mut(buffer.addr(), buffer.len())?.as_mut_ptr())
    }

    /// Whether this backend's arena defers work (deferred or adversarial order).
    pub fn is_deferred(&self) -> bool {
        self.order() != StreamOrder::Immediate
    }

    /// The order this backend's arena runs work in.
    pub fn order(&self) -> StreamOrder {
        lock(&self.device).order
    }

    /// The process address of arena bytes `[addr, addr + len)`, which must lie inside one live
    /// allocation of this arena: what a transfer engine registers and moves when it runs on the
    /// CPU twin (NIXL's DRAM memory, where the arena's "device" memory is host memory).
    ///
    /// Allocations never move, so the address stays valid while the allocation behind `addr`
    /// is alive (a [`Buffer`] of it is held). Reading or writing through it is outside the
    /// arena's lock: the caller orders such access with the backend's own work on those bytes
    /// (by waiting for the stream), just as a DMA engine's access to device memory must be.
    pub fn host_address(&self, addr: u64, len: usize) -> Result<usize> {
        let d = self.dev();
        let bytes = d.arena.bytes(addr, len)?;
        Ok(bytes.as_ptr() as usize)
    }

    fn dev(&self) -> MutexGuard<'_, Device> {
        lock(&self.device)
    }

    /// An event at this stream's current end of queue; `at` is the timing stamp of a timed
    /// one (set when the stream reaches it).
    fn event_here(&self, at: Option<Arc<std::sync::OnceLock<std::time::Instant>>>) -> Event {
        let d = self.dev();
        let s = &d.streams[self.stream];
        Event(EventInner::Cpu {
            arena: self.arena,
            stream: self.stream as u64,
            seq: s.enqueued,
            progress: s.progress.clone(),
            at,
        })
    }

    /// The status word's value in the arena `d` (0 without a word: nothing ever reports).
    fn status_word_in(&self, d: &Device) -> Result<u64> {
        match &self.status_word {
            Some(word) => d.arena.u64_at(word.addr()),
            None => Ok(0),
        }
    }

    /// The status a new launch of `kernel` reports through, and the tracker held until the
    /// launch is enqueued: [`Backend::poll_kernel_status`] then never counts a launch begun and
    /// not yet enqueued as run.
    fn begin(&self, kernel: &'static str) -> (MutexGuard<'_, StatusTracker>, abi::kvs_status) {
        let mut tracker = lock(&self.status);
        let status = tracker.begin(kernel);
        (tracker, status)
    }

    /// Queues `op` on this stream; in immediate mode runs it (and anything before it) now and
    /// returns its error.
    fn enqueue(&self, op: Op) -> Result<()> {
        let mut d = self.dev();
        let s = &mut d.streams[self.stream];
        s.queue.push_back(op);
        s.enqueued += 1;
        if d.order != StreamOrder::Immediate {
            return Ok(());
        }
        let target = d.streams[self.stream].enqueued;
        d.run_until(self.stream, target)?;
        match d.streams[self.stream].error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn run(&self, f: impl FnOnce(&mut Arena) -> Result<()> + Send + 'static) -> Result<()> {
        self.enqueue(Op::Run(Box::new(f)))
    }

    /// Runs everything queued on this stream (the host waits for it); returns the first error a
    /// deferred operation met.
    fn drain(&self) -> Result<MutexGuard<'_, Device>> {
        count_host_sync();
        let mut d = self.dev();
        d.before_host_wait(self.stream);
        let target = d.streams[self.stream].enqueued;
        d.run_until(self.stream, target)?;
        match d.streams[self.stream].error.take() {
            Some(e) => Err(e),
            None => Ok(d),
        }
    }
}

impl Drop for CpuBackend {
    /// A stream handle that goes leaves its queued work to run, as a destroyed CUDA stream's
    /// work still completes: here it runs now, so no event of it stays pending for ever.
    fn drop(&mut self) {
        let mut d = self.dev();
        let target = d.streams[self.stream].enqueued;
        let _ = d.run_until(self.stream, target);
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn host_view(&self, addr: u64, len: usize) -> Result<Option<usize>> {
        self.host_address(addr, len).map(Some)
    }

    fn address_space(&self) -> AddressSpace {
        AddressSpace::Cpu(self.arena)
    }

    fn max_threads(&self, family: KernelFamily) -> u32 {
        crate::backend::compiled_max_threads(family)
    }

    fn stream_id(&self) -> StreamId {
        StreamId::Cpu {
            arena: self.arena,
            stream: self.stream as u64,
        }
    }

    fn alloc(&self, len: usize, kind: MemoryKind) -> Result<Buffer> {
        sweep();
        alloc_in(&self.device, len, kind, self.arena)
    }

    fn write_sync(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.check(dst, "write destination")?;
        let at = dst.slice(offset, data.len())?.addr();
        ordered(self, &[], &[dst.usage()], || {
            self.drain()?
                .arena
                .bytes_mut(at, data.len())?
                .copy_from_slice(data);
            Ok(())
        })
    }

    fn enqueue_write(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.check(dst, "write destination")?;
        let at = dst.slice(offset, data.len())?.addr();
        let data = data.to_vec();
        ordered(self, &[], &[dst.usage()], || {
            self.run(move |mem| {
                mem.bytes_mut(at, data.len())?.copy_from_slice(&data);
                Ok(())
            })
        })
    }

    fn read_sync(&self, src: &Buffer, offset: usize, len: usize) -> Result<Vec<u8>> {
        self.check(src, "read source")?;
        let at = src.slice(offset, len)?.addr();
        ordered(self, &[src.usage()], &[], || {
            Ok(self.drain()?.arena.bytes(at, len)?.to_vec())
        })
    }

    fn fill(&self, dst: &Buffer, byte: u8) -> Result<()> {
        self.check(dst, "fill destination")?;
        let (at, len) = (dst.addr(), dst.len());
        ordered(self, &[], &[dst.usage()], || {
            self.run(move |mem| {
                mem.bytes_mut(at, len)?.fill(byte);
                Ok(())
            })
        })
    }

    fn synchronize(&self) -> Result<()> {
        // The tracker before the arena, as every launch takes them.
        let mut tracker = lock(&self.status);
        let word = {
            let d = self.drain()?;
            if !tracker.has_pending() {
                return Ok(());
            }
            self.status_word_in(&d)?
        };
        sweep();
        tracker.check(word)
    }

    fn poll_kernel_status(&self) -> Result<()> {
        let mut tracker = lock(&self.status);
        let Some(through) = tracker.last_pending() else {
            return Ok(());
        };
        // Every launch begun so far is enqueued (each holds the tracker until it is): once the
        // stream has passed this point, they have all run and written what they report.
        if !self.is_done(&self.event_here(None))? {
            return Ok(());
        }
        let word = self.status_word_in(&self.dev())?;
        tracker.check_through(word, through)
    }

    fn record(&self) -> Result<Event> {
        Ok(self.event_here(None))
    }

    fn record_timed(&self) -> Result<Event> {
        // The time is stamped by an operation of its own, when the stream reaches it: at once
        // in immediate mode, when something waits in deferred mode.
        let at = Arc::new(std::sync::OnceLock::new());
        let stamp = at.clone();
        self.run(move |_| {
            let _ = stamp.set(std::time::Instant::now());
            Ok(())
        })?;
        Ok(self.event_here(Some(at)))
    }

    fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f64> {
        let time = |e: &Event| match &e.0 {
            EventInner::Cpu { at: Some(at), .. } => at.get().copied(),
            _ => None,
        };
        match (time(start), time(end)) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(a).as_secs_f64() * 1e3),
            _ => Err(Error::InvalidArgument(
                "elapsed time needs two timed events of this backend that the stream has reached"
                    .into(),
            )),
        }
    }

    fn wait(&self, event: &Event) -> Result<()> {
        match event.0 {
            EventInner::Cpu {
                arena, stream, seq, ..
            } if arena == self.arena => self.enqueue(Op::WaitEvent {
                stream: stream as usize,
                seq,
            }),
            _ => Err(Error::ForeignMemory {
                what: "an event".into(),
                owner: "another backend".into(),
                user: self.address_space().to_string(),
            }),
        }
    }

    fn is_done(&self, event: &Event) -> Result<bool> {
        match event.0 {
            EventInner::Cpu {
                arena, stream, seq, ..
            } if arena == self.arena => {
                let mut d = self.dev();
                if matches!(d.order, StreamOrder::Adversarial(_)) {
                    // A GPU gets on with queued work while the host asks; here asking does it.
                    d.run_until(stream as usize, seq)?;
                }
                Ok(d.streams[stream as usize].executed >= seq)
            }
            _ => Err(Error::ForeignMemory {
                what: "an event".into(),
                owner: "another backend".into(),
                user: self.address_space().to_string(),
            }),
        }
    }

    fn wait_event_sync(&self, event: &Event) -> Result<()> {
        match event.0 {
            EventInner::Cpu {
                arena, stream, seq, ..
            } if arena == self.arena => {
                count_host_sync();
                let mut d = self.dev();
                let stream = stream as usize;
                d.before_host_wait(stream);
                d.run_until(stream, seq)?;
                match d.streams[stream].error.take() {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            }
            _ => Err(Error::ForeignMemory {
                what: "an event".into(),
                owner: "another backend".into(),
                user: self.address_space().to_string(),
            }),
        }
    }

    unsafe fn wait_counter(&self, addr: u64, value: u32) -> Result<()> {
        self.dev().arena.bytes(addr, 4)?;
        self.enqueue(Op::WaitCounter { addr, value })
    }

    unsafe fn quantize_latent(&self, mut p: abi::kvs_quantize_latent_params) -> Result<()> {
        check::quantize_latent(&p)?;
        let (_launching, status) = self.begin("kvs_quantize_latent");
        p.status = status;
        self.run(move |mem| quantize_latent(mem, &p))
    }

    unsafe fn quantize_indexer(&self, mut p: abi::kvs_quantize_indexer_params) -> Result<()> {
        check::quantize_indexer(&p)?;
        let (_launching, status) = self.begin("kvs_quantize_indexer");
        p.status = status;
        self.run(move |mem| quantize_indexer(mem, &p))
    }

    unsafe fn resolve(&self, mut p: abi::kvs_resolve_params) -> Result<()> {
        check::resolve(&p)?;
        let (_launching, status) = self.begin(crate::backend::resolve_kernel(&p).name());
        p.status = status;
        self.run(move |mem| resolve(mem, &p))
    }

    unsafe fn scratch_rows(&self, mut p: abi::kvs_scratch_rows_params) -> Result<()> {
        let (_launching, status) = self.begin("kvs_scratch_rows");
        p.status = status;
        self.run(move |mem| scratch_rows(mem, &p))
    }

    unsafe fn scratch_table(&self, mut p: abi::kvs_scratch_table_params) -> Result<()> {
        check::scratch_table(&p)?;
        if p.table_len == 0 && p.num_entries == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin("kvs_scratch_table");
        p.status = status;
        self.run(move |mem| scratch_table(mem, &p))
    }

    unsafe fn copy_blocks(&self, mut p: abi::kvs_copy_blocks_params, launch: Launch) -> Result<()> {
        check::copy_blocks(&p)?;
        launch.validate(self.max_threads(KernelFamily::Copy))?;
        if p.num_pages == 0 || p.num_pairs == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin("kvs_copy_blocks");
        p.status = status;
        self.enqueue(Op::Blocks {
            launch: Box::new(BlockLaunch { p, inline: None }),
            next: 0,
        })
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
        let mut header = p.copy;
        let (_launching, status) = self.begin("kvs_copy_blocks_inline");
        header.status = status;
        self.enqueue(Op::Blocks {
            launch: Box::new(BlockLaunch {
                p: header,
                inline: Some(p.table.into()),
            }),
            next: 0,
        })
    }

    unsafe fn write_rows(&self, mut p: abi::kvs_write_rows_params, launch: Launch) -> Result<()> {
        check::write_rows(&p)?;
        launch.validate(self.max_threads(KernelFamily::WriteRows))?;
        let (_launching, status) = self.begin("kvs_write_rows");
        p.status = status;
        self.run(move |mem| write_rows(mem, &p))
    }

    unsafe fn decode_scatter(
        &self,
        mut p: abi::kvs_decode_scatter_params,
        launch: Launch,
    ) -> Result<()> {
        check::decode_scatter(&p)?;
        launch.validate(self.max_threads(KernelFamily::DecodeScatter))?;
        let (_launching, status) = self.begin(crate::backend::decode_scatter_kernel(&p).name());
        p.status = status;
        self.run(move |mem| decode_scatter(mem, &p))
    }

    unsafe fn copy_ranges(&self, mut p: abi::kvs_copy_ranges_params, launch: Launch) -> Result<()> {
        launch.validate(self.max_threads(KernelFamily::Copy))?;
        if p.num_ranges == 0 {
            return Ok(());
        }
        let (_launching, status) = self.begin("kvs_copy_ranges");
        p.status = status;
        self.run(move |mem| copy_ranges(mem, &p))
    }

    unsafe fn memcpy(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.run(move |mem| mem.copy(dst, src, len))
    }

    unsafe fn memcpy_2d(&self, c: &Copy2d) -> Result<()> {
        let c = *c;
        let width = usize::try_from(c.width)
            .map_err(|_| Error::overflow(format!("2D copy rows of {} bytes", c.width)))?;
        self.run(move |mem| {
            for row in 0..c.height {
                mem.copy(c.dst + row * c.dst_pitch, c.src + row * c.src_pitch, width)?;
            }
            Ok(())
        })
    }

    unsafe fn memcpy_batch(&self, ranges: &[abi::kvs_range]) -> Result<()> {
        let ranges = ranges.to_vec();
        self.run(move |mem| {
            for r in &ranges {
                let len = usize::try_from(r.bytes)
                    .map_err(|_| Error::overflow(format!("a range of {} bytes", r.bytes)))?;
                mem.copy(r.dst, r.src, len)?;
            }
            Ok(())
        })
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_instance_has_its_own_address_window() {
        let (a, b) = (CpuBackend::new(), CpuBackend::new());
        let x = a.alloc(64, MemoryKind::Device).unwrap();
        let y = b.alloc(64, MemoryKind::Device).unwrap();
        assert_ne!(x.addr(), y.addr());
        assert_ne!(a.address_space(), b.address_space());
        let e = b.write_sync(&x, 0, &[1; 8]).unwrap_err();
        assert!(matches!(e, Error::ForeignMemory { .. }), "{e}");
        // A second stream shares the arena.
        let s = a.new_stream();
        s.write_sync(&x, 0, &[7; 8]).unwrap();
        assert_eq!(a.read_sync(&x, 0, 8).unwrap(), vec![7; 8]);
    }

    #[test]
    fn impossible_allocations_are_errors_not_aborts() {
        let b = CpuBackend::new();
        for len in [usize::MAX, 1 << 45] {
            let e = b.alloc(len, MemoryKind::Device).unwrap_err();
            assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
        }
    }

    #[test]
    fn deferred_work_runs_when_waited_for() {
        let b = CpuBackend::deferred();
        let other = b.new_stream();
        let x = b.alloc(16, MemoryKind::Device).unwrap();
        b.fill(&x, 3).unwrap();
        let e = b.record().unwrap();
        assert!(!b.is_done(&e).unwrap());
        // Another stream waiting for the event runs the fill first.
        other.wait(&e).unwrap();
        assert!(!b.is_done(&e).unwrap());
        assert_eq!(other.read_sync(&x, 0, 4).unwrap(), vec![3; 4]);
        assert!(b.is_done(&e).unwrap());
    }
}
