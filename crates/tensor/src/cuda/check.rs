//! Every device operation against its CPU twin on fresh random inputs: the CPU kernels are
//! the reference (they are tested against f64 definitions elsewhere). Used by the GPU tests
//! (skipped without a GPU) and by `meshtrain bench gpu --check` on the GPU machine.
//!
//! Tolerances (relative L2 error `‖gpu − cpu‖ / ‖cpu‖`): 1e-5 for f32 paths, 1e-2 for
//! bf16/f16 ones; a NaN or infinity anywhere fails.

use super::blas::F32Math;
use super::context::CudaDevice;
use super::error::CudaError;
use super::ops::{self, ActKind, AttnShape, LinearShape};
use super::train_ops;
use super::{CudaTensor, DeviceGrads, DeviceParams};
use crate::activation::Activation;
use crate::attention::AttentionShape;
use crate::fp8::Fp8Format;
use crate::matmul::{gemm_in, Mat, MatMut};
use crate::rng::SplitMix64;
use crate::rotary::RotaryShape;
use crate::DType;
use std::sync::Arc;

mod convnet;

/// One comparison.
#[derive(Clone, Debug)]
pub struct CheckResult {
    pub name: String,
    pub rel_err: f64,
    pub tolerance: f64,
    pub passed: bool,
    /// Why it failed, when it failed before comparing (an error).
    pub error: Option<String>,
}

impl std::fmt::Display for CheckResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.error {
            Some(e) => write!(f, "FAIL {:<44} error: {e}", self.name),
            None => write!(
                f,
                "{} {:<44} rel err {:.2e} (tolerance {:.0e})",
                if self.passed { "ok  " } else { "FAIL" },
                self.name,
                self.rel_err,
                self.tolerance
            ),
        }
    }
}

/// `‖got − want‖ / ‖want‖` in f64; infinite when anything is not finite or lengths differ.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() || got.iter().chain(want).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (g as f64 - w as f64).powi(2);
        norm += (w as f64).powi(2);
    }
    if norm == 0.0 {
        return diff.sqrt();
    }
    (diff / norm).sqrt()
}

/// The tolerance of a path in `dtype`.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// A comparison of `got` against `want` within `tolerance` (relative L2).
pub fn result(name: String, got: &[f32], want: &[f32], tolerance: f64) -> CheckResult {
    let rel_err = rel_l2(got, want);
    CheckResult {
        name,
        rel_err,
        tolerance,
        passed: rel_err <= tolerance,
        error: None,
    }
}

fn failed(name: String, e: CudaError) -> CheckResult {
    CheckResult {
        name,
        rel_err: f64::INFINITY,
        tolerance: 0.0,
        passed: false,
        error: Some(e.to_string()),
    }
}

/// A norm's input gradient rounded to 16 bits by its kernel (`ops::NormInputGrad`): exactly
/// the device's f32 values rounded (`dx`), and present in 16 bits (absent in f32).
fn rounded_copy(
    name: String,
    copy: Option<CudaTensor>,
    dx: &[f32],
    dtype: DType,
) -> Result<CheckResult, CudaError> {
    match (copy, dtype) {
        (None, DType::F32) => Ok(result(name, &[], &[], 0.0)),
        (Some(c), DType::F32) => Ok(failed(
            name,
            CudaError::Unsupported(format!("an f32 run's gradient got a {:?} copy", c.dtype())),
        )),
        (None, _) => Ok(failed(
            name,
            CudaError::Unsupported("no rounded copy was written".into()),
        )),
        (Some(c), _) => Ok(result(name, &c.to_host_f32()?, &rounded(dx, dtype), 0.0)),
    }
}

/// A fused residual add and norm's sum (exact: one f32 addition a value, as the CPU's) and
/// output (within `tol`) against the CPU's.
fn residual_add_checks(
    name: &dyn Fn(&str) -> String,
    (sum_dev, sum): (&CudaTensor, &[f32]),
    (y_dev, y): (&CudaTensor, &[f32]),
    tol: f64,
) -> Result<[CheckResult; 2], CudaError> {
    Ok([
        result(name("residual add: sum"), &sum_dev.to_host_f32()?, sum, 0.0),
        result(name("residual add: forward"), &y_dev.to_host_f32()?, y, tol),
    ])
}

/// The residual stream's new value `x + h`, as the CPU's `x += h` computes it.
fn residual_sum(x: &[f32], h: &[f32]) -> Vec<f32> {
    let mut sum = x.to_vec();
    crate::par::add_assign(&mut sum, h);
    sum
}

/// Values rounded to `dtype` (what the device holds after an upload in it).
fn rounded(values: &[f32], dtype: DType) -> Vec<f32> {
    let mut v = values.to_vec();
    match dtype {
        DType::F32 => {}
        DType::BF16 => crate::dtype::round_through_bf16(&mut v),
        DType::F16 => crate::dtype::round_through_f16(&mut v),
    }
    v
}

fn random(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * scale).collect()
}

/// Parameters on the device: the f32 masters and their copy in `dtype`.
struct DeviceValues {
    master: CudaTensor,
    half: Option<CudaTensor>,
}

impl DeviceValues {
    fn new(dev: &Arc<CudaDevice>, values: &[f32], dtype: DType) -> Result<Self, CudaError> {
        Ok(DeviceValues {
            master: CudaTensor::from_host(dev, values, DType::F32)?,
            half: match dtype {
                DType::F32 => None,
                d => Some(CudaTensor::from_host(dev, values, d)?),
            },
        })
    }

    fn params(&self) -> DeviceParams<'_> {
        // SAFETY: both tensors hold `len` values and live as long as the view.
        unsafe {
            DeviceParams::new(
                self.master.device(),
                self.master.ptr(),
                self.half.as_ref().map(|h| (h.ptr(), h.dtype())),
                self.master.len(),
            )
        }
    }
}

fn grads_of(t: &CudaTensor) -> DeviceGrads<'_> {
    // SAFETY: an f32 tensor of `len` values owned by the caller for the view's life.
    unsafe { DeviceGrads::new(t.device(), t.ptr(), t.len()) }
}

/// The results so far, each handed to `report` as it is made: a kernel that takes the process
/// down (an illegal address poisons the context) still leaves every earlier line printed.
struct Results<'a> {
    all: Vec<CheckResult>,
    report: &'a mut dyn FnMut(&CheckResult),
}

impl Results<'_> {
    fn push(&mut self, r: CheckResult) {
        (self.report)(&r);
        self.all.push(r);
    }

    fn extend(&mut self, rs: Vec<CheckResult>) {
        rs.into_iter().for_each(|r| self.push(r));
    }
}

/// Runs every check with inputs drawn from `seed`, calling `report` with each result as it is
/// made.
pub fn run_all(
    dev: &Arc<CudaDevice>,
    seed: u64,
    report: &mut dyn FnMut(&CheckResult),
) -> Vec<CheckResult> {
    let mut out = Results {
        all: Vec::new(),
        report,
    };
    let mut rng = SplitMix64::new(seed);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let s = ops::suffix(dtype);
        for (rows, inputs, outputs) in [(96, 80, 48), (257, 64, 200)] {
            let name = format!("linear {rows}x{inputs}->{outputs} {s}");
            out.extend(
                check_linear(
                    dev,
                    &mut rng,
                    LinearShape {
                        rows,
                        inputs,
                        outputs,
                    },
                    dtype,
                )
                .unwrap_or_else(|e| vec![failed(name, e)]),
            );
        }
        for (rows, d) in [(100, 768), (37, 130)] {
            let name = format!("layer norm {rows}x{d} {s}");
            out.extend(
                check_layer_norm(dev, &mut rng, rows, d, dtype)
                    .unwrap_or_else(|e| vec![failed(name, e)]),
            );
        }
        // Llama's layers: RMS norm (vector and scalar rows), rotary + GQA (groups of 3, 1 and
        // 2 query heads per key/value head; head sizes on every kernel path), SwiGLU.
        for (rows, d) in [(100, 768), (37, 130)] {
            let name = format!("rms norm {rows}x{d} {s}");
            out.extend(
                check_rms_norm(dev, &mut rng, rows, d, dtype)
                    .unwrap_or_else(|e| vec![failed(name, e)]),
            );
        }
        for (batch, seq, heads, kv_heads, head_dim) in [
            (2, 33, 6, 2, 64),
            (1, 17, 4, 4, 32),
            (2, 9, 4, 2, 6),
            (1, 5, 2, 1, 128),
        ] {
            let shape = RotaryShape {
                batch,
                seq,
                heads,
                kv_heads,
                head_dim,
            };
            let name = format!("rotary {batch}x{seq} h{heads}/{kv_heads}x{head_dim} {s}");
            out.extend(
                check_rotary(dev, &mut rng, shape, dtype).unwrap_or_else(|e| vec![failed(name, e)]),
            );
            if dtype == DType::F32 {
                // Qwen3's q/k heads out of the grouped rows and back (f32 only).
                let name = format!("q/k heads h{heads}/{kv_heads}x{head_dim}");
                out.extend(
                    check_qk_heads(dev, &mut rng, shape).unwrap_or_else(|e| vec![failed(name, e)]),
                );
            }
        }
        for (rows, half) in [(97, 688), (13, 37)] {
            let name = format!("swiglu {rows}x{half} {s}");
            out.extend(
                check_swiglu(dev, &mut rng, rows, half, dtype)
                    .unwrap_or_else(|e| vec![failed(name, e)]),
            );
        }
        for act in [
            Activation::Gelu,
            Activation::GeluTanh,
            Activation::Relu,
            Activation::Tanh,
            Activation::Sigmoid,
        ] {
            let name = format!("activation {act:?} {s}");
            out.extend(
                check_activation(dev, &mut rng, act, 10_001, dtype)
                    .unwrap_or_else(|e| vec![failed(name, e)]),
            );
        }
        let name = format!("residual add {s}");
        out.push(check_add(dev, &mut rng, 9_999, dtype).unwrap_or_else(|e| failed(name, e)));
        let name = format!("cross-entropy {s}");
        out.extend(
            check_cross_entropy(dev, &mut rng, 67, 1000, dtype)
                .unwrap_or_else(|e| vec![failed(name, e)]),
        );
        out.extend(attention_checks(
            dev,
            &mut rng,
            dtype,
            ops::AttentionProducts::MmaSync,
        ));
        // The convolutional nets' operations (LeNet, ResNet-18).
        out.extend(convnet::run(dev, &mut rng, dtype));
        // FP8 casts (the inputs of FP8 products) read f32 and bf16.
        if dtype != DType::F16 {
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                for shape in [(317, 331), (64, 1000)] {
                    let name = format!("fp8 cast to {format} {}x{} {s}", shape.0, shape.1);
                    out.push(
                        check_fp8_cast(dev, &mut rng, shape, format, dtype)
                            .unwrap_or_else(|e| failed(name, e)),
                    );
                }
            }
        }
    }
    // FP8 products (Ada and Hopper): a linear layer's three against the CPU's.
    if dev.has_fp8_tensor_cores() {
        for (rows, inputs, outputs) in [(128, 64, 96), (512, 768, 2304)] {
            let shape = LinearShape {
                rows,
                inputs,
                outputs,
            };
            for shards in [false, true] {
                let name = format!("linear fp8 {rows}x{inputs}->{outputs}");
                out.extend(
                    check_linear_fp8(dev, &mut rng, shape, shards)
                        .unwrap_or_else(|e| vec![failed(name, e)]),
                );
            }
        }
    }
    // The embedding is f32 whatever the precision: with a position table (GPT) and without
    // (Llama).
    for positions in [true, false] {
        let name = format!("embedding positions={positions}");
        out.extend(
            check_embedding(dev, &mut rng, 50, 4, 24, 68, positions)
                .unwrap_or_else(|e| vec![failed(name, e)]),
        );
    }
    // Hopper's warpgroup (wgmma) attention kernels on the same shapes, last: a fault in a
    // kernel no card has run yet leaves the context unusable, and must not take the checks
    // above with it.
    for dtype in [DType::BF16, DType::F16] {
        out.extend(attention_checks(
            dev,
            &mut rng,
            dtype,
            ops::AttentionProducts::Warpgroup,
        ));
    }
    out.all
}

/// The attention shapes the checks compare, `(batch, seq, heads, head_dim)` and a window:
/// several tiles, ragged ones, one token, every head size; the last four under Mistral's
/// sliding window (shorter than a tile, crossing tiles, one key, a whole tile skipped).
const ATTENTION_SHAPES: [(AttnShape, Option<usize>); 9] = [
    (attn_shape(2, 256, 2, 64), None),
    (attn_shape(1, 200, 3, 64), None),
    (attn_shape(2, 130, 2, 32), None),
    (attn_shape(1, 128, 2, 128), None),
    (attn_shape(1, 1, 1, 64), None),
    (attn_shape(2, 256, 2, 64), Some(100)),
    (attn_shape(2, 130, 2, 32), Some(7)),
    (attn_shape(1, 128, 2, 128), Some(1)),
    (attn_shape(1, 200, 3, 64), Some(64)),
];

/// The attention checks alone (every dtype's mma.sync kernels, then Hopper's wgmma kernels
/// where the GPU has them), for a quick look at attention on a card (`bench gpu --parts
/// attention`); `report` gets each result as it is made.
pub fn run_attention(
    dev: &Arc<CudaDevice>,
    seed: u64,
    report: &mut dyn FnMut(&CheckResult),
) -> Vec<CheckResult> {
    let mut rng = SplitMix64::new(seed);
    let mut all = Vec::new();
    let kinds = [
        (DType::F32, ops::AttentionProducts::MmaSync),
        (DType::BF16, ops::AttentionProducts::MmaSync),
        (DType::F16, ops::AttentionProducts::MmaSync),
        (DType::BF16, ops::AttentionProducts::Warpgroup),
        (DType::F16, ops::AttentionProducts::Warpgroup),
    ];
    for (dtype, products) in kinds {
        for r in attention_checks(dev, &mut rng, dtype, products) {
            report(&r);
            all.push(r);
        }
    }
    all
}

/// The attention kernels of `products` on every shape of [`ATTENTION_SHAPES`] they take.
fn attention_checks(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    dtype: DType,
    products: ops::AttentionProducts,
) -> Vec<CheckResult> {
    let mut out = Vec::new();
    for (shape, window) in ATTENTION_SHAPES {
        let warpgroup = products == ops::AttentionProducts::Warpgroup;
        if warpgroup && !ops::AttentionProducts::warpgroup_fits(dev, dtype, shape.head_dim) {
            continue;
        }
        let name = format!(
            "attention{} {}x{} h{}x{} {}",
            products_label(products),
            shape.batch,
            shape.seq,
            shape.heads,
            shape.head_dim,
            ops::suffix(dtype)
        );
        out.extend(
            check_attention(dev, rng, shape, window, dtype, products)
                .unwrap_or_else(|e| vec![failed(name, e)]),
        );
    }
    out
}

/// How a check's name tells the kernels apart: nothing for mma.sync (the names of earlier
/// logs), " (wgmma)" for Hopper's.
fn products_label(products: ops::AttentionProducts) -> String {
    match products {
        ops::AttentionProducts::MmaSync => String::new(),
        other => format!(" ({})", other.name()),
    }
}

const fn attn_shape(batch: usize, seq: usize, heads: usize, head_dim: usize) -> AttnShape {
    AttnShape {
        batch,
        seq,
        heads,
        head_dim,
    }
}

fn check_linear(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    shape: LinearShape,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    let LinearShape {
        rows,
        inputs,
        outputs,
    } = shape;
    let s = ops::suffix(dtype);
    let x = rounded(&random(rng, rows * inputs, 1.0), dtype);
    let mut p = random(rng, inputs * outputs + outputs, 0.1);
    // The device's 16-bit copy rounds the weights; the CPU rounds product inputs alike, but
    // the bias it adds in f32: round it here so both add the same bias.
    let bias_rounded = rounded(&p[inputs * outputs..], dtype);
    p[inputs * outputs..].copy_from_slice(&bias_rounded);
    let dy = rounded(&random(rng, rows * outputs, 1.0), dtype);
    let g0 = random(rng, p.len(), 0.01);

    let (y, g, dx) = cpu_linear(&x, &p, &dy, &g0, shape, &|c, a, b, accumulate, _| {
        gemm_in(dtype, c, a, b, accumulate)
    });

    let params = DeviceValues::new(dev, &p, dtype)?;
    let x_dev = CudaTensor::from_host(dev, &x, dtype)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let g_dev = CudaTensor::from_host(dev, &g0, DType::F32)?;
    let y_dev = ops::linear_forward(&x_dev, params.params(), shape, true, dtype, F32Math::Exact)?;
    let dx_dev = ops::linear_backward(
        &x_dev,
        &dy_dev,
        params.params(),
        grads_of(&g_dev),
        shape,
        true,
        dtype,
        F32Math::Exact,
        true,
    )?
    .expect("asked for dx");
    // With a tanh GELU after it (GPT-2's first MLP layer): in 16 bits the product's epilogue
    // computes it, writing the pre-activation beside.
    let (act_dev, kept_dev) = ops::linear_act_forward(
        &x_dev,
        params.params(),
        shape,
        true,
        dtype,
        F32Math::Exact,
        ops::ActKind::GeluTanh,
    )?;
    let act: Vec<f32> = y.iter().map(|&v| crate::activation::gelu_tanh(v)).collect();
    // The input gradient taken on through a previous layer's tanh GELU (in 16 bits the
    // product's epilogue: GPT-2's second MLP layer), against dx × GELU′(pre).
    let pre = rounded(&random(rng, rows * inputs, 1.0), dtype);
    let pre_dev = CudaTensor::from_host(dev, &pre, dtype)?;
    let g_through = CudaTensor::from_host(dev, &g0, DType::F32)?;
    let grads = ops::LinearGrads {
        shape,
        bias: true,
        precision: dtype,
        math: F32Math::Exact,
    };
    let dz_dev = grads
        .backward_through(
            &x_dev,
            &dy_dev,
            params.params(),
            grads_of(&g_through),
            true,
            Some((&pre_dev, ops::ActKind::GeluTanh)),
            |dz| dz,
        )?
        .expect("asked for dx");
    let dz: Vec<f32> = dx
        .iter()
        .zip(&pre)
        .map(|(d, &z)| d * crate::activation::gelu_tanh_grad(z))
        .collect();
    let tol = tolerance(dtype);
    let name = |what: &str| format!("linear {rows}x{inputs}->{outputs} {what} {s}");
    Ok(vec![
        result(name("forward"), &y_dev.to_host_f32()?, &y, tol),
        result(name("weight+bias grad"), &g_dev.to_host_f32()?, &g, tol),
        result(name("input grad"), &dx_dev.to_host_f32()?, &dx, tol),
        result(name("forward+gelu"), &act_dev.to_host_f32()?, &act, tol),
        result(name("pre-gelu"), &kept_dev.to_host_f32()?, &y, tol),
        result(
            name("input grad through gelu"),
            &dz_dev.to_host_f32()?,
            &dz,
            tol,
        ),
        result(
            name("weight+bias grad (through gelu)"),
            &g_through.to_host_f32()?,
            &g,
            tol,
        ),
    ])
}

/// Which of a linear layer's products: FP8 gives each its operands' formats.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LinearProduct {
    Forward,
    InputGrad,
    WeightGrad,
}

/// The CPU's linear layer on `x` `[rows, inputs]`, `p` (W then b) and `dy`: `y = x·Wᵀ + b`,
/// `g = g0 + (dyᵀ·x, Σ_rows dy)` and `dx = dy·W`, each product through `product`.
fn cpu_linear(
    x: &[f32],
    p: &[f32],
    dy: &[f32],
    g0: &[f32],
    shape: LinearShape,
    product: &dyn Fn(MatMut, Mat, Mat, bool, LinearProduct),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let LinearShape {
        rows,
        inputs,
        outputs,
    } = shape;
    let (w, b) = p.split_at(inputs * outputs);
    let mut y = vec![0.0f32; rows * outputs];
    product(
        MatMut::new(&mut y, rows, outputs),
        Mat::new(x, rows, inputs),
        Mat::new(w, outputs, inputs).t(),
        false,
        LinearProduct::Forward,
    );
    for r in y.chunks_mut(outputs) {
        r.iter_mut().zip(b).for_each(|(v, b)| *v += b);
    }
    let mut g = g0.to_vec();
    let (gw, gb) = g.split_at_mut(inputs * outputs);
    product(
        MatMut::new(gw, outputs, inputs),
        Mat::new(dy, rows, outputs).t(),
        Mat::new(x, rows, inputs),
        true,
        LinearProduct::WeightGrad,
    );
    for r in dy.chunks(outputs) {
        gb.iter_mut().zip(r).for_each(|(a, v)| *a += v);
    }
    let mut dx = vec![0.0f32; rows * inputs];
    product(
        MatMut::new(&mut dx, rows, inputs),
        Mat::new(dy, rows, outputs),
        Mat::new(w, outputs, inputs),
        false,
        LinearProduct::InputGrad,
    );
    (y, g, dx)
}

/// A linear layer's FP8 products against the CPU's ([`crate::fp8::gemm_fp8_scaled`], the
/// same casts from the same bf16 tensors): forward (bf16 output, so bf16's tolerance), the
/// weight and bias gradients (f32, accumulated onto earlier values) and the input gradient.
///
/// With `shards`, the amaxes go through an agreement, as a tensor-parallel layer's do: it
/// stands for other shards holding larger values, multiplying the input's amax by 2, the
/// weight's by 3 and the output gradient's by 5 (distinct, so a pass that read another
/// tensor's slot would fail), and the CPU casts at those scales.
fn check_linear_fp8(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    shape: LinearShape,
    shards: bool,
) -> Result<Vec<CheckResult>, CudaError> {
    use crate::fp8::{amax_of, gemm_fp8_scaled, Fp8Format::*, Fp8Operand};
    let LinearShape {
        rows,
        inputs,
        outputs,
    } = shape;
    let bf16 = DType::BF16;
    let threads = crate::par::threads();
    let x = rounded(&random(rng, rows * inputs, 1.0), bf16);
    let p = rounded(&random(rng, inputs * outputs + outputs, 0.05), bf16);
    let dy = rounded(&random(rng, rows * outputs, 1e-3), bf16);
    let g0 = random(rng, p.len(), 1e-4);
    // The other shards' share: the factor on each tensor's own amax.
    let (on_x, on_w, on_dy) = if shards {
        (2.0, 3.0, 5.0)
    } else {
        (1.0, 1.0, 1.0)
    };
    let (y, g, dx) = cpu_linear(&x, &p, &dy, &g0, shape, &|c, a, b, accumulate, which| {
        let (a_format, on_a, on_b) = match which {
            LinearProduct::Forward => (E4M3, on_x, on_w),
            LinearProduct::InputGrad => (E5M2, on_dy, on_w),
            LinearProduct::WeightGrad => (E5M2, on_dy, on_x),
        };
        let a_cast = Fp8Operand::current(a_format, on_a * amax_of(&a));
        let b_cast = Fp8Operand::current(E4M3, on_b * amax_of(&b));
        gemm_fp8_scaled(c, a, a_cast, b, b_cast, accumulate, threads);
    });
    // The device amaxes in the passes' order: forward [x, W], backward [dy, W, x].
    let agreement = |amaxes: CudaTensor| -> Result<CudaTensor, CudaError> {
        let factors: &[f32] = match amaxes.len() {
            2 => &[on_x, on_w],
            _ => &[on_dy, on_w, on_x],
        };
        let agreed: Vec<f32> = amaxes
            .to_host_f32()?
            .iter()
            .zip(factors)
            .map(|(a, f)| a * f)
            .collect();
        CudaTensor::from_host(dev, &agreed, DType::F32)
    };
    let agree: super::fp8_linear::ShardAgreement = shards.then_some(&agreement);

    let params = DeviceValues::new(dev, &p, bf16)?;
    let x_dev = CudaTensor::from_host(dev, &x, bf16)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, bf16)?;
    let g_dev = CudaTensor::from_host(dev, &g0, DType::F32)?;
    let y_dev = super::fp8_linear::forward(&x_dev, params.params(), shape, true, agree)?;
    let dx_dev = super::fp8_linear::backward(
        &x_dev,
        &dy_dev,
        params.params(),
        grads_of(&g_dev),
        shape,
        true,
        true,
        agree,
        |dx| dx,
    )?
    .expect("asked for dx");
    let agreed = if shards { " (amaxes agreed)" } else { "" };
    let name = |what: &str| format!("linear fp8 {rows}x{inputs}->{outputs} {what}{agreed}");
    Ok(vec![
        result(name("forward"), &y_dev.to_host_f32()?, &y, tolerance(bf16)),
        result(name("weight+bias grad"), &g_dev.to_host_f32()?, &g, 1e-5),
        result(
            name("input grad"),
            &dx_dev.to_host_f32()?,
            &dx,
            tolerance(bf16),
        ),
    ])
}

fn check_layer_norm(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    rows: usize,
    d: usize,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    let s = ops::suffix(dtype);
    let x: Vec<f32> = random(rng, rows * d, 2.0).iter().map(|v| v + 0.5).collect();
    let p: Vec<f32> = (0..2 * d)
        .map(|i| {
            if i < d {
                1.0 + 0.1 * rng.normal()
            } else {
                0.1 * rng.normal()
            }
        })
        .collect();
    let dy = rounded(&random(rng, rows * d, 1.0), dtype);
    let g0 = random(rng, 2 * d, 0.01);
    let (gamma, beta) = p.split_at(d);
    let (y, mean, rstd) = crate::norm::layer_norm_forward(&x, d, gamma, beta, 1e-5);
    let mut g = g0.clone();
    let (dgamma, dbeta) = g.split_at_mut(d);
    let dx = crate::norm::layer_norm_backward(&x, d, gamma, &mean, &rstd, &dy, dgamma, dbeta);

    let params = DeviceValues::new(dev, &p, DType::F32)?;
    let x_dev = CudaTensor::from_host(dev, &x, DType::F32)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let g_dev = CudaTensor::from_host(dev, &g0, DType::F32)?;
    let (y_dev, stats) = ops::layer_norm_forward(&x_dev, params.params(), d, 1e-5, dtype, true)?;
    let (m_dev, r_dev) = stats.expect("kept");
    let (dx_dev, dx_rounded) = ops::layer_norm_backward(
        &x_dev,
        params.params(),
        &m_dev,
        &r_dev,
        &dy_dev,
        grads_of(&g_dev),
        d,
        None,
        true,
    )?;
    let dx_dev = dx_dev.to_host_f32()?;
    // The residual add fused into the forward: the stream x + h (h the branch's output, in
    // the norm's output dtype), then its norm.
    let h = rounded(&random(rng, rows * d, 1.0), dtype);
    let sum = residual_sum(&x, &h);
    let (y_sum, mean_sum, rstd_sum) = crate::norm::layer_norm_forward(&sum, d, gamma, beta, 1e-5);
    let h_dev = CudaTensor::from_host(dev, &h, dtype)?;
    let (sum_dev, y_sum_dev, stats_sum) =
        ops::add_layer_norm_forward(&x_dev, &h_dev, params.params(), d, 1e-5, dtype, true)?;
    let (m_sum_dev, r_sum_dev) = stats_sum.expect("kept");
    let name = |what: &str| format!("layer norm {rows}x{d} {what} {s}");
    let [sum_check, y_sum_check] = residual_add_checks(
        &name,
        (&sum_dev, &sum),
        (&y_sum_dev, &y_sum),
        tolerance(dtype),
    )?;
    Ok(vec![
        sum_check,
        y_sum_check,
        result(
            name("residual add: mean"),
            &m_sum_dev.to_host_f32()?,
            &mean_sum,
            1e-5,
        ),
        result(
            name("residual add: rstd"),
            &r_sum_dev.to_host_f32()?,
            &rstd_sum,
            1e-5,
        ),
        result(name("forward"), &y_dev.to_host_f32()?, &y, tolerance(dtype)),
        result(name("mean"), &m_dev.to_host_f32()?, &mean, 1e-5),
        result(name("rstd"), &r_dev.to_host_f32()?, &rstd, 1e-5),
        // dx and the parameter gradients are f32 sums of (rounded) dy: f32 tolerance when
        // dy is f32.
        result(name("input grad"), &dx_dev, &dx, tolerance(dtype)),
        rounded_copy(name("input grad, rounded copy"), dx_rounded, &dx_dev, dtype)?,
        result(
            name("gamma+beta grad"),
            &g_dev.to_host_f32()?,
            &g,
            tolerance(dtype),
        ),
    ])
}

fn check_rms_norm(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    rows: usize,
    d: usize,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    let s = ops::suffix(dtype);
    let x: Vec<f32> = random(rng, rows * d, 2.0).iter().map(|v| v + 0.5).collect();
    let w: Vec<f32> = (0..d).map(|_| 1.0 + 0.1 * rng.normal()).collect();
    let dy = rounded(&random(rng, rows * d, 1.0), dtype);
    let g0 = random(rng, d, 0.01);
    let (y, rstd) = crate::norm::rms_norm_forward(&x, d, &w, 1e-5);
    let mut g = g0.clone();
    let dx = crate::norm::rms_norm_backward(&x, d, &w, &rstd, &dy, &mut g);

    let params = DeviceValues::new(dev, &w, DType::F32)?;
    let x_dev = CudaTensor::from_host(dev, &x, DType::F32)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let g_dev = CudaTensor::from_host(dev, &g0, DType::F32)?;
    let (y_dev, r_dev) = ops::rms_norm_forward(&x_dev, params.params(), d, 1e-5, dtype, true)?;
    let r_dev = r_dev.expect("kept");
    let (dx_dev, dx_rounded) = ops::rms_norm_backward(
        &x_dev,
        params.params(),
        &r_dev,
        &dy_dev,
        grads_of(&g_dev),
        d,
        None,
        true,
    )?;
    let dx_dev = dx_dev.to_host_f32()?;
    // The residual add fused into the forward, as in the layer norm's check.
    let h = rounded(&random(rng, rows * d, 1.0), dtype);
    let sum = residual_sum(&x, &h);
    let (y_sum, rstd_sum) = crate::norm::rms_norm_forward(&sum, d, &w, 1e-5);
    let h_dev = CudaTensor::from_host(dev, &h, dtype)?;
    let (sum_dev, y_sum_dev, r_sum_dev) =
        ops::add_rms_norm_forward(&x_dev, &h_dev, params.params(), d, 1e-5, dtype, true)?;
    let tol = tolerance(dtype);
    let name = |what: &str| format!("rms norm {rows}x{d} {what} {s}");
    let [sum_check, y_sum_check] =
        residual_add_checks(&name, (&sum_dev, &sum), (&y_sum_dev, &y_sum), tol)?;
    Ok(vec![
        sum_check,
        y_sum_check,
        result(
            name("residual add: rstd"),
            &r_sum_dev.expect("kept").to_host_f32()?,
            &rstd_sum,
            1e-5,
        ),
        result(name("forward"), &y_dev.to_host_f32()?, &y, tol),
        result(name("rstd"), &r_dev.to_host_f32()?, &rstd, 1e-5),
        // f32 sums of (rounded) dy: f32 tolerance when dy is f32.
        result(name("input grad"), &dx_dev, &dx, tol),
        rounded_copy(name("input grad, rounded copy"), dx_rounded, &dx_dev, dtype)?,
        result(name("weight grad"), &g_dev.to_host_f32()?, &g, tol),
    ])
}

fn check_rotary(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    shape: RotaryShape,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    let RotaryShape {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim,
    } = shape;
    let s = ops::suffix(dtype);
    let rows = batch * seq;
    let x = rounded(&random(rng, rows * shape.input_width(), 1.0), dtype);
    let dy = rounded(&random(rng, rows * shape.output_width(), 1.0), dtype);
    // A context-parallel worker's positions: not 0, 1, 2, ...
    let positions: Vec<usize> = (0..seq).map(|t| 2 * t + 3).collect();
    let (cos, sin) =
        crate::rotary::rotary_tables(&positions, head_dim, &crate::rotary::Rope::new(10_000.0));
    let y = crate::rotary::rotary_expand_forward(shape, &x, &cos, &sin);
    let dx = crate::rotary::rotary_expand_backward(shape, &dy, &cos, &sin);

    let cos_dev = CudaTensor::from_host(dev, &cos, DType::F32)?;
    let sin_dev = CudaTensor::from_host(dev, &sin, DType::F32)?;
    let x_dev = CudaTensor::from_host(dev, &x, dtype)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let y_dev = ops::rotary_forward(&x_dev, shape, &cos_dev, &sin_dev)?;
    let dx_dev = ops::rotary_backward(&dy_dev, shape, &cos_dev, &sin_dev)?;
    let tol = tolerance(dtype);
    let name =
        |what: &str| format!("rotary {batch}x{seq} h{heads}/{kv_heads}x{head_dim} {what} {s}");
    Ok(vec![
        result(name("forward"), &y_dev.to_host_f32()?, &y, tol),
        result(name("backward"), &dx_dev.to_host_f32()?, &dx, tol),
    ])
}

/// Qwen3's q/k heads moved out of grouped rows and back against the CPU's `gather_qk` /
/// `scatter_qk`: moves, so bit for bit.
fn check_qk_heads(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    shape: RotaryShape,
) -> Result<Vec<CheckResult>, CudaError> {
    let rows = shape.batch * shape.seq;
    let x = random(rng, rows * shape.input_width(), 1.0);
    let (q, k) = crate::rotary::gather_qk(shape, &x);
    let x_dev = CudaTensor::from_host(dev, &x, DType::F32)?;
    let (q_dev, k_dev) = ops::qk_heads(&x_dev, shape)?;
    // New heads written back over the originals' places; the value heads stay.
    let (q2, k2) = (random(rng, q.len(), 2.0), random(rng, k.len(), 2.0));
    let mut want = x.clone();
    crate::rotary::scatter_qk(shape, &q2, &k2, &mut want);
    ops::qk_heads_into(
        &CudaTensor::from_host(dev, &q2, DType::F32)?,
        &CudaTensor::from_host(dev, &k2, DType::F32)?,
        &x_dev,
        shape,
    )?;
    let name = |what: &str| {
        format!(
            "q/k heads h{}/{}x{} {what}",
            shape.heads, shape.kv_heads, shape.head_dim
        )
    };
    Ok(vec![
        result(name("gather q"), &q_dev.to_host_f32()?, &q, 0.0),
        result(name("gather k"), &k_dev.to_host_f32()?, &k, 0.0),
        result(name("scatter"), &x_dev.to_host_f32()?, &want, 0.0),
    ])
}

fn check_swiglu(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    rows: usize,
    half: usize,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    let s = ops::suffix(dtype);
    let x = rounded(&random(rng, rows * 2 * half, 2.0), dtype);
    let dy = rounded(&random(rng, rows * half, 1.0), dtype);
    let y = crate::activation::swiglu_forward(&x, half);
    let dx = crate::activation::swiglu_backward(&x, &dy, half);
    let x_dev = CudaTensor::from_host(dev, &x, dtype)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let y_dev = ops::swiglu_forward(&x_dev, half)?;
    let dx_dev = ops::swiglu_backward(&x_dev, &dy_dev, half)?;
    // The CPU's exp is a polynomial approximation good to ~1e-7 relative.
    let tol = tolerance(dtype).max(1e-5);
    Ok(vec![
        result(
            format!("swiglu {rows}x{half} forward {s}"),
            &y_dev.to_host_f32()?,
            &y,
            tol,
        ),
        result(
            format!("swiglu {rows}x{half} backward {s}"),
            &dx_dev.to_host_f32()?,
            &dx,
            tol,
        ),
    ])
}

/// The embedding's CPU twin is the layer's own loop (`meshtrain_nn`'s `GptEmbedding`): a
/// gather (plus the position row), and its scatter-add, written out here.
fn check_embedding(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    vocab: usize,
    batch: usize,
    seq: usize,
    d: usize,
    positions: bool,
) -> Result<Vec<CheckResult>, CudaError> {
    let max_seq = seq + 3;
    let table = vocab * d + if positions { max_seq * d } else { 0 };
    let p = random(rng, table, 1.0);
    let ids: Vec<i32> = (0..batch * seq)
        .map(|_| rng.below(vocab as u64) as i32)
        .collect();
    // Distinct rows of the position table, not in order.
    let pos_of: Vec<i32> = (0..seq).map(|t| (seq - 1 - t) as i32 + 2).collect();
    let dy = random(rng, batch * seq * d, 1.0);
    let g0 = random(rng, table, 0.01);
    let mut y = vec![0.0f32; batch * seq * d];
    let mut g = g0.clone();
    for (i, (row, dyr)) in y.chunks_mut(d).zip(dy.chunks(d)).enumerate() {
        let te = ids[i] as usize * d;
        row.copy_from_slice(&p[te..te + d]);
        g[te..te + d].iter_mut().zip(dyr).for_each(|(a, v)| *a += v);
        if positions {
            let pe = vocab * d + pos_of[i % seq] as usize * d;
            row.iter_mut()
                .zip(&p[pe..pe + d])
                .for_each(|(a, v)| *a += v);
            g[pe..pe + d].iter_mut().zip(dyr).for_each(|(a, v)| *a += v);
        }
    }
    let params = DeviceValues::new(dev, &p, DType::F32)?;
    let pos = positions.then_some(pos_of.as_slice());
    let y_dev = ops::embedding_forward(dev, &ids, params.params(), vocab, d, pos)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, DType::F32)?;
    let g_dev = CudaTensor::from_host(dev, &g0, DType::F32)?;
    ops::embedding_backward(&dy_dev, &ids, grads_of(&g_dev), vocab, d, pos)?;
    let name = |what: &str| format!("embedding {batch}x{seq} d{d} positions={positions} {what}");
    Ok(vec![
        // A gather (and one f32 add): exact.
        result(name("forward"), &y_dev.to_host_f32()?, &y, 0.0),
        result(name("gradient"), &g_dev.to_host_f32()?, &g, 1e-5),
    ])
}

fn check_activation(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    act: Activation,
    n: usize,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    let s = ops::suffix(dtype);
    let x = rounded(&random(rng, n, 2.0), dtype);
    let dy = rounded(&random(rng, n, 1.0), dtype);
    let mut y = vec![0.0f32; n];
    act.forward(&x, &mut y);
    let saved = if act.backward_uses_output() {
        rounded(&y, dtype)
    } else {
        x.clone()
    };
    let mut dx = dy.clone();
    act.backward_in_place(&saved, &mut dx);
    let x_dev = CudaTensor::from_host(dev, &x, dtype)?;
    let y_dev = ops::activation_forward(&x_dev, ActKind::from(act))?;
    let saved_dev = CudaTensor::from_host(dev, &saved, dtype)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let dx_dev = ops::activation_backward(&saved_dev, &dy_dev, ActKind::from(act))?;
    // The CPU's erf/tanh/exp are polynomial approximations good to ~1e-7 relative.
    let tol = tolerance(dtype).max(1e-5);
    Ok(vec![
        result(
            format!("activation {act:?} forward {s}"),
            &y_dev.to_host_f32()?,
            &y,
            tol,
        ),
        result(
            format!("activation {act:?} backward {s}"),
            &dx_dev.to_host_f32()?,
            &dx,
            tol,
        ),
    ])
}

fn check_add(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    n: usize,
    dtype: DType,
) -> Result<CheckResult, CudaError> {
    let a = random(rng, n, 1.0);
    let b = rounded(&random(rng, n, 1.0), dtype);
    let want: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
    let a_dev = CudaTensor::from_host(dev, &a, DType::F32)?;
    let b_dev = CudaTensor::from_host(dev, &b, dtype)?;
    let y = ops::add(a_dev, &b_dev)?;
    Ok(result(
        format!("residual add {}", ops::suffix(dtype)),
        &y.to_host_f32()?,
        &want,
        1e-6,
    ))
}

/// Current scaling's FP8 cast against the CPU's, code for code (the error is the fraction
/// of codes that differ; none may), as it is and transposed, with its inverse scale exactly.
/// The inputs span the format's range and beyond after the scale (subnormals, saturation);
/// a second cast of inputs holding a NaN must fall back to scale 1.
fn check_fp8_cast(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    (rows, cols): (usize, usize),
    format: Fp8Format,
    dtype: DType,
) -> Result<CheckResult, CudaError> {
    let n = rows * cols;
    let x: Vec<f32> = (0..n)
        .map(|_| rng.normal() * (2.0f32).powi(rng.below(40) as i32 - 20))
        .collect();
    let mut with_nan = x.clone();
    with_nan[n / 2] = f32::NAN;
    let (mut differ, mut compared) = (0, 0);
    let mut scales = Vec::new();
    for values in [x, with_nan] {
        let values = rounded(&values, dtype);
        let x_dev = CudaTensor::from_host(dev, &values, dtype)?;
        let scale = crate::fp8::current_scale(format, crate::fp8::amax(&values));
        // Both layouts from one amax pass and one read (`fp8_cast_both`), as backward casts
        // its output gradient.
        let layouts = [false, true];
        let source = train_ops::Fp8Source {
            ptr: x_dev.ptr(),
            dtype,
            rows,
            cols,
        };
        let casts = train_ops::fp8_casts(dev, source, format, &layouts)?;
        for (cast, transposed) in casts.iter().zip(layouts) {
            let codes: Vec<u8> = dev.download(cast.codes.ptr(), n)?;
            let inv_scale: Vec<f32> = dev.download(cast.inv_scale(), 1)?;
            for r in 0..rows {
                for c in 0..cols {
                    let at = if transposed {
                        c * rows + r
                    } else {
                        r * cols + c
                    };
                    differ += (format.encode(values[r * cols + c] * scale) != codes[at]) as usize;
                }
            }
            compared += n;
            scales.push((inv_scale[0], 1.0 / scale));
        }
    }
    let name = format!("fp8 cast to {format} {rows}x{cols} {}", ops::suffix(dtype));
    if let Some((got, want)) = scales.iter().find(|(got, want)| got != want) {
        return Ok(CheckResult {
            name,
            rel_err: f64::INFINITY,
            tolerance: 0.0,
            passed: false,
            error: Some(format!("inverse scale {got}, the CPU's {want}")),
        });
    }
    let rel_err = differ as f64 / compared as f64;
    Ok(CheckResult {
        name,
        rel_err,
        tolerance: 0.0,
        passed: rel_err == 0.0,
        error: None,
    })
}

fn check_cross_entropy(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    rows: usize,
    classes: usize,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    let s = ops::suffix(dtype);
    let logits = rounded(&random(rng, rows * classes, 3.0), dtype);
    let targets: Vec<u32> = (0..rows)
        .map(|_| rng.below(classes as u64) as u32)
        .collect();
    let grad_scale = 0.5;
    let (mean, grad, correct) =
        crate::loss::softmax_cross_entropy(&logits, classes, &targets, grad_scale);
    let t_dev: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
    let t_dev = dev.upload(&t_dev, "targets")?;
    let sums = dev.alloc_zeroed(16, "loss sums")?;
    let l_dev = CudaTensor::from_host(dev, &logits, dtype)?;
    let g_dev = ops::cross_entropy(
        l_dev,
        t_dev.ptr(),
        rows,
        classes,
        Some(grad_scale / rows as f32),
        sums.ptr(),
    )?
    .expect("asked for the gradient");
    let got: Vec<f64> = dev.download(sums.ptr(), 2)?;
    let got_mean = (got[0] / rows as f64) as f32;
    let mut out = vec![
        result(
            format!("cross-entropy loss {s}"),
            &[got_mean],
            &[mean],
            1e-5,
        ),
        result(
            format!("cross-entropy gradient {s}"),
            &g_dev.to_host_f32()?,
            &grad,
            tolerance(dtype),
        ),
    ];
    out.push(CheckResult {
        name: format!("cross-entropy correct count {s}"),
        rel_err: (got[1] - correct as f64).abs(),
        tolerance: 0.0,
        passed: got[1] == correct as f64,
        error: None,
    });
    Ok(out)
}

/// The attention kernels of `products` against the CPU's flash attention on random inputs.
fn check_attention(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    shape: AttnShape,
    window: Option<usize>,
    dtype: DType,
    products: ops::AttentionProducts,
) -> Result<Vec<CheckResult>, CudaError> {
    let AttnShape {
        batch, seq, heads, ..
    } = shape;
    let d = shape.dim();
    let qkv = rounded(&random(rng, batch * seq * 3 * d, 1.0), dtype);
    let dout = rounded(&random(rng, batch * seq * d, 1.0), dtype);
    let cpu_shape = AttentionShape {
        batch,
        seq,
        dim: d,
        heads,
    };
    let (out, lse) = crate::flash::flash_attention_forward(cpu_shape, &qkv, dtype, window);
    let out_kept = rounded(&out, dtype);
    let dqkv = crate::flash::flash_attention_backward(
        cpu_shape, &qkv, &out_kept, &lse, &dout, dtype, window,
    );
    check_attention_kernels(
        dev,
        shape,
        window,
        dtype,
        products,
        &qkv,
        &dout,
        (&out, &lse, &dqkv),
    )
}

/// One kind of attention kernels on `qkv` and `dout` against the CPU's `(out, lse, dqkv)`.
#[allow(clippy::too_many_arguments)]
fn check_attention_kernels(
    dev: &Arc<CudaDevice>,
    shape: AttnShape,
    window: Option<usize>,
    dtype: DType,
    products: ops::AttentionProducts,
    qkv: &[f32],
    dout: &[f32],
    (out, lse, dqkv): (&[f32], &[f32], &[f32]),
) -> Result<Vec<CheckResult>, CudaError> {
    let AttnShape {
        batch,
        seq,
        heads,
        head_dim,
    } = shape;
    let s = ops::suffix(dtype);
    let d = shape.dim();
    let qkv_dev = CudaTensor::from_host(dev, qkv, dtype)?;
    let (out_dev, lse_dev) = ops::attention_forward_with(&qkv_dev, shape, window, products)?;
    let dout_dev = CudaTensor::from_host(dev, dout, dtype)?;
    let dqkv_dev = ops::attention_backward_with(
        &qkv_dev, &out_dev, &lse_dev, &dout_dev, shape, window, products,
    )?;
    let tol = tolerance(dtype);
    let windowed = window.map_or(String::new(), |w| format!(" window {w}"));
    let kind = products_label(products);
    let name = |what: &str| {
        format!("attention{kind} {batch}x{seq} h{heads}x{head_dim}{windowed} {what} {s}")
    };
    let mut results = vec![
        result(name("forward"), &out_dev.to_host_f32()?, out, tol),
        result(
            name("log-sum-exp"),
            &lse_dev.to_host_f32()?,
            lse,
            tol.min(1e-3),
        ),
    ];
    let got = dqkv_dev.to_host_f32()?;
    let pick = |v: &[f32], part: usize| -> Vec<f32> {
        v.chunks(3 * d)
            .flat_map(|row| row[part * d..(part + 1) * d].to_vec())
            .collect()
    };
    // q, k and v gradients apart: each comes from its own kernel. Where every query sees one
    // key (a one-token sequence, or a window of one) dq = dk = 0 exactly (softmax over one
    // key): both sides hold rounding noise there, so their difference is measured against
    // the size of dv instead.
    let dv_norm = pick(dqkv, 2)
        .iter()
        .map(|v| (*v as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let one_key_per_query = seq == 1 || window == Some(1);
    for (part, what) in ["dq", "dk", "dv"].iter().enumerate() {
        let (g, w) = (pick(&got, part), pick(dqkv, part));
        if one_key_per_query && part < 2 {
            let diff = g
                .iter()
                .zip(&w)
                .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            let rel_err = if g.iter().all(|v| v.is_finite()) {
                diff / dv_norm.max(1e-30)
            } else {
                f64::INFINITY
            };
            results.push(CheckResult {
                name: name(&format!("{what} (zero: against |dv|)")),
                rel_err,
                tolerance: tol,
                passed: rel_err <= tol,
                error: None,
            });
        } else {
            results.push(result(name(what), &g, &w, tol));
        }
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_fails_on_nan_and_length() {
        assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_l2(&[1.1], &[1.0]) - 0.1).abs() < 1e-6);
        assert!(rel_l2(&[f32::NAN], &[1.0]).is_infinite());
        assert!(rel_l2(&[1.0], &[f32::INFINITY]).is_infinite());
        assert!(rel_l2(&[1.0], &[1.0, 2.0]).is_infinite());
        assert_eq!(rel_l2(&[0.0], &[0.0]), 0.0);
    }

    /// The GPU checks: skipped (with the reason printed) without a GPU, required with
    /// `MESHTRAIN_REQUIRE_GPU=1`.
    #[test]
    fn every_device_operation_matches_its_cpu_twin() {
        if !super::super::probe::gpu_available() {
            assert!(
                std::env::var("MESHTRAIN_REQUIRE_GPU").as_deref() != Ok("1"),
                "MESHTRAIN_REQUIRE_GPU=1 but no usable CUDA GPU (driver missing or no device)"
            );
            eprintln!("skipped: no CUDA GPU (the driver or a device is missing)");
            return;
        }
        let dev = CudaDevice::get(0).expect("GPU 0");
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        let results = run_all(&dev, seed, &mut |_| {});
        let failed: Vec<String> = results
            .iter()
            .filter(|r| !r.passed)
            .map(|r| r.to_string())
            .collect();
        for r in &results {
            eprintln!("{r}");
        }
        assert!(failed.is_empty(), "seed {seed}:\n{}", failed.join("\n"));
    }
}
