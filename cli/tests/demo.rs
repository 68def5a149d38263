//! The end-to-end demos check every hand-off themselves; these run them across shard sizes, chunk
//! shapes (a final partial page, a single chunk) and HiCache routes on the CPU, and on the GPU
//! with the staged HiCache path they use there and the other routes: the one-request demo and
//! the pressure scenario in one process.

mod common;

use std::sync::Arc;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::Backend;
use kvshard::copy::Method;
use kvshard::hicache::Route;
use kvshard::Error;
use kvshard_cli::demo::{run, run_pressure, Config, Summary};
use kvshard_cli::scenario::{Platform, PressureConfig, Shape};

fn config(ranks: u32, tokens: usize, chunk: usize, draft: bool) -> Config {
    Config {
        shape: Shape {
            ranks,
            layers: 5,
            draft,
            seed: 3,
        },
        tokens,
        chunk,
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
            let summary = run_on_cpu(&config(ranks, tokens, chunk, draft), Platform::Cpu.route())
                .unwrap_or_else(|e| panic!("N={ranks}, {tokens} tokens by {chunk}: {e}"));
            assert_passed(&summary);
        }
    }
}

#[test]
fn demo_passes_on_the_cpu_with_every_hicache_route() {
    // The kernel's host-I/O shape on the CPU twin (each run makes its own backend).
    let cpu = CpuBackend::new();
    let routes = [
        Route::Direct(Method::host_io(&cpu, 2)),
        Route::Direct(Method::CopyEngine),
        Route::Direct(Method::PerBlock),
        Route::Direct(Method::BatchedCopyEngine),
        Route::Staged(Method::host_io(&cpu, 4)),
        Route::Staged(Method::CopyEngine),
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
/// between the demo's streams would show as wrong bytes.
#[test]
fn demo_passes_on_a_deferred_cpu_backend() {
    let cpu = CpuBackend::deferred();
    let streams = || -> kvshard::Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
    let summary = run(
        Arc::new(cpu.new_stream()),
        &streams,
        &config(4, 1000, 256, true),
        Platform::Cpu.route(),
    )
    .unwrap();
    assert_passed(&summary);
}

#[test]
fn demo_refuses_a_chunk_that_is_not_whole_pages_and_a_shape_out_of_bounds() {
    for (tokens, chunk) in [(100, 100), (100, 0), (0, 64)] {
        let e = run_on_cpu(&config(2, tokens, chunk, false), Platform::Cpu.route()).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)),
            "{tokens} tokens by {chunk}: {e}"
        );
    }
    let e = run_on_cpu(&config(0, 64, 64, false), Platform::Cpu.route()).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
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
            Platform::Gpu.route(),
        )
        .unwrap_or_else(|e| panic!("N={ranks}: {e}"));
        assert_passed(&summary);
    }
    let gpu_stream = common::stream(&gpu);
    for route in [
        Route::Staged(Method::host_io(gpu_stream.as_ref(), 8)),
        Route::Direct(Method::host_io(gpu_stream.as_ref(), 2)),
        Route::Direct(Method::CopyEngine),
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

// ---------------------------------------------------------------------------------------------
// The pressure scenario in one process.

#[test]
fn pressure_demo_passes_on_the_cpu() {
    let cpu = CpuBackend::new();
    let streams = || -> kvshard::Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
    let default = PressureConfig::default_for(Platform::Cpu);
    let with = |ranks: u32, draft: bool, chunk: usize| PressureConfig {
        shape: Shape {
            ranks,
            draft,
            ..default.shape.clone()
        },
        chunk,
        ..default.clone()
    };
    for cfg in [default.clone(), with(4, false, 4096), with(1, true, 2048)] {
        let summary = run_pressure(
            Arc::new(cpu.new_stream()),
            &streams,
            &cfg,
            Platform::Cpu.route(),
        )
        .unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
        let text = summary.lines.join("\n");
        assert!(
            text.contains("evicting node 1"),
            "the prompts evict the prefix:\n{text}"
        );
        assert!(text.contains("H2D grew from 0 to"), "{text}");
        // The storage step: run (L2 -> L3 -> L2 -> L1, then L3 into CP 2N; checked) where the
        // `nixl` feature and runtime are there (required when KVSHARD_REQUIRE_NIXL is set),
        // else said skipped.
        let required = cfg!(feature = "nixl") && std::env::var_os("KVSHARD_REQUIRE_NIXL").is_some();
        if required {
            assert!(
                text.contains("reloaded L3 -> L2")
                    && text.contains("byte-identical to the unsharded reference (verified"),
                "{text}"
            );
            // Then into a CP group of twice the size from disk, every reader rank here.
            let n = cfg.shape.ranks;
            let readers: Vec<u32> = (0..2 * n).collect();
            let pages = cfg.prefix_tokens / 64;
            let wider = format!(
                "storage: the CP{n}-written prefix reloaded into CP{} (disk -> host -> device, reader ranks {readers:?} here, {pages} of its {pages} pages, each page read by one reader, at most {} by one): byte-identical to the unsharded reference (",
                2 * n,
                (pages as u32).div_ceil(2 * n)
            );
            assert!(text.contains(&wider), "{wider}\n{text}");
        } else {
            assert!(text.contains("storage: "), "{text}");
        }
        assert_eq!(
            summary.lines.last().map(String::as_str),
            Some("pressure scenario: every check passed")
        );
        assert_eq!(
            text.contains("its prefix was gathered"),
            cfg.shape.ranks > 1,
            "{text}"
        );
    }
    // A scenario without pressure, or where a prompt cannot fit, is refused up front.
    for cfg in [
        PressureConfig {
            prompt_tokens: 6000,
            ..default.clone()
        },
        PressureConfig {
            prompt_tokens: 20_000,
            ..default.clone()
        },
        with(3, true, 2048),
        PressureConfig {
            prefix_tokens: 100,
            ..default.clone()
        },
    ] {
        let e = run_pressure(
            Arc::new(cpu.new_stream()),
            &streams,
            &cfg,
            Platform::Cpu.route(),
        )
        .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{cfg:?}: {e}");
    }
}

#[test]
fn gpu_pressure_demo_passes_at_the_stated_shape() {
    let Some(gpu) = common::open_gpu("gpu_pressure_demo_passes_at_the_stated_shape") else {
        return;
    };
    let streams = || -> kvshard::Result<Arc<dyn Backend>> { Ok(common::stream(&gpu)) };
    let cfg = PressureConfig::default_for(Platform::Gpu);
    let summary = run_pressure(streams().unwrap(), &streams, &cfg, Platform::Gpu.route()).unwrap();
    assert_eq!(
        summary.lines.last().map(String::as_str),
        Some("pressure scenario: every check passed")
    );
}

/// `kvshard storage-bench`'s end-to-end row on the CPU: a prefix (16 pages here) goes device ->
/// host -> storage, then comes back to the device from the host and from storage via the host,
/// byte-identical (checked inside `prefix_row`), both timed. Needs the NIXL runtime (required
/// when KVSHARD_REQUIRE_NIXL is set); the directory is under the target directory (O_DIRECT).
#[cfg(feature = "nixl")]
#[test]
fn storage_end_to_end_row_reloads_a_prefix_byte_identical_on_the_cpu() {
    if let Err(e) = kvshard::transfer::nixl::load() {
        assert!(
            std::env::var_os("KVSHARD_REQUIRE_NIXL").is_none(),
            "KVSHARD_REQUIRE_NIXL is set but {e}"
        );
        eprintln!("SKIPPED: {e}");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let target = exe
        .ancestors()
        .find(|p| p.file_name().is_some_and(|n| n == "target"))
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let dir = target.join("storage-tests").join("e2e-row");
    let _ = std::fs::remove_dir_all(&dir);
    let cpu = CpuBackend::new();
    let b: Arc<dyn Backend> = Arc::new(cpu.new_stream());
    let streams = || -> kvshard::Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
    let shape = Shape {
        ranks: 1,
        layers: 4,
        draft: true,
        seed: 0,
    };
    let g = shape.geometry();
    let row = kvshard_cli::storage_e2e::prefix_row(&b, &streams, &g, 1000, &dir, false).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!((row.tokens, row.pages), (1000, 16));
    assert_eq!(row.bytes, 16 * g.page_bytes() as u64);
    assert!(row.from_storage() >= row.prefetch && !row.prefetch.is_zero());
    let table = kvshard_cli::storage_e2e::render(&[row], b.name());
    assert!(table.contains("| 1000 tokens | 16 |"), "{table}");
}
