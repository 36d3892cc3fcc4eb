//! The operations layers run on device tensors: each checks shapes and dtypes on the host,
//! then queues its kernels (or cuBLASLt product) on the device's stream. Each is the twin of
//! a CPU kernel ([`super::check`] compares them on fresh random inputs).
//!
//! Dtypes follow the CPU's mixed-precision policy: matrix products read `precision` inputs
//! (bf16/f16 with f32 accumulation, or f32), the residual stream, norms' statistics, softmax,
//! losses and every reduction stay f32. Products write their output in `precision` (what the
//! next product reads anyway); norms read the f32 residual stream.

use super::blas::{Epilogue, F32Math, Gemm};
use super::context::{Args, CudaDevice, DevBuf, Launch};
use super::error::CudaError;
use super::{CudaTensor, DeviceGrads, DeviceParams};
use crate::rotary::RotaryShape;
use crate::DType;
use std::sync::Arc;

/// The kernel-name suffix of a dtype (`kernels/ABI.md`).
pub fn suffix(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
    }
}

/// Threads per block of the element-wise kernels, and the most blocks a grid-stride launch
/// uses (enough to fill an H100's 132 multiprocessors many times over).
pub(super) const THREADS: u32 = 256;
pub(super) const MAX_BLOCKS: usize = 132 * 32;
/// Rows summed per block in the deterministic column sums (bias and layer-norm parameter
/// gradients): fixed, so the summation order never depends on the device. 256 rows: the
/// finishing sum over the blocks is latency-bound (~15 µs over 256 partials per column on an
/// H100, 73 times a GPT-2 step at 64 rows per block).
pub const ROWS_PER_BLOCK: usize = 256;

pub(super) fn unsupported(text: String) -> CudaError {
    CudaError::Unsupported(text)
}

pub(super) fn check_len(t: &CudaTensor, len: usize, what: &str) -> Result<(), CudaError> {
    if t.len() != len {
        return Err(unsupported(format!(
            "{what}: expected {len} values, the tensor has {}",
            t.len()
        )));
    }
    Ok(())
}

fn check_dtype(t: &CudaTensor, dtype: DType, what: &str) -> Result<(), CudaError> {
    if t.dtype() != dtype {
        return Err(unsupported(format!(
            "{what}: expected {dtype:?} values, the tensor holds {:?}",
            t.dtype()
        )));
    }
    Ok(())
}

/// `x` itself where it starts on a 16-byte boundary (every allocation does), else an
/// aligned copy (a view into a larger tensor can start anywhere), for kernels that read 16
/// bytes at a time.
pub fn aligned16(x: CudaTensor) -> Result<CudaTensor, CudaError> {
    if x.ptr().is_multiple_of(16) {
        return Ok(x);
    }
    let dev = x.device();
    let copy = CudaTensor::alloc(dev, x.len(), x.dtype(), "an aligned copy")?;
    dev.copy(copy.ptr(), x.ptr(), x.len() * x.dtype().size_bytes())?;
    Ok(copy)
}

/// `x` in `dtype`: itself, or a converted copy.
pub fn to_dtype(x: &CudaTensor, dtype: DType) -> Result<CudaTensor, CudaError> {
    if x.dtype() == dtype {
        return Ok(x.clone());
    }
    let dev = x.device();
    let y = CudaTensor::alloc(dev, x.len(), dtype, "a converted tensor")?;
    convert_into(dev, x.ptr(), x.dtype(), y.ptr(), dtype, x.len())?;
    Ok(y)
}

/// Converts `n` values between f32 and a 16-bit type (one of the two is f32).
pub fn convert_into(
    dev: &CudaDevice,
    src: u64,
    from: DType,
    dst: u64,
    to: DType,
    n: usize,
) -> Result<(), CudaError> {
    let kernel = match (from, to) {
        (DType::F32, DType::BF16) => "convert_f32_bf16",
        (DType::F32, DType::F16) => "convert_f32_f16",
        (DType::BF16, DType::F32) => "convert_bf16_f32",
        (DType::F16, DType::F32) => "convert_f16_f32",
        (a, b) if a == b => return dev.copy(dst, src, n * a.size_bytes()),
        (a, b) => return Err(unsupported(format!("no conversion from {a} to {b}"))),
    };
    dev.launch(
        "elementwise.cu",
        kernel,
        Launch::grid_stride(n, THREADS, MAX_BLOCKS),
        Args::new().ptr(src).ptr(dst).i64(n as i64),
    )
}

/// The weight's address in the product's dtype.
pub(super) fn weight_in(w: &DeviceParams, precision: DType, what: &str) -> Result<u64, CudaError> {
    w.in_dtype(precision)
        .ok_or_else(|| missing_copy(what, precision))
}

fn missing_copy(what: &str, precision: DType) -> CudaError {
    unsupported(format!(
        "{what}: the parameters have no {precision} compute copy (the device store was made \
         for another precision)"
    ))
}

/// A linear layer's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearShape {
    pub rows: usize,
    pub inputs: usize,
    pub outputs: usize,
}

/// A linear layer's three products as cuBLASLt's column-major descriptions. Row-major `X`
/// (`rows × inputs`) is column-major `Xᵀ` over the same memory, so `Y = X·Wᵀ` is computed as
/// `Yᵀ = W·Xᵀ` (W's memory read transposed), `dX = dY·W` as `dXᵀ = Wᵀ·dYᵀ`, and `dW += dYᵀ·X`
/// as `dWᵀ += Xᵀ·dY` (dY's memory read transposed), with no copy of any operand.
#[derive(Clone, Copy, Debug)]
pub struct LinearProducts {
    pub shape: LinearShape,
    /// The inputs' dtype (and the outputs' of the forward and input-gradient products).
    pub precision: DType,
    pub math: F32Math,
}

impl LinearProducts {
    fn base(&self, m: usize, n: usize, k: usize) -> Gemm {
        Gemm::plain(m, n, k, self.precision, self.math)
    }

    /// `y = x·Wᵀ (+ bias)`.
    pub fn forward(&self, x: u64, w: u64, bias: Option<u64>, y: u64) -> Gemm {
        Gemm {
            epilogue: bias.map_or(Epilogue::None, Epilogue::Bias),
            ..self.forward_with(x, w, y)
        }
    }

    /// `y = GELU(x·Wᵀ (+ bias))` (tanh approximation), with the pre-activation written to
    /// `z` (`y`'s type and shape) for backward: GPT-2's first MLP layer in one product.
    pub fn forward_gelu(&self, x: u64, w: u64, bias: Option<u64>, y: u64, z: u64) -> Gemm {
        Gemm {
            epilogue: Epilogue::GeluAux { bias, aux: z },
            ..self.forward_with(x, w, y)
        }
    }

    /// The forward product, no epilogue.
    fn forward_with(&self, x: u64, w: u64, y: u64) -> Gemm {
        let LinearShape {
            rows,
            inputs,
            outputs,
        } = self.shape;
        Gemm {
            transa: true,
            a: w,
            lda: inputs,
            b: x,
            ldb: inputs,
            d: y,
            ldd: outputs,
            ..self.base(outputs, rows, inputs)
        }
    }

    /// `dx = dy·W`.
    pub fn input_grad(&self, dy: u64, w: u64, dx: u64) -> Gemm {
        let LinearShape {
            rows,
            inputs,
            outputs,
        } = self.shape;
        Gemm {
            a: w,
            lda: inputs,
            b: dy,
            ldb: outputs,
            d: dx,
            ldd: inputs,
            ..self.base(inputs, rows, outputs)
        }
    }

    /// `dz = (dy·W) × GELU′(z)`, `z` (`pre`) the previous layer's pre-activation, of `dx`'s
    /// type and shape: the input gradient taken through that layer's tanh GELU.
    pub fn input_grad_dgelu(&self, dy: u64, w: u64, dz: u64, pre: u64) -> Gemm {
        Gemm {
            epilogue: Epilogue::DGelu { aux: pre },
            ..self.input_grad(dy, w, dz)
        }
    }

    /// `dW += dyᵀ·x`, accumulated in f32.
    pub fn weight_grad(&self, x: u64, dy: u64, dw: u64) -> Gemm {
        let LinearShape {
            rows,
            inputs,
            outputs,
        } = self.shape;
        Gemm {
            transb: true,
            a: x,
            lda: inputs,
            b: dy,
            ldb: outputs,
            d: dw,
            ldd: inputs,
            output: DType::F32,
            accumulate: true,
            ..self.base(inputs, outputs, rows)
        }
    }

    /// [`LinearProducts::weight_grad`] that also writes `Σ_rows dy` (f32, `outputs` values)
    /// to `bias_grad`: the bias gradient from the product's own read of `dy` (its B).
    pub fn weight_grad_with_bias(&self, x: u64, dy: u64, dw: u64, bias_grad: u64) -> Gemm {
        Gemm {
            epilogue: Epilogue::BiasGradB(bias_grad),
            ..self.weight_grad(x, dy, dw)
        }
    }
}

/// `y = x·Wᵀ + b` with `x` `[rows, inputs]`, W `[outputs, inputs]` (PyTorch's layout), the
/// bias (if any) right after W in `p`; products in `precision`, `y` in `precision`.
pub fn linear_forward(
    x: &CudaTensor,
    p: DeviceParams,
    shape: LinearShape,
    bias: bool,
    precision: DType,
    math: F32Math,
) -> Result<CudaTensor, CudaError> {
    let f = LinearForward::new(x, p, shape, bias, precision, math)?;
    f.run_plain()?;
    Ok(f.y)
}

/// A linear layer's forward product, its operands in place: the input in the product's
/// dtype, the weight's and bias's addresses (the bias copied to an aligned block if it had
/// to be, kept until the product is queued) and the output allocated.
struct LinearForward {
    products: LinearProducts,
    x: CudaTensor,
    w: u64,
    bias: Option<u64>,
    _aligned_bias: Option<DevBuf>,
    y: CudaTensor,
}

impl LinearForward {
    fn new(
        x: &CudaTensor,
        p: DeviceParams,
        shape: LinearShape,
        bias: bool,
        precision: DType,
        math: F32Math,
    ) -> Result<Self, CudaError> {
        let LinearShape {
            rows,
            inputs,
            outputs,
        } = shape;
        check_len(x, rows * inputs, "linear layer input")?;
        let (w, b) = p.split_at(inputs * outputs);
        let dev = x.device().clone();
        let x = to_dtype(x, precision)?;
        let y = CudaTensor::alloc(&dev, rows * outputs, precision, "a linear layer's output")?;
        let (bias, aligned_bias) = epilogue_bias(&dev, bias.then_some(b), outputs, precision)?;
        Ok(LinearForward {
            products: LinearProducts {
                shape,
                precision,
                math,
            },
            x,
            w: weight_in(&w, precision, "linear weight")?,
            bias,
            _aligned_bias: aligned_bias,
            y,
        })
    }

    /// `y = x·Wᵀ (+ bias)`, queued.
    fn run_plain(&self) -> Result<(), CudaError> {
        let g = self
            .products
            .forward(self.x.ptr(), self.w, self.bias, self.y.ptr());
        self.x.device().with_blas(|blas| blas.gemm(&g))
    }
}

/// [`linear_forward`] then the activation `act`: `(y, kept)`, `kept` what the activation's
/// backward reads (the pre-activation, or `y` for sigmoid and tanh). A tanh GELU goes into
/// the product's epilogue ([`Epilogue::GeluAux`]: `y` and the pre-activation written by the
/// product, not read back by a second pass) where cuBLASLt offers it for the shape and
/// [`Fusion::Epilogues`] is on, in 16-bit precisions only: its GELU is not documented to f32's
/// accuracy, and an f32 run is held to the CPU's results to f32 rounding. Otherwise the
/// activation runs as its own pass.
pub fn linear_act_forward(
    x: &CudaTensor,
    p: DeviceParams,
    shape: LinearShape,
    bias: bool,
    precision: DType,
    math: F32Math,
    act: ActKind,
) -> Result<(CudaTensor, CudaTensor), CudaError> {
    let f = LinearForward::new(x, p, shape, bias, precision, math)?;
    if gelu_epilogue(act, precision, shape.outputs) {
        let dev = x.device();
        let z = CudaTensor::alloc(dev, f.y.len(), precision, "a linear layer's pre-activation")?;
        let g = f
            .products
            .forward_gelu(f.x.ptr(), f.w, f.bias, f.y.ptr(), z.ptr());
        if dev.with_blas(|blas| blas.try_gemm(&g))? {
            return Ok((f.y, z));
        }
    }
    f.run_plain()?;
    activation_after(f.y, act)
}

/// `act` as its own pass over a product's output `z`: `(y, kept)` as
/// [`linear_act_forward`] returns them.
pub fn activation_after(
    z: CudaTensor,
    act: ActKind,
) -> Result<(CudaTensor, CudaTensor), CudaError> {
    let y = activation_forward(&z, act)?;
    let kept = if act.backward_uses_output() {
        y.clone()
    } else {
        z
    };
    Ok((y, kept))
}

/// The bias of a product's epilogue (`outputs` values in `precision`), and the aligned copy
/// holding it when it had to be copied: cuBLASLt's bias epilogue wants an aligned vector,
/// and a bias at an odd place of the flat buffer (a user's model) is copied to an aligned
/// block first. Keep the copy until the product has been queued.
pub(super) fn epilogue_bias(
    dev: &Arc<CudaDevice>,
    bias: Option<DeviceParams>,
    outputs: usize,
    precision: DType,
) -> Result<(Option<u64>, Option<DevBuf>), CudaError> {
    let Some(b) = bias else {
        return Ok((None, None));
    };
    let ptr = weight_in(&b.slice(0..outputs), precision, "linear bias")?;
    if ptr % 16 == 0 {
        return Ok((Some(ptr), None));
    }
    let bytes = outputs * precision.size_bytes();
    let copy = dev.alloc(bytes, "an aligned bias")?;
    dev.copy(copy.ptr(), ptr, bytes)?;
    Ok((Some(copy.ptr()), Some(copy)))
}

/// Backward of [`linear_forward`]: `dW += dyᵀ·x`, `db += Σ_rows dy` (into `grads`: weight
/// then bias, f32) and, if `need_dx`, `dx = dy·W` (in `precision`). `x` is the kept input.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    x: &CudaTensor,
    dy: &CudaTensor,
    p: DeviceParams,
    grads: DeviceGrads,
    shape: LinearShape,
    bias: bool,
    precision: DType,
    math: F32Math,
    need_dx: bool,
) -> Result<Option<CudaTensor>, CudaError> {
    let products = LinearGrads {
        shape,
        bias,
        precision,
        math,
    };
    products.backward(x, dy, p, grads, need_dx, |dx| dx)
}

/// What a linear layer's backward needs besides its tensors.
#[derive(Clone, Copy, Debug)]
pub struct LinearGrads {
    pub shape: LinearShape,
    pub bias: bool,
    pub precision: DType,
    pub math: F32Math,
}

impl LinearGrads {
    /// [`linear_backward`], the input gradient first: `after_dx` gets it as soon as its
    /// product is queued, before the weight gradient's, so a caller can start a collective
    /// on it (tensor parallelism's all-reduce on the communication stream) that runs while
    /// the weight gradient is computed. Returns what `after_dx` returns.
    pub fn backward<R>(
        &self,
        x: &CudaTensor,
        dy: &CudaTensor,
        p: DeviceParams,
        grads: DeviceGrads,
        need_dx: bool,
        after_dx: impl FnOnce(Option<CudaTensor>) -> R,
    ) -> Result<R, CudaError> {
        self.backward_through(x, dy, p, grads, need_dx, None, after_dx)
    }

    /// [`LinearGrads::backward`] whose input gradient is taken on through `through`, the
    /// previous layer's activation (its kind and what its backward reads): `after_dx` gets
    /// the gradient with respect to that activation's input. A tanh GELU's goes into the
    /// product's epilogue ([`Epilogue::DGelu`]) where cuBLASLt offers it, in 16 bits, for
    /// input widths a multiple of 8, with [`Fusion::Epilogues`] on; any other is an `act_bwd` pass
    /// after the product.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_through<R>(
        &self,
        x: &CudaTensor,
        dy: &CudaTensor,
        p: DeviceParams,
        grads: DeviceGrads,
        need_dx: bool,
        through: Option<(&CudaTensor, ActKind)>,
        after_dx: impl FnOnce(Option<CudaTensor>) -> R,
    ) -> Result<R, CudaError> {
        let LinearShape {
            rows,
            inputs,
            outputs,
        } = self.shape;
        check_len(x, rows * inputs, "linear layer kept input")?;
        check_len(dy, rows * outputs, "linear layer output gradient")?;
        let dev = x.device().clone();
        let x = to_dtype(x, self.precision)?;
        let dy = to_dtype(dy, self.precision)?;
        let nw = inputs * outputs;
        let (gw, gb) = grads.split_at(nw);
        let products = LinearProducts {
            shape: self.shape,
            precision: self.precision,
            math: self.math,
        };
        let dx = if need_dx {
            let w = weight_in(&p.slice(0..nw), self.precision, "linear weight")?;
            let dx = CudaTensor::alloc(
                &dev,
                rows * inputs,
                self.precision,
                "a linear layer's input gradient",
            )?;
            let fusable = |pre: &CudaTensor, kind| {
                gelu_epilogue(kind, self.precision, inputs)
                    && pre.dtype() == self.precision
                    && pre.len() == dx.len()
            };
            let fused = match through {
                Some((pre, kind)) if fusable(pre, kind) => {
                    let g = products.input_grad_dgelu(dy.ptr(), w, dx.ptr(), pre.ptr());
                    dev.with_blas(|blas| blas.try_gemm(&g))?
                }
                _ => false,
            };
            if fused {
                Some(dx)
            } else {
                dev.with_blas(|blas| blas.gemm(&products.input_grad(dy.ptr(), w, dx.ptr())))?;
                Some(match through {
                    Some((pre, kind)) => activation_backward(pre, &dx, kind)?,
                    None => dx,
                })
            }
        } else {
            None
        };
        let after = after_dx(dx);
        if self.bias && epilogue_fusion(self.precision, outputs) {
            // The bias gradient from the weight gradient's own read of `dy`
            // ([`Epilogue::BiasGradB`]), written beside it and then added into the
            // gradients, where cuBLASLt offers it for the shape; in 16 bits (f32 and TF32
            // keep the fixed-order column sums, held to the CPU's to f32 rounding).
            let sums = dev.alloc(outputs * 4, "a bias gradient")?;
            let g = products.weight_grad_with_bias(x.ptr(), dy.ptr(), gw.ptr(), sums.ptr());
            if dev.with_blas(|blas| blas.try_gemm(&g))? {
                finish_columns(&dev, sums.ptr(), 1, outputs, gb.ptr(), true)?;
                return Ok(after);
            }
        }
        dev.with_blas(|blas| blas.gemm(&products.weight_grad(x.ptr(), dy.ptr(), gw.ptr())))?;
        if self.bias {
            column_sums(&dy, rows, outputs, gb.ptr(), true)?;
        }
        Ok(after)
    }
}

/// `y[r, ·] += bias` for `y` `[rows, cols]`, the bias read in `y`'s dtype (the masters for
/// f32, the compute copy for 16 bits) and the sum rounded once: a row-parallel layer's bias,
/// added after its partial products are summed over the group. Written into `y` when no one
/// else holds it.
pub fn bias_add(y: CudaTensor, bias: DeviceParams, cols: usize) -> Result<CudaTensor, CudaError> {
    if cols == 0 || !y.len().is_multiple_of(cols) || bias.len() != cols {
        return Err(unsupported(format!(
            "bias add: {} values in rows of {cols} with a bias of {}",
            y.len(),
            bias.len()
        )));
    }
    let dev = y.device().clone();
    let dtype = y.dtype();
    let b = weight_in(&bias, dtype, "bias")?;
    let y = writable(y, true)?;
    dev.launch(
        "bias.cu",
        &format!("bias_add_{}", suffix(dtype)),
        Launch::grid_stride(y.len(), THREADS, MAX_BLOCKS),
        Args::new()
            .ptr(y.ptr())
            .ptr(b)
            .i64((y.len() / cols) as i64)
            .usize_as_i32(cols),
    )?;
    Ok(y)
}

/// `out[c] (+)= Σ_r y[r, c]` for `y` `[rows, cols]`, in a fixed order (two kernels:
/// per-block partial sums, then their sum in block order).
pub fn column_sums(
    y: &CudaTensor,
    rows: usize,
    cols: usize,
    out: u64,
    accumulate: bool,
) -> Result<(), CudaError> {
    check_len(y, rows * cols, "column sums")?;
    let dev = y.device();
    let pass = ColumnSumPass::new(rows, cols, y.dtype(), y.ptr());
    let blocks = pass.launch.grid.1 as usize;
    let partial = dev.alloc(blocks * cols * 4, "column-sum partials")?;
    let kernel = if pass.vector {
        "colsum_partial_vec"
    } else {
        "colsum_partial"
    };
    dev.launch(
        "bias.cu",
        &format!("{kernel}_{}", suffix(y.dtype())),
        pass.launch,
        Args::new()
            .ptr(y.ptr())
            .ptr(partial.ptr())
            .usize_as_i32(rows)
            .usize_as_i32(cols)
            .usize_as_i32(pass.rows_per_block),
    )?;
    finish_columns(dev, partial.ptr(), blocks, cols, out, accumulate)
}

/// Rows per block of the vector column sums (`colsum_partial_vec_*`: 8 warps, each summing
/// a run of 32 rows). For GPT-2's bias gradients (16384 rows; 768 to 3072 bf16 columns:
/// 3 to 12 column groups of 256) that is 64 partials per column and 192 to 768 blocks of
/// 256 threads, each thread with 8 16-byte loads in flight: 6 to 25 MB in flight, several
/// times what an H100's memory needs (~3 TB/s x ~1 us) to stream at full rate. Measured on
/// an H100 (partial + finish, device time, 16384 x 3072 / x 768 bf16): 64 rows 44.3 / 11.4
/// us (256 partials make the finish slow), 128: 40.9 / 9.0, 256: 38.8 / 8.2, 512: 38.7 / 9.0.
const VEC_ROWS_PER_BLOCK: usize = 256;

/// The first pass of [`column_sums`]: which partial kernel, its launch, and the rows each
/// block sums. Fixed by the shape, dtype and alignment alone (never by the device), so the
/// summation order, and the bits, are the same on every GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ColumnSumPass {
    /// `colsum_partial_vec_*` (16 bytes of a row per thread) rather than `colsum_partial_*`.
    vector: bool,
    launch: Launch,
    rows_per_block: usize,
}

impl ColumnSumPass {
    fn new(rows: usize, cols: usize, dtype: DType, ptr: u64) -> Self {
        // Values per 16-byte load: 4 f32, 8 bf16/f16.
        let width = 16 / dtype.size_bytes();
        if cols.is_multiple_of(width) && ptr.is_multiple_of(16) {
            let blocks = rows.div_ceil(VEC_ROWS_PER_BLOCK).max(1);
            ColumnSumPass {
                vector: true,
                launch: Launch {
                    // 32 lanes of `width` columns, 8 runs of rows.
                    grid: ((cols / width).div_ceil(32).max(1) as u32, blocks as u32, 1),
                    block: (32, 8, 1),
                    smem: 0,
                },
                rows_per_block: VEC_ROWS_PER_BLOCK,
            }
        } else {
            let blocks = rows.div_ceil(ROWS_PER_BLOCK).max(1);
            ColumnSumPass {
                vector: false,
                launch: Launch {
                    grid: (cols.div_ceil(THREADS as usize) as u32, blocks as u32, 1),
                    block: (THREADS, 1, 1),
                    smem: 0,
                },
                rows_per_block: ROWS_PER_BLOCK,
            }
        }
    }
}

/// `out[c] (+)= Σ_b partial[b, c]` in block order.
fn finish_columns(
    dev: &CudaDevice,
    partial: u64,
    blocks: usize,
    cols: usize,
    out: u64,
    accumulate: bool,
) -> Result<(), CudaError> {
    dev.launch(
        "bias.cu",
        "colsum_finish",
        // A block per 32 columns (grid-strided past MAX_BLOCKS).
        Launch::linear(cols.div_ceil(32).min(MAX_BLOCKS), THREADS),
        Args::new()
            .ptr(partial)
            .ptr(out)
            .usize_as_i32(blocks)
            .usize_as_i32(cols)
            .i32(accumulate as i32),
    )
}

/// Element-wise activation codes of `elementwise.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActKind {
    Relu = 0,
    Sigmoid = 1,
    Tanh = 2,
    Gelu = 3,
    GeluTanh = 4,
}

impl From<crate::activation::Activation> for ActKind {
    fn from(a: crate::activation::Activation) -> Self {
        use crate::activation::Activation;
        match a {
            Activation::Relu => ActKind::Relu,
            Activation::Sigmoid => ActKind::Sigmoid,
            Activation::Tanh => ActKind::Tanh,
            Activation::Gelu => ActKind::Gelu,
            Activation::GeluTanh => ActKind::GeluTanh,
        }
    }
}

impl ActKind {
    /// Whether backward reads the output (sigmoid, tanh) rather than the input.
    pub fn backward_uses_output(self) -> bool {
        matches!(self, ActKind::Sigmoid | ActKind::Tanh)
    }
}

/// `y = act(x)` in x's dtype.
pub fn activation_forward(x: &CudaTensor, act: ActKind) -> Result<CudaTensor, CudaError> {
    let dev = x.device();
    let y = CudaTensor::alloc(dev, x.len(), x.dtype(), "an activation's output")?;
    dev.launch(
        "elementwise.cu",
        &format!("act_fwd_{}", suffix(x.dtype())),
        Launch::grid_stride(x.len(), THREADS, MAX_BLOCKS),
        Args::new()
            .ptr(x.ptr())
            .ptr(y.ptr())
            .i64(x.len() as i64)
            .i32(act as i32),
    )?;
    Ok(y)
}

/// `dx = dy·act'(saved)` (saved: the output for sigmoid/tanh, else the input), in saved's
/// dtype.
pub fn activation_backward(
    saved: &CudaTensor,
    dy: &CudaTensor,
    act: ActKind,
) -> Result<CudaTensor, CudaError> {
    check_len(dy, saved.len(), "activation gradient")?;
    let dev = saved.device();
    let dy = to_dtype(dy, saved.dtype())?;
    let dx = CudaTensor::alloc(dev, saved.len(), saved.dtype(), "an activation's gradient")?;
    dev.launch(
        "elementwise.cu",
        &format!("act_bwd_{}", suffix(saved.dtype())),
        Launch::grid_stride(saved.len(), THREADS, MAX_BLOCKS),
        Args::new()
            .ptr(saved.ptr())
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .i64(saved.len() as i64)
            .i32(act as i32),
    )?;
    Ok(dx)
}

/// [`activation_backward`] with the bias gradient of the layer whose output the activation
/// took, in one pass (`act_bwd_colsum_*`, bias.cu): the gradient, and its column sums added
/// into the `cols` f32 values at `bias_grad`, each bit for bit what `activation_backward`
/// then [`column_sums`] give, with one read of the gradient less. `None` (nothing done) where
/// the column sums' vector path does not apply (`cols` not a multiple of 16 bytes' worth of
/// values, a pointer off 16 bytes) or [`Fusion::ActivationBias`] is off: the caller runs the two.
pub fn activation_backward_with_bias(
    saved: &CudaTensor,
    dy: &CudaTensor,
    act: ActKind,
    cols: usize,
    bias_grad: u64,
) -> Result<Option<CudaTensor>, CudaError> {
    check_len(dy, saved.len(), "activation gradient")?;
    let dev = saved.device();
    let rows = saved.len() / cols.max(1);
    let pass = ColumnSumPass::new(rows, cols, saved.dtype(), saved.ptr());
    if !pass.vector || rows * cols != saved.len() || !fused(Fusion::ActivationBias) {
        return Ok(None);
    }
    // Decided before `dy` is converted, so the fallback does not convert it again (a
    // converted copy is freshly allocated, so aligned: only `dy` as given can be off).
    let dy = to_dtype(dy, saved.dtype())?;
    if !dy.ptr().is_multiple_of(16) {
        return Ok(None);
    }
    let dx = CudaTensor::alloc(dev, saved.len(), saved.dtype(), "an activation's gradient")?;
    let blocks = pass.launch.grid.1 as usize;
    let partial = dev.alloc(blocks * cols * 4, "column-sum partials")?;
    dev.launch(
        "bias.cu",
        &format!("act_bwd_colsum_{}", suffix(saved.dtype())),
        pass.launch,
        Args::new()
            .ptr(saved.ptr())
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .ptr(partial.ptr())
            .usize_as_i32(rows)
            .usize_as_i32(cols)
            .usize_as_i32(pass.rows_per_block)
            .i32(act as i32),
    )?;
    finish_columns(dev, partial.ptr(), blocks, cols, bias_grad, true)?;
    Ok(Some(dx))
}

/// `a + b` in f32 (`a` f32, `b` any dtype): the residual add. Written into `a`'s buffer when
/// no one else holds it.
pub fn add(a: CudaTensor, b: &CudaTensor) -> Result<CudaTensor, CudaError> {
    check_len(b, a.len(), "residual add")?;
    let dev = a.device().clone();
    // An f32 `a` itself (a clone would keep its buffer shared, never written in place).
    let a = if a.dtype() == DType::F32 {
        a
    } else {
        to_dtype(&a, DType::F32)?
    };
    let y = if a.is_unique() {
        a.clone()
    } else {
        CudaTensor::alloc(&dev, a.len(), DType::F32, "a residual sum")?
    };
    dev.launch(
        "elementwise.cu",
        &format!("add_f32_{}", suffix(b.dtype())),
        Launch::grid_stride(a.len(), THREADS, MAX_BLOCKS),
        Args::new()
            .ptr(a.ptr())
            .ptr(b.ptr())
            .ptr(y.ptr())
            .i64(a.len() as i64),
    )?;
    Ok(y)
}

/// A norm forward's input, with or without the residual add before it. With a branch's output
/// `h` the row normalised is the stream's new value `x + h` (f32), which the norm's kernel
/// computes and stores itself (`*_fwd_add_*`) where `h` is in the norm's output dtype (a
/// branch's last product writes that) and [`Fusion::ResidualAdd`] is on: one pass where a residual add and
/// the norm took two, with the same bits (one f32 addition either way). Otherwise the
/// separate [`add`] runs first.
struct NormInput {
    x: CudaTensor,
    /// The branch's output and the sum's own buffer, when the kernel adds.
    fused_add: Option<(CudaTensor, CudaTensor)>,
}

impl NormInput {
    fn new(
        x: &CudaTensor,
        h: Option<&CudaTensor>,
        out_dtype: DType,
        what: &str,
    ) -> Result<NormInput, CudaError> {
        let x = to_dtype(x, DType::F32)?;
        let Some(h) = h else {
            return Ok(NormInput { x, fused_add: None });
        };
        // An `x` or `h` off its vector alignment would send the fused kernel down its scalar
        // path while the separate norm of the add's fresh (aligned) sum takes the vector one:
        // their row sums run in other orders. Such views (never a product's or an add's
        // output) add first.
        let aligned =
            x.ptr().is_multiple_of(16) && h.ptr().is_multiple_of(4 * h.dtype().size_bytes() as u64);
        if h.dtype() != out_dtype || !aligned || !fused(Fusion::ResidualAdd) {
            return Ok(NormInput {
                x: add(x, h)?,
                fused_add: None,
            });
        }
        check_len(h, x.len(), what)?;
        // Never x's buffer: the kernel reads x as it writes the sum.
        let sum = CudaTensor::alloc(x.device(), x.len(), DType::F32, "a residual sum")?;
        Ok(NormInput {
            x,
            fused_add: Some((h.clone(), sum)),
        })
    }

    /// The kernel `{base}_{dtype}`, or `{base}_add_{dtype}` when it adds.
    fn kernel(&self, base: &str, out_dtype: DType) -> String {
        let add = if self.fused_add.is_some() { "_add" } else { "" };
        format!("{base}{add}_{}", suffix(out_dtype))
    }

    /// The kernel's first arguments: `x`, or `x, h, sum`.
    fn args(&self) -> Args {
        let args = Args::new().ptr(self.x.ptr());
        match &self.fused_add {
            Some((h, sum)) => args.ptr(h.ptr()).ptr(sum.ptr()),
            None => args,
        }
    }

    /// The rows normalised (the sum, when the kernel adds).
    fn normalised(&self) -> &CudaTensor {
        self.fused_add.as_ref().map_or(&self.x, |(_, sum)| sum)
    }

    fn into_normalised(self) -> CudaTensor {
        self.fused_add.map_or(self.x, |(_, sum)| sum)
    }
}

/// Layer norm over rows of `d` of the f32 `x`: `(y in out_dtype, mean, rstd)` (the
/// statistics only when `keep_stats`).
pub fn layer_norm_forward(
    x: &CudaTensor,
    p: DeviceParams,
    d: usize,
    eps: f32,
    out_dtype: DType,
    keep_stats: bool,
) -> Result<(CudaTensor, Option<(CudaTensor, CudaTensor)>), CudaError> {
    let input = NormInput::new(x, None, out_dtype, "layer norm input")?;
    layer_norm_of(&input, p, d, eps, out_dtype, keep_stats)
}

/// The residual add and the layer norm after it: `x += h` (the stream's new value, f32),
/// then [`layer_norm_forward`] of it: `(x + h, y, stats)`, in one kernel where [`NormInput`]
/// says.
#[allow(clippy::type_complexity)]
pub fn add_layer_norm_forward(
    x: &CudaTensor,
    h: &CudaTensor,
    p: DeviceParams,
    d: usize,
    eps: f32,
    out_dtype: DType,
    keep_stats: bool,
) -> Result<(CudaTensor, CudaTensor, Option<(CudaTensor, CudaTensor)>), CudaError> {
    let input = NormInput::new(x, Some(h), out_dtype, "residual add before a layer norm")?;
    let (y, stats) = layer_norm_of(&input, p, d, eps, out_dtype, keep_stats)?;
    Ok((input.into_normalised(), y, stats))
}

fn layer_norm_of(
    input: &NormInput,
    p: DeviceParams,
    d: usize,
    eps: f32,
    out_dtype: DType,
    keep_stats: bool,
) -> Result<(CudaTensor, Option<(CudaTensor, CudaTensor)>), CudaError> {
    let x = input.normalised();
    let dev = x.device().clone();
    let rows = x.len() / d;
    check_len(x, rows * d, "layer norm input")?;
    let (gamma, beta) = p.split_at(d);
    let y = CudaTensor::alloc(&dev, x.len(), out_dtype, "a layer norm's output")?;
    let stats = if keep_stats {
        Some((
            CudaTensor::alloc(&dev, rows, DType::F32, "layer norm means")?,
            CudaTensor::alloc(&dev, rows, DType::F32, "layer norm scales")?,
        ))
    } else {
        None
    };
    let (mean, rstd) = stats.as_ref().map_or((0, 0), |(m, r)| (m.ptr(), r.ptr()));
    dev.launch(
        "layernorm.cu",
        &input.kernel("layernorm_fwd", out_dtype),
        Launch::linear(rows.div_ceil(8), THREADS),
        input
            .args()
            .ptr(gamma.master())
            .ptr(beta.master())
            .ptr(y.ptr())
            .ptr(mean)
            .ptr(rstd)
            .usize_as_i32(rows)
            .usize_as_i32(d)
            .f32(eps),
    )?;
    Ok((y, stats))
}

/// Where a norm's input gradient goes when the caller wants it added into `add_into` (the
/// residual stream's gradient, which the branch's first layer joins): that buffer itself when
/// the caller holds its only reference (the kernel adds in place: `(buffer, true, None)`),
/// else a fresh buffer, with `add_into` handed back for a separate add afterwards.
fn input_grad_target(
    dev: &Arc<CudaDevice>,
    add_into: Option<CudaTensor>,
    len: usize,
    what: &str,
) -> Result<(CudaTensor, bool, Option<CudaTensor>), CudaError> {
    match add_into {
        Some(t) if t.dtype() == DType::F32 && t.is_unique() => {
            check_len(&t, len, "the gradient a norm adds into")?;
            Ok((t, true, None))
        }
        other => Ok((CudaTensor::alloc(dev, len, DType::F32, what)?, false, other)),
    }
}

/// `dx`, or `pending + dx` when the sum could not be taken in place.
fn finish_input_grad(dx: CudaTensor, pending: Option<CudaTensor>) -> Result<CudaTensor, CudaError> {
    match pending {
        Some(into) => add(into, &dx),
        None => Ok(dx),
    }
}

/// A norm's input gradient (f32), and with it, where asked, the same values rounded to the
/// output gradient's 16-bit type ([`rounded_input_grad`]).
pub type NormInputGrad = (CudaTensor, Option<CudaTensor>);

/// The buffer for a norm's rounded input gradient, when `rounded` asks for it and it can be
/// written: `dy` in 16 bits (the type the next layer's products read the gradient in), and
/// the kernel's `dx` the whole result (`pending`: no add after it). The norm's kernel writes
/// it beside `dx`, where the linear layer reading the gradient next (a residual branch's
/// last product) would otherwise convert it in a pass of its own.
fn rounded_input_grad(
    dev: &Arc<CudaDevice>,
    rounded: bool,
    dy: &CudaTensor,
    pending: &Option<CudaTensor>,
    len: usize,
) -> Result<Option<CudaTensor>, CudaError> {
    (rounded && dy.dtype() != DType::F32 && pending.is_none() && fused(Fusion::RoundedGrad))
        .then(|| CudaTensor::alloc(dev, len, dy.dtype(), "a norm's rounded input gradient"))
        .transpose()
}

/// `dx` (with its rounded copy), or `pending + dx` when the sum could not be taken in place
/// (then there is no rounded copy: [`rounded_input_grad`]).
fn finish_norm_grad(
    dx: CudaTensor,
    low: Option<CudaTensor>,
    pending: Option<CudaTensor>,
) -> Result<NormInputGrad, CudaError> {
    Ok((finish_input_grad(dx, pending)?, low))
}

/// Layer-norm backward: returns dx (f32), and its rounded copy if `rounded`
/// ([`rounded_input_grad`]), and adds [dγ | dβ] into `grads`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    x: &CudaTensor,
    p: DeviceParams,
    mean: &CudaTensor,
    rstd: &CudaTensor,
    dy: &CudaTensor,
    grads: DeviceGrads,
    d: usize,
    add_into: Option<CudaTensor>,
    rounded: bool,
) -> Result<NormInputGrad, CudaError> {
    let dev = x.device().clone();
    let x = to_dtype(x, DType::F32)?;
    let rows = x.len() / d;
    check_len(dy, x.len(), "layer norm output gradient")?;
    check_len(mean, rows, "layer norm means")?;
    let (dx, accumulate, pending) =
        input_grad_target(&dev, add_into, x.len(), "a layer norm's input gradient")?;
    let low = rounded_input_grad(&dev, rounded, dy, &pending, x.len())?;
    let low_ptr = low.as_ref().map_or(0, CudaTensor::ptr);
    let t = suffix(dy.dtype());
    let gamma = p.master();
    if let Some(fused) = FusedNormBackward::new(rows, d, 2, [x.ptr(), gamma, dx.ptr()], dy) {
        let inputs = Args::new()
            .ptr(x.ptr())
            .ptr(gamma)
            .ptr(mean.ptr())
            .ptr(rstd.ptr())
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .ptr(low_ptr);
        let kernel = ("layernorm.cu", format!("layernorm_bwd_fused_{t}"));
        fused.run(&dev, kernel, inputs, rows, d, accumulate, grads)?;
        return finish_norm_grad(dx, low, pending);
    }
    dev.launch(
        "layernorm.cu",
        &format!("layernorm_bwd_dx_{t}"),
        Launch::linear(rows.div_ceil(8), THREADS),
        Args::new()
            .ptr(x.ptr())
            .ptr(p.master())
            .ptr(mean.ptr())
            .ptr(rstd.ptr())
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .ptr(low_ptr)
            .usize_as_i32(rows)
            .usize_as_i32(d)
            .i32(accumulate as i32),
    )?;
    let inputs = Args::new()
        .ptr(x.ptr())
        .ptr(mean.ptr())
        .ptr(rstd.ptr())
        .ptr(dy.ptr());
    let kernel = format!("layernorm_bwd_params_{t}");
    add_norm_param_grads(
        &dev,
        ("layernorm.cu", &kernel),
        inputs,
        rows,
        d,
        2 * d,
        grads,
    )?;
    finish_norm_grad(dx, low, pending)
}

/// The step's fused passes: each runs where it applies unless `MESHTRAIN_FUSION` turns it off
/// ([`fusion_setting`]), which keeps the separate kernels: for A/B runs on a card, and for
/// setting one aside if a card disagrees with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fusion {
    /// The residual add in the next norm's forward kernel ([`add_layer_norm_forward`]).
    ResidualAdd,
    /// A norm's input gradient also written rounded to 16 bits, for the product reading it
    /// next ([`NormInputGrad`]).
    RoundedGrad,
    /// A norm's input and parameter gradients in one pass ([`FusedNormBackward`]).
    NormBackward,
    /// A linear layer's activation gradient with its bias gradient
    /// ([`activation_backward_with_bias`]).
    ActivationBias,
    /// GELU, its gradient and the bias gradients in the products' epilogues
    /// ([`epilogue_fusion`]).
    Epilogues,
}

impl Fusion {
    pub const ALL: [Fusion; 5] = [
        Fusion::ResidualAdd,
        Fusion::RoundedGrad,
        Fusion::NormBackward,
        Fusion::ActivationBias,
        Fusion::Epilogues,
    ];

    /// Its name in `MESHTRAIN_FUSION`.
    pub fn name(self) -> &'static str {
        match self {
            Fusion::ResidualAdd => "residual-add",
            Fusion::RoundedGrad => "rounded-grad",
            Fusion::NormBackward => "norm-backward",
            Fusion::ActivationBias => "activation-bias",
            Fusion::Epilogues => "epilogues",
        }
    }
}

/// The fusions `MESHTRAIN_FUSION`'s `value` turns off: unset, empty or `on`, none; `off`,
/// every one; `off:NAME,NAME`, those ([`Fusion::name`]). Anything else is an error naming
/// what is accepted (the command line checks it before any work).
pub fn fusion_setting(value: Option<&str>) -> Result<Vec<Fusion>, String> {
    let names = || {
        Fusion::ALL
            .iter()
            .map(|f| f.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match value.map(str::trim) {
        None | Some("") | Some("on") => Ok(Vec::new()),
        Some("off") => Ok(Fusion::ALL.to_vec()),
        Some(v) => {
            let list = v.strip_prefix("off:").ok_or_else(|| {
                format!(
                    "MESHTRAIN_FUSION={v}: expected on, off or off:NAME,... (names: {})",
                    names()
                )
            })?;
            list.split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(|n| {
                    Fusion::ALL
                        .into_iter()
                        .find(|f| f.name() == n)
                        .ok_or_else(|| {
                            format!(
                                "MESHTRAIN_FUSION: no fusion named {n:?} (names: {})",
                                names()
                            )
                        })
                })
                .collect()
        }
    }
}

/// Whether `f` runs ([`fusion_setting`] of `MESHTRAIN_FUSION`, read once; a value the
/// command line would refuse turns nothing off).
fn fused(f: Fusion) -> bool {
    static OFF: std::sync::OnceLock<Vec<Fusion>> = std::sync::OnceLock::new();
    !OFF.get_or_init(|| {
        fusion_setting(std::env::var("MESHTRAIN_FUSION").ok().as_deref()).unwrap_or_default()
    })
    .contains(&f)
}

/// Whether a product's epilogue takes a pass over its output of `width`-value rows
/// ([`Epilogue`]): with [`Fusion::Epilogues`] on, in 16 bits (an f32 run is held to the CPU's results to
/// f32 rounding, which cuBLASLt's epilogues are not documented to reach, and f32 keeps the
/// fixed-order column sums), for rows a multiple of 8 values (cuBLASLt's auxiliary matrix
/// wants its leading dimension so, and a shape it might refuse only at launch is not tried).
pub fn epilogue_fusion(precision: DType, width: usize) -> bool {
    precision != DType::F32 && width.is_multiple_of(8) && fused(Fusion::Epilogues)
}

/// Whether `act` goes into a product's epilogue, forward ([`Epilogue::GeluAux`]) or as the
/// next layer's input gradient ([`Epilogue::DGelu`]): cuBLASLt's GELU is the tanh one.
pub fn gelu_epilogue(act: ActKind, precision: DType, width: usize) -> bool {
    act == ActKind::GeluTanh && epilogue_fusion(precision, width)
}

/// Blocks of the fused norm backward ([`FusedNormBackward`]: the input gradient and the
/// parameter gradients' partial sums in one pass over `x` and `dy`), or `None` where its
/// vector path does not apply (`d` not a multiple of 4 or above 1,024, buffers not
/// `aligned`) or [`Fusion::NormBackward`] is off. One warp a row up to [`FUSED_NORM_BLOCKS`]
/// blocks of 8, each warp looping over rows beyond. Fixed by the shape alone, so the sums'
/// order, and the bits, are the same on every GPU.
fn fused_norm_backward_blocks(rows: usize, d: usize, aligned: bool) -> Option<usize> {
    let fits = d.is_multiple_of(4) && d > 0 && d <= 1024;
    (fits && aligned && fused(Fusion::NormBackward))
        .then(|| rows.div_ceil(8).clamp(1, FUSED_NORM_BLOCKS))
}

/// A fused norm backward's launch (`layernorm_bwd_fused_*`, `rmsnorm_bwd_fused_*`, common.cuh's
/// `norm_bwd_fused_impl`): `blocks` blocks of 8 warps, each warp with `sums` rows of `d`
/// floats of shared memory (2 for the layer norm's γ and β, 1 for the RMS norm's weight).
struct FusedNormBackward {
    blocks: usize,
    sums: usize,
}

impl FusedNormBackward {
    /// The launch for a norm over rows of `d` with `sums` rows of parameter sums, whose `x`,
    /// weight and `dx` are at `[x, w, dx]` and output gradient is `dy`; `None` where the
    /// fused kernel does not apply ([`fused_norm_backward_blocks`]).
    fn new(
        rows: usize,
        d: usize,
        sums: usize,
        [x, w, dx]: [u64; 3],
        dy: &CudaTensor,
    ) -> Option<Self> {
        let dy_aligned = dy.ptr().is_multiple_of(4 * dy.dtype().size_bytes() as u64);
        let aligned = [x, w, dx].iter().all(|p| p.is_multiple_of(16)) && dy_aligned;
        let blocks = fused_norm_backward_blocks(rows, d, aligned)?;
        Some(FusedNormBackward { blocks, sums })
    }

    /// Launches `kernel` (file, name) on its `inputs` (the tensors up to `dx`), then sums the
    /// blocks' partial rows into `grads` (`sums · d` values) in block order.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        dev: &Arc<CudaDevice>,
        (file, kernel): (&'static str, String),
        inputs: Args,
        rows: usize,
        d: usize,
        accumulate: bool,
        grads: DeviceGrads,
    ) -> Result<(), CudaError> {
        let width = self.sums * d;
        let partial = dev.alloc(self.blocks * width * 4, "norm gradient partials")?;
        let warps = THREADS as usize / 32;
        dev.launch(
            file,
            &kernel,
            Launch {
                smem: (warps * width * 4) as u32,
                ..Launch::linear(self.blocks, THREADS)
            },
            inputs
                .ptr(partial.ptr())
                .usize_as_i32(rows)
                .usize_as_i32(d)
                .i32(accumulate as i32),
        )?;
        finish_columns(dev, partial.ptr(), self.blocks, width, grads.ptr(), true)
    }
}

/// At most this many blocks in a fused norm backward. Fewer blocks make fewer partial
/// rows for `colsum_finish`, whose sum over them is latency-bound (~15 µs over 256 per column
/// on an H100); more keep more rows in flight. 256 blocks of 8 warps at ~100 registers a
/// thread (2 blocks per multiprocessor) are one wave on an H100's 132, and GPT-2's 16,384
/// rows 8 a warp.
const FUSED_NORM_BLOCKS: usize = 256;

/// RMS norm over rows of `d` of the f32 `x` (weight `w`, `d` values): `(y in out_dtype,
/// rstd)` (the statistics only when `keep_stats`).
pub fn rms_norm_forward(
    x: &CudaTensor,
    w: DeviceParams,
    d: usize,
    eps: f32,
    out_dtype: DType,
    keep_stats: bool,
) -> Result<(CudaTensor, Option<CudaTensor>), CudaError> {
    let input = NormInput::new(x, None, out_dtype, "RMS norm input")?;
    rms_norm_of(&input, w, d, eps, out_dtype, keep_stats)
}

/// The residual add and the RMS norm after it: `(x + h, y, rstd)`, as
/// [`add_layer_norm_forward`].
pub fn add_rms_norm_forward(
    x: &CudaTensor,
    h: &CudaTensor,
    w: DeviceParams,
    d: usize,
    eps: f32,
    out_dtype: DType,
    keep_stats: bool,
) -> Result<(CudaTensor, CudaTensor, Option<CudaTensor>), CudaError> {
    let input = NormInput::new(x, Some(h), out_dtype, "residual add before an RMS norm")?;
    let (y, rstd) = rms_norm_of(&input, w, d, eps, out_dtype, keep_stats)?;
    Ok((input.into_normalised(), y, rstd))
}

fn rms_norm_of(
    input: &NormInput,
    w: DeviceParams,
    d: usize,
    eps: f32,
    out_dtype: DType,
    keep_stats: bool,
) -> Result<(CudaTensor, Option<CudaTensor>), CudaError> {
    let x = input.normalised();
    let dev = x.device().clone();
    let rows = x.len() / d;
    check_len(x, rows * d, "RMS norm input")?;
    check_params(&w, d, "RMS norm weight")?;
    let y = CudaTensor::alloc(&dev, x.len(), out_dtype, "an RMS norm's output")?;
    let rstd = if keep_stats {
        Some(CudaTensor::alloc(
            &dev,
            rows,
            DType::F32,
            "RMS norm scales",
        )?)
    } else {
        None
    };
    dev.launch(
        "llama.cu",
        &input.kernel("rmsnorm_fwd", out_dtype),
        Launch::linear(rows.div_ceil(8), THREADS),
        input
            .args()
            .ptr(w.master())
            .ptr(y.ptr())
            .ptr(rstd.as_ref().map_or(0, |r| r.ptr()))
            .usize_as_i32(rows)
            .usize_as_i32(d)
            .f32(eps),
    )?;
    Ok((y, rstd))
}

/// RMS-norm backward: returns dx (f32), and its rounded copy if `rounded`
/// ([`rounded_input_grad`]), and adds dw into `grads` (`d` values).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward(
    x: &CudaTensor,
    w: DeviceParams,
    rstd: &CudaTensor,
    dy: &CudaTensor,
    grads: DeviceGrads,
    d: usize,
    add_into: Option<CudaTensor>,
    rounded: bool,
) -> Result<NormInputGrad, CudaError> {
    let dev = x.device().clone();
    let x = to_dtype(x, DType::F32)?;
    let rows = x.len() / d;
    check_len(dy, x.len(), "RMS norm output gradient")?;
    check_len(rstd, rows, "RMS norm scales")?;
    check_params(&w, d, "RMS norm weight")?;
    if grads.len() != d {
        return Err(unsupported(format!(
            "RMS norm weight gradient: expected {d} values, the view has {}",
            grads.len()
        )));
    }
    let (dx, accumulate, pending) =
        input_grad_target(&dev, add_into, x.len(), "an RMS norm's input gradient")?;
    let low = rounded_input_grad(&dev, rounded, dy, &pending, x.len())?;
    let low_ptr = low.as_ref().map_or(0, CudaTensor::ptr);
    let t = suffix(dy.dtype());
    if let Some(fused) = FusedNormBackward::new(rows, d, 1, [x.ptr(), w.master(), dx.ptr()], dy) {
        let inputs = Args::new()
            .ptr(x.ptr())
            .ptr(w.master())
            .ptr(rstd.ptr())
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .ptr(low_ptr);
        let kernel = ("llama.cu", format!("rmsnorm_bwd_fused_{t}"));
        fused.run(&dev, kernel, inputs, rows, d, accumulate, grads)?;
        return finish_norm_grad(dx, low, pending);
    }
    dev.launch(
        "llama.cu",
        &format!("rmsnorm_bwd_dx_{t}"),
        Launch::linear(rows.div_ceil(8), THREADS),
        Args::new()
            .ptr(x.ptr())
            .ptr(w.master())
            .ptr(rstd.ptr())
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .ptr(low_ptr)
            .usize_as_i32(rows)
            .usize_as_i32(d)
            .i32(accumulate as i32),
    )?;
    let inputs = Args::new().ptr(x.ptr()).ptr(rstd.ptr()).ptr(dy.ptr());
    let kernel = format!("rmsnorm_bwd_params_{t}");
    add_norm_param_grads(&dev, ("llama.cu", &kernel), inputs, rows, d, d, grads)?;
    finish_norm_grad(dx, low, pending)
}

/// A norm's parameter gradients added into `grads` (`width` values: γ and β, or the weight):
/// `kernel` (file, name) writes each block of rows' column sums over `d` columns from its
/// `inputs`, followed by the partials, rows, d and the rows per block; the partials are then
/// summed in block order.
fn add_norm_param_grads(
    dev: &Arc<CudaDevice>,
    (file, kernel): (&'static str, &str),
    inputs: Args,
    rows: usize,
    d: usize,
    width: usize,
    grads: DeviceGrads,
) -> Result<(), CudaError> {
    let blocks = rows.div_ceil(ROWS_PER_BLOCK).max(1);
    let partial = dev.alloc(blocks * width * 4, "norm gradient partials")?;
    dev.launch(
        file,
        kernel,
        Launch {
            grid: (d.div_ceil(THREADS as usize) as u32, blocks as u32, 1),
            block: (THREADS, 1, 1),
            smem: 0,
        },
        inputs
            .ptr(partial.ptr())
            .usize_as_i32(rows)
            .usize_as_i32(d)
            .usize_as_i32(ROWS_PER_BLOCK),
    )?;
    finish_columns(dev, partial.ptr(), blocks, width, grads.ptr(), true)
}

fn check_params(p: &DeviceParams, len: usize, what: &str) -> Result<(), CudaError> {
    if p.len() != len {
        return Err(unsupported(format!(
            "{what}: expected {len} values, the parameters have {}",
            p.len()
        )));
    }
    Ok(())
}

/// Token rows grouped by token id, for a deterministic embedding gradient: `order` lists the
/// rows (`i` of `ids`) sorted stably by id, `starts[u]..starts[u+1]` are the rows of the
/// `u`-th distinct id `uniq[u]`. A counting sort on the host: the ids are there anyway.
/// Negative ids (tokens outside this table: a vocabulary-parallel rank's share) are in no
/// group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenGroups {
    pub order: Vec<i32>,
    pub starts: Vec<i32>,
    pub uniq: Vec<i32>,
}

impl TokenGroups {
    pub fn of(ids: &[i32], vocab: usize) -> TokenGroups {
        let mut counts = vec![0i32; vocab + 1];
        for &id in ids.iter().filter(|&&id| id >= 0) {
            counts[id as usize + 1] += 1;
        }
        let mut uniq = Vec::new();
        let mut starts = Vec::new();
        for (id, &c) in counts[1..].iter().enumerate() {
            if c > 0 {
                uniq.push(id as i32);
            }
        }
        for i in 1..counts.len() {
            counts[i] += counts[i - 1];
        }
        for &u in &uniq {
            starts.push(counts[u as usize]);
        }
        let grouped = counts[vocab];
        starts.push(grouped);
        let mut next = counts;
        let mut order = vec![0i32; grouped as usize];
        for (row, &id) in ids.iter().enumerate().filter(|(_, &id)| id >= 0) {
            order[next[id as usize] as usize] = row as i32;
            next[id as usize] += 1;
        }
        TokenGroups {
            order,
            starts,
            uniq,
        }
    }
}

/// Token ids as i32, checked against the vocabulary.
pub fn token_ids(values: &[f32], vocab: usize) -> Result<Vec<i32>, CudaError> {
    values
        .iter()
        .map(|&v| {
            let id = v as i64;
            if v < 0.0 || id as f32 != v || id as usize >= vocab {
                Err(unsupported(format!(
                    "token id {v} outside vocabulary of {vocab}"
                )))
            } else {
                Ok(id as i32)
            }
        })
        .collect()
}

/// Token (+ position) embedding: `y[i] = wte[ids[i]] (+ wpe[pos_of[i % seq]])` (f32),
/// parameters `[wte (vocab × d) | wpe (max_seq × d)]`, or `wte` alone when `pos_of` is
/// `None` (a model without a position table: Llama's rotary positions).
pub fn embedding_forward(
    dev: &Arc<CudaDevice>,
    ids: &[i32],
    p: DeviceParams,
    vocab: usize,
    d: usize,
    pos_of: Option<&[i32]>,
) -> Result<CudaTensor, CudaError> {
    let tokens = ids.len();
    check_embedding_params(p.len(), vocab, d, pos_of)?;
    let (wte, wpe) = p.split_at(vocab * d);
    let ids_dev = dev.upload(ids, "token ids")?;
    let pos_dev = match pos_of {
        Some(pos) => Some(dev.upload(pos, "token positions")?),
        None => None,
    };
    let y = CudaTensor::alloc(dev, tokens * d, DType::F32, "the embedding's output")?;
    // No table: null `wpe` and `pos_of` (the kernel reads neither, nor `seq`).
    let (wpe, pos_ptr, seq) = match (&pos_dev, pos_of) {
        (Some(buf), Some(pos)) => (wpe.master(), buf.ptr(), pos.len()),
        _ => (0, 0, 1),
    };
    dev.launch(
        "embedding.cu",
        "embedding_fwd",
        Launch::grid_stride(tokens * d, THREADS, MAX_BLOCKS),
        Args::new()
            .ptr(ids_dev.ptr())
            .ptr(wte.master())
            .ptr(wpe)
            .ptr(pos_ptr)
            .ptr(y.ptr())
            .usize_as_i32(tokens)
            .usize_as_i32(seq)
            .usize_as_i32(d),
    )?;
    Ok(y)
}

/// The embedding's parameters hold the token table, and the position table when positions
/// are given.
fn check_embedding_params(
    len: usize,
    vocab: usize,
    d: usize,
    pos_of: Option<&[i32]>,
) -> Result<(), CudaError> {
    let short = match pos_of {
        // The position table's rows: at least every position named.
        Some(pos) => {
            let rows = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
            len < vocab * d + rows * d
        }
        None => len < vocab * d,
    };
    if short {
        return Err(unsupported(format!(
            "embedding: {len} parameter values cannot hold a {vocab} x {d} token table{}",
            if pos_of.is_some() {
                " and the positions' rows"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

/// Backward of [`embedding_forward`]: adds into `grads` = [dwte | dwpe] (dwte alone when
/// `pos_of` is `None`).
pub fn embedding_backward(
    dy: &CudaTensor,
    ids: &[i32],
    grads: DeviceGrads,
    vocab: usize,
    d: usize,
    pos_of: Option<&[i32]>,
) -> Result<(), CudaError> {
    let dev = dy.device().clone();
    let dy = to_dtype(dy, DType::F32)?;
    check_len(&dy, ids.len() * d, "embedding output gradient")?;
    check_embedding_params(grads.len(), vocab, d, pos_of)?;
    let groups = TokenGroups::of(ids, vocab);
    let (gte, gpe) = grads.split_at(vocab * d);
    // Every upload and the grid sized by the token count, not by the batch's distinct ids:
    // the same launch for every batch of a shape (a captured CUDA graph replays it), the
    // count beside the group starts, blocks past it idle.
    let tokens = ids.len().max(1);
    let padded = |mut v: Vec<i32>, len: usize| {
        v.resize(len, 0);
        v
    };
    let count = groups.uniq.len();
    let mut starts = groups.starts.clone();
    starts.resize(tokens + 1, *groups.starts.last().unwrap_or(&0));
    starts.push(count as i32);
    let order = dev.upload(&padded(groups.order, tokens), "embedding token order")?;
    let starts = dev.upload(&starts, "embedding token groups")?;
    let uniq = dev.upload(&padded(groups.uniq, tokens), "embedding token ids")?;
    dev.launch(
        "embedding.cu",
        "embedding_bwd_tokens",
        Launch::linear(tokens.min(MAX_BLOCKS * 4), THREADS),
        Args::new()
            .ptr(dy.ptr())
            .ptr(order.ptr())
            .ptr(starts.ptr())
            .ptr(uniq.ptr())
            .ptr(gte.ptr())
            .ptr(starts.ptr() + 4 * (tokens as u64 + 1))
            .usize_as_i32(d),
    )?;
    let Some(pos_of) = pos_of else {
        return Ok(());
    };
    let seq = pos_of.len();
    let batch = ids.len() / seq;
    let pos_dev = dev.upload(pos_of, "token positions")?;
    dev.launch(
        "embedding.cu",
        "embedding_bwd_positions",
        Launch::grid_stride(seq * d, THREADS, MAX_BLOCKS),
        Args::new()
            .ptr(dy.ptr())
            .ptr(pos_dev.ptr())
            .ptr(gpe.ptr())
            .usize_as_i32(batch)
            .usize_as_i32(seq)
            .usize_as_i32(d),
    )
}

/// Rotary positions + grouped-query heads (`crate::rotary`): checks the shape the kernels
/// handle, and that the tables are `[seq, head_dim/2]` f32 each.
pub fn check_rotary_shape(shape: RotaryShape) -> Result<(), CudaError> {
    let RotaryShape {
        heads,
        kv_heads,
        head_dim,
        ..
    } = shape;
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(unsupported(format!(
            "rotary positions rotate pairs of a head's values: head size {head_dim} is not even"
        )));
    }
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(unsupported(format!(
            "rotary: {heads} query heads are not a multiple of {kv_heads} key/value heads"
        )));
    }
    Ok(())
}

fn check_tables(shape: RotaryShape, cos: &CudaTensor, sin: &CudaTensor) -> Result<(), CudaError> {
    check_rotary_shape(shape)?;
    for (t, what) in [(cos, "rotary cosines"), (sin, "rotary sines")] {
        check_len(t, shape.seq * shape.head_dim / 2, what)?;
        if t.dtype() != DType::F32 {
            return Err(unsupported(format!(
                "{what}: f32 tables, not {}",
                t.dtype()
            )));
        }
    }
    Ok(())
}

/// The grid-stride launch of a rotary or SwiGLU pass over `pairs` pairs of values of rows
/// whose halves are `half` wide: the kernels take 16 bytes of a half per thread when they
/// can (`kernels/llama.cu`).
pub fn pairs_launch(pairs: usize, half: usize, dtype: DType) -> Launch {
    let w = 16 / dtype.size_bytes();
    let units = if half.is_multiple_of(w) {
        pairs / w
    } else {
        pairs
    };
    Launch::grid_stride(units, THREADS, MAX_BLOCKS)
}

fn rotary_args(
    input: &CudaTensor,
    cos: &CudaTensor,
    sin: &CudaTensor,
    out: &CudaTensor,
    s: RotaryShape,
) -> Args {
    Args::new()
        .ptr(input.ptr())
        .ptr(cos.ptr())
        .ptr(sin.ptr())
        .ptr(out.ptr())
        .usize_as_i32(s.batch * s.seq)
        .usize_as_i32(s.seq)
        .usize_as_i32(s.heads)
        .usize_as_i32(s.kv_heads)
        .usize_as_i32(s.head_dim)
}

/// Rotates q and k and repeats the key/value heads: `x` `[B·T, (H + 2·H_kv)·hd]` in the
/// grouped layout → `[B·T, 3·H·hd]` (`[Q | K | V]`) in x's dtype. `cos`/`sin` are
/// [`crate::rotary::rotary_tables`] of the `T` tokens' positions, uploaded (f32).
pub fn rotary_forward(
    x: &CudaTensor,
    shape: RotaryShape,
    cos: &CudaTensor,
    sin: &CudaTensor,
) -> Result<CudaTensor, CudaError> {
    rotary_pass(x, shape, cos, sin, false)
}

/// The query and key heads of grouped q/k/v rows `x` (f32, `[rows, shape.input_width()]`)
/// as contiguous `[rows·heads, hd]` and `[rows·kv_heads, hd]` f32 buffers (the CPU's
/// [`crate::rotary::gather_qk`]): what Qwen3's per-head q/k norms run the RMS norm on.
pub fn qk_heads(x: &CudaTensor, shape: RotaryShape) -> Result<(CudaTensor, CudaTensor), CudaError> {
    let dev = x.device().clone();
    let rows = qk_rows(x, shape)?;
    let q = CudaTensor::alloc(
        &dev,
        rows * shape.heads * shape.head_dim,
        DType::F32,
        "query heads",
    )?;
    let k = CudaTensor::alloc(
        &dev,
        rows * shape.kv_heads * shape.head_dim,
        DType::F32,
        "key heads",
    )?;
    qk_move(x, &q, &k, shape, rows, false)?;
    Ok((q, k))
}

/// Writes query and key heads (as [`qk_heads`] lays them out) into grouped rows `x` (f32),
/// whose value heads stay (the CPU's [`crate::rotary::scatter_qk`]).
pub fn qk_heads_into(
    q: &CudaTensor,
    k: &CudaTensor,
    x: &CudaTensor,
    shape: RotaryShape,
) -> Result<(), CudaError> {
    let rows = qk_rows(x, shape)?;
    check_len(q, rows * shape.heads * shape.head_dim, "query heads")?;
    check_len(k, rows * shape.kv_heads * shape.head_dim, "key heads")?;
    qk_move(x, q, k, shape, rows, true)
}

fn qk_rows(x: &CudaTensor, shape: RotaryShape) -> Result<usize, CudaError> {
    let width = shape.input_width();
    if x.dtype() != DType::F32
        || width == 0
        || !x.len().is_multiple_of(width)
        || shape.kv_heads == 0
        || !shape.heads.is_multiple_of(shape.kv_heads)
    {
        return Err(unsupported(format!(
            "q/k heads of {} {} values as rows of {} query and {} key/value heads of {}: \
             f32 rows of whole groups needed",
            x.len(),
            x.dtype(),
            shape.heads,
            shape.kv_heads,
            shape.head_dim
        )));
    }
    Ok(x.len() / width)
}

fn qk_move(
    grouped: &CudaTensor,
    q: &CudaTensor,
    k: &CudaTensor,
    shape: RotaryShape,
    rows: usize,
    scatter: bool,
) -> Result<(), CudaError> {
    let n = rows * (shape.heads + shape.kv_heads) * shape.head_dim;
    grouped.device().launch(
        "llama.cu",
        "qk_heads_f32",
        Launch::grid_stride(n, THREADS, MAX_BLOCKS),
        Args::new()
            .ptr(grouped.ptr())
            .ptr(q.ptr())
            .ptr(k.ptr())
            .usize_as_i32(rows)
            .usize_as_i32(shape.heads)
            .usize_as_i32(shape.kv_heads)
            .usize_as_i32(shape.head_dim)
            .i32(scatter as i32),
    )
}

/// The gradient of [`rotary_forward`]: `dy` `[B·T, 3·H·hd]` → `[B·T, (H + 2·H_kv)·hd]` in
/// dy's dtype (each key/value head's gradient summed over its group's query heads in order).
pub fn rotary_backward(
    dy: &CudaTensor,
    shape: RotaryShape,
    cos: &CudaTensor,
    sin: &CudaTensor,
) -> Result<CudaTensor, CudaError> {
    rotary_pass(dy, shape, cos, sin, true)
}

/// One rotary pass, forward or backward: the kernels take the same arguments and one thread
/// unit per pair of values of the row they write (`kernels/llama.cu`).
fn rotary_pass(
    input: &CudaTensor,
    shape: RotaryShape,
    cos: &CudaTensor,
    sin: &CudaTensor,
    backward: bool,
) -> Result<CudaTensor, CudaError> {
    check_tables(shape, cos, sin)?;
    let rows = shape.batch * shape.seq;
    let (read, written, kernel, what, output) = if backward {
        let input_gradient = "the rotary pass's input gradient";
        let (read, written) = (shape.output_width(), shape.input_width());
        (
            read,
            written,
            "rotary_bwd",
            "rotary output gradient",
            input_gradient,
        )
    } else {
        let (read, written) = (shape.input_width(), shape.output_width());
        (
            read,
            written,
            "rotary_fwd",
            "rotary input",
            "the rotary pass's output",
        )
    };
    check_len(input, rows * read, what)?;
    let dev = input.device().clone();
    let out = CudaTensor::alloc(&dev, rows * written, input.dtype(), output)?;
    dev.launch(
        "llama.cu",
        &format!("{kernel}_{}", suffix(input.dtype())),
        pairs_launch(rows * written / 2, shape.head_dim / 2, input.dtype()),
        rotary_args(input, cos, sin, &out, shape),
    )?;
    Ok(out)
}

/// SwiGLU over rows `[a | b]` of `2·half` values: `silu(a)·b` (`half` values a row), in x's
/// dtype.
pub fn swiglu_forward(x: &CudaTensor, half: usize) -> Result<CudaTensor, CudaError> {
    let rows = swiglu_rows(x, half)?;
    let dev = x.device().clone();
    let y = CudaTensor::alloc(&dev, rows * half, x.dtype(), "SwiGLU's output")?;
    dev.launch(
        "llama.cu",
        &format!("swiglu_fwd_{}", suffix(x.dtype())),
        pairs_launch(rows * half, half, x.dtype()),
        Args::new()
            .ptr(x.ptr())
            .ptr(y.ptr())
            .usize_as_i32(rows)
            .usize_as_i32(half),
    )?;
    Ok(y)
}

/// The gradient of [`swiglu_forward`] from the kept input: `[da | db]` rows in x's dtype.
pub fn swiglu_backward(
    x: &CudaTensor,
    dy: &CudaTensor,
    half: usize,
) -> Result<CudaTensor, CudaError> {
    let rows = swiglu_rows(x, half)?;
    check_len(dy, rows * half, "SwiGLU output gradient")?;
    let dev = x.device().clone();
    let dy = to_dtype(dy, x.dtype())?;
    let dx = CudaTensor::alloc(&dev, x.len(), x.dtype(), "SwiGLU's input gradient")?;
    dev.launch(
        "llama.cu",
        &format!("swiglu_bwd_{}", suffix(x.dtype())),
        pairs_launch(rows * half, half, x.dtype()),
        Args::new()
            .ptr(x.ptr())
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .usize_as_i32(rows)
            .usize_as_i32(half),
    )?;
    Ok(dx)
}

fn swiglu_rows(x: &CudaTensor, half: usize) -> Result<usize, CudaError> {
    if half == 0 {
        return Err(unsupported("SwiGLU over rows of width 0".into()));
    }
    let rows = x.len() / (2 * half);
    check_len(x, rows * 2 * half, "SwiGLU input")?;
    Ok(rows)
}

/// Attention's shape: `qkv` `[batch, seq, 3·heads·head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// The head sizes the attention kernels are written for (a layer asks before any work:
/// `AttentionCore::refusal_on`).
pub const ATTENTION_HEAD_SIZES: [usize; 3] = [32, 64, 128];

impl AttnShape {
    pub fn dim(&self) -> usize {
        self.heads * self.head_dim
    }

    fn check(&self) -> Result<(), CudaError> {
        if !ATTENTION_HEAD_SIZES.contains(&self.head_dim) {
            return Err(unsupported(format!(
                "CUDA attention handles head sizes 32, 64 and 128; this model's heads are {} \
                 wide (dim / heads)",
                self.head_dim
            )));
        }
        if self.seq == 0 || self.batch == 0 {
            return Err(unsupported("attention over an empty batch".into()));
        }
        Ok(())
    }

    fn args(&self) -> Args {
        Args::new()
            .usize_as_i32(self.batch)
            .usize_as_i32(self.seq)
            .usize_as_i32(self.heads)
            .f32(1.0 / (self.head_dim as f32).sqrt())
    }
}

/// Query rows per block of the tensor-core attention kernels, and their threads.
pub const ATTN_TILE: usize = 64;
const ATTN_THREADS: u32 = 128;

/// Which tensor-core products the 16-bit attention kernels run (`attention.cu`'s `SyncMma`
/// and `WarpgroupMma`): the same algorithm, tiles and order of additions per warp, so the
/// two agree to the products' rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionProducts {
    /// `mma.sync` per warp, operands through `ldmatrix`: every GPU meshtrain runs on.
    MmaSync,
    /// Hopper's warpgroup products (`wgmma`), the streamed tiles read by the tensor cores
    /// straight from shared memory: compute capability 9.0, 16-bit, heads of 64 or 128.
    Warpgroup,
}

impl AttentionProducts {
    /// Whether `dev` runs the warpgroup kernels for `dtype` and heads of `head_dim`.
    pub fn warpgroup_fits(dev: &CudaDevice, dtype: DType, head_dim: usize) -> bool {
        dev.has_warpgroup_mma() && dtype != DType::F32 && [64, 128].contains(&head_dim)
    }

    /// The products attention runs on `dev`: `MESHTRAIN_ATTENTION_KERNELS=wgmma` asks for
    /// the warpgroup kernels wherever they fit ([`Self::warpgroup_fits`]; other shapes keep
    /// `mma.sync`), and is refused by name on a GPU without them; unset or `mma`, `mma.sync`.
    /// (The warpgroup kernels are opt-in until a card has run gpu-check's comparison of them
    /// with the CPU: docs/gpu.md.)
    pub fn chosen(dev: &CudaDevice, dtype: DType, head_dim: usize) -> Result<Self, CudaError> {
        static ASKED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let asked =
            ASKED.get_or_init(|| std::env::var("MESHTRAIN_ATTENTION_KERNELS").unwrap_or_default());
        match asked.as_str() {
            "" | "mma" => Ok(Self::MmaSync),
            "wgmma" if !dev.has_warpgroup_mma() => Err(unsupported(format!(
                "MESHTRAIN_ATTENTION_KERNELS=wgmma needs Hopper's warpgroup products (compute \
                 capability 9.0: H100, H200); {} is sm_{}",
                dev.name(),
                dev.arch()
            ))),
            "wgmma" if Self::warpgroup_fits(dev, dtype, head_dim) => Ok(Self::Warpgroup),
            "wgmma" => Ok(Self::MmaSync),
            other => Err(unsupported(format!(
                "MESHTRAIN_ATTENTION_KERNELS={other}: the attention kernels are `mma` (the \
                 default) or `wgmma` (Hopper)"
            ))),
        }
    }

    /// Its name in reports: `mma.sync` or `wgmma`.
    pub fn name(self) -> &'static str {
        match self {
            Self::MmaSync => "mma.sync",
            Self::Warpgroup => "wgmma",
        }
    }

    /// The kernel-name infix: `attn_{part}{infix}_{dtype}_hd{head_dim}`.
    fn infix(self) -> &'static str {
        match self {
            Self::MmaSync => "",
            Self::Warpgroup => "_wg",
        }
    }
}

/// Dynamic shared memory of the tensor-core kernels (bytes), by kernel, head size and
/// products: the layouts at the top of `attention.cu`.
pub fn attention_smem(kernel: &str, head_dim: usize, products: AttentionProducts) -> u32 {
    // A 64-row 16-bit tile: rows padded by 8 values (16 bytes) under mma.sync, unpadded core
    // matrices for the warpgroup kernels.
    let tile = match products {
        AttentionProducts::MmaSync => ATTN_TILE * (head_dim + 8) * 2,
        AttentionProducts::Warpgroup => ATTN_TILE * head_dim * 2,
    };
    (match kernel {
        // Q; K and V, two buffers each.
        "fwd" => 5 * tile,
        // K, V (the block's); Q and dO, two buffers each; lse and D rows, two each.
        "dkdv" => 6 * tile + 4 * ATTN_TILE * 4,
        // Q, dO (the block's); K and V, two buffers each.
        "dq" => 6 * tile,
        _ => 0,
    }) as u32
}

/// Causal attention forward: `(out [batch, seq, heads·hd] in qkv's dtype, lse [batch, heads,
/// seq] f32)`, each query seeing at most `window` keys when given (Mistral's sliding
/// window). 16-bit inputs run the tensor-core kernel ([`AttentionProducts::chosen`]), f32 the
/// exact one.
pub fn attention_forward(
    qkv: &CudaTensor,
    shape: AttnShape,
    window: Option<usize>,
) -> Result<(CudaTensor, CudaTensor), CudaError> {
    let products = AttentionProducts::chosen(qkv.device(), qkv.dtype(), shape.head_dim)?;
    attention_forward_with(qkv, shape, window, products)
}

/// [`attention_forward`] on the given products (gpu-check compares both with the CPU).
pub fn attention_forward_with(
    qkv: &CudaTensor,
    shape: AttnShape,
    window: Option<usize>,
    products: AttentionProducts,
) -> Result<(CudaTensor, CudaTensor), CudaError> {
    let window = checked_args(qkv, shape, window, products)?;
    let AttnShape {
        batch,
        seq,
        heads,
        head_dim,
    } = shape;
    check_len(qkv, batch * seq * 3 * shape.dim(), "attention q/k/v")?;
    let dev = qkv.device().clone();
    let dtype = qkv.dtype();
    let out = CudaTensor::alloc(&dev, batch * seq * shape.dim(), dtype, "attention output")?;
    let lse = CudaTensor::alloc(
        &dev,
        batch * heads * seq,
        DType::F32,
        "attention log-sum-exps",
    )?;
    let args = append(
        Args::new().ptr(qkv.ptr()).ptr(out.ptr()).ptr(lse.ptr()),
        shape.args(),
    )
    .i32(window);
    let launch = attention_launch(shape, dtype, "fwd", products);
    dev.launch(
        "attention.cu",
        &attention_kernel("fwd", dtype, head_dim, products),
        launch,
        args,
    )?;
    Ok((out, lse))
}

/// The fused attention kernels' checks before a launch: the shape they take, the
/// warpgroup kernels refused where they do not fit (an f32 tensor, a head size without them,
/// a GPU other than compute capability 9.0); returns the kernels' `window` argument.
fn checked_args(
    qkv: &CudaTensor,
    shape: AttnShape,
    window: Option<usize>,
    products: AttentionProducts,
) -> Result<i32, CudaError> {
    shape.check()?;
    let fits = AttentionProducts::warpgroup_fits(qkv.device(), qkv.dtype(), shape.head_dim);
    if products == AttentionProducts::Warpgroup && !fits {
        return Err(unsupported(format!(
            "the warpgroup (wgmma) attention kernels take bf16 or f16 heads of 64 or 128 on \
             compute capability 9.0; this is {:?} heads of {} on sm_{}",
            qkv.dtype(),
            shape.head_dim,
            qkv.device().arch()
        )));
    }
    window_arg(window, shape.seq)
}

fn append(a: Args, b: Args) -> Args {
    a.append(b)
}

/// The kernels' `window` argument over `seq` rows (or cached positions): the keys a query
/// sees at most, 0 for every earlier one (also for a window no shorter than the rows, which
/// hides nothing: the kernels' bounds then stay far from `int`'s end).
pub(crate) fn window_arg(window: Option<usize>, seq: usize) -> Result<i32, CudaError> {
    match window {
        Some(0) => Err(unsupported(
            "a sliding window of no keys (each query sees itself)".into(),
        )),
        Some(w) if w < seq => {
            i32::try_from(w).map_err(|_| unsupported(format!("a sliding window of {w} keys")))
        }
        _ => Ok(0),
    }
}

/// Kernel names of `attention.cu`: `attn_{part}_{dtype}_hd{head_dim}`, the warpgroup ones
/// `attn_{part}_wg_{dtype}_hd{head_dim}`.
pub fn attention_kernel(
    part: &str,
    dtype: DType,
    head_dim: usize,
    products: AttentionProducts,
) -> String {
    format!(
        "attn_{part}{}_{}_hd{head_dim}",
        products.infix(),
        suffix(dtype)
    )
}

/// The launch of an attention kernel: tensor-core kernels take a 64-row tile per block of
/// 128 threads (one warpgroup); the f32 kernels a warp per query (or key) row, 4 rows per
/// block.
pub fn attention_launch(
    shape: AttnShape,
    dtype: DType,
    part: &str,
    products: AttentionProducts,
) -> Launch {
    let bh = (shape.batch * shape.heads) as u32;
    if dtype == DType::F32 {
        return Launch {
            grid: (shape.seq.div_ceil(4) as u32, bh, 1),
            block: (128, 1, 1),
            smem: 0,
        };
    }
    Launch {
        grid: (shape.seq.div_ceil(ATTN_TILE) as u32, bh, 1),
        block: (ATTN_THREADS, 1, 1),
        smem: attention_smem(part, shape.head_dim, products),
    }
}

/// Causal attention backward: `dqkv` in qkv's dtype from the kept `qkv`, `out`, `lse` and
/// the output gradient (under the forward's `window`).
pub fn attention_backward(
    qkv: &CudaTensor,
    out: &CudaTensor,
    lse: &CudaTensor,
    dout: &CudaTensor,
    shape: AttnShape,
    window: Option<usize>,
) -> Result<CudaTensor, CudaError> {
    let products = AttentionProducts::chosen(qkv.device(), qkv.dtype(), shape.head_dim)?;
    attention_backward_with(qkv, out, lse, dout, shape, window, products)
}

/// [`attention_backward`] on the given products.
pub fn attention_backward_with(
    qkv: &CudaTensor,
    out: &CudaTensor,
    lse: &CudaTensor,
    dout: &CudaTensor,
    shape: AttnShape,
    window: Option<usize>,
    products: AttentionProducts,
) -> Result<CudaTensor, CudaError> {
    let window = checked_args(qkv, shape, window, products)?;
    let AttnShape {
        batch,
        seq,
        heads,
        head_dim,
    } = shape;
    let dtype = qkv.dtype();
    check_len(out, batch * seq * shape.dim(), "attention output")?;
    check_len(lse, batch * heads * seq, "attention log-sum-exps")?;
    let dev = qkv.device().clone();
    let (dout, d_rows) = attention_d_rows(out, dout, dtype, shape)?;
    let dqkv = CudaTensor::alloc(&dev, qkv.len(), dtype, "attention input gradient")?;
    for part in ["dkdv", "dq"] {
        dev.launch(
            "attention.cu",
            &attention_kernel(part, dtype, head_dim, products),
            attention_launch(shape, dtype, part, products),
            append(
                Args::new()
                    .ptr(qkv.ptr())
                    .ptr(dout.ptr())
                    .ptr(lse.ptr())
                    .ptr(d_rows.ptr())
                    .ptr(dqkv.ptr()),
                shape.args(),
            )
            .i32(window),
        )?;
    }
    Ok(dqkv)
}

/// Backward's `D = rowsum(dO ∘ O)` per (sample, head, query) `[batch, heads, seq]` f32, and
/// the output gradient in `dtype` (the kernels' operand type).
fn attention_d_rows(
    out: &CudaTensor,
    dout: &CudaTensor,
    dtype: DType,
    shape: AttnShape,
) -> Result<(CudaTensor, CudaTensor), CudaError> {
    let AttnShape {
        batch,
        seq,
        heads,
        head_dim,
    } = shape;
    // The prep kernel reads 16 bytes at a time.
    let out = aligned16(to_dtype(out, dtype)?)?;
    let dout = aligned16(to_dtype(dout, dtype)?)?;
    check_len(&dout, out.len(), "attention output gradient")?;
    let dev = out.device().clone();
    let d_rows = CudaTensor::alloc(&dev, batch * heads * seq, DType::F32, "attention D")?;
    dev.launch(
        "attention.cu",
        &format!("attn_bwd_prep_{}", suffix(dtype)),
        // HD / 8 threads a (sample, head, query) row (attention.cu's backward_prep).
        Launch::grid_stride(batch * heads * seq * head_dim / 8, 256, MAX_BLOCKS * 4),
        append(
            Args::new()
                .ptr(out.ptr())
                .ptr(dout.ptr())
                .ptr(d_rows.ptr())
                .usize_as_i32(head_dim),
            shape.args(),
        ),
    )?;
    Ok((dout, d_rows))
}

/// Ring attention on a rank's block of `shape.seq` rows per sample (its load-balanced
/// chunks): the forward meets the key/value blocks of the ring one at a time, each as
/// [`BlockPair`]s of this block's query rows against the held block's key rows, and keeps
/// the normalised output and log-sum-exp in f32 between them (each pair's result merged by
/// the log-sum-exp rule inside the kernel); the backward takes the final log-sum-exp and
/// adds each pair's gradients into f32 accumulators (dQ here, dK and dV into the held
/// block's, which travels). `parallel::context::RingAttention` drives these over the ring.
pub mod ring {
    use super::*;
    use crate::flash::BlockPair;

    /// The forward's state: the output `[batch, seq, dim]` and log-sum-exp `[batch, heads,
    /// seq]`, f32, before any key (log-sum-exp −∞).
    pub struct RingState {
        pub out: CudaTensor,
        pub lse: CudaTensor,
    }

    /// Checks a pair against the block's rows before any launch (the kernels trust it).
    pub fn check_pair(shape: AttnShape, pair: BlockPair) -> Result<(), CudaError> {
        let BlockPair {
            q_start,
            kv_start,
            q_len,
            kv_len,
            ..
        } = pair;
        if let Some(window) = pair.window {
            return Err(unsupported(format!(
                "a sliding window of {window} keys (Mistral's) in ring attention on the GPU"
            )));
        }
        if q_len == 0 || kv_len == 0 || q_start + q_len > shape.seq || kv_start + kv_len > shape.seq
        {
            return Err(unsupported(format!(
                "a ring attention pair {pair:?} outside the block's {} rows (or empty)",
                shape.seq
            )));
        }
        Ok(())
    }

    fn pair_args(shape: AttnShape, pair: BlockPair) -> Args {
        Args::new()
            .usize_as_i32(shape.batch)
            .usize_as_i32(shape.seq)
            .usize_as_i32(shape.heads)
            .usize_as_i32(pair.q_start)
            .usize_as_i32(pair.kv_start)
            .usize_as_i32(pair.q_len)
            .usize_as_i32(pair.kv_len)
            .i32(i32::from(pair.causal))
            .f32(1.0 / (shape.head_dim as f32).sqrt())
    }

    /// The launch of a pair's kernel: as [`attention_launch`] over the rows the kernel's
    /// blocks walk (queries for `fwd` and `dq`, keys for `dkdv`).
    pub fn pair_launch(shape: AttnShape, dtype: DType, part: &str, pair: BlockPair) -> Launch {
        let rows = if part == "dkdv" {
            pair.kv_len
        } else {
            pair.q_len
        };
        attention_launch(
            AttnShape { seq: rows, ..shape },
            dtype,
            part,
            AttentionProducts::MmaSync,
        )
    }

    fn rows_of(shape: AttnShape) -> usize {
        shape.batch * shape.seq
    }

    /// The keys and values of this rank's fused q/k/v: the block `[batch, seq, 2·dim]` that
    /// travels around the ring, in q/k/v's dtype.
    pub fn keys_values(qkv: &CudaTensor, shape: AttnShape) -> Result<CudaTensor, CudaError> {
        shape.check()?;
        let (n, d) = (rows_of(shape), shape.dim());
        check_len(qkv, n * 3 * d, "ring attention q/k/v")?;
        moved(
            "attn_ring_kv",
            &[qkv],
            n * 2 * d,
            qkv.dtype(),
            shape,
            "key/value block",
        )
    }

    /// `attention.cu`'s `{kernel}_{dtype}` over `rows_of(shape)` rows: `inputs`, then a new
    /// tensor of `len` values of `dtype` it writes, then the rows and the width.
    fn moved(
        kernel: &str,
        inputs: &[&CudaTensor],
        len: usize,
        dtype: DType,
        shape: AttnShape,
        what: &str,
    ) -> Result<CudaTensor, CudaError> {
        let dev = inputs[0].device();
        let out = CudaTensor::alloc(dev, len, dtype, &format!("ring attention {what}"))?;
        let args = inputs.iter().fold(Args::new(), |a, t| a.ptr(t.ptr()));
        dev.launch(
            "attention.cu",
            &format!("{kernel}_{}", suffix(dtype)),
            Launch::grid_stride(len, 256, MAX_BLOCKS),
            args.ptr(out.ptr())
                .i64(rows_of(shape) as i64)
                .usize_as_i32(shape.dim()),
        )?;
        Ok(out)
    }

    /// f32 zeros of `len` values (an accumulator), or with `lse` a log-sum-exp of −∞ beside.
    fn started(
        dev: &Arc<CudaDevice>,
        len: usize,
        lse: usize,
        what: &str,
    ) -> Result<(CudaTensor, CudaTensor), CudaError> {
        let out = CudaTensor::alloc(dev, len, DType::F32, what)?;
        let l = CudaTensor::alloc(dev, lse.max(1), DType::F32, "ring attention log-sum-exps")?;
        dev.launch(
            "attention.cu",
            "attn_ring_start",
            Launch::grid_stride(len.max(lse), 256, MAX_BLOCKS),
            Args::new()
                .ptr(out.ptr())
                .i64(len as i64)
                .ptr(l.ptr())
                .i64(lse as i64),
        )?;
        Ok((out, l))
    }

    /// The forward's state before any key.
    pub fn start(dev: &Arc<CudaDevice>, shape: AttnShape) -> Result<RingState, CudaError> {
        shape.check()?;
        let (out, lse) = started(
            dev,
            rows_of(shape) * shape.dim(),
            shape.batch * shape.heads * shape.seq,
            "ring attention output",
        )?;
        Ok(RingState { out, lse })
    }

    /// An f32 gradient accumulator of `len` zeros.
    pub fn accumulator(dev: &Arc<CudaDevice>, len: usize) -> Result<CudaTensor, CudaError> {
        Ok(started(dev, len, 0, "ring attention gradient accumulator")?.0)
    }

    /// Merges `pair` of this rank's queries (`qkv`) against the held block `kv` into `state`.
    pub fn forward_pair(
        qkv: &CudaTensor,
        kv: &CudaTensor,
        state: &mut RingState,
        shape: AttnShape,
        pair: BlockPair,
    ) -> Result<(), CudaError> {
        check_pair(shape, pair)?;
        let (n, d, dtype) = (rows_of(shape), shape.dim(), qkv.dtype());
        check_len(qkv, n * 3 * d, "ring attention q/k/v")?;
        check_len(kv, n * 2 * d, "ring attention key/value block")?;
        check_len(&state.out, n * d, "ring attention output")?;
        check_len(
            &state.lse,
            shape.batch * shape.heads * shape.seq,
            "ring attention log-sum-exps",
        )?;
        check_dtype(kv, dtype, "ring attention key/value block")?;
        qkv.device().launch(
            "attention.cu",
            &attention_kernel(
                "ring_fwd",
                dtype,
                shape.head_dim,
                AttentionProducts::MmaSync,
            ),
            pair_launch(shape, dtype, "fwd", pair),
            Args::new()
                .ptr(qkv.ptr())
                .ptr(kv.ptr())
                .ptr(state.out.ptr())
                .ptr(state.lse.ptr())
                .append(pair_args(shape, pair)),
        )
    }

    /// What the backward of every pair reads: the output gradient in q/k/v's dtype and the
    /// rows' `D = Σ dO ∘ O`, from the forward's final output (in any dtype).
    pub fn backward_rows(
        out: &CudaTensor,
        dout: &CudaTensor,
        dtype: DType,
        shape: AttnShape,
    ) -> Result<(CudaTensor, CudaTensor), CudaError> {
        shape.check()?;
        check_len(out, rows_of(shape) * shape.dim(), "ring attention output")?;
        attention_d_rows(out, dout, dtype, shape)
    }

    /// Adds `pair`'s dQ into `dq` `[batch, seq, dim]` and its dK, dV into `dkv` (the held
    /// block's accumulator, `[batch, seq, 2·dim]`), both f32; `lse` is the forward's final.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_pair(
        qkv: &CudaTensor,
        kv: &CudaTensor,
        (dout, d_rows): (&CudaTensor, &CudaTensor),
        lse: &CudaTensor,
        dq: &mut CudaTensor,
        dkv: &mut CudaTensor,
        shape: AttnShape,
        pair: BlockPair,
    ) -> Result<(), CudaError> {
        check_pair(shape, pair)?;
        let (n, d, dtype) = (rows_of(shape), shape.dim(), qkv.dtype());
        let stats = shape.batch * shape.heads * shape.seq;
        check_len(qkv, n * 3 * d, "ring attention q/k/v")?;
        check_len(kv, n * 2 * d, "ring attention key/value block")?;
        check_len(dout, n * d, "ring attention output gradient")?;
        check_len(lse, stats, "ring attention log-sum-exps")?;
        check_len(d_rows, stats, "ring attention D")?;
        check_len(dq, n * d, "ring attention dQ accumulator")?;
        check_len(dkv, n * 2 * d, "ring attention dK/dV accumulator")?;
        check_dtype(kv, dtype, "ring attention key/value block")?;
        check_dtype(dout, dtype, "ring attention output gradient")?;
        for (part, acc) in [("dkdv", &*dkv), ("dq", &*dq)] {
            check_dtype(acc, DType::F32, "ring attention gradient accumulator")?;
            qkv.device().launch(
                "attention.cu",
                &attention_kernel(
                    &format!("ring_{part}"),
                    dtype,
                    shape.head_dim,
                    AttentionProducts::MmaSync,
                ),
                pair_launch(shape, dtype, part, pair),
                Args::new()
                    .ptr(qkv.ptr())
                    .ptr(kv.ptr())
                    .ptr(dout.ptr())
                    .ptr(lse.ptr())
                    .ptr(d_rows.ptr())
                    .ptr(acc.ptr())
                    .append(pair_args(shape, pair)),
            )?;
        }
        Ok(())
    }

    /// The fused gradient `[batch, seq, 3·dim]` in `dtype` from the dQ accumulator and this
    /// rank's own block's dK/dV accumulator (home after a whole turn of the ring).
    pub fn join(
        dq: &CudaTensor,
        dkv: &CudaTensor,
        dtype: DType,
        shape: AttnShape,
    ) -> Result<CudaTensor, CudaError> {
        let (n, d) = (rows_of(shape), shape.dim());
        check_len(dq, n * d, "ring attention dQ accumulator")?;
        check_len(dkv, n * 2 * d, "ring attention dK/dV accumulator")?;
        moved(
            "attn_ring_join",
            &[dq, dkv],
            n * 3 * d,
            dtype,
            shape,
            "input gradient",
        )
    }
}

/// Per-row losses and correct flags of a cross-entropy kernel, device scratch, summed into a
/// step's two f64 by `xent_sum` (a fixed-order sum).
struct RowLosses {
    scratch: super::DevBuf,
    rows: usize,
}

impl RowLosses {
    fn new(dev: &Arc<CudaDevice>, rows: usize) -> Result<RowLosses, CudaError> {
        Ok(RowLosses {
            scratch: dev.alloc(rows * 8, "per-row losses")?,
            rows,
        })
    }

    fn losses(&self) -> u64 {
        self.scratch.ptr()
    }

    fn correct(&self) -> u64 {
        self.scratch.ptr() + (self.rows * 4) as u64
    }

    /// Σ loss and Σ correct added into the two f64 at `sums`.
    fn add_into(&self, sums: u64) -> Result<(), CudaError> {
        self.scratch.device().launch(
            "cross_entropy.cu",
            "xent_sum",
            Launch::linear(1, 256),
            Args::new()
                .ptr(self.losses())
                .ptr(self.correct())
                .usize_as_i32(self.rows)
                .ptr(sums),
        )
    }
}

/// `t` as a kernel may overwrite it (when it will: `write`): itself when no one else reads
/// it, else a copy.
pub fn writable(t: CudaTensor, write: bool) -> Result<CudaTensor, CudaError> {
    if !write || t.is_unique() {
        return Ok(t);
    }
    let dev = t.device();
    let copy = CudaTensor::alloc(dev, t.len(), t.dtype(), "a tensor written in place")?;
    dev.copy(copy.ptr(), t.ptr(), t.bytes())?;
    Ok(copy)
}

/// Fused softmax cross-entropy over rows of `classes` logits: adds Σ loss and Σ correct into
/// the two doubles at `sums`, and (with `grad_scale`) overwrites the logits with the gradient
/// of `grad_scale · Σ loss` (grad_scale includes 1/rows), returning them.
pub fn cross_entropy(
    logits: CudaTensor,
    targets: u64,
    rows: usize,
    classes: usize,
    grad_scale: Option<f32>,
    sums: u64,
) -> Result<Option<CudaTensor>, CudaError> {
    check_len(&logits, rows * classes, "cross-entropy logits")?;
    let dev = logits.device().clone();
    let rows_out = RowLosses::new(&dev, rows)?;
    let (losses, correct) = (rows_out.losses(), rows_out.correct());
    let logits = writable(logits, grad_scale.is_some())?;
    dev.launch(
        "cross_entropy.cu",
        &format!("softmax_xent_{}", suffix(logits.dtype())),
        Launch::linear(rows.min(65_535), 512),
        Args::new()
            .ptr(logits.ptr())
            .ptr(targets)
            .ptr(losses)
            .ptr(correct)
            .usize_as_i32(rows)
            .usize_as_i32(classes)
            .f32(grad_scale.unwrap_or(0.0))
            .i32(grad_scale.is_some() as i32),
    )?;
    rows_out.add_into(sums)?;
    Ok(grad_scale.map(|_| logits))
}

/// The vocabulary-parallel cross-entropy's kernels (tensor parallelism's loss): this rank
/// holds `cols` logits of each of `rows` rows (its share of the padded vocabulary), the first
/// `real` of them the real ids `start..start + real`. The caller all-reduces the maxima
/// (max) after [`VocabParallelXent::maxima`] and the sums (sum) after
/// [`VocabParallelXent::sums`]: per-row numbers, never the logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabParallelXent {
    pub rows: usize,
    pub cols: usize,
    pub real: usize,
    pub start: usize,
}

impl VocabParallelXent {
    fn launch(&self) -> Launch {
        Launch::linear(self.rows.min(65_535), 256)
    }

    /// The kernels' shape arguments: rows, columns and real ids (and with `start`, where
    /// they begin).
    fn shape_args(&self, args: Args, start: bool) -> Args {
        let args = args
            .usize_as_i32(self.rows)
            .usize_as_i32(self.cols)
            .usize_as_i32(self.real);
        if start {
            args.usize_as_i32(self.start)
        } else {
            args
        }
    }

    fn check(&self, logits: &CudaTensor) -> Result<(), CudaError> {
        if self.real > self.cols {
            return Err(unsupported(format!(
                "vocabulary-parallel cross-entropy: {} real ids in {} columns",
                self.real, self.cols
            )));
        }
        check_len(logits, self.rows * self.cols, "vocabulary-parallel logits")
    }

    /// Each row's maximum over this rank's real logits, `[rows]` f32.
    pub fn maxima(&self, logits: &CudaTensor) -> Result<CudaTensor, CudaError> {
        self.check(logits)?;
        let dev = logits.device();
        let m = CudaTensor::alloc(dev, self.rows, DType::F32, "the logits' row maxima")?;
        dev.launch(
            "cross_entropy.cu",
            &format!("vp_xent_max_{}", suffix(logits.dtype())),
            self.launch(),
            self.shape_args(Args::new().ptr(logits.ptr()).ptr(m.ptr()), false),
        )?;
        Ok(m)
    }

    /// `[rows]` Σ exp(x − m) over this rank's real logits, then `[rows]` the target's logit
    /// where this rank holds it (0 elsewhere); `m` the group's maxima, `targets` i32 on the
    /// device.
    pub fn sums(
        &self,
        logits: &CudaTensor,
        targets: u64,
        m: &CudaTensor,
    ) -> Result<CudaTensor, CudaError> {
        self.check(logits)?;
        check_len(m, self.rows, "the logits' row maxima")?;
        let dev = logits.device();
        let sums = CudaTensor::alloc(dev, 2 * self.rows, DType::F32, "the softmax sums")?;
        dev.launch(
            "cross_entropy.cu",
            &format!("vp_xent_sums_{}", suffix(logits.dtype())),
            self.launch(),
            self.shape_args(
                Args::new()
                    .ptr(logits.ptr())
                    .ptr(targets)
                    .ptr(m.ptr())
                    .ptr(sums.ptr()),
                true,
            ),
        )?;
        Ok(sums)
    }

    /// The losses and correct counts added into the two f64 at `step_sums` (as
    /// [`cross_entropy`]), and with `grad_scale` the gradient of `grad_scale × Σ loss`
    /// written over the logits (padding columns 0) and returned; `m` and `sums` the group's.
    pub fn finish(
        &self,
        logits: CudaTensor,
        targets: u64,
        (m, sums): (&CudaTensor, &CudaTensor),
        grad_scale: Option<f32>,
        step_sums: u64,
    ) -> Result<Option<CudaTensor>, CudaError> {
        self.check(&logits)?;
        check_len(sums, 2 * self.rows, "the softmax sums")?;
        let dev = logits.device().clone();
        let rows_out = RowLosses::new(&dev, self.rows)?;
        let (losses, correct) = (rows_out.losses(), rows_out.correct());
        let logits = writable(logits, grad_scale.is_some())?;
        dev.launch(
            "cross_entropy.cu",
            &format!("vp_xent_finish_{}", suffix(logits.dtype())),
            self.launch(),
            self.shape_args(
                Args::new()
                    .ptr(logits.ptr())
                    .ptr(targets)
                    .ptr(m.ptr())
                    .ptr(sums.ptr())
                    .ptr(losses)
                    .ptr(correct),
                true,
            )
            .f32(grad_scale.unwrap_or(0.0))
            .i32(grad_scale.is_some() as i32),
        )?;
        rows_out.add_into(step_sums)?;
        Ok(grad_scale.map(|_| logits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `MESHTRAIN_FUSION`: on (or unset) turns nothing off, off everything, `off:` a list by
    /// name; an unknown name or form is an error that names what is accepted.
    #[test]
    fn the_fusion_setting_turns_off_what_it_names_and_refuses_the_rest() {
        assert_eq!(fusion_setting(None), Ok(vec![]));
        assert_eq!(fusion_setting(Some("on")), Ok(vec![]));
        assert_eq!(fusion_setting(Some("off")), Ok(Fusion::ALL.to_vec()));
        assert_eq!(
            fusion_setting(Some("off:epilogues, residual-add")),
            Ok(vec![Fusion::Epilogues, Fusion::ResidualAdd])
        );
        for f in Fusion::ALL {
            assert_eq!(
                fusion_setting(Some(&format!("off:{}", f.name()))),
                Ok(vec![f])
            );
        }
        let e = fusion_setting(Some("off:gelu")).unwrap_err();
        assert!(e.contains("\"gelu\"") && e.contains("rounded-grad"), "{e}");
        let e = fusion_setting(Some("no")).unwrap_err();
        assert!(e.contains("off:NAME"), "{e}");
    }

    /// The epilogues' descriptions mean a linear layer's arithmetic (evaluated on the host,
    /// the pointers host addresses): the forward with GELU gives `gelu_tanh(x·Wᵀ + b)` and
    /// the pre-activation, the input gradient through a GELU `(dy·W) × GELU′(z)`, the weight
    /// gradient with the bias gradient adds `dyᵀ·x` into `dW` and writes `Σ_rows dy`, on
    /// fresh random values (distinct sizes, so a swapped `m`/`n` or leading dimension reads
    /// the wrong elements).
    #[test]
    fn a_linear_layers_epilogues_compute_its_activation_and_bias_gradient() {
        use super::super::blas::run_on_host;
        use crate::activation::gelu_tanh;
        use crate::rng::normal_values;
        // Distinct sizes (widths a multiple of 8, as the epilogues' auxiliary matrices need).
        let (rows, inputs, outputs) = (7, 8, 24);
        let p = LinearProducts {
            shape: LinearShape {
                rows,
                inputs,
                outputs,
            },
            precision: DType::F32,
            math: F32Math::Exact,
        };
        let x = normal_values(rows * inputs, 1);
        let w = normal_values(outputs * inputs, 2);
        let b = normal_values(outputs, 3);
        let dy = normal_values(rows * outputs, 4);
        let addr = |v: &[f32]| v.as_ptr() as u64;
        let (mut y, mut z) = (vec![0.0f32; rows * outputs], vec![0.0f32; rows * outputs]);
        run_on_host(&p.forward_gelu(
            addr(&x),
            addr(&w),
            Some(addr(&b)),
            y.as_mut_ptr() as u64,
            z.as_mut_ptr() as u64,
        ));
        for r in 0..rows {
            for o in 0..outputs {
                let pre: f32 = (0..inputs)
                    .map(|i| x[r * inputs + i] * w[o * inputs + i])
                    .sum::<f32>()
                    + b[o];
                let at = r * outputs + o;
                assert!((z[at] - pre).abs() < 1e-5, "z[{r},{o}] {} vs {pre}", z[at]);
                assert!((y[at] - gelu_tanh(pre)).abs() < 1e-5, "y[{r},{o}]");
            }
        }
        // The input gradient through the previous layer's GELU: dz = (dy·W) × GELU′(pre).
        let pre = normal_values(rows * inputs, 6);
        let mut dz = vec![0.0f32; rows * inputs];
        run_on_host(&p.input_grad_dgelu(addr(&dy), addr(&w), dz.as_mut_ptr() as u64, addr(&pre)));
        for r in 0..rows {
            for i in 0..inputs {
                let dx: f32 = (0..outputs)
                    .map(|o| dy[r * outputs + o] * w[o * inputs + i])
                    .sum();
                let at = r * inputs + i;
                let want = dx * crate::activation::gelu_tanh_grad(pre[at]);
                assert!(
                    (dz[at] - want).abs() < 1e-5,
                    "dz[{r},{i}] {} vs {want}",
                    dz[at]
                );
            }
        }
        let start = normal_values(outputs * inputs, 5);
        let mut dw = start.clone();
        let mut db = vec![f32::NAN; outputs];
        run_on_host(&p.weight_grad_with_bias(
            addr(&x),
            addr(&dy),
            dw.as_mut_ptr() as u64,
            db.as_mut_ptr() as u64,
        ));
        for o in 0..outputs {
            let sum: f32 = (0..rows).map(|r| dy[r * outputs + o]).sum();
            assert!((db[o] - sum).abs() < 1e-5, "db[{o}] {} vs {sum}", db[o]);
            for i in 0..inputs {
                let grad: f32 = (0..rows)
                    .map(|r| dy[r * outputs + o] * x[r * inputs + i])
                    .sum();
                let at = o * inputs + i;
                assert!((dw[at] - start[at] - grad).abs() < 1e-5, "dW[{o},{i}]");
            }
        }
    }

    /// The descriptions the H100 run verified (session 12), now built in one place.
    #[test]
    fn a_linear_layers_products_in_column_major_terms() {
        let p = LinearProducts {
            shape: LinearShape {
                rows: 16384,
                inputs: 768,
                outputs: 2304,
            },
            precision: DType::BF16,
            math: F32Math::Exact,
        };
        let f = p.forward(1, 2, Some(3), 4);
        assert_eq!(
            (f.m, f.n, f.k, f.transa, f.transb),
            (2304, 16384, 768, true, false)
        );
        assert_eq!(
            (f.a, f.lda, f.b, f.ldb, f.d, f.ldd),
            (2, 768, 1, 768, 4, 2304)
        );
        assert_eq!(
            (f.epilogue, f.output, f.accumulate),
            (Epilogue::Bias(3), DType::BF16, false)
        );
        let i = p.input_grad(5, 2, 6);
        assert_eq!(
            (i.m, i.n, i.k, i.transa, i.transb),
            (768, 16384, 2304, false, false)
        );
        assert_eq!(
            (i.a, i.lda, i.b, i.ldb, i.d, i.ldd),
            (2, 768, 5, 2304, 6, 768)
        );
        assert_eq!(
            (i.epilogue, i.output, i.accumulate),
            (Epilogue::None, DType::BF16, false)
        );
        let w = p.weight_grad(1, 5, 7);
        assert_eq!(
            (w.m, w.n, w.k, w.transa, w.transb),
            (768, 2304, 16384, false, true)
        );
        assert_eq!(
            (w.a, w.lda, w.b, w.ldb, w.d, w.ldd),
            (1, 768, 5, 2304, 7, 768)
        );
        assert_eq!(
            (w.epilogue, w.output, w.accumulate),
            (Epilogue::None, DType::F32, true)
        );
        for g in [f, i, w] {
            g.validate().unwrap();
        }
    }

    /// The fused layer-norm backward where its vector path applies, from the shape alone.
    #[test]
    fn the_fused_norm_backward_runs_where_its_vector_path_applies() {
        // GPT-2's norms: 16,384 rows in 256 blocks; few rows, a warp each.
        assert_eq!(fused_norm_backward_blocks(16_384, 768, true), Some(256));
        assert_eq!(fused_norm_backward_blocks(100, 768, true), Some(13));
        assert_eq!(fused_norm_backward_blocks(1, 1024, true), Some(1));
        // The two kernels otherwise.
        for d in [130, 1028, 0] {
            assert_eq!(fused_norm_backward_blocks(64, d, true), None, "d {d}");
        }
        assert_eq!(fused_norm_backward_blocks(64, 768, false), None);
    }

    /// 16 bytes of a row per thread where the shape and pointer allow it, the scalar kernel
    /// otherwise; the rows per block (the summation order) never depend on the device.
    #[test]
    fn column_sums_take_the_vector_kernel_when_they_can() {
        // GPT-2's fc1 bias gradient: 384 lanes of 8 bf16 = 12 groups of 32, 64 row blocks.
        let p = ColumnSumPass::new(16384, 3072, DType::BF16, 0x1000);
        assert!(p.vector);
        assert_eq!(p.launch.grid, (12, 64, 1));
        assert_eq!(p.launch.block, (32, 8, 1));
        assert_eq!(p.rows_per_block, 256);
        // f32: 4 columns per lane; 768 columns = 6 groups; a short last row block.
        let p = ColumnSumPass::new(300, 768, DType::F32, 0x1000);
        assert!(p.vector);
        assert_eq!(p.launch.grid, (6, 2, 1));
        // A partial group of lanes: 8·33 bf16 columns.
        assert_eq!(
            ColumnSumPass::new(10, 264, DType::F16, 0).launch.grid,
            (2, 1, 1)
        );
        // Columns not a multiple of the vector, or a pointer not 16-byte aligned: scalar.
        for (cols, dtype, ptr) in [
            (3076, DType::BF16, 0x1000),
            (770, DType::F32, 0x1000),
            (3072, DType::BF16, 0x1008),
            (768, DType::F32, 0x1004),
        ] {
            let p = ColumnSumPass::new(16384, cols, dtype, ptr);
            assert!(!p.vector, "{cols} {dtype:?} {ptr:#x}");
            assert_eq!(
                p.launch.grid,
                (cols.div_ceil(256) as u32, 64, 1),
                "{cols} {dtype:?}"
            );
            assert_eq!(p.launch.block, (THREADS, 1, 1));
            assert_eq!(p.rows_per_block, ROWS_PER_BLOCK);
        }
        // No rows: one block of partials (zeros).
        assert_eq!(
            ColumnSumPass::new(0, 8, DType::BF16, 0).launch.grid,
            (1, 1, 1)
        );
    }

    #[test]
    fn token_groups_are_a_stable_sort_by_id() {
        let ids = [5, 2, 5, 0, 2, 5];
        let g = TokenGroups::of(&ids, 8);
        assert_eq!(g.uniq, vec![0, 2, 5]);
        assert_eq!(g.starts, vec![0, 1, 3, 6]);
        assert_eq!(g.order, vec![3, 1, 4, 0, 2, 5]);
        // Every row once; rows of an id in increasing order.
        for (u, &id) in g.uniq.iter().enumerate() {
            let rows = &g.order[g.starts[u] as usize..g.starts[u + 1] as usize];
            assert!(rows.windows(2).all(|w| w[0] < w[1]));
            assert!(rows.iter().all(|&r| ids[r as usize] == id));
        }
        // Tokens of other ranks' rows take no part.
        let g = TokenGroups::of(&[-1, 3, -1, 1, 3], 4);
        assert_eq!(
            (g.uniq, g.starts, g.order),
            (vec![1, 3], vec![0, 1, 3], vec![3, 1, 4])
        );
        let empty = TokenGroups::of(&[], 4);
        assert_eq!(
            (empty.order.len(), empty.starts, empty.uniq.len()),
            (0, vec![0], 0)
        );
    }

    #[test]
    fn token_ids_are_checked() {
        assert_eq!(token_ids(&[0.0, 3.0], 4).unwrap(), vec![0, 3]);
        let e = token_ids(&[4.0], 4).unwrap_err().to_string();
        assert!(e.contains("token id 4 outside vocabulary of 4"), "{e}");
        assert!(token_ids(&[1.5], 4).is_err());
        assert!(token_ids(&[-1.0], 4).is_err());
    }

    #[test]
    fn rotary_shapes_outside_the_kernels_are_refused_by_name() {
        let s = RotaryShape {
            batch: 2,
            seq: 8,
            heads: 6,
            kv_heads: 2,
            head_dim: 64,
        };
        assert!(check_rotary_shape(s).is_ok());
        let e = check_rotary_shape(RotaryShape { head_dim: 7, ..s })
            .unwrap_err()
            .to_string();
        assert!(e.contains("head size 7 is not even"), "{e}");
        let e = check_rotary_shape(RotaryShape { kv_heads: 4, ..s })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("6 query heads") && e.contains("4 key/value"),
            "{e}"
        );
        assert!(check_rotary_shape(RotaryShape { kv_heads: 0, ..s }).is_err());
    }

    /// 16 bytes of a row's half per thread where the half allows it, one value otherwise.
    #[test]
    fn pair_launches_cover_every_unit() {
        // 4096 pairs of f32 halves of 32: 1024 float4 units, 4 blocks of 256.
        assert_eq!(pairs_launch(4096, 32, DType::F32).grid, (4, 1, 1));
        // bf16: 8 values per unit.
        assert_eq!(pairs_launch(4096, 32, DType::BF16).grid, (2, 1, 1));
        // A half of 12 bf16 values: one value per unit.
        assert_eq!(pairs_launch(4096, 12, DType::BF16).grid, (16, 1, 1));
        assert_eq!(pairs_launch(0, 12, DType::F16).grid, (1, 1, 1));
        // Large passes are grid-strided.
        assert_eq!(
            pairs_launch(1 << 30, 1, DType::F32).grid.0 as usize,
            MAX_BLOCKS
        );
    }

    #[test]
    fn embedding_parameters_must_hold_the_tables() {
        assert!(check_embedding_params(10 * 4, 10, 4, None).is_ok());
        assert!(check_embedding_params(10 * 4 + 8 * 4, 10, 4, Some(&[0, 7])).is_ok());
        let e = check_embedding_params(10 * 4, 10, 4, Some(&[0, 1]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("10 x 4 token table and the positions"), "{e}");
        assert!(check_embedding_params(39, 10, 4, None).is_err());
    }

    #[test]
    fn attention_shapes_outside_the_kernels_are_refused_by_name() {
        // A sliding window: 0 keys refused, one no shorter than the rows passed as none.
        assert_eq!(window_arg(None, 16).unwrap(), 0);
        assert_eq!(window_arg(Some(5), 16).unwrap(), 5);
        assert_eq!(window_arg(Some(16), 16).unwrap(), 0);
        assert_eq!(window_arg(Some(usize::MAX), 16).unwrap(), 0);
        assert!(window_arg(Some(0), 16).is_err());
        let s = AttnShape {
            batch: 2,
            seq: 16,
            heads: 2,
            head_dim: 48,
        };
        let e = s.check().unwrap_err().to_string();
        assert!(
            e.contains("head sizes 32, 64 and 128") && e.contains("48"),
            "{e}"
        );
        assert!(AttnShape { head_dim: 64, ..s }.check().is_ok());
    }

    #[test]
    fn attention_launches_cover_the_sequence_and_fit_shared_memory() {
        use AttentionProducts::{MmaSync, Warpgroup};
        let s = AttnShape {
            batch: 16,
            seq: 1024,
            heads: 12,
            head_dim: 64,
        };
        let l = attention_launch(s, DType::BF16, "fwd", MmaSync);
        assert_eq!(l.grid, (16, 192, 1));
        assert_eq!(l.block, (128, 1, 1));
        // Ragged sequences get a last partial tile.
        let l = attention_launch(AttnShape { seq: 100, ..s }, DType::BF16, "dq", Warpgroup);
        assert_eq!(l.grid.0, 2);
        // Every kernel fits an H100's 227 KiB (and an A100's 163 KiB) at head size 128.
        for part in ["fwd", "dkdv", "dq"] {
            assert!(attention_smem(part, 128, MmaSync) <= 163 * 1024, "{part}");
            assert!(
                attention_smem(part, 128, Warpgroup) < attention_smem(part, 128, MmaSync),
                "{part}"
            );
        }
        // 64 × 72 16-bit values a tile at head size 64: Q + two K and two V buffers; the
        // backward kernels hold six tiles, dK/dV's also two rows each of lse and D.
        assert_eq!(attention_smem("fwd", 64, MmaSync), 5 * 9216);
        assert_eq!(attention_smem("fwd", 128, MmaSync), 5 * 64 * 136 * 2);
        assert_eq!(attention_smem("dkdv", 64, MmaSync), 6 * 9216 + 1024);
        assert_eq!(attention_smem("dq", 64, MmaSync), 6 * 9216);
        // The warpgroup kernels' tiles are unpadded core matrices (64 × 64 × 2 bytes).
        assert_eq!(attention_smem("fwd", 64, Warpgroup), 5 * 8192);
        assert_eq!(attention_smem("dkdv", 64, Warpgroup), 6 * 8192 + 1024);
        assert_eq!(attention_smem("dq", 128, Warpgroup), 6 * 16384);
        let l = attention_launch(s, DType::F32, "fwd", MmaSync);
        assert_eq!(l.grid, (256, 192, 1));
        assert_eq!(
            attention_kernel("dkdv", DType::F16, 128, MmaSync),
            "attn_dkdv_f16_hd128"
        );
        assert_eq!(
            attention_kernel("fwd", DType::BF16, 64, Warpgroup),
            "attn_fwd_wg_bf16_hd64"
        );
    }

    #[test]
    fn ring_pairs_are_checked_against_the_block_and_launched_over_their_rows() {
        use crate::flash::BlockPair;
        let s = AttnShape {
            batch: 2,
            seq: 200,
            heads: 3,
            head_dim: 64,
        };
        let pair = BlockPair {
            q_start: 100,
            kv_start: 0,
            q_len: 100,
            kv_len: 70,
            causal: false,
            window: None,
        };
        ring::check_pair(s, pair).unwrap();
        // Queries walk the forward's and dQ's blocks, keys dK/dV's.
        assert_eq!(
            ring::pair_launch(s, DType::BF16, "fwd", pair).grid,
            (2, 6, 1)
        );
        assert_eq!(
            ring::pair_launch(s, DType::BF16, "dq", pair).grid,
            (2, 6, 1)
        );
        let l = ring::pair_launch(s, DType::BF16, "dkdv", pair);
        assert_eq!(l.grid, (2, 6, 1));
        assert_eq!(
            l.smem,
            attention_smem("dkdv", 64, AttentionProducts::MmaSync)
        );
        assert_eq!(
            ring::pair_launch(s, DType::F32, "dkdv", pair).grid,
            (18, 6, 1)
        );
        assert_eq!(
            attention_kernel("ring_dkdv", DType::F32, 64, AttentionProducts::MmaSync),
            "attn_ring_dkdv_f32_hd64"
        );
        for bad in [
            BlockPair {
                q_start: 101,
                ..pair
            },
            BlockPair {
                kv_start: 131,
                ..pair
            },
            BlockPair { q_len: 0, ..pair },
        ] {
            let e = ring::check_pair(s, bad).unwrap_err().to_string();
            assert!(e.contains("outside the block's 200 rows"), "{e}");
        }
    }
}
