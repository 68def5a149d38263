//! The transport on a transfer engine that moves raw ranges (Mooncake's), as library code: a
//! `MooncakeSender` per prefill rank and a `MooncakeReceiver` on the decode side, their side
//! channel's frames passed as bytes, and this test playing the engine (it moves each chunk's
//! ranges by hand: host memory copies on the CPU twin, device copies on the GPU). The decode
//! pool must end byte-identical to the in-process reference in every mode, with statuses
//! reported out of order; and the decode side must refuse, drop or bound everything a bad peer
//! sends, checked before use (the module docs of `transfer::mooncake::decode_side`).
//!
//! The CPU twin runs in the adversarial stream order (and immediate); the GPU tests print
//! SKIPPED without a GPU. Over real Mooncake engines across processes: the Python tests
//! (python/tests/test_mooncake*_cpu.py, test_faults_mooncake_cpu.py).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pd::{
    decode_pool, geometry, prefill_pool, reference, requests, Request, DECODE_PAGES, N,
};
use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::Backend;
use kvshard::error::Error;
use kvshard::index::LocalPage;
use kvshard::ipc::wire::ProtocolError;
use kvshard::transfer::mooncake::frames::{
    self, Bounced, Frame, FrameReader, WireDense, WireSection,
};
use kvshard::transfer::mooncake::{
    DecodeTarget, EngineAddresses, MooncakeChunk, MooncakeConfig, MooncakeMode, MooncakeReceiver,
    MooncakeSender, MAX_HELD_STATUSES,
};
use kvshard::transfer::{
    ChunkEnd, ChunkResult, ChunkStatus, ComponentBytes, Finished, Registration,
};

use common::dcp::{
    check_decode_ranks, random_case, setup, Case, Setup, PAGE, REQUEST as DCP_REQUEST,
};
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry, PAGE_SIZE};
use kvshard::shard::DecodeLayout;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SLOT_PAGES: u64 = 4;
const SLOTS: usize = 2;
const DEADLINE: Duration = Duration::from_secs(60);

/// A device's stream and how a transfer engine addresses its memory.
fn engine_device(device: &common::Device) -> (Arc<dyn Backend>, EngineAddresses) {
    match device.cpu_stream() {
        Some(cpu) => (cpu.clone(), EngineAddresses::Cpu(cpu)),
        None => (device.stream(), EngineAddresses::Device),
    }
}

/// The engine: moves every range of `chunk` (engine addresses) and waits until they landed.
fn move_by_hand(chunk: &MooncakeChunk, backend: &dyn Backend, addresses: &EngineAddresses) {
    let ranges = chunk
        .src_addrs()
        .iter()
        .zip(chunk.dst_addrs())
        .zip(chunk.lengths());
    for ((&src, &dst), &len) in ranges {
        match addresses {
            // SAFETY: the ranges are the sender's and the decode pool's memory as the engine
            // addresses it (host addresses of live CPU-twin allocations, held by the sender,
            // the pools and the receiver for the whole test); the packing that wrote the source
            // has run (`ready`), and nothing else touches the destination meanwhile.
            EngineAddresses::Cpu(_) => unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize)
            },
            // SAFETY: device memory of live allocations of this GPU, as above.
            EngineAddresses::Device => unsafe {
                backend.memcpy(dst, src, len as usize).expect("engine copy")
            },
        }
    }
    backend.synchronize().expect("the engine's copies landed");
}

/// One prefill rank: its sender, and the side channel's bytes from the decode.
struct Rank {
    sender: MooncakeSender,
    reader: FrameReader,
}

impl Rank {
    /// Takes what the decode sent: registrations open, frees free their slot.
    fn take(&mut self, bytes: &[u8], layout: &kvshard::transfer::PoolLayout) {
        let (frames, error) = self.reader.feed(bytes);
        assert!(error.is_none(), "{error:?}");
        for frame in frames {
            match frame {
                Frame::Register {
                    request,
                    prefix_pages,
                    pages,
                    state_pages,
                } => {
                    let registration = Registration {
                        request,
                        layout: layout.clone(),
                        prefix_pages: prefix_pages as usize,
                        pages: pages.into_iter().map(LocalPage).collect(),
                        state_pages: state_pages.into_iter().map(LocalPage).collect(),
                    };
                    self.sender.open(registration).expect("open");
                }
                Frame::Free {
                    slot,
                    request,
                    chunk,
                } => self
                    .sender
                    .bounce_free(slot as usize, Some((request, chunk)))
                    .expect("a free names the chunk its slot holds"),
                other => panic!("the decode sent {other:?}"),
            }
        }
    }
}

/// The decode side and N ranks joined over frames, every request registered.
fn joined(
    backend: &Arc<dyn Backend>,
    addresses: &EngineAddresses,
    seed: u64,
    mode: MooncakeMode,
    reqs: &[Request],
) -> (MooncakeReceiver, Vec<Rank>) {
    let mut decode = MooncakeReceiver::new(
        decode_pool(backend.as_ref()),
        backend.clone(),
        addresses.clone(),
        N,
        SLOT_PAGES,
        SLOTS,
        DEADLINE,
    )
    .expect("receiver");
    let mut ranks = Vec::new();
    for rank in 0..N {
        let hi = Frame::Hi {
            rank,
            shape: frames::shape_of(&geometry()),
        };
        let Ok((
            r,
            Frame::Hello {
                bases,
                pages,
                bounce,
                ..
            },
        )) = decode.join(&hi, "decode")
        else {
            panic!("rank {rank} refused");
        };
        assert_eq!(r, rank);
        let config = MooncakeConfig {
            mode,
            bounce_pages: SLOT_PAGES,
            ..MooncakeConfig::default()
        };
        let target = DecodeTarget {
            bases,
            pages,
            bounces: bounce,
        };
        let pool = prefill_pool(backend.as_ref(), seed, rank);
        let sender = MooncakeSender::new(pool, backend.clone(), addresses.clone(), target, config)
            .expect("sender");
        ranks.push(Rank {
            sender,
            reader: FrameReader::new(),
        });
    }
    let layout = kvshard::transfer::PoolLayout::packed(geometry(), DECODE_PAGES);
    for r in reqs {
        let bytes = decode
            .register(r.registration.clone(), None)
            .expect("register");
        for rank in &mut ranks {
            rank.take(&bytes, &layout);
        }
    }
    (decode, ranks)
}

/// Sends every request in `mode`, each rank reporting a request's statuses last chunk first;
/// returns the decode pool's bytes once every request finished.
fn send_all(device: &common::Device, mode: MooncakeMode) -> (Vec<u8>, u64) {
    let (backend, addresses) = engine_device(device);
    let seed = 7;
    let reqs = requests(seed);
    let (mut decode, mut ranks) = joined(&backend, &addresses, seed, mode, &reqs);
    let layout = kvshard::transfer::PoolLayout::packed(geometry(), DECODE_PAGES);
    let mut finished: Vec<Finished> = Vec::new();
    let mut bounced = 0;
    for r in &reqs {
        for (rank, side) in ranks.iter_mut().enumerate() {
            let mut frames = Vec::new();
            for &end in &r.chunks {
                let chunk = side
                    .sender
                    .send(r.registration.request, &r.src_pages, end)
                    .expect("send");
                let start = Instant::now();
                while !chunk.ready().expect("ready") {
                    assert!(
                        start.elapsed() < Duration::from_secs(10),
                        "packing never ran"
                    );
                }
                bounced += u64::from(chunk.slot().is_some());
                move_by_hand(&chunk, backend.as_ref(), &addresses);
                chunk.posted(Duration::ZERO).expect("posted");
                chunk.landed(Duration::ZERO).expect("landed");
                let status = chunk.poll().expect("poll").expect("landed");
                frames.push(frames::encode(&chunk.status_frame(status)).expect("encode"));
            }
            // Out of order: the decode holds later chunks until the earlier ones arrive.
            for bytes in frames.iter().rev() {
                assert_eq!(decode.feed(rank as u32, bytes), None);
            }
            finished.extend(decode.poll().expect("poll"));
            let out = decode.take_outgoing(rank as u32);
            side.take(&out, &layout);
        }
    }
    let start = Instant::now();
    while finished.len() < reqs.len() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "requests never finished"
        );
        finished.extend(decode.poll().expect("poll"));
        for (rank, side) in ranks.iter_mut().enumerate() {
            side.take(&decode.take_outgoing(rank as u32), &layout);
        }
    }
    assert!(finished.iter().all(Finished::is_completed), "{finished:?}");
    assert_eq!(decode.pending_requests(), 0);
    assert_eq!(decode.counters().dropped_statuses, 0);
    for (rank, side) in ranks.iter().enumerate() {
        assert_eq!(
            decode.busy_slots(rank as u32),
            0,
            "a slot held on the decode side"
        );
        assert_eq!(side.sender.bounce_slots_free(), side.sender.bounce_slots());
        let stats = side.sender.stats();
        assert_eq!(stats.chunks, 9);
        assert_eq!(stats.failed_transfers, 0);
    }
    let snapshot = decode
        .pool()
        .snapshot_sync(backend.as_ref())
        .expect("snapshot");
    (snapshot, bounced)
}

// Every mode moves every request byte-identical to the in-process reference, statuses of a
// request reported last chunk first, every slot freed.
common::on_cpu_and_gpu!(
    every_mode_matches_the_reference_with_statuses_out_of_order,
    [
        StreamOrder::Immediate,
        StreamOrder::Adversarial(1),
        StreamOrder::Adversarial(2)
    ],
    |device| {
        let want = reference(7, &requests(7));
        for mode in [
            MooncakeMode::Auto,
            MooncakeMode::Coalesced,
            MooncakeMode::Bounce,
        ] {
            let (got, bounced) = send_all(&device, mode);
            assert!(
                got == want,
                "{mode:?} on {device}: differs from the reference"
            );
            assert_eq!(bounced > 0, mode != MooncakeMode::Coalesced, "{mode:?}");
        }
    }
);

fn cpu() -> (Arc<dyn Backend>, EngineAddresses) {
    let cpu = Arc::new(kvshard::backend::cpu::CpuBackend::new());
    (cpu.clone(), EngineAddresses::Cpu(cpu))
}

/// A decode side of N ranks, joined, with requests 1 and 2 registered (two pages each).
fn decode_with_two_requests() -> MooncakeReceiver {
    let (backend, addresses) = cpu();
    let mut decode = MooncakeReceiver::new(
        decode_pool(backend.as_ref()),
        backend,
        addresses,
        N,
        SLOT_PAGES,
        SLOTS,
        DEADLINE,
    )
    .expect("receiver");
    for rank in 0..N {
        let hi = Frame::Hi {
            rank,
            shape: frames::shape_of(&geometry()),
        };
        decode.join(&hi, "decode").expect("join");
    }
    for request in [1u64, 2] {
        let pages: Vec<LocalPage> = (0..2).map(|p| LocalPage(10 * request + p)).collect();
        let registration = Registration {
            request,
            layout: kvshard::transfer::PoolLayout::packed(geometry(), DECODE_PAGES),
            prefix_pages: 0,
            pages: pages.clone(),
            state_pages: pages,
        };
        decode.register(registration, None).expect("register");
    }
    decode
}

fn status(request: u64, rank: u32, chunk: u32, last: bool) -> ChunkStatus {
    ChunkStatus {
        request,
        rank,
        chunk,
        result: ChunkResult::Sent {
            bytes: ComponentBytes::default(),
            last,
        },
    }
}

fn frame(status: ChunkStatus, bounced: Option<(u32, Vec<u64>)>) -> Vec<u8> {
    let bounced = bounced.map(|(slot, pages)| Bounced {
        slot,
        sections: vec![WireSection {
            components: vec![0],
            pages,
        }],
    });
    frames::encode(&Frame::Status { status, bounced }).expect("encode")
}

/// Polls until `n` requests finished.
fn finish(decode: &mut MooncakeReceiver, n: usize) -> Vec<Finished> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        assert!(start.elapsed() < Duration::from_secs(5), "{out:?}");
        out.extend(decode.poll().expect("poll"));
    }
    out.sort_by_key(Finished::request);
    out
}

fn failed_ranks(f: &Finished) -> Vec<u32> {
    match &f.outcome {
        kvshard::transfer::Outcome::Completed => Vec::new(),
        kvshard::transfer::Outcome::Failed(fs) => fs.iter().map(|f| f.rank).collect(),
    }
}

#[test]
fn a_bad_frame_ends_its_rank_after_the_good_frames_before_it() {
    let mut decode = decode_with_two_requests();
    let mut bytes = frame(status(1, 1, 0, true), None);
    bytes.extend(b"KVSM\x01\x00\x00\x00\x03\x00\x00\x00\xff\xff\xff");
    bytes.extend(frame(status(2, 1, 0, true), None));
    assert!(decode.feed(1, &bytes).is_some());
    assert!(decode
        .gone(1)
        .is_some_and(|w| w.contains("protocol violation")));
    assert_eq!(decode.counters().refused_frames, 1);
    // Rank 1's later bytes are not read; rank 0 is still served.
    assert_eq!(decode.feed(1, &frame(status(2, 1, 0, true), None)), None);
    let mut ok = frame(status(1, 0, 0, true), None);
    ok.extend(frame(status(2, 0, 0, true), None));
    assert_eq!(decode.feed(0, &ok), None);
    let done = finish(&mut decode, 2);
    assert!(
        done[0].is_completed(),
        "the good status before the bad frame was kept"
    );
    assert_eq!(failed_ranks(&done[1]), vec![1]);
    assert_eq!(decode.pending_requests(), 0);
}

#[test]
fn a_status_is_checked_before_use_and_a_bad_one_ends_its_rank() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("another rank's chunk", frame(status(1, 0, 0, true), None)),
        (
            "a slot out of range",
            frame(status(1, 1, 0, true), Some((SLOTS as u32, vec![11]))),
        ),
        (
            "a page outside the pool",
            frame(status(1, 1, 0, true), Some((0, vec![DECODE_PAGES]))),
        ),
        (
            "more pages than the slot holds",
            frame(
                status(1, 1, 0, true),
                Some((0, (1..=SLOT_PAGES + 1).collect())),
            ),
        ),
        ("a frame a rank never sends", {
            frames::encode(&Frame::Register {
                request: 9,
                prefix_pages: 0,
                pages: vec![1],
                state_pages: vec![1],
            })
            .expect("encode")
        }),
        ("a slot still held", {
            let mut b = frame(status(1, 1, 0, false), Some((0, vec![11])));
            b.extend(frame(status(2, 1, 0, true), Some((0, vec![21]))));
            b
        }),
    ];
    for (what, bytes) in cases {
        let mut decode = decode_with_two_requests();
        assert!(decode.feed(1, &bytes).is_some(), "{what}: accepted");
        assert_eq!(decode.counters().refused_frames, 1, "{what}");
        let mut ok = frame(status(1, 0, 0, true), None);
        ok.extend(frame(status(2, 0, 0, true), None));
        assert_eq!(decode.feed(0, &ok), None);
        let done = finish(&mut decode, 2);
        assert!(
            done.iter().all(|f| failed_ranks(f) == vec![1]),
            "{what}: {done:?}"
        );
        assert_eq!(decode.busy_slots(1), 0, "{what}");
    }
}

#[test]
fn statuses_of_unknown_requests_and_duplicates_are_dropped_and_counted_not_held() {
    let mut decode = decode_with_two_requests();
    let mut flood = Vec::new();
    for request in 100..5100u64 {
        flood.extend(frame(status(request, 0, 0, true), None));
    }
    // An unknown bounced status: its slot is freed, for exactly that chunk.
    flood.extend(frame(status(99, 0, 3, true), Some((1, vec![5]))));
    assert_eq!(decode.feed(0, &flood), None);
    let c = decode.counters();
    assert_eq!(
        (c.dropped_statuses, c.freed_for_dropped, c.refused_frames),
        (5001, 1, 0)
    );
    let (frames, _) = FrameReader::new().feed(&decode.take_outgoing(0));
    assert_eq!(
        frames,
        vec![Frame::Free {
            slot: 1,
            request: 99,
            chunk: 3
        }]
    );
    // Duplicates (of a held and of a taken chunk) and a reordered pair.
    let mut b = frame(status(1, 0, 1, true), None);
    b.extend(frame(status(1, 0, 1, true), None));
    b.extend(frame(status(1, 0, 0, false), None));
    b.extend(frame(status(1, 0, 0, false), None));
    assert_eq!(decode.feed(0, &b), None);
    assert_eq!(decode.feed(1, &frame(status(1, 1, 0, true), None)), None);
    let done = finish(&mut decode, 1);
    assert!(done[0].is_completed());
    assert_eq!(decode.counters().dropped_statuses, 5003);
}

#[test]
fn statuses_waiting_for_an_earlier_chunk_are_bounded() {
    let mut decode = decode_with_two_requests();
    let mut b = Vec::new();
    for chunk in 1..=MAX_HELD_STATUSES as u32 {
        b.extend(frame(status(1, 1, chunk, false), None));
    }
    assert_eq!(decode.feed(1, &b), None, "up to the bound is held");
    let err = decode.feed(1, &frame(status(1, 1, 5000, false), None));
    assert!(
        matches!(err, Some(ProtocolError::Invalid { .. })),
        "{err:?}"
    );
    assert_eq!(decode.feed(0, &frame(status(1, 0, 0, true), None)), None);
    assert_eq!(decode.feed(0, &frame(status(2, 0, 0, true), None)), None);
    let done = finish(&mut decode, 2);
    assert!(done.iter().all(|f| failed_ranks(f) == vec![1]));
}

#[test]
fn an_overdue_request_is_aborted_and_handed_back_once_the_rank_says_aborted() {
    let (backend, addresses) = cpu();
    let mut decode = MooncakeReceiver::new(
        decode_pool(backend.as_ref()),
        backend,
        addresses,
        N,
        SLOT_PAGES,
        SLOTS,
        Duration::from_millis(50),
    )
    .expect("receiver");
    for rank in 0..N {
        let hi = Frame::Hi {
            rank,
            shape: frames::shape_of(&geometry()),
        };
        decode.join(&hi, "decode").expect("join");
    }
    let pages = vec![LocalPage(3), LocalPage(4)];
    let registration = Registration {
        request: 1,
        layout: kvshard::transfer::PoolLayout::packed(geometry(), DECODE_PAGES),
        prefix_pages: 0,
        pages: pages.clone(),
        state_pages: pages,
    };
    decode.register(registration, None).expect("register");
    // Rank 0 reports; rank 1's status is lost on the way.
    assert_eq!(decode.feed(0, &frame(status(1, 0, 0, true), None)), None);
    std::thread::sleep(Duration::from_millis(60));
    assert!(decode.poll().expect("poll").is_empty());
    let overdue = decode.expire();
    assert_eq!(overdue.len(), 1);
    assert_eq!(overdue[0].missing.len(), 1);
    assert_eq!(overdue[0].missing[0].rank, 1);
    let (aborts, _) = FrameReader::new().feed(&decode.take_outgoing(1));
    assert!(matches!(
        aborts.as_slice(),
        [Frame::Abort { request: 1, .. }]
    ));
    assert!(decode.take_outgoing(0).is_empty(), "rank 0 owes nothing");
    // Held until rank 1 says it has nothing of the request in flight.
    assert!(decode.poll().expect("poll").is_empty());
    // It still holds slot 1 for chunk 0, whose status never came: the decode frees it.
    let aborted = frames::encode(&Frame::Aborted {
        request: 1,
        held: vec![(1, 0)],
    })
    .expect("encode");
    assert_eq!(decode.feed(1, &aborted), None);
    let (frees, _) = FrameReader::new().feed(&decode.take_outgoing(1));
    assert_eq!(
        frees,
        vec![Frame::Free {
            slot: 1,
            request: 1,
            chunk: 0
        }]
    );
    let done = finish(&mut decode, 1);
    let failed = failed_ranks(&done[0]);
    assert!(
        !failed.is_empty() && failed.iter().all(|&r| r == 1),
        "{failed:?}"
    );
    assert_eq!(decode.pending_requests(), 0);
}

#[test]
fn a_sender_frees_a_slot_only_for_the_chunk_it_holds_once_the_engine_reported_it() {
    let (backend, addresses) = cpu();
    let reqs = requests(7);
    let (_decode, mut ranks) = joined(&backend, &addresses, 7, MooncakeMode::Bounce, &reqs);
    let sender = &mut ranks[0].sender;
    let r = &reqs[0];
    let chunk = sender
        .send(r.registration.request, &r.src_pages, r.chunks[0])
        .expect("send");
    let slot = chunk.slot().expect("bounced");
    let moving = sender.bounce_free(slot, Some((r.registration.request, chunk.chunk())));
    assert!(
        matches!(moving, Err(Error::InvalidArgument(_))),
        "{moving:?}"
    );
    chunk.landed(Duration::ZERO).expect("landed");
    assert!(chunk.landed(Duration::ZERO).is_err(), "reported twice");
    let other = sender.bounce_free(slot, Some((r.registration.request, chunk.chunk() + 1)));
    assert!(matches!(other, Err(Error::InvalidArgument(_))), "{other:?}");
    assert_eq!(sender.bounce_slots_free(), SLOTS - 1);
    sender
        .bounce_free(slot, Some((r.registration.request, chunk.chunk())))
        .expect("free");
    assert!(sender.bounce_free(slot, None).is_err(), "free already");
    assert!(sender.bounce_free(SLOTS, None).is_err(), "out of range");
    assert!(chunk.poll().expect("poll").is_some());
}

#[test]
fn a_chunk_the_engine_never_reports_fails_at_its_transfer_timeout() {
    let (backend, addresses) = cpu();
    let pool = prefill_pool(backend.as_ref(), 7, 0);
    let (_, bases) =
        kvshard::transfer::mooncake::pool_memory(&decode_pool(backend.as_ref()), &addresses)
            .expect("memory");
    let config = MooncakeConfig {
        transfer_timeout: Duration::from_millis(30),
        ..MooncakeConfig::default()
    };
    let target = DecodeTarget {
        bases,
        pages: DECODE_PAGES,
        bounces: Vec::new(),
    };
    let mut sender = MooncakeSender::new(pool, backend, addresses, target, config).expect("sender");
    let r = &requests(7)[0];
    sender.open(r.registration.clone()).expect("open");
    let chunk = sender
        .send(r.registration.request, &r.src_pages, r.chunks[0])
        .expect("send");
    assert!(chunk.poll().expect("moving").is_none());
    std::thread::sleep(Duration::from_millis(40));
    assert!(matches!(chunk.poll(), Err(Error::ChunkFailed { .. })));
    assert_eq!(sender.stats().failed_transfers, 1);
}

#[test]
fn a_transfer_timeout_no_clock_reaches_is_none_and_a_zero_one_is_refused() {
    let (backend, addresses) = cpu();
    let (_, bases) =
        kvshard::transfer::mooncake::pool_memory(&decode_pool(backend.as_ref()), &addresses)
            .expect("memory");
    let target = |bounces: usize| DecodeTarget {
        bases: bases.clone(),
        pages: DECODE_PAGES,
        bounces: vec![(1 << 20, 1 << 20); bounces],
    };
    let sender = |timeout: Duration, bounces: usize| {
        let config = MooncakeConfig {
            transfer_timeout: timeout,
            ..MooncakeConfig::default()
        };
        let pool = prefill_pool(backend.as_ref(), 7, 0);
        MooncakeSender::new(
            pool,
            backend.clone(),
            addresses.clone(),
            target(bounces),
            config,
        )
    };
    // Old behaviour: an instant plus Duration::MAX panicked in the first send.
    let mut unbounded = sender(Duration::MAX, 0).expect("no deadline");
    let r = &requests(7)[0];
    unbounded.open(r.registration.clone()).expect("open");
    let chunk = unbounded
        .send(r.registration.request, &r.src_pages, r.chunks[0])
        .expect("send");
    assert!(chunk.poll().expect("moving").is_none());
    chunk.landed(Duration::ZERO).expect("landed");
    assert!(chunk.wait_sync().is_ok());
    assert!(matches!(
        sender(Duration::ZERO, 0),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        sender(
            Duration::from_secs(1),
            kvshard::transfer::mooncake::MAX_SLOTS + 1
        ),
        Err(Error::OutOfBounds { .. })
    ));
}

// ---- Decode context parallelism (docs/dcp.md, "Mooncake"): N prefill ranks, each a
// `MooncakeSender` reaching the M decode ranks (each a `MooncakeReceiver` of its own pool), every
// chunk packed per decode rank into a slot of that rank's and moved as one range.

/// The decode ranks' receivers and the prefill ranks' senders of a case, joined over frames
/// (each prefill rank greets every decode rank; decode rank d is its destination d), the
/// request registered on every decode rank (its share) and opened on every prefill rank.
struct DcpWired {
    decode: Vec<MooncakeReceiver>,
    senders: Vec<MooncakeSender>,
}

fn dcp_wire(
    cpu: &Arc<CpuBackend>,
    s: &Setup,
    slot_pages: u64,
    slots: usize,
    mode: MooncakeMode,
) -> DcpWired {
    let backend: Arc<dyn Backend> = cpu.clone();
    let addresses = EngineAddresses::Cpu(cpu.clone());
    let n = s.ranks.len() as u32;
    let mut decode: Vec<MooncakeReceiver> = s
        .decode
        .iter()
        .map(|side| {
            MooncakeReceiver::new(
                side.pool.clone(),
                backend.clone(),
                addresses.clone(),
                n,
                slot_pages,
                slots,
                DEADLINE,
            )
            .expect("receiver")
        })
        .collect();
    let senders = (0..n)
        .map(|r| {
            let targets: Vec<DecodeTarget> = decode
                .iter_mut()
                .map(|d| {
                    let hi = Frame::Hi {
                        rank: r,
                        shape: frames::shape_of(d.pool().geometry()),
                    };
                    let Ok((
                        _,
                        Frame::Hello {
                            bases,
                            pages,
                            bounce,
                            ..
                        },
                    )) = d.join(&hi, "decode")
                    else {
                        panic!("rank {r} refused");
                    };
                    DecodeTarget {
                        bases,
                        pages,
                        bounces: bounce,
                    }
                })
                .collect();
            let config = MooncakeConfig {
                mode,
                bounce_pages: slot_pages,
                ..MooncakeConfig::default()
            };
            let mut targets = targets.into_iter();
            let mut sender = MooncakeSender::new(
                s.ranks[r as usize].1.clone(),
                backend.clone(),
                addresses.clone(),
                targets.next().expect("a decode rank"),
                config,
            )
            .expect("sender");
            for (d, t) in (1..).zip(targets) {
                assert_eq!(sender.add_destination(t).expect("destination"), d);
            }
            sender
        })
        .collect::<Vec<_>>();
    for (d, receiver) in (0u32..).zip(&mut decode) {
        receiver
            .register_decode(&s.reg, d, None)
            .expect("register the share");
    }
    let mut senders = senders;
    let all: Vec<usize> = (0..decode.len()).collect();
    for sender in &mut senders {
        sender.open_decode(s.reg.clone(), &all).expect("open");
    }
    DcpWired { decode, senders }
}

/// Polls every decode rank once, handing its frees to the senders (decode rank d is each
/// sender's destination d), and collects what finished.
fn dcp_poll(w: &mut DcpWired, finished: &mut [Vec<Finished>]) {
    for (d, receiver) in w.decode.iter_mut().enumerate() {
        finished[d].extend(receiver.poll().expect("poll"));
        for (r, sender) in w.senders.iter().enumerate() {
            let (frames, error) = FrameReader::new().feed(&receiver.take_outgoing(r as u32));
            assert!(error.is_none(), "{error:?}");
            for frame in frames {
                let Frame::Free {
                    slot,
                    request,
                    chunk,
                } = frame
                else {
                    panic!("decode rank {d} sent {frame:?}");
                };
                sender
                    .bounce_free_at(d, slot as usize, Some((request, chunk)))
                    .expect("a free names the chunk its slot holds");
            }
        }
    }
}

/// Sends every chunk of `case` through the wired ranks, the test playing the engine, each
/// chunk's statuses delivered to the decode ranks in a random order; checks one descriptor per
/// (chunk, prefill rank, decode rank reached); returns the descriptors and what finished.
fn dcp_send_all(
    cpu: &Arc<CpuBackend>,
    case: &Case,
    s: &Setup,
    w: &mut DcpWired,
    rng: &mut StdRng,
) -> (u64, Vec<Vec<Finished>>) {
    let backend: Arc<dyn Backend> = cpu.clone();
    let addresses = EngineAddresses::Cpu(cpu.clone());
    let m = case.layout.ranks() as usize;
    let mut finished: Vec<Vec<Finished>> = vec![Vec::new(); m];
    let mut descriptors = 0u64;
    for i in 0..case.chunk_ends.len() {
        let table = &s.src[..case.chunk_ends[i].div_ceil(PAGE_SIZE)];
        for r in 0..w.senders.len() {
            // Every slot free: the decode ranks unpacked the chunks before and sent the frees.
            let start = Instant::now();
            while (0..m).any(|d| {
                w.senders[r].bounce_slots_free_at(d) < w.decode[d].bounce_regions(0).unwrap().len()
            }) {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "slots never freed"
                );
                dcp_poll(w, &mut finished);
            }
            let chunk = w.senders[r]
                .send(DCP_REQUEST, table, case.end(i))
                .unwrap_or_else(|e| panic!("{case:?} chunk {i} rank {r}: {e}"));
            let start = Instant::now();
            while !chunk.ready().expect("ready") {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "packing never ran"
                );
            }
            move_by_hand(&chunk, backend.as_ref(), &addresses);
            chunk.posted(Duration::ZERO).expect("posted");
            chunk.landed(Duration::ZERO).expect("landed");
            let statuses = chunk.poll_each().expect("poll").expect("landed");
            assert_eq!(statuses.len(), m);
            // One descriptor per decode rank the chunk moves rows to, into that rank.
            let reached: Vec<u32> = (0u32..)
                .zip(&statuses)
                .filter(|(_, st)| match &st.result {
                    ChunkResult::Sent { bytes, .. } => bytes.total() > 0,
                    ChunkResult::Failed { .. } => panic!("{st}"),
                })
                .map(|(d, _)| d)
                .collect();
            assert_eq!(chunk.targets(), &reached[..], "{case:?} chunk {i} rank {r}");
            descriptors += reached.len() as u64;
            let mut order: Vec<usize> = (0..m).collect();
            order.sort_by_key(|_| rng.random::<u32>());
            for d in order {
                let frame = chunk
                    .decode_status_frame(d as u32, statuses[d].clone())
                    .expect("frame");
                assert_eq!(
                    matches!(frame, Frame::DenseStatus { .. }),
                    reached.contains(&(d as u32)),
                    "a rank reached gets a dense status, the others their status alone"
                );
                let bytes = frames::encode(&frame).expect("encode");
                assert_eq!(w.decode[d].feed(r as u32, &bytes), None, "decode rank {d}");
            }
        }
    }
    let start = Instant::now();
    while finished.iter().any(Vec::is_empty) {
        assert!(start.elapsed() < Duration::from_secs(10), "never finished");
        dcp_poll(w, &mut finished);
    }
    (descriptors, finished)
}

#[test]
fn dcp_chunks_match_the_relaid_reference_one_descriptor_per_decode_rank_reached() {
    for seed in 0..10u64 {
        let order = if seed % 2 == 0 {
            StreamOrder::Adversarial(seed)
        } else {
            StreamOrder::Immediate
        };
        let cpu = Arc::new(CpuBackend::with_order(order));
        let base: Arc<dyn Backend> = cpu.clone();
        let stream = || -> Arc<dyn Backend> { cpu.clone() };
        let mut rng = StdRng::seed_from_u64(0x3c0 + seed);
        let case = random_case(&mut rng);
        let s = setup(&base, &stream, &case, &mut rng);
        // A slot holds the largest chunk whole.
        let slot_pages = case.pages() as u64 + 1;
        let mut w = dcp_wire(&cpu, &s, slot_pages, SLOTS, MooncakeMode::Bounce);
        let (descriptors, finished) = dcp_send_all(&cpu, &case, &s, &mut w, &mut rng);
        check_decode_ranks(&case, &s, base.as_ref(), base.as_ref(), &finished);
        for decode in &w.decode {
            let c = decode.counters();
            assert_eq!((c.refused_frames, c.dropped_statuses), (0, 0), "{c:?}");
            assert_eq!(decode.pending_requests(), 0);
        }
        let posted: u64 = w.senders.iter().map(|t| t.stats().descriptors).sum();
        assert_eq!(
            posted, descriptors,
            "{case:?}: one descriptor per (chunk, prefill rank, decode rank reached)"
        );
        for sender in &w.senders {
            for d in 0..sender.destinations() {
                assert_eq!(sender.bounce_slots_free_at(d), SLOTS, "every slot freed");
            }
        }
        println!(
            "mooncake dcp: N {} into {} ({} chunks, prefix {}): byte-identical, {descriptors} descriptors",
            case.n,
            case.layout,
            case.chunk_ends.len(),
            case.prefix_pages
        );
    }
}

/// N = 1 into M = 2 at I = 1, four pages in one final chunk: either rank's rows take two pages.
fn small_dcp_case() -> Case {
    Case {
        n: 1,
        layout: DecodeLayout::new(2, 1).unwrap(),
        geometry: CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 1)),
        chunk_ends: vec![2 * PAGE as usize, 4 * PAGE as usize],
        prefix_pages: 0,
        contiguous: true,
        separate_state: false,
    }
}

fn dcp_setup(cpu: &Arc<CpuBackend>, case: &Case) -> Setup {
    let base: Arc<dyn Backend> = cpu.clone();
    let stream = || -> Arc<dyn Backend> { cpu.clone() };
    setup(&base, &stream, case, &mut StdRng::seed_from_u64(11))
}

fn snapshots(cpu: &Arc<CpuBackend>, s: &Setup) -> Vec<Vec<u8>> {
    s.decode
        .iter()
        .map(|d| d.pool.snapshot_sync(cpu.as_ref()).unwrap())
        .collect()
}

#[test]
fn dcp_refusals_move_nothing() {
    let cpu = Arc::new(CpuBackend::new());
    let case = small_dcp_case();
    let s = dcp_setup(&cpu, &case);
    let before = snapshots(&cpu, &s);
    let table = |i: usize| &s.src[..case.chunk_ends[i].div_ceil(PAGE_SIZE)];
    let refused = |e: Error, what: &str| {
        assert!(matches!(e, Error::ChunkFailed { .. }), "{what}: {e}");
        assert!(e.to_string().contains(what), "{e}");
    };

    // Slots of one page: either rank's two pages of rows do not fit.
    let mut w = dcp_wire(&cpu, &s, 1, SLOTS, MooncakeMode::Bounce);
    let e = w.senders[0]
        .send(DCP_REQUEST, table(1), ChunkEnd::Final(case.tokens()))
        .expect_err("too large for a slot");
    refused(e, "more than a bounce slot");
    for d in 0..2 {
        assert_eq!(w.senders[0].bounce_slots_free_at(d), SLOTS, "no slot held");
    }
    assert_eq!(w.senders[0].stats().descriptors, 0);

    // No free slot: one slot per decode rank, held by chunk 0 (never moved, never freed).
    let mut w = dcp_wire(&cpu, &s, 4, 1, MooncakeMode::Bounce);
    let first = w.senders[0]
        .send(DCP_REQUEST, table(0), case.end(0))
        .expect("chunk 0");
    assert_eq!(first.lengths().len(), 2);
    let e = w.senders[0]
        .send(DCP_REQUEST, table(1), case.end(1))
        .expect_err("no slot");
    refused(e, "no bounce slot free at decode rank 0");
    assert_eq!(first.targets(), &[0, 1]);
    drop(first);

    // Coalesced: no route for rows.
    let mut w = dcp_wire(&cpu, &s, 4, SLOTS, MooncakeMode::Coalesced);
    let e = w.senders[0]
        .send(DCP_REQUEST, table(1), ChunkEnd::Final(case.tokens()))
        .expect_err("coalesced");
    refused(e, "only through bounce slots");

    // Destinations out of range or named twice: refused, nothing opened.
    let mut w = dcp_wire(&cpu, &s, 4, SLOTS, MooncakeMode::Bounce);
    let reg = kvshard::transfer::DecodeRegistration {
        request: 5,
        ..s.reg.clone()
    };
    for bad in [&[0usize, 2][..], &[1, 1], &[0]] {
        assert!(
            w.senders[0].open_decode(reg.clone(), bad).is_err(),
            "{bad:?}"
        );
    }
    assert_eq!(w.senders[0].pending_requests(), 1);
    // Every refusal above moved nothing into any decode rank.
    assert_eq!(snapshots(&cpu, &s), before);
}

/// A decode rank's receiver of `small_dcp_case`, its share registered, and a dense status frame
/// of prefill rank 0's first chunk as the sender made it (its region moved by hand).
fn dcp_decode_and_status(cpu: &Arc<CpuBackend>, s: &Setup) -> (DcpWired, ChunkStatus, WireDense) {
    let mut w = dcp_wire(cpu, s, 4, SLOTS, MooncakeMode::Bounce);
    let chunk = w.senders[0]
        .send(
            DCP_REQUEST,
            &s.src[..2],
            ChunkEnd::Partial(2 * PAGE as usize),
        )
        .expect("chunk 0");
    move_by_hand(&chunk, cpu.as_ref(), &EngineAddresses::Cpu(cpu.clone()));
    chunk.landed(Duration::ZERO).expect("landed");
    let statuses = chunk.poll_each().expect("poll").expect("landed");
    let Frame::DenseStatus { status, dense } = chunk
        .decode_status_frame(1, statuses[1].clone())
        .expect("frame")
    else {
        panic!("rank 1 gets rows of chunk 0");
    };
    (w, status, dense)
}

/// Makes a (malformed) frame from a good dense status.
type MakeFrame<'a> = dyn Fn(&ChunkStatus, &WireDense) -> Frame + 'a;

/// A frame's bytes as a peer could send them, unchecked.
fn raw(frame: &Frame) -> Vec<u8> {
    let mut out = postcard::to_allocvec(frame).unwrap();
    let mut head = b"KVSM\x01\x00\x00\x00".to_vec();
    head.extend((out.len() as u32).to_le_bytes());
    head.append(&mut out);
    head
}

#[test]
fn dcp_a_malformed_dense_status_is_dropped_and_counted_and_moves_nothing() {
    let cpu = Arc::new(CpuBackend::new());
    let case = small_dcp_case();
    let s = dcp_setup(&cpu, &case);
    let before = snapshots(&cpu, &s);
    let good = |status: &ChunkStatus, dense: &WireDense| Frame::DenseStatus {
        status: status.clone(),
        dense: dense.clone(),
    };
    let cases: Vec<(&str, Box<MakeFrame<'_>>)> = vec![
        (
            "another decode rank's region",
            Box::new(|st, d| {
                good(
                    st,
                    &WireDense {
                        rank: 0,
                        ..d.clone()
                    },
                )
            }),
        ),
        (
            "another layout",
            Box::new(|st, d| {
                good(
                    st,
                    &WireDense {
                        interleave: 2,
                        ..d.clone()
                    },
                )
            }),
        ),
        (
            "a rank out of its layout",
            Box::new(|st, d| {
                good(
                    st,
                    &WireDense {
                        rank: 5,
                        ..d.clone()
                    },
                )
            }),
        ),
        (
            "a slot out of range",
            Box::new(|st, d| {
                good(
                    st,
                    &WireDense {
                        slot: SLOTS as u32,
                        ..d.clone()
                    },
                )
            }),
        ),
        (
            "rows past the pages the rank registered",
            Box::new(|st, d| {
                good(
                    st,
                    &WireDense {
                        end_token: 1 << 20,
                        sections: d
                            .sections
                            .iter()
                            .map(|(c, _)| (c.clone(), vec![4, 5]))
                            .collect(),
                        ..d.clone()
                    },
                )
            }),
        ),
        (
            "a region larger than the slot",
            Box::new(|st, d| {
                good(
                    st,
                    &WireDense {
                        end_token: 1 << 20,
                        sections: d
                            .sections
                            .iter()
                            .map(|(c, _)| (c.clone(), (0..20).collect()))
                            .collect(),
                        ..d.clone()
                    },
                )
            }),
        ),
        (
            "an unknown component",
            Box::new(|st, d| {
                good(
                    st,
                    &WireDense {
                        sections: vec![(vec![200], vec![0])],
                        ..d.clone()
                    },
                )
            }),
        ),
        (
            "a failed chunk with a region",
            Box::new(|st, d| {
                good(
                    &ChunkStatus {
                        result: ChunkResult::Failed { reason: "x".into() },
                        ..st.clone()
                    },
                    d,
                )
            }),
        ),
        (
            "rows announced without their region",
            Box::new(|st, _| Frame::Status {
                status: st.clone(),
                bounced: None,
            }),
        ),
        (
            "packed blocks for a sharded request",
            Box::new(|st, d| Frame::Status {
                status: st.clone(),
                bounced: Some(Bounced {
                    slot: d.slot,
                    sections: vec![WireSection {
                        components: vec![0],
                        pages: vec![1],
                    }],
                }),
            }),
        ),
    ];
    for (what, make) in cases {
        let (mut w, status, dense) = dcp_decode_and_status(&cpu, &s);
        let decode = &mut w.decode[1];
        let Some(e) = decode.feed(0, &raw(&make(&status, &dense))) else {
            panic!("{what}: accepted");
        };
        println!("mooncake dcp: {what}: refused: {e}");
        assert_eq!(decode.counters().refused_frames, 1, "{what}");
        assert!(decode.gone(0).is_some(), "{what}: the rank is gone");
        // The good status after it is not read; the request fails for the rank.
        assert_eq!(decode.feed(0, &raw(&good(&status, &dense))), None);
        let done = finish(decode, 1);
        assert_eq!(failed_ranks(&done[0]), vec![0], "{what}");
        assert_eq!(
            s.decode[1].pool.snapshot_sync(cpu.as_ref()).unwrap(),
            before[1],
            "{what}: nothing unpacked"
        );
    }
    // The good one unpacks, and is counted nowhere.
    let (mut w, status, dense) = dcp_decode_and_status(&cpu, &s);
    assert_eq!(w.decode[1].feed(0, &raw(&good(&status, &dense))), None);
    assert_eq!(w.decode[1].counters(), Default::default());
    // A dense status of a request this side never registered is dropped and counted, its slot
    // freed for exactly that chunk.
    let other = ChunkStatus {
        request: 99,
        ..status.clone()
    };
    let slot = (dense.slot + 1) % SLOTS as u32;
    let stray = good(&other, &WireDense { slot, ..dense });
    assert_eq!(w.decode[1].feed(0, &raw(&stray)), None);
    let c = w.decode[1].counters();
    assert_eq!((c.dropped_statuses, c.freed_for_dropped), (1, 1), "{c:?}");
}
