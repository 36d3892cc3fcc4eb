//! Storage dtypes. Compute is always f32; bf16/f16 are storage and wire formats
//! (compute copies of weights, compressed gradients), converted in bulk.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Parse "f32"/"fp32", "bf16", "f16"/"fp16".
    pub fn parse(name: &str) -> Option<DType> {
        match name {
            "f32" | "fp32" | "float32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "fp16" | "float16" => Some(DType::F16),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

pub fn to_bf16(src: &[f32]) -> Vec<bf16> {
    src.iter().map(|&x| bf16::from_f32(x)).collect()
}

pub fn to_f16(src: &[f32]) -> Vec<f16> {
    src.iter().map(|&x| f16::from_f32(x)).collect()
}

/// Round every value through bf16 and back: what a bf16 compute copy of f32 weights holds.
pub fn round_through_bf16(values: &mut [f32]) {
    values
        .iter_mut()
        .for_each(|v| *v = bf16::from_f32(*v).to_f32());
}

/// Round every value through f16 and back.
pub fn round_through_f16(values: &mut [f32]) {
    values
        .iter_mut()
        .for_each(|v| *v = f16::from_f32(*v).to_f32());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_keeps_three_significant_digits() {
        let mut v = vec![1.0f32, 2.71, -2.5e-3, 65504.0];
        let orig = v.clone();
        round_through_bf16(&mut v);
        for (a, b) in v.iter().zip(&orig) {
            assert!((a - b).abs() <= b.abs() * 4e-3, "{a} vs {b}");
        }
        assert_eq!(DType::parse("bf16"), Some(DType::BF16));
        assert_eq!(DType::parse("int8"), None);
    }
}
