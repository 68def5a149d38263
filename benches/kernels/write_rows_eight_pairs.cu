/*
 * A kernel version that lost a benchmark, kept to read and to time again; nothing builds it
 * (build.rs compiles cuda/ only).
 *
 * What: kvs_write_rows with 8 (layer, component) pairs per unit. The kept kernel's structure (a
 *   warp resolves a group of 8 tokens once, then copies their rows for a block of pairs) with
 *   KVS_WRITE_PAIR_BLOCK at 8: fewer, longer units, so a small or mostly skipped chunk spreads
 *   over fewer warps. (743bc10 had this kernel with streaming cache hints; 6db65d4, this
 *   version, dropped them as measured slower: no figure was kept.)
 * Beaten by: the same kernel with 4 pairs per unit (9f1d56a), kept in cuda/write.cu.
 * By how much: BENCHMARKS.md, "Device pool copies and the write path" (H200, 62 layers latent +
 *   indexer, time / owned-byte floor): 1.18-2.8x with 8 pairs per unit, 1.09-1.50x kept
 *   (16K-token chunks, N = 1-8; 4K-token chunks 1.30-2.20x).
 * Source: cuda/copy.cu at 6db65d4, lines 17-21, 26-27, 91-92 and 133-282, verbatim (the rest of
 *   that file, other jobs, left out); it builds against that commit's cuda/common.cuh and
 *   cuda/abi.h:
 *     mkdir -p /tmp/kvs-6db65d4 && git archive 6db65d4 cuda | tar -x -C /tmp/kvs-6db65d4
 *     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I /tmp/kvs-6db65d4/cuda benches/kernels/write_rows_eight_pairs.cu
 * Time it: on an H200 (cargo, and the pinned nvcc from scripts/install-cuda.sh), with the GPU
 *   benchmark of the commit whose kernel it was:
 *     git worktree add /tmp/kvshard-6db65d4 6db65d4 && cd /tmp/kvshard-6db65d4
 *     cargo bench --bench gpu -- write
 * The kept kernel: the same section of today's GPU benchmark (docs/gpu.md, "Running on a GPU host").
 */
#include "common.cuh"

using namespace kvs;

namespace {
/* The write path runs at HBM speed with many CTAs; 512 threads leave it 128 registers. */
constexpr uint32_t WRITE_THREADS = 512;
} // namespace

namespace {

/* Tokens of one write unit, and (layer, component) pairs a unit walks through. */
constexpr uint32_t WRITE_GROUP = 8;
constexpr uint32_t WRITE_PAIR_BLOCK = 8;

/*
 * One pair's rows of a token group: WRITE_GROUP rows of VPR 16-byte vectors, vector i of the
 * group being row i / VPR. `rows` holds the group's local rows (-1: skip). Loads of a chunk are
 * all issued before its stores.
 */
template <uint32_t VPR>
__device__ __forceinline__ void write_latent_rows(uint64_t src_base, uint64_t dst_base, uint64_t first_token,
                                                  const int64_t* rows) {
    constexpr uint32_t VECTORS = WRITE_GROUP * VPR;
    constexpr uint32_t PER_LANE = (VECTORS + 31) / 32;
    // 6 vectors a lane in flight: with the many warps this kernel runs, far more bytes are in
    // flight than HBM needs, and the chunk keeps registers low enough for two CTAs per SM.
    constexpr uint32_t CHUNK = PER_LANE < 6 ? PER_LANE : 6;
    constexpr uint64_t ROW_BYTES = 16ull * VPR;
    const uint32_t lane = threadIdx.x % 32;
    // The group's staged rows are contiguous, so vector i of the group is at 16 * i.
    const uint64_t src = src_base + first_token * ROW_BYTES;
#pragma unroll 1
    for (uint32_t u0 = 0; u0 < PER_LANE; u0 += CHUNK) {
        vec16 r[CHUNK];
        uint32_t valid = 0;
#pragma unroll
        for (uint32_t u = 0; u < CHUNK; ++u) {
            const uint32_t i = lane + 32 * (u0 + u);
            if (u0 + u < PER_LANE && i < VECTORS && rows[i / VPR] >= 0) {
                r[u] = load16(src + 16ull * i);
                valid |= 1u << u;
            }
        }
#pragma unroll
        for (uint32_t u = 0; u < CHUNK; ++u) {
            if (valid & (1u << u)) {
                const uint32_t i = lane + 32 * (u0 + u);
                const uint32_t t = i / VPR;
                store16(dst_base + static_cast<uint64_t>(rows[t]) * ROW_BYTES + 16ull * (i - t * VPR), r[u]);
            }
        }
    }
}

/* One pair's indexer rows of a token group: 8 key vectors per token (2 per lane), then scales. */
__device__ __forceinline__ void write_indexer_rows(uint64_t src_base, uint64_t dst_base, uint64_t first_token,
                                                   const int64_t* rows) {
    const uint32_t lane = threadIdx.x % 32;
    vec16 r[2];
    float scale = 0.0f;
#pragma unroll
    for (uint32_t u = 0; u < 2; ++u) {
        const uint32_t i = lane + 32 * u;
        const uint64_t token = first_token + i / 8;
        if (rows[i / 8] >= 0) {
            r[u] = load16(src_base + (token / KVS_PAGE_SIZE) * KVS_INDEXER_PAGE_BYTES +
                                 (token % KVS_PAGE_SIZE) * KVS_INDEXER_HEAD_DIM + 16ull * (i % 8));
        }
    }
    const uint64_t scale_token = first_token + lane;
    if (lane < WRITE_GROUP && rows[lane] >= 0) {
        scale = *reinterpret_cast<const float*>(src_base + (scale_token / KVS_PAGE_SIZE) * KVS_INDEXER_PAGE_BYTES +
                                                KVS_INDEXER_SCALES_OFFSET + 4 * (scale_token % KVS_PAGE_SIZE));
    }
#pragma unroll
    for (uint32_t u = 0; u < 2; ++u) {
        const uint32_t i = lane + 32 * u;
        const int64_t row = rows[i / 8];
        if (row >= 0) {
            store16(dst_base + (row / KVS_PAGE_SIZE) * KVS_INDEXER_PAGE_BYTES +
                               (row % KVS_PAGE_SIZE) * KVS_INDEXER_HEAD_DIM + 16ull * (i % 8),
                           r[u]);
        }
    }
    if (lane < WRITE_GROUP && rows[lane] >= 0) {
        const int64_t row = rows[lane];
        *reinterpret_cast<float*>(dst_base + (row / KVS_PAGE_SIZE) * KVS_INDEXER_PAGE_BYTES + KVS_INDEXER_SCALES_OFFSET +
                                  4 * (row % KVS_PAGE_SIZE)) = scale;
    }
}

} // namespace

/*
 * Units are (token group, block of pairs): a warp resolves its group's slots once (owner test,
 * local row, bounds), then copies those rows for every pair of its block, so slot work is paid
 * once per WRITE_PAIR_BLOCK layers and a group this rank does not own costs one slot read.
 */
extern "C" __global__ void __launch_bounds__(WRITE_THREADS, 2) kvs_write_rows(const __grid_constant__ kvs_write_rows_params p) {
    __shared__ int64_t s_rows[WRITE_THREADS / 32][WRITE_GROUP];
    const kvs_layer_pair* pairs = reinterpret_cast<const kvs_layer_pair*>(p.pairs);
    const int64_t* slots = reinterpret_cast<const int64_t*>(p.slots);
    const uint32_t lane = threadIdx.x % 32;
    int64_t* rows = s_rows[threadIdx.x / 32];
    const uint64_t groups = (p.num_slots + WRITE_GROUP - 1) / WRITE_GROUP;
    const uint64_t pair_blocks = (p.num_pairs + WRITE_PAIR_BLOCK - 1) / WRITE_PAIR_BLOCK;
    for (uint64_t u = global_warp(); u < groups * pair_blocks; u += grid_warps()) {
        const uint64_t group = u / pair_blocks;
        const uint32_t block = static_cast<uint32_t>(u - group * pair_blocks);
        const uint64_t first_token = group * WRITE_GROUP;
        if (lane < WRITE_GROUP) {
            const uint64_t token = first_token + lane;
            int64_t row = -1;
            if (token < p.num_slots) {
                const int64_t slot = slots[token];
                if (slot >= 0) {
                    const uint64_t s = static_cast<uint64_t>(slot);
                    const bool owned = s < p.slot_limit && page_owner(s / KVS_PAGE_SIZE, p.shard) == p.rank;
                    const uint64_t local = local_row(s, p.shard);
                    if (s >= p.slot_limit || (owned && local >= p.dst_rows)) {
                        if (block == 0) {
                            report(p.status, token);
                        }
                    } else if (owned) {
                        row = static_cast<int64_t>(local);
                    }
                }
            }
            rows[lane] = row;
        }
        __syncwarp();
        if (__any_sync(0xFFFFFFFFu, lane < WRITE_GROUP && rows[lane] >= 0)) {
            const uint32_t end = min(p.num_pairs, (block + 1) * WRITE_PAIR_BLOCK);
            for (uint32_t k = block * WRITE_PAIR_BLOCK; k < end; ++k) {
                const kvs_layer_pair pair = pairs[k];
                if (pair.component >= p.num_components) {
                    if (group == 0 && lane == 0) {
                        report(p.status, p.num_slots + k);
                    }
                    continue;
                }
                const kvs_row_component& c = p.components[pair.component];
                if (c.kind == KVS_ROWS_INDEXER) {
                    write_indexer_rows(pair.src, pair.dst, first_token, rows);
                } else if (c.row_bytes == 576) {
                    write_latent_rows<36>(pair.src, pair.dst, first_token, rows);
                } else if (c.row_bytes == 656) {
                    write_latent_rows<41>(pair.src, pair.dst, first_token, rows);
                } else {
                    // Row sizes are validated on the host: the remaining one is 1152.
                    write_latent_rows<72>(pair.src, pair.dst, first_token, rows);
                }
            }
        }
        // The next unit overwrites this warp's rows.
        __syncwarp();
    }
}
