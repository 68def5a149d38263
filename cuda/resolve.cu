/*
 * Owner-local index resolution: which entries of a token or page list this rank owns, in order,
 * and their local rows or pages. (Translating slots into scratch rows is scratch.cu's.)
 *
 * kvs_resolve_* is a single-pass stream compaction: one CTA of KVS_RESOLVE_THREADS (256)
 * threads per tile of KVS_RESOLVE_TILE (1024) entries. Warp w of a tile holds entries
 * [128w, 128w + 128), lane l item k being entry 128w + 32k + l, so every load is one coalesced
 * 256-byte warp access and the stable order is (warp, item, lane). Per tile:
 *   1. load, test ownership, one ballot per item: its bits are the owning lanes;
 *   2. per-warp totals go through shared memory into the warp's offset and the tile's total;
 *   3. warp 0 adds the total to the Fenwick-tree nodes covering the tile (one relaxed atomic per
 *      node, lane j the j-th) and reads the nodes that sum every earlier tile (lane j the j-th),
 *      polling each until all the tiles it covers have added;
 *   4. every owned entry is written at (tile prefix + warp offset + owners before it), which the
 *      ballots give without a shared-memory compaction.
 * A node word is (adds << 40) | sum: node i covers lowbit(i) tiles and is complete once that many
 * have added. Any tile's prefix is at most log2(tiles) reads away from the tiles' own counts, so
 * the last tile to load is one L2 round trip from every later tile's prefix, where a chained
 * (decoupled look-back) scan walks back window by window. Measured on the H200 (BENCHMARKS.md):
 * 14% faster than the chained look-back at 1M entries, and packed nodes beat nodes on their own
 * lines (contention on the few hot nodes costs less than the extra L2 misses).
 *
 * tile_state holds two trees, interleaved by 128-byte lines (measured: 2-10% faster than two
 * separate halves); launches alternate (parity). A launch needs its tree zero and zeroes the
 * other tree's first clear_tiles nodes, those the previous launch dirtied, so the caller clears
 * the buffer only once, at creation. Tile ids are blockIdx.x: the hardware dispatches CTAs in
 * index order, so every tile a node waits on is already running (the guarantee CUB's single-pass
 * scans rely on too).
 *
 * Bytes: reads 8 B per entry, writes 12 B per owned entry; the floor is that over the device
 * copy bandwidth. Versions that lost to this one are kept in benches/kernels/.
 */
#include "common.cuh"

using namespace kvs;

namespace {

/* The register budget (32 at 8 CTAs of 256 threads) that resolve_tile is written for. */
constexpr uint32_t RESOLVE_CTAS_PER_SM = 8;
constexpr uint32_t RESOLVE_WARPS = KVS_RESOLVE_THREADS / 32;
constexpr uint32_t RESOLVE_ITEMS = KVS_RESOLVE_TILE / KVS_RESOLVE_THREADS;
static_assert(RESOLVE_ITEMS * KVS_RESOLVE_THREADS == KVS_RESOLVE_TILE, "tile = threads x items");
constexpr uint32_t NODE_SUM_BITS = 40;
/* The trees interleave by 128-byte lines: node i of tree t is word node_word(i) + 16 t. */
constexpr uint32_t NODES_PER_LINE = KVS_RESOLVE_LINE_NODES;
static_assert(NODES_PER_LINE * sizeof(uint64_t) == 128, "one line of nodes");

__device__ __forceinline__ uint32_t node_word(uint32_t i) {
    return i + (i & ~(NODES_PER_LINE - 1));
}

__device__ __forceinline__ uint32_t lowbit(uint32_t i) {
    return i & (0u - i);
}

/* Warp 0: adds `count` to every node covering `tile` (nodes below `tiles` only: no prefix reads
 * a higher one). The path has at most 32 nodes, since tiles < 2^31. */
__device__ __forceinline__ void fenwick_add(uint64_t* nodes, uint32_t tile, uint32_t tiles, uint32_t count) {
    const uint32_t lane = threadIdx.x % 32;
    uint32_t i = tile + 1;
    for (uint32_t j = 0; j < lane && i < tiles; ++j) {
        i += lowbit(i);
    }
    if (i < tiles) {
        atomicAdd(reinterpret_cast<unsigned long long*>(nodes + node_word(i)),
                  (1ull << NODE_SUM_BITS) | static_cast<unsigned long long>(count));
    }
}

/* Warp 0: the owned count of every tile before `tile`; every lane returns it. */
__device__ __forceinline__ uint32_t fenwick_prefix(const uint64_t* nodes, uint32_t tile) {
    const uint32_t lane = threadIdx.x % 32;
    uint32_t q = tile;
    for (uint32_t j = 0; j < lane && q != 0; ++j) {
        q -= lowbit(q);
    }
    uint32_t sum = 0;
    if (q != 0) {
        const uint64_t complete = lowbit(q);
        while (true) {
            const uint64_t word = *reinterpret_cast<const volatile uint64_t*>(nodes + node_word(q));
            if ((word >> NODE_SUM_BITS) == complete) {
                sum = static_cast<uint32_t>(word);
                break;
            }
            __nanosleep(32);
        }
    }
    return __reduce_add_sync(0xFFFFFFFFu, sum);
}

/* Owner and local page of a logical page; masks and shifts when the shard size is a power of two
 * (`log2` is then its log). */
template <bool POW2>
__device__ __forceinline__ uint32_t owner_of(uint64_t page, uint32_t shard) {
    return POW2 ? static_cast<uint32_t>(page & (shard - 1)) : page_owner(page, shard);
}

template <bool POW2>
__device__ __forceinline__ uint64_t local_page_of(uint64_t page, uint32_t shard, uint32_t log2) {
    return POW2 ? page >> log2 : local_page(page, shard);
}

} // namespace

/*
 * One tile. Specialized on the entry kind and on a power-of-two shard size: the general owner
 * math (64-bit divisions) and the kind branch cost registers, and at 8 CTAs per SM (32
 * registers, so a 1M-entry launch of 1024 tiles runs in one wave) every register counts.
 */
template <bool TOKENS, bool POW2>
__device__ __forceinline__ void resolve_tile(const kvs_resolve_params& p) {
    __shared__ uint32_t s_warp_totals[RESOLVE_WARPS];
    __shared__ uint32_t s_exclusive;

    const uint32_t tile = blockIdx.x;
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t warp = threadIdx.x / 32;
    uint64_t* state = reinterpret_cast<uint64_t*>(p.tile_state);
    uint64_t* nodes = state + p.parity * NODES_PER_LINE;
    uint64_t* other = state + (p.parity ^ 1) * NODES_PER_LINE;
    for (uint32_t j = tile * KVS_RESOLVE_THREADS + threadIdx.x; j < p.clear_tiles; j += gridDim.x * KVS_RESOLVE_THREADS) {
        other[node_word(j)] = 0;
    }

    const uint64_t first = static_cast<uint64_t>(tile) * KVS_RESOLVE_TILE + warp * 32 * RESOLVE_ITEMS + lane;
    const int64_t* entries = reinterpret_cast<const int64_t*>(p.entries);
    int64_t items[RESOLVE_ITEMS];
    if ((static_cast<uint64_t>(tile) + 1) * KVS_RESOLVE_TILE <= p.num_entries) {
#pragma unroll
        for (uint32_t k = 0; k < RESOLVE_ITEMS; ++k) {
            // Read once: evict-first keeps the L2 for the outputs and the nodes.
            items[k] = __ldcs(entries + first + 32 * k);
        }
    } else {
#pragma unroll
        for (uint32_t k = 0; k < RESOLVE_ITEMS; ++k) {
            items[k] = first + 32 * k < p.num_entries ? entries[first + 32 * k] : -1;
        }
    }

    const uint32_t log2 = static_cast<uint32_t>(__ffs(static_cast<int>(p.shard)) - 1);
    uint32_t owners[RESOLVE_ITEMS];
    uint32_t warp_total = 0;
#pragma unroll
    for (uint32_t k = 0; k < RESOLVE_ITEMS; ++k) {
        const int64_t e = items[k];
        bool owned = false;
        if (e >= 0) {
            const uint64_t entry = static_cast<uint64_t>(e);
            if (entry >= p.limit) {
                report(p.status, first + 32 * k);
            } else if (TOKENS) {
                const uint64_t page = entry / KVS_PAGE_SIZE;
                owned = owner_of<POW2>(page, p.shard) == p.rank;
                items[k] = static_cast<int64_t>(local_page_of<POW2>(page, p.shard, log2) * KVS_PAGE_SIZE +
                                                entry % KVS_PAGE_SIZE);
            } else {
                owned = owner_of<POW2>(entry, p.shard) == p.rank;
                items[k] = static_cast<int64_t>(local_page_of<POW2>(entry, p.shard, log2));
            }
        }
        owners[k] = __ballot_sync(0xFFFFFFFFu, owned);
        warp_total += __popc(owners[k]);
    }
    if (lane == 0) {
        s_warp_totals[warp] = warp_total;
    }
    __syncthreads();
    uint32_t warp_offset = 0;
    uint32_t tile_total = 0;
#pragma unroll
    for (uint32_t w = 0; w < RESOLVE_WARPS; ++w) {
        const uint32_t t = s_warp_totals[w];
        warp_offset += w < warp ? t : 0;
        tile_total += t;
    }

    if (warp == 0) {
        fenwick_add(nodes, tile, gridDim.x, tile_total);
        const uint32_t prefix = fenwick_prefix(nodes, tile);
        if (lane == 0) {
            s_exclusive = prefix;
            if (tile == gridDim.x - 1) {
                *reinterpret_cast<uint64_t*>(p.out_count) = static_cast<uint64_t>(prefix) + tile_total;
            }
        }
    }
    __syncthreads();

    int32_t* out_positions = reinterpret_cast<int32_t*>(p.out_positions);
    long long* out_local = reinterpret_cast<long long*>(p.out_local);
    const uint32_t lanes_before = (1u << lane) - 1;
    const uint64_t out = static_cast<uint64_t>(s_exclusive) + warp_offset;
    uint32_t before = 0; /* the warp's owned entries in earlier items */
#pragma unroll
    for (uint32_t k = 0; k < RESOLVE_ITEMS; ++k) {
        if (owners[k] & (1u << lane)) {
            const uint64_t at = out + before + __popc(owners[k] & lanes_before);
            // Streaming stores: the caller reads the outputs later, not this kernel.
            __stcs(out_positions + at, static_cast<int32_t>(first + 32 * k));
            __stcs(out_local + at, static_cast<long long>(items[k]));
        }
        before += __popc(owners[k]);
    }
}

#define KVS_RESOLVE_ENTRY(name, tokens, pow2)                                                \
    extern "C" __global__ void __launch_bounds__(KVS_RESOLVE_THREADS, RESOLVE_CTAS_PER_SM)   \
        name(const __grid_constant__ kvs_resolve_params p) {                                 \
        resolve_tile<tokens, pow2>(p);                                                       \
    }
/* The host picks one by p.mode and whether p.shard is a power of two. */
KVS_RESOLVE_ENTRY(kvs_resolve_tokens, true, false)
KVS_RESOLVE_ENTRY(kvs_resolve_tokens_pow2, true, true)
KVS_RESOLVE_ENTRY(kvs_resolve_pages, false, false)
KVS_RESOLVE_ENTRY(kvs_resolve_pages_pow2, false, true)
