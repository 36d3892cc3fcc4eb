//! `meshtrain bench gpu`: the CUDA backend on this machine's GPU, in five parts.
//!
//! * `check`: every device kernel against its CPU twin on fresh random inputs (fp32 within
//!   1e-5, bf16/f16 within 1e-2, NaN never passes), the optimizers against
//!   `meshtrain_nn::optim`, then 20 GPT and 20 Llama steps on the GPU against the CPU (fp32: parameters
//!   within 1e-4 relative L2; bf16: every step's loss within 1%) and two GPU runs
//!   bit-identical;
//! * `products`: each matrix product of a GPT-2 124M step against the fastest of the
//!   algorithms cuBLASLt's heuristic offers for the same shape (ours / best);
//! * `kernels`: each fused kernel's bandwidth against a device-to-device copy;
//! * `multi`: several ranks on the GPU(s): the device conformance suite through staged
//!   collectives at 1, 2 and 4 ranks, and a staged all-reduce's rate (`gpu_multi`);
//! * `layouts`: pipelines (1F1B, interleaved), ring context parallelism and an 8-rank
//!   dp × pp × cp hybrid against one GPU, and their checkpoints across devices (`gpu_multi`);
//! * `step`: the GPT-2 124M step (12 × 768, 12 heads, 1024 tokens, vocabulary 50304, batch
//!   16, bf16, AdamW, clipping) and, with `--models llama-1b`, the Llama 3.2 1B-shaped step
//!   (batch 4 × 2048) in tokens/s and model FLOPs utilisation, their device memory, and where
//!   their time goes (one profiled step each).
//!
//! Every number comes from the same process on the same card; the GPU-check script runs
//! PyTorch's anchor beside it.

use crate::config::Config;
use crate::presets::Task;
use anyhow::{bail, Context, Result};
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_nn::optim::{GroupHyper, Optimizer, OptimizerConfig, Segment};
use meshtrain_plan::calibrate::Measurements;
use meshtrain_tensor::cuda::blas::F32Math;
use meshtrain_tensor::cuda::check::{self, rel_l2, result, CheckResult};
use meshtrain_tensor::cuda::ops::{self, AttnShape, LinearProducts, LinearShape};
use meshtrain_tensor::cuda::train_ops::{self, AdamW, FlatState, SegmentRow, SegmentTable};
use meshtrain_tensor::cuda::{CudaDevice, CudaError, CudaTensor, DeviceGrads, DeviceParams};
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::DType;
use meshtrain_train::RunOptions;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchGpuArgs {
    /// Parts to run: check, multi, layouts, convnets, products, kernels, attention (its
    /// checks and rates alone, both kinds of kernels on Hopper), step (comma-separated).
    #[arg(long, default_value = "check,products,kernels,step")]
    pub parts: String,
    /// The GPU.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// The models the step part times (comma-separated): gpt2-124m, llama-1b.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "gpt2-124m")]
    pub models: Vec<StepModel>,
    /// Step part: sequences per batch (default: what PyTorch's anchor runs, 16 for
    /// gpt2-124m, 4 for llama-1b).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Step part: timed steps (after 3 warm-up steps).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Step part: the card's dense bf16 peak in TFLOP/s for model FLOPs utilisation
    /// (default: the planner's preset for an H100, H200 or A100).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Repetitions per timed product or kernel.
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// Where the repository's configs/ are (the comparisons train configs/gpt.toml and
    /// configs/llama.toml).
    #[arg(long, default_value = ".")]
    pub root: PathBuf,
    /// Write the rates measured here for the planner into DIR/measured.toml (the products'
    /// median rate, the copy rate, the attention kernel's rate; merged with what earlier parts
    /// wrote there: `meshtrain plan --measured`) and the step part's breakdown into
    /// DIR/breakdown.json (`meshtrain plan --compare`).
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
    /// A config override (`section.key=value`, repeatable) for every training run of the
    /// check, multi, layouts and convnets parts, after their own settings (so a run's name
    /// may quote a size it no longer has: `cp=2 ring at 2,048 tokens` under `--set
    /// model.seq=32` runs 32): a smaller model where the device is slow, as the emulated
    /// CUDA device is (`scripts/emu-gpu-check.sh`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// `--set`'s overrides, applied by [`train_and_read`] to every run of the parts (their
/// ranks run on threads of their own, so this is set once for the process, not passed down).
static EXTRA_OVERRIDES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

fn cuda(e: CudaError) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

pub fn run(args: &BenchGpuArgs) -> Result<()> {
    if let Some(bad) = args.overrides.iter().find(|o| !o.contains('=')) {
        bail!("--set {bad}: expected section.key=value");
    }
    let _ = EXTRA_OVERRIDES.set(args.overrides.clone());
    let dev = CudaDevice::get(args.device).map_err(cuda)?;
    let (free, total) = dev.memory_info();
    println!(
        "GPU cuda:{} {} (sm_{}, {} multiprocessors, {:.1} of {:.1} GiB free), NVRTC {}",
        dev.ordinal(),
        dev.name(),
        dev.arch(),
        dev.multiprocessors(),
        free as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64,
        meshtrain_tensor::cuda::compile::nvrtc_version().map_err(cuda)?
    );
    let t = Instant::now();
    dev.load_all_kernels().map_err(cuda)?;
    println!(
        "kernels compiled and loaded in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let mut failed = Vec::new();
    for part in args
        .parts
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part {
            "check" => failed.extend(check_part(&dev, args)?),
            "products" => {
                let matmul_tflops = products(&dev, args)?;
                record(&dev, args, |m| {
                    m.matmul_precision = Some(meshtrain_plan::Precision::Bf16);
                    m.matmul_gflops = Some(matmul_tflops * 1e3);
                })?;
            }
            "kernels" => {
                let (copy_gbs, attention_tflops) = kernels(&dev, args)?;
                record(&dev, args, |m| {
                    m.memory_bandwidth_gbps = Some(copy_gbs);
                    m.attention_tflops = Some(attention_tflops);
                })?;
            }
            "attention" => {
                failed.extend(attention_check_part(&dev)?);
                let attention_tflops = attention_rates(&dev, args)?;
                record(&dev, args, |m| m.attention_tflops = Some(attention_tflops))?;
            }
            "step" => step(args)?,
            "multi" => failed.extend(crate::gpu_multi::run(&args.root)?),
            "layouts" => failed.extend(crate::gpu_multi::run_layouts(&args.root)?),
            "convnets" => failed.extend(crate::gpu_convnets::run(&args.root)?),
            other => {
                bail!(
                    "unknown part '{other}' (check, multi, layouts, convnets, products, \
                     kernels, attention, step)"
                )
            }
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} GPU check(s) failed:\n{}",
            failed.len(),
            failed.join("\n")
        );
    }
    Ok(())
}

/// Updates `--out-dir`'s measured.toml with what a part measured (a no-op without
/// `--out-dir`).
fn record(
    dev: &CudaDevice,
    args: &BenchGpuArgs,
    update: impl FnOnce(&mut Measurements),
) -> Result<()> {
    let Some(dir) = &args.out_dir else {
        return Ok(());
    };
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("measured.toml");
    let earlier = std::fs::read_to_string(&path).ok();
    let card = format!("{} (cuda:{}, sm_{})", dev.name(), dev.ordinal(), dev.arch());
    let text = merged_measurements(earlier.as_deref(), &card, update)?;
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    println!("measured rates for the planner: {}", path.display());
    Ok(())
}

/// `earlier` (a measured.toml, if any) with `update` applied, headed by the card and the
/// command the numbers came from, so the file says where they are from.
fn merged_measurements(
    earlier: Option<&str>,
    card: &str,
    update: impl FnOnce(&mut Measurements),
) -> Result<String> {
    let mut measured = match earlier {
        Some(text) => Measurements::parse(text)?,
        None => Measurements::default(),
    };
    update(&mut measured);
    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_default();
    Ok(format!(
        "# Rates measured on {card} by `meshtrain bench gpu` ({}), for\n\
         # `meshtrain plan --measured`: the GPT-2 124M step's products (median, bf16), a\n\
         # device-to-device copy, the attention kernel (forward and backward together).\n{}",
        date.trim(),
        toml::to_string(&measured)?
    ))
}

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// The `attention` part's checks (check::run_attention); returns the failures.
fn attention_check_part(dev: &Arc<CudaDevice>) -> Result<Vec<String>> {
    let seed = seed();
    println!("\n== attention: the kernels against the CPU (seed {seed})");
    let results = check::run_attention(dev, seed, &mut |r| println!("{r}"));
    Ok(failures("attention", &results))
}

/// The failed checks of `results`, after a line saying how many of them passed.
fn failures(what: &str, results: &[CheckResult]) -> Vec<String> {
    let failed: Vec<String> = results
        .iter()
        .filter(|r| !r.passed)
        .map(|r| r.to_string())
        .collect();
    println!(
        "{what}: {} of {} checks passed",
        results.len() - failed.len(),
        results.len()
    );
    failed
}

/// The `check` part; returns the failures.
fn check_part(dev: &Arc<CudaDevice>, args: &BenchGpuArgs) -> Result<Vec<String>> {
    let seed = seed();
    println!("\n== check: every device kernel against its CPU twin (seed {seed})");
    let mut results = check::run_all(dev, seed, &mut |r| println!("{r}"));
    let optimizers = check_optimizers(dev, seed ^ 0x0b7);
    optimizers.iter().for_each(|r| println!("{r}"));
    results.extend(optimizers);
    let mut failed = failures("kernels", &results);
    for model in [
        Compared::Gpt,
        Compared::GptTanh,
        Compared::Llama,
        Compared::Qwen3,
        Compared::Mistral,
    ] {
        let name = model.name();
        println!("\n== check: 20 {name} steps on the GPU against the CPU");
        match compare_model(args, model) {
            Ok(lines) => {
                for (ok, line) in lines {
                    println!("{} {line}", if ok { "ok  " } else { "FAIL" });
                    if !ok {
                        failed.push(line);
                    }
                }
            }
            Err(e) => {
                println!("FAIL {name} comparison: {e:#}");
                failed.push(format!("{name} comparison: {e:#}"));
            }
        }
    }
    Ok(failed)
}

/// AdamW and SGD on the device against `Optimizer::step` on the host: two parameter groups,
/// a clipping factor, the 16-bit copy refreshed, three steps; and the gradient norm.
fn check_optimizers(dev: &Arc<CudaDevice>, seed: u64) -> Vec<CheckResult> {
    let mut out = Vec::new();
    let mut rng = SplitMix64::new(seed);
    let n = 100_003;
    let split = 40_000;
    let segments = vec![
        Segment {
            range: 0..split,
            hyper: GroupHyper {
                weight_decay: 0.1,
                lr_scale: 1.0,
            },
        },
        Segment {
            range: split..n,
            hyper: GroupHyper {
                weight_decay: 0.0,
                lr_scale: 0.5,
            },
        },
    ];
    let configs = [
        OptimizerConfig::Adamw {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.1,
        },
    ];
    for config in configs {
        let name = match config {
            OptimizerConfig::Adamw { .. } => "AdamW",
            OptimizerConfig::Sgd { .. } => "SGD",
        };
        let r = (|| -> Result<Vec<CheckResult>, CudaError> {
            let mut p: Vec<f32> = (0..n).map(|_| rng.normal() * 0.5).collect();
            let mut host = Optimizer::with_segments(config, n, segments.clone());
            let rows = meshtrain_nn::optim::segment_rows(&segments);
            let table = SegmentTable::new(dev, &rows)?;
            let p_dev = CudaTensor::from_host(dev, &p, DType::F32)?;
            let half = CudaTensor::alloc(dev, n, DType::BF16, "half copy")?;
            let m = CudaTensor::zeros(dev, n, DType::F32, "m")?;
            let v = CudaTensor::zeros(dev, n, DType::F32, "v")?;
            let scalars = dev.alloc_zeroed(8 + train_ops::SCHEDULE_BYTES, "norm")?;
            let mut norms = (0.0f32, 0.0f32);
            for step in 1..=3u64 {
                let g: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
                let g_dev = CudaTensor::from_host(dev, &g, DType::F32)?;
                // Clip to a norm below the gradients' (so the factor is used).
                let clip = 100.0;
                train_ops::grad_norm(
                    dev,
                    g_dev.ptr(),
                    std::slice::from_ref(&(0..n)),
                    Some(clip),
                    scalars.ptr(),
                    None,
                )?;
                let mut clipped = g.clone();
                let host_norm = meshtrain_nn::optim::clip_grad_norm(&mut clipped, clip);
                let lr = 1e-3;
                host.step(&mut p, &clipped, lr);
                let state = FlatState {
                    params: p_dev.ptr(),
                    grads: g_dev.ptr(),
                    m: m.ptr(),
                    v: v.ptr(),
                    half: Some((half.ptr(), DType::BF16)),
                    len: n,
                };
                let mul = Some(scalars.ptr() + 4);
                match config {
                    OptimizerConfig::Adamw {
                        beta1, beta2, eps, ..
                    } => train_ops::adamw(
                        dev,
                        state,
                        &table,
                        AdamW {
                            lr,
                            beta1,
                            beta2,
                            eps,
                            step,
                        },
                        mul,
                        scalars.ptr() + 8,
                    )?,
                    OptimizerConfig::Sgd { momentum, .. } => train_ops::sgd(
                        dev,
                        state,
                        &table,
                        train_ops::Sgd { lr, momentum, step },
                        mul,
                        scalars.ptr() + 8,
                    )?,
                }
                let got: Vec<f32> = dev.download(scalars.ptr(), 2)?;
                norms = (got[0], host_norm);
            }
            let mut half_want = p.clone();
            meshtrain_tensor::dtype::round_through_bf16(&mut half_want);
            Ok(vec![
                result(
                    format!("{name} parameters (3 steps, 2 groups, clipped)"),
                    &p_dev.to_host_f32()?,
                    &p,
                    1e-5,
                ),
                result(
                    format!("{name} bf16 compute copy"),
                    &half.to_host_f32()?,
                    &half_want,
                    1e-2,
                ),
                result(
                    format!("{name} gradient norm"),
                    &[norms.0],
                    &[norms.1],
                    1e-5,
                ),
            ])
        })();
        match r {
            Ok(v) => out.extend(v),
            Err(e) => out.push(CheckResult {
                name: format!("{name} optimizer"),
                rel_err: f64::INFINITY,
                tolerance: 0.0,
                passed: false,
                error: Some(e.to_string()),
            }),
        }
    }
    out
}

/// One run of `model`'s config (`configs/gpt.toml` or `configs/llama.toml`, changed by
/// `overrides`) for 20 steps: the final parameters and each step's loss.
fn model_run(root: &Path, model: Compared, overrides: &[String]) -> Result<GptRun> {
    let mut o = vec!["train.steps=20".to_string()];
    o.extend(model.overrides().iter().map(|s| s.to_string()));
    o.extend(overrides.iter().cloned());
    let run = train_and_read(root, model.config(), &o, None)?;
    let _ = std::fs::remove_dir_all(&run.out);
    Ok((run.params, run.losses))
}

/// What a run of the GPU checks left.
pub(crate) struct Trained {
    /// The whole model's parameters, read back from the run's checkpoint by one worker on
    /// the CPU (so any layout and device compare).
    pub params: Vec<f32>,
    /// Its buffers (batch norm's running statistics), read back alike.
    pub buffers: Vec<f32>,
    /// The training loss of every step.
    pub losses: Vec<f64>,
    /// The run's directory (its checkpoint: `checkpoint.safetensors`, or `checkpoint/` when
    /// sharded); the caller removes it.
    pub out: PathBuf,
    /// World rank 0's model states, measured on its device and predicted by the planner.
    pub memory: meshtrain_train::memory::MemoryReport,
}

/// One run of `file` (a config under `root`, changed by `overrides`: losses logged every
/// step, no evaluation, the checkpoint written in the foreground), resumed from `resume`
/// when given.
pub(crate) fn train_and_read(
    root: &Path,
    file: &str,
    overrides: &[String],
    resume: Option<&Path>,
) -> Result<Trained> {
    let out = std::env::temp_dir().join(format!("meshtrain-gpu-check-{}", seed()));
    let mut o: Vec<String> = [
        "train.log_every=1",
        "train.eval_every=1000",
        "train.eval_batches=1",
        "schedule.warmup_steps=5",
        "train.checkpoint_background=false",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    o.push(format!("train.out_dir=\"{}\"", out.display()));
    o.extend(overrides.iter().cloned());
    o.extend(EXTRA_OVERRIDES.get().into_iter().flatten().cloned());
    let text = std::fs::read_to_string(root.join(file))
        .with_context(|| format!("reading {}/{file}", root.display()))?;
    let cfg = Config::from_toml_with_overrides(&text, &o)?;
    cfg.validate()?;
    let task = Task::load(&cfg)?;
    let job = cfg.job(&task)?;
    let options = RunOptions {
        resume: resume.map(Path::to_path_buf),
        ..RunOptions::default()
    };
    let summary = job.clone().run(&options)?;
    // The parameters, as a resumed one-worker trainer on the CPU holds them.
    let mut cpu = cfg.clone();
    cpu.train.device = meshtrain_tensor::Device::Cpu;
    let p = &mut cpu.parallel;
    (p.dp, p.tp, p.pp, p.cp, p.sequence_parallel) = (1, 1, 1, 1, false);
    (p.micro_batches, p.layout, p.timeline) = (1, None, None);
    p.stand_in_device = false;
    let cpu_job = Arc::new(cpu.job(&task)?);
    let mut t = cpu_job.trainer(ThreadsWorld::single(CommConfig::default()), None)?;
    // A whole file, or (ZeRO's default) a sharded checkpoint.
    let sharded = out.join("checkpoint");
    t.resume(&match sharded.is_dir() {
        true => sharded,
        false => out.join("checkpoint.safetensors"),
    })?;
    let params = t.local_params();
    let buffers = t.local_buffers();
    let mut losses = Vec::new();
    for line in std::fs::read_to_string(out.join("metrics.jsonl"))?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        if v["kind"] == "train" {
            losses.push(v["loss"].as_f64().unwrap_or(f64::NAN));
        }
    }
    Ok(Trained {
        params,
        buffers,
        losses,
        out,
        memory: summary.memory,
    })
}

/// A run's final parameters and its losses, step by step.
type GptRun = (Vec<f32>, Vec<f64>);

/// A model the GPU check trains on both devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Compared {
    Gpt,
    /// The GPT config with GPT-2's tanh GELU, in 16 bits only: its first MLP layer's GELU in
    /// the product's epilogue, the bias gradients in the weight gradients' (f32 keeps the
    /// kernels, which the `Gpt` runs compare).
    GptTanh,
    Llama,
    /// The Llama config as Qwen3's block: heads of 128 (wider than dim / heads) and the
    /// q/k norms.
    Qwen3,
    /// The Llama config as Mistral's: a sliding window of 5 of its 128 positions (the key
    /// tile before the diagonal one cut by the window in every kernel; whole tiles skipped
    /// are the emulator's and the `check` part's kernel comparisons).
    Mistral,
}

impl Compared {
    fn config(self) -> &'static str {
        match self {
            Compared::Gpt | Compared::GptTanh => "configs/gpt.toml",
            Compared::Llama | Compared::Qwen3 | Compared::Mistral => "configs/llama.toml",
        }
    }

    /// What makes the config this model.
    fn overrides(self) -> &'static [&'static str] {
        match self {
            Compared::Qwen3 => &["model.head_dim=128", "model.qk_norm=true"],
            Compared::Mistral => &["model.sliding_window=5"],
            Compared::GptTanh => &["model.gelu=\"tanh\""],
            _ => &[],
        }
    }

    /// Whether the comparison runs in `precision` (every one unless the model says).
    fn runs_in(self, precision: &str) -> bool {
        match self {
            Compared::GptTanh => matches!(precision, "bf16" | "fp16"),
            _ => true,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Compared::Gpt => "GPT",
            Compared::GptTanh => "GPT (tanh GELU)",
            Compared::Llama => "Llama",
            Compared::Qwen3 => "Qwen3",
            Compared::Mistral => "Mistral (sliding window)",
        }
    }
}

/// GPU against CPU, 20 steps of `model`: (passed, line) per comparison. fp32 compares the
/// parameters (≤ 1e-4 relative L2); bf16, fp16 (with loss scaling), fp32 with TF32
/// products and, on a card with FP8 tensor cores, fp8 compare every step's loss (≤ 1%);
/// fp32 and bf16 also run twice on the GPU and must agree bit for bit.
fn compare_model(args: &BenchGpuArgs, model: Compared) -> Result<Vec<(bool, String)>> {
    let name = model.name();
    let mut lines = Vec::new();
    let gpu = format!("train.device=\"cuda:{}\"", args.device);
    let mut cases: Vec<(&str, &str, &[&str])> = vec![
        ("fp32", "fp32", &[]),
        ("bf16", "bf16", &[]),
        ("fp16", "fp16", &[]),
        ("fp32 with TF32", "fp32", &["train.tf32=true"]),
    ];
    // FP8 products (Ada, Hopper) against the CPU's FP8 twin.
    let card =
        meshtrain_tensor::cuda::CudaDevice::get(args.device).map_err(|e| anyhow::anyhow!("{e}"))?;
    if card.has_fp8_tensor_cores() {
        cases.push(("fp8", "fp8", &[]));
    }
    cases.retain(|(_, precision, _)| model.runs_in(precision));
    let mut cpu_runs: Vec<(&str, GptRun)> = Vec::new();
    for (label, precision, extra) in cases {
        let p = format!("train.precision=\"{precision}\"");
        let (cpu_params, cpu_losses) = match cpu_runs.iter().find(|(k, _)| *k == precision) {
            Some((_, run)) => run.clone(),
            None => {
                let run = model_run(&args.root, model, std::slice::from_ref(&p))?;
                cpu_runs.push((precision, run.clone()));
                run
            }
        };
        let mut gpu_overrides = vec![p.clone(), gpu.clone()];
        gpu_overrides.extend(extra.iter().map(|s| s.to_string()));
        let t = Instant::now();
        let (gpu_params, gpu_losses) = model_run(&args.root, model, &gpu_overrides)?;
        let gpu_s = t.elapsed().as_secs_f64();
        let rel = rel_l2(&gpu_params, &cpu_params);
        let worst_loss = gpu_losses
            .iter()
            .zip(&cpu_losses)
            .map(|(g, c)| ((g - c) / c).abs())
            .fold(0.0f64, f64::max);
        let lengths = gpu_losses.len() == cpu_losses.len() && !gpu_losses.is_empty();
        let finals = format!(
            "final loss GPU {:.4} CPU {:.4}; {gpu_s:.1} s",
            gpu_losses.last().unwrap_or(&f64::NAN),
            cpu_losses.last().unwrap_or(&f64::NAN)
        );
        if label == "fp32" {
            lines.push((
                rel <= 1e-4 && lengths,
                format!(
                    "{name} fp32, 20 steps: parameters GPU vs CPU relative L2 {rel:.2e} (≤ 1e-4); \
                     losses differ by at most {:.2e} relative; {finals}",
                    worst_loss
                ),
            ));
        } else {
            lines.push((
                worst_loss <= 0.01 && lengths,
                format!(
                    "{name} {label}, 20 steps: every step's loss within {:.3}% of the CPU's \
                     (≤ 1%); parameters relative L2 {rel:.2e}; {finals}",
                    worst_loss * 100.0
                ),
            ));
        }
        if label == "fp32" || label == "bf16" {
            let (again_params, again_losses) = model_run(&args.root, model, &gpu_overrides)?;
            let identical = again_params
                .iter()
                .zip(&gpu_params)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && again_params.len() == gpu_params.len()
                && again_losses == gpu_losses;
            lines.push((
                identical,
                format!("{name} {label}: two GPU runs bit-identical (parameters and losses)"),
            ));
        }
    }
    Ok(lines)
}

/// Device milliseconds of one run of `f`: the median over 5 batches of `reps` runs queued
/// back to back between two events (after 3 warm-ups), each batch's time over `reps`. Queued
/// back to back, a run does not wait for the host's launch of it: a ~40 µs kernel timed
/// alone between two events read ~6 µs of launch latency as its own time.
fn time_ms(
    dev: &CudaDevice,
    reps: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64> {
    for _ in 0..3 {
        f().map_err(cuda)?;
    }
    let reps = reps.max(1);
    let mut times = Vec::with_capacity(5);
    for _ in 0..5 {
        let a = dev.record_event().map_err(cuda)?;
        for _ in 0..reps {
            f().map_err(cuda)?;
        }
        let b = dev.record_event().map_err(cuda)?;
        times.push(a.ms_until(&b).map_err(cuda)? as f64 / reps as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn random_tensor(
    dev: &Arc<CudaDevice>,
    rng: &mut SplitMix64,
    n: usize,
    dtype: DType,
    scale: f32,
) -> Result<CudaTensor> {
    // Hundreds of millions of values for the largest shapes: drawn in parallel, each chunk
    // from its own stream.
    use rayon::prelude::*;
    let base = rng.next_u64();
    let mut v = vec![0.0f32; n];
    v.par_chunks_mut(1 << 20)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut r = SplitMix64::derive(base, i as u64);
            chunk.iter_mut().for_each(|x| *x = r.normal() * scale);
        });
    CudaTensor::from_host(dev, &v, dtype).map_err(cuda)
}

/// The `products` part.
/// The `products` part; returns the median rate of our choices, TFLOP/s.
fn products(dev: &Arc<CudaDevice>, args: &BenchGpuArgs) -> Result<f64> {
    println!("\n== products: a GPT-2 124M step's matrix products (16384 tokens, bf16 in, f32 accumulation) against cuBLASLt's best algorithm");
    println!(
        "{:<34} {:>9} {:>11} {:>11} {:>8}",
        "product", "algos", "ours TF/s", "best TF/s", "ours/best"
    );
    let rows = 16 * 1024;
    let mut rng = SplitMix64::new(seed());
    let bf = DType::BF16;
    let shapes: [(&str, usize, usize, bool); 5] = [
        ("qkv", 768, 2304, true),
        ("proj", 768, 768, true),
        ("fc1", 768, 3072, true),
        ("fc2", 3072, 768, true),
        ("lm head", 768, 50304, false),
    ];
    let mut worst: f64 = 1.0;
    let mut rates = Vec::new();
    for (name, inputs, outputs, bias) in shapes {
        let x = random_tensor(dev, &mut rng, rows * inputs, bf, 1.0)?;
        let w = random_tensor(dev, &mut rng, inputs * outputs + outputs, bf, 0.02)?;
        let dy = random_tensor(dev, &mut rng, rows * outputs, bf, 1.0)?;
        let y = CudaTensor::alloc(dev, rows * outputs, bf, "y").map_err(cuda)?;
        let dx = CudaTensor::alloc(dev, rows * inputs, bf, "dx").map_err(cuda)?;
        let dw = CudaTensor::zeros(dev, inputs * outputs, DType::F32, "dw").map_err(cuda)?;
        let linear = LinearProducts {
            shape: LinearShape {
                rows,
                inputs,
                outputs,
            },
            precision: bf,
            math: F32Math::Exact,
        };
        let bias_ptr = bias.then(|| w.ptr() + (inputs * outputs * 2) as u64);
        let products = [
            (
                format!("{name} forward"),
                linear.forward(x.ptr(), w.ptr(), bias_ptr, y.ptr()),
            ),
            (
                format!("{name} input grad"),
                linear.input_grad(dy.ptr(), w.ptr(), dx.ptr()),
            ),
            (
                format!("{name} weight grad"),
                linear.weight_grad(x.ptr(), dy.ptr(), dw.ptr()),
            ),
        ];
        for (label, g) in products {
            let algos = dev.with_blas(|b| b.algorithms(&g)).map_err(cuda)?;
            // Our choice made on these operands, as a step makes it on its own.
            dev.with_blas(|b| b.retune(&g)).map_err(cuda)?;
            let ours = time_ms(dev, args.reps, || dev.with_blas(|b| b.gemm(&g)))?;
            let mut best = ours;
            for choice in 0..algos {
                let t = time_ms(dev, args.reps, || {
                    dev.with_blas(|b| b.gemm_with(&g, choice))
                })?;
                best = best.min(t);
            }
            let tf = |ms: f64| g.flops() / (ms * 1e-3) / 1e12;
            worst = worst.min(best / ours);
            rates.push(tf(ours));
            println!(
                "{label:<34} {algos:>9} {:>11.0} {:>11.0} {:>8.3}",
                tf(ours),
                tf(best),
                best / ours
            );
        }
    }
    println!("products: the slowest is at {worst:.3} of cuBLASLt's best algorithm for its shape");
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}

/// The `kernels` part: bandwidth of each fused kernel against a device-to-device copy;
/// returns the copy rate (GB/s) and the attention kernel's rate (TFLOP/s, forward and
/// backward together, as the planner counts them).
fn kernels(dev: &Arc<CudaDevice>, args: &BenchGpuArgs) -> Result<(f64, f64)> {
    println!(
        "\n== kernels: bandwidth against a device-to-device copy (GPT-2 124M shapes, 16384 tokens)"
    );
    let mut rng = SplitMix64::new(seed());
    let (rows, d, hidden, vocab) = (16 * 1024, 768, 3072, 50304);
    let copy_bytes = 1usize << 30;
    let a = dev.alloc(copy_bytes, "copy source").map_err(cuda)?;
    let b = dev.alloc(copy_bytes, "copy target").map_err(cuda)?;
    let copy_ms = time_ms(dev, args.reps, || dev.copy(b.ptr(), a.ptr(), copy_bytes))?;
    let copy_gbs = 2.0 * copy_bytes as f64 / (copy_ms * 1e-3) / 1e9;
    println!("device-to-device copy: {copy_gbs:.0} GB/s (read + write)");
    println!(
        "{:<44} {:>9} {:>9} {:>9}",
        "kernel", "ms", "GB/s", "vs copy"
    );
    let report = |name: &str, ms: f64, bytes: f64| {
        let gbs = bytes / (ms * 1e-3) / 1e9;
        println!("{name:<44} {ms:>9.3} {gbs:>9.0} {:>9.2}", gbs / copy_gbs);
    };
    let bf = DType::BF16;
    let n = rows * d;
    let x = random_tensor(dev, &mut rng, n, DType::F32, 1.0)?;
    let p = random_tensor(dev, &mut rng, 2 * d, DType::F32, 1.0)?;
    // SAFETY: `p` holds 2·d values for the views' life.
    let params = unsafe { DeviceParams::new(dev, p.ptr(), None, 2 * d) };
    let ms = time_ms(dev, args.reps, || {
        ops::layer_norm_forward(&x, params, d, 1e-5, bf, true).map(|_| ())
    })?;
    report("layer norm forward (f32 in, bf16 out)", ms, n as f64 * 6.0);
    let (_, stats) = ops::layer_norm_forward(&x, params, d, 1e-5, bf, true).map_err(cuda)?;
    let (mean, rstd) = stats.expect("kept");
    let dy = random_tensor(dev, &mut rng, n, bf, 1.0)?;
    let g = CudaTensor::zeros(dev, 2 * d, DType::F32, "grads").map_err(cuda)?;
    let ms = time_ms(dev, args.reps, || {
        // SAFETY: `g` holds 2·d values.
        let grads = unsafe { DeviceGrads::new(dev, g.ptr(), 2 * d) };
        ops::layer_norm_backward(&x, params, &mean, &rstd, &dy, grads, d, None, false).map(|_| ())
    })?;
    report(
        "layer norm backward (dx + dγ/dβ)",
        ms,
        n as f64 * (4.0 + 2.0 + 4.0 + 4.0 + 2.0),
    );
    let h = random_tensor(dev, &mut rng, rows * hidden, bf, 1.0)?;
    let ms = time_ms(dev, args.reps, || {
        ops::activation_forward(&h, ops::ActKind::Gelu).map(|_| ())
    })?;
    report("GELU forward (bf16)", ms, (rows * hidden) as f64 * 4.0);
    let dh = random_tensor(dev, &mut rng, rows * hidden, bf, 1.0)?;
    let ms = time_ms(dev, args.reps, || {
        ops::activation_backward(&h, &dh, ops::ActKind::Gelu).map(|_| ())
    })?;
    report("GELU backward (bf16)", ms, (rows * hidden) as f64 * 6.0);
    let r = random_tensor(dev, &mut rng, n, bf, 1.0)?;
    let ms = time_ms(dev, args.reps, || ops::add(x.clone(), &r).map(|_| ()))?;
    report("residual add (f32 + bf16 -> f32)", ms, n as f64 * 10.0);
    let ms = time_ms(dev, args.reps, || ops::to_dtype(&x, bf).map(|_| ()))?;
    report("convert f32 -> bf16", ms, n as f64 * 6.0);
    let out = dev.alloc(hidden * 4, "column sums").map_err(cuda)?;
    let ms = time_ms(dev, args.reps, || {
        ops::column_sums(&h, rows, hidden, out.ptr(), true)
    })?;
    report(
        "bias gradient (column sums, bf16)",
        ms,
        (rows * hidden) as f64 * 2.0,
    );
    let logits = random_tensor(dev, &mut rng, rows * vocab, bf, 2.0)?;
    let targets: Vec<i32> = (0..rows).map(|_| rng.below(vocab as u64) as i32).collect();
    let t = dev.upload(&targets, "targets").map_err(cuda)?;
    let sums = dev.alloc_zeroed(16, "sums").map_err(cuda)?;
    // The kernel overwrites the logits with their gradient and hands the buffer back: each
    // repetition reads the previous one's output (finite values of the same size).
    let mut held = Some(logits);
    let ms = time_ms(dev, args.reps, || {
        let l = held.take().expect("the logits are handed back");
        let g = ops::cross_entropy(l, t.ptr(), rows, vocab, Some(1e-4), sums.ptr())?;
        held = g;
        Ok(())
    })?;
    report(
        "softmax + cross-entropy (bf16 logits, grad in place)",
        ms,
        (rows * vocab) as f64 * 4.0,
    );
    let params_n = 124_475_904usize;
    let pv = random_tensor(dev, &mut rng, params_n, DType::F32, 0.02)?;
    let gv = random_tensor(dev, &mut rng, params_n, DType::F32, 1e-3)?;
    let m = CudaTensor::zeros(dev, params_n, DType::F32, "m").map_err(cuda)?;
    let v = CudaTensor::zeros(dev, params_n, DType::F32, "v").map_err(cuda)?;
    let half = CudaTensor::alloc(dev, params_n, bf, "half").map_err(cuda)?;
    let table = SegmentTable::new(
        dev,
        &[SegmentRow {
            end: params_n,
            weight_decay: 0.1,
            lr_scale: 1.0,
        }],
    )
    .map_err(cuda)?;
    let schedule = dev
        .alloc(train_ops::SCHEDULE_BYTES, "schedule")
        .map_err(cuda)?;
    let mut step = 0;
    let ms = time_ms(dev, args.reps, || {
        step += 1;
        train_ops::adamw(
            dev,
            FlatState {
                params: pv.ptr(),
                grads: gv.ptr(),
                m: m.ptr(),
                v: v.ptr(),
                half: Some((half.ptr(), bf)),
                len: params_n,
            },
            &table,
            AdamW {
                lr: 3e-4,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                step,
            },
            None,
            schedule.ptr(),
        )
    })?;
    report(
        "AdamW over 124M parameters (+ bf16 copy)",
        ms,
        params_n as f64 * 30.0,
    );
    let scalars = dev.alloc_zeroed(8, "norm").map_err(cuda)?;
    let ms = time_ms(dev, args.reps, || {
        train_ops::grad_norm(
            dev,
            gv.ptr(),
            std::slice::from_ref(&(0..params_n)),
            Some(1.0),
            scalars.ptr(),
            None,
        )
    })?;
    report("gradient norm over 124M", ms, params_n as f64 * 4.0);
    let attention_tflops = attention_rates(dev, args)?;
    Ok((copy_gbs, attention_tflops))
}

/// Attention's FLOP rate (causal: half the score matrix), at GPT-2's shape and at the Llama
/// 3.2 1B shape's (4 × 2048 tokens, 32 heads of 64): the kernels a step runs
/// (MESHTRAIN_ATTENTION_KERNELS), and on Hopper both kinds. Returns the rate of the step's
/// kernels at GPT-2's shape (forward and backward together, as the planner counts them).
fn attention_rates(dev: &Arc<CudaDevice>, args: &BenchGpuArgs) -> Result<f64> {
    let bf = DType::BF16;
    let mut rng = SplitMix64::new(seed());
    let chosen = ops::AttentionProducts::chosen(dev, bf, 64).map_err(cuda)?;
    let mut kinds = vec![ops::AttentionProducts::MmaSync];
    if ops::AttentionProducts::warpgroup_fits(dev, bf, 64) {
        kinds.push(ops::AttentionProducts::Warpgroup);
    }
    let mut chosen_tflops = 0.0;
    for (batch, seq, heads) in [(16, 1024, 12), (4, 2048, 32)] {
        let shape = AttnShape {
            batch,
            seq,
            heads,
            head_dim: 64,
        };
        let tokens = batch * seq;
        let qkv = random_tensor(dev, &mut rng, tokens * 3 * heads * 64, bf, 1.0)?;
        let dout = random_tensor(dev, &mut rng, tokens * heads * 64, bf, 1.0)?;
        let flops = 4.0 * (batch * heads) as f64 * (seq * seq) as f64 * 64.0 / 2.0;
        for &products in &kinds {
            let fwd = time_ms(dev, args.reps, || {
                ops::attention_forward_with(&qkv, shape, None, products).map(|_| ())
            })?;
            let (o, lse) =
                ops::attention_forward_with(&qkv, shape, None, products).map_err(cuda)?;
            let bwd = time_ms(dev, args.reps, || {
                ops::attention_backward_with(&qkv, &o, &lse, &dout, shape, None, products)
                    .map(|_| ())
            })?;
            let kind = products.name();
            println!(
                "attention ({kind}) {batch}×{seq}, {heads} heads of 64 (causal): forward {fwd:.3} ms ({:.0} TFLOP/s), backward {bwd:.3} ms ({:.0} TFLOP/s of 2.5× the forward's FLOPs)",
                flops / (fwd * 1e-3) / 1e12,
                2.5 * flops / (bwd * 1e-3) / 1e12
            );
            if products == chosen && seq == 1024 {
                chosen_tflops = 3.5 * flops / ((fwd + bwd) * 1e-3) / 1e12;
            }
        }
    }
    Ok(chosen_tflops)
}

/// A model the `step` part times, with the anchors it is measured beside.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StepModel {
    /// GPT-2 small as PyTorch's `pytorch_gpt2_bench.py` and llm.c train it: 12 layers, width
    /// 768, 12 heads, 1024 tokens, vocabulary 50304, tied embeddings, tanh GELU.
    #[value(name = "gpt2-124m")]
    Gpt2Small,
    /// The shape of Llama 3.2 1B (`configs/llama-1b.toml`), beside
    /// `pytorch_llama_bench.py`: 16 layers, width 2048, 32 heads over 8 key/value heads,
    /// SwiGLU 8192, vocabulary 128,256, tied, 2,048 tokens.
    #[value(name = "llama-1b")]
    Llama1b,
    /// The same Llama 1B step with `--precision fp8` (its blocks' linear products in FP8):
    /// its tokens/s against `llama-1b`'s of the same call is FP8's speed-up, its MFU still
    /// counted against the bf16 peak.
    #[value(name = "llama-1b-fp8")]
    Llama1bFp8,
}

impl StepModel {
    fn name(self) -> &'static str {
        match self {
            StepModel::Gpt2Small => "gpt2-124m",
            StepModel::Llama1b => "llama-1b",
            StepModel::Llama1bFp8 => "llama-1b-fp8",
        }
    }

    /// The precision the step trains in.
    fn precision(self) -> &'static str {
        match self {
            StepModel::Llama1bFp8 => "fp8",
            _ => "bf16",
        }
    }

    /// The batch PyTorch's anchor for this model runs (sequences).
    fn default_batch(self) -> usize {
        match self {
            StepModel::Gpt2Small => 16,
            StepModel::Llama1b | StepModel::Llama1bFp8 => 4,
        }
    }

    /// The config the model's step trains, under the repository root.
    fn config_file(self) -> &'static str {
        match self {
            StepModel::Gpt2Small => "configs/gpt.toml",
            StepModel::Llama1b | StepModel::Llama1bFp8 => "configs/llama-1b.toml",
        }
    }

    /// What turns the config into the timed model, trained as its PyTorch anchor trains
    /// (bf16 autocast, AdamW with β₂ 0.999 and weight decay 0.1, clipping at 1.0).
    fn overrides(self) -> &'static [&'static str] {
        match self {
            StepModel::Gpt2Small => &[
                "model.vocab=50304",
                "model.dim=768",
                "model.layers=12",
                "model.heads=12",
                "model.seq=1024",
                "model.tie_embeddings=true",
                // The GELU PyTorch's anchor (`approximate="tanh"`) and llm.c compute, and
                // the one cuBLASLt's epilogue takes.
                "model.gelu=\"tanh\"",
                "train.precision=\"bf16\"",
                "optimizer.beta2=0.999",
            ],
            StepModel::Llama1b => &["train.precision=\"bf16\"", "optimizer.beta2=0.999"],
            StepModel::Llama1bFp8 => &["train.precision=\"fp8\"", "optimizer.beta2=0.999"],
        }
    }

    /// The `RESULT` line's tag (GPT-2's stays `meshtrain`, as in the earlier logs).
    fn result_tag(self) -> &'static str {
        match self {
            StepModel::Gpt2Small => "meshtrain",
            StepModel::Llama1b => "meshtrain-llama-1b",
            StepModel::Llama1bFp8 => "meshtrain-llama-1b-fp8",
        }
    }
}

/// The config `model`'s timed step trains, with `batch` sequences per step on `device`.
fn step_config(root: &Path, model: StepModel, batch: usize, device: usize) -> Result<Config> {
    let overrides: Vec<String> = model
        .overrides()
        .iter()
        .map(|s| s.to_string())
        .chain([
            "train.steps=1000".to_string(),
            "train.eval_every=100000".to_string(),
            "schedule.warmup_steps=10".to_string(),
            "schedule.lr=3e-4".to_string(),
            "optimizer.weight_decay=0.1".to_string(),
            "train.grad_clip=1.0".to_string(),
            format!("train.batch_size={batch}"),
            format!("train.device=\"cuda:{device}\""),
            format!("train.out_dir=\"/tmp/meshtrain-{}-bench\"", model.name()),
        ])
        .collect();
    let file = model.config_file();
    let text = std::fs::read_to_string(root.join(file))
        .with_context(|| format!("reading {}/{file}", root.display()))?;
    let cfg = Config::from_toml_with_overrides(&text, &overrides)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Training FLOPs per token as the PyTorch anchors and llm.c count them for model FLOPs
/// utilisation: 6 per parameter (a tied embedding once) for the weight products, plus
/// 12·layers·width·seq for attention's scores and values with the causal half counted whole.
pub fn training_flops_per_token(params: usize, layers: usize, width: usize, seq: usize) -> f64 {
    6.0 * params as f64 + 12.0 * (layers * width * seq) as f64
}

/// The dense bf16 peak of a card named `card` (as the driver names it), from the planner's
/// cluster presets; `None` for a card they do not describe.
pub fn card_bf16_peak_flops(card: &str) -> Option<f64> {
    let card = card.to_ascii_uppercase();
    let preset = ["H200", "H100", "A100"]
        .into_iter()
        .find(|name| card.contains(name))?;
    let cluster = meshtrain_plan::presets::cluster(&preset.to_ascii_lowercase()).ok()?;
    Some(cluster.peak_flops(meshtrain_plan::Precision::Bf16))
}

/// The `step` part: each of `--models`' training steps on the GPU, timed, its peak device
/// memory, its model FLOPs utilisation, and one profiled step's kernels.
fn step(args: &BenchGpuArgs) -> Result<()> {
    for &model in &args.models {
        step_of(args, model)?;
    }
    Ok(())
}

fn step_of(args: &BenchGpuArgs, model: StepModel) -> Result<()> {
    let batch = args.batch.unwrap_or(model.default_batch());
    let cfg = step_config(&args.root, model, batch, args.device)?;
    let (layers, width, seq, shape) = match &cfg.model {
        crate::config::ModelConfig::Gpt(g) => (
            g.layers,
            g.dim,
            g.seq,
            format!(
                "{} layers, {} wide, {} heads, vocabulary {}",
                g.layers, g.dim, g.heads, g.vocab
            ),
        ),
        crate::config::ModelConfig::Llama(l) => (
            l.layers,
            l.dim,
            l.seq,
            format!(
                "{} layers, {} wide, {} heads over {} key/value heads, SwiGLU {}, vocabulary {}",
                l.layers, l.dim, l.heads, l.kv_heads, l.ffn, l.vocab
            ),
        ),
        _ => bail!("the step part times language models"),
    };
    println!(
        "\n== step: {} ({shape}, tied embeddings), batch {batch} × {seq}, {}, AdamW, clip 1.0",
        model.name(),
        model.precision(),
    );
    let task = Task::load(&cfg)?;
    let job = Arc::new(cfg.job(&task)?);
    let t = Instant::now();
    let mut trainer = job.trainer(ThreadsWorld::single(CommConfig::default()), None)?;
    let params = trainer.whole.num_unique_params();
    println!(
        "model built and uploaded in {:.1} s: {params} parameters",
        t.elapsed().as_secs_f64(),
    );
    let dev = CudaDevice::get(args.device).map_err(cuda)?;
    let mut losses = Vec::new();
    for _ in 0..3 {
        losses.push(trainer.train_step()?.loss);
    }
    let warm = trainer.breakdown.clone();
    let mut times = Vec::new();
    for _ in 0..args.steps {
        let t = Instant::now();
        let s = trainer.train_step()?;
        times.push(t.elapsed().as_secs_f64());
        losses.push(s.loss);
    }
    if let Some(dir) = &args.out_dir {
        // The timed steps' breakdown, as `train` writes it, for `meshtrain plan --compare`.
        let mut timed = trainer.breakdown.since(&warm);
        timed.device_memory = trainer.parallel.device_memory();
        let path = dir.join(match model {
            StepModel::Gpt2Small => "breakdown.json".to_string(),
            other => format!("breakdown-{}.json", other.name()),
        });
        std::fs::create_dir_all(dir)?;
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&timed.measured_step(batch))? + "\n",
        )
        .with_context(|| format!("writing {}", path.display()))?;
        println!("the timed steps' breakdown: {}", path.display());
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let tokens = (batch * seq) as f64;
    let mem = trainer
        .parallel
        .device_memory()
        .context("the step ran on the GPU")?;
    let peak = args
        .peak_tflops
        .map(|t| t * 1e12)
        .or_else(|| card_bf16_peak_flops(dev.name()));
    let mfu = match peak {
        Some(peak) => format!(
            " mfu={:.1}%",
            100.0 * training_flops_per_token(params, layers, width, seq) * tokens / med / peak
        ),
        None => String::new(),
    };
    println!(
        "RESULT {} B={batch} T={seq} params={:.1}M step_ms={:.2} min_ms={:.2} tok_s={:.0}{mfu} peak_mem_GiB={:.2} loss={:.3}",
        model.result_tag(),
        params as f64 / 1e6,
        med * 1e3,
        times[0] * 1e3,
        tokens / med,
        mem.peak_bytes as f64 / (1u64 << 30) as f64,
        losses.last().copied().unwrap_or(f32::NAN)
    );
    println!("losses: {losses:?}");
    dev.profile_start();
    let t = Instant::now();
    trainer.train_step()?;
    let wall = t.elapsed().as_secs_f64() * 1e3;
    let table = dev.profile_finish().map_err(cuda)?;
    let total: f64 = table.iter().map(|r| r.1).sum();
    println!(
        "one profiled step: {wall:.1} ms wall, {total:.1} ms inside kernels and products ({} launches); by kernel:",
        table.iter().map(|r| r.2).sum::<usize>()
    );
    println!("{:<52} {:>9} {:>7} {:>7}", "kernel", "ms", "calls", "share");
    for (name, ms, calls) in table.iter().take(40) {
        println!(
            "{name:<52} {ms:>9.3} {calls:>7} {:>6.1}%",
            100.0 * ms / total.max(1e-9)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each part adds its rates to what earlier parts wrote, and the file names the card; the
    /// planner reads it back.
    #[test]
    fn measured_rates_merge_across_parts_and_name_the_card() {
        let card = "NVIDIA H200 (cuda:0, sm_90)";
        let first = merged_measurements(None, card, |m| {
            m.matmul_precision = Some(meshtrain_plan::Precision::Bf16);
            m.matmul_gflops = Some(700_000.0);
        })
        .unwrap();
        let both = merged_measurements(Some(&first), card, |m| {
            m.memory_bandwidth_gbps = Some(4300.0);
            m.attention_tflops = Some(120.0);
        })
        .unwrap();
        assert!(
            both.starts_with("# Rates measured on NVIDIA H200 (cuda:0, sm_90)"),
            "{both}"
        );
        let read = Measurements::parse(&both).unwrap();
        assert_eq!(read.matmul_gflops, Some(700_000.0));
        assert_eq!(read.matmul_precision, Some(meshtrain_plan::Precision::Bf16));
        assert_eq!(read.memory_bandwidth_gbps, Some(4300.0));
        assert_eq!(read.attention_tflops, Some(120.0));
        let h200 = meshtrain_plan::presets::cluster("h200").unwrap();
        assert!(read.apply(&h200).is_ok());
    }

    /// The step part's models are the shapes their PyTorch anchors build: GPT-2 small's
    /// 124M and Llama 3.2 1B's 1.24B parameters (the tied embedding once), counted from the
    /// configs the step trains; their FLOPs per token as the anchors count them.
    #[test]
    fn the_timed_models_have_the_anchors_shapes() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        for (model, params, flops) in [
            (
                StepModel::Gpt2Small,
                124_475_904,
                6.0 * 124_475_904.0 + 12.0 * 12.0 * 768.0 * 1024.0,
            ),
            (
                StepModel::Llama1b,
                1_235_814_400,
                6.0 * 1_235_814_400.0 + 12.0 * 16.0 * 2048.0 * 2048.0,
            ),
        ] {
            let cfg = step_config(&root, model, model.default_batch(), 0).unwrap();
            assert_eq!(cfg.train.precision, "bf16");
            assert_eq!(cfg.train.batch_size, model.default_batch());
            let (counted, layers, width, seq) = match &cfg.model {
                crate::config::ModelConfig::Gpt(g) => {
                    // PyTorch's anchor computes `gelu(approximate="tanh")`.
                    assert_eq!(g.gelu, meshtrain_nn::models::gpt::Gelu::Tanh);
                    (g.params(), g.layers, g.dim, g.seq)
                }
                crate::config::ModelConfig::Llama(l) => (l.params(), l.layers, l.dim, l.seq),
                other => panic!("{other:?}"),
            };
            assert_eq!(counted, params, "{model:?}");
            let plan = meshtrain_plan::presets::model(model.name()).unwrap();
            assert_eq!(
                plan.total_params() as usize,
                params,
                "{model:?} planner preset"
            );
            assert_eq!(training_flops_per_token(counted, layers, width, seq), flops);
        }
        // The fp8 step is the same model, trained in fp8.
        let bf16 = step_config(&root, StepModel::Llama1b, 4, 0).unwrap();
        let fp8 = step_config(&root, StepModel::Llama1bFp8, 4, 0).unwrap();
        assert_eq!(fp8.train.precision, "fp8");
        assert_eq!(format!("{:?}", fp8.model), format!("{:?}", bf16.model));
    }

    /// Model FLOPs utilisation is against the card's dense bf16 peak, taken from the
    /// planner's presets by the name the driver reports; an unknown card gets none.
    #[test]
    fn the_peak_comes_from_the_cards_name() {
        assert_eq!(card_bf16_peak_flops("NVIDIA H200"), Some(989e12));
        assert_eq!(card_bf16_peak_flops("NVIDIA H100 80GB HBM3"), Some(989e12));
        assert_eq!(card_bf16_peak_flops("NVIDIA A100-SXM4-80GB"), Some(312e12));
        assert_eq!(card_bf16_peak_flops("NVIDIA GeForce RTX 4090"), None);
    }

    /// The comparison's harness on the CPU alone, for both models: a run's parameters and
    /// per-step losses come back, and the same run twice gives the same bits (what the GPU
    /// check asks of the GPU).
    #[test]
    fn a_short_run_reports_its_parameters_and_losses() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let small = [
            "model.dim=32",
            "model.layers=1",
            "model.heads=2",
            "model.seq=16",
        ];
        let llama = ["model.kv_heads=1", "model.ffn=48"];
        for (model, extra) in [
            (Compared::Gpt, &[][..]),
            (Compared::GptTanh, &[][..]),
            (Compared::Llama, &llama[..]),
            (Compared::Qwen3, &llama[..]),
            (Compared::Mistral, &llama[..]),
        ] {
            let shrink: Vec<String> = small.iter().chain(extra).map(|s| s.to_string()).collect();
            let (params, losses) = model_run(&root, model, &shrink).unwrap();
            assert_eq!(losses.len(), 20, "{model:?}");
            assert!(losses.iter().all(|l| l.is_finite()), "{model:?}");
            assert!(losses[19] < losses[0], "{model:?}: {losses:?}");
            if model == Compared::GptTanh {
                // A different function from the exact GELU's model.
                let (_, erf_losses) = model_run(&root, Compared::Gpt, &shrink).unwrap();
                assert_ne!(losses, erf_losses);
                assert!(!model.runs_in("fp32") && model.runs_in("bf16"));
            }
            let (again, again_losses) = model_run(&root, model, &shrink).unwrap();
            assert_eq!(losses, again_losses, "{model:?}");
            assert!(params
                .iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
