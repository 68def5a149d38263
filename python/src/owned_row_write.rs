//! The owned-row write: from a chunk staging into a device pool, every rank persisting only
//! the rows it owns, with the chunk's slots read in place on the device or staged from the host.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dlpark::ffi::{DLDataType, DLDevice};
use pyo3::prelude::*;

use kvshard::backend::{Backend, Buffer, Launch, MemoryKind};
use kvshard::geometry::Component;
use kvshard::index::{ModelLayer, Slot};
use kvshard::pool::OwnedRowWrite;

use crate::chunk_staging::PyChunkStaging;
use crate::device::PyDevice;
use crate::device_pool::PyDevicePool;
use crate::errors::{invalid, IntoPy};
use crate::geometry::PyComponent;
use crate::lock::lock;
use crate::tensor::{device_name, dtype_name, host_i64s, import};

/// A launch shape: `(ctas, threads)`.
pub fn launch_of(l: Option<(u32, u32)>, default: Launch) -> Launch {
    l.map_or(default, |(ctas, threads)| Launch { ctas, threads })
}

/// A prepared owned-row write from a chunk staging into a pool: every rank persists only the
/// rows it owns, for every selected layer, in one launch. Holds the staging and the pool.
#[pyclass(frozen, module = "kvshard", name = "OwnedRowWrite")]
pub struct PyOwnedRowWrite {
    inner: Arc<OwnedRowWrite>,
    device: Py<PyDevice>,
    #[allow(dead_code)]
    holds: (Py<PyChunkStaging>, Py<PyDevicePool>),
    /// Per stream (by its backend's identity), the buffer host slots are staged through:
    /// uploads and writes of one stream are ordered, so one buffer per stream suffices.
    slots: Mutex<HashMap<usize, Buffer>>,
    tokens: usize,
}

#[pymethods]
impl PyOwnedRowWrite {
    /// Prepares writes of every model layer (or of `layers`, a list of model layers: one
    /// layer during its forward) and every component (or of `components`: the latent ones for
    /// an engine that writes its indexer keys itself), uploading the pair table on `stream`
    /// (waits for the upload).
    #[new]
    #[pyo3(signature = (staging, pool, layers = None, stream = None, *, components = None))]
    fn new(
        py: Python<'_>,
        staging: Py<PyChunkStaging>,
        pool: Py<PyDevicePool>,
        layers: Option<Vec<usize>>,
        stream: Option<&Bound<'_, PyAny>>,
        components: Option<Vec<PyComponent>>,
    ) -> PyResult<Self> {
        let device = pool.get().device.clone_ref(py);
        let b = device.get().resolve(stream)?;
        let (s, p) = (staging.get().inner.clone(), pool.get().inner.clone());
        let components: Option<Vec<Component>> =
            components.map(|c| c.into_iter().map(Component::from).collect());
        let w = py
            .detach(|| {
                OwnedRowWrite::prepare_components_sync(
                    b.as_ref(),
                    s,
                    p,
                    |c: Component, m: ModelLayer| {
                        layers.as_ref().is_none_or(|l| l.contains(&m.0))
                            && components.as_ref().is_none_or(|cs| cs.contains(&c))
                    },
                )
            })
            .py_err()?;
        let tokens = staging.get().inner.tokens();
        Ok(Self {
            inner: Arc::new(w),
            device,
            holds: (staging, pool),
            slots: Mutex::new(HashMap::new()),
            tokens,
        })
    }

    /// The launch shape kvshard picks for a chunk of `n` tokens: `(ctas, threads)`.
    #[pyo3(signature = (n, stream = None))]
    fn launch(&self, n: usize, stream: Option<&Bound<'_, PyAny>>) -> PyResult<(u32, u32)> {
        let b = self.device.get().resolve(stream)?;
        let l = self.inner.launch(b.as_ref(), n);
        Ok((l.ctas, l.threads))
    }

    /// Bytes one owned token moves across the selected layers.
    #[getter]
    fn row_bytes(&self) -> u64 {
        self.inner.row_bytes()
    }

    /// Persists the owned rows of a chunk whose logical slots are `slots` (int64): a tensor on
    /// the device (read in place: keep it alive until the write has run), or host int64 values
    /// (a NumPy array or a list: staged through this writer's buffer for `stream`). Enqueued
    /// on `stream`, no wait; a bad slot is skipped and reported by the stream's next
    /// `synchronize`. `n`: the first n slots (default: all); `launch`: `(ctas, threads)`.
    #[pyo3(signature = (slots, stream = None, *, n = None, launch = None))]
    fn run(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
        n: Option<usize>,
        launch: Option<(u32, u32)>,
    ) -> PyResult<()> {
        let d = self.device.get();
        let b = d.resolve(stream)?;
        let (buffer, count) = self.slot_buffer(py, d, b.as_ref(), slots)?;
        let n = n.unwrap_or(count);
        if n > count {
            return Err(invalid(format!("n = {n} of {count} slots")));
        }
        let launch = launch_of(launch, self.inner.launch(b.as_ref(), n));
        let w = self.inner.clone();
        py.detach(|| w.run(b.as_ref(), &buffer, n, launch)).py_err()
    }

    /// Checks `slots` on the host (in range, no padding page, no repeats), uploads them, runs
    /// the write and waits: a bad slot is an error before anything is written.
    #[pyo3(signature = (slots, stream = None, *, launch = None))]
    fn run_checked_sync(
        &self,
        py: Python<'_>,
        slots: Vec<u64>,
        stream: Option<&Bound<'_, PyAny>>,
        launch: Option<(u32, u32)>,
    ) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        let launch = launch_of(launch, self.inner.launch(b.as_ref(), slots.len()));
        let slots: Vec<Slot> = slots.into_iter().map(Slot).collect();
        let w = self.inner.clone();
        py.detach(|| w.run_checked_sync(b.as_ref(), &slots, launch))
            .py_err()
    }
}

impl PyOwnedRowWrite {
    /// The slots as a buffer of the device, and their count.
    fn slot_buffer(
        &self,
        py: Python<'_>,
        d: &PyDevice,
        b: &dyn Backend,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<(Buffer, usize)> {
        let on_device = match (d.gpu(), slots.hasattr("__dlpack__")?) {
            (Some(_), true) => Some(import(slots)?),
            _ => None,
        };
        if let Some(t) =
            on_device.filter(|t| t.device.device_type == dlpark::ffi::DLDeviceType::CUDA)
        {
            if t.dtype != DLDataType::I64 || !t.compact || t.ptr % 8 != 0 || t.shape.len() != 1 {
                return Err(invalid(format!(
                    "slots: expected a 1-D, C-contiguous int64 tensor; got {} of shape {:?}",
                    dtype_name(t.dtype),
                    t.shape
                )));
            }
            let want = DLDevice::cuda(d.gpu().map_or(0, |g| g.info().ordinal as i32));
            if t.device != want {
                return Err(invalid(format!(
                    "slots on {}, the pool on {}",
                    device_name(t.device),
                    device_name(want)
                )));
            }
            // SAFETY: the tensor's int64s on this device; the caller keeps it alive until the
            // write has run (documented).
            let buf = unsafe { Buffer::from_raw(t.ptr, t.nbytes, MemoryKind::Device, d.space()) };
            return Ok((buf, t.nbytes / 8));
        }
        let values: Vec<i64> = host_i64s(slots)?;
        if values.len() > self.tokens {
            return Err(invalid(format!(
                "{} slots for a staging of {} tokens",
                values.len(),
                self.tokens
            )));
        }
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let key = b as *const dyn Backend as *const () as usize;
        let buf = {
            let mut kept = lock(&self.slots);
            match kept.get(&key) {
                Some(buf) => buf.clone(),
                None => {
                    let buf = b
                        .alloc((self.tokens * 8).max(8), MemoryKind::Device)
                        .py_err()?;
                    kept.insert(key, buf.clone());
                    buf
                }
            }
        };
        // Stream-ordered after this stream's earlier writes, which read the previous slots.
        py.detach(|| b.enqueue_write(&buf, 0, &bytes)).py_err()?;
        Ok((buf, values.len()))
    }
}
