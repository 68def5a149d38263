//! The HiCache controller: one rank's loads and backups between a device pool and a host
//! pool on its own streams, with the radix-tree node it moves, its acks, and a load's handle.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvshard::backend::Backend;
use kvshard::hicache::{
    BackupAck, CacheNode, HiCacheController, LoadAck, LoadHandle, Route, Streams,
};
use kvshard::index::ModelLayer;

use crate::device::{after_event, Kind, PyDevice, PyStream};
use crate::device_pool::PyDevicePool;
use crate::errors::{invalid, IntoPy};
use crate::hicache_enums::{PyRoute, PyWritePolicy};
use crate::host_pool::PyHostPool;
use crate::lock::lock;
use crate::shard::{logical, raw};

/// A radix-tree node as the controller sees it: its id, logical device pages in chain order,
/// and the owner of its first page when the cache is sharded.
#[pyclass(frozen, module = "kvshard", name = "CacheNode")]
#[derive(Clone)]
pub struct PyCacheNode(pub CacheNode);

#[pymethods]
impl PyCacheNode {
    #[new]
    #[pyo3(signature = (id, device_pages, start_owner = None))]
    fn new(id: u64, device_pages: Vec<u64>, start_owner: Option<u32>) -> Self {
        Self(CacheNode {
            id,
            device_pages: logical(&device_pages),
            start_owner,
        })
    }

    /// Node id.
    #[getter]
    fn id(&self) -> u64 {
        self.0.id
    }

    /// Logical device pages.
    #[getter]
    fn device_pages(&self) -> Vec<u64> {
        raw(&self.0.device_pages)
    }

    /// The chain's owner at the node's first page (None: no shard owner).
    #[getter]
    fn start_owner(&self) -> Option<u32> {
        self.0.start_owner
    }

    fn __repr__(&self) -> String {
        format!(
            "CacheNode(id={}, {} pages, start_owner={:?})",
            self.0.id,
            self.0.device_pages.len(),
            self.0.start_owner
        )
    }
}

/// A completed backup, acked in submission order.
#[pyclass(frozen, module = "kvshard", name = "BackupAck")]
pub struct PyBackupAck(BackupAck);

#[pymethods]
impl PyBackupAck {
    /// Queue index (0, 1, ... identical on every rank).
    #[getter]
    fn index(&self) -> u64 {
        self.0.index
    }
    /// The node.
    #[getter]
    fn node(&self) -> u64 {
        self.0.node
    }
    /// Logical host pages now holding it.
    #[getter]
    fn host_pages(&self) -> Vec<u64> {
        raw(&self.0.host_pages)
    }
    /// Bytes this rank moved.
    #[getter]
    fn bytes(&self) -> u64 {
        self.0.bytes
    }
    fn __repr__(&self) -> String {
        format!("BackupAck(index={}, node={})", self.0.index, self.0.node)
    }
}

/// A completed load, acked in submission order.
#[pyclass(frozen, module = "kvshard", name = "LoadAck")]
pub struct PyLoadAck(LoadAck);

#[pymethods]
impl PyLoadAck {
    /// Queue index.
    #[getter]
    fn index(&self) -> u64 {
        self.0.index
    }
    /// The node.
    #[getter]
    fn node(&self) -> u64 {
        self.0.node
    }
    /// Bytes this rank moved.
    #[getter]
    fn bytes(&self) -> u64 {
        self.0.bytes
    }
    fn __repr__(&self) -> String {
        format!("LoadAck(index={}, node={})", self.0.index, self.0.node)
    }
}

/// A submitted load: make a stream wait for one model layer with `wait_layer(stream, i)` (the
/// MTP draft's layer is ready with layer 0).
#[pyclass(frozen, module = "kvshard", name = "LoadHandle")]
pub struct PyLoadHandle {
    inner: LoadHandle,
    device: Py<PyDevice>,
}

#[pymethods]
impl PyLoadHandle {
    /// Queue index of the load.
    #[getter]
    fn index(&self) -> u64 {
        self.inner.index()
    }

    /// Model layers it tracks.
    fn __len__(&self) -> usize {
        self.inner.layers().len()
    }

    /// Makes later work on `stream` wait until model layer `layer` has landed, and no longer
    /// (cuStreamWaitEvent / cuStreamWaitValue32 on that stream: the host never waits).
    #[pyo3(signature = (stream, layer))]
    fn wait_layer(&self, stream: Option<&Bound<'_, PyAny>>, layer: usize) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        self.inner
            .wait_layer(b.as_ref(), ModelLayer(layer))
            .py_err()
    }
}

/// One rank's HiCache controller: a load stream with per-layer readiness, a backup stream that
/// waits for compute and acks in FIFO order, relayout streams, the host allocator, and a write
/// policy (a `WritePolicy`, default `WRITE_THROUGH`). Every call takes a `Route` (and `ctas=`,
/// the CTAs of its kernels): straight between the pools on an I/O backend, through device
/// staging, or `Route.AUTO` (the default): picked per call from the direction and pages.
#[pyclass(frozen, module = "kvshard", name = "HiCacheController")]
pub struct PyHiCacheController {
    pub(crate) inner: Mutex<HiCacheController>,
    pub(crate) device: Py<PyDevice>,
    streams: [Py<PyStream>; 5],
    #[allow(dead_code)]
    holds: (Py<PyDevicePool>, Py<PyHostPool>),
}

impl PyHiCacheController {
    /// kvshard's route, its kernel in the host-I/O shape of `ctas` CTAs on this device.
    pub(crate) fn route(&self, route: PyRoute, ctas: u32) -> PyResult<Route> {
        Ok(route.on(self.device.get().default_backend()?.as_ref(), ctas))
    }

    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut HiCacheController) -> kvshard::Result<R> + Send,
    ) -> PyResult<R> {
        py.detach(|| f(&mut lock(&self.inner))).py_err()
    }
}

#[pymethods]
impl PyHiCacheController {
    /// A controller between `device_pool` and `host_pool` (same geometry). `streams`: a dict
    /// with `load`, `backup`, `load_relayout`, `backup_relayout`, `tables` (kvshard.Stream or
    /// any stream object); missing ones are new streams of the device.
    #[new]
    #[pyo3(signature = (device_pool, host_pool, policy = PyWritePolicy::WRITE_THROUGH, streams = None))]
    fn new(
        py: Python<'_>,
        device_pool: Py<PyDevicePool>,
        host_pool: Py<PyHostPool>,
        policy: PyWritePolicy,
        streams: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let device = device_pool.get().device.clone_ref(py);
        let dev = device.bind(py);
        let mut made: Vec<Py<PyStream>> = Vec::with_capacity(5);
        for name in [
            "load",
            "backup",
            "load_relayout",
            "backup_relayout",
            "tables",
        ] {
            let given = match streams {
                Some(s) => s.get_item(name)?,
                None => None,
            };
            let stream = match given {
                Some(g) => {
                    let b = dev.get().resolve(Some(&g))?;
                    PyStream::new(b, device.clone_ref(py))
                }
                None => {
                    let b: Arc<dyn Backend> = match &dev.get().kind {
                        Kind::Cpu(c) => Arc::new(c.new_stream()),
                        Kind::Cuda(g) => {
                            Arc::new(kvshard::backend::cuda::CudaBackend::new(g.clone()).py_err()?)
                        }
                    };
                    PyStream::new(b, device.clone_ref(py))
                }
            };
            made.push(Py::new(py, stream)?);
        }
        let backend = |i: usize| made[i].get().backend.clone();
        let s = Streams {
            load: backend(0),
            backup: backend(1),
            load_relayout: backend(2),
            backup_relayout: backend(3),
            tables: backend(4),
        };
        let (d, h) = (
            device_pool.get().inner.clone(),
            host_pool.get().inner.clone(),
        );
        let policy = policy.into();
        let c = py
            .detach(|| HiCacheController::new(d, h, s, policy))
            .py_err()?;
        let streams: [Py<PyStream>; 5] = made
            .try_into()
            .map_err(|_| invalid("five streams expected"))?;
        Ok(Self {
            inner: Mutex::new(c),
            device,
            streams,
            holds: (device_pool, host_pool),
        })
    }

    /// The load stream.
    #[getter]
    fn load_stream(&self, py: Python<'_>) -> Py<PyStream> {
        self.streams[0].clone_ref(py)
    }

    /// The backup stream.
    #[getter]
    fn backup_stream(&self, py: Python<'_>) -> Py<PyStream> {
        self.streams[1].clone_ref(py)
    }

    /// Records an access (insertion or hit) of `node`; backs it up when the policy says so,
    /// after `after`: a kvshard or torch event, or a stream (its current point: the work
    /// queued on it so far); None is the current point of the stream `None` means. Returns the
    /// backup's queue index when one was submitted.
    #[pyo3(signature = (node, after, route = PyRoute::AUTO, *, ctas = 2))]
    fn access(
        &self,
        py: Python<'_>,
        node: &PyCacheNode,
        after: &Bound<'_, PyAny>,
        route: PyRoute,
        ctas: u32,
    ) -> PyResult<Option<u64>> {
        let route = self.route(route, ctas)?;
        let compute = self.compute(Some(after))?;
        let n = node.0.clone();
        self.with(py, |c| c.access(&n, &compute, route))
    }

    /// Backs `node` up after `after` (as in `access`): allocates its host pages, copies every
    /// layer of this rank's pages on the backup stream. Returns the queue index.
    #[pyo3(signature = (node, after, route = PyRoute::AUTO, *, ctas = 2))]
    fn backup(
        &self,
        py: Python<'_>,
        node: &PyCacheNode,
        after: &Bound<'_, PyAny>,
        route: PyRoute,
        ctas: u32,
    ) -> PyResult<u64> {
        let route = self.route(route, ctas)?;
        let compute = self.compute(Some(after))?;
        let n = node.0.clone();
        self.with(py, |c| c.backup(&n, &compute, route))
    }

    /// `node` is leaving the device pool (write-back backs it up first, after `after` as in
    /// `access`, blocking); returns the acks popped up to its backup.
    #[pyo3(signature = (node, after, route = PyRoute::AUTO, *, ctas = 2))]
    fn evict_sync(
        &self,
        py: Python<'_>,
        node: &PyCacheNode,
        after: &Bound<'_, PyAny>,
        route: PyRoute,
        ctas: u32,
    ) -> PyResult<Vec<PyBackupAck>> {
        let route = self.route(route, ctas)?;
        let compute = self.compute(Some(after))?;
        let n = node.0.clone();
        Ok(self
            .with(py, |c| c.evict_sync(&n, &compute, route))?
            .into_iter()
            .map(PyBackupAck)
            .collect())
    }

    /// Loads backed-up node `node` into logical `device_pages` on the load stream, after
    /// `after` when given (a kvshard or torch event, or a stream's current point; None: right
    /// away). `Route.KERNEL`: one launch with a ready counter per layer; copy-engine routes layer
    /// after layer; staged routes every layer at once.
    #[pyo3(signature = (node, device_pages, after = None, route = PyRoute::AUTO, *, ctas = 2))]
    fn load(
        &self,
        py: Python<'_>,
        node: u64,
        device_pages: Vec<u64>,
        after: Option<&Bound<'_, PyAny>>,
        route: PyRoute,
        ctas: u32,
    ) -> PyResult<PyLoadHandle> {
        let route = self.route(route, ctas)?;
        let after = after_event(self.device.get(), after)?;
        let pages = logical(&device_pages);
        let h = self.with(py, |c| c.load(node, &pages, after.as_ref(), route))?;
        Ok(PyLoadHandle {
            inner: h,
            device: self.device.clone_ref(py),
        })
    }

    /// Drops `node` from the host pool (refused while a transfer of it is in flight).
    fn free_host(&self, node: u64) -> PyResult<()> {
        lock(&self.inner).free_host(node).py_err()
    }

    /// Logical host pages of `node`, once its backup is acked.
    fn host_pages(&self, node: u64) -> Option<Vec<u64>> {
        lock(&self.inner).host_pages(node).map(raw)
    }

    /// How many backups, from the oldest, have completed (never blocks).
    fn poll_backups(&self) -> PyResult<usize> {
        lock(&self.inner).poll_backups().py_err()
    }

    /// How many loads, from the oldest, have completed (never blocks).
    fn poll_loads(&self) -> PyResult<usize> {
        lock(&self.inner).poll_loads().py_err()
    }

    /// Pops the `count` oldest backups (blocks until they completed).
    fn ack_backups_sync(&self, py: Python<'_>, count: usize) -> PyResult<Vec<PyBackupAck>> {
        Ok(self
            .with(py, |c| c.ack_backups_sync(count))?
            .into_iter()
            .map(PyBackupAck)
            .collect())
    }

    /// Pops the `count` oldest loads (blocks until they completed).
    fn ack_loads_sync(&self, py: Python<'_>, count: usize) -> PyResult<Vec<PyLoadAck>> {
        Ok(self
            .with(py, |c| c.ack_loads_sync(count))?
            .into_iter()
            .map(PyLoadAck)
            .collect())
    }

    /// Backups submitted, not acked.
    #[getter]
    fn pending_backups(&self) -> usize {
        lock(&self.inner).pending_backups()
    }

    /// Loads submitted, not acked.
    #[getter]
    fn pending_loads(&self) -> usize {
        lock(&self.inner).pending_loads()
    }

    /// Pages of each staging buffer of staged routes.
    #[getter]
    fn staging_pages(&self) -> u64 {
        lock(&self.inner).staging_pages()
    }

    /// Sets the pages of each staging buffer (refused while transfers are pending).
    fn set_staging_pages(&self, pages: u64) -> PyResult<()> {
        lock(&self.inner).set_staging_pages(pages).py_err()
    }

    /// Makes both directions' staging now (unless made), so the first staged backup and load
    /// allocate nothing: call it once at startup, and after `set_staging_pages`.
    fn prepare_staging(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| lock(&self.inner).prepare_staging()).py_err()
    }

    /// Device bytes of the staging made so far.
    #[getter]
    fn staging_bytes(&self) -> usize {
        lock(&self.inner).staging_bytes()
    }

    /// Free pages of the host allocator, per owner class.
    fn host_free_pages(&self, owner: u32) -> usize {
        lock(&self.inner).host_allocator().free_pages(owner)
    }

    /// The write policy.
    #[getter]
    fn policy(&self) -> PyWritePolicy {
        lock(&self.inner).policy().into()
    }
}

impl PyHiCacheController {
    /// The compute event of an `after` argument: None, or a torch event never recorded, is the
    /// current point of the stream `None` means (torch's current stream when torch is in use).
    fn compute(&self, after: Option<&Bound<'_, PyAny>>) -> PyResult<kvshard::backend::Event> {
        let d = self.device.get();
        match after_event(d, after)? {
            Some(e) => Ok(e),
            None => d.resolve(None)?.record().py_err(),
        }
    }
}
