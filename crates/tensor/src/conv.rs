//! 2-D convolution on CNHW activations as matrix products.
//!
//! With activations laid out `[C, N, H, W]`, `im2col` writes a `[C·kh·kw, N·OH·OW]` matrix and
//! the convolution is `W[O, C·kh·kw] × cols`, whose `[O, N·OH·OW]` result is already the CNHW
//! output. Products over the whole batch keep `gemm` efficient even where the spatial size is
//! 1×1 (ResNet's last stage), which per-sample products would turn into rank-1 updates.
//! Padded convolutions are split into [`TapClass`]es, output positions that share the same
//! in-image taps, so no product multiplies padding.

use crate::matmul::{gemm_in, gemm_pair_in, Mat, MatMut};
use crate::DType;
use std::ops::Range;

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
    /// Whether a training forward returns state for backward (the im2col columns of tap
    /// classes); direct and pointwise convolutions keep none.
    pub fn keeps_columns(&self) -> bool {
        !self.prefers_direct() && !self.is_pointwise()
    }

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

/// A rectangle of output positions whose windows all overlap the image on the same rectangle
/// of kernel taps; their other taps read padding.
///
/// Small images make padding most of the work: at 1×1 (ResNet's last stage on 28×28 input) a
/// padded 3×3 convolution has one useful tap in nine, at 2×2 four in nine. Splitting the
/// outputs into such classes and giving each its own product over its useful taps only skips
/// the multiplications by zero (about half of ResNet-18's arithmetic at 28×28) and shrinks the
/// column matrices by as much.
#[derive(Clone, Debug, PartialEq, Eq)]
struct TapClass {
    oy: Range<usize>,
    ox: Range<usize>,
    ky: Range<usize>,
    kx: Range<usize>,
}

impl TapClass {
    fn taps(&self) -> usize {
        self.ky.len() * self.kx.len()
    }

    fn positions(&self) -> usize {
        self.oy.len() * self.ox.len()
    }

    /// Rows of this class's column matrix: `(c, ky, kx)` over its taps.
    fn patch_len(&self, g: &ConvGeometry) -> usize {
        g.in_channels * self.taps()
    }

    /// Elements of the class's column matrix `[C·taps, N·positions]`.
    fn columns_len(&self, g: &ConvGeometry, s: Spatial) -> usize {
        self.patch_len(g) * s.batch * self.positions()
    }

    /// Elements of the class's gathered weight matrix `[O, C·taps]`; 0 when it uses every tap
    /// (the weight itself is then its matrix).
    fn weight_len(&self, g: &ConvGeometry) -> usize {
        if self.taps() < g.kernel * g.kernel {
            g.out_channels * self.patch_len(g)
        } else {
            0
        }
    }

    /// Offset inside a weight row `[C, k, k]` of each row of the class's column matrix.
    fn weight_offsets(&self, g: &ConvGeometry) -> Vec<usize> {
        let k = g.kernel;
        let mut v = Vec::with_capacity(self.patch_len(g));
        for c in 0..g.in_channels {
            for ky in self.ky.clone() {
                v.extend(self.kx.clone().map(|kx| (c * k + ky) * k + kx));
            }
        }
        v
    }

    /// Offset inside an output plane `[OH, OW]` of each of the class's positions, row-major.
    fn output_offsets(&self, ow: usize) -> Vec<usize> {
        let rows = self.oy.clone();
        rows.flat_map(|oy| self.ox.clone().map(move |ox| oy * ow + ox))
            .collect()
    }

    /// For column-matrix row `r`, call `f(input, column)` once per output position of the
    /// class: sample `n`'s value is read from its channel's `[N, H, W]` block at
    /// `input + n·H·W` (inside the image by construction) and stored at `column + n·positions`
    /// of the row. The caller's loop runs over the batch with two fixed strides, which the
    /// classes of tiny images (one or two outputs per row) need to avoid a per-run overhead.
    /// Shared by [`im2col`] and its adjoint [`col2im`].
    #[inline(always)]
    fn for_each_position(
        &self,
        g: &ConvGeometry,
        s: Spatial,
        r: usize,
        mut f: impl FnMut(usize, usize),
    ) {
        let tap = r % self.taps();
        let ky = self.ky.start + tap / self.kx.len();
        let kx = self.kx.start + tap % self.kx.len();
        let mut column = 0;
        for oy in self.oy.clone() {
            let y = oy * g.stride + ky - g.padding;
            for ox in self.ox.clone() {
                f(y * s.width + ox * g.stride + kx - g.padding, column);
                column += 1;
            }
        }
    }
}

/// The taps of output `o`'s window (`kernel` wide, `stride` apart, `padding` before the
/// image) that fall inside an axis of `len` inputs: tap t reads input o·stride + t − padding,
/// inside [0, len) for t in the returned range. Shared with pooling.
pub(crate) fn window_taps(
    kernel: usize,
    stride: usize,
    padding: usize,
    o: usize,
    len: usize,
) -> Range<usize> {
    let start = o * stride;
    let lo = padding.saturating_sub(start).min(kernel);
    let hi = (len + padding).saturating_sub(start).min(kernel).max(lo);
    lo..hi
}

/// Runs of consecutive outputs along one axis whose windows read the same range of taps
/// inside an axis of `input` elements: `(outputs, taps)`.
fn tap_runs(g: &ConvGeometry, input: usize, outputs: usize) -> Vec<(Range<usize>, Range<usize>)> {
    let mut runs: Vec<(Range<usize>, Range<usize>)> = Vec::new();
    for o in 0..outputs {
        let taps = window_taps(g.kernel, g.stride, g.padding, o, input);
        match runs.last_mut() {
            Some((outs, t)) if *t == taps => outs.end = o + 1,
            _ => runs.push((o..o + 1, taps)),
        }
    }
    runs
}

/// The tap classes of a convolution on input `s`; outputs that see no image (only possible
/// when the padding reaches a whole kernel) belong to none.
fn tap_classes(g: &ConvGeometry, s: Spatial) -> Vec<TapClass> {
    let (oh, ow) = g.output_size(s.height, s.width);
    let (rows, cols) = (tap_runs(g, s.height, oh), tap_runs(g, s.width, ow));
    let mut classes = Vec::with_capacity(rows.len() * cols.len());
    for (oy, ky) in &rows {
        for (ox, kx) in &cols {
            let class = TapClass {
                oy: oy.clone(),
                ox: ox.clone(),
                ky: ky.clone(),
                kx: kx.clone(),
            };
            if class.taps() > 0 {
                classes.push(class);
            }
        }
    }
    classes
}

/// `dst[i][j] = src[i][offsets[j]]` for rows `i` of `dst` (rows `offsets.len()` long) and of
/// `src` (rows `src_row` long).
fn gather_columns(dst: &mut [f32], src: &[f32], src_row: usize, offsets: &[usize]) {
    crate::par::for_each_chunk_mut(dst, offsets.len(), |i, row| {
        let from = &src[i * src_row..][..src_row];
        row.iter_mut().zip(offsets).for_each(|(d, &o)| *d = from[o]);
    });
}

/// `dst[i][offsets[j]] = src[i][j]` (or `+=` when `accumulate`); the adjoint of
/// [`gather_columns`].
fn scatter_columns(
    dst: &mut [f32],
    dst_row: usize,
    src: &[f32],
    offsets: &[usize],
    accumulate: bool,
) {
    crate::par::for_each_chunk_mut(dst, dst_row, |i, row| {
        let from = &src[i * offsets.len()..][..offsets.len()];
        for (&o, &v) in offsets.iter().zip(from) {
            row[o] = if accumulate { row[o] + v } else { v };
        }
    });
}

/// Write class `class`'s column matrix of `x` ([C, N, H, W]) into `cols`
/// ([C·taps, N·positions]). Every element is written: the class has no padding taps.
fn im2col(g: &ConvGeometry, s: Spatial, class: &TapClass, x: &[f32], cols: &mut [f32]) {
    let channel_len = s.batch * s.height * s.width;
    assert_eq!(x.len(), g.in_channels * channel_len);
    assert_eq!(cols.len(), class.columns_len(g, s));
    let (plane, positions) = (s.height * s.width, class.positions());
    let fill_row = |r: usize, row: &mut [f32]| {
        let channel = &x[r / class.taps() * channel_len..][..channel_len];
        class.for_each_position(g, s, r, |input, column| {
            let dst = row[column..].iter_mut().step_by(positions);
            let src = channel[input..].iter().step_by(plane);
            dst.zip(src).for_each(|(d, v)| *d = *v);
        });
    };
    crate::par::for_each_chunk_mut(cols, s.batch * positions, fill_row);
}

/// Accumulate (`+=`) class `class`'s column-gradient matrix into `dx` ([C, N, H, W]); the
/// adjoint of [`im2col`]. Parallel over input channels, each of which owns its planes.
fn col2im(g: &ConvGeometry, s: Spatial, class: &TapClass, dcols: &[f32], dx: &mut [f32]) {
    let (plane, positions) = (s.height * s.width, class.positions());
    let row_len = s.batch * positions;
    let channel = |c: usize, dxc: &mut [f32]| {
        for r in c * class.taps()..(c + 1) * class.taps() {
            let row = &dcols[r * row_len..][..row_len];
            class.for_each_position(g, s, r, |input, column| {
                let dst = dxc[input..].iter_mut().step_by(plane);
                let src = row[column..].iter().step_by(positions);
                dst.zip(src).for_each(|(d, v)| *d += *v);
            });
        }
    };
    crate::par::for_each_chunk_mut(dx, s.batch * plane, channel);
}

/// What a padded convolution's backward reuses from its forward, in one buffer: every
/// class's column matrix, then the gathered weight matrix `[O, C·taps]` of every class that
/// does not use all taps (one that does multiplies the weight itself). Keeping the gathered
/// weights spares the backward a second gather of about half a ResNet-18's weights.
fn class_state(
    g: &ConvGeometry,
    s: Spatial,
    classes: &[TapClass],
    x: &[f32],
    weight: &[f32],
) -> Vec<f32> {
    let columns_len: usize = classes.iter().map(|c| c.columns_len(g, s)).sum();
    let weights_len: usize = classes.iter().map(|c| c.weight_len(g)).sum();
    let mut state = crate::par::take_buffer(columns_len + weights_len);
    let (mut columns, mut weights) = state.split_at_mut(columns_len);
    for class in classes {
        let cols;
        (cols, columns) = columns.split_at_mut(class.columns_len(g, s));
        im2col(g, s, class, x, cols);
        if class.weight_len(g) > 0 {
            let w;
            (w, weights) = weights.split_at_mut(class.weight_len(g));
            gather_columns(w, weight, g.patch_len(), &class.weight_offsets(g));
        }
    }
    state
}

/// Each class with its column matrix and weight matrix inside a [`class_state`] buffer.
fn class_parts<'a>(
    g: &'a ConvGeometry,
    s: Spatial,
    classes: &'a [TapClass],
    state: &'a [f32],
    weight: &'a [f32],
) -> impl Iterator<Item = (&'a TapClass, &'a [f32], &'a [f32])> {
    let columns_len: usize = classes.iter().map(|c| c.columns_len(g, s)).sum();
    let (mut columns, mut weights) = state.split_at(columns_len);
    classes.iter().map(move |class| {
        let cols;
        (cols, columns) = columns.split_at(class.columns_len(g, s));
        let mut w = weight;
        if class.weight_len(g) > 0 {
            (w, weights) = weights.split_at(class.weight_len(g));
        }
        (class, cols, w)
    })
}

/// Forward of a padded or strided convolution, one product per tap class, into `out`
/// (`[O, N, OH, OW]`). Returns the [`class_state`] (columns and gathered weights) when
/// `keep_columns`.
fn classes_forward(
    g: &ConvGeometry,
    s: Spatial,
    x: &[f32],
    weight: &[f32],
    out: &mut [f32],
    keep_columns: bool,
    precision: DType,
) -> Option<Vec<f32>> {
    let (oh, ow) = g.output_size(s.height, s.width);
    let classes = tap_classes(g, s);
    if classes.iter().map(TapClass::positions).sum::<usize>() < oh * ow {
        out.fill(0.0);
    }
    let state = class_state(g, s, &classes, x, weight);
    for (class, cols, w) in class_parts(g, s, &classes, &state, weight) {
        let (k, n) = (class.patch_len(g), s.batch * class.positions());
        let w = Mat::new(w, g.out_channels, k);
        let cols = Mat::new(cols, k, n);
        if class.positions() == oh * ow {
            gemm_in(
                precision,
                MatMut::new(out, g.out_channels, n),
                w,
                cols,
                false,
            );
        } else {
            crate::par::with_scratch(g.out_channels * n, |y| {
                gemm_in(precision, MatMut::new(y, g.out_channels, n), w, cols, false);
                let offsets = class.output_offsets(ow);
                scatter_columns(out, oh * ow, y, &offsets, false);
            });
        }
    }
    if keep_columns {
        Some(state)
    } else {
        crate::par::recycle(state);
        None
    }
}

/// Backward of [`classes_forward`]: accumulates `dweight`, returns `dx` when `need_dx`.
#[allow(clippy::too_many_arguments)]
fn classes_backward(
    g: &ConvGeometry,
    s: Spatial,
    x: &[f32],
    columns: Option<&[f32]>,
    weight: &[f32],
    dy: &[f32],
    dweight: &mut [f32],
    need_dx: bool,
    precision: DType,
) -> Option<Vec<f32>> {
    let (oh, ow) = g.output_size(s.height, s.width);
    let classes = tap_classes(g, s);
    let rebuilt = columns
        .is_none()
        .then(|| class_state(g, s, &classes, x, weight));
    let state = columns
        .or(rebuilt.as_deref())
        .expect("state kept or rebuilt");
    // col2im accumulates into dx, which therefore starts at zero.
    let mut dx = need_dx.then(|| vec![0.0f32; x.len()]);
    for (class, cols, w) in class_parts(g, s, &classes, state, weight) {
        let (k, n) = (class.patch_len(g), s.batch * class.positions());
        let cols = Mat::new(cols, k, n).t();
        let gathered_dy = (class.positions() < oh * ow).then(|| {
            let mut d = crate::par::take_buffer(g.out_channels * n);
            gather_columns(&mut d, dy, oh * ow, &class.output_offsets(ow));
            d
        });
        let dy_m = Mat::new(gathered_dy.as_deref().unwrap_or(dy), g.out_channels, n);
        let w_t = Mat::new(w, g.out_channels, k).t();
        // A class with every tap accumulates straight into dweight; the others go through
        // a buffer that is scattered onto their taps' columns.
        let mut dw_class =
            (class.weight_len(g) > 0).then(|| crate::par::take_buffer(g.out_channels * k));
        let weight_grad = match dw_class.as_deref_mut() {
            Some(buf) => (MatMut::new(buf, g.out_channels, k), dy_m, cols, false),
            None => (MatMut::new(dweight, g.out_channels, k), dy_m, cols, true),
        };
        match dx.as_deref_mut() {
            Some(dx) => crate::par::with_scratch(k * n, |dcols| {
                // The weight gradient and the column gradient are independent products:
                // one per thread.
                gemm_pair_in(
                    precision,
                    weight_grad,
                    (MatMut::new(dcols, k, n), w_t, dy_m, false),
                );
                col2im(g, s, class, dcols, dx);
            }),
            None => {
                let (c, a, b, acc) = weight_grad;
                gemm_in(precision, c, a, b, acc);
            }
        }
        if let Some(buf) = dw_class {
            scatter_columns(dweight, g.patch_len(), &buf, &class.weight_offsets(g), true);
            crate::par::recycle(buf);
        }
        gathered_dy.into_iter().for_each(crate::par::recycle);
    }
    rebuilt.into_iter().for_each(crate::par::recycle);
    dx
}

/// Forward: returns the CNHW output `[O, N, OH, OW]`, and when `keep_columns` the state the
/// backward reuses (the tap classes' im2col columns and gathered weights: training keeps them
/// so backward need not rebuild them; direct and pointwise convolutions keep nothing).
/// Products take their inputs in `precision` (mixed precision); the direct kernels of thin
/// convolutions ([`ConvGeometry::prefers_direct`]) are not products and stay f32.
pub fn conv2d_forward(
    g: &ConvGeometry,
    s: Spatial,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    keep_columns: bool,
    precision: DType,
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
    if g.is_pointwise() {
        gemm_in(
            precision,
            MatMut::new(&mut out, g.out_channels, cols_n),
            w,
            Mat::new(x, g.patch_len(), cols_n),
            false,
        );
    } else {
        kept = classes_forward(g, s, x, weight, &mut out, keep_columns, precision);
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
/// is the state the forward kept, if it did (rebuilt from `x` and the weight otherwise).
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
    precision: DType,
) -> Option<Vec<f32>> {
    let (oh, ow) = g.output_size(s.height, s.width);
    let cols_n = s.batch * oh * ow;
    let k = g.patch_len();
    if let Some(db) = dbias {
        // Each output channel's sum in eight f64 lanes (one serial f64 chain per channel was
        // ~4% of a LeNet step), channels in parallel; the order is fixed per channel, so the
        // bits do not depend on the pool size.
        let sums = crate::par::map_chunks(dy, cols_n, |_, row| {
            let mut lanes = [0.0f64; 8];
            let mut chunks = row.chunks_exact(8);
            for c in &mut chunks {
                lanes.iter_mut().zip(c).for_each(|(l, &v)| *l += v as f64);
            }
            let tail: f64 = chunks.remainder().iter().map(|&v| v as f64).sum();
            lanes.iter().sum::<f64>() + tail
        });
        db.iter_mut()
            .zip(sums)
            .for_each(|(b, sum)| *b += sum as f32);
    }
    if g.prefers_direct() {
        let mut dx = need_dx.then(|| crate::par::take_buffer(x.len()));
        direct_backward(g, s, x, weight, dy, dweight, dx.as_deref_mut());
        return dx;
    }
    if !g.is_pointwise() {
        return classes_backward(g, s, x, columns, weight, dy, dweight, need_dx, precision);
    }
    // Pointwise: the input is the column matrix.
    let dy_m = Mat::new(dy, g.out_channels, cols_n);
    let weight_grad = (
        MatMut::new(dweight, g.out_channels, k),
        dy_m,
        Mat::new(x, k, cols_n).t(),
        true,
    );
    if !need_dx {
        let (c, a, b, acc) = weight_grad;
        gemm_in(precision, c, a, b, acc);
        return None;
    }
    // Every element is written by the product (accumulate = false).
    let mut dx = crate::par::take_buffer(x.len());
    let w_t = Mat::new(weight, g.out_channels, k).t();
    gemm_pair_in(
        precision,
        weight_grad,
        (MatMut::new(&mut dx, k, cols_n), w_t, dy_m, false),
    );
    Some(dx)
}

/// Samples per work item of the direct convolution. Fixed (not derived from the thread count)
/// so that the weight-gradient partial sums, added in item order, give the same bits on any
/// pool size.
const DIRECT_SAMPLES_PER_ITEM: usize = 16;

/// Elements the direct kernels process per step: four AVX registers per row.
const STRIP: usize = 32;

/// `lanes[i] += Σ_k a[k·STRIP + i] · b[k·STRIP + i]` for slices whose length is a multiple
/// of [`STRIP`]: a dot product left in [`STRIP`] independent accumulators (four vector
/// dependency chains instead of one). The caller sums the lanes once after many calls: a
/// horizontal sum per call cost more than the multiply-adds of LeNet's short rows (its second
/// convolution's weight-gradient rows are 5 strips long).
#[inline(always)]
fn dot_into_lanes(a: &[f32], b: &[f32], lanes: &mut [f32; STRIP]) {
    for (x, y) in a.chunks_exact(STRIP).zip(b.chunks_exact(STRIP)) {
        for i in 0..STRIP {
            lanes[i] = x[i].mul_add(y[i], lanes[i]);
        }
    }
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
        // One set of lanes per weight, summed once per item (see `dot_into_lanes`).
        let mut dw_lanes = vec![[0.0f32; STRIP]; weight.len()];
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
                        let lanes = &mut dw_lanes[(o * c_in + c) * kk + t];
                        dot_into_lanes(&d[margin..][..l.span], src, lanes);
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
        let dw: Vec<f32> = dw_lanes.iter().map(|lanes| lanes.iter().sum()).collect();
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

    use crate::rng::normal_values as random;

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

    const GEOMETRIES: [(usize, usize, usize, usize, usize, usize); 12] = [
        // (cin, cout, kernel, stride, padding, size)
        // ResNet's small late stages: one useful tap in nine at 1×1, four at 2×2.
        (20, 24, 3, 1, 1, 1),
        (20, 24, 3, 1, 1, 2),
        (20, 24, 3, 2, 1, 2),
        (20, 24, 3, 1, 1, 4),
        // Padding as wide as the kernel: border outputs see no image at all.
        (20, 3, 1, 1, 1, 3),
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
            let got = conv2d_forward(&g, s, &x, &w, None, false, DType::F32).0;
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
            let x = random(cin * 3 * hw * hw, i as u64);
            for (j, class) in tap_classes(&g, s).iter().enumerate() {
                let len = class.patch_len(&g) * 3 * class.positions();
                let c = random(len, 50 + (i * 100 + j) as u64);
                let mut cols = vec![0.0; len];
                im2col(&g, s, class, &x, &mut cols);
                let mut back = vec![0.0; x.len()];
                col2im(&g, s, class, &c, &mut back);
                let lhs: f64 = cols.iter().zip(&c).map(|(a, b)| (a * b) as f64).sum();
                let rhs: f64 = x.iter().zip(&back).map(|(a, b)| (a * b) as f64).sum();
                assert!(
                    (lhs - rhs).abs() < 1e-3 * (1.0 + lhs.abs()),
                    "geometry {i} class {j}: {lhs} vs {rhs}"
                );
            }
        }
    }

    /// Every output position with a tap inside the image belongs to exactly one class, and
    /// each class's taps are exactly the in-image taps of each of its positions.
    #[test]
    fn tap_classes_partition_the_outputs_by_in_image_taps() {
        for (i, &(cin, cout, k, st, p, hw)) in GEOMETRIES.iter().enumerate() {
            let (g, s) = case(cin, cout, k, st, p, hw, 1);
            let (oh, ow) = g.output_size(hw, hw);
            let inside = |o: usize, t: usize| (o * st + t).checked_sub(p).is_some_and(|v| v < hw);
            let mut owner = vec![None; oh * ow];
            for (j, class) in tap_classes(&g, s).iter().enumerate() {
                for (oy, ox) in class
                    .oy
                    .clone()
                    .flat_map(|y| class.ox.clone().map(move |x| (y, x)))
                {
                    assert_eq!(
                        owner[oy * ow + ox],
                        None,
                        "geometry {i}: ({oy}, {ox}) twice"
                    );
                    owner[oy * ow + ox] = Some(j);
                    let ys: Vec<usize> = (0..k).filter(|&t| inside(oy, t)).collect();
                    let xs: Vec<usize> = (0..k).filter(|&t| inside(ox, t)).collect();
                    assert_eq!(ys, class.ky.clone().collect::<Vec<_>>(), "geometry {i}");
                    assert_eq!(xs, class.kx.clone().collect::<Vec<_>>(), "geometry {i}");
                }
            }
            for (at, o) in owner.iter().enumerate() {
                let sees_image =
                    (0..k).any(|t| inside(at / ow, t)) && (0..k).any(|t| inside(at % ow, t));
                assert_eq!(o.is_some(), sees_image, "geometry {i}: position {at}");
            }
        }
    }

    /// Backward must be the adjoint of forward, on every path (direct, pointwise, tap
    /// classes), in both the input and the weights: ⟨dy, conv(x, w)⟩ = ⟨dx, x⟩ = ⟨dw, w⟩ (no
    /// bias, so conv is bilinear). Checked with kept and with rebuilt columns.
    #[test]
    fn backward_is_the_adjoint_of_forward() {
        for (i, &(cin, cout, k, st, p, hw)) in GEOMETRIES.iter().enumerate() {
            let (g, s) = case(cin, cout, k, st, p, hw, 19);
            let (oh, ow) = g.output_size(hw, hw);
            let x = random(cin * 19 * hw * hw, i as u64);
            let w = random(cout * g.patch_len(), 10 + i as u64);
            let dy = random(cout * 19 * oh * ow, 20 + i as u64);
            let (y, kept) = conv2d_forward(&g, s, &x, &w, None, true, DType::F32);
            let inner = |a: &[f32], b: &[f32]| -> f64 {
                a.iter().zip(b).map(|(a, b)| (a * b) as f64).sum()
            };
            for columns in [kept.as_deref(), None] {
                let mut dw = vec![0.0; w.len()];
                let dx =
                    conv2d_backward(&g, s, &x, columns, &w, &dy, &mut dw, None, true, DType::F32);
                let dx = dx.expect("input gradient");
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
}
