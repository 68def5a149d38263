//! Reloading a cached prefix with another parallelism (docs/storage.md, "Reloading with another
//! parallelism"): a prefix cached by N page-sharded ranks (rotated start owner), in their host
//! pools or on disk, loaded by N' CP ranks, an unsharded server or M decode ranks sharded by
//! token (I = 1 or 64), one process, byte-identical to the unsharded reference: pages kept whole
//! equal the reference's pages, decode ranks equal it re-laid out (`relayout`, as tests/dcp.rs
//! checks), every page the reload does not name untouched. The launches are never waited for:
//! the snapshots, on other streams, follow them by the pools' usage records. CPU twin in the
//! adversarial stream order; `gpu_*` against the twin byte for byte (SKIPPED without a GPU).

mod common;

use std::sync::Arc;

use common::dcp::{block_offset, geometries, relayout, Case, LAUNCH, REQUEST};
use common::synth::{self, POISON};
use kvshard::backend::Backend;
use kvshard::copy::{BlockCopy, BlockCopyPlan, BlockSpace, Method, PageSelection, ScatterRank};
use kvshard::geometry::{CacheGeometry, IndexerScale, PAGE_SIZE};
use kvshard::hicache::{reload, HostFormat, HostLayout, HostPool, PrefixSource, ReaderRank};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::key::Namespace;
use kvshard::pool::DevicePool;
use kvshard::shard::{CpGroup, DecodeLayout, Placement, Reader, ReloadPlan};
use kvshard::transfer::{DecodeRank, DecodeRegistration, PoolLayout};
use kvshard::Error;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::Rng;

const PAGE: u64 = PAGE_SIZE as u64;

/// The prefix every reload must reproduce: the unsharded reference pool (sequence page `P` at
/// its page `src[P]`) and its snapshot.
struct Reference {
    pool: Arc<DevicePool>,
    pages: u64,
    src: Vec<LogicalPage>,
    bytes: Vec<u8>,
}

fn reference(
    base: &Arc<dyn Backend>,
    g: &CacheGeometry,
    pages: u64,
    rng: &mut StdRng,
) -> Reference {
    let total = pages + 3;
    let pool =
        Arc::new(DevicePool::allocate(base.as_ref(), g, Placement::unsharded(), 0, total).unwrap());
    let storage = pool.storage().unwrap();
    base.write_sync(storage, 0, &synth::bytes(rng, storage.len()))
        .unwrap();
    let mut free: Vec<u64> = (1..total).collect();
    free.shuffle(rng);
    let src = free[..pages as usize]
        .iter()
        .map(|&p| LogicalPage(p))
        .collect();
    let bytes = pool.snapshot_sync(base.as_ref()).unwrap();
    Reference {
        pool,
        pages: total,
        src,
        bytes,
    }
}

/// Copies sequence pages `positions` of the reference into `host` at `pages` (enqueued on
/// `base`, not waited for).
fn copy_in(
    base: &Arc<dyn Backend>,
    r: &Reference,
    positions: &[u64],
    host: &Arc<HostPool>,
    pages: &[LocalPage],
) {
    let src = positions
        .iter()
        .map(|&p| LocalPage(r.src[p as usize].0))
        .collect();
    let plan = BlockCopyPlan::new(
        r.pool.as_ref(),
        PageSelection::Local(src),
        host.as_ref(),
        PageSelection::Local(pages.to_vec()),
        pages.len(),
    )
    .unwrap();
    let copy = BlockCopy::prepare(base.as_ref(), plan, r.pool.clone(), host.clone(), None).unwrap();
    copy.run(base.as_ref(), LAUNCH).unwrap();
}

/// A host pool of `pages` pages in `layout`, poisoned.
fn host_pool(
    base: &Arc<dyn Backend>,
    g: &CacheGeometry,
    pages: u64,
    layout: HostLayout,
) -> Arc<HostPool> {
    let h = HostPool::new_with(base.as_ref(), g, pages, HostFormat::kvshard(layout)).unwrap();
    h.fill(base.as_ref(), POISON).unwrap();
    Arc::new(h)
}

/// The writers' host pools holding the prefix as HiCache's backup left it: writer `w` holds the
/// pages it owns, at shuffled pages of its pool (not its padding page 0).
fn cached_in_hosts(
    base: &Arc<dyn Backend>,
    g: &CacheGeometry,
    r: &Reference,
    writers: CpGroup,
    layout: HostLayout,
    rng: &mut StdRng,
) -> PrefixSource {
    let pages = r.src.len() as u64;
    let mut source = PrefixSource {
        pools: Vec::new(),
        pages: vec![(0, LocalPage(0)); pages as usize],
    };
    for w in 0..writers.ranks() {
        let positions: Vec<u64> = (0..pages).filter(|&p| writers.owner(p) == w).collect();
        let host = host_pool(base, g, positions.len() as u64 + 2, layout);
        let mut free: Vec<u64> = (1..host.pages()).collect();
        free.shuffle(rng);
        let at: Vec<LocalPage> = free[..positions.len()]
            .iter()
            .map(|&p| LocalPage(p))
            .collect();
        copy_in(base, r, &positions, &host, &at);
        for (&p, &page) in positions.iter().zip(&at) {
            source.pages[p as usize] = (w as usize, page);
        }
        source.pools.push(host);
    }
    source
}

/// The reader ranks: pools of random bytes, each rank's pages of the prefix shuffled (the
/// indexer state on other pages where `separate_state` and the reader scatters rows), and
/// their snapshots before the reload.
fn readers(
    device: &common::Device,
    g: &CacheGeometry,
    plan: &ReloadPlan,
    separate_state: bool,
    rng: &mut StdRng,
) -> (Vec<ReaderRank>, u64, Vec<Vec<u8>>) {
    let m = plan.reader().ranks();
    let most = (0..m).map(|d| plan.pages_on(d)).max().unwrap();
    let pool_pages = 2 * most + 3;
    let has_indexer = g.components().iter().any(|c| c.component.is_indexer());
    let mut out = Vec::new();
    let mut before = Vec::new();
    for d in 0..m {
        let backend = device.stream();
        let (placement, rank) = match plan.reader() {
            Reader::Cp(group) => (Placement::new(group.ranks()).unwrap(), d),
            Reader::Decode(_) => (Placement::unsharded(), 0),
        };
        let pool = Arc::new(
            DevicePool::allocate(backend.as_ref(), g, placement, rank, pool_pages).unwrap(),
        );
        let storage = pool.storage().unwrap();
        backend
            .write_sync(storage, 0, &synth::bytes(rng, storage.len()))
            .unwrap();
        let mut free: Vec<u64> = (1..pool_pages).collect();
        free.shuffle(rng);
        let need = plan.pages_on(d) as usize;
        let pages: Vec<LocalPage> = free[..need].iter().map(|&p| LocalPage(p)).collect();
        let state_pages = if !has_indexer {
            Vec::new()
        } else if separate_state && plan.scatters() {
            free[need..2 * need].iter().map(|&p| LocalPage(p)).collect()
        } else {
            pages.clone()
        };
        before.push(pool.snapshot_sync(backend.as_ref()).unwrap());
        out.push(ReaderRank {
            backend,
            pool,
            pages: ScatterRank { pages, state_pages },
        });
    }
    (out, pool_pages, before)
}

/// What every reader rank's pool must hold after the reload: pages kept whole equal the
/// reference's pages; decode ranks equal the reference re-laid out as tests/dcp.rs lays it.
fn expected(
    g: &CacheGeometry,
    r: &Reference,
    plan: &ReloadPlan,
    readers: &[ReaderRank],
    pool_pages: u64,
    before: &[Vec<u8>],
) -> Vec<Vec<u8>> {
    match plan.reader() {
        Reader::Decode(layout) => {
            let case = Case {
                n: plan.writers().ranks(),
                layout,
                geometry: g.clone(),
                chunk_ends: vec![plan.tokens() as usize],
                prefix_pages: 0,
                contiguous: false,
                separate_state: false,
            };
            let reg = DecodeRegistration {
                request: REQUEST,
                layout,
                tokens: plan.tokens() as usize,
                prefix_pages: 0,
                ranks: readers
                    .iter()
                    .map(|d| DecodeRank {
                        layout: PoolLayout::of(&d.pool),
                        pages: d.pages.pages.clone(),
                        state_pages: d.pages.state_pages.clone(),
                    })
                    .collect(),
            };
            relayout(&case, &r.bytes, r.pages, &r.src, &reg, pool_pages, before)
        }
        Reader::Cp(_) => {
            let components = g.components();
            let mut out = before.to_vec();
            for p in 0..plan.pages() {
                let keep = plan.keeps(p)[0];
                let d = keep.rank as usize;
                let dst = readers[d].pages.pages[(keep.first / PAGE) as usize].0;
                for (c, comp) in components.iter().enumerate() {
                    for layer in 0..comp.layers() {
                        let from =
                            block_offset(&components, r.pages, c, layer, r.src[p as usize].0);
                        let to = block_offset(&components, pool_pages, c, layer, dst);
                        out[d][to..to + comp.block_bytes]
                            .copy_from_slice(&r.bytes[from..from + comp.block_bytes]);
                    }
                }
            }
            out
        }
    }
}

/// Reloads from `source` into fresh readers and returns their pools, checked against the
/// reference.
fn reload_and_check(
    device: &common::Device,
    g: &CacheGeometry,
    r: &Reference,
    plan: &ReloadPlan,
    source: &PrefixSource,
    separate_state: bool,
    rng: &mut StdRng,
) -> Vec<Vec<u8>> {
    let (ranks, pool_pages, before) = readers(device, g, plan, separate_state, rng);
    // A scatter is a kernel (a HiCache load's host-I/O shape too: its threads past what the
    // decode kernels take are not used); pages kept whole move by any method a HiCache load
    // takes.
    let method = if plan.scatters() {
        *[
            Method::Kernel(LAUNCH),
            Method::host_io(ranks[0].backend.as_ref(), 2),
        ]
        .choose(rng)
        .unwrap()
    } else {
        *[
            Method::Kernel(LAUNCH),
            Method::CopyEngine,
            Method::BatchedCopyEngine,
            Method::PerBlock,
        ]
        .choose(rng)
        .unwrap()
    };
    let done = reload(plan, source, &ranks, method).unwrap_or_else(|e| panic!("{plan}: {e}"));
    assert_eq!(done.events().is_empty(), plan.pages() == 0, "{plan}");
    let want = expected(g, r, plan, &ranks, pool_pages, &before);
    // Read on other streams, never waited for: the pools' usages order the reads.
    let got: Vec<Vec<u8>> = ranks
        .iter()
        .map(|d| d.pool.snapshot_sync(device.stream().as_ref()).unwrap())
        .collect();
    for (d, (got, want)) in got.iter().zip(&want).enumerate() {
        assert!(
            got == want,
            "{plan} (geometry {g:?}): reader rank {d} differs"
        );
    }
    got
}

/// A random reader: N' CP ranks with a random start (an unsharded server at N' = 1) or M
/// decode ranks at I = 1 or 64.
fn random_reader(rng: &mut StdRng) -> Reader {
    if rng.random_bool(0.4) {
        let n = rng.random_range(1..=4u32);
        Reader::Cp(CpGroup::new(n, rng.random_range(0..n)).unwrap())
    } else {
        let m = rng.random_range(1..=4u32);
        Reader::Decode(DecodeLayout::new(m, *[1u32, 64].choose(rng).unwrap()).unwrap())
    }
}

fn random_writers(rng: &mut StdRng) -> CpGroup {
    let n = rng.random_range(1..=4u32);
    CpGroup::new(n, rng.random_range(0..n)).unwrap()
}

/// The issue's shapes: a CP2 prefix into CP4, an unsharded server, DCP2 and DCP4 at I = 1 and 64.
fn issue_readers() -> Vec<Reader> {
    let mut out = vec![
        Reader::Cp(CpGroup::new(4, 1).unwrap()),
        Reader::Cp(CpGroup::unsharded()),
    ];
    for m in [2, 4] {
        for i in [1, 64] {
            out.push(Reader::Decode(DecodeLayout::new(m, i).unwrap()));
        }
    }
    out
}

// From the writers' host pools: random (N, rotation, reader, prefix length, geometry, host
// layout), then the issue's shapes.
common::on_cpu_and_gpu!(
    prefixes_in_host_pools_reload_into_any_parallelism,
    |device| -> Vec<Vec<u8>> {
        let mut rng = device.rng();
        let base = device.stream();
        let mut all = Vec::new();
        let mut cases: Vec<(CpGroup, Reader, u64)> = (0..16)
            .map(|_| {
                (
                    random_writers(&mut rng),
                    random_reader(&mut rng),
                    rng.random_range(1..=14u64),
                )
            })
            .collect();
        for reader in issue_readers() {
            cases.push((CpGroup::new(2, 1).unwrap(), reader, 9));
        }
        for (writers, reader, pages) in cases {
            let g = geometries().choose(&mut rng).unwrap().clone();
            let plan = ReloadPlan::new(writers, reader, pages).unwrap();
            // A scatter reads packed host blocks; a block copy any layout.
            let layout = if plan.scatters() {
                HostLayout::LayerFirst
            } else {
                *HostLayout::ALL.choose(&mut rng).unwrap()
            };
            let r = reference(&base, &g, pages, &mut rng);
            let source = cached_in_hosts(&base, &g, &r, writers, layout, &mut rng);
            let separate = rng.random_bool(0.5);
            all.extend(reload_and_check(
                &device, &g, &r, &plan, &source, separate, &mut rng,
            ));
        }
        all
    }
);

// Keys name no rank: a page's namespace is the geometry's (the same whatever pools of whatever
// placement hold it), so N ranks' keys are every reader's.
#[test]
fn keys_do_not_depend_on_the_parallelism() {
    let base: Arc<dyn Backend> = Arc::new(kvshard::backend::cpu::CpuBackend::new());
    let g = geometries()[0].clone();
    let namespaces: Vec<Namespace> = [
        Placement::unsharded(),
        Placement::new(2).unwrap(),
        Placement::new(4).unwrap(),
    ]
    .into_iter()
    .map(|placement| {
        let pool =
            DevicePool::allocate(base.as_ref(), &g, placement, placement.shard() - 1, 4).unwrap();
        Namespace::new(pool.geometry(), IndexerScale::Ue8m0, b"t").unwrap()
    })
    .collect();
    assert!(namespaces.windows(2).all(|w| w[0] == w[1]));
}

// Everything is checked before anything is enqueued: readers of the wrong count or share, a
// source naming a page twice or outside its pool, separate state pages where pages are kept
// whole.
#[test]
fn bad_reloads_are_refused_before_anything_moves() {
    common::run_on_cpu(
        "bad_reloads_are_refused_before_anything_moves",
        &[],
        |device| refusals(&device),
    );
}

fn refusals(device: &common::Device) {
    let base = device.stream();
    let mut rng = device.rng();
    let g = geometries()[0].clone();
    let writers = CpGroup::new(2, 0).unwrap();
    let r = reference(&base, &g, 5, &mut rng);
    let source = cached_in_hosts(&base, &g, &r, writers, HostLayout::LayerFirst, &mut rng);
    let plan = ReloadPlan::new(writers, Reader::Cp(CpGroup::new(2, 1).unwrap()), 5).unwrap();
    let (ranks, _, before) = readers(device, &g, &plan, false, &mut rng);
    let untouched = |ranks: &[ReaderRank]| {
        for (d, b) in ranks.iter().zip(&before) {
            assert!(d.pool.snapshot_sync(device.stream().as_ref()).unwrap() == *b);
        }
    };
    let refused = |source: &PrefixSource, ranks: &[ReaderRank]| {
        let e = reload(&plan, source, ranks, Method::Kernel(LAUNCH)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument(_) | Error::OutOfRange { .. } | Error::DuplicatePage { .. }
            ),
            "{e}"
        );
    };
    refused(&source, &ranks[..1]);
    let mut short = source.clone();
    short.pages.pop();
    refused(&short, &ranks);
    let mut twice = source.clone();
    let (p0, first) = twice.pages[0];
    twice.pages[2] = (p0, first);
    refused(&twice, &ranks);
    let mut outside = source.clone();
    outside.pages[1].1 = LocalPage(1000);
    refused(&outside, &ranks);
    let mut missing_pool = source.clone();
    missing_pool.pages[1].0 = 7;
    refused(&missing_pool, &ranks);
    let mut wrong_share = ranks.clone();
    wrong_share[0].pages.pages.pop();
    wrong_share[0].pages.state_pages.pop();
    refused(&source, &wrong_share);
    let e = reload(&plan, &source, &ranks, Method::RangeKernel(LAUNCH)).unwrap_err();
    assert!(matches!(e, Error::UnsupportedMethod { .. }), "{e}");
    let mut separate = ranks.clone();
    separate[1].pages.state_pages.reverse();
    if separate[1].pages.state_pages != ranks[1].pages.pages {
        refused(&source, &separate);
    }
    untouched(&ranks);
}

// From disk: the N writers store their pages (each its own, from its host pool); each reader
// rank opens the directory read-only, loads only the pages the plan gives it into a host pool
// of its own, and the reload runs from those: random (N, rotation, reader, prefix length), then
// the issue's shapes (a CP2 prefix into CP4, an unsharded server, DCP2 and DCP4 at I = 1, 64).
#[cfg(feature = "nixl")]
common::on_cpu_and_gpu!(
    prefixes_on_disk_reload_into_any_parallelism,
    |device| -> Vec<Vec<u8>> { from_disk(&device) }
);

#[cfg(feature = "nixl")]
fn from_disk(device: &common::Device) -> Vec<Vec<u8>> {
    use kvshard::hicache::load_reads_sync;
    use kvshard::key::PageKey;
    use kvshard::pool::disk::{DiskStore, LoadOutcome};
    let test = "prefixes_on_disk_reload_into_any_parallelism";
    if !common::storage::nixl_available(test) {
        return Vec::new();
    }
    let mut rng = device.rng();
    let base = device.stream();
    let mut cases: Vec<(CpGroup, Reader, u64)> = (0..6)
        .map(|_| {
            (
                random_writers(&mut rng),
                random_reader(&mut rng),
                rng.random_range(1..=12u64),
            )
        })
        .collect();
    for reader in issue_readers() {
        cases.push((CpGroup::new(2, 1).unwrap(), reader, 9));
    }
    let mut all = Vec::new();
    for (k, (writers, reader, pages)) in cases.into_iter().enumerate() {
        let dir = common::storage::scratch(&format!("{test}_{k}"));
        let g = geometries()[0].clone();
        let plan = ReloadPlan::new(writers, reader, pages).unwrap();
        let r = reference(&base, &g, pages, &mut rng);
        let ns = Namespace::new(&g, IndexerScale::Ue8m0, b"reload").unwrap();
        let tokens: Vec<u32> = (0..pages * PAGE).map(|_| rng.random()).collect();
        let keys = PageKey::chain(&ns, &tokens, None);
        let written = cached_in_hosts(&base, &g, &r, writers, HostLayout::ALL[k % 3], &mut rng);
        let n = writers.ranks();
        for (w, host) in written.pools.iter().enumerate() {
            let config = common::storage::config(&dir, w as u32, n, 32);
            let mut store = DiskStore::open(host.clone(), device.stream(), config).unwrap();
            let items: Vec<(PageKey, LocalPage)> = (0..pages)
                .filter(|&p| written.pages[p as usize].0 == w)
                .map(|p| (keys[p as usize], written.pages[p as usize].1))
                .collect();
            store.store_sync(&items).unwrap();
        }
        // Each reader rank reads its pages alone into its own host pool (layer_first: a
        // scatter reads packed blocks).
        let mut source = PrefixSource {
            pools: Vec::new(),
            pages: vec![(0, LocalPage(0)); pages as usize],
        };
        for d in 0..reader.ranks() {
            let reads: Vec<u64> = plan.reads_of(d).map(|x| x.position).collect();
            let host = host_pool(&base, &g, reads.len() as u64 + 2, HostLayout::LayerFirst);
            let mut config = common::storage::config(&dir, d % n, n, 32);
            config.read_only = true;
            let mut store = DiskStore::open(host.clone(), device.stream(), config).unwrap();
            let at: Vec<LocalPage> = (1..=reads.len() as u64).rev().map(LocalPage).collect();
            let found = load_reads_sync(&plan, d, &mut store, &keys, &at).unwrap();
            assert!(
                found.iter().all(|&f| f == LoadOutcome::Loaded),
                "{plan}: {found:?}"
            );
            for (&p, &page) in reads.iter().zip(&at) {
                source.pages[p as usize] = (d as usize, page);
            }
            source.pools.push(host);
        }
        all.extend(reload_and_check(
            device,
            &g,
            &r,
            &plan,
            &source,
            k % 2 == 0,
            &mut rng,
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
    all
}
