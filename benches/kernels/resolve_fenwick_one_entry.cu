/*
 * A kernel version that lost a benchmark, kept to read and to time again; nothing builds it
 * (build.rs compiles cuda/ only).
 *
 * What: kvs_resolve, Fenwick tree, one entry point for every entry kind and shard size. The
 *   kept algorithm (tile counts added to and prefixes read from a Fenwick tree) in one kernel
 *   that branches at run time on the entry kind (tokens or pages) and on whether the shard size
 *   is a power of two, with the two trees in two halves of the tile state.
 * Beaten by: one entry point per (entry kind, power-of-two shard size) with the trees
 *   interleaved by 128-byte lines (283130a), kept in cuda/resolve.cu: the general owner math
 *   (64-bit divisions) and the kind branch push one kernel past the 32 registers that 8 CTAs of
 *   256 threads per SM allow (on sm_90a with nvcc 13.0 it spills 8 bytes, which the build now
 *   refuses), and a 1M-entry launch then needs a second wave.
 * By how much: BENCHMARKS.md, "Owner-local resolution" history (H200, same method): 1M entries
 *   N=1 12.1 us vs 11.2-11.3 us kept, N=8 9.8 us vs 9.06-9.15 us, 4M N=8 25.8 us vs 21.8-22.6
 *   us: 7-8% at 1M, 12-15% at 4M.
 * Source: cuda/resolve.cu at feb35ef, lines 1-202, verbatim (the rest of that file, other jobs,
 *   left out); it builds against that commit's cuda/common.cuh and cuda/abi.h:
 *     mkdir -p /tmp/kvs-feb35ef && git archive feb35ef cuda | tar -x -C /tmp/kvs-feb35ef
 *     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I /tmp/kvs-feb35ef/cuda benches/kernels/resolve_fenwick_one_entry.cu
 * Time it: on an H200 (cargo, and the pinned nvcc from scripts/install-cuda.sh), with the GPU
 *   benchmark of the commit whose kernel it was:
 *     git worktree add /tmp/kvshard-feb35ef feb35ef && cd /tmp/kvshard-feb35ef
 *     cargo bench --bench gpu -- resolve
 * The kept kernel: the same section of today's GPU benchmark (docs/gpu.md, "Running on a GPU host").
 */
/*
 * Owner-local index resolution and scratch translation.
 *
 * kvs_resolve is a single-pass stream compaction: one CTA of 256 threads per tile of
 * KVS_RESOLVE_TILE (1024) entries. Warp w of a tile holds entries [128w, 128w + 128), lane l
 * item k being entry 128w + 32k + l, so every load is one coalesced 256-byte warp access and the
 * stable order is (warp, item, lane). Per tile:
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
 * tile_state holds two node arrays of state_tiles words; launches alternate (parity). A launch
 * needs its array zero and zeroes the other array's first clear_tiles nodes, those the previous
 * launch dirtied, so the caller clears the buffer only once, at creation. Tile ids are blockIdx.x:
 * the hardware dispatches CTAs in index order, so every tile a node waits on is already running
 * (the guarantee CUB's single-pass scans rely on too).
 *
 * Bytes: reads 8 B per entry, writes 12 B per owned entry; the floor is that over the device
 * copy bandwidth.
 */
#include "common.cuh"

using namespace kvs;

namespace {

constexpr uint32_t RESOLVE_THREADS = 256;
constexpr uint32_t RESOLVE_WARPS = RESOLVE_THREADS / 32;
constexpr uint32_t RESOLVE_ITEMS = KVS_RESOLVE_TILE / RESOLVE_THREADS;
static_assert(RESOLVE_ITEMS * RESOLVE_THREADS == KVS_RESOLVE_TILE, "tile = threads x items");
constexpr uint32_t NODE_SUM_BITS = 40;

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
        atomicAdd(reinterpret_cast<unsigned long long*>(nodes + i),
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
            const uint64_t word = *reinterpret_cast<const volatile uint64_t*>(nodes + q);
            if ((word >> NODE_SUM_BITS) == complete) {
                sum = static_cast<uint32_t>(word);
                break;
            }
            __nanosleep(32);
        }
    }
    return __reduce_add_sync(0xFFFFFFFFu, sum);
}

/* Owner and local index of one entry; shifts when the shard size is a power of two. */
struct Shard {
    uint32_t size;
    uint32_t log2; /* valid when `pow2` */
    bool pow2;

    __device__ __forceinline__ uint32_t owner(uint64_t page) const {
        return pow2 ? static_cast<uint32_t>(page & (size - 1)) : page_owner(page, size);
    }

    __device__ __forceinline__ uint64_t local_page_of(uint64_t page) const {
        return pow2 ? page >> log2 : local_page(page, size);
    }
};

__device__ __forceinline__ Shard make_shard(uint32_t n) {
    Shard s;
    s.size = n;
    s.log2 = static_cast<uint32_t>(__ffs(static_cast<int>(n)) - 1);
    s.pow2 = (n & (n - 1)) == 0;
    return s;
}

} // namespace

/* 8 CTAs per SM (32 registers): a 1M-entry launch (1024 tiles) runs in one wave. */
extern "C" __global__ void __launch_bounds__(RESOLVE_THREADS, 8) kvs_resolve(const __grid_constant__ kvs_resolve_params p) {
    __shared__ uint32_t s_warp_totals[RESOLVE_WARPS];
    __shared__ uint32_t s_exclusive;

    const uint32_t tile = blockIdx.x;
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t warp = threadIdx.x / 32;
    uint64_t* state = reinterpret_cast<uint64_t*>(p.tile_state);
    uint64_t* nodes = state + static_cast<uint64_t>(p.parity) * p.state_tiles;
    uint64_t* other = state + static_cast<uint64_t>(p.parity ^ 1) * p.state_tiles;
    for (uint64_t j = static_cast<uint64_t>(tile) * RESOLVE_THREADS + threadIdx.x; j < p.clear_tiles;
         j += static_cast<uint64_t>(gridDim.x) * RESOLVE_THREADS) {
        other[j] = 0;
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

    const Shard shard = make_shard(p.shard);
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
            } else if (p.mode == KVS_RESOLVE_TOKENS) {
                const uint64_t page = entry / KVS_PAGE_SIZE;
                owned = shard.owner(page) == p.rank;
                items[k] = static_cast<int64_t>(shard.local_page_of(page) * KVS_PAGE_SIZE + entry % KVS_PAGE_SIZE);
            } else {
                owned = shard.owner(entry) == p.rank;
                items[k] = static_cast<int64_t>(shard.local_page_of(entry));
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
    uint64_t out = static_cast<uint64_t>(s_exclusive) + warp_offset;
#pragma unroll
    for (uint32_t k = 0; k < RESOLVE_ITEMS; ++k) {
        if (owners[k] & (1u << lane)) {
            const uint64_t at = out + __popc(owners[k] & lanes_before);
            // Streaming stores: the caller reads the outputs later, not this kernel.
            __stcs(out_positions + at, static_cast<int32_t>(first + 32 * k));
            __stcs(out_local + at, static_cast<long long>(items[k]));
        }
        out += __popc(owners[k]);
    }
}
