//! Max and average pooling over the planes of an activation (each `H×W` plane pooled on its
//! own, so the same code serves NCHW and CNHW), and global average pooling.

use crate::conv::window_taps;
use crate::par::{for_each_chunk_mut, for_each_chunk_pair_mut};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolGeometry {
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl PoolGeometry {
    /// 2×2 windows with stride 2 and no padding: non-overlapping, with fast loops.
    fn is_2x2(&self) -> bool {
        self.kernel == 2 && self.stride == 2 && self.padding == 0
    }

    pub fn output_size(&self, h: usize, w: usize) -> (usize, usize) {
        (
            (h + 2 * self.padding - self.kernel) / self.stride + 1,
            (w + 2 * self.padding - self.kernel) / self.stride + 1,
        )
    }
}

/// Max pooling; returns the output and, per output element, the index of the winning input
/// element inside its plane (padding never wins, as in PyTorch).
pub fn max_pool_forward(
    g: &PoolGeometry,
    planes: usize,
    h: usize,
    w: usize,
    x: &[f32],
) -> (Vec<f32>, Vec<u32>) {
    let (oh, ow) = g.output_size(h, w);
    let mut out = vec![0.0f32; planes * oh * ow];
    let mut arg = vec![0u32; planes * oh * ow];
    let inside = |o: usize, len: usize| window_taps(g.kernel, g.stride, g.padding, o, len);
    let plane = |p: usize, o: &mut [f32], a: &mut [u32]| {
        let src = &x[p * h * w..][..h * w];
        for oy in 0..oh {
            let rows = inside(oy, h);
            for ox in 0..ow {
                let cols = inside(ox, w);
                let mut best = f32::NEG_INFINITY;
                let mut best_idx = 0u32;
                for ki in rows.clone() {
                    let row = (oy * g.stride + ki - g.padding) * w;
                    for kj in cols.clone() {
                        let idx = row + ox * g.stride + kj - g.padding;
                        let v = src[idx];
                        // Selects, not a branch: which tap wins is data-dependent, and the
                        // mispredicted branch made this ~4% of a ResNet-18 step.
                        let take = v > best || v.is_nan();
                        best = if take { v } else { best };
                        best_idx = if take { idx as u32 } else { best_idx };
                    }
                }
                o[oy * ow + ox] = best;
                a[oy * ow + ox] = best_idx;
            }
        }
    };
    for_each_chunk_pair_mut(&mut out, oh * ow, &mut arg, oh * ow, plane);
    (out, arg)
}

pub fn max_pool_backward(
    h: usize,
    w: usize,
    out_plane: usize,
    arg: &[u32],
    dy: &[f32],
) -> Vec<f32> {
    let planes = dy.len() / out_plane;
    let mut dx = vec![0.0f32; planes * h * w];
    let plane = |p: usize, d: &mut [f32]| {
        let a = &arg[p * out_plane..][..out_plane];
        let g = &dy[p * out_plane..][..out_plane];
        for (i, &idx) in a.iter().enumerate() {
            d[idx as usize] += g[i];
        }
    };
    for_each_chunk_mut(&mut dx, h * w, plane);
    dx
}

/// Average pooling without padding (all our models use padding 0 here): each output is the
/// mean of its k×k window.
pub fn avg_pool_forward(
    g: &PoolGeometry,
    planes: usize,
    h: usize,
    w: usize,
    x: &[f32],
) -> Vec<f32> {
    assert_eq!(
        g.padding, 0,
        "average pooling with padding is not supported"
    );
    let (oh, ow) = g.output_size(h, w);
    let inv = 1.0 / (g.kernel * g.kernel) as f32;
    let mut out = vec![0.0f32; planes * oh * ow];
    let plane = |p: usize, o: &mut [f32]| {
        let src = &x[p * h * w..][..h * w];
        if g.is_2x2() {
            // LeNet's pooling: a branch-free loop over row pairs that LLVM vectorises.
            for (oy, orow) in o.chunks_mut(ow).enumerate() {
                let (r0, r1) = (
                    &src[2 * oy * w..][..2 * ow],
                    &src[(2 * oy + 1) * w..][..2 * ow],
                );
                for (ox, v) in orow.iter_mut().enumerate() {
                    *v = ((r0[2 * ox] + r0[2 * ox + 1]) + (r1[2 * ox] + r1[2 * ox + 1])) * inv;
                }
            }
            return;
        }
        for oy in 0..oh {
            for ox in 0..ow {
                let mut s = 0.0;
                for ki in 0..g.kernel {
                    let row = &src[(oy * g.stride + ki) * w + ox * g.stride..][..g.kernel];
                    s += row.iter().sum::<f32>();
                }
                o[oy * ow + ox] = s * inv;
            }
        }
    };
    for_each_chunk_mut(&mut out, oh * ow, plane);
    out
}

pub fn avg_pool_backward(g: &PoolGeometry, h: usize, w: usize, dy: &[f32]) -> Vec<f32> {
    let (oh, ow) = g.output_size(h, w);
    let planes = dy.len() / (oh * ow);
    let inv = 1.0 / (g.kernel * g.kernel) as f32;
    let mut dx = vec![0.0f32; planes * h * w];
    let plane = |p: usize, d: &mut [f32]| {
        let gy = &dy[p * oh * ow..][..oh * ow];
        if g.is_2x2() {
            // Windows do not overlap: each input element gets exactly one output's share.
            for (oy, grow) in gy.chunks(ow).enumerate() {
                for r in 0..2 {
                    let drow = &mut d[(2 * oy + r) * w..][..2 * ow];
                    for (ox, &v) in grow.iter().enumerate() {
                        drow[2 * ox] = v * inv;
                        drow[2 * ox + 1] = v * inv;
                    }
                }
            }
            return;
        }
        for oy in 0..oh {
            for ox in 0..ow {
                let v = gy[oy * ow + ox] * inv;
                for ki in 0..g.kernel {
                    let row = &mut d[(oy * g.stride + ki) * w + ox * g.stride..][..g.kernel];
                    row.iter_mut().for_each(|r| *r += v);
                }
            }
        }
    };
    for_each_chunk_mut(&mut dx, h * w, plane);
    dx
}
