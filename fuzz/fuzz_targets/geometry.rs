//! Geometry from arbitrary fields (they describe the other side of a transfer, so nothing is
//! trusted): computing sizes never panics, and validation refuses what kvshard cannot move.
#![no_main]

use arbitrary::Arbitrary;
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Pool {
    layout: u8,
    page_size: usize,
    head_dim: usize,
    quant_block: usize,
    indexer_layers: Vec<bool>,
}

fn pool(p: Pool) -> PoolGeometry {
    let latent = LatentLayout::ALL[usize::from(p.layout) % LatentLayout::ALL.len()];
    let mut g = PoolGeometry::with_indexer_layers(latent, p.indexer_layers.into_iter().take(256).collect());
    g.page_size = p.page_size;
    g.indexer_head_dim = p.head_dim;
    g.indexer_quant_block = p.quant_block;
    g
}

fuzz_target!(|input: (Pool, Option<Pool>, Pool, Option<Pool>)| {
    let (a, ad, b, bd) = input;
    let prefill = CacheGeometry { target: pool(a), draft: ad.map(pool) };
    let decode = CacheGeometry { target: pool(b), draft: bd.map(pool) };
    for g in [&prefill, &decode] {
        let _ = g.page_bytes();
        let _ = g.page_bytes_checked();
        let components = g.components();
        if g.validate().is_ok() {
            assert!(g.page_bytes_checked().is_ok());
            assert!(components.iter().all(|c| c.block_bytes > 0 && c.layers() > 0));
        }
    }
    if prefill.validate_pd(&decode).is_ok() {
        assert_eq!(prefill.components(), decode.components());
    }
});
