/*
 * Byte-exact copies of KV blocks and rows: the kernels every transfer is built from.
 *
 * kvs_copy_blocks: (page, layer) blocks between any two "block spaces": a device pool, a
 *   contiguous staging buffer, another pool, or pinned host memory in any host layout (through
 *   its device alias). A block is `rows` rows of `row_bytes`; when both sides store a block
 *   contiguously the host passes rows = 1, so the hot path has no division. One warp moves one
 *   block with UNROLL 16-byte loads in flight per lane before the matching stores: 4 KB per warp,
 *   128 KB per 1024-thread CTA, which is what keeps PCIe busy for host I/O (docs/design.md, "What measured fast")
 *   and is plenty for HBM. Logical page lists are resolved to owner-local pages here, in the
 *   same launch. Per-unit completion counters give per-layer ready signals from one launch.
 * kvs_write_rows: the owned-row write path; a warp resolves a group of 8 tokens once and copies
 *   their rows for a block of 4 (layer, component) pairs (short enough that a small chunk still
 *   spreads over many warps, long enough that skipped groups cost little); the row geometry is a template
 *   constant so index math is multiply-shift.
 * kvs_copy_ranges: (src, dst, bytes) descriptors, one warp per descriptor.
 */
#include "common.cuh"

using namespace kvs;

namespace {

constexpr uint32_t UNROLL = 8;
/* Copy kernels may be launched with up to 1024 threads per CTA (host I/O wants few, fat CTAs). */
constexpr uint32_t MAX_THREADS = 1024;
/* The write path runs at HBM speed with many CTAs; 512 threads leave it 128 registers. */
constexpr uint32_t WRITE_THREADS = 512;

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
    for (uint64_t u = first_unit(p.work); u < units; u = next_unit(p.work, u)) {
        const uint64_t k = u / p.num_pages;
        const uint64_t j = u - k * p.num_pages;
        const kvs_layer_pair pair = pairs[k];
        uint64_t src_page = 0;
        uint64_t dst_page = 0;
        // Both sides are resolved (and bounds-checked) before either decides to skip.
        const bool src_ok = resolve_page(p.src_pages, page_id(p.src_pages, j), j, src_page, p.status);
        const bool dst_ok = resolve_page(p.dst_pages, page_id(p.dst_pages, j), j, dst_page, p.status);
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

namespace {

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

extern "C" __global__ void __launch_bounds__(MAX_THREADS) kvs_copy_ranges(const __grid_constant__ kvs_copy_ranges_params p) {
    const kvs_range* ranges = reinterpret_cast<const kvs_range*>(p.ranges);
    const uint32_t lane = threadIdx.x % 32;
    for (uint64_t r = global_warp(); r < p.num_ranges; r += grid_warps()) {
        const kvs_range range = ranges[r];
        if (((range.src | range.dst | range.bytes) & 15) == 0) {
            warp_copy(range.src, range.dst, static_cast<uint32_t>(range.bytes / 16), Contiguous{}, Contiguous{});
        } else {
            for (uint64_t b = lane; b < range.bytes; b += 32) {
                reinterpret_cast<uint8_t*>(range.dst)[b] = reinterpret_cast<const uint8_t*>(range.src)[b];
            }
        }
    }
}
