//! Memory-efficient causal attention (FlashAttention's algorithm, Dao et al. 2022, on the CPU):
//! the `T × T` score matrix is never held. Forward walks each tile of [`TILE`] queries over
//! the key tiles up to the diagonal with an *online softmax* (a running row maximum `m` and
//! sum `l`; the partial output is rescaled by `exp(m_old − m_new)` whenever the maximum
//! grows) and keeps only the output and each row's log-sum-exp `m + ln l`. Backward recomputes
//! each score tile from `Q`, `K` and the log-sum-exp (`P = exp(S·scale − lse)`), with
//! `D_i = Σ dO_i ⊙ O_i` standing in for the row sums of `dP ⊙ P`. Tiles above the diagonal are
//! skipped in both.
//!
//! Memory per sample: the output and `H·T` log-sum-exps kept for backward, and per thread a
//! transposed key (and value) head and one or two score tiles, instead of `H·T²` probabilities ([`crate::attention`] keeps those). Same layout as there: `qkv` is
//! `[B, T, 3·D]`, each head a contiguous `D/H` slice.
//!
//! The kernels underneath work on *block pairs* ([`BlockPair`]: some query rows against some
//! key rows, causal or not) with q, k and v anywhere ([`HeadRows`]), and the forward continues
//! an online softmax from a kept `(output, log-sum-exp)` state ([`flash_forward_into`]). That
//! is what ring attention needs: a rank meets the key/value blocks of the other ranks one at a
//! time, and continuing the softmax from the normalised output and its log-sum-exp is the
//! log-sum-exp merge rule (`lse = log(e^lse₁ + e^lse₂)`, `o = o₁·e^(lse₁−lse) + o₂·e^(lse₂−lse)`).
//! With samples enough for every thread, each task takes a sample and writes its heads in
//! place; with fewer (long sequences), work is spread over (sample, head) pairs, kept
//! head-major (`[B, H, rows, D/H]`) and interleaved back once — so one long sequence still
//! uses as many cores as it has heads.
//!
//! Products run in the layer's precision (f32 through [`small_gemm`], bf16/f16 through
//! [`crate::lowp`], as the probability-keeping kernel does); the softmax is f32.

use crate::activation::{fast_exp, lane_sum, lane_sum_zip};
use crate::attention::{product, transposed_head, AttentionShape};
use crate::matmul::{Mat, MatMut};
use crate::par::{
    filled_buffer, for_each_chunk_mut, for_each_chunk_pair_mut, take_buffer, with_scratch,
};
use crate::DType;

/// Query rows per tile.
pub const TILE: usize = 32;

/// Key columns per tile: a `TILE × KEY_TILE` score tile (32 KiB) stays in the L2 cache,
/// and wide tiles mean few online-softmax rescalings and few, larger products (at T ≤ 256
/// one tile holds every key, and the kernel does what the probability-keeping one does).
pub const KEY_TILE: usize = 256;

/// Backward: query rows per segment of the strip that meets one key tile (a `STRIP × TILE`
/// score segment, 32 KiB).
const STRIP: usize = 256;

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
/// (the diagonal block of a causal product): query `i` sees keys `0..=i` of the block, or
/// under a sliding window of `w` only the last `w` of them, `i + 1 − w..=i` (Mistral's). A
/// non-causal pair's keys all precede its queries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockPair {
    pub q_start: usize,
    pub kv_start: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub causal: bool,
    /// Keys a query sees at most, itself included (causal pairs only).
    pub window: Option<usize>,
}

impl BlockPair {
    /// The whole causal product over `t` rows, each query seeing at most `window` keys.
    pub fn causal(t: usize, window: Option<usize>) -> BlockPair {
        assert!(window != Some(0), "a sliding window of no keys");
        BlockPair {
            q_start: 0,
            kv_start: 0,
            q_len: t,
            kv_len: t,
            causal: true,
            window,
        }
    }

    /// The first key query `i` (of the block) sees.
    fn first_key(&self, i: usize) -> usize {
        match self.window {
            Some(w) if self.causal => (i + 1).saturating_sub(w),
            _ => 0,
        }
    }

    /// The keys of the tile starting at `c0` that query `i` (of the block) sees, as a range
    /// of its `cols` columns (empty where the window has passed the whole tile).
    fn visible(&self, i: usize, c0: usize, cols: usize) -> std::ops::Range<usize> {
        let end = if self.causal {
            (i + 1).saturating_sub(c0).min(cols)
        } else {
            cols
        };
        self.first_key(i).saturating_sub(c0).min(end)..end
    }

    /// The key tiles query tile `[r0, r1)` meets: under a causal mask only keys before
    /// `r1` (the tiles above the diagonal skipped, the last one cut at `r1`), under a window
    /// only from the first key row `r0` sees.
    fn key_tiles(&self, r0: usize, r1: usize) -> impl Iterator<Item = (usize, usize)> {
        let end = if self.causal {
            r1.min(self.kv_len)
        } else {
            self.kv_len
        };
        let first = self.first_key(r0);
        tiles(end, KEY_TILE).filter(move |&(_, c1)| c1 > first)
    }

    /// The query rows that see key tile `[c0, c1)`: under a causal mask from `c0` on, under
    /// a window only until the last query whose window still reaches `c1 − 1`.
    fn query_rows(&self, c0: usize, c1: usize) -> std::ops::Range<usize> {
        if !self.causal {
            return 0..self.q_len;
        }
        let end = match self.window {
            Some(w) => (c1 - 1).saturating_add(w).min(self.q_len),
            None => self.q_len,
        };
        c0.min(end)..end
    }
}

/// Where one head's rows of an output or gradient lie in a task's buffer: row `i` at
/// `offset + i·stride`. Head-major buffers have `stride = head_dim`; a sample's rows of a
/// `[T, width]` activation have `stride = width` and the head's column as offset.
#[derive(Clone, Copy, Debug)]
struct Place {
    offset: usize,
    stride: usize,
}

impl Place {
    fn head_major(start: usize, hd: usize) -> Place {
        Place {
            offset: start * hd,
            stride: hd,
        }
    }

    /// Rows `start..start + len` (of `hd` values) as a matrix.
    fn rows<'b>(&self, buf: &'b mut [f32], start: usize, len: usize, hd: usize) -> MatMut<'b> {
        MatMut::strided(
            &mut buf[self.offset + start * self.stride..],
            len,
            hd,
            self.stride,
            1,
        )
    }

    fn row<'b>(&self, buf: &'b mut [f32], i: usize, hd: usize) -> &'b mut [f32] {
        &mut buf[self.offset + i * self.stride..][..hd]
    }
}

/// Whether the whole-product kernels give each task one sample (all its heads, written in
/// place into the `[B, T, ·]` result) rather than one (sample, head) pair written head-major
/// and interleaved afterwards: when there are samples enough to keep every thread busy.
fn by_sample(g: Heads) -> bool {
    g.batch >= crate::par::threads()
}

/// The starting state of [`flash_forward_into`]: no keys seen (log-sum-exp −∞), head-major
/// `[B, H, rows, hd]` and `[B, H, rows]`. The output's values are unspecified until written:
/// the first key tile of a row overwrites it.
pub fn empty_state(g: Heads, rows: usize) -> (Vec<f32>, Vec<f32>) {
    // Recycled buffers: a fresh allocation this size costs a page fault per 4 KiB.
    let lse = filled_buffer(g.batch * g.heads * rows, f32::NEG_INFINITY);
    (take_buffer(g.head_major_len(rows)), lse)
}

/// Forward of `pair` for head `h` of sample `b`, continuing each query row's online softmax
/// from `(out, lse)` (`out` at `place`, `lse` this head's `q.seq` values).
#[allow(clippy::too_many_arguments)]
fn forward_head(
    g: Heads,
    (b, h): (usize, usize),
    [q, k, v]: [HeadRows; 3],
    pair: BlockPair,
    precision: DType,
    out: &mut [f32],
    place: Place,
    lse: &mut [f32],
) {
    let (hd, scale) = (g.head_dim, g.scale());
    let l_run = &mut lse[pair.q_start..];
    let qh = q.head(b, h, hd, pair.q_start, pair.q_len);
    let vh = v.head(b, h, hd, pair.kv_start, pair.kv_len);
    let at = |i: usize| pair.q_start + i;
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
            for (c0, c1) in pair.key_tiles(r0, r1) {
                let cols = c1 - c0;
                let st = MatMut::strided(tile, rows, cols, KEY_TILE, 1);
                let keys = kt.cols_range(c0, c1);
                product(precision, st, qh.rows_range(r0, r1), keys, false);
                for i in 0..rows {
                    let valid = pair.visible(r0 + i, c0, cols);
                    let row = &mut tile[i * KEY_TILE..][..cols];
                    row[..valid.start].fill(0.0);
                    row[valid.end..].fill(0.0);
                    let row = &mut row[valid];
                    let o = place.row(out, at(r0 + i), hd);
                    if row.is_empty() {
                        // The window has passed this whole tile: nothing to add, but a row
                        // that has seen no key yet must start from zero all the same.
                        if m[i] == f32::NEG_INFINITY {
                            o.fill(0.0);
                        }
                        continue;
                    }
                    // scale > 0: the largest scaled score is the largest score, scaled.
                    let tile_max = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) * scale;
                    let new_max = m[i].max(tile_max);
                    let correction = fast_exp(m[i] - new_max);
                    // Exponentiate first, sum after: a running sum inside the loop would
                    // serialise it and keep `fast_exp` from vectorising.
                    row.iter_mut()
                        .for_each(|v| *v = fast_exp(*v * scale - new_max));
                    let sum = lane_sum(row);
                    if m[i] == f32::NEG_INFINITY {
                        // Nothing accumulated yet: start from zero (the buffer is not
                        // cleared beforehand).
                        o.fill(0.0);
                    } else if correction != 1.0 {
                        o.iter_mut().for_each(|x| *x *= correction);
                    }
                    l[i] = l[i] * correction + sum;
                    m[i] = new_max;
                }
                let p = Mat::strided(tile, rows, cols, KEY_TILE, 1);
                let acc = place.rows(out, at(r0), rows, hd);
                product(precision, acc, p, vh.rows_range(c0, c1), true);
            }
            for i in 0..rows {
                if l[i] > 0.0 {
                    let inv = 1.0 / l[i];
                    place
                        .row(out, at(r0 + i), hd)
                        .iter_mut()
                        .for_each(|x| *x *= inv);
                    l_run[r0 + i] = m[i] + l[i].ln();
                }
            }
        }
    });
}

/// Forward of `pair`, continuing the online softmax of each query row from `(out, lse)`:
/// `out` `[B, H, q.seq, hd]` holds the normalised output over the keys seen so far and `lse`
/// `[B, H, q.seq]` their log-sum-exp (−∞: none yet, the output's values then unspecified);
/// both end covering the pair's keys too.
pub fn flash_forward_into(
    g: Heads,
    operands: [HeadRows; 3],
    pair: BlockPair,
    precision: DType,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (hd, rows) = (g.head_dim, operands[0].seq);
    assert_eq!(out.len(), g.head_major_len(rows));
    assert_eq!(lse.len(), g.batch * g.heads * rows);
    let unit = |u: usize, o: &mut [f32], l: &mut [f32]| {
        let place = Place::head_major(0, hd);
        let bh = (u / g.heads, u % g.heads);
        forward_head(g, bh, operands, pair, precision, o, place, l);
    };
    for_each_chunk_pair_mut(out, rows * hd, lse, rows, unit);
}

/// What backward needs besides q, k and v: the forward's final output and its gradient (the
/// queries' rows) and final log-sum-exp `[B, H, q rows]`.
#[derive(Clone, Copy, Debug)]
pub struct Upstream<'a> {
    pub out: HeadRows<'a>,
    pub dout: HeadRows<'a>,
    pub lse: &'a [f32],
}

/// Which gradient a [`GradTargets`] row range belongs to.
const DQ: usize = 0;
const DK: usize = 1;
const DV: usize = 2;

/// Where backward writes one head's dQ, dK and dV (`which`: [`DQ`], [`DK`], [`DV`]).
trait GradTargets {
    fn rows(&mut self, which: usize, start: usize, len: usize, hd: usize) -> MatMut<'_>;
}

/// One sample's rows of the `[T, 3·D]` gradient of a fused q/k/v: the three at their places.
struct Interleaved<'b> {
    buf: &'b mut [f32],
    places: [Place; 3],
}

impl GradTargets for Interleaved<'_> {
    fn rows(&mut self, which: usize, start: usize, len: usize, hd: usize) -> MatMut<'_> {
        self.places[which].rows(self.buf, start, len, hd)
    }
}

/// Head-major buffers of one (sample, head): dQ, dK, dV each `[rows, hd]`.
struct Separate<'b>([&'b mut [f32]; 3]);

impl GradTargets for Separate<'_> {
    fn rows(&mut self, which: usize, start: usize, len: usize, hd: usize) -> MatMut<'_> {
        Place::head_major(0, hd).rows(self.0[which], start, len, hd)
    }
}

/// Backward of `pair` for head `h` of sample `b`, into `grads`.
/// `fresh`: the places hold nothing yet, so the first product into each row overwrites it
/// (every query row meets key tile 0, and each key tile's first segment is its first touch:
/// only for a pair that is the whole product).
#[allow(clippy::too_many_arguments)]
fn backward_head(
    g: Heads,
    (b, h): (usize, usize),
    [q, k, v]: [HeadRows; 3],
    pair: BlockPair,
    precision: DType,
    up: Upstream,
    grads: &mut impl GradTargets,
    fresh: bool,
) {
    let (hd, scale) = (g.head_dim, g.scale());
    let u = b * g.heads + h;
    let l = &up.lse[u * q.seq + pair.q_start..][..pair.q_len];
    let qh = q.head(b, h, hd, pair.q_start, pair.q_len);
    let kh = k.head(b, h, hd, pair.kv_start, pair.kv_len);
    let doh = up.dout.head(b, h, hd, pair.q_start, pair.q_len);
    let n = pair.kv_len;
    with_scratch(2 * hd * n + 2 * STRIP * TILE + pair.q_len, |scratch| {
        let (kt, rest) = scratch.split_at_mut(hd * n);
        let (vt, rest) = rest.split_at_mut(hd * n);
        let (ptile, rest) = rest.split_at_mut(STRIP * TILE);
        let (dptile, delta) = rest.split_at_mut(STRIP * TILE);
        // D_i = Σ_c dO_ic · O_ic: the row sums of dP ⊙ P, without P.
        let ((o, oc), (go, gc)) = (
            up.out.sample(b, pair.q_start, h, hd),
            up.dout.sample(b, pair.q_start, h, hd),
        );
        for (i, di) in delta.iter_mut().enumerate() {
            let o = &o[i * up.out.stride + oc..][..hd];
            let go = &go[i * up.dout.stride + gc..][..hd];
            *di = lane_sum_zip(o, go, |x, y| x * y);
        }
        let (kx, kc) = k.sample(b, pair.kv_start, h, hd);
        let (vx, vc) = v.sample(b, pair.kv_start, h, hd);
        let kt = transposed_head(kx, k.stride, kc, n, hd, kt);
        let vt = transposed_head(vx, v.stride, vc, n, hd, vt);
        // Key tile by key tile, the strip of queries that see it (under a causal mask
        // those from the tile's first key on), in segments of STRIP rows: dK and dV of
        // the tile are then products as deep as the segment, not as a query tile.
        for (c0, c1) in tiles(n, TILE) {
            let cols = c1 - c0;
            let queries = pair.query_rows(c0, c1);
            let first = queries.start;
            for (s0, s1) in tiles(queries.len(), STRIP) {
                let (r0, r1) = (first + s0, first + s1);
                let rows = r1 - r0;
                // P = exp(Q·Kᵀ·scale − lse), masked above a causal diagonal.
                let st = MatMut::strided(ptile, rows, cols, TILE, 1);
                let qs = qh.rows_range(r0, r1);
                product(precision, st, qs, kt.cols_range(c0, c1), false);
                let dpt = MatMut::strided(dptile, rows, cols, TILE, 1);
                let dos = doh.rows_range(r0, r1);
                product(precision, dpt, dos, vt.cols_range(c0, c1), false);
                for i in 0..rows {
                    let valid = pair.visible(r0 + i, c0, cols);
                    let (pr, dr) = (
                        &mut ptile[i * TILE..][..cols],
                        &mut dptile[i * TILE..][..cols],
                    );
                    let (li, di) = (l[r0 + i], delta[r0 + i]);
                    for (p, dp) in pr[valid.clone()].iter_mut().zip(&mut dr[valid.clone()]) {
                        *p = fast_exp(*p * scale - li);
                        // dS = P ⊙ (dP − D) · scale
                        *dp = *p * (*dp - di) * scale;
                    }
                    for row in [pr, dr] {
                        row[..valid.start].fill(0.0);
                        row[valid.end..].fill(0.0);
                    }
                }
                let p = Mat::strided(ptile, rows, cols, TILE, 1);
                let ds = Mat::strided(dptile, rows, cols, TILE, 1);
                // dV[c] += Pᵀ · dO[r]; dK[c] += dSᵀ · Q[r]; dQ[r] += dS · K[c]
                let (kv_add, q_add) = (!fresh || s0 > 0, !fresh || c0 > 0);
                let (ks, qs0) = (pair.kv_start + c0, pair.q_start + r0);
                product(precision, grads.rows(DV, ks, cols, hd), p.t(), dos, kv_add);
                product(precision, grads.rows(DK, ks, cols, hd), ds.t(), qs, kv_add);
                let kc = kh.rows_range(c0, c1);
                product(precision, grads.rows(DQ, qs0, rows, hd), ds, kc, q_add);
            }
        }
    });
}

/// Backward of `pair`, adding into `dq` `[B, H, q.seq, hd]` and `dkv` `[B, H, 2, kv rows,
/// hd]` (dk then dv per head; `kv rows` = `k.seq`).
pub fn flash_backward_into(
    g: Heads,
    operands: [HeadRows; 3],
    pair: BlockPair,
    precision: DType,
    up: Upstream,
    dq: &mut [f32],
    dkv: &mut [f32],
) {
    let hd = g.head_dim;
    let (q_rows, kv_rows) = (operands[0].seq, operands[1].seq);
    assert_eq!(dq.len(), g.head_major_len(q_rows));
    assert_eq!(dkv.len(), 2 * g.head_major_len(kv_rows));
    let unit = |u: usize, dq: &mut [f32], dkv: &mut [f32]| {
        let bh = (u / g.heads, u % g.heads);
        let (dk, dv) = dkv.split_at_mut(kv_rows * hd);
        let mut grads = Separate([dq, dk, dv]);
        backward_head(g, bh, operands, pair, precision, up, &mut grads, false);
    };
    for_each_chunk_pair_mut(dq, q_rows * hd, dkv, 2 * kv_rows * hd, unit);
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
/// Each query sees the keys up to itself, or only the last `window` of them.
pub fn flash_attention_forward(
    s: AttentionShape,
    qkv: &[f32],
    precision: DType,
    window: Option<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let (t, d) = (s.seq, s.dim);
    assert_eq!(qkv.len(), s.batch * t * 3 * d);
    let g = Heads::of(s);
    let operands = HeadRows::fused(qkv, t, d);
    let pair = BlockPair::causal(t, window);
    let (mut staged, mut lse) = empty_state(g, t);
    if !by_sample(g) {
        flash_forward_into(g, operands, pair, precision, &mut staged, &mut lse);
        let mut out = take_buffer(s.batch * t * d);
        interleave_heads(g, &staged, (1, 0), t, &mut out, d, 0);
        crate::par::recycle(staged);
        return (out, lse);
    }
    // One task per sample, every head written in place (`staged` has B·H·T·hd = B·T·D
    // elements either way).
    let hd = g.head_dim;
    for_each_chunk_pair_mut(&mut staged, t * d, &mut lse, g.heads * t, |b, o, l| {
        for (h, lh) in l.chunks_mut(t).enumerate() {
            let place = Place {
                offset: h * hd,
                stride: d,
            };
            forward_head(g, (b, h), operands, pair, precision, o, place, lh);
        }
    });
    (staged, lse)
}

/// Backward; returns dqkv `[B, T, 3·D]` from the forward's output and log-sum-exp.
pub fn flash_attention_backward(
    s: AttentionShape,
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    precision: DType,
    window: Option<usize>,
) -> Vec<f32> {
    let (t, d) = (s.seq, s.dim);
    let g = Heads::of(s);
    let up = Upstream {
        out: HeadRows::dense(out, t, d),
        dout: HeadRows::dense(dout, t, d),
        lse,
    };
    let operands = HeadRows::fused(qkv, t, d);
    let pair = BlockPair::causal(t, window);
    // Under a window a query row's first key tile is not tile 0, so the first product into
    // its dQ row is not known in advance: the gradient starts from zeros and is added into.
    let fresh = window.is_none();
    let mut dqkv = if fresh {
        take_buffer(qkv.len())
    } else {
        filled_buffer(qkv.len(), 0.0)
    };
    if by_sample(g) {
        // One task per sample; without a window every element is written by a first
        // product (`fresh`).
        let hd = g.head_dim;
        for_each_chunk_mut(&mut dqkv, t * 3 * d, |b, buf| {
            for h in 0..g.heads {
                let at = |part: usize| Place {
                    offset: part * d + h * hd,
                    stride: 3 * d,
                };
                let mut grads = Interleaved {
                    buf: &mut *buf,
                    places: [at(0), at(1), at(2)],
                };
                backward_head(g, (b, h), operands, pair, precision, up, &mut grads, fresh);
            }
        });
    } else {
        let mut dq = filled_buffer(g.head_major_len(t), 0.0);
        let mut dkv = filled_buffer(2 * g.head_major_len(t), 0.0);
        flash_backward_into(g, operands, pair, precision, up, &mut dq, &mut dkv);
        interleave_heads(g, &dq, (1, 0), t, &mut dqkv, 3 * d, 0);
        interleave_heads(g, &dkv, (2, 0), t, &mut dqkv, 3 * d, d);
        interleave_heads(g, &dkv, (2, 1), t, &mut dqkv, 3 * d, 2 * d);
        crate::par::recycle(dq);
        crate::par::recycle(dkv);
    }
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
        reference_windowed(s, qkv, dout, None)
    }

    /// [`reference`] with each query seeing at most the last `window` keys.
    fn reference_windowed(
        s: AttentionShape,
        qkv: &[f32],
        dout: &[f32],
        window: Option<usize>,
    ) -> (Vec<f64>, Vec<f64>) {
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
                    let lo = window.map_or(0, |w| (i + 1).saturating_sub(w));
                    let scores: Vec<f64> = (lo..=i)
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
                            (lo..=i).map(|j| p[j - lo] * x(b, j, vo + c)).sum();
                    }
                    // dP_j = dO_i · V_j; dS_j = P_j (dP_j − Σ P dP) · scale
                    let dp: Vec<f64> = (lo..=i)
                        .map(|j| (0..hd).map(|c| go(c) * x(b, j, vo + c)).sum())
                        .collect();
                    let dot: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                    for j in lo..=i {
                        let (pj, dpj) = (p[j - lo], dp[j - lo]);
                        let ds = pj * (dpj - dot) * scale;
                        for c in 0..hd {
                            dqkv[(b * t + i) * 3 * d + qo + c] += ds * x(b, j, ko + c);
                            dqkv[(b * t + j) * 3 * d + ko + c] += ds * x(b, i, qo + c);
                            dqkv[(b * t + j) * 3 * d + vo + c] += pj * go(c);
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
            let (out, lse) = flash_attention_forward(s, &qkv, DType::F32, None);
            let dqkv = flash_attention_backward(s, &qkv, &out, &lse, &dout, DType::F32, None);
            let (out_ref, d_ref) = reference(s, &qkv, &dout);
            let (eo, ed) = (max_err(&out, &out_ref), max_err(&dqkv, &d_ref));
            assert!(
                eo < 1e-5 && ed < 1e-5,
                "T={seq}: output {eo:.1e}, gradient {ed:.1e}"
            );
        }
    }

    /// Mistral's sliding window: windows shorter than a tile, crossing tiles and longer than
    /// the sequence, where whole key tiles fall out of a query tile's reach, both when each
    /// task takes a sample and when tasks take heads.
    #[test]
    fn a_sliding_window_matches_the_f64_definition() {
        for (seq, window) in [
            (70, 1),
            (70, 5),
            (300, 33),
            (600, 32),
            (600, 257),
            (90, 200),
        ] {
            for batch in [1, 4] {
                let s = AttentionShape {
                    batch,
                    seq,
                    dim: 16,
                    heads: 2,
                };
                let qkv = random(s.batch * seq * 3 * s.dim, (seq + window) as u64);
                let dout = random(s.batch * seq * s.dim, 13);
                let w = Some(window);
                let (out, lse) = flash_attention_forward(s, &qkv, DType::F32, w);
                let dqkv = flash_attention_backward(s, &qkv, &out, &lse, &dout, DType::F32, w);
                let (out_ref, d_ref) = reference_windowed(s, &qkv, &dout, w);
                let (eo, ed) = (max_err(&out, &out_ref), max_err(&dqkv, &d_ref));
                assert!(
                    eo < 1e-5 && ed < 1e-5,
                    "T={seq}, window {window}, batch {batch}: output {eo:.1e}, gradient {ed:.1e}"
                );
            }
        }
        // A window is not the full product: the test above can fail.
        let s = AttentionShape {
            batch: 1,
            seq: 64,
            dim: 16,
            heads: 2,
        };
        let qkv = random(s.batch * 64 * 3 * s.dim, 1);
        let full = flash_attention_forward(s, &qkv, DType::F32, None).0;
        let windowed = flash_attention_forward(s, &qkv, DType::F32, Some(16)).0;
        assert_eq!(
            full[..16 * 16],
            windowed[..16 * 16],
            "the first 16 rows see all keys"
        );
        assert!(full[16 * 16..] != windowed[16 * 16..]);
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
            let (out, lse) = flash_attention_forward(s, &qkv, DType::F32, None);
            let (out_ref, probs) = causal_attention_forward(s, &qkv, DType::F32);
            let d = flash_attention_backward(s, &qkv, &out, &lse, &dout, DType::F32, None);
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
        let (out_ref, lse_ref) = flash_attention_forward(s, &qkv, DType::F32, None);
        let dqkv_ref =
            flash_attention_backward(s, &qkv, &out_ref, &lse_ref, &dout, DType::F32, None);
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
                    window: None,
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
        let mut dq = vec![0.0; g.head_major_len(t)];
        let mut dkv = vec![0.0; 2 * g.head_major_len(t)];
        let up = Upstream {
            out: HeadRows::dense(&out, t, d),
            dout: dout_rows,
            lse: &lse,
        };
        for &pair in pairs.iter().rev() {
            flash_backward_into(g, [q, k, v], pair, DType::F32, up, &mut dq, &mut dkv);
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
        let (out, lse) = flash_attention_forward(s, &qkv, DType::BF16, None);
        let dqkv = flash_attention_backward(s, &qkv, &out, &lse, &dout, DType::BF16, None);
        let (out_ref, d_ref) = reference(s, &qkv, &dout);
        let (eo, ed) = (max_err(&out, &out_ref), max_err(&dqkv, &d_ref));
        assert!(eo < 2e-2 && ed < 2e-2, "output {eo:.1e}, gradient {ed:.1e}");
        assert!(eo > 1e-5, "bf16 products should round ({eo:.1e})");
    }

    /// Both ways of spreading the work: a task per sample writing in place (as many samples
    /// as threads) and a task per (sample, head) staged head-major (fewer samples than
    /// threads), the same results on any machine.
    #[test]
    fn per_sample_and_per_head_tasks_agree() {
        for &seq in &[1usize, 33, 70] {
            let s = AttentionShape {
                batch: 3,
                seq,
                dim: 16,
                heads: 2,
            };
            let qkv = random(s.batch * seq * 3 * s.dim, 40 + seq as u64);
            let dout = random(s.batch * seq * s.dim, 41);
            let run = |threads: usize| {
                crate::par::pool(threads).install(|| {
                    assert_eq!(by_sample(Heads::of(s)), threads <= 3);
                    let (out, lse) = flash_attention_forward(s, &qkv, DType::F32, None);
                    let d = flash_attention_backward(s, &qkv, &out, &lse, &dout, DType::F32, None);
                    (out, d)
                })
            };
            let (out_ref, d_ref) = reference(s, &qkv, &dout);
            for threads in [1, 8] {
                let (out, d) = run(threads);
                let (eo, ed) = (max_err(&out, &out_ref), max_err(&d, &d_ref));
                assert!(
                    eo < 1e-5 && ed < 1e-5,
                    "T={seq}, {threads} threads: output {eo:.1e}, gradient {ed:.1e}"
                );
            }
        }
    }
}
