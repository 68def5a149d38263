//! [`Method`]: the one vocabulary for how bytes move, on every route that moves them (P/D
//! sends in process or into a peer-mapped pool, HiCache transfers straight between the pools,
//! and the relayout of staged HiCache transfers). Each route takes the methods it can run and
//! refuses the others with [`Error::UnsupportedMethod`](crate::Error::UnsupportedMethod) before
//! it enqueues anything.

use std::fmt;

use crate::backend::{Backend, KernelFamily, Launch};
use crate::{Error, Result};

/// How a route moves bytes: a copy kernel with its launch shape, or copy-engine calls.
///
/// | method | P/D ([`BackendTransport`](crate::transfer::BackendTransport)) | HiCache direct | HiCache staged relayout |
/// |---|---|---|---|
/// | [`Kernel`](Method::Kernel) | one launch per section | one launch (ready counters on loads) | one launch per segment |
/// | [`RangeKernel`](Method::RangeKernel) | one launch per chunk | - | - |
/// | [`CopyEngine`](Method::CopyEngine) | one batch call over the coalesced ranges | coalesced runs, 2D over layers | 2D copies per page |
/// | [`BatchedCopyEngine`](Method::BatchedCopyEngine) | - | one batch call holding every block | - |
/// | [`PerBlock`](Method::PerBlock) | one copy per (page, layer) block | one copy per block | - |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// The block-copy kernel (`kvs_copy_blocks`) from page lists, with this launch shape: the
    /// smallest upload, whatever the number of pages and layers. Each CTA takes an SM from the
    /// forward pass while it runs.
    Kernel(Launch),
    /// The range kernel (`kvs_copy_ranges`) over absolute address ranges, with this launch
    /// shape, ranges longer than
    /// [`KERNEL_PIECE_BYTES`](crate::advanced::KERNEL_PIECE_BYTES) split first.
    RangeKernel(Launch),
    /// Coalesced copy-engine copies: few, large pieces (one `memcpy_batch`,
    /// `cudaMemcpyBatchAsync` on the GPU, over a chunk's coalesced ranges; 2D copies over
    /// layers where the layer stride is uniform). No SM at all.
    CopyEngine,
    /// One `cuMemcpyBatchAsync` holding every block, uncoalesced: a baseline.
    BatchedCopyEngine,
    /// One copy-engine copy per (page, layer, component) block: the naive baseline, what a
    /// transfer engine posting one descriptor per block does.
    PerBlock,
}

/// The narrow grid of [`Method::default_for`]: 264 CTAs (two per H200 SM) of 512 threads, one
/// wave (the copy kernels' 64 registers a thread leave room for 1,024 resident threads an SM).
const NARROW: Launch = Launch {
    ctas: 264,
    threads: 512,
};

/// The wide grid of [`Method::for_blocks`]: 1,056 CTAs (eight per H200 SM) of 256 threads, two
/// waves of four CTAs an SM.
const WIDE: Launch = Launch {
    ctas: 1056,
    threads: 256,
};

/// The grid of [`Method::for_decode_scatter`]: 264 CTAs (two per H200 SM) of 256 threads, one
/// wave of 16 warps an SM.
const DECODE: Launch = Launch {
    ctas: 264,
    threads: 256,
};

/// Blocks ((page, layer pair) units of `kvs_copy_blocks`) above which [`Method::for_blocks`]
/// launches the wide grid: the narrow grid's warps (264 x 512 / 32). Up to them the narrow grid
/// gives every block a warp of its one resident wave; past them its warps take blocks one after
/// another, and the wide grid's two waves of four 256-thread CTAs an SM finished the same
/// blocks sooner (H200, 2026-12-02 at 01e02be: 7,936 blocks 85.3% of D2D against 82.7%,
/// 63,488 blocks equal at 93.9%, 992 blocks 43.9% against 50.4%).
pub const WIDE_GRID_BLOCKS: u64 = (NARROW.ctas as u64) * (NARROW.threads as u64) / 32;

impl Method {
    /// The block kernel with kvshard's grid for a launch of unknown size on `backend`: 264 CTAs
    /// (two per H200 SM) of 512 threads, measured at 91-95% of the device-to-device copy for
    /// 512+ page chunks (BENCHMARKS.md). [`Method::for_blocks`] picks per launch.
    pub fn default_for(backend: &dyn Backend) -> Self {
        Self::Kernel(Launch {
            ctas: NARROW.ctas,
            threads: backend.max_threads(KernelFamily::Copy).min(NARROW.threads),
        })
    }

    /// The block kernel with the grid kvshard picks for a launch of `blocks` (page, layer
    /// pair) blocks on `backend`: [`Method::default_for`]'s narrow grid up to
    /// [`WIDE_GRID_BLOCKS`], 1,056 CTAs (eight per H200 SM) of 256 threads above. What
    /// [`BackendTransport::new`](crate::transfer::BackendTransport::new) launches each chunk
    /// with.
    pub fn for_blocks(backend: &dyn Backend, blocks: u64) -> Self {
        if blocks <= WIDE_GRID_BLOCKS {
            return Self::default_for(backend);
        }
        Self::Kernel(Launch {
            ctas: WIDE.ctas,
            threads: backend.max_threads(KernelFamily::Copy).min(WIDE.threads),
        })
    }

    /// The `kvs_decode_scatter` grid kvshard picks (what
    /// [`BackendTransport::new`](crate::transfer::BackendTransport::new) launches each chunk
    /// into a decode context-parallel layout with): 264 CTAs (two per H200 SM) of 256 threads,
    /// 16 warps an SM, each warp keeping 4 KB in flight. Both decode kernels write each warp's
    /// rows as streams of their own; the wide grid's 32 warps an SM kept the same bytes in
    /// flight in twice the streams and measured 1.4 (whole pages) to 2.3 (rows, I = 1)
    /// points of the device-to-device copy slower (H200, 2026-12-04, BENCHMARKS.md).
    pub fn for_decode_scatter(backend: &dyn Backend) -> Self {
        Self::Kernel(Launch {
            ctas: DECODE.ctas,
            threads: decode_threads(backend),
        })
    }

    /// [`Method::for_decode_scatter`]'s grid for launches of which `at_once` run on this GPU at
    /// the same time: prefill ranks sharing a process, each on a stream of its own writing
    /// through mappings of its own, so nothing orders one rank's launch after another's. Each
    /// launch takes 1/`at_once` of the CTAs (at least one). With the whole grid each, the first
    /// launch holds every SM until its work queue drains and the ranks run one after another;
    /// side by side, their writes to a decode page are in flight together (at I = 1 each rank
    /// writes 1/N of every decode page it touches). On the H200, two at once (half the grid
    /// each) took N = 2 and 4 prefill ranks past 90% of the device copy in every case measured;
    /// four at once was up to a point faster at 512 pages and one to two slower at 4,096
    /// (BENCHMARKS.md, the `dcp` section). `at_once` 0 is refused.
    pub fn for_decode_scatter_shared(backend: &dyn Backend, at_once: u32) -> Result<Self> {
        if at_once == 0 {
            return Err(Error::InvalidArgument(
                "for_decode_scatter_shared: at_once must be at least 1".into(),
            ));
        }
        Ok(Self::Kernel(Launch {
            ctas: (DECODE.ctas / at_once).max(1),
            threads: decode_threads(backend),
        }))
    }

    /// The block kernel in the host-I/O shape ([`Launch::host_io`]): `ctas` CTAs of as many
    /// threads as `backend`'s copy kernels take. What HiCache kernels run with (two CTAs
    /// saturate PCIe).
    pub fn host_io(backend: &dyn Backend, ctas: u32) -> Self {
        Self::Kernel(Launch::host_io(backend, ctas))
    }

    /// The launch shape of a kernel method; `None` for the copy engine.
    pub fn launch(&self) -> Option<Launch> {
        match self {
            Self::Kernel(l) | Self::RangeKernel(l) => Some(*l),
            Self::CopyEngine | Self::BatchedCopyEngine | Self::PerBlock => None,
        }
    }
}

/// The decode grid's threads a CTA, as many as `backend`'s decode kernels take.
fn decode_threads(backend: &dyn Backend) -> u32 {
    backend
        .max_threads(KernelFamily::DecodeScatter)
        .min(DECODE.threads)
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Kernel(l) => write!(f, "block kernel ({} CTAs x {})", l.ctas, l.threads),
            Self::RangeKernel(l) => write!(f, "range kernel ({} CTAs x {})", l.ctas, l.threads),
            Self::CopyEngine => f.write_str("copy engine"),
            Self::BatchedCopyEngine => f.write_str("batched copy engine"),
            Self::PerBlock => f.write_str("per-block copies"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_launch() {
        let l = Launch {
            ctas: 2,
            threads: 64,
        };
        assert_eq!(Method::Kernel(l).to_string(), "block kernel (2 CTAs x 64)");
        assert_eq!(
            Method::RangeKernel(l).to_string(),
            "range kernel (2 CTAs x 64)"
        );
        assert_eq!(Method::RangeKernel(l).launch(), Some(l));
        for m in [
            Method::CopyEngine,
            Method::BatchedCopyEngine,
            Method::PerBlock,
        ] {
            assert_eq!(m.launch(), None, "{m}");
        }
        let cpu = crate::backend::cpu::CpuBackend::new();
        assert_eq!(
            Method::host_io(&cpu, 3),
            Method::Kernel(Launch::host_io(&cpu, 3))
        );
        assert!(matches!(Method::default_for(&cpu), Method::Kernel(l) if l.ctas == 264));
    }

    #[test]
    fn shared_decode_grid() {
        let cpu = crate::backend::cpu::CpuBackend::new();
        let whole = Method::for_decode_scatter(&cpu).launch().unwrap();
        for (at_once, ctas) in [(1, 264), (2, 132), (4, 66), (5, 52), (264, 1), (1000, 1)] {
            let shared = Method::for_decode_scatter_shared(&cpu, at_once).unwrap();
            assert_eq!(
                shared.launch(),
                Some(Launch {
                    ctas,
                    threads: whole.threads
                }),
                "{at_once} at once"
            );
        }
        assert!(matches!(
            Method::for_decode_scatter_shared(&cpu, 0),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn the_decode_scatter_grid_is_two_256_thread_ctas_an_h200_sm() {
        let cpu = crate::backend::cpu::CpuBackend::new();
        let Method::Kernel(l) = Method::for_decode_scatter(&cpu) else {
            panic!("not the block kernel");
        };
        assert_eq!((l.ctas, l.threads), (264, 256));
        l.validate(cpu.max_threads(KernelFamily::DecodeScatter))
            .unwrap();
    }

    #[test]
    fn for_blocks_widens_the_grid_past_the_narrow_grids_warps() {
        let cpu = crate::backend::cpu::CpuBackend::new();
        assert_eq!(WIDE_GRID_BLOCKS, 4224);
        for blocks in [0, 1, 992, 3968, WIDE_GRID_BLOCKS] {
            assert_eq!(
                Method::for_blocks(&cpu, blocks),
                Method::default_for(&cpu),
                "{blocks} blocks"
            );
        }
        for blocks in [WIDE_GRID_BLOCKS + 1, 7936, 63488, u64::MAX] {
            let Method::Kernel(l) = Method::for_blocks(&cpu, blocks) else {
                panic!("{blocks} blocks: not the block kernel");
            };
            assert_eq!((l.ctas, l.threads), (1056, 256), "{blocks} blocks");
            l.validate(cpu.max_threads(KernelFamily::Copy)).unwrap();
        }
    }
}
