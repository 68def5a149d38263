//! The memory budget: how a rank's memory splits into scratch slots and whole pages.

use pyo3::prelude::*;

use kvshard::pool::{Budget, BudgetRequest};

use crate::errors::IntoPy;
use crate::geometry::PyCacheGeometry;
use crate::shard::PyPlacement;

/// How a rank's memory is split: scratch slots first (SGLang's formula), then whole pages.
#[pyclass(frozen, module = "kvshard", name = "Budget")]
pub struct PyBudget(pub Budget);

#[pymethods]
impl PyBudget {
    /// Splits `bytes` for `geometry` sharded by `placement`: scratch for prefixes of
    /// `context_len` tokens (`contexts` of them per batch) plus a `chunk_size` chunk, then as
    /// many whole pages as fit.
    #[staticmethod]
    #[pyo3(signature = (bytes, context_len, chunk_size, geometry, placement, contexts = kvshard::pool::DEFAULT_CONTEXTS))]
    fn plan(
        bytes: u64,
        context_len: u64,
        chunk_size: u64,
        geometry: &PyCacheGeometry,
        placement: PyPlacement,
        contexts: u64,
    ) -> PyResult<Self> {
        let mut req = BudgetRequest::new(bytes, context_len, chunk_size);
        req.contexts = contexts;
        Ok(Self(Budget::plan(&req, &geometry.0, placement.0).py_err()?))
    }

    /// Rows of one scratch slot (0 unsharded).
    #[getter]
    fn scratch_rows(&self) -> u64 {
        self.0.scratch_rows
    }
    /// Tokens of the prefix region of a slot.
    #[getter]
    fn max_prefix_tokens(&self) -> u64 {
        self.0.max_prefix_tokens
    }
    /// Bytes of all scratch slots.
    #[getter]
    fn scratch_bytes(&self) -> u64 {
        self.0.scratch_bytes
    }
    /// Bytes of one page across every layer and component.
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.0.page_bytes
    }
    /// Physical pages per layer (page 0 is padding).
    #[getter]
    fn pages(&self) -> u64 {
        self.0.pages
    }
    /// Bytes the pool takes.
    #[getter]
    fn pool_bytes(&self) -> u64 {
        self.0.pool_bytes
    }
    /// Logical token capacity of the shard group.
    #[getter]
    fn logical_capacity(&self) -> u64 {
        self.0.logical_capacity
    }

    fn __repr__(&self) -> String {
        self.0.to_string()
    }
}
