//! `kvshard plan`'s flags: the model, the latent layout, the tiers' sizes and ceilings.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use kvshard::geometry::{LatentLayout, Model};
use kvshard::gpu::Gpu;
use kvshard::pool::capacity::{self, CapacityPlan, CapacityRequest, Ceilings, HostCapacity};
use kvshard::pool::BudgetRequest;
use kvshard::Result;

use crate::plan::{self, CeilingNote};

use super::demo_args::unused;

/// A model `plan` knows.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
pub(super) enum ModelArg {
    /// GLM-5: 78 layers.
    Glm5,
    /// DeepSeek-V3.2: 61 layers.
    #[value(name = "deepseek-v32")]
    DeepseekV32,
}

/// A latent row layout `plan` takes.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
pub(super) enum LatentArg {
    /// FP8 E4M3 "trtllm", 576-byte rows (the sharded DSA path's).
    Fp8Trtllm,
    /// FP8 E4M3 "scaled" (FlashMLA), 656-byte rows.
    Fp8Scaled,
    /// bf16, 1,152-byte rows.
    Bf16,
}

#[derive(Args, Debug)]
pub(super) struct PlanArgs {
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
    pub(super) fn check(&self) -> std::result::Result<(), String> {
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
    pub(super) fn run(&self) -> Result<()> {
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
