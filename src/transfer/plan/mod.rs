//! Send plans: what one prefill rank moves to the decode pool for one chunk of one request, as
//! plain data built on the CPU without a backend.
//!
//! The order of the steps matters (docs/design.md, "P/D"). Source and destination pages are paired
//! by **logical page position** first, because the position is the only index both sides share
//! (the decode registered one page per position after its cached prefix); the pairs are then
//! filtered to the positions this rank owns (source logical page `% N == rank`), and only then
//! is each owned source page resolved to this rank's local page (`/ N`). Resolving or filtering
//! first would lose the position and with it the destination page.
//!
//! Runs where both the local source page and the destination page advance by one are
//! coalesced. A descriptor is relative to the base of its (component, layer) buffer on each
//! side, `(src0 * item, dst0 * item, run * item)` with `item` the component's block bytes, so
//! one list of runs serves every stored layer of a component: a plan keeps the runs once per
//! [`Section`] (latent KV, indexer state) together with the layers they apply to, and
//! [`SendPlan::descriptors`] expands them layer by layer. Send order: target latent layers, the
//! draft latent layer; then, with the final chunk only, the indexer state of the whole sequence
//! from position 0: target indexer layers (layers that have one: zero-size shared-indexer
//! layers never appear), then the draft indexer.
//!
//! Everything is validated before any byte moves, and every page of the chunk is checked, not
//! only the owned ones, so all ranks of a group refuse a bad request at the same chunk.
//!
//! The module by job: `request` holds what a plan is made for (the rank, the decode's
//! registration, the chunk), `build` pairs, filters, resolves and coalesces them into a plan
//! and checks every page, `send_plan` holds the plan itself (its sections and descriptors, plain
//! data) and what it answers, and `dcp` the plans into a decode server sharded by token.

mod build;
mod dcp;
mod request;
mod send_plan;

// Defined with the pools it describes (ipc describes pools with it too, below transfer).
pub use crate::pool::layout::PoolLayout;
pub use dcp::{DecodePlan, DecodeRank, DecodeRegistration, DecodeSection};
pub use request::{ChunkRange, PrefillRank, Registration};
pub use send_plan::{Descriptor, Section, SectionComponent, SendPlan};
