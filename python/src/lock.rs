//! The one way this crate takes a lock: a poisoned mutex is recovered, not propagated.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering the guard when the mutex is poisoned. A panic in another thread while
/// it held the lock already reached Python as that call's exception (PyO3 turns panics into
/// exceptions); propagating the poison would make every later Python call on the object fail
/// too, so the object stays usable, its state as the panicking call left it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
