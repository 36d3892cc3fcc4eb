//! The CUDA arms of the convolutional layers (convolution, batch norm, pooling, the layout
//! changes) and of ResNet's residual join: the same layers as on the CPU, their kernels from
//! `meshtrain_tensor::cuda::convnet`. Activations stay CNHW on the device; what is kept for
//! backward is a device tensor in the dtype the kernels wrote.

use super::{device_grads, kept, ok, on_device, wrap};
use crate::layer::{Mode, ParamsMut, Saved, StatsReducer};
use crate::layers::{BatchNorm2d, Conv2d, Flatten, Pool2d, PoolKind};
use meshtrain_tensor::conv::Spatial;
use meshtrain_tensor::cuda::convnet::{
    self, BatchNorm, BatchStats, ConvLayer, ConvShape, PoolShape,
};
use meshtrain_tensor::cuda::ops::{self, ActKind};
use meshtrain_tensor::cuda::{CudaDevice, DeviceParams};
use meshtrain_tensor::Tensor;
use std::sync::Arc;

fn conv_layer(c: &Conv2d, x_shape: &[usize], dev: &CudaDevice) -> ConvLayer {
    ConvLayer {
        shape: ConvShape {
            geom: c.geom,
            input: Spatial {
                batch: x_shape[1],
                height: x_shape[2],
                width: x_shape[3],
            },
        },
        bias: c.bias,
        precision: c.precision,
        math: dev.f32_math(),
    }
}

pub fn conv_forward(
    c: &Conv2d,
    p: DeviceParams<'_>,
    x: Tensor,
    mode: Mode,
    s: &mut Saved,
) -> Tensor {
    let dev = p.device();
    let layer = conv_layer(c, x.shape(), dev);
    // Kept as the products read it (rounded to 16 bits under mixed precision, as the CPU
    // keeps it); the columns are rebuilt from it in backward.
    let xs = ok(layer.product_input(&on_device(&x, dev)));
    let y = ok(layer.forward(&xs, p));
    let (oh, ow) = layer.shape.output_size();
    if mode.train {
        s.tensors.push(wrap(xs, x.shape()));
    }
    wrap(y, &[c.geom.out_channels, x.dim(1), oh, ow])
}

pub fn conv_backward(
    c: &Conv2d,
    p: DeviceParams<'_>,
    g: ParamsMut<'_>,
    mut s: Saved,
    dy: Tensor,
    need_dx: bool,
) -> Option<Tensor> {
    let x = s.tensors.pop().expect("Conv2d: nothing saved for backward");
    let xs = x
        .cuda()
        .expect("Conv2d: a host input kept by a device forward");
    let dev = p.device();
    let layer = conv_layer(c, x.shape(), dev);
    let dys = on_device(&dy, dev);
    let dx = ok(layer.backward(xs, &dys, p, device_grads(g), need_dx));
    dx.map(|dx| wrap(dx, x.shape()))
}

fn batch_norm(bn: &BatchNorm2d) -> BatchNorm {
    BatchNorm {
        channels: bn.channels,
        eps: bn.eps,
    }
}

/// Per-channel sums (and their count) added up over the workers by SyncBatchNorm's reducer,
/// the count riding along as on the CPU; as they are without one.
fn reduced(
    sums: convnet::ChannelSums,
    count: usize,
    reducer: Option<&Arc<dyn StatsReducer>>,
) -> (convnet::ChannelSums, usize) {
    let Some(reducer) = reducer else {
        return (sums, count);
    };
    let mut total = count;
    let sums = ok(convnet::sums_through_host(sums, |values| {
        values.push(count as f64);
        reducer.sum(values);
        total = values.pop().expect("the count") as usize;
    }));
    (sums, total)
}

pub fn batch_norm_forward(
    bn: &BatchNorm2d,
    p: DeviceParams<'_>,
    b: ParamsMut<'_>,
    x: Tensor,
    mode: Mode,
    s: &mut Saved,
) -> Tensor {
    let dev = p.device();
    let norm = batch_norm(bn);
    let xs = on_device(&x, dev);
    let running = device_grads(b);
    assert_eq!(
        running.len(),
        2 * bn.channels,
        "BatchNorm2d: running statistics of {} values for {} channels",
        running.len(),
        bn.channels
    );
    if !mode.train {
        let (y, _) = ok(norm.apply(&xs, running.ptr(), p, false));
        return wrap(y, x.shape());
    }
    let count = xs.len() / bn.channels;
    let sums = ok(norm.sums(&xs));
    let (sums, count) = reduced(sums, count, bn.reducer());
    let update = mode.update_stats.then_some(running);
    let stats = ok(norm.moments(dev, &sums, count, update, bn.momentum));
    let (y, xhat) = ok(norm.apply(&xs, stats.stats.ptr(), p, true));
    let xhat = xhat.expect("kept in training");
    s.tensors.push(wrap(xhat, x.shape()));
    s.tensors.push(wrap(stats.stats, &[2 * bn.channels]));
    s.indices.push(vec![stats.count as u32]);
    wrap(y, x.shape())
}

pub fn batch_norm_backward(
    bn: &BatchNorm2d,
    p: DeviceParams<'_>,
    g: ParamsMut<'_>,
    mut s: Saved,
    dy: Tensor,
    need_dx: bool,
) -> Option<Tensor> {
    let dev = p.device();
    let norm = batch_norm(bn);
    let stats = kept(&mut s, "BatchNorm2d (statistics)");
    let xhat = kept(&mut s, "BatchNorm2d (normalised input)");
    let count = s.indices.pop().expect("BatchNorm2d: saved count")[0] as usize;
    // In x̂'s dtype once, for both of the backward's kernels.
    let dys = ok(ops::to_dtype(&on_device(&dy, dev), xhat.dtype()));
    let sums = ok(norm.grad_sums(&dys, &xhat, device_grads(g)));
    if !need_dx {
        return None;
    }
    // The input gradient's sums are the global ones under SyncBatchNorm (the parameter
    // gradients above took the local ones: data parallelism averages them afterwards).
    let (sums, _) = reduced(sums, 0, bn.reducer());
    let stats = BatchStats { stats, count };
    let dx = ok(norm.input_grad(&dys, &xhat, &stats, p, &sums));
    Some(wrap(dx, dy.shape()))
}

fn pool_shape(pool: &Pool2d, shape: &[usize]) -> PoolShape {
    PoolShape {
        geom: pool.geom,
        planes: shape[0] * shape[1],
        height: shape[2],
        width: shape[3],
    }
}

pub fn pool_forward(pool: &Pool2d, x: Tensor, mode: Mode, s: &mut Saved) -> Tensor {
    let xs = x.cuda().expect("a device pooling input");
    let shape = pool_shape(pool, x.shape());
    let y = match pool.kind {
        PoolKind::Max => {
            let (y, winners) = ok(convnet::max_pool_forward(xs, shape, mode.train));
            if let Some(w) = winners {
                s.tensors.push(wrap(w, &[y.len()]));
            }
            y
        }
        PoolKind::Avg => ok(convnet::avg_pool_forward(xs, shape)),
    };
    if mode.train {
        s.stats.push(x.shape().iter().map(|&d| d as f32).collect());
    }
    let (oh, ow) = pool.geom.output_size(x.dim(2), x.dim(3));
    wrap(y, &[x.dim(0), x.dim(1), oh, ow])
}

pub fn pool_backward(pool: &Pool2d, mut s: Saved, dy: Tensor) -> Tensor {
    let input: Vec<usize> = s
        .stats
        .pop()
        .expect("Pool2d: saved input shape")
        .iter()
        .map(|&d| d as usize)
        .collect();
    let shape = pool_shape(pool, &input);
    let dys = dy.cuda().expect("a device pooling gradient");
    let dx = match pool.kind {
        PoolKind::Max => {
            let winners = kept(&mut s, "MaxPool (winners)");
            ok(convnet::max_pool_backward(dys, &winners, shape))
        }
        PoolKind::Avg => ok(convnet::avg_pool_backward(dys, shape)),
    };
    wrap(dx, &input)
}

/// NCHW → CNHW; the batch arrives from the host (uploaded here in f32).
pub fn to_channel_major_forward(x: Tensor, dev: &Arc<CudaDevice>) -> Tensor {
    let (n, c, h, w) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
    let xs = on_device(&x, dev);
    let y = if c == 1 {
        xs
    } else {
        ok(convnet::swap_leading_axes(&xs, n, c, h * w))
    };
    wrap(y, &[c, n, h, w])
}

/// CNHW → NCHW (the input's gradient: only a caller that asks for it needs it).
pub fn to_channel_major_backward(dy: Tensor) -> Tensor {
    let (c, n, h, w) = (dy.dim(0), dy.dim(1), dy.dim(2), dy.dim(3));
    let dys = dy.cuda().expect("a device gradient");
    let dx = if c == 1 {
        dys.clone()
    } else {
        ok(convnet::swap_leading_axes(dys, c, n, h * w))
    };
    wrap(dx, &[n, c, h, w])
}

pub fn flatten_forward(f: &Flatten, x: Tensor, mode: Mode, s: &mut Saved) -> Tensor {
    let (c, n, h, w) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
    if mode.train {
        s.stats.push(vec![c as f32, n as f32, h as f32, w as f32]);
    }
    let xs = x.cuda().expect("a device flatten input");
    if f.global_average {
        wrap(
            ok(convnet::global_average_forward(xs, c, n, h * w)),
            &[n, c],
        )
    } else {
        wrap(
            ok(convnet::swap_leading_axes(xs, c, n, h * w)),
            &[n, c * h * w],
        )
    }
}

pub fn flatten_backward(f: &Flatten, mut s: Saved, dy: Tensor) -> Tensor {
    let d = s.stats.pop().expect("Flatten: saved shape");
    let (c, n, h, w) = (d[0] as usize, d[1] as usize, d[2] as usize, d[3] as usize);
    let dys = dy.cuda().expect("a device flatten gradient");
    let dx = if f.global_average {
        ok(convnet::global_average_backward(dys, c, n, h * w))
    } else {
        ok(convnet::swap_leading_axes(dys, n, c, h * w))
    };
    wrap(dx, &[c, n, h, w])
}

/// ResNet's join: `relu(y + shortcut)` (the sum in f32); the output is kept for backward.
pub fn residual_join_forward(y: Tensor, shortcut: Tensor, mode: Mode, s: &mut Saved) -> Tensor {
    let shape = y.shape().to_vec();
    let ys = y.cuda().expect("a device residual branch").clone();
    let sc = on_device(&shortcut, ys.device());
    drop(y);
    let sum = ok(ops::add(ys, &sc));
    let out = wrap(ok(ops::activation_forward(&sum, ActKind::Relu)), &shape);
    if mode.train {
        s.tensors.push(out.clone());
    }
    out
}

/// The join's gradient at the sum: `dy` where the output is positive.
pub fn residual_join_backward(out: &Tensor, dy: Tensor) -> Tensor {
    let outs = out.cuda().expect("a device residual output");
    let dys = on_device(&dy, outs.device());
    wrap(
        ok(ops::activation_backward(outs, &dys, ActKind::Relu)),
        out.shape(),
    )
}

/// `a + b` (the residual block's two input gradients), in f32.
pub fn add(a: Tensor, b: &Tensor) -> Tensor {
    let shape = a.shape().to_vec();
    let av = a.cuda().expect("a device gradient").clone();
    drop(a);
    let bv = on_device(b, av.device());
    wrap(ok(ops::add(av, &bv)), &shape)
}
