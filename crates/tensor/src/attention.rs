//! Causal multi-head self-attention straight from a fused QKV activation.
//!
//! `qkv` is `[B, T, 3·D]` (q, k, v side by side, each head a contiguous `D/H` slice). Strided
//! matrix views read each head in place; only the one head operand that a product needs
//! transposed (K in forward, V in backward, `T × D/H` each) is copied, into a per-thread
//! scratch. Work is spread over the batch (each sample's output rows are contiguous and owned
//! by one thread).
//!
//! The products run block-causally: rows are cut into blocks of [`CAUSAL_BLOCK`] queries, and
//! a query block only meets the keys up to its own last row. The fully masked blocks above the
//! diagonal of `Q·Kᵀ` (and of every backward product) are never computed, which saves ~40% of
//! the attention FLOPs at T = 128. The remaining products are small (32 rows, depth 32–128)
//! and go through [`small_gemm`], which reads the operands in place instead of packing them.

use crate::activation::{fast_exp, lane_sum, lane_sum_zip};
use crate::matmul::{Mat, MatMut};
use crate::small_gemm::small_gemm;
use crate::DType;

/// One of attention's small products with inputs in `precision`: f32 in place through
/// [`small_gemm`]; bf16/f16 through [`crate::lowp`] on this thread (AMX packs a 32-row block
/// in a few hundred cycles, so even these products gain).
pub(crate) fn product(precision: DType, c: MatMut, a: Mat, b: Mat, accumulate: bool) {
    match precision {
        DType::F32 => small_gemm(c, a, b, accumulate),
        _ => crate::lowp::gemm_lowp(precision, c, a, b, accumulate, 1),
    }
}

/// Query rows per block of the block-causal products.
const CAUSAL_BLOCK: usize = 32;

#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub batch: usize,
    pub seq: usize,
    pub dim: usize,
    pub heads: usize,
}

impl AttentionShape {
    fn head_dim(&self) -> usize {
        self.dim / self.heads
    }
}

/// The row blocks `[start, end)` of a causal `t × t` product.
fn causal_blocks(t: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(block)).map(move |i| (i * block, ((i + 1) * block).min(t)))
}

/// Forward; returns (out `[B, T, D]`, probabilities `[B, H, T, T]` kept for backward). The
/// products take their inputs in `precision`; the softmax is f32 whatever it is.
pub fn causal_attention_forward(
    s: AttentionShape,
    qkv: &[f32],
    precision: DType,
) -> (Vec<f32>, Vec<f32>) {
    forward_blocked(s, qkv, CAUSAL_BLOCK, precision)
}

fn forward_blocked(
    s: AttentionShape,
    qkv: &[f32],
    block: usize,
    precision: DType,
) -> (Vec<f32>, Vec<f32>) {
    let (t, d, hd) = (s.seq, s.dim, s.head_dim());
    assert_eq!(qkv.len(), s.batch * t * 3 * d);
    let scale = 1.0 / (hd as f32).sqrt();
    // Both are written in full below: every output row by a product, every probability row
    // by the softmax (its masked tail explicitly zeroed).
    let mut out = crate::par::take_buffer(s.batch * t * d);
    let mut probs = crate::par::take_buffer(s.batch * s.heads * t * t);
    let sample = |b: usize, ob: &mut [f32], pb: &mut [f32]| {
        let q = &qkv[b * t * 3 * d..][..t * 3 * d];
        crate::par::with_scratch(hd * t, |kt| {
            for h in 0..s.heads {
                let p = &mut pb[h * t * t..][..t * t];
                let qh = Mat::strided(&q[h * hd..], t, hd, 3 * d, 1);
                let kt = transposed_head(q, 3 * d, d + h * hd, t, hd, kt);
                let vh = Mat::strided(&q[2 * d + h * hd..], t, hd, 3 * d, 1);
                for (r0, r1) in causal_blocks(t, block) {
                    // Scores of query rows r0..r1 against keys 0..r1.
                    product(
                        precision,
                        MatMut::strided(&mut p[r0 * t..], r1 - r0, r1, t, 1),
                        qh.rows_range(r0, r1),
                        kt.cols_range(0, r1),
                        false,
                    );
                    for i in r0..r1 {
                        let row = &mut p[i * t..][..t];
                        let valid = &mut row[..=i];
                        let max = valid.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                        // Exponentiate first, sum after: a running sum inside the loop would
                        // serialise it and keep `fast_exp` from vectorising.
                        valid
                            .iter_mut()
                            .for_each(|v| *v = fast_exp((*v - max) * scale));
                        let inv = 1.0 / lane_sum(valid);
                        valid.iter_mut().for_each(|v| *v *= inv);
                        row[i + 1..].fill(0.0);
                    }
                    product(
                        precision,
                        MatMut::strided(&mut ob[r0 * d + h * hd..], r1 - r0, hd, d, 1),
                        Mat::strided(&p[r0 * t..], r1 - r0, r1, t, 1),
                        vh.rows_range(0, r1),
                        false,
                    );
                }
            }
        });
    };
    crate::par::for_each_chunk_pair_mut(&mut out, t * d, &mut probs, s.heads * t * t, sample);
    (out, probs)
}

/// One head's `t × hd` block of a row-major activation with row stride `stride`, starting
/// at column `col`, copied transposed into `out` (`hd × t`, row-major): products against a
/// transposed head (`Q·Kᵀ`, `dO·Vᵀ`) then read unit-stride rows, which [`small_gemm`] needs.
pub(crate) fn transposed_head<'o>(
    x: &[f32],
    stride: usize,
    col: usize,
    t: usize,
    hd: usize,
    out: &'o mut [f32],
) -> Mat<'o> {
    // Eight rows at a time, so that each inner step writes eight consecutive outputs (one
    // per row) instead of scattering single values a whole output row apart.
    const ROWS: usize = 8;
    let row = |i: usize| &x[i * stride + col..][..hd];
    let mut i0 = 0;
    while i0 + ROWS <= t {
        let rows: [&[f32]; ROWS] = std::array::from_fn(|r| row(i0 + r));
        for j in 0..hd {
            let dst = &mut out[j * t + i0..][..ROWS];
            for r in 0..ROWS {
                dst[r] = rows[r][j];
            }
        }
        i0 += ROWS;
    }
    for i in i0..t {
        for (j, &v) in row(i).iter().enumerate() {
            out[j * t + i] = v;
        }
    }
    Mat::new(&out[..hd * t], hd, t)
}

/// Backward; returns dqkv `[B, T, 3·D]` (products in `precision`, as in forward).
pub fn causal_attention_backward(
    s: AttentionShape,
    qkv: &[f32],
    probs: &[f32],
    dout: &[f32],
    precision: DType,
) -> Vec<f32> {
    backward_blocked(s, qkv, probs, dout, CAUSAL_BLOCK, precision)
}

fn backward_blocked(
    s: AttentionShape,
    qkv: &[f32],
    probs: &[f32],
    dout: &[f32],
    block: usize,
    precision: DType,
) -> Vec<f32> {
    let (t, d, hd) = (s.seq, s.dim, s.head_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    // Every element is written: dQ, dK and dV of each head by a product over all its rows.
    let mut dqkv = crate::par::take_buffer(qkv.len());
    let sample = |b: usize, dq: &mut [f32]| {
        let q = &qkv[b * t * 3 * d..][..t * 3 * d];
        let dob = &dout[b * t * d..][..t * d];
        crate::par::with_scratch(t * t + hd * t, |scratch| {
            let (dp, vt) = scratch.split_at_mut(t * t);
            for h in 0..s.heads {
                let p = &probs[(b * s.heads + h) * t * t..][..t * t];
                let pm = Mat::new(p, t, t);
                let doh = Mat::strided(&dob[h * hd..], t, hd, d, 1);
                let qh = Mat::strided(&q[h * hd..], t, hd, 3 * d, 1);
                let kh = Mat::strided(&q[d + h * hd..], t, hd, 3 * d, 1);
                let vt = transposed_head(q, 3 * d, 2 * d + h * hd, t, hd, vt);
                for (r0, r1) in causal_blocks(t, block) {
                    // dV[r0..r1] = P[r0.., r0..r1]ᵀ · dO[r0..]: later queries only.
                    product(
                        precision,
                        MatMut::strided(
                            &mut dq[r0 * 3 * d + 2 * d + h * hd..],
                            r1 - r0,
                            hd,
                            3 * d,
                            1,
                        ),
                        pm.rows_range(r0, t).cols_range(r0, r1).t(),
                        doh.rows_range(r0, t),
                        false,
                    );
                    // dP[r0..r1, ..r1] = dO[r0..r1] · V[..r1]ᵀ
                    product(
                        precision,
                        MatMut::strided(&mut dp[r0 * t..], r1 - r0, r1, t, 1),
                        doh.rows_range(r0, r1),
                        vt.cols_range(0, r1),
                        false,
                    );
                    // dS = P ⊙ (dP − rowsum(dP ⊙ P)) · scale, zero above the diagonal.
                    for i in r0..r1 {
                        let (pr, dr) = (&p[i * t..][..t], &mut dp[i * t..][..t]);
                        let dot = lane_sum_zip(&pr[..=i], &dr[..=i], |a, b| a * b);
                        for j in 0..=i {
                            dr[j] = pr[j] * (dr[j] - dot) * scale;
                        }
                        dr[i + 1..].fill(0.0);
                    }
                }
                let ds = Mat::new(dp, t, t);
                for (r0, r1) in causal_blocks(t, block) {
                    // dQ[r0..r1] = dS[r0..r1, ..r1] · K[..r1]
                    product(
                        precision,
                        MatMut::strided(&mut dq[r0 * 3 * d + h * hd..], r1 - r0, hd, 3 * d, 1),
                        ds.rows_range(r0, r1).cols_range(0, r1),
                        kh.rows_range(0, r1),
                        false,
                    );
                    // dK[r0..r1] = dS[r0.., r0..r1]ᵀ · Q[r0..]
                    product(
                        precision,
                        MatMut::strided(&mut dq[r0 * 3 * d + d + h * hd..], r1 - r0, hd, 3 * d, 1),
                        ds.rows_range(r0, t).cols_range(r0, r1).t(),
                        qh.rows_range(r0, t),
                        false,
                    );
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

    use crate::rng::normal_values as random;

    /// The block-causal products must give what whole-matrix products (one block) give,
    /// including sequence lengths that are not a multiple of the block.
    #[test]
    fn block_causal_products_match_whole_matrix_products() {
        for &(seq, block) in &[(37, 8), (64, 32), (20, 7)] {
            let s = AttentionShape {
                batch: 2,
                seq,
                dim: 12,
                heads: 3,
            };
            let qkv = random(s.batch * seq * 3 * s.dim, seq as u64);
            let dout = random(s.batch * seq * s.dim, 7);
            let (out_ref, probs_ref) = forward_blocked(s, &qkv, seq, DType::F32);
            let (out, probs) = forward_blocked(s, &qkv, block, DType::F32);
            let close = |a: &[f32], b: &[f32], what: &str| {
                for (x, y) in a.iter().zip(b) {
                    assert!(
                        (x - y).abs() < 1e-5,
                        "{what} (T={seq}, block {block}): {x} vs {y}"
                    );
                }
            };
            close(&out, &out_ref, "output");
            close(&probs, &probs_ref, "probabilities");
            let d_ref = backward_blocked(s, &qkv, &probs_ref, &dout, seq, DType::F32);
            let d = backward_blocked(s, &qkv, &probs, &dout, block, DType::F32);
            close(&d, &d_ref, "dqkv");
        }
    }
}

/// The shape of a cached attention pass (generation with a key/value cache): `rows` new
/// tokens at positions `start..start + rows` of one sequence, `heads` query heads reading
/// `kv_heads` key/value heads of `head_dim` values (query head `h` reads key/value head
/// `h / (heads / kv_heads)`). The GPU twin is `cuda::decode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedShape {
    pub rows: usize,
    pub start: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Keys a query sees at most, itself included (a sliding window); `None`: all.
    pub window: Option<usize>,
}

impl CachedShape {
    /// Values of a cache row (one position's keys, or its values).
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Values of a `[Q | K | V]` row (the key/value heads repeated for their groups).
    pub fn qkv_width(&self) -> usize {
        3 * self.heads * self.head_dim
    }
}

/// Below this many multiply-adds cached attention runs its rows on the calling thread.
const CACHED_PARALLEL_MIN_MACS: usize = 1 << 18;

/// Appends the new rows' key/value heads (the K and V heads `j·(heads/kv_heads)` of each
/// `[Q | K | V]` row of `qkv`, `[rows, 3·heads·head_dim]`) to `keys` and `values`
/// (`[positions, kv_heads·head_dim]`): grouped-query attention's memory saving is the
/// cache's.
pub fn append_cached_kv(s: CachedShape, qkv: &[f32], keys: &mut Vec<f32>, values: &mut Vec<f32>) {
    let (hd, d) = (s.head_dim, s.heads * s.head_dim);
    let group = s.heads / s.kv_heads;
    for row in qkv.chunks(3 * d).take(s.rows) {
        for j in 0..s.kv_heads {
            keys.extend_from_slice(&row[d + j * group * hd..][..hd]);
            values.extend_from_slice(&row[2 * d + j * group * hd..][..hd]);
        }
    }
}

/// Causal attention of the new rows' queries over the cache (which already holds the new
/// rows: [`append_cached_kv`] first): row `i` (position `start + i`) meets the keys of
/// positions `0..=start + i`. `qkv` holds the rows' `[Q | K | V]` (the queries are the first
/// `heads · head_dim` values of each row). Softmax with the maximum subtracted, the weighted
/// sums in f64; scale `1/√head_dim`. A long prefill's rows in parallel (they are
/// independent). Returns `[rows, heads·head_dim]`.
pub fn cached_attention_forward(
    s: CachedShape,
    qkv: &[f32],
    keys: &[f32],
    values: &[f32],
) -> Vec<f32> {
    use rayon::prelude::*;
    let (hd, h, start, rows) = (s.head_dim, s.heads, s.start, s.rows);
    let (d, kv_width, group) = (h * hd, s.kv_width(), h / s.kv_heads);
    let stride = 3 * d;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; rows * d];
    let row = |(i, out_row): (usize, &mut [f32])| {
        // Positions `first..=start + i`: all before, or the window's last ones.
        let len = start + i + 1;
        let first = s.window.map_or(0, |w| len.saturating_sub(w));
        let mut scores = vec![0.0f32; len - first];
        let mut acc = vec![0.0f64; hd];
        for head in 0..h {
            let qh = &qkv[i * stride + head * hd..][..hd];
            let kv = (head / group) * hd;
            let mut max = f32::NEG_INFINITY;
            for (j, s) in (first..).zip(scores.iter_mut()) {
                let k = &keys[j * kv_width + kv..][..hd];
                *s = qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                max = max.max(*s);
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            let mut total = 0.0f64;
            for (j, &s) in (first..).zip(&scores) {
                let w = f64::from((s - max).exp());
                total += w;
                let v = &values[j * kv_width + kv..][..hd];
                acc.iter_mut()
                    .zip(v)
                    .for_each(|(a, &v)| *a += w * f64::from(v));
            }
            let o = &mut out_row[head * hd..][..hd];
            o.iter_mut()
                .zip(&acc)
                .for_each(|(o, a)| *o = (a / total) as f32);
        }
    };
    // A step's one row, or a short prefill: less work than a task hand-out costs.
    if rows * (start + rows) * d < CACHED_PARALLEL_MIN_MACS {
        out.chunks_mut(d).enumerate().for_each(row);
    } else {
        out.par_chunks_mut(d).enumerate().for_each(row);
    }
    out
}
