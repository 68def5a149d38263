//! The prefill side of the engine's loop (docs/design.md, "The engine's loop"): a
//! [`PrefillLoop`] keeps every chunk its ranks' [`Sender`]s have on their way, and one call per
//! scheduling step, [`PrefillLoop::step`], polls them all, in any order, without waiting, and
//! hands out what the decode side must hear: each landed chunk's status, each failure, each
//! chunk dropped before its status was taken, plus every input a kernel rejected on the
//! streams it watches since the last step. The statuses go to the decode side as they are
//! (in one process: [`Receiver::step`](super::Receiver::step)), which takes a rank's statuses in
//! any order.
//!
//! What vLLM's and SGLang's schedulers do with their KV connectors each step
//! (`get_finished`, `poll`), with nothing left for the engine to remember: a chunk that failed,
//! while moving or before it could be enqueued, closes its request on its rank and its failed
//! status goes out once nothing else of the request moves on that rank (chunks after it are
//! not reported: the failure is the rank's last status; chunks before it are), so the decode
//! side never frees pages a chunk of the rank may still write. A request aborted on a rank
//! ([`PrefillLoop::abort`]) goes out the same way.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use super::{ChunkEnd, ChunkResult, ChunkStatus, PendingChunk, Sender};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::index::LogicalPage;

/// What one [`PrefillLoop::step`] found.
#[derive(Debug, Default)]
pub struct PrefillStep {
    /// The statuses to deliver to the decode side, each once, in the order found: chunks that
    /// landed, a request's failure on a rank (once nothing else of it moves there), chunks
    /// dropped before their status was taken.
    pub statuses: Vec<ChunkStatus>,
    /// Inputs a kernel rejected on a watched stream since the last step
    /// ([`Error::KernelRejected`]), or a stream that could not be asked.
    pub kernel_errors: Vec<Error>,
}

/// Every chunk a process's prefill ranks have on their way, polled each step (module docs).
#[derive(Default)]
pub struct PrefillLoop {
    senders: Vec<Sender>,
    in_flight: Vec<PendingChunk>,
    /// Per (rank, request) that failed: its failed status, held until no chunk of it is in
    /// flight on the rank.
    failing: BTreeMap<(u32, u64), ChunkStatus>,
    streams: Vec<Arc<dyn Backend>>,
}

impl fmt::Debug for PrefillLoop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefillLoop")
            .field(
                "ranks",
                &self.senders.iter().map(Sender::rank).collect::<Vec<_>>(),
            )
            .field("in_flight", &self.in_flight.len())
            .field("failing", &self.failing.len())
            .field("streams", &self.streams.len())
            .finish()
    }
}

impl PrefillLoop {
    /// A loop of no rank yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a rank's sender; a rank already here is refused.
    pub fn add(&mut self, sender: Sender) -> Result<()> {
        let rank = sender.rank();
        if self.senders.iter().any(|s| s.rank() == rank) {
            return Err(Error::InvalidArgument(format!(
                "prefill rank {rank} is in the loop already"
            )));
        }
        self.senders.push(sender);
        Ok(())
    }

    /// Adds a stream whose kernels' rejected inputs each step reports (where the engine's
    /// owned-row writes and quantizers run, the transports' streams).
    pub fn watch(&mut self, stream: Arc<dyn Backend>) {
        self.streams.push(stream);
    }

    /// The sender of `rank`: to open requests on it, read its counters.
    pub fn sender(&mut self, rank: u32) -> Result<&mut Sender> {
        self.senders
            .iter_mut()
            .find(|s| s.rank() == rank)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("prefill rank {rank} is not in the loop"))
            })
    }

    /// Enqueues the next chunk of `request` on `rank` ([`Sender::send`]) and keeps it: its
    /// status comes out of a later [`PrefillLoop::step`]. A chunk that cannot be planned or
    /// enqueued is [`Error::ChunkFailed`]: the request is closed on the rank and its failed
    /// status comes out of a step like any other, for the engine to deliver, nothing more.
    /// A rank not in the loop or a request not open on it is an error and changes nothing.
    pub fn send(
        &mut self,
        rank: u32,
        request: u64,
        pages: &[LogicalPage],
        end: ChunkEnd,
    ) -> Result<()> {
        match self.sender(rank)?.send(request, pages, end) {
            Ok(chunk) => {
                self.in_flight.push(chunk);
                Ok(())
            }
            Err(e) => {
                if let Some(status) = ChunkStatus::from_error(&e) {
                    self.fail(status);
                }
                Err(e)
            }
        }
    }

    /// Gives up on `request` on `rank` ([`Sender::abort`]): its failed status comes out of a
    /// step once no chunk of it is in flight on the rank.
    pub fn abort(&mut self, rank: u32, request: u64, reason: &str) -> Result<()> {
        let status = self.sender(rank)?.abort(request, reason)?;
        self.fail(status);
        Ok(())
    }

    /// Chunks on their way, over every rank.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Polls every chunk in flight once, in any order, never waiting; reports what the decode
    /// side must hear and the kernels' rejected inputs since the last step (module docs).
    pub fn step(&mut self) -> PrefillStep {
        let mut step = PrefillStep::default();
        let mut still = Vec::with_capacity(self.in_flight.len());
        for mut chunk in std::mem::take(&mut self.in_flight) {
            let key = (chunk.rank(), chunk.request());
            match chunk.poll_status() {
                None => still.push(chunk),
                Some(status) if matches!(status.result, ChunkResult::Failed { .. }) => {
                    self.fail(status)
                }
                Some(status) => {
                    // Past the rank's failure of the request: the failure is its last status.
                    if self
                        .failing
                        .get(&key)
                        .is_none_or(|f| status.chunk < f.chunk)
                    {
                        step.statuses.push(status);
                    }
                }
            }
        }
        self.in_flight = still;
        let in_flight = &self.in_flight;
        let settled: Vec<(u32, u64)> = self
            .failing
            .keys()
            .filter(|(rank, request)| {
                !in_flight
                    .iter()
                    .any(|c| c.rank() == *rank && c.request() == *request)
            })
            .copied()
            .collect();
        for key in settled {
            step.statuses.extend(self.failing.remove(&key));
        }
        for sender in &mut self.senders {
            step.statuses.extend(sender.take_dropped());
        }
        for stream in &self.streams {
            if let Err(e) = stream.poll_kernel_status() {
                step.kernel_errors.push(e);
            }
        }
        step
    }

    /// Records a failed status of a request on its rank: the earliest chunk's stands, and the
    /// request is closed on the sender (a failure is the rank's last status).
    fn fail(&mut self, status: ChunkStatus) {
        let key = (status.rank, status.request);
        if let Some(sender) = self.senders.iter_mut().find(|s| s.rank() == status.rank) {
            // Already closed when the send itself failed, or by an earlier failure.
            let _ = sender.close(status.request);
        }
        match self.failing.get(&key) {
            Some(earlier) if earlier.chunk <= status.chunk => {}
            _ => {
                self.failing.insert(key, status);
            }
        }
    }
}
