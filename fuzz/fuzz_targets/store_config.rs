//! A storage store opened with arbitrary settings (every field of `DiskConfig`, as an engine's
//! config file or SGLang's `extra_config` could give them): no panic and no abort, whatever the
//! sizes, counts and durations; the settings' own check refuses exactly what the open refuses
//! before touching the filesystem, and a store that opens works (a page stored and loaded back
//! byte for byte). Needs the NIXL runtime on LD_LIBRARY_PATH (`scripts/install-nixl.sh`).
//! What a run can afford decides which settings are also opened: a slot file of at most 32 MiB
//! (or past any disk, a PiB: refused as full), staging of at most 16 MiB (or past the bound:
//! refused), a deadline of a second or more (or none, or past the bound: refused). A shorter
//! deadline is met by I/O that outlives it, and the store then keeps its staging memory for
//! good (NIXL may still write it): thousands of those would exhaust the fuzzer, not find bugs.
//! The settings' check runs on every input all the same.
#![no_main]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arbitrary::Arbitrary;
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::Backend;
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::hicache::{HostLayout, HostPool};
use kvshard::index::LocalPage;
use kvshard::key::PageKey;
use kvshard::pool::disk::{Damaged, DiskConfig, DiskStore, LoadOutcome, QueueChoice};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    writer: u32,
    writers: u32,
    slots: u64,
    staging_slots: u64,
    max_io_bytes: u64,
    timeout_secs: u64,
    timeout_nanos: u32,
    aio: bool,
    read_only: bool,
    zero_fill: bool,
    journal_records: u64,
    refuse_damaged: bool,
    /// Values in the small ranges most runs take (slots, staging slots, writers, seconds).
    small_slots: Option<u8>,
    small_staging: Option<u8>,
    small_writers: Option<(u8, u8)>,
    small_timeout: Option<u8>,
}

/// What every run shares: the CPU twin, a one-layer host pool, a directory under the fuzz
/// crate's target folder.
struct Fixture {
    backend: CpuBackend,
    host: Arc<HostPool>,
    base: PathBuf,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        kvshard::transfer::nixl::load()
            .expect("the storage fuzz targets need the NIXL runtime: LD_LIBRARY_PATH=$(scripts/install-nixl.sh)");
        let backend = CpuBackend::new();
        let g = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 1));
        let host = Arc::new(HostPool::new(&backend, &g, 4, HostLayout::PageFirstDirect).unwrap());
        let base = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("target")
            .join(format!("store-config-{}", std::process::id()));
        Fixture { backend, host, base }
    })
}

fuzz_target!(|input: Input| {
    let f = fixture();
    let dir = f.base.join("s");
    let _ = std::fs::remove_dir_all(&f.base);
    let slots = input.small_slots.map_or(input.slots, u64::from);
    let staging_slots = input.small_staging.map_or(input.staging_slots, u64::from);
    let (writer, writers) = input
        .small_writers
        .map_or((input.writer, input.writers), |(w, n)| (u32::from(w), u32::from(n)));
    let mut config = DiskConfig::new(&dir, writer, writers, slots);
    config.staging_slots = usize::try_from(staging_slots).unwrap_or(usize::MAX);
    config.max_io_bytes = input.max_io_bytes;
    config.timeout = match input.small_timeout {
        Some(s) => Duration::from_secs(u64::from(s)),
        None => Duration::new(input.timeout_secs, input.timeout_nanos % 1_000_000_000),
    };
    config.queue = if input.aio { QueueChoice::Aio } else { QueueChoice::Auto };
    config.read_only = input.read_only;
    config.zero_fill = input.zero_fill;
    config.journal_records = input.journal_records;
    config.damaged = if input.refuse_damaged { Damaged::Refuse } else { Damaged::Skip };
    let valid = config.validate();
    // What the open would allocate, or wait for (module docs).
    let slot_guess = 64 * 576 + 4096u64;
    let bytes = slots.saturating_mul(slot_guess);
    let staging = staging_slots.saturating_mul(2 * slot_guess);
    let timeout = config.timeout;
    if (bytes > 32 << 20 && bytes <= 1 << 50)
        || (staging > 16 << 20 && staging <= kvshard::pool::disk::MAX_STAGING_BYTES)
        || (!timeout.is_zero() && timeout < Duration::from_secs(1))
    {
        return;
    }
    let b: Arc<dyn Backend> = Arc::new(f.backend.new_stream());
    match DiskStore::open(f.host.clone(), b, config) {
        Err(_) => {}
        Ok(mut store) => {
            assert!(valid.is_ok(), "a store opened with settings its check refuses");
            if store.read_only() {
                return;
            }
            let key = PageKey::from_bytes(&[7; 64]).unwrap();
            let r = store.store_sync(&[(key, LocalPage(1))]);
            if matches!(r, Ok(r) if r.written == 1) {
                let out = store.load_sync(&[(key, LocalPage(2))]).unwrap_or_default();
                assert!(out.iter().all(|o| *o != LoadOutcome::Corrupt), "{out:?}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&f.base);
});
