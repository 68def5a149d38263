//! P/D over NIXL into decode context parallelism (feature `nixl`, docs/dcp.md, "Over NIXL"):
//! N prefill ranks, each a `NixlDecodeTransport` with one agent per decode rank, send random
//! requests chunk by chunk into M decode ranks, each a `NixlTarget` of its own; every chunk
//! reaches each decode rank as one descriptor (a dense region of a bounce slot) and is
//! unpacked there by `kvs_decode_scatter`. Every decode rank must end byte-identical to the
//! unsharded reference re-laid out by the plain function of tests/common/dcp.rs, every request
//! completed on every decode rank, and the transports must have posted exactly one descriptor
//! per (chunk, prefill rank, decode rank it moves rows to).
//!
//! The agents (N x M prefill agents, M decode agents) meet over UCX's TCP transport
//! (`UCX_TLS=tcp,self`, `UCX_NET_DEVICES=lo`) on DRAM pools: in one process of their own for
//! random cases (this binary run again with `--exact child_entry`: NIXL 1.5 was seen corrupting
//! its heap when agents come and go in one process across tests), and with a process per rank
//! (each decode rank and each prefill rank its own process, meeting through files in a
//! directory: their `NixlPeer`s, then "ready" and "done" marks; every process derives the same
//! case, pages and bytes from one seed, so only NIXL's traffic carries the data). Without the
//! NIXL runtime the tests print SKIPPED, or fail when KVSHARD_REQUIRE_NIXL is set.

mod common;

use common::dcp::{
    check_decode_ranks, difference, owed, relayout, setup_with, Case, DecodeSide, PAGE, REQUEST,
};

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::Backend;
use kvshard::copy::RemoteSpace;
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry, PAGE_SIZE};
use kvshard::pool::DevicePool;
use kvshard::shard::{DecodeLayout, Placement};
use kvshard::transfer::nixl::{NixlBackend, NixlConfig, NixlDecodeTransport, NixlTarget};
use kvshard::transfer::{ChunkResult, Finished, PendingChunk, Sender};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

const CHILD: &str = "KVSHARD_NIXL_DCP_CHILD";
const DIR: &str = "KVSHARD_NIXL_DCP_DIR";
const RANK: &str = "KVSHARD_NIXL_DCP_RANK";
/// The seed every process of the test with a process per rank derives pages and bytes from.
const PROCESS_SEED: u64 = 0x37dc9;
/// Generous: agents start, and a loaded 2-core machine moves bytes over TCP.
const WAIT: Duration = Duration::from_secs(60);

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

/// Runs `case` in a process of its own, over UCX TCP loopback.
fn isolated(test: &str, case: &str) {
    if !nixl_available(test) {
        return;
    }
    wait_all(test, vec![spawn(case, &[])]);
}

/// This binary again, running `case` over UCX TCP loopback with `env` set.
fn spawn(case: &str, env: &[(&str, String)]) -> Child {
    Command::new(std::env::current_exe().expect("test binary path"))
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, case)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("UCX_TLS", "tcp,self")
        .env("UCX_NET_DEVICES", "lo")
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn a test process")
}

/// Waits for every process (bounded); kills the rest and fails when one fails.
fn wait_all(test: &str, mut children: Vec<Child>) {
    let deadline = Instant::now() + 4 * WAIT;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            if let Some(status) = children[i].try_wait().expect("wait") {
                if !status.success() {
                    for c in &mut children {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    panic!("{test}: a test process failed ({status}); its stderr says why");
                }
                // Reaped by try_wait already: wait returns its status at once.
                let _ = children.swap_remove(i).wait();
            } else {
                i += 1;
            }
        }
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
                let _ = c.wait();
            }
            panic!(
                "{test}: the test processes did not finish within {:?}",
                4 * WAIT
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn child_entry() {
    let Ok(case) = std::env::var(CHILD) else {
        return;
    };
    match case.as_str() {
        "random_cases" => case_random_cases(),
        "refusals" => case_refusals(),
        "decode" | "prefill" => {
            let dir = PathBuf::from(std::env::var(DIR).expect("dir"));
            let rank: u32 = std::env::var(RANK).expect("rank").parse().expect("rank");
            if case == "decode" {
                decode_process(&dir, rank)
            } else {
                prefill_process(&dir, rank)
            }
        }
        other => panic!("unknown case {other}"),
    }
}

#[test]
fn nixl_dcp_chunks_match_the_relaid_reference_one_descriptor_per_decode_rank() {
    isolated(
        "nixl_dcp_chunks_match_the_relaid_reference_one_descriptor_per_decode_rank",
        "random_cases",
    );
}

#[test]
fn nixl_dcp_refuses_what_it_cannot_carry_before_anything_moves() {
    isolated(
        "nixl_dcp_refuses_what_it_cannot_carry_before_anything_moves",
        "refusals",
    );
}

/// The case of the test with a process per rank: N = 2 prefill ranks into M = 3 decode ranks at
/// I = 1 (a page's rows over every decode rank), three chunks after a cached page, the draft and
/// the indexer, separate state pages.
fn process_case() -> Case {
    Case {
        n: 2,
        layout: DecodeLayout::new(3, 1).unwrap(),
        geometry: CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![true, false],
        )),
        chunk_ends: vec![150, 300, 420],
        prefix_pages: 1,
        contiguous: false,
        separate_state: true,
    }
}

#[test]
fn nixl_dcp_a_process_per_rank_matches_the_relaid_reference() {
    let test = "nixl_dcp_a_process_per_rank_matches_the_relaid_reference";
    if !nixl_available(test) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvshard-nixl-dcp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let case = process_case();
    let mut children = Vec::new();
    for d in 0..case.layout.ranks() {
        let env = [(DIR, dir.display().to_string()), (RANK, d.to_string())];
        children.push(spawn("decode", &env));
    }
    for r in 0..case.n {
        let env = [(DIR, dir.display().to_string()), (RANK, r.to_string())];
        children.push(spawn("prefill", &env));
    }
    wait_all(test, children);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes `bytes` to `dir/name` whole (a rename: a reader never sees part of it).
fn put(dir: &Path, name: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    std::fs::write(&tmp, bytes).expect("write");
    std::fs::rename(&tmp, dir.join(name)).expect("rename");
}

/// Waits (bounded) for `dir/name`, calling `tick` meanwhile; its bytes.
fn take(dir: &Path, name: &str, mut tick: impl FnMut()) -> Vec<u8> {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(bytes) = std::fs::read(dir.join(name)) {
            return bytes;
        }
        assert!(Instant::now() < deadline, "{name} never came");
        tick();
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn peer_of(bytes: &[u8]) -> kvshard::ipc::wire::NixlPeer {
    postcard::from_bytes(bytes).expect("a NixlPeer")
}

/// Decode rank `d`: its pool and target, connected to every prefill rank; receives the request
/// and checks its pool against the relaid reference.
fn decode_process(dir: &Path, d: u32) {
    let cpu = immediate_cpu();
    let base: Arc<dyn Backend> = cpu.clone();
    let stream = || -> Arc<dyn Backend> { cpu.clone() };
    let case = process_case();
    let mut rng = StdRng::seed_from_u64(PROCESS_SEED);
    let s = setup_with(&base, &stream, &registrable(&cpu), &case, &mut rng);
    let n = case.n;
    let config = NixlConfig {
        slot_pages: case.pages() as u64 + 1,
        slots: 2,
        ..NixlConfig::new(format!("proc-decode{d}"))
    };
    let pool = s.decode[d as usize].pool.clone();
    let mut target =
        NixlTarget::new(NixlBackend::Cpu(cpu.clone()), pool.clone(), n, config).expect("target");
    for r in 0..n {
        let info = postcard::to_allocvec(&target.peer_info(r).expect("info")).unwrap();
        put(dir, &format!("decode{d}-for{r}"), &info);
    }
    for r in 0..n {
        let peer = peer_of(&take(dir, &format!("prefill{r}-for{d}"), || {}));
        target.connect(r, &peer).expect("connect");
    }
    target.register(s.reg.rank(d).unwrap()).expect("register");
    put(dir, &format!("ready{d}"), b"");
    let mut finished = Vec::new();
    let deadline = Instant::now() + WAIT;
    while finished.is_empty() {
        finished = target.poll().expect("poll");
        assert!(
            Instant::now() < deadline,
            "decode rank {d}: the request never finished"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    assert!(
        finished[0].is_completed(),
        "decode rank {d}: {:?}",
        finished[0]
    );
    let owed: Vec<_> = (0..n).map(|r| owed(&case, &s.src, r, d)).collect();
    assert_eq!(finished[0].bytes, owed, "decode rank {d}");
    let reference = s.reference.snapshot_sync(base.as_ref()).unwrap();
    let want = relayout(
        &case,
        &reference,
        s.reference_pages,
        &s.src,
        &s.reg,
        s.decode_pages,
        &s.before,
    );
    let got = pool.snapshot_sync(cpu.as_ref()).unwrap();
    if let Some(at) = difference(&case, s.decode_pages, &got, &want[d as usize]) {
        panic!("decode rank {d} differs from the relaid reference at {at}");
    }
    // The prefill ranks' empty parts complete on this side's receipts: stay until they are done.
    for r in 0..n {
        take(dir, &format!("done{r}"), || {
            let _ = target.poll();
        });
    }
    println!("nixl dcp process: decode rank {d} byte-identical to the relaid reference");
}

/// Prefill rank `r`: its pool and a decode group transport connected to every decode rank;
/// sends the request chunk by chunk and counts its descriptors.
fn prefill_process(dir: &Path, r: u32) {
    let cpu = immediate_cpu();
    let base: Arc<dyn Backend> = cpu.clone();
    let stream = || -> Arc<dyn Backend> { cpu.clone() };
    let case = process_case();
    let m = case.layout.ranks();
    let mut rng = StdRng::seed_from_u64(PROCESS_SEED);
    let s = setup_with(&base, &stream, &registrable(&cpu), &case, &mut rng);
    let pool = s.ranks[r as usize].1.clone();
    let config = NixlConfig {
        transfer_timeout: WAIT,
        ..NixlConfig::new(format!("proc-prefill{r}"))
    };
    let t = NixlDecodeTransport::new(NixlBackend::Cpu(cpu.clone()), pool.clone(), config, m)
        .expect("transport");
    let mut dsts = Vec::new();
    for d in 0..m {
        let info = postcard::to_allocvec(&t.peer_info(d).expect("info")).unwrap();
        put(dir, &format!("prefill{r}-for{d}"), &info);
        let peer = peer_of(&take(dir, &format!("decode{d}-for{r}"), || {}));
        dsts.push(t.connect(d, &peer).expect("connect"));
    }
    for d in 0..m {
        take(dir, &format!("ready{d}"), || {});
    }
    let mut sender = Sender::new(pool, Box::new(t.clone()));
    sender.open_decode(s.reg.clone(), dsts).expect("open");
    let mut descriptors = 0u64;
    for i in 0..case.chunk_ends.len() {
        assert!(
            t.wait_for_slots_sync(WAIT),
            "rank {r}: slots never came back"
        );
        let table = &s.src[..case.chunk_ends[i].div_ceil(PAGE_SIZE)];
        let pending = sender
            .send(REQUEST, table, case.end(i))
            .unwrap_or_else(|e| panic!("rank {r} chunk {i}: {e}"));
        descriptors += pending
            .decode_bytes()
            .iter()
            .filter(|b| b.total() > 0)
            .count() as u64;
        for status in pending.wait_each_sync().expect("chunk") {
            assert!(
                matches!(status.result, ChunkResult::Sent { .. }),
                "{status}"
            );
        }
    }
    assert_eq!(
        t.transfer_stats().snapshot().descriptors,
        descriptors,
        "rank {r}: one descriptor per (chunk, decode rank reached)"
    );
    put(dir, &format!("done{r}"), b"");
    println!("nixl dcp process: prefill rank {r} sent {descriptors} descriptors");
}

/// A CPU backend in immediate order: NIXL reads and writes its arena without waiting for any
/// stream.
fn immediate_cpu() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::with_order(StreamOrder::Immediate))
}

/// Decode ranks' pools NIXL can register, on `cpu`.
fn registrable(cpu: &Arc<CpuBackend>) -> impl Fn(&CacheGeometry, u64) -> DecodeSide + '_ {
    move |g, pages| {
        let pool = Arc::new(
            DevicePool::allocate_registrable(cpu.as_ref(), g, Placement::unsharded(), 0, pages)
                .unwrap(),
        );
        DecodeSide {
            owner: cpu.clone(),
            space: Arc::new(RemoteSpace::of(pool.clone(), g.clone()).unwrap()),
            pool,
            _keep: None,
        }
    }
}

/// A random case of a small shape (the agents move every byte over TCP).
fn small_case(rng: &mut StdRng) -> Case {
    let geometries = [
        CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![true, false],
        )),
        CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Scaled, 1)),
        CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Bf16, 1)),
    ];
    let n = *[1u32, 2, 3].choose(rng).unwrap();
    let m = *[1u32, 2, 3, 4].choose(rng).unwrap();
    let i = *[1u32, 3, 16, 64, 128].choose(rng).unwrap();
    let tokens = rng.random_range(1..600usize);
    let prefix_pages = if rng.random_bool(0.3) {
        rng.random_range(0..=(tokens - 1) / PAGE_SIZE)
    } else {
        0
    };
    let mut chunk_ends: Vec<usize> = (0..rng.random_range(0..3))
        .map(|_| rng.random_range(prefix_pages * PAGE_SIZE..=tokens))
        .collect();
    chunk_ends.push(tokens);
    chunk_ends.sort_unstable();
    Case {
        n,
        layout: DecodeLayout::new(m, i).unwrap(),
        geometry: geometries.choose(rng).unwrap().clone(),
        chunk_ends,
        prefix_pages,
        contiguous: rng.random_bool(0.3),
        separate_state: rng.random_bool(0.5),
    }
}

/// The decode ranks' targets and the prefill ranks' transports of a case, connected both ways:
/// per prefill rank its transport and its destinations (one per decode rank).
struct Wired {
    targets: Vec<NixlTarget>,
    transports: Vec<(NixlDecodeTransport, Vec<Arc<RemoteSpace>>)>,
}

fn wire(
    cpu: &Arc<CpuBackend>,
    name: &str,
    decode: &[DecodeSide],
    prefill: &[Arc<DevicePool>],
    slot_pages: u64,
) -> Wired {
    let n = prefill.len() as u32;
    let m = decode.len() as u32;
    let mut targets: Vec<NixlTarget> = decode
        .iter()
        .enumerate()
        .map(|(d, side)| {
            let config = NixlConfig {
                slot_pages,
                slots: 2,
                ..NixlConfig::new(format!("{name}-decode{d}"))
            };
            NixlTarget::new(NixlBackend::Cpu(cpu.clone()), side.pool.clone(), n, config)
                .expect("target")
        })
        .collect();
    let transports = prefill
        .iter()
        .enumerate()
        .map(|(r, pool)| {
            let config = NixlConfig {
                transfer_timeout: WAIT,
                ..NixlConfig::new(format!("{name}-prefill{r}"))
            };
            let t =
                NixlDecodeTransport::new(NixlBackend::Cpu(cpu.clone()), pool.clone(), config, m)
                    .expect("transport");
            let dsts = (0..m)
                .map(|d| {
                    let info = targets[d as usize].peer_info(r as u32).expect("info");
                    t.connect(d, &info).expect("connect")
                })
                .collect();
            for (d, target) in (0..m).zip(targets.iter_mut()) {
                target
                    .connect(r as u32, &t.peer_info(d).expect("info"))
                    .expect("decode connect");
            }
            (t, dsts)
        })
        .collect();
    Wired {
        targets,
        transports,
    }
}

/// Polls every target until `done` says so (bounded).
fn drive(
    targets: &mut [NixlTarget],
    finished: &mut [Vec<Finished>],
    mut done: impl FnMut(&[Vec<Finished>]) -> bool,
) {
    let deadline = Instant::now() + WAIT;
    while !done(finished) {
        for (t, f) in targets.iter_mut().zip(finished.iter_mut()) {
            f.extend(t.poll().expect("poll"));
        }
        assert!(Instant::now() < deadline, "nothing moved within {WAIT:?}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn case_random_cases() {
    let cpu = immediate_cpu();
    let base: Arc<dyn Backend> = cpu.clone();
    let stream = || -> Arc<dyn Backend> { cpu.clone() };
    for seed in 0..6u64 {
        let mut rng = StdRng::seed_from_u64(0xdc9 + seed);
        let case = small_case(&mut rng);
        let m = case.layout.ranks() as usize;
        let s = setup_with(&base, &stream, &registrable(&cpu), &case, &mut rng);
        let prefill: Vec<Arc<DevicePool>> = s.ranks.iter().map(|(_, p)| p.clone()).collect();
        // A slot holds the largest chunk whole.
        let slot_pages = case.pages() as u64 + 1;
        let mut w = wire(&cpu, &format!("dcp{seed}"), &s.decode, &prefill, slot_pages);
        for (d, target) in w.targets.iter_mut().enumerate() {
            target
                .register(s.reg.rank(d as u32).unwrap())
                .expect("register");
        }
        let mut senders: Vec<Sender> = w
            .transports
            .iter()
            .zip(&prefill)
            .map(|((t, dsts), pool)| {
                let mut sender = Sender::new(pool.clone(), Box::new(t.clone()));
                sender
                    .open_decode(s.reg.clone(), dsts.clone())
                    .expect("open");
                sender
            })
            .collect();
        let mut finished: Vec<Vec<Finished>> = vec![Vec::new(); m];
        let mut descriptors = 0u64;
        let table = |i: usize| &s.src[..case.chunk_ends[i].div_ceil(PAGE_SIZE)];
        for i in 0..case.chunk_ends.len() {
            for (r, sender) in senders.iter_mut().enumerate() {
                // Every slot free on both sides: the decode ranks have unpacked the chunks
                // before (their polls send the slots back).
                let t = &w.transports[r].0;
                drive(&mut w.targets, &mut finished, |_| {
                    t.wait_for_slots_sync(Duration::ZERO)
                });
                let mut pending: PendingChunk = sender
                    .send(REQUEST, table(i), case.end(i))
                    .unwrap_or_else(|e| panic!("{case:?} chunk {i} rank {r}: {e}"));
                descriptors += pending
                    .decode_bytes()
                    .iter()
                    .filter(|b| b.total() > 0)
                    .count() as u64;
                let mut statuses = None;
                drive(&mut w.targets, &mut finished, |_| {
                    statuses = pending.poll_each().expect("chunk");
                    statuses.is_some()
                });
                for status in statuses.unwrap() {
                    assert!(
                        matches!(status.result, ChunkResult::Sent { .. }),
                        "{status}"
                    );
                }
            }
        }
        drive(&mut w.targets, &mut finished, |f| {
            f.iter().all(|f| !f.is_empty())
        });
        check_decode_ranks(&case, &s, base.as_ref(), cpu.as_ref(), &finished);
        let posted: u64 = w
            .transports
            .iter()
            .map(|(t, _)| t.transfer_stats().snapshot().descriptors)
            .sum();
        assert_eq!(
            posted, descriptors,
            "{case:?}: one descriptor per (chunk, prefill rank, decode rank reached)"
        );
        println!(
            "nixl dcp: N {} into {} ({} chunks): byte-identical, {descriptors} descriptors",
            case.n,
            case.layout,
            case.chunk_ends.len()
        );
        drop(senders);
    }
}

fn case_refusals() {
    let cpu = immediate_cpu();
    let base: Arc<dyn Backend> = cpu.clone();
    let stream = || -> Arc<dyn Backend> { cpu.clone() };
    let mut rng = StdRng::seed_from_u64(7);
    let case = Case {
        n: 1,
        layout: DecodeLayout::new(2, 1).unwrap(),
        geometry: CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 1)),
        chunk_ends: vec![4 * PAGE as usize],
        prefix_pages: 0,
        contiguous: true,
        separate_state: false,
    };
    let s = setup_with(&base, &stream, &registrable(&cpu), &case, &mut rng);
    let prefill = vec![s.ranks[0].1.clone()];
    let pool = prefill[0].clone();

    // A mode without slots, and no decode ranks, are refused before any agent is made.
    let coalesced = NixlConfig {
        mode: kvshard::transfer::nixl::NixlMode::Coalesced,
        ..NixlConfig::new("refusals-coalesced")
    };
    let e = NixlDecodeTransport::new(NixlBackend::Cpu(cpu.clone()), pool.clone(), coalesced, 2)
        .expect_err("coalesced");
    assert!(matches!(e, kvshard::Error::InvalidArgument(_)), "{e}");
    let e = NixlDecodeTransport::new(
        NixlBackend::Cpu(cpu.clone()),
        pool.clone(),
        NixlConfig::new("refusals-zero"),
        0,
    )
    .expect_err("no decode ranks");
    assert!(matches!(e, kvshard::Error::OutOfBounds { .. }), "{e}");

    // Slots of one page: a 4-page chunk's rows for either rank (2 pages' worth) do not fit.
    let mut w = wire(&cpu, "refusals", &s.decode, &prefill, 1);
    for (d, target) in w.targets.iter_mut().enumerate() {
        target.register(s.reg.rank(d as u32).unwrap()).unwrap();
    }
    let (t, dsts) = &w.transports[0];
    // An unsharded request through a decode group: refused.
    let unsharded = kvshard::transfer::Registration {
        request: 99,
        layout: kvshard::transfer::PoolLayout::of(&s.decode[0].pool),
        prefix_pages: 0,
        pages: vec![kvshard::index::LocalPage(1)],
        state_pages: vec![kvshard::index::LocalPage(1)],
    };
    let mut sender = Sender::new(pool.clone(), Box::new(t.clone()));
    sender.open(unsharded, dsts[0].clone()).unwrap();
    let e = sender
        .send(99, &s.src[..1], kvshard::transfer::ChunkEnd::Final(64))
        .expect_err("unsharded");
    assert!(e.to_string().contains("decode context-parallel"), "{e}");

    let before: Vec<Vec<u8>> = s
        .decode
        .iter()
        .map(|d| d.pool.snapshot_sync(cpu.as_ref()).unwrap())
        .collect();
    sender.open_decode(s.reg.clone(), dsts.clone()).unwrap();
    let e = sender
        .send(REQUEST, &s.src, case.end(0))
        .expect_err("too large for a slot");
    assert!(e.to_string().contains("bounce slot"), "{e}");
    assert_eq!(t.transfer_stats().snapshot().descriptors, 0);
    // The slots it took for the ranks before the refusal are free again.
    assert!(t.wait_for_slots_sync(Duration::ZERO), "slots given back");
    for (d, side) in s.decode.iter().enumerate() {
        assert_eq!(
            side.pool.snapshot_sync(cpu.as_ref()).unwrap(),
            before[d],
            "decode rank {d} untouched"
        );
    }
}
