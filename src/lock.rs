//! The one way the library takes a lock: a poisoned mutex (a thread panicked while holding it)
//! is taken anyway. Every critical section here leaves its state consistent before anything
//! that can panic, so a panic elsewhere in the engine must not turn every later call into a
//! panic of its own.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering it when poisoned.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
