//! The GPU benchmark harness: the device, the ceilings measured in this run, event timing with an
//! L2 flush before every timed repeat and what an engine sees of the same call (window, host
//! time; [`Ctx::time`] for every section), random fills, and the report. The timing and the ceilings
//! are `kvshard_cli::measure`'s, as the demos and `kvshard pd` measure.

use std::fmt::Write as _;
use std::sync::Arc;

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Buffer, MemoryKind};
use kvshard::copy::Direction;
use kvshard::gpu::Gpu;
use kvshard::transfer::Completion;
use kvshard::Result;
use kvshard_cli::measure::{
    copy_sync, duplex_sync, gbps, pages_of, EngineView, Stats, Timer, HOST_SHARE_LIMIT,
};
use kvshard_cli::synth;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Bytes written before every timed repeat so no input is still in the 60 MB L2, and so the
/// repeat's host planning and enqueueing, which runs while the flush does, is not in its
/// device time: 512 MB is ~0.2 ms on the H200, longer than the host takes for the first
/// call of any row (with 256 MB, ~0.1 ms, a 60-85 us `submit_decode` could leave the
/// device waiting for its first launch).
const FLUSH_BYTES: usize = 512 << 20;

/// Runs `submit(i)` for each of `streams`, stream `i` ordered after everything enqueued on
/// `harness` so far and `harness` after everything the submit enqueued on stream `i`: a timing
/// on `harness` covers every stream's work while the streams overlap (separate ranks, each on
/// a stream of its own, as separate processes send).
pub fn fan_out<T>(
    harness: &dyn Backend,
    streams: &[Arc<dyn Backend>],
    mut submit: impl FnMut(usize) -> Result<T>,
) -> Result<Vec<T>> {
    let start = harness.record()?;
    let mut out = Vec::with_capacity(streams.len());
    for (i, stream) in streams.iter().enumerate() {
        stream.wait(&start)?;
        out.push(submit(i)?);
        harness.wait(&stream.record()?)?;
    }
    Ok(out)
}

/// Waits for every completion in `pending`, then for `backend`'s stream: what a timed section
/// does before it checks the bytes its submits moved.
pub fn settle_sync(backend: &dyn Backend, pending: Vec<Box<dyn Completion>>) -> Result<()> {
    for mut completion in pending {
        completion.wait_sync()?;
    }
    backend.synchronize()
}

/// Copy ceilings measured in this run, GB/s in one direction (the best of the repeats).
#[derive(Debug, Clone, Copy)]
pub struct Ceilings {
    /// 2 GiB device-to-device cudaMemcpyAsync (bytes copied / time; read+write is twice this).
    pub d2d: f64,
    /// 1 GiB contiguous pinned host-to-device cudaMemcpyAsync.
    pub h2d: f64,
    /// 1 GiB contiguous device-to-pinned-host cudaMemcpyAsync.
    pub d2h: f64,
    /// H2D and D2H of 1 GiB each at the same time on two streams (sum).
    pub bidir: f64,
}

impl Ceilings {
    /// The ceiling a row names (`None`: a name of the section's own, not one of these).
    pub fn by_name(&self, name: &str) -> Option<f64> {
        match name {
            "d2d" => Some(self.d2d),
            "d2d r+w" => Some(2.0 * self.d2d),
            "h2d" => Some(self.h2d),
            "d2h" => Some(self.d2h),
            "h2d+d2h" => Some(self.bidir),
            _ => None,
        }
    }
}

/// Everything a section needs.
pub struct Ctx {
    pub gpu: Arc<Gpu>,
    /// The harness stream: every timed repeat, its L2 flush and its events run on it. Shared
    /// (`Arc`) because transports and pools take `Arc<dyn Backend>` ([`Ctx::shared`]); kept as
    /// the concrete type for its raw stream (bench kernels, cuBLAS, events).
    pub backend: Arc<CudaBackend>,
    pub ceilings: Ceilings,
    pub quick: bool,
    flush: Buffer,
    pub rng: StdRng,
}

impl Ctx {
    pub fn new(quick: bool) -> Result<Ctx> {
        let gpu = Gpu::open(0)?;
        let backend = Arc::new(CudaBackend::new(gpu.clone())?);
        let flush = backend.alloc(FLUSH_BYTES, MemoryKind::Device)?;
        let mut ctx = Ctx {
            gpu,
            backend,
            ceilings: Ceilings {
                d2d: 0.0,
                h2d: 0.0,
                d2h: 0.0,
                bidir: 0.0,
            },
            quick,
            flush,
            rng: StdRng::seed_from_u64(0x6b76_7368_6172_6464),
        };
        ctx.ceilings = ctx.measure_ceilings()?;
        Ok(ctx)
    }

    /// Raises the `h2d` or `d2h` ceiling to `gbps` when a plain contiguous copy of that kind
    /// measured during the run (the best of its repeats) beat it; says so in the header.
    pub fn raise_ceiling(&mut self, report: &mut Report, dir: Direction, gbps: f64, bytes: u64) {
        let (name, c) = match dir {
            Direction::Load => ("H2D", &mut self.ceilings.h2d),
            Direction::Backup => ("D2H", &mut self.ceilings.d2h),
        };
        if gbps > *c {
            report.header.push(format!(
                "ceiling raised: pinned {name} {:.1} -> {gbps:.1} GB/s (a contiguous copy of {bytes} bytes)",
                *c
            ));
            *c = gbps;
        }
    }

    /// The harness backend as the shared, object-safe handle the library takes.
    pub fn shared(&self) -> Arc<dyn Backend> {
        self.backend.clone()
    }

    pub fn reps(&self, full: usize) -> usize {
        if self.quick {
            full.min(3)
        } else {
            full
        }
    }

    /// Times `f` (which enqueues on the context's stream) `reps` times after the warm-ups; the
    /// L2 flush and the events are on that stream too, so each repeat starts cold and only `f`
    /// is timed. Also what an engine sees of `f`: its window (from its entry, on an idle stream,
    /// to the completion of its bytes) in the window runs, which double as the second warm-up,
    /// and its host time in every run ([`Timer::repeat_viewed_sync`]).
    pub fn time(&self, reps: usize, f: impl FnMut() -> Result<()>) -> Result<Timed> {
        let (stats, view) = Timer::new(self.backend.as_ref())
            .warmups(1)
            .windows(self.windows())
            .flush(&self.flush)
            .repeat_viewed_sync(reps, f)?;
        Ok(Timed { stats, view })
    }

    /// Window runs of each [`Ctx::time`]: three, `--quick` too. The window's median is what
    /// a row reports next to its ceiling; one window (quick runs did so before) was a single
    /// sample that could beat the repeats' median by 1% and pass its ceiling.
    fn windows(&self) -> usize {
        3
    }

    /// Runs of `f` one [`Ctx::time`] of `reps` repeats makes: its warm-up, window runs and
    /// repeats.
    pub fn runs(&self, reps: usize) -> usize {
        1 + self.windows() + reps
    }

    /// The harness's ceiling timing on `b`'s stream: two warm-ups, the L2 flush before every
    /// run.
    fn timer<'a>(&'a self, b: &'a dyn Backend) -> Timer<'a> {
        Timer::new(b).warmups(2).flush(&self.flush)
    }

    /// Fills `buf` with random bytes: a random 16 MB tile uploaded once, then repeated on the
    /// device (copy speed does not depend on the values, but zeros could hide unwritten bytes).
    pub fn fill_random(&mut self, buf: &Buffer) -> Result<()> {
        const TILE: usize = 16 << 20;
        let tile = synth::bytes(&mut self.rng, TILE.min(buf.len()));
        self.fill_tiled(buf, &tile)
    }

    /// Fills `buf` with `tile` repeated: uploaded once, then doubled on the device.
    pub fn fill_tiled(&self, buf: &Buffer, tile: &[u8]) -> Result<()> {
        let n = tile.len().min(buf.len());
        self.backend.write_sync(buf, 0, &tile[..n])?;
        let mut done = n;
        while done < buf.len() {
            let len = done.min(buf.len() - done);
            // SAFETY: both ranges lie inside `buf`, and they do not overlap.
            unsafe {
                self.backend
                    .memcpy(buf.addr() + done as u64, buf.addr(), len)?
            };
            done += len;
        }
        self.backend.synchronize()
    }

    /// The copy engine's ceilings, each the best of its repeats: the fastest this device moved
    /// the bytes in this run. Rows report medians against it, so no honest row passes it; a
    /// median ceiling did not hold: pinned-host copies vary by ~1% between allocations and
    /// moments of one run, and rows measured later beat it.
    fn measure_ceilings(&self) -> Result<Ceilings> {
        let reps = self.reps(10);
        let timer = self.timer(self.backend.as_ref());
        let (device, host) = (MemoryKind::Device, MemoryKind::PinnedHost);
        let d2d = copy_sync(&timer, device, device, 2 << 30, reps)?;
        let h2d = copy_sync(&timer, host, device, 1 << 30, reps)?;
        let d2h = copy_sync(&timer, device, host, 1 << 30, reps)?;
        let other = CudaBackend::new(self.gpu.clone())?;
        let bidir = duplex_sync(&timer, &other, 1 << 30, reps)?;
        Ok(Ceilings {
            d2d: d2d.best_gbps(),
            h2d: h2d.best_gbps(),
            d2h: d2h.best_gbps(),
            bidir: bidir.best_gbps(),
        })
    }
}

/// A case's timing: the device time of its repeats and what an engine sees of it. Derefs to
/// the device time.
#[derive(Debug, Clone, Copy)]
pub struct Timed {
    pub stats: Stats,
    pub view: EngineView,
}

impl std::ops::Deref for Timed {
    type Target = Stats;

    fn deref(&self) -> &Stats {
        &self.stats
    }
}

/// One measured case.
pub struct Row {
    pub section: &'static str,
    pub case: String,
    pub bytes: u64,
    pub ms: f64,
    pub spread: (f64, f64),
    pub view: EngineView,
    pub ceiling_name: &'static str,
    pub ceiling: f64,
    pub note: String,
}

impl Row {
    pub fn gbps(&self) -> f64 {
        gbps(self.bytes, self.ms)
    }

    /// The share of the ceiling `gbps` is, in percent.
    fn percent(&self, gbps: f64) -> f64 {
        100.0 * gbps / self.ceiling.max(f64::MIN_POSITIVE)
    }

    /// GB/s of the median window an engine sees.
    fn window_gbps(&self) -> f64 {
        gbps(self.bytes, self.view.window.median)
    }

    /// The engine's view as table cells: the median window in ms, its share of the ceiling,
    /// host us per call, and the host time's share of the transfer time (flagged `HOST>5%` past
    /// the limit at >= 64 pages).
    fn view_cells(&self) -> [String; 4] {
        let v = self.view;
        let heavy = v.host_heavy(pages_of(&self.case).map(|(p, _)| p), self.ms);
        [
            format!("{:.3}", v.window.median),
            format!("{:.1}%", self.percent(self.window_gbps())),
            format!("{:.1}", v.host_us),
            format!(
                "{:.1}%{}",
                100.0 * v.host_share(self.ms),
                if heavy {
                    format!(" HOST>{:.0}%", 100.0 * HOST_SHARE_LIMIT)
                } else {
                    String::new()
                }
            ),
        ]
    }
}

/// All rows of a run, printed as a table and written under $OUT when set.
#[derive(Default)]
pub struct Report {
    pub rows: Vec<Row>,
    pub header: Vec<String>,
}

impl Report {
    /// Rows whose figure passed their same-run ceiling: impossible, so the figure is computed
    /// wrongly (the run fails).
    pub fn above_ceiling(&self) -> Vec<String> {
        self.rows
            .iter()
            .filter(|r| r.gbps() > r.ceiling || r.window_gbps() > r.ceiling)
            .map(|r| format!("{} {}", r.section, r.case))
            .collect()
    }

    /// Puts every row against the run's final ceilings: a ceiling is the fastest plain copy of
    /// its kind in the whole run, and a contiguous copy measured beside a section's rows
    /// ([`Ctx::raise_ceiling`]) may have beaten the one measured at the start.
    pub fn rebase(&mut self, c: &Ceilings) {
        for row in &mut self.rows {
            if let Some(v) = c.by_name(row.ceiling_name) {
                row.ceiling = row.ceiling.max(v);
            }
        }
    }

    /// Adds a row: the device time's figures and the engine's view, printed against the
    /// ceiling as it stands (the table written at the end uses the final ones).
    pub fn add(
        &mut self,
        section: &'static str,
        case: String,
        bytes: u64,
        timed: Timed,
        ceiling: (&'static str, f64),
        note: String,
    ) {
        let row = Row {
            section,
            case,
            bytes,
            ms: timed.median,
            spread: (timed.min, timed.max),
            view: timed.view,
            ceiling_name: ceiling.0,
            ceiling: ceiling.1,
            note,
        };
        let [window, window_share, host_us, heavy] = row.view_cells();
        println!(
            "{:<12} {:<58} {:>12} B {:>9.3} ms {:>8.1} GB/s {:>6.1}% of {} | window {window:>9} ms {window_share:>6} | host {host_us:>7} us ({heavy}) | {}",
            row.section,
            row.case,
            row.bytes,
            row.ms,
            row.gbps(),
            row.percent(row.gbps()),
            row.ceiling_name,
            row.note
        );
        self.rows.push(row);
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        for h in &self.header {
            let _ = writeln!(s, "{h}  ");
        }
        let _ = writeln!(
            s,
            "\nwindow: what an engine sees, from the entry of the call (the stream idle) to the completion of its bytes (median ms, and its share of the ceiling); host us: the call's planning and enqueueing per call (median); host share: host us over the (device) transfer time, HOST>{:.0}% where a row of >= {} pages passes {:.0}%.",
            100.0 * HOST_SHARE_LIMIT,
            kvshard_cli::measure::HOST_SHARE_MIN_PAGES,
            100.0 * HOST_SHARE_LIMIT
        );
        let _ = writeln!(
            s,
            "\n| section | case | bytes | median ms (min-max) | GB/s | % of ceiling | window ms | window % of ceiling | host us/call | host share of transfer | ceiling GB/s | note |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"
        );
        for r in &self.rows {
            let [window, window_share, host_us, heavy] = r.view_cells();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.3} ({:.3}-{:.3}) | {:.1} | {:.1}% | {window} | {window_share} | {host_us} | {heavy} | {} {:.1} | {} |",
                r.section,
                r.case,
                r.bytes,
                r.ms,
                r.spread.0,
                r.spread.1,
                r.gbps(),
                r.percent(r.gbps()),
                r.ceiling_name,
                r.ceiling,
                r.note
            );
        }
        s
    }
}
