//! The storage tier (feature `nixl`) on NIXL's POSIX backend against a temporary directory, on
//! the CPU: byte-identical round trips of random pages between ranks with different host
//! layouts, LRU reclaiming, reopening, a read-only rank, journal compaction (and a writer
//! killed while compacting), a writer killed mid-write (a child process: this test
//! binary run again with `--exact child_entry` and `KVSHARD_STORAGE_CHILD` set), flipped bytes,
//! and the typed errors of an unusable directory and a full disk.
//!
//! They need the NIXL runtime (`scripts/install-nixl.sh`, its folder on LD_LIBRARY_PATH):
//! without it they print SKIPPED, or fail when KVSHARD_REQUIRE_NIXL is set (CI sets it). The
//! directories are made under the target directory (a real filesystem: tmpfs may refuse
//! O_DIRECT).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::Backend;
use kvshard::copy::BlockSpace;
use kvshard::error::StorageFailure;
use kvshard::geometry::{CacheGeometry, IndexerScale, LatentLayout, PoolGeometry};
use kvshard::hicache::{HostFormat, HostLayout, HostPool};
use kvshard::index::{LocalPage, StoredLayer};
use kvshard::key::{Namespace, PageKey};
use kvshard::pool::disk::{DiskConfig, DiskStore, IoQueue, LoadOutcome, QueueChoice};
use kvshard::Error;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

const CHILD: &str = "KVSHARD_STORAGE_CHILD";
const DIR: &str = "KVSHARD_STORAGE_DIR";
const POISON: u8 = 0xA5;
const PAGES: u64 = 24;

fn geometry() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Scaled,
        vec![true, false, true],
    ))
}

fn nixl_available(test: &str) -> bool {
    match kvshard::transfer::nixl::load() {
        Ok(()) => true,
        Err(e) => {
            assert!(
                std::env::var_os("KVSHARD_REQUIRE_NIXL").is_none(),
                "{test}: KVSHARD_REQUIRE_NIXL is set but {e}"
            );
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {e}");
            false
        }
    }
}

/// A fresh directory for `test` under the target directory.
fn scratch(test: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let target = exe
        .ancestors()
        .find(|p| p.file_name().is_some_and(|n| n == "target"))
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let dir = target.join("storage-tests").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Another stream of `b`'s arena, shared: what a store takes (it asks it about the work queued
/// on the host pages it reads and writes).
fn stream(b: &CpuBackend) -> Arc<dyn Backend> {
    Arc::new(b.new_stream())
}

fn host(b: &CpuBackend, format: HostFormat) -> Arc<HostPool> {
    let h = HostPool::new_with(b, &geometry(), PAGES, format).expect("host pool");
    poison(&h, b);
    Arc::new(h)
}

/// Fills `h` with [`POISON`] and waits for it: the store reads and writes host pages directly,
/// outside the backend's stream order, as a DMA engine would.
fn poison(h: &HostPool, b: &CpuBackend) {
    h.fill(b, POISON).expect("fill");
    b.synchronize().expect("synchronize");
}

/// Every row of `page` of every component, in one order.
fn read_page(h: &HostPool, b: &CpuBackend, page: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for c in h.components().to_vec() {
        let buf = h.buffer(c.component).unwrap();
        for l in 0..c.layers() {
            for r in 0..c.rows {
                let at = h
                    .row_offset(c.component, StoredLayer(l), LocalPage(page), r)
                    .unwrap();
                out.extend(b.read_sync(buf, at as usize, c.row_bytes).unwrap());
            }
        }
    }
    out
}

fn write_page(h: &HostPool, b: &CpuBackend, page: u64, data: &[u8]) {
    let mut at = 0;
    for c in h.components().to_vec() {
        let buf = h.buffer(c.component).unwrap();
        for l in 0..c.layers() {
            for r in 0..c.rows {
                let off = h
                    .row_offset(c.component, StoredLayer(l), LocalPage(page), r)
                    .unwrap();
                b.write_sync(buf, off as usize, &data[at..at + c.row_bytes])
                    .unwrap();
                at += c.row_bytes;
            }
        }
    }
}

/// The pages of batch `batch` of seed `seed`: their keys (one chain) and random bytes.
fn batch(seed: u64, batch: u64, pages: usize) -> (Vec<PageKey>, Vec<Vec<u8>>) {
    let g = geometry();
    let ns = Namespace::new(&g, IndexerScale::Ue8m0, b"tests").unwrap();
    let mut rng = StdRng::seed_from_u64(seed ^ (batch << 20));
    let tokens: Vec<u32> = (0..pages * 64).map(|_| rng.random()).collect();
    let keys = PageKey::chain(&ns, &tokens, None);
    let data = (0..pages)
        .map(|_| {
            let mut d = vec![0u8; g.page_bytes()];
            rng.fill_bytes(&mut d);
            d
        })
        .collect();
    (keys, data)
}

fn config(dir: &Path, writer: u32, writers: u32, slots: u64) -> DiskConfig {
    let mut c = DiskConfig::new(dir, writer, writers, slots);
    c.staging_slots = 5;
    c.timeout = Duration::from_secs(20);
    c
}

#[test]
fn pages_round_trip_between_ranks_byte_for_byte() {
    if !nixl_available("pages_round_trip_between_ranks_byte_for_byte") {
        return;
    }
    let dir = scratch("round_trip");
    let b = CpuBackend::new();
    let h0 = host(&b, HostLayout::LayerFirst.into());
    let h1 = host(&b, HostFormat::sglang(HostLayout::PageFirst, true));
    let mut s0 = DiskStore::open(h0.clone(), stream(&b), config(&dir, 0, 2, 64)).unwrap();
    let mut s1 = DiskStore::open(h1.clone(), stream(&b), config(&dir, 1, 2, 64)).unwrap();
    eprintln!(
        "storage: {} ({} B pages in {} B slots)",
        s0.io_queue(),
        s0.page_bytes(),
        s0.slot_bytes()
    );
    // A chain of 12 pages; rank 0 owns the even positions, rank 1 the odd ones (each writes
    // its own, from its own host pages).
    let (keys, data) = batch(1, 0, 12);
    let mut owned = [Vec::new(), Vec::new()];
    for (i, (k, d)) in keys.iter().zip(&data).enumerate() {
        let (h, page) = (if i % 2 == 0 { &h0 } else { &h1 }, 1 + i as u64 / 2);
        write_page(h, &b, page, d);
        owned[i % 2].push((*k, LocalPage(page)));
    }
    let r0 = s0.store_sync(&owned[0]).unwrap();
    let r1 = s1.store_sync(&owned[1]).unwrap();
    assert_eq!((r0.written, r1.written), (6, 6));
    // Written again: present, not rewritten. An empty batch is fine.
    assert_eq!(s0.store_sync(&owned[0]).unwrap().present, 6);
    assert_eq!(s0.store_sync(&[]).unwrap().written, 0);
    assert!(s1.load_sync(&[]).unwrap().is_empty());
    // Rank 0 takes the snapshot; both answer the same for it.
    let snap = s0.snapshot().unwrap();
    assert_eq!(s0.lookup(&keys, &snap).unwrap(), 12);
    assert_eq!(s1.lookup(&keys, &snap).unwrap(), 12);
    let (other, _) = batch(1, 9, 2);
    let mut longer = keys.clone();
    longer.insert(5, other[0]);
    assert_eq!(s1.lookup(&longer, &snap).unwrap(), 5);
    assert_eq!(s0.exists(&other, &snap).unwrap(), vec![false, false]);
    // An older snapshot (before rank 1 wrote) sees only rank 0's pages, on either rank.
    let empty = kvshard::pool::disk::Snapshot::from_records(vec![6, 0]);
    assert_eq!(s1.exists(&keys[..2], &empty).unwrap(), vec![true, false]);
    // Rank 1 loads the whole chain (rank 0's pages too) into pages 12..24 of its pool.
    let items: Vec<(PageKey, LocalPage)> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, LocalPage(12 + i as u64)))
        .collect();
    let out = s1.load_sync(&items).unwrap();
    assert!(out.iter().all(|o| *o == LoadOutcome::Loaded), "{out:?}");
    for (i, d) in data.iter().enumerate() {
        assert!(read_page(&h1, &b, 12 + i as u64) == *d, "page {i}");
    }
    // Missing keys leave their host page untouched.
    let out = s0.load_sync(&[(other[1], LocalPage(20))]).unwrap();
    assert_eq!(out, vec![LoadOutcome::Missing]);
    assert!(read_page(&h0, &b, 20).iter().all(|&x| x == POISON));
    let stats = s1.stats();
    assert_eq!((stats.loaded_pages, stats.corrupt_pages), (12, 0));
    // Reopened (a restart): the journals rebuild the index.
    drop((s0, s1));
    let h2 = host(&b, HostFormat::sglang(HostLayout::PageFirstDirect, false));
    let mut s0 = DiskStore::open(h2.clone(), stream(&b), config(&dir, 0, 2, 64)).unwrap();
    let snap = s0.snapshot().unwrap();
    assert_eq!(snap.records(), &[6, 6]);
    assert_eq!(s0.lookup(&keys, &snap).unwrap(), 12);
    let out = s0.load_sync(&items[..12]).unwrap();
    assert!(out.iter().all(|o| *o == LoadOutcome::Loaded));
    for (i, d) in data.iter().enumerate() {
        assert!(
            read_page(&h2, &b, 12 + i as u64) == *d,
            "page {i} after reopen"
        );
    }
}

#[test]
fn a_read_only_rank_replays_looks_up_and_loads_but_never_writes() {
    if !nixl_available("a_read_only_rank_replays_looks_up_and_loads_but_never_writes") {
        return;
    }
    let dir = scratch("read_only");
    let b = CpuBackend::new();
    let read_only = |writer: u32| {
        let mut c = config(&dir, writer, 2, 16);
        c.read_only = true;
        c
    };
    // Nothing there yet: nothing to open, and nothing is created.
    let h1 = host(&b, HostFormat::sglang(HostLayout::PageFirst, true));
    match DiskStore::open(h1.clone(), stream(&b), read_only(1)) {
        Err(Error::Storage {
            failure: StorageFailure::Open,
            ..
        }) => {}
        other => panic!("read-only open of an empty directory: {other:?}"),
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // Rank 0 writes 6 pages; rank 1 only reads.
    let h0 = host(&b, HostLayout::LayerFirst.into());
    let mut s0 = DiskStore::open(h0.clone(), stream(&b), config(&dir, 0, 2, 16)).unwrap();
    let (keys, data) = batch(7, 0, 10);
    let items = |from: usize, to: usize, base: u64| -> Vec<(PageKey, LocalPage)> {
        (from..to)
            .map(|i| (keys[i], LocalPage(base + i as u64)))
            .collect()
    };
    for (i, d) in data.iter().enumerate() {
        write_page(&h0, &b, 1 + i as u64, d);
    }
    s0.store_sync(&items(0, 6, 1)).unwrap();
    let files = |d: &Path| {
        let mut v: Vec<(String, u64)> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    e.metadata().unwrap().len(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let before = files(&dir);
    let mut r = DiskStore::open(h1.clone(), stream(&b), read_only(1)).unwrap();
    assert!(r.read_only());
    // Replayed at open: its own snapshot sees rank 0's pages, and so does rank 0's.
    let snap = r.snapshot().unwrap();
    assert_eq!(snap.records(), &[6, 0]);
    assert_eq!(r.lookup(&keys, &snap).unwrap(), 6);
    assert_eq!(r.lookup(&keys, &s0.snapshot().unwrap()).unwrap(), 6);
    let out = r.load_sync(&items(0, 6, 10)).unwrap();
    assert!(out.iter().all(|o| *o == LoadOutcome::Loaded), "{out:?}");
    for (i, d) in data.iter().enumerate().take(6) {
        assert!(read_page(&h1, &b, 10 + i as u64) == *d, "page {i}");
    }
    // A write is a typed error, and touches nothing.
    match r.store_sync(&items(6, 8, 1)) {
        Err(Error::Storage {
            failure: StorageFailure::ReadOnly,
            ..
        }) => {}
        other => panic!("a store on a read-only rank: {other:?}"),
    }
    assert_eq!(r.used_slots(), 0);
    // Rank 0 writes more, the reader's next snapshot (or rank 0's) brings them in.
    s0.store_sync(&items(6, 10, 1)).unwrap();
    let later = s0.snapshot().unwrap();
    assert_eq!(r.lookup(&keys, &later).unwrap(), 10);
    assert_eq!(r.snapshot().unwrap().records(), &[10, 0]);
    // A damaged slot is a counted miss on the reader, which frees nothing (it cannot).
    drop(s0);
    let w0 = dir.join("w0000.slots");
    let mut bytes = std::fs::read(&w0).unwrap();
    let slot = r.slot_bytes() as usize;
    bytes[2 * slot + 100] ^= 0xFF;
    std::fs::write(&w0, &bytes).unwrap();
    let out = r.load_sync(&items(0, 3, 10)).unwrap();
    assert_eq!(
        out.iter().filter(|o| **o == LoadOutcome::Corrupt).count(),
        1,
        "{out:?}"
    );
    assert_eq!(r.stats().corrupt_pages, 1);
    drop(r);
    // The reader created and grew nothing: only rank 0's files, which rank 0 grew.
    let after = files(&dir);
    assert_eq!(
        after.iter().map(|f| &f.0).collect::<Vec<_>>(),
        before.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    assert!(
        after.iter().all(|(n, _)| n.starts_with("w0000.")),
        "{after:?}"
    );
    // Another slot count than the writers': refused as a format error.
    let mut wrong = read_only(1);
    wrong.slots = 17;
    assert!(matches!(
        DiskStore::open(h1, stream(&b), wrong),
        Err(Error::Storage {
            failure: StorageFailure::Format,
            ..
        })
    ));
}

#[test]
fn full_files_reclaim_the_least_recently_used_slots() {
    if !nixl_available("full_files_reclaim_the_least_recently_used_slots") {
        return;
    }
    let dir = scratch("lru");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::PageFirstDirect.into());
    // On libaio (what a container that blocks io_uring gets).
    let mut c = config(&dir, 0, 1, 8);
    c.queue = QueueChoice::Aio;
    let mut s = DiskStore::open(h.clone(), stream(&b), c).unwrap();
    assert!(matches!(s.io_queue(), IoQueue::Aio { .. }));
    let (keys, data) = batch(2, 0, 12);
    for (i, d) in data.iter().enumerate() {
        write_page(&h, &b, 1 + i as u64, d);
    }
    let items: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, LocalPage(1 + i as u64)))
        .collect();
    s.store_sync(&items[..8]).unwrap();
    // Page 0 used again: pages 1..5 are the least recently used.
    let snap = s.snapshot().unwrap();
    assert!(s.exists(&keys[..1], &snap).unwrap()[0]);
    let r = s.store_sync(&items[8..]).unwrap();
    assert_eq!((r.written, r.evicted), (4, 4));
    assert_eq!(s.used_slots(), 8);
    let snap = s.snapshot().unwrap();
    let present = s.exists(&keys, &snap).unwrap();
    let expected: Vec<bool> = (0..12).map(|i| i == 0 || i >= 5).collect();
    assert_eq!(present, expected);
    poison(&h, &b);
    let out = s.load_sync(&items).unwrap();
    for (i, o) in out.iter().enumerate() {
        if expected[i] {
            assert_eq!(*o, LoadOutcome::Loaded);
            assert!(read_page(&h, &b, 1 + i as u64) == data[i], "page {i}");
        } else {
            assert_eq!(*o, LoadOutcome::Missing);
        }
    }
}

#[test]
fn flipped_bytes_are_a_counted_miss() {
    if !nixl_available("flipped_bytes_are_a_counted_miss") {
        return;
    }
    let dir = scratch("corrupt");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 8)).unwrap();
    let (keys, data) = batch(3, 0, 3);
    let items: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, LocalPage(1 + i as u64)))
        .collect();
    for (i, d) in data.iter().enumerate() {
        write_page(&h, &b, 1 + i as u64, d);
    }
    s.store_sync(&items).unwrap();
    // A fresh store takes the free slots lowest first: page i is in slot i. Flip a byte in the
    // middle of slot 1.
    let path = dir.join("w0000.slots");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = (s.slot_bytes() + s.page_bytes() / 2) as usize;
    bytes[at] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    poison(&h, &b);
    let out = s.load_sync(&items).unwrap();
    assert_eq!(
        out,
        vec![
            LoadOutcome::Loaded,
            LoadOutcome::Corrupt,
            LoadOutcome::Loaded
        ]
    );
    assert_eq!(s.stats().corrupt_pages, 1);
    assert!(read_page(&h, &b, 2).iter().all(|&x| x == POISON));
    assert!(read_page(&h, &b, 3) == data[2]);
    // The damaged page left the index (its Free record): a miss for every rank from now on,
    // and after a restart.
    let snap = s.snapshot().unwrap();
    assert_eq!(s.exists(&keys, &snap).unwrap(), vec![true, false, true]);
    drop(s);
    let mut s = DiskStore::open(h, stream(&b), config(&dir, 0, 1, 8)).unwrap();
    let snap = s.snapshot().unwrap();
    assert_eq!(s.exists(&keys, &snap).unwrap(), vec![true, false, true]);
}

#[test]
fn unusable_directories_and_full_disks_are_typed_errors() {
    if !nixl_available("unusable_directories_and_full_disks_are_typed_errors") {
        return;
    }
    let dir = scratch("errors");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    // A directory below a regular file cannot be made (root or not).
    let file = dir.join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    match DiskStore::open(h.clone(), stream(&b), config(&file.join("cp0"), 0, 1, 4)) {
        Err(Error::Storage {
            failure: StorageFailure::Open,
            ..
        }) => {}
        other => panic!("expected an open failure, got {other:?}"),
    }
    // More slots than the filesystem has room for: refused before anything is allocated.
    let vfs = rustix::fs::statvfs(&dir).unwrap();
    let free = vfs.f_bavail * vfs.f_frsize;
    let slots = free / geometry().page_bytes() as u64 * 2 + 1;
    match DiskStore::open(h.clone(), stream(&b), config(&dir.join("full"), 0, 1, slots)) {
        Err(Error::Storage {
            failure: StorageFailure::Full,
            ..
        }) => {}
        other => panic!("expected a full disk, got {other:?}"),
    }
    let len = std::fs::metadata(dir.join("full").join("w0000.slots"))
        .unwrap()
        .len();
    assert_eq!(len, 0, "nothing allocated");
    // Another slot count than the journal's: a format error, naming the journal.
    drop(DiskStore::open(h.clone(), stream(&b), config(&dir.join("fmt"), 0, 1, 4)).unwrap());
    match DiskStore::open(h.clone(), stream(&b), config(&dir.join("fmt"), 0, 1, 5)) {
        Err(Error::Storage {
            failure: StorageFailure::Format,
            ..
        }) => {}
        other => panic!("expected a format error, got {other:?}"),
    }
    // Bad arguments, and host pages outside the pool (page 0 is padding).
    assert!(DiskStore::open(h.clone(), stream(&b), config(&dir, 2, 2, 4)).is_err());
    let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir.join("ok"), 0, 1, 4)).unwrap();
    let (keys, _) = batch(4, 0, 1);
    assert!(s.store_sync(&[(keys[0], LocalPage(0))]).is_err());
    assert!(s.load_sync(&[(keys[0], LocalPage(PAGES))]).is_err());
    // A pool of another backend: its buffers are not that arena's.
    let other = CpuBackend::new();
    assert!(DiskStore::open(h, stream(&other), config(&dir.join("ok2"), 0, 1, 4)).is_err());
}

/// Batches the crash child writes before the parent kills it (it keeps writing after, up to
/// `CRASH_BATCHES`, never reclaiming a slot: `CRASH_SLOTS` hold them all).
const COMMITTED_BATCHES: u64 = 2;
const BATCH_PAGES: usize = 10;
const CRASH_BATCHES: u64 = 200;
const CRASH_SLOTS: u64 = 2048;

#[test]
fn a_writer_killed_mid_write_leaves_only_whole_pages() {
    if !nixl_available("a_writer_killed_mid_write_leaves_only_whole_pages") {
        return;
    }
    let dir = scratch("crash");
    let marker = dir.join("committed");
    let mut child = Command::new(std::env::current_exe().expect("test binary path"))
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, "writer")
        .env(DIR, &dir)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the writer");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !marker.exists() {
        assert!(Instant::now() < deadline, "the writer never committed");
        assert!(child.try_wait().unwrap().is_none(), "the writer exited");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Let it get into later batches, then kill it wherever it is.
    std::thread::sleep(Duration::from_millis(rand::rng().random_range(0..30u64)));
    child.kill().expect("kill the writer");
    child.wait().expect("reap the writer");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::PageFirst.into());
    let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, CRASH_SLOTS)).unwrap();
    let snap = s.snapshot().unwrap();
    let (mut hits, mut misses) = (0, 0);
    // Batch after batch until one with no page at all (the writer never got to it).
    for n in 0..CRASH_BATCHES {
        let (keys, data) = batch(5, n, BATCH_PAGES);
        let present = s.exists(&keys, &snap).unwrap();
        if n < COMMITTED_BATCHES {
            assert!(present.iter().all(|&p| p), "committed batch {n} lost");
        }
        let items: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, LocalPage(1 + i as u64)))
            .collect();
        poison(&h, &b);
        let out = s.load_sync(&items).unwrap();
        for (i, o) in out.iter().enumerate() {
            match o {
                LoadOutcome::Loaded => {
                    assert!(present[i]);
                    assert!(
                        read_page(&h, &b, 1 + i as u64) == data[i],
                        "batch {n} page {i}"
                    );
                    hits += 1;
                }
                LoadOutcome::Missing => {
                    assert!(!present[i]);
                    misses += 1;
                }
                LoadOutcome::Corrupt => panic!("batch {n} page {i}: a torn page reached a load"),
            }
        }
        if present.iter().all(|&p| !p) {
            break;
        }
    }
    eprintln!("crash: {hits} whole pages after the kill, {misses} never committed");
    assert!(hits >= COMMITTED_BATCHES as usize * BATCH_PAGES);
    assert!(
        misses > 0,
        "the writer finished every batch before the kill"
    );
    assert_eq!(s.stats().corrupt_pages, 0);
}

/// The crash test's writer: commits `COMMITTED_BATCHES` batches, says so, then writes batch
/// after batch until killed.
fn writer(dir: &Path) {
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let mut s = DiskStore::open(h.clone(), stream(&b), config(dir, 0, 1, CRASH_SLOTS)).unwrap();
    for n in 0..CRASH_BATCHES {
        let (keys, data) = batch(5, n, BATCH_PAGES);
        for (i, d) in data.iter().enumerate() {
            write_page(&h, &b, 1 + i as u64, d);
        }
        let items: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, LocalPage(1 + i as u64)))
            .collect();
        s.store_sync(&items).unwrap();
        if n + 1 == COMMITTED_BATCHES {
            std::fs::write(dir.join("committed"), b"").unwrap();
        }
    }
}

/// The entry point of child processes; does nothing in an ordinary run.
#[test]
fn child_entry() {
    if let (Ok(role), Some(dir)) = (std::env::var(CHILD), std::env::var_os(DIR)) {
        match role.as_str() {
            "writer" => writer(Path::new(&dir)),
            "compactor" => compactor(Path::new(&dir)),
            other => panic!("no child role {other}"),
        }
    }
}

/// Slots of the compaction tests' writer, and its batches (of [`COMPACT_PAGES`] pages):
/// the first two fill the file, each later one reclaims as many slots (a `Free` and a
/// `Commit` record per page).
const COMPACT_SLOTS: u64 = 8;
const COMPACT_PAGES: usize = 4;
const COMPACT_BATCHES: u64 = 6;

/// Stores the compaction tests' batches on `s` from host `h`.
fn store_compact_batches(
    s: &mut DiskStore,
    h: &HostPool,
    b: &CpuBackend,
    batches: std::ops::Range<u64>,
) {
    for n in batches {
        let (keys, data) = batch(6, n, COMPACT_PAGES);
        for (i, d) in data.iter().enumerate() {
            write_page(h, b, 1 + i as u64, d);
        }
        let items: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, LocalPage(1 + i as u64)))
            .collect();
        assert_eq!(s.store_sync(&items).unwrap().written, COMPACT_PAGES);
    }
}

/// Checks a store of the compaction tests' writer: every position is there (`positions`), the
/// last two batches are present and load byte for byte, the others are not.
fn check_compacted(s: &mut DiskStore, h: &HostPool, b: &CpuBackend, positions: u64) {
    let snap = s.snapshot().unwrap();
    assert_eq!(snap.records()[0], positions);
    for n in 0..COMPACT_BATCHES {
        let (keys, data) = batch(6, n, COMPACT_PAGES);
        let live = n + 2 >= COMPACT_BATCHES;
        assert_eq!(
            s.exists(&keys, &snap).unwrap(),
            vec![live; COMPACT_PAGES],
            "batch {n}"
        );
        if live {
            let items: Vec<_> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| (*k, LocalPage(1 + i as u64)))
                .collect();
            poison(h, b);
            let out = s.load_sync(&items).unwrap();
            assert!(out.iter().all(|o| *o == LoadOutcome::Loaded), "{out:?}");
            for (i, d) in data.iter().enumerate() {
                assert!(read_page(h, b, 1 + i as u64) == *d, "batch {n} page {i}");
            }
        }
    }
}

/// Positions the compaction tests' writer's journal holds after every batch.
const COMPACT_POSITIONS: u64 =
    2 * COMPACT_PAGES as u64 + (COMPACT_BATCHES - 2) * 2 * COMPACT_PAGES as u64;

/// The compaction crash test's child: stores every batch, says so, then compacts its journal
/// again and again until killed.
fn compactor(dir: &Path) {
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let mut s = DiskStore::open(h.clone(), stream(&b), config(dir, 0, 1, COMPACT_SLOTS)).unwrap();
    store_compact_batches(&mut s, &h, &b, 0..COMPACT_BATCHES);
    std::fs::write(dir.join("stored"), b"").unwrap();
    loop {
        s.compact_journal_sync().unwrap();
    }
}

#[test]
fn journals_compact_past_their_bound_and_every_rank_still_agrees() {
    if !nixl_available("journals_compact_past_their_bound_and_every_rank_still_agrees") {
        return;
    }
    let dir = scratch("compact");
    let b = CpuBackend::new();
    let (h0, h1) = (
        host(&b, HostLayout::LayerFirst.into()),
        host(&b, HostFormat::sglang(HostLayout::PageFirst, true)),
    );
    let mut c0 = config(&dir, 0, 2, COMPACT_SLOTS);
    c0.journal_records = 20;
    let mut s0 = DiskStore::open(h0.clone(), stream(&b), c0.clone()).unwrap();
    let mut s1 = DiskStore::open(h1.clone(), stream(&b), config(&dir, 1, 2, COMPACT_SLOTS)).unwrap();
    store_compact_batches(&mut s0, &h0, &b, 0..2);
    // Rank 1 replays the uncompacted journal: a snapshot before any compaction.
    let early = s1.snapshot().unwrap();
    assert_eq!(early.records(), &[8, 0]);
    let (first, _) = batch(6, 0, COMPACT_PAGES);
    assert_eq!(s1.lookup(&first, &early).unwrap(), COMPACT_PAGES);
    // Four more batches: 8 records each, compacted whenever past 20.
    let mut shrank = false;
    for n in 2..COMPACT_BATCHES {
        let before = s0.journal_records().unwrap();
        store_compact_batches(&mut s0, &h0, &b, n..n + 1);
        shrank |= s0.journal_records().unwrap() < before;
        assert!(s0.journal_records().unwrap() <= 20, "{n}");
    }
    assert!(shrank, "the journal was never compacted");
    assert!(!dir.join("w0000.journal.compact").exists());
    // Rank 1 goes on from where it was, in the compacted file: the same positions.
    let snap = s0.snapshot().unwrap();
    assert_eq!(snap.records(), &[COMPACT_POSITIONS, 0]);
    assert_eq!(s1.snapshot().unwrap(), snap);
    check_compacted(&mut s1, &h1, &b, COMPACT_POSITIONS);
    // A rank opening now (read-only) reads only the compacted journal, and agrees.
    let mut ro = config(&dir, 1, 2, COMPACT_SLOTS);
    ro.read_only = true;
    let mut r = DiskStore::open(h1.clone(), stream(&b), ro).unwrap();
    check_compacted(&mut r, &h1, &b, COMPACT_POSITIONS);
    // So does the writer, reopened.
    drop(s0);
    let mut s0 = DiskStore::open(h0.clone(), stream(&b), c0).unwrap();
    check_compacted(&mut s0, &h0, &b, COMPACT_POSITIONS);
}

#[test]
fn a_writer_killed_while_compacting_keeps_every_page() {
    if !nixl_available("a_writer_killed_while_compacting_keeps_every_page") {
        return;
    }
    let dir = scratch("compact_crash");
    let marker = dir.join("stored");
    let mut child = Command::new(std::env::current_exe().expect("test binary path"))
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, "compactor")
        .env(DIR, &dir)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the compactor");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !marker.exists() {
        assert!(Instant::now() < deadline, "the compactor never stored");
        assert!(child.try_wait().unwrap().is_none(), "the compactor exited");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Kill it wherever it is in its compactions (writing, syncing, renaming).
    std::thread::sleep(Duration::from_millis(rand::rng().random_range(1..40u64)));
    child.kill().expect("kill the compactor");
    child.wait().expect("reap the compactor");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::PageFirst.into());
    let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, COMPACT_SLOTS)).unwrap();
    assert!(!dir.join("w0000.journal.compact").exists());
    check_compacted(&mut s, &h, &b, COMPACT_POSITIONS);
}

/// The L3 stage of the HiCache controller on two ranks: write-through once the host backup is
/// acked and the keys are known, FIFO acks with the same indices on both ranks (rank 1 owns
/// none of a one-page node's pages: its operation is empty and acked in turn), eviction from
/// the host, a group-agreed lookup, prefetch back into new host pages byte for byte, then the
/// ordinary load to the device.
#[test]
fn the_controller_writes_through_to_storage_and_prefetches_back() {
    use kvshard::backend::Event;
    use kvshard::copy::Method;
    use kvshard::hicache::{CacheNode, HiCacheController, StoragePolicy, Streams, WritePolicy};
    use kvshard::index::LogicalPage;
    use kvshard::pool::DevicePool;
    use kvshard::shard::Placement;

    if !nixl_available("the_controller_writes_through_to_storage_and_prefetches_back") {
        return;
    }
    let dir = scratch("controller");
    let cpu = CpuBackend::new();
    let g = geometry();
    let placement = Placement::new(2).unwrap();
    let stream = || -> Arc<dyn Backend> { Arc::new(cpu.new_stream()) };
    let timeout = Duration::from_secs(20);
    let mut cs: Vec<HiCacheController> = (0..2u32)
        .map(|r| {
            let pool = Arc::new(DevicePool::allocate(&cpu, &g, placement, r, 16).unwrap());
            pool.fill(&cpu, 0x11 * (r as u8 + 1)).unwrap();
            let host = host(&cpu, HostLayout::PageFirstDirect.into());
            let streams = Streams {
                load: stream(),
                backup: stream(),
                load_relayout: stream(),
                backup_relayout: stream(),
                tables: stream(),
            };
            let mut c =
                HiCacheController::new(pool, host.clone(), streams, WritePolicy::WriteThrough)
                    .unwrap();
            let store = DiskStore::open(host, stream(), config(&dir, r, 2, 32)).unwrap();
            c.attach_storage(store, StoragePolicy::WriteThrough, timeout)
                .unwrap();
            c
        })
        .collect();
    let lp = |v: &[u64]| v.iter().map(|&p| LogicalPage(p)).collect::<Vec<_>>();
    let a = CacheNode {
        id: 7,
        device_pages: lp(&[2, 3, 4, 5]),
        start_owner: None,
    };
    let one = CacheNode {
        id: 8,
        device_pages: lp(&[6]),
        start_owner: None,
    };
    let (keys_a, data_a) = batch(6, 0, 4);
    let (keys_one, _) = batch(6, 1, 1);
    let compute: Event = cpu.record().unwrap();
    // Backed up to the host (no keys yet: nothing goes to storage).
    for c in cs.iter_mut() {
        for n in [&a, &one] {
            c.backup(n, &compute, Method::CopyEngine).unwrap();
        }
        c.ack_backups_sync(2).unwrap();
    }
    // Random bytes in the host pages of node a (what the device would have held).
    let mut saved = std::collections::HashMap::new();
    for c in cs.iter() {
        let rank = c.device().rank();
        let host_pages = c.host_pages(a.id).unwrap().to_vec();
        for (i, p) in host_pages.iter().enumerate() {
            if placement.owner(*p) == rank {
                write_page(c.host(), &cpu, placement.local(*p).0, &data_a[i]);
                saved.insert(i, rank);
            }
        }
    }
    assert_eq!(saved.len(), 4, "every page has one owner");
    // The keys arrive: write-through stores now, each rank its own pages.
    for c in cs.iter_mut() {
        c.set_keys(a.id, keys_a.clone()).unwrap();
        c.set_keys(one.id, keys_one.clone()).unwrap();
    }
    let mut acks = Vec::new();
    for c in cs.iter_mut() {
        let deadline = Instant::now() + timeout;
        while c.poll_storage().unwrap() < 2 {
            assert!(Instant::now() < deadline, "stores never completed");
            std::thread::sleep(Duration::from_millis(1));
        }
        acks.push(c.ack_storage_sync(2).unwrap());
    }
    for (r, a) in acks.iter().enumerate() {
        assert_eq!(a.iter().map(|x| x.index).collect::<Vec<_>>(), vec![0, 1]);
        assert!(a.iter().all(|x| x.complete), "rank {r}: {a:?}");
    }
    assert_eq!(acks[0][0].pages + acks[1][0].pages, 4);
    assert_eq!(
        (acks[0][1].pages, acks[1][1].pages),
        (1, 0),
        "rank 1 owns nothing of node 8"
    );
    // The node leaves the host; the group agrees it is in storage.
    for c in cs.iter_mut() {
        assert!(c.evict_host_sync(a.id).unwrap().is_empty());
        assert!(c.host_pages(a.id).is_none());
    }
    let snapshot = cs[0].storage_snapshot_sync().unwrap();
    for c in cs.iter_mut() {
        assert_eq!(c.storage_lookup_sync(&keys_a, &snapshot).unwrap(), 4);
    }
    // Prefetched back into new host pages, byte for byte.
    for c in cs.iter_mut() {
        poison(c.host(), &cpu);
        assert_eq!(c.prefetch(&a, keys_a.clone()).unwrap(), 2);
    }
    for c in cs.iter_mut() {
        let ack = c.ack_storage_sync(1).unwrap();
        assert!(ack[0].complete, "{ack:?}");
        let rank = c.device().rank();
        let host_pages = c.host_pages(a.id).expect("on the host again").to_vec();
        for (i, p) in host_pages.iter().enumerate() {
            if placement.owner(*p) == rank {
                let got = read_page(c.host(), &cpu, placement.local(*p).0);
                assert!(got == data_a[i], "rank {rank} page {i}");
            }
        }
        // And on to the device as any host node.
        c.load(a.id, &a.device_pages, None, Method::CopyEngine)
            .unwrap();
        assert_eq!(c.ack_loads_sync(1).unwrap().len(), 1);
    }
    // A prefetch of keys nobody stored acks incomplete and leaves the node off the host.
    let (missing, _) = batch(6, 2, 1);
    let ghost = CacheNode {
        id: 9,
        device_pages: lp(&[10]),
        start_owner: None,
    };
    for c in cs.iter_mut() {
        c.prefetch(&ghost, missing.clone()).unwrap();
        let ack = c.ack_storage_sync(1).unwrap();
        let owns = placement.owner(LogicalPage(10)) == c.device().rank();
        assert_eq!(ack[0].complete, !owns, "{ack:?}");
        assert_eq!(c.host_pages(ghost.id).is_some(), !owns);
    }
}

/// GDS (NIXL's GDS backend on cuFile) says exactly what it lacks before anything moves: here,
/// usually libcufile or libcudart off the library path, or no GPU; a host buffer or a
/// descriptor size that does not divide the buffer is refused up front.
#[test]
fn gds_says_what_it_lacks_and_refuses_bad_arguments() {
    if !nixl_available("gds_says_what_it_lacks_and_refuses_bad_arguments") {
        return;
    }
    use kvshard::backend::MemoryKind;
    use kvshard::pool::disk::gds;
    match gds::probe() {
        Ok(()) => eprintln!("GDS: every prerequisite is here"),
        Err(Error::Storage {
            failure: StorageFailure::Register,
            reason,
            ..
        }) => {
            assert!(
                [
                    "libplugin_GDS",
                    "libcuda.so.1",
                    "libcufile.so.0",
                    "libcudart.so.13",
                    "cuFileDriverOpen"
                ]
                .iter()
                .any(|w| reason.contains(w)),
                "{reason}"
            );
            eprintln!("GDS unavailable here: {reason}");
        }
        Err(e) => panic!("GDS probe: {e}"),
    }
    let b = CpuBackend::new();
    let dir = scratch("gds");
    let host = b.alloc(1 << 20, MemoryKind::PinnedHost).unwrap();
    let device = b.alloc(1 << 20, MemoryKind::Device).unwrap();
    for (buffer, io) in [(&host, 1 << 16), (&device, 3 << 12), (&device, 0)] {
        let e = gds::ceiling_sync(&b, buffer, 0, &dir, io, 64, Duration::from_secs(5));
        assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    }
}
