/*
 * Device helpers shared by every kvshard kernel: status reporting, page-interleaved owner math,
 * 16-byte packed access and the FP8 E4M3 encoder. Every function here has a CPU twin in Rust
 * (src/shard, src/fp8.rs, src/backend/cpu.rs) with the same semantics.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
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

/*
 * f32 -> e4m3 with round-to-nearest-even and saturation to +-448. NaN becomes 0x7F whatever
 * its sign, so the result never depends on how the hardware propagates a NaN's sign.
 */
__device__ __forceinline__ uint8_t encode_e4m3(float x) {
    if (isnan(x)) {
        return 0x7F;
    }
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

/* The 8 bf16 values of a 16-byte vector, widened to f32. */
__device__ __forceinline__ void unpack_bf16x8(vec16 v, float out[8]) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    }
}

/* Packs 8 e4m3 codes of x[i] / scale (or x[i] when divide is false) into 8 bytes. */
__device__ __forceinline__ uint2 encode_e4m3x8(const float x[8], float scale, bool divide) {
    uint32_t lo = 0;
    uint32_t hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float a = divide ? x[i] / scale : x[i];
        const float b = divide ? x[i + 4] / scale : x[i + 4];
        lo |= static_cast<uint32_t>(encode_e4m3(a)) << (8 * i);
        hi |= static_cast<uint32_t>(encode_e4m3(b)) << (8 * i);
    }
    return make_uint2(lo, hi);
}

__device__ __forceinline__ float absmax8(const float x[8]) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        m = fmaxf(m, fabsf(x[i]));
    }
    return m;
}

/* Number of warps in the grid and this warp's global index. */
__device__ __forceinline__ uint64_t grid_warps() {
    return static_cast<uint64_t>(gridDim.x) * (blockDim.x / 32);
}

__device__ __forceinline__ uint64_t global_warp() {
    return static_cast<uint64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
}

/* The first unit of this warp: from the work queue, or its grid-stride position. */
__device__ __forceinline__ uint64_t take_unit(const kvs_work_queue& q) {
    unsigned long long u = 0;
    if (threadIdx.x % 32 == 0) {
        u = atomicAdd(reinterpret_cast<unsigned long long*>(q.counter), 1ull) - q.base;
    }
    return __shfl_sync(0xFFFFFFFFu, u, 0);
}

__device__ __forceinline__ uint64_t first_unit(const kvs_work_queue& q) {
    return q.counter != 0 ? take_unit(q) : global_warp();
}

/* The unit after `u`: the queue's next (every warp ends with one failed take, which is what
 * makes a launch add exactly units + warps to the counter), or the grid-stride successor. */
__device__ __forceinline__ uint64_t next_unit(const kvs_work_queue& q, uint64_t u) {
    return q.counter != 0 ? take_unit(q) : u + grid_warps();
}

} // namespace kvs
