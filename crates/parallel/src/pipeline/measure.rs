//! The measurements of `docs/pipeline.md`, as functions the CLI (`meshtrain bench pipeline`)
//! and the ignored test `pipeline_bench` call: bubble (idle fraction) per schedule, activation
//! memory per stage, the cost of recomputation, and equivalence with one worker.

use super::bench::{
    max_abs_diff, median, run_pipeline, run_reference, BenchModel, PartitionChoice, RunConfig,
};
use crate::engine::{PipelineError, ScheduleKind, SendMode};
use meshtrain_nn::models::GptConfig;
use meshtrain_nn::optim::OptimizerConfig;
use serde::Serialize;
use std::fmt::Write;
use std::time::Duration;

/// One bubble measurement.
#[derive(Clone, Debug, Serialize)]
pub struct BubbleRow {
    pub model: String,
    pub schedule: String,
    pub sends: String,
    pub workers: usize,
    pub chunks_per_worker: usize,
    pub micro_batches: usize,
    /// `1 − Σ compute / (p × step window)`, over the measured steps.
    pub measured_idle: f64,
    /// `(p−1)/(v·m + p−1)`.
    pub predicted_idle: f64,
    /// The schedule simulated with this run's measured per-chunk compute times (stage
    /// imbalance included, communication free).
    pub simulated_idle: f64,
    /// Median step time (slowest worker).
    pub step_ms: f64,
}

/// One memory / recomputation measurement.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryRow {
    pub schedule: String,
    pub workers: usize,
    pub micro_batches: usize,
    pub recompute: bool,
    /// Peak activation bytes held by each stage.
    pub peak_bytes: Vec<usize>,
    /// What one micro-batch leaves on each worker (all its chunks, measured by a plain
    /// forward), so `peak_bytes / per_micro_bytes` is the number of micro-batches in flight.
    pub per_micro_bytes: Vec<usize>,
}

/// One equivalence check.
#[derive(Clone, Debug, Serialize)]
pub struct EquivalenceRow {
    pub model: String,
    pub schedule: String,
    pub workers: usize,
    pub micro_batches: usize,
    pub steps: usize,
    /// Max |Δ| of parameters and buffers from the single worker accumulating the same
    /// micro-batches.
    pub vs_micro_batched: f32,
    /// Max |Δ| from the single worker on the whole batch (None for batch-norm models).
    pub vs_full_batch: Option<f32>,
}

/// Settings for [`bubble_sweep`].
#[derive(Clone, Debug)]
pub struct BubbleSweep {
    pub model: BenchModel,
    pub kinds: Vec<ScheduleKind>,
    pub workers: Vec<usize>,
    pub micro_batches: Vec<usize>,
    /// Samples per micro-batch.
    pub micro_batch_size: usize,
    /// Measured steps after one warm-up step.
    pub steps: usize,
    pub partition: PartitionChoice,
    /// Each layout is measured once per send mode.
    pub sends: Vec<SendMode>,
}

impl BubbleSweep {
    /// Equal-cost synthetic stages: 8 sleeping blocks (forward 2 ms, backward 4 ms each), so
    /// every worker has the same work per micro-batch whatever p and v.
    pub fn synthetic(workers: Vec<usize>, micro_batches: Vec<usize>, steps: usize) -> Self {
        BubbleSweep {
            model: BenchModel::Sleep {
                blocks: 8,
                forward: Duration::from_millis(2),
                backward: Duration::from_millis(4),
            },
            kinds: standard_kinds(),
            workers,
            micro_batches,
            micro_batch_size: 1,
            steps,
            partition: PartitionChoice::Params,
            sends: vec![SendMode::Async],
        }
    }

    /// A real GPT cut by measured block times, one core per worker (use p = 2 on 2 cores),
    /// with asynchronous and with inline sends.
    pub fn gpt(micro_batches: Vec<usize>, steps: usize) -> Self {
        BubbleSweep {
            model: BenchModel::Gpt(bench_gpt()),
            kinds: standard_kinds(),
            workers: vec![2],
            micro_batches,
            micro_batch_size: 2,
            steps,
            partition: PartitionChoice::MeasuredTime,
            sends: vec![SendMode::Async, SendMode::Inline],
        }
    }
}

/// GPipe, 1F1B and interleaved 1F1B with 2 chunks per worker.
pub fn standard_kinds() -> Vec<ScheduleKind> {
    vec![
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved {
            chunks_per_worker: 2,
        },
    ]
}

/// The GPT the real-model measurements use: 8 layers (10 blocks: the embedding and the head
/// are light, so 2 or 4 chunks of 2 or 4 layers come out equal), d = 128, sequence 64.
pub fn bench_gpt() -> GptConfig {
    GptConfig {
        vocab: 64,
        dim: 128,
        layers: 8,
        heads: 4,
        seq: 64,
        tie_embeddings: false,
        attention: Default::default(),
        gelu: Default::default(),
    }
}

fn base_config(model: BenchModel, kind: ScheduleKind, workers: usize, m: usize) -> RunConfig {
    RunConfig {
        model,
        kind,
        workers,
        micro_batches: m,
        batch: m,
        steps: 1,
        recompute: false,
        optimizer: OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        },
        lr: 0.01,
        seed: 7,
        threads_per_worker: 1,
        partition: PartitionChoice::Params,
        sends: SendMode::Async,
    }
}

fn model_name(model: &BenchModel) -> String {
    match model {
        BenchModel::Gpt(c) => format!("gpt L{} d{} T{}", c.layers, c.dim, c.seq),
        BenchModel::Resnet { width } => format!("resnet18 w{width}"),
        BenchModel::Sleep {
            blocks,
            forward,
            backward,
        } => format!(
            "sleep {blocks}×({}+{} ms)",
            forward.as_millis(),
            backward.as_millis()
        ),
    }
}

/// Measures the idle fraction of every (schedule, p, m) of the sweep; layouts a schedule
/// cannot run (interleaved with m not a multiple of p) are skipped.
pub fn bubble_sweep(sweep: &BubbleSweep) -> Result<Vec<BubbleRow>, PipelineError> {
    let mut rows = Vec::new();
    for &p in &sweep.workers {
        for &m in &sweep.micro_batches {
            for (&kind, &sends) in sweep
                .kinds
                .iter()
                .flat_map(|k| sweep.sends.iter().map(move |s| (k, s)))
            {
                if matches!(kind, ScheduleKind::Interleaved { .. }) && !m.is_multiple_of(p) {
                    continue;
                }
                let mut cfg = base_config(sweep.model, kind, p, m);
                cfg.batch = m * sweep.micro_batch_size;
                cfg.steps = sweep.steps + 1;
                cfg.partition = sweep.partition.clone();
                cfg.sends = sends;
                let run = run_pipeline(&cfg)?;
                rows.push(BubbleRow {
                    model: model_name(&sweep.model),
                    schedule: kind.to_string(),
                    sends: format!("{sends:?}").to_lowercase(),
                    workers: p,
                    chunks_per_worker: kind.chunks_per_worker(),
                    micro_batches: m,
                    measured_idle: run.idle_fraction(p, 1),
                    predicted_idle: kind.predicted_idle_fraction(p, m),
                    simulated_idle: run.simulated_idle_fraction(1)?,
                    step_ms: run.step_seconds(1) * 1e3,
                });
            }
        }
    }
    Ok(rows)
}

/// Activation bytes one micro-batch (of the run's micro-batch size) leaves on each worker:
/// the sum over the worker's chunks of a plain forward's `Activations::bytes`.
fn per_micro_bytes(
    model: BenchModel,
    partition: &crate::engine::Partition,
    schedule: &crate::engine::Schedule,
    recompute: bool,
    micro_batch_size: usize,
) -> Vec<usize> {
    let net = model.build();
    let mut store = net.init(7);
    let mut h = model.batch(micro_batch_size, 7, 0).0;
    let mut bytes = vec![0; schedule.workers];
    for (c, blocks) in partition.chunks().iter().enumerate() {
        let mode = meshtrain_nn::Mode::TRAIN;
        let (out, acts) = net.forward(&mut store, h, blocks.clone(), mode, &|_| recompute);
        bytes[schedule.worker_of(c)] += acts.bytes();
        h = out;
    }
    bytes
}

/// Peak activation memory per stage on the bench GPT: GPipe and 1F1B, each with and without
/// recomputation, and interleaved 1F1B.
pub fn memory_sweep(
    workers: usize,
    micro_batches: usize,
    micro_batch_size: usize,
    steps: usize,
) -> Result<Vec<MemoryRow>, PipelineError> {
    let v2 = ScheduleKind::Interleaved {
        chunks_per_worker: 2,
    };
    let cases = [
        (ScheduleKind::GPipe, false),
        (ScheduleKind::GPipe, true),
        (ScheduleKind::OneFOneB, false),
        (ScheduleKind::OneFOneB, true),
        (v2, false),
    ];
    let mut rows = Vec::new();
    let model = BenchModel::Gpt(bench_gpt());
    for (kind, recompute) in cases {
        let run_with = |m: usize| {
            let mut cfg = base_config(model, kind, workers, m);
            cfg.batch = m * micro_batch_size;
            cfg.steps = steps;
            cfg.recompute = recompute;
            run_pipeline(&cfg)
        };
        let run = run_with(micro_batches)?;
        let single = per_micro_bytes(
            model,
            &run.partition,
            &run.schedule,
            recompute,
            micro_batch_size,
        );
        rows.push(MemoryRow {
            schedule: kind.to_string(),
            workers,
            micro_batches,
            recompute,
            peak_bytes: run.peak_activation_bytes(),
            per_micro_bytes: single,
        });
    }
    Ok(rows)
}

/// The price of recomputation on one stage's blocks, in thread CPU time (robust to other
/// processes taking the cores, unlike wall time on a loaded machine).
#[derive(Clone, Debug, Serialize)]
pub struct RecomputeRow {
    pub blocks: String,
    pub micro_batch_size: usize,
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub backward_recompute_ms: f64,
    /// Recomputation runs each block's forward once more: backward + forward.
    pub predicted_backward_recompute_ms: f64,
    pub activation_bytes: usize,
    pub activation_bytes_recompute: usize,
}

/// CPU seconds the calling thread has run (`CLOCK_THREAD_CPUTIME_ID`, nanosecond resolution;
/// `/proc/thread-self/schedstat` counts in scheduler ticks on some kernels).
fn thread_cpu_seconds() -> Option<f64> {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    (rc == 0).then_some(t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9)
}

/// Forward and backward of the bench GPT's two p = 2 stages (and the whole model) on one
/// micro-batch, with and without recomputation; medians of `repeats` runs on one thread.
pub fn recompute_cost(
    micro_batch_size: usize,
    repeats: usize,
) -> Result<Vec<RecomputeRow>, PipelineError> {
    use meshtrain_nn::Mode;
    use meshtrain_tensor::Tensor;
    let bench = BenchModel::Gpt(bench_gpt());
    let model = bench.build();
    let n = model.num_blocks();
    let halves = crate::engine::Partition::by_params(&model, 2)?;
    let (x, _) = bench.batch(micro_batch_size, 3, 0);
    let mut rows = Vec::new();
    meshtrain_tensor::par::pool(1).install(|| {
        for blocks in [halves.chunks()[0].clone(), halves.chunks()[1].clone(), 0..n] {
            let mut store = model.init(3);
            let input = if blocks.start == 0 {
                x.clone()
            } else {
                let mode = Mode::TRAIN;
                model
                    .forward(&mut store, x.clone(), 0..blocks.start, mode, &|_| false)
                    .0
            };
            // (forward, backward) CPU seconds and activation bytes, per repeat.
            let mut measure = |recompute: bool| -> Option<(f64, f64, usize)> {
                let (mut fwd, mut bwd, mut bytes) = (Vec::new(), Vec::new(), 0);
                for _ in 0..repeats.max(1) {
                    let t0 = thread_cpu_seconds()?;
                    let (y, acts) = model.forward(
                        &mut store,
                        input.clone(),
                        blocks.clone(),
                        Mode::TRAIN,
                        &|_| recompute,
                    );
                    let t1 = thread_cpu_seconds()?;
                    bytes = acts.bytes();
                    let dy = Tensor::from_vec(vec![1e-3; y.numel()], y.shape());
                    model.backward(&mut store, acts, dy, blocks.start > 0, &mut |_, _| {});
                    let t2 = thread_cpu_seconds()?;
                    fwd.push(t1 - t0);
                    bwd.push(t2 - t1);
                }
                Some((median(fwd), median(bwd), bytes))
            };
            let (Some(plain), Some(recomputed)) = (measure(false), measure(true)) else {
                continue; // no per-thread CPU clock on this system
            };
            rows.push(RecomputeRow {
                blocks: format!("{blocks:?} of {n}"),
                micro_batch_size,
                forward_ms: plain.0 * 1e3,
                backward_ms: plain.1 * 1e3,
                backward_recompute_ms: recomputed.1 * 1e3,
                predicted_backward_recompute_ms: (plain.1 + plain.0) * 1e3,
                activation_bytes: plain.2,
                activation_bytes_recompute: recomputed.2,
            });
        }
    });
    Ok(rows)
}

/// Each schedule's parameters after `steps` steps against the single-worker runs.
pub fn equivalence_sweep(steps: usize) -> Result<Vec<EquivalenceRow>, PipelineError> {
    let gpt = BenchModel::Gpt(GptConfig {
        vocab: 32,
        dim: 16,
        layers: 4,
        heads: 2,
        seq: 8,
        tie_embeddings: false,
        attention: Default::default(),
        gelu: Default::default(),
    });
    let resnet = BenchModel::Resnet { width: 4 };
    let v2 = ScheduleKind::Interleaved {
        chunks_per_worker: 2,
    };
    let cases = [
        (gpt, ScheduleKind::GPipe, 3, 1),
        (gpt, ScheduleKind::GPipe, 2, 4),
        (gpt, ScheduleKind::OneFOneB, 3, 4),
        (gpt, v2, 2, 4),
        (resnet, ScheduleKind::GPipe, 2, 2),
        (resnet, ScheduleKind::OneFOneB, 4, 4),
        (resnet, v2, 2, 2),
    ];
    let mut rows = Vec::new();
    for (model, kind, p, m) in cases {
        let mut cfg = base_config(model, kind, p, m);
        cfg.batch = 8;
        cfg.steps = steps;
        if let BenchModel::Gpt(_) = model {
            cfg.optimizer = OptimizerConfig::Adamw {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
            };
        }
        let run = run_pipeline(&cfg)?;
        let (micro_ref, _) = run_reference(&cfg, m)?;
        let full = match model {
            BenchModel::Gpt(_) => Some(max_abs_diff(&run.params, &run_reference(&cfg, 1)?.0)),
            _ => None,
        };
        rows.push(EquivalenceRow {
            model: model_name(&model),
            schedule: kind.to_string(),
            workers: p,
            micro_batches: m,
            steps,
            vs_micro_batched: max_abs_diff(&run.params, &micro_ref),
            vs_full_batch: full,
        });
    }
    Ok(rows)
}

/// Markdown tables of the three measurements.
pub fn markdown(
    bubbles: &[BubbleRow],
    memory: &[MemoryRow],
    recompute: &[RecomputeRow],
    equivalence: &[EquivalenceRow],
) -> String {
    let mut s = String::new();
    if !bubbles.is_empty() {
        s += "| model | schedule | sends | p | m | measured idle | predicted (p−1)/(v·m+p−1) \
              | simulated with measured costs | step ms |\n";
        s += "|---|---|---|---|---|---|---|---|---|\n";
        for r in bubbles {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.1} |",
                r.model,
                r.schedule,
                r.sends,
                r.workers,
                r.micro_batches,
                r.measured_idle,
                r.predicted_idle,
                r.simulated_idle,
                r.step_ms
            );
        }
        s += "\n";
    }
    if !memory.is_empty() {
        s += "| schedule | p | m | recompute | peak activations per stage (MiB) \
              | in micro-batches per stage |\n";
        s += "|---|---|---|---|---|---|\n";
        for r in memory {
            let mib: Vec<String> = r
                .peak_bytes
                .iter()
                .map(|&b| format!("{:.2}", b as f64 / (1 << 20) as f64))
                .collect();
            let micro: Vec<String> = r
                .peak_bytes
                .iter()
                .zip(&r.per_micro_bytes)
                .map(|(&b, &one)| format!("{:.1}", b as f64 / one.max(1) as f64))
                .collect();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                r.schedule,
                r.workers,
                r.micro_batches,
                r.recompute,
                mib.join(" / "),
                micro.join(" / ")
            );
        }
        s += "\n";
    }
    if !recompute.is_empty() {
        s += "| blocks | micro-batch | forward ms | backward ms | backward with recompute ms \
              | predicted (backward + forward) | activations KiB | with recompute KiB |\n";
        s += "|---|---|---|---|---|---|---|---|\n";
        for r in recompute {
            let _ = writeln!(
                s,
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} |",
                r.blocks,
                r.micro_batch_size,
                r.forward_ms,
                r.backward_ms,
                r.backward_recompute_ms,
                r.predicted_backward_recompute_ms,
                r.activation_bytes as f64 / 1024.0,
                r.activation_bytes_recompute as f64 / 1024.0
            );
        }
        s += "\n";
    }
    if !equivalence.is_empty() {
        s += "| model | schedule | p | m | steps | max abs diff vs micro-batched 1 worker | vs full batch |\n";
        s += "|---|---|---|---|---|---|---|\n";
        for r in equivalence {
            let full = r
                .vs_full_batch
                .map_or("n/a (batch norm)".into(), |d| format!("{d:.1e}"));
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {:.1e} | {} |",
                r.model, r.schedule, r.workers, r.micro_batches, r.steps, r.vs_micro_batched, full
            );
        }
    }
    s
}

/// Chrome traces (Perfetto) of one step of each standard schedule on sleeping equal-cost
/// stages, p = 4, m = 8, written to `dir` as `<schedule>-p4-m8.json`; returns the paths.
pub fn write_example_traces(
    dir: &std::path::Path,
) -> Result<Vec<std::path::PathBuf>, PipelineError> {
    let sweep = BubbleSweep::synthetic(vec![4], vec![8], 1);
    let mut paths = Vec::new();
    for kind in standard_kinds() {
        let mut cfg = base_config(sweep.model, kind, 4, 8);
        cfg.steps = 2;
        let run = run_pipeline(&cfg)?;
        let name = kind.to_string().replace(['(', ')', '='], "");
        let path = dir.join(format!("{name}-p4-m8.json"));
        crate::timeline::write_chrome_trace(&path, &run.spans[1])
            .map_err(|e| PipelineError::Workers(format!("writing {}: {e}", path.display())))?;
        paths.push(path);
    }
    Ok(paths)
}

/// Which tables [`run`] produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Sleeping equal-cost stages, p ∈ {2, 4}.
    BubbleSynthetic,
    /// The bench GPT at p = 2 (one core per worker).
    BubbleGpt,
    /// Peak activations per stage at p = 4 and the CPU cost of recomputation (bench GPT).
    Memory,
    Equivalence,
}

impl Part {
    pub const ALL: [Part; 4] = [
        Part::BubbleSynthetic,
        Part::BubbleGpt,
        Part::Memory,
        Part::Equivalence,
    ];
}

/// The tables of `docs/pipeline.md` for `parts`; `quick` runs fewer steps and sizes (a smoke
/// test, not a measurement).
pub fn run(parts: &[Part], quick: bool) -> Result<String, PipelineError> {
    let steps = if quick { 1 } else { 5 };
    let ms = if quick {
        vec![1, 4]
    } else {
        vec![1, 2, 4, 8, 16]
    };
    let (mut bubbles, mut memory, mut equivalence) = (Vec::new(), Vec::new(), Vec::new());
    let mut recompute = Vec::new();
    let load_before = load_average();
    for part in parts {
        match part {
            Part::BubbleSynthetic => {
                let sweep = BubbleSweep::synthetic(vec![2, 4], ms.clone(), steps);
                bubbles.extend(bubble_sweep(&sweep)?);
            }
            Part::BubbleGpt => bubbles.extend(bubble_sweep(&BubbleSweep::gpt(ms.clone(), steps))?),
            Part::Memory => {
                memory.extend(memory_sweep(4, 8, 2, steps)?);
                recompute.extend(recompute_cost(2, if quick { 1 } else { 9 })?);
            }
            Part::Equivalence => equivalence.extend(equivalence_sweep(if quick { 2 } else { 10 })?),
        }
    }
    Ok(format!(
        "load average before: {load_before}; after: {}\n\n{}",
        load_average(),
        markdown(&bubbles, &memory, &recompute, &equivalence)
    ))
}

/// The 1, 5 and 15 minute load averages (Linux), to judge how disturbed timings were.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}
