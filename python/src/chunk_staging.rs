//! Chunk staging: the device buffers a chunk's rows are quantized into before the owned-row
//! write persists them, with their tensor views and host writes.

use std::sync::Arc;

use pyo3::prelude::*;

use kvshard::copy::BlockSpace;
use kvshard::geometry::{Component, ComponentLayout, LatentLayout, INDEXER_PAGE_BYTES};
use kvshard::index::StoredLayer;
use kvshard::pool::ChunkStaging;

use crate::device::PyDevice;
use crate::device_pool::PyDevicePool;
use crate::errors::{invalid, IntoPy};
use crate::geometry::PyComponent;
use crate::pool_tensors::{export_dtype, view_of};
use crate::tensor::PyTensorView;

/// Chunk staging: per component and stored layer, the chunk's latent rows `[tokens][row]` or
/// page-major indexer blocks `[tokens / 64][8448]`, row `i` holding chunk token `i`; what the
/// quantizers write and the owned-row write reads.
#[pyclass(frozen, module = "kvshard", name = "ChunkStaging")]
pub struct PyChunkStaging {
    pub inner: Arc<ChunkStaging>,
    pub device: Py<PyDevice>,
    latent: LatentLayout,
    components: Vec<ComponentLayout>,
}

#[pymethods]
impl PyChunkStaging {
    /// Staging for chunks of up to `tokens` tokens, shaped like `pool`, in the device's memory.
    #[new]
    fn new(py: Python<'_>, pool: &PyDevicePool, tokens: usize) -> PyResult<Self> {
        let device = pool.device.clone_ref(py);
        let b = device.get().default_backend()?;
        let p = pool.inner.clone();
        let s = py
            .detach(|| ChunkStaging::new(b.as_ref(), &p, tokens))
            .py_err()?;
        Ok(Self {
            inner: Arc::new(s),
            device,
            latent: pool.inner.geometry().target.latent,
            components: pool.inner.components().to_vec(),
        })
    }

    /// Capacity in tokens.
    #[getter]
    fn tokens(&self) -> usize {
        self.inner.tokens()
    }

    /// The staging of stored layer `layer` of `component` as a tensor view: `[tokens, row]`
    /// latent rows, or `[ceil(tokens / 64), 8448]` indexer blocks (uint8; bf16 rows as
    /// bfloat16 unless `raw=True`).
    #[pyo3(signature = (component, layer, *, raw = false))]
    fn layer_view(
        slf: &Bound<'_, Self>,
        component: PyComponent,
        layer: usize,
        raw: bool,
    ) -> PyResult<PyTensorView> {
        let this = slf.get();
        let component = Component::from(component);
        let buf = this.inner.layer(component, StoredLayer(layer)).py_err()?;
        let comp = this
            .components
            .iter()
            .find(|c| c.component == component)
            .ok_or_else(|| invalid(format!("the staging holds no {component}")))?;
        let (dtype, row) = export_dtype(comp, this.latent, raw);
        let shape = if component.is_indexer() {
            vec![
                (buf.len() / INDEXER_PAGE_BYTES) as i64,
                INDEXER_PAGE_BYTES as i64,
            ]
        } else {
            vec![this.inner.tokens() as i64, row as i64]
        };
        view_of(
            this.device.get(),
            buf.addr(),
            buf.len(),
            false,
            dtype,
            shape,
            slf.clone().into_any().unbind(),
        )
    }

    /// Copies `data` into stored layer `layer` of `component` at byte `offset`, ordered on
    /// `stream` (no wait: `data` is staged when this returns).
    #[pyo3(signature = (component, layer, data, offset = 0, stream = None))]
    fn write(
        &self,
        py: Python<'_>,
        component: PyComponent,
        layer: usize,
        data: Vec<u8>,
        offset: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        let buf = self
            .inner
            .layer(Component::from(component), StoredLayer(layer))
            .py_err()?;
        py.detach(|| b.enqueue_write(&buf, offset, &data)).py_err()
    }
}
