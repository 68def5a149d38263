//! Frees that may wait for the whole device, done on a thread of kvshard's own.
//!
//! `cuMemFree` of `cuMemAlloc` memory, `cuMemFreeHost`, `cuMemHostUnregister`, the VMM unmap
//! and release calls, `cuIpcCloseMemHandle` and `cuModuleUnload` may synchronize the device by
//! the driver's choice: on the H200 a `cuMemFreeHost` waited 55-61 ms for 40 matmuls queued on
//! another library's stream. kvshard never calls them on the caller's thread: memory whose own
//! work has completed (`backend::usage` frees nothing earlier) is handed here, and this thread
//! makes the call. The caller's drop returns at once; the memory goes back to the driver as soon
//! as the driver lets this thread free it. (kvshard's own device memory does not come here at
//! all: it comes from a stream-ordered pool and is freed with `cuMemFreeAsync`, which never
//! waits, `super::mempool`.)
//!
//! Bounded: one thread per process, started by the first deferred free; its queue holds only
//! memory callers have already given up, freed in the order given; [`pending`] counts it (and
//! `backend::pending_frees` with the memory still waiting for its work), and
//! `backend::wait_for_frees_sync` waits for both, with a deadline, for a caller that needs the
//! memory back (to allocate as much again, or to free or register again memory kvshard
//! registered). Where no thread can be started, a free runs on the caller's thread, as before.
//!
//! The thread also sweeps the memory still waiting for its work on a GPU (`watch`), every
//! [`POLL`] while there is any, so that memory is freed once its work has completed even when
//! the engine makes no further kvshard call.
//!
//! At process exit the thread stops (an `atexit` handler, registered when it starts, so it runs
//! before the driver's own teardown): it finishes the call it is in, within [`EXIT_GRACE`], and
//! makes no other. A driver call racing the driver's teardown crashed processes at exit under
//! compute-sanitizer; what is still queued then is the process's memory, which the OS reclaims.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::lock::lock;

/// How often the thread sweeps memory that waits for its work on a GPU.
pub(crate) const POLL: Duration = Duration::from_millis(1);

/// How long process exit waits for the call the thread is making.
const EXIT_GRACE: Duration = Duration::from_millis(500);

type Job = Box<dyn FnOnce() + Send>;

/// A sweep by name: run until it says nothing more is pending.
type Sweep = (&'static str, fn() -> bool);

struct State {
    queue: VecDeque<Job>,
    /// Jobs taken off the queue and not finished yet.
    running: usize,
    /// The process that started the thread (a child forked from it has no thread).
    started: Option<u32>,
    /// Sweeps to run every [`POLL`], each while it says more is pending, by name.
    sweeps: Vec<Sweep>,
    /// The process is exiting: the thread makes no further call.
    exiting: bool,
    /// The thread is running the sweeps (driver calls, like a job).
    sweeping: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    queue: VecDeque::new(),
    running: 0,
    started: None,
    sweeps: Vec::new(),
    exiting: false,
    sweeping: false,
});
/// Wakes the thread: a job or a sweep was handed over.
static WORK: Condvar = Condvar::new();
/// Wakes waiters of [`wait_idle`]: the queue ran dry.
static IDLE: Condvar = Condvar::new();

/// Runs `free` on the reaper thread, after the frees handed over before it. `free` must not
/// block on anything but the driver call it makes.
pub(crate) fn defer(free: impl FnOnce() + Send + 'static) {
    let mut state = lock(&STATE);
    if !start(&mut state) {
        drop(state);
        free();
        return;
    }
    state.queue.push_back(Box::new(free));
    WORK.notify_one();
}

/// Has the thread call `sweep` (known as `name`) every [`POLL`] until it returns false (nothing
/// more pending).
pub(crate) fn watch(name: &'static str, sweep: fn() -> bool) {
    let mut state = lock(&STATE);
    if !start(&mut state) {
        return;
    }
    add(&mut state.sweeps, (name, sweep));
    WORK.notify_one();
}

fn add(sweeps: &mut Vec<Sweep>, sweep: Sweep) {
    if !sweeps.iter().any(|(name, _)| *name == sweep.0) {
        sweeps.push(sweep);
    }
}

/// Frees handed over and not done yet.
pub(crate) fn pending() -> usize {
    let state = lock(&STATE);
    state.queue.len() + state.running
}

/// Waits until every free handed over so far is done, or `deadline` passes; whether they are.
pub(crate) fn wait_idle(deadline: Instant) -> bool {
    let mut state = lock(&STATE);
    loop {
        if state.queue.is_empty() && state.running == 0 {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        state = IDLE
            .wait_timeout(state, deadline - now)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0;
    }
}

/// Starts the thread once per process; false when it cannot be started.
fn start(state: &mut State) -> bool {
    let pid = std::process::id();
    if state.started != Some(pid) {
        // In a child forked while the thread was busy, that job is not running here.
        state.running = 0;
        let spawned = std::thread::Builder::new()
            .name("kvshard-reaper".into())
            .spawn(run)
            .is_ok();
        if spawned && state.started.is_none() {
            // Once per process image (a forked child inherits the registration).
            // SAFETY: `atexit` takes a plain function of no arguments that does not unwind
            // (`stop_at_exit` only locks, flags and waits with a deadline).
            unsafe { atexit(stop_at_exit) };
        }
        state.started = spawned.then_some(pid);
    }
    state.started.is_some()
}

extern "C" {
    /// The C library's: runs `f` at `exit`, before the handlers registered earlier (the
    /// driver's teardown among them: it was registered when the driver loaded).
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

/// Stops the thread for process exit: no further call, and the one it is in finished (for at
/// most [`EXIT_GRACE`]).
extern "C" fn stop_at_exit() {
    let mut state = match STATE.try_lock() {
        Ok(state) => state,
        // Held by a thread that exit left running (or poisoned): waiting could hang exit.
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    state.exiting = true;
    WORK.notify_all();
    let deadline = Instant::now() + EXIT_GRACE;
    while state.running > 0 || state.sweeping {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        state = IDLE
            .wait_timeout(state, deadline - now)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0;
    }
}

fn run() {
    let mut state = lock(&STATE);
    loop {
        if state.exiting {
            // Parked until the process is gone.
            state = WORK
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            continue;
        }
        if let Some(job) = state.queue.pop_front() {
            state.running += 1;
            drop(state);
            job();
            state = lock(&STATE);
            state.running -= 1;
            if (state.queue.is_empty() || state.exiting) && state.running == 0 {
                IDLE.notify_all();
            }
            continue;
        }
        if !state.sweeps.is_empty() {
            // Taken while they run: a `watch` meanwhile adds its sweep again, whatever this
            // round finds.
            let sweeps = std::mem::take(&mut state.sweeps);
            state.sweeping = true;
            drop(state);
            let more: Vec<_> = sweeps.into_iter().filter(|(_, sweep)| sweep()).collect();
            state = lock(&STATE);
            state.sweeping = false;
            if state.exiting {
                IDLE.notify_all();
            }
            for sweep in more {
                add(&mut state.sweeps, sweep);
            }
            if !state.sweeps.is_empty() && state.queue.is_empty() {
                state = WORK
                    .wait_timeout(state, POLL)
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .0;
            }
            continue;
        }
        state = WORK
            .wait(state)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn frees_run_off_the_callers_thread_in_order_and_are_waited_for() {
        let caller = std::thread::current().id();
        let order = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        {
            let gate = gate.clone();
            defer(move || {
                let (open, cv) = &*gate;
                let mut open = lock(open);
                while !*open {
                    open = cv.wait(open).unwrap();
                }
            });
        }
        for i in 0..3 {
            let order = order.clone();
            defer(move || {
                assert_ne!(std::thread::current().id(), caller);
                lock(&order).push(i);
            });
        }
        // The first free is held: the others wait behind it, and a wait with a past deadline
        // says so without blocking.
        assert!(pending() >= 3);
        assert!(!wait_idle(Instant::now()));
        *lock(&gate.0) = true;
        gate.1.notify_all();
        assert!(wait_idle(Instant::now() + Duration::from_secs(10)));
        assert_eq!(*lock(&order), vec![0, 1, 2]);
    }

    static SWEPT: AtomicUsize = AtomicUsize::new(0);

    fn three_sweeps() -> bool {
        SWEPT.fetch_add(1, Ordering::SeqCst) < 2
    }

    #[test]
    fn a_watched_sweep_runs_until_nothing_is_pending() {
        watch("three sweeps", three_sweeps);
        let deadline = Instant::now() + Duration::from_secs(10);
        while SWEPT.load(Ordering::SeqCst) < 3 && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        std::thread::sleep(10 * POLL);
        assert_eq!(SWEPT.load(Ordering::SeqCst), 3, "swept until it said done");
    }
}
