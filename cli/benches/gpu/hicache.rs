//! HiCache I/O (issue 6): device pool <-> pinned host pool for every host layout, both
//! directions, every I/O backend (SM kernel at 1/2/4/8/16 CTAs, copy engine, one
//! cudaMemcpyAsync per block, one cudaMemcpyBatchAsync) and the staged path (both relayouts),
//! next to the in-run copy-engine ceilings; per-layer loads; one-launch signalled loads and
//! when layer 0 is consumable; a load and a backup at the same time.

use std::sync::Arc;

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Launch, MemoryKind};
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::hicache::{
    CacheNode, HiCacheController, HostLayout, HostPool, HostTransfer, Route, StagedIo, Streams,
    TransferPlan, WritePolicy, DEFAULT_STAGING_PAGES,
};
use kvshard::index::{LogicalPage, ModelLayer, StoredLayer};
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::{Error, Result};
use kvshard_cli::synth;
use rand::Rng;

use crate::harness::{Ctx, Report};
use kvshard::copy::{Direction, LayerSignals, Layers, Method};

/// CTAs of the staged path's relayout kernel: device-to-device at HBM speed, so a few CTAs
/// outpace PCIe.
pub const STAGED_CTAS: u32 = 8;

pub fn geometry() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 61))
}

/// A device pool of `pages + 1` pages (page 0 is padding) filled with random bytes.
pub fn device_pool(ctx: &mut Ctx, pages: u64) -> Result<Arc<DevicePool>> {
    let pool = DevicePool::allocate(
        ctx.backend.as_ref(),
        &geometry(),
        Placement::unsharded(),
        0,
        pages + 1,
    )?;
    let storage = pool
        .storage()
        .ok_or_else(|| Error::HiCache("an allocated pool has storage".into()))?
        .clone();
    ctx.fill_random(&storage)?;
    Ok(Arc::new(pool))
}

/// A pinned host pool of `pages + 1` pages filled with random bytes.
pub fn host_pool(ctx: &mut Ctx, pages: u64, layout: HostLayout) -> Result<Arc<HostPool>> {
    let host = HostPool::new(ctx.backend.as_ref(), &geometry(), pages + 1, layout)?;
    for c in geometry().components() {
        let buf = host.buffer(c.component)?.clone();
        ctx.fill_random(&buf)?;
    }
    Ok(Arc::new(host))
}

/// Logical pages `pages` (the pools are unsharded: logical and local pages coincide).
pub fn logical(pages: impl IntoIterator<Item = u64>) -> Vec<LogicalPage> {
    pages.into_iter().map(LogicalPage).collect()
}

/// Random device pages paired with the first `n` host pages (what a fresh host allocator gives).
pub fn plan(ctx: &mut Ctx, n: usize, device_pages: u64, host_pages: u64) -> Result<TransferPlan> {
    let perm = synth::permutation(&mut ctx.rng, device_pages as usize - 1);
    let device = logical(perm[..n].iter().map(|&p| p as u64 + 1));
    let host = logical(1..=n as u64);
    TransferPlan::new(
        Placement::unsharded(),
        0,
        &device,
        &host,
        device_pages,
        host_pages,
    )
}

/// Compares the first and last row of 24 random (entry, component, layer) blocks of a finished
/// transfer on both sides.
pub fn verify(
    backend: &dyn Backend,
    rng: &mut impl Rng,
    pool: &DevicePool,
    host: &HostPool,
    plan: &TransferPlan,
) -> Result<()> {
    if plan.is_empty() {
        return Ok(());
    }
    let comps = pool.geometry().components();
    for _ in 0..24 {
        let j = rng.random_range(0..plan.len());
        let comp = &comps[rng.random_range(0..comps.len())];
        let l = StoredLayer(rng.random_range(0..comp.layers()));
        let (dp, hp) = (plan.device_pages()[j], plan.host_pages()[j]);
        let block = pool.read_block_sync(backend, comp.component, l, dp)?;
        let host_buffer = host.buffer(comp.component)?;
        for r in [0, comp.rows - 1] {
            let bytes = comp.row_bytes;
            let dev = &block[r * bytes..(r + 1) * bytes];
            let at = host.row_addr(comp.component, l, hp, r)? - host_buffer.addr();
            let hst = backend.read_sync(host_buffer, at as usize, bytes)?;
            if dev != hst.as_slice() {
                return Err(Error::HiCache(format!(
                    "benchmark transfer wrong: entry {j} {} {l} row {r}",
                    comp.component
                )));
            }
        }
    }
    Ok(())
}

/// The pinned copy ceiling of a direction.
pub fn ceiling(ctx: &Ctx, dir: Direction) -> (&'static str, f64) {
    match dir {
        Direction::Load => ("h2d", ctx.ceilings.h2d),
        Direction::Backup => ("d2h", ctx.ceilings.d2h),
    }
}

/// A transfer of `plan` with its own staging of `chunk` pages (and, for a kernel relayout, the
/// relayout's tables), ready for `run_staged`.
///
/// Each staging gets a transfer of its own: a `HostTransfer` prepares its kernel relayout once,
/// for the staging it is first given, and would run it against that staging's buffers with any
/// later one (see the report's library notes).
pub fn staged(
    backend: &dyn Backend,
    pool: &Arc<DevicePool>,
    host: &Arc<HostPool>,
    plan: &TransferPlan,
    dir: Direction,
    chunk: u64,
    how: Method,
) -> Result<(HostTransfer, StagedIo)> {
    let mut t = HostTransfer::new(pool.clone(), host.clone(), plan.clone(), dir)?;
    let staging = t.staging(backend, chunk)?;
    if let Method::Kernel(_) = how {
        t.prepare_staged_sync(backend, &staging, &mut Vec::new())?;
    }
    Ok((t, staging))
}

/// The route `Route::auto` picks for `t`'s direction and pages, timed as the rows before it
/// (the staged one with the controller's default staging), next to `best`, the fastest
/// median of the case: the rule is meant to stay within 3% of it (flagged `AUTO>3%` beyond).
fn auto_pick(
    ctx: &mut Ctx,
    report: &mut Report,
    t: &HostTransfer,
    (pool, host, plan, other): (
        &Arc<DevicePool>,
        &Arc<HostPool>,
        &TransferPlan,
        &CudaBackend,
    ),
    best: f64,
) -> Result<()> {
    let b = ctx.backend.as_ref();
    let (dir, pages) = (t.direction(), t.plan().len());
    let route = Route::auto(dir, pages, host.layout(), b);
    let reps = ctx.reps(if pages >= 2048 { 3 } else { 8 });
    let stats = match route {
        Route::Direct(io) => ctx.time(reps, || t.run(ctx.backend.as_ref(), io, Layers::All))?,
        Route::Staged(how) => {
            let (st, staging) = staged(b, pool, host, plan, dir, DEFAULT_STAGING_PAGES, how)?;
            ctx.time(reps, || {
                st.run_staged(ctx.backend.as_ref(), other, &staging, how)
            })?
        }
        Route::Auto => return Err(Error::Verification("Route::auto picked Auto".into())),
    };
    verify(ctx.backend.as_ref(), &mut ctx.rng, pool, host, plan)?;
    let gap = 100.0 * (1.0 - best / stats.median);
    let flag = if gap > 3.0 { " AUTO>3%" } else { "" };
    report.add(
        "hicache",
        format!(
            "{:?} {dir:?} {pages}p x 62 layers, auto ({route})",
            host.layout()
        ),
        t.bytes(Layers::All)?,
        stats,
        ceiling(ctx, dir),
        format!("Route::auto's pick; {gap:.1}% below the fastest row of the case{flag}"),
    );
    Ok(())
}

/// One contiguous copy of a case's bytes between pinned host memory and the device, timed as
/// every row is: the ceiling of that size (a copy of 180 MB does not reach the 1 GiB ceiling's
/// rate: its ramp and the timing's fixed cost weigh more), against which a route's gap to
/// the ceiling is its own.
fn same_bytes_copy(
    ctx: &mut Ctx,
    report: &mut Report,
    bytes: u64,
    dir: Direction,
    pages: usize,
) -> Result<()> {
    let b = ctx.backend.as_ref();
    let len = usize::try_from(bytes).map_err(|_| Error::InvalidArgument("bytes".into()))?;
    let (host, device) = (
        b.alloc(len, MemoryKind::PinnedHost)?,
        b.alloc(len, MemoryKind::Device)?,
    );
    let (src, dst) = match dir {
        Direction::Load => (&host, &device),
        Direction::Backup => (&device, &host),
    };
    let stats = ctx.time(ctx.reps(8), || {
        // SAFETY: two live allocations of `len` bytes of this backend, held until every timed
        // run has been waited for (ctx.time returns after the last).
        unsafe { ctx.backend.memcpy(dst.addr(), src.addr(), len) }
    })?;
    ctx.raise_ceiling(
        report,
        dir,
        kvshard_cli::measure::gbps(bytes, stats.min),
        bytes,
    );
    report.add(
        "hicache",
        format!("{dir:?} {pages}p x 62 layers, one contiguous copy of the same bytes"),
        bytes,
        stats,
        ceiling(ctx, dir),
        "the size's own ceiling: no layout, no pages, one cudaMemcpyAsync".to_string(),
    );
    Ok(())
}

/// The model layers a layer-by-layer consumer loads one call each: every readiness group once
/// (the MTP draft's layer loads with target layer 0).
pub fn layer_groups(t: &HostTransfer) -> Vec<ModelLayer> {
    (0..t.model_layers())
        .map(ModelLayer)
        .filter(|&m| t.group(m) == m)
        .collect()
}

pub fn io(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let max_pages: u64 = if ctx.quick { 512 } else { 2048 };
    let pool = device_pool(ctx, max_pages)?;
    let other = CudaBackend::new(ctx.gpu.clone())?;
    for layout in [
        HostLayout::LayerFirst,
        HostLayout::PageFirstDirect,
        HostLayout::PageFirst,
    ] {
        let host = host_pool(ctx, max_pages, layout)?;
        for pages in [64usize, 512, 2048]
            .into_iter()
            .filter(|&p| p as u64 <= max_pages)
        {
            let plan = plan(ctx, pages, max_pages + 1, max_pages + 1)?;
            for dir in [Direction::Load, Direction::Backup] {
                let mut t = HostTransfer::new(pool.clone(), host.clone(), plan.clone(), dir)?;
                t.prepare_kernel_sync(ctx.backend.as_ref(), &mut Vec::new())?;
                let bytes = t.bytes(Layers::All)?;
                if layout == HostLayout::LayerFirst {
                    same_bytes_copy(ctx, report, bytes, dir, pages)?;
                }
                let mut ios = vec![Method::CopyEngine];
                ios.extend(
                    [1, 2, 4, 8, 16].map(|ctas| Method::host_io(ctx.backend.as_ref(), ctas)),
                );
                if pages <= 512 {
                    ios.push(Method::PerBlock);
                    // Token-major page_first makes the batch one entry per 576-byte row (~250K at
                    // 64 pages); driver 580 crashed the process on it (BENCHMARKS.md).
                    if layout != HostLayout::PageFirst {
                        ios.push(Method::BatchedCopyEngine);
                    }
                }
                // The fastest row of this case (median time), for the automatic pick below.
                let mut best = f64::INFINITY;
                for io in ios {
                    let host_bound = matches!(io, Method::PerBlock | Method::BatchedCopyEngine);
                    let reps = ctx.reps(if host_bound || pages >= 2048 { 3 } else { 8 });
                    let stats = ctx.time(reps, || t.run(ctx.backend.as_ref(), io, Layers::All))?;
                    best = best.min(stats.median);
                    verify(ctx.backend.as_ref(), &mut ctx.rng, &pool, &host, &plan)?;
                    let calls = t.calls(io, Layers::All)?;
                    report.add(
                        "hicache",
                        format!("{layout:?} {dir:?} {pages}p x 62 layers, {io}"),
                        bytes,
                        stats,
                        ceiling(ctx, dir),
                        format!(
                            "{} launches, {} memcpy, {} 2D, {} batch calls / {} entries",
                            calls.launches,
                            calls.memcpy,
                            calls.memcpy_2d,
                            calls.batch_calls,
                            calls.batch_entries
                        ),
                    );
                }
                let mut staged_cases = vec![
                    (16u64, Method::host_io(ctx.backend.as_ref(), STAGED_CTAS)),
                    (64, Method::host_io(ctx.backend.as_ref(), STAGED_CTAS)),
                ];
                if layout != HostLayout::PageFirst {
                    staged_cases.push((32, Method::CopyEngine));
                }
                // Small loads (issue 25, goal 5): do smaller chunks or a wider relayout shorten
                // the pipeline's first copy and last relayout, which a 64-page load cannot hide?
                staged_cases.push((16, Method::host_io(ctx.backend.as_ref(), 32)));
                if pages == 64 && dir == Direction::Load {
                    for (chunk, ctas) in [(16, 64), (8, 32)] {
                        staged_cases.push((chunk, Method::host_io(ctx.backend.as_ref(), ctas)));
                    }
                }
                for (chunk, how) in staged_cases {
                    let (st, staging) =
                        staged(ctx.backend.as_ref(), &pool, &host, &plan, dir, chunk, how)?;
                    let stats = ctx.time(ctx.reps(if pages >= 2048 { 3 } else { 8 }), || {
                        st.run_staged(ctx.backend.as_ref(), &other, &staging, how)
                    })?;
                    best = best.min(stats.median);
                    verify(ctx.backend.as_ref(), &mut ctx.rng, &pool, &host, &plan)?;
                    report.add(
                        "hicache",
                        format!("{layout:?} {dir:?} {pages}p x 62 layers, staged copy-engine ({chunk}-page chunks, {how:?} relayout)"),
                        bytes,
                        stats,
                        ceiling(ctx, dir),
                        format!(
                            "{:.0} MB device staging, relayout on a second stream",
                            staging.bytes() as f64 / 1e6
                        ),
                    );
                }
                auto_pick(ctx, report, &t, (&pool, &host, &plan, &other), best)?;
                if dir == Direction::Load && pages == 512 {
                    per_layer_load(ctx, report, &t, layout)?;
                    verify(ctx.backend.as_ref(), &mut ctx.rng, &pool, &host, &plan)?;
                }
            }
        }
        if layout == HostLayout::PageFirstDirect {
            controller_loads(ctx, report, &pool, &host, max_pages)?;
        }
    }
    Ok(())
}

/// What an engine sees: `HiCacheController::load` timed from the call (planning, table
/// uploads, enqueueing and the copy) to the bytes landed, on a node backed up beforehand, with
/// the automatic route and the two it chooses between. The controller's load stream is the
/// harness stream, so the timing's events bracket the whole load.
fn controller_loads(
    ctx: &mut Ctx,
    report: &mut Report,
    pool: &Arc<DevicePool>,
    host: &Arc<HostPool>,
    max_pages: u64,
) -> Result<()> {
    let b: Arc<dyn Backend> = ctx.backend.clone();
    let gpu = ctx.gpu.clone();
    let other = || -> Result<Arc<dyn Backend>> { Ok(Arc::new(CudaBackend::new(gpu.clone())?)) };
    let streams = Streams {
        load: b.clone(),
        backup: other()?,
        load_relayout: other()?,
        backup_relayout: other()?,
        tables: other()?,
    };
    let mut ctl = HiCacheController::new(
        pool.clone(),
        host.clone(),
        streams,
        WritePolicy::WriteThrough,
    )?;
    ctl.prepare_staging()?;
    for (id, pages) in [64usize, 512]
        .into_iter()
        .filter(|&p| p as u64 <= max_pages)
        .enumerate()
    {
        let perm = synth::permutation(&mut ctx.rng, max_pages as usize);
        let node = CacheNode {
            id: id as u64,
            device_pages: logical(perm[..pages].iter().map(|&p| p as u64 + 1)),
            start_owner: None,
        };
        ctl.backup(&node, &b.record()?, Route::Auto)?;
        ctl.ack_backups_sync(1)?;
        let host_pages = ctl
            .host_pages(node.id)
            .ok_or_else(|| Error::HiCache("an acked backup has host pages".into()))?
            .to_vec();
        let plan = TransferPlan::new(
            Placement::unsharded(),
            0,
            &node.device_pages,
            &host_pages,
            max_pages + 1,
            max_pages + 1,
        )?;
        let bytes = HostTransfer::new(pool.clone(), host.clone(), plan.clone(), Direction::Load)?
            .bytes(Layers::All)?;
        let routes = [
            Route::Auto,
            Route::Direct(Method::host_io(b.as_ref(), 2)),
            Route::Staged(Method::host_io(b.as_ref(), STAGED_CTAS)),
        ];
        for route in routes {
            let picked = match route {
                Route::Auto => format!(
                    "auto: {}",
                    Route::auto(Direction::Load, pages, host.layout(), b.as_ref())
                ),
                r => r.to_string(),
            };
            let reps = ctx.reps(8);
            let stats = ctx.time(reps, || {
                ctl.load(node.id, &node.device_pages, None, route)
                    .map(|_| ())
            })?;
            let pending = ctl.pending_loads();
            ctl.ack_loads_sync(pending)?;
            verify(b.as_ref(), &mut ctx.rng, pool, host, &plan)?;
            report.add(
                "hicache",
                format!("PageFirstDirect controller load {pages}p x 62 layers, HiCacheController::load ({picked})"),
                bytes,
                stats,
                ceiling(ctx, Direction::Load),
                "from the call: planning, table uploads, enqueueing and the copy; staging made up front".into(),
            );
        }
        ctl.free_host(node.id)?;
    }
    Ok(())
}

/// Every readiness group loaded by its own call (what a layer-by-layer consumer does: the MTP
/// draft's layer comes with target layer 0), on the copy engine with an event per call, and on
/// the SM kernel.
fn per_layer_load(
    ctx: &Ctx,
    report: &mut Report,
    t: &HostTransfer,
    layout: HostLayout,
) -> Result<()> {
    let bytes = t.bytes(Layers::All)?;
    let groups = layer_groups(t);
    for io in [Method::CopyEngine, Method::host_io(ctx.backend.as_ref(), 4)] {
        let stats = ctx.time(ctx.reps(5), || {
            for &m in &groups {
                t.run(ctx.backend.as_ref(), io, Layers::One(m))?;
                ctx.backend.record()?;
            }
            Ok(())
        })?;
        report.add(
            "hicache",
            format!(
                "{layout:?} per-layer Load 512p, {} calls + events ({} model layers), {io}",
                groups.len(),
                t.model_layers()
            ),
            bytes,
            stats,
            ceiling(ctx, Direction::Load),
            String::new(),
        );
    }
    Ok(())
}

/// A 16-page load of every layer in one launch with per-layer ready counters; when a consumer
/// stream can start on layer 0 and on the last layer to land.
pub fn signalled(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let pool = device_pool(ctx, 1024)?;
    let host = host_pool(ctx, 1024, HostLayout::LayerFirst)?;
    let consumer = CudaBackend::new(ctx.gpu.clone())?;
    for (pages, ctas_list) in [(16usize, vec![2u32, 4, 8]), (1024, vec![4])] {
        let plan = plan(ctx, pages, 1025, 1025)?;
        let mut t = HostTransfer::new(pool.clone(), host.clone(), plan, Direction::Load)?;
        t.prepare_kernel_sync(ctx.backend.as_ref(), &mut Vec::new())?;
        let bytes = t.bytes(Layers::All)?;
        let model_layers = t.model_layers();
        // The last readiness group lands last (pairs run layer-major); the draft's layer is
        // ready with layer 0.
        let last = layer_groups(&t)
            .last()
            .copied()
            .ok_or_else(|| Error::HiCache("a cache of no layers".into()))?;
        for ctas in ctas_list {
            let mut signals = LayerSignals::new(ctx.backend.as_ref(), model_layers)?;
            let stats = ctx.time(ctx.reps(10), || {
                t.run_signalled(
                    ctx.backend.as_ref(),
                    Launch::host_io(ctx.backend.as_ref(), ctas),
                    &mut signals,
                )
                .map(drop)
            })?;
            verify(ctx.backend.as_ref(), &mut ctx.rng, &pool, &host, t.plan())?;
            report.add(
                "hicache",
                format!("signalled Load {pages}p x 62 layers, one launch, {ctas} CTAs"),
                bytes,
                stats,
                ("h2d", ctx.ceilings.h2d),
                String::new(),
            );
            // When is each layer consumable? Events on the consumer after waiting on counters.
            let start = ctx.gpu.new_event(true)?;
            let first = ctx.gpu.new_event(true)?;
            let done = ctx.gpu.new_event(true)?;
            ctx.backend.stream().record(&start)?;
            let waits = t.run_signalled(
                ctx.backend.as_ref(),
                Launch::host_io(ctx.backend.as_ref(), ctas),
                &mut signals,
            )?;
            waits[0].wait(&consumer)?;
            consumer.stream().record(&first)?;
            waits[last.0].wait(&consumer)?;
            consumer.stream().record(&done)?;
            consumer.synchronize()?;
            ctx.backend.synchronize()?;
            let ms = |e: &cudarc::driver::CudaEvent| -> Result<f64> {
                start
                    .elapsed_ms(e)
                    .map(f64::from)
                    .map_err(|source| Error::Driver {
                        call: "cuEventElapsedTime",
                        source,
                    })
            };
            let (t0, tl) = (ms(&first)?, ms(&done)?);
            println!(
                "hicache      {pages}p signalled load, {ctas} CTAs: layer 0 (with the draft) consumable at {t0:.3} ms, layer {} at {tl:.3} ms",
                last.0
            );
            report.header.push(format!(
                "signalled load of {pages} pages, {ctas} CTAs: layer 0 (with the draft) consumable at {t0:.3} ms, the last layer ({}) at {tl:.3} ms after the launch was enqueued",
                last.0
            ));
        }
    }
    Ok(())
}

/// A load and a backup of 512 pages each at the same time, on two streams.
pub fn duplex(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let pool = device_pool(ctx, 1024)?;
    let other = CudaBackend::new(ctx.gpu.clone())?;
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirstDirect] {
        let host = host_pool(ctx, 1024, layout)?;
        // Disjoint pages on both sides: the load fills pages the backup does not read.
        let perm = synth::permutation(&mut ctx.rng, 1024);
        let dev = logical(perm.iter().map(|&p| p as u64 + 1));
        let load_plan = TransferPlan::new(
            Placement::unsharded(),
            0,
            &dev[..512],
            &logical(1..=512),
            1025,
            1025,
        )?;
        let backup_plan = TransferPlan::new(
            Placement::unsharded(),
            0,
            &dev[512..],
            &logical(513..=1024),
            1025,
            1025,
        )?;
        let load = HostTransfer::new(
            pool.clone(),
            host.clone(),
            load_plan.clone(),
            Direction::Load,
        )?;
        let backup = HostTransfer::new(
            pool.clone(),
            host.clone(),
            backup_plan.clone(),
            Direction::Backup,
        )?;
        let bytes = load.bytes(Layers::All)? + backup.bytes(Layers::All)?;
        let stats = ctx.time(ctx.reps(8), || {
            let fork = ctx.backend.record()?;
            other.wait(&fork)?;
            load.run(ctx.backend.as_ref(), Method::CopyEngine, Layers::All)?;
            backup.run(&other, Method::CopyEngine, Layers::All)?;
            let join = other.record()?;
            ctx.backend.wait(&join)
        })?;
        verify(ctx.backend.as_ref(), &mut ctx.rng, &pool, &host, &load_plan)?;
        verify(
            ctx.backend.as_ref(),
            &mut ctx.rng,
            &pool,
            &host,
            &backup_plan,
        )?;
        report.add(
            "hicache",
            format!("{layout:?} Load 512p + Backup 512p at once, copy-engine"),
            bytes,
            stats,
            ("h2d+d2h", ctx.ceilings.bidir),
            String::new(),
        );
        let relayout_load = CudaBackend::new(ctx.gpu.clone())?;
        let relayout_backup = CudaBackend::new(ctx.gpu.clone())?;
        for (chunk, how) in [
            (32, Method::host_io(ctx.backend.as_ref(), STAGED_CTAS)),
            (128, Method::host_io(ctx.backend.as_ref(), STAGED_CTAS)),
            (32, Method::CopyEngine),
        ] {
            let (load, load_staging) = staged(
                ctx.backend.as_ref(),
                &pool,
                &host,
                &load_plan,
                Direction::Load,
                chunk,
                how,
            )?;
            let (backup, backup_staging) = staged(
                ctx.backend.as_ref(),
                &pool,
                &host,
                &backup_plan,
                Direction::Backup,
                chunk,
                how,
            )?;
            let stats = ctx.time(ctx.reps(8), || {
                let fork = ctx.backend.record()?;
                other.wait(&fork)?;
                load.run_staged(ctx.backend.as_ref(), &relayout_load, &load_staging, how)?;
                backup.run_staged(&other, &relayout_backup, &backup_staging, how)?;
                let join = other.record()?;
                ctx.backend.wait(&join)
            })?;
            verify(ctx.backend.as_ref(), &mut ctx.rng, &pool, &host, &load_plan)?;
            verify(
                ctx.backend.as_ref(),
                &mut ctx.rng,
                &pool,
                &host,
                &backup_plan,
            )?;
            report.add(
                "hicache",
                format!("{layout:?} Load 512p + Backup 512p at once, staged copy-engine ({chunk}-page chunks, {how:?} relayout)"),
                bytes,
                stats,
                ("h2d+d2h", ctx.ceilings.bidir),
                String::new(),
            );
        }
    }
    Ok(())
}
