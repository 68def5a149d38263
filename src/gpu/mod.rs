//! The CUDA runtime layer: one thin wrapper over cudarc's driver API (loaded at run time, so the
//! crate builds and runs its CPU paths with no CUDA installed).
//!
//! - [`Gpu`]: a device's primary context (the one PyTorch and other engines share), its
//!   properties, and the embedded kernel module loaded once;
//! - [`Stream`]: a stream kvshard owns, or one borrowed from the engine ([`Gpu::borrow_stream`]);
//! - [`memory`]: device allocations and pinned host memory with their driver-given device aliases;
//!   device memory comes from a stream-ordered pool of kvshard's (`mempool`), and every free that
//!   may wait for the device runs on kvshard's reaper thread (`reaper`), so no free waits on the
//!   caller's thread.
//!
//! Opening a device never panics: a missing driver, a missing GPU and a build without kernels
//! are each a typed [`Error`](crate::Error).

/// Reference loads for benchmarks (feature `bench-kernels`).
#[cfg(feature = "bench-kernels")]
pub mod bench;
mod device;
mod events;
pub mod memory;
pub(crate) mod mempool;
mod module;
pub(crate) mod reaper;
mod reuse;
mod stream;
pub(crate) mod sync_count;
pub mod topology;
pub mod vmm;

pub use device::{driver_present, embedded_archs, DeviceInfo, Gpu};
pub use events::PooledEvent;
pub use module::{kernels, Kernel, KernelFn, RESOURCE_USAGE};
pub use reuse::cached_bytes;
pub use stream::Stream;
