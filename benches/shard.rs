//! Host-side costs of sharding: the rotated-owner allocator's operations and the CPU reference
//! of owner-local resolution. Allocator operations run on a clone of a prepared allocator made
//! outside the timed region, so each timed call sees the same state.
//!
//! Run with `cargo bench --bench shard`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use kvshard::shard::{
    resolve_owned, AllocRequest, ChainStart, Placement, ResolveMode, ShardAllocator,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Physical pages per rank: room for every benchmark's pages with most of the pool still free,
/// as in a serving pool.
const PAGES_PER_RANK: u64 = 16_384;

fn allocator(shard: u32) -> ShardAllocator {
    ShardAllocator::new(Placement::new(shard).unwrap(), PAGES_PER_RANK).unwrap()
}

fn new_chain(pages: usize) -> AllocRequest {
    AllocRequest {
        chain: ChainStart::New,
        pages,
    }
}

fn allocator_ops(c: &mut Criterion) {
    let mut group = c.benchmark_group("allocator");
    for shard in [2u32, 8] {
        let fresh = allocator(shard);

        let batch = vec![new_chain(16); 64];
        group.throughput(Throughput::Elements(64 * 16));
        group.bench_with_input(
            BenchmarkId::new("alloc_batch_64x16", shard),
            &batch,
            |b, batch| {
                b.iter_batched_ref(
                    || fresh.clone(),
                    |a| black_box(a.alloc_batch(batch).unwrap()),
                    BatchSize::LargeInput,
                )
            },
        );

        group.throughput(Throughput::Elements(2048));
        group.bench_function(BenchmarkId::new("alloc_chain_2k", shard), |b| {
            b.iter_batched_ref(
                || fresh.clone(),
                |a| black_box(a.alloc(new_chain(2048)).unwrap()),
                BatchSize::LargeInput,
            )
        });

        let mut used = fresh.clone();
        let chain = used.alloc(new_chain(2048)).unwrap().pages;
        group.bench_with_input(BenchmarkId::new("free_2k", shard), &chain, |b, chain| {
            b.iter_batched_ref(
                || used.clone(),
                |a| a.free(black_box(chain)).unwrap(),
                BatchSize::LargeInput,
            )
        });
        group.bench_with_input(
            BenchmarkId::new("alloc_matching_2k", shard),
            &chain,
            |b, chain| {
                b.iter_batched_ref(
                    || used.clone(),
                    |a| black_box(a.alloc_matching(chain).unwrap()),
                    BatchSize::LargeInput,
                )
            },
        );
    }
    group.finish();
}

fn resolve_reference(c: &mut Criterion) {
    let mut group = c.benchmark_group("resolve_owned");
    let mut rng = StdRng::seed_from_u64(7);
    let placement = Placement::new(8).unwrap();
    for n in [1usize << 10, 1 << 16, 1 << 20] {
        // ~10% padding, the rest spread over 2^30 logical slots.
        let entries: Vec<i64> = (0..n)
            .map(|_| match rng.random_range(0..10) {
                0 => -1,
                _ => rng.random_range(0..1 << 30),
            })
            .collect();
        group.throughput(Throughput::Elements(n as u64));
        for mode in [ResolveMode::Tokens, ResolveMode::Pages] {
            group.bench_with_input(
                BenchmarkId::new(format!("{mode:?}"), n),
                &entries,
                |b, entries| {
                    b.iter(|| {
                        resolve_owned(placement, 3, mode, black_box(entries), 1 << 30).unwrap()
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, allocator_ops, resolve_reference);
criterion_main!(benches);
