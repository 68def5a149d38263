//! HiCache: host pool layouts, owner-aware planning, transfers on every route (the four direct
//! I/O backends and both staged relayouts) for every host layout, on device pools kvshard
//! allocated and on pools wrapping separately allocated per-layer buffers, and the controller's
//! ordering, acks, policies, per-layer readiness and failure handling. Each transfer is checked
//! against its meaning (owned blocks moved, everything else still poisoned), from one body on
//! the CPU twin (`cpu_*`) and on the GPU (`gpu_*`, SKIPPED without one). Per-layer readiness
//! is observed on the deferred CPU backend (a consumer that waited for layer 0 sees layer 0 and
//! the MTP draft landed and the last layer not yet), and on the GPU with a load large enough
//! to be caught in flight.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::synth::{self, POISON};
use kvshard::abi;
use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::{
    AddressSpace, Backend, Buffer, Copy2d, Event, KernelFamily, Launch, MemoryKind,
};
use kvshard::copy::{BlockSpace, Direction, IoCalls, LayerSignals, Layers, Method};
use kvshard::geometry::{CacheGeometry, Component, ComponentLayout, LatentLayout, PoolGeometry};
use kvshard::hicache::{
    pages_of_tokens, CacheNode, HiCacheController, HostLayout, HostPool, HostTransfer, LayerReady,
    Route, Streams, TransferPlan, WritePolicy, AUTO_STAGED_PAGES, DEFAULT_STAGING_PAGES,
};
use kvshard::index::{LocalPage, LogicalPage, ModelLayer, Slot, StoredLayer};
use kvshard::pool::{DevicePool, PoolBuffers, RawBuffer};
use kvshard::shard::{AllocRequest, ChainStart, Placement, ShardAllocator};
use kvshard::Error;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DEVICE_PAGES: u64 = 12;
const HOST_PAGES: u64 = 14;

const IOS: [Method; 4] = [
    common::host_io(2),
    Method::CopyEngine,
    Method::PerBlock,
    Method::BatchedCopyEngine,
];

/// Every route: the four direct I/O backends, then staging with either relayout.
const ROUTES: [Route; 6] = [
    Route::Direct(common::host_io(2)),
    Route::Direct(Method::CopyEngine),
    Route::Direct(Method::PerBlock),
    Route::Direct(Method::BatchedCopyEngine),
    Route::Staged(common::host_io(2)),
    Route::Staged(Method::CopyEngine),
];

const RELAYOUTS: [Method; 2] = [common::host_io(2), Method::CopyEngine];

fn geometries() -> Vec<CacheGeometry> {
    vec![
        // A shared-indexer layer (1) and the draft: four components, single-layer ones too.
        CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![true, false, true],
        )),
        CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Scaled, 2)),
    ]
}

fn lp(pages: &[u64]) -> Vec<LogicalPage> {
    pages.iter().map(|&p| LogicalPage(p)).collect()
}

// ---------------------------------------------------------------------------------------------
// Device pools

/// How a test's device pool is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PoolKind {
    /// `DevicePool::allocate`: one allocation, a uniform layer stride.
    Allocated,
    /// `DevicePool::wrap` over per-layer buffers allocated one by one from the same backend,
    /// with spacers between them: no uniform layer stride, as an engine's buffers.
    Wrapped,
}

const KINDS: [PoolKind; 2] = [PoolKind::Allocated, PoolKind::Wrapped];

/// A device pool and the memory behind it. Declared before what uses the pool, so it is
/// dropped last.
struct TestPool {
    pool: Arc<DevicePool>,
    /// What random data is written into: the pool's storage, or its layer buffers.
    buffers: Vec<Buffer>,
    /// Spacers between wrapped layer buffers, kept so the addresses stay as they are.
    _spacers: Vec<Buffer>,
}

fn make_pool(
    b: &dyn Backend,
    g: &CacheGeometry,
    placement: Placement,
    rank: u32,
    pages: u64,
    kind: PoolKind,
) -> TestPool {
    match kind {
        PoolKind::Allocated => {
            let pool = DevicePool::allocate(b, g, placement, rank, pages).unwrap();
            let buffers = vec![pool.storage().unwrap().clone()];
            TestPool {
                pool: Arc::new(pool),
                buffers,
                _spacers: Vec::new(),
            }
        }
        PoolKind::Wrapped => {
            let components = g.components();
            let mut layers: Vec<Vec<Buffer>> = vec![Vec::new(); components.len()];
            let mut spacers = Vec::new();
            let deepest = components.iter().map(|c| c.layers()).max().unwrap_or(0);
            // Layer by layer across components, a spacer of growing size before each buffer.
            for l in 0..deepest {
                for (c, comp) in components.iter().enumerate() {
                    if l >= comp.layers() {
                        continue;
                    }
                    spacers.push(b.alloc(4096 * (1 + l + 3 * c), MemoryKind::Device).unwrap());
                    let need = PoolBuffers::required_bytes(g, comp.component, pages).unwrap();
                    // Engines size buffers in tokens: a few bytes beyond the last page.
                    let buffer = b.alloc(need as usize + 100, MemoryKind::Device).unwrap();
                    layers[c].push(buffer);
                }
            }
            // Descending addresses, whatever order the allocator gave: two layers or more are
            // never evenly spaced upwards (two ascending buffers would be one stride apart).
            let mut buffers = PoolBuffers::default();
            for (c, comp) in components.iter().enumerate() {
                layers[c].sort_by_key(|b| std::cmp::Reverse(b.addr()));
                let raws = match comp.component {
                    Component::TargetLatent => &mut buffers.target_latent,
                    Component::TargetIndexer => &mut buffers.target_indexer,
                    Component::DraftLatent => &mut buffers.draft_latent,
                    Component::DraftIndexer => &mut buffers.draft_indexer,
                };
                raws.extend(layers[c].iter().map(|b| RawBuffer {
                    addr: b.addr(),
                    bytes: b.len() as u64,
                }));
            }
            assert_eq!(buffers.pages_covered(g), Some(pages));
            // SAFETY: every address is a live allocation of `b` holding at least `pages`
            // blocks; the buffers are kept with the pool.
            let pool = unsafe { DevicePool::wrap(b, g, placement, rank, pages, &buffers) }.unwrap();
            for comp in &components {
                let stride = pool.layer_stride(comp.component).unwrap();
                assert_eq!(stride, None, "{}: a wrapped pool's layers", comp.component);
            }
            TestPool {
                pool: Arc::new(pool),
                buffers: layers.into_iter().flatten().collect(),
                _spacers: spacers,
            }
        }
    }
}

impl TestPool {
    /// Random bytes everywhere, from `seed`.
    fn randomize(&self, b: &dyn Backend, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        for buffer in &self.buffers {
            b.write_sync(buffer, 0, &synth::bytes(&mut rng, buffer.len()))
                .unwrap();
        }
    }
}

/// A pool kvshard allocated, random bytes everywhere.
fn random_pool(
    b: &dyn Backend,
    g: &CacheGeometry,
    placement: Placement,
    rank: u32,
    seed: u64,
) -> Arc<DevicePool> {
    let p = make_pool(b, g, placement, rank, DEVICE_PAGES, PoolKind::Allocated);
    p.randomize(b, seed);
    p.pool
}

// ---------------------------------------------------------------------------------------------
// Nodes and expectations

/// An allocator that has handed out and taken back a few chains, so what it allocates next
/// mixes runs of consecutive local pages with jumps.
fn scrambled(rng: &mut impl Rng, placement: Placement, pages: u64) -> ShardAllocator {
    let mut a = ShardAllocator::new(placement, pages).unwrap();
    let mut chain = |a: &mut ShardAllocator| {
        let pages = rng.random_range(1..=2 * placement.shard() as usize);
        a.alloc(AllocRequest {
            chain: ChainStart::New,
            pages,
        })
        .unwrap()
        .pages
    };
    let _kept = chain(&mut a);
    let freed = chain(&mut a);
    let _kept2 = chain(&mut a);
    a.free(&freed).unwrap();
    a
}

/// Logical pages of one node as every rank sees them: its device pages, the host pages a
/// backup gives it, and the device pages a later load brings it back to.
#[derive(Debug, Clone)]
struct Node {
    device: Vec<LogicalPage>,
    host: Vec<LogicalPage>,
    reload: Vec<LogicalPage>,
}

fn node(rng: &mut impl Rng, placement: Placement, pages: usize) -> Node {
    let device = scrambled(rng, placement, DEVICE_PAGES)
        .alloc(AllocRequest {
            chain: ChainStart::New,
            pages,
        })
        .unwrap()
        .pages;
    let host = scrambled(rng, placement, HOST_PAGES)
        .alloc_matching(&device)
        .unwrap();
    let reload = scrambled(rng, placement, DEVICE_PAGES)
        .alloc_matching(&host)
        .unwrap();
    Node {
        device,
        host,
        reload,
    }
}

/// Rank `rank`'s plan pairing `node`'s device pages with its host pages.
fn node_plan(placement: Placement, rank: u32, node: &Node) -> TransferPlan {
    TransferPlan::new(
        placement,
        rank,
        &node.device,
        &node.host,
        DEVICE_PAGES,
        HOST_PAGES,
    )
    .unwrap()
}

/// Offset of block (`c`, `l`, `p`) in a canonical snapshot of `pages` pages.
fn canon(components: &[ComponentLayout], pages: u64, c: usize, l: usize, p: u64) -> usize {
    let before: usize = components[..c]
        .iter()
        .map(|x| x.layers() * pages as usize * x.block_bytes)
        .sum();
    before + (l * pages as usize + p as usize) * components[c].block_bytes
}

/// `dst` with the owned pairs' blocks of `src` copied in (both canonical snapshots).
fn expect_moved(
    components: &[ComponentLayout],
    (placement, rank): (Placement, u32),
    (src, src_pages, src_total): (&[u8], &[LogicalPage], u64),
    (dst, dst_pages, dst_total): (&mut [u8], &[LogicalPage], u64),
) {
    for (&s, &d) in src_pages.iter().zip(dst_pages) {
        if placement.owner(s) != rank {
            continue;
        }
        let (s, d) = (placement.local(s).0, placement.local(d).0);
        for (c, comp) in components.iter().enumerate() {
            for l in 0..comp.layers() {
                let from = canon(components, src_total, c, l, s);
                let to = canon(components, dst_total, c, l, d);
                let b = comp.block_bytes;
                dst[to..to + b].copy_from_slice(&src[from..from + b]);
            }
        }
    }
}

struct Trip {
    source: Vec<u8>,
    host: Vec<u8>,
    reloaded: Vec<u8>,
}

/// Asserts that a round trip of `rank`'s pages put exactly its owned pages of `source` (at
/// `device` pages) into `host` (at `host_pages`; every other byte poison) and from there into
/// `reloaded` (at `reload` pages; every other byte as in `device_base`).
fn assert_round_trip(
    components: &[ComponentLayout],
    owner: (Placement, u32),
    (source, host, reloaded): (&[u8], &[u8], &[u8]),
    (device, host_pages, reload): (&[LogicalPage], &[LogicalPage], &[LogicalPage]),
    device_base: Vec<u8>,
    case: &str,
) {
    let mut want_host = vec![POISON; host.len()];
    expect_moved(
        components,
        owner,
        (source, device, DEVICE_PAGES),
        (&mut want_host, host_pages, HOST_PAGES),
    );
    assert!(host == want_host, "{case}: host");
    let mut want_device = device_base;
    expect_moved(
        components,
        owner,
        (host, host_pages, HOST_PAGES),
        (&mut want_device, reload, DEVICE_PAGES),
    );
    assert!(reloaded == want_device, "{case}: reloaded device pool");
}

// ---------------------------------------------------------------------------------------------
// Round trips of one HostTransfer each way

/// Where a round trip runs: its backend (and a second stream of it, for staged relayouts),
/// the cache, the host layout, the rank and how its device pools are made.
struct Where<'a> {
    b: &'a dyn Backend,
    other: &'a dyn Backend,
    g: &'a CacheGeometry,
    layout: HostLayout,
    placement: Placement,
    rank: u32,
    kind: PoolKind,
}

/// Backs `node` up from a random pool of the rank into a poisoned host pool, then loads it
/// into a poisoned device pool, moving each direction with `run` (which leaves `w.b`'s stream
/// ordered after everything it enqueued); returns every pool's bytes.
fn round_trip_with(w: &Where<'_>, node: &Node, run: &dyn Fn(&mut HostTransfer)) -> Trip {
    let b = w.b;
    let source = make_pool(b, w.g, w.placement, w.rank, DEVICE_PAGES, w.kind);
    source.randomize(b, 7 + u64::from(w.rank));
    let reloaded = make_pool(b, w.g, w.placement, w.rank, DEVICE_PAGES, w.kind);
    reloaded.pool.fill(b, POISON).unwrap();
    let host = Arc::new(HostPool::new(b, w.g, HOST_PAGES, w.layout).unwrap());
    host.fill(b, POISON).unwrap();
    let plan = |device: &[LogicalPage]| {
        TransferPlan::new(
            w.placement,
            w.rank,
            device,
            &node.host,
            DEVICE_PAGES,
            HOST_PAGES,
        )
        .unwrap()
    };
    let mut backup = HostTransfer::new(
        source.pool.clone(),
        host.clone(),
        plan(&node.device),
        Direction::Backup,
    )
    .unwrap();
    run(&mut backup);
    let mut load = HostTransfer::new(
        reloaded.pool.clone(),
        host.clone(),
        plan(&node.reload),
        Direction::Load,
    )
    .unwrap();
    run(&mut load);
    b.synchronize().unwrap();
    Trip {
        source: source.pool.snapshot_sync(b).unwrap(),
        host: host.snapshot_sync(b).unwrap(),
        reloaded: reloaded.pool.snapshot_sync(b).unwrap(),
    }
}

/// Runs `t` on `route` with `w`'s streams (staged: `chunk`-page staging buffers, dropped once
/// `w.b` has passed them).
fn run_route(w: &Where<'_>, t: &mut HostTransfer, route: Route, chunk: u64) {
    match route {
        Route::Direct(io) => {
            if matches!(io, Method::Kernel(_)) {
                t.prepare_kernel_sync(w.other, &mut Vec::new()).unwrap();
            }
            t.run(w.b, io, Layers::All).unwrap();
        }
        Route::Staged(how) => {
            let staging = t.staging(w.b, chunk).unwrap();
            if matches!(how, Method::Kernel(_)) {
                t.prepare_staged_sync(w.other, &staging, &mut Vec::new())
                    .unwrap();
            }
            t.run_staged(w.b, w.other, &staging, how).unwrap();
            // The staging is dropped here: `w.b` reaching this point means all has landed.
            w.b.synchronize().unwrap();
        }
        Route::Auto => {
            let route = Route::auto(t.direction(), t.plan().len(), w.layout, w.b);
            run_route(w, t, route, chunk)
        }
    }
}

fn round_trip(w: &Where<'_>, route: Route, node: &Node) -> Trip {
    round_trip_with(w, node, &|t| run_route(w, t, route, 2))
}

/// Calls `f(geometry, placement, rank, node)` for every test geometry, every N of `shards` and
/// the ranks `ranks(N)` names, with one node of 3N + 1 random pages per (geometry, N).
fn for_each_rank(
    rng: &mut impl Rng,
    shards: &[u32],
    ranks: impl Fn(u32) -> Vec<u32>,
    mut f: impl FnMut(&CacheGeometry, Placement, u32, &Node),
) {
    for g in geometries() {
        for &n in shards {
            let placement = Placement::new(n).unwrap();
            let node = node(rng, placement, 3 * n as usize + 1);
            for rank in ranks(n) {
                f(&g, placement, rank, &node);
            }
        }
    }
}

fn all_ranks(n: u32) -> Vec<u32> {
    (0..n).collect()
}

// A direct round trip (backup, then load into other pages) moves exactly the rank's owned
// pages, on every I/O backend and host layout, at every rank of N in {1, 2, 4}.
common::on_cpu_and_gpu!(
    round_trips_move_exactly_the_owned_pages_for_every_layout_and_backend,
    |device| {
        let mut rng = device.rng();
        let (b, other) = (device.stream(), device.stream());
        for_each_rank(
            &mut rng,
            &[1, 2, 4],
            all_ranks,
            |g, placement, rank, node| {
                for layout in HostLayout::ALL {
                    let w = Where {
                        b: b.as_ref(),
                        other: other.as_ref(),
                        g,
                        layout,
                        placement,
                        rank,
                        kind: PoolKind::Allocated,
                    };
                    for io in IOS {
                        let trip = round_trip(&w, Route::Direct(io), node);
                        assert_round_trip(
                            &g.components(),
                            (placement, rank),
                            (&trip.source, &trip.host, &trip.reloaded),
                            (&node.device, &node.host, &node.reload),
                            vec![POISON; trip.reloaded.len()],
                            &format!("N={} rank {rank} {layout} {io}", placement.shard()),
                        );
                    }
                }
            },
        );
    }
);

// Every route, the staged ones too, round trips exactly the owned pages on every host layout,
// for pools kvshard allocated and for pools wrapping an engine's per-layer buffers.
common::on_cpu_and_gpu!(
    every_route_round_trips_on_every_host_layout_for_allocated_and_wrapped_pools,
    |device| {
        let mut rng = device.rng();
        let (b, other) = (device.stream(), device.stream());
        for_each_rank(
            &mut rng,
            &[1, 2, 3],
            all_ranks,
            |g, placement, rank, node| {
                for layout in HostLayout::ALL {
                    for kind in KINDS {
                        let w = Where {
                            b: b.as_ref(),
                            other: other.as_ref(),
                            g,
                            layout,
                            placement,
                            rank,
                            kind,
                        };
                        for route in ROUTES {
                            let trip = round_trip(&w, route, node);
                            let case = format!(
                                "N={} rank {rank} {layout} {kind:?} pool, {route}",
                                placement.shard()
                            );
                            assert_round_trip(
                                &g.components(),
                                (placement, rank),
                                (&trip.source, &trip.host, &trip.reloaded),
                                (&node.device, &node.host, &node.reload),
                                vec![POISON; trip.reloaded.len()],
                                &case,
                            );
                        }
                    }
                }
            },
        );
    }
);

#[test]
fn staging_of_another_transfer_or_no_ctas_is_refused_before_anything_moves() {
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(1).unwrap();
    let pool = Arc::new(DevicePool::allocate(&b, g, placement, 0, DEVICE_PAGES).unwrap());
    let host = Arc::new(HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirstDirect).unwrap());
    let plan = TransferPlan::new(
        placement,
        0,
        &lp(&[1, 2]),
        &lp(&[1, 2]),
        DEVICE_PAGES,
        HOST_PAGES,
    )
    .unwrap();
    let mut load =
        HostTransfer::new(pool.clone(), host.clone(), plan.clone(), Direction::Load).unwrap();
    let mut backup = HostTransfer::new(pool, host.clone(), plan, Direction::Backup).unwrap();
    let load_staging = load.staging(&b, 2).unwrap();
    assert_eq!(load_staging.chunk_pages(), 2);
    assert!(load.staging(&b, 0).is_err());
    let target_latent = host.buffer(Component::TargetLatent).unwrap();
    let before = b.read_sync(target_latent, 0, 4096).unwrap();
    let other = b.new_stream();
    for how in RELAYOUTS {
        let err = backup
            .run_staged(&b, &other, &load_staging, how)
            .unwrap_err();
        assert!(err.to_string().contains("staging made for a Load"), "{err}");
    }
    let err = backup
        .prepare_staged_sync(&b, &load_staging, &mut Vec::new())
        .unwrap_err();
    assert!(err.to_string().contains("staging made for a Load"), "{err}");
    let err = load
        .run_staged(&b, &other, &load_staging, common::host_io(0))
        .unwrap_err();
    assert!(
        err.to_string().contains("need 1 to 2147483647 CTAs"),
        "{err}"
    );
    // A kernel relayout needs its tables first; the copy engine does not.
    let err = load
        .run_staged(&b, &other, &load_staging, common::host_io(2))
        .unwrap_err();
    assert!(err.to_string().contains("prepare_staged_sync"), "{err}");
    // Nor does the SM kernel run without its tables.
    let err = load.run(&b, common::host_io(2), Layers::All).unwrap_err();
    assert!(err.to_string().contains("prepare_kernel_sync"), "{err}");
    b.synchronize().unwrap();
    assert_eq!(b.read_sync(target_latent, 0, 4096).unwrap(), before);
    load.prepare_staged_sync(&b, &load_staging, &mut Vec::new())
        .unwrap();
    load.run_staged(&b, &other, &load_staging, common::host_io(2))
        .unwrap();
    // A kernel relayout prepared for one staging is refused with another (its tables name the
    // first staging's mirrors), until it is prepared for that one too.
    let second = load.staging(&b, 1).unwrap();
    let err = load
        .run_staged(&b, &other, &second, common::host_io(2))
        .unwrap_err();
    assert!(err.to_string().contains("with this staging"), "{err}");
    let mut spare = Vec::new();
    load.prepare_staged_sync(&b, &second, &mut spare).unwrap();
    assert!(
        spare.is_empty(),
        "the first staging's tables went back to the spares and were reused"
    );
    load.run_staged(&b, &other, &second, common::host_io(2))
        .unwrap();
    b.synchronize().unwrap();
}

/// Every relayout and chunk size of the staged path on `w` against the direct copy engine on
/// the CPU reference, for every layout (token-major `page_first` included: both relayouts
/// serve it).
fn staged_matches_direct(w: &Where<'_>, chunks: &[u64], node: &Node) {
    let cpu = CpuBackend::new();
    let cpu_other = cpu.new_stream();
    for layout in HostLayout::ALL {
        let reference = Where {
            b: &cpu,
            other: &cpu_other,
            layout,
            ..*w
        };
        let want = round_trip(&reference, Route::Direct(Method::CopyEngine), node);
        let here = Where { layout, ..*w };
        for &chunk in chunks {
            for how in RELAYOUTS {
                let got = round_trip_with(&here, node, &|t| {
                    run_route(&here, t, Route::Staged(how), chunk)
                });
                let case = format!("N={} {layout} {how:?} chunk {chunk}", w.placement.shard());
                assert!(want.source == got.source, "{case}: random source differs");
                assert!(want.host == got.host, "{case}: host");
                assert!(want.reloaded == got.reloaded, "{case}: reloaded");
            }
        }
    }
}

// A staged round trip, through either relayout and in staging chunks of any size, moves the
// same bytes as the direct copy engine on the CPU twin.
common::on_cpu_and_gpu!(staged_round_trips_equal_the_direct_ones, |device| {
    let mut rng = device.rng();
    let (b, other) = (device.stream(), device.stream());
    for g in geometries() {
        for n in [1u32, 2] {
            let placement = Placement::new(n).unwrap();
            let node = node(&mut rng, placement, 3 * n as usize + 1);
            for rank in 0..n {
                for kind in KINDS {
                    let w = Where {
                        b: b.as_ref(),
                        other: other.as_ref(),
                        g: &g,
                        layout: HostLayout::LayerFirst,
                        placement,
                        rank,
                        kind,
                    };
                    staged_matches_direct(&w, &[1, 2, 3, 64], &node);
                }
            }
        }
    }
});

#[test]
fn layouts_place_blocks_where_domain_md_says_and_tile_their_buffers() {
    let g = &geometries()[0];
    let b = CpuBackend::new();
    let (pages, b36, b84) = (5u64, 36_864u64, 8448u64);
    for layout in HostLayout::ALL {
        let host = HostPool::new(&b, g, pages, layout).unwrap();
        let base = |c: Component| host.buffer(c).unwrap().addr();
        let row = |c, l, p, r| host.row_addr(c, StoredLayer(l), LocalPage(p), r);
        // Target latent (3 layers of 64 rows of 576 B): layer 2, page 3, row 5.
        let latent = row(Component::TargetLatent, 2, 3, 5).unwrap() - base(Component::TargetLatent);
        // Target indexer (layers 0 and 2 stored as 0 and 1): stored layer 1, page 4.
        let indexer =
            row(Component::TargetIndexer, 1, 4, 0).unwrap() - base(Component::TargetIndexer);
        let (want_latent, want_indexer) = match layout {
            HostLayout::LayerFirst => (2 * 5 * b36 + 3 * b36 + 5 * 576, 5 * b84 + 4 * b84),
            HostLayout::PageFirstDirect => (3 * (3 * b36) + 2 * b36 + 5 * 576, 4 * 2 * b84 + b84),
            HostLayout::PageFirst => (
                3 * (64 * 3 * 576) + 2 * 576 + 5 * (3 * 576),
                4 * 2 * b84 + b84,
            ),
        };
        assert_eq!((latent, indexer), (want_latent, want_indexer), "{layout}");
        // Every row of every block, over all layers and pages, tiles its buffer exactly once.
        for comp in host.components() {
            let c = comp.component;
            let mut rows: Vec<u64> = (0..comp.layers())
                .flat_map(|l| (0..pages).map(move |p| (l, p)))
                .flat_map(|(l, p)| (0..comp.rows).map(move |r| (l, p, r)))
                .map(|(l, p, r)| row(c, l, p, r).unwrap() - base(c))
                .collect();
            rows.sort_unstable();
            let tiled = rows
                .iter()
                .enumerate()
                .all(|(i, &at)| at == i as u64 * comp.row_bytes as u64);
            assert!(tiled, "{layout} {c}");
            assert_eq!(
                host.buffer(c).unwrap().len(),
                rows.len() * comp.row_bytes,
                "{layout} {c}"
            );
        }
        assert!(row(Component::TargetLatent, 3, 0, 0).is_err());
        assert!(row(Component::TargetLatent, 0, 5, 0).is_err());
        assert!(row(Component::TargetLatent, 0, 0, 64).is_err());
        assert_eq!(host.layout(), layout);
        assert_eq!(host.pages(), pages);
    }
}

#[test]
fn every_layout_holds_the_same_canonical_bytes_after_a_backup() {
    let mut rng = common::rng("every_layout_holds_the_same_canonical_bytes");
    let b = CpuBackend::new();
    let other = b.new_stream();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let node = node(&mut rng, placement, 9);
    let snapshots: Vec<Vec<u8>> = HostLayout::ALL
        .iter()
        .map(|&layout| {
            let w = Where {
                b: &b,
                other: &other,
                g,
                layout,
                placement,
                rank: 1,
                kind: PoolKind::Allocated,
            };
            round_trip(&w, Route::Direct(Method::CopyEngine), &node).host
        })
        .collect();
    assert!(snapshots.windows(2).all(|w| w[0] == w[1]));
    assert!(snapshots[0].iter().any(|&x| x != POISON));
}

#[test]
fn per_layer_runs_add_up_to_the_whole_transfer() {
    let mut rng = common::rng("per_layer_runs_add_up");
    let b = CpuBackend::new();
    let other = b.new_stream();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let node = node(&mut rng, placement, 9);
    let draft = ModelLayer(g.target.num_layers());
    for layout in HostLayout::ALL {
        let w = Where {
            b: &b,
            other: &other,
            g,
            layout,
            placement,
            rank: 0,
            kind: PoolKind::Allocated,
        };
        for io in IOS {
            let whole = round_trip(&w, Route::Direct(io), &node).host;
            let source = random_pool(&b, g, placement, 0, 7);
            let host = Arc::new(HostPool::new(&b, g, HOST_PAGES, layout).unwrap());
            host.fill(&b, POISON).unwrap();
            let plan = node_plan(placement, 0, &node);
            let mut t = HostTransfer::new(source, host.clone(), plan, Direction::Backup).unwrap();
            t.prepare_kernel_sync(&b, &mut Vec::new()).unwrap();
            // The draft's layer is read with target layer 0 (one readiness group): running
            // every group once moves everything once.
            assert_eq!(t.group(draft), ModelLayer(0));
            assert_eq!(
                t.bytes(Layers::One(draft)).unwrap(),
                t.bytes(Layers::One(ModelLayer(0))).unwrap()
            );
            let mut bytes = 0;
            for m in (0..g.model_layers()).map(ModelLayer) {
                if t.group(m) != m {
                    continue;
                }
                t.run(&b, io, Layers::One(m)).unwrap();
                bytes += t.bytes(Layers::One(m)).unwrap();
            }
            assert_eq!(bytes, t.bytes(Layers::All).unwrap());
            assert!(host.snapshot_sync(&b).unwrap() == whole, "{layout} {io}");
            assert!(matches!(
                t.run(&b, io, Layers::One(ModelLayer(4))),
                Err(Error::OutOfRange { index: 4, .. })
            ));
        }
    }
}

#[test]
fn signalled_runs_count_every_layer_to_its_target() {
    let mut rng = common::rng("signalled_runs_count_every_layer");
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let node = node(&mut rng, placement, 9);
    let source = random_pool(&b, g, placement, 1, 3);
    let host = Arc::new(HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirst).unwrap());
    let plan = node_plan(placement, 1, &node);
    let owned = plan.len() as u32;
    let mut t = HostTransfer::new(source, host, plan, Direction::Backup).unwrap();
    let mut signals = LayerSignals::new(&b, g.model_layers()).unwrap();
    assert!(
        t.run_signalled(&b, Launch::host_io(&b, 2), &mut signals)
            .is_err(),
        "tables missing"
    );
    t.prepare_kernel_sync(&b, &mut Vec::new()).unwrap();
    for round in 1..=2u32 {
        let waits = t
            .run_signalled(&b, Launch::host_io(&b, 2), &mut signals)
            .unwrap();
        // Readiness group 0 is target layer 0 (latent + indexer) and the draft's layer (latent
        // + indexer); layer 1 has latent only, layer 2 latent + indexer. The draft's model
        // layer (3) counts into group 0 and is ready with it.
        let per_layer = [4, 1, 2, 4].map(|pairs| round * pairs * owned);
        let targets: Vec<u32> = waits.iter().map(|w| w.target()).collect();
        assert_eq!(targets, per_layer, "round {round}");
        let layers: Vec<ModelLayer> = waits.iter().map(|w| w.layer()).collect();
        assert_eq!(layers, [0, 1, 2, 0].map(ModelLayer));
        let counters = b.read_sync(signals.counters(), 0, 16).unwrap();
        let counted: Vec<u32> = counters
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(counted, [4, 1, 2, 0].map(|pairs| round * pairs * owned));
        for (m, w) in waits.iter().enumerate() {
            assert_eq!(signals.target(ModelLayer(m)).unwrap(), counted[m]);
            w.wait(&b).unwrap();
            LayerReady::Counter(w.clone()).wait(&b).unwrap();
        }
    }
    assert!(signals.target(ModelLayer(4)).is_err());
    let mut wrong = LayerSignals::new(&b, 3).unwrap();
    assert!(matches!(
        t.run_signalled(&b, Launch::host_io(&b, 2), &mut wrong),
        Err(Error::GeometryMismatch { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// A backend that counts, holds and fails

/// Backend calls a [`Probe`] can fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Call {
    Alloc,
    WriteSync,
    EnqueueWrite,
    Fill,
    Record,
    Wait,
    WaitCounter,
    CopyBlocks,
    CopyRanges,
    Memcpy,
    Memcpy2d,
    MemcpyBatch,
}

/// Every call a backup makes on some stream.
const FAULTABLE: [Call; 12] = [
    Call::Alloc,
    Call::WriteSync,
    Call::EnqueueWrite,
    Call::Fill,
    Call::Record,
    Call::Wait,
    Call::WaitCounter,
    Call::CopyBlocks,
    Call::CopyRanges,
    Call::Memcpy,
    Call::Memcpy2d,
    Call::MemcpyBatch,
];

/// Fails the `left`-th of the next calls of `calls`, once.
struct Fault {
    calls: Vec<Call>,
    left: usize,
    fired: Option<Call>,
}

type StreamMaker = Arc<dyn Fn() -> Arc<dyn Backend> + Send + Sync>;

/// A backend that delegates to another, counting what it is asked to do, optionally holding
/// its work, and failing a chosen call on demand.
///
/// On the CPU it runs over a deferred arena: work it is given runs at once ("settles") unless
/// the probe is held, and then only when something waits for it (a `synchronize`, another
/// stream's wait), so the controller's acks can be checked against work that is not done yet.
struct Probe {
    inner: Arc<dyn Backend>,
    make: StreamMaker,
    settle: bool,
    held: AtomicBool,
    calls: Mutex<IoCalls>,
    allocs: AtomicUsize,
    syncs: AtomicUsize,
    fault: Mutex<Option<Fault>>,
}

impl Probe {
    /// A probe over a new deferred CPU arena.
    fn cpu() -> Arc<Self> {
        let root = CpuBackend::deferred();
        Self::over(
            Arc::new(move || Arc::new(root.new_stream()) as Arc<dyn Backend>),
            true,
        )
    }

    /// A probe over new streams of `device`: on the CPU twin (whose arena must run in deferred
    /// order) its work settles at once unless held; a GPU runs it as it comes.
    fn on(device: common::Device) -> Arc<Self> {
        let settle = !device.is_gpu();
        Self::over(Arc::new(move || device.stream()), settle)
    }

    fn over(make: StreamMaker, settle: bool) -> Arc<Self> {
        Arc::new(Self {
            inner: make(),
            make,
            settle,
            held: AtomicBool::new(false),
            calls: Mutex::new(IoCalls::default()),
            allocs: AtomicUsize::new(0),
            syncs: AtomicUsize::new(0),
            fault: Mutex::new(None),
        })
    }

    /// A probe over another stream of the same device.
    fn stream(&self) -> Arc<Self> {
        Self::over(self.make.clone(), self.settle)
    }

    /// Work enqueued from now on waits until something waits for it.
    fn hold(&self) {
        self.held.store(true, Ordering::SeqCst);
    }

    /// Work enqueued from now on runs at once again.
    fn release(&self) {
        self.held.store(false, Ordering::SeqCst);
    }

    fn take_calls(&self) -> IoCalls {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }

    fn syncs(&self) -> usize {
        self.syncs.load(Ordering::SeqCst)
    }

    fn allocs(&self) -> usize {
        self.allocs.load(Ordering::SeqCst)
    }

    /// Fails the `k`-th of the next calls of `calls` (counting from 1).
    fn arm(&self, calls: &[Call], k: usize) {
        *self.fault.lock().unwrap() = Some(Fault {
            calls: calls.to_vec(),
            left: k,
            fired: None,
        });
    }

    /// Clears the fault; returns the call it failed, if it fired.
    fn disarm(&self) -> Option<Call> {
        self.fault.lock().unwrap().take().and_then(|f| f.fired)
    }

    fn enter(&self, call: Call) -> kvshard::Result<()> {
        let mut fault = self.fault.lock().unwrap();
        if let Some(f) = fault.as_mut() {
            if f.fired.is_none() && f.calls.contains(&call) {
                f.left -= 1;
                if f.left == 0 {
                    f.fired = Some(call);
                    return Err(match call {
                        Call::Alloc => Error::OutOfMemory {
                            what: "an injected allocation failure".into(),
                            bytes: 0,
                            memory: "device",
                        },
                        _ => Error::InvalidArgument(format!("injected failure of {call:?}")),
                    });
                }
            }
        }
        Ok(())
    }

    /// Runs what was just enqueued, unless held (or not a deferred CPU arena).
    fn settle(&self, result: kvshard::Result<()>) -> kvshard::Result<()> {
        result?;
        if self.settle && !self.held.load(Ordering::SeqCst) {
            self.inner.synchronize()?;
        }
        Ok(())
    }
}

impl Backend for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }

    fn stream_id(&self) -> kvshard::backend::StreamId {
        self.inner.stream_id()
    }

    fn address_space(&self) -> AddressSpace {
        self.inner.address_space()
    }

    fn max_threads(&self, family: KernelFamily) -> u32 {
        self.inner.max_threads(family)
    }

    fn alloc(&self, len: usize, kind: MemoryKind) -> kvshard::Result<Buffer> {
        self.enter(Call::Alloc)?;
        self.allocs.fetch_add(1, Ordering::SeqCst);
        self.inner.alloc(len, kind)
    }

    fn write_sync(&self, dst: &Buffer, offset: usize, data: &[u8]) -> kvshard::Result<()> {
        self.enter(Call::WriteSync)?;
        self.inner.write_sync(dst, offset, data)
    }

    fn enqueue_write(&self, dst: &Buffer, offset: usize, data: &[u8]) -> kvshard::Result<()> {
        self.enter(Call::EnqueueWrite)?;
        self.settle(self.inner.enqueue_write(dst, offset, data))
    }

    fn read_sync(&self, src: &Buffer, offset: usize, len: usize) -> kvshard::Result<Vec<u8>> {
        self.inner.read_sync(src, offset, len)
    }

    fn fill(&self, dst: &Buffer, byte: u8) -> kvshard::Result<()> {
        self.enter(Call::Fill)?;
        self.settle(self.inner.fill(dst, byte))
    }

    fn synchronize(&self) -> kvshard::Result<()> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        self.inner.synchronize()
    }

    fn poll_kernel_status(&self) -> kvshard::Result<()> {
        self.inner.poll_kernel_status()
    }

    fn record(&self) -> kvshard::Result<Event> {
        self.enter(Call::Record)?;
        self.inner.record()
    }

    fn record_timed(&self) -> kvshard::Result<Event> {
        self.enter(Call::Record)?;
        self.inner.record_timed()
    }

    fn elapsed_ms(&self, start: &Event, end: &Event) -> kvshard::Result<f64> {
        self.inner.elapsed_ms(start, end)
    }

    fn wait(&self, event: &Event) -> kvshard::Result<()> {
        self.enter(Call::Wait)?;
        self.settle(self.inner.wait(event))
    }

    fn is_done(&self, event: &Event) -> kvshard::Result<bool> {
        self.inner.is_done(event)
    }

    fn wait_event_sync(&self, event: &Event) -> kvshard::Result<()> {
        self.inner.wait_event_sync(event)
    }

    unsafe fn wait_counter(&self, addr: u64, value: u32) -> kvshard::Result<()> {
        self.enter(Call::WaitCounter)?;
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.wait_counter(addr, value) })
    }

    unsafe fn quantize_latent(&self, p: abi::kvs_quantize_latent_params) -> kvshard::Result<()> {
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.quantize_latent(p) })
    }

    unsafe fn quantize_indexer(&self, p: abi::kvs_quantize_indexer_params) -> kvshard::Result<()> {
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.quantize_indexer(p) })
    }

    unsafe fn resolve(&self, p: abi::kvs_resolve_params) -> kvshard::Result<()> {
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.resolve(p) })
    }

    unsafe fn scratch_rows(&self, p: abi::kvs_scratch_rows_params) -> kvshard::Result<()> {
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.scratch_rows(p) })
    }

    unsafe fn scratch_table(&self, p: abi::kvs_scratch_table_params) -> kvshard::Result<()> {
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.scratch_table(p) })
    }

    unsafe fn copy_blocks(
        &self,
        p: abi::kvs_copy_blocks_params,
        launch: Launch,
    ) -> kvshard::Result<()> {
        self.enter(Call::CopyBlocks)?;
        self.calls.lock().unwrap().launches += 1;
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.copy_blocks(p, launch) })
    }

    unsafe fn copy_blocks_inline(
        &self,
        p: &abi::kvs_copy_blocks_inline_params,
        launch: Launch,
    ) -> kvshard::Result<()> {
        // A block-copy launch like any other, its tables in its parameters.
        self.enter(Call::CopyBlocks)?;
        self.calls.lock().unwrap().launches += 1;
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.copy_blocks_inline(p, launch) })
    }

    unsafe fn write_rows(
        &self,
        p: abi::kvs_write_rows_params,
        launch: Launch,
    ) -> kvshard::Result<()> {
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.write_rows(p, launch) })
    }

    unsafe fn decode_scatter(
        &self,
        p: abi::kvs_decode_scatter_params,
        launch: Launch,
    ) -> kvshard::Result<()> {
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.decode_scatter(p, launch) })
    }

    unsafe fn copy_ranges(
        &self,
        p: abi::kvs_copy_ranges_params,
        launch: Launch,
    ) -> kvshard::Result<()> {
        self.enter(Call::CopyRanges)?;
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.copy_ranges(p, launch) })
    }

    unsafe fn memcpy(&self, dst: u64, src: u64, len: usize) -> kvshard::Result<()> {
        self.enter(Call::Memcpy)?;
        self.calls.lock().unwrap().memcpy += 1;
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.memcpy(dst, src, len) })
    }

    unsafe fn memcpy_2d(&self, copy: &Copy2d) -> kvshard::Result<()> {
        self.enter(Call::Memcpy2d)?;
        self.calls.lock().unwrap().memcpy_2d += 1;
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.memcpy_2d(copy) })
    }

    unsafe fn memcpy_batch(&self, ranges: &[abi::kvs_range]) -> kvshard::Result<()> {
        self.enter(Call::MemcpyBatch)?;
        {
            let mut calls = self.calls.lock().unwrap();
            calls.batch_calls += 1;
            calls.batch_entries += ranges.len();
        }
        // SAFETY: the caller's contract, passed on.
        self.settle(unsafe { self.inner.memcpy_batch(ranges) })
    }
}

/// A controller's five streams as probes, kept to inspect them.
struct ProbeStreams {
    load: Arc<Probe>,
    backup: Arc<Probe>,
    load_relayout: Arc<Probe>,
    backup_relayout: Arc<Probe>,
    tables: Arc<Probe>,
}

impl ProbeStreams {
    fn new(b: &Probe) -> Self {
        Self {
            load: b.stream(),
            backup: b.stream(),
            load_relayout: b.stream(),
            backup_relayout: b.stream(),
            tables: b.stream(),
        }
    }

    fn streams(&self) -> Streams {
        Streams {
            load: self.load.clone(),
            backup: self.backup.clone(),
            load_relayout: self.load_relayout.clone(),
            backup_relayout: self.backup_relayout.clone(),
            tables: self.tables.clone(),
        }
    }
}

/// Five plain streams of `make`'s device.
fn plain_streams(make: &dyn Fn() -> Arc<dyn Backend>) -> Streams {
    Streams {
        load: make(),
        backup: make(),
        load_relayout: make(),
        backup_relayout: make(),
        tables: make(),
    }
}

fn cache_node(id: u64, pages: &[u64]) -> CacheNode {
    CacheNode {
        id,
        device_pages: lp(pages),
        start_owner: None,
    }
}

#[test]
fn backends_submit_the_calls_they_promise() {
    let b = Probe::cpu();
    let g = &geometries()[0]; // target latent 3 layers, indexer 2, draft latent 1, indexer 1
    let placement = Placement::new(2).unwrap();
    // Rank 0's pairs: local device 2,3,4 with host 5,6,7 (one run of 3), then 9 with 2.
    let device = lp(&[4, 6, 8, 18, 5]);
    let host = lp(&[10, 12, 14, 4, 3]);
    let pool = random_pool(b.as_ref(), g, placement, 0, 1);
    let blocks = 3 + 2 + 1 + 1;
    for layout in HostLayout::ALL {
        let hp = Arc::new(HostPool::new(b.as_ref(), g, HOST_PAGES, layout).unwrap());
        let plan =
            TransferPlan::new(placement, 0, &device, &host, DEVICE_PAGES, HOST_PAGES).unwrap();
        assert_eq!(plan.runs().len(), 2);
        for direction in [Direction::Backup, Direction::Load] {
            let mut t =
                HostTransfer::new(pool.clone(), hp.clone(), plan.clone(), direction).unwrap();
            t.prepare_kernel_sync(b.as_ref(), &mut Vec::new()).unwrap();
            b.take_calls();
            for io in IOS {
                let layers = [
                    Layers::All,
                    Layers::One(ModelLayer(0)),
                    Layers::One(ModelLayer(2)),
                    Layers::One(ModelLayer(3)),
                ];
                for layers in layers {
                    let promised = t.calls(io, layers).unwrap();
                    t.run(b.as_ref(), io, layers).unwrap();
                    assert_eq!(b.take_calls(), promised, "{layout} {io} {layers:?}");
                }
                // The draft's layer is layer 0's readiness group: the same calls.
                assert_eq!(
                    t.calls(io, Layers::One(ModelLayer(3))).unwrap(),
                    t.calls(io, Layers::One(ModelLayer(0))).unwrap()
                );
            }
            let all = |io| t.calls(io, Layers::All).unwrap();
            assert_eq!(all(common::host_io(4)).launches, 1);
            let batch = all(Method::BatchedCopyEngine);
            let per_block = all(Method::PerBlock);
            let engine = all(Method::CopyEngine);
            assert_eq!(batch.batch_calls, 1);
            match layout {
                HostLayout::PageFirst => {
                    // Target latent blocks are 64 strided rows (one 2D copy, or 64 entries);
                    // one-layer draft latent rows are contiguous.
                    assert_eq!(batch.batch_entries, 4 * (3 * 64 + 4));
                    assert_eq!((per_block.memcpy, per_block.memcpy_2d), (4 * 4, 4 * 3));
                    // One 2D copy per (run, layer) of the target latent; the indexer is
                    // page-major, as in page_first_direct (3 copies, below).
                    assert_eq!(engine.memcpy_2d, 2 * 3 + 3);
                }
                _ => {
                    assert_eq!(batch.batch_entries, 4 * blocks);
                    assert_eq!(per_block.memcpy, 4 * blocks);
                    // layer_first: one copy per (run, component), layers as rows.
                    // page_first_direct: per page, layers as rows, while a run is no longer
                    // than the layers (latent: 3 + 1); per layer, pages as rows, once it is
                    // (indexer, 2 layers: the 3-page run as 2 copies, then 1).
                    let stacked = if layout == HostLayout::LayerFirst {
                        2 * 2
                    } else {
                        4 + 3
                    };
                    assert_eq!(engine.memcpy_2d, stacked, "{layout}");
                }
            }
            // Draft latent and indexer: one piece per run each, in one batch call.
            assert_eq!(
                (engine.batch_calls, engine.batch_entries),
                (1, 2 * 2),
                "{layout}"
            );
        }
    }
}

#[test]
fn engine_pools_without_a_uniform_layer_stride_fall_back_to_one_batch_per_call() {
    let b = Probe::cpu();
    let g = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 3));
    let placement = Placement::unsharded();
    // Allocated interleaved, so neither component's layers are evenly spaced.
    let alloc = |bytes: usize| {
        b.alloc(DEVICE_PAGES as usize * bytes, MemoryKind::Device)
            .unwrap()
    };
    let (l0, i0, l1, l2, i1, i2) = (
        alloc(36_864),
        alloc(8448),
        alloc(36_864),
        alloc(36_864),
        alloc(8448),
        alloc(8448),
    );
    let raw = |b: &Buffer| RawBuffer {
        addr: b.addr(),
        bytes: b.len() as u64,
    };
    let buffers = PoolBuffers {
        target_latent: vec![raw(&l0), raw(&l1), raw(&l2)],
        target_indexer: vec![raw(&i0), raw(&i1), raw(&i2)],
        ..PoolBuffers::default()
    };
    // An undersized buffer is refused.
    let mut short = buffers.clone();
    short.target_indexer[2].bytes -= 1;
    // SAFETY: every address is a live allocation of `b`; the pools do not outlive them.
    let refused = unsafe { DevicePool::wrap(b.as_ref(), &g, placement, 0, DEVICE_PAGES, &short) };
    assert!(matches!(refused, Err(Error::InvalidArgument(_))));
    // SAFETY: as above, each holding DEVICE_PAGES blocks.
    let pool =
        unsafe { DevicePool::wrap(b.as_ref(), &g, placement, 0, DEVICE_PAGES, &buffers) }.unwrap();
    assert!(pool.storage().is_none());
    assert_eq!(
        (
            pool.layer_stride(Component::TargetLatent).unwrap(),
            pool.layer_stride(Component::TargetIndexer).unwrap()
        ),
        (None, None)
    );
    let host = Arc::new(HostPool::new(b.as_ref(), &g, HOST_PAGES, HostLayout::LayerFirst).unwrap());
    let plan = TransferPlan::new(
        placement,
        0,
        &lp(&[1, 2, 3, 7]),
        &lp(&[4, 5, 6, 1]),
        DEVICE_PAGES,
        HOST_PAGES,
    )
    .unwrap();
    let t = HostTransfer::new(Arc::new(pool), host.clone(), plan, Direction::Backup).unwrap();
    let calls = t.calls(Method::CopyEngine, Layers::All).unwrap();
    // Two runs x (3 latent + 3 indexer layers), each one contiguous range.
    assert_eq!(
        calls,
        IoCalls {
            batch_calls: 1,
            batch_entries: 2 * 6,
            ..IoCalls::default()
        }
    );
    t.run(b.as_ref(), Method::CopyEngine, Layers::All).unwrap();
    let indexer = host.buffer(Component::TargetIndexer).unwrap();
    assert_eq!(
        b.read_sync(&i1, 3 * 8448, 8448).unwrap(),
        b.read_sync(indexer, (HOST_PAGES as usize + 6) * 8448, 8448)
            .unwrap()
    );
}

#[test]
fn planning_refuses_bad_pairs_identically_on_every_rank() {
    let placement = Placement::new(2).unwrap();
    let plan = |rank: u32, device: &[u64], host: &[u64]| {
        TransferPlan::new(
            placement,
            rank,
            &lp(device),
            &lp(host),
            DEVICE_PAGES,
            HOST_PAGES,
        )
    };
    for rank in 0..2 {
        assert!(matches!(
            plan(rank, &[4, 7], &[6, 8]),
            Err(Error::WrongOwner {
                page: 8,
                owner: 0,
                expected: 1
            })
        ));
        assert!(matches!(
            plan(rank, &[4, 1], &[6, 3]),
            Err(Error::ReservedPage { page: 1, shard: 2 })
        ));
        assert!(matches!(
            plan(rank, &[4, 24], &[6, 8]),
            Err(Error::OutOfRange {
                what: "logical device page",
                index: 24,
                limit: 24
            })
        ));
        assert!(matches!(
            plan(rank, &[4, 5], &[6, 29]),
            Err(Error::OutOfRange {
                what: "logical host page",
                ..
            })
        ));
        assert!(matches!(
            plan(rank, &[4, 6, 4], &[6, 8, 10]),
            Err(Error::DuplicatePage { page: 4, .. })
        ));
        assert!(matches!(
            plan(rank, &[4, 6], &[6, 6]),
            Err(Error::DuplicatePage { page: 6, .. })
        ));
        assert!(matches!(
            plan(rank, &[4, 6], &[6, 8, 10]),
            Err(Error::HiCache(_))
        ));
    }
    assert!(TransferPlan::new(placement, 2, &[], &[], 4, 4).is_err());
    let tokens: Vec<Slot> = (256..384).map(Slot).collect();
    assert_eq!(pages_of_tokens(&tokens).unwrap(), lp(&[4, 5]));
    assert!(matches!(
        pages_of_tokens(&tokens[1..65]),
        Err(Error::HiCache(_))
    ));
    assert!(matches!(
        pages_of_tokens(&tokens[..100]),
        Err(Error::MisalignedPrefix { tokens: 100, .. })
    ));
}

#[test]
fn host_pools_refuse_bad_shapes() {
    let b = CpuBackend::new();
    let g = &geometries()[0];
    assert!(HostPool::new(&b, g, 1, HostLayout::LayerFirst).is_err());
    let mut bad = g.clone();
    bad.target.page_size = 32;
    assert!(HostPool::new(&b, &bad, 4, HostLayout::LayerFirst).is_err());
    let other = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 3));
    let pool = Arc::new(DevicePool::allocate(&b, &other, Placement::unsharded(), 0, 4).unwrap());
    let host = Arc::new(HostPool::new(&b, g, 4, HostLayout::PageFirst).unwrap());
    let plan = TransferPlan::new(Placement::unsharded(), 0, &lp(&[1]), &lp(&[1]), 4, 4).unwrap();
    assert!(matches!(
        HostTransfer::new(pool.clone(), host, plan.clone(), Direction::Load),
        Err(Error::GeometryMismatch { .. })
    ));
    let same = Arc::new(HostPool::new(&b, &other, 4, HostLayout::PageFirst).unwrap());
    let sharded =
        Arc::new(DevicePool::allocate(&b, &other, Placement::new(2).unwrap(), 0, 4).unwrap());
    assert!(matches!(
        HostTransfer::new(sharded, same.clone(), plan.clone(), Direction::Load),
        Err(Error::HiCache(_))
    ));
    // A host pool of another backend's memory is refused, by the transfer and the controller.
    let elsewhere = CpuBackend::new();
    let foreign = Arc::new(HostPool::new(&elsewhere, &other, 4, HostLayout::PageFirst).unwrap());
    assert!(matches!(
        HostTransfer::new(pool.clone(), foreign.clone(), plan.clone(), Direction::Load),
        Err(Error::ForeignMemory { .. })
    ));
    let streams = plain_streams(&|| Arc::new(b.new_stream()) as Arc<dyn Backend>);
    assert!(matches!(
        HiCacheController::new(
            pool.clone(),
            foreign,
            streams.clone(),
            WritePolicy::WriteBack
        ),
        Err(Error::ForeignMemory { .. })
    ));
    let other_streams = plain_streams(&|| Arc::new(elsewhere.new_stream()) as Arc<dyn Backend>);
    assert!(matches!(
        HiCacheController::new(pool, same, other_streams, WritePolicy::WriteBack),
        Err(Error::ForeignMemory { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// The controller

/// A compute-stream event that has completed.
fn done(b: &dyn Backend) -> Event {
    b.record().unwrap()
}

#[test]
fn controller_acks_backups_in_fifo_order_only_once_complete() {
    let b = Probe::cpu();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(b.as_ref(), g, placement, 0, 5);
    let host =
        Arc::new(HostPool::new(b.as_ref(), g, HOST_PAGES, HostLayout::PageFirstDirect).unwrap());
    let ps = ProbeStreams::new(&b);
    let mut ctl = HiCacheController::new(pool, host, ps.streams(), WritePolicy::WriteBack).unwrap();
    let io = Method::CopyEngine;
    let now = done(b.as_ref());
    ps.backup.hold();
    assert_eq!(ctl.backup(&cache_node(10, &[4, 5]), &now, io).unwrap(), 0);
    assert_eq!(
        ctl.backup(&cache_node(11, &[6, 7, 8]), &now, io).unwrap(),
        1
    );
    assert_eq!(ctl.pending_backups(), 2);
    assert_eq!(ctl.poll_backups().unwrap(), 0, "nothing is complete yet");
    assert!(ctl.host_pages(10).is_none(), "no host pages before the ack");
    // Acking waits for the backup stream, then pops in order.
    let acks = ctl.ack_backups_sync(1).unwrap();
    assert_eq!(ps.backup.syncs(), 1);
    assert_eq!((acks[0].index, acks[0].node), (0, 10));
    assert_eq!(ctl.poll_backups().unwrap(), 1);
    ps.backup.release();
    assert_eq!(ctl.backup(&cache_node(12, &[10]), &now, io).unwrap(), 2);
    assert_eq!(ctl.poll_backups().unwrap(), 2);
    let acks = ctl.ack_backups_sync(2).unwrap();
    assert_eq!(acks.iter().map(|a| a.index).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(ps.backup.syncs(), 1, "complete acks do not block");
    // Rank 0 owns pages 6 and 8 of node 11: two pages of every layer and component.
    assert_eq!(acks[0].bytes, 2 * g.page_bytes() as u64);
    assert!(ctl.ack_backups_sync(1).is_err());
    assert_eq!(ctl.host_pages(11), Some(acks[0].host_pages.as_slice()));
    assert!(
        ctl.backup(&cache_node(11, &[12]), &now, io).is_err(),
        "already on host"
    );
}

#[test]
fn kernel_tables_are_reused_once_their_transfer_is_acked() {
    let b = Probe::cpu();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(b.as_ref(), g, placement, 0, 6);
    let host = Arc::new(HostPool::new(b.as_ref(), g, HOST_PAGES, HostLayout::PageFirst).unwrap());
    let ps = ProbeStreams::new(&b);
    let mut ctl = HiCacheController::new(
        pool.clone(),
        host.clone(),
        ps.streams(),
        WritePolicy::WriteThrough,
    )
    .unwrap();
    let io = common::host_io(2);
    let now = done(b.as_ref());
    let signals = ps.tables.allocs();
    ctl.backup(&cache_node(1, &[4, 6, 8]), &now, io).unwrap();
    ctl.backup(&cache_node(2, &[10, 12]), &now, io).unwrap();
    assert_eq!(ps.tables.allocs(), signals + 2);
    ctl.ack_backups_sync(2).unwrap();
    // Smaller or equal tables fit the buffers the acked backups gave back.
    let h = ctl.load(1, &lp(&[14, 16, 18]), None, io).unwrap();
    ctl.backup(&cache_node(3, &[20, 22]), &now, io).unwrap();
    assert_eq!(ps.tables.allocs(), signals + 2);
    assert_eq!(h.index(), 0);

    // A transfer's tables go back to its owner once it is done, for the next to reuse; a
    // spare too small for the next one stays spare.
    let plan = |device: &[u64]| {
        TransferPlan::new(
            placement,
            0,
            &lp(device),
            &lp(device),
            DEVICE_PAGES,
            HOST_PAGES,
        )
        .unwrap()
    };
    let transfer = |device: &[u64]| {
        HostTransfer::new(pool.clone(), host.clone(), plan(device), Direction::Load)
    };
    let mut spare = Vec::new();
    let mut small = transfer(&[4]).unwrap();
    let before = b.allocs();
    small.prepare_kernel_sync(b.as_ref(), &mut spare).unwrap();
    assert_eq!(b.allocs(), before + 1);
    small.run(b.as_ref(), io, Layers::All).unwrap();
    b.synchronize().unwrap();
    spare = small.into_tables();
    assert_eq!(spare.len(), 1);
    let small_table = spare[0].len();
    assert!(small_table >= 7 * 24 + 16, "{small_table}");
    let mut again = transfer(&[6]).unwrap();
    again.prepare_kernel_sync(b.as_ref(), &mut spare).unwrap();
    assert_eq!(b.allocs(), before + 1, "reused");
    assert!(spare.is_empty());
    again.run(b.as_ref(), io, Layers::All).unwrap();
    b.synchronize().unwrap();
    spare = again.into_tables();
    let mut big = transfer(&[4, 6, 8, 10, 12, 14, 16, 18, 20, 22]).unwrap();
    assert!(big.kernel_table_bytes() > small_table);
    big.prepare_kernel_sync(b.as_ref(), &mut spare).unwrap();
    assert_eq!(b.allocs(), before + 2, "too small to reuse");
    assert_eq!(spare.len(), 1, "the small one stays spare");
    big.run(b.as_ref(), io, Layers::All).unwrap();
    b.synchronize().unwrap();
}

/// One shard group: a controller per rank over its own pools, all given the same calls.
struct Group {
    ranks: Vec<HiCacheController>,
}

impl Group {
    fn each<T>(
        &mut self,
        mut f: impl FnMut(&mut HiCacheController) -> kvshard::Result<T>,
    ) -> Vec<T> {
        self.ranks.iter_mut().map(|c| f(c).unwrap()).collect()
    }
}

#[test]
fn ranks_that_own_nothing_still_submit_signal_and_ack() {
    let b = Probe::cpu();
    let g = &geometries()[0];
    let placement = Placement::new(4).unwrap();
    let pools: Vec<Arc<DevicePool>> = (0..4)
        .map(|r| random_pool(b.as_ref(), g, placement, r, 9))
        .collect();
    let hosts: Vec<Arc<HostPool>> = (0..4)
        .map(|_| {
            let h = HostPool::new(b.as_ref(), g, HOST_PAGES, HostLayout::PageFirst).unwrap();
            h.fill(b.as_ref(), POISON).unwrap();
            Arc::new(h)
        })
        .collect();
    let mut group = Group {
        ranks: pools
            .iter()
            .zip(&hosts)
            .map(|(p, h)| {
                let ps = ProbeStreams::new(&b);
                HiCacheController::new(
                    p.clone(),
                    h.clone(),
                    ps.streams(),
                    WritePolicy::WriteThrough,
                )
                .unwrap()
            })
            .collect(),
    };
    // Pages of owners 0 and 1 only: ranks 2 and 3 own nothing.
    let n = cache_node(1, &[4, 5, 8, 9]);
    let now = done(b.as_ref());
    for route in ROUTES {
        let indices = group.each(|c| c.access(&n, &now, route));
        assert!(indices.iter().all(|&i| i == indices[0] && i.is_some()));
        let ready = group.each(|c| c.poll_backups());
        assert_eq!(ready, vec![1; 4]);
        let acks = group.each(|c| c.ack_backups_sync(1));
        let bytes: Vec<u64> = acks.iter().map(|a| a[0].bytes).collect();
        let page = g.page_bytes() as u64;
        assert_eq!(bytes, vec![2 * page, 2 * page, 0, 0], "{route}");
        assert!(acks
            .iter()
            .all(|a| a[0].host_pages == acks[0][0].host_pages));
        let reload = lp(&[12, 13, 16, 17]);
        let handles = group.each(|c| c.load(1, &reload, None, route));
        for (c, h) in group.ranks.iter().zip(&handles) {
            assert_eq!(h.layers().len(), g.model_layers());
            for layer in (0..g.model_layers()).map(ModelLayer) {
                h.wait_layer(c.streams().load.as_ref(), layer).unwrap();
            }
        }
        assert_eq!(group.each(|c| c.poll_loads()), vec![1; 4]);
        let loads = group.each(|c| c.ack_loads_sync(1));
        assert!(loads
            .iter()
            .all(|l| l[0].index == loads[0][0].index && l[0].node == 1));
        assert_eq!(loads[3][0].bytes, 0);
        group.each(|c| c.free_host(1));
        // Evicting drops the node's hit count: the next access backs it up again.
        group.each(|c| c.evict_sync(&n, &now, route));
    }
    // The idle ranks' pools never changed.
    for r in 2..4 {
        assert!(hosts[r]
            .snapshot_sync(b.as_ref())
            .unwrap()
            .iter()
            .all(|&x| x == POISON));
        let fresh = random_pool(b.as_ref(), g, placement, r as u32, 9);
        assert!(
            pools[r].snapshot_sync(b.as_ref()).unwrap() == fresh.snapshot_sync(b.as_ref()).unwrap()
        );
    }
}

#[test]
fn write_policies_back_up_on_the_access_or_eviction_they_name() {
    let b = Probe::cpu();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(b.as_ref(), g, placement, 1, 2);
    let host = Arc::new(HostPool::new(b.as_ref(), g, HOST_PAGES, HostLayout::LayerFirst).unwrap());
    let io = common::host_io(1);
    let n = cache_node(3, &[5, 6, 7]);
    let now = done(b.as_ref());
    let controller = |policy| {
        let ps = ProbeStreams::new(&b);
        let ctl = HiCacheController::new(pool.clone(), host.clone(), ps.streams(), policy).unwrap();
        (ctl, ps)
    };
    let (mut through, _ps) = controller(WritePolicy::WriteThrough);
    assert_eq!(through.policy(), WritePolicy::WriteThrough);
    assert_eq!(through.access(&n, &now, io).unwrap(), Some(0));
    assert_eq!(
        through.access(&n, &now, io).unwrap(),
        None,
        "already backed up"
    );
    assert_eq!(
        through.evict_sync(&n, &now, io).unwrap().len(),
        1,
        "evict waits for it"
    );
    assert!(through.evict_sync(&n, &now, io).unwrap().is_empty());

    let (mut selective, _ps) = controller(WritePolicy::WriteThroughSelective);
    assert_eq!(selective.access(&n, &now, io).unwrap(), None);
    assert_eq!(selective.access(&n, &now, io).unwrap(), Some(0));
    let other = CacheNode { id: 4, ..n.clone() };
    assert_eq!(selective.access(&other, &now, io).unwrap(), None);
    assert!(
        selective.evict_sync(&other, &now, io).unwrap().is_empty(),
        "one hit: dropped"
    );
    assert_eq!(selective.pending_backups(), 1);

    let (mut back, ps) = controller(WritePolicy::WriteBack);
    for _ in 0..3 {
        assert_eq!(back.access(&n, &now, io).unwrap(), None);
    }
    assert_eq!(back.pending_backups(), 0);
    ps.backup.hold();
    let acks = back.evict_sync(&n, &now, io).unwrap();
    assert_eq!(ps.backup.syncs(), 1, "write-back eviction blocks");
    assert_eq!((acks.len(), acks[0].node), (1, 3));
    // The node's bytes are on the host: load them back elsewhere and compare.
    // Rank 1 moves 5 -> 9 and 7 -> 13: local 2 -> 4 and 3 -> 6.
    let h = back
        .load(3, &lp(&[9, 10, 13]), None, Method::CopyEngine)
        .unwrap();
    assert_eq!(h.index(), 0);
    assert_eq!(
        back.ack_loads_sync(1).unwrap()[0].bytes,
        2 * g.page_bytes() as u64
    );
    for comp in pool.components() {
        for l in (0..comp.layers()).map(StoredLayer) {
            let read = |p: u64| {
                pool.read_block_sync(b.as_ref(), comp.component, l, LocalPage(p))
                    .unwrap()
            };
            assert_eq!(read(2), read(4), "{} {l}", comp.component);
            assert_eq!(read(3), read(6), "{} {l}", comp.component);
        }
    }
}

#[test]
fn a_start_owner_of_zero_is_an_owner() {
    let b = Probe::cpu();
    let g = &geometries()[1];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(b.as_ref(), g, placement, 0, 4);
    let host =
        Arc::new(HostPool::new(b.as_ref(), g, HOST_PAGES, HostLayout::PageFirstDirect).unwrap());
    let ps = ProbeStreams::new(&b);
    let mut ctl =
        HiCacheController::new(pool, host, ps.streams(), WritePolicy::WriteThrough).unwrap();
    let io = Method::CopyEngine;
    let now = done(b.as_ref());
    // A chain segment starting at owner 0: its host pages follow the rotation from 0.
    let node = |id, pages: &[u64], start_owner| CacheNode {
        id,
        device_pages: lp(pages),
        start_owner,
    };
    let starts_at_0 = [6u64, 9, 10];
    ctl.backup(&node(1, &starts_at_0, Some(0)), &now, io)
        .unwrap();
    let ack = ctl.ack_backups_sync(1).unwrap().remove(0);
    assert_eq!(ack.start_owner, Some(0));
    let owners: Vec<u32> = ack.host_pages.iter().map(|&p| placement.owner(p)).collect();
    assert_eq!(owners, vec![0, 1, 0]);
    // Pages starting at owner 1 contradict a start owner of 0 (were 0 taken for "no owner",
    // this would pass): refused before anything moves, host pages returned.
    let starts_at_1 = [5u64, 12, 7];
    let free = ctl.host_allocator().total_free();
    let err = ctl
        .backup(&node(2, &starts_at_1, Some(0)), &now, io)
        .unwrap_err();
    assert!(matches!(err, Error::WrongOwner { .. }), "{err}");
    assert_eq!(ctl.host_allocator().total_free(), free);
    assert_eq!(ctl.pending_backups(), 0);
    // Without a shard owner the same pages back up with matching owner classes.
    assert_eq!(
        ctl.backup(&node(2, &starts_at_1, None), &now, io).unwrap(),
        1
    );
    let ack = ctl.ack_backups_sync(1).unwrap().remove(0);
    assert_eq!(ack.start_owner, None);
    let owners: Vec<u32> = ack.host_pages.iter().map(|&p| placement.owner(p)).collect();
    assert_eq!(owners, vec![1, 0, 1]);
    let err = ctl
        .backup(&node(3, &starts_at_0, Some(2)), &now, io)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert_eq!(ctl.host_allocator().total_free(), free - 3);
}

#[test]
fn refused_operations_change_nothing() {
    let b = Probe::cpu();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(b.as_ref(), g, placement, 0, 8);
    let host = Arc::new(HostPool::new(b.as_ref(), g, HOST_PAGES, HostLayout::LayerFirst).unwrap());
    host.fill(b.as_ref(), POISON).unwrap();
    let before = pool.snapshot_sync(b.as_ref()).unwrap();
    let ps = ProbeStreams::new(&b);
    let mut ctl = HiCacheController::new(
        pool.clone(),
        host.clone(),
        ps.streams(),
        WritePolicy::WriteThrough,
    )
    .unwrap();
    let io = common::host_io(2);
    let now = done(b.as_ref());
    let free = ctl.host_allocator().total_free();
    for bad in [&[4u64, 1][..], &[4, 24], &[4, 6, 4]] {
        assert!(
            ctl.backup(&cache_node(1, bad), &now, io).is_err(),
            "{bad:?}"
        );
    }
    assert_eq!(ctl.host_allocator().total_free(), free);
    assert_eq!(ctl.pending_backups(), 0);
    assert!(host
        .snapshot_sync(b.as_ref())
        .unwrap()
        .iter()
        .all(|&x| x == POISON));
    // Loads of unknown or unacked nodes, and loads into wrong owners, are refused too.
    assert!(ctl.load(1, &lp(&[4]), None, io).is_err());
    assert_eq!(ctl.backup(&cache_node(2, &[4, 6]), &now, io).unwrap(), 0);
    assert!(
        ctl.load(2, &lp(&[8, 10]), None, io).is_err(),
        "backup not acked"
    );
    assert!(ctl.free_host(2).is_err(), "backup in flight");
    ctl.ack_backups_sync(1).unwrap();
    assert!(matches!(
        ctl.load(2, &lp(&[8, 11]), None, io),
        Err(Error::WrongOwner { .. })
    ));
    assert_eq!(ctl.pending_loads(), 0);
    let h = ctl.load(2, &lp(&[8, 10]), None, io).unwrap();
    assert!(ctl.free_host(2).is_err(), "load pending");
    assert!(ctl.free_host(3).is_err(), "never on the host");
    assert_eq!(h.index(), 0);
    assert!(h
        .wait_layer(ps.load.as_ref(), ModelLayer(g.model_layers()))
        .is_err());
    ctl.ack_loads_sync(1).unwrap();
    ctl.free_host(2).unwrap();
    assert_eq!(ctl.host_allocator().total_free(), free);
    // Pages 4 and 6 were copied to 8 and 10 (local 2, 3 -> 4, 5); the rest is unchanged.
    let after = pool.snapshot_sync(b.as_ref()).unwrap();
    let mut expected = before.clone();
    expect_moved(
        pool.components(),
        (placement, 0),
        (&before, &lp(&[4, 6]), DEVICE_PAGES),
        (&mut expected, &lp(&[8, 10]), DEVICE_PAGES),
    );
    assert!(after == expected);
}

/// One rank's controller round trip: the source pool, the host pool after the acked backup, the
/// host pages it got, the device pool after the acked load, and the bytes each ack reported.
struct ControllerTrip {
    source: Vec<u8>,
    host: Vec<u8>,
    host_pages: Vec<LogicalPage>,
    reloaded: Vec<u8>,
    bytes: (u64, u64),
}

/// Backs `node` up through a controller of the rank on `streams` (random device pool of `w`'s
/// kind, poisoned host pool) on `route`, then loads it back into its reload pages on `route`,
/// a consumer on `w.b` waiting for every layer before the pools are read.
fn controller_trip(w: &Where<'_>, streams: Streams, route: Route, node: &Node) -> ControllerTrip {
    let b = w.b;
    let pool = make_pool(b, w.g, w.placement, w.rank, DEVICE_PAGES, w.kind);
    pool.randomize(b, 11 + u64::from(w.rank));
    let host = Arc::new(HostPool::new(b, w.g, HOST_PAGES, w.layout).unwrap());
    host.fill(b, POISON).unwrap();
    let source = pool.pool.snapshot_sync(b).unwrap();
    let mut ctl = HiCacheController::new(
        pool.pool.clone(),
        host.clone(),
        streams,
        WritePolicy::WriteBack,
    )
    .unwrap();
    let n = CacheNode {
        id: 1,
        device_pages: node.device.clone(),
        start_owner: None,
    };
    // What `b` did so far stands for the forward pass that wrote the pages.
    let compute = b.record().unwrap();
    assert_eq!(ctl.backup(&n, &compute, route).unwrap(), 0);
    let backup = ctl.ack_backups_sync(1).unwrap().remove(0);
    let written = b.record().unwrap();
    let h = ctl.load(1, &node.reload, Some(&written), route).unwrap();
    assert_eq!(h.layers().len(), w.g.model_layers());
    for layer in (0..w.g.model_layers()).map(ModelLayer) {
        h.wait_layer(b, layer).unwrap();
    }
    let load = ctl.ack_loads_sync(1).unwrap().remove(0);
    assert_eq!((load.index, load.node), (0, 1));
    ControllerTrip {
        source,
        host: host.snapshot_sync(b).unwrap(),
        host_pages: backup.host_pages,
        reloaded: pool.pool.snapshot_sync(b).unwrap(),
        bytes: (backup.bytes, load.bytes),
    }
}

// A controller's backup and load, on every route, host layout and rank, move exactly the
// rank's owned pages, and each ack reports their bytes.
common::on_cpu_and_gpu!(
    controller_round_trips_through_every_route_move_exactly_the_owned_pages,
    |device| {
        let mut rng = device.rng();
        let b = device.stream();
        let make = || device.stream();
        for_each_rank(
            &mut rng,
            &[1, 2, 4],
            all_ranks,
            |g, placement, rank, node| {
                let owned = node
                    .device
                    .iter()
                    .filter(|&&p| placement.owner(p) == rank)
                    .count() as u64;
                let bytes = owned * g.page_bytes() as u64;
                for layout in HostLayout::ALL {
                    // Wrapped pools on the first and the last rank only: every rank of them is
                    // covered by HostTransfer round trips (every_route_round_trips_on_every_host_...).
                    let edge = rank == 0 || rank + 1 == placement.shard();
                    let kinds = if edge { &KINDS[..] } else { &KINDS[..1] };
                    for &kind in kinds {
                        let w = Where {
                            b: b.as_ref(),
                            other: b.as_ref(),
                            g,
                            layout,
                            placement,
                            rank,
                            kind,
                        };
                        for route in ROUTES {
                            let case = format!(
                                "N={} rank {rank} {layout} {kind:?} pool, {route}",
                                placement.shard()
                            );
                            let trip = controller_trip(&w, plain_streams(&make), route, node);
                            assert_eq!(trip.bytes, (bytes, bytes), "{case}");
                            assert_round_trip(
                                &g.components(),
                                (placement, rank),
                                (&trip.source, &trip.host, &trip.reloaded),
                                (&node.device, &trip.host_pages, &node.reload),
                                trip.source.clone(),
                                &case,
                            );
                        }
                    }
                }
            },
        );
    }
);

#[test]
fn controller_acks_in_fifo_order_across_mixed_routes() {
    let b = Probe::cpu();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(b.as_ref(), g, placement, 0, 5);
    let before = pool.snapshot_sync(b.as_ref()).unwrap();
    let host =
        Arc::new(HostPool::new(b.as_ref(), g, HOST_PAGES, HostLayout::PageFirstDirect).unwrap());
    let ps = ProbeStreams::new(&b);
    let mut ctl =
        HiCacheController::new(pool.clone(), host, ps.streams(), WritePolicy::WriteBack).unwrap();
    let routes = [
        Route::Staged(Method::CopyEngine),
        Method::CopyEngine.into(),
        Route::Staged(common::host_io(2)),
        common::host_io(2).into(),
        Method::PerBlock.into(),
        Route::Staged(Method::CopyEngine),
        Method::BatchedCopyEngine.into(),
    ];
    // Rank 0 owns the even pages: 1, 2, 0, 1, 1, 1 and 2 of each node.
    let device: [&[u64]; 7] = [
        &[4, 5],
        &[6, 7, 8],
        &[9],
        &[10, 11],
        &[3, 2],
        &[13, 12],
        &[14, 16],
    ];
    let reload: [&[u64]; 7] = [
        &[12, 13],
        &[14, 15, 16],
        &[17],
        &[18, 19],
        &[21, 20],
        &[23, 22],
        &[2, 4],
    ];
    let owned = [1u64, 2, 0, 1, 1, 1, 2];
    let now = done(b.as_ref());
    // Held: nothing completes until acked (the relayouts of staged routes are held too, so that
    // no wait of theirs runs the backup stream early).
    ps.backup.hold();
    ps.backup_relayout.hold();
    for (i, (&route, pages)) in routes.iter().zip(device).enumerate() {
        let n = cache_node(10 + i as u64, pages);
        assert_eq!(ctl.backup(&n, &now, route).unwrap(), i as u64, "{route}");
    }
    assert_eq!(ctl.poll_backups().unwrap(), 0, "nothing is complete yet");
    let acks = ctl.ack_backups_sync(routes.len()).unwrap();
    assert_eq!(ps.backup.syncs(), 1);
    let order: Vec<(u64, u64, u64)> = acks.iter().map(|a| (a.index, a.node, a.bytes)).collect();
    let page = g.page_bytes() as u64;
    let want: Vec<(u64, u64, u64)> = (0..routes.len() as u64)
        .map(|i| (i, 10 + i, owned[i as usize] * page))
        .collect();
    assert_eq!(order, want);
    // Loads in the opposite route order, held too: queue indices and acks in submission order.
    ps.load.hold();
    ps.load_relayout.hold();
    for (i, (&route, pages)) in routes.iter().rev().zip(reload).enumerate() {
        let h = ctl.load(10 + i as u64, &lp(pages), None, route).unwrap();
        assert_eq!(h.index(), i as u64, "{route}");
        assert_eq!(h.layers().len(), g.model_layers());
        let events = h.layers().iter().all(|l| matches!(l, LayerReady::Event(_)));
        let counters = h
            .layers()
            .iter()
            .all(|l| matches!(l, LayerReady::Counter(_)));
        match route {
            Route::Direct(Method::Kernel(_)) => assert!(counters, "{route}"),
            _ => assert!(events, "{route}"),
        }
    }
    assert_eq!(ctl.poll_loads().unwrap(), 0, "nothing is complete yet");
    let loads = ctl.ack_loads_sync(routes.len()).unwrap();
    assert_eq!(ps.load.syncs(), 1);
    let order: Vec<(u64, u64, u64)> = loads.iter().map(|a| (a.index, a.node, a.bytes)).collect();
    assert_eq!(order, want);
    // Every node came back where it was loaded; nothing else changed.
    let mut expected = before.clone();
    for (pages, to) in device.iter().zip(reload) {
        expect_moved(
            pool.components(),
            (placement, 0),
            (&before, &lp(pages), DEVICE_PAGES),
            (&mut expected, &lp(to), DEVICE_PAGES),
        );
    }
    assert!(pool.snapshot_sync(b.as_ref()).unwrap() == expected);
}

#[test]
fn the_auto_route_picks_by_direction_and_pages_and_moves_the_same_bytes() {
    let b: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let bk = b.as_ref();
    let staged = AUTO_STAGED_PAGES;
    assert_eq!(Route::default(), Route::Auto);
    let (lf, pfd) = (HostLayout::LayerFirst, HostLayout::PageFirstDirect);
    for layout in [lf, pfd, HostLayout::PageFirst] {
        assert!(matches!(
            Route::auto(Direction::Load, staged - 1, layout, bk),
            Route::Direct(Method::Kernel(_))
        ));
        assert!(matches!(
            Route::auto(Direction::Load, staged, layout, bk),
            Route::Staged(Method::Kernel(_))
        ));
        assert!(matches!(
            Route::auto(Direction::Backup, staged - 1, layout, bk),
            Route::Direct(Method::Kernel(_))
        ));
    }
    assert!(matches!(
        Route::auto(Direction::Backup, 4 * staged, lf, bk),
        Route::Direct(Method::Kernel(_))
    ));
    assert!(matches!(
        Route::auto(Direction::Backup, staged, pfd, bk),
        Route::Staged(Method::Kernel(_))
    ));
    // Through a controller: a node of `staged` pages (a staged load) and one of 3 (direct),
    // backed up and reloaded into other pages with Route::Auto, come back byte for byte.
    let g = &geometries()[1];
    let pages = 2 * staged as u64 + 8;
    let pool = Arc::new(DevicePool::allocate(bk, g, Placement::unsharded(), 0, pages + 1).unwrap());
    let storage = pool.storage().unwrap();
    let mut rng =
        common::rng("the_auto_route_picks_by_direction_and_pages_and_moves_the_same_bytes");
    b.write_sync(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();
    let host = Arc::new(HostPool::new(bk, g, pages, HostLayout::PageFirstDirect).unwrap());
    let streams = plain_streams(&|| -> Arc<dyn Backend> { b.clone() });
    let mut ctl =
        HiCacheController::new(pool.clone(), host, streams, WritePolicy::WriteBack).unwrap();
    let big: Vec<u64> = (1..=staged as u64).collect();
    let small = [staged as u64 + 1, staged as u64 + 3, staged as u64 + 5];
    for (id, from, to) in [
        (
            1,
            big.clone(),
            big.iter()
                .map(|p| p + staged as u64 + 8)
                .collect::<Vec<_>>(),
        ),
        (2, small.to_vec(), vec![pages - 2, pages - 1, pages]),
    ] {
        let local = |ps: &[u64]| ps.iter().map(|&p| LocalPage(p)).collect::<Vec<_>>();
        let before = pool.read_pages_sync(bk, &local(&from)).unwrap();
        let now = done(bk);
        ctl.backup(&cache_node(id, &from), &now, Route::Auto)
            .unwrap();
        ctl.ack_backups_sync(1).unwrap();
        ctl.load(id, &lp(&to), None, Route::default()).unwrap();
        ctl.ack_loads_sync(1).unwrap();
        assert!(
            pool.read_pages_sync(bk, &local(&to)).unwrap() == before,
            "node {id}: {} pages",
            from.len()
        );
    }
    assert!(
        ctl.staging_bytes() > 0,
        "the large load went through the staging"
    );
}

#[test]
fn staged_backups_back_to_back_reuse_one_staging() {
    let b = Probe::cpu();
    let g = &geometries()[1];
    let placement = Placement::unsharded();
    let (pages, nodes) = (70u64, 3u64);
    let (device_pages, host_pages) = (pages * nodes + 2, pages * nodes + 2);
    let pool = Arc::new(DevicePool::allocate(b.as_ref(), g, placement, 0, device_pages).unwrap());
    let storage = pool.storage().unwrap();
    let mut rng = common::rng("staged_backups_back_to_back_reuse_one_staging");
    b.write_sync(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();
    let before = pool.snapshot_sync(b.as_ref()).unwrap();
    let host =
        Arc::new(HostPool::new(b.as_ref(), g, host_pages, HostLayout::PageFirstDirect).unwrap());
    host.fill(b.as_ref(), POISON).unwrap();
    let ps = ProbeStreams::new(&b);
    let mut ctl = HiCacheController::new(
        pool.clone(),
        host.clone(),
        ps.streams(),
        WritePolicy::WriteBack,
    )
    .unwrap();
    assert_eq!(ctl.staging_pages(), DEFAULT_STAGING_PAGES);
    assert_eq!((DEFAULT_STAGING_PAGES, ctl.staging_bytes()), (16, 0));
    let staging_bytes = 2 * DEFAULT_STAGING_PAGES as usize * g.page_bytes();
    // Three nodes of 70 pages (chunks of 16, 16, 16, 16 and 6): one in order, one reversed, one every
    // other page of the rest, so the relayout scatters.
    let chain: Vec<Vec<LogicalPage>> = vec![
        lp(&(1..=70).collect::<Vec<_>>()),
        lp(&(71..=140).rev().collect::<Vec<_>>()),
        lp(&(141..=210)
            .step_by(2)
            .chain((142..=210).step_by(2))
            .collect::<Vec<_>>()),
    ];
    let routes = [
        Route::Staged(Method::CopyEngine),
        Route::Staged(common::host_io(2)),
        Route::Staged(Method::CopyEngine),
    ];
    // Tables for a kernel relayout: one block copy per staging buffer.
    let new_tables = [0, 2, 0];
    let now = done(b.as_ref());
    ps.backup.hold();
    ps.backup_relayout.hold();
    let mut allocs = ps.tables.allocs();
    for (i, (pages, &route)) in chain.iter().zip(&routes).enumerate() {
        let n = CacheNode {
            id: i as u64,
            device_pages: pages.clone(),
            start_owner: None,
        };
        assert_eq!(ctl.backup(&n, &now, route).unwrap(), i as u64);
        assert_eq!(ctl.staging_bytes(), staging_bytes, "made once, for backups");
        let made = ps.tables.allocs() - allocs;
        if i == 0 {
            // Two staging buffers of one device mirror per component.
            assert_eq!(made, 2 * g.components().len(), "staging");
        } else {
            assert_eq!(made, new_tables[i], "{route}: only its own tables");
        }
        allocs = ps.tables.allocs();
    }
    let n = CacheNode {
        id: 9,
        device_pages: lp(&[211]),
        start_owner: None,
    };
    ctl.backup(&n, &now, routes[0]).unwrap();
    assert_eq!(ps.tables.allocs(), allocs, "the staging is reused");
    assert!(
        ctl.set_staging_pages(16).is_err(),
        "no resize while the staging may be in use"
    );
    let acks = ctl.ack_backups_sync(4).unwrap();
    assert_eq!(
        acks.iter().map(|a| a.index).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    let mut expected = vec![POISON; host.snapshot_sync(b.as_ref()).unwrap().len()];
    for (pages, ack) in chain.iter().zip(&acks) {
        assert_eq!(ack.bytes, 70 * g.page_bytes() as u64);
        expect_moved(
            pool.components(),
            (placement, 0),
            (&before, pages, device_pages),
            (&mut expected, &ack.host_pages, host_pages),
        );
    }
    let backed_up = host.snapshot_sync(b.as_ref()).unwrap();
    // Node 9's page was backed up too.
    expect_moved(
        pool.components(),
        (placement, 0),
        (&before, &lp(&[211]), device_pages),
        (&mut expected, &acks[3].host_pages, host_pages),
    );
    assert!(
        backed_up == expected,
        "host pool after three staged backups"
    );
    // Staged loads back, into the other nodes' pages, reuse one load staging of a new size.
    assert!(matches!(
        ctl.set_staging_pages(0),
        Err(Error::InvalidArgument(_))
    ));
    ctl.set_staging_pages(24).unwrap();
    assert_eq!((ctl.staging_pages(), ctl.staging_bytes()), (24, 0));
    ps.load.hold();
    ps.load_relayout.hold();
    for (i, &route) in routes.iter().enumerate() {
        let into = &chain[(i + 1) % chain.len()];
        assert_eq!(
            ctl.load(i as u64, into, None, route).unwrap().index(),
            i as u64
        );
    }
    assert_eq!(ctl.staging_bytes(), 2 * 24 * g.page_bytes(), "loads only");
    let loads = ctl.ack_loads_sync(3).unwrap();
    assert_eq!(loads.iter().map(|l| l.node).collect::<Vec<_>>(), [0, 1, 2]);
    let mut reloaded = before.clone();
    for (i, ack) in acks.iter().take(3).enumerate() {
        let into = &chain[(i + 1) % chain.len()];
        expect_moved(
            pool.components(),
            (placement, 0),
            (&backed_up, &ack.host_pages, host_pages),
            (&mut reloaded, into, device_pages),
        );
    }
    assert!(
        pool.snapshot_sync(b.as_ref()).unwrap() == reloaded,
        "device pool after three staged loads"
    );
}

#[test]
fn refused_routes_change_nothing() {
    let b = Probe::cpu();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(b.as_ref(), g, placement, 0, 8);
    let before = pool.snapshot_sync(b.as_ref()).unwrap();
    let host = Arc::new(HostPool::new(b.as_ref(), g, HOST_PAGES, HostLayout::PageFirst).unwrap());
    host.fill(b.as_ref(), POISON).unwrap();
    let ps = ProbeStreams::new(&b);
    let mut ctl = HiCacheController::new(
        pool.clone(),
        host.clone(),
        ps.streams(),
        WritePolicy::WriteThroughSelective,
    )
    .unwrap();
    let range_kernel = Method::RangeKernel(Launch {
        ctas: 2,
        threads: 64,
    });
    // Launch shapes no kernel takes, and methods the route does not run.
    let refused = [
        Route::Staged(common::host_io(0)),
        common::host_io(0).into(),
        range_kernel.into(),
        Route::Staged(range_kernel),
        Route::Staged(Method::PerBlock),
        Route::Staged(Method::BatchedCopyEngine),
    ];
    let device = [4u64, 6, 7];
    let n = cache_node(1, &device);
    let now = done(b.as_ref());
    let free: Vec<usize> = (0..2).map(|r| ctl.host_allocator().free_pages(r)).collect();
    let allocs = ps.tables.allocs();
    let unchanged = |ctl: &HiCacheController| {
        let now: Vec<usize> = (0..2).map(|r| ctl.host_allocator().free_pages(r)).collect();
        assert_eq!(now, free);
        assert!((1..2 * HOST_PAGES).all(|p| !ctl.host_allocator().is_allocated(LogicalPage(p))));
        assert_eq!((ctl.pending_backups(), ctl.pending_loads()), (0, 0));
        assert_eq!(ctl.staging_bytes(), 0);
        assert_eq!(ps.tables.allocs(), allocs);
        assert!(host
            .snapshot_sync(b.as_ref())
            .unwrap()
            .iter()
            .all(|&x| x == POISON));
        assert!(pool.snapshot_sync(b.as_ref()).unwrap() == before);
    };
    for route in refused {
        let err = ctl.backup(&n, &now, route).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument(_) | Error::UnsupportedMethod { .. }
            ),
            "{route}: {err}"
        );
        // Refused accesses are not counted: two of them do not make the node due.
        assert!(ctl.access(&n, &now, route).is_err(), "{route}");
        assert!(ctl.evict_sync(&n, &now, route).is_err(), "{route}");
        assert!(ctl.load(1, &lp(&device), None, route).is_err(), "{route}");
        unchanged(&ctl);
    }
    // Token-major page_first is no reason to refuse the copy-engine relayout any more.
    let io = Route::Staged(Method::CopyEngine);
    assert_eq!(ctl.access(&n, &now, io).unwrap(), None, "first counted hit");
    assert_eq!(ctl.access(&n, &now, io).unwrap(), Some(0), "no index lost");
    ctl.ack_backups_sync(1).unwrap();
    // A load on a refused route changes nothing either; the next one gets index 0.
    let reload = lp(&[8, 10, 11]);
    for route in refused {
        assert!(ctl.load(1, &reload, None, route).is_err(), "{route}");
        assert_eq!(ctl.pending_loads(), 0);
    }
    assert_eq!(ctl.load(1, &reload, None, io).unwrap().index(), 0);
    assert_eq!(ctl.ack_loads_sync(1).unwrap()[0].node, 1);
    let mut expected = before.clone();
    expect_moved(
        pool.components(),
        (placement, 0),
        (&before, &lp(&device), DEVICE_PAGES),
        (&mut expected, &reload, DEVICE_PAGES),
    );
    assert!(pool.snapshot_sync(b.as_ref()).unwrap() == expected);
}

// ---------------------------------------------------------------------------------------------
// A failed backup leaks nothing

/// Which of the controller's streams a fault is injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Faulty {
    Backup,
    BackupRelayout,
    Tables,
}

/// For `route`, fails the k-th faultable call on the `faulty` stream of a backup, for k = 1, 2,
/// ... until a backup makes fewer such calls than k, each k on a fresh controller (so the
/// staging and kernel tables a first staged or kernel backup makes fail at every step too): every
/// failed backup returns an error and leaves the host allocator and the pending backups as they
/// were, and a backup of the same node with the fault cleared succeeds, acks and holds the
/// node's bytes. Returns how many faults fired.
fn failed_backups_leak_nothing(b: &Arc<Probe>, route: Route, faulty: Faulty) -> usize {
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(b.as_ref(), g, placement, 0, 21);
    let source = pool.snapshot_sync(b.as_ref()).unwrap();
    let host = Arc::new(HostPool::new(b.as_ref(), g, HOST_PAGES, HostLayout::PageFirst).unwrap());
    host.fill(b.as_ref(), POISON).unwrap();
    let ps = ProbeStreams::new(b);
    // Backups run only when acked (or when a failed one is cleaned up), as on a busy GPU.
    ps.backup.hold();
    ps.backup_relayout.hold();
    let stream = match faulty {
        Faulty::Backup => &ps.backup,
        Faulty::BackupRelayout => &ps.backup_relayout,
        Faulty::Tables => &ps.tables,
    };
    // Rank 0 owns 4, 6, 8 and 10 (local 2, 3, 4, 5: one run).
    let node = cache_node(5, &[4, 5, 6, 7, 8, 10]);
    let now = done(b.as_ref());
    let mut fired = 0;
    for k in 1.. {
        let case = format!("{route}, fault {k} on the {faulty:?} stream");
        let mut ctl = HiCacheController::new(
            pool.clone(),
            host.clone(),
            ps.streams(),
            WritePolicy::WriteBack,
        )
        .unwrap();
        // A small staging, so a staged backup runs several segments through both buffers.
        ctl.set_staging_pages(2).unwrap();
        // Another node's backup sits in the queue, unacked, the whole time (on a route that
        // makes no staging or tables).
        let other = cache_node(1, &[12, 14]);
        assert_eq!(ctl.backup(&other, &now, Method::CopyEngine).unwrap(), 0);
        let free = ctl.host_allocator().total_free();
        stream.arm(&FAULTABLE, k);
        let result = ctl.backup(&node, &now, route);
        let call = stream.disarm();
        let passed = result.is_ok();
        let index = match result {
            Ok(index) => {
                assert!(call.is_none(), "{case}: the fault fired, the backup passed");
                index
            }
            Err(e) => {
                let call = call.expect("an error without the fault");
                assert!(e.to_string().contains("injected"), "{case} ({call:?}): {e}");
                fired += 1;
                assert_eq!(ctl.host_allocator().total_free(), free, "{case} ({call:?})");
                assert_eq!(ctl.pending_backups(), 1, "{case} ({call:?})");
                assert!(ctl.host_pages(node.id).is_none(), "{case}");
                // The fault cleared, the same node backs up.
                ctl.backup(&node, &now, route)
                    .unwrap_or_else(|e| panic!("{case} ({call:?}), then: {e}"))
            }
        };
        assert_eq!(index, 1, "{case}: no queue index lost");
        let acks = ctl.ack_backups_sync(2).unwrap();
        assert_eq!((acks[0].node, acks[1].node), (other.id, node.id), "{case}");
        assert_eq!(acks[1].bytes, 4 * g.page_bytes() as u64, "{case}");
        // The acked host pages hold the node's owned blocks.
        let held = host.snapshot_sync(b.as_ref()).unwrap();
        let mut want = held.clone();
        expect_moved(
            pool.components(),
            (placement, 0),
            (&source, &node.device_pages, DEVICE_PAGES),
            (&mut want, &acks[1].host_pages, HOST_PAGES),
        );
        assert!(held == want, "{case}: host pages after the retry");
        if passed {
            break;
        }
    }
    fired
}

// On every route, a backup failed by any call of its backup, relayout or tables stream leaks
// nothing and a retry succeeds; and the faults fired where each stream has calls to fail.
// The CPU twin runs deferred: the probe holds the backup streams' work until it is acked.
common::on_cpu_and_gpu!(
    a_failed_backup_leaks_nothing_whichever_call_fails,
    [StreamOrder::Deferred],
    |device| {
        let b = Probe::on(device);
        for route in ROUTES {
            let staged = matches!(route, Route::Staged(_));
            let kernel = matches!(route, Route::Direct(Method::Kernel(_)));
            for faulty in [Faulty::Backup, Faulty::BackupRelayout, Faulty::Tables] {
                let fired = failed_backups_leak_nothing(&b, route, faulty);
                eprintln!("{route}: {fired} faults on the {faulty:?} stream");
                let expected = match faulty {
                    // The wait for compute, the copies, the completion event at least.
                    Faulty::Backup => fired >= 3,
                    Faulty::BackupRelayout => (fired > 0) == staged,
                    // Kernel tables; the staging (and a kernel relayout's tables).
                    Faulty::Tables => (fired > 0) == (staged || kernel),
                };
                assert!(expected, "{route}: {fired} faults on the {faulty:?} stream");
            }
        }
    }
);

// ---------------------------------------------------------------------------------------------
// Per-layer readiness on the CPU (deferred backend)

/// How a load publishes its layers' readiness.
#[derive(Debug, Clone, Copy)]
enum Loader {
    /// `HiCacheController::load` on a route.
    Controller(Route),
    /// `HostTransfer::run_signalled` straight, with its own ready counters.
    Signalled,
}

/// What a consumer saw of a load: per model layer of interest, whether every block of the
/// node had landed and whether every block was still poison, right after it waited for layer 0
/// only; whether the pool held exactly the node after it waited for the last target layer; and
/// whether the draft's readiness is layer 0's.
#[derive(Debug)]
struct Readiness {
    layer0: (bool, bool),
    draft: (bool, bool),
    last: (bool, bool),
    complete: bool,
    draft_is_layer0: bool,
}

/// Whether two readiness entries are the same: one counter and target, or one event.
fn same_readiness(a: &LayerReady, b: &LayerReady) -> bool {
    match (a, b) {
        (LayerReady::Counter(x), LayerReady::Counter(y)) => {
            x.layer() == y.layer() && x.target() == y.target()
        }
        // Events are opaque: a CPU event's debug form names its stream and position.
        (LayerReady::Event(x), LayerReady::Event(y)) => format!("{x:?}") == format!("{y:?}"),
        _ => false,
    }
}

/// Backs a node of 6 pages up from a random pool (on a deferred CPU backend), poisons the pool,
/// loads the node back with `loader` and watches it from a consumer stream.
fn readiness(loader: Loader, layout: HostLayout) -> Readiness {
    let root = CpuBackend::deferred();
    let g = &geometries()[0];
    let (placement, pages) = (Placement::unsharded(), 8u64);
    let pool = Arc::new(DevicePool::allocate(&root, g, placement, 0, pages).unwrap());
    let storage = pool.storage().unwrap();
    let mut rng = StdRng::seed_from_u64(31);
    root.write_sync(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();
    let source = pool.snapshot_sync(&root).unwrap();
    let host = Arc::new(HostPool::new(&root, g, pages, layout).unwrap());
    host.fill(&root, POISON).unwrap();
    let node = cache_node(1, &[1, 2, 3, 4, 5, 6]);
    let local: Vec<LocalPage> = (1..=6).map(LocalPage).collect();
    let streams = plain_streams(&|| Arc::new(root.new_stream()) as Arc<dyn Backend>);
    let consumer = root.new_stream();
    let components = g.components();
    let draft = ModelLayer(g.target.num_layers());
    let last = ModelLayer(g.target.num_layers() - 1);
    // Every block of the node in model layer `m`: (all landed, all still poison).
    let state = |m: ModelLayer| {
        let (mut landed, mut poison) = (true, true);
        for (c, comp) in components.iter().enumerate() {
            let Some(l) = comp.stored_layer(m) else {
                continue;
            };
            for &p in &local {
                // What the engine's attention reads: its own view of the block, ordered by the
                // layer's readiness only (a kvshard read would wait for the whole load).
                let addr = pool.block_addr(comp.component, l, p).unwrap();
                // SAFETY: one block of the pool, alive for the whole test.
                let view = unsafe {
                    Buffer::from_raw(
                        addr,
                        comp.block_bytes,
                        MemoryKind::Device,
                        pool.address_space(),
                    )
                };
                let got = consumer.read_sync(&view, 0, comp.block_bytes).unwrap();
                let at = canon(&components, pages, c, l.0, p.0);
                landed &= got[..] == source[at..at + comp.block_bytes];
                poison &= got.iter().all(|&x| x == POISON);
            }
        }
        (landed, poison)
    };
    let mut expected = vec![POISON; source.len()];
    expect_moved(
        &components,
        (placement, 0),
        (&source, &node.device_pages, pages),
        (&mut expected, &node.device_pages, pages),
    );
    let observe = |layers: &[LayerReady]| {
        assert_eq!(layers.len(), g.model_layers());
        layers[0].wait(&consumer).unwrap();
        let (layer0, draft_state, last_state) = (state(ModelLayer(0)), state(draft), state(last));
        layers[last.0].wait(&consumer).unwrap();
        Readiness {
            layer0,
            draft: draft_state,
            last: last_state,
            complete: pool.snapshot_sync(&consumer).unwrap() == expected,
            draft_is_layer0: same_readiness(&layers[draft.0], &layers[0]),
        }
    };
    match loader {
        Loader::Controller(route) => {
            let mut ctl =
                HiCacheController::new(pool.clone(), host.clone(), streams, WritePolicy::WriteBack)
                    .unwrap();
            let compute = root.record().unwrap();
            ctl.backup(&node, &compute, route).unwrap();
            ctl.ack_backups_sync(1).unwrap();
            pool.fill(&root, POISON).unwrap();
            let poisoned = root.record().unwrap();
            let handle = ctl
                .load(1, &node.device_pages, Some(&poisoned), route)
                .unwrap();
            let seen = observe(handle.layers());
            if let (Route::Direct(Method::Kernel(_)), LayerReady::Counter(c)) =
                (route, &handle.layers()[draft.0])
            {
                assert_eq!(c.layer(), ModelLayer(0), "the draft counts into layer 0");
            }
            assert_eq!(ctl.ack_loads_sync(1).unwrap()[0].node, 1);
            seen
        }
        Loader::Signalled => {
            let plan = TransferPlan::new(
                placement,
                0,
                &node.device_pages,
                &node.device_pages,
                pages,
                pages,
            )
            .unwrap();
            let backup =
                HostTransfer::new(pool.clone(), host.clone(), plan.clone(), Direction::Backup)
                    .unwrap();
            // After the host pool's poison (deferred on `root` until something waits for it).
            streams.backup.wait(&root.record().unwrap()).unwrap();
            backup
                .run(streams.backup.as_ref(), Method::CopyEngine, Layers::All)
                .unwrap();
            streams.backup.synchronize().unwrap();
            pool.fill(&root, POISON).unwrap();
            let load = streams.load.as_ref();
            load.wait(&root.record().unwrap()).unwrap();
            let mut t =
                HostTransfer::new(pool.clone(), host.clone(), plan, Direction::Load).unwrap();
            t.prepare_kernel_sync(streams.tables.as_ref(), &mut Vec::new())
                .unwrap();
            let mut signals = LayerSignals::new(streams.tables.as_ref(), g.model_layers()).unwrap();
            let waits = t
                .run_signalled(load, Launch::host_io(load, 2), &mut signals)
                .unwrap();
            assert_eq!(waits[draft.0].layer(), ModelLayer(0));
            let layers: Vec<LayerReady> = waits.into_iter().map(LayerReady::Counter).collect();
            let seen = observe(&layers);
            load.synchronize().unwrap();
            seen
        }
    }
}

/// The loaders whose layers become ready one by one.
const PER_LAYER: [Loader; 5] = [
    Loader::Controller(Route::Direct(common::host_io(2))),
    Loader::Controller(Route::Direct(Method::CopyEngine)),
    Loader::Controller(Route::Direct(Method::PerBlock)),
    Loader::Controller(Route::Direct(Method::BatchedCopyEngine)),
    Loader::Signalled,
];

const STAGED: [Loader; 2] = [
    Loader::Controller(Route::Staged(common::host_io(2))),
    Loader::Controller(Route::Staged(Method::CopyEngine)),
];

#[test]
fn cpu_layer_zero_is_consumable_before_the_last_layer_lands() {
    for layout in HostLayout::ALL {
        for loader in PER_LAYER {
            let seen = readiness(loader, layout);
            let case = format!("{layout} {loader:?}: {seen:?}");
            assert_eq!(
                seen.layer0,
                (true, false),
                "{case}: layer 0 once it is ready"
            );
            assert_eq!(seen.last, (false, true), "{case}: the last layer then");
            assert!(
                seen.complete,
                "{case}: everything once the last layer is ready"
            );
        }
    }
}

#[test]
fn cpu_the_mtp_draft_is_ready_with_layer_0() {
    for layout in HostLayout::ALL {
        for loader in PER_LAYER.into_iter().chain(STAGED) {
            let seen = readiness(loader, layout);
            let case = format!("{layout} {loader:?}: {seen:?}");
            assert_eq!(seen.draft, (true, false), "{case}: the draft with layer 0");
            assert!(seen.draft_is_layer0, "{case}: the draft's readiness");
        }
    }
}

#[test]
fn cpu_staged_loads_are_ready_as_a_whole() {
    for layout in HostLayout::ALL {
        for loader in STAGED {
            let seen = readiness(loader, layout);
            let case = format!("{layout} {loader:?}: {seen:?}");
            assert_eq!(seen.layer0, (true, false), "{case}");
            assert_eq!(seen.last, (true, false), "{case}: ready with layer 0");
            assert!(seen.complete, "{case}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// On the GPU only: engine-registered and NUMA-local pinned host memory, and per-layer readiness
// caught in flight (the CPU twin's readiness is observed deferred, above)

#[test]
fn gpu_registered_and_numa_local_host_pools_round_trip() {
    let name = "gpu_registered_and_numa_local_host_pools_round_trip";
    let Some(cuda) = common::cuda(name) else {
        return;
    };
    let gpu = cuda.gpu().clone();
    let mut rng = common::rng(name);
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let node = node(&mut rng, placement, 9);
    let cpu = CpuBackend::new();
    let cpu_other = cpu.new_stream();
    for layout in HostLayout::ALL {
        let reference = Where {
            b: &cpu,
            other: &cpu_other,
            g,
            layout,
            placement,
            rank: 1,
            kind: PoolKind::Allocated,
        };
        let want = round_trip(&reference, Route::Direct(Method::CopyEngine), &node);
        // Engine-owned memory, registered in chunks of a few pages each.
        let sizes: Vec<usize> = g
            .components()
            .iter()
            .map(|c| c.page_bytes() * HOST_PAGES as usize)
            .collect();
        let layouts: Vec<std::alloc::Layout> = sizes
            .iter()
            .map(|&s| std::alloc::Layout::from_size_align(s, 4096).unwrap())
            .collect();
        // SAFETY: non-zero sizes; freed below after the pools are dropped.
        let memory: Vec<*mut u8> = layouts
            .iter()
            .map(|&l| unsafe { std::alloc::alloc_zeroed(l) })
            .collect();
        assert!(memory.iter().all(|p| !p.is_null()));
        let regions: Vec<kvshard::hicache::HostRegion> = memory
            .iter()
            .zip(&sizes)
            .map(|(&host, &len)| kvshard::hicache::HostRegion { host, len })
            .collect();
        {
            // The smallest chunks registration allows (one 64 KiB-aligned grain of pages):
            // several per component in layer_first.
            // SAFETY: the regions are live, aligned, unregistered, and outlive the pool.
            let registered =
                unsafe { HostPool::register(&gpu, g, HOST_PAGES, layout, &regions, 1) }.unwrap();
            let numa = HostPool::new_numa_local(&cuda, g, HOST_PAGES, layout).unwrap();
            eprintln!("{layout}: NUMA placement {:?}", numa.numa());
            for host in [Arc::new(registered), Arc::new(numa)] {
                for io in [Method::CopyEngine, common::host_io(2)] {
                    host.fill(&cuda, POISON).unwrap();
                    let source = random_pool(&cuda, g, placement, 1, 8);
                    let plan = node_plan(placement, 1, &node);
                    let mut t =
                        HostTransfer::new(source, host.clone(), plan, Direction::Backup).unwrap();
                    t.prepare_kernel_sync(&cuda, &mut Vec::new()).unwrap();
                    t.run(&cuda, io, Layers::All).unwrap();
                    cuda.synchronize().unwrap();
                    assert!(
                        host.snapshot_sync(&cuda).unwrap() == want.host,
                        "{layout} {io}"
                    );
                }
            }
        }
        for (p, l) in memory.into_iter().zip(layouts) {
            // SAFETY: allocated above with this layout; the registration is gone.
            unsafe { std::alloc::dealloc(p, l) };
        }
    }
}

/// Loads a large node (61 layers and the draft) on `route` through the controller while a
/// consumer stream waits for layer 0 only and then copies one block of layer 0, of the draft
/// and of the last layer: layer 0 and the draft must have landed and, on a direct route, the
/// last layer not yet; a staged load is ready as a whole, so there the last layer must have
/// landed too.
fn layer_zero_lands_first(route: impl Into<Route>) {
    let route = route.into();
    let whole = matches!(route, Route::Staged(_));
    let name = format!("gpu_layer_zero_is_consumable_before_the_last_layer_lands ({route})");
    let Some(gpu) = common::open_gpu(&name) else {
        return;
    };
    let b = common::stream(&gpu);
    let g = CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 61));
    let pages = 256u64;
    let placement = Placement::unsharded();
    let pool = Arc::new(DevicePool::allocate(b.as_ref(), &g, placement, 0, pages + 2).unwrap());
    let host =
        Arc::new(HostPool::new(b.as_ref(), &g, pages + 2, HostLayout::PageFirstDirect).unwrap());
    let streams = plain_streams(&|| common::stream(&gpu));
    let mut ctl =
        HiCacheController::new(pool.clone(), host, streams.clone(), WritePolicy::WriteBack)
            .unwrap();
    const LANDED: u8 = 0x3C;
    pool.fill(b.as_ref(), LANDED).unwrap();
    b.synchronize().unwrap();
    let device: Vec<u64> = (1..=pages).collect();
    let n = cache_node(1, &device);
    let compute = b.record().unwrap();
    assert_eq!(ctl.evict_sync(&n, &compute, route).unwrap().len(), 1);
    // The consumer's stream and probe buffer are made before the load is enqueued: a device
    // allocation may synchronize the device, which would let the whole load land first.
    let consumer = common::stream(&gpu);
    let last_page = LocalPage(pages);
    let probes = [
        (Component::TargetLatent, 0, true),
        (Component::TargetIndexer, 0, true),
        (Component::DraftLatent, 0, true),
        (Component::DraftIndexer, 0, true),
        (Component::TargetLatent, 60, whole),
        (Component::TargetIndexer, 60, whole),
    ];
    let block = |c: Component| {
        g.components()
            .iter()
            .find(|l| l.component == c)
            .unwrap()
            .block_bytes
    };
    let total: usize = probes.iter().map(|&(c, _, _)| block(c)).sum();
    let probe = consumer.alloc(total, MemoryKind::Device).unwrap();
    // The probes can see the last layer early without a fault only when the host enqueued them
    // late: another test's device allocation or free may synchronize the device and stall this
    // thread for the whole load. An attempt whose enqueue took longer than `STALL` proves
    // nothing and is run again (the node evicted anew); one enqueued promptly must hold.
    const STALL: Duration = Duration::from_millis(2);
    for attempt in 0.. {
        if attempt > 0 {
            assert_eq!(ctl.ack_loads_sync(1).unwrap()[0].node, 1);
            // Already on the host since the first eviction: nothing to back up, no ack.
            let compute = b.record().unwrap();
            assert!(ctl.evict_sync(&n, &compute, route).unwrap().is_empty());
        }
        pool.fill(b.as_ref(), POISON).unwrap();
        let poisoned = b.record().unwrap();
        let enqueued = Instant::now();
        let handle = ctl
            .load(1, &n.device_pages, Some(&poisoned), route)
            .unwrap();
        handle.wait_layer(consumer.as_ref(), ModelLayer(0)).unwrap();
        let mut at = 0;
        for &(c, layer, _) in &probes {
            let addr = pool.block_addr(c, StoredLayer(layer), last_page).unwrap();
            // SAFETY: one block of the pool into its own part of the probe buffer.
            unsafe { consumer.memcpy(probe.addr() + at as u64, addr, block(c)) }.unwrap();
            at += block(c);
        }
        let stalled = enqueued.elapsed() > STALL;
        consumer.synchronize().unwrap();
        streams.load.synchronize().unwrap();
        let seen = consumer.read_sync(&probe, 0, total).unwrap();
        let mut at = 0;
        let mut wrong = None;
        for &(c, layer, landed) in &probes {
            let bytes = &seen[at..at + block(c)];
            at += block(c);
            let want = if landed { LANDED } else { POISON };
            if wrong.is_none() && !bytes.iter().all(|&x| x == want) {
                wrong = Some(format!(
                    "{route}: {c} stored layer {layer} once layer 0 was ready (expected {})",
                    if landed { "landed" } else { "not yet landed" }
                ));
            }
        }
        match wrong {
            None => break,
            Some(why) if !stalled || attempt == 4 => panic!("{why} (attempt {attempt})"),
            Some(why) => eprintln!("{why}: enqueued after a host stall, run again"),
        }
    }
    assert_eq!(ctl.ack_loads_sync(1).unwrap()[0].node, 1);
    for comp in pool.components() {
        let layers = [0, 30, 60].into_iter().filter(|&l| l < comp.layers());
        for layer in layers.map(StoredLayer) {
            for page in (1..=pages).step_by(5).map(LocalPage) {
                let bytes = pool
                    .read_block_sync(b.as_ref(), comp.component, layer, page)
                    .unwrap();
                assert!(
                    bytes.iter().all(|&x| x == LANDED),
                    "{route}: {} {layer} {page}",
                    comp.component
                );
            }
        }
    }
}

#[test]
fn gpu_layer_zero_is_consumable_before_the_last_layer_lands_sm_kernel() {
    layer_zero_lands_first(common::host_io(4));
}

#[test]
fn gpu_layer_zero_is_consumable_before_the_last_layer_lands_copy_engine() {
    layer_zero_lands_first(Method::CopyEngine);
}

#[test]
fn gpu_staged_loads_are_ready_as_a_whole() {
    layer_zero_lands_first(Route::Staged(Method::CopyEngine));
    layer_zero_lands_first(Route::Staged(common::host_io(4)));
}
