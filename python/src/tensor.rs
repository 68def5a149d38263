//! Tensors without copies, both ways, through DLPack.
//!
//! - In: [`import`] takes any object with `__dlpack__` (torch, CuPy, JAX, NumPy) and reads its
//!   address, size, dtype, shape and device without copying or synchronizing (CUDA producers
//!   are asked with `stream=-1`, "no synchronization": the pools wrap memory, they do not read
//!   it now). [`check`] holds it against what the geometry expects and says, in a
//!   `ValueError`, what that was. [`import_writable`] is the import of memory kvshard writes
//!   into: it refuses read-only producers and holds the tensor so NumPy cannot reallocate it.
//!   [`host_i64s`] reads host int64 values (slots) from a CPU tensor or a sequence of ints.
//! - Out: [`PyTensorView`] hands kvshard's own memory (host pools, staging, pools kvshard
//!   allocated) to the engine as a DLPack producer (`torch.from_dlpack(view)`,
//!   `numpy.from_dlpack(view)`), keeping the memory alive while any consumer holds it. A view
//!   is not synchronized with any stream: it is ready when the work that wrote it has run.

use std::ffi::c_void;
use std::sync::Arc;

use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType};
use dlpark::metadata::Dynamic;
use dlpark::python::consumer::stream as dl_stream;
use dlpark::python::{DlpackExporter, DlpackStream, ExportRequest, StreamArg};
use dlpark::{DlpackFlags, Managed};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView, PyString, PyWeakrefReference};

use kvshard::backend::Buffer;

use crate::errors::{invalid, read_only};

/// Asks CUDA producers for no synchronization (`stream=-1`) and CPU producers for none at all
/// (NumPy refuses any stream for CPU arrays).
struct NoSync;

// SAFETY: the stream argument is a constant sentinel; `wait_for_producer` keeps its default
// (declining the C exchange API's stream ordering, so the standard protocol is used).
unsafe impl DlpackStream for NoSync {
    fn as_python_arg(&self, _py: Python<'_>, device: DLDevice) -> PyResult<StreamArg> {
        Ok(if device.device_type == DLDeviceType::CUDA {
            dl_stream::no_sync()
        } else {
            dl_stream::none()
        })
    }
}

/// What an imported tensor is: its first byte, extent and description. The Python object is
/// kept so the memory outlives whatever wraps it.
pub struct Imported {
    /// Address of the first element (data pointer plus byte offset).
    pub ptr: u64,
    /// Bytes of the tensor.
    pub nbytes: usize,
    pub device: DLDevice,
    pub dtype: DLDataType,
    pub shape: Vec<i64>,
    /// C-contiguous (compact row-major).
    pub compact: bool,
    /// The producer marked it read-only (DLPack's `READ_ONLY` flag; only versioned capsules
    /// carry it, and NumPy refuses to export a read-only array through a legacy one).
    pub read_only: bool,
    pub object: Py<PyAny>,
}

/// The legacy default stream sentinel, for CUDA producers that refuse `stream=-1`: they then
/// order their pending work before the legacy default stream (on the device, no host wait).
struct LegacyDefault;

// SAFETY: as NoSync: a constant sentinel, the exchange API's ordering declined.
unsafe impl DlpackStream for LegacyDefault {
    fn as_python_arg(&self, _py: Python<'_>, device: DLDevice) -> PyResult<StreamArg> {
        Ok(if device.device_type == DLDeviceType::CUDA {
            dl_stream::cuda(std::ptr::null_mut())
        } else {
            dl_stream::none()
        })
    }
}

/// Reads `object`'s DLPack description without copying or synchronizing.
pub fn import(object: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let imported = match dlpark::python::from_dlpack(object.as_borrowed(), Some(&NoSync), None) {
        Ok(t) => t,
        Err(first) => dlpark::python::from_dlpack(object.as_borrowed(), Some(&LegacyDefault), None)
            .map_err(|_| first)?,
    };
    let read_only = imported.flags().contains(DlpackFlags::READ_ONLY);
    let t = imported
        .validate()
        .map_err(|e| invalid(format!("not a valid DLPack tensor: {e}")))?;
    let compact = t
        .is_compact()
        .map_err(|e| invalid(format!("not a valid DLPack tensor: {e}")))?;
    let ptr = (t.data_ptr() as u64)
        .checked_add(t.byte_offset())
        .ok_or_else(|| invalid("tensor address overflows"))?;
    Ok(Imported {
        ptr,
        nbytes: t.num_bytes(),
        device: t.device(),
        dtype: t.dtype(),
        shape: t.shape().to_vec(),
        compact,
        read_only,
        object: object.clone().unbind(),
    })
    // The capsule's managed tensor is released here; `object` keeps the memory.
}

/// Imports `object` as memory kvshard will write into (`what` names it in errors), and pushes
/// onto `keep` what must live as long as kvshard may write there.
///
/// - A read-only producer is refused with `ReadOnlyError`: one whose buffer export is
///   read-only, or whose DLPack capsule carries `READ_ONLY`. Writing into a read-only mapping
///   (`np.memmap(mode="r")`) crashes the interpreter; into an array over `bytes`, it changes an
///   immutable object.
/// - For producers with the buffer protocol (NumPy), a buffer export (a `memoryview`) is kept:
///   exporters that track exports (`bytearray`, `mmap`) refuse to resize or close under it.
/// - A weak reference is kept: NumPy refuses `ndarray.resize` on an array with weak
///   references, even with `refcheck=False`, which otherwise reallocates the memory under
///   kvshard (it checks neither buffer exports nor, with `refcheck=False`, references).
/// - The object itself is kept, so its memory outlives the wrapper.
pub fn import_writable(
    object: &Bound<'_, PyAny>,
    what: &str,
    keep: &mut Vec<Py<PyAny>>,
) -> PyResult<Imported> {
    // Before the DLPack import: NumPy < 2.1 cannot say "read-only" through DLPack at all (it
    // raises BufferError), while its buffer export always says it.
    let export = PyMemoryView::from(object).ok();
    if let Some(view) = &export {
        if view.getattr("readonly")?.extract::<bool>()? {
            return Err(refused(what));
        }
    }
    let imported = import(object)?;
    if imported.read_only {
        return Err(refused(what));
    }
    keep.push(imported.object.clone_ref(object.py()));
    keep.extend(export.map(|v| v.into_any().unbind()));
    // Objects without weak reference support (no `__weakref__` slot) are held all the same;
    // only NumPy's resize guard relies on it.
    keep.extend(
        PyWeakrefReference::new(object)
            .ok()
            .map(|w| w.into_any().unbind()),
    );
    Ok(imported)
}

fn refused(what: &str) -> PyErr {
    read_only(format!(
        "{what}: the tensor is read-only (a NumPy array with writeable=False, a memmap opened with mode 'r', an array over bytes), and kvshard writes into it; pass writable memory"
    ))
}

/// A dtype's usual name.
pub fn dtype_name(d: DLDataType) -> String {
    let base = match (d.code, d.bits) {
        (DLDataTypeCode::UINT, 8) => "uint8".to_string(),
        (DLDataTypeCode::INT, 8) => "int8".to_string(),
        (DLDataTypeCode::UINT, b) => format!("uint{b}"),
        (DLDataTypeCode::INT, b) => format!("int{b}"),
        (DLDataTypeCode::FLOAT, b) => format!("float{b}"),
        (DLDataTypeCode::BFLOAT, 16) => "bfloat16".to_string(),
        (DLDataTypeCode::BOOL, _) => "bool".to_string(),
        (DLDataTypeCode::FLOAT8_E4M3FN, _) => "float8_e4m3fn".to_string(),
        (DLDataTypeCode::FLOAT8_E4M3, _) => "float8_e4m3".to_string(),
        (DLDataTypeCode::FLOAT8_E5M2, _) => "float8_e5m2".to_string(),
        (code, bits) => format!("dtype(code {}, {bits} bits)", code.0),
    };
    if d.lanes > 1 {
        format!("{base}x{}", d.lanes)
    } else {
        base
    }
}

/// A device's usual name.
pub fn device_name(d: DLDevice) -> String {
    match d.device_type {
        DLDeviceType::CPU => "cpu".into(),
        DLDeviceType::CUDA => format!("cuda:{}", d.device_id),
        DLDeviceType::CUDAHOST => "cpu (pinned)".into(),
        other => format!("DLPack device type {} #{}", other.0, d.device_id),
    }
}

/// What a wrapped tensor must be.
pub struct Want {
    /// What it is for ("target latent buffer of stored layer 3").
    pub what: String,
    /// Devices accepted (the first is the one named in errors).
    pub devices: Vec<DLDevice>,
    /// Bytes of the row its last dimension must hold.
    pub row_bytes: usize,
    /// Element sizes accepted, and their names for the message.
    pub item_sizes: &'static [usize],
    pub dtypes: &'static str,
    /// The fewest bytes it must hold, and why.
    pub min_bytes: u64,
    pub min_why: String,
    /// Exactly `min_bytes` (host buffers), not at least.
    pub exact: bool,
}

/// Checks `t` is what `want` says, or says in a `ValueError` what was expected and what came.
pub fn check(t: &Imported, want: &Want) -> PyResult<()> {
    let item = (usize::from(t.dtype.bits) * usize::from(t.dtype.lanes)).div_ceil(8);
    let last = t.shape.last().copied().unwrap_or(1).max(0) as usize;
    let problems: Vec<String> = [
        (!want.devices.contains(&t.device)).then(|| {
            format!(
                "it is on {}, not {}",
                device_name(t.device),
                device_name(want.devices[0])
            )
        }),
        (!t.compact).then(|| "it is not C-contiguous".to_string()),
        (!want.item_sizes.contains(&item) || t.dtype.bits % 8 != 0)
            .then(|| format!("its dtype is {}", dtype_name(t.dtype))),
        (last * item != want.row_bytes).then(|| {
            format!(
                "its last dimension holds {} bytes ({last} x {item})",
                last * item
            )
        }),
        (if want.exact {
            t.nbytes as u64 != want.min_bytes
        } else {
            (t.nbytes as u64) < want.min_bytes
        })
        .then(|| format!("it holds {} bytes", t.nbytes)),
        (t.ptr % 16 != 0).then(|| format!("its address {:#x} is not 16-byte aligned", t.ptr)),
    ]
    .into_iter()
    .flatten()
    .collect();
    if problems.is_empty() {
        return Ok(());
    }
    Err(invalid(format!(
        "{}: expected a C-contiguous, 16-byte aligned tensor on {} of dtype {} whose last dimension holds one {}-byte row, {} {} bytes ({}); got shape {:?}, dtype {} on {}: {}",
        want.what,
        device_name(want.devices[0]),
        want.dtypes,
        want.row_bytes,
        if want.exact { "exactly" } else { "at least" },
        want.min_bytes,
        want.min_why,
        t.shape,
        dtype_name(t.dtype),
        device_name(t.device),
        problems.join(", ")
    )))
}

/// What keeps exported memory alive: a kvshard buffer, Python objects, or both.
#[derive(Default)]
pub struct KeepInner {
    pub buffer: Option<Buffer>,
    pub objects: Vec<Py<PyAny>>,
}

/// Shared by every capsule exported from a view.
pub type Keep = Arc<KeepInner>;

/// kvshard memory as a DLPack producer: `torch.from_dlpack(view)`, `numpy.from_dlpack(view)`,
/// `cupy.from_dlpack(view)` give a tensor over the same bytes, no copy. It is not ordered with
/// any stream: use it once the work that writes it has run (or on the stream that ran it).
#[pyclass(frozen, module = "kvshard", name = "TensorView")]
pub struct PyTensorView {
    ptr: u64,
    device: DLDevice,
    dtype: DLDataType,
    shape: Vec<i64>,
    /// In elements.
    strides: Vec<i64>,
    keep: Keep,
}

impl PyTensorView {
    /// A C-contiguous view of `shape` elements of `dtype` at `ptr`.
    ///
    /// # Safety
    /// The memory must hold the whole shape and stay valid while `keep` lives.
    pub unsafe fn contiguous(
        ptr: u64,
        device: DLDevice,
        dtype: DLDataType,
        shape: Vec<i64>,
        keep: Keep,
    ) -> Self {
        let mut strides = vec![1i64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        Self {
            ptr,
            device,
            dtype,
            shape,
            strides,
            keep,
        }
    }

    fn export<M: dlpark::ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let prepared = {
            let meta = Dynamic::new(self.shape.clone(), self.strides.clone());
            // SAFETY: the metadata is copied into the allocation (nothing borrowed).
            unsafe { meta.prepare_unchecked_as::<M>() }
        }
        .map_err(|e| invalid(format!("DLPack export: {e}")))?;
        let mut t = prepared.initialize(Box::new(self.keep.clone()));
        t.set_data(self.ptr as *mut c_void)
            .set_device(self.device)
            .set_dtype(self.dtype);
        // SAFETY: the data pointer holds the whole shape (the constructor's contract), kept
        // alive by the context installed above until the consumer's deleter runs; shape and
        // strides live in the allocation; the view is writable (no READ_ONLY flag).
        Ok(unsafe { t.finish() })
    }
}

impl DlpackExporter for PyTensorView {
    fn device(&self) -> DLDevice {
        self.device
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        // No producer stream: the memory is ready once the work that wrote it has run, which
        // the caller orders (module docs).
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<dlpark::ffi::DLManagedTensor>> {
        self.export()
    }

    fn export_versioned(
        &self,
        _py: Python<'_>,
    ) -> PyResult<Managed<dlpark::ffi::DLManagedTensorVersioned>> {
        self.export()
    }
}

#[pymethods]
impl PyTensorView {
    /// The DLPack protocol: a capsule over the same bytes.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        dlpark::python::export_dlpack(self, py, request)
    }

    /// The DLPack device: `(type, id)`.
    fn __dlpack_device__(&self) -> (u32, i32) {
        (self.device.device_type.0, self.device.device_id)
    }

    /// Shape, in elements.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }

    /// Strides, in elements.
    #[getter]
    fn strides(&self) -> Vec<i64> {
        self.strides.clone()
    }

    /// Element type name.
    #[getter]
    fn dtype(&self) -> String {
        dtype_name(self.dtype)
    }

    /// Address of the first byte (host address for host memory, device address otherwise).
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    #[getter]
    fn nbytes(&self) -> i64 {
        let item = (i64::from(self.dtype.bits) + 7) / 8;
        self.shape.iter().product::<i64>() * item
    }

    /// `"cpu"`, `"cpu (pinned)"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        device_name(self.device)
    }

    fn __repr__(&self) -> String {
        format!(
            "<kvshard.TensorView {:?} {} on {} at {:#x}>",
            self.shape,
            dtype_name(self.dtype),
            device_name(self.device),
            self.ptr
        )
    }
}

/// Host int64 values from a NumPy array, any DLPack CPU tensor (1-D, int64), or a sequence of
/// Python ints (a float, even a whole one, is refused rather than truncated).
pub fn host_i64s(v: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if v.hasattr("__dlpack__")? {
        let t = import(v)?;
        let cpu = matches!(
            t.device.device_type,
            DLDeviceType::CPU | DLDeviceType::CUDAHOST
        );
        if !cpu || t.dtype != DLDataType::I64 || !t.compact || t.shape.len() != 1 {
            return Err(invalid(format!(
                "expected host int64 values (a 1-D, C-contiguous int64 array on the CPU); got {} of shape {:?} on {}",
                dtype_name(t.dtype),
                t.shape,
                device_name(t.device)
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
    if v.is_instance_of::<PyString>() || v.is_instance_of::<PyBytes>() {
        return Err(invalid(format!(
            "expected a sequence of ints; got {}",
            v.get_type().name()?
        )));
    }
    let mut out = Vec::new();
    for (i, item) in v.try_iter()?.enumerate() {
        let item = item?;
        // Integers only, as Python's own indexing takes them (`__index__`: ints, NumPy's integer
        // scalars): a float, even a whole one, is refused, never truncated to another slot.
        let value = item.extract::<i64>().map_err(|_| {
            let what = item
                .repr()
                .map(|r| r.to_string())
                .unwrap_or_else(|_| "?".into());
            invalid(format!(
                "value {i} is {what}: expected an integer (an int, or a NumPy integer) that fits int64"
            ))
        })?;
        out.push(value);
    }
    Ok(out)
}
