//! kvshard's errors as Python exceptions, carrying kvshard's message.
//!
//! The exception classes live in `kvshard/_errors.py` (Python allows them several bases:
//! `InvalidArgumentError` is both a `KvshardError` and a `ValueError`); this module looks them up
//! once per interpreter and maps every [`kvshard::Error`] variant to one.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use kvshard::transfer::ChunkStatus;

/// The exception classes of `kvshard._errors`, looked up once.
struct Classes {
    base: Py<PyType>,
    invalid: Py<PyType>,
    memory: Py<PyType>,
    unavailable: Py<PyType>,
    driver: Py<PyType>,
    transfer: Py<PyType>,
    chunk_failed: Py<PyType>,
    hicache: Py<PyType>,
    read_only: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

fn classes(py: Python<'_>) -> PyResult<&Classes> {
    CLASSES.get_or_try_init(py, || {
        let m = py.import("kvshard._errors")?;
        let get = |name: &str| -> PyResult<Py<PyType>> {
            Ok(m.getattr(name)?.cast_into::<PyType>()?.unbind())
        };
        Ok(Classes {
            base: get("KvshardError")?,
            invalid: get("InvalidArgumentError")?,
            memory: get("OutOfMemoryError")?,
            unavailable: get("UnavailableError")?,
            driver: get("DriverError")?,
            transfer: get("TransferError")?,
            chunk_failed: get("ChunkFailedError")?,
            hicache: get("HiCacheError")?,
            read_only: get("ReadOnlyError")?,
        })
    })
}

/// Converts kvshard errors (and only them) into Python exceptions; `?` on a kvshard `Result`
/// inside a `PyResult` function goes through this.
pub struct KvError(pub kvshard::Error);

impl From<kvshard::Error> for KvError {
    fn from(e: kvshard::Error) -> Self {
        Self(e)
    }
}

impl From<KvError> for PyErr {
    fn from(e: KvError) -> PyErr {
        Python::attach(|py| to_py(py, e.0))
    }
}

/// The Python exception for `e`.
pub fn to_py(py: Python<'_>, e: kvshard::Error) -> PyErr {
    use kvshard::Error as E;
    let message = e.to_string();
    let Ok(c) = classes(py) else {
        // The package's own Python half is missing (a broken install): still say what failed.
        return PyRuntimeError::new_err(message);
    };
    let class = match &e {
        E::KernelsMissing | E::NoDriver | E::NoGpu { .. } => &c.unavailable,
        E::Driver { .. } => &c.driver,
        E::KernelRejected { .. }
        | E::GeometryMismatch { .. }
        | E::InvalidGeometry(_)
        | E::OutOfRange { .. }
        | E::InvalidArgument(_)
        | E::MisalignedPrefix { .. }
        | E::DoubleFree { .. }
        | E::NeverAllocated { .. }
        | E::ReservedPage { .. }
        | E::WrongOwner { .. }
        | E::Overflow { .. }
        | E::ForeignMemory { .. }
        | E::DuplicatePage { .. } => &c.invalid,
        E::Exhausted { .. } | E::BudgetTooSmall(_) | E::OutOfMemory { .. } => &c.memory,
        E::Transfer { .. } => &c.transfer,
        E::ChunkFailed { .. } => &c.chunk_failed,
        E::HiCache(_) => &c.hicache,
        _ => &c.base,
    };
    let err = PyErr::from_type(class.bind(py).clone(), message);
    if let E::ChunkFailed {
        request,
        rank,
        chunk,
        reason,
    } = &e
    {
        let value = err.value(py);
        // Attributes for the engine: what to deliver to the decode side. Failing to set them
        // leaves the message, which says the same.
        let _ = value.setattr("request", *request);
        let _ = value.setattr("rank", *rank);
        let _ = value.setattr("chunk", *chunk);
        let _ = value.setattr("reason", reason.as_str());
        if let Some(status) = ChunkStatus::from_error(&e) {
            if let Ok(status) = Py::new(py, crate::transfer::PyChunkStatus(status)) {
                let _ = value.setattr("status", status);
            }
        }
    }
    err
}

/// A `ValueError` of kvshard (`InvalidArgumentError`, also a `ValueError`) with `message`: what
/// the Python layer refuses before calling kvshard (a tensor of the wrong shape, say).
pub fn invalid(message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| match classes(py) {
        Ok(c) => PyErr::from_type(c.invalid.bind(py).clone(), message),
        Err(_) => PyValueError::new_err(message),
    })
}

/// A `ReadOnlyError` (an `InvalidArgumentError`, so also a `ValueError`) with `message`: memory
/// kvshard would write into, marked read-only by its producer (a read-only NumPy array, a memmap
/// opened with mode `"r"`, an array over `bytes`). Writing into it anyway could crash the
/// interpreter (a read-only mapping) or change an immutable object, so it is refused up front.
pub fn read_only(message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| match classes(py) {
        Ok(c) => PyErr::from_type(c.read_only.bind(py).clone(), message),
        Err(_) => PyValueError::new_err(message),
    })
}

/// `Result` of kvshard into `PyResult`.
pub trait IntoPy<T> {
    /// The value, or kvshard's error as its Python exception.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for kvshard::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(|e| PyErr::from(KvError(e)))
    }
}
