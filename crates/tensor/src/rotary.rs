//! Rotary position embeddings (RoPE, Su et al. 2021) and grouped-query attention's sharing of
//! key/value heads (Ainslie et al. 2023), as one pass between a Llama block's fused q/k/v
//! projection and the attention kernels.
//!
//! Why one pass: the attention kernels ([`crate::attention`], [`crate::flash`], ring attention
//! and Ulysses on top of them) take a fused `[Q | K | V]` row with one key/value head per
//! query head. Rotating q and k and repeating each key/value head for the query heads of its
//! group produces exactly that row, so every attention kernel and every context-parallel form
//! serves Llama unchanged. The price is the repeated key/value heads in the kept activations
//! (`3·H` heads instead of `H + 2·H_kv`); the weights and the projection's FLOPs keep GQA's
//! savings.
//!
//! The projection's output is laid out by key/value group (Megatron-LM's layout for GQA): for
//! group `j`, its `H/H_kv` query heads, then key head `j`, then value head `j`. A split of
//! those rows into `tp` equal parts is a split by whole groups, so tensor parallelism needs no
//! special case. The rotation is Hugging Face Llama's ("rotate half": element `i` pairs with
//! `i + head_dim/2`, angle `position · θ^(−2i/head_dim)`), so its weights load unpermuted.

use crate::par::{chunk_len, for_each_chunk_mut, PARALLEL_MIN_LEN};

/// The shape of one rotary pass: `batch · seq` token rows of `heads` query heads and
/// `kv_heads` key/value heads of `head_dim` values each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotaryShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl RotaryShape {
    /// Width of an input row: the fused projection's outputs.
    pub fn input_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Width of an output row: `[Q | K | V]`, one key/value head per query head.
    pub fn output_width(&self) -> usize {
        3 * self.heads * self.head_dim
    }

    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// The rotary frequencies: the base θ (`rope_theta`) and, for Llama 3.1 and later, their
/// long-context rescaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
}

/// Llama 3.1's rescaling of the rotary frequencies for a context longer than the one the
/// model was first trained on (Hugging Face's `rope_type = "llama3"`): a frequency whose
/// wavelength exceeds `original_context / low_freq_factor` turns `factor` times slower, one
/// whose wavelength is under `original_context / high_freq_factor` stays, and those between
/// are interpolated smoothly. Downloaded Llama 3.x weights were trained with it, so their
/// logits need it.
/// In a config (`[model.rope_scaling]`) its fields carry Hugging Face's names.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    #[serde(rename = "original_max_position_embeddings")]
    pub original_context: usize,
}

impl Rope {
    /// Plain rotary positions of base `theta`.
    pub fn new(theta: f64) -> Self {
        Rope {
            theta,
            scaling: None,
        }
    }

    /// The `head_dim / 2` inverse frequencies `θ^(−2i/head_dim)` (rounded to f32, as
    /// Hugging Face holds them), rescaled where `scaling` says.
    pub fn inverse_frequencies(&self, head_dim: usize) -> Vec<f32> {
        (0..head_dim / 2)
            .map(|i| {
                let plain = (1.0 / self.theta.powf((2 * i) as f64 / head_dim as f64)) as f32;
                match &self.scaling {
                    None => plain,
                    Some(s) => s.rescale(plain as f64) as f32,
                }
            })
            .collect()
    }
}

impl RopeScaling {
    fn rescale(&self, inverse: f64) -> f64 {
        let wavelength = 2.0 * std::f64::consts::PI / inverse;
        let context = self.original_context as f64;
        if wavelength < context / self.high_freq_factor {
            inverse
        } else if wavelength > context / self.low_freq_factor {
            inverse / self.factor
        } else {
            let smooth = (context / wavelength - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inverse / self.factor + smooth * inverse
        }
    }

    /// Why the values cannot be used, if they cannot (a zero factor, factors out of order).
    pub fn problem(&self) -> Option<String> {
        let ok = self.factor > 0.0
            && self.low_freq_factor > 0.0
            && self.high_freq_factor > self.low_freq_factor
            && self.original_context > 0;
        (!ok).then(|| {
            format!(
                "rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and \
                 original_max_position_embeddings > 0 (got factor {}, low_freq_factor {}, \
                 high_freq_factor {}, original_max_position_embeddings {})",
                self.factor, self.low_freq_factor, self.high_freq_factor, self.original_context
            )
        })
    }
}

/// The cosines and sines of every (position, frequency) pair, `[positions.len(), head_dim/2]`
/// each. Computed as Hugging Face computes them (an f32 inverse frequency times an f32
/// position, the angle's cosine rounded to f32), so that the same weights give the same logits.
pub fn rotary_tables(positions: &[usize], head_dim: usize, rope: &Rope) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let inverse = rope.inverse_frequencies(head_dim);
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for &f in &inverse {
            let angle = (p as f32 * f) as f64;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// `out = R·x` for one head: pairs `(i, i + h/2)` rotated by their angle.
fn rotate(x: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let half = cos.len();
    let (x0, x1) = x.split_at(half);
    let (o0, o1) = out.split_at_mut(half);
    for i in 0..half {
        o0[i] = x0[i] * cos[i] - x1[i] * sin[i];
        o1[i] = x1[i] * cos[i] + x0[i] * sin[i];
    }
}

/// `out = Rᵀ·y` for one head (the rotation's gradient).
fn rotate_back(y: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let half = cos.len();
    let (y0, y1) = y.split_at(half);
    let (o0, o1) = out.split_at_mut(half);
    for i in 0..half {
        o0[i] = y0[i] * cos[i] + y1[i] * sin[i];
        o1[i] = y1[i] * cos[i] - y0[i] * sin[i];
    }
}

/// Rows per parallel task: enough elements to pay for a task.
fn rows_per_task(rows: usize, width: usize) -> usize {
    (chunk_len(rows * width, PARALLEL_MIN_LEN) / width).max(1)
}

/// Rotates q and k and repeats key/value heads: `x` `[B·T, (H + 2·H_kv)·hd]` in the grouped
/// layout → `[B·T, 3·H·hd]` (`[Q | K | V]`). `cos`/`sin` are [`rotary_tables`] of the `T`
/// tokens' positions.
pub fn rotary_expand_forward(shape: RotaryShape, x: &[f32], cos: &[f32], sin: &[f32]) -> Vec<f32> {
    let (hd, g, h) = (shape.head_dim, shape.group(), shape.heads);
    let (win, wout) = (shape.input_width(), shape.output_width());
    let rows = shape.batch * shape.seq;
    assert_eq!(x.len(), rows * win, "rotary input: {shape:?}");
    let half = hd / 2;
    let mut out = crate::par::take_buffer(rows * wout);
    let task = rows_per_task(rows, wout);
    for_each_chunk_mut(&mut out, task * wout, |c, block| {
        for (k, o) in block.chunks_mut(wout).enumerate() {
            let r = c * task + k;
            let t = r % shape.seq;
            let (cos, sin) = (&cos[t * half..][..half], &sin[t * half..][..half]);
            let xr = &x[r * win..][..win];
            let (oq, okv) = o.split_at_mut(h * hd);
            let (ok, ov) = okv.split_at_mut(h * hd);
            for j in 0..shape.kv_heads {
                let group = &xr[j * (g + 2) * hd..][..(g + 2) * hd];
                let (q, kv) = group.split_at(g * hd);
                let (k_in, v_in) = kv.split_at(hd);
                let first = j * g;
                for m in 0..g {
                    rotate(
                        &q[m * hd..][..hd],
                        cos,
                        sin,
                        &mut oq[(first + m) * hd..][..hd],
                    );
                }
                rotate(k_in, cos, sin, &mut ok[first * hd..][..hd]);
                for m in 1..g {
                    ok.copy_within(first * hd..(first + 1) * hd, (first + m) * hd);
                }
                for m in 0..g {
                    ov[(first + m) * hd..][..hd].copy_from_slice(v_in);
                }
            }
        }
    });
    out
}

/// The gradient of [`rotary_expand_forward`]: `dy` `[B·T, 3·H·hd]` → `[B·T, (H + 2·H_kv)·hd]`
/// (query gradients rotated back; each key/value head's gradient summed over the query heads
/// of its group, keys then rotated back).
pub fn rotary_expand_backward(
    shape: RotaryShape,
    dy: &[f32],
    cos: &[f32],
    sin: &[f32],
) -> Vec<f32> {
    let (hd, g, h) = (shape.head_dim, shape.group(), shape.heads);
    let (win, wout) = (shape.input_width(), shape.output_width());
    let rows = shape.batch * shape.seq;
    assert_eq!(dy.len(), rows * wout, "rotary gradient: {shape:?}");
    let half = hd / 2;
    let mut dx = crate::par::take_buffer(rows * win);
    let task = rows_per_task(rows, win);
    for_each_chunk_mut(&mut dx, task * win, |c, block| {
        let mut sum = vec![0.0f32; hd];
        for (k, d) in block.chunks_mut(win).enumerate() {
            let r = c * task + k;
            let t = r % shape.seq;
            let (cos, sin) = (&cos[t * half..][..half], &sin[t * half..][..half]);
            let yr = &dy[r * wout..][..wout];
            let (dq, dkv) = yr.split_at(h * hd);
            let (dk, dv) = dkv.split_at(h * hd);
            for j in 0..shape.kv_heads {
                let group = &mut d[j * (g + 2) * hd..][..(g + 2) * hd];
                let (q, kv) = group.split_at_mut(g * hd);
                let (k_out, v_out) = kv.split_at_mut(hd);
                let first = j * g;
                for m in 0..g {
                    rotate_back(
                        &dq[(first + m) * hd..][..hd],
                        cos,
                        sin,
                        &mut q[m * hd..][..hd],
                    );
                }
                sum.copy_from_slice(&dk[first * hd..][..hd]);
                for m in 1..g {
                    let more = &dk[(first + m) * hd..][..hd];
                    sum.iter_mut().zip(more).for_each(|(s, v)| *s += v);
                }
                rotate_back(&sum, cos, sin, k_out);
                v_out.copy_from_slice(&dv[first * hd..][..hd]);
                for m in 1..g {
                    let more = &dv[(first + m) * hd..][..hd];
                    v_out.iter_mut().zip(more).for_each(|(s, v)| *s += v);
                }
            }
        }
    });
    dx
}

/// The query and key heads of grouped q/k/v rows (`x`, `[rows, (H + 2·H_kv)·hd]`), each
/// head a row of `hd` values: `[rows·H, hd]` of queries and `[rows·H_kv, hd]` of keys, in row
/// then head order (Qwen3's per-head norms of q and k run on these).
pub fn gather_qk(shape: RotaryShape, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (hd, g, kv) = (shape.head_dim, shape.group(), shape.kv_heads);
    let rows = x.len() / shape.input_width();
    let mut q = Vec::with_capacity(rows * shape.heads * hd);
    let mut k = Vec::with_capacity(rows * kv * hd);
    for xr in x.chunks(shape.input_width()) {
        for group in xr.chunks(hd * (g + 2)) {
            q.extend_from_slice(&group[..g * hd]);
            k.extend_from_slice(&group[g * hd..][..hd]);
        }
    }
    (q, k)
}

/// Writes query and key heads (as [`gather_qk`] lays them out) back into grouped q/k/v rows
/// `x`, whose value heads stay as they are.
pub fn scatter_qk(shape: RotaryShape, q: &[f32], k: &[f32], x: &mut [f32]) {
    let (hd, g) = (shape.head_dim, shape.group());
    let (mut qs, mut ks) = (q.chunks(g * hd), k.chunks(hd));
    for xr in x.chunks_mut(shape.input_width()) {
        for group in xr.chunks_mut(hd * (g + 2)) {
            group[..g * hd].copy_from_slice(qs.next().expect("query heads"));
            group[g * hd..][..hd].copy_from_slice(ks.next().expect("key heads"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// The rotation in f64 from its definition: a complex multiplication of the pair
    /// `(x_i, x_{i+h/2})` by `e^{i·p·θ^(−2i/hd)}`.
    fn rotate_f64(x: &[f32], p: usize, theta: f64) -> Vec<f64> {
        let (hd, half) = (x.len(), x.len() / 2);
        let mut out = vec![0.0; hd];
        for i in 0..half {
            let angle = p as f64 * theta.powf(-((2 * i) as f64) / hd as f64);
            let (re, im) = (x[i] as f64, x[i + half] as f64);
            out[i] = re * angle.cos() - im * angle.sin();
            out[i + half] = re * angle.sin() + im * angle.cos();
        }
        out
    }

    #[test]
    fn forward_rotates_and_repeats_by_group() {
        let shape = RotaryShape {
            batch: 2,
            seq: 5,
            heads: 6,
            kv_heads: 2,
            head_dim: 8,
        };
        let mut rng = SplitMix64::new(7);
        let x: Vec<f32> = (0..shape.batch * shape.seq * shape.input_width())
            .map(|_| rng.normal())
            .collect();
        let positions: Vec<usize> = (0..shape.seq).map(|t| 3 * t + 1).collect();
        let (cos, sin) = rotary_tables(&positions, 8, &Rope::new(10000.0));
        let y = rotary_expand_forward(shape, &x, &cos, &sin);
        let (hd, g) = (8, 3);
        for r in 0..shape.batch * shape.seq {
            let p = positions[r % shape.seq];
            let xr = &x[r * shape.input_width()..][..shape.input_width()];
            let yr = &y[r * shape.output_width()..][..shape.output_width()];
            for head in 0..shape.heads {
                let j = head / g;
                let base = j * (g + 2) * hd;
                let q = &xr[base + (head % g) * hd..][..hd];
                let k = &xr[base + g * hd..][..hd];
                let v = &xr[base + (g + 1) * hd..][..hd];
                let want = [rotate_f64(q, p, 1e4), rotate_f64(k, p, 1e4)];
                for (part, want) in want.iter().enumerate() {
                    let got = &yr[(part * shape.heads + head) * hd..][..hd];
                    for (a, b) in got.iter().zip(want) {
                        assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
                    }
                }
                assert_eq!(&yr[(2 * shape.heads + head) * hd..][..hd], v);
            }
        }
    }

    /// ⟨backward(dy), x⟩ = ⟨dy, forward(x)⟩: the backward is the forward's transpose.
    #[test]
    fn backward_is_the_transpose() {
        let shape = RotaryShape {
            batch: 1,
            seq: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 6,
        };
        let mut rng = SplitMix64::new(11);
        let n_in = shape.seq * shape.input_width();
        let n_out = shape.seq * shape.output_width();
        let x: Vec<f32> = (0..n_in).map(|_| rng.normal()).collect();
        let dy: Vec<f32> = (0..n_out).map(|_| rng.normal()).collect();
        let (cos, sin) = rotary_tables(&[0, 1, 2, 3], 6, &Rope::new(500.0));
        let y = rotary_expand_forward(shape, &x, &cos, &sin);
        let dx = rotary_expand_backward(shape, &dy, &cos, &sin);
        let dot = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
        };
        let (lhs, rhs) = (dot(&dx, &x), dot(&dy, &y));
        assert!(
            (lhs - rhs).abs() < 1e-4 * lhs.abs().max(1.0),
            "{lhs} vs {rhs}"
        );
    }

    /// Llama 3.1's rescaling, frequency by frequency against its definition: the short
    /// wavelengths kept, the long ones `factor` times slower, those between interpolated.
    #[test]
    fn llama3_scaling_keeps_short_stretches_long_and_blends_between() {
        let scaling = RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 64,
        };
        let plain = Rope::new(10_000.0).inverse_frequencies(8);
        let scaled = Rope {
            theta: 10_000.0,
            scaling: Some(scaling),
        }
        .inverse_frequencies(8);
        // Wavelengths 2π/f: 6.3 (< 64/4: kept), 62.8 (between 16 and 64), 628 and 6283
        // (> 64: divided by 8).
        assert_eq!(scaled[0], plain[0]);
        let f = plain[1] as f64;
        let smooth = (64.0 / (2.0 * std::f64::consts::PI / f) - 1.0) / 3.0;
        let blended = (1.0 - smooth) * f / 8.0 + smooth * f;
        assert!(
            (scaled[1] as f64 - blended).abs() < 1e-9 * f.max(1.0),
            "{scaled:?}"
        );
        assert!(scaled[1] < plain[1] && scaled[1] > plain[1] / 8.0);
        for i in 2..4 {
            assert_eq!(scaled[i], (plain[i] as f64 / 8.0) as f32);
        }
        assert!(scaling.problem().is_none());
        let bad = RopeScaling {
            high_freq_factor: 0.5,
            ..scaling
        };
        assert!(bad
            .problem()
            .unwrap()
            .contains("low_freq_factor < high_freq_factor"));
    }

    /// The q and k heads gathered from grouped rows go back to their places; the value
    /// heads stay.
    #[test]
    fn query_and_key_heads_gather_and_scatter_in_place() {
        let shape = RotaryShape {
            batch: 1,
            seq: 3,
            heads: 4,
            kv_heads: 2,
            head_dim: 2,
        };
        let x: Vec<f32> = (0..3 * shape.input_width()).map(|i| i as f32).collect();
        let (q, k) = gather_qk(shape, &x);
        assert_eq!((q.len(), k.len()), (3 * 4 * 2, 3 * 2 * 2));
        // Row 0, group 1 (values 8..16): query heads 8..12, key head 12..14, value 14..16.
        assert_eq!(&q[4..8], &[8.0, 9.0, 10.0, 11.0]);
        assert_eq!(&k[2..4], &[12.0, 13.0]);
        let mut y = x.clone();
        scatter_qk(shape, &vec![-1.0; q.len()], &vec![-2.0; k.len()], &mut y);
        for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
            let within = i % 8;
            let want = match within {
                0..=3 => -1.0,
                4..=5 => -2.0,
                _ => a,
            };
            assert_eq!(b, want, "value {i}");
        }
    }
}
