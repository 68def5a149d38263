//! HiCache host pools: pinned host buffers in kvshard's or SGLang's byte layout, allocated by
//! kvshard or wrapping the engine's host tensors, and each buffer's layout and tensor view.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{Backend, MemoryKind};
use kvshard::copy::BlockSpace;
use kvshard::geometry::CacheGeometry;
use kvshard::hicache::{
    DraftPacking, HostBufferLayout, HostFormat, HostLayout, HostMemory, HostPool, RegisteredRegion,
};
use kvshard::index::{LocalPage, StoredLayer};

use crate::device::PyDevice;
use crate::errors::{invalid, IntoPy};
use crate::geometry::{PyCacheGeometry, PyComponent, PyComponentLayout};
use crate::hicache_enums::PyHostLayout;
use crate::pool_tensors::{dl_devices, export_dtype, item_sizes, view_of, PoolKeep, PyKeep};
use crate::tensor::{check, import_writable, Imported, KeepInner, PyTensorView, Want};

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
///
/// A wrapping pool holds the engine's tensors for as long as it and the work queued on it live
/// (memory kvshard registered: until it is unregistered), and claims their memory: the same
/// memory wrapped twice is refused.
#[pyclass(frozen, module = "kvshard", name = "HostPool")]
pub struct PyHostPool {
    pub inner: Arc<HostPool>,
    pub device: Py<PyDevice>,
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
        let imported = import_buffers(d, g, &format, &layouts, &tensors, &mut keep)?;
        keep.commit()?;
        let pool = match (d.cpu(), d.gpu()) {
            (Some(cpu), _) => {
                let memory = adopted(py, cpu, &imported, &mut keep)?;
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
                // SAFETY: the tensors' memory, checked above and held (`keep`, taken below) until
                // the pool's registrations are undone; the caller asked kvshard to register it
                // (so it is not registered yet).
                let owner: Arc<dyn Send + Sync> = Arc::new(std::mem::take(&mut keep));
                unsafe {
                    HostPool::register_with_owner(
                        gpu,
                        g,
                        pages,
                        format,
                        &regions,
                        1 << 30,
                        Some(owner),
                    )
                }
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
                // SAFETY: the tensors' memory, checked above and held by the pool (`keep`,
                // below) until it and its work are gone; the documented contract: registered
                // with CUDA as `registrations` say (the driver refuses memory it does not know).
                unsafe { HostPool::adopt_registered(gpu, g, pages, format, &regions) }
            }
            (None, None) => unreachable_device(),
        }
        .py_err()?;
        // The tensors live as long as the pool and its queued work (when kvshard registered
        // them, the registrations hold them already and this holds nothing).
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
    pub(crate) fn host_ptr(&self, index: usize) -> PyResult<Option<usize>> {
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
                let keep = Arc::new(KeepInner {
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

/// The imported host tensors adopted into `cpu`'s arena (held by `keep`), with their host
/// addresses.
fn adopted(
    py: Python<'_>,
    cpu: &CpuBackend,
    imported: &[Imported],
    keep: &mut PoolKeep,
) -> PyResult<Vec<HostMemory>> {
    let mut memory = Vec::with_capacity(imported.len());
    for it in imported {
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
    Ok(memory)
}

/// The engine's host tensors imported as the buffers `layouts` of `format` describe, each
/// checked (device, row and item sizes, at least its bytes) and claimed in `keep`.
fn import_buffers(
    d: &PyDevice,
    g: &CacheGeometry,
    format: &HostFormat,
    layouts: &[HostBufferLayout],
    tensors: &[Bound<'_, PyAny>],
    keep: &mut PoolKeep,
) -> PyResult<Vec<Imported>> {
    let mut imported = Vec::with_capacity(tensors.len());
    for (i, (t, l)) in tensors.iter().zip(layouts).enumerate() {
        let what = format!("host buffer {i} ({:?})", l.components);
        let it = import_writable(t, &what, &mut keep.objects)?;
        keep.claim(&it, &what);
        let comp = g
            .components()
            .into_iter()
            .find(|c| c.component == l.components[0])
            .ok_or_else(|| invalid("host buffer of no component"))?;
        let (sizes, names) = item_sizes(&comp, g.target.latent);
        let want = Want {
            what,
            devices: dl_devices(d, true),
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
    Ok(imported)
}

fn unreachable_device() -> kvshard::Result<HostPool> {
    Err(kvshard::Error::InvalidArgument(
        "a device is the CPU backend or a GPU".into(),
    ))
}
