//! HiCache's choices as enum classes: how a host pool orders its blocks (`HostLayout`), how
//! the controller moves a node (`Route`, whose kernel members take their CTAs from the call's
//! `ctas=`), when it backs a node up (`WritePolicy`), and which way a host transfer moves pages
//! (`Direction`).

use pyo3::prelude::*;

use kvshard::backend::Backend;
use kvshard::copy::Direction;
use kvshard::hicache::{HostLayout, Route, WritePolicy};

use crate::errors::IntoPy;
use crate::method::PyMethod;

/// How a host pool orders the blocks of a buffer.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "HostLayout"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyHostLayout {
    /// `[L][pages][block]`.
    LAYER_FIRST,
    /// `[pages * 64][L][row]` (indexer `[pages][L][8448]`): SGLang's default.
    PAGE_FIRST,
    /// `[pages][L][block]`.
    PAGE_FIRST_DIRECT,
}

mirror_enum!(PyHostLayout <=> HostLayout {
    LAYER_FIRST = LayerFirst,
    PAGE_FIRST = PageFirst,
    PAGE_FIRST_DIRECT = PageFirstDirect,
});

#[pymethods]
impl PyHostLayout {
    /// The layout SGLang names `name` (`"layer_first"`, `"page_first"`, `"page_first_direct"`:
    /// its `hicache_mem_layout`); `str(layout)` is the name back.
    #[staticmethod]
    fn from_name(name: &str) -> PyResult<Self> {
        Ok(HostLayout::from_name(name).py_err()?.into())
    }

    fn __str__(&self) -> String {
        HostLayout::from(*self).to_string()
    }
}

/// How a `HiCacheController` operation moves a node (`ctas=` sets the kernels' CTAs): straight
/// between the pools with a `Method`, or through the controller's device staging.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "Route"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyRoute {
    /// Direct, on the SM kernel; a load counts each layer's readiness as it lands.
    KERNEL,
    /// Direct, on coalesced copy-engine copies; a load lands layer after layer.
    COPY_ENGINE,
    /// Direct, one copy-engine call per block.
    PER_BLOCK,
    /// Direct, one batch copy.
    BATCH,
    /// Through device staging, relaid by the copy engine: every host layout and device pool
    /// (a load lands every layer at once).
    STAGED,
    /// Through device staging, relaid by the kernel.
    STAGED_KERNEL,
    /// Picked per call from the direction and pages (Rust's `Route::auto`, the rule measured
    /// in BENCHMARKS.md): the default.
    AUTO,
}

impl PyRoute {
    /// kvshard's route on `b`, its kernel in the host-I/O shape of `ctas` CTAs.
    pub fn on(self, b: &dyn Backend, ctas: u32) -> Route {
        let method = |m: PyMethod| m.host_io(b, ctas);
        match self {
            Self::KERNEL => Route::Direct(method(PyMethod::KERNEL)),
            Self::COPY_ENGINE => Route::Direct(method(PyMethod::COPY_ENGINE)),
            Self::PER_BLOCK => Route::Direct(method(PyMethod::PER_BLOCK)),
            Self::BATCH => Route::Direct(method(PyMethod::BATCHED_COPY_ENGINE)),
            Self::STAGED => Route::Staged(method(PyMethod::COPY_ENGINE)),
            Self::STAGED_KERNEL => Route::Staged(method(PyMethod::KERNEL)),
            Self::AUTO => Route::Auto,
        }
    }
}

/// When a `HiCacheController` backs a device node up to the host.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "WritePolicy"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyWritePolicy {
    /// On the node's first access.
    WRITE_THROUGH,
    /// On the node's second access.
    WRITE_THROUGH_SELECTIVE,
    /// Only when the node is evicted (eviction waits for the copy).
    WRITE_BACK,
}

mirror_enum!(PyWritePolicy <=> WritePolicy {
    WRITE_THROUGH = WriteThrough,
    WRITE_THROUGH_SELECTIVE = WriteThroughSelective,
    WRITE_BACK = WriteBack,
});

/// Which way a `HostTransfer` moves pages.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "Direction"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyDirection {
    /// Host to device.
    LOAD,
    /// Device to host.
    BACKUP,
}

mirror_enum!(PyDirection <=> Direction {
    LOAD = Load,
    BACKUP = Backup,
});
