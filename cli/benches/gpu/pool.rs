//! Device pool copies (issue 4): gather, scatter and pool-to-pool of scattered pages, all 61
//! target layers plus the draft, latent and indexer, against one cudaMemcpyAsync per
//! (page, layer) block, one cudaMemcpyBatchAsync call, and the in-run D2D ceiling; and the
//! owned-row write path against its byte floor.

use std::sync::Arc;

use kvshard::abi;
use kvshard::backend::{upload_i64s_sync, Backend, Buffer, Launch};
use kvshard::copy::{BlockCopy, BlockCopyPlan, BlockSpace, PageSelection, Staging};
use kvshard::geometry::{CacheGeometry, Component, LatentLayout, PoolGeometry, PAGE_SIZE};
use kvshard::index::{LocalPage, Slot, StoredLayer};
use kvshard::pool::{ChunkStaging, DevicePool, OwnedRowWrite};
use kvshard::shard::Placement;
use kvshard::{Error, Result};
use kvshard_cli::synth::{self, POISON};
use rand::Rng;

use crate::harness::{Ctx, Report, Timed};

/// Grids tried for the D2D kernels: (CTAs per SM, threads).
const GRIDS: [(u32, u32); 3] = [(1, 1024), (2, 512), (4, 256)];

/// One side of a copy as the checks read it: the space, and one buffer covering all of it.
#[derive(Clone, Copy)]
pub struct Side<'a> {
    pub space: &'a dyn BlockSpace,
    pub whole: &'a Buffer,
}

impl Side<'_> {
    /// The bytes of block (`component`, `layer`, `page`), at the address the space itself
    /// gives (checked against its pages and layers), read out of the covering buffer.
    fn block(
        &self,
        backend: &dyn Backend,
        component: Component,
        layer: StoredLayer,
        page: LocalPage,
    ) -> Result<Vec<u8>> {
        let c = self.space.component_index(component)?;
        let bytes = self.space.components()[c].block_bytes;
        let addr = self.space.block_addr(component, layer, page)?;
        let offset = addr.checked_sub(self.whole.addr()).ok_or_else(|| {
            Error::InvalidArgument(format!("block at {addr:#x} below its buffer"))
        })?;
        backend.read_sync(self.whole, offset as usize, bytes)
    }
}

/// The allocation behind a pool the benchmark allocated.
fn storage(pool: &DevicePool) -> Result<&Buffer> {
    pool.storage()
        .ok_or_else(|| Error::InvalidArgument("benchmark pools are allocated by kvshard".into()))
}

/// Compares 48 random (entry, component, layer) blocks of a finished copy.
pub fn verify(
    backend: &dyn Backend,
    rng: &mut impl Rng,
    src: Side<'_>,
    src_pages: &[LocalPage],
    dst: Side<'_>,
    dst_pages: &[LocalPage],
) -> Result<()> {
    let components = src.space.components();
    for _ in 0..48 {
        let j = rng.random_range(0..src_pages.len());
        let comp = &components[rng.random_range(0..components.len())];
        let l = StoredLayer(rng.random_range(0..comp.layers()));
        if src.block(backend, comp.component, l, src_pages[j])?
            != dst.block(backend, comp.component, l, dst_pages[j])?
        {
            return Err(Error::InvalidArgument(format!(
                "benchmark copy wrong at entry {j} {} {l}",
                comp.component
            )));
        }
    }
    Ok(())
}

/// Times the kernel at every grid of [`GRIDS`]; returns the best and a note listing all.
fn best_grid(ctx: &Ctx, copy: &BlockCopy, reps: usize) -> Result<(Timed, String)> {
    let sms = ctx.gpu.info().sm_count;
    let mut best: Option<Timed> = None;
    let mut note = String::from("grids");
    for (per_sm, threads) in GRIDS {
        let launch = Launch {
            ctas: sms * per_sm,
            threads,
        };
        let s = ctx.time(reps, || copy.run(ctx.backend.as_ref(), launch))?;
        note.push_str(&format!(" {}x{}:{:.3}ms", launch.ctas, threads, s.median));
        if best.is_none_or(|b| s.median < b.median) {
            best = Some(s);
        }
    }
    best.map(|b| (b, note))
        .ok_or_else(|| Error::InvalidArgument("no grid timed".into()))
}

/// Every (page, layer) block of a copy as a range, at the addresses the spaces give.
fn block_ranges(
    src: &dyn BlockSpace,
    src_pages: &[LocalPage],
    dst: &dyn BlockSpace,
    dst_pages: &[LocalPage],
) -> Result<Vec<abi::kvs_range>> {
    let mut out = Vec::new();
    for comp in src.components() {
        for l in (0..comp.layers()).map(StoredLayer) {
            for (&s, &d) in src_pages.iter().zip(dst_pages) {
                out.push(abi::kvs_range {
                    src: src.block_addr(comp.component, l, s)?,
                    dst: dst.block_addr(comp.component, l, d)?,
                    bytes: comp.block_bytes as u64,
                });
            }
        }
    }
    Ok(out)
}

/// The two copy-engine baselines over `ranges`; `dst` is poisoned before each and `check`ed
/// after it.
fn alternatives(
    ctx: &mut Ctx,
    report: &mut Report,
    case: &str,
    ranges: &[abi::kvs_range],
    bytes: u64,
    dst: &Buffer,
    check: impl Fn(&mut Ctx) -> Result<()>,
) -> Result<()> {
    let d2d = ("d2d", ctx.ceilings.d2d);
    let reps = ctx.reps(3);
    ctx.backend.fill(dst, POISON)?;
    let per_block = ctx.time(reps, || {
        ranges.iter().try_for_each(|r| {
            // SAFETY: every range is a whole block of the live pool or staging (addresses from
            // `block_addr`, checked against their pages and layers), all of this GPU.
            unsafe { ctx.backend.memcpy(r.dst, r.src, r.bytes as usize) }
        })
    })?;
    check(ctx)?;
    report.add(
        "pool",
        format!("{case} per-block cudaMemcpyAsync"),
        bytes,
        per_block,
        d2d,
        format!("{} calls", ranges.len()),
    );
    ctx.backend.fill(dst, POISON)?;
    // SAFETY: as above.
    let batch = ctx.time(reps, || unsafe { ctx.backend.memcpy_batch(ranges) })?;
    check(ctx)?;
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

/// The gather and scatter kernels of `pages` random pages (of `max_pages`, past the padding
/// page) between `pool` and `staging`, the
/// best grid of each, and (up to 2,048 pages) the alternatives to the gather.
fn copies_case(
    ctx: &mut Ctx,
    report: &mut Report,
    layout: LatentLayout,
    (pool, pool_side): (&Arc<DevicePool>, Side<'_>),
    (staging, staging_side): (&Arc<Staging>, Side<'_>),
    (pages, max_pages): (u64, u64),
) -> Result<()> {
    // Distinct random pages past the padding page 0.
    let perm = synth::permutation(&mut ctx.rng, max_pages as usize);
    let local: Vec<LocalPage> = perm[..pages as usize]
        .iter()
        .map(|&p| LocalPage(p as u64 + 1))
        .collect();
    let positions: Vec<LocalPage> = (0..pages).map(LocalPage).collect();
    let reps = ctx.reps(if pages >= 4096 { 5 } else { 20 });
    let d2d = ("d2d", ctx.ceilings.d2d);
    let case = format!("{} rows, {pages} pages x 62 layers", layout.row_bytes());

    let plan = BlockCopyPlan::new(
        pool.as_ref(),
        PageSelection::Local(local.clone()),
        staging.as_ref(),
        PageSelection::Positions,
        pages as usize,
    )?;
    let gather = BlockCopy::prepare_sync(
        ctx.backend.as_ref(),
        plan,
        pool.clone(),
        staging.clone(),
        None,
    )?;
    let (stats, note) = best_grid(ctx, &gather, reps)?;
    verify(
        ctx.backend.as_ref(),
        &mut ctx.rng,
        pool_side,
        &local,
        staging_side,
        &positions,
    )?;
    report.add(
        "pool",
        format!("{case} gather kernel"),
        gather.bytes(),
        stats,
        d2d,
        note,
    );
    // The gather's tables, for the scatter: every run of the gather has completed.
    let tables = gather.into_tables();

    let plan = BlockCopyPlan::new(
        staging.as_ref(),
        PageSelection::Positions,
        pool.as_ref(),
        PageSelection::Local(local.clone()),
        pages as usize,
    )?;
    let scatter = BlockCopy::prepare_sync(
        ctx.backend.as_ref(),
        plan,
        staging.clone(),
        pool.clone(),
        tables,
    )?;
    let (stats, note) = best_grid(ctx, &scatter, reps)?;
    verify(
        ctx.backend.as_ref(),
        &mut ctx.rng,
        staging_side,
        &positions,
        pool_side,
        &local,
    )?;
    report.add(
        "pool",
        format!("{case} scatter kernel"),
        scatter.bytes(),
        stats,
        d2d,
        note,
    );

    if pages <= 2048 {
        let ranges = block_ranges(pool.as_ref(), &local, staging.as_ref(), &positions)?;
        alternatives(
            ctx,
            report,
            &format!("{case} gather"),
            &ranges,
            scatter.bytes(),
            staging.buffer(),
            |ctx| {
                verify(
                    ctx.backend.as_ref(),
                    &mut ctx.rng,
                    pool_side,
                    &local,
                    staging_side,
                    &positions,
                )
            },
        )?;
    }
    Ok(())
}

pub fn copies(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let max_pages: u64 = if ctx.quick { 2048 } else { 16384 };
    for layout in [LatentLayout::Fp8Trtllm, LatentLayout::Fp8Scaled] {
        let g = CacheGeometry::with_draft(PoolGeometry::new(layout, 61));
        let pool = Arc::new(DevicePool::allocate(
            ctx.backend.as_ref(),
            &g,
            Placement::unsharded(),
            0,
            max_pages + 1,
        )?);
        let pool_buffer = storage(&pool)?.clone();
        ctx.fill_random(&pool_buffer)?;
        let staging = Arc::new(Staging::new(ctx.backend.as_ref(), &g, max_pages)?);
        let pool_side = Side {
            space: pool.as_ref(),
            whole: &pool_buffer,
        };
        let staging_side = Side {
            space: staging.as_ref(),
            whole: staging.buffer(),
        };
        for pages in [64u64, 512, 4096, 16384]
            .into_iter()
            .filter(|&p| p <= max_pages)
        {
            copies_case(
                ctx,
                report,
                layout,
                (&pool, pool_side),
                (&staging, staging_side),
                (pages, max_pages),
            )?;
        }
    }
    Ok(())
}

/// Compares 48 random owned tokens of a finished write, latent rows of random layers: the row
/// the pool holds at the token's local row against the chunk staging's row of the token.
pub fn verify_write(
    backend: &dyn Backend,
    rng: &mut impl Rng,
    pool: &DevicePool,
    staging: &ChunkStaging,
    slots: &[i64],
) -> Result<()> {
    let placement = pool.placement();
    let owned: Vec<usize> = (0..slots.len())
        .filter(|&i| placement.slot_owner(Slot(slots[i] as u64)) == pool.rank())
        .collect();
    if owned.is_empty() {
        return Ok(());
    }
    let pool_buffer = storage(pool)?;
    let latent = pool
        .components()
        .iter()
        .find(|c| c.component == Component::TargetLatent)
        .ok_or_else(|| Error::InvalidArgument("the pool holds no target latent".into()))?;
    let row = latent.row_bytes;
    for _ in 0..48 {
        let i = owned[rng.random_range(0..owned.len())];
        let l = StoredLayer(rng.random_range(0..latent.layers()));
        let local_row = placement.local_row(Slot(slots[i] as u64));
        let page = LocalPage(local_row / PAGE_SIZE as u64);
        let at = pool.block_addr(Component::TargetLatent, l, page)?
            + (local_row % PAGE_SIZE as u64) * row as u64;
        let written = backend.read_sync(pool_buffer, (at - pool_buffer.addr()) as usize, row)?;
        let staged = staging.layer(Component::TargetLatent, l)?;
        if written != backend.read_sync(&staged, i * row, row)? {
            return Err(Error::InvalidArgument(format!(
                "owned-row write wrong: chunk token {i} (slot {}) {l}",
                slots[i]
            )));
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
            let pool = Arc::new(DevicePool::allocate(
                ctx.backend.as_ref(),
                &g,
                placement,
                0,
                pages_per_rank,
            )?);
            let staging = Arc::new(ChunkStaging::new(ctx.backend.as_ref(), &pool, tokens)?);
            let staged = staging.buffer().clone();
            ctx.fill_random(&staged)?;
            // A chunk of whole pages at random non-reserved logical pages.
            let logical = placement.logical_pages(pages_per_rank)? as usize - n as usize;
            let perm = synth::permutation(&mut ctx.rng, logical);
            let slots: Vec<i64> = (0..tokens)
                .map(|i| (perm[i / 64] + i64::from(n)) * 64 + (i % 64) as i64)
                .collect();
            let owned = slots
                .iter()
                .filter(|&&s| placement.slot_owner(Slot(s as u64)) == 0)
                .count() as u64;
            let slot_buf = upload_i64s_sync(ctx.backend.as_ref(), &slots)?;
            let write = OwnedRowWrite::prepare_sync(
                ctx.backend.as_ref(),
                staging.clone(),
                pool.clone(),
                |_| true,
            )?;
            let bytes = owned * write.row_bytes();
            let floor_ms = bytes as f64 / (ctx.ceilings.d2d * 1e6);
            let launch = write.launch(ctx.backend.as_ref(), tokens);
            let stats = ctx.time(ctx.reps(20), || {
                write.run(ctx.backend.as_ref(), &slot_buf, tokens, launch)
            })?;
            // Reports any slot the kernel rejected.
            ctx.backend.synchronize()?;
            verify_write(ctx.backend.as_ref(), &mut ctx.rng, &pool, &staging, &slots)?;
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
