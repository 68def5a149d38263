/*
 * Byte-exact block and range copies: the kernels every transfer between block spaces is built
 * from. (Owned-row writes are write.cu's.)
 *
 * kvs_copy_blocks: (page, layer) blocks between any two "block spaces": a device pool, a
 *   contiguous staging buffer, another pool, or pinned host memory in any host layout (through
 *   its device alias). A block is `rows` rows of `row_bytes`; when both sides store a block
 *   contiguously the host passes rows = 1, so the hot path has no division. One warp moves one
 *   block with COPY_UNROLL 16-byte loads in flight per lane before the matching stores: on the
 *   H200 4 KB per warp, 128 KB per 1024-thread CTA, which is what keeps PCIe busy for host I/O
 *   (docs/design.md, "What measured fast") and is plenty for HBM; half that on Blackwell (register budgets below).
 *   Logical page lists are resolved to owner-local pages here, in the same launch. Per-unit
 *   completion counters give per-layer ready signals from one launch.
 * kvs_copy_blocks_inline: the same copy with its pair table and page ids in the launch's own
 *   parameters (up to KVS_COPY_INLINE_BYTES): a one-shot copy (a P/D chunk) then needs no
 *   upload, no table memory and no copy in the stream ahead of it.
 * kvs_copy_ranges: (src, dst, bytes) descriptors, one warp per descriptor; a descriptor longer
 *   than KVS_COPY_RANGE_MAX_BYTES is skipped and reported, never narrowed.
 *
 * Versions of kvs_copy_blocks that lost to this one are kept in benches/kernels/.
 */
#include "common.cuh"

using namespace kvs;

namespace {

/*
 * Register budget of kvs_copy_blocks. sm_90 (the H200 cubin and the compute_90 PTX) keeps the
 * measured one: 1024 threads (64 registers) with 8 vectors a lane in flight. Blackwell's ptxas
 * (sm_100a, sm_103a) needs more registers for the same code, unbounded 104 where sm_90a needs
 * 74, so that budget spilled there. On Blackwell the kernel keeps its 1024 threads, so every
 * launch shape the host uses stays valid, with 4 vectors a lane: that fits 64 registers and
 * keeps the 64 KB per CTA that 512 threads with 8 would. The Blackwell shape has not been
 * measured.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr uint32_t COPY_UNROLL = 4;
#else
constexpr uint32_t COPY_UNROLL = 8;
#endif
/* kvs_copy_ranges fits 64 registers with 8 vectors a lane on every architecture. */
constexpr uint32_t RANGES_UNROLL = 8;
/*
 * warp_copy counts a range's vectors in 32 bits, and its lanes step up to 32 * UNROLL past the
 * last one: the longest range kvs_copy_ranges accepts must leave that much headroom.
 */
static_assert(KVS_COPY_RANGE_MAX_BYTES / 16 + 32 * RANGES_UNROLL <= 0xFFFFFFFFull,
              "a range's vector count fits warp_copy's 32-bit counter");

/* The raw id of entry j of a page list whose ids are at `ids` (j itself for POSITION): the only
 * memory read it needs. */
__device__ __forceinline__ int64_t page_id(const kvs_page_list& list, const int64_t* ids, uint64_t j) {
    return list.kind == KVS_INDEX_POSITION ? static_cast<int64_t>(j) : ids[j];
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

/* One warp copies `vectors` 16-byte vectors, UNROLL per lane in flight; vector i sits at
 * base + offset(i) on each side. */
template <uint32_t UNROLL, typename Offset>
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

/*
 * kvs_copy_blocks over `p`, its pair table at `pairs` and its page ids at `src_ids` / `dst_ids`:
 * device memory (kvs_copy_blocks) or the launch's own parameters (kvs_copy_blocks_inline).
 */
__device__ __forceinline__ void copy_blocks(const kvs_copy_blocks_params& p, const kvs_layer_pair* pairs,
                                            const int64_t* src_ids, const int64_t* dst_ids) {
    uint32_t* signals = reinterpret_cast<uint32_t*>(p.signals);
    const uint64_t units = p.num_pages * p.num_pairs;
    for (uint64_t u = first_unit(p.work); u < units; u = next_unit(p.work, u)) {
        const uint64_t k = u / p.num_pages;
        const uint64_t j = u - k * p.num_pages;
        const kvs_layer_pair pair = pairs[k];
        uint64_t src_page = 0;
        uint64_t dst_page = 0;
        // Both sides are resolved (and bounds-checked) before either decides to skip.
        const bool src_ok = resolve_page(p.src_pages, page_id(p.src_pages, src_ids, j), j, src_page, p.status);
        const bool dst_ok = resolve_page(p.dst_pages, page_id(p.dst_pages, dst_ids, j), j, dst_page, p.status);
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
                warp_copy<COPY_UNROLL>(src, dst, vectors_per_row, Contiguous{}, Contiguous{});
            } else {
                warp_copy<COPY_UNROLL>(src, dst, vectors_per_row * c.rows,
                                       Strided{vectors_per_row, c.src.row_stride},
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

} // namespace

extern "C" __global__ void __launch_bounds__(KVS_COPY_THREADS) kvs_copy_blocks(const __grid_constant__ kvs_copy_blocks_params p) {
    copy_blocks(p, reinterpret_cast<const kvs_layer_pair*>(p.pairs), reinterpret_cast<const int64_t*>(p.src_pages.ids),
                reinterpret_cast<const int64_t*>(p.dst_pages.ids));
}

/*
 * The tables are read in place from the parameter space (`__grid_constant__` makes the
 * parameter addressable, no per-thread copy): every lane of a warp reads the same pair and ids,
 * which the constant cache broadcasts.
 */
extern "C" __global__ void __launch_bounds__(KVS_COPY_THREADS)
    kvs_copy_blocks_inline(const __grid_constant__ kvs_copy_blocks_inline_params p) {
    const uint8_t* table = reinterpret_cast<const uint8_t*>(p.table);
    copy_blocks(p.copy, reinterpret_cast<const kvs_layer_pair*>(table + p.copy.pairs),
                reinterpret_cast<const int64_t*>(table + p.copy.src_pages.ids),
                reinterpret_cast<const int64_t*>(table + p.copy.dst_pages.ids));
}

extern "C" __global__ void __launch_bounds__(KVS_COPY_THREADS) kvs_copy_ranges(const __grid_constant__ kvs_copy_ranges_params p) {
    const kvs_range* ranges = reinterpret_cast<const kvs_range*>(p.ranges);
    const uint32_t lane = threadIdx.x % 32;
    for (uint64_t r = global_warp(); r < p.num_ranges; r += grid_warps()) {
        const kvs_range range = ranges[r];
        if (range.bytes > KVS_COPY_RANGE_MAX_BYTES) {
            if (lane == 0) {
                report(p.status, r);
            }
        } else if (((range.src | range.dst | range.bytes) & 15) == 0) {
            // In range for the 32-bit count: the bound above (static_assert at the top).
            warp_copy<RANGES_UNROLL>(range.src, range.dst, static_cast<uint32_t>(range.bytes / 16), Contiguous{},
                                     Contiguous{});
        } else {
            for (uint64_t b = lane; b < range.bytes; b += 32) {
                reinterpret_cast<uint8_t*>(range.dst)[b] = reinterpret_cast<const uint8_t*>(range.src)[b];
            }
        }
    }
}
