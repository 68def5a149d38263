//! The copy layer: the one place that turns "these pages of this space into those pages of that
//! space" into kernel launches and copy-engine programs. `pool`, `transfer` and `hicache` decide
//! what moves and when; everything that builds a kernel's copy parameters lives here.
//!
//! - `space`: [`BlockSpace`] (sealed: unsafe code trusts it), [`Staging`], [`RemoteSpace`];
//! - `runs`: the owner-run primitive (pair by position, filter by owner, map to local pages,
//!   coalesce) that P/D send plans and HiCache transfer plans share;
//! - `block_copy_plan`: [`BlockCopyPlan`], the only builder of `kvs_copy_blocks_params` and its pair
//!   table (plain data, checked against both spaces);
//! - `decode_scatter`: [`DecodeScatterPlan`], the only builder of `kvs_decode_scatter_params`
//!   and its tables: one prefill rank's chunk into every rank of a decode context-parallel
//!   layout (docs/dcp.md), launched by [`TableStore::launch_scatter`];
//! - `block_copy`: a plan prepared on a backend ([`BlockCopy`]) and run, and [`TableStore`] for
//!   one-shot launches;
//! - `method`: [`Method`], the one vocabulary for how bytes move (a copy kernel and its launch
//!   shape, or copy-engine calls) that every route takes;
//! - `dma`: copy-engine programs (contiguous runs, 2D copies over layers, batches);
//! - `ready_counters`: per-layer ready counters of signalled copies;
//! - `resolver`: the device side of owner-local resolution;
//! - `scratch`: the device side of a gather plan's scratch page table.
//!
//! ```text
//!  pool / transfer / hicache (policy: what, when, acks)
//!        │ plans: OwnedRuns, BlockCopyPlan (pure data, checked against both spaces)
//!        v
//!  copy layer ── BlockCopy / TableStore ──> kvs_copy_blocks (kernel or CPU twin)
//!            └── dma programs ────────────> memcpy / memcpy_2d / memcpy_batch
//! ```

pub(crate) mod block_copy;
mod block_copy_plan;
mod decode_scatter;
pub(crate) mod dma;
pub(crate) mod method;
pub(crate) mod ready_counters;
pub(crate) mod resolver;
pub(crate) mod runs;
pub(crate) mod scratch;
pub(crate) mod space;

pub use block_copy::{BlockCopy, BlockCopyPlan, PageSelection, TableBuffer, TableStore};
pub(crate) use block_copy_plan::check_distinct;
pub use decode_scatter::{DecodeScatterPlan, ScatterRank, ScatterSection};
pub use dma::{Direction, IoCalls, Layers};
pub use method::{Method, WIDE_GRID_BLOCKS};
pub use ready_counters::{CounterWait, LayerSignals};
pub use resolver::{scratch_rows_device_sync, Resolver};
pub use runs::{OwnedRuns, Run};
pub use scratch::ScratchTable;
pub use space::{BlockSpace, RemoteSpace, SpaceId, Staging};
