//! `kvshard pd --scenario pressure`: the seed's topology across processes, one per GPU.
//!
//! The CP group's N prefill ranks and D decodes (each decode holding the full unsharded cache)
//! each run in a process of their own ([`run()`] starts them: the running executable again, with
//! a hidden role flag), every one driving the same pressure scenario
//! ([`crate::demo::pressure`]): a seeded prefix written through to the host, two prompts that
//! evict it, the prefix reloaded from the host and gathered into every rank's attention
//! scratch before each chunk of the second prompt. The ranks share a CP group memory
//! ([`kvshard::ipc::group::GroupMemory`]): the barrier, the NCCL id, and on the CPU twin or ranks that share a GPU
//! the host-staged all-gather. Each rank sends every prompt chunk to every decode as soon as
//! it is written (one launch per chunk and decode with the `blocks` method). Each decode
//! registers both prompts up front, replays the unsharded reference prefill itself and checks
//! every block that landed against it.
//!
//! GPUs: rank r on GPU r, the decodes on the GPUs after the ranks (sharing the last GPU when
//! there are not enough), or as `--gpus` says (each rank's, then each decode's).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::Backend;
use kvshard::ipc::PeerBackend;
use kvshard::Result;

use crate::scenario::Platform;

mod config;
mod dcp;
mod dcp_rank;
mod decode;
mod rank;
mod report;
mod run;

pub use config::{nccl_possible, PressurePdConfig};
pub use decode::decode_role;
pub use rank::rank_role;
pub use run::run;

/// The socket of decode `decode`: the run's socket path with the decode's index appended.
fn decode_socket(base: &Path, decode: u32) -> PathBuf {
    let mut path = base.as_os_str().to_owned();
    path.push(format!(".{decode}"));
    path.into()
}

/// New streams of `backend`'s device, for the HiCache controllers.
fn streams_of(backend: &PeerBackend) -> impl Fn() -> Result<Arc<dyn Backend>> + '_ {
    move || -> Result<Arc<dyn Backend>> {
        Ok(match backend {
            PeerBackend::Cpu(cpu) => Arc::new(cpu.new_stream()),
            PeerBackend::Cuda(cuda) => Arc::new(CudaBackend::new(cuda.gpu().clone())?),
        })
    }
}

/// The platform `backend` runs on.
fn platform(backend: &PeerBackend) -> Platform {
    match backend {
        PeerBackend::Cpu(_) => Platform::Cpu,
        PeerBackend::Cuda(_) => Platform::Gpu,
    }
}
