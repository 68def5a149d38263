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

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, MemoryKind};
use kvshard::chain::RequestChain;
use kvshard::copy::{BlockSpace, Method};
use kvshard::ipc::group::GroupMemory;
use kvshard::ipc::{ExportedPool, Liveness, PeerBackend};
use kvshard::pool::DevicePool;
use kvshard::shard::{Placement, ShardAllocator};
use kvshard::transfer::{
    ChunkEnd, DecodeEndpoint, Finished, PoolLayout, PrefillEndpoint, PrefillEvent, Registration,
};
use kvshard::{Error, Result};

use super::message::Message;
use super::{
    blocks, ceiling, check_method, layer_range, method_name, rank0_gpu, run_roles, shape_args,
    socket_path, verify_landed, DecodeWatch, Processes, Report, Role, REQUEST_TIMEOUT, STARTUP,
};
use crate::demo::pressure::{
    run_scenario, AllGather, Local, Prompts, Scenario, PROMPT_1, PROMPT_2,
};
use crate::measure::{copy_sync, gbps, Ceiling, Laps, Moved, Timer};
use crate::scenario::{Platform, PressureConfig};
use crate::synth::POISON;

/// One run of the scenario across processes, identical in every process of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PressurePdConfig {
    /// The scenario every process drives (its ranks are the prefill processes).
    pub scenario: PressureConfig,
    /// Where the processes run: the decodes each hold the full unsharded cache and receive
    /// every prompt.
    pub processes: Processes,
    /// How ranks send chunks to the decodes.
    pub method: Method,
    /// Whether the ranks all-gather over NCCL (GPUs, one rank per GPU) instead of through host
    /// shared memory.
    pub nccl: bool,
}

impl PressurePdConfig {
    /// The default for the CPU twin (the scenario's CPU shape, seconds) or GPUs (61 layers and
    /// the draft, one-launch sends with 132 CTAs): CP2 and two decodes, the seed's topology.
    pub fn default_for(platform: Platform) -> Self {
        Self {
            scenario: PressureConfig::default_for(platform),
            processes: Processes::new(platform, 2),
            method: blocks(if platform.is_gpu() { 132 } else { 2 }),
            nccl: false,
        }
    }

    /// Checks the run makes sense before any process starts.
    pub fn validate(&self) -> Result<()> {
        self.scenario.pages_per_rank()?;
        self.processes.check(self.scenario.shape.ranks)?;
        if !self.processes.platform.is_gpu() && self.nccl {
            return Err(Error::InvalidArgument(
                "pd pressure: NCCL needs GPUs".into(),
            ));
        }
        check_method(&self.method)
    }

    /// Pages of each decode's pool: both prompts, registered up front with a poisoned page
    /// before, between and after them (a write past a request's pages shows), and page 0.
    pub fn decode_pages(&self) -> u64 {
        (2 * self
            .scenario
            .prompt_tokens
            .div_ceil(kvshard::geometry::PAGE_SIZE)
            + 4) as u64
    }

    /// Bytes the run needs, device then host, over every process: each rank's pool, reference,
    /// staging, send buffers and scratch, each decode's pool and reference; each rank's host
    /// pool and the group memory. An estimate (tables and small buffers left out).
    pub fn memory(&self) -> Result<(u64, u64)> {
        let sc = &self.scenario;
        let over = |what: &str| Error::Overflow {
            what: format!("the pressure run's {what}"),
        };
        let mul = |a: u64, b: u64, what: &str| a.checked_mul(b).ok_or_else(|| over(what));
        let add = |a: u64, b: u64, what: &str| a.checked_add(b).ok_or_else(|| over(what));
        let page = sc.shape.geometry().page_bytes_checked()? as u64;
        let per_rank = sc.pages_per_rank()?;
        let reference = sc.reference_pages();
        let chunk = sc.chunk.div_ceil(kvshard::geometry::PAGE_SIZE) as u64;
        let (_, layout) = sc.scratch()?;
        let scratch = layout.map_or(0, |l| l.pages() + 2 * l.prefix_pages());
        let ranks = u64::from(sc.shape.ranks);
        let sends = mul(sc.send_pages()?, ranks, "send pages")?;
        let rank_pages = [reference, chunk, scratch, sends]
            .into_iter()
            .try_fold(per_rank, |a, b| add(a, b, "pages per rank"))?;
        let decode_pages = add(self.decode_pages(), reference + chunk, "pages per decode")?;
        let pages = add(
            mul(ranks, rank_pages, "pages")?,
            mul(u64::from(self.processes.decodes), decode_pages, "pages")?,
            "pages",
        )?;
        let host_pages = mul(
            ranks,
            mul(per_rank, sc.host_factor, "host pages")?,
            "host pages",
        )?;
        let group = kvshard::ipc::group::group_bytes(sc.shape.ranks, self.slot_bytes()?)? as u64;
        Ok((
            mul(pages, page, "device bytes")?,
            add(mul(host_pages, page, "host bytes")?, group, "host bytes")?,
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
        let mut args = shape_args(&self.scenario.shape);
        args.extend(self.processes.to_args());
        args.extend([
            "--decodes".into(),
            self.processes.decodes.to_string(),
            "--methods".into(),
            method_name(&self.method),
            "--all-gather".into(),
            if self.nccl { "nccl" } else { "host" }.into(),
        ]);
        args
    }
}

fn decode_socket(base: &Path, decode: u32) -> PathBuf {
    let mut path = base.as_os_str().to_owned();
    path.push(format!(".{decode}"));
    path.into()
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

/// The platform `backend` runs on.
fn platform(backend: &PeerBackend) -> Platform {
    match backend {
        PeerBackend::Cpu(_) => Platform::Cpu,
        PeerBackend::Cuda(_) => Platform::Gpu,
    }
}

// ---------------------------------------------------------------------------------------------
// A prefill rank.
// ---------------------------------------------------------------------------------------------

/// A rank's sends: every prompt chunk to every decode, as soon as it is written.
struct RankSends {
    endpoints: Vec<PrefillEndpoint>,
    b: Arc<dyn Backend>,
    /// Each chunk's sends of the prompt being prefilled, on the rank's stream.
    laps: Laps,
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
        let done = SystemTime::now();
        let moved = Moved {
            bytes: self.bytes() - self.bytes_before,
            ms: self.laps.total_ms_sync(self.b.as_ref())?,
        };
        Message::PromptSent {
            request,
            moved,
            first: self.first.take().unwrap_or(done),
            last_chunk: self.last_chunk.take().unwrap_or(done),
            done,
        }
        .emit();
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
    let mut sends = RankSends {
        endpoints,
        b: b.clone(),
        laps: Laps::default(),
        first: None,
        last_chunk: None,
        bytes_before: 0,
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
        &mut sends,
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
    let (p, ranks) = (&cfg.processes, sc.shape.ranks);
    let backend = p.open_backend(ranks, Role::Decode(index))?;
    let b = backend.backend();
    if index == 0 {
        Message::Ceiling(ceiling(&backend, rank0_gpu(p, ranks)?)?).emit();
        Message::H2dCeiling(h2d_ceiling(&backend)?).emit();
    }
    let g = sc.shape.geometry();
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
        ranks,
        Liveness::default(),
    )?;
    endpoint.set_deadline(p.deadline);
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
            Registration::of_chain(&chain, request, PoolLayout::of(&pool), 0)?,
        )?;
    }
    let mut watch = DecodeWatch::new(endpoint);
    let landed = [watch.wait_sync(PROMPT_1)?, watch.wait_sync(PROMPT_2)?];
    let mut replay = Replay::default();
    let local = Local {
        pools: Vec::new(),
        all_gather: AllGather::InProcess,
        storage_dir: None,
    };
    let route = platform(&backend).route();
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
            "request {request} landed equal to the reference, block for block (checked in {:.1} ms)",
            check.elapsed().as_secs_f64() * 1e3
        );
        Message::Landed {
            request,
            bytes: finished.total_bytes().total(),
            done,
        }
        .emit();
    }
    Ok(())
}

/// The pinned host-to-device ceiling the reloads are measured against: one copy-engine copy of
/// 1 GiB (32 MiB on the CPU twin, indicative only) from pinned host memory, best of four.
fn h2d_ceiling(backend: &PeerBackend) -> Result<Ceiling> {
    let hardware = platform(backend).is_gpu();
    let len: usize = if hardware { 1 << 30 } else { 32 << 20 };
    let b = backend.backend();
    let t = copy_sync(
        &Timer::new(b.as_ref()),
        MemoryKind::PinnedHost,
        MemoryKind::Device,
        len,
        4,
    )?;
    Ok(Ceiling {
        what: format!("pinned H2D, one copy-engine copy of {} MiB", len >> 20),
        gbps: t.best_gbps(),
        hardware,
    })
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

/// Runs `cfg`: creates the CP group memory, starts the ranks and the decodes
/// (`exe pd --scenario pressure --role ...`), forwards what they print, and builds the report
/// from their messages.
pub fn run(cfg: &PressurePdConfig, exe: &Path) -> Result<Report> {
    cfg.validate()?;
    let ranks = cfg.scenario.shape.ranks;
    let decodes = cfg.processes.decodes;
    let group = GroupMemory::create(ranks, cfg.slot_bytes()?)?;
    let socket = socket_path("pdp");
    let mut args = vec!["pd".to_string(), "--scenario".into(), "pressure".into()];
    args.extend(cfg.to_args());
    args.extend([
        "--socket".into(),
        socket.display().to_string(),
        "--group".into(),
        group.proc_path().display().to_string(),
    ]);
    let roles = (0..decodes)
        .map(Role::Decode)
        .chain((0..ranks).map(Role::Rank))
        .collect();
    // The storage step's directory, shared by the ranks: private to this run (a random name,
    // mode 0700), named to them, removed once they have exited.
    #[cfg(feature = "nixl")]
    let storage = crate::demo::pressure::storage::group_directory()?;
    #[cfg(feature = "nixl")]
    args.extend(["--storage-dir".into(), storage.path().display().to_string()]);
    let messages = run_roles(exe, &args, roles);
    #[cfg(feature = "nixl")]
    drop(storage);
    for d in 0..decodes {
        let _ = std::fs::remove_file(decode_socket(&socket, d));
    }
    drop(group);
    let shared_gpu = cfg.processes.ranks_share_a_gpu(ranks);
    Ok(Report {
        markdown: table(cfg, &messages?, shared_gpu),
    })
}

/// Milliseconds since the Unix epoch: the processes of a run share the host's wall clock.
fn wall_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
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

/// Milliseconds covered by at least one of `windows` (start, end).
fn union_ms(mut windows: Vec<(f64, f64)>) -> f64 {
    windows.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut open: Option<(f64, f64)> = None;
    for (a, b) in windows {
        open = match open {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + open.map_or(0.0, |(s, e)| e - s)
}

/// A rank's P/D of one prompt, as its message says.
struct PromptSend {
    rank: u32,
    request: u64,
    moved: Moved,
    window: (f64, f64),
    last_chunk: f64,
}

/// The report from the processes' messages.
/// The run's tables; `shared_gpu` when the prefill ranks share a GPU (and its host link).
fn table(cfg: &PressurePdConfig, messages: &[(Role, Message)], shared_gpu: bool) -> String {
    let sc = &cfg.scenario;
    // Messages in rank (or decode) order, whatever order the pipes delivered them in.
    let mut messages: Vec<&(Role, Message)> = messages.iter().collect();
    messages.sort_by_key(|(role, _)| *role);
    let none = |what: &str| Ceiling {
        what: format!("no {what} measured"),
        gbps: 0.0,
        hardware: false,
    };
    let copy = messages
        .iter()
        .find_map(|(_, m)| match m {
            Message::Ceiling(c) => Some(c.clone()),
            _ => None,
        })
        .unwrap_or_else(|| none("copy ceiling"));
    let h2d = messages
        .iter()
        .find_map(|(_, m)| match m {
            Message::H2dCeiling(c) => Some(c.clone()),
            _ => None,
        })
        .unwrap_or_else(|| none("H2D ceiling"));
    let sends: Vec<PromptSend> = messages
        .iter()
        .filter_map(|(role, m)| match (role, m) {
            (
                Role::Rank(rank),
                Message::PromptSent {
                    request,
                    moved,
                    first,
                    last_chunk,
                    done,
                },
            ) => Some(PromptSend {
                rank: *rank,
                request: *request,
                moved: *moved,
                window: (wall_ms(*first), wall_ms(*done)),
                last_chunk: wall_ms(*last_chunk),
            }),
            _ => None,
        })
        .collect();
    let reloads: Vec<(u32, Moved, (f64, f64))> = messages
        .iter()
        .filter_map(|(role, m)| match (role, m) {
            (Role::Rank(rank), Message::Reloaded { moved, start, end }) => {
                Some((*rank, *moved, (wall_ms(*start), wall_ms(*end))))
            }
            _ => None,
        })
        .collect();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} prefill ranks -> {} decodes, two {}-token prompts (chunks of {}), a {}-token prefix reloaded from the host; sends: {}; all-gather: {}; ceiling: {copy}\n",
        sc.shape,
        sc.shape.ranks,
        cfg.processes.decodes,
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
        let of: Vec<&PromptSend> = sends.iter().filter(|s| s.request == request).collect();
        for s in &of {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.2} | {:.1} | {} |",
                request - 1,
                s.rank,
                s.moved.bytes,
                s.moved.ms,
                s.moved.gbps(),
                copy.share(s.moved.gbps())
            );
        }
        // Ranks on GPUs of their own send at once (bytes over the slowest rank); ranks that
        // share a GPU time-slice it without MPS (bytes over the sum of their times).
        let bytes: u64 = of.iter().map(|s| s.moved.bytes).sum();
        let slowest = of.iter().map(|s| s.moved.ms).fold(0.0, f64::max);
        let serial: f64 = of.iter().map(|s| s.moved.ms).sum();
        for (what, ms) in [
            ("all, concurrent (bytes / slowest rank)", slowest),
            ("all, serialized (bytes / sum of the ranks' times)", serial),
        ] {
            let g = gbps(bytes, ms);
            let _ = writeln!(
                out,
                "| {} | {what} | {bytes} | {ms:.2} | {g:.1} | {} |",
                request - 1,
                copy.share(g)
            );
        }
    }
    let _ = writeln!(
        out,
        "\npinned H2D ceiling (this run): {h2d}\n\n| rank | prefix reload H2D bytes | ms | GB/s | % of the H2D ceiling | share of the reload during other ranks' P/D sends | during other ranks' reloads |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|");
    // The share of a rank's reload window that other ranks' windows cover.
    let during = |rank: u32, window: (f64, f64), windows: &[(u32, (f64, f64))]| {
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
    let send_windows: Vec<(u32, (f64, f64))> = sends.iter().map(|s| (s.rank, s.window)).collect();
    let reload_windows: Vec<(u32, (f64, f64))> = reloads.iter().map(|r| (r.0, r.2)).collect();
    for &(rank, moved, window) in &reloads {
        let _ = writeln!(
            out,
            "| {rank} | {} | {:.2} | {:.1} | {} | {} | {} |",
            moved.bytes,
            moved.ms,
            moved.gbps(),
            h2d.share(moved.gbps()),
            during(rank, window, &send_windows),
            during(rank, window, &reload_windows),
        );
    }
    // Ranks that share a GPU share its host link: their reloads together are what the link
    // delivered, bytes over the time some reload was running (the union of the wall-clock
    // windows: reloads apart in time do not count the gap between them).
    if reloads.len() > 1 && shared_gpu {
        let bytes: u64 = reloads.iter().map(|r| r.1.bytes).sum();
        let busy = union_ms(reload_windows.iter().map(|&(_, w)| w).collect());
        let g = gbps(bytes, busy);
        let _ = writeln!(
            out,
            "| all, one shared link (bytes / union of the windows) | {bytes} | {busy:.2} | {g:.1} | {} | | |",
            h2d.share(g)
        );
    }
    let _ = writeln!(
        out,
        "\n| prompt | decode | bytes landed | last prefill chunk written -> decode complete (ms) | verified against the unsharded reference |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---|");
    let mut landed: Vec<(u64, u32, u64, SystemTime)> = messages
        .iter()
        .filter_map(|(role, m)| match (role, m) {
            (
                Role::Decode(decode),
                Message::Landed {
                    request,
                    bytes,
                    done,
                },
            ) => Some((*request, *decode, *bytes, *done)),
            _ => None,
        })
        .collect();
    landed.sort_by_key(|&(request, decode, ..)| (request, decode));
    for (request, decode, bytes, done) in landed {
        let last_chunk = sends
            .iter()
            .filter(|s| s.request == request)
            .map(|s| s.last_chunk)
            .fold(0.0, f64::max);
        // A decode reports a prompt only once every block of it equals the reference's.
        let _ = writeln!(
            out,
            "| {} | {decode} | {bytes} | {:.2} | byte-identical |",
            request - 1,
            wall_ms(done) - last_chunk,
        );
    }
    // The storage step, as each rank reported it.
    let storage: Vec<(u32, &String)> = messages
        .iter()
        .filter_map(|(role, m)| match (role, m) {
            (Role::Rank(rank), Message::Storage { lines }) => {
                Some(lines.iter().map(move |l| (*rank, l)))
            }
            _ => None,
        })
        .flatten()
        .collect();
    if !storage.is_empty() {
        let _ = writeln!(
            out,
            "\n| rank | storage step (the prefix L2 -> L3 -> L2 -> L1) |"
        );
        let _ = writeln!(out, "|---:|---|");
        for (rank, line) in storage {
            let _ = writeln!(out, "| {rank} | {} |", line.trim_start_matches("storage: "));
        }
    }
    out
}

/// Whether the ranks of `cfg` can all-gather over NCCL on a machine of `present` GPUs: built
/// with the `nccl` feature, on GPUs, each rank on a GPU of its own, libnccl loadable.
pub fn nccl_possible(cfg: &PressurePdConfig, present: usize) -> bool {
    let p = &cfg.processes;
    cfg!(feature = "nccl")
        && p.platform.is_gpu()
        && p.ranks_on_distinct_gpus(cfg.scenario.shape.ranks, present)
        && nccl_present()
}

#[cfg(feature = "nccl")]
fn nccl_present() -> bool {
    kvshard::nccl::nccl_present()
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
        let cfg = PressurePdConfig::default_for(Platform::Gpu);
        let p = &cfg.processes;
        let on = |present| {
            let ranks: Vec<usize> = (0..2)
                .map(|r| p.gpu_of(2, Role::Rank(r), present))
                .collect();
            let decodes: Vec<usize> = (0..2)
                .map(|d| p.gpu_of(2, Role::Decode(d), present))
                .collect();
            (ranks, decodes)
        };
        assert_eq!(on(4), (vec![0, 1], vec![2, 3]));
        assert_eq!(on(3), (vec![0, 1], vec![2, 2]));
        assert_eq!(on(2), (vec![0, 1], vec![1, 1]));
        assert_eq!(on(1), (vec![0, 0], vec![0, 0]));
        assert!(p.ranks_on_distinct_gpus(2, 2));
        assert!(!p.ranks_on_distinct_gpus(2, 1));
        let named = Processes {
            gpus: vec![3, 2, 1, 0],
            ..p.clone()
        };
        assert_eq!(named.gpu_of(2, Role::Rank(0), 4), 3);
        assert_eq!(named.gpu_of(2, Role::Decode(1), 4), 0);
    }

    #[test]
    fn a_run_that_cannot_work_is_refused_before_any_process_starts() {
        let cpu = PressurePdConfig::default_for(Platform::Cpu);
        assert!(cpu.validate().is_ok());
        let mut bad = vec![
            PressurePdConfig {
                nccl: true,
                ..cpu.clone()
            },
            PressurePdConfig {
                method: blocks(0),
                ..cpu.clone()
            },
        ];
        for decodes in [0, super::super::MAX_DECODES + 1] {
            let mut c = cpu.clone();
            c.processes.decodes = decodes;
            bad.push(c);
        }
        // GPUs named for a run on the CPU twin, or for a GPU run, not one per process.
        let mut c = cpu.clone();
        c.processes.gpus = vec![0, 0, 0, 0];
        bad.push(c);
        let mut c = PressurePdConfig::default_for(Platform::Gpu);
        c.processes.gpus = vec![0, 1];
        bad.push(c);
        let mut c = cpu.clone();
        c.processes.deadline = Duration::ZERO;
        bad.push(c);
        let mut c = cpu.clone();
        c.scenario.shape.ranks = 3;
        bad.push(c);
        for cfg in bad {
            assert!(
                matches!(cfg.validate(), Err(Error::InvalidArgument(_))),
                "{cfg:?}"
            );
        }
    }

    #[test]
    fn the_union_of_windows_leaves_out_the_gaps_between_them() {
        assert_eq!(union_ms(vec![(10.0, 12.0), (0.0, 2.0), (1.0, 3.0)]), 5.0);
        assert_eq!(union_ms(vec![(0.0, 10.0), (2.0, 3.0)]), 10.0);
        assert_eq!(union_ms(Vec::new()), 0.0);
    }

    #[test]
    fn the_reload_overlap_is_the_covered_share_of_its_window() {
        assert_eq!(covered((0.0, 10.0), &[]), 0.0);
        assert_eq!(covered((0.0, 10.0), &[(5.0, 20.0)]), 0.5);
        assert_eq!(covered((0.0, 10.0), &[(-5.0, 20.0), (2.0, 3.0)]), 1.0);
        assert_eq!(covered((4.0, 4.0), &[(0.0, 9.0)]), 0.0);
    }

    #[test]
    fn the_report_reads_every_message_of_the_run() {
        let cfg = PressurePdConfig::default_for(Platform::Gpu);
        let t = UNIX_EPOCH + Duration::from_secs(1_000);
        let ms = |n: u64| t + Duration::from_millis(n);
        let moved = |bytes, ms| Moved { bytes, ms };
        let mut messages = vec![
            (
                Role::Decode(0),
                Message::Ceiling(Ceiling {
                    what: "local D2D copy on GPU 0, 1 GiB".into(),
                    gbps: 2000.0,
                    hardware: true,
                }),
            ),
            (
                Role::Decode(0),
                Message::H2dCeiling(Ceiling {
                    what: "pinned H2D".into(),
                    gbps: 50.0,
                    hardware: true,
                }),
            ),
        ];
        for (rank, start) in [(0, 0), (1, 5)] {
            messages.push((
                Role::Rank(rank),
                Message::Reloaded {
                    moved: moved(25_000_000, 1.0),
                    start: ms(start),
                    end: ms(start + 10),
                },
            ));
            for request in [PROMPT_1, PROMPT_2] {
                messages.push((
                    Role::Rank(rank),
                    Message::PromptSent {
                        request,
                        moved: moved(1_000_000_000, 1.0 + f64::from(rank)),
                        first: ms(0),
                        last_chunk: ms(20),
                        done: ms(30),
                    },
                ));
            }
        }
        for decode in [0, 1] {
            for request in [PROMPT_1, PROMPT_2] {
                messages.push((
                    Role::Decode(decode),
                    Message::Landed {
                        request,
                        bytes: 2_000_000_000,
                        done: ms(32),
                    },
                ));
            }
        }
        // The order the pipes deliver does not matter.
        messages.reverse();
        let table = table(&cfg, &messages, true);
        assert!(
            table.contains("ceiling: local D2D copy on GPU 0, 1 GiB: 2000.0 GB/s"),
            "{table}"
        );
        // Rank 1 moved 1 GB in 2 ms: 500 GB/s, a quarter of the copy ceiling.
        assert!(
            table.contains("| 1 | 1 | 1000000000 | 2.00 | 500.0 | 25% |"),
            "{table}"
        );
        assert!(
            table.contains(
                "| 1 | all, concurrent (bytes / slowest rank) | 2000000000 | 2.00 | 1000.0 | 50% |"
            ),
            "{table}"
        );
        // Each reload: 25 GB/s, half the H2D ceiling; rank 0's window (0-10 ms) lies inside
        // rank 1's sends and half inside rank 1's reload (5-15 ms).
        assert!(
            table.contains("| 0 | 25000000 | 1.00 | 25.0 | 50% | 100% | 50% |"),
            "{table}"
        );
        // Together, over the union of both windows (0-15 ms): 50 MB in 15 ms on the one link.
        assert!(
            table.contains(
                "| all, one shared link (bytes / union of the windows) | 50000000 | 15.00 | 3.3 | 7% | | |"
            ),
            "{table}"
        );
        assert!(!super::table(&cfg, &messages, false).contains("one shared link"));
        assert_eq!(table.matches("| byte-identical |").count(), 4, "{table}");
        // 12 ms after the last chunk was written, decode 1 had prompt 1.
        assert!(
            table.contains("| 1 | 1 | 2000000000 | 12.00 | byte-identical |"),
            "{table}"
        );
    }
}
