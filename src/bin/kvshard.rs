//! `kvshard`: `info` says what this build and machine have; `demo` runs the end-to-end job.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::Backend;
use kvshard::demo::{self, Config, PressureConfig, StreamFactory, Summary};
use kvshard::gpu::{self, topology, Gpu};
use kvshard::hicache::Route;

#[derive(Parser)]
#[command(version, about = "Page-sharded FP8 KV cache data plane for DSA models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The kernel build, the GPU (name, SMs, memory) and where it sits (PCIe, NUMA).
    Info,
    /// The end-to-end job: sharded prefill writes, P/D transfer and a HiCache round trip of one
    /// request (`--scenario basic`), or the seed's accuracy scenario under memory pressure
    /// (`--scenario pressure`), every hand-off checked byte for byte; on the GPU if there is
    /// one, else on the CPU.
    Demo(DemoArgs),
}

/// Which job `demo` runs.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// One request through prefill writes, P/D and a HiCache round trip.
    Basic,
    /// A seeded prefix written through to the host, two prompts that force evictions, the
    /// prefix reloaded from the host and gathered into the scratch for the second one's chunks.
    Pressure,
}

#[derive(Args)]
struct DemoArgs {
    /// Which job to run.
    #[arg(long, value_enum, default_value = "basic")]
    scenario: Scenario,
    /// Run on the CPU reference backend even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    /// CP shard size N.
    #[arg(long)]
    ranks: Option<u32>,
    /// Target layers (default: 61 on the GPU, 4 on the CPU).
    #[arg(long)]
    layers: Option<usize>,
    /// Request length in tokens (pressure: each prompt's).
    #[arg(long)]
    tokens: Option<usize>,
    /// Prefill chunk size in tokens (a multiple of 64).
    #[arg(long)]
    chunk: Option<usize>,
    /// Leave the MTP draft pool out.
    #[arg(long)]
    no_draft: bool,
}

impl DemoArgs {
    fn config(&self, gpu: bool) -> Config {
        let d = Config::default_for(gpu);
        Config {
            ranks: self.ranks.unwrap_or(d.ranks),
            layers: self.layers.unwrap_or(d.layers),
            draft: !self.no_draft && d.draft,
            tokens: self.tokens.unwrap_or(d.tokens),
            chunk: self.chunk.unwrap_or(d.chunk),
            seed: d.seed,
        }
    }

    fn pressure(&self, gpu: bool) -> PressureConfig {
        let d = PressureConfig::default_for(gpu);
        PressureConfig {
            ranks: self.ranks.unwrap_or(d.ranks),
            layers: self.layers.unwrap_or(d.layers),
            draft: !self.no_draft && d.draft,
            prompt_tokens: self.tokens.unwrap_or(d.prompt_tokens),
            chunk: self.chunk.unwrap_or(d.chunk),
            ..d
        }
    }

    /// Runs the chosen scenario on `b`.
    fn run(
        &self,
        b: Arc<dyn Backend>,
        streams: StreamFactory<'_>,
        gpu: bool,
    ) -> kvshard::Result<Summary> {
        let route: Route = demo::default_route(gpu);
        match self.scenario {
            Scenario::Basic => demo::run(b, streams, &self.config(gpu), route),
            Scenario::Pressure => demo::run_pressure(b, streams, &self.pressure(gpu), route),
        }
    }
}

fn demo(args: &DemoArgs) -> ExitCode {
    let gpu = if args.cpu {
        println!("backend: cpu (asked for)");
        None
    } else {
        match Gpu::open(0) {
            Ok(gpu) => Some(gpu),
            Err(e) => {
                println!("backend: cpu ({e})");
                None
            }
        }
    };
    let result = match gpu {
        Some(gpu) => {
            let streams = move || -> kvshard::Result<Arc<dyn Backend>> {
                Ok(Arc::new(CudaBackend::new(gpu.clone())?))
            };
            streams().and_then(|b| args.run(b, &streams, true))
        }
        None => {
            let cpu = CpuBackend::new();
            let streams =
                || -> kvshard::Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
            args.run(Arc::new(cpu.new_stream()), &streams, false)
        }
    };
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            println!("demo FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn info() -> ExitCode {
    match gpu::embedded_archs() {
        Some(archs) => {
            println!("kernels: embedded for {archs}; ptxas resource usage (registers, spills, stack, threads):");
            for line in gpu::RESOURCE_USAGE.lines() {
                println!("  {line}");
            }
        }
        None => println!("kernels: NOT embedded (built without nvcc 13.0; run scripts/install-cuda.sh and rebuild)"),
    }
    let gpu = match Gpu::open(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("gpu: none usable ({e})");
            return ExitCode::SUCCESS;
        }
    };
    let i = gpu.info();
    println!(
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
            println!(
                "pcie: gen {} x{} (max gen {} x{}); numa node {}; driver {}",
                show(t.pcie_gen),
                show(t.pcie_width),
                show(t.pcie_max_gen),
                show(t.pcie_max_width),
                show(t.numa_node),
                t.driver.as_deref().unwrap_or("unknown")
            );
        }
        Err(why) => println!("pcie/numa: unknown ({why})"),
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Info => info(),
        Command::Demo(args) => demo(&args),
    }
}
