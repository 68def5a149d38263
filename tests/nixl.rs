//! P/D over NIXL across processes (feature `nixl`): a decode process and N = 2 prefill
//! processes, each with its own NIXL agent, meet over the control channel and move random
//! requests chunk by chunk; the decode pool must end byte-identical to the in-process
//! reference (the same requests sent by `BackendTransport` in one process). Every mode is
//! covered (auto, bounce with coalesced fallback, coalesced, per block), with cached
//! prefixes, empty final chunks and sections larger than a bounce slot. Failures: a prefill
//! process that dies mid-request, a geometry mismatch, and a decode side that vanishes
//! without its channel saying so (the transfer timeout).
//!
//! The CPU tests run on DRAM pools over UCX's TCP transport (`UCX_TLS=tcp,self`,
//! `UCX_NET_DEVICES=lo`, set for every process they start). They need the NIXL runtime
//! (`scripts/install-nixl.sh`, its folder on LD_LIBRARY_PATH): without it they print SKIPPED,
//! or fail when KVSHARD_REQUIRE_NIXL is set (CI sets it). The GPU test runs the same with VRAM
//! pools, each prefill process on its own GPU where there are enough (else all on GPU 0), over
//! whatever UCX picks (CUDA IPC between GPUs of one host), and prints SKIPPED without a GPU.
//!
//! The processes are this test binary run again with `--exact child_entry` and the role in
//! `KVSHARD_NIXL_CHILD`; `child_entry` does nothing in an ordinary run.

mod common;

use common::pd::{decode_pool, geometry, page_of, prefill_pool, reference, requests, N};

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::cuda::CudaBackend;
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::gpu::Gpu;
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::ipc::wire::{Hello, Message, Role};
use kvshard::ipc::{recv_any, Channel, Listener, Liveness};
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::transfer::nixl::{NixlBackend, NixlConfig, NixlMode, NixlTarget, NixlTransport};
use kvshard::transfer::{
    ChunkEnd, ChunkStatus, Finished, MissingChunks, Outcome, PendingChunk, PoolLayout,
    Registration, Sender, DEFAULT_DEADLINE,
};
use rand::Rng;

const CHILD: &str = "KVSHARD_NIXL_CHILD";
const SOCKET: &str = "KVSHARD_NIXL_SOCKET";
const SEED: &str = "KVSHARD_NIXL_SEED";
const RANK: &str = "KVSHARD_NIXL_RANK";
const MODE: &str = "KVSHARD_NIXL_MODE";
const DEVICE: &str = "KVSHARD_NIXL_DEVICE";
/// Bounce slots of 4 pages: small enough that the large request falls back to coalesced.
const SLOT_PAGES: u64 = 4;
/// Generous: a process has to start and create its NIXL agent (and a GPU context).
const STARTUP: Duration = Duration::from_secs(30);
/// The request rank 1 dies in the middle of, in the "die" role.
const DIES_IN: u64 = 2;
/// How soon after rank 1's kill the decode must see it gone (its channel closes at once; the
/// heartbeat reports a silent peer within a second), with margin for a loaded 2-core machine.
const DEATH_SEEN_WITHIN: Duration = Duration::from_secs(5);
/// How soon a request rank 1 was still sending must be reported failed once the decode has
/// seen rank 1 gone and rank 0 has sent its part (a request is handed back once every rank has
/// reported its last status, so rank 0's own transfers are not timed), with the same margin.
/// Far below the decode's loop bound (`STARTUP`), itself far below the default receive
/// deadline: failures that waited for a deadline would fail the test.
const FAILED_WITHIN: Duration = Duration::from_secs(5);
const _: () = assert!(STARTUP.as_secs() < DEFAULT_DEADLINE.as_secs());

// ---------------------------------------------------------------------------------------------
// Processes

/// Whether the NIXL runtime loads here; says SKIPPED when not (or fails, when required).
fn nixl_available(test: &str) -> bool {
    match kvshard::transfer::nixl::load() {
        Ok(()) => true,
        Err(e) => {
            assert!(
                std::env::var_os("KVSHARD_REQUIRE_NIXL").is_none(),
                "{test}: KVSHARD_REQUIRE_NIXL is set but {e}"
            );
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {e}");
            false
        }
    }
}

/// A child process, killed and reaped if the test ends before it does.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn spawn(
        role: &str,
        socket: &Path,
        seed: u64,
        rank: u32,
        mode: &str,
        gpu: Option<usize>,
    ) -> Proc {
        Self::spawn_with(role, socket, seed, rank, mode, gpu, &[])
    }

    fn spawn_with(
        role: &str,
        socket: &Path,
        seed: u64,
        rank: u32,
        mode: &str,
        gpu: Option<usize>,
        env: &[(&str, &Path)],
    ) -> Proc {
        let mut cmd = Command::new(std::env::current_exe().expect("test binary path"));
        cmd.envs(env.iter().copied());
        cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env(CHILD, role)
            .env(SOCKET, socket)
            .env(SEED, seed.to_string())
            .env(RANK, rank.to_string())
            .env(MODE, mode)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        match gpu {
            Some(device) => {
                cmd.env(DEVICE, device.to_string());
            }
            None => {
                // DRAM over TCP on the loopback: what works on a machine with no RDMA and no
                // GPU, and what the CI runs. Where a GPU is present, NIXL refuses a UCX_TLS
                // without a CUDA transport, even for DRAM-only agents.
                let tls = if Gpu::open(0).is_ok() {
                    "tcp,self,cuda_copy"
                } else {
                    "tcp,self"
                };
                cmd.env("UCX_TLS", tls).env("UCX_NET_DEVICES", "lo");
            }
        }
        Proc(cmd.spawn().expect("spawn child test process"))
    }

    /// Waits (bounded) for the child to exit; returns whether it succeeded.
    fn finish(self, what: &str) -> bool {
        self.finish_within(what, STARTUP * 2)
    }

    /// The same, waiting up to `limit`.
    fn finish_within(mut self, what: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            match self.0.try_wait().expect("wait for child") {
                Some(status) => return status.success(),
                None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                None => panic!("{what}: child still running after {limit:?}"),
            }
        }
    }
}

fn socket_path(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvshard-nixl-{}-{test}.sock", std::process::id()))
}

/// The wall clock, which the processes of one machine share.
fn wall_clock() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
}

/// Where a prefill process writes the wall-clock moment of `event` (`killed`: the "die" rank
/// kills itself; `rank0-landed`: every transfer of rank 0 landed), for the decode to time from.
fn stamp_path(socket: &Path, event: &str) -> PathBuf {
    socket.with_extension(event)
}

fn stamp(socket: &Path, event: &str) {
    let now = wall_clock().as_nanos().to_string();
    std::fs::write(stamp_path(socket, event), now).expect("write a time stamp");
}

/// Reads (waiting, bounded, for it to be written) and removes the moment of `event`.
fn read_stamp(socket: &Path, event: &str) -> Duration {
    let path = stamp_path(socket, event);
    let wait = Instant::now() + STARTUP;
    let text = loop {
        match std::fs::read_to_string(&path) {
            Ok(text) if !text.is_empty() => break text,
            _ if Instant::now() < wait => std::thread::sleep(Duration::from_millis(10)),
            other => panic!("no time stamp {event}: {other:?}"),
        }
    };
    let _ = std::fs::remove_file(&path);
    Duration::from_nanos(text.trim().parse().expect("a time stamp"))
}

const STAMPS: [&str; 2] = ["killed", "rank0-landed"];

/// Runs a decode process and N prefill processes; `roles[r]` is rank r's role. Returns whether
/// every process succeeded.
fn run(
    test: &str,
    seed: u64,
    mode: &str,
    decode_role: &str,
    roles: [&str; 2],
    gpus: Option<usize>,
) {
    let socket = socket_path(&format!("{test}-{mode}"));
    let device = |rank: u32| gpus.map(|n| (rank as usize + 1) % n.max(1));
    let decode = Proc::spawn(decode_role, &socket, seed, 0, mode, gpus.map(|_| 0));
    let prefills: Vec<Proc> = (0..N)
        .map(|r| Proc::spawn(roles[r as usize], &socket, seed, r, mode, device(r)))
        .collect();
    let decode_ok = decode.finish(test);
    let prefill_ok: Vec<bool> = prefills.into_iter().map(|p| p.finish(test)).collect();
    assert!(
        decode_ok,
        "{test} ({mode}): the decode process failed (its stderr says why)"
    );
    for (r, ok) in prefill_ok.iter().enumerate() {
        let expect = roles[r] != "die";
        assert_eq!(*ok, expect, "{test} ({mode}): prefill rank {r} exit");
    }
}

/// Says Bye and waits (bounded) for the decode to close the connection: a process that exits
/// right after its Bye can be seen gone before its Bye is read (the decode's heartbeat meets a
/// closed socket first).
fn say_bye(mut ch: Channel) {
    if ch.send(&Message::Bye).is_err() {
        return;
    }
    let deadline = Instant::now() + STARTUP;
    while Instant::now() < deadline {
        match ch.recv_timeout(Duration::from_millis(100)) {
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

/// Entry point of every child process; a no-op in an ordinary run.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let env = |name: &str| -> u64 {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let socket = PathBuf::from(std::env::var(SOCKET).expect("socket"));
    let seed = env(SEED);
    let rank = env(RANK) as u32;
    let mode = match std::env::var(MODE).as_deref() {
        Ok("coalesced") => NixlMode::Coalesced,
        Ok("bounce") => NixlMode::Bounce,
        Ok("per-block") => NixlMode::PerBlock,
        _ => NixlMode::Auto,
    };
    let device = std::env::var(DEVICE).ok().and_then(|v| v.parse().ok());
    match role.as_str() {
        "decode" => decode_child(&socket, seed, device, false),
        "decode-expect-death" => decode_child(&socket, seed, device, true),
        "prefill" => prefill_child(&socket, seed, rank, mode, device, false),
        "die" => prefill_child(&socket, seed, rank, mode, device, true),
        bench if bench.starts_with("bench-") => {
            let out = PathBuf::from(std::env::var(BENCH_OUT).expect("bench out dir"));
            let (role, n) = bench.rsplit_once('-').expect("bench role");
            let n: u32 = n.parse().expect("bench N");
            if role == "bench-decode" {
                bench_decode_child(&socket, n, device, &out);
            } else {
                bench_prefill_child(&socket, rank, n, device, &out);
            }
        }
        "case_geometry_mismatch_refuses_the_peer_on_both_sides" => {
            case_geometry_mismatch_refuses_the_peer_on_both_sides()
        }
        "case_vanished_decode_fails_chunks_in_bounded_time_and_a_new_one_is_served" => {
            case_vanished_decode_fails_chunks_in_bounded_time_and_a_new_one_is_served()
        }
        "case_peer_reported_gone_fails_chunks_at_once" => {
            case_peer_reported_gone_fails_chunks_at_once()
        }
        "case_missing_final_chunk_is_overdue_at_the_deadline" => {
            case_missing_final_chunk_is_overdue_at_the_deadline()
        }
        "case_an_unbounded_timeout_is_no_deadline" => case_an_unbounded_timeout_is_no_deadline(),
        other => panic!("unknown child role {other}"),
    }
}

/// A CPU backend in immediate order, whatever `KVSHARD_CPU_STREAMS` says: NIXL reads and writes
/// its arena without waiting for any stream, so a deferred order is refused.
fn immediate_cpu() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::with_order(StreamOrder::Immediate))
}

fn nixl_backend(device: Option<usize>) -> NixlBackend {
    match device {
        Some(ordinal) => {
            let gpu = Gpu::open(ordinal).expect("GPU");
            NixlBackend::Cuda(Arc::new(CudaBackend::new(gpu).expect("CUDA backend")))
        }
        None => NixlBackend::Cpu(immediate_cpu()),
    }
}

fn config(agent: String, mode: NixlMode) -> NixlConfig {
    NixlConfig {
        mode,
        slot_pages: SLOT_PAGES,
        slots: 2,
        transfer_timeout: Duration::from_secs(10),
        ..NixlConfig::new(agent)
    }
}

fn decode_child(socket: &Path, seed: u64, device: Option<usize>, expect_death: bool) {
    for event in STAMPS {
        let _ = std::fs::remove_file(stamp_path(socket, event));
    }
    let nixl = nixl_backend(device);
    let backend = nixl.backend();
    let pool = decode_pool(backend.as_ref());
    let mut target = NixlTarget::new(
        nixl,
        pool.clone(),
        N,
        config("decode".into(), NixlMode::Auto),
    )
    .expect("decode target");
    let requests = requests(seed);
    // Registered before any rank can send: a notice for an unknown request is refused.
    for r in &requests {
        target.register(r.registration.clone()).expect("register");
    }
    let listener =
        Listener::bind(socket, Hello::new(Role::Decode, 0, 1), Liveness::default()).expect("bind");
    let mut channels = listener
        .accept_n(N as usize, STARTUP)
        .expect("ranks connect");
    for ch in &mut channels {
        let rank = ch.peer().rank;
        ch.send(&Message::NixlPeer(
            target.peer_info(rank).expect("peer info"),
        ))
        .expect("send NixlPeer");
        let got = ch.recv_timeout(STARTUP).expect("alive").expect("NixlPeer");
        let Message::NixlPeer(peer) = got.message else {
            panic!("expected NixlPeer, got {:?}", got.message);
        };
        target.connect(rank, &peer).expect("connect rank");
    }
    let mut finished: Vec<Finished> = Vec::new();
    // When (wall clock) each request was handed back, and rank 1 was seen gone.
    let mut reported: Vec<(u64, Duration)> = Vec::new();
    let mut gone_at: Option<Duration> = None;
    // Also what fails the test if failures wait for a deadline (`DEFAULT_DEADLINE`, as this
    // target is configured) instead of following rank 1's death.
    let deadline = Instant::now() + STARTUP;
    // Until every request has finished and every live rank has said Bye (a rank's last
    // transfer completes on its side only after this side has taken it).
    while finished.len() < requests.len() || !channels.is_empty() {
        assert!(
            Instant::now() < deadline,
            "decode: {} requests open, {} ranks connected",
            target.pending_requests(),
            channels.len()
        );
        let polled = target.poll().expect("poll");
        let now = wall_clock();
        reported.extend(polled.iter().map(|f| (f.request(), now)));
        finished.extend(polled);
        if let Some((i, r)) =
            recv_any(&mut channels, Duration::from_millis(1)).expect("poll channels")
        {
            let rank = channels[i].peer().rank;
            match r {
                Ok(m) if m.message == Message::Bye => {
                    channels.remove(i);
                }
                Ok(m) => panic!("decode: unexpected {:?}", m.message),
                // A rank that said Bye and exited can be seen gone (its Bye unread yet) once
                // every request has finished: that is its normal end.
                Err(_) if finished.len() == requests.len() => {
                    channels.remove(i);
                }
                Err(e) => {
                    assert!(expect_death, "decode: rank {rank} gone: {e}");
                    if rank == 1 {
                        gone_at = Some(wall_clock());
                    }
                    target
                        .rank_gone_sync(rank, &e.to_string())
                        .expect("rank gone");
                    channels.remove(i);
                }
            }
        }
    }
    assert_eq!(target.pending_requests(), 0, "nothing left open");
    if !expect_death {
        // (A dead rank's notices still in flight when its death is seen are refused.)
        assert_eq!(
            target.refused_notifications(),
            0,
            "every notice was expected"
        );
    }
    finished.sort_by_key(Finished::request);
    let expected = reference(
        seed,
        if expect_death {
            &requests[..1]
        } else {
            &requests
        },
    );
    let got = pool.snapshot_sync(backend.as_ref()).expect("snapshot");
    if expect_death {
        // What is timed, from rank 1's kill: the decode seeing it gone, and handing back failed
        // the requests rank 1 was still sending, as soon as rank 0 has sent its part of them
        // (a request is handed back once every rank has reported its last status): not how
        // long rank 0's transfers take.
        let gone = gone_at.expect("rank 1's death was seen");
        let killed = read_stamp(socket, "killed");
        let landed = read_stamp(socket, "rank0-landed");
        let seen = gone.saturating_sub(killed);
        let from = killed.max(landed);
        let slowest = reported
            .iter()
            .filter(|(request, _)| *request != 1)
            .map(|(_, at)| at.saturating_sub(from))
            .max()
            .expect("requests failed");
        let (lag, when) = match landed.checked_sub(killed) {
            Some(lag) => (lag, "after"),
            None => (killed - landed, "before"),
        };
        let _ = writeln!(
            std::io::stderr(),
            "decode: rank 1 seen gone {seen:?} after its kill; rank 0's transfers landed \
             {lag:?} {when} it; the last failure handed back {slowest:?} after both; {:?} \
             from the kill to here",
            wall_clock().saturating_sub(killed)
        );
        assert!(
            seen < DEATH_SEEN_WITHIN,
            "rank 1 was seen gone {seen:?} after its kill"
        );
        assert!(
            slowest < FAILED_WITHIN,
            "a failed request was handed back {slowest:?} after rank 1's kill and rank 0's \
             transfers landed"
        );
        assert!(
            finished[0].is_completed(),
            "request 1 landed before the death"
        );
        for f in &finished[1..] {
            let Outcome::Failed(failures) = &f.outcome else {
                panic!("request {} completed although rank 1 died", f.request());
            };
            assert!(failures.iter().any(|x| x.rank == 1), "{failures:?}");
        }
        // Request 1's pages are byte-identical to the reference; the failed requests' pages
        // are the decode's to free and are not compared.
        let r1 = &requests[0].registration;
        for page in r1.pages.iter().chain(&r1.state_pages) {
            assert!(
                page_of(&got, &pool, *page) == page_of(&expected, &pool, *page),
                "request 1 page {}",
                page.0
            );
        }
    } else {
        for f in &finished {
            assert!(f.is_completed(), "request {}: {:?}", f.request(), f.outcome);
        }
        assert!(
            got == expected,
            "the decode pool differs from the in-process reference"
        );
    }
    for event in STAMPS {
        let _ = std::fs::remove_file(stamp_path(socket, event));
    }
}

fn prefill_child(
    socket: &Path,
    seed: u64,
    rank: u32,
    mode: NixlMode,
    device: Option<usize>,
    die: bool,
) {
    let nixl = nixl_backend(device);
    let backend = nixl.backend();
    let pool = prefill_pool(backend.as_ref(), seed, rank);
    let transport = NixlTransport::new(nixl, pool.clone(), config(format!("prefill{rank}"), mode))
        .expect("transport");
    let mut ch = Channel::connect(
        socket,
        Hello::new(Role::Prefill, rank, N),
        Liveness::default(),
        STARTUP,
    )
    .expect("connect");
    let got = ch.recv_timeout(STARTUP).expect("alive").expect("NixlPeer");
    let Message::NixlPeer(peer) = got.message else {
        panic!("expected NixlPeer, got {:?}", got.message);
    };
    ch.send(&Message::NixlPeer(
        transport.peer_info().expect("peer info"),
    ))
    .expect("send NixlPeer");
    let remote = transport.connect(&peer).expect("connect to the decode");
    let mut sender = Sender::new(pool, Box::new(transport.clone()));
    let requests = requests(seed);
    for r in &requests {
        sender
            .open(r.registration.clone(), remote.clone())
            .expect("open");
    }
    let report = |status: Option<ChunkStatus>| {
        if let Some(status) = status {
            transport.report(&status).expect("report a failure");
        }
    };
    if die {
        // Request 1 whole, then the first chunk of request 2, then death mid-request.
        for r in &requests[..DIES_IN as usize] {
            let chunks = if r.registration.request == DIES_IN {
                &r.chunks[..1]
            } else {
                &r.chunks[..]
            };
            for &end in chunks {
                sender
                    .send(r.registration.request, &r.src_pages, end)
                    .expect("send")
                    .wait_sync()
                    .expect("landed");
            }
        }
        // The notices of what landed reach the decode before the death: a rank that dies
        // right after its last transfer completed may take its notice with it, and the decode
        // then fails that request too (bytes that landed unreported do not count).
        std::thread::sleep(Duration::from_millis(500));
        // No core dump: writing one would delay the exit the decode is timing.
        let none = rustix::process::Rlimit {
            current: Some(0),
            maximum: Some(0),
        };
        let _ = rustix::process::setrlimit(rustix::process::Resource::Core, none);
        stamp(socket, "killed");
        std::process::abort();
    }
    // Round robin over the requests, many chunks in flight at once (slots run out: the rule
    // falls back to coalesced), then every one waited for.
    let mut pending: Vec<PendingChunk> = Vec::new();
    let rounds = requests.iter().map(|r| r.chunks.len()).max().unwrap_or(0);
    for round in 0..rounds {
        for r in &requests {
            let Some(&end) = r.chunks.get(round) else {
                continue;
            };
            match sender.send(r.registration.request, &r.src_pages, end) {
                Ok(p) => pending.push(p),
                Err(e) => {
                    report(ChunkStatus::from_error(&e));
                    panic!("rank {rank}: {e}");
                }
            }
        }
        // Look at the channel: the decode must still be there.
        if let Err(e) = ch.recv_timeout(Duration::ZERO) {
            transport.peer_gone(&e.to_string());
        }
    }
    for p in pending {
        p.wait_sync().expect("landed");
    }
    if rank == 0 {
        stamp(socket, "rank0-landed");
    }
    let stats = transport.transfer_stats().snapshot();
    let _ = writeln!(std::io::stderr(), "rank {rank} {mode:?}: {stats}");
    assert_eq!(stats.failed_transfers, 0);
    if mode == NixlMode::Bounce {
        assert!(stats.bounced_chunks > 0, "{stats}");
    }
    say_bye(ch);
}

// ---------------------------------------------------------------------------------------------
// The tests

#[test]
fn nixl_loopback_decode_and_two_prefill_processes_match_the_reference() {
    let test = "nixl_loopback_decode_and_two_prefill_processes_match_the_reference";
    if !nixl_available(test) {
        return;
    }
    let seed: u64 = common::rng(test).random();
    for mode in ["auto", "bounce", "coalesced", "per-block"] {
        run(test, seed, mode, "decode", ["prefill", "prefill"], None);
    }
}

#[test]
fn nixl_loopback_a_killed_prefill_fails_its_requests_on_the_decode_side() {
    let test = "nixl_loopback_a_killed_prefill_fails_its_requests_on_the_decode_side";
    if !nixl_available(test) {
        return;
    }
    let seed: u64 = common::rng(test).random();
    run(
        test,
        seed,
        "auto",
        "decode-expect-death",
        ["prefill", "die"],
        None,
    );
}

#[test]
fn gpu_nixl_vram_pools_match_the_reference() {
    let test = "gpu_nixl_vram_pools_match_the_reference";
    let Some(_gpu) = common::open_gpu(test) else {
        return;
    };
    if !nixl_available(test) {
        return;
    }
    let gpus = (0..8).take_while(|&g| Gpu::open(g).is_ok()).count().max(1);
    let seed: u64 = common::rng(test).random();
    for mode in ["auto", "bounce", "coalesced", "per-block"] {
        run(
            test,
            seed,
            mode,
            "decode",
            ["prefill", "prefill"],
            Some(gpus),
        );
    }
}

/// Runs `case` in a process of its own: several agents are created and destroyed in it, and
/// NIXL 1.5 was seen corrupting its heap when agents come and go in one process across tests
/// (in UCX's shared progress thread); an engine creates its agent once per process.
fn isolated(test: &str, case: &str) {
    if !nixl_available(test) {
        return;
    }
    let proc = Proc::spawn(case, Path::new("unused"), 0, 0, "auto", None);
    assert!(
        proc.finish(test),
        "{test}: the test process failed (its stderr says why)"
    );
}

/// A decode target (requests due `deadline` after registration) and one prefill transport
/// (transfers failing `timeout` after posting) in this process (two agents over UCX), N = 1.
fn in_process(
    test: &str,
    decode_geometry: CacheGeometry,
    timeout: Duration,
    deadline: Duration,
) -> (NixlTarget, NixlTransport, Arc<DevicePool>, Arc<CpuBackend>) {
    let cpu = immediate_cpu();
    let dst = Arc::new(
        DevicePool::allocate_registrable(
            cpu.as_ref(),
            &decode_geometry,
            Placement::unsharded(),
            0,
            16,
        )
        .expect("decode pool"),
    );
    let target = NixlTarget::new(
        NixlBackend::Cpu(cpu.clone()),
        dst,
        1,
        NixlConfig {
            deadline,
            ..NixlConfig::new(format!("{test}-decode"))
        },
    )
    .expect("target");
    let src = Arc::new(
        DevicePool::allocate_registrable(cpu.as_ref(), &geometry(), Placement::unsharded(), 0, 16)
            .expect("prefill pool"),
    );
    let transport = NixlTransport::new(
        NixlBackend::Cpu(cpu.clone()),
        src.clone(),
        NixlConfig {
            transfer_timeout: timeout,
            ..NixlConfig::new(format!("{test}-prefill"))
        },
    )
    .expect("transport");
    (target, transport, src, cpu)
}

fn one_request(request: u64) -> Registration {
    Registration {
        request,
        layout: PoolLayout::packed(geometry(), 16),
        prefix_pages: 0,
        pages: vec![LocalPage(3), LocalPage(4)],
        state_pages: vec![LocalPage(5), LocalPage(6)],
    }
}

#[test]
fn nixl_a_geometry_mismatch_refuses_the_peer_on_both_sides() {
    isolated(
        "nixl_a_geometry_mismatch_refuses_the_peer_on_both_sides",
        "case_geometry_mismatch_refuses_the_peer_on_both_sides",
    );
}

fn case_geometry_mismatch_refuses_the_peer_on_both_sides() {
    let test = "nixl_a_geometry_mismatch_refuses_the_peer_on_both_sides";
    // The decode runs without the draft; the prefill with it.
    let decode = CacheGeometry::target_only(geometry().target);
    let (mut target, transport, _src, _cpu) = in_process(test, decode, STARTUP, DEFAULT_DEADLINE);
    let e = transport
        .connect(&target.peer_info(0).expect("info"))
        .expect_err("the prefill refuses the decode's geometry");
    assert!(matches!(e, kvshard::Error::GeometryMismatch { .. }), "{e}");
    let e = target
        .connect(0, &transport.peer_info().expect("info"))
        .expect_err("the decode refuses the prefill's geometry");
    assert!(matches!(e, kvshard::Error::GeometryMismatch { .. }), "{e}");
    // A request the refused rank is part of fails at once; nothing stays open.
    let mut reg = one_request(7);
    reg.layout = PoolLayout::packed(CacheGeometry::target_only(geometry().target), 16);
    target.register(reg).expect("register");
    let finished = target.poll().expect("poll");
    assert_eq!(finished.len(), 1);
    assert!(!finished[0].is_completed());
    assert_eq!(target.pending_requests(), 0);
}

// Old behaviour: a transfer timeout or a slot wait of `Duration::MAX` panicked (an instant plus
// the timeout overflowed); a zero timeout failed every transfer. Now the first is no deadline,
// the second a typed error before any agent is made.
#[test]
fn nixl_an_unbounded_timeout_is_no_deadline() {
    let test = "nixl_an_unbounded_timeout_is_no_deadline";
    if !nixl_available(test) {
        return;
    }
    let cpu = immediate_cpu();
    let src = Arc::new(
        DevicePool::allocate_registrable(cpu.as_ref(), &geometry(), Placement::unsharded(), 0, 16)
            .expect("prefill pool"),
    );
    let zero = NixlTransport::new(
        NixlBackend::Cpu(cpu),
        src,
        NixlConfig {
            transfer_timeout: Duration::ZERO,
            ..NixlConfig::new(format!("{test}-zero"))
        },
    );
    assert!(
        matches!(zero, Err(kvshard::Error::OutOfBounds { .. })),
        "{:?}",
        zero.err()
    );
    isolated(test, "case_an_unbounded_timeout_is_no_deadline");
}

fn case_an_unbounded_timeout_is_no_deadline() {
    let test = "nixl_an_unbounded_timeout_is_no_deadline";
    let (mut target, transport, src, _cpu) =
        in_process(test, geometry(), Duration::MAX, DEFAULT_DEADLINE);
    assert!(
        transport.wait_for_slots_sync(Duration::MAX),
        "no slot is busy"
    );
    let remote = transport
        .connect(&target.peer_info(0).expect("info"))
        .expect("connect");
    target
        .connect(0, &transport.peer_info().expect("info"))
        .expect("decode connect");
    let mut sender = Sender::new(src, Box::new(transport.clone()));
    target.register(one_request(1)).expect("register");
    sender.open(one_request(1), remote).expect("open");
    sender
        .send(1, &[LogicalPage(2), LogicalPage(3)], ChunkEnd::Final(128))
        .expect("send")
        .wait_sync()
        .expect("landed");
    let deadline = Instant::now() + STARTUP;
    let mut finished = Vec::new();
    while finished.is_empty() && Instant::now() < deadline {
        finished = target.poll().expect("poll");
    }
    assert!(finished[0].is_completed());
}

#[test]
fn nixl_a_vanished_decode_fails_chunks_in_bounded_time_and_a_new_one_is_served() {
    isolated(
        "nixl_a_vanished_decode_fails_chunks_in_bounded_time_and_a_new_one_is_served",
        "case_vanished_decode_fails_chunks_in_bounded_time_and_a_new_one_is_served",
    );
}

fn case_vanished_decode_fails_chunks_in_bounded_time_and_a_new_one_is_served() {
    let test = "nixl_a_vanished_decode_fails_chunks_in_bounded_time_and_a_new_one_is_served";
    let timeout = Duration::from_secs(3);
    let (mut target, transport, src, cpu) = in_process(test, geometry(), timeout, DEFAULT_DEADLINE);
    let remote = transport
        .connect(&target.peer_info(0).expect("info"))
        .expect("connect");
    target
        .connect(0, &transport.peer_info().expect("info"))
        .expect("decode connect");
    let mut sender = Sender::new(src.clone(), Box::new(transport.clone()));
    let src_pages = [LogicalPage(2), LogicalPage(3)];
    // One request lands...
    target.register(one_request(1)).expect("register");
    sender.open(one_request(1), remote.clone()).expect("open");
    sender
        .send(1, &src_pages, ChunkEnd::Final(128))
        .expect("send")
        .wait_sync()
        .expect("landed");
    let deadline = Instant::now() + STARTUP;
    let mut finished = Vec::new();
    while finished.is_empty() && Instant::now() < deadline {
        finished = target.poll().expect("poll");
    }
    assert!(finished[0].is_completed());
    // ...then the decode vanishes without a word: its agent and memory are gone.
    drop(target);
    sender.open(one_request(2), remote).expect("open");
    let start = Instant::now();
    let failed = sender
        .send(2, &src_pages, ChunkEnd::Final(128))
        .and_then(PendingChunk::wait_sync);
    let took = start.elapsed();
    let e = failed.expect_err("a write to a vanished agent fails");
    assert!(matches!(e, kvshard::Error::ChunkFailed { .. }), "{e}");
    assert!(
        took < timeout + Duration::from_secs(2),
        "failed after {took:?}"
    );
    let stats = transport.transfer_stats().snapshot();
    assert_eq!(stats.failed_transfers, 1, "{stats}");
    // The transport serves a new decode side.
    let dst = Arc::new(
        DevicePool::allocate_registrable(cpu.as_ref(), &geometry(), Placement::unsharded(), 0, 16)
            .expect("decode pool"),
    );
    let mut target = NixlTarget::new(
        NixlBackend::Cpu(cpu.clone()),
        dst,
        1,
        NixlConfig::new(format!("{test}-decode2")),
    )
    .expect("target");
    let remote = transport
        .connect(&target.peer_info(0).expect("info"))
        .expect("reconnect");
    target
        .connect(0, &transport.peer_info().expect("info"))
        .expect("decode connect");
    target.register(one_request(3)).expect("register");
    sender.open(one_request(3), remote).expect("open");
    sender
        .send(3, &src_pages, ChunkEnd::Final(128))
        .expect("send")
        .wait_sync()
        .expect("landed");
    let mut finished = Vec::new();
    while finished.is_empty() && Instant::now() < deadline {
        finished = target.poll().expect("poll");
    }
    assert!(finished[0].is_completed());
}

#[test]
fn nixl_a_peer_reported_gone_fails_chunks_at_once() {
    isolated(
        "nixl_a_peer_reported_gone_fails_chunks_at_once",
        "case_peer_reported_gone_fails_chunks_at_once",
    );
}

fn case_peer_reported_gone_fails_chunks_at_once() {
    let test = "nixl_a_peer_reported_gone_fails_chunks_at_once";
    let (target, transport, src, _cpu) = in_process(test, geometry(), STARTUP, DEFAULT_DEADLINE);
    let remote = transport
        .connect(&target.peer_info(0).expect("info"))
        .expect("connect");
    let mut sender = Sender::new(src, Box::new(transport.clone()));
    sender.open(one_request(1), remote).expect("open");
    transport.peer_gone("its channel closed");
    let start = Instant::now();
    let e = sender
        .send(1, &[LogicalPage(2), LogicalPage(3)], ChunkEnd::Final(128))
        .expect_err("refused");
    assert!(start.elapsed() < Duration::from_secs(1));
    assert!(e.to_string().contains("gone"), "{e}");
}

#[test]
fn nixl_a_missing_final_chunk_is_overdue_at_the_deadline() {
    isolated(
        "nixl_a_missing_final_chunk_is_overdue_at_the_deadline",
        "case_missing_final_chunk_is_overdue_at_the_deadline",
    );
}

fn case_missing_final_chunk_is_overdue_at_the_deadline() {
    let test = "nixl_a_missing_final_chunk_is_overdue_at_the_deadline";
    let deadline = Duration::from_secs(2);
    let (mut target, transport, src, _cpu) = in_process(test, geometry(), STARTUP, deadline);
    let remote = transport
        .connect(&target.peer_info(0).expect("info"))
        .expect("connect");
    target
        .connect(0, &transport.peer_info().expect("info"))
        .expect("decode connect");
    let registered = Instant::now();
    target.register(one_request(1)).expect("register");
    let mut sender = Sender::new(src, Box::new(transport.clone()));
    sender.open(one_request(1), remote).expect("open");
    // The first page lands; the final chunk never comes.
    sender
        .send(1, &[LogicalPage(2), LogicalPage(3)], ChunkEnd::Partial(64))
        .expect("send")
        .wait_sync()
        .expect("landed");
    let overdue = loop {
        let overdue = target.expire().expect("expire");
        if !overdue.is_empty() {
            break overdue;
        }
        assert!(target.poll().expect("poll").is_empty());
        assert!(
            registered.elapsed() < deadline + Duration::from_secs(2),
            "not overdue past its deadline"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(registered.elapsed() >= deadline);
    assert_eq!(overdue.len(), 1);
    assert_eq!((overdue[0].request, overdue[0].deadline), (1, deadline));
    assert_eq!(
        overdue[0].missing,
        vec![MissingChunks {
            rank: 0,
            received: 1
        }],
        "chunk 0's notice arrived, the final chunk's never did"
    );
    let e = kvshard::Error::from(overdue[0].clone());
    assert!(
        e.to_string()
            .contains("prefill rank 0: chunks 0..=0 arrived, chunk 1 onward missing"),
        "{e}"
    );
    // Aborted on the rank: its failure notice hands the request back, failed.
    let status = sender
        .abort(1, "the decode's deadline passed")
        .expect("abort");
    transport.report(&status).expect("report");
    let start = Instant::now();
    let finished = loop {
        let finished = target.poll().expect("poll");
        if !finished.is_empty() {
            break finished;
        }
        assert!(start.elapsed() < STARTUP, "the abort never arrived");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(!finished[0].is_completed());
    assert_eq!(target.pending_requests(), 0);
}

// ---------------------------------------------------------------------------------------------
// Benchmark (ignored: run it on purpose, BENCHMARKS.md says how)

const BENCH_OUT: &str = "KVSHARD_NIXL_BENCH_OUT";
const BENCH_MODES: [(&str, NixlMode); 4] = [
    ("coalesced", NixlMode::Coalesced),
    ("bounce", NixlMode::Bounce),
    ("per-block", NixlMode::PerBlock),
    ("auto", NixlMode::Auto),
];
/// Timed iterations per (mode, pages), after one untimed warm-up.
const BENCH_ITERS: usize = 3;

/// The benchmark's cache: GLM-5-like on a GPU (61 layers, every one with an indexer, and the
/// MTP draft: 2.81 MB a page), the tests' small one on the CPU.
fn bench_geometry(gpu: bool) -> CacheGeometry {
    if gpu {
        CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 61))
    } else {
        geometry()
    }
}

/// How long a benchmark's decode process may run: eight ranks sharing one GPU take minutes.
const BENCH_LIMIT: Duration = Duration::from_secs(900);

/// Request sizes in pages: `KVSHARD_NIXL_BENCH_PAGES` (comma-separated), else 64 to 4,096 on a
/// GPU host and 64 and 256 here.
fn bench_sizes(gpu: bool) -> Vec<u64> {
    let chosen: Vec<u64> = std::env::var("KVSHARD_NIXL_BENCH_PAGES")
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_default();
    if !chosen.is_empty() {
        chosen
    } else if gpu {
        vec![64, 256, 512, 1024, 4096]
    } else {
        vec![64, 256]
    }
}

fn bench_request(mode: usize, size: usize, iteration: usize) -> u64 {
    ((mode * 16 + size) * 16 + iteration) as u64 + 1
}

/// The bench request of `pages` pages: position i is logical page N + i (owner i mod N, local
/// page 1 + i / N: a rank's pages are contiguous on its side) and decode page 1 + i (a rank's
/// pages sit N apart there: the sharded layout's worst case for descriptors).
fn bench_registration(
    geometry: &CacheGeometry,
    request: u64,
    pages: u64,
    decode_pages: u64,
) -> Registration {
    let dst: Vec<LocalPage> = (1..=pages).map(LocalPage).collect();
    Registration {
        request,
        layout: PoolLayout::packed(geometry.clone(), decode_pages),
        prefix_pages: 0,
        pages: dst.clone(),
        state_pages: dst,
    }
}

fn bench_decode_child(socket: &Path, n: u32, device: Option<usize>, out: &Path) {
    let gpu = device.is_some();
    let g = bench_geometry(gpu);
    let sizes = bench_sizes(gpu);
    let max = *sizes.iter().max().unwrap_or(&64);
    let nixl = nixl_backend(device);
    let backend = nixl.backend();
    let pool = Arc::new(
        DevicePool::allocate_registrable(backend.as_ref(), &g, Placement::unsharded(), 0, max + 1)
            .expect("decode pool"),
    );
    let mut cfg = NixlConfig::new("bench-decode");
    cfg.slot_pages = max.div_ceil(u64::from(n)).min(512);
    cfg.slots = 1;
    let mut target = NixlTarget::new(nixl, pool, n, cfg).expect("target");
    let listener =
        Listener::bind(socket, Hello::new(Role::Decode, 0, 1), Liveness::default()).expect("bind");
    let mut channels = listener
        .accept_n(n as usize, STARTUP)
        .expect("ranks connect");
    for ch in &mut channels {
        let got = ch.recv_timeout(STARTUP).expect("alive").expect("NixlPeer");
        let Message::NixlPeer(peer) = got.message else {
            panic!("expected NixlPeer, got {:?}", got.message);
        };
        target.connect(ch.peer().rank, &peer).expect("connect rank");
    }
    let mut expected = 0;
    for m in 0..BENCH_MODES.len() {
        for (s, &pages) in sizes.iter().enumerate() {
            for it in 0..=BENCH_ITERS {
                let reg = bench_registration(&g, bench_request(m, s, it), pages, max + 1);
                target.register(reg).expect("register");
                expected += 1;
            }
        }
    }
    // Every rank starts once every request is registered.
    for ch in &mut channels {
        let rank = ch.peer().rank;
        ch.send(&Message::NixlPeer(target.peer_info(rank).expect("info")))
            .expect("start");
    }
    let start = Instant::now();
    let mut lines = String::new();
    let mut done = 0;
    while done < expected || !channels.is_empty() {
        for f in target.poll().expect("poll") {
            assert!(f.is_completed(), "request {}: {:?}", f.request(), f.outcome);
            done += 1;
            lines.push_str(&format!(
                "{} {}\n",
                f.request(),
                start.elapsed().as_micros()
            ));
        }
        if let Some((i, r)) = recv_any(&mut channels, Duration::from_micros(200)).expect("poll") {
            match r {
                Ok(m) if m.message == Message::Bye => {
                    channels.remove(i);
                }
                // Gone after its Bye, with everything landed: its normal end.
                Err(_) if done == expected => {
                    channels.remove(i);
                }
                other => panic!("decode: unexpected {other:?}"),
            }
        }
    }
    std::fs::write(out.join("decode.txt"), lines).expect("write results");
}

fn bench_prefill_child(socket: &Path, rank: u32, n: u32, device: Option<usize>, out: &Path) {
    let gpu = device.is_some();
    let g = bench_geometry(gpu);
    let sizes = bench_sizes(gpu);
    let max = *sizes.iter().max().unwrap_or(&64);
    let nixl = nixl_backend(device);
    let backend = nixl.backend();
    let local = max.div_ceil(u64::from(n)) + 2;
    let pool = Arc::new(
        DevicePool::allocate_registrable(
            backend.as_ref(),
            &g,
            Placement::new(n).expect("placement"),
            rank,
            local,
        )
        .expect("prefill pool"),
    );
    pool.fill(backend.as_ref(), 0x5A).expect("fill");
    backend.synchronize().expect("sync");
    let transport = NixlTransport::new(
        nixl,
        pool.clone(),
        NixlConfig::new(format!("bench-prefill{rank}")),
    )
    .expect("transport");
    let mut ch = Channel::connect(
        socket,
        Hello::new(Role::Prefill, rank, n),
        Liveness::default(),
        STARTUP,
    )
    .expect("connect");
    ch.send(&Message::NixlPeer(transport.peer_info().expect("info")))
        .expect("send NixlPeer");
    let got = ch.recv_timeout(STARTUP).expect("alive").expect("start");
    let Message::NixlPeer(peer) = got.message else {
        panic!("expected NixlPeer, got {:?}", got.message);
    };
    let remote = transport.connect(&peer).expect("connect to the decode");
    let stats = transport.transfer_stats();
    let mut sender = Sender::new(pool, Box::new(transport.clone()));
    let mut lines = String::new();
    for (m, (name, mode)) in BENCH_MODES.iter().enumerate() {
        transport.set_mode(*mode);
        for (s, &pages) in sizes.iter().enumerate() {
            let src: Vec<LogicalPage> = (0..pages).map(|i| LogicalPage(u64::from(n) + i)).collect();
            for it in 0..=BENCH_ITERS {
                let id = bench_request(m, s, it);
                sender
                    .open(bench_registration(&g, id, pages, max + 1), remote.clone())
                    .expect("open");
                // Every mode starts from free slots (a bounced chunk frees its slot only once
                // the decode has scattered it).
                assert!(
                    transport.wait_for_slots_sync(STARTUP),
                    "bounce slots stay busy"
                );
                let before = stats.snapshot();
                let t0 = Instant::now();
                sender
                    .send(id, &src, ChunkEnd::Final(pages as usize * 64))
                    .expect("send")
                    .wait_sync()
                    .expect("landed");
                let wall = t0.elapsed();
                let after = stats.snapshot();
                // Keep reading the control channel: the decode's heartbeats fill the socket
                // buffer of a rank that stops reading, and the decode then rightly reports it
                // gone (a long run with eight ranks fills it in about 30 s).
                if let Some(got) = ch.recv_timeout(Duration::ZERO).expect("decode alive") {
                    panic!("unexpected message during the benchmark: {:?}", got.message);
                }
                if it == 0 {
                    continue;
                }
                lines.push_str(&format!(
                    "{name} {pages} {} {} {} {} {} {}\n",
                    after.descriptors - before.descriptors,
                    (after.post_time.sum - before.post_time.sum).as_micros(),
                    (after.transfer_time.sum - before.transfer_time.sum).as_micros(),
                    after.bytes - before.bytes,
                    wall.as_micros(),
                    after.bounced_chunks - before.bounced_chunks,
                ));
            }
        }
    }
    std::fs::write(out.join(format!("rank{rank}.txt")), lines).expect("write results");
    say_bye(ch);
}

/// NIXL P/D throughput per mode, pages and N: a decode process and N prefill processes (on a
/// GPU host: the decode on GPU 0, the prefill ranks on GPU 1 when there is one, GLM-5-like
/// geometry, 64 to 4,096 pages; here: the CPU over TCP, small), one final chunk per request,
/// every rank sending its pages of the request at once. Prints a Markdown table.
#[test]
#[ignore = "a benchmark: run with --ignored (BENCHMARKS.md)"]
fn bench_nixl_pd() {
    let test = "bench_nixl_pd";
    if !nixl_available(test) {
        return;
    }
    let gpus = (0..8).take_while(|&g| Gpu::open(g).is_ok()).count();
    let shards: Vec<u32> = std::env::var("KVSHARD_NIXL_BENCH_N")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 8]);
    let mut table = String::from(
        "| mode | N | pages | descriptors/rank | post ms (mean/rank) | transfer ms (max rank) | post/transfer | GB/s (all ranks) | bounced |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for &n in &shards {
        let out =
            std::env::temp_dir().join(format!("kvshard-nixl-bench-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).expect("out dir");
        let socket = socket_path(&format!("bench-{n}"));
        let (decode_gpu, prefill_gpu) = match gpus {
            0 => (None, None),
            1 => (Some(0), Some(0)),
            _ => (Some(0), Some(1)),
        };
        let spawn = |role: &str, rank: u32, gpu: Option<usize>| {
            Proc::spawn_with(
                role,
                &socket,
                0,
                rank,
                "auto",
                gpu,
                &[(BENCH_OUT, out.as_path())],
            )
        };
        let decode = spawn(&format!("bench-decode-{n}"), 0, decode_gpu);
        let ranks: Vec<Proc> = (0..n)
            .map(|r| spawn(&format!("bench-prefill-{n}"), r, prefill_gpu))
            .collect();
        assert!(
            decode.finish_within(test, BENCH_LIMIT),
            "bench decode (N = {n}) failed"
        );
        for r in ranks {
            assert!(r.finish(test), "bench prefill (N = {n}) failed");
        }
        // mode pages -> per rank (descriptors, post us, transfer us, bytes, wall us, bounced)
        let mut rows: std::collections::BTreeMap<(usize, u64), Vec<[u64; 6]>> = Default::default();
        for r in 0..n {
            let text = std::fs::read_to_string(out.join(format!("rank{r}.txt"))).expect("results");
            for line in text.lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                let m = BENCH_MODES
                    .iter()
                    .position(|(name, _)| *name == f[0])
                    .expect("mode");
                let v: Vec<u64> = f[1..].iter().map(|x| x.parse().expect("number")).collect();
                rows.entry((m, v[0]))
                    .or_default()
                    .push([v[1], v[2], v[3], v[4], v[5], v[6]]);
            }
        }
        for ((m, pages), v) in rows {
            let k = v.len() as f64;
            let per_rank = f64::from(n);
            let iters = k / per_rank;
            let desc = v.iter().map(|x| x[0]).sum::<u64>() as f64 / k;
            let post = v.iter().map(|x| x[1]).sum::<u64>() as f64 / k / 1e3;
            let xfer = v.iter().map(|x| x[2]).max().unwrap_or(0) as f64 / 1e3;
            let bytes = v.iter().map(|x| x[3]).sum::<u64>() as f64 / iters;
            let wall = v.iter().map(|x| x[4]).max().unwrap_or(1) as f64 / 1e6;
            let bounced = v.iter().map(|x| x[5]).sum::<u64>();
            table.push_str(&format!(
                "| {} | {n} | {pages} | {desc:.0} | {post:.3} | {xfer:.3} | {:.1}% | {:.1} | {bounced}/{} |\n",
                BENCH_MODES[m].0,
                100.0 * post / xfer.max(1e-9),
                bytes / wall / 1e9,
                v.len(),
            ));
        }
        let _ = std::fs::remove_dir_all(&out);
    }
    let _ = writeln!(std::io::stderr(), "{table}");
}
