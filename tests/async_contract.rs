//! The asynchronous contract (docs/design.md, "Streams, lifetimes and waits"): work kvshard
//! queues keeps every buffer, table and pool it uses until it has run, waits on the device for
//! conflicting work kvshard queued on other streams, and only `_sync` calls block the host.
//!
//! Each test runs on CPU backends whose streams run work only when something waits for it
//! (deferred), and in adversarial order (each host wait runs the other streams first or last
//! by a seeded coin), so a missing dependency gives wrong bytes or a missing allocation here,
//! deterministically, instead of sometimes on a GPU. The behaviours an engine meets on a GPU
//! run there too, from the same body (`gpu_*`).

use kvshard::copy::{
    BlockCopy, BlockCopyPlan, Direction, Layers, Method, PageSelection, RemoteSpace, Staging,
};
use std::sync::Arc;

mod common;

use common::synth::{self, POISON};
use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::{
    pending_frees, sync_counts, upload_i64s_sync, Backend, Launch, MemoryKind, SyncCounts,
};
use kvshard::chain::RequestChain;
use kvshard::geometry::{CacheGeometry, Component, LatentLayout, PoolGeometry};
use kvshard::hicache::{
    CacheNode, HiCacheController, HostLayout, HostPool, HostTransfer, Route, Streams, TransferPlan,
    WritePolicy,
};
use kvshard::index::{LocalPage, LogicalPage, ModelLayer, StoredLayer};
use kvshard::pool::{ChunkStaging, DevicePool, OwnedRowWrite};
use kvshard::shard::{Placement, ShardAllocator};
use kvshard::transfer::{BackendTransport, ChunkEnd, PoolLayout, Registration, Sender};

const LAUNCH: Launch = Launch {
    ctas: 4,
    threads: 256,
};
const PAGES: u64 = 16;
const TOKENS: usize = 256;

/// Every order a test runs in: deferred, and adversarial with seeds that take both sides of
/// the coin at the first host waits.
const ORDERS: [StreamOrder; 5] = [
    StreamOrder::Deferred,
    StreamOrder::Adversarial(0),
    StreamOrder::Adversarial(1),
    StreamOrder::Adversarial(2),
    StreamOrder::Adversarial(7),
];

/// Two target layers (the second shares its indexer) and the MTP draft.
fn geometry() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        vec![true, false],
    ))
}

fn seeded(seed: u64) -> rand::rngs::StdRng {
    <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed)
}

fn random_pool(b: &dyn Backend, seed: u64) -> Arc<DevicePool> {
    let pool = DevicePool::allocate(b, &geometry(), Placement::unsharded(), 0, PAGES).unwrap();
    let storage = pool.storage().unwrap();
    b.write_sync(storage, 0, &synth::bytes(&mut seeded(seed), storage.len()))
        .unwrap();
    Arc::new(pool)
}

fn poisoned_pool(b: &dyn Backend) -> Arc<DevicePool> {
    let pool = DevicePool::allocate(b, &geometry(), Placement::unsharded(), 0, PAGES).unwrap();
    pool.fill(b, POISON).unwrap();
    Arc::new(pool)
}

/// The local pages of an unsharded chain (its logical pages, as local ones).
fn local_pages(chain: &RequestChain) -> Vec<LocalPage> {
    chain
        .pages()
        .unwrap()
        .iter()
        .map(|p| LocalPage(p.0))
        .collect()
}

fn local(pages: &[u64]) -> Vec<LocalPage> {
    pages.iter().map(|&p| LocalPage(p)).collect()
}

fn logical(pages: &[u64]) -> Vec<LogicalPage> {
    pages.iter().map(|&p| LogicalPage(p)).collect()
}

// Old behaviour: a copy's tables handed to the next copy (`into_tables`, then
// `prepare_sync(.., reuse)` on another stream) were rewritten before the first copy's
// queued run read them, which then copied by the second copy's tables into the wrong pool.
common::on_cpu_and_gpu!(
    tables_reused_while_a_run_is_queued_are_rewritten_only_after_it,
    ORDERS,
    |device| {
        let (b, other) = (device.stream(), device.stream());
        let (b, other) = (b.as_ref(), other.as_ref());
        let g = geometry();
        let src = random_pool(b, 1);
        let dst = Arc::new(Staging::new(b, &g, 4).unwrap());
        let unrelated = Arc::new(Staging::new(b, &g, 1).unwrap());
        b.fill(dst.buffer(), POISON).unwrap();
        b.fill(unrelated.buffer(), POISON).unwrap();
        b.synchronize().unwrap();
        let first = BlockCopyPlan::new(
            src.as_ref(),
            PageSelection::Local(local(&[1, 3, 5, 7])),
            dst.as_ref(),
            PageSelection::Positions,
            4,
        )
        .unwrap();
        let copy = BlockCopy::prepare_sync(b, first, src.clone(), dst.clone(), None).unwrap();
        copy.run(b, LAUNCH).unwrap();
        let tables = copy.into_tables();
        let second = BlockCopyPlan::new(
            src.as_ref(),
            PageSelection::Local(local(&[2])),
            unrelated.as_ref(),
            PageSelection::Positions,
            1,
        )
        .unwrap();
        let copy =
            BlockCopy::prepare_sync(other, second, src.clone(), unrelated.clone(), tables).unwrap();
        copy.run(other, LAUNCH).unwrap();
        other.synchronize().unwrap();
        b.synchronize().unwrap();
        let block = g.target.latent_block_bytes();
        let layer = |s: &Staging| s.layer(Component::TargetLatent, StoredLayer(1)).unwrap();
        for (j, page) in [1, 3, 5, 7].into_iter().enumerate() {
            let got = b.read_sync(&layer(&dst), j * block, block).unwrap();
            let want = src
                .read_block_sync(b, Component::TargetLatent, StoredLayer(1), LocalPage(page))
                .unwrap();
            assert!(got == want, "{device}: page {page} of the first copy");
        }
        let got = b.read_sync(&layer(&unrelated), 0, block).unwrap();
        let want = src
            .read_block_sync(b, Component::TargetLatent, StoredLayer(1), LocalPage(2))
            .unwrap();
        assert!(got == want, "{device}: the second copy");
    }
);

/// Old behaviour: preparing a staged transfer for a second staging while a run through the
/// first was queued rewrote the tables that run read: it reported Ok and landed none of its
/// bytes.
#[test]
fn a_staged_preparation_while_a_staged_run_is_queued_leaves_the_run_correct() {
    for order in ORDERS {
        let b = CpuBackend::with_order(order);
        let other = b.new_stream();
        let g = geometry();
        let placement = Placement::unsharded();
        let host = Arc::new(HostPool::new(&b, &g, PAGES, HostLayout::PageFirst).unwrap());
        for c in g.components() {
            let buf = host.buffer(c.component).unwrap();
            b.write_sync(buf, 0, &synth::bytes(&mut seeded(3), buf.len()))
                .unwrap();
        }
        let (device, host_pages) = ([2, 5, 6], [1, 2, 3]);
        let plan = TransferPlan::new(
            placement,
            0,
            &logical(&device),
            &logical(&host_pages),
            PAGES,
            PAGES,
        )
        .unwrap();
        let load_into = |pool: &Arc<DevicePool>| {
            HostTransfer::new(pool.clone(), host.clone(), plan.clone(), Direction::Load).unwrap()
        };
        // The reference: the same load through the copy engine, alone.
        let reference = poisoned_pool(&b);
        load_into(&reference)
            .run(&b, Method::CopyEngine, Layers::All)
            .unwrap();
        let pool = poisoned_pool(&b);
        let mut load = load_into(&pool);
        let first = load.staging(&b, 2).unwrap();
        let second = load.staging(&b, 2).unwrap();
        let how = common::host_io(2);
        // Tables are uploaded on a stream of their own, as the HiCache controller does.
        let tables = b.new_stream();
        load.prepare_staged_sync(&tables, &first, &mut Vec::new())
            .unwrap();
        load.run_staged(&b, &other, &first, how).unwrap();
        let mut spare = Vec::new();
        load.prepare_staged_sync(&tables, &second, &mut spare)
            .unwrap();
        // The second preparation took the first one's tables back to reuse them.
        assert!(spare.is_empty(), "{order:?}");
        b.synchronize().unwrap();
        other.synchronize().unwrap();
        let got = pool.read_pages_sync(&b, &local(&device)).unwrap();
        let want = reference.read_pages_sync(&b, &local(&device)).unwrap();
        assert!(got == want, "{order:?}: the queued load landed its bytes");
    }
}

// Dropping the last handle of a pool (and the copy reading it) while the copy is queued
// parks the pool's memory until the copy has run; nothing blocks the host meanwhile. (On
// the GPU under compute-sanitizer memcheck, a free under the copy is an error.)
common::on_cpu_and_gpu!(
    a_pool_dropped_with_a_copy_queued_stays_until_the_copy_ran,
    ORDERS,
    |device| {
        let b = device.stream();
        let b = b.as_ref();
        // On the GPU, 8 GiB of fill ahead of the copy (milliseconds of device time) keeps it
        // queued while the host drops the pool and looks (microseconds). A gate the stream
        // waits on would do it exactly, but compute-sanitizer serializes streams and would
        // never open it. The CPU twin runs nothing until something waits: no fill needed.
        let busy: usize = if device.is_gpu() { 8 << 30 } else { 0 };
        let g = geometry();
        let src = random_pool(b, 4);
        let want = src
            .read_block_sync(b, Component::TargetLatent, StoredLayer(0), LocalPage(3))
            .unwrap();
        let dst = Arc::new(Staging::new(b, &g, 1).unwrap());
        let plan = BlockCopyPlan::new(
            src.as_ref(),
            PageSelection::Local(local(&[3])),
            dst.as_ref(),
            PageSelection::Positions,
            1,
        )
        .unwrap();
        let copy = BlockCopy::prepare_sync(b, plan, src, dst.clone(), None).unwrap();
        let ballast = (busy > 0).then(|| b.alloc(busy, MemoryKind::Device).unwrap());
        let before = sync_counts();
        if let Some(ballast) = &ballast {
            b.fill(ballast, 1).unwrap();
        }
        copy.run(b, LAUNCH).unwrap();
        let ran = b.record().unwrap();
        drop(copy);
        // Parked, or its copy had already run: asked in this order, `freed and not run` is
        // impossible, however the device and other threads go. (Where nothing runs until waited
        // for, only parked is possible.)
        let parked = pending_frees() >= 1;
        let ran = ran.is_complete().unwrap();
        assert!(parked || ran, "{device}: the source waits for its copy");
        assert!(
            parked || busy > 0,
            "{device}: nothing ran, so the source is parked"
        );
        assert_eq!(sync_counts() - before, SyncCounts::default(), "{device}");
        b.synchronize().unwrap();
        let layer = dst.layer(Component::TargetLatent, StoredLayer(0)).unwrap();
        let got = b.read_sync(&layer, 0, layer.len()).unwrap();
        assert!(
            got == want,
            "{device}: the copy read the dropped pool's bytes"
        );
    }
);

/// One rank of an engine (unsharded, so every page is its own): its pool, chunk staging and
/// writer, with the compute stream they run on, on the CPU twin or a GPU.
struct Rank {
    /// Makes another stream of the same device.
    streams: Box<dyn Fn() -> Arc<dyn Backend>>,
    compute: Arc<dyn Backend>,
    pool: Arc<DevicePool>,
    staging: Arc<ChunkStaging>,
    writer: OwnedRowWrite,
    alloc: ShardAllocator,
}

impl Rank {
    fn new(order: StreamOrder) -> Self {
        let cpu = CpuBackend::with_order(order);
        Self::on(Box::new(move || Arc::new(cpu.new_stream())))
    }

    fn on(streams: Box<dyn Fn() -> Arc<dyn Backend>>) -> Self {
        let compute = streams();
        let pool = poisoned_pool(compute.as_ref());
        let staging = Arc::new(ChunkStaging::new(compute.as_ref(), &pool, TOKENS).unwrap());
        let writer =
            OwnedRowWrite::prepare_sync(compute.as_ref(), staging.clone(), pool.clone(), |_| true)
                .unwrap();
        let alloc = ShardAllocator::new(Placement::unsharded(), PAGES).unwrap();
        Self {
            streams,
            compute,
            pool,
            staging,
            writer,
            alloc,
        }
    }

    /// The chain's slots for its first `TOKENS` tokens, uploaded once (set-up, not per chunk).
    fn slots(&self, chain: &RequestChain) -> kvshard::backend::Buffer {
        let raw: Vec<i64> = chain
            .slots(0..TOKENS)
            .unwrap()
            .iter()
            .map(|s| s.0 as i64)
            .collect();
        upload_i64s_sync(self.compute.as_ref(), &raw).unwrap()
    }

    /// Enqueues the forward pass's KV for one chunk (bytes from `seed`) and the owned-row write
    /// of it into `slots`, on the compute stream: nothing waits.
    fn write(&self, slots: &kvshard::backend::Buffer, seed: u64) {
        let bytes = synth::bytes(&mut seeded(seed), self.staging.buffer().len());
        self.compute
            .enqueue_write(self.staging.buffer(), 0, &bytes)
            .unwrap();
        let launch = self.writer.launch(self.compute.as_ref(), TOKENS);
        self.writer
            .run(self.compute.as_ref(), slots, TOKENS, launch)
            .unwrap();
    }

    /// A decode side for this rank's sends: an unsharded, poisoned decode pool with a chain of
    /// `TOKENS` tokens registered as request 1, and a sender of this rank's pool on a stream of
    /// its own, opened for it.
    fn decode_side(&self) -> (Arc<DevicePool>, RequestChain, Registration, Sender) {
        let decode = poisoned_pool(self.compute.as_ref());
        let mut alloc = ShardAllocator::new(Placement::unsharded(), PAGES).unwrap();
        let mut chain = RequestChain::new(Placement::unsharded());
        chain.grow_to(&mut alloc, TOKENS).unwrap();
        let reg = Registration::of_chain(&chain, 1, PoolLayout::of(&decode), 0).unwrap();
        let dst = Arc::new(RemoteSpace::of(decode.clone(), geometry()).unwrap());
        let transport = BackendTransport::new((self.streams)());
        let mut sender = Sender::new(self.pool.clone(), Box::new(transport));
        sender.open(reg.clone(), dst).unwrap();
        (decode, chain, reg, sender)
    }

    fn controller(&self) -> HiCacheController {
        let g = geometry();
        let host = Arc::new(
            HostPool::new(self.compute.as_ref(), &g, PAGES, HostLayout::PageFirst).unwrap(),
        );
        let stream = || (self.streams)();
        let streams = Streams {
            load: stream(),
            backup: stream(),
            load_relayout: stream(),
            backup_relayout: stream(),
            tables: stream(),
        };
        HiCacheController::new(self.pool.clone(), host, streams, WritePolicy::WriteThrough).unwrap()
    }
}

// An engine mistake that passed silently: a P/D send on its own stream right after an
// owned-row write on the compute stream, with no event between them, sent stale bytes.
common::on_cpu_and_gpu!(
    a_send_on_another_stream_after_a_write_sends_the_written_bytes,
    ORDERS,
    |device| {
        let case = device.to_string();
        let mut rank = Rank::on(Box::new(move || device.stream()));
        let mut chain = RequestChain::new(Placement::unsharded());
        chain.grow_to(&mut rank.alloc, TOKENS).unwrap();
        let slots = rank.slots(&chain);
        let (decode, decode_chain, reg, mut sender) = rank.decode_side();
        rank.write(&slots, 5);
        let pending = sender
            .send(reg.request, chain.pages().unwrap(), ChunkEnd::Final(TOKENS))
            .unwrap();
        pending.wait_sync().unwrap();
        rank.compute.synchronize().unwrap();
        let pages: Vec<LocalPage> = local_pages(&chain);
        let dpages: Vec<LocalPage> = local_pages(&decode_chain);
        let sent = decode
            .read_pages_sync(rank.compute.as_ref(), &dpages)
            .unwrap();
        let written = rank
            .pool
            .read_pages_sync(rank.compute.as_ref(), &pages)
            .unwrap();
        assert!(sent == written, "{case}: the decode got the written bytes");
    }
);

// An engine mistake that passed silently: pages written again (a new request) before
// their backup ran put the new bytes in the host cache. The new write now waits for the
// backup.
common::on_cpu_and_gpu!(
    pages_rewritten_before_their_backup_ran_back_up_the_old_bytes,
    ORDERS,
    |device| {
        let case = device.to_string();
        let mut rank = Rank::on(Box::new(move || device.stream()));
        let mut c = rank.controller();
        let mut chain = RequestChain::new(Placement::unsharded());
        chain.grow_to(&mut rank.alloc, TOKENS).unwrap();
        let slots = rank.slots(&chain);
        let pages: Vec<LocalPage> = local_pages(&chain);
        rank.write(&slots, 6);
        let backed = rank
            .pool
            .read_pages_sync(rank.compute.as_ref(), &pages)
            .unwrap();
        let node = CacheNode::of_chain(&chain, 3, 0..chain.page_count()).unwrap();
        let done = rank.compute.record().unwrap();
        c.access(&node, &done, Method::CopyEngine).unwrap();
        // The engine reuses the pages at once: a new request's chunk lands in them.
        rank.write(&slots, 7);
        c.ack_backups_sync(1).unwrap();
        // Reload the backup into the same pages and compare with what was backed up.
        let handle = c
            .load(
                node.id,
                &node.device_pages,
                None,
                Route::Direct(Method::CopyEngine),
            )
            .unwrap();
        handle
            .wait_layer(rank.compute.as_ref(), ModelLayer(0))
            .unwrap();
        c.ack_loads_sync(1).unwrap();
        let reloaded = rank
            .pool
            .read_pages_sync(rank.compute.as_ref(), &pages)
            .unwrap();
        assert!(
            reloaded == backed,
            "{case}: the backup holds the first request's bytes"
        );
    }
);

// Staging made up front (an engine's startup) is the staging every later staged transfer
// uses: none of them allocates, and the round trip still brings back the written bytes.
common::on_cpu_and_gpu!(
    staging_prepared_up_front_serves_every_staged_transfer,
    ORDERS,
    |device| {
        let case = device.to_string();
        let mut rank = Rank::on(Box::new(move || device.stream()));
        let mut c = rank.controller();
        assert_eq!(
            c.staging_bytes(),
            0,
            "{case}: nothing made before it is asked"
        );
        c.prepare_staging().unwrap();
        let made = c.staging_bytes();
        assert!(made > 0, "{case}");
        c.prepare_staging().unwrap();
        assert_eq!(c.staging_bytes(), made, "{case}: made once");
        let mut chain = RequestChain::new(Placement::unsharded());
        chain.grow_to(&mut rank.alloc, TOKENS).unwrap();
        let slots = rank.slots(&chain);
        let pages: Vec<LocalPage> = local_pages(&chain);
        rank.write(&slots, 8);
        let backed = rank
            .pool
            .read_pages_sync(rank.compute.as_ref(), &pages)
            .unwrap();
        let node = CacheNode::of_chain(&chain, 4, 0..chain.page_count()).unwrap();
        let done = rank.compute.record().unwrap();
        let staged = Route::Staged(Method::CopyEngine);
        c.access(&node, &done, staged).unwrap();
        c.ack_backups_sync(1).unwrap();
        rank.pool.fill(rank.compute.as_ref(), POISON).unwrap();
        let handle = c.load(node.id, &node.device_pages, None, staged).unwrap();
        handle
            .wait_layer(rank.compute.as_ref(), ModelLayer(0))
            .unwrap();
        c.ack_loads_sync(1).unwrap();
        assert_eq!(
            c.staging_bytes(),
            made,
            "{case}: no transfer made staging of its own"
        );
        let reloaded = rank
            .pool
            .read_pages_sync(rank.compute.as_ref(), &pages)
            .unwrap();
        assert!(reloaded == backed, "{case}: the staged round trip");
        // Resizing drops it; preparing again makes the new size.
        c.set_staging_pages(1).unwrap();
        assert_eq!(c.staging_bytes(), 0, "{case}");
        c.prepare_staging().unwrap();
        assert!(c.staging_bytes() > 0 && c.staging_bytes() < made, "{case}");
    }
);

/// An engine mistake that raced on a GPU and passed on the CPU: kvshard work reading reloaded
/// pages before the load's layer signal. kvshard's own reads now wait for the load.
#[test]
fn a_kvshard_read_of_reloaded_pages_before_their_signal_sees_the_loaded_bytes() {
    for order in ORDERS {
        let mut rank = Rank::new(order);
        let mut c = rank.controller();
        let mut chain = RequestChain::new(Placement::unsharded());
        chain.grow_to(&mut rank.alloc, TOKENS).unwrap();
        let slots = rank.slots(&chain);
        let pages: Vec<LocalPage> = local_pages(&chain);
        rank.write(&slots, 8);
        let backed = rank
            .pool
            .read_pages_sync(rank.compute.as_ref(), &pages)
            .unwrap();
        let node = CacheNode::of_chain(&chain, 4, 0..chain.page_count()).unwrap();
        let done = rank.compute.record().unwrap();
        c.access(&node, &done, Method::CopyEngine).unwrap();
        c.ack_backups_sync(1).unwrap();
        rank.pool.fill(rank.compute.as_ref(), POISON).unwrap();
        let _handle = c
            .load(
                node.id,
                &node.device_pages,
                None,
                Route::Direct(common::host_io(2)),
            )
            .unwrap();
        let consumer = (rank.streams)();
        let got = rank
            .pool
            .read_pages_sync(consumer.as_ref(), &pages)
            .unwrap();
        assert!(got == backed, "{order:?}: the read waited for the load");
        c.ack_loads_sync(1).unwrap();
    }
}

// The steady state of an engine (a chunk written, sent, backed up, a cached prefix
// reloaded layer by layer) blocks the host nowhere and never waits for the whole device:
// only the `_sync` calls at the end do. On the GPU, on kvshard's own streams.
common::on_cpu_and_gpu!(
    an_engines_steady_state_blocks_nothing_outside_sync_calls,
    ORDERS,
    |device| {
        let case = device.to_string();
        let mut rank = Rank::on(Box::new(move || device.stream()));
        let mut c = rank.controller();
        // Set-up: a prefix written and backed up, acked.
        let mut prefix = RequestChain::new(Placement::unsharded());
        prefix.grow_to(&mut rank.alloc, TOKENS).unwrap();
        rank.write(&rank.slots(&prefix), 10);
        let cached = CacheNode::of_chain(&prefix, 5, 0..prefix.page_count()).unwrap();
        let done = rank.compute.record().unwrap();
        c.access(&cached, &done, Method::CopyEngine).unwrap();
        c.ack_backups_sync(1).unwrap();
        let reload_into = rank.alloc.alloc_matching(&cached.device_pages).unwrap();
        // A new request, with its P/D destination.
        let mut chain = RequestChain::new(Placement::unsharded());
        chain.grow_to(&mut rank.alloc, TOKENS).unwrap();
        let slots = rank.slots(&chain);
        let (_decode, _decode_chain, reg, mut sender) = rank.decode_side();
        let consumer = (rank.streams)();
        let node = CacheNode::of_chain(&chain, 6, 0..chain.page_count()).unwrap();

        let before = sync_counts();
        rank.write(&slots, 9);
        let mut pending = sender
            .send(reg.request, chain.pages().unwrap(), ChunkEnd::Final(TOKENS))
            .unwrap();
        let done = rank.compute.record().unwrap();
        c.access(&node, &done, Method::CopyEngine).unwrap();
        let handle = c
            .load(
                cached.id,
                &reload_into,
                None,
                Route::Direct(common::host_io(2)),
            )
            .unwrap();
        for layer in 0..geometry().model_layers() {
            handle
                .wait_layer(consumer.as_ref(), ModelLayer(layer))
                .unwrap();
        }
        let _ = pending.poll().unwrap();
        let _ = c.poll_backups().unwrap();
        let blocked = sync_counts() - before;
        assert_eq!(blocked, SyncCounts::default(), "{case}: {blocked:?}");

        pending.wait_sync().unwrap();
        c.ack_backups_sync(1).unwrap();
        c.ack_loads_sync(1).unwrap();
        consumer.synchronize().unwrap();
        assert!(sync_counts().host_blocking > before.host_blocking);
    }
);

/// A random host pool of `PAGES` pages in `layout`.
fn random_host(b: &dyn Backend, layout: HostLayout, seed: u64) -> Arc<HostPool> {
    let host = HostPool::new(b, &geometry(), PAGES, layout).unwrap();
    let mut rng = seeded(seed);
    for i in 0..host.buffer_layouts().len() {
        let buf = host.buffer_memory(i).unwrap();
        b.write_sync(buf, 0, &synth::bytes(&mut rng, buf.len()))
            .unwrap();
    }
    Arc::new(host)
}

/// A load of host pages 1..=4 into device pages 1..=4 on one stream and a backup of device
/// pages `backup` into host pages 9..=12 on another (`None`: both on one stream, the
/// reference), by `method`; returns the two pools' bytes at the end and whether the load had
/// run when the backup's stream was waited for.
fn load_beside_backup(
    order: StreamOrder,
    method: Method,
    backup: &[u64],
    two_streams: bool,
) -> (Vec<u8>, Vec<u8>, bool) {
    let a = CpuBackend::with_order(order);
    let other = a.new_stream();
    let b = if two_streams { &other } else { &a };
    let pool = random_pool(&a, 11);
    let host = random_host(&a, HostLayout::LayerFirst, 12);
    let transfer = |device: &[u64], host_pages: &[u64], dir| {
        let plan = TransferPlan::new(
            Placement::unsharded(),
            0,
            &logical(device),
            &logical(host_pages),
            PAGES,
            PAGES,
        )
        .unwrap();
        let mut t = HostTransfer::new(pool.clone(), host.clone(), plan, dir).unwrap();
        if matches!(method, Method::Kernel(_)) {
            t.prepare_kernel_sync(&a, &mut Vec::new()).unwrap();
        }
        t
    };
    let load = transfer(&[1, 2, 3, 4], &[1, 2, 3, 4], Direction::Load);
    let back = transfer(backup, &[9, 10, 11, 12], Direction::Backup);
    load.run(&a, method, Layers::All).unwrap();
    let loaded = a.record().unwrap();
    back.run(b, method, Layers::All).unwrap();
    b.synchronize().unwrap();
    let load_ran = a.is_done(&loaded).unwrap();
    a.synchronize().unwrap();
    (
        pool.snapshot_sync(&a).unwrap(),
        host.snapshot_sync(&a).unwrap(),
        load_ran,
    )
}

// Old behaviour: the usage of a whole pool ordered a load and a backup of disjoint pages of the
// same pools on two streams one after the other (on the H200 the two directions ran at 54 GB/s
// together instead of overlapping). Usages now name the pages a HiCache copy touches.
#[test]
fn a_load_and_a_backup_of_other_pages_on_two_streams_do_not_wait_for_each_other() {
    for method in [Method::CopyEngine, Method::Kernel(LAUNCH)] {
        // Disjoint pages: the backup's stream runs without the load's.
        let reference = load_beside_backup(StreamOrder::Deferred, method, &[9, 10, 11, 12], false);
        let (pool, host, load_ran) =
            load_beside_backup(StreamOrder::Deferred, method, &[9, 10, 11, 12], true);
        assert!(
            !load_ran,
            "{method}: the backup of other pages waited for the load"
        );
        assert!(
            pool == reference.0 && host == reference.1,
            "{method}: two streams moved other bytes than one"
        );
        // Overlapping pages (the backup reads page 4, which the load writes): ordered, and the
        // backup reads the loaded bytes.
        let reference = load_beside_backup(StreamOrder::Deferred, method, &[4, 10, 11, 12], false);
        let (pool, host, load_ran) =
            load_beside_backup(StreamOrder::Deferred, method, &[4, 10, 11, 12], true);
        assert!(
            load_ran,
            "{method}: the backup of a loaded page did not wait for the load"
        );
        assert!(
            pool == reference.0 && host == reference.1,
            "{method}: the backup of a loaded page read other bytes than on one stream"
        );
        // Every adversarial order gives the one-stream bytes too.
        for order in ORDERS {
            for backup in [[9, 10, 11, 12], [4, 10, 11, 12]] {
                let one = load_beside_backup(order, method, &backup, false);
                let two = load_beside_backup(order, method, &backup, true);
                assert!(
                    one.0 == two.0 && one.1 == two.1,
                    "{method}, {order:?}, backup {backup:?}: bytes differ"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Frees (docs/design.md, "Streams, lifetimes and waits"): no drop waits for another stream.
// ---------------------------------------------------------------------------------------------

/// Host memory of the test's own, page-aligned, that a registered host pool lends kvshard.
struct LentHost {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: plain memory owned by this value; nothing else holds a reference into it.
unsafe impl Send for LentHost {}
// SAFETY: see Send.
unsafe impl Sync for LentHost {}

impl LentHost {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: a non-zero size (every host buffer holds pages).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "host memory for a registered pool");
        Self { ptr, layout }
    }
}

impl Drop for LentHost {
    fn drop(&mut self) {
        // SAFETY: allocated by `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// Every kind of kvshard object that owns memory on `gpu`, made on `b`, each with work of its
/// own queued and completed (so each has a usage with events): what an engine drops when it
/// shrinks a pool or its Python collects an object. Named for the report.
fn owners(
    gpu: &Arc<kvshard::gpu::Gpu>,
    b: &Arc<dyn Backend>,
) -> Vec<(&'static str, Box<dyn std::any::Any>)> {
    use kvshard::backend::cuda::CudaBackend;
    use kvshard::copy::{LayerSignals, Resolver};
    use kvshard::hicache::{HostFormat, HostRegion};
    use kvshard::ipc::{ExportedPool, PeerBackend};
    let g = geometry();
    let bk = b.as_ref();
    let pool = poisoned_pool(bk);
    let registrable = Arc::new(
        DevicePool::allocate_registrable(bk, &g, Placement::unsharded(), 0, PAGES).unwrap(),
    );
    registrable.fill(bk, 1).unwrap();
    let host = HostPool::new(bk, &g, PAGES, HostLayout::PageFirst).unwrap();
    host.fill(bk, 2).unwrap();
    let format = HostFormat::kvshard(HostLayout::PageFirst);
    let lent: Vec<LentHost> = format
        .buffers(&g, PAGES)
        .unwrap()
        .iter()
        .map(|l| LentHost::new(l.bytes))
        .collect();
    let regions: Vec<HostRegion> = format
        .buffers(&g, PAGES)
        .unwrap()
        .iter()
        .zip(&lent)
        .map(|(l, m)| HostRegion {
            host: m.ptr,
            len: l.bytes,
        })
        .collect();
    // SAFETY: the test's own page-aligned memory of exactly each buffer's size, never
    // registered, held by the pool's registrations until they are undone.
    let registered = unsafe {
        HostPool::register_with_owner(
            gpu,
            &g,
            PAGES,
            format,
            &regions,
            1 << 20,
            Some(Arc::new(lent)),
        )
    }
    .unwrap();
    registered.fill(bk, 3).unwrap();
    let staging = Arc::new(ChunkStaging::new(bk, &pool, TOKENS).unwrap());
    bk.fill(staging.buffer(), 4).unwrap();
    let writer = OwnedRowWrite::prepare_sync(bk, staging.clone(), pool.clone(), |_| true).unwrap();
    let streams = Streams {
        load: common::stream(gpu),
        backup: common::stream(gpu),
        load_relayout: common::stream(gpu),
        backup_relayout: common::stream(gpu),
        tables: common::stream(gpu),
    };
    let controller_host = Arc::new(HostPool::new(bk, &g, PAGES, HostLayout::PageFirst).unwrap());
    let controller = HiCacheController::new(
        pool.clone(),
        controller_host,
        streams,
        WritePolicy::WriteThrough,
    )
    .unwrap();
    let signals = LayerSignals::new(bk, g.model_layers()).unwrap();
    let resolver = Resolver::new(bk, 4096).unwrap();
    let cuda = Arc::new(CudaBackend::new(gpu.clone()).unwrap());
    let exported = ExportedPool::allocate(
        &PeerBackend::Cuda(cuda.clone()),
        &g,
        Placement::unsharded(),
        0,
        PAGES,
    )
    .unwrap();
    exported.pool().fill(cuda.as_ref(), 5).unwrap();
    cuda.synchronize().unwrap();
    bk.synchronize().unwrap();
    vec![
        (
            "HiCache controller (its staging and tables)",
            Box::new(controller),
        ),
        ("owned-row write (its tables)", Box::new(writer)),
        ("chunk staging", Box::new(staging)),
        ("device pool (allocated)", Box::new(pool)),
        (
            "device pool (registrable, cuMemAlloc)",
            Box::new(registrable),
        ),
        ("host pool (pinned, cuMemHostAlloc)", Box::new(host)),
        ("layer signals", Box::new(signals)),
        ("resolver", Box::new(resolver)),
        ("CUDA backend (its stream and status words)", Box::new(cuda)),
        // Last: memory the driver gives no way to let go of without a call that may wait for
        // the device (the engine's host memory, unregistered; VMM memory, unmapped), made on
        // the reaper thread; while it waits, the driver may hold this thread's CUDA calls.
        (
            "host pool (engine memory kvshard registered)",
            Box::new(registered),
        ),
        ("exported pool (VMM)", Box::new(exported)),
    ]
}

/// How many of [`owners`]' objects, counted from the end, leave a free on the reaper thread.
const UNDONE_ON_THE_REAPER: usize = 2;

/// Enqueues about `ms` milliseconds of memory-bound work on `engine` (fills of a ballast it
/// allocates: the production fatbin has no spin kernel) and returns the event after it.
fn busy(engine: &dyn Backend, ms: f64) -> kvshard::backend::Event {
    let ballast = engine.alloc(1 << 30, MemoryKind::Device).unwrap();
    let start = engine.record_timed().unwrap();
    for _ in 0..4 {
        engine.fill(&ballast, 1).unwrap();
    }
    let end = engine.record_timed().unwrap();
    engine.synchronize().unwrap();
    let each = (engine.elapsed_ms(&start, &end).unwrap() / 4.0).max(1e-3);
    for _ in 0..((ms / each).ceil() as usize).clamp(1, 20_000) {
        engine.fill(&ballast, 2).unwrap();
    }
    engine.record().unwrap()
}

// Old behaviour: on the H200, dropping an allocated pool, a pinned host pool or a staging while
// an engine's stream had 40 matmuls queued blocked the host 55-61 ms, until that stream had
// finished (cuMemFree / cuMemFreeHost on the dropping thread synchronize the device). Now
// device memory comes from a stream-ordered pool, `cuMemAlloc` and pinned host memory are kept
// for reuse, and what the driver leaves no other way to undo runs on the reaper thread: each
// drop returns in under 1 ms while the engine's work is still queued.
#[test]
fn gpu_dropping_kvshard_objects_never_waits_for_another_stream() {
    use std::io::Write;
    // Alone among this binary's GPU tests: beside the loop below (which fills the device and
    // gives its memory back to the driver) the drops measured 12-24 ms each on the H200.
    let _alone = common::device_alone();
    let test = "gpu_dropping_kvshard_objects_never_waits_for_another_stream";
    let Some(gpu) = common::open_gpu(test) else {
        return;
    };
    assert_eq!(
        gpu.stream_ordered_absent(),
        None,
        "{test}: a stream-ordered pool"
    );
    let b = common::stream(&gpu);
    let engine = common::stream(&gpu);
    let mut objects = owners(&gpu, &b);
    let last = objects.split_off(objects.len() - UNDONE_ON_THE_REAPER);
    // 60 ms of the engine's work, as the H200 measurement had.
    let done = busy(engine.as_ref(), 60.0);
    let queued_before = !done.is_complete().unwrap();
    let mut times = Vec::new();
    for (name, object) in objects {
        let start = std::time::Instant::now();
        drop(object);
        times.push((name, start.elapsed()));
    }
    let start = std::time::Instant::now();
    drop(b);
    times.push(("CUDA backend the objects were made on", start.elapsed()));
    let queued_after = !done.is_complete().unwrap();
    // The drops that leave a call on the reaper return at once too; what they leave may hold
    // later CUDA calls until the device is idle (the driver's choice), so they come last.
    for (name, object) in last {
        let start = std::time::Instant::now();
        drop(object);
        times.push((name, start.elapsed()));
    }
    for (name, took) in &times {
        let _ = writeln!(
            std::io::stderr(),
            "free timing: drop of {name}: {:.3} ms with the engine's work queued",
            took.as_secs_f64() * 1e3
        );
    }
    let _ = writeln!(
        std::io::stderr(),
        "free timing: the engine's 60 ms of work still queued after every drop: {queued_after}"
    );
    if queued_before {
        assert!(
            queued_after,
            "{test}: a drop waited for the engine's stream: {times:?}"
        );
        let slowest = times.iter().map(|(_, t)| *t).max().unwrap_or_default();
        assert!(
            slowest < std::time::Duration::from_millis(1),
            "{test}: a drop took {slowest:?}: {times:?}"
        );
    } else {
        // A tool that serializes the device (compute-sanitizer) ran the work at enqueue.
        let _ = writeln!(
            std::io::stderr(),
            "NOTE {test}: the engine's work had run before the drops; nothing to compare"
        );
    }
    engine.synchronize().unwrap();
    kvshard::backend::wait_for_frees_sync(std::time::Duration::from_secs(60))
        .expect("every free done once the engine's work has run");
}

// Memory dropped in a loop comes back: 40 device allocations of a sixteenth of the GPU each
// (2.5 times its memory: memory that never came back would run it out), each dropped while a
// fill of it is queued, then pinned host buffers the same way; every free drains and the
// device's free memory is back.
#[test]
fn gpu_memory_dropped_in_a_loop_comes_back() {
    let _shared = common::device_shared();
    let test = "gpu_memory_dropped_in_a_loop_comes_back";
    let Some(gpu) = common::open_gpu(test) else {
        return;
    };
    let b = common::stream(&gpu);
    let wait = std::time::Duration::from_secs(60);
    kvshard::backend::wait_for_frees_sync(wait).unwrap();
    gpu.bind().unwrap();
    let (free_before, total) = cudarc::driver::result::mem_get_info().unwrap();
    let chunk = total / 16;
    for i in 0..40u8 {
        let buffer = b.alloc(chunk, MemoryKind::Device).unwrap_or_else(|e| {
            panic!("{test}: allocation {i}: {e} (the dropped memory did not come back)")
        });
        b.fill(&buffer, i).unwrap();
        drop(buffer);
    }
    // cuMemAlloc memory is kept for reuse: the same 40 rounds fit only if each takes the block
    // the round before gave up.
    for i in 0..40u8 {
        let buffer = b.alloc_registrable(chunk).unwrap_or_else(|e| {
            panic!("{test}: registrable allocation {i}: {e} (the block was not reused)")
        });
        b.fill(&buffer, i).unwrap();
        drop(buffer);
    }
    for i in 0..16u8 {
        let buffer = b.alloc(64 << 20, MemoryKind::PinnedHost).unwrap();
        b.fill(&buffer, i).unwrap();
        drop(buffer);
    }
    b.synchronize().unwrap();
    kvshard::backend::wait_for_frees_sync(wait).expect("every free drains");
    assert_eq!(
        kvshard::gpu::cached_bytes(),
        0,
        "{test}: the blocks kept for reuse went back to the driver"
    );
    gpu.bind().unwrap();
    let (free_after, _) = cudarc::driver::result::mem_get_info().unwrap();
    // Other tests of this binary allocate meanwhile (one holds 8 GiB for a while): two chunks
    // of slack, against the 40 chunks a leak would hold.
    assert!(
        free_after + 2 * chunk >= free_before,
        "{test}: {free_before} bytes free before, {free_after} after"
    );
}

// A pool keeps what its owner lends alive past the work queued on it: a wrapped pool's engine
// memory must outlive kvshard's work however early the engine drops the pool.
common::on_cpu_and_gpu!(
    what_a_pool_keeps_alive_outlives_its_queued_work,
    ORDERS,
    |device| {
        use std::sync::atomic::{AtomicBool, Ordering};
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let b = device.stream();
        let b = b.as_ref();
        let busy_bytes: usize = if device.is_gpu() { 8 << 30 } else { 0 };
        let src = random_pool(b, 9);
        let dropped = Arc::new(AtomicBool::new(false));
        src.keep_alive(Box::new(Flag(dropped.clone())));
        let dst = Arc::new(Staging::new(b, &geometry(), 1).unwrap());
        let plan = BlockCopyPlan::new(
            src.as_ref(),
            PageSelection::Local(local(&[3])),
            dst.as_ref(),
            PageSelection::Positions,
            1,
        )
        .unwrap();
        let copy = BlockCopy::prepare_sync(b, plan, src, dst, None).unwrap();
        let ballast = (busy_bytes > 0).then(|| b.alloc(busy_bytes, MemoryKind::Device).unwrap());
        if let Some(ballast) = &ballast {
            b.fill(ballast, 1).unwrap();
        }
        copy.run(b, LAUNCH).unwrap();
        let ran = b.record().unwrap();
        drop(copy);
        // Kept, or its copy had already run (asked in this order).
        let kept = !dropped.load(Ordering::SeqCst);
        assert!(
            kept || ran.is_complete().unwrap(),
            "{device}: let go under its copy"
        );
        assert!(
            kept || busy_bytes > 0,
            "{device}: nothing ran, so it is kept"
        );
        b.synchronize().unwrap();
        // Let go once the copy has run, by the next sweep, through the reaper thread.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !dropped.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
            let _ = pending_frees();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(
            dropped.load(Ordering::SeqCst),
            "{device}: kept after its work ran"
        );
    }
);
