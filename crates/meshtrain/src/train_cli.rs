//! The arguments of `meshtrain train`, shared with `meshtrain launch` (which reads the job
//! they describe to size its worlds, then hands them to every restart).

use crate::config::{Config, DEFAULT_SAMPLE_TOKENS};
use crate::generate::{sample_text, Tokenizer, GENERATE_TEMPERATURE, GENERATE_TOP_K};
use crate::presets::Task;
use anyhow::Context;
use meshtrain_nn::generate::Sampling;
use meshtrain_train::launch::EvalHook;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// Config file, e.g. configs/lenet.toml.
    #[arg(long, default_value = "configs/lenet.toml")]
    pub config: PathBuf,
    /// Override a config value: --set train.batch_size=128 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Resume from a checkpoint of the same model (default: none).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// With --resume: go on with another global batch (or a world that needs one) than the
    /// checkpoint's; the optimizer state is kept and the data continue at the same sample
    /// position (docs/checkpoints.md).
    #[arg(long)]
    pub reshape: bool,
    /// Start from a checkpoint's weights with a fresh optimizer at step 0 (fine-tuning; the
    /// checkpoint may come from another model configuration whose tensors match).
    #[arg(long, value_name = "CHECKPOINT", conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    /// A layout, e.g. "dp=2,pp=2,mb=4,schedule=1f1b" or what `meshtrain plan` printed; the
    /// keys it names override the config's (same as --set parallel.layout=...).
    #[arg(long)]
    pub layout: Option<String>,
    /// Data-parallel workers (threads of this process; under mpirun the MPI world size).
    /// Same as --set parallel.dp=N.
    #[arg(long)]
    pub dp: Option<usize>,
    /// How replicas synchronise: ddp (bucketed all-reduce overlapped with backward) or
    /// single-master (scatter / gather to rank 0 / broadcast, like nn.DataParallel).
    #[arg(long, value_parser = ["ddp", "single-master"])]
    pub dp_mode: Option<String>,
    /// Pipeline stages: the model is cut into P stages on P workers (world = dp × tp × pp).
    /// Same as --set parallel.pp=P.
    #[arg(long)]
    pub pp: Option<usize>,
    /// Tensor-parallel workers: each transformer layer (GPT, Llama) is split over T workers
    /// (Megatron-style; world = dp × tp × pp). Same as --set parallel.tp=T; --set
    /// parallel.sequence_parallel=true adds sequence parallelism.
    #[arg(long)]
    pub tp: Option<usize>,
    /// Context-parallel workers: each sequence is spread over C workers (GPT, Llama; world =
    /// dp × tp × pp × cp). Same as --set parallel.cp=C; --set parallel.cp_mode="ulysses"
    /// picks Ulysses over the default ring attention.
    #[arg(long)]
    pub cp: Option<usize>,
    /// Matrix products in fp32, bf16, fp16 or fp8 (mixed precision with f32 master weights;
    /// fp16 adds dynamic loss scaling; fp8 is bf16 with the inner blocks' linear products in
    /// E4M3/E5M2: on GPUs with FP8 tensor cores, and on the CPU as their reference). Same as
    /// --set train.precision=P.
    #[arg(long, value_parser = ["fp32", "bf16", "fp16", "fp8"])]
    pub precision: Option<String>,
    /// Pipeline schedule: gpipe, 1f1b or interleaved[:V] (V chunks per worker, default 2).
    #[arg(long)]
    pub schedule: Option<String>,
    /// Micro-batches per step and data-parallel replica (pipeline runs).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// The Fashion-MNIST directory (its four IDX .gz files), searched before the system
    /// package, the cache and a download. Same as --set data.data_dir=DIR. See
    /// docs/data.md.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Where the step runs: cpu (default), cuda (GPU 0) or cuda:N. Same as --set
    /// train.device="cuda:N". See docs/gpu.md.
    #[arg(long)]
    pub device: Option<String>,
    /// Also write the metrics as TensorBoard event files into DIR (`tensorboard --logdir
    /// DIR`). Same as --set train.tensorboard="DIR".
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Write a Chrome trace of the last step to FILE.json (open it in
    /// https://ui.perfetto.dev) and a PNG of it next to it.
    #[arg(long, value_name = "FILE.json")]
    pub timeline: Option<PathBuf>,
}

impl TrainArgs {
    /// The config overrides these arguments stand for: the `--set` ones, then the ones the
    /// shorthand flags (`--dp`, `--layout`, ...) add.
    pub fn overrides(&self) -> Vec<String> {
        let mut overrides = self.overrides.clone();
        if let Some(dp) = self.dp {
            overrides.push(format!("parallel.dp={dp}"));
        }
        if let Some(mode) = &self.dp_mode {
            overrides.push(format!("parallel.dp_mode=\"{mode}\""));
        }
        if let Some(pp) = self.pp {
            overrides.push(format!("parallel.pp={pp}"));
        }
        if let Some(tp) = self.tp {
            overrides.push(format!("parallel.tp={tp}"));
        }
        if let Some(cp) = self.cp {
            overrides.push(format!("parallel.cp={cp}"));
        }
        if let Some(precision) = &self.precision {
            overrides.push(format!("train.precision={}", toml_string(precision)));
        }
        if let Some(schedule) = &self.schedule {
            overrides.push(format!("parallel.schedule={}", toml_string(schedule)));
        }
        if let Some(m) = self.micro_batches {
            overrides.push(format!("parallel.micro_batches={m}"));
        }
        if let Some(device) = &self.device {
            overrides.push(format!("train.device={}", toml_string(device)));
        }
        if let Some(path) = &self.timeline {
            let path = path.to_string_lossy();
            overrides.push(format!("parallel.timeline={}", toml_string(&path)));
        }
        if let Some(dir) = &self.data_dir {
            let dir = dir.to_string_lossy();
            overrides.push(format!("data.data_dir={}", toml_string(&dir)));
        }
        if let Some(dir) = &self.tensorboard {
            let dir = dir.to_string_lossy();
            overrides.push(format!("train.tensorboard={}", toml_string(&dir)));
        }
        if let Some(layout) = &self.layout {
            overrides.push(format!("parallel.layout={}", toml_string(layout)));
        }
        overrides
    }
}

/// `s` as a TOML string literal (so no value is mistaken for a number or a table).
pub fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// The hook that prints a sample of text at each evaluation of a language-model run
/// (`train.sample_tokens`, default [`DEFAULT_SAMPLE_TOKENS`]; `None` when off or for an
/// image model): on rank 0, the gathered whole model continues the start of a text
/// ([`Tokenizer::start_of_text`]) through the key/value-cache decoder, drawn as `meshtrain
/// generate` draws with its default temperature and top-k and `train.seed`, the same draws
/// at every evaluation so that samples differ by the model alone. The line is
/// `sample: "…"`, the text escaped as a Rust string (newlines as `\n`): one greppable line
/// per evaluation, as the log's other lines are.
///
/// Every worker of a run must get the same answer (the hook makes the evaluation a gather):
/// it depends on the config alone (the task's tokenizer is the config's `data.tokenizer`).
/// Shards whose vocabulary is neither GPT-2's nor cl100k's
/// cannot be decoded: a note says so (on rank 0) and the run has no samples.
pub fn eval_samples(cfg: &Config, task: &Task) -> Option<EvalHook> {
    let tokens = cfg.train.sample_tokens.unwrap_or(DEFAULT_SAMPLE_TOKENS);
    if tokens == 0 || cfg.model.language().is_none() {
        return None;
    }
    // The task has the run's data.tokenizer open already.
    let tokenizer = match &task.tokenizer {
        Some(opened) => Ok(Arc::clone(opened)),
        None => Tokenizer::of_run(cfg).map(Arc::new),
    };
    let tokenizer = match tokenizer {
        Ok(tokenizer) => tokenizer,
        // Shards of a vocabulary generate cannot decode either: the run trains as before.
        Err(e) => {
            if meshtrain_train::lead_process() {
                println!("note: no text samples at evaluation (train.sample_tokens): {e:#}");
            }
            return None;
        }
    };
    let sampling = Sampling {
        temperature: GENERATE_TEMPERATURE,
        top_k: GENERATE_TOP_K,
        seed: cfg.train.seed,
    };
    Some(EvalHook::new(move |_step, model, store| {
        let text = sample_text(model, &store.values, &tokenizer, tokens, sampling)
            .context("drawing a sample")?;
        Ok(Some(format!("sample: {text:?}")))
    }))
}
