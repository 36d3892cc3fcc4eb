//! Inputs shared by the comm integration tests.

/// Pseudo-random floats of both signs spread over 2^`exponent_span` magnitudes around 1,
/// different on every rank: sums of them depend on the order of the additions, which is what
/// the equivalence and determinism tests need to see.
pub fn random_floats(rank: usize, len: usize, exponent_span: u64) -> Vec<f32> {
    let mut state =
        0x1234_5678_9ABC_DEF0u64 ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let lowest = -((exponent_span / 2) as i32);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mantissa = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let exponent = ((state >> 8) % exponent_span) as i32 + lowest;
            mantissa * 2f32.powi(exponent)
        })
        .collect()
}
