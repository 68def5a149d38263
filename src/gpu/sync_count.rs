//! Counts of the waits that block a host thread, per thread: the check behind the rule that
//! only `_sync` calls (and `synchronize`) block, and that nothing waits for the whole device.
//!
//! Counted per thread because an engine (and a test binary) runs many threads at once: a
//! thread's count is what that thread's calls blocked on.

use std::cell::Cell;

thread_local! {
    static HOST: Cell<u64> = const { Cell::new(0) };
    static DEVICE: Cell<u64> = const { Cell::new(0) };
}

/// How often the calling thread has blocked on a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SyncCounts {
    /// Waits for one stream or one event (a `_sync` call, `synchronize`).
    pub host_blocking: u64,
    /// Waits for every stream of a device (`cuCtxSynchronize`): only the unmapping of
    /// memory another process exported still does it.
    pub device_wide: u64,
}

impl std::ops::Sub for SyncCounts {
    type Output = SyncCounts;

    fn sub(self, earlier: SyncCounts) -> SyncCounts {
        SyncCounts {
            host_blocking: self.host_blocking.saturating_sub(earlier.host_blocking),
            device_wide: self.device_wide.saturating_sub(earlier.device_wide),
        }
    }
}

/// The calling thread's counts so far; subtract two readings to count a stretch of calls.
pub fn sync_counts() -> SyncCounts {
    SyncCounts {
        host_blocking: HOST.with(Cell::get),
        device_wide: DEVICE.with(Cell::get),
    }
}

/// Counts one wait of the host for a stream or an event.
pub(crate) fn count_host_sync() {
    HOST.with(|c| c.set(c.get() + 1));
}

/// Counts one wait of the host for a whole device (also a host-blocking wait).
pub(crate) fn count_device_sync() {
    DEVICE.with(|c| c.set(c.get() + 1));
    count_host_sync();
}
