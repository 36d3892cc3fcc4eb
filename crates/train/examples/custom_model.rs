//! Train a model and a dataset of your own with meshtrain's parallel layouts, through the
//! public API only: a three-arm spiral (2-D points, 3 classes), a residual MLP whose residual
//! block is a layer written here with its own forward and backward, trained data-parallel
//! (`dp=2`), pipelined (`pp=2`, 4 micro-batches of 16) and data-parallel in bf16 mixed
//! precision (the layer passes `set_precision` to its linears), with parameter groups (no
//! weight decay on biases), warm-up + cosine, checkpoints and metrics.
//!
//! ```sh
//! cargo run --release -p meshtrain-train --example custom_model
//! ```
//!
//! It exits non-zero if a layout does not learn the spirals (CI runs it).

use meshtrain_train::nn::layers::Linear;
use meshtrain_train::nn::optim::{OptimizerConfig, ParamGroups};
use meshtrain_train::nn::{
    Block, CrossEntropy, InputSpec, Layer, Mode, Model, ParamSpec, Params, ParamsMut, Saved,
};
use meshtrain_train::tensor::activation::Activation;
use meshtrain_train::tensor::rng::SplitMix64;
use meshtrain_train::tensor::{DType, Device, Tensor};
use meshtrain_train::{
    BatchMut, Dataset, DatasetError, EvalPlan, Inputs, Job, LrSchedule, RunOptions,
};
use std::sync::Arc;

/// Points on three noisy spiral arms; the label is the arm.
struct Spirals {
    points: Vec<[f32; 2]>,
    labels: Vec<u32>,
}

impl Spirals {
    fn new(n: usize, seed: u64) -> Spirals {
        let mut rng = SplitMix64::new(seed);
        let (mut points, mut labels) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n {
            let arm = (i % 3) as u32;
            let t = rng.next_f32(); // position along the arm, 0..1
            let angle = 4.0 * t + arm as f32 * 2.0 * std::f32::consts::PI / 3.0;
            let noise = 0.15 * rng.normal();
            points.push([
                t * angle.cos() + 0.05 * noise,
                t * angle.sin() - 0.05 * noise,
            ]);
            labels.push(arm);
        }
        Spirals { points, labels }
    }
}

impl Dataset for Spirals {
    fn name(&self) -> String {
        "spirals".into()
    }

    fn len(&self) -> usize {
        self.points.len()
    }

    fn input(&self) -> InputSpec {
        InputSpec::float(&[2])
    }

    fn fill(&self, indices: &[usize], batch: BatchMut<'_>) -> Result<(), DatasetError> {
        let Inputs::Float(x) = batch.inputs else {
            return Err("spirals are float features".into());
        };
        for ((&i, xi), yi) in indices.iter().zip(x.chunks_exact_mut(2)).zip(batch.targets) {
            xi.copy_from_slice(&self.points[i]);
            *yi = self.labels[i];
        }
        Ok(())
    }
}

/// `y = x + fc2(relu(fc1(x)))`: a layer of our own. Its parameters are fc1's then fc2's, in
/// the slices the model hands it; backward adds the skip path's gradient to the MLP's.
struct ResidualMlp {
    fc1: Linear,
    fc2: Linear,
}

impl ResidualMlp {
    fn new(width: usize) -> Self {
        ResidualMlp {
            fc1: Linear::new(width, 2 * width, true).with_activation(Activation::Relu),
            fc2: Linear::new(2 * width, width, true),
        }
    }

    fn fc1_len(&self) -> usize {
        self.fc1.params().iter().map(ParamSpec::len).sum()
    }
}

impl Layer for ResidualMlp {
    /// Mixed precision reaches layers through this (or through `children_mut`, for layers
    /// kept in `Children`): our two linears then run their products in bf16/f16.
    fn set_precision(&mut self, precision: DType) {
        self.fc1.set_precision(precision);
        self.fc2.set_precision(precision);
    }

    fn params(&self) -> Vec<ParamSpec> {
        let mut specs = Vec::new();
        for (prefix, layer) in [("fc1", &self.fc1), ("fc2", &self.fc2)] {
            for mut p in layer.params() {
                p.name = format!("{prefix}.{}", p.name);
                specs.push(p);
            }
        }
        specs
    }

    /// Our layer is made of built-in linears and a residual add, so it runs wherever they
    /// do (both have CUDA kernels): on a GPU it needs no code of its own.
    fn runs_on(&self, device: Device) -> bool {
        self.fc1.runs_on(device) && self.fc2.runs_on(device)
    }

    /// `Params` are the model's flat buffer wherever it lives (host values or GPU memory):
    /// we only slice them and hand the slices to the linears, which pick their kernels.
    fn forward(
        &self,
        p: Params<'_>,
        mut b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let (p1, p2) = p.split_at(self.fc1_len());
        let (mut s1, mut s2) = (Saved::default(), Saved::default());
        let h = self
            .fc1
            .forward(p1, b.slice(0..0), x.clone(), mode, &mut s1);
        let y = self.fc2.forward(p2, b.slice(0..0), h, mode, &mut s2);
        s.children.extend([s1, s2]);
        let mut out = x;
        out.add_assign(&y);
        out
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        let (p1, p2) = p.split_at(self.fc1_len());
        let (g1, g2) = g.split_at(self.fc1_len());
        let s2 = s.children.pop().expect("fc2's saved state");
        let s1 = s.children.pop().expect("fc1's saved state");
        let dh = self.fc2.backward(p2, g2, s2, dy.clone(), true)?;
        let dx = self.fc1.backward(p1, g1, s1, dh, need_dx)?;
        let mut sum = dy;
        sum.add_assign(&dx);
        need_dx.then_some(sum)
    }
}

/// Four blocks, so a pipeline can cut between any two of them.
fn model() -> Model {
    let width = 32;
    Model::new(vec![
        Block::new(
            "stem",
            Linear::new(2, width, true).with_activation(Activation::Tanh),
        ),
        Block::new("res1", ResidualMlp::new(width)),
        Block::new("res2", ResidualMlp::new(width)),
        Block::new("head", Linear::new(width, 3, true)),
    ])
    .with_input(InputSpec::float(&[2]))
}

fn main() -> anyhow::Result<()> {
    let train: Arc<dyn Dataset> = Arc::new(Spirals::new(6144, 1));
    let test: Arc<dyn Dataset> = Arc::new(Spirals::new(1536, 2));
    let out = std::env::temp_dir().join("meshtrain-custom-model");
    let mut finals = Vec::new();
    for layout in ["dp=2", "pp=2,mb=16", "dp=2,precision=bf16"] {
        println!("\n== {layout}");
        let summary = Job::new(model, train.clone(), Arc::new(CrossEntropy::new(3)))
            .eval(test.clone(), EvalPlan::All { batch: 512 })
            .optimizer(OptimizerConfig::Adamw {
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.01,
            })
            .param_groups(ParamGroups::no_decay_on_vectors())
            .lr(LrSchedule {
                lr: 1e-2,
                warmup_steps: 20,
                min_lr_fraction: 0.05,
                reference_batch: None,
            })
            .batch_size(64)
            .epochs(6)
            .threads(2)
            .log_every(96)
            .layout(layout.parse()?)
            .out_dir(out.join(layout.replace([',', '='], "_")))
            .run(&RunOptions {
                verbose: true,
                ..RunOptions::default()
            })?;
        let accuracy = summary.test_accuracy.unwrap_or(0.0);
        println!(
            "{layout}: test accuracy {:.1}%, final loss {:.4}, {:.0} samples/s",
            100.0 * accuracy,
            summary.final_train_loss,
            summary.samples_per_s
        );
        anyhow::ensure!(
            accuracy > 0.9,
            "{layout} did not learn the spirals: {:.1}% test accuracy",
            100.0 * accuracy
        );
        finals.push(summary.eval_loss.unwrap_or(f64::NAN));
    }
    // Both layouts train the same model on the same batches: only the order of float sums
    // differs. bf16 products round, so it lands near them, not on them.
    let gap = (finals[0] - finals[1]).abs() / finals[0];
    println!("\ndp=2 and pp=2 test losses differ by {gap:.1e} (relative)");
    anyhow::ensure!(gap < 1e-2, "the layouts diverged: {finals:?}");
    let bf16_gap = (finals[0] - finals[2]).abs();
    println!("dp=2 in bf16 and in fp32: test losses differ by {bf16_gap:.1e} (nats)");
    anyhow::ensure!(bf16_gap < 0.02, "bf16 diverged from fp32: {finals:?}");
    Ok(())
}
