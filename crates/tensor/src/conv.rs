//! 2-D convolution on CNHW activations as one matrix product per call.
//!
//! With activations laid out `[C, N, H, W]`, `im2col` writes a `[C·kh·kw, N·OH·OW]` matrix and
//! the convolution is `W[O, C·kh·kw] × cols`, whose `[O, N·OH·OW]` result is already the CNHW
//! output. One large product per layer keeps `gemm` efficient even where the spatial size is
//! 1×1 (ResNet's last stage), which per-sample products would turn into rank-1 updates.

use crate::matmul::{gemm, Mat, MatMut};
use rayon::prelude::*;

/// Geometry of one convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvGeometry {
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl ConvGeometry {
    pub fn output_size(&self, h: usize, w: usize) -> (usize, usize) {
        (
            (h + 2 * self.padding - self.kernel) / self.stride + 1,
            (w + 2 * self.padding - self.kernel) / self.stride + 1,
        )
    }

    /// Rows of the im2col matrix: C·k·k.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.kernel * self.kernel
    }

    /// A 1×1, stride-1, unpadded convolution reads its input directly as the column matrix.
    fn is_pointwise(&self) -> bool {
        self.kernel == 1 && self.stride == 1 && self.padding == 0
    }
}

/// Input dimensions of a CNHW activation (C is the geometry's in_channels).
#[derive(Clone, Copy, Debug)]
pub struct Spatial {
    pub batch: usize,
    pub height: usize,
    pub width: usize,
}

fn use_parallel(work: usize) -> bool {
    crate::par::threads() > 1 && work > 32 * 1024
}

/// Write the im2col matrix of `x` ([C, N, H, W]) into `cols` ([C·k·k, N·OH·OW]).
pub fn im2col(g: &ConvGeometry, s: Spatial, x: &[f32], cols: &mut [f32]) {
    let (oh, ow) = g.output_size(s.height, s.width);
    let row_len = s.batch * oh * ow;
    assert_eq!(x.len(), g.in_channels * s.batch * s.height * s.width);
    assert_eq!(cols.len(), g.patch_len() * row_len);
    let fill_row = |r: usize, row: &mut [f32]| {
        let c = r / (g.kernel * g.kernel);
        let ki = (r / g.kernel) % g.kernel;
        let kj = r % g.kernel;
        for n in 0..s.batch {
            let plane = &x[(c * s.batch + n) * s.height * s.width..][..s.height * s.width];
            for oy in 0..oh {
                let out = &mut row[(n * oh + oy) * ow..][..ow];
                let iy = (oy * g.stride + ki) as isize - g.padding as isize;
                if iy < 0 || iy >= s.height as isize {
                    out.fill(0.0);
                    continue;
                }
                let src = &plane[iy as usize * s.width..][..s.width];
                for (ox, o) in out.iter_mut().enumerate() {
                    let ix = (ox * g.stride + kj) as isize - g.padding as isize;
                    *o = if ix >= 0 && ix < s.width as isize {
                        src[ix as usize]
                    } else {
                        0.0
                    };
                }
            }
        }
    };
    if use_parallel(cols.len()) {
        cols.par_chunks_mut(row_len)
            .enumerate()
            .for_each(|(r, row)| fill_row(r, row));
    } else {
        cols.chunks_mut(row_len)
            .enumerate()
            .for_each(|(r, row)| fill_row(r, row));
    }
}

/// Accumulate the column-gradient matrix back into `dx` ([C, N, H, W]); the adjoint of
/// [`im2col`]. Parallel over input channels, each of which owns its output planes.
pub fn col2im(g: &ConvGeometry, s: Spatial, dcols: &[f32], dx: &mut [f32]) {
    let (oh, ow) = g.output_size(s.height, s.width);
    let row_len = s.batch * oh * ow;
    let plane_len = s.height * s.width;
    let kk = g.kernel * g.kernel;
    let channel = |c: usize, dxc: &mut [f32]| {
        dxc.fill(0.0);
        for kidx in 0..kk {
            let (ki, kj) = (kidx / g.kernel, kidx % g.kernel);
            let row = &dcols[(c * kk + kidx) * row_len..][..row_len];
            for n in 0..s.batch {
                let plane = &mut dxc[n * plane_len..][..plane_len];
                for oy in 0..oh {
                    let iy = (oy * g.stride + ki) as isize - g.padding as isize;
                    if iy < 0 || iy >= s.height as isize {
                        continue;
                    }
                    let dst = &mut plane[iy as usize * s.width..][..s.width];
                    let src = &row[(n * oh + oy) * ow..][..ow];
                    for (ox, v) in src.iter().enumerate() {
                        let ix = (ox * g.stride + kj) as isize - g.padding as isize;
                        if ix >= 0 && ix < s.width as isize {
                            dst[ix as usize] += v;
                        }
                    }
                }
            }
        }
    };
    let per_channel = s.batch * plane_len;
    if use_parallel(dcols.len()) {
        dx.par_chunks_mut(per_channel)
            .enumerate()
            .for_each(|(c, d)| channel(c, d));
    } else {
        dx.chunks_mut(per_channel)
            .enumerate()
            .for_each(|(c, d)| channel(c, d));
    }
}

/// Forward: returns the CNHW output `[O, N, OH, OW]` as a flat vector.
pub fn conv2d_forward(
    g: &ConvGeometry,
    s: Spatial,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let (oh, ow) = g.output_size(s.height, s.width);
    let cols_n = s.batch * oh * ow;
    let mut out = vec![0.0f32; g.out_channels * cols_n];
    let w = Mat::new(weight, g.out_channels, g.patch_len());
    if g.is_pointwise() {
        gemm(
            MatMut::new(&mut out, g.out_channels, cols_n),
            w,
            Mat::new(x, g.in_channels, cols_n),
            false,
        );
    } else {
        let mut cols = vec![0.0f32; g.patch_len() * cols_n];
        im2col(g, s, x, &mut cols);
        gemm(
            MatMut::new(&mut out, g.out_channels, cols_n),
            w,
            Mat::new(&cols, g.patch_len(), cols_n),
            false,
        );
    }
    if let Some(b) = bias {
        crate::par::for_each_chunk_mut(&mut out, cols_n, |o, row| {
            let bo = b[o];
            row.iter_mut().for_each(|v| *v += bo);
        });
    }
    out
}

/// Backward: accumulates `dweight` (and `dbias`) and returns `dx` when `need_dx`.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    g: &ConvGeometry,
    s: Spatial,
    x: &[f32],
    weight: &[f32],
    dy: &[f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    need_dx: bool,
) -> Option<Vec<f32>> {
    let (oh, ow) = g.output_size(s.height, s.width);
    let cols_n = s.batch * oh * ow;
    let k = g.patch_len();
    if let Some(db) = dbias {
        for (o, row) in dy.chunks(cols_n).enumerate() {
            db[o] += row.iter().map(|&v| v as f64).sum::<f64>() as f32;
        }
    }
    let dy_m = Mat::new(dy, g.out_channels, cols_n);
    let owned_cols;
    let cols: &[f32] = if g.is_pointwise() {
        x
    } else {
        let mut c = vec![0.0f32; k * cols_n];
        im2col(g, s, x, &mut c);
        owned_cols = c;
        &owned_cols
    };
    gemm(
        MatMut::new(dweight, g.out_channels, k),
        dy_m,
        Mat::new(cols, k, cols_n).t(),
        true,
    );
    if !need_dx {
        return None;
    }
    let w_t = Mat::new(weight, g.out_channels, k).t();
    if g.is_pointwise() {
        let mut dx = vec![0.0f32; x.len()];
        gemm(MatMut::new(&mut dx, k, cols_n), w_t, dy_m, false);
        return Some(dx);
    }
    let mut dcols = vec![0.0f32; k * cols_n];
    gemm(MatMut::new(&mut dcols, k, cols_n), w_t, dy_m, false);
    let mut dx = vec![0.0f32; x.len()];
    col2im(g, s, &dcols, &mut dx);
    Some(dx)
}
