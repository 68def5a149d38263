//! The transfer scenario's decode process: its copy ceiling, its pool and its requests, and
//! the watch over what the ranks said.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use kvshard::backend::MemoryKind;
use kvshard::chain::RequestChain;
use kvshard::copy::BlockSpace;
use kvshard::gpu::Gpu;
use kvshard::ipc::{ExportedPool, Liveness, PeerBackend};
use kvshard::shard::{Placement, ShardAllocator};
use kvshard::transfer::{DecodeEndpoint, DecodeEvent, Finished, PoolLayout, Registration};
use kvshard::{Error, Result};

use super::message::Message;
use super::{gpu_count, pattern, verify_sync, PdConfig, Processes, Role, STARTUP};
use crate::measure::{copy_sync, peer_sync, Ceiling, Timer};
use crate::synth::POISON;

/// The copy ceiling of a run, measured by the decode of `backend` against the GPU of the ranks'
/// `source`: the peer copy engine moving 1 GiB from `source` into the decode's GPU when they
/// differ, a local device copy of 1 GiB on one GPU, a 32 MiB copy on the CPU twin (indicative
/// only). Best of four (the first also touches every page).
pub(crate) fn ceiling(backend: &PeerBackend, source: usize) -> Result<Ceiling> {
    const RUNS: usize = 4;
    Ok(match backend {
        PeerBackend::Cpu(cpu) => {
            let t = copy_sync(
                &Timer::new(cpu.as_ref()),
                MemoryKind::Device,
                MemoryKind::Device,
                32 << 20,
                RUNS,
            )?;
            Ceiling {
                what: "CPU twin copy of 32 MiB (indicative only)".into(),
                gbps: t.best_gbps(),
                hardware: false,
            }
        }
        PeerBackend::Cuda(cuda) => {
            let here = cuda.gpu().info().ordinal;
            let (t, what) = if source == here {
                let t = copy_sync(
                    &Timer::new(cuda.as_ref()),
                    MemoryKind::Device,
                    MemoryKind::Device,
                    1 << 30,
                    RUNS,
                )?;
                (t, format!("local D2D copy on GPU {here}, 1 GiB"))
            } else {
                let t = peer_sync(cuda, &Gpu::open(source)?, 1 << 30, RUNS)?;
                (
                    t,
                    format!("peer copy engine GPU {source} -> GPU {here}, 1 GiB"),
                )
            };
            Ceiling {
                what,
                gbps: t.best_gbps(),
                hardware: true,
            }
        }
    })
}

/// The GPU rank 0 runs on: where a decode's ceiling copies from (0 on the CPU twin, which has
/// no GPU to name).
pub(crate) fn rank0_gpu(processes: &Processes, ranks: u32) -> Result<usize> {
    if !processes.platform.is_gpu() {
        return Ok(0);
    }
    Ok(processes.gpu_of(ranks, Role::Rank(0), gpu_count()?))
}

/// The decode process: allocates and publishes its pool, registers every request of every
/// case in turn, waits for each, verifies the first of each case and prints what it measured.
pub fn decode_role(cfg: &PdConfig, socket: &Path) -> Result<()> {
    cfg.validate()?;
    let (p, ranks) = (&cfg.processes, cfg.shape.ranks);
    let backend = p.open_backend(ranks, Role::Decode(0))?;
    let b = backend.backend();
    Message::Ceiling(ceiling(&backend, rank0_gpu(p, ranks)?)?).emit();
    let g = cfg.shape.geometry();
    let exported = Arc::new(ExportedPool::allocate(
        &backend,
        &g,
        Placement::unsharded(),
        0,
        cfg.decode_pages(),
    )?);
    println!(
        "decode: pool of {} pages shared as {:?}{}",
        cfg.decode_pages(),
        exported.memory(),
        exported
            .fabric_absent()
            .map_or(String::new(), |why| format!(" (no fabric handle: {why})"))
    );
    let pool = exported.pool().clone();
    let pattern = pattern(cfg);
    let mut endpoint = DecodeEndpoint::bind(socket, backend.clone(), ranks, Liveness::default())?;
    endpoint.set_deadline(p.deadline);
    endpoint.wait_for_ranks_sync(STARTUP)?;
    let pool_id = endpoint.publish(exported)?;
    let mut watch = DecodeWatch::new(endpoint);
    for (case, c) in cfg.cases().into_iter().enumerate() {
        for iteration in 0..cfg.iterations {
            let request = cfg.request_id(case, iteration);
            let verified = iteration == 0;
            if verified {
                pool.fill(b.as_ref(), POISON)?;
                b.synchronize()?;
            }
            let mut allocator = ShardAllocator::new(Placement::unsharded(), pool.pages())?;
            let mut chain = RequestChain::new(Placement::unsharded());
            chain.grow_to(&mut allocator, PdConfig::tokens(c.pages))?;
            let registration = Registration::of_chain(&chain, request, PoolLayout::of(&pool), 0)?;
            let start = Instant::now();
            watch.endpoint.register(pool_id, registration)?;
            let (finished, _) = watch.wait_sync(request)?;
            let wall_ms = start.elapsed().as_secs_f64() * 1e3;
            if !finished.is_completed() {
                return Err(Error::Transfer {
                    request,
                    reason: format!("failed: {:?}", finished.outcome),
                });
            }
            if verified {
                let source = cfg.prefill_chain(c.pages)?;
                verify_sync(
                    b.as_ref(),
                    &pool,
                    &pattern,
                    cfg,
                    &source,
                    &finished.registration,
                )?;
            }
            Message::Received {
                case: case as u32,
                iteration: iteration as u32,
                wall_ms,
                bytes: finished.total_bytes().total(),
                verified,
            }
            .emit();
        }
    }
    Ok(())
}

/// A decode's endpoint and the requests it has seen finish, each with when it was seen.
pub(crate) struct DecodeWatch {
    pub(crate) endpoint: DecodeEndpoint,
    finished: HashMap<u64, (Finished, SystemTime)>,
}

impl DecodeWatch {
    pub(crate) fn new(endpoint: DecodeEndpoint) -> Self {
        Self {
            endpoint,
            finished: HashMap::new(),
        }
    }

    /// Takes what the ranks said within `timeout`; a rank going, or a request's deadline
    /// passing ([`Error::TransferDeadline`]), is an error.
    fn poll_sync(&mut self, timeout: Duration) -> Result<()> {
        for event in self.endpoint.poll_sync(timeout)? {
            match event {
                DecodeEvent::Finished(f) => {
                    self.finished.insert(f.request(), (*f, SystemTime::now()));
                }
                DecodeEvent::RankGone { rank, why, .. } => {
                    return Err(Error::PeerGone {
                        rank: Some(rank),
                        why,
                    })
                }
                DecodeEvent::Overdue(overdue) => return Err(overdue.into()),
                DecodeEvent::Refused { why } => println!("decode: refused a connection: {why}"),
                DecodeEvent::Joined { .. } => {}
            }
        }
        Ok(())
    }

    /// Polls until `request`, registered with the endpoint, has finished: within the
    /// endpoint's deadline, or [`Error::TransferDeadline`] says what never arrived.
    pub(crate) fn wait_sync(&mut self, request: u64) -> Result<(Finished, SystemTime)> {
        let start = Instant::now();
        // The endpoint reports a request it tracks overdue at its deadline: one still waited
        // for a poll later was never registered there.
        let limit = self
            .endpoint
            .deadline()
            .saturating_add(Duration::from_secs(1));
        loop {
            if let Some(done) = self.finished.remove(&request) {
                return Ok(done);
            }
            if start.elapsed() > limit {
                return Err(Error::Timeout {
                    what: format!("request {request}, which the decode never registered"),
                    waited: start.elapsed(),
                });
            }
            self.poll_sync(Duration::from_millis(20))?;
        }
    }
}
