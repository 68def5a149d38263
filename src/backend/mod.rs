//! Execution backends: where bytes live and how kernels run.
//!
//! Both backends speak the kernel ABI of `cuda/abi.h` directly: a kernel's parameter struct,
//! with its addresses, means the same thing to the CUDA kernel ([`cuda::CudaBackend`]) and to
//! its CPU twin ([`cpu::CpuBackend`]), which keeps its allocations in an address space of its
//! own. So one plan, turned into one set of parameter structs, runs on either, and tests
//! compare the bytes.
//!
//! Every [`Buffer`] knows the [`AddressSpace`] it belongs to, and everything that hands a buffer
//! to a backend checks it belongs to that backend's space ([`Backend::check`]): a buffer of one
//! CPU backend, or of another GPU, is refused rather than read as an unrelated address.
//!
//! The kernel entry points are `unsafe`: they take raw addresses (that is what engines hand
//! us). The safe layers above (pools, the copy layer, transfers, HiCache) validate every index
//! and size first and build the parameters from memory they hold.
//!
//! Nothing a backend does synchronizes its stream unless the method's name ends in `_sync` or
//! is [`Backend::synchronize`] ([`sync_counts`] counts those waits), and nothing synchronizes
//! the whole device. Memory is freed only after the work kvshard queued on it has
//! completed, and no free waits on the caller's thread (device memory from a stream-ordered
//! pool, the other frees on kvshard's reaper thread: `gpu::memory`); work kvshard queues on one
//! stream waits for the conflicting work it queued on others ([`Usage`]).

mod check;
pub mod cpu;
pub mod cuda;
mod status;
mod upload;
mod usage;

pub(crate) use crate::gpu::sync_count::count_host_sync;
pub use crate::gpu::sync_count::{sync_counts, SyncCounts};
pub(crate) use upload::upload_i64s_sync as upload_reused_sync;
// The storage tier's host accesses (feature `nixl`) wait for the work queued on their pages.
#[cfg(feature = "nixl")]
pub(crate) use usage::host_conflicts;
pub(crate) use usage::{kept, ordered, ordered_event, ordered_pages, sweep, Pages};
pub use usage::{pending_frees, wait_for_frees_sync, StreamId, Usage};

use std::fmt;
use std::sync::Arc;

use crate::abi;
use crate::error::{Error, Result};
use crate::gpu::{kernels, KernelFn, PooledEvent};

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Device memory (HBM).
    Device,
    /// Pinned host memory the device can read and write directly.
    PinnedHost,
}

/// The address space a buffer's address means something in: one CPU backend's arena (shared by
/// its streams), or one GPU (shared by every stream and context handle of that device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressSpace {
    /// The arena of a [`cpu::CpuBackend`] and the streams made from it.
    Cpu(u64),
    /// CUDA device `ordinal` (its device memory and the device aliases of pinned host memory).
    Cuda(usize),
    /// Memory of another process, possibly on another host, that only a transfer engine
    /// reaches (a NIXL peer's pool): no backend runs in it, so every kernel and copy refuses it
    /// ([`Error::ForeignMemory`]). Each such destination gets an id of its own.
    Remote(u64),
}

impl fmt::Display for AddressSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu(id) => write!(f, "CPU backend arena {id}"),
            Self::Cuda(ordinal) => write!(f, "CUDA device {ordinal}"),
            Self::Remote(id) => write!(f, "remote memory {id}"),
        }
    }
}

/// A range of backend memory: an address kernels use, a length, the address space it belongs
/// to, and its [`Usage`]: the work queued on it and (for memory kvshard allocated) a share of
/// the allocation, which is freed only once the last share is gone and that work has completed.
#[derive(Clone)]
pub struct Buffer {
    addr: u64,
    len: usize,
    kind: MemoryKind,
    space: AddressSpace,
    usage: Usage,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("space", &self.space)
            .field("usage", &self.usage)
            .finish()
    }
}

impl Buffer {
    pub(crate) fn owned(
        addr: u64,
        len: usize,
        kind: MemoryKind,
        space: AddressSpace,
        owner: Arc<dyn Send + Sync>,
    ) -> Self {
        Self {
            addr,
            len,
            kind,
            space,
            usage: Usage::new(Some(Box::new(owner))),
        }
    }

    /// This buffer's range, tracked by `usage` instead of its own record: a space shares one
    /// record among all of its buffers, and `usage` keeps this buffer's memory alive.
    pub(crate) fn tracked_by(&self, usage: &Usage) -> Buffer {
        Buffer {
            usage: usage.clone(),
            ..self.clone()
        }
    }

    /// The record of the work queued on this buffer's memory.
    pub fn usage(&self) -> &Usage {
        &self.usage
    }

    /// Wraps memory kvshard does not own (an engine's device buffers, say) in `space` (a
    /// backend's [`Backend::address_space`]).
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory of `space` (a device address or device alias for
    /// CUDA) that stays valid while the buffer and any work using it are alive.
    pub unsafe fn from_raw(addr: u64, len: usize, kind: MemoryKind, space: AddressSpace) -> Self {
        Self {
            addr,
            len,
            kind,
            space,
            usage: Usage::new(None),
        }
    }

    /// The address kernels use (device address or device alias).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The address space the buffer belongs to.
    pub fn space(&self) -> AddressSpace {
        self.space
    }

    /// The sub-range `[offset, offset + len)`, sharing this buffer's allocation.
    pub fn slice(&self, offset: usize, len: usize) -> Result<Buffer> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(Buffer {
                addr: self.addr + offset as u64,
                len,
                kind: self.kind,
                space: self.space,
                usage: self.usage.clone(),
            }),
            _ => Err(Error::InvalidArgument(format!(
                "slice [{offset}, {offset}+{len}) of a {}-byte buffer",
                self.len
            ))),
        }
    }

    /// Address of byte `offset`, checked against the length.
    pub fn at(&self, offset: usize) -> Result<u64> {
        if offset > self.len {
            return Err(Error::OutOfRange {
                what: "buffer offset",
                index: i64::try_from(offset).unwrap_or(i64::MAX),
                limit: self.len as u64 + 1,
            });
        }
        Ok(self.addr + offset as u64)
    }
}

/// A point in a backend's stream that other streams of the same device can wait for. Two
/// events are equal when they are the same point of the same stream (clones of one record).
#[derive(Debug, Clone)]
pub struct Event(EventInner);

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (
                EventInner::Cpu {
                    arena, stream, seq, ..
                },
                EventInner::Cpu {
                    arena: a,
                    stream: s,
                    seq: q,
                    ..
                },
            ) => (arena, stream, seq) == (a, s, q),
            (EventInner::Cuda { event: a, .. }, EventInner::Cuda { event: b, .. }) => {
                Arc::ptr_eq(a, b)
            }
            _ => false,
        }
    }
}

impl Event {
    /// An event that never completes: what stands for work whose own event could not be
    /// recorded, so the memory it uses is never freed under it.
    pub(crate) fn never() -> Event {
        Event(EventInner::Cpu {
            arena: u64::MAX,
            stream: u64::MAX,
            seq: u64::MAX,
            progress: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            at: None,
        })
    }

    /// The stream the event was recorded on.
    pub fn stream_id(&self) -> StreamId {
        match &self.0 {
            EventInner::Cpu { arena, stream, .. } => StreamId::Cpu {
                arena: *arena,
                stream: *stream,
            },
            EventInner::Cuda { stream, .. } => StreamId::Cuda(*stream),
        }
    }

    /// Whether the work before the event has completed, asked without waiting. A CUDA error
    /// (a context whose work failed for good) is returned as it is.
    pub fn is_complete(&self) -> Result<bool> {
        match &self.0 {
            EventInner::Cpu { progress, seq, .. } => {
                Ok(progress.load(std::sync::atomic::Ordering::Acquire) >= *seq)
            }
            EventInner::Cuda { event, .. } => event
                .try_is_complete()
                .map_err(Error::driver("cuEventQuery")),
        }
    }
}

#[derive(Debug, Clone)]
enum EventInner {
    /// The CPU backend: operation `seq` of stream `stream` of arena `arena`; a timed event also
    /// holds when the stream reached it, stamped by an operation of its own. `progress` is how
    /// many operations the stream has run, so completion is known without the arena's lock.
    Cpu {
        arena: u64,
        stream: u64,
        seq: u64,
        progress: Arc<std::sync::atomic::AtomicU64>,
        at: Option<Arc<std::sync::OnceLock<std::time::Instant>>>,
    },
    /// A CUDA event, and the stream (by its handle) it was recorded on.
    Cuda {
        event: Arc<PooledEvent>,
        stream: u64,
    },
}

/// Grid shape of a copy kernel: transfers share SMs with the forward pass, so the caller picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Launch {
    /// CTAs.
    pub ctas: u32,
    /// Threads per CTA (a multiple of 32; at most what the kernel was compiled for, which
    /// [`Backend::max_threads`] says).
    pub threads: u32,
}

impl Launch {
    /// `ctas` CTAs of as many threads as `backend`'s copy kernels take (1024 on the H200):
    /// the shape for host I/O, where bytes in flight per CTA decide the bandwidth.
    pub fn host_io(backend: &dyn Backend, ctas: u32) -> Self {
        Self {
            ctas,
            threads: backend.max_threads(KernelFamily::Copy),
        }
    }

    /// Checks the shape a kernel of at most `max_threads` threads per CTA can take
    /// ([`Backend::max_threads`] on a device; `abi::KVS_COPY_THREADS` before one is open):
    /// 1 to [`Launch::MAX_CTAS`] CTAs, a multiple of 32 threads, at most `max_threads`. Every
    /// launch is checked so; an engine checks a configured shape up front.
    pub fn validate(&self, max_threads: u32) -> Result<()> {
        if self.ctas == 0
            || self.ctas > Self::MAX_CTAS
            || self.threads == 0
            || self.threads % 32 != 0
            || self.threads > max_threads
        {
            return Err(Error::InvalidArgument(format!(
                "launch of {} CTAs x {} threads (need 1 to {} CTAs, a multiple of 32 threads, at most {max_threads})",
                self.ctas,
                self.threads,
                Self::MAX_CTAS
            )));
        }
        Ok(())
    }

    /// Most CTAs a launch takes: CUDA's largest grid (`2^31 - 1` blocks in x).
    pub const MAX_CTAS: u32 = i32::MAX as u32;
}

/// The kernel families a launch shape is chosen for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// `kvs_copy_blocks` and `kvs_copy_ranges`.
    Copy,
    /// `kvs_write_rows`.
    WriteRows,
    /// `kvs_decode_scatter`.
    DecodeScatter,
}

/// A plain 2D copy: `height` rows of `width` bytes, rows `src_pitch` / `dst_pitch` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Copy2d {
    /// Destination address of the first row.
    pub dst: u64,
    /// Bytes between destination rows.
    pub dst_pitch: u64,
    /// Source address of the first row.
    pub src: u64,
    /// Bytes between source rows.
    pub src_pitch: u64,
    /// Bytes per row.
    pub width: u64,
    /// Rows.
    pub height: u64,
}

/// A backend: memory, ordering, the kernels and the copy engine.
///
/// Work is ordered as enqueued on the backend's stream; [`Backend::synchronize`] waits for it
/// and reports any input a kernel rejected since the last check. Methods whose names end in
/// `_sync` wait for the stream too; no other method does.
pub trait Backend: Send + Sync {
    /// Short name ("cpu", "cuda").
    fn name(&self) -> &'static str;

    /// The stream this backend enqueues on.
    fn stream_id(&self) -> StreamId;

    /// The address space this backend's buffers belong to.
    fn address_space(&self) -> AddressSpace;

    /// Most threads per CTA the kernels of `family` may be launched with on this device.
    fn max_threads(&self, family: KernelFamily) -> u32;

    /// Checks `buffer` belongs to this backend's address space; `what` names it in the error.
    fn check(&self, buffer: &Buffer, what: &str) -> Result<()> {
        check_space(self.address_space(), buffer.space(), what)
    }

    /// Allocates `len` bytes; contents are unspecified. Running out is
    /// [`Error::OutOfMemory`], never an abort. On CUDA, device memory comes from kvshard's
    /// stream-ordered pool (freed with `cuMemFreeAsync`, which never waits) and pinned host
    /// memory from `cuMemHostAlloc` (freed on kvshard's reaper thread).
    fn alloc(&self, len: usize, kind: MemoryKind) -> Result<Buffer>;

    /// Allocates `len` bytes of device memory that other libraries can register or share by
    /// its address: on CUDA from `cuMemAlloc`, which legacy CUDA IPC (`cuIpcGetMemHandle`),
    /// UCX's `cuda_ipc` (NIXL's VRAM transport) and GPUDirect RDMA and Storage take, and
    /// memory of a stream-ordered pool ([`Backend::alloc`]'s) is not. Its free may wait for
    /// the whole device, the driver's choice: kvshard makes it on its reaper thread, never the
    /// dropping one, but the engine's own CUDA calls may wait behind it. Elsewhere, the same as
    /// [`Backend::alloc`] of device memory.
    fn alloc_registrable(&self, len: usize) -> Result<Buffer> {
        self.alloc(len, MemoryKind::Device)
    }

    /// Copies `data` into `dst` at `offset` after prior work, and waits for it.
    fn write_sync(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()>;

    /// Enqueues a copy of `data` into `dst` at `offset`, ordered after prior work, without
    /// waiting for the stream: `data` has been staged when this returns and may be reused.
    fn enqueue_write(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()>;

    /// Reads `len` bytes of `src` at `offset` after prior work, waiting for it.
    fn read_sync(&self, src: &Buffer, offset: usize, len: usize) -> Result<Vec<u8>>;

    /// Sets every byte of `dst` to `byte` (stream-ordered).
    fn fill(&self, dst: &Buffer, byte: u8) -> Result<()>;

    /// Waits for all enqueued work, then reports the first input any kernel rejected.
    fn synchronize(&self) -> Result<()>;

    /// The process address of `[addr, addr + len)` of this backend's memory where the host
    /// reaches it as plain memory (the CPU twin's arena), `None` where it does not (device
    /// memory): what a storage tier copies host pages through. Accessing it is outside the
    /// stream order: the caller orders it with the stream's work, as a DMA engine would.
    fn host_view(&self, addr: u64, len: usize) -> Result<Option<usize>> {
        let _ = (addr, len);
        Ok(None)
    }

    /// Records an event at the current point of the stream.
    fn record(&self) -> Result<Event>;

    /// Records an event that also marks a time, for [`Backend::elapsed_ms`].
    fn record_timed(&self) -> Result<Event>;

    /// Milliseconds between two timed events of this device, once both have completed.
    fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f64>;

    /// Makes later work wait for `event` (recorded on any stream of the same device).
    fn wait(&self, event: &Event) -> Result<()>;

    /// Whether the work before `event` has finished.
    fn is_done(&self, event: &Event) -> Result<bool>;

    /// Blocks the calling thread until the work before `event` has finished.
    fn wait_event_sync(&self, event: &Event) -> Result<()>;

    /// Makes later work wait until the u32 counter at `addr` reaches `value` (wrapping compare).
    ///
    /// # Safety
    /// `addr` must be a 4-byte aligned address of this backend valid until the wait is over.
    unsafe fn wait_counter(&self, addr: u64, value: u32) -> Result<()>;

    /// `kvs_quantize_latent`.
    ///
    /// # Safety
    /// Every address in `p` must be valid for the kernel's documented accesses until the
    /// launch completes.
    unsafe fn quantize_latent(&self, p: abi::kvs_quantize_latent_params) -> Result<()>;

    /// `kvs_quantize_indexer`.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn quantize_indexer(&self, p: abi::kvs_quantize_indexer_params) -> Result<()>;

    /// `kvs_resolve`; `tile_state` must hold [`resolve_state_bytes`] bytes.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn resolve(&self, p: abi::kvs_resolve_params) -> Result<()>;

    /// `kvs_scratch_rows`.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn scratch_rows(&self, p: abi::kvs_scratch_rows_params) -> Result<()>;

    /// `kvs_scratch_table`.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn scratch_table(&self, p: abi::kvs_scratch_table_params) -> Result<()>;

    /// `kvs_copy_blocks` with the given grid.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn copy_blocks(&self, p: abi::kvs_copy_blocks_params, launch: Launch) -> Result<()>;

    /// `kvs_copy_blocks_inline` with the given grid: [`Backend::copy_blocks`] with the pair
    /// table and page ids carried in `p` itself (no upload); table offsets that fall outside
    /// it are refused with [`Error::InvalidArgument`] before anything is enqueued.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn copy_blocks_inline(
        &self,
        p: &abi::kvs_copy_blocks_inline_params,
        launch: Launch,
    ) -> Result<()>;

    /// `kvs_write_rows` with the given grid.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn write_rows(&self, p: abi::kvs_write_rows_params, launch: Launch) -> Result<()>;

    /// `kvs_decode_scatter` with the given grid: one prefill rank's chunk into the rows of every
    /// rank of a decode server sharded by token (docs/dcp.md).
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn decode_scatter(
        &self,
        p: abi::kvs_decode_scatter_params,
        launch: Launch,
    ) -> Result<()>;

    /// `kvs_copy_ranges` with the given grid. A range longer than
    /// [`abi::KVS_COPY_RANGE_MAX_BYTES`] is skipped and reported: the next
    /// [`Backend::synchronize`] fails with [`Error::KernelRejected`] naming its position.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn copy_ranges(&self, p: abi::kvs_copy_ranges_params, launch: Launch) -> Result<()>;

    /// Copy-engine copy of `len` contiguous bytes.
    ///
    /// # Safety
    /// Both ranges must be valid memory of this backend until the copy completes.
    unsafe fn memcpy(&self, dst: u64, src: u64, len: usize) -> Result<()>;

    /// Copy-engine 2D copy.
    ///
    /// # Safety
    /// Every row of both sides must be valid memory of this backend until the copy completes.
    unsafe fn memcpy_2d(&self, copy: &Copy2d) -> Result<()>;

    /// One copy-engine batch call moving every range (`cudaMemcpyBatchAsync`).
    ///
    /// # Safety
    /// Every range must be valid memory of this backend until the copy completes.
    unsafe fn memcpy_batch(&self, ranges: &[abi::kvs_range]) -> Result<()>;
}

/// Checks memory of address space `owner` may be used by a backend of space `user`.
pub(crate) fn check_space(user: AddressSpace, owner: AddressSpace, what: &str) -> Result<()> {
    if user != owner {
        return Err(Error::ForeignMemory {
            what: what.to_string(),
            owner: owner.to_string(),
            user: user.to_string(),
        });
    }
    Ok(())
}

/// Units `kvs_write_rows` splits a write of `slots` tokens over `pairs` layer pairs into.
pub fn write_units(slots: u64, pairs: u32) -> u64 {
    slots
        .div_ceil(u64::from(abi::KVS_WRITE_GROUP))
        .saturating_mul(u64::from(pairs.div_ceil(abi::KVS_WRITE_PAIR_BLOCK)))
}

/// The `kvs_resolve` kernel for `p`: one per entry kind and shard-size class (cuda/resolve.cu
/// says why). The CPU twin reports errors under the same name.
pub(crate) fn resolve_kernel(p: &abi::kvs_resolve_params) -> KernelFn<abi::kvs_resolve_params> {
    match (p.mode == abi::KVS_RESOLVE_TOKENS, p.shard.is_power_of_two()) {
        (true, true) => kernels::RESOLVE_TOKENS_POW2,
        (true, false) => kernels::RESOLVE_TOKENS,
        (false, true) => kernels::RESOLVE_PAGES_POW2,
        (false, false) => kernels::RESOLVE_PAGES,
    }
}

/// The `kvs_decode_scatter` kernel for `p` (checked by `check::decode_scatter`): a direct
/// launch takes the pages kernel where the layout keeps pages whole, else the rows kernel of the
/// launch's latent rows; a packing or unpacking one the pack or unpack kernel of those rows
/// (cuda/decode_scatter.cu says why there are ten). The CPU twin reports errors under the
/// same name.
pub(crate) fn decode_scatter_kernel(
    p: &abi::kvs_decode_scatter_params,
) -> KernelFn<abi::kvs_decode_scatter_params> {
    let page_granular =
        p.num_ranks == 1 || u64::from(p.interleave) % crate::geometry::PAGE_SIZE as u64 == 0;
    if p.mode == abi::KVS_DECODE_DIRECT && page_granular {
        return kernels::DECODE_SCATTER_PAGES;
    }
    let latent = p.components[..(p.num_components as usize).min(p.components.len())]
        .iter()
        .find(|c| c.kind == abi::KVS_ROWS_LATENT)
        .map(|c| c.row_bytes);
    // By the latent rows: 576 bytes, or a launch of indexer components only (every rows kernel
    // moves those).
    let [rows_576, rows_656, rows_1152] = match p.mode {
        abi::KVS_DECODE_PACK => [
            kernels::DECODE_PACK_ROWS_576,
            kernels::DECODE_PACK_ROWS_656,
            kernels::DECODE_PACK_ROWS_1152,
        ],
        abi::KVS_DECODE_UNPACK => [
            kernels::DECODE_UNPACK_ROWS_576,
            kernels::DECODE_UNPACK_ROWS_656,
            kernels::DECODE_UNPACK_ROWS_1152,
        ],
        _ => [
            kernels::DECODE_SCATTER_ROWS_576,
            kernels::DECODE_SCATTER_ROWS_656,
            kernels::DECODE_SCATTER_ROWS_1152,
        ],
    };
    match latent {
        Some(abi::KVS_LATENT_SCALED_ROW_BYTES) => rows_656,
        Some(abi::KVS_LATENT_BF16_ROW_BYTES) => rows_1152,
        _ => rows_576,
    }
}

/// Tiles (one CTA each) `kvs_resolve` uses for `entries` entries.
pub fn resolve_tiles(entries: u64) -> u64 {
    entries.div_ceil(u64::from(abi::KVS_RESOLVE_TILE))
}

/// Nodes per tree of the tile state `kvs_resolve` needs for up to `entries` entries: one per
/// tile, rounded up to whole 128-byte lines (the two trees interleave by lines).
pub fn resolve_state_tiles(entries: u64) -> u64 {
    resolve_tiles(entries).next_multiple_of(u64::from(abi::KVS_RESOLVE_LINE_NODES))
}

/// Bytes of tile state `kvs_resolve` needs for up to `entries` entries: two trees of
/// [`resolve_state_tiles`] uint64 nodes.
pub fn resolve_state_bytes(entries: u64) -> u64 {
    2 * 8 * resolve_state_tiles(entries)
}

/// Reads little-endian i64s from bytes.
pub fn i64s_from_bytes(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

/// Little-endian bytes of i64s.
pub fn i64s_to_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Uploads `values` into a new device buffer of `backend`, waiting for the copy (its one use
/// is set-up: per-call uploads go through a reused table, see `copy::TableStore`).
pub fn upload_i64s_sync(backend: &dyn Backend, values: &[i64]) -> Result<Buffer> {
    let bytes = crate::error::Checked::mul_or(values.len(), 8, || {
        format!("bytes of {} int64s", values.len())
    })?;
    let buf = backend.alloc(bytes, MemoryKind::Device)?;
    backend.write_sync(&buf, 0, &i64s_to_bytes(values))?;
    Ok(buf)
}

/// Threads per CTA each kernel family is compiled for (`cuda/abi.h`): what the CPU twin
/// accepts, so a launch shape valid there is valid on every embedded architecture.
pub(crate) fn compiled_max_threads(family: KernelFamily) -> u32 {
    match family {
        KernelFamily::Copy => abi::KVS_COPY_THREADS,
        KernelFamily::WriteRows => abi::KVS_WRITE_THREADS,
        KernelFamily::DecodeScatter => abi::KVS_COPY_THREADS,
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::gpu::Gpu;

    /// The CPU backend, and the CUDA one where a GPU opens (else the test says it skipped the
    /// GPU, or fails where `KVSHARD_REQUIRE_GPU` is set).
    fn twins(test: &str) -> Vec<Arc<dyn Backend>> {
        let mut backends: Vec<Arc<dyn Backend>> = vec![Arc::new(cpu::CpuBackend::new())];
        match Gpu::open(0).and_then(cuda::CudaBackend::new) {
            Ok(gpu) => backends.push(Arc::new(gpu)),
            Err(why) => {
                assert!(
                    std::env::var_os("KVSHARD_REQUIRE_GPU").is_none(),
                    "KVSHARD_REQUIRE_GPU is set but no GPU is usable: {why}"
                );
                let _ = writeln!(std::io::stderr(), "SKIPPED {test} on the GPU: {why}");
            }
        }
        backends
    }

    /// One launch of each block-copy kernel over the same copy: two layer pairs of 2-row blocks
    /// (64 bytes), source pages [3, 0, 2, 1] to destination pages [5, 7, -1, 0] of 6: entry 1
    /// is out of range (reported, skipped) and entry 2 padding. Returns what each left in the
    /// poisoned destination and what the synchronize said.
    fn block_copy_twins(backend: &dyn Backend) -> Vec<(Vec<u8>, Result<()>)> {
        let (block, src_pages, dst_pages) = (64u64, 4u64, 6u64);
        let src = backend
            .alloc((2 * src_pages * block) as usize, MemoryKind::Device)
            .unwrap();
        let dst = backend
            .alloc((2 * dst_pages * block) as usize, MemoryKind::Device)
            .unwrap();
        let data: Vec<u8> = (0..src.len()).map(|i| (i * 13 + 1) as u8).collect();
        backend.write_sync(&src, 0, &data).unwrap();
        let pairs = [
            (src.addr(), dst.addr(), 0u32, 0u32),
            (
                src.addr() + src_pages * block,
                dst.addr() + dst_pages * block,
                0,
                1,
            ),
        ];
        let mut table: Vec<u8> = Vec::new();
        for (s, d, component, signal) in pairs {
            table.extend(s.to_le_bytes());
            table.extend(d.to_le_bytes());
            table.extend(component.to_le_bytes());
            table.extend(signal.to_le_bytes());
        }
        let src_at = table.len() as u64;
        table.extend(i64s_to_bytes(&[3, 0, 2, 1]));
        let dst_at = table.len() as u64;
        table.extend(i64s_to_bytes(&[5, 7, -1, 0]));
        let side = abi::kvs_block_side {
            page_stride: block,
            row_stride: block / 2,
        };
        let mut components = [abi::kvs_block_component::default(); 4];
        components[0] = abi::kvs_block_component {
            rows: 2,
            row_bytes: (block / 2) as u32,
            src: side,
            dst: side,
        };
        let list = |ids, limit| abi::kvs_page_list {
            ids,
            limit,
            kind: abi::KVS_INDEX_LOCAL,
            ..Default::default()
        };
        let params = |tables: u64| abi::kvs_copy_blocks_params {
            components,
            pairs: tables,
            num_pages: 4,
            src_pages: list(tables + src_at, src_pages),
            dst_pages: list(tables + dst_at, dst_pages),
            num_pairs: 2,
            num_components: 1,
            ..Default::default()
        };
        let launch = Launch {
            ctas: 2,
            threads: 64,
        };
        let uploaded = backend.alloc(table.len(), MemoryKind::Device).unwrap();
        backend.write_sync(&uploaded, 0, &table).unwrap();
        let mut inline = abi::kvs_copy_blocks_inline_params {
            copy: params(0),
            ..Default::default()
        };
        for (word, b) in inline.table.iter_mut().zip(table.chunks_exact(8)) {
            *word = u64::from_le_bytes(b.try_into().unwrap());
        }
        let mut out = Vec::new();
        for uploaded_tables in [true, false] {
            backend.fill(&dst, 0xEE).unwrap();
            // SAFETY: every address is inside `src`, `dst` or the table, all alive past the
            // synchronize below; the bad entry is skipped before its page is addressed.
            unsafe {
                if uploaded_tables {
                    backend.copy_blocks(params(uploaded.addr()), launch)
                } else {
                    backend.copy_blocks_inline(&inline, launch)
                }
            }
            .unwrap();
            let said = backend.synchronize();
            out.push((backend.read_sync(&dst, 0, dst.len()).unwrap(), said));
        }
        out
    }

    #[test]
    fn gpu_copy_blocks_inline_moves_and_reports_what_copy_blocks_does() {
        for backend in twins("gpu_copy_blocks_inline_moves_and_reports_what_copy_blocks_does") {
            let runs = block_copy_twins(backend.as_ref());
            // Entries 0 (3 -> 5) and 3 (1 -> 0) move, in both layers; the rest stays poisoned.
            let (block, src_pages, dst_pages) = (64usize, 4usize, 6usize);
            let data: Vec<u8> = (0..2 * src_pages * block)
                .map(|i| (i * 13 + 1) as u8)
                .collect();
            let mut expect = vec![0xEE; 2 * dst_pages * block];
            for layer in 0..2 {
                for (s, d) in [(3, 5), (1, 0)] {
                    let from = (layer * src_pages + s) * block;
                    let to = (layer * dst_pages + d) * block;
                    expect[to..to + block].copy_from_slice(&data[from..from + block]);
                }
            }
            for ((bytes, said), kernel) in runs
                .into_iter()
                .zip(["kvs_copy_blocks", "kvs_copy_blocks_inline"])
            {
                assert!(
                    bytes == expect,
                    "{} {kernel}: the bytes differ",
                    backend.name()
                );
                match said {
                    Err(Error::KernelRejected {
                        kernel: k,
                        position: 1,
                    }) if k == kernel => {}
                    other => panic!(
                        "{} {kernel}: entry 1 was not reported: {other:?}",
                        backend.name()
                    ),
                }
            }
        }
    }

    #[test]
    fn inline_table_offsets_outside_the_table_are_refused_before_anything_runs() {
        let backend = cpu::CpuBackend::new();
        let table = u64::from(abi::KVS_COPY_INLINE_BYTES);
        let mut components = [abi::kvs_block_component::default(); 4];
        components[0] = abi::kvs_block_component {
            rows: 1,
            row_bytes: 16,
            ..Default::default()
        };
        let list = |ids| abi::kvs_page_list {
            ids,
            limit: 1,
            kind: abi::KVS_INDEX_LOCAL,
            ..Default::default()
        };
        let launch = Launch {
            ctas: 1,
            threads: 32,
        };
        // Pairs past the end, ids past the end, an unaligned offset.
        for (pairs, src_ids, dst_ids) in [(table - 8, 0, 8), (0, 24, table - 8 + 1), (4, 24, 32)] {
            let p = abi::kvs_copy_blocks_inline_params {
                copy: abi::kvs_copy_blocks_params {
                    components,
                    pairs,
                    num_pages: 1,
                    src_pages: list(src_ids),
                    dst_pages: list(dst_ids),
                    num_pairs: 1,
                    num_components: 1,
                    ..Default::default()
                },
                ..Default::default()
            };
            // SAFETY: refused before anything is enqueued (what this test checks).
            match unsafe { backend.copy_blocks_inline(&p, launch) } {
                Err(Error::InvalidArgument(why)) => assert!(why.contains("inline"), "{why}"),
                other => panic!("offsets {pairs}/{src_ids}/{dst_ids} not refused: {other:?}"),
            }
        }
        backend.synchronize().unwrap();
    }

    #[test]
    fn copy_ranges_skips_and_reports_ranges_longer_than_the_kernel_takes() {
        let too_long = abi::KVS_COPY_RANGE_MAX_BYTES;
        for backend in twins("copy_ranges_skips_and_reports_ranges_longer_than_the_kernel_takes") {
            let data: Vec<u8> = (1..=64).collect();
            let src = backend.alloc(64, MemoryKind::Device).unwrap();
            let dst = backend.alloc(64, MemoryKind::Device).unwrap();
            backend.write_sync(&src, 0, &data).unwrap();
            backend.fill(&dst, 0xEE).unwrap();
            // A 16-byte aligned range, one 16 bytes too long (the vector path's length), an
            // unaligned range, and one a byte too long (the byte path's). The long ones start
            // inside the buffers too: only the bound keeps them from being copied.
            let ranges = [
                (0, 0, 16),
                (16, 16, too_long + 16),
                (32, 35, 5),
                (48, 48, too_long + 1),
            ];
            let table: Vec<u8> = ranges
                .iter()
                .flat_map(|&(s, d, bytes)| [src.addr() + s, dst.addr() + d, bytes])
                .flat_map(u64::to_le_bytes)
                .collect();
            let table_buffer = backend.alloc(table.len(), MemoryKind::Device).unwrap();
            backend.write_sync(&table_buffer, 0, &table).unwrap();
            let p = abi::kvs_copy_ranges_params {
                ranges: table_buffer.addr(),
                num_ranges: ranges.len() as u64,
                status: abi::kvs_status::default(),
            };
            let launch = Launch {
                ctas: 1,
                threads: 64,
            };
            // SAFETY: the two short ranges lie inside `src` and `dst`, which outlive the
            // synchronize below; the long ones are skipped before their addresses are read
            // (what this test checks).
            unsafe { backend.copy_ranges(p, launch) }.unwrap();
            match backend.synchronize() {
                Err(Error::KernelRejected {
                    kernel: "kvs_copy_ranges",
                    position: 1,
                }) => {}
                other => panic!(
                    "{}: the long ranges were not reported at position 1: {other:?}",
                    backend.name()
                ),
            }
            let mut expect = vec![0xEE; 64];
            expect[..16].copy_from_slice(&data[..16]);
            expect[35..40].copy_from_slice(&data[32..37]);
            assert_eq!(
                backend.read_sync(&dst, 0, 64).unwrap(),
                expect,
                "{}",
                backend.name()
            );
        }
    }
}
