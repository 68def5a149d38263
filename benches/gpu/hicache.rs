//! HiCache I/O (issue 6): device pool <-> pinned host pool for every host layout, both
//! directions, every I/O backend (SM kernel at 1/2/4/8/16 CTAs, copy engine, one
//! cudaMemcpyAsync per block, one cudaMemcpyBatchAsync), next to the in-run copy-engine
//! ceilings; per-layer loads; one-launch signalled loads and when layer 0 is consumable; a load
//! and a backup at the same time.

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Buffer, MemoryKind};
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::hicache::{
    Direction, HostLayout, HostPool, HostTransfer, IoBackend, LayerSignals, Layers, Relayout,
    TransferPlan,
};
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::synth;
use kvshard::{Error, Result};
use rand::Rng;

use crate::harness::{Ctx, Report, Stats};

/// CTAs of the staged path's relayout kernel: device-to-device at HBM speed, so a few CTAs
/// outpace PCIe.
pub const STAGED_CTAS: u32 = 8;

pub fn geometry() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 61))
}

/// A device pool of `pages + 1` pages (page 0 is padding) filled with random bytes.
pub fn device_pool(ctx: &mut Ctx, pages: u64) -> Result<DevicePool> {
    let pool = DevicePool::allocate(
        &ctx.backend,
        &geometry(),
        Placement::unsharded(),
        0,
        pages + 1,
    )?;
    let storage = pool.storage().expect("allocated pool").clone();
    ctx.fill_random(&storage)?;
    Ok(pool)
}

/// A pinned host pool of `pages + 1` pages filled with random bytes.
pub fn host_pool(ctx: &mut Ctx, pages: u64, layout: HostLayout) -> Result<HostPool> {
    let host = HostPool::new(&ctx.backend, &geometry(), pages + 1, layout)?;
    for c in 0..geometry().components().len() {
        let buf = host.buffer(c)?.clone();
        ctx.fill_random(&buf)?;
    }
    Ok(host)
}

/// Random device pages paired with the first `n` host pages (what a fresh host allocator gives).
pub fn plan(ctx: &mut Ctx, n: usize, device_pages: u64, host_pages: u64) -> Result<TransferPlan> {
    let perm = synth::permutation(&mut ctx.rng, device_pages as usize - 1);
    let device: Vec<u64> = perm[..n].iter().map(|&p| p as u64 + 1).collect();
    let host: Vec<u64> = (1..=n as u64).collect();
    TransferPlan::new(
        Placement::unsharded(),
        0,
        &device,
        &host,
        device_pages,
        host_pages,
    )
}

fn row(ctx: &Ctx, addr: u64, len: usize) -> Result<Vec<u8>> {
    // SAFETY: callers pass a row inside a live pool.
    let buf = unsafe { Buffer::from_raw(addr, len, MemoryKind::Device) };
    ctx.backend.read(&buf, 0, len)
}

/// Compares the first and last row of 24 random (entry, component, layer) blocks of a finished
/// transfer on both sides.
fn verify(ctx: &mut Ctx, pool: &DevicePool, host: &HostPool, plan: &TransferPlan) -> Result<()> {
    let comps = pool.geometry().components();
    for _ in 0..24 {
        let j = ctx.rng.random_range(0..plan.len());
        let c = ctx.rng.random_range(0..comps.len());
        let l = ctx.rng.random_range(0..comps[c].layers());
        let (dp, hp) = (plan.device_pages()[j], plan.host_pages()[j]);
        for r in [0, comps[c].rows - 1] {
            let bytes = comps[c].row_bytes;
            let dev = row(ctx, pool.block_addr(c, l, dp)? + (r * bytes) as u64, bytes)?;
            let hst = row(ctx, host.row_addr(c, l, hp, r)?, bytes)?;
            if dev != hst {
                return Err(Error::HiCache(format!(
                    "benchmark transfer wrong: entry {j} component {c} layer {l} row {r}"
                )));
            }
        }
    }
    Ok(())
}

fn ceiling(ctx: &Ctx, dir: Direction) -> (&'static str, f64) {
    match dir {
        Direction::Load => ("h2d", ctx.ceilings.h2d),
        Direction::Backup => ("d2h", ctx.ceilings.d2h),
    }
}

pub fn io(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let max_pages: u64 = if ctx.quick { 512 } else { 2048 };
    let pool = device_pool(ctx, max_pages)?;
    let model_layers = geometry().model_layers();
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
                let mut t = HostTransfer::new(&pool, &host, plan.clone(), dir)?;
                t.prepare_kernel(&ctx.backend, None)?;
                let bytes = t.bytes(Layers::All)?;
                let mut ios = vec![IoBackend::CopyEngine];
                ios.extend([1, 2, 4, 8, 16].map(|ctas| IoBackend::SmKernel { ctas }));
                if pages <= 512 {
                    ios.push(IoBackend::PerBlockMemcpy);
                    // Token-major page_first makes the batch one entry per 576-byte row (~250K at
                    // 64 pages); driver 580 crashed the process on it (BENCHMARKS.md).
                    if layout != HostLayout::PageFirst {
                        ios.push(IoBackend::BatchMemcpy);
                    }
                }
                for io in ios {
                    let host_bound =
                        matches!(io, IoBackend::PerBlockMemcpy | IoBackend::BatchMemcpy);
                    let reps = ctx.reps(if host_bound || pages >= 2048 { 3 } else { 8 });
                    let stats = ctx.time(reps, || t.run(&ctx.backend, io, Layers::All))?;
                    verify(ctx, &pool, &host, &plan)?;
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
                let mut staged = vec![
                    (16u64, Relayout::Kernel { ctas: STAGED_CTAS }),
                    (64, Relayout::Kernel { ctas: STAGED_CTAS }),
                ];
                if layout != HostLayout::PageFirst {
                    staged.push((32, Relayout::CopyEngine));
                }
                for (chunk, how) in staged {
                    let staging = t.staging(&ctx.backend, chunk)?;
                    let stats = ctx.time(ctx.reps(if pages >= 2048 { 3 } else { 8 }), || {
                        t.run_staged(&ctx.backend, &other, &staging, how)
                    })?;
                    verify(ctx, &pool, &host, &plan)?;
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
                if dir == Direction::Load && pages == 512 {
                    per_layer_load(ctx, report, &t, layout, model_layers)?;
                }
            }
        }
    }
    Ok(())
}

/// Every layer loaded by its own call (what a layer-by-layer consumer does), on the copy engine
/// with an event per layer, and on the SM kernel.
fn per_layer_load(
    ctx: &Ctx,
    report: &mut Report,
    t: &HostTransfer<'_>,
    layout: HostLayout,
    model_layers: usize,
) -> Result<()> {
    let bytes = t.bytes(Layers::All)?;
    for io in [IoBackend::CopyEngine, IoBackend::SmKernel { ctas: 4 }] {
        let stats = ctx.time(ctx.reps(5), || {
            for m in 0..model_layers {
                t.run(&ctx.backend, io, Layers::One(m))?;
                ctx.backend.record()?;
            }
            Ok(())
        })?;
        report.add(
            "hicache",
            format!("{layout:?} per-layer Load 512p, {model_layers} calls + events, {io}"),
            bytes,
            stats,
            ceiling(ctx, Direction::Load),
            String::new(),
        );
    }
    Ok(())
}

/// A 16-page load of every layer in one launch with per-layer ready counters; when a consumer
/// stream can start on layer 0 and on the last layer.
pub fn signalled(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let pool = device_pool(ctx, 1024)?;
    let host = host_pool(ctx, 1024, HostLayout::LayerFirst)?;
    let model_layers = geometry().model_layers();
    let consumer = CudaBackend::new(ctx.gpu.clone())?;
    for (pages, ctas_list) in [(16usize, vec![2u32, 4, 8]), (1024, vec![4])] {
        let plan = plan(ctx, pages, 1025, 1025)?;
        let mut t = HostTransfer::new(&pool, &host, plan, Direction::Load)?;
        t.prepare_kernel(&ctx.backend, None)?;
        let bytes = t.bytes(Layers::All)?;
        for ctas in ctas_list {
            let mut signals = LayerSignals::new(&ctx.backend, model_layers)?;
            let stats = ctx.time(ctx.reps(10), || {
                t.run_signalled(&ctx.backend, ctas, &mut signals).map(drop)
            })?;
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
            let last = ctx.gpu.new_event(true)?;
            ctx.backend.stream().record(&start)?;
            let waits = t.run_signalled(&ctx.backend, ctas, &mut signals)?;
            waits[0].wait(&consumer)?;
            consumer.stream().record(&first)?;
            waits[model_layers - 1].wait(&consumer)?;
            consumer.stream().record(&last)?;
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
            let (t0, tl) = (ms(&first)?, ms(&last)?);
            println!("hicache      {pages}p signalled load, {ctas} CTAs: layer 0 consumable at {t0:.3} ms, layer {} at {tl:.3} ms", model_layers - 1);
            report.header.push(format!(
                "signalled load of {pages} pages, {ctas} CTAs: layer 0 consumable at {t0:.3} ms, last layer at {tl:.3} ms after the launch was enqueued"
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
        let dev: Vec<u64> = perm.iter().map(|&p| p as u64 + 1).collect();
        let load_plan = TransferPlan::new(
            Placement::unsharded(),
            0,
            &dev[..512],
            &(1..=512).collect::<Vec<_>>(),
            1025,
            1025,
        )?;
        let backup_plan = TransferPlan::new(
            Placement::unsharded(),
            0,
            &dev[512..],
            &(513..=1024).collect::<Vec<_>>(),
            1025,
            1025,
        )?;
        let load = HostTransfer::new(&pool, &host, load_plan, Direction::Load)?;
        let backup = HostTransfer::new(&pool, &host, backup_plan, Direction::Backup)?;
        let bytes = load.bytes(Layers::All)? + backup.bytes(Layers::All)?;
        let stats: Stats = ctx.time(ctx.reps(8), || {
            let fork = ctx.backend.record()?;
            other.wait(&fork)?;
            load.run(&ctx.backend, IoBackend::CopyEngine, Layers::All)?;
            backup.run(&other, IoBackend::CopyEngine, Layers::All)?;
            let join = other.record()?;
            ctx.backend.wait(&join)
        })?;
        report.add(
            "hicache",
            format!("{layout:?} Load 512p + Backup 512p at once, copy-engine"),
            bytes,
            stats,
            ("h2d+d2h", ctx.ceilings.bidir),
            String::new(),
        );
        let (mut load, mut backup) = (load, backup);
        load.prepare_kernel(&ctx.backend, None)?;
        backup.prepare_kernel(&ctx.backend, None)?;
        let relayout_load = CudaBackend::new(ctx.gpu.clone())?;
        let relayout_backup = CudaBackend::new(ctx.gpu.clone())?;
        for (chunk, how) in [
            (32, Relayout::Kernel { ctas: STAGED_CTAS }),
            (128, Relayout::Kernel { ctas: STAGED_CTAS }),
            (32, Relayout::CopyEngine),
        ] {
            let load_staging = load.staging(&ctx.backend, chunk)?;
            let backup_staging = backup.staging(&ctx.backend, chunk)?;
            let stats: Stats = ctx.time(ctx.reps(8), || {
                let fork = ctx.backend.record()?;
                other.wait(&fork)?;
                load.run_staged(&ctx.backend, &relayout_load, &load_staging, how)?;
                backup.run_staged(&other, &relayout_backup, &backup_staging, how)?;
                let join = other.record()?;
                ctx.backend.wait(&join)
            })?;
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
