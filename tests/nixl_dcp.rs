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
//! (`UCX_TLS=tcp,self`, `UCX_NET_DEVICES=lo`) on DRAM pools, in a process of their own (this
//! binary run again with `--exact child_entry`): NIXL 1.5 was seen corrupting its heap when
//! agents come and go in one process across tests. Without the NIXL runtime the test prints
//! SKIPPED, or fails when KVSHARD_REQUIRE_NIXL is set.

mod common;

use common::dcp::{difference, owed, relayout, setup_with, Case, DecodeSide, PAGE, REQUEST};

use std::io::Write;
use std::process::{Command, Stdio};
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
    let mut child = Command::new(std::env::current_exe().expect("test binary path"))
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, case)
        .env("UCX_TLS", "tcp,self")
        .env("UCX_NET_DEVICES", "lo")
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the test process");
    let deadline = Instant::now() + 4 * WAIT;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            assert!(
                status.success(),
                "{test}: the test process failed ({status}); its stderr says why"
            );
            return;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{test}: the test process did not finish within {:?}",
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
        for (d, side) in s.decode.iter().enumerate() {
            assert_eq!(finished[d].len(), 1, "{case:?}: decode rank {d}");
            let f = &finished[d][0];
            assert!(f.is_completed(), "{case:?}: decode rank {d}: {f:?}");
            let got = side.pool.snapshot_sync(cpu.as_ref()).unwrap();
            if let Some(at) = difference(&case, s.decode_pages, &got, &want[d]) {
                panic!("{case:?}: decode rank {d} differs from the relaid reference at {at}");
            }
            // Each prefill rank's bytes for this decode rank, as it reported them.
            let owed: Vec<_> = (0..case.n)
                .map(|r| owed(&case, &s.src, r, d as u32))
                .collect();
            assert_eq!(f.bytes, owed, "{case:?}: decode rank {d}");
        }
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
    for (d, side) in s.decode.iter().enumerate() {
        assert_eq!(
            side.pool.snapshot_sync(cpu.as_ref()).unwrap(),
            before[d],
            "decode rank {d} untouched"
        );
    }
}
