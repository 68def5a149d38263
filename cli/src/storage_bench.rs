//! `kvshard storage-bench` (feature `nixl`): the storage tier's store and load throughput,
//! per rank and for N ranks together, next to a `fio` ceiling measured in the same run on the
//! same filesystem.
//!
//! Each rank is a thread with its own host pool (the CPU twin's memory: the store copies host
//! pages the same way whether they are pinned or not) and its own [`DiskStore`] in one
//! directory. Every rank stores `pages` pages in batches of `batch`, all ranks at once, then
//! loads them back; the stores run twice, into empty slots and then into a full file (each
//! page reclaiming the least recently used slot, its Free record first). Reported per operation: GB/s per rank (mean) and together (bytes of all
//! ranks over the slowest rank's time), descriptors (I/Os) per page, host CPU time per page
//! (the rank thread's, from `CLOCK_THREAD_CPUTIME_ID`: packing, checksums, posting and
//! reaping), and the p50 / p99 of one batch's time. The ceiling is `fio` with `direct=1`,
//! io_uring (libaio when io_uring is refused), `numjobs` = ranks, iodepth 32, at the slot size
//! and at the per-layer block size, reading and writing (over and over, time-based: after its
//! first pass fio overwrites blocks it wrote), plus the first-fill ceiling: fio writing every
//! slot-size block of freshly fallocated files once, as the store's first fill writes its
//! freshly preallocated file (the filesystem converting unwritten extents in both).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use kvshard::backend::cpu::CpuBackend;
use kvshard::geometry::{CacheGeometry, IndexerScale};
use kvshard::hicache::{HostLayout, HostPool};
use kvshard::index::LocalPage;
use kvshard::key::{Namespace, PageKey};
use kvshard::pool::capacity::{slot_bytes, DEFAULT_DIO_ALIGN};
use kvshard::pool::disk::{DiskConfig, DiskStore, LoadOutcome, QueueChoice, MAX_STAGING_BYTES};
use kvshard::{Error, Result};

/// Most ranks (threads, each with its own store and host pool) a run may have: a CP group's
/// size, far below the storage tier's own bound ([`kvshard::pool::disk::MAX_WRITERS`]).
pub const MAX_RANKS: u32 = 64;

/// A directory of its own for one run's stores, made in `base` (created if missing): a random
/// name starting with `prefix`, mode 0700, removed with everything in it when the value is
/// dropped. Never a predictable name in a shared folder: nobody can plant a file or a link in
/// it ahead of the run.
pub fn private_dir(base: &Path, prefix: &str) -> Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(base).map_err(|source| Error::Os {
        call: "create the storage base directory",
        source,
    })?;
    tempfile::Builder::new()
        .prefix(prefix)
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(base)
        .map_err(|source| Error::Os {
            call: "make a private storage directory",
            source,
        })
}

/// Bytes of host memory the OS says are available (`MemAvailable`).
fn host_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()?
        .checked_mul(1024)
}

/// What one run measures.
#[derive(Debug, Clone)]
pub struct StorageBench {
    /// The directory (a real filesystem: O_DIRECT).
    pub dir: PathBuf,
    /// Ranks, one thread and one store each.
    pub ranks: u32,
    /// The cache geometry.
    pub geometry: CacheGeometry,
    /// Pages each rank stores and loads.
    pub pages: u64,
    /// Pages per store or load call.
    pub batch: usize,
    /// Staging slots per store.
    pub staging_slots: usize,
    /// Largest descriptor.
    pub max_io_bytes: u64,
    /// libaio instead of io_uring.
    pub aio: bool,
    /// The fio binary (`None`: no ceiling).
    pub fio: Option<PathBuf>,
    /// Seconds of each fio run.
    pub fio_seconds: u32,
    /// Write each rank's new slot file once at open ([`DiskConfig::zero_fill`]).
    pub zero_fill: bool,
}

/// How a fio ceiling writes its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// For the whole run, over and over (after the first pass, overwriting blocks it wrote).
    Repeated,
    /// Every block of freshly fallocated files once.
    FirstFill,
}

/// One rank's figures for one operation.
#[derive(Debug, Clone, Default)]
struct RankRun {
    secs: f64,
    cpu_secs: f64,
    ios: u64,
    batches: Vec<f64>,
}

fn thread_cpu() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

impl StorageBench {
    /// Checks the run before anything is allocated or started: 1 to [`MAX_RANKS`] ranks, at
    /// least one page and a batch of 1 to `pages` pages, one staging slot or more (two buffers
    /// of them within the store's bound), and the ranks' host pools (a batch of pages each)
    /// within the host memory available.
    pub fn validate(&self) -> Result<()> {
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return Err(Error::InvalidArgument(format!(
                "--ranks {}: 1 to {MAX_RANKS} ranks",
                self.ranks
            )));
        }
        if self.pages == 0 || self.batch == 0 || self.batch as u64 > self.pages {
            return Err(Error::InvalidArgument(format!(
                "--pages {} in batches of --batch {}: at least one page, a batch of 1 to --pages",
                self.pages, self.batch
            )));
        }
        let page = self.geometry.page_bytes() as u64;
        let staging = (self.staging_slots as u64)
            .checked_mul(2 * page)
            .filter(|&b| self.staging_slots > 0 && b <= MAX_STAGING_BYTES);
        if staging.is_none() {
            return Err(Error::InvalidArgument(format!(
                "--staging-slots {}: at least 1, and two buffers of them within {MAX_STAGING_BYTES} B",
                self.staging_slots
            )));
        }
        let host = (self.batch as u64 + 1)
            .checked_mul(page)
            .and_then(|b| b.checked_mul(u64::from(self.ranks)));
        match (host, host_available()) {
            (None, _) => return Err(crate::overflow("the ranks' host pools")),
            (Some(need), Some(have)) if need > have => {
                return Err(Error::InvalidArgument(format!(
                    "the ranks' host pools need {:.2} GB and {:.2} GB are available: lower --batch or --ranks",
                    need as f64 / 1e9,
                    have as f64 / 1e9
                )))
            }
            _ => {}
        }
        // Every rank's slot file (a page in 4 KiB-aligned slots; the store checks the exact
        // size) on the directory's filesystem.
        let disk = self
            .pages
            .checked_mul(slot_bytes(&self.geometry, DEFAULT_DIO_ALIGN)?)
            .and_then(|b| b.checked_mul(u64::from(self.ranks)));
        let free = self
            .dir
            .ancestors()
            .find_map(|d| rustix::fs::statvfs(d).ok())
            .map(|v| v.f_bavail.saturating_mul(v.f_frsize));
        match (disk, free) {
            (None, _) => Err(crate::overflow("the ranks' slot files")),
            (Some(need), Some(have)) if need > have => Err(Error::InvalidArgument(format!(
                "the ranks' slot files need {:.2} GB and {} has {:.2} GB free: lower --pages or --ranks",
                need as f64 / 1e9,
                self.dir.display(),
                have as f64 / 1e9
            ))),
            _ => Ok(()),
        }
    }

    /// Runs the benchmark in a private directory made in [`StorageBench::dir`] (removed at the
    /// end); returns the report (markdown).
    pub fn run(&self) -> Result<String> {
        self.validate()?;
        kvshard::transfer::nixl::load()?;
        // fio runs before kvshard's ranks and again after them; each ceiling is the faster of
        // its two passes. A shared disk's rate drifts over a minute by more than the store's
        // gap to fio: one pass after the ranks once measured below the store it bounds (H200
        // host, 2026-12-04, 52d98d8: store 104%, load 102% of fio's).
        // The store's slot size once its file's alignment is probed: 4 KiB on every disk so far.
        let slot_guess = slot_bytes(&self.geometry, DEFAULT_DIO_ALIGN)?;
        let before = self.ceilings(slot_guess)?;
        let private = private_dir(&self.dir, "kvshard-storage-bench-")?;
        let dir = private.path().to_path_buf();
        let barrier = Arc::new(Barrier::new(self.ranks as usize));
        let handles: Vec<_> = (0..self.ranks)
            .map(|r| {
                let (me, dir, barrier) = (self.clone(), dir.clone(), barrier.clone());
                std::thread::spawn(move || me.rank(r, &dir, &barrier))
            })
            .collect();
        let mut runs = Vec::new();
        for h in handles {
            runs.push(
                h.join()
                    .map_err(|_| Error::Verification("a benchmark rank panicked".into()))??,
            );
        }
        let (slot_bytes, queue) = (runs[0].1, runs[0].2.clone());
        let open_secs = runs.iter().map(|r| r.3).fold(0.0, f64::max);
        drop(private);
        let page_bytes = self.geometry.page_bytes() as f64;
        let mut out = format!(
            "## kvshard storage-bench: {} ranks, {} pages each in batches of {}, {:.2} MB pages in {} B slots, NIXL POSIX on {queue}, descriptors up to {} MiB, {} staging slots\n\n",
            self.ranks,
            self.pages,
            self.batch,
            page_bytes / 1e6,
            slot_bytes,
            self.max_io_bytes >> 20,
            self.staging_slots
        );
        out.push_str(&format!(
            "Slot files made (preallocated{}) in {:.2} s (the slowest rank's open).{}\n\n",
            if self.zero_fill {
                ", then written once with zeros"
            } else {
                ""
            },
            open_secs,
            if self.fio.is_some() {
                format!(
                    " fio ran {} s a case before the ranks and again after them; each ceiling is the faster pass.",
                    self.fio_seconds
                )
            } else {
                String::new()
            }
        ));
        let after = self.ceilings(slot_bytes)?;
        // The pass before counts only where it ran at the store's slot size.
        let before = if slot_guess == slot_bytes {
            before
        } else {
            Vec::new()
        };
        let ceilings = best_of(&before, &after);
        out.push_str("| op | GB/s per rank | GB/s all ranks | fio GB/s (slot size) | ratio to the faster fio | fio GB/s (layer block) | I/Os per page | host CPU us per page | batch p50 ms | batch p99 ms |\n|---|---|---|---|---|---|---|---|---|---|\n");
        // The first fill is compared with fio's first fill (a freshly fallocated file written
        // once), the others with fio overwriting its own blocks.
        let ops = [
            ("store (first fill) / fio first fill", 0usize, "first-fill"),
            ("store (first fill) / fio overwrite", 0, "write"),
            ("store (full: LRU reuse)", 1, "write"),
            ("load", 2, "read"),
        ];
        for (op, pick, fio_op) in ops {
            let rr: Vec<&RankRun> = runs.iter().map(|r| &r.0[pick]).collect();
            out.push_str(&self.row(op, &rr, fio_op, &ceilings));
        }
        if self.fio.is_none() {
            out.push_str(
                "\nNo fio ceiling: no fio binary (install Debian's fio, or pass --fio).\n",
            );
        } else {
            // Both passes, so that the disk's drift over the run shows beside the ratios.
            out.push_str(&format!(
                "\nfio GB/s before the ranks / after them: {}.\n",
                passes(&before, &after)
            ));
        }
        Ok(out)
    }

    /// One row of the report: `op` over every rank's run of it, against fio's `fio_op`.
    fn row(&self, op: &str, rr: &[&RankRun], fio_op: &str, ceilings: &Ceilings) -> String {
        let bytes = self.pages as f64 * self.geometry.page_bytes() as f64;
        let per_rank = rr.iter().map(|r| bytes / r.secs / 1e9).sum::<f64>() / rr.len() as f64;
        let slowest = rr.iter().map(|r| r.secs).fold(0.0, f64::max);
        let all = bytes * self.ranks as f64 / slowest / 1e9;
        let pages = self.pages as f64 * self.ranks as f64;
        let ios = rr.iter().map(|r| r.ios).sum::<u64>() as f64 / pages;
        let cpu = rr.iter().map(|r| r.cpu_secs).sum::<f64>() / pages * 1e6;
        let mut batches: Vec<f64> = rr.iter().flat_map(|r| r.batches.iter().copied()).collect();
        batches.sort_by(f64::total_cmp);
        let fio = |bs: &str| gbps_of(ceilings, fio_op, bs);
        let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        // The ceiling is the faster of fio's two block sizes in this run: fio's few seconds
        // on a shared disk vary by more than the two sizes differ (the H200 host's slot-size
        // read once measured below kvshard's own load).
        let best = match (fio("slot"), fio("layer")) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let ratio = best.map_or("-".to_string(), |f| {
            let pct = all / f * 100.0;
            let flag = if pct > 100.0 {
                " (above its ceiling: fio ran slower than the store; a longer --fio-seconds)"
            } else {
                ""
            };
            format!("{pct:.0}%{flag}")
        });
        format!(
            "| {op} | {per_rank:.2} | {all:.2} | {} | {ratio} | {} | {ios:.2} | {cpu:.0} | {:.2} | {:.2} |\n",
            show(fio("slot")),
            show(fio("layer")),
            percentile(&batches, 0.5) * 1e3,
            percentile(&batches, 0.99) * 1e3,
        )
    }

    /// One rank: store every page into empty slots, store as many new pages again (each one
    /// reclaiming the least recently used slot), then load those back (checked by the slots'
    /// CRCs). Returns (first fill, steady store, load), the slot bytes, the queue and the
    /// seconds the store took to open.
    fn rank(
        &self,
        r: u32,
        dir: &Path,
        barrier: &Barrier,
    ) -> Result<([RankRun; 3], u64, String, f64)> {
        let b = CpuBackend::new();
        let host = Arc::new(HostPool::new(
            &b,
            &self.geometry,
            self.batch as u64 + 1,
            HostLayout::PageFirstDirect,
        )?);
        // Non-zero bytes per page and rank (the store does not look at them beyond copying and
        // checksumming).
        for i in 0..host.buffer_layouts().len() {
            let m = host.buffer_memory(i)?;
            let data: Vec<u8> = (0..m.len())
                .map(|k| (k as u64 * 31 + u64::from(r) * 7) as u8)
                .collect();
            kvshard::backend::Backend::write_sync(&b, m, 0, &data)?;
        }
        let mut cfg = DiskConfig::new(dir, r, self.ranks, self.pages);
        cfg.staging_slots = self.staging_slots;
        cfg.max_io_bytes = self.max_io_bytes;
        cfg.timeout = Duration::from_secs(120);
        if self.aio {
            cfg.queue = QueueChoice::Aio;
        }
        cfg.zero_fill = self.zero_fill;
        let opened = Instant::now();
        let mut store = DiskStore::open(host, Arc::new(b.new_stream()), cfg)?;
        let open_secs = opened.elapsed().as_secs_f64();
        let ns = Namespace::new(&self.geometry, IndexerScale::Ue8m0, b"storage-bench")?;
        // Two key sets: the first fills every slot (fresh, preallocated blocks), the second
        // replaces it page by page through LRU reclaiming (the steady state of a full cache).
        let batches = |pass: u32| -> Vec<Vec<(PageKey, LocalPage)>> {
            let tokens: Vec<u32> = (0..self.pages * 64)
                .map(|i| (i as u32) ^ (r << 28) ^ (pass << 27))
                .collect();
            PageKey::chain(&ns, &tokens, None)
                .chunks(self.batch)
                .map(|c| {
                    c.iter()
                        .enumerate()
                        .map(|(i, k)| (*k, LocalPage(1 + i as u64)))
                        .collect()
                })
                .collect()
        };
        let (first, steady) = (batches(0), batches(1));
        let mut runs = [RankRun::default(), RankRun::default(), RankRun::default()];
        for (op, run) in runs.iter_mut().enumerate() {
            let batches = if op == 0 { &first } else { &steady };
            barrier.wait();
            let before = store.stats();
            let (t0, c0) = (Instant::now(), thread_cpu());
            for items in batches {
                let t = Instant::now();
                if op < 2 {
                    let rep = store.store_sync(items)?;
                    if rep.written != items.len() {
                        return Err(Error::Verification(format!("rank {r}: {rep:?}")));
                    }
                } else {
                    let out = store.load_sync(items)?;
                    if out.iter().any(|o| *o != LoadOutcome::Loaded) {
                        return Err(Error::Verification(format!(
                            "rank {r}: a page did not load"
                        )));
                    }
                }
                run.batches.push(t.elapsed().as_secs_f64());
            }
            run.secs = t0.elapsed().as_secs_f64();
            run.cpu_secs = thread_cpu() - c0;
            let after = store.stats();
            run.ios = if op < 2 {
                after.write_ios - before.write_ios
            } else {
                after.read_ios - before.read_ios
            };
        }
        Ok((
            runs,
            store.slot_bytes(),
            store.io_queue().to_string(),
            open_secs,
        ))
    }

    /// fio's bandwidth (GB/s) for (write|read) x (slot|layer): `numjobs` = ranks, direct I/O.
    fn ceilings(&self, slot_bytes: u64) -> Result<Vec<(&'static str, &'static str, f64)>> {
        let Some(fio) = &self.fio else {
            return Ok(Vec::new());
        };
        let private = private_dir(&self.dir, "kvshard-fio-")?;
        let dir = private.path();
        let layer = self.geometry.target.latent_block_bytes() as u64;
        let size = (slot_bytes * self.pages).max(64 << 20);
        let mut out = Vec::new();
        for op in ["write", "read"] {
            for (name, bs) in [("slot", slot_bytes), ("layer", layer)] {
                let gbps = self.fio_run(fio, dir, op, bs, size, Pass::Repeated)?;
                out.push((op, name, gbps));
            }
        }
        // The like of kvshard's first fill: every block of a freshly fallocated file written
        // once (the filesystem converts unwritten extents as it goes), files removed after.
        let gbps = self.fio_run(
            fio,
            dir,
            "write",
            slot_bytes,
            slot_bytes * self.pages,
            Pass::FirstFill,
        )?;
        out.push(("first-fill", "slot", gbps));
        Ok(out)
    }

    fn fio_run(
        &self,
        fio: &Path,
        dir: &Path,
        op: &str,
        bs: u64,
        size: u64,
        pass: Pass,
    ) -> Result<f64> {
        let engine = if self.aio {
            vec!["libaio"]
        } else {
            vec!["io_uring", "libaio"]
        };
        let mut last = String::new();
        for e in engine {
            let mut args = vec![
                format!("--directory={}", dir.display()),
                format!("--rw={op}"),
                format!("--bs={bs}"),
                "--direct=1".into(),
                format!("--ioengine={e}"),
                "--iodepth=32".into(),
                format!("--numjobs={}", self.ranks),
                format!("--size={size}"),
                format!("--runtime={}", self.fio_seconds),
                "--group_reporting".into(),
                "--output-format=json".into(),
            ];
            match pass {
                Pass::Repeated => args.extend(["--name=ceiling".into(), "--time_based".into()]),
                Pass::FirstFill => args.extend([
                    "--name=first-fill".into(),
                    "--fallocate=native".into(),
                    "--unlink=1".into(),
                ]),
            }
            let out = Command::new(fio)
                .args(&args)
                .output()
                .map_err(|source| Error::Os {
                    call: "run fio",
                    source,
                })?;
            let text = String::from_utf8_lossy(&out.stdout);
            let bw = text
                .split("\"bw_bytes\"")
                .skip(1)
                .filter_map(|s| s.trim_start_matches([' ', ':']).split([',', '\n']).next())
                .filter_map(|v| v.trim().parse::<f64>().ok())
                .fold(0.0, f64::max);
            if out.status.success() && bw > 0.0 {
                return Ok(bw / 1e9);
            }
            last = String::from_utf8_lossy(&out.stderr)
                .lines()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ");
        }
        Err(Error::Verification(format!(
            "fio {op} bs={bs} failed: {last}"
        )))
    }
}

/// fio's bandwidths of one pass over its cases: (op, block, GB/s).
type Ceilings = [(&'static str, &'static str, f64)];

/// The pass's bandwidth for `op` at `block`, if it ran that case.
fn gbps_of(pass: &Ceilings, op: &str, block: &str) -> Option<f64> {
    pass.iter().find(|c| c.0 == op && c.1 == block).map(|c| c.2)
}

/// Per (op, block) of `after`, the faster of its two passes' bandwidths.
fn best_of(before: &Ceilings, after: &Ceilings) -> Vec<(&'static str, &'static str, f64)> {
    after
        .iter()
        .map(|&(op, bs, gbps)| {
            let earlier = gbps_of(before, op, bs).unwrap_or(gbps);
            (op, bs, gbps.max(earlier))
        })
        .collect()
}

/// Each (op, block) of `after` with its two passes' bandwidths, "op block before / after"
/// ("-" where the pass before did not run at the store's slot size).
fn passes(before: &Ceilings, after: &Ceilings) -> String {
    after
        .iter()
        .map(|&(op, bs, gbps)| {
            let earlier = gbps_of(before, op, bs).map_or("-".to_string(), |g| format!("{g:.2}"));
            format!("{op} {bs} {earlier} / {gbps:.2}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Shape;

    /// One change to a run's settings, named.
    type Change = (&'static str, fn(&mut StorageBench));

    fn bench(dir: &Path) -> StorageBench {
        StorageBench {
            dir: dir.to_path_buf(),
            ranks: 2,
            geometry: Shape {
                ranks: 1,
                layers: 2,
                draft: true,
                seed: 0,
            }
            .geometry(),
            pages: 8,
            batch: 4,
            staging_slots: 4,
            max_io_bytes: 8 << 20,
            aio: false,
            fio: None,
            fio_seconds: 1,
            zero_fill: false,
        }
    }

    // Old behaviour: `--ranks 4294967295` aborted the process (a thread and a host pool per
    // rank) and `--batch 18446744073709551615` wrapped the host pool's page count to 0.
    #[test]
    fn sizes_out_of_bounds_are_refused_before_anything_is_allocated() {
        let base = std::env::temp_dir();
        assert!(bench(&base).validate().is_ok());
        let cases: [Change; 8] = [
            ("ranks u32::MAX", |b| b.ranks = u32::MAX),
            ("ranks 0", |b| b.ranks = 0),
            ("batch usize::MAX", |b| b.batch = usize::MAX),
            ("batch 0", |b| b.batch = 0),
            ("batch past pages", |b| b.batch = 9),
            ("pages u64::MAX", |b| {
                b.pages = u64::MAX;
                b.batch = 1;
            }),
            ("staging usize::MAX", |b| b.staging_slots = usize::MAX),
            ("staging 0", |b| b.staging_slots = 0),
        ];
        for (what, change) in cases {
            let mut b = bench(&base);
            change(&mut b);
            let e = b.validate();
            assert!(
                matches!(e, Err(Error::InvalidArgument(_) | Error::Overflow { .. })),
                "{what}: {e:?}"
            );
        }
    }

    #[test]
    fn each_ceiling_is_the_faster_of_the_passes_before_and_after() {
        let before = [("write", "slot", 2.6), ("read", "slot", 1.5)];
        let after = [
            ("write", "slot", 2.4),
            ("read", "slot", 1.7),
            ("read", "layer", 1.4),
        ];
        assert_eq!(
            best_of(&before, &after),
            vec![
                ("write", "slot", 2.6),
                ("read", "slot", 1.7),
                ("read", "layer", 1.4)
            ]
        );
        assert_eq!(best_of(&[], &after), after.to_vec());
        assert_eq!(
            passes(&before, &after),
            "write slot 2.60 / 2.40, read slot 1.50 / 1.70, read layer - / 1.40"
        );
    }

    #[test]
    fn a_private_dir_is_made_fresh_for_the_run_and_removed_after() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("kvshard-private-{}", std::process::id()));
        let a = private_dir(&base, "kvshard-x-").unwrap();
        let b = private_dir(&base, "kvshard-x-").unwrap();
        assert_ne!(a.path(), b.path());
        let mode = std::fs::metadata(a.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(a.path().join("f"), b"x").unwrap();
        let kept = a.path().to_path_buf();
        drop(a);
        assert!(!kept.exists());
        drop(b);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
