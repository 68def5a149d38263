/*
 * A kernel version that lost a benchmark, kept to read and to time again; nothing builds it
 * (build.rs compiles cuda/ only).
 *
 * What: kvs_copy_blocks that prefetches the next unit's page ids. Each warp loads the page ids
 *   of its next grid-stride unit before copying the current one (UnitIds, fetch_ids), to hide
 *   the id loads behind the copy.
 * Beaten by: the same kernel without the prefetch (47a88b1), then the work-queue kernel kept in
 *   cuda/copy.cu (1e0cdae). The prefetch spills at the 64 registers of 1024-thread CTAs (40
 *   bytes of spill stores and 48 of loads on sm_90a with nvcc 13.0), which the build now
 *   refuses.
 * By how much: BENCHMARKS.md, "Device pool copies" (H200, 576-byte rows, 62 layers, % of the
 *   in-run D2D ceiling, gather / scatter): 90.2 / 89.6 with the prefetch, 92.3 / 91.6 without,
 *   93.7 / 92.9 kept.
 * Source: cuda/copy.cu at 9f1d56a, lines 18-26 and 29-156, verbatim (the rest of that file,
 *   other jobs, left out); it builds against that commit's cuda/common.cuh and cuda/abi.h:
 *     mkdir -p /tmp/kvs-9f1d56a && git archive 9f1d56a cuda | tar -x -C /tmp/kvs-9f1d56a
 *     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I /tmp/kvs-9f1d56a/cuda benches/kernels/copy_blocks_prefetch.cu
 * Time it: on an H200 (cargo, and the pinned nvcc from scripts/install-cuda.sh), with the GPU
 *   benchmark of the commit whose kernel it was:
 *     git worktree add /tmp/kvshard-9f1d56a 9f1d56a && cd /tmp/kvshard-9f1d56a
 *     cargo bench --bench gpu -- pool
 * The kept kernel: the same section of today's GPU benchmark (docs/gpu.md, "Running on a GPU host").
 */
#include "common.cuh"

using namespace kvs;

namespace {

constexpr uint32_t UNROLL = 8;
/* Copy kernels may be launched with up to 1024 threads per CTA (host I/O wants few, fat CTAs). */
constexpr uint32_t MAX_THREADS = 1024;

/* The raw id of entry j of a page list (j itself for POSITION): the only memory read it needs. */
__device__ __forceinline__ int64_t page_id(const kvs_page_list& list, uint64_t j) {
    return list.kind == KVS_INDEX_POSITION ? static_cast<int64_t>(j) : reinterpret_cast<const int64_t*>(list.ids)[j];
}

/* Turns raw id `id` of entry j into a page; false when skipped (padding, not owned, bad). */
__device__ __forceinline__ bool resolve_page(const kvs_page_list& list, int64_t id, uint64_t j, uint64_t& page,
                                             const kvs_status& status) {
    if (id < 0) {
        return false;
    }
    page = static_cast<uint64_t>(id);
    if (list.kind == KVS_INDEX_LOGICAL) {
        if (page_owner(page, list.shard) != list.rank) {
            return false;
        }
        page = local_page(page, list.shard);
    }
    if (page >= list.limit) {
        report(status, j);
        return false;
    }
    return true;
}

/* The page ids a warp reads before it can copy a unit; fetched one unit ahead. */
struct UnitIds {
    int64_t src;
    int64_t dst;
};

__device__ __forceinline__ UnitIds fetch_ids(const kvs_copy_blocks_params& p, uint64_t u) {
    const uint64_t j = u % p.num_pages;
    return UnitIds{page_id(p.src_pages, j), page_id(p.dst_pages, j)};
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
                r[u] = load16(src + src_offset(v));
            }
        }
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            const uint32_t v = v0 + 32 * u;
            if (v < vectors) {
                store16(dst + dst_offset(v), r[u]);
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
    uint64_t u = global_warp();
    UnitIds ids{};
    if (u < units) {
        ids = fetch_ids(p, u);
    }
    while (u < units) {
        // The next unit's page ids are loaded now and consumed after this unit's copy (the
        // pair table is small and stays cached).
        const uint64_t next_u = u + grid_warps();
        UnitIds next{};
        if (next_u < units) {
            next = fetch_ids(p, next_u);
        }
        const uint64_t k = u / p.num_pages;
        const uint64_t j = u - k * p.num_pages;
        const kvs_layer_pair pair = pairs[k];
        uint64_t src_page = 0;
        uint64_t dst_page = 0;
        // Both sides are resolved (and bounds-checked) before either decides to skip.
        const bool src_ok = resolve_page(p.src_pages, ids.src, j, src_page, p.status);
        const bool dst_ok = resolve_page(p.dst_pages, ids.dst, j, dst_page, p.status);
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
        ids = next;
        u = next_u;
    }
}
