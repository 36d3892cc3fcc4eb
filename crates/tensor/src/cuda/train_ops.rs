//! What a training step does over the flat device buffers: optimizer updates (which also
//! refresh the 16-bit compute copy), the global gradient norm and its clipping factor, fp16
//! unscaling, tied-parameter gradient sums. The same rules as `meshtrain_nn::optim` on the
//! CPU; every reduction in a fixed order, so two runs are bit-identical.

use super::context::{Args, CudaDevice, DevBuf, Launch};
use super::error::CudaError;
use crate::DType;
use std::ops::Range;
use std::sync::Arc;

const THREADS: u32 = 256;
/// Blocks of the optimizer's grid-stride launches, and of the sum of squares: fixed (not
/// derived from the device), so the norm's summation order is the same on every GPU.
const UPDATE_BLOCKS: usize = 132 * 16;
pub const NORM_BLOCKS: usize = 1024;

/// Parameter groups as the kernels read them: element `i` belongs to the first segment whose
/// end exceeds it.
pub struct SegmentTable {
    ends: DevBuf,
    weight_decay: DevBuf,
    lr_scale: DevBuf,
    count: usize,
}

/// One group's run of the flat buffer: (end, weight decay, learning-rate scale).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SegmentRow {
    pub end: usize,
    pub weight_decay: f32,
    pub lr_scale: f32,
}

impl SegmentTable {
    pub fn new(dev: &Arc<CudaDevice>, rows: &[SegmentRow]) -> Result<SegmentTable, CudaError> {
        assert!(
            rows.windows(2).all(|w| w[0].end <= w[1].end),
            "segments in order"
        );
        let ends: Vec<i64> = rows.iter().map(|r| r.end as i64).collect();
        let wd: Vec<f32> = rows.iter().map(|r| r.weight_decay).collect();
        let lr: Vec<f32> = rows.iter().map(|r| r.lr_scale).collect();
        Ok(SegmentTable {
            ends: dev.upload(&ends, "optimizer segments")?,
            weight_decay: dev.upload(&wd, "optimizer segments")?,
            lr_scale: dev.upload(&lr, "optimizer segments")?,
            count: rows.len(),
        })
    }

    fn args(&self) -> Args {
        Args::new()
            .ptr(self.ends.ptr())
            .ptr(self.weight_decay.ptr())
            .ptr(self.lr_scale.ptr())
            .usize_as_i32(self.count)
    }
}

/// The flat buffers one optimizer updates.
#[derive(Clone, Copy, Debug)]
pub struct FlatState {
    pub params: u64,
    pub grads: u64,
    /// First moment (AdamW) or momentum (SGD).
    pub m: u64,
    /// Second moment (AdamW only).
    pub v: u64,
    /// The 16-bit compute copy to refresh, if any.
    pub half: Option<(u64, DType)>,
    pub len: usize,
}

fn half_suffix(half: Option<(u64, DType)>) -> (&'static str, u64) {
    match half {
        None | Some((_, DType::F32)) => ("none", 0),
        Some((p, DType::BF16)) => ("bf16", p),
        Some((p, DType::F16)) => ("f16", p),
    }
}

/// AdamW's hyper-parameters for one step.
#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// The step number (1 for the first update).
    pub step: u64,
}

/// One AdamW update, PyTorch's arrangement (as `meshtrain_nn::optim`): the bias corrections
/// folded into two scalars computed here in f32 exactly as the CPU does.
pub fn adamw(
    dev: &CudaDevice,
    s: FlatState,
    table: &SegmentTable,
    h: AdamW,
    grad_mul: Option<u64>,
) -> Result<(), CudaError> {
    let t = h.step as i32;
    let c1 = 1.0 - h.beta1.powi(t);
    let c2 = 1.0 - h.beta2.powi(t);
    let inv_sqrt_c2 = 1.0 / c2.sqrt();
    let (suffix, half) = half_suffix(s.half);
    dev.launch(
        "optimizer.cu",
        &format!("adamw_{suffix}"),
        Launch::grid_stride(s.len, THREADS, UPDATE_BLOCKS),
        Args::new()
            .ptr(s.params)
            .ptr(s.grads)
            .ptr(s.m)
            .ptr(s.v)
            .ptr(half)
            .i64(s.len as i64)
            .append(table.args())
            .f32(h.lr)
            .f32(h.beta1)
            .f32(h.beta2)
            .f32(h.eps)
            .f32(c1)
            .f32(inv_sqrt_c2)
            .ptr(grad_mul.unwrap_or(0)),
    )
}

/// One SGD (momentum) update.
pub fn sgd(
    dev: &CudaDevice,
    s: FlatState,
    table: &SegmentTable,
    lr: f32,
    momentum: f32,
    step: u64,
    grad_mul: Option<u64>,
) -> Result<(), CudaError> {
    let (suffix, half) = half_suffix(s.half);
    dev.launch(
        "optimizer.cu",
        &format!("sgd_{suffix}"),
        Launch::grid_stride(s.len, THREADS, UPDATE_BLOCKS),
        Args::new()
            .ptr(s.params)
            .ptr(s.grads)
            .ptr(s.m)
            .ptr(half)
            .i64(s.len as i64)
            .append(table.args())
            .f32(lr)
            .f32(momentum)
            .i32((step == 1) as i32)
            .ptr(grad_mul.unwrap_or(0)),
    )
}

/// The global L2 norm of the gradients in `ranges` of `grads` (tied copies left out by the
/// caller) into `out[0]`, and the clipping factor for `max_norm` into `out[1]` (1 when
/// there is nothing to clip): the optimizer multiplies the gradients by it, so the host
/// never waits for the norm. With `total`, the f64 sum of squares is written there too (a
/// worker's share of a norm summed over several).
pub fn grad_norm(
    dev: &Arc<CudaDevice>,
    grads: u64,
    ranges: &[Range<usize>],
    max_norm: Option<f32>,
    out: u64,
    total: Option<u64>,
) -> Result<(), CudaError> {
    let ranges: Vec<&Range<usize>> = ranges.iter().filter(|r| !r.is_empty()).collect();
    let slots = ranges.len().max(1) * NORM_BLOCKS;
    let partial = dev.alloc_zeroed(slots * 8, "gradient norm partials")?;
    for (i, r) in ranges.iter().enumerate() {
        dev.launch(
            "optimizer.cu",
            "sumsq_partial",
            Launch::linear(NORM_BLOCKS, THREADS),
            Args::new()
                .ptr(grads + (r.start * 4) as u64)
                .i64(r.len() as i64)
                .ptr(partial.ptr() + (i * NORM_BLOCKS * 8) as u64),
        )?;
    }
    dev.launch(
        "optimizer.cu",
        "norm_finish",
        Launch::linear(1, THREADS),
        Args::new()
            .ptr(partial.ptr())
            .usize_as_i32(slots)
            .f32(max_norm.unwrap_or(0.0))
            .ptr(out)
            .ptr(total.unwrap_or(0)),
    )
}

/// `g *= factor`, setting the int at `found_inf` to 1 if any result is not finite (fp16's
/// loss-scaling check).
pub fn unscale_check(
    dev: &CudaDevice,
    grads: u64,
    len: usize,
    factor: f32,
    found_inf: u64,
) -> Result<(), CudaError> {
    dev.launch(
        "elementwise.cu",
        "unscale_check_f32",
        Launch::grid_stride(len, THREADS, UPDATE_BLOCKS),
        Args::new()
            .ptr(grads)
            .i64(len as i64)
            .f32(factor)
            .ptr(found_inf),
    )
}

/// Both `a` and `b` become `a + b` (the gradients of a tied parameter's two places).
pub fn tie_sum(dev: &CudaDevice, a: u64, b: u64, len: usize) -> Result<(), CudaError> {
    dev.launch(
        "elementwise.cu",
        "tie_sum_f32",
        Launch::grid_stride(len, THREADS, UPDATE_BLOCKS),
        Args::new().ptr(a).ptr(b).i64(len as i64),
    )
}

/// A tensor cast to FP8 on the device ([`fp8_casts`]): its codes and the scalars beside them.
pub struct Fp8Cast {
    /// One byte a value: row-major `[rows, cols]`, or `[cols, rows]` when `transposed`.
    pub codes: DevBuf,
    /// The amax (its f32 bits, as an int) and `1 / scale`, two f32s, shared by the casts of
    /// one tensor.
    scalars: Arc<DevBuf>,
    pub format: crate::fp8::Fp8Format,
    pub transposed: bool,
}

impl Fp8Cast {
    /// The f32 that FP8 products multiply back by (cuBLASLt's `A_SCALE`/`B_SCALE` pointer).
    pub fn inv_scale(&self) -> u64 {
        self.scalars.ptr() + 4
    }

    /// The f32 holding the tensor's amax.
    pub fn amax(&self) -> u64 {
        self.scalars.ptr()
    }
}

/// [`fp8_casts`] with one layout.
#[allow(clippy::too_many_arguments)]
pub fn fp8_cast(
    dev: &Arc<CudaDevice>,
    x: u64,
    dtype: DType,
    rows: usize,
    cols: usize,
    format: crate::fp8::Fp8Format,
    transposed: bool,
) -> Result<Fp8Cast, CudaError> {
    let mut casts = fp8_casts(dev, x, dtype, rows, cols, format, &[transposed])?;
    Ok(casts.remove(0))
}

/// Current scaling's casts to FP8 of the row-major `[rows, cols]` values at `x` (f32 or
/// bf16, `dtype`): one amax pass (the largest |x|), then one cast per entry of `transposed`
/// (the codes as they are, or `[cols, rows]`: cuBLASLt's FP8 products take only "TN"
/// operands, so a tensor read by two products may be wanted both ways), each value times
/// `scale` = [`crate::fp8::current_scale`] of the amax, rounded to nearest even and
/// saturating: the codes of [`crate::fp8::Fp8Format::encode`]. The casts share the amax and
/// `1 / scale`, which stay on the device; nothing goes through the host.
#[allow(clippy::too_many_arguments)]
pub fn fp8_casts(
    dev: &Arc<CudaDevice>,
    x: u64,
    dtype: DType,
    rows: usize,
    cols: usize,
    format: crate::fp8::Fp8Format,
    transposed: &[bool],
) -> Result<Vec<Fp8Cast>, CudaError> {
    let kernel = |stem: &str| match dtype {
        DType::F32 | DType::BF16 => Ok(format!("{stem}_{}", super::ops::suffix(dtype))),
        DType::F16 => Err(CudaError::Unsupported(
            "FP8 casts of f16 values (they read f32 or bf16)".into(),
        )),
    };
    if transposed.contains(&true) && rows.div_ceil(32) > 65_535 {
        return Err(CudaError::Unsupported(format!(
            "an FP8 cast-transpose of {rows} rows (at most {} in one launch)",
            65_535 * 32
        )));
    }
    let len = rows * cols;
    let e4m3 = format == crate::fp8::Fp8Format::E4M3;
    let scalars = Arc::new(dev.alloc_zeroed(8, "an FP8 amax and scale")?);
    // Block 256: the amax's shared reduction assumes it.
    let flat = Launch::grid_stride(len, THREADS, UPDATE_BLOCKS);
    dev.launch(
        "fp8.cu",
        &kernel("fp8_amax")?,
        flat,
        Args::new().ptr(x).i64(len as i64).ptr(scalars.ptr()),
    )?;
    let mut casts = Vec::with_capacity(transposed.len());
    for &transposed in transposed {
        let cast = Fp8Cast {
            codes: dev.alloc(len.max(1), "FP8 codes")?,
            scalars: scalars.clone(),
            format,
            transposed,
        };
        let (name, launch, shape) = if transposed {
            let tiles = Launch {
                grid: (cols.div_ceil(32) as u32, rows.div_ceil(32) as u32, 1),
                block: (32, 8, 1),
                smem: 0,
            };
            let shape = Args::new().usize_as_i32(rows).usize_as_i32(cols);
            ("fp8_cast_transpose", tiles, shape)
        } else {
            ("fp8_cast", flat, Args::new().i64(len as i64))
        };
        dev.launch(
            "fp8.cu",
            &kernel(name)?,
            launch,
            Args::new()
                .ptr(x)
                .ptr(cast.codes.ptr())
                .append(shape)
                .i32(e4m3 as i32)
                .ptr(cast.amax())
                .ptr(cast.inv_scale()),
        )?;
        casts.push(cast);
    }
    Ok(casts)
}

/// `x *= s` over `len` f32 values.
pub fn scale(dev: &CudaDevice, x: u64, len: usize, s: f32) -> Result<(), CudaError> {
    dev.launch(
        "elementwise.cu",
        "scale_f32",
        Launch::grid_stride(len, THREADS, UPDATE_BLOCKS),
        Args::new().ptr(x).i64(len as i64).f32(s),
    )
}

/// A copy plan over flat f32 buffers (ZeRO's pieces into slots and back): `runs` is a device
/// table of `count` runs, three i64 each (source offset or −1 for zeros, destination
/// offset, length), the longest `max_len`; `add` adds instead of copying.
#[allow(clippy::too_many_arguments)]
pub fn copy_runs(
    dev: &CudaDevice,
    src: u64,
    dst: u64,
    runs: u64,
    count: usize,
    max_len: usize,
    add: bool,
) -> Result<(), CudaError> {
    if count == 0 {
        return Ok(());
    }
    // Runs over y (at most 65535 blocks there: the kernel strides over the rest), each run's
    // elements over x: as many blocks as the longest run needs, up to 64.
    let launch = copy_runs_launch(count, max_len);
    dev.launch(
        "elementwise.cu",
        "copy_runs_f32",
        launch,
        Args::new()
            .ptr(src)
            .ptr(dst)
            .ptr(runs)
            .usize_as_i32(count)
            .i32(add as i32),
    )
}

/// [`copy_runs`]'s launch shape: runs over y, each run's elements over x.
fn copy_runs_launch(count: usize, max_len: usize) -> Launch {
    Launch {
        grid: (
            max_len.div_ceil(THREADS as usize).clamp(1, 64) as u32,
            count.min(65_535) as u32,
            1,
        ),
        block: (THREADS, 1, 1),
        smem: 0,
    }
}

/// A copy plan over values of `dtype` (activations: Ulysses' reshuffles), copies only: the
/// f32 kernel, or the 16-bit one moving bf16 or f16 bits.
#[allow(clippy::too_many_arguments)]
pub fn copy_runs_of(
    dev: &CudaDevice,
    dtype: DType,
    src: u64,
    dst: u64,
    runs: u64,
    count: usize,
    max_len: usize,
) -> Result<(), CudaError> {
    if dtype == DType::F32 {
        return copy_runs(dev, src, dst, runs, count, max_len, false);
    }
    if count == 0 {
        return Ok(());
    }
    dev.launch(
        "elementwise.cu",
        "copy_runs_u16",
        copy_runs_launch(count, max_len),
        Args::new().ptr(src).ptr(dst).ptr(runs).usize_as_i32(count),
    )
}
