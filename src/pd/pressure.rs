//! `kvshard pd --scenario pressure`: the seed's topology across processes, one per GPU.
//!
//! The CP group's N prefill ranks and D decodes (each decode holding the full unsharded cache)
//! each run in a process of their own ([`run`] starts them: the running executable again, with
//! a hidden role flag), every one driving the same pressure scenario
//! ([`crate::demo::pressure`]): a seeded prefix written through to the host, two prompts that
//! evict it, the prefix reloaded from the host and gathered into every rank's attention
//! scratch before each chunk of the second prompt. The ranks share a CP group memory
//! ([`GroupMemory`]): the barrier, the NCCL id, and on the CPU twin or ranks that share a GPU
//! the host-staged all-gather. Each rank sends every prompt chunk to every decode as soon as
//! it is written (one launch per chunk and decode with the `blocks` method). Each decode
//! registers both prompts up front, replays the unsharded reference prefill itself and checks
//! every block that landed against it.
//!
//! GPUs: rank r on GPU r, the decodes on the GPUs after the ranks (sharing the last GPU when
//! there are not enough), or as `--gpus` says (each rank's, then each decode's).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::{
    best_of_four, ceiling, fields, gbps, layer_range, num, open_backend, run_roles, verify_landed,
    DecodeWatch, Report, REQUEST_TIMEOUT, STARTUP, TAG,
};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, Event, Launch, MemoryKind};
use crate::chain::RequestChain;
use crate::copy::BlockSpace;
use crate::demo::pressure::{
    run_scenario, AllGather, Local, Moved, Prompts, Scenario, PROMPT_1, PROMPT_2,
};
use crate::demo::{default_route, PressureConfig};
use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::ipc::group::GroupMemory;
use crate::ipc::{ExportedPool, Liveness, PeerBackend};
use crate::pool::DevicePool;
use crate::shard::{Placement, ShardAllocator};
use crate::synth::POISON;
use crate::transfer::{
    ChunkEnd, DecodeEndpoint, Finished, PeerMethod, PoolLayout, PrefillEndpoint, PrefillEvent,
    DEFAULT_DEADLINE,
};

/// One run of the scenario across processes, identical in every process of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PressurePdConfig {
    /// Run on the CPU twin (memfd pools) instead of GPUs.
    pub cpu: bool,
    /// The scenario every process drives (its `ranks` are the prefill processes).
    pub scenario: PressureConfig,
    /// Decode processes, each holding the full unsharded cache and receiving every prompt.
    pub decodes: u32,
    /// How ranks send chunks to the decodes.
    pub method: PeerMethod,
    /// Whether the ranks all-gather over NCCL (GPUs, one rank per GPU) instead of through host
    /// shared memory.
    pub nccl: bool,
    /// GPUs: each rank's, then each decode's; empty: the default placement (module docs).
    pub gpus: Vec<usize>,
    /// How long a decode waits for each prompt, from its registration (both are registered up
    /// front) to every rank's last status, before the run fails with
    /// [`Error::TransferDeadline`].
    pub deadline: Duration,
}

/// Where a process of the run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PressureRole {
    /// Prefill rank `r`.
    Rank(u32),
    /// Decode `d`.
    Decode(u32),
}

impl PressurePdConfig {
    /// The default for the CPU twin (the scenario's CPU shape, seconds) or GPUs (61 layers and
    /// the draft, one-launch sends with 132 CTAs): CP2 and two decodes, the seed's topology.
    pub fn default_for(cpu: bool) -> Self {
        Self {
            cpu,
            scenario: PressureConfig::default_for(!cpu),
            decodes: 2,
            method: PeerMethod::Blocks(Launch {
                ctas: if cpu { 2 } else { 132 },
                threads: crate::abi::KVS_COPY_THREADS.min(512),
            }),
            nccl: false,
            gpus: Vec::new(),
            deadline: DEFAULT_DEADLINE,
        }
    }

    /// Checks the run makes sense before any process starts.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("pd pressure: {why}")));
        let ranks = self.scenario.ranks;
        if ranks == 0 || ranks > crate::transfer::MAX_PREFILL_RANKS {
            return bad(format!("{ranks} prefill ranks"));
        }
        if self.decodes == 0 || self.decodes > 8 {
            return bad(format!("{} decodes (1 to 8)", self.decodes));
        }
        if self.cpu && self.nccl {
            return bad("NCCL needs GPUs".into());
        }
        let processes = (ranks + self.decodes) as usize;
        if !self.gpus.is_empty() && self.gpus.len() != processes {
            return bad(format!(
                "--gpus names {} GPUs; {ranks} ranks and {} decodes need {processes}",
                self.gpus.len(),
                self.decodes
            ));
        }
        self.scenario.pages_per_rank().map(|_| ())
    }

    /// The GPU of `role` on a machine of `present` GPUs.
    pub fn gpu_of(&self, role: PressureRole, present: usize) -> usize {
        let ranks = self.scenario.ranks as usize;
        let at = match role {
            PressureRole::Rank(r) => r as usize,
            PressureRole::Decode(d) => ranks + d as usize,
        };
        if let Some(&g) = self.gpus.get(at) {
            return g;
        }
        let n = present.max(1);
        match role {
            PressureRole::Rank(r) => r as usize % n,
            PressureRole::Decode(d) if n > ranks => ranks + d as usize % (n - ranks),
            PressureRole::Decode(_) => n - 1,
        }
    }

    /// Whether the ranks sit on distinct GPUs of a machine of `present` (NCCL's condition).
    pub fn ranks_on_distinct_gpus(&self, present: usize) -> bool {
        let mut gpus: Vec<usize> = (0..self.scenario.ranks)
            .map(|r| self.gpu_of(PressureRole::Rank(r), present))
            .collect();
        gpus.sort_unstable();
        gpus.dedup();
        gpus.len() == self.scenario.ranks as usize
    }

    /// Pages of each decode's pool: both prompts, registered up front with a poisoned page
    /// before, between and after them (a write past a request's pages shows), and page 0.
    pub fn decode_pages(&self) -> u64 {
        (2 * self.scenario.prompt_tokens.div_ceil(PAGE_SIZE) + 4) as u64
    }

    /// Bytes the run needs, device then host, over every process: each rank's pool, reference,
    /// staging, send buffers and scratch, each decode's pool and reference; each rank's host
    /// pool and the group memory. An estimate (tables and small buffers left out).
    pub fn memory(&self) -> Result<(u64, u64)> {
        use crate::error::Checked;
        let sc = &self.scenario;
        let page = sc.geometry().page_bytes_checked()? as u64;
        let per_rank = sc.pages_per_rank()?;
        let reference = ((sc.prefix_tokens + 2 * sc.prompt_tokens).div_ceil(PAGE_SIZE) + 2) as u64;
        let chunk = sc.chunk.div_ceil(PAGE_SIZE) as u64;
        let (_, layout) = sc.scratch()?;
        let scratch = layout.map_or(0, |l| l.pages() + 2 * l.prefix_pages());
        let sends = sc.send_pages()? * u64::from(sc.ranks);
        let ranks = u64::from(sc.ranks);
        let rank_pages = per_rank + reference + chunk + scratch + sends;
        let decode_pages = self.decode_pages() + reference + chunk;
        let pages = ranks.mul_or(rank_pages, || "pages".into())?.add_or(
            u64::from(self.decodes).mul_or(decode_pages, || "pages".into())?,
            || "pages".into(),
        )?;
        let host_pages = ranks.mul_or(
            per_rank.mul_or(sc.host_factor, || "host pages".into())?,
            || "host pages".into(),
        )?;
        let group = crate::ipc::group::group_bytes(sc.ranks, self.slot_bytes()?)? as u64;
        Ok((
            pages.mul_or(page, || "device bytes".into())?,
            host_pages
                .mul_or(page, || "host bytes".into())?
                .add_or(group, || "host bytes".into())?,
        ))
    }

    /// Bytes of each slot of the group memory (none when NCCL gathers).
    pub fn slot_bytes(&self) -> Result<usize> {
        if self.nccl {
            Ok(0)
        } else {
            self.scenario.send_bytes()
        }
    }

    /// The command-line flags that give this configuration (after `pd --scenario pressure`).
    pub fn to_args(&self) -> Vec<String> {
        let sc = &self.scenario;
        let mut args = vec![
            "--ranks".to_string(),
            sc.ranks.to_string(),
            "--layers".into(),
            sc.layers.to_string(),
            "--decodes".into(),
            self.decodes.to_string(),
            "--methods".into(),
            super::method_name(&self.method),
            "--seed".into(),
            sc.seed.to_string(),
            "--deadline-ms".into(),
            self.deadline.as_millis().to_string(),
        ];
        if self.cpu {
            args.push("--cpu".into());
        }
        if !sc.draft {
            args.push("--no-draft".into());
        }
        args.push("--all-gather".into());
        args.push(if self.nccl { "nccl" } else { "host" }.into());
        if !self.gpus.is_empty() {
            args.push("--gpus".into());
            args.push(
                self.gpus
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            );
        }
        args
    }
}

fn decode_socket(base: &Path, decode: u32) -> PathBuf {
    let mut path = base.as_os_str().to_owned();
    path.push(format!(".{decode}"));
    path.into()
}

/// Microseconds since the Unix epoch: the processes of a run share the host's wall clock.
fn micros(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros())
}

/// New streams of `backend`'s device, for the HiCache controllers.
fn streams_of(backend: &PeerBackend) -> impl Fn() -> Result<Arc<dyn Backend>> + '_ {
    move || -> Result<Arc<dyn Backend>> {
        Ok(match backend {
            PeerBackend::Cpu(cpu) => Arc::new(cpu.new_stream()),
            PeerBackend::Cuda(cuda) => Arc::new(CudaBackend::new(cuda.gpu().clone())?),
        })
    }
}

fn is_gpu(backend: &PeerBackend) -> bool {
    matches!(backend, PeerBackend::Cuda(_))
}

// ---------------------------------------------------------------------------------------------
// A prefill rank.
// ---------------------------------------------------------------------------------------------

/// A rank's sends: every prompt chunk to every decode, as soon as it is written.
struct RankSends {
    endpoints: Vec<PrefillEndpoint>,
    b: Arc<dyn Backend>,
    rank: u32,
    /// Events around each chunk's sends of the prompt being prefilled.
    timed: Vec<(Event, Event)>,
    /// When the prompt's first send was enqueued.
    first: Option<SystemTime>,
    /// When its last chunk had been written (the device caught up).
    last_chunk: Option<SystemTime>,
    bytes_before: u64,
}

impl RankSends {
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
        if self.first.is_none() {
            self.wait_registered(request)?;
            self.bytes_before = self.bytes();
            self.first = Some(SystemTime::now());
        }
        if matches!(end, ChunkEnd::Final(_)) {
            self.b.synchronize()?;
            self.last_chunk = Some(SystemTime::now());
        }
        let start = self.b.record_timed()?;
        for ep in &mut self.endpoints {
            ep.send(request, chain.pages()?, end)?;
        }
        self.timed.push((start, self.b.record_timed()?));
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
        let done = SystemTime::now();
        let mut ms = 0.0;
        for (start, end) in self.timed.drain(..) {
            ms += self.b.elapsed_ms(&start, &end)?;
        }
        let bytes = self.bytes() - self.bytes_before;
        let first = self.first.take().unwrap_or(done);
        let last_chunk = self.last_chunk.take().unwrap_or(done);
        println!(
            "{TAG} kind=send rank={} request={request} bytes={bytes} ms={ms:.4} first_us={} last_chunk_us={} done_us={}",
            self.rank,
            micros(first),
            micros(last_chunk),
            micros(done)
        );
        Ok(format!(
            "P/D sent to {} decodes as each chunk was written: {}",
            self.endpoints.len(),
            Moved { bytes, ms }
        ))
    }
}

#[cfg(feature = "nccl")]
fn nccl_all_gather(backend: &PeerBackend, group: &GroupMemory) -> Result<AllGather> {
    use crate::nccl::{NcclGroup, NcclId};
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
/// `socket`), runs the scenario sending every prompt chunk, and waits for the decodes to close.
pub fn rank_role(cfg: &PressurePdConfig, socket: &Path, group: &Path, rank: u32) -> Result<()> {
    cfg.validate()?;
    let sc = &cfg.scenario;
    let backend = open_backend(cfg.cpu, |n| cfg.gpu_of(PressureRole::Rank(rank), n))?;
    let b = backend.backend();
    let pool = Arc::new(DevicePool::allocate(
        b.as_ref(),
        &sc.geometry(),
        Placement::new(sc.ranks)?,
        rank,
        sc.pages_per_rank()?,
    )?);
    let memory = GroupMemory::join(group, rank, sc.ranks, cfg.slot_bytes()?, STARTUP)?;
    let all_gather = if cfg.nccl {
        nccl_all_gather(&backend, &memory)?
    } else {
        AllGather::HostStaged(memory)
    };
    let endpoints = (0..cfg.decodes)
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
    let mut sends = RankSends {
        endpoints,
        b: b.clone(),
        rank,
        timed: Vec::new(),
        first: None,
        last_chunk: None,
        bytes_before: 0,
    };
    let local = Local {
        pools: vec![pool],
        all_gather,
    };
    let route = default_route(is_gpu(&backend));
    let outcome = run_scenario(
        b.clone(),
        &streams_of(&backend),
        sc,
        route,
        local,
        &mut sends,
    )?;
    println!(
        "{TAG} kind=reload rank={rank} bytes={} ms={:.4} start_us={} end_us={}",
        outcome.reload.bytes,
        outcome.reload.ms,
        micros(outcome.reload_window.0),
        micros(outcome.reload_window.1)
    );
    sends.wait_closed()
}

// ---------------------------------------------------------------------------------------------
// A decode.
// ---------------------------------------------------------------------------------------------

/// What a decode keeps of its replay of the scenario: the reference and its prompts' chains.
#[derive(Default)]
struct Replay {
    /// The reference's chain of each prompt.
    refs: HashMap<u64, RequestChain>,
    /// The reference pool, once a prompt is prefilled.
    reference: Option<Arc<DevicePool>>,
}

impl Prompts for Replay {
    fn chunk_written(&mut self, _: &Scenario, _: u64, _: &RequestChain, _: ChunkEnd) -> Result<()> {
        Ok(())
    }

    fn prompt_done(
        &mut self,
        s: &Scenario,
        request: u64,
        _: &RequestChain,
        ref_chain: &RequestChain,
    ) -> Result<String> {
        self.reference = Some(s.reference().clone());
        self.refs.insert(request, ref_chain.clone());
        Ok("the reference replayed".into())
    }
}

/// Decode `index`: publishes its pool to every rank, registers both prompts, waits for both
/// (polling only, so each is timed when it finishes), then replays the reference and checks
/// every block that landed against it. Decode 0 also measures the copy ceilings first.
pub fn decode_role(cfg: &PressurePdConfig, socket: &Path, index: u32) -> Result<()> {
    cfg.validate()?;
    let sc = &cfg.scenario;
    let backend = open_backend(cfg.cpu, |n| cfg.gpu_of(PressureRole::Decode(index), n))?;
    let b = backend.backend();
    if index == 0 {
        let (gbps, what) = ceiling(&backend, |n| cfg.gpu_of(PressureRole::Rank(0), n))?;
        println!(
            "{TAG} kind=ceiling gbps={gbps:.1} what={}",
            what.replace(' ', "_")
        );
        println!("{TAG} kind=h2d gbps={:.1}", h2d_ceiling(b.as_ref())?);
    }
    let g = sc.geometry();
    let unsharded = Placement::unsharded();
    let exported = Arc::new(ExportedPool::allocate(
        &backend,
        &g,
        unsharded,
        0,
        cfg.decode_pages(),
    )?);
    let pool = exported.pool().clone();
    pool.fill(b.as_ref(), POISON)?;
    b.synchronize()?;
    let mut endpoint = DecodeEndpoint::bind(
        decode_socket(socket, index),
        backend.clone(),
        sc.ranks,
        Liveness::default(),
    )?;
    endpoint.set_deadline(cfg.deadline);
    endpoint.wait_for_ranks_sync(STARTUP)?;
    let pool_id = endpoint.publish(exported)?;
    let mut alloc = ShardAllocator::new(unsharded, pool.pages())?;
    for request in [PROMPT_1, PROMPT_2] {
        // The guard page before the request stays poisoned.
        RequestChain::new(unsharded).grow_to(&mut alloc, 1)?;
        let mut chain = RequestChain::new(unsharded);
        chain.grow_to(&mut alloc, sc.prompt_tokens)?;
        endpoint.register(
            pool_id,
            chain.registration(request, PoolLayout::of(&pool), 0)?,
        )?;
    }
    let mut watch = DecodeWatch::new(endpoint);
    let landed = [watch.wait_sync(PROMPT_1)?, watch.wait_sync(PROMPT_2)?];
    let mut replay = Replay::default();
    let local = Local {
        pools: Vec::new(),
        all_gather: AllGather::InProcess,
    };
    let route = default_route(is_gpu(&backend));
    run_scenario(
        b.clone(),
        &streams_of(&backend),
        sc,
        route,
        local,
        &mut replay,
    )?;
    let reference = replay
        .reference
        .clone()
        .ok_or_else(|| Error::Verification("the scenario ended without its reference".into()))?;
    for (request, (finished, done)) in [PROMPT_1, PROMPT_2].into_iter().zip(landed) {
        if !finished.is_completed() {
            return Err(Error::Transfer {
                request,
                reason: format!("failed: {:?}", finished.outcome),
            });
        }
        let ref_chain = replay.refs.get(&request).ok_or_else(|| {
            Error::Verification(format!("no reference chain of request {request}"))
        })?;
        let check = Instant::now();
        verify_against(b.as_ref(), &pool, &reference, ref_chain, &finished)?;
        println!(
            "{TAG} kind=decode decode={index} request={request} bytes={} done_us={} verify_ms={:.1} verified=true",
            finished.total_bytes().total(),
            micros(done),
            check.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(())
}

/// The pinned host-to-device ceiling the reloads are measured against: one copy-engine copy of
/// 1 GiB (32 MiB on the CPU twin) from pinned host memory, best of four.
fn h2d_ceiling(b: &dyn Backend) -> Result<f64> {
    let len: usize = if b.name() == "cpu" { 32 << 20 } else { 1 << 30 };
    let host = b.alloc(len, MemoryKind::PinnedHost)?;
    let device = b.alloc(len, MemoryKind::Device)?;
    // SAFETY: two live allocations of `len` bytes of this backend, held past the wait.
    let best = best_of_four(b, || unsafe { b.memcpy(device.addr(), host.addr(), len) })?;
    Ok(gbps(len as u64, best))
}

/// Checks decode pool `pool` after `finished` landed: each block equals the reference's block
/// of the same sequence position (read a stored layer at a time).
fn verify_against(
    b: &dyn Backend,
    pool: &DevicePool,
    reference: &DevicePool,
    ref_chain: &RequestChain,
    finished: &Finished,
) -> Result<()> {
    let storage = reference
        .storage()
        .ok_or_else(|| Error::InvalidArgument("the reference is allocated by kvshard".into()))?;
    let mut layer: Option<((usize, usize), Vec<u8>)> = None;
    verify_landed(b, pool, &finished.registration, &mut |c, l, position| {
        if layer.as_ref().map(|(key, _)| *key) != Some((c, l)) {
            let (offset, len) = layer_range(reference, c, l)?;
            layer = Some(((c, l), b.read_sync(storage, offset, len)?));
        }
        let bytes = layer
            .as_ref()
            .map(|(_, bytes)| bytes.as_slice())
            .unwrap_or(&[]);
        let block = reference.components()[c].block_bytes;
        let page = ref_chain
            .pages()?
            .get(position)
            .ok_or_else(|| Error::Verification(format!("position {position} past the chain")))?;
        let at = page.0 as usize * block;
        bytes
            .get(at..at + block)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| Error::Verification(format!("{page} past the reference")))
    })
}

// ---------------------------------------------------------------------------------------------
// The run.
// ---------------------------------------------------------------------------------------------

/// Runs `cfg`: creates the CP group memory, starts the decodes and the ranks
/// (`exe pd --scenario pressure --role ...`), forwards what they print, and builds the report
/// from their tagged lines.
pub fn run(cfg: &PressurePdConfig, exe: &Path) -> Result<Report> {
    cfg.validate()?;
    let sc = &cfg.scenario;
    let group = GroupMemory::create(sc.ranks, cfg.slot_bytes()?)?;
    let socket = std::env::temp_dir().join(format!("kvshard-pdp-{}.sock", std::process::id()));
    let mut args = vec!["pd".to_string(), "--scenario".into(), "pressure".into()];
    args.extend(cfg.to_args());
    args.extend([
        "--socket".into(),
        socket.display().to_string(),
        "--group".into(),
        group.proc_path().display().to_string(),
    ]);
    let role = |kind: &str, index: u32| {
        vec![
            "--role".to_string(),
            kind.to_string(),
            "--rank".into(),
            index.to_string(),
        ]
    };
    let roles = (0..cfg.decodes)
        .map(|d| (format!("decode {d}"), role("decode", d)))
        .chain((0..sc.ranks).map(|r| (format!("rank {r}"), role("prefill", r))))
        .collect();
    let lines = run_roles(exe, &args, roles);
    for d in 0..cfg.decodes {
        let _ = std::fs::remove_file(decode_socket(&socket, d));
    }
    drop(group);
    Ok(Report {
        markdown: table(cfg, &lines?),
    })
}

/// The fraction of `window` that `others` cover (each overlap counted once; they may overlap
/// each other, so this is an upper bound of the union, capped at 1).
fn covered(window: (f64, f64), others: &[(f64, f64)]) -> f64 {
    let len = window.1 - window.0;
    if len <= 0.0 {
        return 0.0;
    }
    let sum = others
        .iter()
        .map(|&(a, b)| (b.min(window.1) - a.max(window.0)).max(0.0))
        .fold(0.0, |x, y| x + y);
    (sum / len).min(1.0)
}

/// The report from the processes' tagged lines.
fn table(cfg: &PressurePdConfig, lines: &[(String, String)]) -> String {
    let sc = &cfg.scenario;
    let parsed: Vec<HashMap<String, String>> = lines.iter().map(|(_, l)| fields(l)).collect();
    // Each kind's lines in rank (or decode) order.
    let kind = |k: &'static str| {
        let mut of: Vec<&HashMap<String, String>> = parsed
            .iter()
            .filter(|f| f.get("kind").map(String::as_str) == Some(k))
            .collect();
        let key =
            |f: &HashMap<String, String>| (num(f, "request"), num(f, "rank"), num(f, "decode"));
        of.sort_by(|a, b| {
            key(a)
                .partial_cmp(&key(b))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        of.into_iter()
    };
    let (ceiling_gbps, ceiling_what) = kind("ceiling").next().map_or((0.0, String::new()), |f| {
        (
            num(f, "gbps"),
            f.get("what").cloned().unwrap_or_default().replace('_', " "),
        )
    });
    let share = |gbps: f64| {
        if cfg.cpu || ceiling_gbps <= 0.0 {
            "n/a".to_string()
        } else {
            format!("{:.0}%", 100.0 * gbps / ceiling_gbps)
        }
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "CP{} prefill ranks -> {} decodes, {} layers{}, two {}-token prompts (chunks of {}), a {}-token prefix reloaded from the host; sends: {}; all-gather: {}; ceiling: {ceiling_what}: {ceiling_gbps:.1} GB/s\n",
        sc.ranks,
        cfg.decodes,
        sc.layers,
        if sc.draft { " + MTP draft" } else { "" },
        sc.prompt_tokens,
        sc.chunk,
        sc.prefix_tokens,
        cfg.method,
        if cfg.nccl { "NCCL" } else { "host shared memory" },
    );
    let _ = writeln!(
        out,
        "| prompt | rank | P/D bytes (all decodes) | ms on the rank's stream | GB/s | % of ceiling |"
    );
    let _ = writeln!(out, "|---:|---|---:|---:|---:|---:|");
    for request in [PROMPT_1, PROMPT_2] {
        let sends: Vec<_> = kind("send")
            .filter(|f| num(f, "request") as u64 == request)
            .collect();
        for f in &sends {
            let g = gbps(num(f, "bytes") as u64, num(f, "ms"));
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.2} | {g:.1} | {} |",
                request - 1,
                num(f, "rank"),
                num(f, "bytes"),
                num(f, "ms"),
                share(g)
            );
        }
        // Ranks on GPUs of their own send at once (bytes over the slowest rank); ranks that
        // share a GPU time-slice it without MPS (bytes over the sum of their times).
        let bytes = sends
            .iter()
            .map(|f| num(f, "bytes"))
            .fold(0.0, |a, b| a + b);
        let slowest = sends.iter().map(|f| num(f, "ms")).fold(0.0, f64::max);
        let serial = sends.iter().map(|f| num(f, "ms")).fold(0.0, |a, b| a + b);
        for (what, ms) in [
            ("all, concurrent (bytes / slowest rank)", slowest),
            ("all, serialized (bytes / sum of the ranks' times)", serial),
        ] {
            let g = gbps(bytes as u64, ms);
            let _ = writeln!(
                out,
                "| {} | {what} | {bytes} | {ms:.2} | {g:.1} | {} |",
                request - 1,
                share(g)
            );
        }
    }
    // The rank and the wall-clock window (ms) of every line of kind `k`, from its fields `from`
    // and `to`.
    let windows = |k: &'static str, from: &str, to: &str| -> Vec<(f64, (f64, f64))> {
        kind(k)
            .map(|f| (num(f, "rank"), (num(f, from) / 1e3, num(f, to) / 1e3)))
            .collect()
    };
    let send_windows = windows("send", "first_us", "done_us");
    let h2d = kind("h2d").next().map_or(0.0, |f| num(f, "gbps"));
    let _ = writeln!(
        out,
        "\npinned H2D ceiling (one copy-engine copy, this run): {h2d:.1} GB/s\n\n| rank | prefix reload H2D bytes | ms | GB/s | % of the H2D ceiling | share of the reload during other ranks' P/D sends | during other ranks' reloads |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|");
    let reload_windows = windows("reload", "start_us", "end_us");
    // The share of a rank's reload window other ranks' windows of `windows` cover.
    let during = |rank: f64, window: (f64, f64), windows: &[(f64, (f64, f64))]| {
        let others: Vec<(f64, f64)> = windows
            .iter()
            .filter(|(r, _)| *r != rank)
            .map(|&(_, w)| w)
            .collect();
        if others.is_empty() {
            "n/a (one rank)".to_string()
        } else {
            format!("{:.0}%", 100.0 * covered(window, &others))
        }
    };
    for (f, &(rank, window)) in kind("reload").zip(&reload_windows) {
        let g = gbps(num(f, "bytes") as u64, num(f, "ms"));
        let of_h2d = if cfg.cpu || h2d <= 0.0 {
            "n/a".to_string()
        } else {
            format!("{:.0}%", 100.0 * g / h2d)
        };
        let _ = writeln!(
            out,
            "| {rank} | {} | {:.2} | {g:.1} | {of_h2d} | {} | {} |",
            num(f, "bytes"),
            num(f, "ms"),
            during(rank, window, &send_windows),
            during(rank, window, &reload_windows),
        );
    }
    let _ = writeln!(
        out,
        "\n| prompt | decode | bytes landed | last prefill chunk written -> decode complete (ms) | verified against the unsharded reference |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---|");
    for f in kind("decode") {
        let request = num(f, "request") as u64;
        let last_chunk = kind("send")
            .filter(|s| num(s, "request") as u64 == request)
            .map(|s| num(s, "last_chunk_us"))
            .fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2} | {} |",
            request - 1,
            num(f, "decode"),
            num(f, "bytes"),
            (num(f, "done_us") - last_chunk) / 1e3,
            if f.get("verified").map(String::as_str) == Some("true") {
                "byte-identical"
            } else {
                "NO"
            }
        );
    }
    out
}

/// Whether the ranks of `cfg` can all-gather over NCCL on a machine of `present` GPUs: built
/// with the `nccl` feature, on GPUs, each rank on a GPU of its own, libnccl loadable.
pub fn nccl_possible(cfg: &PressurePdConfig, present: usize) -> bool {
    cfg!(feature = "nccl") && !cfg.cpu && cfg.ranks_on_distinct_gpus(present) && nccl_present()
}

#[cfg(feature = "nccl")]
fn nccl_present() -> bool {
    crate::nccl::nccl_present()
}

#[cfg(not(feature = "nccl"))]
fn nccl_present() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_sit_on_the_seed_topology_or_share_the_gpus_there_are() {
        let cfg = PressurePdConfig::default_for(false);
        let on = |present| {
            let ranks: Vec<usize> = (0..2)
                .map(|r| cfg.gpu_of(PressureRole::Rank(r), present))
                .collect();
            let decodes: Vec<usize> = (0..2)
                .map(|d| cfg.gpu_of(PressureRole::Decode(d), present))
                .collect();
            (ranks, decodes)
        };
        assert_eq!(on(4), (vec![0, 1], vec![2, 3]));
        assert_eq!(on(3), (vec![0, 1], vec![2, 2]));
        assert_eq!(on(2), (vec![0, 1], vec![1, 1]));
        assert_eq!(on(1), (vec![0, 0], vec![0, 0]));
        assert!(cfg.ranks_on_distinct_gpus(2));
        assert!(!cfg.ranks_on_distinct_gpus(1));
        let named = PressurePdConfig {
            gpus: vec![3, 2, 1, 0],
            ..cfg.clone()
        };
        assert_eq!(named.gpu_of(PressureRole::Rank(0), 4), 3);
        assert_eq!(named.gpu_of(PressureRole::Decode(1), 4), 0);
    }

    #[test]
    fn a_run_that_cannot_work_is_refused_before_any_process_starts() {
        let cpu = PressurePdConfig::default_for(true);
        assert!(cpu.validate().is_ok());
        let mut bad = vec![
            PressurePdConfig {
                decodes: 0,
                ..cpu.clone()
            },
            PressurePdConfig {
                nccl: true,
                ..cpu.clone()
            },
            PressurePdConfig {
                gpus: vec![0, 1],
                ..cpu.clone()
            },
        ];
        let mut ranks = cpu.clone();
        ranks.scenario.ranks = 3;
        bad.push(ranks);
        for cfg in bad {
            assert!(
                matches!(cfg.validate(), Err(Error::InvalidArgument(_))),
                "{cfg:?}"
            );
        }
    }

    #[test]
    fn the_reload_overlap_is_the_covered_share_of_its_window() {
        assert_eq!(covered((0.0, 10.0), &[]), 0.0);
        assert_eq!(covered((0.0, 10.0), &[(5.0, 20.0)]), 0.5);
        assert_eq!(covered((0.0, 10.0), &[(-5.0, 20.0), (2.0, 3.0)]), 1.0);
        assert_eq!(covered((4.0, 4.0), &[(0.0, 9.0)]), 0.0);
    }
}
