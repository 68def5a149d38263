//! The decode side: a [`MooncakeReceiver`] holds the decode pool, its bounce buffers (one per
//! prefill rank and slot) and the [`Receiver`], and turns each rank's side-channel bytes into
//! finished requests. Nothing a peer sends is trusted:
//!
//! - **Frames.** Bytes go through the rank's [`FrameReader`]; a malformed, truncated, oversize
//!   or unknown frame, or one a prefill rank never sends, is a violation: counted, the rank is
//!   gone from then on (the caller closes its connection) and every request it was sending
//!   fails once what it reported before has been taken.
//! - **Statuses** are checked before use: the rank is the connection's, a bounce slot is one
//!   of the rank's and free here, sections fit the bounce buffer and the pool (checked in full
//!   before the scatter is enqueued). A status of a request this side is not receiving from
//!   the rank (never registered, finished, or failed here) or of a chunk already taken is
//!   dropped and counted, never buffered; the one slot such a status may name is freed for
//!   exactly that chunk ([`Frame::Free`] names it, and the prefill frees it only if the slot
//!   still holds it). Statuses that arrive ahead of an earlier chunk of their (request, rank)
//!   wait for it, at most [`MAX_HELD_STATUSES`] per rank (more is a violation).
//! - **Decode context parallelism.** A decode rank of a server sharded by token registers its
//!   share of a request ([`MooncakeReceiver::register_decode`]); its chunks arrive as
//!   [`Frame::DenseStatus`]es (or plain statuses where a chunk moves it no row). Everything a
//!   dense status says is checked before the unpack is enqueued: the layout and the rank are
//!   the registered ones, the slot is the rank's and free, and the region fits the slot and
//!   lands in the pages the share registered only ([`DenseBounce::unpack`]); a dense status of
//!   an unsharded request, or a packed (unsharded) one of a decode context-parallel request, or
//!   a plain one of such a request saying rows moved (they travel only in a region), is a
//!   violation.
//! - **Order.** A bounced chunk is scattered as soon as its status arrives (its bytes have
//!   landed); each rank's statuses reach the [`Receiver`] in chunk order, each only once its
//!   scatter has run, and its slot is freed then.
//! - **Deadlines.** [`MooncakeReceiver::expire`] reports overdue requests and asks the ranks
//!   that owe them to abort ([`Frame::Abort`]); a rank's [`Frame::Aborted`] says no status of
//!   the request will follow, so the request fails for it and is handed back once every rank
//!   is done. A gone rank's requests fail once its scatters have run.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

mod dense;

use dense::{moved_rows, DenseShare};

use super::addresses::EngineAddresses;
use super::frames::{self, component_of, Bounced, Frame, FrameReader, Shape, WireDense};
use crate::backend::{Backend, Event};
use crate::error::causes::ProtocolError;
use crate::error::{Error, Result};
use crate::index::LocalPage;
use crate::pool::DevicePool;
use crate::transfer::{
    BounceBuffer, ChunkResult, ChunkStatus, DenseBounce, Finished, Overdue, PackedSection,
    Receiver, Registration, MAX_PREFILL_RANKS,
};

/// Most statuses of one prefill rank that may wait for an earlier chunk of their (request,
/// rank): far more than a rank has in flight, a bound on what a peer can make this side hold.
pub const MAX_HELD_STATUSES: usize = 1024;

/// Most bounce slots per prefill rank.
pub const MAX_SLOTS: usize = 64;

/// What the side channel counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SideCounters {
    /// Frames refused as violations (each ended its connection).
    pub refused_frames: u64,
    /// Statuses dropped: of a request not being received from the rank, or of a chunk already
    /// taken (a duplicate).
    pub dropped_statuses: u64,
    /// Frees sent for slots of dropped statuses.
    pub freed_for_dropped: u64,
}

/// A status taken from a rank, or an entry that only waits for its scatter and frees its slot
/// (`status` `None`: a status dropped after its scatter was enqueued).
#[derive(Debug)]
struct Queued {
    status: Option<ChunkStatus>,
    event: Option<Event>,
    /// The slot to free once the scatter has run: (slot, request, chunk).
    slot: Option<(u32, u64, u32)>,
}

/// Where one rank stands in one request.
#[derive(Debug, Default)]
struct Progress {
    /// The next chunk to queue.
    next: u32,
    /// Statuses of later chunks, by chunk.
    held: BTreeMap<u32, Queued>,
    /// Its last status is queued (or the request failed for it here).
    done: bool,
}

/// What a status carried with it.
enum Landing {
    /// Nothing: the status alone.
    Plain,
    /// Blocks packed into a bounce slot (an unsharded request).
    Bounced(Bounced),
    /// A decode context-parallel rank's dense region in a bounce slot.
    Dense(WireDense),
}

impl Landing {
    fn slot(&self) -> Option<u32> {
        match self {
            Landing::Plain => None,
            Landing::Bounced(b) => Some(b.slot),
            Landing::Dense(d) => Some(d.slot),
        }
    }
}

/// One prefill rank as the decode sees it.
struct Rank {
    joined: bool,
    gone: Option<String>,
    reader: FrameReader,
    buffers: Vec<BounceBuffer>,
    /// The chunk each slot holds here, from its status until its free is sent.
    busy: Vec<Option<(u64, u32)>>,
    /// Statuses in the order they reach the Receiver.
    queue: VecDeque<Queued>,
    held: usize,
    outgoing: Vec<u8>,
}

/// The decode side of P/D on a transfer engine with a side channel (module docs).
pub struct MooncakeReceiver {
    pool: Arc<DevicePool>,
    backend: Arc<dyn Backend>,
    addresses: EngineAddresses,
    receiver: Receiver,
    ranks: Vec<Rank>,
    requests: HashMap<u64, Vec<Progress>>,
    /// The decode context-parallel requests, by request: this rank's share.
    shares: HashMap<u64, DenseShare>,
    /// Unpacks dense regions.
    dense: DenseBounce,
    finished: Vec<Finished>,
    counters: SideCounters,
}

impl std::fmt::Debug for MooncakeReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeReceiver")
            .field("ranks", &self.ranks.len())
            .field("requests", &self.requests.len())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl MooncakeReceiver {
    /// The decode side for `ranks` prefill ranks writing into `pool`: `slots` bounce buffers of
    /// `bounce_pages` pages per rank (none when either is 0) on `backend` (a stream of the
    /// pool's device, where the scatters run), addresses translated by `addresses`; requests
    /// are due `deadline` after registration unless they say otherwise.
    pub fn new(
        pool: Arc<DevicePool>,
        backend: Arc<dyn Backend>,
        addresses: EngineAddresses,
        ranks: u32,
        bounce_pages: u64,
        slots: usize,
        deadline: Duration,
    ) -> Result<Self> {
        if ranks == 0 || ranks > MAX_PREFILL_RANKS {
            return Err(Error::InvalidArgument(format!(
                "{ranks} prefill ranks (1 to {MAX_PREFILL_RANKS})"
            )));
        }
        if slots > MAX_SLOTS {
            return Err(Error::InvalidArgument(format!(
                "{slots} bounce slots per rank (at most {MAX_SLOTS})"
            )));
        }
        crate::backend::check_space(
            backend.address_space(),
            crate::copy::BlockSpace::address_space(pool.as_ref()),
            "the decode pool",
        )?;
        let slots = if bounce_pages == 0 { 0 } else { slots };
        let mut all = Vec::with_capacity(ranks as usize);
        for _ in 0..ranks {
            let buffers = (0..slots)
                .map(|_| BounceBuffer::new(backend.clone(), pool.geometry(), bounce_pages))
                .collect::<Result<Vec<_>>>()?;
            all.push(Rank {
                joined: false,
                gone: None,
                reader: FrameReader::new(),
                busy: vec![None; buffers.len()],
                buffers,
                queue: VecDeque::new(),
                held: 0,
                outgoing: Vec::new(),
            });
        }
        Ok(Self {
            pool,
            dense: DenseBounce::new(backend.clone()),
            backend,
            addresses,
            receiver: Receiver::with_deadline(deadline),
            ranks: all,
            requests: HashMap::new(),
            shares: HashMap::new(),
            finished: Vec::new(),
            counters: SideCounters::default(),
        })
    }

    /// Prefill ranks.
    pub fn ranks(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// The decode pool.
    pub fn pool(&self) -> &Arc<DevicePool> {
        &self.pool
    }

    /// The pool's shape, as a rank's `Hi` must state it.
    pub fn shape(&self) -> Vec<Shape> {
        frames::shape_of(self.pool.geometry())
    }

    /// The engine's `(address, bytes)` of `rank`'s bounce buffers, one per slot: register them
    /// once.
    pub fn bounce_regions(&self, rank: u32) -> Result<Vec<(u64, u64)>> {
        self.rank(rank)?
            .buffers
            .iter()
            .map(|b| {
                let len = b.buffer().len() as u64;
                Ok((self.addresses.address(b.buffer().addr(), len)?, len))
            })
            .collect()
    }

    fn rank(&self, rank: u32) -> Result<&Rank> {
        self.ranks.get(rank as usize).ok_or(Error::OutOfRange {
            what: "prefill rank",
            index: i64::from(rank),
            limit: self.ranks.len() as u64,
        })
    }

    /// Answers a connection's first frame: a `Hi` of a rank in range that has not joined, with
    /// the pool's shape, joins it and returns `(rank, Hello)` (`engine` is this side's engine
    /// address); anything else is `Err(Refused)`, the frame to send before closing.
    pub fn join(&mut self, hi: &Frame, engine: &str) -> std::result::Result<(u32, Frame), Frame> {
        let refused = |why: String| Frame::Refused { why };
        let Frame::Hi { rank, shape } = hi else {
            return Err(refused(format!("expected Hi, got {}", hi.name())));
        };
        if *shape != self.shape() {
            return Err(refused(format!(
                "rank {rank}: another cache shape ({shape:?}; this decode has {:?})",
                self.shape()
            )));
        }
        let Some(r) = self.ranks.get(*rank as usize) else {
            return Err(refused(format!(
                "rank {rank} of a group of {}",
                self.ranks.len()
            )));
        };
        if r.joined {
            return Err(refused(format!("rank {rank} has joined already")));
        }
        let (_, bases) = super::addresses::pool_memory(&self.pool, &self.addresses)
            .map_err(|e| refused(e.to_string()))?;
        let bounce = self
            .bounce_regions(*rank)
            .map_err(|e| refused(e.to_string()))?;
        self.ranks[*rank as usize].joined = true;
        let hello = Frame::Hello {
            engine: engine.to_string(),
            bases,
            pages: crate::copy::BlockSpace::pages(self.pool.as_ref()),
            bounce,
        };
        Ok((*rank, hello))
    }

    /// Starts receiving a request from every rank, due `deadline` from now (the receiver's
    /// otherwise); returns the `Register` frame to send every rank that has joined and is not
    /// gone. Refused, changing nothing, when the registration does not validate or a rank has
    /// not joined yet.
    pub fn register(
        &mut self,
        registration: Registration,
        deadline: Option<Duration>,
    ) -> Result<Vec<u8>> {
        let request = registration.request;
        self.check_joined(request)?;
        let frame = Frame::Register {
            request,
            prefix_pages: registration.prefix_pages as u64,
            pages: registration.pages.iter().map(|p| p.0).collect(),
            state_pages: registration.state_pages.iter().map(|p| p.0).collect(),
        };
        let bytes = frames::encode(&frame).map_err(|e| Error::Transfer {
            request,
            reason: format!("cannot be sent: {e}"),
        })?;
        self.receive(registration, deadline)?;
        Ok(bytes)
    }

    fn check_joined(&self, request: u64) -> Result<()> {
        match self
            .ranks
            .iter()
            .position(|r| !r.joined && r.gone.is_none())
        {
            Some(r) => Err(Error::Transfer {
                request,
                reason: format!("prefill rank {r} has not joined"),
            }),
            None => Ok(()),
        }
    }

    /// Registers `registration` with the receiver and expects a status from every rank.
    fn receive(&mut self, registration: Registration, deadline: Option<Duration>) -> Result<()> {
        let request = registration.request;
        let deadline = deadline.unwrap_or_else(|| self.receiver.deadline());
        self.receiver
            .register_with_deadline(registration, self.ranks(), deadline)?;
        let progress = (0..self.ranks.len()).map(|_| Progress::default()).collect();
        self.requests.insert(request, progress);
        Ok(())
    }

    /// Takes the next bytes from `rank`'s connection. A violation (module docs) is returned:
    /// the rank is gone from now on, and the caller closes the connection.
    pub fn feed(&mut self, rank: u32, bytes: &[u8]) -> Option<ProtocolError> {
        let r = self.ranks.get_mut(rank as usize)?;
        if r.gone.is_some() {
            return None;
        }
        let (frames, mut error) = r.reader.feed(bytes);
        for frame in frames {
            if let Err(e) = self.take(rank, frame) {
                error = Some(e);
                break;
            }
        }
        if let Some(e) = &error {
            self.counters.refused_frames += 1;
            self.rank_gone(rank, &format!("protocol violation: {e}"));
        }
        error
    }

    /// `rank`'s connection ended (or failed): every request it was sending fails once what it
    /// reported before has been taken.
    pub fn rank_gone(&mut self, rank: u32, why: &str) {
        let Some(r) = self.ranks.get_mut(rank as usize) else {
            return;
        };
        if r.gone.is_some() {
            return;
        }
        r.gone = Some(why.to_string());
        r.outgoing.clear();
        r.reader = FrameReader::new();
        let requests: Vec<u64> = self.requests.keys().copied().collect();
        for request in requests {
            self.discard_held(request, rank);
        }
    }

    /// Why `rank` is gone, once it is.
    pub fn gone(&self, rank: u32) -> Option<&str> {
        self.ranks.get(rank as usize)?.gone.as_deref()
    }

    /// What to send `rank` now (frees, aborts), taken.
    pub fn take_outgoing(&mut self, rank: u32) -> Vec<u8> {
        self.ranks
            .get_mut(rank as usize)
            .map(|r| std::mem::take(&mut r.outgoing))
            .unwrap_or_default()
    }

    fn send(&mut self, rank: u32, frame: &Frame) {
        let Some(r) = self.ranks.get_mut(rank as usize) else {
            return;
        };
        if r.gone.is_some() {
            return;
        }
        // The frames this side makes always encode (a free or an abort is a few bytes).
        if let Ok(bytes) = frames::encode(frame) {
            r.outgoing.extend(bytes);
        }
    }

    /// One frame from `rank`.
    fn take(&mut self, rank: u32, frame: Frame) -> std::result::Result<(), ProtocolError> {
        match frame {
            Frame::Status { status, bounced } => {
                let landing = bounced.map_or(Landing::Plain, Landing::Bounced);
                self.status(rank, status, landing)
            }
            Frame::DenseStatus { status, dense } => {
                self.status(rank, status, Landing::Dense(dense))
            }
            Frame::Aborted { request, held } => self.aborted(rank, request, &held),
            other => Err(ProtocolError::Unexpected {
                expected: "Status, DenseStatus or Aborted",
                got: other.name(),
            }),
        }
    }

    /// One status from `rank` (module docs: statuses).
    fn status(
        &mut self,
        rank: u32,
        status: ChunkStatus,
        landing: Landing,
    ) -> std::result::Result<(), ProtocolError> {
        let invalid = |why: String| ProtocolError::Invalid {
            message: "Status",
            why,
        };
        if status.rank != rank {
            return Err(invalid(format!(
                "rank {rank} reported a chunk of rank {}",
                status.rank
            )));
        }
        let (request, chunk) = (status.request, status.chunk);
        let slots = self.ranks[rank as usize].buffers.len();
        if let Some(slot) = landing.slot() {
            if slot as usize >= slots {
                return Err(invalid(format!(
                    "bounce slot {slot} of rank {rank}, which has {slots}"
                )));
            }
        }
        let busy = landing
            .slot()
            .and_then(|slot| self.ranks[rank as usize].busy[slot as usize]);
        let expected = self
            .requests
            .get(&request)
            .map(|p| &p[rank as usize])
            .filter(|p| !p.done)
            .map(|p| chunk >= p.next && !p.held.contains_key(&chunk));
        match expected {
            Some(true) => {}
            Some(false) => {
                // A chunk already taken: its slot was handled with the first copy.
                self.counters.dropped_statuses += 1;
                return Ok(());
            }
            None => {
                // Not being received from this rank: nothing will scatter its slot.
                self.counters.dropped_statuses += 1;
                if let (Some(slot), None) = (landing.slot(), busy) {
                    self.counters.freed_for_dropped += 1;
                    let free = Frame::Free {
                        slot,
                        request,
                        chunk,
                    };
                    self.send(rank, &free);
                }
                return Ok(());
            }
        }
        if let Some((r, c)) = busy {
            return Err(invalid(format!(
                "bounce slot {} holds chunk {c} of request {r} still",
                landing.slot().unwrap_or(0)
            )));
        }
        if self.ranks[rank as usize].held >= MAX_HELD_STATUSES {
            return Err(invalid(format!(
                "more than {MAX_HELD_STATUSES} statuses waiting for earlier chunks"
            )));
        }
        let sharded = self.shares.contains_key(&request);
        let event = match &landing {
            Landing::Plain if sharded && moved_rows(&status) => {
                return Err(invalid(format!(
                    "rows of request {request} announced without the region that carries them"
                )))
            }
            Landing::Plain => None,
            Landing::Bounced(_) if sharded => {
                return Err(invalid(format!(
                    "packed blocks for request {request}, which this decode rank receives sharded by token"
                )))
            }
            Landing::Bounced(b) => Some(self.scatter(rank, b).map_err(|e| {
                invalid(format!("bounce slot {} cannot be scattered: {e}", b.slot))
            })?),
            Landing::Dense(d) => Some(self.unpack(rank, request, d).map_err(|e| {
                invalid(format!("bounce slot {} cannot be unpacked: {e}", d.slot))
            })?),
        };
        let slot = landing.slot().map(|slot| {
            self.ranks[rank as usize].busy[slot as usize] = Some((request, chunk));
            (slot, request, chunk)
        });
        let queued = Queued {
            status: Some(status),
            event,
            slot,
        };
        self.hold(rank, request, chunk, queued);
        Ok(())
    }

    /// Enqueues the scatter of a bounced chunk of `rank` into the pool, after checking every
    /// section against the buffer and the pool.
    fn scatter(&mut self, rank: u32, b: &Bounced) -> Result<Event> {
        let sections = b
            .sections
            .iter()
            .map(|s| {
                Ok(PackedSection {
                    components: s
                        .components
                        .iter()
                        .map(|&c| {
                            component_of(c).ok_or_else(|| {
                                Error::InvalidArgument(format!("component code {c}"))
                            })
                        })
                        .collect::<Result<_>>()?,
                    pages: s.pages.iter().map(|&p| LocalPage(p)).collect(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let buffer = &mut self.ranks[rank as usize].buffers[b.slot as usize];
        buffer.scatter(&sections, &self.pool)
    }

    /// Holds a status of `rank` and queues, in chunk order, every held one whose turn came.
    fn hold(&mut self, rank: u32, request: u64, chunk: u32, queued: Queued) {
        let Some(progress) = self
            .requests
            .get_mut(&request)
            .and_then(|p| p.get_mut(rank as usize))
        else {
            return;
        };
        progress.held.insert(chunk, queued);
        let r = &mut self.ranks[rank as usize];
        r.held += 1;
        while !progress.done {
            let Some(next) = progress.held.remove(&progress.next) else {
                break;
            };
            r.held -= 1;
            progress.next += 1;
            progress.done = next.status.as_ref().is_some_and(ChunkStatus::is_terminal);
            r.queue.push_back(next);
        }
        if progress.done {
            // Chunks after the rank's last one: nothing to deliver, but their scatters write
            // the pool and their slots are freed once they have run.
            for (_, mut q) in std::mem::take(&mut progress.held) {
                r.held -= 1;
                self.counters.dropped_statuses += 1;
                q.status = None;
                r.queue.push_back(q);
            }
        }
    }

    /// Stops waiting for `rank`'s held statuses of `request`: they only wait for their
    /// scatters and free their slots.
    fn discard_held(&mut self, request: u64, rank: u32) {
        let Some(progress) = self
            .requests
            .get_mut(&request)
            .and_then(|p| p.get_mut(rank as usize))
        else {
            return;
        };
        let r = &mut self.ranks[rank as usize];
        for (_, mut q) in std::mem::take(&mut progress.held) {
            r.held -= 1;
            self.counters.dropped_statuses += 1;
            q.status = None;
            r.queue.push_back(q);
        }
    }

    /// `rank` gave `request` up: no status of it follows, nothing of it is in flight. The
    /// slots it still holds for the request that this side is not scattering are freed (their
    /// statuses never came).
    fn aborted(
        &mut self,
        rank: u32,
        request: u64,
        held: &[(u32, u32)],
    ) -> std::result::Result<(), ProtocolError> {
        let slots = self.ranks[rank as usize].busy.len();
        if let Some(&(slot, _)) = held.iter().find(|&&(s, _)| s as usize >= slots) {
            return Err(ProtocolError::Invalid {
                message: "Aborted",
                why: format!("bounce slot {slot} of rank {rank}, which has {slots}"),
            });
        }
        for &(slot, chunk) in held {
            if self.ranks[rank as usize].busy[slot as usize].is_none() {
                self.counters.freed_for_dropped += 1;
                let free = Frame::Free {
                    slot,
                    request,
                    chunk,
                };
                self.send(rank, &free);
            }
        }
        let Some(progress) = self
            .requests
            .get(&request)
            .and_then(|p| p.get(rank as usize))
        else {
            return Ok(());
        };
        if progress.done {
            return Ok(());
        }
        let chunk = progress.next;
        self.discard_held(request, rank);
        let failed = Queued {
            status: Some(ChunkStatus {
                request,
                rank,
                chunk,
                result: ChunkResult::Failed {
                    reason: format!("prefill rank {rank} aborted it"),
                },
            }),
            event: None,
            slot: None,
        };
        if let Some(p) = self
            .requests
            .get_mut(&request)
            .and_then(|p| p.get_mut(rank as usize))
        {
            p.done = true;
        }
        self.ranks[rank as usize].queue.push_back(failed);
        Ok(())
    }

    /// Takes every status whose scatter has run (freeing its slot), fails the requests of gone
    /// ranks once their queues are empty, and returns the requests that finished, each once.
    /// Never blocks.
    pub fn poll(&mut self) -> Result<Vec<Finished>> {
        for rank in 0..self.ranks.len() as u32 {
            loop {
                let r = &mut self.ranks[rank as usize];
                let ready = match r.queue.front() {
                    None => break,
                    Some(Queued { event: Some(e), .. }) => self.backend.is_done(e)?,
                    Some(_) => true,
                };
                if !ready {
                    break;
                }
                let Some(q) = r.queue.pop_front() else { break };
                if let Some((slot, request, chunk)) = q.slot {
                    r.busy[slot as usize] = None;
                    // Its scatter has run: the rank may pack into the slot again.
                    self.send(
                        rank,
                        &Frame::Free {
                            slot,
                            request,
                            chunk,
                        },
                    );
                }
                if let Some(status) = q.status {
                    self.deliver(status);
                }
            }
        }
        self.fail_gone();
        Ok(std::mem::take(&mut self.finished))
    }

    /// Fails, at the chunk each owes, every open request of each gone rank whose queue is
    /// empty (what it reported before it went has been taken).
    fn fail_gone(&mut self) {
        for rank in 0..self.ranks.len() as u32 {
            let r = &self.ranks[rank as usize];
            let Some(why) = r.gone.clone() else { continue };
            if !r.queue.is_empty() {
                continue;
            }
            let mut owed: Vec<(u64, u32)> = self
                .requests
                .iter()
                .filter_map(|(&request, p)| {
                    let p = &p[rank as usize];
                    (!p.done).then_some((request, p.next))
                })
                .collect();
            owed.sort_unstable();
            for (request, chunk) in owed {
                if let Some(p) = self
                    .requests
                    .get_mut(&request)
                    .and_then(|p| p.get_mut(rank as usize))
                {
                    p.done = true;
                }
                self.deliver(ChunkStatus {
                    request,
                    rank,
                    chunk,
                    result: ChunkResult::Failed {
                        reason: format!("prefill rank {rank} is gone: {why}"),
                    },
                });
            }
        }
    }

    fn deliver(&mut self, status: ChunkStatus) {
        let request = status.request;
        match self.receiver.receive(status) {
            Ok(Some(finished)) => {
                self.requests.remove(&request);
                self.shares.remove(&request);
                self.finished.push(finished);
            }
            Ok(None) => {}
            // Every status queued is the one the Receiver expects (chunk order per rank, one
            // last status each); one it refuses changes nothing there.
            Err(_) => self.counters.dropped_statuses += 1,
        }
    }

    /// Reports each request whose deadline passed before every rank's last status (once), and
    /// asks each rank that owes it to abort it ([`Frame::Abort`], in [`Self::take_outgoing`]).
    /// Never blocks.
    pub fn expire(&mut self) -> Vec<Overdue> {
        let overdue = self.receiver.expire();
        for o in &overdue {
            for m in &o.missing {
                let abort = Frame::Abort {
                    request: o.request,
                    reason: format!("the decode's deadline of {:?} passed", o.deadline),
                };
                self.send(m.rank, &abort);
            }
        }
        overdue
    }

    /// Requests registered and not yet handed back.
    pub fn pending_requests(&self) -> usize {
        self.receiver.pending_requests()
    }

    /// Bounce slots of `rank` held by a chunk not yet scattered and freed.
    pub fn busy_slots(&self, rank: u32) -> usize {
        self.ranks
            .get(rank as usize)
            .map_or(0, |r| r.busy.iter().filter(|b| b.is_some()).count())
    }

    /// What the side channel counted.
    pub fn counters(&self) -> SideCounters {
        self.counters
    }

    /// The receiver's default deadline.
    pub fn deadline(&self) -> Duration {
        self.receiver.deadline()
    }
}
