//! Batch norm over channel-contiguous data (CNHW: channel `c` owns `x[c·M..(c+1)·M]`) and layer
//! norm over rows. Statistics accumulate in f64: a channel of ResNet's stem holds 25k values.
//!
//! Batch norm is split into "local sums" and "normalise with given statistics" so that
//! SyncBatchNorm can all-reduce the sums across data-parallel workers in between.

use crate::activation::{lane_sum, lane_sum_zip};
use crate::par::{for_each_chunk_mut, for_each_chunk_pair_mut, map_chunks, map_chunks_mut};

/// Per-channel (sum, sum of squares, count) of channel-contiguous data.
pub fn channel_sums(x: &[f32], channels: usize) -> Vec<[f64; 2]> {
    let m = x.len() / channels;
    let one = |_: usize, c: &[f32]| {
        let (mut s, mut q) = (0.0f64, 0.0f64);
        for &v in c {
            s += v as f64;
            q += (v as f64) * (v as f64);
        }
        [s, q]
    };
    map_chunks(x, m, one)
}

/// Mean and biased variance per channel from sums over `count` values.
pub fn moments_from_sums(sums: &[[f64; 2]], count: usize) -> (Vec<f32>, Vec<f32>) {
    let n = count as f64;
    sums.iter()
        .map(|[s, q]| {
            let mean = s / n;
            ((mean) as f32, ((q / n - mean * mean).max(0.0)) as f32)
        })
        .unzip()
}

/// `y = gamma·(x − mean)·rstd + beta` per channel; returns (y, xhat) where xhat is kept for
/// backward.
pub fn batch_norm_apply(
    x: &[f32],
    mean: &[f32],
    var: &[f32],
    eps: f32,
    gamma: &[f32],
    beta: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let channels = mean.len();
    let m = x.len() / channels;
    let mut y = vec![0.0f32; x.len()];
    let mut xhat = vec![0.0f32; x.len()];
    let one = |c: usize, yc: &mut [f32], hc: &mut [f32]| {
        let rstd = 1.0 / (var[c] + eps).sqrt();
        let (mu, g, b) = (mean[c], gamma[c], beta[c]);
        let xc = &x[c * m..][..m];
        for i in 0..m {
            let h = (xc[i] - mu) * rstd;
            hc[i] = h;
            yc[i] = g * h + b;
        }
    };
    for_each_chunk_pair_mut(&mut y, m, &mut xhat, m, one);
    (y, xhat)
}

/// Per-channel (Σdy, Σdy·xhat): the local part of the batch-norm backward, all-reduced across
/// workers by SyncBatchNorm.
pub fn batch_norm_grad_sums(dy: &[f32], xhat: &[f32], channels: usize) -> Vec<[f64; 2]> {
    let m = dy.len() / channels;
    (0..channels)
        .map(|c| {
            let (d, h) = (&dy[c * m..][..m], &xhat[c * m..][..m]);
            let (mut s, mut sh) = (0.0f64, 0.0f64);
            for i in 0..m {
                s += d[i] as f64;
                sh += (d[i] * h[i]) as f64;
            }
            [s, sh]
        })
        .collect()
}

/// dx of batch norm in training mode given the (possibly globally reduced) gradient sums over
/// `count` values: dx = γ·rstd·(dy − Σdy/M − xhat·Σ(dy·xhat)/M).
pub fn batch_norm_input_grad(
    dy: &[f32],
    xhat: &[f32],
    var: &[f32],
    eps: f32,
    gamma: &[f32],
    sums: &[[f64; 2]],
    count: usize,
) -> Vec<f32> {
    let channels = var.len();
    let m = dy.len() / channels;
    let mut dx = vec![0.0f32; dy.len()];
    let one = |c: usize, dxc: &mut [f32]| {
        let rstd = 1.0 / (var[c] + eps).sqrt();
        let k = gamma[c] * rstd;
        let mean_dy = (sums[c][0] / count as f64) as f32;
        let mean_dyh = (sums[c][1] / count as f64) as f32;
        let (d, h) = (&dy[c * m..][..m], &xhat[c * m..][..m]);
        for i in 0..m {
            dxc[i] = k * (d[i] - mean_dy - h[i] * mean_dyh);
        }
    };
    for_each_chunk_mut(&mut dx, m, one);
    dx
}

/// Rows per chunk in layer norm's parameter-gradient reduction. Fixed (not derived from the
/// thread count) so the summation order, and so the result, is the same on any pool size.
const LN_CHUNK_ROWS: usize = 64;

/// Layer norm over the last dimension `d`; returns (y, mean, rstd) per row.
pub fn layer_norm_forward(
    x: &[f32],
    d: usize,
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / d;
    // Every row is written below.
    let mut y = crate::par::take_buffer(x.len());
    let mut stats = vec![[0.0f32; 2]; rows];
    let one = |r: usize, yr: &mut [f32], st: &mut [[f32; 2]]| {
        let xr = &x[r * d..][..d];
        // Lane-wise sums: a plain `.sum()` is one serial chain of adds per row.
        let mean = lane_sum(xr) / d as f32;
        let var = lane_sum_zip(xr, xr, |v, _| (v - mean) * (v - mean)) / d as f32;
        let rstd = 1.0 / (var + eps).sqrt();
        for i in 0..d {
            yr[i] = (xr[i] - mean) * rstd * gamma[i] + beta[i];
        }
        st[0] = [mean, rstd];
    };
    for_each_chunk_pair_mut(&mut y, d, &mut stats, 1, one);
    let (mean, rstd) = stats.into_iter().map(|[m, r]| (m, r)).unzip();
    (y, mean, rstd)
}

/// Layer-norm backward: returns dx and accumulates dgamma/dbeta.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    x: &[f32],
    d: usize,
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) -> Vec<f32> {
    // Every row is written below.
    let mut dx = crate::par::take_buffer(x.len());
    let chunk = LN_CHUNK_ROWS * d;
    let run = |ci: usize, dxc: &mut [f32]| -> Vec<f32> {
        let mut part = vec![0.0f32; 2 * d];
        for (lr, dxr) in dxc.chunks_mut(d).enumerate() {
            let r = ci * LN_CHUNK_ROWS + lr;
            let (xr, dyr) = (&x[r * d..][..d], &dy[r * d..][..d]);
            let (mu, rs) = (mean[r], rstd[r]);
            // g = dy·γ goes through dx (overwritten below); the row sums of g and g·ĥ are
            // lane-wise, so that neither they nor the parameter-gradient loop run scalar.
            let (dgamma_part, dbeta_part) = part.split_at_mut(d);
            for i in 0..d {
                let h = (xr[i] - mu) * rs;
                dxr[i] = dyr[i] * gamma[i];
                dgamma_part[i] += dyr[i] * h;
                dbeta_part[i] += dyr[i];
            }
            let mg = lane_sum(dxr) / d as f32;
            let mgh = lane_sum_zip(dxr, xr, |g, x| g * ((x - mu) * rs)) / d as f32;
            for i in 0..d {
                let h = (xr[i] - mu) * rs;
                dxr[i] = rs * (dxr[i] - mg - h * mgh);
            }
        }
        part
    };
    let parts: Vec<Vec<f32>> = map_chunks_mut(&mut dx, chunk, run);
    for p in parts {
        for i in 0..d {
            dgamma[i] += p[i];
            dbeta[i] += p[d + i];
        }
    }
    dx
}

/// RMS norm over the last dimension `d` (Zhang & Sennrich 2019, Llama's norm):
/// `y = x / √(mean(x²) + eps) · w`. Returns (y, 1/rms per row).
pub fn rms_norm_forward(x: &[f32], d: usize, weight: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let rows = x.len() / d;
    // Every row is written below.
    let mut y = crate::par::take_buffer(x.len());
    let mut rstd = vec![0.0f32; rows];
    let one = |r: usize, yr: &mut [f32], st: &mut [f32]| {
        let xr = &x[r * d..][..d];
        let mean_square = lane_sum_zip(xr, xr, |a, b| a * b) / d as f32;
        let rs = 1.0 / (mean_square + eps).sqrt();
        for i in 0..d {
            yr[i] = xr[i] * rs * weight[i];
        }
        st[0] = rs;
    };
    for_each_chunk_pair_mut(&mut y, d, &mut rstd, 1, one);
    (y, rstd)
}

/// RMS-norm backward: returns dx and accumulates dweight. With `h = x·rs` and `g = dy·w`,
/// `dx = rs·(g − h·mean(g·h))`; the weight gradient sums `dy·h` over rows in fixed chunks (the
/// same bits on any pool size).
pub fn rms_norm_backward(
    x: &[f32],
    d: usize,
    weight: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dweight: &mut [f32],
) -> Vec<f32> {
    // Every row is written below.
    let mut dx = crate::par::take_buffer(x.len());
    let chunk = LN_CHUNK_ROWS * d;
    let run = |ci: usize, dxc: &mut [f32]| -> Vec<f32> {
        let mut part = vec![0.0f32; d];
        for (lr, dxr) in dxc.chunks_mut(d).enumerate() {
            let r = ci * LN_CHUNK_ROWS + lr;
            let (xr, dyr, rs) = (&x[r * d..][..d], &dy[r * d..][..d], rstd[r]);
            for i in 0..d {
                dxr[i] = dyr[i] * weight[i];
                part[i] += dyr[i] * xr[i] * rs;
            }
            let mgh = lane_sum_zip(dxr, xr, |g, x| g * x * rs) / d as f32;
            for i in 0..d {
                dxr[i] = rs * (dxr[i] - xr[i] * rs * mgh);
            }
        }
        part
    };
    let parts: Vec<Vec<f32>> = map_chunks_mut(&mut dx, chunk, run);
    for p in parts {
        dweight.iter_mut().zip(p).for_each(|(a, v)| *a += v);
    }
    dx
}
