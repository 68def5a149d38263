//! The Rust side of `python/bench.py`: the same calls on the same objects, in native loops, so
//! one process in one run measures what the Python binding adds per call and whether bulk
//! throughput through Python matches Rust's. Not part of the public API (underscore names).

use std::time::Instant;

use pyo3::prelude::*;

use kvshard::backend::Launch;
use kvshard::copy::Layers;
use kvshard::index::LogicalPage;
use kvshard::transfer::ChunkEnd;

use crate::errors::{invalid, IntoPy};
use crate::hicache_controller::PyHiCacheController;
use crate::hicache_enums::PyRoute;
use crate::host_transfer::PyHostTransfer;
use crate::layer_signals::PyLayerSignals;
use crate::lock::lock;
use crate::method::PyMethod;
use crate::transfer::{PyRegistration, PyRemoteSpace, PySender};

/// Most iterations one call times: a timing per iteration is kept, and more would only
/// exhaust memory.
const MAX_ITERS: usize = 1 << 24;

/// Refuses a count of iterations past [`MAX_ITERS`].
fn check_iters(iters: usize) -> PyResult<()> {
    if iters > MAX_ITERS {
        return Err(invalid(format!(
            "{iters} iterations: at most {MAX_ITERS} per call"
        )));
    }
    Ok(())
}

/// Nanoseconds of each of `iters` `HiCacheController::load` calls (node `node` into
/// `pages`, `route`), each load acked (waited for) outside the timed call.
#[pyfunction]
#[pyo3(signature = (controller, node, pages, route, iters, ctas = 2))]
pub fn _rust_load_ns(
    py: Python<'_>,
    controller: &PyHiCacheController,
    node: u64,
    pages: Vec<u64>,
    route: PyRoute,
    iters: usize,
    ctas: u32,
) -> PyResult<Vec<u64>> {
    check_iters(iters)?;
    let route = controller.route(route, ctas)?;
    let pages: Vec<LogicalPage> = pages.into_iter().map(LogicalPage).collect();
    py.detach(|| {
        let mut c = lock(&controller.inner);
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            let h = c.load(node, &pages, None, route)?;
            out.push(t.elapsed().as_nanos() as u64);
            drop(h);
            c.ack_loads_sync(1)?;
        }
        Ok(out)
    })
    .py_err()
}

/// Nanoseconds of each of `iters` `HostTransfer::run_signalled` calls on `stream` (synchronized
/// outside the timed call every 64 runs).
#[pyfunction]
#[pyo3(signature = (transfer, signals, stream, iters, ctas = 2))]
pub fn _rust_run_signalled_ns(
    py: Python<'_>,
    transfer: &PyHostTransfer,
    signals: &mut PyLayerSignals,
    stream: &Bound<'_, PyAny>,
    iters: usize,
    ctas: u32,
) -> PyResult<Vec<u64>> {
    check_iters(iters)?;
    let b = transfer.device.get().resolve(Some(stream))?;
    let s = &mut signals.0;
    py.detach(|| {
        let t = lock(&transfer.inner);
        let mut out = Vec::with_capacity(iters);
        for i in 0..iters {
            let start = Instant::now();
            let waits = t.run_signalled(b.as_ref(), Launch::host_io(b.as_ref(), ctas), s)?;
            out.push(start.elapsed().as_nanos() as u64);
            drop(waits);
            if i % 64 == 63 {
                b.synchronize()?;
            }
        }
        b.synchronize()?;
        Ok(out)
    })
    .py_err()
}

/// Nanoseconds of each of `iters` `Sender::send` calls of one final chunk (`pages`, `end`
/// tokens) of `registration` into `dst`; the request is opened before and the chunk waited
/// for after each timed call.
#[pyfunction]
pub fn _rust_send_ns(
    py: Python<'_>,
    sender: &PySender,
    registration: &PyRegistration,
    dst: &PyRemoteSpace,
    pages: Vec<u64>,
    end: usize,
    iters: usize,
) -> PyResult<Vec<u64>> {
    check_iters(iters)?;
    let pages: Vec<LogicalPage> = pages.into_iter().map(LogicalPage).collect();
    let (reg, dst) = (registration.0.clone(), dst.inner.clone());
    py.detach(|| {
        let mut s = lock(&sender.inner);
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            s.open(reg.clone(), dst.clone())?;
            let t = Instant::now();
            let pending = s.send(reg.request, &pages, ChunkEnd::Final(end))?;
            out.push(t.elapsed().as_nanos() as u64);
            pending.wait_sync()?;
        }
        Ok(out)
    })
    .py_err()
}

/// Wall seconds of `iters` `HostTransfer::run` calls of every layer on `io`, enqueued back to
/// back on `stream` and waited for (after one warm-up run).
#[pyfunction]
#[pyo3(signature = (transfer, stream, io, iters, ctas = 2))]
pub fn _rust_bulk_seconds(
    py: Python<'_>,
    transfer: &PyHostTransfer,
    stream: &Bound<'_, PyAny>,
    io: PyMethod,
    iters: usize,
    ctas: u32,
) -> PyResult<f64> {
    check_iters(iters)?;
    let b = transfer.device.get().resolve(Some(stream))?;
    let io = io.host_io(b.as_ref(), ctas);
    py.detach(|| {
        let t = lock(&transfer.inner);
        t.run(b.as_ref(), io, Layers::All)?;
        b.synchronize()?;
        let start = Instant::now();
        for _ in 0..iters {
            t.run(b.as_ref(), io, Layers::All)?;
        }
        b.synchronize()?;
        Ok(start.elapsed().as_secs_f64())
    })
    .py_err()
}

/// Wall seconds of `iters` final chunks (`pages`, `end` tokens) sent back to back, each as its
/// own request (`registration` with request ids `first_request..`), then waited for.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn _rust_bulk_send_seconds(
    py: Python<'_>,
    sender: &PySender,
    registration: &PyRegistration,
    dst: &PyRemoteSpace,
    pages: Vec<u64>,
    end: usize,
    iters: usize,
    first_request: u64,
) -> PyResult<f64> {
    check_iters(iters)?;
    if first_request.checked_add(iters as u64).is_none() {
        return Err(invalid(format!(
            "requests {first_request} + {iters} overflow the 64-bit request ids"
        )));
    }
    let pages: Vec<LogicalPage> = pages.into_iter().map(LogicalPage).collect();
    let dst = dst.inner.clone();
    let reg = registration.0.clone();
    py.detach(|| {
        let mut s = lock(&sender.inner);
        let start = Instant::now();
        let mut pending = Vec::with_capacity(iters);
        for i in 0..iters as u64 {
            let mut r = reg.clone();
            r.request = first_request + i;
            s.open(r, dst.clone())?;
            pending.push(s.send(first_request + i, &pages, ChunkEnd::Final(end))?);
        }
        for p in pending {
            p.wait_sync()?;
        }
        Ok(start.elapsed().as_secs_f64())
    })
    .py_err()
}
