//! `meshtrain bench pipeline`: the pipeline library's measurements (bubble per schedule,
//! activation memory, equivalence with one worker; `meshtrain_parallel::pipeline::measure`)
//! and a throughput comparison of the real trainer on GPT: one worker, `dp = 2` and `pp = 2`
//! with the same global batch and the same total number of intra-op threads.
//!
//! Wall-clock throughput on a shared machine is noisy, so each run also reports the process
//! CPU time per sample (all threads), which other processes do not inflate as much: a layout
//! that only waits (the bubble) costs wall time but little CPU.

use crate::config::Config;
use crate::presets::Task;
use crate::scaling::parse_list;
use anyhow::{anyhow, bail, Context, Result};
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_parallel::pipeline::measure::{self, Part};
use meshtrain_train::{Breakdown, Trainer};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchPipelineArgs {
    /// Comma-separated parts: bubble-synthetic (sleeping equal-cost stages, p ∈ {2, 4},
    /// m ∈ {1, 2, 4, 8, 16}, GPipe / 1F1B / interleaved), bubble-gpt (a real GPT at p = 2),
    /// memory (activation memory per stage, recomputation), equivalence (parameters vs one
    /// worker), throughput (GPT: one worker vs dp = 2 vs pp = 2 in the real trainer).
    #[arg(long, default_value = "bubble-synthetic,memory,throughput")]
    pub parts: String,
    /// Fewer steps and sizes: a smoke test, not a measurement.
    #[arg(long)]
    pub quick: bool,
    /// Throughput: comma-separated layouts, `1` (one worker), `dpN`, or `ppN` (with
    /// --schedule and --micro-batches).
    #[arg(long, default_value = "1,dp2,pp2")]
    pub layouts: String,
    /// Throughput: the pipeline schedule.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Throughput: micro-batches per step of the pipeline runs.
    #[arg(long, default_value_t = 4)]
    pub micro_batches: usize,
    /// Throughput: total intra-op threads, shared by the workers.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Throughput: timed steps per layout (after --warmup untimed ones).
    #[arg(long, default_value_t = 6)]
    pub steps: u64,
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,
    /// Throughput: config overrides of configs/gpt.toml for every run.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// One throughput measurement (means over the workers of the timed steps).
#[derive(Serialize, Debug, Clone)]
pub struct ThroughputRun {
    pub layout: String,
    pub workers: usize,
    pub threads_per_worker: usize,
    pub samples_per_s: f64,
    pub step_ms: f64,
    pub compute_ms: f64,
    /// The optimizer's part of `compute_ms`.
    pub optimizer_ms: f64,
    pub pipeline_idle_ms: f64,
    pub comm_exposed_ms: f64,
    pub comm_hidden_ms: f64,
    /// Tensor-parallel collectives: the part of `compute_ms` spent waiting in them.
    pub tp_comm_ms: f64,
    /// ZeRO-3: the part of `comm_exposed_ms` spent waiting for parameters being all-gathered.
    pub param_gather_ms: f64,
    /// Context parallelism: the part of `compute_ms` attention waited for transfers, and
    /// how long the transfers ran on the communication thread.
    pub cp_comm_ms: f64,
    pub cp_busy_ms: f64,
    /// Context parallelism: million elements a worker sent per step.
    pub cp_elems_m: f64,
    pub forward_ms: f64,
    pub backward_ms: f64,
    /// Process CPU time (all threads) per sample.
    pub cpu_ms_per_sample: f64,
}

pub fn run(args: &BenchPipelineArgs) -> Result<()> {
    let mut parts = Vec::new();
    let mut throughput = false;
    for part in args
        .parts
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part {
            "bubble-synthetic" => parts.push(Part::BubbleSynthetic),
            "bubble-gpt" => parts.push(Part::BubbleGpt),
            "memory" => parts.push(Part::Memory),
            "equivalence" => parts.push(Part::Equivalence),
            "throughput" => throughput = true,
            other => bail!(
                "unknown part '{other}' (bubble-synthetic, bubble-gpt, memory, equivalence, throughput)"
            ),
        }
    }
    if !parts.is_empty() {
        println!("{}", measure::run(&parts, args.quick)?);
    }
    if throughput {
        let runs = throughput_runs(args)?;
        println!("{}", throughput_table(&runs));
    }
    Ok(())
}

/// (data-parallel size, pipeline stages) of a layout name.
fn parse_layout(name: &str) -> Result<(usize, usize)> {
    let number = |s: &str| {
        s.parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .with_context(|| format!("bad layout '{name}' (expected 1, dpN or ppN)"))
    };
    match (name.strip_prefix("dp"), name.strip_prefix("pp")) {
        _ if name == "1" => Ok((1, 1)),
        (Some(n), _) => Ok((number(n)?, 1)),
        (_, Some(n)) => Ok((1, number(n)?)),
        _ => bail!("bad layout '{name}' (expected 1, dpN or ppN)"),
    }
}

/// GPT throughput of each layout in the real trainer, all in this process one after another.
pub fn throughput_runs(args: &BenchPipelineArgs) -> Result<Vec<ThroughputRun>> {
    let mut overrides = args.overrides.clone();
    overrides.push("train.log_every=1000000".into());
    let base = Config::load(&PathBuf::from("configs/gpt.toml"), &overrides)?;
    let task = Task::load(&base)?;
    let (steps, warmup) = if args.quick {
        (1, 1)
    } else {
        (args.steps, args.warmup)
    };
    let mut runs = Vec::new();
    for name in parse_list(&args.layouts) {
        let name = name.as_str();
        let (dp, pp) = parse_layout(name)?;
        let mut cfg = base.clone();
        cfg.parallel.dp = dp;
        cfg.parallel.pp = pp;
        if pp > 1 {
            cfg.parallel.schedule = args.schedule.clone();
            cfg.parallel.micro_batches = args.micro_batches;
        }
        cfg.validate()?;
        let layout = if pp > 1 {
            format!("pp{pp} {} m={}", args.schedule, args.micro_batches)
        } else {
            name.to_string()
        };
        runs.push(measure_layout(
            &layout,
            cfg,
            &task,
            args.threads,
            warmup,
            steps,
        )?);
    }
    Ok(runs)
}

pub fn measure_layout(
    layout: &str,
    cfg: Config,
    task: &Task,
    threads: usize,
    warmup: u64,
    steps: u64,
) -> Result<ThroughputRun> {
    let workers = cfg.layout()?.world_size();
    let threads_per_worker = (threads / workers).max(1);
    let batch = cfg.train.batch_size;
    let job = Arc::new(cfg.job(task)?);
    job.check(workers)?;
    // Per worker: the timed steps' breakdown, wall seconds, and (rank 0) process CPU seconds.
    let results = ThreadsWorld::run(workers, CommConfig::default(), move |group| {
        let fail = |e: anyhow::Error| format!("{e:#}");
        let world = Arc::clone(&group);
        let mut t = job.trainer(group, Some(threads_per_worker)).map_err(fail)?;
        let step = |t: &mut Trainer| -> Result<()> { t.train_step().map(|_| ()) };
        for _ in 0..warmup {
            step(&mut t).map_err(fail)?;
        }
        world.barrier().map_err(|e| e.to_string())?;
        let (before, cpu0, wall) = (t.breakdown.clone(), process_cpu_s(), Instant::now());
        for _ in 0..steps {
            step(&mut t).map_err(fail)?;
        }
        world.barrier().map_err(|e| e.to_string())?;
        let (wall, cpu) = (wall.elapsed().as_secs_f64(), process_cpu_s() - cpu0);
        Ok::<_, String>((t.breakdown.since(&before), wall, cpu))
    })
    .map_err(|e| anyhow!("{layout}: {e}"))?;
    let n = steps.max(1) as f64 * results.len() as f64;
    let mean = |f: fn(&Breakdown) -> f64| results.iter().map(|r| f(&r.0)).sum::<f64>() / n * 1e3;
    let wall = results.iter().map(|r| r.1).fold(0.0, f64::max);
    let samples = (batch as u64 * steps) as f64;
    Ok(ThroughputRun {
        layout: layout.to_string(),
        workers,
        threads_per_worker,
        samples_per_s: samples / wall,
        step_ms: wall / steps.max(1) as f64 * 1e3,
        compute_ms: mean(Breakdown::compute_s),
        optimizer_ms: mean(|b| b.times.optimizer_s),
        pipeline_idle_ms: mean(|b| b.times.pipeline_idle_s),
        comm_exposed_ms: mean(|b| b.times.comm_exposed_s),
        comm_hidden_ms: mean(|b| b.times.comm_hidden_s),
        tp_comm_ms: mean(|b| b.times.tp_comm_s),
        param_gather_ms: mean(|b| b.times.param_gather_s),
        cp_comm_ms: mean(|b| b.times.cp_comm_s),
        cp_busy_ms: mean(|b| b.times.cp_comm_busy_s),
        cp_elems_m: mean(|b| b.times.cp_comm_elems as f64) * 1e-9,
        forward_ms: mean(|b| b.times.forward_s),
        backward_ms: mean(|b| b.times.backward_s),
        cpu_ms_per_sample: results[0].2 / samples * 1e3,
    })
}

/// User + system CPU seconds of this process, all threads (Linux `/proc/self/stat`, in clock
/// ticks of 1/100 s); 0 where unavailable.
fn process_cpu_s() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may contain spaces) in parentheses.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

fn throughput_table(runs: &[ThroughputRun]) -> String {
    let one = runs
        .iter()
        .find(|r| r.workers == 1)
        .map(|r| r.samples_per_s);
    let mut s = String::from(
        "| layout | workers | thr/worker | samples/s | vs 1 worker | step ms | compute ms/worker \
         | pipeline idle ms | comm exposed ms | comm hidden ms | CPU ms/sample |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        s += &format!(
            "| {} | {} | {} | {:.1} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} |\n",
            r.layout,
            r.workers,
            r.threads_per_worker,
            r.samples_per_s,
            one.map_or("-".into(), |o| format!("{:.2}", r.samples_per_s / o)),
            r.step_ms,
            r.compute_ms,
            r.pipeline_idle_ms,
            r.comm_exposed_ms,
            r.comm_hidden_ms,
            r.cpu_ms_per_sample
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse() {
        assert_eq!(parse_layout("1").unwrap(), (1, 1));
        assert_eq!(parse_layout("dp2").unwrap(), (2, 1));
        assert_eq!(parse_layout("pp4").unwrap(), (1, 4));
        assert!(parse_layout("pp0").is_err());
        assert!(parse_layout("tp2").is_err());
    }
}
