//! The storage tier's cases of the fault-injection suite (feature `nixl`, NIXL's POSIX backend,
//! stores under the build tree): slow storage past every deadline, a disk that fills mid-store,
//! writers killed mid-store and mid-compaction, flipped bytes in slots and journals (middle and
//! tail), two writers of one rank, and links planted at every file the store opens and at the
//! directory itself. Each case checks that nothing hangs past its deadline, no wrong byte is
//! served as a hit (every page loads byte for byte, or is reported: a miss, a counted corrupt
//! page or damaged record, a typed error), no slot leaks, and prints its tally
//! (`fault-injection: CASE: ...`; run with `--nocapture` to see the lines).
//!
//! Processes that must die or hold a lock are this binary run again (`--exact child_entry`,
//! with `KVSHARD_FAULT_CHILD` naming the role).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::Backend;
use kvshard::error::StorageFailure;
use kvshard::hicache::{HostLayout, HostPool};
use kvshard::index::LocalPage;
use kvshard::key::PageKey;
use kvshard::pool::disk::{DiskStore, LoadOutcome};
use kvshard::Error;
use rand::Rng;

mod common;

use common::faults::Tally;
use common::storage::*;

const CHILD: &str = "KVSHARD_FAULT_CHILD";
const DIR: &str = "KVSHARD_FAULT_DIR";
/// How long a case waits for a child process to reach a point, or to exit.
const CHILD_DEADLINE: Duration = Duration::from_secs(60);
/// Pages per batch the cases store.
const BATCH: usize = 6;

/// Starts this binary again as child `role` on `dir`, through a shell that ignores SIGXFSZ
/// (the signal a write past the file size limit raises; ignored, the write fails with EFBIG
/// instead of killing the process, and the disposition survives the exec).
fn child(role: &str, dir: &Path) -> Child {
    Command::new("sh")
        .args(["-c", "trap '' XFSZ; exec \"$0\" \"$@\""])
        .arg(std::env::current_exe().expect("test binary path"))
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, role)
        .env(DIR, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn a child")
}

/// Waits (at most [`CHILD_DEADLINE`]) for `path` to exist while `child` runs.
fn await_marker(child: &mut Child, path: &Path) {
    let deadline = Instant::now() + CHILD_DEADLINE;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "the child never reached {path:?}"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the child exited early"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits (at most [`CHILD_DEADLINE`]) for `child` to exit; its stdout and whether it succeeded.
fn finish(mut child: Child) -> (String, bool) {
    let deadline = Instant::now() + CHILD_DEADLINE;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut out = String::new();
            if let Some(mut o) = child.stdout.take() {
                let _ = std::io::Read::read_to_string(&mut o, &mut out);
            }
            return (out, status.success());
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return ("the child hung past its deadline".into(), false);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Batch `n` of seed `seed` on host pages `1..=BATCH`: written into the host pool, and its
/// (key, page) items and bytes.
fn stage(
    h: &HostPool,
    b: &dyn Backend,
    seed: u64,
    n: u64,
) -> (Vec<(PageKey, LocalPage)>, Vec<Vec<u8>>) {
    let (keys, data) = batch(seed, n, BATCH);
    for (i, d) in data.iter().enumerate() {
        write_page(h, b, 1 + i as u64, d);
    }
    (items(&keys, 1), data)
}

/// What a load of `keys` (whose bytes are `data`) into a poisoned `h` served: (pages loaded
/// byte for byte, pages reported as missing or corrupt, bytes served wrong as a hit).
fn served(
    s: &mut DiskStore,
    h: &HostPool,
    b: &dyn Backend,
    keys: &[PageKey],
    data: &[Vec<u8>],
) -> (usize, usize, u64) {
    poison(h, b);
    let out = s.load_sync(&items(keys, 1)).expect("a load");
    let (mut good, mut reported, mut wrong) = (0, 0, 0u64);
    for (i, o) in out.iter().enumerate() {
        match o {
            LoadOutcome::Loaded => {
                let got = read_page(h, b, 1 + i as u64);
                let bad = got.iter().zip(&data[i]).filter(|(a, b)| a != b).count();
                if bad == 0 {
                    good += 1;
                } else {
                    wrong += bad as u64;
                }
            }
            LoadOutcome::Missing | LoadOutcome::Corrupt => {
                // A page reported is left as it was.
                assert!(read_page(h, b, 1 + i as u64).iter().all(|&x| x == POISON));
                reported += 1;
            }
        }
    }
    (good, reported, wrong)
}

/// The keys of batch `n` of seed `seed`.
fn keys(seed: u64, n: u64) -> (Vec<PageKey>, Vec<Vec<u8>>) {
    batch(seed, n, BATCH)
}

#[test]
fn fault_slow_storage() {
    if !nixl_available("fault_slow_storage") {
        return;
    }
    let mut tally = Tally::default();
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::PageFirstDirect.into());
    let dir = scratch("fault_slow");
    let (committed, data) = {
        let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 64)).unwrap();
        let (first, data) = stage(&h, &b, 40, 0);
        s.store_sync(&first).unwrap();
        (first.iter().map(|i| i.0).collect::<Vec<_>>(), data)
    };
    // Storage slower than the deadline: I/O takes longer than a deadline of 1 us to 100 us
    // (where it does not, no fault was injected and the batch must simply be there). The call
    // returns within its deadline (plus what one poll takes), with a typed timeout; the store
    // then refuses further I/O (NIXL may still move bytes), and a reopened store has every
    // committed page and none of the timed-out batch.
    for (n, timeout) in [1u64, 10, 100].into_iter().enumerate() {
        let timeout = Duration::from_micros(timeout);
        let mut c = config(&dir, 0, 1, 64);
        c.timeout = timeout;
        let mut s = DiskStore::open(h.clone(), stream(&b), c).unwrap();
        let (late, _) = stage(&h, &b, 40, 1 + n as u64);
        let started = Instant::now();
        let r = s.store_sync(&late);
        let took = started.elapsed();
        let timed_out = matches!(r, Err(Error::Timeout { .. }));
        let refused_after = timed_out && s.load_sync(&items(&committed, 1)).is_err();
        drop(s);
        let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 64)).unwrap();
        let (good, _, wrong) = served(&mut s, &h, &b, &committed, &data);
        let snap = s.snapshot().unwrap();
        let late = late.iter().map(|i| i.0).collect::<Vec<_>>();
        let present = s.exists(&late, &snap).unwrap();
        tally.served_wrong += wrong;
        eprintln!("slow storage, deadline {timeout:?}: {r:?} after {took:?}");
        if r.is_ok() {
            // The disk beat the deadline (no fault): the batch is simply there.
            assert!(present.iter().all(|&p| p) && good == BATCH);
            continue;
        }
        tally.fault(
            timed_out
                && refused_after
                && took < timeout + Duration::from_secs(2)
                && good == BATCH
                && present.iter().all(|&p| !p),
        );
    }
    // A storage worker slower than the controller's deadline (1 us, where a prefetch of 12
    // stored pages reads megabytes): the ack times out when its deadline passes, the
    // operation stays pending, and is acked once done.
    {
        use kvshard::hicache::{CacheNode, HiCacheController, StoragePolicy, Streams, WritePolicy};
        use kvshard::index::LogicalPage;
        use kvshard::pool::DevicePool;
        use kvshard::shard::Placement;
        let g = geometry();
        let pool = Arc::new(DevicePool::allocate(&b, &g, Placement::unsharded(), 0, 16).unwrap());
        let h2 = host(&b, HostLayout::PageFirstDirect.into());
        let dir2 = scratch("fault_slow_worker");
        let (stored, _) = batch(41, 0, 12);
        {
            let mut s = DiskStore::open(h2.clone(), stream(&b), config(&dir2, 0, 1, 64)).unwrap();
            s.store_sync(&items(&stored, 1)).unwrap();
        }
        let streams = Streams::each(|| Ok(stream(&b))).unwrap();
        let mut c =
            HiCacheController::new(pool, h2.clone(), streams, WritePolicy::WriteThrough).unwrap();
        let store = DiskStore::open(h2.clone(), stream(&b), config(&dir2, 0, 1, 64)).unwrap();
        let deadline = Duration::from_micros(1);
        c.attach_storage(store, StoragePolicy::WriteThrough, deadline)
            .unwrap();
        let node = CacheNode {
            id: 1,
            device_pages: (1..=12).map(LogicalPage).collect(),
            start_owner: None,
        };
        let free = c.host_allocator().free_pages(0);
        c.prefetch(&node, stored).unwrap();
        let started = Instant::now();
        let first = c.ack_storage_sync(1);
        let took = started.elapsed();
        let timed_out = matches!(first, Err(Error::Timeout { .. }));
        // The worker beat the deadline only if this thread was paused meanwhile (no fault):
        // then the first ack is the operation's.
        let acked = match &first {
            Ok(a) => Ok(a.len() == 1 && a[0].complete),
            Err(_) => {
                let until = Instant::now() + CHILD_DEADLINE;
                while c.poll_storage().unwrap() < 1 && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
                c.ack_storage_sync(1).map(|a| a.len() == 1 && a[0].complete)
            }
        };
        let on_host = c.host_pages(node.id).is_some_and(|p| p.len() == 12);
        let taken = free - c.host_allocator().free_pages(0);
        eprintln!("slow worker: {first:?} after {took:?}, then {acked:?}");
        let whole = acked.unwrap_or(false) && on_host && taken == 12;
        if first.is_ok() {
            assert!(
                whole,
                "the worker's operation, acked in time, is incomplete"
            );
        } else {
            tally.fault(timed_out && took < Duration::from_secs(2) && whole);
        }
    }
    tally.report("storage slow I/O past every deadline");
}

#[test]
fn fault_disk_full_mid_store() {
    if !nixl_available("fault_disk_full_mid_store") {
        return;
    }
    let dir = scratch("fault_full");
    let (out, ok) = finish(child("full", &dir));
    eprint!("{out}");
    let mut tally = Tally::default();
    // (The harness may print its own "test child_entry ... " in front of the first line.)
    for line in out
        .lines()
        .filter_map(|l| l.split_once("full: ").map(|(_, r)| r))
    {
        // "survived WRONG": one fault each.
        let mut it = line.split_whitespace();
        let survived = it.next() == Some("true");
        let wrong: u64 = it.next().and_then(|w| w.parse().ok()).unwrap_or(1);
        tally.served_wrong += wrong;
        tally.fault(ok && survived);
    }
    tally.report("storage disk full mid-store");
}

/// The disk-full child: a file size limit (RLIMIT_FSIZE, with SIGXFSZ ignored by the shell
/// that started it) below the slots a batch writes makes its data writes fail mid-store.
fn full_child(dir: &Path) {
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::PageFirstDirect.into());
    let mut s = DiskStore::open(h.clone(), stream(&b), config(dir, 0, 1, 64)).unwrap();
    let (first, first_data) = stage(&h, &b, 42, 0);
    s.store_sync(&first).unwrap();
    let slot = s.slot_bytes();
    let first_keys: Vec<PageKey> = first.iter().map(|i| i.0).collect();
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let was = getrlimit(Resource::Fsize);
    for (n, room) in [0u64, 2, 5].into_iter().enumerate() {
        // The next batch takes the slots after the committed ones: room for `room` of them.
        let used = s.used_slots();
        let limit = (used + room) * slot;
        let (next, _) = stage(&h, &b, 42, 1 + n as u64);
        setrlimit(
            Resource::Fsize,
            Rlimit {
                current: Some(limit),
                maximum: was.maximum,
            },
        )
        .unwrap();
        let r = s.store_sync(&next);
        setrlimit(Resource::Fsize, was).unwrap();
        let typed = matches!(r, Err(Error::Storage { .. } | Error::Nixl { .. }));
        let leaked = s.used_slots() != used;
        let (good, _, wrong) = served(&mut s, &h, &b, &first_keys, &first_data);
        let snap = s.snapshot().unwrap();
        let next_keys: Vec<PageKey> = next.iter().map(|i| i.0).collect();
        let absent = s.exists(&next_keys, &snap).unwrap().iter().all(|p| !p);
        // With room again, the same batch goes in whole.
        let (next, next_data) = stage(&h, &b, 42, 1 + n as u64);
        let again = s.store_sync(&next).map(|r| r.written);
        let (good_next, _, wrong_next) = served(&mut s, &h, &b, &next_keys, &next_data);
        eprintln!("disk full with room for {room} slots: {r:?}, then {again:?}");
        let survived = typed
            && !leaked
            && good == BATCH
            && absent
            && again.ok() == Some(BATCH)
            && good_next == BATCH;
        println!("full: {survived} {}", wrong + wrong_next);
    }
    drop(s);
    // Reopened: everything stored is there.
    let mut s = DiskStore::open(h.clone(), stream(&b), config(dir, 0, 1, 64)).unwrap();
    let (good, _, wrong) = served(&mut s, &h, &b, &first_keys, &first_data);
    println!("full: {} {wrong}", good == BATCH);
    // A full file: the next batch reclaims every slot, and no byte may be written (the limit
    // at 0), so even its Free records fail. Its slots are not lost: they keep their pages.
    let full = dir.join("full-file");
    let mut s = DiskStore::open(h.clone(), stream(&b), config(&full, 0, 1, BATCH as u64)).unwrap();
    let (old, old_data) = stage(&h, &b, 42, 10);
    s.store_sync(&old).unwrap();
    let old_keys: Vec<PageKey> = old.iter().map(|i| i.0).collect();
    let (new, new_data) = stage(&h, &b, 42, 11);
    let new_keys: Vec<PageKey> = new.iter().map(|i| i.0).collect();
    setrlimit(
        Resource::Fsize,
        Rlimit {
            current: Some(0),
            maximum: was.maximum,
        },
    )
    .unwrap();
    let r = s.store_sync(&new);
    setrlimit(Resource::Fsize, was).unwrap();
    let typed = matches!(
        r,
        Err(Error::Storage {
            failure: StorageFailure::Full,
            ..
        })
    );
    let kept = s.used_slots() == BATCH as u64;
    let (good, _, wrong) = served(&mut s, &h, &b, &old_keys, &old_data);
    let (new, _) = stage(&h, &b, 42, 11);
    let again = s.store_sync(&new).map(|r| (r.written, r.evicted));
    let (good_new, _, wrong_new) = served(&mut s, &h, &b, &new_keys, &new_data);
    eprintln!("a full file, no byte writable: {r:?}, then {again:?}");
    println!(
        "full: {} {}",
        typed && kept && good == BATCH && again.ok() == Some((BATCH, BATCH)) && good_new == BATCH,
        wrong + wrong_new
    );
}

#[test]
fn fault_torn_writes() {
    if !nixl_available("fault_torn_writes") {
        return;
    }
    let mut tally = Tally::default();
    for (role, kills) in [("writer", 3), ("compactor", 3)] {
        for k in 0..kills {
            let dir = scratch(&format!("fault_torn_{role}_{k}"));
            let mut c = child(role, &dir);
            await_marker(&mut c, &dir.join("committed"));
            std::thread::sleep(Duration::from_millis(rand::rng().random_range(0..25u64)));
            c.kill().expect("kill");
            c.wait().expect("reap");
            let b = CpuBackend::new();
            let h = host(&b, HostLayout::PageFirst.into());
            let started = Instant::now();
            let opened = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, TORN_SLOTS));
            let Ok(mut s) = opened else {
                eprintln!("torn {role}: reopen failed: {opened:?}");
                tally.fault(false);
                continue;
            };
            let no_stray = !dir.join("w0000.journal.compact").exists();
            let snap = s.snapshot().unwrap();
            let mut intact = true;
            // Batch after batch until one with no page (the writer never got to it).
            for n in 0..TORN_BATCHES {
                let (keys, data) = keys(43, n);
                let present = s.exists(&keys, &snap).unwrap();
                if n < 2 && !present.iter().all(|&p| p) {
                    intact = false;
                }
                let (good, reported, wrong) = served(&mut s, &h, &b, &keys, &data);
                tally.served_wrong += wrong;
                // Present pages load whole; absent ones are misses, never torn hits.
                let hits = present.iter().filter(|&&p| p).count();
                intact &= good == hits && reported == BATCH - hits;
                if hits == 0 {
                    break;
                }
            }
            intact &= s.stats().corrupt_pages == 0 && no_stray;
            eprintln!(
                "torn {role} {k}: reopened in {:?}, {} torn records cut",
                started.elapsed(),
                s.stats().torn_records
            );
            tally.fault(intact);
        }
    }
    tally.report("storage torn writes (writers killed mid-store and mid-compaction)");
}

/// Slots of the torn-write children (never reclaimed by their batches until the compactor's).
const TORN_SLOTS: u64 = 512;
const TORN_BATCHES: u64 = 60;

/// The torn-write child: stores batches (committing two, then saying so) until killed; the
/// compactor also compacts its journal after every batch.
fn torn_child(dir: &Path, compact: bool) {
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let mut s = DiskStore::open(h.clone(), stream(&b), config(dir, 0, 1, TORN_SLOTS)).unwrap();
    for n in 0..TORN_BATCHES {
        let (items, _) = stage(&h, &b, 43, n);
        s.store_sync(&items).unwrap();
        if compact {
            s.compact_journal_sync().unwrap();
        }
        if n == 1 {
            std::fs::write(dir.join("committed"), b"").unwrap();
        }
    }
    // Every batch stored: wait to be killed.
    std::thread::sleep(CHILD_DEADLINE);
}

#[test]
fn fault_flipped_bytes() {
    if !nixl_available("fault_flipped_bytes") {
        return;
    }
    let mut tally = Tally::default();
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::PageFirstDirect.into());
    // (what, where) flips: a slot's middle and its last page byte; a journal record in the
    // middle (damage) and the last one (a tail: cut at open); the journal's header.
    for case in [
        "slot middle",
        "slot tail",
        "journal middle",
        "journal tail",
        "journal header",
    ] {
        let dir = scratch(&format!("fault_flip_{}", case.replace(' ', "_")));
        let mut s = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 16)).unwrap();
        let (items, data) = stage(&h, &b, 44, 0);
        s.store_sync(&items).unwrap();
        let keys: Vec<PageKey> = items.iter().map(|i| i.0).collect();
        let (slot, page) = (s.slot_bytes() as usize, s.page_bytes() as usize);
        let slots = dir.join("w0000.slots");
        let journal = dir.join("w0000.journal");
        // A fresh store takes slots lowest first: page i in slot i, its commit record i.
        match case {
            "slot middle" => flip(&slots, 2 * slot + page / 2),
            "slot tail" => flip(&slots, 3 * slot + page - 1),
            "journal middle" => flip(&journal, JOURNAL_HEADER + 2 * JOURNAL_RECORD + 50),
            "journal tail" => flip(&journal, JOURNAL_HEADER + (BATCH - 1) * JOURNAL_RECORD + 10),
            _ => flip(&journal, 20),
        }
        drop(s);
        let survived = match DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 16)) {
            // The header damaged: the store refuses the file, typed; nothing served.
            Err(Error::Storage {
                failure: StorageFailure::Format,
                ..
            }) => case == "journal header",
            Err(e) => {
                eprintln!("{case}: {e}");
                false
            }
            Ok(mut s) => {
                let (good, reported, wrong) = served(&mut s, &h, &b, &keys, &data);
                tally.served_wrong += wrong;
                let st = s.stats();
                // Every lost page is reported: a corrupt slot counted, a damaged record
                // counted, a tail record cut and counted.
                let counted = st.corrupt_pages + st.damaged_records + st.torn_records;
                eprintln!("{case}: {good} pages whole, {reported} reported, {st:?}");
                good + reported == BATCH && reported == 1 && counted == 1
            }
        };
        tally.fault(survived);
    }
    tally.report("storage flipped bytes in slots and journals");
}

#[test]
fn fault_two_writers() {
    if !nixl_available("fault_two_writers") {
        return;
    }
    let mut tally = Tally::default();
    let dir = scratch("fault_two_writers");
    let mut holder = child("holder", &dir);
    await_marker(&mut holder, &dir.join("committed"));
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::PageFirstDirect.into());
    // Another process writes rank 0: refused, naming it; a reader opens alongside.
    let pid = holder.id();
    let refused = matches!(
        DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 32)),
        Err(Error::Storage { failure: StorageFailure::Locked { holder: Some(p) }, .. }) if p == pid
    );
    let mut ro = config(&dir, 0, 1, 32);
    ro.read_only = true;
    let (keys, data) = keys(45, 0);
    let read_alongside = DiskStore::open(h.clone(), stream(&b), ro)
        .map(|mut r| served(&mut r, &h, &b, &keys, &data))
        .map(|(good, _, wrong)| {
            tally.served_wrong += wrong;
            good == BATCH
        })
        .unwrap_or(false);
    tally.fault(refused && read_alongside);
    // The holder dies: its lock goes with it, its pages stay.
    holder.kill().expect("kill");
    holder.wait().expect("reap");
    let taken = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 32))
        .map(|mut s| served(&mut s, &h, &b, &keys, &data))
        .map(|(good, _, wrong)| {
            tally.served_wrong += wrong;
            good == BATCH
        })
        .unwrap_or(false);
    tally.fault(taken);
    tally.report("storage two writers of one rank");
}

/// The two-writers child: writes rank 0's first batch, says so, and holds the rank.
fn holder_child(dir: &Path) {
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::LayerFirst.into());
    let mut s = DiskStore::open(h.clone(), stream(&b), config(dir, 0, 1, 32)).unwrap();
    let (items, _) = stage(&h, &b, 45, 0);
    s.store_sync(&items).unwrap();
    std::fs::write(dir.join("committed"), b"").unwrap();
    std::thread::sleep(CHILD_DEADLINE);
}

#[test]
fn fault_planted_links() {
    if !nixl_available("fault_planted_links") {
        return;
    }
    let mut tally = Tally::default();
    let base = scratch("fault_links");
    let b = CpuBackend::new();
    let h = host(&b, HostLayout::PageFirstDirect.into());
    let victim = base.join("victim");
    let precious = vec![0x5Au8; 1 << 16];
    let refused = |r: Result<DiskStore, Error>| {
        matches!(
            r,
            Err(Error::Storage {
                failure: StorageFailure::Untrusted,
                ..
            })
        )
    };
    // Planted before the open: the slot file, the journal, the lock file.
    for name in ["w0000.slots", "w0000.journal", "w0000.lock"] {
        std::fs::write(&victim, &precious).unwrap();
        let dir = base.join(name.replace('.', "_"));
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(name)).unwrap();
        let r = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 1, 8));
        tally.fault(refused(r) && std::fs::read(&victim).unwrap() == precious);
    }
    // Planted while the store runs: the compaction file (removed, then created exclusively),
    // the journal swapped for a link (the writer's own descriptor is unaffected; the next open
    // refuses it), another rank's slot file (a load refuses it, the host untouched).
    std::fs::write(&victim, &precious).unwrap();
    let dir = base.join("running");
    let mut s0 = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 2, 8)).unwrap();
    let mut s1 = DiskStore::open(h.clone(), stream(&b), config(&dir, 1, 2, 8)).unwrap();
    let (staged, data) = stage(&h, &b, 46, 0);
    s0.store_sync(&staged[..3]).unwrap();
    s1.store_sync(&staged[3..]).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("w0000.journal.compact")).unwrap();
    let compacted = s0.compact_journal_sync().is_ok();
    tally.fault(compacted && std::fs::read(&victim).unwrap() == precious);
    let w1 = dir.join("w0001.slots");
    let saved = dir.join("w0001.slots.saved");
    std::fs::rename(&w1, &saved).unwrap();
    std::os::unix::fs::symlink(&victim, &w1).unwrap();
    poison(&h, &b);
    let keys: Vec<PageKey> = staged.iter().map(|i| i.0).collect();
    let snap = s0.snapshot().unwrap();
    assert_eq!(s0.lookup(&keys, &snap).unwrap(), BATCH);
    let load = s0.load_sync(&items(&keys, 1));
    let untouched = (1..=BATCH as u64).all(|p| read_page(&h, &b, p).iter().all(|&x| x == POISON));
    tally.fault(
        matches!(
            load,
            Err(Error::Storage {
                failure: StorageFailure::Untrusted,
                ..
            })
        ) && untouched
            && std::fs::read(&victim).unwrap() == precious,
    );
    std::fs::remove_file(&w1).unwrap();
    std::fs::rename(&saved, &w1).unwrap();
    let (good, _, wrong) = served(&mut s0, &h, &b, &keys, &data);
    tally.served_wrong += wrong;
    drop((s0, s1));
    let journal = dir.join("w0000.journal");
    let kept = dir.join("w0000.journal.kept");
    std::fs::rename(&journal, &kept).unwrap();
    std::os::unix::fs::symlink(&victim, &journal).unwrap();
    let r = DiskStore::open(h.clone(), stream(&b), config(&dir, 0, 2, 8));
    tally.fault(good == BATCH && refused(r) && std::fs::read(&victim).unwrap() == precious);
    // The directory itself.
    let real = base.join("real");
    std::fs::create_dir_all(&real).unwrap();
    let alias = base.join("alias");
    std::os::unix::fs::symlink(&real, &alias).unwrap();
    let r = DiskStore::open(h.clone(), stream(&b), config(&alias, 0, 1, 8));
    tally.fault(refused(r) && std::fs::read_dir(&real).unwrap().count() == 0);
    tally.report("storage planted links");
}

/// The entry point of child processes; does nothing in an ordinary run.
#[test]
fn child_entry() {
    if let (Ok(role), Some(dir)) = (std::env::var(CHILD), std::env::var_os(DIR)) {
        let dir = PathBuf::from(dir);
        match role.as_str() {
            "full" => full_child(&dir),
            "writer" => torn_child(&dir, false),
            "compactor" => torn_child(&dir, true),
            "holder" => holder_child(&dir),
            other => panic!("no child role {other}"),
        }
    }
}
