//! `meshtrain bench calibrate`: the planner's predictions for our own machine, checked against
//! our own data-parallel runs (issue 6, item 6).
//!
//! The planner never sees the runs it predicts. It gets hardware figures measured here by
//! micro-benchmarks — one worker's matrix-product rate, single-thread memory bandwidth, the
//! threads backend's all-reduce bandwidth and latency, and the fixed cost of one framework op
//! (from a batch-1 LeNet step, a configuration none of the predicted runs uses) — and then
//! predicts the 2-worker DDP step of each model, which the real trainer measures afterwards.
//! Everything it writes (`bench.toml`, `<model>.toml`) reproduces the comparison with
//! `meshtrain plan --measured bench.toml --layout … --compare <model>.toml`.

use crate::bench::gemm_peak;
use crate::config::{Config, ModelConfig};
use crate::pipeline_bench::measure_layout;
use crate::presets::{build_model, Task};
use crate::scaling::{measure, model_config, parse_list, BenchScalingArgs, ScalingRun};
use anyhow::{anyhow, Context, Result};
use meshtrain_comm::bench::{
    bench_group, memcpy_gbps, BenchBackend, BenchCollectivesArgs, BenchOp,
};
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_nn::models::LeNetVariant;
use meshtrain_nn::optim::OptimizerConfig;
use meshtrain_nn::{Mode, ParamStore};
use meshtrain_plan::calibrate::{compare, Measurements};
use meshtrain_plan::diagnose::MeasuredStep;
use meshtrain_plan::{presets, Layout, Optimizer, Precision, Problem, TrainingSetup};
use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::Tensor;
use std::fmt::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchCalibrateArgs {
    /// Comma-separated models to predict and measure (lenet, resnet18, gpt).
    #[arg(long, default_value = "lenet,resnet18,gpt")]
    pub models: String,
    /// Data-parallel workers of the predicted and measured runs (one thread each).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Timed steps per measured run (default per model as in `bench scaling`).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Write bench.toml and one `<model>.toml` breakdown per model here.
    #[arg(long, default_value = "runs/calibrate")]
    pub out_dir: PathBuf,
}

/// Matrix-product rate of one worker (one thread): the planner's per-"GPU" rate.
fn worker_matmul_gflops() -> f64 {
    meshtrain_tensor::par::pool(1).install(|| gemm_peak(512))
}

/// All-reduce bus bandwidth (GB/s) at `large` bytes and per-step latency (µs) at 4 KiB on the
/// threads backend with `workers` workers.
fn allreduce_figures(workers: usize, large: usize) -> Result<(f64, f64)> {
    let args = BenchCollectivesArgs {
        backend: BenchBackend::Threads,
        workers: vec![workers],
        ops: vec![BenchOp::AllReduce],
        sizes: Vec::new(),
        seconds: 0.5,
        min_iters: 5,
        warmup: 3,
        json: None,
        raw_mpi: false,
        hierarchical: false,
        ranks_per_host: 0,
        rounds: 1,
    };
    let sizes = vec![4096, large];
    let memcpy = vec![0.0, 0.0];
    let rows = ThreadsWorld::run(
        workers,
        CommConfig::default().with_desync_check(false),
        move |g| {
            bench_group(
                g.as_ref(),
                "threads",
                BenchOp::AllReduce,
                &sizes,
                &memcpy,
                &args,
            )
        },
    )
    .map_err(|e| anyhow!("all-reduce benchmark failed: {e}"))?;
    let rows = &rows[0];
    // A ring all-reduce takes 2(n−1) steps; the planner charges its latency per step.
    let steps = 2.0 * (workers.max(2) - 1) as f64;
    Ok((rows[1].busbw_gbps, rows[0].time_us / steps))
}

/// Fixed cost of one framework op (µs): a batch-1 LeNet training step on one thread, minus
/// its arithmetic at the measured matrix rate, divided by the planner's op count for LeNet.
/// Batch 1 makes the fixed costs dominate; no predicted run uses it.
fn kernel_overhead_us(matmul_gflops: f64) -> Result<f64> {
    let spec = presets::model("lenet")?;
    let generic = match &spec.architecture {
        meshtrain_plan::Architecture::Generic(g) => g.clone(),
        _ => unreachable!("the lenet preset is a generic model"),
    };
    let model = build_model(&ModelConfig::Lenet {
        variant: LeNetVariant::Sigmoid,
    });
    let mut store = model.init(0);
    let x = Tensor::from_vec(vec![0.5; 784], &[1, 1, 28, 28]);
    let step = |store: &mut ParamStore| {
        let (logits, acts) = model.forward_all(store, x.clone(), Mode::TRAIN);
        let (_, dl, _) = softmax_cross_entropy(logits.data(), 10, &[3], 1.0);
        let dl = Tensor::from_vec(dl, logits.shape());
        model.backward(store, acts, dl, false, &mut |_, _| {});
    };
    let mut times: Vec<f64> = meshtrain_tensor::par::pool(1).install(|| {
        (0..300)
            .map(|_| {
                let t = Instant::now();
                step(&mut store);
                t.elapsed().as_secs_f64()
            })
            .collect()
    });
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let math = generic.flops_per_sample / (matmul_gflops * 1e9);
    Ok(((median - math).max(0.0) / generic.kernels_per_step as f64) * 1e6)
}

fn measured_step(run: &ScalingRun) -> MeasuredStep {
    MeasuredStep {
        workers: run.workers as u64,
        compute_s: (run.compute_ms - run.optimizer_ms) / 1e3,
        comm_exposed_s: run.comm_exposed_ms / 1e3,
        comm_hidden_s: run.comm_hidden_ms / 1e3,
        bubble_s: 0.0,
        data_s: run.data_ms / 1e3,
        optimizer_s: run.optimizer_ms / 1e3,
        step_s: Some(run.step_ms / 1e3),
        samples_per_step: Some(run.global_batch as f64),
        // Calibration runs are threads of this one process.
        hosts: Some(1),
        grad_reduce: None,
        device_memory: None,
    }
}

pub fn run_calibrate(args: &BenchCalibrateArgs) -> Result<()> {
    if args.workers < 2 {
        anyhow::bail!("--workers must be at least 2 (a data-parallel run is predicted)");
    }
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("creating {}", args.out_dir.display()))?;

    println!("## Hardware, measured now");
    let matmul = worker_matmul_gflops();
    let memory = memcpy_gbps(64 << 20, 0.5);
    let (busbw, latency) = allreduce_figures(args.workers, 16 << 20)?;
    let overhead = kernel_overhead_us(matmul)?;
    let measurements = Measurements {
        matmul_gflops: Some(matmul),
        memory_bandwidth_gbps: Some(memory),
        allreduce_bus_bandwidth_gbps: Some(busbw),
        allreduce_latency_us: Some(latency),
        kernel_overhead_us: Some(overhead),
        ..Measurements::default()
    };
    let bench_toml = toml::to_string(&measurements)?;
    print!("{bench_toml}");
    let bench_path = args.out_dir.join("bench.toml");
    std::fs::write(&bench_path, &bench_toml)
        .with_context(|| format!("writing {}", bench_path.display()))?;
    let cluster = measurements.apply(&presets::cluster("cpu")?.with_gpus(args.workers as u64)?)?;

    let scaling_args = BenchScalingArgs {
        models: args.models.clone(),
        workers: args.workers.to_string(),
        threads: args.workers,
        steps: args.steps,
        ..BenchScalingArgs::default()
    };
    let single_args = BenchScalingArgs {
        workers: "1".into(),
        threads: 1,
        ..scaling_args.clone()
    };
    println!(
        "\n| model | run | 1 worker × 1 thread samples/s | its achieved GFLOP/s (fitted) | predicted samples/s | measured samples/s | predicted / measured |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut details = String::new();
    for model in parse_list(&args.models) {
        let model = model.as_str();
        let (file, mut overrides) = model_config(model)?;
        overrides.push("train.log_every=1000000".into());
        let cfg = Config::load(&PathBuf::from(&file), &overrides)?;
        let task = Task::load(&cfg)?;
        let global_batch = cfg.train.batch_size as u64;
        let optimizer = match cfg.optimizer {
            OptimizerConfig::Adamw { .. } => Optimizer::Adam,
            OptimizerConfig::Sgd { .. } => Optimizer::Sgd,
        };
        let setup = TrainingSetup {
            optimizer,
            ..TrainingSetup::new(global_batch, Precision::Fp32)
        };
        // One constant per model from its own 1-worker run: the achieved matrix rate.
        let single = measure(model, 1, &single_args, &task, &cfg)?;
        let spec = presets::model(model)?;
        let (rate, model_cluster) = fit_model_rate(
            &spec,
            &cluster,
            &setup,
            single.compute_ms - single.optimizer_ms,
        )?;
        // The same figures with this model's rate, so `meshtrain plan` reproduces the rows.
        let model_bench = args.out_dir.join(format!("bench-{model}.toml"));
        let with_rate = Measurements {
            matmul_gflops: Some(rate),
            ..measurements.clone()
        };
        std::fs::write(&model_bench, toml::to_string(&with_rate)?)
            .with_context(|| format!("writing {}", model_bench.display()))?;
        let problem = Problem::new(spec, model_cluster, setup)?;

        // The runs to predict: DDP over all workers, and for GPT a 1F1B pipeline over them.
        let mut runs = Vec::new();
        let w = args.workers as u64;
        let ddp = measure(model, args.workers, &scaling_args, &task, &cfg)?;
        runs.push((
            model.to_string(),
            format!("dp={w},mb={}", global_batch / w),
            measured_step(&ddp),
            ddp.samples_per_s,
        ));
        if model == "gpt" {
            let m = PIPELINE_MICRO_BATCHES;
            let mut pipe_cfg = cfg.clone();
            pipe_cfg.parallel.pp = args.workers;
            pipe_cfg.parallel.schedule = "1f1b".into();
            pipe_cfg.parallel.micro_batches = m;
            pipe_cfg.validate()?;
            let steps = args.steps.unwrap_or(8);
            let pipe = measure_layout("pipeline", pipe_cfg, &task, args.workers, 3, steps)?;
            runs.push((
                format!("{model}-pipeline"),
                format!("pp={w},mb={},schedule=1f1b", global_batch / m as u64),
                throughput_step(&pipe, w, global_batch),
                pipe.samples_per_s,
            ));
            // And tensor parallelism over the same workers (Megatron's split of each layer).
            let mut tp_cfg = cfg.clone();
            tp_cfg.parallel.tp = args.workers;
            tp_cfg.validate()?;
            let tensor = measure_layout("tensor", tp_cfg, &task, args.workers, 3, steps)?;
            runs.push((
                format!("{model}-tensor"),
                format!("tp={w},mb={global_batch}"),
                throughput_step(&tensor, w, global_batch),
                tensor.samples_per_s,
            ));
        }
        for (name, layout_text, step, measured_rate) in &runs {
            let predicted = problem.evaluate(&Layout::parse(layout_text)?)?;
            let measured_path = args.out_dir.join(format!("{name}.toml"));
            std::fs::write(&measured_path, toml::to_string(step)?)
                .with_context(|| format!("writing {}", measured_path.display()))?;
            println!(
                "| {model} | {layout_text} | {:.1} | {rate:.1} | {:.1} | {measured_rate:.1} | {:.2} |",
                single.samples_per_s,
                predicted.throughput.samples_per_s,
                predicted.throughput.samples_per_s / measured_rate
            );
            let _ =
                writeln!(
                details,
                "\n{name}: meshtrain plan --model {model} --cluster cpu --gpus {w} --global-batch \
                 {global_batch} --optimizer {opt} --precision fp32 --measured {bench} \
                 --layout {layout_text} --compare {measured}",
                opt = if optimizer == Optimizer::Adam { "adam" } else { "sgd" },
                bench = model_bench.display(),
                measured = measured_path.display(),
            );
            details += &compare(&predicted, step);
        }
    }
    println!("{details}");
    Ok(())
}

/// A measured run of [`measure_layout`] as the planner's breakdown (tensor-parallel
/// communication is inside the compute, as the planner's compare row counts it).
fn throughput_step(
    run: &crate::pipeline_bench::ThroughputRun,
    workers: u64,
    global_batch: u64,
) -> MeasuredStep {
    MeasuredStep {
        workers,
        compute_s: (run.compute_ms - run.optimizer_ms) / 1e3,
        comm_exposed_s: run.comm_exposed_ms / 1e3,
        comm_hidden_s: run.comm_hidden_ms / 1e3,
        bubble_s: run.pipeline_idle_ms / 1e3,
        data_s: 0.0,
        optimizer_s: run.optimizer_ms / 1e3,
        step_s: Some(run.step_ms / 1e3),
        samples_per_step: Some(global_batch as f64),
        hosts: Some(1),
        grad_reduce: None,
        device_memory: None,
    }
}

/// Micro-batches of the predicted pipeline run (as in `bench pipeline`'s throughput part).
const PIPELINE_MICRO_BATCHES: usize = 8;

/// The matrix rate (GFLOP/s, at most the measured peak of `cluster`) for which the planner's
/// single-worker compute time of `model` equals `measured_compute_ms`: the one constant the
/// calibration takes from a run. Small convolutions and short products run far below the
/// peak of a 512³ product, and that fraction is a property of the model's shapes, not of
/// the layout, so it carries over to the multi-worker runs being predicted.
fn fit_model_rate(
    model: &meshtrain_plan::ModelSpec,
    cluster: &meshtrain_plan::ClusterSpec,
    setup: &TrainingSetup,
    measured_compute_ms: f64,
) -> Result<(f64, meshtrain_plan::ClusterSpec)> {
    let peak = cluster.peak_tflops.fp32 * 1e3 * cluster.gemm_efficiency;
    let batch = setup.global_batch;
    let compute_at = |gflops: f64| -> Result<(f64, meshtrain_plan::ClusterSpec)> {
        let mut c = cluster.clone();
        c.gemm_efficiency = gflops / (c.peak_tflops.fp32 * 1e3);
        let p = Problem::new(model.clone(), c.with_gpus(1)?, setup.clone())?;
        let e = p.evaluate(&Layout::data_parallel(1, batch))?;
        Ok(((e.time.compute_s + e.time.recompute_s) * 1e3, c))
    };
    // Compute time falls as the rate rises: bisect on a log scale.
    let (mut low, mut high) = (peak * 1e-3, peak);
    if compute_at(high)?.0 >= measured_compute_ms {
        return Ok((high, compute_at(high)?.1));
    }
    for _ in 0..60 {
        let mid = (low * high).sqrt();
        if compute_at(mid)?.0 > measured_compute_ms {
            low = mid;
        } else {
            high = mid;
        }
    }
    Ok((high, compute_at(high)?.1))
}
