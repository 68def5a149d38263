//! The fault-injection suite's transport cases (`fault_*`, each reporting its `Tally`; run with
//! `--nocapture` for the lines): P/D across processes on the CPU twin, a decode process and
//! N = 2 prefill processes meeting through `DecodeEndpoint` and `PrefillEndpoint` over the
//! control channel (`kvshard::ipc`), moving the random requests of tests/common/pd.rs. Faults:
//! a prefill rank killed mid-chunk, the decode killed mid-chunk, chunk statuses dropped,
//! duplicated, delayed and reordered by a proxy process between a rank and the decode (it
//! speaks the control channel both ways, descriptors included), and a decode restarted under
//! the same ranks. With the `nixl` feature, the same kills and a decode restarted over NIXL
//! (UCX's TCP transport on the loopback, as tests/nixl.rs runs it), a chunk's notification that
//! never comes (its chunk lost), and every notification sent again once its chunk landed (a
//! repeat, late). NIXL delivers the notifications itself, so no proxy stands between the
//! agents: the ranks do the faults.
//!
//! Each case asserts: nothing hangs past its deadline (every process ends within its bound,
//! failures come at once or at the request's deadline), no wrong byte is served (the pages of
//! every completed request equal the in-process reference's; failed requests are reported),
//! nothing leaks (every request handed back, every mapping dropped).
//!
//! The processes are this test binary run again with `--exact child_entry` and the role in
//! `KVSHARD_FAULT_CHILD`; `child_entry` does nothing in an ordinary run.

mod common;

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::faults::Tally;
use common::pd::{geometry, page_of, prefill_pool, reference, requests, Request, DECODE_PAGES, N};
use common::synth::POISON;
use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::copy::Method;
use kvshard::ipc::wire::{Hello, Message, Role};
use kvshard::ipc::{recv_any, Channel, ExportedPool, Listener, Liveness, PeerBackend};
use kvshard::shard::Placement;
use kvshard::transfer::{
    DecodeEndpoint, DecodeEvent, Finished, Outcome, PrefillEndpoint, PrefillEvent,
};

const CHILD: &str = "KVSHARD_FAULT_CHILD";
const SOCKET: &str = "KVSHARD_FAULT_SOCKET";
const CONNECT: &str = "KVSHARD_FAULT_CONNECT";
const RANK: &str = "KVSHARD_FAULT_RANK";
const DEADLINE_MS: &str = "KVSHARD_FAULT_DEADLINE_MS";
const FAULTS: &str = "KVSHARD_FAULT_FAULTS";
const SESSION: &str = "KVSHARD_FAULT_SESSION";
const SEED: u64 = 7;
/// A process has to start, and the machine has 2 cores shared with other builds.
const STARTUP: Duration = Duration::from_secs(30);
/// The decode's bound on its loop: far below the default deadline, so a failure that waited
/// for a deadline it was not given fails the case.
const LOOP_BOUND: Duration = Duration::from_secs(40);
/// How soon a failure must be seen after a kill: the channel's end is seen at once, a silent
/// peer within the liveness timeout; margin for a loaded machine.
const FAILED_WITHIN: Duration = Duration::from_secs(5);
/// The decode's deadline where a status is dropped.
const DROP_DEADLINE: Duration = Duration::from_secs(8);
/// The request rank 1 dies in the middle of, in the "die" role.
const DIES_IN: u64 = 2;
/// How long the proxy holds a delayed status, and a reordered one at most.
const DELAY: Duration = Duration::from_millis(500);

// ---------------------------------------------------------------------------------------------
// Reports: what a child saw, as `key value...` lines in a file named for it.

fn wall_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis()
}

fn report_path(socket: &Path, name: &str) -> PathBuf {
    socket.with_extension(name)
}

fn write_report(socket: &Path, name: &str, lines: &[String]) {
    let tmp = report_path(socket, &format!("{name}.tmp"));
    std::fs::write(&tmp, lines.join("\n")).expect("write a report");
    std::fs::rename(&tmp, report_path(socket, name)).expect("publish a report");
}

/// A child's report, by its first word: the rest of each line.
fn read_report(socket: &Path, name: &str) -> BTreeMap<String, Vec<String>> {
    let path = report_path(socket, name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("no report {}: {e}", path.display()));
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines() {
        let (key, rest) = line.split_once(' ').unwrap_or((line, ""));
        out.entry(key.to_string())
            .or_default()
            .push(rest.to_string());
    }
    out
}

fn wait_for_report(socket: &Path, name: &str) {
    let end = Instant::now() + STARTUP;
    while !report_path(socket, name).exists() {
        assert!(Instant::now() < end, "no report {name} within {STARTUP:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------------------------
// Processes

/// A child process, killed and reaped if the test ends before it does.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn spawn(role: &str, socket: &Path, rank: u32, env: &[(&str, String)]) -> Proc {
        let mut cmd = Command::new(std::env::current_exe().expect("test binary path"));
        cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env(CHILD, role)
            .env(SOCKET, socket)
            .env(RANK, rank.to_string())
            .env("KVSHARD_CPU_STREAMS", "immediate")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Proc(cmd.spawn().expect("spawn a child process"))
    }

    /// Waits (bounded) for the child to end; whether it exited successfully. A child killed
    /// by its own hand ends with a signal.
    fn finish(mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + limit;
        loop {
            if let Some(status) = self.0.try_wait().expect("wait for a child") {
                return Some(status);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// `connect()`, again until it succeeds within `STARTUP`: a rank reconnecting to a decode that
/// restarts may meet the dying one's socket (the connection is reset) before the new one's.
fn retry<T>(connect: impl Fn() -> kvshard::Result<T>) -> T {
    let end = Instant::now() + STARTUP;
    loop {
        match connect() {
            Ok(t) => return t,
            Err(e) if Instant::now() >= end => panic!("connect: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn socket_path(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvshard-faults-{}-{test}.sock", std::process::id()))
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn cpu_backend() -> PeerBackend {
    PeerBackend::Cpu(Arc::new(CpuBackend::with_order(StreamOrder::Immediate)))
}

#[test]
fn child_entry() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let socket = PathBuf::from(std::env::var(SOCKET).expect("socket"));
    let rank = env_u64(RANK, 0) as u32;
    match role.as_str() {
        "decode" => decode_child(&socket, false),
        "decode-die" => decode_child(&socket, true),
        "prefill" => prefill_child(&socket, rank, false, false),
        "prefill-die" => prefill_child(&socket, rank, true, false),
        "prefill-reconnect" => prefill_child(&socket, rank, false, true),
        "proxy" => proxy_child(&socket, rank),
        #[cfg(feature = "nixl")]
        "nixl-decode" => nixl_faults::decode_child(&socket, false),
        #[cfg(feature = "nixl")]
        "nixl-decode-die" => nixl_faults::decode_child(&socket, true),
        #[cfg(feature = "nixl")]
        "nixl-prefill" => nixl_faults::prefill_child(&socket, rank, false, false),
        #[cfg(feature = "nixl")]
        "nixl-prefill-die" => nixl_faults::prefill_child(&socket, rank, true, false),
        #[cfg(feature = "nixl")]
        "nixl-prefill-reconnect" => nixl_faults::prefill_child(&socket, rank, false, true),
        other => panic!("unknown role {other}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The decode

fn failed_ranks(f: &Finished) -> Vec<u32> {
    match &f.outcome {
        Outcome::Completed => Vec::new(),
        Outcome::Failed(fs) => fs.iter().map(|f| f.rank).collect(),
    }
}

fn decode_child(socket: &Path, die: bool) {
    let session = std::env::var(SESSION).unwrap_or_default();
    let backend = cpu_backend();
    let b = backend.backend();
    let exported = Arc::new(
        ExportedPool::allocate(
            &backend,
            &geometry(),
            Placement::unsharded(),
            0,
            DECODE_PAGES,
        )
        .expect("decode pool"),
    );
    let pool = exported.pool().clone();
    pool.fill(b.as_ref(), POISON).expect("poison");
    b.synchronize().expect("sync");
    let mut endpoint =
        DecodeEndpoint::bind(socket, backend.clone(), N, Liveness::default()).expect("bind");
    endpoint.set_deadline(Duration::from_millis(env_u64(DEADLINE_MS, 120_000)));
    endpoint.wait_for_ranks_sync(STARTUP).expect("ranks");
    let id = endpoint.publish(exported).expect("publish");
    let reqs = requests(SEED);
    let mut lines = Vec::new();
    let mut refused = 0;
    for r in &reqs {
        // A rank that dies while the requests are registered has the later ones refused: they
        // were never taken, so they count as failed at once.
        if endpoint.register(id, r.registration.clone()).is_err() {
            lines.push(format!("refused {} {}", r.registration.request, wall_ms()));
            refused += 1;
        }
    }
    let mut finished: Vec<(Finished, u128)> = Vec::new();
    let start = Instant::now();
    while finished.len() + refused < reqs.len() && start.elapsed() < LOOP_BOUND {
        for event in endpoint.poll_sync(Duration::from_millis(20)).expect("poll") {
            match event {
                DecodeEvent::Finished(f) => {
                    if die {
                        write_report(socket, "killed", &[format!("at {}", wall_ms())]);
                        let _ = rustix::process::kill_process(
                            rustix::process::getpid(),
                            rustix::process::Signal::KILL,
                        );
                    }
                    finished.push((*f, wall_ms()));
                }
                DecodeEvent::Overdue(o) => lines.push(format!("overdue {}", o.request)),
                DecodeEvent::RankGone { rank, .. } => {
                    lines.push(format!("gone {rank} {}", wall_ms()))
                }
                DecodeEvent::Joined { .. } | DecodeEvent::Refused { .. } => {}
            }
        }
    }
    let snapshot = pool.snapshot_sync(b.as_ref()).expect("snapshot");
    let want = reference(SEED, &reqs);
    for (f, at) in &finished {
        let r = &f.registration;
        let wrong = r
            .pages
            .iter()
            .chain(&r.state_pages)
            .filter(|&&p| page_of(&snapshot, &pool, p) != page_of(&want, &pool, p))
            .count();
        let failed: Vec<String> = failed_ranks(f).iter().map(u32::to_string).collect();
        lines.push(format!(
            "request {} {} {} {at} {}",
            f.request(),
            u8::from(f.is_completed()),
            r.pages.len() + r.state_pages.len(),
            failed.join(",")
        ));
        if f.is_completed() {
            lines.push(format!("wrong {} {wrong}", f.request()));
        }
    }
    lines.push(format!("pending {}", endpoint.pending_requests()));
    lines.push(format!("dropped {}", endpoint.dropped_statuses()));
    write_report(socket, &format!("decode{session}"), &lines);
}

// ---------------------------------------------------------------------------------------------
// A prefill rank

fn prefill_child(socket: &Path, rank: u32, die: bool, reconnect: bool) {
    let backend = cpu_backend();
    let pool = prefill_pool(backend.backend().as_ref(), SEED, rank);
    let connect = std::env::var(CONNECT).map_or_else(|_| socket.to_path_buf(), PathBuf::from);
    let reqs = requests(SEED);
    prefill_session(
        socket, &connect, &backend, &pool, rank, die, &reqs, "prefill",
    );
    if reconnect {
        // The same rank serves the decode that took the place of the one that went.
        prefill_session(
            socket, socket, &backend, &pool, rank, false, &reqs, "prefill2",
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn prefill_session(
    socket: &Path,
    connect: &Path,
    backend: &PeerBackend,
    pool: &Arc<kvshard::pool::DevicePool>,
    rank: u32,
    die: bool,
    reqs: &[Request],
    name: &str,
) {
    let method = Method::default_for(backend.backend().as_ref());
    let mut endpoint = retry(|| {
        PrefillEndpoint::connect(
            connect,
            backend.clone(),
            pool.clone(),
            method,
            Liveness::default(),
            STARTUP,
        )
    });
    let mut sent = 0;
    let mut errors = 0;
    let mut aborted = 0;
    let closed = loop {
        let mut queue = Vec::new();
        let mut closed = None;
        for event in endpoint.poll_sync(Duration::from_millis(50)).expect("poll") {
            match event {
                PrefillEvent::Registered { request } => queue.push(request),
                PrefillEvent::Aborted { .. } => aborted += 1,
                PrefillEvent::Closed { why, .. } => closed = Some(why),
                _ => {}
            }
        }
        for request in queue {
            let Some(r) = reqs.iter().find(|r| r.registration.request == request) else {
                continue;
            };
            for (i, &end) in r.chunks.iter().enumerate() {
                if die && rank == 1 && request == DIES_IN && i == 1 {
                    write_report(socket, "killed", &[format!("at {}", wall_ms())]);
                    let _ = rustix::process::kill_process(
                        rustix::process::getpid(),
                        rustix::process::Signal::KILL,
                    );
                }
                match endpoint.send(request, &r.src_pages, end) {
                    Ok(_) => sent += 1,
                    Err(_) => {
                        errors += 1;
                        break;
                    }
                }
            }
        }
        if let Some(why) = closed {
            break why;
        }
    };
    write_report(
        socket,
        &format!("{name}-{rank}"),
        &[
            format!("sent {sent}"),
            format!("errors {errors}"),
            format!("aborted {aborted}"),
            format!("mapped {}", endpoint.mapped_pools()),
            format!("closed {closed}"),
            format!("at {}", wall_ms()),
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// The proxy: between one rank and the decode, the control channel both ways; chunk statuses on
// their way to the decode are dropped, duplicated, delayed or reordered.

/// What the proxy does to one status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Drop,
    Dup,
    Delay,
    /// Sent after the next message (or `DELAY` later, when none comes).
    Swap,
}

/// `index=kind` pairs, comma-separated: what to do to the rank's `index`-th status.
fn faults_of(text: &str) -> BTreeMap<usize, Fault> {
    text.split(',')
        .filter(|s| !s.is_empty())
        .map(|pair| {
            let (i, kind) = pair.split_once('=').expect("index=kind");
            let kind = match kind {
                "drop" => Fault::Drop,
                "dup" => Fault::Dup,
                "delay" => Fault::Delay,
                "swap" => Fault::Swap,
                other => panic!("fault {other}"),
            };
            (i.parse().expect("an index"), kind)
        })
        .collect()
}

fn forward(to: &mut Channel, r: &kvshard::ipc::Received) -> bool {
    let fds: Vec<_> = r.fds.iter().map(|f| f.as_fd()).collect();
    to.send_with_fds(&r.message, &fds).is_ok()
}

fn proxy_child(socket: &Path, rank: u32) {
    let faults = faults_of(&std::env::var(FAULTS).unwrap_or_default());
    let listen = PathBuf::from(std::env::var(CONNECT).expect("the proxy's socket"));
    let listener =
        Listener::bind(&listen, Hello::new(Role::Decode, 0, 1), Liveness::default()).expect("bind");
    let down = listener
        .accept_timeout(STARTUP)
        .expect("accept")
        .expect("the rank connects");
    assert_eq!(down.peer().rank, rank);
    let up = Channel::connect(socket, down.peer().clone(), Liveness::default(), STARTUP)
        .expect("connect to the decode");
    let mut channels = [down, up];
    let mut index = 0usize;
    let mut held: Option<(kvshard::ipc::Received, Instant)> = None;
    let mut hits = Vec::new();
    loop {
        // A reordered status goes after the next message, or alone once DELAY passed.
        if held.as_ref().is_some_and(|(_, at)| at.elapsed() >= DELAY) {
            let (h, _) = held.take().expect("held");
            if !forward(&mut channels[1], &h) {
                break;
            }
        }
        let Ok(Some((i, received))) = recv_any(&mut channels, Duration::from_millis(20)) else {
            continue;
        };
        let Ok(r) = received else { break };
        if i == 1 {
            if !forward(&mut channels[0], &r) {
                break;
            }
            continue;
        }
        let fault = match &r.message {
            Message::Chunk(status) => {
                let fault = faults.get(&index).copied();
                index += 1;
                if let Some(f) = fault {
                    hits.push(format!("{f:?} {} {}", status.request, status.chunk));
                }
                fault
            }
            _ => None,
        };
        let sent = match fault {
            Some(Fault::Drop) => true,
            Some(Fault::Swap) => {
                let earlier = held.replace((r, Instant::now()));
                match earlier {
                    Some((h, _)) => forward(&mut channels[1], &h),
                    None => true,
                }
            }
            Some(Fault::Dup) => forward(&mut channels[1], &r) && forward(&mut channels[1], &r),
            Some(Fault::Delay) => {
                std::thread::sleep(DELAY);
                forward(&mut channels[1], &r)
            }
            None => forward(&mut channels[1], &r),
        };
        let sent = sent
            && match fault {
                Some(Fault::Swap) => true,
                _ => held
                    .take()
                    .is_none_or(|(h, _)| forward(&mut channels[1], &h)),
            };
        if !sent {
            break;
        }
    }
    let hits: Vec<String> = hits.into_iter().map(|h| format!("hit {h}")).collect();
    write_report(socket, &format!("proxy-{rank}"), &hits);
}

// ---------------------------------------------------------------------------------------------
// The cases

/// One request as the decode reported it.
#[derive(Debug)]
struct Seen {
    completed: bool,
    pages_back: usize,
    at: u128,
    failed: Vec<u32>,
}

/// The decode's report: requests seen finished, requests refused at registration (and when),
/// overdue ones, pending count, wrong pages.
struct DecodeReport {
    seen: BTreeMap<u64, Seen>,
    refused: BTreeMap<u64, u128>,
    overdue: Vec<u64>,
    pending: usize,
    wrong: usize,
    dropped: u64,
}

fn decode_report(socket: &Path, name: &str) -> DecodeReport {
    let r = read_report(socket, name);
    let num = |s: &str| s.parse::<u128>().expect("a number");
    let mut seen = BTreeMap::new();
    for line in r.get("request").into_iter().flatten() {
        let f: Vec<&str> = line.split(' ').collect();
        seen.insert(
            num(f[0]) as u64,
            Seen {
                completed: f[1] == "1",
                pages_back: num(f[2]) as usize,
                at: num(f[3]),
                failed: f
                    .get(4)
                    .map(|s| {
                        s.split(',')
                            .filter(|x| !x.is_empty())
                            .map(|x| num(x) as u32)
                            .collect()
                    })
                    .unwrap_or_default(),
            },
        );
    }
    let refused = r
        .get("refused")
        .into_iter()
        .flatten()
        .map(|l| {
            let (request, at) = l.split_once(' ').expect("request and time");
            (num(request) as u64, num(at))
        })
        .collect();
    let wrong = r
        .get("wrong")
        .into_iter()
        .flatten()
        .map(|l| num(l.split(' ').nth(1).unwrap_or("0")) as usize)
        .sum();
    let first = |k: &str| {
        r.get(k)
            .and_then(|v| v.first())
            .map(|s| num(s))
            .unwrap_or(0)
    };
    DecodeReport {
        overdue: r
            .get("overdue")
            .into_iter()
            .flatten()
            .map(|s| num(s) as u64)
            .collect(),
        pending: first("pending") as usize,
        dropped: first("dropped") as u64,
        seen,
        refused,
        wrong,
    }
}

/// Every request handed back with all its pages, none pending.
fn all_handed_back(d: &DecodeReport, reqs: &[Request]) -> bool {
    d.pending == 0
        && reqs.iter().all(|r| {
            let reg = &r.registration;
            d.seen
                .get(&reg.request)
                .is_some_and(|s| s.pages_back == reg.pages.len() + reg.state_pages.len())
        })
}

fn killed_at(socket: &Path) -> u128 {
    wait_for_report(socket, "killed");
    read_report(socket, "killed")["at"][0]
        .parse()
        .expect("a time")
}

fn first_number(socket: &Path, name: &str, key: &str) -> u64 {
    read_report(socket, name)[key][0].parse().expect("a number")
}

#[test]
fn fault_endpoint_prefill_killed_mid_chunk() {
    let socket = socket_path("prefill-killed");
    let decode = Proc::spawn("decode", &socket, 0, &[]);
    let p0 = Proc::spawn("prefill", &socket, 0, &[]);
    let p1 = Proc::spawn("prefill-die", &socket, 1, &[]);
    // Reaped at once: the decode hands back what rank 1 failed once its process has exited.
    let killed = p1.finish(STARTUP).is_some_and(|s| !s.success());
    let ended = decode.finish(LOOP_BOUND + STARTUP).is_some() && p0.finish(STARTUP).is_some();
    let d = decode_report(&socket, "decode");
    let at = killed_at(&socket);
    // Rank 1's failure comes first; rank 0, when still sending the request, is then told to
    // abort it and answers with a failure of its own.
    let failed_in_time = d.seen.values().filter(|s| !s.completed).all(|s| {
        s.failed.first() == Some(&1) && s.at.saturating_sub(at) < FAILED_WITHIN.as_millis()
    });
    // Requests the decode registered after rank 1 died were refused then, not later; they were
    // never taken, so only the others are handed back.
    let registered: Vec<Request> = requests(SEED)
        .into_iter()
        .filter(|r| !d.refused.contains_key(&r.registration.request))
        .collect();
    let refused_after_the_kill = d
        .refused
        .values()
        .all(|&r| r >= at && r - at < FAILED_WITHIN.as_millis());
    let mut tally = Tally {
        served_wrong: d.wrong as u64,
        ..Tally::default()
    };
    tally.fault_checked(&[
        ("rank 1 was killed", killed),
        ("every process ended", ended),
        (
            "the request rank 1 died in failed",
            d.seen.get(&DIES_IN).is_some_and(|s| !s.completed),
        ),
        ("failed by rank 1 first, and in time", failed_in_time),
        ("refused only after the kill", refused_after_the_kill),
        ("nothing overdue", d.overdue.is_empty()),
        (
            "every registered request handed back",
            all_handed_back(&d, &registered),
        ),
        (
            "rank 0 unmapped the pool",
            first_number(&socket, "prefill-0", "mapped") == 0,
        ),
    ]);
    tally.report("endpoint: a prefill rank killed mid-chunk");
}

#[test]
fn fault_endpoint_decode_killed_mid_chunk() {
    let socket = socket_path("decode-killed");
    let decode = Proc::spawn("decode-die", &socket, 0, &[]);
    let prefills: Vec<Proc> = (0..N)
        .map(|r| Proc::spawn("prefill", &socket, r, &[]))
        .collect();
    let killed = decode.finish(STARTUP).is_some_and(|s| !s.success());
    let at = killed_at(&socket);
    let ended = prefills.into_iter().all(|p| p.finish(STARTUP).is_some());
    let mut tally = Tally::default();
    let survived = (0..N).all(|r| {
        let report = read_report(&socket, &format!("prefill-{r}"));
        let closed_at: u128 = report["at"][0].parse().expect("a time");
        report["mapped"][0] == "0" && closed_at.saturating_sub(at) < FAILED_WITHIN.as_millis()
    });
    tally.fault(killed && ended && survived);
    tally.report("endpoint: the decode killed mid-chunk");
}

#[test]
fn fault_endpoint_chunk_statuses_dropped_duplicated_delayed_reordered() {
    let socket = socket_path("status-faults");
    // Each rank reports its 9 statuses in send order: request 1's chunks 0-2, request 2's
    // 0-1, request 3's 0-1, request 4's, request 5's. Rank 0 loses request 5's final status
    // and repeats request 2's first; rank 1's request 1 chunk 1 comes late, and request 3's
    // last status after request 4's.
    let faults = ["8=drop,3=dup", "1=delay,6=swap"];
    let deadline = (DEADLINE_MS, DROP_DEADLINE.as_millis().to_string());
    let decode = Proc::spawn("decode", &socket, 0, &[deadline]);
    let mut others = Vec::new();
    for r in 0..N {
        let proxy_socket = socket_path(&format!("status-faults-proxy-{r}"));
        let at = (CONNECT, proxy_socket.display().to_string());
        let plan = (FAULTS, faults[r as usize].to_string());
        others.push(Proc::spawn("proxy", &socket, r, &[at.clone(), plan]));
        others.push(Proc::spawn("prefill", &socket, r, &[at]));
    }
    let ended = decode.finish(LOOP_BOUND + STARTUP).is_some()
        && others.into_iter().all(|p| p.finish(STARTUP).is_some());
    let d = decode_report(&socket, "decode");
    let reqs = requests(SEED);
    let leaked = !all_handed_back(&d, &reqs);
    let mut tally = Tally {
        served_wrong: d.wrong as u64,
        ..Tally::default()
    };
    for r in 0..N {
        for hit in read_report(&socket, &format!("proxy-{r}"))
            .get("hit")
            .into_iter()
            .flatten()
        {
            let f: Vec<&str> = hit.split(' ').collect();
            let request: u64 = f[1].parse().expect("a request");
            let seen = d.seen.get(&request);
            let survived = ended
                && !leaked
                && match f[0] {
                    // Overdue at its deadline, the rank asked to abort it, handed back failed.
                    "Drop" => seen.is_some_and(|s| !s.completed) && d.overdue.contains(&request),
                    _ => seen.is_some_and(|s| s.completed),
                };
            tally.fault(survived);
        }
    }
    assert!(d.dropped >= 1, "the repeated status was not counted");
    tally.report("endpoint: chunk statuses dropped, duplicated, delayed, reordered");
}

#[test]
fn fault_endpoint_decode_restarted_under_the_same_ranks() {
    let socket = socket_path("decode-restarted");
    let first = Proc::spawn("decode-die", &socket, 0, &[]);
    let prefills: Vec<Proc> = (0..N)
        .map(|r| Proc::spawn("prefill-reconnect", &socket, r, &[]))
        .collect();
    let killed = first.finish(STARTUP).is_some_and(|s| !s.success());
    killed_at(&socket);
    let second = Proc::spawn("decode", &socket, 0, &[(SESSION, "2".into())]);
    let ended = second.finish(LOOP_BOUND + STARTUP).is_some()
        && prefills.into_iter().all(|p| p.finish(STARTUP).is_some());
    let d = decode_report(&socket, "decode2");
    let reqs = requests(SEED);
    let mut tally = Tally {
        served_wrong: d.wrong as u64,
        ..Tally::default()
    };
    tally.fault_checked(&[
        ("the first decode was killed", killed),
        ("every process ended", ended),
        ("every request handed back", all_handed_back(&d, &reqs)),
        (
            "every request completed",
            d.seen.values().all(|s| s.completed),
        ),
        (
            "the ranks served the second decode without errors and unmapped it",
            (0..N).all(|r| {
                let p = read_report(&socket, &format!("prefill2-{r}"));
                p["errors"][0] == "0" && p["mapped"][0] == "0"
            }),
        ),
    ]);
    tally.report("endpoint: a decode restarted under the same ranks");
}

// ---------------------------------------------------------------------------------------------
// NIXL (feature `nixl`): the same P/D over NIXL agents, UCX's TCP transport on the loopback; the
// agents meet over the control channel (`NixlPeer` both ways), the decode asks a rank to abort
// an overdue request there, and a rank's notices ride on its transfers.

#[cfg(feature = "nixl")]
mod nixl_faults {
    use super::*;
    use kvshard::transfer::nixl::{NixlBackend, NixlConfig, NixlMode, NixlTarget, NixlTransport};
    use kvshard::transfer::{ChunkStatus, PendingChunk, Sender};

    /// The roles' extra behaviour: rank 0 loses request `LOST`'s final chunk; every chunk's
    /// notice is sent again once it landed.
    pub const LOSE_LAST: &str = "KVSHARD_FAULT_LOSE_LAST";
    pub const REPEAT: &str = "KVSHARD_FAULT_REPEAT";
    pub const LOST: u64 = 5;

    /// Whether the NIXL runtime loads here; says SKIPPED when not (or fails, when required).
    pub fn available(test: &str) -> bool {
        match kvshard::transfer::nixl::load() {
            Ok(()) => true,
            Err(e) => {
                assert!(
                    std::env::var_os("KVSHARD_REQUIRE_NIXL").is_none(),
                    "{test}: KVSHARD_REQUIRE_NIXL is set but {e}"
                );
                eprintln!("SKIPPED {test}: {e}");
                false
            }
        }
    }

    /// UCX on the loopback's TCP (NIXL refuses a UCX_TLS without a CUDA transport where a GPU
    /// is present, even for DRAM-only agents).
    pub fn ucx_env() -> Vec<(&'static str, String)> {
        let tls = if kvshard::gpu::Gpu::open(0).is_ok() {
            "tcp,self,cuda_copy"
        } else {
            "tcp,self"
        };
        vec![("UCX_TLS", tls.into()), ("UCX_NET_DEVICES", "lo".into())]
    }

    fn config(agent: String, deadline: Duration) -> NixlConfig {
        NixlConfig {
            mode: NixlMode::Auto,
            slot_pages: 4,
            slots: 2,
            transfer_timeout: Duration::from_secs(5),
            deadline,
            ..NixlConfig::new(agent)
        }
    }

    fn cpu() -> Arc<CpuBackend> {
        Arc::new(CpuBackend::with_order(StreamOrder::Immediate))
    }

    pub fn decode_child(socket: &Path, die: bool) {
        let session = std::env::var(SESSION).unwrap_or_default();
        let nixl = NixlBackend::Cpu(cpu());
        let backend = nixl.backend();
        let pool = common::pd::decode_pool(backend.as_ref());
        let deadline = Duration::from_millis(env_u64(DEADLINE_MS, 120_000));
        let mut target = NixlTarget::new(
            nixl,
            pool.clone(),
            N,
            config(format!("decode{session}-{}", std::process::id()), deadline),
        )
        .expect("target");
        let reqs = requests(SEED);
        for r in &reqs {
            target.register(r.registration.clone()).expect("register");
        }
        let listener = Listener::bind(socket, Hello::new(Role::Decode, 0, 1), Liveness::default())
            .expect("bind");
        let mut channels = listener.accept_n(N as usize, STARTUP).expect("ranks");
        for ch in &mut channels {
            let rank = ch.peer().rank;
            ch.send(&Message::NixlPeer(target.peer_info(rank).expect("info")))
                .expect("send NixlPeer");
            let got = ch.recv_timeout(STARTUP).expect("alive").expect("NixlPeer");
            let Message::NixlPeer(peer) = got.message else {
                panic!("expected NixlPeer, got {:?}", got.message);
            };
            target.connect(rank, &peer).expect("connect");
        }
        let mut finished: Vec<(Finished, u128)> = Vec::new();
        let mut lines = Vec::new();
        let start = Instant::now();
        while finished.len() < reqs.len() && start.elapsed() < LOOP_BOUND {
            for f in target.poll().expect("poll") {
                if die {
                    write_report(socket, "killed", &[format!("at {}", wall_ms())]);
                    let _ = rustix::process::kill_process(
                        rustix::process::getpid(),
                        rustix::process::Signal::KILL,
                    );
                }
                finished.push((f, wall_ms()));
            }
            for o in target.expire().expect("expire") {
                lines.push(format!("overdue {}", o.request));
                // The ranks that owe it are asked to abort it.
                for m in &o.missing {
                    if let Some(ch) = channels.iter_mut().find(|c| c.peer().rank == m.rank) {
                        let _ = ch.send(&Message::Abort {
                            request: o.request,
                            reason: "overdue".into(),
                        });
                    }
                }
            }
            if let Some((i, Err(e))) =
                recv_any(&mut channels, Duration::from_millis(2)).expect("poll channels")
            {
                let rank = channels[i].peer().rank;
                lines.push(format!("gone {rank} {}", wall_ms()));
                target.rank_gone_sync(rank, &e.to_string()).expect("gone");
                channels.remove(i);
            }
        }
        let snapshot = pool.snapshot_sync(backend.as_ref()).expect("snapshot");
        let want = reference(SEED, &reqs);
        for (f, at) in &finished {
            let r = &f.registration;
            let failed: Vec<String> = failed_ranks(f).iter().map(u32::to_string).collect();
            lines.push(format!(
                "request {} {} {} {at} {}",
                f.request(),
                u8::from(f.is_completed()),
                r.pages.len() + r.state_pages.len(),
                failed.join(",")
            ));
            if f.is_completed() {
                let wrong = r
                    .pages
                    .iter()
                    .chain(&r.state_pages)
                    .filter(|&&p| page_of(&snapshot, &pool, p) != page_of(&want, &pool, p))
                    .count();
                lines.push(format!("wrong {} {wrong}", f.request()));
            }
        }
        lines.push(format!("pending {}", target.pending_requests()));
        lines.push(format!("dropped {}", target.refused_notifications()));
        write_report(socket, &format!("nixl-decode{session}"), &lines);
    }

    pub fn prefill_child(socket: &Path, rank: u32, die: bool, reconnect: bool) {
        let nixl = NixlBackend::Cpu(cpu());
        let pool = prefill_pool(nixl.backend().as_ref(), SEED, rank);
        let agent = format!("prefill{rank}-{}", std::process::id());
        let transport =
            NixlTransport::new(nixl, pool.clone(), config(agent, Duration::from_secs(120)))
                .expect("transport");
        session(socket, &transport, &pool, rank, die, "nixl-prefill");
        if reconnect {
            session(socket, &transport, &pool, rank, false, "nixl-prefill2");
        }
    }

    /// One decode's worth of requests: connect, send every chunk (each waited for), answer
    /// aborts until the decode goes, report.
    fn session(
        socket: &Path,
        transport: &NixlTransport,
        pool: &Arc<kvshard::pool::DevicePool>,
        rank: u32,
        die: bool,
        name: &str,
    ) {
        let lose_last = std::env::var_os(LOSE_LAST).is_some();
        let repeat = std::env::var_os(REPEAT).is_some();
        let hello = Hello::new(Role::Prefill, rank, N);
        let mut ch =
            retry(|| Channel::connect(socket, hello.clone(), Liveness::default(), STARTUP));
        let got = ch.recv_timeout(STARTUP).expect("alive").expect("NixlPeer");
        let Message::NixlPeer(peer) = got.message else {
            panic!("expected NixlPeer, got {:?}", got.message);
        };
        ch.send(&Message::NixlPeer(transport.peer_info().expect("info")))
            .expect("send NixlPeer");
        let remote = transport.connect(&peer).expect("connect to the decode");
        let mut sender = Sender::new(pool.clone(), Box::new(transport.clone()));
        let reqs = requests(SEED);
        let (mut sent, mut errors, mut repeated) = (0, 0, 0);
        let mut aborts = Vec::new();
        for r in &reqs {
            let request = r.registration.request;
            sender
                .open(r.registration.clone(), remote.clone())
                .expect("open");
            for (i, &end) in r.chunks.iter().enumerate() {
                if die && rank == 1 && request == DIES_IN && i == 1 {
                    // Its earlier notices reach the decode before the death.
                    std::thread::sleep(Duration::from_millis(300));
                    write_report(socket, "killed", &[format!("at {}", wall_ms())]);
                    let _ = rustix::process::kill_process(
                        rustix::process::getpid(),
                        rustix::process::Signal::KILL,
                    );
                }
                // The last request's final chunk is lost (never sent): its notice never comes.
                if lose_last && rank == 0 && request == LOST && i + 1 == r.chunks.len() {
                    break;
                }
                let landed = sender
                    .send(request, &r.src_pages, end)
                    .and_then(PendingChunk::wait_sync);
                match landed {
                    Ok(status) => {
                        sent += 1;
                        if repeat {
                            // The same notice again: the decode must drop it.
                            repeated += u32::from(transport.report(&status).is_ok());
                        }
                    }
                    Err(e) => {
                        errors += 1;
                        if let Some(s) = ChunkStatus::from_error(&e) {
                            let _ = transport.report(&s);
                        }
                        let _ = sender.close(request);
                        break;
                    }
                }
                match ch.recv_timeout(Duration::ZERO) {
                    Ok(Some(m)) => aborts.push(m.message),
                    Ok(None) => {}
                    Err(e) => transport.peer_gone(&e.to_string()),
                }
            }
        }
        // Until the decode goes: its aborts are answered with the rank's failed status.
        let mut aborted = 0;
        let closed = loop {
            for m in aborts.drain(..) {
                if let Message::Abort { request, reason } = m {
                    if let Ok(status) = sender.abort(request, &reason) {
                        aborted += 1;
                        let _ = transport.report(&status);
                    }
                }
            }
            match ch.recv_timeout(Duration::from_millis(100)) {
                Ok(Some(m)) => aborts.push(m.message),
                Ok(None) => {}
                Err(e) => break e.to_string(),
            }
        };
        transport.peer_gone(&closed);
        write_report(
            socket,
            &format!("{name}-{rank}"),
            &[
                format!("sent {sent}"),
                format!("errors {errors}"),
                format!("aborted {aborted}"),
                format!("repeated {repeated}"),
                format!("pending {}", sender.pending_requests()),
                format!("at {}", wall_ms()),
            ],
        );
    }
}

#[cfg(feature = "nixl")]
fn nixl_spawn(role: &str, socket: &Path, rank: u32, extra: &[(&str, String)]) -> Proc {
    let mut env = nixl_faults::ucx_env();
    env.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
    Proc::spawn(role, socket, rank, &env)
}

#[cfg(feature = "nixl")]
#[test]
fn fault_nixl_prefill_killed_mid_chunk() {
    if !nixl_faults::available("fault_nixl_prefill_killed_mid_chunk") {
        return;
    }
    let socket = socket_path("nixl-prefill-killed");
    let decode = nixl_spawn("nixl-decode", &socket, 0, &[]);
    let p0 = nixl_spawn("nixl-prefill", &socket, 0, &[]);
    let p1 = nixl_spawn("nixl-prefill-die", &socket, 1, &[]);
    let killed = p1.finish(STARTUP * 2).is_some_and(|s| !s.success());
    let ended = decode.finish(LOOP_BOUND + STARTUP).is_some() && p0.finish(STARTUP).is_some();
    let d = decode_report(&socket, "nixl-decode");
    let at = killed_at(&socket);
    let failed_in_time = d.seen.values().filter(|s| !s.completed).all(|s| {
        s.failed.contains(&1) && s.at.saturating_sub(at) < (FAILED_WITHIN * 2).as_millis()
    });
    let mut tally = Tally {
        served_wrong: d.wrong as u64,
        ..Tally::default()
    };
    tally.fault_checked(&[
        ("rank 1 was killed", killed),
        ("every process ended", ended),
        (
            "the request rank 1 died in failed",
            d.seen.get(&DIES_IN).is_some_and(|s| !s.completed),
        ),
        ("failed by rank 1, and in time", failed_in_time),
        (
            "every request handed back",
            all_handed_back(&d, &requests(SEED)),
        ),
    ]);
    tally.report("nixl: a prefill rank killed mid-chunk");
}

#[cfg(feature = "nixl")]
#[test]
fn fault_nixl_decode_killed_mid_chunk() {
    if !nixl_faults::available("fault_nixl_decode_killed_mid_chunk") {
        return;
    }
    let socket = socket_path("nixl-decode-killed");
    let decode = nixl_spawn("nixl-decode-die", &socket, 0, &[]);
    let prefills: Vec<Proc> = (0..N)
        .map(|r| nixl_spawn("nixl-prefill", &socket, r, &[]))
        .collect();
    let killed = decode.finish(STARTUP * 2).is_some_and(|s| !s.success());
    let at = killed_at(&socket);
    let ended = prefills
        .into_iter()
        .all(|p| p.finish(STARTUP * 2).is_some());
    // Every chunk in flight fails at the latest at its transfer timeout (5 s).
    let survived = (0..N).all(|r| {
        let p = read_report(&socket, &format!("nixl-prefill-{r}"));
        let done: u128 = p["at"][0].parse().expect("a time");
        p["pending"][0] == "0" && done.saturating_sub(at) < (FAILED_WITHIN * 3).as_millis()
    });
    let mut tally = Tally::default();
    tally.fault(killed && ended && survived);
    tally.report("nixl: the decode killed mid-chunk");
}

#[cfg(feature = "nixl")]
#[test]
fn fault_nixl_notifications_lost_repeated_and_late() {
    if !nixl_faults::available("fault_nixl_notifications_lost_repeated_and_late") {
        return;
    }
    let socket = socket_path("nixl-notices");
    let deadline = (DEADLINE_MS, DROP_DEADLINE.as_millis().to_string());
    let repeat = (nixl_faults::REPEAT, "1".to_string());
    let decode = nixl_spawn("nixl-decode", &socket, 0, &[deadline]);
    let p0 = nixl_spawn(
        "nixl-prefill",
        &socket,
        0,
        &[repeat.clone(), (nixl_faults::LOSE_LAST, "1".into())],
    );
    let p1 = nixl_spawn("nixl-prefill", &socket, 1, &[repeat]);
    let ended = decode.finish(LOOP_BOUND + STARTUP).is_some()
        && p0.finish(STARTUP).is_some()
        && p1.finish(STARTUP).is_some();
    let d = decode_report(&socket, "nixl-decode");
    let reqs = requests(SEED);
    let handed_back = ended && all_handed_back(&d, &reqs);
    let mut tally = Tally {
        served_wrong: d.wrong as u64,
        ..Tally::default()
    };
    // The lost notice: overdue at its deadline, the rank asked to abort, handed back failed.
    let lost = nixl_faults::LOST;
    tally.fault(
        handed_back && d.overdue.contains(&lost) && d.seen.get(&lost).is_some_and(|s| !s.completed),
    );
    // Each repeated notice (late: it follows its chunk's own) is dropped, its request completes.
    let others_complete = reqs
        .iter()
        .filter(|r| r.registration.request != lost)
        .all(|r| {
            d.seen
                .get(&r.registration.request)
                .is_some_and(|s| s.completed)
        });
    let mut repeated = 0;
    for r in 0..N {
        let p = read_report(&socket, &format!("nixl-prefill-{r}"));
        repeated += p["repeated"][0].parse::<u64>().expect("a count");
    }
    assert!(repeated >= 10, "{repeated} notices repeated");
    for _ in 0..repeated {
        tally.fault(handed_back && others_complete && d.dropped >= repeated);
    }
    tally.report("nixl: notifications lost, repeated and late");
}

#[cfg(feature = "nixl")]
#[test]
fn fault_nixl_decode_restarted_under_the_same_ranks() {
    if !nixl_faults::available("fault_nixl_decode_restarted_under_the_same_ranks") {
        return;
    }
    let socket = socket_path("nixl-decode-restarted");
    let first = nixl_spawn("nixl-decode-die", &socket, 0, &[]);
    let prefills: Vec<Proc> = (0..N)
        .map(|r| nixl_spawn("nixl-prefill-reconnect", &socket, r, &[]))
        .collect();
    let killed = first.finish(STARTUP * 2).is_some_and(|s| !s.success());
    killed_at(&socket);
    let second = nixl_spawn("nixl-decode", &socket, 0, &[(SESSION, "2".into())]);
    let ended = second.finish(LOOP_BOUND + STARTUP).is_some()
        && prefills
            .into_iter()
            .all(|p| p.finish(STARTUP * 2).is_some());
    let d = decode_report(&socket, "nixl-decode2");
    let mut tally = Tally {
        served_wrong: d.wrong as u64,
        ..Tally::default()
    };
    tally.fault(
        killed
            && ended
            && all_handed_back(&d, &requests(SEED))
            && d.seen.values().all(|s| s.completed)
            && (0..N)
                .all(|r| read_report(&socket, &format!("nixl-prefill2-{r}"))["errors"][0] == "0"),
    );
    tally.report("nixl: a decode restarted under the same ranks");
}
