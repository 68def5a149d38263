//! `kvshard demo`'s flags (the shape, the scenario, the gather), their checks, and the command.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::Backend;
use kvshard::gpu::Gpu;
use kvshard::Result;

use crate::demo::{self, Config, StreamFactory, Summary};
use crate::scenario::{Platform, PressureConfig, Shape};

use super::machine::{add, fits, mul, Machine, MemoryNeed};

/// The flags every scenario shares: the cache and the CP group ([`Shape`]).
#[derive(Args, Debug)]
pub(super) struct ShapeArgs {
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
    pub(super) fn apply(&self, shape: Shape) -> Shape {
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
pub(super) enum DemoScenario {
    /// One request through prefill writes, P/D and a HiCache round trip.
    Basic,
    /// A seeded prefix written through to the host, two prompts that force evictions, the
    /// prefix reloaded from the host and gathered into the scratch for the second one's chunks.
    Pressure,
}

#[derive(Args, Debug)]
pub(super) struct DemoArgs {
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
pub(super) enum GatherArg {
    /// NCCL where it can run, else host shared memory.
    Auto,
    /// NCCL (each rank on a GPU of its own); refused where it cannot run.
    Nccl,
    /// Host shared memory (the CPU twin's, and ranks sharing a GPU).
    Host,
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
    pub(super) fn check(&self) -> std::result::Result<(), String> {
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
pub(super) fn unused(name: &str, given: bool, why: &str) -> std::result::Result<(), String> {
    if given {
        Err(format!("{name} does nothing {why}"))
    } else {
        Ok(())
    }
}

pub(super) fn demo(args: &DemoArgs) -> ExitCode {
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
