//! P/D send planning on the CPU: `SendPlan::new` for a whole request sent as one final chunk
//! (its latent KV and the indexer state of every position: the most one call plans), 1K to 128K
//! tokens, N = 2 and 8, 61-layer target + draft with 576-byte rows; and the resolution of the
//! plan into absolute ranges (`DescriptorBatch::resolve`) against the sending rank's pool and
//! the decode pool as a transport sees it (a `RemoteSpace`). Descriptor counts before and after
//! coalescing are printed once, to stderr.
//!
//! Pages are handed out the way a fresh server does: every owner's free list in order on the
//! prefill side, consecutive pages on the decode side. "fragmented" shuffles both.
//!
//! The resolution runs against real pools of the CPU reference backend, sized for the request:
//! resolving computes addresses and never touches the bytes, and the backend's allocations are
//! zeroed lazily, so the pools cost address space, not memory.
//!
//! `cargo bench --bench transfer`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvshard::backend::cpu::CpuBackend;
use kvshard::copy::RemoteSpace;
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry, PAGE_SIZE};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::transfer::{
    ChunkRange, DescriptorBatch, PoolLayout, PrefillRank, Registration, SendPlan,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

const TOKENS: [usize; 5] = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 17];
const SHARDS: [u32; 2] = [2, 8];

fn geometry() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 61))
}

/// Rank 0 of `n` and the decode registration of a `tokens`-token request: the prefill's page
/// of every position (owner `j % n`, next page of its free list), the decode's page of every
/// position, both in order or shuffled.
struct Request {
    source: PrefillRank,
    src_pages: Vec<LogicalPage>,
    registration: Registration,
    chunk: ChunkRange,
}

fn request(tokens: usize, n: u32, fragmented: bool) -> Request {
    let mut rng = StdRng::seed_from_u64(7);
    let pages = tokens.div_ceil(PAGE_SIZE);
    // Shuffled free lists hold twice what the request needs, so that they scatter it; in-order
    // ones exactly what it needs (the plan is the same either way).
    let spread = if fragmented { 2 } else { 1 };
    let rank_pages = spread * pages.div_ceil(n as usize) as u64 + 1;
    let free: Vec<Vec<u64>> = (0..n)
        .map(|_| {
            let mut v: Vec<u64> = (1..rank_pages).collect();
            if fragmented {
                v.shuffle(&mut rng);
            }
            v
        })
        .collect();
    let src_pages = (0..pages)
        .map(|j| {
            let owner = j as u32 % n;
            LogicalPage(free[owner as usize][j / n as usize] * u64::from(n) + u64::from(owner))
        })
        .collect();
    let decode_pages = spread * pages as u64 + 1;
    let mut dst: Vec<LocalPage> = (1..decode_pages).map(LocalPage).collect();
    if fragmented {
        dst.shuffle(&mut rng);
    }
    dst.truncate(pages);
    Request {
        source: PrefillRank {
            placement: Placement::new(n).expect("n >= 1"),
            rank: 0,
            layout: PoolLayout::packed(geometry(), rank_pages),
        },
        src_pages,
        registration: Registration {
            request: 1,
            layout: PoolLayout::packed(geometry(), decode_pages),
            prefix_pages: 0,
            pages: dst.clone(),
            state_pages: dst,
        },
        chunk: ChunkRange {
            index: 0,
            start: 0,
            end: tokens,
            last: true,
        },
    }
}

impl Request {
    fn plan(&self) -> SendPlan {
        SendPlan::new(
            &self.source,
            &self.src_pages,
            &self.registration,
            self.chunk,
        )
        .expect("a valid request")
    }
}

/// The two sides of a request in memory: rank 0's pool and the decode pool, as the transport
/// reaches it, both of the layouts the request's plan was made for, and the backend whose arena
/// holds them.
struct Sides {
    source: DevicePool,
    decode: RemoteSpace,
    _backend: CpuBackend,
}

impl Sides {
    fn new(req: &Request) -> Self {
        let backend = CpuBackend::new();
        let source = &req.source;
        let source = DevicePool::allocate(
            &backend,
            &source.layout.geometry,
            source.placement,
            source.rank,
            source.layout.pages,
        )
        .expect("the prefill rank's pool");
        let layout = &req.registration.layout;
        let decode = DevicePool::allocate(
            &backend,
            &layout.geometry,
            Placement::unsharded(),
            0,
            layout.pages,
        )
        .expect("the decode pool");
        let decode =
            RemoteSpace::of(Arc::new(decode), layout.geometry.clone()).expect("the decode side");
        Self {
            source,
            decode,
            _backend: backend,
        }
    }
}

fn print_counts() {
    eprintln!(
        "descriptors of rank 0 for a whole request (61 + 1 latent layers, 61 + 1 indexer layers):"
    );
    eprintln!(
        "{:>8} {:>3} {:>11} {:>12} {:>12} {:>10}",
        "tokens", "N", "allocation", "uncoalesced", "coalesced", "MB moved"
    );
    for &tokens in &TOKENS {
        for n in [1, 2, 8] {
            for fragmented in [false, true] {
                let plan = request(tokens, n, fragmented).plan();
                eprintln!(
                    "{tokens:>8} {n:>3} {:>11} {:>12} {:>12} {:>10.1}",
                    if fragmented { "fragmented" } else { "fresh" },
                    plan.uncoalesced_count(),
                    plan.descriptor_count(),
                    plan.bytes().total() as f64 / 1e6
                );
            }
        }
    }
}

fn planning(c: &mut Criterion) {
    print_counts();
    let mut group = c.benchmark_group("plan");
    for n in SHARDS {
        for &tokens in &TOKENS {
            let req = request(tokens, n, false);
            group.throughput(Throughput::Elements(tokens as u64));
            group.bench_with_input(BenchmarkId::new(format!("N{n}"), tokens), &req, |b, req| {
                b.iter(|| {
                    black_box(
                        SendPlan::new(
                            black_box(&req.source),
                            black_box(&req.src_pages),
                            black_box(&req.registration),
                            req.chunk,
                        )
                        .expect("a valid request"),
                    )
                })
            });
        }
    }
    group.finish();

    let mut group = c.benchmark_group("resolve");
    for n in SHARDS {
        for &tokens in &TOKENS {
            let req = request(tokens, n, false);
            let plan = req.plan();
            let sides = Sides::new(&req);
            group.throughput(Throughput::Elements(plan.descriptor_count() as u64));
            group.bench_with_input(
                BenchmarkId::new(format!("N{n}"), tokens),
                &plan,
                |b, plan| {
                    b.iter(|| {
                        black_box(
                            DescriptorBatch::resolve(black_box(plan), &sides.source, &sides.decode)
                                .expect("resolves"),
                        )
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, planning);
criterion_main!(benches);
