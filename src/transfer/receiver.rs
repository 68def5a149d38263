//! The decode side of P/D (docs/design.md, "P/D", step 4): the [`Receiver`] completes a
//! request only after one final status from each of the N ranks, so it never reads a page a
//! rank is still writing. A failed request is kept until every rank has reported its last
//! status (the other ranks may still be writing into its pages unless told to abort), then its
//! registration is handed back so the pages can be freed. A finished request leaves no state.
//!
//! Nothing hangs silently: every request has a deadline, counted from its registration
//! ([`DEFAULT_DEADLINE`], [`Receiver::with_deadline`], or per request
//! [`Receiver::register_with_deadline`]). [`Receiver::expire`] returns each request whose
//! deadline passed before every rank's last status as an [`Overdue`] (the
//! [`Error::TransferDeadline`] it converts into): the request, and per rank whose last status
//! never came, the chunks that did. A missing final chunk, a rank that went silent and a status
//! that was never delivered all end there. The request is then failed, but its pages stay held
//! until every rank has reported its last status: a rank that is only late may still be
//! writing them.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::plan::Registration;
use super::ComponentBytes;
use super::{ChunkResult, ChunkStatus};
use crate::error::{Error, Result};

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
