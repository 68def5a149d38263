//! What a run needs of the machine against what it has: processes per CPU and GPU, device and
//! host memory (NVML, the OS).

use std::io::Write;

use kvshard::gpu::{topology, Gpu};
use kvshard::{Error, Result};

use crate::pd::{self, PdConfig};
use crate::scenario::Platform;

/// Processes a `pd` run may start per CPU this process may use: every process polls its
/// channels, and on the CPU twin computes on the CPU too; crowded past that, they time-slice so
/// hard that heartbeats (every 100 ms; a peer silent for 750 ms is gone) start to fail.
pub const PROCESSES_PER_CPU: usize = 4;

/// Processes a `pd` run may start per GPU: each holds a CUDA context and its pools on the GPU
/// it shares.
pub const PROCESSES_PER_GPU: usize = 8;

/// The machine a run is checked against: where it runs and what it has.
#[derive(Debug, Clone, Copy)]
pub(super) struct Machine {
    pub(super) platform: Platform,
    /// GPUs the driver sees (0 on the CPU twin, and unprobed in a started process).
    pub(super) gpus: usize,
    /// CPUs this process may use.
    pub(super) cpus: usize,
    /// Whether this is a process a `pd` run started: it is told its platform (`--cpu` or not)
    /// and its all-gather, and probes nothing.
    pub(super) started: bool,
}

impl Machine {
    /// The CPU twin when `cpu` says so or no GPU opens (saying why when `tell`), else GPUs; a
    /// started process is on GPUs unless told `--cpu`.
    pub(super) fn detect(cpu: bool, started: bool, tell: bool) -> Machine {
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

/// What the transfer scenario needs on the GPU or the CPU twin.
pub(super) fn transfer_memory(c: &PdConfig) -> Result<MemoryNeed> {
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
pub(super) struct MemoryNeed {
    /// Device memory (host memory on the CPU backend).
    pub(super) device: u64,
    /// Pinned host memory.
    pub(super) host: u64,
}

pub(super) fn mul(a: u64, b: u64) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| Error::Overflow {
        what: format!("the memory estimate ({a} x {b})"),
    })
}

pub(super) fn add(a: u64, b: u64) -> Result<u64> {
    a.checked_add(b).ok_or_else(|| Error::Overflow {
        what: format!("the memory estimate ({a} + {b})"),
    })
}

/// Bytes of host memory the OS says are available.
pub(super) fn host_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()?
        .checked_mul(1024)
}

/// Bytes of device memory NVML says are free on GPU 0.
pub(super) fn device_available() -> Option<u64> {
    let gpu = Gpu::open(0).ok()?;
    topology::free_memory(&gpu.info().pci_bus_id)
}

/// Refuses `need` when it does not fit what the machine has (host memory only, on the CPU).
pub(super) fn fits(
    need: MemoryNeed,
    platform: Platform,
    lower: &str,
) -> std::result::Result<(), String> {
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
