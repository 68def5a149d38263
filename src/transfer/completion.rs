//! Chunk sequencing and completion (DOMAIN.md section 5, step 5).
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

use std::collections::HashMap;
use std::fmt;

use super::exec::{DescriptorBatch, Transport};
use super::plan::{ChunkRange, PrefillRank, Registration, SendPlan};
use super::ComponentBytes;
use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::pool::{BlockSpace, DevicePool};

/// Where a chunk ends: the tokens of the request prefilled so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkEnd {
    /// A chunk with more to come: only its whole pages are sent.
    Partial(usize),
    /// The request's final chunk: the rest of the sequence and the indexer state.
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
    next_chunk: u32,
    /// Tokens sent so far (page-aligned): where the next chunk starts.
    sent_until: usize,
}

/// The sending side of one prefill rank: plans, resolves and moves every chunk of its requests
/// from its pool, and reports each chunk.
#[derive(Debug)]
pub struct Sender<'a> {
    pool: &'a DevicePool,
    source: PrefillRank,
    requests: HashMap<u64, Outgoing>,
    sent: ComponentBytes,
}

impl<'a> Sender<'a> {
    /// The sender of the rank `pool` belongs to.
    pub fn new(pool: &'a DevicePool) -> Self {
        Self {
            pool,
            source: PrefillRank::of(pool),
            requests: HashMap::new(),
            sent: ComponentBytes::default(),
        }
    }

    /// This sender's rank.
    pub fn rank(&self) -> u32 {
        self.source.rank
    }

    /// Starts sending a request the decode side registered. Its first chunk starts after the
    /// decode's cached prefix.
    pub fn open(&mut self, registration: Registration) -> Result<()> {
        let request = registration.request;
        if self.requests.contains_key(&request) {
            return Err(Error::Transfer {
                request,
                reason: format!("already open on prefill rank {}", self.source.rank),
            });
        }
        let sent_until = registration.prefix_pages * PAGE_SIZE;
        self.requests.insert(
            request,
            Outgoing {
                registration,
                next_chunk: 0,
                sent_until,
            },
        );
        Ok(())
    }

    /// Sends the next chunk of `request` through `transport` into `dst` (the decode pool, or
    /// the description of its registered memory), and waits for it to land. `src_pages` is the
    /// request's logical page of every sequence position prefilled so far.
    ///
    /// Returns the chunk's status, to be delivered to the decode side. A chunk that fails
    /// (validation, transport) yields a failed status and closes the request on this rank;
    /// an `Err` means no chunk was sent: the request is not open here.
    pub fn send(
        &mut self,
        transport: &mut dyn Transport,
        dst: &dyn BlockSpace,
        request: u64,
        src_pages: &[u64],
        end: ChunkEnd,
    ) -> Result<ChunkStatus> {
        let rank = self.source.rank;
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
        let moved = move_chunk(
            self.pool,
            &self.source,
            transport,
            dst,
            &out.registration,
            src_pages,
            chunk,
        );
        let result = match moved {
            Ok((bytes, sent_pages)) => {
                self.sent += bytes;
                out.next_chunk += 1;
                out.sent_until = sent_pages * PAGE_SIZE;
                ChunkResult::Sent { bytes, last }
            }
            Err(e) => ChunkResult::Failed {
                reason: e.to_string(),
            },
        };
        let status = ChunkStatus {
            request,
            rank,
            chunk: chunk.index,
            result,
        };
        if status.is_terminal() {
            self.requests.remove(&request);
        }
        Ok(status)
    }

    /// Gives up on `request` on this rank (the decode side failed it, or the prefill was
    /// cancelled): the returned failed status is the rank's last for the request.
    pub fn abort(&mut self, request: u64, reason: &str) -> Result<ChunkStatus> {
        let Some(out) = self.requests.remove(&request) else {
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

    /// Requests open on this rank (neither finished nor failed).
    pub fn pending_requests(&self) -> usize {
        self.requests.len()
    }

    /// Physical bytes this rank has moved, per component, over all requests.
    pub fn bytes_sent(&self) -> ComponentBytes {
        self.sent
    }
}

/// Plans, resolves and moves one chunk; returns its bytes and the pages sent so far.
fn move_chunk(
    pool: &DevicePool,
    source: &PrefillRank,
    transport: &mut dyn Transport,
    dst: &dyn BlockSpace,
    registration: &Registration,
    src_pages: &[u64],
    chunk: ChunkRange,
) -> Result<(ComponentBytes, usize)> {
    let plan = SendPlan::new(source, src_pages, registration, chunk)?;
    let batch = DescriptorBatch::resolve(&plan, pool, dst)?;
    let submitted = transport.submit(&batch);
    // Even after a failed submission, whatever was enqueued must land before the status goes
    // out: the decode side frees the pages once every rank has reported its last status.
    let landed = transport.wait();
    submitted?;
    landed?;
    Ok((batch.bytes(), plan.kv.positions.end))
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
    /// Whether some rank failed it (it then only waits for the others' last statuses).
    pub failed: bool,
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
}

/// The decode side: tracks the chunk statuses of every registered request.
#[derive(Debug, Default)]
pub struct Receiver {
    requests: HashMap<u64, Incoming>,
}

impl Receiver {
    /// A receiver tracking nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts tracking a request sent by `prefill_ranks` ranks (the prefill group's N).
    pub fn register(&mut self, registration: Registration, prefill_ranks: u32) -> Result<()> {
        let request = registration.request;
        if prefill_ranks == 0 {
            return Err(Error::Transfer {
                request,
                reason: "a request needs at least one prefill rank".into(),
            });
        }
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
            },
        );
        Ok(())
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
        })
    }

    /// Requests registered and not finished.
    pub fn pending_requests(&self) -> usize {
        self.requests.len()
    }
}
