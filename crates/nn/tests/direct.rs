//! Forward passes of the spatial layers against their definitions, written as plain loops, on
//! non-square inputs and odd geometries that the PyTorch reference files (square inputs) do
//! not cover. With the gradient checks (which prove backward consistent with forward) this
//! pins down the whole layer for any shape.

mod common;

use common::{assert_close, normal_vec};
use meshtrain_nn::layers::{Act, Children, Conv2d, Linear, Pool2d, Seq};
use meshtrain_nn::{Layer, Mode, ParamsMut, Saved};
use meshtrain_tensor::activation::Activation;
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;

/// Element `[c, n, y, x]` of a CNHW buffer, or `None` outside the plane (padding).
fn at(x: &[f32], dims: [usize; 4], c: usize, n: usize, y: isize, xx: isize) -> Option<f32> {
    let [_, nn, h, w] = dims;
    if y < 0 || xx < 0 || y >= h as isize || xx >= w as isize {
        return None;
    }
    Some(x[((c * nn + n) * h + y as usize) * w + xx as usize])
}

/// Output size of a window sweep (PyTorch's floor mode).
fn out_len(len: usize, k: usize, s: usize, p: usize) -> usize {
    (len + 2 * p - k) / s + 1
}

/// Cross-correlation with zero padding from its definition, CNHW in and out.
fn conv_direct(x: &[f32], dims: [usize; 4], w: &[f32], b: &[f32], geom: [usize; 4]) -> Vec<f32> {
    let [o, k, s, p] = geom;
    let [c, n, h, wd] = dims;
    let (oh, ow) = (out_len(h, k, s, p), out_len(wd, k, s, p));
    let mut y = vec![0.0f32; o * n * oh * ow];
    for oc in 0..o {
        for ni in 0..n {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = b[oc] as f64;
                    for ic in 0..c {
                        for ki in 0..k {
                            for kj in 0..k {
                                let iy = (oy * s + ki) as isize - p as isize;
                                let ix = (ox * s + kj) as isize - p as isize;
                                let v = at(x, dims, ic, ni, iy, ix).unwrap_or(0.0);
                                acc += (v * w[((oc * c + ic) * k + ki) * k + kj]) as f64;
                            }
                        }
                    }
                    y[((oc * n + ni) * oh + oy) * ow + ox] = acc as f32;
                }
            }
        }
    }
    y
}

/// Max (padding never wins) or mean pooling from the definition, CNHW in and out.
fn pool_direct(x: &[f32], dims: [usize; 4], k: usize, s: usize, p: usize, max: bool) -> Vec<f32> {
    let [c, n, h, w] = dims;
    let (oh, ow) = (out_len(h, k, s, p), out_len(w, k, s, p));
    let mut y = Vec::with_capacity(c * n * oh * ow);
    for ci in 0..c {
        for ni in 0..n {
            for oy in 0..oh {
                for ox in 0..ow {
                    let window = (0..k * k).filter_map(|i| {
                        let iy = (oy * s + i / k) as isize - p as isize;
                        let ix = (ox * s + i % k) as isize - p as isize;
                        at(x, dims, ci, ni, iy, ix)
                    });
                    y.push(if max {
                        window.fold(f32::NEG_INFINITY, f32::max)
                    } else {
                        window.sum::<f32>() / (k * k) as f32
                    });
                }
            }
        }
    }
    y
}

fn forward(layer: &dyn Layer, params: &[f32], x: &[f32], dims: [usize; 4]) -> Tensor {
    let x = Tensor::from_vec(x.to_vec(), &dims);
    layer.forward(
        params.into(),
        ParamsMut::Host(&mut []),
        x,
        Mode::EVAL,
        &mut Saved::default(),
    )
}

#[test]
fn convolution_matches_definition_on_non_square_inputs() {
    // (in, out, kernel, stride, padding, height, width)
    for (i, (c, o, k, s, p, h, w)) in [
        (2, 3, 3, 1, 1, 5, 9),
        (2, 3, 3, 2, 1, 7, 10),
        (3, 2, 5, 2, 2, 11, 6),
        (1, 4, 7, 2, 3, 12, 9),
        (3, 4, 1, 2, 0, 7, 4),
        (3, 4, 1, 1, 0, 3, 8),
        (2, 2, 2, 3, 0, 8, 11),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = SplitMix64::new(i as u64);
        let dims = [c, 2, h, w];
        let x = normal_vec(&mut rng, dims.iter().product(), 1.0);
        let weight = normal_vec(&mut rng, o * c * k * k, 0.5);
        let bias = normal_vec(&mut rng, o, 0.5);
        let conv = Conv2d::new(c, o, k, s, p);
        let y = forward(&conv, &[weight.clone(), bias.clone()].concat(), &x, dims);
        let want = conv_direct(&x, dims, &weight, &bias, [o, k, s, p]);
        assert_eq!(
            y.shape(),
            [o, 2, out_len(h, k, s, p), out_len(w, k, s, p)],
            "conv k{k} s{s} p{p} on {h}x{w}: shape"
        );
        let what = format!("conv k{k} s{s} p{p} on {h}x{w}");
        assert_close(&what, y.data(), &want, 1e-6, 0.0);
    }
}

#[test]
fn pooling_matches_definition_on_non_square_inputs() {
    for (i, (k, s, p, h, w)) in [
        (3, 2, 1, 7, 10),
        (2, 2, 0, 8, 5),
        (3, 2, 1, 6, 6),
        (3, 3, 0, 10, 7),
    ]
    .into_iter()
    .enumerate()
    {
        let dims = [3, 2, h, w];
        let x = normal_vec(&mut SplitMix64::new(100 + i as u64), 6 * h * w, 1.0);
        let y = forward(&Pool2d::max(k, s, p), &[], &x, dims);
        let what = format!("maxpool k{k} s{s} p{p} on {h}x{w}");
        assert_close(
            &what,
            y.data(),
            &pool_direct(&x, dims, k, s, p, true),
            0.0,
            0.0,
        );
        if p == 0 {
            let y = forward(&Pool2d::avg(k, s), &[], &x, dims);
            let what = format!("avgpool k{k} s{s} on {h}x{w}");
            assert_close(
                &what,
                y.data(),
                &pool_direct(&x, dims, k, s, 0, false),
                1e-6,
                0.0,
            );
        }
    }
}

/// Linear's bias is broadcast and its gradient summed in parallel row blocks on large inputs;
/// a batch of 300 rows (not a multiple of the 64-row block) × 70 outputs is large enough to
/// split. The result must match the definition and not depend on the pool size.
#[test]
fn linear_bias_forward_and_gradient_match_definition_on_any_pool() {
    let (rows, inputs, outputs) = (300, 5, 70);
    let mut rng = SplitMix64::new(7);
    let x = normal_vec(&mut rng, rows * inputs, 1.0);
    let weight = normal_vec(&mut rng, outputs * inputs, 0.5);
    let bias = normal_vec(&mut rng, outputs, 0.5);
    let dy = normal_vec(&mut rng, rows * outputs, 1.0);
    let params = [weight.clone(), bias.clone()].concat();
    let linear = Linear::new(inputs, outputs, true);
    let run = |threads: usize| {
        meshtrain_tensor::par::pool(threads).install(|| {
            let mut saved = Saved::default();
            let xt = Tensor::from_vec(x.clone(), &[rows, inputs]);
            let y = linear.forward(
                (&params).into(),
                ParamsMut::Host(&mut []),
                xt,
                Mode::TRAIN,
                &mut saved,
            );
            let mut grads = vec![0.0f32; params.len()];
            let dyt = Tensor::from_vec(dy.clone(), &[rows, outputs]);
            linear.backward((&params).into(), (&mut grads).into(), saved, dyt, false);
            (y.data().to_vec(), grads[outputs * inputs..].to_vec())
        })
    };
    let mut want_y = vec![0.0f32; rows * outputs];
    for r in 0..rows {
        for o in 0..outputs {
            let dot: f64 = (0..inputs)
                .map(|i| (x[r * inputs + i] * weight[o * inputs + i]) as f64)
                .sum();
            want_y[r * outputs + o] = (dot + bias[o] as f64) as f32;
        }
    }
    let want_gb: Vec<f32> = (0..outputs)
        .map(|o| (0..rows).map(|r| dy[r * outputs + o] as f64).sum::<f64>() as f32)
        .collect();
    let (y1, gb1) = run(1);
    let (y2, gb2) = run(2);
    assert_close("linear forward, 2 threads", &y2, &want_y, 1e-5, 1e-6);
    assert_close("linear bias grad, 2 threads", &gb2, &want_gb, 1e-6, 1e-6);
    assert_eq!(y1, y2, "linear forward depends on the pool size");
    assert_eq!(gb1, gb2, "linear bias gradient depends on the pool size");
}

/// A Linear with a fused activation must give the same output, input gradient and parameter
/// gradients, bit for bit, as the same Linear followed by a separate [`Act`] layer, on 1 and
/// 2 threads. GELU saves its input and Tanh its output, covering both backward paths; 300
/// rows is not a multiple of the 64-row sweep block.
#[test]
fn linear_with_fused_activation_equals_linear_then_act() {
    let (rows, inputs, outputs) = (300, 6, 70);
    let mut rng = SplitMix64::new(11);
    let x = normal_vec(&mut rng, rows * inputs, 1.0);
    let params = normal_vec(&mut rng, outputs * inputs + outputs, 0.5);
    let dy = normal_vec(&mut rng, rows * outputs, 1.0);
    let run = |layer: &dyn Layer, threads: usize| {
        meshtrain_tensor::par::pool(threads).install(|| {
            let mut saved = Saved::default();
            let xt = Tensor::from_vec(x.clone(), &[rows, inputs]);
            let y = layer.forward(
                (&params).into(),
                ParamsMut::Host(&mut []),
                xt,
                Mode::TRAIN,
                &mut saved,
            );
            let mut grads = vec![0.0f32; params.len()];
            let dyt = Tensor::from_vec(dy.clone(), &[rows, outputs]);
            let dx = layer.backward((&params).into(), (&mut grads).into(), saved, dyt, true);
            (
                y.data().to_vec(),
                dx.expect("input gradient").data().to_vec(),
                grads,
            )
        })
    };
    for act in [Activation::Gelu, Activation::Tanh] {
        let fused = Linear::new(inputs, outputs, true).with_activation(act);
        let separate = Seq(Children::new(vec![
            (
                "".into(),
                Box::new(Linear::new(inputs, outputs, true)) as Box<dyn Layer>,
            ),
            ("".into(), Box::new(Act(act))),
        ]));
        for threads in [1, 2] {
            let (fy, fdx, fg) = run(&fused, threads);
            let (sy, sdx, sg) = run(&separate, threads);
            assert_eq!(fy, sy, "{act:?} fused forward, {threads} threads");
            assert_eq!(fdx, sdx, "{act:?} fused input gradient, {threads} threads");
            assert_eq!(
                fg, sg,
                "{act:?} fused parameter gradients, {threads} threads"
            );
        }
    }
}

/// A Linear in FP8 (as `--precision fp8` sets it: bf16 kept inputs, FP8 products) against
/// the definition written with the CPU's FP8 rounding and f64 sums: the forward product of
/// E4M3 input and weight, the input gradient of E5M2 output gradient and E4M3 weight, and
/// the weight gradient of E5M2 output gradient and the E4M3 of the bf16-kept input, each
/// tensor at its own current scale; the bias gradient exact. The same layer in bf16 lands
/// measurably further from these values, so the test knows which path ran.
#[test]
fn linear_in_fp8_is_the_product_of_its_fp8_operands() {
    use meshtrain_tensor::fp8::{amax, current_scale, Fp8Format};
    use meshtrain_tensor::DType;
    let (rows, inputs, outputs) = (130, 48, 70);
    let mut rng = SplitMix64::new(8);
    let x = normal_vec(&mut rng, rows * inputs, 1.0);
    let weight = normal_vec(&mut rng, outputs * inputs, 0.05);
    let bias = normal_vec(&mut rng, outputs, 0.5);
    let dy = normal_vec(&mut rng, rows * outputs, 1e-3);
    let params = [weight.clone(), bias.clone()].concat();
    let run = |fp8: bool| {
        let mut linear = Linear::new(inputs, outputs, true);
        linear.set_precision(DType::BF16);
        linear.set_fp8_products(fp8);
        let mut saved = Saved::default();
        let y = linear.forward(
            (&params).into(),
            ParamsMut::Host(&mut []),
            Tensor::from_vec(x.clone(), &[rows, inputs]),
            Mode::TRAIN,
            &mut saved,
        );
        let mut grads = vec![0.0f32; params.len()];
        let dyt = Tensor::from_vec(dy.clone(), &[rows, outputs]);
        let dx = linear.backward((&params).into(), (&mut grads).into(), saved, dyt, true);
        (y.data().to_vec(), dx.unwrap().data().to_vec(), grads)
    };
    // Each tensor on its format's grid at its current scale, and that scale.
    let cast = |v: &[f32], f: Fp8Format| -> (Vec<f64>, f64) {
        let s = current_scale(f, amax(v));
        (v.iter().map(|&e| f.round(e * s) as f64).collect(), s as f64)
    };
    let mut x_bf16 = x.clone();
    meshtrain_tensor::dtype::round_through_bf16(&mut x_bf16);
    let (qx, sx) = cast(&x, Fp8Format::E4M3);
    let (qxk, sxk) = cast(&x_bf16, Fp8Format::E4M3);
    let (qw, sw) = cast(&weight, Fp8Format::E4M3);
    let (qdy, sdy) = cast(&dy, Fp8Format::E5M2);
    let mut want_y = vec![0.0f32; rows * outputs];
    let mut want_dx = vec![0.0f32; rows * inputs];
    let mut want_dw = vec![0.0f32; outputs * inputs];
    for r in 0..rows {
        for o in 0..outputs {
            let dot: f64 = (0..inputs)
                .map(|i| qx[r * inputs + i] * qw[o * inputs + i])
                .sum();
            want_y[r * outputs + o] = (dot / (sx * sw) + bias[o] as f64) as f32;
        }
        for i in 0..inputs {
            let dot: f64 = (0..outputs)
                .map(|o| qdy[r * outputs + o] * qw[o * inputs + i])
                .sum();
            want_dx[r * inputs + i] = (dot / (sdy * sw)) as f32;
        }
    }
    for o in 0..outputs {
        for i in 0..inputs {
            let dot: f64 = (0..rows)
                .map(|r| qdy[r * outputs + o] * qxk[r * inputs + i])
                .sum();
            want_dw[o * inputs + i] = (dot / (sdy * sxk)) as f32;
        }
    }
    let want_db: Vec<f32> = (0..outputs)
        .map(|o| (0..rows).map(|r| dy[r * outputs + o] as f64).sum::<f64>() as f32)
        .collect();
    let (y, dx, g) = run(true);
    let nw = outputs * inputs;
    assert_close("fp8 forward", &y, &want_y, 1e-5, 1e-6);
    assert_close("fp8 input gradient", &dx, &want_dx, 1e-5, 1e-9);
    assert_close("fp8 weight gradient", &g[..nw], &want_dw, 1e-5, 1e-9);
    assert_close("fp8 bias gradient", &g[nw..], &want_db, 1e-6, 1e-9);
    // The bf16 layer is not within these tolerances of the FP8 definition.
    let (y16, _, _) = run(false);
    let off = y16
        .iter()
        .zip(&want_y)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        off > 1e-3,
        "bf16 and fp8 forward agree to {off:e}: did fp8 run?"
    );
}
