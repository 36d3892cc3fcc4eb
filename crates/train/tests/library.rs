//! The library as a user meets it: a model and dataset defined here (not built in), trained
//! through the public API on every layout, checked against one worker on the same global
//! batches; tied parameters across pipeline stages; bad data, models and layouts rejected
//! before any work; a stuck worker reported by every other within the configured timeout.
//!
//! Tolerances: as in `crates/meshtrain/tests/data_parallel.rs`, data-parallel and pipelined
//! runs differ from one worker only in the order of floating-point sums, so parameters agree
//! to a relative L2 distance of 2e-4 after 12 steps. Where no sum is reordered (one
//! micro-batch, no data parallelism, no clipping) the pipeline must be bit-identical.

use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_train::nn::layers::Linear;
use meshtrain_train::nn::models::{gpt, GptConfig};
use meshtrain_train::nn::optim::{OptimizerConfig, ParamGroups};
use meshtrain_train::nn::{
    Block, CrossEntropy, InputSpec, Layer, Mode, Model, ParamSpec, Params, ParamsMut, Saved,
};
use meshtrain_train::tensor::activation::Activation;
use meshtrain_train::tensor::rng::SplitMix64;
use meshtrain_train::tensor::Tensor;
use meshtrain_train::{
    BatchMut, Dataset, DatasetError, EvalPlan, Inputs, Job, Layout, LrSchedule, RunOptions,
    Sampling, TextWindows,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Gaussian blobs in 8 dimensions, 4 classes: a dataset of the test's own.
struct Blobs {
    x: Vec<f32>,
    y: Vec<u32>,
    /// Label every sample with this class instead (a broken dataset).
    bad_label: Option<u32>,
    /// Claim this input shape (a broken dataset).
    shape: Vec<usize>,
}

const DIM: usize = 8;

impl Blobs {
    fn new(n: usize, seed: u64) -> Blobs {
        let mut rng = SplitMix64::new(seed);
        let mut x = Vec::with_capacity(n * DIM);
        let mut y = Vec::with_capacity(n);
        for i in 0..n {
            let class = (i % 4) as u32;
            for d in 0..DIM {
                let centre = if d % 4 == class as usize { 2.0 } else { 0.0 };
                x.push(centre + rng.normal());
            }
            y.push(class);
        }
        Blobs {
            x,
            y,
            bad_label: None,
            shape: vec![DIM],
        }
    }
}

impl Dataset for Blobs {
    fn name(&self) -> String {
        "blobs".into()
    }
    fn len(&self) -> usize {
        self.y.len()
    }
    fn input(&self) -> InputSpec {
        InputSpec::float(&self.shape)
    }
    fn fill(&self, indices: &[usize], batch: BatchMut<'_>) -> Result<(), DatasetError> {
        let Inputs::Float(x) = batch.inputs else {
            return Err("float features".into());
        };
        let per = x.len() / indices.len();
        for ((&i, xi), yi) in indices
            .iter()
            .zip(x.chunks_exact_mut(per))
            .zip(batch.targets)
        {
            xi.copy_from_slice(&self.x[i * DIM..][..per.min(DIM)]);
            *yi = self.bad_label.unwrap_or(self.y[i]);
        }
        Ok(())
    }
}

/// A layer of the test's own: `y = x · s` with one learned scale per feature, and
/// optionally a long sleep in forward (to make a stuck worker).
struct Scale {
    dim: usize,
    sleep: bool,
}

impl Layer for Scale {
    fn params(&self) -> Vec<ParamSpec> {
        vec![ParamSpec::new(
            "scale",
            &[self.dim],
            meshtrain_train::nn::Init::Ones,
        )]
    }
    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let p = p.host();
        if self.sleep {
            std::thread::sleep(Duration::from_secs(6));
        }
        let y: Vec<f32> = x
            .data()
            .chunks(self.dim)
            .flat_map(|row| row.iter().zip(p).map(|(a, b)| a * b))
            .collect();
        if mode.train {
            s.tensors.push(x.clone());
        }
        Tensor::from_vec(y, x.shape())
    }
    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        let p = p.host();
        let g = g.host();
        let x = s.tensors.pop().expect("saved input");
        for (xr, dr) in x.data().chunks(self.dim).zip(dy.data().chunks(self.dim)) {
            for k in 0..self.dim {
                g[k] += xr[k] * dr[k];
            }
        }
        let dx: Vec<f32> = dy
            .data()
            .chunks(self.dim)
            .flat_map(|row| row.iter().zip(p).map(|(a, b)| a * b))
            .collect();
        Some(Tensor::from_vec(dx, dy.shape()))
    }
}

fn mlp(sleep: bool) -> Model {
    Model::new(vec![
        Block::new("scale", Scale { dim: DIM, sleep }),
        Block::new(
            "fc1",
            Linear::new(DIM, 32, true).with_activation(Activation::Gelu),
        ),
        Block::new(
            "fc2",
            Linear::new(32, 32, true).with_activation(Activation::Tanh),
        ),
        Block::new("head", Linear::new(32, 4, true)),
    ])
    .with_input(InputSpec::float(&[DIM]))
}

fn blob_job(layout: &str) -> Job {
    Job::new(
        || mlp(false),
        Arc::new(Blobs::new(1024, 7)),
        Arc::new(CrossEntropy::new(4)),
    )
    .eval(Arc::new(Blobs::new(256, 8)), EvalPlan::All { batch: 100 })
    .optimizer(OptimizerConfig::Adamw {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.05,
    })
    .param_groups(ParamGroups::no_decay_on_vectors())
    .lr(LrSchedule {
        lr: 3e-3,
        warmup_steps: 3,
        min_lr_fraction: 0.1,
        reference_batch: None,
    })
    .batch_size(32)
    .epochs(1)
    .grad_clip(1.0)
    .layout(layout.parse().unwrap())
}

/// The whole model's parameters after `steps` steps of `job` on its layout's world (one
/// thread per worker), gathered from the stages on rank 0.
fn train(job: Job, steps: u64) -> Vec<f32> {
    let workers = job.layout.world_size();
    job.check(workers).unwrap_or_else(|e| panic!("{e:#}"));
    let job = Arc::new(job);
    let mut out = ThreadsWorld::run(workers, CommConfig::default(), move |group| {
        let mut t = job.trainer(group, Some(1))?;
        for _ in 0..steps {
            t.train_step()?;
        }
        let full = t.parallel.gather_state(&t.model, &t.whole)?;
        Ok::<_, anyhow::Error>(full.map(|(store, _)| store.values))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    out.remove(0).expect("rank 0 gathers the model")
}

fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let norm = |it: &mut dyn Iterator<Item = f64>| it.map(|v| v * v).sum::<f64>().sqrt();
    norm(&mut a.iter().zip(b).map(|(x, y)| (*x - *y) as f64))
        / norm(&mut b.iter().map(|&v| v as f64))
}

#[test]
fn a_users_model_trains_the_same_on_every_layout() {
    let single = train(blob_job("dp=1"), 12);
    for layout in [
        "dp=2",
        "dp=4",
        "pp=2,m=4,schedule=1f1b",
        "pp=2,m=4,schedule=gpipe",
        "pp=2,m=2,schedule=interleaved:2",
        "dp=2,pp=2,mb=4,schedule=1f1b",
        "dp=1,m=4",
    ] {
        let params = train(blob_job(layout), 12);
        let d = rel_diff(&params, &single);
        eprintln!("{layout}: relative difference {d:.2e}");
        assert!(d <= 2e-4, "{layout}: {d:.2e}");
        assert_ne!(params, single, "{layout}: no rounding difference at all?");
    }
    let mut sm = blob_job("dp=2");
    sm.parallel.dp_mode = meshtrain_train::DpMode::SingleMaster;
    let d = rel_diff(&train(sm, 12), &single);
    assert!(d <= 2e-4, "single master: {d:.2e}");
}

#[test]
fn a_users_model_learns_through_job_run() {
    let dir = tempfile::tempdir().unwrap();
    let job = blob_job("pp=2,mb=8")
        .epochs(3)
        .out_dir(dir.path())
        .log_every(1000);
    let summary = job.run(&RunOptions::default()).unwrap();
    let accuracy = summary.test_accuracy.unwrap();
    assert!(accuracy > 0.9, "accuracy {accuracy}");
    assert_eq!(summary.layout, "dp=1,pp=2,mb=8,schedule=1f1b");
    // The run's breakdown is what `meshtrain plan --compare` reads.
    let breakdown: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("breakdown.json")).unwrap())
            .unwrap();
    assert_eq!(breakdown["workers"], 2);
    assert!(breakdown["step_s"].as_f64().unwrap() > 0.0);
    assert!(breakdown["bubble_s"].as_f64().unwrap() > 0.0);
}

/// GPT with its head tied to the token embedding. On two stages the copies live on
/// different workers and their gradients are added across them; with one micro-batch and
/// no clipping nothing else differs from one worker, so the result is bit-identical.
#[test]
fn tied_embeddings_across_pipeline_stages() {
    let cfg = GptConfig {
        vocab: 256,
        dim: 16,
        layers: 2,
        heads: 2,
        seq: 8,
        tie_embeddings: true,
        attention: Default::default(),
        gelu: Default::default(),
    };
    let text: Vec<u8> = (0..4000u32).map(|i| (i * 7 % 251) as u8).collect();
    let job = |layout: &str| {
        Job::new(
            move || gpt::gpt(&cfg),
            Arc::new(TextWindows::bytes("bytes", &text, cfg.seq)),
            Arc::new(CrossEntropy::new(256)),
        )
        .sampling(Sampling::Random)
        .steps(8)
        .batch_size(4)
        .lr(LrSchedule::constant(1e-2))
        .layout(layout.parse().unwrap())
    };
    let model = gpt::gpt(&cfg);
    assert_eq!(model.num_unique_params() + 256 * 16, model.num_params());
    let (tok, head) = (
        model.params()[model.param_index("tok.weight").unwrap()]
            .range
            .clone(),
        model.params()[model.param_index("head.weight").unwrap()]
            .range
            .clone(),
    );
    let single = train(job("dp=1"), 8);
    assert_eq!(
        single[tok.clone()],
        single[head.clone()],
        "the copies drifted apart"
    );
    let initial = model.init(0).values;
    assert_ne!(
        single[tok.clone()],
        initial[tok.clone()],
        "the embedding did not train"
    );
    let piped = train(job("pp=2,schedule=gpipe"), 8);
    assert_eq!(
        piped[tok.clone()],
        piped[head],
        "the copies drifted apart across stages"
    );
    assert!(piped == single, "pp=2: {:.2e}", rel_diff(&piped, &single));
    let mixed = train(job("dp=2,pp=2,m=2"), 8);
    assert!(rel_diff(&mixed, &single) <= 2e-4);
    // An untied model's head moves independently of the embedding.
    let untied = GptConfig {
        tie_embeddings: false,
        ..cfg
    };
    assert_eq!(
        gpt::gpt(&untied).num_unique_params(),
        gpt::gpt(&untied).num_params()
    );
}

#[test]
fn bad_data_models_and_layouts_fail_before_any_work() {
    let err = |job: Job| format!("{:#}", job.check(job.layout.world_size()).unwrap_err());
    // A dataset whose samples do not fit the model.
    let mut wrong = Blobs::new(64, 1);
    wrong.shape = vec![3, 4];
    let e = err(blob_job("dp=1")
        .eval(Arc::new(Blobs::new(64, 2)), EvalPlan::All { batch: 8 })
        .pipe(|j| Job {
            train_data: Arc::new(wrong),
            ..j
        }));
    assert!(
        e.contains("training set 'blobs'") && e.contains("[3, 4]") && e.contains("[8]"),
        "{e}"
    );
    // A model that declares nothing: one sample goes through it, and its complaint is the
    // error (not a panic in a worker).
    let mut undeclared = blob_job("dp=1");
    undeclared.model = Arc::new(|| Model::new(vec![Block::new("fc", Linear::new(5, 4, true))]));
    let e = err(undeclared);
    assert!(
        e.contains("the model cannot take one sample of the dataset"),
        "{e}"
    );
    // Labels the loss cannot take, named with the sample.
    let mut labels = Blobs::new(64, 1);
    labels.bad_label = Some(9);
    let e = err(Job {
        train_data: Arc::new(labels),
        ..blob_job("dp=1")
    });
    assert!(
        e.contains("target 0 is 9, outside 0..4") && e.contains("sample 0"),
        "{e}"
    );
    // Layouts.
    let e = err(blob_job("pp=5"));
    assert!(
        e.contains("5 stages, but the model has only 4 blocks"),
        "{e}"
    );
    let e = format!("{:#}", blob_job("dp=2,pp=3").check(4).unwrap_err());
    assert!(
        e.contains("dp=2 × tp=1 × pp=3 × cp=1 = 6 but the world has 4 workers"),
        "{e}"
    );
    let e = err(blob_job("dp=3"));
    assert!(
        e.contains("train.batch_size 32 must divide evenly over dp=3"),
        "{e}"
    );
    let e = err(blob_job("dp=1").batch_size(2048));
    assert!(
        e.contains("batch size 2048 is larger than the 1024 samples"),
        "{e}"
    );
    let e = err(blob_job("dp=1").steps(0));
    assert!(e.contains("train.steps must be at least 1"), "{e}");
}

trait Pipe: Sized {
    fn pipe<R>(self, f: impl FnOnce(Self) -> R) -> R {
        f(self)
    }
}
impl Pipe for Job {}

#[test]
fn a_stuck_worker_fails_every_other_within_the_timeout() {
    // DDP, and ZeRO-2/3, whose per-block collectives run inside forward and backward: a
    // failed one must cost one timeout, not one per block.
    for layout in ["dp=2", "dp=2,zero=2", "dp=2,zero=3"] {
        // Each worker builds its model on its own thread: worker 1's sleeps in forward.
        let mut job = blob_job(layout);
        job.model = Arc::new(|| mlp(std::thread::current().name() == Some("meshtrain-worker-1")));
        let job = job.timeout(Duration::from_secs(1)).steps(2);
        let started = Instant::now();
        let dir = tempfile::tempdir().unwrap();
        let err = format!(
            "{:#}",
            job.out_dir(dir.path())
                .run(&RunOptions::default())
                .unwrap_err()
        );
        let elapsed = started.elapsed();
        eprintln!("{layout}: after {elapsed:?}: {err}");
        assert!(err.contains("rank 0"), "{layout}: {err}");
        assert!(
            err.contains("timed out") || err.contains("timeout"),
            "{layout}: {err}"
        );
        assert!(
            err.contains("[1]"),
            "{layout}: the missing rank is named: {err}"
        );
        assert!(
            elapsed < Duration::from_secs(5),
            "{layout}: took {elapsed:?}"
        );
    }
}

#[test]
fn layouts_parse_what_the_planner_prints() {
    let l: Layout = "dp=2 tp=1 pp=2 zero=0 mb=4 recompute=none 1f1b"
        .parse()
        .unwrap();
    assert_eq!((l.dp, l.pp, l.micro_batch_size), (2, 2, Some(4)));
}
