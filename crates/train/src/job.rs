//! A [`Job`]: everything a run needs — a model, data, a loss, an optimizer with parameter
//! groups, a learning-rate schedule and a [`Layout`] — checked as a whole before any work.
//!
//! ```no_run
//! # use meshtrain_train::*;
//! # use std::sync::Arc;
//! # fn model() -> nn::Model { unimplemented!() }
//! # fn data() -> Arc<dyn Dataset> { unimplemented!() }
//! let summary = Job::new(model, data(), Arc::new(nn::CrossEntropy::new(10)))
//!     .batch_size(64)
//!     .epochs(5)
//!     .layout("dp=2".parse()?)
//!     .run(&RunOptions::default())?;
//! # Ok::<(), anyhow::Error>(())
//! ```

use crate::dataset::{Dataset, EvalPlan, Inputs, Sampling};
use anyhow::{anyhow, bail, ensure, Context, Result};
use meshtrain_nn::optim::{OptimizerConfig, ParamGroups};
use meshtrain_nn::{InputKind, InputSpec, Loss, Mode, Model, ParamStore};
use meshtrain_parallel::pipeline::PartitionSpec;
use meshtrain_parallel::{Layout, ParallelOptions, ResolvedLayout};
use meshtrain_tensor::Tensor;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Builds a fresh model (every worker builds its own, then keeps its share).
pub type ModelFn = Arc<dyn Fn() -> Model + Send + Sync>;

/// How long training runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Length {
    /// Whole passes over the training set (needs [`Sampling::Epochs`]).
    Epochs(u64),
    Steps(u64),
}

/// Linear warm-up, then cosine decay to `min_lr_fraction × lr` at the last step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub lr: f32,
    pub warmup_steps: u64,
    /// 1.0 = constant after warm-up.
    pub min_lr_fraction: f32,
    /// Linear scaling rule: `lr` is for this global batch and scales with the actual one.
    pub reference_batch: Option<usize>,
}

impl LrSchedule {
    pub fn constant(lr: f32) -> Self {
        LrSchedule {
            lr,
            warmup_steps: 0,
            min_lr_fraction: 1.0,
            reference_batch: None,
        }
    }
}

/// An evaluation set and how to report on it.
#[derive(Clone)]
pub struct EvalSpec {
    pub data: Arc<dyn Dataset>,
    pub plan: EvalPlan,
    /// Report correct predictions per target (classification).
    pub accuracy: bool,
    /// Report perplexity, `exp(loss)` (language models).
    pub perplexity: bool,
    /// A reference loss to print beside the evaluation loss (text: the unigram entropy, the
    /// loss of a model that ignores context).
    pub baseline: Option<f64>,
}

/// A training run, described completely. Build one with [`Job::new`] and the setters, then
/// [`Job::run`] it; every field is public for callers that prefer a struct literal.
#[derive(Clone)]
pub struct Job {
    pub model: ModelFn,
    /// What the model is, stored in checkpoints: resuming refuses a checkpoint of another
    /// description (empty: not checked). The CLI stores the `[model]` config here.
    pub model_description: String,
    pub train_data: Arc<dyn Dataset>,
    pub sampling: Sampling,
    pub eval: Option<EvalSpec>,
    pub loss: Arc<dyn Loss>,
    pub optimizer: OptimizerConfig,
    pub param_groups: ParamGroups,
    pub lr: LrSchedule,
    /// Global batch: samples per optimizer step over all replicas.
    pub batch_size: usize,
    pub length: Length,
    /// Stop after this many steps (tests, resume checks); the schedule is unchanged.
    pub max_steps: Option<u64>,
    pub seed: u64,
    /// Intra-op threads of the whole job (default: all cores), split over the workers.
    pub threads: Option<usize>,
    /// Clip the global gradient norm to this value.
    pub grad_clip: Option<f32>,
    /// Log every N steps.
    pub log_every: u64,
    /// Evaluate every N steps (default: after each epoch, and at the end).
    pub eval_every: Option<u64>,
    /// Save a checkpoint every N steps (always at the end).
    pub checkpoint_every: Option<u64>,
    /// Save a checkpoint when this many minutes have passed since the last one (default
    /// 10): a long run is never more than this much work from its last checkpoint, whether
    /// or not anyone thought of `checkpoint_every`. Rank 0's clock decides for everyone.
    pub checkpoint_every_minutes: Option<f64>,
    /// Write the every-N-steps checkpoints on a background thread from an in-memory
    /// snapshot, so training waits for a memory copy instead of the disk (the final one is
    /// written before the run returns either way). See [`crate::writer`].
    pub checkpoint_background: bool,
    /// Metrics, checkpoints and the breakdown go here.
    pub out_dir: PathBuf,
    pub layout: Layout,
    pub parallel: ParallelOptions,
    /// Write a Chrome trace (and a PNG) of the last training step here.
    pub timeline: Option<PathBuf>,
    /// Also write the metrics (loss, learning rate, gradient norm, throughput, evaluation,
    /// the summary's memory and breakdown) as TensorBoard event files into this directory.
    pub tensorboard: Option<PathBuf>,
    /// How long a collective may wait for its peers before every worker fails with the
    /// operation, its sequence number and the missing ranks.
    pub timeout: Duration,
    /// The run's settings as text, stored in checkpoints for reference.
    pub config_text: String,
    /// How checkpoints are written: one file gathered on rank 0, or every worker its
    /// pieces ([`crate::sharded`]).
    pub checkpoint_format: CheckpointFormat,
}

/// How a run writes its checkpoints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointFormat {
    /// Sharded under ZeRO (gathering would put the whole model on one worker, which is
    /// what ZeRO avoids), one file otherwise.
    #[default]
    Auto,
    /// `checkpoint.safetensors`: the whole model, gathered on rank 0.
    Whole,
    /// `checkpoint/`: every worker writes its pieces, plus an index.
    Sharded,
}

/// Minutes between the checkpoints every run saves unless told otherwise.
pub const DEFAULT_CHECKPOINT_MINUTES: f64 = 10.0;

/// The default collective timeout: long enough for a slow evaluation or checkpoint on one
/// worker, short enough that a dead worker is reported within minutes.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl Job {
    /// A job training `model` on `train_data` with `loss`: AdamW (PyTorch's defaults,
    /// weight decay 0.01) at a constant 1e-3, batch 64, one epoch, one worker.
    pub fn new(
        model: impl Fn() -> Model + Send + Sync + 'static,
        train_data: Arc<dyn Dataset>,
        loss: Arc<dyn Loss>,
    ) -> Job {
        Job {
            model: Arc::new(model),
            model_description: String::new(),
            train_data,
            sampling: Sampling::Epochs,
            eval: None,
            loss,
            optimizer: OptimizerConfig::Adamw {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
            },
            param_groups: ParamGroups::default(),
            lr: LrSchedule::constant(1e-3),
            batch_size: 64,
            length: Length::Epochs(1),
            max_steps: None,
            seed: 0,
            threads: None,
            grad_clip: None,
            log_every: 50,
            eval_every: None,
            checkpoint_every: None,
            checkpoint_every_minutes: Some(DEFAULT_CHECKPOINT_MINUTES),
            checkpoint_background: true,
            out_dir: PathBuf::from("runs/latest"),
            layout: Layout::default(),
            parallel: ParallelOptions::default(),
            timeline: None,
            tensorboard: None,
            timeout: DEFAULT_TIMEOUT,
            config_text: String::new(),
            checkpoint_format: CheckpointFormat::Auto,
        }
    }

    pub fn sampling(mut self, sampling: Sampling) -> Self {
        self.sampling = sampling;
        self
    }

    /// Evaluates on `data` (after each epoch, every `eval_every` steps, and at the end),
    /// reporting the loss and, for classification, the accuracy.
    pub fn eval(mut self, data: Arc<dyn Dataset>, plan: EvalPlan) -> Self {
        self.eval = Some(EvalSpec {
            data,
            plan,
            accuracy: true,
            perplexity: false,
            baseline: None,
        });
        self
    }

    pub fn eval_spec(mut self, eval: EvalSpec) -> Self {
        self.eval = Some(eval);
        self
    }

    pub fn optimizer(mut self, optimizer: OptimizerConfig) -> Self {
        self.optimizer = optimizer;
        self
    }

    pub fn param_groups(mut self, groups: ParamGroups) -> Self {
        self.param_groups = groups;
        self
    }

    pub fn lr(mut self, lr: LrSchedule) -> Self {
        self.lr = lr;
        self
    }

    pub fn batch_size(mut self, batch: usize) -> Self {
        self.batch_size = batch;
        self
    }

    pub fn epochs(mut self, epochs: u64) -> Self {
        self.length = Length::Epochs(epochs);
        self
    }

    pub fn steps(mut self, steps: u64) -> Self {
        self.length = Length::Steps(steps);
        self
    }

    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = Some(threads);
        self
    }

    pub fn grad_clip(mut self, max_norm: f32) -> Self {
        self.grad_clip = Some(max_norm);
        self
    }

    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    pub fn parallel(mut self, options: ParallelOptions) -> Self {
        self.parallel = options;
        self
    }

    pub fn out_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.out_dir = dir.into();
        self
    }

    pub fn log_every(mut self, steps: u64) -> Self {
        self.log_every = steps;
        self
    }

    pub fn timeline(mut self, path: impl Into<PathBuf>) -> Self {
        self.timeline = Some(path.into());
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn describe_model(mut self, description: impl Into<String>) -> Self {
        self.model_description = description.into();
        self
    }

    /// Training steps per epoch (0 for [`Sampling::Random`]).
    pub fn steps_per_epoch(&self) -> u64 {
        match self.sampling {
            Sampling::Epochs => (self.train_data.len() / self.batch_size.max(1)) as u64,
            Sampling::Random => 0,
        }
    }

    /// Steps of the whole schedule.
    pub fn total_steps(&self) -> u64 {
        match self.length {
            Length::Steps(s) => s,
            Length::Epochs(e) => e * self.steps_per_epoch(),
        }
    }

    /// The step training stops at (`max_steps` or the end of the schedule).
    pub fn stop_step(&self) -> u64 {
        let total = self.total_steps();
        self.max_steps.map_or(total, |m| m.min(total))
    }

    /// What the run should say about settings that are legal but probably not meant: a
    /// warm-up that the run never leaves.
    pub fn notices(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let warmup = self.lr.warmup_steps;
        // The schedule's length (max_steps stops early on purpose, the schedule unchanged).
        let run = self.total_steps();
        if warmup > 0 && warmup >= run && run > 0 {
            let suggested = (run / 10).max(1);
            notes.push(format!(
                "schedule.warmup_steps={warmup} but the run trains {run} step{}: the learning \
                 rate never leaves warm-up (it reaches {:.0}% of schedule.lr at the last step); \
                 lower schedule.warmup_steps, e.g. to {suggested} (a tenth of the run)",
                if run == 1 { "" } else { "s" },
                100.0 * run as f64 / warmup as f64
            ));
        }
        notes
    }

    /// Checks everything that can be checked before any work, for a world of `world`
    /// workers: settings, the layout against the world, the batch and the model, the data
    /// against the model and the loss (one sample through the model). Returns the resolved
    /// layout.
    pub fn check(&self, world: usize) -> Result<ResolvedLayout> {
        ensure!(self.batch_size > 0, "train.batch_size must be at least 1");
        ensure!(self.threads != Some(0), "train.threads must be at least 1");
        ensure!(self.log_every > 0, "train.log_every must be at least 1");
        if let Some(m) = self.checkpoint_every_minutes {
            ensure!(
                m.is_finite() && m >= 0.0,
                "checkpoint.every_minutes must be a number of minutes ≥ 0 (0: none), got {m}"
            );
        }
        let lr = &self.lr;
        ensure!(
            lr.lr > 0.0 && lr.lr.is_finite(),
            "schedule.lr must be a positive number, got {}",
            lr.lr
        );
        ensure!(
            (0.0..=1.0).contains(&lr.min_lr_fraction),
            "schedule.min_lr_fraction must be in [0, 1], got {}",
            lr.min_lr_fraction
        );
        if let Some(c) = self.grad_clip {
            ensure!(
                c > 0.0 && c.is_finite(),
                "train.grad_clip must be positive, got {c}"
            );
        }
        self.param_groups
            .validate()
            .map_err(|e| anyhow!("parameter groups: {e}"))?;
        let data = &self.train_data;
        ensure!(
            !data.is_empty(),
            "the training set '{}' is empty",
            data.name()
        );
        match (self.length, self.sampling) {
            (Length::Steps(0), _) => bail!("train.steps must be at least 1"),
            (Length::Epochs(0), _) => bail!("train.epochs must be at least 1"),
            (Length::Epochs(_), Sampling::Random) => bail!(
                "'{}' is sampled at random (no epochs): give the run's length in steps \
                 (train.steps)",
                data.name()
            ),
            _ => {}
        }
        // Epochs are dealt whole batches at a time, whatever sets the run's length.
        ensure!(
            self.sampling != Sampling::Epochs || self.steps_per_epoch() > 0,
            "batch size {} is larger than the {} samples of '{}'",
            self.batch_size,
            data.len(),
            data.name()
        );
        ensure!(
            self.max_steps != Some(0),
            "train.max_steps must be at least 1"
        );
        let model = (self.model)();
        let resolved = self
            .layout
            .resolve(world, self.batch_size, &model)
            .context("the layout cannot run")?;
        self.parallel
            .partition
            .check(
                model.num_blocks(),
                resolved.schedule.num_chunks(),
                resolved.layout.tp * resolved.layout.cp,
            )
            .context("the layout cannot run")?;
        let cp = resolved.layout.cp;
        if cp > 1 {
            let p = &self.parallel;
            meshtrain_parallel::context::check(
                &model,
                cp,
                p.cp_mode,
                p.dp_mode,
                resolved.layout.tp,
            )
            .context("the layout cannot run")?;
            let seq = model.input().map_or(0, |i| i.sample_len());
            ensure!(
                data.targets_per_sample() == seq,
                "the layout cannot run: cp={cp} cuts every sample's {seq} tokens, and each \
                 worker's loss needs its tokens' targets, but '{}' has {} target(s) per \
                 sample",
                data.name(),
                data.targets_per_sample()
            );
        }
        if self.parallel.partition != PartitionSpec::Params && resolved.layout.pp == 1 {
            // Harmless (one chunk), but say so rather than ignore it silently.
            tracing::info!("parallel.partition applies to pipelines only (pp = 1 here)");
        }
        check_data_fits(&model, data.as_ref(), self.loss.as_ref())
            .with_context(|| format!("training set '{}'", data.name()))?;
        if let Some(eval) = &self.eval {
            ensure!(
                !eval.data.is_empty(),
                "the evaluation set '{}' is empty",
                eval.data.name()
            );
            match eval.plan {
                EvalPlan::All { batch } => ensure!(batch > 0, "evaluation batch must be ≥ 1"),
                EvalPlan::Random {
                    batches,
                    batch_size,
                    ..
                } => ensure!(
                    batches > 0 && batch_size > 0,
                    "train.eval_batches and the evaluation batch must be at least 1"
                ),
            }
            let same_samples = eval.data.input() == data.input()
                && eval.data.targets_per_sample() == data.targets_per_sample();
            if !same_samples {
                check_data_fits(&model, eval.data.as_ref(), self.loss.as_ref())
                    .with_context(|| format!("evaluation set '{}'", eval.data.name()))?;
            }
        }
        Ok(resolved)
    }
}

/// The dataset's samples are what the model takes and the loss can score: compares the
/// declared input, then runs one sample through a fresh model (a shape mismatch deep inside
/// a user's layer becomes this error, not a panic in a worker).
fn check_data_fits(model: &Model, data: &dyn Dataset, loss: &dyn Loss) -> Result<()> {
    let input = data.input();
    if let Some(expected) = model.input() {
        // Token ids fit when the dataset's vocabulary is within the model's.
        let fits = match (input.kind, expected.kind) {
            (InputKind::Tokens { vocab: given }, InputKind::Tokens { vocab: takes }) => {
                given <= takes && input.shape == expected.shape
            }
            _ => input == *expected,
        };
        ensure!(
            fits,
            "the dataset gives {input}, but the model takes {expected}"
        );
    }
    let batch = load(data, &input, loss, &[0])?;
    let probe = || -> Result<(), String> {
        // Shapes are what is probed: zero parameters do, without drawing random ones.
        let mut store = ParamStore {
            values: vec![0.0; model.num_params()],
            grads: Vec::new(),
            buffers: vec![0.0; model.num_buffers()],
        };
        let (out, _) = model.forward_all(&mut store, batch.x.clone(), Mode::EVAL);
        loss.forward(&out, &batch.y)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    // The probe may panic inside a layer on a shape it cannot take; keep the default hook's
    // report (and backtrace) out of the user's way, and say what did not fit instead.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(probe));
    std::panic::set_hook(hook);
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => bail!("the loss cannot score the model's output on one sample: {e}"),
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "(no message)".into());
            bail!(
                "the model cannot take one sample of the dataset ({input}, {} target(s)): {why}",
                data.targets_per_sample()
            )
        }
    }
}

/// Loads samples `indices` of `data` as a batch: integer inputs checked against the
/// vocabulary and carried as exact f32 values, targets checked by the loss. Errors name the
/// dataset and the sample.
pub(crate) fn load(
    data: &dyn Dataset,
    input: &InputSpec,
    loss: &dyn Loss,
    indices: &[usize],
) -> Result<meshtrain_parallel::Batch> {
    let n = indices.len();
    let per_sample = input.sample_len();
    let tps = data.targets_per_sample();
    let mut y = vec![0u32; n * tps];
    let mut shape = vec![n];
    shape.extend(&input.shape);
    let failed = |e| {
        anyhow!(
            "'{}': loading samples {}: {e}",
            data.name(),
            describe(indices)
        )
    };
    let x = match input.kind {
        InputKind::Float => {
            let mut x = vec![0.0f32; n * per_sample];
            data.fill(
                indices,
                crate::dataset::BatchMut {
                    inputs: Inputs::Float(&mut x),
                    targets: &mut y,
                },
            )
            .map_err(failed)?;
            x
        }
        InputKind::Tokens { vocab } => {
            ensure!(
                vocab <= 1 << 24,
                "vocabulary of {vocab} tokens: ids travel as exact f32 values, at most 2^24"
            );
            let mut ids = vec![0u32; n * per_sample];
            data.fill(
                indices,
                crate::dataset::BatchMut {
                    inputs: Inputs::Tokens(&mut ids),
                    targets: &mut y,
                },
            )
            .map_err(failed)?;
            if let Some(k) = ids.iter().position(|&t| t as usize >= vocab) {
                bail!(
                    "'{}': sample {} holds token id {}, outside the vocabulary of {vocab}",
                    data.name(),
                    indices[k / per_sample.max(1)],
                    ids[k]
                );
            }
            ids.into_iter().map(|t| t as f32).collect()
        }
    };
    if let Err(e) = loss.check_targets(&y) {
        let at = match &e {
            meshtrain_nn::LossError::TargetOutOfRange { index, .. } => {
                format!(" (sample {})", indices[index / tps.max(1)])
            }
            _ => String::new(),
        };
        bail!("'{}'{at}: {e}", data.name());
    }
    Ok(meshtrain_parallel::Batch {
        x: Tensor::from_vec(x, &shape),
        y,
        samples: n,
    })
}

/// A few indices for messages.
fn describe(indices: &[usize]) -> String {
    match indices {
        [] => "(none)".into(),
        [i] => i.to_string(),
        [first, .., last] if indices.len() > 4 => {
            format!("{first}, …, {last} ({} samples)", indices.len())
        }
        _ => format!("{indices:?}"),
    }
}
