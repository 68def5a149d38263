//! The storage tier below a host pool (feature `nixl`): kvshard's `DiskStore`, one rank's view
//! of its group's storage directory, moved by NIXL's POSIX backend. Pages are addressed by
//! 64-byte keys (`storage_keys`) and host page numbers; every call that does I/O releases the
//! GIL and is named `_sync` (or takes a snapshot, which reads the other ranks' journals).

use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvshard::index::LocalPage;
use kvshard::key::PageKey;
use kvshard::pool::disk::{
    Damaged, DiskConfig, DiskStats, DiskStore, LoadOutcome, Snapshot, StoreReport,
};

use crate::errors::{invalid, IntoPy};
use crate::host_pool::PyHostPool;
use crate::lock::lock;

/// What happened to one page of a `DiskStore.load_sync`.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "LoadOutcome"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyLoadOutcome {
    /// Its bytes are in the host page.
    LOADED,
    /// The store does not hold it; the host page is untouched.
    MISSING,
    /// Its slot failed its checksum (flipped bytes, or reused since the lookup): a miss,
    /// counted in `DiskStats.corrupt_pages`; the host page is untouched.
    CORRUPT,
}

mirror_enum!(PyLoadOutcome <=> LoadOutcome {
    LOADED = Loaded,
    MISSING = Missing,
    CORRUPT = Corrupt,
});

/// A group's agreed view of the storage: per writer rank, the journal records it covers. One
/// rank takes it (`DiskStore.snapshot()`), sends `records` to the others, which rebuild it with
/// `Snapshot(records)`: every rank's `exists`/`lookup` then answers the same.
#[pyclass(frozen, from_py_object, module = "kvshard", name = "Snapshot")]
#[derive(Clone)]
pub struct PySnapshot(Snapshot);

#[pymethods]
impl PySnapshot {
    #[new]
    fn new(records: Vec<u64>) -> Self {
        Self(Snapshot::from_records(records))
    }

    /// Per writer rank, the journal records covered.
    #[getter]
    fn records(&self) -> Vec<u64> {
        self.0.records().to_vec()
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.0 == other.0
    }

    fn __repr__(&self) -> String {
        format!("Snapshot({:?})", self.0.records())
    }
}

/// What one `DiskStore.store_sync` did.
#[pyclass(frozen, module = "kvshard", name = "StoreReport")]
pub struct PyStoreReport(StoreReport);

#[pymethods]
impl PyStoreReport {
    /// Pages written and committed.
    #[getter]
    fn written(&self) -> usize {
        self.0.written
    }
    /// Pages already present (written by any rank), not written again.
    #[getter]
    fn present(&self) -> usize {
        self.0.present
    }
    /// Slots reclaimed from older pages to make room.
    #[getter]
    fn evicted(&self) -> usize {
        self.0.evicted
    }
    /// New pages not written: the batch had more new pages than the file has slots.
    #[getter]
    fn dropped(&self) -> usize {
        self.0.dropped
    }
    fn __repr__(&self) -> String {
        let r = self.0;
        format!(
            "StoreReport(written={}, present={}, evicted={}, dropped={})",
            r.written, r.present, r.evicted, r.dropped
        )
    }
}

/// Counters of a `DiskStore` since it opened.
#[pyclass(frozen, module = "kvshard", name = "DiskStats")]
pub struct PyDiskStats(DiskStats);

#[pymethods]
impl PyDiskStats {
    /// Pages written.
    #[getter]
    fn stored_pages(&self) -> u64 {
        self.0.stored_pages
    }
    /// Pages loaded.
    #[getter]
    fn loaded_pages(&self) -> u64 {
        self.0.loaded_pages
    }
    /// Loads that found a slot failing its checksum (each a miss).
    #[getter]
    fn corrupt_pages(&self) -> u64 {
        self.0.corrupt_pages
    }
    /// Slots reclaimed.
    #[getter]
    fn evicted_pages(&self) -> u64 {
        self.0.evicted_pages
    }
    /// Descriptors (one I/O each) posted to write.
    #[getter]
    fn write_ios(&self) -> u64 {
        self.0.write_ios
    }
    /// Descriptors posted to read.
    #[getter]
    fn read_ios(&self) -> u64 {
        self.0.read_ios
    }
    /// Journal records skipped as damaged (a failed checksum, or a slot past the file, with
    /// valid records after it): each may be a page lost (a miss, never a wrong hit).
    #[getter]
    fn damaged_records(&self) -> u64 {
        self.0.damaged_records
    }
    /// Records cut from this rank's journal tail at open (a batch a killed writer was
    /// appending: never committed).
    #[getter]
    fn torn_records(&self) -> u64 {
        self.0.torn_records
    }
    /// The counters by name, in the order above.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.0;
        let d = PyDict::new(py);
        for (name, value) in [
            ("stored_pages", s.stored_pages),
            ("loaded_pages", s.loaded_pages),
            ("corrupt_pages", s.corrupt_pages),
            ("evicted_pages", s.evicted_pages),
            ("write_ios", s.write_ios),
            ("read_ios", s.read_ios),
            ("damaged_records", s.damaged_records),
            ("torn_records", s.torn_records),
        ] {
            d.set_item(name, value)?;
        }
        Ok(d)
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// `(key, host page)` pairs: 64-byte keys and page numbers of the store's host pool.
fn parse_items(items: Vec<(Vec<u8>, u64)>) -> PyResult<Vec<(PageKey, LocalPage)>> {
    items
        .into_iter()
        .map(|(k, p)| Ok((PageKey::from_bytes(&k).py_err()?, LocalPage(p))))
        .collect()
}

fn parse_keys(keys: Vec<Vec<u8>>) -> PyResult<Vec<PageKey>> {
    keys.iter()
        .map(|k| PageKey::from_bytes(k).py_err())
        .collect()
}

/// One rank's storage tier below its host pool: rank `writer` of `writers` ranks sharing
/// directory `dir` (one preallocated slot file and one journal per rank, `slots` slots each;
/// every rank opens it with the same `writers` and `slots`). Each rank writes only the pages it
/// owns into its own file; any rank reads any rank's. A page is present only once all of it
/// (every component of the host pool) is durable with its commit record; a torn or corrupted
/// slot is a miss. Needs the NIXL runtime (`scripts/install-nixl.sh` on LD_LIBRARY_PATH).
///
/// `DiskStore(host, dir, slots, writer=0, writers=1, staging_slots=32, max_io_bytes=8 MiB,
/// timeout=30.0, read_only=False, damaged="skip")`. Keys are 64 bytes (`Namespace.key`); pages
/// are host page numbers (page 0 is the padding page). Store and load read and write host
/// memory with the CPU, ordered like any kvshard work on the host pool: a store first waits for
/// the writes queued on its pages (a backup still queued on another stream), a load for the
/// reads and writes queued on its pages (a load to the device still reading them), each within
/// `timeout`. `dir` is handled like a database's: made mode 0700 when missing, every file
/// opened beneath it without following links, refused (`StorageError`, `failure="untrusted"`)
/// when a link or anything group/other-writable or another user's is there; one writer per
/// directory and rank (`failure="locked"`, `holder` the process holding it; `read_only=True`
/// opens take no lock and write nothing). `damaged`: what a damaged journal record (one with
/// valid records after it) does: `"skip"` (counted in `DiskStats.damaged_records`) or
/// `"refuse"` (`failure="corrupt"`). `timeout` is seconds, more than 0 and at most a day.
/// Calls on one store are serialized; each releases the GIL while it works.
#[pyclass(frozen, module = "kvshard", name = "DiskStore")]
pub struct PyDiskStore {
    inner: Mutex<DiskStore>,
    host: Py<PyHostPool>,
    queue: String,
}

#[pymethods]
impl PyDiskStore {
    #[new]
    #[pyo3(signature = (host, dir, slots, *, writer = 0, writers = 1, staging_slots = 32, max_io_bytes = 8388608, timeout = 30.0, read_only = false, damaged = "skip"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host: Py<PyHostPool>,
        dir: std::path::PathBuf,
        slots: u64,
        writer: u32,
        writers: u32,
        staging_slots: usize,
        max_io_bytes: u64,
        timeout: f64,
        read_only: bool,
        damaged: &str,
    ) -> PyResult<Self> {
        // NaN, negative, infinite or past Duration's range: refused here (Duration's own
        // conversion would panic); zero or past a day by DiskConfig::validate.
        let timeout = Duration::try_from_secs_f64(timeout)
            .map_err(|_| invalid(format!("timeout {timeout} s: expected a positive duration")))?;
        let damaged = match damaged {
            "skip" => Damaged::Skip,
            "refuse" => Damaged::Refuse,
            other => {
                return Err(invalid(format!(
                    "damaged={other:?}: expected \"skip\" or \"refuse\""
                )))
            }
        };
        let mut config = DiskConfig::new(dir, writer, writers, slots);
        config.staging_slots = staging_slots;
        config.max_io_bytes = max_io_bytes;
        config.timeout = timeout;
        config.read_only = read_only;
        config.damaged = damaged;
        let h = host.get();
        let pool = h.inner.clone();
        let backend = h.device.get().default_backend()?;
        let store = py
            .detach(|| {
                kvshard::transfer::nixl::load()?;
                DiskStore::open(pool, backend, config)
            })
            .py_err()?;
        let queue = store.io_queue().to_string();
        Ok(Self {
            inner: Mutex::new(store),
            host,
            queue,
        })
    }

    /// The host pool it reads and writes.
    #[getter]
    fn host(&self, py: Python<'_>) -> Py<PyHostPool> {
        self.host.clone_ref(py)
    }

    /// The kernel queue NIXL's POSIX backend runs on: `"io_uring"`, or `"libaio (why)"`.
    #[getter]
    fn io_queue(&self) -> &str {
        &self.queue
    }

    /// Bytes of one slot (a page of every component, padded to the direct-I/O alignment).
    #[getter]
    fn slot_bytes(&self) -> u64 {
        lock(&self.inner).slot_bytes()
    }

    /// Bytes of one page's data.
    #[getter]
    fn page_bytes(&self) -> u64 {
        lock(&self.inner).page_bytes()
    }

    /// Slots of this rank holding a page.
    #[getter]
    fn used_slots(&self) -> u64 {
        lock(&self.inner).used_slots()
    }

    /// Counters since open (`corrupt_pages`: loads that found a slot failing its checksum).
    fn stats(&self) -> PyDiskStats {
        PyDiskStats(lock(&self.inner).stats())
    }

    /// Reads what every other rank has committed since the last snapshot and returns the
    /// group's view to share: one rank takes it, every rank passes it to `exists`/`lookup`.
    fn snapshot(&self, py: Python<'_>) -> PyResult<PySnapshot> {
        let s = py.detach(|| lock(&self.inner).snapshot()).py_err()?;
        Ok(PySnapshot(s))
    }

    /// Per key (64 bytes), whether its page is present as of `snapshot` (the same answer on
    /// every rank given the same snapshot).
    fn exists(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        snapshot: PySnapshot,
    ) -> PyResult<Vec<bool>> {
        let keys = parse_keys(keys)?;
        py.detach(|| lock(&self.inner).exists(&keys, &snapshot.0))
            .py_err()
    }

    /// How many leading keys of `keys` (a prefix chain) are present as of `snapshot`.
    fn lookup(&self, py: Python<'_>, keys: Vec<Vec<u8>>, snapshot: PySnapshot) -> PyResult<usize> {
        let keys = parse_keys(keys)?;
        py.detach(|| lock(&self.inner).lookup(&keys, &snapshot.0))
            .py_err()
    }

    /// Writes the pages `items` (`(key, host page)` pairs) that no rank has stored yet: this
    /// rank's owned pages, each written once. Returns what was written, already present,
    /// reclaimed and dropped (a batch with more new pages than the file has slots). A page is
    /// present only once its commit record is durable, after its data.
    fn store_sync(&self, py: Python<'_>, items: Vec<(Vec<u8>, u64)>) -> PyResult<PyStoreReport> {
        let items = parse_items(items)?;
        let r = py
            .detach(|| lock(&self.inner).store_sync(&items))
            .py_err()?;
        Ok(PyStoreReport(r))
    }

    /// Loads the pages `items` (`(key, host page)` pairs) into the host pool from whichever rank
    /// wrote them: per page `LOADED`, `MISSING` or `CORRUPT` (a checksum mismatch: a miss,
    /// counted). Only loaded pages' host bytes change. Lookups see what the last `snapshot`,
    /// `exists` or `lookup` replayed of the other ranks' journals.
    fn load_sync(
        &self,
        py: Python<'_>,
        items: Vec<(Vec<u8>, u64)>,
    ) -> PyResult<Vec<PyLoadOutcome>> {
        let items = parse_items(items)?;
        let out = py.detach(|| lock(&self.inner).load_sync(&items)).py_err()?;
        Ok(out.into_iter().map(Into::into).collect())
    }

    fn __repr__(&self) -> String {
        let s = lock(&self.inner);
        format!(
            "DiskStore({} B slots, {} used, {})",
            s.slot_bytes(),
            s.used_slots(),
            self.queue
        )
    }
}
