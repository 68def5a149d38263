//! A store opened over a fuzzed journal: writer 1's journal of a known store (six pages, two
//! of them evicted, so commits, frees and, compacted, skips) with bytes flipped, the file cut
//! or grown, or replaced whole, read as this rank's own journal (the writer reopening) or as
//! another rank's (a snapshot). No panic, no abort, no unbounded allocation; and unless the
//! fuzzer forged a valid record of its own, no page is ever served with wrong bytes, and every
//! page whose commit record it left alone (and did not cut) loads byte for byte. Needs the NIXL
//! runtime on LD_LIBRARY_PATH (`scripts/install-nixl.sh`).
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arbitrary::Arbitrary;
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::Backend;
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::hicache::{HostLayout, HostPool};
use kvshard::index::LocalPage;
use kvshard::key::PageKey;
use kvshard::pool::disk::{Damaged, DiskConfig, DiskStore, LoadOutcome};
use libfuzzer_sys::fuzz_target;

const HEADER: usize = 64;
const RECORD: usize = 96;
const KEYS: usize = 6;
const SLOTS: u64 = 4;

#[derive(Debug, Arbitrary)]
struct Input {
    /// Read as the writer's own journal (else as another rank's).
    own: bool,
    /// The compacted journal (else the one the stores wrote).
    compacted: bool,
    refuse_damaged: bool,
    /// (byte offset, bits to flip).
    flips: Vec<(u16, u8)>,
    /// Bytes to cut the file to.
    cut: Option<u16>,
    /// Bytes appended.
    grow: Vec<u8>,
    /// A journal of these bytes instead (bounded).
    whole: Option<Vec<u8>>,
}

/// A store's files, made once: writer 1 of 2, its six pages' keys and bytes, and the journal
/// as written and as compacted.
struct Base {
    backend: CpuBackend,
    host: Arc<HostPool>,
    dir: PathBuf,
    keys: Vec<PageKey>,
    pages: Vec<Vec<u8>>,
    slots: Vec<u8>,
    journal: Vec<u8>,
    compacted: Vec<u8>,
}

fn config(dir: &Path, writer: u32) -> DiskConfig {
    let mut c = DiskConfig::new(dir, writer, 2, SLOTS);
    c.staging_slots = 2;
    c.timeout = Duration::from_secs(20);
    c
}

/// Every byte of host page `page`, buffer by buffer.
fn page(h: &HostPool, b: &dyn Backend, page: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..h.buffer_layouts().len() {
        let m = h.buffer_memory(i).unwrap();
        for (offset, n) in h.page_spans(i, LocalPage(page)).unwrap() {
            out.extend(b.read_sync(m, offset as usize, n as usize).unwrap());
        }
    }
    out
}

fn base() -> &'static Base {
    static B: OnceLock<Base> = OnceLock::new();
    B.get_or_init(|| {
        kvshard::transfer::nixl::load()
            .expect("the storage fuzz targets need the NIXL runtime: LD_LIBRARY_PATH=$(scripts/install-nixl.sh)");
        let backend = CpuBackend::new();
        let g = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 1));
        let host = Arc::new(HostPool::new(&backend, &g, 8, HostLayout::PageFirstDirect).unwrap());
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("target")
            .join(format!("journal-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let made = root.join("base");
        let keys: Vec<PageKey> = (0..KEYS as u8)
            .map(|i| PageKey::from_bytes(&[i + 1; 64]).unwrap())
            .collect();
        let mut pages = Vec::new();
        for p in 1..=KEYS as u64 {
            for i in 0..host.buffer_layouts().len() {
                let m = host.buffer_memory(i).unwrap();
                for (offset, n) in host.page_spans(i, LocalPage(p)).unwrap() {
                    let bytes: Vec<u8> = (0..n).map(|k| (k * 31 + p * 7 + 1) as u8).collect();
                    backend.write_sync(m, offset as usize, &bytes).unwrap();
                }
            }
            pages.push(page(&host, &backend, p));
        }
        let stream = || -> Arc<dyn Backend> { Arc::new(backend.new_stream()) };
        let mut s = DiskStore::open(host.clone(), stream(), config(&made, 1)).unwrap();
        let items: Vec<(PageKey, LocalPage)> =
            keys.iter().enumerate().map(|(i, k)| (*k, LocalPage(1 + i as u64))).collect();
        // Four pages fill the four slots; two more evict the first two (Frees, then Commits).
        s.store_sync(&items[..4]).unwrap();
        s.store_sync(&items[4..]).unwrap();
        drop(s);
        let slots = std::fs::read(made.join("w0001.slots")).unwrap();
        let journal = std::fs::read(made.join("w0001.journal")).unwrap();
        let mut s = DiskStore::open(host.clone(), stream(), config(&made, 1)).unwrap();
        s.compact_journal_sync().unwrap();
        drop(s);
        let compacted = std::fs::read(made.join("w0001.journal")).unwrap();
        Base {
            backend,
            host,
            dir: root.join("run"),
            keys,
            pages,
            slots,
            journal,
            compacted,
        }
    })
}

/// Whether `b` (one record place) is a record whose own checksum holds.
fn checks(b: &[u8]) -> bool {
    b.len() == RECORD
        && &b[..4] == b"KVSR"
        && u32::from_le_bytes([b[88], b[89], b[90], b[91]]) == crc32c::crc32c(&b[..88])
}

fuzz_target!(|input: Input| {
    let base = base();
    let original = if input.compacted { &base.compacted } else { &base.journal };
    let mut journal = original.clone();
    if let Some(whole) = &input.whole {
        journal = whole.iter().copied().take(1 << 16).collect();
    }
    for &(at, bits) in input.flips.iter().take(64) {
        if let Some(b) = journal.get_mut(usize::from(at)) {
            *b ^= bits;
        }
    }
    if let Some(cut) = input.cut {
        journal.truncate(usize::from(cut));
    }
    journal.extend(input.grow.iter().take(1 << 16));
    // Which original record places are left as they were (and not cut), and whether any
    // changed place holds a record whose checksum holds (one the fuzzer forged).
    let places = original.len().saturating_sub(HEADER) / RECORD;
    let intact: Vec<bool> = (0..places)
        .map(|i| {
            let r = HEADER + i * RECORD..HEADER + (i + 1) * RECORD;
            journal.get(r.clone()) == original.get(r)
        })
        .collect();
    let header_intact = journal.get(..HEADER) == original.get(..HEADER);
    let forged = journal
        .get(HEADER..)
        .unwrap_or(&[])
        .chunks(RECORD)
        .enumerate()
        .any(|(i, b)| !intact.get(i).copied().unwrap_or(false) && checks(b));

    let dir = &base.dir;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("w0001.slots"), &base.slots).unwrap();
    std::fs::write(dir.join("w0001.journal"), &journal).unwrap();
    let b = &base.backend;
    let writer = if input.own { 1 } else { 0 };
    let mut c = config(dir, writer);
    c.damaged = if input.refuse_damaged { Damaged::Refuse } else { Damaged::Skip };
    let Ok(mut s) = DiskStore::open(base.host.clone(), Arc::new(b.new_stream()), c) else {
        // Refused (another header, damage under Refuse): typed, nothing served.
        return;
    };
    let snapshot = match s.snapshot() {
        Ok(snap) => snap,
        Err(_) => return,
    };
    let _ = s.exists(&base.keys, &snapshot);
    base.host.fill(b, 0).unwrap();
    b.synchronize().unwrap();
    let items: Vec<(PageKey, LocalPage)> =
        base.keys.iter().enumerate().map(|(i, k)| (*k, LocalPage(1 + i as u64))).collect();
    let out = s.load_sync(&items).unwrap();
    if forged {
        return;
    }
    // The record place of each present page's commit, in the original journal.
    let commit_place = |key: &PageKey| -> Option<usize> {
        (0..places).rev().find(|&i| {
            let r = &original[HEADER + i * RECORD..HEADER + (i + 1) * RECORD];
            r[4] == 1 && &r[16..80] == key.bytes()
        })
    };
    for (i, o) in out.iter().enumerate() {
        let got = page(&base.host, b, 1 + i as u64);
        match o {
            LoadOutcome::Loaded => assert!(got == base.pages[i], "page {i} served wrong bytes"),
            // An evicted key whose Free and whose slot's next commit were both damaged names
            // a slot holding another key's page: its checksum says so, a reported miss.
            LoadOutcome::Corrupt => assert!(i < 2, "page {i}: its slot is untouched"),
            LoadOutcome::Missing => {
                // Only a page whose commit was changed or cut (or an evicted one) is missing,
                // when the header is the store's.
                let kept = commit_place(&base.keys[i]).is_some_and(|p| intact[p]);
                assert!(
                    !(kept && header_intact && i >= 2 && input.whole.is_none()),
                    "page {i} lost though its commit record is intact"
                );
            }
        }
    }
});
