//! The GPU benchmark harness: the device, the ceilings measured in this run, event timing with an
//! L2 flush before every timed repeat, random fills, and the report.

use std::fmt::Write as _;
use std::sync::Arc;

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Buffer, MemoryKind};
use kvshard::gpu::{Gpu, Stream};
use kvshard::{Error, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Bytes written before every timed repeat so no input is still in the 60 MB L2.
const FLUSH_BYTES: usize = 256 << 20;

/// Copy ceilings measured in this run, GB/s in one direction.
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

/// Median, min and max of repeated timings, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Stats {
    fn of(mut ms: Vec<f64>) -> Stats {
        ms.sort_by(f64::total_cmp);
        // Callers always time at least one repeat (`Ctx::reps` of a positive count).
        Stats {
            median: ms[ms.len() / 2],
            min: ms[0],
            max: ms[ms.len() - 1],
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

    /// Times `f` (which enqueues on `stream`) `reps` times after two warm-ups; the L2 flush and
    /// the events are on `stream` too, so each repeat starts cold and only `f` is timed.
    pub fn time_on(
        &self,
        stream: &Stream,
        reps: usize,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<Stats> {
        let flush_backend = CudaBackend::with_stream(self.gpu.clone(), stream.clone())?;
        let start = self.gpu.new_event(true)?;
        let end = self.gpu.new_event(true)?;
        let mut ms = Vec::with_capacity(reps);
        for rep in 0..reps + 2 {
            flush_backend.fill(&self.flush, rep as u8 | 1)?;
            stream.record(&start)?;
            f()?;
            stream.record(&end)?;
            stream.synchronize()?;
            if rep >= 2 {
                ms.push(f64::from(start.elapsed_ms(&end).map_err(|e| {
                    Error::Driver {
                        call: "cuEventElapsedTime",
                        source: e,
                    }
                })?));
            }
        }
        Ok(Stats::of(ms))
    }

    /// [`Ctx::time_on`] on the context's own stream.
    pub fn time(&self, reps: usize, f: impl FnMut() -> Result<()>) -> Result<Stats> {
        self.time_on(self.backend.stream(), reps, f)
    }

    /// Fills `buf` with random bytes: a random 16 MB tile uploaded once, then repeated on the
    /// device (copy speed does not depend on the values, but zeros could hide unwritten bytes).
    pub fn fill_random(&mut self, buf: &Buffer) -> Result<()> {
        const TILE: usize = 16 << 20;
        let mut tile = vec![0u8; TILE.min(buf.len())];
        self.rng.fill(&mut tile[..]);
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

    fn measure_ceilings(&mut self) -> Result<Ceilings> {
        let reps = self.reps(10);
        let d2d_bytes = 2usize << 30;
        let a = self.backend.alloc(d2d_bytes, MemoryKind::Device)?;
        let b = self.backend.alloc(d2d_bytes, MemoryKind::Device)?;
        self.fill_random(&a)?;
        // SAFETY: two live, disjoint 2 GiB device buffers.
        let d2d = self.time(reps, || unsafe {
            self.backend.memcpy(b.addr(), a.addr(), d2d_bytes)
        })?;
        drop((a, b));

        let hbytes = 1usize << 30;
        let host = self.backend.alloc(hbytes, MemoryKind::PinnedHost)?;
        let host2 = self.backend.alloc(hbytes, MemoryKind::PinnedHost)?;
        let dev = self.backend.alloc(hbytes, MemoryKind::Device)?;
        let dev2 = self.backend.alloc(hbytes, MemoryKind::Device)?;
        self.fill_random(&dev)?;
        // SAFETY: live, disjoint 1 GiB buffers (pinned host through its device alias).
        let h2d = self.time(reps, || unsafe {
            self.backend.memcpy(dev.addr(), host.addr(), hbytes)
        })?;
        // SAFETY: as above.
        let d2h = self.time(reps, || unsafe {
            self.backend.memcpy(host.addr(), dev.addr(), hbytes)
        })?;
        let other = CudaBackend::new(self.gpu.clone())?;
        let bidir = self.time(reps, || {
            let fork = self.backend.record()?;
            other.wait(&fork)?;
            // SAFETY: as above; the two directions touch disjoint buffers.
            unsafe {
                self.backend.memcpy(dev.addr(), host.addr(), hbytes)?;
                other.memcpy(host2.addr(), dev2.addr(), hbytes)?;
            }
            let join = other.record()?;
            self.backend.wait(&join)
        })?;
        let gbps = |bytes: usize, s: Stats| bytes as f64 / (s.median * 1e6);
        Ok(Ceilings {
            d2d: gbps(d2d_bytes, d2d),
            h2d: gbps(hbytes, h2d),
            d2h: gbps(hbytes, d2h),
            bidir: gbps(2 * hbytes, bidir),
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
        self.bytes as f64 / (self.ms * 1e6)
    }
}

/// All rows of a run, printed as a table and written under $OUT when set.
#[derive(Default)]
pub struct Report {
    pub rows: Vec<Row>,
    pub header: Vec<String>,
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
