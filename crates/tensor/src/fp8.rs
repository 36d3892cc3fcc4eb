//! 8-bit floating point (FP8) for matrix products on Hopper-class GPUs: the two formats, their
//! conversions, the per-tensor scaling that makes 8 bits enough, and the product's CPU twin.
//!
//! Why two formats (the OCP FP8 formats that Hopper's tensor cores take; NVIDIA's Transformer
//! Engine recipe): forward tensors (inputs, weights) need precision more than range, gradients
//! the reverse.
//! * **E4M3** ("e4m3fn"): 4 exponent bits (bias 7), 3 mantissa bits, no infinities, one NaN
//!   pattern per sign (`S.1111.111`); largest finite ±448, smallest normal 2⁻⁶, smallest
//!   subnormal 2⁻⁹. For activations and weights.
//! * **E5M2**: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like (infinities, NaNs);
//!   largest finite ±57,344, smallest subnormal 2⁻¹⁶. For gradients.
//!
//! Why scales: 448 is small. A tensor is multiplied by a per-tensor `scale` before the cast,
//! chosen so its largest magnitude (`amax`) lands on the format's largest value, and the
//! product is multiplied back by `1 / (scale_a · scale_b)` in f32 (cuBLASLt's `A_SCALE`/
//! `B_SCALE` pointers take these inverses).
//!
//! Why the scale comes from the tensor itself (**current**, or dynamic, scaling: one amax pass
//! before the cast): it is what PyTorch's own float8 training (torchao's default "tensorwise"
//! recipe) and Transformer Engine's `Float8CurrentScaling` do. The older **delayed** scaling
//! takes the scale from earlier steps' maxima, saving that pass at the price of state that
//! has to be checkpointed, agreed across ranks and warmed up (its first step runs at scale
//! 1), and of an overflow whenever a tensor grows faster than its history: torchao dropped it.
//! With current scaling a resumed run continues exactly, and a parallel layout needs no state
//! in common: a data-parallel replica or a pipeline micro-batch casts whole tensors of its
//! own. Only ranks holding *shards* of one tensor (tensor parallelism) agree on its amax, the
//! largest of theirs, so that each shard is cast at the whole tensor's scale, as one worker
//! casts it: [`gemm_fp8_scaled`] takes scales decided outside it.
//!
//! Conversions round to nearest, ties to even, and **saturate**: a finite value beyond the
//! largest becomes ±largest, as PTX's `cvt.rn.satfinite` and Transformer Engine's casts do
//! (an infinity too; NaN stays NaN). The CUDA kernels (`kernels/fp8.cu`) implement the same
//! bit arithmetic and are tested against [`Fp8Format::encode`].
//!
//! [`gemm_fp8`] is the CPU twin of an FP8 product: both operands rounded to their formats'
//! grids after scaling, the product of those exact values accumulated in f32, then
//! unscaled. Every E4M3 and E5M2 value is exact in bf16, so the bf16 product kernels
//! ([`crate::lowp`]) multiply them without a further rounding.

use crate::lowp::gemm_lowp;
use crate::matmul::{Mat, MatMut};
use crate::{par, DType};
use rayon::prelude::*;

/// One of the two FP8 formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent, 3 mantissa bits, no infinities (±448): activations and weights.
    E4M3,
    /// 5 exponent, 2 mantissa bits, IEEE-like (±57,344): gradients.
    E5M2,
}

impl Fp8Format {
    /// Mantissa bits.
    const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// The exponent's bias.
    const fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }

    /// The code of the largest finite magnitude (sign bit clear).
    const fn max_code(self) -> u8 {
        match self {
            // S.1111.110: S.1111.111 is NaN.
            Fp8Format::E4M3 => 0x7E,
            // S.11110.11: the all-ones exponent is infinity and NaN.
            Fp8Format::E5M2 => 0x7B,
        }
    }

    /// The NaN this module writes (sign bit clear); PTX writes the same.
    pub const fn nan_code(self) -> u8 {
        0x7F
    }

    /// The largest finite value: 448 (E4M3) or 57,344 (E5M2).
    pub fn max(self) -> f32 {
        self.normal_value(self.max_code())
    }

    /// The smallest normal value: 2⁻⁶ (E4M3) or 2⁻¹⁴ (E5M2), 2^(1 − bias) by its f32 bits.
    pub fn min_normal(self) -> f32 {
        f32::from_bits(((128 - self.bias()) as u32) << 23)
    }

    /// The smallest subnormal, the step between subnormals: 2^(1 − bias − mantissa bits).
    fn subnormal_unit(self) -> f32 {
        f32::from_bits(((128 - self.bias() - self.mantissa_bits() as i32) as u32) << 23)
    }

    /// The value of a normal code's magnitude (exponent field 1 or more), built as f32 bits:
    /// the exponent rebiased, the mantissa bits moved to the top of f32's.
    fn normal_value(self, magnitude: u8) -> f32 {
        let m_bits = self.mantissa_bits();
        let exponent = (magnitude >> m_bits) as i32 - self.bias() + 127;
        let mantissa = (magnitude & ((1 << m_bits) - 1)) as u32;
        f32::from_bits(((exponent as u32) << 23) | (mantissa << (23 - m_bits)))
    }

    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }

    /// The value of `code`.
    pub fn decode(self, code: u8) -> f32 {
        let m_bits = self.mantissa_bits();
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let magnitude = code & 0x7F;
        let exponent = (magnitude >> m_bits) as i32;
        let mantissa = (magnitude & ((1 << m_bits) - 1)) as f32;
        let all_ones = (1i32 << (7 - m_bits)) - 1;
        match self {
            Fp8Format::E4M3 if magnitude == 0x7F => return f32::NAN,
            Fp8Format::E5M2 if exponent == all_ones => {
                return if mantissa == 0.0 {
                    sign * f32::INFINITY
                } else {
                    f32::NAN
                };
            }
            _ => {}
        }
        if exponent == 0 {
            sign * mantissa * self.subnormal_unit()
        } else {
            sign * self.normal_value(magnitude)
        }
    }

    /// The code nearest to `x`: ties to even, saturating (±largest for any finite value or
    /// infinity beyond it), NaN to [`Fp8Format::nan_code`].
    pub fn encode(self, x: f32) -> u8 {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        if x.is_nan() {
            return sign | self.nan_code();
        }
        let magnitude = bits & 0x7FFF_FFFF;
        let m_bits = self.mantissa_bits();
        let code = if f32::from_bits(magnitude) < self.min_normal() {
            // Subnormal (or zero) in FP8: count units of the smallest subnormal, rounded to
            // the nearest integer, ties to even. Scaling by a power of two is exact here; a
            // count of 2^m_bits is the smallest normal, whose code is that count too.
            (f32::from_bits(magnitude) / self.subnormal_unit()).round_ties_even() as u32
        } else {
            // Normal: drop the f32 mantissa's low bits with round-to-nearest-even (a carry
            // into the exponent is the right result), then rebias the exponent.
            let shift = 23 - m_bits;
            let halfway = (1u32 << (shift - 1)) - 1;
            let rounded =
                (magnitude as u64 + halfway as u64 + ((magnitude >> shift) & 1) as u64) >> shift;
            let rebias = ((127 - self.bias()) as u64) << m_bits;
            (rounded - rebias).min(u32::MAX as u64) as u32
        };
        sign | code.min(self.max_code() as u32) as u8
    }

    /// `x` rounded to this format's grid (what a product reads after the cast): the value of
    /// [`Fp8Format::encode`]'s code, computed on the f32 bits directly (the CPU products'
    /// hot loop) and tested against it.
    pub fn round(self, x: f32) -> f32 {
        let m_bits = self.mantissa_bits();
        let unit = self.subnormal_unit();
        let a = x.abs();
        let rounded = if a.is_nan() {
            return x;
        } else if a < self.min_normal() {
            (a / unit).round_ties_even() * unit
        } else {
            let shift = 23 - m_bits;
            let bits = a.to_bits() as u64;
            let halfway = (1u64 << (shift - 1)) - 1;
            let kept = ((bits + halfway + ((bits >> shift) & 1)) >> shift) << shift;
            f32::from_bits(kept.min(0x7F80_0000) as u32)
        };
        rounded.min(self.max()).copysign(x)
    }
}

impl std::fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The largest magnitude in `values` (0 for none; NaN if one is NaN, which
/// [`current_scale`] turns into scale 1).
pub fn amax(values: &[f32]) -> f32 {
    amax_iter(values.iter().copied())
}

/// [`amax`] of any sequence of values: the one fold the slices, bf16 bits and strided views
/// share.
fn amax_iter(values: impl Iterator<Item = f32>) -> f32 {
    values.fold(0.0f32, |m, v| {
        let a = v.abs();
        if a.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(a)
        }
    })
}

/// The current-scaling factor of a tensor whose largest magnitude is `amax`: `amax` lands on
/// `format`'s largest value. A tensor of zeros, or one holding an infinity or NaN, is cast
/// with scale 1 (its product then carries the infinity or NaN, which the step's overflow
/// checks see).
pub fn current_scale(format: Fp8Format, amax: f32) -> f32 {
    if amax.is_finite() && amax > 0.0 {
        let scale = format.max() / amax;
        if scale.is_finite() {
            return scale;
        }
    }
    1.0
}

/// Elements per task of the parallel amax passes.
const AMAX_CHUNK: usize = 1 << 14;

/// [`amax`] on all threads.
pub fn amax_parallel(values: &[f32]) -> f32 {
    let maxima: Vec<f32> = values.par_chunks(AMAX_CHUNK).map(amax).collect();
    amax(&maxima)
}

/// [`amax_parallel`] of bf16 values (their bits), widened exactly.
pub fn amax_bf16(bits: &[u16]) -> f32 {
    let maxima: Vec<f32> = bits
        .par_chunks(AMAX_CHUNK)
        .map(|chunk| amax_iter(chunk.iter().map(|&b| f32::from_bits(u32::from(b) << 16))))
        .collect();
    amax(&maxima)
}

/// The largest magnitude of a matrix view's elements ([`amax`] over them, in parallel).
pub fn amax_of(m: &Mat) -> f32 {
    match m.dense_storage() {
        Some((storage, _, _)) => amax_parallel(storage),
        None => {
            let maxima: Vec<f32> = (0..m.rows())
                .into_par_iter()
                .map(|r| amax_iter((0..m.cols()).map(|c| m.at(r, c))))
                .collect();
            amax(&maxima)
        }
    }
}

/// How one operand of an FP8 product is cast: its format and the scale multiplied in first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Operand {
    pub format: Fp8Format,
    pub scale: f32,
}

impl Fp8Operand {
    /// The cast of a tensor whose largest magnitude is `amax`, at its [`current_scale`].
    pub fn current(format: Fp8Format, amax: f32) -> Fp8Operand {
        Fp8Operand {
            format,
            scale: current_scale(format, amax),
        }
    }
}

/// `values` multiplied by `operand.scale` and rounded to its format's grid, in place.
pub fn cast_in_place(values: &mut [f32], operand: Fp8Operand) {
    const CHUNK: usize = 1 << 14;
    values.par_chunks_mut(CHUNK).for_each(|chunk| {
        for v in chunk.iter_mut() {
            *v = operand.format.round(*v * operand.scale);
        }
    });
}

/// The matrix behind `m` cast as `operand` says: its elements and their row and column
/// strides. A view without gaps (a matrix or its transpose) is cast in storage order and
/// keeps its strides; any other is gathered row-major first.
fn cast_matrix(m: &Mat, operand: Fp8Operand) -> (Vec<f32>, usize, usize) {
    let (rows, cols) = (m.rows(), m.cols());
    let mut dense = par::take_buffer(rows * cols);
    let (rs, cs) = match m.dense_storage() {
        Some((storage, rs, cs)) => {
            dense.copy_from_slice(storage);
            (rs, cs)
        }
        None => {
            dense
                .par_chunks_mut(cols.max(1))
                .enumerate()
                .for_each(|(r, row)| {
                    for (c, v) in row.iter_mut().enumerate() {
                        *v = m.at(r, c);
                    }
                });
            (cols, 1)
        }
    };
    cast_in_place(&mut dense, operand);
    (dense, rs, cs)
}

/// A pointer that may cross to rayon's threads: each writes rows of its own.
#[derive(Clone, Copy)]
struct RowsOut(*mut f32);
// SAFETY: the rows written through it are disjoint (one task per row).
unsafe impl Send for RowsOut {}
unsafe impl Sync for RowsOut {}

impl RowsOut {
    /// The element `offset` places on (a method, so closures capture the whole `RowsOut`).
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// `c = a·b` (`+= a·b` when `accumulate`) as an FP8 product: each operand multiplied by its
/// current scale and cast to its format, the cast values multiplied with f32 accumulation
/// on `threads` threads, the result multiplied by `1 / (scale_a · scale_b)`. The CPU twin of
/// the GPU's cuBLASLt FP8 product; returns the two casts.
pub fn gemm_fp8(
    c: MatMut,
    a: Mat,
    a_format: Fp8Format,
    b: Mat,
    b_format: Fp8Format,
    accumulate: bool,
    threads: usize,
) -> [Fp8Operand; 2] {
    let a_cast = Fp8Operand::current(a_format, amax_of(&a));
    let b_cast = Fp8Operand::current(b_format, amax_of(&b));
    gemm_fp8_scaled(c, a, a_cast, b, b_cast, accumulate, threads);
    [a_cast, b_cast]
}

/// [`gemm_fp8`] with the casts decided by the caller (a tensor-parallel shard is cast at the
/// scale of the whole tensor, whose amax its group agreed on).
pub fn gemm_fp8_scaled(
    c: MatMut,
    a: Mat,
    a_cast: Fp8Operand,
    b: Mat,
    b_cast: Fp8Operand,
    accumulate: bool,
    threads: usize,
) {
    let (m, k, n) = (a.rows(), a.cols(), b.cols());
    assert_eq!(
        k,
        b.rows(),
        "fp8 product: a is {m}x{k}, b is {}x{n}",
        b.rows()
    );
    let (qa, a_rs, a_cs) = cast_matrix(&a, a_cast);
    let (qb, b_rs, b_cs) = cast_matrix(&b, b_cast);
    let mut product = par::take_buffer(m * n);
    // Exact bf16 inputs: the bf16 kernel rounds nothing, accumulates in f32.
    gemm_lowp(
        DType::BF16,
        MatMut::new(&mut product, m, n),
        Mat::strided(&qa, m, k, a_rs, a_cs),
        Mat::strided(&qb, k, n, b_rs, b_cs),
        false,
        threads,
    );
    // The inverses multiplied, as the GPU's scale pointers hold them.
    let unscale = (1.0 / a_cast.scale) * (1.0 / b_cast.scale);
    let (rs, cs) = (c.row_stride(), c.col_stride());
    let out = RowsOut(c.into_mut_ptr());
    product
        .par_chunks(n.max(1))
        .enumerate()
        .for_each(|(r, row)| {
            for (col, &p) in row.iter().enumerate() {
                let v = p * unscale;
                let dst = out.at(r * rs + col * cs);
                // SAFETY: (r, col) lies inside the view `c`, whose bounds MatMut checked, and
                // row r is this task's alone.
                unsafe { *dst = if accumulate { *dst + v } else { v } };
            }
        });
    par::recycle(product);
    par::recycle(qa);
    par::recycle(qb);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64 as Rng;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// Every finite value of `format` with its code, by decoding all 256 codes.
    fn finite_values(format: Fp8Format) -> Vec<(u8, f32)> {
        (0..=255u8)
            .map(|c| (c, format.decode(c)))
            .filter(|(_, v)| v.is_finite())
            .collect()
    }

    /// The reference: the nearest finite value by exhaustive search (in f64), ties to the
    /// even code, saturating; written apart from the bit arithmetic it checks.
    fn nearest(format: Fp8Format, x: f32) -> u8 {
        if x.is_nan() {
            return format.nan_code() | if x.is_sign_negative() { 0x80 } else { 0 };
        }
        let max = format.max() as f64;
        let x = (x as f64).clamp(-max, max);
        let mut best: Option<(f64, u8)> = None;
        for (code, v) in finite_values(format) {
            // Same-signed zeros only, so -0.0 maps to the negative zero.
            if v == 0.0 && (code & 0x80 != 0) != x.is_sign_negative() {
                continue;
            }
            let d = (v as f64 - x).abs();
            best = match best {
                None => Some((d, code)),
                Some((bd, bc)) if d < bd || (d == bd && code & 1 == 0 && bc & 1 == 1) => {
                    Some((d, code))
                }
                keep => keep,
            };
        }
        best.unwrap().1
    }

    #[test]
    fn the_formats_have_their_published_limits() {
        assert_eq!(Fp8Format::E4M3.max(), 448.0);
        assert_eq!(Fp8Format::E5M2.max(), 57344.0);
        assert_eq!(Fp8Format::E4M3.min_normal(), 2f32.powi(-6));
        assert_eq!(Fp8Format::E5M2.min_normal(), 2f32.powi(-14));
        assert_eq!(Fp8Format::E4M3.decode(0x01), 2f32.powi(-9));
        assert_eq!(Fp8Format::E5M2.decode(0x01), 2f32.powi(-16));
        assert!(Fp8Format::E4M3.decode(0x7F).is_nan());
        assert!(Fp8Format::E4M3.decode(0xFF).is_nan());
        assert_eq!(Fp8Format::E5M2.decode(0x7C), f32::INFINITY);
        assert_eq!(Fp8Format::E5M2.decode(0xFC), f32::NEG_INFINITY);
        assert!(Fp8Format::E5M2.decode(0x7D).is_nan());
        // E4M3 has 253 finite magnitudes-with-sign plus two zeros; E5M2 loses 8 codes.
        assert_eq!(finite_values(Fp8Format::E4M3).len(), 254);
        assert_eq!(finite_values(Fp8Format::E5M2).len(), 248);
    }

    /// The amax of bf16 bits, of a strided view and on all threads is [`amax`] of the same
    /// values, a NaN included.
    #[test]
    fn every_amax_is_the_largest_magnitude_of_its_values() {
        let mut rng = Rng::new(0xA3A);
        let values: Vec<f32> = (0..40_000).map(|_| rng.normal() * 3.0).collect();
        let bf16: Vec<u16> = values.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let widened: Vec<f32> = bf16
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        assert_eq!(amax_bf16(&bf16), amax(&widened));
        assert_eq!(amax_parallel(&values), amax(&values));
        // Every other column of a 200 x 200 matrix: a view with gaps.
        let m = Mat::strided(&values, 200, 100, 200, 2);
        let picked: Vec<f32> = (0..200 * 100)
            .map(|i| values[(i / 100) * 200 + 2 * (i % 100)])
            .collect();
        assert_eq!(amax_of(&m), amax(&picked));
        assert_eq!(amax_of(&Mat::new(&values, 200, 200).t()), amax(&values));
        let mut with_nan = widened.clone();
        with_nan[12_345] = f32::NAN;
        let nan_bits: Vec<u16> = with_nan
            .iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect();
        assert!(amax_bf16(&nan_bits).is_nan() && amax_parallel(&with_nan).is_nan());
    }

    #[test]
    fn every_finite_code_encodes_back_to_itself() {
        for format in FORMATS {
            for (code, v) in finite_values(format) {
                assert_eq!(format.encode(v), code, "{format} code {code:#04x} = {v}");
            }
        }
    }

    #[test]
    fn encoding_matches_the_exhaustive_nearest_value() {
        let mut rng = Rng::new(0x0F8);
        for format in FORMATS {
            let values = finite_values(format);
            let mut inputs: Vec<f32> = Vec::new();
            // Exact midpoints between neighbours (the ties), and points just either side.
            let mut sorted: Vec<f32> = values.iter().map(|&(_, v)| v).collect();
            sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
            for w in sorted.windows(2) {
                let mid = ((w[0] as f64 + w[1] as f64) / 2.0) as f32;
                inputs.extend([mid, mid.next_up(), mid.next_down()]);
            }
            // Random magnitudes over the whole range and beyond, both signs.
            for _ in 0..20_000 {
                let e = rng.next_f32() * 44.0 - 24.0;
                let sign = if rng.next_f32() < 0.5 { -1.0 } else { 1.0 };
                inputs.push(sign * 2f32.powf(e) * (1.0 + rng.next_f32()));
            }
            inputs.extend([
                0.0,
                -0.0,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::MAX,
                f32::MIN_POSITIVE,
                1e-45,
                format.max() * 1.03,
                -format.max() * 1.07,
            ]);
            for x in inputs {
                assert_eq!(format.encode(x), nearest(format, x), "{format} of {x:e}");
            }
            assert_eq!(format.encode(f32::NAN) & 0x7F, format.nan_code());
        }
    }

    #[test]
    fn rounding_is_the_value_of_the_code() {
        let mut rng = Rng::new(0x5EED);
        for format in FORMATS {
            let mut inputs: Vec<f32> = (0..100_000)
                .map(|_| {
                    let e = rng.next_f32() * 50.0 - 28.0;
                    (if rng.next_f32() < 0.5 { -1.0 } else { 1.0 }) * 2f32.powf(e)
                })
                .collect();
            inputs.extend(finite_values(format).iter().map(|&(_, v)| v));
            inputs.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, 1e-45]);
            for x in inputs {
                let (fast, slow) = (format.round(x), format.decode(format.encode(x)));
                assert_eq!(
                    fast.to_bits(),
                    slow.to_bits(),
                    "{format} of {x:e}: {fast} vs {slow}"
                );
            }
            assert!(format.round(f32::NAN).is_nan());
        }
    }

    #[test]
    fn ties_go_to_the_even_code_and_overflow_saturates() {
        // E4M3 around 1: neighbours 1.0 (0x38) and 1.125 (0x39); 1.0625 is the tie → 0x38.
        let f = Fp8Format::E4M3;
        assert_eq!(f.encode(1.0625), 0x38);
        // 1.125 and 1.25 (0x3A): the tie 1.1875 goes up to the even 0x3A.
        assert_eq!(f.encode(1.1875), 0x3A);
        // Beyond 448, even far beyond, and infinity: 448.
        for x in [464.0, 480.0, 1e6, f32::INFINITY] {
            assert_eq!(f.decode(f.encode(x)), 448.0, "{x}");
            assert_eq!(f.decode(f.encode(-x)), -448.0, "-{x}");
        }
        assert_eq!(Fp8Format::E5M2.decode(Fp8Format::E5M2.encode(1e9)), 57344.0);
    }

    #[test]
    fn the_current_scale_puts_the_amax_on_the_largest_value() {
        assert_eq!(current_scale(Fp8Format::E4M3, 2.0), 224.0);
        assert_eq!(current_scale(Fp8Format::E5M2, 57344.0), 1.0);
        for odd in [0.0, f32::INFINITY, f32::NAN, 1e-45] {
            assert_eq!(current_scale(Fp8Format::E4M3, odd), 1.0, "{odd}");
        }
        // The largest magnitude casts to the largest value exactly.
        let amax = 3.7f32;
        let s = current_scale(Fp8Format::E4M3, amax);
        assert_eq!(Fp8Format::E4M3.round(-amax * s), -448.0);
    }

    /// The product of the cast operands against f64 on the same grid values: only the f32
    /// accumulation differs. And against the exact product: E4M3's 3 mantissa bits give the
    /// few-percent error an fp8 product has.
    #[test]
    fn the_fp8_product_is_the_product_of_the_cast_operands() {
        let mut rng = Rng::new(8);
        let (m, k, n) = (37, 70, 29);
        let a: Vec<f32> = (0..m * k).map(|_| rng.normal() * 3.0).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.normal() * 0.02).collect();
        let mut c = vec![1.0f32; m * n];
        let [a_cast, b_cast] = gemm_fp8(
            MatMut::new(&mut c, m, n),
            Mat::new(&a, m, k),
            Fp8Format::E4M3,
            Mat::new(&b, k, n),
            Fp8Format::E5M2,
            true,
            2,
        );
        assert_eq!(a_cast.scale, 448.0 / amax(&a));
        assert_eq!(b_cast.scale, 57344.0 / amax(&b));
        let qa: Vec<f64> = a
            .iter()
            .map(|&x| a_cast.format.round(x * a_cast.scale) as f64)
            .collect();
        let qb: Vec<f64> = b
            .iter()
            .map(|&x| b_cast.format.round(x * b_cast.scale) as f64)
            .collect();
        let unscale = 1.0 / (a_cast.scale as f64 * b_cast.scale as f64);
        let (mut worst_grid, mut err, mut norm) = (0.0f64, 0.0f64, 0.0f64);
        for r in 0..m {
            for col in 0..n {
                let (mut on_grid, mut exact) = (0.0f64, 0.0f64);
                for i in 0..k {
                    on_grid += qa[r * k + i] * qb[i * n + col];
                    exact += a[r * k + i] as f64 * b[i * n + col] as f64;
                }
                let got = c[r * n + col] as f64 - 1.0;
                worst_grid = worst_grid.max((got - on_grid * unscale).abs() / (1.0 + exact.abs()));
                err += (got - exact).powi(2);
                norm += exact.powi(2);
            }
        }
        assert!(
            worst_grid < 1e-5,
            "against the grid values' product: {worst_grid:e}"
        );
        let rel = (err / norm).sqrt();
        assert!(
            rel > 1e-3 && rel < 0.08,
            "against the exact product: relative L2 {rel:e}"
        );
    }

    #[test]
    fn casting_in_place_rounds_the_scaled_values() {
        let mut v = vec![0.5f32, -3.0, 2.0, 0.001];
        let operand = Fp8Operand {
            format: Fp8Format::E4M3,
            scale: 100.0,
        };
        cast_in_place(&mut v, operand);
        // ×100: 50 and 200 are ties that go to the even codes (48, 192); -300 is nearest -288
        // (E4M3's step is 32 there); 0.1 becomes 13 · 2⁻⁷.
        assert_eq!(v, [48.0, -288.0, 192.0, 0.1015625]);
    }
}
