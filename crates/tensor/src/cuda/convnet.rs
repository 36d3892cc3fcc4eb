//! The convolutional nets' device operations (LeNet, ResNet-18) over CNHW activations
//! (`[C, N, H, W]`, the layout of meshtrain's convolutional layers on both devices): each the
//! twin of a CPU kernel of `conv`, `norm` or `pool`, checked against it by [`super::check`].
//!
//! A convolution is one cuBLASLt product over the whole batch, `W[O, C·k·k] ×
//! cols[C·k·k, N·OH·OW]`, whose result is the CNHW output as it is (the CPU does the same
//! with `gemm`). `im2col` builds the columns; the backward rebuilds them from the kept input
//! rather than keeping them (k² times the input: 9x for ResNet's 3×3 layers), and `col2im`
//! turns the columns' gradient into the input's. A 1×1, stride-1 unpadded convolution reads
//! its input as the columns.
//!
//! Dtypes follow the linear layers': the products read `precision` inputs (the input rounded
//! once, the weight's compute copy) and write `precision` outputs; weight and bias gradients
//! accumulate in f32. Batch norm and pooling keep their input's dtype, with f32 statistics
//! and double sums (the CPU's `norm::channel_sums` are double).

use super::blas::{F32Math, Gemm};
use super::context::{Args, CudaDevice, DevBuf, Launch};
use super::error::CudaError;
use super::ops::{check_len, suffix, to_dtype, unsupported, weight_in, MAX_BLOCKS, THREADS};
use super::{CudaTensor, DeviceGrads, DeviceParams};
use crate::conv::{ConvGeometry, Spatial};
use crate::pool::PoolGeometry;
use crate::DType;
use std::sync::Arc;

fn grid_stride(n: usize) -> Launch {
    Launch::grid_stride(n, THREADS, MAX_BLOCKS)
}

/// Every count a kernel takes as an `int` must fit one.
fn check_int(what: &str, v: usize) -> Result<(), CudaError> {
    if v > i32::MAX as usize {
        return Err(unsupported(format!(
            "{what} is {v}, more than the kernels' 32-bit counts take"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Convolution.

/// One convolution over a CNHW batch: its geometry and the input's spatial size.
#[derive(Clone, Copy, Debug)]
pub struct ConvShape {
    pub geom: ConvGeometry,
    pub input: Spatial,
}

impl ConvShape {
    /// `(OH, OW)`.
    pub fn output_size(&self) -> (usize, usize) {
        self.geom.output_size(self.input.height, self.input.width)
    }

    /// Output positions over the batch, `N·OH·OW`: the columns of every product.
    pub fn positions(&self) -> usize {
        let (oh, ow) = self.output_size();
        self.input.batch * oh * ow
    }

    pub fn input_len(&self) -> usize {
        self.geom.in_channels * self.input.batch * self.input.height * self.input.width
    }

    pub fn output_len(&self) -> usize {
        self.geom.out_channels * self.positions()
    }

    /// Elements of the column matrix `[C·k·k, N·OH·OW]`.
    pub fn columns_len(&self) -> usize {
        self.geom.patch_len() * self.positions()
    }

    /// A 1×1, stride-1, unpadded convolution: the input is its own column matrix.
    pub fn input_is_columns(&self) -> bool {
        let g = &self.geom;
        g.kernel == 1 && g.stride == 1 && g.padding == 0
    }

    /// Refuses what no kernel can run: empty dimensions, a window larger than the padded
    /// image, counts past 32 bits.
    pub fn check(&self) -> Result<(), CudaError> {
        let g = &self.geom;
        let s = &self.input;
        if [
            g.in_channels,
            g.out_channels,
            g.kernel,
            g.stride,
            s.batch,
            s.height,
            s.width,
        ]
        .contains(&0)
        {
            return Err(unsupported(format!(
                "a convolution with an empty dimension: {self:?}"
            )));
        }
        if s.height + 2 * g.padding < g.kernel || s.width + 2 * g.padding < g.kernel {
            return Err(unsupported(format!(
                "a {k}×{k} convolution over a {}×{} input padded by {}: the window is larger \
                 than the image",
                s.height,
                s.width,
                g.padding,
                k = g.kernel
            )));
        }
        check_int(
            "a convolution's output positions (batch × height × width)",
            self.positions(),
        )?;
        check_int("a convolution's patch length", g.patch_len())
    }

    fn dims(&self) -> Args {
        let (oh, ow) = self.output_size();
        let g = &self.geom;
        Args::new()
            .usize_as_i32(g.in_channels)
            .usize_as_i32(self.input.batch)
            .usize_as_i32(self.input.height)
            .usize_as_i32(self.input.width)
            .usize_as_i32(g.kernel)
            .usize_as_i32(g.stride)
            .usize_as_i32(g.padding)
            .usize_as_i32(oh)
            .usize_as_i32(ow)
    }
}

/// A convolution's three products as cuBLASLt's column-major descriptions. Row-major `X`
/// (`r × c`) is column-major `Xᵀ` over the same memory, so with `P = N·OH·OW` and
/// `K = C·k·k`: `Y[O, P] = W[O, K]·cols[K, P]` is `Yᵀ = colsᵀ·Wᵀ`; `dW[O, K] += dY·colsᵀ` is
/// `dWᵀ += cols·dYᵀ` (the columns' memory read transposed); `dcols[K, P] = Wᵀ·dY` is
/// `dcolsᵀ = dYᵀ·W` (W's memory read transposed). No operand is copied.
#[derive(Clone, Copy, Debug)]
pub struct ConvProducts {
    pub shape: ConvShape,
    /// The inputs' dtype (and the outputs' of the forward and column-gradient products).
    pub precision: DType,
    pub math: F32Math,
}

impl ConvProducts {
    fn base(&self, m: usize, n: usize, k: usize) -> Gemm {
        Gemm::plain(m, n, k, self.precision, self.math)
    }

    /// `y = W·cols`.
    pub fn forward(&self, cols: u64, w: u64, y: u64) -> Gemm {
        let (p, k) = (self.shape.positions(), self.shape.geom.patch_len());
        Gemm {
            a: cols,
            lda: p,
            b: w,
            ldb: k,
            d: y,
            ldd: p,
            ..self.base(p, self.shape.geom.out_channels, k)
        }
    }

    /// `dW += dy·colsᵀ`, accumulated in f32.
    pub fn weight_grad(&self, cols: u64, dy: u64, dw: u64) -> Gemm {
        let (p, k) = (self.shape.positions(), self.shape.geom.patch_len());
        Gemm {
            transa: true,
            a: cols,
            lda: p,
            b: dy,
            ldb: p,
            d: dw,
            ldd: k,
            output: DType::F32,
            accumulate: true,
            ..self.base(k, self.shape.geom.out_channels, p)
        }
    }

    /// `dcols = Wᵀ·dy`.
    pub fn input_grad(&self, dy: u64, w: u64, dcols: u64) -> Gemm {
        let (p, k) = (self.shape.positions(), self.shape.geom.patch_len());
        Gemm {
            transb: true,
            a: dy,
            lda: p,
            b: w,
            ldb: k,
            d: dcols,
            ldd: p,
            ..self.base(p, k, self.shape.geom.out_channels)
        }
    }
}

/// The column matrix of `x` (in `x`'s dtype): `x` itself for a pointwise convolution.
fn columns(x: &CudaTensor, shape: &ConvShape) -> Result<CudaTensor, CudaError> {
    if shape.input_is_columns() {
        return Ok(x.clone());
    }
    let dev = x.device();
    let cols = CudaTensor::alloc(
        dev,
        shape.columns_len(),
        x.dtype(),
        "a convolution's columns",
    )?;
    dev.launch(
        "conv.cu",
        &format!("im2col_{}", suffix(x.dtype())),
        grid_stride(cols.len()),
        Args::new()
            .ptr(x.ptr())
            .ptr(cols.ptr())
            .append(shape.dims()),
    )?;
    Ok(cols)
}

/// A convolution layer's settings besides its shape.
#[derive(Clone, Copy, Debug)]
pub struct ConvLayer {
    pub shape: ConvShape,
    /// Whether the parameters hold a bias after the weight.
    pub bias: bool,
    pub precision: DType,
    pub math: F32Math,
}

impl ConvLayer {
    fn products(&self) -> ConvProducts {
        ConvProducts {
            shape: self.shape,
            precision: self.precision,
            math: self.math,
        }
    }

    fn weight_len(&self) -> usize {
        self.shape.geom.out_channels * self.shape.geom.patch_len()
    }

    fn check_params(&self, len: usize) -> Result<(), CudaError> {
        let want = self.weight_len()
            + if self.bias {
                self.shape.geom.out_channels
            } else {
                0
            };
        if len != want {
            return Err(unsupported(format!(
                "a convolution's parameters: expected {want} values, the layer has {len}"
            )));
        }
        Ok(())
    }

    /// The input as the products read it (rounded to `precision` once): what the layer
    /// keeps for backward.
    pub fn product_input(&self, x: &CudaTensor) -> Result<CudaTensor, CudaError> {
        self.shape.check()?;
        check_len(x, self.shape.input_len(), "a convolution's input")?;
        to_dtype(x, self.precision)
    }

    /// `y = W ⊛ x (+ b)`, CNHW `[O, N, OH, OW]` in `precision`; `x` as
    /// [`ConvLayer::product_input`] returns it.
    pub fn forward(&self, x: &CudaTensor, p: DeviceParams) -> Result<CudaTensor, CudaError> {
        self.check_params(p.len())?;
        let x = self.product_input(x)?;
        let dev = x.device().clone();
        let nw = self.weight_len();
        let cols = columns(&x, &self.shape)?;
        let y = CudaTensor::alloc(
            &dev,
            self.shape.output_len(),
            self.precision,
            "a convolution's output",
        )?;
        let w = weight_in(&p.slice(0..nw), self.precision, "convolution weight")?;
        dev.with_blas(|blas| blas.gemm(&self.products().forward(cols.ptr(), w, y.ptr())))?;
        drop(cols);
        if self.bias {
            let b = weight_in(&p.slice(nw..p.len()), self.precision, "convolution bias")?;
            dev.launch(
                "conv.cu",
                &format!("channel_bias_add_{}", suffix(self.precision)),
                grid_stride(y.len()),
                Args::new()
                    .ptr(y.ptr())
                    .ptr(b)
                    .i64(self.shape.positions() as i64)
                    .i64(y.len() as i64),
            )?;
        }
        Ok(y)
    }

    /// Backward: `dW += dy·colsᵀ`, `db += Σ dy` per channel (into `grads`, weight then bias,
    /// f32) and, if `need_dx`, the input gradient in `precision`. `x` is the kept input.
    pub fn backward(
        &self,
        x: &CudaTensor,
        dy: &CudaTensor,
        p: DeviceParams,
        grads: DeviceGrads,
        need_dx: bool,
    ) -> Result<Option<CudaTensor>, CudaError> {
        self.check_params(p.len())?;
        check_len(
            dy,
            self.shape.output_len(),
            "a convolution's output gradient",
        )?;
        let x = self.product_input(x)?;
        let dy = to_dtype(dy, self.precision)?;
        let dev = x.device().clone();
        let nw = self.weight_len();
        let (gw, gb) = grads.split_at(nw);
        let products = self.products();
        let cols = columns(&x, &self.shape)?;
        dev.with_blas(|blas| blas.gemm(&products.weight_grad(cols.ptr(), dy.ptr(), gw.ptr())))?;
        drop(cols);
        if self.bias {
            let sums = channel_sums(&dy, None, self.shape.geom.out_channels)?;
            param_grads(&dev, &sums, None, gb.ptr(), self.shape.geom.out_channels)?;
        }
        if !need_dx {
            return Ok(None);
        }
        let w = weight_in(&p.slice(0..nw), self.precision, "convolution weight")?;
        let pointwise = self.shape.input_is_columns();
        let dcols = CudaTensor::alloc(
            &dev,
            self.shape.columns_len(),
            self.precision,
            if pointwise {
                "a convolution's input gradient"
            } else {
                "a convolution's column gradient"
            },
        )?;
        dev.with_blas(|blas| blas.gemm(&products.input_grad(dy.ptr(), w, dcols.ptr())))?;
        if pointwise {
            return Ok(Some(dcols));
        }
        let dx = CudaTensor::alloc(
            &dev,
            self.shape.input_len(),
            self.precision,
            "a convolution's input gradient",
        )?;
        dev.launch(
            "conv.cu",
            &format!("col2im_{}", suffix(self.precision)),
            grid_stride(dx.len()),
            Args::new()
                .ptr(dcols.ptr())
                .ptr(dx.ptr())
                .append(self.shape.dims()),
        )?;
        Ok(Some(dx))
    }
}

// ---------------------------------------------------------------------------------------
// Per-channel sums.

/// Values of a channel per block of `channel_partials`: the parts follow from the shape
/// alone, so the order of additions, and the bits, are the same on every GPU. 8192 values
/// (32 per thread) keep a block's memory traffic well above its launch cost; ResNet-18's
/// stem at batch 256 on 28×28 images (50,176 values per channel) gets 7 blocks per channel.
const CHANNEL_SPAN: usize = 8192;
/// The most parts a channel is cut into.
const CHANNEL_PARTS_MAX: usize = 256;

/// How many blocks sum one channel of `plane` values.
pub fn channel_parts(plane: usize) -> usize {
    plane.div_ceil(CHANNEL_SPAN).clamp(1, CHANNEL_PARTS_MAX)
}

/// Per-channel pairs of sums in double on the device, `[channels][2]`.
pub struct ChannelSums {
    buf: DevBuf,
    channels: usize,
}

impl ChannelSums {
    pub fn ptr(&self) -> u64 {
        self.buf.ptr()
    }

    pub fn channels(&self) -> usize {
        self.channels
    }

    /// The sums on the host, `[s₀, t₀, s₁, t₁, …]` (the host waits).
    pub fn to_host(&self) -> Result<Vec<f64>, CudaError> {
        self.buf.device().download(self.ptr(), self.channels * 2)
    }
}

/// Per-channel `(Σa, Σa²)` (or `(Σa, Σa·b)` with `b`) of a channel-major `a` in double, in a
/// fixed order.
pub fn channel_sums(
    a: &CudaTensor,
    b: Option<&CudaTensor>,
    channels: usize,
) -> Result<ChannelSums, CudaError> {
    if channels == 0 || !a.len().is_multiple_of(channels) {
        return Err(unsupported(format!(
            "per-channel sums of {} values over {channels} channels",
            a.len()
        )));
    }
    if let Some(b) = b {
        check_len(b, a.len(), "per-channel products' second operand")?;
        if b.dtype() != a.dtype() {
            return Err(unsupported(format!(
                "per-channel products of {} and {} values",
                a.dtype(),
                b.dtype()
            )));
        }
    }
    check_int("a batch norm's channels", channels)?;
    let dev = a.device();
    let plane = a.len() / channels;
    let parts = channel_parts(plane);
    let partial = dev.alloc(channels * parts * 16, "per-channel partial sums")?;
    let sums = dev.alloc(channels * 16, "per-channel sums")?;
    dev.launch(
        "conv.cu",
        &format!("channel_partials_{}", suffix(a.dtype())),
        Launch {
            grid: (channels as u32, parts as u32, 1),
            block: (THREADS, 1, 1),
            smem: 0,
        },
        Args::new()
            .ptr(a.ptr())
            .ptr(b.map_or(0, |b| b.ptr()))
            .ptr(partial.ptr())
            .usize_as_i32(parts)
            .i64(plane as i64),
    )?;
    dev.launch(
        "conv.cu",
        "channel_finish",
        grid_stride(channels),
        Args::new()
            .ptr(partial.ptr())
            .ptr(sums.ptr())
            .usize_as_i32(channels)
            .usize_as_i32(parts),
    )?;
    Ok(ChannelSums {
        buf: sums,
        channels,
    })
}

/// `dgamma += f32(Σdy·x̂)` (when given), `dbeta += f32(Σdy)` from [`channel_sums`].
fn param_grads(
    dev: &CudaDevice,
    sums: &ChannelSums,
    dgamma: Option<u64>,
    dbeta: u64,
    channels: usize,
) -> Result<(), CudaError> {
    dev.launch(
        "conv.cu",
        "bn_param_grads",
        grid_stride(channels),
        Args::new()
            .ptr(sums.ptr())
            .ptr(dgamma.unwrap_or(0))
            .ptr(dbeta)
            .usize_as_i32(channels),
    )
}

// ---------------------------------------------------------------------------------------
// Batch norm.

/// Batch norm over a channel-major tensor: its channels, `eps`, and what the forward
/// computed (the batch's statistics, `[mean[C] | var[C]]` in f32).
#[derive(Clone, Copy, Debug)]
pub struct BatchNorm {
    pub channels: usize,
    pub eps: f32,
}

/// A training forward's statistics: `[mean[C] | var[C]]` (f32) and the values they cover
/// (all data-parallel workers' under SyncBatchNorm).
pub struct BatchStats {
    pub stats: CudaTensor,
    pub count: usize,
}

/// Per-channel sums brought to the host and back, so that a reducer (SyncBatchNorm's
/// all-reduce over host f64 vectors) can add them up over workers. `reduce` may append
/// values of its own (the count) as long as it takes them off again.
pub fn sums_through_host(
    sums: ChannelSums,
    reduce: impl FnOnce(&mut Vec<f64>),
) -> Result<ChannelSums, CudaError> {
    let channels = sums.channels;
    let mut host = sums.to_host()?;
    reduce(&mut host);
    if host.len() != channels * 2 {
        return Err(unsupported(format!(
            "a reduction of {} per-channel sums returned {}",
            channels * 2,
            host.len()
        )));
    }
    sums.buf.device().upload_to(sums.ptr(), &host)?;
    Ok(sums)
}

impl BatchNorm {
    fn check_sums(&self, sums: &ChannelSums) -> Result<(), CudaError> {
        if sums.channels != self.channels {
            return Err(unsupported(format!(
                "batch norm over {} channels given sums of {}",
                self.channels, sums.channels
            )));
        }
        Ok(())
    }

    fn check(&self, x: &CudaTensor, params: usize) -> Result<usize, CudaError> {
        let c = self.channels;
        if c == 0 || !x.len().is_multiple_of(c) {
            return Err(unsupported(format!(
                "batch norm over {c} channels of a tensor of {} values",
                x.len()
            )));
        }
        if params != 2 * c {
            return Err(unsupported(format!(
                "batch norm's parameters: expected {} values (weight, bias), the layer has {params}",
                2 * c
            )));
        }
        Ok(x.len() / c)
    }

    /// The batch's `(Σx, Σx²)` per channel (double, on the device): what SyncBatchNorm
    /// adds up over workers before [`BatchNorm::moments`].
    pub fn sums(&self, x: &CudaTensor) -> Result<ChannelSums, CudaError> {
        channel_sums(x, None, self.channels)
    }

    /// Mean and biased variance from the sums over `count` values; with `running` (the
    /// layer's buffers, `[running_mean | running_var]`) their update with `momentum`.
    pub fn moments(
        &self,
        dev: &Arc<CudaDevice>,
        sums: &ChannelSums,
        count: usize,
        running: Option<DeviceGrads>,
        momentum: f32,
    ) -> Result<BatchStats, CudaError> {
        self.check_sums(sums)?;
        let c = self.channels;
        if let Some(r) = &running {
            if r.len() != 2 * c {
                return Err(unsupported(format!(
                    "batch norm's running statistics: expected {} values, the layer has {}",
                    2 * c,
                    r.len()
                )));
            }
        }
        let stats = CudaTensor::alloc(dev, 2 * c, DType::F32, "batch statistics")?;
        let args = Args::new()
            .ptr(sums.ptr())
            .ptr(stats.ptr())
            .ptr(running.map_or(0, |r| r.ptr()))
            .usize_as_i32(c)
            .f64(count as f64)
            .f32(momentum);
        dev.launch("conv.cu", "bn_moments", grid_stride(c), args)?;
        Ok(BatchStats { stats, count })
    }

    /// `y = γ·x̂ + β`, `x̂ = (x − mean)/√(var + eps)` with `stats = [mean | var]` (a
    /// training batch's, or the running buffers' in evaluation); returns `(y, x̂)`, x̂ only
    /// when `keep`. Both in `x`'s dtype.
    pub fn apply(
        &self,
        x: &CudaTensor,
        stats: u64,
        p: DeviceParams,
        keep: bool,
    ) -> Result<(CudaTensor, Option<CudaTensor>), CudaError> {
        // (`stats` is a pointer: the callers hold its 2·C values, a training batch's
        // [`BatchStats`] or the layer's running buffers, whose length the layer checks.)
        let plane = self.check(x, p.len())?;
        let dev = x.device();
        let y = CudaTensor::alloc(dev, x.len(), x.dtype(), "a batch norm's output")?;
        let xhat = if keep {
            Some(CudaTensor::alloc(
                dev,
                x.len(),
                x.dtype(),
                "a batch norm's normalised input",
            )?)
        } else {
            None
        };
        let c = self.channels;
        dev.launch(
            "conv.cu",
            &format!("bn_apply_{}", suffix(x.dtype())),
            grid_stride(x.len()),
            Args::new()
                .ptr(x.ptr())
                .ptr(stats)
                .ptr(p.master())
                .ptr(p.master() + (c * 4) as u64)
                .ptr(y.ptr())
                .ptr(xhat.as_ref().map_or(0, |t| t.ptr()))
                .usize_as_i32(c)
                .i64(plane as i64)
                .f32(self.eps),
        )?;
        Ok((y, xhat))
    }

    /// The backward's local `(Σdy, Σdy·x̂)` per channel; adds them to the parameter
    /// gradients (local: data parallelism averages gradients afterwards) and returns them
    /// for [`BatchNorm::input_grad`] (SyncBatchNorm first adds them up over workers).
    pub fn grad_sums(
        &self,
        dy: &CudaTensor,
        xhat: &CudaTensor,
        grads: DeviceGrads,
    ) -> Result<ChannelSums, CudaError> {
        let c = self.channels;
        if grads.len() != 2 * c {
            return Err(unsupported(format!(
                "batch norm's gradients: expected {} values, the layer has {}",
                2 * c,
                grads.len()
            )));
        }
        let dy = to_dtype(dy, xhat.dtype())?;
        let sums = channel_sums(&dy, Some(xhat), c)?;
        let (dgamma, dbeta) = grads.split_at(c);
        param_grads(dy.device(), &sums, Some(dgamma.ptr()), dbeta.ptr(), c)?;
        Ok(sums)
    }

    /// `dx = γ·rstd·(dy − Σdy/count − x̂·Σ(dy·x̂)/count)` in x̂'s dtype.
    pub fn input_grad(
        &self,
        dy: &CudaTensor,
        xhat: &CudaTensor,
        stats: &BatchStats,
        p: DeviceParams,
        sums: &ChannelSums,
    ) -> Result<CudaTensor, CudaError> {
        let plane = self.check(xhat, p.len())?;
        self.check_sums(sums)?;
        check_len(&stats.stats, 2 * self.channels, "batch statistics")?;
        check_len(dy, xhat.len(), "a batch norm's output gradient")?;
        let dy = to_dtype(dy, xhat.dtype())?;
        let dev = xhat.device();
        let c = self.channels;
        let dx = CudaTensor::alloc(
            dev,
            xhat.len(),
            xhat.dtype(),
            "a batch norm's input gradient",
        )?;
        dev.launch(
            "conv.cu",
            &format!("bn_input_grad_{}", suffix(xhat.dtype())),
            grid_stride(dx.len()),
            Args::new()
                .ptr(dy.ptr())
                .ptr(xhat.ptr())
                .ptr(stats.stats.ptr() + (c * 4) as u64)
                .ptr(p.master())
                .ptr(sums.ptr())
                .ptr(dx.ptr())
                .usize_as_i32(c)
                .i64(plane as i64)
                .f64(stats.count as f64)
                .f32(self.eps),
        )?;
        Ok(dx)
    }
}

// ---------------------------------------------------------------------------------------
// Pooling and layout changes.

/// Pooling over `planes` planes of `height × width` (C·N of them in CNHW).
#[derive(Clone, Copy, Debug)]
pub struct PoolShape {
    pub geom: PoolGeometry,
    pub planes: usize,
    pub height: usize,
    pub width: usize,
}

impl PoolShape {
    fn check(&self, x_len: usize, average: bool) -> Result<(), CudaError> {
        let g = &self.geom;
        if g.kernel == 0
            || g.stride == 0
            || self.height + 2 * g.padding < g.kernel
            || self.width + 2 * g.padding < g.kernel
        {
            return Err(unsupported(format!(
                "pooling {self:?}: the window does not fit"
            )));
        }
        if average && g.padding != 0 {
            return Err(unsupported("average pooling with padding".into()));
        }
        // PyTorch's rule: a window never sees only padding (its output would be -inf, and
        // which input its gradient goes to undefined).
        if 2 * g.padding > g.kernel {
            return Err(unsupported(format!(
                "pooling with padding {} over a {}-wide window: the padding must be at most half \
                 the window",
                g.padding, g.kernel
            )));
        }
        if x_len != self.planes * self.height * self.width {
            return Err(unsupported(format!(
                "pooling {self:?} over a tensor of {x_len} values"
            )));
        }
        check_int("a pooled plane's size", self.height * self.width)
    }

    pub fn output_len(&self) -> usize {
        let (oh, ow) = self.geom.output_size(self.height, self.width);
        self.planes * oh * ow
    }

    fn args(&self) -> Args {
        let (oh, ow) = self.geom.output_size(self.height, self.width);
        Args::new()
            .i64(self.planes as i64)
            .usize_as_i32(self.height)
            .usize_as_i32(self.width)
            .usize_as_i32(oh)
            .usize_as_i32(ow)
            .usize_as_i32(self.geom.kernel)
            .usize_as_i32(self.geom.stride)
            .usize_as_i32(self.geom.padding)
    }
}

/// Max pooling: the output and, with `keep`, each output's winner (its index in the plane:
/// int32 values in a 4-byte device tensor, the device tensor having no integer dtype).
pub fn max_pool_forward(
    x: &CudaTensor,
    shape: PoolShape,
    keep: bool,
) -> Result<(CudaTensor, Option<CudaTensor>), CudaError> {
    shape.check(x.len(), false)?;
    let dev = x.device();
    let y = CudaTensor::alloc(dev, shape.output_len(), x.dtype(), "max pooling's output")?;
    let winners = if keep {
        Some(CudaTensor::alloc(
            dev,
            y.len(),
            DType::F32,
            "max pooling's winners",
        )?)
    } else {
        None
    };
    dev.launch(
        "conv.cu",
        &format!("maxpool_fwd_{}", suffix(x.dtype())),
        grid_stride(y.len()),
        Args::new()
            .ptr(x.ptr())
            .ptr(y.ptr())
            .ptr(winners.as_ref().map_or(0, |w| w.ptr()))
            .append(shape.args()),
    )?;
    Ok((y, winners))
}

/// Max pooling's input gradient (in `dy`'s dtype) from the forward's winners.
pub fn max_pool_backward(
    dy: &CudaTensor,
    winners: &CudaTensor,
    shape: PoolShape,
) -> Result<CudaTensor, CudaError> {
    shape.check(shape.planes * shape.height * shape.width, false)?;
    check_len(dy, shape.output_len(), "max pooling's output gradient")?;
    check_len(winners, shape.output_len(), "max pooling's winners")?;
    let dev = dy.device();
    let dx = CudaTensor::alloc(
        dev,
        shape.planes * shape.height * shape.width,
        dy.dtype(),
        "max pooling's input gradient",
    )?;
    dev.launch(
        "conv.cu",
        &format!("maxpool_bwd_{}", suffix(dy.dtype())),
        grid_stride(dx.len()),
        Args::new()
            .ptr(dy.ptr())
            .ptr(winners.ptr())
            .ptr(dx.ptr())
            .append(shape.args()),
    )?;
    Ok(dx)
}

/// Average pooling (no padding).
pub fn avg_pool_forward(x: &CudaTensor, shape: PoolShape) -> Result<CudaTensor, CudaError> {
    shape.check(x.len(), true)?;
    let dev = x.device();
    let y = CudaTensor::alloc(
        dev,
        shape.output_len(),
        x.dtype(),
        "average pooling's output",
    )?;
    dev.launch(
        "conv.cu",
        &format!("avgpool_fwd_{}", suffix(x.dtype())),
        grid_stride(y.len()),
        Args::new().ptr(x.ptr()).ptr(y.ptr()).append(shape.args()),
    )?;
    Ok(y)
}

/// Average pooling's input gradient.
pub fn avg_pool_backward(dy: &CudaTensor, shape: PoolShape) -> Result<CudaTensor, CudaError> {
    shape.check(shape.planes * shape.height * shape.width, true)?;
    check_len(dy, shape.output_len(), "average pooling's output gradient")?;
    let dev = dy.device();
    let dx = CudaTensor::alloc(
        dev,
        shape.planes * shape.height * shape.width,
        dy.dtype(),
        "average pooling's input gradient",
    )?;
    dev.launch(
        "conv.cu",
        &format!("avgpool_bwd_{}", suffix(dy.dtype())),
        grid_stride(dx.len()),
        Args::new().ptr(dy.ptr()).ptr(dx.ptr()).append(shape.args()),
    )?;
    Ok(dx)
}

/// `[A, B, P] → [B, A, P]`: NCHW ↔ CNHW, and CNHW → `[N, C·H·W]` (PyTorch's flatten order).
pub fn swap_leading_axes(
    x: &CudaTensor,
    a: usize,
    b: usize,
    rest: usize,
) -> Result<CudaTensor, CudaError> {
    check_len(x, a * b * rest, "a transposed tensor")?;
    check_int("a transposed axis", a.max(b))?;
    let dev = x.device();
    let y = CudaTensor::alloc(dev, x.len(), x.dtype(), "a transposed tensor")?;
    dev.launch(
        "conv.cu",
        &format!("swap_axes_{}", suffix(x.dtype())),
        grid_stride(y.len()),
        Args::new()
            .ptr(x.ptr())
            .ptr(y.ptr())
            .usize_as_i32(a)
            .usize_as_i32(b)
            .i64(rest as i64),
    )?;
    Ok(y)
}

/// Global average pooling of CNHW `[C, N, plane]` into `[N, C]`.
pub fn global_average_forward(
    x: &CudaTensor,
    channels: usize,
    batch: usize,
    plane: usize,
) -> Result<CudaTensor, CudaError> {
    check_len(
        x,
        channels * batch * plane,
        "global average pooling's input",
    )?;
    check_int("a pooled plane's size", plane)?;
    check_int("the channels", channels)?;
    check_int("the batch", batch)?;
    let dev = x.device();
    let y = CudaTensor::alloc(
        dev,
        channels * batch,
        x.dtype(),
        "global average pooling's output",
    )?;
    dev.launch(
        "conv.cu",
        &format!("global_avg_fwd_{}", suffix(x.dtype())),
        grid_stride(y.len()),
        Args::new()
            .ptr(x.ptr())
            .ptr(y.ptr())
            .usize_as_i32(channels)
            .usize_as_i32(batch)
            .usize_as_i32(plane),
    )?;
    Ok(y)
}

/// Global average pooling's input gradient, `[C, N, plane]` from `[N, C]`.
pub fn global_average_backward(
    dy: &CudaTensor,
    channels: usize,
    batch: usize,
    plane: usize,
) -> Result<CudaTensor, CudaError> {
    check_len(
        dy,
        channels * batch,
        "global average pooling's output gradient",
    )?;
    check_int("a pooled plane's size", plane)?;
    check_int("the channels", channels)?;
    check_int("the batch", batch)?;
    let dev = dy.device();
    let dx = CudaTensor::alloc(
        dev,
        channels * batch * plane,
        dy.dtype(),
        "global average pooling's input gradient",
    )?;
    dev.launch(
        "conv.cu",
        &format!("global_avg_bwd_{}", suffix(dy.dtype())),
        grid_stride(dx.len()),
        Args::new()
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .usize_as_i32(channels)
            .usize_as_i32(batch)
            .usize_as_i32(plane),
    )?;
    Ok(dx)
}

#[cfg(test)]
mod tests {
    use super::super::blas::run_on_host;
    use super::*;
    use crate::conv::{conv2d_backward, conv2d_forward};
    use crate::rng::SplitMix64;

    /// Every (column-matrix index, input index) pair of `im2col` as `conv.cu` defines it:
    /// column row `(c·k + ky)·k + kx`, column `(n·OH + oy)·OW + ox`, reading the input at
    /// `(c, n, oy·s + ky − p, ox·s + kx − p)` where that is inside the image.
    fn for_each_tap(s: &ConvShape, mut f: impl FnMut(usize, usize)) {
        let g = &s.geom;
        let (oh, ow) = s.output_size();
        let (n, h, w, k) = (s.input.batch, s.input.height, s.input.width, g.kernel);
        for c in 0..g.in_channels {
            for (ky, kx) in (0..k).flat_map(|ky| (0..k).map(move |kx| (ky, kx))) {
                let row = (c * k + ky) * k + kx;
                for (ni, oy, ox) in (0..n)
                    .flat_map(|ni| (0..oh).flat_map(move |oy| (0..ow).map(move |ox| (ni, oy, ox))))
                {
                    let iy = (oy * g.stride + ky) as isize - g.padding as isize;
                    let ix = (ox * g.stride + kx) as isize - g.padding as isize;
                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                        continue;
                    }
                    f(
                        row * s.positions() + (ni * oh + oy) * ow + ox,
                        ((c * n + ni) * h + iy as usize) * w + ix as usize,
                    );
                }
            }
        }
    }

    /// `im2col` on the host.
    fn columns_on_host(x: &[f32], s: &ConvShape) -> Vec<f32> {
        let mut cols = vec![0.0; s.columns_len()];
        for_each_tap(s, |col, input| cols[col] = x[input]);
        cols
    }

    /// `col2im`: the adjoint of [`columns_on_host`].
    fn image_on_host(dcols: &[f32], s: &ConvShape) -> Vec<f32> {
        let mut dx = vec![0.0; s.input_len()];
        for_each_tap(s, |col, input| dx[input] += dcols[col]);
        dx
    }

    fn rel(got: &[f32], want: &[f32]) -> f64 {
        crate::cuda::check::rel_l2(got, want)
    }

    /// The three products' descriptions, evaluated as cuBLAS would, give the CPU
    /// convolution's output, weight gradient and (through col2im) input gradient.
    #[test]
    fn the_products_descriptions_are_the_cpu_convolution() {
        let mut rng = SplitMix64::new(7);
        let shapes = [
            (3, 8, 3, 1, 1, 2, 6, 5),
            (4, 5, 3, 2, 1, 3, 7, 8),
            (2, 4, 1, 2, 0, 2, 5, 5),
            (3, 2, 1, 1, 0, 2, 3, 4),
            (1, 6, 5, 1, 2, 2, 8, 8),
        ];
        for (i, o, k, st, p, n, h, w) in shapes {
            let shape = ConvShape {
                geom: ConvGeometry {
                    in_channels: i,
                    out_channels: o,
                    kernel: k,
                    stride: st,
                    padding: p,
                },
                input: Spatial {
                    batch: n,
                    height: h,
                    width: w,
                },
            };
            shape.check().expect("a valid shape");
            let g = shape.geom;
            let nw = g.out_channels * g.patch_len();
            let x: Vec<f32> = (0..shape.input_len()).map(|_| rng.normal()).collect();
            let wt: Vec<f32> = (0..nw).map(|_| 0.3 * rng.normal()).collect();
            let dy: Vec<f32> = (0..shape.output_len()).map(|_| rng.normal()).collect();
            let (y_cpu, _) = conv2d_forward(&g, shape.input, &x, &wt, None, false, DType::F32);
            let mut dw_cpu = vec![0.5f32; nw];
            let dx_cpu = conv2d_backward(
                &g,
                shape.input,
                &x,
                None,
                &wt,
                &dy,
                &mut dw_cpu,
                None,
                true,
                DType::F32,
            )
            .expect("dx");

            let products = ConvProducts {
                shape,
                precision: DType::F32,
                math: F32Math::Exact,
            };
            let cols = if shape.input_is_columns() {
                x.clone()
            } else {
                columns_on_host(&x, &shape)
            };
            let addr = |v: &[f32]| v.as_ptr() as u64;
            let mut y = vec![f32::NAN; shape.output_len()];
            run_on_host(&products.forward(addr(&cols), addr(&wt), y.as_mut_ptr() as u64));
            let mut dw = vec![0.5f32; nw];
            run_on_host(&products.weight_grad(addr(&cols), addr(&dy), dw.as_mut_ptr() as u64));
            let mut dcols = vec![f32::NAN; shape.columns_len()];
            run_on_host(&products.input_grad(addr(&dy), addr(&wt), dcols.as_mut_ptr() as u64));
            let dx = if shape.input_is_columns() {
                dcols
            } else {
                image_on_host(&dcols, &shape)
            };
            let what = format!("{shape:?}");
            assert!(
                rel(&y, &y_cpu) < 1e-5,
                "forward {what}: {}",
                rel(&y, &y_cpu)
            );
            assert!(
                rel(&dw, &dw_cpu) < 1e-5,
                "weight grad {what}: {}",
                rel(&dw, &dw_cpu)
            );
            assert!(
                rel(&dx, &dx_cpu) < 1e-5,
                "input grad {what}: {}",
                rel(&dx, &dx_cpu)
            );
        }
    }

    #[test]
    fn shapes_no_kernel_can_run_are_refused_by_name() {
        let shape = |kernel, padding, height| ConvShape {
            geom: ConvGeometry {
                in_channels: 2,
                out_channels: 3,
                kernel,
                stride: 1,
                padding,
            },
            input: Spatial {
                batch: 1,
                height,
                width: 8,
            },
        };
        assert!(shape(3, 1, 8).check().is_ok());
        let e = shape(5, 0, 3).check().unwrap_err().to_string();
        assert!(e.contains("larger than the image"), "{e}");
        assert!(shape(5, 1, 3).check().is_ok(), "3 + 2 ≥ 5 fits");
        let e = shape(0, 0, 3).check().unwrap_err().to_string();
        assert!(e.contains("empty dimension"), "{e}");
        let huge = ConvShape {
            input: Spatial {
                batch: 1 << 20,
                height: 64,
                width: 64,
            },
            ..shape(3, 1, 8)
        };
        let e = huge.check().unwrap_err().to_string();
        assert!(e.contains("32-bit"), "{e}");
    }

    #[test]
    fn a_channel_is_cut_into_parts_by_its_size_alone() {
        assert_eq!(channel_parts(1), 1);
        assert_eq!(channel_parts(CHANNEL_SPAN), 1);
        assert_eq!(channel_parts(CHANNEL_SPAN + 1), 2);
        // ResNet-18's stem at batch 256 on 28×28: 256·14·14 values per channel.
        assert_eq!(channel_parts(256 * 14 * 14), 7);
        assert_eq!(channel_parts(usize::MAX / 2), CHANNEL_PARTS_MAX);
    }
}
