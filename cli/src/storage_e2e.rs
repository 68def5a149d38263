//! `kvshard storage-bench`'s end-to-end rows (feature `nixl`): the figure users compare, a
//! prefix of 16K or 128K tokens reloaded to the device from storage (L3 -> L2 -> L1) next to
//! the same prefix from host memory (L2 -> L1), each timed from the first call to bytes usable
//! on the device (the load's acknowledgement, which waits for its last event).
//!
//! One unsharded rank: a device pool and a page-first-direct host pool of the prefix's pages
//! (pinned on CUDA), a HiCache controller with a [`DiskStore`] attached write-through. The
//! device pages get a distinct pattern, are backed up to the host (and so stored), then:
//! 1. the device pages are zeroed and the prefix loaded L2 -> L1 (timed), the pool's bytes
//!    digested;
//! 2. the prefix leaves the host, the device pages are zeroed again, and it is prefetched
//!    L3 -> L2 and loaded L2 -> L1 (timed from the prefetch), the pool's bytes digested: the two
//!    digests must match (byte-identical, page order included, against what L2 gave).
//!
//! The L3 path is the store's: its prefetch completes before the L2 -> L1 load is enqueued (no
//! overlap of disk reads with the host-to-device copy), so the L3 time is the sum of the two.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard::backend::Backend;
use kvshard::geometry::{CacheGeometry, IndexerScale};
use kvshard::hicache::{
    CacheNode, HiCacheController, HostLayout, HostPool, Route, StoragePolicy, Streams, WritePolicy,
};
use kvshard::index::LogicalPage;
use kvshard::key::{Namespace, PageKey};
use kvshard::pool::disk::{DiskConfig, DiskStore, QueueChoice};
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::{Error, Result};

use crate::demo::StreamFactory;

/// Tokens per page (SGLang's page size for these models).
const PAGE_TOKENS: u64 = 64;

/// One prefix's row.
#[derive(Debug, Clone)]
pub struct E2eRow {
    /// Tokens of the prefix.
    pub tokens: u64,
    /// Pages of the prefix.
    pub pages: u64,
    /// Bytes moved (the pages' data).
    pub bytes: u64,
    /// L2 -> L1, from the load call to its acknowledgement.
    pub from_host: Duration,
    /// L3 -> L2, from the prefetch call to its acknowledgement.
    pub prefetch: Duration,
    /// L2 -> L1 after the prefetch, from the load call to its acknowledgement.
    pub then_load: Duration,
    /// The store's queue.
    pub queue: String,
}

impl E2eRow {
    /// L3 -> L2 -> L1 in all.
    pub fn from_storage(&self) -> Duration {
        self.prefetch + self.then_load
    }
}

/// Digest of a pool's every byte, order included (a multiply-rotate fold over 8-byte words:
/// several GB/s, where SipHash would add seconds to a 5.5 GB prefix), and whether any is non-zero.
fn digest(pool: &DevicePool, b: &dyn Backend) -> Result<(u64, bool)> {
    let bytes = pool.snapshot_sync(b)?;
    let mut h = 0u64;
    let mut any = 0u64;
    for w in bytes.chunks(8) {
        let mut word = [0u8; 8];
        word[..w.len()].copy_from_slice(w);
        let v = u64::from_le_bytes(word);
        any |= v;
        h = (h.rotate_left(5) ^ v).wrapping_mul(0x517C_C1B7_2722_0A95);
    }
    Ok((h, any != 0))
}

/// Writes a pattern distinct per byte position (so a page landing in the wrong place changes the
/// digest) over the whole pool allocation, in chunks.
fn pattern(pool: &DevicePool, b: &dyn Backend) -> Result<()> {
    let storage = pool
        .storage()
        .ok_or_else(|| Error::Verification("the benchmark's pool has no allocation".into()))?;
    const CHUNK: usize = 64 << 20;
    let mut chunk = vec![0u8; CHUNK];
    let mut at = 0usize;
    while at < storage.len() {
        let n = CHUNK.min(storage.len() - at);
        for (i, w) in chunk[..n].chunks_mut(8).enumerate() {
            // splitmix64 of the word's position: cheap and never repeating.
            let mut z = ((at / 8 + i) as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let v = (z ^ (z >> 31)).to_le_bytes();
            w.copy_from_slice(&v[..w.len()]);
        }
        b.write_sync(storage, at, &chunk[..n])?;
        at += n;
    }
    Ok(())
}

/// Measures one prefix of `tokens` tokens of geometry `g` on backend `b` (streams from
/// `streams`), its storage in a private directory made in `base` for the row (removed after).
pub fn prefix_row(
    b: &Arc<dyn Backend>,
    streams: StreamFactory<'_>,
    g: &CacheGeometry,
    tokens: u64,
    base: &Path,
    aio: bool,
) -> Result<E2eRow> {
    let private = crate::storage_bench::private_dir(base, "kvshard-storage-e2e-")?;
    let dir = private.path();
    let bk = b.as_ref();
    let pages = tokens.div_ceil(PAGE_TOKENS);
    // Page 0 of each pool is padding.
    let device = Arc::new(DevicePool::allocate(
        bk,
        g,
        Placement::unsharded(),
        0,
        pages + 1,
    )?);
    let host = Arc::new(HostPool::new(
        bk,
        g,
        pages + 1,
        HostLayout::PageFirstDirect,
    )?);
    let s = Streams::each(streams)?;
    let mut c = HiCacheController::new(device.clone(), host.clone(), s, WritePolicy::WriteThrough)?;
    c.prepare_staging()?;
    let mut cfg = DiskConfig::new(dir, 0, 1, pages);
    cfg.timeout = Duration::from_secs(120);
    if aio {
        cfg.queue = QueueChoice::Aio;
    }
    let store = DiskStore::open(host, b.clone(), cfg)?;
    let queue = store.io_queue().to_string();
    c.attach_storage(store, StoragePolicy::WriteThrough, Duration::from_secs(120))?;
    let ns = Namespace::new(g, IndexerScale::Ue8m0, b"storage-bench-e2e")?;
    let ids: Vec<u32> = (0..pages * PAGE_TOKENS)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761))
        .collect();
    let keys = PageKey::chain(&ns, &ids, None);
    let device_pages: Vec<LogicalPage> = (1..=pages).map(LogicalPage).collect();
    let node = CacheNode {
        id: 1,
        device_pages: device_pages.clone(),
        start_owner: None,
    };

    // The prefix on the device, backed up to the host, written through to storage.
    pattern(&device, bk)?;
    let written = bk.record()?;
    c.set_keys(node.id, keys.clone())?;
    c.backup(&node, &written, Route::Auto)?;
    c.ack_backups_sync(1)?;
    let stored = c.ack_storage_sync(1)?;
    if !stored.iter().all(|a| a.complete) {
        return Err(Error::Verification(format!(
            "storage-bench e2e: the prefix was not stored whole ({stored:?})"
        )));
    }

    // 1. From L2.
    device.fill(bk, 0)?;
    bk.synchronize()?;
    let t = Instant::now();
    c.load(node.id, &device_pages, None, Route::Auto)?;
    c.ack_loads_sync(1)?;
    let from_host = t.elapsed();
    let (from_l2, nonzero) = digest(&device, bk)?;
    if !nonzero {
        return Err(Error::Verification(
            "storage-bench e2e: the load from the host left the pool zero".into(),
        ));
    }

    // 2. From L3, through L2.
    c.evict_host_sync(node.id)?;
    device.fill(bk, 0)?;
    bk.synchronize()?;
    let t = Instant::now();
    c.prefetch(&node, keys)?;
    let acks = c.ack_storage_sync(1)?;
    let prefetch = t.elapsed();
    if !acks.iter().all(|a| a.complete) {
        return Err(Error::Verification(format!(
            "storage-bench e2e: the prefix came back from storage incomplete ({acks:?})"
        )));
    }
    let t = Instant::now();
    c.load(node.id, &device_pages, None, Route::Auto)?;
    c.ack_loads_sync(1)?;
    let then_load = t.elapsed();
    let (from_l3, _) = digest(&device, bk)?;
    if from_l3 != from_l2 {
        return Err(Error::Verification(
            "storage-bench e2e: the prefix reloaded from storage differs from the one loaded from the host".into(),
        ));
    }
    Ok(E2eRow {
        tokens,
        pages,
        bytes: pages * g.page_bytes() as u64,
        from_host,
        prefetch,
        then_load,
        queue,
    })
}

/// The rows as a markdown table, with what they ran on.
pub fn render(rows: &[E2eRow], backend: &str) -> String {
    let mut out = format!(
        "\n## End to end: a prefix reloaded to the device ({backend} backend, one rank, NIXL POSIX on {}), from the call to usable bytes; byte-identical to the host's copy\n\n",
        rows.first().map_or("-", |r| r.queue.as_str())
    );
    out.push_str("| prefix | pages | GB | from L2 ms | L2 GB/s | from L3 via L2 ms | L3 -> L2 ms | then L2 -> L1 ms | L3 GB/s | L3 / L2 time |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let gbps = |d: Duration| r.bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9;
        out.push_str(&format!(
            "| {} tokens | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1}x |\n",
            if r.tokens % 1024 == 0 {
                format!("{}K", r.tokens / 1024)
            } else {
                r.tokens.to_string()
            },
            r.pages,
            r.bytes as f64 / 1e9,
            ms(r.from_host),
            gbps(r.from_host),
            ms(r.from_storage()),
            ms(r.prefetch),
            ms(r.then_load),
            gbps(r.from_storage()),
            r.from_storage().as_secs_f64() / r.from_host.as_secs_f64().max(1e-9),
        ));
    }
    out
}

/// `storage-bench --gds`: GPUDirect Storage on GPU 0 through NIXL's GDS backend
/// ([`kvshard::pool::disk::gds`]), `descriptors` slot-size descriptors of the geometry's slot
/// (rounded up to 4 KiB) at once, `in_flight` per request; the report says exactly why where
/// GDS cannot run, and that the tier's loads then go through the host (the rows above).
pub fn gds_report(
    b: &dyn Backend,
    g: &CacheGeometry,
    dir: &Path,
    descriptors: u64,
    in_flight: usize,
) -> String {
    let io_bytes = (g.page_bytes() as u64).div_ceil(4096) * 4096;
    let bytes = io_bytes * descriptors.max(1);
    let measured = usize::try_from(bytes)
        .map_err(|_| crate::overflow("GDS bytes"))
        // cuFile registers the buffer by address: cuMemAlloc memory, which it takes.
        .and_then(|len| b.alloc_registrable(len))
        .and_then(|vram| {
            kvshard::pool::disk::gds::ceiling_sync(
                b,
                &vram,
                0,
                dir,
                io_bytes,
                in_flight,
                Duration::from_secs(60),
            )
        });
    let mut out = String::from("\n## GDS: GPU 0 <-> file through NIXL's GDS backend (cuFile)\n\n");
    match measured {
        Ok(c) => {
            out.push_str(&format!(
                "NIXL backend {}, {:.2} GB each way, checked byte for byte after each read.\n\n| descriptors | write GB/s (VRAM -> file) | read GB/s (file -> VRAM) |\n|---|---|---|\n| one of {:.2} GB (cuFile's ceiling for these bytes) | {:.2} | {:.2} |\n| {} B (a slot), {} per request | {:.2} | {:.2} |\n",
                c.backend,
                c.bytes as f64 / 1e9,
                c.bytes as f64 / 1e9,
                c.one_write_gbps,
                c.one_read_gbps,
                c.io_bytes,
                c.in_flight,
                c.many_write_gbps,
                c.many_read_gbps
            ));
        }
        Err(e) => out.push_str(&format!(
            "GDS not measured: {e}\nThe storage tier's loads go through the host instead (NIXL POSIX into host staging, then L2 -> L1: the end-to-end rows).\n"
        )),
    }
    out
}
