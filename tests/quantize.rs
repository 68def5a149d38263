//! FP8 quantizers: the CPU reference against the format, and the kernels against the reference,
//! byte for byte, on random data with poisoned outputs.

mod common;

use half::bf16;
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{i64s_to_bytes, Backend, MemoryKind};
use kvshard::geometry::{IndexerScale, LatentLayout, INDEXER_PAGE_BYTES, LATENT_DIM, PAGE_SIZE};
use kvshard::quantize::{
    quantize_indexer, quantize_latent, INDEXER_INPUT_ROW_BYTES, LATENT_INPUT_ROW_BYTES,
};
use kvshard::synth::{self, POISON};
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

/// Distinct random slots in `0..rows`, every fifth one padding.
fn slots(rng: &mut impl Rng, tokens: usize, rows: usize) -> Vec<i64> {
    let perm = synth::permutation(rng, rows);
    (0..tokens)
        .map(|i| if i % 5 == 3 { -1 } else { perm[i] })
        .collect()
}

fn run_latent<B: Backend>(
    b: &B,
    layout: LatentLayout,
    input: &[u8],
    slots: &[i64],
    rows: usize,
) -> Vec<u8> {
    let src = b.alloc(input.len(), MemoryKind::Device).unwrap();
    b.write(&src, 0, input).unwrap();
    let dst = b
        .alloc(rows * layout.row_bytes(), MemoryKind::Device)
        .unwrap();
    b.fill(&dst, POISON).unwrap();
    quantize_latent(b, layout, &src, slots, &dst).unwrap();
    b.read(&dst, 0, dst.len()).unwrap()
}

fn run_indexer<B: Backend>(
    b: &B,
    scale: IndexerScale,
    input: &[u8],
    slots: &[i64],
    pages: usize,
) -> Vec<u8> {
    let src = b.alloc(input.len(), MemoryKind::Device).unwrap();
    b.write(&src, 0, input).unwrap();
    let dst = b
        .alloc(pages * INDEXER_PAGE_BYTES, MemoryKind::Device)
        .unwrap();
    b.fill(&dst, POISON).unwrap();
    quantize_indexer(b, scale, &src, slots, &dst).unwrap();
    b.read(&dst, 0, dst.len()).unwrap()
}

fn bf16_row(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

#[test]
fn cpu_latent_rows_land_at_their_slots_and_nowhere_else() {
    let mut rng = common::rng("cpu_latent_rows_land_at_their_slots_and_nowhere_else");
    let (tokens, rows) = (50, 80);
    let input = latent_input(&mut rng, tokens);
    let slots = slots(&mut rng, tokens, rows);
    for layout in LatentLayout::ALL {
        let out = run_latent(&CpuBackend::new(), layout, &input, &slots, rows);
        let rb = layout.row_bytes();
        let mut expected = vec![POISON; rows * rb];
        for (t, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
            let row =
                bf16_row(&input[t * LATENT_INPUT_ROW_BYTES..(t + 1) * LATENT_INPUT_ROW_BYTES]);
            fp8::quantize_latent_row(
                layout,
                &row,
                &mut expected[s as usize * rb..(s as usize + 1) * rb],
            );
        }
        assert_eq!(out, expected, "{layout}");
    }
}

#[test]
fn cpu_indexer_blocks_are_page_major() {
    let mut rng = common::rng("cpu_indexer_blocks_are_page_major");
    let (tokens, pages) = (70, 3);
    let input = synth::bf16_bytes(&mut rng, tokens * 128);
    let slots = slots(&mut rng, tokens, pages * PAGE_SIZE);
    let out = run_indexer(
        &CpuBackend::new(),
        IndexerScale::Ue8m0,
        &input,
        &slots,
        pages,
    );
    for (t, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
        let (page, off) = (s as usize / 64, s as usize % 64);
        let keys = bf16_row(&input[t * INDEXER_INPUT_ROW_BYTES..(t + 1) * INDEXER_INPUT_ROW_BYTES]);
        let mut codes = [0u8; 128];
        let scale = fp8::quantize_indexer_row(&keys, IndexerScale::Ue8m0, &mut codes);
        let block = &out[page * INDEXER_PAGE_BYTES..(page + 1) * INDEXER_PAGE_BYTES];
        assert_eq!(&block[off * 128..off * 128 + 128], &codes);
        assert_eq!(&block[8192 + 4 * off..8196 + 4 * off], &scale.to_le_bytes());
    }
    let untouched = (0..pages * 64)
        .filter(|r| !slots.contains(&(*r as i64)))
        .count();
    let poisoned_scales = (0..pages * 64)
        .filter(|r| out[r / 64 * INDEXER_PAGE_BYTES + 8192 + 4 * (r % 64)..][..4] == [POISON; 4])
        .count();
    assert_eq!(untouched, poisoned_scales);
}

#[test]
fn out_of_range_slots_are_rejected_before_anything_is_written() {
    let b = CpuBackend::new();
    let src = b
        .alloc(2 * LATENT_INPUT_ROW_BYTES, MemoryKind::Device)
        .unwrap();
    let dst = b.alloc(4 * 576, MemoryKind::Device).unwrap();
    b.fill(&dst, POISON).unwrap();
    let err = quantize_latent(&b, LatentLayout::Fp8Trtllm, &src, &[1, 4], &dst).unwrap_err();
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
    assert!(b
        .read(&dst, 0, dst.len())
        .unwrap()
        .iter()
        .all(|&x| x == POISON));
}

#[test]
fn gpu_latent_quantizer_matches_cpu_byte_for_byte() {
    let Some(gpu) = common::cuda("gpu_latent_quantizer_matches_cpu_byte_for_byte") else {
        return;
    };
    let mut rng = common::rng("gpu_latent_quantizer_matches_cpu_byte_for_byte");
    for (tokens, rows) in [(1, 1), (37, 64), (5000, 6000)] {
        let input = latent_input(&mut rng, tokens.max(1));
        let slots = slots(&mut rng, tokens, rows);
        for layout in LatentLayout::ALL {
            let cpu = run_latent(&CpuBackend::new(), layout, &input, &slots, rows);
            let gpu_out = run_latent(&gpu, layout, &input, &slots, rows);
            assert!(
                cpu == gpu_out,
                "{layout}, {tokens} tokens: GPU differs from the CPU reference"
            );
        }
    }
}

#[test]
fn gpu_indexer_quantizer_matches_cpu_byte_for_byte() {
    let Some(gpu) = common::cuda("gpu_indexer_quantizer_matches_cpu_byte_for_byte") else {
        return;
    };
    let mut rng = common::rng("gpu_indexer_quantizer_matches_cpu_byte_for_byte");
    for (tokens, pages) in [(1, 1), (63, 2), (4099, 80)] {
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
            let cpu = run_indexer(&CpuBackend::new(), scale, &input, &slots, pages);
            let gpu_out = run_indexer(&gpu, scale, &input, &slots, pages);
            assert!(
                cpu == gpu_out,
                "{scale:?}, {tokens} tokens: GPU differs from the CPU reference"
            );
        }
    }
}

/// The raw entry point with device-resident slots: the kernel skips the bad slot, writes the
/// rest, and the next synchronize names the kernel and the first bad position, on both backends.
fn raw_bad_slot_is_reported<B: Backend>(b: &B) {
    let src = b
        .alloc(3 * LATENT_INPUT_ROW_BYTES, MemoryKind::Device)
        .unwrap();
    b.write(&src, 0, &vec![0x3C; src.len()]).unwrap();
    let slots = b.alloc(24, MemoryKind::Device).unwrap();
    b.write(&slots, 0, &i64s_to_bytes(&[0, 9, 1])).unwrap();
    let dst = b.alloc(2 * 576, MemoryKind::Device).unwrap();
    b.fill(&dst, POISON).unwrap();
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
    match b.synchronize() {
        Err(Error::KernelRejected { kernel, position }) => {
            assert_eq!((kernel, position), ("kvs_quantize_latent", 1))
        }
        other => panic!("{}: expected a rejection, got {other:?}", b.name()),
    }
    let out = b.read(&dst, 0, dst.len()).unwrap();
    assert!(
        out.iter().all(|&x| x != POISON),
        "{}: in-range rows written",
        b.name()
    );
    assert!(b.synchronize().is_ok(), "a report is delivered once");
}

#[test]
fn raw_bad_slot_is_reported_on_cpu() {
    raw_bad_slot_is_reported(&CpuBackend::new());
}

#[test]
fn gpu_raw_bad_slot_is_reported() {
    if let Some(gpu) = common::cuda("gpu_raw_bad_slot_is_reported") {
        raw_bad_slot_is_reported(&gpu);
    }
}

#[test]
fn cpu_streams_share_memory_but_not_status() {
    let a = CpuBackend::new();
    let b = a.new_stream();
    let buf = a.alloc(16, MemoryKind::Device).unwrap();
    b.write(&buf, 0, &[7; 16]).unwrap();
    assert_eq!(a.read(&buf, 0, 16).unwrap(), vec![7; 16]);
    raw_bad_slot_is_reported(&b);
    assert!(
        a.synchronize().is_ok(),
        "another stream's rejection is not ours"
    );
}
