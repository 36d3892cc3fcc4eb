//! Memory-efficient causal attention (FlashAttention's algorithm, Dao et al. 2022, on the CPU):
//! the `T × T` score matrix is never held. Forward walks each tile of [`TILE`] queries over
//! the key tiles up to the diagonal with an *online softmax* (a running row maximum `m` and
//! sum `l`; the partial output is rescaled by `exp(m_old − m_new)` whenever the maximum
//! grows) and keeps only the output and each row's log-sum-exp `m + ln l`. Backward recomputes
//! each score tile from `Q`, `K` and the log-sum-exp (`P = exp(S·scale − lse)`), with
//! `D_i = Σ dO_i ⊙ O_i` standing in for the row sums of `dP ⊙ P`. Tiles above the diagonal are
//! skipped in both.
//!
//! Memory per sample: the output, `H·T` log-sum-exps and two `TILE × KEY_TILE` tiles, instead of
//! `H·T²` probabilities ([`crate::attention`] keeps those). Same layout as there: `qkv` is
//! `[B, T, 3·D]`, each head a contiguous `D/H` slice.
//!
//! The kernels underneath work on *block pairs* ([`BlockPair`]: some query rows against some
//! key rows, causal or not) with q, k and v anywhere ([`HeadRows`]), and the forward continues
//! an online softmax from a kept `(output, log-sum-exp)` state ([`flash_forward_into`]). That
//! is what ring attention needs: a rank meets the key/value blocks of the other ranks one at a
//! time, and continuing the softmax from the normalised output and its log-sum-exp is the
//! log-sum-exp merge rule (`lse = log(e^lse₁ + e^lse₂)`, `o = o₁·e^(lse₁−lse) + o₂·e^(lse₂−lse)`).
//! Work is spread over (sample, head) pairs, so one long sequence still uses every core;
//! results are kept head-major (`[B, H, rows, D/H]`) and interleaved back once.
//!
//! Products run in the layer's precision (f32 through [`small_gemm`], bf16/f16 through
//! [`crate::lowp`], as the probability-keeping kernel does); the softmax is f32.

use crate::activation::fast_exp;
use crate::attention::{product, transposed_head, AttentionShape};
use crate::matmul::{Mat, MatMut};
use crate::par::{for_each_chunk_mut, for_each_chunk_pair_mut, take_buffer, with_scratch};
use crate::DType;

/// Query rows per tile.
pub const TILE: usize = 32;

/// Key columns per tile: a `TILE × KEY_TILE` score tile (32 KiB) stays in the L2 cache,
/// and wide tiles mean few online-softmax rescalings and few, larger products (at T ≤ 256
/// one tile holds every key, and the kernel does what the probability-keeping one does).
pub const KEY_TILE: usize = 256;

/// `(start, end)` of the tiles of `width` rows among `t`.
fn tiles(t: usize, width: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(width)).map(move |i| (i * width, ((i + 1) * width).min(t)))
}

/// How many samples, heads and values per head the attention runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl Heads {
    pub fn of(s: AttentionShape) -> Heads {
        Heads {
            batch: s.batch,
            heads: s.heads,
            head_dim: s.dim / s.heads,
        }
    }

    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Elements of a head-major buffer of `rows` rows per (sample, head): `[B, H, rows, hd]`.
    pub fn head_major_len(&self, rows: usize) -> usize {
        self.batch * self.heads * rows * self.head_dim
    }
}

/// One attention operand (q, k, v, an output or its gradient) where it lies: `seq` rows per
/// sample, row `i` of sample `b` starting at `data[(b·seq + i)·stride + offset]`, head `h`'s
/// values at `+ h·head_dim`. A fused `[B, T, 3·D]` activation holds q, k and v at offsets
/// 0, D and 2·D ([`HeadRows::fused`]); a travelling key/value block `[B, T, 2·D]` holds k and
/// v at 0 and D.
#[derive(Clone, Copy, Debug)]
pub struct HeadRows<'a> {
    pub data: &'a [f32],
    pub seq: usize,
    pub stride: usize,
    pub offset: usize,
}

impl<'a> HeadRows<'a> {
    /// q, k and v of a fused `[B, seq, 3·dim]` activation.
    pub fn fused(qkv: &'a [f32], seq: usize, dim: usize) -> [HeadRows<'a>; 3] {
        std::array::from_fn(|i| HeadRows {
            data: qkv,
            seq,
            stride: 3 * dim,
            offset: i * dim,
        })
    }

    /// A plain `[B, seq, width]` activation (an output, its gradient).
    pub fn dense(data: &'a [f32], seq: usize, width: usize) -> HeadRows<'a> {
        HeadRows {
            data,
            seq,
            stride: width,
            offset: 0,
        }
    }

    /// Sample `b`'s rows (from `start`) of head `h`, and the column of head `h` in them.
    fn sample(&self, b: usize, start: usize, h: usize, hd: usize) -> (&'a [f32], usize) {
        (
            &self.data[(b * self.seq + start) * self.stride..],
            self.offset + h * hd,
        )
    }

    /// Head `h` of sample `b`, rows `start..start + rows`, as a `rows × hd` matrix.
    fn head(&self, b: usize, h: usize, hd: usize, start: usize, rows: usize) -> Mat<'a> {
        let (x, col) = self.sample(b, start, h, hd);
        Mat::strided(&x[col..], rows, hd, self.stride, 1)
    }
}

/// Which query rows meet which key rows. Causal pairs begin at the same sequence position
/// (the diagonal block of a causal product): query `i` sees keys `0..=i` of the block. A
/// non-causal pair's keys all precede its queries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockPair {
    pub q_start: usize,
    pub kv_start: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub causal: bool,
}

impl BlockPair {
    /// The whole causal product over `t` rows.
    pub fn causal(t: usize) -> BlockPair {
        BlockPair {
            q_start: 0,
            kv_start: 0,
            q_len: t,
            kv_len: t,
            causal: true,
        }
    }

    /// Keys of the tile starting at `c0` that query `i` (of the block) sees, of `cols`.
    fn visible(&self, i: usize, c0: usize, cols: usize) -> usize {
        if self.causal {
            (i + 1).saturating_sub(c0).min(cols)
        } else {
            cols
        }
    }

    /// The key tiles query tile `[r0, r1)` meets: under a causal mask only keys before
    /// `r1` (the tiles above the diagonal skipped, the last one cut at `r1`).
    fn key_tiles(&self, r1: usize) -> impl Iterator<Item = (usize, usize)> {
        let end = if self.causal {
            r1.min(self.kv_len)
        } else {
            self.kv_len
        };
        tiles(end, KEY_TILE)
    }
}

/// The starting state of [`flash_forward_into`]: no keys seen (output 0, log-sum-exp −∞),
/// head-major `[B, H, rows, hd]` and `[B, H, rows]`.
pub fn empty_state(g: Heads, rows: usize) -> (Vec<f32>, Vec<f32>) {
    (
        vec![0.0; g.head_major_len(rows)],
        vec![f32::NEG_INFINITY; g.batch * g.heads * rows],
    )
}

/// Forward of `pair`, continuing the online softmax of each query row from `(out, lse)`:
/// `out` `[B, H, q.seq, hd]` holds the normalised output over the keys seen so far and `lse`
/// `[B, H, q.seq]` their log-sum-exp (−∞: none yet); both end covering the pair's keys too.
pub fn flash_forward_into(
    g: Heads,
    [q, k, v]: [HeadRows; 3],
    pair: BlockPair,
    precision: DType,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (hd, scale) = (g.head_dim, g.scale());
    assert_eq!(out.len(), g.head_major_len(q.seq));
    assert_eq!(lse.len(), g.batch * g.heads * q.seq);
    let unit = |u: usize, o: &mut [f32], l_run: &mut [f32]| {
        let (b, h) = (u / g.heads, u % g.heads);
        let o = &mut o[pair.q_start * hd..];
        let l_run = &mut l_run[pair.q_start..];
        let qh = q.head(b, h, hd, pair.q_start, pair.q_len);
        let vh = v.head(b, h, hd, pair.kv_start, pair.kv_len);
        with_scratch(hd * pair.kv_len + TILE * KEY_TILE + 2 * TILE, |scratch| {
            let (kt, rest) = scratch.split_at_mut(hd * pair.kv_len);
            let (tile, stats) = rest.split_at_mut(TILE * KEY_TILE);
            let (m, l) = stats.split_at_mut(TILE);
            let (kx, col) = k.sample(b, pair.kv_start, h, hd);
            let kt = transposed_head(kx, k.stride, col, pair.kv_len, hd, kt);
            for (r0, r1) in tiles(pair.q_len, TILE) {
                let rows = r1 - r0;
                // The kept state: a normalised output is an unnormalised one with l = 1 at
                // m = lse (and l = 0 before any key).
                for i in 0..rows {
                    m[i] = l_run[r0 + i];
                    l[i] = if m[i] == f32::NEG_INFINITY { 0.0 } else { 1.0 };
                }
                for (c0, c1) in pair.key_tiles(r1) {
                    let cols = c1 - c0;
                    let st = MatMut::strided(tile, rows, cols, KEY_TILE, 1);
                    product(
                        precision,
                        st,
                        qh.rows_range(r0, r1),
                        kt.cols_range(c0, c1),
                        false,
                    );
                    for i in 0..rows {
                        let valid = pair.visible(r0 + i, c0, cols);
                        let row = &mut tile[i * KEY_TILE..][..cols];
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
                            o[(r0 + i) * hd..][..hd]
                                .iter_mut()
                                .for_each(|x| *x *= correction);
                        }
                    }
                    let p = Mat::strided(tile, rows, cols, KEY_TILE, 1);
                    let acc = MatMut::new(&mut o[r0 * hd..(r0 + rows) * hd], rows, hd);
                    product(precision, acc, p, vh.rows_range(c0, c1), true);
                }
                for i in 0..rows {
                    if l[i] > 0.0 {
                        let inv = 1.0 / l[i];
                        o[(r0 + i) * hd..][..hd].iter_mut().for_each(|x| *x *= inv);
                        l_run[r0 + i] = m[i] + l[i].ln();
                    }
                }
            }
        });
    };
    for_each_chunk_pair_mut(out, q.seq * hd, lse, q.seq, unit);
}

/// `D_i = Σ_c a_ic · b_ic` per (sample, head, row): with the output and its gradient, the row
/// sums of `dP ⊙ P` that flash backward needs without `P`. `[B, H, seq]`.
pub fn row_dots(g: Heads, a: HeadRows, b: HeadRows) -> Vec<f32> {
    let hd = g.head_dim;
    let mut d = take_buffer(g.batch * g.heads * a.seq);
    for_each_chunk_mut(&mut d, a.seq, |u, du| {
        let (s, h) = (u / g.heads, u % g.heads);
        let ((x, xc), (y, yc)) = (a.sample(s, 0, h, hd), b.sample(s, 0, h, hd));
        for (i, di) in du.iter_mut().enumerate() {
            let (x, y) = (&x[i * a.stride + xc..][..hd], &y[i * b.stride + yc..][..hd]);
            *di = x.iter().zip(y).map(|(p, q)| p * q).sum();
        }
    });
    d
}

/// Backward of `pair`, adding into `dq` `[B, H, q.seq, hd]` and `dkv` `[B, H, 2, kv rows,
/// hd]` (dk then dv per head; `kv rows` = `k.seq`). `lse` is the forward's final log-sum-exp
/// and `delta` [`row_dots`] of the final output and `dout`, both `[B, H, q.seq]`; `dout` has
/// the queries' rows.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_into(
    g: Heads,
    [q, k, v]: [HeadRows; 3],
    pair: BlockPair,
    precision: DType,
    dout: HeadRows,
    lse: &[f32],
    delta: &[f32],
    dq: &mut [f32],
    dkv: &mut [f32],
) {
    let (hd, scale) = (g.head_dim, g.scale());
    let kv_rows = k.seq;
    assert_eq!(dq.len(), g.head_major_len(q.seq));
    assert_eq!(dkv.len(), 2 * g.head_major_len(kv_rows));
    let unit = |u: usize, dq: &mut [f32], dkv: &mut [f32]| {
        let (b, h) = (u / g.heads, u % g.heads);
        let l = &lse[u * q.seq + pair.q_start..][..pair.q_len];
        let delta = &delta[u * q.seq + pair.q_start..][..pair.q_len];
        let dq = &mut dq[pair.q_start * hd..];
        let (dk, dv) = dkv.split_at_mut(kv_rows * hd);
        let (dk, dv) = (&mut dk[pair.kv_start * hd..], &mut dv[pair.kv_start * hd..]);
        let qh = q.head(b, h, hd, pair.q_start, pair.q_len);
        let kh = k.head(b, h, hd, pair.kv_start, pair.kv_len);
        let doh = dout.head(b, h, hd, pair.q_start, pair.q_len);
        let n = pair.kv_len;
        with_scratch(2 * hd * n + 2 * TILE * KEY_TILE, |scratch| {
            let (kt, rest) = scratch.split_at_mut(hd * n);
            let (vt, rest) = rest.split_at_mut(hd * n);
            let (ptile, dptile) = rest.split_at_mut(TILE * KEY_TILE);
            let (kx, kc) = k.sample(b, pair.kv_start, h, hd);
            let (vx, vc) = v.sample(b, pair.kv_start, h, hd);
            let kt = transposed_head(kx, k.stride, kc, n, hd, kt);
            let vt = transposed_head(vx, v.stride, vc, n, hd, vt);
            for (r0, r1) in tiles(pair.q_len, TILE) {
                let rows = r1 - r0;
                for (c0, c1) in pair.key_tiles(r1) {
                    let cols = c1 - c0;
                    // P = exp(Q·Kᵀ·scale − lse), masked above a causal diagonal.
                    let st = MatMut::strided(ptile, rows, cols, KEY_TILE, 1);
                    product(
                        precision,
                        st,
                        qh.rows_range(r0, r1),
                        kt.cols_range(c0, c1),
                        false,
                    );
                    let dpt = MatMut::strided(dptile, rows, cols, KEY_TILE, 1);
                    product(
                        precision,
                        dpt,
                        doh.rows_range(r0, r1),
                        vt.cols_range(c0, c1),
                        false,
                    );
                    for i in 0..rows {
                        let valid = pair.visible(r0 + i, c0, cols);
                        let (pr, dr) = (
                            &mut ptile[i * KEY_TILE..][..cols],
                            &mut dptile[i * KEY_TILE..][..cols],
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
                    let p = Mat::strided(ptile, rows, cols, KEY_TILE, 1);
                    let ds = Mat::strided(dptile, rows, cols, KEY_TILE, 1);
                    // dV[c] += Pᵀ · dO[r]; dQ[r] += dS · K[c]; dK[c] += dSᵀ · Q[r]
                    let dov = doh.rows_range(r0, r1);
                    product(precision, head_rows(dv, hd, c0, cols), p.t(), dov, true);
                    let kc = kh.rows_range(c0, c1);
                    product(precision, head_rows(dq, hd, r0, rows), ds, kc, true);
                    let qr = qh.rows_range(r0, r1);
                    product(precision, head_rows(dk, hd, c0, cols), ds.t(), qr, true);
                }
            }
        });
    };
    for_each_chunk_pair_mut(dq, q.seq * hd, dkv, 2 * kv_rows * hd, unit);
}

/// Rows `start..start + len` of one head's head-major `[rows, hd]` buffer.
fn head_rows(buf: &mut [f32], hd: usize, start: usize, len: usize) -> MatMut<'_> {
    MatMut::new(&mut buf[start * hd..(start + len) * hd], len, hd)
}

/// Writes head-major `src` (`[B, H, rows, hd]`, or `[B, H, parts, rows, hd]` read at `part`)
/// into the columns of head 0.. of `dst` (`[B, rows, stride]` from column `offset`).
pub fn interleave_heads(
    g: Heads,
    src: &[f32],
    (parts, part): (usize, usize),
    rows: usize,
    dst: &mut [f32],
    stride: usize,
    offset: usize,
) {
    let hd = g.head_dim;
    for_each_chunk_mut(dst, rows * stride, |b, sample| {
        for h in 0..g.heads {
            let unit = &src[((b * g.heads + h) * parts + part) * rows * hd..][..rows * hd];
            for (i, row) in unit.chunks(hd).enumerate() {
                sample[i * stride + offset + h * hd..][..hd].copy_from_slice(row);
            }
        }
    });
}

/// Forward; returns (out `[B, T, D]`, log-sum-exp `[B, H, T]` of each row's scaled scores).
pub fn flash_attention_forward(
    s: AttentionShape,
    qkv: &[f32],
    precision: DType,
) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(qkv.len(), s.batch * s.seq * 3 * s.dim);
    let g = Heads::of(s);
    let (mut out_heads, mut lse) = empty_state(g, s.seq);
    let operands = HeadRows::fused(qkv, s.seq, s.dim);
    let pair = BlockPair::causal(s.seq);
    flash_forward_into(g, operands, pair, precision, &mut out_heads, &mut lse);
    let mut out = take_buffer(s.batch * s.seq * s.dim);
    interleave_heads(g, &out_heads, (1, 0), s.seq, &mut out, s.dim, 0);
    (out, lse)
}

/// Backward; returns dqkv `[B, T, 3·D]` from the forward's output and log-sum-exp.
pub fn flash_attention_backward(
    s: AttentionShape,
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    precision: DType,
) -> Vec<f32> {
    let (t, d) = (s.seq, s.dim);
    let g = Heads::of(s);
    let dout = HeadRows::dense(dout, t, d);
    let delta = row_dots(g, HeadRows::dense(out, t, d), dout);
    let mut dq = vec![0.0; g.head_major_len(t)];
    let mut dkv = vec![0.0; 2 * g.head_major_len(t)];
    let operands = HeadRows::fused(qkv, t, d);
    let pair = BlockPair::causal(t);
    flash_backward_into(
        g, operands, pair, precision, dout, lse, &delta, &mut dq, &mut dkv,
    );
    crate::par::recycle(delta);
    let mut dqkv = take_buffer(qkv.len());
    interleave_heads(g, &dq, (1, 0), t, &mut dqkv, 3 * d, 0);
    interleave_heads(g, &dkv, (2, 0), t, &mut dqkv, 3 * d, d);
    interleave_heads(g, &dkv, (2, 1), t, &mut dqkv, 3 * d, 2 * d);
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
            let (out, lse) = flash_attention_forward(s, &qkv, DType::F32);
            let dqkv = flash_attention_backward(s, &qkv, &out, &lse, &dout, DType::F32);
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
            let (out, lse) = flash_attention_forward(s, &qkv, DType::F32);
            let (out_ref, probs) = causal_attention_forward(s, &qkv, DType::F32);
            let d = flash_attention_backward(s, &qkv, &out, &lse, &dout, DType::F32);
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

    /// Ring attention's decomposition: query chunks meet key/value chunks one at a time, in
    /// any order, from a separate `[B, T, 2·D]` key/value buffer, and the continued softmax
    /// and accumulated gradients equal the whole causal product.
    #[test]
    fn block_pairs_in_any_order_equal_the_whole_product() {
        let s = AttentionShape {
            batch: 2,
            seq: 120,
            dim: 32,
            heads: 4,
        };
        let (t, d, chunk) = (s.seq, s.dim, 40);
        let g = Heads::of(s);
        let qkv = random(s.batch * t * 3 * d, 21);
        let dout = random(s.batch * t * d, 22);
        let (out_ref, lse_ref) = flash_attention_forward(s, &qkv, DType::F32);
        let dqkv_ref = flash_attention_backward(s, &qkv, &out_ref, &lse_ref, &dout, DType::F32);
        // k and v copied out of the fused activation, as a ring would send them.
        let kv: Vec<f32> = qkv
            .chunks(3 * d)
            .flat_map(|row| row[d..].iter().copied())
            .collect();
        let [q, _, _] = HeadRows::fused(&qkv, t, d);
        let (k, v) = (
            HeadRows {
                data: &kv,
                seq: t,
                stride: 2 * d,
                offset: 0,
            },
            HeadRows {
                data: &kv,
                seq: t,
                stride: 2 * d,
                offset: d,
            },
        );
        let pairs: Vec<BlockPair> = (0..t / chunk)
            .flat_map(|i| {
                // Newest keys first: the order differs from the whole product's.
                (0..=i).rev().map(move |j| BlockPair {
                    q_start: i * chunk,
                    kv_start: j * chunk,
                    q_len: chunk,
                    kv_len: chunk,
                    causal: i == j,
                })
            })
            .collect();
        let (mut out_heads, mut lse) = empty_state(g, t);
        for &pair in &pairs {
            flash_forward_into(g, [q, k, v], pair, DType::F32, &mut out_heads, &mut lse);
        }
        let mut out = vec![0.0; s.batch * t * d];
        interleave_heads(g, &out_heads, (1, 0), t, &mut out, d, 0);
        let close = |a: &[f32], b: &[f32], what: &str| {
            let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs() / scale)
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-5, "{what}: {worst:.1e}");
        };
        close(&out, &out_ref, "output");
        close(&lse, &lse_ref, "log-sum-exp");
        let dout_rows = HeadRows::dense(&dout, t, d);
        let delta = row_dots(g, HeadRows::dense(&out, t, d), dout_rows);
        let mut dq = vec![0.0; g.head_major_len(t)];
        let mut dkv = vec![0.0; 2 * g.head_major_len(t)];
        for &pair in pairs.iter().rev() {
            let operands = [q, k, v];
            flash_backward_into(
                g,
                operands,
                pair,
                DType::F32,
                dout_rows,
                &lse,
                &delta,
                &mut dq,
                &mut dkv,
            );
        }
        let mut dqkv = vec![0.0; qkv.len()];
        interleave_heads(g, &dq, (1, 0), t, &mut dqkv, 3 * d, 0);
        interleave_heads(g, &dkv, (2, 0), t, &mut dqkv, 3 * d, d);
        interleave_heads(g, &dkv, (2, 1), t, &mut dqkv, 3 * d, 2 * d);
        close(&dqkv, &dqkv_ref, "dqkv");
    }

    /// Under bf16 the products round their inputs (as the probability-keeping kernel's do);
    /// the result stays within bf16's precision of the f64 definition.
    #[test]
    fn bf16_products_stay_close_to_the_definition() {
        let s = AttentionShape {
            batch: 2,
            seq: 77,
            dim: 64,
            heads: 2,
        };
        let qkv = random(s.batch * s.seq * 3 * s.dim, 8);
        let dout = random(s.batch * s.seq * s.dim, 9);
        let (out, lse) = flash_attention_forward(s, &qkv, DType::BF16);
        let dqkv = flash_attention_backward(s, &qkv, &out, &lse, &dout, DType::BF16);
        let (out_ref, d_ref) = reference(s, &qkv, &dout);
        let (eo, ed) = (max_err(&out, &out_ref), max_err(&dqkv, &d_ref));
        assert!(eo < 2e-2 && ed < 2e-2, "output {eo:.1e}, gradient {ed:.1e}");
        assert!(eo > 1e-5, "bf16 products should round ({eo:.1e})");
    }
}
