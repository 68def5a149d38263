/*
 * The owned-row write path: kvs_write_rows persists a chunk's staged KV rows into this rank's
 * pool, only the rows whose logical slots it owns, every (layer, component) pair in one launch.
 *
 * Each CTA first lists the chunk's token groups of KVS_WRITE_GROUP (8) tokens that hold a row this
 * rank owns, so the grid is spent on owned work only (at N = 8 seven groups in eight are
 * another rank's); a warp then resolves an owned group's rows once and copies them for a block of
 * up to KVS_WRITE_PAIR_BLOCK (4) (layer, component) pairs; the row geometry is a template
 * constant so index math is multiply-shift.
 *
 * Versions that lost to this one are kept in benches/kernels/.
 */
#include "common.cuh"

using namespace kvs;

namespace {

/*
 * Register budget. sm_90 (the H200 cubin and the compute_90 PTX) runs two 512-thread CTAs per SM
 * (64 registers) with 4 vectors a lane in flight: the grid-stride kernel before the owned-group
 * lists was measured best with 6, and with the lists' loop state (window, units dealt) 6 spilled
 * 40-56 B and 5 spilled 12-24 B on sm_90a; 4 does not. Every warp now copies owned rows (none
 * idles on another rank's), so 32 warps x 4 vectors a lane keep ~8 MB in flight on the H200.
 * Blackwell's ptxas (sm_100a, sm_103a) needs more registers for the same code, unbounded 154
 * where sm_90a needs 90 (the three row geometries fit 80 each, not together), so that budget
 * spilled there. On Blackwell the kernel runs one 512-thread CTA per SM (up to 128 registers)
 * with 5 vectors a lane, the most that does not spill. The Blackwell shape has not been
 * measured.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr uint32_t WRITE_CTAS_PER_SM = 1;
constexpr uint32_t WRITE_CHUNK = 5;
#else
constexpr uint32_t WRITE_CTAS_PER_SM = 2;
constexpr uint32_t WRITE_CHUNK = 4;
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

/*
 * Window of the chunk a CTA compacts at once: WINDOW_GROUPS token groups (8,192 tokens), in
 * ballots of 32 tokens (GROUPS_PER_BALLOT groups) by one warp each. Its list of owned groups
 * takes 2 KB of shared memory.
 */
constexpr uint32_t WINDOW_GROUPS = 1024;
constexpr uint32_t GROUPS_PER_BALLOT = 32 / WRITE_GROUP;
constexpr uint32_t WINDOW_BALLOTS = WINDOW_GROUPS / GROUPS_PER_BALLOT;
static_assert(WINDOW_BALLOTS % 32 == 0, "whole ballots per lane in the window's scan");
static_assert(WINDOW_GROUPS <= 65536, "window group indices fit 16 bits");

/*
 * Chunk token `token`'s local row in this rank's pool, or -1 (padding, another rank's, or bad).
 * `bad` is set for a slot the write must report: beyond the logical capacity, on a reserved
 * padding page, or owned with a local row beyond the pool.
 */
__device__ __forceinline__ int64_t owned_row(const kvs_write_rows_params& p, const int64_t* slots, uint64_t token,
                                             bool& bad) {
    bad = false;
    if (token >= p.num_slots) {
        return -1;
    }
    const int64_t slot = slots[token];
    if (slot < 0) {
        return -1;
    }
    const uint64_t s = static_cast<uint64_t>(slot);
    // Logical pages 0..shard are every rank's padding page: a slot there is a mistake
    // (chunk-relative slots, say) and is reported, never written.
    bad = s >= p.slot_limit || s / KVS_PAGE_SIZE < p.shard;
    const bool owned = !bad && page_owner(s / KVS_PAGE_SIZE, p.shard) == p.rank;
    const uint64_t local = local_row(s, p.shard);
    if (owned && local >= p.dst_rows) {
        bad = true;
    }
    return owned && !bad ? static_cast<int64_t>(local) : -1;
}

/*
 * CTAs of the grid that take units: all of them up to 2^31 warps (no useful grid has more; the
 * rest leave at once), so a unit index (below 2^30: 1,024 groups x at most 2^20 pairs) plus the
 * grid never wraps 32 bits. Recomputed where needed rather than kept across the copy loop,
 * whose registers are all spoken for.
 */
__device__ __forceinline__ uint32_t unit_ctas() {
    return min(gridDim.x, 0x7FFFFFFFu / (blockDim.x / 32));
}

} // namespace

/*
 * The write touches only owned work. Each CTA compacts a window of the chunk: its warps read the
 * window's slots (one coalesced int64 a lane, a ballot per 32 tokens), then warp 0 lists, in order,
 * the token groups holding at least one owned row. Every CTA builds the same list, so the grid
 * splits the owned units (group, block of pairs) among its warps with no communication: the units
 * of all windows form one sequence dealt round robin to the grid's warps. A unit resolves its
 * group's rows (eight slot reads, L2-hot) and copies them for its block of pairs. The block is 4
 * pairs when the owned work gives every warp 8 such units or more, else 2 or 1, so a small owned
 * share (a sharded 4K-token chunk) still spreads over every warp. The grid should be what is
 * resident at once (OwnedRowWrite::launch): every CTA scans every slot.
 */
extern "C" __global__ void __launch_bounds__(KVS_WRITE_THREADS, WRITE_CTAS_PER_SM)
    kvs_write_rows(const __grid_constant__ kvs_write_rows_params p) {
    __shared__ int64_t s_rows[KVS_WRITE_THREADS / 32][WRITE_GROUP];
    __shared__ uint8_t s_flags[WINDOW_BALLOTS];
    __shared__ uint16_t s_list[WINDOW_GROUPS];
    // The window's owned units, pairs a unit walks through and pair blocks a group has, and the
    // units dealt before it modulo the grid (a warp's first unit of the window is the one
    // congruent to its index): kept in shared memory, not registers, which the copy loop needs.
    __shared__ uint32_t s_units, s_block_pairs, s_pair_blocks, s_dealt, s_first;
    const kvs_layer_pair* pairs = reinterpret_cast<const kvs_layer_pair*>(p.pairs);
    const int64_t* slots = reinterpret_cast<const int64_t*>(p.slots);
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t warp = threadIdx.x / 32;
    const uint32_t warps = blockDim.x / 32;
    int64_t* rows = s_rows[warp];
    if (blockIdx.x >= unit_ctas()) {
        return;
    }
    if (threadIdx.x == 0) {
        s_dealt = 0;
    }
    // Pairs naming no component: reported once (by the first CTA), skipped by every unit.
    if (blockIdx.x == 0 && warp == 0) {
        for (uint32_t k = lane; k < p.num_pairs; k += 32) {
            if (pairs[k].component >= p.num_components) {
                report(p.status, p.num_slots + k);
            }
        }
    }
    // Fewer than 2^32 slots (checked on the host), so windows count groups in 32 bits.
    for (uint32_t window = 0; static_cast<uint64_t>(window) * WRITE_GROUP < p.num_slots; window += WINDOW_GROUPS) {
        const uint64_t first_token = static_cast<uint64_t>(window) * WRITE_GROUP;
        for (uint32_t b = warp; b < WINDOW_BALLOTS; b += warps) {
            const uint64_t token = first_token + 32ull * b + lane;
            bool bad;
            const bool owned = owned_row(p, slots, token, bad) >= 0;
            if (bad && blockIdx.x == 0) {
                report(p.status, token);
            }
            const uint32_t mask = __ballot_sync(0xFFFFFFFFu, owned);
            if (lane == 0) {
                uint8_t flags = 0;
#pragma unroll
                for (uint32_t g = 0; g < GROUPS_PER_BALLOT; ++g) {
                    flags |= ((mask >> (WRITE_GROUP * g)) & 0xFFu) != 0 ? (1u << g) : 0u;
                }
                s_flags[b] = flags;
            }
        }
        __syncthreads();
        if (warp == 0) {
            // Lane i lists the owned groups of ballots [i * PER_LANE, (i + 1) * PER_LANE), after
            // those of the lanes before it.
            constexpr uint32_t PER_LANE = WINDOW_BALLOTS / 32;
            uint32_t count = 0;
#pragma unroll
            for (uint32_t j = 0; j < PER_LANE; ++j) {
                count += __popc(s_flags[lane * PER_LANE + j]);
            }
            uint32_t before = count;
#pragma unroll
            for (uint32_t d = 1; d < 32; d *= 2) {
                const uint32_t v = __shfl_up_sync(0xFFFFFFFFu, before, d);
                if (lane >= d) {
                    before += v;
                }
            }
            uint32_t at = before - count;
            for (uint32_t j = 0; j < PER_LANE; ++j) {
                const uint32_t b = lane * PER_LANE + j;
                for (uint32_t g = 0; g < GROUPS_PER_BALLOT; ++g) {
                    if (s_flags[b] & (1u << g)) {
                        s_list[at++] = static_cast<uint16_t>(b * GROUPS_PER_BALLOT + g);
                    }
                }
            }
            if (lane == 31) {
                // Blocks of 4 pairs when every warp gets 8 units or more, else 2 or 1.
                const uint32_t grid = unit_ctas() * (blockDim.x / 32);
                uint32_t block_pairs = WRITE_PAIR_BLOCK;
                while (block_pairs > 1 &&
                       static_cast<uint64_t>(before) * ((p.num_pairs + block_pairs - 1) / block_pairs) < 8ull * grid) {
                    block_pairs /= 2;
                }
                const uint32_t pair_blocks = (p.num_pairs + block_pairs - 1) / block_pairs;
                // At most WINDOW_GROUPS x num_pairs: 32 bits (the host bounds the pairs).
                const uint32_t units = before * pair_blocks;
                s_block_pairs = block_pairs;
                s_pair_blocks = pair_blocks;
                s_units = units;
                s_first = s_dealt;
                s_dealt = static_cast<uint32_t>((static_cast<uint64_t>(s_dealt) + units) % grid);
            }
        }
        __syncthreads();
        const uint32_t me = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
        const uint32_t first = s_first;
        for (uint32_t u = me >= first ? me - first : me + (unit_ctas() * (blockDim.x / 32) - first); u < s_units;
             u += unit_ctas() * (blockDim.x / 32)) {
            const uint32_t pair_blocks = s_pair_blocks;
            const uint64_t group = static_cast<uint64_t>(window) + s_list[u / pair_blocks];
            const uint32_t block = static_cast<uint32_t>(u % pair_blocks);
            const uint64_t group_token = group * WRITE_GROUP;
            if (lane < WRITE_GROUP) {
                bool bad;
                rows[lane] = owned_row(p, slots, group_token + lane, bad);
            }
            __syncwarp();
            const uint32_t block_pairs = s_block_pairs;
            const uint32_t end = min(p.num_pairs, (block + 1) * block_pairs);
            for (uint32_t k = block * block_pairs; k < end; ++k) {
                const kvs_layer_pair pair = pairs[k];
                if (pair.component >= p.num_components) {
                    continue;
                }
                const kvs_row_component& c = p.components[pair.component];
                if (c.kind == KVS_ROWS_INDEXER) {
                    write_indexer_rows(pair.src, pair.dst, group_token, rows);
                } else if (c.row_bytes == KVS_LATENT_TRTLLM_ROW_BYTES) {
                    write_latent_rows<KVS_LATENT_TRTLLM_ROW_BYTES / 16>(pair.src, pair.dst, group_token, rows);
                } else if (c.row_bytes == KVS_LATENT_SCALED_ROW_BYTES) {
                    write_latent_rows<KVS_LATENT_SCALED_ROW_BYTES / 16>(pair.src, pair.dst, group_token, rows);
                } else {
                    // Row sizes are validated on the host: the remaining one is the bf16 row.
                    write_latent_rows<KVS_LATENT_BF16_ROW_BYTES / 16>(pair.src, pair.dst, group_token, rows);
                }
            }
            // The next unit overwrites this warp's rows.
            __syncwarp();
        }
        // The next window overwrites the flags and the list.
        __syncthreads();
    }
}
