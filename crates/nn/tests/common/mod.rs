//! Helpers shared by the nn integration tests: seeded test data and a tolerance check that
//! reports where and by how much two tensors differ.
#![allow(dead_code)] // each test crate uses a different subset

use meshtrain_tensor::rng::SplitMix64;

/// `n` standard-normal values times `scale`.
pub fn normal_vec(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * scale).collect()
}

/// Normal values pushed away from zero (|v| ≥ `margin`), so a ReLU kink is never within a
/// finite-difference step of any element.
pub fn away_from_zero(rng: &mut SplitMix64, n: usize, margin: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v = rng.normal();
            v.signum() * (margin + v.abs())
        })
        .collect()
}

/// A random permutation of `n` values spaced `gap` apart and centred on zero: no two elements
/// are within `gap` of each other, so max pooling has no ties and a finite-difference step
/// smaller than `gap / 2` never changes which element wins a window.
pub fn distinct_values(rng: &mut SplitMix64, n: usize, gap: f32) -> Vec<f32> {
    let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * gap).collect();
    rng.shuffle(&mut v);
    v
}

/// Euclidean norm in f64.
pub fn norm(v: &[f32]) -> f64 {
    v.iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt()
}

/// Asserts `‖got − want‖₂ ≤ rtol·‖want‖₂ + atol·√n` (norm-wise, so small entries of a large
/// tensor are judged on the tensor's scale) and, per element, `|got − want| ≤
/// 10·(rtol·max|want| + atol)` (so one badly wrong element cannot hide in the norm).
/// Panics with the worst element on failure; returns the norm-wise relative error.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], rtol: f64, atol: f64) -> f64 {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: length {} vs reference {}",
        got.len(),
        want.len()
    );
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what}: non-finite values"
    );
    let diff: Vec<f32> = got.iter().zip(want).map(|(a, b)| a - b).collect();
    let (dn, wn) = (norm(&diff), norm(want));
    let max_want = want.iter().fold(0.0f64, |m, &v| m.max(v.abs() as f64));
    let (worst, worst_d) = diff
        .iter()
        .enumerate()
        .fold((0, 0.0f64), |(wi, wd), (i, &d)| {
            if (d.abs() as f64) > wd {
                (i, d.abs() as f64)
            } else {
                (wi, wd)
            }
        });
    let bound = rtol * wn + atol * (got.len() as f64).sqrt();
    let elem_bound = 10.0 * (rtol * max_want + atol);
    assert!(
        dn <= bound && worst_d <= elem_bound,
        "{what}: ‖diff‖ {dn:.3e} (bound {bound:.3e}, ‖ref‖ {wn:.3e}); worst element {worst}: \
         {} vs reference {} (bound {elem_bound:.3e})",
        got[worst],
        want[worst]
    );
    println!(
        "{what}: norm-wise relative error {:.2e}",
        dn / wn.max(1e-30)
    );
    if wn > 0.0 {
        dn / wn
    } else {
        dn
    }
}
