//! P/D into decode context parallelism (docs/dcp.md): a request prefilled by N page-sharded
//! ranks (rotated start owner, pages shuffled or in order) and sent chunk by chunk into the M
//! ranks of a decode server sharded by token, I tokens at a time, must leave every decode rank's
//! pool byte-identical to the unsharded reference re-laid out by `relayout` below, a plain CPU
//! function written from the layout's definition alone: latent rows of every token after the
//! decode's cached prefix, indexer keys and scales of every token, target and draft, each at its
//! decode rank's row; the cached prefix's rows, the rows of no token and every other page
//! untouched. Random (N, M, I, rotation, chunking, prefix, geometry) on the CPU twin in the
//! adversarial stream order (.cargo/config.toml), chunks in lockstep and pipelined; every decode
//! rank completes the request after a final status from every prefill rank, pairs sharing no
//! token included, with the bytes that reached it. The kernel against its twin byte for byte
//! (`gpu_*`, SKIPPED without a GPU), its reports of bad indices, and what is refused before any
//! byte moves.

mod common;

use std::collections::VecDeque;
use std::sync::Arc;

use common::dcp::*;
use common::synth::POISON;
use kvshard::abi;
use kvshard::backend::{Backend, Buffer, Launch, MemoryKind};
use kvshard::copy::{
    BlockSpace, DecodeScatterPlan, Method, RemoteSpace, ScatterRank, ScatterSection,
};
use kvshard::geometry::{CacheGeometry, Component, INDEXER_ROW_BYTES, PAGE_SIZE};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::pool::DevicePool;
use kvshard::shard::{DecodeLayout, Placement};
use kvshard::transfer::{
    BackendTransport, ChunkEnd, ChunkRange, ChunkResult, ChunkStatus, Completion, ComponentBytes,
    DecodePlan, DecodeRank, DecodeRegistration, DenseBounce, Finished, PendingChunk, PoolLayout,
    PrefillRank, Receiver, SendPlan, Sender, Transport,
};
use kvshard::Error;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// How a chunk reaches the decode ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// One launch writes every decode rank's pool (`BackendTransport`).
    Scatter,
    /// The bounce route, the test playing the transfer engine ([`Bounced`]).
    Bounce,
}

/// The bounce route (docs/dcp.md, "Over NIXL and Mooncake") with the test playing the transfer
/// engine: a prefill rank packs each chunk's rows per decode rank into regions of its own bounce
/// memory (one launch), each region's bytes, exactly as many as it says, are written into that
/// decode rank's slot (one range per chunk, prefill rank and decode rank: counted against the
/// plan's decode ranks reached), and the decode rank unpacks them into its pages. Synchronous: a
/// chunk has landed when `submit_decode` returns.
struct Bounced {
    pack: DenseBounce,
    /// This prefill rank's region for each decode rank.
    regions: Vec<Buffer>,
    /// Per decode rank: its unpacking stream, its slot for this prefill rank, its pool and its
    /// pages of the request.
    decode: Vec<(DenseBounce, Buffer, Arc<DevicePool>, ScatterRank)>,
    layout: DecodeLayout,
    components: usize,
    indexer_layers: u64,
}

/// A completion that has landed.
struct Landed;

impl Completion for Landed {
    fn poll(&mut self) -> kvshard::Result<bool> {
        Ok(true)
    }

    fn wait_sync(&mut self) -> kvshard::Result<()> {
        Ok(())
    }
}

impl Bounced {
    /// A prefill rank packing on `b` into the decode ranks of `s`.
    fn new(s: &Setup, b: &Arc<dyn Backend>) -> Self {
        let layout = s.reg.layout;
        let components = s.decode[0].pool.geometry().components();
        // Room for every row a decode rank holds, in every component.
        let most = (0..layout.ranks())
            .map(|d| layout.pages_on(d, s.reg.tokens as u64))
            .max()
            .unwrap();
        let all: Vec<Component> = components.iter().map(|c| c.component).collect();
        let bytes = kvshard::transfer::region_layout(&components, &[(all, (most + 1) * PAGE)])
            .unwrap()
            .1;
        let slot = |b: &Arc<dyn Backend>| {
            let buffer = b.alloc_registrable(bytes).unwrap();
            b.fill(&buffer, POISON).unwrap();
            buffer
        };
        Self {
            pack: DenseBounce::new(b.clone()),
            regions: (0..layout.ranks()).map(|_| slot(b)).collect(),
            decode: s
                .decode
                .iter()
                .zip(&s.reg.ranks)
                .map(|(side, rank)| {
                    (
                        DenseBounce::new(side.owner.clone()),
                        slot(&side.owner),
                        side.pool.clone(),
                        ScatterRank {
                            pages: rank.pages.clone(),
                            state_pages: rank.state_pages.clone(),
                        },
                    )
                })
                .collect(),
            layout,
            components: components.len(),
            indexer_layers: components
                .iter()
                .filter(|c| c.component.is_indexer())
                .map(|c| c.layers() as u64)
                .sum(),
        }
    }
}

impl Transport for Bounced {
    fn submit(
        &mut self,
        _: &SendPlan,
        _: &Arc<DevicePool>,
        _: &Arc<RemoteSpace>,
    ) -> kvshard::Result<Box<dyn Completion>> {
        unreachable!("the bounce route of these tests sends into decode ranks only")
    }

    fn submit_decode(
        &mut self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        _: &[Arc<RemoteSpace>],
    ) -> kvshard::Result<Box<dyn Completion>> {
        let regions: Vec<Option<Buffer>> = self.regions.iter().cloned().map(Some).collect();
        let packed = self.pack.pack(plan, src, &regions)?;
        self.pack.backend().wait_event_sync(&packed.event)?;
        let mut ranges = 0;
        for (d, ((chunk, bytes), region)) in packed.ranks.iter().zip(&self.regions).enumerate() {
            let owed = plan.rank_bytes()[d].total();
            if chunk.is_empty() {
                assert_eq!((*bytes, owed), (0, 0), "decode rank {d}: nothing moves");
                continue;
            }
            // The rank's bytes, at most 63 rows of padding per indexer layer and 255 bytes
            // per component.
            let padding =
                63 * INDEXER_ROW_BYTES as u64 * self.indexer_layers + 256 * self.components as u64;
            assert!(
                owed <= *bytes && *bytes < owed + padding,
                "decode rank {d}: a region of {bytes} B for {owed} B"
            );
            ranges += 1;
            let wire = self.pack.backend().read_sync(region, 0, *bytes as usize)?;
            let (unpack, slot, pool, pages) = &mut self.decode[d];
            unpack.backend().write_sync(slot, 0, &wire)?;
            let event = unpack.unpack(chunk, self.layout, d as u32, slot, pool, pages)?;
            unpack.backend().wait_event_sync(&event)?;
        }
        assert_eq!(
            ranges,
            plan.decode_ranks_reached(),
            "one range per decode rank reached"
        );
        Ok(Box::new(Landed))
    }
}

/// Sends every chunk of `case` from every prefill rank (a random rank order per chunk) into the
/// decode ranks, delivering each decode rank's status to its receiver; returns what each
/// decode rank's receiver finished with, and with [`Mode::ReadFirst`] what `read` read before
/// the first wait. Checks no receiver finishes before its last status and nothing stays
/// pending.
fn send(
    s: &Setup,
    case: &Case,
    rng: &mut StdRng,
    mode: Mode,
    read: &dyn Fn() -> Vec<Vec<u8>>,
    route: Route,
) -> (Vec<Finished>, Option<Vec<Vec<u8>>>) {
    let n = case.n;
    let m = case.layout.ranks() as usize;
    let mut senders: Vec<Sender> = s
        .ranks
        .iter()
        .map(|(b, pool)| {
            let transport: Box<dyn Transport> = match route {
                Route::Scatter => Box::new(
                    BackendTransport::with_method(b.clone(), Method::Kernel(LAUNCH)).unwrap(),
                ),
                Route::Bounce => Box::new(Bounced::new(s, b)),
            };
            Sender::new(pool.clone(), transport)
        })
        .collect();
    let mut receivers: Vec<Receiver> = (0..m)
        .map(|d| {
            let mut r = Receiver::new();
            r.register(s.reg.rank(d as u32).unwrap(), n).unwrap();
            r
        })
        .collect();
    for sender in &mut senders {
        sender.open_decode(s.reg.clone(), s.spaces.clone()).unwrap();
    }
    let mut finished: Vec<Option<Finished>> = vec![None; m];
    let mut deliver = |pending: PendingChunk| {
        assert_eq!(pending.decode_ranks(), m);
        let statuses = pending.wait_each_sync().unwrap();
        assert_eq!(statuses.len(), m);
        for (d, status) in statuses.into_iter().enumerate() {
            assert!(
                matches!(status.result, ChunkResult::Sent { .. }),
                "{status}"
            );
            assert!(finished[d].is_none(), "decode rank {d} finished early");
            finished[d] = receivers[d].receive(status).unwrap();
        }
    };
    let table = |i: usize| &s.src[..case.chunk_ends[i].div_ceil(PAGE_SIZE)];
    let mut early = None;
    match mode {
        Mode::Lockstep => {
            for i in 0..case.chunk_ends.len() {
                let mut order: Vec<usize> = (0..senders.len()).collect();
                order.shuffle(rng);
                let pending: Vec<PendingChunk> = order
                    .iter()
                    .map(|&r| senders[r].send(REQUEST, table(i), case.end(i)).unwrap())
                    .collect();
                pending.into_iter().for_each(&mut deliver);
            }
        }
        Mode::Pipelined | Mode::ReadFirst => {
            let mut queues: Vec<VecDeque<PendingChunk>> = senders
                .iter_mut()
                .map(|sender| {
                    (0..case.chunk_ends.len())
                        .map(|i| sender.send(REQUEST, table(i), case.end(i)).unwrap())
                        .collect()
                })
                .collect();
            if mode == Mode::ReadFirst {
                early = Some(read());
            }
            for _ in 0..case.chunk_ends.len() {
                let mut order: Vec<usize> = (0..senders.len()).collect();
                order.shuffle(rng);
                for r in order {
                    deliver(queues[r].pop_front().unwrap());
                }
            }
        }
    }
    assert!(senders.iter().all(|s| s.pending_requests() == 0));
    assert!(receivers.iter().all(|r| r.pending_requests() == 0));
    let finished = finished
        .into_iter()
        .enumerate()
        .map(|(d, f)| f.unwrap_or_else(|| panic!("decode rank {d} never finished")))
        .collect();
    (finished, early)
}

/// Runs `case`, checks every decode rank against the relayout and the bytes each reports,
/// and returns the decode ranks' snapshots.
fn run_case(
    base: &Arc<dyn Backend>,
    stream: &dyn Fn() -> Arc<dyn Backend>,
    case: &Case,
    mode: Mode,
    seed: u64,
) -> Vec<Vec<u8>> {
    run_case_with(
        base,
        stream,
        &local_decode(base),
        case,
        mode,
        seed,
        Route::Scatter,
    )
}

/// [`run_case`] into decode pools `make_decode` makes, by `route`.
fn run_case_with(
    base: &Arc<dyn Backend>,
    stream: &dyn Fn() -> Arc<dyn Backend>,
    make_decode: DecodeMaker,
    case: &Case,
    mode: Mode,
    seed: u64,
    route: Route,
) -> Vec<Vec<u8>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let s = setup_with(base, stream, make_decode, case, &mut rng);
    let read = || {
        s.decode
            .iter()
            .map(|d| d.pool.snapshot_sync(d.owner.as_ref()).unwrap())
            .collect()
    };
    let (finished, early) = send(&s, case, &mut rng, mode, &read, route);
    let reference = s.reference.snapshot_sync(base.as_ref()).unwrap();
    let want = relayout(
        case,
        &reference,
        s.reference_pages,
        &s.src,
        &s.reg,
        s.decode_pages,
        &s.before,
    );
    let what = format!("{case:?} {mode:?}");
    let mut got = Vec::new();
    let snapshots = early.unwrap_or_else(read);
    for (d, snapshot) in snapshots.into_iter().enumerate() {
        if let Some(at) = difference(case, s.decode_pages, &snapshot, &want[d]) {
            panic!("{what}: decode rank {d} differs from the relayout at {at}");
        }
        let f = &finished[d];
        assert!(f.is_completed(), "{what}: decode rank {d}: {:?}", f.outcome);
        for r in 0..case.n {
            assert_eq!(
                f.bytes[r as usize],
                owed(case, &s.src, r, d as u32),
                "{what}: bytes from prefill rank {r} to decode rank {d}"
            );
        }
        got.push(snapshot);
    }
    got
}

// Random (N, M, I, rotation, chunking, prefix, geometry), chunks in lockstep, pipelined, and
// pipelined with the decode pools read before any wait:
// every decode rank equals the unsharded reference re-laid out, and counts the bytes each
// prefill rank owed it. On the GPU, the bytes also equal the CPU twin's.
common::on_cpu_and_gpu!(
    chunks_into_decode_ranks_match_the_relaid_reference,
    |device| -> Vec<Vec<u8>> {
        let mut rng = device.rng();
        let base = device.stream();
        let stream = || device.stream();
        let mut all = Vec::new();
        for _ in 0..24 {
            let case = random_case(&mut rng);
            for mode in [Mode::Lockstep, Mode::Pipelined, Mode::ReadFirst] {
                let seed = rng.random();
                all.extend(run_case(&base, &stream, &case, mode, seed));
            }
        }
        all
    }
);

// The shapes of the issue, each pair of (N, M) equal or not, multiples or coprime, at I = 1
// (vLLM's and SGLang's DCP) and I = 64 (a page: Helix, vLLM's interleave at the block size),
// with the draft and the indexer.
common::on_cpu_and_gpu!(
    the_issues_shapes_match_the_relaid_reference,
    |device| -> Vec<Vec<u8>> {
        let mut rng = device.rng();
        let base = device.stream();
        let stream = || device.stream();
        let mut all = Vec::new();
        for (n, m) in [
            (2, 2),
            (2, 4),
            (4, 2),
            (4, 4),
            (3, 4),
            (4, 3),
            (1, 8),
            (8, 1),
        ] {
            for i in [1, 64] {
                let case = Case {
                    n,
                    layout: DecodeLayout::new(m, i).unwrap(),
                    geometry: geometries()[0].clone(),
                    chunk_ends: vec![300, 640, 1000],
                    prefix_pages: 1,
                    contiguous: false,
                    separate_state: false,
                };
                let seed = rng.random();
                all.extend(run_case(&base, &stream, &case, Mode::Lockstep, seed));
            }
        }
        all
    }
);

// The bounce route (docs/dcp.md, "Over NIXL and Mooncake"): random (N, M, I, rotation, chunking,
// prefix, geometry) and the issue's shapes, each chunk packed per decode rank by one launch,
// moved as one range per decode rank reached, and unpacked there: every decode rank equals the
// unsharded reference re-laid out, as by the direct scatter. On the GPU, the bytes also equal
// the CPU twin's (the pack and unpack kernels against their twin).
common::on_cpu_and_gpu!(bounced_chunks_match_the_relaid_reference, |device| -> Vec<
    Vec<u8>,
> {
    let mut rng = device.rng();
    let base = device.stream();
    let stream = || device.stream();
    let mut cases: Vec<Case> = (0..16).map(|_| random_case(&mut rng)).collect();
    for (n, m) in [(2, 2), (2, 4), (4, 2), (3, 4)] {
        for i in [1, 64] {
            cases.push(Case {
                n,
                layout: DecodeLayout::new(m, i).unwrap(),
                geometry: geometries()[0].clone(),
                chunk_ends: vec![300, 640, 1000],
                prefix_pages: 1,
                contiguous: false,
                separate_state: true,
            });
        }
    }
    let mut all = Vec::new();
    for case in cases {
        let seed = rng.random();
        all.extend(run_case_with(
            &base,
            &stream,
            &local_decode(&base),
            &case,
            Mode::Pipelined,
            seed,
            Route::Bounce,
        ));
    }
    all
});

// A decode rank that shares no token with a prefill rank, or holds no token of the request at
// all, still completes it after a final status from every prefill rank (with no bytes).
common::on_cpu_and_gpu!(pairs_with_nothing_to_send_still_complete, |device| {
    let mut rng = device.rng();
    let base = device.stream();
    let stream = || device.stream();
    // One page of tokens, a page a decode rank: decode ranks 1..4 hold nothing; prefill
    // ranks other than the page's owner send nothing.
    let case = Case {
        n: 4,
        layout: DecodeLayout::new(4, 64).unwrap(),
        geometry: geometries()[0].clone(),
        chunk_ends: vec![40, 64],
        prefix_pages: 0,
        contiguous: true,
        separate_state: false,
    };
    let seed = rng.random();
    run_case(&base, &stream, &case, Mode::Pipelined, seed);
    let mut rng = StdRng::seed_from_u64(seed);
    let s = setup(&base, &stream, &case, &mut rng);
    assert!(s.reg.ranks[1..].iter().all(|r| r.pages.is_empty()));
    let (finished, _) = send(
        &s,
        &case,
        &mut rng,
        Mode::Lockstep,
        &Vec::new,
        Route::Scatter,
    );
    for f in &finished[1..] {
        assert!(f.is_completed() && f.total_bytes().total() == 0);
        assert_eq!(f.bytes.len(), 4, "a status from every prefill rank");
    }
});

fn small_geometry() -> CacheGeometry {
    geometries()[0].clone()
}

/// A registration of `tokens` tokens for `layout` over decode pools of `pages` pages: rank d's
/// pages from 1 on.
fn registration(layout: DecodeLayout, tokens: usize, pages: u64) -> DecodeRegistration {
    let g = small_geometry();
    DecodeRegistration {
        request: 5,
        layout,
        tokens,
        prefix_pages: 0,
        ranks: (0..layout.ranks())
            .map(|d| {
                let p: Vec<LocalPage> = (1..=layout.pages_on(d, tokens as u64))
                    .map(LocalPage)
                    .collect();
                DecodeRank {
                    layout: PoolLayout::packed(g.clone(), pages),
                    pages: p.clone(),
                    state_pages: p,
                }
            })
            .collect(),
    }
}

fn transfer_reason(e: Error) -> String {
    match e {
        Error::Transfer { request: 5, reason } => reason,
        other => panic!("not a transfer error of request 5: {other}"),
    }
}

#[test]
fn a_registration_is_checked_alone_before_it_is_accepted() {
    let layout = DecodeLayout::new(3, 1).unwrap();
    let good = registration(layout, 300, 10);
    good.validate().unwrap();
    // Rank 0 holds tokens 0, 3, ..., 297: 100 tokens, two pages.
    assert_eq!(good.ranks[0].pages.len(), 2);
    let share = good.rank(1).unwrap();
    assert_eq!((share.prefix_pages, share.pages.len()), (0, 2));
    assert!(good.rank(3).is_err());

    let mut r = good.clone();
    r.ranks.pop();
    assert!(transfer_reason(r.validate().unwrap_err())
        .contains("2 decode ranks registered for a layout of 3"));
    let mut r = good.clone();
    r.ranks[2].pages.push(LocalPage(9));
    let m = transfer_reason(r.validate().unwrap_err());
    assert!(
        m.contains("decode rank 2 registered 3 pages") && m.contains("takes 2"),
        "{m}"
    );
    let mut r = good.clone();
    r.ranks[1].state_pages.pop();
    assert!(transfer_reason(r.validate().unwrap_err()).contains("1 state pages"));
    let mut r = good.clone();
    r.ranks[1].pages[1] = LocalPage(1);
    assert!(matches!(
        r.validate().unwrap_err(),
        Error::Transfer { .. } | Error::DuplicatePage { .. }
    ));
    let mut r = good.clone();
    r.ranks[0].pages[0] = LocalPage(0);
    assert!(
        transfer_reason(r.validate().unwrap_err()).contains("decode rank 0: destination page 0")
    );
    let mut r = good.clone();
    r.ranks[2].state_pages[0] = LocalPage(10);
    assert!(transfer_reason(r.validate().unwrap_err()).contains("out of range"));
    let mut r = good.clone();
    r.ranks[1].layout = PoolLayout::packed(CacheGeometry::target_only(small_geometry().target), 10);
    assert!(transfer_reason(r.validate().unwrap_err()).contains("another cache geometry"));
    let mut r = good.clone();
    r.prefix_pages = 5;
    assert!(transfer_reason(r.validate().unwrap_err()).contains("cached prefix of 5 pages"));
    let mut r = good;
    r.tokens = 1 << 33;
    assert!(transfer_reason(r.validate().unwrap_err()).contains("at most"));
}

#[test]
fn plans_count_each_decode_ranks_bytes_and_refuse_bad_chunks() {
    let g = small_geometry();
    let source = PrefillRank {
        placement: Placement::new(2).unwrap(),
        rank: 1,
        layout: PoolLayout::packed(g.clone(), 20),
    };
    let layout = DecodeLayout::new(2, 1).unwrap();
    let reg = registration(layout, 200, 10);
    // Positions 0..4 on logical pages 3, 5, 4, 7: rank 1 owns positions 0, 1, 3.
    let pages: Vec<LogicalPage> = [3, 5, 4, 7].map(LogicalPage).to_vec();
    let chunk = |index, start, end, last| ChunkRange {
        index,
        start,
        end,
        last,
    };
    let plan = DecodePlan::new(&source, &pages, &reg, chunk(0, 0, 150, false)).unwrap();
    // Whole pages only: positions 0 and 1, up to token 128.
    assert_eq!(plan.end_token(), 128);
    assert_eq!(plan.kv().entries(), &[(LocalPage(1), 0), (LocalPage(2), 1)]);
    assert!(plan.state().is_empty());
    // 128 tokens alternate between the two decode ranks: 64 rows each, 3 + 1 latent layers.
    for b in plan.rank_bytes() {
        assert_eq!(b.get(Component::TargetLatent), 64 * 576 * 3);
        assert_eq!(b.get(Component::DraftLatent), 64 * 576);
        assert_eq!(b.get(Component::TargetIndexer), 0);
    }
    assert_eq!(plan.decode_ranks_reached(), 2);
    assert!(plan
        .to_string()
        .contains("into 2 decode ranks x 1 tokens interleaved"));
    let last = DecodePlan::new(&source, &pages, &reg, chunk(1, 128, 200, true)).unwrap();
    // Position 3 (tokens 192..200) moves its 8 rows; the state covers positions 0, 1, 3.
    assert_eq!(last.kv().entries(), &[(LocalPage(3), 3)]);
    assert_eq!(last.state().entries().len(), 3);
    let state_rows: u64 = last
        .rank_bytes()
        .iter()
        .map(|b| b.get(Component::TargetIndexer))
        .sum();
    assert_eq!(state_rows, (128 + 8) * 132 * 2);

    let e = |c| transfer_reason(DecodePlan::new(&source, &pages, &reg, c).unwrap_err());
    assert!(e(chunk(1, 128, 190, true)).contains("token count mismatch"));
    assert!(e(chunk(0, 0, 300, false)).contains("token count mismatch"));
    assert!(e(chunk(0, 10, 100, false)).contains("not a page boundary"));
    let mut cached = reg.clone();
    cached.prefix_pages = 2;
    let m = transfer_reason(
        DecodePlan::new(&source, &pages, &cached, chunk(0, 64, 200, true)).unwrap_err(),
    );
    assert!(
        m.contains("inside the decode's cached prefix of 2 pages"),
        "{m}"
    );
    let m = transfer_reason(
        DecodePlan::new(&source, &pages[..2], &reg, chunk(0, 0, 200, true)).unwrap_err(),
    );
    assert!(m.contains("page table holds 2 pages"), "{m}");
    let bad: Vec<LogicalPage> = [3, 1, 4, 7].map(LogicalPage).to_vec();
    let m =
        transfer_reason(DecodePlan::new(&source, &bad, &reg, chunk(0, 0, 200, true)).unwrap_err());
    assert!(m.contains("source page 1 at position 1 is reserved"), "{m}");
}

/// A pool and its destination on `b`, `pages` pages of the small geometry.
fn decode_space(b: &Arc<dyn Backend>, pages: u64) -> (Arc<DevicePool>, Arc<RemoteSpace>) {
    let g = small_geometry();
    let pool =
        Arc::new(DevicePool::allocate(b.as_ref(), &g, Placement::unsharded(), 0, pages).unwrap());
    let space = Arc::new(RemoteSpace::of(pool.clone(), g).unwrap());
    (pool, space)
}

#[test]
fn senders_refuse_what_does_not_describe_the_destinations_and_transports_that_cannot() {
    let b: Arc<dyn Backend> = Arc::new(kvshard::backend::cpu::CpuBackend::new());
    let g = small_geometry();
    let pool =
        Arc::new(DevicePool::allocate(b.as_ref(), &g, Placement::new(2).unwrap(), 0, 8).unwrap());
    let layout = DecodeLayout::new(2, 16).unwrap();
    let reg = registration(layout, 100, 10);
    let (_d0, s0) = decode_space(&b, 10);
    let (_d1, s1) = decode_space(&b, 10);
    let (_d2, small) = decode_space(&b, 6);
    let mut sender = Sender::new(pool.clone(), Box::new(BackendTransport::new(b.clone())));
    let m = transfer_reason(
        sender
            .open_decode(reg.clone(), vec![s0.clone()])
            .unwrap_err(),
    );
    assert!(
        m.contains("2 decode ranks registered, 1 destinations given"),
        "{m}"
    );
    let m = transfer_reason(
        sender
            .open_decode(reg.clone(), vec![s0.clone(), small])
            .unwrap_err(),
    );
    assert!(
        m.contains("decode rank 1 registered a pool of 10 pages"),
        "{m}"
    );
    assert_eq!(sender.pending_requests(), 0, "refused, nothing opened");
    sender
        .open_decode(reg.clone(), vec![s0.clone(), s1.clone()])
        .unwrap();
    let m = transfer_reason(
        sender
            .open_decode(reg.clone(), vec![s0.clone(), s1.clone()])
            .unwrap_err(),
    );
    assert!(m.contains("already open"), "{m}");

    // The copy engine has no decode route: the chunk fails, the request closes.
    let mut ce = Sender::new(
        pool.clone(),
        Box::new(BackendTransport::with_method(b.clone(), Method::CopyEngine).unwrap()),
    );
    ce.open_decode(reg.clone(), vec![s0.clone(), s1.clone()])
        .unwrap();
    let pages: Vec<LogicalPage> = [2, 3].map(LogicalPage).to_vec();
    match ce.send(5, &pages, ChunkEnd::Final(100)) {
        Err(Error::ChunkFailed { reason, .. }) => {
            assert!(
                reason.contains("decode context-parallel layout"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ce.pending_requests(), 0);

    // A transport of its own, without a decode route: refused by the trait's default.
    struct Unsharded;
    impl Transport for Unsharded {
        fn submit(
            &mut self,
            _: &SendPlan,
            _: &Arc<DevicePool>,
            _: &Arc<RemoteSpace>,
        ) -> kvshard::Result<Box<dyn Completion>> {
            unreachable!("no unsharded send in this test")
        }
    }
    let mut own = Sender::new(pool, Box::new(Unsharded));
    own.open_decode(reg, vec![s0, s1]).unwrap();
    match own.send(5, &pages, ChunkEnd::Final(100)) {
        Err(Error::ChunkFailed { reason, .. }) => {
            assert!(
                reason.contains("only into unsharded decode pools"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn scatter_plans_are_checked_against_every_space() {
    let b: Arc<dyn Backend> = Arc::new(kvshard::backend::cpu::CpuBackend::new());
    let g = small_geometry();
    let src = DevicePool::allocate(b.as_ref(), &g, Placement::unsharded(), 0, 4).unwrap();
    let (d0, _) = decode_space(&b, 4);
    let (d1, _) = decode_space(&b, 4);
    let layout = DecodeLayout::new(2, 1).unwrap();
    let latent = vec![Component::TargetLatent, Component::DraftLatent];
    let kv = |entries: Vec<(LocalPage, u64)>| ScatterSection {
        components: latent.clone(),
        entries,
    };
    let rank = |pages: Vec<u64>| ScatterRank {
        pages: pages.iter().copied().map(LocalPage).collect(),
        state_pages: Vec::new(),
    };
    let ranks = [rank(vec![1, 2]), rank(vec![1])];
    let dsts: [&dyn BlockSpace; 2] = [d0.as_ref(), d1.as_ref()];
    // Pages 0 and 1 of the sequence, 100 tokens: rank 0 holds 50 (one page), rank 1 50.
    let ok = DecodeScatterPlan::new(
        &src,
        &dsts,
        layout,
        100,
        kv(vec![(LocalPage(1), 0), (LocalPage(2), 1)]),
        ScatterSection::default(),
        &ranks,
    )
    .unwrap();
    assert_eq!(ok.bytes(), 100 * 576 * 4);
    assert_eq!(ok.units(), 2 * 4);
    let plan = |src_page: u64,
                position: u64,
                end: u64,
                ranks: &[ScatterRank],
                dsts: &[&dyn BlockSpace]| {
        DecodeScatterPlan::new(
            &src,
            dsts,
            layout,
            end,
            kv(vec![(LocalPage(src_page), position)]),
            ScatterSection::default(),
            ranks,
        )
    };
    assert!(matches!(
        plan(4, 0, 100, &ranks, &dsts),
        Err(Error::OutOfRange {
            what: "scatter source page",
            ..
        })
    ));
    // Tokens 256..300 reach rank 0's local token 149: a third page it did not register.
    assert!(plan(1, 4, 300, &ranks, &dsts)
        .unwrap_err()
        .to_string()
        .contains("decode rank 0 registered 2"));
    let wide = [rank(vec![1, 4]), rank(vec![1])];
    assert!(matches!(
        plan(1, 0, 100, &wide, &dsts),
        Err(Error::OutOfRange {
            what: "decode rank page",
            ..
        })
    ));
    let twice = [rank(vec![1, 1]), rank(vec![1])];
    assert!(matches!(
        plan(1, 0, 100, &twice, &dsts),
        Err(Error::DuplicatePage { .. })
    ));
    let same: [&dyn BlockSpace; 2] = [d0.as_ref(), d0.as_ref()];
    assert!(plan(1, 0, 100, &ranks, &same)
        .unwrap_err()
        .to_string()
        .contains("overlapping memory"));
    assert!(plan(1, 0, 100, &ranks[..1], &dsts).is_err());
    assert!(plan(1, 0, abi::KVS_DECODE_MAX_TOKENS + 1, &ranks, &dsts).is_err());
    let repeated = DecodeScatterPlan::new(
        &src,
        &dsts,
        layout,
        100,
        kv(vec![(LocalPage(1), 0), (LocalPage(2), 0)]),
        ScatterSection::default(),
        &ranks,
    );
    assert!(matches!(repeated, Err(Error::DuplicatePage { .. })));
    let both = DecodeScatterPlan::new(
        &src,
        &dsts,
        layout,
        100,
        kv(vec![(LocalPage(1), 0)]),
        kv(vec![(LocalPage(1), 0)]),
        &ranks,
    );
    assert!(both.unwrap_err().to_string().contains("twice"));
}

/// Raw `kvs_decode_scatter` parameters over one latent component of one layer (576-byte rows),
/// source page 0 holding sequence page `position`, two decode ranks of `rank_pages` ids each
/// (in `table` order), interleave 1: what the checked layer above never builds, to see the
/// kernel's own reports.
fn raw_scatter(
    backend: &dyn Backend,
    position: u64,
    rank_pages: [i64; 2],
    limit: u64,
) -> (Vec<u8>, kvshard::Result<()>) {
    let block = 64 * 576u64;
    let src = backend.alloc(block as usize, MemoryKind::Device).unwrap();
    let data: Vec<u8> = (0..block).map(|i| (i * 7 + 3) as u8).collect();
    backend.write_sync(&src, 0, &data).unwrap();
    let dst = backend
        .alloc(2 * 2 * block as usize, MemoryKind::Device)
        .unwrap();
    backend.fill(&dst, POISON).unwrap();
    let mut table = Vec::new();
    let word = |t: &mut Vec<u8>, w: u64| t.extend_from_slice(&w.to_le_bytes());
    let tables = backend.alloc(4096, MemoryKind::Device).unwrap();
    let at = tables.addr();
    // pair (src base, component 0), bases of rank 0 and rank 1, two rank descriptors, their
    // one-page lists, one entry.
    word(&mut table, src.addr());
    word(&mut table, 0);
    word(&mut table, dst.addr());
    word(&mut table, dst.addr() + 2 * block);
    for (d, _) in rank_pages.iter().enumerate() {
        word(&mut table, at + 96 + 8 * d as u64);
        word(&mut table, 0);
        word(&mut table, 1);
        word(&mut table, limit);
    }
    for p in rank_pages {
        word(&mut table, p as u64);
    }
    let entry = table.len() as u64;
    word(&mut table, 0);
    word(&mut table, position);
    backend.write_sync(&tables, 0, &table).unwrap();
    let mut components = [abi::kvs_row_component::default(); 4];
    components[0] = abi::kvs_row_component {
        kind: abi::KVS_ROWS_LATENT,
        row_bytes: 576,
    };
    let p = abi::kvs_decode_scatter_params {
        components,
        pairs: at,
        dst_bases: at + 16,
        ranks: at + 32,
        entries: at + entry,
        num_entries: 1,
        src_limit: 1,
        end_token: 1 << 20,
        num_pairs: 1,
        num_kv_pairs: 1,
        num_ranks: 2,
        interleave: 1,
        num_components: 1,
        ..Default::default()
    };
    let launch = Launch {
        ctas: 2,
        threads: 64,
    };
    // SAFETY: every address is one of the buffers above, alive past the synchronize; the
    // rows the ranks' lists do not cover are skipped before they are addressed (what this
    // checks).
    unsafe { backend.decode_scatter(p, launch) }.unwrap();
    let said = backend.synchronize();
    (backend.read_sync(&dst, 0, dst.len()).unwrap(), said)
}

// The kernel and its twin skip and report the same bad indices: a row past the pages its rank
// registered, a page past the rank's pool; padding ids (< 0) are skipped silently.
common::on_cpu_and_gpu!(the_kernel_reports_what_it_skips, |device| -> Vec<Vec<u8>> {
    let b = device.stream();
    let mut out = Vec::new();
    // Page ids in range: every row lands; rank 0's even tokens on its page 1.
    let (bytes, said) = raw_scatter(b.as_ref(), 0, [1, 0], 2);
    said.unwrap();
    out.push(bytes);
    // Sequence page 2 (tokens 128..192): local tokens 64..96 on each rank, their second page,
    // which neither rank registered: skipped, reported at entry 0.
    let (bytes, said) = raw_scatter(b.as_ref(), 2, [1, 0], 2);
    assert!(
        matches!(said, Err(Error::KernelRejected { position: 0, .. })),
        "{device}: {said:?}"
    );
    assert!(
        bytes.iter().all(|&x| x == POISON),
        "{device}: nothing written"
    );
    out.push(bytes);
    // Rank 1's page past its pool: reported; rank 0's padding id: skipped silently.
    let (bytes, said) = raw_scatter(b.as_ref(), 0, [-1, 5], 2);
    assert!(
        matches!(said, Err(Error::KernelRejected { position: 0, .. })),
        "{device}: {said:?}"
    );
    assert!(
        bytes.iter().all(|&x| x == POISON),
        "{device}: nothing written"
    );
    out.push(bytes);
    out
});

/// Raw `kvs_decode_scatter` parameters unpacking rank 0 of 2 (interleave 1) from a dense
/// source of `src_pages` pages (one latent component of one layer, 576-byte rows) into its
/// pages 1 and 2 of a 3-page pool: sequence page `position`'s 32 rows of the rank, at dense row
/// `dense` (the shift subtracts what puts them there).
fn raw_unpack(
    backend: &dyn Backend,
    position: u64,
    dense: u64,
    src_pages: u64,
) -> (Vec<u8>, kvshard::Result<()>) {
    let block = 64 * 576u64;
    let src = backend
        .alloc((src_pages.max(1) * block) as usize, MemoryKind::Device)
        .unwrap();
    let data: Vec<u8> = (0..src.len() as u64).map(|i| (i * 7 + 3) as u8).collect();
    backend.write_sync(&src, 0, &data).unwrap();
    let dst = backend
        .alloc(3 * block as usize, MemoryKind::Device)
        .unwrap();
    backend.fill(&dst, POISON).unwrap();
    let tables = backend.alloc(4096, MemoryKind::Device).unwrap();
    let at = tables.addr();
    let mut table = Vec::new();
    let word = |t: &mut Vec<u8>, w: u64| t.extend_from_slice(&w.to_le_bytes());
    // pair (src base, component 0), the rank's base, its descriptor, its two pages, one entry,
    // one shift: local token 32 * position - shift is the dense row.
    word(&mut table, src.addr());
    word(&mut table, 0);
    word(&mut table, dst.addr());
    word(&mut table, at + 56);
    word(&mut table, 0);
    word(&mut table, 2);
    word(&mut table, 3);
    word(&mut table, 1);
    word(&mut table, 2);
    let entry = table.len() as u64;
    word(&mut table, 0);
    word(&mut table, position);
    let shift = table.len() as u64;
    word(&mut table, (32 * position).wrapping_sub(dense));
    backend.write_sync(&tables, 0, &table).unwrap();
    let mut components = [abi::kvs_row_component::default(); 4];
    components[0] = abi::kvs_row_component {
        kind: abi::KVS_ROWS_LATENT,
        row_bytes: 576,
    };
    let p = abi::kvs_decode_scatter_params {
        components,
        pairs: at,
        dst_bases: at + 16,
        ranks: at + 24,
        entries: at + entry,
        num_entries: 1,
        shifts: at + shift,
        src_limit: src_pages,
        end_token: 1 << 20,
        num_pairs: 1,
        num_kv_pairs: 1,
        num_ranks: 2,
        interleave: 1,
        num_components: 1,
        mode: abi::KVS_DECODE_UNPACK,
        one_rank: 1,
        rank: 0,
        ..Default::default()
    };
    let launch = Launch {
        ctas: 2,
        threads: 64,
    };
    // SAFETY: every address is one of the buffers above, alive past the synchronize; the
    // rows the source does not hold are refused before they are read (what this checks).
    unsafe { backend.decode_scatter(p, launch) }.unwrap();
    let said = backend.synchronize();
    (backend.read_sync(&dst, 0, dst.len()).unwrap(), said)
}

// The unpack kernel and its twin move a rank's rows from their dense rows, and refuse (report,
// moving none of them) an entry whose rows do not all lie in the source's pages.
common::on_cpu_and_gpu!(the_unpack_kernel_reads_only_its_source, |device| -> Vec<
    Vec<u8>,
> {
    let b = device.stream();
    let mut out = Vec::new();
    // Sequence page 1: rank 0's local tokens 32..64, the end of its page 1, from dense rows
    // 40..72 of a 2-page source.
    let (bytes, said) = raw_unpack(b.as_ref(), 1, 40, 2);
    said.unwrap();
    let block = 64 * 576;
    for row in 0..64usize {
        let got = &bytes[block + row * 576..block + (row + 1) * 576];
        if row < 32 {
            assert!(
                got.iter().all(|&x| x == POISON),
                "{device}: row {row} untouched"
            );
        } else {
            let from = (40 + row - 32) * 576;
            let want: Vec<u8> = (from..from + 576)
                .map(|i| (i as u64 * 7 + 3) as u8)
                .collect();
            assert_eq!(got, &want[..], "{device}: row {row}");
        }
    }
    out.push(bytes);
    // Dense rows 100..132 of a 2-page source (128 rows): refused at entry 0, nothing moved.
    let (bytes, said) = raw_unpack(b.as_ref(), 1, 100, 2);
    assert!(
        matches!(said, Err(Error::KernelRejected { position: 0, .. })),
        "{device}: {said:?}"
    );
    assert!(
        bytes.iter().all(|&x| x == POISON),
        "{device}: nothing written"
    );
    out.push(bytes);
    // A shift past the rank's tokens wraps to a row far past the source: refused as well.
    let (bytes, said) = raw_unpack(b.as_ref(), 1, u64::MAX - 3, 2);
    assert!(
        matches!(said, Err(Error::KernelRejected { .. })),
        "{device}: {said:?}"
    );
    out.push(bytes);
    out
});

#[test]
fn scatter_modes_are_checked_before_any_launch() {
    let b = kvshard::backend::cpu::CpuBackend::new();
    let tables = b.alloc(64, MemoryKind::Device).unwrap();
    let base = abi::kvs_decode_scatter_params {
        pairs: tables.addr(),
        dst_bases: tables.addr(),
        ranks: tables.addr(),
        entries: tables.addr(),
        num_entries: 1,
        shifts: tables.addr(),
        src_limit: 1,
        end_token: 64,
        num_pairs: 1,
        num_kv_pairs: 1,
        num_ranks: 2,
        interleave: 1,
        num_components: 1,
        components: [
            abi::kvs_row_component {
                kind: abi::KVS_ROWS_LATENT,
                row_bytes: 576,
            },
            Default::default(),
            Default::default(),
            Default::default(),
        ],
        ..Default::default()
    };
    let launch = Launch {
        ctas: 1,
        threads: 32,
    };
    for (what, p) in [
        (
            "a packing without shifts",
            abi::kvs_decode_scatter_params {
                mode: abi::KVS_DECODE_PACK,
                shifts: 0,
                ..base
            },
        ),
        (
            "an unpacking of every rank",
            abi::kvs_decode_scatter_params {
                mode: abi::KVS_DECODE_UNPACK,
                ..base
            },
        ),
        (
            "one rank past the layout",
            abi::kvs_decode_scatter_params {
                one_rank: 1,
                rank: 2,
                ..base
            },
        ),
        (
            "one rank said otherwise than 0 or 1",
            abi::kvs_decode_scatter_params {
                one_rank: 2,
                ..base
            },
        ),
        (
            "an unknown mode",
            abi::kvs_decode_scatter_params { mode: 7, ..base },
        ),
    ] {
        // SAFETY: refused before anything is read (what this checks).
        let r = unsafe { b.decode_scatter(p, launch) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{what}: {r:?}");
    }
    b.synchronize().unwrap();
}

/// The scatter of the first 10 tokens' target latent and indexer rows of `src`'s page 1 into
/// two decode ranks (M = 2, I = 1) of one page each, page 0 of `d0` and of `d1`.
fn first_page_into_two(
    src: &DevicePool,
    d0: &RemoteSpace,
    d1: &RemoteSpace,
) -> kvshard::Result<DecodeScatterPlan> {
    let rank = ScatterRank {
        pages: vec![LocalPage(0)],
        state_pages: vec![LocalPage(0)],
    };
    DecodeScatterPlan::new(
        src,
        &[d0, d1],
        DecodeLayout::new(2, 1).unwrap(),
        10,
        ScatterSection {
            components: vec![Component::TargetLatent],
            entries: vec![(LocalPage(1), 0)],
        },
        ScatterSection {
            components: vec![Component::TargetIndexer],
            entries: vec![(LocalPage(1), 0)],
        },
        &[rank.clone(), rank],
    )
}

// Found with the bounce route's regions: a rank's memory overlapping another's was missed
// unless the two ranges were neighbours in address order (a long range of one rank, a short
// one of the same rank inside it, then the other rank's inside the long one). Fails on the old
// check, which compared neighbours only.
#[test]
fn overlapping_decode_ranks_are_refused_wherever_they_overlap() {
    let b: Arc<dyn Backend> = Arc::new(kvshard::backend::cpu::CpuBackend::new());
    let g = small_geometry();
    let src = DevicePool::allocate(b.as_ref(), &g, Placement::unsharded(), 0, 4).unwrap();
    // One page per layer. Rank 0: its target latent layer 0 at 1 MiB (36,864 bytes long), its
    // two target indexer layers inside it from 1 MiB + 1,008 (8,448 bytes each, ending at
    // 1 MiB + 17,920), every other layer from 3 MiB. Rank 1: every layer from 1 MiB + 20,000,
    // 100,000 apart: its first inside rank 0's first, after rank 0's indexer layers.
    let m = 1u64 << 20;
    let d0 = RemoteSpace::unmapped(
        g.clone(),
        1,
        // In component order: target latent, target indexer, draft latent, draft indexer.
        vec![
            vec![m, 3 * m, 3 * m + (64 << 10)],
            vec![m + 1_008, m + 9_472],
            vec![3 * m + (128 << 10)],
            vec![3 * m + (192 << 10)],
        ],
    )
    .unwrap();
    let mut at = m + 20_000;
    let d1_bases: Vec<Vec<u64>> = g
        .components()
        .iter()
        .map(|c| {
            (0..c.layers())
                .map(|_| {
                    at += 100_000;
                    at - 100_000
                })
                .collect()
        })
        .collect();
    let d1 = RemoteSpace::unmapped(g.clone(), 1, d1_bases).unwrap();
    let plan = first_page_into_two(&src, &d0, &d1);
    assert!(
        plan.as_ref()
            .is_err_and(|e| e.to_string().contains("overlapping memory")),
        "{plan:?}"
    );
}

// The check first compares each rank's span (its lowest base to its furthest written byte);
// ranks whose layers interleave in memory without touching have overlapping spans, and must
// still be accepted by the range-by-range check behind it.
#[test]
fn decode_ranks_whose_layers_interleave_without_touching_are_accepted() {
    let b: Arc<dyn Backend> = Arc::new(kvshard::backend::cpu::CpuBackend::new());
    let g = small_geometry();
    let src = DevicePool::allocate(b.as_ref(), &g, Placement::unsharded(), 0, 4).unwrap();
    // One page per layer, every layer 64 KiB from the last, ranks alternating: rank 0 at 1 MiB,
    // rank 1 at 1 MiB + 64 KiB, rank 0 at 1 MiB + 128 KiB, ...
    let mut at = 1u64 << 20;
    let mut bases = [Vec::new(), Vec::new()];
    for c in g.components() {
        for side in &mut bases {
            side.push(Vec::new());
        }
        for _ in 0..c.layers() {
            for side in &mut bases {
                side.last_mut().unwrap().push(at);
                at += 64 << 10;
            }
        }
    }
    let [b0, b1] = bases;
    let b0_copy = b0.clone();
    let d0 = RemoteSpace::unmapped(g.clone(), 1, b0).unwrap();
    let d1 = RemoteSpace::unmapped(g.clone(), 1, b1).unwrap();
    let plan = first_page_into_two(&src, &d0, &d1);
    assert!(plan.is_ok(), "{plan:?}");
    // Rank 1's layers 4 KiB into rank 0's: inside every block rank 0 is written in.
    let inside: Vec<Vec<u64>> = b0_copy
        .iter()
        .map(|layers| layers.iter().map(|base| base + 4096).collect())
        .collect();
    let d1 = RemoteSpace::unmapped(g.clone(), 1, inside).unwrap();
    assert!(first_page_into_two(&src, &d0, &d1)
        .is_err_and(|e| e.to_string().contains("overlapping memory")));
}

#[test]
fn every_status_of_a_chunk_names_its_decode_rank_bytes() {
    // The statuses a chunk gives its decode ranks add up to what it moved.
    let mut rng = common::rng("every_status_of_a_chunk_names_its_decode_rank_bytes");
    let b: Arc<dyn Backend> = Arc::new(kvshard::backend::cpu::CpuBackend::new());
    let stream = || -> Arc<dyn Backend> { b.clone() };
    let case = Case {
        n: 2,
        layout: DecodeLayout::new(3, 16).unwrap(),
        geometry: small_geometry(),
        chunk_ends: vec![500],
        prefix_pages: 0,
        contiguous: false,
        separate_state: true,
    };
    let s = setup(&b, &stream, &case, &mut rng);
    let mut sender = Sender::new(
        s.ranks[0].1.clone(),
        Box::new(BackendTransport::new(b.clone())),
    );
    sender.open_decode(s.reg.clone(), s.spaces.clone()).unwrap();
    let mut pending = sender.send(REQUEST, &s.src, case.end(0)).unwrap();
    let total = pending.bytes();
    let per: Vec<ComponentBytes> = pending.decode_bytes().to_vec();
    let polled = pending.poll_each().unwrap();
    let statuses: Vec<ChunkStatus> = match polled {
        Some(s) => s,
        None => pending.wait_each_sync().unwrap(),
    };
    let mut sum = ComponentBytes::default();
    for (status, bytes) in statuses.iter().zip(&per) {
        match status.result {
            ChunkResult::Sent { bytes: b, last } => {
                assert!(last);
                assert_eq!(b, *bytes);
                sum += b;
            }
            ChunkResult::Failed { .. } => panic!("{status}"),
        }
    }
    assert_eq!(sum, total);
    assert_eq!(sender.bytes_sent(), total);
    b.synchronize().unwrap();
}

// Decode pools of other processes: each decode rank's pool exported (a sealed memfd, as a
// decode process does) and imported into the prefill ranks' address space (a second arena
// stands for the other process), as `ipc::ImportedPool` maps them for `kvshard pd`: one
// launch per prefill rank and chunk writes every decode rank's memory, which each decode rank
// then reads as its own. (On a GPU the same route is exportable VMM memory mapped into the
// prefill's context; the kernel is the one the GPU tests above check against its twin.)
#[test]
fn chunks_reach_decode_pools_imported_from_other_processes() {
    use kvshard::backend::cpu::CpuBackend;
    use kvshard::ipc::wire::Message;
    use kvshard::ipc::{ExportedPool, ImportedPool, PeerBackend};
    let mut rng = common::rng("chunks_reach_decode_pools_imported_from_other_processes");
    let prefill = Arc::new(CpuBackend::new());
    let base: Arc<dyn Backend> = Arc::new(prefill.new_stream());
    let stream = || -> Arc<dyn Backend> { Arc::new(prefill.new_stream()) };
    let import = |g: &CacheGeometry, pages: u64| {
        let decode = Arc::new(CpuBackend::new());
        let exported = ExportedPool::allocate(
            &PeerBackend::Cpu(decode.clone()),
            g,
            Placement::unsharded(),
            0,
            pages,
        )
        .unwrap();
        let (msg, fds) = exported.publication(1).unwrap();
        let Message::PublishPool(p) = msg else {
            panic!("{msg:?}")
        };
        let imported = ImportedPool::import(&PeerBackend::Cpu(prefill.clone()), &p, fds).unwrap();
        DecodeSide {
            owner: decode,
            pool: exported.pool().clone(),
            space: imported.space().clone(),
            _keep: Some(Box::new((exported, imported))),
        }
    };
    for _ in 0..6 {
        let case = random_case(&mut rng);
        for mode in [Mode::Lockstep, Mode::Pipelined] {
            let seed = rng.random();
            run_case_with(&base, &stream, &import, &case, mode, seed, Route::Scatter);
        }
    }
}

// The same on the GPU: each decode rank's pool in exportable VMM memory, imported (mapped a
// second time, as a decode process's pool is) into the prefill ranks' context.
#[test]
fn gpu_chunks_reach_decode_pools_imported_from_other_processes() {
    use kvshard::backend::cuda::CudaBackend;
    use kvshard::ipc::wire::Message;
    use kvshard::ipc::{ExportedPool, ImportedPool, PeerBackend};
    let test = "gpu_chunks_reach_decode_pools_imported_from_other_processes";
    let Some(gpu) = common::open_gpu(test) else {
        return;
    };
    let mut rng = common::rng(test);
    let prefill = Arc::new(CudaBackend::new(gpu.clone()).unwrap());
    let base: Arc<dyn Backend> = prefill.clone();
    let stream = || common::stream(&gpu);
    let import = |g: &CacheGeometry, pages: u64| {
        let decode = Arc::new(CudaBackend::new(gpu.clone()).unwrap());
        let exported = ExportedPool::allocate(
            &PeerBackend::Cuda(decode.clone()),
            g,
            Placement::unsharded(),
            0,
            pages,
        )
        .unwrap();
        let (msg, fds) = exported.publication(1).unwrap();
        let Message::PublishPool(p) = msg else {
            panic!("{msg:?}")
        };
        let imported = ImportedPool::import(&PeerBackend::Cuda(prefill.clone()), &p, fds).unwrap();
        DecodeSide {
            owner: decode,
            pool: exported.pool().clone(),
            space: imported.space().clone(),
            _keep: Some(Box::new((exported, imported))),
        }
    };
    for _ in 0..6 {
        let case = random_case(&mut rng);
        let seed = rng.random();
        run_case_with(
            &base,
            &stream,
            &import,
            &case,
            Mode::Lockstep,
            seed,
            Route::Scatter,
        );
    }
}
