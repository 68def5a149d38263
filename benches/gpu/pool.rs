//! Device pool copies (issue 4): gather, scatter and pool-to-pool of scattered pages, all 61
//! target layers plus the draft, latent and indexer, against one cudaMemcpyAsync per
//! (page, layer) block, one cudaMemcpyBatchAsync call, and the in-run D2D ceiling; and the
//! owned-row write path against its byte floor.

use kvshard::abi;
use kvshard::backend::{Backend, Buffer, Launch, MemoryKind};
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::pool::{
    BlockCopy, BlockCopyPlan, BlockSpace, ChunkStaging, DevicePool, OwnedRowWrite, PageSelection,
    Staging,
};
use kvshard::shard::Placement;
use kvshard::synth;
use kvshard::{Error, Result};
use rand::Rng;

use crate::harness::{Ctx, Report, Stats};

/// Grids tried for the D2D kernels: (CTAs per SM, threads).
const GRIDS: [(u32, u32); 3] = [(1, 1024), (2, 512), (4, 256)];

fn block_bytes(
    ctx: &Ctx,
    space: &dyn BlockSpace,
    c: usize,
    l: usize,
    page: u64,
) -> Result<Vec<u8>> {
    let bytes = space.components()[c].block_bytes;
    let addr = space.layer_base(c, l) + page * space.block_side(c).page_stride;
    // SAFETY: inside the space's layer buffer.
    let buf = unsafe { Buffer::from_raw(addr, bytes, MemoryKind::Device) };
    ctx.backend.read(&buf, 0, bytes)
}

/// Compares 48 random (entry, component, layer) blocks of a finished copy.
fn verify(
    ctx: &mut Ctx,
    src: &dyn BlockSpace,
    src_pages: &[u64],
    dst: &dyn BlockSpace,
    dst_pages: &[u64],
) -> Result<()> {
    for _ in 0..48 {
        let j = ctx.rng.random_range(0..src_pages.len());
        let c = ctx.rng.random_range(0..src.components().len());
        let l = ctx.rng.random_range(0..src.components()[c].layers());
        if block_bytes(ctx, src, c, l, src_pages[j])? != block_bytes(ctx, dst, c, l, dst_pages[j])?
        {
            return Err(Error::InvalidArgument(format!(
                "benchmark copy wrong at entry {j} component {c} layer {l}"
            )));
        }
    }
    Ok(())
}

/// Times the kernel at every grid of [`GRIDS`]; returns the best and a note listing all.
fn best_grid(ctx: &Ctx, copy: &BlockCopy<'_>, reps: usize) -> Result<(Stats, String)> {
    let sms = ctx.gpu.info().sm_count;
    let mut best: Option<Stats> = None;
    let mut note = String::from("grids");
    for (per_sm, threads) in GRIDS {
        let launch = Launch {
            ctas: sms * per_sm,
            threads,
        };
        let s = ctx.time(reps, || copy.run(&ctx.backend, launch))?;
        note.push_str(&format!(" {}x{}:{:.3}ms", launch.ctas, threads, s.median));
        if best.is_none_or(|b| s.median < b.median) {
            best = Some(s);
        }
    }
    Ok((best.expect("at least one grid"), note))
}

/// Every (page, layer) block of a copy as a range.
fn block_ranges(
    src: &dyn BlockSpace,
    src_pages: &[u64],
    dst: &dyn BlockSpace,
    dst_pages: &[u64],
) -> Vec<abi::kvs_range> {
    let mut out = Vec::new();
    for (c, comp) in src.components().iter().enumerate() {
        for l in 0..comp.layers() {
            for (&s, &d) in src_pages.iter().zip(dst_pages) {
                out.push(abi::kvs_range {
                    src: src.layer_base(c, l) + s * src.block_side(c).page_stride,
                    dst: dst.layer_base(c, l) + d * dst.block_side(c).page_stride,
                    bytes: comp.block_bytes as u64,
                });
            }
        }
    }
    out
}

fn alternatives(
    ctx: &Ctx,
    report: &mut Report,
    case: &str,
    ranges: &[abi::kvs_range],
    bytes: u64,
) -> Result<()> {
    let d2d = ("d2d", ctx.ceilings.d2d);
    let reps = ctx.reps(3);
    // SAFETY: every range is a whole block of a live pool or staging buffer.
    let per_block = ctx.time(reps, || {
        ranges
            .iter()
            .try_for_each(|r| unsafe { ctx.backend.memcpy(r.dst, r.src, r.bytes as usize) })
    })?;
    report.add(
        "pool",
        format!("{case} per-block cudaMemcpyAsync"),
        bytes,
        per_block,
        d2d,
        format!("{} calls", ranges.len()),
    );
    // SAFETY: as above.
    let batch = ctx.time(reps, || unsafe { ctx.backend.memcpy_batch(ranges) })?;
    report.add(
        "pool",
        format!("{case} one cudaMemcpyBatchAsync"),
        bytes,
        batch,
        d2d,
        format!("{} entries", ranges.len()),
    );
    Ok(())
}

pub fn copies(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let max_pages: u64 = if ctx.quick { 2048 } else { 16384 };
    for layout in [LatentLayout::Fp8Trtllm, LatentLayout::Fp8Scaled] {
        let g = CacheGeometry::with_draft(PoolGeometry::new(layout, 61));
        let backend = &ctx.backend;
        let pool = DevicePool::allocate(backend, &g, Placement::unsharded(), 0, max_pages + 1)?;
        let storage = pool.storage().expect("allocated pool").clone();
        ctx.fill_random(&storage)?;
        let staging = Staging::new(&ctx.backend, &g, max_pages)?;
        for pages in [64u64, 512, 4096, 16384]
            .into_iter()
            .filter(|&p| p <= max_pages)
        {
            let perm = synth::permutation(&mut ctx.rng, max_pages as usize);
            let ids: Vec<i64> = perm[..pages as usize].iter().map(|p| p + 1).collect();
            let local: Vec<u64> = ids.iter().map(|&p| p as u64).collect();
            let positions: Vec<u64> = (0..pages).collect();
            let reps = ctx.reps(if pages >= 4096 { 5 } else { 20 });
            let d2d = ("d2d", ctx.ceilings.d2d);
            let case = format!("{} rows, {pages} pages x 62 layers", layout.row_bytes());

            let plan = BlockCopyPlan::new(
                &pool,
                PageSelection::Local(ids.clone()),
                &staging,
                PageSelection::Positions,
                pages as usize,
            )?;
            let gather = BlockCopy::prepare(&ctx.backend, &plan, &pool, &staging)?;
            let (stats, note) = best_grid(ctx, &gather, reps)?;
            verify(ctx, &pool, &local, &staging, &positions)?;
            report.add(
                "pool",
                format!("{case} gather kernel"),
                plan.bytes(),
                stats,
                d2d,
                note,
            );

            let plan = BlockCopyPlan::new(
                &staging,
                PageSelection::Positions,
                &pool,
                PageSelection::Local(ids.clone()),
                pages as usize,
            )?;
            let scatter = BlockCopy::prepare(&ctx.backend, &plan, &staging, &pool)?;
            let (stats, note) = best_grid(ctx, &scatter, reps)?;
            verify(ctx, &staging, &positions, &pool, &local)?;
            report.add(
                "pool",
                format!("{case} scatter kernel"),
                plan.bytes(),
                stats,
                d2d,
                note,
            );

            if pages <= 2048 {
                let ranges = block_ranges(&pool, &local, &staging, &positions);
                alternatives(
                    ctx,
                    report,
                    &format!("{case} gather"),
                    &ranges,
                    plan.bytes(),
                )?;
            }
        }
    }
    Ok(())
}

pub fn write_path(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let g = CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 61));
    for n in [1u32, 4, 8] {
        for tokens in [4096usize, 16384, 65536] {
            if ctx.quick && tokens > 16384 {
                continue;
            }
            let placement = Placement::new(n)?;
            let pages_per_rank = (tokens / 64).div_ceil(n as usize) as u64 + 2;
            let pool = DevicePool::allocate(&ctx.backend, &g, placement, 0, pages_per_rank)?;
            let staging = ChunkStaging::new(&ctx.backend, &pool, tokens)?;
            let staged = staging.buffer().clone();
            ctx.fill_random(&staged)?;
            // A chunk of whole pages at random non-reserved logical pages.
            let logical = placement.logical_pages(pages_per_rank) as usize - n as usize;
            let perm = synth::permutation(&mut ctx.rng, logical);
            let slots: Vec<i64> = (0..tokens)
                .map(|i| (perm[i / 64] + i64::from(n)) * 64 + (i % 64) as i64)
                .collect();
            let owned = slots
                .iter()
                .filter(|&&s| placement.slot_owner(s as u64) == 0)
                .count() as u64;
            let slot_buf = kvshard::backend::upload_i64s(&ctx.backend, &slots)?;
            let write = OwnedRowWrite::prepare(&ctx.backend, &staging, &pool, |_| true)?;
            let bytes = owned * write.row_bytes();
            let floor_ms = bytes as f64 / (ctx.ceilings.d2d * 1e6);
            let launch = write.launch(tokens);
            let stats = ctx.time(ctx.reps(20), || {
                write.run(&ctx.backend, &slot_buf, tokens, launch)
            })?;
            ctx.backend.synchronize()?;
            report.add(
                "write",
                format!(
                    "N={n} rank 0, {tokens}-token chunk, 62 layers latent+indexer, {} CTAs",
                    launch.ctas
                ),
                bytes,
                stats,
                ("d2d", ctx.ceilings.d2d),
                format!(
                    "{:.2}x the byte floor ({floor_ms:.3} ms)",
                    stats.median / floor_ms
                ),
            );
        }
    }
    Ok(())
}
