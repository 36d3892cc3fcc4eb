//! `meshtrain bench zero`: what ZeRO's stages hold, move and cost on GPT, measured against
//! the formulas they should follow.
//!
//! * **memory**: per worker, the bytes of parameters, gradients and optimizer state as
//!   allocated (vector capacities after a step) at dp = 2 and 4 for stages 0–3, against the
//!   planner's `model_state_bytes` for the same parameter count, and the transient peak
//!   (gathered blocks, wire buffers). Peak RSS per worker needs one process per worker:
//!   `scripts/zero-memory.sh` runs the same layouts under mpirun.
//! * **communication**: the bytes each worker's collectives move per step in the ZeRO
//!   paper's units (an all-reduce counts twice), against Ψ = parameter bytes: 2Ψ for DDP
//!   and stages 1–2, 3Ψ for stage 3.
//! * **throughput**: dp = 2, DDP against ZeRO-3 with and without prefetching (and stages 1
//!   and 2), alternating, with the exposed all-gather time.
//! * **consolidate**: a sharded checkpoint of a large GPT written by dp = 4 ZeRO-3 workers,
//!   joined into one file by `meshtrain checkpoint consolidate`'s code, timed.

use crate::config::Config;
use crate::pipeline_bench::{measure_layout, ThroughputRun};
use crate::presets::Task;
use anyhow::{anyhow, bail, Context, Result};
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_train::memory::MemoryReport;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchZeroArgs {
    /// Comma-separated parts: memory, throughput, consolidate.
    #[arg(long, default_value = "memory,throughput,consolidate")]
    pub parts: String,
    /// GPT width and layers of the memory and throughput measurements (512 × 8: 25M
    /// parameters, so model states dominate a worker's memory).
    #[arg(long, default_value_t = 512)]
    pub dim: usize,
    #[arg(long, default_value_t = 8)]
    pub layers: usize,
    /// Global batch (sequences of 64 tokens).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Throughput: alternations of the layouts.
    #[arg(long, default_value_t = 3)]
    pub pairs: usize,
    /// Throughput: timed steps per run (after one untimed one).
    #[arg(long, default_value_t = 4)]
    pub steps: u64,
    /// Total intra-op threads, shared by the workers.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Consolidate: width and layers of the checkpointed GPT (1024 × 12: 153M parameters,
    /// 1.8 GB of shards with AdamW's moments).
    #[arg(long, default_value_t = 1024)]
    pub consolidate_dim: usize,
    #[arg(long, default_value_t = 12)]
    pub consolidate_layers: usize,
}

/// A scratch directory removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Result<Scratch> {
        let dir = std::env::temp_dir().join(format!(
            "meshtrain-bench-zero-{}-{name}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Scratch(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn gpt(dim: usize, layers: usize, batch: usize, extra: &[String]) -> Result<Config> {
    let mut o = vec![
        format!("model.dim={dim}"),
        format!("model.layers={layers}"),
        format!("model.heads={}", (dim / 64).max(1)),
        "model.seq=64".to_string(),
        format!("train.batch_size={batch}"),
        "train.log_every=1000000".to_string(),
        "train.eval_batches=1".to_string(),
    ];
    o.extend(extra.iter().cloned());
    Config::load(&PathBuf::from("configs/gpt.toml"), &o)
}

pub fn run(args: &BenchZeroArgs) -> Result<()> {
    for part in args
        .parts
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part {
            "memory" => memory(args)?,
            "throughput" => throughput(args)?,
            "consolidate" => consolidate(args)?,
            other => bail!("unknown part '{other}' (memory, throughput, consolidate)"),
        }
    }
    Ok(())
}

/// Rank 0's memory report after two steps and its traffic in the second, with the whole
/// model's parameter bytes Ψ.
fn measure_memory(cfg: &Config, threads: usize) -> Result<(MemoryReport, u64, usize)> {
    let task = Task::load(cfg)?;
    let job = Arc::new(cfg.job(&task)?);
    let workers = job.layout.world_size();
    job.check(workers)?;
    let per_worker = (threads / workers).max(1);
    let params = (job.model)().num_params();
    let results = ThreadsWorld::run(workers, CommConfig::default(), move |group| {
        let mut t = job.trainer(group, Some(per_worker))?;
        t.train_step()?;
        let traffic = t.train_step()?.times.comm_traffic_bytes;
        Ok::<_, anyhow::Error>((t.memory_report(), traffic))
    })
    .map_err(|e| anyhow!("{e}"))?;
    Ok((results[0].0, results[0].1, params * 4))
}

fn memory(args: &BenchZeroArgs) -> Result<()> {
    println!(
        "## Model states per worker and traffic per step (GPT {}×{}, fp32 AdamW, measured on \
         rank 0 after 2 steps)\n\n| dp | zero | parameters MiB | gradients MiB | optimizer MiB \
         | states MiB | formula MiB | measured / formula | transient peak MiB | traffic / Ψ \
         |\n|---|---|---|---|---|---|---|---|---|---|",
        args.dim, args.layers
    );
    for dp in [2usize, 4] {
        for zero in 0..=3u8 {
            let extra = vec![format!("parallel.dp={dp}"), format!("parallel.zero={zero}")];
            let cfg = gpt(args.dim, args.layers, args.batch, &extra)?;
            let (r, traffic, psi) = measure_memory(&cfg, args.threads)?;
            println!(
                "| {dp} | {zero} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.4} | {:.2} | {:.3} |",
                r.parameters_mib,
                r.gradients_mib,
                r.optimizer_mib,
                r.states_mib(),
                r.predicted_mib,
                r.states_mib() / r.predicted_mib,
                r.transient_mib,
                traffic as f64 / psi as f64,
            );
        }
    }
    println!();
    Ok(())
}

fn throughput(args: &BenchZeroArgs) -> Result<()> {
    println!(
        "## Throughput at dp = 2, {} threads in all (GPT {}×{}, batch {}; alternating, {} \
         rounds of {} timed steps)\n\n| layout | samples/s (each round) | vs DDP | step ms | \
         compute ms | comm exposed ms | of which all-gather wait ms | comm hidden ms |\n\
         |---|---|---|---|---|---|---|---|",
        args.threads, args.dim, args.layers, args.batch, args.pairs, args.steps
    );
    let layouts: [(&str, &[&str]); 5] = [
        ("DDP", &[]),
        ("zero=1", &["parallel.zero=1"]),
        ("zero=2", &["parallel.zero=2"]),
        ("zero=3", &["parallel.zero=3"]),
        (
            "zero=3, no prefetch",
            &["parallel.zero=3", "parallel.zero_prefetch=false"],
        ),
    ];
    let base = gpt(
        args.dim,
        args.layers,
        args.batch,
        &["parallel.dp=2".to_string()],
    )?;
    let task = Task::load(&base)?;
    let mut runs: Vec<Vec<ThroughputRun>> = vec![Vec::new(); layouts.len()];
    for _ in 0..args.pairs {
        for (i, (name, extra)) in layouts.iter().enumerate() {
            let mut o = vec!["parallel.dp=2".to_string()];
            o.extend(extra.iter().map(|s| s.to_string()));
            let cfg = gpt(args.dim, args.layers, args.batch, &o)?;
            runs[i].push(measure_layout(
                name,
                cfg,
                &task,
                args.threads,
                1,
                args.steps,
            )?);
        }
    }
    let median = |v: &[f64]| {
        let mut x = v.to_vec();
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let ddp: Vec<f64> = runs[0].iter().map(|r| r.samples_per_s).collect();
    for (i, (name, _)) in layouts.iter().enumerate() {
        let r = &runs[i];
        let col = |f: fn(&ThroughputRun) -> f64| median(&r.iter().map(f).collect::<Vec<_>>());
        let ratios: Vec<f64> = r
            .iter()
            .zip(&ddp)
            .map(|(x, d)| x.samples_per_s / d)
            .collect();
        let each: Vec<String> = r
            .iter()
            .map(|x| format!("{:.1}", x.samples_per_s))
            .collect();
        println!(
            "| {name} | {} | {:.2} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} |",
            each.join(", "),
            median(&ratios),
            col(|x| x.step_ms),
            col(|x| x.compute_ms),
            col(|x| x.comm_exposed_ms),
            col(|x| x.param_gather_ms),
            col(|x| x.comm_hidden_ms),
        );
    }
    println!();
    Ok(())
}

fn consolidate(args: &BenchZeroArgs) -> Result<()> {
    let dir = Scratch::new("consolidate")?;
    let out = dir.path().join("run");
    let cfg = gpt(
        args.consolidate_dim,
        args.consolidate_layers,
        4,
        &[
            "parallel.dp=4".to_string(),
            "parallel.zero=3".to_string(),
            format!("train.out_dir=\"{}\"", out.display()),
        ],
    )?;
    let task = Task::load(&cfg)?;
    let job = Arc::new(cfg.job(&task)?);
    job.check(4)?;
    let t = std::time::Instant::now();
    let checkpoint = ThreadsWorld::run(4, CommConfig::default(), move |group| {
        let mut t = job.trainer(group, Some(1))?;
        let path = t.checkpoint_path();
        t.save_checkpoint(&path)?;
        Ok::<_, anyhow::Error>(path)
    })
    .map_err(|e| anyhow!("{e}"))?
    .remove(0);
    let save_s = t.elapsed().as_secs_f64();
    let whole = dir.path().join("whole.safetensors");
    let report = meshtrain_train::sharded::consolidate(&checkpoint, &whole, &|_, _| {})?;
    let params = (cfg.job(&task)?.model)().num_params();
    println!(
        "## Consolidating a sharded checkpoint\n\nGPT {}×{} ({:.0}M parameters) at dp = 4 \
         ZeRO-3: 4 workers set up and wrote their shards and the index in {save_s:.1} s \
         ({:.0} MiB); `meshtrain checkpoint consolidate` joined them into one {:.0} MiB \
         file in **{:.2} s** ({:.0} MiB/s), {} threads.\n",
        args.consolidate_dim,
        args.consolidate_layers,
        params as f64 / 1e6,
        report.read_bytes as f64 / (1024.0 * 1024.0),
        report.written_bytes as f64 / (1024.0 * 1024.0),
        report.seconds,
        report.written_bytes as f64 / (1024.0 * 1024.0) / report.seconds,
        rayon::current_num_threads()
    );
    check_loads(&whole, &cfg)?;
    Ok(())
}

/// The consolidated file resumes a one-worker run of the same model.
fn check_loads(file: &Path, cfg: &Config) -> Result<()> {
    let mut single = cfg.clone();
    single.parallel.dp = 1;
    single.parallel.zero = 0;
    let task = Task::load(&single)?;
    let job = Arc::new(single.job(&task)?);
    let mut t = job.trainer(ThreadsWorld::single(CommConfig::default()), Some(1))?;
    t.resume(file)
        .with_context(|| format!("resuming from {}", file.display()))
}
