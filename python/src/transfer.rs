//! P/D transfer, the prefill side: registrations, destinations, chunk statuses, pending chunks
//! and the per-rank sender (its copy methods, and the statuses of chunks dropped before they
//! were taken). The decode side's receiver is `receiver`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use kvshard::backend::{Backend, Launch};
use kvshard::copy::{BlockSpace, Method, RemoteSpace};
use kvshard::geometry::Component;
use kvshard::index::LocalPage;
use kvshard::transfer::{
    ChunkEnd, ChunkResult, ChunkStatus, ComponentBytes, PendingChunk, PoolLayout, Registration,
    Sender, StreamChoice, StreamTransport,
};

use crate::dcp::PyDecodeRegistration;
use crate::device::PyDevice;
use crate::device_pool::PyDevicePool;
use crate::errors::{invalid, IntoPy};
use crate::geometry::{PyCacheGeometry, PyComponent};
use crate::lock::lock;
use crate::method::PyMethod;
use crate::shard::logical;

/// Bytes per component as a dict (only components that moved bytes, in kernel order).
pub fn bytes_dict(b: &ComponentBytes) -> BTreeMap<PyComponent, u64> {
    Component::ALL
        .iter()
        .filter(|&&c| b.get(c) > 0)
        .map(|&c| (c.into(), b.get(c)))
        .collect()
}

/// How one side of a transfer stores its pages, as it registers them with the other side.
#[pyclass(frozen, module = "kvshard", name = "PoolLayout")]
#[derive(Clone)]
pub struct PyPoolLayout(pub PoolLayout);

#[pymethods]
impl PyPoolLayout {
    /// A side storing `pages` pages per layer of every component packed (every DevicePool).
    #[staticmethod]
    fn packed(geometry: &PyCacheGeometry, pages: u64) -> Self {
        Self(PoolLayout::packed(geometry.0.clone(), pages))
    }

    /// The layout of `pool`.
    #[staticmethod]
    fn of(pool: &PyDevicePool) -> Self {
        Self(PoolLayout::of(&pool.inner))
    }

    /// Geometry of the side's cache.
    #[getter]
    fn geometry(&self) -> PyCacheGeometry {
        PyCacheGeometry(self.0.geometry.clone())
    }

    /// Pages per layer.
    #[getter]
    fn pages(&self) -> u64 {
        self.0.pages
    }

    /// Bytes between consecutive pages of one layer, per component.
    #[getter]
    fn page_strides(&self) -> Vec<u64> {
        self.0.page_strides.clone()
    }
}

/// What the decode side registered for one request (sent to every prefill rank): destination
/// pages of each position after its cached prefix, and of the indexer state from position 0.
#[pyclass(frozen, module = "kvshard", name = "Registration")]
#[derive(Clone)]
pub struct PyRegistration(pub Registration);

#[pymethods]
impl PyRegistration {
    #[new]
    #[pyo3(signature = (request, layout, pages, state_pages, prefix_pages = 0))]
    fn new(
        request: u64,
        layout: &PyPoolLayout,
        pages: Vec<u64>,
        state_pages: Vec<u64>,
        prefix_pages: usize,
    ) -> PyResult<Self> {
        let r = Registration {
            request,
            layout: layout.0.clone(),
            prefix_pages,
            pages: pages.into_iter().map(LocalPage).collect(),
            state_pages: state_pages.into_iter().map(LocalPage).collect(),
        };
        r.validate().py_err()?;
        Ok(Self(r))
    }

    /// Request id.
    #[getter]
    fn request(&self) -> u64 {
        self.0.request
    }

    /// The decode pool's layout.
    #[getter]
    fn layout(&self) -> PyPoolLayout {
        PyPoolLayout(self.0.layout.clone())
    }

    /// Leading pages the decode already holds.
    #[getter]
    fn prefix_pages(&self) -> usize {
        self.0.prefix_pages
    }

    /// Destination page of each position from `prefix_pages` on.
    #[getter]
    fn pages(&self) -> Vec<u64> {
        self.0.pages.iter().map(|p| p.0).collect()
    }

    /// Destination page of the indexer state of each position from 0 on.
    #[getter]
    fn state_pages(&self) -> Vec<u64> {
        self.0.state_pages.iter().map(|p| p.0).collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "Registration(request={}, prefix_pages={}, {} pages)",
            self.0.request,
            self.0.prefix_pages,
            self.0.pages.len()
        )
    }
}

/// A destination of P/D transfers as this process's kernels reach it: a pool of this process
/// (`RemoteSpace.of(pool)`), or raw addresses another transport mapped
/// (`RemoteSpace.from_addresses`).
#[pyclass(frozen, module = "kvshard", name = "RemoteSpace")]
pub struct PyRemoteSpace {
    pub inner: Arc<RemoteSpace>,
    #[allow(dead_code)]
    keep: Option<Py<PyAny>>,
}

#[pymethods]
impl PyRemoteSpace {
    /// The destination `pool` (of this process) describes; it keeps the pool alive.
    #[staticmethod]
    fn of(pool: Py<PyDevicePool>) -> PyResult<Self> {
        let p = pool.get();
        let space = RemoteSpace::of(p.inner.clone(), p.inner.geometry().clone()).py_err()?;
        Ok(Self {
            inner: Arc::new(space),
            keep: Some(pool.into_any()),
        })
    }

    /// A destination at raw addresses of `device`: `bases[c][l]` is stored layer `l` of
    /// component `c` (in `geometry.components()` order), each holding `pages` packed blocks.
    /// The caller guarantees the memory is mapped, writable by this device's kernels, and
    /// stays so while the space and any transfer into it are alive (`keep` is held meanwhile).
    #[staticmethod]
    #[pyo3(signature = (device, geometry, pages, bases, keep = None))]
    fn from_addresses(
        device: &PyDevice,
        geometry: &PyCacheGeometry,
        pages: u64,
        bases: Vec<Vec<u64>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        // SAFETY: the Python API's documented contract (above): the caller vouches for the
        // addresses, as a network transport vouches for memory it registered.
        let space = unsafe {
            RemoteSpace::from_raw(
                device.space(),
                geometry.0.clone(),
                pages,
                bases,
                Arc::new(()),
            )
        }
        .py_err()?;
        Ok(Self {
            inner: Arc::new(space),
            keep,
        })
    }

    /// The destination's geometry.
    #[getter]
    fn geometry(&self) -> PyCacheGeometry {
        PyCacheGeometry(self.inner.geometry().clone())
    }

    /// Pages per layer.
    #[getter]
    fn pages(&self) -> u64 {
        self.inner.pages()
    }
}

/// One rank's report on one chunk of one request: what the decode side must hear.
#[pyclass(frozen, module = "kvshard", name = "ChunkStatus")]
#[derive(Clone)]
pub struct PyChunkStatus(pub ChunkStatus);

#[pymethods]
impl PyChunkStatus {
    /// A sent chunk's status (as it arrives over the wire): `bytes` per component.
    #[staticmethod]
    #[pyo3(signature = (request, rank, chunk, last, bytes = None))]
    fn sent(
        request: u64,
        rank: u32,
        chunk: u32,
        last: bool,
        bytes: Option<BTreeMap<PyComponent, u64>>,
    ) -> Self {
        let mut b = ComponentBytes::default();
        for (c, n) in bytes.unwrap_or_default() {
            b.add(c.into(), n);
        }
        Self(ChunkStatus {
            request,
            rank,
            chunk,
            result: ChunkResult::Sent { bytes: b, last },
        })
    }

    /// A failed chunk's status (as it arrives over the wire).
    #[staticmethod]
    fn failed(request: u64, rank: u32, chunk: u32, reason: String) -> Self {
        Self(ChunkStatus {
            request,
            rank,
            chunk,
            result: ChunkResult::Failed { reason },
        })
    }

    /// Request id.
    #[getter]
    fn request(&self) -> u64 {
        self.0.request
    }

    /// The reporting prefill rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.0.rank
    }

    /// Index of the chunk in the request's send order.
    #[getter]
    fn chunk(&self) -> u32 {
        self.0.chunk
    }

    /// Whether the chunk's bytes landed (False: it failed).
    #[getter]
    fn ok(&self) -> bool {
        matches!(self.0.result, ChunkResult::Sent { .. })
    }

    /// Whether this was the request's final chunk.
    #[getter]
    fn last(&self) -> bool {
        matches!(self.0.result, ChunkResult::Sent { last: true, .. })
    }

    /// Whether this is the rank's last status for the request.
    #[getter]
    fn terminal(&self) -> bool {
        self.0.is_terminal()
    }

    /// Bytes moved per component.
    #[getter]
    fn bytes(&self) -> BTreeMap<PyComponent, u64> {
        match &self.0.result {
            ChunkResult::Sent { bytes, .. } => bytes_dict(bytes),
            ChunkResult::Failed { .. } => BTreeMap::new(),
        }
    }

    /// Why it failed (None when sent).
    #[getter]
    fn reason(&self) -> Option<String> {
        match &self.0.result {
            ChunkResult::Failed { reason } => Some(reason.clone()),
            ChunkResult::Sent { .. } => None,
        }
    }

    fn __repr__(&self) -> String {
        format!("<kvshard.ChunkStatus {}>", self.0)
    }
}

/// A chunk on its way: poll it, or wait for it. Its status must reach the decode side.
#[pyclass(frozen, module = "kvshard", name = "PendingChunk")]
pub struct PyPendingChunk {
    inner: Mutex<Option<PendingChunk>>,
    /// The spaces the copies touch (kept until the chunk has landed): the pool, and the
    /// destination of every decode rank.
    #[allow(dead_code)]
    holds: (Py<PyDevicePool>, Vec<Py<PyRemoteSpace>>),
}

/// `poll` of a chunk held until it is waited for (every transport's Python chunk): its status
/// once landed, None while it moves, a failure as `ChunkFailedError`; the GIL released.
pub(crate) fn poll_held(
    py: Python<'_>,
    held: &Mutex<Option<PendingChunk>>,
) -> PyResult<Option<PyChunkStatus>> {
    let status = py.detach(|| lock(held).as_mut().map(|p| p.poll()));
    Ok(status
        .ok_or_else(|| invalid("the chunk was already waited for"))?
        .py_err()?
        .map(PyChunkStatus))
}

/// `wait_sync` of a chunk held until it is waited for: takes it and waits (the GIL released), once.
pub(crate) fn wait_held(
    py: Python<'_>,
    held: &Mutex<Option<PendingChunk>>,
) -> PyResult<PyChunkStatus> {
    let p = lock(held)
        .take()
        .ok_or_else(|| invalid("the chunk was already waited for"))?;
    Ok(PyChunkStatus(py.detach(|| p.wait_sync()).py_err()?))
}

#[pymethods]
impl PyPendingChunk {
    /// The chunk's status once it has landed, None while it is moving; a failure raises
    /// `ChunkFailedError` (its `status` is what to deliver).
    fn poll(&self, py: Python<'_>) -> PyResult<Option<PyChunkStatus>> {
        poll_held(py, &self.inner)
    }

    /// Waits until the chunk has landed and returns its status (once).
    fn wait_sync(&self, py: Python<'_>) -> PyResult<PyChunkStatus> {
        wait_held(py, &self.inner)
    }

    /// `poll`, with the status as each decode rank must receive it: one per decode rank (one
    /// for an unsharded decode), in rank order, each with the bytes that reached that rank.
    fn poll_each(&self, py: Python<'_>) -> PyResult<Option<Vec<PyChunkStatus>>> {
        let statuses = py.detach(|| lock(&self.inner).as_mut().map(|p| p.poll_each()));
        Ok(statuses
            .ok_or_else(|| invalid("the chunk was already waited for"))?
            .py_err()?
            .map(|s| s.into_iter().map(PyChunkStatus).collect()))
    }

    /// `wait_sync`, with the status each decode rank must receive (`poll_each`), once.
    fn wait_each_sync(&self, py: Python<'_>) -> PyResult<Vec<PyChunkStatus>> {
        let p = lock(&self.inner)
            .take()
            .ok_or_else(|| invalid("the chunk was already waited for"))?;
        let statuses = py.detach(|| p.wait_each_sync()).py_err()?;
        Ok(statuses.into_iter().map(PyChunkStatus).collect())
    }

    /// Decode ranks the chunk is reported to (1 for an unsharded decode).
    #[getter]
    fn decode_ranks(&self) -> Option<usize> {
        lock(&self.inner).as_ref().map(|p| p.decode_ranks())
    }

    /// Request id.
    #[getter]
    fn request(&self) -> Option<u64> {
        lock(&self.inner).as_ref().map(|p| p.request())
    }

    /// The chunk's index.
    #[getter]
    fn chunk(&self) -> Option<u32> {
        lock(&self.inner).as_ref().map(|p| p.chunk())
    }

    /// Whether it is the request's final chunk.
    #[getter]
    fn last(&self) -> Option<bool> {
        lock(&self.inner).as_ref().map(|p| p.is_last())
    }

    /// Bytes it moves, per component.
    #[getter]
    fn bytes(&self) -> BTreeMap<PyComponent, u64> {
        lock(&self.inner)
            .as_ref()
            .map(|p| bytes_dict(&p.bytes()))
            .unwrap_or_default()
    }
}

/// The sending side of one prefill rank: plans and enqueues every chunk of its requests from
/// its pool into each request's destination (in-process: the same GPU, a peer-mapped pool, or
/// the CPU reference), on the stream each `send` names (default: `stream` given here; when
/// that is None too, the stream None means at the time of the `send`: torch's current stream
/// when torch is in use).
/// `method`: a `Method` (default `KERNEL`: one block-copy launch per section; `RANGE_KERNEL`,
/// `COPY_ENGINE` and `PER_BLOCK` too, `BATCHED_COPY_ENGINE` raises); `launch`: `(ctas, threads)`
/// of the kernels (default: the grid kvshard picks for each launch's blocks). A chunk's `PendingChunk` must be polled or waited for:
/// one dropped before that fails its request, and `take_dropped` hands out the status to
/// deliver.
#[pyclass(module = "kvshard", name = "Sender")]
pub struct PySender {
    pub(crate) inner: Mutex<Sender>,
    /// The stream the next submission enqueues on, and the default (None: resolved at each
    /// `send`, since torch's current stream may change between sends).
    current: StreamChoice,
    default: Option<Arc<dyn Backend>>,
    pool: Py<PyDevicePool>,
    /// The destinations of each open request (one per decode rank).
    dst: Mutex<BTreeMap<u64, Vec<Py<PyRemoteSpace>>>>,
}

#[pymethods]
impl PySender {
    #[new]
    #[pyo3(signature = (pool, stream = None, method = PyMethod::KERNEL, launch = None))]
    fn new(
        pool: Py<PyDevicePool>,
        stream: Option<&Bound<'_, PyAny>>,
        method: PyMethod,
        launch: Option<(u32, u32)>,
    ) -> PyResult<Self> {
        let p = pool.get();
        let b = p.device.get().resolve(stream)?;
        let default = stream.filter(|s| !s.is_none()).map(|_| b.clone());
        let grid = match (launch, Method::default_for(b.as_ref())) {
            (Some((ctas, threads)), _) => Launch { ctas, threads },
            (None, default) => default
                .launch()
                .unwrap_or_else(|| Launch::host_io(b.as_ref(), 264)),
        };
        // The block kernel with no launch given: each launch's grid picked from its blocks.
        let method =
            (launch.is_some() || method != PyMethod::KERNEL).then(|| method.with_launch(grid));
        // Refused here, before any request: the transport of this stream is the first one.
        let (transport, current) = StreamTransport::new(b, method).py_err()?;
        Ok(Self {
            inner: Mutex::new(Sender::new(p.inner.clone(), Box::new(transport))),
            current,
            default,
            pool,
            dst: Mutex::new(BTreeMap::new()),
        })
    }

    /// This sender's rank.
    #[getter]
    fn rank(&self) -> u32 {
        lock(&self.inner).rank()
    }

    /// Starts sending a request the decode side registered into `dst`.
    fn open(
        &self,
        py: Python<'_>,
        registration: &PyRegistration,
        dst: Py<PyRemoteSpace>,
    ) -> PyResult<()> {
        let request = registration.0.request;
        lock(&self.inner)
            .open(registration.0.clone(), dst.get().inner.clone())
            .py_err()?;
        lock(&self.dst).insert(request, vec![dst.clone_ref(py)]);
        Ok(())
    }

    /// Starts sending a request the ranks of a decode server sharded by token registered
    /// (a `DecodeRegistration`) into `dsts`, each decode rank's destination in rank order.
    /// Each chunk goes to every decode rank owning one of its tokens, in one launch; its
    /// `PendingChunk.poll_each` / `wait_each_sync` give the status for each decode rank.
    fn open_decode(
        &self,
        py: Python<'_>,
        registration: &PyDecodeRegistration,
        dsts: Vec<Py<PyRemoteSpace>>,
    ) -> PyResult<()> {
        let request = registration.0.request;
        let spaces = dsts.iter().map(|d| d.get().inner.clone()).collect();
        lock(&self.inner)
            .open_decode(registration.0.clone(), spaces)
            .py_err()?;
        let held = dsts.iter().map(|d| d.clone_ref(py)).collect();
        lock(&self.dst).insert(request, held);
        Ok(())
    }

    /// Enqueues the next chunk of `request` on `stream` (default: the sender's; nothing
    /// waits): `pages` is the request's logical page of every position prefilled so far, `end`
    /// the tokens prefilled so far, `last` (required, keyword-only: a forgotten final chunk
    /// would leave the decode side waiting) whether this is the final chunk (it carries the
    /// indexer state; a rank owning nothing still sends it). A chunk that cannot be planned or
    /// enqueued raises `ChunkFailedError` (deliver its `status`).
    #[pyo3(signature = (request, pages, end, *, last, stream = None))]
    fn send(
        &self,
        py: Python<'_>,
        request: u64,
        pages: Vec<u64>,
        end: usize,
        last: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyPendingChunk> {
        let backend = match (stream.filter(|s| !s.is_none()), &self.default) {
            (None, Some(default)) => default.clone(),
            (given, _) => self.pool.get().device.get().resolve(given)?,
        };
        let dst = lock(&self.dst)
            .get(&request)
            .map(|d| d.iter().map(|d| d.clone_ref(py)).collect::<Vec<_>>())
            .ok_or_else(|| {
                PyErr::from(crate::errors::KvError(kvshard::Error::Transfer {
                    request,
                    reason: "not open on this sender".into(),
                }))
            })?;
        let end = if last {
            ChunkEnd::Final(end)
        } else {
            ChunkEnd::Partial(end)
        };
        let pages = logical(&pages);
        let result = py.detach(|| {
            let mut sender = lock(&self.inner);
            self.current.set(backend);
            sender.send(request, &pages, end)
        });
        if last || result.is_err() {
            lock(&self.dst).remove(&request);
        }
        Ok(PyPendingChunk {
            inner: Mutex::new(Some(result.py_err()?)),
            holds: (self.pool.clone_ref(py), dst),
        })
    }

    /// Gives up on `request` on this rank; returns the failed status to deliver (the failure of
    /// a chunk of it dropped unpolled, when there is one).
    fn abort(&self, request: u64, reason: &str) -> PyResult<PyChunkStatus> {
        lock(&self.dst).remove(&request);
        Ok(PyChunkStatus(
            lock(&self.inner).abort(request, reason).py_err()?,
        ))
    }

    /// Closes `request` on this rank without a status of its own: after a chunk of it failed
    /// while moving (`poll` or `wait_sync` raised `ChunkFailedError`), whose `status` already is
    /// the rank's last for the request. A request not open is a `TransferError`.
    fn close(&self, request: u64) -> PyResult<()> {
        lock(&self.dst).remove(&request);
        lock(&self.inner).close(request).py_err()
    }

    /// The failed statuses of chunks whose `PendingChunk` was dropped (garbage-collected)
    /// before it was polled to a status or waited for, one per request (its earliest dropped
    /// chunk), each handed out once. Their requests are closed here; deliver each status to
    /// the decode side, which otherwise waits for it until the request's deadline. Call it
    /// every scheduling step: a dropped final chunk is reported nowhere else.
    fn take_dropped(&self) -> Vec<PyChunkStatus> {
        let statuses = lock(&self.inner).take_dropped();
        let mut dst = lock(&self.dst);
        statuses
            .into_iter()
            .map(|s| {
                dst.remove(&s.request);
                PyChunkStatus(s)
            })
            .collect()
    }

    /// Requests open on this rank.
    #[getter]
    fn pending_requests(&self) -> usize {
        lock(&self.inner).pending_requests()
    }

    /// Bytes this rank has enqueued, per component.
    #[getter]
    fn bytes_sent(&self) -> BTreeMap<PyComponent, u64> {
        bytes_dict(&lock(&self.inner).bytes_sent())
    }
}
