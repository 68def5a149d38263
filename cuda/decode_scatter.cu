/*
 * kvs_decode_scatter: one prefill rank's chunk into the rows of the M ranks of a decode server
 * sharded by token (decode context parallelism, docs/dcp.md), every (component, layer) and
 * every decode rank in one launch. The placement (abi.h, above kvs_decode_scatter_params): token
 * t on rank (t / I) % M, its local token k = (t / (I M)) I + t % I in row k % 64 of the rank's
 * (k / 64)-th page of the request.
 *
 * A unit is one (pair, source page): a warp moves the page's rows of one layer. Rows of a page
 * go to different ranks when I is under a page, so the warp first places its 64 rows (each lane
 * two: rank, local token, the rank's page from its table, the row's address) into a table of
 * its own in shared memory, then moves the block's 16-byte vectors in source order, UNROLL
 * loads a lane in flight before their stores, each to the address of its row: the loads are
 * contiguous, the stores contiguous within a row (a 576-byte FP8 row is 36 vectors). Indexer
 * pages hold 64 keys of 128 bytes then 64 f32 scales: keys move as vectors the same way, and
 * each lane moves the scales of its own two rows. When the layout keeps pages whole (M = 1, or
 * I a multiple of 64) the page's rows are one run on one rank, and the unit is a plain block
 * copy (its valid rows' prefix when the sequence ends inside the page). Rows of tokens at or
 * past end_token are not moved.
 *
 * Row geometry is a template constant (vectors per row: 36, 41 or 72 for the latent layouts, 8
 * for an indexer key), so finding a vector's row is a multiply-shift, as in write.cu.
 *
 * The bounce route (docs/dcp.md, "Over NIXL and Mooncake"): KVS_DECODE_PACK places each row at
 * row index (local token - shift) of its rank's destination, so a rank's rows of the launch fill
 * its bounce region densely; KVS_DECODE_UNPACK moves one rank's rows back out of such a region
 * into the rank's pages. A page's rows of one rank are consecutive local tokens of that rank, so
 * they are consecutive rows of the region: the unpack unit reads them as one contiguous run
 * (split at most once, at a region page, for indexer keys) and stores each at its row.
 */
#include "common.cuh"

using namespace kvs;

/* The job's helpers, named apart: nvcc compiles every job file as one translation unit. */
namespace decode {

/*
 * Register budgets: up to KVS_DECODE_THREADS (512) threads a CTA; the scatter and pack rows
 * kernels 128 registers (one such CTA an SM), the pages and unpack kernels 64 (two: the budget
 * they had at 1,024 threads, so DenseBounce's 264 x 512 grid still keeps two CTAs an SM for them;
 * the pack kernel, 72 registers on sm_90a in its shared template, keeps one). 16-byte vectors a
 * lane keeps in flight: sm_90 keeps 8 (4 KB a warp) for whole pages (as copy.cu measured) and
 * for the state section's indexer pages, and 9 for a DIRECT launch's latent slices: a slice of 16
 * 576-byte rows is 576 vectors, two batches of 9 a lane. The slices (KVS_DECODE_SLICE_ROWS, a
 * quarter page a unit) keep the pages written at once four times fewer on the same grid
 * (Method::for_decode_scatter: two 256-thread CTAs an SM, 16 warps, which beat 8 to 32 warps an
 * SM in every CTA size tried). H200, 2026-12-04, 512 pages, I = 1, against the whole-page units
 * of 8 vectors in the same calls: slices of 16 rows at 9 vectors +0.9 to +2.0 points of D2D;
 * at 8 vectors (a third batch of 2 a lane) -0.2 to +1.4; slices of 32 rows at 9 -0.7 to +1.6;
 * of 8 rows 7.6-12.3 points slower, at 8 vectors (a second batch of 1 a lane) and at 9 (a unit
 * per 4.6 KB); whole pages at 9 vectors -0.7 to +0.1 (BENCHMARKS.md). Blackwell keeps 4 (nothing measured
 * there; its ptxas needed more registers than sm_90's for the same code within the 64-register
 * budget these kernels had before). Measured on the H200 and kept out (docs/dcp.md, "What is
 * measured"): on 2026-12-03 (a49c5cb, the grid of eight CTAs an SM) every row read whether or
 * not it is moved (no table lookup before the loads), a lane's row followed by addition instead
 * of a division per vector (2% slower); on 2026-12-04 a warp writing one destination rank's
 * rows before the next (destination-major: +3 points at M = 4, N = 2, none at M = 2 on the grid
 * of eight CTAs an SM; 0.2-2.2 points slower on this one; with the rows' order computed in the
 * kernel for any layout, 0.5-7 slower), streaming cache hints (__ldcs/__stcs: 3-5 points slower
 * on both kernels), a CTA per page staging its rows in shared memory to write each rank's run
 * contiguously (benches/kernels/decode_scatter_rows_staged.cu: 10 points slower), and a warp
 * staging 8 rows at a time by cp.async to write whole 128-byte lines (4-6 points slower).
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr uint32_t PAGES_UNROLL = 4;
constexpr uint32_t ROWS_UNROLL = 4;
constexpr uint32_t SLICE_UNROLL = 4;
#else
constexpr uint32_t PAGES_UNROLL = 8;
constexpr uint32_t ROWS_UNROLL = 8;
constexpr uint32_t SLICE_UNROLL = 9;
#endif
/* UNPACK keeps 4 on every architecture (at 8 its rows spill within its 64 registers). */
constexpr uint32_t UNPACK_UNROLL = 4;

constexpr uint32_t ROWS = KVS_PAGE_SIZE;
constexpr uint32_t WARPS = KVS_DECODE_THREADS / 32;
constexpr uint32_t KEY_VECTORS = KVS_INDEXER_HEAD_DIM / 16;

/* Where token `token` lives: its decode rank and local token. */
struct Place {
    uint32_t rank;
    uint64_t local;
};

/* In 32 bits: only tokens below end_token are placed, and end_token is at most
   KVS_DECODE_MAX_TOKENS (checked by the host). */
__device__ __forceinline__ Place place(uint64_t token, uint32_t interleave, uint32_t ranks) {
    const uint32_t t = static_cast<uint32_t>(token);
    const uint32_t group = t / interleave;
    return {group % ranks, static_cast<uint64_t>(group / ranks) * interleave + t % interleave};
}

/* Tokens before `token` on rank `rank` (tokens_on of shard::DecodeLayout), `token` below
   end_token and so below 2^32: in 32 bits, as `place`, except where a round of the layout is
   longer than any token (then every token is in the first round). */
__device__ __forceinline__ uint64_t tokens_before(uint32_t token, uint32_t rank, uint32_t interleave,
                                                  uint32_t ranks) {
    const uint64_t round = static_cast<uint64_t>(interleave) * ranks;
    uint32_t full = 0;
    uint32_t rest = token;
    if (round <= 0xFFFFFFFFull) {
        full = token / static_cast<uint32_t>(round);
        rest = token - full * static_cast<uint32_t>(round);
    }
    const uint64_t lo = static_cast<uint64_t>(rank) * interleave;
    const uint64_t part = rest <= lo ? 0 : (rest - lo < interleave ? rest - lo : interleave);
    return static_cast<uint64_t>(full) * interleave + part;
}

/* The ranks the launch's tables hold, and where rank `rank` is among them (abi.h). */
__device__ __forceinline__ uint32_t table_ranks(const kvs_decode_scatter_params& p) {
    return p.one_rank != 0 ? 1u : p.num_ranks;
}

__device__ __forceinline__ uint32_t table_slot(const kvs_decode_scatter_params& p, uint32_t rank) {
    return p.one_rank != 0 ? 0u : rank;
}

/* Whether the launch moves rank `rank`'s rows. */
__device__ __forceinline__ bool moves_rank(const kvs_decode_scatter_params& p, uint32_t rank) {
    return p.one_rank == 0 || rank == p.rank;
}

/* The shift of the rank at table place `s` for the unit reported at `position` (PACK, UNPACK). */
__device__ __forceinline__ uint64_t shift_of(const kvs_decode_scatter_params& p, uint64_t position, uint32_t s) {
    return reinterpret_cast<const uint64_t*>(p.shifts)[position * table_ranks(p) + s];
}

/* Bytes of one block of component c, both sides packed. */
__device__ __forceinline__ uint64_t block_bytes(const kvs_row_component& c) {
    return c.kind == KVS_ROWS_INDEXER ? KVS_INDEXER_PAGE_BYTES : static_cast<uint64_t>(ROWS) * c.row_bytes;
}

/*
 * The address of the destination page holding row index `at.local` (a local token, or in PACK
 * the rank's dense row) of pair k on rank `at.rank`, or 0 when the rows are skipped: a padding
 * page id (< 0), or one reported at `position` (a local page the rank did not register, a page
 * past its pool).
 */
__device__ __forceinline__ uint64_t dst_page(const kvs_decode_scatter_params& p, uint64_t k, bool state, Place at,
                                             uint64_t block, uint64_t position) {
    const uint32_t s = table_slot(p, at.rank);
    const kvs_decode_rank& r = reinterpret_cast<const kvs_decode_rank*>(p.ranks)[s];
    const uint64_t index = at.local / ROWS;
    if (index >= r.num_pages) {
        report(p.status, position);
        return 0;
    }
    const int64_t page = reinterpret_cast<const int64_t*>(state ? r.state_pages : r.pages)[index];
    if (page < 0) {
        return 0;
    }
    if (static_cast<uint64_t>(page) >= r.limit) {
        report(p.status, position);
        return 0;
    }
    const uint64_t base = reinterpret_cast<const uint64_t*>(p.dst_bases)[k * table_ranks(p) + s];
    return base + static_cast<uint64_t>(page) * block;
}

/* One warp copies `vectors` contiguous 16-byte vectors, PAGES_UNROLL a lane in flight. */
__device__ __forceinline__ void warp_run(uint64_t src, uint64_t dst, uint32_t vectors) {
    const uint32_t lane = threadIdx.x % 32;
    for (uint32_t v0 = lane; v0 < vectors; v0 += 32 * PAGES_UNROLL) {
        vec16 r[PAGES_UNROLL];
#pragma unroll
        for (uint32_t u = 0; u < PAGES_UNROLL; ++u) {
            const uint32_t v = v0 + 32 * u;
            if (v < vectors) {
                r[u] = load16(src + 16ull * v);
            }
        }
#pragma unroll
        for (uint32_t u = 0; u < PAGES_UNROLL; ++u) {
            const uint32_t v = v0 + 32 * u;
            if (v < vectors) {
                store16(dst + 16ull * v, r[u]);
            }
        }
    }
}

/*
 * One warp moves the first `rows` rows of VPR vectors each, contiguous at `src`, row o to
 * rows[o] (0: skipped, not even read), UNROLL vectors a lane in flight.
 */
template <uint32_t VPR, uint32_t UNROLL>
__device__ __forceinline__ void warp_rows(uint64_t src, const uint64_t* rows, uint32_t valid) {
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t vectors = valid * VPR;
    for (uint32_t v0 = lane; v0 < vectors; v0 += 32 * UNROLL) {
        vec16 r[UNROLL];
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            const uint32_t v = v0 + 32 * u;
            if (v < vectors && rows[v / VPR] != 0) {
                r[u] = load16(src + 16ull * v);
            }
        }
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            const uint32_t v = v0 + 32 * u;
            if (v < vectors) {
                const uint32_t o = v / VPR;
                const uint64_t to = rows[o];
                if (to != 0) {
                    store16(to + 16ull * (v - o * VPR), r[u]);
                }
            }
        }
    }
}

/*
 * One unit's source page and what its rows are, once the checks every unit makes have passed:
 * a pair naming a component past num_components (reported once, by the pair's entry 0), a
 * padding entry, a source page past src_limit (reported; UNPACK reads no entry page, and its
 * `src` is the pair's layer base), a page past the tokens to move.
 */
struct Unit {
    uint64_t k;        /* the pair */
    bool state;        /* whether it moves the state section (ranks' state_pages) */
    uint64_t position; /* where its errors are reported */
    uint64_t first;    /* the page's first token */
    uint32_t valid;    /* rows of tokens below end_token */
    kvs_row_component c;
    uint64_t block; /* bytes of a block of the pair's component */
    uint64_t src;   /* the source block */
};

__device__ __forceinline__ bool unit_of(const kvs_decode_scatter_params& p, uint64_t u, Unit& w) {
    const uint64_t kv_units = static_cast<uint64_t>(p.num_kv_pairs) * p.num_entries;
    uint64_t j = 0;
    if (u < kv_units) {
        w.k = u / p.num_entries;
        j = u - w.k * p.num_entries;
        w.state = false;
        w.position = j;
    } else {
        const uint64_t s = u - kv_units;
        const uint64_t k = s / p.num_state_entries;
        j = s - k * p.num_state_entries;
        w.k = p.num_kv_pairs + k;
        w.state = true;
        w.position = p.num_entries + j;
    }
    const kvs_decode_pair pair = reinterpret_cast<const kvs_decode_pair*>(p.pairs)[w.k];
    if (pair.component >= p.num_components) {
        if (j == 0 && threadIdx.x % 32 == 0) {
            report(p.status, p.num_entries + p.num_state_entries + w.k);
        }
        return false;
    }
    const kvs_decode_entry e = reinterpret_cast<const kvs_decode_entry*>(w.state ? p.state_entries : p.entries)[j];
    if (e.page < 0) {
        return false;
    }
    const bool unpack = p.mode == KVS_DECODE_UNPACK;
    if (!unpack && static_cast<uint64_t>(e.page) >= p.src_limit) {
        if (threadIdx.x % 32 == 0) {
            report(p.status, w.position);
        }
        return false;
    }
    w.first = e.position * ROWS;
    if (w.first >= p.end_token) {
        return false;
    }
    w.valid = p.end_token - w.first < ROWS ? static_cast<uint32_t>(p.end_token - w.first) : ROWS;
    w.c = p.components[pair.component];
    w.block = block_bytes(w.c);
    w.src = unpack ? pair.src : pair.src + static_cast<uint64_t>(e.page) * w.block;
    return true;
}

/* The units of a launch. */
__device__ __forceinline__ uint64_t units_of(const kvs_decode_scatter_params& p) {
    return static_cast<uint64_t>(p.num_kv_pairs) * p.num_entries +
           static_cast<uint64_t>(p.num_pairs - p.num_kv_pairs) * p.num_state_entries;
}

/* A layout that keeps pages whole: each unit's valid rows are one run on one rank. */
__device__ __forceinline__ void scatter_pages(const kvs_decode_scatter_params& p) {
    const uint32_t lane = threadIdx.x % 32;
    const uint64_t units = units_of(p);
    Unit w;
    for (uint64_t u = first_unit(p.work); u < units; u = next_unit(p.work, u)) {
        if (!unit_of(p, u, w)) {
            continue;
        }
        // Every lane places the page's first token alike (the same loads, broadcast).
        const Place at = place(w.first, p.interleave, p.num_ranks);
        if (!moves_rank(p, at.rank)) {
            continue;
        }
        const uint64_t dst = dst_page(p, w.k, w.state, at, w.block, w.position);
        if (dst == 0) {
            continue;
        }
        // The whole block, or its valid rows: a latent prefix, an indexer's keys prefix (its
        // scales below).
        const bool indexer = w.c.kind == KVS_ROWS_INDEXER;
        const uint32_t vectors = w.valid == ROWS ? static_cast<uint32_t>(w.block / 16)
                                 : indexer      ? w.valid * KEY_VECTORS
                                                : w.valid * (w.c.row_bytes / 16);
        warp_run(w.src, dst, vectors);
        // A lane moves the scales of rows lane and lane + 32 (a page has 64 rows, a warp 32
        // lanes).
        for (uint32_t o = lane; indexer && w.valid < ROWS && o < w.valid; o += 32) {
            const uint64_t scale = KVS_INDEXER_SCALES_OFFSET + 4ull * o;
            *reinterpret_cast<float*>(dst + scale) = *reinterpret_cast<const float*>(w.src + scale);
        }
    }
}

/*
 * A layout that spreads a page's rows over ranks, or any PACK launch; LATENT_VPR is the vectors
 * of a latent row (every latent component of a cache has the same rows). A latent-section unit
 * is SLICE rows of its page (a DIRECT launch: KVS_DECODE_SLICE_ROWS; PACK: the whole page), so
 * the units in flight at once cover fewer pages, and each warp keeps LATENT_UNROLL of a slice's
 * vectors a lane in flight; a state-section unit is its whole page.
 */
template <uint32_t LATENT_VPR, bool PACK, uint32_t SLICE, uint32_t LATENT_UNROLL>
__device__ __forceinline__ void scatter_rows(const kvs_decode_scatter_params& p) {
    static_assert(ROWS % SLICE == 0 && SLICE <= ROWS, "a page is whole slices");
    constexpr uint32_t SLICES = ROWS / SLICE;
    /* Each warp's placed rows: the destination of row o of its unit (0: skipped). */
    __shared__ uint64_t placed[WARPS][ROWS];
    uint64_t* rows = placed[threadIdx.x / 32];
    const uint32_t lane = threadIdx.x % 32;
    const uint64_t kv_units = static_cast<uint64_t>(p.num_kv_pairs) * p.num_entries;
    const uint64_t kv_slices = kv_units * SLICES;
    // The host counted the launch's units the same way (launch::decode_scatter_units).
    const uint64_t units = units_of(p) + kv_units * (SLICES - 1);
    Unit w;
    for (uint64_t u = first_unit(p.work); u < units; u = next_unit(p.work, u)) {
        // The page's unit, and the slice's first row and rows.
        uint32_t first = 0;
        uint32_t span = ROWS;
        uint64_t page_unit = u - kv_units * (SLICES - 1);
        if (u < kv_slices) {
            page_unit = u / SLICES;
            first = static_cast<uint32_t>(u - page_unit * SLICES) * SLICE;
            span = SLICE;
        }
        if (!unit_of(p, page_unit, w) || first >= w.valid) {
            continue;
        }
        const uint32_t n = w.valid - first < span ? w.valid - first : span;
        const bool indexer = w.c.kind == KVS_ROWS_INDEXER;
        // Each lane places rows lane and lane + 32 of the unit; an indexer lane keeps its rows'
        // scale addresses and moves those scales itself.
        uint64_t scales[2] = {0, 0};
#pragma unroll
        for (uint32_t h = 0; h < 2; ++h) {
            const uint32_t o = lane + 32 * h;
            uint64_t to = 0;
            if (o < n) {
                Place at = place(w.first + first + o, p.interleave, p.num_ranks);
                if (PACK) {
                    // Its dense row in the rank's destination.
                    at.local -= shift_of(p, w.position, table_slot(p, at.rank));
                }
                const uint64_t page = moves_rank(p, at.rank) ? dst_page(p, w.k, w.state, at, w.block, w.position) : 0;
                const uint64_t row = at.local % ROWS;
                if (page != 0) {
                    to = page + row * (indexer ? KVS_INDEXER_HEAD_DIM : w.c.row_bytes);
                    scales[h] = page + KVS_INDEXER_SCALES_OFFSET + 4 * row;
                }
            }
            if (o < span) {
                rows[o] = to;
            }
        }
        __syncwarp();
        if (indexer) {
            warp_rows<KEY_VECTORS, ROWS_UNROLL>(w.src + static_cast<uint64_t>(first) * KVS_INDEXER_HEAD_DIM,
                                                rows, n);
#pragma unroll
            for (uint32_t h = 0; h < 2; ++h) {
                if (scales[h] != 0) {
                    *reinterpret_cast<float*>(scales[h]) = *reinterpret_cast<const float*>(
                        w.src + KVS_INDEXER_SCALES_OFFSET + 4ull * (first + lane + 32 * h));
                }
            }
        } else {
            warp_rows<LATENT_VPR, LATENT_UNROLL>(w.src + static_cast<uint64_t>(first) * w.c.row_bytes, rows, n);
        }
        // The next unit rewrites the table only after every lane is done reading it.
        __syncwarp();
    }
}

/*
 * UNPACK: rank p.rank's rows of each unit's page, read from the source's dense rows (abi.h). The
 * page's rows on the rank are its local tokens [k0, k0 + n), rows [q0, q0 + n) of the source: a
 * contiguous run of latent rows (the source's pages are one block apart), of indexer keys up to
 * the next source page.
 */
template <uint32_t LATENT_VPR>
__device__ __forceinline__ void unpack_rows(const kvs_decode_scatter_params& p) {
    /* Each warp's placed rows: the destination of the run's row i (0: skipped). */
    __shared__ uint64_t placed[WARPS][ROWS];
    uint64_t* rows = placed[threadIdx.x / 32];
    const uint32_t lane = threadIdx.x % 32;
    const uint64_t units = units_of(p);
    // Rows the source holds (src_limit pages; saturated rather than wrapped).
    const uint64_t capacity = p.src_limit > (~0ull >> 6) ? ~0ull : p.src_limit * ROWS;
    Unit w;
    for (uint64_t u = first_unit(p.work); u < units; u = next_unit(p.work, u)) {
        if (!unit_of(p, u, w)) {
            continue;
        }
        // The page's tokens on the rank: those before its last token, and the last one itself.
        const uint32_t last = static_cast<uint32_t>(w.first + w.valid - 1);
        const uint64_t k0 = tokens_before(static_cast<uint32_t>(w.first), p.rank, p.interleave, p.num_ranks);
        const uint32_t n = static_cast<uint32_t>(tokens_before(last, p.rank, p.interleave, p.num_ranks) - k0) +
                           (place(last, p.interleave, p.num_ranks).rank == p.rank ? 1 : 0);
        if (n == 0) {
            continue;
        }
        const uint64_t q0 = k0 - shift_of(p, w.position, 0);
        if (q0 > capacity || n > capacity - q0) {
            if (lane == 0) {
                report(p.status, w.position);
            }
            continue;
        }
        const bool indexer = w.c.kind == KVS_ROWS_INDEXER;
        uint64_t scales[2] = {0, 0};
#pragma unroll
        for (uint32_t h = 0; h < 2; ++h) {
            const uint32_t i = lane + 32 * h;
            uint64_t to = 0;
            if (i < n) {
                const Place at = {p.rank, k0 + i};
                const uint64_t page = dst_page(p, w.k, w.state, at, w.block, w.position);
                const uint64_t row = at.local % ROWS;
                if (page != 0) {
                    to = page + row * (indexer ? KVS_INDEXER_HEAD_DIM : w.c.row_bytes);
                    scales[h] = page + KVS_INDEXER_SCALES_OFFSET + 4 * row;
                }
            }
            rows[i] = to;
        }
        __syncwarp();
        if (indexer) {
            // Keys of the run to the end of its first source page, then the rest from the next.
            for (uint32_t i = 0; i < n;) {
                const uint64_t q = q0 + i;
                const uint32_t row = static_cast<uint32_t>(q % ROWS);
                const uint32_t piece = n - i < ROWS - row ? n - i : ROWS - row;
                warp_rows<KEY_VECTORS, UNPACK_UNROLL>(w.src + (q / ROWS) * KVS_INDEXER_PAGE_BYTES +
                                           static_cast<uint64_t>(row) * KVS_INDEXER_HEAD_DIM,
                                       rows + i, piece);
                i += piece;
            }
#pragma unroll
            for (uint32_t h = 0; h < 2; ++h) {
                if (scales[h] != 0) {
                    const uint64_t q = q0 + lane + 32 * h;
                    *reinterpret_cast<float*>(scales[h]) = *reinterpret_cast<const float*>(
                        w.src + (q / ROWS) * KVS_INDEXER_PAGE_BYTES + KVS_INDEXER_SCALES_OFFSET + 4 * (q % ROWS));
                }
            }
        } else {
            warp_rows<LATENT_VPR, UNPACK_UNROLL>(w.src + q0 * w.c.row_bytes, rows, n);
        }
        // The next unit rewrites the table only after every lane is done reading it.
        __syncwarp();
    }
}

} // namespace decode

using namespace decode;

/* The kernels: one for layouts that keep pages whole, one per latent row size for the others, for
   PACK and for UNPACK (the host picks by the mode, the layout and the cache's rows); their launch
   bounds set the register budgets above. */
extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 2)
    kvs_decode_scatter_pages(const __grid_constant__ kvs_decode_scatter_params p) {
    scatter_pages(p);
}

extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 1)
    kvs_decode_scatter_rows_576(const __grid_constant__ kvs_decode_scatter_params p) {
    scatter_rows<KVS_LATENT_TRTLLM_ROW_BYTES / 16, false, KVS_DECODE_SLICE_ROWS, SLICE_UNROLL>(p);
}

extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 1)
    kvs_decode_pack_rows_576(const __grid_constant__ kvs_decode_scatter_params p) {
    scatter_rows<KVS_LATENT_TRTLLM_ROW_BYTES / 16, true, ROWS, ROWS_UNROLL>(p);
}

extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 1)
    kvs_decode_scatter_rows_656(const __grid_constant__ kvs_decode_scatter_params p) {
    scatter_rows<KVS_LATENT_SCALED_ROW_BYTES / 16, false, KVS_DECODE_SLICE_ROWS, SLICE_UNROLL>(p);
}

extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 1)
    kvs_decode_pack_rows_656(const __grid_constant__ kvs_decode_scatter_params p) {
    scatter_rows<KVS_LATENT_SCALED_ROW_BYTES / 16, true, ROWS, ROWS_UNROLL>(p);
}

extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 1)
    kvs_decode_scatter_rows_1152(const __grid_constant__ kvs_decode_scatter_params p) {
    scatter_rows<KVS_LATENT_BF16_ROW_BYTES / 16, false, KVS_DECODE_SLICE_ROWS, SLICE_UNROLL>(p);
}

extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 1)
    kvs_decode_pack_rows_1152(const __grid_constant__ kvs_decode_scatter_params p) {
    scatter_rows<KVS_LATENT_BF16_ROW_BYTES / 16, true, ROWS, ROWS_UNROLL>(p);
}

extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 2)
    kvs_decode_unpack_rows_576(const __grid_constant__ kvs_decode_scatter_params p) {
    unpack_rows<KVS_LATENT_TRTLLM_ROW_BYTES / 16>(p);
}

extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 2)
    kvs_decode_unpack_rows_656(const __grid_constant__ kvs_decode_scatter_params p) {
    unpack_rows<KVS_LATENT_SCALED_ROW_BYTES / 16>(p);
}

extern "C" __global__ void __launch_bounds__(KVS_DECODE_THREADS, 2)
    kvs_decode_unpack_rows_1152(const __grid_constant__ kvs_decode_scatter_params p) {
    unpack_rows<KVS_LATENT_BF16_ROW_BYTES / 16>(p);
}
