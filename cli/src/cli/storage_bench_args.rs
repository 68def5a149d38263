//! `kvshard storage-bench`'s flags (feature `nixl`) and the command that runs it.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::Backend;
use kvshard::gpu::Gpu;
use kvshard::Result;

use crate::demo::StreamFactory;
use crate::scenario::Shape;

/// `kvshard storage-bench`'s flags.
#[derive(Args, Debug)]
pub(super) struct StorageBenchArgs {
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

pub(super) fn storage_bench(args: &StorageBenchArgs) -> ExitCode {
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
