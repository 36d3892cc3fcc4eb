//! `meshtrain bench tensor`: what tensor and sequence parallelism cost and buy on GPT,
//! measured against the formulas they should follow.
//!
//! * **communication**: the tensor-parallel collectives of one layer in one step (calls and
//!   elements, from the layers' own counters; per layer = the difference between 4 and 2
//!   layers, halved), against Megatron's accounting: 2 all-reduces of `s·b·h` forward and 2
//!   backward; with sequence parallelism all-gathers and reduce-scatters of the same size.
//! * **memory**: activation bytes one worker keeps per layer (the executor's count of what
//!   forward saves, per layer as above) against Korthikanti et al.'s formula adapted to what
//!   our GPT block stores (see [`activation_formula`]).
//! * **throughput**: one worker (all threads) vs tp = 2, tp = 2 with sequence parallelism and
//!   dp = 2, alternating, for each width, with the breakdown that explains the differences.

use crate::config::Config;
use crate::pipeline_bench::{measure_layout, ThroughputRun};
use crate::presets::Task;
use crate::scaling::parse_list;
use anyhow::{Context, Result};
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_parallel::tensor::TpComm;
use std::fmt::Write;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchTensorArgs {
    /// Comma-separated parts: communication, memory, throughput.
    #[arg(long, default_value = "communication,memory,throughput")]
    pub parts: String,
    /// Throughput: comma-separated model widths (heads = width / 64; batch 32 at 256 and 8
    /// at wider widths, so a step stays near a second).
    #[arg(long, default_value = "256,1024")]
    pub dims: String,
    /// Throughput: alternations of the layouts per width.
    #[arg(long, default_value_t = 2)]
    pub pairs: usize,
    /// Throughput: timed steps per run (after --warmup untimed ones).
    #[arg(long, default_value_t = 4)]
    pub steps: u64,
    #[arg(long, default_value_t = 1)]
    pub warmup: u64,
    /// Total intra-op threads, shared by the workers.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

/// The GPT config of the measurements: `configs/gpt.toml` with `layers` layers.
fn gpt_config(layers: usize, extra: &[String]) -> Result<Config> {
    let mut o = vec![
        format!("model.layers={layers}"),
        "train.log_every=1000000".to_string(),
    ];
    o.extend(extra.iter().cloned());
    Config::load(&PathBuf::from("configs/gpt.toml"), &o)
}

/// One step of `layout` on the threads backend: rank 0's tensor-parallel counts and the most
/// activation bytes it held.
fn one_step(cfg: &Config, layout: &str, threads: usize) -> Result<(TpComm, usize)> {
    let mut cfg = cfg.clone();
    cfg.parallel.layout = Some(layout.to_string());
    cfg.validate()?;
    let task = Task::load(&cfg)?;
    let job = Arc::new(cfg.job(&task)?);
    let workers = job.layout.world_size();
    job.check(workers)?;
    let per_worker = (threads / workers).max(1);
    let results = ThreadsWorld::run(workers, CommConfig::default(), move |group| {
        let mut t = job.trainer(group, Some(per_worker))?;
        let before = t.parallel.tp_comm().unwrap_or_default();
        let stats = t.train_step()?;
        let comm = t.parallel.tp_comm().unwrap_or_default().since(&before);
        Ok::<_, anyhow::Error>((comm, stats.peak_activation_bytes))
    })
    .map_err(|e| anyhow::anyhow!("{layout}: {e}"))?;
    Ok(results[0])
}

/// Per-layer difference of `f` between a 4-layer and a 2-layer model.
fn per_layer<T>(four: T, two: T, f: impl Fn(&T) -> f64) -> f64 {
    (f(&four) - f(&two)) / 2.0
}

/// Activation elements one GPT layer keeps per worker for `s` tokens, batch `b`, width `h`,
/// `a` heads, over `t` tensor-parallel workers: what our block saves — ln1's input and its
/// row statistics, q/k/v's input, the attention core's q/k/v (3) and probabilities (`a·s²·b`),
/// proj's input, ln2's input and statistics, fc1's input and pre-activation (4), fc2's input
/// (4): `16·sbh + a·s²·b + 4·sb`, all f32. Tensor parallelism splits q/k/v, the core, proj's
/// input and the MLP's inside (`12·sbh/t + a·s²·b/t`) and replicates the rest (`4·sbh + 4·sb`);
/// sequence parallelism splits the rest too. Korthikanti et al.'s `sbh(34 + 5as/h)` (bytes,
/// 16-bit activations, dropout masks) becomes here `4·sbh(16 + as/h) + 16·sb` bytes.
pub fn activation_formula(s: f64, b: f64, h: f64, a: f64, t: f64, sp: bool) -> f64 {
    let sbh = s * b * h;
    let probs = a * s * s * b;
    let stats = 4.0 * s * b;
    let elements = match (t > 1.0, sp) {
        (false, _) => 16.0 * sbh + probs + stats,
        (true, false) => 4.0 * sbh + 12.0 * sbh / t + probs / t + stats,
        (true, true) => (16.0 * sbh + probs + stats) / t,
    };
    4.0 * elements
}

pub fn run(args: &BenchTensorArgs) -> Result<()> {
    let parts = parse_list(&args.parts);
    for part in &parts {
        match part.as_str() {
            "communication" | "memory" => {}
            "throughput" => {}
            other => anyhow::bail!("unknown part '{other}' (communication, memory, throughput)"),
        }
    }
    let base = gpt_config(2, &[])?;
    let g = match &base.model {
        crate::config::ModelConfig::Gpt(g) => *g,
        _ => unreachable!("configs/gpt.toml is a GPT"),
    };
    let (s, b, h, a) = (
        g.seq as f64,
        base.train.batch_size as f64,
        g.dim as f64,
        g.heads as f64,
    );
    let sbh = s * b * h;
    let mut out = String::new();
    if parts.iter().any(|p| p == "communication" || p == "memory") {
        let four = gpt_config(4, &[])?;
        let mut rows = Vec::new();
        for layout in ["dp=1", "tp=2", "tp=2,sp=on"] {
            let two_step = one_step(&base, layout, args.threads)?;
            let four_step = one_step(&four, layout, args.threads)?;
            rows.push((layout, two_step, four_step));
        }
        if parts.iter().any(|p| p == "communication") {
            let _ = writeln!(
                out,
                "## Tensor-parallel communication per layer per step (GPT s={s} b={b} h={h}, \
                 t=2; sbh = {sbh})\n\n| layout | all-reduces | all-reduce elements | \
                 all-gathers | all-gather elements | reduce-scatters | reduce-scatter elements \
                 | formula | ring elements sent per rank |\n|---|---|---|---|---|---|---|---|---|"
            );
            for (layout, two, four) in rows.iter().skip(1) {
                let d = |f: &dyn Fn(&TpComm) -> u64| per_layer(four.0, two.0, |c| f(c) as f64);
                let (ar, are) = (d(&|c| c.all_reduces), d(&|c| c.all_reduce_elems));
                let (ag, age) = (d(&|c| c.all_gathers), d(&|c| c.all_gather_elems));
                let (rs, rse) = (d(&|c| c.reduce_scatters), d(&|c| c.reduce_scatter_elems));
                let formula = if layout.contains("sp") {
                    "fwd 2 AG + 2 RS, bwd 2 RS (dx) + 2 AG (dy) + 2 AG (inputs, gathered again) of sbh"
                } else {
                    "fwd 2 AR + bwd 2 AR of sbh"
                };
                // A ring all-reduce sends 2(t−1)/t of its elements per rank, an all-gather or
                // reduce-scatter (t−1)/t.
                let ring = are + 0.5 * (age + rse);
                let _ = writeln!(
                    out,
                    "| {layout} | {ar} | {are} ({:.2} sbh) | {ag} | {age} ({:.2} sbh) | {rs} | \
                     {rse} ({:.2} sbh) | {formula} | {ring} ({:.2} sbh) |",
                    are / sbh,
                    age / sbh,
                    rse / sbh,
                    ring / sbh
                );
            }
        }
        if parts.iter().any(|p| p == "memory") {
            let _ = writeln!(
                out,
                "\n## Activation memory per layer per worker (bytes; GPT s={s} b={b} h={h} a={a})\n\n\
                 | layout | measured | formula | measured / formula |\n|---|---|---|---|"
            );
            for (layout, two, four) in &rows {
                let measured = per_layer(four.1, two.1, |m| *m as f64);
                let t = if layout.starts_with("tp=2") { 2.0 } else { 1.0 };
                let formula = activation_formula(s, b, h, a, t, layout.contains("sp"));
                let _ = writeln!(
                    out,
                    "| {layout} | {measured:.0} | {formula:.0} | {:.4} |",
                    measured / formula
                );
            }
        }
        println!("{out}");
    }
    if parts.iter().any(|p| p == "throughput") {
        throughput(args)?;
    }
    Ok(())
}

fn throughput(args: &BenchTensorArgs) -> Result<()> {
    println!(
        "## Throughput, {} threads in all (alternating layouts, {} pairs, {} timed steps)\n\n\
         | width | layout | samples/s (each pair) | vs 1 worker | step ms | compute ms | of which tp comm ms \
         | optimizer ms | dp comm exposed ms |\n|---|---|---|---|---|---|---|---|---|",
        args.threads, args.pairs, args.steps
    );
    for dim in parse_list(&args.dims) {
        let dim: usize = dim.parse().with_context(|| format!("bad width '{dim}'"))?;
        let batch = if dim <= 256 { 32 } else { 8 };
        let extra = vec![
            format!("model.dim={dim}"),
            format!("model.heads={}", (dim / 64).max(1)),
            format!("train.batch_size={batch}"),
        ];
        let cfg = gpt_config(4, &extra)?;
        let task = Task::load(&cfg)?;
        let layouts = ["dp=1", "tp=2", "tp=2,sp=on", "dp=2"];
        let mut runs: Vec<Vec<ThroughputRun>> = vec![Vec::new(); layouts.len()];
        for _ in 0..args.pairs {
            for (i, layout) in layouts.iter().enumerate() {
                let mut c = cfg.clone();
                c.parallel.layout = Some(layout.to_string());
                c.validate()?;
                runs[i].push(measure_layout(
                    layout,
                    c,
                    &task,
                    args.threads,
                    args.warmup,
                    args.steps,
                )?);
            }
        }
        let median = |v: &[ThroughputRun], f: fn(&ThroughputRun) -> f64| {
            let mut x: Vec<f64> = v.iter().map(f).collect();
            x.sort_by(f64::total_cmp);
            x[x.len() / 2]
        };
        let one: Vec<f64> = runs[0].iter().map(|r| r.samples_per_s).collect();
        for (i, layout) in layouts.iter().enumerate() {
            let r = &runs[i];
            let each: Vec<String> = r
                .iter()
                .map(|x| format!("{:.2}", x.samples_per_s))
                .collect();
            let ratios: Vec<f64> = r
                .iter()
                .zip(&one)
                .map(|(x, o)| x.samples_per_s / o)
                .collect();
            let mut sorted = ratios.clone();
            sorted.sort_by(f64::total_cmp);
            println!(
                "| {dim} | {layout} | {} | {:.2} | {:.0} | {:.0} | {:.1} | {:.0} | {:.1} |",
                each.join(", "),
                sorted[sorted.len() / 2],
                median(r, |x| x.step_ms),
                median(r, |x| x.compute_ms),
                median(r, |x| x.tp_comm_ms),
                median(r, |x| x.optimizer_ms),
                median(r, |x| x.comm_exposed_ms),
            );
        }
    }
    Ok(())
}
