//! `meshtrain bench scaling`: data-parallel throughput for 1, 2 and 4 workers (threads
//! backend; more workers than cores are oversubscribed) for LeNet, ResNet-18 and GPT, with the
//! step-time breakdown that explains it: compute, communication exposed, communication hidden
//! behind backward, data loading — and the computation-to-synchronisation ratio.
//!
//! Strong scaling, as in the PyTorch peer baseline: the global batch is fixed and every
//! worker gets `threads / N` intra-op threads, so N workers use the same cores as one. Each
//! run is the real trainer (`train --dp N`) on real data after warm-up steps.

use crate::config::{Config, DpMode};
use crate::presets::Task;
use anyhow::{anyhow, bail, Context, Result};
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_train::Breakdown;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchScalingArgs {
    /// Comma-separated models: lenet (the D2L sigmoid LeNet, as in the peer baseline),
    /// lenet-relu, resnet18, gpt.
    #[arg(long, default_value = "lenet,resnet18,gpt")]
    pub models: String,
    /// Comma-separated worker counts.
    #[arg(long, default_value = "1,2,4")]
    pub workers: String,
    /// Total intra-op threads shared by the workers.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Timed steps per run (default per model: LeNet 60, ResNet-18 8, GPT 8).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Untimed warm-up steps per run.
    #[arg(long, default_value_t = 3)]
    pub warmup: u64,
    /// Synchronisation: ddp or single-master.
    #[arg(long, default_value = "ddp")]
    pub dp_mode: String,
    /// Extra config overrides for every run (e.g. parallel.overlap=false).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Where the workers run: cpu (threads), or cuda: one GPU per worker where there are
    /// enough (NCCL), else workers sharing the GPU(s) through staged collectives. On a GPU the
    /// table is followed by the planner's prediction for 1, 2 and 8 GPUs of the lent kind
    /// (H200) on NVLink.
    #[arg(long)]
    pub device: Option<String>,
    /// Append one JSON line per run to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw the breakdown chart to this PNG.
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// Write `<model>.toml` step breakdowns here for `meshtrain plan --diagnose`.
    #[arg(long)]
    pub diagnose_dir: Option<PathBuf>,
}

/// The command line's defaults, taken from the command line's own definition (so a caller
/// that sets a few fields gets what `meshtrain bench scaling` would).
impl Default for BenchScalingArgs {
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            args: BenchScalingArgs,
        }
        <Command as clap::Parser>::parse_from(["scaling"]).args
    }
}

/// One (model, workers) measurement.
#[derive(Serialize, Debug, Clone)]
pub struct ScalingRun {
    pub model: String,
    pub workers: usize,
    pub threads_per_worker: usize,
    pub dp_mode: String,
    pub global_batch: usize,
    pub steps: u64,
    pub samples_per_s: f64,
    pub step_ms: f64,
    pub compute_ms: f64,
    /// The optimizer's part of `compute_ms`.
    pub optimizer_ms: f64,
    pub comm_exposed_ms: f64,
    pub comm_hidden_ms: f64,
    pub data_ms: f64,
    pub comm_mb_per_step: f64,
    pub compute_to_comm: f64,
    /// samples/s relative to the 1-worker run of the same model (if measured).
    pub vs_one_worker: Option<f64>,
}

pub(crate) fn model_config(model: &str) -> Result<(String, Vec<String>)> {
    let (file, extra): (&str, &[&str]) = match model {
        "lenet" => ("configs/lenet.toml", &["model.variant=\"sigmoid\""]),
        "lenet-relu" => ("configs/lenet.toml", &[]),
        "resnet18" => ("configs/resnet18.toml", &[]),
        "gpt" => ("configs/gpt.toml", &[]),
        other => bail!("unknown model '{other}' (lenet, lenet-relu, resnet18, gpt)"),
    };
    Ok((
        file.to_string(),
        extra.iter().map(|s| s.to_string()).collect(),
    ))
}

fn default_steps(model: &str) -> u64 {
    match model {
        "lenet" | "lenet-relu" => 60,
        _ => 8,
    }
}

/// Runs one (model, workers) measurement with the real trainer.
pub fn measure(
    model: &str,
    workers: usize,
    args: &BenchScalingArgs,
    task: &Task,
    base: &Config,
) -> Result<ScalingRun> {
    let mut cfg = base.clone();
    cfg.parallel.dp = workers;
    cfg.validate()?;
    let threads = (args.threads / workers).max(1);
    let steps = args.steps.unwrap_or_else(|| default_steps(model));
    let warmup = args.warmup;
    let job = Arc::new(cfg.job(task)?);
    job.check(workers)?;
    let breakdowns = ThreadsWorld::run(workers, CommConfig::default(), move |group| {
        let mut t = job
            .trainer(group, Some(threads))
            .map_err(|e| format!("{e:#}"))?;
        let mut timed = Breakdown::default();
        for step in 0..warmup + steps {
            if step == warmup {
                timed = t.breakdown.clone();
            }
            t.train_step().map_err(|e| format!("{e:#}"))?;
        }
        Ok::<_, String>(t.breakdown.since(&timed))
    })
    .map_err(|e| anyhow!("{model} with {workers} workers: {e}"))?;
    // The slowest worker sets the pace; report rank 0's split of it.
    let bd = &breakdowns[0];
    let n = bd.steps.max(1) as f64;
    let step_s = breakdowns.iter().map(Breakdown::step_s).fold(0.0, f64::max) / n;
    Ok(ScalingRun {
        model: model.to_string(),
        workers,
        threads_per_worker: threads,
        dp_mode: args.dp_mode.clone(),
        global_batch: base.train.batch_size,
        steps,
        samples_per_s: base.train.batch_size as f64 / step_s,
        step_ms: step_s * 1e3,
        compute_ms: bd.compute_s() / n * 1e3,
        optimizer_ms: bd.times.optimizer_s / n * 1e3,
        comm_exposed_ms: bd.times.comm_exposed_s / n * 1e3,
        comm_hidden_ms: bd.times.comm_hidden_s / n * 1e3,
        data_ms: bd.data_s / n * 1e3,
        comm_mb_per_step: bd.times.comm_bytes as f64 / n / 1e6,
        compute_to_comm: if workers > 1 {
            bd.compute_to_comm()
        } else {
            f64::INFINITY
        },
        vs_one_worker: None,
    })
}

/// A comma-separated list of names, blanks dropped (`--models`, `--layouts`).
pub(crate) fn parse_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(|x| x.trim().to_string())
        .filter(|x| !x.is_empty())
        .collect()
}

/// The model's config with the bench's settings, from the repository at `root`.
fn base_config(root: &Path, model: &str, args: &BenchScalingArgs) -> Result<Config> {
    let mode = match args.dp_mode.as_str() {
        "ddp" => DpMode::Ddp,
        "single-master" => DpMode::SingleMaster,
        other => bail!("unknown --dp-mode '{other}' (ddp, single-master)"),
    };
    let (file, mut overrides) = model_config(model)?;
    overrides.extend(args.overrides.iter().cloned());
    if let Some(device) = &args.device {
        overrides.push(format!("train.device=\"{device}\""));
    }
    overrides.push("train.log_every=1000000".into());
    let mut base = Config::load(&root.join(file), &overrides)?;
    base.parallel.dp_mode = mode;
    Ok(base)
}

/// One (model, workers) measurement of the repository at `root`'s config for `model`.
pub fn measure_one(
    root: &Path,
    model: &str,
    workers: usize,
    args: &BenchScalingArgs,
) -> Result<ScalingRun> {
    let base = base_config(root, model, args)?;
    let task = Task::load(&base)?;
    measure(model, workers, args, &task, &base)
}

pub fn run_scaling(args: &BenchScalingArgs) -> Result<Vec<ScalingRun>> {
    run_scaling_in(Path::new("."), args)
}

/// [`run_scaling`] with the configs of the repository at `root`.
pub fn run_scaling_in(root: &Path, args: &BenchScalingArgs) -> Result<Vec<ScalingRun>> {
    let workers: Vec<usize> = parse_list(&args.workers)
        .iter()
        .map(|w| w.parse().with_context(|| format!("bad worker count '{w}'")))
        .collect::<Result<_>>()?;
    if workers.contains(&0) {
        bail!("worker counts must be at least 1");
    }
    println!(
        "| model | workers | thr/worker | samples/s | vs 1 worker | step ms | compute ms | comm exposed ms | comm hidden ms | data ms | comm MB/step | compute/comm |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut runs = Vec::new();
    let mut bases = Vec::new();
    for model in parse_list(&args.models) {
        let base = base_config(root, &model, args)?;
        let task = Task::load(&base)?;
        let mut one = None;
        for &w in &workers {
            let mut run = measure(&model, w, args, &task, &base)?;
            if w == 1 {
                one = Some(run.samples_per_s);
            }
            run.vs_one_worker = one.map(|o| run.samples_per_s / o);
            println!(
                "| {} | {} | {} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {} |",
                run.model,
                run.workers,
                run.threads_per_worker,
                run.samples_per_s,
                run.vs_one_worker.map_or("-".into(), |v| format!("{v:.2}")),
                run.step_ms,
                run.compute_ms,
                run.comm_exposed_ms,
                run.comm_hidden_ms,
                run.data_ms,
                run.comm_mb_per_step,
                if run.compute_to_comm.is_finite() {
                    format!("{:.1}", run.compute_to_comm)
                } else {
                    "-".into()
                }
            );
            if let Some(path) = &args.json {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?;
                serde_json::to_writer(&mut f, &run)?;
                f.write_all(b"\n")?;
            }
            runs.push(run);
        }
        if let Some(dir) = &args.diagnose_dir {
            let ours: Vec<&ScalingRun> = runs.iter().filter(|r| r.model == model).collect();
            write_diagnose_file(dir, &model, &ours)?;
        }
        bases.push((model, base));
    }
    if base_device(&bases).is_cuda() {
        println!(
            "\nWorkers sharing one GPU show the synchronisation's cost (every gradient crosses \
             pinned host memory) but not the speed-up: they take turns on the same \
             multiprocessors. What N GPUs of their own would do, the planner's prediction \
             for the lent kind (H200, NVLink inside a node):"
        );
        for (model, base) in &bases {
            print_prediction(model, &predict_on_gpus(model, base, &[1, 2, 8])?);
        }
    }
    if let Some(path) = &args.png {
        draw_breakdown_chart(path, &runs)?;
        println!("chart: {}", path.display());
    }
    Ok(runs)
}

fn base_device(bases: &[(String, Config)]) -> meshtrain_tensor::Device {
    bases
        .first()
        .map_or(meshtrain_tensor::Device::Cpu, |(_, b)| b.train.device)
}

/// One row of the planner's prediction: GPUs, samples/s, step, compute and exposed
/// data-parallel communication (seconds), and the computation-to-synchronisation ratio
/// (infinite on one GPU).
#[derive(Clone, Copy, Debug)]
pub struct Predicted {
    pub gpus: u64,
    pub samples_per_s: f64,
    pub step_s: f64,
    pub compute_s: f64,
    pub comm_exposed_s: f64,
    pub compute_to_comm: f64,
}

/// The planner's step for `model` (its preset) at `base`'s global batch, precision and
/// optimizer on `gpus` H200s of one NVLink node, data-parallel: the
/// computation-to-synchronisation ratio that decides whether more GPUs help, in numbers for
/// real GPUs.
pub fn predict_on_gpus(model: &str, base: &Config, gpus: &[u64]) -> Result<Vec<Predicted>> {
    use meshtrain_plan::{presets, Layout, Optimizer, Precision, Problem, TrainingSetup};
    let spec = presets::model(match model {
        "lenet" | "lenet-relu" => "lenet",
        other => other,
    })?;
    let precision = match base.train.precision.as_str() {
        "bf16" => Precision::Bf16,
        "fp16" => Precision::Fp16,
        _ => Precision::Fp32,
    };
    let optimizer = match base.optimizer {
        meshtrain_nn::optim::OptimizerConfig::Adamw { .. } => Optimizer::Adam,
        meshtrain_nn::optim::OptimizerConfig::Sgd { .. } => Optimizer::Sgd,
    };
    let setup = TrainingSetup {
        optimizer,
        ..TrainingSetup::new(base.train.batch_size as u64, precision)
    };
    gpus.iter()
        .map(|&n| {
            let cluster = presets::cluster("h200")?.with_gpus(n)?;
            let problem = Problem::new(spec.clone(), cluster, setup.clone())?;
            // Each replica's share in one micro-batch, as the trainer runs it.
            let share = (base.train.batch_size as u64 / n).max(1);
            let layout = Layout::parse(&format!("dp={n},mb={share}"))?;
            let e = meshtrain_plan::search::evaluate_layout(&problem, &layout)?;
            let t = &e.time;
            let comm = t.dp_exposed_s + t.dp_hidden_s;
            Ok(Predicted {
                gpus: n,
                samples_per_s: e.throughput.samples_per_s,
                step_s: t.step_s,
                compute_s: t.compute_s,
                comm_exposed_s: t.dp_exposed_s,
                compute_to_comm: if n > 1 && comm > 0.0 {
                    t.compute_s / comm
                } else {
                    f64::INFINITY
                },
            })
        })
        .collect()
}

fn print_prediction(model: &str, rows: &[Predicted]) {
    println!(
        "\n| {model} on H200 (planner) | samples/s | vs 1 GPU | step ms | compute ms | dp comm exposed ms | compute/comm |"
    );
    println!("|---|---|---|---|---|---|---|");
    let one = rows.first().map_or(1.0, |r| r.samples_per_s);
    for r in rows {
        println!(
            "| {} GPU{} | {:.0} | {:.2} | {:.3} | {:.3} | {:.3} | {} |",
            r.gpus,
            if r.gpus == 1 { "" } else { "s" },
            r.samples_per_s,
            r.samples_per_s / one,
            r.step_s * 1e3,
            r.compute_s * 1e3,
            r.comm_exposed_s * 1e3,
            if r.compute_to_comm.is_finite() {
                format!("{:.1}", r.compute_to_comm)
            } else {
                "-".into()
            }
        );
    }
}

/// The chart of the study: per model, one bar per worker count, each bar the step time split
/// into compute, exposed communication, data loading and the rest (waiting for the slowest
/// worker), all relative to the model's 1-worker step so models of very different cost share
/// one axis. A bar below 1.0 is a speedup (its label is the samples/s ratio); communication
/// hidden behind backward is not on the critical path and so not stacked.
fn draw_breakdown_chart(path: &std::path::Path, runs: &[ScalingRun]) -> Result<()> {
    use meshtrain_chart::{stacked_bars, Bar, BarChart, BarGroup, Color, ValueFormat};
    let mut groups: Vec<BarGroup> = Vec::new();
    for run in runs {
        let base_ms = runs
            .iter()
            .find(|r| r.model == run.model && r.workers == 1)
            .map_or(run.step_ms, |r| r.step_ms);
        let rel = |ms: f64| (ms / base_ms).max(0.0);
        let other = run.step_ms - run.compute_ms - run.comm_exposed_ms - run.data_ms;
        let bar = Bar {
            label: format!("{}w", run.workers),
            segments: vec![
                ("compute".into(), rel(run.compute_ms)),
                ("communication (exposed)".into(), rel(run.comm_exposed_ms)),
                ("data".into(), rel(run.data_ms)),
                ("waiting / other".into(), rel(other)),
            ],
        };
        match groups.iter_mut().find(|g| g.label == run.model) {
            Some(g) => g.bars.push(bar),
            None => groups.push(BarGroup {
                label: run.model.clone(),
                bars: vec![bar],
            }),
        }
    }
    let chart = BarChart {
        title: "Data-parallel step time relative to 1 worker (same global batch, same cores)"
            .into(),
        y_label: "step time / 1-worker step time".into(),
        groups,
        value_labels: Some(ValueFormat {
            decimals: 2,
            suffix: String::new(),
        }),
        category_colors: vec![
            ("compute".into(), Color(66, 133, 244)),
            ("communication (exposed)".into(), Color(219, 68, 55)),
            ("data".into(), Color(244, 180, 0)),
            ("waiting / other".into(), Color(160, 160, 160)),
        ],
        ..BarChart::default()
    };
    stacked_bars(path, &chart).with_context(|| format!("drawing {}", path.display()))
}

/// The runs of one model as `[[run]]` tables that `meshtrain plan --diagnose` reads.
fn write_diagnose_file(dir: &std::path::Path, model: &str, runs: &[&ScalingRun]) -> Result<()> {
    use std::fmt::Write;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut text =
        format!("# meshtrain bench scaling, {model}: strong scaling, fixed global batch\n");
    for r in runs {
        let _ = write!(
            text,
            "\n[[run]]\nworkers = {}\ncompute_s = {:.6}\noptimizer_s = {:.6}\ncomm_exposed_s = {:.6}\n\
             comm_hidden_s = {:.6}\ndata_s = {:.6}\nstep_s = {:.6}\nsamples_per_step = {}\n",
            r.workers,
            (r.compute_ms - r.optimizer_ms) / 1e3,
            r.optimizer_ms / 1e3,
            r.comm_exposed_ms / 1e3,
            r.comm_hidden_ms / 1e3,
            r.data_ms / 1e3,
            r.step_ms / 1e3,
            r.global_batch
        );
    }
    let path = dir.join(format!("{model}.toml"));
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// D2L's conclusion in the planner's numbers for H200s: ResNet-18 gains from 8 GPUs,
    /// LeNet hardly does. On GPUs the reason is not the bytes synchronised (NVLink moves
    /// LeNet's 0.25 MB in microseconds) but that LeNet's step is launch-bound: a smaller
    /// share per GPU does not shrink it.
    #[test]
    fn the_planner_says_resnet_scales_and_lenet_less() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let args = BenchScalingArgs::default();
        let gain = |model: &str| {
            let base = base_config(&root, model, &args).unwrap();
            let rows = predict_on_gpus(model, &base, &[1, 2, 8]).unwrap();
            assert_eq!(rows.len(), 3);
            assert!(rows[0].compute_to_comm.is_infinite());
            assert!(rows.iter().all(|r| r.samples_per_s > 0.0 && r.step_s > 0.0));
            (
                rows[2].samples_per_s / rows[0].samples_per_s,
                rows[1].compute_to_comm,
            )
        };
        let (lenet, _) = gain("lenet");
        let (resnet, resnet_ratio) = gain("resnet18");
        assert!(resnet > lenet, "8-GPU gain: ResNet {resnet} LeNet {lenet}");
        assert!(lenet < 1.5, "LeNet on 8 GPUs: {lenet}x");
        assert!(
            resnet_ratio > 1.0,
            "ResNet's compute/comm on 2 GPUs: {resnet_ratio}"
        );
    }
}
