//! The decode side of P/D (docs/design.md, "P/D", step 4): the [`Receiver`] completes a
//! request only after one final status from each of the N ranks, so it never reads a page a
//! rank is still writing. A failed request is kept until every rank has reported its last
//! status (the other ranks may still be writing into its pages unless told to abort), then its
//! registration is handed back so the pages can be freed. A finished request leaves no state.
//!
//! A rank's statuses are taken as they come, in any order across its chunks (an engine polls
//! its pending chunks in any order, and the ones that land first report first): a status ahead
//! of the rank's next chunk is held until the chunks before it have arrived (at most
//! [`MAX_CHUNKS_AHEAD`] ahead), so a rank is done only once every chunk up to its final one, or
//! up to its failed one, has been reported, and never while an earlier chunk may still write.
//! A duplicate, a status after the rank's last, or a chunk past its final one is refused with
//! the reason, changing nothing.
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

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use super::plan::Registration;
use super::ComponentBytes;
use super::{ChunkResult, ChunkStatus};
use crate::error::{Error, Result};

// Defined with the error type, which carries them (`Error::TransferDeadline`).
pub use crate::error::causes::{MissingChunks, Overdue};

/// Most chunks a rank's status may run ahead of the rank's next expected chunk (held until
/// those before it arrive): a bound on what one rank makes the decode side hold.
pub const MAX_CHUNKS_AHEAD: u32 = 1024;

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

/// What one [`Receiver::step`] found.
#[derive(Debug, Default)]
pub struct ReceiveStep {
    /// Requests every rank has reported its last status for, in the order they finished.
    pub finished: Vec<Finished>,
    /// Requests whose deadline passed first ([`Receiver::expire`]): abort them on the ranks
    /// named.
    pub overdue: Vec<Overdue>,
    /// Statuses refused, each with why ([`Receiver::receive`]'s errors); they changed nothing.
    pub refused: Vec<Error>,
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

#[derive(Debug, Default, Clone)]
struct RankProgress {
    /// The next chunk in order: every chunk before it has been taken.
    next_chunk: u32,
    done: bool,
    bytes: ComponentBytes,
    /// Sent statuses ahead of `next_chunk`, by chunk: (bytes, whether it is the final chunk).
    held: BTreeMap<u32, (ComponentBytes, bool)>,
    /// A failed status ahead of `next_chunk`: (chunk, reason), the rank's last once the chunks
    /// before it have arrived.
    failure: Option<(u32, String)>,
}

impl RankProgress {
    /// Why this rank's status of `chunk` cannot be taken now, if it cannot; `kind` is what
    /// the status says: `Some(last)` a chunk sent (`last`: the final one), `None` a failure.
    fn refusal(&self, rank: u32, chunk: u32, kind: Option<bool>) -> Option<String> {
        let expected = self.next_chunk;
        if self.done {
            return Some(format!(
                "status of chunk {chunk} from prefill rank {rank} after its last status"
            ));
        }
        let failed_at = self.failure.as_ref().map(|(c, _)| *c);
        if chunk < expected || self.held.contains_key(&chunk) || failed_at == Some(chunk) {
            return Some(format!(
                "duplicate status of chunk {chunk} from prefill rank {rank} (chunk {expected} expected next)"
            ));
        }
        if chunk - expected > MAX_CHUNKS_AHEAD {
            return Some(format!(
                "status of chunk {chunk} from prefill rank {rank}, more than {MAX_CHUNKS_AHEAD} chunks ahead of chunk {expected}"
            ));
        }
        let final_chunk = self.held.iter().find(|(_, (_, l))| *l).map(|(c, _)| *c);
        if let Some(end) = final_chunk.filter(|&end| chunk > end) {
            return Some(format!(
                "status of chunk {chunk} from prefill rank {rank} past its final chunk {end}"
            ));
        }
        match kind {
            None => failed_at.map(|f| {
                format!("a second failed status (chunk {chunk}) from prefill rank {rank}, after chunk {f}'s")
            }),
            Some(true) => {
                if let Some(end) = final_chunk {
                    return Some(format!(
                        "a second final status (chunk {chunk}) from prefill rank {rank}, whose final chunk is {end}"
                    ));
                }
                self.held.range(chunk + 1..).next().map(|(after, _)| {
                    format!("final status of chunk {chunk} from prefill rank {rank}, after its chunk {after}")
                })
            }
            Some(false) => None,
        }
    }

    /// Takes the held statuses that are next in order; returns whether the rank is done, and
    /// its failure when that is how it ended.
    fn advance(&mut self) -> Option<RankFailure> {
        while let Some((bytes, last)) = self.held.remove(&self.next_chunk) {
            self.bytes += bytes;
            self.next_chunk += 1;
            if last {
                self.done = true;
                return None;
            }
        }
        match self.failure.take() {
            Some((chunk, reason)) if chunk == self.next_chunk => {
                self.done = true;
                // Held statuses past the failed chunk landed; the failure is the rank's last.
                self.held.clear();
                Some((chunk, reason))
            }
            held => {
                self.failure = held;
                None
            }
        }
        .map(|(chunk, reason)| RankFailure {
            rank: u32::MAX,
            chunk,
            reason,
        })
    }
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

    /// Takes one status, in any order across the rank's chunks (module docs). Returns the
    /// finished request once every rank has reported its last status and every chunk before
    /// it. A status for an unknown request, from a rank outside the group, a duplicate, one
    /// after the rank's last status or past its final chunk, or more than
    /// [`MAX_CHUNKS_AHEAD`] ahead is an error naming why, and changes nothing.
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
        let kind = match status.result {
            ChunkResult::Sent { last, .. } => Some(last),
            ChunkResult::Failed { .. } => None,
        };
        if let Some(why) = progress.refusal(rank, chunk, kind) {
            return fail(why);
        }
        match status.result {
            ChunkResult::Sent { bytes, last } => {
                // A chunk past a held failure landed; the failure is the rank's last status.
                if progress.failure.as_ref().is_none_or(|(f, _)| chunk < *f) {
                    progress.held.insert(chunk, (bytes, last));
                }
            }
            ChunkResult::Failed { reason } => {
                // Statuses held past it landed; the failure ends the rank there.
                progress.held.retain(|&c, _| c < chunk);
                progress.failure = Some((chunk, reason));
            }
        }
        if let Some(failure) = progress.advance() {
            incoming.failures.push(RankFailure { rank, ..failure });
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

    /// The decode side's step of the engine's loop: takes `statuses` (in any order,
    /// [`Receiver::receive`]), then expires what is overdue ([`Receiver::expire`]). One call
    /// per scheduling step, with whatever statuses came since the last (none is fine): a
    /// request whose ranks went silent surfaces here as overdue, never as a silent hang.
    pub fn step(&mut self, statuses: impl IntoIterator<Item = ChunkStatus>) -> ReceiveStep {
        let mut step = ReceiveStep::default();
        for status in statuses {
            match self.receive(status) {
                Ok(Some(done)) => step.finished.push(done),
                Ok(None) => {}
                Err(e) => step.refused.push(e),
            }
        }
        step.overdue = self.expire();
        step
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
