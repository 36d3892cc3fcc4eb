//! The kernels' multi-threaded paths against their single-threaded ones.
//!
//! The gradient checks and PyTorch comparisons use small tensors, which the kernels process
//! on one thread (they only split work above ~16k elements or 2¹⁸ multiply-adds). Here every
//! layer runs on inputs above those thresholds, forward and backward, inside a 1-thread and a
//! 3-thread rayon pool, and the results must agree bit for bit: the serial paths are proven
//! correct elsewhere, and every kernel splits work so that each output element is computed by
//! the same sequence of operations whatever the pool size.

mod common;

use common::normal_vec;
use meshtrain_nn::layers::{Act, BatchNorm2d, Conv2d, Flatten, LayerNorm, Linear, Pool2d};
use meshtrain_nn::models::resnet::Residual;
use meshtrain_nn::models::{gpt, GptConfig};
use meshtrain_nn::transformer::GptBlock;
use meshtrain_nn::{Layer, Mode, Saved};
use meshtrain_tensor::activation::Activation;
use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::par;
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;

/// Output, input gradient, parameter gradients and buffers after one train step.
type StepResult = (Tensor, Option<Tensor>, Vec<f32>, Vec<f32>);

fn layer_step(layer: &dyn Layer, x: &Tensor, seed: u64, threads: usize) -> StepResult {
    let mut rng = SplitMix64::new(seed);
    let mut params = Vec::new();
    for spec in layer.params() {
        let mut v = vec![0.0; spec.len()];
        spec.init.fill(&mut v, &mut rng);
        params.extend(v);
    }
    let mut buffers = Vec::new();
    for spec in layer.buffers() {
        let mut v = vec![0.0; spec.len()];
        spec.init.fill(&mut v, &mut rng);
        buffers.extend(v);
    }
    par::pool(threads).install(|| {
        let mut saved = Saved::default();
        let y = layer.forward(
            (&params).into(),
            (&mut buffers).into(),
            x.clone(),
            Mode::TRAIN,
            &mut saved,
        );
        let r = normal_vec(&mut SplitMix64::new(seed ^ 1), y.numel(), 1.0);
        let mut grads = vec![0.0; params.len()];
        let dy = Tensor::from_vec(r, y.shape());
        let dx = layer.backward((&params).into(), (&mut grads).into(), saved, dy, true);
        (y, dx, grads, buffers)
    })
}

fn check(name: &str, layer: &dyn Layer, x: Tensor) {
    let serial = layer_step(layer, &x, 9, 1);
    let parallel = layer_step(layer, &x, 9, 3);
    assert!(
        serial.0 == parallel.0,
        "{name}: outputs differ across pool sizes"
    );
    assert!(serial.1 == parallel.1, "{name}: input gradients differ");
    assert!(serial.2 == parallel.2, "{name}: parameter gradients differ");
    assert!(serial.3 == parallel.3, "{name}: buffers differ");
}

fn normal(seed: u64, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(normal_vec(&mut SplitMix64::new(seed), n, 1.0), shape)
}

#[test]
fn dense_and_norm_layers() {
    check(
        "linear",
        &Linear::new(64, 128, true),
        normal(1, &[4, 16, 64]),
    );
    check("layernorm", &LayerNorm::new(64), normal(2, &[8, 70, 64]));
    check(
        "batchnorm",
        &BatchNorm2d::new(16),
        normal(3, &[16, 8, 16, 16]),
    );
    for act in [
        Activation::Relu,
        Activation::Sigmoid,
        Activation::Tanh,
        Activation::Gelu,
    ] {
        check(&format!("{act:?}"), &Act(act), normal(4, &[40, 1000]));
    }
}

#[test]
fn convolution_and_pooling_layers() {
    check(
        "conv k3 s1 p1",
        &Conv2d::new(8, 16, 3, 1, 1),
        normal(5, &[8, 8, 16, 16]),
    );
    check(
        "conv k3 s2 p1",
        &Conv2d::new(8, 16, 3, 2, 1),
        normal(6, &[8, 8, 17, 17]),
    );
    check(
        "conv pointwise",
        &Conv2d::new(32, 16, 1, 1, 0),
        normal(7, &[32, 8, 16, 16]),
    );
    check(
        "maxpool k3 s2 p1",
        &Pool2d::max(3, 2, 1),
        normal(8, &[16, 8, 16, 16]),
    );
    check(
        "avgpool k2 s2",
        &Pool2d::avg(2, 2),
        normal(9, &[16, 8, 16, 16]),
    );
    let gap = Flatten {
        global_average: true,
    };
    check("global average", &gap, normal(10, &[64, 8, 8, 8]));
    check(
        "residual",
        &Residual::new(16, 32, 2),
        normal(11, &[16, 4, 16, 16]),
    );
}

#[test]
fn transformer_block_and_loss() {
    check(
        "gpt block",
        &GptBlock::new(64, 4, None),
        normal(12, &[4, 32, 64]),
    );
    let logits = normal_vec(&mut SplitMix64::new(13), 256 * 100, 3.0);
    let targets: Vec<u32> = (0..256).map(|i| (i * 37 % 100) as u32).collect();
    let run =
        |threads| par::pool(threads).install(|| softmax_cross_entropy(&logits, 100, &targets, 0.5));
    assert!(
        run(1) == run(3),
        "softmax cross-entropy differs across pool sizes"
    );
}

/// A whole GPT step, through the model's block loop, on 1 and 3 threads.
#[test]
fn gpt_model_step() {
    let cfg = GptConfig {
        vocab: 64,
        dim: 64,
        layers: 2,
        heads: 4,
        seq: 32,
        tie_embeddings: false,
        attention: Default::default(),
        gelu: Default::default(),
    };
    let model = gpt::gpt(&cfg);
    let mut rng = SplitMix64::new(14);
    let ids: Vec<f32> = (0..4 * cfg.seq).map(|_| rng.below(64) as f32).collect();
    let targets: Vec<u32> = (0..4 * cfg.seq).map(|_| rng.below(64) as u32).collect();
    let run = |threads| {
        par::pool(threads).install(|| {
            let mut store = model.init(1);
            let x = Tensor::from_vec(ids.clone(), &[4, cfg.seq]);
            let (logits, acts) = model.forward_all(&mut store, x, Mode::TRAIN);
            let (loss, d, _) = softmax_cross_entropy(logits.data(), 64, &targets, 1.0);
            let d = Tensor::from_vec(d, logits.shape());
            model.backward(&mut store, acts, d, false, &mut |_, _| {});
            (loss, store)
        })
    };
    assert!(run(1) == run(3), "GPT step differs across pool sizes");
}
