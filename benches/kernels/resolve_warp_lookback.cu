/*
 * A kernel version that lost a benchmark, kept to read and to time again; nothing builds it
 * (build.rs compiles cuda/ only).
 *
 * What: kvs_resolve with a warp-0 decoupled look-back (2026-11-30, f3bf0d4). Warp-striped 1024-entry
 *   tiles with ballot ranks (no shared-memory compaction); warp 0 looks back over 64
 *   predecessors at once (two tile words a lane, all polled together), one 128-byte line per
 *   tile word; words carry the launch's epoch, so the state is never cleared.
 * Beaten by: the Fenwick tree of tile counts (feb35ef), kept in cuda/resolve.cu in its
 *   four-entry-point form (283130a): the last tile to load is one L2 round trip from every
 *   later tile's prefix, where this look-back walks back window by window.
 * By how much: BENCHMARKS.md, "Owner-local resolution" history (H200, standalone variant
 *   harness, same method): 1M entries N=1 12.1-12.5 us vs 11.2-11.3 us kept, N=8 10.4-10.7 us
 *   vs 9.06-9.15 us, 4M N=8 22.6-24.0 us vs 21.8-22.6 us: about 14% at 1M, N=8, where issue 3's
 *   2x target was missed with this kernel and met with the kept one.
 * Source: cuda/resolve.cu at c09d5a3, lines 1-239, verbatim (the rest of that file, other jobs,
 *   left out); it builds against that commit's cuda/common.cuh and cuda/abi.h:
 *     mkdir -p /tmp/kvs-c09d5a3 && git archive c09d5a3 cuda | tar -x -C /tmp/kvs-c09d5a3
 *     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I /tmp/kvs-c09d5a3/cuda benches/kernels/resolve_warp_lookback.cu
 * Time it: on an H200 (cargo, and the pinned nvcc from scripts/install-cuda.sh), with the GPU
 *   benchmark of the commit whose kernel it was:
 *     git worktree add /tmp/kvshard-c09d5a3 c09d5a3 && cd /tmp/kvshard-c09d5a3
 *     cargo bench --bench gpu -- resolve
 * The kept kernel: the same section of today's GPU benchmark (docs/gpu.md, "Running on a GPU host").
 */
/*
 * Owner-local index resolution and scratch translation.
 *
 * kvs_resolve is a single-pass stream compaction (decoupled look-back, as in CUB's scans): one
 * CTA of 256 threads per tile of KVS_RESOLVE_TILE entries. Warp w of a tile holds entries
 * [256w, 256w + 256), lane l item k being entry 256w + 32k + l, so every load is one coalesced
 * 256-byte warp access and the stable order is (warp, item, lane). Per tile:
 *   1. load, test ownership, one ballot per item: its bits are the owning lanes;
 *   2. per-warp totals go through shared memory into the warp's offset and the tile's total;
 *   3. the tile publishes its aggregate; warp 0 looks back over 64 predecessors at a time (two
 *      words per lane, all polled at once) until it meets an inclusive prefix, and the tile
 *      publishes its own;
 *   4. every owned entry is written at (tile prefix + warp offset + owners before it), which
 *      the ballots give without a shared-memory compaction; each store is coalesced.
 * Tile-state words are (epoch << 34) | (flag << 32) | count, one per 128-byte line: words of
 * older launches carry an older epoch and read as "not ready", so the buffer is never cleared,
 * and polls of different tiles land on different L2 slices. Measured on the H200 (BENCHMARKS.md):
 * wider windows, serial polls and packed words each cost 10-40% at 1M entries, through L2
 * contention on the polled lines. Tile ids are blockIdx.x: the hardware dispatches CTAs in index
 * order, so every predecessor a tile waits on is already running (the guarantee CUB's
 * single-pass scans rely on too).
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
/* Predecessors one look-back step reads per lane. */
constexpr uint32_t LOOK_BACK_WORDS = 2;
constexpr uint32_t LOOK_BACK_WINDOW = 32 * LOOK_BACK_WORDS;
constexpr uint32_t FLAG_AGGREGATE = 1;
constexpr uint32_t FLAG_PREFIX = 2;

__device__ __forceinline__ uint64_t tile_word(uint32_t epoch, uint32_t flag, uint32_t count) {
    return (static_cast<uint64_t>(epoch) << 34) | (static_cast<uint64_t>(flag) << 32) | count;
}

__device__ __forceinline__ void publish(uint64_t* state, uint32_t tile, uint64_t word) {
    *reinterpret_cast<volatile uint64_t*>(state + static_cast<uint64_t>(tile) * KVS_RESOLVE_STATE_WORDS) =
        word;
}

/*
 * Exclusive prefix of `tile`: the owned counts of every tile before it. Called by warp 0 only;
 * every lane returns the result. A step polls its whole window at once (one L2 round trip when
 * the words are ready), re-polling only words not ready yet, and sums up to and including the
 * nearest inclusive prefix; without one in the window it moves one window further back.
 */
__device__ uint32_t look_back(const uint64_t* state, uint32_t tile, uint32_t epoch) {
    const uint32_t lane = threadIdx.x % 32;
    uint32_t exclusive = 0;
    int64_t newest = static_cast<int64_t>(tile) - 1;
    while (true) {
        uint32_t flags[LOOK_BACK_WORDS];
        uint32_t counts[LOOK_BACK_WORDS];
#pragma unroll
        for (uint32_t j = 0; j < LOOK_BACK_WORDS; ++j) {
            // Tiles before the first read as an inclusive prefix of 0.
            const bool before_first = newest < static_cast<int64_t>(lane * LOOK_BACK_WORDS + j);
            flags[j] = before_first ? FLAG_PREFIX : 0;
            counts[j] = 0;
        }
        while (true) {
            uint64_t words[LOOK_BACK_WORDS];
#pragma unroll
            for (uint32_t j = 0; j < LOOK_BACK_WORDS; ++j) {
                const uint64_t idx = static_cast<uint64_t>(newest - (lane * LOOK_BACK_WORDS + j));
                words[j] = flags[j] == 0
                               ? *reinterpret_cast<const volatile uint64_t*>(state + idx * KVS_RESOLVE_STATE_WORDS)
                               : 0;
            }
            bool ready = true;
#pragma unroll
            for (uint32_t j = 0; j < LOOK_BACK_WORDS; ++j) {
                if (flags[j] == 0) {
                    flags[j] = (words[j] >> 34) == epoch ? static_cast<uint32_t>((words[j] >> 32) & 3) : 0;
                    counts[j] = static_cast<uint32_t>(words[j]);
                }
                ready = ready && flags[j] != 0;
            }
            if (ready) {
                break;
            }
            __nanosleep(32);
        }
        uint32_t nearest = LOOK_BACK_WINDOW;
#pragma unroll
        for (int j = LOOK_BACK_WORDS - 1; j >= 0; --j) {
            if (flags[j] == FLAG_PREFIX) {
                nearest = lane * LOOK_BACK_WORDS + j;
            }
        }
        const uint32_t first = __reduce_min_sync(0xFFFFFFFFu, nearest);
        uint32_t contribution = 0;
#pragma unroll
        for (uint32_t j = 0; j < LOOK_BACK_WORDS; ++j) {
            contribution += lane * LOOK_BACK_WORDS + j <= first ? counts[j] : 0;
        }
        exclusive += __reduce_add_sync(0xFFFFFFFFu, contribution);
        if (first < LOOK_BACK_WINDOW) {
            return exclusive;
        }
        newest -= LOOK_BACK_WINDOW;
    }
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

extern "C" __global__ void __launch_bounds__(RESOLVE_THREADS) kvs_resolve(const __grid_constant__ kvs_resolve_params p) {
    __shared__ uint32_t s_warp_totals[RESOLVE_WARPS];
    __shared__ uint32_t s_exclusive;

    const uint32_t tile = blockIdx.x;
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t warp = threadIdx.x / 32;
    const uint64_t first = static_cast<uint64_t>(tile) * KVS_RESOLVE_TILE + warp * 32 * RESOLVE_ITEMS + lane;
    const int64_t* entries = reinterpret_cast<const int64_t*>(p.entries);

    int64_t items[RESOLVE_ITEMS];
    if ((static_cast<uint64_t>(tile) + 1) * KVS_RESOLVE_TILE <= p.num_entries) {
#pragma unroll
        for (uint32_t k = 0; k < RESOLVE_ITEMS; ++k) {
            // Read once: evict-first keeps the L2 for the outputs and the tile states.
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

    uint64_t* state = reinterpret_cast<uint64_t*>(p.tile_state);
    const uint32_t epoch = p.tile_epoch;
    uint32_t exclusive = 0;
    if (tile == 0) {
        if (threadIdx.x == 0) {
            publish(state, tile, tile_word(epoch, FLAG_PREFIX, tile_total));
        }
    } else {
        if (warp == 0) {
            if (lane == 0) {
                publish(state, tile, tile_word(epoch, FLAG_AGGREGATE, tile_total));
            }
            const uint32_t prefix = look_back(state, tile, epoch);
            if (lane == 0) {
                publish(state, tile, tile_word(epoch, FLAG_PREFIX, prefix + tile_total));
                s_exclusive = prefix;
            }
        }
        __syncthreads();
        exclusive = s_exclusive;
    }

    int32_t* out_positions = reinterpret_cast<int32_t*>(p.out_positions);
    long long* out_local = reinterpret_cast<long long*>(p.out_local);
    const uint32_t lanes_before = (1u << lane) - 1;
    uint64_t out = static_cast<uint64_t>(exclusive) + warp_offset;
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
    if (tile == gridDim.x - 1 && threadIdx.x == 0) {
        *reinterpret_cast<uint64_t*>(p.out_count) = static_cast<uint64_t>(exclusive) + tile_total;
    }
}
