//! The CUDA arms of the built-in layers. Each layer is written once (its parameters, what it
//! keeps for backward, how it composes); when its parameters or tensors are on a GPU, its
//! forward and backward come here and run `meshtrain_tensor::cuda::ops` instead of the CPU
//! kernels. What is kept for backward goes into [`Saved::tensors`] as device tensors, in
//! the dtype the kernels wrote (16 bits under mixed precision).
//!
//! Device errors (out of memory, a failed launch) cannot travel through the layer contract,
//! which returns tensors: they are raised ([`ok`]) and caught by the device step at its
//! boundary, which returns them as errors.

use crate::cache::{KvCache, LayerKv};
use crate::layer::{Mode, ParamsMut, Saved};
use crate::layers::{LayerNorm, Linear, RmsNorm};
use crate::transformer::{AttentionCore, GptEmbedding, QkNorm, Rotary};
use meshtrain_tensor::activation::Activation;
use meshtrain_tensor::attention::CachedShape;
use meshtrain_tensor::cuda::decode;
use meshtrain_tensor::cuda::error::ok_or_raise as ok;
use meshtrain_tensor::cuda::ops::{self, ActKind, AttnShape, LinearShape};
use meshtrain_tensor::cuda::{CudaDevice, CudaError, CudaTensor, DeviceGrads, DeviceParams};
use meshtrain_tensor::rotary::RotaryShape;
use meshtrain_tensor::{DType, Tensor};
use std::sync::Arc;

pub mod convnet;

/// `x`'s values on `dev`: a device tensor as it is, a host one uploaded (f32): a model's
/// first layer meets the batch this way.
pub fn on_device(x: &Tensor, dev: &Arc<CudaDevice>) -> CudaTensor {
    match x.cuda() {
        Some(c) => c.clone(),
        None => ok(CudaTensor::from_host(dev, x.data(), DType::F32)),
    }
}

/// `t`'s device values, taken out of it (a host tensor is uploaded).
fn device_values(t: Tensor, dev: &Arc<CudaDevice>) -> CudaTensor {
    match t.into_cuda() {
        Ok((values, _)) => values,
        Err(host) => on_device(&host, dev),
    }
}

fn wrap(t: CudaTensor, shape: &[usize]) -> Tensor {
    Tensor::from_cuda(t, shape)
}

fn device_grads(g: ParamsMut<'_>) -> DeviceGrads<'_> {
    match g {
        ParamsMut::Device(g) => g,
        ParamsMut::Host(_) => panic!("device parameters with host gradients"),
    }
}

fn kept(s: &mut Saved, what: &str) -> CudaTensor {
    let t = s
        .tensors
        .pop()
        .unwrap_or_else(|| panic!("{what}: nothing saved for backward"));
    t.cuda()
        .unwrap_or_else(|| panic!("{what}: a host tensor kept by a device forward"))
        .clone()
}

fn out_shape(x: &Tensor, last: usize) -> Vec<usize> {
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("non-empty shape") = last;
    shape
}

pub fn linear_forward(
    l: &Linear,
    p: DeviceParams<'_>,
    x: Tensor,
    mode: Mode,
    s: &mut Saved,
) -> Tensor {
    let dev = p.device();
    let xs = on_device(&x, dev);
    let shape = LinearShape {
        rows: x.numel() / l.inputs,
        inputs: l.inputs,
        outputs: l.outputs,
    };
    let y_shape = out_shape(&x, l.outputs);
    // Keep the input as the product reads it (rounded to 16 bits under mixed precision).
    let xs = ok(ops::to_dtype(&xs, l.precision));
    let products = |l: &Linear| {
        if l.fp8 {
            let agree = shard_agreement(l);
            meshtrain_tensor::cuda::fp8_linear::forward(
                &xs,
                p,
                shape,
                l.bias,
                agree.as_ref().map(|a| a as _),
            )
        } else {
            ops::linear_forward(&xs, p, shape, l.bias, l.precision, dev.f32_math())
        }
    };
    // The output, and what the activation's backward reads.
    let (y, act_input) = match l.activation.map(ActKind::from) {
        None => (ok(products(l)), None),
        // The product and its activation together: a tanh GELU in the product's epilogue.
        Some(kind) if !l.fp8 => {
            let (y, kept) = ok(ops::linear_act_forward(
                &xs,
                p,
                shape,
                l.bias,
                l.precision,
                dev.f32_math(),
                kind,
            ));
            (y, Some(kept))
        }
        Some(kind) => {
            let (y, kept) = ok(ops::activation_after(ok(products(l)), kind));
            (y, Some(kept))
        }
    };
    if mode.train {
        s.tensors.push(wrap(xs, x.shape()));
        if let Some(kept) = act_input {
            s.tensors.push(wrap(kept, &y_shape));
        }
    }
    wrap(y, &y_shape)
}

pub fn linear_backward(
    l: &Linear,
    p: DeviceParams<'_>,
    g: ParamsMut<'_>,
    s: Saved,
    dy: Tensor,
    need_dx: bool,
) -> Option<Tensor> {
    linear_backward_then(l, p, g, s, dy, need_dx, |dx| dx)
}

/// [`linear_backward`] with the input gradient taken on through `act`, the previous layer's
/// activation ([`crate::Layer::backward_into_activation`]): in the input-gradient product's
/// epilogue where it can (`ops::LinearGrads::backward_through`).
pub fn linear_backward_through(
    l: &Linear,
    p: DeviceParams<'_>,
    g: ParamsMut<'_>,
    s: Saved,
    dy: Tensor,
    act: &crate::layer::OutputActivation,
) -> Tensor {
    let pre = on_device(&act.input, p.device());
    let through = Some((&pre, ActKind::from(act.kind)));
    let shape = act.input.shape().to_vec();
    backward_products(l, p, g, s, dy, true, through, |dx| {
        wrap(
            dx.expect("a linear layer asked for its input gradient returns it"),
            &shape,
        )
    })
}

/// [`linear_backward`], with `after_dx` given the input gradient as soon as its product is
/// queued and before the weight gradient's (`ops::LinearGrads::backward`): tensor
/// parallelism starts its all-reduce (or reduce-scatter) of it there, so that the collective
/// runs while the weight gradient is computed. Returns what `after_dx` returns.
pub fn linear_backward_then<R>(
    l: &Linear,
    p: DeviceParams<'_>,
    g: ParamsMut<'_>,
    s: Saved,
    dy: Tensor,
    need_dx: bool,
    after_dx: impl FnOnce(Option<Tensor>) -> R,
) -> R {
    let shape = s.tensors.first().map(|x| x.shape().to_vec());
    backward_products(l, p, g, s, dy, need_dx, None, |dx| {
        after_dx(dx.map(|dx| {
            wrap(
                dx,
                shape
                    .as_deref()
                    .expect("Linear: nothing saved for backward"),
            )
        }))
    })
}

/// A linear layer's backward: its activation's gradient, then its products, the input
/// gradient taken on through `through` (the previous layer's activation) when given;
/// `after_dx` gets the input gradient as a device tensor.
#[allow(clippy::too_many_arguments)]
fn backward_products<R>(
    l: &Linear,
    p: DeviceParams<'_>,
    g: ParamsMut<'_>,
    mut s: Saved,
    dy: Tensor,
    need_dx: bool,
    through: Option<(&CudaTensor, ActKind)>,
    after_dx: impl FnOnce(Option<CudaTensor>) -> R,
) -> R {
    let dev = p.device();
    let mut g = device_grads(g);
    // The output gradient as the products read it: where its producer also wrote it rounded
    // to their type (a norm's input gradient, the residual stream's: `Tensor::rounded`), that
    // copy, which is what converting it here would give; not under an activation (whose
    // backward reads it unrounded) nor FP8 (whose casts do).
    let mut dz = match dy.rounded(l.precision) {
        Some(r) if l.activation.is_none() && !l.fp8 => r.clone(),
        _ => on_device(&dy, dev),
    };
    // Whether the bias gradient is still to be taken (the products' backward sums `dz`'s
    // columns), or was taken with the activation's gradient in one pass.
    let mut bias = l.bias;
    if let Some(act) = l.activation {
        let saved = kept(&mut s, "Linear (activation)");
        let kind = ActKind::from(act);
        let nw = l.inputs * l.outputs;
        let fused = if l.bias {
            let bias_grad = g.slice(nw..nw + l.outputs).ptr();
            ok(ops::activation_backward_with_bias(
                &saved, &dz, kind, l.outputs, bias_grad,
            ))
        } else {
            None
        };
        dz = match fused {
            Some(dz) => {
                bias = false;
                dz
            }
            None => ok(ops::activation_backward(&saved, &dz, kind)),
        };
    }
    let x = s.tensors.pop().expect("Linear: nothing saved for backward");
    let xs = x
        .cuda()
        .expect("Linear: a host input kept by a device forward");
    let linear_shape = LinearShape {
        rows: x.numel() / l.inputs,
        inputs: l.inputs,
        outputs: l.outputs,
    };
    if l.fp8 {
        let agree = shard_agreement(l);
        // The previous layer's activation, if any, as its own pass after the products.
        let after_dx = |dx: Option<CudaTensor>| {
            after_dx(dx.map(|dx| match through {
                Some((pre, kind)) => ok(ops::activation_backward(pre, &dx, kind)),
                None => dx,
            }))
        };
        return ok(meshtrain_tensor::cuda::fp8_linear::backward(
            xs,
            &dz,
            p,
            g,
            linear_shape,
            bias,
            need_dx,
            agree.as_ref().map(|a| a as _),
            after_dx,
        ));
    }
    let grads = ops::LinearGrads {
        shape: linear_shape,
        bias,
        precision: l.precision,
        math: dev.f32_math(),
    };
    ok(grads.backward_through(xs, &dz, p, g, need_dx, through, after_dx))
}

/// The agreement of an FP8 layer's amaxes over the ranks holding its other shards
/// ([`Linear::fp8_shards`]), as the device products take it; `None` for whole tensors.
#[allow(clippy::type_complexity)]
fn shard_agreement(
    l: &Linear,
) -> Option<impl Fn(CudaTensor) -> Result<CudaTensor, meshtrain_tensor::cuda::error::CudaError> + '_>
{
    l.fp8_shards.as_ref().map(|shards| {
        move |amaxes: CudaTensor| {
            let n = amaxes.len();
            let agreed = shards.agree(Tensor::from_cuda(amaxes, &[n]));
            Ok(agreed
                .into_cuda()
                .unwrap_or_else(|_| panic!("FP8 amaxes agreed into a host tensor"))
                .0)
        }
    })
}

/// A norm's forward on the device: `plain` of `x`, or with `add` (a residual branch's output)
/// `fused` of `x` and it. Returns `(the rows normalised, y, statistics)`.
fn norm_forward_with<S>(
    x: &Tensor,
    add: Option<&Tensor>,
    dev: &Arc<CudaDevice>,
    plain: impl FnOnce(&CudaTensor) -> Result<(CudaTensor, S), CudaError>,
    fused: impl FnOnce(&CudaTensor, &CudaTensor) -> Result<(CudaTensor, CudaTensor, S), CudaError>,
) -> (CudaTensor, CudaTensor, S) {
    let xs = on_device(x, dev);
    match add {
        None => {
            let (y, stats) = ok(plain(&xs));
            (xs, y, stats)
        }
        Some(h) => ok(fused(&xs, &on_device(h, dev))),
    }
}

/// A layer norm's forward of `x`, or with `add` (a residual branch's output) of the stream's
/// new value `x + add`, the residual add fused into the norm's kernel
/// ([`ops::add_layer_norm_forward`]): `(the rows normalised, y)`; backward keeps the former.
pub fn layer_norm_forward(
    n: &LayerNorm,
    p: DeviceParams<'_>,
    x: &Tensor,
    add: Option<&Tensor>,
    mode: Mode,
    s: &mut Saved,
) -> (Tensor, Tensor) {
    let (input, y, stats) = norm_forward_with(
        x,
        add,
        p.device(),
        |xs| ops::layer_norm_forward(xs, p, n.dim, n.eps, n.precision, mode.train),
        |xs, h| ops::add_layer_norm_forward(xs, h, p, n.dim, n.eps, n.precision, mode.train),
    );
    if let Some((mean, rstd)) = stats {
        let rows = [mean.len()];
        s.tensors.push(wrap(input.clone(), x.shape()));
        s.tensors.push(wrap(mean, &rows));
        s.tensors.push(wrap(rstd, &rows));
    }
    (wrap(input, x.shape()), wrap(y, x.shape()))
}

/// A norm's input gradient, with the copy rounded to 16 bits its kernel wrote beside it (for
/// the linear layer that reads the residual stream's gradient next: `Tensor::rounded`).
fn norm_input_grad((dx, rounded): ops::NormInputGrad, shape: &[usize]) -> Tensor {
    let dx = wrap(dx, shape);
    match rounded {
        Some(r) => dx.with_rounded(r),
        None => dx,
    }
}

/// With `add_into`, the input gradient is added into it (the residual stream's gradient) and
/// the sum returned. Under mixed precision it carries its 16-bit copy ([`norm_input_grad`]).
pub fn layer_norm_backward(
    n: &LayerNorm,
    p: DeviceParams<'_>,
    g: ParamsMut<'_>,
    mut s: Saved,
    dy: Tensor,
    add_into: Option<Tensor>,
) -> Tensor {
    let rstd = kept(&mut s, "LayerNorm (rstd)");
    let mean = kept(&mut s, "LayerNorm (mean)");
    let x = s.tensors.pop().expect("LayerNorm: input");
    let xs = x
        .cuda()
        .expect("LayerNorm: a host input kept by a device forward");
    let dys = on_device(&dy, p.device());
    let dx = ok(ops::layer_norm_backward(
        xs,
        p,
        &mean,
        &rstd,
        &dys,
        device_grads(g),
        n.dim,
        add_into.map(|t| device_values(t, p.device())),
        n.precision != DType::F32,
    ));
    norm_input_grad(dx, x.shape())
}

/// An RMS norm's forward, with or without the residual add before it: as
/// [`layer_norm_forward`].
pub fn rms_norm_forward(
    n: &RmsNorm,
    p: DeviceParams<'_>,
    x: &Tensor,
    add: Option<&Tensor>,
    mode: Mode,
    s: &mut Saved,
) -> (Tensor, Tensor) {
    let (input, y, rstd) = norm_forward_with(
        x,
        add,
        p.device(),
        |xs| ops::rms_norm_forward(xs, p, n.dim, n.eps, n.precision, mode.train),
        |xs, h| ops::add_rms_norm_forward(xs, h, p, n.dim, n.eps, n.precision, mode.train),
    );
    if let Some(rstd) = rstd {
        let rows = [rstd.len()];
        s.tensors.push(wrap(input.clone(), x.shape()));
        s.tensors.push(wrap(rstd, &rows));
    }
    (wrap(input, x.shape()), wrap(y, x.shape()))
}

/// As [`layer_norm_backward`].
pub fn rms_norm_backward(
    n: &RmsNorm,
    p: DeviceParams<'_>,
    g: ParamsMut<'_>,
    mut s: Saved,
    dy: Tensor,
    add_into: Option<Tensor>,
) -> Tensor {
    let rstd = kept(&mut s, "RmsNorm (rstd)");
    let x = s.tensors.pop().expect("RmsNorm: input");
    let xs = x
        .cuda()
        .expect("RmsNorm: a host input kept by a device forward");
    let dys = on_device(&dy, p.device());
    let dx = ok(ops::rms_norm_backward(
        xs,
        p,
        &rstd,
        &dys,
        device_grads(g),
        n.dim,
        add_into.map(|t| device_values(t, p.device())),
        n.precision != DType::F32,
    ));
    norm_input_grad(dx, x.shape())
}

/// Rows `[a | b]` → `silu(a)·b` in x's dtype (the product dtype under mixed precision: the
/// gate/up projection wrote it, the down projection reads it); the input is kept.
pub fn swiglu_forward(x: Tensor, mode: Mode, s: &mut Saved) -> Tensor {
    let xs = x.cuda().expect("a device SwiGLU's input").clone();
    let half = x.shape().last().copied().unwrap_or(0) / 2;
    let y = wrap(ok(ops::swiglu_forward(&xs, half)), &out_shape(&x, half));
    if mode.train {
        s.tensors.push(x);
    }
    y
}

pub fn swiglu_backward(kept: Tensor, dy: Tensor) -> Tensor {
    let xs = kept.cuda().expect("device SwiGLU state");
    let half = kept.shape().last().copied().unwrap_or(0) / 2;
    let dys = on_device(&dy, xs.device());
    wrap(ok(ops::swiglu_backward(xs, &dys, half)), kept.shape())
}

/// The rotary tables of `t` tokens (from position `first` on, when given), computed on the
/// host by the CPU's own function (so the angles are bit-identical to the CPU's) and uploaded.
fn rotary_tables(
    r: &Rotary,
    t: usize,
    first: Option<usize>,
    dev: &Arc<CudaDevice>,
) -> (CudaTensor, CudaTensor) {
    let (cos, sin) = r.tables(t, first);
    (
        ok(CudaTensor::from_host(dev, &cos, DType::F32)),
        ok(CudaTensor::from_host(dev, &sin, DType::F32)),
    )
}

/// Rotary + GQA on a device tensor, in its dtype; keeps the (device) tables for backward.
pub fn rotary_forward(
    r: &Rotary,
    shape: RotaryShape,
    x: Tensor,
    first: Option<usize>,
    mode: Mode,
    s: &mut Saved,
) -> Tensor {
    let xs = x.cuda().expect("a device rotary input");
    let (cos, sin) = rotary_tables(r, shape.seq, first, xs.device());
    let y = ok(ops::rotary_forward(xs, shape, &cos, &sin));
    if mode.train {
        let table = [shape.seq, shape.head_dim / 2];
        s.tensors.push(wrap(cos, &table));
        s.tensors.push(wrap(sin, &table));
    }
    wrap(y, &[shape.batch, shape.seq, shape.output_width()])
}

pub fn rotary_backward(shape: RotaryShape, mut s: Saved, dy: Tensor) -> Tensor {
    let sin = kept(&mut s, "rotary (sines)");
    let cos = kept(&mut s, "rotary (cosines)");
    let dys = on_device(&dy, sin.device());
    wrap(
        ok(ops::rotary_backward(&dys, shape, &cos, &sin)),
        &[shape.batch, shape.seq, shape.input_width()],
    )
}

pub fn act_forward(act: Activation, x: Tensor, mode: Mode, s: &mut Saved) -> Tensor {
    let xs = x.cuda().expect("a device activation's input").clone();
    let kind = ActKind::from(act);
    let y = wrap(ok(ops::activation_forward(&xs, kind)), x.shape());
    if mode.train {
        s.tensors.push(if kind.backward_uses_output() {
            y.clone()
        } else {
            x
        });
    }
    y
}

pub fn act_backward(act: Activation, kept: Tensor, dy: Tensor) -> Tensor {
    let saved = kept.cuda().expect("device activation state");
    let dys = on_device(&dy, saved.device());
    wrap(
        ok(ops::activation_backward(saved, &dys, ActKind::from(act))),
        kept.shape(),
    )
}

/// The position-table rows of `t` tokens (from position `first` on, when given), or `None`
/// for an embedding without a table.
fn positions(e: &GptEmbedding, t: usize, first: Option<usize>) -> Option<Vec<i32>> {
    e.learned_positions.then(|| {
        (0..t)
            .map(|i| e.sequence.position_from(i, t, first) as i32)
            .collect()
    })
}

pub fn embedding_forward(
    e: &GptEmbedding,
    p: DeviceParams<'_>,
    ids: Tensor,
    first: Option<usize>,
    mode: Mode,
    s: &mut Saved,
) -> Tensor {
    let (b, t, d) = (ids.dim(0), ids.dim(1), e.dim);
    // The batch comes from the host, so its ids are read there, checked once and kept there:
    // backward groups tokens by id on the host.
    let token_ids = ok(ops::token_ids(ids.to_host().data(), e.vocab));
    let y = ok(ops::embedding_forward(
        p.device(),
        &token_ids,
        p,
        e.vocab,
        d,
        positions(e, t, first).as_deref(),
    ));
    if mode.train {
        s.indices
            .push(token_ids.iter().map(|&i| i as u32).collect());
    }
    wrap(y, &[b, t, d])
}

pub fn embedding_backward(e: &GptEmbedding, g: DeviceGrads<'_>, mut s: Saved, dy: Tensor) {
    let token_ids: Vec<i32> = s
        .indices
        .pop()
        .expect("embedding: saved ids")
        .into_iter()
        .map(|i| i as i32)
        .collect();
    let dys = on_device(&dy, g.device());
    ok(ops::embedding_backward(
        &dys,
        &token_ids,
        g,
        e.vocab,
        e.dim,
        positions(e, dy.dim(1), None).as_deref(),
    ));
}

fn attn_shape(a: &AttentionCore, qkv: &Tensor) -> AttnShape {
    AttnShape {
        batch: qkv.dim(0),
        seq: qkv.dim(1),
        heads: a.heads,
        head_dim: a.dim / a.heads,
    }
}

/// Both attention kernels compute the same function; on a GPU the memory-efficient one runs
/// whatever the layer's kind (the probability-keeping kernel exists for the CPU).
pub fn attention_forward(a: &AttentionCore, qkv: Tensor, mode: Mode, s: &mut Saved) -> Tensor {
    let shape = attn_shape(a, &qkv);
    let q = ok(ops::to_dtype(
        qkv.cuda().expect("device q/k/v"),
        a.precision,
    ));
    let (out, lse) = ok(ops::attention_forward(&q, shape, a.window));
    let out_shape = [shape.batch, shape.seq, a.dim];
    if mode.train {
        s.tensors.push(wrap(q, qkv.shape()));
        s.tensors.push(wrap(out.clone(), &out_shape));
        s.tensors
            .push(wrap(lse, &[shape.batch, a.heads, shape.seq]));
    }
    wrap(out, &out_shape)
}

/// A cached pass's attention on a device ([`AttentionCore`]'s `forward_cached`): the new
/// rows' keys and values into the layer's device cache (room for the whole context, made by
/// the first pass), then their queries over it; f32 (`cuda::decode`).
pub fn attention_cached(
    a: &AttentionCore,
    shape: CachedShape,
    qkv: Tensor,
    cache: &mut KvCache,
) -> Tensor {
    let qs = ok(ops::to_dtype(qkv.cuda().expect("device q/k/v"), DType::F32));
    let dev = qs.device().clone();
    let slot = cache.next_layer(shape.kv_width(), |capacity| {
        let room = capacity * shape.kv_width();
        LayerKv::Device {
            keys: ok(CudaTensor::zeros(&dev, room, DType::F32, "the key cache")),
            values: ok(CudaTensor::zeros(&dev, room, DType::F32, "the value cache")),
        }
    });
    let LayerKv::Device { keys, values } = slot else {
        panic!("a device attention pass over a host cache")
    };
    ok(decode::append_kv(&qs, keys, values, shape));
    let out = ok(decode::attention(&qs, keys, values, shape));
    wrap(out, &[1, shape.rows, a.dim])
}

/// Qwen3's q/k norms on a device: the query and key heads moved out of the grouped rows
/// (f32), the RMS norm kernels on them, moved back into the f32 rows (a copy when the input
/// is still read elsewhere), returned in the input's dtype; the heads and their scales kept
/// for backward.
pub fn qk_norm_forward(
    n: &QkNorm,
    shape: RotaryShape,
    p: DeviceParams<'_>,
    x: Tensor,
    mode: Mode,
    s: &mut Saved,
) -> Tensor {
    let input = on_device(&x, p.device());
    let xs = ok(ops::to_dtype(&input, DType::F32));
    let hd = n.head_dim;
    let (q, k) = ok(ops::qk_heads(&xs, shape));
    let (qn, rq) = ok(ops::rms_norm_forward(
        &q,
        p.slice(0..hd),
        hd,
        n.eps,
        DType::F32,
        mode.train,
    ));
    let (kn, rk) = ok(ops::rms_norm_forward(
        &k,
        p.slice(hd..2 * hd),
        hd,
        n.eps,
        DType::F32,
        mode.train,
    ));
    // The value heads pass through: the rows written in place (a copy when shared).
    let y = ok(ops::writable(xs, true));
    ok(ops::qk_heads_into(&qn, &kn, &y, shape));
    if let (Some(rq), Some(rk)) = (rq, rk) {
        for t in [q, k, rq, rk] {
            let len = t.len();
            s.tensors.push(wrap(t, &[len]));
        }
    }
    wrap(ok(ops::to_dtype(&y, input.dtype())), x.shape())
}

/// The gradient of [`qk_norm_forward`]: the input gradient (in `dy`'s dtype), the weights'
/// gradients added into `g` by the RMS norm kernels (under tensor parallelism summed over the
/// group first, through the host: `2·hd` values).
pub fn qk_norm_backward(
    n: &QkNorm,
    shape: RotaryShape,
    p: DeviceParams<'_>,
    g: ParamsMut<'_>,
    mut s: Saved,
    dy: Tensor,
) -> Tensor {
    let rk = kept(&mut s, "q/k norms (key scales)");
    let rq = kept(&mut s, "q/k norms (query scales)");
    let k = kept(&mut s, "q/k norms (keys)");
    let q = kept(&mut s, "q/k norms (queries)");
    let dev = p.device();
    let hd = n.head_dim;
    let incoming = on_device(&dy, dev);
    let dys = ok(ops::to_dtype(&incoming, DType::F32));
    let (dq, dk) = ok(ops::qk_heads(&dys, shape));
    let mut g = device_grads(g);
    let norms = |grads: &mut DeviceGrads<'_>| {
        let (dqx, _) = ok(ops::rms_norm_backward(
            &q,
            p.slice(0..hd),
            &rq,
            &dq,
            grads.slice(0..hd),
            hd,
            None,
            false,
        ));
        let (dkx, _) = ok(ops::rms_norm_backward(
            &k,
            p.slice(hd..2 * hd),
            &rk,
            &dk,
            grads.slice(hd..2 * hd),
            hd,
            None,
            false,
        ));
        (dqx, dkx)
    };
    let (dqx, dkx) = if n.grad_reducer.is_none() {
        norms(&mut g)
    } else {
        // This pass's weight gradients alone, summed over the tensor-parallel group through
        // the host (2·hd values), then added to the gradient.
        let scratch = ok(CudaTensor::zeros(
            dev,
            2 * hd,
            DType::F32,
            "q/k norms' weight gradients",
        ));
        // SAFETY: the scratch buffer holds 2·hd f32 values and outlives the view.
        let mut part = unsafe { DeviceGrads::new(dev, scratch.ptr(), 2 * hd) };
        let moved = norms(&mut part);
        let mut dw = ok(scratch.to_host_f32());
        n.sum_over_heads(&mut dw);
        let mut total: Vec<f32> = ok(dev.download(g.ptr(), 2 * hd));
        total.iter_mut().zip(&dw).for_each(|(t, d)| *t += d);
        ok(dev.upload_to(g.ptr(), &total));
        moved
    };
    // The value heads' gradient passes through; the query and key heads' are the norms'.
    let dx = ok(ops::writable(dys, true));
    ok(ops::qk_heads_into(&dqx, &dkx, &dx, shape));
    // In the dtype the rotary pass's gradient came in, as the projection expects it.
    wrap(ok(ops::to_dtype(&dx, incoming.dtype())), dy.shape())
}

/// The last of `x`'s `rows` rows of `width` values, copied on the device.
pub fn last_row(x: Tensor, rows: usize, width: usize) -> Tensor {
    let xs = x.cuda().expect("a device tensor");
    let bytes = width * xs.dtype().size_bytes();
    let last = ok(CudaTensor::alloc(
        xs.device(),
        width,
        xs.dtype(),
        "the last row",
    ));
    ok(xs
        .device()
        .copy(last.ptr(), xs.ptr() + ((rows - 1) * bytes) as u64, bytes));
    wrap(last, &[1, 1, width])
}

pub fn attention_backward(a: &AttentionCore, mut s: Saved, dy: Tensor) -> Tensor {
    let lse = kept(&mut s, "attention (log-sum-exp)");
    let out = kept(&mut s, "attention (output)");
    let qkv = s.tensors.pop().expect("attention: q/k/v");
    let shape = attn_shape(a, &qkv);
    let qs = qkv.cuda().expect("device q/k/v");
    let dys = on_device(&dy, qs.device());
    wrap(
        ok(ops::attention_backward(
            qs, &out, &lse, &dys, shape, a.window,
        )),
        qkv.shape(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transformer::SequenceShard;
    use meshtrain_tensor::Device;

    fn embedding(learned_positions: bool, sequence: SequenceShard) -> GptEmbedding {
        GptEmbedding {
            vocab: 10,
            max_seq: 8,
            dim: 4,
            init_std: 0.02,
            learned_positions,
            sequence,
        }
    }

    /// The device embedding adds the position rows the CPU adds, and none (a null table)
    /// without a position table.
    #[test]
    fn the_device_embedding_gets_positions_only_with_a_table() {
        assert_eq!(
            positions(&embedding(false, SequenceShard::default()), 4, None),
            None
        );
        assert_eq!(
            positions(&embedding(true, SequenceShard::default()), 4, None),
            Some(vec![0, 1, 2, 3])
        );
        // A context-parallel worker's tokens sit at their places in the whole sequence.
        let shard = SequenceShard { parts: 2, index: 0 };
        assert_eq!(
            positions(&embedding(true, shard), 4, None),
            Some(vec![0, 1, 6, 7])
        );
        for learned in [false, true] {
            let e = embedding(learned, SequenceShard::default());
            assert!(crate::Layer::runs_on(&e, Device::Cuda(0)));
        }
    }
}
