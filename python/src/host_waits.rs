//! The calling thread's host-blocking waits: the check behind the rule that only calls named
//! `_sync` (and `synchronize`) block, readable from Python.

use pyo3::prelude::*;

/// How often the calling thread has blocked on a stream or an event so far (every wait of a
/// `_sync` call or `synchronize`, on the CPU twin and on a GPU). Subtract two readings to count
/// the waits of the calls between them: calls not named `_sync` add none.
#[pyfunction]
pub fn host_waits() -> u64 {
    kvshard::backend::sync_counts().host_blocking
}
