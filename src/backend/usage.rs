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
//!   parked ([`pending_frees`]) and freed by the first sweep that finds those events complete:
//!   any allocation, synchronization or free sweeps, and while memory waits for work on a GPU
//!   kvshard's reaper thread sweeps every millisecond (`gpu::reaper`), so it goes once its work
//!   has run even if the engine calls kvshard no more. Nothing blocks the host or the device to
//!   free memory: the frees themselves never wait on the caller's thread (`gpu::memory`), and
//!   [`wait_for_frees_sync`] is the one wait for them, for a caller that needs the memory back.
//!
//! Granularity is the usage (one allocation, or one whole space: a pool), narrowed to pages
//! where the work knows them ([`Pages`], [`ordered_pages`]: HiCache's copies name the pages of
//! the two pools they touch), so work of two streams on other pages of one pool is not
//! ordered; docs/design.md says where kvshard names pages and where the whole memory.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{count_host_sync, Backend, Event};
use crate::error::{Error, Result};
use crate::gpu::{mempool, reaper};
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

/// Which pages of a space an access touches: all of them, or the listed local pages (sorted,
/// distinct). A page stands for every byte of it in every component and layer of the space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Pages {
    /// The whole memory (every access that names no pages).
    All,
    /// These local pages only.
    Some(Arc<[u64]>),
}

impl Pages {
    /// The pages `pages` names, in any order, repeats allowed.
    pub(crate) fn of(pages: impl IntoIterator<Item = u64>) -> Self {
        let mut v: Vec<u64> = pages.into_iter().collect();
        v.sort_unstable();
        v.dedup();
        Pages::Some(v.into())
    }

    /// Whether the two share a page.
    fn meets(&self, other: &Pages) -> bool {
        let (Pages::Some(a), Pages::Some(b)) = (self, other) else {
            return true;
        };
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            match a[i].cmp(&b[j]) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => return true,
            }
        }
        false
    }

    /// Whether every page of `other` is one of these.
    fn covers(&self, other: &Pages) -> bool {
        match (self, other) {
            (Pages::All, _) => true,
            (Pages::Some(_), Pages::All) => false,
            (Pages::Some(a), Pages::Some(b)) => b.iter().all(|p| a.binary_search(p).is_ok()),
        }
    }
}

/// One access: the event after the work of `stream` that made it, and the pages it touched.
struct Access {
    stream: StreamId,
    event: Event,
    pages: Pages,
}

/// The events of the last accesses to some memory.
#[derive(Default)]
struct Accesses {
    /// Later work on a stream completes after earlier work, so an access stands for the earlier
    /// accesses of its stream to pages it covers: at most one whole-memory access per stream,
    /// and accesses of some pages only while their work is queued.
    reads: Vec<Access>,
    writes: Vec<Access>,
    /// Work was enqueued whose event could not be recorded (a failing device): when it
    /// completes is unknown, so the memory is never freed.
    unknown: bool,
}

impl Accesses {
    /// Events other streams recorded that work of `stream` on `pages` must wait for: writes,
    /// and for a write also reads, of a page it touches.
    fn conflicts(&self, stream: StreamId, write: bool, pages: &Pages, into: &mut Vec<Event>) {
        let reads = if write { &self.reads[..] } else { &[] };
        for a in self.writes.iter().chain(reads) {
            if a.stream != stream && a.pages.meets(pages) && !into.contains(&a.event) {
                into.push(a.event.clone());
            }
        }
    }

    fn record(&mut self, stream: StreamId, event: &Event, write: bool, pages: &Pages) {
        if write && *pages == Pages::All {
            // The write waited for every other stream's access, so its event completes after
            // all of them: it alone stands for them from now on.
            self.reads.clear();
            self.writes.clear();
        }
        let list = if write {
            &mut self.writes
        } else {
            &mut self.reads
        };
        // This stream's earlier accesses of pages this one covers complete before it.
        list.retain(|a| !(a.stream == stream && pages.covers(&a.pages)));
        if *pages != Pages::All {
            // Accesses of some pages accumulate across streams; those whose work has run order
            // nothing any more (an error keeps them: waiting longer is safe).
            list.retain(|a| !a.event.is_complete().unwrap_or(false));
        }
        list.push(Access {
            stream,
            event: event.clone(),
            pages: pages.clone(),
        });
    }

    fn events(self) -> impl Iterator<Item = Event> {
        let unknown = self.unknown;
        self.reads
            .into_iter()
            .chain(self.writes)
            .map(|a| a.event)
            .chain(unknown.then(Event::never))
    }
}

struct Inner {
    accesses: Mutex<Accesses>,
    /// The memory this usage keeps alive (an allocation's owner, or a space's buffers).
    keep: Option<Box<dyn Send + Sync>>,
    /// What else must outlive the memory's work ([`Usage::keep_alive`]).
    also: Mutex<Vec<Box<dyn Send + Sync>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let accesses = std::mem::take(&mut *lock(&self.accesses));
        let pending: Vec<Event> = accesses
            .events()
            .filter(|e| !e.is_complete().unwrap_or(true))
            .collect();
        let kept = Kept {
            keep: self.keep.take(),
            also: std::mem::take(&mut *lock(&self.also)),
        };
        if !pending.is_empty() && !kept.is_empty() {
            let cuda = pending
                .iter()
                .any(|e| matches!(e.stream_id(), StreamId::Cuda(_)));
            lock(&GRAVES).push(Grave {
                events: pending,
                cuda,
                _kept: kept,
            });
            if cuda {
                reaper::watch("parked frees", sweep_gpu);
            }
        } else {
            drop(kept);
        }
        sweep();
    }
}

/// What a usage keeps alive, let go in this order: the memory, then what must outlive it.
struct Kept {
    keep: Option<Box<dyn Send + Sync>>,
    also: Vec<Box<dyn Send + Sync>>,
}

impl Kept {
    fn is_empty(&self) -> bool {
        self.keep.is_none() && self.also.is_empty()
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        drop(self.keep.take());
        drop(std::mem::take(&mut self.also));
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
            also: Mutex::new(Vec::new()),
        }))
    }

    /// Keeps `owner` alive until this record and every access it holds are gone: what holds
    /// memory an engine lent kvshard (the tensors a pool wraps), so that memory outlives the
    /// work kvshard queued on it however early the engine drops its handles.
    pub fn keep_alive(&self, owner: Box<dyn Send + Sync>) {
        lock(&self.0.also).push(owner);
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
    ordered_pages(backend, &whole(reads), &whole(writes), work)
}

/// [`ordered`] for work that touches only some pages of each memory: a `(usage, pages)` pair
/// per memory, so work of two streams on disjoint pages of one pool (a HiCache load and a
/// backup) is not ordered. The pages must cover every byte the work touches in that memory.
pub(crate) fn ordered_pages<T>(
    backend: &dyn Backend,
    reads: &[(&Usage, &Pages)],
    writes: &[(&Usage, &Pages)],
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

/// Each usage with the whole of its memory.
fn whole<'a>(usages: &[&'a Usage]) -> Vec<(&'a Usage, &'static Pages)> {
    static ALL: Pages = Pages::All;
    usages.iter().map(|u| (*u, &ALL)).collect()
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
    let (reads, writes) = (whole(reads), whole(writes));
    wait_conflicts(backend, &reads, &writes)?;
    let out = work();
    let recorded = record(backend, &reads, &writes, timed);
    let out = out?;
    Ok((out, recorded?))
}

/// Makes `backend`'s stream wait for the earlier accesses of other streams that conflict with
/// work reading `reads` and writing `writes`.
fn wait_conflicts(
    backend: &dyn Backend,
    reads: &[(&Usage, &Pages)],
    writes: &[(&Usage, &Pages)],
) -> Result<()> {
    let stream = backend.stream_id();
    let mut waits = Vec::new();
    for (usages, write) in [(writes, true), (reads, false)] {
        for (u, pages) in usages {
            lock(&u.0.accesses).conflicts(stream, write, pages, &mut waits);
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
    let recorded = record(backend, &whole(reads), &[], false);
    let out = out?;
    recorded?;
    Ok(out)
}

/// Records the point `backend`'s stream has reached (a timed event if `timed`) on every usage,
/// as a read or a write, and returns it. When the event cannot be had, the usages are marked as
/// holding work of unknown completion.
fn record(
    backend: &dyn Backend,
    reads: &[(&Usage, &Pages)],
    writes: &[(&Usage, &Pages)],
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
            for (u, _) in reads.iter().chain(writes) {
                lock(&u.0.accesses).unknown = true;
            }
            return Err(e);
        }
    };
    for (u, pages) in writes {
        lock(&u.0.accesses).record(stream, &event, true, pages);
    }
    for (u, pages) in reads {
        // A read of pages the same work writes is recorded as the write.
        if !writes.iter().any(|(w, wp)| w.same(u) && wp.covers(pages)) {
            lock(&u.0.accesses).record(stream, &event, false, pages);
        }
    }
    Ok(event)
}

/// The events of queued work that a host access of `pages` of `usage` (a `_sync` call reading
/// or writing the memory itself, outside every stream: the storage tier) must wait for: every
/// stream's writes of those pages and, for a host write, their reads too. The host is on no
/// stream, so no access is left out as ordered by its stream. Work whose event could not be
/// recorded (a failing device) cannot be waited for: an error.
#[cfg(feature = "nixl")]
pub(crate) fn host_conflicts(usage: &Usage, write: bool, pages: &Pages) -> Result<Vec<Event>> {
    let a = lock(&usage.0.accesses);
    if a.unknown {
        return Err(crate::error::Error::HiCache(
            "work of unknown completion (its event could not be recorded) uses this memory: \
             a host access cannot be ordered after it"
                .into(),
        ));
    }
    let reads = if write { &a.reads[..] } else { &[] };
    let mut out: Vec<Event> = Vec::new();
    for x in a.writes.iter().chain(reads) {
        if x.pages.meets(pages) && !out.contains(&x.event) {
            out.push(x.event.clone());
        }
    }
    Ok(out)
}

/// Memory whose last handle went while work that uses it was still queued.
struct Grave {
    events: Vec<Event>,
    /// Whether some of the work is a GPU's (the reaper thread sweeps for it).
    cuda: bool,
    _kept: Kept,
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

/// The reaper thread's sweep: whether memory still waits for work on a GPU.
fn sweep_gpu() -> bool {
    sweep();
    lock(&GRAVES).iter().any(|g| g.cuda)
}

/// Frees not done yet, in the whole process: allocations waiting for queued work, and frees
/// handed to the reaper thread and not done yet.
pub fn pending_frees() -> usize {
    sweep();
    lock(&GRAVES).len() + reaper::pending()
}

/// Waits until the memory dropped so far while work on a GPU used it is freed (that work
/// completed, then the free done, on the reaper thread where it goes there), then hands what
/// kvshard's stream-ordered pools hold beyond their allocations, and the `cuMemAlloc` and
/// pinned host blocks kept for reuse (`gpu::cached_bytes`), back to the driver: for a
/// caller that needs the memory of dropped objects back (to allocate as much again, or to free
/// or register again host memory kvshard registered). Memory parked behind work of the CPU
/// twin is not waited for: that work runs only when its stream is waited for. Refused with
/// [`Error::Timeout`] once `timeout` has passed (`Duration::MAX`: no deadline).
pub fn wait_for_frees_sync(timeout: Duration) -> Result<()> {
    count_host_sync();
    let start = Instant::now();
    let deadline = start.checked_add(timeout);
    let gpu_parked = || lock(&GRAVES).iter().filter(|g| g.cuda).count();
    loop {
        sweep();
        if gpu_parked() == 0 {
            // Nothing waits for GPU work: what is left is the reaper's, whose frees may park
            // more (a free that lets go of another usage), so look again once it is done.
            let far = || start + Duration::from_secs(100 * 365 * 24 * 3600);
            if reaper::wait_idle(deadline.unwrap_or_else(far)) && gpu_parked() == 0 {
                crate::gpu::memory::release_sync();
                return mempool::trim_all_sync();
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Error::Timeout {
                what: format!(
                    "frees: {} allocations waiting for work on a GPU, {} frees on the reaper \
                     thread",
                    gpu_parked(),
                    reaper::pending()
                ),
                waited: timeout,
            });
        }
        std::thread::sleep(reaper::POLL);
    }
}
