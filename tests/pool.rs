//! Device pools: gather, scatter, pool-to-pool copies and the owned-row write path. Each
//! operation is checked on the CPU reference against its meaning, and on the GPU against the
//! CPU reference byte for byte (random data, poisoned outputs).

mod common;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{Backend, Launch, MemoryKind};
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::pool::{
    BlockCopy, BlockCopyPlan, BlockSpace, ChunkStaging, DevicePool, OwnedRowWrite, PageSelection,
    PoolBuffers, Staging,
};
use kvshard::shard::Placement;
use kvshard::synth::{self, POISON};
use kvshard::Error;
use rand::Rng;

const LAUNCH: Launch = Launch {
    ctas: 8,
    threads: 512,
};

fn geometries() -> Vec<CacheGeometry> {
    vec![
        // Shared-indexer layers (1 and 3) and the draft.
        CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![true, false, true, false, true],
        )),
        CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Scaled, 3)),
        CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Bf16, 2)),
    ]
}

/// A pool whose every byte is random (the same bytes for the same seed on any backend).
fn random_pool<B: Backend>(
    b: &B,
    g: &CacheGeometry,
    placement: Placement,
    rank: u32,
    pages: u64,
    seed: u64,
) -> DevicePool {
    let pool = DevicePool::allocate(b, g, placement, rank, pages).unwrap();
    let storage = pool.storage().unwrap();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    b.write(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();
    pool
}

/// Logical pages of `pages`-page ranks: random, distinct, non-reserved, with padding entries.
fn logical_pages(rng: &mut impl Rng, placement: Placement, pages: u64, n: usize) -> Vec<i64> {
    let logical = placement.logical_pages(pages) as usize;
    let shard = placement.shard() as i64;
    let perm = synth::permutation(rng, logical - shard as usize);
    (0..n)
        .map(|i| if i % 7 == 6 { -1 } else { perm[i] + shard })
        .collect()
}

/// The block bytes of `space`'s component `c`, layer `l`, page `p`, read back.
fn block<B: Backend>(b: &B, space: &dyn BlockSpace, c: usize, l: usize, p: u64) -> Vec<u8> {
    let bytes = space.components()[c].block_bytes;
    let addr = space.layer_base(c, l) + p * space.block_side(c).page_stride;
    // SAFETY: inside the space's layer buffer.
    let buf = unsafe { kvshard::backend::Buffer::from_raw(addr, bytes, MemoryKind::Device) };
    b.read(&buf, 0, bytes).unwrap()
}

struct Outcome {
    staging: Vec<u8>,
    pool: Vec<u8>,
    other: Vec<u8>,
}

/// Gather rank `rank`'s pages into staging, scatter staging into a second pool of the same rank,
/// and copy pool to pool; returns every buffer's bytes.
fn gather_scatter<B: Backend>(b: &B, g: &CacheGeometry, n: u32, rank: u32, ids: &[i64]) -> Outcome {
    let placement = Placement::new(n).unwrap();
    let pages = 40;
    let pool = random_pool(b, g, placement, rank, pages, 7);
    let staging = Staging::new(b, g, ids.len() as u64).unwrap();
    b.fill(staging.buffer(), POISON).unwrap();
    let logical = PageSelection::Logical {
        ids: ids.to_vec(),
        placement,
        rank,
    };
    let plan = BlockCopyPlan::new(
        &pool,
        logical.clone(),
        &staging,
        PageSelection::Positions,
        ids.len(),
    )
    .unwrap();
    BlockCopy::prepare(b, &plan, &pool, &staging)
        .unwrap()
        .run(b, LAUNCH)
        .unwrap();

    let other = DevicePool::allocate(b, g, placement, rank, pages).unwrap();
    other.fill(b, POISON).unwrap();
    let plan = BlockCopyPlan::new(
        &staging,
        PageSelection::Positions,
        &other,
        logical.clone(),
        ids.len(),
    )
    .unwrap();
    BlockCopy::prepare(b, &plan, &staging, &other)
        .unwrap()
        .run(b, LAUNCH)
        .unwrap();
    // Pool to pool, into an unsharded pool at shifted local pages (a decode-style destination).
    let unsharded =
        DevicePool::allocate(b, g, Placement::unsharded(), 0, ids.len() as u64 + 1).unwrap();
    unsharded.fill(b, POISON).unwrap();
    let dst: Vec<i64> = (0..ids.len() as i64).map(|j| j + 1).collect();
    let plan = BlockCopyPlan::new(
        &pool,
        logical,
        &unsharded,
        PageSelection::Local(dst),
        ids.len(),
    )
    .unwrap();
    BlockCopy::prepare(b, &plan, &pool, &unsharded)
        .unwrap()
        .run(b, LAUNCH)
        .unwrap();
    b.synchronize().unwrap();
    let mut other_bytes = other.snapshot(b).unwrap();
    other_bytes.extend(unsharded.snapshot(b).unwrap());
    Outcome {
        staging: b.read(staging.buffer(), 0, staging.buffer().len()).unwrap(),
        pool: pool.snapshot(b).unwrap(),
        other: other_bytes,
    }
}

#[test]
fn cpu_gather_takes_exactly_the_owned_pages() {
    let mut rng = common::rng("cpu_gather_takes_exactly_the_owned_pages");
    let b = CpuBackend::new();
    for g in geometries() {
        let placement = Placement::new(4).unwrap();
        let pool = random_pool(&b, &g, placement, 1, 30, 3);
        let ids = logical_pages(&mut rng, placement, 30, 50);
        let staging = Staging::new(&b, &g, ids.len() as u64).unwrap();
        b.fill(staging.buffer(), POISON).unwrap();
        let sel = PageSelection::Logical {
            ids: ids.clone(),
            placement,
            rank: 1,
        };
        let plan =
            BlockCopyPlan::new(&pool, sel, &staging, PageSelection::Positions, ids.len()).unwrap();
        let owned = ids.iter().filter(|&&p| p >= 0 && p % 4 == 1).count();
        assert_eq!(plan.moved_entries(), owned);
        assert_eq!(plan.bytes(), owned as u64 * g.page_bytes() as u64);
        BlockCopy::prepare(&b, &plan, &pool, &staging)
            .unwrap()
            .run(&b, LAUNCH)
            .unwrap();
        for (c, comp) in pool.components().iter().enumerate() {
            for l in 0..comp.layers() {
                for (j, &id) in ids.iter().enumerate() {
                    let got = block(&b, &staging, c, l, j as u64);
                    if id >= 0 && id % 4 == 1 {
                        assert_eq!(
                            got,
                            block(&b, &pool, c, l, id as u64 / 4),
                            "{} layer {l} entry {j}",
                            comp.component
                        );
                    } else {
                        assert!(
                            got.iter().all(|&x| x == POISON),
                            "entry {j} is not this rank's"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn cpu_scatter_inverts_gather_and_pool_copies_match() {
    let mut rng = common::rng("cpu_scatter_inverts_gather_and_pool_copies_match");
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let ids = logical_pages(&mut rng, placement, 40, 60);
    let out = gather_scatter(&b, g, 2, 0, &ids);
    // The scattered pool holds the source's owned pages and poison elsewhere.
    let src = random_pool(&b, g, placement, 0, 40, 7);
    let owned: Vec<u64> = ids
        .iter()
        .filter(|&&p| p >= 0 && p % 2 == 0)
        .map(|&p| p as u64 / 2)
        .collect();
    let mut offset = 0;
    for (c, comp) in src.components().iter().enumerate() {
        for l in 0..comp.layers() {
            for p in 0..40u64 {
                let got = &out.other[offset..offset + comp.block_bytes];
                if owned.contains(&p) {
                    assert_eq!(got, &block(&b, &src, c, l, p)[..]);
                } else {
                    assert!(got.iter().all(|&x| x == POISON));
                }
                offset += comp.block_bytes;
            }
        }
    }
}

#[test]
fn gpu_gather_scatter_match_cpu_byte_for_byte() {
    let Some(gpu) = common::cuda("gpu_gather_scatter_match_cpu_byte_for_byte") else {
        return;
    };
    let mut rng = common::rng("gpu_gather_scatter_match_cpu_byte_for_byte");
    for g in geometries() {
        for n in [1u32, 2, 4, 8] {
            let ids = logical_pages(
                &mut rng,
                Placement::new(n).unwrap(),
                40,
                70.min(40 * n as usize - n as usize),
            );
            for rank in [0, n - 1] {
                let cpu = gather_scatter(&CpuBackend::new(), &g, n, rank, &ids);
                let gpu_out = gather_scatter(&gpu, &g, n, rank, &ids);
                assert!(
                    cpu.staging == gpu_out.staging,
                    "N={n} rank {rank}: staging differs"
                );
                assert!(
                    cpu.pool == gpu_out.pool,
                    "N={n} rank {rank}: source pool changed differently"
                );
                assert!(
                    cpu.other == gpu_out.other,
                    "N={n} rank {rank}: scattered pools differ"
                );
            }
        }
    }
}

/// Stages a random chunk, writes the owned rows of rank `rank` of `n`, returns the pool bytes.
fn write_chunk<B: Backend>(b: &B, g: &CacheGeometry, n: u32, rank: u32, slots: &[i64]) -> Vec<u8> {
    let placement = Placement::new(n).unwrap();
    let pool = DevicePool::allocate(b, g, placement, rank, 24).unwrap();
    pool.fill(b, POISON).unwrap();
    let staging = ChunkStaging::new(b, &pool, slots.len()).unwrap();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(11);
    b.write(
        staging.buffer(),
        0,
        &synth::bytes(&mut rng, staging.buffer().len()),
    )
    .unwrap();
    let write = OwnedRowWrite::prepare(b, &staging, &pool, |_| true).unwrap();
    write
        .run_checked(
            b,
            slots,
            Launch {
                ctas: 16,
                threads: 512,
            },
        )
        .unwrap();
    pool.snapshot(b).unwrap()
}

/// Distinct random logical slots of `n` ranks of 24 pages, skipping the reserved pages.
fn chunk_slots(rng: &mut impl Rng, n: u32, tokens: usize) -> Vec<i64> {
    let reserved = 64 * n as usize;
    let perm = synth::permutation(rng, 24 * 64 * n as usize - reserved);
    (0..tokens)
        .map(|i| {
            if i % 11 == 10 {
                -1
            } else {
                perm[i] + reserved as i64
            }
        })
        .collect()
}

#[test]
fn cpu_write_path_persists_owned_rows_only() {
    let mut rng = common::rng("cpu_write_path_persists_owned_rows_only");
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let (n, rank) = (4, 2);
    let slots = chunk_slots(&mut rng, n, 300);
    let placement = Placement::new(n).unwrap();
    let pool = DevicePool::allocate(&b, g, placement, rank, 24).unwrap();
    pool.fill(&b, POISON).unwrap();
    let staging = ChunkStaging::new(&b, &pool, slots.len()).unwrap();
    b.write(
        staging.buffer(),
        0,
        &synth::bytes(&mut rng, staging.buffer().len()),
    )
    .unwrap();
    let write = OwnedRowWrite::prepare(&b, &staging, &pool, |_| true).unwrap();
    write.run_checked(&b, &slots, LAUNCH).unwrap();
    let row_of = |slot: u64| placement.local_row(slot);
    for (c, comp) in pool.components().iter().enumerate() {
        for l in 0..comp.layers() {
            let src = b
                .read(
                    &staging.layer(c, l).unwrap(),
                    0,
                    staging.layer(c, l).unwrap().len(),
                )
                .unwrap();
            let dst = &block(&b, &pool, c, l, 0).len(); // block size sanity
            assert_eq!(*dst, comp.block_bytes);
            for (i, &s) in slots.iter().enumerate() {
                if s < 0 || placement.slot_owner(s as u64) != rank {
                    continue;
                }
                let row = row_of(s as u64);
                let blk = block(&b, &pool, c, l, row / 64);
                if comp.component.is_indexer() {
                    let (sb, so) = (i / 64 * 8448, i % 64);
                    let ro = (row % 64) as usize;
                    assert_eq!(
                        &blk[ro * 128..ro * 128 + 128],
                        &src[sb + so * 128..sb + so * 128 + 128]
                    );
                    assert_eq!(
                        &blk[8192 + 4 * ro..8196 + 4 * ro],
                        &src[sb + 8192 + 4 * so..sb + 8196 + 4 * so]
                    );
                } else {
                    let r = comp.row_bytes;
                    let ro = (row % 64) as usize;
                    assert_eq!(&blk[ro * r..(ro + 1) * r], &src[i * r..(i + 1) * r]);
                }
            }
        }
    }
    // Rows nobody owns here stay poisoned: count written latent rows of layer 0.
    let owned = slots
        .iter()
        .filter(|&&s| s >= 0 && placement.slot_owner(s as u64) == rank)
        .count();
    let layer0: Vec<u8> = (0..24).flat_map(|p| block(&b, &pool, 0, 0, p)).collect();
    let written = layer0
        .chunks(576)
        .filter(|r| r.iter().any(|&x| x != POISON))
        .count();
    assert_eq!(written, owned);
}

#[test]
fn gpu_write_path_matches_cpu_byte_for_byte() {
    let Some(gpu) = common::cuda("gpu_write_path_matches_cpu_byte_for_byte") else {
        return;
    };
    let mut rng = common::rng("gpu_write_path_matches_cpu_byte_for_byte");
    for g in geometries() {
        for n in [1u32, 2, 4, 8] {
            for tokens in [1, 63, 64, 777] {
                let slots = chunk_slots(&mut rng, n, tokens);
                for rank in [0, n - 1] {
                    let cpu = write_chunk(&CpuBackend::new(), &g, n, rank, &slots);
                    let gpu_out = write_chunk(&gpu, &g, n, rank, &slots);
                    assert!(
                        cpu == gpu_out,
                        "N={n} rank {rank} {tokens} tokens: pools differ"
                    );
                }
            }
        }
    }
}

#[test]
fn wrapped_engine_buffers_behave_like_owned_pools() {
    let mut rng = common::rng("wrapped_engine_buffers_behave_like_owned_pools");
    let b = CpuBackend::new();
    let g = geometries().remove(0);
    // Separate allocations per layer: no uniform layer stride.
    let layers: Vec<_> = g
        .components()
        .iter()
        .flat_map(|c| {
            (0..c.layers())
                .map(|l| {
                    b.alloc(10 * c.block_bytes + 4096 * l, MemoryKind::Device)
                        .unwrap()
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let addrs: Vec<u64> = layers.iter().map(|l| l.addr()).collect();
    let buffers = PoolBuffers {
        target_latent: addrs[0..5].to_vec(),
        target_indexer: addrs[5..8].to_vec(),
        draft_latent: vec![addrs[8]],
        draft_indexer: vec![addrs[9]],
    };
    let placement = Placement::new(2).unwrap();
    // SAFETY: every address is a live allocation of `b` holding 10 blocks of its component.
    let pool = unsafe { DevicePool::wrap(&b, &g, placement, 1, 10, &buffers) }.unwrap();
    assert_eq!(pool.layer_stride(0), None);
    for l in &layers {
        b.write(l, 0, &synth::bytes(&mut rng, l.len())).unwrap();
    }
    let ids = vec![3i64, 5, 7, -1, 9];
    let staging = Staging::new(&b, &g, 5).unwrap();
    let sel = PageSelection::Logical {
        ids,
        placement,
        rank: 1,
    };
    let plan = BlockCopyPlan::new(&pool, sel, &staging, PageSelection::Positions, 5).unwrap();
    BlockCopy::prepare(&b, &plan, &pool, &staging)
        .unwrap()
        .run(&b, LAUNCH)
        .unwrap();
    assert_eq!(block(&b, &staging, 1, 2, 2), block(&b, &pool, 1, 2, 3));
    assert_eq!(
        b.read(pool.layer_table(), 0, 8).unwrap(),
        addrs[0].to_le_bytes()
    );

    let mut wrong = buffers.clone();
    wrong.target_indexer.push(addrs[0]);
    // SAFETY: refused before any address is used.
    let err = unsafe { DevicePool::wrap(&b, &g, placement, 1, 10, &wrong) }.unwrap_err();
    assert!(
        err.to_string()
            .contains("target indexer buffers: expected 3, got 4"),
        "{err}"
    );
}

#[test]
fn bad_copies_are_refused_before_anything_moves() {
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = DevicePool::allocate(&b, g, placement, 0, 8).unwrap();
    let staging = Staging::new(&b, g, 4).unwrap();
    let sel = |ids: Vec<i64>| PageSelection::Logical {
        ids,
        placement,
        rank: 0,
    };
    let plan = |ids| BlockCopyPlan::new(&pool, sel(ids), &staging, PageSelection::Positions, 2);
    assert!(matches!(
        plan(vec![4, 16]),
        Err(Error::OutOfRange {
            index: 16,
            limit: 16,
            ..
        })
    ));
    assert!(matches!(
        plan(vec![1, 4]),
        Err(Error::ReservedPage { page: 1, shard: 2 })
    ));
    assert!(BlockCopyPlan::new(
        &pool,
        sel(vec![4; 5]),
        &staging,
        PageSelection::Positions,
        5
    )
    .is_err());
    let other = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 5));
    let small = Staging::new(&b, &other, 4).unwrap();
    let err = BlockCopyPlan::new(&pool, sel(vec![4, 6]), &small, PageSelection::Positions, 2)
        .unwrap_err();
    assert!(matches!(err, Error::GeometryMismatch { .. }), "{err}");
    assert!(
        DevicePool::allocate(&b, g, placement, 2, 8).is_err(),
        "rank outside the shard"
    );
    // A write with an out-of-range slot writes nothing.
    let chunk = ChunkStaging::new(&b, &pool, 2).unwrap();
    pool.fill(&b, POISON).unwrap();
    let write = OwnedRowWrite::prepare(&b, &chunk, &pool, |_| true).unwrap();
    let err = write.run_checked(&b, &[128, 1 << 20], LAUNCH).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                what: "logical slot",
                ..
            }
        ),
        "{err}"
    );
    assert!(pool.snapshot(&b).unwrap().iter().all(|&x| x == POISON));
}

/// Gathers rank 1's pages of `ids` into poisoned staging with grid `launch`; returns the staging.
fn gather_once<B: Backend>(
    b: &B,
    pool: &DevicePool,
    staging: &Staging,
    ids: &[i64],
    launch: Launch,
) -> Vec<u8> {
    let placement = pool.placement();
    let sel = PageSelection::Logical {
        ids: ids.to_vec(),
        placement,
        rank: 1,
    };
    let plan = BlockCopyPlan::new(pool, sel, staging, PageSelection::Positions, ids.len()).unwrap();
    b.fill(staging.buffer(), POISON).unwrap();
    BlockCopy::prepare(b, &plan, pool, staging)
        .unwrap()
        .run(b, launch)
        .unwrap();
    b.synchronize().unwrap();
    b.read(staging.buffer(), 0, staging.buffer().len()).unwrap()
}

/// The CUDA backend hands its copy kernels a work queue whose base it advances after every
/// launch: many launches of varying grids and sizes on one backend must all stay exact.
#[test]
fn gpu_work_queue_stays_in_step_across_launches() {
    let Some(gpu) = common::cuda("gpu_work_queue_stays_in_step_across_launches") else {
        return;
    };
    let mut rng = common::rng("gpu_work_queue_stays_in_step_across_launches");
    let cpu = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool_gpu = random_pool(&gpu, g, placement, 1, 40, 5);
    let pool_cpu = random_pool(&cpu, g, placement, 1, 40, 5);
    let staging_gpu = Staging::new(&gpu, g, 60).unwrap();
    let staging_cpu = Staging::new(&cpu, g, 60).unwrap();
    for round in 0..40 {
        let n = rng.random_range(1..60);
        let ids = logical_pages(&mut rng, placement, 40, n);
        let launch = Launch {
            ctas: rng.random_range(1..9),
            threads: 32 * rng.random_range(1..33),
        };
        let want = gather_once(&cpu, &pool_cpu, &staging_cpu, &ids, launch);
        let got = gather_once(&gpu, &pool_gpu, &staging_gpu, &ids, launch);
        assert!(want == got, "round {round}: {n} pages with {launch:?}");
    }
}
