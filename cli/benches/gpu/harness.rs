//! The GPU benchmark harness: the device, the ceilings measured in this run, event timing with an
//! L2 flush before every timed repeat, random fills, and the report. The timing and the ceilings
//! are `kvshard_cli::measure`'s, as the demos and `kvshard pd` measure.

use std::fmt::Write as _;
use std::sync::Arc;

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Buffer, MemoryKind};
use kvshard::gpu::Gpu;
use kvshard::Result;
use kvshard_cli::measure::{copy_sync, duplex_sync, gbps, Stats, Timer};
use kvshard_cli::synth;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Bytes written before every timed repeat so no input is still in the 60 MB L2.
const FLUSH_BYTES: usize = 256 << 20;

/// Copy ceilings measured in this run, GB/s in one direction (medians of the repeats).
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

    /// Times `f` (which enqueues on the context's stream) `reps` times after two warm-ups; the
    /// L2 flush and the events are on that stream too, so each repeat starts cold and only `f`
    /// is timed.
    pub fn time(&self, reps: usize, f: impl FnMut() -> Result<()>) -> Result<Stats> {
        self.timer(self.backend.as_ref()).repeat_sync(reps, f)
    }

    /// The harness's timing on `b`'s stream: two warm-ups, the L2 flush before every run.
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

    /// The copy engine's ceilings, each a median as every row is.
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
            d2d: d2d.median_gbps(),
            h2d: h2d.median_gbps(),
            d2h: d2h.median_gbps(),
            bidir: bidir.median_gbps(),
        })
    }
}

/// One measured case.
pub struct Row {
    pub section: &'static str,
    pub case: String,
    pub bytes: u64,
    pub ms: f64,
    pub spread: (f64, f64),
    pub ceiling_name: &'static str,
    pub ceiling: f64,
    pub note: String,
}

impl Row {
    pub fn gbps(&self) -> f64 {
        gbps(self.bytes, self.ms)
    }
}

/// All rows of a run, printed as a table and written under $OUT when set.
#[derive(Default)]
pub struct Report {
    pub rows: Vec<Row>,
    pub header: Vec<String>,
    /// Rows whose figure passed their same-run ceiling: impossible, so the figure is computed
    /// wrongly (the run fails).
    pub above_ceiling: Vec<String>,
}

impl Report {
    pub fn add(
        &mut self,
        section: &'static str,
        case: String,
        bytes: u64,
        stats: Stats,
        ceiling: (&'static str, f64),
        note: String,
    ) {
        let row = Row {
            section,
            case,
            bytes,
            ms: stats.median,
            spread: (stats.min, stats.max),
            ceiling_name: ceiling.0,
            ceiling: ceiling.1,
            note,
        };
        if row.gbps() > row.ceiling {
            self.above_ceiling
                .push(format!("{} {}", row.section, row.case));
        }
        println!(
            "{:<12} {:<58} {:>12} B {:>9.3} ms {:>8.1} GB/s {:>6.1}% of {} {}",
            row.section,
            row.case,
            row.bytes,
            row.ms,
            row.gbps(),
            100.0 * row.gbps() / row.ceiling.max(f64::MIN_POSITIVE),
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
            "\n| section | case | bytes | median ms (min-max) | GB/s | % of ceiling | ceiling GB/s | note |\n|---|---|---:|---:|---:|---:|---|---|"
        );
        for r in &self.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.3} ({:.3}-{:.3}) | {:.1} | {:.1}% | {} {:.1} | {} |",
                r.section,
                r.case,
                r.bytes,
                r.ms,
                r.spread.0,
                r.spread.1,
                r.gbps(),
                100.0 * r.gbps() / r.ceiling.max(f64::MIN_POSITIVE),
                r.ceiling_name,
                r.ceiling,
                r.note
            );
        }
        s
    }
}
