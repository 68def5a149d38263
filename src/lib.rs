//! # kvshard
//!
//! The data plane for the KV cache of DSA models (GLM-5.x, DeepSeek-V3.2: FP8 E4M3 latent rows
//! plus indexer keys and scales, page 64) sharded page by page across the context-parallel ranks
//! of a prefill server. CUDA kernels do the byte work; this crate plans it and runs it:
//!
//! ```text
//! geometry ──> shard (placement, allocator) ──> pools (device, host)
//!                   │                              │
//!                   └──> plans (pure data, CPU) <──┘
//!                                │
//!                                v
//!                      backends execute plans
//!                      ├── cpu   (reference twin of every kernel; always available)
//!                      └── cuda  (kernels from cuda/, streams, events)
//! ```
//!
//! Every kernel has a CPU twin with the same parameter struct ([`abi`]) and semantics; tests run
//! one plan through both and compare bytes. The crate builds, and its CPU paths run, on machines
//! without CUDA; GPU entry points then return [`Error::KernelsMissing`] or [`Error::NoDriver`].
#![warn(missing_docs)]

#[allow(missing_docs, non_camel_case_types, clippy::all)]
#[rustfmt::skip]
#[path = "../bindings/abi.rs"]
pub mod abi;

pub mod backend;
pub mod demo;
pub mod error;
pub mod fp8;
pub mod geometry;
pub mod gpu;
pub mod hicache;
pub mod pool;
pub mod quantize;
pub mod shard;
pub mod synth;
pub mod transfer;

pub use error::{Error, Result};
