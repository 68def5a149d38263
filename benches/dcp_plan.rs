//! P/D into a decode server sharded by token, host side on the CPU: what a prefill rank's
//! `Sender` does for every chunk before its launch. `DecodePlan::new` plans a rank's chunk
//! (the registration validated too, which a sender does once per request) and
//! `DecodePlan::scatter` checks it against the rank's pool and every decode rank's destination
//! and lays out the kernel's tables (what `Transport::submit_decode` builds before it uploads
//! them). DeepSeek-V3.2 (61 + 1 layers, latent and indexer), a whole request as one final
//! chunk, a fresh prefill group (position `j` at owner `j % N`'s next page) and decode ranks
//! holding their share from page 1, as the GPU benchmark's `dcp` section sets them up.
//!
//! The pools are the CPU backend's: planning computes addresses and never touches the bytes.
//!
//! `cargo bench --bench dcp_plan`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvshard::backend::cpu::CpuBackend;
use kvshard::copy::{BlockSpace, RemoteSpace};
use kvshard::geometry::{CacheGeometry, LatentLayout, Model, PAGE_SIZE};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::pool::DevicePool;
use kvshard::shard::{DecodeLayout, Placement};
use kvshard::transfer::{
    ChunkRange, DecodePlan, DecodeRank, DecodeRegistration, PoolLayout, PrefillRank,
};

/// (pages, N, M, I): the GPU benchmark's quick matrix at 512 pages, and its longest request.
const CASES: [(u64, u32, u32, u32); 10] = [
    (512, 2, 2, 1),
    (512, 2, 2, 64),
    (512, 2, 4, 1),
    (512, 2, 4, 64),
    (512, 4, 2, 1),
    (512, 4, 2, 64),
    (512, 4, 4, 1),
    (512, 4, 4, 64),
    (4096, 4, 4, 1),
    (4096, 4, 4, 64),
];

/// Prefill rank 0 of a case, its request and destinations.
struct Case {
    source: PrefillRank,
    pool: DevicePool,
    src_pages: Vec<LogicalPage>,
    registration: DecodeRegistration,
    dsts: Vec<RemoteSpace>,
    chunk: ChunkRange,
    _backend: CpuBackend,
}

impl Case {
    fn new(g: &CacheGeometry, pages: u64, n: u32, layout: DecodeLayout) -> Self {
        let backend = CpuBackend::new();
        let placement = Placement::new(n).expect("a prefill group");
        let shard = u64::from(n);
        let src_pages = (0..pages)
            .map(|j| LogicalPage((j / shard + 1) * shard + j % shard))
            .collect();
        let pool = DevicePool::allocate(&backend, g, placement, 0, pages.div_ceil(shard) + 1)
            .expect("prefill rank 0's pool");
        let tokens = pages * PAGE_SIZE as u64;
        let mut ranks = Vec::new();
        let mut dsts = Vec::new();
        for d in 0..layout.ranks() {
            let share = layout.pages_on(d, tokens);
            let decode = DevicePool::allocate(&backend, g, Placement::unsharded(), 0, share + 1)
                .expect("a decode rank's pool");
            let list: Vec<LocalPage> = (1..=share).map(LocalPage).collect();
            ranks.push(DecodeRank {
                layout: PoolLayout::of(&decode),
                pages: list.clone(),
                state_pages: list,
            });
            dsts.push(RemoteSpace::of(Arc::new(decode), g.clone()).expect("a decode side"));
        }
        Self {
            source: PrefillRank::of(&pool),
            pool,
            src_pages,
            registration: DecodeRegistration {
                request: 1,
                layout,
                tokens: tokens as usize,
                prefix_pages: 0,
                ranks,
            },
            dsts,
            chunk: ChunkRange {
                index: 0,
                start: 0,
                end: tokens as usize,
                last: true,
            },
            _backend: backend,
        }
    }

    fn plan(&self) -> DecodePlan {
        DecodePlan::new(
            &self.source,
            &self.src_pages,
            &self.registration,
            self.chunk,
        )
        .expect("a valid chunk")
    }
}

fn planning(c: &mut Criterion) {
    let g = Model::DeepseekV32.geometry(LatentLayout::Fp8Trtllm, true);
    let cases: Vec<(String, Case)> = CASES
        .iter()
        .map(|&(pages, n, m, i)| {
            let layout = DecodeLayout::new(m, i).expect("a decode layout");
            (
                format!("{pages}p N{n} M{m} I{i}"),
                Case::new(&g, pages, n, layout),
            )
        })
        .collect();
    let mut group = c.benchmark_group("decode_plan");
    for (name, case) in &cases {
        group.bench_with_input(BenchmarkId::from_parameter(name), case, |b, case| {
            b.iter(|| black_box(case.plan()))
        });
    }
    group.finish();
    let mut group = c.benchmark_group("decode_scatter_plan");
    for (name, case) in &cases {
        let plan = case.plan();
        let dsts: Vec<&dyn BlockSpace> = case.dsts.iter().map(|d| d as &dyn BlockSpace).collect();
        group.bench_with_input(BenchmarkId::from_parameter(name), &plan, |b, plan| {
            b.iter(|| black_box(plan.scatter(&case.pool, &dsts).expect("checks")))
        });
    }
    group.finish();
}

criterion_group!(benches, planning);
criterion_main!(benches);
