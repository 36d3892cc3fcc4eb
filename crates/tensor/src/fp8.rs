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
//! chosen so its largest magnitude (`amax`) lands near the format's largest value, and the
//! product is multiplied back by `1 / (scale_a · scale_b)` in f32 (cuBLASLt's `A_SCALE`/
//! `B_SCALE` pointers take these inverses). **Delayed scaling** ([`DelayedScaling`]) takes the
//! scale from the maxima of earlier steps, so the cast needs no extra pass over the tensor:
//! it records this step's amax while it converts.
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
        self.decode(self.max_code())
    }

    /// The smallest normal value: 2⁻⁶ (E4M3) or 2⁻¹⁴ (E5M2).
    pub fn min_normal(self) -> f32 {
        (2.0f32).powi(1 - self.bias())
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
        let unit = (2.0f32).powi(-(m_bits as i32));
        if exponent == 0 {
            // Subnormal: mantissa · 2^(1 - bias - m_bits).
            sign * mantissa * unit * self.min_normal()
        } else {
            sign * (1.0 + mantissa * unit) * (2.0f32).powi(exponent - self.bias())
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
            let unit = self.min_normal() * (2.0f32).powi(-(m_bits as i32));
            (f32::from_bits(magnitude) / unit).round_ties_even() as u32
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

    /// `x` rounded to this format's grid (what a product reads after the cast).
    pub fn round(self, x: f32) -> f32 {
        self.decode(self.encode(x))
    }
}

impl std::fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The largest magnitude in `values` (0 for none; NaN if one is NaN, so that a step whose
/// tensors hold a NaN cannot set a scale: [`DelayedScaling::update`] skips it).
pub fn amax(values: &[f32]) -> f32 {
    values.iter().fold(0.0f32, |m, v| {
        let a = v.abs();
        if a.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(a)
        }
    })
}

/// Per-tensor delayed scaling (Transformer Engine's `DelayedScaling` recipe, "max" over the
/// history): the scale a tensor is multiplied by before its cast comes from the largest
/// amax of the last `history` steps, not from the tensor being cast, so the cast itself
/// records the amax it will be scaled by later and needs no pass of its own.
///
/// `scale = format.max() / amax / 2^margin`; a history whose largest amax is 0, infinite or
/// NaN leaves the scale as it was (it starts at 1). Plain data: [`DelayedScaling::to_values`]
/// gives the state as floats, so a layer can keep it among its buffers and checkpoints
/// carry it.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayedScaling {
    pub format: Fp8Format,
    /// Powers of two of headroom below the format's largest value.
    pub margin: i32,
    /// The scale in use: multiplied into the tensor before the cast.
    pub scale: f32,
    /// The last steps' amaxes, the newest at `next - 1` (a ring).
    history: Vec<f32>,
    next: usize,
}

impl DelayedScaling {
    /// A fresh state: scale 1, a history of `length` zeros.
    pub fn new(format: Fp8Format, length: usize, margin: i32) -> Result<Self, String> {
        if length == 0 {
            return Err("an amax history needs at least one step".into());
        }
        if !(0..=32).contains(&margin) {
            return Err(format!(
                "fp8 scaling margin {margin}: want 0 to 32 powers of two"
            ));
        }
        Ok(DelayedScaling {
            format,
            margin,
            scale: 1.0,
            history: vec![0.0; length],
            next: 0,
        })
    }

    /// Records one step's amax (the newest replaces the oldest).
    pub fn record(&mut self, amax: f32) {
        self.history[self.next] = amax;
        self.next = (self.next + 1) % self.history.len();
    }

    /// The largest amax in the history (NaN if one is NaN).
    pub fn history_amax(&self) -> f32 {
        amax(&self.history)
    }

    /// Sets the scale from the history, as Transformer Engine does after each step; a
    /// history amax of 0 (nothing seen yet), infinity or NaN keeps the old scale.
    pub fn update(&mut self) {
        let amax = self.history_amax();
        if amax.is_finite() && amax > 0.0 {
            let scale = self.format.max() / amax / (2.0f32).powi(self.margin);
            if scale.is_finite() && scale > 0.0 {
                self.scale = scale;
            }
        }
    }

    /// The state as floats: the scale, the ring's next slot, then the history in ring order.
    pub fn to_values(&self) -> Vec<f32> {
        let mut v = vec![self.scale, self.next as f32];
        v.extend_from_slice(&self.history);
        v
    }

    /// The state [`DelayedScaling::to_values`] wrote, for a history of `values.len() - 2`.
    pub fn from_values(format: Fp8Format, margin: i32, values: &[f32]) -> Result<Self, String> {
        let mut state = DelayedScaling::new(format, values.len().saturating_sub(2), margin)?;
        let (scale, next) = (values[0], values[1]);
        let ok_next = next >= 0.0 && next.fract() == 0.0 && (next as usize) < state.history.len();
        if !(scale.is_finite() && scale > 0.0 && ok_next) {
            return Err(format!(
                "an fp8 scaling state with scale {scale} and ring slot {next} (history of {})",
                state.history.len()
            ));
        }
        state.scale = scale;
        state.next = next as usize;
        state.history.copy_from_slice(&values[2..]);
        Ok(state)
    }
}

/// How one operand of an FP8 product is cast: its format and the scale multiplied in first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Operand {
    pub format: Fp8Format,
    pub scale: f32,
}

/// `values` multiplied by `scale` and rounded to `format`'s grid, in place; returns the amax
/// of the values before scaling (what delayed scaling records).
pub fn cast_in_place(values: &mut [f32], operand: Fp8Operand) -> f32 {
    const CHUNK: usize = 1 << 14;
    let maxima: Vec<f32> = values
        .par_chunks_mut(CHUNK)
        .map(|chunk| {
            let m = amax(chunk);
            for v in chunk.iter_mut() {
                *v = operand.format.round(*v * operand.scale);
            }
            m
        })
        .collect();
    amax(&maxima)
}

/// The matrix behind `m`, row-major, cast to `operand`'s grid (scaled); and its amax.
fn cast_matrix(m: &Mat, operand: Fp8Operand) -> (Vec<f32>, f32) {
    let (rows, cols) = (m.rows(), m.cols());
    let mut dense = par::take_buffer(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            dense[r * cols + c] = m.at(r, c);
        }
    }
    let amax = cast_in_place(&mut dense, operand);
    (dense, amax)
}

/// The amaxes of an FP8 product's operands, before scaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Maxima {
    pub a: f32,
    pub b: f32,
}

/// `c = a·b / (scale_a · scale_b)` (`+= c` when `accumulate`) with both operands cast to FP8
/// after scaling: the CPU twin of cuBLASLt's FP8 product with f32 accumulation. Returns the
/// operands' amaxes, which delayed scaling records.
pub fn gemm_fp8(
    c: MatMut,
    a: Mat,
    a_cast: Fp8Operand,
    b: Mat,
    b_cast: Fp8Operand,
    accumulate: bool,
) -> Fp8Maxima {
    let (m, k, n) = (a.rows(), a.cols(), b.cols());
    assert_eq!(
        k,
        b.rows(),
        "fp8 product: a is {m}x{k}, b is {}x{n}",
        b.rows()
    );
    let (qa, amax_a) = cast_matrix(&a, a_cast);
    let (qb, amax_b) = cast_matrix(&b, b_cast);
    let mut product = par::take_buffer(m * n);
    // Exact bf16 inputs: the bf16 kernel rounds nothing, accumulates in f32.
    gemm_lowp(
        DType::BF16,
        MatMut::new(&mut product, m, n),
        Mat::new(&qa, m, k),
        Mat::new(&qb, k, n),
        false,
        par::threads(),
    );
    let unscale = 1.0 / (a_cast.scale * b_cast.scale);
    let (rs, cs) = (c.row_stride(), c.col_stride());
    let out = c.into_mut_ptr();
    for r in 0..m {
        for col in 0..n {
            let v = product[r * n + col] * unscale;
            // SAFETY: (r, col) lies inside the view `c`, whose bounds MatMut checked.
            unsafe {
                let p = out.add(r * rs + col * cs);
                *p = if accumulate { *p + v } else { v };
            }
        }
    }
    par::recycle(product);
    par::recycle(qa);
    par::recycle(qb);
    Fp8Maxima {
        a: amax_a,
        b: amax_b,
    }
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
    fn delayed_scaling_follows_the_history_maximum() {
        let mut s = DelayedScaling::new(Fp8Format::E4M3, 3, 1).unwrap();
        s.update();
        assert_eq!(s.scale, 1.0, "nothing recorded yet: the scale stays");
        s.record(2.0);
        s.update();
        assert_eq!(s.scale, 448.0 / 2.0 / 2.0);
        s.record(8.0);
        s.record(1.0);
        s.update();
        assert_eq!(s.scale, 448.0 / 8.0 / 2.0);
        s.record(1.0); // 2.0 leaves the ring
        s.record(1.0); // then 8.0
        s.update();
        assert_eq!(s.scale, 448.0 / 1.0 / 2.0);
        let values = s.to_values();
        assert_eq!(
            DelayedScaling::from_values(Fp8Format::E4M3, 1, &values).unwrap(),
            s
        );
        let before = s.scale;
        s.record(f32::NAN);
        s.update();
        assert_eq!(s.scale, before, "a NaN amax keeps the scale");
        assert!(DelayedScaling::from_values(Fp8Format::E4M3, 1, &[0.0, 0.0, 1.0]).is_err());
        assert!(DelayedScaling::new(Fp8Format::E5M2, 0, 0).is_err());
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
        let a_cast = Fp8Operand {
            format: Fp8Format::E4M3,
            scale: 448.0 / amax(&a),
        };
        let b_cast = Fp8Operand {
            format: Fp8Format::E5M2,
            scale: 57344.0 / amax(&b) / 4.0,
        };
        let mut c = vec![1.0f32; m * n];
        let maxima = gemm_fp8(
            MatMut::new(&mut c, m, n),
            Mat::new(&a, m, k),
            a_cast,
            Mat::new(&b, k, n),
            b_cast,
            true,
        );
        assert_eq!(
            maxima,
            Fp8Maxima {
                a: amax(&a),
                b: amax(&b)
            }
        );
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
    fn casting_in_place_returns_the_unscaled_amax() {
        let mut v = vec![0.5f32, -3.0, 2.0, 0.001];
        let operand = Fp8Operand {
            format: Fp8Format::E4M3,
            scale: 100.0,
        };
        assert_eq!(cast_in_place(&mut v, operand), 3.0);
        // ×100: 50 and 200 are ties that go to the even codes (48, 192); -300 is nearest -288
        // (E4M3's step is 32 there); 0.1 becomes 13 · 2⁻⁷.
        assert_eq!(v, [48.0, -288.0, 192.0, 0.1015625]);
    }
}
