//! A request's chain of logical pages: the slots its writes take, its HiCache nodes and its
//! P/D registration. Above `hicache` and `transfer` (it makes their objects), as
//! `kvshard::chain` is in the library.

use pyo3::prelude::*;

use kvshard::chain::RequestChain;
use kvshard::hicache::CacheNode;
use kvshard::transfer::Registration;

use crate::errors::IntoPy;
use crate::hicache_controller::PyCacheNode;
use crate::shard::{logical, raw, PyPlacement, PyShardAllocator};
use crate::transfer::{PyPoolLayout, PyRegistration};

/// One request's chain of logical pages: grown chunk by chunk through the allocator, it gives
/// the slots the writes take, the HiCache node and the P/D registration.
#[pyclass(module = "kvshard", name = "RequestChain")]
pub struct PyRequestChain(pub RequestChain);

#[pymethods]
impl PyRequestChain {
    #[new]
    fn new(placement: PyPlacement) -> Self {
        Self(RequestChain::new(placement.0))
    }

    /// A chain continuing a cached prefix (pages `allocator` handed out and still holds) whose
    /// position 0 is owned by `start_owner`.
    #[staticmethod]
    fn cached(allocator: &PyShardAllocator, start_owner: u32, pages: Vec<u64>) -> PyResult<Self> {
        Ok(Self(
            RequestChain::cached(&allocator.0, start_owner, logical(&pages)).py_err()?,
        ))
    }

    /// The start owner (None before the first page).
    #[getter]
    fn start_owner(&self) -> Option<u32> {
        self.0.start_owner()
    }

    /// Logical pages, in position order (refused once the chain is stale).
    #[getter]
    fn pages(&self) -> PyResult<Vec<u64>> {
        Ok(raw(self.0.pages().py_err()?))
    }

    /// Tokens the pages hold.
    #[getter]
    fn capacity(&self) -> usize {
        self.0.capacity()
    }

    /// Grows the chain to hold `tokens` tokens (all or nothing); returns the new pages.
    fn grow_to(&mut self, allocator: &mut PyShardAllocator, tokens: usize) -> PyResult<Vec<u64>> {
        Ok(raw(self.0.grow_to(&mut allocator.0, tokens).py_err()?))
    }

    /// Logical slots of tokens `[start, end)`.
    fn slots(&self, start: usize, end: usize) -> PyResult<Vec<u64>> {
        Ok(self
            .0
            .slots(start..end)
            .py_err()?
            .into_iter()
            .map(|s| s.0)
            .collect())
    }

    /// The HiCache node of positions `[start, end)` with id `id`.
    fn cache_node(&self, id: u64, start: usize, end: usize) -> PyResult<PyCacheNode> {
        Ok(PyCacheNode(
            CacheNode::of_chain(&self.0, id, start..end).py_err()?,
        ))
    }

    /// Host pages a backup of `node` gets from the host allocator.
    #[staticmethod]
    fn host_pages(node: &PyCacheNode, host: &mut PyShardAllocator) -> PyResult<Vec<u64>> {
        Ok(raw(&node.0.alloc_host_pages(&mut host.0).py_err()?))
    }

    /// The P/D registration of this (unsharded, decode-side) chain.
    #[pyo3(signature = (request, layout, prefix_pages = 0))]
    fn registration(
        &self,
        request: u64,
        layout: &PyPoolLayout,
        prefix_pages: usize,
    ) -> PyResult<PyRegistration> {
        Ok(PyRegistration(
            Registration::of_chain(&self.0, request, layout.0.clone(), prefix_pages).py_err()?,
        ))
    }

    fn __repr__(&self) -> String {
        format!(
            "RequestChain(start_owner={:?}, {} pages)",
            self.0.start_owner(),
            self.0.page_count()
        )
    }
}
