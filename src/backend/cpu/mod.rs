//! The CPU reference backend: the twin of every kernel, with the same parameter structs and the
//! same semantics, on an address space of its own (so a plan's addresses mean the same thing
//! here as on the GPU). Each twin below is the specification its kernel is tested against, byte
//! for byte.
//!
//! Every [`CpuBackend::new`] gets a window of addresses no other instance uses, so a buffer of
//! one instance is refused by another ([`crate::error::Error::ForeignMemory`]) and can never be
//! read as an unrelated allocation. [`CpuBackend::new_stream`] makes another stream of the same
//! arena, like a second CUDA stream of one device.
//!
//! Work runs in one of three orders ([`StreamOrder`]):
//! - **immediate**: an operation runs when it is enqueued, so every event is complete as soon
//!   as it is recorded;
//! - **deferred**: operations queue up per stream and run only when something waits for them
//!   (a `_sync` call or `synchronize` of their stream, another stream's wait on an event or a
//!   counter). A counter wait runs the other streams one block-copy unit at a time, lowest
//!   stream first, until the counter arrives: deterministic, and fine-grained enough that
//!   per-layer readiness is observable without a GPU (a consumer that waited for layer 0 sees
//!   layer 0 landed and the last layer not yet);
//! - **adversarial**: deferred, and whenever the host waits for a stream, a seeded coin decides
//!   whether every other stream's queued work runs first or stays queued. Only recorded
//!   events and counters order streams, so work that should have waited for another stream
//!   and did not reads the old bytes (the other stream runs later) or has its bytes
//!   overwritten (the other stream runs first): an ordering bug fails on the CPU, in CI, as
//!   it would on a GPU only sometimes. Asking whether an event is done runs its stream up to
//!   it, as a GPU makes progress on its own.
//!
//! [`CpuBackend::new`] takes its order from `KVSHARD_CPU_STREAMS` (`immediate`, `deferred`,
//! `adversarial` or `adversarial:SEED`; immediate when unset). The repository's cargo
//! configuration sets it to `adversarial` for every test run.
//!
//! Freeing memory never runs queued work: an allocation whose queued work has not run stays in
//! the arena until it has (`super::usage`).

mod allocation;
mod arena;
mod cpu_backend;
mod streams;
mod twins;

pub(crate) use arena::HostBytes;
pub use cpu_backend::CpuBackend;
pub use streams::StreamOrder;
