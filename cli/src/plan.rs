//! `kvshard plan`: the capacity of a CP group's GPU (L1), host (L2) and disk (L3) tiers for a
//! model, and how long a prefix takes to come back from each ([`kvshard::pool::capacity`] does
//! the arithmetic). This module reads the sizes the flags give, measures the ceilings when asked
//! (`--measure`: D2D and pinned H2D on GPU 0, or the host's memcpy where no GPU opens, and an
//! O_DIRECT read of a file it writes in `--disk-path`), and prints the plan as three tables: the
//! tiers, the writer group's reloads, and the reloads by readers of another parallelism
//! ([`kvshard::shard::ReloadPlan`]: another CP size, an unsharded server, DCP decode ranks).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::MemoryKind;
use kvshard::geometry::Model;
use kvshard::gpu::Gpu;
use kvshard::pool::capacity::{CapacityPlan, CapacityRequest, HostCapacity, Tier};
use kvshard::shard::{CpGroup, DecodeLayout, Reader, ReloadPlan};
use kvshard::{Error, Result};

use crate::measure::{copy_sync, gbps, Stats, Timer};

/// Bytes of the file the disk measurement writes and reads back with O_DIRECT: large enough
/// that one read's latency does not dominate, small enough to take about a second.
pub const DISK_PROBE_BYTES: usize = 256 << 20;

/// Bytes of each O_DIRECT read and write of the disk measurement (a multiple of any device's
/// direct-I/O alignment; about one L3 slot of the models).
pub const DISK_IO_BYTES: usize = 4 << 20;

/// Bytes each copy of the GPU and host memcpy measurements moves.
pub const COPY_BYTES: usize = 256 << 20;

/// Timed repeats of each measurement (the median is reported, as the benchmark does).
pub const RUNS: usize = 5;

/// Parses a size: bytes (`4096`), or a number with a decimal (`40GB`, `1.5TB`: powers of 1,000)
/// or binary (`40GiB`: powers of 1,024) unit, `K`/`M`/`G`/`T` alone being decimal. Hand-written:
/// eight units do not need a crate.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        other => {
            return Err(format!(
                "{text:?}: unit {other:?} (bytes, or KB MB GB TB, KiB MiB GiB TiB)"
            ))
        }
    };
    let bad = || format!("{text:?} is no size (bytes, or a number with a unit: 40GB, 1.5TiB)");
    if number.contains('.') {
        let value: f64 = number.parse().map_err(|_| bad())?;
        let bytes = value * scale as f64;
        // u64::MAX as f64 rounds up to 2^64, which does not fit: compare with < .
        if !(bytes.is_finite() && bytes < u64::MAX as f64) {
            return Err(format!("{text:?} does not fit 64 bits"));
        }
        Ok(bytes as u64)
    } else {
        number
            .parse::<u64>()
            .map_err(|_| bad())?
            .checked_mul(scale)
            .ok_or_else(|| format!("{text:?} does not fit 64 bits"))
    }
}

/// Parses a host cache size: a size as [`parse_size`] reads it, or `Nx` (N times the pages of
/// the rank's GPU pool).
pub fn parse_host(text: &str) -> std::result::Result<HostCapacity, String> {
    match text.trim().strip_suffix(['x', 'X']) {
        Some(factor) => factor
            .parse::<u64>()
            .map(HostCapacity::Factor)
            .map_err(|_| {
                format!("{text:?}: a host cache of N times the GPU pool's pages is `Nx` (4x)")
            }),
        None => parse_size(text).map(HostCapacity::Bytes),
    }
}

/// Where a ceiling came from, for the report.
#[derive(Debug, Clone, PartialEq)]
pub struct CeilingNote {
    /// Which ceiling ("D2D").
    pub name: &'static str,
    /// Its GB/s.
    pub gbps: f64,
    /// How it was found ("given", "measured: ...").
    pub source: String,
}

/// The D2D and pinned H2D ceilings of GPU 0 (medians of [`RUNS`] copies of [`COPY_BYTES`]).
pub fn measure_gpu(gpu: std::sync::Arc<Gpu>) -> Result<(f64, f64)> {
    let b = CudaBackend::new(gpu)?;
    let timer = Timer::new(&b).warmups(1);
    let (device, host) = (MemoryKind::Device, MemoryKind::PinnedHost);
    let d2d = copy_sync(&timer, device, device, COPY_BYTES, RUNS)?;
    let h2d = copy_sync(&timer, host, device, COPY_BYTES, RUNS)?;
    Ok((d2d.median_gbps(), h2d.median_gbps()))
}

/// The host's memcpy ceiling: [`RUNS`] copies of [`COPY_BYTES`] between two buffers of
/// non-zero bytes, the median.
pub fn measure_host_memcpy() -> Result<f64> {
    let src: Vec<u8> = (0..COPY_BYTES).map(|i| (i % 251) as u8 | 1).collect();
    let mut dst = vec![0u8; COPY_BYTES];
    // A warm-up faults the destination's pages in.
    dst.copy_from_slice(&src);
    let mut ms = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(gbps(COPY_BYTES as u64, Stats::of(ms)?.median))
}

/// A file the disk measurement writes, removed when dropped, whatever happened.
struct Probe(PathBuf);

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A buffer of `len` bytes aligned to 4 KiB (any device's direct-I/O alignment), inside an
/// over-allocated vector: O_DIRECT needs the buffer aligned as well as offsets and lengths.
fn aligned(storage: &mut Vec<u8>, len: usize) -> &mut [u8] {
    const ALIGN: usize = 4096;
    storage.resize(len + ALIGN, 0);
    let skip = storage.as_ptr().align_offset(ALIGN);
    &mut storage[skip..skip + len]
}

/// The read ceiling of the filesystem holding `dir`: writes a [`DISK_PROBE_BYTES`] file with
/// O_DIRECT, then reads it back with O_DIRECT in [`DISK_IO_BYTES`] reads (the page cache stays
/// out of both), [`RUNS`] times; the median. The file is removed afterwards. A filesystem
/// without O_DIRECT (tmpfs) is an [`Error::Os`] naming it.
pub fn measure_disk(dir: &Path) -> Result<f64> {
    let os = |call| move |source| Error::Os { call, source };
    let path = dir.join(format!(".kvshard-plan-probe-{}", std::process::id()));
    let mut storage = Vec::new();
    let buf = aligned(&mut storage, DISK_IO_BYTES);
    buf.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 253) as u8 | 1);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(os("create the disk probe with O_DIRECT in --disk-path (tmpfs has no O_DIRECT: give --disk-gbps)"))?;
    let _probe = Probe(path.clone());
    for _ in 0..DISK_PROBE_BYTES / DISK_IO_BYTES {
        file.write_all(buf).map_err(os("write the disk probe"))?;
    }
    file.sync_all().map_err(os("sync the disk probe"))?;
    let mut ms = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let mut file: File = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .map_err(os("open the disk probe with O_DIRECT"))?;
        let t = Instant::now();
        for _ in 0..DISK_PROBE_BYTES / DISK_IO_BYTES {
            file.read_exact(buf).map_err(os("read the disk probe"))?;
        }
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(gbps(DISK_PROBE_BYTES as u64, Stats::of(ms)?.median))
}

/// What `kvshard plan` describes, besides the plan: the model and what the ceilings are.
#[derive(Debug, Clone, PartialEq)]
pub struct Heading {
    /// The model.
    pub model: Model,
    /// Where each known ceiling came from.
    pub ceilings: Vec<CeilingNote>,
}

/// Milliseconds of `seconds`, or why there are none.
fn ms(seconds: Option<f64>, fits: bool) -> String {
    match (seconds, fits) {
        (_, false) => "does not fit".into(),
        (Some(s), true) => format!("{:.3} ms", s * 1e3),
        (None, true) => "n/a (no ceiling)".into(),
    }
}

/// The readers `kvshard plan` times a reload for: CP groups of 1 (an unsharded server), 2, 4
/// and 8 ranks, and DCP decode groups of 2, 4 and 8 ranks at I = 1 and 64, with their labels.
pub fn readers() -> Vec<(String, Reader)> {
    let mut out: Vec<(String, Reader)> = [1u32, 2, 4, 8]
        .into_iter()
        .filter_map(|n| {
            let label = if n == 1 {
                "unsharded".to_string()
            } else {
                format!("CP{n}")
            };
            Some((label, Reader::Cp(CpGroup::new(n, 0).ok()?)))
        })
        .collect();
    for m in [2u32, 4, 8] {
        for i in [1u32, 64] {
            if let Ok(layout) = DecodeLayout::new(m, i) {
                out.push((format!("DCP{m} I={i}"), Reader::Decode(layout)));
            }
        }
    }
    out
}

/// A prefix's reload by a reader of another parallelism: the busiest reader rank's pages, and
/// the time from L2 (those pages over pinned H2D) and from L3 (the slots the group reads, each
/// page once, over the shared disk's ceiling, then loaded as from L2: the writer group's model),
/// or why there is none.
fn reader_row(
    req: &CapacityRequest,
    plan: &CapacityPlan,
    tokens: u64,
    reader: Reader,
) -> (String, String, String) {
    let writers = CpGroup::new(req.cp, 0);
    let pages = tokens.div_ceil(kvshard::geometry::PAGE_SIZE as u64);
    let reload = match writers.and_then(|w| ReloadPlan::new(w, reader, pages)) {
        Ok(r) => r,
        Err(e) => return (format!("n/a ({e})"), String::new(), String::new()),
    };
    let busiest = reload.busiest();
    let c = &req.ceilings;
    let over = |bytes: u64, gbps: Option<f64>| gbps.map(|g| bytes as f64 / (g * 1e9));
    let host = over(busiest.saturating_mul(plan.budget.page_bytes), c.h2d_gbps);
    let read = reload.reads().len() as u64;
    let disk = over(read.saturating_mul(plan.slot_bytes), c.disk_gbps)
        .zip(host)
        .map(|(read, load)| read + load);
    (busiest.to_string(), ms(host, true), ms(disk, true))
}

/// The report `kvshard plan` prints: what was planned, the tiers' table and the reloads' table.
/// Integers print without separators, so scripts and tests can read them back.
pub fn render(req: &CapacityRequest, plan: &CapacityPlan, heading: &Heading) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    let g = &req.geometry;
    let b = &plan.budget;
    let mut s = String::new();
    let mut line = |text: String| {
        s.push_str(&text);
        s.push('\n');
    };
    line(format!(
        "plan: {}, {} layers{}, {}, CP{}",
        heading.model,
        g.target.num_layers(),
        if g.draft.is_some() {
            " + MTP draft"
        } else {
            ""
        },
        g.target.latent,
        req.cp
    ));
    line(format!(
        "page: {} B (every layer and component); L3 slot: {} B (padded to {} B)",
        b.page_bytes, plan.slot_bytes, req.dio_align
    ));
    line(if b.scratch_rows == 0 {
        "scratch budget per rank: 0 B (unsharded: attention reads the pool itself)".into()
    } else {
        format!(
            "scratch budget per rank: {} B ({:.2} GB; {} rows per slot for {} contexts of {} tokens and a {}-token chunk)",
            b.scratch_bytes,
            gb(b.scratch_bytes),
            b.scratch_rows,
            req.gpu.contexts,
            req.gpu.context_len,
            req.gpu.chunk_size
        )
    });
    line(format!("logical GPU slots: {}", b.logical_capacity));
    if let Some(host) = plan.tier(Tier::Host).and_then(|t| t.pages_per_rank) {
        line(format!("host pages per rank: {host}"));
    }
    line(format!(
        "L3 slots: {}",
        plan.tier(Tier::Disk).map_or(0, |t| t.pages)
    ));
    line(String::new());
    line("| tier | bytes | pages per rank | pages | tokens |".into());
    line("|---|---:|---:|---:|---:|".into());
    for t in &plan.tiers {
        let (bytes, per_rank) = match t.pages_per_rank {
            Some(p) => (format!("{:.2} GB per rank", gb(t.bytes)), p.to_string()),
            None => (format!("{:.2} GB shared", gb(t.bytes)), "shared".into()),
        };
        line(format!(
            "| {} | {bytes} | {per_rank} | {} | {} |",
            t.tier, t.pages, t.tokens
        ));
    }
    line(String::new());
    let ceilings: Vec<String> = heading
        .ceilings
        .iter()
        .map(|c| format!("{} {:.1} GB/s ({})", c.name, c.gbps, c.source))
        .collect();
    line(format!(
        "ceilings: {}",
        if ceilings.is_empty() {
            "none (--measure, or --d2d-gbps, --h2d-gbps, --disk-gbps)".into()
        } else {
            ceilings.join(", ")
        }
    ));
    line(
        "reload: the busiest rank's pages over D2D (L1) or pinned H2D (L2); from L3 every slot read \
         from the shared disk into L2, then loaded as from L2"
            .into(),
    );
    line(String::new());
    let names: Vec<String> = Tier::ALL.iter().map(|t| format!("from {t}")).collect();
    line(format!(
        "| prefix | pages (busiest rank) | {} |",
        names.join(" | ")
    ));
    line("|---|---:|---:|---:|---:|".into());
    for r in &plan.reloads {
        let times: Vec<String> = r.tiers.iter().map(|t| ms(t.seconds, t.fits)).collect();
        line(format!(
            "| {} tokens | {} ({}) | {} |",
            r.tokens,
            r.pages,
            r.pages_per_rank,
            times.join(" | ")
        ));
    }
    line(String::new());
    line(format!(
        "reload by another parallelism (the prefix cached by CP{}): the busiest reader rank's pages \
         over pinned H2D (L2); from L3 every slot read once from the shared disk, then loaded as \
         from L2 (a DCP group whose rows spread over ranks, I = 1, reads each page once, \
         round-robin, and scatters its rows, rather than each rank reading every page)",
        req.cp
    ));
    line(String::new());
    line(
        "| prefix, reader | pages (busiest reader rank) | from host (L2) | from disk (L3) |".into(),
    );
    line("|---|---:|---:|---:|".into());
    for r in &plan.reloads {
        for (label, reader) in readers() {
            let (pages, host, disk) = reader_row(req, plan, r.tokens, reader);
            line(format!(
                "| {} tokens, {label} | {pages} | {host} | {disk} |",
                r.tokens
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_decimal_and_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("40GB"), Ok(40_000_000_000));
        assert_eq!(parse_size("40 GiB"), Ok(40 << 30));
        assert_eq!(parse_size("1.5TB"), Ok(1_500_000_000_000));
        assert_eq!(parse_size("2t"), Ok(2_000_000_000_000));
        assert!(parse_size("40 parsecs").unwrap_err().contains("unit"));
        assert!(parse_size("GB").unwrap_err().contains("no size"));
        assert!(parse_size("1.2.3GB").unwrap_err().contains("no size"));
        assert!(parse_size("99999999TiB").unwrap_err().contains("64 bits"));
        assert!(parse_size("1e30").is_err());
        assert_eq!(parse_host("4x"), Ok(HostCapacity::Factor(4)));
        assert_eq!(
            parse_host("160GB"),
            Ok(HostCapacity::Bytes(160_000_000_000))
        );
        assert!(parse_host("fourx").unwrap_err().contains("`Nx`"));
    }

    #[test]
    fn the_disk_probe_refuses_what_cannot_be_created_and_leaves_nothing() {
        let missing = Path::new("/nonexistent-kvshard-dir");
        let e = measure_disk(missing).unwrap_err();
        assert!(matches!(e, Error::Os { .. }), "{e}");
        assert!(e.to_string().contains("--disk-gbps"), "{e}");
    }

    #[test]
    fn the_buffer_for_direct_io_is_aligned() {
        let mut storage = Vec::new();
        let buf = aligned(&mut storage, 8192);
        assert_eq!((buf.len(), buf.as_ptr() as usize % 4096), (8192, 0));
    }
}
