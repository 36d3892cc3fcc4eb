//! What a training step does over the flat device buffers: optimizer updates (which also
//! refresh the 16-bit compute copy), the global gradient norm and its clipping factor, fp16
//! unscaling, tied-parameter gradient sums. The same rules as `meshtrain_nn::optim` on the
//! CPU; every reduction in a fixed order, so two runs are bit-identical.

use super::context::{Args, CudaDevice, DevBuf, Launch};
use super::error::CudaError;
use super::CudaTensor;
use crate::DType;
use std::ops::Range;
use std::sync::Arc;

const THREADS: u32 = 256;
/// Blocks of the optimizer's grid-stride launches, and of the sum of squares: fixed (not
/// derived from the device), so the norm's summation order is the same on every GPU.
const UPDATE_BLOCKS: usize = 132 * 16;
pub const NORM_BLOCKS: usize = 1024;
/// Elements per block of the sum of squares below [`NORM_BLOCKS`] blocks: a short range
/// (ZeRO's shard pieces, a layer norm's gain) takes a block or a few, not 1,024 blocks of
/// idle threads. Still a function of the range alone, so the order is the same everywhere.
const NORM_ELEMENTS_PER_BLOCK: usize = 2048;

/// Blocks of the sum of squares over `len` elements.
fn norm_blocks(len: usize) -> usize {
    len.div_ceil(NORM_ELEMENTS_PER_BLOCK).clamp(1, NORM_BLOCKS)
}

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

/// The bytes of device memory an update's per-step values are written to ([`adamw`],
/// [`sgd`]): the kernels read them there rather than as arguments, so a step captured as a
/// CUDA graph ([`super::graph`]) replays the same launch every step.
pub const SCHEDULE_BYTES: usize = 16;

/// One AdamW update, PyTorch's arrangement (as `meshtrain_nn::optim`): the bias corrections
/// folded into two scalars computed here in f32 exactly as the CPU does, written with the
/// learning rate to `schedule` ([`SCHEDULE_BYTES`] of device memory).
pub fn adamw(
    dev: &CudaDevice,
    s: FlatState,
    table: &SegmentTable,
    h: AdamW,
    grad_mul: Option<u64>,
    schedule: u64,
) -> Result<(), CudaError> {
    let t = h.step as i32;
    let c1 = 1.0 - h.beta1.powi(t);
    let c2 = 1.0 - h.beta2.powi(t);
    let inv_sqrt_c2 = 1.0 / c2.sqrt();
    dev.upload_to(schedule, &[h.lr, c1, inv_sqrt_c2])?;
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
            .ptr(schedule)
            .f32(h.beta1)
            .f32(h.beta2)
            .f32(h.eps)
            .ptr(grad_mul.unwrap_or(0)),
    )
}

/// SGD's hyper-parameters for one step.
#[derive(Clone, Copy, Debug)]
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    /// The step number (1 for the first update, which sets the momentum to the gradient).
    pub step: u64,
}

/// One SGD (momentum) update; the learning rate and first-step flag are written to
/// `schedule` ([`SCHEDULE_BYTES`] of device memory), as [`adamw`]'s.
pub fn sgd(
    dev: &CudaDevice,
    s: FlatState,
    table: &SegmentTable,
    h: Sgd,
    grad_mul: Option<u64>,
    schedule: u64,
) -> Result<(), CudaError> {
    let Sgd { lr, momentum, step } = h;
    dev.upload_to(schedule, &[lr, (step == 1) as i32 as f32])?;
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
            .ptr(schedule)
            .f32(momentum)
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
    // Each range's partial sums one after another: the finish adds them all.
    let slots = ranges
        .iter()
        .map(|r| norm_blocks(r.len()))
        .sum::<usize>()
        .max(1);
    let partial = dev.alloc_zeroed(slots * 8, "gradient norm partials")?;
    let mut slot = 0;
    for r in ranges {
        let blocks = norm_blocks(r.len());
        dev.launch(
            "optimizer.cu",
            "sumsq_partial",
            Launch::linear(blocks, THREADS),
            Args::new()
                .ptr(grads + (r.start * 4) as u64)
                .i64(r.len() as i64)
                .ptr(partial.ptr() + (slot * 8) as u64),
        )?;
        slot += blocks;
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

/// The amaxes of the tensors one pass casts to FP8, one f32 slot each in one device tensor
/// (so that tensor-parallel shards agree on all of them in one collective: [`Fp8Amaxes::agreed`]),
/// and beside them each cast's `1 / scale`, written by the cast.
pub struct Fp8Amaxes {
    /// Each slot holds its tensor's amax as the float's bits (an int for the kernels'
    /// `atomicMax`; non-negative floats order as their bits do, so a float maximum over
    /// ranks gives the same slot).
    amaxes: CudaTensor,
    inv_scales: DevBuf,
}

impl Fp8Amaxes {
    /// The amaxes replaced by what `agree` makes of them (tensor parallelism: their maxima
    /// over the ranks holding the other shards), before any cast reads them.
    pub fn agreed(
        self,
        agree: impl FnOnce(CudaTensor) -> Result<CudaTensor, CudaError>,
    ) -> Result<Fp8Amaxes, CudaError> {
        let amaxes = agree(self.amaxes)?;
        if amaxes.dtype() != DType::F32 || 4 * amaxes.len() != self.inv_scales.bytes() {
            return Err(CudaError::Unsupported(format!(
                "FP8 amaxes agreed into {} values of {}, not the {} given",
                amaxes.len(),
                amaxes.dtype(),
                self.inv_scales.bytes() / 4
            )));
        }
        Ok(Fp8Amaxes {
            amaxes,
            inv_scales: self.inv_scales,
        })
    }

    /// Slot `slot`'s amax (an f32 on the device).
    pub fn amax(&self, slot: usize) -> u64 {
        self.amaxes.ptr() + 4 * slot as u64
    }

    /// Slot `slot`'s `1 / scale` (an f32 on the device).
    pub fn inv_scale(&self, slot: usize) -> u64 {
        self.inv_scales.ptr() + 4 * slot as u64
    }
}

/// A tensor cast to FP8 on the device ([`fp8_cast_from`]): its codes and its scalars.
pub struct Fp8Cast {
    /// One byte a value: row-major `[rows, cols]`, or `[cols, rows]` when `transposed`.
    pub codes: DevBuf,
    /// The amax and `1 / scale` of the tensor, in slot `slot`, shared with the other casts
    /// of its pass.
    scalars: Arc<Fp8Amaxes>,
    slot: usize,
    pub format: crate::fp8::Fp8Format,
    pub transposed: bool,
}

impl Fp8Cast {
    /// Room for the codes of a `len`-value cast whose scalars are `scalars`' slot `slot`.
    fn alloc(
        scalars: &Arc<Fp8Amaxes>,
        slot: usize,
        len: usize,
        format: crate::fp8::Fp8Format,
        transposed: bool,
    ) -> Result<Fp8Cast, CudaError> {
        Ok(Fp8Cast {
            codes: scalars.amaxes.device().alloc(len.max(1), "FP8 codes")?,
            scalars: scalars.clone(),
            slot,
            format,
            transposed,
        })
    }

    /// The f32 that FP8 products multiply back by (cuBLASLt's `A_SCALE`/`B_SCALE` pointer).
    pub fn inv_scale(&self) -> u64 {
        self.scalars.inv_scale(self.slot)
    }

    /// The f32 holding the tensor's amax.
    pub fn amax(&self) -> u64 {
        self.scalars.amax(self.slot)
    }
}

/// One tensor an FP8 pass casts: the row-major `[rows, cols]` values at `ptr`, f32 or bf16.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Source {
    pub ptr: u64,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

/// The fp8.cu kernel `stem` for values of `dtype`.
fn fp8_kernel(stem: &str, dtype: DType) -> Result<String, CudaError> {
    match dtype {
        DType::F32 | DType::BF16 => Ok(format!("{stem}_{}", super::ops::suffix(dtype))),
        DType::F16 => Err(CudaError::Unsupported(
            "FP8 casts of f16 values (they read f32 or bf16)".into(),
        )),
    }
}

/// Current scaling's first pass over each of `sources`: its amax (the largest |x|) into its
/// slot, in order.
pub fn fp8_amaxes(dev: &Arc<CudaDevice>, sources: &[Fp8Source]) -> Result<Fp8Amaxes, CudaError> {
    let n = sources.len();
    let amaxes = CudaTensor::zeros(dev, n, DType::F32, "FP8 amaxes")?;
    let inv_scales = dev.alloc(4 * n, "FP8 inverse scales")?;
    for (slot, source) in sources.iter().enumerate() {
        let len = source.rows * source.cols;
        // Block 256: the amax's shared reduction assumes it.
        dev.launch(
            "fp8.cu",
            &fp8_kernel("fp8_amax", source.dtype)?,
            Launch::grid_stride(len, THREADS, UPDATE_BLOCKS),
            Args::new()
                .ptr(source.ptr)
                .i64(len as i64)
                .ptr(amaxes.ptr() + 4 * slot as u64),
        )?;
    }
    Ok(Fp8Amaxes { amaxes, inv_scales })
}

/// Current scaling's cast to FP8 of `source`, whose amax is in `scalars`' slot `slot`:
/// each value times `scale` = [`crate::fp8::current_scale`] of the amax, rounded to nearest
/// even and saturating (the codes of [`crate::fp8::Fp8Format::encode`]), as it is or
/// `transposed` to `[cols, rows]` (cuBLASLt's FP8 products take only "TN" operands, so a
/// tensor read by two products may be wanted both ways). The cast writes `1 / scale` to the
/// slot; nothing goes through the host.
pub fn fp8_cast_from(
    scalars: &Arc<Fp8Amaxes>,
    slot: usize,
    source: Fp8Source,
    format: crate::fp8::Fp8Format,
    transposed: bool,
) -> Result<Fp8Cast, CudaError> {
    let Fp8Source {
        ptr,
        dtype,
        rows,
        cols,
    } = source;
    let dev = scalars.amaxes.device();
    if transposed {
        check_cast_transpose(rows)?;
    }
    let len = rows * cols;
    let e4m3 = format == crate::fp8::Fp8Format::E4M3;
    let cast = Fp8Cast::alloc(scalars, slot, len, format, transposed)?;
    let (name, launch, shape) = if transposed {
        let shape = Args::new().usize_as_i32(rows).usize_as_i32(cols);
        (
            "fp8_cast_transpose",
            cast_transpose_launch(rows, cols),
            shape,
        )
    } else {
        let flat = Launch::grid_stride(len, THREADS, UPDATE_BLOCKS);
        ("fp8_cast", flat, Args::new().i64(len as i64))
    };
    dev.launch(
        "fp8.cu",
        &fp8_kernel(name, dtype)?,
        launch,
        Args::new()
            .ptr(ptr)
            .ptr(cast.codes.ptr())
            .append(shape)
            .i32(e4m3 as i32)
            .ptr(cast.amax())
            .ptr(cast.inv_scale()),
    )?;
    Ok(cast)
}

/// [`fp8_cast_from`] in both layouts from one read of `source` (`fp8_cast_both_*`, the
/// cast-transpose's launch also writing the codes as they are): `(plain, transposed)`.
pub fn fp8_cast_both(
    scalars: &Arc<Fp8Amaxes>,
    slot: usize,
    source: Fp8Source,
    format: crate::fp8::Fp8Format,
) -> Result<(Fp8Cast, Fp8Cast), CudaError> {
    let Fp8Source {
        ptr,
        dtype,
        rows,
        cols,
    } = source;
    check_cast_transpose(rows)?;
    let dev = scalars.amaxes.device();
    let plain = Fp8Cast::alloc(scalars, slot, rows * cols, format, false)?;
    let transposed = Fp8Cast::alloc(scalars, slot, rows * cols, format, true)?;
    dev.launch(
        "fp8.cu",
        &fp8_kernel("fp8_cast_both", dtype)?,
        cast_transpose_launch(rows, cols),
        Args::new()
            .ptr(ptr)
            .ptr(plain.codes.ptr())
            .ptr(transposed.codes.ptr())
            .usize_as_i32(rows)
            .usize_as_i32(cols)
            .i32((format == crate::fp8::Fp8Format::E4M3) as i32)
            .ptr(plain.amax())
            .ptr(plain.inv_scale()),
    )?;
    Ok((plain, transposed))
}

/// The cast-transpose kernels' launch: one 32 x 32 tile a block of (32, 8).
fn cast_transpose_launch(rows: usize, cols: usize) -> Launch {
    Launch {
        grid: (cols.div_ceil(32) as u32, rows.div_ceil(32) as u32, 1),
        block: (32, 8, 1),
        smem: 0,
    }
}

/// Whether a cast-transpose of `rows` rows fits one launch (its grid's second dimension
/// counts tiles of 32 rows): callers check before their first launch.
pub fn check_cast_transpose(rows: usize) -> Result<(), CudaError> {
    if rows.div_ceil(32) > 65_535 {
        return Err(CudaError::Unsupported(format!(
            "an FP8 cast-transpose of {rows} rows (at most {} in one launch)",
            65_535 * 32
        )));
    }
    Ok(())
}

/// Current scaling's casts of one tensor: one amax pass ([`fp8_amaxes`]), then one cast per
/// entry of `transposed` ([`fp8_cast_from`]; `[false, true]` in one pass, [`fp8_cast_both`]),
/// sharing the amax and `1 / scale`.
pub fn fp8_casts(
    dev: &Arc<CudaDevice>,
    source: Fp8Source,
    format: crate::fp8::Fp8Format,
    transposed: &[bool],
) -> Result<Vec<Fp8Cast>, CudaError> {
    if transposed.contains(&true) {
        check_cast_transpose(source.rows)?;
    }
    let scalars = Arc::new(fp8_amaxes(dev, &[source])?);
    if transposed == [false, true] {
        // Both layouts from one read, as a backward casts its output gradient.
        let (plain, transposed) = fp8_cast_both(&scalars, 0, source, format)?;
        return Ok(vec![plain, transposed]);
    }
    transposed
        .iter()
        .map(|&t| fp8_cast_from(&scalars, 0, source, format, t))
        .collect()
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
