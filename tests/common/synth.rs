//! Synthetic inputs for the library's integration tests: random, never zero, seeded. (The
//! applications in cli/ have their own, `kvshard_cli::synth`: the library carries no test data
//! and no random generator.)

use half::bf16;
use rand::seq::SliceRandom;
use rand::Rng;

/// Byte every output is filled with before a kernel runs, so an unwritten byte shows.
pub const POISON: u8 = 0xA5;

/// `count` random bf16 values (little-endian bytes), normal-distributed-ish with magnitudes
/// spread over many binades, so FP8 rounding, saturation and scales are all exercised.
pub fn bf16_bytes(rng: &mut impl Rng, count: usize) -> Vec<u8> {
    (0..count)
        .flat_map(|_| {
            let mantissa: f32 = rng.random_range(-1.0..1.0);
            let exponent: i32 = rng.random_range(-12..10);
            bf16::from_f32(mantissa * 2f32.powi(exponent))
                .to_bits()
                .to_le_bytes()
        })
        .collect()
}

/// Values the FP8 encoder treats specially: NaNs of both signs, infinities, saturation
/// boundaries, signed zeros, subnormals and exact rounding midpoints.
pub fn fp8_edge_values() -> Vec<f32> {
    let mut v = vec![
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        448.0,
        464.0,
        480.0,
        -1.0e6,
        0.0,
        -0.0,
        2f32.powi(-9),
        2f32.powi(-10),
        3.0 * 2f32.powi(-11),
        -2f32.powi(-7),
    ];
    // Midpoints between neighbouring E4M3 values (representable in bf16: 4 mantissa bits).
    for code in 0..0x7Eu8 {
        v.push((kvshard::fp8::decode_e4m3(code) + kvshard::fp8::decode_e4m3(code + 1)) / 2.0);
    }
    v
}

/// A random permutation of `0..n`.
pub fn permutation(rng: &mut impl Rng, n: usize) -> Vec<i64> {
    let mut v: Vec<i64> = (0..n as i64).collect();
    v.shuffle(rng);
    v
}

/// `n` random bytes.
pub fn bytes(rng: &mut impl Rng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill(&mut v[..]);
    v
}
