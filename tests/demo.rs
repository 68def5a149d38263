//! The end-to-end demo checks every hand-off itself; these run it across shard sizes, chunk
//! shapes (a final partial page, a single chunk) and HiCache routes on the CPU, and on the GPU
//! with the staged HiCache path it uses there and the other routes.

mod common;

use std::sync::Arc;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::Backend;
use kvshard::demo::{default_route, run, Config, Summary};
use kvshard::hicache::{IoBackend, Relayout, Route};

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

/// Runs the demo on a fresh CPU backend, every stream a stream of its arena.
fn run_on_cpu(cfg: &Config, route: Route) -> kvshard::Result<Summary> {
    let cpu = CpuBackend::new();
    let streams = || -> kvshard::Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
    run(Arc::new(cpu.new_stream()), &streams, cfg, route)
}

fn assert_passed(summary: &Summary) {
    assert_eq!(
        summary.lines.last().map(String::as_str),
        Some("demo: every check passed")
    );
}

#[test]
fn demo_passes_on_the_cpu_for_every_shard_size() {
    for ranks in [1, 2, 4, 8] {
        for (tokens, chunk, draft) in [(1000, 256, true), (64, 64, false), (3000, 3008, true)] {
            let summary = run_on_cpu(&config(ranks, tokens, chunk, draft), default_route(false))
                .unwrap_or_else(|e| panic!("N={ranks}, {tokens} tokens by {chunk}: {e}"));
            assert_passed(&summary);
        }
    }
}

#[test]
fn demo_passes_on_the_cpu_with_every_hicache_route() {
    let routes = [
        Route::Direct(IoBackend::SmKernel { ctas: 2 }),
        Route::Direct(IoBackend::CopyEngine),
        Route::Direct(IoBackend::PerBlockMemcpy),
        Route::Direct(IoBackend::BatchMemcpy),
        Route::Staged(Relayout::Kernel { ctas: 4 }),
        Route::Staged(Relayout::CopyEngine),
    ];
    for route in routes {
        let summary = run_on_cpu(&config(4, 1000, 256, true), route)
            .unwrap_or_else(|e| panic!("{route}: {e}"));
        assert_passed(&summary);
        assert!(
            summary
                .lines
                .iter()
                .any(|l| l.contains(&format!("HiCache ({route})"))),
            "{route}: {:?}",
            summary.lines
        );
    }
}

/// On a deferred CPU backend work runs only when something waits for it, so a missing wait
/// between the demo's streams would show as wrong bytes. It cannot run yet: the demo times every
/// stage with `Backend::elapsed_ms`, which refuses the events of a deferred arena.
#[test]
fn demo_passes_on_a_deferred_cpu_backend() {
    let cpu = CpuBackend::deferred();
    let streams = || -> kvshard::Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
    let summary = run(
        Arc::new(cpu.new_stream()),
        &streams,
        &config(4, 1000, 256, true),
        default_route(false),
    )
    .unwrap();
    assert_passed(&summary);
}

#[test]
fn demo_refuses_a_chunk_that_is_not_whole_pages() {
    for (tokens, chunk) in [(100, 100), (100, 0), (0, 64)] {
        assert!(
            run_on_cpu(&config(2, tokens, chunk, false), default_route(false)).is_err(),
            "{tokens} tokens by {chunk}"
        );
    }
}

#[test]
fn gpu_demo_passes_with_the_staged_hicache_path() {
    let Some(gpu) = common::open_gpu("gpu_demo_passes_with_the_staged_hicache_path") else {
        return;
    };
    let streams = || -> kvshard::Result<Arc<dyn Backend>> { Ok(common::stream(&gpu)) };
    for ranks in [2, 4] {
        let summary = run(
            common::stream(&gpu),
            &streams,
            &config(ranks, 5000, 1024, true),
            default_route(true),
        )
        .unwrap_or_else(|e| panic!("N={ranks}: {e}"));
        assert_passed(&summary);
    }
    for route in [
        Route::Staged(Relayout::Kernel { ctas: 8 }),
        Route::Direct(IoBackend::SmKernel { ctas: 2 }),
        Route::Direct(IoBackend::CopyEngine),
    ] {
        let summary = run(
            common::stream(&gpu),
            &streams,
            &config(4, 5000, 1024, true),
            route,
        )
        .unwrap_or_else(|e| panic!("{route}: {e}"));
        assert_passed(&summary);
    }
}
