//! `Method`: how bytes move, the one Python enum every route takes (kvshard's `Method`, with
//! the launch shape of its kernels given where the call is made: `launch=` or `ctas=`).

use pyo3::prelude::*;

use kvshard::backend::{Backend, Launch};
use kvshard::copy::Method;

/// How bytes move: a copy kernel (its launch shape set by the call's `launch=` or `ctas=`) or
/// copy-engine calls. Each route takes the methods it can run and raises `InvalidArgument`
/// for the others before anything is enqueued.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "Method"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyMethod {
    /// The block-copy kernel from page lists (each CTA takes an SM from the forward pass).
    KERNEL,
    /// The range-copy kernel over absolute ranges (P/D senders only).
    RANGE_KERNEL,
    /// Coalesced copy-engine copies (one batch call per P/D chunk; SGLang's `direct` for
    /// HiCache).
    COPY_ENGINE,
    /// One batch copy (`cuMemcpyBatchAsync`) holding every block (HiCache direct only).
    BATCHED_COPY_ENGINE,
    /// One copy-engine call per (page, layer, component) block: the naive baseline.
    PER_BLOCK,
}

impl PyMethod {
    /// kvshard's method, a kernel with the launch shape `launch`.
    pub fn with_launch(self, launch: Launch) -> Method {
        match self {
            Self::KERNEL => Method::Kernel(launch),
            Self::RANGE_KERNEL => Method::RangeKernel(launch),
            Self::COPY_ENGINE => Method::CopyEngine,
            Self::BATCHED_COPY_ENGINE => Method::BatchedCopyEngine,
            Self::PER_BLOCK => Method::PerBlock,
        }
    }

    /// kvshard's method, a kernel in the host-I/O shape of `ctas` CTAs on `b`
    /// ([`Method::host_io`]): what HiCache kernels run with.
    pub fn host_io(self, b: &dyn Backend, ctas: u32) -> Method {
        self.with_launch(Launch::host_io(b, ctas))
    }
}
