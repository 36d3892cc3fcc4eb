//! `meshtrain bench models`: single-worker training throughput on synthetic batches (the same
//! protocol as the PyTorch peer baseline in shared/bench-peer: fixed batch, warm-up steps, then
//! as many timed steps as fit in a time budget), with achieved GFLOP/s against the matrix
//! product peak measured in the same process.

use crate::config::ModelConfig;
use crate::presets::build_model;
use anyhow::{bail, Result};
use meshtrain_nn::models::{GptConfig, LeNetVariant};
use meshtrain_nn::optim::{Optimizer, OptimizerConfig};
use meshtrain_nn::Mode;
use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::matmul::{gemm, Mat, MatMut};
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::{DType, Tensor};
use meshtrain_train::peak_rss_mb;
use serde::Serialize;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchModelsArgs {
    /// Comma-separated models: lenet, resnet18, gpt.
    #[arg(long, default_value = "lenet,resnet18,gpt")]
    pub models: String,
    /// Intra-op threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Seconds of timed steps per model (at least 5 steps).
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Run exactly this many timed steps instead of filling `--seconds` (for profiling and
    /// for comparing builds step for step).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Append one JSON line per model to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// Forward+backward FLOPs per sample as counted by PyTorch's FlopCounterMode for the same
/// models (shared/bench-peer/model_flops.py), so GFLOP/s compare like for like. These are
/// nominal: they count a padded convolution's multiplications by padding, which our tap
/// classes (and oneDNN's kernels) skip; for ResNet-18 at 28×28 about half of the nominal
/// count is never executed, so its GFLOP/s can exceed the product peak.
fn flops_per_sample(name: &str) -> f64 {
    match name {
        "lenet" => 2.3e6,
        "resnet18" => 197e6,
        _ => GptConfig::default().train_flops_per_sequence(),
    }
}

#[derive(Serialize, Debug)]
pub struct ModelBench {
    pub model: String,
    pub backend: &'static str,
    pub batch: usize,
    pub threads: usize,
    pub steps: usize,
    pub step_ms_median: f64,
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub optimizer_ms: f64,
    pub samples_per_s: f64,
    /// Samples per second of CPU time per thread (process CPU time of the timed steps divided
    /// by the thread count): close to the quiet-machine rate while other jobs share the cores,
    /// since time spent descheduled does not count.
    pub cpu_samples_per_s: f64,
    pub gflops: f64,
    pub gemm_peak_gflops: f64,
    pub activation_mb: f64,
    pub peak_rss_mb: Option<f64>,
}

/// GFLOP/s of a square f32 product on the current pool: the practical peak our kernels chase.
pub fn gemm_peak(n: usize) -> f64 {
    let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.1).collect();
    let b = a.clone();
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        gemm(
            MatMut::new(&mut c, n, n),
            Mat::new(&a, n, n),
            Mat::new(&b, n, n),
            false,
        );
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n as f64).powi(3) / best / 1e9
}

/// CPU time consumed so far by all threads of this process, in seconds (NaN where the clock
/// is not available: only Linux's clock id and timespec layout are spelled out here).
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn process_cpu_seconds() -> f64 {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we pass; the layout matches 64-bit Linux.
    let rc = unsafe { clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn process_cpu_seconds() -> f64 {
    f64::NAN
}

/// When the timed loop stops: after a fixed number of steps, or once the time budget is
/// spent (at least 5 and at most 200 steps, like the PyTorch peer).
#[derive(Clone, Copy, Debug)]
pub enum StepBudget {
    Steps(usize),
    Seconds(f64),
}

impl StepBudget {
    fn done(self, steps: usize, elapsed_s: f64) -> bool {
        match self {
            StepBudget::Steps(n) => steps >= n.max(1),
            StepBudget::Seconds(s) => (steps >= 5 && elapsed_s > s) || steps >= 200,
        }
    }
}

/// One model's training steps on synthetic batches, its products in `precision`.
pub fn bench_model(
    name: &str,
    threads: usize,
    budget: StepBudget,
    precision: DType,
) -> Result<ModelBench> {
    let (cfg, batch, classes, opt) = match name {
        "lenet" => (
            ModelConfig::Lenet {
                variant: LeNetVariant::Sigmoid,
            },
            256,
            10,
            OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
            },
        ),
        "resnet18" => (
            ModelConfig::Resnet18 { width: 64 },
            128,
            10,
            OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
            },
        ),
        "gpt" => (
            ModelConfig::Gpt(GptConfig::default()),
            32,
            256,
            OptimizerConfig::Adamw {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
        ),
        other => bail!("unknown model '{other}' (expected lenet, resnet18 or gpt)"),
    };
    let mut model = build_model(&cfg);
    model.set_precision(precision);
    let mut store = model.init(0);
    let mut optimizer = Optimizer::new(opt, model.num_params());
    let mut rng = SplitMix64::new(1);
    let (x, y) = if name == "gpt" {
        let seq = GptConfig::default().seq;
        let x: Vec<f32> = (0..batch * seq).map(|_| rng.below(256) as f32).collect();
        let y: Vec<u32> = (0..batch * seq).map(|_| rng.below(256) as u32).collect();
        (Tensor::from_vec(x, &[batch, seq]), y)
    } else {
        let x: Vec<f32> = (0..batch * 784).map(|_| rng.normal()).collect();
        let y: Vec<u32> = (0..batch).map(|_| rng.below(10) as u32).collect();
        (Tensor::from_vec(x, &[batch, 1, 28, 28]), y)
    };
    let pool = meshtrain_tensor::par::pool(threads);
    pool.install(|| {
        let peak = gemm_peak(1024);
        let mut times = Vec::new();
        let (mut fwd, mut bwd, mut opt_t) = (0.0, 0.0, 0.0);
        let mut act_bytes = 0usize;
        let mut started = Instant::now();
        let mut cpu_started = process_cpu_seconds();
        let mut step = 0usize;
        loop {
            let t0 = Instant::now();
            let (logits, acts) = model.forward_all(&mut store, x.clone(), Mode::TRAIN);
            act_bytes = act_bytes.max(acts.bytes());
            let (_, dl, _) = softmax_cross_entropy(logits.data(), classes, &y, 1.0);
            let t1 = Instant::now();
            model.backward(
                &mut store,
                acts,
                Tensor::from_vec(dl, logits.shape()),
                false,
                &mut |_, _| {},
            );
            let t2 = Instant::now();
            optimizer.step(&mut store.values, &store.grads, 1e-3);
            store.zero_grads();
            let t3 = Instant::now();
            step += 1;
            if step == 3 {
                // Warm-up over: the budget counts timed steps only.
                started = Instant::now();
                cpu_started = process_cpu_seconds();
            }
            if step > 3 {
                times.push((t3 - t0).as_secs_f64());
                fwd += (t1 - t0).as_secs_f64();
                bwd += (t2 - t1).as_secs_f64();
                opt_t += (t3 - t2).as_secs_f64();
            }
            if budget.done(times.len(), started.elapsed().as_secs_f64()) {
                break;
            }
        }
        let cpu_per_thread = (process_cpu_seconds() - cpu_started) / threads as f64;
        let n = times.len() as f64;
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let sps = batch as f64 / median;
        Ok(ModelBench {
            model: name.to_string(),
            backend: meshtrain_tensor::matmul::BACKEND,
            batch,
            threads,
            steps: times.len(),
            step_ms_median: median * 1e3,
            forward_ms: fwd / n * 1e3,
            backward_ms: bwd / n * 1e3,
            optimizer_ms: opt_t / n * 1e3,
            samples_per_s: sps,
            cpu_samples_per_s: batch as f64 * n / cpu_per_thread,
            gflops: sps * flops_per_sample(name) / 1e9,
            gemm_peak_gflops: peak,
            activation_mb: act_bytes as f64 / 1048576.0,
            peak_rss_mb: peak_rss_mb(),
        })
    })
}

pub fn run_models(args: &BenchModelsArgs) -> Result<()> {
    println!("matrix products: {}", meshtrain_tensor::matmul::BACKEND);
    println!(
        "{:<9} {:>5} {:>4} {:>9} {:>8} {:>8} {:>7} {:>10} {:>10} {:>8} {:>9} {:>8} {:>9}",
        "model",
        "batch",
        "thr",
        "step ms",
        "fwd ms",
        "bwd ms",
        "opt ms",
        "samples/s",
        "cpu smp/s",
        "GFLOP/s",
        "gemm peak",
        "% peak",
        "act MiB"
    );
    for name in args
        .models
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let budget = match args.steps {
            Some(n) => StepBudget::Steps(n),
            None => StepBudget::Seconds(args.seconds),
        };
        let r = bench_model(name, args.threads, budget, DType::F32)?;
        println!(
            "{:<9} {:>5} {:>4} {:>9.1} {:>8.1} {:>8.1} {:>7.1} {:>10.1} {:>10.1} {:>8.1} {:>9.1} {:>7.0}% {:>9.1}",
            r.model,
            r.batch,
            r.threads,
            r.step_ms_median,
            r.forward_ms,
            r.backward_ms,
            r.optimizer_ms,
            r.samples_per_s,
            r.cpu_samples_per_s,
            r.gflops,
            r.gemm_peak_gflops,
            100.0 * r.gflops / r.gemm_peak_gflops,
            r.activation_mb
        );
        if let Some(path) = &args.json {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?;
            writeln!(f, "{}", serde_json::to_string(&r)?)?;
        }
    }
    if let Some(rss) = peak_rss_mb() {
        println!("peak resident memory of the process: {rss:.0} MiB");
    }
    Ok(())
}
