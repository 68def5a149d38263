//! `kvshard pd`'s flags, their checks against the machine, the report file, and the command
//! that starts the processes.

use std::fs::File;
use std::io::{Seek, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, ValueEnum};
use kvshard::backend::Launch;
use kvshard::shard::DecodeLayout;
use kvshard::{Error, Result};

use crate::pd::pressure::{self, PressurePdConfig};
use crate::pd::{self, PdConfig, Role};
use crate::scenario::Platform;
use kvshard::copy::Method;

use super::demo_args::{unused, GatherArg, ShapeArgs};
use super::machine::{
    fits, transfer_memory, Machine, MemoryNeed, PROCESSES_PER_CPU, PROCESSES_PER_GPU,
};

/// Which job `pd` runs.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
pub(super) enum PdScenario {
    /// Request sizes x methods from N ranks to one decode.
    Transfer,
    /// The seed's topology under memory pressure, every rank and decode a process.
    Pressure,
}

#[derive(Args, Debug)]
pub(super) struct PdArgs {
    /// Which job to run.
    #[arg(long, value_enum, default_value = "transfer")]
    scenario: PdScenario,
    /// Run on the CPU twin (memfd pools) even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Decodes (pressure scenario; default 2): decode processes, or with --decode-dcp M
    /// decode context-parallel groups of M processes each.
    #[arg(long)]
    decodes: Option<u32>,
    /// Decode context parallelism (pressure scenario): each decode is a group of M processes,
    /// one per decode rank, each holding its share of the cache (default 1: unsharded).
    #[arg(long, value_name = "M")]
    decode_dcp: Option<u32>,
    /// Tokens a decode rank takes at a time with --decode-dcp (token t on rank (t / I) % M;
    /// default 1, 64 places whole pages).
    #[arg(long, value_name = "I")]
    decode_interleave: Option<u32>,
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
    pub(super) markdown: Option<PathBuf>,
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
        unused("--decode-dcp", self.decode_dcp.is_some(), S)?;
        unused("--decode-interleave", self.decode_interleave.is_some(), S)?;
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
        let m = self.decode_dcp.unwrap_or(1);
        c.decode_layout = DecodeLayout::new(m, self.decode_interleave.unwrap_or(1))
            .map_err(|e| format!("--decode-dcp {m}: {e}"))?;
        c.processes.decodes = c
            .processes
            .decodes
            .checked_mul(m)
            .ok_or("--decodes x --decode-dcp overflows")?;
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
    pub(super) fn check(&self) -> std::result::Result<(), String> {
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

/// The `--markdown` report file, opened before any process starts; written once the run has
/// its report, removed again if the run fails and the file was not there before.
pub(super) struct ReportFile {
    path: PathBuf,
    file: File,
    created: bool,
}

impl ReportFile {
    /// Opens `path` for writing without truncating it (a failed run leaves an old report as it
    /// was).
    pub(super) fn open(path: &Path) -> std::result::Result<ReportFile, String> {
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
pub(super) fn pd_command(args: &PdArgs, report: Option<ReportFile>) -> ExitCode {
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
                                "pd pressure: {} prefill ranks and {} decode processes on {}",
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
pub(super) fn prefill(cfg: &PdConfig, socket: &Path, rank: u32) -> Result<()> {
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
pub(super) fn report_run(
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
