//! Ownership: placement and the rotated-owner allocator every rank runs identically (a
//! request's page chain, which also makes HiCache nodes and P/D registrations, is in
//! `chain.rs`, above both).

use pyo3::prelude::*;

use kvshard::index::{LocalPage, LogicalPage, Slot};
use kvshard::shard::{AllocRequest, Allocation, ChainStart, Placement, ShardAllocator};

use crate::errors::IntoPy;

/// Python ints as logical pages.
pub fn logical(pages: &[u64]) -> Vec<LogicalPage> {
    pages.iter().map(|&p| LogicalPage(p)).collect()
}

/// Logical pages as Python ints.
pub fn raw(pages: &[LogicalPage]) -> Vec<u64> {
    pages.iter().map(|p| p.0).collect()
}

/// Sharding of the logical index space over `shard` ranks, page by page: logical page `l` is
/// owned by rank `l % shard` and is its local page `l // shard`; logical pages `0..shard` are
/// every rank's padding page 0.
#[pyclass(
    frozen,
    eq,
    hash,
    from_py_object,
    module = "kvshard",
    name = "Placement"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyPlacement(pub Placement);

#[pymethods]
impl PyPlacement {
    #[new]
    #[pyo3(signature = (shard = 1))]
    fn new(shard: u32) -> PyResult<Self> {
        Ok(Self(Placement::new(shard).py_err()?))
    }

    /// Shard size N.
    #[getter]
    fn shard(&self) -> u32 {
        self.0.shard()
    }

    /// Tokens per page (64).
    #[getter]
    fn page_size(&self) -> usize {
        self.0.page_size()
    }

    /// Owner of logical page `page`.
    fn owner(&self, page: u64) -> u32 {
        self.0.owner(LogicalPage(page))
    }

    /// Owner of logical token slot `slot`.
    fn slot_owner(&self, slot: u64) -> u32 {
        self.0.slot_owner(Slot(slot))
    }

    /// Local page of logical page `page` on its owner.
    fn local(&self, page: u64) -> u64 {
        self.0.local(LogicalPage(page)).0
    }

    /// Local row of logical slot `slot` on its owner.
    fn local_row(&self, slot: u64) -> u64 {
        self.0.local_row(Slot(slot))
    }

    /// Logical page of local page `local` on `rank` (None when it does not fit).
    fn logical(&self, rank: u32, local: u64) -> Option<u64> {
        self.0.logical(rank, LocalPage(local)).map(|p| p.0)
    }

    /// Whether logical page `page` is a reserved padding page.
    fn is_reserved(&self, page: u64) -> bool {
        self.0.is_reserved(LogicalPage(page))
    }

    /// Logical pages of a group whose ranks each hold `physical_pages`.
    fn logical_pages(&self, physical_pages: u64) -> PyResult<u64> {
        self.0.logical_pages(physical_pages).py_err()
    }

    /// Logical token slots of a group whose ranks each hold `physical_pages`.
    fn logical_capacity(&self, physical_pages: u64) -> PyResult<u64> {
        self.0.logical_capacity(physical_pages).py_err()
    }

    fn __repr__(&self) -> String {
        format!("Placement({})", self.0.shard())
    }
}

/// Pages handed out for one allocation: `pages[i]` sits at chain position
/// `first_position + i`, owned by `(start_owner + first_position + i) % N`.
#[pyclass(frozen, module = "kvshard", name = "Allocation")]
pub struct PyAllocation(pub Allocation);

#[pymethods]
impl PyAllocation {
    /// The chain's start owner.
    #[getter]
    fn start_owner(&self) -> u32 {
        self.0.start_owner
    }

    /// Chain position of the first page.
    #[getter]
    fn first_position(&self) -> usize {
        self.0.first_position
    }

    /// Logical pages, in chain order.
    #[getter]
    fn pages(&self) -> Vec<u64> {
        raw(&self.0.pages)
    }

    fn __repr__(&self) -> String {
        format!(
            "Allocation(start_owner={}, first_position={}, pages={:?})",
            self.0.start_owner,
            self.0.first_position,
            raw(&self.0.pages)
        )
    }
}

fn chain_start(start_owner: Option<u32>, prefix_tokens: usize) -> ChainStart {
    match start_owner {
        None => ChainStart::New,
        Some(start_owner) => ChainStart::Extend {
            start_owner,
            prefix_tokens,
        },
    }
}

/// The rotated-owner page allocator every rank of a shard group runs identically (so all agree
/// on every logical page without talking). Every multi-page call is all-or-nothing.
#[pyclass(module = "kvshard", name = "ShardAllocator")]
pub struct PyShardAllocator(pub ShardAllocator);

#[pymethods]
impl PyShardAllocator {
    #[new]
    fn new(placement: PyPlacement, pages_per_rank: u64) -> PyResult<Self> {
        Ok(Self(
            ShardAllocator::new(placement.0, pages_per_rank).py_err()?,
        ))
    }

    /// The placement.
    #[getter]
    fn placement(&self) -> PyPlacement {
        PyPlacement(self.0.placement())
    }

    /// Physical pages per rank (page 0 reserved).
    #[getter]
    fn pages_per_rank(&self) -> u64 {
        self.0.pages_per_rank()
    }

    /// `pages` pages of a new chain (`start_owner=None`: the allocator picks the start owner),
    /// or extending a chain whose start owner is `start_owner` after `prefix_tokens` tokens.
    #[pyo3(signature = (pages, start_owner = None, prefix_tokens = 0))]
    fn alloc(
        &mut self,
        pages: usize,
        start_owner: Option<u32>,
        prefix_tokens: usize,
    ) -> PyResult<PyAllocation> {
        let a = self
            .0
            .alloc(AllocRequest {
                chain: chain_start(start_owner, prefix_tokens),
                pages,
            })
            .py_err()?;
        Ok(PyAllocation(a))
    }

    /// Several chains at once, each `(pages, start_owner or None, prefix_tokens)`: all or none.
    fn alloc_batch(
        &mut self,
        requests: Vec<(usize, Option<u32>, usize)>,
    ) -> PyResult<Vec<PyAllocation>> {
        let requests: Vec<AllocRequest> = requests
            .into_iter()
            .map(|(pages, start_owner, prefix)| AllocRequest {
                chain: chain_start(start_owner, prefix),
                pages,
            })
            .collect();
        Ok(self
            .0
            .alloc_batch(&requests)
            .py_err()?
            .into_iter()
            .map(PyAllocation)
            .collect())
    }

    /// Pages of the same owner classes as `pages` (host copies of device pages).
    fn alloc_matching(&mut self, pages: Vec<u64>) -> PyResult<Vec<u64>> {
        Ok(raw(&self.0.alloc_matching(&logical(&pages)).py_err()?))
    }

    /// Returns `pages` (all-or-nothing; a double free is an error).
    fn free(&mut self, pages: Vec<u64>) -> PyResult<()> {
        self.0.free(&logical(&pages)).py_err()
    }

    /// Free pages of owner class `owner`.
    fn free_pages(&self, owner: u32) -> usize {
        self.0.free_pages(owner)
    }

    /// Free pages of every class.
    fn total_free(&self) -> usize {
        self.0.total_free()
    }

    /// Admission capacity in tokens: `N * 64 * min(free)`.
    fn admission_capacity(&self) -> u64 {
        self.0.admission_capacity()
    }

    /// Tokens each request reserves (`N * 64`).
    fn request_overhead(&self) -> u64 {
        self.0.request_overhead()
    }

    /// Whether logical page `page` is handed out.
    fn is_allocated(&self, page: u64) -> bool {
        self.0.is_allocated(LogicalPage(page))
    }

    fn __repr__(&self) -> String {
        format!(
            "ShardAllocator({} ranks x {} pages, {} free)",
            self.0.placement().shard(),
            self.0.pages_per_rank(),
            self.0.total_free()
        )
    }
}
