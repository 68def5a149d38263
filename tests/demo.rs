//! The end-to-end demo checks every hand-off itself; these run it across shard sizes and chunk
//! shapes (a final partial page, a single chunk) on the CPU, and on the GPU with the staged
//! HiCache path.

mod common;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::cuda::CudaBackend;
use kvshard::demo::{run, Config};

fn config(ranks: u32, tokens: usize, chunk: usize, draft: bool) -> Config {
    Config {
        ranks,
        layers: 5,
        draft,
        tokens,
        chunk,
        seed: 3,
    }
}

#[test]
fn demo_passes_on_the_cpu_for_every_shard_size() {
    let b = CpuBackend::new();
    for ranks in [1, 2, 4, 8] {
        for (tokens, chunk, draft) in [(1000, 256, true), (64, 64, false), (3000, 3008, true)] {
            let summary = run(
                &b,
                &b.new_stream(),
                &config(ranks, tokens, chunk, draft),
                false,
            )
            .unwrap_or_else(|e| panic!("N={ranks}, {tokens} tokens by {chunk}: {e}"));
            assert_eq!(
                summary.lines.last().map(String::as_str),
                Some("demo: every check passed")
            );
        }
    }
}

#[test]
fn demo_refuses_a_chunk_that_is_not_whole_pages() {
    let b = CpuBackend::new();
    assert!(run(&b, &b.new_stream(), &config(2, 100, 100, false), false).is_err());
}

#[test]
fn gpu_demo_passes_with_the_staged_hicache_path() {
    let Some(gpu) = common::cuda("gpu_demo_passes_with_the_staged_hicache_path") else {
        return;
    };
    let relayout = CudaBackend::new(gpu.gpu().clone()).unwrap();
    for ranks in [2, 4] {
        let summary = run(&gpu, &relayout, &config(ranks, 5000, 1024, true), true).unwrap();
        assert_eq!(
            summary.lines.last().map(String::as_str),
            Some("demo: every check passed")
        );
    }
}
