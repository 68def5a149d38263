/*
 * A kernel version that lost a benchmark, kept to read and to time again; nothing builds it
 * (build.rs compiles cuda/ only).
 *
 * What: kvs_write_rows with one warp per (token group, pair). The first owned-row write path:
 *   units are (pair, group of 4-32 tokens), so every (layer, component) pair reads and resolves
 *   the group's slots again (owner test, local row, bounds), and a group this rank does not own
 *   costs a slot read per pair; bad slots are reported in a pass of their own.
 * Beaten by: token groups resolved once per block of pairs (743bc10, 6db65d4: 8 pairs per
 *   unit), then the 4-pair kernel kept in cuda/write.cu (9f1d56a).
 * By how much: BENCHMARKS.md, "Device pool copies and the write path" (H200, 62 layers latent +
 *   indexer, time / owned-byte floor): 2.3-28x here, 1.18-2.8x with 8 pairs per unit,
 *   1.09-1.50x kept (16K-token chunks, N = 1-8).
 * Source: cuda/copy.cu at 894c728, lines 17-23, 26-27, 91-92 and 133-273, verbatim (the rest of
 *   that file, other jobs, left out); it builds against that commit's cuda/common.cuh and
 *   cuda/abi.h:
 *     mkdir -p /tmp/kvs-894c728 && git archive 894c728 cuda | tar -x -C /tmp/kvs-894c728
 *     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I /tmp/kvs-894c728/cuda benches/kernels/write_rows_per_pair.cu
 * Time it: this kernel predates the GPU benchmark in git (benches/gpu came with its
 *   replacement, in 743bc10, with cuda/abi.h unchanged), so time it under that benchmark:
 *     git worktree add /tmp/kvshard-743bc10 743bc10 && cd /tmp/kvshard-743bc10
 *     git show 894c728:cuda/copy.cu > cuda/copy.cu
 *     cargo bench --bench gpu -- write
 * The kept kernel: the same section of today's GPU benchmark (docs/gpu.md, "Running on a GPU host").
 */
#include "common.cuh"

using namespace kvs;

namespace {

constexpr uint32_t UNROLL = 8;
/* The write path runs at HBM speed with many CTAs; 512 threads leave it 128 registers. */
constexpr uint32_t WRITE_THREADS = 512;
} // namespace

namespace {

/*
 * Latent rows of VPR 16-byte vectors; a warp moves GROUP tokens = GROUP * VPR / 32 vectors per
 * lane, UNROLL loads in flight before their stores.
 */
template <uint32_t VPR, uint32_t GROUP>
__device__ __forceinline__ void write_latent_group(const kvs_write_rows_params& p, const kvs_layer_pair& pair,
                                                   uint64_t first_token) {
    static_assert((GROUP * VPR) % 32 == 0, "a group must be whole vectors per lane");
    constexpr uint32_t PER_LANE = GROUP * VPR / 32;
    constexpr uint64_t ROW_BYTES = 16ull * VPR;
    const uint32_t lane = threadIdx.x % 32;
    const int64_t* slots = reinterpret_cast<const int64_t*>(p.slots);
#pragma unroll 1
    for (uint32_t u0 = 0; u0 < PER_LANE; u0 += UNROLL) {
        vec16 r[UNROLL];
        uint64_t dst[UNROLL];
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            dst[u] = 0;
            const uint32_t i = lane + 32 * (u0 + u);
            const uint64_t token = first_token + i / VPR;
            if (u0 + u >= PER_LANE || token >= p.num_slots) {
                continue;
            }
            const int64_t slot = slots[token];
            if (slot < 0 || static_cast<uint64_t>(slot) >= p.slot_limit ||
                page_owner(static_cast<uint64_t>(slot) / KVS_PAGE_SIZE, p.shard) != p.rank) {
                continue;
            }
            const uint64_t row = local_row(static_cast<uint64_t>(slot), p.shard);
            if (row < p.dst_rows) {
                const uint32_t v = i % VPR;
                r[u] = load16(pair.src + token * ROW_BYTES + 16ull * v);
                dst[u] = pair.dst + row * ROW_BYTES + 16ull * v;
            }
        }
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            if (dst[u] != 0) {
                store16(dst[u], r[u]);
            }
        }
    }
}

/* Indexer rows: 8 key vectors + one f32 scale per token; 4 tokens per warp, one vector a lane. */
__device__ __forceinline__ void write_indexer_group(const kvs_write_rows_params& p, const kvs_layer_pair& pair,
                                                    uint64_t first_token) {
    const uint32_t lane = threadIdx.x % 32;
    const uint64_t token = first_token + lane / 8;
    if (token >= p.num_slots) {
        return;
    }
    const int64_t slot = reinterpret_cast<const int64_t*>(p.slots)[token];
    if (slot < 0 || static_cast<uint64_t>(slot) >= p.slot_limit ||
        page_owner(static_cast<uint64_t>(slot) / KVS_PAGE_SIZE, p.shard) != p.rank) {
        return;
    }
    const uint64_t row = local_row(static_cast<uint64_t>(slot), p.shard);
    if (row >= p.dst_rows) {
        return;
    }
    const uint32_t v = lane % 8;
    const uint64_t src_block = pair.src + (token / KVS_PAGE_SIZE) * KVS_INDEXER_PAGE_BYTES;
    const uint64_t dst_block = pair.dst + (row / KVS_PAGE_SIZE) * KVS_INDEXER_PAGE_BYTES;
    const uint64_t src_off = (token % KVS_PAGE_SIZE);
    const uint64_t dst_off = (row % KVS_PAGE_SIZE);
    store16(dst_block + dst_off * KVS_INDEXER_HEAD_DIM + 16ull * v,
            load16(src_block + src_off * KVS_INDEXER_HEAD_DIM + 16ull * v));
    if (v == 0) {
        *reinterpret_cast<float*>(dst_block + KVS_INDEXER_SCALES_OFFSET + 4 * dst_off) =
            *reinterpret_cast<const float*>(src_block + KVS_INDEXER_SCALES_OFFSET + 4 * src_off);
    }
}

/* Tokens per warp unit for a component: whole vectors per lane for each supported row size. */
__device__ __forceinline__ uint32_t group_tokens(const kvs_row_component& c) {
    if (c.kind == KVS_ROWS_INDEXER) {
        return 4;
    }
    // Row sizes are validated on the host: 576, 656 or 1152.
    switch (c.row_bytes) {
    case 576:
        return 8; /* 36 vectors: 8 tokens = 9 per lane */
    case 656:
        return 32; /* 41 vectors: 32 tokens = 41 per lane */
    default:
        return 4; /* 1152: 72 vectors: 4 tokens = 9 per lane */
    }
}

} // namespace

extern "C" __global__ void __launch_bounds__(WRITE_THREADS) kvs_write_rows(const __grid_constant__ kvs_write_rows_params p) {
    const kvs_layer_pair* pairs = reinterpret_cast<const kvs_layer_pair*>(p.pairs);
    const int64_t* slots = reinterpret_cast<const int64_t*>(p.slots);
    // Bad slots are reported once, in a pass of their own, not once per pair.
    const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.num_slots;
         i += threads) {
        const int64_t slot = slots[i];
        if (slot >= 0 && (static_cast<uint64_t>(slot) >= p.slot_limit ||
                          (page_owner(static_cast<uint64_t>(slot) / KVS_PAGE_SIZE, p.shard) == p.rank &&
                           local_row(static_cast<uint64_t>(slot), p.shard) >= p.dst_rows))) {
            report(p.status, i);
        }
    }
    // Units are (pair, group of tokens); groups per pair depend on the pair's component.
    uint64_t unit_base = 0;
    for (uint32_t k = 0; k < p.num_pairs; ++k) {
        const kvs_layer_pair pair = pairs[k];
        if (pair.component >= p.num_components) {
            if (blockIdx.x == 0 && threadIdx.x == 0) {
                report(p.status, p.num_slots + k);
            }
            continue;
        }
        const kvs_row_component& c = p.components[pair.component];
        const uint32_t group = group_tokens(c);
        const uint64_t groups = (p.num_slots + group - 1) / group;
        // This warp's first unit inside [unit_base, unit_base + groups).
        const uint64_t w = global_warp();
        const uint64_t stride = grid_warps();
        uint64_t first = w >= unit_base ? w : w + ((unit_base - w + stride - 1) / stride) * stride;
        for (uint64_t u = first; u < unit_base + groups; u += stride) {
            const uint64_t token = (u - unit_base) * group;
            if (c.kind == KVS_ROWS_INDEXER) {
                write_indexer_group(p, pair, token);
            } else if (c.row_bytes == 576) {
                write_latent_group<36, 8>(p, pair, token);
            } else if (c.row_bytes == 656) {
                write_latent_group<41, 32>(p, pair, token);
            } else {
                write_latent_group<72, 4>(p, pair, token);
            }
        }
        unit_base += groups;
    }
}
