/*
 * A kernel version that lost a benchmark, kept to read and to time again; nothing builds it
 * (build.rs compiles cuda/ only).
 *
 * What: kvs_decode_scatter's rows kernel (I under a page, M > 1) with a CTA per (pair, page)
 *   unit instead of a warp: the CTA stages the page's rows in 36 KB of shared memory with
 *   contiguous loads, sorts the rows by destination rank, then writes each rank's rows of the
 *   page as one contiguous run (a rank's rows of a page are consecutive rows of its page), so
 *   no warp's stores alternate between the M ranks' pages row by row. Units from the work queue
 *   a CTA at a time (next_cta_unit).
 * Beaten by: the warp-per-unit rows kernel in cuda/decode_scatter.cu (byte-identical: the dcp
 *   tests' GPU cases passed with this kernel, memcheck and racecheck clean).
 * By how much: H200, 2026-12-04, the GPU benchmark's dcp section (512 pages, I = 1, N = 2, 4
 *   into M = 2, 4, two runs each, the warp kernel of e24204d run in turns with it, both on the
 *   grid of then, 1,056 CTAs of 256 threads): 74.1-78.6% of the same-run D2D ceiling against
 *   77.8-88.4%, and 31.5-58.4% with 512- and 1,024-thread CTAs: each CTA waits out its loads
 *   before its stores at two barriers a page, so fewer bytes are in flight than with
 *   independent warps.
 * Source: written against cuda/decode_scatter.cu at e24204d; it uses that file's helpers (place,
 *   moves_rank, dst_page, Unit, unit_of, units_of, ROWS, KEY_VECTORS), so it builds inside it:
 *     git show e24204d:cuda/decode_scatter.cu > /tmp/ds.cu
 *   paste this file's code (below the #include) before `unpack_rows` there, make the three
 *   kvs_decode_scatter_rows_* kernels call scatter_rows_staged<ROW_BYTES / 16>(p), then
 *     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -Xptxas -v -I cuda /tmp/ds.cu
 * Time it: with that file as cuda/decode_scatter.cu, `scripts/stage-gpu.sh`, then on the GPU host
 *   `.gpu/run-gpu.sh bench -- --quick dcp` (DCP_I=1 for the rows kernel alone).
 */
#include "common.cuh"

using namespace kvs;

namespace decode {

/* The unit after `u` for a CTA that moves each unit with all its threads: the queue's next
   (thread 0 takes it; every thread gets it through `slot`), as take_unit is for a warp: the
   counter counts the units past the grid's first one per CTA. Every thread must call it. */
__device__ __forceinline__ uint64_t next_cta_unit(const kvs_work_queue& q, uint64_t* slot) {
    if (threadIdx.x == 0) {
        *slot = atomicAdd(reinterpret_cast<unsigned long long*>(q.counter), 1ull) - q.base + gridDim.x;
    }
    __syncthreads();
    const uint64_t u = *slot;
    // No thread writes the slot again before every thread has read it.
    __syncthreads();
    return u;
}

/* Bytes of a CTA's staging: a 576-byte page's 64 rows, 56 of 656 bytes, 32 of 1152, an indexer
   page whole (8,448). Static shared memory (under 48 KB: no opt-in at launch). */
constexpr uint32_t STAGE_BYTES = 36864;
/* 16-byte vectors a thread keeps in flight while it stages rows: a 256-thread CTA (the grid
   Method::for_blocks picks) stages a full staging (2,304 vectors) in two rounds of loads; 9 (one
   round) spills on every architecture within the 64 registers of 1,024-thread CTAs. */
constexpr uint32_t STAGE_UNROLL = 6;

/* The CTA copies `vectors` contiguous 16-byte vectors from `src` into `stage`. */
__device__ __forceinline__ void cta_stage(uint64_t src, vec16* stage, uint32_t vectors) {
    for (uint32_t v0 = threadIdx.x; v0 < vectors; v0 += blockDim.x * STAGE_UNROLL) {
        vec16 r[STAGE_UNROLL];
#pragma unroll
        for (uint32_t u = 0; u < STAGE_UNROLL; ++u) {
            const uint32_t v = v0 + blockDim.x * u;
            if (v < vectors) {
                r[u] = load16(src + 16ull * v);
            }
        }
#pragma unroll
        for (uint32_t u = 0; u < STAGE_UNROLL; ++u) {
            const uint32_t v = v0 + blockDim.x * u;
            if (v < vectors) {
                stage[v] = r[u];
            }
        }
    }
}

/*
 * The CTA's row table of one unit, in shared memory: the destination of each row of the page
 * (0: skipped), its indexer scale's, and its rank (the order key: rows of one rank are
 * consecutive local tokens, so sorting a stage's rows by rank, then row, lists the writes
 * destination run by destination run).
 */
struct CtaRows {
    uint64_t to[ROWS];
    uint64_t scale[ROWS];
    uint32_t rank[ROWS];
    uint8_t order[ROWS]; /* a stage's rows in write order (stage-relative) */
};

/*
 * The scatter where a page's rows go to several ranks (I under a page, M > 1), a CTA per unit:
 * the CTA stages the page's rows in shared memory with contiguous loads, then writes them
 * destination run by destination run (a rank's rows of the page are consecutive rows of its
 * page), so each warp's stores are one contiguous run where the warp-per-page kernel's
 * alternate between the M ranks' pages every row (docs/dcp.md, "What is measured").
 */
template <uint32_t LATENT_VPR>
__device__ __forceinline__ void scatter_rows_staged(const kvs_decode_scatter_params& p) {
    __shared__ __align__(16) vec16 stage[STAGE_BYTES / 16];
    __shared__ CtaRows table;
    __shared__ uint64_t next;
    const uint32_t t = threadIdx.x;
    const uint64_t units = units_of(p);
    Unit w;
    for (uint64_t u = blockIdx.x; u < units; u = next_cta_unit(p.work, &next)) {
        if (!unit_of(p, u, w)) {
            continue;
        }
        const bool indexer = w.c.kind == KVS_ROWS_INDEXER;
        const uint32_t vpr = indexer ? KEY_VECTORS : LATENT_VPR;
        const uint32_t row_bytes = indexer ? KVS_INDEXER_HEAD_DIM : w.c.row_bytes;
        for (uint32_t o = t; o < ROWS; o += blockDim.x) {
            uint64_t to = 0;
            uint64_t scale = 0;
            uint32_t rank = 0;
            if (o < w.valid) {
                const Place at = place(w.first + o, p.interleave, p.num_ranks);
                rank = at.rank;
                const uint64_t page = moves_rank(p, at.rank) ? dst_page(p, w.k, w.state, at, w.block, w.position) : 0;
                if (page != 0) {
                    to = page + (at.local % ROWS) * row_bytes;
                    scale = page + KVS_INDEXER_SCALES_OFFSET + 4 * (at.local % ROWS);
                }
            }
            table.to[o] = to;
            table.scale[o] = scale;
            table.rank[o] = rank;
        }
        // An indexer page's keys fit the staging whole, its scales read in place below.
        const uint32_t per_stage = indexer ? ROWS : STAGE_BYTES / 16 / LATENT_VPR;
        for (uint32_t s0 = 0; s0 < w.valid; s0 += per_stage) {
            const uint32_t rows = w.valid - s0 < per_stage ? w.valid - s0 : per_stage;
            cta_stage(w.src + static_cast<uint64_t>(s0) * row_bytes, stage, rows * vpr);
            __syncthreads();
            for (uint32_t i = t; i < rows; i += blockDim.x) {
                const uint32_t key = table.rank[s0 + i];
                uint32_t before = 0;
                for (uint32_t o = 0; o < rows; ++o) {
                    const uint32_t other = table.rank[s0 + o];
                    before += (other < key || (other == key && o < i)) ? 1 : 0;
                }
                table.order[before] = static_cast<uint8_t>(i);
            }
            __syncthreads();
            const uint32_t vectors = rows * vpr;
            for (uint32_t d = t; d < vectors; d += blockDim.x) {
                const uint32_t slot = d / vpr;
                const uint32_t o = table.order[slot];
                const uint64_t to = table.to[s0 + o];
                if (to != 0) {
                    const uint32_t v = d - slot * vpr;
                    store16(to + 16ull * v, stage[o * vpr + v]);
                }
            }
            for (uint32_t i = t; indexer && i < rows; i += blockDim.x) {
                const uint32_t o = table.order[i];
                const uint64_t scale = table.scale[s0 + o];
                if (scale != 0) {
                    *reinterpret_cast<float*>(scale) =
                        *reinterpret_cast<const float*>(w.src + KVS_INDEXER_SCALES_OFFSET + 4ull * (s0 + o));
                }
            }
            // The next stage (or unit) overwrites the staging and the order only after every
            // thread is done reading them.
            __syncthreads();
        }
    }
}

} // namespace decode
