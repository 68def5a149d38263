//! The `kvshard` command line (feature `cli`): `info` says what this build and machine have;
//! `demo` runs the end-to-end job; `pd` runs P/D across processes.
//!
//! Every run is checked before anything is allocated: flags are bounded by what the formats
//! allow, and the memory a run needs is estimated and compared with what the machine has (device
//! memory through NVML, host memory from the OS). A run that cannot fit is refused with one line
//! naming the bytes and the flag to lower, and exit status 1; no input makes it panic or abort.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, Launch};
use crate::demo::{self, Config, PressureConfig, StreamFactory, Summary};
use crate::gpu::{self, topology, Gpu};
use crate::hicache::Route;
use crate::pd;
use crate::transfer::PeerMethod;

/// Prints a line; a closed stdout (a pipe into `head`) is not an error worth dying for.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// Most CP ranks a run may have: what a P/D receiver accepts per request.
pub const MAX_RANKS: u32 = crate::transfer::MAX_PREFILL_RANKS;
/// Most target layers a run may have: far above any model (DeepSeek-V3.2 has 61, GLM-5 78),
/// and well inside the 32-bit layer indices of the kernels' pair tables and ready counters.
pub const MAX_LAYERS: usize = 4096;

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
    /// P/D across processes: a decode process and N prefill processes (on the GPUs, or the CPU
    /// twin), the decode pool mapped into every rank; sends requests with each method, verifies
    /// the bytes and reports GB/s next to the copy ceiling (`--scenario transfer`). Or the seed's
    /// topology (`--scenario pressure`): CP prefill ranks with the CP gather, write-through and
    /// reload, sending every chunk to each of the decodes, one process per GPU.
    Pd(Box<PdArgs>),
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
    /// Decode processes (pressure scenario; default 2).
    #[arg(long)]
    decodes: Option<u32>,
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
    /// The decode's socket (pressure: the decodes' sockets' stem).
    #[arg(long, hide = true)]
    socket: Option<PathBuf>,
    /// The CP group memory of the pressure scenario's ranks.
    #[arg(long, hide = true)]
    group: Option<PathBuf>,
    /// How the pressure scenario's ranks all-gather prefix pages: `auto` (NCCL when each rank
    /// has a GPU of its own and libnccl loads, else through host shared memory), `nccl`, `host`.
    #[arg(long, value_enum)]
    all_gather: Option<GatherArg>,
    /// Pause between a rank's chunks, in milliseconds.
    #[arg(long, hide = true)]
    pace_ms: Option<u64>,
    /// How long a decode waits for a request, in milliseconds, from its registration to every
    /// rank's last status; past it the run fails naming the ranks and chunks that never came
    /// (default 300000).
    #[arg(long)]
    deadline_ms: Option<u64>,
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
            deadline: self
                .deadline_ms
                .map_or(d.deadline, std::time::Duration::from_millis),
        })
    }
}

impl PdArgs {
    /// The pressure scenario's run: its defaults, with what the flags say.
    fn pressure_config(&self, cpu: bool) -> Result<pd::pressure::PressurePdConfig, String> {
        let mut c = pd::pressure::PressurePdConfig::default_for(cpu);
        let sc = &mut c.scenario;
        sc.ranks = self.ranks.unwrap_or(sc.ranks);
        sc.layers = self.layers.unwrap_or(sc.layers);
        sc.draft = !self.no_draft && sc.draft;
        sc.seed = self.seed.unwrap_or(sc.seed);
        c.decodes = self.decodes.unwrap_or(c.decodes);
        c.gpus = self.gpus.clone().unwrap_or_default();
        c.nccl = self.all_gather == Some(GatherArg::Nccl);
        if let Some(ms) = self.deadline_ms {
            c.deadline = std::time::Duration::from_millis(ms);
        }
        match (&self.methods, &self.ctas) {
            (Some(names), _) if names.len() == 1 && names[0] != "blocks" => {
                c.method = pd::parse_method(&names[0]).map_err(|e| e.to_string())?
            }
            (None, Some(ctas)) if ctas.len() == 1 => {
                c.method = PeerMethod::Blocks(Launch {
                    ctas: ctas[0],
                    threads: self.threads.unwrap_or(512),
                })
            }
            (None, None) => {}
            _ => {
                return Err(
                    "the pressure scenario sends with one method: --methods M or --ctas C".into(),
                )
            }
        }
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

/// `kvshard pd --scenario pressure`: the run, or one of its role processes.
fn pressure_command(args: &PdArgs, cpu: bool) -> crate::Result<()> {
    let invalid = |e: String| crate::Error::InvalidArgument(e);
    let mut cfg = args.pressure_config(cpu).map_err(invalid)?;
    let socket = args.socket.clone().unwrap_or_default();
    let group = args.group.clone().unwrap_or_default();
    match (args.role.as_deref(), args.rank) {
        (None, _) => {
            let present = if cpu { 0 } else { pd::gpu_count()? };
            let possible = pd::pressure::nccl_possible(&cfg, present);
            cfg.nccl = match args.all_gather.unwrap_or(GatherArg::Auto) {
                GatherArg::Auto => possible,
                GatherArg::Host => false,
                GatherArg::Nccl if possible => true,
                GatherArg::Nccl => {
                    return Err(invalid(
                        "--all-gather nccl needs each rank on a GPU of its own, the nccl feature and libnccl"
                            .into(),
                    ))
                }
            };
            say!(
                "pd pressure: {} prefill ranks and {} decodes on {}",
                cfg.scenario.ranks,
                cfg.decodes,
                if cfg.cpu { "the CPU twin" } else { "GPUs" }
            );
            report_run(args.markdown.as_deref(), |exe| pd::pressure::run(&cfg, exe))
        }
        (Some("decode"), Some(d)) => pd::pressure::decode_role(&cfg, &socket, d),
        (Some("prefill"), Some(r)) => pd::pressure::rank_role(&cfg, &socket, &group, r),
        (Some(role), _) => Err(invalid(format!(
            "unknown role {role:?} (or a role without --rank)"
        ))),
    }
}

fn pd_command(args: &PdArgs) -> ExitCode {
    let cpu = args.cpu
        || match (&args.role, Gpu::open(0)) {
            (Some(_), _) | (None, Ok(_)) => false,
            (None, Err(e)) => {
                say!("backend: cpu ({e})");
                true
            }
        };
    if args.scenario == PdScenario::Pressure {
        return match pressure_command(args, cpu) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                say!("pd pressure FAILED: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let cfg = match args.config(cpu) {
        Ok(cfg) => cfg,
        Err(e) => {
            say!("pd: {e}");
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
                Err(crate::Error::InvalidArgument(format!(
                    "rank {rank} served {} of {expected} requests, failed {:?}, {} pools still mapped ({})",
                    s.served, s.failed, s.mapped_after_close, s.closed
                )))
            }
        }),
        (Some(role), _) => Err(crate::Error::InvalidArgument(format!(
            "unknown role {role:?} (or a prefill role without --rank)"
        ))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say!("pd FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_pd(cfg: &pd::PdConfig, markdown: Option<&std::path::Path>) -> crate::Result<()> {
    say!(
        "pd: decode + {} prefill processes on {}",
        cfg.ranks,
        if cfg.cpu { "the CPU twin" } else { "GPUs" }
    );
    report_run(markdown, |exe| pd::run(cfg, exe))
}

/// Runs a `pd` scenario's processes (this executable again, `run` given its path), prints the
/// report and writes it to `markdown` when asked.
fn report_run(
    markdown: Option<&std::path::Path>,
    run: impl FnOnce(&std::path::Path) -> crate::Result<pd::Report>,
) -> crate::Result<()> {
    let exe = std::env::current_exe().map_err(|source| crate::Error::Os {
        call: "find the running executable",
        source,
    })?;
    let report = run(&exe)?;
    say!("{}", report.markdown);
    if let Some(path) = markdown {
        std::fs::write(path, &report.markdown).map_err(|source| crate::Error::Os {
            call: "write the report",
            source,
        })?;
    }
    Ok(())
}

/// Which job `demo` runs.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Scenario {
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
    ) -> crate::Result<Summary> {
        let route: Route = demo::default_route(gpu);
        match self.scenario {
            Scenario::Basic => demo::run(b, streams, &self.config(gpu), route),
            Scenario::Pressure => demo::run_pressure(b, streams, &self.pressure(gpu), route),
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
            let streams = move || -> crate::Result<Arc<dyn Backend>> {
                Ok(Arc::new(CudaBackend::new(gpu.clone())?))
            };
            streams().and_then(|b| args.run(b, &streams, true))
        }
        None => {
            let cpu = CpuBackend::new();
            let streams = || -> crate::Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
            args.run(Arc::new(cpu.new_stream()), &streams, false)
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
/// reason it cannot run. Nothing is allocated. Help and version requests come back as `Err`
/// with exit status 0.
pub fn parse<I, T>(args: I) -> Result<Cli, (String, u8)>
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
    cli.check().map_err(|why| (why, 1))?;
    Ok(cli)
}

/// Bytes a run needs of each kind of memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryNeed {
    /// Device memory (host memory on the CPU backend).
    pub device: u64,
    /// Pinned host memory.
    pub host: u64,
}

fn bounds(ranks: Option<u32>, layers: Option<usize>) -> Result<(), String> {
    if let Some(r) = ranks {
        if r == 0 || r > MAX_RANKS {
            return Err(format!("--ranks {r}: a run has 1 to {MAX_RANKS} CP ranks"));
        }
    }
    if let Some(l) = layers {
        if l == 0 || l > MAX_LAYERS {
            return Err(format!(
                "--layers {l}: a model has 1 to {MAX_LAYERS} target layers"
            ));
        }
    }
    Ok(())
}

fn mul(a: u64, b: u64, what: &str) -> Result<u64, String> {
    a.checked_mul(b)
        .ok_or_else(|| format!("{what} overflows 64 bits"))
}

impl DemoArgs {
    /// What the chosen scenario needs, on the GPU (`gpu`) or the CPU.
    fn memory(&self, gpu: bool) -> Result<MemoryNeed, String> {
        bounds(self.ranks, self.layers)?;
        match self.scenario {
            Scenario::Basic => {
                let c = self.config(gpu);
                if c.chunk == 0 || c.chunk % 64 != 0 || c.tokens == 0 {
                    return Err(format!(
                        "--chunk {} for --tokens {}: chunks are a non-zero multiple of 64 tokens",
                        c.chunk, c.tokens
                    ));
                }
                let page = c
                    .geometry()
                    .page_bytes_checked()
                    .map_err(|e| e.to_string())? as u64;
                let pages = (c.tokens as u64).div_ceil(64) + 2;
                let per_rank = c.pages_per_rank();
                // The ranks' pools, the reference, three decode pools, the staging.
                let pools = mul(per_rank, u64::from(c.ranks), "pool pages")?
                    .checked_add(mul(pages, 4, "reference and decode pages")?)
                    .ok_or("pool pages overflow 64 bits")?;
                let device = mul(pools, page, "device bytes")?
                    .checked_add(mul((c.chunk as u64).div_ceil(64), page, "staging bytes")?)
                    .ok_or("device bytes overflow 64 bits")?;
                let host = mul(
                    mul(per_rank, u64::from(c.ranks), "host pages")?,
                    page,
                    "host bytes",
                )?;
                Ok(MemoryNeed { device, host })
            }
            Scenario::Pressure => {
                let c = self.pressure(gpu);
                let per_rank = c.pages_per_rank().map_err(|e| e.to_string())?;
                let page = c
                    .geometry()
                    .page_bytes_checked()
                    .map_err(|e| e.to_string())? as u64;
                let pool_pages = mul(per_rank, u64::from(c.ranks), "pool pages")?;
                let reference = ((c.prefix_tokens + 2 * c.prompt_tokens) as u64).div_ceil(64) + 2;
                // The ranks' pools, the reference, two decode pools, staging and scratch slots
                // (about a reference's worth).
                let device = mul(
                    pool_pages
                        .checked_add(mul(reference, 4, "reference pages")?)
                        .ok_or("device pages overflow 64 bits")?,
                    page,
                    "device bytes",
                )?;
                let host = mul(
                    mul(pool_pages, c.host_factor, "host pages")?,
                    page,
                    "host bytes",
                )?;
                Ok(MemoryNeed { device, host })
            }
        }
    }
}

impl PdArgs {
    /// What the run needs on the GPU or the CPU twin.
    fn memory(&self, cpu: bool) -> Result<MemoryNeed, String> {
        bounds(self.ranks, self.layers)?;
        if self.scenario == PdScenario::Pressure {
            let c = self.pressure_config(cpu)?;
            let need = c.memory().map_err(|e| e.to_string())?;
            return Ok(MemoryNeed {
                device: need.0,
                host: need.1,
            });
        }
        let c = self.config(cpu)?;
        c.validate().map_err(|e| e.to_string())?;
        let page = c
            .geometry()
            .page_bytes_checked()
            .map_err(|e| e.to_string())? as u64;
        let pages = mul(c.prefill_pages(), u64::from(c.ranks), "prefill pages")?
            .checked_add(mul(c.decode_pages(), 2, "decode pages")?)
            .ok_or("pages overflow 64 bits")?;
        Ok(MemoryNeed {
            device: mul(pages, page, "device bytes")?,
            host: 0,
        })
    }
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
fn fits(need: MemoryNeed, gpu: bool, lower: &str) -> Result<(), String> {
    let gb = |b: u64| b as f64 / 1e9;
    let host = host_available();
    let checks: [(&str, u64, Option<u64>); 2] = if gpu {
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

impl Cli {
    /// Checks the run before anything is allocated: bounds, then the memory estimate.
    pub fn check(&self) -> Result<(), String> {
        match &self.command {
            Command::Info => Ok(()),
            Command::Demo(args) => {
                let gpu = !args.cpu && Gpu::open(0).is_ok();
                let need = args.memory(gpu).map_err(|why| {
                    let c = args.config(gpu);
                    format!(
                        "demo of {} tokens in chunks of {}, {} layers, {} ranks: {why}",
                        c.tokens, c.chunk, c.layers, c.ranks
                    )
                })?;
                fits(need, gpu, "--tokens, --layers or --ranks")
            }
            Command::Pd(args) => {
                if args.role.is_some() {
                    return Ok(());
                }
                let cpu = args.cpu || Gpu::open(0).is_err();
                let need = args.memory(cpu)?;
                let lower = match args.scenario {
                    PdScenario::Transfer => "--pages, --layers or --ranks",
                    PdScenario::Pressure => "--layers, --ranks or --decodes",
                };
                fits(need, !cpu, lower)
            }
        }
    }
}

/// Runs the command line `args` (the program name first); what `kvshard` does.
pub fn main_with<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match parse(args) {
        Ok(cli) => match cli.command {
            Command::Info => info(),
            Command::Demo(args) => demo(&args),
            Command::Pd(args) => pd_command(&args),
        },
        Err((line, code)) => {
            say!("{}", line.trim_end());
            ExitCode::from(code)
        }
    }
}
