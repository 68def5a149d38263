//! Device pools: one rank's pages of every component, allocated by kvshard or wrapping the
//! engine's own KV tensors without a copy, with their layer views, reads, snapshots and fills.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use kvshard::backend::MemoryKind;
use kvshard::copy::BlockSpace;
use kvshard::geometry::{Component, ComponentLayout, INDEXER_PAGE_BYTES, PAGE_SIZE};
use kvshard::index::{LocalPage, StoredLayer};
use kvshard::pool::{DevicePool, PoolBuffers, RawBuffer};

use crate::device::PyDevice;
use crate::errors::{invalid, IntoPy};
use crate::geometry::{PyCacheGeometry, PyComponent, PyComponentLayout};
use crate::pool_tensors::{dl_devices, export_dtype, item_sizes, view_of, PoolKeep, PyKeep};
use crate::shard::PyPlacement;
use crate::tensor::{check, import_writable, PyTensorView, Want};

/// One rank's device pool: every component of the cache for `pages` physical pages, allocated
/// by kvshard (`DevicePool.allocate`) or wrapping the engine's own KV tensors without a copy
/// (`DevicePool.wrap`).
///
/// A wrapped pool holds its tensors (and their CPU adoptions) for as long as it and the work
/// queued on it live, and claims their memory: the same memory wrapped twice (two layers, two
/// pools) is refused.
#[pyclass(frozen, module = "kvshard", name = "DevicePool")]
pub struct PyDevicePool {
    pub inner: Arc<DevicePool>,
    pub device: Py<PyDevice>,
}

/// The memory of one wrapped layer, checked against what it must hold: its address in the
/// device's address space, and its bytes.
fn layer_memory(
    device: &PyDevice,
    t: &Bound<'_, PyAny>,
    want: &Want,
    keep: &mut PoolKeep,
) -> PyResult<RawBuffer> {
    let imported = import_writable(t, &want.what, &mut keep.objects)?;
    check(&imported, want)?;
    keep.claim(&imported, &want.what);
    adopt_on_cpu(
        device,
        &imported.object,
        imported.ptr,
        imported.nbytes,
        keep,
    )
}

/// `ptr` as an address of `device`'s space: itself on a GPU; adopted into the arena on the CPU
/// backend.
fn adopt_on_cpu(
    device: &PyDevice,
    object: &Py<PyAny>,
    ptr: u64,
    bytes: usize,
    keep: &mut PoolKeep,
) -> PyResult<RawBuffer> {
    match device.cpu() {
        None => Ok(RawBuffer {
            addr: ptr,
            bytes: bytes as u64,
        }),
        Some(cpu) => {
            let owner = Python::attach(|py| object.clone_ref(py));
            // SAFETY: `bytes` bytes at `ptr` are the tensor's (its DLPack description), kept
            // alive by the adopted allocation's keep-alive (the tensor object); the engine must
            // not touch them while kvshard's work uses them, the contract of wrapping any
            // engine memory (documented on DevicePool.wrap).
            let b = unsafe {
                cpu.adopt_raw(
                    ptr as *mut u8,
                    bytes,
                    MemoryKind::Device,
                    Arc::new(PyKeep(owner)),
                )
            }
            .py_err()?;
            let raw = RawBuffer {
                addr: b.addr(),
                bytes: b.len() as u64,
            };
            keep.buffers.push(b);
            Ok(raw)
        }
    }
}

#[pymethods]
impl PyDevicePool {
    /// Allocates a pool of `pages` physical pages per layer for `rank` of `placement` in one
    /// allocation of `device`'s memory: on a GPU from kvshard's stream-ordered pool, whose
    /// free never waits for the device. `registrable=True` allocates with `cuMemAlloc`
    /// instead, memory a transfer engine can register by address (UCX's `cuda_ipc`, GPUDirect
    /// RDMA, legacy CUDA IPC); its free may wait for the whole device and runs on kvshard's
    /// reaper thread.
    #[staticmethod]
    #[pyo3(signature = (device, geometry, placement, rank, pages, *, registrable = false))]
    fn allocate(
        py: Python<'_>,
        device: Py<PyDevice>,
        geometry: &PyCacheGeometry,
        placement: PyPlacement,
        rank: u32,
        pages: u64,
        registrable: bool,
    ) -> PyResult<Self> {
        let b = device.get().default_backend()?;
        let g = geometry.0.clone();
        let pool = py
            .detach(|| {
                if registrable {
                    DevicePool::allocate_registrable(b.as_ref(), &g, placement.0, rank, pages)
                } else {
                    DevicePool::allocate(b.as_ref(), &g, placement.0, rank, pages)
                }
            })
            .py_err()?;
        Ok(Self {
            inner: Arc::new(pool),
            device,
        })
    }

    /// Wraps the engine's existing KV tensors, without copying. Each component is a list of
    /// tensors, one per stored layer (indexer components: one per layer that has an indexer),
    /// or one tensor whose first dimension is the layer count. Every tensor must be
    /// C-contiguous on the device (NumPy arrays for the CPU backend), its last dimension one
    /// row (a latent row; an 8,448-byte indexer block), and hold at least `pages` pages: a
    /// mismatch is a `ValueError` saying what was expected. kvshard writes into them, so a
    /// read-only one (a memmap opened with mode `"r"`, an array over `bytes`) is refused with
    /// `ReadOnlyError`. The pool keeps the tensors alive as long as it and the work queued on
    /// it live, and holds a buffer export and a weak reference of each, so NumPy refuses to
    /// resize a wrapped array; they must not be reallocated (torch's `resize_`) while work
    /// uses them. One memory, one usage record: a tensor (or a view of one buffer) given twice,
    /// or memory another live kvshard pool wraps, is refused with `InvalidArgumentError`.
    #[staticmethod]
    #[pyo3(signature = (device, geometry, placement, rank, pages, target_latent, target_indexer = None, draft_latent = None, draft_indexer = None))]
    #[allow(clippy::too_many_arguments)]
    fn wrap(
        device: Py<PyDevice>,
        geometry: &PyCacheGeometry,
        placement: PyPlacement,
        rank: u32,
        pages: u64,
        target_latent: &Bound<'_, PyAny>,
        target_indexer: Option<&Bound<'_, PyAny>>,
        draft_latent: Option<&Bound<'_, PyAny>>,
        draft_indexer: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let d = device.get();
        let g = &geometry.0;
        g.validate().py_err()?;
        let mut buffers = PoolBuffers::default();
        let mut keep = PoolKeep::default();
        let given = [
            (Component::TargetLatent, Some(target_latent)),
            (Component::TargetIndexer, target_indexer),
            (Component::DraftLatent, draft_latent),
            (Component::DraftIndexer, draft_indexer),
        ];
        let components = g.components();
        for (component, tensors) in given {
            let Some(tensors) = tensors.filter(|t| !t.is_none()) else {
                continue;
            };
            let Some(c) = components.iter().find(|c| c.component == component) else {
                return Err(invalid(format!(
                    "{component} tensors given, but the geometry has no {component}"
                )));
            };
            let need = PoolBuffers::required_bytes(g, component, pages).py_err()?;
            let (sizes, names) = item_sizes(c, g.target.latent);
            let raws = if let Ok(list) = tensors.cast::<PyList>() {
                wrap_list(d, c, list.iter().collect(), need, sizes, names, &mut keep)?
            } else if let Ok(tuple) = tensors.cast::<PyTuple>() {
                wrap_list(d, c, tuple.iter().collect(), need, sizes, names, &mut keep)?
            } else {
                wrap_stacked(d, c, tensors, need, sizes, names, pages, &mut keep)?
            };
            match component {
                Component::TargetLatent => buffers.target_latent = raws,
                Component::TargetIndexer => buffers.target_indexer = raws,
                Component::DraftLatent => buffers.draft_latent = raws,
                Component::DraftIndexer => buffers.draft_indexer = raws,
            }
        }
        let b = d.default_backend()?;
        keep.commit()?;
        // SAFETY: every buffer is a checked tensor of this device (its address space: a CUDA
        // device address, or an adoption into the CPU arena) holding at least `pages` blocks,
        // kept alive by the pool itself until it and the work queued on it are gone.
        let pool = unsafe { DevicePool::wrap(b.as_ref(), g, placement.0, rank, pages, &buffers) }
            .py_err()?;
        pool.keep_alive(Box::new(keep));
        Ok(Self {
            inner: Arc::new(pool),
            device,
        })
    }

    /// The device.
    #[getter]
    fn device(&self, py: Python<'_>) -> Py<PyDevice> {
        self.device.clone_ref(py)
    }

    /// Cache geometry.
    #[getter]
    fn geometry(&self) -> PyCacheGeometry {
        PyCacheGeometry(self.inner.geometry().clone())
    }

    /// Sharding of the logical index space.
    #[getter]
    fn placement(&self) -> PyPlacement {
        PyPlacement(self.inner.placement())
    }

    /// This pool's rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank()
    }

    /// Physical pages per layer.
    #[getter]
    fn pages(&self) -> u64 {
        self.inner.pages()
    }

    /// Logical pages of the shard group.
    #[getter]
    fn logical_pages(&self) -> u64 {
        self.inner.logical_pages()
    }

    /// Logical token capacity of the shard group.
    #[getter]
    fn logical_capacity(&self) -> u64 {
        self.inner.logical_capacity()
    }

    /// Whether kvshard allocated the memory (False: it wraps the engine's tensors).
    #[getter]
    fn owned(&self) -> bool {
        self.inner.storage().is_some()
    }

    /// The components.
    fn components(&self) -> Vec<PyComponentLayout> {
        self.inner
            .components()
            .iter()
            .cloned()
            .map(PyComponentLayout)
            .collect()
    }

    /// Base address of every stored layer of `component`.
    fn layer_bases(&self, component: PyComponent) -> PyResult<Vec<u64>> {
        Ok(self
            .inner
            .layer_bases(Component::from(component))
            .py_err()?
            .to_vec())
    }

    /// Address of block (`layer`, local `page`) of `component`.
    fn block_addr(&self, component: PyComponent, layer: usize, page: u64) -> PyResult<u64> {
        self.inner
            .block_addr(
                Component::from(component),
                StoredLayer(layer),
                LocalPage(page),
            )
            .py_err()
    }

    /// Stored layer `layer` of `component` as a tensor view (`torch.from_dlpack` /
    /// `numpy.from_dlpack`): `[pages * 64, row]` latent rows or `[pages, 8448]` indexer blocks,
    /// uint8 (bf16 rows as bfloat16 unless `raw=True`: NumPy has no bfloat16).
    #[pyo3(signature = (component, layer, *, raw = false))]
    fn layer_view(
        slf: &Bound<'_, Self>,
        component: PyComponent,
        layer: usize,
        raw: bool,
    ) -> PyResult<PyTensorView> {
        let this = slf.get();
        let component = Component::from(component);
        let pool = &this.inner;
        let c = pool.component_index(component).py_err()?;
        let comp = &pool.components()[c];
        let addr = pool
            .block_addr(component, StoredLayer(layer), LocalPage(0))
            .py_err()?;
        let bytes = pool.pages() as usize * comp.block_bytes;
        let (dtype, row) = export_dtype(comp, pool.geometry().target.latent, raw);
        let shape = if component.is_indexer() {
            vec![pool.pages() as i64, INDEXER_PAGE_BYTES as i64]
        } else {
            vec![(pool.pages() as usize * PAGE_SIZE) as i64, row as i64]
        };
        let d = this.device.get();
        view_of(
            d,
            addr,
            bytes,
            false,
            dtype,
            shape,
            slf.clone().into_any().unbind(),
        )
    }

    /// The bytes of block (`layer`, `page`) of `component`, after prior work on `stream`
    /// (waits for it).
    #[pyo3(signature = (component, layer, page, stream = None))]
    fn read_block_sync<'py>(
        &self,
        py: Python<'py>,
        component: PyComponent,
        layer: usize,
        page: u64,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.device.get().resolve(stream)?;
        let c = Component::from(component);
        let pool = self.inner.clone();
        let bytes = py
            .detach(|| pool.read_block_sync(b.as_ref(), c, StoredLayer(layer), LocalPage(page)))
            .py_err()?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The bytes of each local page of `pages` (every block, component by component, layer by
    /// layer), after prior work on `stream` (waits for it).
    #[pyo3(signature = (pages, stream = None))]
    fn read_pages_sync<'py>(
        &self,
        py: Python<'py>,
        pages: Vec<u64>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let b = self.device.get().resolve(stream)?;
        let pool = self.inner.clone();
        let local: Vec<LocalPage> = pages.into_iter().map(LocalPage).collect();
        let out = py
            .detach(|| pool.read_pages_sync(b.as_ref(), &local))
            .py_err()?;
        Ok(out.iter().map(|p| PyBytes::new(py, p)).collect())
    }

    /// Every block of the pool, component by component, layer by layer, page by page (waits).
    #[pyo3(signature = (stream = None))]
    fn snapshot_sync<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.device.get().resolve(stream)?;
        let pool = self.inner.clone();
        let out = py.detach(|| pool.snapshot_sync(b.as_ref())).py_err()?;
        Ok(PyBytes::new(py, &out))
    }

    /// Fills every layer buffer with `byte` (stream-ordered, no wait).
    #[pyo3(signature = (byte, stream = None))]
    fn fill(&self, py: Python<'_>, byte: u8, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        let pool = self.inner.clone();
        py.detach(|| pool.fill(b.as_ref(), byte)).py_err()
    }

    fn __repr__(&self) -> String {
        format!(
            "<kvshard.DevicePool rank {} of {}, {} pages, {}>",
            self.inner.rank(),
            self.inner.placement().shard(),
            self.inner.pages(),
            if self.inner.storage().is_some() {
                "allocated"
            } else {
                "wrapping engine tensors"
            }
        )
    }
}

/// A list of per-layer tensors of component `c`.
#[allow(clippy::too_many_arguments)]
fn wrap_list(
    d: &PyDevice,
    c: &ComponentLayout,
    tensors: Vec<Bound<'_, PyAny>>,
    need: u64,
    sizes: &'static [usize],
    names: &'static str,
    keep: &mut PoolKeep,
) -> PyResult<Vec<RawBuffer>> {
    if tensors.len() != c.layers() {
        return Err(invalid(format!(
            "{}: expected {} tensors (one per stored layer), got {}",
            c.component,
            c.layers(),
            tensors.len()
        )));
    }
    tensors
        .iter()
        .enumerate()
        .map(|(l, t)| {
            let want = Want {
                what: format!("{} tensor of stored layer {l}", c.component),
                devices: dl_devices(d, false),
                row_bytes: c.row_bytes,
                item_sizes: sizes,
                dtypes: names,
                min_bytes: need,
                min_why: format!(
                    "{} pages of {} B blocks",
                    need / c.block_bytes as u64,
                    c.block_bytes
                ),
                exact: false,
            };
            layer_memory(d, t, &want, keep)
        })
        .collect()
}

/// One tensor holding every stored layer of component `c` (first dimension: layers).
#[allow(clippy::too_many_arguments)]
fn wrap_stacked(
    d: &PyDevice,
    c: &ComponentLayout,
    t: &Bound<'_, PyAny>,
    need: u64,
    sizes: &'static [usize],
    names: &'static str,
    pages: u64,
    keep: &mut PoolKeep,
) -> PyResult<Vec<RawBuffer>> {
    let layers = c.layers() as u64;
    let what = format!("{} tensor (all {} stored layers)", c.component, c.layers());
    let imported = import_writable(t, &what, &mut keep.objects)?;
    keep.claim(&imported, &what);
    let want = Want {
        what,
        devices: dl_devices(d, false),
        row_bytes: c.row_bytes,
        item_sizes: sizes,
        dtypes: names,
        min_bytes: need * layers,
        min_why: format!(
            "{layers} layers x {pages} pages of {} B blocks",
            c.block_bytes
        ),
        exact: false,
    };
    check(&imported, &want)?;
    let first = imported.shape.first().copied().unwrap_or(0);
    let stride = imported.nbytes as u64 / layers.max(1);
    if imported.shape.len() < 2 || first as u64 != layers || stride % 16 != 0 {
        return Err(invalid(format!(
            "{}: a single tensor must have the {layers} stored layers as its first dimension (16-byte aligned layers); got shape {:?}",
            want.what, imported.shape
        )));
    }
    let whole = adopt_on_cpu(d, &imported.object, imported.ptr, imported.nbytes, keep)?;
    Ok((0..layers)
        .map(|l| RawBuffer {
            addr: whole.addr + l * stride,
            bytes: stride,
        })
        .collect())
}
