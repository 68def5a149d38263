//! Counts of the waits that block a host thread, per thread: the check behind the rule that
//! only `_sync` calls (and `synchronize`) block. Nothing in kvshard waits for a whole device
//! (`cuCtxSynchronize`) any more, so there is no such wait to count.
//!
//! Counted per thread because an engine (and a test binary) runs many threads at once: a
//! thread's count is what that thread's calls blocked on.

use std::cell::Cell;

thread_local! {
    static HOST: Cell<u64> = const { Cell::new(0) };
}

/// How often the calling thread has blocked on a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SyncCounts {
    /// Waits for one stream or one event (a `_sync` call, `synchronize`).
    pub host_blocking: u64,
}

impl std::ops::Sub for SyncCounts {
    type Output = SyncCounts;

    fn sub(self, earlier: SyncCounts) -> SyncCounts {
        SyncCounts {
            host_blocking: self.host_blocking.saturating_sub(earlier.host_blocking),
        }
    }
}

/// The calling thread's counts so far; subtract two readings to count a stretch of calls.
pub fn sync_counts() -> SyncCounts {
    SyncCounts {
        host_blocking: HOST.with(Cell::get),
    }
}

/// Counts one wait of the host for a stream or an event.
pub(crate) fn count_host_sync() {
    HOST.with(|c| c.set(c.get() + 1));
}
