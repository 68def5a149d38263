//! The P/D requests both sides of a cross-process test derive from one seed (tests/nixl.rs,
//! tests/mooncake.rs, tests/faults_transport.rs): the geometry, the prefill pools' bytes, the
//! requests (several chunks, a cached prefix, a one-page request whose other rank sends an
//! empty final chunk, one larger than a bounce slot), the poisoned decode pool, and the
//! in-process reference the decode pool must end byte-identical to. The pools are allocated
//! registrable (`DevicePool::allocate_registrable`): NIXL and Mooncake register them by address.

use std::sync::Arc;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::Backend;
use kvshard::copy::{BlockSpace, RemoteSpace};
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::transfer::{BackendTransport, ChunkEnd, PoolLayout, Registration, Sender};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};

use super::synth::POISON;

/// Prefill ranks.
pub const N: u32 = 2;
/// Pages of each prefill rank's pool.
pub const PREFILL_PAGES: u64 = 48;
/// Pages of the decode pool.
pub const DECODE_PAGES: u64 = 128;

/// The cache: FP8 latent rows, a shared-indexer layer, the MTP draft.
pub fn geometry() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        vec![true, false, true],
    ))
}

// ---------------------------------------------------------------------------------------------
// The requests both sides derive from the seed

/// One request: the decode's registration, the prefill's logical page of every position, and
/// where its chunks end.
#[derive(Debug, Clone)]
pub struct Request {
    /// The decode's registration.
    pub registration: Registration,
    /// The prefill's logical page of every position.
    pub src_pages: Vec<LogicalPage>,
    /// Where its chunks end.
    pub chunks: Vec<ChunkEnd>,
}

/// A request's pages, cached prefix pages, and chunk ends as (tokens, final).
pub type Shape = (usize, usize, Vec<(usize, bool)>);

/// Requests of (pages, cached prefix pages, chunk ends as (tokens, final)): several chunks,
/// a cached prefix, a one-page request (a rank owns nothing: its empty final chunk), and one
/// larger than a bounce slot.
pub fn requests(seed: u64) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut logical: Vec<u64> = (u64::from(N)..PREFILL_PAGES * u64::from(N)).collect();
    logical.shuffle(&mut rng);
    let mut decode: Vec<u64> = (1..DECODE_PAGES).collect();
    decode.shuffle(&mut rng);
    let shapes: [Shape; 5] = [
        (
            11,
            0,
            vec![(3 * 64, false), (7 * 64 + 5, false), (11 * 64 - 30, true)],
        ),
        (9, 0, vec![(2 * 64 + 1, false), (9 * 64, true)]),
        (6, 2, vec![(4 * 64, false), (6 * 64, true)]),
        (1, 0, vec![(40, true)]),
        (20, 0, vec![(20 * 64, true)]),
    ];
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (pages, prefix, chunks))| {
            let src_pages = logical.drain(..pages).map(LogicalPage).collect();
            let state: Vec<LocalPage> = decode.drain(..pages).map(LocalPage).collect();
            let kv: Vec<LocalPage> = decode.drain(..pages - prefix).map(LocalPage).collect();
            Request {
                registration: Registration {
                    request: i as u64 + 1,
                    layout: PoolLayout::packed(geometry(), DECODE_PAGES),
                    prefix_pages: prefix,
                    pages: kv,
                    state_pages: state,
                },
                src_pages,
                chunks: chunks
                    .into_iter()
                    .map(|(t, last)| {
                        if last {
                            ChunkEnd::Final(t)
                        } else {
                            ChunkEnd::Partial(t)
                        }
                    })
                    .collect(),
            }
        })
        .collect()
}

/// Rank `rank`'s pool contents: random, never all zero.
pub fn pool_bytes(seed: u64, rank: u32, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    StdRng::seed_from_u64(seed ^ (u64::from(rank) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .fill_bytes(&mut bytes);
    bytes
}

pub fn prefill_pool(backend: &dyn Backend, seed: u64, rank: u32) -> Arc<DevicePool> {
    let pool = DevicePool::allocate_registrable(
        backend,
        &geometry(),
        Placement::new(N).expect("placement"),
        rank,
        PREFILL_PAGES,
    )
    .expect("prefill pool");
    let storage = pool.storage().expect("allocated pool").clone();
    backend
        .write_sync(&storage, 0, &pool_bytes(seed, rank, storage.len()))
        .expect("fill");
    Arc::new(pool)
}

pub fn decode_pool(backend: &dyn Backend) -> Arc<DevicePool> {
    let pool = DevicePool::allocate_registrable(
        backend,
        &geometry(),
        Placement::unsharded(),
        0,
        DECODE_PAGES,
    )
    .expect("decode pool");
    pool.fill(backend, POISON).expect("poison");
    backend.synchronize().expect("sync");
    Arc::new(pool)
}

/// The decode pool after sending `requests` (all of them, or the first `upto`) in one process.
pub fn reference(seed: u64, requests: &[Request]) -> Vec<u8> {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let dst = decode_pool(backend.as_ref());
    let remote = Arc::new(RemoteSpace::of(dst.clone(), geometry()).expect("remote"));
    for rank in 0..N {
        let pool = prefill_pool(backend.as_ref(), seed, rank);
        let mut sender = Sender::new(pool, Box::new(BackendTransport::new(backend.clone())));
        for r in requests {
            sender
                .open(r.registration.clone(), remote.clone())
                .expect("open");
            for &end in &r.chunks {
                sender
                    .send(r.registration.request, &r.src_pages, end)
                    .expect("send")
                    .wait_sync()
                    .expect("landed");
            }
        }
    }
    dst.snapshot_sync(backend.as_ref()).expect("snapshot")
}

/// Page `page` of every layer of a decode pool snapshot, in `read_pages_sync`'s order.
pub fn page_of(snapshot: &[u8], pool: &DevicePool, page: LocalPage) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for c in pool.geometry().components() {
        let layer = pool.pages() as usize * c.block_bytes;
        for l in 0..c.layers() {
            let start = at + l * layer + page.0 as usize * c.block_bytes;
            out.extend_from_slice(&snapshot[start..start + c.block_bytes]);
        }
        at += c.layers() * layer;
    }
    out
}
