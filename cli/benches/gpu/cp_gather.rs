//! The CP all-gather on two GPUs, one thread per GPU (shared by the `allgather` benchmark section
//! and `tests/nccl.rs`): each rank packs its send list and NCCL all-gathers it, layer by layer,
//! into its attention scratch; the scratch read through the gather plan's page table must equal
//! the unsharded pool's pages in logical order. Timed next to NCCL's all-gather of the same
//! bytes from one contiguous buffer, in the same run.

use std::sync::mpsc;
use std::sync::Arc;

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, MemoryKind};
use kvshard::chain::RequestChain;
use kvshard::copy::{BlockSpace, Staging};
use kvshard::gpu::Gpu;
use kvshard::index::{LocalPage, ModelLayer, StoredLayer};
use kvshard::nccl::{CpGather, NcclGroup, NcclId};
use kvshard::pool::DevicePool;
use kvshard::shard::{GatherPlan, GatherRequest, Placement, ScratchLayout, ShardAllocator};
use kvshard::{Error, Result};
use kvshard_cli::measure::{EngineView, Stats, Timer};
use kvshard_cli::scenario;

/// Byte of the unsharded cache the test data puts at (logical page, component, stored layer,
/// offset): every byte says where it belongs, so a misplaced block cannot pass.
fn expected(page: u64, component: usize, layer: usize, offset: usize) -> u8 {
    let x = page
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((component as u64) << 56)
        .wrapping_add((layer as u64) << 40)
        .wrapping_add(offset as u64 / 8);
    (x ^ (x >> 29) ^ (offset as u64)) as u8
}

/// What one run measures.
pub struct Shape {
    /// Target layers (the draft comes on top).
    pub layers: usize,
    /// Physical pages per rank.
    pub pages_per_rank: u64,
    /// Requests of the batch and the prefix pages of each.
    pub requests: usize,
    /// Pages of each request's cached prefix.
    pub prefix_pages: usize,
    /// CTAs of the pack.
    pub ctas: u32,
    /// Timed repeats.
    pub repeats: usize,
}

/// What one run found, from rank 0's view.
pub struct Figures {
    /// Bytes landing in each rank's scratch per gather of every layer.
    pub gathered_bytes: u64,
    /// Pages of each rank's send list.
    pub block: u64,
    /// Pack + all-gather, layer by layer, every layer (ms).
    pub pack_gather: Stats,
    /// What an engine sees of it: the window from the first layer's call (both ranks' streams
    /// idle) to the last layer's completion, and the host time of the calls.
    pub pack_gather_view: EngineView,
    /// One all-gather of the same bytes from one contiguous buffer (ms).
    pub contiguous: Stats,
}

/// The cache: the applications' (every fourth layer sharing its indexer, the MTP draft), CP2.
fn cache(shape: &Shape) -> scenario::Shape {
    scenario::Shape {
        ranks: 2,
        layers: shape.layers,
        draft: true,
        seed: 0,
    }
}

/// The batch every rank plans identically: `requests` chains grown by one allocator.
fn batch(shape: &Shape, placement: Placement) -> Result<Vec<RequestChain>> {
    let mut alloc = ShardAllocator::new(placement, shape.pages_per_rank)?;
    (0..shape.requests)
        .map(|_| {
            let mut chain = RequestChain::new(placement);
            chain.grow_to(&mut alloc, shape.prefix_pages * 64)?;
            Ok(chain)
        })
        .collect()
}

/// Fills rank `rank`'s pool with the unsharded cache's bytes of the pages it owns.
fn fill(b: &CudaBackend, pool: &DevicePool, placement: Placement) -> Result<()> {
    let storage = pool
        .storage()
        .ok_or_else(|| Error::InvalidArgument("an allocated pool".into()))?;
    for (c, comp) in pool.components().iter().enumerate() {
        for l in 0..comp.layers() {
            let base = pool.block_addr(comp.component, StoredLayer(l), LocalPage(0))?;
            let mut bytes = vec![0u8; pool.pages() as usize * comp.block_bytes];
            for (p, block) in bytes.chunks_exact_mut(comp.block_bytes).enumerate() {
                let logical = placement
                    .logical(pool.rank(), LocalPage(p as u64))
                    .map_or(0, |l| l.0);
                for (i, byte) in block.iter_mut().enumerate() {
                    *byte = expected(logical, c, l, i);
                }
            }
            b.write_sync(storage, (base - storage.addr()) as usize, &bytes)?;
        }
    }
    Ok(())
}

/// Rank `rank`'s side of the run.
fn rank_main(rank: u32, shape: &Shape, id: NcclId) -> Result<Figures> {
    let gpu = Gpu::open(rank as usize)?;
    let b = CudaBackend::new(gpu)?;
    let g = cache(shape).geometry();
    let placement = cache(shape).placement()?;
    let pool = Arc::new(DevicePool::allocate(
        &b,
        &g,
        placement,
        rank,
        shape.pages_per_rank,
    )?);
    fill(&b, &pool, placement)?;
    let chains = batch(shape, placement)?;
    let requests = chains
        .iter()
        .map(|c| GatherRequest::of_chain(c, c.page_count()))
        .collect::<Result<Vec<_>>>()?;
    let prefix_tokens = (shape.requests * shape.prefix_pages + 2 * shape.requests) as u64 * 128;
    let layout = ScratchLayout::new(prefix_tokens, 64)?;
    let plan = GatherPlan::new(placement, layout, pool.logical_pages(), &requests)?;
    let scratch = Arc::new(Staging::new(&b, &g, layout.pages())?);
    b.fill(scratch.buffer(), 0xA5)?;
    let gather = CpGather::prepare_sync(&b, &plan, pool.clone(), scratch.clone())?;
    let group = NcclGroup::join(&b, id, rank, 2)?;
    let layers = g.model_layers();
    let run_all = || -> Result<()> {
        for m in (0..layers).map(ModelLayer) {
            gather.run_layer(&b, &group, m, shape.ctas)?;
        }
        Ok(())
    };
    // One untimed run first: NCCL sets its channels up on the first collective.
    // Every rank makes the same runs (warm-up, window, repeats), so the collectives pair up.
    let timer = Timer::new(&b).warmups(1);
    let (pack_gather, pack_gather_view) = timer
        .windows(1)
        .repeat_viewed_sync(shape.repeats, run_all)?;
    let gathered_bytes: u64 = (0..layers).map(|m| gather.layer_bytes(ModelLayer(m))).sum();
    // The same bytes in one all-gather from one contiguous buffer.
    let per_rank = (gathered_bytes / 2) as usize;
    let send = b.alloc(per_rank.max(1), MemoryKind::Device)?;
    let recv = b.alloc((2 * per_rank).max(1), MemoryKind::Device)?;
    // SAFETY: `send` holds `per_rank` bytes and `recv` twice that, both live until every timed
    // run has been waited for.
    let contiguous = timer.repeat_sync(shape.repeats, || unsafe {
        group.all_gather_raw(&b, send.addr(), recv.addr(), per_rank)
    })?;
    verify(&b, &plan, &scratch)?;
    Ok(Figures {
        gathered_bytes,
        block: plan.block(),
        pack_gather,
        pack_gather_view,
        contiguous,
    })
}

/// Every mapped prefix page of the scratch, read through the page table, against the
/// unsharded cache's bytes.
fn verify(b: &CudaBackend, plan: &GatherPlan, scratch: &Staging) -> Result<()> {
    let table = plan.page_table()?;
    for (c, comp) in scratch.components().iter().enumerate() {
        for l in 0..comp.layers() {
            let layer = scratch.layer(comp.component, StoredLayer(l))?;
            let bytes = b.read_sync(&layer, 0, layer.len())?;
            for &page in plan.mapped_pages() {
                let at = table[page.0 as usize];
                if at < 0 || (at as u64) >= plan.gathered_pages() {
                    continue;
                }
                let block = &bytes[at as usize * comp.block_bytes..][..comp.block_bytes];
                let good = block
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == expected(page.0, c, l, i));
                if !good {
                    return Err(Error::InvalidArgument(format!(
                        "scratch page {at} ({} layer {l}) does not hold logical page {}",
                        comp.component, page.0
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Runs `shape` on GPUs 0 and 1; `Ok(Err(reason))` when there are not two GPUs or no NCCL.
pub fn two_gpu_gather(shape: &Shape) -> Result<std::result::Result<Figures, String>> {
    if !kvshard::nccl::nccl_present() {
        return Ok(Err("libnccl.so.2 cannot be loaded".into()));
    }
    if let Err(e) = Gpu::open(1) {
        return Ok(Err(format!("needs two GPUs: {e}")));
    }
    let id = NcclId::new()?;
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        for rank in 0..2u32 {
            let tx = tx.clone();
            s.spawn(move || {
                let _ = tx.send((rank, rank_main(rank, shape, id)));
            });
        }
    });
    drop(tx);
    let mut rank0 = None;
    for (rank, result) in rx {
        let figures = result?;
        if rank == 0 {
            rank0 = Some(figures);
        }
    }
    rank0
        .map(Ok)
        .ok_or_else(|| Error::InvalidArgument("rank 0 reported nothing".into()))
}
