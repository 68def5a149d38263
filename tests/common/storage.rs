//! What the storage tier's test binaries share (feature `nixl`): the geometry, host pools on the
//! CPU twin or a GPU, pages of random bytes with their keys, stores' settings and directories
//! under the build tree (a real filesystem: tmpfs may refuse O_DIRECT), and the check that the
//! NIXL runtime loads (without it a test says SKIPPED, or fails under KVSHARD_REQUIRE_NIXL).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::Backend;
use kvshard::copy::BlockSpace;
use kvshard::geometry::{CacheGeometry, IndexerScale, LatentLayout, PoolGeometry};
use kvshard::hicache::{HostFormat, HostPool};
use kvshard::index::{LocalPage, StoredLayer};
use kvshard::key::{Namespace, PageKey};
use kvshard::pool::disk::DiskConfig;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

/// What host pages hold before anything is loaded into them.
pub const POISON: u8 = 0xA5;
/// Host pages of the tests' pools (page 0 is padding).
pub const PAGES: u64 = 24;

/// Three target layers (the second sharing its indexer) and the MTP draft.
pub fn geometry() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Scaled,
        vec![true, false, true],
    ))
}

/// Whether the NIXL runtime loads (else the test skips, saying so, or fails when
/// KVSHARD_REQUIRE_NIXL is set).
pub fn nixl_available(test: &str) -> bool {
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
pub fn scratch(test: &str) -> PathBuf {
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
pub fn stream(b: &CpuBackend) -> Arc<dyn Backend> {
    Arc::new(b.new_stream())
}

/// A host pool of [`PAGES`] pages of [`geometry`] in `format`, poisoned.
pub fn host(b: &dyn Backend, format: HostFormat) -> Arc<HostPool> {
    let h = HostPool::new_with(b, &geometry(), PAGES, format).expect("host pool");
    poison(&h, b);
    Arc::new(h)
}

/// Fills `h` with [`POISON`] and waits for it.
pub fn poison(h: &HostPool, b: &dyn Backend) {
    h.fill(b, POISON).expect("fill");
    b.synchronize().expect("synchronize");
}

/// Every row of `page` of every component, in one order.
pub fn read_page(h: &HostPool, b: &dyn Backend, page: u64) -> Vec<u8> {
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

/// Writes `data` (a page in [`read_page`]'s order) into host page `page`.
pub fn write_page(h: &HostPool, b: &dyn Backend, page: u64, data: &[u8]) {
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
pub fn batch(seed: u64, batch: u64, pages: usize) -> (Vec<PageKey>, Vec<Vec<u8>>) {
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

/// Rank `writer` of `writers` in `dir`, `slots` slots each: 5 staging slots, 20 s per call.
pub fn config(dir: &Path, writer: u32, writers: u32, slots: u64) -> DiskConfig {
    let mut c = DiskConfig::new(dir, writer, writers, slots);
    c.staging_slots = 5;
    c.timeout = Duration::from_secs(20);
    c
}

/// CRC-32C (Castagnoli), bit by bit: what journal records carry, for tests that write records
/// of their own.
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Bytes of a journal's header and of one of its records (docs/storage.md, "Journals").
pub const JOURNAL_HEADER: usize = 64;
/// Bytes of one journal record.
pub const JOURNAL_RECORD: usize = 96;

/// A valid journal record (its own checksum right) of `kind` (1 commit, 2 free, 3 skip) for
/// `slot` (a skip: its count), `key` and page checksum `crc`.
pub fn journal_record(kind: u8, slot: u64, key: &PageKey, crc: u32) -> [u8; JOURNAL_RECORD] {
    let mut b = [0u8; JOURNAL_RECORD];
    b[..4].copy_from_slice(b"KVSR");
    b[4] = kind;
    b[8..16].copy_from_slice(&slot.to_le_bytes());
    if kind != 3 {
        b[16..80].copy_from_slice(key.bytes());
    }
    b[80..84].copy_from_slice(&crc.to_le_bytes());
    let check = crc32c(&b[..88]);
    b[88..92].copy_from_slice(&check.to_le_bytes());
    b
}

/// Flips bit 0 of byte `at` of the file at `path`.
pub fn flip(path: &Path, at: usize) {
    let mut bytes = std::fs::read(path).expect("read");
    bytes[at] ^= 1;
    std::fs::write(path, &bytes).expect("write");
}

/// `(key, host page)` pairs of `keys`, on host pages `first..`.
pub fn items(keys: &[PageKey], first: u64) -> Vec<(PageKey, LocalPage)> {
    keys.iter()
        .enumerate()
        .map(|(i, k)| (*k, LocalPage(first + i as u64)))
        .collect()
}
