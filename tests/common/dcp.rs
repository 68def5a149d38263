//! Decode context parallelism's test cases (tests/dcp.rs, the DCP cases of tests/nixl.rs): a
//! request prefilled by N page-sharded ranks (rotated start owner, pages shuffled or in order)
//! for the M ranks of a decode server sharded by token, I tokens at a time; the reference every
//! decode rank must equal (`relayout`, a plain CPU function written from the layout's definition
//! alone), and the bytes each prefill rank owes each decode rank.
// Each test binary uses only part of it.
#![allow(dead_code)]

use std::sync::Arc;

use super::synth::{self, POISON};
use kvshard::backend::{Backend, Launch};
use kvshard::copy::{BlockCopy, BlockCopyPlan, BlockSpace, PageSelection, RemoteSpace};
use kvshard::geometry::{
    CacheGeometry, ComponentLayout, LatentLayout, PoolGeometry, INDEXER_HEAD_DIM,
    INDEXER_ROW_BYTES, INDEXER_SCALES_OFFSET, PAGE_SIZE,
};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::pool::DevicePool;
use kvshard::shard::{DecodeLayout, Placement};
use kvshard::transfer::{
    ChunkEnd, ComponentBytes, DecodeRank, DecodeRegistration, Finished, PoolLayout,
};
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::Rng;

pub const LAUNCH: Launch = Launch {
    ctas: 8,
    threads: 256,
};
pub const REQUEST: u64 = 37;
pub const PAGE: u64 = PAGE_SIZE as u64;

/// One request to send.
#[derive(Debug, Clone)]
pub struct Case {
    /// Prefill ranks.
    pub n: u32,
    pub layout: DecodeLayout,
    pub geometry: CacheGeometry,
    /// Prefill chunk ends in tokens; the last one is the sequence length.
    pub chunk_ends: Vec<usize>,
    /// Sequence pages the decode ranks already hold.
    pub prefix_pages: usize,
    /// Pages handed out in order on both sides rather than shuffled.
    pub contiguous: bool,
    /// Whether each decode rank registers other pages for the indexer state than for the
    /// latent rows.
    pub separate_state: bool,
}

impl Case {
    pub fn tokens(&self) -> usize {
        *self.chunk_ends.last().unwrap()
    }

    pub fn pages(&self) -> usize {
        self.tokens().div_ceil(PAGE_SIZE)
    }

    pub fn end(&self, i: usize) -> ChunkEnd {
        let tokens = self.chunk_ends[i];
        if i + 1 == self.chunk_ends.len() {
            ChunkEnd::Final(tokens)
        } else {
            ChunkEnd::Partial(tokens)
        }
    }
}

pub fn geometries() -> Vec<CacheGeometry> {
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
pub fn random_case(rng: &mut StdRng) -> Case {
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
pub fn prefill_pages(
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
pub fn block_offset(
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
pub fn relayout(
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
pub fn owed(case: &Case, src: &[LogicalPage], r: u32, d: u32) -> ComponentBytes {
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
pub enum Mode {
    /// Every rank enqueues a chunk, then every rank's chunk is waited for.
    Lockstep,
    /// Every rank enqueues every chunk before the first wait.
    Pipelined,
    /// Pipelined, and the decode ranks' pools are read on another stream before any chunk is
    /// waited for: the reads must follow the chunks by themselves (the pools' usages).
    ReadFirst,
}

/// One prefill rank: its stream and its pool.
pub type Rank = (Arc<dyn Backend>, Arc<DevicePool>);

/// One decode rank's pool: the backend that reads and writes it as its own, the pool, the
/// destination the prefill ranks send into, and whatever keeps the memory shared.
pub struct DecodeSide {
    pub owner: Arc<dyn Backend>,
    pub pool: Arc<DevicePool>,
    pub space: Arc<RemoteSpace>,
    pub _keep: Option<Box<dyn std::any::Any>>,
}

/// Makes a decode rank's pool of a geometry and a page count.
pub type DecodeMaker<'a> = &'a dyn Fn(&CacheGeometry, u64) -> DecodeSide;

/// A pool on `base`, its destination made in this process.
pub fn local_decode(base: &Arc<dyn Backend>) -> impl Fn(&CacheGeometry, u64) -> DecodeSide + '_ {
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
pub struct Setup {
    pub reference: Arc<DevicePool>,
    pub reference_pages: u64,
    pub src: Vec<LogicalPage>,
    pub ranks: Vec<Rank>,
    pub decode: Vec<DecodeSide>,
    pub spaces: Vec<Arc<RemoteSpace>>,
    pub decode_pages: u64,
    pub reg: DecodeRegistration,
    pub before: Vec<Vec<u8>>,
}

pub fn setup(
    base: &Arc<dyn Backend>,
    stream: &dyn Fn() -> Arc<dyn Backend>,
    case: &Case,
    rng: &mut StdRng,
) -> Setup {
    setup_with(base, stream, &local_decode(base), case, rng)
}

pub fn setup_with(
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

/// Where a decode rank's snapshot first differs from the expectation, named.
pub fn difference(case: &Case, pages: u64, got: &[u8], want: &[u8]) -> Option<String> {
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

/// Checks every decode rank of `s` once `case` was sent: one request finished there, completed,
/// its pool (read on `read`) byte-identical to the reference (read on `base`) re-laid out, with
/// the bytes each prefill rank owed it.
pub fn check_decode_ranks(
    case: &Case,
    s: &Setup,
    base: &dyn Backend,
    read: &dyn Backend,
    finished: &[Vec<Finished>],
) {
    let reference = s.reference.snapshot_sync(base).unwrap();
    let want = relayout(
        case,
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
        let got = side.pool.snapshot_sync(read).unwrap();
        if let Some(at) = difference(case, s.decode_pages, &got, &want[d]) {
            panic!("{case:?}: decode rank {d} differs from the relaid reference at {at}");
        }
        // Each prefill rank's bytes for this decode rank, as it reported them.
        let owed: Vec<_> = (0..case.n)
            .map(|r| owed(case, &s.src, r, d as u32))
            .collect();
        assert_eq!(f.bytes, owed, "{case:?}: decode rank {d}");
    }
}
