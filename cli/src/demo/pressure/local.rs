//! What one process of the pressure scenario holds ([`Local`]: its ranks' pools, how their send
//! buffers reach the other ranks, the storage directory), and the checks that it fits.

use std::sync::Arc;

use kvshard::copy::BlockSpace;
use kvshard::ipc::group::GroupMemory;
use kvshard::pool::DevicePool;
use kvshard::{Error, Result};

use crate::scenario::PressureConfig;

/// How the ranks' packed send buffers reach every rank's attention scratch.
pub(crate) enum AllGather {
    /// Every rank is in this process: device copies land each owner's send buffer in every
    /// rank's scratch (on one device, the all-gather emulated).
    InProcess,
    /// One rank per process, the processes sharing this group memory: a rank's packed send
    /// buffer goes through its slot in host shared memory, and every rank copies the others'
    /// to its device and lands them as the in-process copies do. The CPU twin's all-gather, and
    /// the one for ranks that share a GPU (which NCCL refuses).
    HostStaged(GroupMemory),
    /// NCCL between ranks on distinct GPUs: per layer, the pack and one `ncclAllGather` per
    /// component land every rank's block straight in every scratch.
    #[cfg(feature = "nccl")]
    Nccl {
        /// This rank's communicator.
        group: kvshard::nccl::NcclGroup,
        /// The scenario's backend, as NCCL needs it (its stream).
        cuda: Arc<kvshard::backend::cuda::CudaBackend>,
    },
}

impl AllGather {
    /// How the report names it.
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            AllGather::InProcess => "the all-gather emulated by device copies in one process",
            AllGather::HostStaged(_) => {
                "the all-gather staged through host shared memory between the rank processes"
            }
            #[cfg(feature = "nccl")]
            AllGather::Nccl { .. } => "the all-gather over NCCL between the rank processes",
        }
    }
}

impl std::fmt::Debug for AllGather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

/// What one process of the scenario holds.
#[derive(Debug)]
pub(crate) struct Local {
    /// The CP ranks' pools that live here, [`PressureConfig::pages_per_rank`] pages each on the
    /// scenario's backend: every rank (the demo), one (a rank process) or none (a decode).
    pub(crate) pools: Vec<Arc<DevicePool>>,
    /// How their send buffers reach the other ranks.
    pub(crate) all_gather: AllGather,
    /// The storage step's directory, made private by the parent of a rank process (`None`:
    /// every rank is here and the step makes its own, or no rank is).
    pub(crate) storage_dir: Option<std::path::PathBuf>,
}

/// Checks what a process holds fits the scenario: local pools of the group's shape, each rank
/// once; a host-staged all-gather's group of the same ranks, holding exactly its own rank's
/// pool, with slots that hold a send buffer.
pub(super) fn check_local(cfg: &PressureConfig, local: &Local, per_rank: u64) -> Result<()> {
    let bad = |why: String| Err(Error::InvalidArgument(format!("pressure scenario: {why}")));
    let g = cfg.shape.geometry();
    let mut seen = std::collections::HashSet::new();
    for pool in &local.pools {
        if pool.placement().shard() != cfg.shape.ranks
            || pool.pages() != per_rank
            || pool.geometry() != &g
            || !seen.insert(pool.rank())
        {
            return bad(format!(
                "a pool of rank {} of {} with {} pages (each of the {} ranks once, {per_rank} pages, the scenario's geometry)",
                pool.rank(),
                pool.placement().shard(),
                pool.pages(),
                cfg.shape.ranks
            ));
        }
    }
    // A shared storage directory is for rank processes of a group run; with every rank (or
    // none) here there is nothing to share it with.
    if local.storage_dir.is_some() && seen.len() != 1 {
        return bad("a shared storage directory is for a process holding one rank".into());
    }
    let send_bytes = cfg.send_bytes()?;
    match &local.all_gather {
        AllGather::InProcess
            if !local.pools.is_empty() && seen.len() != cfg.shape.ranks as usize =>
        {
            bad("an in-process all-gather needs every rank in the process".into())
        }
        AllGather::HostStaged(group)
            if group.ranks() != cfg.shape.ranks
                || seen.len() != 1
                || !seen.contains(&group.rank())
                || group.slot_bytes() < send_bytes =>
        {
            bad(format!(
                "a host-staged group of {} ranks with {}-byte slots, as rank {}, for ranks {seen:?} ({} bytes per send buffer)",
                group.ranks(),
                group.slot_bytes(),
                group.rank(),
                send_bytes
            ))
        }
        _ => Ok(()),
    }
}
