//! `kvshard._kvshard`: the native half of the `kvshard` Python package (PyO3, abi3).
//!
//! The classes wrap kvshard's Rust API one to one: geometry, placement and the rotated
//! allocator, request chains, the budget, device pools (allocated, or wrapping the engine's
//! DLPack tensors without a copy) and the owned-row write, P/D senders and receivers, host
//! pools (kvshard's and SGLang's byte layouts) with their transfers, and the HiCache
//! controller. Every enqueueing call takes the caller's stream and never synchronizes it
//! behind the caller's back; long calls release the GIL. kvshard's errors arrive as the
//! exceptions of `kvshard._errors`, with kvshard's message. No panic crosses into Python: the
//! code returns errors, and PyO3 turns any panic that slipped through into an exception.
//! Routes, I/O backends, relayouts, copy methods, write policies, directions, layouts and
//! components are enum classes (`kvshard.Route.KERNEL`), never strings. Storage keys
//! (`Namespace`, SGLang's page-hash chain) are always built; the storage tier below the host
//! pool (`DiskStore`) with the `nixl` feature.
//!
//! One job per module; a module imports only modules below it, bottom-up: `errors` (kvshard's
//! errors as exceptions), `lock` (the poison-recovering lock), `tensor` (DLPack both ways),
//! `device` (devices, streams, events), `frees` (the process's pending frees), `geometry`, `shard` (placement, the allocator),
//! `method` (how bytes move), `pool_tensors` (what every pool shares about tensors),
//! `device_pool`, `chunk_staging`, `owned_row_write`, `budget`, `batch_plans` (a prefill
//! batch's admission and gather plan), `capacity` (the capacity
//! planner), `dcp` (decode context-parallel layouts and registrations), `transfer` (P/D),
//! `hicache_enums` (HiCache's choices), `host_pool`, `mooncake_prefill` (the prefill side of a
//! transfer engine's transport: send plans as its descriptor lists, bounce buffers, the memory
//! it registers), `side_channel` (the Mooncake side channel's frames and its decode side),
//! `layer_signals` (per-layer readiness),
//! `host_transfer` (transfer plans, host transfers, their staging), `hicache_controller`,
//! `chain` (a request's chain, which makes HiCache nodes and P/D registrations),
//! `storage_keys` (namespaces, page hashes, keys), `disk_store` (the storage tier, feature
//! `nixl`), `bench` (`python/bench.py`'s native loops), and this file on top.

/// Both `From` conversions between a Python enum and the kvshard enum it mirrors, from one
/// table of variant pairs, so the two directions cannot disagree.
macro_rules! mirror_enum {
    ($py:ident <=> $rs:ident { $($p:ident = $r:ident),+ $(,)? }) => {
        impl From<$py> for $rs {
            fn from(v: $py) -> Self {
                match v {
                    $($py::$p => Self::$r,)+
                }
            }
        }

        impl From<$rs> for $py {
            fn from(v: $rs) -> Self {
                match v {
                    $($rs::$r => Self::$p,)+
                }
            }
        }
    };
}

mod batch_plans;
mod bench;
mod budget;
mod capacity;
mod chain;
mod chunk_staging;
mod dcp;
mod device;
mod device_pool;
#[cfg(feature = "nixl")]
mod disk_store;
mod errors;
// The process's pending frees (kvshard.pending_frees, kvshard.wait_for_frees_sync).
mod frees;
mod geometry;
mod hicache_controller;
mod hicache_enums;
// The calling thread's host-blocking waits (kvshard.host_waits: only `_sync` calls block).
mod host_pool;
mod host_transfer;
mod host_waits;
mod layer_signals;
mod lock;
mod method;
mod mooncake_prefill;
mod owned_row_write;
// A page copy an engine runs layer by layer (its scratch gather).
mod page_copy;
mod pool_tensors;
// The decode side of P/D: its receiver of chunk statuses (Finished, Overdue).
mod receiver;
mod shard;
mod side_channel;
mod storage_keys;
mod tensor;
mod transfer;

use pyo3::prelude::*;

/// Architectures whose kernels this build embeds (None: built without nvcc; GPU calls raise
/// `UnavailableError` and the CPU backend still runs).
#[pyfunction]
fn embedded_archs() -> Option<&'static str> {
    kvshard::gpu::embedded_archs()
}

/// Whether the CUDA driver library can be loaded here.
#[pyfunction]
fn driver_present() -> bool {
    kvshard::gpu::driver_present()
}

#[pymodule(gil_used = false)]
fn _kvshard(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use kvshard::geometry as g;
    m.add("PAGE_SIZE", g::PAGE_SIZE)?;
    m.add("INDEXER_PAGE_BYTES", g::INDEXER_PAGE_BYTES)?;
    m.add("INDEXER_ROW_BYTES", g::INDEXER_ROW_BYTES)?;
    m.add("KV_LORA_RANK", g::KV_LORA_RANK)?;
    m.add("ROPE_DIM", g::ROPE_DIM)?;
    m.add("INDEXER_HEAD_DIM", g::INDEXER_HEAD_DIM)?;
    m.add("MAX_PREFILL_RANKS", kvshard::transfer::MAX_PREFILL_RANKS)?;
    m.add(
        "DEFAULT_DEADLINE",
        kvshard::transfer::DEFAULT_DEADLINE.as_secs_f64(),
    )?;
    m.add(
        "DEFAULT_STAGING_PAGES",
        kvshard::hicache::DEFAULT_STAGING_PAGES,
    )?;
    m.add_function(wrap_pyfunction!(embedded_archs, m)?)?;
    m.add_function(wrap_pyfunction!(driver_present, m)?)?;
    // The process's pending frees.
    m.add_function(wrap_pyfunction!(frees::pending_frees, m)?)?;
    m.add_function(wrap_pyfunction!(frees::wait_for_frees_sync, m)?)?;
    m.add_function(wrap_pyfunction!(host_waits::host_waits, m)?)?;
    m.add_function(wrap_pyfunction!(capacity::plan_capacity, m)?)?;
    m.add_function(wrap_pyfunction!(device::_stream_handle, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_rust_load_ns, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_rust_run_signalled_ns, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_rust_send_ns, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_rust_bulk_seconds, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_rust_bulk_send_seconds, m)?)?;
    m.add_class::<device::PyDevice>()?;
    m.add_class::<device::PyStream>()?;
    m.add_class::<device::PyEvent>()?;
    m.add_class::<tensor::PyTensorView>()?;
    m.add_class::<geometry::PyLatentLayout>()?;
    m.add_class::<geometry::PyComponent>()?;
    m.add_class::<geometry::PyPoolGeometry>()?;
    m.add_class::<geometry::PyCacheGeometry>()?;
    m.add_class::<geometry::PyComponentLayout>()?;
    m.add_class::<shard::PyPlacement>()?;
    m.add_class::<shard::PyShardAllocator>()?;
    m.add_class::<shard::PyAllocation>()?;
    m.add_class::<device_pool::PyDevicePool>()?;
    m.add_class::<chunk_staging::PyChunkStaging>()?;
    m.add_class::<owned_row_write::PyOwnedRowWrite>()?;
    m.add_class::<budget::PyBudget>()?;
    m.add_class::<capacity::PyTierCapacity>()?;
    m.add_class::<capacity::PyTierReload>()?;
    m.add_class::<capacity::PyReload>()?;
    m.add_class::<capacity::PyCapacityPlan>()?;
    m.add_class::<transfer::PyPoolLayout>()?;
    m.add_class::<transfer::PyRegistration>()?;
    m.add_class::<transfer::PyRemoteSpace>()?;
    m.add_class::<transfer::PyChunkStatus>()?;
    m.add_class::<transfer::PyPendingChunk>()?;
    m.add_class::<transfer::PySender>()?;
    m.add_class::<receiver::PyFinished>()?;
    m.add_class::<receiver::PyOverdue>()?;
    m.add_class::<receiver::PyReceiver>()?;
    m.add_class::<method::PyMethod>()?;
    // Decode context parallelism (docs/dcp.md).
    m.add_class::<dcp::PyDecodeLayout>()?;
    m.add_class::<dcp::PyDecodeRank>()?;
    m.add_class::<dcp::PyDecodeRegistration>()?;
    m.add("MAX_DECODE_RANKS", kvshard::shard::MAX_DECODE_RANKS)?;
    m.add_function(wrap_pyfunction!(mooncake_prefill::engine_memory, m)?)?;
    m.add_function(wrap_pyfunction!(mooncake_prefill::engine_regions, m)?)?;
    m.add_class::<mooncake_prefill::PyMooncakeMode>()?;
    m.add_class::<mooncake_prefill::PyBounceBuffer>()?;
    m.add_class::<mooncake_prefill::PyMooncakeChunk>()?;
    m.add_class::<mooncake_prefill::PyMooncakeSender>()?;
    // The Mooncake side channel: its frames and its decode side.
    m.add_function(wrap_pyfunction!(side_channel::side_frame, m)?)?;
    m.add_function(wrap_pyfunction!(side_channel::side_shape, m)?)?;
    m.add_class::<side_channel::PySideReader>()?;
    m.add_class::<side_channel::PyMooncakeReceiver>()?;
    m.add_class::<hicache_enums::PyHostLayout>()?;
    m.add_class::<hicache_enums::PyRoute>()?;
    m.add_class::<hicache_enums::PyWritePolicy>()?;
    m.add_class::<hicache_enums::PyDirection>()?;
    m.add_class::<host_pool::PyHostBufferLayout>()?;
    m.add_class::<host_pool::PyHostPool>()?;
    m.add_class::<host_transfer::PyTransferPlan>()?;
    m.add_class::<layer_signals::PyLayerSignals>()?;
    m.add_class::<layer_signals::PyLayerReady>()?;
    m.add_class::<layer_signals::PyLayerWaits>()?;
    m.add_class::<host_transfer::PyHostTransfer>()?;
    m.add_class::<host_transfer::PyStagedIo>()?;
    m.add_class::<hicache_controller::PyCacheNode>()?;
    m.add_class::<hicache_controller::PyBackupAck>()?;
    m.add_class::<hicache_controller::PyLoadAck>()?;
    m.add_class::<hicache_controller::PyLoadHandle>()?;
    m.add_class::<hicache_controller::PyHiCacheController>()?;
    m.add_class::<chain::PyRequestChain>()?;
    m.add("KEY_BYTES", kvshard::key::KEY_BYTES)?;
    m.add("STORAGE_LAYOUT_VERSION", kvshard::key::LAYOUT_VERSION)?;
    // A CP prefill batch's admission and gather plan (batch_plans.rs).
    m.add_class::<batch_plans::PyAdmission>()?;
    m.add_class::<batch_plans::PyGatherPlan>()?;
    // A page copy an engine's scratch gather runs layer by layer (page_copy.rs).
    m.add_class::<page_copy::PyPageCopy>()?;
    m.add_class::<storage_keys::PyIndexerScale>()?;
    m.add_class::<storage_keys::PyNamespace>()?;
    m.add_function(wrap_pyfunction!(storage_keys::page_hash, m)?)?;
    m.add_function(wrap_pyfunction!(storage_keys::page_hashes, m)?)?;
    #[cfg(feature = "nixl")]
    {
        m.add_class::<disk_store::PyLoadOutcome>()?;
        m.add_class::<disk_store::PySnapshot>()?;
        m.add_class::<disk_store::PyStoreReport>()?;
        m.add_class::<disk_store::PyDiskStats>()?;
        m.add_class::<disk_store::PyDiskStore>()?;
    }
    Ok(())
}
