//! # kvshard-cli
//!
//! The applications built on kvshard, and the first engine that embeds it: they use only
//! kvshard's public API, as any serving engine would.
//!
//! - [`cli`]: the `kvshard` command line (`info`, `demo`, `pd`, `plan`), every flag checked before
//!   anything is allocated or any process starts;
//! - [`scenario`]: what every run describes the same way: the cache and CP group
//!   ([`scenario::Shape`]), where it runs, and the seed's pressure scenario;
//! - [`demo`]: one request through every stage in one process, and the pressure scenario that
//!   one process or many drive;
//! - [`pd`]: P/D across processes (the transfer matrix and the seed's topology), the processes
//!   reporting to the run in typed messages ([`pd::message`]);
//! - [`plan`]: `kvshard plan`, the capacity planner's report and the ceilings it measures;
//! - [`measure`]: throughput, event timing, repeated timings, what an engine sees of a call
//!   (window and host time) and the in-run ceilings, for the demos, `pd` and the GPU benchmark
//!   (`cargo bench -p kvshard-cli --bench gpu`);
//! - `storage_bench` (feature `nixl`): `kvshard storage-bench`, the storage tier next to a
//!   same-run fio ceiling;
//! - `storage_e2e` (feature `nixl`): its end-to-end rows, a prefix reloaded to the device from
//!   storage next to the same prefix from host memory;
//! - [`synth`]: seeded synthetic data.
#![warn(missing_docs)]

pub mod cli;
pub mod demo;
pub mod measure;
pub mod pd;
pub mod plan;
pub mod scenario;
#[cfg(feature = "nixl")]
pub mod storage_bench;
#[cfg(feature = "nixl")]
pub mod storage_e2e;
pub mod synth;

/// An [`kvshard::Error::Overflow`] naming `what`: a size computed from the flags that does not
/// fit its type.
pub(crate) fn overflow(what: impl Into<String>) -> kvshard::Error {
    kvshard::Error::Overflow { what: what.into() }
}
