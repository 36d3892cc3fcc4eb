//! The `meshtrain` command.

use anyhow::Result;
use clap::{Parser, Subcommand};
use meshtrain::bench::{run_models, BenchModelsArgs};
use meshtrain::config::Config;
use meshtrain::presets::Task;
use meshtrain::train_cli::TrainArgs;
use meshtrain_parallel::DeviceCheck;
use meshtrain_train::{stop, RunOptions, StopRequest};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "meshtrain",
    version,
    about = "Train neural networks across many workers (data, tensor, pipeline and context parallelism, ZeRO)",
    long_about = "meshtrain trains LeNet, ResNet-18, GPT and Llama models (or your own, as a library) on \
                  CPU cores or GPUs, one worker or many, and tells you where the step time goes.\n\nStart with:\n  meshtrain train --config configs/lenet.toml\n\
                  Override any config value with --set, e.g. --set train.epochs=1 --set schedule.lr=0.05"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model from a TOML config (see configs/).
    Train(TrainArgs),
    /// Benchmarks: models, collectives, scaling (data parallelism), calibrate (the planner),
    /// pipeline, tensor, precision, zero, context (long sequences), gpu.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Recommend a parallel layout (DP×TP×PP×SP, ZeRO, micro-batches, precision) for a model
    /// and a cluster, with predicted memory, time and bottleneck.
    Plan(meshtrain_plan::cli::PlanArgs),
    /// Draw a run's training curves (loss, accuracy or unigram baseline) into a PNG.
    Plot(meshtrain::plot::PlotArgs),
    /// Run a training job under mpirun and restart it from its last checkpoint when a
    /// worker dies, hangs or loses its link (same world or a smaller one; any other failure
    /// ends it at once): `meshtrain launch --np 4 --max-restarts 2 -- --config
    /// configs/gpt.toml`, or one process per GPU of this machine: `meshtrain launch --gpus 4
    /// -- --config configs/gpt.toml`.
    Launch(meshtrain::launch::LaunchArgs),
    /// Text from a trained GPT or Llama checkpoint, streamed as it comes:
    /// `meshtrain generate --checkpoint runs/gpt/checkpoint.safetensors --prompt "ROMEO:"`.
    Generate(meshtrain::generate::GenerateArgs),
    /// Write a GPT or Llama checkpoint (Llama's Mistral, Qwen2 and Qwen3 variants included) as
    /// a Hugging Face transformers model directory (config.json + model.safetensors, with
    /// tokenizer.json, tokenizer_config.json and generation_config.json when the run's
    /// tokenizer is known): `meshtrain export --checkpoint runs/llama/checkpoint.safetensors
    /// --format hf --out hf-model`. `train --init-from DIR` reads such a directory back (yours,
    /// or downloaded GPT-2, Llama, Mistral, Qwen2/Qwen2.5, Qwen3 or SmolLM weights).
    Export(meshtrain::export::ExportArgs),
    /// Turn documents into token shards (llm.c's file format) to train on with
    /// data.train_files: plain text, JSON lines or Parquet, gzip- or zstd-compressed or not,
    /// files, directories or globs; GPT-2 or cl100k BPE, or your own tokenizer.json
    /// (--tokenizer): `meshtrain tokenize --input corpus.txt --out data/tok`.
    Tokenize(meshtrain::tokenize::TokenizeArgs),
    /// Inspect checkpoints, or join sharded ones (written under ZeRO, or with
    /// train.checkpoint_format = "sharded") into one file.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// What a checkpoint holds: step, model, tensors (a sharded one: its layout and shard
    /// files too).
    Info {
        /// A checkpoint.safetensors, a sharded checkpoint's directory (or its index.json), or
        /// a run directory holding either.
        path: PathBuf,
    },
    /// Join a sharded checkpoint into one checkpoint.safetensors (the format every run
    /// resumes from), streaming and in parallel.
    Consolidate {
        /// The checkpoint directory (or its index.json).
        path: PathBuf,
        /// The file to write, e.g. checkpoint.safetensors.
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Single-worker training throughput of LeNet, ResNet-18 and GPT on synthetic batches.
    Models(BenchModelsArgs),
    /// Collective latency and bandwidth (algbw/busbw) per backend, against memcpy.
    Collectives(meshtrain_comm::bench::BenchCollectivesArgs),
    /// Data-parallel throughput for 1, 2 and 4 workers with the step-time breakdown
    /// (compute, communication exposed and hidden, data) that explains it.
    Scaling(meshtrain::scaling::BenchScalingArgs),
    /// The planner's predictions for this machine (from measured FLOP/s, bandwidth, latency
    /// and per-op cost) against measured data-parallel runs of the built-in models.
    Calibrate(meshtrain::calibrate::BenchCalibrateArgs),
    /// Pipeline parallelism: bubble per schedule, activation memory, equivalence with one
    /// worker, and GPT throughput pp=2 vs dp=2 vs one worker.
    Pipeline(meshtrain::pipeline_bench::BenchPipelineArgs),
    /// Tensor and sequence parallelism on GPT: communication and activation memory per layer
    /// against the formulas, and throughput tp = 2 vs dp = 2 vs one worker.
    Tensor(meshtrain::tensor_bench::BenchTensorArgs),
    /// Mixed precision: f32 against bf16 products (every bf16 kernel of this CPU) and whole
    /// training steps of the built-in models per precision.
    Precision(meshtrain::precision_bench::BenchPrecisionArgs),
    /// ZeRO stages 0–3 on GPT: model-state memory per worker against the planner's formula,
    /// traffic per step against 2Ψ/3Ψ, ZeRO-3 throughput with and without prefetching, and
    /// consolidating a large sharded checkpoint.
    Zero(meshtrain::zero_bench::BenchZeroArgs),
    /// Long sequences: memory-efficient attention against the probability-keeping kernel
    /// (GFLOP/s, memory at seq 512…8192), context parallelism's activation memory per
    /// worker, a GPT over a memory limit trained at cp = 4, ring vs Ulysses at cp = 2.
    Context(meshtrain::context_bench::BenchContextArgs),
    /// The CUDA backend on this machine's GPU (--parts): every kernel against its CPU twin and
    /// 20 GPT and Llama steps against the CPU, several ranks and parallel layouts on the
    /// GPU(s), LeNet and ResNet-18 against the CPU, products against cuBLASLt's best
    /// algorithm, kernels' bandwidth against a copy, attention, and the GPT-2 124M or Llama
    /// 1B-shaped step in tokens/s with its per-kernel time.
    #[cfg(feature = "cuda")]
    Gpu(meshtrain::gpu_bench::BenchGpuArgs),
}

/// The `tokenizer.json` of a Hugging Face model directory given to `--init-from`, if it has
/// one.
fn tokenizer_beside_weights(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    let path = dir.join("tokenizer.json");
    (dir.is_dir() && path.is_file()).then_some(path)
}

fn train(args: &TrainArgs) -> Result<ExitCode> {
    // First, so that a Ctrl-C while the data loads is a stop after the first step, not a
    // kill.
    let stop = StopRequest::on_signals()?;
    let overrides = args.overrides();
    let mut cfg = Config::load(&args.config, &overrides)?;
    // Under a launcher, every process of a host takes the GPU of its local rank.
    cfg.train.device =
        meshtrain_train::local_device(cfg.train.device, |name| std::env::var(name).ok())?;
    // Before the data loads and anything is written: a GPU the machine does not have, or
    // cannot run this layout or model on, is said at once.
    cfg.check_device(&cfg.layout()?, DeviceCheck::Opening)?;
    let from_dir = args.init_from.as_deref().and_then(tokenizer_beside_weights);
    if let (Some(path), None) = (from_dir, &cfg.data.tokenizer) {
        // The tokenizer that came with the weights decodes the samples, and generate
        // later (the run config keeps it), unless the config names one.
        if meshtrain_train::lead_process() {
            println!(
                "note: decoding with {} (the --init-from directory's tokenizer; \
                 data.tokenizer names another)",
                path.display()
            );
        }
        cfg.data.tokenizer = Some(path);
    }
    let task = Task::load(&cfg)?;
    let job = cfg.job(&task)?;
    let resume = args.resume.clone().or(cfg.checkpoint.resume.clone());
    anyhow::ensure!(
        resume.is_some() || !args.reshape,
        "--reshape changes the batch of a resumed run: give the checkpoint with --resume"
    );
    let options = RunOptions {
        resume,
        reshape: args.reshape,
        init_from: args.init_from.clone(),
        show_progress: std::io::stderr().is_terminal(),
        verbose: true,
        stop: Some(stop.clone()),
        command_line: Some(std::env::args().collect()),
        after_eval: meshtrain::train_cli::eval_samples(&cfg, &task),
    };
    let lead = meshtrain_train::lead_process();
    if lead {
        println!("meshtrain: {}", task.source);
        for notice in cfg.notices().into_iter().chain(job.notices()) {
            println!("note: {notice}");
        }
        announce_stop_requests(stop);
    }
    let summary = job.run(&options)?;
    // The trainer said where the checkpoint is and how to resume.
    if let Some(stopped) = &summary.stopped {
        return Ok(ExitCode::from(stop::exit_status(stopped.signal) as u8));
    }
    if summary.rank != 0 {
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "done: {} steps, final train loss {:.4}",
        summary.steps, summary.final_train_loss
    );
    if let Some(acc) = summary.test_accuracy {
        println!("test accuracy {:.2}%", acc * 100.0);
    }
    if let (Some(l), Some(b)) = (summary.eval_loss, summary.unigram_baseline) {
        println!("validation loss {l:.4} nats/token vs unigram baseline {b:.4}");
    }
    println!("throughput {:.1} samples/s", summary.samples_per_s);
    println!("{}", summary.breakdown.report());
    println!("{}", summary.memory.report());
    if let Some(rss) = summary.peak_rss_mb {
        println!("peak memory {rss:.0} MiB (the largest process)");
    }
    Ok(ExitCode::SUCCESS)
}

/// Says at once that a signal was heard (the loop acts on it only after the step in flight,
/// which can take a while), from a thread that watches the request.
fn announce_stop_requests(stop: StopRequest) {
    std::thread::spawn(move || loop {
        if let Some(signal) = stop.requested() {
            let again = if signal == stop::SIGUSR1 {
                String::new()
            } else {
                format!(" ({} again aborts at once)", stop::signal_name(signal))
            };
            eprintln!(
                "{}: finishing the step in flight, then saving a checkpoint{again}",
                stop::signal_name(signal)
            );
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    });
}

/// Errors are the user's to read (a bad config, a missing file, a dead worker): print the
/// message and its causes, never the stack trace that returning `Err` from `main` would add
/// whenever RUST_BACKTRACE is set. Panics keep their backtraces.
fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        // Under mpirun, this fault was printed once already.
        Err(e) if e.is::<meshtrain_train::ReportedElsewhere>() => ExitCode::FAILURE,
        Err(e) => {
            meshtrain_train::print_error(&e);
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: logs redirected to a file stay plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    // A fusion switch the kernels would not understand is refused before any work.
    #[cfg(feature = "cuda")]
    meshtrain_tensor::cuda::ops::fusion_setting(std::env::var("MESHTRAIN_FUSION").ok().as_deref())
        .map_err(anyhow::Error::msg)?;
    let done = match cli.command {
        Command::Train(a) => return train(&a),
        Command::Launch(a) => return meshtrain::launch::run(&a),
        Command::Bench(BenchCommand::Models(a)) => run_models(&a),
        Command::Bench(BenchCommand::Collectives(a)) => meshtrain_comm::bench::run_bench(a),
        Command::Bench(BenchCommand::Scaling(a)) => meshtrain::scaling::run_scaling(&a).map(|_| ()),
        Command::Bench(BenchCommand::Calibrate(a)) => meshtrain::calibrate::run_calibrate(&a),
        Command::Bench(BenchCommand::Pipeline(a)) => meshtrain::pipeline_bench::run(&a),
        Command::Bench(BenchCommand::Tensor(a)) => meshtrain::tensor_bench::run(&a),
        Command::Bench(BenchCommand::Precision(a)) => meshtrain::precision_bench::run(&a),
        Command::Bench(BenchCommand::Zero(a)) => meshtrain::zero_bench::run(&a),
        Command::Bench(BenchCommand::Context(a)) => meshtrain::context_bench::run(&a),
        #[cfg(feature = "cuda")]
        Command::Bench(BenchCommand::Gpu(a)) => meshtrain::gpu_bench::run(&a),
        Command::Plan(a) => meshtrain_plan::cli::run(&a),
        Command::Plot(a) => meshtrain::plot::run(&a),
        Command::Checkpoint(c) => checkpoint(c),
        Command::Tokenize(a) => meshtrain::tokenize::run(&a),
        Command::Generate(a) => meshtrain::generate::run(&a),
        Command::Export(a) => meshtrain::export::run(&a),
    };
    done.map(|()| ExitCode::SUCCESS)
}

/// The checkpoint a path given to `checkpoint info` means: itself, or in a run directory its
/// `checkpoint.safetensors` or `checkpoint/` (sharded).
fn checkpoint_in(path: &std::path::Path) -> std::path::PathBuf {
    if path.is_dir() && !path.join("index.json").is_file() {
        for inside in ["checkpoint.safetensors", "checkpoint"] {
            if path.join(inside).exists() {
                return path.join(inside);
            }
        }
    }
    path.to_path_buf()
}

fn checkpoint(command: CheckpointCommand) -> Result<()> {
    use meshtrain_train::sharded::{consolidate, describe, is_sharded, ShardedCheckpoint};
    if let CheckpointCommand::Info { path } = &command {
        let path = checkpoint_in(path);
        if !is_sharded(&path) {
            print!("{}", meshtrain_train::checkpoint::describe_file(&path)?);
            return Ok(());
        }
    }
    let path = match &command {
        CheckpointCommand::Info { path } | CheckpointCommand::Consolidate { path, .. } => path,
    };
    if !is_sharded(path) {
        anyhow::bail!(
            "{} is not a sharded checkpoint (a directory holding index.json); a \
             checkpoint.safetensors is already whole",
            path.display()
        );
    }
    match command {
        CheckpointCommand::Info { path } => {
            print!(
                "{}",
                describe(&ShardedCheckpoint::open(&checkpoint_in(&path))?)
            );
        }
        CheckpointCommand::Consolidate { path, out } => {
            let bar = if std::io::stderr().is_terminal() {
                indicatif::ProgressBar::new(0)
            } else {
                indicatif::ProgressBar::hidden()
            };
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:30} {bytes}/{total_bytes} [{elapsed_precise}<{eta_precise}] {bytes_per_sec}",
                )
                .expect("a valid template"),
            );
            let report = consolidate(&path, &out, &|done, total| {
                bar.set_length(total);
                bar.set_position(done);
            })?;
            bar.finish_and_clear();
            println!(
                "wrote {} ({:.1} MiB) from {} ({:.1} MiB of shards) in {:.2} s",
                out.display(),
                report.written_bytes as f64 / (1024.0 * 1024.0),
                path.display(),
                report.read_bytes as f64 / (1024.0 * 1024.0),
                report.seconds
            );
        }
    }
    Ok(())
}
