//! `meshtrain bench context`: long sequences — the memory-efficient attention kernel against
//! the probability-keeping one, and context parallelism's modes, measured.
//!
//! * **kernels**: causal attention forward + backward at seq 128…2048 (GPT width 256, 4
//!   heads, 4096 tokens per call), both kernels in f32 and bf16, interleaved rounds, median
//!   GFLOP/s of useful work (forward `2·B·T²·D`, backward `4·B·T²·D`: the causal half of the
//!   products; flash's recomputed scores are not counted).
//! * **memory**: what one attention layer keeps for backward at seq 512…8192 (batch 1), per
//!   kernel, and the most activation bytes a GPT worker holds in a step at cp = 1, 2, 4.
//! * **limit**: a GPT at seq 8192 whose first step on one worker exceeds
//!   `train.memory_limit_mb`, trained at cp = 4 under the same limit.
//! * **modes**: GPT step time at cp = 2, ring against Ulysses (and one worker), alternating,
//!   with the breakdown: forward, backward, the time attention waited for transfers
//!   (exposed) against how long the transfers ran (hidden behind the block products where
//!   they ran longer than attention waited).

use crate::config::Config;
use crate::pipeline_bench::{measure_layout, ThroughputRun};
use crate::presets::Task;
use anyhow::{anyhow, bail, Result};
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_nn::transformer::{AttentionCore, AttentionKind};
use meshtrain_nn::{Layer, Mode, Params, ParamsMut, Saved};
use meshtrain_tensor::attention::{
    causal_attention_backward, causal_attention_forward, AttentionShape,
};
use meshtrain_tensor::flash::{flash_attention_backward, flash_attention_forward};
use meshtrain_tensor::rng::normal_values;
use meshtrain_tensor::{DType, Tensor};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchContextArgs {
    /// Comma-separated parts: kernels, memory, limit, modes.
    #[arg(long, default_value = "kernels,memory,limit,modes")]
    pub parts: String,
    /// Kernels: interleaved rounds (the median is reported).
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// Kernels: comma-separated sequence lengths (4096 tokens per call).
    #[arg(long, default_value = "128,256,512,1024,2048")]
    pub kernel_seqs: String,
    /// Modes: GPT sequence length and global batch of the cp = 2 comparison.
    #[arg(long, default_value_t = 2048)]
    pub seq: usize,
    #[arg(long, default_value_t = 2)]
    pub batch: usize,
    /// Modes: alternations of the layouts, and timed steps per run (after one untimed one).
    #[arg(long, default_value_t = 3)]
    pub pairs: usize,
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    /// Total intra-op threads, shared by the workers.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

pub fn run(args: &BenchContextArgs) -> Result<()> {
    for part in args
        .parts
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part {
            "kernels" => kernels(args)?,
            "memory" => memory()?,
            "limit" => limit(args)?,
            "modes" => modes(args)?,
            other => bail!("unknown part '{other}' (kernels, memory, limit, modes)"),
        }
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds of one forward + backward of `kind` at `precision`.
fn time_attention(s: AttentionShape, kind: AttentionKind, precision: DType) -> f64 {
    let qkv = normal_values(s.batch * s.seq * 3 * s.dim, 1);
    let dout = normal_values(s.batch * s.seq * s.dim, 2);
    let t = Instant::now();
    let grads = if kind == AttentionKind::Flash {
        let (out, lse) = flash_attention_forward(s, &qkv, precision, None);
        flash_attention_backward(s, &qkv, &out, &lse, &dout, precision, None)
    } else {
        let (out, probs) = causal_attention_forward(s, &qkv, precision);
        std::hint::black_box(&out);
        causal_attention_backward(s, &qkv, &probs, &dout, precision)
    };
    std::hint::black_box(grads);
    t.elapsed().as_secs_f64()
}

fn kernels(args: &BenchContextArgs) -> Result<()> {
    let seqs: Vec<usize> = args
        .kernel_seqs
        .split(',')
        .map(|v| v.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("--kernel-seqs: {e}"))?;
    if let Some(bad) = seqs.iter().find(|&&t| t == 0 || t > 4096) {
        bail!("--kernel-seqs: {bad} is not a sequence length between 1 and 4096");
    }
    let pool = meshtrain_tensor::par::pool(args.threads);
    println!(
        "## Attention forward + backward, standard (keeps probabilities) vs flash \
         (memory-efficient)\n\nGPT width 256, 4 heads, 4096 tokens per call, {} threads, \
         median of {} interleaved rounds; useful GFLOP/s = 6·B·T²·D / time.\n\n\
         | seq × batch | precision | standard ms | flash ms | standard GFLOP/s | flash \
         GFLOP/s | flash speed-up |\n|---|---|---|---|---|---|---|",
        args.threads, args.rounds
    );
    for seq in seqs {
        let s = AttentionShape {
            batch: (4096 / seq).max(1),
            seq,
            dim: 256,
            heads: 4,
        };
        for precision in [DType::F32, DType::BF16] {
            let mut times = [Vec::new(), Vec::new()];
            pool.install(|| {
                for _ in 0..args.rounds {
                    for (i, kind) in [AttentionKind::Standard, AttentionKind::Flash]
                        .into_iter()
                        .enumerate()
                    {
                        times[i].push(time_attention(s, kind, precision));
                    }
                }
            });
            let [standard, flash] = times.map(median);
            let flops = 6.0 * (s.batch * seq * seq * s.dim) as f64;
            println!(
                "| {seq} × {} | {precision} | {:.2} | {:.2} | {:.1} | {:.1} | {:.2}x |",
                s.batch,
                standard * 1e3,
                flash * 1e3,
                flops / standard / 1e9,
                flops / flash / 1e9,
                standard / flash
            );
        }
    }
    println!();
    Ok(())
}

/// Bytes one attention layer of `kind` keeps for backward at `seq` (batch 1, width 256, 4
/// heads, f32).
fn attention_kept_bytes(kind: AttentionKind, seq: usize) -> usize {
    let core = AttentionCore {
        dim: 256,
        heads: 4,
        kv_heads: 4,
        precision: DType::F32,
        kind,
        window: None,
    };
    let qkv = Tensor::from_vec(normal_values(seq * 3 * 256, 3), &[1, seq, 3 * 256]);
    let mut saved = Saved::default();
    let mode = Mode {
        train: true,
        update_stats: true,
    };
    let out = core.forward(
        Params::Host(&[]),
        ParamsMut::Host(&mut []),
        qkv,
        mode,
        &mut saved,
    );
    std::hint::black_box(out);
    saved.bytes()
}

/// The most activation bytes a worker of `cfg`'s layout kept in its first step.
fn step_activation_bytes(cfg: &Config) -> Result<usize> {
    let task = Task::load(cfg)?;
    let job = Arc::new(cfg.job(&task)?);
    let workers = job.layout.world_size();
    job.check(workers)?;
    let peaks = ThreadsWorld::run(workers, CommConfig::default(), move |group| {
        let mut t = job.trainer(group, Some(1))?;
        Ok::<_, anyhow::Error>(t.train_step()?.peak_activation_bytes)
    })
    .map_err(|e| anyhow!("{e}"))?;
    Ok(peaks.into_iter().max().unwrap_or(0))
}

fn gpt(extra: &[String]) -> Result<Config> {
    let mut o = vec![
        "train.log_every=1000000".to_string(),
        "train.eval_batches=1".to_string(),
        "train.eval_every=1000000".to_string(),
    ];
    o.extend(extra.iter().cloned());
    Config::load(&PathBuf::from("configs/gpt.toml"), &o)
}

fn memory() -> Result<()> {
    const MIB: f64 = 1024.0 * 1024.0;
    println!(
        "## What one attention layer keeps for backward (batch 1, width 256, 4 heads, f32)\n\n\
         | seq | standard MiB | × previous | flash MiB | × previous |\n|---|---|---|---|---|"
    );
    let mut previous: Option<(usize, usize)> = None;
    for seq in [512usize, 1024, 2048, 4096, 8192] {
        let standard = attention_kept_bytes(AttentionKind::Standard, seq);
        let flash = attention_kept_bytes(AttentionKind::Flash, seq);
        let growth = |now: usize, before: Option<usize>| {
            before.map_or("".to_string(), |b| format!("{:.2}", now as f64 / b as f64))
        };
        println!(
            "| {seq} | {:.1} | {} | {:.2} | {} |",
            standard as f64 / MIB,
            growth(standard, previous.map(|p| p.0)),
            flash as f64 / MIB,
            growth(flash, previous.map(|p| p.1)),
        );
        previous = Some((standard, flash));
    }
    println!(
        "\n## Activations a GPT worker keeps in a step (GPT 256×4, seq 2048, batch 1; cp = 1 \
         with flash attention)\n\n| cp | mode | most activation MiB per worker | of one \
         worker's |\n|---|---|---|---|"
    );
    let mut one = None;
    for (cp, mode) in [
        (1usize, "ring"),
        (2, "ring"),
        (2, "ulysses"),
        (4, "ring"),
        (4, "ulysses"),
    ] {
        let cfg = gpt(&[
            "model.seq=2048".into(),
            "model.attention=\"flash\"".into(),
            "train.batch_size=1".into(),
            format!("parallel.cp={cp}"),
            format!("parallel.cp_mode=\"{mode}\""),
        ])?;
        let bytes = step_activation_bytes(&cfg)? as f64;
        let base = *one.get_or_insert(bytes);
        let mode = if cp == 1 { "—" } else { mode };
        println!(
            "| {cp} | {mode} | {:.1} | {:.3} |",
            bytes / MIB,
            bytes / base
        );
    }
    println!();
    Ok(())
}

/// A GPT at seq 8192 under a per-worker limit: refused after one worker's first step, trained
/// at cp = 4.
fn limit(args: &BenchContextArgs) -> Result<()> {
    let limit_mb = 400;
    println!("## GPT 256×4 at seq 8192 (flash attention, batch 1) under train.memory_limit_mb = {limit_mb}\n");
    for cp in [1usize, 4] {
        let cfg = gpt(&[
            "model.seq=8192".into(),
            "model.attention=\"flash\"".into(),
            "train.batch_size=1".into(),
            "train.steps=2".into(),
            format!("train.memory_limit_mb={limit_mb}"),
            format!("parallel.cp={cp}"),
            format!(
                "train.out_dir=\"{}\"",
                std::env::temp_dir()
                    .join(format!("meshtrain-bench-context-{}", std::process::id()))
                    .display()
            ),
        ])?;
        let task = Task::load(&cfg)?;
        match measure_layout(&format!("cp={cp}"), cfg, &task, args.threads, 1, 1) {
            Ok(run) => println!(
                "- cp={cp}: trains, {:.1} s per step (forward {:.0} ms, backward {:.0} ms, \
                 attention waited {:.0} ms of {:.0} ms of transfers)",
                run.step_ms / 1e3,
                run.forward_ms,
                run.backward_ms,
                run.cp_comm_ms,
                run.cp_busy_ms
            ),
            Err(e) => println!("- cp={cp}: refused: {e:#}"),
        }
    }
    let _ = std::fs::remove_dir_all(
        std::env::temp_dir().join(format!("meshtrain-bench-context-{}", std::process::id())),
    );
    println!();
    Ok(())
}

fn modes(args: &BenchContextArgs) -> Result<()> {
    println!(
        "## GPT step at cp = 2: ring vs Ulysses (GPT 256×4, seq {}, batch {}, {} threads in \
         all; alternating, {} rounds of {} timed steps; means over workers)\n\n| layout | \
         step ms (median) | vs one worker | forward ms | backward ms | attention waited ms \
         | transfers ran ms | hidden | sent M elements/step |\n|---|---|---|---|---|---|---|---|---|",
        args.seq, args.batch, args.threads, args.pairs, args.steps
    );
    let layouts: [(&str, &[&str]); 3] = [
        ("one worker, flash", &["model.attention=\"flash\""]),
        ("cp=2 ring", &["parallel.cp=2"]),
        (
            "cp=2 ulysses (flash)",
            &[
                "parallel.cp=2",
                "parallel.cp_mode=\"ulysses\"",
                "model.attention=\"flash\"",
            ],
        ),
    ];
    let base = |extra: &[&str]| {
        let mut o = vec![
            format!("model.seq={}", args.seq),
            format!("train.batch_size={}", args.batch),
        ];
        o.extend(extra.iter().map(|s| s.to_string()));
        gpt(&o)
    };
    let task = Task::load(&base(&[])?)?;
    let mut runs: Vec<Vec<ThroughputRun>> = vec![Vec::new(); layouts.len()];
    for _ in 0..args.pairs {
        for (i, (name, extra)) in layouts.iter().enumerate() {
            runs[i].push(measure_layout(
                name,
                base(extra)?,
                &task,
                args.threads,
                1,
                args.steps,
            )?);
        }
    }
    let step = |r: &[ThroughputRun]| median(r.iter().map(|x| x.step_ms).collect());
    let one = step(&runs[0]);
    for ((name, _), r) in layouts.iter().zip(&runs) {
        let m = |f: fn(&ThroughputRun) -> f64| median(r.iter().map(f).collect());
        let (waited, busy) = (m(|x| x.cp_comm_ms), m(|x| x.cp_busy_ms));
        let hidden = if busy > 0.0 {
            let hidden = meshtrain_parallel::context::CpComm::hidden_fraction(waited, busy);
            format!("{:.0}%", 100.0 * hidden)
        } else {
            "—".into()
        };
        println!(
            "| {name} | {:.0} | {:.2}x | {:.0} | {:.0} | {waited:.1} | {busy:.1} | {hidden} | \
             {:.2} |",
            step(r),
            one / step(r),
            m(|x| x.forward_ms),
            m(|x| x.backward_ms),
            m(|x| x.cp_elems_m),
        );
    }
    println!();
    Ok(())
}
