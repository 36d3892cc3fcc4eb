//! Finite-difference gradient checks for every layer.
//!
//! For a layer `y = f(x; p)` and a fixed random `r` shaped like `y`, the scalar
//! `L = Σ y·r` has `∂L/∂p = backward(dy = r)` and `∂L/∂x = the returned dx`. Every parameter
//! and every input element is perturbed by ±h and the central difference
//! `(L(+h) − L(−h)) / (actual step)` is compared with the analytic value.
//!
//! Tolerance: every element must be within `2e-3·max|grad| + noise` of the central
//! difference, and the error norm within `2e-3·‖grad‖ + noise·√n`, where `noise` bounds the
//! difference's f32 rounding noise, `2⁻²³·Σ|y·r| / h` (each output carries ~2⁻²⁴ relative
//! error; `L` itself is summed in f64). Why that much: at h = 1e-2 the central difference's
//! truncation error `h²·L‴/6` is ~1e-5..1e-4 relative for the curved layers (norms, softmax,
//! GELU); the worst measured error is 1.6e-4 of max |grad| (GPT block), every case prints
//! its own. Why not more: real backward bugs (a wrong index, a missing term, a transposed
//! weight) give errors of order 1.
//!
//! Non-smooth points are kept out of the data: ReLU inputs stay ≥ 0.1 from zero and max-pool
//! inputs are distinct values spaced far wider than 2h, so no step changes a winner.

mod common;

use common::{away_from_zero, distinct_values, normal_vec};
use meshtrain_nn::layers::ToChannelMajor;
use meshtrain_nn::layers::{
    Act, BatchNorm2d, Conv2d, Flatten, LayerNorm, Linear, Pool2d, RmsNorm, Seq, SwiGlu,
};
use meshtrain_nn::models::resnet::Residual;
use meshtrain_nn::transformer::{
    causal_self_attention, AttentionKind, GptBlock, GptEmbedding, LlamaBlockShape, Rotary,
    SequenceShard, TransformerBlock,
};
use meshtrain_nn::{Init, Layer, Mode, ParamSpec, Saved, Stream};
use meshtrain_tensor::activation::Activation;
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;

/// Worst element error allowed, as a fraction of the tensor's largest analytic gradient
/// (see the module docs for why).
const TOLERANCE: f64 = 2e-3;
/// Default finite-difference step.
const STEP: f32 = 1e-2;

/// Parameters for `specs`: drawn from each spec's own initialiser, except that parameters
/// initialised to constants (norm weights = 1, biases = 0) get random values around those
/// constants, so a swapped or ignored affine parameter shows in the gradients.
fn random_params(specs: &[ParamSpec], rng: &mut SplitMix64) -> Vec<f32> {
    let mut out = Vec::new();
    for spec in specs {
        let mut v = vec![0.0f32; spec.len()];
        match spec.init {
            Init::Ones => v.iter_mut().for_each(|x| *x = 1.0 + 0.2 * rng.normal()),
            Init::Zeros => v.iter_mut().for_each(|x| *x = 0.2 * rng.normal()),
            init => init.fill(&mut v, rng),
        }
        out.extend(v);
    }
    out
}

/// `L = Σ y·r` in f64 after a train-mode forward (buffers are copied: a BatchNorm forward
/// updates its running statistics, which must not drift between evaluations).
fn loss(layer: &dyn Layer, params: &[f32], buffers: &[f32], x: &Tensor, r: &[f32]) -> f64 {
    let mut b = buffers.to_vec();
    let y = layer.forward(
        params.into(),
        (&mut b).into(),
        x.clone(),
        Mode::TRAIN,
        &mut Saved::default(),
    );
    assert_eq!(y.numel(), r.len(), "output size changed between calls");
    y.data()
        .iter()
        .zip(r)
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum()
}

/// Differences of `L` in coordinate `i` of `values` with step `h`: [central, forward,
/// backward], `base` being `L` at the unperturbed point. Where `L` is smooth the one-sided
/// differences agree to `O(h·L″)`; where a kink (a ReLU input crossing zero) lies within the
/// step they differ by the jump in slope, which is how [`compare`] recognises kinks.
fn differences(
    values: &mut [f32],
    i: usize,
    h: f32,
    base: f64,
    eval: &mut dyn FnMut(&[f32]) -> f64,
) -> [f64; 3] {
    let orig = values[i];
    let (plus, minus) = (orig + h, orig - h);
    values[i] = plus;
    let lp = eval(values);
    values[i] = minus;
    let lm = eval(values);
    values[i] = orig;
    [
        (lp - lm) / (plus as f64 - minus as f64),
        (lp - base) / (plus as f64 - orig as f64),
        (base - lm) / (orig as f64 - minus as f64),
    ]
}

/// Compares one gradient tensor; returns (worst error relative to its largest entry, number
/// of coordinates non-smooth (bracket-checked only)). `noise` is the finite-difference noise floor at the full
/// step (see [`noise_floor`]), added to the allowance so that gradients that are exactly zero
/// in exact arithmetic (a conv bias feeding a batch norm) are not judged on rounding noise.
/// When `kinks_allowed` (layers with ReLUs on internal values), a coordinate whose one-sided
/// differences disagree by more than the allowance is treated as a kink: the analytic value
/// must then lie between the two one-sided differences, and the coordinate is counted.
fn compare(
    case: &str,
    what: &str,
    analytic: &[f32],
    numeric: &[[f64; 3]],
    noise: f64,
    kinks_allowed: bool,
) -> (f64, usize) {
    let scale = analytic.iter().fold(0.0f64, |m, &v| m.max(v.abs() as f64));
    let allowance = TOLERANCE * scale + noise;
    let (mut worst, mut at, mut sq_err, mut sq, mut kinks) = (0.0f64, 0, 0.0f64, 0.0f64, 0);
    for (i, (&a, &[full, forward, backward])) in analytic.iter().zip(numeric).enumerate() {
        // One-sided differences carry twice the rounding noise of the central one.
        if kinks_allowed && (forward - backward).abs() > allowance + 2.0 * noise {
            // Near a kink (or where L is strongly curved) the true derivative still lies
            // between the one-sided slopes; a wrong backward generally does not.
            let (lo, hi) = (forward.min(backward), forward.max(backward));
            let a = a as f64;
            assert!(
                a >= lo - allowance - 2.0 * noise && a <= hi + allowance + 2.0 * noise,
                "{case}: {what}[{i}]: analytic {a} outside the one-sided differences \
                 [{lo}, {hi}]"
            );
            kinks += 1;
            continue;
        }
        let e = (a as f64 - full).abs();
        sq_err += e * e;
        sq += full * full;
        if e > worst {
            worst = e;
            at = i;
        }
    }
    let n = analytic.len() as f64;
    let elem_ok = worst <= allowance;
    let norm_ok = sq_err.sqrt() <= TOLERANCE * sq.sqrt() + noise * n.sqrt();
    assert!(
        elem_ok && norm_ok,
        "{case}: {what} gradient wrong: element {at} analytic {} vs finite difference {} \
         (worst error {worst:.3e}, max |grad| {scale:.3e}, noise floor {noise:.1e}; \
         norm-wise {:.2e})",
        analytic[at],
        numeric[at][0],
        (sq_err / sq.max(1e-300)).sqrt()
    );
    (worst / scale.max(noise), kinks)
}

/// Bound on the rounding noise of one central difference: each f32 output carries a relative
/// error of order 2⁻²⁴, so `L = Σ y·r` is uncertain by about `2⁻²⁴·Σ|y·r|`; the difference of
/// two such values divided by `2h` gives `2⁻²⁴·Σ|y·r| / h`; we allow twice that (ε = 2⁻²³).
fn noise_floor(y: &[f32], r: &[f32], step: f32) -> f64 {
    let sum_abs: f64 = y
        .iter()
        .zip(r)
        .map(|(&a, &b)| (a as f64 * b as f64).abs())
        .sum();
    f32::EPSILON as f64 * sum_abs / step as f64
}

/// One gradient-check case.
struct Check<'a> {
    name: &'a str,
    layer: &'a dyn Layer,
    input: Tensor,
    params: Vec<f32>,
    buffers: Vec<f32>,
    /// False for integer inputs (token ids), whose layers return no input gradient.
    check_input: bool,
    step: f32,
    /// Largest fraction of coordinates that may be skipped as kinks (layers with ReLUs on
    /// internal values the test cannot keep away from zero); 0 elsewhere.
    max_kink_fraction: f64,
}

impl<'a> Check<'a> {
    /// A case with random parameters (see [`random_params`]) and initial buffers.
    fn new(name: &'a str, layer: &'a dyn Layer, input: Tensor, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let params = random_params(&layer.params(), &mut rng);
        let mut buffers = Vec::new();
        for spec in layer.buffers() {
            let mut b = vec![0.0; spec.len()];
            spec.init.fill(&mut b, &mut rng);
            buffers.extend(b);
        }
        Check {
            name,
            layer,
            input,
            params,
            buffers,
            check_input: true,
            step: STEP,
            max_kink_fraction: 0.0,
        }
    }

    fn params_only(mut self) -> Self {
        self.check_input = false;
        self
    }

    fn run(self) {
        let Check {
            name,
            layer,
            input,
            mut params,
            buffers,
            check_input,
            step,
            max_kink_fraction,
        } = self;
        let kinks_allowed = max_kink_fraction > 0.0;
        let (mut kinks, mut checked) = (0usize, 0usize);
        // Analytic gradients.
        let mut saved = Saved::default();
        let mut b = buffers.clone();
        let y = layer.forward(
            (&params).into(),
            (&mut b).into(),
            input.clone(),
            Mode::TRAIN,
            &mut saved,
        );
        let r = normal_vec(&mut SplitMix64::new(0x5eed), y.numel(), 1.0);
        let base = loss(layer, &params, &buffers, &input, &r);
        let noise = noise_floor(y.data(), &r, step);
        let mut grads = vec![0.0f32; params.len()];
        let dx = layer.backward(
            (&params).into(),
            (&mut grads).into(),
            saved,
            Tensor::from_vec(r.clone(), y.shape()),
            true,
        );
        let mut worst = 0.0f64;

        // Parameters, one named tensor at a time.
        let mut offset = 0;
        for spec in layer.params() {
            let range = offset..offset + spec.len();
            offset = range.end;
            let numeric: Vec<[f64; 3]> = range
                .clone()
                .map(|i| {
                    differences(&mut params, i, step, base, &mut |p| {
                        loss(layer, p, &buffers, &input, &r)
                    })
                })
                .collect();
            let (w, k) = compare(
                name,
                &spec.name,
                &grads[range],
                &numeric,
                noise,
                kinks_allowed,
            );
            worst = worst.max(w);
            kinks += k;
            checked += numeric.len();
        }

        // The input.
        if check_input {
            let dx = dx.unwrap_or_else(|| panic!("{name}: no input gradient returned"));
            assert_eq!(dx.shape(), input.shape(), "{name}: input gradient shape");
            let shape = input.shape().to_vec();
            let mut xs = input.into_vec();
            let numeric: Vec<[f64; 3]> = (0..xs.len())
                .map(|i| {
                    differences(&mut xs, i, step, base, &mut |x| {
                        let x = Tensor::from_vec(x.to_vec(), &shape);
                        loss(layer, &params, &buffers, &x, &r)
                    })
                })
                .collect();
            let (w, k) = compare(name, "input", dx.data(), &numeric, noise, kinks_allowed);
            worst = worst.max(w);
            kinks += k;
            checked += numeric.len();
        }
        assert!(
            kinks as f64 <= max_kink_fraction * checked as f64,
            "{name}: {kinks} of {checked} coordinates look non-smooth, more than the {:.1} % allowed",
            100.0 * max_kink_fraction
        );
        println!(
            "{name}: worst error {worst:.2e} of max(|grad|, noise floor {noise:.1e}); \
             {kinks} of {checked} coordinates non-smooth (bracket-checked only)"
        );
    }
}

fn tensor(values: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(values, shape)
}

fn normal(seed: u64, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    tensor(normal_vec(&mut SplitMix64::new(seed), n, 1.0), shape)
}

#[test]
fn linear_2d_and_3d_input() {
    let l = Linear::new(5, 3, true);
    Check::new("linear 2-D", &l, normal(1, &[4, 5]), 11).run();
    let l = Linear::new(5, 6, true);
    Check::new("linear 3-D", &l, normal(2, &[2, 3, 5]), 12).run();
    let l = Linear::new(4, 3, false);
    Check::new("linear without bias", &l, normal(3, &[3, 4]), 13).run();
    let l = Linear::new(5, 6, true).with_activation(Activation::Gelu);
    Check::new("linear + fused GELU", &l, normal(4, &[2, 3, 5]), 14).run();
    let l = Linear::new(4, 3, false).with_activation(Activation::Tanh);
    Check::new(
        "linear without bias + fused tanh",
        &l,
        normal(5, &[3, 4]),
        15,
    )
    .run();
}

/// Convolutions on CNHW input `[C, N, H, W]`, covering every code path of the kernel:
/// padded im2col, strided windows, the 1×1 strided case and the pointwise (no im2col) path.
#[test]
fn conv2d_geometries() {
    // (in, out, kernel, stride, padding, input size)
    let cases = [
        ("conv k5 s1 p2", 3, 4, 5, 1, 2, 8),
        ("conv k3 s2 p1", 3, 4, 3, 2, 1, 7),
        ("conv k1 s2 p0", 3, 4, 1, 2, 0, 7),
        ("conv k1 s1 p0 (pointwise)", 3, 4, 1, 1, 0, 5),
        ("conv k7 s2 p3", 1, 4, 7, 2, 3, 12),
    ];
    for (i, &(name, cin, cout, k, s, p, hw)) in cases.iter().enumerate() {
        let conv = Conv2d::new(cin, cout, k, s, p);
        Check::new(
            name,
            &conv,
            normal(20 + i as u64, &[cin, 2, hw, hw]),
            30 + i as u64,
        )
        .run();
    }
    // Non-square input: a height/width mix-up cannot hide.
    let conv = Conv2d::new(2, 3, 3, 2, 1);
    Check::new(
        "conv k3 s2 p1 on 7x10",
        &conv,
        normal(42, &[2, 2, 7, 10]),
        43,
    )
    .run();
    let conv = Conv2d::new(2, 3, 5, 1, 2);
    Check::new("conv k5 s1 p2 on 6x4", &conv, normal(44, &[2, 2, 6, 4]), 45).run();
    let mut no_bias = Conv2d::new(2, 3, 3, 1, 1);
    no_bias.bias = false;
    Check::new("conv without bias", &no_bias, normal(40, &[2, 2, 5, 5]), 41).run();
}

#[test]
fn batch_norm_train_mode() {
    let bn = BatchNorm2d::new(3);
    let x = normal_vec(&mut SplitMix64::new(50), 3 * 4 * 5 * 5, 1.5);
    let x = x.into_iter().map(|v| v + 0.3).collect();
    Check::new("batchnorm train", &bn, tensor(x, &[3, 4, 5, 5]), 51).run();
}

/// Running statistics follow PyTorch: `running = 0.9·running + 0.1·batch`, with the biased
/// batch variance used to normalise but the unbiased one stored (checked against an
/// independent f64 computation); recomputation and eval leave them alone.
#[test]
fn batch_norm_running_statistics() {
    let (c, n, hw) = (3, 4, 9);
    let bn = BatchNorm2d::new(c);
    let mut rng = SplitMix64::new(52);
    let x: Vec<f32> = normal_vec(&mut rng, c * n * hw, 2.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v + (i / (n * hw)) as f32)
        .collect();
    let params = random_params(&bn.params(), &mut rng);
    let start = [vec![0.5f32, -0.2, 0.1], vec![0.7f32, 1.3, 2.0]].concat();
    let mut buffers = start.clone();
    let xt = tensor(x.clone(), &[c, n, 3, 3]);
    bn.forward(
        (&params).into(),
        (&mut buffers).into(),
        xt.clone(),
        Mode::TRAIN,
        &mut Saved::default(),
    );
    let m = (n * hw) as f64;
    for ch in 0..c {
        let v = &x[ch * n * hw..][..n * hw];
        let mean = v.iter().map(|&a| a as f64).sum::<f64>() / m;
        let unbiased = v.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / (m - 1.0);
        let want_mean = 0.9 * start[ch] as f64 + 0.1 * mean;
        let want_var = 0.9 * start[c + ch] as f64 + 0.1 * unbiased;
        assert!(
            (buffers[ch] as f64 - want_mean).abs() < 1e-6 * (1.0 + want_mean.abs()),
            "running_mean[{ch}] {} vs {want_mean}",
            buffers[ch]
        );
        assert!(
            (buffers[c + ch] as f64 - want_var).abs() < 1e-5 * (1.0 + want_var.abs()),
            "running_var[{ch}] {} vs {want_var}",
            buffers[c + ch]
        );
    }
    let after_train = buffers.clone();
    bn.forward(
        (&params).into(),
        (&mut buffers).into(),
        xt.clone(),
        Mode::RECOMPUTE,
        &mut Saved::default(),
    );
    assert_eq!(
        buffers, after_train,
        "recomputation must not update running stats"
    );
    bn.forward(
        (&params).into(),
        (&mut buffers).into(),
        xt,
        Mode::EVAL,
        &mut Saved::default(),
    );
    assert_eq!(buffers, after_train, "eval must not update running stats");
}

#[test]
fn layer_norm() {
    let ln = LayerNorm::new(8);
    Check::new("layernorm", &ln, normal(60, &[2, 4, 8]), 61).run();
}

#[test]
fn pooling() {
    let mut rng = SplitMix64::new(70);
    // Gap 0.05 between any two inputs, step 1e-2: no step changes a max-pool winner.
    let x = tensor(
        distinct_values(&mut rng, 3 * 2 * 7 * 7, 0.05),
        &[3, 2, 7, 7],
    );
    Check::new("maxpool k3 s2 p1", &Pool2d::max(3, 2, 1), x, 71).run();
    let x = tensor(
        distinct_values(&mut rng, 3 * 2 * 8 * 8, 0.05),
        &[3, 2, 8, 8],
    );
    Check::new("maxpool k2 s2", &Pool2d::max(2, 2, 0), x, 72).run();
    Check::new(
        "avgpool k2 s2",
        &Pool2d::avg(2, 2),
        normal(73, &[3, 2, 8, 8]),
        74,
    )
    .run();
    Check::new(
        "avgpool k3 s1",
        &Pool2d::avg(3, 1),
        normal(75, &[2, 2, 5, 6]),
        76,
    )
    .run();
}

#[test]
fn flatten_and_layout_changes() {
    let plain = Flatten {
        global_average: false,
    };
    Check::new("flatten", &plain, normal(80, &[3, 2, 4, 4]), 81).run();
    let gap = Flatten {
        global_average: true,
    };
    Check::new("global average", &gap, normal(82, &[3, 2, 5, 5]), 83).run();
    Check::new(
        "to channel-major",
        &ToChannelMajor,
        normal(84, &[2, 3, 4, 5]),
        85,
    )
    .run();
}

#[test]
fn activations() {
    let mut rng = SplitMix64::new(90);
    let relu_in = tensor(away_from_zero(&mut rng, 42, 0.1), &[6, 7]);
    Check::new("relu", &Act(Activation::Relu), relu_in, 91).run();
    for (i, (name, act)) in [
        ("sigmoid", Activation::Sigmoid),
        ("tanh", Activation::Tanh),
        ("gelu", Activation::Gelu),
        ("gelu (tanh)", Activation::GeluTanh),
    ]
    .into_iter()
    .enumerate()
    {
        let x = tensor(normal_vec(&mut rng, 42, 2.0), &[6, 7]);
        Check::new(name, &Act(act), x, 92 + i as u64).run();
    }
}

#[test]
fn gpt_embedding_param_grads() {
    let emb = GptEmbedding {
        vocab: 11,
        max_seq: 6,
        dim: 4,
        init_std: 0.5,
        learned_positions: true,
        sequence: Default::default(),
    };
    // Id 3 appears three times: its gradient row must accumulate.
    let ids = vec![3.0, 0.0, 10.0, 3.0, 7.0, 3.0, 1.0, 2.0, 5.0, 9.0];
    Check::new("gpt embedding", &emb, tensor(ids, &[2, 5]), 100)
        .params_only()
        .run();
}

#[test]
fn causal_self_attention_layer() {
    let attn = causal_self_attention(16, 4, None);
    Check::new(
        "causal self-attention",
        &attn,
        normal(110, &[2, 6, 16]),
        111,
    )
    .run();
}

#[test]
fn gpt_block() {
    let block = GptBlock::new(16, 4, None);
    Check::new("gpt block", &block, normal(120, &[2, 5, 16]), 121).run();
}

/// A linear layer that offers its activation to the next layer on the host too
/// (`Layer::output_activation`; a `Linear` offers it on a GPU only), counting the offers.
struct Offering {
    inner: Linear,
    offers: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Layer for Offering {
    fn params(&self) -> Vec<ParamSpec> {
        self.inner.params()
    }
    fn forward(
        &self,
        p: meshtrain_nn::Params<'_>,
        b: meshtrain_nn::ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        self.inner.forward(p, b, x, mode, s)
    }
    fn backward(
        &self,
        p: meshtrain_nn::Params<'_>,
        g: meshtrain_nn::ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        self.inner.backward(p, g, s, dy, need_dx)
    }
    fn output_activation(&self, s: &Saved) -> Option<meshtrain_nn::OutputActivation> {
        self.offers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(meshtrain_nn::OutputActivation {
            kind: self.inner.activation.expect("an activation"),
            input: s.tensors.last().expect("the kept pre-activation").clone(),
        })
    }
    fn backward_from_pre_activation(
        &self,
        p: meshtrain_nn::Params<'_>,
        g: meshtrain_nn::ParamsMut<'_>,
        s: Saved,
        dz: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        self.inner
            .backward_from_pre_activation(p, g, s, dz, need_dx)
    }
}

/// A block whose fc1 offers its activation to fc2 (the GPU's path: fc2's input-gradient
/// product takes the GELU's gradient, fc1's backward starts from its pre-activation's
/// gradient), run here on the host through the same block code: its gradients are the
/// block's. Tanh's backward reads the activation's output, GELU's its input.
#[test]
fn gpt_block_with_the_activation_taken_by_the_next_layer() {
    for activation in [Activation::GeluTanh, Activation::Tanh] {
        let mut block = TransformerBlock::gpt(16, 4, None, AttentionKind::Flash, activation);
        let parts = block.children_mut().expect("a block has children");
        let fc1 = parts
            .layers_mut()
            .iter_mut()
            .find(|(name, _)| name == "fc1")
            .expect("fc1");
        let mut inner = Linear::new(16, 64, true);
        inner.activation = Some(activation);
        let offers = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        fc1.1 = Box::new(Offering {
            inner,
            offers: offers.clone(),
        });
        parts.relayout();
        let name = format!("gpt block, {activation:?} taken by fc2");
        Check::new(&name, &block, normal(122, &[2, 5, 16]), 123).run();
        assert!(
            offers.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "{name}: the block never asked fc1 for its activation"
        );
    }
}

/// A `Seq` takes the offer as the block does (`Children::backward_chain`): an MLP of two
/// linear layers whose first offers its activation (on the host here), then a third layer
/// with an activation that is not offered, has the gradients of finite differences, and the
/// offer was taken.
#[test]
fn seq_with_the_activation_taken_by_the_next_layer() {
    for activation in [Activation::GeluTanh, Activation::Tanh] {
        let mut inner = Linear::new(12, 20, true);
        inner.activation = Some(activation);
        let offers = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut last = Linear::new(8, 6, true);
        last.activation = Some(Activation::Tanh);
        let seq = Seq::new(vec![
            (
                "fc1",
                Box::new(Offering {
                    inner,
                    offers: offers.clone(),
                }) as Box<dyn Layer>,
            ),
            ("fc2", Box::new(Linear::new(20, 8, true))),
            ("fc3", Box::new(last)),
        ]);
        let name = format!("seq, {activation:?} taken by fc2");
        Check::new(&name, &seq, normal(124, &[3, 12]), 125).run();
        assert!(
            offers.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "{name}: the Seq never asked fc1 for its activation"
        );
    }
}

/// A block leaving its last residual add to the layer after it (`Layer::forward_residual`,
/// as a model runs its blocks; on a GPU the next norm does the add in its kernel) computes
/// what the layers' own forwards compute, and backward from what it saved gives the same
/// gradients, bit for bit: two GPT blocks, then a final norm and head (a `Seq`, whose norm
/// takes the add).
#[test]
fn a_residual_add_left_to_the_next_layer_changes_no_bit() {
    let mut rng = SplitMix64::new(160);
    let block = || TransformerBlock::gpt(16, 4, None, AttentionKind::Flash, Activation::GeluTanh);
    let tail = Seq::new(vec![
        ("norm", Box::new(LayerNorm::new(16)) as Box<dyn Layer>),
        ("head", Box::new(Linear::new(16, 10, false))),
    ]);
    let (first, second) = (block(), block());
    let layers: [&dyn Layer; 3] = [&first, &second, &tail];
    let params: Vec<Vec<f32>> = layers
        .iter()
        .map(|l| random_params(&l.params(), &mut rng))
        .collect();
    let x = normal(161, &[2, 5, 16]);

    let mut own = Vec::new();
    let mut y = x.clone();
    for (layer, p) in layers.iter().zip(&params) {
        let mut s = Saved::default();
        y = layer.forward(
            p.as_slice().into(),
            (&mut Vec::new()).into(),
            y,
            Mode::TRAIN,
            &mut s,
        );
        own.push(s);
    }
    let mut left = Vec::new();
    let mut stream = Stream::Ready(x);
    for (i, (layer, p)) in layers.iter().zip(&params).enumerate() {
        let mut s = Saved::default();
        let leave_add = i + 1 < layers.len();
        stream = layer.forward_residual(
            p.as_slice().into(),
            (&mut Vec::new()).into(),
            stream,
            leave_add,
            Mode::TRAIN,
            &mut s,
        );
        assert_eq!(
            matches!(stream, Stream::Pending { .. }),
            leave_add,
            "layer {i}: an add left undone exactly where asked"
        );
        left.push(s);
    }
    let y_left = stream.resolve();
    assert_eq!(y.data(), y_left.data(), "the output");

    let dy = normal(162, y.shape());
    let backward = |saved: Vec<Saved>| {
        let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        let mut g = dy.clone();
        for ((layer, p), (s, gr)) in layers
            .iter()
            .zip(&params)
            .zip(saved.into_iter().zip(grads.iter_mut()))
            .rev()
        {
            g = layer
                .backward(p.as_slice().into(), gr.into(), s, g, true)
                .expect("an input gradient");
        }
        (g.data().to_vec(), grads)
    };
    let (dx_own, grads_own) = backward(own);
    let (dx_left, grads_left) = backward(left);
    assert_eq!(dx_own, dx_left, "the input gradient");
    assert_eq!(grads_own, grads_left, "the parameter gradients");
}

/// D2L residual blocks (conv–BN–ReLU–conv–BN + shortcut, ReLU), train-mode batch norm.
/// Their ReLUs act on internal values the test cannot keep off zero, and a perturbed conv
/// weight moves a whole channel through batch norm, so some steps cross a kink (measured at
/// h = 1e-2: conv1.weight off by 7 %; at h = 1e-3 one weight still sits 2e-4 from a kink,
/// with one-sided slopes −1.6 and −5.02 around the analytic −5.013). The step is therefore
/// 1e-3, and coordinates whose one-sided differences disagree are only required to have the
/// analytic value between them (at most 10 % of coordinates; the count is printed).
#[test]
fn residual_blocks() {
    let same = Residual::new(4, 4, 1);
    let x = normal(130, &[4, 2, 6, 6]);
    let mut c = Check::new("residual (identity shortcut)", &same, x, 131);
    c.step = 1e-3;
    c.max_kink_fraction = 0.1;
    c.run();
    let proj = Residual::new(3, 6, 2);
    let x = normal(132, &[3, 2, 7, 7]);
    let mut c = Check::new("residual (1x1 projection)", &proj, x, 133);
    c.step = 1e-3;
    c.max_kink_fraction = 0.1;
    c.run();
}

#[test]
fn llama_layers() {
    Check::new(
        "rms norm",
        &RmsNorm::new(7, 1e-5),
        normal(140, &[3, 4, 7]),
        141,
    )
    .run();
    Check::new("swiglu", &SwiGlu, normal(142, &[3, 4, 10]), 143).run();
    // 6 query heads sharing 2 key/value heads of width 4, positions of the second of two
    // context-parallel workers (non-contiguous: chunks 1 and 2 of 4).
    let rotary = Rotary {
        heads: 6,
        kv_heads: 2,
        head_dim: 4,
        rope: meshtrain_tensor::rotary::Rope::new(100.0),
        sequence: SequenceShard { parts: 2, index: 1 },
    };
    Check::new("rotary + GQA", &rotary, normal(144, &[2, 4, 40]), 145).run();
}

#[test]
fn llama_block() {
    let shape = LlamaBlockShape {
        dim: 16,
        heads: 4,
        kv_heads: 2,
        ffn: 24,
        rope: meshtrain_tensor::rotary::Rope::new(10_000.0),
        norm_eps: 1e-5,
        qkv_bias: false,
        head_dim: 4,
        qk_norm: false,
        window: None,
    };
    let block = TransformerBlock::llama(shape, Init::Normal(0.3), AttentionKind::Flash);
    Check::new("llama block", &block, normal(150, &[2, 5, 16]), 151).run();
    // Qwen3's: heads wider than dim / heads (4 × 6 = 24 over a width of 16) and the q/k norms.
    let qwen3 = LlamaBlockShape {
        head_dim: 6,
        qk_norm: true,
        ..shape
    };
    let block = TransformerBlock::llama(qwen3, Init::Normal(0.3), AttentionKind::Flash);
    Check::new("qwen3 block", &block, normal(152, &[2, 5, 16]), 153).run();
    // Mistral's sliding window: each of the 5 tokens sees at most the last 2.
    let mistral = LlamaBlockShape {
        window: Some(2),
        ..shape
    };
    let block = TransformerBlock::llama(mistral, Init::Normal(0.3), AttentionKind::Flash);
    Check::new("mistral block", &block, normal(154, &[2, 5, 16]), 155).run();
}
