//! Device pools: gather, scatter, pool-to-pool copies and the owned-row write path. Each
//! operation is checked against its meaning (random data, poisoned outputs), from one body on
//! the CPU twin (`cpu_*`) and on the GPU (`gpu_*`, SKIPPED without one).

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::synth::{self, POISON};
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{upload_i64s_sync, Backend, Buffer, Launch, MemoryKind};
use kvshard::copy::{BlockCopy, BlockCopyPlan, BlockSpace, PageSelection, Staging};
use kvshard::geometry::{
    CacheGeometry, Component, LatentLayout, PoolGeometry, INDEXER_HEAD_DIM, INDEXER_PAGE_BYTES,
    INDEXER_SCALES_OFFSET, PAGE_SIZE,
};
use kvshard::index::{LocalPage, LogicalPage, ModelLayer, Slot, StoredLayer};
use kvshard::pool::{ChunkStaging, DevicePool, OwnedRowWrite, PoolBuffers, RawBuffer};
use kvshard::shard::Placement;
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

fn seeded(seed: u64) -> rand::rngs::StdRng {
    <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed)
}

/// A pool whose every byte is random (the same bytes for the same seed on any backend).
fn random_pool(
    b: &dyn Backend,
    g: &CacheGeometry,
    placement: Placement,
    rank: u32,
    pages: u64,
    seed: u64,
) -> Arc<DevicePool> {
    let pool = DevicePool::allocate(b, g, placement, rank, pages).unwrap();
    let storage = pool.storage().unwrap();
    b.write_sync(storage, 0, &synth::bytes(&mut seeded(seed), storage.len()))
        .unwrap();
    Arc::new(pool)
}

/// `n` random, distinct, non-reserved logical pages of a group of `pages`-page ranks (every
/// rank's, so each rank moves only its share).
fn logical_pages(
    rng: &mut impl Rng,
    placement: Placement,
    pages: u64,
    n: usize,
) -> Vec<LogicalPage> {
    let shard = u64::from(placement.shard());
    let logical = placement.logical_pages(pages).unwrap();
    synth::permutation(rng, (logical - shard) as usize)
        .into_iter()
        .take(n)
        .map(|p| LogicalPage(p as u64 + shard))
        .collect()
}

/// The bytes of block (`layer`, `page`) of `component` of `space`, read back through `b`.
fn block(
    b: &dyn Backend,
    space: &dyn BlockSpace,
    component: Component,
    layer: usize,
    page: u64,
) -> Vec<u8> {
    let addr = space
        .block_addr(component, StoredLayer(layer), LocalPage(page))
        .unwrap();
    let c = space.component_index(component).unwrap();
    let bytes = space.components()[c].block_bytes;
    // SAFETY: block_addr checked the block lies inside the space, which the caller holds.
    let buf = unsafe { Buffer::from_raw(addr, bytes, MemoryKind::Device, space.address_space()) };
    b.read_sync(&buf, 0, bytes).unwrap()
}

/// Prepares `plan` between `src` and `dst` and runs it whole.
fn copy(b: &dyn Backend, plan: BlockCopyPlan, src: Arc<dyn BlockSpace>, dst: Arc<dyn BlockSpace>) {
    BlockCopy::prepare_sync(b, plan, src, dst, None)
        .unwrap()
        .run(b, LAUNCH)
        .unwrap();
}

/// Gathers rank `rank`'s pages into staging, scatters the staging into a second pool of the same
/// rank, and copies pool to an unsharded pool layer by layer, and checks that each moved
/// exactly the rank's owned pages (the entries of other ranks' pages, and every page no entry
/// names, still poison) and left the source as it was.
fn gather_scatter(b: &dyn Backend, g: &CacheGeometry, n: u32, rank: u32, pages: &[LogicalPage]) {
    let case = format!("N={n} rank {rank}");
    let placement = Placement::new(n).unwrap();
    let entries = pages.len();
    let pool = random_pool(b, g, placement, rank, 40, 7);
    let source = pool.snapshot_sync(b).unwrap();
    let staging = Arc::new(Staging::new(b, g, entries as u64).unwrap());
    b.fill(staging.buffer(), POISON).unwrap();
    let logical = PageSelection::Logical {
        pages: pages.to_vec(),
        placement,
        rank,
    };
    let plan = BlockCopyPlan::new(
        pool.as_ref(),
        logical.clone(),
        staging.as_ref(),
        PageSelection::Positions,
        entries,
    )
    .unwrap();
    copy(b, plan, pool.clone(), staging.clone());

    let other = Arc::new(DevicePool::allocate(b, g, placement, rank, 40).unwrap());
    other.fill(b, POISON).unwrap();
    let plan = BlockCopyPlan::new(
        staging.as_ref(),
        PageSelection::Positions,
        other.as_ref(),
        logical.clone(),
        entries,
    )
    .unwrap();
    copy(b, plan, staging.clone(), other.clone());

    // Pool to pool, into an unsharded pool at shifted local pages (a decode-style destination),
    // one model layer per launch.
    let unsharded = Arc::new(
        DevicePool::allocate(b, g, Placement::unsharded(), 0, entries as u64 + 1).unwrap(),
    );
    unsharded.fill(b, POISON).unwrap();
    let dst = (1..=entries as u64).map(LocalPage).collect();
    let plan = BlockCopyPlan::new(
        pool.as_ref(),
        logical,
        unsharded.as_ref(),
        PageSelection::Local(dst),
        entries,
    )
    .unwrap()
    .layer_major();
    let layers = plan.model_layers();
    let layered = BlockCopy::prepare_sync(b, plan, pool.clone(), unsharded.clone(), None).unwrap();
    for m in 0..layers {
        layered.run_layer(b, ModelLayer(m), LAUNCH).unwrap();
    }
    b.synchronize().unwrap();

    assert!(
        pool.snapshot_sync(b).unwrap() == source,
        "{case}: the source changed"
    );
    // Entry j's page, where this rank owns it, holds its local page of the source: at staging
    // position j, at the same local page of the scattered pool, and at local page j + 1 of the
    // unsharded pool. Everything else is poison.
    let local_of =
        |page: LogicalPage| (placement.owner(page) == rank).then(|| placement.local(page).0);
    let owned: Vec<u64> = pages.iter().filter_map(|&p| local_of(p)).collect();
    let is_poison = |bytes: &[u8]| bytes.iter().all(|&x| x == POISON);
    for comp in pool.components() {
        let c = comp.component;
        for l in 0..comp.layers() {
            for (j, &page) in pages.iter().enumerate() {
                let at = format!("{case}: {c} layer {l} entry {j}");
                let staged = block(b, staging.as_ref(), c, l, j as u64);
                let copied = block(b, unsharded.as_ref(), c, l, j as u64 + 1);
                match local_of(page) {
                    Some(local) => {
                        let want = block(b, pool.as_ref(), c, l, local);
                        assert!(staged == want, "{at}: staging");
                        assert!(copied == want, "{at}: unsharded pool");
                    }
                    None => {
                        assert!(is_poison(&staged), "{at}: staging of another rank's page");
                        assert!(
                            is_poison(&copied),
                            "{at}: unsharded pool, another rank's page"
                        );
                    }
                }
            }
            assert!(
                is_poison(&block(b, unsharded.as_ref(), c, l, 0)),
                "{case}: page 0"
            );
            for p in 0..40u64 {
                let got = block(b, other.as_ref(), c, l, p);
                if owned.contains(&p) {
                    assert!(
                        got == block(b, pool.as_ref(), c, l, p),
                        "{case}: {c} {l} page {p}"
                    );
                } else {
                    assert!(
                        is_poison(&got),
                        "{case}: {c} layer {l} page {p} is no entry's"
                    );
                }
            }
        }
    }
}

// Gather, scatter and pool-to-pool copies move exactly the rank's owned pages, for every test
// geometry, at every N, at the first and the last rank.
common::on_cpu_and_gpu!(
    gather_scatter_and_pool_copies_move_exactly_the_owned_pages,
    |device| {
        let (b, mut rng) = (device.stream(), device.rng());
        for g in geometries() {
            for n in [1u32, 2, 4, 8] {
                let placement = Placement::new(n).unwrap();
                let count = 70.min(40 * n as usize - n as usize);
                let pages = logical_pages(&mut rng, placement, 40, count);
                let mut ranks = vec![0, n - 1];
                ranks.dedup();
                for rank in ranks {
                    gather_scatter(b.as_ref(), &g, n, rank, &pages);
                }
            }
        }
    }
);

#[test]
fn cpu_gather_takes_exactly_the_owned_pages() {
    let mut rng = common::rng("cpu_gather_takes_exactly_the_owned_pages");
    let b = CpuBackend::new();
    for g in geometries() {
        let placement = Placement::new(4).unwrap();
        let pool = random_pool(&b, &g, placement, 1, 30, 3);
        let pages = logical_pages(&mut rng, placement, 30, 50);
        let staging = Arc::new(Staging::new(&b, &g, pages.len() as u64).unwrap());
        b.fill(staging.buffer(), POISON).unwrap();
        let sel = PageSelection::Logical {
            pages: pages.clone(),
            placement,
            rank: 1,
        };
        let plan = BlockCopyPlan::new(
            pool.as_ref(),
            sel,
            staging.as_ref(),
            PageSelection::Positions,
            pages.len(),
        )
        .unwrap();
        let owned = pages.iter().filter(|p| p.0 % 4 == 1).count();
        assert_eq!(plan.moved_entries(), owned);
        assert_eq!(plan.bytes(), owned as u64 * g.page_bytes() as u64);
        copy(&b, plan, pool.clone(), staging.clone());
        for comp in pool.components() {
            for l in 0..comp.layers() {
                for (j, &page) in pages.iter().enumerate() {
                    let got = block(&b, staging.as_ref(), comp.component, l, j as u64);
                    if page.0 % 4 == 1 {
                        assert_eq!(
                            got,
                            block(&b, pool.as_ref(), comp.component, l, page.0 / 4),
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
fn cpu_entry_windows_and_single_layers_compose_the_whole_copy() {
    let mut rng = common::rng("cpu_entry_windows_and_single_layers_compose_the_whole_copy");
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(&b, g, placement, 1, 40, 9);
    let pages = logical_pages(&mut rng, placement, 40, 33);
    let sel = PageSelection::Logical {
        pages: pages.clone(),
        placement,
        rank: 1,
    };
    let into = |staging: &Arc<Staging>| {
        b.fill(staging.buffer(), POISON).unwrap();
        let plan = BlockCopyPlan::new(
            pool.as_ref(),
            sel.clone(),
            staging.as_ref(),
            PageSelection::Positions,
            pages.len(),
        )
        .unwrap()
        .layer_major();
        BlockCopy::prepare_sync(&b, plan, pool.clone(), staging.clone(), None).unwrap()
    };
    let read = |staging: &Staging| {
        b.read_sync(staging.buffer(), 0, staging.buffer().len())
            .unwrap()
    };
    let staging = Arc::new(Staging::new(&b, g, pages.len() as u64).unwrap());
    into(&staging).run(&b, LAUNCH).unwrap();
    let whole = read(&staging);
    assert!(whole.iter().any(|&x| x != POISON));
    let layered = into(&staging);
    for m in 0..layered.plan().model_layers() {
        layered.run_layer(&b, ModelLayer(m), LAUNCH).unwrap();
    }
    assert!(read(&staging) == whole, "layer by layer differs");
    // A window of entries addresses staging positions from 0, as a staged transfer does.
    let window = Arc::new(Staging::new(&b, g, 10).unwrap());
    let windows = into(&window);
    for start in (0..pages.len()).step_by(10) {
        let end = (start + 10).min(pages.len());
        b.fill(window.buffer(), POISON).unwrap();
        windows.run_entries(&b, start..end, LAUNCH).unwrap();
        for comp in g.components() {
            for l in 0..comp.layers() {
                for j in start..end {
                    assert_eq!(
                        block(&b, window.as_ref(), comp.component, l, (j - start) as u64),
                        block(&b, staging.as_ref(), comp.component, l, j as u64),
                        "{} layer {l} entry {j}",
                        comp.component
                    );
                }
            }
        }
    }
    let err = windows.run_entries(&b, 0..11, LAUNCH).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                what: "staging position",
                ..
            }
        ),
        "{err}"
    );
}

/// How a chunk's slots reach the write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slots {
    /// The engine's device buffer, padding (-1) included, with kvshard's grid or `ctas` CTAs.
    Device { ctas: Option<u32> },
    /// Checked on the host (no padding allowed).
    Checked,
}

/// Stages a random chunk (seed 11), writes the owned rows of rank `rank` of `n` into a poisoned
/// pool of 24 pages, returns the pool and the staging.
fn write_chunk(
    b: &dyn Backend,
    g: &CacheGeometry,
    n: u32,
    rank: u32,
    slots: &[i64],
    how: Slots,
) -> (Arc<DevicePool>, Arc<ChunkStaging>) {
    let placement = Placement::new(n).unwrap();
    let pool = Arc::new(DevicePool::allocate(b, g, placement, rank, 24).unwrap());
    pool.fill(b, POISON).unwrap();
    let staging = Arc::new(ChunkStaging::new(b, &pool, slots.len()).unwrap());
    b.write_sync(
        staging.buffer(),
        0,
        &synth::bytes(&mut seeded(11), staging.buffer().len()),
    )
    .unwrap();
    let write = OwnedRowWrite::prepare_sync(b, staging.clone(), pool.clone(), |_| true).unwrap();
    match how {
        Slots::Device { ctas } => {
            let buf = upload_i64s_sync(b, slots).unwrap();
            let launch = match ctas {
                Some(ctas) => Launch { ctas, threads: 512 },
                None => write.launch(b, slots.len()),
            };
            write.run(b, &buf, slots.len(), launch).unwrap();
            b.synchronize().unwrap();
        }
        Slots::Checked => {
            let slots: Vec<Slot> = slots.iter().map(|&s| Slot(s as u64)).collect();
            write
                .run_checked_sync(b, &slots, write.launch(b, slots.len()))
                .unwrap();
        }
    }
    (pool, staging)
}

/// A write prepared for some (component, layer) pairs moves exactly those: the target latent
/// rows of layer 1 land as an unfiltered write puts them, every other component and layer of
/// the pool keeps its poison (an engine whose own kernel writes the indexer keys keeps them).
#[test]
fn cpu_a_component_filtered_write_moves_only_what_it_keeps() {
    let mut rng = common::rng("cpu_a_component_filtered_write_moves_only_what_it_keeps");
    let b = CpuBackend::new();
    for g in geometries() {
        let slots = chunk_slots(&mut rng, 2, 128, false);
        let (full, _) = write_chunk(&b, &g, 2, 1, &slots, Slots::Checked);
        let pool =
            Arc::new(DevicePool::allocate(&b, &g, Placement::new(2).unwrap(), 1, 24).unwrap());
        pool.fill(&b, POISON).unwrap();
        let staging = Arc::new(ChunkStaging::new(&b, &pool, slots.len()).unwrap());
        let bytes = synth::bytes(&mut seeded(11), staging.buffer().len());
        b.write_sync(staging.buffer(), 0, &bytes).unwrap();
        let keep = |c: Component, m: ModelLayer| c == Component::TargetLatent && m == ModelLayer(1);
        let write =
            OwnedRowWrite::prepare_components_sync(&b, staging, pool.clone(), keep).unwrap();
        let checked: Vec<Slot> = slots.iter().map(|&s| Slot(s as u64)).collect();
        write
            .run_checked_sync(&b, &checked, write.launch(&b, checked.len()))
            .unwrap();
        for c in pool.components() {
            for (l, &m) in c.model_layers.iter().enumerate() {
                for p in 0..24 {
                    let at = (c.component, StoredLayer(l), LocalPage(p));
                    let got = pool.read_block_sync(&b, at.0, at.1, at.2).unwrap();
                    if keep(c.component, m) {
                        assert_eq!(
                            got,
                            full.read_block_sync(&b, at.0, at.1, at.2).unwrap(),
                            "{at:?}"
                        );
                    } else {
                        assert!(got.iter().all(|&x| x == POISON), "{at:?} written");
                    }
                }
            }
        }
    }
}

/// Distinct random logical slots of `n` ranks of 24 pages, skipping the reserved pages; every
/// eleventh is padding (-1) when `padding`.
fn chunk_slots(rng: &mut impl Rng, n: u32, tokens: usize, padding: bool) -> Vec<i64> {
    let reserved = 64 * n as usize;
    let perm = synth::permutation(rng, 24 * 64 * n as usize - reserved);
    (0..tokens)
        .map(|i| {
            if padding && i % 11 == 10 {
                -1
            } else {
                perm[i] + reserved as i64
            }
        })
        .collect()
}

/// Checks `pool` holds exactly the rows of `slots` rank `rank` owns, from `staging`, and
/// poison everywhere else.
fn check_owned_rows(b: &dyn Backend, pool: &DevicePool, staging: &ChunkStaging, slots: &[i64]) {
    let (placement, rank) = (pool.placement(), pool.rank());
    // Local row -> the token written there.
    let owned: HashMap<u64, usize> = slots
        .iter()
        .enumerate()
        .filter(|&(_, &s)| s >= 0 && placement.slot_owner(Slot(s as u64)) == rank)
        .map(|(i, &s)| (placement.local_row(Slot(s as u64)), i))
        .collect();
    let page = PAGE_SIZE as u64;
    for comp in pool.components() {
        for l in 0..comp.layers() {
            let layer = staging.layer(comp.component, StoredLayer(l)).unwrap();
            let src = b.read_sync(&layer, 0, layer.len()).unwrap();
            let mut written = 0;
            for p in 0..pool.pages() {
                let blk = block(b, pool, comp.component, l, p);
                for ro in 0..PAGE_SIZE {
                    let row = p * page + ro as u64;
                    let token = owned.get(&row).copied();
                    let (got, want): (Vec<&[u8]>, Vec<&[u8]>) = if comp.component.is_indexer() {
                        let k = INDEXER_HEAD_DIM;
                        let s = INDEXER_SCALES_OFFSET;
                        let got =
                            vec![&blk[ro * k..(ro + 1) * k], &blk[s + 4 * ro..s + 4 * ro + 4]];
                        let want = token.map_or_else(Vec::new, |i| {
                            let (sb, so) = (i / PAGE_SIZE * INDEXER_PAGE_BYTES, i % PAGE_SIZE);
                            vec![
                                &src[sb + so * k..sb + (so + 1) * k],
                                &src[sb + s + 4 * so..sb + s + 4 * so + 4],
                            ]
                        });
                        (got, want)
                    } else {
                        let r = comp.row_bytes;
                        let got = vec![&blk[ro * r..(ro + 1) * r]];
                        let want = token.map_or_else(Vec::new, |i| vec![&src[i * r..(i + 1) * r]]);
                        (got, want)
                    };
                    if token.is_some() {
                        written += 1;
                        assert_eq!(got, want, "{} layer {l} row {row}", comp.component);
                    } else {
                        assert!(
                            got.iter().all(|part| part.iter().all(|&x| x == POISON)),
                            "{} layer {l} row {row} is no owned token's",
                            comp.component
                        );
                    }
                }
            }
            assert_eq!(written, owned.len());
        }
    }
}

// The owned-row write persists exactly the rows of the chunk's tokens the rank owns (padding
// tokens write nothing), with kvshard's grid or a small one, for every test geometry, at every
// N, at the first and the last rank, for chunks of one token to several pages; slots checked on
// the host land as the same slots from a device buffer.
common::on_cpu_and_gpu!(write_path_persists_owned_rows_only, |device| {
    let (b, mut rng) = (device.stream(), device.rng());
    let b = b.as_ref();
    for g in geometries() {
        for n in [1u32, 2, 4, 8] {
            for tokens in [1, 63, 64, 300, 777] {
                let slots = chunk_slots(&mut rng, n, tokens, true);
                let mut ranks = vec![0, n - 1];
                ranks.dedup();
                for rank in ranks {
                    for how in [
                        Slots::Device { ctas: None },
                        Slots::Device { ctas: Some(3) },
                    ] {
                        let (pool, staging) = write_chunk(b, &g, n, rank, &slots, how);
                        check_owned_rows(b, &pool, &staging, &slots);
                    }
                }
            }
        }
    }
    let (g, n, rank) = (&geometries()[0], 4, 2);
    let slots = chunk_slots(&mut rng, n, 200, false);
    let (pool, staging) = write_chunk(b, g, n, rank, &slots, Slots::Checked);
    check_owned_rows(b, &pool, &staging, &slots);
    let (device, _) = write_chunk(b, g, n, rank, &slots, Slots::Device { ctas: Some(1) });
    assert!(pool.snapshot_sync(b).unwrap() == device.snapshot_sync(b).unwrap());
});

#[test]
fn wrapped_engine_buffers_behave_like_owned_pools() {
    let mut rng = common::rng("wrapped_engine_buffers_behave_like_owned_pools");
    let b = CpuBackend::new();
    let g = geometries().remove(0);
    // Separate allocations per layer, of different sizes: no uniform layer stride.
    let layers: Vec<Buffer> = g
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
    let raw: Vec<RawBuffer> = layers
        .iter()
        .map(|l| RawBuffer {
            addr: l.addr(),
            bytes: l.len() as u64,
        })
        .collect();
    let buffers = PoolBuffers {
        target_latent: raw[0..5].to_vec(),
        target_indexer: raw[5..8].to_vec(),
        draft_latent: vec![raw[8]],
        draft_indexer: vec![raw[9]],
    };
    assert_eq!(buffers.pages_covered(&g), Some(10));
    let placement = Placement::new(2).unwrap();
    // SAFETY: every address is a live allocation of `b` holding at least 10 blocks of its
    // component; `layers` outlives the pool.
    let pool = Arc::new(unsafe { DevicePool::wrap(&b, &g, placement, 1, 10, &buffers) }.unwrap());
    assert_eq!(pool.layer_stride(Component::TargetLatent).unwrap(), None);
    let addrs: Vec<u64> = raw.iter().map(|r| r.addr).collect();
    assert_eq!(
        pool.layer_bases(Component::TargetLatent).unwrap(),
        &addrs[0..5]
    );
    assert_eq!(
        pool.layer_bases(Component::DraftIndexer).unwrap(),
        &addrs[9..]
    );
    for l in &layers {
        b.write_sync(l, 0, &synth::bytes(&mut rng, l.len()))
            .unwrap();
    }
    // An owned pool with the same blocks gathers the same bytes.
    let owned = Arc::new(DevicePool::allocate(&b, &g, placement, 1, 10).unwrap());
    let all: Vec<LocalPage> = (0..10).map(LocalPage).collect();
    let plan = BlockCopyPlan::new(
        pool.as_ref(),
        PageSelection::Local(all.clone()),
        owned.as_ref(),
        PageSelection::Local(all),
        10,
    )
    .unwrap();
    copy(&b, plan, pool.clone(), owned.clone());
    assert!(owned.snapshot_sync(&b).unwrap() == pool.snapshot_sync(&b).unwrap());
    assert_ne!(owned.layer_stride(Component::TargetLatent).unwrap(), None);
    let pages = [3, 5, 7, 9].map(LogicalPage).to_vec();
    let gather = |src: &Arc<DevicePool>| {
        let staging = Arc::new(Staging::new(&b, &g, 4).unwrap());
        b.fill(staging.buffer(), POISON).unwrap();
        let sel = PageSelection::Logical {
            pages: pages.clone(),
            placement,
            rank: 1,
        };
        let plan = BlockCopyPlan::new(
            src.as_ref(),
            sel,
            staging.as_ref(),
            PageSelection::Positions,
            4,
        )
        .unwrap();
        copy(&b, plan, src.clone(), staging.clone());
        staging
    };
    let staging = gather(&pool);
    assert_eq!(
        block(&b, staging.as_ref(), Component::TargetIndexer, 2, 2),
        block(&b, pool.as_ref(), Component::TargetIndexer, 2, 3)
    );
    let bytes = |s: &Staging| b.read_sync(s.buffer(), 0, s.buffer().len()).unwrap();
    assert!(bytes(&staging) == bytes(&gather(&owned)));

    let mut wrong = buffers.clone();
    wrong.target_indexer.push(raw[0]);
    // SAFETY: refused before any address is used.
    let err = unsafe { DevicePool::wrap(&b, &g, placement, 1, 10, &wrong) }.unwrap_err();
    assert!(
        err.to_string()
            .contains("target indexer buffers: expected 3, got 4"),
        "{err}"
    );
    let mut misaligned = buffers.clone();
    misaligned.draft_latent[0].addr += 8;
    // SAFETY: refused before any address is used.
    let err = unsafe { DevicePool::wrap(&b, &g, placement, 1, 10, &misaligned) }.unwrap_err();
    assert!(err.to_string().contains("16-byte aligned"), "{err}");
}

#[test]
fn bad_copies_are_refused_before_anything_moves() {
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = Arc::new(DevicePool::allocate(&b, g, placement, 0, 8).unwrap());
    let staging = Arc::new(Staging::new(&b, g, 4).unwrap());
    b.fill(staging.buffer(), POISON).unwrap();
    let sel = |pages: &[u64]| PageSelection::Logical {
        pages: pages.iter().map(|&p| LogicalPage(p)).collect(),
        placement,
        rank: 0,
    };
    let plan = |pages: &[u64]| {
        BlockCopyPlan::new(
            pool.as_ref(),
            sel(pages),
            staging.as_ref(),
            PageSelection::Positions,
            pages.len(),
        )
    };
    assert!(matches!(
        plan(&[4, 16]),
        Err(Error::OutOfRange {
            index: 16,
            limit: 16,
            ..
        })
    ));
    assert!(matches!(
        plan(&[1, 4]),
        Err(Error::ReservedPage { page: 1, shard: 2 })
    ));
    // More entries than the staging holds: a positions side is checked per launch (a staged
    // transfer runs a long plan in windows), so the run is refused and nothing lands.
    let long = plan(&[4; 5]).unwrap();
    let err = BlockCopy::prepare_sync(&b, long, pool.clone(), staging.clone(), None)
        .unwrap()
        .run(&b, LAUNCH)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                what: "staging position",
                ..
            }
        ),
        "{err}"
    );
    assert!(b
        .read_sync(staging.buffer(), 0, staging.buffer().len())
        .unwrap()
        .iter()
        .all(|&x| x == POISON));
    let err = BlockCopyPlan::new(
        pool.as_ref(),
        sel(&[4, 6]),
        staging.as_ref(),
        PageSelection::Positions,
        3,
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let other = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 5));
    let small = Staging::new(&b, &other, 4).unwrap();
    let err = BlockCopyPlan::new(
        pool.as_ref(),
        sel(&[4, 6]),
        &small,
        PageSelection::Positions,
        2,
    )
    .unwrap_err();
    assert!(matches!(err, Error::GeometryMismatch { .. }), "{err}");
    assert!(
        DevicePool::allocate(&b, g, placement, 2, 8).is_err(),
        "rank outside the shard"
    );
    assert!(
        DevicePool::allocate(&b, g, placement, 0, 1).is_err(),
        "no page besides the padding page"
    );
    // A write with an out-of-range slot writes nothing.
    let chunk = Arc::new(ChunkStaging::new(&b, &pool, 2).unwrap());
    pool.fill(&b, POISON).unwrap();
    let write = OwnedRowWrite::prepare_sync(&b, chunk, pool.clone(), |_| true).unwrap();
    let err = write
        .run_checked_sync(&b, &[Slot(128), Slot(1 << 20)], LAUNCH)
        .unwrap_err();
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
    let err = write
        .run_checked_sync(&b, &[Slot(130), Slot(130)], LAUNCH)
        .unwrap_err();
    assert!(matches!(err, Error::DuplicatePage { .. }), "{err}");
    assert!(pool.snapshot_sync(&b).unwrap().iter().all(|&x| x == POISON));
}

/// Gathers rank 1's pages of `pages` into poisoned staging with grid `launch`; returns the
/// staging.
fn gather_once(
    b: &dyn Backend,
    pool: &Arc<DevicePool>,
    staging: &Arc<Staging>,
    pages: &[LogicalPage],
    launch: Launch,
) -> Vec<u8> {
    let sel = PageSelection::Logical {
        pages: pages.to_vec(),
        placement: pool.placement(),
        rank: 1,
    };
    let plan = BlockCopyPlan::new(
        pool.as_ref(),
        sel,
        staging.as_ref(),
        PageSelection::Positions,
        pages.len(),
    )
    .unwrap();
    b.fill(staging.buffer(), POISON).unwrap();
    BlockCopy::prepare_sync(b, plan, pool.clone(), staging.clone(), None)
        .unwrap()
        .run(b, launch)
        .unwrap();
    b.synchronize().unwrap();
    b.read_sync(staging.buffer(), 0, staging.buffer().len())
        .unwrap()
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
    let staging_gpu = Arc::new(Staging::new(&gpu, g, 60).unwrap());
    let staging_cpu = Arc::new(Staging::new(&cpu, g, 60).unwrap());
    for round in 0..40 {
        let n = rng.random_range(1..60);
        let pages = logical_pages(&mut rng, placement, 40, n);
        let launch = Launch {
            ctas: rng.random_range(1..9),
            threads: 32 * rng.random_range(1..33),
        };
        let want = gather_once(&cpu, &pool_cpu, &staging_cpu, &pages, launch);
        let got = gather_once(&gpu, &pool_gpu, &staging_gpu, &pages, launch);
        assert!(want == got, "round {round}: {n} pages with {launch:?}");
    }
}
