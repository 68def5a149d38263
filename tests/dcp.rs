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

use common::synth::{self, POISON};
use kvshard::abi;
use kvshard::backend::{Backend, Launch, MemoryKind};
use kvshard::copy::{
    BlockCopy, BlockCopyPlan, BlockSpace, DecodeScatterPlan, Method, PageSelection, RemoteSpace,
    ScatterRank, ScatterSection,
};
use kvshard::geometry::{
    CacheGeometry, Component, ComponentLayout, LatentLayout, PoolGeometry, INDEXER_HEAD_DIM,
    INDEXER_ROW_BYTES, INDEXER_SCALES_OFFSET, PAGE_SIZE,
};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::pool::DevicePool;
use kvshard::shard::{DecodeLayout, Placement};
use kvshard::transfer::{
    BackendTransport, ChunkEnd, ChunkRange, ChunkResult, ChunkStatus, Completion, ComponentBytes,
    DecodePlan, DecodeRank, DecodeRegistration, Finished, PendingChunk, PoolLayout, PrefillRank,
    Receiver, SendPlan, Sender, Transport,
};
use kvshard::Error;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

const LAUNCH: Launch = Launch {
    ctas: 8,
    threads: 256,
};
const REQUEST: u64 = 37;
const PAGE: u64 = PAGE_SIZE as u64;

/// One request to send.
#[derive(Debug, Clone)]
struct Case {
    /// Prefill ranks.
    n: u32,
    layout: DecodeLayout,
    geometry: CacheGeometry,
    /// Prefill chunk ends in tokens; the last one is the sequence length.
    chunk_ends: Vec<usize>,
    /// Sequence pages the decode ranks already hold.
    prefix_pages: usize,
    /// Pages handed out in order on both sides rather than shuffled.
    contiguous: bool,
    /// Whether each decode rank registers other pages for the indexer state than for the
    /// latent rows.
    separate_state: bool,
}

impl Case {
    fn tokens(&self) -> usize {
        *self.chunk_ends.last().unwrap()
    }

    fn pages(&self) -> usize {
        self.tokens().div_ceil(PAGE_SIZE)
    }

    fn end(&self, i: usize) -> ChunkEnd {
        let tokens = self.chunk_ends[i];
        if i + 1 == self.chunk_ends.len() {
            ChunkEnd::Final(tokens)
        } else {
            ChunkEnd::Partial(tokens)
        }
    }
}

fn geometries() -> Vec<CacheGeometry> {
    vec![
        // The draft, and a shared-indexer layer (no indexer buffer).
        CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![true, false, true],
        )),
        CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Scaled, 2)),
        CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Bf16, 1)),
        // No indexer at all: no state section.
        CacheGeometry::target_only(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![false, false],
        )),
    ]
}

/// A random case: N, M, I, the geometry, the chunking (ends inside pages or on them), the
/// decode's cached prefix, page order.
fn random_case(rng: &mut StdRng) -> Case {
    let n = *[1u32, 2, 3, 4, 8].choose(rng).unwrap();
    let m = *[1u32, 2, 3, 4, 5, 8].choose(rng).unwrap();
    let i = *[1u32, 1, 2, 3, 16, 48, 64, 64, 128, 100]
        .choose(rng)
        .unwrap();
    let tokens = rng.random_range(1..900usize);
    let prefix_pages = if rng.random_bool(0.3) {
        rng.random_range(0..=(tokens - 1) / PAGE_SIZE)
    } else {
        0
    };
    let mut chunk_ends: Vec<usize> = (0..rng.random_range(0..4))
        .map(|_| rng.random_range(prefix_pages * PAGE_SIZE..=tokens))
        .collect();
    chunk_ends.push(tokens);
    chunk_ends.sort_unstable();
    Case {
        n,
        layout: DecodeLayout::new(m, i).unwrap(),
        geometry: geometries().choose(rng).unwrap().clone(),
        chunk_ends,
        prefix_pages,
        contiguous: rng.random_bool(0.3),
        separate_state: rng.random_bool(0.5),
    }
}

/// The logical page of every position on `n` ranks of `rank_pages` pages (docs/design.md,
/// "Ownership"): position j is owned by `(start + j) % n`, a random start owner.
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

/// The decode ranks' pools as they must be after the request: `before` with every token's rows
/// copied from the unsharded `reference` (sequence page `P` at its page `src[P]`) to where the
/// layout puts it, written from the definition: token `t` on rank `(t / I) % M` as local token
/// `k = (t / (I M)) I + t % I`, row `k % 64` of the rank's `(k / 64)`-th page; a latent row
/// for every token after the cached prefix, an indexer key and scale for every token.
fn relayout(
    case: &Case,
    reference: &[u8],
    reference_pages: u64,
    src: &[LogicalPage],
    reg: &DecodeRegistration,
    decode_pages: u64,
    before: &[Vec<u8>],
) -> Vec<Vec<u8>> {
    let components = case.geometry.components();
    let (i, m) = (
        u64::from(case.layout.interleave()),
        u64::from(case.layout.ranks()),
    );
    let mut out = before.to_vec();
    for t in 0..case.tokens() as u64 {
        let rank = ((t / i) % m) as usize;
        let k = (t / (i * m)) * i + t % i;
        let (page, o) = (src[(t / PAGE) as usize].0, (t % PAGE) as usize);
        let row = (k % PAGE) as usize;
        for (c, comp) in components.iter().enumerate() {
            let indexer = comp.component.is_indexer();
            if !indexer && t < (case.prefix_pages * PAGE_SIZE) as u64 {
                continue;
            }
            let pages = if indexer {
                &reg.ranks[rank].state_pages
            } else {
                &reg.ranks[rank].pages
            };
            let dst_page = pages[(k / PAGE) as usize].0;
            for layer in 0..comp.layers() {
                let from = block_offset(&components, reference_pages, c, layer, page);
                let to = block_offset(&components, decode_pages, c, layer, dst_page);
                let pieces: Vec<(usize, usize, usize)> = if indexer {
                    let key = INDEXER_HEAD_DIM;
                    let scales = INDEXER_SCALES_OFFSET;
                    vec![
                        (o * key, row * key, key),
                        (scales + 4 * o, scales + 4 * row, 4),
                    ]
                } else {
                    let r = comp.row_bytes;
                    vec![(o * r, row * r, r)]
                };
                for (s, d, len) in pieces {
                    out[rank][to + d..to + d + len]
                        .copy_from_slice(&reference[from + s..from + s + len]);
                }
            }
        }
    }
    out
}

/// Bytes that must reach decode rank `d` from prefill rank `r` (of the case's N).
fn owed(case: &Case, src: &[LogicalPage], r: u32, d: u32) -> ComponentBytes {
    let mut out = ComponentBytes::default();
    let n = u64::from(case.n);
    for t in 0..case.tokens() as u64 {
        if case.layout.place(t).rank != d || src[(t / PAGE) as usize].0 % n != u64::from(r) {
            continue;
        }
        for comp in case.geometry.components() {
            let indexer = comp.component.is_indexer();
            if !indexer && t < (case.prefix_pages * PAGE_SIZE) as u64 {
                continue;
            }
            let row = if indexer {
                INDEXER_ROW_BYTES
            } else {
                comp.row_bytes
            };
            out.add(comp.component, (row * comp.layers()) as u64);
        }
    }
    out
}

/// How the chunks of a request are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Every rank enqueues a chunk, then every rank's chunk is waited for.
    Lockstep,
    /// Every rank enqueues every chunk before the first wait.
    Pipelined,
    /// Pipelined, and the decode ranks' pools are read on another stream before any chunk is
    /// waited for: the reads must follow the chunks by themselves (the pools' usages).
    ReadFirst,
}

/// One prefill rank: its stream and its pool.
type Rank = (Arc<dyn Backend>, Arc<DevicePool>);

/// One decode rank's pool: the backend that reads and writes it as its own, the pool, the
/// destination the prefill ranks send into, and whatever keeps the memory shared.
struct DecodeSide {
    owner: Arc<dyn Backend>,
    pool: Arc<DevicePool>,
    space: Arc<RemoteSpace>,
    _keep: Option<Box<dyn std::any::Any>>,
}

/// Makes a decode rank's pool of a geometry and a page count.
type DecodeMaker<'a> = &'a dyn Fn(&CacheGeometry, u64) -> DecodeSide;

/// A pool on `base`, its destination made in this process.
fn local_decode(base: &Arc<dyn Backend>) -> impl Fn(&CacheGeometry, u64) -> DecodeSide + '_ {
    move |g, pages| {
        let pool = Arc::new(
            DevicePool::allocate(base.as_ref(), g, Placement::unsharded(), 0, pages).unwrap(),
        );
        DecodeSide {
            owner: base.clone(),
            space: Arc::new(RemoteSpace::of(pool.clone(), g.clone()).unwrap()),
            pool,
            _keep: None,
        }
    }
}

/// A case made ready to send: the reference, the prefill ranks holding their pages of it, the
/// decode ranks' pools (poison, but random bytes in every page they registered) and their
/// registration.
struct Setup {
    reference: Arc<DevicePool>,
    reference_pages: u64,
    src: Vec<LogicalPage>,
    ranks: Vec<Rank>,
    decode: Vec<DecodeSide>,
    spaces: Vec<Arc<RemoteSpace>>,
    decode_pages: u64,
    reg: DecodeRegistration,
    before: Vec<Vec<u8>>,
}

fn setup(
    base: &Arc<dyn Backend>,
    stream: &dyn Fn() -> Arc<dyn Backend>,
    case: &Case,
    rng: &mut StdRng,
) -> Setup {
    setup_with(base, stream, &local_decode(base), case, rng)
}

fn setup_with(
    base: &Arc<dyn Backend>,
    stream: &dyn Fn() -> Arc<dyn Backend>,
    make_decode: DecodeMaker,
    case: &Case,
    rng: &mut StdRng,
) -> Setup {
    let g = &case.geometry;
    let n = case.n;
    let placement = Placement::new(n).unwrap();
    let per_rank = case.pages().div_ceil(n as usize) as u64 + 3;
    let src = prefill_pages(rng, n, per_rank, case.pages(), case.contiguous);
    let reference_pages = placement.logical_pages(per_rank).unwrap();
    let reference = Arc::new(
        DevicePool::allocate(base.as_ref(), g, Placement::unsharded(), 0, reference_pages).unwrap(),
    );
    let storage = reference.storage().unwrap();
    base.write_sync(storage, 0, &synth::bytes(rng, storage.len()))
        .unwrap();
    // Decode ranks: each registers its share's pages, distinct, in order or shuffled, and
    // (with `separate_state`) other pages for the indexer state.
    let layout = case.layout;
    let tokens = case.tokens() as u64;
    let most = (0..layout.ranks())
        .map(|d| layout.pages_on(d, tokens))
        .max()
        .unwrap();
    let decode_pages = 2 * most + 3;
    let has_indexer = g.components().iter().any(|c| c.component.is_indexer());
    let mut decode = Vec::new();
    let mut spaces = Vec::new();
    let mut before = Vec::new();
    let mut dranks = Vec::new();
    for d in 0..layout.ranks() {
        let side = make_decode(g, decode_pages);
        let (owner, pool) = (&side.owner, &side.pool);
        pool.fill(owner.as_ref(), POISON).unwrap();
        let mut free: Vec<u64> = (1..decode_pages).collect();
        if !case.contiguous {
            free.shuffle(rng);
        }
        let need = layout.pages_on(d, tokens) as usize;
        let pages: Vec<LocalPage> = free[..need].iter().copied().map(LocalPage).collect();
        let state_pages: Vec<LocalPage> = if !has_indexer {
            Vec::new()
        } else if case.separate_state {
            free[need..2 * need]
                .iter()
                .copied()
                .map(LocalPage)
                .collect()
        } else {
            pages.clone()
        };
        // Random bytes in every registered page: rows the request does not write (the cached
        // prefix's, rows past the end) must keep them.
        let storage = pool.storage().unwrap();
        for comp in pool.components() {
            let list = if comp.component.is_indexer() {
                &state_pages
            } else {
                &pages
            };
            for layer in 0..comp.layers() {
                for p in list {
                    let at = pool
                        .block_addr(comp.component, kvshard::index::StoredLayer(layer), *p)
                        .unwrap();
                    owner
                        .write_sync(
                            storage,
                            (at - storage.addr()) as usize,
                            &synth::bytes(rng, comp.block_bytes),
                        )
                        .unwrap();
                }
            }
        }
        owner.synchronize().unwrap();
        before.push(pool.snapshot_sync(owner.as_ref()).unwrap());
        spaces.push(side.space.clone());
        dranks.push(DecodeRank {
            layout: PoolLayout::of(pool),
            pages,
            state_pages,
        });
        decode.push(side);
    }
    // Prefill ranks: garbage everywhere, then the reference bytes at their owned pages, copied
    // on `base` last, with no wait after: each rank's sends (on its own stream) must follow the
    // copies by themselves (the pools' usages).
    let ranks: Vec<Rank> = (0..n)
        .map(|r| {
            let pool =
                Arc::new(DevicePool::allocate(base.as_ref(), g, placement, r, per_rank).unwrap());
            let storage = pool.storage().unwrap();
            base.write_sync(storage, 0, &synth::bytes(rng, storage.len()))
                .unwrap();
            (stream(), pool)
        })
        .collect();
    let local: Vec<LocalPage> = src.iter().map(|p| LocalPage(p.0)).collect();
    for (r, (_, pool)) in (0..n).zip(&ranks) {
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
            BlockCopy::prepare(base.as_ref(), plan, reference.clone(), pool.clone(), None).unwrap();
        copy.run(base.as_ref(), LAUNCH).unwrap();
        // Dropped with its launch queued: its tables stay until the launch has run.
        drop(copy);
    }
    let reg = DecodeRegistration {
        request: REQUEST,
        layout,
        tokens: case.tokens(),
        prefix_pages: case.prefix_pages,
        ranks: dranks,
    };
    reg.validate().unwrap();
    Setup {
        reference,
        reference_pages,
        src,
        ranks,
        decode,
        spaces,
        decode_pages,
        reg,
        before,
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
) -> (Vec<Finished>, Option<Vec<Vec<u8>>>) {
    let n = case.n;
    let m = case.layout.ranks() as usize;
    let mut senders: Vec<Sender> = s
        .ranks
        .iter()
        .map(|(b, pool)| {
            let transport =
                BackendTransport::with_method(b.clone(), Method::Kernel(LAUNCH)).unwrap();
            Sender::new(pool.clone(), Box::new(transport))
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

/// Where a decode rank's snapshot first differs from the expectation, named.
fn difference(case: &Case, pages: u64, got: &[u8], want: &[u8]) -> Option<String> {
    let at = got.iter().zip(want).position(|(a, b)| a != b)?;
    let components = case.geometry.components();
    for (c, comp) in components.iter().enumerate() {
        for layer in 0..comp.layers() {
            for page in 0..pages {
                let start = block_offset(&components, pages, c, layer, page);
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

/// Runs `case`, checks every decode rank against the relayout and the bytes each reports,
/// and returns the decode ranks' snapshots.
fn run_case(
    base: &Arc<dyn Backend>,
    stream: &dyn Fn() -> Arc<dyn Backend>,
    case: &Case,
    mode: Mode,
    seed: u64,
) -> Vec<Vec<u8>> {
    run_case_with(base, stream, &local_decode(base), case, mode, seed)
}

/// [`run_case`] into decode pools `make_decode` makes.
fn run_case_with(
    base: &Arc<dyn Backend>,
    stream: &dyn Fn() -> Arc<dyn Backend>,
    make_decode: DecodeMaker,
    case: &Case,
    mode: Mode,
    seed: u64,
) -> Vec<Vec<u8>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let s = setup_with(base, stream, make_decode, case, &mut rng);
    let read = || {
        s.decode
            .iter()
            .map(|d| d.pool.snapshot_sync(d.owner.as_ref()).unwrap())
            .collect()
    };
    let (finished, early) = send(&s, case, &mut rng, mode, &read);
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
    let (finished, _) = send(&s, &case, &mut rng, Mode::Lockstep, &Vec::new);
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
            run_case_with(&base, &stream, &import, &case, mode, seed);
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
        run_case_with(&base, &stream, &import, &case, Mode::Lockstep, seed);
    }
}
