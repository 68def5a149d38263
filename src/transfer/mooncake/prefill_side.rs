//! The prefill side: a [`MooncakeSender`] plans each chunk as every [`Sender`] does, and its
//! transport hands the chunk out to the engine as a [`MooncakeChunk`] instead of moving it:
//! coalesced (source, destination, length) lists, or one range packed into a bounce slot. The
//! engine posts it and reports back ([`MooncakeChunk::landed`], [`MooncakeChunk::failed`]);
//! the chunk then completes as every pending chunk does, within the transfer timeout.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::addresses::EngineAddresses;
use super::frames::{component_code, Bounced, Frame, WireSection};
use crate::backend::{Backend, Event};
use crate::copy::RemoteSpace;
use crate::error::{Error, Result};
use crate::index::LogicalPage;
use crate::lock::lock;
use crate::pool::DevicePool;
use crate::transfer::{
    BounceBuffer, ChunkEnd, ChunkStatus, Completion, DescriptorBatch, PackedSection, PendingChunk,
    Posted, Registration, SendPlan, Sender, StatsSnapshot, TransferStats, Transport,
};

/// How a [`MooncakeSender`] hands out each chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MooncakeMode {
    /// Bounced when a slot is free, the chunk fits it, and its coalesced descriptors average
    /// fewer than [`MooncakeConfig::bounce_below`] bytes (NIXL's rule); coalesced otherwise.
    Auto,
    /// Coalesced runs: one descriptor per run of pages contiguous on both sides, per layer.
    Coalesced,
    /// One descriptor per chunk whenever a slot is free and the chunk fits it.
    Bounce,
}

/// A sender's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MooncakeConfig {
    /// How chunks are handed out.
    pub mode: MooncakeMode,
    /// Pages per section this rank's bounce buffers hold (0: none).
    pub bounce_pages: u64,
    /// [`MooncakeMode::Auto`] bounces chunks whose coalesced descriptors average fewer bytes.
    pub bounce_below: u64,
    /// A chunk the engine has not reported this long after it was handed out fails (more
    /// than zero; a timeout no clock reaches, `Duration::MAX`, is none).
    pub transfer_timeout: Duration,
}

impl Default for MooncakeConfig {
    /// Auto, 64-page slots, bounce under 512 KiB per descriptor, a 30 s transfer timeout.
    fn default() -> Self {
        Self {
            mode: MooncakeMode::Auto,
            bounce_pages: 64,
            bounce_below: 512 << 10,
            transfer_timeout: Duration::from_secs(30),
        }
    }
}

/// Where the decode side said to write (its hello): its pool's layer bases and pages, and its
/// bounce buffer for each of this rank's slots, all as its engine addresses them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeTarget {
    /// Engine address of every stored layer of every component (`bases[c][l]`).
    pub bases: Vec<Vec<u64>>,
    /// Pages per layer of the decode pool.
    pub pages: u64,
    /// `(address, bytes)` of the decode's buffer of each slot.
    pub bounces: Vec<(u64, u64)>,
}

/// What the engine reported of a chunk's transfer.
#[derive(Debug)]
enum Outcome {
    Moving,
    Landed(Duration),
    Failed(String),
}

/// One chunk's outcome, settled by the engine's side (any thread) and read by the sender's.
#[derive(Debug)]
struct Settle {
    outcome: Mutex<Outcome>,
    changed: Condvar,
}

impl Settle {
    fn is_moving(&self) -> bool {
        matches!(*lock(&self.outcome), Outcome::Moving)
    }
}

/// A chunk's completion: what the engine settled, or a failure once the timeout passes.
struct Settled {
    settle: Arc<Settle>,
    request: u64,
    /// When the chunk fails unreported (`None`: a timeout too long for the clock, none).
    deadline: Option<Instant>,
    timeout: Duration,
}

impl Settled {
    fn check(&self, outcome: &Outcome) -> Result<bool> {
        let failed = |reason: String| {
            Err(Error::Transfer {
                request: self.request,
                reason,
            })
        };
        match outcome {
            Outcome::Landed(_) => Ok(true),
            Outcome::Failed(reason) => failed(reason.clone()),
            Outcome::Moving if self.deadline.is_some_and(|d| Instant::now() >= d) => {
                failed(format!(
                    "the transfer engine did not report the chunk landed within {:?}",
                    self.timeout
                ))
            }
            Outcome::Moving => Ok(false),
        }
    }
}

impl Completion for Settled {
    fn poll(&mut self) -> Result<bool> {
        self.check(&lock(&self.settle.outcome))
    }

    fn wait_sync(&mut self) -> Result<()> {
        let mut outcome = lock(&self.settle.outcome);
        loop {
            if self.check(&outcome)? {
                return Ok(());
            }
            outcome = match self.deadline {
                Some(d) => self
                    .settle
                    .changed
                    .wait_timeout(outcome, d.saturating_duration_since(Instant::now()))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0),
                // No timeout was asked for: until the engine reports the chunk.
                None => self
                    .settle
                    .changed
                    .wait(outcome)
                    .unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    fn transfer_time(&self) -> Option<Duration> {
        match *lock(&self.settle.outcome) {
            Outcome::Landed(d) => Some(d),
            _ => None,
        }
    }
}

/// A chunk as the engine moves it.
#[derive(Debug)]
struct Export {
    src: Vec<u64>,
    dst: Vec<u64>,
    lengths: Vec<u64>,
    sections: Vec<PackedSection>,
    packing: Option<Event>,
    slot: Option<usize>,
    settle: Arc<Settle>,
    prepared: Duration,
    bytes: u64,
}

/// The chunk a bounce slot holds, from its packing until it is freed.
#[derive(Debug)]
struct Holder {
    settle: Arc<Settle>,
    request: u64,
    chunk: u32,
}

/// One bounce slot: this rank's buffer, the decode's buffer for it, and the chunk holding both
/// (the engine reads this side's buffer until the chunk's transfer is reported; the decode's
/// scatter reads the other side's after that).
struct Slot {
    buffer: BounceBuffer,
    /// `buffer` as the engine addresses it.
    address: u64,
    /// The decode's buffer of this slot: (address, bytes).
    remote: (u64, u64),
    holder: Option<Holder>,
}

/// What the transport and the sender's face share.
struct Shared {
    config: MooncakeConfig,
    slots: Vec<Slot>,
    addresses: EngineAddresses,
    /// The chunk `submit` handed out last, taken by [`MooncakeSender::send`].
    last: Option<Export>,
}

impl Shared {
    /// The free slot `plan` bounces through and its packed bytes, when it goes bounced.
    fn bounce_slot(&self, plan: &SendPlan) -> Option<(usize, u64)> {
        if self.config.mode == MooncakeMode::Coalesced {
            return None;
        }
        let slot = self.slots.iter().position(|s| s.holder.is_none())?;
        let s = &self.slots[slot];
        let bytes = s.buffer.packed_bytes(plan).filter(|&b| b <= s.remote.1)?;
        if self.config.mode == MooncakeMode::Auto {
            let mean = plan.bytes().total() / (plan.descriptor_count() as u64).max(1);
            if mean >= self.config.bounce_below {
                return None;
            }
        }
        Some((slot, bytes))
    }
}

/// The sender's transport: hands each chunk to the engine as an [`Export`].
struct EngineTransport {
    shared: Arc<Mutex<Shared>>,
    stats: TransferStats,
}

impl Transport for EngineTransport {
    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>> {
        let started = Instant::now();
        let mut s = lock(&self.shared);
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
            // The slot is free: the engine finished reading it (its chunk was reported) and the
            // decode scattered its side, so the packing may overwrite it.
            let packed = sl.buffer.pack(plan, src)?;
            debug_assert_eq!(packed.bytes, bytes);
            export.src.push(sl.address);
            export.dst.push(sl.remote.0);
            export.lengths.push(packed.bytes);
            export.sections = packed.sections;
            export.packing = Some(packed.event);
            export.slot = Some(slot);
            sl.holder = Some(Holder {
                settle: settle.clone(),
                request: plan.request(),
                chunk: plan.chunk().index,
            });
        } else {
            let batch = DescriptorBatch::resolve(plan, src.as_ref(), dst.as_ref())?;
            for r in batch.ranges() {
                export.src.push(s.addresses.address(r.src, r.bytes)?);
                export.dst.push(r.dst);
                export.lengths.push(r.bytes);
            }
        }
        export.prepared = started.elapsed();
        let completion = Settled {
            settle,
            request: plan.request(),
            deadline: started.checked_add(s.config.transfer_timeout),
            timeout: s.config.transfer_timeout,
        };
        s.last = Some(export);
        Ok(self.stats.track(Box::new(completion), started))
    }

    fn stats(&self) -> Option<TransferStats> {
        Some(self.stats.clone())
    }
}

/// One chunk handed to the engine: post [`Self::src_addrs`] / [`Self::dst_addrs`] /
/// [`Self::lengths`] (a bounced one once [`Self::ready`]), count it [`Self::posted`], report it
/// [`Self::landed`] or [`Self::failed`], then [`Self::poll`] it (or wait) for the status to
/// deliver to the decode side, as every [`PendingChunk`]'s.
pub struct MooncakeChunk {
    pending: Mutex<Option<PendingChunk>>,
    export: Export,
    request: u64,
    rank: u32,
    chunk: u32,
    last: bool,
    posted_once: Mutex<bool>,
    stats: TransferStats,
    backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for MooncakeChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeChunk")
            .field("request", &self.request)
            .field("rank", &self.rank)
            .field("chunk", &self.chunk)
            .field("descriptors", &self.export.lengths.len())
            .field("slot", &self.export.slot)
            .finish_non_exhaustive()
    }
}

impl MooncakeChunk {
    /// Request id.
    pub fn request(&self) -> u64 {
        self.request
    }

    /// The sending rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Index of the chunk in the request's send order.
    pub fn chunk(&self) -> u32 {
        self.chunk
    }

    /// Whether it is the request's final chunk.
    pub fn is_last(&self) -> bool {
        self.last
    }

    /// Source addresses (this rank's memory, as the engine addresses it).
    pub fn src_addrs(&self) -> &[u64] {
        &self.export.src
    }

    /// Destination addresses (the decode's, as it published them).
    pub fn dst_addrs(&self) -> &[u64] {
        &self.export.dst
    }

    /// Lengths.
    pub fn lengths(&self) -> &[u64] {
        &self.export.lengths
    }

    /// Payload bytes (a bounced range adds at most 255 bytes of padding per component).
    pub fn bytes(&self) -> u64 {
        self.export.bytes
    }

    /// The bounce slot it was packed into (`None` unless bounced): its one descriptor targets
    /// the decode's buffer of that slot.
    pub fn slot(&self) -> Option<usize> {
        self.export.slot
    }

    /// The packed sections (empty unless bounced): what the decode scatters.
    pub fn sections(&self) -> &[PackedSection] {
        &self.export.sections
    }

    /// Whether the descriptors may be posted: the bounce packing has run (always, unbounced).
    /// Never blocks.
    pub fn ready(&self) -> Result<bool> {
        match &self.export.packing {
            Some(e) => self.backend.is_done(e),
            None => Ok(true),
        }
    }

    /// Counts the chunk as posted, once: `engine` is the time the engine's post took, added to
    /// kvshard's planning (and packing launch) time.
    pub fn posted(&self, engine: Duration) -> Result<()> {
        let mut once = lock(&self.posted_once);
        if *once {
            return Err(Error::InvalidArgument(
                "the chunk was already counted as posted".into(),
            ));
        }
        self.stats.posted(&Posted {
            bytes: self.export.bytes,
            descriptors: self.export.lengths.len() as u64,
            post_time: self.export.prepared.saturating_add(engine),
            bounced: self.export.packing.is_some(),
        });
        *once = true;
        Ok(())
    }

    fn settle(&self, outcome: Outcome) -> Result<()> {
        let mut o = lock(&self.export.settle.outcome);
        if !matches!(*o, Outcome::Moving) {
            return Err(Error::InvalidArgument(
                "the chunk's transfer was already reported".into(),
            ));
        }
        *o = outcome;
        self.export.settle.changed.notify_all();
        Ok(())
    }

    /// Reports the chunk's bytes landed, `took` after it was handed out. Once per chunk (a
    /// second report of either kind is refused).
    pub fn landed(&self, took: Duration) -> Result<()> {
        self.settle(Outcome::Landed(took))
    }

    /// Reports the chunk's transfer failed: [`Self::poll`] then fails with it.
    pub fn failed(&self, reason: impl Into<String>) -> Result<()> {
        self.settle(Outcome::Failed(reason.into()))
    }

    /// Whether the engine has reported the chunk (landed or failed).
    pub fn is_reported(&self) -> bool {
        !self.export.settle.is_moving()
    }

    /// The chunk's status once the engine reported it landed (`None` while it is moving); a
    /// failure (reported, or the transfer timeout passing first) is [`Error::ChunkFailed`].
    /// Never blocks.
    pub fn poll(&self) -> Result<Option<ChunkStatus>> {
        match lock(&self.pending).as_mut() {
            Some(p) => p.poll(),
            None => Err(Error::InvalidArgument(
                "the chunk was already waited for".into(),
            )),
        }
    }

    /// Blocks the host until the engine reports the chunk (at most the transfer timeout) and
    /// returns its status, once.
    pub fn wait_sync(&self) -> Result<ChunkStatus> {
        let pending = lock(&self.pending)
            .take()
            .ok_or_else(|| Error::InvalidArgument("the chunk was already waited for".into()))?;
        pending.wait_sync()
    }

    /// The side channel's report of `status` (this chunk's), naming the bounce slot and its
    /// sections when the chunk went bounced and landed.
    pub fn status_frame(&self, status: ChunkStatus) -> Frame {
        let bounced = match (self.export.slot, &status.result) {
            (Some(slot), crate::transfer::ChunkResult::Sent { .. }) => Some(Bounced {
                slot: slot as u32,
                sections: self
                    .export
                    .sections
                    .iter()
                    .map(|s| WireSection {
                        components: s.components.iter().map(|&c| component_code(c)).collect(),
                        pages: s.pages.iter().map(|p| p.0).collect(),
                    })
                    .collect(),
            }),
            _ => None,
        };
        Frame::Status { status, bounced }
    }
}

/// The sending side of one prefill rank for a transfer engine that moves raw ranges
/// (Mooncake's): plans each chunk of its requests and hands it out (module docs) into the
/// decode pool the decode side published ([`DecodeTarget`]).
pub struct MooncakeSender {
    sender: Sender,
    shared: Arc<Mutex<Shared>>,
    dst: Arc<RemoteSpace>,
    backend: Arc<dyn Backend>,
    stats: TransferStats,
}

impl std::fmt::Debug for MooncakeSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeSender")
            .field("rank", &self.sender.rank())
            .field("slots", &self.bounce_slots())
            .finish_non_exhaustive()
    }
}

impl MooncakeSender {
    /// The sender of `pool`'s rank into `decode`, packing on `backend` (a stream of `pool`'s
    /// device), addresses translated by `addresses`. One bounce slot of
    /// [`MooncakeConfig::bounce_pages`] pages per decode buffer in `decode.bounces` (none when
    /// coalesced or 0 pages; at most [`MAX_SLOTS`](super::MAX_SLOTS)). A zero transfer timeout
    /// is [`Error::OutOfBounds`].
    pub fn new(
        pool: Arc<DevicePool>,
        backend: Arc<dyn Backend>,
        addresses: EngineAddresses,
        decode: DecodeTarget,
        config: MooncakeConfig,
    ) -> Result<Self> {
        crate::backend::check_space(
            backend.address_space(),
            crate::copy::BlockSpace::address_space(pool.as_ref()),
            "the prefill pool",
        )?;
        if config.transfer_timeout.is_zero() {
            return Err(Error::out_of_bounds(
                "a Mooncake transfer timeout",
                "0 s",
                "more than 0 s (every chunk would fail unreported)",
            ));
        }
        if decode.bounces.len() > super::MAX_SLOTS {
            return Err(Error::out_of_bounds(
                "the decode's bounce buffers for a rank",
                decode.bounces.len(),
                format!("at most {}", super::MAX_SLOTS),
            ));
        }
        let geometry = pool.geometry().clone();
        let dst = Arc::new(RemoteSpace::unmapped(
            geometry.clone(),
            decode.pages,
            decode.bases,
        )?);
        let mut slots = Vec::new();
        if config.bounce_pages > 0 && config.mode != MooncakeMode::Coalesced {
            for remote in decode.bounces {
                let buffer = BounceBuffer::new(backend.clone(), &geometry, config.bounce_pages)?;
                let b = buffer.buffer();
                let address = addresses.address(b.addr(), b.len() as u64)?;
                slots.push(Slot {
                    buffer,
                    address,
                    remote,
                    holder: None,
                });
            }
        }
        let stats = TransferStats::new("mooncake");
        let shared = Arc::new(Mutex::new(Shared {
            config,
            slots,
            addresses,
            last: None,
        }));
        let transport = EngineTransport {
            shared: shared.clone(),
            stats: stats.clone(),
        };
        Ok(Self {
            sender: Sender::new(pool, Box::new(transport)),
            shared,
            dst,
            backend,
            stats,
        })
    }

    /// This sender's rank.
    pub fn rank(&self) -> u32 {
        self.sender.rank()
    }

    /// This rank's bounce buffers to register with the engine, `[(address, bytes)]`, one per
    /// slot.
    pub fn bounce_regions(&self) -> Vec<(u64, u64)> {
        lock(&self.shared)
            .slots
            .iter()
            .map(|s| (s.address, s.buffer.buffer().len() as u64))
            .collect()
    }

    /// Starts sending a request the decode side registered.
    pub fn open(&mut self, registration: Registration) -> Result<()> {
        self.sender.open(registration, self.dst.clone())
    }

    /// Plans the next chunk of `request` and hands it out (nothing moves until the engine
    /// posts it); `pages` is the request's logical page of every position prefilled so far. A
    /// chunk that cannot be planned is [`Error::ChunkFailed`], as [`Sender::send`]'s.
    pub fn send(
        &mut self,
        request: u64,
        pages: &[LogicalPage],
        end: ChunkEnd,
    ) -> Result<MooncakeChunk> {
        let pending = self.sender.send(request, pages, end)?;
        let export = lock(&self.shared)
            .last
            .take()
            .ok_or_else(|| Error::InvalidArgument("the transport handed out no chunk".into()))?;
        Ok(MooncakeChunk {
            request,
            rank: self.sender.rank(),
            chunk: pending.chunk(),
            last: pending.is_last(),
            pending: Mutex::new(Some(pending)),
            export,
            posted_once: Mutex::new(false),
            stats: self.stats.clone(),
            backend: self.backend.clone(),
        })
    }

    /// Frees bounce slot `slot` for the next chunk, once the decode side has scattered the
    /// chunk packed into it (or its failed transfer is over). With `holder` `(request, chunk)`,
    /// only if the slot holds that chunk. Refused ([`Error::InvalidArgument`], nothing
    /// changed) for a slot out of range or free, another holder, or a chunk the engine has not
    /// reported landed or failed: the engine may still read it, and a packing into it would
    /// overwrite what is on the wire.
    pub fn bounce_free(&self, slot: usize, holder: Option<(u64, u32)>) -> Result<()> {
        let mut s = lock(&self.shared);
        let count = s.slots.len();
        let refused =
            |why: String| Err(Error::InvalidArgument(format!("bounce slot {slot}: {why}")));
        let Some(sl) = s.slots.get_mut(slot) else {
            return refused(format!("the sender has {count}"));
        };
        let Some(h) = &sl.holder else {
            return refused("free already".into());
        };
        if let Some((request, chunk)) = holder {
            if (h.request, h.chunk) != (request, chunk) {
                return refused(format!(
                    "it holds chunk {} of request {}, not chunk {chunk} of request {request}",
                    h.chunk, h.request
                ));
            }
        }
        if h.settle.is_moving() {
            return refused(
                "the engine has not reported its chunk landed or failed, and may still be reading it"
                    .into(),
            );
        }
        sl.holder = None;
        Ok(())
    }

    /// `(slot, chunk)` of each bounce slot holding a chunk of `request`.
    pub fn held_slots(&self, request: u64) -> Vec<(usize, u32)> {
        lock(&self.shared)
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let h = s.holder.as_ref()?;
                (h.request == request).then_some((i, h.chunk))
            })
            .collect()
    }

    /// Bounce slots (0: this sender never bounces).
    pub fn bounce_slots(&self) -> usize {
        lock(&self.shared).slots.len()
    }

    /// Bounce slots no chunk holds.
    pub fn bounce_slots_free(&self) -> usize {
        lock(&self.shared)
            .slots
            .iter()
            .filter(|s| s.holder.is_none())
            .count()
    }

    /// Gives up on `request` on this rank ([`Sender::abort`]).
    pub fn abort(&mut self, request: u64, reason: &str) -> Result<ChunkStatus> {
        self.sender.abort(request, reason)
    }

    /// Closes `request` after a chunk of it failed ([`Sender::close`]).
    pub fn close(&mut self, request: u64) -> Result<()> {
        self.sender.close(request)
    }

    /// The failed statuses of chunks dropped before their status was taken
    /// ([`Sender::take_dropped`]).
    pub fn take_dropped(&mut self) -> Vec<ChunkStatus> {
        self.sender.take_dropped()
    }

    /// Requests open on this rank.
    pub fn pending_requests(&self) -> usize {
        self.sender.pending_requests()
    }

    /// The transfer counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }
}
