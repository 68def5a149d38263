//! Synthetic inputs for the demos, `kvshard pd` and the GPU benchmark: random, never zero,
//! seeded.

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

/// SplitMix64's finalizer: a well-mixed 64-bit hash of `x`.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A generator seeded by `parts` (a seed and what the data belongs to): every process that
/// names the same parts draws the same bytes.
pub fn seeded(parts: &[u64]) -> rand::rngs::StdRng {
    use rand::SeedableRng;
    let seed = parts.iter().fold(0u64, |acc, &p| mix(acc ^ mix(p)));
    rand::rngs::StdRng::seed_from_u64(seed)
}
