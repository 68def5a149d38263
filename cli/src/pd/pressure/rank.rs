//! A prefill rank of the pressure run: its CP group, its sends to every decode as each prompt
//! chunk is written.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard::backend::Backend;
use kvshard::chain::RequestChain;
use kvshard::ipc::group::GroupMemory;
use kvshard::ipc::{Liveness, PeerBackend};
use kvshard::pool::DevicePool;
use kvshard::transfer::{ChunkEnd, PrefillEndpoint, PrefillEvent};
use kvshard::{Error, Result};

use super::super::message::{Message, PromptTimes};
use super::super::{Role, REQUEST_TIMEOUT, STARTUP};
use super::dcp_rank::DcpSends;
use super::{decode_socket, platform, streams_of, PressurePdConfig};
use crate::demo::pressure::{run_scenario, AllGather, Local, Prompts, Scenario};
use crate::measure::{Laps, Moved};

/// A rank's sends: every prompt chunk to every decode, as soon as it is written.
struct RankSends {
    endpoints: Vec<PrefillEndpoint>,
    b: Arc<dyn Backend>,
    /// Each chunk's sends of the prompt being prefilled, on the rank's stream.
    laps: Laps,
    /// When the prompt's sends began and its last chunk was written.
    times: PromptTimes,
    bytes_before: u64,
}

impl RankSends {
    /// Connects prefill rank `pool.rank()` (its pool on `backend`) to every decode of `cfg`
    /// (sockets from `socket`).
    fn connect(
        cfg: &PressurePdConfig,
        socket: &Path,
        backend: &PeerBackend,
        pool: &Arc<DevicePool>,
    ) -> Result<RankSends> {
        let endpoints = (0..cfg.processes.decodes)
            .map(|d| {
                PrefillEndpoint::connect(
                    decode_socket(socket, d),
                    backend.clone(),
                    pool.clone(),
                    cfg.method,
                    Liveness::default(),
                    STARTUP,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RankSends {
            endpoints,
            b: backend.backend(),
            laps: Laps::default(),
            times: PromptTimes::default(),
            bytes_before: 0,
        })
    }

    fn bytes(&self) -> u64 {
        self.endpoints.iter().map(|e| e.stats().bytes).sum()
    }

    /// Takes what the decodes said; a decode that closed, aborted or refused fails the rank.
    fn take(&mut self, timeout: Duration) -> Result<()> {
        for (d, ep) in self.endpoints.iter_mut().enumerate() {
            for event in ep.poll_sync(timeout)? {
                match event {
                    PrefillEvent::Closed { why, .. } => {
                        // A decode says Hello as rank 0: which decode is in `why`.
                        return Err(Error::PeerGone {
                            rank: Some(0),
                            why: format!("decode {d}: {why}"),
                        });
                    }
                    PrefillEvent::Aborted { request, .. }
                    | PrefillEvent::RegistrationRefused { request, .. } => {
                        return Err(Error::Transfer {
                            request,
                            reason: format!("decode {d} gave it up"),
                        })
                    }
                    PrefillEvent::PoolRefused { why, .. } => {
                        return Err(Error::InvalidArgument(format!(
                            "decode {d}'s pool refused: {why}"
                        )))
                    }
                    PrefillEvent::Registered { .. } | PrefillEvent::PoolImported { .. } => {}
                }
            }
        }
        Ok(())
    }

    /// Waits until every decode has registered `request` with this rank.
    fn wait_registered(&mut self, request: u64) -> Result<()> {
        let start = Instant::now();
        while self
            .endpoints
            .iter()
            .any(|e| e.registration(request).is_none())
        {
            if start.elapsed() > STARTUP {
                return Err(Error::Timeout {
                    what: format!("every decode's registration of request {request}"),
                    waited: start.elapsed(),
                });
            }
            self.take(Duration::from_millis(20))?;
        }
        Ok(())
    }

    /// Waits until every decode has closed its connection (after it checked what landed).
    fn wait_closed(mut self) -> Result<()> {
        let start = Instant::now();
        while self.endpoints.iter().any(|e| e.closed().is_none()) {
            if start.elapsed() > REQUEST_TIMEOUT {
                return Err(Error::Timeout {
                    what: "the decodes' end of the run".into(),
                    waited: start.elapsed(),
                });
            }
            for ep in &mut self.endpoints {
                ep.poll_sync(Duration::from_millis(20))?;
            }
        }
        Ok(())
    }
}

impl Prompts for RankSends {
    fn chunk_written(
        &mut self,
        _: &Scenario,
        request: u64,
        chain: &RequestChain,
        end: ChunkEnd,
    ) -> Result<()> {
        if !self.times.started() {
            self.wait_registered(request)?;
            self.bytes_before = self.bytes();
            self.times.start();
        }
        if matches!(end, ChunkEnd::Final(_)) {
            self.b.synchronize()?;
            self.times.last_chunk_written();
        }
        let endpoints = &mut self.endpoints;
        self.laps.time(self.b.as_ref(), || {
            for ep in endpoints.iter_mut() {
                ep.send(request, chain.pages()?, end)?;
            }
            Ok(())
        })?;
        self.take(Duration::ZERO)
    }

    fn prompt_done(
        &mut self,
        _: &Scenario,
        request: u64,
        _: &RequestChain,
        _: &RequestChain,
    ) -> Result<String> {
        self.b.synchronize()?;
        let moved = Moved {
            bytes: self.bytes() - self.bytes_before,
            ms: self.laps.total_ms_sync(self.b.as_ref())?,
        };
        self.times.emit_sent(request, moved);
        Ok(format!(
            "P/D sent to {} decodes as each chunk was written: {moved}",
            self.endpoints.len(),
        ))
    }
}

#[cfg(feature = "nccl")]
fn nccl_all_gather(backend: &PeerBackend, group: &GroupMemory) -> Result<AllGather> {
    use kvshard::nccl::{NcclGroup, NcclId};
    let PeerBackend::Cuda(cuda) = backend else {
        return Err(Error::InvalidArgument("NCCL needs GPUs".into()));
    };
    let id = if group.rank() == 0 {
        let id = NcclId::new()?;
        group.publish_nccl_id(&id.to_bytes())?;
        id
    } else {
        NcclId::from_bytes(group.nccl_id_sync()?)
    };
    Ok(AllGather::Nccl {
        group: NcclGroup::join(cuda, id, group.rank(), group.ranks())?,
        cuda: cuda.clone(),
    })
}

#[cfg(not(feature = "nccl"))]
fn nccl_all_gather(_: &PeerBackend, _: &GroupMemory) -> Result<AllGather> {
    Err(Error::InvalidArgument(
        "this kvshard was built without the nccl feature".into(),
    ))
}

/// Prefill rank `rank`: joins the group at `group`, connects to every decode (sockets from
/// `socket`), runs the scenario sending every prompt chunk (its storage step in `storage_dir`,
/// the directory the run's parent made for its ranks), and waits for the decodes to close.
pub fn rank_role(
    cfg: &PressurePdConfig,
    socket: &Path,
    group: &Path,
    storage_dir: Option<&Path>,
    rank: u32,
) -> Result<()> {
    cfg.validate()?;
    let sc = &cfg.scenario;
    let ranks = sc.shape.ranks;
    let backend = cfg.processes.open_backend(ranks, Role::Rank(rank))?;
    let b = backend.backend();
    let pool = Arc::new(DevicePool::allocate(
        b.as_ref(),
        &sc.shape.geometry(),
        sc.shape.placement()?,
        rank,
        sc.pages_per_rank()?,
    )?);
    let memory = GroupMemory::join(group, rank, ranks, cfg.slot_bytes()?, STARTUP)?;
    let all_gather = if cfg.nccl {
        nccl_all_gather(&backend, &memory)?
    } else {
        AllGather::HostStaged(memory)
    };
    let mut sends = if cfg.is_dcp() {
        Sends::Dcp(DcpSends::connect(
            cfg,
            socket,
            &backend,
            pool.clone(),
            rank,
        )?)
    } else {
        Sends::Whole(RankSends::connect(cfg, socket, &backend, &pool)?)
    };
    let local = Local {
        pools: vec![pool],
        all_gather,
        storage_dir: storage_dir.map(Path::to_path_buf),
    };
    let route = platform(&backend).route();
    let outcome = run_scenario(
        b.clone(),
        &streams_of(&backend),
        sc,
        route,
        local,
        match &mut sends {
            Sends::Whole(s) => s,
            Sends::Dcp(s) => s,
        },
    )?;
    Message::Reloaded {
        moved: outcome.reload,
        start: outcome.reload_window.0,
        end: outcome.reload_window.1,
    }
    .emit();
    Message::Storage {
        lines: outcome
            .summary
            .lines
            .iter()
            .filter(|l| l.starts_with("storage:"))
            .cloned()
            .collect(),
    }
    .emit();
    match sends {
        Sends::Whole(s) => s.wait_closed(),
        Sends::Dcp(s) => s.wait_closed(),
    }
}

/// A rank's sends: to unsharded decodes, or into decode context-parallel groups.
enum Sends {
    Whole(RankSends),
    Dcp(DcpSends),
}
