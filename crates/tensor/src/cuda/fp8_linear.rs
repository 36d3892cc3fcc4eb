//! A linear layer's three products in FP8 on the GPU (`--precision fp8`): the device twin of
//! the CPU's [`crate::fp8::gemm_fp8`] path in `Linear`, with the same casts (inputs and
//! weights in E4M3, output gradients in E5M2, each at its own current scale) and cuBLASLt's
//! FP8 tensor-core products with f32 sums.
//!
//! Why transposes: cuBLASLt takes FP8 operands only "TN" (its A transposed, its B not, in
//! its column-major terms). The forward product `y = x·Wᵀ` is already that shape (the same
//! description as the bf16 one); backward's are not, so their operands are cast transposed
//! (Transformer Engine's cast-transpose): `dx = dy·W` reads `Wᵀ`, and `dW += dyᵀ·x` reads
//! `xᵀ` and `dyᵀ`. Each tensor's casts are an amax pass and a cast pass over the bf16 tensor
//! (`dy`, wanted both ways, is cast to both from one read: `fp8_cast_both`); the scales never
//! leave the device.
//!
//! Each pass takes its tensors' amaxes first, into one small device tensor
//! ([`super::train_ops::fp8_amaxes`]), then casts: a tensor-parallel layer's ranks agree on
//! those amaxes in between ([`ShardAgreement`]), so that every shard is cast at the whole
//! tensor's scale, as the CPU's `Linear` does.
//!
//! What is kept for backward is the bf16 input, as under bf16 (the layer's kept tensors do
//! not change with fp8, so sequence parallelism's re-gather and recomputation work as they
//! are); backward casts it again, from its own amax, exactly as the CPU path does.

use super::blas::{Epilogue, Fp8Operands, Gemm};
use super::error::CudaError;
use super::ops::{check_len, epilogue_bias, to_dtype, weight_in, LinearShape};
use super::train_ops::{
    check_cast_transpose, fp8_amaxes, fp8_cast_both, fp8_cast_from, Fp8Cast, Fp8Source,
};
use super::{CudaTensor, DeviceGrads, DeviceParams};
use crate::fp8::Fp8Format;
use crate::DType;

/// What the FP8 products read and write besides FP8: bf16 (activations, the weights' compute
/// copy, the forward and input-gradient outputs).
const COMPUTE: DType = DType::BF16;

/// How a tensor-parallel layer's ranks agree on a pass's FP8 amaxes: the f32 device tensor
/// of them in, their maxima over the ranks out ([`super::train_ops::Fp8Amaxes::agreed`]).
/// `None` for a layer whose tensors are whole. The amaxes' order: forward `[x, W]`,
/// backward `[dy, W, x]`, as the CPU's `Linear` agrees on them.
pub type ShardAgreement<'a> = Option<&'a dyn Fn(CudaTensor) -> Result<CudaTensor, CudaError>>;

/// A pass's amaxes of `sources`, agreed over the shards when `agree` says so.
fn amaxes_of(
    dev: &std::sync::Arc<super::context::CudaDevice>,
    sources: &[Fp8Source],
    agree: ShardAgreement,
) -> Result<std::sync::Arc<super::train_ops::Fp8Amaxes>, CudaError> {
    let amaxes = fp8_amaxes(dev, sources)?;
    let amaxes = match agree {
        Some(agree) => amaxes.agreed(agree)?,
        None => amaxes,
    };
    Ok(std::sync::Arc::new(amaxes))
}

/// A bf16 `[rows, cols]` tensor at `ptr`, to be cast.
fn source(ptr: u64, rows: usize, cols: usize) -> Fp8Source {
    Fp8Source {
        ptr,
        dtype: COMPUTE,
        rows,
        cols,
    }
}

fn operands(a: &Fp8Cast, b: &Fp8Cast) -> Option<Fp8Operands> {
    Some(Fp8Operands {
        a: a.format,
        b: b.format,
        a_inv_scale: a.inv_scale(),
        b_inv_scale: b.inv_scale(),
    })
}

/// The shape conditions of cuBLASLt's FP8 products for this layer, checked before any cast:
/// every dimension a multiple of 16 (each is some product's inner or leading dimension),
/// and backward's cast-transposes (of `rows` and `outputs` rows) each one launch.
fn check_shape(shape: LinearShape) -> Result<(), CudaError> {
    let LinearShape {
        rows,
        inputs,
        outputs,
    } = shape;
    if [rows, inputs, outputs].iter().all(|d| d % 16 == 0) {
        check_cast_transpose(rows)?;
        return check_cast_transpose(outputs);
    }
    Err(CudaError::Unsupported(format!(
        "an FP8 linear layer of {inputs} -> {outputs} features over {rows} rows: cuBLASLt's \
         FP8 products need each of the three in multiples of 16 (train this model in bf16, \
         or pick sizes that are)"
    )))
}

/// `y = x·Wᵀ (+ bias)` with `x` and `W` cast to E4M3; `y` in bf16.
pub fn forward(
    x: &CudaTensor,
    p: DeviceParams,
    shape: LinearShape,
    bias: bool,
    agree: ShardAgreement,
) -> Result<CudaTensor, CudaError> {
    let LinearShape {
        rows,
        inputs,
        outputs,
    } = shape;
    check_shape(shape)?;
    check_len(x, rows * inputs, "linear layer input")?;
    let nw = inputs * outputs;
    let (w, b) = p.split_at(nw);
    let dev = x.device().clone();
    let x = to_dtype(x, COMPUTE)?;
    let w = weight_in(&w, COMPUTE, "linear weight")?;
    let x_source = source(x.ptr(), rows, inputs);
    let w_source = source(w, outputs, inputs);
    let amaxes = amaxes_of(&dev, &[x_source, w_source], agree)?;
    let xq = fp8_cast_from(&amaxes, 0, x_source, Fp8Format::E4M3, false)?;
    let wq = fp8_cast_from(&amaxes, 1, w_source, Fp8Format::E4M3, false)?;
    let y = CudaTensor::alloc(&dev, rows * outputs, COMPUTE, "a linear layer's output")?;
    let (bias_ptr, aligned_bias) = epilogue_bias(&dev, bias.then_some(b), outputs, COMPUTE)?;
    // Column-major: yᵀ [outputs × rows] = (W stored [inputs × outputs])ᵀ · xᵀ [inputs × rows].
    let g = Gemm {
        transa: true,
        a: wq.codes.ptr(),
        lda: inputs,
        b: xq.codes.ptr(),
        ldb: inputs,
        d: y.ptr(),
        ldd: outputs,
        epilogue: bias_ptr.map_or(Epilogue::None, Epilogue::Bias),
        fp8: operands(&wq, &xq),
        ..Gemm::plain(outputs, rows, inputs, COMPUTE, dev.f32_math())
    };
    dev.with_blas(|blas| blas.gemm(&g))?;
    drop((aligned_bias, xq, wq));
    Ok(y)
}

/// Backward of [`forward`]: `dx = dy·W` (if `need_dx`; bf16) with `dy` in E5M2 and `Wᵀ` in
/// E4M3, handed to `after_dx` as soon as it is queued (tensor parallelism starts its
/// collective there); then `dW += dyᵀ·x` (f32, accumulated) with `xᵀ` in E4M3 and `dyᵀ` in
/// E5M2, and `db += Σ_rows dy` from the bf16 `dy`, as under bf16.
#[allow(clippy::too_many_arguments)]
pub fn backward<R>(
    x: &CudaTensor,
    dy: &CudaTensor,
    p: DeviceParams,
    grads: DeviceGrads,
    shape: LinearShape,
    bias: bool,
    need_dx: bool,
    agree: ShardAgreement,
    after_dx: impl FnOnce(Option<CudaTensor>) -> R,
) -> Result<R, CudaError> {
    let LinearShape {
        rows,
        inputs,
        outputs,
    } = shape;
    check_shape(shape)?;
    check_len(x, rows * inputs, "linear layer kept input")?;
    check_len(dy, rows * outputs, "linear layer output gradient")?;
    let dev = x.device().clone();
    let x = to_dtype(x, COMPUTE)?;
    let dy = to_dtype(dy, COMPUTE)?;
    let nw = inputs * outputs;
    let (gw, gb) = grads.split_at(nw);
    let math = dev.f32_math();
    let w = weight_in(&p.slice(0..nw), COMPUTE, "linear weight")?;
    let dy_source = source(dy.ptr(), rows, outputs);
    let w_source = source(w, outputs, inputs);
    let x_source = source(x.ptr(), rows, inputs);
    // One amax pass per tensor, `dy`'s for both its layouts: as it is (the input gradient's
    // B) and transposed (the weight gradient's B).
    let amaxes = amaxes_of(&dev, &[dy_source, w_source, x_source], agree)?;
    // `dy` in both layouts from one read when both are wanted.
    let (dyq, dyt) = if need_dx {
        let (plain, transposed) = fp8_cast_both(&amaxes, 0, dy_source, Fp8Format::E5M2)?;
        (Some(plain), transposed)
    } else {
        let transposed = fp8_cast_from(&amaxes, 0, dy_source, Fp8Format::E5M2, true)?;
        (None, transposed)
    };
    let dx = if let Some(dyq) = dyq {
        // Wᵀ [inputs, outputs] row-major is column-major [outputs × inputs]: A, transposed.
        let wt = fp8_cast_from(&amaxes, 1, w_source, Fp8Format::E4M3, true)?;
        let dx = CudaTensor::alloc(
            &dev,
            rows * inputs,
            COMPUTE,
            "a linear layer's input gradient",
        )?;
        // Column-major: dxᵀ [inputs × rows] = (Wᵀ stored [outputs × inputs])ᵀ · dyᵀ.
        let g = Gemm {
            transa: true,
            a: wt.codes.ptr(),
            lda: outputs,
            b: dyq.codes.ptr(),
            ldb: outputs,
            d: dx.ptr(),
            ldd: inputs,
            fp8: operands(&wt, &dyq),
            ..Gemm::plain(inputs, rows, outputs, COMPUTE, math)
        };
        dev.with_blas(|blas| blas.gemm(&g))?;
        drop((wt, dyq));
        Some(dx)
    } else {
        None
    };
    let after = after_dx(dx);
    // xᵀ [inputs, rows] (and dyᵀ [outputs, rows], above), row-major.
    let xt = fp8_cast_from(&amaxes, 2, x_source, Fp8Format::E4M3, true)?;
    // Column-major: dWᵀ [inputs × outputs] = (xᵀ stored [rows × inputs])ᵀ · (dyᵀ stored
    // [rows × outputs]).
    let g = Gemm {
        transa: true,
        a: xt.codes.ptr(),
        lda: rows,
        b: dyt.codes.ptr(),
        ldb: rows,
        d: gw.ptr(),
        ldd: inputs,
        output: DType::F32,
        accumulate: true,
        fp8: operands(&xt, &dyt),
        ..Gemm::plain(inputs, outputs, rows, COMPUTE, math)
    };
    dev.with_blas(|blas| blas.gemm(&g))?;
    drop((xt, dyt));
    if bias {
        super::ops::column_sums(&dy, rows, outputs, gb.ptr(), true)?;
    }
    Ok(after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_off_sixteen_are_refused_before_any_work() {
        let ok = LinearShape {
            rows: 4096,
            inputs: 768,
            outputs: 2304,
        };
        assert!(check_shape(ok).is_ok());
        for bad in [
            LinearShape { rows: 100, ..ok },
            LinearShape { inputs: 770, ..ok },
            LinearShape { outputs: 10, ..ok },
        ] {
            let e = check_shape(bad).unwrap_err().to_string();
            assert!(e.contains("multiples of 16"), "{e}");
        }
    }
}
