//! `kvshard`: `info` says what this build and machine have; `demo` runs the end-to-end job; `pd`
//! runs P/D across processes.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Launch};
use kvshard::demo::{self, Config, PressureConfig, StreamFactory, Summary};
use kvshard::gpu::{self, topology, Gpu};
use kvshard::hicache::Route;
use kvshard::pd;
use kvshard::transfer::PeerMethod;

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
    /// P/D across processes: a decode process and N prefill processes (on the GPUs, or the CPU
    /// twin), the decode pool mapped into every rank; sends requests with each method, verifies
    /// the bytes and reports GB/s next to the copy ceiling.
    Pd(Box<PdArgs>),
}

#[derive(Args)]
struct PdArgs {
    /// Run on the CPU twin (memfd pools) even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    /// Prefill processes (the CP group's N).
    #[arg(long)]
    ranks: Option<u32>,
    /// Target layers (default: 61 on GPUs, 4 on the CPU).
    #[arg(long)]
    layers: Option<usize>,
    /// Leave the MTP draft out.
    #[arg(long)]
    no_draft: bool,
    /// Request sizes in pages, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pages: Option<Vec<usize>>,
    /// Pages per prefill chunk.
    #[arg(long)]
    chunk_pages: Option<usize>,
    /// Methods, comma-separated: `blocks` (once per --ctas), `blocks:CTAS[:THREADS]`, `ce`
    /// (copy-engine batch), `naive` (one copy per page and layer).
    #[arg(long, value_delimiter = ',')]
    methods: Option<Vec<String>>,
    /// CTA counts a plain `blocks` method runs with.
    #[arg(long, value_delimiter = ',')]
    ctas: Option<Vec<u32>>,
    /// Threads per CTA of the `blocks` methods.
    #[arg(long)]
    threads: Option<u32>,
    /// Requests per case (the first is verified).
    #[arg(long)]
    iterations: Option<usize>,
    /// GPUs: the decode's, then each rank's (default: the decode on the last GPU, rank r on GPU r
    /// modulo the count).
    #[arg(long, value_delimiter = ',')]
    gpus: Option<Vec<usize>>,
    /// Seed of the random blocks.
    #[arg(long)]
    seed: Option<u64>,
    /// Also write the report table to this file.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// The process's role in a run (set by `kvshard pd` for the processes it starts).
    #[arg(long, hide = true)]
    role: Option<String>,
    /// The prefill process's rank.
    #[arg(long, hide = true)]
    rank: Option<u32>,
    /// The decode's socket.
    #[arg(long, hide = true)]
    socket: Option<PathBuf>,
    /// Pause between a rank's chunks, in milliseconds.
    #[arg(long, hide = true)]
    pace_ms: Option<u64>,
}

impl PdArgs {
    fn config(&self, cpu: bool) -> Result<pd::PdConfig, String> {
        let d = pd::PdConfig::default_for(cpu);
        let threads = self.threads.unwrap_or(512);
        let ctas = self.ctas.clone().unwrap_or_else(|| {
            d.methods
                .iter()
                .filter_map(|m| match m {
                    PeerMethod::Blocks(l) => Some(l.ctas),
                    _ => None,
                })
                .collect()
        });
        let methods = match &self.methods {
            None => d
                .methods
                .iter()
                .flat_map(|m| match m {
                    PeerMethod::Blocks(_) => ctas
                        .iter()
                        .map(|&ctas| PeerMethod::Blocks(Launch { ctas, threads }))
                        .collect(),
                    other => vec![*other],
                })
                .collect(),
            Some(names) => {
                let mut methods = Vec::new();
                for name in names {
                    if name == "blocks" {
                        methods.extend(
                            ctas.iter()
                                .map(|&ctas| PeerMethod::Blocks(Launch { ctas, threads })),
                        );
                    } else {
                        methods.push(pd::parse_method(name).map_err(|e| e.to_string())?);
                    }
                }
                methods
            }
        };
        Ok(pd::PdConfig {
            cpu,
            ranks: self.ranks.unwrap_or(d.ranks),
            layers: self.layers.unwrap_or(d.layers),
            draft: !self.no_draft && d.draft,
            pages: self.pages.clone().unwrap_or(d.pages),
            chunk_pages: self.chunk_pages.unwrap_or(d.chunk_pages),
            methods,
            iterations: self.iterations.unwrap_or(d.iterations),
            gpus: self.gpus.clone().unwrap_or_default(),
            seed: self.seed.unwrap_or(d.seed),
            pace: std::time::Duration::from_millis(self.pace_ms.unwrap_or(0)),
        })
    }
}

fn pd_command(args: &PdArgs) -> ExitCode {
    let cpu = args.cpu
        || match (&args.role, Gpu::open(0)) {
            (Some(_), _) | (None, Ok(_)) => false,
            (None, Err(e)) => {
                println!("backend: cpu ({e})");
                true
            }
        };
    let cfg = match args.config(cpu) {
        Ok(cfg) => cfg,
        Err(e) => {
            println!("pd: {e}");
            return ExitCode::FAILURE;
        }
    };
    let socket = args.socket.clone().unwrap_or_default();
    let result = match (args.role.as_deref(), args.rank) {
        (None, _) => run_pd(&cfg, args.markdown.as_deref()),
        (Some("decode"), _) => pd::decode_role(&cfg, &socket),
        (Some("prefill"), Some(rank)) => pd::prefill_role(&cfg, &socket, rank).and_then(|s| {
            let expected = cfg.cases().len() * cfg.iterations;
            if s.served == expected && s.failed.is_empty() && s.mapped_after_close == 0 {
                Ok(())
            } else {
                Err(kvshard::Error::InvalidArgument(format!(
                    "rank {rank} served {} of {expected} requests, failed {:?}, {} pools still mapped ({})",
                    s.served, s.failed, s.mapped_after_close, s.closed
                )))
            }
        }),
        (Some(role), _) => Err(kvshard::Error::InvalidArgument(format!(
            "unknown role {role:?} (or a prefill role without --rank)"
        ))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("pd FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_pd(cfg: &pd::PdConfig, markdown: Option<&std::path::Path>) -> kvshard::Result<()> {
    let exe = std::env::current_exe().map_err(|source| kvshard::Error::Os {
        call: "find the running executable",
        source,
    })?;
    println!(
        "pd: decode + {} prefill processes on {}",
        cfg.ranks,
        if cfg.cpu { "the CPU twin" } else { "GPUs" }
    );
    let report = pd::run(cfg, &exe)?;
    println!("{}", report.markdown);
    if let Some(path) = markdown {
        std::fs::write(path, &report.markdown).map_err(|source| kvshard::Error::Os {
            call: "write the report",
            source,
        })?;
    }
    Ok(())
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
        Command::Pd(args) => pd_command(&args),
    }
}
