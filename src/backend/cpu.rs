//! The CPU reference backend: the twin of every kernel, with the same parameter structs and the
//! same semantics, on an address space of its own (so a plan's addresses mean the same thing
//! here as on the GPU). Each twin below is the specification its kernel is tested against, byte
//! for byte.
//!
//! Every [`CpuBackend::new`] gets a window of addresses no other instance uses, so a buffer of
//! one instance is refused by another ([`crate::error::Error::ForeignMemory`]) and can never be
//! read as an unrelated allocation. [`CpuBackend::new_stream`] makes another stream of the same
//! arena, like a second CUDA stream of one device.
//!
//! Work runs in one of three orders ([`StreamOrder`]):
//! - **immediate**: an operation runs when it is enqueued, so every event is complete as soon
//!   as it is recorded;
//! - **deferred**: operations queue up per stream and run only when something waits for them
//!   (a `_sync` call or `synchronize` of their stream, another stream's wait on an event or a
//!   counter). A counter wait runs the other streams one block-copy unit at a time, lowest
//!   stream first, until the counter arrives: deterministic, and fine-grained enough that
//!   per-layer readiness is observable without a GPU (a consumer that waited for layer 0 sees
//!   layer 0 landed and the last layer not yet);
//! - **adversarial**: deferred, and whenever the host waits for a stream, a seeded coin decides
//!   whether every other stream's queued work runs first or stays queued. Only recorded
//!   events and counters order streams, so work that should have waited for another stream
//!   and did not reads the old bytes (the other stream runs later) or has its bytes
//!   overwritten (the other stream runs first): an ordering bug fails on the CPU, in CI, as
//!   it would on a GPU only sometimes. Asking whether an event is done runs its stream up to
//!   it, as a GPU makes progress on its own.
//!
//! [`CpuBackend::new`] takes its order from `KVSHARD_CPU_STREAMS` (`immediate`, `deferred`,
//! `adversarial` or `adversarial:SEED`; immediate when unset). The repository's cargo
//! configuration sets it to `adversarial` for every test run.
//!
//! Freeing memory never runs queued work: an allocation whose queued work has not run stays in
//! the arena until it has (`super::usage`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use half::bf16;

use super::status::{raise, StatusTracker};
use super::{
    check, count_host_sync, ordered, sweep, AddressSpace, Backend, Buffer, Copy2d, Event,
    EventInner, KernelFamily, Launch, MemoryKind, StreamId,
};
use crate::abi;
use crate::error::{Error, Result};
use crate::fp8;
use crate::geometry::{
    IndexerScale, LatentLayout, INDEXER_HEAD_DIM, INDEXER_PAGE_BYTES, INDEXER_SCALES_OFFSET,
    LATENT_DIM, PAGE_SIZE,
};
use crate::index::{LogicalPage, Slot};
use crate::shard::Placement;

/// First address of the first arena; every arena owns a window of [`ARENA_SPAN`] addresses, and
/// allocations inside it are 256-byte aligned with unmapped gaps between them, so an
/// out-of-bounds access is an error here just as it would be a fault on the GPU.
const BASE: u64 = 0x1000_0000_0000;
const ARENA_SPAN: u64 = 1 << 46;
/// Windows fit below 2^63 (addresses stay positive as int64); arenas beyond this many reuse
/// windows, which is harmless because buffers are matched to arenas by id, not by address.
const WINDOWS: u64 = ((1 << 63) - BASE) / ARENA_SPAN;
const GAP: u64 = 64 << 10;

static NEXT_ARENA: AtomicU64 = AtomicU64::new(0);

/// Bytes an allocation can hold: kvshard's own zeroed heap memory, or memory mapped from
/// elsewhere (shared memory another process exported).
pub(crate) trait HostBytes: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl HostBytes for Box<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Memory the caller owns, adopted into an arena ([`CpuBackend::adopt`]).
struct Adopted {
    ptr: *mut u8,
    len: usize,
    _keep: Arc<dyn Send + Sync>,
}

// SAFETY: the memory is the caller's, who promised (`CpuBackend::adopt`) it stays valid until
// `_keep` is dropped and is not touched concurrently with the arena's work; the arena only
// reaches it under its lock.
unsafe impl Send for Adopted {}

impl HostBytes for Adopted {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `len` valid bytes at `ptr` while `_keep` lives (the adopt contract).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as `bytes`, and writable; `&mut self` is the arena's only access path.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// `len` zeroed bytes, or [`Error::OutOfMemory`]: the allocation is asked of the allocator
/// fallibly and zeroed by it (calloc: fresh pages are not touched until used).
fn zeroed(len: usize, kind: MemoryKind) -> Result<Box<[u8]>> {
    let oom = || Error::OutOfMemory {
        what: "a CPU backend allocation".into(),
        bytes: len as u64,
        memory: memory_name(kind),
    };
    if len == 0 {
        return Ok(Box::new([]));
    }
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| oom())?;
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: `ptr` is a zeroed allocation of the global allocator with the layout of a
    // `[u8; len]`, owned by nothing else: exactly what a boxed slice of `len` bytes is.
    Ok(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) })
}

fn memory_name(kind: MemoryKind) -> &'static str {
    match kind {
        MemoryKind::Device => "device",
        MemoryKind::PinnedHost => "pinned host",
    }
}

/// Bytes of memory the machine has, as the OS reports it (`None` when it cannot be read).
fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

struct Arena {
    id: u64,
    allocs: BTreeMap<u64, Box<dyn HostBytes>>,
    next: u64,
    /// Bytes currently allocated, and the most the machine can hold.
    used: u64,
    limit: u64,
}

impl Arena {
    fn locate(&self, addr: u64, len: usize) -> Result<(u64, usize)> {
        if let Some((&base, bytes)) = self.allocs.range(..=addr).next_back() {
            let offset = (addr - base) as usize;
            if offset
                .checked_add(len)
                .is_some_and(|end| end <= bytes.bytes().len())
            {
                return Ok((base, offset));
            }
        }
        Err(Error::InvalidArgument(format!(
            "CPU backend: [{addr:#x}, +{len}) is not inside one allocation of arena {}",
            self.id
        )))
    }

    fn bytes(&self, addr: u64, len: usize) -> Result<&[u8]> {
        let (base, offset) = self.locate(addr, len)?;
        Ok(&self.allocs[&base].bytes()[offset..offset + len])
    }

    fn bytes_mut(&mut self, addr: u64, len: usize) -> Result<&mut [u8]> {
        let (base, offset) = self.locate(addr, len)?;
        let alloc = self
            .allocs
            .get_mut(&base)
            .ok_or_else(|| Error::InvalidArgument(format!("allocation {base:#x} vanished")))?;
        Ok(&mut alloc.bytes_mut()[offset..offset + len])
    }

    fn copy(&mut self, dst: u64, src: u64, len: usize) -> Result<()> {
        let data = self.bytes(src, len)?.to_vec();
        self.bytes_mut(dst, len)?.copy_from_slice(&data);
        Ok(())
    }

    fn i64_at(&self, addr: u64) -> Result<i64> {
        let b = self.bytes(addr, 8)?;
        Ok(i64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    fn u64_at(&self, addr: u64) -> Result<u64> {
        Ok(self.i64_at(addr)? as u64)
    }

    fn u32_at(&self, addr: u64) -> Result<u32> {
        let b = self.bytes(addr, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn set_u64(&mut self, addr: u64, v: u64) -> Result<()> {
        self.bytes_mut(addr, 8)?.copy_from_slice(&v.to_le_bytes());
        Ok(())
    }

    fn pair(&self, addr: u64, k: u64) -> Result<abi::kvs_layer_pair> {
        let at = addr + 24 * k;
        Ok(abi::kvs_layer_pair {
            src: self.u64_at(at)?,
            dst: self.u64_at(at + 8)?,
            component: self.u32_at(at + 16)?,
            signal: self.u32_at(at + 20)?,
        })
    }

    /// Takes `len` bytes in this arena's window, held by `bytes`.
    fn insert(&mut self, len: usize, bytes: Box<dyn HostBytes>) -> Result<u64> {
        let base = self.next;
        let next = base
            .checked_add(len as u64)
            .and_then(|e| e.checked_add(GAP))
            .map(|e| e.next_multiple_of(256))
            .filter(|&e| e <= window_start(self.id) + ARENA_SPAN)
            .ok_or_else(|| Error::OutOfMemory {
                what: format!("CPU backend arena {} (its address window is full)", self.id),
                bytes: len as u64,
                memory: "host",
            })?;
        self.next = next;
        self.used += len as u64;
        self.allocs.insert(base, bytes);
        Ok(base)
    }
}

/// An operation that runs whole against the arena.
type Work = Box<dyn FnOnce(&mut Arena) -> Result<()> + Send>;

/// One queued operation of a stream.
enum Op {
    /// Runs whole.
    Run(Work),
    /// `kvs_copy_blocks`, run unit by unit (unit `u = k * num_pages + j`, as on the GPU).
    Blocks {
        p: Box<abi::kvs_copy_blocks_params>,
        next: u64,
    },
    /// Waits until stream `stream` has run its first `seq` operations.
    WaitEvent { stream: usize, seq: u64 },
    /// Waits until the u32 at `addr` reaches `value` (wrapping compare).
    WaitCounter { addr: u64, value: u32 },
}

#[derive(Default)]
struct StreamState {
    queue: VecDeque<Op>,
    /// Operations enqueued, and run, so far; `progress` mirrors `executed` for events, which
    /// read it without the arena's lock.
    enqueued: u64,
    executed: u64,
    progress: Arc<AtomicU64>,
    /// The first error a deferred operation met; reported by the next synchronize.
    error: Option<Error>,
}

/// When queued work runs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOrder {
    /// Every operation runs when it is enqueued.
    Immediate,
    /// Operations run when something waits for them.
    Deferred,
    /// Deferred, and each host wait runs the other streams first or last, by a coin seeded
    /// with this value.
    Adversarial(u64),
}

impl StreamOrder {
    /// The order `KVSHARD_CPU_STREAMS` names: `immediate` (also when unset), `deferred`,
    /// `adversarial` (seed 0) or `adversarial:SEED`.
    pub fn from_env() -> Result<Self> {
        let value = std::env::var("KVSHARD_CPU_STREAMS").unwrap_or_default();
        match value.as_str() {
            "" | "immediate" => Ok(Self::Immediate),
            "deferred" => Ok(Self::Deferred),
            "adversarial" => Ok(Self::Adversarial(0)),
            other => other
                .strip_prefix("adversarial:")
                .and_then(|seed| seed.parse().ok())
                .map(Self::Adversarial)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "KVSHARD_CPU_STREAMS={other}: expected immediate, deferred, adversarial or adversarial:SEED"
                    ))
                }),
        }
    }
}

struct Device {
    arena: Arena,
    streams: Vec<StreamState>,
    order: StreamOrder,
    /// The adversarial coin's state (splitmix64).
    coin: u64,
}

fn counter_reached(counter: u32, value: u32) -> bool {
    (counter.wrapping_sub(value) as i32) >= 0
}

impl Device {
    /// Runs one step of stream `s`'s first operation: a whole operation, or one unit of a block
    /// copy. Returns whether the stream had anything to run.
    fn step(&mut self, s: usize) -> bool {
        let Some(op) = self.streams[s].queue.pop_front() else {
            return false;
        };
        let (result, rest) = match op {
            Op::Run(f) => (f(&mut self.arena), None),
            Op::Blocks { p, next } => match copy_block_unit(&mut self.arena, &p, next) {
                Ok(()) if next + 1 < p.num_pages * u64::from(p.num_pairs) => {
                    (Ok(()), Some(Op::Blocks { p, next: next + 1 }))
                }
                other => (other, None),
            },
            Op::WaitEvent { stream, seq } => (self.run_until(stream, seq), None),
            Op::WaitCounter { addr, value } => (self.wait_counter(s, addr, value), None),
        };
        match rest {
            Some(op) => self.streams[s].queue.push_front(op),
            None => {
                let st = &mut self.streams[s];
                st.executed += 1;
                st.progress.store(st.executed, Ordering::Release);
            }
        }
        if let Err(e) = result {
            self.streams[s].error.get_or_insert(e);
        }
        true
    }

    /// Runs stream `s` until its first `seq` operations have run.
    fn run_until(&mut self, s: usize, seq: u64) -> Result<()> {
        while self.streams[s].executed < seq {
            if !self.step(s) {
                break;
            }
        }
        Ok(())
    }

    /// Before the host waits for stream `s`: in adversarial order, a coin decides whether every
    /// other stream's queued work runs now (before `s`) or stays queued (after it).
    fn before_host_wait(&mut self, s: usize) {
        if !matches!(self.order, StreamOrder::Adversarial(_)) {
            return;
        }
        // splitmix64: a well-mixed, reproducible sequence from the seed.
        self.coin = self.coin.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.coin;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        if (z ^ (z >> 31)) & 1 == 0 {
            return;
        }
        for other in (0..self.streams.len()).filter(|&o| o != s) {
            let target = self.streams[other].enqueued;
            let _ = self.run_until(other, target);
        }
    }

    /// Runs the other streams, one step at a time (lowest stream first), until the counter at
    /// `addr` reaches `value`; work that can never get it there is an error (it would hang a
    /// GPU).
    fn wait_counter(&mut self, waiter: usize, addr: u64, value: u32) -> Result<()> {
        loop {
            let counter = self.arena.u32_at(addr)?;
            if counter_reached(counter, value) {
                return Ok(());
            }
            let busy =
                (0..self.streams.len()).find(|&s| s != waiter && !self.streams[s].queue.is_empty());
            match busy {
                Some(s) => {
                    self.step(s);
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "counter at {addr:#x} is {counter} and can never reach {value}: the wait would hang on a GPU"
                    )))
                }
            }
        }
    }
}

/// Frees its allocation from the arena when the last buffer sharing it is dropped.
struct CpuAllocation {
    device: Weak<Mutex<Device>>,
    base: u64,
    len: u64,
}

impl Drop for CpuAllocation {
    fn drop(&mut self) {
        if let Some(device) = self.device.upgrade() {
            // Runs nothing: the allocation's usage (`super::usage`) drops this only once the
            // work kvshard queued on it has run. Work queued on it without its usage being told
            // meets a missing allocation and fails, where a GPU would read freed memory.
            let mut d = lock(&device);
            if d.arena.allocs.remove(&self.base).is_some() {
                d.arena.used -= self.len;
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

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

    fn begin(&self, kernel: &'static str) -> abi::kvs_status {
        lock(&self.status).begin(kernel)
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

fn window_start(arena: u64) -> u64 {
    BASE + (arena % WINDOWS) * ARENA_SPAN
}

fn alloc_in(
    device: &Arc<Mutex<Device>>,
    len: usize,
    kind: MemoryKind,
    arena: u64,
) -> Result<Buffer> {
    {
        let d = lock(device);
        if d.arena.used.saturating_add(len as u64) > d.arena.limit {
            return Err(Error::OutOfMemory {
                what: format!(
                    "a CPU backend allocation ({} bytes already held, the machine has {})",
                    d.arena.used, d.arena.limit
                ),
                bytes: len as u64,
                memory: memory_name(kind),
            });
        }
    }
    adopt_in(device, Box::new(zeroed(len, kind)?), kind, arena)
}

/// Places `bytes` in the arena's window and returns them as a buffer that removes (and drops)
/// them when its last share goes.
fn adopt_in(
    device: &Arc<Mutex<Device>>,
    bytes: Box<dyn HostBytes>,
    kind: MemoryKind,
    arena: u64,
) -> Result<Buffer> {
    let len = bytes.bytes().len();
    let base = lock(device).arena.insert(len, bytes)?;
    let owner = Arc::new(CpuAllocation {
        device: Arc::downgrade(device),
        base,
        len: len as u64,
    });
    Ok(Buffer::owned(
        base,
        len,
        kind,
        AddressSpace::Cpu(arena),
        owner,
    ))
}

/// Raises the status word in `mem` for a bad input at `position`.
fn report(mem: &mut Arena, status: &abi::kvs_status, position: u64) -> Result<()> {
    if status.word == 0 {
        return Ok(());
    }
    let mut word = mem.u64_at(status.word)?;
    raise(&mut word, status, position);
    mem.set_u64(status.word, word)
}

fn bf16s(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

/// The CPU twin of `resolve_page` in cuda/copy.cu.
fn resolve_page(
    mem: &mut Arena,
    list: &abi::kvs_page_list,
    j: u64,
    status: &abi::kvs_status,
) -> Result<Option<u64>> {
    let page = if list.kind == abi::KVS_INDEX_POSITION {
        j
    } else {
        let id = mem.i64_at(list.ids + 8 * j)?;
        if id < 0 {
            return Ok(None);
        }
        if list.kind == abi::KVS_INDEX_LOGICAL {
            let placement = Placement::new(list.shard)?;
            let page = LogicalPage(id as u64);
            if placement.owner(page) != list.rank {
                return Ok(None);
            }
            placement.local(page).0
        } else {
            id as u64
        }
    };
    if page >= list.limit {
        report(mem, status, j)?;
        return Ok(None);
    }
    Ok(Some(page))
}

/// Unit `u` of `kvs_copy_blocks`: entry `j` of pair `k`, then the pair's signal.
fn copy_block_unit(mem: &mut Arena, p: &abi::kvs_copy_blocks_params, u: u64) -> Result<()> {
    let k = u / p.num_pages;
    let j = u - k * p.num_pages;
    let pair = mem.pair(p.pairs, k)?;
    let src_page = resolve_page(mem, &p.src_pages, j, &p.status)?;
    let dst_page = resolve_page(mem, &p.dst_pages, j, &p.status)?;
    let component_ok = pair.component < p.num_components;
    if !component_ok && j == 0 {
        report(mem, &p.status, u)?;
    }
    if let (Some(s), Some(d), true) = (src_page, dst_page, component_ok) {
        let c = &p.components[pair.component as usize];
        let src = pair.src + s * c.src.page_stride;
        let dst = pair.dst + d * c.dst.page_stride;
        for r in 0..u64::from(c.rows) {
            mem.copy(
                dst + r * c.dst.row_stride,
                src + r * c.src.row_stride,
                c.row_bytes as usize,
            )?;
        }
    }
    if p.signals != 0 {
        let at = p.signals + 4 * u64::from(pair.signal);
        let v = mem.u32_at(at)?.wrapping_add(1);
        mem.bytes_mut(at, 4)?.copy_from_slice(&v.to_le_bytes());
    }
    Ok(())
}

fn quantize_latent(mem: &mut Arena, p: &abi::kvs_quantize_latent_params) -> Result<()> {
    let layout = match p.layout {
        abi::KVS_LATENT_FP8_TRTLLM => LatentLayout::Fp8Trtllm,
        abi::KVS_LATENT_FP8_SCALED => LatentLayout::Fp8Scaled,
        _ => LatentLayout::Bf16,
    };
    let row_bytes = layout.row_bytes();
    let mut row = vec![0u8; row_bytes];
    for token in 0..p.num_tokens {
        let slot = mem.i64_at(p.slots + 8 * token)?;
        if slot < 0 {
            continue;
        }
        if slot as u64 >= p.dst_rows {
            report(mem, &p.status, token)?;
            continue;
        }
        let input = bf16s(mem.bytes(p.src + token * p.src_stride, 2 * LATENT_DIM)?);
        fp8::quantize_latent_row(layout, &input, &mut row)?;
        mem.bytes_mut(p.dst + slot as u64 * row_bytes as u64, row_bytes)?
            .copy_from_slice(&row);
    }
    Ok(())
}

fn quantize_indexer(mem: &mut Arena, p: &abi::kvs_quantize_indexer_params) -> Result<()> {
    let kind = if p.scale == abi::KVS_SCALE_UE8M0 {
        IndexerScale::Ue8m0
    } else {
        IndexerScale::Plain
    };
    let mut codes = [0u8; INDEXER_HEAD_DIM];
    for token in 0..p.num_tokens {
        let slot = mem.i64_at(p.slots + 8 * token)?;
        if slot < 0 {
            continue;
        }
        if slot as u64 >= p.dst_pages.saturating_mul(PAGE_SIZE as u64) {
            report(mem, &p.status, token)?;
            continue;
        }
        let keys = bf16s(mem.bytes(p.src + token * p.src_stride, 2 * INDEXER_HEAD_DIM)?);
        let scale = fp8::quantize_indexer_row(&keys, kind, &mut codes)?;
        let block = p.dst + (slot as u64 / PAGE_SIZE as u64) * INDEXER_PAGE_BYTES as u64;
        let offset = slot as u64 % PAGE_SIZE as u64;
        mem.bytes_mut(block + offset * INDEXER_HEAD_DIM as u64, INDEXER_HEAD_DIM)?
            .copy_from_slice(&codes);
        mem.bytes_mut(block + INDEXER_SCALES_OFFSET as u64 + 4 * offset, 4)?
            .copy_from_slice(&scale.to_le_bytes());
    }
    Ok(())
}

fn resolve(mem: &mut Arena, p: &abi::kvs_resolve_params) -> Result<()> {
    let placement = Placement::new(p.shard)?;
    let mut count = 0u64;
    for i in 0..p.num_entries {
        let e = mem.i64_at(p.entries + 8 * i)?;
        if e < 0 {
            continue;
        }
        let e = e as u64;
        if e >= p.limit {
            report(mem, &p.status, i)?;
            continue;
        }
        let owned = if p.mode == abi::KVS_RESOLVE_TOKENS {
            (placement.slot_owner(Slot(e)) == p.rank).then(|| placement.local_row(Slot(e)))
        } else {
            (placement.owner(LogicalPage(e)) == p.rank).then(|| placement.local(LogicalPage(e)).0)
        };
        if let Some(local) = owned {
            mem.bytes_mut(p.out_positions + 4 * count, 4)?
                .copy_from_slice(&(i as i32).to_le_bytes());
            mem.bytes_mut(p.out_local + 8 * count, 8)?
                .copy_from_slice(&(local as i64).to_le_bytes());
            count += 1;
        }
    }
    if p.num_entries > 0 {
        mem.set_u64(p.out_count, count)?;
    }
    Ok(())
}

fn scratch_rows(mem: &mut Arena, p: &abi::kvs_scratch_rows_params) -> Result<()> {
    let page_size = PAGE_SIZE as u64;
    for i in 0..p.num_slots {
        let slot = mem.i64_at(p.slots + 8 * i)?;
        let mut row = -1i64;
        if slot >= 0 {
            let page = slot as u64 / page_size;
            let scratch_page = if page < p.table_len {
                mem.i64_at(p.page_table + 8 * page)?
            } else {
                -1
            };
            // Bound the page before multiplying, so a huge table entry cannot wrap into range.
            let mapped =
                scratch_page >= 0 && (scratch_page as u64) < p.scratch_rows.div_ceil(page_size);
            let candidate = if mapped {
                scratch_page as u64 * page_size + slot as u64 % page_size
            } else {
                p.scratch_rows
            };
            if candidate < p.scratch_rows {
                row = candidate as i64;
            } else {
                report(mem, &p.status, i)?;
            }
        }
        mem.bytes_mut(p.out_rows + 8 * i, 8)?
            .copy_from_slice(&row.to_le_bytes());
    }
    Ok(())
}

/// `count` int64s at `addr`, or an error when they do not fit one allocation.
fn i64s_at(mem: &Arena, addr: u64, count: u64) -> Result<Vec<i64>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    let bytes = count
        .checked_mul(8)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Error::overflow(format!("bytes of {count} int64s")))?;
    Ok(super::i64s_from_bytes(mem.bytes(addr, bytes)?))
}

fn scratch_table(mem: &mut Arena, p: &abi::kvs_scratch_table_params) -> Result<()> {
    let pages = i64s_at(mem, p.pages, p.num_entries)?;
    let scratch = i64s_at(mem, p.scratch_pages, p.num_entries)?;
    let ok = |s: i64| s >= 0 && (s as u64) < p.trash_page;
    let len = usize::try_from(p.table_len)
        .ok()
        .and_then(|n| n.checked_mul(8))
        .ok_or_else(|| Error::overflow(format!("a table of {} int64s", p.table_len)))?;
    let mut table = Vec::with_capacity(len);
    for l in 0..p.table_len {
        // check::scratch_table bounds table_len and trash_page to int64.
        let page = l as i64;
        // The kernel's lower bound, step for step.
        let (mut lo, mut hi) = (0usize, pages.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if pages[mid] < page {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let out = match (pages.get(lo), scratch.get(lo)) {
            (Some(&found), Some(&s)) if found == page && ok(s) => s,
            _ => p.trash_page as i64,
        };
        table.extend_from_slice(&out.to_le_bytes());
    }
    if len > 0 {
        mem.bytes_mut(p.table, len)?.copy_from_slice(&table);
    }
    for (i, (&page, &s)) in pages.iter().zip(&scratch).enumerate() {
        let unsorted = i > 0 && page <= pages[i - 1];
        if page < 0 || page as u64 >= p.table_len || unsorted || !ok(s) {
            report(mem, &p.status, i as u64)?;
        }
    }
    Ok(())
}

fn write_rows(mem: &mut Arena, p: &abi::kvs_write_rows_params) -> Result<()> {
    let placement = Placement::new(p.shard)?;
    let mut rows = Vec::new();
    for i in 0..p.num_slots {
        let slot = mem.i64_at(p.slots + 8 * i)?;
        let mut target = None;
        if slot >= 0 {
            let slot = Slot(slot as u64);
            let bad = slot.0 >= p.slot_limit || placement.is_reserved(slot.page());
            let owned = !bad && placement.slot_owner(slot) == p.rank;
            let row = placement.local_row(slot);
            if bad || (owned && row >= p.dst_rows) {
                report(mem, &p.status, i)?;
            } else if owned {
                target = Some(row);
            }
        }
        rows.push(target);
    }
    for k in 0..u64::from(p.num_pairs) {
        let pair = mem.pair(p.pairs, k)?;
        if pair.component >= p.num_components {
            report(mem, &p.status, p.num_slots + k)?;
            continue;
        }
        let c = p.components[pair.component as usize];
        for (token, row) in rows.iter().enumerate() {
            let Some(row) = *row else { continue };
            let token = token as u64;
            if c.kind == abi::KVS_ROWS_INDEXER {
                let (page, block) = (PAGE_SIZE as u64, INDEXER_PAGE_BYTES as u64);
                let src_block = pair.src + (token / page) * block;
                let dst_block = pair.dst + (row / page) * block;
                let key = INDEXER_HEAD_DIM as u64;
                mem.copy(
                    dst_block + (row % page) * key,
                    src_block + (token % page) * key,
                    INDEXER_HEAD_DIM,
                )?;
                let scales = INDEXER_SCALES_OFFSET as u64;
                mem.copy(
                    dst_block + scales + 4 * (row % page),
                    src_block + scales + 4 * (token % page),
                    4,
                )?;
            } else {
                let r = u64::from(c.row_bytes);
                mem.copy(
                    pair.dst + row * r,
                    pair.src + token * r,
                    c.row_bytes as usize,
                )?;
            }
        }
    }
    Ok(())
}

fn copy_ranges(mem: &mut Arena, p: &abi::kvs_copy_ranges_params) -> Result<()> {
    for r in 0..p.num_ranges {
        let at = p.ranges + 24 * r;
        let (src, dst, bytes) = (mem.u64_at(at)?, mem.u64_at(at + 8)?, mem.u64_at(at + 16)?);
        // The kernel counts a range's vectors in 32 bits: longer ranges are skipped and
        // reported there, so here too, whatever this host could copy.
        if bytes > abi::KVS_COPY_RANGE_MAX_BYTES {
            report(mem, &p.status, r)?;
            continue;
        }
        let bytes = usize::try_from(bytes)
            .map_err(|_| Error::overflow(format!("range {r} of {bytes} bytes")))?;
        mem.copy(dst, src, bytes)?;
    }
    Ok(())
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn address_space(&self) -> AddressSpace {
        AddressSpace::Cpu(self.arena)
    }

    fn max_threads(&self, family: KernelFamily) -> u32 {
        super::compiled_max_threads(family)
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
        let word = {
            let d = self.drain()?;
            if !lock(&self.status).has_pending() {
                return Ok(());
            }
            match &self.status_word {
                Some(word) => d.arena.u64_at(word.addr())?,
                None => 0,
            }
        };
        sweep();
        lock(&self.status).check(word)
    }

    fn record(&self) -> Result<Event> {
        let d = self.dev();
        let s = &d.streams[self.stream];
        Ok(Event(EventInner::Cpu {
            arena: self.arena,
            stream: self.stream as u64,
            seq: s.enqueued,
            progress: s.progress.clone(),
            at: None,
        }))
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
        let d = self.dev();
        let s = &d.streams[self.stream];
        Ok(Event(EventInner::Cpu {
            arena: self.arena,
            stream: self.stream as u64,
            seq: s.enqueued,
            progress: s.progress.clone(),
            at: Some(at),
        }))
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
        p.status = self.begin("kvs_quantize_latent");
        self.run(move |mem| quantize_latent(mem, &p))
    }

    unsafe fn quantize_indexer(&self, mut p: abi::kvs_quantize_indexer_params) -> Result<()> {
        check::quantize_indexer(&p)?;
        p.status = self.begin("kvs_quantize_indexer");
        self.run(move |mem| quantize_indexer(mem, &p))
    }

    unsafe fn resolve(&self, mut p: abi::kvs_resolve_params) -> Result<()> {
        check::resolve(&p)?;
        p.status = self.begin(super::resolve_kernel(&p).name());
        self.run(move |mem| resolve(mem, &p))
    }

    unsafe fn scratch_rows(&self, mut p: abi::kvs_scratch_rows_params) -> Result<()> {
        p.status = self.begin("kvs_scratch_rows");
        self.run(move |mem| scratch_rows(mem, &p))
    }

    unsafe fn scratch_table(&self, mut p: abi::kvs_scratch_table_params) -> Result<()> {
        check::scratch_table(&p)?;
        if p.table_len == 0 && p.num_entries == 0 {
            return Ok(());
        }
        p.status = self.begin("kvs_scratch_table");
        self.run(move |mem| scratch_table(mem, &p))
    }

    unsafe fn copy_blocks(&self, mut p: abi::kvs_copy_blocks_params, launch: Launch) -> Result<()> {
        check::copy_blocks(&p)?;
        launch.validate(self.max_threads(KernelFamily::Copy))?;
        if p.num_pages == 0 || p.num_pairs == 0 {
            return Ok(());
        }
        p.status = self.begin("kvs_copy_blocks");
        self.enqueue(Op::Blocks {
            p: Box::new(p),
            next: 0,
        })
    }

    unsafe fn write_rows(&self, mut p: abi::kvs_write_rows_params, launch: Launch) -> Result<()> {
        check::write_rows(&p)?;
        launch.validate(self.max_threads(KernelFamily::WriteRows))?;
        p.status = self.begin("kvs_write_rows");
        self.run(move |mem| write_rows(mem, &p))
    }

    unsafe fn copy_ranges(&self, mut p: abi::kvs_copy_ranges_params, launch: Launch) -> Result<()> {
        launch.validate(self.max_threads(KernelFamily::Copy))?;
        if p.num_ranges == 0 {
            return Ok(());
        }
        p.status = self.begin("kvs_copy_ranges");
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
