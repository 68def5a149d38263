//! HiCache: host pools (kvshard's and SGLang's formats), transfer plans, host transfers with any
//! `Method` they take, and the controller with its routes and write policies, each choice an
//! enum class (`HostLayout`, `Method`, `Route`, `WritePolicy`, `Direction`) whose kernel
//! members take their CTAs from the call's `ctas=`.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use kvshard::backend::{Backend, Launch, MemoryKind};
use kvshard::copy::{BlockSpace, CounterWait, Direction, LayerSignals, Layers, TableBuffer};
use kvshard::hicache::{
    BackupAck, CacheNode, HiCacheController, HostLayout, HostPool, HostTransfer, LayerReady,
    LoadAck, LoadHandle, Route, StagedIo, Streams, TransferPlan, WritePolicy,
};
use kvshard::hicache::{DraftPacking, HostBufferLayout, HostFormat, HostMemory, RegisteredRegion};
use kvshard::index::{LocalPage, ModelLayer, StoredLayer};

use crate::device::{after_event, PyDevice, PyStream};
use crate::errors::{invalid, IntoPy};
use crate::geometry::{PyCacheGeometry, PyComponent, PyComponentLayout};
use crate::method::PyMethod;
use crate::pool::{export_dtype, view_of, PoolKeep, PyDevicePool, PyKeep};
use crate::shard::{logical, raw, PyPlacement};
use crate::tensor::{check, import_writable, PyTensorView, Want};

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How a host pool orders the blocks of a buffer.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "HostLayout"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyHostLayout {
    /// `[L][pages][block]`.
    LAYER_FIRST,
    /// `[pages * 64][L][row]` (indexer `[pages][L][8448]`): SGLang's default.
    PAGE_FIRST,
    /// `[pages][L][block]`.
    PAGE_FIRST_DIRECT,
}

mirror_enum!(PyHostLayout <=> HostLayout {
    LAYER_FIRST = LayerFirst,
    PAGE_FIRST = PageFirst,
    PAGE_FIRST_DIRECT = PageFirstDirect,
});

#[pymethods]
impl PyHostLayout {
    /// The layout SGLang names `name` (`"layer_first"`, `"page_first"`, `"page_first_direct"`:
    /// its `hicache_mem_layout`); `str(layout)` is the name back.
    #[staticmethod]
    fn from_name(name: &str) -> PyResult<Self> {
        Ok(HostLayout::from_name(name).py_err()?.into())
    }

    fn __str__(&self) -> String {
        HostLayout::from(*self).to_string()
    }
}

/// How a `HiCacheController` operation moves a node (`ctas=` sets the kernels' CTAs): straight
/// between the pools with a `Method`, or through the controller's device staging.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "Route"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyRoute {
    /// Direct, on the SM kernel; a load counts each layer's readiness as it lands.
    KERNEL,
    /// Direct, on coalesced copy-engine copies; a load lands layer after layer.
    COPY_ENGINE,
    /// Direct, one copy-engine call per block.
    PER_BLOCK,
    /// Direct, one batch copy.
    BATCH,
    /// Through device staging, relaid by the copy engine: every host layout and device pool
    /// (a load lands every layer at once).
    STAGED,
    /// Through device staging, relaid by the kernel.
    STAGED_KERNEL,
}

impl PyRoute {
    /// kvshard's route on `b`, its kernel in the host-I/O shape of `ctas` CTAs.
    pub fn on(self, b: &dyn Backend, ctas: u32) -> Route {
        let method = |m: PyMethod| m.host_io(b, ctas);
        match self {
            Self::KERNEL => Route::Direct(method(PyMethod::KERNEL)),
            Self::COPY_ENGINE => Route::Direct(method(PyMethod::COPY_ENGINE)),
            Self::PER_BLOCK => Route::Direct(method(PyMethod::PER_BLOCK)),
            Self::BATCH => Route::Direct(method(PyMethod::BATCHED_COPY_ENGINE)),
            Self::STAGED => Route::Staged(method(PyMethod::COPY_ENGINE)),
            Self::STAGED_KERNEL => Route::Staged(method(PyMethod::KERNEL)),
        }
    }
}

/// When a `HiCacheController` backs a device node up to the host.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "WritePolicy"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyWritePolicy {
    /// On the node's first access.
    WRITE_THROUGH,
    /// On the node's second access.
    WRITE_THROUGH_SELECTIVE,
    /// Only when the node is evicted (eviction waits for the copy).
    WRITE_BACK,
}

mirror_enum!(PyWritePolicy <=> WritePolicy {
    WRITE_THROUGH = WriteThrough,
    WRITE_THROUGH_SELECTIVE = WriteThroughSelective,
    WRITE_BACK = WriteBack,
});

/// Which way a `HostTransfer` moves pages.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "Direction"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyDirection {
    /// Host to device.
    LOAD,
    /// Device to host.
    BACKUP,
}

mirror_enum!(PyDirection <=> Direction {
    LOAD = Load,
    BACKUP = Backup,
});

fn layers_of(layer: Option<usize>) -> Layers {
    layer.map_or(Layers::All, |m| Layers::One(ModelLayer(m)))
}

/// The `(host address, bytes)` of each registration covering one host tensor.
type Registrations = Vec<(usize, usize)>;

/// One host buffer: which components it holds, its shape and strides.
#[pyclass(frozen, module = "kvshard", name = "HostBufferLayout")]
pub struct PyHostBufferLayout(HostBufferLayout);

#[pymethods]
impl PyHostBufferLayout {
    /// Components stored in it, in layer order (the target's, then a packed draft's).
    #[getter]
    fn components(&self) -> Vec<PyComponent> {
        self.0.components.iter().map(|&c| c.into()).collect()
    }
    /// Stored layers of all its components.
    #[getter]
    fn layers(&self) -> usize {
        self.0.layers
    }
    /// Pages it holds.
    #[getter]
    fn pages(&self) -> u64 {
        self.0.pages
    }
    /// Bytes of one (page, layer) block.
    #[getter]
    fn block_bytes(&self) -> usize {
        self.0.block_bytes
    }
    /// Rows of a block.
    #[getter]
    fn rows(&self) -> usize {
        self.0.rows
    }
    /// Bytes of one row.
    #[getter]
    fn row_bytes(&self) -> usize {
        self.0.row_bytes
    }
    /// Bytes of the buffer.
    #[getter]
    fn bytes(&self) -> usize {
        self.0.bytes
    }
    /// `(layer_stride, page_stride, row_stride)` in bytes.
    #[getter]
    fn strides(&self) -> (u64, u64, u64) {
        let s = self.0.strides;
        (s.layer_stride, s.page_stride, s.row_stride)
    }
    /// Whether it holds indexer blocks.
    #[getter]
    fn is_indexer(&self) -> bool {
        self.0.is_indexer()
    }
    fn __repr__(&self) -> String {
        format!(
            "HostBufferLayout({:?}, {} layers x {} pages x {} B)",
            self.0.components, self.0.layers, self.0.pages, self.0.block_bytes
        )
    }
}

/// SGLang's tensor shape of a host buffer in `layout` (elements of `row` per row), in the
/// dtype [`export_dtype`] gives.
fn sglang_shape(layout: HostLayout, b: &HostBufferLayout, row: usize) -> Vec<i64> {
    let (l, p, r) = (b.layers as i64, b.pages as i64, row as i64);
    let page = kvshard::geometry::PAGE_SIZE as i64;
    if b.is_indexer() {
        match layout {
            HostLayout::LayerFirst => vec![l, p, r],
            _ => vec![p, l, 1, r],
        }
    } else {
        match layout {
            HostLayout::LayerFirst => vec![l, p * page, 1, r],
            HostLayout::PageFirst => vec![p * page, l, 1, r],
            HostLayout::PageFirstDirect => vec![p, l, page, 1, r],
        }
    }
}

fn format_of(
    layout: PyHostLayout,
    packed_draft: bool,
    indexer_extra_pages: Option<u64>,
    sglang: bool,
) -> HostFormat {
    HostFormat {
        layout: layout.into(),
        draft: if packed_draft {
            DraftPacking::Packed
        } else {
            DraftPacking::Separate
        },
        indexer_extra_pages: indexer_extra_pages.unwrap_or(u64::from(sglang)),
    }
}

/// One rank's host pool: pinned host buffers holding `pages` pages of every component.
///
/// `HostPool(device, geometry, pages, layout)` allocates kvshard's format (one buffer per
/// component). SGLang's byte layout: `sglang=True` (the indexer buffer one page longer),
/// `packed_draft=True` (the MTP draft as the tail layer of the target's buffers, SGLang's
/// default NextN mode). `HostPool.wrap` takes the engine's own host tensors instead.
/// `buffer_view(i)` hands each buffer back as a tensor (SGLang's shape) for storage backends.
#[pyclass(frozen, module = "kvshard", name = "HostPool")]
pub struct PyHostPool {
    pub inner: Arc<HostPool>,
    pub device: Py<PyDevice>,
    #[allow(dead_code)]
    keep: PoolKeep,
}

#[pymethods]
impl PyHostPool {
    #[new]
    #[pyo3(signature = (device, geometry, pages, layout, *, packed_draft = false, sglang = false, indexer_extra_pages = None, numa_local = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device: Py<PyDevice>,
        geometry: &PyCacheGeometry,
        pages: u64,
        layout: PyHostLayout,
        packed_draft: bool,
        sglang: bool,
        indexer_extra_pages: Option<u64>,
        numa_local: bool,
    ) -> PyResult<Self> {
        let format = format_of(layout, packed_draft, indexer_extra_pages, sglang);
        let d = device.get();
        let b = d.default_backend()?;
        let g = geometry.0.clone();
        let pool = match (numa_local, d.gpu()) {
            (true, Some(gpu)) => {
                let gpu = gpu.clone();
                py.detach(|| {
                    let cuda = kvshard::backend::cuda::CudaBackend::new(gpu)?;
                    HostPool::new_numa_local(&cuda, &g, pages, format)
                })
            }
            _ => py.detach(|| HostPool::new_with(b.as_ref(), &g, pages, format)),
        }
        .py_err()?;
        Ok(Self {
            inner: Arc::new(pool),
            device,
            keep: PoolKeep::default(),
        })
    }

    /// Wraps the engine's host tensors, one per buffer of the format (`HostPool.buffer_layouts`
    /// order; SGLang's `kv_buffer` then its indexer host buffer), each C-contiguous and exactly
    /// the buffer's size, without copying. On a GPU the memory must already be registered with
    /// CUDA (`cudaHostRegister`, as SGLang does): kvshard asks the driver for its device alias
    /// and never unregisters it; `registrations` gives, per tensor, the `(address, bytes)` of
    /// each registration when there were several (read from SGLang's
    /// `_sglang_cuda_host_registered_ranges` when present), or `register=True` has kvshard
    /// register unregistered, 4 KiB-aligned memory itself. On the CPU backend the arrays are
    /// adopted into its arena. Backups write into the tensors: a read-only one is refused with
    /// `ReadOnlyError`, and each is held (a buffer export, a weak reference) so NumPy refuses
    /// to resize it while the pool lives.
    #[staticmethod]
    #[pyo3(signature = (device, geometry, pages, buffers, layout, *, packed_draft = false, sglang = false, indexer_extra_pages = None, registrations = None, register = false))]
    #[allow(clippy::too_many_arguments)]
    fn wrap(
        py: Python<'_>,
        device: Py<PyDevice>,
        geometry: &PyCacheGeometry,
        pages: u64,
        buffers: &Bound<'_, PyAny>,
        layout: PyHostLayout,
        packed_draft: bool,
        sglang: bool,
        indexer_extra_pages: Option<u64>,
        registrations: Option<Vec<Option<Registrations>>>,
        register: bool,
    ) -> PyResult<Self> {
        let format = format_of(layout, packed_draft, indexer_extra_pages, sglang);
        let d = device.get();
        let g = &geometry.0;
        let layouts = format.buffers(g, pages).py_err()?;
        let tensors: Vec<Bound<'_, PyAny>> = if let Ok(l) = buffers.cast::<PyList>() {
            l.iter().collect()
        } else if let Ok(t) = buffers.cast::<PyTuple>() {
            t.iter().collect()
        } else {
            vec![buffers.clone()]
        };
        if tensors.len() != layouts.len() {
            return Err(invalid(format!(
                "{} host tensors given; the {format} format has {} buffers ({})",
                tensors.len(),
                layouts.len(),
                layouts
                    .iter()
                    .map(|b| format!("{:?}", b.components))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let mut keep = PoolKeep::default();
        let mut imported = Vec::with_capacity(tensors.len());
        for (i, (t, l)) in tensors.iter().zip(&layouts).enumerate() {
            let what = format!("host buffer {i} ({:?})", l.components);
            let it = import_writable(t, &what, &mut keep.objects)?;
            let comp = g
                .components()
                .into_iter()
                .find(|c| c.component == l.components[0])
                .ok_or_else(|| invalid("host buffer of no component"))?;
            let (sizes, names) = crate::pool::item_sizes(&comp, g.target.latent);
            let want = Want {
                what,
                devices: crate::pool::dl_devices(d, true),
                row_bytes: l.row_bytes,
                item_sizes: sizes,
                dtypes: names,
                min_bytes: l.bytes as u64,
                min_why: format!(
                    "{} layers x {} pages x {} B blocks, {format}",
                    l.layers, l.pages, l.block_bytes
                ),
                exact: true,
            };
            check(&it, &want)?;
            imported.push(it);
        }
        let pool = match (d.cpu(), d.gpu()) {
            (Some(cpu), _) => {
                let mut memory = Vec::with_capacity(imported.len());
                for it in &imported {
                    // SAFETY: the array's bytes (its DLPack description), kept alive by the
                    // adopted allocation's keep-alive; the engine must not touch them while
                    // kvshard's work uses them (the documented contract of wrapping).
                    let b = unsafe {
                        cpu.adopt_raw(
                            it.ptr as *mut u8,
                            it.nbytes,
                            MemoryKind::PinnedHost,
                            Arc::new(PyKeep(it.object.clone_ref(py))),
                        )
                    }
                    .py_err()?;
                    keep.buffers.push(b.clone());
                    memory.push(HostMemory {
                        memory: b,
                        host: Some(it.ptr as *mut u8),
                    });
                }
                let backend: Arc<dyn Backend> = cpu.clone();
                // SAFETY: adopted memory of this arena, alive with `keep`, with its host
                // addresses.
                unsafe { HostPool::wrap(backend.as_ref(), g, pages, format, memory) }
            }
            (None, Some(gpu)) if register => {
                let regions: Vec<kvshard::hicache::HostRegion> = imported
                    .iter()
                    .map(|it| kvshard::hicache::HostRegion {
                        host: it.ptr as *mut u8,
                        len: it.nbytes,
                    })
                    .collect();
                // SAFETY: the tensors' memory, checked above and kept alive by this object;
                // the caller asked kvshard to register it (so it is not registered yet).
                unsafe { HostPool::register_with(gpu, g, pages, format, &regions, 1 << 30) }
            }
            (None, Some(gpu)) => {
                let mut regions = Vec::with_capacity(imported.len());
                for (i, (it, t)) in imported.iter().zip(&tensors).enumerate() {
                    let given = registrations
                        .as_ref()
                        .and_then(|r| r.get(i).cloned().flatten());
                    let from_sglang = || -> Option<Vec<(usize, usize)>> {
                        t.getattr("_sglang_cuda_host_registered_ranges")
                            .ok()?
                            .extract()
                            .ok()
                    };
                    regions.push(RegisteredRegion {
                        host: it.ptr as *mut u8,
                        len: it.nbytes,
                        registrations: given.or_else(from_sglang).unwrap_or_default(),
                    });
                }
                // SAFETY: the tensors' memory, checked above and kept alive by this object;
                // the documented contract: registered with CUDA as `registrations` say (the
                // driver refuses memory it does not know).
                unsafe { HostPool::adopt_registered(gpu, g, pages, format, &regions) }
            }
            (None, None) => unreachable_device(),
        }
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

    /// Usable pages (page 0 is padding).
    #[getter]
    fn pages(&self) -> u64 {
        self.inner.pages()
    }

    /// Block order of every buffer.
    #[getter]
    fn layout(&self) -> PyHostLayout {
        self.inner.layout().into()
    }

    /// Whether the MTP draft is packed into the target's buffers.
    #[getter]
    fn packed_draft(&self) -> bool {
        self.inner.format().draft == DraftPacking::Packed
    }

    /// Pages indexer buffers hold beyond `pages`.
    #[getter]
    fn indexer_extra_pages(&self) -> u64 {
        self.inner.format().indexer_extra_pages
    }

    /// Bytes of the whole pool.
    #[getter]
    fn bytes(&self) -> usize {
        self.inner.bytes()
    }

    /// Where the pages were placed: `CallerThread`, `GpuLocal { node: .. }` (next to the GPU),
    /// `Unplaced(why)`, or `Engine` (the engine's memory).
    #[getter]
    fn numa(&self) -> String {
        format!("{:?}", self.inner.numa())
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

    /// The layout of every buffer, in order.
    fn buffer_layouts(&self) -> Vec<PyHostBufferLayout> {
        self.inner
            .buffer_layouts()
            .into_iter()
            .map(|b| PyHostBufferLayout(b.clone()))
            .collect()
    }

    /// The buffer holding `component`, and the buffer layer of its stored layer 0.
    fn component_buffer(&self, component: PyComponent) -> PyResult<(usize, usize)> {
        self.inner.component_buffer(component.into()).py_err()
    }

    /// The host address of buffer `index` (None where unknown).
    fn host_ptr(&self, index: usize) -> PyResult<Option<usize>> {
        let d = self.device.get();
        match (self.inner.host_ptr(index).py_err()?, d.cpu()) {
            (Some(p), _) => Ok(Some(p as usize)),
            (None, Some(cpu)) => {
                let m = self.inner.buffer_memory(index).py_err()?;
                Ok(Some(cpu.host_ptr(m).py_err()? as usize))
            }
            (None, None) => Ok(None),
        }
    }

    /// The device alias kernels address buffer `index` by.
    fn device_ptr(&self, index: usize) -> PyResult<u64> {
        Ok(self.inner.buffer_memory(index).py_err()?.addr())
    }

    /// Buffer `index` as a host (CPU) tensor view in SGLang's shape (`layer_first`
    /// `[L, pages*64, 1, row]`, `page_first` `[pages*64, L, 1, row]`, `page_first_direct`
    /// `[pages, L, 64, 1, row]`; indexer `[L, pages, 8448]` or `[pages, L, 1, 8448]`), uint8
    /// (bf16 for bf16 latent rows unless `raw=True`: NumPy has no bfloat16):
    /// `torch.from_dlpack(view)` or `numpy.from_dlpack(view)`.
    #[pyo3(signature = (index, *, raw = false))]
    fn buffer_view(slf: &Bound<'_, Self>, index: usize, raw: bool) -> PyResult<PyTensorView> {
        let this = slf.get();
        let layout = this.inner.buffer_layout(index).py_err()?.clone();
        let comp = this
            .inner
            .components()
            .iter()
            .find(|c| c.component == layout.components[0])
            .cloned()
            .ok_or_else(|| invalid("host buffer of no component"))?;
        let (dtype, row) = export_dtype(&comp, this.inner.geometry().target.latent, raw);
        let shape = sglang_shape(this.inner.layout(), &layout, row);
        let d = this.device.get();
        let owner = slf.clone().into_any().unbind();
        match (this.inner.host_ptr(index).py_err()?, d.gpu()) {
            (Some(host), Some(_)) => {
                let keep = Arc::new(crate::tensor::KeepInner {
                    buffer: None,
                    objects: vec![owner],
                });
                // SAFETY: the buffer's host address and its bytes (exactly `shape`), alive with
                // the host pool that `keep` holds.
                Ok(unsafe {
                    PyTensorView::contiguous(
                        host as u64,
                        dlpark::ffi::DLDevice::CPU,
                        dtype,
                        shape,
                        keep,
                    )
                })
            }
            (None, Some(_)) => Err(invalid(format!(
                "host buffer {index}: its host address is unknown"
            ))),
            (_, None) => {
                let m = this.inner.buffer_memory(index).py_err()?;
                view_of(d, m.addr(), m.len(), true, dtype, shape, owner)
            }
        }
    }

    /// The byte ranges `(offset, bytes)` of local page `page` of buffer `index` (every layer):
    /// one range in the page-major layouts, one per layer in `layer_first`.
    fn page_spans(&self, index: usize, page: u64) -> PyResult<Vec<(u64, u64)>> {
        self.inner.page_spans(index, LocalPage(page)).py_err()
    }

    /// `page_spans` as host addresses: what SGLang's `get_page_buffer_meta` hands storage
    /// backends.
    fn page_pointers(&self, index: usize, page: u64) -> PyResult<Vec<(usize, u64)>> {
        let base = self
            .host_ptr(index)?
            .ok_or_else(|| invalid(format!("host buffer {index}: its host address is unknown")))?;
        Ok(self
            .page_spans(index, page)?
            .into_iter()
            .map(|(o, n)| (base + o as usize, n))
            .collect())
    }

    /// Byte offset of row `row` of block (`layer`, `page`) of `component` from its buffer's
    /// start.
    fn row_offset(
        &self,
        component: PyComponent,
        layer: usize,
        page: u64,
        row: usize,
    ) -> PyResult<u64> {
        self.inner
            .row_offset(component.into(), StoredLayer(layer), LocalPage(page), row)
            .py_err()
    }

    /// Every block in canonical order (component, layer, page, rows), the same bytes whatever
    /// the format (waits for `stream`).
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

    /// Sets every byte to `byte` (stream-ordered, no wait).
    #[pyo3(signature = (byte, stream = None))]
    fn fill(&self, py: Python<'_>, byte: u8, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let b = self.device.get().resolve(stream)?;
        let pool = self.inner.clone();
        py.detach(|| pool.fill(b.as_ref(), byte)).py_err()
    }

    fn __repr__(&self) -> String {
        format!(
            "<kvshard.HostPool {} pages, {}, {} bytes>",
            self.inner.pages(),
            self.inner.format(),
            self.inner.bytes()
        )
    }
}

fn unreachable_device() -> kvshard::Result<HostPool> {
    Err(kvshard::Error::InvalidArgument(
        "a device is the CPU backend or a GPU".into(),
    ))
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
            let slots: Vec<kvshard::index::Slot> = crate::pool::host_i64s(v)?
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
            py.detach(|| LayerSignals::new_sync(b.as_ref(), model_layers))
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
    ready: Vec<LayerReady>,
    device: Py<PyDevice>,
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
    fn prepare_kernel(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
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
    fn prepare_staged(
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
/// the CTAs of its kernels): straight between the pools on an I/O backend, or through device
/// staging.
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
        streams: Option<&Bound<'_, pyo3::types::PyDict>>,
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
                        crate::device::Kind::Cpu(c) => Arc::new(c.new_stream()),
                        crate::device::Kind::Cuda(g) => {
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
    #[pyo3(signature = (node, after, route = PyRoute::COPY_ENGINE, *, ctas = 2))]
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
    #[pyo3(signature = (node, after, route = PyRoute::COPY_ENGINE, *, ctas = 2))]
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
    #[pyo3(signature = (node, after, route = PyRoute::COPY_ENGINE, *, ctas = 2))]
    fn evict(
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
    #[pyo3(signature = (node, device_pages, after = None, route = PyRoute::KERNEL, *, ctas = 2))]
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
    fn ack_backups(&self, py: Python<'_>, count: usize) -> PyResult<Vec<PyBackupAck>> {
        Ok(self
            .with(py, |c| c.ack_backups_sync(count))?
            .into_iter()
            .map(PyBackupAck)
            .collect())
    }

    /// Pops the `count` oldest loads (blocks until they completed).
    fn ack_loads(&self, py: Python<'_>, count: usize) -> PyResult<Vec<PyLoadAck>> {
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
