//! HiCache: host pool layouts, owner-aware planning, transfers on every I/O backend and the
//! controller's ordering, acks and policies. Each transfer is checked on the CPU reference
//! against its meaning (owned blocks moved, everything else still poisoned), and on the GPU
//! against the CPU result byte for byte.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kvshard::abi;
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{Backend, Buffer, Copy2d, Launch, MemoryKind};
use kvshard::geometry::{CacheGeometry, ComponentLayout, LatentLayout, PoolGeometry};
use kvshard::hicache::{
    pages_of_tokens, CacheNode, Direction, HiCacheController, HostLayout, HostPool, HostTransfer,
    IoBackend, IoCalls, LayerReady, LayerSignals, Layers, Relayout, Route, Streams, TransferPlan,
    WritePolicy, DEFAULT_STAGING_PAGES,
};
use kvshard::pool::{BlockSpace, DevicePool, PoolBuffers};
use kvshard::shard::{AllocRequest, ChainStart, Placement, ShardAllocator};
use kvshard::synth::{self, POISON};
use kvshard::Error;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DEVICE_PAGES: u64 = 12;
const HOST_PAGES: u64 = 14;

const IOS: [IoBackend; 4] = [
    IoBackend::SmKernel { ctas: 2 },
    IoBackend::CopyEngine,
    IoBackend::PerBlockMemcpy,
    IoBackend::BatchMemcpy,
];

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

fn random_pool<B: Backend>(
    b: &B,
    g: &CacheGeometry,
    placement: Placement,
    rank: u32,
    seed: u64,
) -> DevicePool {
    let pool = DevicePool::allocate(b, g, placement, rank, DEVICE_PAGES).unwrap();
    let storage = pool.storage().unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    b.write(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();
    pool
}

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
    device: Vec<u64>,
    host: Vec<u64>,
    reload: Vec<u64>,
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

/// Offset of block (`c`, `l`, `p`) in a canonical snapshot of `pages` pages.
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

fn canon(components: &[ComponentLayout], pages: u64, c: usize, l: usize, p: u64) -> usize {
    let before: usize = components[..c]
        .iter()
        .map(|x| x.layers() * pages as usize * x.block_bytes)
        .sum();
    before + (l * pages as usize + p as usize) * components[c].block_bytes
}

/// `dst` with the owned pairs' blocks of `src` copied in (both canonical snapshots).
#[allow(clippy::too_many_arguments)]
fn expect_moved(
    components: &[ComponentLayout],
    placement: Placement,
    rank: u32,
    src: &[u8],
    src_pages: (&[u64], u64),
    dst: &mut [u8],
    dst_pages: (&[u64], u64),
) {
    for (&s, &d) in src_pages.0.iter().zip(dst_pages.0) {
        if placement.owner(s) != rank {
            continue;
        }
        let (s, d) = (placement.local_page(s), placement.local_page(d));
        for (c, comp) in components.iter().enumerate() {
            for l in 0..comp.layers() {
                let from = canon(components, src_pages.1, c, l, s);
                let to = canon(components, dst_pages.1, c, l, d);
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

/// Backs `node` up from a random pool of `rank` into a poisoned host pool, then loads it into a
/// poisoned device pool, with `io` both ways; returns every pool's bytes.
fn round_trip<B: Backend>(
    b: &B,
    g: &CacheGeometry,
    layout: HostLayout,
    placement: Placement,
    rank: u32,
    io: IoBackend,
    node: &Node,
) -> Trip {
    round_trip_with(b, g, layout, placement, rank, node, &|t| {
        t.run(b, io, Layers::All).unwrap()
    })
}

/// As [`round_trip`], moving each direction with `run` (which leaves `b`'s stream ordered after
/// everything it enqueued).
fn round_trip_with<B: Backend>(
    b: &B,
    g: &CacheGeometry,
    layout: HostLayout,
    placement: Placement,
    rank: u32,
    node: &Node,
    run: &dyn Fn(&HostTransfer<'_>),
) -> Trip {
    let source = random_pool(b, g, placement, rank, 7 + u64::from(rank));
    let host = HostPool::new(b, g, HOST_PAGES, layout).unwrap();
    host.fill(b, POISON).unwrap();
    let reloaded = DevicePool::allocate(b, g, placement, rank, DEVICE_PAGES).unwrap();
    reloaded.fill(b, POISON).unwrap();
    let plan = |device: &[u64]| {
        TransferPlan::new(
            placement,
            rank,
            device,
            &node.host,
            DEVICE_PAGES,
            HOST_PAGES,
        )
        .unwrap()
    };
    let mut backup =
        HostTransfer::new(&source, &host, plan(&node.device), Direction::Backup).unwrap();
    backup.prepare_kernel(b, None).unwrap();
    run(&backup);
    let mut load =
        HostTransfer::new(&reloaded, &host, plan(&node.reload), Direction::Load).unwrap();
    load.prepare_kernel(b, None).unwrap();
    run(&load);
    b.synchronize().unwrap();
    Trip {
        source: source.snapshot(b).unwrap(),
        host: host.snapshot(b).unwrap(),
        reloaded: reloaded.snapshot(b).unwrap(),
    }
}

/// Asserts that a round trip of `rank`'s pages put exactly its owned pages of `source` (at
/// `device` pages) into `host` (at `host_pages`; every other byte poison) and from there into
/// `reloaded` (at `reload` pages; every other byte as in `device_base`).
fn assert_round_trip(
    components: &[ComponentLayout],
    (placement, rank): (Placement, u32),
    (source, host, reloaded): (&[u8], &[u8], &[u8]),
    (device, host_pages, reload): (&[u64], &[u64], &[u64]),
    device_base: Vec<u8>,
    case: &str,
) {
    let mut want_host = vec![POISON; host.len()];
    expect_moved(
        components,
        placement,
        rank,
        source,
        (device, DEVICE_PAGES),
        &mut want_host,
        (host_pages, HOST_PAGES),
    );
    assert!(host == want_host, "{case}: host");
    let mut want_device = device_base;
    expect_moved(
        components,
        placement,
        rank,
        host,
        (host_pages, HOST_PAGES),
        &mut want_device,
        (reload, DEVICE_PAGES),
    );
    assert!(reloaded == want_device, "{case}: reloaded device pool");
}

/// Calls `f(geometry, placement, rank, node)` for every test geometry, N in {1, 2, 4} and the
/// ranks `ranks(N)` names, with one node of 3N + 1 random pages per (geometry, N).
fn for_each_rank(
    rng: &mut impl Rng,
    ranks: impl Fn(u32) -> Vec<u32>,
    mut f: impl FnMut(&CacheGeometry, Placement, u32, &Node),
) {
    for g in geometries() {
        for n in [1u32, 2, 4] {
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

/// The first and the last rank (the GPU twins check these; the CPU tests check every rank).
fn edge_ranks(n: u32) -> Vec<u32> {
    let mut ranks = vec![0, n - 1];
    ranks.dedup();
    ranks
}

#[test]
fn cpu_round_trips_move_exactly_the_owned_pages_for_every_layout_and_backend() {
    let mut rng = common::rng("cpu_round_trips");
    let b = CpuBackend::new();
    for_each_rank(&mut rng, all_ranks, |g, placement, rank, node| {
        for layout in HostLayout::ALL {
            for io in IOS {
                let trip = round_trip(&b, g, layout, placement, rank, io, node);
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
    });
}

/// A round trip through double-buffered device staging with `chunk`-page buffers, the copy engine
/// on `b` and the relayout kernel on `other`.
fn staged_round_trip<B: Backend>(
    (b, other): (&B, &B),
    g: &CacheGeometry,
    (layout, how): (HostLayout, Relayout),
    placement: Placement,
    rank: u32,
    chunk: u64,
    node: &Node,
) -> Trip {
    round_trip_with(b, g, layout, placement, rank, node, &|t| {
        let staging = t.staging(b, chunk).unwrap();
        t.run_staged(b, other, &staging, how).unwrap();
        // The staging buffers are dropped here: `b` reaching this point means all has landed.
        b.synchronize().unwrap();
    })
}

/// The relayouts a host layout supports: the copy engine needs whole blocks on the host side.
fn relayouts(layout: HostLayout) -> Vec<Relayout> {
    let mut out = vec![Relayout::Kernel { ctas: 2 }];
    if layout != HostLayout::PageFirst {
        out.push(Relayout::CopyEngine);
    }
    out
}

#[test]
fn copy_engine_relayout_refuses_token_major_rows() {
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(1).unwrap();
    let pool = DevicePool::allocate(&b, g, placement, 0, DEVICE_PAGES).unwrap();
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirst).unwrap();
    let plan = TransferPlan::new(placement, 0, &[1, 2], &[1, 2], DEVICE_PAGES, HOST_PAGES).unwrap();
    let mut t = HostTransfer::new(&pool, &host, plan, Direction::Load).unwrap();
    t.prepare_kernel(&b, None).unwrap();
    let staging = t.staging(&b, 2).unwrap();
    let err = t
        .run_staged(&b, &b.new_stream(), &staging, Relayout::CopyEngine)
        .unwrap_err();
    assert!(err.to_string().contains("whole blocks"), "{err}");
}

#[test]
fn staging_of_another_transfer_or_no_ctas_is_refused_before_anything_moves() {
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(1).unwrap();
    let pool = DevicePool::allocate(&b, g, placement, 0, DEVICE_PAGES).unwrap();
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirstDirect).unwrap();
    let plan = TransferPlan::new(placement, 0, &[1, 2], &[1, 2], DEVICE_PAGES, HOST_PAGES).unwrap();
    let mut load = HostTransfer::new(&pool, &host, plan.clone(), Direction::Load).unwrap();
    let mut backup = HostTransfer::new(&pool, &host, plan, Direction::Backup).unwrap();
    load.prepare_kernel(&b, None).unwrap();
    backup.prepare_kernel(&b, None).unwrap();
    let load_staging = load.staging(&b, 2).unwrap();
    let before = b.read(host.buffer(0).unwrap(), 0, 4096).unwrap();
    let other = b.new_stream();
    for how in [Relayout::Kernel { ctas: 2 }, Relayout::CopyEngine] {
        let err = backup
            .run_staged(&b, &other, &load_staging, how)
            .unwrap_err();
        assert!(err.to_string().contains("staging made for a Load"), "{err}");
    }
    let err = load
        .run_staged(&b, &other, &load_staging, Relayout::Kernel { ctas: 0 })
        .unwrap_err();
    assert!(err.to_string().contains("0 CTAs"), "{err}");
    b.synchronize().unwrap();
    assert_eq!(b.read(host.buffer(0).unwrap(), 0, 4096).unwrap(), before);
}

/// Every relayout and chunk size of the staged path on `b` (+ `other`) against the direct copy
/// engine on the CPU reference, for every layout, rank `rank` of `placement`.
fn staged_matches_direct<B: Backend>(
    (b, other): (&B, &B),
    g: &CacheGeometry,
    placement: Placement,
    rank: u32,
    chunks: &[u64],
    node: &Node,
) {
    let cpu = CpuBackend::new();
    for layout in HostLayout::ALL {
        let want = round_trip(
            &cpu,
            g,
            layout,
            placement,
            rank,
            IoBackend::CopyEngine,
            node,
        );
        for &chunk in chunks {
            for how in relayouts(layout) {
                let got =
                    staged_round_trip((b, other), g, (layout, how), placement, rank, chunk, node);
                let case = format!("N={} {layout} {how:?} chunk {chunk}", placement.shard());
                assert!(want.host == got.host, "{case}: host");
                assert!(want.reloaded == got.reloaded, "{case}: reloaded");
            }
        }
    }
}

#[test]
fn staged_round_trips_equal_the_direct_ones() {
    let mut rng = common::rng("staged_round_trips_equal_the_direct_ones");
    let b = CpuBackend::new();
    let other = b.new_stream();
    for g in geometries() {
        for n in [1u32, 2] {
            let placement = Placement::new(n).unwrap();
            let node = node(&mut rng, placement, 3 * n as usize + 1);
            staged_matches_direct((&b, &other), &g, placement, 0, &[1, 2, 64], &node);
        }
    }
}

#[test]
fn gpu_staged_round_trips_match_cpu_byte_for_byte() {
    let Some(gpu) = common::cuda("gpu_staged_round_trips_match_cpu_byte_for_byte") else {
        return;
    };
    let other = kvshard::backend::cuda::CudaBackend::new(gpu.gpu().clone()).unwrap();
    let mut rng = common::rng("gpu_staged_round_trips_match_cpu_byte_for_byte");
    for g in geometries() {
        let placement = Placement::new(2).unwrap();
        let node = node(&mut rng, placement, 7);
        staged_matches_direct((&gpu, &other), &g, placement, 1, &[1, 3], &node);
    }
}

#[test]
fn layouts_place_blocks_where_domain_md_says_and_tile_their_buffers() {
    let g = &geometries()[0];
    let b = CpuBackend::new();
    let (pages, b36, b84) = (5u64, 36_864u64, 8448u64);
    for layout in HostLayout::ALL {
        let host = HostPool::new(&b, g, pages, layout).unwrap();
        let base = |c: usize| host.buffer(c).unwrap().addr();
        // Target latent (3 layers of 64 rows of 576 B): layer 2, page 3, row 5.
        let latent = host.row_addr(0, 2, 3, 5).unwrap() - base(0);
        // Target indexer (layers 0 and 2 stored as 0 and 1): stored layer 1, page 4.
        let indexer = host.row_addr(1, 1, 4, 0).unwrap() - base(1);
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
        for (c, comp) in host.components().iter().enumerate() {
            let mut rows: Vec<u64> = (0..comp.layers())
                .flat_map(|l| (0..pages).map(move |p| (l, p)))
                .flat_map(|(l, p)| (0..comp.rows).map(move |r| (l, p, r)))
                .map(|(l, p, r)| host.row_addr(c, l, p, r).unwrap() - base(c))
                .collect();
            rows.sort_unstable();
            let tiled = rows
                .iter()
                .enumerate()
                .all(|(i, &at)| at == i as u64 * comp.row_bytes as u64);
            assert!(tiled, "{layout} {}", comp.component);
            assert_eq!(
                host.buffer(c).unwrap().len(),
                rows.len() * comp.row_bytes,
                "{layout} {}",
                comp.component
            );
        }
        assert!(host.row_addr(0, 3, 0, 0).is_err() && host.row_addr(0, 0, 5, 0).is_err());
    }
}

#[test]
fn every_layout_holds_the_same_canonical_bytes_after_a_backup() {
    let mut rng = common::rng("every_layout_holds_the_same_canonical_bytes");
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let node = node(&mut rng, placement, 9);
    let snapshots: Vec<Vec<u8>> = HostLayout::ALL
        .iter()
        .map(|&layout| round_trip(&b, g, layout, placement, 1, IoBackend::CopyEngine, &node).host)
        .collect();
    assert!(snapshots.windows(2).all(|w| w[0] == w[1]));
    assert!(snapshots[0].iter().any(|&x| x != POISON));
}

#[test]
fn per_layer_runs_add_up_to_the_whole_transfer() {
    let mut rng = common::rng("per_layer_runs_add_up");
    let b = CpuBackend::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let node = node(&mut rng, placement, 9);
    for layout in HostLayout::ALL {
        for io in IOS {
            let whole = round_trip(&b, g, layout, placement, 0, io, &node).host;
            let source = random_pool(&b, g, placement, 0, 7);
            let host = HostPool::new(&b, g, HOST_PAGES, layout).unwrap();
            host.fill(&b, POISON).unwrap();
            let plan = node_plan(placement, 0, &node);
            let mut t = HostTransfer::new(&source, &host, plan, Direction::Backup).unwrap();
            t.prepare_kernel(&b, None).unwrap();
            let mut bytes = 0;
            for m in 0..g.model_layers() {
                t.run(&b, io, Layers::One(m)).unwrap();
                bytes += t.bytes(Layers::One(m)).unwrap();
            }
            assert_eq!(bytes, t.bytes(Layers::All).unwrap());
            assert!(host.snapshot(&b).unwrap() == whole, "{layout} {io}");
            assert!(matches!(
                t.run(&b, io, Layers::One(4)),
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
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirst).unwrap();
    let plan = node_plan(placement, 1, &node);
    let owned = plan.len() as u32;
    let mut t = HostTransfer::new(&source, &host, plan, Direction::Backup).unwrap();
    let mut signals = LayerSignals::new(&b, g.model_layers()).unwrap();
    assert!(
        t.run_signalled(&b, 2, &mut signals).is_err(),
        "tables missing"
    );
    t.prepare_kernel(&b, None).unwrap();
    for round in 1..=2u32 {
        let waits = t.run_signalled(&b, 2, &mut signals).unwrap();
        // Model layers 0 and 2 have latent + indexer, layer 1 latent only, 3 is the draft's two.
        let per_layer = [2, 1, 2, 2].map(|pairs| round * pairs * owned);
        let targets: Vec<u32> = waits.iter().map(|w| w.target()).collect();
        assert_eq!(targets, per_layer, "round {round}");
        let counters = b.read(signals.counters(), 0, 16).unwrap();
        let counted: Vec<u32> = counters
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(counted, per_layer);
        for w in &waits {
            w.wait(&b).unwrap();
            LayerReady::<()>::Counter(w.clone()).wait(&b).unwrap();
        }
    }
    let mut wrong = LayerSignals::new(&b, 3).unwrap();
    assert!(matches!(
        t.run_signalled(&b, 2, &mut wrong),
        Err(Error::GeometryMismatch { .. })
    ));
}

/// A CPU backend that counts what it is asked to do and can hold its events incomplete, to
/// check call counts and the controller's ack logic against events that are not done yet.
struct Probe {
    cpu: CpuBackend,
    calls: Mutex<IoCalls>,
    allocs: Mutex<usize>,
    syncs: Mutex<usize>,
    held: AtomicBool,
    gates: Mutex<Vec<Arc<AtomicBool>>>,
}

impl Probe {
    fn new() -> Self {
        Self::on(CpuBackend::new())
    }

    fn on(cpu: CpuBackend) -> Self {
        Self {
            cpu,
            calls: Mutex::new(IoCalls::default()),
            allocs: Mutex::new(0),
            syncs: Mutex::new(0),
            held: AtomicBool::new(false),
            gates: Mutex::new(Vec::new()),
        }
    }

    fn stream(&self) -> Self {
        Self::on(self.cpu.new_stream())
    }

    /// Events recorded from now on stay incomplete until `synchronize`.
    fn hold(&self) {
        self.held.store(true, Ordering::SeqCst);
    }

    fn take_calls(&self) -> IoCalls {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }

    fn syncs(&self) -> usize {
        *self.syncs.lock().unwrap()
    }

    fn allocs(&self) -> usize {
        *self.allocs.lock().unwrap()
    }
}

impl Backend for Probe {
    type Event = Arc<AtomicBool>;

    fn name(&self) -> &'static str {
        "probe"
    }

    fn alloc(&self, len: usize, kind: MemoryKind) -> kvshard::Result<Buffer> {
        *self.allocs.lock().unwrap() += 1;
        self.cpu.alloc(len, kind)
    }

    fn write(&self, dst: &Buffer, offset: usize, data: &[u8]) -> kvshard::Result<()> {
        self.cpu.write(dst, offset, data)
    }

    fn enqueue_write(&self, dst: &Buffer, offset: usize, data: &[u8]) -> kvshard::Result<()> {
        self.cpu.enqueue_write(dst, offset, data)
    }

    fn read(&self, src: &Buffer, offset: usize, len: usize) -> kvshard::Result<Vec<u8>> {
        self.cpu.read(src, offset, len)
    }

    fn fill(&self, dst: &Buffer, byte: u8) -> kvshard::Result<()> {
        self.cpu.fill(dst, byte)
    }

    fn synchronize(&self) -> kvshard::Result<()> {
        *self.syncs.lock().unwrap() += 1;
        self.held.store(false, Ordering::SeqCst);
        for g in self.gates.lock().unwrap().drain(..) {
            g.store(true, Ordering::SeqCst);
        }
        self.cpu.synchronize()
    }

    fn record(&self) -> kvshard::Result<Self::Event> {
        let gate = Arc::new(AtomicBool::new(!self.held.load(Ordering::SeqCst)));
        self.gates.lock().unwrap().push(gate.clone());
        Ok(gate)
    }

    fn wait(&self, _event: &Self::Event) -> kvshard::Result<()> {
        Ok(())
    }

    fn is_done(&self, event: &Self::Event) -> kvshard::Result<bool> {
        Ok(event.load(Ordering::SeqCst))
    }

    unsafe fn wait_counter(&self, addr: u64, value: u32) -> kvshard::Result<()> {
        unsafe { self.cpu.wait_counter(addr, value) }
    }

    unsafe fn quantize_latent(&self, p: abi::kvs_quantize_latent_params) -> kvshard::Result<()> {
        unsafe { self.cpu.quantize_latent(p) }
    }

    unsafe fn quantize_indexer(&self, p: abi::kvs_quantize_indexer_params) -> kvshard::Result<()> {
        unsafe { self.cpu.quantize_indexer(p) }
    }

    unsafe fn resolve(&self, p: abi::kvs_resolve_params) -> kvshard::Result<()> {
        unsafe { self.cpu.resolve(p) }
    }

    unsafe fn scratch_rows(&self, p: abi::kvs_scratch_rows_params) -> kvshard::Result<()> {
        unsafe { self.cpu.scratch_rows(p) }
    }

    unsafe fn copy_blocks(
        &self,
        p: abi::kvs_copy_blocks_params,
        launch: Launch,
    ) -> kvshard::Result<()> {
        self.calls.lock().unwrap().launches += 1;
        unsafe { self.cpu.copy_blocks(p, launch) }
    }

    unsafe fn write_rows(
        &self,
        p: abi::kvs_write_rows_params,
        launch: Launch,
    ) -> kvshard::Result<()> {
        unsafe { self.cpu.write_rows(p, launch) }
    }

    unsafe fn copy_ranges(
        &self,
        p: abi::kvs_copy_ranges_params,
        launch: Launch,
    ) -> kvshard::Result<()> {
        unsafe { self.cpu.copy_ranges(p, launch) }
    }

    unsafe fn memcpy(&self, dst: u64, src: u64, len: usize) -> kvshard::Result<()> {
        self.calls.lock().unwrap().memcpy += 1;
        unsafe { self.cpu.memcpy(dst, src, len) }
    }

    unsafe fn memcpy_2d(&self, copy: &Copy2d) -> kvshard::Result<()> {
        self.calls.lock().unwrap().memcpy_2d += 1;
        unsafe { self.cpu.memcpy_2d(copy) }
    }

    unsafe fn memcpy_batch(&self, ranges: &[abi::kvs_range]) -> kvshard::Result<()> {
        let mut calls = self.calls.lock().unwrap();
        calls.batch_calls += 1;
        calls.batch_entries += ranges.len();
        unsafe { self.cpu.memcpy_batch(ranges) }
    }
}

#[test]
fn backends_submit_the_calls_they_promise() {
    let b = Probe::new();
    let g = &geometries()[0]; // target latent 3 layers, indexer 2, draft latent 1, indexer 1
    let placement = Placement::new(2).unwrap();
    // Rank 0's pairs: local device 2,3,4 with host 5,6,7 (one run of 3), then 9 with 2.
    let device = [4, 6, 8, 18, 5];
    let host = [10, 12, 14, 4, 3];
    let pool = random_pool(&b, g, placement, 0, 1);
    let blocks = 3 + 2 + 1 + 1;
    for layout in HostLayout::ALL {
        let hp = HostPool::new(&b, g, HOST_PAGES, layout).unwrap();
        let plan =
            TransferPlan::new(placement, 0, &device, &host, DEVICE_PAGES, HOST_PAGES).unwrap();
        assert_eq!(plan.runs().len(), 2);
        for direction in [Direction::Backup, Direction::Load] {
            let mut t = HostTransfer::new(&pool, &hp, plan.clone(), direction).unwrap();
            t.prepare_kernel(&b, None).unwrap();
            for io in IOS {
                for layers in [Layers::All, Layers::One(0), Layers::One(3)] {
                    let promised = t.calls(io, layers).unwrap();
                    t.run(&b, io, layers).unwrap();
                    assert_eq!(b.take_calls(), promised, "{layout} {io} {layers:?}");
                }
            }
            let all = |io| t.calls(io, Layers::All).unwrap();
            assert_eq!(all(IoBackend::SmKernel { ctas: 4 }).launches, 1);
            let batch = all(IoBackend::BatchMemcpy);
            let per_block = all(IoBackend::PerBlockMemcpy);
            let engine = all(IoBackend::CopyEngine);
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
    let b = Probe::new();
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
    let buffers = PoolBuffers {
        target_latent: vec![l0.addr(), l1.addr(), l2.addr()],
        target_indexer: vec![i0.addr(), i1.addr(), i2.addr()],
        ..PoolBuffers::default()
    };
    // SAFETY: every address is a live allocation of `b` holding DEVICE_PAGES blocks.
    let pool = unsafe { DevicePool::wrap(&b, &g, placement, 0, DEVICE_PAGES, &buffers) }.unwrap();
    assert_eq!((pool.layer_stride(0), pool.layer_stride(1)), (None, None));
    let host = HostPool::new(&b, &g, HOST_PAGES, HostLayout::LayerFirst).unwrap();
    let plan = TransferPlan::new(
        placement,
        0,
        &[1, 2, 3, 7],
        &[4, 5, 6, 1],
        DEVICE_PAGES,
        HOST_PAGES,
    )
    .unwrap();
    let t = HostTransfer::new(&pool, &host, plan, Direction::Backup).unwrap();
    let calls = t.calls(IoBackend::CopyEngine, Layers::All).unwrap();
    // Two runs x (3 latent + 3 indexer layers), each one contiguous range.
    assert_eq!(
        calls,
        IoCalls {
            batch_calls: 1,
            batch_entries: 2 * 6,
            ..IoCalls::default()
        }
    );
    t.run(&b, IoBackend::CopyEngine, Layers::All).unwrap();
    assert_eq!(
        b.read(&i1, 3 * 8448, 8448).unwrap(),
        b.read(
            host.buffer(1).unwrap(),
            (HOST_PAGES as usize + 6) * 8448,
            8448
        )
        .unwrap()
    );
}

#[test]
fn planning_refuses_bad_pairs_identically_on_every_rank() {
    let placement = Placement::new(2).unwrap();
    let plan = |rank: u32, device: &[u64], host: &[u64]| {
        TransferPlan::new(placement, rank, device, host, DEVICE_PAGES, HOST_PAGES)
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
            Err(Error::HiCache(_))
        ));
        assert!(matches!(
            plan(rank, &[4, 6], &[6, 8, 10]),
            Err(Error::HiCache(_))
        ));
    }
    assert!(TransferPlan::new(placement, 2, &[], &[], 4, 4).is_err());
    let tokens: Vec<u64> = (256..384).collect();
    assert_eq!(pages_of_tokens(&tokens).unwrap(), vec![4, 5]);
    assert!(matches!(
        pages_of_tokens(&tokens[1..65]),
        Err(Error::HiCache(_))
    ));
}

/// A compute-stream event that has completed.
fn done() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(true))
}

fn streams(b: &Probe) -> Streams<Probe> {
    Streams {
        load: b.stream(),
        backup: b.stream(),
        load_relayout: b.stream(),
        backup_relayout: b.stream(),
        tables: b.stream(),
    }
}

#[test]
fn controller_acks_backups_in_fifo_order_only_once_complete() {
    let b = Probe::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(&b, g, placement, 0, 5);
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirstDirect).unwrap();
    let mut ctl =
        HiCacheController::new(&pool, &host, streams(&b), WritePolicy::WriteBack).unwrap();
    let node = |id, device_pages| CacheNode {
        id,
        device_pages,
        start_owner: None,
    };
    let io = IoBackend::CopyEngine;
    ctl.streams().backup.hold();
    assert_eq!(ctl.backup(&node(10, &[4, 5]), &done(), io).unwrap(), 0);
    assert_eq!(ctl.backup(&node(11, &[6, 7, 8]), &done(), io).unwrap(), 1);
    assert_eq!(ctl.poll_backups().unwrap(), 0, "nothing is complete yet");
    assert!(ctl.host_pages(10).is_none(), "no host pages before the ack");
    // Acking waits for the backup stream, then pops in order.
    let acks = ctl.ack_backups(1).unwrap();
    assert_eq!(ctl.streams().backup.syncs(), 1);
    assert_eq!((acks[0].index, acks[0].node), (0, 10));
    assert_eq!(ctl.poll_backups().unwrap(), 1);
    assert_eq!(ctl.backup(&node(12, &[10]), &done(), io).unwrap(), 2);
    assert_eq!(ctl.poll_backups().unwrap(), 2);
    let acks = ctl.ack_backups(2).unwrap();
    assert_eq!(acks.iter().map(|a| a.index).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(
        ctl.streams().backup.syncs(),
        1,
        "complete acks do not block"
    );
    // Rank 0 owns pages 6 and 8 of node 11: two pages of every layer and component.
    assert_eq!(acks[0].bytes, 2 * g.page_bytes() as u64);
    assert!(ctl.ack_backups(1).is_err());
    assert_eq!(ctl.host_pages(11), Some(acks[0].host_pages.as_slice()));
    assert!(
        ctl.backup(&node(11, &[12]), &done(), io).is_err(),
        "already on host"
    );
}

#[test]
fn kernel_tables_are_reused_once_their_transfer_is_acked() {
    let b = Probe::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(&b, g, placement, 0, 6);
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirst).unwrap();
    let mut ctl =
        HiCacheController::new(&pool, &host, streams(&b), WritePolicy::WriteThrough).unwrap();
    let io = IoBackend::SmKernel { ctas: 2 };
    let node = |id, device_pages| CacheNode {
        id,
        device_pages,
        start_owner: None,
    };
    let signals = ctl.streams().tables.allocs();
    ctl.backup(&node(1, &[4, 6, 8]), &done(), io).unwrap();
    ctl.backup(&node(2, &[10, 12]), &done(), io).unwrap();
    assert_eq!(ctl.streams().tables.allocs(), signals + 2);
    ctl.ack_backups(2).unwrap();
    // Smaller or equal tables fit the buffers the acked backups gave back.
    let h = ctl.load(1, &[14, 16, 18], None, io).unwrap();
    ctl.backup(&node(3, &[20, 22]), &done(), io).unwrap();
    assert_eq!(ctl.streams().tables.allocs(), signals + 2);
    assert_eq!(h.index(), 0);

    // A buffer too small for a transfer's tables is refused.
    let plan = TransferPlan::new(placement, 0, &[4], &[4], DEVICE_PAGES, HOST_PAGES).unwrap();
    let mut t = HostTransfer::new(&pool, &host, plan, Direction::Load).unwrap();
    let small = b
        .alloc(t.kernel_table_bytes() - 8, MemoryKind::Device)
        .unwrap();
    assert!(matches!(
        t.prepare_kernel(&b, Some(small)),
        Err(Error::InvalidArgument(_))
    ));
    let fits = b.alloc(t.kernel_table_bytes(), MemoryKind::Device).unwrap();
    let addr = fits.addr();
    t.prepare_kernel(&b, Some(fits)).unwrap();
    t.run(&b, io, Layers::All).unwrap();
    assert_eq!(t.into_kernel_tables().map(|t| t.addr()), Some(addr));
}

/// One shard group: a controller per rank over its own pools, all given the same calls.
struct Group<'p> {
    ranks: Vec<HiCacheController<'p, Probe>>,
}

impl<'p> Group<'p> {
    fn each<T>(
        &mut self,
        mut f: impl FnMut(&mut HiCacheController<'p, Probe>) -> kvshard::Result<T>,
    ) -> Vec<T> {
        self.ranks.iter_mut().map(|c| f(c).unwrap()).collect()
    }
}

#[test]
fn ranks_that_own_nothing_still_submit_signal_and_ack() {
    let b = Probe::new();
    let g = &geometries()[0];
    let placement = Placement::new(4).unwrap();
    let pools: Vec<DevicePool> = (0..4)
        .map(|r| random_pool(&b, g, placement, r, 9))
        .collect();
    let hosts: Vec<HostPool> = (0..4)
        .map(|_| {
            let h = HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirst).unwrap();
            h.fill(&b, POISON).unwrap();
            h
        })
        .collect();
    let mut group = Group {
        ranks: pools
            .iter()
            .zip(&hosts)
            .map(|(p, h)| {
                HiCacheController::new(p, h, streams(&b), WritePolicy::WriteThrough).unwrap()
            })
            .collect(),
    };
    // Pages of owners 0 and 1 only: ranks 2 and 3 own nothing.
    let device = [4u64, 5, 8, 9];
    let n = CacheNode {
        id: 1,
        device_pages: &device,
        start_owner: None,
    };
    for io in [IoBackend::SmKernel { ctas: 2 }, IoBackend::CopyEngine] {
        let indices = group.each(|c| c.access(&n, &done(), io));
        assert!(indices.iter().all(|&i| i == indices[0] && i.is_some()));
        let ready = group.each(|c| c.poll_backups());
        assert_eq!(ready, vec![1; 4]);
        let acks = group.each(|c| c.ack_backups(1));
        let bytes: Vec<u64> = acks.iter().map(|a| a[0].bytes).collect();
        let page = g.page_bytes() as u64;
        assert_eq!(bytes, vec![2 * page, 2 * page, 0, 0]);
        assert!(acks
            .iter()
            .all(|a| a[0].host_pages == acks[0][0].host_pages));
        let reload = [12u64, 13, 16, 17];
        let handles = group.each(|c| c.load(1, &reload, None, io));
        for (c, h) in group.ranks.iter().zip(&handles) {
            assert_eq!(h.layers().len(), g.model_layers());
            for layer in 0..g.model_layers() {
                h.wait_layer(&c.streams().load, layer).unwrap();
            }
        }
        assert_eq!(group.each(|c| c.poll_loads()), vec![1; 4]);
        let loads = group.each(|c| c.ack_loads(1));
        assert!(loads
            .iter()
            .all(|l| l[0].index == loads[0][0].index && l[0].node == 1));
        assert_eq!(loads[3][0].bytes, 0);
        group.each(|c| c.free_host(1));
    }
    // The idle ranks' pools never changed.
    for r in 2..4 {
        assert!(hosts[r].snapshot(&b).unwrap().iter().all(|&x| x == POISON));
        let fresh = random_pool(&b, g, placement, r as u32, 9);
        assert!(pools[r].snapshot(&b).unwrap() == fresh.snapshot(&b).unwrap());
    }
}

#[test]
fn write_policies_back_up_on_the_access_or_eviction_they_name() {
    let b = Probe::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(&b, g, placement, 1, 2);
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::LayerFirst).unwrap();
    let io = IoBackend::SmKernel { ctas: 1 };
    let device = [5u64, 6, 7];
    let n = CacheNode {
        id: 3,
        device_pages: &device,
        start_owner: None,
    };
    let mut through =
        HiCacheController::new(&pool, &host, streams(&b), WritePolicy::WriteThrough).unwrap();
    assert_eq!(through.access(&n, &done(), io).unwrap(), Some(0));
    assert_eq!(
        through.access(&n, &done(), io).unwrap(),
        None,
        "already backed up"
    );
    assert_eq!(
        through.evict(&n, &done(), io).unwrap().len(),
        1,
        "evict waits for it"
    );
    assert!(through.evict(&n, &done(), io).unwrap().is_empty());

    let mut selective = HiCacheController::new(
        &pool,
        &host,
        streams(&b),
        WritePolicy::WriteThroughSelective,
    )
    .unwrap();
    assert_eq!(selective.access(&n, &done(), io).unwrap(), None);
    assert_eq!(selective.access(&n, &done(), io).unwrap(), Some(0));
    let other = CacheNode { id: 4, ..n };
    assert_eq!(selective.access(&other, &done(), io).unwrap(), None);
    assert!(
        selective.evict(&other, &done(), io).unwrap().is_empty(),
        "one hit: dropped"
    );
    assert_eq!(selective.pending_backups(), 1);

    let mut back =
        HiCacheController::new(&pool, &host, streams(&b), WritePolicy::WriteBack).unwrap();
    for _ in 0..3 {
        assert_eq!(back.access(&n, &done(), io).unwrap(), None);
    }
    assert_eq!(back.pending_backups(), 0);
    back.streams().backup.hold();
    let acks = back.evict(&n, &done(), io).unwrap();
    assert_eq!(
        back.streams().backup.syncs(),
        1,
        "write-back eviction blocks"
    );
    assert_eq!((acks.len(), acks[0].node), (1, 3));
    // The node's bytes are on the host: load them back elsewhere and compare.
    // Rank 1 moves 5 -> 9 and 7 -> 13: local 2 -> 4 and 3 -> 6.
    let reload = [9u64, 10, 13];
    let h = back.load(3, &reload, None, IoBackend::CopyEngine).unwrap();
    assert_eq!(h.index(), 0);
    assert_eq!(
        back.ack_loads(1).unwrap()[0].bytes,
        2 * g.page_bytes() as u64
    );
    for (c, comp) in pool.components().iter().enumerate() {
        for l in 0..comp.layers() {
            let read = |p: u64| {
                let at = pool.block_addr(c, l, p).unwrap();
                // SAFETY: one block of the pool.
                let block = unsafe { Buffer::from_raw(at, comp.block_bytes, MemoryKind::Device) };
                b.read(&block, 0, comp.block_bytes).unwrap()
            };
            assert_eq!(read(2), read(4), "{} layer {l}", comp.component);
            assert_eq!(read(3), read(6), "{} layer {l}", comp.component);
        }
    }
}

#[test]
fn a_start_owner_of_zero_is_an_owner() {
    let b = Probe::new();
    let g = &geometries()[1];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(&b, g, placement, 0, 4);
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirstDirect).unwrap();
    let mut ctl =
        HiCacheController::new(&pool, &host, streams(&b), WritePolicy::WriteThrough).unwrap();
    let io = IoBackend::CopyEngine;
    // A chain segment starting at owner 0: its host pages follow the rotation from 0.
    let starts_at_0 = [6u64, 9, 10];
    let node = |id, device_pages, start_owner| CacheNode {
        id,
        device_pages,
        start_owner,
    };
    ctl.backup(&node(1, &starts_at_0, Some(0)), &done(), io)
        .unwrap();
    let ack = ctl.ack_backups(1).unwrap().remove(0);
    assert_eq!(ack.start_owner, Some(0));
    let owners: Vec<u32> = ack.host_pages.iter().map(|&p| placement.owner(p)).collect();
    assert_eq!(owners, vec![0, 1, 0]);
    // Pages starting at owner 1 contradict a start owner of 0 (were 0 taken for "no owner",
    // this would pass): refused before anything moves, host pages returned.
    let starts_at_1 = [5u64, 12, 7];
    let free = ctl.host_allocator().total_free();
    let err = ctl
        .backup(&node(2, &starts_at_1, Some(0)), &done(), io)
        .unwrap_err();
    assert!(matches!(err, Error::WrongOwner { .. }), "{err}");
    assert_eq!(ctl.host_allocator().total_free(), free);
    assert_eq!(ctl.pending_backups(), 0);
    // Without a shard owner the same pages back up with matching owner classes.
    assert_eq!(
        ctl.backup(&node(2, &starts_at_1, None), &done(), io)
            .unwrap(),
        1
    );
    let ack = ctl.ack_backups(1).unwrap().remove(0);
    assert_eq!(ack.start_owner, None);
    let owners: Vec<u32> = ack.host_pages.iter().map(|&p| placement.owner(p)).collect();
    assert_eq!(owners, vec![1, 0, 1]);
    let err = ctl
        .backup(&node(3, &starts_at_0, Some(2)), &done(), io)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn refused_operations_change_nothing() {
    let b = Probe::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(&b, g, placement, 0, 8);
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::LayerFirst).unwrap();
    host.fill(&b, POISON).unwrap();
    let before = pool.snapshot(&b).unwrap();
    let mut ctl =
        HiCacheController::new(&pool, &host, streams(&b), WritePolicy::WriteThrough).unwrap();
    let io = IoBackend::SmKernel { ctas: 2 };
    let free = ctl.host_allocator().total_free();
    for bad in [&[4u64, 1][..], &[4, 24], &[4, 6, 4]] {
        let n = CacheNode {
            id: 1,
            device_pages: bad,
            start_owner: None,
        };
        assert!(ctl.backup(&n, &done(), io).is_err(), "{bad:?}");
    }
    assert_eq!(ctl.host_allocator().total_free(), free);
    assert_eq!(ctl.pending_backups(), 0);
    assert!(host.snapshot(&b).unwrap().iter().all(|&x| x == POISON));
    // Loads of unknown or unacked nodes, and loads into wrong owners, are refused too.
    assert!(ctl.load(1, &[4], None, io).is_err());
    let n = CacheNode {
        id: 2,
        device_pages: &[4, 6],
        start_owner: None,
    };
    assert_eq!(ctl.backup(&n, &done(), io).unwrap(), 0);
    assert!(ctl.load(2, &[8, 10], None, io).is_err(), "backup not acked");
    assert!(ctl.free_host(2).is_err(), "backup in flight");
    ctl.ack_backups(1).unwrap();
    assert!(matches!(
        ctl.load(2, &[8, 11], None, io),
        Err(Error::WrongOwner { .. })
    ));
    assert_eq!(ctl.pending_loads(), 0);
    let h = ctl.load(2, &[8, 10], None, io).unwrap();
    assert!(ctl.free_host(2).is_err(), "load pending");
    assert_eq!(h.index(), 0);
    ctl.ack_loads(1).unwrap();
    ctl.free_host(2).unwrap();
    assert_eq!(ctl.host_allocator().total_free(), free);
    // Pages 4 and 6 were copied to 8 and 10 (local 2, 3 -> 4, 5); the rest is unchanged.
    let after = pool.snapshot(&b).unwrap();
    let comps = pool.components();
    let mut expected = before.clone();
    expect_moved(
        comps,
        placement,
        0,
        &before,
        (&[4, 6], DEVICE_PAGES),
        &mut expected,
        (&[8, 10], DEVICE_PAGES),
    );
    assert!(after == expected);
}

/// The routes through the staging a host layout supports.
fn staged_routes(layout: HostLayout) -> Vec<Route> {
    relayouts(layout).into_iter().map(Route::Staged).collect()
}

/// One rank's controller round trip: the source pool, the host pool after the acked backup, the
/// host pages it got, the device pool after the acked load, and the bytes each ack reported.
struct ControllerTrip {
    source: Vec<u8>,
    host: Vec<u8>,
    host_pages: Vec<u64>,
    reloaded: Vec<u8>,
    bytes: (u64, u64),
}

/// Backs `node` up through a controller of rank `rank` on `streams` (random device pool,
/// poisoned host pool) on `route`, then loads it back into its reload pages on `route`, a
/// consumer on `b` waiting for every layer before the pools are read.
#[allow(clippy::too_many_arguments)]
fn controller_trip<B: Backend>(
    b: &B,
    streams: Streams<B>,
    g: &CacheGeometry,
    layout: HostLayout,
    placement: Placement,
    rank: u32,
    route: Route,
    node: &Node,
) -> ControllerTrip {
    let pool = random_pool(b, g, placement, rank, 11 + u64::from(rank));
    let host = HostPool::new(b, g, HOST_PAGES, layout).unwrap();
    host.fill(b, POISON).unwrap();
    let source = pool.snapshot(b).unwrap();
    let mut ctl = HiCacheController::new(&pool, &host, streams, WritePolicy::WriteBack).unwrap();
    let n = CacheNode {
        id: 1,
        device_pages: &node.device,
        start_owner: None,
    };
    // What `b` did so far stands for the forward pass that wrote the pages.
    let compute = b.record().unwrap();
    assert_eq!(ctl.backup(&n, &compute, route).unwrap(), 0);
    let backup = ctl.ack_backups(1).unwrap().remove(0);
    let written = b.record().unwrap();
    let h = ctl.load(1, &node.reload, Some(&written), route).unwrap();
    assert_eq!(h.layers().len(), g.model_layers());
    for layer in 0..g.model_layers() {
        h.wait_layer(b, layer).unwrap();
    }
    let load = ctl.ack_loads(1).unwrap().remove(0);
    assert_eq!((load.index, load.node), (0, 1));
    ControllerTrip {
        source,
        host: host.snapshot(b).unwrap(),
        host_pages: backup.host_pages,
        reloaded: pool.snapshot(b).unwrap(),
        bytes: (backup.bytes, load.bytes),
    }
}

#[test]
fn controller_round_trips_through_the_staging_move_exactly_the_owned_pages() {
    let mut rng = common::rng("controller_round_trips_through_the_staging");
    let b = Probe::new();
    for_each_rank(&mut rng, all_ranks, |g, placement, rank, node| {
        let owned = node
            .device
            .iter()
            .filter(|&&p| placement.owner(p) == rank)
            .count() as u64;
        let bytes = owned * g.page_bytes() as u64;
        for layout in HostLayout::ALL {
            for route in staged_routes(layout) {
                let case = format!("N={} rank {rank} {layout} {route}", placement.shard());
                let trip =
                    controller_trip(&b, streams(&b), g, layout, placement, rank, route, node);
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
    });
}

#[test]
fn controller_acks_in_fifo_order_across_mixed_routes() {
    let b = Probe::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(&b, g, placement, 0, 5);
    let before = pool.snapshot(&b).unwrap();
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirstDirect).unwrap();
    let mut ctl =
        HiCacheController::new(&pool, &host, streams(&b), WritePolicy::WriteBack).unwrap();
    let routes = [
        Route::Staged(Relayout::CopyEngine),
        IoBackend::CopyEngine.into(),
        Route::Staged(Relayout::Kernel { ctas: 2 }),
        IoBackend::SmKernel { ctas: 2 }.into(),
        Route::Staged(Relayout::CopyEngine),
    ];
    // Rank 0 owns the even pages: 1, 2, 0, 1 and 1 of each node.
    let device: [&[u64]; 5] = [&[4, 5], &[6, 7, 8], &[9], &[10, 11], &[3, 2]];
    let reload: [&[u64]; 5] = [&[12, 13], &[14, 15, 16], &[17], &[18, 19], &[21, 20]];
    let owned = [1u64, 2, 0, 1, 1];
    ctl.streams().backup.hold();
    for (i, (&route, pages)) in routes.iter().zip(device).enumerate() {
        let n = CacheNode {
            id: 10 + i as u64,
            device_pages: pages,
            start_owner: None,
        };
        assert_eq!(ctl.backup(&n, &done(), route).unwrap(), i as u64, "{route}");
    }
    assert_eq!(ctl.poll_backups().unwrap(), 0, "nothing is complete yet");
    let acks = ctl.ack_backups(routes.len()).unwrap();
    assert_eq!(ctl.streams().backup.syncs(), 1);
    let order: Vec<(u64, u64, u64)> = acks.iter().map(|a| (a.index, a.node, a.bytes)).collect();
    let page = g.page_bytes() as u64;
    let want: Vec<(u64, u64, u64)> = (0..5)
        .map(|i| (i, 10 + i, owned[i as usize] * page))
        .collect();
    assert_eq!(order, want);
    // Loads in the opposite route order, held too: queue indices and acks in submission order.
    ctl.streams().load.hold();
    for (i, (&route, pages)) in routes.iter().rev().zip(reload).enumerate() {
        let h = ctl.load(10 + i as u64, pages, None, route).unwrap();
        assert_eq!(h.index(), i as u64, "{route}");
        assert_eq!(h.layers().len(), g.model_layers());
        let events = h.layers().iter().all(|l| matches!(l, LayerReady::Event(_)));
        let counters = h
            .layers()
            .iter()
            .all(|l| matches!(l, LayerReady::Counter(_)));
        match route {
            Route::Direct(IoBackend::SmKernel { .. }) => assert!(counters, "{route}"),
            _ => assert!(events, "{route}"),
        }
    }
    assert_eq!(ctl.poll_loads().unwrap(), 0, "nothing is complete yet");
    let loads = ctl.ack_loads(routes.len()).unwrap();
    assert_eq!(ctl.streams().load.syncs(), 1);
    let order: Vec<(u64, u64, u64)> = loads.iter().map(|a| (a.index, a.node, a.bytes)).collect();
    assert_eq!(order, want);
    // Every node came back where it was loaded; nothing else changed.
    let mut expected = before.clone();
    for (pages, to) in device.iter().zip(reload) {
        expect_moved(
            pool.components(),
            placement,
            0,
            &before,
            (pages, DEVICE_PAGES),
            &mut expected,
            (to, DEVICE_PAGES),
        );
    }
    assert!(pool.snapshot(&b).unwrap() == expected);
}

#[test]
fn staged_backups_back_to_back_reuse_one_staging() {
    let b = Probe::new();
    let g = &geometries()[1];
    let placement = Placement::unsharded();
    let (pages, nodes) = (70u64, 3u64);
    let (device_pages, host_pages) = (pages * nodes + 2, pages * nodes + 2);
    let pool = DevicePool::allocate(&b, g, placement, 0, device_pages).unwrap();
    let storage = pool.storage().unwrap();
    let mut rng = common::rng("staged_backups_back_to_back_reuse_one_staging");
    b.write(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();
    let before = pool.snapshot(&b).unwrap();
    let host = HostPool::new(&b, g, host_pages, HostLayout::PageFirstDirect).unwrap();
    host.fill(&b, POISON).unwrap();
    let mut ctl =
        HiCacheController::new(&pool, &host, streams(&b), WritePolicy::WriteBack).unwrap();
    assert_eq!(ctl.staging_pages(), DEFAULT_STAGING_PAGES);
    assert_eq!((DEFAULT_STAGING_PAGES, ctl.staging_bytes()), (32, 0));
    let staging_bytes = 2 * 32 * g.page_bytes();
    // Three nodes of 70 pages (chunks of 32, 32 and 6): one in order, one reversed, one every
    // other page of the rest, so the relayout scatters.
    let chain: Vec<Vec<u64>> = vec![
        (1..=70).collect(),
        (71..=140).rev().collect(),
        (141..=210)
            .step_by(2)
            .chain((142..=210).step_by(2))
            .collect(),
    ];
    let routes = [
        Route::Staged(Relayout::CopyEngine),
        Route::Staged(Relayout::Kernel { ctas: 2 }),
        Route::Staged(Relayout::CopyEngine),
    ];
    ctl.streams().backup.hold();
    let tables = ctl.streams().tables.allocs();
    for (i, (pages, &route)) in chain.iter().zip(&routes).enumerate() {
        let n = CacheNode {
            id: i as u64,
            device_pages: pages,
            start_owner: None,
        };
        assert_eq!(ctl.backup(&n, &done(), route).unwrap(), i as u64);
        assert_eq!(ctl.staging_bytes(), staging_bytes, "made once, for backups");
        if i == 0 {
            assert!(
                ctl.streams().tables.allocs() > tables + 1,
                "staging and tables"
            );
        }
    }
    // After the first backup only each backup's own kernel tables were allocated.
    let made = ctl.streams().tables.allocs();
    let n = CacheNode {
        id: 9,
        device_pages: &[211],
        start_owner: None,
    };
    ctl.backup(&n, &done(), routes[0]).unwrap();
    assert_eq!(ctl.streams().tables.allocs(), made + 1);
    assert!(
        ctl.set_staging_pages(16).is_err(),
        "no resize while the staging may be in use"
    );
    let acks = ctl.ack_backups(4).unwrap();
    assert_eq!(
        acks.iter().map(|a| a.index).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    let mut expected = vec![POISON; host.snapshot(&b).unwrap().len()];
    for (pages, ack) in chain.iter().zip(&acks) {
        assert_eq!(ack.bytes, 70 * g.page_bytes() as u64);
        let owned = (pages.as_slice(), device_pages);
        let moved = (ack.host_pages.as_slice(), host_pages);
        expect_moved(
            pool.components(),
            placement,
            0,
            &before,
            owned,
            &mut expected,
            moved,
        );
    }
    let backed_up = host.snapshot(&b).unwrap();
    // Node 9's page was backed up too.
    let (one, one_host) = ([211u64], acks[3].host_pages.as_slice());
    expect_moved(
        pool.components(),
        placement,
        0,
        &before,
        (&one, device_pages),
        &mut expected,
        (one_host, host_pages),
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
    ctl.streams().load.hold();
    for (i, &route) in routes.iter().enumerate() {
        let into = &chain[(i + 1) % chain.len()];
        assert_eq!(
            ctl.load(i as u64, into, None, route).unwrap().index(),
            i as u64
        );
    }
    assert_eq!(ctl.staging_bytes(), 2 * 24 * g.page_bytes(), "loads only");
    let loads = ctl.ack_loads(3).unwrap();
    assert_eq!(loads.iter().map(|l| l.node).collect::<Vec<_>>(), [0, 1, 2]);
    let mut reloaded = before.clone();
    for (i, ack) in acks.iter().take(3).enumerate() {
        let into = &chain[(i + 1) % chain.len()];
        let moved = (ack.host_pages.as_slice(), host_pages);
        let comps = pool.components();
        expect_moved(
            comps,
            placement,
            0,
            &backed_up,
            moved,
            &mut reloaded,
            (into, device_pages),
        );
    }
    assert!(
        pool.snapshot(&b).unwrap() == reloaded,
        "device pool after three staged loads"
    );
}

#[test]
fn refused_routes_change_nothing() {
    let b = Probe::new();
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let pool = random_pool(&b, g, placement, 0, 8);
    let before = pool.snapshot(&b).unwrap();
    // Token-major page_first rows are not whole blocks: no copy-engine relayout.
    let host = HostPool::new(&b, g, HOST_PAGES, HostLayout::PageFirst).unwrap();
    host.fill(&b, POISON).unwrap();
    let mut ctl = HiCacheController::new(
        &pool,
        &host,
        streams(&b),
        WritePolicy::WriteThroughSelective,
    )
    .unwrap();
    let refused = [
        Route::Staged(Relayout::CopyEngine),
        Route::Staged(Relayout::Kernel { ctas: 0 }),
        IoBackend::SmKernel { ctas: 0 }.into(),
    ];
    let device = [4u64, 6, 7];
    let n = CacheNode {
        id: 1,
        device_pages: &device,
        start_owner: None,
    };
    let free: Vec<usize> = (0..2).map(|r| ctl.host_allocator().free_pages(r)).collect();
    let allocs = ctl.streams().tables.allocs();
    let unchanged = |ctl: &HiCacheController<'_, Probe>| {
        let now: Vec<usize> = (0..2).map(|r| ctl.host_allocator().free_pages(r)).collect();
        assert_eq!(now, free);
        assert!((1..2 * HOST_PAGES).all(|p| !ctl.host_allocator().is_allocated(p)));
        assert_eq!((ctl.pending_backups(), ctl.pending_loads()), (0, 0));
        assert_eq!(ctl.staging_bytes(), 0);
        assert_eq!(ctl.streams().tables.allocs(), allocs);
        assert!(host.snapshot(&b).unwrap().iter().all(|&x| x == POISON));
        assert!(pool.snapshot(&b).unwrap() == before);
    };
    for route in refused {
        let err = ctl.backup(&n, &done(), route).unwrap_err();
        match route {
            Route::Staged(Relayout::CopyEngine) => {
                assert!(matches!(err, Error::HiCache(_)), "{err}");
                assert!(err.to_string().contains("whole blocks"), "{err}");
            }
            _ => assert!(matches!(err, Error::InvalidArgument(_)), "{route}: {err}"),
        }
        // Refused accesses are not counted: two of them do not make the node due.
        assert!(ctl.access(&n, &done(), route).is_err(), "{route}");
        assert!(ctl.evict(&n, &done(), route).is_err(), "{route}");
        assert!(ctl.load(1, &device, None, route).is_err(), "{route}");
        unchanged(&ctl);
    }
    let io = Route::Staged(Relayout::Kernel { ctas: 2 });
    assert_eq!(
        ctl.access(&n, &done(), io).unwrap(),
        None,
        "first counted hit"
    );
    assert_eq!(
        ctl.access(&n, &done(), io).unwrap(),
        Some(0),
        "no index lost"
    );
    ctl.ack_backups(1).unwrap();
    // A load on a refused route changes nothing either; the next one gets index 0.
    let reload = [8u64, 10, 11];
    for route in refused {
        assert!(ctl.load(1, &reload, None, route).is_err(), "{route}");
        assert_eq!(ctl.pending_loads(), 0);
    }
    assert_eq!(ctl.load(1, &reload, None, io).unwrap().index(), 0);
    assert_eq!(ctl.ack_loads(1).unwrap()[0].node, 1);
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
    let pool = DevicePool::allocate(&b, &other, Placement::unsharded(), 0, 4).unwrap();
    let host = HostPool::new(&b, g, 4, HostLayout::PageFirst).unwrap();
    let plan = TransferPlan::new(Placement::unsharded(), 0, &[1], &[1], 4, 4).unwrap();
    assert!(matches!(
        HostTransfer::new(&pool, &host, plan.clone(), Direction::Load),
        Err(Error::GeometryMismatch { .. })
    ));
    let same = HostPool::new(&b, &other, 4, HostLayout::PageFirst).unwrap();
    let sharded = DevicePool::allocate(&b, &other, Placement::new(2).unwrap(), 0, 4).unwrap();
    assert!(matches!(
        HostTransfer::new(&sharded, &same, plan, Direction::Load),
        Err(Error::HiCache(_))
    ));
}

// ---------------------------------------------------------------------------------------------
// GPU

#[test]
fn gpu_round_trips_match_cpu_byte_for_byte() {
    let Some(gpu) = common::cuda("gpu_round_trips_match_cpu_byte_for_byte") else {
        return;
    };
    let mut rng = common::rng("gpu_round_trips_match_cpu_byte_for_byte");
    let cpu = CpuBackend::new();
    for_each_rank(&mut rng, edge_ranks, |g, placement, rank, node| {
        for layout in HostLayout::ALL {
            for io in IOS {
                let case = format!("N={} rank {rank} {layout} {io}", placement.shard());
                let want = round_trip(&cpu, g, layout, placement, rank, io, node);
                let got = round_trip(&gpu, g, layout, placement, rank, io, node);
                assert!(want.source == got.source, "random source differs");
                assert!(want.host == got.host, "{case}: host");
                assert!(want.reloaded == got.reloaded, "{case}: reloaded");
            }
        }
    });
}

#[test]
fn gpu_registered_and_numa_local_host_pools_round_trip() {
    let Some(gpu) = common::cuda("gpu_registered_and_numa_local_host_pools_round_trip") else {
        return;
    };
    let mut rng = common::rng("gpu_registered_and_numa_local_host_pools_round_trip");
    let g = &geometries()[0];
    let placement = Placement::new(2).unwrap();
    let node = node(&mut rng, placement, 9);
    let cpu = CpuBackend::new();
    for layout in HostLayout::ALL {
        let want = round_trip(&cpu, g, layout, placement, 1, IoBackend::CopyEngine, &node);
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
        // SAFETY: non-zero sizes; freed below after the pool is dropped.
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
                unsafe { HostPool::register(gpu.gpu(), g, HOST_PAGES, layout, &regions, 1) }
                    .unwrap();
            let numa = HostPool::new_numa_local(&gpu, g, HOST_PAGES, layout).unwrap();
            eprintln!("{layout}: NUMA placement {:?}", numa.numa());
            for host in [&registered, &numa] {
                for io in [IoBackend::CopyEngine, IoBackend::SmKernel { ctas: 2 }] {
                    host.fill(&gpu, POISON).unwrap();
                    let source = random_pool(&gpu, g, placement, 1, 8);
                    let plan = node_plan(placement, 1, &node);
                    let mut t = HostTransfer::new(&source, host, plan, Direction::Backup).unwrap();
                    t.prepare_kernel(&gpu, None).unwrap();
                    t.run(&gpu, io, Layers::All).unwrap();
                    gpu.synchronize().unwrap();
                    assert!(host.snapshot(&gpu).unwrap() == want.host, "{layout} {io}");
                }
            }
        }
        for (p, l) in memory.into_iter().zip(layouts) {
            // SAFETY: allocated above with this layout; the registration is gone.
            unsafe { std::alloc::dealloc(p, l) };
        }
    }
}

/// Loads a large node on `io` through the controller while a consumer stream waits for layer 0
/// only and then snapshots one block of layer 0 and one of the last layer: layer 0 must have
/// landed and, on a direct route, the last layer not yet; a staged load is ready as a whole, so
/// there the last layer must have landed too.
fn layer_zero_lands_first(io: impl Into<Route>) {
    let io = io.into();
    let whole = matches!(io, Route::Staged(_));
    let name = format!("gpu_layer_zero_is_consumable_before_the_last_layer_lands ({io})");
    let Some(gpu) = common::cuda(&name) else {
        return;
    };
    let dev = gpu.gpu().clone();
    let new = || kvshard::backend::cuda::CudaBackend::new(dev.clone()).unwrap();
    let g = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 61));
    let pages = 256usize;
    let placement = Placement::unsharded();
    let pool = DevicePool::allocate(&gpu, &g, placement, 0, pages as u64 + 2).unwrap();
    let host = HostPool::new(&gpu, &g, pages as u64 + 2, HostLayout::PageFirstDirect).unwrap();
    let streams = Streams {
        load: new(),
        backup: new(),
        load_relayout: new(),
        backup_relayout: new(),
        tables: new(),
    };
    let mut ctl = HiCacheController::new(&pool, &host, streams, WritePolicy::WriteBack).unwrap();
    const LANDED: u8 = 0x3C;
    pool.fill(&gpu, LANDED).unwrap();
    gpu.synchronize().unwrap();
    let device: Vec<u64> = (1..=pages as u64).collect();
    let n = CacheNode {
        id: 1,
        device_pages: &device,
        start_owner: None,
    };
    let compute = gpu.record().unwrap();
    assert_eq!(ctl.evict(&n, &compute, io).unwrap().len(), 1);
    pool.fill(&gpu, POISON).unwrap();
    let poisoned = gpu.record().unwrap();
    let handle = ctl.load(1, &device, Some(&poisoned), io).unwrap();
    let consumer = new();
    handle.wait_layer(&consumer, 0).unwrap();
    let probe = consumer.alloc(2 * 36_864, MemoryKind::Device).unwrap();
    let last_page = *device.last().unwrap();
    for (i, layer) in [0usize, 60].into_iter().enumerate() {
        let block = pool.block_addr(0, layer, last_page).unwrap();
        // SAFETY: one latent block of the pool into one half of the probe buffer.
        unsafe { consumer.memcpy(probe.addr() + i as u64 * 36_864, block, 36_864) }.unwrap();
    }
    consumer.synchronize().unwrap();
    ctl.streams().load.synchronize().unwrap();
    let seen = consumer.read(&probe, 0, probe.len()).unwrap();
    assert!(
        seen[..36_864].iter().all(|&x| x == LANDED),
        "{io}: layer 0 had not landed when its signal fired"
    );
    if whole {
        assert!(
            seen[36_864..].iter().all(|&x| x == LANDED),
            "{io}: a staged load's layer 0 was ready before its last layer had landed"
        );
    } else {
        assert!(
            seen[36_864..].iter().all(|&x| x == POISON),
            "{io}: the last layer had landed before layer 0 was consumed"
        );
    }
    assert_eq!(ctl.ack_loads(1).unwrap()[0].node, 1);
    for (c, comp) in pool.components().iter().enumerate() {
        for layer in [0, 30, 60] {
            let at = pool.block_addr(c, layer, 1).unwrap();
            let len = pages * comp.block_bytes;
            // SAFETY: pages 1..=pages of one layer buffer of the pool.
            let loaded = unsafe { Buffer::from_raw(at, len, MemoryKind::Device) };
            let bytes = gpu.read(&loaded, 0, len).unwrap();
            assert!(
                bytes.iter().all(|&x| x == LANDED),
                "{io}: {} layer {layer}",
                comp.component
            );
        }
    }
}

#[test]
fn gpu_layer_zero_is_consumable_before_the_last_layer_lands_sm_kernel() {
    layer_zero_lands_first(IoBackend::SmKernel { ctas: 4 });
}

#[test]
fn gpu_layer_zero_is_consumable_before_the_last_layer_lands_copy_engine() {
    layer_zero_lands_first(IoBackend::CopyEngine);
}

#[test]
fn gpu_staged_loads_are_ready_as_a_whole() {
    layer_zero_lands_first(Route::Staged(Relayout::CopyEngine));
    layer_zero_lands_first(Route::Staged(Relayout::Kernel { ctas: 4 }));
}

#[test]
fn gpu_controller_round_trips_match_cpu_byte_for_byte() {
    let Some(gpu) = common::cuda("gpu_controller_round_trips_match_cpu_byte_for_byte") else {
        return;
    };
    let dev = gpu.gpu().clone();
    let new = || kvshard::backend::cuda::CudaBackend::new(dev.clone()).unwrap();
    let gpu_streams = || Streams {
        load: new(),
        backup: new(),
        load_relayout: new(),
        backup_relayout: new(),
        tables: new(),
    };
    let mut rng = common::rng("gpu_controller_round_trips_match_cpu_byte_for_byte");
    let cpu = Probe::new();
    for_each_rank(&mut rng, edge_ranks, |g, placement, rank, node| {
        for layout in HostLayout::ALL {
            let direct = Route::from(IoBackend::SmKernel { ctas: 2 });
            for route in staged_routes(layout).into_iter().chain([direct]) {
                let case = format!("N={} rank {rank} {layout} {route}", placement.shard());
                let want =
                    controller_trip(&cpu, streams(&cpu), g, layout, placement, rank, route, node);
                let got =
                    controller_trip(&gpu, gpu_streams(), g, layout, placement, rank, route, node);
                assert!(want.source == got.source, "random source differs");
                assert_eq!(want.host_pages, got.host_pages, "{case}");
                assert_eq!(want.bytes, got.bytes, "{case}");
                assert!(want.host == got.host, "{case}: host");
                assert!(want.reloaded == got.reloaded, "{case}: reloaded");
            }
        }
    });
}
