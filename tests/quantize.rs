//! FP8 quantizers: the CPU twin (`cpu_*`) and the kernels (`gpu_*`, SKIPPED without a GPU)
//! against the format's reference codecs, byte for byte, from one body each, on random data
//! with poisoned outputs. Both entry points run: the enqueue-only one on the engine's device
//! rows, and the host-checked one that waits.

mod common;

use common::synth::{self, POISON};
use half::bf16;
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{upload_i64s_sync, Backend, Buffer, MemoryKind};
use kvshard::geometry::{IndexerScale, LatentLayout, INDEXER_PAGE_BYTES, LATENT_DIM, PAGE_SIZE};
use kvshard::quantize::{
    quantize_indexer, quantize_indexer_checked_sync, quantize_latent, quantize_latent_checked_sync,
    INDEXER_INPUT_ROW_BYTES, LATENT_INPUT_ROW_BYTES,
};
use kvshard::{abi, fp8, Error};
use rand::Rng;

/// Random rows, with the FP8 edge values spread over the first rows.
fn latent_input(rng: &mut impl Rng, tokens: usize) -> Vec<u8> {
    let mut input = synth::bf16_bytes(rng, tokens * LATENT_DIM);
    for (i, v) in synth::fp8_edge_values().into_iter().enumerate() {
        let at = 2 * (i * 37 % (tokens * LATENT_DIM));
        input[at..at + 2].copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
    }
    // A whole zero tile (exercises the zero-scale rule of the scaled layout).
    input[..256].fill(0);
    input
}

/// Distinct random rows in `0..rows`, every fifth one padding.
fn slots(rng: &mut impl Rng, tokens: usize, rows: usize) -> Vec<i64> {
    let perm = synth::permutation(rng, rows);
    (0..tokens)
        .map(|i| if i % 5 == 3 { -1 } else { perm[i] })
        .collect()
}

fn upload(b: &dyn Backend, bytes: &[u8]) -> Buffer {
    let buf = b.alloc(bytes.len(), MemoryKind::Device).unwrap();
    b.write_sync(&buf, 0, bytes).unwrap();
    buf
}

fn poisoned(b: &dyn Backend, len: usize) -> Buffer {
    let buf = b.alloc(len, MemoryKind::Device).unwrap();
    b.fill(&buf, POISON).unwrap();
    buf
}

/// Quantizes through both entry points into two poisoned destinations; they must agree. Returns
/// the destination's bytes.
fn run_latent(
    b: &dyn Backend,
    layout: LatentLayout,
    input: &[u8],
    slots: &[i64],
    rows: usize,
) -> Vec<u8> {
    let src = upload(b, input);
    let checked = poisoned(b, rows * layout.row_bytes());
    quantize_latent_checked_sync(b, layout, &src, slots, &checked).unwrap();
    let device = poisoned(b, rows * layout.row_bytes());
    let rows_buf = upload_i64s_sync(b, slots).unwrap();
    quantize_latent(b, layout, &src, &rows_buf, slots.len(), &device).unwrap();
    b.synchronize().unwrap();
    let out = b.read_sync(&checked, 0, checked.len()).unwrap();
    assert!(
        out == b.read_sync(&device, 0, device.len()).unwrap(),
        "{}: {layout}: the two entry points differ",
        b.name()
    );
    out
}

/// As [`run_latent`], for the indexer.
fn run_indexer(
    b: &dyn Backend,
    scale: IndexerScale,
    input: &[u8],
    slots: &[i64],
    pages: usize,
) -> Vec<u8> {
    let src = upload(b, input);
    let checked = poisoned(b, pages * INDEXER_PAGE_BYTES);
    quantize_indexer_checked_sync(b, scale, &src, slots, &checked).unwrap();
    let device = poisoned(b, pages * INDEXER_PAGE_BYTES);
    let rows_buf = upload_i64s_sync(b, slots).unwrap();
    quantize_indexer(b, scale, &src, &rows_buf, slots.len(), &device).unwrap();
    b.synchronize().unwrap();
    let out = b.read_sync(&checked, 0, checked.len()).unwrap();
    assert!(
        out == b.read_sync(&device, 0, device.len()).unwrap(),
        "{}: {scale:?}: the two entry points differ",
        b.name()
    );
    out
}

fn bf16_row(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

// Every token's latent row lands at its slot, quantized as the format's reference does, in
// every layout and at sizes from one row to thousands; padding tokens write nothing and every
// other row stays poisoned.
common::on_cpu_and_gpu!(latent_rows_land_at_their_slots_and_nowhere_else, |device| {
    let (b, mut rng) = (device.stream(), device.rng());
    for (tokens, rows) in [(1, 1), (37, 64), (50, 80), (5000, 6000)] {
        let input = latent_input(&mut rng, tokens);
        let slots = slots(&mut rng, tokens, rows);
        for layout in LatentLayout::ALL {
            let out = run_latent(b.as_ref(), layout, &input, &slots, rows);
            let rb = layout.row_bytes();
            let mut expected = vec![POISON; rows * rb];
            for (t, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
                let row =
                    bf16_row(&input[t * LATENT_INPUT_ROW_BYTES..(t + 1) * LATENT_INPUT_ROW_BYTES]);
                fp8::quantize_latent_row(
                    layout,
                    &row,
                    &mut expected[s as usize * rb..(s as usize + 1) * rb],
                )
                .unwrap();
            }
            assert!(out == expected, "{layout}, {tokens} tokens");
        }
    }
});

// Every token's indexer key lands in its page's block, page-major (the codes of the page's 64
// rows, then their scales), quantized as the reference does with either scale format, the FP8
// edge values included; the scales of rows no token wrote stay poisoned.
common::on_cpu_and_gpu!(indexer_blocks_are_page_major, |device| {
    let (b, mut rng) = (device.stream(), device.rng());
    for (tokens, pages) in [(1, 1), (63, 2), (70, 3), (4099, 80)] {
        let mut input = synth::bf16_bytes(&mut rng, tokens * 128);
        for (i, v) in synth::fp8_edge_values()
            .into_iter()
            .enumerate()
            .take(tokens * 128)
        {
            input[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
        }
        let slots = slots(&mut rng, tokens, pages * PAGE_SIZE);
        for scale in [IndexerScale::Ue8m0, IndexerScale::Plain] {
            let case = format!("{scale:?}, {tokens} tokens");
            let out = run_indexer(b.as_ref(), scale, &input, &slots, pages);
            for (t, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
                let (page, off) = (s as usize / 64, s as usize % 64);
                let keys = bf16_row(
                    &input[t * INDEXER_INPUT_ROW_BYTES..(t + 1) * INDEXER_INPUT_ROW_BYTES],
                );
                let mut codes = [0u8; 128];
                let want = fp8::quantize_indexer_row(&keys, scale, &mut codes).unwrap();
                let block = &out[page * INDEXER_PAGE_BYTES..(page + 1) * INDEXER_PAGE_BYTES];
                assert_eq!(
                    &block[off * 128..off * 128 + 128],
                    &codes,
                    "{case}: token {t}"
                );
                let got = &block[8192 + 4 * off..8196 + 4 * off];
                assert_eq!(got, &want.to_le_bytes(), "{case}: token {t}");
            }
            let untouched = (0..pages * 64)
                .filter(|r| !slots.contains(&(*r as i64)))
                .count();
            let poisoned_scales = (0..pages * 64)
                .filter(|r| {
                    out[r / 64 * INDEXER_PAGE_BYTES + 8192 + 4 * (r % 64)..][..4] == [POISON; 4]
                })
                .count();
            assert_eq!(untouched, poisoned_scales, "{case}");
        }
    }
});

#[test]
fn out_of_range_slots_are_rejected_before_anything_is_written() {
    let b = CpuBackend::new();
    let src = b
        .alloc(2 * LATENT_INPUT_ROW_BYTES, MemoryKind::Device)
        .unwrap();
    let dst = poisoned(&b, 4 * 576);
    let err =
        quantize_latent_checked_sync(&b, LatentLayout::Fp8Trtllm, &src, &[1, 4], &dst).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                index: 4,
                limit: 4,
                ..
            }
        ),
        "{err}"
    );
    let keys = b
        .alloc(2 * INDEXER_INPUT_ROW_BYTES, MemoryKind::Device)
        .unwrap();
    let blocks = poisoned(&b, INDEXER_PAGE_BYTES);
    let err = quantize_indexer_checked_sync(&b, IndexerScale::Plain, &keys, &[0, 64], &blocks)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                index: 64,
                limit: 64,
                ..
            }
        ),
        "{err}"
    );
    for buf in [&dst, &blocks] {
        assert!(b
            .read_sync(buf, 0, buf.len())
            .unwrap()
            .iter()
            .all(|&x| x == POISON));
    }
}

#[test]
fn short_or_misaligned_buffers_are_refused() {
    let b = CpuBackend::new();
    let src = b
        .alloc(2 * LATENT_INPUT_ROW_BYTES, MemoryKind::Device)
        .unwrap();
    let rows = upload_i64s_sync(&b, &[0, 1, 2]).unwrap();
    let dst = poisoned(&b, 4 * 576);
    let layout = LatentLayout::Fp8Trtllm;
    let cases = [
        (
            "three rows of a two-row input",
            quantize_latent(&b, layout, &src, &rows, 3, &dst),
        ),
        (
            "a row buffer short of two int64s",
            quantize_latent(&b, layout, &src, &rows.slice(0, 15).unwrap(), 2, &dst),
        ),
        (
            "a misaligned row buffer",
            quantize_latent(&b, layout, &src, &rows.slice(4, 16).unwrap(), 2, &dst),
        ),
        (
            "a misaligned destination",
            quantize_latent(&b, layout, &src, &rows, 2, &dst.slice(8, 576).unwrap()),
        ),
    ];
    for (what, got) in cases {
        assert!(
            matches!(got, Err(Error::InvalidArgument(_))),
            "{what}: {got:?}"
        );
    }
    b.synchronize().unwrap();
    assert!(b
        .read_sync(&dst, 0, dst.len())
        .unwrap()
        .iter()
        .all(|&x| x == POISON));
}

/// Three rows of 0x3C bytes for rows [0, 9, 1] of a two-row destination: row 9 is out of range.
fn bad_row_inputs(b: &dyn Backend) -> (Buffer, Buffer, Buffer) {
    let src = upload(b, &vec![0x3C; 3 * LATENT_INPUT_ROW_BYTES]);
    let slots = upload_i64s_sync(b, &[0, 9, 1]).unwrap();
    let dst = poisoned(b, 2 * 576);
    (src, slots, dst)
}

/// After a launch that met row 9 at position 1: the next synchronize names the kernel and the
/// position, once; the in-range rows were written.
fn check_reported(b: &dyn Backend, dst: &Buffer) {
    match b.synchronize() {
        Err(Error::KernelRejected { kernel, position }) => {
            assert_eq!((kernel, position), ("kvs_quantize_latent", 1))
        }
        other => panic!("{}: expected a rejection, got {other:?}", b.name()),
    }
    let out = b.read_sync(dst, 0, dst.len()).unwrap();
    assert!(
        out.iter().all(|&x| x != POISON),
        "{}: in-range rows written",
        b.name()
    );
    assert!(b.synchronize().is_ok(), "a report is delivered once");
}

/// The raw entry point with device-resident slots: the kernel skips the bad slot, writes the
/// rest, and the next synchronize names the kernel and the first bad position, on both backends.
fn raw_bad_slot_is_reported(b: &dyn Backend) {
    let (src, slots, dst) = bad_row_inputs(b);
    let p = abi::kvs_quantize_latent_params {
        src: src.addr(),
        src_stride: LATENT_INPUT_ROW_BYTES as u64,
        slots: slots.addr(),
        dst: dst.addr(),
        dst_rows: 2,
        num_tokens: 3,
        layout: abi::KVS_LATENT_FP8_TRTLLM,
        ..Default::default()
    };
    // SAFETY: every address is a live buffer of `b` covering what the kernel reads and writes
    // for in-range slots; the out-of-range slot is the point of the test.
    unsafe { b.quantize_latent(p).unwrap() };
    check_reported(b, &dst);
}

/// The safe enqueue-only entry point reports a bad device row the same way.
fn device_rows_bad_slot_is_reported(b: &dyn Backend) {
    let (src, slots, dst) = bad_row_inputs(b);
    quantize_latent(b, LatentLayout::Fp8Trtllm, &src, &slots, 3, &dst).unwrap();
    check_reported(b, &dst);
}

// A latent row slot out of range is skipped and reported at the next synchronize, through the
// raw entry point and through the enqueue-only one, each on a stream of its own.
common::on_cpu_and_gpu!(bad_slots_are_reported, |device| {
    raw_bad_slot_is_reported(device.stream().as_ref());
    device_rows_bad_slot_is_reported(device.stream().as_ref());
});

#[test]
fn cpu_streams_share_memory_but_not_status() {
    let a = CpuBackend::new();
    let b = a.new_stream();
    let buf = a.alloc(16, MemoryKind::Device).unwrap();
    b.write_sync(&buf, 0, &[7; 16]).unwrap();
    assert_eq!(a.read_sync(&buf, 0, 16).unwrap(), vec![7; 16]);
    raw_bad_slot_is_reported(&b);
    assert!(
        a.synchronize().is_ok(),
        "another stream's rejection is not ours"
    );
}
