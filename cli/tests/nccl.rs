//! The CP all-gather on two GPUs through NCCL (feature `nccl`): every rank's scratch, read
//! through the gather plan's page table, holds the unsharded pool's pages. It runs the GPU
//! benchmark's `allgather` harness (`benches/gpu/cp_gather.rs`), once, small. Skips, saying so,
//! without two GPUs or without NCCL (KVSHARD_REQUIRE_GPUS=2 turns that into a failure).
#![cfg(feature = "nccl")]

#[path = "../benches/gpu/cp_gather.rs"]
mod cp_gather;

use std::io::Write;

#[test]
fn gpu_two_gpu_nccl_all_gather_lands_every_prefix_page_where_the_page_table_says() {
    let shape = cp_gather::Shape {
        layers: 4,
        pages_per_rank: 40,
        requests: 3,
        prefix_pages: 7,
        ctas: 4,
        repeats: 1,
    };
    match cp_gather::two_gpu_gather(&shape).expect("the two-GPU gather") {
        Ok(f) => assert!(
            f.gathered_bytes > 0
                && f.block > 0
                && f.pack_gather.median > 0.0
                && f.pack_gather_view.window.median > 0.0
                && f.contiguous.median > 0.0
        ),
        Err(why) => {
            assert!(
                std::env::var_os("KVSHARD_REQUIRE_GPUS").is_none(),
                "KVSHARD_REQUIRE_GPUS is set but: {why}"
            );
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED gpu_two_gpu_nccl_all_gather: {why}"
            );
        }
    }
}
