//! The kernels a build embeds. Without nvcc 13.0 at build time the crate still builds (build.rs
//! sets `cfg(kvshard_no_kernels)`) and embeds none, and opening a GPU returns
//! `Error::KernelsMissing` before the driver is asked anything: every GPU entry point starts
//! from an opened `Gpu`. With feature `require-kernels` every kernel is embedded.
//!
//! Which build this is must come from outside, or a build that found nvcc where it should not
//! have would pass as the other kind: `KVSHARD_EXPECT_NO_KERNELS=1` says nvcc was hidden from the
//! build (.ci/run builds this test so, in a target directory of its own); feature
//! `require-kernels` says the kernels were built. With neither, the build may be either, and
//! only its consistency is checked.

use kvshard::gpu::{self, Gpu, Kernel};
use kvshard::Error;

#[test]
fn opening_a_gpu_says_whether_this_build_has_kernels() {
    let hidden = std::env::var_os("KVSHARD_EXPECT_NO_KERNELS").is_some();
    let required = cfg!(feature = "require-kernels");
    assert!(
        !(hidden && required),
        "KVSHARD_EXPECT_NO_KERNELS with feature `require-kernels`: such a build fails instead"
    );
    let archs = gpu::embedded_archs();
    if hidden {
        assert_eq!(
            archs, None,
            "kernels were built although the build was to find no nvcc (one on the PATH?)"
        );
    }
    if required {
        assert!(archs.is_some_and(|a| !a.is_empty()), "{archs:?}");
    }
    match archs {
        None => {
            assert_eq!(
                gpu::RESOURCE_USAGE,
                "",
                "a build without kernels reports none"
            );
            // The first check of all: an ordinal no machine has fails the same way.
            for ordinal in [0, 1 << 20] {
                let e = Gpu::open(ordinal).unwrap_err();
                assert!(matches!(e, Error::KernelsMissing), "GPU {ordinal}: {e}");
            }
        }
        Some(archs) => {
            for kernel in Kernel::ALL {
                assert!(
                    gpu::RESOURCE_USAGE.contains(kernel.name()),
                    "{archs}: no resource usage of {}",
                    kernel.name()
                );
            }
            // No driver, no GPU or an opened one: anything but missing kernels.
            if let Err(e) = Gpu::open(0) {
                assert!(!matches!(e, Error::KernelsMissing), "{archs} embedded: {e}");
            }
        }
    }
}
