//! Element-wise activations and the vectorisable `exp`/`erf` they are built on.
//!
//! `f32::exp` is a libm call that LLVM cannot vectorise; GELU over a GPT's MLP activations
//! calls it millions of times a step. [`fast_exp`] is a branch-free Cephes-style polynomial
//! (relative error ~1e-7) that compiles to SIMD inside the loops below.

use crate::par;

/// `a·b + c`, fused where the target has FMA (one instruction, one rounding). Rust never
/// contracts `a * b + c` on its own, and without the FMA feature `mul_add` would be a libm
/// call, so the choice is made at compile time. Halves the instruction count of the
/// polynomials below, which made GELU compute-bound at ~5 cycles per element.
#[inline(always)]
pub fn madd(a: f32, b: f32, c: f32) -> f32 {
    if cfg!(target_feature = "fma") {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// exp(x) with ~1e-7 relative error, vectorisable. Inputs are clamped to the f32 range.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2²³: adding it to |v| < 2²² rounds v to the nearest integer and leaves that integer
    // in the low mantissa bits. This replaces `round()` + `as i32`, whose saturating NaN-safe
    // conversion LLVM lowers to a scalar `cvttss2si` + `cmov` per lane and so unvectorised
    // half of every GELU loop. A NaN input stays NaN through `r` below.
    const ROUND_SHIFT: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = madd(x, LOG2E, ROUND_SHIFT);
    let n = shifted - ROUND_SHIFT;
    let n_int = shifted.to_bits().wrapping_sub(ROUND_SHIFT.to_bits()) as i32;
    let r = madd(-n, LN2_LO, madd(-n, LN2_HI, x));
    let p = 1.987_569_2e-4_f32;
    let p = madd(p, r, 1.398_2e-3);
    let p = madd(p, r, 8.333_452e-3);
    let p = madd(p, r, 4.166_579_6e-2);
    let p = madd(p, r, 1.666_666_5e-1);
    let p = madd(p, r, 0.5);
    let p = madd(p * r, r, r + 1.0);
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    p * scale
}

/// Sum with eight independent partial sums: vectorisable, unlike one running sum (which
/// also keeps a loop that fills the values, such as a softmax's `fast_exp`, scalar).
pub fn lane_sum(v: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = v.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..8 {
            lanes[i] += c[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `Σ f(aᵢ, bᵢ)` with eight independent partial sums, like [`lane_sum`]: the reductions of
/// layer norm (variance, the backward's two row sums) vectorise only in this form.
#[inline(always)]
pub fn lane_sum_zip(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut lanes = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| f(x, y))
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            lanes[i] += f(x[i], y[i]);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// erf(x) by Abramowitz & Stegun 7.1.26 (absolute error < 1e-6 in f32), vectorisable.
#[inline(always)]
pub fn fast_erf(x: f32) -> f32 {
    erf_and_gaussian(x).0
}

/// `(erf(x), exp(-x²))`: the formula evaluates `exp(-x²)` anyway, and GELU's derivative needs
/// exactly that Gaussian too, so it pays for one `exp` per element instead of two.
#[inline(always)]
fn erf_and_gaussian(x: f32) -> (f32, f32) {
    let a = x.abs();
    let t = 1.0 / madd(0.327_591_1, a, 1.0);
    let poly = madd(t, 1.061_405_4, -1.453_152_1);
    let poly = madd(poly, t, 1.421_413_7);
    let poly = madd(poly, t, -0.284_496_74);
    let poly = madd(poly, t, 0.254_829_6) * t;
    let gaussian = fast_exp(-a * a);
    let y = madd(-poly, gaussian, 1.0);
    (y.copysign(x), gaussian)
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + fast_exp(-x))
}

/// tanh(x) with ~1e-7 relative error everywhere, vectorisable (both branches are computed and
/// one is selected). `2·sigmoid(2x) − 1` would cancel near zero (relative error ~1e-3 at
/// |x| = 1e-4, ~1e-1 at 1e-6); below |x| = 0.625 an odd polynomial (Cephes `tanhf`) keeps
/// full relative precision, above it `1 − 2/(e^{2|x|} + 1)` has nothing left to cancel.
#[inline(always)]
pub fn fast_tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let p = madd(-5.704_988_7e-3, z, 2.063_909e-2);
    let p = madd(p, z, -5.373_971_6e-2);
    let p = madd(p, z, 1.333_144_2e-1);
    let p = madd(p, z, -3.333_328e-1);
    let small = madd(p * z, x, x);
    let large = (1.0 - 2.0 / (fast_exp(2.0 * a) + 1.0)).copysign(x);
    if a < 0.625 {
        small
    } else {
        large
    }
}

const INV_SQRT2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/sqrt(2π)
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// Exact (erf) GELU, PyTorch's default.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    let half_x = 0.5 * x;
    madd(half_x, fast_erf(x * INV_SQRT2), half_x)
}

#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    // exp(-(x/√2)²) = exp(-x²/2): the erf's Gaussian is the normal density's too.
    let (erf, gaussian) = erf_and_gaussian(x * INV_SQRT2);
    madd(x * INV_SQRT_2PI, gaussian, madd(0.5, erf, 0.5))
}

/// √(2/π), the tanh approximation's scale.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic term of the tanh approximation.
const GELU_CUBIC: f32 = 0.044_715;

/// GELU's tanh approximation, `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`: what the original
/// GPT-2 was trained with (`gelu_new` in Hugging Face, `approximate="tanh"` in PyTorch), so
/// that its downloaded weights compute the function they were trained for.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    let t = fast_tanh(SQRT_2_OVER_PI * madd(GELU_CUBIC * x, x * x, x));
    let half_x = 0.5 * x;
    madd(half_x, t, half_x)
}

#[inline(always)]
pub fn gelu_tanh_grad(x: f32) -> f32 {
    let t = fast_tanh(SQRT_2_OVER_PI * madd(GELU_CUBIC * x, x * x, x));
    let inner_grad = SQRT_2_OVER_PI * madd(3.0 * GELU_CUBIC, x * x, 1.0);
    madd(0.5, t, 0.5) + 0.5 * x * (1.0 - t * t) * inner_grad
}

/// The activations meshtrain's models use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Relu,
    Sigmoid,
    Tanh,
    /// Exact (erf) GELU.
    Gelu,
    /// GELU's tanh approximation ([`gelu_tanh`]).
    GeluTanh,
}

impl Activation {
    /// `y = act(x)`, parallel for large buffers.
    pub fn forward(self, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len());
        let chunk = par::chunk_len(y.len(), par::PARALLEL_MIN_LEN);
        par::for_each_chunk_mut(y, chunk, |i, yc| {
            self.forward_serial(&x[i * chunk..][..yc.len()], yc)
        });
    }

    /// [`Self::forward`] on the calling thread, for callers that already split the work (a
    /// layer fusing its bias and activation into one pass over each block of rows).
    pub fn forward_serial(self, x: &[f32], y: &mut [f32]) {
        // One monomorphised loop per activation (generic, not a function pointer, which
        // would cost an indirect call per element and block vectorisation).
        fn map(x: &[f32], y: &mut [f32], f: impl Fn(f32) -> f32) {
            y.iter_mut().zip(x).for_each(|(y, &x)| *y = f(x));
        }
        match self {
            Activation::Relu => map(x, y, |x| x.max(0.0)),
            Activation::Sigmoid => map(x, y, sigmoid),
            Activation::Tanh => map(x, y, fast_tanh),
            Activation::Gelu => map(x, y, gelu),
            Activation::GeluTanh => map(x, y, gelu_tanh),
        }
    }

    /// Whether the backward needs the output (`y`) rather than the input (`x`): lets the layer
    /// keep only one of them for backward. ReLU's derivative reads the input (`x > 0` ⇔
    /// `y > 0`), which the layer can keep by moving it instead of copying its output.
    pub fn backward_uses_output(self) -> bool {
        matches!(self, Activation::Sigmoid | Activation::Tanh)
    }

    /// `dx = dy · act'(·)` in place (`grad` holds dy on entry and dx on return), where
    /// `saved` is the output if [`Self::backward_uses_output`], else the input. In place
    /// because the incoming gradient is dead afterwards: no second buffer to allocate and fill.
    pub fn backward_in_place(self, saved: &[f32], grad: &mut [f32]) {
        assert_eq!(saved.len(), grad.len());
        let chunk = par::chunk_len(grad.len(), par::PARALLEL_MIN_LEN);
        par::for_each_chunk_mut(grad, chunk, |i, gc| {
            self.backward_in_place_serial(&saved[i * chunk..][..gc.len()], gc)
        });
    }

    /// [`Self::backward_in_place`] on the calling thread.
    pub fn backward_in_place_serial(self, saved: &[f32], grad: &mut [f32]) {
        fn update(saved: &[f32], grad: &mut [f32], f: impl Fn(f32, f32) -> f32) {
            grad.iter_mut().zip(saved).for_each(|(g, &s)| *g = f(s, *g));
        }
        match self {
            Activation::Relu => update(saved, grad, |x, g| if x > 0.0 { g } else { 0.0 }),
            Activation::Sigmoid => update(saved, grad, |y, g| g * y * (1.0 - y)),
            Activation::Tanh => update(saved, grad, |y, g| g * (1.0 - y * y)),
            Activation::Gelu => update(saved, grad, |x, g| g * gelu_grad(x)),
            Activation::GeluTanh => update(saved, grad, |x, g| g * gelu_tanh_grad(x)),
        }
    }
}

/// SwiGLU (Shazeer 2020), the gated MLP activation of Llama: each row of `x` is `[a | b]`
/// (gate, then up projection, `half` values each) and `y = silu(a) · b`, `silu(a) = a·σ(a)`.
pub fn swiglu_forward(x: &[f32], half: usize) -> Vec<f32> {
    let rows = x.len() / (2 * half);
    let mut y = par::take_buffer(rows * half);
    let chunk = par::chunk_len(y.len(), par::PARALLEL_MIN_LEN).div_ceil(half) * half;
    par::for_each_chunk_mut(&mut y, chunk, |c, yc| {
        let first = c * chunk / half;
        for (k, yr) in yc.chunks_mut(half).enumerate() {
            let (a, b) = x[(first + k) * 2 * half..][..2 * half].split_at(half);
            for i in 0..half {
                yr[i] = a[i] * sigmoid(a[i]) * b[i];
            }
        }
    });
    y
}

/// The gradient of [`swiglu_forward`]: `da = dy·b·σ(a)·(1 + a·(1 − σ(a)))`, `db = dy·silu(a)`.
pub fn swiglu_backward(x: &[f32], dy: &[f32], half: usize) -> Vec<f32> {
    let mut dx = par::take_buffer(x.len());
    let chunk = par::chunk_len(dx.len(), par::PARALLEL_MIN_LEN).div_ceil(2 * half) * 2 * half;
    par::for_each_chunk_mut(&mut dx, chunk, |c, dc| {
        let first = c * chunk / (2 * half);
        for (k, dr) in dc.chunks_mut(2 * half).enumerate() {
            let r = first + k;
            let (a, b) = x[r * 2 * half..][..2 * half].split_at(half);
            let g = &dy[r * half..][..half];
            let (da, db) = dr.split_at_mut(half);
            for i in 0..half {
                let s = sigmoid(a[i]);
                da[i] = g[i] * b[i] * s * (1.0 + a[i] * (1.0 - s));
                db[i] = g[i] * a[i] * s;
            }
        }
    });
    dx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_tanh_matches_its_formula_in_f64() {
        let mut x = -9.0f64;
        while x < 9.0 {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let t = (c * (x + 0.044715 * x * x * x)).tanh();
            let want = 0.5 * x * (1.0 + t);
            let dwant =
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
            let got = gelu_tanh(x as f32) as f64;
            let dgot = gelu_tanh_grad(x as f32) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                "gelu_tanh({x}): {got} vs {want}"
            );
            assert!(
                (dgot - dwant).abs() <= 1e-6 * dwant.abs().max(1.0),
                "grad({x}): {dgot} vs {dwant}"
            );
            x += 0.0173;
        }
    }

    #[test]
    fn fast_exp_and_erf_match_libm() {
        let mut x = -20.0f32;
        while x < 20.0 {
            let rel = (fast_exp(x) - x.exp()).abs() / x.exp();
            assert!(rel < 3e-7, "exp({x}): rel err {rel}");
            x += 0.0137;
        }
        // The clamp ends, where the exponent bits are built at their limits.
        for x in [-87.0f32, -86.6, 87.9, 88.0] {
            let rel = (fast_exp(x) - x.exp()).abs() / x.exp();
            assert!(rel < 3e-7, "exp({x}): rel err {rel}");
        }
        assert!(fast_exp(f32::NAN).is_nan(), "exp(NaN) must stay NaN");
        // erf reference via a high-precision series in f64.
        fn erf64(x: f64) -> f64 {
            let mut sum = 0.0;
            let mut term = x;
            let mut n = 0.0;
            while term.abs() > 1e-17 || n < 5.0 {
                sum += term / (2.0 * n + 1.0);
                n += 1.0;
                term *= -x * x / n;
                if n > 200.0 {
                    break;
                }
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        }
        let mut x = -4.0f32;
        while x < 4.0 {
            let err = (fast_erf(x) as f64 - erf64(x as f64)).abs();
            // A&S 7.1.26 is 1.5e-7 in exact arithmetic; f32 evaluation adds a few ulps.
            assert!(err < 1e-6, "erf({x}): err {err}");
            x += 0.031;
        }
    }

    /// The range: |x| from 1e-8 to 10, both signs, against f64 (PyTorch's f32 tanh
    /// is within ~1e-7 too). The old `2·sigmoid(2x) − 1` fails this at |x| < 1e-2.
    #[test]
    fn tanh_keeps_relative_precision_from_1e_minus_8_to_10() {
        let mut worst = (0.0f64, 0.0f32);
        let mut a = 1e-8f32;
        while a <= 10.0 {
            for x in [a, -a] {
                let want = (x as f64).tanh();
                let rel = ((fast_tanh(x) as f64 - want) / want).abs();
                if rel > worst.0 {
                    worst = (rel, x);
                }
            }
            a *= 1.003;
        }
        assert!(
            worst.0 < 3e-7,
            "tanh({}): relative error {:.2e}",
            worst.1,
            worst.0
        );
        assert_eq!(fast_tanh(0.0), 0.0);
        assert_eq!(fast_tanh(30.0), 1.0);
        assert_eq!(fast_tanh(-30.0), -1.0);
        assert!(fast_tanh(f32::NAN).is_nan());
    }

    #[test]
    fn lane_sum_matches_a_double_precision_sum() {
        for len in 0..40 {
            let v: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let want: f64 = v.iter().map(|&x| x as f64).sum();
            let got = lane_sum(&v) as f64;
            assert!((got - want).abs() < 1e-5, "len {len}: {got} vs {want}");
        }
    }

    #[test]
    fn activation_gradients_match_finite_differences() {
        let xs: Vec<f32> = (0..41).map(|i| -3.0 + 0.15 * i as f32 + 0.01).collect();
        for act in [
            Activation::Relu,
            Activation::Sigmoid,
            Activation::Tanh,
            Activation::Gelu,
        ] {
            let mut y = vec![0.0; xs.len()];
            act.forward(&xs, &mut y);
            let mut dx = vec![1.0; xs.len()];
            let saved = if act.backward_uses_output() { &y } else { &xs };
            act.backward_in_place(saved, &mut dx);
            for (i, &x) in xs.iter().enumerate() {
                let h = 1e-2f32;
                let (mut p, mut m) = ([0.0f32], [0.0f32]);
                act.forward(&[x + h], &mut p);
                act.forward(&[x - h], &mut m);
                let fd = (p[0] - m[0]) / (2.0 * h);
                assert!(
                    (fd - dx[i]).abs() < 2e-3,
                    "{act:?} at {x}: fd {fd} vs {}",
                    dx[i]
                );
            }
        }
    }
}
