//! FP8 E4M3 reference codecs (the CPU twins of `cuda/quantize.cu`).
//!
//! Bit-level conversion comes from the `float8` crate, a port of CUDA's own `cuda_fp8.hpp`
//! conversion: round-to-nearest-even, saturation to +-448 (`__NV_SATFINITE`), subnormals
//! rounded correctly. kvshard adds one rule on top: **every NaN encodes to 0x7F** whatever its
//! sign (CUDA's host path keeps the sign, the hardware instruction's handling of it is not
//! something a cache should depend on); the kernels apply the same rule.
//!
//! Quantization formulas (all in f32, IEEE division, exactly as the kernels compute them):
//! - trtllm latent (576 B): every element `e4m3(x)` (scale 1.0);
//! - scaled latent (656 B): per 128-element nope tile `scale = amax / 448`, codes
//!   `e4m3(x / scale)`; a tile whose amax is 0 stores scale 0 and its (signed) zeros unscaled;
//!   the 64 rope elements stay bf16;
//! - indexer: `scale = 2^ceil(log2(max(amax, 1e-4) / 448))` (ue8m0, computed from the f32 bits)
//!   or `max(amax, 1e-4) / 448` (plain); codes `e4m3(x / scale)`.

use float8::F8E4M3;
use half::bf16;

use crate::error::{Error, Result};

use crate::geometry::{
    IndexerScale, LatentLayout, INDEXER_HEAD_DIM, KV_LORA_RANK, LATENT_DIM, LATENT_SCALE_TILE,
};

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// The code every NaN encodes to.
pub const E4M3_NAN: u8 = 0x7F;

/// f32 -> E4M3 code: round-to-nearest-even, saturating to +-448, NaN -> 0x7F.
pub fn encode_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        E4M3_NAN
    } else {
        F8E4M3::from_f32(x).to_bits()
    }
}

/// E4M3 code -> f32 (exact). 0x7F and 0xFF decode to NaN.
pub fn decode_e4m3(code: u8) -> f32 {
    F8E4M3::from_bits(code).to_f32()
}

fn amax(values: &[bf16]) -> f32 {
    values.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()))
}

/// The ue8m0 indexer scale for a block whose largest magnitude is `amax`.
pub fn ue8m0_scale(amax: f32) -> f32 {
    let v = amax.max(1e-4) / E4M3_MAX;
    let bits = v.to_bits();
    let exponent = ((bits >> 23) & 0xFF) as i32 - 127 + i32::from(bits & 0x7F_FFFF != 0);
    f32::from_bits(((exponent + 127) as u32) << 23)
}

/// The indexer scale of one token's key.
pub fn indexer_scale(keys: &[bf16], kind: IndexerScale) -> f32 {
    let amax = amax(keys);
    match kind {
        IndexerScale::Ue8m0 => ue8m0_scale(amax),
        IndexerScale::Plain => amax.max(1e-4) / E4M3_MAX,
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::InvalidArgument(format!(
            "{what}: {got} elements, {want} expected"
        )));
    }
    Ok(())
}

/// Quantizes one token's 128 bf16 indexer key elements into 128 `codes`, returning the scale.
pub fn quantize_indexer_row(keys: &[bf16], kind: IndexerScale, codes: &mut [u8]) -> Result<f32> {
    check_len("indexer key", keys.len(), INDEXER_HEAD_DIM)?;
    check_len("indexer codes", codes.len(), INDEXER_HEAD_DIM)?;
    let scale = indexer_scale(keys, kind);
    for (c, k) in codes.iter_mut().zip(keys) {
        *c = encode_e4m3(k.to_f32() / scale);
    }
    Ok(scale)
}

/// Quantizes one token's 576 bf16 latent elements (512 nope, then 64 rope) into a row of
/// `layout.row_bytes()` bytes.
pub fn quantize_latent_row(layout: LatentLayout, input: &[bf16], row: &mut [u8]) -> Result<()> {
    check_len("latent input", input.len(), LATENT_DIM)?;
    check_len("latent row bytes", row.len(), layout.row_bytes())?;
    match layout {
        LatentLayout::Bf16 => {
            for (chunk, v) in row.chunks_exact_mut(2).zip(input) {
                chunk.copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        LatentLayout::Fp8Trtllm => {
            for (c, v) in row.iter_mut().zip(input) {
                *c = encode_e4m3(v.to_f32());
            }
        }
        LatentLayout::Fp8Scaled => {
            let (codes, rest) = row.split_at_mut(KV_LORA_RANK);
            let (scales, rope) = rest.split_at_mut(
                (crate::abi::KVS_LATENT_SCALED_ROPE_OFFSET
                    - crate::abi::KVS_LATENT_SCALED_SCALES_OFFSET) as usize,
            );
            let (nope, rope_in) = input.split_at(KV_LORA_RANK);
            for (tile, (tile_codes, tile_in)) in codes
                .chunks_exact_mut(LATENT_SCALE_TILE)
                .zip(nope.chunks_exact(LATENT_SCALE_TILE))
                .enumerate()
            {
                let scale = amax(tile_in) / E4M3_MAX;
                for (c, v) in tile_codes.iter_mut().zip(tile_in) {
                    let x = v.to_f32();
                    *c = encode_e4m3(if scale != 0.0 { x / scale } else { x });
                }
                scales[4 * tile..4 * tile + 4].copy_from_slice(&scale.to_le_bytes());
            }
            for (chunk, v) in rope.chunks_exact_mut(2).zip(rope_in) {
                chunk.copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_256_codes_round_trip() {
        for code in 0..=255u8 {
            let x = decode_e4m3(code);
            if code & 0x7F == 0x7F {
                assert!(x.is_nan(), "code {code:#04x} must be NaN");
                assert_eq!(encode_e4m3(x), E4M3_NAN);
            } else {
                assert!(
                    x.is_finite() && x.abs() <= E4M3_MAX,
                    "code {code:#04x} -> {x}"
                );
                assert_eq!(encode_e4m3(x), code, "code {code:#04x} -> {x}");
            }
        }
    }

    #[test]
    fn decode_matches_the_e4m3_formula() {
        for code in (0..=255u8).filter(|c| c & 0x7F != 0x7F) {
            let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
            let exp = i32::from((code >> 3) & 0xF);
            let man = f32::from(code & 7);
            let expected = if exp == 0 {
                sign * man / 8.0 * 2f32.powi(-6)
            } else {
                sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
            };
            assert_eq!(
                decode_e4m3(code).to_bits(),
                expected.to_bits(),
                "code {code:#04x}"
            );
        }
    }

    #[test]
    fn midpoints_round_to_even() {
        // Every pair of neighbouring positive finite codes: the midpoint goes to the even code.
        for code in 0..0x7Eu8 {
            let lo = decode_e4m3(code);
            let hi = decode_e4m3(code + 1);
            let mid = (lo + hi) / 2.0;
            let even = if code % 2 == 0 { code } else { code + 1 };
            assert_eq!(encode_e4m3(mid), even, "midpoint of {code:#04x}");
            assert_eq!(
                encode_e4m3(-mid),
                even | 0x80,
                "negative midpoint of {code:#04x}"
            );
            let just_above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(encode_e4m3(just_above), code + 1);
        }
    }

    #[test]
    fn saturates_and_handles_specials() {
        assert_eq!(encode_e4m3(448.0), 0x7E);
        assert_eq!(encode_e4m3(463.9), 0x7E);
        assert_eq!(encode_e4m3(464.0), 0x7E);
        assert_eq!(encode_e4m3(1.0e9), 0x7E);
        assert_eq!(encode_e4m3(f32::INFINITY), 0x7E);
        assert_eq!(encode_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(encode_e4m3(f32::NAN), 0x7F);
        assert_eq!(encode_e4m3(-f32::NAN), 0x7F);
        assert_eq!(encode_e4m3(0.0), 0x00);
        assert_eq!(encode_e4m3(-0.0), 0x80);
        // Smallest subnormal is 2^-9; half of it rounds to even (zero), a bit more rounds up.
        assert_eq!(encode_e4m3(2f32.powi(-9)), 0x01);
        assert_eq!(encode_e4m3(2f32.powi(-10)), 0x00);
        assert_eq!(encode_e4m3(2f32.powi(-10) * 1.01), 0x01);
    }

    #[test]
    fn ue8m0_scale_is_the_next_power_of_two() {
        assert_eq!(ue8m0_scale(448.0), 1.0);
        assert_eq!(ue8m0_scale(449.0), 2.0);
        assert_eq!(ue8m0_scale(224.0), 0.5);
        assert_eq!(ue8m0_scale(0.0), ue8m0_scale(1e-4));
        let s = ue8m0_scale(1e-4);
        assert!((1e-4 / 448.0..2.0 * 1e-4 / 448.0).contains(&s));
        for amax in [0.01f32, 0.3, 7.0, 1000.0, 3.0e5] {
            let s = ue8m0_scale(amax);
            assert_eq!(s.to_bits() & 0x7F_FFFF, 0, "power of two");
            assert!(s >= amax / 448.0 && s / 2.0 < amax / 448.0, "{amax} -> {s}");
        }
    }

    #[test]
    fn scaled_row_layout() {
        let mut input = vec![bf16::from_f32(0.0); LATENT_DIM];
        input[0] = bf16::from_f32(-3.0); // tile 0 amax 3
        input[130] = bf16::from_f32(896.0); // tile 1 amax 896 -> scale 2
        input[512] = bf16::from_f32(1.5); // rope
        let mut row = vec![0u8; 656];
        quantize_latent_row(LatentLayout::Fp8Scaled, &input, &mut row).unwrap();
        let scale =
            |t: usize| f32::from_le_bytes(row[512 + 4 * t..516 + 4 * t].try_into().unwrap());
        assert_eq!(scale(0), 3.0 / 448.0);
        assert_eq!(scale(1), 2.0);
        assert_eq!(scale(2), 0.0, "all-zero tile");
        assert_eq!(row[0], encode_e4m3(-3.0 / (3.0 / 448.0)));
        assert_eq!(decode_e4m3(row[130]), 448.0);
        assert_eq!(&row[528..530], &bf16::from_f32(1.5).to_bits().to_le_bytes());
    }

    #[test]
    fn trtllm_row_is_unscaled_e4m3() {
        let input: Vec<bf16> = (0..LATENT_DIM)
            .map(|i| bf16::from_f32(i as f32 / 7.0 - 40.0))
            .collect();
        let mut row = vec![0u8; 576];
        quantize_latent_row(LatentLayout::Fp8Trtllm, &input, &mut row).unwrap();
        for (c, v) in row.iter().zip(&input) {
            assert_eq!(*c, encode_e4m3(v.to_f32()));
        }
    }

    #[test]
    fn indexer_row_codes_and_scale() {
        let keys: Vec<bf16> = (0..INDEXER_HEAD_DIM)
            .map(|i| bf16::from_f32(i as f32 - 60.0))
            .collect();
        let mut codes = [0u8; INDEXER_HEAD_DIM];
        let scale = quantize_indexer_row(&keys, IndexerScale::Ue8m0, &mut codes).unwrap();
        assert_eq!(scale, 0.25); // amax 67 -> 67/448 = 0.1496 -> 2^-2
        assert_eq!(decode_e4m3(codes[0]), -240.0);
        let plain = quantize_indexer_row(&keys, IndexerScale::Plain, &mut codes).unwrap();
        assert_eq!(plain, 67.0 / 448.0);
        assert_eq!(decode_e4m3(codes[127]), 448.0);
        // Wrong lengths are errors, not panics.
        assert!(quantize_indexer_row(&keys[..5], IndexerScale::Plain, &mut codes).is_err());
        assert!(quantize_latent_row(LatentLayout::Fp8Scaled, &keys, &mut codes).is_err());
    }
}
