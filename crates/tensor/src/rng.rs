//! A tiny deterministic RNG shared by parameter initialisation, the data pipeline and other
//! crates (one generator for the whole project, so seeds mean the same thing everywhere).
//!
//! SplitMix64 (Steele, Lea & Flood 2014; the seeding generator of
//! xoshiro): 64-bit state, integer-only arithmetic, so a seed gives the same
//! stream on every platform and Rust version. Good enough for shuffling and
//! sampling offsets; not cryptographic.

/// SplitMix64 generator. Cloning it forks an identical stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 output function: a bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `n` standard normal values from `seed` (inputs for kernel tests and benchmarks).
pub fn normal_values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    (0..n).map(|_| r.normal()).collect()
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// An independent stream for `(seed, stream)`, e.g. one per epoch or per
    /// rank: mixing the stream id keeps nearby ids from giving overlapping
    /// sequences.
    pub fn derive(seed: u64, stream: u64) -> Self {
        Self::new(seed ^ mix64(stream.wrapping_add(GOLDEN_GAMMA)))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// Uniform in `0..bound` without modulo bias (Lemire's multiply-shift
    /// with rejection).
    ///
    /// # Panics
    /// If `bound` is 0 (an empty range has no value to return).
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "SplitMix64::below needs a non-zero bound");
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(bound);
            if (product as u64) >= threshold {
                return (product >> 64) as u64;
            }
        }
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, 1)` with 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Standard normal sample (Box–Muller on two uniforms).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.next_f64();
        let u2 = self.next_f64();
        let r = (-2.0 * (1.0 - u1).ln()).sqrt();
        (r * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    /// Fisher–Yates shuffle in place.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_samples_have_unit_variance() {
        let mut r = SplitMix64::new(1);
        let n = 20000;
        let var = (0..n).map(|_| (r.normal() as f64).powi(2)).sum::<f64>() / n as f64;
        assert!((var - 1.0).abs() < 0.05, "var {var}");
        let mean = (0..n).map(|_| r.next_f32() as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    }

    /// Reference values from an independent Python implementation of the
    /// published algorithm (see crates/data/scripts/splitmix64_reference.py).
    #[test]
    fn matches_reference_stream() {
        let mut rng = SplitMix64::new(0);
        let first: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(
            first,
            [0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f]
        );
        let mut rng = SplitMix64::new(1234567);
        let first: Vec<u64> = (0..2).map(|_| rng.next_u64()).collect();
        assert_eq!(first, [6457827717110365317, 3203168211198807973]);
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SplitMix64::new(7);
        let mut seen = [0usize; 7];
        for _ in 0..7000 {
            seen[rng.below(7) as usize] += 1;
        }
        // Each bucket expects 1000; 5 sigma is about 150.
        assert!(seen.iter().all(|&c| (850..1150).contains(&c)), "{seen:?}");
    }

    #[test]
    fn shuffle_is_a_deterministic_permutation() {
        let mut a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        SplitMix64::new(42).shuffle(&mut a);
        SplitMix64::new(42).shuffle(&mut b);
        assert_eq!(a, b);
        assert_ne!(a, (0..100).collect::<Vec<_>>());
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn derived_streams_differ() {
        let a = SplitMix64::derive(5, 0).next_u64();
        let b = SplitMix64::derive(5, 1).next_u64();
        assert_ne!(a, b);
    }

    #[test]
    fn unit_floats_in_range() {
        let mut rng = SplitMix64::new(3);
        let mean = (0..10_000).map(|_| rng.next_f64()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }
}
