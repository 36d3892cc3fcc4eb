//! Model-level properties the parallel modes rely on: the gradient-ready hook, block-range
//! forward/backward (pipeline stages), recomputation, deterministic initialisation, parameter
//! counts (checked against PyTorch's `sum(p.numel())`) and gradient accumulation.

mod common;

use common::{assert_close, normal_vec};
use meshtrain_nn::models::{gpt, lenet, resnet, GptConfig, LeNetVariant};
use meshtrain_nn::{Mode, Model, ParamStore};
use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;
use std::collections::HashSet;

/// A model with a batch of inputs and targets.
struct Setup {
    name: &'static str,
    model: Model,
    input: Tensor,
    targets: Vec<u32>,
    classes: usize,
}

fn images(seed: u64, batch: usize) -> (Tensor, Vec<u32>) {
    let mut rng = SplitMix64::new(seed);
    let x = normal_vec(&mut rng, batch * 28 * 28, 1.0);
    let y = (0..batch).map(|_| rng.below(10) as u32).collect();
    (Tensor::from_vec(x, &[batch, 1, 28, 28]), y)
}

fn small_gpt_config() -> GptConfig {
    GptConfig {
        vocab: 32,
        dim: 16,
        layers: 3,
        heads: 2,
        seq: 8,
        tie_embeddings: false,
        attention: Default::default(),
        gelu: Default::default(),
    }
}

/// LeNet (both variants), a narrow ResNet-18 (batch norm, residuals) and a small GPT.
fn setups() -> Vec<Setup> {
    let (x, y) = images(1, 4);
    let (xr, yr) = images(2, 4);
    let cfg = small_gpt_config();
    let mut rng = SplitMix64::new(3);
    let ids = (0..2 * cfg.seq)
        .map(|_| rng.below(cfg.vocab as u64) as f32)
        .collect();
    let next = (0..2 * cfg.seq)
        .map(|_| rng.below(cfg.vocab as u64) as u32)
        .collect();
    vec![
        Setup {
            name: "lenet sigmoid",
            model: lenet::lenet(LeNetVariant::Sigmoid),
            input: x.clone(),
            targets: y.clone(),
            classes: 10,
        },
        Setup {
            name: "lenet relu",
            model: lenet::lenet(LeNetVariant::Relu),
            input: x,
            targets: y,
            classes: 10,
        },
        Setup {
            name: "resnet18 w4",
            model: resnet::resnet18(4, 10),
            input: xr,
            targets: yr,
            classes: 10,
        },
        Setup {
            name: "gpt",
            model: gpt::gpt(&cfg),
            input: Tensor::from_vec(ids, &[2, cfg.seq]),
            targets: next,
            classes: cfg.vocab,
        },
    ]
}

/// Mean-loss gradient of the logits, scaled by `scale`.
fn loss_grad(s: &Setup, logits: &Tensor, targets: &[u32], scale: f32) -> Tensor {
    let (_, d, _) = softmax_cross_entropy(logits.data(), s.classes, targets, scale);
    Tensor::from_vec(d, logits.shape())
}

/// One whole-model train step's gradients (and updated buffers) from a fresh init.
fn whole_pass(s: &Setup) -> ParamStore {
    let mut store = s.model.init(7);
    let (logits, acts) = s
        .model
        .forward_all(&mut store, s.input.clone(), Mode::TRAIN);
    let dy = loss_grad(s, &logits, &s.targets, 1.0);
    s.model
        .backward(&mut store, acts, dy, false, &mut |_, _| {});
    store
}

/// (a) The hook fires once per block, last block first, and when it fires for block `i`
/// that block's gradient range already holds its final value (so its all-reduce may start).
#[test]
fn block_ready_hook_fires_in_reverse_with_final_gradients() {
    for s in setups() {
        let n = s.model.num_blocks();
        let mut store = s.model.init(7);
        let (logits, acts) = s
            .model
            .forward_all(&mut store, s.input.clone(), Mode::TRAIN);
        let dy = loss_grad(&s, &logits, &s.targets, 1.0);
        let mut fired = Vec::new();
        let mut snapshots = Vec::new();
        s.model.backward(&mut store, acts, dy, false, &mut |i, st| {
            fired.push(i);
            snapshots.push(st.grads[s.model.block_param_range(i)].to_vec());
        });
        let expected: Vec<usize> = (0..n).rev().collect();
        assert_eq!(fired, expected, "{}: hook order", s.name);
        for (&i, snap) in fired.iter().zip(&snapshots) {
            let final_grads = &store.grads[s.model.block_param_range(i)];
            assert_eq!(
                snap.as_slice(),
                final_grads,
                "{}: block {i} gradients changed after its hook fired",
                s.name
            );
            assert!(
                snap.iter().any(|&g| g != 0.0),
                "{}: block {i} had no gradient when its hook fired",
                s.name
            );
        }
    }
}

/// (b) Forward 0..k then k..n, backward n..k then k..0 from the received gradient — what two
/// pipeline stages do — gives bit-identical gradients and buffers to the whole-model pass,
/// for every cut point.
#[test]
fn split_block_ranges_match_whole_model_bit_for_bit() {
    for s in setups() {
        let whole = whole_pass(&s);
        let n = s.model.num_blocks();
        for k in 1..n {
            let mut store = s.model.init(7);
            let none = |_: usize| false;
            let (h, acts1) = s
                .model
                .forward(&mut store, s.input.clone(), 0..k, Mode::TRAIN, &none);
            let boundary_shape = h.shape().to_vec();
            let (logits, acts2) = s.model.forward(&mut store, h, k..n, Mode::TRAIN, &none);
            let dy = loss_grad(&s, &logits, &s.targets, 1.0);
            let mut fired = Vec::new();
            let dh = s
                .model
                .backward(&mut store, acts2, dy, true, &mut |i, _| fired.push(i))
                .expect("the second stage must return its input gradient");
            assert_eq!(
                dh.shape(),
                boundary_shape,
                "{}: cut {k}: gradient shape",
                s.name
            );
            let first = s
                .model
                .backward(&mut store, acts1, dh, false, &mut |i, _| fired.push(i));
            assert!(first.is_none(), "{}: first stage returned dx", s.name);
            assert_eq!(
                fired,
                (0..n).rev().collect::<Vec<_>>(),
                "{}: cut {k}",
                s.name
            );
            assert!(
                store.grads == whole.grads,
                "{}: cut at block {k}: gradients differ from the whole-model pass",
                s.name
            );
            assert_eq!(store.buffers, whole.buffers, "{}: cut {k}: buffers", s.name);
        }
    }
}

/// (c) Recomputing some blocks in backward (activation checkpointing) gives identical
/// gradients and batch-norm running statistics (each updated once, in the first forward) and
/// keeps fewer activation bytes.
#[test]
fn recomputation_is_exact_and_saves_memory() {
    for s in setups() {
        let whole = whole_pass(&s);
        let plain_bytes = {
            let mut store = s.model.init(7);
            let (_, acts) = s
                .model
                .forward_all(&mut store, s.input.clone(), Mode::TRAIN);
            acts.bytes()
        };
        let n = s.model.num_blocks();
        for (what, pred) in [
            (
                "odd blocks",
                &(|i: usize| i % 2 == 1) as &dyn Fn(usize) -> bool,
            ),
            ("all blocks", &|_| true),
        ] {
            let mut store = s.model.init(7);
            let (logits, acts) =
                s.model
                    .forward(&mut store, s.input.clone(), 0..n, Mode::TRAIN, pred);
            let bytes = acts.bytes();
            assert!(
                bytes < plain_bytes,
                "{}: recomputing {what} keeps {bytes} bytes, not fewer than {plain_bytes}",
                s.name
            );
            let dy = loss_grad(&s, &logits, &s.targets, 1.0);
            s.model
                .backward(&mut store, acts, dy, false, &mut |_, _| {});
            assert!(
                store.grads == whole.grads,
                "{}: recomputing {what} changed the gradients",
                s.name
            );
            assert_eq!(
                store.buffers, whole.buffers,
                "{}: recomputing {what} changed the running statistics",
                s.name
            );
            println!(
                "{}: recompute {what}: {bytes} of {plain_bytes} bytes",
                s.name
            );
        }
    }
}

/// (d) Initialisation is a function of the seed; names are unique and ranges tile the buffer.
#[test]
fn init_is_deterministic_and_names_are_unique() {
    for s in setups() {
        let a = s.model.init(11);
        assert_eq!(a, s.model.init(11), "{}: same seed, different init", s.name);
        let b = s.model.init(12);
        assert_ne!(a.values, b.values, "{}: seed ignored", s.name);
        assert!(a.grads.iter().all(|&g| g == 0.0));
        for (kind, entries, total) in [
            ("param", s.model.params(), s.model.num_params()),
            ("buffer", s.model.buffers(), s.model.num_buffers()),
        ] {
            let names: HashSet<&str> = entries.iter().map(|e| e.name.as_str()).collect();
            assert_eq!(
                names.len(),
                entries.len(),
                "{}: duplicate {kind} names",
                s.name
            );
            let mut next = 0;
            for e in entries {
                assert_eq!(
                    e.range.start, next,
                    "{}: {kind} {} not contiguous",
                    s.name, e.name
                );
                assert_eq!(e.range.len(), e.shape.iter().product::<usize>());
                next = e.range.end;
            }
            assert_eq!(
                next, total,
                "{}: {kind} ranges do not cover the buffer",
                s.name
            );
        }
        // Block ranges tile the parameter buffer in order.
        let mut next = 0;
        for i in 0..s.model.num_blocks() {
            let r = s.model.block_param_range(i);
            assert_eq!(r.start, next, "{}: block {i} range", s.name);
            next = r.end;
        }
        assert_eq!(next, s.model.num_params());
    }
}

/// (e) Parameter counts of the benchmark models, as PyTorch reports them
/// (`sum(p.numel() for p in m.parameters())` of `lenet()`, `d2l_resnet18(1, 10)` and
/// `TinyGPT()` in the peer baseline `pytorch_ddp_bench.py`, run with torch 2.15).
#[test]
fn parameter_counts_match_pytorch() {
    assert_eq!(lenet::lenet(LeNetVariant::Sigmoid).num_params(), 61_706);
    assert_eq!(lenet::lenet(LeNetVariant::Relu).num_params(), 61_706);
    assert_eq!(resnet::resnet18(64, 10).num_params(), 11_178_378);
    assert_eq!(gpt::gpt(&GptConfig::default()).num_params(), 3_323_392);
}

/// (f) Gradient accumulation: the mean loss over a batch of 8 equals the average of the two
/// half-batch mean losses, so two backward passes over the halves, each with gradient scale
/// ½, accumulate to the full-batch gradients (equivalently, unscaled halves sum to twice
/// them). LeNet has no batch norm, so the halves are independent. Summation order differs,
/// hence a tolerance (1e-5 norm-wise) instead of bit equality.
#[test]
fn gradient_accumulation_over_half_batches() {
    for variant in [LeNetVariant::Sigmoid, LeNetVariant::Relu] {
        let model = lenet::lenet(variant);
        let (x, y) = images(5, 8);
        let mut full = model.init(3);
        let (logits, acts) = model.forward_all(&mut full, x.clone(), Mode::TRAIN);
        let (_, d, _) = softmax_cross_entropy(logits.data(), 10, &y, 1.0);
        model.backward(
            &mut full,
            acts,
            Tensor::from_vec(d, logits.shape()),
            false,
            &mut |_, _| {},
        );

        let mut halves = model.init(3);
        for h in 0..2 {
            let xs = x.data()[h * 4 * 784..(h + 1) * 4 * 784].to_vec();
            let xs = Tensor::from_vec(xs, &[4, 1, 28, 28]);
            let (logits, acts) = model.forward_all(&mut halves, xs, Mode::TRAIN);
            let (_, d, _) = softmax_cross_entropy(logits.data(), 10, &y[h * 4..(h + 1) * 4], 1.0);
            let d = Tensor::from_vec(d, logits.shape());
            model.backward(&mut halves, acts, d, false, &mut |_, _| {});
        }
        let twice_full: Vec<f32> = full.grads.iter().map(|g| 2.0 * g).collect();
        assert_close(
            &format!("{variant:?}: sum of half-batch grads vs 2 x full"),
            &halves.grads,
            &twice_full,
            1e-5,
            0.0,
        );
        assert!(common::norm(&full.grads) > 0.0);
    }
}

/// Eval-mode forward is a pure function: it neither reads batch statistics nor updates the
/// running ones, and repeated calls agree bit for bit.
#[test]
fn eval_forward_leaves_buffers_alone() {
    for s in setups() {
        let mut store = s.model.init(7);
        let before = store.buffers.clone();
        let (a, _) = s.model.forward_all(&mut store, s.input.clone(), Mode::EVAL);
        let (b, _) = s.model.forward_all(&mut store, s.input.clone(), Mode::EVAL);
        assert_eq!(a, b, "{}", s.name);
        assert_eq!(store.buffers, before, "{}: eval updated buffers", s.name);
    }
}

/// Two micro-batches in flight at once (forward 1, forward 2, backward 2, backward 1 — a
/// pipeline schedule) give the same gradients and running statistics as running them one
/// after the other: forward state lives in the returned activations, not in the layers.
/// Gradients accumulate in another order, so they are compared to 1e-6 rather than bitwise.
#[test]
fn micro_batches_in_flight_match_sequential() {
    for s in setups() {
        let (first, second) = halves(&s);
        let mut sequential = s.model.init(7);
        for (x, y) in [&first, &second] {
            let (logits, acts) = s.model.forward_all(&mut sequential, x.clone(), Mode::TRAIN);
            let dy = loss_grad(&s, &logits, y, 0.5);
            s.model
                .backward(&mut sequential, acts, dy, false, &mut |_, _| {});
        }
        let mut interleaved = s.model.init(7);
        let (l1, a1) = s
            .model
            .forward_all(&mut interleaved, first.0.clone(), Mode::TRAIN);
        let (l2, a2) = s
            .model
            .forward_all(&mut interleaved, second.0.clone(), Mode::TRAIN);
        let d2 = loss_grad(&s, &l2, &second.1, 0.5);
        s.model
            .backward(&mut interleaved, a2, d2, false, &mut |_, _| {});
        let d1 = loss_grad(&s, &l1, &first.1, 0.5);
        s.model
            .backward(&mut interleaved, a1, d1, false, &mut |_, _| {});
        let what = format!("{}: interleaved micro-batch grads", s.name);
        assert_close(&what, &interleaved.grads, &sequential.grads, 1e-6, 0.0);
        assert_eq!(
            interleaved.buffers, sequential.buffers,
            "{}: buffers",
            s.name
        );
    }
}

/// The setup's batch split in two along the leading (batch) axis.
fn halves(s: &Setup) -> ((Tensor, Vec<u32>), (Tensor, Vec<u32>)) {
    let shape = s.input.shape();
    let per_sample = s.input.numel() / shape[0];
    let targets_per_sample = s.targets.len() / shape[0];
    let half = shape[0] / 2;
    let mut half_shape = shape.to_vec();
    half_shape[0] = half;
    let part = |i: usize| {
        let x = s.input.data()[i * half * per_sample..(i + 1) * half * per_sample].to_vec();
        let t = half * targets_per_sample;
        (
            Tensor::from_vec(x, &half_shape),
            s.targets[i * t..(i + 1) * t].to_vec(),
        )
    };
    (part(0), part(1))
}
