//! The copy layer: the one place that turns "these pages of this space into those pages of that
//! space" into kernel launches and copy-engine programs. `pool`, `transfer` and `hicache` decide
//! what moves and when; everything that builds a kernel's copy parameters lives here.
//!
//! - `space`: [`BlockSpace`] (sealed: unsafe code trusts it), [`Staging`], [`RemoteSpace`];
//! - `runs`: the owner-run primitive (pair by position, filter by owner, map to local pages,
//!   coalesce) that P/D send plans and HiCache transfer plans share;
//! - `plan`: [`BlockCopyPlan`], the only builder of `kvs_copy_blocks_params` and its pair
//!   table (plain data, checked against both spaces);
//! - `decode_scatter`: [`DecodeScatterPlan`], the only builder of `kvs_decode_scatter_params`
//!   and its tables: one prefill rank's chunk into every rank of a decode context-parallel
//!   layout (docs/dcp.md), launched by [`TableStore::launch_scatter`];
//! - `program`: a plan prepared on a backend ([`BlockCopy`]) and run, and [`TableStore`] for
//!   one-shot launches;
//! - `method`: [`Method`], the one vocabulary for how bytes move (a copy kernel and its launch
//!   shape, or copy-engine calls) that every route takes;
//! - `engine`: copy-engine programs (contiguous runs, 2D copies over layers, batches);
//! - `signals`: per-layer ready counters of signalled copies;
//! - `resolver`: the device side of owner-local resolution;
//! - `scratch`: the device side of a gather plan's scratch page table.
//!
//! ```text
//!  pool / transfer / hicache (policy: what, when, acks)
//!        │ plans: OwnedRuns, BlockCopyPlan (pure data, checked against both spaces)
//!        v
//!  copy layer ── BlockCopy / TableStore ──> kvs_copy_blocks (kernel or CPU twin)
//!            └── engine programs ─────────> memcpy / memcpy_2d / memcpy_batch
//! ```

mod decode_scatter;
pub(crate) mod engine;
pub(crate) mod method;
mod plan;
pub(crate) mod program;
pub(crate) mod resolver;
pub(crate) mod runs;
pub(crate) mod scratch;
pub(crate) mod signals;
pub(crate) mod space;

pub use decode_scatter::{DecodeScatterPlan, ScatterRank, ScatterSection};
pub use engine::{Direction, IoCalls, Layers};
pub use method::{Method, WIDE_GRID_BLOCKS};
pub(crate) use plan::check_distinct;
pub use program::{BlockCopy, BlockCopyPlan, PageSelection, TableBuffer, TableStore};
pub use resolver::{scratch_rows_device_sync, Resolver};
pub use runs::{OwnedRuns, Run};
pub use scratch::ScratchTable;
pub use signals::{CounterWait, LayerSignals};
pub use space::{BlockSpace, RemoteSpace, SpaceId, Staging};
