//! The `kvshard` command line: `info` says what this build and machine have; `demo` runs the
//! end-to-end job; `pd` runs P/D across processes; `plan` sizes a CP group's cache tiers.
//!
//! Every flag is checked before anything is allocated or any process starts: shapes are bounded
//! by what the formats allow, launch shapes by what the copy kernel takes, the processes a `pd`
//! run starts by what the machine has ([`PROCESSES_PER_CPU`], [`PROCESSES_PER_GPU`]), a flag the
//! chosen scenario would ignore is refused, and the memory a run needs is estimated and compared
//! with what the machine has (device memory through NVML, host memory from the OS). The
//! `--markdown` report file is opened for writing before any process starts. A run that cannot
//! go is refused with one line naming what to change, and exit status 1; no input makes it
//! panic or abort.

use std::ffi::OsString;
use std::fs::File;
use std::io::{Seek, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Launch};
use kvshard::geometry::{LatentLayout, Model};
use kvshard::gpu::{self, topology, Gpu};
use kvshard::pool::capacity::{self, CapacityPlan, CapacityRequest, Ceilings, HostCapacity};
use kvshard::pool::BudgetRequest;
use kvshard::{Error, Result};

use crate::demo::{self, Config, StreamFactory, Summary};
use crate::pd::pressure::{self, PressurePdConfig};
use crate::pd::{self, PdConfig, Role};
use crate::plan::{self, CeilingNote};
use crate::scenario::{Platform, PressureConfig, Shape};
use kvshard::copy::Method;

/// Prints a line; a closed stdout (a pipe into `head`) is not an error worth dying for.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// Processes a `pd` run may start per CPU this process may use: every process polls its
/// channels, and on the CPU twin computes on the CPU too; crowded past that, they time-slice so
/// hard that heartbeats (every 100 ms; a peer silent for 750 ms is gone) start to fail.
pub const PROCESSES_PER_CPU: usize = 4;

/// Processes a `pd` run may start per GPU: each holds a CUDA context and its pools on the GPU
/// it shares.
pub const PROCESSES_PER_GPU: usize = 8;

/// The command line.
#[derive(Parser, Debug)]
#[command(
    name = "kvshard",
    version,
    about = "Page-sharded FP8 KV cache data plane for DSA models"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The kernel build, the GPU (name, SMs, memory) and where it sits (PCIe, NUMA).
    Info,
    /// The end-to-end job: sharded prefill writes, P/D transfer and a HiCache round trip of one
    /// request (`--scenario basic`), or the seed's accuracy scenario under memory pressure
    /// (`--scenario pressure`), every hand-off checked byte for byte; on the GPU if there is
    /// one, else on the CPU.
    Demo(DemoArgs),
    /// P/D across processes: N prefill processes and a decode process (on the GPUs, or the CPU
    /// twin), the decode pool mapped into every rank; sends requests with each method, verifies
    /// the bytes and reports GB/s next to the copy ceiling (`--scenario transfer`). Or the seed's
    /// topology (`--scenario pressure`): CP prefill ranks with the CP gather, write-through and
    /// reload, sending every chunk to each of the decodes, one process per GPU.
    Pd(Box<PdArgs>),
    /// The capacity planner: per tier (GPU L1, host L2, disk L3) the pages and tokens a CP
    /// group of a model holds, the scratch budget and logical GPU slots, the host pages per
    /// rank, the L3 slots, and how long a 16K and a 128K-token prefix take to come back from
    /// each tier, from ceilings measured here (`--measure`) or given.
    Plan(Box<PlanArgs>),
    /// The storage tier below the host pools (feature `nixl`): store and load GB/s per rank and
    /// for N ranks together, I/Os and host CPU time per page, p50/p99 of a batch, next to a
    /// same-run fio ceiling on the same filesystem.
    #[cfg(feature = "nixl")]
    StorageBench(StorageBenchArgs),
}

/// A model `plan` knows.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum ModelArg {
    /// GLM-5: 78 layers.
    Glm5,
    /// DeepSeek-V3.2: 61 layers.
    #[value(name = "deepseek-v32")]
    DeepseekV32,
}

/// A latent row layout `plan` takes.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum LatentArg {
    /// FP8 E4M3 "trtllm", 576-byte rows (the sharded DSA path's).
    Fp8Trtllm,
    /// FP8 E4M3 "scaled" (FlashMLA), 656-byte rows.
    Fp8Scaled,
    /// bf16, 1,152-byte rows.
    Bf16,
}

#[derive(Args, Debug)]
struct PlanArgs {
    /// The model.
    #[arg(long, value_enum)]
    model: ModelArg,
    /// CP ranks N (1 = unsharded).
    #[arg(long)]
    cp: u32,
    /// GPU memory per rank for the attention scratch and the pool (`40GB`, `37GiB`, bytes).
    #[arg(long, value_parser = plan::parse_size)]
    gpu_mem: u64,
    /// Host (L2) cache per rank: a size, or `Nx`, N times the GPU pool's pages.
    #[arg(long, value_parser = plan::parse_host)]
    host_mem: HostCapacity,
    /// The CP group's disk (L3) store, shared by its ranks.
    #[arg(long, value_parser = plan::parse_size)]
    disk: u64,
    /// Latent row layout.
    #[arg(long, value_enum, default_value = "fp8-trtllm")]
    latent: LatentArg,
    /// Leave the MTP draft out.
    #[arg(long)]
    no_draft: bool,
    /// Longest context a request may have, in tokens (sizes the scratch).
    #[arg(long, default_value_t = 131_072)]
    context_len: u64,
    /// Prefill chunk size in tokens (sizes the scratch).
    #[arg(long, default_value_t = 8192)]
    chunk: u64,
    /// Contexts whose prefixes one batch's scratch holds (SGLang: 8).
    #[arg(long, default_value_t = kvshard::pool::DEFAULT_CONTEXTS)]
    contexts: u64,
    /// The disk's direct-I/O alignment in bytes (L3 slots are padded to it).
    #[arg(long, default_value_t = capacity::DEFAULT_DIO_ALIGN)]
    dio_align: u64,
    /// Prefix lengths in tokens whose reload times to print, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = capacity::DEFAULT_PREFIXES)]
    prefixes: Vec<u64>,
    /// Measure the ceilings here: D2D and pinned H2D on GPU 0 (the host's memcpy for both
    /// without a GPU) and an O_DIRECT read in --disk-path. A ceiling given by its flag wins.
    #[arg(long)]
    measure: bool,
    /// Directory on the disk the L3 store would use (where --measure reads a file it writes).
    #[arg(long)]
    disk_path: Option<PathBuf>,
    /// D2D ceiling in GB/s.
    #[arg(long)]
    d2d_gbps: Option<f64>,
    /// Pinned H2D ceiling in GB/s.
    #[arg(long)]
    h2d_gbps: Option<f64>,
    /// The disk store's read ceiling in GB/s, all ranks together.
    #[arg(long)]
    disk_gbps: Option<f64>,
}

impl PlanArgs {
    /// The model's name and the request the flags describe, with the ceilings given by flags.
    fn request(&self) -> (Model, CapacityRequest) {
        let model = match self.model {
            ModelArg::Glm5 => Model::Glm5,
            ModelArg::DeepseekV32 => Model::DeepseekV32,
        };
        let latent = match self.latent {
            LatentArg::Fp8Trtllm => LatentLayout::Fp8Trtllm,
            LatentArg::Fp8Scaled => LatentLayout::Fp8Scaled,
            LatentArg::Bf16 => LatentLayout::Bf16,
        };
        let mut gpu = BudgetRequest::new(self.gpu_mem, self.context_len, self.chunk);
        gpu.contexts = self.contexts;
        let req = CapacityRequest {
            geometry: model.geometry(latent, !self.no_draft),
            cp: self.cp,
            gpu,
            host: self.host_mem,
            disk_bytes: self.disk,
            dio_align: self.dio_align,
            ceilings: Ceilings {
                d2d_gbps: self.d2d_gbps,
                h2d_gbps: self.h2d_gbps,
                disk_gbps: self.disk_gbps,
            },
            prefixes: self.prefixes.clone(),
        };
        (model, req)
    }

    /// Checks the plan can be made (the planner's own checks) and that --measure has a disk to
    /// read or its ceiling given; measures nothing.
    fn check(&self) -> std::result::Result<(), String> {
        let (_, req) = self.request();
        CapacityPlan::plan(&req).map_err(|e| format!("plan: {e}"))?;
        unused(
            "--disk-path",
            self.disk_path.is_some() && !self.measure,
            "without --measure",
        )?;
        if self.measure && self.disk_path.is_none() && self.disk_gbps.is_none() {
            return Err(
                "plan --measure reads the disk in --disk-path DIR (or give --disk-gbps)".into(),
            );
        }
        Ok(())
    }

    /// The ceilings: each flag's, else measured when --measure says so; what each is, for the
    /// report.
    fn ceilings(&self) -> Result<(Ceilings, Vec<CeilingNote>)> {
        let mut notes = Vec::new();
        let mut note = |name, gbps: Option<f64>, source: &str| {
            if let Some(gbps) = gbps {
                notes.push(CeilingNote {
                    name,
                    gbps,
                    source: source.to_string(),
                });
            }
            gbps
        };
        let (mut d2d, mut h2d, mut disk) = (None, None, None);
        let (mut d2d_from, mut h2d_from, mut disk_from) =
            (String::new(), String::new(), String::new());
        if self.measure {
            if self.d2d_gbps.is_none() || self.h2d_gbps.is_none() {
                match Gpu::open(0) {
                    Ok(gpu) => {
                        let name = gpu.info().name.clone();
                        let (d, h) = plan::measure_gpu(gpu)?;
                        (d2d, h2d) = (Some(d), Some(h));
                        d2d_from = format!("measured: {name}, copy engine");
                        h2d_from = format!("measured: {name}, copy engine");
                    }
                    Err(e) => {
                        let m = plan::measure_host_memcpy()?;
                        (d2d, h2d) = (Some(m), Some(m));
                        d2d_from = format!("measured: host memcpy, no GPU ({e})");
                        h2d_from = d2d_from.clone();
                    }
                }
            }
            if let (None, Some(dir)) = (self.disk_gbps, &self.disk_path) {
                disk = Some(plan::measure_disk(dir)?);
                disk_from = format!(
                    "measured: O_DIRECT reads of {} MiB in {}",
                    plan::DISK_IO_BYTES >> 20,
                    dir.display()
                );
            }
        }
        let pick = |given: Option<f64>, measured: Option<f64>, from: &str| match given {
            Some(g) => (Some(g), "given".to_string()),
            None => (measured, from.to_string()),
        };
        let (d2d, d2d_from) = pick(self.d2d_gbps, d2d, &d2d_from);
        let (h2d, h2d_from) = pick(self.h2d_gbps, h2d, &h2d_from);
        let (disk, disk_from) = pick(self.disk_gbps, disk, &disk_from);
        let ceilings = Ceilings {
            d2d_gbps: note("D2D", d2d, &d2d_from),
            h2d_gbps: note("pinned H2D", h2d, &h2d_from),
            disk_gbps: note("disk", disk, &disk_from),
        };
        Ok((ceilings, notes))
    }

    /// Measures what it must, plans and prints.
    fn run(&self) -> Result<()> {
        let (model, mut req) = self.request();
        let (ceilings, notes) = self.ceilings()?;
        req.ceilings = ceilings;
        let plan = CapacityPlan::plan(&req)?;
        let heading = plan::Heading {
            model,
            ceilings: notes,
        };
        say!("{}", plan::render(&req, &plan, &heading).trim_end());
        Ok(())
    }
}

/// `kvshard storage-bench`'s flags.
#[cfg(feature = "nixl")]
#[derive(Args, Debug)]
struct StorageBenchArgs {
    /// Directory to benchmark in (a filesystem with O_DIRECT); default: the temporary directory.
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Ranks (threads), each with its own store and host pool; fio's numjobs.
    #[arg(long, default_value_t = 2)]
    ranks: u32,
    /// Target layers of the seed's geometry.
    #[arg(long, default_value_t = 61)]
    layers: usize,
    /// Leave the MTP draft out.
    #[arg(long)]
    no_draft: bool,
    /// Pages each rank stores and loads.
    #[arg(long, default_value_t = 256)]
    pages: u64,
    /// Pages per store or load call.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Staging slots per store (pages of one round of I/O).
    #[arg(long, default_value_t = 32)]
    staging_slots: usize,
    /// Largest descriptor, MiB.
    #[arg(long, default_value_t = 8)]
    max_io_mib: u64,
    /// libaio instead of io_uring (kvshard and fio).
    #[arg(long)]
    aio: bool,
    /// The fio binary (default: `fio` on PATH; none: no ceiling).
    #[arg(long)]
    fio: Option<std::path::PathBuf>,
    /// Seconds of each fio run.
    #[arg(long, default_value_t = 5)]
    fio_seconds: u32,
    /// Prefixes (tokens) of the end-to-end rows, reloaded to the device from storage next to
    /// from host memory; default 16384,131072 on a GPU, 16384 on the CPU (128K tokens need
    /// about 5.5 GB each of device, host and disk, and 5.5 GB more of host memory to check).
    #[arg(long, value_delimiter = ',')]
    e2e_tokens: Vec<u64>,
    /// No end-to-end rows.
    #[arg(long, conflicts_with = "e2e_only")]
    no_e2e: bool,
    /// Only the end-to-end rows (no throughput table, no fio).
    #[arg(long)]
    e2e_only: bool,
    /// The end-to-end rows on the CPU backend even where a GPU is.
    #[arg(long)]
    cpu: bool,
    /// Write each rank's new slot file once at open (zeros), so the first fill overwrites
    /// written blocks (DiskConfig::zero_fill); the report says what the open cost.
    #[arg(long)]
    zero_fill: bool,
    /// Also measure GPUDirect Storage on GPU 0 (NIXL's GDS backend, cuFile): one descriptor
    /// and slot-size descriptors, VRAM <-> file, checked; says why where it cannot run.
    #[arg(long)]
    gds: bool,
    /// Only the GDS measurement.
    #[arg(long, conflicts_with_all = ["e2e_only", "no_e2e"])]
    gds_only: bool,
    /// Slot-size descriptors the GDS measurement moves (384: about 1 GB).
    #[arg(long, default_value_t = 384)]
    gds_descriptors: u64,
    /// GDS descriptors per request (at most 128: published runs hang GDS at 256 in flight).
    #[arg(long, default_value_t = 64)]
    gds_in_flight: usize,
}

#[cfg(feature = "nixl")]
fn storage_bench(args: &StorageBenchArgs) -> ExitCode {
    let fio = args.fio.clone().or_else(|| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("fio"))
                .find(|p| p.is_file())
        })
    });
    // Every flag checked before anything is allocated: the shape's bounds here, the rest by
    // StorageBench::validate.
    let shape = Shape {
        ranks: 1,
        layers: args.layers,
        draft: !args.no_draft,
        seed: 0,
    };
    let max_io_bytes = args.max_io_mib.max(1).checked_mul(1 << 20);
    if let Err(e) = shape.check().and_then(|()| {
        max_io_bytes
            .map(|_| ())
            .ok_or_else(|| crate::overflow("--max-io-mib"))
    }) {
        say!("storage-bench: {e}");
        return ExitCode::FAILURE;
    }
    let bench = crate::storage_bench::StorageBench {
        dir: args.dir.clone().unwrap_or_else(std::env::temp_dir),
        ranks: args.ranks,
        geometry: shape.geometry(),
        pages: args.pages,
        batch: args.batch,
        staging_slots: args.staging_slots,
        max_io_bytes: max_io_bytes.unwrap_or(u64::MAX),
        aio: args.aio,
        fio,
        fio_seconds: args.fio_seconds.max(1),
        zero_fill: args.zero_fill,
    };
    if let Err(e) = bench.validate() {
        say!("storage-bench: {e}");
        return ExitCode::FAILURE;
    }
    if !args.e2e_only && !args.gds_only {
        match bench.run() {
            Ok(report) => say!("{report}"),
            Err(e) => {
                say!("storage-bench: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let gpu = if args.cpu { None } else { Gpu::open(0).ok() };
    if args.gds || args.gds_only {
        let report = match &gpu {
            Some(gpu) => match CudaBackend::new(gpu.clone()) {
                Ok(b) => crate::storage_e2e::gds_report(
                    &b,
                    &bench.geometry,
                    &bench.dir,
                    args.gds_descriptors,
                    args.gds_in_flight,
                ),
                Err(e) => format!("\n## GDS\n\nGDS not measured: {e}\n"),
            },
            None => "\n## GDS\n\nGDS not measured: no GPU (GDS moves device memory)\n".into(),
        };
        say!("{report}");
    }
    if args.no_e2e || args.gds_only {
        return ExitCode::SUCCESS;
    }
    let tokens = match (args.e2e_tokens.is_empty(), gpu.is_some()) {
        (false, _) => args.e2e_tokens.clone(),
        (true, true) => vec![16384, 131072],
        (true, false) => vec![16384],
    };
    let rows = |b: Arc<dyn Backend>, streams: StreamFactory<'_>| -> Result<String> {
        let mut rows = Vec::new();
        for &t in &tokens {
            // Each row's store in a private directory of its own, made in --dir.
            rows.push(crate::storage_e2e::prefix_row(
                &b,
                streams,
                &bench.geometry,
                t.max(1),
                &bench.dir,
                args.aio,
            )?);
        }
        Ok(crate::storage_e2e::render(&rows, b.name()))
    };
    let result = match gpu {
        Some(gpu) => {
            let streams = move || -> Result<Arc<dyn Backend>> {
                Ok(Arc::new(CudaBackend::new(gpu.clone())?))
            };
            streams().and_then(|b| rows(b, &streams))
        }
        None => {
            let cpu = CpuBackend::new();
            let streams = || -> Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
            rows(Arc::new(cpu.new_stream()), &streams)
        }
    };
    match result {
        Ok(report) => {
            say!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            say!("storage-bench end to end: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The flags every scenario shares: the cache and the CP group ([`Shape`]).
#[derive(Args, Debug)]
struct ShapeArgs {
    /// CP shard size N: the prefill ranks.
    #[arg(long)]
    ranks: Option<u32>,
    /// Target layers (default: 61 on GPUs, a few on the CPU).
    #[arg(long)]
    layers: Option<usize>,
    /// Leave the MTP draft out.
    #[arg(long)]
    no_draft: bool,
    /// Seed of the synthetic KV.
    #[arg(long)]
    seed: Option<u64>,
}

impl ShapeArgs {
    /// `shape` (a scenario's default) with what the flags say.
    fn apply(&self, shape: Shape) -> Shape {
        Shape {
            ranks: self.ranks.unwrap_or(shape.ranks),
            layers: self.layers.unwrap_or(shape.layers),
            draft: !self.no_draft && shape.draft,
            seed: self.seed.unwrap_or(shape.seed),
        }
    }
}

/// Which job `demo` runs.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum DemoScenario {
    /// One request through prefill writes, P/D and a HiCache round trip.
    Basic,
    /// A seeded prefix written through to the host, two prompts that force evictions, the
    /// prefix reloaded from the host and gathered into the scratch for the second one's chunks.
    Pressure,
}

#[derive(Args, Debug)]
struct DemoArgs {
    /// Which job to run.
    #[arg(long, value_enum, default_value = "basic")]
    scenario: DemoScenario,
    /// Run on the CPU reference backend even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Request length in tokens (pressure: each prompt's).
    #[arg(long)]
    tokens: Option<usize>,
    /// Prefill chunk size in tokens (a multiple of 64).
    #[arg(long)]
    chunk: Option<usize>,
}

/// How the pressure scenario's ranks all-gather.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum GatherArg {
    /// NCCL where it can run, else host shared memory.
    Auto,
    /// NCCL (each rank on a GPU of its own); refused where it cannot run.
    Nccl,
    /// Host shared memory (the CPU twin's, and ranks sharing a GPU).
    Host,
}

/// Which job `pd` runs.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum PdScenario {
    /// Request sizes x methods from N ranks to one decode.
    Transfer,
    /// The seed's topology under memory pressure, every rank and decode a process.
    Pressure,
}

#[derive(Args, Debug)]
struct PdArgs {
    /// Which job to run.
    #[arg(long, value_enum, default_value = "transfer")]
    scenario: PdScenario,
    /// Run on the CPU twin (memfd pools) even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Decode processes (pressure scenario; default 2).
    #[arg(long)]
    decodes: Option<u32>,
    /// Request sizes in pages, comma-separated (transfer scenario).
    #[arg(long, value_delimiter = ',')]
    pages: Option<Vec<usize>>,
    /// Pages per prefill chunk (transfer scenario).
    #[arg(long)]
    chunk_pages: Option<usize>,
    /// Methods, comma-separated: `blocks` (the block kernel, once per --ctas),
    /// `blocks:CTAS[:THREADS]`, `ranges:CTAS[:THREADS]` (the range kernel), `ce` (copy-engine
    /// batch), `naive` (one copy per page and layer). The pressure scenario sends with one.
    #[arg(long, value_delimiter = ',')]
    methods: Option<Vec<String>>,
    /// CTA counts a plain `blocks` method runs with.
    #[arg(long, value_delimiter = ',')]
    ctas: Option<Vec<u32>>,
    /// Threads per CTA of the plain `blocks` methods (a multiple of 32, at most 1,024).
    #[arg(long)]
    threads: Option<u32>,
    /// Requests per case, the first verified (transfer scenario).
    #[arg(long)]
    iterations: Option<usize>,
    /// GPUs: each rank's, then each decode's (default: rank r on GPU r modulo the count, the
    /// decodes on the GPUs after the ranks, sharing the last one when there are not enough).
    #[arg(long, value_delimiter = ',')]
    gpus: Option<Vec<usize>>,
    /// Also write the report table to this file (opened before any process starts).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// The process's role in a run (set by `kvshard pd` for the processes it starts).
    #[arg(long, hide = true)]
    role: Option<String>,
    /// The role's rank (or decode index).
    #[arg(long, hide = true)]
    rank: Option<u32>,
    /// The decode's socket (pressure: the decodes' sockets' stem).
    #[arg(long, hide = true)]
    socket: Option<PathBuf>,
    /// The CP group memory of the pressure scenario's ranks.
    #[arg(long, hide = true)]
    group: Option<PathBuf>,
    /// The storage step's directory the pressure scenario's ranks share (made private by the
    /// run for them).
    #[arg(long, hide = true)]
    storage_dir: Option<PathBuf>,
    /// How the pressure scenario's ranks all-gather prefix pages: `auto` (NCCL when each rank
    /// has a GPU of its own and libnccl loads, else through host shared memory), `nccl`, `host`.
    #[arg(long, value_enum)]
    all_gather: Option<GatherArg>,
    /// Pause between a rank's chunks, in milliseconds (transfer scenario).
    #[arg(long, hide = true)]
    pace_ms: Option<u64>,
    /// How long a decode waits for a request, in milliseconds, from its registration to every
    /// rank's last status; past it the run fails naming the ranks and chunks that never came
    /// (default 300000).
    #[arg(long)]
    deadline_ms: Option<u64>,
}

/// The machine a run is checked against: where it runs and what it has.
#[derive(Debug, Clone, Copy)]
struct Machine {
    platform: Platform,
    /// GPUs the driver sees (0 on the CPU twin, and unprobed in a started process).
    gpus: usize,
    /// CPUs this process may use.
    cpus: usize,
    /// Whether this is a process a `pd` run started: it is told its platform (`--cpu` or not)
    /// and its all-gather, and probes nothing.
    started: bool,
}

impl Machine {
    /// The CPU twin when `cpu` says so or no GPU opens (saying why when `tell`), else GPUs; a
    /// started process is on GPUs unless told `--cpu`.
    fn detect(cpu: bool, started: bool, tell: bool) -> Machine {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let on = |platform, gpus| Machine {
            platform,
            gpus,
            cpus,
            started,
        };
        if cpu {
            return on(Platform::Cpu, 0);
        }
        if started {
            return on(Platform::Gpu, 0);
        }
        match Gpu::open(0).and_then(|_| pd::gpu_count()) {
            Ok(gpus) => on(Platform::Gpu, gpus),
            Err(e) => {
                if tell {
                    say!("backend: cpu ({e})");
                }
                on(Platform::Cpu, 0)
            }
        }
    }
}

impl DemoArgs {
    fn config(&self, platform: Platform) -> Config {
        let d = Config::default_for(platform);
        Config {
            shape: self.shape.apply(d.shape),
            tokens: self.tokens.unwrap_or(d.tokens),
            chunk: self.chunk.unwrap_or(d.chunk),
        }
    }

    fn pressure(&self, platform: Platform) -> PressureConfig {
        let d = PressureConfig::default_for(platform);
        PressureConfig {
            shape: self.shape.apply(d.shape.clone()),
            prompt_tokens: self.tokens.unwrap_or(d.prompt_tokens),
            chunk: self.chunk.unwrap_or(d.chunk),
            ..d
        }
    }

    /// What the chosen scenario needs, after checking it.
    fn memory(&self, platform: Platform) -> Result<MemoryNeed> {
        match self.scenario {
            DemoScenario::Basic => {
                let c = self.config(platform);
                c.check()?;
                let page = c.shape.geometry().page_bytes_checked()? as u64;
                let pages = (c.tokens as u64).div_ceil(64) + 2;
                let per_rank = c.pages_per_rank();
                let ranks = u64::from(c.shape.ranks);
                // The ranks' pools, the reference, three decode pools, the staging.
                let pools = add(mul(per_rank, ranks)?, mul(pages, 4)?)?;
                let device = add(mul(pools, page)?, mul((c.chunk as u64).div_ceil(64), page)?)?;
                let host = mul(mul(per_rank, ranks)?, page)?;
                Ok(MemoryNeed { device, host })
            }
            DemoScenario::Pressure => {
                let c = self.pressure(platform);
                let per_rank = c.pages_per_rank()?;
                let page = c.shape.geometry().page_bytes_checked()? as u64;
                let pool_pages = mul(per_rank, u64::from(c.shape.ranks))?;
                // The ranks' pools, the reference, two decode pools, staging and scratch slots
                // (about a reference's worth).
                let device = mul(add(pool_pages, mul(c.reference_pages(), 4)?)?, page)?;
                let host = mul(mul(pool_pages, c.host_factor)?, page)?;
                Ok(MemoryNeed { device, host })
            }
        }
    }

    /// Checks the run before anything is allocated: the scenario, then the memory estimate.
    fn check(&self) -> std::result::Result<(), String> {
        let machine = Machine::detect(self.cpu, false, false);
        let need = self.memory(machine.platform).map_err(|e| {
            let c = self.config(machine.platform);
            format!(
                "demo of {} tokens in chunks of {}, {}: {e}",
                c.tokens, c.chunk, c.shape
            )
        })?;
        fits(need, machine.platform, "--tokens, --layers or --ranks")
    }

    /// Runs the chosen scenario on `b`.
    fn run(
        &self,
        b: Arc<dyn Backend>,
        streams: StreamFactory<'_>,
        platform: Platform,
    ) -> Result<Summary> {
        let route = platform.route();
        match self.scenario {
            DemoScenario::Basic => demo::run(b, streams, &self.config(platform), route),
            DemoScenario::Pressure => {
                demo::run_pressure(b, streams, &self.pressure(platform), route)
            }
        }
    }
}

/// A flag the chosen run does not use (`why` says where: "in the pressure scenario"): refused
/// rather than ignored.
fn unused(name: &str, given: bool, why: &str) -> std::result::Result<(), String> {
    if given {
        Err(format!("{name} does nothing {why}"))
    } else {
        Ok(())
    }
}

impl PdArgs {
    /// The processes of the run, from the flags.
    fn processes(&self, platform: Platform, decodes: u32) -> pd::Processes {
        let mut p = pd::Processes::new(platform, self.decodes.unwrap_or(decodes));
        p.gpus = self.gpus.clone().unwrap_or_default();
        if let Some(ms) = self.deadline_ms {
            p.deadline = Duration::from_millis(ms);
        }
        p
    }

    /// The launch shapes a plain `blocks` method runs with: one per `--ctas`, `--threads` each.
    fn plain_blocks(&self, default: &[Method]) -> Vec<Method> {
        let threads = self.threads.unwrap_or(512);
        let ctas = self.ctas.clone().unwrap_or_else(|| {
            default
                .iter()
                .filter_map(|m| match m {
                    Method::Kernel(l) => Some(l.ctas),
                    _ => None,
                })
                .collect()
        });
        ctas.into_iter()
            .map(|ctas| Method::Kernel(Launch { ctas, threads }))
            .collect()
    }

    /// Whether the methods include a plain `blocks` (the default methods do).
    fn has_plain_blocks(&self) -> bool {
        self.methods
            .as_ref()
            .is_none_or(|names| names.iter().any(|n| n == "blocks"))
    }

    /// The transfer scenario's run: its defaults, with what the flags say; checked.
    fn transfer(&self, platform: Platform) -> std::result::Result<PdConfig, String> {
        const S: &str = "in the transfer scenario";
        unused("--decodes", self.decodes.is_some(), S)?;
        unused("--all-gather", self.all_gather.is_some(), S)?;
        unused("--group", self.group.is_some(), S)?;
        unused("--storage-dir", self.storage_dir.is_some(), S)?;
        if !self.has_plain_blocks() {
            let why = "with --methods that have no plain `blocks`";
            unused("--ctas", self.ctas.is_some(), why)?;
            unused("--threads", self.threads.is_some(), why)?;
        }
        let d = PdConfig::default_for(platform);
        let methods = match &self.methods {
            None => d
                .methods
                .iter()
                .flat_map(|m| match m {
                    Method::Kernel(_) => self.plain_blocks(&d.methods),
                    other => vec![*other],
                })
                .collect(),
            Some(names) => {
                let mut methods = Vec::new();
                for name in names {
                    if name == "blocks" {
                        methods.extend(self.plain_blocks(&d.methods));
                    } else {
                        methods.push(pd::parse_method(name).map_err(|e| e.to_string())?);
                    }
                }
                methods
            }
        };
        let cfg = PdConfig {
            shape: self.shape.apply(d.shape),
            processes: self.processes(platform, 1),
            pages: self.pages.clone().unwrap_or(d.pages),
            chunk_pages: self.chunk_pages.unwrap_or(d.chunk_pages),
            methods,
            iterations: self.iterations.unwrap_or(d.iterations),
            pace: Duration::from_millis(self.pace_ms.unwrap_or(0)),
        };
        cfg.validate().map_err(|e| e.to_string())?;
        Ok(cfg)
    }

    /// The pressure scenario's run: its defaults, with what the flags say; checked (NCCL as
    /// `--all-gather` says, `auto` deciding on `machine`).
    fn pressure(&self, machine: Machine) -> std::result::Result<PressurePdConfig, String> {
        const S: &str = "in the pressure scenario";
        unused("--pages", self.pages.is_some(), S)?;
        unused("--chunk-pages", self.chunk_pages.is_some(), S)?;
        unused("--iterations", self.iterations.is_some(), S)?;
        unused("--pace-ms", self.pace_ms.is_some(), S)?;
        let mut c = PressurePdConfig::default_for(machine.platform);
        c.scenario.shape = self.shape.apply(c.scenario.shape.clone());
        c.processes = self.processes(machine.platform, c.processes.decodes);
        let one = "the pressure scenario sends with one method: --methods M or --ctas C";
        c.method = match self.methods.as_deref() {
            Some([name]) if name != "blocks" => {
                let own = "with --methods M (M has its own shape)";
                unused("--ctas", self.ctas.is_some(), own)?;
                unused("--threads", self.threads.is_some(), own)?;
                pd::parse_method(name).map_err(|e| e.to_string())?
            }
            None | Some([_]) => match self.plain_blocks(&[c.method])[..] {
                [method] => method,
                _ => return Err(one.into()),
            },
            Some(_) => return Err(one.into()),
        };
        let possible = |c: &PressurePdConfig| pressure::nccl_possible(c, machine.gpus);
        c.nccl = match self.all_gather.unwrap_or(GatherArg::Auto) {
            // A started process is told `host` or `nccl`: `auto` decided once, in the run.
            GatherArg::Nccl if machine.started => true,
            GatherArg::Auto => possible(&c),
            GatherArg::Host => false,
            // Validation says why NCCL cannot run on the CPU twin.
            GatherArg::Nccl if !machine.platform.is_gpu() || possible(&c) => true,
            GatherArg::Nccl => {
                return Err(
                    "--all-gather nccl needs each rank on a GPU of its own, the nccl feature and libnccl"
                        .into(),
                )
            }
        };
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }

    /// The role of a process `kvshard pd` started, from the hidden flags.
    fn role(&self) -> std::result::Result<Option<Role>, String> {
        match (self.role.as_deref(), self.rank) {
            (None, None) => Ok(None),
            (Some("decode"), Some(d)) => Ok(Some(Role::Decode(d))),
            (Some("prefill"), Some(r)) => Ok(Some(Role::Rank(r))),
            (role, rank) => Err(format!(
                "--role {role:?} --rank {rank:?}: a role process is `--role decode|prefill --rank N`"
            )),
        }
    }

    /// Checks a role process's flags: its role in range, and what it needs given.
    fn check_role(&self, role: Role, ranks: u32, decodes: u32) -> std::result::Result<(), String> {
        let ok = match role {
            Role::Rank(r) => r < ranks,
            Role::Decode(d) => d < decodes,
        };
        if !ok {
            return Err(format!(
                "{role} of a run of {ranks} ranks and {decodes} decodes"
            ));
        }
        if self.socket.is_none() {
            return Err(format!("{role} without --socket"));
        }
        let ranks_share_memory = self.scenario == PdScenario::Pressure;
        if ranks_share_memory && matches!(role, Role::Rank(_)) && self.group.is_none() {
            return Err(format!("{role} without --group"));
        }
        if self.markdown.is_some() {
            return Err(format!("{role} writes no report: --markdown is the run's"));
        }
        Ok(())
    }

    /// Checks the run before any process starts: every flag, the role of a started process,
    /// then (for the run itself) the GPUs named, the processes the machine takes and the memory
    /// estimate.
    fn check(&self) -> std::result::Result<(), String> {
        let role = self.role()?;
        let machine = Machine::detect(self.cpu, role.is_some(), false);
        let (ranks, decodes, processes, need, lower) = match self.scenario {
            PdScenario::Transfer => {
                let c = self.transfer(machine.platform)?;
                let need = if role.is_none() {
                    transfer_memory(&c).map_err(|e| e.to_string())?
                } else {
                    MemoryNeed::default()
                };
                let lower = "--pages, --layers or --ranks";
                (c.shape.ranks, 1, c.processes, need, lower)
            }
            PdScenario::Pressure => {
                let c = self.pressure(machine)?;
                let (device, host) = if role.is_none() {
                    c.memory().map_err(|e| e.to_string())?
                } else {
                    (0, 0)
                };
                let lower = "--layers, --ranks or --decodes";
                let (ranks, decodes) = (c.scenario.shape.ranks, c.processes.decodes);
                (
                    ranks,
                    decodes,
                    c.processes,
                    MemoryNeed { device, host },
                    lower,
                )
            }
        };
        if let Some(role) = role {
            return self.check_role(role, ranks, decodes);
        }
        if self.socket.is_some() || self.group.is_some() || self.storage_dir.is_some() {
            return Err(
                "--socket, --group and --storage-dir are for the processes a run starts".into(),
            );
        }
        if let Some(&g) = processes.gpus.iter().find(|&&g| g >= machine.gpus) {
            return Err(format!(
                "--gpus names GPU {g}; this machine has {}",
                machine.gpus
            ));
        }
        let count = processes.count(ranks) as usize;
        let (most, why) = if machine.platform.is_gpu() {
            let most = (PROCESSES_PER_CPU * machine.cpus).min(PROCESSES_PER_GPU * machine.gpus);
            (
                most,
                format!(
                    "{PROCESSES_PER_GPU} per GPU of {}, {PROCESSES_PER_CPU} per CPU of {}",
                    machine.gpus, machine.cpus
                ),
            )
        } else {
            (
                PROCESSES_PER_CPU * machine.cpus,
                format!("{PROCESSES_PER_CPU} per CPU of {}", machine.cpus),
            )
        };
        if count > most {
            return Err(format!(
                "pd of {ranks} ranks and {decodes} decodes would start {count} processes; this machine takes at most {most} ({why}): lower --ranks or --decodes"
            ));
        }
        fits(need, machine.platform, lower)
    }
}

/// What the transfer scenario needs on the GPU or the CPU twin.
fn transfer_memory(c: &PdConfig) -> Result<MemoryNeed> {
    let page = c.shape.geometry().page_bytes_checked()? as u64;
    let pages = add(
        mul(c.prefill_pages(), u64::from(c.shape.ranks))?,
        mul(c.decode_pages(), 2)?,
    )?;
    Ok(MemoryNeed {
        device: mul(pages, page)?,
        host: 0,
    })
}

/// Bytes a run needs of each kind of memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct MemoryNeed {
    /// Device memory (host memory on the CPU backend).
    device: u64,
    /// Pinned host memory.
    host: u64,
}

fn mul(a: u64, b: u64) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| Error::Overflow {
        what: format!("the memory estimate ({a} x {b})"),
    })
}

fn add(a: u64, b: u64) -> Result<u64> {
    a.checked_add(b).ok_or_else(|| Error::Overflow {
        what: format!("the memory estimate ({a} + {b})"),
    })
}

/// Bytes of host memory the OS says are available.
fn host_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()?
        .checked_mul(1024)
}

/// Bytes of device memory NVML says are free on GPU 0.
fn device_available() -> Option<u64> {
    let gpu = Gpu::open(0).ok()?;
    topology::free_memory(&gpu.info().pci_bus_id)
}

/// Refuses `need` when it does not fit what the machine has (host memory only, on the CPU).
fn fits(need: MemoryNeed, platform: Platform, lower: &str) -> std::result::Result<(), String> {
    let gb = |b: u64| b as f64 / 1e9;
    let host = host_available();
    let checks: [(&str, u64, Option<u64>); 2] = if platform.is_gpu() {
        [
            ("device", need.device, device_available()),
            ("pinned host", need.host, host),
        ]
    } else {
        [
            ("host", need.device.saturating_add(need.host), host),
            ("", 0, None),
        ]
    };
    for (what, bytes, available) in checks {
        if let Some(available) = available {
            if bytes > available {
                return Err(format!(
                    "the run needs {:.2} GB of {what} memory and {:.2} GB are available: lower {lower}",
                    gb(bytes),
                    gb(available)
                ));
            }
        }
    }
    Ok(())
}

/// The `--markdown` report file, opened before any process starts; written once the run has
/// its report, removed again if the run fails and the file was not there before.
struct ReportFile {
    path: PathBuf,
    file: File,
    created: bool,
}

impl ReportFile {
    /// Opens `path` for writing without truncating it (a failed run leaves an old report as it
    /// was).
    fn open(path: &Path) -> std::result::Result<ReportFile, String> {
        let created = !path.exists();
        let file = File::options()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| format!("--markdown {}: {e}", path.display()))?;
        Ok(ReportFile {
            path: path.to_path_buf(),
            file,
            created,
        })
    }

    /// Replaces the file's contents with `text`.
    fn write(mut self, text: &str) -> Result<()> {
        let os = |call| move |source| Error::Os { call, source };
        self.file.set_len(0).map_err(os("truncate the report"))?;
        self.file.rewind().map_err(os("rewind the report"))?;
        self.file
            .write_all(text.as_bytes())
            .map_err(os("write the report"))
    }

    /// Leaves no empty report behind a failed run.
    fn discard(self) {
        if self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// `kvshard pd`: the run (its report printed and written to `report`), or one of its role
/// processes.
fn pd_command(args: &PdArgs, report: Option<ReportFile>) -> ExitCode {
    let role = args.role().unwrap_or(None);
    let machine = Machine::detect(args.cpu, role.is_some(), role.is_none());
    let socket = args.socket.clone().unwrap_or_default();
    let (result, what) = match args.scenario {
        PdScenario::Transfer => (
            args.transfer(machine.platform)
                .map_err(Error::InvalidArgument)
                .and_then(|cfg| match role {
                    None => {
                        say!(
                            "pd: {} prefill processes and a decode on {}",
                            cfg.shape.ranks,
                            cfg.processes.platform
                        );
                        report_run(report, |exe| pd::run(&cfg, exe))
                    }
                    Some(Role::Decode(_)) => pd::decode_role(&cfg, &socket),
                    Some(Role::Rank(rank)) => prefill(&cfg, &socket, rank),
                }),
            "pd",
        ),
        PdScenario::Pressure => (
            args.pressure(machine)
                .map_err(Error::InvalidArgument)
                .and_then(|cfg| {
                    let group = args.group.clone().unwrap_or_default();
                    match role {
                        None => {
                            say!(
                                "pd pressure: {} prefill ranks and {} decodes on {}",
                                cfg.scenario.shape.ranks,
                                cfg.processes.decodes,
                                cfg.processes.platform
                            );
                            report_run(report, |exe| pressure::run(&cfg, exe))
                        }
                        Some(Role::Decode(d)) => pressure::decode_role(&cfg, &socket, d),
                        Some(Role::Rank(r)) => pressure::rank_role(
                            &cfg,
                            &socket,
                            &group,
                            args.storage_dir.as_deref(),
                            r,
                        ),
                    }
                }),
            "pd pressure",
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say!("{what} FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A transfer scenario's prefill rank, which must have served every request.
fn prefill(cfg: &PdConfig, socket: &Path, rank: u32) -> Result<()> {
    let s = pd::prefill_role(cfg, socket, rank)?;
    let expected = cfg.cases().len() * cfg.iterations;
    if s.served == expected && s.failed.is_empty() && s.mapped_after_close == 0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "rank {rank} served {} of {expected} requests, failed {:?}, {} pools still mapped ({})",
            s.served, s.failed, s.mapped_after_close, s.closed
        )))
    }
}

/// Runs a `pd` scenario's processes (this executable again, `run` given its path), prints the
/// report and writes it to `report` when asked.
fn report_run(
    report: Option<ReportFile>,
    run: impl FnOnce(&Path) -> Result<pd::Report>,
) -> Result<()> {
    let result = std::env::current_exe()
        .map_err(|source| Error::Os {
            call: "find the running executable",
            source,
        })
        .and_then(|exe| run(&exe));
    match (result, report) {
        (Ok(r), report) => {
            say!("{}", r.markdown);
            report.map_or(Ok(()), |f| f.write(&r.markdown))
        }
        (Err(e), report) => {
            if let Some(report) = report {
                report.discard();
            }
            Err(e)
        }
    }
}

fn demo(args: &DemoArgs) -> ExitCode {
    let gpu = if args.cpu {
        say!("backend: cpu (asked for)");
        None
    } else {
        match Gpu::open(0) {
            Ok(gpu) => Some(gpu),
            Err(e) => {
                say!("backend: cpu ({e})");
                None
            }
        }
    };
    let result = match gpu {
        Some(gpu) => {
            let streams = move || -> Result<Arc<dyn Backend>> {
                Ok(Arc::new(CudaBackend::new(gpu.clone())?))
            };
            streams().and_then(|b| args.run(b, &streams, Platform::Gpu))
        }
        None => {
            let cpu = CpuBackend::new();
            let streams = || -> Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
            args.run(Arc::new(cpu.new_stream()), &streams, Platform::Cpu)
        }
    };
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            say!("demo FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn info() -> ExitCode {
    match gpu::embedded_archs() {
        Some(archs) => {
            say!("kernels: embedded for {archs}; ptxas resource usage (registers, spills, stack, threads):");
            for line in gpu::RESOURCE_USAGE.lines() {
                say!("  {line}");
            }
        }
        None => say!("kernels: NOT embedded (built without nvcc 13.0; run scripts/install-cuda.sh and rebuild)"),
    }
    let gpu = match Gpu::open(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            say!("gpu: none usable ({e})");
            return ExitCode::SUCCESS;
        }
    };
    let i = gpu.info();
    say!(
        "gpu 0: {} (compute capability {}.{}, {} SMs, {:.1} GiB), PCI {}",
        i.name,
        i.compute_capability.0,
        i.compute_capability.1,
        i.sm_count,
        i.total_memory as f64 / (1u64 << 30) as f64,
        i.pci_bus_id
    );
    match topology::topology(&i.pci_bus_id) {
        Ok(t) => {
            let show = |v: Option<u32>| v.map_or("unknown".to_string(), |v| v.to_string());
            say!(
                "pcie: gen {} x{} (max gen {} x{}); numa node {}; driver {}",
                show(t.pcie_gen),
                show(t.pcie_width),
                show(t.pcie_max_gen),
                show(t.pcie_max_width),
                show(t.numa_node),
                t.driver.as_deref().unwrap_or("unknown")
            );
        }
        Err(why) => say!("pcie/numa: unknown ({why})"),
    }
    ExitCode::SUCCESS
}

/// Parses `args` (the program name first) into a checked plan of what to run, or the one-line
/// reason it cannot run. Nothing is allocated and no process starts. Help and version requests
/// come back as `Err` with exit status 0.
pub fn parse<I, T>(args: I) -> std::result::Result<Cli, (String, u8)>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = Cli::try_parse_from(args).map_err(|e| {
        use clap::error::ErrorKind;
        let code = match e.kind() {
            ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => 0,
            _ => 1,
        };
        let text = e.to_string();
        let line = if code == 0 {
            text
        } else {
            text.lines()
                .next()
                .unwrap_or("invalid arguments")
                .to_string()
        };
        (line, code)
    })?;
    cli.check().map_err(|why| (one_line(&why), 1))?;
    Ok(cli)
}

/// `why` on one line: a refusal is one line, whatever the error it quotes says.
fn one_line(why: &str) -> String {
    why.lines().collect::<Vec<_>>().join(" ")
}

impl Cli {
    /// Checks the run before anything is allocated or any process starts: every flag, then the
    /// processes and memory it needs against what the machine has.
    pub fn check(&self) -> std::result::Result<(), String> {
        match &self.command {
            Command::Info => Ok(()),
            Command::Demo(args) => args.check(),
            Command::Pd(args) => args.check(),
            Command::Plan(args) => args.check(),
            #[cfg(feature = "nixl")]
            Command::StorageBench(_) => Ok(()),
        }
    }
}

/// Runs the command line `args` (the program name first); what `kvshard` does.
pub fn main_with<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match parse(args) {
        Ok(cli) => cli,
        Err((line, code)) => {
            say!("{}", line.trim_end());
            return ExitCode::from(code);
        }
    };
    match cli.command {
        Command::Info => info(),
        Command::Demo(args) => demo(&args),
        Command::Pd(args) => {
            // The last check before any process starts: the report must be writable.
            let report = match args.markdown.as_deref().map(ReportFile::open).transpose() {
                Ok(report) => report,
                Err(why) => {
                    say!("{why}");
                    return ExitCode::FAILURE;
                }
            };
            pd_command(&args, report)
        }
        Command::Plan(args) => match args.run() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                say!("plan FAILED: {e}");
                ExitCode::FAILURE
            }
        },
        #[cfg(feature = "nixl")]
        Command::StorageBench(args) => storage_bench(&args),
    }
}
