//! The capacity planner: what a CP group's GPU, host and disk tiers hold for a cache geometry,
//! and how long a prefix takes to come back from each (`kvshard::pool::capacity`).

use pyo3::prelude::*;

use kvshard::pool::capacity::{
    self, CapacityPlan, CapacityRequest, Ceilings, HostCapacity, Tier, TierCapacity,
};
use kvshard::pool::BudgetRequest;

use crate::budget::PyBudget;
use crate::errors::{invalid, IntoPy};
use crate::geometry::PyCacheGeometry;

/// A tier's short name: `"gpu"` (L1), `"host"` (L2), `"disk"` (L3).
fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "gpu",
        Tier::Host => "host",
        Tier::Disk => "disk",
    }
}

/// What one tier holds: `bytes` (per rank for `"gpu"` and `"host"`, the whole store for
/// `"disk"`), `pages_per_rank` (None for the shared disk), the group's `pages` (slots for the
/// disk) and the `tokens` it caches.
#[pyclass(frozen, get_all, module = "kvshard", name = "TierCapacity")]
#[derive(Clone)]
pub struct PyTierCapacity {
    tier: &'static str,
    bytes: u64,
    pages_per_rank: Option<u64>,
    pages: u64,
    tokens: u64,
}

impl From<&TierCapacity> for PyTierCapacity {
    fn from(t: &TierCapacity) -> Self {
        Self {
            tier: tier_name(t.tier),
            bytes: t.bytes,
            pages_per_rank: t.pages_per_rank,
            pages: t.pages,
            tokens: t.tokens,
        }
    }
}

/// How long a prefix takes to come back from one tier: whether the tier `fits` it, and the
/// `seconds` until it is in GPU memory (None without the ceilings it needs).
#[pyclass(frozen, get_all, module = "kvshard", name = "TierReload")]
#[derive(Clone)]
pub struct PyTierReload {
    tier: &'static str,
    fits: bool,
    seconds: Option<f64>,
}

/// The reload of one prefix: its `tokens` and `pages`, the busiest rank's pages and bytes, the
/// bytes read from the disk, and one `TierReload` per tier, fastest first.
#[pyclass(frozen, get_all, module = "kvshard", name = "Reload")]
#[derive(Clone)]
pub struct PyReload {
    tokens: u64,
    pages: u64,
    pages_per_rank: u64,
    bytes_per_rank: u64,
    disk_bytes: u64,
    tiers: Vec<PyTierReload>,
}

/// A capacity plan: the GPU budget (scratch, pages, logical GPU slots), the L3 slot size,
/// what each tier holds and the prefixes' reload times.
#[pyclass(frozen, module = "kvshard", name = "CapacityPlan")]
pub struct PyCapacityPlan(CapacityPlan);

#[pymethods]
impl PyCapacityPlan {
    /// How each rank's GPU memory splits.
    #[getter]
    fn budget(&self) -> PyBudget {
        PyBudget(self.0.budget)
    }
    /// Bytes of one L3 slot: a page of every component, padded to the direct-I/O alignment.
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.0.slot_bytes
    }
    /// What each tier holds: gpu, host, disk.
    #[getter]
    fn tiers(&self) -> Vec<PyTierCapacity> {
        self.0.tiers.iter().map(PyTierCapacity::from).collect()
    }
    /// The prefixes' reload times, in the order asked.
    #[getter]
    fn reloads(&self) -> Vec<PyReload> {
        self.0
            .reloads
            .iter()
            .map(|r| PyReload {
                tokens: r.tokens,
                pages: r.pages,
                pages_per_rank: r.pages_per_rank,
                bytes_per_rank: r.bytes_per_rank,
                disk_bytes: r.disk_bytes,
                tiers: r
                    .tiers
                    .iter()
                    .map(|t| PyTierReload {
                        tier: tier_name(t.tier),
                        fits: t.fits,
                        seconds: t.seconds,
                    })
                    .collect(),
            })
            .collect()
    }

    fn __repr__(&self) -> String {
        let t: Vec<String> = self
            .0
            .tiers
            .iter()
            .map(|t| format!("{}: {} pages, {} tokens", t.tier, t.pages, t.tokens))
            .collect();
        format!("CapacityPlan({}; {})", self.0.budget, t.join("; "))
    }
}

/// Plans a CP group of `cp` ranks of `geometry`: `gpu_bytes` of GPU memory per rank for the
/// scratch (sized by `context_len`, `chunk_size`, `contexts`) and the pool; a host cache per
/// rank of `host_bytes`, or `host_factor` times the GPU pool's pages (exactly one of them); a
/// disk store of `disk_bytes` shared by the group, slots padded to `dio_align`; reload times of
/// `prefixes` (tokens) from the ceilings given in GB/s (None: unknown). Impossible inputs raise
/// kvshard's errors (a budget too small, an invalid argument).
#[pyfunction]
#[pyo3(signature = (
    geometry, cp, gpu_bytes, disk_bytes, *, host_bytes = None, host_factor = None,
    context_len = 131_072, chunk_size = 8192, contexts = kvshard::pool::DEFAULT_CONTEXTS,
    dio_align = capacity::DEFAULT_DIO_ALIGN, d2d_gbps = None, h2d_gbps = None,
    disk_gbps = None, prefixes = capacity::DEFAULT_PREFIXES.to_vec()
))]
#[allow(clippy::too_many_arguments)]
pub fn plan_capacity(
    geometry: &PyCacheGeometry,
    cp: u32,
    gpu_bytes: u64,
    disk_bytes: u64,
    host_bytes: Option<u64>,
    host_factor: Option<u64>,
    context_len: u64,
    chunk_size: u64,
    contexts: u64,
    dio_align: u64,
    d2d_gbps: Option<f64>,
    h2d_gbps: Option<f64>,
    disk_gbps: Option<f64>,
    prefixes: Vec<u64>,
) -> PyResult<PyCapacityPlan> {
    let host = match (host_bytes, host_factor) {
        (Some(b), None) => HostCapacity::Bytes(b),
        (None, Some(f)) => HostCapacity::Factor(f),
        _ => {
            return Err(invalid(
                "give the host cache as exactly one of host_bytes= and host_factor=",
            ))
        }
    };
    let mut gpu = BudgetRequest::new(gpu_bytes, context_len, chunk_size);
    gpu.contexts = contexts;
    let req = CapacityRequest {
        geometry: geometry.0.clone(),
        cp,
        gpu,
        host,
        disk_bytes,
        dio_align,
        ceilings: Ceilings {
            d2d_gbps,
            h2d_gbps,
            disk_gbps,
        },
        prefixes,
    };
    Ok(PyCapacityPlan(CapacityPlan::plan(&req).py_err()?))
}
