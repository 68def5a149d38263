//! Transfers sharing the GPU with a forward pass (issue 6, item 7): HiCache loads and backups of
//! 512 pages x 62 layers while a cuBLAS bf16 GEMM (8192^3, every SM) or a memory-bound bf16 add
//! (3 x 2 GiB) runs back to back on another stream. Reports, per I/O backend and direction, the
//! transfer's rate under load / idle and the compute kernel's rate with the transfer / alone.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as blas_sys};
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Buffer, MemoryKind};
use kvshard::gpu::{bench, Stream};
use kvshard::hicache::{Direction, HostLayout, HostTransfer, IoBackend, Layers, Relayout};
use kvshard::{Error, Result};

use crate::harness::{Ctx, Report};
use crate::hicache::{device_pool, host_pool, plan, STAGED_CTAS};

/// How a measured transfer moves its bytes.
#[derive(Clone, Copy)]
enum Io {
    Direct(IoBackend),
    Staged(Relayout),
}

impl std::fmt::Display for Io {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Io::Direct(io) => write!(f, "{io}"),
            Io::Staged(how) => write!(f, "staged copy-engine (32-page chunks, {how:?} relayout)"),
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
        let values = kvshard::synth::bf16_bytes(&mut ctx.rng, 1 << 20);
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
    gpu: std::sync::Arc<kvshard::gpu::Gpu>,
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

/// Seconds of `n` back-to-back enqueues of `load` on `stream`, measured with events.
fn timed_loads(ctx: &Ctx, load: &dyn Load, stream: &Stream, n: usize) -> Result<f64> {
    let (start, end) = (ctx.gpu.new_event(true)?, ctx.gpu.new_event(true)?);
    stream.record(&start)?;
    for _ in 0..n {
        load.enqueue(stream)?;
    }
    stream.record(&end)?;
    stream.synchronize()?;
    let ms = start.elapsed_ms(&end).map_err(|source| Error::Driver {
        call: "cuEventElapsedTime",
        source,
    })?;
    Ok(f64::from(ms) / 1e3)
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
    let pool = device_pool(ctx, 1024)?;
    let host = host_pool(ctx, 1024, HostLayout::LayerFirst)?;
    let compute = CudaBackend::new(ctx.gpu.clone())?;
    let plan = plan(ctx, 512, 1025, 1025)?;
    for load in &loads {
        // The compute kernel alone, warm.
        timed_loads(ctx, load.as_ref(), compute.stream(), 3)?;
        let alone = timed_loads(ctx, load.as_ref(), compute.stream(), 20)?;
        let unit_s = alone / 20.0;
        for dir in [Direction::Load, Direction::Backup] {
            let mut t = HostTransfer::new(&pool, &host, plan.clone(), dir)?;
            t.prepare_kernel(&ctx.backend, None)?;
            let bytes = t.bytes(Layers::All)?;
            let staging = t.staging(&ctx.backend, 32)?;
            let relayout = CudaBackend::new(ctx.gpu.clone())?;
            for io in [
                Io::Direct(IoBackend::CopyEngine),
                Io::Staged(Relayout::Kernel { ctas: STAGED_CTAS }),
                Io::Staged(Relayout::CopyEngine),
                Io::Direct(IoBackend::SmKernel { ctas: 2 }),
                Io::Direct(IoBackend::SmKernel { ctas: 4 }),
                Io::Direct(IoBackend::SmKernel { ctas: 8 }),
            ] {
                let run = || match io {
                    Io::Direct(io) => t.run(&ctx.backend, io, Layers::All),
                    Io::Staged(how) => t.run_staged(&ctx.backend, &relayout, &staging, how),
                };
                let reps = ctx.reps(10);
                let idle = ctx.time(reps, run)?;
                // Transfers under load: the compute stream runs well past the timed transfers.
                let window_s = (reps + 2) as f64 * idle.median / 1e3;
                let covering = ((window_s * 1.5) / unit_s).ceil() as usize + 2;
                for _ in 0..covering {
                    load.enqueue(compute.stream())?;
                }
                let busy = ctx.time(reps, run)?;
                compute.synchronize()?;
                // The compute kernel while transfers run back to back on the other stream.
                let n_loads = ((window_s * 0.6) / unit_s).floor().max(1.0) as usize;
                for _ in 0..(reps + 4) {
                    run()?;
                }
                let with = timed_loads(ctx, load.as_ref(), compute.stream(), n_loads)?;
                ctx.backend.synchronize()?;
                let compute_kept =
                    (load.work() * n_loads as f64 / with) / (load.work() * 20.0 / alone);
                report.add(
                    "interfere",
                    format!("{} under {}: {dir:?} 512p, {io}", "transfer", load.name()),
                    bytes,
                    busy,
                    ("idle transfer", bytes as f64 / (idle.median * 1e6)),
                    format!(
                        "transfer keeps {:.2}x; compute keeps {:.2}x ({:.1} {} alone)",
                        idle.median / busy.median,
                        compute_kept,
                        load.work() * 20.0 / alone / 1e12,
                        if load.name().contains("GEMM") {
                            "TFLOP/s"
                        } else {
                            "TB/s"
                        }
                    ),
                );
            }
        }
    }
    Ok(())
}
