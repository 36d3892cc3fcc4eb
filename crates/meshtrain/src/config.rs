//! Training configuration: TOML files with `--set key=value` overrides, validated up front so
//! a typo fails before any work starts, with the offending key in the message. A config is
//! one way to describe a [`Job`] of the `meshtrain-train` library: [`Config::job`] builds it
//! from the built-in models and datasets ([`crate::presets`]).

use crate::presets::{build_model, Task};
use anyhow::{anyhow, bail, Context, Result};
use meshtrain_nn::models::{GptConfig, LeNetVariant, LlamaConfig};
use meshtrain_nn::optim::{OptimizerConfig, ParamGroup, ParamGroups, Selector};
use meshtrain_parallel::context::CpMode;
use meshtrain_parallel::data::{DdpConfig, GradCompression, GradReduce};
use meshtrain_parallel::engine::{ScheduleKind, SendMode};
use meshtrain_parallel::layout::Recompute;
pub use meshtrain_parallel::parallelize::DpMode;
use meshtrain_parallel::pipeline::PartitionSpec;
use meshtrain_parallel::precision::{parse_trainer_precision, LossScaleConfig};
use meshtrain_parallel::zero::ZeroOptions;
use meshtrain_parallel::{DeviceCheck, Layout, ParallelOptions};
use meshtrain_tensor::Device;
use meshtrain_train::{CheckpointFormat, Job, Length, LrSchedule};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    #[serde(default)]
    pub data: DataConfig,
    pub train: TrainConfig,
    pub optimizer: OptimizerConfig,
    pub schedule: ScheduleConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub parallel: ParallelConfig,
    /// Parameter groups: per-group weight decay and learning-rate scale (PyTorch's
    /// `param_groups`), e.g. no weight decay on biases and norms.
    #[serde(default)]
    pub param_groups: Vec<ParamGroupConfig>,
}

/// `[[param_groups]]`: the parameters a group takes and what it changes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamGroupConfig {
    /// Parameter name patterns with `*` wildcards (`"*.bias"`, `"*ln*"`), or `"ndim<2"` /
    /// `"ndim>=2"` on the number of dimensions.
    pub params: Vec<String>,
    /// The group's weight decay (default: the optimizer's).
    #[serde(default)]
    pub weight_decay: Option<f32>,
    /// A factor on the learning rate.
    #[serde(default = "one")]
    pub lr_scale: f32,
}

/// Parallel layout and data-parallel settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    /// Data-parallel workers (threads of this process, or the MPI world under mpirun).
    #[serde(default = "one_usize")]
    pub dp: usize,
    #[serde(default)]
    pub dp_mode: DpMode,
    /// DDP bucket size in MiB (PyTorch: 25).
    #[serde(default = "default_bucket_mb")]
    pub bucket_cap_mb: f64,
    /// DDP's first, small bucket in MiB (PyTorch: 1).
    #[serde(default = "one_f64")]
    pub first_bucket_mb: f64,
    /// Gradients on the wire: "none" (f32) or "bf16".
    #[serde(default)]
    pub compression: GradCompression,
    /// Overlap each bucket's all-reduce with the rest of backward.
    #[serde(default = "yes")]
    pub overlap: bool,
    /// DDP's all-reduce: "auto" (hierarchical when the data-parallel group spans several
    /// hosts with more than one of its ranks on some host), "flat" or "hierarchical"
    /// (inside each host, then across hosts).
    #[serde(default)]
    pub grad_reduce: GradReduce,
    /// Hosts of this many consecutive ranks: simulated hosts on the threads backend; under
    /// mpirun it overrides the detected placement. 0: one host (threads), detected (MPI).
    #[serde(default)]
    pub ranks_per_host: usize,
    /// Batch-norm statistics over the global batch (SyncBatchNorm) instead of per worker.
    #[serde(default)]
    pub sync_batch_norm: bool,
    /// Pipeline stages: the model's blocks are cut into `pp` stages on `pp` workers, and the
    /// world is `dp × tp × pp` workers (see docs/pipeline.md). 1 = no pipeline.
    #[serde(default = "one_usize")]
    pub pp: usize,
    /// Tensor-parallel workers per stage (Megatron-style split layers; GPT only): the world
    /// is `dp × tp × pp`. 1 = none.
    #[serde(default = "one_usize")]
    pub tp: usize,
    /// Context-parallel workers per replica: each sequence is spread over `cp` workers
    /// (GPT only; the world is `dp × tp × pp × cp`). 1 = none. See docs/long-sequences.md.
    #[serde(default = "one_usize")]
    pub cp: usize,
    /// How attention spreads over the context-parallel workers: "ring" (key/value blocks
    /// passed around, overlapped with compute) or "ulysses" (all-to-all to whole sequences of
    /// a share of the heads; needs the heads divisible by tp × cp).
    #[serde(default)]
    pub cp_mode: CpMode,
    /// Sequence parallelism inside tensor parallelism: layer norms and residuals hold each
    /// worker's share of the tokens (needs tp > 1 and the sequence length divisible by tp).
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Pipeline schedule: "gpipe", "1f1b", "interleaved" (2 chunks per worker) or
    /// "interleaved:V".
    #[serde(default = "default_pipeline_schedule")]
    pub schedule: String,
    /// Micro-batches each data-parallel replica's batch is split into (pipeline runs).
    #[serde(default = "one_usize")]
    pub micro_batches: usize,
    /// How blocks are cut into stages: "params" (equal parameter counts), "balanced" (equal
    /// block counts), "time" (equal measured forward + backward time) or "explicit:3,6"
    /// (cut before blocks 3 and 6).
    #[serde(default = "default_partition")]
    pub partition: String,
    /// Pipeline runs: write a Chrome trace of the last training step here (and a PNG of it
    /// next to it).
    #[serde(default)]
    pub timeline: Option<PathBuf>,
    /// How pipeline stages send activations and gradients: "async" (on the communication
    /// thread, overlapping compute when a core is free for it) or "inline" (on the compute
    /// thread; better when the workers already use every core, see docs/pipeline.md).
    #[serde(default = "default_pipeline_sends")]
    pub sends: String,
    /// Tests: place each chunk's state on a stand-in device in host memory, so the device
    /// half of the step (bound views, loss sums on the device, the checkpoint mirror, the
    /// flat arithmetic behind `DeviceState`) runs without a GPU. Results equal the CPU's.
    #[serde(default)]
    pub stand_in_device: bool,
    /// A layout string (`"dp=2,pp=2,mb=4,schedule=1f1b"`, or what `meshtrain plan` prints):
    /// the keys it names override dp, pp, schedule, micro_batches and train.recompute.
    #[serde(default)]
    pub layout: Option<String>,
    /// ZeRO stage over the data-parallel group: 0 = DDP (full replicas), 1 = optimizer state
    /// sharded, 2 = and gradients, 3 = and parameters (FSDP). See docs/zero.md.
    #[serde(default)]
    pub zero: u8,
    /// ZeRO-3: all-gather the next block's parameters while the current one computes.
    #[serde(default = "yes")]
    pub zero_prefetch: bool,
    /// ZeRO-3: free each block's gathered parameters after its forward and gather them again
    /// for backward (FSDP2's default); false keeps them until backward.
    #[serde(default = "yes")]
    pub reshard_after_forward: bool,
    /// Seconds a collective may wait for its peers before every worker fails with the
    /// operation, its sequence number and the missing ranks (default 300;
    /// `MESHTRAIN_TIMEOUT_S` overrides it, e.g. under mpirun).
    #[serde(default)]
    pub timeout_s: Option<f64>,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            dp: 1,
            tp: 1,
            cp: 1,
            cp_mode: CpMode::Ring,
            sequence_parallel: false,
            dp_mode: DpMode::Ddp,
            bucket_cap_mb: default_bucket_mb(),
            first_bucket_mb: 1.0,
            compression: GradCompression::None,
            overlap: true,
            grad_reduce: GradReduce::Auto,
            ranks_per_host: 0,
            sync_batch_norm: false,
            pp: 1,
            schedule: default_pipeline_schedule(),
            micro_batches: 1,
            partition: default_partition(),
            timeline: None,
            sends: default_pipeline_sends(),
            layout: None,
            stand_in_device: false,
            zero: 0,
            zero_prefetch: true,
            reshard_after_forward: true,
            timeout_s: None,
        }
    }
}

fn one_usize() -> usize {
    1
}
fn one_f64() -> f64 {
    1.0
}
fn default_bucket_mb() -> f64 {
    25.0
}
fn yes() -> bool {
    true
}
fn default_pipeline_schedule() -> String {
    "1f1b".into()
}
fn default_pipeline_sends() -> String {
    "async".into()
}
fn default_partition() -> String {
    "params".into()
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ModelConfig {
    Lenet {
        #[serde(default)]
        variant: LeNetVariant,
    },
    Resnet18 {
        /// Width of the first stage (D2L: 64).
        #[serde(default = "default_resnet_width")]
        width: usize,
    },
    Gpt(GptConfig),
    Llama(LlamaConfig),
}

/// What the data and the tokens need to know of a language model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LanguageShape {
    pub vocab: usize,
    /// Tokens per sample.
    pub seq: usize,
}

impl ModelConfig {
    /// The vocabulary and context of a language model (GPT or Llama); `None` for the image
    /// models.
    pub fn language(&self) -> Option<LanguageShape> {
        match self {
            ModelConfig::Gpt(g) => Some(LanguageShape {
                vocab: g.vocab,
                seq: g.seq,
            }),
            ModelConfig::Llama(l) => Some(LanguageShape {
                vocab: l.vocab,
                seq: l.seq,
            }),
            _ => None,
        }
    }

    /// The model's own check of its sizes.
    fn validate(&self) -> Result<()> {
        match self {
            ModelConfig::Gpt(g) => g.validate().map_err(anyhow::Error::msg),
            ModelConfig::Llama(l) => l.validate().map_err(anyhow::Error::msg),
            ModelConfig::Resnet18 { width } if *width == 0 => bail!("model.width must be positive"),
            _ => Ok(()),
        }
    }
}

fn default_resnet_width() -> usize {
    64
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Fashion-MNIST directory (IDX .gz files); default: system package, cache, download,
    /// then the subset shipped in the repository.
    pub data_dir: Option<PathBuf>,
    /// Train on only the first N training images (quick runs, tests).
    pub train_limit: Option<usize>,
    /// Evaluate on only the first N test images.
    pub test_limit: Option<usize>,
    /// GPT: train on these token shards (a glob, e.g. "data/tok/train_*.bin") instead of
    /// the built-in Shakespeare bytes: `meshtrain tokenize`'s output or llm.c's.
    #[serde(default)]
    pub train_files: Option<String>,
    /// GPT: evaluate on these token shards (a glob).
    #[serde(default)]
    pub val_files: Option<String>,
    /// The Hugging Face tokenizer.json the shards were written with (`meshtrain tokenize
    /// --tokenizer`): what the training log's samples and `generate` decode with. Not needed
    /// for GPT-2 or cl100k shards (their vocabulary size names them).
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Global batch size (images, or sequences for GPT).
    pub batch_size: usize,
    /// Image models train for whole epochs...
    #[serde(default)]
    pub epochs: Option<u64>,
    /// ...GPT trains for a number of steps (random windows of the corpus). Given both, the
    /// steps win (and the run says so).
    #[serde(default)]
    pub steps: Option<u64>,
    #[serde(default)]
    pub seed: u64,
    /// Intra-op threads (default: all cores).
    #[serde(default)]
    pub threads: Option<usize>,
    /// Clip the global gradient norm to this value.
    #[serde(default)]
    pub grad_clip: Option<f32>,
    /// Print/log metrics every N steps.
    #[serde(default = "default_log_every")]
    pub log_every: u64,
    /// GPT: evaluate every N steps (image models evaluate after each epoch).
    #[serde(default)]
    pub eval_every: Option<u64>,
    /// GPT: validation batches per evaluation.
    #[serde(default = "default_eval_batches")]
    pub eval_batches: usize,
    /// Language models: at each evaluation, rank 0 prints a sample of this many tokens
    /// continuing the start of a text (a newline for bytes, the end-of-text token for a BPE),
    /// drawn as `meshtrain generate` draws with its default temperature and top-k and
    /// `train.seed`: the last sample is what `generate` prints from the final checkpoint.
    /// 0 turns it off; default [`DEFAULT_SAMPLE_TOKENS`] (image models: must be left out
    /// or 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_tokens: Option<usize>,
    /// Where metrics, checkpoints and plots go.
    #[serde(default = "default_out_dir")]
    pub out_dir: PathBuf,
    /// Stop after this many steps (for tests and resume checks); the schedule is unchanged.
    #[serde(default)]
    pub max_steps: Option<u64>,
    /// Activation checkpointing: keep only each block's input and recompute its activations
    /// in backward (less memory, about one extra forward of compute).
    #[serde(default)]
    pub recompute: bool,
    /// Gradient accumulation: each worker splits its share of the batch into this many
    /// micro-batches and synchronises gradients only after the last one.
    #[serde(default = "one_usize")]
    pub accumulation_steps: usize,
    /// Matrix products' inputs: "fp32", "bf16", "fp16" or "fp8" (mixed precision: f32 master
    /// weights, optimizer, reductions and norms; fp16 with dynamic loss scaling; fp8 is bf16
    /// with the inner blocks' linear products in FP8: Ada/Hopper GPUs, or the CPU as their
    /// reference). See docs/precision.md.
    #[serde(default = "default_precision")]
    pub precision: String,
    /// fp16's dynamic loss scale (PyTorch GradScaler's defaults: init_scale = 65536,
    /// growth_factor = 2, backoff_factor = 0.5, growth_interval = 2000).
    #[serde(default)]
    pub loss_scale: LossScaleConfig,
    /// Refuse to start when a worker's model states (parameters, gradients, optimizer
    /// state, as the planner's ZeRO formula predicts them for the layout) exceed this many
    /// MiB; the error names both figures and the ZeRO stages that would fit.
    #[serde(default)]
    pub memory_limit_mb: Option<f64>,
    /// "auto" (sharded under ZeRO, one file otherwise), "whole" (`checkpoint.safetensors`,
    /// gathered on rank 0) or "sharded" (`checkpoint/`: every worker writes its pieces and
    /// an index; loads into any layout). See docs/zero.md.
    #[serde(default)]
    pub checkpoint_format: CheckpointFormat,
    /// Write the every-N-steps checkpoints from an in-memory snapshot on a background
    /// thread, so training does not wait for the disk (false: write them synchronously).
    #[serde(default = "yes")]
    pub checkpoint_background: bool,
    /// Where the step runs: "cpu" (the default), "cuda" (GPU 0) or "cuda:N". See docs/gpu.md.
    #[serde(default)]
    pub device: Device,
    /// Also write the metrics as TensorBoard event files into this directory
    /// (`tensorboard --logdir DIR`).
    #[serde(default)]
    pub tensorboard: Option<PathBuf>,
    /// On a GPU, let f32 matrix products use TF32 tensor cores (~7x faster, ~1e-3 relative
    /// error; PyTorch's `allow_tf32`). Off by default: f32 means f32.
    #[serde(default)]
    pub tf32: bool,
    /// On a GPU, capture the training step as CUDA graphs after two eager steps and replay
    /// them (a few launches a step instead of hundreds: for small models, whose steps are
    /// bound by launches). One worker, no fp16 loss scaling; a step that differs from the
    /// captured one runs eagerly, and the run says why. See docs/gpu.md.
    #[serde(default)]
    pub cuda_graph: bool,
}

fn default_precision() -> String {
    "fp32".into()
}

fn default_log_every() -> u64 {
    20
}
fn default_eval_batches() -> usize {
    20
}

/// Tokens of the sample a language-model run prints at each evaluation unless
/// `train.sample_tokens` says otherwise: a couple of lines of text, enough to see what the
/// model writes, and milliseconds to decode for the models a CPU trains.
pub const DEFAULT_SAMPLE_TOKENS: usize = 64;

fn default_out_dir() -> PathBuf {
    PathBuf::from("runs/latest")
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    pub lr: f32,
    #[serde(default)]
    pub warmup_steps: u64,
    /// Cosine decay floor as a fraction of `lr` (1.0 = constant after warm-up).
    #[serde(default = "one")]
    pub min_lr_fraction: f32,
    /// Linear scaling rule: `lr` is for this batch size and scales with the global batch.
    #[serde(default)]
    pub reference_batch: Option<usize>,
}

fn one() -> f32 {
    1.0
}

fn default_checkpoint_minutes() -> f64 {
    meshtrain_train::DEFAULT_CHECKPOINT_MINUTES
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            every_steps: None,
            every_minutes: default_checkpoint_minutes(),
            resume: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Save every N steps (0 or absent: only at the end).
    #[serde(default)]
    pub every_steps: Option<u64>,
    /// Also save when this many minutes have passed since the last checkpoint (default 10;
    /// 0: only `every_steps` and the end), so a long run is never lost whole. Written in the
    /// background like `every_steps`.
    #[serde(default = "default_checkpoint_minutes")]
    pub every_minutes: f64,
    /// Resume from this checkpoint file.
    #[serde(default)]
    pub resume: Option<PathBuf>,
}

impl Config {
    /// Parse TOML text, apply `key=value` overrides (dotted keys, TOML values; bare words are
    /// taken as strings), and validate.
    pub fn from_toml_with_overrides(text: &str, overrides: &[String]) -> Result<Config> {
        let mut value: toml::Value = toml::from_str(text).context("config is not valid TOML")?;
        for o in overrides {
            apply_override(&mut value, o)?;
        }
        let cfg: Config = value.try_into().map_err(|e: toml::de::Error| {
            anyhow::anyhow!("invalid config: {}", e.to_string().trim())
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn load(path: &Path, overrides: &[String]) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        // The value at fault may be the file's or the command line's (--set, --device, …):
        // name both.
        Self::from_toml_with_overrides(&text, overrides).with_context(|| match overrides {
            [] => format!("in config {}", path.display()),
            _ => format!(
                "in config {} with the command line's {}",
                path.display(),
                overrides.join(" ")
            ),
        })
    }

    pub fn validate(&self) -> Result<()> {
        let t = &self.train;
        if t.batch_size == 0 {
            bail!("train.batch_size must be at least 1");
        }
        if t.threads == Some(0) {
            bail!("train.threads must be at least 1");
        }
        self.model.validate()?;
        match self.model.language() {
            Some(lm) => {
                if t.steps.is_none() {
                    bail!("language models train for train.steps");
                }
                if lm.vocab < 256 && self.data.train_files.is_none() {
                    bail!(
                        "without data.train_files a language model trains on bytes: \
                         model.vocab must be at least 256, got {}",
                        lm.vocab
                    );
                }
            }
            None => {
                if t.epochs.is_none() && t.steps.is_none() {
                    bail!("image models need train.epochs (or train.steps)");
                }
                if let Some(n) = t.sample_tokens.filter(|&n| n > 0) {
                    bail!(
                        "train.sample_tokens = {n}: samples of text are for language models \
                         (GPT, Llama); leave it out for an image model"
                    );
                }
            }
        }
        if t.steps == Some(0) {
            bail!("train.steps must be at least 1");
        }
        if t.epochs == Some(0) && t.steps.is_none() {
            bail!("train.epochs must be at least 1");
        }
        if t.max_steps == Some(0) {
            bail!("train.max_steps must be at least 1");
        }
        if !(self.schedule.lr > 0.0 && self.schedule.lr.is_finite()) {
            bail!(
                "schedule.lr must be a positive number, got {}",
                self.schedule.lr
            );
        }
        if !(0.0..=1.0).contains(&self.schedule.min_lr_fraction) {
            bail!("schedule.min_lr_fraction must be in [0, 1]");
        }
        if t.log_every == 0 {
            bail!("train.log_every must be at least 1");
        }
        let minutes = self.checkpoint.every_minutes;
        if !(minutes.is_finite() && minutes >= 0.0) {
            bail!(
                "checkpoint.every_minutes must be a number of minutes ≥ 0 (0: off), not {minutes}"
            );
        }
        let p = &self.parallel;
        if p.dp == 0 {
            bail!("parallel.dp must be at least 1");
        }
        if p.pp == 0 {
            bail!("parallel.pp must be at least 1");
        }
        if p.tp == 0 {
            bail!("parallel.tp must be at least 1");
        }
        if p.cp == 0 {
            bail!("parallel.cp must be at least 1");
        }
        if t.accumulation_steps == 0 {
            bail!("train.accumulation_steps must be at least 1");
        }
        // Checked again where the scaler is built (library users); here before any data loads.
        t.loss_scale
            .check()
            .map_err(|e| anyhow!("train.loss_scale: {e}"))?;
        if let Some(limit) = t.memory_limit_mb.filter(|l| !(l.is_finite() && *l > 0.0)) {
            bail!("train.memory_limit_mb must be a positive number of MiB, not {limit}");
        }
        if self.parallel.zero > 3 {
            bail!(
                "parallel.zero must be 0 (DDP), 1, 2 or 3, not {}",
                self.parallel.zero
            );
        }
        if p.micro_batches == 0 {
            bail!("parallel.micro_batches must be at least 1");
        }
        if !(p.bucket_cap_mb > 0.0 && p.first_bucket_mb > 0.0) {
            bail!("parallel.bucket_cap_mb and parallel.first_bucket_mb must be positive");
        }
        if let Some(s) = p.timeout_s {
            if !(s.is_finite() && s > 0.0) {
                bail!("parallel.timeout_s must be a positive number of seconds, got {s}");
            }
        }
        self.param_groups()
            .validate()
            .map_err(|e| anyhow!("param_groups: {e}"))?;
        let options = self.parallel_options()?;
        let layout = self.layout()?;
        let model = build_model(&self.model);
        let resolved = layout
            .resolve(layout.world_size(), t.batch_size, &model)
            .with_context(|| format!("layout {layout}"))?;
        options.partition.check(
            model.num_blocks(),
            resolved.schedule.num_chunks(),
            resolved.layout.tp * resolved.layout.cp,
        )?;
        let l = &resolved.layout;
        meshtrain_parallel::context::check(&model, l.cp, options.cp_mode, options.dp_mode, l.tp)
            .with_context(|| format!("parallel.cp_mode = \"{}\"", options.cp_mode))?;
        Ok(())
    }

    /// Whether this machine can run the config's model on its `train.device` under `layout`
    /// (the config's own, or the one a launcher is about to start), asked before the data
    /// loads: it needs the model and the layout only ([`meshtrain_parallel::check_device`]).
    /// A run on the CPU always can.
    pub fn check_device(&self, layout: &Layout, how: DeviceCheck) -> Result<()> {
        if self.train.device.is_cpu() {
            return Ok(());
        }
        let model = build_model(&self.model);
        meshtrain_parallel::check_device(&model, layout, self.train.device, how)?;
        Ok(())
    }

    /// The run's layout: dp, pp, the schedule, micro-batches (`parallel.micro_batches`, or
    /// without a pipeline `train.accumulation_steps`, which is the same thing on one stage)
    /// and recomputation, then whatever `parallel.layout` names on top.
    pub fn layout(&self) -> Result<Layout> {
        let (p, t) = (&self.parallel, &self.train);
        if p.pp > 1 && t.accumulation_steps != 1 {
            bail!(
                "train.accumulation_steps={} does not combine with a pipeline: \
                 parallel.micro_batches already splits each replica's batch",
                t.accumulation_steps
            );
        }
        if t.accumulation_steps > 1
            && p.micro_batches > 1
            && t.accumulation_steps != p.micro_batches
        {
            bail!(
                "train.accumulation_steps={} and parallel.micro_batches={} both split each \
                 replica's batch: set one of them",
                t.accumulation_steps,
                p.micro_batches
            );
        }
        let base = Layout {
            dp: p.dp,
            pp: p.pp,
            tp: p.tp,
            cp: p.cp,
            sp: p.sequence_parallel,
            schedule: p
                .schedule
                .parse::<ScheduleKind>()
                .map_err(|e| anyhow!("parallel.schedule: {e}"))?,
            micro_batches: Some(t.accumulation_steps.max(p.micro_batches)),
            recompute: if t.recompute {
                Recompute::Full
            } else {
                Recompute::None
            },
            precision: parse_trainer_precision(&t.precision)
                .map_err(|e| anyhow!("train.precision: {e}"))?,
            zero: p.zero,
            ..Layout::default()
        };
        match &p.layout {
            None => Ok(base),
            Some(text) => Ok(Layout::parse_onto(base, text)?),
        }
    }

    /// The parallel modules' settings besides the layout.
    pub fn parallel_options(&self) -> Result<ParallelOptions> {
        let p = &self.parallel;
        Ok(ParallelOptions {
            dp_mode: p.dp_mode,
            ddp: DdpConfig {
                bucket_cap_mb: p.bucket_cap_mb,
                first_bucket_mb: p.first_bucket_mb,
                compression: p.compression,
                overlap: p.overlap,
                reduce: p.grad_reduce,
            },
            sync_batch_norm: p.sync_batch_norm,
            partition: p
                .partition
                .parse::<PartitionSpec>()
                .map_err(|e| anyhow!("parallel.{e}"))?,
            sends: match p.sends.as_str() {
                "async" => SendMode::Async,
                "inline" => SendMode::Inline,
                other => bail!("unknown parallel.sends '{other}' (expected async or inline)"),
            },
            skip_sequence_parallel_grad_sum: false,
            loss_scale: self.train.loss_scale,
            inject_overflow: None,
            zero: ZeroOptions {
                prefetch: p.zero_prefetch,
                reshard_after_forward: p.reshard_after_forward,
            },
            memory_limit_mb: self.train.memory_limit_mb,
            device: self.train.device,
            stand_in_device: self.parallel.stand_in_device,
            tf32: self.train.tf32,
            cuda_graph: self.train.cuda_graph,
            cp_mode: p.cp_mode,
            ranks_per_host: p.ranks_per_host,
        })
    }

    pub fn param_groups(&self) -> ParamGroups {
        ParamGroups {
            groups: self
                .param_groups
                .iter()
                .map(|g| ParamGroup {
                    select: Selector::Patterns(g.params.clone()),
                    weight_decay: g.weight_decay,
                    lr_scale: g.lr_scale,
                })
                .collect(),
        }
    }

    /// Things the run should say about how it read the config.
    pub fn notices(&self) -> Vec<String> {
        let t = &self.train;
        match (t.epochs, t.steps) {
            (Some(e), Some(s)) => vec![format!(
                "train.steps={s} sets the run's length; train.epochs={e} is not used"
            )],
            _ => Vec::new(),
        }
    }

    /// What the checkpoint stores to recognise the model (the `[model]` table), without the
    /// attention kernel: the kernels compute the same function, so a checkpoint trained with
    /// one resumes with the other.
    pub fn model_description(&self) -> String {
        let mut model = self.model.clone();
        match &mut model {
            ModelConfig::Gpt(gpt) => gpt.attention = Default::default(),
            ModelConfig::Llama(llama) => llama.attention = Default::default(),
            _ => {}
        }
        toml::to_string(&model).unwrap_or_default()
    }

    /// The library job this config describes, on `task`'s data.
    pub fn job(&self, task: &Task) -> Result<Job> {
        let (t, s) = (&self.train, &self.schedule);
        let model_cfg = self.model.clone();
        let mut job = Job::new(
            move || build_model(&model_cfg),
            task.train.clone(),
            task.loss.clone(),
        )
        .sampling(task.sampling)
        .optimizer(self.optimizer)
        .param_groups(self.param_groups())
        .lr(LrSchedule {
            lr: s.lr,
            warmup_steps: s.warmup_steps,
            min_lr_fraction: s.min_lr_fraction,
            reference_batch: s.reference_batch,
        })
        .batch_size(t.batch_size)
        .seed(t.seed)
        .log_every(t.log_every)
        .out_dir(t.out_dir.clone())
        .layout(self.layout()?)
        .parallel(self.parallel_options()?)
        .describe_model(self.model_description());
        job.length = match (t.steps, t.epochs) {
            (Some(s), _) => Length::Steps(s),
            (None, Some(e)) => Length::Epochs(e),
            (None, None) => bail!("the config gives neither train.steps nor train.epochs"),
        };
        job.eval = task.eval.clone().map(|mut e| {
            if let meshtrain_train::EvalPlan::Random {
                batches,
                batch_size,
                ..
            } = &mut e.plan
            {
                *batches = t.eval_batches.max(1);
                *batch_size = t.batch_size;
            }
            e
        });
        job.max_steps = t.max_steps;
        job.checkpoint_format = t.checkpoint_format;
        job.threads = t.threads;
        job.grad_clip = t.grad_clip;
        job.eval_every = t.eval_every;
        job.checkpoint_every = self.checkpoint.every_steps;
        job.checkpoint_every_minutes = Some(self.checkpoint.every_minutes).filter(|&m| m != 0.0);
        job.checkpoint_background = t.checkpoint_background;
        job.timeline = self.parallel.timeline.clone();
        job.tensorboard = t.tensorboard.clone();
        if let Some(secs) = self.parallel.timeout_s {
            job.timeout = Duration::from_secs_f64(secs);
        }
        job.config_text = toml::to_string(self).unwrap_or_default();
        Ok(job)
    }
}

fn apply_override(root: &mut toml::Value, assignment: &str) -> Result<()> {
    let (key, raw) = assignment
        .split_once('=')
        .with_context(|| format!("override '{assignment}' is not key=value"))?;
    let value: toml::Value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let mut node = root;
    let parts: Vec<&str> = key.trim().split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let table = node
            .as_table_mut()
            .with_context(|| format!("override '{key}': '{part}' is inside a non-table value"))?;
        if i + 1 == parts.len() {
            table.insert(part.to_string(), value);
            return Ok(());
        }
        node = table
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()));
    }
    bail!("empty override key in '{assignment}'")
}

#[cfg(test)]
mod tests {
    use super::*;

    const LENET: &str = r#"
        [model]
        kind = "lenet"
        [train]
        batch_size = 256
        epochs = 1
        [optimizer]
        kind = "sgd"
        momentum = 0.9
        weight_decay = 0.0
        [schedule]
        lr = 0.1
    "#;

    #[test]
    fn overrides_change_nested_values_and_types() {
        let cfg = Config::from_toml_with_overrides(
            LENET,
            &[
                "train.batch_size=64".into(),
                "model.variant=relu".into(),
                "schedule.lr=0.05".into(),
            ],
        )
        .unwrap();
        assert_eq!(cfg.train.batch_size, 64);
        assert_eq!(
            cfg.model,
            ModelConfig::Lenet {
                variant: LeNetVariant::Relu
            }
        );
        assert_eq!(cfg.schedule.lr, 0.05);
    }

    #[test]
    fn bad_configs_get_clear_errors() {
        let err = |o: &[&str]| {
            let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
            format!(
                "{:#}",
                Config::from_toml_with_overrides(LENET, &o).unwrap_err()
            )
        };
        assert!(err(&["train.batch_sise=3"]).contains("batch_sise"));
        assert!(err(&["train.batch_size=0"]).contains("batch_size"));
        assert!(err(&["schedule.lr=-1"]).contains("lr"));
        assert!(err(&["model.kind=vgg"]).contains("vgg"));
        assert!(err(&["nonsense"]).contains("key=value"));
        assert!(err(&["parallel.dp=3"]).contains("divide evenly"));
        assert!(err(&["parallel.dp=0"]).contains("parallel.dp"));
        assert!(err(&["parallel.dp_mode=magic"]).contains("magic"));
        assert!(err(&["parallel.compression=fp8"]).contains("fp8"));
        assert!(err(&["train.loss_scale.backoff_factor=1.5"]).contains("train.loss_scale"));
        assert!(err(&["train.memory_limit_mb=-4"]).contains("positive number of MiB"));
        assert!(err(&["parallel.zero=4"]).contains("parallel.zero must be 0"));
        let gpt = r#"
            [model]
            kind = "gpt"
            vocab = 256
            dim = 30
            layers = 1
            heads = 4
            seq = 8
            [train]
            batch_size = 2
            steps = 1
            [optimizer]
            kind = "adamw"
            beta1 = 0.9
            beta2 = 0.95
            eps = 1e-8
            weight_decay = 0.1
            [schedule]
            lr = 0.001
        "#;
        let e = format!(
            "{:#}",
            Config::from_toml_with_overrides(gpt, &[]).unwrap_err()
        );
        assert!(e.contains("not divisible by heads"), "{e}");
    }
}
