/*
 * A kernel version that lost a benchmark, kept to read and to time again; nothing builds it
 * (build.rs compiles cuda/ only).
 *
 * What: kvs_copy_blocks with streaming cache hints. Every 16-byte load and store of a block
 *   copy evict-first (__ldcs / __stcs through common.cuh's load16_stream / store16_stream), so
 *   that a transfer would not push the forward pass's working set out of L2. Otherwise the
 *   kernel of its day: one warp per (page, pair) unit, grid-stride, 8 vectors a lane in flight.
 * Beaten by: the same kernel with plain loads and stores (6db65d4), then the work-queue kernel
 *   kept in cuda/copy.cu (1e0cdae).
 * By how much: BENCHMARKS.md, "Device pool copies" (H200, 576-byte rows, 62 layers, % of the
 *   in-run D2D ceiling, gather / scatter): 89.1 / 88.7 with the hints, 92.3 / 91.6 with plain
 *   loads, 93.7 / 92.9 kept: the hints cost 3 points against plain loads.
 * Source: cuda/copy.cu at 743bc10, lines 17-25 and 28-131, verbatim (the rest of that file,
 *   other jobs, left out); it builds against that commit's cuda/common.cuh and cuda/abi.h:
 *     mkdir -p /tmp/kvs-743bc10 && git archive 743bc10 cuda | tar -x -C /tmp/kvs-743bc10
 *     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I /tmp/kvs-743bc10/cuda benches/kernels/copy_blocks_streaming.cu
 * Time it: on an H200 (cargo, and the pinned nvcc from scripts/install-cuda.sh), with the GPU
 *   benchmark of the commit whose kernel it was:
 *     git worktree add /tmp/kvshard-743bc10 743bc10 && cd /tmp/kvshard-743bc10
 *     cargo bench --bench gpu -- pool
 * The kept kernel: the same section of today's GPU benchmark (docs/gpu.md, "Running on a GPU host").
 */
#include "common.cuh"

using namespace kvs;

namespace {

constexpr uint32_t UNROLL = 8;
/* Copy kernels may be launched with up to 1024 threads per CTA (host I/O wants few, fat CTAs). */
constexpr uint32_t MAX_THREADS = 1024;

/* Resolves entry j of a page list; false when the entry is skipped (padding, not owned, bad). */
__device__ __forceinline__ bool resolve_page(const kvs_page_list& list, uint64_t j, uint64_t& page,
                                             const kvs_status& status) {
    if (list.kind == KVS_INDEX_POSITION) {
        page = j;
    } else {
        const int64_t id = reinterpret_cast<const int64_t*>(list.ids)[j];
        if (id < 0) {
            return false;
        }
        if (list.kind == KVS_INDEX_LOGICAL) {
            if (page_owner(static_cast<uint64_t>(id), list.shard) != list.rank) {
                return false;
            }
            page = local_page(static_cast<uint64_t>(id), list.shard);
        } else {
            page = static_cast<uint64_t>(id);
        }
    }
    if (page >= list.limit) {
        report(status, j);
        return false;
    }
    return true;
}

/* One warp copies `vectors` 16-byte vectors; vector i sits at base + offset(i) on each side. */
template <typename Offset>
__device__ __forceinline__ void warp_copy(uint64_t src, uint64_t dst, uint32_t vectors, Offset src_offset,
                                          Offset dst_offset) {
    const uint32_t lane = threadIdx.x % 32;
    for (uint32_t v0 = lane; v0 < vectors; v0 += 32 * UNROLL) {
        vec16 r[UNROLL];
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            const uint32_t v = v0 + 32 * u;
            if (v < vectors) {
                r[u] = load16_stream(src + src_offset(v));
            }
        }
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            const uint32_t v = v0 + 32 * u;
            if (v < vectors) {
                store16_stream(dst + dst_offset(v), r[u]);
            }
        }
    }
}

struct Contiguous {
    __device__ __forceinline__ uint64_t operator()(uint32_t v) const { return 16ull * v; }
};

struct Strided {
    uint32_t vectors_per_row;
    uint64_t row_stride;
    __device__ __forceinline__ uint64_t operator()(uint32_t v) const {
        return (v / vectors_per_row) * row_stride + 16ull * (v % vectors_per_row);
    }
};

} // namespace

extern "C" __global__ void __launch_bounds__(MAX_THREADS) kvs_copy_blocks(const __grid_constant__ kvs_copy_blocks_params p) {
    const kvs_layer_pair* pairs = reinterpret_cast<const kvs_layer_pair*>(p.pairs);
    uint32_t* signals = reinterpret_cast<uint32_t*>(p.signals);
    const uint64_t units = p.num_pages * p.num_pairs;
    for (uint64_t u = global_warp(); u < units; u += grid_warps()) {
        const uint64_t k = u / p.num_pages;
        const uint64_t j = u - k * p.num_pages;
        const kvs_layer_pair pair = pairs[k];
        uint64_t src_page = 0;
        uint64_t dst_page = 0;
        // Both sides are resolved (and bounds-checked) before either decides to skip.
        const bool src_ok = resolve_page(p.src_pages, j, src_page, p.status);
        const bool dst_ok = resolve_page(p.dst_pages, j, dst_page, p.status);
        const bool component_ok = pair.component < p.num_components;
        if (!component_ok && j == 0) {
            report(p.status, u);
        }
        if (src_ok && dst_ok && component_ok) {
            const kvs_block_component& c = p.components[pair.component];
            const uint64_t src = pair.src + src_page * c.src.page_stride;
            const uint64_t dst = pair.dst + dst_page * c.dst.page_stride;
            const uint32_t vectors_per_row = c.row_bytes / 16;
            if (c.rows == 1) {
                warp_copy(src, dst, vectors_per_row, Contiguous{}, Contiguous{});
            } else {
                warp_copy(src, dst, vectors_per_row * c.rows, Strided{vectors_per_row, c.src.row_stride},
                          Strided{vectors_per_row, c.dst.row_stride});
            }
        }
        if (signals != nullptr) {
            // Every lane's stores are ordered before the counter that publishes them.
            __threadfence_system();
            __syncwarp();
            if (threadIdx.x % 32 == 0) {
                atomicAdd(signals + pair.signal, 1u);
            }
        }
    }
}
