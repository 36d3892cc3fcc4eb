//! Products small enough to live in L1/L2, computed in place without packing.
//!
//! Causal attention at GPT's default shape makes ~12,000 products per step of 32 rows, depth
//! 32–128 and 32–128 columns. The `gemm` crate packs both operands and dispatches per call,
//! which at these sizes costs as much as the arithmetic: measured in a training step they ran
//! at ~47 GFLOP/s against ~85 for the large products. Here the operands are read where they
//! lie (the right-hand side must have unit column stride; the left-hand side may have any
//! strides, since its elements are only ever broadcast), with a 6×16 register tile of FMA
//! accumulators kept for the whole depth, so each output element is loaded and stored once.
//!
//! Used only where the caller knows the operands are small; everything else goes through
//! [`crate::matmul::gemm`]. Falls back to [`gemm_serial`] on CPUs without AVX2/FMA, or when
//! the right-hand side has no unit column stride.

use crate::matmul::{gemm_serial, Mat, MatMut};

/// `c = a · b`, or `c += a · b` when `accumulate`, on the calling thread.
pub fn small_gemm(c: MatMut, a: Mat, b: Mat, accumulate: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if b.col_stride() == 1
            && c.col_stride() == 1
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            assert_eq!(a.cols(), b.rows(), "small_gemm: inner dimensions differ");
            assert_eq!(c.rows(), a.rows(), "small_gemm: output rows differ");
            assert_eq!(c.cols(), b.cols(), "small_gemm: output columns differ");
            // SAFETY: AVX2 and FMA are present (checked above); the views were bounds-checked
            // at construction and the shapes agree, so every index the kernel forms is inside
            // its view.
            unsafe { avx2::product(c, a, b, accumulate) };
            return;
        }
    }
    gemm_serial(c, a, b, accumulate)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::matmul::{Mat, MatMut};
    use std::arch::x86_64::*;

    /// Rows of the register tile: 6 rows × 2 vectors = 12 accumulators, plus 2 for the
    /// right-hand row and 1 for the broadcast, fits AVX2's 16 registers.
    const MR: usize = 6;

    /// # Safety
    /// AVX2 and FMA must be available; `c` and `b` must have unit column stride and the shapes
    /// must agree.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn product(c: MatMut, a: Mat, b: Mat, accumulate: bool) {
        let (m, n, k) = (c.rows(), c.cols(), a.cols());
        let (a_rs, a_cs) = (a.row_stride(), a.col_stride());
        let b_rs = b.row_stride();
        let c_rs = c.row_stride();
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        let cp = c.into_mut_ptr();
        let mut j = 0;
        // Column blocks of 16, then 8, then single columns.
        while j + 16 <= n {
            row_blocks::<2>(
                m,
                k,
                ap,
                a_rs,
                a_cs,
                bp.add(j),
                b_rs,
                cp.add(j),
                c_rs,
                accumulate,
            );
            j += 16;
        }
        if j + 8 <= n {
            row_blocks::<1>(
                m,
                k,
                ap,
                a_rs,
                a_cs,
                bp.add(j),
                b_rs,
                cp.add(j),
                c_rs,
                accumulate,
            );
            j += 8;
        }
        for jj in j..n {
            for i in 0..m {
                let mut s = 0.0f32;
                for p in 0..k {
                    s += *ap.add(i * a_rs + p * a_cs) * *bp.add(p * b_rs + jj);
                }
                let out = cp.add(i * c_rs + jj);
                *out = if accumulate { *out + s } else { s };
            }
        }
    }

    /// One column block (`NV` vectors of 8) over all rows, `MR` rows at a time.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn row_blocks<const NV: usize>(
        m: usize,
        k: usize,
        a: *const f32,
        a_rs: usize,
        a_cs: usize,
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
        accumulate: bool,
    ) {
        // A tile of `$rows` rows starting at row `i` (a macro because the height is a const
        // generic: one monomorphised tile per height).
        macro_rules! tile_at {
            ($rows:expr, $i:expr) => {
                tile::<{ $rows }, NV>(
                    k,
                    a.add($i * a_rs),
                    a_rs,
                    a_cs,
                    b,
                    b_rs,
                    c.add($i * c_rs),
                    c_rs,
                    accumulate,
                )
            };
        }
        let mut i = 0;
        while i + MR <= m {
            tile_at!(MR, i);
            i += MR;
        }
        // The last 1–5 rows: one tile of exactly that height.
        match m - i {
            0 => {}
            1 => tile_at!(1, i),
            2 => tile_at!(2, i),
            3 => tile_at!(3, i),
            4 => tile_at!(4, i),
            _ => tile_at!(5, i),
        }
    }

    /// `R × 8·NV` outputs, accumulated in registers over the whole depth.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn tile<const R: usize, const NV: usize>(
        k: usize,
        a: *const f32,
        a_rs: usize,
        a_cs: usize,
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); NV]; R];
        for p in 0..k {
            let brow = b.add(p * b_rs);
            let mut bv = [_mm256_setzero_ps(); NV];
            for (v, slot) in bv.iter_mut().enumerate() {
                *slot = _mm256_loadu_ps(brow.add(8 * v));
            }
            let acol = a.add(p * a_cs);
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*acol.add(r * a_rs));
                for v in 0..NV {
                    row[v] = _mm256_fmadd_ps(av, bv[v], row[v]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            let crow = c.add(r * c_rs);
            for (v, &sum) in row.iter().enumerate() {
                let out = crow.add(8 * v);
                let value = if accumulate {
                    _mm256_add_ps(_mm256_loadu_ps(out), sum)
                } else {
                    sum
                };
                _mm256_storeu_ps(out, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::gemm_reference;

    use crate::rng::normal_values as random;

    /// Every tile height (1–6 rows left over), both vector widths and the scalar column tail,
    /// a transposed (strided) left-hand side, a strided output, and accumulation.
    #[test]
    fn small_products_match_the_reference() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (7, 9, 5),
            (13, 24, 3),
            (32, 64, 64),
            (11, 37, 70),
            (6, 16, 1),
        ] {
            let a = random(m * k, 1);
            let b = random(k * n, 2);
            let want = gemm_reference(m, n, k, &a, &b);
            // a stored transposed (k × m), read through a transposed view.
            let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
            // The output inside a wider buffer (row stride n + 3).
            let mut c = vec![0.5f32; m * (n + 3)];
            small_gemm(
                MatMut::strided(&mut c, m, n, n + 3, 1),
                Mat::new(&at, k, m).t(),
                Mat::new(&b, k, n),
                false,
            );
            for i in 0..m {
                for j in 0..n {
                    let (got, want) = (c[i * (n + 3) + j], want[i * n + j]);
                    assert!(
                        (got - want).abs() < 1e-4 * k as f32,
                        "{m}x{n}x{k} ({i},{j}): {got} vs {want}"
                    );
                }
                // Padding columns are never touched.
                assert!(c[i * (n + 3) + n..][..3].iter().all(|&v| v == 0.5));
            }
            small_gemm(
                MatMut::strided(&mut c, m, n, n + 3, 1),
                Mat::new(&a, m, k),
                Mat::new(&b, k, n),
                true,
            );
            for i in 0..m {
                for j in 0..n {
                    let (got, want) = (c[i * (n + 3) + j], 2.0 * want[i * n + j]);
                    assert!(
                        (got - want).abs() < 2e-4 * k as f32,
                        "accumulate {m}x{n}x{k}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// A right-hand side without unit column stride takes the `gemm` path and still agrees.
    #[test]
    fn transposed_right_hand_sides_fall_back() {
        let (m, n, k) = (5, 12, 9);
        let a = random(m * k, 3);
        let b = random(k * n, 4);
        let bt: Vec<f32> = (0..n * k).map(|idx| b[(idx % k) * n + idx / k]).collect();
        let mut c = vec![0.0f32; m * n];
        small_gemm(
            MatMut::new(&mut c, m, n),
            Mat::new(&a, m, k),
            Mat::new(&bt, n, k).t(),
            false,
        );
        for (got, want) in c.iter().zip(gemm_reference(m, n, k, &a, &b)) {
            assert!((got - want).abs() < 1e-3, "{got} vs {want}");
        }
    }
}
