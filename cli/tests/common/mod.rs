//! Shared by the applications' integration tests: the GPU when there is one (tests that need it
//! print SKIPPED otherwise, or fail when KVSHARD_REQUIRE_GPU=1 so a GPU run proves they ran),
//! seeded random generators, and the `kvshard` binary.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::Backend;
use kvshard::gpu::Gpu;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// The GPU, or `None` (after saying the test skipped) without one.
pub fn open_gpu(test: &str) -> Option<Arc<Gpu>> {
    static GPU: OnceLock<Result<Arc<Gpu>, String>> = OnceLock::new();
    match GPU.get_or_init(|| Gpu::open(0).map_err(|e| e.to_string())) {
        Ok(gpu) => Some(gpu.clone()),
        Err(why) => {
            assert!(
                std::env::var_os("KVSHARD_REQUIRE_GPU").is_none(),
                "{test}: KVSHARD_REQUIRE_GPU is set but no GPU is usable: {why}"
            );
            // Straight to stderr, not eprintln!: the test harness hides what passing tests print,
            // and a skip must be seen.
            let _ = writeln!(std::io::stderr(), "SKIPPED {test} on the GPU: {why}");
            None
        }
    }
}

/// A new stream of `gpu` as a shared backend.
pub fn stream(gpu: &Arc<Gpu>) -> Arc<dyn Backend> {
    Arc::new(CudaBackend::new(gpu.clone()).expect("CUDA stream"))
}

/// A seeded RNG; the seed is printed so a failure can be replayed with KVSHARD_SEED.
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("KVSHARD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("{test}: KVSHARD_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// The `kvshard` binary: `KVSHARD_BIN` names another (the GPU staging's), else cargo's build of
/// this crate's.
pub fn kvshard_bin() -> PathBuf {
    std::env::var_os("KVSHARD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_kvshard").into())
}
