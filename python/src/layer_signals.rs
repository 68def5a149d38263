//! Per-layer readiness of HiCache loads: the ready counters a signalled load counts into, and
//! the waits a consumer stream makes on one model layer or on every layer of a run.

use pyo3::prelude::*;

use kvshard::copy::LayerSignals;
use kvshard::hicache::LayerReady;

use crate::device::PyDevice;
use crate::errors::{invalid, IntoPy};

/// Per-model-layer ready counters signalled loads count into.
#[pyclass(module = "kvshard", name = "LayerSignals")]
pub struct PyLayerSignals(pub(crate) LayerSignals);

#[pymethods]
impl PyLayerSignals {
    /// Zeroed counters for `model_layers` layers (the upload waits for `stream`).
    #[new]
    #[pyo3(signature = (device, model_layers, stream = None))]
    fn new(
        py: Python<'_>,
        device: &PyDevice,
        model_layers: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let b = device.resolve(stream)?;
        Ok(Self(
            py.detach(|| LayerSignals::new(b.as_ref(), model_layers))
                .py_err()?,
        ))
    }

    /// Model layers counted.
    #[getter]
    fn layers(&self) -> usize {
        self.0.layers()
    }
}

/// "Model layer `layer` has landed", for a consumer stream to wait on.
#[pyclass(frozen, module = "kvshard", name = "LayerReady")]
pub struct PyLayerReady {
    ready: LayerReady,
    device: Py<PyDevice>,
}

#[pymethods]
impl PyLayerReady {
    /// Makes later work on `stream` wait until the layer has landed (on the device:
    /// cuStreamWaitEvent or cuStreamWaitValue32; the host does not wait).
    #[pyo3(signature = (stream = None))]
    fn wait(&self, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        self.ready.wait(b.as_ref()).py_err()
    }
}

/// Every model layer's readiness of one signalled run (one object, so a run costs one Python
/// allocation whatever the layer count).
#[pyclass(frozen, module = "kvshard", name = "LayerWaits")]
pub struct PyLayerWaits {
    pub(crate) ready: Vec<LayerReady>,
    pub(crate) device: Py<PyDevice>,
}

#[pymethods]
impl PyLayerWaits {
    /// Model layers.
    fn __len__(&self) -> usize {
        self.ready.len()
    }

    /// Model layer `layer`'s readiness.
    fn __getitem__(&self, py: Python<'_>, layer: usize) -> PyResult<PyLayerReady> {
        let ready = self.ready.get(layer).cloned().ok_or_else(|| {
            pyo3::exceptions::PyIndexError::new_err(format!(
                "model layer {layer} of {}",
                self.ready.len()
            ))
        })?;
        Ok(PyLayerReady {
            ready,
            device: self.device.clone_ref(py),
        })
    }

    /// Makes later work on `stream` wait until model layer `layer` has landed.
    #[pyo3(signature = (stream, layer))]
    fn wait_layer(&self, stream: Option<&Bound<'_, PyAny>>, layer: usize) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        self.ready
            .get(layer)
            .ok_or_else(|| invalid(format!("model layer {layer} of {}", self.ready.len())))?
            .wait(b.as_ref())
            .py_err()
    }
}
