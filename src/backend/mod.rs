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

mod buffer;
mod check;
pub mod cpu;
pub mod cuda;
mod event;
mod interface;
mod launch;
mod status_word;
mod upload;
mod usage;

pub(crate) use crate::gpu::sync_count::count_host_sync;
pub use crate::gpu::sync_count::{sync_counts, SyncCounts};
pub(crate) use buffer::check_space;
pub use buffer::{AddressSpace, Buffer, MemoryKind};
pub use event::Event;
pub(crate) use event::EventInner;
pub use interface::{Backend, Copy2d};
pub(crate) use launch::{compiled_max_threads, decode_scatter_kernel, resolve_kernel};
pub use launch::{
    resolve_state_bytes, resolve_state_tiles, resolve_tiles, write_units, KernelFamily, Launch,
};
pub(crate) use upload::upload_reused_sync;
pub use upload::{enqueue_i64s, i64s_from_bytes, i64s_to_bytes, upload_i64s_sync};
// The storage tier's host accesses (feature `nixl`) wait for the work queued on their pages.
#[cfg(feature = "nixl")]
pub(crate) use usage::host_conflicts;
pub(crate) use usage::{kept, ordered, ordered_event, ordered_pages, sweep, Pages};
pub use usage::{pending_frees, wait_for_frees_sync, StreamId, Usage};
