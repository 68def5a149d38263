//! kvshard's errors as Python exceptions, carrying kvshard's message.
//!
//! The bottom of the extension's modules: it imports none of them. The exception classes live
//! in `kvshard/_errors.py` (Python allows them several bases: `InvalidArgumentError` is both a
//! `KvshardError` and a `ValueError`); this module looks them up once per interpreter and maps
//! every [`kvshard::Error`] variant to one, by an exhaustive match: a variant the library adds
//! fails to compile here until it is mapped. The attributes an exception carries are plain
//! Python values, so no class of the modules above is needed here (`ChunkFailedError.status`
//! is built from them in `_errors.py`).

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The exception classes of `kvshard._errors`, looked up once.
struct Classes {
    base: Py<PyType>,
    invalid: Py<PyType>,
    memory: Py<PyType>,
    unavailable: Py<PyType>,
    driver: Py<PyType>,
    transfer: Py<PyType>,
    chunk_failed: Py<PyType>,
    deadline: Py<PyType>,
    hicache: Py<PyType>,
    storage: Py<PyType>,
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
            deadline: get("TransferDeadlineError")?,
            hicache: get("HiCacheError")?,
            storage: get("StorageError")?,
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

/// The exception class of `e`. Exhaustive, without a catch-all, so a new variant is a compile
/// error here until it is given its class.
fn class_of<'c>(c: &'c Classes, e: &kvshard::Error) -> &'c Py<PyType> {
    use kvshard::Error as E;
    match e {
        E::KernelsMissing | E::NoDriver | E::NoGpu { .. } | E::NoNccl => &c.unavailable,
        #[cfg(feature = "nixl")]
        E::NixlUnavailable { .. } => &c.unavailable,
        E::Driver { .. } | E::Nccl { .. } => &c.driver,
        E::KernelRejected { .. }
        | E::GeometryMismatch { .. }
        | E::InvalidGeometry(_)
        | E::OutOfRange { .. }
        | E::InvalidArgument(_)
        | E::MisalignedPrefix { .. }
        | E::DoubleFree { .. }
        | E::NeverAllocated { .. }
        | E::NotAllocated { .. }
        | E::ReservedPage { .. }
        | E::WrongOwner { .. }
        | E::Overflow { .. }
        // A size or duration the caller gave outside what kvshard takes.
        | E::OutOfBounds { .. }
        | E::ForeignMemory { .. }
        | E::DuplicatePage { .. }
        | E::StaleChain { .. }
        | E::ForeignAllocator { .. }
        | E::UnsupportedMethod { .. }
        // A request longer than the batch limits allow: no amount of freeing admits it.
        | E::NeverAdmissible { .. }
        // Decode context parallelism: a layout no decode server can have.
        | E::InvalidDecodeLayout { .. } => &c.invalid,
        E::Exhausted { .. }
        | E::BudgetTooSmall(_)
        | E::OutOfMemory { .. }
        | E::ScratchOverflow { .. }
        | E::EvictionStalled { .. } => &c.memory,
        E::Transfer { .. } => &c.transfer,
        #[cfg(feature = "nixl")]
        E::Nixl { .. } => &c.transfer,
        E::ChunkFailed { .. } => &c.chunk_failed,
        E::TransferDeadline(_) => &c.deadline,
        E::HiCache(_) => &c.hicache,
        E::Storage { .. } => &c.storage,
        // kvshard's process-to-process channels and the demo's byte checks have no Python
        // API: should one reach Python, the base class with kvshard's message says what failed.
        E::Os { .. }
        | E::PeerGone { .. }
        | E::Protocol { .. }
        | E::Timeout { .. }
        | E::Verification(_) => &c.base,
    }
}

/// The Python exception for `e`, with the attributes an engine acts on.
pub fn to_py(py: Python<'_>, e: kvshard::Error) -> PyErr {
    let message = e.to_string();
    let Ok(c) = classes(py) else {
        // The package's own Python half is missing (a broken install): still say what failed.
        return PyRuntimeError::new_err(message);
    };
    let err = PyErr::from_type(class_of(c, &e).bind(py).clone(), message);
    let value = err.value(py);
    // Failing to set an attribute leaves the message, which says the same.
    match &e {
        // What to deliver to the decode side (`_errors.ChunkFailedError.status` is built from
        // these).
        kvshard::Error::ChunkFailed {
            request,
            rank,
            chunk,
            reason,
        } => {
            let _ = value.setattr("request", *request);
            let _ = value.setattr("rank", *rank);
            let _ = value.setattr("chunk", *chunk);
            let _ = value.setattr("reason", reason.as_str());
        }
        // Which ranks to abort (or answer for with a failed status), as `Receiver.expire`
        // reports them.
        kvshard::Error::TransferDeadline(overdue) => {
            let _ = value.setattr("request", overdue.request);
            let _ = value.setattr("deadline", overdue.deadline.as_secs_f64());
            let _ = value.setattr("ranks", overdue.ranks);
            let _ = value.setattr("missing", missing_chunks(overdue));
        }
        // Which file, and what failed, for an engine that reacts to a full disk otherwise than
        // to a damaged file.
        kvshard::Error::Storage { path, failure, .. } => {
            let _ = value.setattr("path", path.as_str());
            let _ = value.setattr("failure", storage_failure(*failure));
            // The process holding a writer's lock, where its lock file says (None otherwise).
            let holder = match failure {
                kvshard::error::StorageFailure::Locked { holder } => *holder,
                _ => None,
            };
            let _ = value.setattr("holder", holder);
        }
        _ => {}
    }
    err
}

/// The name `StorageError.failure` holds for each kind of storage failure.
fn storage_failure(f: kvshard::error::StorageFailure) -> &'static str {
    use kvshard::error::StorageFailure as F;
    match f {
        F::Full => "full",
        F::Open => "open",
        F::Register => "register",
        F::Io => "io",
        F::Format => "format",
        F::ReadOnly => "read_only",
        // The directory handled like a database's, journals never losing data silently.
        F::Untrusted => "untrusted",
        F::Locked { .. } => "locked",
        F::Corrupt => "corrupt",
    }
}

/// `(rank, chunks received)` of each rank whose last status of an overdue request never came.
pub fn missing_chunks(overdue: &kvshard::transfer::Overdue) -> Vec<(u32, u32)> {
    overdue
        .missing
        .iter()
        .map(|m| (m.rank, m.received))
        .collect()
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
