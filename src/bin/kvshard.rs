//! `kvshard`: `info` says what this build and machine have; `demo` runs the end-to-end job.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvshard::gpu::{self, topology, Gpu};

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
}

fn info() -> ExitCode {
    match gpu::embedded_archs() {
        Some(archs) => println!("kernels: embedded for {archs}"),
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
    }
}
