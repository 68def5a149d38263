/*
 * kvshard kernel ABI: the single source of truth for every parameter struct passed to a kernel
 * by value. `bindings/abi.rs` is generated from this file by bindgen (see tests/bindings.rs) and
 * committed; never edit it by hand.
 *
 * Conventions:
 * - every symbol starts with `kvs_` / `KVS_`;
 * - fixed-width fields only; addresses are `uint64_t` (a CUdeviceptr, or the device alias of
 *   pinned host memory), so the same struct means the same thing to the CUDA kernel and to its
 *   CPU twin in src/backend/cpu.rs, which interprets the addresses in its own address space;
 * - index arrays are int64 (what engines keep in their `out_cache_loc` / page tables); a
 *   negative entry is padding and is skipped;
 * - kernels bounds-check every index they read from memory: an out-of-range entry is skipped
 *   (nothing is written for it) and reported through `kvs_status`;
 * - sizes are asserted below and mirrored by bindgen's layout tests.
 */
#ifndef KVSHARD_ABI_H
#define KVSHARD_ABI_H

#include <stdint.h>

/* Tokens per page: fixed for the DSA configurations kvshard serves. */
#define KVS_PAGE_SIZE 64
/* Indexer: 128 e4m3 key bytes per token, one f32 scale per token, page-major blocks: the keys
   of the page's 64 tokens, then their 64 scales. A token's key and scale are one row of
   KVS_ROWS_INDEXER. */
#define KVS_INDEXER_HEAD_DIM 128
#define KVS_INDEXER_ROW_BYTES 132
#define KVS_INDEXER_PAGE_BYTES 8448
#define KVS_INDEXER_SCALES_OFFSET 8192
/* Latent rows: 512 "nope" + 64 "rope" elements. */
#define KVS_KV_LORA_RANK 512
#define KVS_ROPE_DIM 64
/* Bytes per latent row of each KVS_LATENT_* layout. */
#define KVS_LATENT_TRTLLM_ROW_BYTES 576
#define KVS_LATENT_SCALED_ROW_BYTES 656
#define KVS_LATENT_BF16_ROW_BYTES 1152
/* The scaled layout quantizes the nope in tiles of 128 elements, one f32 scale each; the scales
   follow the nope, then the rope as raw bf16. */
#define KVS_LATENT_SCALE_TILE 128
#define KVS_LATENT_SCALED_SCALES_OFFSET 512
#define KVS_LATENT_SCALED_ROPE_OFFSET 528
/* Quantizer inputs, one bf16 row per token: the 576 latent elements (nope then rope), or the
   128 indexer key elements. */
#define KVS_LATENT_INPUT_ROW_BYTES 1152
#define KVS_INDEXER_INPUT_ROW_BYTES 256
/* Target latent, target indexer, draft latent, draft indexer. */
#define KVS_MAX_COMPONENTS 4
/* kvs_write_rows units: a group of tokens x a block of (layer, component) pairs. The host counts
   units with the same numbers (kvs_work_queue bases, grids). */
#define KVS_WRITE_GROUP 8
#define KVS_WRITE_PAIR_BLOCK 4
/* kvs_resolve: entries per tile (one CTA each), and uint64 nodes per 128-byte line of tile
   state: the two trees interleave by lines, so a tree holds a multiple of this many nodes. */
#define KVS_RESOLVE_TILE 1024
#define KVS_RESOLVE_LINE_NODES 16

/*
 * Launch shapes: threads per CTA of each kernel family. Where a kernel's __launch_bounds__ use
 * them, the bounds of every embedded architecture are these; the register budget behind them
 * may differ by architecture (the kernel files say where and why). The host asks the loaded
 * module what a kernel allows (Gpu::max_threads), which is what the driver enforces.
 */
/* kvs_quantize_latent, kvs_quantize_indexer, kvs_scratch_rows, kvs_scratch_table: grid-stride
   loops over warps (latent: one token each), half-warps (indexer) or threads (scratch rows,
   scratch table), correct at any multiple of 32. They carry no launch bounds: bounds of 256
   change the quantizers' H200 code. */
#define KVS_ELEMENTWISE_THREADS 256
/* kvs_resolve_*: exactly this many threads, one CTA per KVS_RESOLVE_TILE entries. */
#define KVS_RESOLVE_THREADS 256
/* kvs_copy_blocks, kvs_copy_ranges: the most threads per CTA (host I/O wants few, fat CTAs). */
#define KVS_COPY_THREADS 1024
/* kvs_write_rows: the most threads per CTA (it sizes the CTA's shared row table). */
#define KVS_WRITE_THREADS 512
/* kvs_decode_*: the most threads per CTA (128 registers a thread: the rows kernels keep 9
   vectors a lane in flight; Method::for_decode_scatter launches 256). */
#define KVS_DECODE_THREADS 512

/* kvs_copy_ranges: the longest range (4 GiB) one entry may describe. One warp copies a range and
   counts its 16-byte vectors in 32 bits; a longer entry is skipped and reported, by the kernel
   and its CPU twin alike, instead of being narrowed. The host builds its tables from pieces of
   far less (transfer::KERNEL_PIECE_BYTES) and refuses a longer range before uploading. */
#define KVS_COPY_RANGE_MAX_BYTES 0x100000000ull

/* kvs_quantize_latent_params.layout */
#define KVS_LATENT_FP8_TRTLLM 0 /* KVS_LATENT_TRTLLM_ROW_BYTES: e4m3 nope + e4m3 rope, scale 1.0 */
#define KVS_LATENT_FP8_SCALED 1 /* KVS_LATENT_SCALED_ROW_BYTES: e4m3 nope, 4 f32 tile scales, bf16 rope */
#define KVS_LATENT_BF16 2       /* KVS_LATENT_BF16_ROW_BYTES: bf16 nope + rope */

/* kvs_quantize_indexer_params.scale */
#define KVS_SCALE_UE8M0 0 /* 2^ceil(log2(max(amax,1e-4)/448)), the sharded path */
#define KVS_SCALE_PLAIN 1 /* max(amax,1e-4)/448, the unsharded fused store */

/* kvs_page_list.kind */
#define KVS_INDEX_POSITION 0 /* entry j addresses page j; `ids` is unused */
#define KVS_INDEX_LOCAL 1    /* ids[j] is a page of this buffer */
#define KVS_INDEX_LOGICAL 2  /* ids[j] is a logical page; only pages owned by `rank` are moved,
                                to local page ids[j] / shard */

/* kvs_resolve_params.mode */
#define KVS_RESOLVE_TOKENS 0 /* entries are logical token slots; outputs are local rows */
#define KVS_RESOLVE_PAGES 1  /* entries are logical pages; outputs are local pages */

/* kvs_row_component.kind */
#define KVS_ROWS_LATENT 0  /* a row is row_bytes contiguous bytes at row * row_bytes */
#define KVS_ROWS_INDEXER 1 /* a row is 128 key bytes + one f32 scale inside page-major blocks */

/**
 * Where a kernel reports the first bad input it met. `word` is the device address of a uint64
 * that the kernel raises with atomicMax to (epoch << 32) | (0xFFFFFFFF - position); the host
 * gives every launch a new, larger epoch, so a word whose high half equals this launch's epoch
 * names the smallest bad position of this launch and older reports never mask newer ones.
 * word == 0 disables reporting.
 */
typedef struct kvs_status {
    uint64_t word;
    uint32_t epoch;
    uint32_t reserved;
} kvs_status;

/**
 * Dynamic work distribution for the copy kernels: each warp starts at its grid position,
 * counted CTA-major (unit i < warps in the grid goes to CTA i % grid, so a small launch still
 * spreads over every SM), and takes every later unit with
 * `atomicAdd(counter, 1) - base + (warps in the grid)` instead of striding the grid, so warps
 * that drew short or skipped units take more and the grid ends together. The counter is never
 * reset: a warp stops at its first take past the last unit, so every launch adds exactly its
 * unit count to it, and the host (which launches on one stream) passes the running total as
 * `base`. counter == 0 selects plain grid-stride assignment.
 * (kvs_copy_blocks gains from it; kvs_write_rows, whose units are mostly skipped after one slot
 * read, loses to counter contention, so its host launches it with counter == 0.)
 */
typedef struct kvs_work_queue {
    uint64_t counter; /**< device address of a uint64 counter */
    uint64_t base;    /**< the counter's value when this launch starts */
} kvs_work_queue;

/** bf16 rows [num_tokens][576] (nope then rope) -> latent rows at dst + slots[i] * row_bytes. */
typedef struct kvs_quantize_latent_params {
    uint64_t src;        /**< bf16 input rows */
    uint64_t src_stride; /**< bytes between input rows, multiple of 16 */
    uint64_t slots;      /**< int64[num_tokens]: destination row; < 0 skips */
    uint64_t dst;        /**< latent buffer */
    uint64_t dst_rows;   /**< rows in dst; slots >= dst_rows are reported */
    uint64_t num_tokens;
    uint32_t layout; /**< KVS_LATENT_* */
    uint32_t reserved;
    kvs_status status;
} kvs_quantize_latent_params;

/** bf16 keys [num_tokens][128] -> e4m3 keys + f32 scale in page-major 8448-byte indexer blocks. */
typedef struct kvs_quantize_indexer_params {
    uint64_t src;
    uint64_t src_stride;
    uint64_t slots;     /**< int64[num_tokens]: destination token slot; < 0 skips */
    uint64_t dst;       /**< indexer buffer */
    uint64_t dst_pages; /**< pages in dst; slots >= 64 * dst_pages are reported */
    uint64_t num_tokens;
    uint32_t scale; /**< KVS_SCALE_* */
    uint32_t reserved;
    kvs_status status;
} kvs_quantize_indexer_params;

/**
 * Owner-local index resolution: for one rank, the stable-ordered subset of `entries` it owns,
 * their positions in `entries`, their local rows (tokens) or local pages, and the count.
 * Single pass: tiles add their counts to a Fenwick tree in `tile_state` and read their prefixes
 * from it. `tile_state` holds two trees of `state_tiles` uint64 nodes (a multiple of KVS_RESOLVE_LINE_NODES), their
 * 128-byte lines interleaved, zero when first used; launches alternate between them (`parity`),
 * and each launch zeroes the first `clear_tiles` nodes of the other one: the previous launch's
 * tile count.
 */
typedef struct kvs_resolve_params {
    uint64_t entries; /**< int64[num_entries]; < 0 is padding (not owned, not an error) */
    uint64_t num_entries;
    uint64_t limit;         /**< entries >= limit are reported and not owned */
    uint64_t out_positions; /**< int32[num_entries] */
    uint64_t out_local;     /**< int64[num_entries] */
    uint64_t out_count;     /**< uint64[1] */
    uint64_t tile_state;    /**< uint64[2 * state_tiles], 128-byte aligned: the two trees, owned by the caller */
    uint32_t shard;
    uint32_t rank;
    uint32_t mode;        /**< KVS_RESOLVE_* */
    uint32_t parity;      /**< tree this launch uses (0 or 1); its first tiles nodes must be zero */
    uint32_t state_tiles; /**< nodes per tree: a multiple of KVS_RESOLVE_LINE_NODES, at least this launch's tiles */
    uint32_t clear_tiles; /**< nodes of the other tree to zero, at most state_tiles */
    kvs_status status;
} kvs_resolve_params;

/** Scratch translation: out_rows[i] = page_pos[slots[i] / 64] * 64 + slots[i] % 64. */
typedef struct kvs_scratch_rows_params {
    uint64_t slots; /**< int64[num_slots]; < 0 gives -1 */
    uint64_t num_slots;
    uint64_t page_table; /**< int64[table_len]: scratch page of each logical page; < 0 unmapped */
    uint64_t table_len;
    uint64_t scratch_rows; /**< rows in the scratch buffer: bound on every output row */
    uint64_t out_rows;     /**< int64[num_slots]; -1 for padding and reported entries */
    kvs_status status;
} kvs_scratch_rows_params;

/**
 * Scratch page table of a CP prefill batch (src/shard/gather.rs): for every logical page l below
 * table_len, table[l] = scratch_pages[i] where pages[i] == l (the entry the lower-bound binary
 * search of l in `pages` finds), or trash_page when l is not mapped. Entries must have strictly
 * ascending pages below table_len and scratch pages below trash_page (every mapped page lies in
 * the prefix or chunk region, before the trash page); a bad entry is reported at its position
 * and a page whose entry has a bad scratch page maps to trash_page. (Unsorted entries are
 * reported too; the table then holds whatever the search finds, the same on every backend.)
 */
typedef struct kvs_scratch_table_params {
    uint64_t pages;         /**< int64[num_entries]: mapped logical pages, strictly ascending */
    uint64_t scratch_pages; /**< int64[num_entries]: the scratch page of each */
    uint64_t num_entries;
    uint64_t table;      /**< int64[table_len]: output, one scratch page per logical page */
    uint64_t table_len;  /**< logical pages of the shard group, at most INT64_MAX */
    uint64_t trash_page; /**< the scratch slot's last page, at most INT64_MAX */
    kvs_status status;
} kvs_scratch_table_params;

/** How one side of a block copy addresses the blocks of one component. */
typedef struct kvs_block_side {
    uint64_t page_stride; /**< bytes between pages of one layer */
    uint64_t row_stride;  /**< bytes between rows of one block */
} kvs_block_side;

/**
 * One component of a block copy. Row r of page p of layer l sits at
 * layer_base + p * page_stride + r * row_stride on each side; row_bytes is a multiple of 16
 * and every address is 16-byte aligned. A page-major indexer block is one row of 8448 bytes.
 */
typedef struct kvs_block_component {
    uint32_t rows;      /**< rows per block */
    uint32_t row_bytes; /**< bytes per row */
    kvs_block_side src;
    kvs_block_side dst;
} kvs_block_component;

/**
 * One (layer, component) of a copy: base addresses of that layer on each side. Pairs are
 * processed in table order; `signal` is the ready counter the pair counts towards.
 */
typedef struct kvs_layer_pair {
    uint64_t src;
    uint64_t dst;
    uint32_t component;
    uint32_t signal;
} kvs_layer_pair;

/** Which page of a side entry j of a copy addresses (see KVS_INDEX_*). */
typedef struct kvs_page_list {
    uint64_t ids;   /**< int64[num_pages] for LOCAL and LOGICAL; < 0 skips the entry */
    uint64_t limit; /**< exclusive bound on the resulting page of this side */
    uint32_t kind;
    uint32_t shard; /**< LOGICAL: shard size N */
    uint32_t rank;  /**< LOGICAL: this rank */
    uint32_t reserved;
} kvs_page_list;

/**
 * Block copy: for every pair k and entry j, copy the block of page src(j) of the pair's source
 * layer to page dst(j) of its destination layer. Entry j moves only if every LOGICAL side owns
 * it. Work is flattened as unit u = k * num_pages + j and spread over warps in that order, so
 * pairs complete roughly in table order. After finishing (or skipping) a unit, its warp adds 1
 * to signals[pairs[k].signal] (uint32 counters; signals == 0 disables): a counter reaches
 * base + num_pages * (pairs with that signal) exactly when those pairs have fully landed.
 * A pair naming a component >= num_components is skipped and reported as position k * num_pages.
 */
typedef struct kvs_copy_blocks_params {
    kvs_block_component components[KVS_MAX_COMPONENTS];
    uint64_t pairs; /**< kvs_layer_pair[num_pairs] */
    uint64_t num_pages;
    kvs_page_list src_pages;
    kvs_page_list dst_pages;
    uint64_t signals;
    uint32_t num_pairs;
    uint32_t num_components;
    kvs_work_queue work;
    kvs_status status;
} kvs_copy_blocks_params;

/*
 * kvs_copy_blocks_inline: bytes of pair table and page ids a launch carries in its own
 * parameters (the kernel takes the struct by value, `__grid_constant__`: parameters may be up
 * to 32,764 bytes on sm_70+ with CUDA >= 12.1). A P/D chunk's tables (24 bytes per layer pair,
 * 16 per page) fit up to a few hundred pages: such a launch needs no upload, no table memory
 * and no copy in the stream before it; larger tables go through kvs_copy_blocks.
 */
#define KVS_COPY_INLINE_BYTES 8192

/**
 * kvs_copy_blocks with its tables inline: exactly kvs_copy_blocks over `copy`, except that
 * `copy.pairs` and the `ids` of each LOCAL or LOGICAL page list are byte offsets into `table`
 * (8-byte aligned; the pairs and ids they name lie inside it: checked by the host before the
 * launch) instead of device addresses. `table` holds the same bytes kvs_copy_blocks reads from
 * device memory, so the two kernels move the same bytes.
 */
typedef struct kvs_copy_blocks_inline_params {
    kvs_copy_blocks_params copy;
    uint64_t table[KVS_COPY_INLINE_BYTES / 8];
} kvs_copy_blocks_inline_params;

/** One component of an owned-row write. */
typedef struct kvs_row_component {
    uint32_t kind;      /**< KVS_ROWS_* */
    uint32_t row_bytes; /**< latent: bytes per row (multiple of 16); indexer: KVS_INDEXER_ROW_BYTES */
} kvs_row_component;

/**
 * Owned-row write: chunk token i (logical slot slots[i]) is row i of each pair's source
 * (staging) layer; if this rank owns the slot, it is copied to the local row of the pair's
 * destination (pool) layer. Both sides use the component's row addressing. A pair naming a
 * component >= num_components is skipped and reported as position num_slots + k.
 */
typedef struct kvs_write_rows_params {
    kvs_row_component components[KVS_MAX_COMPONENTS];
    uint64_t pairs; /**< kvs_layer_pair[num_pairs] (signal unused) */
    uint64_t slots; /**< int64[num_slots]; < 0 skips */
    uint64_t num_slots;
    uint64_t slot_limit; /**< logical slots >= slot_limit, and slots on the reserved padding
                              pages 0..shard, are reported and skipped */
    uint64_t dst_rows;   /**< local rows per destination layer: bound on every local row */
    uint32_t num_pairs;
    uint32_t shard;
    uint32_t rank;
    uint32_t num_components;
    kvs_work_queue work;
    kvs_status status;
} kvs_write_rows_params;

/** One contiguous byte range to copy. */
typedef struct kvs_range {
    uint64_t src;
    uint64_t dst;
    uint64_t bytes;
} kvs_range;

/**
 * Copy every range of a table (P/D descriptors executed on the GPU). A range longer than
 * KVS_COPY_RANGE_MAX_BYTES is skipped and reported as its position in the table.
 */
typedef struct kvs_copy_ranges_params {
    uint64_t ranges; /**< kvs_range[num_ranges] */
    uint64_t num_ranges;
    kvs_status status;
} kvs_copy_ranges_params;

/*
 * Decode context parallelism (docs/dcp.md): kvs_decode_scatter moves one prefill rank's chunk into
 * the rows of the M ranks of a decode server sharded by token, I tokens at a time: token t of the
 * request lives on decode rank (t / I) % M as its local token k = (t / (I * M)) * I + t % I, in
 * row k % 64 of the rank's (k / 64)-th page of the request. The Rust twin of this placement is
 * shard::DecodeLayout.
 */
/* The most decode ranks one scatter may write (shard::MAX_DECODE_RANKS). */
#define KVS_DECODE_MAX_RANKS 1024
/* Rows of a page one unit of a DIRECT rows kernel moves (a slice: below). */
#define KVS_DECODE_SLICE_ROWS 16
/* The most tokens of a request a scatter moves: end_token is at most this, so the kernels place
   tokens in 32 bits (64-bit divisions cost them registers they spill on Blackwell). */
#define KVS_DECODE_MAX_TOKENS 0x100000000ull

/** One decode rank of a scatter: its pages of the request and its pool's size. */
typedef struct kvs_decode_rank {
    uint64_t pages;       /**< int64[num_pages]: the rank's page holding each of its local pages of
                               the request, for the latent section; < 0 skips the rows */
    uint64_t state_pages; /**< int64[num_pages]: the same for the state (indexer) section; 0 when the
                               launch has no state section */
    uint64_t num_pages;   /**< local pages the rank registered: a row past them is reported */
    uint64_t limit;       /**< pages per layer of the rank's pool: a page at or past it is reported */
} kvs_decode_rank;

/** One source page of a scatter: the prefill rank's local page holding sequence page `position`
    (tokens 64 * position to 64 * position + 63). */
typedef struct kvs_decode_entry {
    int64_t page;      /**< local page of the source; < 0 skips the entry */
    uint64_t position; /**< sequence page */
} kvs_decode_entry;

/** One (component, layer) of a scatter: the source layer's base; its base on every decode rank
    is in the launch's dst_bases. */
typedef struct kvs_decode_pair {
    uint64_t src;
    uint32_t component;
    uint32_t reserved;
} kvs_decode_pair;

/* What a kvs_decode_scatter launch does with the rows it places (its `mode`; docs/dcp.md, "Over
   NIXL and Mooncake"). */
/* Each row from its source page to its rank's page (below). */
#define KVS_DECODE_DIRECT 0u
/* Each rank's rows packed densely: a row lands at row index (local token - shift) of its rank's
   pages, so the rows of one launch on one rank fill that rank's destination (a bounce region)
   from its page 0, in sequence order. */
#define KVS_DECODE_PACK 1u
/* One rank's rows unpacked: the row of local token k is read from row index (k - shift) of the
   source layer's pages (what KVS_DECODE_PACK wrote), and lands at its rank's page as in
   KVS_DECODE_DIRECT; the entries' pages are not read (< 0 still skips the entry). */
#define KVS_DECODE_UNPACK 2u

/**
 * Scatter: for every pair k and entry j of the pair's section, every row o of source page
 * entries[j].page of the pair's source layer whose token t = 64 * position + o is below
 * end_token is copied to its decode rank's row (above), in that rank's layer base
 * dst_bases[k * T + s]: T the ranks the tables hold, s the rank's place among them (below).
 * Both sides store blocks packed (pages one block apart): a latent block is 64 rows of
 * row_bytes; an indexer block is 64 x 128 key bytes then 64 f32 scales, and a row is a token's
 * key and scale. Pairs [0, num_kv_pairs) move the latent section's entries through the ranks'
 * `pages`, pairs [num_kv_pairs, num_pairs) the state section's through their `state_pages`.
 * Units u = k * num_entries + j for the latent section, then num_kv_pairs * num_entries +
 * (k - num_kv_pairs) * num_state_entries + j, spread over warps by the work queue; the DIRECT
 * rows kernels cut each latent-section unit into 64 / KVS_DECODE_SLICE_ROWS slices of that many
 * rows (units u * slices + s, the state section's after them), so the launch's unit count is
 * the latent section's times the slices plus the state section's (launch::decode_scatter_units). Reported
 * positions: latent entry j at j, state entry j at num_entries + j (a source page at or past
 * src_limit, a rank's row past its num_pages, a destination page at or past its limit), pair k
 * naming a component >= num_components at num_entries + num_state_entries + k.
 *
 * Ranks: with one_rank = 0 every rank's rows move and the tables hold every rank (T = num_ranks,
 * rank r at s = r); with one_rank = 1 only the rows of rank `rank`'s tokens move (rank <
 * num_ranks) and the tables hold that rank alone (T = 1, s = 0). Modes (KVS_DECODE_*): PACK and
 * UNPACK read a row's shift from shifts[position * T + s], position the unit's reported position;
 * UNPACK needs one_rank, and reports an entry whose rows of the rank fall outside the source's
 * src_limit pages at its position (none of them moved).
 *
 * The kernels: DIRECT launches kvs_decode_scatter_pages where the layout keeps pages whole
 * (num_ranks == 1, or interleave a multiple of 64: each entry's rows are one run on one rank),
 * else kvs_decode_scatter_rows_576, _656 or _1152 by the latent components' row bytes (every
 * latent component of a launch has the same rows); PACK kvs_decode_pack_rows_576, _656 or _1152
 * whatever the layout (a rank's dense rows need not start a page); UNPACK
 * kvs_decode_unpack_rows_576, _656 or _1152.
 */
typedef struct kvs_decode_scatter_params {
    kvs_row_component components[KVS_MAX_COMPONENTS];
    uint64_t pairs;         /**< kvs_decode_pair[num_pairs] */
    uint64_t dst_bases;     /**< uint64[num_pairs * T] */
    uint64_t ranks;         /**< kvs_decode_rank[T] */
    uint64_t entries;       /**< kvs_decode_entry[num_entries]: the latent section's */
    uint64_t num_entries;
    uint64_t state_entries; /**< kvs_decode_entry[num_state_entries]: the state section's */
    uint64_t num_state_entries;
    uint64_t shifts;        /**< uint64[(num_entries + num_state_entries) * T]: PACK and UNPACK */
    uint64_t src_limit; /**< pages per layer of the source */
    uint64_t end_token; /**< tokens at or past it are not moved (the sequence's end so far); at
                             most KVS_DECODE_MAX_TOKENS */
    uint32_t num_pairs;
    uint32_t num_kv_pairs;
    uint32_t num_ranks;  /**< M, 1 to KVS_DECODE_MAX_RANKS */
    uint32_t interleave; /**< I, at least 1 */
    uint32_t num_components;
    uint32_t mode;       /**< KVS_DECODE_DIRECT, _PACK or _UNPACK */
    uint32_t one_rank;   /**< 1: only rank `rank`'s rows move (UNPACK needs it); 0: every rank's */
    uint32_t rank;
    kvs_work_queue work;
    kvs_status status;
} kvs_decode_scatter_params;

/* The benchmark kernels (cuda/bench.cu) are built only with the cargo feature `bench-kernels`;
   their parameter structs stay here, the one ABI source, whether built or not. */

/** Benchmark load: out[i] = a[i] + b[i] over bf16, a memory-bound stand-in for a forward pass. */
typedef struct kvs_bench_add_params {
    uint64_t a;
    uint64_t b;
    uint64_t out;
    uint64_t count;
} kvs_bench_add_params;

/** Benchmark floor: reads `bytes` (a multiple of 16) at `src` once, as fast as the GPU can. */
typedef struct kvs_bench_read_params {
    uint64_t src;
    uint64_t bytes;
    uint64_t sink; /**< uint64[1], written only when the data xor to a value no test input has */
} kvs_bench_read_params;

#ifdef __cplusplus
#define KVS_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define KVS_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif
KVS_STATIC_ASSERT(KVS_LATENT_TRTLLM_ROW_BYTES == KVS_KV_LORA_RANK + KVS_ROPE_DIM, "trtllm row");
KVS_STATIC_ASSERT(KVS_LATENT_SCALED_SCALES_OFFSET == KVS_KV_LORA_RANK, "scales after the nope");
KVS_STATIC_ASSERT(KVS_LATENT_SCALED_ROPE_OFFSET ==
                      KVS_LATENT_SCALED_SCALES_OFFSET + 4 * (KVS_KV_LORA_RANK / KVS_LATENT_SCALE_TILE),
                  "rope after the scales");
KVS_STATIC_ASSERT(KVS_LATENT_SCALED_ROW_BYTES == KVS_LATENT_SCALED_ROPE_OFFSET + 2 * KVS_ROPE_DIM, "scaled row");
KVS_STATIC_ASSERT(KVS_LATENT_BF16_ROW_BYTES == 2 * (KVS_KV_LORA_RANK + KVS_ROPE_DIM), "bf16 row");
KVS_STATIC_ASSERT(KVS_LATENT_INPUT_ROW_BYTES == 2 * (KVS_KV_LORA_RANK + KVS_ROPE_DIM), "latent input row");
KVS_STATIC_ASSERT(KVS_INDEXER_INPUT_ROW_BYTES == 2 * KVS_INDEXER_HEAD_DIM, "indexer input row");
KVS_STATIC_ASSERT(KVS_INDEXER_ROW_BYTES == KVS_INDEXER_HEAD_DIM + 4, "indexer row: key + f32 scale");
KVS_STATIC_ASSERT(KVS_INDEXER_SCALES_OFFSET == KVS_PAGE_SIZE * KVS_INDEXER_HEAD_DIM, "indexer scales");
KVS_STATIC_ASSERT(KVS_INDEXER_PAGE_BYTES == KVS_PAGE_SIZE * KVS_INDEXER_ROW_BYTES, "indexer block");
KVS_STATIC_ASSERT(KVS_RESOLVE_TILE % KVS_RESOLVE_THREADS == 0, "resolve tile: whole items per thread");
KVS_STATIC_ASSERT(KVS_ELEMENTWISE_THREADS % 32 == 0 && KVS_RESOLVE_THREADS % 32 == 0 &&
                      KVS_COPY_THREADS % 32 == 0 && KVS_WRITE_THREADS % 32 == 0 && KVS_DECODE_THREADS % 32 == 0,
                  "whole warps");
KVS_STATIC_ASSERT(KVS_COPY_THREADS <= 1024 && KVS_WRITE_THREADS <= 1024 && KVS_DECODE_THREADS <= 1024,
                  "CUDA's CTA limit");
KVS_STATIC_ASSERT(KVS_PAGE_SIZE % KVS_DECODE_SLICE_ROWS == 0, "a page is whole slices");
KVS_STATIC_ASSERT(sizeof(kvs_status) == 16, "kvs_status");
KVS_STATIC_ASSERT(sizeof(kvs_quantize_latent_params) == 72, "kvs_quantize_latent_params");
KVS_STATIC_ASSERT(sizeof(kvs_quantize_indexer_params) == 72, "kvs_quantize_indexer_params");
KVS_STATIC_ASSERT(sizeof(kvs_resolve_params) == 96, "kvs_resolve_params");
KVS_STATIC_ASSERT(sizeof(kvs_scratch_rows_params) == 64, "kvs_scratch_rows_params");
KVS_STATIC_ASSERT(sizeof(kvs_scratch_table_params) == 64, "kvs_scratch_table_params");
KVS_STATIC_ASSERT(sizeof(kvs_block_component) == 40, "kvs_block_component");
KVS_STATIC_ASSERT(sizeof(kvs_layer_pair) == 24, "kvs_layer_pair");
KVS_STATIC_ASSERT(sizeof(kvs_page_list) == 32, "kvs_page_list");
KVS_STATIC_ASSERT(sizeof(kvs_work_queue) == 16, "kvs_work_queue");
KVS_STATIC_ASSERT(sizeof(kvs_copy_blocks_params) == 288, "kvs_copy_blocks_params");
KVS_STATIC_ASSERT(sizeof(kvs_copy_blocks_inline_params) == 288 + KVS_COPY_INLINE_BYTES,
                  "kvs_copy_blocks_inline_params");
KVS_STATIC_ASSERT(sizeof(kvs_copy_blocks_inline_params) <= 32764, "the parameter space of sm_70+");
KVS_STATIC_ASSERT(KVS_COPY_INLINE_BYTES % 8 == 0, "whole uint64 words");
KVS_STATIC_ASSERT(sizeof(kvs_write_rows_params) == 120, "kvs_write_rows_params");
KVS_STATIC_ASSERT(sizeof(kvs_range) == 24, "kvs_range");
KVS_STATIC_ASSERT(sizeof(kvs_copy_ranges_params) == 32, "kvs_copy_ranges_params");
KVS_STATIC_ASSERT(sizeof(kvs_decode_rank) == 32, "kvs_decode_rank");
KVS_STATIC_ASSERT(sizeof(kvs_decode_entry) == 16, "kvs_decode_entry");
KVS_STATIC_ASSERT(sizeof(kvs_decode_pair) == 16, "kvs_decode_pair");
KVS_STATIC_ASSERT(sizeof(kvs_decode_scatter_params) == 176, "kvs_decode_scatter_params");
KVS_STATIC_ASSERT(sizeof(kvs_bench_add_params) == 32, "kvs_bench_add_params");
KVS_STATIC_ASSERT(sizeof(kvs_bench_read_params) == 24, "kvs_bench_read_params");

#endif /* KVSHARD_ABI_H */
