//! The convolutional nets' device operations against their CPU twins (`conv`, `norm`,
//! `pool`, the layout changes), on fresh random inputs in every dtype.

use super::{failed, grads_of, random, result, rounded, tolerance, CheckResult, DeviceValues};
use crate::conv::{conv2d_backward, conv2d_forward, ConvGeometry, Spatial};
use crate::cuda::blas::F32Math;
use crate::cuda::context::CudaDevice;
use crate::cuda::convnet::{self, BatchNorm, ConvLayer, ConvShape, PoolShape};
use crate::cuda::error::CudaError;
use crate::cuda::ops;
use crate::cuda::CudaTensor;
use crate::pool::{self, PoolGeometry};
use crate::rng::SplitMix64;
use crate::DType;
use std::sync::Arc;

/// Every check of this file in `dtype`.
pub(super) fn run(dev: &Arc<CudaDevice>, rng: &mut SplitMix64, dtype: DType) -> Vec<CheckResult> {
    let s = ops::suffix(dtype);
    let mut out = Vec::new();
    // (in, out, kernel, stride, padding, batch, height, width) and whether the layer has a
    // bias and is asked for its input gradient: ResNet's 3×3 (plain and strided), its 1×1
    // strided shortcut and 7×7/2 stem, a pointwise layer, LeNet's two, and a network's first
    // convolution without a bias.
    let convs = [
        ((3, 8, 3, 1, 1, 4, 9, 9), true, true),
        ((8, 16, 3, 2, 1, 3, 8, 7), true, true),
        ((4, 6, 1, 2, 0, 2, 7, 7), true, true),
        ((5, 3, 1, 1, 0, 3, 4, 5), true, true),
        ((3, 8, 7, 2, 3, 2, 15, 13), true, true),
        ((1, 6, 5, 1, 2, 5, 12, 12), true, true),
        ((6, 16, 5, 1, 0, 3, 10, 10), true, true),
        ((3, 4, 3, 1, 1, 2, 5, 6), false, false),
    ];
    for ((i, o, k, st, p, n, h, w), bias, need_dx) in convs {
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
        let name = format!("conv {i}->{o} k{k}s{st}p{p} {n}x{h}x{w} {s}");
        out.extend(
            check_conv(dev, rng, shape, dtype, bias, need_dx)
                .unwrap_or_else(|e| vec![failed(name, e)]),
        );
    }
    // (channels, values per channel): a CNHW map, a [C, N] one, a channel past one part.
    for (c, plane) in [(6, 4 * 5 * 5), (10, 7), (3, 20_000)] {
        let name = format!("batch norm {c}x{plane} {s}");
        out.extend(
            check_batch_norm(dev, rng, c, plane, dtype).unwrap_or_else(|e| vec![failed(name, e)]),
        );
    }
    let pools = [(2, 2, 0, 7, 8), (3, 2, 1, 9, 7), (3, 1, 1, 5, 5)];
    for (k, st, p, h, w) in pools {
        let shape = PoolShape {
            geom: PoolGeometry {
                kernel: k,
                stride: st,
                padding: p,
            },
            planes: 6,
            height: h,
            width: w,
        };
        // Average pooling has no padding.
        for max in [true, false].into_iter().filter(|&max| max || p == 0) {
            let kind = if max { "max" } else { "avg" };
            let name = format!("{kind} pool k{k}s{st}p{p} {h}x{w} {s}");
            out.extend(
                check_pool(dev, rng, shape, max, dtype).unwrap_or_else(|e| vec![failed(name, e)]),
            );
        }
    }
    let name = format!("channel-major layouts {s}");
    out.extend(check_layouts(dev, rng, dtype).unwrap_or_else(|e| vec![failed(name, e)]));
    out
}

/// A convolution (with a bias or not; asked for its input gradient or not) against the CPU:
/// its output, its parameters' gradients and its input gradient, or that it returns none.
fn check_conv(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    shape: ConvShape,
    dtype: DType,
    bias: bool,
    need_dx: bool,
) -> Result<Vec<CheckResult>, CudaError> {
    let g = shape.geom;
    let s = ops::suffix(dtype);
    let nw = g.out_channels * g.patch_len();
    let x = rounded(&random(rng, shape.input_len(), 1.0), dtype);
    let mut p = random(rng, nw + if bias { g.out_channels } else { 0 }, 0.2);
    // The device adds the bias from its 16-bit copy; the CPU adds it in f32: round it here so
    // both add the same bias (the CPU rounds the weight itself as a product input).
    let rounded_bias = rounded(&p[nw..], dtype);
    p[nw..].copy_from_slice(&rounded_bias);
    let dy = rounded(&random(rng, shape.output_len(), 1.0), dtype);
    let g0 = random(rng, p.len(), 0.01);

    let (w, b) = p.split_at(nw);
    let b = bias.then_some(b);
    let (y, _) = conv2d_forward(&g, shape.input, &x, w, b, false, dtype);
    let mut grads = g0.clone();
    let (gw, gb) = grads.split_at_mut(nw);
    let dx = conv2d_backward(
        &g,
        shape.input,
        &x,
        None,
        w,
        &dy,
        gw,
        bias.then_some(gb),
        need_dx,
        dtype,
    );

    let layer = ConvLayer {
        shape,
        bias,
        precision: dtype,
        math: F32Math::Exact,
    };
    let params = DeviceValues::new(dev, &p, dtype)?;
    let x_dev = CudaTensor::from_host(dev, &x, dtype)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let g_dev = CudaTensor::from_host(dev, &g0, DType::F32)?;
    let y_dev = layer.forward(&x_dev, params.params())?;
    let dx_dev = layer.backward(&x_dev, &dy_dev, params.params(), grads_of(&g_dev), need_dx)?;
    let tol = tolerance(dtype);
    let name = |what: &str| {
        format!(
            "conv {}->{} k{}s{}p{}{} {what} {s}",
            g.in_channels,
            g.out_channels,
            g.kernel,
            g.stride,
            g.padding,
            if bias { "" } else { " no bias" }
        )
    };
    let mut results = vec![
        result(name("forward"), &y_dev.to_host_f32()?, &y, tol),
        result(name("parameter grads"), &g_dev.to_host_f32()?, &grads, tol),
    ];
    results.push(match (dx_dev, dx) {
        (Some(got), Some(want)) => result(name("input grad"), &got.to_host_f32()?, &want, tol),
        (got, _) => CheckResult {
            name: name("returns an input gradient only when asked"),
            rel_err: 0.0,
            tolerance: 0.0,
            passed: got.is_none() && !need_dx,
            error: None,
        },
    });
    Ok(results)
}

fn check_batch_norm(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    channels: usize,
    plane: usize,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    use crate::norm;
    let s = ops::suffix(dtype);
    let (eps, momentum) = (1e-5f32, 0.1f32);
    // Channels with their own offsets and spreads, as a convolution's output has.
    let x: Vec<f32> = (0..channels * plane)
        .map(|i| {
            let c = (i / plane) as f32;
            (rng.normal() * (0.5 + 0.3 * c) + 0.2 * c - 0.4).clamp(-8.0, 8.0)
        })
        .collect();
    let x = rounded(&x, dtype);
    let p: Vec<f32> = (0..2 * channels)
        .map(|i| {
            if i < channels {
                1.0 + 0.1 * rng.normal()
            } else {
                0.1 * rng.normal()
            }
        })
        .collect();
    let running0: Vec<f32> = (0..2 * channels)
        .map(|i| {
            if i < channels {
                0.1 * rng.normal()
            } else {
                1.0 + 0.1 * rng.normal().abs()
            }
        })
        .collect();
    let dy = rounded(&random(rng, channels * plane, 1.0), dtype);
    let g0 = random(rng, 2 * channels, 0.01);

    // The CPU layer's steps (`BatchNorm2d::forward` / `backward` without a reducer).
    let (gamma, beta) = p.split_at(channels);
    let sums = norm::channel_sums(&x, channels);
    let (mean, var) = norm::moments_from_sums(&sums, plane);
    let mut running = running0.clone();
    let unbias = plane as f32 / (plane.max(2) - 1) as f32;
    for c in 0..channels {
        running[c] = (1.0 - momentum) * running[c] + momentum * mean[c];
        running[channels + c] =
            (1.0 - momentum) * running[channels + c] + momentum * var[c] * unbias;
    }
    let (y, xhat) = norm::batch_norm_apply(&x, &mean, &var, eps, gamma, beta);
    let grad_sums = norm::batch_norm_grad_sums(&dy, &rounded(&xhat, dtype), channels);
    let mut grads = g0.clone();
    for c in 0..channels {
        grads[c] += grad_sums[c][1] as f32;
        grads[channels + c] += grad_sums[c][0] as f32;
    }
    let dx = norm::batch_norm_input_grad(
        &dy,
        &rounded(&xhat, dtype),
        &var,
        eps,
        gamma,
        &grad_sums,
        plane,
    );
    let (eval_y, _) = norm::batch_norm_apply(
        &x,
        &running[..channels],
        &running[channels..],
        eps,
        gamma,
        beta,
    );

    let bn = BatchNorm { channels, eps };
    let params = DeviceValues::new(dev, &p, DType::F32)?;
    let x_dev = CudaTensor::from_host(dev, &x, dtype)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let g_dev = CudaTensor::from_host(dev, &g0, DType::F32)?;
    let running_dev = CudaTensor::from_host(dev, &running0, DType::F32)?;
    let sums_dev = bn.sums(&x_dev)?;
    let stats = bn.moments(
        dev,
        &sums_dev,
        plane,
        Some(grads_of(&running_dev)),
        momentum,
    )?;
    let (y_dev, xhat_dev) = bn.apply(&x_dev, stats.stats.ptr(), params.params(), true)?;
    let xhat_dev = xhat_dev.expect("kept");
    let grad_sums_dev = bn.grad_sums(&dy_dev, &xhat_dev, grads_of(&g_dev))?;
    let dx_dev = bn.input_grad(&dy_dev, &xhat_dev, &stats, params.params(), &grad_sums_dev)?;
    let (eval_dev, none) = bn.apply(&x_dev, running_dev.ptr(), params.params(), false)?;
    assert!(none.is_none(), "evaluation keeps nothing");

    let mean_var: Vec<f32> = mean.iter().chain(&var).copied().collect();
    let tol = tolerance(dtype);
    let name = |what: &str| format!("batch norm {channels}x{plane} {what} {s}");
    Ok(vec![
        result(
            name("mean+var"),
            &stats.stats.to_host_f32()?,
            &mean_var,
            1e-5,
        ),
        result(
            name("running stats"),
            &running_dev.to_host_f32()?,
            &running,
            1e-5,
        ),
        result(name("forward"), &y_dev.to_host_f32()?, &y, tol),
        result(name("gamma+beta grad"), &g_dev.to_host_f32()?, &grads, tol),
        result(name("input grad"), &dx_dev.to_host_f32()?, &dx, tol),
        result(name("evaluation"), &eval_dev.to_host_f32()?, &eval_y, tol),
    ])
}

/// Max pooling (`max`) or average pooling against the CPU: output and input gradient.
fn check_pool(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    shape: PoolShape,
    max: bool,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    let s = ops::suffix(dtype);
    let PoolShape {
        geom,
        planes,
        height,
        width,
    } = shape;
    let x = rounded(&random(rng, planes * height * width, 1.0), dtype);
    let dy = rounded(&random(rng, shape.output_len(), 1.0), dtype);
    let x_dev = CudaTensor::from_host(dev, &x, dtype)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let (y, dx, y_dev, dx_dev) = if max {
        let (y, arg) = pool::max_pool_forward(&geom, planes, height, width, &x);
        let (oh, ow) = geom.output_size(height, width);
        let dx = pool::max_pool_backward(height, width, oh * ow, &arg, &dy);
        let (y_dev, winners) = convnet::max_pool_forward(&x_dev, shape, true)?;
        let dx_dev = convnet::max_pool_backward(&dy_dev, &winners.expect("kept"), shape)?;
        (y, dx, y_dev, dx_dev)
    } else {
        let y = pool::avg_pool_forward(&geom, planes, height, width, &x);
        let dx = pool::avg_pool_backward(&geom, height, width, &dy);
        let y_dev = convnet::avg_pool_forward(&x_dev, shape)?;
        let dx_dev = convnet::avg_pool_backward(&dy_dev, shape)?;
        (y, dx, y_dev, dx_dev)
    };
    let tol = tolerance(dtype);
    let name = |what: &str| {
        format!(
            "{} pool k{}s{}p{} {what} {s}",
            if max { "max" } else { "avg" },
            geom.kernel,
            geom.stride,
            geom.padding
        )
    };
    // The device writes the input gradient in dy's dtype: compare it rounded alike.
    Ok(vec![
        result(name("forward"), &y_dev.to_host_f32()?, &y, tol),
        result(
            name("backward"),
            &dx_dev.to_host_f32()?,
            &rounded(&dx, dtype),
            tol,
        ),
    ])
}

/// NCHW ↔ CNHW, flatten and global average pooling.
fn check_layouts(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    dtype: DType,
) -> Result<Vec<CheckResult>, CudaError> {
    let s = ops::suffix(dtype);
    let (c, n, hw) = (5, 3, 7);
    let x = rounded(&random(rng, c * n * hw, 1.0), dtype);
    let swapped = crate::tensor::swap_leading_axes(&x, c, n, hw);
    let x_dev = CudaTensor::from_host(dev, &x, dtype)?;
    let swapped_dev = convnet::swap_leading_axes(&x_dev, c, n, hw)?;
    let inv = 1.0 / hw as f32;
    let avg: Vec<f32> = (0..n * c)
        .map(|i| {
            let (ni, ci) = (i / c, i % c);
            x[(ci * n + ni) * hw..][..hw].iter().sum::<f32>() * inv
        })
        .collect();
    let dy = rounded(&random(rng, n * c, 1.0), dtype);
    let davg: Vec<f32> = (0..c * n * hw)
        .map(|i| {
            let (ci, ni) = (i / hw / n, i / hw % n);
            dy[ni * c + ci] * inv
        })
        .collect();
    let avg_dev = convnet::global_average_forward(&x_dev, c, n, hw)?;
    let dy_dev = CudaTensor::from_host(dev, &dy, dtype)?;
    let davg_dev = convnet::global_average_backward(&dy_dev, c, n, hw)?;
    let tol = tolerance(dtype);
    Ok(vec![
        result(
            format!("swap leading axes {s}"),
            &swapped_dev.to_host_f32()?,
            &swapped,
            0.0,
        ),
        result(
            format!("global average forward {s}"),
            &avg_dev.to_host_f32()?,
            &rounded(&avg, dtype),
            tol,
        ),
        result(
            format!("global average backward {s}"),
            &davg_dev.to_host_f32()?,
            &rounded(&davg, dtype),
            tol,
        ),
    ])
}
