//! Where a run's processes run: the roles, the GPU each sits on, the backend it opens.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::cuda::CudaBackend;
use kvshard::gpu::Gpu;
use kvshard::ipc::PeerBackend;
use kvshard::transfer::DEFAULT_DEADLINE;
use kvshard::{Error, Result};

use super::MAX_DECODES;
use crate::scenario::{Platform, Shape};

/// A process of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Prefill rank `r` of the CP group.
    Rank(u32),
    /// Decode `d`.
    Decode(u32),
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Rank(r) => write!(f, "rank {r}"),
            Role::Decode(d) => write!(f, "decode {d}"),
        }
    }
}

/// Where the processes of a run execute and how long a decode waits: what both `pd` scenarios
/// share, identical in every process of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Processes {
    /// The CPU twin (memfd pools) or GPUs.
    pub platform: Platform,
    /// Decode processes (the transfer scenario has one).
    pub decodes: u32,
    /// GPUs: each rank's, then each decode's; empty: rank r on GPU r (modulo the count), the
    /// decodes on the GPUs after the ranks, sharing the last one when there are not enough.
    pub gpus: Vec<usize>,
    /// How long a decode waits for a request, from its registration to every rank's last
    /// status, before the run fails with [`Error::TransferDeadline`].
    pub deadline: Duration,
}

impl Processes {
    /// `decodes` decode processes on `platform`, the default placement and deadline.
    pub fn new(platform: Platform, decodes: u32) -> Self {
        Self {
            platform,
            decodes,
            gpus: Vec::new(),
            deadline: DEFAULT_DEADLINE,
        }
    }

    /// Processes of a run of `ranks` prefill ranks.
    pub fn count(&self, ranks: u32) -> u32 {
        ranks.saturating_add(self.decodes)
    }

    /// Checks the processes of a run of `ranks` ranks make sense: 1 to [`MAX_DECODES`]
    /// decodes, a GPU named for each process or none, a deadline.
    pub fn check(&self, ranks: u32) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("pd: {why}")));
        if self.decodes == 0 || self.decodes > MAX_DECODES {
            return bad(format!("{} decodes (1 to {MAX_DECODES})", self.decodes));
        }
        if !self.gpus.is_empty() {
            if !self.platform.is_gpu() {
                return bad("--gpus names GPUs: a run on the CPU twin has none".into());
            }
            let count = self.count(ranks) as usize;
            if self.gpus.len() != count {
                return bad(format!(
                    "--gpus names {} GPUs; {ranks} ranks and {} decodes need {count}",
                    self.gpus.len(),
                    self.decodes
                ));
            }
        }
        if self.deadline.is_zero() {
            return bad("a deadline of 0 ms fails every request".into());
        }
        Ok(())
    }

    /// The GPU of `role` in a run of `ranks` ranks on a machine of `present` GPUs.
    pub fn gpu_of(&self, ranks: u32, role: Role, present: usize) -> usize {
        let ranks = ranks as usize;
        let at = match role {
            Role::Rank(r) => r as usize,
            Role::Decode(d) => ranks + d as usize,
        };
        if let Some(&g) = self.gpus.get(at) {
            return g;
        }
        let n = present.max(1);
        match role {
            Role::Rank(r) => r as usize % n,
            Role::Decode(d) if n > ranks => ranks + d as usize % (n - ranks),
            Role::Decode(_) => n - 1,
        }
    }

    /// Whether two or more of the `ranks` ranks share a GPU (and so its SMs and host link) on
    /// this machine: always on the CPU twin, else as the GPUs present place them.
    pub fn ranks_share_a_gpu(&self, ranks: u32) -> bool {
        let present = match self.platform {
            Platform::Cpu => 1,
            _ => gpu_count().unwrap_or(1),
        };
        ranks > 1 && !self.ranks_on_distinct_gpus(ranks, present)
    }

    /// Whether the `ranks` ranks sit on distinct GPUs of a machine of `present` (NCCL's
    /// condition).
    pub fn ranks_on_distinct_gpus(&self, ranks: u32, present: usize) -> bool {
        let mut gpus: Vec<usize> = (0..ranks)
            .map(|r| self.gpu_of(ranks, Role::Rank(r), present))
            .collect();
        gpus.sort_unstable();
        gpus.dedup();
        gpus.len() == ranks as usize
    }

    /// The backend of the process of `role` in a run of `ranks` ranks: the CPU twin, or its GPU.
    pub fn open_backend(&self, ranks: u32, role: Role) -> Result<PeerBackend> {
        if !self.platform.is_gpu() {
            return Ok(PeerBackend::Cpu(Arc::new(CpuBackend::new())));
        }
        let gpu = Gpu::open(self.gpu_of(ranks, role, gpu_count()?))?;
        Ok(PeerBackend::Cuda(Arc::new(CudaBackend::new(gpu)?)))
    }

    /// The flags that give these processes to a process of the run (`--decodes` apart: the
    /// transfer scenario takes none).
    pub(crate) fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--deadline-ms".to_string(),
            self.deadline.as_millis().to_string(),
        ];
        if !self.platform.is_gpu() {
            args.push("--cpu".into());
        }
        if !self.gpus.is_empty() {
            args.push("--gpus".into());
            args.push(list(&self.gpus));
        }
        args
    }
}

/// The flags that give `shape` to a process of the run.
pub(crate) fn shape_args(shape: &Shape) -> Vec<String> {
    let mut args = vec![
        "--ranks".to_string(),
        shape.ranks.to_string(),
        "--layers".into(),
        shape.layers.to_string(),
        "--seed".into(),
        shape.seed.to_string(),
    ];
    if !shape.draft {
        args.push("--no-draft".into());
    }
    args
}

pub(super) fn list(v: &[usize]) -> String {
    v.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// GPUs the driver sees (an error without a driver).
pub fn gpu_count() -> Result<usize> {
    if !kvshard::gpu::driver_present() {
        return Err(Error::NoDriver);
    }
    let driver = |call| move |source| Error::Driver { call, source };
    cudarc::driver::result::init().map_err(driver("cuInit"))?;
    let n = cudarc::driver::result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}
