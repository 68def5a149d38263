//! `kvshard pd`: P/D across processes, the multi-process counterpart of `kvshard demo`.
//!
//! [`run()`] starts N prefill processes and a decode process (the running executable again, with
//! a hidden role flag), on the CPU twin or on GPUs ([`Processes`]: rank r on GPU r, the decode
//! on the GPU after the ranks or the last one, or as `--gpus` says). The decode allocates its
//! pool as exportable memory and publishes it ([`DecodeEndpoint`](kvshard::transfer::DecodeEndpoint)); each prefill rank fills its
//! own pool with random blocks, maps the decode pool and sends every request the decode
//! registers ([`PrefillEndpoint`](kvshard::transfer::PrefillEndpoint)), with the method of the request's case. Every case (request
//! size x method) runs `iterations` times; the first is verified block by block against what
//! the ranks hold, every one is timed, on the decode (registration to completion) and on each
//! rank (its stream, first chunk to last). The report is one table: GB/s, the share of the copy
//! ceiling measured in the same run (the peer copy engine across two GPUs, a local copy on one
//! GPU or the CPU), and what each chunk needed (launches, copy-engine calls, descriptors).
//!
//! Nothing waits forever: the decode gives every request [`Processes::deadline`] from its
//! registration (`--deadline-ms`), and a request still missing a rank's last status then fails
//! the run with [`Error::TransferDeadline`](kvshard::Error::TransferDeadline), naming the request, the ranks and the chunks that
//! arrived.
//!
//! Every process derives the same cases, chains and data from the same [`PdConfig`]: nothing
//! but the protocol's messages travels between them, and each process tells the parent what it
//! measured in typed [`message::Message`]s.

pub mod message;
pub mod pressure;

use std::time::Duration;

/// How long processes wait for each other to start and connect.
pub(crate) const STARTUP: Duration = Duration::from_secs(120);
/// How long a rank waits for the decodes to end a run after its last request, and what bounds
/// a run's processes with [`STARTUP`].
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Most decode processes a run may have.
pub const MAX_DECODES: u32 = 8;

mod config;
mod decode;
mod pattern;
mod prefill;
mod processes;
mod run;

use processes::list;

pub use config::{blocks, check_method, method_name, parse_method, Case, PdConfig};
pub use decode::decode_role;
pub(crate) use decode::{ceiling, rank0_gpu, DecodeWatch};
pub use pattern::{fill_pool_sync, pattern, verify_sync, Pattern};
pub(crate) use pattern::{layer_range, verify_landed};
pub use prefill::{prefill_role, PrefillSummary};
pub(crate) use processes::shape_args;
pub use processes::{gpu_count, Processes, Role};
pub use run::{run, Report};
pub(crate) use run::{run_roles, socket_path};
