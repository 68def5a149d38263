//! A CP prefill batch's plans as plain data: which requests join it (`Admission`) and where its
//! pages land in the per-layer attention scratch (`GatherPlan`). Engines that schedule in Python
//! (SGLang's `PrefillAdder`, its pool's `begin_shard_extend`) call these to get kvshard's
//! answers; the differential tests compare them with SGLang's own.

use pyo3::prelude::*;

use kvshard::index::LogicalPage;
use kvshard::shard::{
    Admission, AdmissionLimits, Candidate, Decision, GatherPlan, GatherRequest, ScratchLayout,
};

use crate::errors::IntoPy;
use crate::shard::{logical, PyPlacement};

/// Which requests of a scheduling pass join the batch, and how much of each is prefilled now,
/// so the batch's gather fits the scratch slot and its pages fit the pool.
#[pyclass(module = "kvshard", name = "Admission")]
pub struct PyAdmission(Admission);

#[pymethods]
impl PyAdmission {
    /// A pass for `placement` whose scratch holds `max_prefix_tokens` prefix tokens and
    /// `chunk_tokens` chunk tokens, against a pool that can admit `capacity` tokens
    /// (`ShardAllocator.admission_capacity()` when the pass starts).
    #[new]
    fn new(
        placement: PyPlacement,
        max_prefix_tokens: u64,
        chunk_tokens: u64,
        capacity: u64,
    ) -> Self {
        let limits = AdmissionLimits {
            max_prefix_tokens,
            chunk_tokens,
        };
        Self(Admission::new(placement.0, limits, capacity))
    }

    /// Offers the next request (`prefix_len` cached tokens, a multiple of 64, and `extend_len`
    /// new ones): `(extend_len, last)` when admitted (a continuing chunk is floored to whole
    /// pages, `last` False), or `None` when deferred (the batch unchanged). A request that can
    /// never fit, offered to an empty batch, raises `InvalidArgumentError`.
    fn offer(&mut self, prefix_len: u64, extend_len: u64) -> PyResult<Option<(u64, bool)>> {
        let decision = self
            .0
            .offer(Candidate {
                prefix_len,
                extend_len,
            })
            .py_err()?;
        Ok(match decision {
            Decision::Admit { extend_len, last } => Some((extend_len, last)),
            Decision::Defer(_) => None,
        })
    }

    /// Prefix pages per owner of the batch so far: `sum ceil((prefix_len / 64) / N)`.
    #[getter]
    fn block(&self) -> u64 {
        self.0.block()
    }

    /// Chunk pages of the batch so far.
    #[getter]
    fn chunk_pages(&self) -> u64 {
        self.0.chunk_pages()
    }

    /// Pool tokens the batch reserves: its chunks plus `N * 64` per request.
    #[getter]
    fn reserved_tokens(&self) -> u64 {
        self.0.reserved_tokens()
    }

    /// Requests admitted so far.
    #[getter]
    fn admitted(&self) -> usize {
        self.0.admitted()
    }
}

/// A batch's gather plan: every rank's send list and the scratch page of every logical page.
#[pyclass(frozen, module = "kvshard", name = "GatherPlan")]
pub struct PyGatherPlan(GatherPlan);

#[pymethods]
impl PyGatherPlan {
    /// Plans the gather of `requests`, each `(start_owner, prefix_pages, chunk_pages)` (logical
    /// pages in chain order), for a group of `placement` holding `logical_pages` logical pages,
    /// into slots of `max_prefix_tokens` prefix and `chunk_tokens` chunk tokens. Every page is
    /// checked first (in range, not reserved, owned along its chain's rotation, no duplicate);
    /// a batch that overflows a region raises.
    #[new]
    fn new(
        placement: PyPlacement,
        max_prefix_tokens: u64,
        chunk_tokens: u64,
        logical_pages: u64,
        requests: Vec<(u32, Vec<u64>, Vec<u64>)>,
    ) -> PyResult<Self> {
        let layout = ScratchLayout::new(max_prefix_tokens, chunk_tokens).py_err()?;
        let pages: Vec<(u32, Vec<LogicalPage>, Vec<LogicalPage>)> = requests
            .iter()
            .map(|(owner, prefix, chunk)| (*owner, logical(prefix), logical(chunk)))
            .collect();
        let requests: Vec<GatherRequest<'_>> = pages
            .iter()
            .map(|(start_owner, prefix, chunk)| GatherRequest {
                start_owner: *start_owner,
                prefix,
                chunk,
            })
            .collect();
        GatherPlan::new(placement.0, layout, logical_pages, &requests)
            .py_err()
            .map(Self)
    }

    /// Prefix pages per owner: `sum_i ceil(K_i / N)`, the length of every send list.
    #[getter]
    fn block(&self) -> u64 {
        self.0.block()
    }

    /// Rank `rank`'s send list: its prefix pages' local pages ascending, padded with local
    /// page 0 to `block` entries.
    fn send_list(&self, rank: u32) -> PyResult<Vec<u64>> {
        Ok(self
            .0
            .send_list(rank)
            .py_err()?
            .iter()
            .map(|p| p.0)
            .collect())
    }

    /// The scratch page of every logical page of the group (the trash page when unmapped).
    fn page_table(&self) -> PyResult<Vec<i64>> {
        self.0.page_table().py_err()
    }

    fn __repr__(&self) -> String {
        format!(
            "GatherPlan(block={}, prefix_pages={}, chunk_pages={})",
            self.0.block(),
            self.0.prefix_pages(),
            self.0.chunk_pages()
        )
    }
}
