//! Shared by the integration tests: the CUDA backend when a GPU is present (tests that need it
//! print SKIPPED otherwise, or fail when KVSHARD_REQUIRE_GPU=1 so a GPU run proves they ran),
//! seeded random generators, and [`on_cpu_and_gpu!`], which states a behaviour once and runs
//! it on the CPU twin and on the GPU.
// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

pub mod dcp;
pub mod faults;
pub mod pd;
pub mod source;
// The storage tier's binaries (feature `nixl`: tests/storage.rs, tests/faults_storage.rs).
#[cfg(feature = "nixl")]
pub mod storage;
pub mod synth;

use std::fmt;
use std::io::Write;
use std::sync::{Arc, OnceLock};

use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::Backend;
use kvshard::gpu::Gpu;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// The block kernel in HiCache's host-I/O shape: `ctas` CTAs of as many threads as the copy
/// kernels were compiled for, what [`kvshard::copy::Method::host_io`] picks on the CPU twin and the
/// H200; a constant, so that route tables can be.
pub const fn host_io(ctas: u32) -> kvshard::copy::Method {
    kvshard::copy::Method::Kernel(kvshard::backend::Launch {
        ctas,
        threads: kvshard::abi::KVS_COPY_THREADS,
    })
}

fn gpu() -> Option<Arc<Gpu>> {
    static GPU: OnceLock<Result<Arc<Gpu>, String>> = OnceLock::new();
    GPU.get_or_init(|| Gpu::open(0).map_err(|e| e.to_string()))
        .clone()
        .ok()
}

/// A CUDA backend on a fresh stream, or `None` (after saying the test skipped) without a GPU.
pub fn cuda(test: &str) -> Option<CudaBackend> {
    open_gpu(test).map(|gpu| CudaBackend::new(gpu).expect("CUDA backend"))
}

/// The same, shared: what pools, transports and controllers take.
pub fn cuda_arc(test: &str) -> Option<Arc<dyn Backend>> {
    cuda(test).map(|b| Arc::new(b) as Arc<dyn Backend>)
}

/// The GPU, or `None` (after saying the test skipped) without one.
pub fn open_gpu(test: &str) -> Option<Arc<Gpu>> {
    match gpu() {
        Some(gpu) => Some(gpu),
        None => {
            let why = Gpu::open(0)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
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

/// A seed, random unless KVSHARD_SEED names one; printed so a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("KVSHARD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("{test}: KVSHARD_SEED={seed}");
    seed
}

/// A seeded RNG; the seed is printed so a failure can be replayed with KVSHARD_SEED.
pub fn rng(test: &str) -> StdRng {
    StdRng::seed_from_u64(seed(test))
}

/// The device a behaviour of [`on_cpu_and_gpu!`] runs on, the CPU twin or the GPU, and the
/// test's seed. Streams of one device share its memory, as an engine's streams do.
pub struct Device {
    on: On,
    seed: u64,
}

enum On {
    Cpu(CpuBackend),
    Gpu(Arc<Gpu>),
}

impl Device {
    /// A new stream of the device.
    pub fn stream(&self) -> Arc<dyn Backend> {
        match &self.on {
            On::Cpu(cpu) => Arc::new(cpu.new_stream()),
            On::Gpu(gpu) => stream(gpu),
        }
    }

    /// A new stream of the CPU twin as its own type (what needs the twin's host addresses, as
    /// a transfer engine moves them), or `None` on the GPU.
    pub fn cpu_stream(&self) -> Option<Arc<CpuBackend>> {
        match &self.on {
            On::Cpu(cpu) => Some(Arc::new(cpu.new_stream())),
            On::Gpu(_) => None,
        }
    }

    /// Whether this is the GPU: for the few shapes a behaviour needs only there (work that keeps
    /// a GPU stream busy; the CPU twin runs nothing until something waits).
    pub fn is_gpu(&self) -> bool {
        matches!(self.on, On::Gpu(_))
    }

    /// An RNG from the test's seed: the same on the CPU twin and on the GPU, so that both make
    /// the same data.
    pub fn rng(&self) -> StdRng {
        StdRng::seed_from_u64(self.seed)
    }
}

/// What assertion messages name: the GPU, or the CPU twin and its stream order.
impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.on {
            On::Cpu(cpu) => write!(f, "the CPU twin ({:?})", cpu.order()),
            On::Gpu(gpu) => write!(f, "{}", gpu.info().name),
        }
    }
}

/// Runs `body` on the CPU twin: once per order of `orders`, or, when it names none, once in the
/// order every test process runs in (`KVSHARD_CPU_STREAMS`, .cargo/config.toml).
pub fn run_on_cpu(test: &str, orders: &[StreamOrder], body: impl Fn(Device)) {
    let seed = seed(test);
    let cpus: Vec<CpuBackend> = if orders.is_empty() {
        vec![CpuBackend::new()]
    } else {
        orders.iter().map(|&o| CpuBackend::with_order(o)).collect()
    };
    for cpu in cpus {
        body(Device {
            on: On::Cpu(cpu),
            seed,
        });
    }
}

/// Taken for reading by every GPU test run through [`run_on_gpu`] / [`run_on_gpu_against_cpu`],
/// and for writing ([`device_alone`]) by a test that times the host against queued device work:
/// another test's driver call beside it (a free the driver makes wait for the whole device
/// holds every thread's CUDA calls) would be timed as its own.
static DEVICE_WIDE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// The device to this test alone among the test binary's GPU tests (see [`DEVICE_WIDE`]).
pub fn device_alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    DEVICE_WIDE.write().unwrap_or_else(|e| e.into_inner())
}

/// The device shared with the binary's other GPU tests, but with none that runs alone.
pub fn device_shared() -> std::sync::RwLockReadGuard<'static, ()> {
    DEVICE_WIDE.read().unwrap_or_else(|e| e.into_inner())
}

/// Runs `body` on the GPU, or skips (saying so; failing under KVSHARD_REQUIRE_GPU) without one.
pub fn run_on_gpu(test: &str, body: impl Fn(Device)) {
    let _shared = device_shared();
    if let Some(gpu) = open_gpu(test) {
        body(Device {
            on: On::Gpu(gpu),
            seed: seed(test),
        });
    }
}

/// [`run_on_gpu`], then the same on the CPU twin with the same seed: what the GPU made must
/// equal what the twin made.
pub fn run_on_gpu_against_cpu<T: PartialEq>(test: &str, body: impl Fn(Device) -> T) {
    let _shared = device_shared();
    let Some(gpu) = open_gpu(test) else {
        return;
    };
    let seed = seed(test);
    let got = body(Device {
        on: On::Gpu(gpu),
        seed,
    });
    let want = body(Device {
        on: On::Cpu(CpuBackend::new()),
        seed,
    });
    assert!(
        got == want,
        "{test}: the GPU's result differs from the CPU twin's"
    );
}

/// One behaviour, stated once, as two tests: `cpu_NAME` runs the body on the CPU twin and
/// `gpu_NAME` on the GPU (SKIPPED without one, or failing when KVSHARD_REQUIRE_GPU is set; the
/// GPU scripts select these by their `gpu_` prefix). The body is a closure of a [`Device`]:
///
/// ```ignore
/// // What the behaviour is.
/// common::on_cpu_and_gpu!(a_behaviour, |device| {
///     // asserts, on device.stream()
/// });
/// ```
///
/// - `on_cpu_and_gpu!(name, ORDERS, |device| ..)` runs the CPU twin once per stream order of
///   `ORDERS`;
/// - `on_cpu_and_gpu!(name, |device| -> T { .. })` also returns what the device made (its
///   bytes): `gpu_NAME` then runs the body on the CPU twin too, from the same seed, and asserts
///   that both made the same.
///
/// Invoked with parentheses, so that rustfmt formats the body; its description is a plain
/// comment above it (rustdoc documents no macro invocation).
// As the whole module: not every test binary that includes it uses it.
#[allow(unused_macros)]
macro_rules! on_cpu_and_gpu {
    ($name:ident, |$device:ident| $body:block) => {
        ::pastey::paste! {
            #[test]
            fn [<cpu_ $name>]() {
                $crate::common::run_on_cpu(concat!("cpu_", stringify!($name)), &[], |$device| $body);
            }

            #[test]
            fn [<gpu_ $name>]() {
                $crate::common::run_on_gpu(concat!("gpu_", stringify!($name)), |$device| $body);
            }
        }
    };
    ($name:ident, |$device:ident| -> $out:ty $body:block) => {
        ::pastey::paste! {
            #[test]
            fn [<cpu_ $name>]() {
                // The body asserts what it made; only the GPU has a twin to compare it with.
                $crate::common::run_on_cpu(concat!("cpu_", stringify!($name)), &[], |$device| {
                    let _: $out = $body;
                });
            }

            #[test]
            fn [<gpu_ $name>]() {
                $crate::common::run_on_gpu_against_cpu(
                    concat!("gpu_", stringify!($name)),
                    |$device| -> $out { $body },
                );
            }
        }
    };
    ($name:ident, $orders:expr, |$device:ident| $body:block) => {
        ::pastey::paste! {
            #[test]
            fn [<cpu_ $name>]() {
                $crate::common::run_on_cpu(concat!("cpu_", stringify!($name)), &$orders, |$device| $body);
            }

            #[test]
            fn [<gpu_ $name>]() {
                $crate::common::run_on_gpu(concat!("gpu_", stringify!($name)), |$device| $body);
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use on_cpu_and_gpu;
