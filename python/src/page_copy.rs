//! A prepared page copy from a device pool into a destination space of the same geometry, run
//! whole or one model layer at a time: what an engine's own scratch gather needs (a rank's
//! prefix pages onto their scratch pages, layer by layer, as the forward reads them).

use std::sync::Arc;

use pyo3::prelude::*;

use kvshard::backend::{Backend, Launch};
use kvshard::copy::{BlockCopy, BlockCopyPlan, BlockSpace, Method, PageSelection};
use kvshard::index::{LocalPage, ModelLayer};

use crate::device::PyDevice;
use crate::device_pool::PyDevicePool;
use crate::errors::{invalid, IntoPy};
use crate::owned_row_write::launch_of;
use crate::transfer::PyRemoteSpace;

/// Local pages `src_pages[j]` of a pool copied onto local pages `dst_pages[j]` of a destination
/// (`RemoteSpace`) of the pool's geometry, every component, per model layer. The tables are
/// uploaded when it is made, on `stream`, with no wait; every run is ordered after the upload.
/// Holds the pool and the destination.
#[pyclass(frozen, module = "kvshard", name = "PageCopy")]
pub struct PyPageCopy {
    inner: BlockCopy,
    /// Per model layer, the (component, layer) pairs it moves: its launches' blocks per page.
    layer_pairs: Vec<usize>,
    device: Py<PyDevice>,
    #[allow(dead_code)]
    holds: (Py<PyDevicePool>, Py<PyRemoteSpace>),
}

#[pymethods]
impl PyPageCopy {
    /// Plans and uploads the copy of `pool`'s local pages `src_pages` onto `dst`'s local pages
    /// `dst_pages` (equal lengths; every page checked against its space, the pool's padding
    /// page and a destination page named twice refused), on `stream`.
    #[new]
    #[pyo3(signature = (pool, src_pages, dst, dst_pages, stream = None))]
    fn new(
        py: Python<'_>,
        pool: Py<PyDevicePool>,
        src_pages: Vec<u64>,
        dst: Py<PyRemoteSpace>,
        dst_pages: Vec<u64>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if src_pages.len() != dst_pages.len() {
            return Err(invalid(format!(
                "{} source pages for {} destination pages",
                src_pages.len(),
                dst_pages.len()
            )));
        }
        let device = pool.get().device.clone_ref(py);
        let b = device.get().resolve(stream)?;
        let src: Arc<dyn BlockSpace> = pool.get().inner.clone();
        let to: Arc<dyn BlockSpace> = dst.get().inner.clone();
        let n = src_pages.len();
        let local = |p: Vec<u64>| PageSelection::Local(p.into_iter().map(LocalPage).collect());
        let copy = py
            .detach(|| {
                let plan = BlockCopyPlan::new(
                    src.as_ref(),
                    local(src_pages),
                    to.as_ref(),
                    local(dst_pages),
                    n,
                )?
                .layer_major();
                BlockCopy::prepare(b.as_ref(), plan, src, to, None)
            })
            .py_err()?;
        let layer_pairs = copy.plan().layer_pairs().iter().map(|r| r.len()).collect();
        Ok(Self {
            inner: copy,
            layer_pairs,
            device,
            holds: (pool, dst),
        })
    }

    /// Pages copied.
    fn __len__(&self) -> usize {
        self.inner.plan().entries()
    }

    /// Bytes a whole run moves.
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.bytes()
    }

    /// Enqueues the copy of model layer `layer` (every component of it) on `stream`, no wait;
    /// `launch`: `(ctas, threads)` (default: kvshard's grid for the layer's blocks).
    #[pyo3(signature = (layer, stream = None, *, launch = None))]
    fn run_layer(
        &self,
        py: Python<'_>,
        layer: usize,
        stream: Option<&Bound<'_, PyAny>>,
        launch: Option<(u32, u32)>,
    ) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        let pairs = self.layer_pairs.get(layer).copied().unwrap_or(0) as u64;
        let launch = launch_of(
            launch,
            grid(b.as_ref(), pairs * self.inner.plan().entries() as u64)?,
        );
        py.detach(|| self.inner.run_layer(b.as_ref(), ModelLayer(layer), launch))
            .py_err()
    }

    /// Enqueues the whole copy (every layer) on `stream`, no wait.
    #[pyo3(signature = (stream = None, *, launch = None))]
    fn run(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        launch: Option<(u32, u32)>,
    ) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        let launch = launch_of(launch, grid(b.as_ref(), self.inner.plan().blocks())?);
        py.detach(|| self.inner.run(b.as_ref(), launch)).py_err()
    }
}

/// kvshard's block-kernel grid for a launch of `blocks` (page, layer pair) blocks.
fn grid(b: &dyn Backend, blocks: u64) -> PyResult<Launch> {
    Method::for_blocks(b, blocks)
        .launch()
        .ok_or_else(|| invalid("the block kernel has no launch shape"))
}
