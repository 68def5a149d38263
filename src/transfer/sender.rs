//! The sending side of P/D (docs/design.md, "P/D", step 4): every prefill rank runs a
//! [`Sender`], which sends every chunk of a request in order, including chunks it owns nothing
//! of (an empty final chunk above all), and reports one [`ChunkStatus`] per chunk once the
//! chunk's bytes have landed. A failure on any rank (a plan that does not validate, a transport
//! error, an abort) is that rank's last status for the request.
//!
//! A [`PendingChunk`] dropped before its status was taken (by [`PendingChunk::poll`] or
//! [`PendingChunk::wait_sync`]) is reported by its [`Sender`]: the next [`Sender::send`] of the
//! request fails with [`Error::ChunkFailed`] naming the dropped chunk, and
//! [`Sender::take_dropped`] hands out its failed status (what the decode side must hear) for a
//! request that is sent no more.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use super::plan::{
    ChunkRange, DecodePlan, DecodeRegistration, PrefillRank, Registration, SendPlan,
};
use super::stats::TransferStats;
use super::transport::{Completion, Transport};
use super::ComponentBytes;
use crate::copy::{BlockSpace, RemoteSpace, ScatterRank};
use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::index::LogicalPage;
use crate::lock::lock;
use crate::pool::DevicePool;

use super::{ChunkResult, ChunkStatus};

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

/// Where a request's chunks go.
#[derive(Debug)]
enum Target {
    /// One unsharded decode pool.
    Unsharded {
        registration: Registration,
        dst: Arc<RemoteSpace>,
    },
    /// Every rank of a decode server sharded by token (docs/dcp.md), in rank order.
    Decode {
        registration: DecodeRegistration,
        /// The registration's pages as the copy layer takes them, made once.
        ranks: Arc<[ScatterRank]>,
        dsts: Vec<Arc<RemoteSpace>>,
    },
}

/// A request a sender is sending.
#[derive(Debug)]
struct Outgoing {
    target: Target,
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
    /// Bytes that reach each decode rank (one entry for an unsharded decode).
    decode_bytes: Vec<ComponentBytes>,
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

    /// The prefill rank sending it.
    pub fn rank(&self) -> u32 {
        self.rank
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
        self.status(self.bytes)
    }

    fn status(&self, bytes: ComponentBytes) -> ChunkStatus {
        ChunkStatus {
            request: self.request,
            rank: self.rank,
            chunk: self.chunk,
            result: ChunkResult::Sent {
                bytes,
                last: self.last,
            },
        }
    }

    /// The status as each decode rank receives it, in rank order.
    fn each(&self) -> Vec<ChunkStatus> {
        self.decode_bytes.iter().map(|&b| self.status(b)).collect()
    }

    /// Decode ranks the chunk is reported to: 1 for an unsharded decode pool, the layout's M
    /// for a decode server sharded by token ([`Sender::open_decode`]).
    pub fn decode_ranks(&self) -> usize {
        self.decode_bytes.len()
    }

    /// Bytes that reach each decode rank, per component, in rank order (one entry, the
    /// chunk's bytes, for an unsharded decode pool).
    pub fn decode_bytes(&self) -> &[ComponentBytes] {
        &self.decode_bytes
    }

    /// [`PendingChunk::poll`], with the status as each decode rank must receive it: one per
    /// decode rank, in rank order, each carrying the bytes that reached that rank (a decode
    /// rank that shares no token with the chunk gets its status all the same, with no bytes).
    /// A failure is the same for every decode rank ([`ChunkStatus::from_error`]).
    pub fn poll_each(&mut self) -> Result<Option<Vec<ChunkStatus>>> {
        Ok(self.poll()?.map(|_| self.each()))
    }

    /// [`PendingChunk::wait_sync`], with the status each decode rank must receive
    /// ([`PendingChunk::poll_each`]).
    pub fn wait_each_sync(mut self) -> Result<Vec<ChunkStatus>> {
        self.delivered = true;
        match self.completion.wait_sync() {
            Ok(()) => Ok(self.each()),
            Err(e) => Err(self.failed(e)),
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

    /// [`PendingChunk::poll`], a failure given as the failed status to deliver
    /// ([`ChunkStatus::from_error`] of its [`Error::ChunkFailed`]).
    pub(super) fn poll_status(&mut self) -> Option<ChunkStatus> {
        match self.completion.poll() {
            Ok(true) => {
                self.delivered = true;
                Some(self.sent())
            }
            Ok(false) => None,
            Err(e) => {
                self.delivered = true;
                Some(ChunkStatus {
                    result: ChunkResult::Failed {
                        reason: e.to_string(),
                    },
                    ..self.sent()
                })
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
        lock(&queue).push(Dropped {
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
                target: Target::Unsharded { registration, dst },
                next_chunk: 0,
                sent_until,
            },
        );
        Ok(())
    }

    /// Starts sending a request the ranks of a decode server sharded by token registered
    /// (docs/dcp.md), into `dsts`: the memory of each decode rank the registration describes, in
    /// rank order, as this process reaches it. Its first chunk starts after the decode's cached
    /// prefix; each chunk goes to every decode rank that owns one of its tokens, and its
    /// [`PendingChunk`] gives one status per decode rank ([`PendingChunk::poll_each`]).
    /// Refused, changing nothing, when the registration does not validate or does not describe
    /// `dsts`, or the request is open already.
    pub fn open_decode(
        &mut self,
        registration: DecodeRegistration,
        dsts: Vec<Arc<RemoteSpace>>,
    ) -> Result<()> {
        let request = registration.request;
        if self.requests.contains_key(&request) {
            return Err(Error::Transfer {
                request,
                reason: format!("already open on prefill rank {}", self.source.rank),
            });
        }
        registration.validate()?;
        if dsts.len() != registration.ranks.len() {
            return Err(Error::Transfer {
                request,
                reason: format!(
                    "{} decode ranks registered, {} destinations given",
                    registration.ranks.len(),
                    dsts.len()
                ),
            });
        }
        for (d, (rank, dst)) in registration.ranks.iter().zip(&dsts).enumerate() {
            if rank.layout.geometry != *dst.geometry() || rank.layout.pages != dst.pages() {
                return Err(Error::Transfer {
                    request,
                    reason: format!(
                        "decode rank {d} registered a pool of {} pages; its destination holds {}, or another geometry",
                        rank.layout.pages,
                        dst.pages()
                    ),
                });
            }
        }
        let sent_until = registration.prefix_tokens()?;
        let ranks = registration.scatter_ranks();
        self.requests.insert(
            request,
            Outgoing {
                target: Target::Decode {
                    registration,
                    ranks,
                    dsts,
                },
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
        // The registration was validated by `open` / `open_decode`, and nothing changes it
        // since. Each arm: the bytes per decode rank, the end of the pages sent, the completion.
        let submitted = match &out.target {
            Target::Unsharded { registration, dst } => {
                SendPlan::of_valid(&self.source, src_pages, registration, chunk).and_then(|plan| {
                    let completion = self.transport.submit(&plan, &self.pool, dst)?;
                    Ok((vec![plan.bytes()], plan.kv().positions().end, completion))
                })
            }
            Target::Decode {
                registration,
                ranks,
                dsts,
            } => DecodePlan::of_valid(&self.source, src_pages, registration, ranks.clone(), chunk)
                .and_then(|plan| {
                    let completion = self.transport.submit_decode(&plan, &self.pool, dsts)?;
                    Ok((
                        plan.rank_bytes().to_vec(),
                        plan.kv().positions().end,
                        completion,
                    ))
                }),
        };
        match submitted {
            Ok((decode_bytes, end_page, completion)) => {
                let mut bytes = ComponentBytes::default();
                for b in &decode_bytes {
                    bytes += *b;
                }
                self.sent += bytes;
                out.next_chunk += 1;
                out.sent_until = end_page * PAGE_SIZE;
                if last {
                    self.requests.remove(&request);
                }
                Ok(PendingChunk {
                    request,
                    rank,
                    chunk: chunk.index,
                    last,
                    bytes,
                    decode_bytes,
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
        lock(&self.dropped)
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
