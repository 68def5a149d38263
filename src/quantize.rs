//! Safe entry points of the FP8 quantizers (`cuda/quantize.cu`, CPU twins in [`crate::fp8`]):
//! bf16 rows in, latent rows or indexer page blocks out, at given token slots.
//!
//! Slots are given on the host, checked against the destination before anything runs, then
//! uploaded; an engine that keeps its slots on the device calls the backend's raw entry points,
//! whose kernels skip and report out-of-range slots instead.

use crate::abi;
use crate::backend::{upload_i64s, Backend, Buffer};
use crate::error::{Error, Result};
use crate::geometry::{
    IndexerScale, LatentLayout, INDEXER_HEAD_DIM, INDEXER_PAGE_BYTES, LATENT_DIM, PAGE_SIZE,
};

/// Bytes of one bf16 input row of the latent quantizer (512 nope + 64 rope).
pub const LATENT_INPUT_ROW_BYTES: usize = 2 * LATENT_DIM;
/// Bytes of one bf16 input row of the indexer quantizer.
pub const INDEXER_INPUT_ROW_BYTES: usize = 2 * INDEXER_HEAD_DIM;

fn check_slots(slots: &[i64], limit: u64, what: &'static str) -> Result<()> {
    match slots.iter().find(|&&s| s >= 0 && s as u64 >= limit) {
        Some(&bad) => Err(Error::OutOfRange {
            what,
            index: bad,
            limit,
        }),
        None => Ok(()),
    }
}

fn check_input(input: &Buffer, tokens: usize, row_bytes: usize) -> Result<()> {
    if input.len() < tokens * row_bytes || input.addr() % 16 != 0 {
        return Err(Error::InvalidArgument(format!(
            "input of {} bytes at {:#x} for {tokens} rows of {row_bytes} bytes (needs 16-byte alignment)",
            input.len(),
            input.addr()
        )));
    }
    Ok(())
}

/// Quantizes `slots.len()` bf16 rows of `input` (rows of [`LATENT_INPUT_ROW_BYTES`]) into the
/// latent buffer `dst`, row `slots[i]` for input row `i`; negative slots are skipped.
pub fn quantize_latent<B: Backend>(
    backend: &B,
    layout: LatentLayout,
    input: &Buffer,
    slots: &[i64],
    dst: &Buffer,
) -> Result<()> {
    check_input(input, slots.len(), LATENT_INPUT_ROW_BYTES)?;
    let dst_rows = (dst.len() / layout.row_bytes()) as u64;
    check_slots(slots, dst_rows, "latent slot")?;
    let slot_buf = upload_i64s(backend, slots)?;
    let params = abi::kvs_quantize_latent_params {
        src: input.addr(),
        src_stride: LATENT_INPUT_ROW_BYTES as u64,
        slots: slot_buf.addr(),
        dst: dst.addr(),
        dst_rows,
        num_tokens: slots.len() as u64,
        layout: layout.abi(),
        ..Default::default()
    };
    // SAFETY: the input holds every row read, the slot buffer every slot, and every slot was
    // checked to address a whole row of `dst`; all buffers outlive the call's work because
    // `slot_buf` is dropped only after the backend has finished with it (synchronize below).
    unsafe { backend.quantize_latent(params)? };
    backend.synchronize()
}

/// Quantizes `slots.len()` bf16 indexer keys of `input` (rows of [`INDEXER_INPUT_ROW_BYTES`])
/// into the page-major indexer buffer `dst` at token slots `slots[i]`.
pub fn quantize_indexer<B: Backend>(
    backend: &B,
    scale: IndexerScale,
    input: &Buffer,
    slots: &[i64],
    dst: &Buffer,
) -> Result<()> {
    check_input(input, slots.len(), INDEXER_INPUT_ROW_BYTES)?;
    let dst_pages = (dst.len() / INDEXER_PAGE_BYTES) as u64;
    check_slots(slots, dst_pages * PAGE_SIZE as u64, "indexer slot")?;
    let slot_buf = upload_i64s(backend, slots)?;
    let params = abi::kvs_quantize_indexer_params {
        src: input.addr(),
        src_stride: INDEXER_INPUT_ROW_BYTES as u64,
        slots: slot_buf.addr(),
        dst: dst.addr(),
        dst_pages,
        num_tokens: slots.len() as u64,
        scale: scale.abi(),
        ..Default::default()
    };
    // SAFETY: as in quantize_latent.
    unsafe { backend.quantize_indexer(params)? };
    backend.synchronize()
}
