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
use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvshard::gpu::{self, topology, Gpu};

/// Prints a line; a closed stdout (a pipe into `head`) is not an error worth dying for.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

mod demo_args;
mod machine;
mod pd_args;
mod plan_args;
#[cfg(feature = "nixl")]
mod storage_bench_args;

pub use machine::{PROCESSES_PER_CPU, PROCESSES_PER_GPU};

use demo_args::{demo, DemoArgs};
use pd_args::{pd_command, PdArgs, ReportFile};
use plan_args::PlanArgs;
#[cfg(feature = "nixl")]
use storage_bench_args::{storage_bench, StorageBenchArgs};

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
