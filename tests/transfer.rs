//! P/D transfer: a request sent from N in {1, 2, 4, 8} sharded prefill ranks into one unsharded
//! decode pool must leave the decode pool byte-identical to what an unsharded prefill sends, and
//! to an independent expectation built from the reference bytes (every page at its registered
//! destination, the decode's cached prefix untouched, the indexer state of the whole sequence,
//! poison everywhere else). Covered: with and without the draft, shared-indexer layers,
//! decode-side cached prefixes, empty chunks and empty final chunks, coalesced and scattered
//! pages, every copy method; chunks sent one at a time and pipelined (every chunk of the request
//! enqueued before the first wait); completion bookkeeping and failure injection at submission
//! and in flight; validation errors; descriptor batches and block copies against the spaces a
//! plan was made for. The sends run from one body on the CPU twin (`cpu_*`) and on the GPU
//! (`gpu_*`, all ranks on one GPU, one stream each; SKIPPED without a GPU).

mod common;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::synth::{self, POISON};
use kvshard::abi;
use kvshard::advanced::{block_copies, kernel_pieces, KERNEL_PIECE_BYTES};
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{Backend, Launch};
use kvshard::copy::{
    BlockCopy, BlockCopyPlan, BlockSpace, Method, PageSelection, RemoteSpace, Staging,
};
use kvshard::geometry::{
    CacheGeometry, Component, ComponentLayout, LatentLayout, PoolGeometry, PAGE_SIZE,
};
use kvshard::index::{LocalPage, LogicalPage, StoredLayer};
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::transfer::{
    BackendTransport, ChunkEnd, ChunkRange, ChunkResult, ChunkStatus, Completion, ComponentBytes,
    DescriptorBatch, Finished, MissingChunks, Outcome, Overdue, PendingChunk, PoolLayout,
    PrefillRank, Receiver, Registration, SendPlan, Sender, Transport, DEFAULT_DEADLINE,
    MAX_CHUNKS_AHEAD, MAX_PREFILL_RANKS,
};
use kvshard::{Error, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const LAUNCH: Launch = Launch {
    ctas: 16,
    threads: 256,
};
const METHODS: [Method; 3] = [
    Method::RangeKernel(LAUNCH),
    Method::CopyEngine,
    Method::Kernel(LAUNCH),
];
const SHARDS: [u32; 4] = [1, 2, 4, 8];
/// Pages of the decode pool.
const DECODE_PAGES: u64 = 40;
const REQUEST: u64 = 42;
/// How late past its deadline a request may be reported overdue on a loaded test machine.
const SLACK: Duration = Duration::from_secs(2);

/// A CPU backend's streams: the first one, and a maker of more streams of the same arena.
struct CpuStreams {
    root: CpuBackend,
}

impl CpuStreams {
    fn new(deferred: bool) -> Self {
        let root = if deferred {
            CpuBackend::deferred()
        } else {
            CpuBackend::new()
        };
        Self { root }
    }

    fn stream(&self) -> Arc<dyn Backend> {
        Arc::new(self.root.new_stream())
    }
}

/// One request to send.
#[derive(Debug, Clone)]
struct Case {
    name: &'static str,
    geometry: CacheGeometry,
    /// Prefill chunk ends in tokens; the last one is the sequence length.
    chunk_ends: Vec<usize>,
    /// Pages the decode already holds.
    prefix_pages: usize,
    /// Pages handed out in order on both sides (runs coalesce) rather than shuffled.
    contiguous: bool,
}

impl Case {
    fn tokens(&self) -> usize {
        *self.chunk_ends.last().unwrap()
    }

    fn pages(&self) -> usize {
        self.tokens().div_ceil(PAGE_SIZE)
    }

    /// Where chunk `i` ends, as the sender takes it.
    fn end(&self, i: usize) -> ChunkEnd {
        let tokens = self.chunk_ends[i];
        if i + 1 == self.chunk_ends.len() {
            ChunkEnd::Final(tokens)
        } else {
            ChunkEnd::Partial(tokens)
        }
    }
}

fn draft_shared() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        vec![true, false, true],
    ))
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "draft + shared-indexer layers, chunk ends inside pages",
            geometry: draft_shared(),
            chunk_ends: vec![300, 700, 1000],
            prefix_pages: 0,
            contiguous: false,
        },
        Case {
            name: "target only, coalescing pages",
            geometry: CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2)),
            chunk_ends: vec![512, 1000],
            prefix_pages: 0,
            contiguous: true,
        },
        Case {
            name: "decode-cached prefix of 5 pages, a chunk inside it",
            geometry: draft_shared(),
            chunk_ends: vec![200, 600, 1000],
            prefix_pages: 5,
            contiguous: false,
        },
        Case {
            name: "no indexer state, final chunk of one page",
            geometry: CacheGeometry::target_only(PoolGeometry::with_indexer_layers(
                LatentLayout::Fp8Scaled,
                vec![false, false],
            )),
            chunk_ends: vec![960, 1000],
            prefix_pages: 0,
            contiguous: true,
        },
        Case {
            name: "three-page request, bf16 rows, one chunk",
            geometry: CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Bf16, 2)),
            chunk_ends: vec![150],
            prefix_pages: 0,
            contiguous: false,
        },
        Case {
            name: "cached prefix, page-aligned chunks, coalescing",
            geometry: CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 1)),
            chunk_ends: vec![512, 1024],
            prefix_pages: 3,
            contiguous: true,
        },
    ]
}

/// Local pages per prefill rank: room for the rank's share of the sequence and a few more.
fn rank_pages(case: &Case, n: u32) -> u64 {
    case.pages().div_ceil(n as usize) as u64 + 4
}

/// The logical page of every position on `n` ranks of `rank_pages` pages (docs/design.md, "Ownership"):
/// position j is owned by `(start + j) % n` and takes that owner's next free local page, from
/// a free list in order or shuffled.
fn prefill_pages(
    rng: &mut StdRng,
    n: u32,
    rank_pages: u64,
    pages: usize,
    contiguous: bool,
) -> Vec<LogicalPage> {
    let start = rng.random_range(0..n);
    let free: Vec<Vec<u64>> = (0..n)
        .map(|_| {
            let mut v: Vec<u64> = (1..rank_pages).collect();
            if !contiguous {
                v.shuffle(rng);
            }
            v
        })
        .collect();
    let mut next = vec![0usize; n as usize];
    (0..pages)
        .map(|j| {
            let owner = (start + j as u32) % n;
            let local = free[owner as usize][next[owner as usize]];
            next[owner as usize] += 1;
            LogicalPage(local * u64::from(n) + u64::from(owner))
        })
        .collect()
}

/// The decode page of every position: consecutive, or distinct random pages of the pool.
fn decode_pages(rng: &mut StdRng, pages: usize, contiguous: bool) -> Vec<LocalPage> {
    if contiguous {
        (3..3 + pages as u64).map(LocalPage).collect()
    } else {
        let mut v: Vec<LocalPage> = (1..DECODE_PAGES).map(LocalPage).collect();
        v.shuffle(rng);
        v.truncate(pages);
        v
    }
}

fn registration(case: &Case, dec: &[LocalPage], decode: &DevicePool) -> Registration {
    Registration {
        request: REQUEST,
        layout: PoolLayout::of(decode),
        prefix_pages: case.prefix_pages,
        pages: dec[case.prefix_pages..].to_vec(),
        state_pages: dec.to_vec(),
    }
}

/// Offset of block (component `c`, `layer`, `page`) in a snapshot of a `pages`-page pool.
fn block_offset(
    components: &[ComponentLayout],
    pages: u64,
    c: usize,
    layer: usize,
    page: u64,
) -> usize {
    let before: usize = components[..c]
        .iter()
        .map(|x| x.layers() * pages as usize * x.block_bytes)
        .sum();
    before + (layer * pages as usize + page as usize) * components[c].block_bytes
}

/// Where two snapshots of a `pages`-page pool first differ, if they do.
fn difference(components: &[ComponentLayout], pages: u64, a: &[u8], b: &[u8]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("lengths {} and {}", a.len(), b.len()));
    }
    let at = a.iter().zip(b).position(|(x, y)| x != y)?;
    for (c, comp) in components.iter().enumerate() {
        for layer in 0..comp.layers() {
            for page in 0..pages {
                let start = block_offset(components, pages, c, layer, page);
                if (start..start + comp.block_bytes).contains(&at) {
                    return Some(format!(
                        "{} layer {layer} page {page}, byte {}",
                        comp.component,
                        at - start
                    ));
                }
            }
        }
    }
    Some(format!("byte {at}"))
}

/// Writes `data` into block (`component`, `layer`, `page`) of a pool kvshard allocated.
fn write_block(
    b: &dyn Backend,
    pool: &DevicePool,
    component: Component,
    layer: usize,
    page: LocalPage,
    data: &[u8],
) {
    let storage = pool.storage().unwrap();
    let at = pool
        .block_addr(component, StoredLayer(layer), page)
        .unwrap();
    b.write_sync(storage, (at - storage.addr()) as usize, data)
        .unwrap();
}

/// A decode pool of `geometry` (poison, except the latent blocks of the cached prefix, which
/// hold bytes of their own: a transfer must leave them alone) and the destination it is to the
/// prefill ranks.
fn decode_pool_of(
    b: &dyn Backend,
    geometry: &CacheGeometry,
    prefix: &[LocalPage],
    seed: u64,
) -> (Arc<DevicePool>, Arc<RemoteSpace>) {
    let pool = Arc::new(
        DevicePool::allocate(b, geometry, Placement::unsharded(), 0, DECODE_PAGES).unwrap(),
    );
    pool.fill(b, POISON).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    for comp in pool.components() {
        if comp.component.is_indexer() {
            continue;
        }
        for layer in 0..comp.layers() {
            for &page in prefix {
                let data = synth::bytes(&mut rng, comp.block_bytes);
                write_block(b, &pool, comp.component, layer, page, &data);
            }
        }
    }
    // The ranks write on streams of their own: the poison must have landed first.
    b.synchronize().unwrap();
    let space = Arc::new(RemoteSpace::of(pool.clone(), geometry.clone()).unwrap());
    (pool, space)
}

fn decode_pool(
    b: &dyn Backend,
    case: &Case,
    dec: &[LocalPage],
    seed: u64,
) -> (Arc<DevicePool>, Arc<RemoteSpace>) {
    decode_pool_of(b, &case.geometry, &dec[..case.prefix_pages], seed)
}

/// What the decode pool must hold afterwards, computed from the reference bytes alone: latent
/// blocks of positions after the prefix and indexer blocks of every position at their decode
/// pages, everything else as it was.
fn expected(
    case: &Case,
    before: &[u8],
    reference: &[u8],
    reference_pages: u64,
    src: &[LogicalPage],
    dec: &[LocalPage],
) -> Vec<u8> {
    let components = case.geometry.components();
    let mut out = before.to_vec();
    for (j, (&s, &d)) in src.iter().zip(dec).enumerate() {
        for (c, comp) in components.iter().enumerate() {
            if !comp.component.is_indexer() && j < case.prefix_pages {
                continue;
            }
            for layer in 0..comp.layers() {
                // The reference pool is unsharded: logical page l is its page l.
                let from = block_offset(&components, reference_pages, c, layer, s.0);
                let to = block_offset(&components, DECODE_PAGES, c, layer, d.0);
                out[to..to + comp.block_bytes]
                    .copy_from_slice(&reference[from..from + comp.block_bytes]);
            }
        }
    }
    out
}

/// Bytes rank `rank` of `n` must move: its positions after the prefix for latent components,
/// its positions from 0 for indexer ones.
fn owed_bytes(case: &Case, src: &[LogicalPage], n: u32, rank: u32) -> ComponentBytes {
    let mut out = ComponentBytes::default();
    for comp in case.geometry.components() {
        let first = if comp.component.is_indexer() {
            0
        } else {
            case.prefix_pages
        };
        let owned = src[first..]
            .iter()
            .filter(|&&p| p.0 % u64::from(n) == u64::from(rank))
            .count();
        out.add(
            comp.component,
            (owned * comp.layers() * comp.block_bytes) as u64,
        );
    }
    out
}

/// How the chunks of a request are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Chunk by chunk: every rank enqueues a chunk, then every rank's chunk is waited for.
    Lockstep,
    /// Every rank enqueues every chunk of the request before the first wait; then the chunks
    /// are waited for in order. On a deferred CPU backend nothing has moved before the waits.
    Pipelined,
}

/// What sending one request produced.
struct Sent {
    finished: Finished,
    statuses: Vec<ChunkStatus>,
    rank_bytes: Vec<ComponentBytes>,
}

/// One prefill rank: its stream and its pool.
type Rank = (Arc<dyn Backend>, Arc<DevicePool>);

/// Sends every chunk of `case` from every rank in `ranks` (a random rank order per chunk) into
/// `decode`, delivering each status to a receiver; checks the request finishes exactly with
/// the last status and leaves nothing pending anywhere. With `untouched` (a deferred backend),
/// pipelined chunks are checked not to have moved a byte before the first wait: `untouched`
/// reads the decode pool without running the ranks' streams.
#[allow(clippy::too_many_arguments)]
fn send_request(
    ranks: &[Rank],
    decode: &Arc<RemoteSpace>,
    method: Method,
    case: &Case,
    src: &[LogicalPage],
    reg: &Registration,
    rng: &mut StdRng,
    mode: Mode,
    untouched: Option<&dyn Fn() -> bool>,
) -> Sent {
    let n = ranks.len() as u32;
    let mut senders: Vec<Sender> = ranks
        .iter()
        .map(|(b, pool)| {
            let transport = BackendTransport::with_method(b.clone(), method).unwrap();
            Sender::new(pool.clone(), Box::new(transport))
        })
        .collect();
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), n).unwrap();
    for s in &mut senders {
        s.open(reg.clone(), decode.clone()).unwrap();
    }
    let mut statuses = Vec::new();
    let mut finished = None;
    let mut deliver = |pending: PendingChunk| {
        let status = pending.wait_sync().unwrap();
        assert!(
            matches!(status.result, ChunkResult::Sent { .. }),
            "{status}"
        );
        assert!(
            finished.is_none(),
            "finished before every rank reported: {status}"
        );
        statuses.push(status.clone());
        finished = receiver.receive(status).unwrap();
    };
    // The prefill page table holds the pages of the tokens prefilled so far.
    let table = |i: usize| &src[..case.chunk_ends[i].div_ceil(PAGE_SIZE)];
    match mode {
        Mode::Lockstep => {
            for i in 0..case.chunk_ends.len() {
                let mut order: Vec<usize> = (0..ranks.len()).collect();
                order.shuffle(rng);
                let pending: Vec<PendingChunk> = order
                    .iter()
                    .map(|&r| senders[r].send(REQUEST, table(i), case.end(i)).unwrap())
                    .collect();
                pending.into_iter().for_each(&mut deliver);
            }
        }
        Mode::Pipelined => {
            let mut queues: Vec<VecDeque<PendingChunk>> = senders
                .iter_mut()
                .map(|s| {
                    (0..case.chunk_ends.len())
                        .map(|i| {
                            let p = s.send(REQUEST, table(i), case.end(i)).unwrap();
                            assert_eq!((p.request(), p.chunk() as usize), (REQUEST, i));
                            assert_eq!(p.is_last(), i + 1 == case.chunk_ends.len());
                            p
                        })
                        .collect()
                })
                .collect();
            // Every chunk of the request is enqueued and the senders are done with it.
            assert!(senders.iter().all(|s| s.pending_requests() == 0));
            if let Some(untouched) = untouched {
                for q in &mut queues {
                    for p in q.iter_mut().filter(|p| p.bytes().total() > 0) {
                        assert!(p.poll().unwrap().is_none(), "landed before a wait: {p:?}");
                    }
                }
                assert!(untouched(), "bytes moved before the first wait");
            }
            for _ in 0..case.chunk_ends.len() {
                let mut order: Vec<usize> = (0..ranks.len()).collect();
                order.shuffle(rng);
                for r in order {
                    deliver(queues[r].pop_front().unwrap());
                }
            }
        }
    }
    let finished = finished.expect("finished with the last status");
    assert_eq!(receiver.pending_requests(), 0);
    assert!(senders.iter().all(|s| s.pending_requests() == 0));
    Sent {
        finished,
        statuses,
        rank_bytes: senders.iter().map(Sender::bytes_sent).collect(),
    }
}

/// One case on one backend: decode snapshots after an N-rank send and after an unsharded send
/// of the same reference bytes, and the expectation.
struct Run {
    sharded: Vec<u8>,
    unsharded: Vec<u8>,
    expected: Vec<u8>,
    sent: Sent,
    src: Vec<LogicalPage>,
}

/// Runs `case` from `n` ranks, each on a stream of its own made by `stream`, checking on the
/// way that a pipelined send moved nothing before its first wait when `deferred`.
#[allow(clippy::too_many_arguments)]
fn run_case(
    base: &Arc<dyn Backend>,
    stream: &dyn Fn() -> Arc<dyn Backend>,
    case: &Case,
    n: u32,
    method: Method,
    mode: Mode,
    deferred: bool,
    seed: u64,
) -> Run {
    let mut rng = StdRng::seed_from_u64(seed);
    let g = &case.geometry;
    let placement = Placement::new(n).unwrap();
    let per_rank = rank_pages(case, n);
    let src = prefill_pages(&mut rng, n, per_rank, case.pages(), case.contiguous);
    let dec = decode_pages(&mut rng, case.pages(), case.contiguous);

    // The reference: logical page l at page l of one unsharded pool, random bytes. It is also
    // the pool of the unsharded prefill.
    let reference_pages = placement.logical_pages(per_rank).unwrap();
    let reference = Arc::new(
        DevicePool::allocate(base.as_ref(), g, Placement::unsharded(), 0, reference_pages).unwrap(),
    );
    let storage = reference.storage().unwrap();
    base.write_sync(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();

    // Prefill ranks: garbage everywhere, the reference bytes at their owned pages.
    let local: Vec<LocalPage> = src.iter().map(|p| LocalPage(p.0)).collect();
    let ranks: Vec<Rank> = (0..n)
        .map(|r| {
            let b = stream();
            let pool =
                Arc::new(DevicePool::allocate(b.as_ref(), g, placement, r, per_rank).unwrap());
            let storage = pool.storage().unwrap();
            b.write_sync(storage, 0, &synth::bytes(&mut rng, storage.len()))
                .unwrap();
            let plan = BlockCopyPlan::new(
                reference.as_ref(),
                PageSelection::Local(local.clone()),
                pool.as_ref(),
                PageSelection::Logical {
                    pages: src.clone(),
                    placement,
                    rank: r,
                },
                src.len(),
            )
            .unwrap();
            let copy =
                BlockCopy::prepare_sync(b.as_ref(), plan, reference.clone(), pool.clone(), None)
                    .unwrap();
            copy.run(b.as_ref(), LAUNCH).unwrap();
            // The copy's tables must outlive the launch: keep it until the stream has run it.
            b.synchronize().unwrap();
            drop(copy);
            (b, pool)
        })
        .collect();

    let prefix_seed = rng.random();
    let (sharded_decode, sharded_space) = decode_pool(base.as_ref(), case, &dec, prefix_seed);
    let before = sharded_decode.snapshot_sync(base.as_ref()).unwrap();
    let reg = registration(case, &dec, &sharded_decode);
    // Reading on `base` through an untracked view (as another process reading the decode pool
    // would) runs none of the ranks' streams; a kvshard read would wait for their sends.
    let storage = sharded_decode.storage().unwrap();
    // SAFETY: the decode pool's whole allocation, alive for the whole test.
    let view = unsafe {
        kvshard::backend::Buffer::from_raw(
            storage.addr(),
            storage.len(),
            storage.kind(),
            storage.space(),
        )
    };
    let raw_before = base.read_sync(&view, 0, view.len()).unwrap();
    let untouched = || base.read_sync(&view, 0, view.len()).unwrap() == raw_before;
    let check: Option<&dyn Fn() -> bool> = if deferred && mode == Mode::Pipelined {
        Some(&untouched)
    } else {
        None
    };
    let sent = send_request(
        &ranks,
        &sharded_space,
        method,
        case,
        &src,
        &reg,
        &mut rng,
        mode,
        check,
    );

    let (unsharded_decode, unsharded_space) = decode_pool(base.as_ref(), case, &dec, prefix_seed);
    send_request(
        &[(stream(), reference.clone())],
        &unsharded_space,
        method,
        case,
        &src,
        &reg,
        &mut rng,
        mode,
        None,
    );

    Run {
        sharded: sharded_decode.snapshot_sync(base.as_ref()).unwrap(),
        unsharded: unsharded_decode.snapshot_sync(base.as_ref()).unwrap(),
        expected: expected(
            case,
            &before,
            &reference.snapshot_sync(base.as_ref()).unwrap(),
            reference_pages,
            &src,
            &dec,
        ),
        sent,
        src,
    }
}

fn check_run(case: &Case, n: u32, method: Method, mode: Mode, run: &Run) {
    let what = format!("{} N={n} {method:?} {mode:?}", case.name);
    let components = case.geometry.components();
    if let Some(at) = difference(&components, DECODE_PAGES, &run.unsharded, &run.expected) {
        panic!("{what}: the unsharded send differs from the expectation at {at}");
    }
    if let Some(at) = difference(&components, DECODE_PAGES, &run.sharded, &run.unsharded) {
        panic!("{what}: the sharded send differs from the unsharded one at {at}");
    }
    let f = &run.sent.finished;
    assert!(f.is_completed(), "{what}: {:?}", f.outcome);
    assert_eq!(f.request(), REQUEST);
    for rank in 0..n {
        let owed = owed_bytes(case, &run.src, n, rank);
        assert_eq!(f.bytes[rank as usize], owed, "{what}: bytes of rank {rank}");
        assert_eq!(
            run.sent.rank_bytes[rank as usize], owed,
            "{what}: sender bytes of rank {rank}"
        );
    }
    assert_eq!(
        f.total_bytes(),
        owed_bytes(case, &run.src, 1, 0),
        "{what}: the ranks' bytes add up to an unsharded send"
    );
    // One status per rank per chunk, empty chunks included.
    assert_eq!(
        run.sent.statuses.len(),
        n as usize * case.chunk_ends.len(),
        "{what}"
    );
}

// A request sent from N sharded prefill ranks (each on a stream of its own), by every copy
// method, chunk by chunk and pipelined, leaves the decode pool as an unsharded prefill's send
// and the expectation built from the reference bytes say; each rank reports the bytes it owes.
// On the GPU, every request also finishes as on the CPU twin.
common::on_cpu_and_gpu!(sharded_sends_match_an_unsharded_prefill, |device| -> Vec<
    Finished,
> {
    let mut rng = device.rng();
    let base = device.stream();
    let mut finished = Vec::new();
    for case in cases() {
        for n in SHARDS {
            for method in METHODS {
                for mode in [Mode::Lockstep, Mode::Pipelined] {
                    let seed = rng.random();
                    let stream = || device.stream();
                    let run = run_case(&base, &stream, &case, n, method, mode, false, seed);
                    check_run(&case, n, method, mode, &run);
                    finished.push(run.sent.finished);
                }
            }
        }
    }
    finished
});

#[test]
fn pipelined_chunks_land_only_when_waited_for_and_match_lockstep_sends() {
    let mut rng = common::rng("pipelined_chunks_land_only_when_waited_for");
    // Deferred: enqueued chunks run only when waited for, so "nothing moved before the first
    // wait" is observable, and the waits run them in order.
    let cpu = CpuStreams::new(true);
    let base = cpu.stream();
    let immediate = CpuStreams::new(false);
    let immediate_base = immediate.stream();
    for case in cases() {
        for n in SHARDS {
            for method in METHODS {
                let seed = rng.random();
                let run = run_case(
                    &base,
                    &|| cpu.stream(),
                    &case,
                    n,
                    method,
                    Mode::Pipelined,
                    true,
                    seed,
                );
                check_run(&case, n, method, Mode::Pipelined, &run);
                // The same request chunk by chunk on an immediate backend: byte-identical.
                let lockstep = run_case(
                    &immediate_base,
                    &|| immediate.stream(),
                    &case,
                    n,
                    method,
                    Mode::Lockstep,
                    false,
                    seed,
                );
                assert!(
                    lockstep.sharded == run.sharded,
                    "{} N={n} {method:?}: pipelined and lockstep sends differ",
                    case.name
                );
                assert_eq!(lockstep.sent.finished, run.sent.finished);
            }
        }
    }
}

#[test]
fn ranks_owning_nothing_still_send_an_empty_final_chunk() {
    let mut rng = common::rng("ranks_owning_nothing_still_send_an_empty_final_chunk");
    let cpu = CpuStreams::new(false);
    let base = cpu.stream();
    let all = cases();
    let method = Method::CopyEngine;
    let run = |case: &Case, n: u32, seed: u64| {
        let run = run_case(
            &base,
            &|| cpu.stream(),
            case,
            n,
            method,
            Mode::Lockstep,
            false,
            seed,
        );
        check_run(case, n, method, Mode::Lockstep, &run);
        run
    };
    // One page in the final chunk and no state: 7 of 8 ranks have nothing to send in it.
    let one_page = run(&all[3], 8, rng.random());
    let empty_finals = one_page
        .sent
        .statuses
        .iter()
        .filter(|s| {
            s.is_terminal()
                && s.result
                    == ChunkResult::Sent {
                        bytes: ComponentBytes::default(),
                        last: true,
                    }
        })
        .count();
    assert_eq!(empty_finals, 7);
    // Three pages with their state: 5 of 8 ranks own nothing of the whole request.
    let short = run(&all[4], 8, rng.random());
    let idle = short
        .sent
        .finished
        .bytes
        .iter()
        .filter(|b| b.total() == 0)
        .count();
    assert_eq!(idle, 5);
    // A chunk that ends inside the decode's cached prefix sends nothing on any rank.
    let cached = run(&all[2], 4, rng.random());
    let first: Vec<_> = cached
        .sent
        .statuses
        .iter()
        .filter(|s| s.chunk == 0)
        .collect();
    assert_eq!(first.len(), 4);
    assert!(first.iter().all(|s| s.result
        == ChunkResult::Sent {
            bytes: ComponentBytes::default(),
            last: false
        }));
}

/// A transport that fails its `fail_on`-th submission (counting from 1): at submission (nothing
/// is enqueued) or, with `in_flight`, once the chunk has moved (its completion reports the
/// failure, as a transfer engine that detects an error on completion does).
struct Failing {
    inner: BackendTransport,
    fail_on: usize,
    in_flight: bool,
    submitted: usize,
}

struct FailingCompletion {
    inner: Box<dyn Completion>,
    request: u64,
    submission: usize,
}

impl FailingCompletion {
    fn error(&self) -> Error {
        Error::Transfer {
            request: self.request,
            reason: format!(
                "injected failure of submission {} in flight",
                self.submission
            ),
        }
    }
}

impl Completion for FailingCompletion {
    fn poll(&mut self) -> Result<bool> {
        match self.inner.poll()? {
            true => Err(self.error()),
            false => Ok(false),
        }
    }

    fn wait_sync(&mut self) -> Result<()> {
        self.inner.wait_sync()?;
        Err(self.error())
    }
}

impl Transport for Failing {
    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>> {
        self.submitted += 1;
        let failing = self.submitted == self.fail_on;
        if failing && !self.in_flight {
            return Err(Error::Transfer {
                request: plan.request(),
                reason: format!("injected failure of submission {}", self.submitted),
            });
        }
        let inner = self.inner.submit(plan, src, dst)?;
        if failing {
            return Ok(Box::new(FailingCompletion {
                inner,
                request: plan.request(),
                submission: self.submitted,
            }));
        }
        Ok(inner)
    }
}

/// Sends a 3-chunk request from 4 ranks, rank 2's transport failing its second chunk (at
/// submission, or in flight). The other ranks either go on sending (`abort` false) or are told
/// to abort once the decode side sees the failure. Either way the request ends failed on both
/// sides, every status is accepted, and nothing stays pending.
fn fail_mid_request(abort: bool, in_flight: bool, seed: u64) {
    let case = &cases()[0];
    let n = 4u32;
    let cpu = CpuStreams::new(false);
    let b = cpu.stream();
    let mut rng = StdRng::seed_from_u64(seed);
    let placement = Placement::new(n).unwrap();
    let per_rank = rank_pages(case, n);
    let src = prefill_pages(&mut rng, n, per_rank, case.pages(), false);
    let dec = decode_pages(&mut rng, case.pages(), false);
    let (decode, space) = decode_pool(b.as_ref(), case, &dec, 1);
    let reg = registration(case, &dec, &decode);
    let mut senders: Vec<Sender> = (0..n)
        .map(|r| {
            let pool = DevicePool::allocate(b.as_ref(), &case.geometry, placement, r, per_rank);
            let transport = Failing {
                inner: BackendTransport::with_method(cpu.stream(), Method::CopyEngine).unwrap(),
                fail_on: if r == 2 { 2 } else { 0 },
                in_flight,
                submitted: 0,
            };
            Sender::new(Arc::new(pool.unwrap()), Box::new(transport))
        })
        .collect();
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), n).unwrap();
    for s in &mut senders {
        s.open(reg.clone(), space.clone()).unwrap();
    }
    let mut delivered = 0;
    // Whether the decode side has seen the failure (and, with `abort`, the control plane told
    // the other ranks).
    let mut decode_failed = false;
    let mut finished = None;
    let mut deliver = |receiver: &mut Receiver, status: ChunkStatus| {
        assert!(
            finished.is_none(),
            "a status after the request finished: {status}"
        );
        delivered += 1;
        finished = receiver.receive(status).unwrap();
    };
    for i in 0..case.chunk_ends.len() {
        let table = &src[..case.chunk_ends[i].div_ceil(PAGE_SIZE)];
        for (r, sender) in senders.iter_mut().enumerate() {
            if abort && decode_failed {
                // The decode side saw the failure and the control plane tells the rest to stop.
                if let Ok(status) = sender.abort(REQUEST, "the decode side failed the request") {
                    deliver(&mut receiver, status);
                }
                continue;
            }
            let status = match sender.send(REQUEST, table, case.end(i)) {
                Ok(pending) => pending.wait_sync(),
                Err(e) => Err(e),
            };
            match status {
                Ok(status) => {
                    assert!(!(r == 2 && i == 1), "the injected failure went unseen");
                    assert!(
                        matches!(status.result, ChunkResult::Sent { .. }),
                        "{status}"
                    );
                    deliver(&mut receiver, status);
                }
                Err(e) if r == 2 && i == 1 => {
                    let status = ChunkStatus::from_error(&e).expect("a chunk failure");
                    assert!(status.is_terminal() && status.rank == 2 && status.chunk == 1);
                    if in_flight {
                        // The sender enqueued the chunk and moved on; the engine closes the
                        // request on this rank. The abort's own status is not delivered: the
                        // failure already was the rank's last.
                        assert_eq!(sender.pending_requests(), 1);
                        sender.abort(REQUEST, "chunk 1 failed").unwrap();
                    }
                    assert_eq!(
                        sender.pending_requests(),
                        0,
                        "failed on the prefill side at once"
                    );
                    deliver(&mut receiver, status);
                    let p = receiver.progress(REQUEST).unwrap();
                    assert!(p.failed && p.ranks_done < n, "{p:?}");
                    decode_failed = true;
                }
                Err(e) => {
                    // Only the failed rank refuses to go on with the request.
                    assert!(r == 2 && i == 2, "rank {r} chunk {i}: {e}");
                    assert!(ChunkStatus::from_error(&e).is_none(), "{e}");
                    assert!(e.to_string().contains("not open on prefill rank 2"), "{e}");
                }
            }
        }
    }
    let finished = finished.expect("finished once every rank reported its last status");
    assert_eq!(
        finished.registration, reg,
        "the pages are handed back to be freed"
    );
    let Outcome::Failed(failures) = &finished.outcome else {
        panic!("{:?}", finished.outcome);
    };
    assert_eq!((failures[0].rank, failures[0].chunk), (2, 1));
    assert!(
        failures[0]
            .reason
            .contains("injected failure of submission 2"),
        "{}",
        failures[0].reason
    );
    if abort {
        // Rank 3 (its chunk 1 came after rank 2's failure), then ranks 0 and 1 (chunk 2) were
        // aborted.
        assert_eq!(failures.len(), 4, "{failures:?}");
        assert!(failures[1..]
            .iter()
            .all(|f| f.reason.starts_with("aborted: ")));
        assert_eq!(delivered, 4 + 4 + 2);
    } else {
        assert_eq!(failures.len(), 1);
        assert_eq!(delivered, 4 + 4 + 3);
    }
    assert_eq!(receiver.pending_requests(), 0);
    assert!(senders.iter().all(|s| s.pending_requests() == 0));
}

#[test]
fn a_failed_chunk_fails_the_request_on_both_sides_and_leaks_nothing() {
    let mut rng = common::rng("a_failed_chunk_fails_the_request_on_both_sides_and_leaks_nothing");
    for in_flight in [false, true] {
        for abort in [false, true] {
            fail_mid_request(abort, in_flight, rng.random());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Nothing hangs silently: a request's deadline, and chunks dropped before their status was
// taken.

/// Request `REQUEST` of the first case (3 chunks), opened on the senders of its `n` ranks.
struct OpenRequest {
    _cpu: CpuStreams,
    case: Case,
    src: Vec<LogicalPage>,
    reg: Registration,
    /// The decode pool, as the ranks reach it.
    space: Arc<RemoteSpace>,
    senders: Vec<Sender>,
}

impl OpenRequest {
    fn new(n: u32, seed: u64) -> Self {
        let case = cases().remove(0);
        let cpu = CpuStreams::new(false);
        let b = cpu.stream();
        let mut rng = StdRng::seed_from_u64(seed);
        let placement = Placement::new(n).unwrap();
        let per_rank = rank_pages(&case, n);
        let src = prefill_pages(&mut rng, n, per_rank, case.pages(), false);
        let dec = decode_pages(&mut rng, case.pages(), false);
        let (decode, space) = decode_pool(b.as_ref(), &case, &dec, 1);
        let reg = registration(&case, &dec, &decode);
        let senders = (0..n)
            .map(|r| {
                let pool = DevicePool::allocate(b.as_ref(), &case.geometry, placement, r, per_rank);
                let transport = BackendTransport::new(cpu.stream());
                let mut sender = Sender::new(Arc::new(pool.unwrap()), Box::new(transport));
                sender.open(reg.clone(), space.clone()).unwrap();
                sender
            })
            .collect();
        Self {
            _cpu: cpu,
            case,
            src,
            reg,
            space,
            senders,
        }
    }

    /// Sends chunk `i` of `request` from `rank`, still pending.
    fn send(&mut self, request: u64, rank: usize, i: usize) -> Result<PendingChunk> {
        let table = &self.src[..self.case.chunk_ends[i].div_ceil(PAGE_SIZE)];
        self.senders[rank].send(request, table, self.case.end(i))
    }

    /// Sends chunk `i` of `request` from `rank` and returns its status once it has landed.
    fn landed(&mut self, request: u64, rank: usize, i: usize) -> ChunkStatus {
        self.send(request, rank, i).unwrap().wait_sync().unwrap()
    }
}

/// Calls [`Receiver::expire`] until it reports something; returns that and how long after
/// `registered` it came. Fails past `limit`.
fn expire_within(
    receiver: &mut Receiver,
    registered: Instant,
    limit: Duration,
) -> (Vec<Overdue>, Duration) {
    loop {
        let overdue = receiver.expire();
        if !overdue.is_empty() {
            return (overdue, registered.elapsed());
        }
        assert!(
            registered.elapsed() < limit,
            "nothing reported overdue {limit:?} after the registration"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_missing_final_chunk_fails_the_request_within_its_deadline_naming_rank_and_chunks() {
    let deadline = Duration::from_millis(300);
    let mut o = OpenRequest::new(4, 11);
    let mut receiver = Receiver::with_deadline(deadline);
    assert_eq!(receiver.deadline(), deadline);
    let registered = Instant::now();
    receiver.register(o.reg.clone(), 4).unwrap();
    for rank in 0..4 {
        // Rank 2 never sends its final chunk (chunk 2).
        let chunks = if rank == 2 { 2 } else { 3 };
        for i in 0..chunks {
            let status = o.landed(REQUEST, rank, i);
            assert_eq!(receiver.receive(status).unwrap(), None);
        }
    }
    assert!(receiver.expire().is_empty(), "overdue before its deadline");
    let (overdue, after) = expire_within(&mut receiver, registered, deadline + SLACK);
    assert!(after >= deadline, "reported overdue after {after:?}");
    assert_eq!(
        overdue,
        vec![Overdue {
            request: REQUEST,
            deadline,
            ranks: 4,
            missing: vec![MissingChunks {
                rank: 2,
                received: 2
            }],
        }]
    );
    let e = Error::from(overdue[0].clone());
    assert!(matches!(&e, Error::TransferDeadline(o) if o.request == REQUEST));
    let message = e.to_string();
    assert!(
        message.contains("request 42: no last status within its deadline of 300ms from 1 of its 4 prefill ranks; prefill rank 2: chunks 0..=1 arrived, chunk 2 onward missing (the final chunk among them)"),
        "{message}"
    );
    // Reported once; the request is failed, its pages held while rank 2 may still write them.
    assert!(receiver.expire().is_empty());
    let p = receiver.progress(REQUEST).unwrap();
    assert!(p.failed && p.overdue && p.ranks_done == 3, "{p:?}");
    // The control plane aborts it on rank 2, whose answer hands the request back.
    let aborted = o.senders[2]
        .abort(REQUEST, "the decode's deadline passed")
        .unwrap();
    assert_eq!(aborted.chunk, 2);
    let finished = receiver
        .receive(aborted)
        .unwrap()
        .expect("every rank reported");
    let Outcome::Failed(failures) = &finished.outcome else {
        panic!("{:?}", finished.outcome);
    };
    assert_eq!(failures.len(), 2, "{failures:?}");
    assert!(failures.iter().all(|f| (f.rank, f.chunk) == (2, 2)));
    assert!(
        failures[0].reason.contains("no last status within"),
        "{failures:?}"
    );
    assert!(failures[1].reason.starts_with("aborted: "), "{failures:?}");
    assert_eq!(finished.registration, o.reg);
    assert_eq!(receiver.pending_requests(), 0);
}

#[test]
fn a_silent_rank_fails_the_request_within_its_own_deadline() {
    let deadline = Duration::from_millis(200);
    let mut o = OpenRequest::new(2, 12);
    // The receiver's default is long; this request gets a deadline of its own.
    let mut receiver = Receiver::new();
    assert_eq!(receiver.deadline(), DEFAULT_DEADLINE);
    let registered = Instant::now();
    receiver
        .register_with_deadline(o.reg.clone(), 2, deadline)
        .unwrap();
    for i in 0..3 {
        let status = o.landed(REQUEST, 0, i);
        assert_eq!(receiver.receive(status).unwrap(), None);
    }
    // Rank 1 says nothing at all.
    let (overdue, after) = expire_within(&mut receiver, registered, deadline + SLACK);
    assert!(after >= deadline, "reported overdue after {after:?}");
    assert_eq!(
        overdue[0].missing,
        vec![MissingChunks {
            rank: 1,
            received: 0
        }]
    );
    let message = Error::from(overdue[0].clone()).to_string();
    assert!(
        message.contains("request 42: no last status within its deadline of 200ms from 1 of its 2 prefill ranks; prefill rank 1: no chunk arrived (chunk 0 onward missing, the final chunk among them)"),
        "{message}"
    );
    // Rank 1 is known gone (its process exited): the decode answers for it at the chunk it
    // owes, and the pages come back.
    let gone = ChunkStatus {
        request: REQUEST,
        rank: 1,
        chunk: overdue[0].missing[0].received,
        result: ChunkResult::Failed {
            reason: "prefill rank 1 gone".into(),
        },
    };
    let finished = receiver.receive(gone).unwrap().expect("finished");
    assert!(!finished.is_completed());
    assert_eq!(receiver.pending_requests(), 0);
}

#[test]
fn a_dropped_pending_chunk_is_reported_not_lost() {
    let mut o = OpenRequest::new(2, 13);
    let mut receiver = Receiver::with_deadline(Duration::from_millis(300));
    // Request 43 goes to the same pages: a rank whose engine never takes its dropped chunk.
    let mut ignored = o.reg.clone();
    ignored.request = REQUEST + 1;
    let registered = Instant::now();
    for reg in [&o.reg, &ignored] {
        receiver.register(reg.clone(), 2).unwrap();
    }
    for s in &mut o.senders {
        s.open(ignored.clone(), o.space.clone()).unwrap();
    }

    // Rank 0 drops chunk 0 unpolled: its next send of the request reports it, as the failure
    // the decode side must hear, and the request is closed on the rank.
    drop(o.send(REQUEST, 0, 0).unwrap());
    let e = o.send(REQUEST, 0, 1).unwrap_err();
    assert!(
        matches!(&e, Error::ChunkFailed { request: REQUEST, rank: 0, chunk: 0, reason } if reason.contains("chunk 0 was dropped on prefill rank 0 before its status was taken")),
        "{e}"
    );
    assert!(o.send(REQUEST, 0, 1).is_err(), "closed on the rank");
    assert_eq!(
        receiver
            .receive(ChunkStatus::from_error(&e).unwrap())
            .unwrap(),
        None
    );

    // Rank 1: chunk 0 polled to its status and then dropped is delivered, not reported.
    let mut first = o.send(REQUEST, 1, 0).unwrap();
    let status = first.poll().unwrap().expect("landed at once on the CPU");
    drop(first);
    assert!(o.senders[1].take_dropped().is_empty());
    assert_eq!(receiver.receive(status).unwrap(), None);
    let status = o.landed(REQUEST, 1, 1);
    assert_eq!(receiver.receive(status).unwrap(), None);
    // Its final chunk dropped: the request is no longer open on the rank, and only
    // `take_dropped` reports it, once.
    drop(o.send(REQUEST, 1, 2).unwrap());
    let dropped = o.senders[1].take_dropped();
    assert_eq!(dropped.len(), 1, "{dropped:?}");
    assert_eq!(
        (dropped[0].request, dropped[0].rank, dropped[0].chunk),
        (REQUEST, 1, 2)
    );
    assert!(dropped[0].is_terminal());
    assert!(o.senders[1].take_dropped().is_empty());
    let finished = receiver
        .receive(dropped[0].clone())
        .unwrap()
        .expect("every rank reported");
    let Outcome::Failed(failures) = &finished.outcome else {
        panic!("{:?}", finished.outcome);
    };
    assert_eq!(
        failures
            .iter()
            .map(|f| (f.rank, f.chunk))
            .collect::<Vec<_>>(),
        vec![(0, 0), (1, 2)]
    );
    assert!(failures.iter().all(|f| f.reason.contains("was dropped")));

    // Request 43: rank 0 lands everything, rank 1 drops its second chunk and nobody takes the
    // report; the decode's deadline names the rank and the chunk that never arrived.
    for i in 0..3 {
        let status = o.landed(REQUEST + 1, 0, i);
        assert_eq!(receiver.receive(status).unwrap(), None);
    }
    let status = o.landed(REQUEST + 1, 1, 0);
    assert_eq!(receiver.receive(status).unwrap(), None);
    drop(o.send(REQUEST + 1, 1, 1).unwrap());
    let (overdue, after) = expire_within(
        &mut receiver,
        registered,
        Duration::from_millis(300) + SLACK,
    );
    assert!(after >= Duration::from_millis(300), "{after:?}");
    assert_eq!(overdue.len(), 1);
    assert_eq!(overdue[0].request, REQUEST + 1);
    assert_eq!(
        overdue[0].missing,
        vec![MissingChunks {
            rank: 1,
            received: 1
        }]
    );
    // The rank's report is still there to deliver: it hands the request back.
    let dropped = o.senders[1].take_dropped();
    assert_eq!((dropped[0].request, dropped[0].chunk), (REQUEST + 1, 1));
    assert!(receiver.receive(dropped[0].clone()).unwrap().is_some());
    assert_eq!(receiver.pending_requests(), 0);
    assert!(o.senders.iter().all(|s| s.pending_requests() == 0));
}

#[test]
fn invalid_requests_fail_before_any_byte_moves() {
    let cpu = CpuStreams::new(false);
    let b = cpu.stream();
    let case = &cases()[0];
    let n = 2u32;
    let placement = Placement::new(n).unwrap();
    let pools: Vec<Arc<DevicePool>> = (0..n)
        .map(|r| {
            let pool = DevicePool::allocate(b.as_ref(), &case.geometry, placement, r, 20);
            Arc::new(pool.unwrap())
        })
        .collect();
    let src: Vec<LogicalPage> = (0..case.pages() as u64)
        .map(|p| LogicalPage(2 + p))
        .collect();
    let dec: Vec<LocalPage> = (1..=case.pages() as u64).map(LocalPage).collect();
    let (decode, space) = decode_pool(b.as_ref(), case, &dec, 1);
    let before = decode.snapshot_sync(b.as_ref()).unwrap();
    let good = registration(case, &dec, &decode);
    let senders = || -> Vec<Sender> {
        pools
            .iter()
            .map(|p| {
                let t = BackendTransport::with_method(cpu.stream(), Method::CopyEngine).unwrap();
                Sender::new(p.clone(), Box::new(t))
            })
            .collect()
    };

    // A destination page outside the decode pool: the registration itself is refused by both
    // sides, before any chunk.
    let mut far = good.clone();
    far.pages[3] = LocalPage(DECODE_PAGES + 7);
    let far_message =
        "request 42: destination page 47 at position 3 out of range (the decode pool holds 40 pages)";
    let e = Receiver::new().register(far.clone(), n).unwrap_err();
    assert!(e.to_string().contains(far_message), "{e}");
    for mut s in senders() {
        let e = s.open(far.clone(), space.clone()).unwrap_err();
        assert!(e.to_string().contains(far_message), "{e}");
        assert_eq!(s.pending_requests(), 0);
    }

    // The indexer state registered for one page too few.
    let mut state = good.clone();
    state.state_pages.pop();
    // The decode registered its indexer blocks with another stride.
    let mut stride = good.clone();
    stride.layout.page_strides[1] += 64;
    // The decode runs no draft (and its destination holds none).
    let target_only = CacheGeometry::target_only(case.geometry.target.clone());
    let (_, target_space) = decode_pool_of(b.as_ref(), &target_only, &[], 1);
    let mut no_draft = good.clone();
    no_draft.layout = PoolLayout::packed(target_only, DECODE_PAGES);
    let expectations = [
        (stride, &space, 0, "request 42: packed page stride mismatch for target indexer: prefill 8448 B, decode 8512 B"),
        (no_draft, &target_space, 0, "request 42: prefill vs decode: draft pool present: expected true, got false"),
        // Last: its first two chunks go through.
        (state, &space, 2, "request 42: state page count mismatch: the prefill sends 16 state pages (positions 0..16), the decode registered 15"),
    ];
    for (reg, dst, failing_chunk, message) in expectations {
        let mut receiver = Receiver::new();
        receiver.register(reg.clone(), n).unwrap();
        let mut finished = None;
        for (r, mut sender) in senders().into_iter().enumerate() {
            sender.open(reg.clone(), dst.clone()).unwrap();
            for i in 0..case.chunk_ends.len() {
                match sender.send(REQUEST, &src, case.end(i)) {
                    Ok(pending) => {
                        assert!(i < failing_chunk, "rank {r} chunk {i}: {pending:?}");
                        finished = receiver.receive(pending.wait_sync().unwrap()).unwrap();
                    }
                    Err(e) => {
                        // Every rank refuses the same chunk: it checks all pages, not only
                        // its own.
                        assert_eq!(i, failing_chunk, "rank {r}: {e}");
                        let status = ChunkStatus::from_error(&e).expect("a chunk failure");
                        let ChunkResult::Failed { reason } = &status.result else {
                            panic!("{status}");
                        };
                        assert!(
                            reason.contains(message),
                            "rank {r}: {reason}\nexpected: {message}"
                        );
                        assert_eq!((status.rank, status.chunk), (r as u32, i as u32));
                        finished = receiver.receive(status).unwrap();
                        break;
                    }
                }
            }
            assert_eq!(sender.pending_requests(), 0);
        }
        let finished = finished.expect("finished");
        assert!(matches!(&finished.outcome, Outcome::Failed(f) if f.len() == 2));
        assert_eq!(receiver.pending_requests(), 0);
        if failing_chunk == 0 {
            assert!(
                decode.snapshot_sync(b.as_ref()).unwrap() == before,
                "{message}: bytes moved before the failure"
            );
        }
    }
}

fn sent(chunk: u32, bytes: u64, last: bool) -> ChunkStatus {
    let mut b = ComponentBytes::default();
    b.add(Component::TargetLatent, bytes);
    ChunkStatus {
        request: REQUEST,
        rank: 1,
        chunk,
        result: ChunkResult::Sent { bytes: b, last },
    }
}

/// A registration of [`REQUEST`] on a decode pool, for tests of the receiver alone.
fn receiver_registration() -> Registration {
    let cpu = CpuStreams::new(false);
    let b = cpu.stream();
    let case = &cases()[1];
    let (decode, _space) = decode_pool(b.as_ref(), case, &[], 0);
    let dec: Vec<LocalPage> = (1..=16).map(LocalPage).collect();
    registration(case, &dec, &decode)
}

fn status_of(rank: u32, chunk: u32, result: ChunkResult) -> ChunkStatus {
    ChunkStatus {
        request: REQUEST,
        rank,
        chunk,
        result,
    }
}

fn sent_bytes(bytes: u64, last: bool) -> ChunkResult {
    let mut b = ComponentBytes::default();
    b.add(Component::TargetLatent, bytes);
    ChunkResult::Sent { bytes: b, last }
}

#[test]
fn the_receiver_takes_each_rank_s_statuses_in_any_order() {
    let reg = receiver_registration();
    for seed in 0..300u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let ranks = rng.random_range(1..=4u32);
        // Per rank: its chunks, and the chunk it fails at (if it does).
        let plan: Vec<(u32, Option<u32>)> = (0..ranks)
            .map(|_| {
                let chunks = rng.random_range(1..=6u32);
                let fails = rng.random_bool(0.3).then(|| rng.random_range(0..chunks));
                (chunks, fails)
            })
            .collect();
        // Every status a rank delivers. A failed rank delivers its failure after the chunks
        // past it that landed first (what a loop that polls in any order does), never before.
        let mut statuses: Vec<ChunkStatus> = Vec::new();
        let mut expect_bytes = Vec::new();
        for (rank, &(chunks, fails)) in (0u32..).zip(&plan) {
            let mut bytes = 0;
            let mut mine = Vec::new();
            for c in 0..chunks {
                let n = u64::from(rank * 100 + c + 1);
                match fails {
                    Some(f) if c == f => continue,
                    Some(f) if c > f && !rng.random_bool(0.5) => continue,
                    Some(f) if c > f => {}
                    _ => bytes += n,
                }
                mine.push(status_of(rank, c, sent_bytes(n, c + 1 == chunks)));
            }
            mine.shuffle(&mut rng);
            if let Some(f) = fails {
                let at = rng.random_range(0..=mine.len());
                let failure = ChunkResult::Failed {
                    reason: format!("rank {rank} failed"),
                };
                // Past every status of a chunk after it.
                let after = mine.iter().rposition(|s| s.chunk > f).map_or(0, |p| p + 1);
                mine.insert(at.max(after), status_of(rank, f, failure));
            }
            expect_bytes.push(bytes);
            statuses.extend(mine);
        }
        // Interleave the ranks, keeping each rank's own order.
        let mut order: Vec<u32> = statuses.iter().map(|s| s.rank).collect();
        order.shuffle(&mut rng);
        let mut by_rank: Vec<VecDeque<ChunkStatus>> = (0..ranks).map(|_| VecDeque::new()).collect();
        for s in statuses {
            by_rank[s.rank as usize].push_back(s);
        }
        let mut rx = Receiver::new();
        rx.register(reg.clone(), ranks).unwrap();
        let total = order.len();
        let mut finished = None;
        for (i, rank) in order.into_iter().enumerate() {
            let s = by_rank[rank as usize]
                .pop_front()
                .expect("a status per entry");
            let got = rx
                .receive(s.clone())
                .unwrap_or_else(|e| panic!("seed {seed}: {s:?} refused: {e}"));
            if i + 1 < total {
                assert!(
                    got.is_none(),
                    "seed {seed}: finished before every status came"
                );
            } else {
                finished = got;
            }
        }
        let done = finished.unwrap_or_else(|| panic!("seed {seed}: never finished"));
        let failed: Vec<(u32, u32)> = (0u32..)
            .zip(&plan)
            .filter_map(|(r, &(_, f))| f.map(|f| (r, f)))
            .collect();
        match &done.outcome {
            Outcome::Completed => assert!(failed.is_empty(), "seed {seed}"),
            Outcome::Failed(why) => {
                let mut got: Vec<(u32, u32)> = why.iter().map(|f| (f.rank, f.chunk)).collect();
                got.sort_unstable();
                assert_eq!(got, failed, "seed {seed}");
            }
        }
        let bytes: Vec<u64> = done.bytes.iter().map(ComponentBytes::total).collect();
        assert_eq!(
            bytes, expect_bytes,
            "seed {seed}: every chunk before a rank's last status counted, none after"
        );
        assert_eq!(rx.pending_requests(), 0);
    }
}

#[test]
fn the_receiver_says_why_a_status_cannot_be_taken_and_changes_nothing() {
    let mut rx = Receiver::new();
    rx.register(receiver_registration(), 1).unwrap();
    let refused = |rx: &mut Receiver, s: ChunkStatus, why: &str| {
        let before = rx.progress(REQUEST);
        let e = rx.receive(s).unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
        assert_eq!(
            rx.progress(REQUEST),
            before,
            "a refused status changed nothing"
        );
    };
    let failed = || ChunkResult::Failed {
        reason: "failed".into(),
    };
    refused(
        &mut rx,
        status_of(0, MAX_CHUNKS_AHEAD + 1, sent_bytes(1, false)),
        &format!("more than {MAX_CHUNKS_AHEAD} chunks ahead of chunk 0"),
    );
    assert!(rx
        .receive(status_of(0, 3, sent_bytes(1, true)))
        .unwrap()
        .is_none());
    refused(
        &mut rx,
        status_of(0, 4, sent_bytes(1, false)),
        "status of chunk 4 from prefill rank 0 past its final chunk 3",
    );
    refused(
        &mut rx,
        status_of(0, 2, sent_bytes(1, true)),
        "a second final status (chunk 2) from prefill rank 0, whose final chunk is 3",
    );
    refused(
        &mut rx,
        status_of(0, 5, failed()),
        "status of chunk 5 from prefill rank 0 past its final chunk 3",
    );
    // A failure before the final chunk ends the rank there once the chunks before it came.
    assert!(rx.receive(status_of(0, 2, failed())).unwrap().is_none());
    refused(
        &mut rx,
        status_of(0, 1, failed()),
        "a second failed status (chunk 1) from prefill rank 0, after chunk 2's",
    );
    assert!(rx
        .receive(status_of(0, 1, sent_bytes(1, false)))
        .unwrap()
        .is_none());
    let done = rx
        .receive(status_of(0, 0, sent_bytes(1, false)))
        .unwrap()
        .expect("the rank's failure is its last status once chunks 0 and 1 came");
    match done.outcome {
        Outcome::Failed(why) => assert_eq!((why[0].rank, why[0].chunk), (0, 2)),
        other => panic!("{other:?}"),
    }

    let mut rx = Receiver::new();
    rx.register(receiver_registration(), 1).unwrap();
    assert!(rx
        .receive(status_of(0, 2, sent_bytes(1, false)))
        .unwrap()
        .is_none());
    refused(
        &mut rx,
        status_of(0, 1, sent_bytes(1, true)),
        "final status of chunk 1 from prefill rank 0, after its chunk 2",
    );
}

#[test]
fn the_receiver_refuses_unknown_duplicate_and_out_of_order_statuses() {
    let cpu = CpuStreams::new(false);
    let b = cpu.stream();
    let case = &cases()[1];
    let (decode, space) = decode_pool(b.as_ref(), case, &[], 0);
    let dec: Vec<LocalPage> = (1..=16).map(LocalPage).collect();
    let reg = registration(case, &dec, &decode);
    let mut rx = Receiver::new();
    let err = |r: Result<Option<Finished>>| r.unwrap_err().to_string();
    assert!(err(rx.receive(sent(0, 1, false)))
        .contains("request 42: status of chunk 0 from prefill rank 1: not registered"));
    for ranks in [0, MAX_PREFILL_RANKS + 1] {
        let e = rx.register(reg.clone(), ranks).unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "{ranks} prefill ranks (a request needs 1 to {MAX_PREFILL_RANKS})"
            )),
            "{e}"
        );
    }
    let mut twice = reg.clone();
    twice.pages[1] = twice.pages[0];
    assert!(matches!(
        rx.register(twice.clone(), 2),
        Err(Error::Transfer { request: 42, .. })
    ));
    rx.register(reg.clone(), 2).unwrap();
    assert!(rx
        .register(reg.clone(), 2)
        .unwrap_err()
        .to_string()
        .contains("already registered"));

    // A status ahead of the rank's next chunk is held until the chunks before it arrive.
    assert!(rx.receive(sent(1, 1, false)).unwrap().is_none());
    let e = err(rx.receive(sent(1, 1, false)));
    assert!(
        e.contains("duplicate status of chunk 1 from prefill rank 1 (chunk 0 expected next)"),
        "{e}"
    );
    assert!(rx.receive(sent(0, 10, false)).unwrap().is_none());
    let e = err(rx.receive(sent(0, 10, false)));
    assert!(
        e.contains("duplicate status of chunk 0 from prefill rank 1 (chunk 2 expected next)"),
        "{e}"
    );
    let mut stranger = sent(1, 1, false);
    stranger.rank = 2;
    assert!(err(rx.receive(stranger))
        .contains("status from prefill rank 2, but 2 ranks send the request"));
    assert!(
        rx.receive(sent(2, 4, true)).unwrap().is_none(),
        "rank 0 has not reported"
    );
    let e = err(rx.receive(sent(3, 1, true)));
    assert!(
        e.contains("status of chunk 3 from prefill rank 1 after its last status"),
        "{e}"
    );
    let p = rx.progress(REQUEST).unwrap();
    assert_eq!(
        (p.ranks, p.ranks_done, p.failed),
        (2, 1, false),
        "refused statuses change nothing"
    );

    let mut rank0 = sent(0, 7, true);
    rank0.rank = 0;
    let done = rx.receive(rank0).unwrap().expect("both ranks reported");
    assert!(done.is_completed());
    assert_eq!(
        done.bytes
            .iter()
            .map(ComponentBytes::total)
            .collect::<Vec<_>>(),
        vec![7, 15]
    );
    assert_eq!(rx.pending_requests(), 0);
    assert!(rx.progress(REQUEST).is_none());
    assert!(err(rx.receive(sent(3, 1, true))).contains("not registered"));

    // The prefill side refuses what it does not know, bad registrations, destinations the
    // registration does not describe, and opening twice.
    let pool = DevicePool::allocate(
        b.as_ref(),
        &case.geometry,
        Placement::new(2).unwrap(),
        1,
        20,
    )
    .unwrap();
    let transport = BackendTransport::with_method(cpu.stream(), Method::CopyEngine).unwrap();
    let mut tx = Sender::new(Arc::new(pool), Box::new(transport));
    let e = tx.send(REQUEST, &[], ChunkEnd::Final(0)).unwrap_err();
    assert!(
        e.to_string()
            .contains("request 42: not open on prefill rank 1"),
        "{e}"
    );
    assert!(ChunkStatus::from_error(&e).is_none(), "nothing to report");
    assert!(tx.abort(REQUEST, "why").is_err());
    let e = tx.open(twice, space.clone()).unwrap_err();
    assert!(matches!(e, Error::Transfer { request: 42, .. }), "{e}");
    let (_, smaller) = {
        let small = Arc::new(
            DevicePool::allocate(b.as_ref(), &case.geometry, Placement::unsharded(), 0, 20)
                .unwrap(),
        );
        let space = RemoteSpace::of(small.clone(), case.geometry.clone()).unwrap();
        (small, Arc::new(space))
    };
    let e = tx.open(reg.clone(), smaller).unwrap_err();
    assert!(
        e.to_string().contains(
            "the registration describes a decode pool of 40 pages; the destination holds 20"
        ),
        "{e}"
    );
    assert_eq!(tx.pending_requests(), 0);
    tx.open(reg.clone(), space.clone()).unwrap();
    assert!(tx
        .open(reg, space)
        .unwrap_err()
        .to_string()
        .contains("already open on prefill rank 1"));
    let aborted = tx.abort(REQUEST, "cancelled").unwrap();
    assert_eq!(
        aborted.result,
        ChunkResult::Failed {
            reason: "aborted: cancelled".into()
        }
    );
    assert!(aborted.is_terminal());
    assert_eq!(tx.pending_requests(), 0);
}

// ---------------------------------------------------------------------------------------------
// Executors: what used to be the unit tests of src/transfer/backend_transport.rs.

fn exec_geometry() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2))
}

/// Rank 0 of 2 sends positions 0..40 (logical pages 2..42: it owns the even positions, local
/// pages 1..=20) into decode pages 1..=20 (even positions) and 30..=49 (odd ones), so its 20
/// pages coalesce into one run.
fn exec_setup(b: &dyn Backend) -> (Arc<DevicePool>, Arc<DevicePool>, SendPlan) {
    let g = exec_geometry();
    let src = DevicePool::allocate(b, &g, Placement::new(2).unwrap(), 0, 48).unwrap();
    let dst = DevicePool::allocate(b, &g, Placement::unsharded(), 0, 64).unwrap();
    let src_pages: Vec<LogicalPage> = (0..40).map(|p| LogicalPage(2 + p)).collect();
    let dst_pages: Vec<LocalPage> = (0..40)
        .map(|p| LocalPage(if p % 2 == 0 { 1 + p / 2 } else { 30 + p / 2 }))
        .collect();
    let reg = Registration {
        request: 3,
        layout: PoolLayout::of(&dst),
        prefix_pages: 0,
        pages: dst_pages.clone(),
        state_pages: dst_pages,
    };
    let plan = SendPlan::new(
        &PrefillRank::of(&src),
        &src_pages,
        &reg,
        ChunkRange {
            index: 0,
            start: 0,
            end: 40 * 64,
            last: true,
        },
    )
    .unwrap();
    assert_eq!(plan.kv().runs().len(), 1);
    assert_eq!(plan.kv().owned_pages(), 20);
    (Arc::new(src), Arc::new(dst), plan)
}

#[test]
fn kernel_pieces_tile_each_range_exactly() {
    let piece = KERNEL_PIECE_BYTES;
    let ranges = [
        abi::kvs_range {
            src: 0x1000,
            dst: 0x9000_0000,
            bytes: 2 * piece + 48,
        },
        abi::kvs_range {
            src: 0x5000_0000,
            dst: 0x7000,
            bytes: 0,
        },
        abi::kvs_range {
            src: 0x6000_0000,
            dst: 0x8000,
            bytes: piece,
        },
    ];
    let pieces: Vec<_> = kernel_pieces(&ranges).collect();
    let expect = |src, dst, bytes| abi::kvs_range { src, dst, bytes };
    assert_eq!(
        pieces,
        vec![
            expect(0x1000, 0x9000_0000, piece),
            expect(0x1000 + piece, 0x9000_0000 + piece, piece),
            expect(0x1000 + 2 * piece, 0x9000_0000 + 2 * piece, 48),
            expect(0x6000_0000, 0x8000, piece),
        ]
    );
}

#[test]
fn batches_resolve_offsets_against_layer_bases() {
    let b = CpuBackend::new();
    let (src, dst, plan) = exec_setup(&b);
    let batch = DescriptorBatch::resolve(&plan, src.as_ref(), dst.as_ref()).unwrap();
    assert_eq!(batch.ranges().len(), plan.descriptor_count());
    assert_eq!(batch.bytes(), plan.bytes());
    let summed: u64 = batch.ranges().iter().map(|r| r.bytes).sum();
    assert_eq!(summed, plan.bytes().total());
    for (r, d) in batch.ranges().iter().zip(plan.descriptors()) {
        let src_base = src.layer_bases(d.component).unwrap()[d.layer];
        let dst_base = dst.layer_bases(d.component).unwrap()[d.layer];
        assert_eq!(r.src, src_base + d.src_offset);
        assert_eq!(r.dst, dst_base + d.dst_offset);
        assert_eq!(r.bytes, d.bytes);
    }
    assert_eq!(
        (
            batch.request(),
            batch.rank(),
            batch.chunk(),
            batch.is_last()
        ),
        (3, 0, 0, true)
    );
    assert!(!batch.is_empty());
    assert!(batch
        .to_string()
        .starts_with("request 3 rank 0 chunk 0 final:"));
    // The decode side as a remote destination resolves to the same addresses.
    let remote = RemoteSpace::of(dst.clone(), exec_geometry()).unwrap();
    let via_remote = DescriptorBatch::resolve(&plan, src.as_ref(), &remote).unwrap();
    assert_eq!(via_remote.ranges(), batch.ranges());
}

#[test]
fn batches_and_block_copies_refuse_spaces_the_plan_was_not_made_for() {
    let b = CpuBackend::new();
    let (src, dst, plan) = exec_setup(&b);
    let g = exec_geometry();
    // Both resolutions check the plan against the actual spaces the same way.
    let refuse = |src: &dyn BlockSpace, dst: &dyn BlockSpace| -> Vec<String> {
        vec![
            DescriptorBatch::resolve(&plan, src, dst)
                .unwrap_err()
                .to_string(),
            block_copies(&plan, src, dst).unwrap_err().to_string(),
        ]
    };
    // Fewer pages than the plan addresses.
    let small = DevicePool::allocate(&b, &g, Placement::unsharded(), 0, 8).unwrap();
    for e in refuse(src.as_ref(), &small) {
        assert!(
            e.contains("request 3: the plan moves target latent pages up to page 20, the destination holds 8 pages per layer"),
            "{e}"
        );
    }
    // No draft.
    let other = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2));
    let no_draft = DevicePool::allocate(&b, &other, Placement::unsharded(), 0, 64).unwrap();
    for e in refuse(src.as_ref(), &no_draft) {
        assert!(e.contains("the destination holds no draft latent"), "{e}");
    }
    // More layers.
    let three = CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 3));
    let deeper = DevicePool::allocate(&b, &three, Placement::new(2).unwrap(), 0, 48).unwrap();
    for e in refuse(&deeper, dst.as_ref()) {
        assert!(
            e.contains("the source holds 3 target latent layers, the plan moves 2"),
            "{e}"
        );
    }
    // Staging stores blocks packed like a pool: a plan runs from it if it holds the pages.
    let staging = Staging::new(&b, &g, 21).unwrap();
    assert!(DescriptorBatch::resolve(&plan, &staging, dst.as_ref()).is_ok());
    assert!(block_copies(&plan, &staging, dst.as_ref()).is_ok());
    let staging = Staging::new(&b, &g, 20).unwrap();
    for e in refuse(&staging, dst.as_ref()) {
        assert!(
            e.contains("up to page 20, the source holds 20 pages"),
            "{e}"
        );
    }
    // Every transport method refuses a destination too small, before enqueuing anything.
    let small = Arc::new(small);
    small.fill(&b, POISON).unwrap();
    let small_remote = Arc::new(RemoteSpace::of(small.clone(), g.clone()).unwrap());
    let b: Arc<dyn Backend> = Arc::new(b);
    for method in METHODS {
        let mut t = BackendTransport::with_method(b.clone(), method).unwrap();
        assert_eq!(t.method(), method);
        let e = t.submit(&plan, &src, &small_remote).err().unwrap();
        assert!(
            e.to_string().contains("the destination holds 8 pages"),
            "{e}"
        );
    }
    assert!(small
        .snapshot_sync(b.as_ref())
        .unwrap()
        .iter()
        .all(|&x| x == POISON));
    // A block copy planned between two spaces runs between those two only, on their backend.
    let copies = block_copies(&plan, src.as_ref(), dst.as_ref()).unwrap();
    assert_eq!(
        copies.len(),
        1,
        "one final chunk: its latent KV and indexer state share one page list, so one copy"
    );
    let twin =
        Arc::new(DevicePool::allocate(b.as_ref(), &g, Placement::unsharded(), 0, 64).unwrap());
    let e = BlockCopy::prepare_sync(b.as_ref(), copies[0].clone(), src.clone(), twin, None)
        .unwrap_err();
    assert!(
        e.to_string().contains("copy planned for destination"),
        "{e}"
    );
    let foreign = CpuBackend::new();
    let e = BlockCopy::prepare_sync(&foreign, copies[0].clone(), src.clone(), dst.clone(), None)
        .unwrap_err();
    assert!(matches!(e, Error::ForeignMemory { .. }), "{e}");
}

#[test]
fn a_later_final_chunk_copies_its_kv_and_the_whole_state_separately() {
    // The final chunk of a request sent in two: its latent KV covers pages 20..40, the
    // indexer state all 40, so the block copy cannot share one page list; the bytes must
    // still be exactly what the copy engine moves.
    let b: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let mut rng = common::rng("a_later_final_chunk_copies_its_kv_and_the_whole_state_separately");
    let (src, dst, first) = exec_setup(b.as_ref());
    let storage = src.storage().unwrap();
    b.write_sync(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();
    let src_pages: Vec<LogicalPage> = (0..40).map(|p| LogicalPage(2 + p)).collect();
    let dst_pages: Vec<LocalPage> = (0..40)
        .map(|p| LocalPage(if p % 2 == 0 { 1 + p / 2 } else { 30 + p / 2 }))
        .collect();
    let reg = Registration {
        request: first.request(),
        layout: PoolLayout::of(&dst),
        prefix_pages: 0,
        pages: dst_pages.clone(),
        state_pages: dst_pages,
    };
    let chunk = ChunkRange {
        index: 1,
        start: 20 * 64,
        end: 40 * 64,
        last: true,
    };
    let plan = SendPlan::new(&PrefillRank::of(&src), &src_pages, &reg, chunk).unwrap();
    assert_eq!(plan.kv().owned_pages(), 10);
    assert_eq!(plan.state().owned_pages(), 20);
    let copies = block_copies(&plan, src.as_ref(), dst.as_ref()).unwrap();
    assert_eq!(
        copies.len(),
        2,
        "the chunk's KV pages and the sequence's state pages"
    );
    let remote = Arc::new(RemoteSpace::of(dst.clone(), exec_geometry()).unwrap());
    let mut outs = Vec::new();
    for method in [Method::CopyEngine, Method::Kernel(LAUNCH)] {
        dst.fill(b.as_ref(), POISON).unwrap();
        let mut t = BackendTransport::with_method(b.clone(), method).unwrap();
        t.submit(&plan, &src, &remote).unwrap().wait_sync().unwrap();
        outs.push(dst.snapshot_sync(b.as_ref()).unwrap());
    }
    assert!(outs[0] == outs[1], "kernel and copy engine differ");
    assert!(outs[0].iter().any(|&x| x != POISON));
}

#[test]
fn every_copy_method_copies_the_same_bytes() {
    let b: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let mut rng = common::rng("every_copy_method_copies_the_same_bytes");
    let (src, dst, plan) = exec_setup(b.as_ref());
    let storage = src.storage().unwrap();
    b.write_sync(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();
    let remote = Arc::new(RemoteSpace::of(dst.clone(), exec_geometry()).unwrap());
    let batch = DescriptorBatch::resolve(&plan, src.as_ref(), dst.as_ref()).unwrap();
    // The coalesced latent run (20 pages, 720 KB) is longer than a kernel piece.
    assert!(batch.ranges().iter().any(|r| r.bytes > KERNEL_PIECE_BYTES));
    let mut outs = Vec::new();
    for method in METHODS {
        dst.fill(b.as_ref(), POISON).unwrap();
        let mut t = BackendTransport::with_method(b.clone(), method).unwrap();
        let mut done = t.submit(&plan, &src, &remote).unwrap();
        done.wait_sync().unwrap();
        assert!(done.poll().unwrap());
        outs.push(dst.snapshot_sync(b.as_ref()).unwrap());
    }
    assert!(outs[0] == outs[1], "kernel and copy engine differ");
    assert!(outs[0] == outs[2], "kernel and block copies differ");
    // 20 of 64 pages of every layer landed; the rest stays poisoned.
    let landed = outs[0].iter().filter(|&&x| x != POISON).count();
    assert!(landed > 0 && landed < outs[0].len() / 2, "{landed}");
    // Exactly the owned pages' blocks, at their destinations.
    for d in plan.descriptors() {
        let s = src.layer_bases(d.component).unwrap()[d.layer] + d.src_offset;
        let t = dst.layer_bases(d.component).unwrap()[d.layer] + d.dst_offset;
        let (sb, tb) = (src.storage().unwrap(), dst.storage().unwrap());
        let want = b
            .read_sync(sb, (s - sb.addr()) as usize, d.bytes as usize)
            .unwrap();
        let got = b
            .read_sync(tb, (t - tb.addr()) as usize, d.bytes as usize)
            .unwrap();
        assert!(want == got, "{d:?}");
    }
    // The default method is the block copy.
    let t = BackendTransport::new(b.clone());
    assert!(matches!(t.method(), Method::Kernel(_)), "{t:?}");
}

#[test]
fn a_transport_without_device_timing_moves_the_same_bytes_and_still_counts_its_chunks() {
    // `set_device_timing(false)` records untimed events only: the bytes, the completion and the
    // stats' chunk count and transfer time (from the host clock) must be as with timing on.
    let mut rng = common::rng(
        "a_transport_without_device_timing_moves_the_same_bytes_and_still_counts_its_chunks",
    );
    let b: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let (src, dst, plan) = exec_setup(b.as_ref());
    let storage = src.storage().unwrap();
    b.write_sync(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();
    let remote = Arc::new(RemoteSpace::of(dst.clone(), exec_geometry()).unwrap());
    for method in METHODS {
        let mut images = Vec::new();
        for timing in [true, false] {
            dst.fill(b.as_ref(), POISON).unwrap();
            let mut t = BackendTransport::with_method(b.clone(), method).unwrap();
            t.set_device_timing(timing);
            let mut done = t.submit(&plan, &src, &remote).unwrap();
            done.wait_sync().unwrap();
            assert!(done.poll().unwrap(), "{method}: landed after wait_sync");
            let stats = t.stats().unwrap().snapshot();
            assert_eq!(stats.chunks, 1, "{method}, timing {timing}");
            images.push(dst.snapshot_sync(b.as_ref()).unwrap());
        }
        assert!(
            images[0] == images[1],
            "{method}: timing off moved other bytes than timing on"
        );
        assert!(
            images[1].iter().any(|&x| x != POISON),
            "{method}: nothing moved"
        );
    }
}
