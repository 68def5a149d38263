//! The Mooncake side channel's frames and its decode side as Python types: conversions to and
//! from `kvshard::transfer::mooncake::{wire, MooncakeReceiver}`, where the codec and every
//! check of what a peer sends are. `kvshard/mooncake.py` moves the bytes over its sockets.
//!
//! A frame travels through Python as a dict whose `"t"` names its kind: `hi` (`rank`,
//! `shape`), `hello` (`engine`, `bases`, `pages`, `bounce`), `refused` (`why`), `register`
//! (`request`, `prefix_pages`, `pages`, `state_pages`), `free` (`slot`, `request`, `chunk`),
//! `status` (`status`, a `ChunkStatus`; `slot` and `sections` when bounced), `abort`
//! (`request`, `reason`), `aborted` (`request`, `held`: the `(slot, chunk)` still held),
//! `dense_status` (`status`, `slot`, `ranks`, `interleave`, `rank`, `end_token`, `sections`: a
//! chunk packed densely for a decode context-parallel rank, each section `(component codes,
//! sequence pages)`).

use std::collections::BTreeMap;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use kvshard::transfer::mooncake::frames::{
    self, Bounced, Frame, FrameReader, Shape, WireDense, WireSection,
};
use kvshard::transfer::mooncake::MooncakeReceiver;

use crate::dcp::PyDecodeRegistration;
use crate::device_pool::PyDevicePool;
use crate::errors::{invalid, IntoPy};
use crate::geometry::PyCacheGeometry;
use crate::mooncake_prefill::addresses_of;
use crate::receiver::{deadline_of, PyFinished, PyOverdue};
use crate::transfer::{PyChunkStatus, PyRegistration};

/// `dict[key]`, converted; a missing or mistyped field is an `InvalidArgumentError`.
fn field<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    let v = d
        .get_item(key)?
        .ok_or_else(|| invalid(format!("a side-channel frame without {key:?}")))?;
    v.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        invalid(format!("side-channel field {key:?}: {e}"))
    })
}

/// A frame from its dict.
fn frame_of(d: &Bound<'_, PyDict>) -> PyResult<Frame> {
    let kind: String = field(d, "t")?;
    Ok(match kind.as_str() {
        "hi" => Frame::Hi {
            rank: field(d, "rank")?,
            shape: field::<Vec<(u8, u32, u64)>>(d, "shape")?
                .into_iter()
                .map(|(component, layers, block_bytes)| Shape {
                    component,
                    layers,
                    block_bytes,
                })
                .collect(),
        },
        "hello" => Frame::Hello {
            engine: field(d, "engine")?,
            bases: field(d, "bases")?,
            pages: field(d, "pages")?,
            bounce: field(d, "bounce")?,
        },
        "refused" => Frame::Refused {
            why: field(d, "why")?,
        },
        "register" => Frame::Register {
            request: field(d, "request")?,
            prefix_pages: field(d, "prefix_pages")?,
            pages: field(d, "pages")?,
            state_pages: field(d, "state_pages")?,
        },
        "free" => Frame::Free {
            slot: field(d, "slot")?,
            request: field(d, "request")?,
            chunk: field(d, "chunk")?,
        },
        "status" => {
            let status: PyRef<'_, PyChunkStatus> = field(d, "status")?;
            let slot: Option<u32> = d.get_item("slot")?.map(|v| v.extract()).transpose()?;
            let bounced = match slot {
                None => None,
                Some(slot) => Some(Bounced {
                    slot,
                    sections: field::<Vec<(Vec<u8>, Vec<u64>)>>(d, "sections")?
                        .into_iter()
                        .map(|(components, pages)| WireSection { components, pages })
                        .collect(),
                }),
            };
            Frame::Status {
                status: status.0.clone(),
                bounced,
            }
        }
        "dense_status" => {
            let status: PyRef<'_, PyChunkStatus> = field(d, "status")?;
            Frame::DenseStatus {
                status: status.0.clone(),
                dense: WireDense {
                    slot: field(d, "slot")?,
                    ranks: field(d, "ranks")?,
                    interleave: field(d, "interleave")?,
                    rank: field(d, "rank")?,
                    end_token: field(d, "end_token")?,
                    sections: field(d, "sections")?,
                },
            }
        }
        "abort" => Frame::Abort {
            request: field(d, "request")?,
            reason: field(d, "reason")?,
        },
        "aborted" => Frame::Aborted {
            request: field(d, "request")?,
            held: field(d, "held")?,
        },
        other => return Err(invalid(format!("a side-channel frame of kind {other:?}"))),
    })
}

/// A frame as its dict.
fn dict_of<'py>(py: Python<'py>, frame: Frame) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match frame {
        Frame::Hi { rank, shape } => {
            d.set_item("t", "hi")?;
            d.set_item("rank", rank)?;
            let shape: Vec<(u8, u32, u64)> = shape
                .into_iter()
                .map(|s| (s.component, s.layers, s.block_bytes))
                .collect();
            d.set_item("shape", shape)?;
        }
        Frame::Hello {
            engine,
            bases,
            pages,
            bounce,
        } => {
            d.set_item("t", "hello")?;
            d.set_item("engine", engine)?;
            d.set_item("bases", bases)?;
            d.set_item("pages", pages)?;
            d.set_item("bounce", bounce)?;
        }
        Frame::Refused { why } => {
            d.set_item("t", "refused")?;
            d.set_item("why", why)?;
        }
        Frame::Register {
            request,
            prefix_pages,
            pages,
            state_pages,
        } => {
            d.set_item("t", "register")?;
            d.set_item("request", request)?;
            d.set_item("prefix_pages", prefix_pages)?;
            d.set_item("pages", pages)?;
            d.set_item("state_pages", state_pages)?;
        }
        Frame::Free {
            slot,
            request,
            chunk,
        } => {
            d.set_item("t", "free")?;
            d.set_item("slot", slot)?;
            d.set_item("request", request)?;
            d.set_item("chunk", chunk)?;
        }
        Frame::Status { status, bounced } => {
            d.set_item("t", "status")?;
            d.set_item("status", PyChunkStatus(status))?;
            if let Some(b) = bounced {
                d.set_item("slot", b.slot)?;
                let sections: Vec<(Vec<u8>, Vec<u64>)> = b
                    .sections
                    .into_iter()
                    .map(|s| (s.components, s.pages))
                    .collect();
                d.set_item("sections", sections)?;
            }
        }
        Frame::Abort { request, reason } => {
            d.set_item("t", "abort")?;
            d.set_item("request", request)?;
            d.set_item("reason", reason)?;
        }
        Frame::Aborted { request, held } => {
            d.set_item("t", "aborted")?;
            d.set_item("request", request)?;
            d.set_item("held", held)?;
        }
        Frame::DenseStatus { status, dense } => {
            d.set_item("t", "dense_status")?;
            d.set_item("status", PyChunkStatus(status))?;
            d.set_item("slot", dense.slot)?;
            d.set_item("ranks", dense.ranks)?;
            d.set_item("interleave", dense.interleave)?;
            d.set_item("rank", dense.rank)?;
            d.set_item("end_token", dense.end_token)?;
            d.set_item("sections", dense.sections)?;
        }
    }
    Ok(d)
}

/// The bytes of one side-channel frame, given as its dict (module docs); a frame missing a
/// field, or one the protocol refuses (over its size limit, contradicting itself), raises
/// `InvalidArgumentError` and nothing is sent.
#[pyfunction]
pub fn side_frame<'py>(
    py: Python<'py>,
    frame: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyBytes>> {
    let frame = frame_of(frame)?;
    let bytes = frames::encode(&frame).map_err(|e| invalid(e.to_string()))?;
    Ok(PyBytes::new(py, &bytes))
}

/// The shape of a cache as a rank's `hi` states it, `[(component code, layers, block bytes)]`.
#[pyfunction]
pub fn side_shape(geometry: &PyCacheGeometry) -> Vec<(u8, u32, u64)> {
    frames::shape_of(&geometry.0)
        .into_iter()
        .map(|s| (s.component, s.layers, s.block_bytes))
        .collect()
}

/// One side-channel connection's incoming bytes as frames: `feed` returns the frames the bytes
/// complete, every one checked. The first violation (a malformed, truncated, oversize or
/// unknown frame) ends the stream: the frames before it are returned, `error` says what was
/// wrong, and nothing more is read; close the connection. It never holds more than one
/// frame's limit of bytes.
#[pyclass(module = "kvshard", name = "SideReader")]
#[derive(Default)]
pub struct PySideReader(FrameReader);

#[pymethods]
impl PySideReader {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// The frames the next `data` completes, as dicts, in order.
    fn feed<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let (frames, _) = self.0.feed(data);
        frames.into_iter().map(|f| dict_of(py, f)).collect()
    }

    /// The violation that ended the stream, or None.
    #[getter]
    fn error(&self) -> Option<String> {
        self.0.broken().map(|e| e.to_string())
    }

    /// Bytes held of an incomplete frame.
    #[getter]
    fn buffered(&self) -> usize {
        self.0.buffered()
    }
}

/// The decode side of P/D on a transfer engine with a side channel: the decode `pool`, for
/// `ranks` prefill ranks, `bounce_slots` bounce buffers of `bounce_pages` pages per rank (none
/// when either is 0; the scatters run on `stream`), requests due `deadline` seconds after
/// registration (default `DEFAULT_DEADLINE`). Feed it each rank's bytes (`feed`), send each
/// rank what `take_outgoing` returns, and call `poll` and `expire` every scheduling step.
/// Every status is checked before use; a violation ends the rank (docs/mooncake.md).
#[pyclass(module = "kvshard", name = "MooncakeReceiver")]
pub struct PyMooncakeReceiver {
    inner: MooncakeReceiver,
    #[allow(dead_code)]
    pool: Py<PyDevicePool>,
}

#[pymethods]
impl PyMooncakeReceiver {
    #[new]
    #[pyo3(signature = (pool, ranks, *, bounce_pages = 64, bounce_slots = 2, deadline = None, stream = None))]
    fn new(
        pool: Py<PyDevicePool>,
        ranks: u32,
        bounce_pages: u64,
        bounce_slots: usize,
        deadline: Option<f64>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let p = pool.get();
        let device = p.device.get();
        let backend = device.resolve(stream)?;
        let deadline = match deadline {
            Some(s) => deadline_of(s, "MooncakeReceiver")?,
            None => kvshard::transfer::DEFAULT_DEADLINE,
        };
        let inner = MooncakeReceiver::new(
            p.inner.clone(),
            backend,
            addresses_of(device),
            ranks,
            bounce_pages,
            bounce_slots,
            deadline,
        )
        .py_err()?;
        Ok(Self { inner, pool })
    }

    /// Prefill ranks.
    #[getter]
    fn ranks(&self) -> u32 {
        self.inner.ranks()
    }

    /// Seconds from registration to the deadline of requests registered without one.
    #[getter]
    fn deadline(&self) -> f64 {
        self.inner.deadline().as_secs_f64()
    }

    /// The engine's `(address, bytes)` of `rank`'s bounce buffers, one per slot: register
    /// them once.
    fn bounce_regions(&self, rank: u32) -> PyResult<Vec<(u64, u64)>> {
        self.inner.bounce_regions(rank).py_err()
    }

    /// Answers a connection's first frame (a dict from `SideReader`): `(rank, hello bytes)`
    /// when it is the `hi` of a rank in range that has not joined, with the pool's shape
    /// (`engine` is this side's engine address); else `(None, refused bytes)`: send them, then
    /// close.
    fn join<'py>(
        &mut self,
        py: Python<'py>,
        hi: &Bound<'py, PyDict>,
        engine: &str,
    ) -> PyResult<(Option<u32>, Bound<'py, PyBytes>)> {
        let (rank, reply) = match frame_of(hi) {
            Ok(hi) => match self.inner.join(&hi, engine) {
                Ok((rank, hello)) => (Some(rank), hello),
                Err(refused) => (None, refused),
            },
            Err(e) => (None, Frame::Refused { why: e.to_string() }),
        };
        let bytes = frames::encode(&reply).map_err(|e| invalid(e.to_string()))?;
        Ok((rank, PyBytes::new(py, &bytes)))
    }

    /// Expects `registration` from every rank, due `deadline` seconds from now (default the
    /// receiver's); returns the `register` frame to send every rank (a rank that is gone fails
    /// it). Refused while a rank has not joined.
    #[pyo3(signature = (registration, *, deadline = None))]
    fn register<'py>(
        &mut self,
        py: Python<'py>,
        registration: &PyRegistration,
        deadline: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let deadline = deadline
            .map(|s| deadline_of(s, "MooncakeReceiver.register"))
            .transpose()?;
        let bytes = self
            .inner
            .register(registration.0.clone(), deadline)
            .py_err()?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Expects decode rank `rank`'s share of `registration` (a decode context-parallel
    /// request, `kvshard.transfer.DecodeRegistration`) from every prefill rank, due `deadline` seconds
    /// from now (default the receiver's): its chunks arrive densely packed, each checked and
    /// unpacked into the share's pages. Nothing is sent: the prefill ranks open it with
    /// `MooncakeSender.open_decode`. Refused while a rank has not joined.
    #[pyo3(signature = (registration, rank, *, deadline = None))]
    fn register_decode(
        &mut self,
        registration: &PyDecodeRegistration,
        rank: u32,
        deadline: Option<f64>,
    ) -> PyResult<()> {
        let deadline = deadline
            .map(|s| deadline_of(s, "MooncakeReceiver.register_decode"))
            .transpose()?;
        self.inner
            .register_decode(&registration.0, rank, deadline)
            .py_err()
    }

    /// Takes the next bytes from `rank`'s connection; returns None, or the violation that
    /// ended the rank (then close its connection).
    fn feed(&mut self, py: Python<'_>, rank: u32, data: &[u8]) -> Option<String> {
        let inner = &mut self.inner;
        py.detach(|| inner.feed(rank, data)).map(|e| e.to_string())
    }

    /// `rank`'s connection ended: its requests fail once what it reported before is taken.
    fn rank_gone(&mut self, rank: u32, why: &str) {
        self.inner.rank_gone(rank, why);
    }

    /// Why `rank` is gone, or None.
    fn gone(&self, rank: u32) -> Option<String> {
        self.inner.gone(rank).map(str::to_string)
    }

    /// The bytes to send `rank` now (slot frees, aborts), taken.
    fn take_outgoing<'py>(&mut self, py: Python<'py>, rank: u32) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.take_outgoing(rank))
    }

    /// Takes every status whose scatter has run and returns the `Finished` requests (pages
    /// handed back, completed or failed). Never blocks.
    fn poll(&mut self, py: Python<'_>) -> PyResult<Vec<PyFinished>> {
        let inner = &mut self.inner;
        let finished = py.detach(|| inner.poll()).py_err()?;
        Ok(finished.into_iter().map(PyFinished).collect())
    }

    /// The `Overdue` requests (each once); the ranks that owe them are asked to abort (in
    /// `take_outgoing`). Never blocks.
    fn expire(&mut self) -> Vec<PyOverdue> {
        self.inner.expire().into_iter().map(PyOverdue).collect()
    }

    /// Requests registered and not yet handed back.
    #[getter]
    fn pending_requests(&self) -> usize {
        self.inner.pending_requests()
    }

    /// `rank`'s bounce slots held by a chunk not yet scattered and freed.
    fn busy_slots(&self, rank: u32) -> usize {
        self.inner.busy_slots(rank)
    }

    /// What the side channel counted: `refused_frames` (violations), `dropped_statuses`
    /// (unknown requests, duplicates), `freed_for_dropped` (slots freed for those).
    fn counters(&self) -> BTreeMap<&'static str, u64> {
        let c = self.inner.counters();
        BTreeMap::from([
            ("refused_frames", c.refused_frames),
            ("dropped_statuses", c.dropped_statuses),
            ("freed_for_dropped", c.freed_for_dropped),
        ])
    }
}
