/*
 * Device helpers shared by the kernel files (one job each): status reporting, page-interleaved
 * owner math, 16-byte packed access and the spreading of work units over warps. Every function
 * here has a CPU twin in Rust (src/shard, src/backend/cpu.rs, src/backend/status.rs) with the
 * same semantics. Helpers of one job live in its file.
 */
#pragma once

#include <stdint.h>

#include "abi.h"

namespace kvs {

/* 128-bit packed access: the unit every copy kernel moves. */
typedef uint4 vec16;

__device__ __forceinline__ vec16 load16(uint64_t addr) {
    return *reinterpret_cast<const vec16*>(addr);
}

__device__ __forceinline__ void store16(uint64_t addr, vec16 v) {
    *reinterpret_cast<vec16*>(addr) = v;
}

/* Raises the launch's status word to name `position` (see kvs_status in abi.h). */
__device__ __forceinline__ void report(const kvs_status& status, uint64_t position) {
    if (status.word == 0) {
        return;
    }
    const uint64_t pos = position > 0xFFFFFFFFull ? 0xFFFFFFFFull : position;
    const unsigned long long value =
        (static_cast<unsigned long long>(status.epoch) << 32) | (0xFFFFFFFFull - pos);
    atomicMax(reinterpret_cast<unsigned long long*>(status.word), value);
}

/* Page-interleaved ownership (docs/design.md, "Ownership"). */
__device__ __forceinline__ uint32_t page_owner(uint64_t logical_page, uint32_t shard) {
    return static_cast<uint32_t>(logical_page % shard);
}

__device__ __forceinline__ uint64_t local_page(uint64_t logical_page, uint32_t shard) {
    return logical_page / shard;
}

__device__ __forceinline__ uint64_t local_row(uint64_t logical_slot, uint32_t shard) {
    return (logical_slot / (static_cast<uint64_t>(shard) * KVS_PAGE_SIZE)) * KVS_PAGE_SIZE +
           logical_slot % KVS_PAGE_SIZE;
}

/* Number of warps in the grid and this warp's global index. */
__device__ __forceinline__ uint64_t grid_warps() {
    return static_cast<uint64_t>(gridDim.x) * (blockDim.x / 32);
}

__device__ __forceinline__ uint64_t global_warp() {
    return static_cast<uint64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
}

/* The queue's next unit: the counter counts the units past the grid's first one per warp. */
__device__ __forceinline__ uint64_t take_unit(const kvs_work_queue& q) {
    unsigned long long u = 0;
    if (threadIdx.x % 32 == 0) {
        u = atomicAdd(reinterpret_cast<unsigned long long*>(q.counter), 1ull) - q.base + grid_warps();
    }
    return __shfl_sync(0xFFFFFFFFu, u, 0);
}

/* The first unit of this warp. With a queue: its grid position counted CTA-major, so a launch
 * with fewer units than warps still spreads them over every CTA (and SM); taking it from the
 * queue instead made every warp of a launch hit one counter at once, a burst the copy waited
 * for (measured on the H200: a 64-page P/D chunk 1-2 points slower). Without: the warp's global
 * index, the grid-stride order. */
__device__ __forceinline__ uint64_t first_unit(const kvs_work_queue& q) {
    return q.counter != 0 ? static_cast<uint64_t>(threadIdx.x / 32) * gridDim.x + blockIdx.x : global_warp();
}

/* The unit after `u`: the queue's next (a warp stops at its first failed take, so a launch adds
 * exactly its unit count to the counter), or the grid-stride successor. */
__device__ __forceinline__ uint64_t next_unit(const kvs_work_queue& q, uint64_t u) {
    return q.counter != 0 ? take_unit(q) : u + grid_warps();
}

} // namespace kvs
