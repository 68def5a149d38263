/*
 * The owned-row write path: kvs_write_rows persists a chunk's staged KV rows into this rank's
 * pool, only the rows whose logical slots it owns, every (layer, component) pair in one launch.
 *
 * A warp resolves a group of KVS_WRITE_GROUP (8) tokens once and copies their rows for a block
 * of KVS_WRITE_PAIR_BLOCK (4) (layer, component) pairs (short enough that a small chunk still
 * spreads over many warps, long enough that skipped groups cost little); the row geometry is a
 * template constant so index math is multiply-shift.
 *
 * Versions that lost to this one are kept in benches/kernels/.
 */
#include "common.cuh"

using namespace kvs;

namespace {

/*
 * Register budget. sm_90 (the H200 cubin and the compute_90 PTX) keeps the measured one: two
 * 512-thread CTAs per SM (64 registers) with 6 vectors a lane in flight. Blackwell's ptxas
 * (sm_100a, sm_103a) needs more registers for the same code, unbounded 154 where sm_90a needs
 * 90 (the three row geometries fit 80 each, not together), so that budget spilled there. On
 * Blackwell the kernel runs one 512-thread CTA per SM (up to 128 registers) with 5 vectors a
 * lane, the most that does not spill. The Blackwell shape has not been measured.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr uint32_t WRITE_CTAS_PER_SM = 1;
constexpr uint32_t WRITE_CHUNK = 5;
#else
constexpr uint32_t WRITE_CTAS_PER_SM = 2;
constexpr uint32_t WRITE_CHUNK = 6;
#endif

/* Tokens of one write unit, and (layer, component) pairs a unit walks through (abi.h). */
constexpr uint32_t WRITE_GROUP = KVS_WRITE_GROUP;
constexpr uint32_t WRITE_PAIR_BLOCK = KVS_WRITE_PAIR_BLOCK;

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
    // WRITE_CHUNK vectors a lane in flight: with the many warps this kernel runs, far more bytes
    // are in flight than HBM needs, and the chunk keeps registers within the budget.
    constexpr uint32_t CHUNK = PER_LANE < WRITE_CHUNK ? PER_LANE : WRITE_CHUNK;
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

/* 16-byte key vectors per indexer token, and of a token group per lane. */
constexpr uint32_t KEY_VECTORS = KVS_INDEXER_HEAD_DIM / 16;
constexpr uint32_t GROUP_KEY_VECTORS_PER_LANE = WRITE_GROUP * KEY_VECTORS / 32;
static_assert(GROUP_KEY_VECTORS_PER_LANE * 32 == WRITE_GROUP * KEY_VECTORS, "whole key vectors per lane");

/* One pair's indexer rows of a token group: the key vectors, then the scales. */
__device__ __forceinline__ void write_indexer_rows(uint64_t src_base, uint64_t dst_base, uint64_t first_token,
                                                   const int64_t* rows) {
    const uint32_t lane = threadIdx.x % 32;
    vec16 r[GROUP_KEY_VECTORS_PER_LANE];
    float scale = 0.0f;
#pragma unroll
    for (uint32_t u = 0; u < GROUP_KEY_VECTORS_PER_LANE; ++u) {
        const uint32_t i = lane + 32 * u;
        const uint64_t token = first_token + i / KEY_VECTORS;
        if (rows[i / KEY_VECTORS] >= 0) {
            r[u] = load16(src_base + (token / KVS_PAGE_SIZE) * KVS_INDEXER_PAGE_BYTES +
                          (token % KVS_PAGE_SIZE) * KVS_INDEXER_HEAD_DIM + 16ull * (i % KEY_VECTORS));
        }
    }
    const uint64_t scale_token = first_token + lane;
    if (lane < WRITE_GROUP && rows[lane] >= 0) {
        scale = *reinterpret_cast<const float*>(src_base + (scale_token / KVS_PAGE_SIZE) * KVS_INDEXER_PAGE_BYTES +
                                                KVS_INDEXER_SCALES_OFFSET + 4 * (scale_token % KVS_PAGE_SIZE));
    }
#pragma unroll
    for (uint32_t u = 0; u < GROUP_KEY_VECTORS_PER_LANE; ++u) {
        const uint32_t i = lane + 32 * u;
        const int64_t row = rows[i / KEY_VECTORS];
        if (row >= 0) {
            store16(dst_base + (row / KVS_PAGE_SIZE) * KVS_INDEXER_PAGE_BYTES +
                        (row % KVS_PAGE_SIZE) * KVS_INDEXER_HEAD_DIM + 16ull * (i % KEY_VECTORS),
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
extern "C" __global__ void __launch_bounds__(KVS_WRITE_THREADS, WRITE_CTAS_PER_SM)
    kvs_write_rows(const __grid_constant__ kvs_write_rows_params p) {
    __shared__ int64_t s_rows[KVS_WRITE_THREADS / 32][WRITE_GROUP];
    const kvs_layer_pair* pairs = reinterpret_cast<const kvs_layer_pair*>(p.pairs);
    const int64_t* slots = reinterpret_cast<const int64_t*>(p.slots);
    const uint32_t lane = threadIdx.x % 32;
    int64_t* rows = s_rows[threadIdx.x / 32];
    const uint64_t groups = (p.num_slots + WRITE_GROUP - 1) / WRITE_GROUP;
    const uint64_t pair_blocks = (p.num_pairs + WRITE_PAIR_BLOCK - 1) / WRITE_PAIR_BLOCK;
    for (uint64_t u = first_unit(p.work); u < groups * pair_blocks; u = next_unit(p.work, u)) {
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
                    // Logical pages 0..shard are every rank's padding page: a slot there is a
                    // mistake (chunk-relative slots, say) and is reported, never written.
                    const bool bad = s >= p.slot_limit || s / KVS_PAGE_SIZE < p.shard;
                    const bool owned = !bad && page_owner(s / KVS_PAGE_SIZE, p.shard) == p.rank;
                    const uint64_t local = local_row(s, p.shard);
                    if (bad || (owned && local >= p.dst_rows)) {
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
                } else if (c.row_bytes == KVS_LATENT_TRTLLM_ROW_BYTES) {
                    write_latent_rows<KVS_LATENT_TRTLLM_ROW_BYTES / 16>(pair.src, pair.dst, first_token, rows);
                } else if (c.row_bytes == KVS_LATENT_SCALED_ROW_BYTES) {
                    write_latent_rows<KVS_LATENT_SCALED_ROW_BYTES / 16>(pair.src, pair.dst, first_token, rows);
                } else {
                    // Row sizes are validated on the host: the remaining one is the bf16 row.
                    write_latent_rows<KVS_LATENT_BF16_ROW_BYTES / 16>(pair.src, pair.dst, first_token, rows);
                }
            }
        }
        // The next unit overwrites this warp's rows.
        __syncwarp();
    }
}
