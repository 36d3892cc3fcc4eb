//! The `meshtrain` command.

use anyhow::Result;
use clap::{Parser, Subcommand};
use meshtrain::bench::{run_models, BenchModelsArgs};
use meshtrain::config::Config;
use meshtrain::presets::Task;
use meshtrain_train::RunOptions;
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "meshtrain",
    version,
    about = "Train neural networks across many workers (data, pipeline and tensor parallelism)",
    long_about = "meshtrain trains LeNet, ResNet-18 and GPT models on one worker or many, and tells you \
                  where the step time goes.\n\nStart with:\n  meshtrain train --config configs/lenet.toml\n\
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
    /// Benchmarks: model throughput, collectives.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Recommend a parallel layout (DP×TP×PP×SP, ZeRO, micro-batches, precision) for a model
    /// and a cluster, with predicted memory, time and bottleneck.
    Plan(meshtrain_plan::cli::PlanArgs),
    /// Draw a run's training curves (loss, accuracy or unigram baseline) into a PNG.
    Plot(meshtrain::plot::PlotArgs),
    /// Inspect or convert sharded checkpoints (written under ZeRO, or with
    /// train.checkpoint_format = "sharded").
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// What a sharded checkpoint holds: step, layout, tensors, shard files.
    Info {
        /// The checkpoint directory (or its index.json).
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

#[derive(clap::Args)]
struct TrainArgs {
    /// Config file, e.g. configs/lenet.toml.
    #[arg(long, default_value = "configs/lenet.toml")]
    config: PathBuf,
    /// Override a config value: --set train.batch_size=128 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Resume from a checkpoint of the same model (default: none).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Start from a checkpoint's weights with a fresh optimizer at step 0 (fine-tuning; the
    /// checkpoint may come from another model configuration whose tensors match).
    #[arg(long, value_name = "CHECKPOINT", conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    /// A layout, e.g. "dp=2,pp=2,mb=4,schedule=1f1b" or what `meshtrain plan` printed; the
    /// keys it names override the config's (same as --set parallel.layout=...).
    #[arg(long)]
    layout: Option<String>,
    /// Data-parallel workers (threads of this process; under mpirun the MPI world size).
    /// Same as --set parallel.dp=N.
    #[arg(long)]
    dp: Option<usize>,
    /// How replicas synchronise: ddp (bucketed all-reduce overlapped with backward) or
    /// single-master (scatter / gather to rank 0 / broadcast, like nn.DataParallel).
    #[arg(long, value_parser = ["ddp", "single-master"])]
    dp_mode: Option<String>,
    /// Pipeline stages: the model is cut into P stages on P workers (world = dp × tp × pp).
    /// Same as --set parallel.pp=P.
    #[arg(long)]
    pp: Option<usize>,
    /// Tensor-parallel workers: each GPT layer is split over T workers (Megatron-style;
    /// world = dp × tp × pp). Same as --set parallel.tp=T; --set
    /// parallel.sequence_parallel=true adds sequence parallelism.
    #[arg(long)]
    tp: Option<usize>,
    /// Context-parallel workers: each sequence is spread over C workers (GPT only; world =
    /// dp × tp × pp × cp). Same as --set parallel.cp=C; --set parallel.cp_mode="ulysses"
    /// picks Ulysses over the default ring attention.
    #[arg(long)]
    cp: Option<usize>,
    /// Matrix products in fp32, bf16 or fp16 (mixed precision with f32 master weights; fp16
    /// adds dynamic loss scaling). Same as --set train.precision=P.
    #[arg(long, value_parser = ["fp32", "bf16", "fp16"])]
    precision: Option<String>,
    /// Pipeline schedule: gpipe, 1f1b or interleaved[:V] (V chunks per worker, default 2).
    #[arg(long)]
    schedule: Option<String>,
    /// Micro-batches per step and data-parallel replica (pipeline runs).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// Write a Chrome trace of the last step to FILE.json (open it in
    /// https://ui.perfetto.dev) and a PNG of it next to it.
    #[arg(long, value_name = "FILE.json")]
    timeline: Option<PathBuf>,
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
}

fn train(args: &TrainArgs) -> Result<()> {
    let mut overrides = args.overrides.clone();
    if let Some(dp) = args.dp {
        overrides.push(format!("parallel.dp={dp}"));
    }
    if let Some(mode) = &args.dp_mode {
        overrides.push(format!("parallel.dp_mode=\"{mode}\""));
    }
    if let Some(pp) = args.pp {
        overrides.push(format!("parallel.pp={pp}"));
    }
    if let Some(tp) = args.tp {
        overrides.push(format!("parallel.tp={tp}"));
    }
    if let Some(cp) = args.cp {
        overrides.push(format!("parallel.cp={cp}"));
    }
    if let Some(precision) = &args.precision {
        overrides.push(format!("train.precision={}", toml_string(precision)));
    }
    if let Some(schedule) = &args.schedule {
        overrides.push(format!("parallel.schedule={}", toml_string(schedule)));
    }
    if let Some(m) = args.micro_batches {
        overrides.push(format!("parallel.micro_batches={m}"));
    }
    if let Some(path) = &args.timeline {
        let path = path.to_string_lossy();
        overrides.push(format!("parallel.timeline={}", toml_string(&path)));
    }
    if let Some(layout) = &args.layout {
        overrides.push(format!("parallel.layout={}", toml_string(layout)));
    }
    let cfg = Config::load(&args.config, &overrides)?;
    let task = Task::load(&cfg)?;
    let job = cfg.job(&task)?;
    let options = RunOptions {
        resume: args.resume.clone().or(cfg.checkpoint.resume.clone()),
        init_from: args.init_from.clone(),
        show_progress: std::io::stderr().is_terminal(),
        verbose: true,
    };
    let lead = !meshtrain_train::launched_by_mpi()
        || std::env::var("OMPI_COMM_WORLD_RANK").is_ok_and(|r| r == "0");
    if lead {
        println!("meshtrain: {}", task.source);
        for notice in cfg.notices() {
            println!("note: {notice}");
        }
    }
    let summary = job.run(&options)?;
    if summary.rank != 0 {
        return Ok(());
    }
    println!(
        "done: {} steps, final train loss {:.4}",
        summary.steps, summary.final_train_loss
    );
    if let Some(acc) = summary.test_accuracy {
        println!("test accuracy {:.2}%", acc * 100.0);
    }
    if let (Some(l), Some(b)) = (summary.eval_loss, summary.unigram_baseline) {
        println!("validation loss {l:.4} nats/char vs unigram baseline {b:.4}");
    }
    println!("throughput {:.1} samples/s", summary.samples_per_s);
    println!("{}", summary.breakdown.report());
    println!("{}", summary.memory.report());
    if let Some(rss) = summary.peak_rss_mb {
        println!("peak memory {rss:.0} MiB (the largest process)");
    }
    Ok(())
}

/// `s` as a TOML string literal (so no value is mistaken for a number or a table).
fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// Errors are the user's to read (a bad config, a missing file, a dead worker): print the
/// message and its causes, never the stack trace that returning `Err` from `main` would add
/// whenever RUST_BACKTRACE is set. Panics keep their backtraces.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e}");
            let causes: Vec<String> = e.chain().skip(1).map(|c| c.to_string()).collect();
            if !causes.is_empty() {
                eprintln!("\nCaused by:");
                for cause in causes {
                    eprintln!("    {cause}");
                }
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: logs redirected to a file stay plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match Cli::parse().command {
        Command::Train(a) => train(&a),
        Command::Bench(BenchCommand::Models(a)) => run_models(&a),
        Command::Bench(BenchCommand::Collectives(a)) => meshtrain_comm::bench::run_bench(a),
        Command::Bench(BenchCommand::Scaling(a)) => meshtrain::scaling::run_scaling(&a).map(|_| ()),
        Command::Bench(BenchCommand::Calibrate(a)) => meshtrain::calibrate::run_calibrate(&a),
        Command::Bench(BenchCommand::Pipeline(a)) => meshtrain::pipeline_bench::run(&a),
        Command::Bench(BenchCommand::Tensor(a)) => meshtrain::tensor_bench::run(&a),
        Command::Bench(BenchCommand::Precision(a)) => meshtrain::precision_bench::run(&a),
        Command::Bench(BenchCommand::Zero(a)) => meshtrain::zero_bench::run(&a),
        Command::Bench(BenchCommand::Context(a)) => meshtrain::context_bench::run(&a),
        Command::Plan(a) => meshtrain_plan::cli::run(&a),
        Command::Plot(a) => meshtrain::plot::run(&a),
        Command::Checkpoint(c) => checkpoint(c),
    }
}

fn checkpoint(command: CheckpointCommand) -> Result<()> {
    use meshtrain_train::sharded::{consolidate, describe, is_sharded, ShardedCheckpoint};
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
            print!("{}", describe(&ShardedCheckpoint::open(&path)?));
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
