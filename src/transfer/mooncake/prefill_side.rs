//! The prefill side: a [`MooncakeSender`] plans each chunk as every [`Sender`] does, and its
//! transport hands the chunk out to the engine as a [`MooncakeChunk`] instead of moving it:
//! coalesced (source, destination, length) lists, or one range packed into a bounce slot. The
//! engine posts it and reports back ([`MooncakeChunk::landed`], [`MooncakeChunk::failed`]);
//! the chunk then completes as every pending chunk does, within the transfer timeout.
//!
//! **Decode context parallelism** (docs/dcp.md, "Mooncake"): a sender may reach several decode
//! servers' pools ([`MooncakeSender::add_destination`]: each decode rank of a DCP server is
//! one, with its own bounce buffers for this rank), and [`MooncakeSender::open_decode`] opens
//! a request into them. Each chunk is packed per decode rank densely into a region of a free
//! slot of that rank's ([`DenseBounce::pack`], one launch) and handed out as one descriptor per
//! decode rank it moves rows to; each decode rank's status then rides a
//! [`Frame::DenseStatus`](super::frames::Frame::DenseStatus) saying how to unpack the region ([`MooncakeChunk::decode_status_frame`];
//! a rank the chunk moves nothing to gets a plain status). There is no coalesced route for such
//! rows: a chunk finding no free slot at a decode rank it moves rows to, or whose rows there do
//! not fit a slot, is refused before anything moves.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

mod chunk;

pub use chunk::{DecodePart, MooncakeChunk};

use chunk::Export;

use super::addresses::EngineAddresses;
use crate::backend::{Backend, Buffer};
use crate::copy::RemoteSpace;
use crate::error::{Error, Result};
use crate::index::LogicalPage;
use crate::lock::lock;
use crate::pool::DevicePool;
use crate::transfer::{
    region_of, BounceBuffer, ChunkEnd, ChunkStatus, Completion, DecodePlan, DecodeRegistration,
    DenseBounce, DescriptorBatch, Registration, SendPlan, Sender, StatsSnapshot, TransferStats,
    Transport,
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

/// One decode pool the sender reaches (a decode server's, or one decode context-parallel
/// rank's) and its bounce slots.
struct Destination {
    dst: Arc<RemoteSpace>,
    slots: Vec<Slot>,
}

/// What the transport and the sender's face share.
struct Shared {
    config: MooncakeConfig,
    /// Destination 0 is the decode `MooncakeSender::new` was given.
    dests: Vec<Destination>,
    addresses: EngineAddresses,
    /// Packs chunks densely for decode context-parallel ranks.
    dense: DenseBounce,
    /// The chunk `submit` handed out last, taken by [`MooncakeSender::send`].
    last: Option<Export>,
}

impl Shared {
    /// Keeps `export` for the engine to take (prepared since `started`) and returns the
    /// completion of request `request`'s chunk, failed unreported the transfer timeout after
    /// `started`.
    fn hand_out(&mut self, mut export: Export, request: u64, started: Instant) -> Settled {
        export.prepared = started.elapsed();
        let completion = Settled {
            settle: export.settle.clone(),
            request,
            deadline: started.checked_add(self.config.transfer_timeout),
            timeout: self.config.transfer_timeout,
        };
        self.last = Some(export);
        completion
    }

    /// The free slot of destination 0 `plan` bounces through and its packed bytes, when it goes
    /// bounced.
    fn bounce_slot(&self, plan: &SendPlan) -> Option<(usize, u64)> {
        if self.config.mode == MooncakeMode::Coalesced {
            return None;
        }
        let slots = &self.dests[0].slots;
        let slot = slots.iter().position(|s| s.holder.is_none())?;
        let s = &slots[slot];
        let bytes = s.buffer.packed_bytes(plan).filter(|&b| b <= s.remote.1)?;
        if self.config.mode == MooncakeMode::Auto {
            let mean = plan.bytes().total() / (plan.descriptor_count() as u64).max(1);
            if mean >= self.config.bounce_below {
                return None;
            }
        }
        Some((slot, bytes))
    }

    fn slots_mut(&mut self, destination: usize) -> Result<&mut Vec<Slot>> {
        let count = self.dests.len();
        self.dests
            .get_mut(destination)
            .map(|d| &mut d.slots)
            .ok_or(Error::OutOfRange {
                what: "Mooncake destination",
                index: destination as i64,
                limit: count as u64,
            })
    }

    /// Per decode rank of `plan`: its destination (the one `dsts` names), and the free slot
    /// its rows go through with their bytes (none when it has no rows). Refused, before
    /// anything is taken, when a rank with rows finds no free slot or its rows do not fit one.
    fn dense_slots(
        &self,
        plan: &DecodePlan,
        src: &DevicePool,
        dsts: &[Arc<RemoteSpace>],
    ) -> Result<Vec<DecodePart>> {
        let request = plan.request();
        let refused = |reason: String| Err(Error::Transfer { request, reason });
        let m = plan.layout().ranks() as usize;
        if dsts.len() != m {
            return refused(format!(
                "a chunk for {m} decode ranks into {} destinations",
                dsts.len()
            ));
        }
        if self.config.mode == MooncakeMode::Coalesced {
            return refused(
                "a decode context-parallel chunk travels only through bounce slots (mode Auto or Bounce)".into(),
            );
        }
        let components = src.geometry().components();
        let mut parts = Vec::with_capacity(m);
        for (d, dst) in (0u32..).zip(dsts) {
            let Some(destination) = self.dests.iter().position(|x| Arc::ptr_eq(&x.dst, dst)) else {
                return refused(format!(
                    "decode rank {d}'s destination is not one of the sender's"
                ));
            };
            let (dense, bytes) = region_of(plan, &components, d)?;
            if dense.is_empty() {
                parts.push(DecodePart {
                    destination,
                    slot: None,
                    bytes: 0,
                    dense,
                });
                continue;
            }
            let slots = &self.dests[destination].slots;
            let Some(slot) = slots.iter().position(|s| s.holder.is_none()) else {
                return refused(format!(
                    "no bounce slot free at decode rank {d} ({} slots): a decode context-parallel chunk has no other route over Mooncake (free slots first)",
                    slots.len()
                ));
            };
            let room = (slots[slot].buffer.buffer().len() as u64).min(slots[slot].remote.1);
            if bytes > room {
                return refused(format!(
                    "decode rank {d}'s rows of the chunk take {bytes} B, more than a bounce slot's {room} B (more bounce pages on both sides, or smaller chunks)"
                ));
            }
            parts.push(DecodePart {
                destination,
                slot: Some(slot),
                bytes,
                dense,
            });
        }
        Ok(parts)
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
        let mut export = Export::new(plan.bytes().total());
        if plan.is_empty() {
            // Nothing moves: the engine's side reports the chunk at once.
        } else if let Some((slot, bytes)) = s.bounce_slot(plan) {
            let sl = &mut s.dests[0].slots[slot];
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
                settle: export.settle.clone(),
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
        export.targets = vec![0; export.lengths.len()];
        let completion = s.hand_out(export, plan.request(), started);
        Ok(self.stats.track(Box::new(completion), started))
    }

    /// Packs every decode rank's rows of `plan` into a free slot of its destination (one
    /// launch) and hands the chunk out as one descriptor per decode rank it moves rows to
    /// (module docs); refused, before anything moves, as [`Shared::dense_slots`] says.
    fn submit_decode(
        &mut self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        dsts: &[Arc<RemoteSpace>],
    ) -> Result<Box<dyn Completion>> {
        let started = Instant::now();
        let mut s = lock(&self.shared);
        let parts = s.dense_slots(plan, src, dsts)?;
        let mut export = Export::new(plan.rank_bytes().iter().map(|b| b.total()).sum());
        if parts.iter().any(|p| p.slot.is_some()) {
            let regions: Vec<Option<Buffer>> = parts
                .iter()
                .map(|p| {
                    p.slot
                        .map(|slot| s.dests[p.destination].slots[slot].buffer.buffer().clone())
                })
                .collect();
            // Every slot taken is free: the engine finished reading it and its decode rank
            // unpacked its side, so the packing may overwrite it.
            let packed = s.dense.pack(plan, src, &regions)?;
            for (d, p) in (0u32..).zip(&parts) {
                let Some(slot) = p.slot else { continue };
                let sl = &mut s.dests[p.destination].slots[slot];
                export.src.push(sl.address);
                export.dst.push(sl.remote.0);
                export.lengths.push(p.bytes);
                export.targets.push(d);
                sl.holder = Some(Holder {
                    settle: export.settle.clone(),
                    request: plan.request(),
                    chunk: plan.chunk().index,
                });
            }
            export.packing = Some(packed.event);
        }
        export.parts = parts;
        export.layout = Some(plan.layout());
        let completion = s.hand_out(export, plan.request(), started);
        Ok(self.stats.track(Box::new(completion), started))
    }

    fn stats(&self) -> Option<TransferStats> {
        Some(self.stats.clone())
    }
}

/// The sending side of one prefill rank for a transfer engine that moves raw ranges
/// (Mooncake's): plans each chunk of its requests and hands it out (module docs) into the
/// decode pool the decode side published ([`DecodeTarget`]).
pub struct MooncakeSender {
    sender: Sender,
    pool: Arc<DevicePool>,
    shared: Arc<Mutex<Shared>>,
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

/// A destination for `decode` (module docs): its pool as a remote space and one bounce slot per
/// buffer it published (none when `config` never bounces).
fn destination(
    pool: &Arc<DevicePool>,
    backend: &Arc<dyn Backend>,
    addresses: &EngineAddresses,
    config: &MooncakeConfig,
    decode: DecodeTarget,
) -> Result<Destination> {
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
    Ok(Destination { dst, slots })
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
        let first = destination(&pool, &backend, &addresses, &config, decode)?;
        let stats = TransferStats::new("mooncake");
        let shared = Arc::new(Mutex::new(Shared {
            config,
            dests: vec![first],
            addresses,
            dense: DenseBounce::new(backend.clone()),
            last: None,
        }));
        let transport = EngineTransport {
            shared: shared.clone(),
            stats: stats.clone(),
        };
        Ok(Self {
            sender: Sender::new(pool.clone(), Box::new(transport)),
            pool,
            shared,
            backend,
            stats,
        })
    }

    /// Adds another decode pool this sender reaches, `decode` as its side said (with its
    /// bounce buffers for this rank, sized as [`Self::new`] sizes destination 0's): a decode
    /// rank of a decode context-parallel server ([`Self::open_decode`]). Returns its index.
    pub fn add_destination(&mut self, decode: DecodeTarget) -> Result<usize> {
        let mut s = lock(&self.shared);
        let d = {
            let Shared {
                config, addresses, ..
            } = &*s;
            destination(&self.pool, &self.backend, addresses, config, decode)?
        };
        s.dests.push(d);
        Ok(s.dests.len() - 1)
    }

    /// Destinations (1 plus those added).
    pub fn destinations(&self) -> usize {
        lock(&self.shared).dests.len()
    }

    /// This sender's rank.
    pub fn rank(&self) -> u32 {
        self.sender.rank()
    }

    /// This rank's bounce buffers to register with the engine, `[(address, bytes)]`, one per
    /// slot of every destination, in destination order.
    pub fn bounce_regions(&self) -> Vec<(u64, u64)> {
        lock(&self.shared)
            .dests
            .iter()
            .flat_map(|d| &d.slots)
            .map(|s| (s.address, s.buffer.buffer().len() as u64))
            .collect()
    }

    /// Starts sending a request the decode side (destination 0) registered.
    pub fn open(&mut self, registration: Registration) -> Result<()> {
        let dst = lock(&self.shared).dests[0].dst.clone();
        self.sender.open(registration, dst)
    }

    /// Starts sending a request the ranks of a decode context-parallel server registered
    /// (docs/dcp.md) into `destinations`: per decode rank, in rank order, the destination that
    /// is its pool (0, or one [`Self::add_destination`] returned), each named once. Its chunks
    /// then travel densely packed (module docs); [`MooncakeChunk::poll_each`] gives each decode
    /// rank's status. Refused, changing nothing, for a destination out of range or named twice,
    /// or as [`Sender::open_decode`] refuses.
    pub fn open_decode(
        &mut self,
        registration: DecodeRegistration,
        destinations: &[usize],
    ) -> Result<()> {
        let dsts = {
            let s = lock(&self.shared);
            let mut seen = vec![false; s.dests.len()];
            let mut dsts = Vec::with_capacity(destinations.len());
            for &d in destinations {
                let Some(dest) = s.dests.get(d) else {
                    return Err(Error::OutOfRange {
                        what: "Mooncake destination",
                        index: d as i64,
                        limit: s.dests.len() as u64,
                    });
                };
                if std::mem::replace(&mut seen[d], true) {
                    return Err(Error::Transfer {
                        request: registration.request,
                        reason: format!(
                            "destination {d} named for two decode ranks (they would write one pool)"
                        ),
                    });
                }
                dsts.push(dest.dst.clone());
            }
            dsts
        };
        self.sender.open_decode(registration, dsts)
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
        self.bounce_free_at(0, slot, holder)
    }

    /// [`Self::bounce_free`] of a slot of destination `destination` (a decode rank's free
    /// arrives on its own side channel).
    pub fn bounce_free_at(
        &self,
        destination: usize,
        slot: usize,
        holder: Option<(u64, u32)>,
    ) -> Result<()> {
        let mut s = lock(&self.shared);
        let slots = s.slots_mut(destination)?;
        let count = slots.len();
        let refused =
            |why: String| Err(Error::InvalidArgument(format!("bounce slot {slot}: {why}")));
        let Some(sl) = slots.get_mut(slot) else {
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

    /// `(slot, chunk)` of each bounce slot of destination 0 holding a chunk of `request`.
    pub fn held_slots(&self, request: u64) -> Vec<(usize, u32)> {
        self.held_slots_at(0, request)
    }

    /// [`Self::held_slots`] of destination `destination` (none for one out of range).
    pub fn held_slots_at(&self, destination: usize, request: u64) -> Vec<(usize, u32)> {
        let s = lock(&self.shared);
        let Some(d) = s.dests.get(destination) else {
            return Vec::new();
        };
        d.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let h = s.holder.as_ref()?;
                (h.request == request).then_some((i, h.chunk))
            })
            .collect()
    }

    /// Bounce slots of destination 0 (0: this sender never bounces).
    pub fn bounce_slots(&self) -> usize {
        lock(&self.shared).dests[0].slots.len()
    }

    /// Bounce slots of destination 0 no chunk holds.
    pub fn bounce_slots_free(&self) -> usize {
        self.bounce_slots_free_at(0)
    }

    /// Bounce slots of destination `destination` no chunk holds (0 for one out of range).
    pub fn bounce_slots_free_at(&self, destination: usize) -> usize {
        lock(&self.shared)
            .dests
            .get(destination)
            .map_or(0, |d| d.slots.iter().filter(|s| s.holder.is_none()).count())
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
