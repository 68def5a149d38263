//! An SGLang-like engine embedding kvshard: two CP prefill ranks and an unsharded decode pool
//! wrap the engine's own KV buffers (DSA geometry with the MTP draft), a 1,000-token prompt is
//! allocated and written chunk by chunk, sent P/D (every rank sends every chunk, an empty final
//! chunk included), backed up to HiCache by write-through, evicted, and reloaded layer by layer
//! into new pages. Runs on the CPU reference backend: `cargo run --example engine`.

use std::sync::Arc;

// Everything from the front door: an engine needs nothing else.
use kvshard::engine::{
    sync_counts, Backend, BackendTransport, Buffer, CacheGeometry, CacheNode, ChunkEnd,
    ChunkStaging, Component, CpuBackend, DevicePool, Error, HiCacheController, HostLayout,
    HostPool, LatentLayout, LocalPage, LogicalPage, MemoryKind, Method, ModelLayer, OwnedRowWrite,
    Placement, PoolBuffers, PoolGeometry, PoolLayout, RawBuffer, Receiver, Registration,
    RemoteSpace, RequestChain, Result, Route, Sender, ShardAllocator, Streams, WritePolicy,
};

const RANKS: u32 = 2;
const PAGES: u64 = 24; // per rank: 16,384 logical slots would need 128; a small demo uses 24
const PROMPT: usize = 1000;
const CHUNK: usize = 256;

/// The engine's own per-layer KV buffers (torch tensors in SGLang), wrapped without copying.
fn engine_pool(
    b: &CpuBackend,
    g: &CacheGeometry,
    placement: Placement,
    rank: u32,
) -> Result<(DevicePool, Vec<Buffer>)> {
    let mut buffers = PoolBuffers::default();
    let mut keep = Vec::new();
    for c in g.components() {
        for _ in 0..c.layers() {
            let bytes = PoolBuffers::required_bytes(g, c.component, PAGES)?;
            let t = b.alloc(bytes as usize, MemoryKind::Device)?;
            let raw = RawBuffer {
                addr: t.addr(),
                bytes,
            };
            match c.component {
                Component::TargetLatent => buffers.target_latent.push(raw),
                Component::TargetIndexer => buffers.target_indexer.push(raw),
                Component::DraftLatent => buffers.draft_latent.push(raw),
                Component::DraftIndexer => buffers.draft_indexer.push(raw),
            }
            keep.push(t);
        }
    }
    // SAFETY: every buffer is this backend's memory of the bytes it claims, kept alive in `keep`
    // for as long as the pool is used.
    let pool = unsafe { DevicePool::wrap(b, g, placement, rank, PAGES, &buffers)? };
    Ok((pool, keep))
}

fn main() -> Result<()> {
    let syncs = sync_counts();
    let cpu = CpuBackend::new();
    let b: Arc<dyn Backend> = Arc::new(cpu.new_stream());
    let g = CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        vec![true, true, false, true],
    ));
    let cp = Placement::new(RANKS)?;

    // Prefill ranks and the decode pool, on the engine's buffers.
    let mut ranks = Vec::new();
    let mut tensors = Vec::new();
    for r in 0..RANKS {
        let (pool, t) = engine_pool(&cpu, &g, cp, r)?;
        ranks.push(Arc::new(pool));
        tensors.push(t);
    }
    let (decode, t) = engine_pool(&cpu, &g, Placement::unsharded(), 0)?;
    let decode = Arc::new(decode);
    tensors.push(t);

    // The prompt's chain, grown chunk by chunk; each chunk staged whole, owned rows persisted.
    let mut alloc = ShardAllocator::new(cp, PAGES)?;
    let mut chain = RequestChain::new(cp);
    let staging = Arc::new(ChunkStaging::new(b.as_ref(), &ranks[0], CHUNK)?);
    let writers = ranks
        .iter()
        .map(|p| OwnedRowWrite::prepare_sync(b.as_ref(), staging.clone(), p.clone(), |_| true))
        .collect::<Result<Vec<_>>>()?;
    let mut start = 0;
    while start < PROMPT {
        let end = (start + CHUNK).min(PROMPT);
        chain.grow_to(&mut alloc, end)?;
        // The forward pass writes the chunk's KV into the staging (here: a byte pattern).
        let bytes: Vec<u8> = (0..staging.buffer().len())
            .map(|i| (i * 31 + start) as u8)
            .collect();
        b.write_sync(staging.buffer(), 0, &bytes)?;
        let slots = chain.slots(start..end)?;
        for w in &writers {
            w.run_checked_sync(b.as_ref(), &slots, w.launch(b.as_ref(), end - start))?;
        }
        start = end;
    }

    // P/D: decode registers its pages; every prefill rank sends every chunk.
    let mut decode_alloc = ShardAllocator::new(Placement::unsharded(), PAGES)?;
    let mut decode_chain = RequestChain::new(Placement::unsharded());
    decode_chain.grow_to(&mut decode_alloc, PROMPT)?;
    let reg = Registration::of_chain(&decode_chain, 1, PoolLayout::of(&decode), 0)?;
    let dst = Arc::new(RemoteSpace::of(decode.clone(), g.clone())?);
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), RANKS)?;
    let mut senders: Vec<Sender> = ranks
        .iter()
        .map(|p| Sender::new(p.clone(), Box::new(BackendTransport::new(b.clone()))))
        .collect();
    let mut done = None;
    for (i, end) in [512, PROMPT].into_iter().enumerate() {
        let at = if i == 1 {
            ChunkEnd::Final(end)
        } else {
            ChunkEnd::Partial(end)
        };
        for s in &mut senders {
            if i == 0 {
                s.open(reg.clone(), dst.clone())?;
            }
            let status = s.send(reg.request, chain.pages()?, at)?.wait_sync()?;
            done = receiver.receive(status)?.or(done);
        }
    }
    let finished = done.ok_or(Error::Transfer {
        request: reg.request,
        reason: "a rank never sent its final chunk".into(),
    })?;
    println!(
        "P/D: request {} {:?}, {}",
        finished.request(),
        finished.outcome,
        finished.total_bytes()
    );

    // HiCache: write-through backup of the prompt's node on every rank.
    let streams = || -> Arc<dyn Backend> { Arc::new(cpu.new_stream()) };
    let mut controllers = ranks
        .iter()
        .map(|p| {
            let host = Arc::new(HostPool::new(&cpu, &g, PAGES, HostLayout::PageFirst)?);
            let s = Streams {
                load: streams(),
                backup: streams(),
                load_relayout: streams(),
                backup_relayout: streams(),
                tables: streams(),
            };
            HiCacheController::new(p.clone(), host, s, WritePolicy::WriteThrough)
        })
        .collect::<Result<Vec<_>>>()?;
    let node = CacheNode::of_chain(&chain, 7, 0..chain.page_count())?;
    let compute = b.record()?;
    let owned = |pages: &[LogicalPage], rank: usize| -> Vec<LocalPage> {
        pages
            .iter()
            .filter(|&&p| cp.owner(p) == rank as u32)
            .map(|&p| cp.local(p))
            .collect()
    };
    let before: Vec<_> = (0..ranks.len())
        .map(|r| ranks[r].read_pages_sync(b.as_ref(), &owned(chain.pages()?, r)))
        .collect::<Result<_>>()?;
    for c in &mut controllers {
        c.access(&node, &compute, Method::CopyEngine)?;
        c.ack_backups_sync(1)?;
    }

    // Eviction: the controller forgets nothing on the host; the engine frees the device pages.
    for c in &mut controllers {
        c.evict_sync(&node, &compute, Method::CopyEngine)?;
    }
    chain.free(&mut alloc)?;

    // Reload into new pages of the same owners, consuming layer by layer.
    let reloaded = alloc.alloc_matching(&node.device_pages)?;
    let consumer = streams();
    for c in &mut controllers {
        let handle = c.load(
            node.id,
            &reloaded,
            None,
            Route::Direct(Method::host_io(b.as_ref(), 2)),
        )?;
        for layer in 0..g.model_layers() {
            // The attention of `layer` would run on `consumer` right after this wait.
            handle.wait_layer(consumer.as_ref(), ModelLayer(layer))?;
        }
        c.ack_loads_sync(1)?;
    }
    consumer.synchronize()?;
    let after: Vec<_> = (0..ranks.len())
        .map(|r| ranks[r].read_pages_sync(b.as_ref(), &owned(&reloaded, r)))
        .collect::<Result<_>>()?;
    if after != before {
        return Err(Error::HiCache(
            "reloaded pages differ from the backup".into(),
        ));
    }
    let reloaded_chain = RequestChain::cached(&alloc, chain.start_owner().unwrap_or(0), reloaded)?;
    println!(
        "HiCache: {} pages backed up, evicted and reloaded into new pages (start owner {:?}), byte-identical",
        reloaded_chain.page_count(),
        reloaded_chain.start_owner(),
    );
    // Only the `_sync` calls above blocked, each on one stream or event.
    let syncs = sync_counts() - syncs;
    println!(
        "waits: {} host-blocking, all in _sync calls",
        syncs.host_blocking
    );
    Ok(())
}
