//! Reference loads for benchmarks: what a transfer's speed is compared with or run against.
//! Only with feature `bench-kernels`, which also puts their kernels (`cuda/bench.cu`) into the
//! fatbin.

use super::{kernels, Gpu, Stream};
use crate::abi;
use crate::error::Result;

/// Launches the empty kernel (1 CTA, 32 threads): the fixed cost every launch pays.
pub fn empty_kernel(gpu: &Gpu, stream: &Stream) -> Result<()> {
    // SAFETY: the kernel takes no parameters and touches no memory.
    unsafe { gpu.launch(kernels::BENCH_EMPTY, 1, 32, stream, &()) }
}

/// Launches a read of `bytes` (a multiple of 16) at `src` (8 CTAs of 512 threads per SM, one
/// pass): the least time any kernel reading that buffer once can take.
///
/// # Safety
/// `src` must be a 16-byte aligned device buffer of `bytes` bytes and `sink` an 8-byte one,
/// both valid until the kernel completes on `stream`.
pub unsafe fn read(gpu: &Gpu, stream: &Stream, src: u64, bytes: u64, sink: u64) -> Result<()> {
    let p = abi::kvs_bench_read_params { src, bytes, sink };
    let grid = gpu.info().sm_count * 8;
    // SAFETY: forwarded contract.
    unsafe { gpu.launch(kernels::BENCH_READ, grid, 512, stream, &p) }
}

/// Launches `out[i] = a[i] + b[i]` over `count` bf16 values (a multiple of 8): a
/// memory-bound stand-in for a forward pass, on every SM.
///
/// # Safety
/// `a`, `b` and `out` must be 16-byte aligned device buffers of `count` bf16 values that
/// stay valid until the kernel completes on `stream`.
pub unsafe fn bf16_add(
    gpu: &Gpu,
    stream: &Stream,
    a: u64,
    b: u64,
    out: u64,
    count: u64,
) -> Result<()> {
    let p = abi::kvs_bench_add_params { a, b, out, count };
    let grid = gpu.info().sm_count * 8;
    // SAFETY: forwarded contract.
    unsafe { gpu.launch(kernels::BENCH_ADD, grid, 256, stream, &p) }
}
