//! Send plans as a transfer engine's descriptor lists (Mooncake's `TransferEngine`, driven by
//! `kvshard/mooncake.py`, or an engine's own Mooncake path): kvshard plans each chunk, and
//! hands out either its coalesced (source address, destination address, length) lists or, in
//! bounce mode, the one range its owned blocks were packed into; the engine moves them and
//! reports back (`landed`, `failed`), and the chunk completes as every P/D chunk does (a
//! status per (request, chunk, rank), failures as `ChunkFailedError`, a deadline).
//!
//! Addresses are the ones an engine registers and moves: device addresses on a GPU, process
//! (host) addresses on the CPU backend, whose arena addresses no engine knows.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{Backend, Event};
use kvshard::copy::{BlockSpace, RemoteSpace};
use kvshard::geometry::Component;
use kvshard::index::LocalPage;
use kvshard::pool::DevicePool;
use kvshard::transfer::{
    BounceBuffer, ChunkEnd, Completion, DescriptorBatch, PackedSection, PendingChunk, Posted,
    SendPlan, Sender, TransferStats, Transport,
};

use crate::chunk_staging::PyChunkStaging;
use crate::device::{PyDevice, PyEvent};
use crate::device_pool::PyDevicePool;
use crate::errors::{invalid, IntoPy};
use crate::geometry::PyCacheGeometry;
use crate::host_pool::PyHostPool;
use crate::lock::lock;
use crate::shard::logical;
use crate::transfer::{poll_held, wait_held, PyChunkStatus, PyRegistration};

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

/// `[addr, addr + len)` of `cpu`'s memory (or a GPU's, `cpu` None) as an engine addresses it.
fn engine_address(cpu: Option<&CpuBackend>, addr: u64, len: u64) -> kvshard::Result<u64> {
    match cpu {
        Some(b) => {
            let len = usize::try_from(len).map_err(|_| {
                kvshard::Error::InvalidArgument(format!("{len} bytes at {addr:#x}"))
            })?;
            Ok(b.host_address(addr, len)? as u64)
        }
        None => Ok(addr),
    }
}

/// `(regions to register, layer bases)` of a pool, as `engine_memory` returns them.
type EngineMemory = (Vec<(u64, u64)>, Vec<Vec<u64>>);

/// The memory of `pool` as a transfer engine registers and addresses it: the contiguous
/// regions to register once, `[(address, bytes)]` (adjacent layers merged), and the base of
/// every stored layer of every component (`bases[c][l]`, in `geometry.components()` order),
/// what the decode side publishes to its prefill ranks (`MooncakeSender(decode_bases=...)`).
#[pyfunction]
pub fn engine_memory(pool: &PyDevicePool) -> PyResult<EngineMemory> {
    let device = pool.device.get();
    let cpu = device.cpu().map(|b| b.as_ref());
    let p = &pool.inner;
    let mut ranges = Vec::new();
    let mut bases = Vec::new();
    for c in p.geometry().components() {
        let bytes = p.pages() * c.block_bytes as u64;
        let mut layers = Vec::new();
        for &base in p.layer_bases(c.component).py_err()? {
            let at = engine_address(cpu, base, bytes).py_err()?;
            layers.push(at);
            ranges.push((at, bytes));
        }
        bases.push(layers);
    }
    Ok((merged(ranges), bases))
}

/// Sorted `[(address, bytes)]` with overlapping or adjacent ranges merged.
fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (addr, len) in ranges {
        match out.last_mut() {
            Some((a, l)) if *a + *l >= addr => *l = (addr + len).max(*a + *l) - *a,
            _ => out.push((addr, len)),
        }
    }
    out
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
        let device = s.device.get();
        let buf = s.inner.buffer();
        let at = engine_address(
            device.cpu().map(|c| c.as_ref()),
            buf.addr(),
            buf.len() as u64,
        )
        .py_err()?;
        return Ok(vec![(at, buf.len() as u64)]);
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
        return Ok(merged(ranges));
    }
    Err(invalid(format!(
        "engine_regions takes a DevicePool, HostPool, ChunkStaging or BounceBuffer, not {}",
        memory.get_type().name()?
    )))
}

/// The index of `c` in `Component::ALL`: a packed section's components on the wire.
fn component_code(c: Component) -> u32 {
    Component::ALL.iter().position(|&x| x == c).unwrap_or(0) as u32
}

/// Packed sections from their wire form, `[(component codes, destination pages)]`.
fn sections_of(wire: Vec<(Vec<u32>, Vec<u64>)>) -> PyResult<Vec<PackedSection>> {
    wire.into_iter()
        .map(|(codes, pages)| {
            let components = codes
                .into_iter()
                .map(|code| {
                    Component::ALL.get(code as usize).copied().ok_or_else(|| {
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

/// A bounce buffer: on the decode side, one per (prefill rank, slot): register
/// `address`/`bytes` with the engine once and publish them to the rank; `scatter` empties a
/// chunk the rank packed into it into the pool's pages.
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
        let d = device;
        let backend = d.resolve(stream)?;
        let inner = BounceBuffer::new(backend, &geometry.0, pages).py_err()?;
        let b = inner.buffer();
        let address =
            engine_address(d.cpu().map(|c| c.as_ref()), b.addr(), b.len() as u64).py_err()?;
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
        sections: Vec<(Vec<u32>, Vec<u64>)>,
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

/// What an engine reports of a chunk's transfer.
enum Outcome {
    Moving,
    Landed(Duration),
    Failed(String),
}

/// The outcome of one chunk, settled by the engine's side and polled by the sender's.
struct Settle {
    outcome: Mutex<Outcome>,
    changed: Condvar,
}

/// A chunk's completion: what the engine settled, or a failure once its deadline passes.
struct Settled {
    settle: Arc<Settle>,
    request: u64,
    deadline: Instant,
    timeout: Duration,
}

impl Settled {
    fn check(&self, outcome: &Outcome) -> kvshard::Result<bool> {
        match outcome {
            Outcome::Landed(_) => Ok(true),
            Outcome::Failed(reason) => Err(kvshard::Error::Transfer {
                request: self.request,
                reason: reason.clone(),
            }),
            Outcome::Moving if Instant::now() >= self.deadline => Err(kvshard::Error::Transfer {
                request: self.request,
                reason: format!(
                    "the transfer engine did not report the chunk landed within {:?}",
                    self.timeout
                ),
            }),
            Outcome::Moving => Ok(false),
        }
    }
}

impl Completion for Settled {
    fn poll(&mut self) -> kvshard::Result<bool> {
        self.check(&lock(&self.settle.outcome))
    }

    fn wait_sync(&mut self) -> kvshard::Result<()> {
        let mut outcome = lock(&self.settle.outcome);
        loop {
            if self.check(&outcome)? {
                return Ok(());
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            outcome = self
                .settle
                .changed
                .wait_timeout(outcome, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    fn transfer_time(&self) -> Option<Duration> {
        match *lock(&self.settle.outcome) {
            Outcome::Landed(d) => Some(d),
            _ => None,
        }
    }
}

/// One chunk as the engine moves it.
struct Export {
    src: Vec<u64>,
    dst: Vec<u64>,
    lengths: Vec<u64>,
    sections: Vec<PackedSection>,
    packing: Option<Event>,
    /// The bounce slot the chunk was packed into.
    slot: Option<usize>,
    settle: Arc<Settle>,
    prepared: Duration,
    bytes: u64,
}

/// One bounce slot of a prefill rank: its buffer here, the decode's buffer for it, and the
/// chunk that holds both until the slot is freed.
struct Slot {
    buffer: BounceBuffer,
    /// `buffer` as the engine addresses it.
    address: u64,
    /// The decode's bounce buffer of this slot: (address, bytes).
    remote: (u64, u64),
    /// The chunk packed into the slot, from its packing until `bounce_free`: the engine reads
    /// this side's buffer until the chunk's transfer is reported, and the decode's scatter
    /// reads the other side's after that.
    holder: Option<Arc<Settle>>,
}

/// What a sender's transport and its Python face share.
struct Shared {
    mode: PyMooncakeMode,
    /// Bounce slots: chunk k + 1 packs into one while chunk k is on the wire from another.
    slots: Vec<Slot>,
    bounce_below: u64,
    timeout: Duration,
    cpu: Option<Arc<CpuBackend>>,
    /// The export of the chunk `submit` made last, taken by `send`.
    last: Option<Export>,
    stats: TransferStats,
}

impl Shared {
    /// The free slot `plan` bounces through and its packed bytes, when it goes bounced.
    fn bounce_slot(&self, plan: &SendPlan) -> Option<(usize, u64)> {
        if self.mode == PyMooncakeMode::COALESCED {
            return None;
        }
        let slot = self.slots.iter().position(|s| s.holder.is_none())?;
        let s = &self.slots[slot];
        let bytes = s.buffer.packed_bytes(plan).filter(|&b| b <= s.remote.1)?;
        if self.mode == PyMooncakeMode::AUTO {
            let mean = plan.bytes().total() / (plan.descriptor_count() as u64).max(1);
            if mean >= self.bounce_below {
                return None;
            }
        }
        Some((slot, bytes))
    }
}

/// The sender's transport: hands each chunk to the engine as an [`Export`].
struct EngineTransport(Arc<Mutex<Shared>>);

impl Transport for EngineTransport {
    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> kvshard::Result<Box<dyn Completion>> {
        let started = Instant::now();
        let mut s = lock(&self.0);
        plan.check_spaces(src.as_ref(), dst.as_ref())?;
        let settle = Arc::new(Settle {
            outcome: Mutex::new(Outcome::Moving),
            changed: Condvar::new(),
        });
        let mut export = Export {
            src: Vec::new(),
            dst: Vec::new(),
            lengths: Vec::new(),
            sections: Vec::new(),
            packing: None,
            slot: None,
            settle: settle.clone(),
            prepared: Duration::ZERO,
            bytes: plan.bytes().total(),
        };
        if plan.is_empty() {
            // Nothing moves: the engine's side reports the chunk at once.
        } else if let Some((slot, bytes)) = s.bounce_slot(plan) {
            let sl = &mut s.slots[slot];
            // The slot is free: the engine finished reading it (its last chunk was reported)
            // and the decode scattered its side, so the packing may overwrite it.
            let packed = sl.buffer.pack(plan, src)?;
            debug_assert_eq!(packed.bytes, bytes);
            export.src.push(sl.address);
            export.dst.push(sl.remote.0);
            export.lengths.push(packed.bytes);
            export.sections = packed.sections;
            export.packing = Some(packed.event);
            export.slot = Some(slot);
            sl.holder = Some(settle.clone());
        } else {
            let batch = DescriptorBatch::resolve(plan, src.as_ref(), dst.as_ref())?;
            let cpu = s.cpu.clone();
            for r in batch.ranges() {
                export
                    .src
                    .push(engine_address(cpu.as_deref(), r.src, r.bytes)?);
                export.dst.push(r.dst);
                export.lengths.push(r.bytes);
            }
        }
        export.prepared = started.elapsed();
        s.last = Some(export);
        let completion = Settled {
            settle,
            request: plan.request(),
            deadline: started + s.timeout,
            timeout: s.timeout,
        };
        Ok(s.stats.track(Box::new(completion), started))
    }

    fn stats(&self) -> Option<TransferStats> {
        Some(lock(&self.0).stats.clone())
    }
}

/// One chunk handed to the engine: post `src_addrs`/`dst_addrs`/`lengths` (in bounce mode,
/// once `ready()`), report `posted`, then `landed` or `failed`; `poll` it (or `wait`) for the
/// status to deliver to the decode side, as every `PendingChunk`.
#[pyclass(module = "kvshard", name = "MooncakeChunk")]
pub struct PyMooncakeChunk {
    pending: Mutex<Option<PendingChunk>>,
    export: Export,
    request: u64,
    rank: u32,
    chunk: u32,
    last: bool,
    posted_once: Mutex<bool>,
    shared: Arc<Mutex<Shared>>,
    backend: Option<Arc<dyn Backend>>,
}

impl PyMooncakeChunk {
    fn settle(&self, outcome: Outcome) -> PyResult<()> {
        let mut o = lock(&self.export.settle.outcome);
        if !matches!(*o, Outcome::Moving) {
            return Err(invalid("the chunk's transfer was already reported"));
        }
        *o = outcome;
        self.export.settle.changed.notify_all();
        Ok(())
    }
}

#[pymethods]
impl PyMooncakeChunk {
    /// Request id.
    #[getter]
    fn request(&self) -> u64 {
        self.request
    }

    /// The sending rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// Index of the chunk in the request's send order.
    #[getter]
    fn chunk(&self) -> u32 {
        self.chunk
    }

    /// Whether it is the request's final chunk.
    #[getter]
    fn last(&self) -> bool {
        self.last
    }

    /// Source addresses (this rank's memory, as the engine addresses it).
    #[getter]
    fn src_addrs(&self) -> Vec<u64> {
        self.export.src.clone()
    }

    /// Destination addresses (the decode side's, as it published them).
    #[getter]
    fn dst_addrs(&self) -> Vec<u64> {
        self.export.dst.clone()
    }

    /// Lengths.
    #[getter]
    fn lengths(&self) -> Vec<u64> {
        self.export.lengths.clone()
    }

    /// Descriptors to post: 0 for a chunk that moves nothing (report it all the same), 1 when
    /// bounced.
    #[getter]
    fn descriptors(&self) -> usize {
        self.export.lengths.len()
    }

    /// Payload bytes of the chunk (a bounced range adds at most 255 bytes of padding per
    /// component).
    #[getter]
    fn bytes(&self) -> u64 {
        self.export.bytes
    }

    /// Whether the chunk went through the bounce buffers.
    #[getter]
    fn bounced(&self) -> bool {
        self.export.packing.is_some()
    }

    /// The bounce slot it was packed into (None unless bounced): its descriptor targets the
    /// decode's buffer of that slot, which scatters it; free it with
    /// `MooncakeSender.bounce_free(slot)` once that is done.
    #[getter]
    fn slot(&self) -> Option<usize> {
        self.export.slot
    }

    /// The packed sections, `[(component codes, destination pages)]`: what the decode side's
    /// `BounceBuffer.scatter` takes (empty unless bounced).
    #[getter]
    fn sections(&self) -> Vec<(Vec<u32>, Vec<u64>)> {
        self.export
            .sections
            .iter()
            .map(|s| {
                (
                    s.components.iter().map(|&c| component_code(c)).collect(),
                    s.pages.iter().map(|p| p.0).collect(),
                )
            })
            .collect()
    }

    /// Whether the descriptors may be posted: the bounce packing has run (always, unbounced).
    /// Never blocks.
    fn ready(&self) -> PyResult<bool> {
        match (&self.export.packing, &self.backend) {
            (Some(e), Some(b)) => b.is_done(e).py_err(),
            _ => Ok(true),
        }
    }

    /// Counts the chunk as posted (once): `seconds` the engine's post took, added to kvshard's
    /// planning (and packing launch) time.
    fn posted(&self, seconds: f64) -> PyResult<()> {
        let mut once = lock(&self.posted_once);
        if *once {
            return Err(invalid("the chunk was already counted as posted"));
        }
        let engine = Duration::try_from_secs_f64(seconds)
            .map_err(|e| invalid(format!("{seconds} s of posting: {e}")))?;
        lock(&self.shared).stats.posted(&Posted {
            bytes: self.export.bytes,
            descriptors: self.export.lengths.len() as u64,
            post_time: self.export.prepared + engine,
            bounced: self.export.packing.is_some(),
        });
        *once = true;
        Ok(())
    }

    /// Reports the chunk's bytes landed, `seconds` after it was handed out.
    fn landed(&self, seconds: f64) -> PyResult<()> {
        let d = Duration::try_from_secs_f64(seconds)
            .map_err(|e| invalid(format!("{seconds} s of transfer: {e}")))?;
        self.settle(Outcome::Landed(d))
    }

    /// Reports the chunk's transfer failed (`poll` then raises `ChunkFailedError`).
    fn failed(&self, reason: String) -> PyResult<()> {
        self.settle(Outcome::Failed(reason))
    }

    /// The chunk's status once the engine reported it landed, None while it is moving; a
    /// failure (reported, or the transfer timeout passing first) raises `ChunkFailedError`
    /// (its `status` is what to deliver).
    fn poll(&self, py: Python<'_>) -> PyResult<Option<PyChunkStatus>> {
        poll_held(py, &self.pending)
    }

    /// Waits (at most the transfer timeout) until the engine reports the chunk and returns its
    /// status (once).
    fn wait(&self, py: Python<'_>) -> PyResult<PyChunkStatus> {
        wait_held(py, &self.pending)
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
    inner: Mutex<Sender>,
    shared: Arc<Mutex<Shared>>,
    dst: Arc<RemoteSpace>,
    backend: Arc<dyn Backend>,
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
        let backend = device.resolve(stream)?;
        let timeout = Duration::try_from_secs_f64(transfer_timeout)
            .map_err(|e| invalid(format!("transfer_timeout {transfer_timeout} s: {e}")))?;
        let geometry = p.inner.geometry().clone();
        let dst =
            Arc::new(RemoteSpace::unmapped(geometry.clone(), decode_pages, decode_bases).py_err()?);
        let cpu = device.cpu().cloned();
        let mut slots = Vec::new();
        if bounce_pages > 0 && mode != PyMooncakeMode::COALESCED {
            for remote in decode_bounces {
                let buffer =
                    BounceBuffer::new(backend.clone(), &geometry, bounce_pages).py_err()?;
                let b = buffer.buffer();
                let address = engine_address(cpu.as_deref(), b.addr(), b.len() as u64).py_err()?;
                slots.push(Slot {
                    buffer,
                    address,
                    remote,
                    holder: None,
                });
            }
        }
        let shared = Arc::new(Mutex::new(Shared {
            mode,
            slots,
            bounce_below,
            timeout,
            cpu,
            last: None,
            stats: TransferStats::new("mooncake"),
        }));
        let sender = Sender::new(p.inner.clone(), Box::new(EngineTransport(shared.clone())));
        Ok(Self {
            inner: Mutex::new(sender),
            shared,
            dst,
            backend,
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
        lock(&self.shared)
            .slots
            .iter()
            .map(|s| (s.address, s.buffer.buffer().len() as u64))
            .collect()
    }

    /// Starts sending a request the decode side registered (its pool is the one the sender
    /// was made for).
    fn open(&self, registration: &PyRegistration) -> PyResult<()> {
        lock(&self.inner)
            .open(registration.0.clone(), self.dst.clone())
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
        let (pending, export, rank) = py
            .detach(|| {
                let mut sender = lock(&self.inner);
                let pending = sender.send(request, &pages, end)?;
                let export = lock(&self.shared).last.take();
                Ok::<_, kvshard::Error>((pending, export, sender.rank()))
            })
            .py_err()?;
        let export = export.ok_or_else(|| invalid("the transport handed out no chunk"))?;
        Ok(PyMooncakeChunk {
            request,
            rank,
            chunk: pending.chunk(),
            last: pending.is_last(),
            pending: Mutex::new(Some(pending)),
            export,
            posted_once: Mutex::new(false),
            shared: self.shared.clone(),
            backend: Some(self.backend.clone()),
        })
    }

    /// Frees bounce slot `slot` for the next chunk: call it once the decode side has scattered
    /// the chunk packed into it (its scatter event has passed), or once its failed transfer is
    /// over. Refused (`InvalidArgumentError`) for a slot that is free, or whose chunk the
    /// engine has not reported landed or failed yet (`MooncakeChunk.landed`/`failed`): the
    /// engine may still be reading it, and a packing into it would overwrite what is on the
    /// wire.
    fn bounce_free(&self, slot: usize) -> PyResult<()> {
        let mut s = lock(&self.shared);
        let count = s.slots.len();
        let sl = s
            .slots
            .get_mut(slot)
            .ok_or_else(|| invalid(format!("bounce slot {slot}; the sender has {count}")))?;
        let holder = sl
            .holder
            .as_ref()
            .ok_or_else(|| invalid(format!("bounce slot {slot} is free already")))?;
        if matches!(*lock(&holder.outcome), Outcome::Moving) {
            return Err(invalid(format!(
                "bounce slot {slot}: the engine has not reported its chunk landed or failed, \
                 and may still be reading it"
            )));
        }
        sl.holder = None;
        Ok(())
    }

    /// Bounce slots (0: this sender never bounces).
    #[getter]
    fn bounce_slots(&self) -> usize {
        lock(&self.shared).slots.len()
    }

    /// Bounce slots no chunk holds.
    #[getter]
    fn bounce_slots_free(&self) -> usize {
        lock(&self.shared)
            .slots
            .iter()
            .filter(|s| s.holder.is_none())
            .count()
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
        let s = lock(&self.shared).stats.snapshot();
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
