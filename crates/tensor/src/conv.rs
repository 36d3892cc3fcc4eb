//! 2-D convolution on CNHW activations as one matrix product per call.
//!
//! With activations laid out `[C, N, H, W]`, `im2col` writes a `[C·kh·kw, N·OH·OW]` matrix and
//! the convolution is `W[O, C·kh·kw] × cols`, whose `[O, N·OH·OW]` result is already the CNHW
//! output. One large product per layer keeps `gemm` efficient even where the spatial size is
//! 1×1 (ResNet's last stage), which per-sample products would turn into rank-1 updates.

use crate::matmul::{gemm, Mat, MatMut};

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

/// Output columns `[lo, hi)` whose input column `ox·stride + kj − padding` lies inside the
/// image: the rest read padding. Computing the range once per row keeps the inner loops
/// branch-free (a plain copy when the stride is 1).
fn valid_columns(g: &ConvGeometry, width: usize, ow: usize, kj: usize) -> (usize, usize) {
    let (p, s) = (g.padding, g.stride);
    // first ox with ox·s + kj ≥ p
    let lo = if kj >= p { 0 } else { (p - kj).div_ceil(s) };
    // ox·s + kj − p ≤ width − 1  ⇔  ox ≤ (width − 1 + p − kj) / s
    let hi = if width + p > kj {
        ((width - 1 + p - kj) / s + 1).min(ow)
    } else {
        0
    };
    (lo.min(hi), hi)
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
                let (lo, hi) = valid_columns(g, s.width, ow, kj);
                if lo >= hi {
                    out.fill(0.0);
                    continue;
                }
                out[..lo].fill(0.0);
                out[hi..].fill(0.0);
                let first = lo * g.stride + kj - g.padding;
                if g.stride == 1 {
                    out[lo..hi].copy_from_slice(&src[first..first + (hi - lo)]);
                } else {
                    for (i, o) in out[lo..hi].iter_mut().enumerate() {
                        *o = src[first + i * g.stride];
                    }
                }
            }
        }
    };
    crate::par::for_each_chunk_mut(cols, row_len, fill_row);
}

/// Accumulate (`+=`) the column-gradient matrix into `dx` ([C, N, H, W]); the adjoint of
/// [`im2col`]. Parallel over input channels, each of which owns its output planes.
pub fn col2im(g: &ConvGeometry, s: Spatial, dcols: &[f32], dx: &mut [f32]) {
    let (oh, ow) = g.output_size(s.height, s.width);
    let row_len = s.batch * oh * ow;
    let plane_len = s.height * s.width;
    let kk = g.kernel * g.kernel;
    let channel = |c: usize, dxc: &mut [f32]| {
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
                    let (lo, hi) = valid_columns(g, s.width, ow, kj);
                    if lo >= hi {
                        continue;
                    }
                    let first = lo * g.stride + kj - g.padding;
                    if g.stride == 1 {
                        let d = &mut dst[first..first + (hi - lo)];
                        d.iter_mut().zip(&src[lo..hi]).for_each(|(d, v)| *d += v);
                    } else {
                        for (i, v) in src[lo..hi].iter().enumerate() {
                            dst[first + i * g.stride] += v;
                        }
                    }
                }
            }
        }
    };
    let per_channel = s.batch * plane_len;
    crate::par::for_each_chunk_mut(dx, per_channel, channel);
}

/// Forward: returns the CNHW output `[O, N, OH, OW]`, and the im2col columns when
/// `keep_columns` (training keeps them so backward need not rebuild them; pointwise
/// convolutions never need columns).
pub fn conv2d_forward(
    g: &ConvGeometry,
    s: Spatial,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    keep_columns: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let (oh, ow) = g.output_size(s.height, s.width);
    let cols_n = s.batch * oh * ow;
    // Every element is written by the product below (accumulate = false).
    let mut out = crate::par::take_buffer(g.out_channels * cols_n);
    let w = Mat::new(weight, g.out_channels, g.patch_len());
    let mut kept = None;
    let mut product = |cols: &[f32]| {
        gemm(
            MatMut::new(&mut out, g.out_channels, cols_n),
            w,
            Mat::new(cols, g.patch_len(), cols_n),
            false,
        )
    };
    if g.is_pointwise() {
        product(x);
    } else if keep_columns {
        let mut cols = crate::par::take_buffer(g.patch_len() * cols_n);
        im2col(g, s, x, &mut cols);
        product(&cols);
        kept = Some(cols);
    } else {
        crate::par::with_scratch(g.patch_len() * cols_n, |cols| {
            im2col(g, s, x, cols);
            product(cols);
        });
    }
    if let Some(b) = bias {
        crate::par::for_each_chunk_mut(&mut out, cols_n, |o, row| {
            let bo = b[o];
            row.iter_mut().for_each(|v| *v += bo);
        });
    }
    (out, kept)
}

/// Backward: accumulates `dweight` (and `dbias`) and returns `dx` when `need_dx`. `columns`
/// are the forward's im2col columns if it kept them (rebuilt from `x` otherwise).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    g: &ConvGeometry,
    s: Spatial,
    x: &[f32],
    columns: Option<&[f32]>,
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
    let weight_grad = |cols: &[f32], dweight: &mut [f32]| {
        gemm(
            MatMut::new(dweight, g.out_channels, k),
            dy_m,
            Mat::new(cols, k, cols_n).t(),
            true,
        )
    };
    match columns {
        _ if g.is_pointwise() => weight_grad(x, dweight),
        Some(cols) => weight_grad(cols, dweight),
        None => crate::par::with_scratch(k * cols_n, |cols| {
            im2col(g, s, x, cols);
            weight_grad(cols, dweight);
        }),
    }
    if !need_dx {
        return None;
    }
    let w_t = Mat::new(weight, g.out_channels, k).t();
    let mut dx = vec![0.0f32; x.len()];
    if g.is_pointwise() {
        gemm(MatMut::new(&mut dx, k, cols_n), w_t, dy_m, false);
        return Some(dx);
    }
    crate::par::with_scratch(k * cols_n, |dcols| {
        gemm(MatMut::new(dcols, k, cols_n), w_t, dy_m, false);
        col2im(g, s, dcols, &mut dx);
    });
    Some(dx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = SplitMix64::new(seed);
        (0..n).map(|_| r.normal()).collect()
    }

    /// Direct convolution on CNHW data, the definition the im2col path must reproduce.
    fn direct(g: &ConvGeometry, s: Spatial, x: &[f32], w: &[f32]) -> Vec<f32> {
        let (oh, ow) = g.output_size(s.height, s.width);
        let mut y = vec![0.0f32; g.out_channels * s.batch * oh * ow];
        for o in 0..g.out_channels {
            for n in 0..s.batch {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = 0.0;
                        for c in 0..g.in_channels {
                            for i in 0..g.kernel {
                                for j in 0..g.kernel {
                                    let iy = (oy * g.stride + i) as isize - g.padding as isize;
                                    let ix = (ox * g.stride + j) as isize - g.padding as isize;
                                    if iy < 0
                                        || ix < 0
                                        || iy >= s.height as isize
                                        || ix >= s.width as isize
                                    {
                                        continue;
                                    }
                                    let xv = x[((c * s.batch + n) * s.height + iy as usize)
                                        * s.width
                                        + ix as usize];
                                    acc += xv
                                        * w[((o * g.in_channels + c) * g.kernel + i) * g.kernel
                                            + j];
                                }
                            }
                        }
                        y[((o * s.batch + n) * oh + oy) * ow + ox] = acc;
                    }
                }
            }
        }
        y
    }

    const GEOMETRIES: [(usize, usize, usize, usize, usize, usize); 6] = [
        // (cin, cout, kernel, stride, padding, size)
        (3, 4, 5, 1, 2, 8),
        (3, 4, 3, 2, 1, 7),
        (3, 4, 1, 2, 0, 7),
        (2, 3, 1, 1, 0, 5),
        (1, 4, 7, 2, 3, 12),
        (2, 2, 3, 3, 2, 4),
    ];

    /// The geometry and input size of one test case.
    fn case(
        cin: usize,
        cout: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        hw: usize,
        batch: usize,
    ) -> (ConvGeometry, Spatial) {
        let g = ConvGeometry {
            in_channels: cin,
            out_channels: cout,
            kernel,
            stride,
            padding,
        };
        (
            g,
            Spatial {
                batch,
                height: hw,
                width: hw,
            },
        )
    }

    #[test]
    fn im2col_convolution_matches_direct_convolution() {
        for (i, &(cin, cout, k, st, p, hw)) in GEOMETRIES.iter().enumerate() {
            let (g, s) = case(cin, cout, k, st, p, hw, 2);
            let x = random(cin * 2 * hw * hw, i as u64);
            let w = random(cout * g.patch_len(), 100 + i as u64);
            let got = conv2d_forward(&g, s, &x, &w, None, false).0;
            let want = direct(&g, s, &x, &w);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "geometry {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn col2im_is_the_adjoint_of_im2col() {
        for (i, &(cin, cout, k, st, p, hw)) in GEOMETRIES.iter().enumerate() {
            let (g, s) = case(cin, cout, k, st, p, hw, 3);
            let (oh, ow) = g.output_size(hw, hw);
            let x = random(cin * 3 * hw * hw, i as u64);
            let c = random(g.patch_len() * 3 * oh * ow, 50 + i as u64);
            let mut cols = vec![0.0; c.len()];
            im2col(&g, s, &x, &mut cols);
            let mut back = vec![0.0; x.len()];
            col2im(&g, s, &c, &mut back);
            let lhs: f64 = cols.iter().zip(&c).map(|(a, b)| (a * b) as f64).sum();
            let rhs: f64 = x.iter().zip(&back).map(|(a, b)| (a * b) as f64).sum();
            assert!(
                (lhs - rhs).abs() < 1e-3 * (1.0 + lhs.abs()),
                "geometry {i}: {lhs} vs {rhs}"
            );
        }
    }
}
