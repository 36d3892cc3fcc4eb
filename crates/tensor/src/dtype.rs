//! Storage dtypes. Arithmetic outside matrix products is f32; bf16/f16 are the inputs of
//! mixed-precision products ([`crate::lowp`]), the storage of activations kept for backward
//! ([`HalfTensor`]) and wire formats (compressed gradients), converted in bulk.

use crate::Tensor;
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

/// A tensor stored in 16 bits (bf16 or f16): an activation kept from forward to backward
/// under mixed precision. The products that read it in backward round it to the same 16
/// bits anyway, so storing it rounded halves the memory and changes no result of theirs.
#[derive(Debug)]
pub struct HalfTensor {
    bits: Vec<u16>,
    dtype: DType,
    shape: Vec<usize>,
}

impl HalfTensor {
    /// `t` rounded to `dtype` (bf16 or f16, round to nearest even); its f32 buffer goes back
    /// to the thread's pool.
    pub fn from_tensor(t: Tensor, dtype: DType) -> Self {
        assert!(dtype != DType::F32, "HalfTensor holds bf16 or f16");
        let len = t.numel();
        let mut bits: Vec<u16> = Vec::with_capacity(len);
        let chunk = crate::par::PARALLEL_MIN_LEN;
        let src = t.data();
        crate::par::for_each_chunk_mut(&mut bits.spare_capacity_mut()[..len], chunk, |i, dst| {
            narrow(&src[i * chunk..][..dst.len()], dst, dtype)
        });
        // SAFETY: every element of the first `len` was written by `narrow`.
        unsafe { bits.set_len(len) };
        let shape = t.shape().to_vec();
        t.recycle();
        HalfTensor { bits, dtype, shape }
    }

    /// The values in f32 again (exactly the rounded values).
    pub fn into_tensor(self) -> Tensor {
        Tensor::from_vec(self.to_f32(), &self.shape)
    }

    /// The values in f32, row-major, in a buffer from the thread's pool.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = crate::par::take_buffer(self.bits.len());
        let chunk = crate::par::PARALLEL_MIN_LEN;
        crate::par::for_each_chunk_mut(&mut out, chunk, |i, dst| {
            widen(&self.bits[i * chunk..][..dst.len()], dst, self.dtype)
        });
        out
    }

    pub fn bytes(&self) -> usize {
        self.bits.len() * 2
    }

    /// The stored bits (bf16 or f16, as [`HalfTensor::dtype`] says), row-major.
    pub fn bits(&self) -> &[u16] {
        &self.bits
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        self.bits.len()
    }
}

/// `dst[i] = src[i]` rounded to `dtype` (bf16 or f16, nearest even), as bits.
fn narrow(src: &[f32], dst: &mut [std::mem::MaybeUninit<u16>], dtype: DType) {
    #[cfg(target_arch = "x86_64")]
    if simd::usable(dtype) {
        // SAFETY: the CPU has the instructions (checked); lengths are equal.
        return unsafe { simd::narrow(src, dst, dtype) };
    }
    for (d, &v) in dst.iter_mut().zip(src) {
        d.write(match dtype {
            DType::BF16 => bf16::from_f32(v).to_bits(),
            _ => f16::from_f32(v).to_bits(),
        });
    }
}

/// `values` rounded to `dtype` (bf16 or f16, nearest even) and back to f32, in place: the
/// inputs a mixed-precision product sees.
pub fn round_through(values: &mut [f32], dtype: DType) {
    if dtype == DType::F32 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if simd::usable(dtype) {
        // SAFETY: the CPU has the instructions (checked).
        return unsafe { simd::round_through(values, dtype) };
    }
    match dtype {
        DType::BF16 => round_through_bf16(values),
        _ => round_through_f16(values),
    }
}

/// `dst[i]` = the f32 value of the bf16 or f16 bits `src[i]` (exact).
pub(crate) fn widen(src: &[u16], dst: &mut [f32], dtype: DType) {
    #[cfg(target_arch = "x86_64")]
    if simd::usable(dtype) {
        // SAFETY: as in `narrow`.
        return unsafe { simd::widen(src, dst, dtype) };
    }
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = match dtype {
            DType::BF16 => bf16::from_bits(b).to_f32(),
            _ => f16::from_bits(b).to_f32(),
        };
    }
}

/// Sixteen values per instruction: `vcvtneps2bf16` (AVX-512 BF16) and `vcvtps2ph` (AVX-512F)
/// round to nearest even like `half` does (but flush f32 subnormals, below 2⁻¹²⁶, to zero:
/// harmless for training values), at a fraction of its scalar cost (the conversions
/// of activations kept for backward were ~11% of a bf16 GPT step through `half`).
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::DType;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    pub fn usable(dtype: DType) -> bool {
        dtype != DType::F32
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && (dtype == DType::F16 || std::arch::is_x86_feature_detected!("avx512bf16"))
    }

    fn lanes(left: usize) -> u16 {
        if left >= 16 {
            0xffff
        } else {
            ((1u32 << left) - 1) as u16
        }
    }

    /// # Safety
    /// [`usable`] for `dtype`; `dst.len() == src.len()`.
    pub unsafe fn narrow(src: &[f32], dst: &mut [MaybeUninit<u16>], dtype: DType) {
        match dtype {
            DType::BF16 => narrow_bf16(src, dst),
            _ => narrow_f16(src, dst),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn narrow_bf16(src: &[f32], dst: &mut [MaybeUninit<u16>]) {
        for i in (0..src.len()).step_by(16) {
            let mask = lanes(src.len() - i);
            let v = _mm512_maskz_loadu_ps(mask, src.as_ptr().add(i));
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i) as *mut i16, mask, h);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn narrow_f16(src: &[f32], dst: &mut [MaybeUninit<u16>]) {
        for i in (0..src.len()).step_by(16) {
            let mask = lanes(src.len() - i);
            let v = _mm512_maskz_loadu_ps(mask, src.as_ptr().add(i));
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i) as *mut i16, mask, h);
        }
    }

    /// # Safety
    /// [`usable`] for `dtype`.
    pub unsafe fn round_through(values: &mut [f32], dtype: DType) {
        let mut bits = [MaybeUninit::<u16>::uninit(); 64];
        let mut wide = [0.0f32; 64];
        for part in values.chunks_mut(64) {
            let n = part.len();
            narrow(part, &mut bits[..n], dtype);
            // SAFETY: `narrow` wrote the first n.
            let written = std::slice::from_raw_parts(bits.as_ptr() as *const u16, n);
            widen(written, &mut wide[..n], dtype);
            part.copy_from_slice(&wide[..n]);
        }
    }

    /// # Safety
    /// As [`narrow`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn widen(src: &[u16], dst: &mut [f32], dtype: DType) {
        for i in (0..src.len()).step_by(16) {
            let mask = lanes(src.len() - i);
            let h = _mm256_maskz_loadu_epi16(mask, src.as_ptr().add(i) as *const i16);
            let v = match dtype {
                DType::BF16 => {
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                }
                _ => _mm512_cvtph_ps(h),
            };
            _mm512_mask_storeu_ps(dst.as_mut_ptr().add(i), mask, v);
        }
    }
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

    #[test]
    fn half_tensors_keep_the_rounded_values_at_half_the_bytes() {
        let values: Vec<f32> = (0..40_000).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        for dtype in [DType::BF16, DType::F16] {
            let t = Tensor::from_vec(values.clone(), &[200, 200]);
            let h = HalfTensor::from_tensor(t, dtype);
            assert_eq!(h.bytes(), 80_000);
            let back = h.into_tensor();
            assert_eq!(back.shape(), &[200, 200]);
            let mut want = values.clone();
            match dtype {
                DType::BF16 => round_through_bf16(&mut want),
                _ => round_through_f16(&mut want),
            }
            assert_eq!(back.data(), &want[..], "{dtype}");
            let mut rounded = values.clone();
            round_through(&mut rounded, dtype);
            assert_eq!(rounded, want, "{dtype}: round_through");
        }
    }
}
