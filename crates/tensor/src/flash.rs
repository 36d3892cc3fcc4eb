//! Memory-efficient causal attention (FlashAttention's algorithm, Dao et al. 2022, on the CPU):
//! the `T × T` score matrix is never held. Forward walks each block of [`TILE`] queries over
//! the key blocks up to the diagonal with an *online softmax* (a running row maximum `m` and
//! sum `l`; the partial output is rescaled by `exp(m_old − m_new)` whenever the maximum
//! grows) and keeps only the output and each row's log-sum-exp `m + ln l`. Backward recomputes
//! each score tile from `Q`, `K` and the log-sum-exp (`P = exp(S·scale − lse)`), with
//! `D_i = Σ dO_i ⊙ O_i` standing in for the row sums of `dP ⊙ P`. Tiles above the diagonal are
//! skipped in both.
//!
//! Memory per sample: the output, `H·T` log-sum-exps and a few `TILE × TILE` tiles, instead of
//! `H·T²` probabilities ([`crate::attention`] keeps those). Same layout as there: `qkv` is
//! `[B, T, 3·D]`, each head a contiguous `D/H` slice; products in f32 through
//! [`small_gemm`].
//!
//! A GPT runs it with `model.attention = "flash"`; it becomes the default once it is at least
//! as fast as [`crate::attention`] at the sequence lengths we train, in every precision
//! (issue 18).

use crate::activation::fast_exp;
use crate::attention::{transposed_head, AttentionShape};
use crate::matmul::{Mat, MatMut};
use crate::small_gemm::small_gemm;

/// Query and key rows per tile.
pub const TILE: usize = 32;

/// `(start, end)` of the tiles of `t` rows.
fn tiles(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(TILE)).map(move |i| (i * TILE, ((i + 1) * TILE).min(t)))
}

/// Forward; returns (out `[B, T, D]`, log-sum-exp `[B, H, T]` of each row's scaled scores).
pub fn flash_attention_forward(s: AttentionShape, qkv: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (t, d, h) = (s.seq, s.dim, s.heads);
    let hd = d / h;
    assert_eq!(qkv.len(), s.batch * t * 3 * d);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; s.batch * t * d];
    let mut lse = vec![0.0f32; s.batch * h * t];
    let sample = |b: usize, ob: &mut [f32], lb: &mut [f32]| {
        let q = &qkv[b * t * 3 * d..][..t * 3 * d];
        crate::par::with_scratch(hd * t + TILE * TILE + 2 * TILE, |scratch| {
            let (kt, rest) = scratch.split_at_mut(hd * t);
            let (tile, stats) = rest.split_at_mut(TILE * TILE);
            let (m, l) = stats.split_at_mut(TILE);
            for head in 0..h {
                let qh = Mat::strided(&q[head * hd..], t, hd, 3 * d, 1);
                let vh = Mat::strided(&q[2 * d + head * hd..], t, hd, 3 * d, 1);
                let kt = transposed_head(q, 3 * d, d + head * hd, t, hd, kt);
                for (r0, r1) in tiles(t) {
                    let rows = r1 - r0;
                    m[..rows].fill(f32::NEG_INFINITY);
                    l[..rows].fill(0.0);
                    for (c0, c1) in tiles(t).take_while(|&(c0, _)| c0 < r1) {
                        let cols = c1 - c0;
                        let st = MatMut::strided(tile, rows, cols, TILE, 1);
                        small_gemm(st, qh.rows_range(r0, r1), kt.cols_range(c0, c1), false);
                        for i in 0..rows {
                            // Keys after the query are masked (the diagonal tile only).
                            let valid = (r0 + i + 1).saturating_sub(c0).min(cols);
                            let row = &mut tile[i * TILE..][..cols];
                            let tile_max = row[..valid]
                                .iter()
                                .fold(f32::NEG_INFINITY, |a, &v| a.max(v * scale));
                            let new_max = m[i].max(tile_max);
                            let correction = fast_exp(m[i] - new_max);
                            let mut sum = 0.0;
                            for v in &mut row[..valid] {
                                *v = fast_exp(*v * scale - new_max);
                                sum += *v;
                            }
                            row[valid..].fill(0.0);
                            l[i] = l[i] * correction + sum;
                            m[i] = new_max;
                            if correction != 1.0 {
                                ob[(r0 + i) * d + head * hd..][..hd]
                                    .iter_mut()
                                    .for_each(|o| *o *= correction);
                            }
                        }
                        let p = Mat::strided(tile, rows, cols, TILE, 1);
                        let acc = MatMut::strided(&mut ob[r0 * d + head * hd..], rows, hd, d, 1);
                        small_gemm(acc, p, vh.rows_range(c0, c1), true);
                    }
                    for i in 0..rows {
                        let inv = 1.0 / l[i];
                        ob[(r0 + i) * d + head * hd..][..hd]
                            .iter_mut()
                            .for_each(|o| *o *= inv);
                        lb[head * t + r0 + i] = m[i] + l[i].ln();
                    }
                }
            }
        });
    };
    crate::par::for_each_chunk_pair_mut(&mut out, t * d, &mut lse, h * t, sample);
    (out, lse)
}

/// Backward; returns dqkv `[B, T, 3·D]` from the forward's output and log-sum-exp.
pub fn flash_attention_backward(
    s: AttentionShape,
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
) -> Vec<f32> {
    let (t, d, h) = (s.seq, s.dim, s.heads);
    let hd = d / h;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut dqkv = vec![0.0f32; qkv.len()];
    let sample = |b: usize, dq: &mut [f32]| {
        let q = &qkv[b * t * 3 * d..][..t * 3 * d];
        let ob = &out[b * t * d..][..t * d];
        let dob = &dout[b * t * d..][..t * d];
        crate::par::with_scratch(2 * hd * t + 2 * TILE * TILE + t, |scratch| {
            let (kt, rest) = scratch.split_at_mut(hd * t);
            let (vt, rest) = rest.split_at_mut(hd * t);
            let (ptile, rest) = rest.split_at_mut(TILE * TILE);
            let (dptile, delta) = rest.split_at_mut(TILE * TILE);
            for head in 0..h {
                let l = &lse[(b * h + head) * t..][..t];
                let qh = Mat::strided(&q[head * hd..], t, hd, 3 * d, 1);
                let kh = Mat::strided(&q[d + head * hd..], t, hd, 3 * d, 1);
                let doh = Mat::strided(&dob[head * hd..], t, hd, d, 1);
                let kt = transposed_head(q, 3 * d, d + head * hd, t, hd, kt);
                let vt = transposed_head(q, 3 * d, 2 * d + head * hd, t, hd, vt);
                // D_i = Σ_c dO_ic · O_ic: the row sums of dP ⊙ P, without P.
                for (i, di) in delta.iter_mut().enumerate() {
                    let o = &ob[i * d + head * hd..][..hd];
                    let g = &dob[i * d + head * hd..][..hd];
                    *di = o.iter().zip(g).map(|(a, b)| a * b).sum();
                }
                for (r0, r1) in tiles(t) {
                    let rows = r1 - r0;
                    for (c0, c1) in tiles(t).take_while(|&(c0, _)| c0 < r1) {
                        let cols = c1 - c0;
                        // P = exp(Q·Kᵀ·scale − lse), masked above the diagonal.
                        let st = MatMut::strided(ptile, rows, cols, TILE, 1);
                        small_gemm(st, qh.rows_range(r0, r1), kt.cols_range(c0, c1), false);
                        let dpt = MatMut::strided(dptile, rows, cols, TILE, 1);
                        small_gemm(dpt, doh.rows_range(r0, r1), vt.cols_range(c0, c1), false);
                        for i in 0..rows {
                            let valid = (r0 + i + 1).saturating_sub(c0).min(cols);
                            let (pr, dr) = (
                                &mut ptile[i * TILE..][..cols],
                                &mut dptile[i * TILE..][..cols],
                            );
                            let (li, di) = (l[r0 + i], delta[r0 + i]);
                            for j in 0..valid {
                                pr[j] = fast_exp(pr[j] * scale - li);
                                // dS = P ⊙ (dP − D) · scale
                                dr[j] = pr[j] * (dr[j] - di) * scale;
                            }
                            pr[valid..].fill(0.0);
                            dr[valid..].fill(0.0);
                        }
                        let p = Mat::strided(ptile, rows, cols, TILE, 1);
                        let ds = Mat::strided(dptile, rows, cols, TILE, 1);
                        // dV[c] += Pᵀ · dO[r]
                        small_gemm(
                            MatMut::strided(
                                &mut dq[c0 * 3 * d + 2 * d + head * hd..],
                                cols,
                                hd,
                                3 * d,
                                1,
                            ),
                            p.t(),
                            doh.rows_range(r0, r1),
                            true,
                        );
                        // dQ[r] += dS · K[c]
                        small_gemm(
                            MatMut::strided(&mut dq[r0 * 3 * d + head * hd..], rows, hd, 3 * d, 1),
                            ds,
                            kh.rows_range(c0, c1),
                            true,
                        );
                        // dK[c] += dSᵀ · Q[r]
                        small_gemm(
                            MatMut::strided(
                                &mut dq[c0 * 3 * d + d + head * hd..],
                                cols,
                                hd,
                                3 * d,
                                1,
                            ),
                            ds.t(),
                            qh.rows_range(r0, r1),
                            true,
                        );
                    }
                }
            }
        });
    };
    crate::par::for_each_chunk_mut(&mut dqkv, t * 3 * d, sample);
    dqkv
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{causal_attention_backward, causal_attention_forward};
    use crate::rng::normal_values as random;
    use crate::DType;

    /// Causal attention in f64, straight from the definition.
    fn reference(s: AttentionShape, qkv: &[f32], dout: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let (t, d, h) = (s.seq, s.dim, s.heads);
        let hd = d / h;
        let scale = 1.0 / (hd as f64).sqrt();
        let x = |b: usize, i: usize, c: usize| qkv[(b * t + i) * 3 * d + c] as f64;
        let mut out = vec![0.0; s.batch * t * d];
        let mut dqkv = vec![0.0; qkv.len()];
        for b in 0..s.batch {
            for head in 0..h {
                let (qo, ko, vo) = (head * hd, d + head * hd, 2 * d + head * hd);
                for i in 0..t {
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            (0..hd)
                                .map(|c| x(b, i, qo + c) * x(b, j, ko + c))
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|v| (v - max).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let p: Vec<f64> = e.iter().map(|v| v / z).collect();
                    let go = |c: usize| dout[(b * t + i) * d + head * hd + c] as f64;
                    for c in 0..hd {
                        out[(b * t + i) * d + head * hd + c] =
                            (0..=i).map(|j| p[j] * x(b, j, vo + c)).sum();
                    }
                    // dP_j = dO_i · V_j; dS_j = P_j (dP_j − Σ P dP) · scale
                    let dp: Vec<f64> = (0..=i)
                        .map(|j| (0..hd).map(|c| go(c) * x(b, j, vo + c)).sum())
                        .collect();
                    let dot: f64 = (0..=i).map(|j| p[j] * dp[j]).sum();
                    for j in 0..=i {
                        let ds = p[j] * (dp[j] - dot) * scale;
                        for c in 0..hd {
                            dqkv[(b * t + i) * 3 * d + qo + c] += ds * x(b, j, ko + c);
                            dqkv[(b * t + j) * 3 * d + ko + c] += ds * x(b, i, qo + c);
                            dqkv[(b * t + j) * 3 * d + vo + c] += p[j] * go(c);
                        }
                    }
                }
            }
        }
        (out, dqkv)
    }

    fn max_err(a: &[f32], b: &[f64]) -> f64 {
        let scale = b.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
        a.iter()
            .zip(b)
            .map(|(x, y)| (*x as f64 - y).abs())
            .fold(0.0, f64::max)
            / scale
    }

    #[test]
    fn matches_the_f64_definition_at_odd_and_tile_crossing_lengths() {
        for &seq in &[1usize, 2, 31, 32, 33, 70, 129, 4096] {
            // The longest at one small head, so the f64 definition stays quick.
            let (batch, dim, heads) = if seq > 1000 { (1, 8, 1) } else { (2, 16, 2) };
            let s = AttentionShape {
                batch,
                seq,
                dim,
                heads,
            };
            let qkv = random(s.batch * seq * 3 * s.dim, seq as u64);
            let dout = random(s.batch * seq * s.dim, 11);
            let (out, lse) = flash_attention_forward(s, &qkv);
            let dqkv = flash_attention_backward(s, &qkv, &out, &lse, &dout);
            let (out_ref, d_ref) = reference(s, &qkv, &dout);
            let (eo, ed) = (max_err(&out, &out_ref), max_err(&dqkv, &d_ref));
            assert!(
                eo < 1e-5 && ed < 1e-5,
                "T={seq}: output {eo:.1e}, gradient {ed:.1e}"
            );
        }
    }

    #[test]
    fn matches_the_probability_keeping_kernel() {
        for &seq in &[64usize, 128, 200] {
            let s = AttentionShape {
                batch: 2,
                seq,
                dim: 64,
                heads: 4,
            };
            let qkv = random(s.batch * seq * 3 * s.dim, 3 + seq as u64);
            let dout = random(s.batch * seq * s.dim, 5);
            let (out, lse) = flash_attention_forward(s, &qkv);
            let (out_ref, probs) = causal_attention_forward(s, &qkv, DType::F32);
            let d = flash_attention_backward(s, &qkv, &out, &lse, &dout);
            let d_ref = causal_attention_backward(s, &qkv, &probs, &dout, DType::F32);
            let close = |a: &[f32], b: &[f32], what: &str| {
                let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() / scale < 1e-5, "{what} T={seq}: {x} vs {y}");
                }
            };
            close(&out, &out_ref, "output");
            close(&d, &d_ref, "dqkv");
        }
    }
}
