//! Chunk sequencing and completion (docs/design.md, "P/D", step 4).
//!
//! Every prefill rank runs a [`Sender`]: it sends every chunk of a request in order, including
//! chunks it owns nothing of (an empty final chunk above all), and reports one [`ChunkStatus`]
//! per chunk once the chunk's bytes have landed. The decode side's [`Receiver`] completes a
//! request only after one final status from each of the N ranks, so it never reads a page a
//! rank is still writing.
//!
//! A failure on any rank (a plan that does not validate, a transport error, an abort) is that
//! rank's last status for the request: the request is failed on the sending rank at once and on
//! the decode side as soon as the status arrives. The decode side keeps a failed request until
//! every rank has reported its last status (the other ranks may still be writing into its pages,
//! unless told to [`Sender::abort`]), then hands its registration back so the pages can be
//! freed. A finished request leaves no state behind on either side.
//!
//! Nothing hangs silently:
//! - **Deadlines.** Every request the [`Receiver`] tracks has a deadline, counted from its
//!   registration ([`DEFAULT_DEADLINE`], or [`Receiver::with_deadline`], or per request
//!   [`Receiver::register_with_deadline`]). [`Receiver::expire`] returns each request whose
//!   deadline passed before every rank's last status as an [`Overdue`] (the
//!   [`Error::TransferDeadline`] it converts into): the request, and per rank whose last status
//!   never came, the chunks that did. A missing final chunk, a rank that went silent and a
//!   status that was never delivered all end there, within the deadline. The request is then
//!   failed, but its pages stay held until every rank has reported its last status (abort the
//!   ranks named; a rank that can write no more, its process gone, is answered for with a
//!   failed status at the chunk it owes): a rank that is only late may still be writing them.
//! - **Dropped chunks.** A [`PendingChunk`] dropped before its status was taken (by
//!   [`PendingChunk::poll`] or [`PendingChunk::wait_sync`]) is reported by its [`Sender`]: the
//!   next [`Sender::send`] of the request fails with [`Error::ChunkFailed`] naming the dropped
//!   chunk, and [`Sender::take_dropped`] hands out its failed status (what the decode side
//!   must hear) for a request that is sent no more. The engine delivers that status like any
//!   other failure; a status never delivered still ends at the decode side's deadline.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::plan::{ChunkRange, PrefillRank, Registration, SendPlan};
use super::stats::TransferStats;
use super::transport::{Completion, Transport};
use super::ComponentBytes;
use crate::copy::RemoteSpace;
use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::index::LogicalPage;
use crate::pool::DevicePool;

// Defined with the error type, which carries them (`Error::TransferDeadline`).
pub use crate::error::causes::{MissingChunks, Overdue};

/// Most prefill ranks one request may be sent by: a bound on what a registration makes the
/// decode side hold, far above any context-parallel group.
pub const MAX_PREFILL_RANKS: u32 = 4096;

/// How long the decode side waits for a request by default, from its registration to every
/// prefill rank's last status: SGLang's decode waits as long for a request's KV
/// (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s), long enough for a long prompt's chunked
/// prefill queued behind others, short enough that a lost request's pages come back.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(300);

/// Where a chunk ends: the tokens of the request prefilled so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkEnd {
    /// A chunk with more to come: only its whole pages are sent.
    Partial(usize),
    /// The request's final chunk: the rest of the sequence and the indexer state. A rank that
    /// owns none of the request's pages still sends it (an empty final chunk), so the decode
    /// side hears from every rank.
    Final(usize),
}

/// What happened to one chunk on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkResult {
    /// The chunk's bytes landed.
    Sent {
        /// Bytes this rank moved for the chunk, per component (zero when it owned nothing).
        bytes: ComponentBytes,
        /// Whether this was the request's final chunk.
        last: bool,
    },
    /// The chunk failed, and with it the request; the rank sends nothing more for it.
    Failed {
        /// Why (the error, as it travels over the wire).
        reason: String,
    },
}

/// One rank's report on one chunk of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkStatus {
    /// Request id.
    pub request: u64,
    /// The reporting prefill rank.
    pub rank: u32,
    /// Index of the chunk in the request's send order.
    pub chunk: u32,
    /// What happened.
    pub result: ChunkResult,
}

impl ChunkStatus {
    /// Whether this is the rank's last status for the request (final chunk sent, or failure).
    pub fn is_terminal(&self) -> bool {
        match self.result {
            ChunkResult::Sent { last, .. } => last,
            ChunkResult::Failed { .. } => true,
        }
    }

    /// The failed status an [`Error::ChunkFailed`] stands for (what the decode side must hear),
    /// or `None` for any other error.
    pub fn from_error(error: &Error) -> Option<ChunkStatus> {
        match error {
            Error::ChunkFailed {
                request,
                rank,
                chunk,
                reason,
            } => Some(ChunkStatus {
                request: *request,
                rank: *rank,
                chunk: *chunk,
                result: ChunkResult::Failed {
                    reason: reason.clone(),
                },
            }),
            _ => None,
        }
    }
}

impl fmt::Display for ChunkStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "request {} rank {} chunk {}: ",
            self.request, self.rank, self.chunk
        )?;
        match &self.result {
            ChunkResult::Sent { bytes, last } => {
                write!(f, "sent {bytes}{}", if *last { " (final)" } else { "" })
            }
            ChunkResult::Failed { reason } => write!(f, "failed: {reason}"),
        }
    }
}

/// A request a sender is sending.
#[derive(Debug)]
struct Outgoing {
    registration: Registration,
    dst: Arc<RemoteSpace>,
    next_chunk: u32,
    /// Tokens sent so far (page-aligned): where the next chunk starts.
    sent_until: usize,
}

/// A chunk dropped before its status was taken.
#[derive(Debug, Clone, Copy)]
struct Dropped {
    request: u64,
    chunk: u32,
}

/// The chunks dropped before their status was taken, in drop order, shared by a [`Sender`]
/// and its [`PendingChunk`]s.
type DroppedQueue = Mutex<Vec<Dropped>>;

/// A chunk on its way: poll it or wait for it. Its status goes to the decode side once it has
/// landed; a failure comes back as [`Error::ChunkFailed`], never as a status to overlook.
///
/// Dropped before its status was taken ([`Self::poll`] returning a status or an error,
/// [`Self::wait_sync`]), it is reported to its [`Sender`] (module docs: dropped chunks): the
/// decode side would otherwise wait for a status that never comes.
#[must_use = "a chunk's status must reach the decode side once it has landed"]
pub struct PendingChunk {
    request: u64,
    rank: u32,
    chunk: u32,
    last: bool,
    bytes: ComponentBytes,
    completion: Box<dyn Completion>,
    /// Whether the chunk's status (or its failure) was handed out.
    delivered: bool,
    /// Where a drop before then is reported (nowhere once the sender is gone).
    dropped: Weak<DroppedQueue>,
}

impl fmt::Debug for PendingChunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingChunk")
            .field("request", &self.request)
            .field("rank", &self.rank)
            .field("chunk", &self.chunk)
            .field("last", &self.last)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl PendingChunk {
    /// Request id.
    pub fn request(&self) -> u64 {
        self.request
    }

    /// Index of the chunk in the request's send order.
    pub fn chunk(&self) -> u32 {
        self.chunk
    }

    /// Whether this is the request's final chunk.
    pub fn is_last(&self) -> bool {
        self.last
    }

    /// Bytes the chunk moves, per component.
    pub fn bytes(&self) -> ComponentBytes {
        self.bytes
    }

    fn failed(&self, e: Error) -> Error {
        Error::ChunkFailed {
            request: self.request,
            rank: self.rank,
            chunk: self.chunk,
            reason: e.to_string(),
        }
    }

    fn sent(&self) -> ChunkStatus {
        ChunkStatus {
            request: self.request,
            rank: self.rank,
            chunk: self.chunk,
            result: ChunkResult::Sent {
                bytes: self.bytes,
                last: self.last,
            },
        }
    }

    /// The chunk's status once it has landed (`None` while it is still moving). Never blocks.
    pub fn poll(&mut self) -> Result<Option<ChunkStatus>> {
        match self.completion.poll() {
            Ok(true) => {
                self.delivered = true;
                Ok(Some(self.sent()))
            }
            Ok(false) => Ok(None),
            Err(e) => {
                self.delivered = true;
                Err(self.failed(e))
            }
        }
    }

    /// Blocks the host until the chunk has landed ([`Completion::wait_sync`]) and returns its
    /// status.
    pub fn wait_sync(mut self) -> Result<ChunkStatus> {
        self.delivered = true;
        match self.completion.wait_sync() {
            Ok(()) => Ok(self.sent()),
            Err(e) => Err(self.failed(e)),
        }
    }

    /// The status the chunk will have once it has landed, handed out now: for a transport that
    /// reports a chunk ahead of its copy, covered by an event the decode side waits for
    /// (`PrefillEndpoint` on a GPU). Keep the chunk and poll it to see a failure in flight.
    pub(crate) fn reported(&mut self) -> ChunkStatus {
        self.delivered = true;
        self.sent()
    }
}

impl Drop for PendingChunk {
    fn drop(&mut self) {
        if self.delivered {
            return;
        }
        let Some(queue) = self.dropped.upgrade() else {
            return;
        };
        queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Dropped {
                request: self.request,
                chunk: self.chunk,
            });
    }
}

/// The sending side of one prefill rank: plans and enqueues every chunk of its requests from
/// its pool through its transport. It holds the pool and the transport, so an engine keeps one
/// per rank with no lifetimes attached.
pub struct Sender {
    pool: Arc<DevicePool>,
    source: PrefillRank,
    transport: Box<dyn Transport>,
    requests: HashMap<u64, Outgoing>,
    sent: ComponentBytes,
    /// Chunks dropped before their status was taken, reported by their [`PendingChunk`]s.
    dropped: Arc<DroppedQueue>,
}

impl fmt::Debug for Sender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender")
            .field("rank", &self.source.rank)
            .field("requests", &self.requests.len())
            .field("sent", &self.sent)
            .finish_non_exhaustive()
    }
}

impl Sender {
    /// The sender of the rank `pool` belongs to, moving chunks with `transport`.
    pub fn new(pool: Arc<DevicePool>, transport: Box<dyn Transport>) -> Self {
        Self {
            source: PrefillRank::of(&pool),
            pool,
            transport,
            requests: HashMap::new(),
            sent: ComponentBytes::default(),
            dropped: Arc::default(),
        }
    }

    /// This sender's rank.
    pub fn rank(&self) -> u32 {
        self.source.rank
    }

    /// Starts sending a request the decode side registered, into `dst` (the memory that
    /// registration describes, as this process reaches it). Its first chunk starts after the
    /// decode's cached prefix. Refused, changing nothing, when the registration does not
    /// validate or does not describe `dst`.
    pub fn open(&mut self, registration: Registration, dst: Arc<RemoteSpace>) -> Result<()> {
        let request = registration.request;
        if self.requests.contains_key(&request) {
            return Err(Error::Transfer {
                request,
                reason: format!("already open on prefill rank {}", self.source.rank),
            });
        }
        registration.validate()?;
        let described = registration.layout.geometry == *dst.geometry()
            && registration.layout.pages == crate::copy::BlockSpace::pages(dst.as_ref());
        if !described {
            return Err(Error::Transfer {
                request,
                reason: format!(
                    "the registration describes a decode pool of {} pages; the destination holds {}, or another geometry",
                    registration.layout.pages,
                    crate::copy::BlockSpace::pages(dst.as_ref())
                ),
            });
        }
        let sent_until = registration.prefix_tokens()?;
        self.requests.insert(
            request,
            Outgoing {
                registration,
                dst,
                next_chunk: 0,
                sent_until,
            },
        );
        Ok(())
    }

    /// Enqueues the next chunk of `request` and returns it pending: nothing waits. `src_pages`
    /// is the request's logical page of every sequence position prefilled so far.
    ///
    /// A chunk that cannot be planned or enqueued fails the request on this rank (it is
    /// closed here) and comes back as [`Error::ChunkFailed`]; a failure while the chunk moves
    /// comes back the same way from [`PendingChunk::poll`] / [`PendingChunk::wait_sync`], and the
    /// engine then [`Sender::close`]s the request. Either way, deliver
    /// [`ChunkStatus::from_error`] to the decode side: it is the rank's last status. So is a
    /// chunk of the request dropped before its status was taken: the request is closed and this
    /// call fails with the dropped chunk's [`Error::ChunkFailed`]. A request that is not open is
    /// an [`Error::Transfer`].
    pub fn send(
        &mut self,
        request: u64,
        src_pages: &[LogicalPage],
        end: ChunkEnd,
    ) -> Result<PendingChunk> {
        let rank = self.source.rank;
        if let Some(chunk) = self.dropped_of(request) {
            self.requests.remove(&request);
            return Err(Error::ChunkFailed {
                request,
                rank,
                chunk,
                reason: dropped_reason(chunk, rank),
            });
        }
        let Some(out) = self.requests.get_mut(&request) else {
            return Err(Error::Transfer {
                request,
                reason: format!(
                    "not open on prefill rank {rank} (never opened, or already finished)"
                ),
            });
        };
        let (end, last) = match end {
            ChunkEnd::Partial(t) => (t, false),
            ChunkEnd::Final(t) => (t, true),
        };
        let chunk = ChunkRange {
            index: out.next_chunk,
            start: out.sent_until,
            end,
            last,
        };
        // The registration was validated by `open`, and nothing changes it since.
        let submitted = SendPlan::of_valid(&self.source, src_pages, &out.registration, chunk)
            .and_then(|plan| {
                let completion = self.transport.submit(&plan, &self.pool, &out.dst)?;
                Ok((plan, completion))
            });
        match submitted {
            Ok((plan, completion)) => {
                let bytes = plan.bytes();
                self.sent += bytes;
                out.next_chunk += 1;
                out.sent_until = plan.kv().positions().end * PAGE_SIZE;
                if last {
                    self.requests.remove(&request);
                }
                Ok(PendingChunk {
                    request,
                    rank,
                    chunk: chunk.index,
                    last,
                    bytes,
                    completion,
                    delivered: false,
                    dropped: Arc::downgrade(&self.dropped),
                })
            }
            Err(e) => {
                self.requests.remove(&request);
                Err(Error::ChunkFailed {
                    request,
                    rank,
                    chunk: chunk.index,
                    reason: e.to_string(),
                })
            }
        }
    }

    /// Gives up on `request` on this rank (the decode side failed it, a chunk failed while
    /// moving, or the prefill was cancelled): the returned failed status is the rank's last
    /// for the request. When a chunk of it was dropped before its status was taken, that
    /// chunk's failure is the status (the decode side expects no later chunk).
    pub fn abort(&mut self, request: u64, reason: &str) -> Result<ChunkStatus> {
        let open = self.requests.remove(&request);
        if let Some(chunk) = self.dropped_of(request) {
            return Ok(self.dropped_status(request, chunk));
        }
        let Some(out) = open else {
            return Err(Error::Transfer {
                request,
                reason: format!(
                    "cannot abort: not open on prefill rank {}",
                    self.source.rank
                ),
            });
        };
        Ok(ChunkStatus {
            request,
            rank: self.source.rank,
            chunk: out.next_chunk,
            result: ChunkResult::Failed {
                reason: format!("aborted: {reason}"),
            },
        })
    }

    /// Closes `request` on this rank without a status of its own: after one of its chunks
    /// failed while moving, the failure ([`ChunkStatus::from_error`]) already is the rank's last
    /// status for the request, and the decode side takes no other (a chunk of it dropped since
    /// is forgotten with it).
    pub fn close(&mut self, request: u64) -> Result<()> {
        let dropped = self.dropped_of(request).is_some();
        match self.requests.remove(&request) {
            Some(_) => Ok(()),
            None if dropped => Ok(()),
            None => Err(Error::Transfer {
                request,
                reason: format!(
                    "cannot close: not open on prefill rank {}",
                    self.source.rank
                ),
            }),
        }
    }

    /// The failed statuses of chunks dropped before their status was taken, one per request
    /// (its earliest dropped chunk), in the order they were dropped; each is handed out once,
    /// here or by [`Sender::send`] / [`Sender::abort`]. Deliver each to the decode side: it is
    /// the rank's last status for its request, which is closed here. Call it regularly (every
    /// scheduling step): a dropped final chunk is reported nowhere else.
    pub fn take_dropped(&mut self) -> Vec<ChunkStatus> {
        let dropped = std::mem::take(&mut *self.lock_dropped());
        let mut earliest: Vec<Dropped> = Vec::new();
        for d in dropped {
            match earliest.iter_mut().find(|e| e.request == d.request) {
                Some(e) => e.chunk = e.chunk.min(d.chunk),
                None => earliest.push(d),
            }
        }
        earliest
            .into_iter()
            .map(|d| {
                self.requests.remove(&d.request);
                self.dropped_status(d.request, d.chunk)
            })
            .collect()
    }

    fn lock_dropped(&self) -> std::sync::MutexGuard<'_, Vec<Dropped>> {
        self.dropped.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes every dropped chunk of `request` from the queue; returns the earliest.
    fn dropped_of(&mut self, request: u64) -> Option<u32> {
        let mut earliest: Option<u32> = None;
        self.lock_dropped().retain(|d| {
            if d.request != request {
                return true;
            }
            earliest = Some(earliest.map_or(d.chunk, |e| e.min(d.chunk)));
            false
        });
        earliest
    }

    /// The failed status of dropped chunk `chunk` of `request`.
    fn dropped_status(&self, request: u64, chunk: u32) -> ChunkStatus {
        ChunkStatus {
            request,
            rank: self.source.rank,
            chunk,
            result: ChunkResult::Failed {
                reason: dropped_reason(chunk, self.source.rank),
            },
        }
    }

    /// Requests open on this rank (neither finished nor failed).
    pub fn pending_requests(&self) -> usize {
        self.requests.len()
    }

    /// Physical bytes this rank has enqueued, per component, over all requests.
    pub fn bytes_sent(&self) -> ComponentBytes {
        self.sent
    }

    /// The transport's counters ([`Transport::stats`]), when it keeps them.
    pub fn stats(&self) -> Option<TransferStats> {
        self.transport.stats()
    }
}

/// Why a dropped chunk failed its request.
fn dropped_reason(chunk: u32, rank: u32) -> String {
    format!(
        "chunk {chunk} was dropped on prefill rank {rank} before its status was taken, so the decode side never heard of it"
    )
}

/// A rank's failure of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// The prefill rank.
    pub rank: u32,
    /// The chunk that failed.
    pub chunk: u32,
    /// Why.
    pub reason: String,
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank sent every chunk: the decode pool holds the request's cache.
    Completed,
    /// At least one rank failed; the pages hold nothing usable.
    Failed(Vec<RankFailure>),
}

/// A request the decode side is done with: every prefill rank has reported its last status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// The registration, handed back: on completion its pages now hold the request's cache;
    /// on failure they are the decode side's to free (no rank writes to them any more).
    pub registration: Registration,
    /// Physical bytes each prefill rank moved, per component.
    pub bytes: Vec<ComponentBytes>,
    /// How it ended.
    pub outcome: Outcome,
}

impl Finished {
    /// Request id.
    pub fn request(&self) -> u64 {
        self.registration.request
    }

    /// Whether the request completed.
    pub fn is_completed(&self) -> bool {
        self.outcome == Outcome::Completed
    }

    /// Bytes of all ranks together, per component.
    pub fn total_bytes(&self) -> ComponentBytes {
        let mut total = ComponentBytes::default();
        for b in &self.bytes {
            total += *b;
        }
        total
    }
}

/// Where a request the decode side is receiving stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Prefill ranks sending it.
    pub ranks: u32,
    /// Ranks that have reported their last status.
    pub ranks_done: u32,
    /// Whether some rank failed it, or its deadline passed (it then only waits for the others'
    /// last statuses).
    pub failed: bool,
    /// Whether its deadline passed ([`Receiver::expire`] reported it).
    pub overdue: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct RankProgress {
    next_chunk: u32,
    done: bool,
    bytes: ComponentBytes,
}

#[derive(Debug)]
struct Incoming {
    registration: Registration,
    ranks: Vec<RankProgress>,
    failures: Vec<RankFailure>,
    deadline: Duration,
    /// When the deadline passes (`None`: never, a deadline too long for the clock).
    due: Option<Instant>,
    /// Whether [`Receiver::expire`] has reported it.
    overdue: bool,
}

/// The decode side: tracks the chunk statuses of every registered request, each within its
/// deadline (module docs).
#[derive(Debug)]
pub struct Receiver {
    requests: HashMap<u64, Incoming>,
    deadline: Duration,
}

impl Default for Receiver {
    fn default() -> Self {
        Self::with_deadline(DEFAULT_DEADLINE)
    }
}

impl Receiver {
    /// A receiver tracking nothing, its requests due [`DEFAULT_DEADLINE`] after registration.
    pub fn new() -> Self {
        Self::default()
    }

    /// A receiver tracking nothing, its requests due `deadline` after registration.
    pub fn with_deadline(deadline: Duration) -> Self {
        Self {
            requests: HashMap::new(),
            deadline,
        }
    }

    /// The deadline of requests registered without one of their own.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Sets the deadline of requests registered from now on without one of their own.
    pub fn set_deadline(&mut self, deadline: Duration) {
        self.deadline = deadline;
    }

    /// Starts tracking a request sent by `prefill_ranks` ranks (the prefill group's N, at most
    /// [`MAX_PREFILL_RANKS`]), due [`Receiver::deadline`] from now. The registration is
    /// validated first.
    pub fn register(&mut self, registration: Registration, prefill_ranks: u32) -> Result<()> {
        self.register_with_deadline(registration, prefill_ranks, self.deadline)
    }

    /// [`Receiver::register`], the request due `deadline` from now.
    pub fn register_with_deadline(
        &mut self,
        registration: Registration,
        prefill_ranks: u32,
        deadline: Duration,
    ) -> Result<()> {
        let request = registration.request;
        if prefill_ranks == 0 || prefill_ranks > MAX_PREFILL_RANKS {
            return Err(Error::Transfer {
                request,
                reason: format!(
                    "{prefill_ranks} prefill ranks (a request needs 1 to {MAX_PREFILL_RANKS})"
                ),
            });
        }
        registration.validate()?;
        if self.requests.contains_key(&request) {
            return Err(Error::Transfer {
                request,
                reason: "already registered on the decode side".into(),
            });
        }
        self.requests.insert(
            request,
            Incoming {
                registration,
                ranks: vec![RankProgress::default(); prefill_ranks as usize],
                failures: Vec::new(),
                deadline,
                due: Instant::now().checked_add(deadline),
                overdue: false,
            },
        );
        Ok(())
    }

    /// Fails every request whose deadline has passed before every rank reported its last
    /// status, and returns each once, in request order, naming the ranks whose last status
    /// never came and the chunks that did. Call it regularly (what the waits of the endpoints
    /// do). Never blocks.
    ///
    /// An overdue request is failed (each missing rank's failure is recorded at the chunk it
    /// owes) but still tracked: a rank that is only late may still write its pages, so they are
    /// handed back ([`Finished`], failed) once every rank has reported its last status. Tell
    /// the ranks named to abort it; for a rank that can write no more (its process is gone),
    /// [`Receiver::receive`] a failed status at the chunk it owes (`received`).
    pub fn expire(&mut self) -> Vec<Overdue> {
        let now = Instant::now();
        let mut overdue: Vec<Overdue> = Vec::new();
        for (&request, incoming) in &mut self.requests {
            if incoming.overdue || incoming.due.is_none_or(|due| now < due) {
                continue;
            }
            incoming.overdue = true;
            let missing: Vec<MissingChunks> = (0u32..)
                .zip(&incoming.ranks)
                .filter(|(_, p)| !p.done)
                .map(|(rank, p)| MissingChunks {
                    rank,
                    received: p.next_chunk,
                })
                .collect();
            for m in &missing {
                incoming.failures.push(RankFailure {
                    rank: m.rank,
                    chunk: m.received,
                    reason: format!(
                        "no last status within the request's deadline of {:?}",
                        incoming.deadline
                    ),
                });
            }
            overdue.push(Overdue {
                request,
                deadline: incoming.deadline,
                ranks: incoming.ranks.len() as u32,
                missing,
            });
        }
        overdue.sort_unstable_by_key(|o| o.request);
        overdue
    }

    /// Takes one status. Returns the finished request once every rank has reported its last
    /// status. A status for an unknown request, from a rank outside the group, for a chunk
    /// other than the rank's next one, or after the rank's last status is an error and changes
    /// nothing.
    pub fn receive(&mut self, status: ChunkStatus) -> Result<Option<Finished>> {
        let request = status.request;
        let fail = |reason: String| Err(Error::Transfer { request, reason });
        let (rank, chunk) = (status.rank, status.chunk);
        let Some(incoming) = self.requests.get_mut(&request) else {
            return fail(format!(
                "status of chunk {chunk} from prefill rank {rank}: not registered on the decode side (unknown, or already finished)"
            ));
        };
        let ranks = incoming.ranks.len();
        let Some(progress) = incoming.ranks.get_mut(rank as usize) else {
            return fail(format!(
                "status from prefill rank {rank}, but {ranks} ranks send the request"
            ));
        };
        if progress.done {
            return fail(format!(
                "status of chunk {chunk} from prefill rank {rank} after its last status"
            ));
        }
        let expected = progress.next_chunk;
        if chunk < expected {
            return fail(format!(
                "duplicate status of chunk {chunk} from prefill rank {rank} (chunk {expected} expected)"
            ));
        }
        if chunk > expected {
            return fail(format!(
                "out-of-order status of chunk {chunk} from prefill rank {rank} (chunk {expected} expected)"
            ));
        }
        match status.result {
            ChunkResult::Sent { bytes, last } => {
                progress.bytes += bytes;
                progress.next_chunk += 1;
                progress.done = last;
            }
            ChunkResult::Failed { reason } => {
                progress.done = true;
                incoming.failures.push(RankFailure {
                    rank,
                    chunk,
                    reason,
                });
            }
        }
        if !incoming.ranks.iter().all(|p| p.done) {
            return Ok(None);
        }
        let Some(done) = self.requests.remove(&request) else {
            return Ok(None);
        };
        let outcome = if done.failures.is_empty() {
            Outcome::Completed
        } else {
            Outcome::Failed(done.failures)
        };
        Ok(Some(Finished {
            registration: done.registration,
            bytes: done.ranks.iter().map(|p| p.bytes).collect(),
            outcome,
        }))
    }

    /// Where `request` stands, while it is registered.
    pub fn progress(&self, request: u64) -> Option<Progress> {
        self.requests.get(&request).map(|i| Progress {
            ranks: i.ranks.len() as u32,
            ranks_done: i.ranks.iter().filter(|p| p.done).count() as u32,
            failed: !i.failures.is_empty(),
            overdue: i.overdue,
        })
    }

    /// Requests registered and not finished.
    pub fn pending_requests(&self) -> usize {
        self.requests.len()
    }
}
