//! Devices, streams and events: where kvshard's work runs, on the caller's streams.
//!
//! A [`PyDevice`] is the CPU reference backend or one GPU. Every enqueueing call takes a stream:
//! `None` (on a GPU, torch's current stream when the process uses torch, else the legacy
//! default stream; on the CPU backend, the arena's first stream), a [`PyStream`], an int
//! `CUstream` handle, or any object with a `cuda_stream` attribute (`torch.cuda.Stream`), the
//! CUDA stream protocol's `__cuda_stream__` (`(version, handle)`: cuda.core, CuPy, Numba) or a
//! `ptr` attribute (older CuPy).
//!
//! Per call, a foreign stream costs one attribute read and one map lookup: its handle is read
//! (interned attribute names, no exception on the way for the common shapes) and the backend
//! wrapping that handle is made once per device and kept, keyed by the handle (events come from
//! the GPU's pool). The contract this rests on: a CUDA handle names at most one live stream at a
//! time, and a wrapper's only state is the handle and kvshard's own status words, so when the
//! caller destroys a stream and CUDA hands the same handle to a new one, the kept wrapper
//! enqueues on the new stream, which is right; enqueueing on a stream the caller has destroyed
//! (and nothing replaced) is the caller's error, exactly as with the raw handle. An `after=` argument also takes events: a [`PyEvent`] or a
//! `torch.cuda.Event` (any object with a `cuda_event` handle); see [`after_event`]. kvshard
//! enqueues on the caller's stream and never synchronizes it behind the caller's back (the
//! first use of a CUDA stream zeroes kvshard's two status words on it, stream-ordered, without
//! waiting).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use pyo3::exceptions::PyAttributeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyInt, PyString, PyType};

use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{AddressSpace, Backend, Event};
use kvshard::gpu::Gpu;

use crate::errors::{invalid, IntoPy, KvError};
use crate::lock::lock;

/// What a device is.
pub enum Kind {
    /// The CPU reference backend: its arena (and stream 0 of it).
    Cpu(Arc<CpuBackend>),
    /// A GPU.
    Cuda(Arc<Gpu>),
}

/// A device: the CPU reference backend (`Device.cpu()`) or a GPU (`Device.cuda(ordinal)`),
/// with the streams kvshard has been handed on it.
///
/// Every kvshard object lives on one device; calls refuse streams of another one. A stream
/// argument of `None` means, on a GPU, torch's current stream of this GPU
/// (`torch.cuda.current_stream(ordinal)`) when torch is loaded (kvshard never imports it) and
/// has initialized CUDA, and the legacy default stream otherwise (torch's default stream, the
/// only one it can have before that); on the CPU backend, the arena's first stream.
#[pyclass(frozen, module = "kvshard", name = "Device")]
pub struct PyDevice {
    pub kind: Kind,
    /// The default stream: the CPU arena's stream 0, or the GPU's legacy default stream.
    default: Mutex<Option<Arc<dyn Backend>>>,
    /// CUDA streams borrowed so far, by handle.
    streams: Mutex<HashMap<usize, Arc<dyn Backend>>>,
    /// A stream of kvshard's that turns foreign CUDA events (`torch.cuda.Event`) into kvshard
    /// events: it waits for the foreign event and records one of its own. Made on first use;
    /// the lock also keeps one wait and its record together.
    carrier: Mutex<Option<Arc<CudaBackend>>>,
}

impl PyDevice {
    /// The CPU reference backend, when this is it.
    pub fn cpu(&self) -> Option<&Arc<CpuBackend>> {
        match &self.kind {
            Kind::Cpu(b) => Some(b),
            Kind::Cuda(_) => None,
        }
    }

    /// The GPU, when this is one.
    pub fn gpu(&self) -> Option<&Arc<Gpu>> {
        match &self.kind {
            Kind::Cuda(g) => Some(g),
            Kind::Cpu(_) => None,
        }
    }

    /// The address space of this device's memory.
    pub fn space(&self) -> AddressSpace {
        match &self.kind {
            Kind::Cpu(b) => b.address_space(),
            Kind::Cuda(g) => AddressSpace::Cuda(g.info().ordinal),
        }
    }

    /// The default stream's backend.
    pub fn default_backend(&self) -> PyResult<Arc<dyn Backend>> {
        let mut d = lock(&self.default);
        if let Some(b) = d.as_ref() {
            return Ok(b.clone());
        }
        let b: Arc<dyn Backend> = match &self.kind {
            Kind::Cpu(b) => b.clone(),
            Kind::Cuda(_) => self.borrowed(0)?,
        };
        *d = Some(b.clone());
        Ok(b)
    }

    /// The backend enqueuing on CUDA stream `handle` (0: the legacy default stream), made on
    /// first use.
    fn borrowed(&self, handle: usize) -> PyResult<Arc<dyn Backend>> {
        let Kind::Cuda(gpu) = &self.kind else {
            return Err(invalid(format!(
                "a CUDA stream handle ({handle:#x}) given to the CPU device; pass a kvshard.Stream of it, or None"
            )));
        };
        let mut streams = lock(&self.streams);
        if let Some(b) = streams.get(&handle) {
            return Ok(b.clone());
        }
        // SAFETY: the handle is the caller's stream of this device's primary context (the
        // Python API's documented contract: a live stream of this GPU, kept alive while kvshard
        // may enqueue on it), or 0, the legacy default stream, which always exists.
        let stream = unsafe { gpu.borrow_stream(handle as sys::CUstream) };
        let backend: Arc<dyn Backend> =
            Arc::new(CudaBackend::with_stream(gpu.clone(), stream).py_err()?);
        streams.insert(handle, backend.clone());
        Ok(backend)
    }

    /// The backend for a Python stream argument (see the module docs).
    pub fn resolve(&self, stream: Option<&Bound<'_, PyAny>>) -> PyResult<Arc<dyn Backend>> {
        let Some(s) = stream.filter(|s| !s.is_none()) else {
            return self.implicit();
        };
        if let Ok(own) = s.cast::<PyStream>() {
            let own = own.get();
            if own.backend.address_space() != self.space() {
                return Err(invalid(format!(
                    "a stream of {} used with {}",
                    own.backend.address_space(),
                    self.space()
                )));
            }
            return Ok(own.backend.clone());
        }
        self.borrowed(stream_handle(s)?)
    }

    /// The stream a `None` stream argument means: on a GPU, torch's current stream when the
    /// process uses torch (the stream the engine's own kernels are on), else the default.
    fn implicit(&self) -> PyResult<Arc<dyn Backend>> {
        if let Kind::Cuda(gpu) = &self.kind {
            let ordinal = gpu.info().ordinal;
            if let Some(handle) = Python::attach(|py| torch_current_stream(py, ordinal))? {
                return self.borrowed(handle);
            }
        }
        self.default_backend()
    }

    /// A kvshard event that completes once the foreign CUDA event `raw` (of this GPU's
    /// context) has: the carrier stream waits for `raw`, then records. None for handle 0 (torch
    /// creates its event on the first record: one never recorded is nothing to wait for).
    fn foreign_event(&self, raw: usize) -> PyResult<Option<Event>> {
        let Kind::Cuda(gpu) = &self.kind else {
            return Err(invalid(format!(
                "a CUDA event (handle {raw:#x}) given to the CPU device; pass a kvshard.Event, a kvshard.Stream or None"
            )));
        };
        if raw == 0 {
            return Ok(None);
        }
        let mut carrier = lock(&self.carrier);
        let c = match carrier.as_ref() {
            Some(c) => c.clone(),
            None => {
                let c = Arc::new(CudaBackend::new(gpu.clone()).py_err()?);
                *carrier = Some(c.clone());
                c
            }
        };
        gpu.bind().py_err()?;
        // SAFETY: the carrier's stream is kvshard's own, alive with `c`; `raw` is the caller's
        // live event of this device's primary context (the documented contract of `after=`,
        // as for stream handles). A wait on an event never recorded is a no-op in CUDA.
        unsafe {
            cudarc::driver::result::stream::wait_event(
                c.stream().raw(),
                raw as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|source| {
            PyErr::from(KvError(kvshard::Error::Driver {
                call: "cuStreamWaitEvent",
                source,
            }))
        })?;
        c.record().py_err().map(Some)
    }
}

/// `sys.modules`, looked up once: torch counts as in use when it is in there (kvshard never
/// imports it).
static SYS_MODULES: PyOnceLock<Py<PyDict>> = PyOnceLock::new();

/// torch's "current raw stream" getter, once torch has initialized CUDA: initialized never
/// becomes uninitialized in a process, so after that a `None` stream costs one call into torch
/// (`torch._C._cuda_getCurrentRawStream(ordinal)`, the int handle torch's own generated code
/// uses; `torch.cuda.current_stream(ordinal).cuda_stream` where a torch lacks it).
static TORCH_RAW_STREAM: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The raw handle of torch's current stream on GPU `ordinal`, when the process has loaded torch
/// and torch has initialized CUDA. Before that torch's current stream can only be its default
/// stream, the legacy default stream kvshard's default already is, and asking torch would
/// initialize its CUDA state behind the engine's back.
fn torch_current_stream(py: Python<'_>, ordinal: usize) -> PyResult<Option<usize>> {
    if let Some(getter) = TORCH_RAW_STREAM.get(py) {
        return getter.bind(py).call1((ordinal,))?.extract().map(Some);
    }
    let modules = SYS_MODULES.get_or_try_init(py, || -> PyResult<Py<PyDict>> {
        Ok(py
            .import("sys")?
            .getattr("modules")?
            .cast_into::<PyDict>()?
            .unbind())
    })?;
    let Some(torch) = modules.bind(py).get_item("torch")? else {
        return Ok(None);
    };
    let cuda = torch.getattr("cuda")?;
    if !cuda.call_method0("is_initialized")?.is_truthy()? {
        return Ok(None);
    }
    let getter = match torch
        .getattr("_C")
        .and_then(|c| c.getattr("_cuda_getCurrentRawStream"))
    {
        Ok(raw) => raw.unbind(),
        Err(_) => py
            .eval(
                c"lambda c: lambda ordinal: c.current_stream(ordinal).cuda_stream",
                None,
                None,
            )?
            .call1((cuda,))?
            .unbind(),
    };
    let getter = TORCH_RAW_STREAM.get_or_init(py, || getter);
    getter.bind(py).call1((ordinal,))?.extract().map(Some)
}

/// Where a stream object's handle is: torch's `cuda_stream`, the CUDA stream protocol's
/// `__cuda_stream__` (a method or attribute giving `(version, handle)`), or `ptr` (older CuPy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HandleAttribute {
    CudaStream,
    Protocol,
    Ptr,
}

impl HandleAttribute {
    /// In the order they are tried.
    const ALL: [Self; 3] = [Self::CudaStream, Self::Protocol, Self::Ptr];

    fn name<'py>(self, py: Python<'py>) -> &'py Bound<'py, PyString> {
        match self {
            Self::CudaStream => intern!(py, "cuda_stream"),
            Self::Protocol => intern!(py, "__cuda_stream__"),
            Self::Ptr => intern!(py, "ptr"),
        }
    }

    /// The handle `s` gives through this attribute: None when it has no such attribute or the
    /// value is no handle; a property's own error propagates.
    fn read(self, s: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let Some(v) = attribute(s, self.name(s.py()))? else {
            return Ok(None);
        };
        Ok(match self {
            Self::Protocol => {
                let v = if v.is_callable() { v.call0()? } else { v };
                v.extract::<(usize, usize)>().ok().map(|(_version, h)| h)
            }
            Self::CudaStream | Self::Ptr => v.extract::<usize>().ok(),
        })
    }
}

/// Types whose handle attribute is known (up to [`KNOWN_TYPES`]; each entry holds its type, so
/// a type's identity is never reused while it is here): the first stream of a type pays for
/// the attributes it lacks (an exception each), later ones read the one that answered.
static HANDLE_TYPES: Mutex<Vec<(Py<PyType>, HandleAttribute)>> = Mutex::new(Vec::new());
const KNOWN_TYPES: usize = 16;

/// The raw handle of a stream object: an int, or its `cuda_stream` (torch), `__cuda_stream__`
/// (the CUDA stream protocol) or `ptr` (older CuPy), tried in that order. Per call it costs a
/// type check, one lookup of the object's type among those seen, and one attribute read: ints
/// are recognised by type, attribute names are interned, and a type's missing attributes (each
/// a raised exception) are probed once.
pub fn stream_handle(s: &Bound<'_, PyAny>) -> PyResult<usize> {
    let handle = if s.is_instance_of::<PyInt>() {
        s.extract::<usize>().ok()
    } else {
        let ty = s.get_type();
        let known = lock(&HANDLE_TYPES)
            .iter()
            .find(|(t, _)| t.is(&ty))
            .map(|&(_, a)| a);
        match known {
            // An instance may lack what its type's first instance had: probe it in full.
            Some(a) => match a.read(s)? {
                Some(h) => Some(h),
                None => probe(s)?,
            },
            None => probe(s)?,
        }
    };
    handle.ok_or_else(|| {
        invalid(format!(
            "a stream must be None, a kvshard.Stream, an int CUstream handle, or an object with a `cuda_stream` (torch), `__cuda_stream__` (the CUDA stream protocol: (version, handle)) or `ptr` (CuPy) attribute; got {}",
            s.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })
}

/// Every handle attribute of `s` in order; the first that answers is remembered for its type.
fn probe(s: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    for a in HandleAttribute::ALL {
        if let Some(h) = a.read(s)? {
            let mut known = lock(&HANDLE_TYPES);
            let ty = s.get_type();
            if known.len() < KNOWN_TYPES && !known.iter().any(|(t, _)| t.is(&ty)) {
                known.push((ty.unbind(), a));
            }
            return Ok(Some(h));
        }
    }
    Ok(None)
}

/// Attribute `name` of `s`, None when it has none (any other error raised by a property is the
/// caller's and propagates).
fn attribute<'py>(
    s: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    match s.getattr(name) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_instance_of::<PyAttributeError>(s.py()) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The handle `stream_handle` reads from `stream` (not part of the public API: the tests of
/// its conversions, which run without a GPU).
#[pyfunction]
pub fn _stream_handle(stream: &Bound<'_, PyAny>) -> PyResult<usize> {
    stream_handle(stream)
}

#[pymethods]
impl PyDevice {
    /// The CPU reference backend: the twin of every kernel, on an address space of its own,
    /// its streams in `order`: `"immediate"` (every operation runs when it is enqueued),
    /// `"deferred"` (work runs only when something waits for it, so per-layer readiness is
    /// observable without a GPU) or `"adversarial"` (deferred, and at each host wait a coin
    /// seeded with `seed` runs the other streams first or last: a missing dependency between
    /// streams then reads old bytes or has its bytes overwritten). `None`: the order the
    /// `KVSHARD_CPU_STREAMS` environment variable names (`immediate` when unset). `seed` only
    /// with `"adversarial"`; anything else raises `InvalidArgumentError`.
    #[staticmethod]
    #[pyo3(name = "cpu", signature = (order = None, seed = None))]
    fn cpu_backend(order: Option<&str>, seed: Option<u64>) -> PyResult<Self> {
        let order = match (order, seed) {
            (None, None) => return Ok(Self::of(Kind::Cpu(Arc::new(CpuBackend::new())))),
            (Some("immediate"), None) => StreamOrder::Immediate,
            (Some("deferred"), None) => StreamOrder::Deferred,
            (Some("adversarial"), seed) => StreamOrder::Adversarial(seed.unwrap_or(0)),
            (order, Some(seed)) => {
                return Err(invalid(format!(
                    "seed={seed} with order={order:?}: a seed picks the adversarial order's coin"
                )))
            }
            (Some(other), None) => {
                return Err(invalid(format!(
                    "order={other:?}: expected \"immediate\", \"deferred\" or \"adversarial\""
                )))
            }
        };
        Ok(Self::of(Kind::Cpu(Arc::new(CpuBackend::with_order(order)))))
    }

    /// GPU `ordinal` (its primary context, the one torch uses). Raises `UnavailableError`
    /// without a driver, a GPU, or kernels in this build.
    #[staticmethod]
    #[pyo3(signature = (ordinal = 0))]
    fn cuda(py: Python<'_>, ordinal: usize) -> PyResult<Self> {
        let gpu = py.detach(|| Gpu::open(ordinal)).py_err()?;
        Ok(Self::of(Kind::Cuda(gpu)))
    }

    /// `"cpu"` or `"cuda"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match self.kind {
            Kind::Cpu(_) => "cpu",
            Kind::Cuda(_) => "cuda",
        }
    }

    /// The CUDA ordinal (`None` for the CPU backend).
    #[getter]
    fn ordinal(&self) -> Option<usize> {
        self.gpu().map(|g| g.info().ordinal)
    }

    /// The GPU's name, compute capability and SM count (`None` for the CPU backend).
    #[getter]
    fn info(&self) -> Option<(String, (i32, i32), u32)> {
        self.gpu().map(|g| {
            let i = g.info();
            (i.name.clone(), i.compute_capability, i.sm_count)
        })
    }

    /// A kvshard stream on the caller's stream `stream` (an int handle, a `torch.cuda.Stream`,
    /// a CuPy stream), or on the stream `None` means (torch's current stream on a GPU when the
    /// process uses torch, else the default stream). Wrapping a CUDA stream zeroes
    /// kvshard's status words on it and waits for that once; later calls with the same stream
    /// reuse the wrapper and never synchronize.
    #[pyo3(signature = (stream = None))]
    fn stream(slf: &Bound<'_, Self>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<PyStream> {
        let d = slf.get();
        let backend = d.resolve(stream)?;
        Ok(PyStream::new(backend, slf.clone().unbind()))
    }

    /// A new stream owned by kvshard (CPU: another stream of the arena; CUDA: a non-blocking
    /// stream).
    fn new_stream(slf: &Bound<'_, Self>) -> PyResult<PyStream> {
        let d = slf.get();
        let backend: Arc<dyn Backend> = match &d.kind {
            Kind::Cpu(b) => Arc::new(b.new_stream()),
            Kind::Cuda(g) => Arc::new(CudaBackend::new(g.clone()).py_err()?),
        };
        Ok(PyStream::new(backend, slf.clone().unbind()))
    }

    /// Waits for the default stream and every stream kvshard has been handed, then reports
    /// the first input any kernel rejected.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let mut all: Vec<Arc<dyn Backend>> = lock(&self.streams).values().cloned().collect();
        all.push(self.default_backend()?);
        py.detach(|| all.iter().try_for_each(|b| b.synchronize()))
            .py_err()
    }

    fn __repr__(&self) -> String {
        match &self.kind {
            Kind::Cpu(b) => format!(
                "Device.cpu(deferred={})",
                if b.is_deferred() { "True" } else { "False" }
            ),
            Kind::Cuda(g) => format!("Device.cuda({}) # {}", g.info().ordinal, g.info().name),
        }
    }
}

impl PyDevice {
    fn of(kind: Kind) -> Self {
        Self {
            kind,
            default: Mutex::new(None),
            streams: Mutex::new(HashMap::new()),
            carrier: Mutex::new(None),
        }
    }
}

/// A stream kvshard enqueues on: one of the caller's (borrowed), or one kvshard made.
#[pyclass(frozen, module = "kvshard", name = "Stream")]
pub struct PyStream {
    pub backend: Arc<dyn Backend>,
    device: Py<PyDevice>,
}

impl PyStream {
    pub fn new(backend: Arc<dyn Backend>, device: Py<PyDevice>) -> Self {
        Self { backend, device }
    }
}

#[pymethods]
impl PyStream {
    /// The device.
    #[getter]
    fn device(&self, py: Python<'_>) -> Py<PyDevice> {
        self.device.clone_ref(py)
    }

    /// An event at the current point of the stream (`timed=True`: usable with
    /// `Event.elapsed_ms`). Does not wait.
    #[pyo3(signature = (timed = false))]
    fn record(&self, timed: bool) -> PyResult<PyEvent> {
        let event = if timed {
            self.backend.record_timed()
        } else {
            self.backend.record()
        }
        .py_err()?;
        Ok(PyEvent {
            event,
            backend: self.backend.clone(),
        })
    }

    /// Makes later work on this stream wait for `event` (on the device, not the host).
    fn wait(&self, event: &PyEvent) -> PyResult<()> {
        self.backend.wait(&event.event).py_err()
    }

    /// Blocks until everything enqueued so far has run; reports the first input a kernel
    /// rejected since the last check.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let b = self.backend.clone();
        py.detach(|| b.synchronize()).py_err()
    }

    fn __repr__(&self) -> String {
        format!("<kvshard.Stream on {}>", self.backend.address_space())
    }
}

/// A point in a stream: other streams can wait for it, the host can poll or wait for it.
#[pyclass(frozen, module = "kvshard", name = "Event")]
pub struct PyEvent {
    pub event: Event,
    pub backend: Arc<dyn Backend>,
}

#[pymethods]
impl PyEvent {
    /// Whether the work before the event has finished (never blocks).
    fn query(&self) -> PyResult<bool> {
        self.backend.is_done(&self.event).py_err()
    }

    /// Blocks the calling thread until the work before the event has finished.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let (b, e) = (self.backend.clone(), self.event.clone());
        py.detach(|| b.wait_event_sync(&e)).py_err()
    }

    /// Milliseconds from this (timed) event to `end`, once both have completed.
    fn elapsed_ms(&self, end: &PyEvent) -> PyResult<f64> {
        self.backend.elapsed_ms(&self.event, &end.event).py_err()
    }
}

/// The event after which something runs (None: nothing to wait for): a kvshard Event as is; a
/// foreign CUDA event (`torch.cuda.Event`: any object with a `cuda_event` handle) carried into
/// a kvshard event (one never recorded, handle 0, is nothing to wait for); or the current
/// point of a stream (a kvshard Stream, a `torch.cuda.Stream`, a CuPy stream, an int
/// handle), recorded now, without waiting: the work queued on it so far.
pub fn after_event(device: &PyDevice, after: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Event>> {
    let Some(a) = after.filter(|a| !a.is_none()) else {
        return Ok(None);
    };
    if let Ok(e) = a.cast::<PyEvent>() {
        return Ok(Some(e.get().event.clone()));
    }
    if let Some(handle) = attribute(a, intern!(a.py(), "cuda_event"))? {
        let raw = handle.extract::<usize>().map_err(|_| {
            invalid("after: an event's `cuda_event` must be its int CUevent handle")
        })?;
        return device.foreign_event(raw);
    }
    let b = device.resolve(Some(a))?;
    Ok(Some(b.record().py_err()?))
}
