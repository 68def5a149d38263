/*
 * Benchmark-only kernels: the empty launch that bounds every small kernel's time, a read of a
 * buffer that bounds every kernel reading it once, and a memory-bound bf16 add standing in for a
 * forward pass that competes for HBM with transfers.
 *
 * Built only with the cargo feature `bench-kernels` (build.rs), which the GPU benchmark enables:
 * the fatbin an engine embeds carries no kernel it never launches. Their host side is
 * `gpu::bench`, which exists only with the feature too.
 */
#include <cuda_bf16.h>

#include "common.cuh"

extern "C" __global__ void kvs_bench_empty() {}

extern "C" __global__ void kvs_bench_add(const __grid_constant__ kvs_bench_add_params p) {
    const uint64_t vectors = p.count / 8;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
        const uint4 a = reinterpret_cast<const uint4*>(p.a)[i];
        const uint4 b = reinterpret_cast<const uint4*>(p.b)[i];
        uint4 out;
        const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
        const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
        __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            o2[k] = __hadd2(a2[k], b2[k]);
        }
        reinterpret_cast<uint4*>(p.out)[i] = out;
    }
}

extern "C" __global__ void kvs_bench_read(const __grid_constant__ kvs_bench_read_params p) {
    const uint64_t vectors = p.bytes / 16;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    uint32_t acc = 0;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
        const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p.src) + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    // A data-dependent store keeps the loads; random inputs never xor to this per thread.
    if (acc == 0x6b767368u) {
        *reinterpret_cast<uint64_t*>(p.sink) = acc;
    }
}
