/*
 * The attention scratch of a CP prefill batch (src/shard/gather.rs, docs/design.md "Prefill"):
 * the page table that maps every logical page to its scratch page, and slots translated into
 * scratch rows through it.
 *
 * kvs_scratch_table writes, for every logical page of the shard group, the scratch page the
 * attention kernel reads it from: its place in the owner-major prefix region or the chunk
 * region, or the trash page. The host uploads only the batch's mapped pages (sorted), not a
 * table as long as the logical index space. One thread per logical page, grid-stride: a
 * lower-bound binary search of the page in the mapped pages (log2 of the batch's pages, ~14
 * reads for 16K pages, all L1/L2 hits after the first warps), then one coalesced 8-byte store.
 * A second grid-stride pass checks the entries. Bytes: 8 per logical page written; the floor is
 * that over the device copy bandwidth.
 *
 * kvs_scratch_rows: out_rows[i] = table[slots[i] / 64] * 64 + slots[i] % 64, one thread per
 * slot, grid-stride; a slot whose page is unmapped or whose row falls outside the scratch is
 * reported.
 */
#include "common.cuh"

using namespace kvs;

namespace {

/* Index of the first of pages[0..n) not below `page` (n if none). The CPU twin takes the same
 * halving steps, so even unsorted (reported) entries give the same table on both. */
__device__ __forceinline__ uint64_t lower_bound(const int64_t* pages, uint64_t n, int64_t page) {
    uint64_t lo = 0;
    uint64_t hi = n;
    while (lo < hi) {
        const uint64_t mid = lo + (hi - lo) / 2;
        if (pages[mid] < page) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

__device__ __forceinline__ bool scratch_ok(int64_t scratch, uint64_t trash_page) {
    return scratch >= 0 && static_cast<uint64_t>(scratch) < trash_page;
}

} // namespace

extern "C" __global__ void kvs_scratch_table(const __grid_constant__ kvs_scratch_table_params p) {
    const int64_t* pages = reinterpret_cast<const int64_t*>(p.pages);
    const int64_t* scratch = reinterpret_cast<const int64_t*>(p.scratch_pages);
    int64_t* table = reinterpret_cast<int64_t*>(p.table);
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t trash = static_cast<int64_t>(p.trash_page);
    for (uint64_t l = first; l < p.table_len; l += stride) {
        const int64_t page = static_cast<int64_t>(l);
        const uint64_t i = lower_bound(pages, p.num_entries, page);
        int64_t out = trash;
        if (i < p.num_entries && pages[i] == page && scratch_ok(scratch[i], p.trash_page)) {
            out = scratch[i];
        }
        table[l] = out;
    }
    for (uint64_t i = first; i < p.num_entries; i += stride) {
        const int64_t page = pages[i];
        const bool bad = page < 0 || static_cast<uint64_t>(page) >= p.table_len ||
                         (i > 0 && page <= pages[i - 1]) || !scratch_ok(scratch[i], p.trash_page);
        if (bad) {
            report(p.status, i);
        }
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
