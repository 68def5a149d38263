//! The process's pending frees: kvshard frees nothing on the caller's thread that could wait
//! for the device (memory whose work is still queued waits for it; frees that may wait for the
//! whole device run on kvshard's reaper thread), so a dropped object's memory comes back a
//! little later. These say how much is pending and wait for it, for a caller that needs the
//! memory back (to allocate as much again, or to free or register again memory kvshard
//! registered).

use std::time::Duration;

use pyo3::prelude::*;

use crate::errors::{invalid, IntoPy};

/// Frees not done yet in this process: memory waiting for its queued work, and frees on
/// kvshard's reaper thread.
#[pyfunction]
pub fn pending_frees() -> usize {
    kvshard::backend::pending_frees()
}

/// Waits (the GIL released) until the memory dropped so far while GPU work used it is freed,
/// and kvshard's memory pools have handed what they no longer use back to the device: for a
/// caller that needs that memory back. `KvshardError` once `timeout` seconds (a finite,
/// non-negative number) have passed.
#[pyfunction]
#[pyo3(signature = (timeout = 60.0))]
pub fn wait_for_frees_sync(py: Python<'_>, timeout: f64) -> PyResult<()> {
    let timeout = Duration::try_from_secs_f64(timeout).map_err(|_| {
        invalid(format!(
            "timeout of {timeout} seconds: a finite, non-negative number of seconds below 2^64"
        ))
    })?;
    py.detach(|| kvshard::backend::wait_for_frees_sync(timeout))
        .py_err()
}
