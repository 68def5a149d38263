/*
 * A kernel version that lost a benchmark, kept to read and to time again; nothing builds it
 * (build.rs compiles cuda/ only).
 *
 * What: kvs_resolve with a CTA-wide decoupled look-back (2026-11-30, 6db65d4). Blocked 2048-entry tiles
 *   (8 entries a thread), a block-wide scan of the owned counts, the whole CTA looking back
 *   over up to 256 predecessors' tile words at a time (with back-off in the spin, 9f1d56a),
 *   owned entries compacted through shared memory.
 * Beaten by: the warp-striped, ballot-ranked look-back of 2026-11-30 (f3bf0d4,
 *   resolve_warp_lookback.cu), then the Fenwick tree of tile counts kept in cuda/resolve.cu
 *   (feb35ef, 283130a).
 * By how much: BENCHMARKS.md (H200, token slots, ~10% padding, rank 0; benches/gpu at 1e0cdae
 *   against the kept kernel's three runs at 283130a / a4f6d0d): 1M entries N=1 14.9 us vs
 *   11.2-11.5 us, N=8 12.8 us vs 9.06-9.22 us, 4M N=8 32.8 us vs 22.2-22.6 us: the kept kernel
 *   takes a quarter to a third less time.
 * Source: cuda/resolve.cu at 051d8f4, lines 1-215, verbatim (the rest of that file, other jobs,
 *   left out); it builds against that commit's cuda/common.cuh and cuda/abi.h:
 *     mkdir -p /tmp/kvs-051d8f4 && git archive 051d8f4 cuda | tar -x -C /tmp/kvs-051d8f4
 *     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I /tmp/kvs-051d8f4/cuda benches/kernels/resolve_cta_lookback.cu
 * Time it: on an H200 (cargo, and the pinned nvcc from scripts/install-cuda.sh), with the GPU
 *   benchmark of the commit whose kernel it was:
 *     git worktree add /tmp/kvshard-051d8f4 051d8f4 && cd /tmp/kvshard-051d8f4
 *     cargo bench --bench gpu -- resolve
 * The kept kernel: the same section of today's GPU benchmark (docs/gpu.md, "Running on a GPU host").
 */
/*
 * Owner-local index resolution and scratch translation.
 *
 * kvs_resolve is a single-pass stream compaction (decoupled look-back, as in CUB's scans):
 * one CTA per tile of RESOLVE_TILE entries, blocked arrangement (thread t holds entries
 * [8t, 8t+8) of the tile, so the stable order is the thread order). Per tile:
 *   1. load, test ownership, count owned entries per thread;
 *   2. block-wide exclusive scan of the counts (warp shuffles + one shared-memory step);
 *   3. the tile publishes its aggregate, the whole CTA looks back over up to 256 predecessors
 *      at a time until it meets an inclusive prefix, and the tile publishes its own;
 *   4. owned entries are compacted into shared memory, then written out coalesced.
 * Tile-state words are (epoch << 34) | (flag << 32) | count. Words of older launches carry an
 * older epoch and read as "not ready", so the state buffer is never cleared. Tile ids are
 * blockIdx.x: the hardware dispatches CTAs in index order, so every predecessor a tile waits on
 * is already running (the guarantee CUB's single-pass scans rely on too).
 *
 * Bytes: reads 8 B per entry, writes 12 B per owned entry; the floor is that over the device
 * copy bandwidth.
 */
#include "common.cuh"

using namespace kvs;

namespace {

constexpr uint32_t RESOLVE_THREADS = 256;
constexpr uint32_t RESOLVE_ITEMS = 8;
constexpr uint32_t RESOLVE_TILE = RESOLVE_THREADS * RESOLVE_ITEMS;
constexpr uint32_t FLAG_AGGREGATE = 1;
constexpr uint32_t FLAG_PREFIX = 2;

__device__ __forceinline__ uint64_t tile_word(uint32_t epoch, uint32_t flag, uint32_t count) {
    return (static_cast<uint64_t>(epoch) << 34) | (static_cast<uint64_t>(flag) << 32) | count;
}

__device__ __forceinline__ void publish(uint64_t* state, uint32_t tile, uint64_t word) {
    *reinterpret_cast<volatile uint64_t*>(state + tile) = word;
}

/*
 * Exclusive prefix of this tile: the sum of all owned counts of the tiles before it. The whole
 * CTA looks back over RESOLVE_THREADS predecessors at a time: tiles run concurrently, so few
 * inclusive prefixes exist early on, and a wide window reaches one (or the start) in one or two
 * steps instead of a chain of 32-tile steps. Ends with the result in every thread.
 */
__device__ uint32_t look_back(const uint64_t* state, uint32_t tile, uint32_t epoch, uint32_t* s_first,
                              uint32_t* s_sums) {
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t warp = threadIdx.x / 32;
    uint32_t exclusive = 0;
    int64_t newest = static_cast<int64_t>(tile) - 1;
    while (true) {
        const int64_t idx = newest - threadIdx.x;
        uint32_t flag = FLAG_PREFIX;
        uint32_t count = 0;
        if (idx >= 0) {
            while (true) {
                const uint64_t w = *reinterpret_cast<const volatile uint64_t*>(state + idx);
                flag = (w >> 34) == epoch ? static_cast<uint32_t>((w >> 32) & 3) : 0;
                count = static_cast<uint32_t>(w);
                if (flag != 0) {
                    break;
                }
                // Back off: hundreds of threads polling the same few lines would otherwise
                // slow the L2 slices every tile's loads and stores go through.
                __nanosleep(100);
            }
        }
        if (threadIdx.x == 0) {
            *s_first = RESOLVE_THREADS;
        }
        __syncthreads();
        if (flag == FLAG_PREFIX) {
            atomicMin(s_first, threadIdx.x);
        }
        __syncthreads();
        const uint32_t first = *s_first;
        // Predecessors up to (and including) the nearest inclusive prefix contribute.
        uint32_t contribution = threadIdx.x <= first ? count : 0;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            contribution += __shfl_xor_sync(0xFFFFFFFFu, contribution, offset);
        }
        if (lane == 0) {
            s_sums[warp] = contribution;
        }
        __syncthreads();
#pragma unroll
        for (uint32_t w = 0; w < RESOLVE_THREADS / 32; ++w) {
            exclusive += s_sums[w];
        }
        // s_first and s_sums are rewritten by the next step.
        __syncthreads();
        if (first < RESOLVE_THREADS) {
            return exclusive;
        }
        newest -= RESOLVE_THREADS;
    }
}

} // namespace

extern "C" __global__ void __launch_bounds__(RESOLVE_THREADS) kvs_resolve(const __grid_constant__ kvs_resolve_params p) {
    __shared__ int32_t s_positions[RESOLVE_TILE];
    __shared__ int64_t s_local[RESOLVE_TILE];
    __shared__ uint32_t s_warp_totals[RESOLVE_THREADS / 32];
    __shared__ uint32_t s_look_back[RESOLVE_THREADS / 32];
    __shared__ uint32_t s_first;

    const uint32_t tile = blockIdx.x;
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t warp = threadIdx.x / 32;
    const uint64_t first = static_cast<uint64_t>(tile) * RESOLVE_TILE + threadIdx.x * RESOLVE_ITEMS;
    const int64_t* entries = reinterpret_cast<const int64_t*>(p.entries);

    int64_t items[RESOLVE_ITEMS];
    if (first + RESOLVE_ITEMS <= p.num_entries) {
#pragma unroll
        for (uint32_t k = 0; k < RESOLVE_ITEMS; k += 2) {
            const longlong2 pair = *reinterpret_cast<const longlong2*>(entries + first + k);
            items[k] = pair.x;
            items[k + 1] = pair.y;
        }
    } else {
#pragma unroll
        for (uint32_t k = 0; k < RESOLVE_ITEMS; ++k) {
            items[k] = first + k < p.num_entries ? entries[first + k] : -1;
        }
    }

    uint32_t owned_mask = 0;
#pragma unroll
    for (uint32_t k = 0; k < RESOLVE_ITEMS; ++k) {
        const int64_t e = items[k];
        if (e < 0) {
            continue;
        }
        const uint64_t entry = static_cast<uint64_t>(e);
        if (entry >= p.limit) {
            report(p.status, first + k);
            continue;
        }
        if (p.mode == KVS_RESOLVE_TOKENS) {
            if (page_owner(entry / KVS_PAGE_SIZE, p.shard) == p.rank) {
                owned_mask |= 1u << k;
                items[k] = static_cast<int64_t>(local_row(entry, p.shard));
            }
        } else if (page_owner(entry, p.shard) == p.rank) {
            owned_mask |= 1u << k;
            items[k] = static_cast<int64_t>(local_page(entry, p.shard));
        }
    }

    // Block-wide exclusive scan of the per-thread counts.
    const uint32_t count = __popc(owned_mask);
    uint32_t inclusive = count;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const uint32_t other = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
        if (static_cast<int>(lane) >= offset) {
            inclusive += other;
        }
    }
    if (lane == 31) {
        s_warp_totals[warp] = inclusive;
    }
    __syncthreads();
    uint32_t warp_exclusive = 0;
    uint32_t tile_total = 0;
#pragma unroll
    for (uint32_t w = 0; w < RESOLVE_THREADS / 32; ++w) {
        warp_exclusive += w < warp ? s_warp_totals[w] : 0;
        tile_total += s_warp_totals[w];
    }
    const uint32_t thread_exclusive = warp_exclusive + inclusive - count;

    uint64_t* state = reinterpret_cast<uint64_t*>(p.tile_state);
    const uint32_t epoch = p.tile_epoch;
    uint32_t exclusive = 0;
    if (tile == 0) {
        if (threadIdx.x == 0) {
            publish(state, tile, tile_word(epoch, FLAG_PREFIX, tile_total));
        }
    } else {
        if (threadIdx.x == 0) {
            publish(state, tile, tile_word(epoch, FLAG_AGGREGATE, tile_total));
        }
        exclusive = look_back(state, tile, epoch, &s_first, s_look_back);
        if (threadIdx.x == 0) {
            publish(state, tile, tile_word(epoch, FLAG_PREFIX, exclusive + tile_total));
        }
    }

    // Compact into shared memory in stable order, then write out coalesced.
    uint32_t slot = thread_exclusive;
#pragma unroll
    for (uint32_t k = 0; k < RESOLVE_ITEMS; ++k) {
        if (owned_mask & (1u << k)) {
            s_positions[slot] = static_cast<int32_t>(first + k);
            s_local[slot] = items[k];
            ++slot;
        }
    }
    __syncthreads();
    const uint64_t out = exclusive;
    int32_t* out_positions = reinterpret_cast<int32_t*>(p.out_positions);
    int64_t* out_local = reinterpret_cast<int64_t*>(p.out_local);
    for (uint32_t i = threadIdx.x; i < tile_total; i += RESOLVE_THREADS) {
        out_positions[out + i] = s_positions[i];
        out_local[out + i] = s_local[i];
    }
    if (tile == gridDim.x - 1 && threadIdx.x == 0) {
        *reinterpret_cast<uint64_t*>(p.out_count) = out + tile_total;
    }
}
