//! P/D across processes: a decode and N = 2 prefill processes over the real protocol
//! ([`DecodeEndpoint`], [`PrefillEndpoint`]), on the CPU twin (memfd pools, CI) and on one GPU
//! (two processes, same-device IPC; these print SKIPPED without a GPU).
//!
//! - the bytes a multi-process run leaves in the decode pool equal the in-process reference
//!   (the same requests sent in one process with `BackendTransport` into a local pool);
//! - a prefill process killed mid-request is detected within a second, the request fails on the
//!   decode, its pages come back, and a restarted rank serves the next request;
//! - a decode process killed mid-request is detected by every prefill within a second, which
//!   fails the request, unmaps the decode pool and returns its pages;
//! - a prefill rank that never sends its final chunk fails `kvshard pd`'s decode within its
//!   deadline, with the error naming the request, the rank and the chunks that never came.
//!
//! Peer processes are this test binary run again with `--exact child_entry` and the role in
//! `KVSHARD_PD_CHILD`; `child_entry` does nothing in an ordinary run.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Launch};
use kvshard::chain::RequestChain;
use kvshard::copy::{BlockSpace, Method, RemoteSpace};
use kvshard::index::LogicalPage;
use kvshard::ipc::{ExportedPool, Liveness, PeerBackend};
use kvshard::pool::DevicePool;
use kvshard::shard::{Placement, ShardAllocator};
use kvshard::transfer::{
    BackendTransport, ChunkEnd, DecodeEndpoint, DecodeEvent, Finished, MissingChunks, Outcome,
    PoolLayout, PrefillEndpoint, PrefillEvent, Receiver, Registration, Sender,
};
use kvshard::Error;
use kvshard_cli::pd::{self, PdConfig};
use kvshard_cli::scenario::Platform;
use kvshard_cli::synth::POISON;
use rand::Rng;

const CHILD: &str = "KVSHARD_PD_CHILD";
const SOCKET: &str = "KVSHARD_PD_SOCKET";
const RANK: &str = "KVSHARD_PD_RANK";
const SEED: &str = "KVSHARD_PD_SEED";
const SCENARIO: &str = "KVSHARD_PD_SCENARIO";
const PACE: &str = "KVSHARD_PD_PACE_MS";
/// What a prefill child must have seen when the decode closes: `served,failed`.
const EXPECT: &str = "KVSHARD_PD_EXPECT";
/// Generous: a child has to start, fill its pool, and on a GPU create its context.
const STARTUP: Duration = Duration::from_secs(60);
/// How fast a gone peer must be noticed.
const DETECT: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------------------------------------
// Scenarios: every process derives the same configuration from the scenario's name and seed.

fn config(scenario: &str, seed: u64, cpu: bool) -> PdConfig {
    let mut cfg = PdConfig::default_for(Platform::Gpu);
    cfg.processes.platform = if cpu { Platform::Cpu } else { Platform::Gpu };
    cfg.shape.seed = seed;
    cfg.shape.ranks = 2;
    cfg.shape.layers = 4;
    cfg.shape.draft = true;
    cfg.processes.gpus = if cpu { Vec::new() } else { vec![0, 0, 0] };
    let blocks = Method::Kernel(Launch {
        ctas: 2,
        threads: 256,
    });
    match scenario {
        // Three sizes x three methods, chunks of 3 pages: short chunks, empty ones (a rank
        // owning nothing of a chunk), one-page requests.
        "reference" => {
            cfg.pages = vec![1, 7, 13];
            cfg.chunk_pages = 3;
            cfg.methods = vec![blocks, Method::CopyEngine, Method::PerBlock];
            // On a GPU, the second iteration goes into a pool shared by legacy IPC handles.
            cfg.iterations = if cpu { 1 } else { 2 };
        }
        // One request of 6 chunks, whose final chunk one rank never sends.
        "skip" => {
            cfg.pages = vec![12];
            cfg.chunk_pages = 2;
            cfg.methods = vec![blocks];
            cfg.iterations = 1;
        }
        // Requests of 6 chunks, sent slowly enough to be killed mid-way; two iterations: the
        // killed one and the one after.
        _ => {
            cfg.pages = vec![12];
            cfg.chunk_pages = 2;
            cfg.methods = vec![blocks];
            cfg.iterations = 2;
        }
    }
    cfg
}

fn env_u64(name: &str) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn socket_path(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvshard-pd-{}-{test}.sock", std::process::id()))
}

/// A child process, killed and reaped if the test ends before it does.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Spawn<'a> {
    role: &'a str,
    scenario: &'a str,
    socket: &'a Path,
    seed: u64,
    cpu: bool,
    rank: u32,
    pace_ms: u64,
    expect: &'a str,
}

impl Spawn<'_> {
    fn start(&self) -> Peer {
        let child = Command::new(std::env::current_exe().expect("test binary path"))
            .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env(CHILD, self.role)
            .env(SCENARIO, self.scenario)
            .env(SOCKET, self.socket)
            .env(SEED, self.seed.to_string())
            .env(RANK, self.rank.to_string())
            .env(PACE, self.pace_ms.to_string())
            .env(EXPECT, self.expect)
            .env("KVSHARD_PD_CPU", if self.cpu { "1" } else { "0" })
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child test process");
        Peer(child)
    }
}

impl Peer {
    /// Waits (bounded) for the child to exit and asserts it succeeded.
    fn finish(mut self, what: &str) {
        let deadline = Instant::now() + STARTUP;
        loop {
            match self.0.try_wait().expect("wait for child") {
                Some(status) => {
                    assert!(status.success(), "{what}: child exited with {status}");
                    return;
                }
                None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                None => panic!("{what}: child still running after {STARTUP:?}"),
            }
        }
    }
}

/// Decode pool mappings of this process (what a prefill must drop when the decode is gone).
fn memfd_pool_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("memfd:kvshard-pd-pool"))
        .count()
}

// ---------------------------------------------------------------------------------------------
// Child side

/// Entry point of every child process; a no-op in an ordinary run.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let scenario = std::env::var(SCENARIO).expect("scenario");
    let socket = PathBuf::from(std::env::var(SOCKET).expect("socket"));
    let cpu = std::env::var("KVSHARD_PD_CPU").as_deref() == Ok("1");
    let mut cfg = config(&scenario, env_u64(SEED), cpu);
    cfg.pace = Duration::from_millis(env_u64(PACE));
    match role.as_str() {
        "prefill" => child_prefill(&cfg, &socket),
        "decode" => child_decode(&cfg, &socket),
        "skip-final" => child_skip_final(&cfg, &socket),
        other => panic!("unknown child role {other}"),
    }
}

/// Where a rank that skips its final chunk says it has sent every other chunk of request 1.
fn skipped(socket: &Path) -> PathBuf {
    socket.with_extension("final-skipped")
}

/// A prefill rank that sends every chunk of request 1 but the final one, then stays connected
/// (heartbeats and all: silent only about the request) until the decode closes.
fn child_skip_final(cfg: &PdConfig, socket: &Path) {
    let rank = env_u64(RANK) as u32;
    let backend = backend(!cfg.processes.platform.is_gpu()).expect("backend");
    let b = backend.backend();
    let placement = Placement::new(cfg.shape.ranks).unwrap();
    let pool = Arc::new(
        DevicePool::allocate(
            b.as_ref(),
            &cfg.shape.geometry(),
            placement,
            rank,
            cfg.prefill_pages(),
        )
        .unwrap(),
    );
    pd::fill_pool_sync(b.as_ref(), &pool, &pd::pattern(cfg)).unwrap();
    let mut endpoint = PrefillEndpoint::connect(
        socket,
        backend,
        pool,
        cfg.methods[0],
        Liveness::default(),
        STARTUP,
    )
    .expect("connect");
    let start = Instant::now();
    while !endpoint
        .poll_sync(Duration::from_millis(20))
        .unwrap()
        .contains(&PrefillEvent::Registered { request: 1 })
    {
        assert!(start.elapsed() < STARTUP, "request 1 never registered");
    }
    let chain = cfg.prefill_chain(cfg.pages[0]).unwrap();
    let ends = cfg.chunk_ends(PdConfig::tokens(cfg.pages[0]));
    for &end in &ends[..ends.len() - 1] {
        endpoint.send(1, chain.pages().unwrap(), end).unwrap();
    }
    std::fs::write(skipped(socket), b"").expect("marker");
    // The decode gives the request up at its deadline (an abort this rank answers), then
    // closes the connection.
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < STARTUP, "the decode never closed");
        let events = endpoint.poll_sync(Duration::from_millis(20)).unwrap();
        if events
            .iter()
            .any(|e| matches!(e, PrefillEvent::Closed { .. }))
        {
            return;
        }
    }
}

fn child_prefill(cfg: &PdConfig, socket: &Path) {
    let rank = env_u64(RANK) as u32;
    let summary = pd::prefill_role(cfg, socket, rank).expect("prefill role");
    let expect = std::env::var(EXPECT).unwrap_or_default();
    let (served, failed) = expect.split_once(',').expect("expectation");
    assert_eq!(
        summary.served.to_string(),
        served,
        "rank {rank}: {summary:?}"
    );
    assert_eq!(
        summary.failed.len().to_string(),
        failed,
        "rank {rank}: {summary:?}"
    );
    assert_eq!(summary.mapped_after_close, 0, "rank {rank}: {summary:?}");
    if !cfg.processes.platform.is_gpu() {
        assert_eq!(
            memfd_pool_mappings(),
            0,
            "rank {rank}: the decode pool is still mapped"
        );
    }
}

/// Where a decode child says every rank has landed a chunk of request 1.
fn marker(socket: &Path) -> PathBuf {
    socket.with_extension("mid-request")
}

/// A decode that registers request 1 and serves until it is killed; once every rank has landed
/// a chunk of it, it says so (the request is then in flight on every rank).
fn child_decode(cfg: &PdConfig, socket: &Path) {
    let backend = backend(!cfg.processes.platform.is_gpu()).expect("decode backend");
    let exported = Arc::new(
        ExportedPool::allocate(
            &backend,
            &cfg.shape.geometry(),
            Placement::unsharded(),
            0,
            cfg.decode_pages(),
        )
        .expect("decode pool"),
    );
    let mut endpoint =
        DecodeEndpoint::bind(socket, backend, cfg.shape.ranks, Liveness::default()).expect("bind");
    endpoint.wait_for_ranks_sync(STARTUP).expect("ranks");
    let pool = endpoint.publish(exported.clone()).expect("publish");
    let (registration, _) = decode_registration(cfg, exported.pool(), 1, 0);
    endpoint.register(pool, registration).expect("register");
    let mut said = false;
    loop {
        endpoint.poll_sync(Duration::from_millis(10)).expect("poll");
        let landed = endpoint.chunks_landed(1).unwrap_or_default();
        if !said && landed.iter().all(|&c| c >= 1) {
            std::fs::write(marker(socket), b"").expect("marker");
            said = true;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Parent-side helpers

fn backend(cpu: bool) -> kvshard::Result<PeerBackend> {
    if cpu {
        return Ok(PeerBackend::Cpu(Arc::new(CpuBackend::new())));
    }
    let gpu = kvshard::gpu::Gpu::open(0)?;
    Ok(PeerBackend::Cuda(Arc::new(CudaBackend::new(gpu)?)))
}

/// The decode's registration of request `request` (its case by its id) in `pool`, its pages
/// from a fresh allocator, with `prefix` cached pages.
fn decode_registration(
    cfg: &PdConfig,
    pool: &DevicePool,
    request: u64,
    prefix: usize,
) -> (Registration, RequestChain) {
    let mut allocator = ShardAllocator::new(Placement::unsharded(), pool.pages()).unwrap();
    registration_from(cfg, pool, request, prefix, &mut allocator)
}

/// The same, its pages from `allocator`.
fn registration_from(
    cfg: &PdConfig,
    pool: &DevicePool,
    request: u64,
    prefix: usize,
    allocator: &mut ShardAllocator,
) -> (Registration, RequestChain) {
    let (_, _, case) = cfg.case_of(request).expect("case");
    let mut chain = RequestChain::new(Placement::unsharded());
    chain
        .grow_to(allocator, PdConfig::tokens(case.pages))
        .expect("decode pages");
    let registration = Registration::of_chain(&chain, request, PoolLayout::of(pool), prefix)
        .expect("registration");
    (registration, chain)
}

/// Polls `endpoint` until every request of `requests` is finished; any other event is
/// returned too, in order.
fn finish_all(
    endpoint: &mut DecodeEndpoint,
    requests: &[u64],
    limit: Duration,
) -> (Vec<Finished>, Vec<DecodeEvent>) {
    let start = Instant::now();
    let (mut finished, mut others) = (Vec::new(), Vec::new());
    while finished.len() < requests.len() {
        assert!(
            start.elapsed() < limit,
            "requests {requests:?} not finished after {limit:?}; finished {finished:?}, events {others:?}"
        );
        for e in endpoint.poll_sync(Duration::from_millis(50)).expect("poll") {
            match e {
                DecodeEvent::Finished(f) => finished.push(*f),
                other => others.push(other),
            }
        }
    }
    (finished, others)
}

/// The in-process reference: the same requests, from the same rank pools, sent with
/// `BackendTransport` into a local decode pool of `pages` pages, poisoned first.
fn reference(cfg: &PdConfig, pages: u64, registrations: &[Registration]) -> Vec<u8> {
    let b: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let g = cfg.shape.geometry();
    let pattern = pd::pattern(cfg);
    let placement = Placement::new(cfg.shape.ranks).unwrap();
    let pools: Vec<Arc<DevicePool>> = (0..cfg.shape.ranks)
        .map(|r| {
            let pool =
                DevicePool::allocate(b.as_ref(), &g, placement, r, cfg.prefill_pages()).unwrap();
            pd::fill_pool_sync(b.as_ref(), &pool, &pattern).unwrap();
            Arc::new(pool)
        })
        .collect();
    let decode =
        Arc::new(DevicePool::allocate(b.as_ref(), &g, Placement::unsharded(), 0, pages).unwrap());
    decode.fill(b.as_ref(), POISON).unwrap();
    let space = Arc::new(RemoteSpace::of(decode.clone(), g).unwrap());
    let mut receiver = Receiver::new();
    for reg in registrations {
        let (_, _, case) = cfg.case_of(reg.request).unwrap();
        let chain = cfg.prefill_chain(case.pages).unwrap();
        receiver.register(reg.clone(), cfg.shape.ranks).unwrap();
        let prefix = reg.prefix_pages * 64;
        for pool in &pools {
            let mut sender = Sender::new(pool.clone(), Box::new(BackendTransport::new(b.clone())));
            sender.open(reg.clone(), space.clone()).unwrap();
            for end in cfg.chunk_ends(PdConfig::tokens(case.pages)) {
                if matches!(end, ChunkEnd::Partial(t) if t <= prefix) {
                    continue;
                }
                let status = sender
                    .send(reg.request, chain.pages().unwrap(), end)
                    .unwrap()
                    .wait_sync()
                    .unwrap();
                receiver.receive(status).unwrap();
            }
        }
    }
    assert_eq!(
        receiver.pending_requests(),
        0,
        "every reference request completed"
    );
    decode.snapshot_sync(b.as_ref()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// (a) byte-identical to the in-process reference

fn two_prefill_processes_match(test: &str, cpu: bool) {
    let backend = match cpu {
        true => backend(true).unwrap(),
        false => {
            let Some(_) = common::open_gpu(test) else {
                return;
            };
            backend(false).unwrap()
        }
    };
    let seed: u64 = common::rng(test).random();
    let cfg = config("reference", seed, cpu);
    let socket = socket_path(test);
    let mut endpoint = DecodeEndpoint::bind(
        &socket,
        backend.clone(),
        cfg.shape.ranks,
        Liveness::default(),
    )
    .unwrap();
    let cases = cfg.cases().len();
    let served = (cases * cfg.iterations) as u64;
    // One batch per iteration: every case once, in case order, so each batch lands in the
    // same decode pages and must produce the same pool.
    let batch = |iteration: usize| -> Vec<u64> {
        (0..cases)
            .map(|case| cfg.request_id(case, iteration))
            .collect()
    };
    // The fourth case (7 pages) has a cached prefix of two pages.
    let prefix_of = |request: u64| match cfg.case_of(request) {
        Some((3, _, _)) => 2,
        _ => 0,
    };
    let children: Vec<Peer> = (0..cfg.shape.ranks)
        .map(|rank| {
            Spawn {
                role: "prefill",
                scenario: "reference",
                socket: &socket,
                seed,
                cpu,
                rank,
                pace_ms: 0,
                expect: &format!("{served},0"),
            }
            .start()
        })
        .collect();
    // Every request of a batch at once, in one decode pool large enough for all; the 7-page
    // case with a cached prefix (its chunks start after it; its indexer state covers it).
    let pages: u64 = cfg.cases().iter().map(|c| c.pages as u64).sum::<u64>() + 2;
    let exported = Arc::new(
        ExportedPool::allocate(
            &backend,
            &cfg.shape.geometry(),
            Placement::unsharded(),
            0,
            pages,
        )
        .unwrap(),
    );
    let b = backend.backend();
    exported.pool().fill(b.as_ref(), POISON).unwrap();
    b.synchronize().unwrap();
    endpoint.wait_for_ranks_sync(STARTUP).unwrap();
    let pool = endpoint.publish(exported.clone()).unwrap();
    let mut allocator = ShardAllocator::new(Placement::unsharded(), pages).unwrap();
    let mut registrations = Vec::new();
    let first = batch(0);
    for &request in &first {
        let (reg, _) = registration_from(
            &cfg,
            exported.pool(),
            request,
            prefix_of(request),
            &mut allocator,
        );
        endpoint.register(pool, reg.clone()).unwrap();
        registrations.push(reg);
    }
    let (finished, others) = finish_all(&mut endpoint, &first, STARTUP);
    assert!(
        others
            .iter()
            .all(|e| matches!(e, DecodeEvent::Joined { .. })),
        "{others:?}"
    );
    for f in &finished {
        assert!(f.is_completed(), "{f:?}");
        assert_eq!(f.bytes.len(), 2);
    }
    let got = exported.pool().snapshot_sync(b.as_ref()).unwrap();
    let want = reference(&cfg, pages, &registrations);
    assert!(
        got == want,
        "the decode pool differs from the in-process reference"
    );
    if let PeerBackend::Cuda(cuda) = &backend {
        // The same requests again (their second iteration), into a plain cuMemAlloc pool
        // shared with legacy IPC handles, as an engine's cudaMalloc buffers are.
        let plain = DevicePool::allocate_registrable(
            b.as_ref(),
            &cfg.shape.geometry(),
            Placement::unsharded(),
            0,
            pages,
        )
        .unwrap();
        plain.fill(b.as_ref(), POISON).unwrap();
        let shared = Arc::new(ExportedPool::share_ipc(cuda, Arc::new(plain)).unwrap());
        assert_eq!(shared.memory(), kvshard::ipc::wire::PoolSharing::CudaIpc);
        let ipc_pool = endpoint.publish(shared.clone()).unwrap();
        let mut allocator = ShardAllocator::new(Placement::unsharded(), pages).unwrap();
        let mut again = Vec::new();
        for request in batch(1) {
            let (reg, _) = registration_from(
                &cfg,
                shared.pool(),
                request,
                prefix_of(request),
                &mut allocator,
            );
            endpoint.register(ipc_pool, reg.clone()).unwrap();
            again.push(reg.request);
        }
        let (finished, _) = finish_all(&mut endpoint, &again, STARTUP);
        assert!(finished.iter().all(Finished::is_completed), "{finished:?}");
        let got = shared.pool().snapshot_sync(b.as_ref()).unwrap();
        assert!(
            got == want,
            "the IPC-shared pool differs from the in-process reference"
        );
    }
    drop(endpoint);
    for (rank, child) in children.into_iter().enumerate() {
        child.finish(&format!("{test}: rank {rank}"));
    }
}

#[test]
fn cpu_two_prefill_processes_match_the_in_process_reference() {
    two_prefill_processes_match(
        "cpu_two_prefill_processes_match_the_in_process_reference",
        true,
    );
}

#[test]
fn gpu_two_prefill_processes_on_one_gpu_match_the_in_process_reference() {
    two_prefill_processes_match(
        "gpu_two_prefill_processes_on_one_gpu_match_the_in_process_reference",
        false,
    );
}

// ---------------------------------------------------------------------------------------------
// (b) a prefill process killed mid-request

fn killed_prefill(test: &str, cpu: bool) {
    let backend = match cpu {
        true => backend(true).unwrap(),
        false => {
            let Some(_) = common::open_gpu(test) else {
                return;
            };
            backend(false).unwrap()
        }
    };
    let seed: u64 = common::rng(test).random();
    let cfg = config("kill", seed, cpu);
    let socket = socket_path(test);
    let mut endpoint = DecodeEndpoint::bind(
        &socket,
        backend.clone(),
        cfg.shape.ranks,
        Liveness::default(),
    )
    .unwrap();
    let spawn = |rank: u32, expect: &str| {
        Spawn {
            role: "prefill",
            scenario: "kill",
            socket: &socket,
            seed,
            cpu,
            rank,
            pace_ms: 150,
            expect,
        }
        .start()
    };
    // Rank 0 survives: request 1 aborted, request 2 served. Rank 1 is killed during request 1.
    let survivor = spawn(0, "1,1");
    let mut victim = spawn(1, "unused");
    let exported = Arc::new(
        ExportedPool::allocate(
            &backend,
            &cfg.shape.geometry(),
            Placement::unsharded(),
            0,
            cfg.decode_pages(),
        )
        .unwrap(),
    );
    let b = backend.backend();
    endpoint.wait_for_ranks_sync(STARTUP).unwrap();
    let pool = endpoint.publish(exported.clone()).unwrap();
    let mut allocator =
        ShardAllocator::new(Placement::unsharded(), exported.pool().pages()).unwrap();
    let free = allocator.total_free();
    let (reg, chain) = registration_from(&cfg, exported.pool(), 1, 0, &mut allocator);
    endpoint.register(pool, reg).unwrap();

    // Mid-request: rank 1 has landed a chunk, and has more to send.
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < STARTUP, "rank 1 never sent a chunk");
        let events = endpoint.poll_sync(Duration::from_millis(10)).unwrap();
        assert!(
            events
                .iter()
                .all(|e| matches!(e, DecodeEvent::Joined { .. })),
            "{events:?}"
        );
        if endpoint.chunks_landed(1).unwrap()[1] >= 1 {
            break;
        }
    }
    victim.0.kill().unwrap();
    let killed = Instant::now();
    let (mut gone, mut failed) = (None, None);
    while failed.is_none() {
        assert!(
            killed.elapsed() < 3 * DETECT,
            "gone {gone:?}, failed {failed:?}"
        );
        for e in endpoint.poll_sync(Duration::from_millis(10)).unwrap() {
            match e {
                DecodeEvent::RankGone {
                    rank: 1, failed: f, ..
                } => {
                    assert_eq!(f, vec![1]);
                    gone = Some(killed.elapsed());
                }
                DecodeEvent::Finished(f) => failed = Some((*f, killed.elapsed())),
                other => panic!("{other:?}"),
            }
        }
    }
    let gone = gone.expect("rank 1 reported gone");
    assert!(gone < DETECT, "rank 1 gone after {gone:?}");
    let (f, _) = failed.unwrap();
    let Outcome::Failed(failures) = &f.outcome else {
        panic!("{f:?}")
    };
    assert!(failures.iter().any(|r| r.rank == 1), "{failures:?}");
    assert!(
        failures
            .iter()
            .any(|r| r.rank == 0 && r.reason.contains("abort")),
        "{failures:?}"
    );
    // Its pages come back.
    allocator.free(chain.pages().unwrap()).unwrap();
    assert_eq!(allocator.total_free(), free);
    let _ = victim.0.wait();

    // A restarted rank 1 joins; the next request is served by both, byte for byte.
    let restarted = spawn(1, "1,0");
    let start = Instant::now();
    while endpoint.connected_ranks() != [0, 1] {
        assert!(start.elapsed() < STARTUP, "rank 1 did not rejoin");
        endpoint.poll_sync(Duration::from_millis(20)).unwrap();
    }
    exported.pool().fill(b.as_ref(), POISON).unwrap();
    b.synchronize().unwrap();
    let (reg, _) = registration_from(&cfg, exported.pool(), 2, 0, &mut allocator);
    endpoint.register(pool, reg).unwrap();
    let (finished, _) = finish_all(&mut endpoint, &[2], STARTUP);
    assert!(finished[0].is_completed(), "{:?}", finished[0]);
    let source = cfg.prefill_chain(cfg.pages[0]).unwrap();
    pd::verify_sync(
        b.as_ref(),
        exported.pool(),
        &pd::pattern(&cfg),
        &cfg,
        &source,
        &finished[0].registration,
    )
    .unwrap();
    drop(endpoint);
    survivor.finish(&format!("{test}: rank 0"));
    restarted.finish(&format!("{test}: restarted rank 1"));
}

#[test]
fn cpu_a_killed_prefill_fails_its_request_and_a_restarted_rank_serves_the_next() {
    killed_prefill(
        "cpu_a_killed_prefill_fails_its_request_and_a_restarted_rank_serves_the_next",
        true,
    );
}

#[test]
fn gpu_a_killed_prefill_fails_its_request_and_a_restarted_rank_serves_the_next() {
    killed_prefill(
        "gpu_a_killed_prefill_fails_its_request_and_a_restarted_rank_serves_the_next",
        false,
    );
}

// ---------------------------------------------------------------------------------------------
// (c) the decode process killed mid-request

fn killed_decode(test: &str, cpu: bool) {
    let backend = match cpu {
        true => backend(true).unwrap(),
        false => {
            let Some(_) = common::open_gpu(test) else {
                return;
            };
            backend(false).unwrap()
        }
    };
    let seed: u64 = common::rng(test).random();
    let cfg = config("kill", seed, cpu);
    let socket = socket_path(test);
    let spawn = |role: &'static str, rank: u32, expect: &str| {
        Spawn {
            role,
            scenario: "kill",
            socket: &socket,
            seed,
            cpu,
            rank,
            pace_ms: 150,
            expect,
        }
        .start()
    };
    let mut decode = spawn("decode", 0, "");
    // Rank 1 runs in a child: it must fail request 1 and unmap the pool.
    let other = spawn("prefill", 1, "0,1");
    // Rank 0 is this process.
    let b = backend.backend();
    let placement = Placement::new(cfg.shape.ranks).unwrap();
    let pool = Arc::new(
        DevicePool::allocate(
            b.as_ref(),
            &cfg.shape.geometry(),
            placement,
            0,
            cfg.prefill_pages(),
        )
        .unwrap(),
    );
    pd::fill_pool_sync(b.as_ref(), &pool, &pd::pattern(&cfg)).unwrap();
    let mut endpoint = PrefillEndpoint::connect(
        &socket,
        backend,
        pool,
        cfg.methods[0],
        Liveness::default(),
        STARTUP,
    )
    .unwrap();
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < STARTUP, "request 1 never registered");
        let events = endpoint.poll_sync(Duration::from_millis(20)).unwrap();
        if events.contains(&PrefillEvent::Registered { request: 1 }) {
            break;
        }
    }
    assert_eq!(endpoint.mapped_pools(), 1);
    // The rank's own pages of the request, from its allocator.
    let mut allocator = ShardAllocator::new(placement, cfg.prefill_pages()).unwrap();
    let free = allocator.total_free();
    let mut chain = RequestChain::new(placement);
    chain
        .grow_to(&mut allocator, PdConfig::tokens(cfg.pages[0]))
        .unwrap();
    let ends = cfg.chunk_ends(PdConfig::tokens(cfg.pages[0]));
    endpoint.send(1, chain.pages().unwrap(), ends[0]).unwrap();
    endpoint.send(1, chain.pages().unwrap(), ends[1]).unwrap();
    // Killed once both ranks are mid-request (the other rank has landed a chunk too).
    let start = Instant::now();
    while !marker(&socket).exists() {
        assert!(start.elapsed() < STARTUP, "rank 1 never landed a chunk");
        assert!(endpoint
            .poll_sync(Duration::from_millis(10))
            .unwrap()
            .is_empty());
    }
    let _ = std::fs::remove_file(marker(&socket));

    decode.0.kill().unwrap();
    let killed = Instant::now();
    let (why, failed) = loop {
        assert!(
            killed.elapsed() < 3 * DETECT,
            "the decode's end went unnoticed"
        );
        let closed = endpoint
            .poll_sync(Duration::from_millis(10))
            .unwrap()
            .into_iter()
            .find_map(|e| match e {
                PrefillEvent::Closed { why, failed } => Some((why, failed)),
                _ => None,
            });
        if let Some(closed) = closed {
            break closed;
        }
    };
    let took = killed.elapsed();
    assert!(took < DETECT, "decode gone after {took:?} ({why})");
    assert_eq!(failed, vec![1], "{why}");
    assert_eq!(endpoint.mapped_pools(), 0);
    assert!(endpoint.closed().is_some());
    let more = endpoint.send(1, chain.pages().unwrap(), ends[2]);
    assert!(matches!(more, Err(Error::PeerGone { .. })), "{more:?}");
    // The engine frees the request's pages.
    let pages: Vec<LogicalPage> = chain.pages().unwrap().to_vec();
    allocator.free(&pages).unwrap();
    assert_eq!(allocator.total_free(), free);
    let _ = decode.0.wait();
    other.finish(&format!("{test}: rank 1"));
}

#[test]
fn cpu_a_killed_decode_fails_the_request_on_every_prefill() {
    killed_decode(
        "cpu_a_killed_decode_fails_the_request_on_every_prefill",
        true,
    );
}

#[test]
fn gpu_a_killed_decode_fails_the_request_on_every_prefill() {
    killed_decode(
        "gpu_a_killed_decode_fails_the_request_on_every_prefill",
        false,
    );
}

// ---------------------------------------------------------------------------------------------
// (d) a final chunk that never comes

fn missing_final(test: &str, cpu: bool) {
    if !cpu && common::open_gpu(test).is_none() {
        return;
    }
    let seed: u64 = common::rng(test).random();
    let deadline = Duration::from_secs(2);
    let mut cfg = config("skip", seed, cpu);
    cfg.processes.deadline = deadline;
    let socket = socket_path(test);
    let _ = std::fs::remove_file(skipped(&socket));
    let spawn = |role: &'static str, rank: u32, expect: &str| {
        Spawn {
            role,
            scenario: "skip",
            socket: &socket,
            seed,
            cpu,
            rank,
            pace_ms: 0,
            expect,
        }
        .start()
    };
    // Rank 0 serves the request whole; rank 1 never sends its final chunk.
    let rank0 = spawn("prefill", 0, "1,0");
    let rank1 = spawn("skip-final", 1, "");
    // This process is `kvshard pd`'s decode.
    let decode = {
        let (cfg, socket) = (cfg.clone(), socket.clone());
        std::thread::spawn(move || (pd::decode_role(&cfg, &socket), Instant::now()))
    };
    let start = Instant::now();
    while !skipped(&socket).exists() {
        assert!(
            start.elapsed() < STARTUP && !decode.is_finished(),
            "rank 1 never sent its chunks"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The request was registered before rank 1 could send a chunk of it.
    let sent = Instant::now();
    let (result, ended) = decode.join().expect("the decode thread");
    let _ = std::fs::remove_file(skipped(&socket));
    let e = result.expect_err("the decode must fail");
    let Error::TransferDeadline(overdue) = &e else {
        panic!("{e}");
    };
    let chunks = cfg.chunk_ends(PdConfig::tokens(cfg.pages[0])).len() as u32;
    assert_eq!(overdue.request, 1, "{e}");
    assert_eq!(overdue.deadline, deadline, "{e}");
    assert_eq!(
        overdue.missing,
        vec![MissingChunks {
            rank: 1,
            received: chunks - 1
        }],
        "{e}"
    );
    let message = e.to_string();
    assert!(
        message.contains(&format!(
            "request 1: no last status within its deadline of 2s from 1 of its 2 prefill ranks; prefill rank 1: chunks 0..={} arrived, chunk {} onward missing",
            chunks - 2,
            chunks - 1
        )),
        "{message}"
    );
    let took = ended.duration_since(sent);
    assert!(
        took < deadline + Duration::from_secs(1),
        "failed {took:?} after rank 1's last chunk"
    );
    rank0.finish(&format!("{test}: rank 0"));
    rank1.finish(&format!("{test}: rank 1"));
}

#[test]
fn cpu_a_missing_final_chunk_fails_the_pd_decode_within_its_deadline() {
    missing_final(
        "cpu_a_missing_final_chunk_fails_the_pd_decode_within_its_deadline",
        true,
    );
}

#[test]
fn gpu_a_missing_final_chunk_fails_the_pd_decode_within_its_deadline() {
    missing_final(
        "gpu_a_missing_final_chunk_fails_the_pd_decode_within_its_deadline",
        false,
    );
}
