//! 2-D convolution on CNHW activations as one matrix product per call.
//!
//! With activations laid out `[C, N, H, W]`, `im2col` writes a `[C·kh·kw, N·OH·OW]` matrix and
//! the convolution is `W[O, C·kh·kw] × cols`, whose `[O, N·OH·OW]` result is already the CNHW
//! output. One large product per layer keeps `gemm` efficient even where the spatial size is
//! 1×1 (ResNet's last stage), which per-sample products would turn into rank-1 updates.

use crate::matmul::{gemm, gemm_pair, Mat, MatMut};

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

    /// Convolutions with few channels (LeNet's: 1→6 and 6→16) run as direct loops: their
    /// products are too thin for `gemm` to reach speed (6 or 16 output rows), while the
    /// im2col matrix they would multiply is 25× the input (20 MB for LeNet's first layer at
    /// batch 256) and costs more memory traffic than the arithmetic itself.
    fn prefers_direct(&self) -> bool {
        self.stride == 1
            && !self.is_pointwise()
            && self.in_channels <= DIRECT_MAX_CHANNELS
            && self.out_channels <= DIRECT_MAX_CHANNELS
    }

    /// A 1×1, stride-1, unpadded convolution reads its input directly as the column matrix.
    fn is_pointwise(&self) -> bool {
        self.kernel == 1 && self.stride == 1 && self.padding == 0
    }
}

/// Largest input or output channel count that takes the direct path (see
/// [`ConvGeometry::prefers_direct`]); ResNet's 64+ channel layers stay on im2col + `gemm`.
const DIRECT_MAX_CHANNELS: usize = 16;

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
    if g.prefers_direct() {
        direct_forward(g, s, x, weight, bias, &mut out);
        return (out, kept);
    }
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
    if g.prefers_direct() {
        let mut dx = need_dx.then(|| crate::par::take_buffer(x.len()));
        direct_backward(g, s, x, weight, dy, dweight, dx.as_deref_mut());
        return dx;
    }
    let dy_m = Mat::new(dy, g.out_channels, cols_n);
    // The columns: the input itself (pointwise), the forward's, or rebuilt here.
    let rebuilt = match columns {
        _ if g.is_pointwise() => None,
        Some(_) => None,
        None => {
            let mut cols = crate::par::take_buffer(k * cols_n);
            im2col(g, s, x, &mut cols);
            Some(cols)
        }
    };
    let cols = match (&rebuilt, columns) {
        _ if g.is_pointwise() => x,
        (Some(c), _) => c.as_slice(),
        (None, Some(c)) => c,
        (None, None) => unreachable!("columns are rebuilt when not kept"),
    };
    let weight_grad = (
        MatMut::new(dweight, g.out_channels, k),
        dy_m,
        Mat::new(cols, k, cols_n).t(),
        true,
    );
    let w_t = Mat::new(weight, g.out_channels, k).t();
    let dx = if !need_dx {
        let (c, a, b, acc) = weight_grad;
        gemm(c, a, b, acc);
        None
    } else if g.is_pointwise() {
        // Every element is written by the product (accumulate = false).
        let mut dx = crate::par::take_buffer(x.len());
        gemm_pair(
            weight_grad,
            (MatMut::new(&mut dx, k, cols_n), w_t, dy_m, false),
        );
        Some(dx)
    } else {
        // col2im accumulates into dx, which therefore starts at zero.
        let mut dx = vec![0.0f32; x.len()];
        crate::par::with_scratch(k * cols_n, |dcols| {
            // The weight gradient and the column gradient are independent products of equal
            // size: one per thread.
            gemm_pair(
                weight_grad,
                (MatMut::new(dcols, k, cols_n), w_t, dy_m, false),
            );
            col2im(g, s, dcols, &mut dx);
        });
        Some(dx)
    };
    if let Some(c) = rebuilt {
        crate::par::recycle(c);
    }
    dx
}

/// Samples per work item of the direct convolution. Fixed (not derived from the thread count)
/// so that the weight-gradient partial sums, added in item order, give the same bits on any
/// pool size.
const DIRECT_SAMPLES_PER_ITEM: usize = 16;

/// Elements the direct kernels process per step: four AVX registers per row.
const STRIP: usize = 32;

/// Dot product of two slices whose length is a multiple of [`STRIP`], with [`STRIP`]
/// independent accumulators: four vector dependency chains instead of one, so the adds do not
/// wait on each other's latency.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; STRIP];
    for (x, y) in a.chunks_exact(STRIP).zip(b.chunks_exact(STRIP)) {
        for i in 0..STRIP {
            lanes[i] = x[i].mul_add(y[i], lanes[i]);
        }
    }
    lanes.iter().sum()
}

/// The direct convolution's view of one sample: each input plane copied into a zero-bordered
/// `PH × PW` buffer, and outputs kept with the padded row stride `PW`. Output element
/// `(oy, ox)` then sits at `oy·PW + ox` and reads input `oy·PW + ox + ki·PW + kj` for tap
/// `(ki, kj)`: every tap is one contiguous multiply-add over the output row (the `PW − OW`
/// columns past each row's end are computed and thrown away). Output rows are `span` long,
/// the useful length rounded up to whole [`STRIP`]s, and padded planes carry a [`STRIP`] of
/// zero slack at their end, so the kernels never need a remainder loop.
struct DirectLayout {
    pw: usize,
    /// Distance between padded input planes: `PH·PW` plus slack.
    pstride: usize,
    span: usize,
    oh: usize,
    ow: usize,
    /// Offset of each tap `(ki, kj)`, row-major over the kernel window.
    taps: Vec<usize>,
}

impl DirectLayout {
    fn new(g: &ConvGeometry, s: Spatial) -> Self {
        let (oh, ow) = g.output_size(s.height, s.width);
        let (ph, pw) = (s.height + 2 * g.padding, s.width + 2 * g.padding);
        let k = g.kernel;
        DirectLayout {
            pw,
            pstride: ph * pw + STRIP,
            span: ((oh - 1) * pw + ow).next_multiple_of(STRIP),
            oh,
            ow,
            taps: (0..k * k).map(|t| (t / k) * pw + t % k).collect(),
        }
    }

    /// Copy sample `n`'s planes of `x` ([C, N, H, W]) into the interiors of `padded`.
    fn pad_sample(&self, g: &ConvGeometry, s: Spatial, x: &[f32], n: usize, padded: &mut [f32]) {
        let hw = s.height * s.width;
        for (c, dst) in padded.chunks_mut(self.pstride).enumerate() {
            let src = &x[(c * s.batch + n) * hw..][..hw];
            for (y, row) in src.chunks(s.width).enumerate() {
                let at = (y + g.padding) * self.pw + g.padding;
                dst[at..at + s.width].copy_from_slice(row);
            }
        }
    }
}

/// Planes a direct kernel reads: `count` planes, `stride` apart, and per tap the offset of its
/// shifted view.
struct Planes<'a> {
    data: &'a [f32],
    stride: usize,
    count: usize,
    taps: &'a [usize],
}

/// `acc[o][i] = init(o) + Σ_{c, t} weight(o, c, t) · input[c][i + taps[t]]` for output rows
/// `o0..o0 + OB` and `i < span` (rows of `acc` are `span` long, `span` a multiple of
/// [`STRIP`]). The `OB × STRIP` accumulators stay in registers across all input planes and
/// taps, so each input load feeds `OB` multiply-adds and nothing is stored until the end: the
/// convolution forward (inputs = padded planes) and its input gradient (inputs = the output
/// gradient, taps mirrored) both run through here.
#[inline(always)]
fn correlate<const OB: usize>(
    input: &Planes,
    weight: impl Fn(usize, usize, usize) -> f32,
    init: impl Fn(usize) -> f32,
    o0: usize,
    span: usize,
    acc: &mut [f32],
) {
    for s0 in (0..span).step_by(STRIP) {
        let mut a = [[0.0f32; STRIP]; OB];
        for (r, row) in a.iter_mut().enumerate() {
            row.fill(init(o0 + r));
        }
        for c in 0..input.count {
            let plane = &input.data[c * input.stride..][..input.stride];
            for (t, &off) in input.taps.iter().enumerate() {
                let src = &plane[s0 + off..][..STRIP];
                for (r, row) in a.iter_mut().enumerate() {
                    let w = weight(o0 + r, c, t);
                    for i in 0..STRIP {
                        row[i] = src[i].mul_add(w, row[i]);
                    }
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            acc[(o0 + r) * span + s0..][..STRIP].copy_from_slice(row);
        }
    }
}

/// [`correlate`] for all `outputs` rows, two at a time (two rows × four registers is what
/// AVX2's sixteen registers hold next to the input loads).
fn correlate_all(
    input: &Planes,
    weight: impl Fn(usize, usize, usize) -> f32 + Copy,
    init: impl Fn(usize) -> f32 + Copy,
    outputs: usize,
    span: usize,
    acc: &mut [f32],
) {
    let mut o0 = 0;
    while o0 + 2 <= outputs {
        correlate::<2>(input, weight, init, o0, span, acc);
        o0 += 2;
    }
    if o0 < outputs {
        correlate::<1>(input, weight, init, o0, span, acc);
    }
}

/// Run `f(first_sample, samples, parts)` over items of [`DIRECT_SAMPLES_PER_ITEM`] samples,
/// where `parts[p]` is the item's slice of plane group `p` of `data` (`data` is `[P, N, inner]`,
/// CNHW with P channels): each item owns its samples in every channel, so items run in
/// parallel without sharing an output element. Results come back in item order.
fn map_sample_items<R: Send>(
    data: &mut [f32],
    batch: usize,
    inner: usize,
    f: impl Fn(usize, usize, Vec<&mut [f32]>) -> R + Sync + Send,
) -> Vec<R> {
    use rayon::prelude::*;
    let items = batch.div_ceil(DIRECT_SAMPLES_PER_ITEM);
    let mut parts: Vec<Vec<&mut [f32]>> = (0..items).map(|_| Vec::new()).collect();
    for plane in data.chunks_mut(batch * inner) {
        for (i, part) in plane
            .chunks_mut(DIRECT_SAMPLES_PER_ITEM * inner)
            .enumerate()
        {
            parts[i].push(part);
        }
    }
    let run = |(i, p): (usize, Vec<&mut [f32]>)| {
        let first = i * DIRECT_SAMPLES_PER_ITEM;
        f(first, DIRECT_SAMPLES_PER_ITEM.min(batch - first), p)
    };
    if crate::par::threads() > 1 && items > 1 {
        parts.into_par_iter().enumerate().map(run).collect()
    } else {
        parts.into_iter().enumerate().map(run).collect()
    }
}

/// Direct convolution forward (see [`DirectLayout`]) into `out` (`[O, N, OH, OW]`).
fn direct_forward(
    g: &ConvGeometry,
    s: Spatial,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let l = DirectLayout::new(g, s);
    let c_in = g.in_channels;
    map_sample_items(out, s.batch, l.oh * l.ow, |first, count, mut outs| {
        let mut padded = vec![0.0f32; c_in * l.pstride];
        let mut acc = vec![0.0f32; g.out_channels * l.span];
        let kk = l.taps.len();
        for j in 0..count {
            l.pad_sample(g, s, x, first + j, &mut padded);
            let input = Planes {
                data: &padded,
                stride: l.pstride,
                count: c_in,
                taps: &l.taps,
            };
            correlate_all(
                &input,
                |o, c, t| weight[(o * c_in + c) * kk + t],
                |o| bias.map_or(0.0, |b| b[o]),
                g.out_channels,
                l.span,
                &mut acc,
            );
            for (a, dst) in acc.chunks(l.span).zip(outs.iter_mut()) {
                let dst = &mut dst[j * l.oh * l.ow..][..l.oh * l.ow];
                for (oy, row) in dst.chunks_mut(l.ow).enumerate() {
                    row.copy_from_slice(&a[oy * l.pw..][..l.ow]);
                }
            }
        }
    });
}

/// Direct convolution backward: accumulates `dweight` and writes `dx` (`[C, N, H, W]`) when
/// given.
fn direct_backward(
    g: &ConvGeometry,
    s: Spatial,
    x: &[f32],
    weight: &[f32],
    dy: &[f32],
    dweight: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    let l = DirectLayout::new(g, s);
    let (c_in, c_out, kk) = (g.in_channels, g.out_channels, l.taps.len());
    let out_plane = l.oh * l.ow;
    let hw = s.height * s.width;
    let per_sample = |first: usize, count: usize, mut dxs: Vec<&mut [f32]>| -> Vec<f32> {
        let mut dw = vec![0.0f32; weight.len()];
        let mut padded = vec![0.0f32; c_in * l.pstride];
        // dy with the padded row stride after a zero margin of `margin` (the largest tap
        // offset); the columns past each row's end, the rounding tail and the margin stay
        // zero, so thrown-away positions contribute nothing.
        let margin = *l.taps.last().expect("a kernel has taps");
        let dx_span = (l.pstride - STRIP).next_multiple_of(STRIP);
        let dy_stride = margin + dx_span.max(l.span) + STRIP;
        let mut dys = vec![0.0f32; c_out * dy_stride];
        // The input gradient is the correlation of dy with the mirrored kernel: padded
        // position p gets dy[p − off] · w for every tap.
        let mirrored: Vec<usize> = l.taps.iter().map(|&off| margin - off).collect();
        let mut dpadded = vec![0.0f32; c_in * dx_span];
        for j in 0..count {
            let n = first + j;
            l.pad_sample(g, s, x, n, &mut padded);
            for (o, d) in dys.chunks_mut(dy_stride).enumerate() {
                let src = &dy[(o * s.batch + n) * out_plane..][..out_plane];
                for (oy, row) in src.chunks(l.ow).enumerate() {
                    d[margin + oy * l.pw..][..l.ow].copy_from_slice(row);
                }
            }
            for c in 0..c_in {
                for (t, &off) in l.taps.iter().enumerate() {
                    let src = &padded[c * l.pstride + off..][..l.span];
                    for (o, d) in dys.chunks(dy_stride).enumerate() {
                        dw[(o * c_in + c) * kk + t] += dot(&d[margin..][..l.span], src);
                    }
                }
            }
            if dxs.is_empty() {
                continue;
            }
            let grads = Planes {
                data: &dys,
                stride: dy_stride,
                count: c_out,
                taps: &mirrored,
            };
            correlate_all(
                &grads,
                |c, o, t| weight[(o * c_in + c) * kk + t],
                |_| 0.0,
                c_in,
                dx_span,
                &mut dpadded,
            );
            for (c, dst) in dxs.iter_mut().enumerate() {
                let dst = &mut dst[j * hw..][..hw];
                let src = &dpadded[c * dx_span..];
                for (y, row) in dst.chunks_mut(s.width).enumerate() {
                    row.copy_from_slice(&src[(y + g.padding) * l.pw + g.padding..][..s.width]);
                }
            }
        }
        dw
    };
    // Without an input gradient the items get no output slices (an empty `dxs`).
    let partials = map_sample_items(dx.unwrap_or(&mut []), s.batch, hw, per_sample);
    for p in partials {
        dweight.iter_mut().zip(&p).for_each(|(d, v)| *d += v);
    }
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

    const GEOMETRIES: [(usize, usize, usize, usize, usize, usize); 7] = [
        // (cin, cout, kernel, stride, padding, size)
        (3, 4, 5, 1, 2, 8),
        (3, 4, 3, 2, 1, 7),
        (3, 4, 1, 2, 0, 7),
        (2, 3, 1, 1, 0, 5),
        (1, 4, 7, 2, 3, 12),
        (2, 2, 3, 3, 2, 4),
        (6, 16, 5, 1, 0, 14),
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

    /// The direct path's backward must be the adjoint of its forward in both the input and
    /// the weights: ⟨dy, conv(x, w)⟩ = ⟨dx, x⟩ = ⟨dw, w⟩ (no bias, so conv is bilinear).
    #[test]
    fn direct_backward_is_the_adjoint_of_direct_forward() {
        for (i, &(cin, cout, k, st, p, hw)) in GEOMETRIES.iter().enumerate() {
            let (g, s) = case(cin, cout, k, st, p, hw, 19);
            if !g.prefers_direct() {
                continue;
            }
            let (oh, ow) = g.output_size(hw, hw);
            let x = random(cin * 19 * hw * hw, i as u64);
            let w = random(cout * g.patch_len(), 10 + i as u64);
            let dy = random(cout * 19 * oh * ow, 20 + i as u64);
            let y = conv2d_forward(&g, s, &x, &w, None, true).0;
            let mut dw = vec![0.0; w.len()];
            let dx = conv2d_backward(&g, s, &x, None, &w, &dy, &mut dw, None, true).unwrap();
            let inner = |a: &[f32], b: &[f32]| -> f64 {
                a.iter().zip(b).map(|(a, b)| (a * b) as f64).sum()
            };
            let (lhs, by_x, by_w) = (inner(&dy, &y), inner(&dx, &x), inner(&dw, &w));
            for (what, v) in [("dx", by_x), ("dw", by_w)] {
                assert!(
                    (lhs - v).abs() < 1e-3 * (1.0 + lhs.abs()),
                    "geometry {i} {what}: {lhs} vs {v}"
                );
            }
        }
    }
}
