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

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::{Backend, MemoryKind};
use kvshard::copy::{Direction, Layers, Method};
use kvshard::error::StorageFailure;
use kvshard::hicache::{HostFormat, HostLayout, HostPool, HostTransfer, TransferPlan};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::key::PageKey;
use kvshard::pool::disk::{
    Damaged, DiskConfig, DiskStore, IoQueue, LoadOutcome, QueueChoice, MAX_TIMEOUT, MAX_WRITERS,
};
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::Error;
use rand::{Rng, RngCore};

mod common;

use common::storage::*;

const CHILD: &str = "KVSHARD_STORAGE_CHILD";
const DIR: &str = "KVSHARD_STORAGE_DIR";

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
    match DiskStore::open(
        h.clone(),
        stream(&b),
        config(&dir.join("full"), 0, 1, slots),
    ) {
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
    let mut s1 =
        DiskStore::open(h1.clone(), stream(&b), config(&dir, 1, 2, COMPACT_SLOTS)).unwrap();
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

/// The stream orders the asynchronous-contract tests run the CPU twin in: deferred, and
/// adversarial with seeds that take both sides of the coin at the first host waits.
const ORDERS: [StreamOrder; 4] = [
    StreamOrder::Deferred,
    StreamOrder::Adversarial(0),
    StreamOrder::Adversarial(1),
    StreamOrder::Adversarial(7),
];

/// A fresh directory for each run of a test body (it runs once per stream order).
fn fresh(test: &str) -> PathBuf {
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    scratch(&format!("{test}-{n}"))
}

/// On the GPU, 8 GiB of fill queued on `stream` ahead of the transfer under test (milliseconds
/// of device time) keeps it queued while the host goes on; the CPU twin runs nothing until
/// something waits, so needs none.
fn ballast(device: &common::Device, stream: &dyn Backend) -> Option<kvshard::backend::Buffer> {
    let ballast = device
        .is_gpu()
        .then(|| stream.alloc(8 << 30, MemoryKind::Device).unwrap());
    if let Some(b) = &ballast {
        stream.fill(b, 1).unwrap();
    }
    ballast
}

/// A device pool of random bytes and a poisoned host pool of the tests' geometry on `b`.
fn pools(device: &common::Device, b: &dyn Backend) -> (Arc<DevicePool>, Arc<HostPool>) {
    let g = geometry();
    let pool = DevicePool::allocate(b, &g, Placement::unsharded(), 0, PAGES).unwrap();
    let storage = pool.storage().unwrap();
    let mut bytes = vec![0u8; storage.len()];
    device.rng().fill_bytes(&mut bytes);
    b.write_sync(storage, 0, &bytes).unwrap();
    (Arc::new(pool), host(b, HostLayout::PageFirst.into()))
}

/// A transfer between device pages `device` and host pages `host` of unsharded pools.
fn transfer(
    pool: &Arc<DevicePool>,
    h: &Arc<HostPool>,
    device: &[u64],
    host: &[u64],
    direction: Direction,
) -> HostTransfer {
    let lp = |v: &[u64]| v.iter().map(|&p| LogicalPage(p)).collect::<Vec<_>>();
    let plan = TransferPlan::new(
        Placement::unsharded(),
        0,
        &lp(device),
        &lp(host),
        PAGES,
        PAGES,
    )
    .unwrap();
    HostTransfer::new(pool.clone(), h.clone(), plan, direction).unwrap()
}

// Old behaviour: `store_sync` right after a backup queued on another stream read the host pages
// at once, persisting their old bytes with a valid checksum: a later load said Loaded and gave
// the stale bytes. The store waits for the queued writes of the pages it names.
common::on_cpu_and_gpu!(
    a_store_persists_what_a_backup_still_queued_writes,
    ORDERS,
    |device| {
        if !nixl_available("a_store_persists_what_a_backup_still_queued_writes") {
            return;
        }
        let (b, other) = (device.stream(), device.stream());
        let (pool, h) = pools(&device, b.as_ref());
        let dir = fresh("store_after_backup");
        let mut s = DiskStore::open(h.clone(), b.clone(), config(&dir, 0, 1, 16)).unwrap();
        let backup = transfer(&pool, &h, &[3, 4], &[1, 2], Direction::Backup);
        let _ballast = ballast(&device, other.as_ref());
        backup
            .run(other.as_ref(), Method::CopyEngine, Layers::All)
            .unwrap();
        let (keys, _) = batch(21, 0, 2);
        let r = s.store_sync(&items(&keys, 1)).unwrap();
        assert_eq!(r.written, 2, "{device}");
        other.synchronize().unwrap();
        let backed_up: Vec<Vec<u8>> = (1..=2).map(|p| read_page(&h, b.as_ref(), p)).collect();
        for page in &backed_up {
            assert!(
                page.iter().any(|&x| x != POISON),
                "{device}: the backup ran"
            );
        }
        let out = s.load_sync(&items(&keys, 5)).unwrap();
        assert_eq!(out, vec![LoadOutcome::Loaded; 2], "{device}");
        for (i, want) in backed_up.iter().enumerate() {
            assert!(
                read_page(&h, b.as_ref(), 5 + i as u64) == *want,
                "{device}: page {i} was stored before its backup wrote it"
            );
        }
    }
);

// Old behaviour: `load_sync` into host pages that a load to the device still queued reads
// wrote them at once: the queued load copied the storage's bytes instead of the host's. The
// store waits for the queued reads (and writes) of the pages it loads into.
common::on_cpu_and_gpu!(
    a_load_from_storage_leaves_what_a_queued_device_load_reads,
    ORDERS,
    |device| {
        if !nixl_available("a_load_from_storage_leaves_what_a_queued_device_load_reads") {
            return;
        }
        let (b, other) = (device.stream(), device.stream());
        let (pool, h) = pools(&device, b.as_ref());
        let dir = fresh("load_under_device_load");
        let mut s = DiskStore::open(h.clone(), b.clone(), config(&dir, 0, 1, 16)).unwrap();
        // Host page 1 holds A (what the device load must copy), storage holds B.
        let (keys, data) = batch(22, 0, 2);
        write_page(&h, b.as_ref(), 1, &data[0]);
        write_page(&h, b.as_ref(), 3, &data[1]);
        s.store_sync(&items(&keys[1..], 3)).unwrap();
        let load = transfer(&pool, &h, &[4], &[1], Direction::Load);
        let _ballast = ballast(&device, other.as_ref());
        load.run(other.as_ref(), Method::CopyEngine, Layers::All)
            .unwrap();
        let out = s.load_sync(&[(keys[1], LocalPage(1))]).unwrap();
        assert_eq!(out, vec![LoadOutcome::Loaded], "{device}");
        other.synchronize().unwrap();
        assert!(
            read_page(&h, b.as_ref(), 1) == data[1],
            "{device}: B loaded"
        );
        // What the device load copied, brought back to host page 7: A.
        let back = transfer(&pool, &h, &[4], &[7], Direction::Backup);
        back.run(b.as_ref(), Method::CopyEngine, Layers::All)
            .unwrap();
        b.synchronize().unwrap();
        assert!(
            read_page(&h, b.as_ref(), 7) == data[0],
            "{device}: the queued load copied the bytes loaded from storage after it"
        );
    }
);

// Old behaviour: a second open of the same directory and writer rank succeeded; both wrote
// slots and journal records independently, the first one's pages then loaded as Corrupt and a
// restart lost its commits.
#[test]
fn a_second_writer_of_a_rank_is_refused_naming_the_first() {
    if !nixl_available("a_second_writer_of_a_rank_is_refused_naming_the_first") {
        return;
    }
    let dir = scratch("two_writers");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let mut first = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 2, 8)).unwrap();
    let (keys, data) = batch(23, 0, 2);
    for (i, d) in data.iter().enumerate() {
        write_page(&h, &b, 1 + i as u64, d);
    }
    first.store_sync(&items(&keys, 1)).unwrap();
    match DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 2, 8)) {
        Err(Error::Storage {
            failure: StorageFailure::Locked { holder },
            reason,
            ..
        }) => {
            assert_eq!(holder, Some(std::process::id()), "{reason}");
            assert!(reason.contains("read-only"), "{reason}");
        }
        other => panic!("a second writer of rank 0: {other:?}"),
    }
    // Another rank, and a reader of rank 0, open alongside it.
    let mut other = DiskStore::open(h.clone(), stream(&b), config(&dir, 1, 2, 8)).unwrap();
    let mut ro = config(&dir, 0, 2, 8);
    ro.read_only = true;
    let mut reader = DiskStore::open(h.clone(), stream(&b), ro).unwrap();
    let snap = other.snapshot().unwrap();
    assert_eq!(reader.lookup(&keys, &snap).unwrap(), 2);
    // Closed, the rank is free again, its pages whole. (A child process another test forks
    // meanwhile holds a copy of the lock's descriptor until its exec closes it: a moment.)
    drop(first);
    let until = Instant::now() + Duration::from_secs(5);
    let mut again = loop {
        match DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 2, 8)) {
            Err(Error::Storage {
                failure: StorageFailure::Locked { .. },
                ..
            }) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
            other => break other.unwrap(),
        }
    };
    poison(&h, &b);
    assert_eq!(
        again.load_sync(&items(&keys, 1)).unwrap(),
        vec![LoadOutcome::Loaded; 2]
    );
    for (i, d) in data.iter().enumerate() {
        assert!(read_page(&h, &b, 1 + i as u64) == *d);
    }
}

// Old behaviour: a link planted at the slot file, the journal or the compaction file made the
// store grow and overwrite a file outside its directory with page data, or truncate it at the
// next compaction.
#[test]
fn links_planted_in_the_directory_are_refused_never_followed() {
    if !nixl_available("links_planted_in_the_directory_are_refused_never_followed") {
        return;
    }
    let base = scratch("links");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let victim = base.join("victim");
    let precious = b"a file outside the store's directory".to_vec();
    let untrusted = |r: Result<DiskStore, Error>, what: &str| match r {
        Err(Error::Storage {
            failure: StorageFailure::Untrusted,
            ..
        }) => {}
        other => panic!("{what}: {other:?}"),
    };
    for name in ["w0000.slots", "w0000.journal", "w0000.lock"] {
        std::fs::write(&victim, &precious).unwrap();
        let dir = base.join(name.replace('.', "-"));
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(name)).unwrap();
        untrusted(
            DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 4)),
            name,
        );
        assert_eq!(std::fs::read(&victim).unwrap(), precious, "{name}");
        // A hard link to it: refused too.
        std::fs::remove_file(dir.join(name)).unwrap();
        std::fs::hard_link(&victim, dir.join(name)).unwrap();
        untrusted(
            DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 4)),
            name,
        );
        assert_eq!(std::fs::read(&victim).unwrap(), precious, "{name}");
    }
    // The compaction file: a link there when the store opens is removed (the link, not its
    // target); one planted later is removed before the compaction creates its file.
    std::fs::write(&victim, &precious).unwrap();
    let dir = base.join("compact");
    std::fs::create_dir_all(&dir).unwrap();
    let compact = dir.join("w0000.journal.compact");
    std::os::unix::fs::symlink(&victim, &compact).unwrap();
    let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 4)).unwrap();
    assert!(
        compact.symlink_metadata().is_err(),
        "the stray link is gone"
    );
    let (keys, _) = batch(24, 0, 2);
    s.store_sync(&items(&keys, 1)).unwrap();
    std::os::unix::fs::symlink(&victim, &compact).unwrap();
    s.compact_journal_sync().unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), precious);
    assert!(!dir
        .join("w0000.journal")
        .symlink_metadata()
        .unwrap()
        .is_symlink());
    // Another rank's journal as a link: a reader refuses it.
    drop(s);
    let peer = dir.join("w0001.journal");
    std::os::unix::fs::symlink(&victim, &peer).unwrap();
    let mut ro = config(&dir, 1, 2, 4);
    ro.read_only = true;
    untrusted(
        DiskStore::open(h.clone(), stream(&b), ro),
        "a peer's journal",
    );
    std::fs::remove_file(&peer).unwrap();
    // The directory itself as a link.
    let real = base.join("real");
    std::fs::create_dir_all(&real).unwrap();
    let alias = base.join("alias");
    std::os::unix::fs::symlink(&real, &alias).unwrap();
    untrusted(
        DiskStore::open(h.clone(), stream(&b), config(&alias, 0, 1, 4)),
        "the directory",
    );
    assert_eq!(std::fs::read_dir(&real).unwrap().count(), 0);
}

// Someone else could change them: the store refuses a directory or file writable by group or
// others, or owned by another user.
#[test]
fn a_directory_or_file_another_user_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    if !nixl_available("a_directory_or_file_another_user_can_write_is_refused") {
        return;
    }
    let base = scratch("untrusted");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let refused =
        |dir: &Path, what: &str| match DiskStore::open(h.clone(), stream(&b), config(dir, 0, 1, 4))
        {
            Err(Error::Storage {
                failure: StorageFailure::Untrusted,
                reason,
                ..
            }) => eprintln!("{what}: {reason}"),
            other => panic!("{what}: {other:?}"),
        };
    let dir = base.join("group-writable");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
    refused(&dir, "a group-writable directory");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    drop(DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 4)).unwrap());
    let journal = dir.join("w0000.journal");
    std::fs::set_permissions(&journal, std::fs::Permissions::from_mode(0o666)).unwrap();
    refused(&dir, "an other-writable journal");
    std::fs::set_permissions(&journal, std::fs::Permissions::from_mode(0o600)).unwrap();
    // Another owner (only root can hand a file over).
    if rustix::process::geteuid().is_root() {
        let nobody = Some(rustix::process::Uid::from_raw(65534));
        rustix::fs::chown(&journal, nobody, None).unwrap();
        refused(&dir, "another user's journal");
        rustix::fs::chown(&journal, Some(rustix::process::geteuid()), None).unwrap();
    }
    drop(DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 4)).unwrap());
    // A new directory is made private.
    let made = base.join("made").join("here");
    drop(DiskStore::open(h.clone(), stream(&b), config(&made, 0, 1, 4)).unwrap());
    let mode = std::fs::metadata(&made).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "{mode:o}");
}

/// Journal record place `place` of `dir`'s writer `writer`: its byte offset.
fn record_at(place: usize) -> usize {
    JOURNAL_HEADER + place * JOURNAL_RECORD
}

// Old behaviour: one record failing its checksum in the middle of a journal was taken for a
// torn tail: the next open cut the journal there, deleting every later commit, with no error
// and no counter; and a damaged Free record brought an evicted key back as present.
#[test]
fn a_damaged_journal_record_loses_nothing_after_it_and_is_counted() {
    if !nixl_available("a_damaged_journal_record_loses_nothing_after_it_and_is_counted") {
        return;
    }
    let dir = scratch("damaged_journal");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::PageFirstDirect.into());
    // 4 slots: batch 0 fills them (records 0..4), batch 1 evicts them (Frees 4..8, then
    // Commits 8..12).
    let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 4)).unwrap();
    let (old, _) = batch(25, 0, 4);
    let (new, data) = batch(25, 1, 4);
    for (i, d) in data.iter().enumerate() {
        write_page(&h, &b, 1 + i as u64, d);
    }
    s.store_sync(&items(&old, 1)).unwrap();
    s.store_sync(&items(&new, 1)).unwrap();
    drop(s);
    let journal = dir.join("w0000.journal");
    let len = std::fs::metadata(&journal).unwrap().len();
    // Damage the Free of old[1] (record 5) and the commit of new[0] (record 8).
    flip(&journal, record_at(5) + 20);
    flip(&journal, record_at(8) + 40);
    let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 4)).unwrap();
    assert_eq!(s.stats().damaged_records, 2);
    assert_eq!(
        std::fs::metadata(&journal).unwrap().len(),
        len,
        "nothing cut"
    );
    let snap = s.snapshot().unwrap();
    assert_eq!(snap.records(), &[12]);
    // Every later commit kept; the damaged one's page a miss; the key whose Free was lost is
    // not back.
    assert_eq!(
        s.exists(&new, &snap).unwrap(),
        vec![false, true, true, true]
    );
    assert_eq!(s.exists(&old, &snap).unwrap(), vec![false; 4]);
    poison(&h, &b);
    let out = s.load_sync(&items(&new, 1)).unwrap();
    assert_eq!(out[0], LoadOutcome::Missing);
    for i in 1..4 {
        assert_eq!(out[i], LoadOutcome::Loaded);
        assert!(read_page(&h, &b, 1 + i as u64) == data[i], "page {i}");
    }
    assert_eq!(
        s.load_sync(&items(&old, 1)).unwrap(),
        vec![LoadOutcome::Missing; 4]
    );
    // A reader counts the same damage and agrees.
    let mut ro = config(&dir, 0, 1, 4);
    ro.read_only = true;
    let mut r = DiskStore::open(h.clone(), stream(&b), ro.clone()).unwrap();
    assert_eq!(r.stats().damaged_records, 2);
    assert_eq!(
        r.exists(&new, &snap).unwrap(),
        vec![false, true, true, true]
    );
    // Refused when asked to, with nothing changed.
    drop(s);
    for mut c in [config(&dir, 0, 1, 4), ro] {
        c.damaged = Damaged::Refuse;
        match DiskStore::open(h.clone(), stream(&b), c) {
            Err(Error::Storage {
                failure: StorageFailure::Corrupt,
                reason,
                ..
            }) => assert!(reason.contains("record 5"), "{reason}"),
            other => panic!("a damaged journal under Refuse: {other:?}"),
        }
    }
    assert_eq!(std::fs::metadata(&journal).unwrap().len(), len);
}

// Old behaviour: records of another rank's journal were not range-checked: a commit naming a
// slot past that rank's file failed the whole load batch it was in.
#[test]
fn a_peer_record_past_its_file_is_skipped_and_counted_not_fatal() {
    if !nixl_available("a_peer_record_past_its_file_is_skipped_and_counted_not_fatal") {
        return;
    }
    let dir = scratch("peer_range");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let mut s0 = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 2, 8)).unwrap();
    let mut s1 = DiskStore::open(h.clone(), stream(&b), config(&dir, 1, 2, 8)).unwrap();
    let (keys, data) = batch(26, 0, 3);
    for (i, d) in data.iter().enumerate() {
        write_page(&h, &b, 1 + i as u64, d);
    }
    s1.store_sync(&items(&keys[..2], 1)).unwrap();
    // Rank 1's journal gains a well-formed commit of slot 8 of 8, then a valid record.
    let journal = dir.join("w0001.journal");
    let mut bytes = std::fs::read(&journal).unwrap();
    bytes.extend_from_slice(&journal_record(1, 8, &keys[2], 7));
    bytes.extend_from_slice(&journal_record(3, 1, &keys[2], 0));
    std::fs::write(&journal, &bytes).unwrap();
    let snap = s0.snapshot().unwrap();
    assert_eq!(snap.records(), &[0, 4]);
    assert_eq!(s0.stats().damaged_records, 1);
    assert_eq!(s0.exists(&keys, &snap).unwrap(), vec![true, true, false]);
    poison(&h, &b);
    let out = s0.load_sync(&items(&keys, 1)).unwrap();
    assert_eq!(
        out,
        vec![
            LoadOutcome::Loaded,
            LoadOutcome::Loaded,
            LoadOutcome::Missing
        ]
    );
    assert!(read_page(&h, &b, 1) == data[0] && read_page(&h, &b, 2) == data[1]);
}

/// Bytes this process has read through `read` and its kind (Linux's `rchar`).
fn bytes_read() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("rchar:").map(|v| v.trim().parse().ok()))
        })
        .flatten()
        .unwrap_or(0)
}

// Old behaviour: another rank's journal that did not end in a whole, valid record was read
// whole at every snapshot (a 512 MiB file: 524 MB more memory and 3.1 s per snapshot).
#[test]
fn snapshots_read_only_what_a_peer_appended() {
    if !nixl_available("snapshots_read_only_what_a_peer_appended") {
        return;
    }
    let dir = scratch("peer_incremental");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let mut s0 = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 2, 8)).unwrap();
    let mut s1 = DiskStore::open(h.clone(), stream(&b), config(&dir, 1, 2, 8)).unwrap();
    let (keys, _) = batch(27, 0, 2);
    s1.store_sync(&items(&keys[..1], 1)).unwrap();
    drop(s1);
    // 64 MiB of garbage after its last record (a writer killed mid-append, and more).
    let journal = dir.join("w0001.journal");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&journal)
        .unwrap();
    std::io::Write::write_all(&mut f, &vec![0x3C; 64 << 20]).unwrap();
    drop(f);
    assert_eq!(s0.snapshot().unwrap().records(), &[0, 1]);
    let before = bytes_read();
    for _ in 0..4 {
        assert_eq!(s0.snapshot().unwrap().records(), &[0, 1]);
    }
    let read = bytes_read() - before;
    assert!(
        read < 1 << 20,
        "4 snapshots read {read} B of an unchanged journal"
    );
    // The writer back: its open cuts the tail, its next commit is seen.
    let mut s1 = DiskStore::open(h.clone(), stream(&b), config(&dir, 1, 2, 8)).unwrap();
    assert_eq!(s1.stats().torn_records, (64u64 << 20).div_ceil(96));
    s1.store_sync(&items(&keys[1..], 2)).unwrap();
    let snap = s0.snapshot().unwrap();
    assert_eq!(snap.records(), &[0, 2]);
    assert_eq!(s0.lookup(&keys, &snap).unwrap(), 2);
    assert_eq!(s0.stats().damaged_records, 0);
}

// Old behaviour: `writers = u32::MAX` aborted the process (an allocation per writer), a
// timeout of `Duration::MAX` panicked at the first deadline, and another geometry's reopen grew
// the slot file before refusing.
#[test]
fn settings_out_of_bounds_are_refused_before_anything_is_touched() {
    if !nixl_available("settings_out_of_bounds_are_refused_before_anything_is_touched") {
        return;
    }
    let base = scratch("bounds");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let dir = base.join("s");
    let cases: Vec<(&str, DiskConfig)> = vec![
        ("writers u32::MAX", config(&dir, 0, u32::MAX, 4)),
        (
            "writers past the bound",
            config(&dir, 0, MAX_WRITERS + 1, 4),
        ),
        ("writer past writers", config(&dir, 2, 2, 4)),
        ("no slot", config(&dir, 0, 1, 0)),
        ("timeout Duration::MAX", {
            let mut c = config(&dir, 0, 1, 4);
            c.timeout = Duration::MAX;
            c
        }),
        ("timeout past the bound", {
            let mut c = config(&dir, 0, 1, 4);
            c.timeout = MAX_TIMEOUT + Duration::from_secs(1);
            c
        }),
        ("timeout zero", {
            let mut c = config(&dir, 0, 1, 4);
            c.timeout = Duration::ZERO;
            c
        }),
        ("staging usize::MAX", {
            let mut c = config(&dir, 0, 1, 4);
            c.staging_slots = usize::MAX;
            c
        }),
        ("staging past 1 GiB", {
            let mut c = config(&dir, 0, 1, 4);
            c.staging_slots = 1 << 20;
            c
        }),
        ("slots u64::MAX", config(&dir, 0, 1, u64::MAX)),
    ];
    for (what, c) in cases {
        match DiskStore::open(h.clone(), stream(&b), c) {
            Err(Error::InvalidArgument(_) | Error::Overflow { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    // Nothing was made but, for the sizes the slot size decides, the empty slot file.
    let slots = dir.join("w0000.slots");
    assert!(std::fs::metadata(&slots).map_or(true, |m| m.len() == 0));
    assert!(!dir.join("w0000.journal").exists());
    // Another slot count than the journal's: refused before the slot file grows.
    let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 4)).unwrap();
    let len = 4 * s.slot_bytes();
    s.store_sync(&[]).unwrap();
    drop(s);
    match DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 64)) {
        Err(Error::Storage {
            failure: StorageFailure::Format,
            ..
        }) => {}
        other => panic!("another slot count: {other:?}"),
    }
    assert_eq!(std::fs::metadata(&slots).unwrap().len(), len, "grown");
}

// Old behaviour: prefetching one node twice before its ack took a second set of host pages for
// it, and the first set was never given back; a storage timeout of `Duration::MAX` was taken
// (every wait on the worker then unbounded).
#[test]
fn a_node_prefetched_twice_before_its_ack_takes_its_host_pages_once() {
    use kvshard::hicache::{CacheNode, HiCacheController, StoragePolicy, Streams, WritePolicy};
    if !nixl_available("a_node_prefetched_twice_before_its_ack_takes_its_host_pages_once") {
        return;
    }
    let dir = scratch("prefetch_twice");
    let cpu = CpuBackend::new();
    let g = geometry();
    let pool = Arc::new(DevicePool::allocate(&cpu, &g, Placement::unsharded(), 0, 16).unwrap());
    let h = host(&cpu, HostLayout::PageFirstDirect.into());
    let streams = Streams::each(|| Ok(stream(&cpu))).unwrap();
    let mut c =
        HiCacheController::new(pool, h.clone(), streams, WritePolicy::WriteThrough).unwrap();
    let timeout = Duration::from_secs(20);
    for bad in [Duration::MAX, Duration::ZERO, MAX_TIMEOUT * 2] {
        let store = DiskStore::open(h.clone(), stream(&cpu), config(&dir, 0, 1, 16)).unwrap();
        assert!(matches!(
            c.attach_storage(store, StoragePolicy::WriteThrough, bad),
            Err(Error::InvalidArgument(_))
        ));
    }
    let store = DiskStore::open(h.clone(), stream(&cpu), config(&dir, 0, 1, 16)).unwrap();
    c.attach_storage(store, StoragePolicy::WriteThrough, timeout)
        .unwrap();
    let node = CacheNode {
        id: 3,
        device_pages: [2, 3, 4].map(LogicalPage).to_vec(),
        start_owner: None,
    };
    let (keys, _) = batch(28, 0, 3);
    let free = c.host_allocator().free_pages(0);
    c.prefetch(&node, keys.clone()).unwrap();
    assert!(matches!(
        c.prefetch(&node, keys.clone()),
        Err(Error::HiCache(_))
    ));
    assert_eq!(c.host_allocator().free_pages(0), free - 3);
    // Nothing stored: the prefetch misses and gives its pages back, all of them.
    let acks = c.ack_storage_sync(1).unwrap();
    assert!(!acks[0].complete);
    assert_eq!(c.host_allocator().free_pages(0), free);
    assert!(c.host_pages(node.id).is_none());
}
