//! The asynchronous contract's bookkeeping: which queued work uses which memory.
//!
//! Every [`Buffer`](super::Buffer) (and every block space, for all of its buffers at once) has a
//! [`Usage`]: the last read and the last write kvshard enqueued on it, per stream, as events.
//! Two rules follow from it, the model cudarc uses for its slices:
//!
//! - **Ordering is tracked.** Before kvshard enqueues work that reads memory, the stream waits
//!   (stream-side, never the host) for the last writes other streams enqueued on it; before work
//!   that writes, for the last reads and writes of other streams ([`ordered`]). Work of one
//!   stream is ordered by the stream itself. What kvshard cannot see (the engine's own kernels)
//!   is ordered by the engine: `Backend::wait` on the stream it hands kvshard.
//! - **Lifetimes follow the GPU.** Memory is given back only after every event recorded on its
//!   usage has completed: when the last handle goes while work is still queued, the memory is
//!   parked ([`pending_frees`]) and freed by a later call that finds those events complete
//!   (any allocation, synchronization or free does the sweep). Nothing blocks the host or the
//!   device to free memory.
//!
//! Granularity is the usage: one allocation, or one whole space (a pool). Two accesses to
//! different pages of one pool on two streams are still ordered; docs/design.md says why that
//! is the trade kvshard makes.

use std::fmt;
use std::sync::{Arc, Mutex};

use super::{Backend, Event};
use crate::error::Result;
use crate::lock::lock;

/// Identity of one stream: events of one stream complete in the order they were recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamId {
    /// Stream `stream` of CPU arena `arena`.
    Cpu {
        /// The arena.
        arena: u64,
        /// The stream's index in its arena.
        stream: u64,
    },
    /// A CUDA stream, by its handle's value.
    Cuda(u64),
}

/// The events of the last accesses to some memory.
#[derive(Default)]
struct Accesses {
    /// At most one event per stream: later work on a stream completes after earlier work.
    reads: Vec<(StreamId, Event)>,
    writes: Vec<(StreamId, Event)>,
    /// Work was enqueued whose event could not be recorded (a failing device): when it
    /// completes is unknown, so the memory is never freed.
    unknown: bool,
}

impl Accesses {
    /// Events other streams recorded that work of `stream` must wait for: writes, and for a
    /// write also reads.
    fn conflicts(&self, stream: StreamId, write: bool, into: &mut Vec<Event>) {
        let reads = if write { &self.reads[..] } else { &[] };
        for (s, e) in self.writes.iter().chain(reads) {
            if *s != stream && !into.contains(e) {
                into.push(e.clone());
            }
        }
    }

    fn record(&mut self, stream: StreamId, event: &Event, write: bool) {
        if write {
            // The write waited for every other stream's access, so its event completes after
            // all of them: it alone stands for them from now on.
            self.reads.clear();
            self.writes.clear();
            self.writes.push((stream, event.clone()));
        } else {
            self.reads.retain(|(s, _)| *s != stream);
            self.reads.push((stream, event.clone()));
        }
    }

    fn events(self) -> impl Iterator<Item = Event> {
        let unknown = self.unknown;
        self.reads
            .into_iter()
            .chain(self.writes)
            .map(|(_, e)| e)
            .chain(unknown.then(Event::never))
    }
}

struct Inner {
    accesses: Mutex<Accesses>,
    /// The memory this usage keeps alive (an allocation's owner, or a space's buffers).
    keep: Option<Box<dyn Send + Sync>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let accesses = std::mem::take(&mut *lock(&self.accesses));
        let pending: Vec<Event> = accesses
            .events()
            .filter(|e| !e.is_complete().unwrap_or(true))
            .collect();
        let keep = self.keep.take();
        if let (false, Some(keep)) = (pending.is_empty(), keep) {
            lock(&GRAVES).push(Grave {
                events: pending,
                _keep: keep,
            });
        }
        sweep();
    }
}

/// Which queued work reads and writes some memory, and the memory itself until that work has
/// completed. Clones share one record.
#[derive(Clone)]
pub struct Usage(Arc<Inner>);

impl fmt::Debug for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = lock(&self.0.accesses);
        f.debug_struct("Usage")
            .field("reads", &a.reads.len())
            .field("writes", &a.writes.len())
            .finish()
    }
}

impl Usage {
    /// A record with no accesses yet, keeping `keep` alive until the record and every access
    /// it holds are gone.
    pub(crate) fn new(keep: Option<Box<dyn Send + Sync>>) -> Self {
        Self(Arc::new(Inner {
            accesses: Mutex::new(Accesses::default()),
            keep,
        }))
    }

    /// Whether two handles share one record.
    pub(crate) fn same(&self, other: &Usage) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Enqueues `work` on `backend`'s stream ordered after every earlier access of other streams
/// that conflicts with it (work that reads `reads` waits for their writes; work that writes
/// `writes` waits for their reads and writes), then records the work's event on every usage.
/// Nothing here blocks the host. A usage named in both lists counts as written.
pub(crate) fn ordered<T>(
    backend: &dyn Backend,
    reads: &[&Usage],
    writes: &[&Usage],
    work: impl FnOnce() -> Result<T>,
) -> Result<T> {
    wait_conflicts(backend, reads, writes)?;
    // Recorded even when the work failed: part of it may be enqueued already (a program of
    // copies cut short), and what it names must outlive that part too.
    let out = work();
    let recorded = record(backend, reads, writes, false);
    let out = out?;
    recorded?;
    Ok(out)
}

/// [`ordered`], whose record on the usages is also returned: the one point of the stream that
/// tells the caller when the work has run (a transfer's completion, what must be kept alive
/// until then, and with `timed` its device time), with no event recorded for it alone. An
/// untimed event is lighter on the stream (no timestamp between two launches).
pub(crate) fn ordered_event<T>(
    backend: &dyn Backend,
    reads: &[&Usage],
    writes: &[&Usage],
    timed: bool,
    work: impl FnOnce() -> Result<T>,
) -> Result<(T, Event)> {
    wait_conflicts(backend, reads, writes)?;
    let out = work();
    let recorded = record(backend, reads, writes, timed);
    let out = out?;
    Ok((out, recorded?))
}

/// Makes `backend`'s stream wait for the earlier accesses of other streams that conflict with
/// work reading `reads` and writing `writes`.
fn wait_conflicts(backend: &dyn Backend, reads: &[&Usage], writes: &[&Usage]) -> Result<()> {
    let stream = backend.stream_id();
    let mut waits = Vec::new();
    for (usages, write) in [(writes, true), (reads, false)] {
        for u in usages {
            lock(&u.0.accesses).conflicts(stream, write, &mut waits);
        }
    }
    for e in &waits {
        if !e.is_complete()? {
            backend.wait(e)?;
        }
    }
    Ok(())
}

/// Enqueues `work`, which reads `reads` without needing their writes first (a wait for a ready
/// counter a copy still increments), and records it on them: the memory stays until the work
/// has run, and a later write waits for it.
pub(crate) fn kept<T>(
    backend: &dyn Backend,
    reads: &[&Usage],
    work: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let out = work();
    let recorded = record(backend, reads, &[], false);
    let out = out?;
    recorded?;
    Ok(out)
}

/// Records the point `backend`'s stream has reached (a timed event if `timed`) on every usage,
/// as a read or a write, and returns it. When the event cannot be had, the usages are marked as
/// holding work of unknown completion.
fn record(
    backend: &dyn Backend,
    reads: &[&Usage],
    writes: &[&Usage],
    timed: bool,
) -> Result<Event> {
    let stream = backend.stream_id();
    let event = if timed {
        backend.record_timed()
    } else {
        backend.record()
    };
    let event = match event {
        Ok(event) => event,
        Err(e) => {
            for u in reads.iter().chain(writes) {
                lock(&u.0.accesses).unknown = true;
            }
            return Err(e);
        }
    };
    for u in writes {
        lock(&u.0.accesses).record(stream, &event, true);
    }
    for u in reads {
        if !writes.iter().any(|w| w.same(u)) {
            lock(&u.0.accesses).record(stream, &event, false);
        }
    }
    Ok(event)
}

/// Memory whose last handle went while work that uses it was still queued.
struct Grave {
    events: Vec<Event>,
    _keep: Box<dyn Send + Sync>,
}

static GRAVES: Mutex<Vec<Grave>> = Mutex::new(Vec::new());

/// Frees the parked memory whose work has completed. The memory is dropped after the lock is
/// released: a free may itself lock a backend (the CPU arena) or park more memory.
pub(crate) fn sweep() {
    let done: Vec<Grave> = {
        let mut graves = lock(&GRAVES);
        if graves.is_empty() {
            return;
        }
        let (done, waiting) = std::mem::take(&mut *graves)
            .into_iter()
            .partition(|g| g.events.iter().all(|e| e.is_complete().unwrap_or(true)));
        *graves = waiting;
        done
    };
    drop(done);
}

/// Allocations waiting for queued work before they are freed, in the whole process.
pub fn pending_frees() -> usize {
    sweep();
    lock(&GRAVES).len()
}
