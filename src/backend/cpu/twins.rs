//! The CPU twin of every kernel: each function here is the specification its kernel is tested
//! against, byte for byte, and takes the same parameter struct.

use half::bf16;

use crate::abi;
use crate::backend::status_word::raise;
use crate::error::{Error, Result};
use crate::fp8;
use crate::geometry::{
    IndexerScale, LatentLayout, INDEXER_HEAD_DIM, INDEXER_PAGE_BYTES, INDEXER_SCALES_OFFSET,
    LATENT_DIM, PAGE_SIZE,
};
use crate::index::{LogicalPage, Slot};
use crate::shard::{DecodeLayout, Placement};

use super::arena::Arena;

/// Raises the status word in `mem` for a bad input at `position`.
pub(super) fn report(mem: &mut Arena, status: &abi::kvs_status, position: u64) -> Result<()> {
    if status.word == 0 {
        return Ok(());
    }
    let mut word = mem.u64_at(status.word)?;
    raise(&mut word, status, position);
    mem.set_u64(status.word, word)
}

pub(super) fn bf16s(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

/// One `kvs_copy_blocks` or `kvs_copy_blocks_inline` launch as the twin runs it: the header,
/// and where its pair table and page ids are read from.
pub(super) struct BlockLaunch {
    pub(super) p: abi::kvs_copy_blocks_params,
    /// `None`: the header's table addresses are arena addresses (`kvs_copy_blocks`); else they
    /// are byte offsets into these words, the launch's own table (`kvs_copy_blocks_inline`).
    pub(super) inline: Option<Box<[u64]>>,
}

impl BlockLaunch {
    /// The little-endian word at byte `at` of the inline table (offsets were checked by
    /// `check::copy_blocks_inline`; an error, not a panic, if one were not).
    fn word(table: &[u64], at: u64) -> Result<u64> {
        usize::try_from(at / 8)
            .ok()
            .filter(|_| at % 8 == 0)
            .and_then(|i| table.get(i))
            .copied()
            .ok_or_else(|| {
                Error::InvalidArgument(format!("inline block-copy table read at byte {at}"))
            })
    }

    /// Pair `k` of the table.
    fn pair(&self, mem: &Arena, k: u64) -> Result<abi::kvs_layer_pair> {
        let Some(table) = &self.inline else {
            return mem.pair(self.p.pairs, k);
        };
        let at = self.p.pairs + 24 * k;
        let packed = Self::word(table, at + 16)?;
        Ok(abi::kvs_layer_pair {
            src: Self::word(table, at)?,
            dst: Self::word(table, at + 8)?,
            component: packed as u32,
            signal: (packed >> 32) as u32,
        })
    }

    /// The CPU twin of `page_id` in cuda/copy.cu: the raw id of entry `j` of `list`.
    fn page_id(&self, mem: &Arena, list: &abi::kvs_page_list, j: u64) -> Result<i64> {
        if list.kind == abi::KVS_INDEX_POSITION {
            return Ok(j as i64);
        }
        match &self.inline {
            None => mem.i64_at(list.ids + 8 * j),
            Some(table) => Self::word(table, list.ids + 8 * j).map(|w| w as i64),
        }
    }
}

/// The CPU twin of `resolve_page` in cuda/copy.cu: raw id `id` of entry `j` as a page.
pub(super) fn resolve_page(
    mem: &mut Arena,
    list: &abi::kvs_page_list,
    id: i64,
    j: u64,
    status: &abi::kvs_status,
) -> Result<Option<u64>> {
    if id < 0 {
        return Ok(None);
    }
    let mut page = id as u64;
    if list.kind == abi::KVS_INDEX_LOGICAL {
        let placement = Placement::new(list.shard)?;
        let logical = LogicalPage(page);
        if placement.owner(logical) != list.rank {
            return Ok(None);
        }
        page = placement.local(logical).0;
    }
    if page >= list.limit {
        report(mem, status, j)?;
        return Ok(None);
    }
    Ok(Some(page))
}

/// Unit `u` of a block copy: entry `j` of pair `k`, then the pair's signal.
pub(super) fn copy_block_unit(mem: &mut Arena, launch: &BlockLaunch, u: u64) -> Result<()> {
    let p = &launch.p;
    let k = u / p.num_pages;
    let j = u - k * p.num_pages;
    let pair = launch.pair(mem, k)?;
    let src_id = launch.page_id(mem, &p.src_pages, j)?;
    let dst_id = launch.page_id(mem, &p.dst_pages, j)?;
    let src_page = resolve_page(mem, &p.src_pages, src_id, j, &p.status)?;
    let dst_page = resolve_page(mem, &p.dst_pages, dst_id, j, &p.status)?;
    let component_ok = pair.component < p.num_components;
    if !component_ok && j == 0 {
        report(mem, &p.status, u)?;
    }
    if let (Some(s), Some(d), true) = (src_page, dst_page, component_ok) {
        let c = &p.components[pair.component as usize];
        let src = pair.src + s * c.src.page_stride;
        let dst = pair.dst + d * c.dst.page_stride;
        for r in 0..u64::from(c.rows) {
            mem.copy(
                dst + r * c.dst.row_stride,
                src + r * c.src.row_stride,
                c.row_bytes as usize,
            )?;
        }
    }
    if p.signals != 0 {
        let at = p.signals + 4 * u64::from(pair.signal);
        let v = mem.u32_at(at)?.wrapping_add(1);
        mem.bytes_mut(at, 4)?.copy_from_slice(&v.to_le_bytes());
    }
    Ok(())
}

pub(super) fn quantize_latent(mem: &mut Arena, p: &abi::kvs_quantize_latent_params) -> Result<()> {
    let layout = match p.layout {
        abi::KVS_LATENT_FP8_TRTLLM => LatentLayout::Fp8Trtllm,
        abi::KVS_LATENT_FP8_SCALED => LatentLayout::Fp8Scaled,
        _ => LatentLayout::Bf16,
    };
    let row_bytes = layout.row_bytes();
    let mut row = vec![0u8; row_bytes];
    for token in 0..p.num_tokens {
        let slot = mem.i64_at(p.slots + 8 * token)?;
        if slot < 0 {
            continue;
        }
        if slot as u64 >= p.dst_rows {
            report(mem, &p.status, token)?;
            continue;
        }
        let input = bf16s(mem.bytes(p.src + token * p.src_stride, 2 * LATENT_DIM)?);
        fp8::quantize_latent_row(layout, &input, &mut row)?;
        mem.bytes_mut(p.dst + slot as u64 * row_bytes as u64, row_bytes)?
            .copy_from_slice(&row);
    }
    Ok(())
}

pub(super) fn quantize_indexer(
    mem: &mut Arena,
    p: &abi::kvs_quantize_indexer_params,
) -> Result<()> {
    let kind = if p.scale == abi::KVS_SCALE_UE8M0 {
        IndexerScale::Ue8m0
    } else {
        IndexerScale::Plain
    };
    let mut codes = [0u8; INDEXER_HEAD_DIM];
    for token in 0..p.num_tokens {
        let slot = mem.i64_at(p.slots + 8 * token)?;
        if slot < 0 {
            continue;
        }
        if slot as u64 >= p.dst_pages.saturating_mul(PAGE_SIZE as u64) {
            report(mem, &p.status, token)?;
            continue;
        }
        let keys = bf16s(mem.bytes(p.src + token * p.src_stride, 2 * INDEXER_HEAD_DIM)?);
        let scale = fp8::quantize_indexer_row(&keys, kind, &mut codes)?;
        let block = p.dst + (slot as u64 / PAGE_SIZE as u64) * INDEXER_PAGE_BYTES as u64;
        let offset = slot as u64 % PAGE_SIZE as u64;
        mem.bytes_mut(block + offset * INDEXER_HEAD_DIM as u64, INDEXER_HEAD_DIM)?
            .copy_from_slice(&codes);
        mem.bytes_mut(block + INDEXER_SCALES_OFFSET as u64 + 4 * offset, 4)?
            .copy_from_slice(&scale.to_le_bytes());
    }
    Ok(())
}

pub(super) fn resolve(mem: &mut Arena, p: &abi::kvs_resolve_params) -> Result<()> {
    let placement = Placement::new(p.shard)?;
    let mut count = 0u64;
    for i in 0..p.num_entries {
        let e = mem.i64_at(p.entries + 8 * i)?;
        if e < 0 {
            continue;
        }
        let e = e as u64;
        if e >= p.limit {
            report(mem, &p.status, i)?;
            continue;
        }
        let owned = if p.mode == abi::KVS_RESOLVE_TOKENS {
            (placement.slot_owner(Slot(e)) == p.rank).then(|| placement.local_row(Slot(e)))
        } else {
            (placement.owner(LogicalPage(e)) == p.rank).then(|| placement.local(LogicalPage(e)).0)
        };
        if let Some(local) = owned {
            mem.bytes_mut(p.out_positions + 4 * count, 4)?
                .copy_from_slice(&(i as i32).to_le_bytes());
            mem.bytes_mut(p.out_local + 8 * count, 8)?
                .copy_from_slice(&(local as i64).to_le_bytes());
            count += 1;
        }
    }
    if p.num_entries > 0 {
        mem.set_u64(p.out_count, count)?;
    }
    Ok(())
}

pub(super) fn scratch_rows(mem: &mut Arena, p: &abi::kvs_scratch_rows_params) -> Result<()> {
    let page_size = PAGE_SIZE as u64;
    for i in 0..p.num_slots {
        let slot = mem.i64_at(p.slots + 8 * i)?;
        let mut row = -1i64;
        if slot >= 0 {
            let page = slot as u64 / page_size;
            let scratch_page = if page < p.table_len {
                mem.i64_at(p.page_table + 8 * page)?
            } else {
                -1
            };
            // Bound the page before multiplying, so a huge table entry cannot wrap into range.
            let mapped =
                scratch_page >= 0 && (scratch_page as u64) < p.scratch_rows.div_ceil(page_size);
            let candidate = if mapped {
                scratch_page as u64 * page_size + slot as u64 % page_size
            } else {
                p.scratch_rows
            };
            if candidate < p.scratch_rows {
                row = candidate as i64;
            } else {
                report(mem, &p.status, i)?;
            }
        }
        mem.bytes_mut(p.out_rows + 8 * i, 8)?
            .copy_from_slice(&row.to_le_bytes());
    }
    Ok(())
}

/// `count` int64s at `addr`, or an error when they do not fit one allocation.
pub(super) fn i64s_at(mem: &Arena, addr: u64, count: u64) -> Result<Vec<i64>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    let bytes = count
        .checked_mul(8)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Error::overflow(format!("bytes of {count} int64s")))?;
    Ok(crate::backend::i64s_from_bytes(mem.bytes(addr, bytes)?))
}

pub(super) fn scratch_table(mem: &mut Arena, p: &abi::kvs_scratch_table_params) -> Result<()> {
    let pages = i64s_at(mem, p.pages, p.num_entries)?;
    let scratch = i64s_at(mem, p.scratch_pages, p.num_entries)?;
    let ok = |s: i64| s >= 0 && (s as u64) < p.trash_page;
    let len = usize::try_from(p.table_len)
        .ok()
        .and_then(|n| n.checked_mul(8))
        .ok_or_else(|| Error::overflow(format!("a table of {} int64s", p.table_len)))?;
    let mut table = Vec::with_capacity(len);
    for l in 0..p.table_len {
        // check::scratch_table bounds table_len and trash_page to int64.
        let page = l as i64;
        // The kernel's lower bound, step for step.
        let (mut lo, mut hi) = (0usize, pages.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if pages[mid] < page {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let out = match (pages.get(lo), scratch.get(lo)) {
            (Some(&found), Some(&s)) if found == page && ok(s) => s,
            _ => p.trash_page as i64,
        };
        table.extend_from_slice(&out.to_le_bytes());
    }
    if len > 0 {
        mem.bytes_mut(p.table, len)?.copy_from_slice(&table);
    }
    for (i, (&page, &s)) in pages.iter().zip(&scratch).enumerate() {
        let unsorted = i > 0 && page <= pages[i - 1];
        if page < 0 || page as u64 >= p.table_len || unsorted || !ok(s) {
            report(mem, &p.status, i as u64)?;
        }
    }
    Ok(())
}

pub(super) fn write_rows(mem: &mut Arena, p: &abi::kvs_write_rows_params) -> Result<()> {
    let placement = Placement::new(p.shard)?;
    let mut rows = Vec::new();
    for i in 0..p.num_slots {
        let slot = mem.i64_at(p.slots + 8 * i)?;
        let mut target = None;
        if slot >= 0 {
            let slot = Slot(slot as u64);
            let bad = slot.0 >= p.slot_limit || placement.is_reserved(slot.page());
            let owned = !bad && placement.slot_owner(slot) == p.rank;
            let row = placement.local_row(slot);
            if bad || (owned && row >= p.dst_rows) {
                report(mem, &p.status, i)?;
            } else if owned {
                target = Some(row);
            }
        }
        rows.push(target);
    }
    for k in 0..u64::from(p.num_pairs) {
        let pair = mem.pair(p.pairs, k)?;
        if pair.component >= p.num_components {
            report(mem, &p.status, p.num_slots + k)?;
            continue;
        }
        let c = p.components[pair.component as usize];
        for (token, row) in rows.iter().enumerate() {
            let Some(row) = *row else { continue };
            let token = token as u64;
            if c.kind == abi::KVS_ROWS_INDEXER {
                let (page, block) = (PAGE_SIZE as u64, INDEXER_PAGE_BYTES as u64);
                let src_block = pair.src + (token / page) * block;
                let dst_block = pair.dst + (row / page) * block;
                let key = INDEXER_HEAD_DIM as u64;
                mem.copy(
                    dst_block + (row % page) * key,
                    src_block + (token % page) * key,
                    INDEXER_HEAD_DIM,
                )?;
                let scales = INDEXER_SCALES_OFFSET as u64;
                mem.copy(
                    dst_block + scales + 4 * (row % page),
                    src_block + scales + 4 * (token % page),
                    4,
                )?;
            } else {
                let r = u64::from(c.row_bytes);
                mem.copy(
                    pair.dst + row * r,
                    pair.src + token * r,
                    c.row_bytes as usize,
                )?;
            }
        }
    }
    Ok(())
}

pub(super) fn copy_ranges(mem: &mut Arena, p: &abi::kvs_copy_ranges_params) -> Result<()> {
    for r in 0..p.num_ranges {
        let at = p.ranges + 24 * r;
        let (src, dst, bytes) = (mem.u64_at(at)?, mem.u64_at(at + 8)?, mem.u64_at(at + 16)?);
        // The kernel counts a range's vectors in 32 bits: longer ranges are skipped and
        // reported there, so here too, whatever this host could copy.
        if bytes > abi::KVS_COPY_RANGE_MAX_BYTES {
            report(mem, &p.status, r)?;
            continue;
        }
        let bytes = usize::try_from(bytes)
            .map_err(|_| Error::overflow(format!("range {r} of {bytes} bytes")))?;
        mem.copy(dst, src, bytes)?;
    }
    Ok(())
}

/// The CPU twin of `kvs_decode_scatter` (cuda/decode_scatter.cu): every unit in order, every
/// row of it placed by [`DecodeLayout`], the kernel's arithmetic, and moved on its own (the
/// kernel moves a page-granular layout's rows as one run, and an unpacked rank's rows as one
/// contiguous run of its source: the same bytes).
pub(super) fn decode_scatter(mem: &mut Arena, p: &abi::kvs_decode_scatter_params) -> Result<()> {
    let layout = DecodeLayout::new(p.num_ranks, p.interleave)?;
    let kv_units = u64::from(p.num_kv_pairs) * p.num_entries;
    let state_pairs = u64::from(p.num_pairs - p.num_kv_pairs);
    let units = kv_units + state_pairs * p.num_state_entries;
    for u in 0..units {
        let (k, j, state) = if u < kv_units {
            (u / p.num_entries, u % p.num_entries, false)
        } else {
            let s = u - kv_units;
            (
                u64::from(p.num_kv_pairs) + s / p.num_state_entries,
                s % p.num_state_entries,
                true,
            )
        };
        let at = p.pairs + 16 * k;
        let (src_base, component) = (mem.u64_at(at)?, mem.u32_at(at + 8)?);
        let position = if state { p.num_entries + j } else { j };
        if component >= p.num_components {
            if j == 0 {
                report(mem, &p.status, p.num_entries + p.num_state_entries + k)?;
            }
            continue;
        }
        let entry = if state { p.state_entries } else { p.entries } + 16 * j;
        let (src_page, sequence_page) = (mem.i64_at(entry)?, mem.u64_at(entry + 8)?);
        if src_page < 0 {
            continue;
        }
        let unpack = p.mode == abi::KVS_DECODE_UNPACK;
        if !unpack && src_page as u64 >= p.src_limit {
            report(mem, &p.status, position)?;
            continue;
        }
        let first = sequence_page.wrapping_mul(PAGE);
        if first >= p.end_token {
            continue;
        }
        let unit = ScatterUnit {
            k,
            state,
            position,
            first,
            valid: (p.end_token - first).min(PAGE),
            c: p.components[component as usize],
        };
        if unpack {
            unpack_unit(mem, p, &layout, &unit, src_base)?;
        } else {
            let src = src_base.wrapping_add((src_page as u64).wrapping_mul(unit.block()));
            scatter_unit(mem, p, &layout, &unit, src)?;
        }
    }
    Ok(())
}

const PAGE: u64 = PAGE_SIZE as u64;

/// One unit of a decode scatter that passed the checks every unit makes.
struct ScatterUnit {
    /// The pair.
    k: u64,
    /// Whether it moves the state section.
    state: bool,
    /// Where its errors are reported.
    position: u64,
    /// The page's first token.
    first: u64,
    /// Rows of tokens below the end.
    valid: u64,
    c: abi::kvs_row_component,
}

impl ScatterUnit {
    fn indexer(&self) -> bool {
        self.c.kind == abi::KVS_ROWS_INDEXER
    }

    /// Bytes of a block of the unit's component.
    fn block(&self) -> u64 {
        if self.indexer() {
            INDEXER_PAGE_BYTES as u64
        } else {
            PAGE * u64::from(self.c.row_bytes)
        }
    }

    /// Moves row `from` of the source block at `src` to row `to` of the destination block at
    /// `dst`: a latent row, or an indexer key and its scale.
    fn move_row(&self, mem: &mut Arena, src: u64, from: u64, dst: u64, to: u64) -> Result<()> {
        if self.indexer() {
            let key = INDEXER_HEAD_DIM as u64;
            mem.copy(dst + to * key, src + from * key, INDEXER_HEAD_DIM)?;
            let scales = INDEXER_SCALES_OFFSET as u64;
            mem.copy(dst + scales + 4 * to, src + scales + 4 * from, 4)
        } else {
            let bytes = u64::from(self.c.row_bytes);
            mem.copy(
                dst + to * bytes,
                src + from * bytes,
                self.c.row_bytes as usize,
            )
        }
    }
}

/// The ranks a launch's tables hold, and rank `rank`'s place among them (abi.h).
fn table_ranks(p: &abi::kvs_decode_scatter_params) -> u64 {
    if p.one_rank != 0 {
        1
    } else {
        u64::from(p.num_ranks)
    }
}

fn table_slot(p: &abi::kvs_decode_scatter_params, rank: u32) -> u64 {
    if p.one_rank != 0 {
        0
    } else {
        u64::from(rank)
    }
}

/// The destination block holding row index `row` of rank `rank` for the unit, or `None` when
/// the row is skipped (a padding page id), reported (a page the rank did not register, a page
/// past its pool) included: the kernel's `dst_page`.
fn dst_block(
    mem: &mut Arena,
    p: &abi::kvs_decode_scatter_params,
    unit: &ScatterUnit,
    rank: u32,
    row: u64,
) -> Result<Option<u64>> {
    let s = table_slot(p, rank);
    let r = p.ranks + 32 * s;
    let (pages, state_pages, num_pages, limit) = (
        mem.u64_at(r)?,
        mem.u64_at(r + 8)?,
        mem.u64_at(r + 16)?,
        mem.u64_at(r + 24)?,
    );
    let index = row / PAGE;
    if index >= num_pages {
        report(mem, &p.status, unit.position)?;
        return Ok(None);
    }
    let list = if unit.state { state_pages } else { pages };
    let page = mem.i64_at(list + 8 * index)?;
    if page < 0 {
        return Ok(None);
    }
    if page as u64 >= limit {
        report(mem, &p.status, unit.position)?;
        return Ok(None);
    }
    let base = mem.u64_at(p.dst_bases + 8 * (unit.k * table_ranks(p) + s))?;
    Ok(Some(base + page as u64 * unit.block()))
}

/// The shift of table place `s` for the unit (PACK and UNPACK).
fn shift_of(
    mem: &Arena,
    p: &abi::kvs_decode_scatter_params,
    unit: &ScatterUnit,
    s: u64,
) -> Result<u64> {
    mem.u64_at(p.shifts + 8 * (unit.position * table_ranks(p) + s))
}

/// DIRECT and PACK: each row of the unit's source block at `src` to its rank's row.
fn scatter_unit(
    mem: &mut Arena,
    p: &abi::kvs_decode_scatter_params,
    layout: &DecodeLayout,
    unit: &ScatterUnit,
    src: u64,
) -> Result<()> {
    for o in 0..unit.valid {
        let place = layout.place(unit.first + o);
        if p.one_rank != 0 && place.rank != p.rank {
            continue;
        }
        let mut row = place.local;
        if p.mode == abi::KVS_DECODE_PACK {
            row = row.wrapping_sub(shift_of(mem, p, unit, table_slot(p, place.rank))?);
        }
        if let Some(dst) = dst_block(mem, p, unit, place.rank, row)? {
            unit.move_row(mem, src, o, dst, row % PAGE)?;
        }
    }
    Ok(())
}

/// UNPACK: rank `p.rank`'s rows of the unit's page, local tokens `[k0, k0 + n)`, from rows
/// `[q0, q0 + n)` of the source layer at `base` (nothing when they do not all lie in its
/// `src_limit` pages: reported).
fn unpack_unit(
    mem: &mut Arena,
    p: &abi::kvs_decode_scatter_params,
    layout: &DecodeLayout,
    unit: &ScatterUnit,
    base: u64,
) -> Result<()> {
    let k0 = layout.tokens_on(p.rank, unit.first);
    let n = layout.tokens_on(p.rank, unit.first + unit.valid) - k0;
    if n == 0 {
        return Ok(());
    }
    let q0 = k0.wrapping_sub(shift_of(mem, p, unit, 0)?);
    let capacity = p.src_limit.saturating_mul(PAGE);
    if q0 > capacity || n > capacity - q0 {
        return report(mem, &p.status, unit.position);
    }
    for i in 0..n {
        let (k, q) = (k0 + i, q0 + i);
        if let Some(dst) = dst_block(mem, p, unit, p.rank, k)? {
            let src = base + (q / PAGE) * unit.block();
            unit.move_row(mem, src, q % PAGE, dst, k % PAGE)?;
        }
    }
    Ok(())
}
