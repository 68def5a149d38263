//! The decode side's receiver of P/D chunk statuses: what it takes, the requests it finishes
//! (`Finished`) and those whose deadline passed (`Overdue`), so an engine written in Python
//! never waits on a status that cannot come.

use std::collections::BTreeMap;
use std::time::Duration;

use pyo3::prelude::*;

use kvshard::transfer::{Finished, Outcome, Overdue, Receiver};

use crate::dcp::PyDecodeRegistration;
use crate::errors::{invalid, missing_chunks, to_py, IntoPy};
use crate::geometry::PyComponent;
use crate::transfer::{bytes_dict, PyChunkStatus, PyRegistration};

/// A request the decode side is done with: every prefill rank reported its last status.
#[pyclass(frozen, module = "kvshard", name = "Finished")]
pub struct PyFinished(pub Finished);

#[pymethods]
impl PyFinished {
    /// Request id.
    #[getter]
    fn request(&self) -> u64 {
        self.0.request()
    }

    /// Whether every rank sent every chunk.
    #[getter]
    fn completed(&self) -> bool {
        self.0.is_completed()
    }

    /// The registration, handed back (its pages are the decode side's again).
    #[getter]
    fn registration(&self) -> PyRegistration {
        PyRegistration(self.0.registration.clone())
    }

    /// Bytes of all ranks together, per component.
    #[getter]
    fn total_bytes(&self) -> BTreeMap<PyComponent, u64> {
        bytes_dict(&self.0.total_bytes())
    }

    /// Per failed rank: `(rank, chunk, reason)`.
    #[getter]
    fn failures(&self) -> Vec<(u32, u32, String)> {
        match &self.0.outcome {
            Outcome::Completed => Vec::new(),
            Outcome::Failed(f) => f
                .iter()
                .map(|f| (f.rank, f.chunk, f.reason.clone()))
                .collect(),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<kvshard.Finished request {} {}>",
            self.0.request(),
            if self.0.is_completed() {
                "completed"
            } else {
                "failed"
            }
        )
    }
}

/// The decode side's seconds as a deadline (`what` names it in errors).
pub(crate) fn deadline_of(seconds: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds).map_err(|e| {
        invalid(format!(
            "{what}: {seconds} s is not a deadline ({e}); give non-negative, finite seconds"
        ))
    })
}

/// A request whose deadline passed before every prefill rank reported its last status, as
/// `Receiver.expire` returns it. It is failed, but its pages stay held until every rank has
/// reported: abort the ranks in `missing` (or, for a rank whose process is gone, `receive` a
/// `ChunkStatus.failed` at the chunk it owes, `received`).
#[pyclass(frozen, module = "kvshard", name = "Overdue")]
pub struct PyOverdue(pub Overdue);

#[pymethods]
impl PyOverdue {
    /// Request id.
    #[getter]
    fn request(&self) -> u64 {
        self.0.request
    }

    /// The request's deadline in seconds, counted from its registration.
    #[getter]
    fn deadline(&self) -> f64 {
        self.0.deadline.as_secs_f64()
    }

    /// Prefill ranks sending it.
    #[getter]
    fn ranks(&self) -> u32 {
        self.0.ranks
    }

    /// `(rank, received)` of each rank whose last status never came, in rank order: chunks
    /// `0..received` arrived, chunk `received` (and every later one) did not.
    #[getter]
    fn missing(&self) -> Vec<(u32, u32)> {
        missing_chunks(&self.0)
    }

    /// The `TransferDeadlineError` it stands for (kvshard's `Error::TransferDeadline`), for an
    /// engine that raises it: `raise overdue.error()`.
    fn error(&self, py: Python<'_>) -> Py<PyAny> {
        to_py(py, self.0.clone().into()).into_value(py).into_any()
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }

    fn __repr__(&self) -> String {
        format!("<kvshard.Overdue {}>", self.0)
    }
}

/// The decode side: completes a request only once every prefill rank has reported its final
/// chunk (or failed), so it never reads a page a rank may still write. Every request has a
/// deadline, in seconds from its registration (`deadline`, default `DEFAULT_DEADLINE`):
/// `expire()`, called every scheduling step, reports each request whose deadline passed first
/// (a final chunk never sent, a status never delivered, a rank gone silent), so nothing waits
/// forever.
#[pyclass(module = "kvshard", name = "Receiver")]
pub struct PyReceiver(Receiver);

#[pymethods]
impl PyReceiver {
    /// A receiver whose requests are due `deadline` seconds after registration (default
    /// `DEFAULT_DEADLINE`).
    #[new]
    #[pyo3(signature = (deadline = None))]
    fn new(deadline: Option<f64>) -> PyResult<Self> {
        Ok(Self(match deadline {
            Some(s) => Receiver::with_deadline(deadline_of(s, "Receiver")?),
            None => Receiver::new(),
        }))
    }

    /// Seconds from registration to the deadline of requests registered without one of their
    /// own; setting it applies to requests registered from then on.
    #[getter]
    fn deadline(&self) -> f64 {
        self.0.deadline().as_secs_f64()
    }

    #[setter]
    fn set_deadline(&mut self, seconds: f64) -> PyResult<()> {
        self.0
            .set_deadline(deadline_of(seconds, "Receiver.deadline")?);
        Ok(())
    }

    /// Expects `registration` from `prefill_ranks` ranks, due `deadline` seconds from now
    /// (default: the receiver's).
    #[pyo3(signature = (registration, prefill_ranks, *, deadline = None))]
    fn register(
        &mut self,
        registration: &PyRegistration,
        prefill_ranks: u32,
        deadline: Option<f64>,
    ) -> PyResult<()> {
        let deadline = match deadline {
            Some(s) => deadline_of(s, "Receiver.register")?,
            None => self.0.deadline(),
        };
        self.0
            .register_with_deadline(registration.0.clone(), prefill_ranks, deadline)
            .py_err()
    }

    /// Expects decode rank `rank`'s share of `registration` (a `DecodeRegistration`: a
    /// `Registration` of the rank's own pages, which `Finished.registration` hands back) from
    /// `prefill_ranks` ranks, due `deadline` seconds from now (default: the receiver's).
    #[pyo3(signature = (registration, rank, prefill_ranks, *, deadline = None))]
    fn register_decode(
        &mut self,
        registration: &PyDecodeRegistration,
        rank: u32,
        prefill_ranks: u32,
        deadline: Option<f64>,
    ) -> PyResult<()> {
        let deadline = match deadline {
            Some(s) => deadline_of(s, "Receiver.register_decode")?,
            None => self.0.deadline(),
        };
        let share = registration.0.rank(rank).py_err()?;
        self.0
            .register_with_deadline(share, prefill_ranks, deadline)
            .py_err()
    }

    /// Takes one rank's status; returns the request once it is finished.
    fn receive(&mut self, status: &PyChunkStatus) -> PyResult<Option<PyFinished>> {
        Ok(self.0.receive(status.0.clone()).py_err()?.map(PyFinished))
    }

    /// Fails every request whose deadline has passed before every rank reported its last
    /// status, and returns each once, in request order. Never blocks.
    fn expire(&mut self) -> Vec<PyOverdue> {
        self.0.expire().into_iter().map(PyOverdue).collect()
    }

    /// `(ranks, ranks_done, failed, overdue)` of a request being received, or None: `failed`
    /// once a rank failed it or its deadline passed, `overdue` once `expire` reported it.
    fn progress(&self, request: u64) -> Option<(u32, u32, bool, bool)> {
        self.0
            .progress(request)
            .map(|p| (p.ranks, p.ranks_done, p.failed, p.overdue))
    }

    /// Requests being received.
    #[getter]
    fn pending_requests(&self) -> usize {
        self.0.pending_requests()
    }
}
