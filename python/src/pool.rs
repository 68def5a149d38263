//! Device pools (allocated by kvshard, or wrapping the engine's tensors), the chunk staging,
//! the owned-row write and the memory budget.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dlpark::ffi::{DLDataType, DLDevice};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use kvshard::backend::{Backend, Buffer, Launch, MemoryKind};
use kvshard::copy::BlockSpace;
use kvshard::geometry::{Component, ComponentLayout, LatentLayout, INDEXER_PAGE_BYTES, PAGE_SIZE};
use kvshard::index::{LocalPage, ModelLayer, Slot, StoredLayer};
use kvshard::pool::{
    Budget, BudgetRequest, ChunkStaging, DevicePool, OwnedRowWrite, PoolBuffers, RawBuffer,
};

use crate::device::PyDevice;
use crate::errors::{invalid, IntoPy};
use crate::geometry::{PyCacheGeometry, PyComponent, PyComponentLayout};
use crate::shard::PyPlacement;
use crate::tensor::{check, import, import_writable, KeepInner, PyTensorView, Want};

/// A Python object as an `Arc<dyn Send + Sync>` keep-alive.
pub struct PyKeep(#[allow(dead_code)] pub Py<PyAny>);

/// The DLPack devices a tensor of `device` may be on.
pub fn dl_devices(device: &PyDevice, host: bool) -> Vec<DLDevice> {
    match device.gpu() {
        Some(g) if !host => vec![DLDevice::cuda(g.info().ordinal as i32)],
        Some(_) => vec![
            DLDevice::CPU,
            DLDevice {
                device_type: dlpark::ffi::DLDeviceType::CUDAHOST,
                device_id: 0,
            },
        ],
        None => vec![
            DLDevice::CPU,
            DLDevice {
                device_type: dlpark::ffi::DLDeviceType::CUDAHOST,
                device_id: 0,
            },
        ],
    }
}

/// Element sizes a component's tensors may have, and their names.
pub fn item_sizes(c: &ComponentLayout, latent: LatentLayout) -> (&'static [usize], &'static str) {
    if c.component.is_indexer() || latent != LatentLayout::Bf16 {
        (&[1], "uint8/int8/float8")
    } else {
        (&[2, 1], "bfloat16 (or uint8 bytes)")
    }
}

/// The element type kvshard exports a component's rows as: bytes, or bf16 for bf16 rows unless
/// `raw` (NumPy has no bfloat16).
pub fn export_dtype(c: &ComponentLayout, latent: LatentLayout, raw: bool) -> (DLDataType, usize) {
    if raw || c.component.is_indexer() || latent != LatentLayout::Bf16 {
        (DLDataType::U8, c.row_bytes)
    } else {
        (
            DLDataType::scalar(dlpark::ffi::DLDataTypeCode::BFLOAT, 16),
            c.row_bytes / 2,
        )
    }
}

/// Engine memory a pool wraps: the tensors, and their adoptions into a CPU arena.
#[derive(Default)]
pub struct PoolKeep {
    pub objects: Vec<Py<PyAny>>,
    pub buffers: Vec<Buffer>,
}

/// One rank's device pool: every component of the cache for `pages` physical pages, allocated
/// by kvshard (`DevicePool.allocate`) or wrapping the engine's own KV tensors without a copy
/// (`DevicePool.wrap`).
#[pyclass(frozen, module = "kvshard", name = "DevicePool")]
pub struct PyDevicePool {
    pub inner: Arc<DevicePool>,
    pub device: Py<PyDevice>,
    /// Keeps wrapped tensors (and their CPU adoptions) alive as long as this object; every
    /// kvshard object that holds the pool holds this object too.
    #[allow(dead_code)]
    keep: PoolKeep,
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
    /// allocation of `device`'s memory.
    #[staticmethod]
    fn allocate(
        py: Python<'_>,
        device: Py<PyDevice>,
        geometry: &PyCacheGeometry,
        placement: PyPlacement,
        rank: u32,
        pages: u64,
    ) -> PyResult<Self> {
        let b = device.get().default_backend()?;
        let g = geometry.0.clone();
        let pool = py
            .detach(|| DevicePool::allocate(b.as_ref(), &g, placement.0, rank, pages))
            .py_err()?;
        Ok(Self {
            inner: Arc::new(pool),
            device,
            keep: PoolKeep::default(),
        })
    }

    /// Wraps the engine's existing KV tensors, without copying. Each component is a list of
    /// tensors, one per stored layer (indexer components: one per layer that has an indexer),
    /// or one tensor whose first dimension is the layer count. Every tensor must be
    /// C-contiguous on the device (NumPy arrays for the CPU backend), its last dimension one
    /// row (a latent row; an 8,448-byte indexer block), and hold at least `pages` pages: a
    /// mismatch is a `ValueError` saying what was expected. kvshard writes into them, so a
    /// read-only one (a memmap opened with mode `"r"`, an array over `bytes`) is refused with
    /// `ReadOnlyError`. The pool keeps the tensors alive, and holds a buffer export and a weak
    /// reference of each, so NumPy refuses to resize a wrapped array; they must not be freed
    /// or reallocated (torch's `resize_`) while work uses them.
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
        // SAFETY: every buffer is a checked tensor of this device (its address space: a CUDA
        // device address, or an adoption into the CPU arena) holding at least `pages` blocks,
        // kept alive by this object, which every user of the pool holds.
        let pool = unsafe { DevicePool::wrap(b.as_ref(), g, placement.0, rank, pages, &buffers) }
            .py_err()?;
        Ok(Self {
            inner: Arc::new(pool),
            device,
            keep,
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
    fn read_block<'py>(
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
    fn read_pages<'py>(
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
    fn snapshot<'py>(
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

/// A view of `bytes` bytes at `addr` of `device`'s space (a CPU arena address is turned into
/// its host address), kept alive by `owner`.
pub fn view_of(
    d: &PyDevice,
    addr: u64,
    bytes: usize,
    host: bool,
    dtype: DLDataType,
    shape: Vec<i64>,
    owner: Py<PyAny>,
) -> PyResult<PyTensorView> {
    let (ptr, device) = match (d.cpu(), d.gpu()) {
        (Some(cpu), _) => {
            // SAFETY: only used to look the range up in the arena (no access through it).
            let b = unsafe { Buffer::from_raw(addr, bytes, MemoryKind::Device, d.space()) };
            (cpu.host_ptr(&b).py_err()? as u64, DLDevice::CPU)
        }
        (None, Some(g)) if !host => (addr, DLDevice::cuda(g.info().ordinal as i32)),
        // Host memory goes out as plain CPU memory (torch and NumPy import kDLCPU; torch
        // refuses kDLCUDAHost), addressed by its host address.
        (None, _) => (addr, DLDevice::CPU),
    };
    let keep = Arc::new(KeepInner {
        buffer: None,
        objects: vec![owner],
    });
    // SAFETY: `bytes` bytes at `ptr` belong to the object `owner` keeps alive (a pool, a
    // staging, a host pool), and `shape` spans exactly them (callers build it from the same
    // sizes).
    Ok(unsafe { PyTensorView::contiguous(ptr, device, dtype, shape, keep) })
}

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
    /// layer during its forward), uploading the pair table on `stream` (waits for the upload).
    #[new]
    #[pyo3(signature = (staging, pool, layers = None, stream = None))]
    fn new(
        py: Python<'_>,
        staging: Py<PyChunkStaging>,
        pool: Py<PyDevicePool>,
        layers: Option<Vec<usize>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let device = pool.get().device.clone_ref(py);
        let b = device.get().resolve(stream)?;
        let (s, p) = (staging.get().inner.clone(), pool.get().inner.clone());
        let w = py
            .detach(|| {
                OwnedRowWrite::prepare_sync(b.as_ref(), s, p, |m: ModelLayer| {
                    layers.as_ref().is_none_or(|l| l.contains(&m.0))
                })
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
    fn run_checked(
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
            if t.dtype != DLDataType::I64 || !t.compact || t.ptr % 8 != 0 {
                return Err(invalid(format!(
                    "slots: expected a C-contiguous int64 tensor; got {} of shape {:?}",
                    crate::tensor::dtype_name(t.dtype),
                    t.shape
                )));
            }
            let want = DLDevice::cuda(d.gpu().map_or(0, |g| g.info().ordinal as i32));
            if t.device != want {
                return Err(invalid(format!(
                    "slots on {}, the pool on {}",
                    crate::tensor::device_name(t.device),
                    crate::tensor::device_name(want)
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
            let mut kept = self.slots.lock().unwrap_or_else(|p| p.into_inner());
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

/// Host int64 values from a NumPy array, any DLPack CPU tensor, or a sequence of ints.
pub fn host_i64s(v: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if v.hasattr("__dlpack__")? {
        let t = import(v)?;
        let cpu = matches!(
            t.device.device_type,
            dlpark::ffi::DLDeviceType::CPU | dlpark::ffi::DLDeviceType::CUDAHOST
        );
        if !cpu || t.dtype != DLDataType::I64 || !t.compact {
            return Err(invalid(format!(
                "expected host int64 values (a C-contiguous int64 array on the CPU); got {} of shape {:?} on {}",
                crate::tensor::dtype_name(t.dtype),
                t.shape,
                crate::tensor::device_name(t.device)
            )));
        }
        let n = t.nbytes / 8;
        if n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: `n` int64s of host memory described by the tensor, which `t.object` keeps
        // alive for the copy; read under the GIL while the caller holds the array.
        let s = unsafe { std::slice::from_raw_parts(t.ptr as *const i64, n) };
        return Ok(s.to_vec());
    }
    v.extract::<Vec<i64>>()
}

/// How a rank's memory is split: scratch slots first (SGLang's formula), then whole pages.
#[pyclass(frozen, module = "kvshard", name = "Budget")]
pub struct PyBudget(pub Budget);

#[pymethods]
impl PyBudget {
    /// Splits `bytes` for `geometry` sharded by `placement`: scratch for prefixes of
    /// `context_len` tokens (`contexts` of them per batch) plus a `chunk_size` chunk, then as
    /// many whole pages as fit.
    #[staticmethod]
    #[pyo3(signature = (bytes, context_len, chunk_size, geometry, placement, contexts = kvshard::pool::DEFAULT_CONTEXTS))]
    fn plan(
        bytes: u64,
        context_len: u64,
        chunk_size: u64,
        geometry: &PyCacheGeometry,
        placement: PyPlacement,
        contexts: u64,
    ) -> PyResult<Self> {
        let mut req = BudgetRequest::new(bytes, context_len, chunk_size);
        req.contexts = contexts;
        Ok(Self(Budget::plan(&req, &geometry.0, placement.0).py_err()?))
    }

    /// Rows of one scratch slot (0 unsharded).
    #[getter]
    fn scratch_rows(&self) -> u64 {
        self.0.scratch_rows
    }
    /// Tokens of the prefix region of a slot.
    #[getter]
    fn max_prefix_tokens(&self) -> u64 {
        self.0.max_prefix_tokens
    }
    /// Bytes of all scratch slots.
    #[getter]
    fn scratch_bytes(&self) -> u64 {
        self.0.scratch_bytes
    }
    /// Bytes of one page across every layer and component.
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.0.page_bytes
    }
    /// Physical pages per layer (page 0 is padding).
    #[getter]
    fn pages(&self) -> u64 {
        self.0.pages
    }
    /// Bytes the pool takes.
    #[getter]
    fn pool_bytes(&self) -> u64 {
        self.0.pool_bytes
    }
    /// Logical token capacity of the shard group.
    #[getter]
    fn logical_capacity(&self) -> u64 {
        self.0.logical_capacity
    }

    fn __repr__(&self) -> String {
        self.0.to_string()
    }
}
