//! Scalar checks of kernel parameters, shared by both backends so that a launch the CUDA backend
//! refuses is refused identically by the CPU reference. Addresses are the caller's contract;
//! everything else (enums, sizes, shard/rank, alignment of strides) is checked here.

use crate::abi;
use crate::error::{Error, Result};

fn invalid<T>(what: String) -> Result<T> {
    Err(Error::InvalidArgument(what))
}

fn check_shard(shard: u32, rank: u32) -> Result<()> {
    if shard == 0 || rank >= shard {
        return invalid(format!("rank {rank} of shard size {shard}"));
    }
    Ok(())
}

/// A quantizer's input rows and output: 16-byte aligned, rows at least `row` bytes apart.
fn check_rows(what: &str, src: u64, stride: u64, row: u64, dst: u64) -> Result<()> {
    if stride % 16 != 0 || stride < row || src % 16 != 0 || dst % 16 != 0 {
        return invalid(format!(
            "{what} quantizer: source {src:#x} stride {stride} / destination {dst:#x} must be 16-byte aligned, stride >= {row}"
        ));
    }
    Ok(())
}

pub(crate) fn quantize_latent(p: &abi::kvs_quantize_latent_params) -> Result<()> {
    if p.layout > abi::KVS_LATENT_BF16 {
        return invalid(format!("latent layout code {}", p.layout));
    }
    check_rows(
        "latent",
        p.src,
        p.src_stride,
        u64::from(abi::KVS_LATENT_INPUT_ROW_BYTES),
        p.dst,
    )
}

pub(crate) fn quantize_indexer(p: &abi::kvs_quantize_indexer_params) -> Result<()> {
    if p.scale > abi::KVS_SCALE_PLAIN {
        return invalid(format!("indexer scale code {}", p.scale));
    }
    check_rows(
        "indexer",
        p.src,
        p.src_stride,
        u64::from(abi::KVS_INDEXER_INPUT_ROW_BYTES),
        p.dst,
    )
}

pub(crate) fn resolve(p: &abi::kvs_resolve_params) -> Result<()> {
    check_shard(p.shard, p.rank)?;
    if p.mode > abi::KVS_RESOLVE_PAGES {
        return invalid(format!("resolve mode {}", p.mode));
    }
    if p.num_entries >= 1 << 31 {
        return invalid(format!("{} entries (at most 2^31 - 1)", p.num_entries));
    }
    if p.parity > 1 {
        return invalid(format!("tile-state parity {} (0 or 1)", p.parity));
    }
    let tiles = super::resolve_tiles(p.num_entries);
    if tiles > u64::from(p.state_tiles)
        || p.clear_tiles > p.state_tiles
        || p.state_tiles % abi::KVS_RESOLVE_LINE_NODES != 0
    {
        return invalid(format!(
            "tile state of {} nodes per tree for {tiles} tiles, clearing {}",
            p.state_tiles, p.clear_tiles
        ));
    }
    Ok(())
}

pub(crate) fn scratch_table(p: &abi::kvs_scratch_table_params) -> Result<()> {
    // Table entries and logical pages are int64s on both sides.
    if i64::try_from(p.table_len).is_err() || i64::try_from(p.trash_page).is_err() {
        return invalid(format!(
            "scratch table of {} logical pages with trash page {} (both at most 2^63 - 1)",
            p.table_len, p.trash_page
        ));
    }
    Ok(())
}

fn check_page_list(side: &str, l: &abi::kvs_page_list) -> Result<()> {
    match l.kind {
        abi::KVS_INDEX_POSITION | abi::KVS_INDEX_LOCAL => Ok(()),
        abi::KVS_INDEX_LOGICAL => check_shard(l.shard, l.rank),
        k => invalid(format!("{side} page list kind {k}")),
    }
}

pub(crate) fn copy_blocks(p: &abi::kvs_copy_blocks_params) -> Result<()> {
    if p.num_components as usize > p.components.len() {
        return invalid(format!(
            "{} components (at most {})",
            p.num_components,
            p.components.len()
        ));
    }
    for (i, c) in p.components[..p.num_components as usize].iter().enumerate() {
        let strides = [
            c.src.page_stride,
            c.src.row_stride,
            c.dst.page_stride,
            c.dst.row_stride,
        ];
        if c.rows == 0
            || c.row_bytes == 0
            || c.row_bytes % 16 != 0
            || strides.iter().any(|s| s % 16 != 0)
        {
            return invalid(format!(
                "block component {i}: {} rows of {} bytes, strides {strides:?} (need rows >= 1, 16-byte multiples)",
                c.rows, c.row_bytes
            ));
        }
    }
    check_page_list("source", &p.src_pages)?;
    check_page_list("destination", &p.dst_pages)?;
    if p.num_pages.checked_mul(u64::from(p.num_pairs)).is_none() {
        return invalid("block copy unit count overflows".into());
    }
    Ok(())
}

/// `kvs_copy_blocks_inline`: the header as [`copy_blocks`], and every table offset it holds 8-byte
/// aligned with what it names (the pairs, each id list that has ids) inside the inline table,
/// so the kernel never reads past its parameters.
pub(crate) fn copy_blocks_inline(p: &abi::kvs_copy_blocks_inline_params) -> Result<()> {
    let c = &p.copy;
    copy_blocks(c)?;
    let table = abi::KVS_COPY_INLINE_BYTES as u64;
    let fits = |what: &str, offset: u64, count: u64, item: u64| -> Result<()> {
        let end = count.checked_mul(item).and_then(|b| b.checked_add(offset));
        match end {
            Some(end) if end <= table && offset % 8 == 0 => Ok(()),
            _ => invalid(format!(
                "inline block copy: {what} at byte {offset}, {count} x {item} bytes, outside its {table}-byte table or unaligned"
            )),
        }
    };
    let pair = std::mem::size_of::<abi::kvs_layer_pair>() as u64;
    fits("pair table", c.pairs, u64::from(c.num_pairs), pair)?;
    for (side, list) in [
        ("source ids", &c.src_pages),
        ("destination ids", &c.dst_pages),
    ] {
        if list.kind != abi::KVS_INDEX_POSITION {
            fits(side, list.ids, c.num_pages, 8)?;
        }
    }
    Ok(())
}

pub(crate) fn write_rows(p: &abi::kvs_write_rows_params) -> Result<()> {
    check_shard(p.shard, p.rank)?;
    if p.num_components as usize > p.components.len() {
        return invalid(format!(
            "{} components (at most {})",
            p.num_components,
            p.components.len()
        ));
    }
    for (i, c) in p.components[..p.num_components as usize].iter().enumerate() {
        let ok = match c.kind {
            abi::KVS_ROWS_LATENT => matches!(
                c.row_bytes,
                abi::KVS_LATENT_TRTLLM_ROW_BYTES
                    | abi::KVS_LATENT_SCALED_ROW_BYTES
                    | abi::KVS_LATENT_BF16_ROW_BYTES
            ),
            abi::KVS_ROWS_INDEXER => c.row_bytes == abi::KVS_INDEXER_ROW_BYTES,
            _ => false,
        };
        if !ok {
            return invalid(format!(
                "row component {i}: kind {} with {} bytes",
                c.kind, c.row_bytes
            ));
        }
    }
    Ok(())
}

/// `kvs_decode_scatter`: the layout (1 to `KVS_DECODE_MAX_RANKS` ranks, an interleave of at
/// least one token), the mode and its ranks (one rank of the layout, or every rank; an unpack
/// of one rank; a shift table where the mode reads one), the sections' pairs, the row formats
/// (the latent layouts' rows, the indexer row) and unit and table counts that fit 64 bits.
pub(crate) fn decode_scatter(p: &abi::kvs_decode_scatter_params) -> Result<()> {
    if p.num_ranks == 0 || p.num_ranks > abi::KVS_DECODE_MAX_RANKS || p.interleave == 0 {
        return invalid(format!(
            "decode scatter over {} ranks interleaving {} tokens",
            p.num_ranks, p.interleave
        ));
    }
    let one_rank = match p.one_rank {
        0 => false,
        1 if p.rank < p.num_ranks => true,
        _ => {
            return invalid(format!(
                "decode scatter of rank {} alone ({}) over {} ranks",
                p.rank, p.one_rank, p.num_ranks
            ))
        }
    };
    let shifted = match p.mode {
        abi::KVS_DECODE_DIRECT => false,
        abi::KVS_DECODE_PACK => true,
        abi::KVS_DECODE_UNPACK if one_rank => true,
        _ => {
            return invalid(format!(
                "decode scatter mode {} ({})",
                p.mode,
                if one_rank { "one rank" } else { "every rank" }
            ))
        }
    };
    if shifted && p.shifts == 0 {
        return invalid("a packing or unpacking decode scatter without its shifts".into());
    }
    if p.num_kv_pairs > p.num_pairs {
        return invalid(format!(
            "decode scatter: {} latent pairs of {}",
            p.num_kv_pairs, p.num_pairs
        ));
    }
    if p.end_token > abi::KVS_DECODE_MAX_TOKENS {
        return invalid(format!(
            "decode scatter up to token {} (at most {})",
            p.end_token,
            abi::KVS_DECODE_MAX_TOKENS
        ));
    }
    if p.num_components as usize > p.components.len() {
        return invalid(format!(
            "{} components (at most {})",
            p.num_components,
            p.components.len()
        ));
    }
    let mut latent_rows = None;
    for (i, c) in p.components[..p.num_components as usize].iter().enumerate() {
        let ok = match c.kind {
            abi::KVS_ROWS_LATENT => {
                // Every latent component has the rows of the one kernel that moves them.
                let same = *latent_rows.get_or_insert(c.row_bytes) == c.row_bytes;
                same && matches!(
                    c.row_bytes,
                    abi::KVS_LATENT_TRTLLM_ROW_BYTES
                        | abi::KVS_LATENT_SCALED_ROW_BYTES
                        | abi::KVS_LATENT_BF16_ROW_BYTES
                )
            }
            abi::KVS_ROWS_INDEXER => c.row_bytes == abi::KVS_INDEXER_ROW_BYTES,
            _ => false,
        };
        if !ok {
            return invalid(format!(
                "decode scatter component {i}: kind {} with {} bytes",
                c.kind, c.row_bytes
            ));
        }
    }
    let units = super::launch::decode_scatter_units(p);
    let ranks = if one_rank { 1 } else { u64::from(p.num_ranks) };
    let bases = u64::from(p.num_pairs).checked_mul(ranks);
    let shifts = p
        .num_entries
        .checked_add(p.num_state_entries)
        .and_then(|e| e.checked_mul(ranks));
    if units.is_none() || bases.is_none() || shifts.is_none() {
        return invalid("decode scatter unit count overflows".into());
    }
    Ok(())
}
