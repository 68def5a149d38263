//! HiCache transfers between a device pool and a host pool: the plan of one rank's page pairs,
//! the transfer that runs it with any `Method` (direct, signalled per layer, or through device
//! staging), and that staging.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use kvshard::backend::Launch;
use kvshard::copy::{CounterWait, Layers, TableBuffer};
use kvshard::hicache::{HostTransfer, LayerReady, StagedIo, TransferPlan};
use kvshard::index::ModelLayer;

use crate::device::PyDevice;
use crate::device_pool::PyDevicePool;
use crate::errors::{invalid, IntoPy};
use crate::hicache_enums::PyDirection;
use crate::host_pool::PyHostPool;
use crate::layer_signals::{PyLayerSignals, PyLayerWaits};
use crate::lock::lock;
use crate::method::PyMethod;
use crate::shard::{logical, PyPlacement};
use crate::tensor::host_i64s;

/// The layers one run moves: every layer, or model layer `layer`'s readiness group.
fn layers_of(layer: Option<usize>) -> Layers {
    layer.map_or(Layers::All, |m| Layers::One(ModelLayer(m)))
}

/// One rank's share of a HiCache operation, in local pages: logical device pages paired with
/// logical host pages by position, this rank's pairs kept and checked (every rank accepts or
/// refuses the same operation).
#[pyclass(frozen, module = "kvshard", name = "TransferPlan")]
#[derive(Clone)]
pub struct PyTransferPlan(pub TransferPlan);

#[pymethods]
impl PyTransferPlan {
    #[new]
    fn new(
        placement: PyPlacement,
        rank: u32,
        device_pages: Vec<u64>,
        host_pages: Vec<u64>,
        device_pool_pages: u64,
        host_pool_pages: u64,
    ) -> PyResult<Self> {
        Ok(Self(
            TransferPlan::new(
                placement.0,
                rank,
                &logical(&device_pages),
                &logical(&host_pages),
                device_pool_pages,
                host_pool_pages,
            )
            .py_err()?,
        ))
    }

    /// Pairs from whole-page token slots (`64 p .. 64 p + 63` each, as SGLang's int64
    /// per-token indices are): the logical pages of `device_slots` and `host_slots`.
    #[staticmethod]
    fn from_slots(
        placement: PyPlacement,
        rank: u32,
        device_slots: &Bound<'_, PyAny>,
        host_slots: &Bound<'_, PyAny>,
        device_pool_pages: u64,
        host_pool_pages: u64,
    ) -> PyResult<Self> {
        let pages = |v: &Bound<'_, PyAny>| -> PyResult<Vec<kvshard::index::LogicalPage>> {
            let slots: Vec<kvshard::index::Slot> = host_i64s(v)?
                .into_iter()
                .map(|s| {
                    u64::try_from(s)
                        .map(kvshard::index::Slot)
                        .map_err(|_| invalid(format!("negative slot {s}")))
                })
                .collect::<PyResult<_>>()?;
            kvshard::hicache::pages_of_tokens(&slots).py_err()
        };
        Ok(Self(
            TransferPlan::new(
                placement.0,
                rank,
                &pages(device_slots)?,
                &pages(host_slots)?,
                device_pool_pages,
                host_pool_pages,
            )
            .py_err()?,
        ))
    }

    /// Pairs this rank moves.
    fn __len__(&self) -> usize {
        self.0.len()
    }

    /// Pairs in the whole operation (every rank's).
    #[getter]
    fn requested(&self) -> usize {
        self.0.requested()
    }

    /// Positions of this rank's pairs.
    #[getter]
    fn positions(&self) -> Vec<usize> {
        self.0.positions().to_vec()
    }

    /// Local device page of each pair.
    #[getter]
    fn device_pages(&self) -> Vec<u64> {
        self.0.device_pages().iter().map(|p| p.0).collect()
    }

    /// Local host page of each pair.
    #[getter]
    fn host_pages(&self) -> Vec<u64> {
        self.0.host_pages().iter().map(|p| p.0).collect()
    }

    /// Coalesced runs `(device page, host page, pages)`.
    #[getter]
    fn runs(&self) -> Vec<(u64, u64, u64)> {
        self.0
            .runs()
            .iter()
            .map(|r| (r.src.0, r.dst.0, r.pages))
            .collect()
    }
}

/// One rank's share of a HiCache transfer between a device pool and a host pool, checked and
/// ready to run (repeatedly) on any I/O backend. It holds both pools.
#[pyclass(frozen, module = "kvshard", name = "HostTransfer")]
pub struct PyHostTransfer {
    pub(crate) inner: Mutex<HostTransfer>,
    spare: Mutex<Vec<TableBuffer>>,
    pub(crate) device: Py<PyDevice>,
    #[allow(dead_code)]
    holds: (Py<PyDevicePool>, Py<PyHostPool>),
}

impl PyHostTransfer {
    /// Runs `f` on the transfer (under its lock, without the GIL).
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut HostTransfer, &mut Vec<TableBuffer>) -> kvshard::Result<R> + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let mut t = lock(&self.inner);
            let mut spare = lock(&self.spare);
            f(&mut t, &mut spare)
        })
        .py_err()
    }
}

#[pymethods]
impl PyHostTransfer {
    /// `plan`'s pairs moved in `direction` (`Direction.LOAD`: host to device;
    /// `Direction.BACKUP`: device to host).
    #[new]
    fn new(
        py: Python<'_>,
        device_pool: Py<PyDevicePool>,
        host_pool: Py<PyHostPool>,
        plan: &PyTransferPlan,
        direction: PyDirection,
    ) -> PyResult<Self> {
        let t = HostTransfer::new(
            device_pool.get().inner.clone(),
            host_pool.get().inner.clone(),
            plan.0.clone(),
            direction.into(),
        )
        .py_err()?;
        Ok(Self {
            inner: Mutex::new(t),
            spare: Mutex::new(Vec::new()),
            device: device_pool.get().device.clone_ref(py),
            holds: (device_pool, host_pool),
        })
    }

    /// Uploads the SM kernel's tables, waiting for `stream` (use one other than the transfers').
    #[pyo3(signature = (stream = None))]
    fn prepare_kernel_sync(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        self.with(py, |t, spare| t.prepare_kernel_sync(b.as_ref(), spare))
    }

    /// Enqueues the copies of every layer (or of model layer `layer`'s readiness group: layer
    /// 0 carries the MTP draft) on `stream` with method `io` (`Method.KERNEL` with `ctas`
    /// CTAs, `COPY_ENGINE`, `BATCHED_COPY_ENGINE` or `PER_BLOCK`). No wait.
    #[pyo3(signature = (stream = None, io = PyMethod::KERNEL, layer = None, *, ctas = 2))]
    fn run(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        io: PyMethod,
        layer: Option<usize>,
        ctas: u32,
    ) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        let io = io.host_io(b.as_ref(), ctas);
        self.with(py, |t, _| t.run(b.as_ref(), io, layers_of(layer)))
    }

    /// Enqueues every layer as one kernel launch of `ctas` CTAs counting into `signals`;
    /// returns every model layer's readiness (the draft's is layer 0's): `waits[i].wait(s)` or
    /// `waits.wait_layer(s, i)`.
    #[pyo3(signature = (signals, stream = None, *, ctas = 2))]
    fn run_signalled(
        &self,
        py: Python<'_>,
        signals: &mut PyLayerSignals,
        stream: Option<&Bound<'_, PyAny>>,
        ctas: u32,
    ) -> PyResult<PyLayerWaits> {
        let b = self.device.get().resolve(stream)?;
        let s = &mut signals.0;
        let launch = Launch::host_io(b.as_ref(), ctas);
        let waits: Vec<CounterWait> =
            self.with(py, |t, _| t.run_signalled(b.as_ref(), launch, s))?;
        Ok(PyLayerWaits {
            ready: waits.into_iter().map(LayerReady::Counter).collect(),
            device: self.device.clone_ref(py),
        })
    }

    /// Device staging for `run_staged`: two mirrors of `pages` pages each.
    #[pyo3(signature = (pages, stream = None))]
    fn staging(
        &self,
        py: Python<'_>,
        pages: u64,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStagedIo> {
        let b = self.device.get().resolve(stream)?;
        Ok(PyStagedIo(Arc::new(
            self.with(py, |t, _| t.staging(b.as_ref(), pages))?,
        )))
    }

    /// Uploads the kernel relayout's tables for `staging` (waits for `stream`).
    #[pyo3(signature = (staging, stream = None))]
    fn prepare_staged_sync(
        &self,
        py: Python<'_>,
        staging: &PyStagedIo,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        let s = staging.0.clone();
        self.with(py, |t, spare| t.prepare_staged_sync(b.as_ref(), &s, spare))
    }

    /// Every layer through `staging`: copy-engine runs on `copy_stream`, the relayout
    /// (`Method.COPY_ENGINE`, or `Method.KERNEL` with `ctas` CTAs) on `relayout_stream`. When
    /// `copy_stream` reaches the end of what this enqueues, the transfer has landed.
    #[pyo3(signature = (staging, copy_stream, relayout_stream, relayout = PyMethod::COPY_ENGINE, *, ctas = 2))]
    fn run_staged(
        &self,
        py: Python<'_>,
        staging: &PyStagedIo,
        copy_stream: &Bound<'_, PyAny>,
        relayout_stream: &Bound<'_, PyAny>,
        relayout: PyMethod,
        ctas: u32,
    ) -> PyResult<()> {
        let d = self.device.get();
        let (c, r) = (
            d.resolve(Some(copy_stream))?,
            d.resolve(Some(relayout_stream))?,
        );
        let how = relayout.host_io(r.as_ref(), ctas);
        let s = staging.0.clone();
        self.with(py, |t, _| t.run_staged(c.as_ref(), r.as_ref(), &s, how))
    }

    /// Bytes one run of every layer (or of `layer`'s group) moves.
    #[pyo3(signature = (layer = None))]
    fn bytes(&self, layer: Option<usize>) -> PyResult<u64> {
        lock(&self.inner).bytes(layers_of(layer)).py_err()
    }

    /// The launches and copy-engine calls one run with `io` submits.
    #[pyo3(signature = (io = PyMethod::KERNEL, layer = None, *, ctas = 2))]
    fn calls(
        &self,
        io: PyMethod,
        layer: Option<usize>,
        ctas: u32,
    ) -> PyResult<std::collections::BTreeMap<&'static str, usize>> {
        let n = lock(&self.inner)
            .calls(
                io.with_launch(Launch {
                    ctas,
                    threads: kvshard::abi::KVS_COPY_THREADS,
                }),
                layers_of(layer),
            )
            .py_err()?;
        Ok([
            ("launches", n.launches),
            ("memcpy", n.memcpy),
            ("memcpy_2d", n.memcpy_2d),
            ("batch_calls", n.batch_calls),
            ("batch_entries", n.batch_entries),
        ]
        .into_iter()
        .collect())
    }

    /// Which way it moves pages.
    #[getter]
    fn direction(&self) -> PyDirection {
        lock(&self.inner).direction().into()
    }

    /// Model layers of the cache (the draft's included).
    #[getter]
    fn model_layers(&self) -> usize {
        lock(&self.inner).model_layers()
    }

    /// The readiness group of model layer `m` (the draft's is 0).
    fn group(&self, m: usize) -> usize {
        lock(&self.inner).group(ModelLayer(m)).0
    }

    /// Pairs this rank moves.
    fn __len__(&self) -> usize {
        lock(&self.inner).plan().len()
    }
}

/// Device staging of a staged transfer.
#[pyclass(frozen, module = "kvshard", name = "StagedIo")]
pub struct PyStagedIo(Arc<StagedIo>);

#[pymethods]
impl PyStagedIo {
    /// Pages each staging buffer holds.
    #[getter]
    fn chunk_pages(&self) -> u64 {
        self.0.chunk_pages()
    }

    /// Device bytes of the two buffers.
    #[getter]
    fn bytes(&self) -> usize {
        self.0.bytes()
    }
}
