//! The prefill side of P/D on a transfer engine (Mooncake's `TransferEngine`, driven by
//! `kvshard/mooncake.py`, or an engine's own Mooncake path) as Python types: conversions to and
//! from `kvshard::transfer::mooncake`, where the transport is (docs/mooncake.md). kvshard plans
//! each chunk and hands out its coalesced (source, destination, length) lists or, bounced, the
//! one range its owned blocks were packed into; the engine moves them and reports back.
//!
//! Addresses are the ones an engine registers and moves: device addresses on a GPU, process
//! (host) addresses on the CPU backend, whose arena addresses no engine knows.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use kvshard::backend::Backend;
use kvshard::geometry::Component;
use kvshard::index::LocalPage;
use kvshard::transfer::mooncake::{
    self as mc, DecodeTarget, EngineAddresses, MooncakeChunk, MooncakeConfig, MooncakeMode,
    MooncakeSender,
};
use kvshard::transfer::{BounceBuffer, ChunkEnd, PackedSection};

use crate::chunk_staging::PyChunkStaging;
use crate::dcp::PyDecodeRegistration;
use crate::device::{PyDevice, PyEvent};
use crate::device_pool::PyDevicePool;
use crate::errors::{invalid, IntoPy};
use crate::geometry::PyCacheGeometry;
use crate::host_pool::PyHostPool;
use crate::lock::lock;
use crate::shard::logical;
use crate::transfer::{PyChunkStatus, PyRegistration};

/// How a `MooncakeSender` hands out each chunk.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "MooncakeMode"
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms)]
pub enum PyMooncakeMode {
    /// Bounce a chunk when a bounce slot is free, it fits the slot, and its coalesced
    /// descriptors average fewer than `bounce_below` bytes; coalesced otherwise.
    AUTO,
    /// Coalesced runs: one descriptor per run of pages contiguous on both sides, per layer.
    COALESCED,
    /// One descriptor per chunk whenever a bounce slot is free and the chunk fits it.
    BOUNCE,
}

mirror_enum!(PyMooncakeMode <=> MooncakeMode {
    AUTO = Auto,
    COALESCED = Coalesced,
    BOUNCE = Bounce,
});

/// How `device` translates its addresses for an engine.
pub fn addresses_of(device: &PyDevice) -> EngineAddresses {
    match device.cpu() {
        Some(b) => EngineAddresses::Cpu(b.clone()),
        None => EngineAddresses::Device,
    }
}

/// The memory of `pool` as a transfer engine registers and addresses it: the contiguous
/// regions to register once, `[(address, bytes)]` (adjacent layers merged), and the base of
/// every stored layer of every component (`bases[c][l]`, in `geometry.components()` order),
/// what the decode side publishes to its prefill ranks (`MooncakeSender(decode_bases=...)`).
#[pyfunction]
pub fn engine_memory(pool: &PyDevicePool) -> PyResult<mc::PoolMemory> {
    mc::pool_memory(&pool.inner, &addresses_of(pool.device.get())).py_err()
}

/// The contiguous regions of any kvshard memory a transfer engine registers, `[(address,
/// bytes)]` as the engine addresses them (adjacent ranges merged), for `memory` a
/// `DevicePool` (its stored layers: `engine_memory`'s regions; a pool wrapping an engine's
/// exportable VMM tensors is one too), a `HostPool` (each of its buffers, by host address:
/// HiCache's pinned host pools), a `ChunkStaging` or a `BounceBuffer`. Register each once
/// (`kvshard.mooncake.Engine.register` refuses a second registration) and reuse it.
#[pyfunction]
pub fn engine_regions(memory: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u64)>> {
    if let Ok(pool) = memory.cast::<PyDevicePool>() {
        return Ok(engine_memory(pool.get())?.0);
    }
    if let Ok(b) = memory.cast::<PyBounceBuffer>() {
        let b = b.borrow();
        return Ok(vec![(b.address, b.bytes())]);
    }
    if let Ok(s) = memory.cast::<PyChunkStaging>() {
        let s = s.get();
        let buf = s.inner.buffer();
        let len = buf.len() as u64;
        let at = addresses_of(s.device.get())
            .address(buf.addr(), len)
            .py_err()?;
        return Ok(vec![(at, len)]);
    }
    if let Ok(h) = memory.cast::<PyHostPool>() {
        let h = h.get();
        let mut ranges = Vec::new();
        for i in 0..h.inner.buffer_layouts().len() {
            let bytes = h.inner.buffer_memory(i).py_err()?.len() as u64;
            // Host memory is registered by its host address (a pinned pool's device alias is
            // what kernels use, not what an engine's host-side transports read).
            let at = h
                .host_ptr(i)?
                .ok_or_else(|| invalid(format!("host buffer {i}: its host address is unknown")))?;
            ranges.push((at as u64, bytes));
        }
        return Ok(mc::merged(ranges));
    }
    Err(invalid(format!(
        "engine_regions takes a DevicePool, HostPool, ChunkStaging or BounceBuffer, not {}",
        memory.get_type().name()?
    )))
}

/// Packed sections as Python sees them, `[(component codes, destination pages)]`.
type WireSections = Vec<(Vec<u32>, Vec<u64>)>;

/// Packed sections from their Python form.
fn sections_of(wire: WireSections) -> PyResult<Vec<PackedSection>> {
    wire.into_iter()
        .map(|(codes, pages)| {
            let components = codes
                .into_iter()
                .map(|code| {
                    u8::try_from(code)
                        .ok()
                        .and_then(mc::frames::component_of)
                        .ok_or_else(|| {
                            invalid(format!("component code {code} in a packed section"))
                        })
                })
                .collect::<PyResult<_>>()?;
            Ok(PackedSection {
                components,
                pages: pages.into_iter().map(LocalPage).collect(),
            })
        })
        .collect()
}

/// Packed sections in their Python form.
fn sections_wire(sections: &[PackedSection]) -> WireSections {
    let code = |c: Component| u32::from(mc::frames::component_code(c));
    sections
        .iter()
        .map(|s| {
            (
                s.components.iter().map(|&c| code(c)).collect(),
                s.pages.iter().map(|p| p.0).collect(),
            )
        })
        .collect()
}

/// A bounce buffer: one per (prefill rank, slot) on the decode side, registered with the
/// engine once (`address`/`bytes`); `scatter` empties a chunk the rank packed into it into the
/// pool's pages. (`kvshard.mooncake.MooncakeDecode` keeps its own, in its `MooncakeReceiver`.)
#[pyclass(module = "kvshard", name = "BounceBuffer")]
pub struct PyBounceBuffer {
    inner: Mutex<BounceBuffer>,
    address: u64,
}

#[pymethods]
impl PyBounceBuffer {
    /// A buffer for chunks whose sections own at most `pages` pages each, in `device`'s
    /// memory; its copies run on `stream` (default: the device's).
    #[new]
    #[pyo3(signature = (device, geometry, pages, stream = None))]
    fn new(
        device: &PyDevice,
        geometry: &PyCacheGeometry,
        pages: u64,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let backend = device.resolve(stream)?;
        let inner = BounceBuffer::new(backend, &geometry.0, pages).py_err()?;
        let b = inner.buffer();
        let address = addresses_of(device)
            .address(b.addr(), b.len() as u64)
            .py_err()?;
        Ok(Self {
            inner: Mutex::new(inner),
            address,
        })
    }

    /// The buffer's address as the engine addresses it.
    #[getter]
    fn address(&self) -> u64 {
        self.address
    }

    /// Its bytes.
    #[getter]
    fn bytes(&self) -> u64 {
        lock(&self.inner).buffer().len() as u64
    }

    /// Pages per section it holds.
    #[getter]
    fn pages(&self) -> u64 {
        lock(&self.inner).pages()
    }

    /// Enqueues the scatter of a chunk the rank packed, as its `MooncakeChunk.sections`
    /// describe it (`[(component codes, destination pages)]`), into `pool`; returns the
    /// event after which the pages hold it. Call it only once the chunk's bytes have landed.
    fn scatter(
        &self,
        py: Python<'_>,
        sections: WireSections,
        pool: &PyDevicePool,
    ) -> PyResult<PyEvent> {
        let sections = sections_of(sections)?;
        let dst = pool.inner.clone();
        let (event, backend) = py
            .detach(|| {
                let mut inner = lock(&self.inner);
                Ok::<_, kvshard::Error>((inner.scatter(&sections, &dst)?, inner.backend().clone()))
            })
            .py_err()?;
        Ok(PyEvent { event, backend })
    }
}

/// Seconds as a duration (`what` names them in the error).
fn seconds(s: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|e| invalid(format!("{what}: {s} s ({e})")))
}

/// One chunk handed to the engine: post `src_addrs`/`dst_addrs`/`lengths` (in bounce mode,
/// once `ready()`), report `posted`, then `landed` or `failed`; `poll` it (or `wait_sync`) for the
/// status to deliver to the decode side (`report(status)` is its side-channel frame).
#[pyclass(frozen, module = "kvshard", name = "MooncakeChunk")]
pub struct PyMooncakeChunk(MooncakeChunk);

#[pymethods]
impl PyMooncakeChunk {
    /// Request id.
    #[getter]
    fn request(&self) -> u64 {
        self.0.request()
    }

    /// The sending rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.0.rank()
    }

    /// Index of the chunk in the request's send order.
    #[getter]
    fn chunk(&self) -> u32 {
        self.0.chunk()
    }

    /// Whether it is the request's final chunk.
    #[getter]
    fn last(&self) -> bool {
        self.0.is_last()
    }

    /// Source addresses (this rank's memory, as the engine addresses it).
    #[getter]
    fn src_addrs(&self) -> Vec<u64> {
        self.0.src_addrs().to_vec()
    }

    /// Destination addresses (the decode side's, as it published them).
    #[getter]
    fn dst_addrs(&self) -> Vec<u64> {
        self.0.dst_addrs().to_vec()
    }

    /// Lengths.
    #[getter]
    fn lengths(&self) -> Vec<u64> {
        self.0.lengths().to_vec()
    }

    /// The decode rank each descriptor goes to (post it to that rank's engine): all 0 for an
    /// unsharded decode.
    #[getter]
    fn targets(&self) -> Vec<u32> {
        self.0.targets().to_vec()
    }

    /// Per decode rank of a decode context-parallel request, in rank order, `(destination,
    /// slot)`: the sender's destination the rank is and the bounce slot its region went
    /// through (None when the chunk moves it no row). Empty for an unsharded decode.
    #[getter]
    fn decode_parts(&self) -> Vec<(usize, Option<usize>)> {
        self.0
            .decode_parts()
            .iter()
            .map(|p| (p.destination, p.slot))
            .collect()
    }

    /// Descriptors to post: 0 for a chunk that moves nothing (report it all the same), 1 when
    /// bounced (one per decode rank reached, for a decode context-parallel request).
    #[getter]
    fn descriptors(&self) -> usize {
        self.0.lengths().len()
    }

    /// Payload bytes of the chunk (a bounced range adds at most 255 bytes of padding per
    /// component).
    #[getter]
    fn bytes(&self) -> u64 {
        self.0.bytes()
    }

    /// Whether the chunk went through the bounce buffers.
    #[getter]
    fn bounced(&self) -> bool {
        self.0.slot().is_some()
    }

    /// The bounce slot it was packed into (None unless bounced): its descriptor targets the
    /// decode's buffer of that slot, which scatters it; free it with
    /// `MooncakeSender.bounce_free(slot)` once that is done.
    #[getter]
    fn slot(&self) -> Option<usize> {
        self.0.slot()
    }

    /// The packed sections, `[(component codes, destination pages)]`: what the decode side's
    /// `BounceBuffer.scatter` takes (empty unless bounced).
    #[getter]
    fn sections(&self) -> WireSections {
        sections_wire(self.0.sections())
    }

    /// Whether the descriptors may be posted: the bounce packing has run (always, unbounced).
    /// Never blocks.
    fn ready(&self) -> PyResult<bool> {
        self.0.ready().py_err()
    }

    /// Counts the chunk as posted (once): `seconds` the engine's post took, added to kvshard's
    /// planning (and packing launch) time.
    fn posted(&self, seconds: f64) -> PyResult<()> {
        let engine = self::seconds(seconds, "posting")?;
        self.0.posted(engine).py_err()
    }

    /// Reports the chunk's bytes landed, `seconds` after it was handed out.
    fn landed(&self, seconds: f64) -> PyResult<()> {
        let took = self::seconds(seconds, "transfer")?;
        self.0.landed(took).py_err()
    }

    /// Reports the chunk's transfer failed (`poll` then raises `ChunkFailedError`).
    fn failed(&self, reason: String) -> PyResult<()> {
        self.0.failed(reason).py_err()
    }

    /// Whether the engine has reported the chunk (landed or failed).
    #[getter]
    fn reported(&self) -> bool {
        self.0.is_reported()
    }

    /// The chunk's status once the engine reported it landed, None while it is moving; a
    /// failure (reported, or the transfer timeout passing first) raises `ChunkFailedError`
    /// (its `status` is what to deliver).
    fn poll(&self, py: Python<'_>) -> PyResult<Option<PyChunkStatus>> {
        Ok(py.detach(|| self.0.poll()).py_err()?.map(PyChunkStatus))
    }

    /// `poll`, with the status each decode rank receives, in rank order (one for an unsharded
    /// decode).
    fn poll_each(&self, py: Python<'_>) -> PyResult<Option<Vec<PyChunkStatus>>> {
        Ok(py
            .detach(|| self.0.poll_each())
            .py_err()?
            .map(|v| v.into_iter().map(PyChunkStatus).collect()))
    }

    /// Waits (at most the transfer timeout) until the engine reports the chunk and returns its
    /// status (once).
    fn wait_sync(&self, py: Python<'_>) -> PyResult<PyChunkStatus> {
        Ok(PyChunkStatus(py.detach(|| self.0.wait_sync()).py_err()?))
    }

    /// The side channel's frame reporting `status` (this chunk's, from `poll` or a
    /// `ChunkFailedError`): it names the bounce slot and sections of a chunk that landed.
    fn report<'py>(
        &self,
        py: Python<'py>,
        status: &PyChunkStatus,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let frame = self.0.status_frame(status.0.clone());
        let bytes = mc::frames::encode(&frame).map_err(|e| invalid(e.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The side channel's frame reporting `status` to decode rank `decode_rank` of a decode
    /// context-parallel request (its entry of `poll_each`, or a `ChunkFailedError`'s status):
    /// a `dense_status` naming the slot and how to unpack the region when the chunk moved the
    /// rank rows and landed, a plain `status` otherwise.
    fn report_decode<'py>(
        &self,
        py: Python<'py>,
        decode_rank: u32,
        status: &PyChunkStatus,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let frame = self
            .0
            .decode_status_frame(decode_rank, status.0.clone())
            .py_err()?;
        let bytes = mc::frames::encode(&frame).map_err(|e| invalid(e.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }
}

/// The sending side of one prefill rank for a transfer engine that moves raw ranges
/// (Mooncake's): plans each chunk of its requests and hands it out as descriptor lists into
/// the decode pool the decode side published (`decode_bases[c][l]`, `decode_pages` pages per
/// layer, addresses as its engine registered them: `engine_memory(pool)` there), coalesced,
/// or packed into one of this rank's bounce slots for one descriptor into the decode's buffer
/// of that slot (`decode_bounces`: the `(address, bytes)` of each of the decode's buffers for
/// this rank, one slot each) by `mode`. `bounce_pages` sizes this rank's bounce buffers (0:
/// none), one per decode slot; `transfer_timeout` fails a chunk the engine has not reported
/// by then; the packing copies run on `stream`.
#[pyclass(module = "kvshard", name = "MooncakeSender")]
pub struct PyMooncakeSender {
    inner: Mutex<MooncakeSender>,
    #[allow(dead_code)]
    pool: Py<PyDevicePool>,
}

#[pymethods]
impl PyMooncakeSender {
    #[new]
    #[pyo3(signature = (pool, decode_bases, decode_pages, *, mode = PyMooncakeMode::AUTO, bounce_pages = 64, decode_bounces = Vec::new(), bounce_below = 512 << 10, transfer_timeout = 30.0, stream = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        pool: Py<PyDevicePool>,
        decode_bases: Vec<Vec<u64>>,
        decode_pages: u64,
        mode: PyMooncakeMode,
        bounce_pages: u64,
        decode_bounces: Vec<(u64, u64)>,
        bounce_below: u64,
        transfer_timeout: f64,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let p = pool.get();
        let device = p.device.get();
        let backend: Arc<dyn Backend> = device.resolve(stream)?;
        let config = MooncakeConfig {
            mode: mode.into(),
            bounce_pages,
            bounce_below,
            transfer_timeout: seconds(transfer_timeout, "transfer_timeout")?,
        };
        let target = DecodeTarget {
            bases: decode_bases,
            pages: decode_pages,
            bounces: decode_bounces,
        };
        let sender = MooncakeSender::new(
            p.inner.clone(),
            backend,
            addresses_of(device),
            target,
            config,
        )
        .py_err()?;
        Ok(Self {
            inner: Mutex::new(sender),
            pool,
        })
    }

    /// This sender's rank.
    #[getter]
    fn rank(&self) -> u32 {
        lock(&self.inner).rank()
    }

    /// This rank's bounce buffers to register with the engine, `[(address, bytes)]`, one per
    /// slot (empty: no bouncing).
    #[getter]
    fn bounce_regions(&self) -> Vec<(u64, u64)> {
        lock(&self.inner).bounce_regions()
    }

    /// Starts sending a request the decode side registered (its pool is the one the sender
    /// was made for).
    fn open(&self, registration: &PyRegistration) -> PyResult<()> {
        lock(&self.inner).open(registration.0.clone()).py_err()
    }

    /// Adds another decode pool to reach, as its side published it (a decode rank of a decode
    /// context-parallel server: `decode_bases`, `decode_pages` and `decode_bounces` as the
    /// constructor takes them); returns its destination index (the constructor's is 0).
    #[pyo3(signature = (decode_bases, decode_pages, *, decode_bounces = Vec::new()))]
    fn add_destination(
        &self,
        decode_bases: Vec<Vec<u64>>,
        decode_pages: u64,
        decode_bounces: Vec<(u64, u64)>,
    ) -> PyResult<usize> {
        let target = DecodeTarget {
            bases: decode_bases,
            pages: decode_pages,
            bounces: decode_bounces,
        };
        lock(&self.inner).add_destination(target).py_err()
    }

    /// Starts sending a request the ranks of a decode context-parallel server registered
    /// (`kvshard.transfer.DecodeRegistration`) into `destinations`: per decode rank, in rank order, the
    /// destination that is its pool (0, or one `add_destination` returned), each once. Each
    /// chunk then goes as one descriptor per decode rank it moves rows to, packed into a slot
    /// of that rank's; report each rank's status with `MooncakeChunk.report_decode`.
    fn open_decode(
        &self,
        registration: &PyDecodeRegistration,
        destinations: Vec<usize>,
    ) -> PyResult<()> {
        lock(&self.inner)
            .open_decode(registration.0.clone(), &destinations)
            .py_err()
    }

    /// Plans the next chunk of `request` and hands it out (nothing moves until the engine
    /// posts it): `pages` is the request's logical page of every position prefilled so far,
    /// `end` the tokens prefilled so far, `last` (keyword-only, required) whether this is the
    /// final chunk. A chunk that cannot be planned raises `ChunkFailedError` (deliver its
    /// `status`).
    #[pyo3(signature = (request, pages, end, *, last))]
    fn send(
        &self,
        py: Python<'_>,
        request: u64,
        pages: Vec<u64>,
        end: usize,
        last: bool,
    ) -> PyResult<PyMooncakeChunk> {
        let end = if last {
            ChunkEnd::Final(end)
        } else {
            ChunkEnd::Partial(end)
        };
        let pages = logical(&pages);
        let chunk = py
            .detach(|| lock(&self.inner).send(request, &pages, end))
            .py_err()?;
        Ok(PyMooncakeChunk(chunk))
    }

    /// Frees bounce slot `slot` for the next chunk: call it once the decode side has scattered
    /// the chunk packed into it (its scatter event has passed), or once its failed transfer is
    /// over; with `request` and `chunk`, only if the slot holds that chunk (what the decode's
    /// free names). Refused (`InvalidArgumentError`) for a slot that is free, holds another
    /// chunk, or whose chunk the engine has not reported landed or failed yet
    /// (`MooncakeChunk.landed`/`failed`): the engine may still be reading it, and a packing
    /// into it would overwrite what is on the wire.
    /// `destination` names whose slot it is (a decode rank's free arrives on its own side
    /// channel; default 0).
    #[pyo3(signature = (slot, *, request = None, chunk = None, destination = 0))]
    fn bounce_free(
        &self,
        slot: usize,
        request: Option<u64>,
        chunk: Option<u32>,
        destination: usize,
    ) -> PyResult<()> {
        let holder = match (request, chunk) {
            (Some(r), Some(c)) => Some((r, c)),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "bounce_free: give both request and chunk, or neither",
                ))
            }
        };
        lock(&self.inner)
            .bounce_free_at(destination, slot, holder)
            .py_err()
    }

    /// `[(slot, chunk)]` of each bounce slot of `destination` holding a chunk of `request`.
    #[pyo3(signature = (request, *, destination = 0))]
    fn held_slots(&self, request: u64, destination: usize) -> Vec<(usize, u32)> {
        lock(&self.inner).held_slots_at(destination, request)
    }

    /// Destinations (1 plus those added).
    #[getter]
    fn destinations(&self) -> usize {
        lock(&self.inner).destinations()
    }

    /// Bounce slots (0: this sender never bounces).
    #[getter]
    fn bounce_slots(&self) -> usize {
        lock(&self.inner).bounce_slots()
    }

    /// Bounce slots no chunk holds.
    #[getter]
    fn bounce_slots_free(&self) -> usize {
        lock(&self.inner).bounce_slots_free()
    }

    /// Gives up on `request` on this rank; returns the failed status to deliver.
    fn abort(&self, request: u64, reason: &str) -> PyResult<PyChunkStatus> {
        Ok(PyChunkStatus(
            lock(&self.inner).abort(request, reason).py_err()?,
        ))
    }

    /// Closes `request` after a chunk of it failed while moving (its `ChunkFailedError.status`
    /// was the rank's last).
    fn close(&self, request: u64) -> PyResult<()> {
        lock(&self.inner).close(request).py_err()
    }

    /// The failed statuses of chunks dropped before their status was taken (as
    /// `Sender.take_dropped`).
    fn take_dropped(&self) -> Vec<PyChunkStatus> {
        lock(&self.inner)
            .take_dropped()
            .into_iter()
            .map(PyChunkStatus)
            .collect()
    }

    /// Requests open on this rank.
    #[getter]
    fn pending_requests(&self) -> usize {
        lock(&self.inner).pending_requests()
    }

    /// The transfer counters: chunks (empty and bounced ones among them), bytes, descriptors,
    /// failed transfers, and post and transfer time (count and seconds summed).
    fn stats(&self) -> BTreeMap<&'static str, f64> {
        let s = lock(&self.inner).stats();
        BTreeMap::from([
            ("chunks", s.chunks as f64),
            ("empty_chunks", s.empty_chunks as f64),
            ("bounced_chunks", s.bounced_chunks as f64),
            ("bytes", s.bytes as f64),
            ("descriptors", s.descriptors as f64),
            ("failed_transfers", s.failed_transfers as f64),
            ("posts", s.post_time.count as f64),
            ("post_seconds", s.post_time.sum.as_secs_f64()),
            ("transfers", s.transfer_time.count as f64),
            ("transfer_seconds", s.transfer_time.sum.as_secs_f64()),
        ])
    }
}
