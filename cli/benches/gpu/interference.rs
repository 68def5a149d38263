//! Transfers sharing the GPU with a forward pass (issue 6, item 7): HiCache loads and backups of
//! 512 pages x 62 layers while a cuBLAS bf16 GEMM (8192^3, every SM) or a memory-bound bf16 add
//! (3 x 2 GiB) runs back to back on another stream. Reports, per host layout, I/O backend and
//! direction, the transfer's rate under load / idle and the compute kernel's rate with the
//! transfer / alone, next to the same for one contiguous 1 GiB copy (the least a transfer can
//! disturb). Every compute enqueue is timed by its own events and only those lying wholly inside
//! the transfers' window count; "alone" is measured right before and after, so both sides see
//! the same clocks. SM clock and board power, sampled through NVML, show the power cap at work.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::CudaEvent;
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Buffer, MemoryKind};
use kvshard::gpu::{bench, Stream};
use kvshard::hicache::{HostLayout, HostPool, HostTransfer, StagedIo, TransferPlan};
use kvshard::pool::DevicePool;
use kvshard::{Error, Result};
use kvshard_cli::measure::gbps;

use crate::harness::{Ctx, Report};
use crate::hicache::{ceiling, device_pool, host_pool, plan, staged, verify, STAGED_CTAS};
use kvshard::copy::{Direction, Layers, Method};
use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::Nvml;

/// How a measured transfer moves its bytes.
#[derive(Clone, Copy)]
enum Io {
    /// One contiguous 1 GiB pinned copy: the control.
    Contiguous,
    Direct(Method),
    Staged(Method),
}

impl std::fmt::Display for Io {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Io::Contiguous => f.write_str("one contiguous 1 GiB cudaMemcpyAsync (control)"),
            Io::Direct(io) => write!(f, "{io}"),
            Io::Staged(how) => write!(f, "staged copy-engine (32-page chunks, {how} relayout)"),
        }
    }
}

/// A compute load enqueued `n` times on its own stream.
trait Load {
    fn name(&self) -> &'static str;
    fn enqueue(&self, stream: &Stream) -> Result<()>;
    /// Work units of one enqueue (FLOPs, or bytes read + written), for rates.
    fn work(&self) -> f64;
}

const N: usize = 8192;

struct Gemm {
    handle: blas_sys::cublasHandle_t,
    a: Buffer,
    b: Buffer,
    c: Buffer,
}

fn blas_err(call: &'static str) -> impl Fn(blas::CublasError) -> Error {
    move |e| Error::InvalidArgument(format!("cuBLAS {call}: {e:?}"))
}

impl Gemm {
    fn new(ctx: &mut Ctx) -> Result<Option<Gemm>> {
        // SAFETY: only probes for the shared library.
        if !unsafe { blas_sys::is_culib_present() } {
            return Ok(None);
        }
        let bytes = N * N * 2;
        let (a, b, c) = (
            ctx.backend.alloc(bytes, MemoryKind::Device)?,
            ctx.backend.alloc(bytes, MemoryKind::Device)?,
            ctx.backend.alloc(bytes, MemoryKind::Device)?,
        );
        // Random bf16 in [-1, 1) scaled down: finite products, never zeros.
        let values = kvshard_cli::synth::bf16_bytes(&mut ctx.rng, 1 << 20);
        for buf in [&a, &b] {
            ctx.fill_tiled(buf, &values)?;
        }
        ctx.gpu.bind()?;
        let handle = blas::create_handle().map_err(blas_err("cublasCreate"))?;
        Ok(Some(Gemm { handle, a, b, c }))
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once.
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}

impl Load for Gemm {
    fn name(&self) -> &'static str {
        "bf16 GEMM 8192^3 (cuBLAS)"
    }

    fn enqueue(&self, stream: &Stream) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the handle is live; A, B, C are 8192x8192 bf16 device matrices; alpha and beta
        // are host f32 scalars (default pointer mode) that outlive the call.
        unsafe {
            blas::set_stream(self.handle, stream.raw() as blas_sys::cudaStream_t)
                .map_err(blas_err("cublasSetStream"))?;
            blas::gemm_ex(
                self.handle,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                N as i32,
                N as i32,
                N as i32,
                &alpha as *const f32 as *const c_void,
                self.a.addr() as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16BF,
                N as i32,
                self.b.addr() as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16BF,
                N as i32,
                &beta as *const f32 as *const c_void,
                self.c.addr() as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_16BF,
                N as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(blas_err("cublasGemmEx"))
        }
    }

    fn work(&self) -> f64 {
        2.0 * (N as f64).powi(3)
    }
}

struct Add {
    gpu: Arc<kvshard::gpu::Gpu>,
    a: Buffer,
    b: Buffer,
    out: Buffer,
}

impl Add {
    fn new(ctx: &mut Ctx) -> Result<Add> {
        let bytes = 2usize << 30;
        let (a, b, out) = (
            ctx.backend.alloc(bytes, MemoryKind::Device)?,
            ctx.backend.alloc(bytes, MemoryKind::Device)?,
            ctx.backend.alloc(bytes, MemoryKind::Device)?,
        );
        ctx.fill_random(&a)?;
        ctx.fill_random(&b)?;
        Ok(Add {
            gpu: ctx.gpu.clone(),
            a,
            b,
            out,
        })
    }
}

impl Load for Add {
    fn name(&self) -> &'static str {
        "bf16 add 3 x 2 GiB"
    }

    fn enqueue(&self, stream: &Stream) -> Result<()> {
        // SAFETY: three live 2 GiB device buffers of bf16.
        unsafe {
            bench::bf16_add(
                &self.gpu,
                stream,
                self.a.addr(),
                self.b.addr(),
                self.out.addr(),
                (self.a.len() / 2) as u64,
            )
        }
    }

    fn work(&self) -> f64 {
        3.0 * self.a.len() as f64
    }
}

/// Per-enqueue events of a compute load: enqueue `i` runs between `starts[i]` and `ends[i]`.
struct Timeline {
    starts: Vec<CudaEvent>,
    ends: Vec<CudaEvent>,
}

impl Timeline {
    fn new(ctx: &Ctx, n: usize) -> Result<Timeline> {
        let events = || {
            (0..n)
                .map(|_| ctx.gpu.new_event(true))
                .collect::<Result<Vec<_>>>()
        };
        Ok(Timeline {
            starts: events()?,
            ends: events()?,
        })
    }

    /// Enqueues `load` once per event pair, each between its events.
    fn enqueue(&self, load: &dyn Load, stream: &Stream) -> Result<()> {
        for (s, e) in self.starts.iter().zip(&self.ends) {
            stream.record(s)?;
            load.enqueue(stream)?;
            stream.record(e)?;
        }
        Ok(())
    }

    /// Work per second over the enqueues that lie wholly inside `window` (all when `None`), and
    /// how many did. Call after the events completed.
    fn rate(
        &self,
        load: &dyn Load,
        window: Option<(&CudaEvent, &CudaEvent)>,
    ) -> Result<(f64, usize)> {
        let (mut seconds, mut counted) = (0.0, 0);
        for (s, e) in self.starts.iter().zip(&self.ends) {
            if let Some((from, to)) = window {
                if elapsed_ms(from, s)? < 0.0 || elapsed_ms(e, to)? < 0.0 {
                    continue;
                }
            }
            seconds += elapsed_ms(s, e)? / 1e3;
            counted += 1;
        }
        if counted == 0 {
            return Err(Error::InvalidArgument(format!(
                "no {} enqueue lay inside the transfer window",
                load.name()
            )));
        }
        Ok((load.work() * counted as f64 / seconds, counted))
    }
}

fn elapsed_ms(from: &CudaEvent, to: &CudaEvent) -> Result<f64> {
    from.elapsed_ms(to)
        .map(f64::from)
        .map_err(|source| Error::Driver {
            call: "cuEventElapsedTime",
            source,
        })
}

/// What NVML saw while a window ran: mean SM clock (MHz), mean board power (W) and every
/// throttle reason reported.
struct Sample {
    mhz: f64,
    watts: f64,
    reasons: ThrottleReasons,
}

/// Samples NVML every 5 ms until `done` completes; `None` without NVML.
fn sample_until(nvml: Option<&Nvml>, bus_id: &str, done: &CudaEvent) -> Result<Option<Sample>> {
    let device = nvml.and_then(|n| n.device_by_pci_bus_id(bus_id).ok());
    let (mut mhz, mut watts, mut n) = (0.0, 0.0, 0u32);
    let mut reasons = ThrottleReasons::empty();
    while !done.try_is_complete().map_err(|source| Error::Driver {
        call: "cuEventQuery",
        source,
    })? {
        if let Some(d) = &device {
            if let (Ok(c), Ok(p)) = (d.clock_info(Clock::SM), d.power_usage()) {
                mhz += f64::from(c);
                watts += f64::from(p) / 1e3;
                n += 1;
            }
            reasons |= d
                .current_throttle_reasons()
                .unwrap_or(ThrottleReasons::empty());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok((n > 0).then(|| Sample {
        mhz: mhz / f64::from(n),
        watts: watts / f64::from(n),
        reasons,
    }))
}

fn clocks(sample: Option<Sample>) -> String {
    sample.map_or_else(String::new, |s| {
        // Idle is reported whenever a sample falls between two enqueues: not a limit.
        let reasons = s.reasons - ThrottleReasons::GPU_IDLE;
        format!("{:.0} MHz {:.0} W {reasons:?}", s.mhz, s.watts)
    })
}

/// The transfers measured against a load: the contiguous control, then per host pool the
/// staged and direct moves (and the SM kernel's grids where the layout allows it).
fn cases_of<'a>(ctx: &Ctx, hosts: &'a [Arc<HostPool>]) -> Vec<(Option<&'a Arc<HostPool>>, Io)> {
    let mut cases: Vec<(Option<&Arc<HostPool>>, Io)> = vec![(None, Io::Contiguous)];
    for host in hosts {
        let mut ios = vec![
            Io::Staged(Method::CopyEngine),
            Io::Staged(Method::host_io(ctx.backend.as_ref(), STAGED_CTAS)),
            Io::Direct(Method::CopyEngine),
        ];
        if host.layout() == HostLayout::LayerFirst {
            ios.extend(
                [2, 4, 8].map(|ctas| Io::Direct(Method::host_io(ctx.backend.as_ref(), ctas))),
            );
        }
        cases.extend(ios.into_iter().map(|io| (Some(host), io)));
    }
    cases
}

/// The transfer of `plan` between `pool` and `host` in direction `dir` that `io` moves, and its
/// staging when staged (none for the control).
fn transfer_of(
    ctx: &Ctx,
    pool: &Arc<DevicePool>,
    host: Option<&Arc<HostPool>>,
    plan: &TransferPlan,
    dir: Direction,
    io: Io,
) -> Result<(Option<HostTransfer>, Option<StagedIo>)> {
    match (host, io) {
        (None, _) => Ok((None, None)),
        (Some(h), Io::Staged(how)) => {
            let (t, staging) = staged(ctx.backend.as_ref(), pool, h, plan, dir, 32, how)?;
            Ok((Some(t), Some(staging)))
        }
        (Some(h), _) => {
            let mut t = HostTransfer::new(pool.clone(), h.clone(), plan.clone(), dir)?;
            t.prepare_kernel_sync(ctx.backend.as_ref(), &mut Vec::new())?;
            Ok((Some(t), None))
        }
    }
}

/// The compute load's rate and clocks alone, then while `run` repeats `runs` times on the
/// transfer stream (only enqueues wholly inside the transfers' window count), then alone
/// again, `n` enqueues each.
struct Rates {
    /// The load's rate alone (before and after, averaged), and while the transfers ran.
    alone: f64,
    with: f64,
    counted: usize,
    alone_clocks: Option<Sample>,
    with_clocks: Option<Sample>,
}

/// Measures [`Rates`] of `load` on `compute` against `run`.
fn compute_rates(
    ctx: &Ctx,
    load: &dyn Load,
    compute: &CudaBackend,
    (nvml, bus_id): (Option<&Nvml>, &str),
    (n, unit_s, runs): (usize, f64, usize),
    run: &dyn Fn() -> Result<()>,
) -> Result<Rates> {
    let timeline = Timeline::new(ctx, n)?;
    timeline.enqueue(load, compute.stream())?;
    let done = ctx.gpu.new_event(false)?;
    compute.stream().record(&done)?;
    let alone_clocks = sample_until(nvml, bus_id, &done)?;
    let before = timeline.rate(load, None)?.0;
    let (from, to) = (ctx.gpu.new_event(true)?, ctx.gpu.new_event(true)?);
    let long = Timeline::new(ctx, 2 * n + 4)?;
    long.enqueue(load, compute.stream())?;
    // Start the transfers once the compute stream is busy.
    std::thread::sleep(Duration::from_secs_f64(unit_s * 2.0));
    ctx.backend.stream().record(&from)?;
    for _ in 0..runs {
        run()?;
    }
    ctx.backend.stream().record(&to)?;
    let with_clocks = sample_until(nvml, bus_id, &to)?;
    compute.synchronize()?;
    ctx.backend.synchronize()?;
    let (with, counted) = long.rate(load, Some((&from, &to)))?;
    timeline.enqueue(load, compute.stream())?;
    compute.synchronize()?;
    let after = timeline.rate(load, None)?.0;
    let alone = (before + after) / 2.0;
    Ok(Rates {
        alone,
        with,
        counted,
        alone_clocks,
        with_clocks,
    })
}

/// The seconds one enqueue of `load` takes, measured after a first enqueue, then two seconds of
/// the load, so that "alone" sees the clocks of a busy GPU.
fn warm_unit(ctx: &Ctx, load: &dyn Load, compute: &CudaBackend) -> Result<f64> {
    // One enqueue first: the first cuBLAS call loads its kernels on the host, between a probe's
    // events, so the probe overstated the unit, the wait before the window outlasted the queued
    // compute, and no enqueue lay inside the window (H200, 2026-12-04, a1c0278).
    load.enqueue(compute.stream())?;
    compute.synchronize()?;
    let probe = Timeline::new(ctx, 8)?;
    probe.enqueue(load, compute.stream())?;
    compute.synchronize()?;
    let unit_s = load.work() / probe.rate(load, None)?.0;
    for _ in 0..(2.0 / unit_s).ceil() as usize {
        load.enqueue(compute.stream())?;
    }
    compute.synchronize()?;
    Ok(unit_s)
}

pub fn run(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let mut loads: Vec<Box<dyn Load>> = Vec::new();
    match Gemm::new(ctx)? {
        Some(g) => loads.push(Box::new(g)),
        None => println!(
            "interference: cuBLAS not found (set LD_LIBRARY_PATH to libcublas.so.13): GEMM skipped"
        ),
    }
    loads.push(Box::new(Add::new(ctx)?));
    let nvml = Nvml::init().ok();
    let bus_id = ctx.gpu.info().pci_bus_id.clone();
    let pool = device_pool(ctx, 1024)?;
    let compute = CudaBackend::new(ctx.gpu.clone())?;
    let relayout = CudaBackend::new(ctx.gpu.clone())?;
    let plan = plan(ctx, 512, 1025, 1025)?;
    let control_bytes = 1usize << 30;
    let control_host = ctx.backend.alloc(control_bytes, MemoryKind::PinnedHost)?;
    let control_dev = ctx.backend.alloc(control_bytes, MemoryKind::Device)?;
    ctx.fill_random(&control_dev)?;
    let layouts = [HostLayout::PageFirstDirect, HostLayout::LayerFirst];
    let hosts = layouts
        .iter()
        .map(|&l| host_pool(ctx, 1024, l))
        .collect::<Result<Vec<_>>>()?;
    for load in &loads {
        let unit_s = warm_unit(ctx, load.as_ref(), &compute)?;
        let cases = cases_of(ctx, &hosts);
        for dir in [Direction::Load, Direction::Backup] {
            for &(host, io) in &cases {
                let (t, staging) = transfer_of(ctx, &pool, host, &plan, dir, io)?;
                let bytes = t
                    .as_ref()
                    .map_or(Ok(control_bytes as u64), |t| t.bytes(Layers::All))?;
                let run = || match (io, t.as_ref(), staging.as_ref()) {
                    // SAFETY: live, disjoint 1 GiB buffers (pinned host through its device alias).
                    (Io::Contiguous, _, _) => unsafe {
                        match dir {
                            Direction::Load => ctx.backend.memcpy(
                                control_dev.addr(),
                                control_host.addr(),
                                control_bytes,
                            ),
                            Direction::Backup => ctx.backend.memcpy(
                                control_host.addr(),
                                control_dev.addr(),
                                control_bytes,
                            ),
                        }
                    },
                    (Io::Direct(io), Some(t), _) => t.run(ctx.backend.as_ref(), io, Layers::All),
                    (Io::Staged(how), Some(t), Some(s)) => {
                        t.run_staged(ctx.backend.as_ref(), &relayout, s, how)
                    }
                    _ => Err(Error::InvalidArgument(
                        "an interference case without its transfer or staging".into(),
                    )),
                };
                let reps = ctx.reps(10);
                let idle = ctx.time(reps, run)?;
                // The transfer under load: the compute stream runs well past the timed transfers.
                let window_s = ctx.runs(reps) as f64 * idle.median / 1e3;
                let covering = ((window_s * 1.5) / unit_s).ceil() as usize + 2;
                for _ in 0..covering {
                    load.enqueue(compute.stream())?;
                }
                let busy = ctx.time(reps, run)?;
                compute.synchronize()?;
                // The compute kernel alone, then while transfers run back to back on the other
                // stream (only enqueues wholly inside their window count), then alone again.
                let n = ((window_s / unit_s).ceil() as usize).max(4);
                let rates = compute_rates(
                    ctx,
                    load.as_ref(),
                    &compute,
                    (nvml.as_ref(), &bus_id),
                    (n, unit_s, ctx.runs(reps)),
                    &run,
                )?;
                if let (Some(t), Some(h)) = (&t, host) {
                    verify(ctx.backend.as_ref(), &mut ctx.rng, &pool, h, t.plan())?;
                }
                // The control is a plain contiguous copy: its best repeat, idle or under load,
                // is a sample of the ceiling. The rows are shares of the pinned ceiling; how
                // much of its idle speed a transfer keeps under load is a factor in the note
                // (noise can put it past 1.00x; a ceiling share cannot pass 100%).
                if matches!(io, Io::Contiguous) {
                    let best = gbps(bytes, idle.min.min(busy.min));
                    ctx.raise_ceiling(report, dir, best, bytes);
                }
                let host_name = host.map_or_else(String::new, |h| format!("{} ", h.layout()));
                report.add(
                    "interfere",
                    format!("under {}: {host_name}{dir:?} 512p, {io}", load.name()),
                    bytes,
                    busy,
                    ceiling(ctx, dir),
                    format!(
                        "transfer keeps {:.2}x; compute keeps {:.2}x ({:.1} {unit} alone, {} enqueues inside; alone {} / with {})",
                        idle.median / busy.median,
                        rates.with / rates.alone,
                        rates.alone / 1e12,
                        rates.counted,
                        clocks(rates.alone_clocks),
                        clocks(rates.with_clocks),
                        unit = if load.name().contains("GEMM") { "TFLOP/s" } else { "TB/s" },
                    ),
                );
            }
        }
    }
    Ok(())
}
