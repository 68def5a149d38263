//! What the pressure scenario reports of a prefill, and the grid its block copies run at: what
//! the scenario's stages (scenario.rs) and the CP gather (gather.rs) both fill in.

use kvshard::backend::{Backend, KernelFamily, Launch};
use kvshard::copy::BlockCopy;

use crate::measure::Moved;

/// What one prefill moved: owned-row writes, and for gathered prefixes the pack, the all-gather
/// and the page table; with the wall time of setup and verification apart.
#[derive(Debug, Default)]
pub(super) struct PrefillReport {
    pub(super) chunks: usize,
    pub(super) writes: Moved,
    /// The packs and the landings together (in one process they interleave layer by layer on
    /// one stream, so one pair of events times both).
    pub(super) gather: Moved,
    pub(super) packed: u64,
    pub(super) gathered: u64,
    /// Wall time of the host-staged exchanges between the processes.
    pub(super) exchange_ms: f64,
    pub(super) table_ms: f64,
    pub(super) gathers: usize,
    pub(super) evicted: Vec<String>,
    pub(super) setup_ms: f64,
    pub(super) verify_ms: f64,
}

impl PrefillReport {
    pub(super) fn add_gather(&mut self, packs: &[BlockCopy], landings: &[BlockCopy], ms: f64) {
        let packed: u64 = packs.iter().map(BlockCopy::bytes).sum();
        let gathered: u64 = landings.iter().map(BlockCopy::bytes).sum();
        self.gather.add(packed + gathered, ms);
        self.packed += packed;
        self.gathered += gathered;
    }
}

/// The grid of the scenario's device-to-device block copies: enough CTAs to fill an H200
/// (copies between device buffers are bandwidth-bound, not bytes-in-flight-bound).
pub(super) fn copy_launch(b: &dyn Backend) -> Launch {
    Launch {
        ctas: 128,
        threads: b.max_threads(KernelFamily::Copy),
    }
}

/// How the report says what a prefill evicted.
pub(super) fn evicted(report: &PrefillReport) -> String {
    if report.evicted.is_empty() {
        "evicting nothing".into()
    } else {
        format!("evicting {}", report.evicted.join(", "))
    }
}
