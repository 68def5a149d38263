//! Misuse of the API, one test per way a caller can get it wrong, on the CPU backend: a copy run
//! with spaces its plan was not made for, a buffer of one backend passed as an address of
//! another, a repeated destination page (it lost one position's data while the status said
//! sent), an undersized engine buffer or chunk-relative slots (they wrote outside what they
//! meant), and a failed chunk (a status to overlook). Each passed silently once, or could not be
//! expressed as a check at all; each is now refused before anything moves (the destination bytes
//! are checked to be still poison) or surfaces as an `Err`.
//!
//! The compile-time holes (private plan fields, the sealed `BlockSpace`, `TableBuffer` having no
//! public constructor, a `LogicalPage` where a `LocalPage` is wanted) are covered by the
//! compile_fail doctests in the library.

mod common;

use std::sync::Arc;

use common::synth::{self, POISON};
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{upload_i64s_sync, Backend, Buffer, Launch, MemoryKind};
use kvshard::chain::RequestChain;
use kvshard::copy::{
    BlockCopy, BlockCopyPlan, BlockSpace, Direction, LayerSignals, Layers, Method, PageSelection,
    RemoteSpace, Resolver, Staging, TableStore,
};
use kvshard::geometry::{CacheGeometry, Component, LatentLayout, PoolGeometry};
use kvshard::hicache::{
    CacheNode, HiCacheController, HostLayout, HostPool, HostTransfer, Route, Streams, TransferPlan,
    WritePolicy,
};
use kvshard::index::{LocalPage, LogicalPage, ModelLayer, Slot, StoredLayer};
use kvshard::pool::{ChunkStaging, DevicePool, OwnedRowWrite, PoolBuffers, RawBuffer};
use kvshard::quantize::{quantize_latent, quantize_latent_checked_sync, LATENT_INPUT_ROW_BYTES};
use kvshard::shard::{Placement, ResolveMode, ShardAllocator};
use kvshard::transfer::{
    BackendTransport, ChunkEnd, ChunkResult, ChunkStatus, Completion, Outcome, PoolLayout,
    Receiver, Registration, SendPlan, Sender, Transport,
};
use kvshard::Error;

const LAUNCH: Launch = Launch {
    ctas: 4,
    threads: 256,
};

/// Three target layers (layer 1 shares its indexer) and the MTP draft.
fn geometry() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        vec![true, false, true],
    ))
}

fn seeded(seed: u64) -> rand::rngs::StdRng {
    <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed)
}

fn is_poison(bytes: &[u8]) -> bool {
    bytes.iter().all(|&x| x == POISON)
}

fn random_pool(
    b: &dyn Backend,
    placement: Placement,
    rank: u32,
    pages: u64,
    seed: u64,
) -> Arc<DevicePool> {
    let pool = DevicePool::allocate(b, &geometry(), placement, rank, pages).unwrap();
    let storage = pool.storage().unwrap();
    b.write_sync(storage, 0, &synth::bytes(&mut seeded(seed), storage.len()))
        .unwrap();
    Arc::new(pool)
}

fn poisoned_pool(b: &dyn Backend, placement: Placement, rank: u32, pages: u64) -> Arc<DevicePool> {
    let pool = DevicePool::allocate(b, &geometry(), placement, rank, pages).unwrap();
    pool.fill(b, POISON).unwrap();
    Arc::new(pool)
}

fn poisoned(b: &dyn Backend, len: usize) -> Buffer {
    let buf = b.alloc(len, MemoryKind::Device).unwrap();
    b.fill(&buf, POISON).unwrap();
    buf
}

fn read_all(b: &dyn Backend, buf: &Buffer) -> Vec<u8> {
    b.read_sync(buf, 0, buf.len()).unwrap()
}

fn expect_foreign<T: std::fmt::Debug>(got: kvshard::Result<T>, what: &str) {
    assert!(
        matches!(got, Err(Error::ForeignMemory { .. })),
        "{what}: {got:?}"
    );
}

/// Old API: `BlockCopy::prepare(b, &plan, &src, &dst)` took any spaces of the right shape, so a
/// plan made for one pool copied another pool's bytes. Now a plan remembers its spaces'
/// identities and both `BlockCopy::prepare_sync` and `TableStore::launch` refuse others.
#[test]
fn a_copy_prepared_with_spaces_other_than_its_plans_is_refused() {
    let b = CpuBackend::new();
    let g = geometry();
    let placement = Placement::unsharded();
    let planned = random_pool(&b, placement, 0, 8, 1);
    let twin = random_pool(&b, placement, 0, 8, 2);
    let staging = Arc::new(Staging::new(&b, &g, 3).unwrap());
    let other_staging = Arc::new(Staging::new(&b, &g, 3).unwrap());
    for s in [&staging, &other_staging] {
        b.fill(s.buffer(), POISON).unwrap();
    }
    let pages: Vec<LocalPage> = [1, 4, 6].map(LocalPage).to_vec();
    let plan = BlockCopyPlan::new(
        planned.as_ref(),
        PageSelection::Local(pages.clone()),
        staging.as_ref(),
        PageSelection::Positions,
        3,
    )
    .unwrap();
    type Space = Arc<dyn BlockSpace>;
    let cases: [(&str, Space, Space); 3] = [
        ("another source", twin.clone(), staging.clone()),
        (
            "another destination",
            planned.clone(),
            other_staging.clone(),
        ),
        (
            "source and destination swapped",
            staging.clone(),
            planned.clone(),
        ),
    ];
    let mut store = TableStore::new(Arc::new(b.new_stream()));
    for (what, src, dst) in cases {
        let got = BlockCopy::prepare_sync(&b, plan.clone(), src.clone(), dst.clone(), None);
        assert!(
            matches!(&got, Err(Error::InvalidArgument(m)) if m.contains("copy planned for")),
            "prepare_sync with {what}: {got:?}"
        );
        let got = store.launch(&plan, &src, &dst, LAUNCH);
        assert!(
            matches!(&got, Err(Error::InvalidArgument(m)) if m.contains("copy planned for")),
            "TableStore::launch with {what}: {got:?}"
        );
    }
    b.synchronize().unwrap();
    for s in [&staging, &other_staging] {
        assert!(
            is_poison(&read_all(&b, s.buffer())),
            "a refused copy moved bytes"
        );
    }
    // The spaces the plan was made for copy the planned pool's pages.
    let planned_space: Arc<dyn BlockSpace> = planned.clone();
    let staging_space: Arc<dyn BlockSpace> = staging.clone();
    store
        .launch(&plan, &planned_space, &staging_space, LAUNCH)
        .unwrap();
    store.backend().synchronize().unwrap();
    let latent = g.target.latent_block_bytes();
    for (j, &page) in pages.iter().enumerate() {
        let got = b
            .read_sync(
                &staging
                    .layer(Component::TargetLatent, StoredLayer(2))
                    .unwrap(),
                j * latent,
                latent,
            )
            .unwrap();
        let want = planned
            .read_block_sync(&b, Component::TargetLatent, StoredLayer(2), page)
            .unwrap();
        assert!(got == want, "entry {j}");
    }
}

/// Old API: the CPU backend read any host address, so a buffer of one backend instance was
/// silently used by another. Now every `CpuBackend::new` has its own address space, and every
/// entry point that takes a buffer checks it (`Error::ForeignMemory`).
#[test]
fn a_buffer_of_one_cpu_backend_is_foreign_memory_to_another() {
    let (a, other) = (CpuBackend::new(), CpuBackend::new());
    let buf = poisoned(&a, 64);
    expect_foreign(other.write_sync(&buf, 0, &[1; 8]), "write_sync");
    expect_foreign(other.enqueue_write(&buf, 0, &[1; 8]), "enqueue_write");
    expect_foreign(other.fill(&buf, 0), "fill");
    expect_foreign(other.read_sync(&buf, 0, 8), "read_sync");
    other.synchronize().unwrap();
    assert!(is_poison(&read_all(&a, &buf)));
    // Another stream of the same backend shares its address space.
    a.new_stream().write_sync(&buf, 0, &[1; 8]).unwrap();
    assert_eq!(a.read_sync(&buf, 0, 8).unwrap(), [1; 8]);
}

#[test]
fn a_quantizer_input_of_another_cpu_backend_is_foreign_memory() {
    let (a, other) = (CpuBackend::new(), CpuBackend::new());
    let layout = LatentLayout::Fp8Trtllm;
    let input = a
        .alloc(2 * LATENT_INPUT_ROW_BYTES, MemoryKind::Device)
        .unwrap();
    a.write_sync(
        &input,
        0,
        &synth::bf16_bytes(&mut seeded(3), LATENT_INPUT_ROW_BYTES),
    )
    .unwrap();
    let dst = poisoned(&other, 4 * layout.row_bytes());
    expect_foreign(
        quantize_latent_checked_sync(&other, layout, &input, &[0, 1], &dst),
        "checked quantizer input",
    );
    let rows = upload_i64s_sync(&a, &[0, 1]).unwrap();
    let own_input = poisoned(&other, 2 * LATENT_INPUT_ROW_BYTES);
    expect_foreign(
        quantize_latent(&other, layout, &own_input, &rows, 2, &dst),
        "quantizer rows",
    );
    other.synchronize().unwrap();
    assert!(is_poison(&read_all(&other, &dst)));
}

#[test]
fn an_owned_row_write_refuses_a_slot_buffer_of_another_cpu_backend() {
    let (a, other) = (CpuBackend::new(), CpuBackend::new());
    let placement = Placement::new(2).unwrap();
    let pool = poisoned_pool(&a, placement, 0, 8);
    let staging = Arc::new(ChunkStaging::new(&a, &pool, 64).unwrap());
    a.write_sync(staging.buffer(), 0, &vec![7; staging.buffer().len()])
        .unwrap();
    let write = OwnedRowWrite::prepare_sync(&a, staging.clone(), pool.clone(), |_| true).unwrap();
    // Slots of rank 0's logical page 2 (its local page 1).
    let slots: Vec<i64> = (128..192).collect();
    let foreign = upload_i64s_sync(&other, &slots).unwrap();
    expect_foreign(write.run(&a, &foreign, 64, LAUNCH), "slot buffer");
    expect_foreign(
        write.run(&other, &foreign, 64, LAUNCH),
        "pool of another backend",
    );
    expect_foreign(
        OwnedRowWrite::prepare_sync(&other, staging, pool.clone(), |_| true),
        "staging and pool of another backend",
    );
    a.synchronize().unwrap();
    assert!(is_poison(&pool.snapshot_sync(&a).unwrap()));
    // The same slots from a buffer of the pool's own backend land.
    let own = upload_i64s_sync(&a, &slots).unwrap();
    write.run(&a, &own, 64, LAUNCH).unwrap();
    a.synchronize().unwrap();
    assert!(!is_poison(
        &pool
            .read_block_sync(&a, Component::TargetLatent, StoredLayer(0), LocalPage(1))
            .unwrap()
    ));
}

#[test]
fn a_resolver_made_on_one_cpu_backend_is_refused_by_another() {
    let (a, other) = (CpuBackend::new(), CpuBackend::new());
    let mut resolver = Resolver::new(&a, 16).unwrap();
    for out in [
        resolver.positions(),
        resolver.local(),
        resolver.count_buffer(),
    ] {
        a.fill(out, POISON).unwrap();
    }
    let p = Placement::new(2).unwrap();
    let entries = upload_i64s_sync(&other, &[3; 16]).unwrap();
    expect_foreign(
        resolver.resolve_sync(&other, &entries, 16, p, 1, ResolveMode::Pages, 10),
        "resolve_sync",
    );
    // SAFETY: refused before the address is used: the resolver is not of `other`'s space.
    let raw = unsafe {
        resolver.resolve_device(&other, entries.addr(), 16, p, 1, ResolveMode::Pages, 10)
    };
    expect_foreign(raw, "resolve_device");
    // Entries of another backend are refused by the resolver's own backend too.
    expect_foreign(
        resolver.resolve_sync(&a, &entries, 16, p, 1, ResolveMode::Pages, 10),
        "foreign entries",
    );
    for out in [
        resolver.positions(),
        resolver.local(),
        resolver.count_buffer(),
    ] {
        assert!(is_poison(&read_all(&a, out)), "a refused launch wrote");
    }
}

/// Old API: two entries naming one destination page raced (on the GPU) and one position's
/// data was lost. Now a repeated destination page fails the plan.
#[test]
fn a_repeated_destination_page_of_a_block_copy_is_refused_before_anything_moves() {
    let b = CpuBackend::new();
    let g = geometry();
    let placement = Placement::new(2).unwrap();
    let dst = poisoned_pool(&b, placement, 0, 8);
    let src = Arc::new(Staging::new(&b, &g, 3).unwrap());
    b.write_sync(
        src.buffer(),
        0,
        &synth::bytes(&mut seeded(4), src.buffer().len()),
    )
    .unwrap();
    let local = BlockCopyPlan::new(
        src.as_ref(),
        PageSelection::Positions,
        dst.as_ref(),
        PageSelection::Local([3, 5, 3].map(LocalPage).to_vec()),
        3,
    )
    .unwrap_err();
    assert!(
        matches!(
            local,
            Error::DuplicatePage {
                what: "destination",
                page: 3,
                first: 0,
                second: 2
            }
        ),
        "{local}"
    );
    let logical = BlockCopyPlan::new(
        src.as_ref(),
        PageSelection::Positions,
        dst.as_ref(),
        PageSelection::Logical {
            pages: [4, 6, 4].map(LogicalPage).to_vec(),
            placement,
            rank: 0,
        },
        3,
    )
    .unwrap_err();
    assert!(
        matches!(logical, Error::DuplicatePage { page: 4, .. }),
        "{logical}"
    );
    assert!(is_poison(&dst.snapshot_sync(&b).unwrap()));
}

/// A prefill rank's pool (N = 1, random bytes), the request's pages, and a poisoned decode pool
/// of `backend` with the destination that describes it.
struct PdSetup {
    pool: Arc<DevicePool>,
    src_pages: Vec<LogicalPage>,
    decode: Arc<DevicePool>,
    dst: Arc<RemoteSpace>,
}

fn pd_setup(
    prefill: &dyn Backend,
    decode_backend: &dyn Backend,
    placement: Placement,
    rank: u32,
) -> PdSetup {
    let pool = random_pool(prefill, placement, rank, 8, 10 + u64::from(rank));
    let mut alloc = ShardAllocator::new(placement, 8).unwrap();
    let mut chain = RequestChain::new(placement);
    chain.grow_to(&mut alloc, 256).unwrap();
    let decode = poisoned_pool(decode_backend, Placement::unsharded(), 0, 16);
    let dst = Arc::new(RemoteSpace::of(decode.clone(), geometry()).unwrap());
    PdSetup {
        pool,
        src_pages: chain.pages().unwrap().to_vec(),
        decode,
        dst,
    }
}

fn registration(pages: &[u64], state_pages: &[u64]) -> Registration {
    Registration {
        request: 9,
        layout: PoolLayout::packed(geometry(), 16),
        prefix_pages: 0,
        pages: pages.iter().map(|&p| LocalPage(p)).collect(),
        state_pages: state_pages.iter().map(|&p| LocalPage(p)).collect(),
    }
}

/// Old API: a registration listing one decode page twice was sent, one position's KV overwrote
/// another's, and every rank reported the chunk sent. Now `Registration::validate`,
/// `Sender::open` and `Receiver::register` refuse it, for the KV pages and the state pages.
#[test]
fn a_registration_with_a_repeated_page_is_refused_before_anything_moves() {
    let b = CpuBackend::new();
    let setup = pd_setup(&b, &b, Placement::unsharded(), 0);
    let good = registration(&[1, 2, 3, 4], &[5, 6, 7, 8]);
    good.validate().unwrap();
    let bad = [
        ("pages", registration(&[1, 2, 1, 4], &[5, 6, 7, 8])),
        ("state pages", registration(&[1, 2, 3, 4], &[5, 6, 7, 6])),
    ];
    for (what, reg) in bad {
        let expect_dup = |got: kvshard::Result<()>, call: &str| {
            assert!(
                matches!(&got, Err(Error::Transfer { request: 9, reason }) if reason.contains("appears at positions")),
                "{call} with repeated {what}: {got:?}"
            );
        };
        expect_dup(reg.validate(), "validate");
        let mut sender = Sender::new(
            setup.pool.clone(),
            Box::new(BackendTransport::new(Arc::new(b.new_stream()))),
        );
        expect_dup(sender.open(reg.clone(), setup.dst.clone()), "Sender::open");
        assert_eq!(sender.pending_requests(), 0);
        let send = sender.send(9, &setup.src_pages, ChunkEnd::Final(256));
        assert!(
            matches!(send, Err(Error::Transfer { .. })),
            "a refused request is not open: {send:?}"
        );
        let mut receiver = Receiver::new();
        expect_dup(receiver.register(reg, 1), "Receiver::register");
        assert_eq!(receiver.pending_requests(), 0);
    }
    b.synchronize().unwrap();
    assert!(is_poison(&setup.decode.snapshot_sync(&b).unwrap()));
}

/// Old API: a HiCache backup naming one host page twice wrote two device pages into it. Now
/// `TransferPlan::new` refuses it, so no transfer can be built from it.
#[test]
fn a_hicache_plan_with_a_repeated_host_page_is_refused_before_anything_moves() {
    let b = CpuBackend::new();
    let g = geometry();
    let placement = Placement::new(2).unwrap();
    let _device = random_pool(&b, placement, 0, 10, 5);
    let host = HostPool::new(&b, &g, 10, HostLayout::PageFirst).unwrap();
    host.fill(&b, POISON).unwrap();
    let device_pages = [4, 6, 8].map(LogicalPage);
    let host_pages = [10, 12, 10].map(LogicalPage);
    for rank in 0..2 {
        let err =
            TransferPlan::new(placement, rank, &device_pages, &host_pages, 10, 10).unwrap_err();
        assert!(
            matches!(
                err,
                Error::DuplicatePage {
                    page: 10,
                    first: 0,
                    second: 2,
                    ..
                }
            ),
            "rank {rank}: {err}"
        );
    }
    assert!(is_poison(&host.snapshot_sync(&b).unwrap()));
}

/// Old API: `PoolBuffers` held bare addresses, so an engine buffer shorter than the pool's pages
/// was written past its end. Now each buffer states its bytes and `DevicePool::wrap` refuses a
/// short one, naming the component, the stored layer and both byte counts.
#[test]
fn a_wrapped_pool_buffer_one_page_short_is_refused_naming_component_layer_and_bytes() {
    let b = CpuBackend::new();
    let g = geometry();
    let pages = 8u64;
    for (short, short_layer) in [(Component::TargetIndexer, 1), (Component::DraftLatent, 0)] {
        let mut held = Vec::new();
        let mut buffers = PoolBuffers::default();
        for comp in g.components() {
            for l in 0..comp.layers() {
                let need = PoolBuffers::required_bytes(&g, comp.component, pages).unwrap();
                let bytes = if (comp.component, l) == (short, short_layer) {
                    need - comp.block_bytes as u64
                } else {
                    need
                };
                let buf = b.alloc(bytes as usize, MemoryKind::Device).unwrap();
                let raw = RawBuffer {
                    addr: buf.addr(),
                    bytes,
                };
                held.push(buf);
                match comp.component {
                    Component::TargetLatent => buffers.target_latent.push(raw),
                    Component::TargetIndexer => buffers.target_indexer.push(raw),
                    Component::DraftLatent => buffers.draft_latent.push(raw),
                    Component::DraftIndexer => buffers.draft_indexer.push(raw),
                }
            }
        }
        let block = g
            .components()
            .into_iter()
            .find(|c| c.component == short)
            .unwrap()
            .block_bytes as u64;
        // SAFETY: every buffer is a live allocation of `b` of the bytes it states; the short one
        // is the point of the test and is refused before any address is used.
        let err = unsafe { DevicePool::wrap(&b, &g, Placement::unsharded(), 0, pages, &buffers) }
            .unwrap_err();
        let message = err.to_string();
        let names = [
            format!("{short} buffer of stored layer {short_layer}"),
            format!("holds {} bytes", (pages - 1) * block),
            format!("need {}", pages * block),
        ];
        assert!(
            matches!(err, Error::InvalidArgument(_)) && names.iter().all(|n| message.contains(n)),
            "{message}"
        );
        // With the buffer whole the same buffers wrap.
        let mut whole = buffers.clone();
        let list = match short {
            Component::TargetIndexer => &mut whole.target_indexer,
            _ => &mut whole.draft_latent,
        };
        let fixed = b
            .alloc((pages * block) as usize, MemoryKind::Device)
            .unwrap();
        list[short_layer] = RawBuffer {
            addr: fixed.addr(),
            bytes: pages * block,
        };
        // SAFETY: every buffer is a live allocation of `b` of the bytes it states, held below.
        unsafe { DevicePool::wrap(&b, &g, Placement::unsharded(), 0, pages, &whole) }.unwrap();
        drop((held, fixed));
    }
}

/// Old API: the checked write took raw i64 slots, and slots relative to the chunk (0..n) were
/// accepted: they are logical page 0, the reserved padding page every rank shares. Now the slots
/// are typed and `run_checked_sync` refuses a reserved page before anything is written.
#[test]
fn chunk_relative_slots_on_the_padding_page_are_refused_by_the_checked_write() {
    let b = CpuBackend::new();
    for shard in [1, 2, 4] {
        let placement = Placement::new(shard).unwrap();
        let pool = poisoned_pool(&b, placement, 0, 8);
        let staging = Arc::new(ChunkStaging::new(&b, &pool, 64).unwrap());
        b.write_sync(staging.buffer(), 0, &vec![7; staging.buffer().len()])
            .unwrap();
        let write = OwnedRowWrite::prepare_sync(&b, staging, pool.clone(), |_| true).unwrap();
        let relative: Vec<Slot> = (0..64).map(Slot).collect();
        let err = write.run_checked_sync(&b, &relative, LAUNCH).unwrap_err();
        assert!(
            matches!(err, Error::ReservedPage { page: 0, shard: s } if s == shard),
            "N={shard}: {err}"
        );
        // The last reserved page of the group is refused too.
        let last: Vec<Slot> = (0..64)
            .map(|t| Slot(u64::from(shard - 1) * 64 + t))
            .collect();
        assert!(matches!(
            write.run_checked_sync(&b, &last, LAUNCH),
            Err(Error::ReservedPage { .. })
        ));
        assert!(is_poison(&pool.snapshot_sync(&b).unwrap()), "N={shard}");
    }
}

/// Old API: a send whose destination lived in another backend's memory was enqueued as if it
/// were local and reported sent. Now the transport refuses it and the chunk comes back as an
/// `Err(ChunkFailed)`, whichever way the transport moves bytes.
#[test]
fn a_send_into_another_cpu_backends_pool_fails_as_an_err() {
    let (prefill, decode) = (CpuBackend::new(), CpuBackend::new());
    let setup = pd_setup(&prefill, &decode, Placement::unsharded(), 0);
    let methods = [
        Method::default_for(&prefill),
        Method::RangeKernel(LAUNCH),
        Method::CopyEngine,
    ];
    for method in methods {
        let transport =
            BackendTransport::with_method(Arc::new(prefill.new_stream()), method).unwrap();
        let mut sender = Sender::new(setup.pool.clone(), Box::new(transport));
        sender
            .open(
                registration(&[1, 2, 3, 4], &[5, 6, 7, 8]),
                setup.dst.clone(),
            )
            .unwrap();
        let err = sender
            .send(9, &setup.src_pages, ChunkEnd::Final(256))
            .unwrap_err();
        assert!(
            matches!(&err, Error::ChunkFailed { request: 9, rank: 0, chunk: 0, reason } if reason.contains("address space")),
            "{method:?}: {err}"
        );
        assert_eq!(sender.pending_requests(), 0, "the failed request is closed");
        assert_eq!(sender.bytes_sent().total(), 0);
    }
    prefill.synchronize().unwrap();
    assert!(is_poison(&setup.decode.snapshot_sync(&decode).unwrap()));
}

/// A transport whose chunks fail while they move (a NIXL transfer that errors, say).
struct FailsWhileMoving;

struct Failing;

impl Completion for Failing {
    fn poll(&mut self) -> kvshard::Result<bool> {
        Err(Error::InvalidArgument("the link went down".into()))
    }

    fn wait_sync(&mut self) -> kvshard::Result<()> {
        Err(Error::InvalidArgument("the link went down".into()))
    }
}

impl Transport for FailsWhileMoving {
    fn submit(
        &mut self,
        _plan: &SendPlan,
        _src: &Arc<DevicePool>,
        _dst: &Arc<RemoteSpace>,
    ) -> kvshard::Result<Box<dyn Completion>> {
        Ok(Box::new(Failing))
    }
}

/// Old API: a failed chunk was a status among the sent ones. Now it is an
/// `Err(Error::ChunkFailed)`, from `Sender::send` (refused before it moves) or from
/// `PendingChunk::wait_sync` / `poll` (failed while moving); `ChunkStatus::from_error` turns it into
/// the failed status the decode side must hear, and the `Receiver` finishes the request as
/// failed once every rank has reported.
#[test]
fn a_failed_chunk_is_an_err_whose_status_fails_the_request_on_the_receiver() {
    let (a, other) = (CpuBackend::new(), CpuBackend::new());
    let placement = Placement::new(2).unwrap();
    let reg = registration(&[1, 2, 3, 4], &[5, 6, 7, 8]);
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), 2).unwrap();
    // Rank 0 sends into another backend's pool: refused by send.
    let foreign = pd_setup(&a, &other, placement, 0);
    let mut rank0 = Sender::new(
        foreign.pool.clone(),
        Box::new(BackendTransport::new(Arc::new(a.new_stream()))),
    );
    rank0.open(reg.clone(), foreign.dst.clone()).unwrap();
    let err = rank0
        .send(9, &foreign.src_pages, ChunkEnd::Final(256))
        .unwrap_err();
    let status = ChunkStatus::from_error(&err).expect("a chunk failure has a status");
    assert_eq!((status.request, status.rank, status.chunk), (9, 0, 0));
    assert!(status.is_terminal());
    assert!(matches!(status.result, ChunkResult::Failed { .. }));
    assert_eq!(receiver.receive(status).unwrap(), None);
    let progress = receiver.progress(9).unwrap();
    assert!(progress.failed && progress.ranks_done == 1);
    // Rank 1 sends its share into the decode pool of its own backend.
    let local = pd_setup(&a, &a, placement, 1);
    let mut rank1 = Sender::new(
        local.pool.clone(),
        Box::new(BackendTransport::new(Arc::new(a.new_stream()))),
    );
    rank1.open(reg.clone(), local.dst.clone()).unwrap();
    let sent = rank1
        .send(9, &local.src_pages, ChunkEnd::Final(256))
        .unwrap()
        .wait_sync()
        .unwrap();
    assert!(matches!(sent.result, ChunkResult::Sent { last: true, .. }));
    let finished = receiver
        .receive(sent)
        .unwrap()
        .expect("every rank reported");
    assert!(!finished.is_completed());
    match &finished.outcome {
        Outcome::Failed(failures) => {
            assert_eq!(failures.len(), 1);
            assert_eq!((failures[0].rank, failures[0].chunk), (0, 0));
            assert!(failures[0].reason.contains("address space"), "{failures:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(finished.registration, reg);
    assert_eq!(receiver.pending_requests(), 0);
    assert!(is_poison(&foreign.decode.snapshot_sync(&other).unwrap()));

    // A chunk that fails while it moves comes back from poll and wait as ChunkFailed.
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), 1).unwrap();
    let setup = pd_setup(&a, &a, Placement::unsharded(), 0);
    let mut sender = Sender::new(setup.pool.clone(), Box::new(FailsWhileMoving));
    sender.open(reg.clone(), setup.dst.clone()).unwrap();
    let mut pending = sender
        .send(9, &setup.src_pages, ChunkEnd::Partial(128))
        .unwrap();
    let polled = pending.poll().unwrap_err();
    assert!(
        matches!(polled, Error::ChunkFailed { chunk: 0, .. }),
        "{polled}"
    );
    let err = pending.wait_sync().unwrap_err();
    assert!(
        matches!(&err, Error::ChunkFailed { request: 9, rank: 0, chunk: 0, reason } if reason.contains("the link went down")),
        "{err}"
    );
    let status = ChunkStatus::from_error(&err).unwrap();
    let finished = receiver
        .receive(status)
        .unwrap()
        .expect("the only rank failed");
    assert!(matches!(finished.outcome, Outcome::Failed(ref f) if f.len() == 1));
    // The engine closes the request on the sender, whose last status is the failure too.
    assert_eq!(sender.pending_requests(), 1);
    let aborted = sender.abort(9, "chunk 0 failed").unwrap();
    assert!(aborted.is_terminal() && sender.pending_requests() == 0);
    // Any other error stands for no chunk.
    assert_eq!(ChunkStatus::from_error(&Error::KernelsMissing), None);
}

/// An untracked view of `buf` (what an engine's own kernel reads): kvshard does not order it.
fn engine_view(buf: &Buffer) -> Buffer {
    // SAFETY: the same range of a live allocation, used only while `buf` is alive.
    unsafe { Buffer::from_raw(buf.addr(), buf.len(), buf.kind(), buf.space()) }
}

/// `CpuBackend::deferred` runs work only when something waits for it: an event is not done
/// until waited on, an engine's untracked read on another stream does not see the bytes before
/// it waits, and does after. kvshard's own (tracked) read is ordered after the writes anyway.
#[test]
fn a_deferred_cpu_event_is_done_only_once_waited_on_and_the_waiting_stream_sees_the_bytes() {
    let b = CpuBackend::deferred();
    assert!(b.is_deferred());
    let consumer = b.new_stream();
    let x = b.alloc(4096, MemoryKind::Device).unwrap();
    let view = engine_view(&x);
    b.fill(&x, 3).unwrap();
    b.enqueue_write(&x, 0, &[9; 16]).unwrap();
    let e = b.record().unwrap();
    assert!(!b.is_done(&e).unwrap(), "nothing waited yet");
    assert!(
        consumer
            .read_sync(&view, 0, 4096)
            .unwrap()
            .iter()
            .all(|&v| v == 0),
        "an untracked read on a stream that did not wait sees the fresh (zeroed) allocation"
    );
    assert!(!b.is_done(&e).unwrap());
    consumer.wait(&e).unwrap();
    assert!(!b.is_done(&e).unwrap(), "a wait is itself deferred");
    let seen = consumer.read_sync(&x, 0, 4096).unwrap();
    assert_eq!(&seen[..16], &[9; 16]);
    assert!(seen[16..].iter().all(|&v| v == 3));
    assert!(b.is_done(&e).unwrap());
    // wait_event_sync runs the work too.
    b.fill(&x, 5).unwrap();
    let e = b.record().unwrap();
    assert!(!b.is_done(&e).unwrap());
    consumer.wait_event_sync(&e).unwrap();
    assert!(b.is_done(&e).unwrap());
    assert_eq!(consumer.read_sync(&x, 0, 1).unwrap(), [5]);
}

/// On a deferred backend a consumer that waited for one layer's ready counter sees that layer
/// landed and later layers not yet: per-layer readiness is observable without a GPU.
#[test]
fn a_deferred_signalled_copy_lands_layer_by_layer() {
    let b = CpuBackend::deferred();
    let g = geometry();
    let pool = random_pool(&b, Placement::unsharded(), 0, 8, 6);
    let staging = Arc::new(Staging::new(&b, &g, 4).unwrap());
    b.fill(staging.buffer(), POISON).unwrap();
    let plan = BlockCopyPlan::new(
        pool.as_ref(),
        PageSelection::Local([1, 2, 5, 7].map(LocalPage).to_vec()),
        staging.as_ref(),
        PageSelection::Positions,
        4,
    )
    .unwrap()
    .layer_major();
    // What each layer must hold once it landed, read before anything is launched (a read
    // through `b` would run the whole copy).
    let pages_of = |c: Component, l: usize| -> Vec<u8> {
        [1, 2, 5, 7]
            .iter()
            .flat_map(|&p| {
                pool.read_block_sync(&b, c, StoredLayer(l), LocalPage(p))
                    .unwrap()
            })
            .collect()
    };
    let want = [
        (Component::TargetLatent, 0),
        (Component::TargetIndexer, 0),
        (Component::TargetLatent, 2),
        (Component::DraftIndexer, 0),
    ]
    .map(|(c, l)| pages_of(c, l));
    let copy = BlockCopy::prepare_sync(&b, plan, pool.clone(), staging.clone(), None).unwrap();
    let mut signals = LayerSignals::new(&b, g.model_layers()).unwrap();
    let waits = copy.run_signalled(&b, LAUNCH, &mut signals).unwrap();
    assert_eq!(waits.len(), 4);
    let consumer = b.new_stream();
    // The engine's attention reads a layer through its own (untracked) view, ordered by the
    // layer's counter only: a tracked read would wait for the whole copy.
    let layer = |c: Component, l: usize| {
        let buf = engine_view(&staging.layer(c, StoredLayer(l)).unwrap());
        consumer.read_sync(&buf, 0, buf.len()).unwrap()
    };
    waits[0].wait(&consumer).unwrap();
    assert!(layer(Component::TargetLatent, 0) == want[0]);
    assert!(layer(Component::TargetIndexer, 0) == want[1]);
    assert!(
        is_poison(&layer(Component::TargetLatent, 2)),
        "layer 2 not yet"
    );
    assert!(
        is_poison(&layer(Component::DraftLatent, 0)),
        "the draft not yet"
    );
    waits[3].wait(&consumer).unwrap();
    assert!(layer(Component::TargetLatent, 2) == want[2]);
    assert!(layer(Component::DraftIndexer, 0) == want[3]);
    assert_eq!(signals.target(ModelLayer(3)).unwrap(), waits[3].target());
}

/// Whether `result` is the typed refusal of `method` by `route`, before anything was enqueued.
fn expect_unsupported<T: std::fmt::Debug>(result: kvshard::Result<T>, method: Method, route: &str) {
    match result {
        Err(Error::UnsupportedMethod {
            method: m,
            route: r,
            accepts,
        }) => {
            assert_eq!((m.as_str(), r), (method.to_string().as_str(), route));
            assert!(!accepts.is_empty());
        }
        other => panic!("{method} on {route}: {other:?}"),
    }
}

/// How bytes move is one `Method` on every route; a P/D transport (in process or into a
/// peer-mapped pool) takes the block kernel, the range kernel, the copy engine and the per-block
/// baseline, and refuses the batched copy engine when it is made, before any chunk is submitted.
#[test]
fn a_pd_transport_refuses_a_method_it_cannot_run_when_it_is_made() {
    let b: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    type Make = fn(Arc<dyn Backend>, Method) -> kvshard::Result<BackendTransport>;
    let makers: [Make; 2] = [BackendTransport::with_method, BackendTransport::peer];
    for make in makers {
        let refused = make(b.clone(), Method::BatchedCopyEngine);
        expect_unsupported(refused, Method::BatchedCopyEngine, "a P/D transport");
        for method in [
            Method::default_for(b.as_ref()),
            Method::RangeKernel(LAUNCH),
            Method::CopyEngine,
            Method::PerBlock,
        ] {
            assert_eq!(make(b.clone(), method).unwrap().method(), method);
        }
    }
    let err = BackendTransport::with_method(b, Method::BatchedCopyEngine).unwrap_err();
    assert!(
        err.to_string().contains("batched copy engine"),
        "the message names the method: {err}"
    );
}

/// A backup of logical pages 1-3 of an unsharded poisoned host pool: what the HiCache routes
/// are asked to run with methods they refuse.
fn hicache_backup(b: &CpuBackend) -> (Arc<DevicePool>, Arc<HostPool>, HostTransfer) {
    let placement = Placement::unsharded();
    let device = random_pool(b, placement, 0, 10, 5);
    let host = Arc::new(HostPool::new(b, &geometry(), 10, HostLayout::PageFirst).unwrap());
    host.fill(b, POISON).unwrap();
    let pages = [1, 2, 3].map(LogicalPage);
    let plan = TransferPlan::new(placement, 0, &pages, &pages, 10, 10).unwrap();
    let transfer =
        HostTransfer::new(device.clone(), host.clone(), plan, Direction::Backup).unwrap();
    (device, host, transfer)
}

/// A direct HiCache transfer takes the block kernel, the copy engine, the batched copy engine and
/// the per-block baseline; the range kernel is refused before anything is enqueued (its calls
/// too).
#[test]
fn a_direct_hicache_transfer_refuses_the_range_kernel_before_anything_moves() {
    let b = CpuBackend::new();
    let (_device, host, mut backup) = hicache_backup(&b);
    backup.prepare_kernel_sync(&b, &mut Vec::new()).unwrap();
    let range = Method::RangeKernel(LAUNCH);
    let route = "a direct HiCache transfer";
    expect_unsupported(backup.run(&b, range, Layers::All), range, route);
    expect_unsupported(backup.calls(range, Layers::All), range, route);
    b.synchronize().unwrap();
    assert!(is_poison(&host.snapshot_sync(&b).unwrap()));
}

/// The relayout of a staged HiCache transfer is the block kernel or the copy engine; any other
/// method is refused before anything is enqueued.
#[test]
fn a_staged_hicache_relayout_refuses_a_method_it_cannot_run_before_anything_moves() {
    let b = CpuBackend::new();
    let (_device, host, mut backup) = hicache_backup(&b);
    let staging = backup.staging(&b, 2).unwrap();
    backup
        .prepare_staged_sync(&b, &staging, &mut Vec::new())
        .unwrap();
    let other = b.new_stream();
    for method in [
        Method::RangeKernel(LAUNCH),
        Method::BatchedCopyEngine,
        Method::PerBlock,
    ] {
        let refused = backup.run_staged(&b, &other, &staging, method);
        expect_unsupported(refused, method, "the relayout of a staged HiCache transfer");
    }
    b.synchronize().unwrap();
    other.synchronize().unwrap();
    assert!(is_poison(&host.snapshot_sync(&b).unwrap()));
}

/// The HiCache controller checks a route's method before it allocates, stages or enqueues
/// anything: a refused backup leaves the host allocator, the queues and the staging as they were.
#[test]
fn the_hicache_controller_refuses_a_routes_unsupported_method_before_anything_changes() {
    let b = CpuBackend::new();
    let (device, host, _) = hicache_backup(&b);
    let stream = || -> Arc<dyn Backend> { Arc::new(b.new_stream()) };
    let streams = Streams {
        load: stream(),
        backup: stream(),
        load_relayout: stream(),
        backup_relayout: stream(),
        tables: stream(),
    };
    let mut ctl =
        HiCacheController::new(device, host.clone(), streams, WritePolicy::WriteThrough).unwrap();
    let node = CacheNode {
        id: 1,
        device_pages: [1, 2, 3].map(LogicalPage).to_vec(),
        start_owner: None,
    };
    let compute = b.record().unwrap();
    let free = ctl.host_allocator().free_pages(0);
    let range = Method::RangeKernel(LAUNCH);
    for (route, method, name) in [
        (Route::Direct(range), range, "a direct HiCache transfer"),
        (
            Route::Staged(Method::PerBlock),
            Method::PerBlock,
            "the relayout of a staged HiCache transfer",
        ),
    ] {
        expect_unsupported(ctl.backup(&node, &compute, route), method, name);
        expect_unsupported(ctl.access(&node, &compute, route), method, name);
        assert_eq!(ctl.host_allocator().free_pages(0), free);
        assert_eq!((ctl.pending_backups(), ctl.staging_bytes()), (0, 0));
    }
    b.synchronize().unwrap();
    assert!(is_poison(&host.snapshot_sync(&b).unwrap()));
}

// Old behaviour: a launch of more CTAs than CUDA's largest grid passed every check and failed
// only in the driver (or ran four billion CTAs on the CPU twin); it is refused with the shape.
#[test]
fn a_launch_past_cudas_largest_grid_is_refused_before_anything_is_enqueued() {
    let b = CpuBackend::new();
    let max = b.max_threads(kvshard::backend::KernelFamily::Copy);
    for ctas in [Launch::MAX_CTAS + 1, u32::MAX] {
        let e = Launch { ctas, threads: 32 }.validate(max).unwrap_err();
        assert!(e.to_string().contains("need 1 to 2147483647 CTAs"), "{e}");
    }
    assert!(Launch {
        ctas: Launch::MAX_CTAS,
        threads: 32
    }
    .validate(max)
    .is_ok());
}
