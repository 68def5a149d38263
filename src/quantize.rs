//! Safe entry points of the FP8 quantizers (the `kvs_quantize_*` kernels in cuda/, CPU twins
//! in [`crate::fp8`]): bf16 rows in, latent rows or indexer page blocks out, at given rows.
//!
//! Two forms each:
//! - [`quantize_latent`] / [`quantize_indexer`] take the engine's device buffer of int64 rows
//!   and only enqueue (no allocation, no wait): the kernel skips and reports a row outside the
//!   destination, and the backend's next `synchronize` names the first;
//! - [`quantize_latent_checked_sync`] / [`quantize_indexer_checked_sync`] take the rows on the
//!   host, refuse a bad one before anything runs, upload them and wait.

use crate::abi;
use crate::backend::{ordered, upload_reused_sync, Backend, Buffer};
use crate::error::{Checked, Error, Result};
use crate::geometry::{IndexerScale, LatentLayout, INDEXER_PAGE_BYTES, PAGE_SIZE};

/// Bytes of one bf16 input row of the latent quantizer (512 nope + 64 rope).
pub const LATENT_INPUT_ROW_BYTES: usize = abi::KVS_LATENT_INPUT_ROW_BYTES as usize;
/// Bytes of one bf16 input row of the indexer quantizer.
pub const INDEXER_INPUT_ROW_BYTES: usize = abi::KVS_INDEXER_INPUT_ROW_BYTES as usize;

fn check_rows(rows: &[i64], limit: u64, what: &'static str) -> Result<()> {
    match rows.iter().find(|&&s| s >= 0 && s as u64 >= limit) {
        Some(&bad) => Err(Error::OutOfRange {
            what,
            index: bad,
            limit,
        }),
        None => Ok(()),
    }
}

/// Checks the buffers belong to `backend`, the input holds `tokens` rows and `slots` `tokens`
/// int64s, all aligned.
fn check_buffers(
    backend: &dyn Backend,
    input: &Buffer,
    slots: &Buffer,
    dst: &Buffer,
    tokens: usize,
    row_bytes: usize,
) -> Result<()> {
    backend.check(input, "quantizer input")?;
    backend.check(slots, "quantizer rows")?;
    backend.check(dst, "quantizer destination")?;
    let need = tokens.mul_or(row_bytes, || format!("bytes of {tokens} input rows"))?;
    if input.len() < need || input.addr() % 16 != 0 || dst.addr() % 16 != 0 {
        return Err(Error::InvalidArgument(format!(
            "input of {} bytes at {:#x} for {tokens} rows of {row_bytes} bytes, destination at {:#x} (both need 16-byte alignment)",
            input.len(),
            input.addr(),
            dst.addr()
        )));
    }
    let slot_bytes = tokens.mul_or(8, || format!("bytes of {tokens} rows"))?;
    if slots.len() < slot_bytes || slots.addr() % 8 != 0 {
        return Err(Error::InvalidArgument(format!(
            "row buffer of {} bytes at {:#x} for {tokens} int64 rows",
            slots.len(),
            slots.addr()
        )));
    }
    Ok(())
}

/// Enqueues quantizing `tokens` bf16 rows of `input` (rows of [`LATENT_INPUT_ROW_BYTES`]) into
/// the latent buffer `dst`: input row `i` goes to row `slots[i]` (the engine's device int64
/// buffer; negative rows are skipped). No allocation, no wait: a row outside `dst` is skipped and
/// reported by the backend's next `synchronize`.
pub fn quantize_latent(
    backend: &dyn Backend,
    layout: LatentLayout,
    input: &Buffer,
    slots: &Buffer,
    tokens: usize,
    dst: &Buffer,
) -> Result<()> {
    check_buffers(backend, input, slots, dst, tokens, LATENT_INPUT_ROW_BYTES)?;
    let params = abi::kvs_quantize_latent_params {
        src: input.addr(),
        src_stride: LATENT_INPUT_ROW_BYTES as u64,
        slots: slots.addr(),
        dst: dst.addr(),
        dst_rows: (dst.len() / layout.row_bytes()) as u64,
        num_tokens: tokens as u64,
        layout: layout.abi(),
        ..Default::default()
    };
    ordered(
        backend,
        &[input.usage(), slots.usage()],
        &[dst.usage()],
        || {
            // SAFETY: every buffer belongs to the backend and holds what the kernel reads
            // (`tokens` input rows and int64 rows) or writes (the kernel bounds every row by
            // `dst_rows`, whole rows of `dst`); their usages keep the memory until the launch has
            // run, and order it after other streams' conflicting work.
            unsafe { backend.quantize_latent(params) }
        },
    )
}

/// Enqueues quantizing `tokens` bf16 indexer keys of `input` (rows of
/// [`INDEXER_INPUT_ROW_BYTES`]) into the page-major indexer buffer `dst` at token rows
/// `slots[i]` (device int64s). No allocation, no wait, as [`quantize_latent`].
pub fn quantize_indexer(
    backend: &dyn Backend,
    scale: IndexerScale,
    input: &Buffer,
    slots: &Buffer,
    tokens: usize,
    dst: &Buffer,
) -> Result<()> {
    check_buffers(backend, input, slots, dst, tokens, INDEXER_INPUT_ROW_BYTES)?;
    let params = abi::kvs_quantize_indexer_params {
        src: input.addr(),
        src_stride: INDEXER_INPUT_ROW_BYTES as u64,
        slots: slots.addr(),
        dst: dst.addr(),
        dst_pages: (dst.len() / INDEXER_PAGE_BYTES) as u64,
        num_tokens: tokens as u64,
        scale: scale.abi(),
        ..Default::default()
    };
    ordered(
        backend,
        &[input.usage(), slots.usage()],
        &[dst.usage()],
        || {
            // SAFETY: as in quantize_latent; the kernel bounds every row by whole pages of `dst`.
            unsafe { backend.quantize_indexer(params) }
        },
    )
}

/// Quantizes `rows.len()` bf16 rows of `input` into the latent buffer `dst` at rows `rows[i]`
/// (negative: skipped), after checking every row on the host; uploads the rows and waits.
pub fn quantize_latent_checked_sync(
    backend: &dyn Backend,
    layout: LatentLayout,
    input: &Buffer,
    rows: &[i64],
    dst: &Buffer,
) -> Result<()> {
    check_rows(rows, (dst.len() / layout.row_bytes()) as u64, "latent row")?;
    let slots = upload_reused_sync(backend, rows)?;
    quantize_latent(backend, layout, input, slots.buffer(), rows.len(), dst)?;
    backend.synchronize()
}

/// Quantizes `rows.len()` bf16 indexer keys of `input` into `dst` at token rows `rows[i]`, after
/// checking every row on the host; uploads the rows and waits.
pub fn quantize_indexer_checked_sync(
    backend: &dyn Backend,
    scale: IndexerScale,
    input: &Buffer,
    rows: &[i64],
    dst: &Buffer,
) -> Result<()> {
    let limit = ((dst.len() / INDEXER_PAGE_BYTES) as u64).saturating_mul(PAGE_SIZE as u64);
    check_rows(rows, limit, "indexer row")?;
    let slots = upload_reused_sync(backend, rows)?;
    quantize_indexer(backend, scale, input, slots.buffer(), rows.len(), dst)?;
    backend.synchronize()
}
