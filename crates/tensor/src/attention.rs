//! Causal multi-head self-attention straight from a fused QKV activation.
//!
//! `qkv` is `[B, T, 3·D]` (q, k, v side by side, each head a contiguous `D/H` slice). Strided
//! matrix views read each head in place, so no head-split copies are made; work is spread over
//! the batch (each sample's output rows are contiguous and owned by one thread).

use crate::activation::fast_exp;
use crate::matmul::{gemm_serial, Mat, MatMut};

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

/// Forward; returns (out `[B, T, D]`, probabilities `[B, H, T, T]` kept for backward).
pub fn causal_attention_forward(s: AttentionShape, qkv: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (t, d, hd) = (s.seq, s.dim, s.head_dim());
    assert_eq!(qkv.len(), s.batch * t * 3 * d);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; s.batch * t * d];
    let mut probs = vec![0.0f32; s.batch * s.heads * t * t];
    let sample = |b: usize, ob: &mut [f32], pb: &mut [f32]| {
        let q = &qkv[b * t * 3 * d..][..t * 3 * d];
        for h in 0..s.heads {
            let p = &mut pb[h * t * t..][..t * t];
            let qh = Mat::strided(&q[h * hd..], t, hd, 3 * d, 1);
            let kh = Mat::strided(&q[d + h * hd..], t, hd, 3 * d, 1);
            gemm_serial(MatMut::new(p, t, t), qh, kh.t(), false);
            for (i, row) in p.chunks_mut(t).enumerate() {
                let valid = &mut row[..=i];
                let max = valid.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let mut sum = 0.0;
                for v in valid.iter_mut() {
                    *v = fast_exp((*v - max) * scale);
                    sum += *v;
                }
                let inv = 1.0 / sum;
                valid.iter_mut().for_each(|v| *v *= inv);
                row[i + 1..].fill(0.0);
            }
            let vh = Mat::strided(&q[2 * d + h * hd..], t, hd, 3 * d, 1);
            gemm_serial(
                MatMut::strided(&mut ob[h * hd..], t, hd, d, 1),
                Mat::new(p, t, t),
                vh,
                false,
            );
        }
    };
    crate::par::for_each_chunk_pair_mut(&mut out, t * d, &mut probs, s.heads * t * t, sample);
    (out, probs)
}

/// Backward; returns dqkv `[B, T, 3·D]`.
pub fn causal_attention_backward(
    s: AttentionShape,
    qkv: &[f32],
    probs: &[f32],
    dout: &[f32],
) -> Vec<f32> {
    let (t, d, hd) = (s.seq, s.dim, s.head_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    let mut dqkv = vec![0.0f32; qkv.len()];
    let sample = |b: usize, dq: &mut [f32]| {
        let q = &qkv[b * t * 3 * d..][..t * 3 * d];
        let dob = &dout[b * t * d..][..t * d];
        let mut dp = vec![0.0f32; t * t];
        for h in 0..s.heads {
            let p = &probs[(b * s.heads + h) * t * t..][..t * t];
            let doh = Mat::strided(&dob[h * hd..], t, hd, d, 1);
            // dV = Pᵀ · dO
            gemm_serial(
                MatMut::strided(&mut dq[2 * d + h * hd..], t, hd, 3 * d, 1),
                Mat::new(p, t, t).t(),
                doh,
                false,
            );
            // dP = dO · Vᵀ
            let vh = Mat::strided(&q[2 * d + h * hd..], t, hd, 3 * d, 1);
            gemm_serial(MatMut::new(&mut dp, t, t), doh, vh.t(), false);
            // dS = P ⊙ (dP − rowsum(dP ⊙ P)) · scale  (zero above the diagonal since P is)
            for i in 0..t {
                let (pr, dr) = (&p[i * t..][..t], &mut dp[i * t..][..t]);
                let dot: f32 = pr[..=i].iter().zip(&dr[..=i]).map(|(a, b)| a * b).sum();
                for j in 0..=i {
                    dr[j] = pr[j] * (dr[j] - dot) * scale;
                }
                dr[i + 1..].fill(0.0);
            }
            let qh = Mat::strided(&q[h * hd..], t, hd, 3 * d, 1);
            let kh = Mat::strided(&q[d + h * hd..], t, hd, 3 * d, 1);
            // dQ = dS · K ; dK = dSᵀ · Q
            gemm_serial(
                MatMut::strided(&mut dq[h * hd..], t, hd, 3 * d, 1),
                Mat::new(&dp, t, t),
                kh,
                false,
            );
            gemm_serial(
                MatMut::strided(&mut dq[d + h * hd..], t, hd, 3 * d, 1),
                Mat::new(&dp, t, t).t(),
                qh,
                false,
            );
        }
    };
    crate::par::for_each_chunk_mut(&mut dqkv, t * 3 * d, sample);
    dqkv
}
