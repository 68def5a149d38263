//! The transfer scenario's prefill rank: fills its pool and sends every request the decode
//! registers.

use std::collections::{HashSet, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvshard::backend::Backend;
use kvshard::copy::Method;
use kvshard::geometry::PAGE_SIZE;
use kvshard::ipc::Liveness;
use kvshard::pool::DevicePool;
use kvshard::transfer::{ChunkEnd, PrefillEndpoint, PrefillEvent};
use kvshard::{Error, Result};

use super::message::Message;
use super::{fill_pool_sync, pattern, PdConfig, Role, STARTUP};
use crate::measure::time_sync;

/// What a prefill rank did before the decode closed the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillSummary {
    /// Requests sent to the end.
    pub served: usize,
    /// Requests that failed or were aborted.
    pub failed: Vec<u64>,
    /// Why the endpoint closed.
    pub closed: String,
    /// Decode pools still mapped after it closed (0: the mappings were dropped).
    pub mapped_after_close: usize,
}

/// A prefill rank: fills its pool, connects, and sends every request the decode registers with
/// its case's method, until the decode closes the connection.
pub fn prefill_role(cfg: &PdConfig, socket: &Path, rank: u32) -> Result<PrefillSummary> {
    cfg.validate()?;
    let backend = cfg
        .processes
        .open_backend(cfg.shape.ranks, Role::Rank(rank))?;
    let b = backend.backend();
    let pool = Arc::new(DevicePool::allocate(
        b.as_ref(),
        &cfg.shape.geometry(),
        cfg.shape.placement()?,
        rank,
        cfg.prefill_pages(),
    )?);
    fill_pool_sync(b.as_ref(), &pool, &pattern(cfg))?;
    let first = cfg.methods.first().copied().unwrap_or(Method::CopyEngine);
    let endpoint =
        PrefillEndpoint::connect(socket, backend, pool, first, Liveness::default(), STARTUP)?;
    let mut rank_loop = RankLoop {
        cfg,
        endpoint,
        backend: b,
        queue: VecDeque::new(),
        aborted: HashSet::new(),
        summary: PrefillSummary {
            served: 0,
            failed: Vec::new(),
            closed: String::new(),
            mapped_after_close: 0,
        },
        closed: false,
    };
    while !rank_loop.closed {
        let events = rank_loop.endpoint.poll_sync(Duration::from_millis(50))?;
        rank_loop.take(events);
        while let Some(request) = rank_loop.queue.pop_front() {
            if rank_loop.send_request(request)? {
                rank_loop.summary.served += 1;
            }
        }
    }
    rank_loop.summary.mapped_after_close = rank_loop.endpoint.mapped_pools();
    Ok(rank_loop.summary)
}

/// A prefill rank's loop: the requests it was given and what became of them.
struct RankLoop<'a> {
    cfg: &'a PdConfig,
    endpoint: PrefillEndpoint,
    backend: Arc<dyn Backend>,
    queue: VecDeque<u64>,
    aborted: HashSet<u64>,
    summary: PrefillSummary,
    closed: bool,
}

impl RankLoop<'_> {
    fn take(&mut self, events: Vec<PrefillEvent>) {
        let rank = self.endpoint.rank();
        for event in events {
            match event {
                PrefillEvent::Registered { request } => self.queue.push_back(request),
                PrefillEvent::Aborted { request, .. } => {
                    self.queue.retain(|&r| r != request);
                    self.aborted.insert(request);
                    self.summary.failed.push(request);
                }
                PrefillEvent::RegistrationRefused { request, why } => {
                    println!("rank {rank}: request {request} refused: {why}");
                    self.summary.failed.push(request);
                }
                PrefillEvent::PoolRefused { pool, why } => {
                    println!("rank {rank}: pool {pool} refused: {why}")
                }
                PrefillEvent::PoolImported { .. } => {}
                PrefillEvent::Closed { why, failed } => {
                    self.summary.failed.extend(failed);
                    self.summary.closed = why;
                    self.closed = true;
                }
            }
        }
    }

    /// Sends every chunk of `request` (from the decode's cached prefix on); `false` when it
    /// failed, was aborted or the connection closed on the way (counted where that was seen).
    fn send_request(&mut self, request: u64) -> Result<bool> {
        let rank = self.endpoint.rank();
        let Some((case, iteration, c)) = self.cfg.case_of(request) else {
            self.endpoint.abort(request, "no such case in this run")?;
            self.summary.failed.push(request);
            return Ok(false);
        };
        self.endpoint.set_method(c.method)?;
        let chain = self.cfg.prefill_chain(c.pages)?;
        let prefix = self
            .endpoint
            .registration(request)
            .map_or(0, |r| r.prefix_pages * PAGE_SIZE);
        let ends: Vec<ChunkEnd> = self
            .cfg
            .chunk_ends(PdConfig::tokens(c.pages))
            .into_iter()
            .filter(|e| !matches!(e, ChunkEnd::Partial(t) if *t <= prefix))
            .collect();
        let before = self.endpoint.stats();
        let mut sent = true;
        let b = self.backend.clone();
        let kernel_ms = time_sync(b.as_ref(), || {
            for (k, &end) in ends.iter().enumerate() {
                if k > 0 {
                    if !self.cfg.pace.is_zero() {
                        std::thread::sleep(self.cfg.pace);
                    }
                    // An abort (or the decode's end) between chunks stops the request here.
                    let events = self.endpoint.poll_sync(Duration::ZERO)?;
                    self.take(events);
                    if self.closed || self.aborted.contains(&request) {
                        sent = false;
                        return Ok(());
                    }
                }
                match self.endpoint.send(request, chain.pages()?, end) {
                    Ok(_) => {}
                    Err(Error::ChunkFailed { reason, .. }) => {
                        println!("rank {rank}: request {request} failed: {reason}");
                        self.summary.failed.push(request);
                        sent = false;
                        return Ok(());
                    }
                    // The decode is gone (its Closed event lists the request) or aborted it
                    // (its Aborted event does).
                    Err(Error::PeerGone { .. }) | Err(Error::Transfer { .. }) => {
                        sent = false;
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })?;
        if !sent {
            return Ok(false);
        }
        let s = self.endpoint.stats();
        Message::Sent {
            case: case as u32,
            iteration: iteration as u32,
            kernel_ms,
            chunks: s.chunks - before.chunks,
            launches: s.launches - before.launches,
            copy_calls: s.copy_calls - before.copy_calls,
            descriptors: s.descriptors - before.descriptors,
            bytes: s.bytes - before.bytes,
        }
        .emit();
        Ok(true)
    }
}
