/*
 * FP8 E4M3 quantizers: bf16 rows in, cache rows out, written at given slots.
 *
 * Latent (one warp per token, grid-stride): a 576-element bf16 row is 72 16-byte vectors
 * (64 nope + 8 rope); lane i owns vectors i, i+32 and i+64.
 *   - trtllm (576 B): every element encoded with scale 1.0; vector v -> 8 bytes at 8v.
 *   - scaled (656 B): nope tile t = vectors [16t, 16t+16), so lanes 0-15 hold tiles 0 and 2 and
 *     lanes 16-31 tiles 1 and 3; a half-warp xor-reduction gives each tile's amax, scale =
 *     amax / 448 (a zero tile stores scale 0 and its zeros unscaled), f32 scales at 512, the
 *     bf16 rope copied raw to 528.
 *   - bf16 (1152 B): a raw copy.
 * Indexer (one half-warp per token): 128 bf16 = 16 vectors, one per lane; the half-warp
 * reduces amax, picks the ue8m0 or plain scale, writes 8 key bytes per lane into the page-major
 * block and lane 0 the f32 scale.
 * The CPU twin is src/fp8.rs (row codecs) driven by src/backend/cpu.rs.
 */
#include <cuda_fp8.h>

#include "common.cuh"

using namespace kvs;

namespace {

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

/* 16-byte vectors of a latent input row; the lane mapping above holds for these shapes only. */
constexpr uint32_t LATENT_VECTORS = KVS_LATENT_INPUT_ROW_BYTES / 16;
constexpr uint32_t NOPE_VECTORS = 2 * KVS_KV_LORA_RANK / 16;
constexpr uint32_t ROPE_VECTORS = 2 * KVS_ROPE_DIM / 16;
static_assert(NOPE_VECTORS == 2 * 32 && NOPE_VECTORS + ROPE_VECTORS == LATENT_VECTORS, "latent input row");
static_assert(2 * KVS_LATENT_SCALE_TILE / 16 == 16, "a scale tile per half-warp");
static_assert(ROPE_VECTORS <= 32, "one rope vector per lane");
static_assert(KVS_INDEXER_INPUT_ROW_BYTES / 16 == 16, "an indexer row per half-warp");

__device__ __forceinline__ float half_warp_max(float v) {
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
    }
    return v;
}

__device__ __forceinline__ void store8(uint64_t addr, uint2 v) {
    *reinterpret_cast<uint2*>(addr) = v;
}

__device__ __forceinline__ float ue8m0_scale(float amax) {
    const float v = fmaxf(amax, 1e-4f) / 448.0f;
    const uint32_t bits = __float_as_uint(v);
    const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0);
    return __uint_as_float(static_cast<uint32_t>(exponent + 127) << 23);
}

} // namespace

extern "C" __global__ void kvs_quantize_latent(const __grid_constant__ kvs_quantize_latent_params p) {
    const uint32_t lane = threadIdx.x % 32;
    for (uint64_t token = global_warp(); token < p.num_tokens; token += grid_warps()) {
        const int64_t slot = reinterpret_cast<const int64_t*>(p.slots)[token];
        if (slot < 0) {
            continue;
        }
        if (static_cast<uint64_t>(slot) >= p.dst_rows) {
            if (lane == 0) {
                report(p.status, token);
            }
            continue;
        }
        const uint64_t src = p.src + token * p.src_stride;
        if (p.layout == KVS_LATENT_BF16) {
            const uint64_t dst = p.dst + static_cast<uint64_t>(slot) * KVS_LATENT_BF16_ROW_BYTES;
            for (uint32_t v = lane; v < LATENT_VECTORS; v += 32) {
                store16(dst + 16 * v, load16(src + 16 * v));
            }
        } else if (p.layout == KVS_LATENT_FP8_TRTLLM) {
            const uint64_t dst = p.dst + static_cast<uint64_t>(slot) * KVS_LATENT_TRTLLM_ROW_BYTES;
            for (uint32_t v = lane; v < LATENT_VECTORS; v += 32) {
                float x[8];
                unpack_bf16x8(load16(src + 16 * v), x);
                store8(dst + 8 * v, encode_e4m3x8(x, 1.0f, false));
            }
        } else {
            const uint64_t dst = p.dst + static_cast<uint64_t>(slot) * KVS_LATENT_SCALED_ROW_BYTES;
#pragma unroll
            for (uint32_t half = 0; half < 2; ++half) {
                const uint32_t v = lane + 32 * half;
                float x[8];
                unpack_bf16x8(load16(src + 16 * v), x);
                const float amax = half_warp_max(absmax8(x));
                const float scale = amax / 448.0f;
                store8(dst + 8 * v, encode_e4m3x8(x, scale, scale != 0.0f));
                if (lane % 16 == 0) {
                    const uint32_t tile = lane / 16 + 2 * half;
                    *reinterpret_cast<float*>(dst + KVS_LATENT_SCALED_SCALES_OFFSET + 4 * tile) = scale;
                }
            }
            if (lane < ROPE_VECTORS) {
                store16(dst + KVS_LATENT_SCALED_ROPE_OFFSET + 16 * lane, load16(src + 16 * (NOPE_VECTORS + lane)));
            }
        }
    }
}

extern "C" __global__ void kvs_quantize_indexer(const __grid_constant__ kvs_quantize_indexer_params p) {
    const uint32_t lane = threadIdx.x % 16;
    const uint32_t half = (threadIdx.x % 32) / 16;
    for (uint64_t base = 2 * global_warp(); base < p.num_tokens; base += 2 * grid_warps()) {
        const uint64_t token = base + half;
        int64_t slot = -1;
        if (token < p.num_tokens) {
            slot = reinterpret_cast<const int64_t*>(p.slots)[token];
            if (slot >= 0 && static_cast<uint64_t>(slot) >= p.dst_pages * KVS_PAGE_SIZE) {
                if (lane == 0) {
                    report(p.status, token);
                }
                slot = -1;
            }
        }
        // Both half-warps take part in the shuffles, valid token or not.
        float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (slot >= 0) {
            unpack_bf16x8(load16(p.src + token * p.src_stride + 16 * lane), x);
        }
        const float amax = half_warp_max(absmax8(x));
        if (slot < 0) {
            continue;
        }
        const float scale =
            p.scale == KVS_SCALE_UE8M0 ? ue8m0_scale(amax) : fmaxf(amax, 1e-4f) / 448.0f;
        const uint64_t page = static_cast<uint64_t>(slot) / KVS_PAGE_SIZE;
        const uint64_t offset = static_cast<uint64_t>(slot) % KVS_PAGE_SIZE;
        const uint64_t block = p.dst + page * KVS_INDEXER_PAGE_BYTES;
        store8(block + offset * KVS_INDEXER_HEAD_DIM + 8 * lane, encode_e4m3x8(x, scale, true));
        if (lane == 0) {
            *reinterpret_cast<float*>(block + KVS_INDEXER_SCALES_OFFSET + 4 * offset) = scale;
        }
    }
}
