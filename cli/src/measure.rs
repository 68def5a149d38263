//! Measurement, once for the demos, `kvshard pd` and the GPU benchmark: throughput ([`gbps`],
//! [`Moved`]), device time by events around enqueued work ([`time_sync`], [`time_forked_sync`],
//! and [`Laps`] for stretches of work read together later), repeated timings with warm-ups and
//! an optional L2 flush summarized as median, best and worst ([`Timer`], [`Stats`], [`Timing`]),
//! and the copy ceilings a run measures itself ([`copy_sync`], [`duplex_sync`], [`peer_sync`])
//! that every figure is reported against ([`Ceiling`]).
//!
//! What an engine sees of a call is measured beside the device time ([`EngineView`],
//! [`Timer::repeat_viewed_sync`]): the window from the call's entry to the completion of its
//! bytes, on an idle stream, and the host time of the call itself (planning and enqueueing).
//!
//! Every stretch of timed work is also checked to enqueue without blocking the host
//! ([`timed_waits`]): it is an engine's steady state, and kvshard's contract is that only its
//! `_sync` calls wait.
//!
//! Device time is a pair of events on the stream the work runs on, never the host's clock, so
//! setup and verification around the work stay out of it; only the engine's view reads the
//! host clock, around the call alone. On the CPU
//! twin the same events time the reference kernels; those figures say nothing about hardware
//! and reports mark their share of a ceiling "n/a".

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{sync_counts, Backend, Buffer, Event, MemoryKind};
use kvshard::gpu::memory::DeviceAllocation;
use kvshard::gpu::Gpu;
use kvshard::{Error, Result};
use serde::{Deserialize, Serialize};

/// GB/s of `bytes` moved in `ms` milliseconds (0 when no time passed).
pub fn gbps(bytes: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        bytes as f64 / ms / 1e6
    } else {
        0.0
    }
}

/// Bytes and device milliseconds of one kind of transfer, summed over a stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Moved {
    /// Bytes moved.
    pub bytes: u64,
    /// Device milliseconds the moves took.
    pub ms: f64,
}

impl Moved {
    /// Adds a transfer of `bytes` that took `ms`.
    pub fn add(&mut self, bytes: u64, ms: f64) {
        self.bytes += bytes;
        self.ms += ms;
    }

    /// The throughput.
    pub fn gbps(&self) -> f64 {
        gbps(self.bytes, self.ms)
    }
}

impl fmt::Display for Moved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes in {:.2} ms ({:.1} GB/s)",
            self.bytes,
            self.ms,
            self.gbps()
        )
    }
}

thread_local! {
    static TIMED: Cell<TimedWaits> = const { Cell::new(TimedWaits { stretches: 0, waits: 0 }) };
}

/// The host waits made while enqueueing timed work on this thread: what [`time_sync`],
/// [`time_forked_sync`] and [`Laps::time`] time is the work an engine enqueues in its steady
/// state (writes, gathers, sends, backups, loads), where kvshard promises not to block.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TimedWaits {
    /// Stretches of timed work enqueued.
    pub stretches: u64,
    /// Host waits (`backend::sync_counts`) made while enqueueing them.
    pub waits: u64,
}

impl std::ops::Sub for TimedWaits {
    type Output = TimedWaits;

    fn sub(self, earlier: TimedWaits) -> TimedWaits {
        TimedWaits {
            stretches: self.stretches.saturating_sub(earlier.stretches),
            waits: self.waits.saturating_sub(earlier.waits),
        }
    }
}

/// This thread's [`TimedWaits`] so far; subtract two readings to check a stretch of a run.
pub fn timed_waits() -> TimedWaits {
    TIMED.with(Cell::get)
}

/// Runs `work` (the enqueueing of timed work), counting it and the host waits it made.
fn enqueue<T>(work: impl FnOnce() -> Result<T>) -> Result<T> {
    let before = sync_counts();
    let result = work();
    let waits = (sync_counts() - before).host_blocking;
    TIMED.with(|t| {
        let now = t.get();
        t.set(TimedWaits {
            stretches: now.stretches + 1,
            waits: now.waits + waits,
        })
    });
    result
}

/// Times the work `work` enqueues on `b` with a pair of events around it; waits for the second
/// and returns the milliseconds between them.
pub fn time_sync(b: &dyn Backend, work: impl FnOnce() -> Result<()>) -> Result<f64> {
    let start = b.record_timed()?;
    enqueue(work)?;
    let end = b.record_timed()?;
    b.wait_event_sync(&end)?;
    b.elapsed_ms(&start, &end)
}

/// Times work spread over other streams: `work` gets an event of `b` to start its streams after
/// and returns an event of each stream it used, recorded after its work; `b` waits for them on
/// the device, so the time covers every stream's work, the streams running concurrently.
pub fn time_forked_sync(
    b: &dyn Backend,
    work: impl FnOnce(&Event) -> Result<Vec<Event>>,
) -> Result<f64> {
    let start = b.record_timed()?;
    for joined in enqueue(|| work(&start))? {
        b.wait(&joined)?;
    }
    let end = b.record_timed()?;
    b.wait_event_sync(&end)?;
    b.elapsed_ms(&start, &end)
}

/// Device time of several stretches of work on one stream, none waited for as it is enqueued
/// (the work runs on while the host goes on): each lap is a pair of events around the work,
/// read once, all together.
#[derive(Default)]
pub struct Laps {
    laps: Vec<(Event, Event)>,
}

impl Laps {
    /// Enqueues `work` on `b` between the events of a new lap; waits for nothing.
    pub fn time(&mut self, b: &dyn Backend, work: impl FnOnce() -> Result<()>) -> Result<()> {
        let start = b.record_timed()?;
        enqueue(work)?;
        self.laps.push((start, b.record_timed()?));
        Ok(())
    }

    /// The milliseconds of every lap so far, summed, once `b` (the laps' stream) has run them;
    /// the laps start over.
    pub fn total_ms_sync(&mut self, b: &dyn Backend) -> Result<f64> {
        if let Some((_, last)) = self.laps.last() {
            b.wait_event_sync(last)?;
        }
        self.laps
            .drain(..)
            .try_fold(0.0, |ms, (start, end)| Ok(ms + b.elapsed_ms(&start, &end)?))
    }
}

/// Median, best and worst of repeated timings, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// The median.
    pub median: f64,
    /// The best (shortest).
    pub min: f64,
    /// The worst.
    pub max: f64,
}

impl Stats {
    /// The summary of `ms`; at least one timing.
    pub fn of(mut ms: Vec<f64>) -> Result<Stats> {
        if ms.is_empty() {
            return Err(Error::InvalidArgument("no timing to summarize".into()));
        }
        ms.sort_by(f64::total_cmp);
        Ok(Stats {
            median: ms[ms.len() / 2],
            min: ms[0],
            max: ms[ms.len() - 1],
        })
    }
}

/// Repeats work on a backend's stream and times each repeat with events: warm-ups first
/// (untimed), and before every repeat, warm-ups included, an optional fill of a flush buffer on
/// the same stream so no input is still in the cache (a fill of a changing byte, so it cannot be
/// skipped).
#[derive(Clone, Copy)]
pub struct Timer<'a> {
    backend: &'a dyn Backend,
    warmups: usize,
    windows: usize,
    flush: Option<&'a Buffer>,
}

impl<'a> Timer<'a> {
    /// A timer on `backend`'s stream, no warm-up, no flush.
    pub fn new(backend: &'a dyn Backend) -> Self {
        Self {
            backend,
            warmups: 0,
            windows: 0,
            flush: None,
        }
    }

    /// The same, with `warmups` untimed runs first.
    pub fn warmups(self, warmups: usize) -> Self {
        Self { warmups, ..self }
    }

    /// The same, with `windows` runs after the warm-ups that [`Timer::repeat_viewed_sync`]
    /// times as an engine sees them (they warm up the timed runs too).
    pub fn windows(self, windows: usize) -> Self {
        Self { windows, ..self }
    }

    /// The same, filling `flush` (larger than the cache) before every run.
    pub fn flush(self, flush: &'a Buffer) -> Self {
        Self {
            flush: Some(flush),
            ..self
        }
    }

    /// The backend the timer runs on.
    pub fn backend(&self) -> &'a dyn Backend {
        self.backend
    }

    /// Runs `work` (which enqueues on the timer's stream) `runs` times after the warm-ups;
    /// each run is timed alone, its flush outside the events.
    pub fn repeat_sync(&self, runs: usize, mut work: impl FnMut() -> Result<()>) -> Result<Stats> {
        let b = self.backend;
        let mut ms = Vec::with_capacity(runs);
        for run in 0..self.warmups + runs {
            if let Some(flush) = self.flush {
                b.fill(flush, run as u8 | 1)?;
            }
            let t = time_sync(b, &mut work)?;
            if run >= self.warmups {
                ms.push(t);
            }
        }
        Stats::of(ms)
    }

    /// [`Timer::repeat_sync`] of `work`, and what an engine sees of it ([`EngineView`]): after
    /// the warm-ups, each of the timer's window runs starts on an idle stream (the flush waited
    /// for) and is timed by the host clock from the entry of `work` to the completion of what
    /// it enqueued (an event after it, waited for), and the host time `work` itself takes
    /// (planning and enqueueing) is read around every window and timed run. The timed runs'
    /// device time is as [`Timer::repeat_sync`] measures it: the flush queued ahead of them
    /// hides the host's enqueueing, so it is the transfer alone.
    pub fn repeat_viewed_sync(
        &self,
        runs: usize,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<(Stats, EngineView)> {
        let b = self.backend;
        let mut host_us = Vec::with_capacity(self.windows + runs);
        let mut windows = Vec::with_capacity(self.windows);
        for run in 0..self.warmups + self.windows {
            if let Some(flush) = self.flush {
                b.fill(flush, run as u8 | 1)?;
            }
            if run < self.warmups {
                time_sync(b, &mut work)?;
                continue;
            }
            // The engine's call starts on an idle stream: nothing queued ahead hides its
            // planning and enqueueing.
            b.synchronize()?;
            let entry = Instant::now();
            enqueue(&mut work)?;
            host_us.push(entry.elapsed().as_secs_f64() * 1e6);
            let done = b.record()?;
            b.wait_event_sync(&done)?;
            windows.push(entry.elapsed().as_secs_f64() * 1e3);
        }
        let timed = Timer {
            warmups: 0,
            windows: 0,
            ..*self
        };
        let stats = timed.repeat_sync(runs, || {
            let entry = Instant::now();
            let result = work();
            host_us.push(entry.elapsed().as_secs_f64() * 1e6);
            result
        })?;
        let view = EngineView {
            window: Stats::of(windows)?,
            host_us: Stats::of(host_us)?.median,
        };
        Ok((stats, view))
    }
}

/// Rows of at least this many pages must spend at most [`HOST_SHARE_LIMIT`] of their transfer
/// time on the host (issue 25, goal 1).
pub const HOST_SHARE_MIN_PAGES: u64 = 64;

/// The most host time per call, as a share of the transfer time, a row of
/// [`HOST_SHARE_MIN_PAGES`] or more pages may take.
pub const HOST_SHARE_LIMIT: f64 = 0.05;

/// What an engine sees of a call: the window from the entry of the call to the completion of
/// its bytes, and the host time of the call (planning plus enqueueing, not the wait).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineView {
    /// The windows, in milliseconds.
    pub window: Stats,
    /// Median host microseconds per call.
    pub host_us: f64,
}

impl EngineView {
    /// The host time per call as a share of `transfer_ms` (infinite when no time passed).
    pub fn host_share(&self, transfer_ms: f64) -> f64 {
        if transfer_ms > 0.0 {
            self.host_us / (transfer_ms * 1e3)
        } else {
            f64::INFINITY
        }
    }

    /// Whether a row of `pages` pages (`None`: it names no page count) whose transfer takes
    /// `transfer_ms` spends more than [`HOST_SHARE_LIMIT`] of it on the host, at
    /// [`HOST_SHARE_MIN_PAGES`] pages or more.
    pub fn host_heavy(&self, pages: Option<u64>, transfer_ms: f64) -> bool {
        pages.is_some_and(|p| p >= HOST_SHARE_MIN_PAGES)
            && self.host_share(transfer_ms) > HOST_SHARE_LIMIT
    }
}

/// Repeated timings of moving the same bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Bytes each run moved.
    pub bytes: u64,
    /// The runs' milliseconds.
    pub stats: Stats,
}

impl Timing {
    /// GB/s of the best run: what a ceiling is.
    pub fn best_gbps(&self) -> f64 {
        gbps(self.bytes, self.stats.min)
    }

    /// GB/s of the median run.
    pub fn median_gbps(&self) -> f64 {
        gbps(self.bytes, self.stats.median)
    }
}

/// A copy of `bytes` from a new allocation of `from` into one of `to` on the timer's stream,
/// `runs` times: the copy engine's ceiling between those kinds of memory (`Device` to `Device`,
/// `PinnedHost` to `Device`, ...).
pub fn copy_sync(
    timer: &Timer<'_>,
    from: MemoryKind,
    to: MemoryKind,
    bytes: usize,
    runs: usize,
) -> Result<Timing> {
    let b = timer.backend();
    let src = b.alloc(bytes, from)?;
    let dst = b.alloc(bytes, to)?;
    // SAFETY: two live allocations of `bytes` bytes of this backend, held until every timed run
    // has been waited for.
    let stats = timer.repeat_sync(runs, || unsafe { b.memcpy(dst.addr(), src.addr(), bytes) })?;
    Ok(Timing {
        bytes: bytes as u64,
        stats,
    })
}

/// Pinned host-to-device on the timer's stream and device-to-pinned-host on `other` at the same
/// time, `bytes` each way, `runs` times: the ceiling of both directions together (the timing
/// counts both directions' bytes).
pub fn duplex_sync(
    timer: &Timer<'_>,
    other: &dyn Backend,
    bytes: usize,
    runs: usize,
) -> Result<Timing> {
    let b = timer.backend();
    let (host, host2) = (
        b.alloc(bytes, MemoryKind::PinnedHost)?,
        b.alloc(bytes, MemoryKind::PinnedHost)?,
    );
    let (dev, dev2) = (
        b.alloc(bytes, MemoryKind::Device)?,
        b.alloc(bytes, MemoryKind::Device)?,
    );
    let stats = timer.repeat_sync(runs, || {
        let fork = b.record()?;
        other.wait(&fork)?;
        // SAFETY: live, disjoint allocations of `bytes` bytes of this device (pinned host
        // through its device alias), held until every timed run has been waited for; the two
        // directions touch disjoint buffers.
        unsafe {
            b.memcpy(dev.addr(), host.addr(), bytes)?;
            other.memcpy(host2.addr(), dev2.addr(), bytes)?;
        }
        b.wait(&other.record()?)
    })?;
    Ok(Timing {
        bytes: 2 * bytes as u64,
        stats,
    })
}

/// A copy of `bytes` from `source`'s device memory into `cuda`'s by the peer copy engine
/// (`cuMemcpyPeerAsync`, over NVLink where there is one), on `cuda`'s stream, `runs` times.
pub fn peer_sync(
    cuda: &CudaBackend,
    source: &Arc<Gpu>,
    bytes: usize,
    runs: usize,
) -> Result<Timing> {
    let dst = cuda.alloc(bytes, MemoryKind::Device)?;
    let src = DeviceAllocation::new(source.context(), bytes)?;
    let here = cuda.gpu();
    let stats = Timer::new(cuda).repeat_sync(runs, || {
        // The copy is enqueued on `cuda`'s stream, with its context current.
        here.bind()?;
        // SAFETY: both allocations hold `bytes` bytes and outlive the copy (every timed run is
        // waited for before they drop); the contexts are their devices' own.
        unsafe {
            cudarc::driver::sys::cuMemcpyPeerAsync(
                dst.addr(),
                here.context().cu_ctx(),
                src.ptr(),
                source.context().cu_ctx(),
                bytes,
                cuda.stream().raw(),
            )
        }
        .result()
        .map_err(|source| Error::Driver {
            call: "cuMemcpyPeerAsync",
            source,
        })
    })?;
    Ok(Timing {
        bytes: bytes as u64,
        stats,
    })
}

/// A ceiling measured in the same run as the figures reported against it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ceiling {
    /// What was measured ("peer copy engine GPU 0 -> GPU 1, 1 GiB").
    pub what: String,
    /// Its GB/s.
    pub gbps: f64,
    /// Whether it measures hardware: the CPU twin's copies do not, and no share of them means
    /// anything.
    pub hardware: bool,
}

impl Ceiling {
    /// `gbps` as a share of the ceiling (`93%`), or `n/a` where that means nothing (the CPU twin,
    /// or no ceiling measured).
    pub fn share(&self, gbps: f64) -> String {
        if self.hardware && self.gbps > 0.0 {
            format!("{:.0}%", 100.0 * gbps / self.gbps)
        } else {
            "n/a".into()
        }
    }
}

impl fmt::Display for Ceiling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {:.1} GB/s", self.what, self.gbps)
    }
}

/// The page count a benchmark case names (`512 pages`, `64p`) and the case with it taken out: the
/// x value and the line of the row. `None` for rows that measure no page count.
pub fn pages_of(case: &str) -> Option<(u64, String)> {
    let words: Vec<&str> = case.split(' ').collect();
    for (i, w) in words.iter().enumerate() {
        let (digits, rest) = w.split_at(w.find(|c: char| !c.is_ascii_digit()).unwrap_or(w.len()));
        let pages = match (digits.parse::<u64>(), rest) {
            (Ok(p), "p") => p,
            (Ok(p), "") if words.get(i + 1).is_some_and(|n| n.starts_with("pages")) => p,
            _ => continue,
        };
        let mut line: Vec<&str> = words.clone();
        let drop = if rest.is_empty() { 2 } else { 1 };
        let tail = words[i + drop - 1].trim_start_matches(|c: char| c.is_ascii_alphanumeric());
        line.splice(i..i + drop, (!tail.is_empty()).then_some(tail));
        return Some((pages, line.join(" ")));
    }
    None
}

#[cfg(test)]
mod tests {
    use kvshard::backend::cpu::CpuBackend;

    use super::*;

    #[test]
    fn throughput_is_bytes_over_time_and_nothing_without_time() {
        assert_eq!(gbps(2_000_000, 1.0), 2.0);
        assert_eq!(gbps(5, 0.0), 0.0);
        let mut m = Moved::default();
        m.add(1_000_000, 0.5);
        m.add(1_000_000, 0.5);
        assert_eq!(m.gbps(), 2.0);
        assert_eq!(m.to_string(), "2000000 bytes in 1.00 ms (2.0 GB/s)");
    }

    #[test]
    fn laps_add_up_the_work_they_time_and_start_over() {
        let cpu = CpuBackend::new();
        let b = cpu.new_stream();
        let mut laps = Laps::default();
        assert_eq!(laps.total_ms_sync(&b).unwrap(), 0.0);
        let buf = b.alloc(1 << 20, MemoryKind::Device).unwrap();
        let mut ran = 0;
        for byte in [1u8, 2, 3] {
            laps.time(&b, || {
                ran += 1;
                b.fill(&buf, byte)
            })
            .unwrap();
        }
        assert_eq!(ran, 3);
        assert!(laps.total_ms_sync(&b).unwrap() >= 0.0);
        // Summing waited for the last lap: its fill is done.
        assert_eq!(b.read_sync(&buf, 0, 1).unwrap(), vec![3]);
        assert_eq!(laps.total_ms_sync(&b).unwrap(), 0.0);
        let e = laps.time(&b, || Err(Error::HiCache("busy".into())));
        assert!(matches!(e, Err(Error::HiCache(_))));
    }

    #[test]
    fn stats_are_median_best_and_worst_and_need_a_timing() {
        let s = Stats::of(vec![3.0, 1.0, 2.0, 9.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 9.0));
        assert!(Stats::of(Vec::new()).is_err());
        let t = Timing {
            bytes: 4_000_000,
            stats: s,
        };
        assert_eq!(t.best_gbps(), 4.0);
    }

    #[test]
    fn a_timer_runs_the_warmups_and_times_only_the_runs() {
        let cpu = CpuBackend::new();
        let b = cpu.new_stream();
        let flush = b.alloc(64, MemoryKind::Device).unwrap();
        let mut calls = 0;
        let stats = Timer::new(&b)
            .warmups(2)
            .flush(&flush)
            .repeat_sync(3, || {
                calls += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(calls, 5);
        assert!(stats.min >= 0.0 && stats.min <= stats.median && stats.median <= stats.max);
        // The last fill (run 4) left its byte in the flush buffer.
        assert_eq!(b.read_sync(&flush, 0, 1).unwrap(), vec![5]);
        let e = Timer::new(&b).repeat_sync(1, || Err(Error::HiCache("busy".into())));
        assert!(matches!(e, Err(Error::HiCache(_))));
    }

    #[test]
    fn an_engine_view_times_every_call_and_the_windows_from_an_idle_stream() {
        let cpu = CpuBackend::new();
        let b = cpu.new_stream();
        let flush = b.alloc(64, MemoryKind::Device).unwrap();
        let buf = b.alloc(1 << 20, MemoryKind::Device).unwrap();
        let mut calls = 0;
        let (stats, view) = Timer::new(&b)
            .warmups(1)
            .windows(2)
            .flush(&flush)
            .repeat_viewed_sync(3, || {
                calls += 1;
                // Host time the call spends before it enqueues: the window holds it.
                std::thread::sleep(std::time::Duration::from_millis(2));
                b.fill(&buf, calls as u8)
            })
            .unwrap();
        assert_eq!(calls, 6);
        assert!(stats.min >= 0.0);
        assert!(view.host_us >= 2_000.0, "{view:?}");
        assert!(view.window.min >= 2.0, "{view:?}");
        // The last timed run's fill is done.
        assert_eq!(b.read_sync(&buf, 0, 1).unwrap(), vec![6]);
        let e = Timer::new(&b)
            .windows(1)
            .repeat_viewed_sync(1, || Err(Error::HiCache("busy".into())));
        assert!(matches!(e, Err(Error::HiCache(_))));
    }

    #[test]
    fn rows_of_64_pages_or_more_may_spend_5_percent_on_the_host() {
        let view = EngineView {
            window: Stats::of(vec![1.2]).unwrap(),
            host_us: 60.0,
        };
        // 60 us of a 1 ms transfer: 6%.
        assert!((view.host_share(1.0) - 0.06).abs() < 1e-12);
        assert!(view.host_heavy(Some(64), 1.0));
        assert!(!view.host_heavy(Some(63), 1.0));
        assert!(!view.host_heavy(None, 1.0));
        assert!(!view.host_heavy(Some(512), 1.2));
        assert!(view.host_heavy(Some(512), 0.0));
    }

    #[test]
    fn copy_and_duplex_ceilings_time_the_copies_they_make() {
        let cpu = CpuBackend::new();
        let (b, other) = (cpu.new_stream(), cpu.new_stream());
        let t = copy_sync(
            &Timer::new(&b),
            MemoryKind::PinnedHost,
            MemoryKind::Device,
            1 << 16,
            2,
        )
        .unwrap();
        assert_eq!(t.bytes, 1 << 16);
        let d = duplex_sync(&Timer::new(&b), &other, 1 << 16, 2).unwrap();
        assert_eq!(d.bytes, 2 << 16);
    }

    #[test]
    fn a_share_of_the_twin_or_of_no_ceiling_is_not_applicable() {
        let gpu = Ceiling {
            what: "d2d".into(),
            gbps: 200.0,
            hardware: true,
        };
        assert_eq!(gpu.share(150.0), "75%");
        let twin = Ceiling {
            hardware: false,
            ..gpu.clone()
        };
        assert_eq!(twin.share(150.0), "n/a");
        let none = Ceiling {
            gbps: 0.0,
            ..gpu.clone()
        };
        assert_eq!(none.share(150.0), "n/a");
        assert_eq!(gpu.to_string(), "d2d: 200.0 GB/s");
    }

    #[test]
    fn the_page_count_is_the_x_value_and_the_rest_names_the_line() {
        assert_eq!(
            pages_of("N=8, 512 pages x 62+62 layers, range kernel"),
            Some((512, "N=8, x 62+62 layers, range kernel".into()))
        );
        assert_eq!(
            pages_of("LayerFirst Load 64p x 62 layers, copy-engine"),
            Some((64, "LayerFirst Load x 62 layers, copy-engine".into()))
        );
        assert_eq!(
            pages_of("576 rows, 64 pages x 62 layers gather kernel"),
            Some((64, "576 rows, x 62 layers gather kernel".into()))
        );
        assert_eq!(
            pages_of("LayerFirst Load 512p + Backup 512p at once"),
            Some((512, "LayerFirst Load + Backup 512p at once".into()))
        );
        assert_eq!(pages_of("a GEMM of 8192 x 8192"), None);
    }
}
