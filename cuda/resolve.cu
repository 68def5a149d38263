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

extern "C" __global__ void kvs_scratch_rows(const __grid_constant__ kvs_scratch_rows_params p) {
    const int64_t* slots = reinterpret_cast<const int64_t*>(p.slots);
    const int64_t* table = reinterpret_cast<const int64_t*>(p.page_table);
    int64_t* out = reinterpret_cast<int64_t*>(p.out_rows);
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.num_slots;
         i += stride) {
        const int64_t slot = slots[i];
        int64_t row = -1;
        if (slot >= 0) {
            const uint64_t page = static_cast<uint64_t>(slot) / KVS_PAGE_SIZE;
            const int64_t scratch_page = page < p.table_len ? table[page] : -1;
            // Bound the page before multiplying, so a huge table entry cannot wrap into range.
            const bool mapped = scratch_page >= 0 &&
                                static_cast<uint64_t>(scratch_page) < (p.scratch_rows + KVS_PAGE_SIZE - 1) / KVS_PAGE_SIZE;
            const uint64_t candidate = mapped ? static_cast<uint64_t>(scratch_page) * KVS_PAGE_SIZE +
                                                    static_cast<uint64_t>(slot) % KVS_PAGE_SIZE
                                              : p.scratch_rows;
            if (candidate < p.scratch_rows) {
                row = static_cast<int64_t>(candidate);
            } else {
                report(p.status, i);
            }
        }
        out[i] = row;
    }
}
