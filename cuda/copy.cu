/*
 * Byte-exact copies of KV blocks and rows: the kernels every transfer is built from.
 *
 * kvs_copy_blocks: (page, layer) blocks between any two "block spaces": a device pool, a
 *   contiguous staging buffer, another pool, or pinned host memory in any host layout (through
 *   its device alias). A block is `rows` rows of `row_bytes`; when both sides store a block
 *   contiguously the host passes rows = 1, so the hot path has no division. One warp moves one
 *   block with UNROLL 16-byte loads in flight per lane before the matching stores: 4 KB per warp,
 *   128 KB per 1024-thread CTA, which is what keeps PCIe busy for host I/O (see PERFORMANCE.md)
 *   and is plenty for HBM. Logical page lists are resolved to owner-local pages here, in the
 *   same launch. Per-unit completion counters give per-layer ready signals from one launch.
 * kvs_write_rows: the owned-row write path; a warp handles a group of tokens of one
 *   (layer, component) so that a group is a whole number of 16-byte vectors per lane; the row
 *   geometry is a template constant so index math is multiply-shift.
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
