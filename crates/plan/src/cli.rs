//! `meshtrain plan`: the command-line face of the planner. The binary wires it in with
//! `Plan(meshtrain_plan::cli::PlanArgs)` and `meshtrain_plan::cli::run(&args)`.

use std::fmt::Write;
use std::path::Path;

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;

use crate::calibrate::{compare, Measurements};
use crate::cluster::{ClusterSpec, Precision, GIB};
use crate::cost::{Evaluation, Problem};
use crate::diagnose::{diagnose, parse_measurements};
use crate::explain::{losses, memo};
use crate::layout::{
    AttentionKind, CpMode, ElementwiseKernels, GradReduce, Layout, Optimizer, TrainingSetup,
};
use crate::model::ModelSpec;
use crate::presets;
use crate::search::{evaluate_layout, search_feasible, TIE};

/// Arguments of `meshtrain plan`.
#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    /// Model: a preset name (gpt, lenet, resnet18, gpt2-124m, llama-1b, gpt-30b, llama-70b,
    /// gpt-1.7b … gpt-1t, gpt3-175b) or a path to a model TOML file.
    #[arg(long, default_value = "gpt")]
    pub model: String,
    /// Cluster: a preset name (cpu-2core, a100-40gb, a100-80gb, h100-sxm-80gb,
    /// h200-sxm-141gb; short: cpu, a100, h100, h200) or a path to a cluster TOML file.
    #[arg(long, default_value = "cpu")]
    pub cluster: String,
    /// Number of GPUs (workers); defaults to the cluster preset's.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_gpus)]
    pub gpus: Option<u64>,
    /// Sequences (samples) per optimizer step over all replicas.
    #[arg(long, default_value_t = 64)]
    pub global_batch: u64,
    /// Sequence length (transformers); defaults to the model's.
    #[arg(long)]
    pub seq: Option<u64>,
    /// fp32, bf16, fp16 or fp8 (fp8 GEMMs inside bf16 layers; needs a cluster with an fp8
    /// peak); defaults to bf16 where the hardware has fast 16-bit math, else fp32.
    #[arg(long)]
    pub precision: Option<String>,
    /// adam or sgd.
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
    /// Reduce gradients only after backward (no overlap), as Megatron-LM did in 2021.
    #[arg(long)]
    pub no_overlap: bool,
    /// Attention kernel the trainer runs (its `model.attention`): `flash`, the default because
    /// current frameworks use memory-efficient attention (per-row log-sum-exps instead of the
    /// a·s² probabilities, score tiles recomputed in backward; also the trainer's default), or
    /// `standard` (probabilities kept, as in 2021–22 Megatron).
    #[arg(long, default_value = "flash")]
    pub attention: String,
    /// How the framework runs element-wise work: `fused` (Megatron's fused kernels,
    /// `torch.compile`) or `eager` (one PyTorch kernel per operation, norms and rotary
    /// embeddings in fp32).
    #[arg(long, default_value = "fused")]
    pub elementwise: String,
    /// The data-parallel all-reduce across nodes (the trainer's `parallel.grad_reduce`):
    /// `flat` (one ring, as NCCL with a card per GPU), `hierarchical` (inside the node, then
    /// the shards across nodes, then inside the node again; plain DDP only) or `auto` (the
    /// trainer's default rule over host collectives, MPI or staged: hierarchical when the
    /// group spans nodes with several of its ranks on each). The default, flat, is what
    /// NCCL-based GPU trainers do, and what the trainer's `auto` does over NCCL (whose rings
    /// and trees follow the nodes themselves); the printed run line names the planned choice
    /// wherever the group spans nodes.
    #[arg(long, default_value = "flat")]
    pub grad_reduce: String,
    /// Context-parallel mode the trainer uses (its `parallel.cp_mode`): `ring` or `ulysses`.
    /// Left out, the planner tries both for every layout with cp > 1 and shows which it picked.
    #[arg(long, value_name = "MODE")]
    pub cp_mode: Option<String>,
    /// How many layouts to print.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print the recommendation memo for the best layout.
    #[arg(long)]
    pub explain: bool,
    /// Evaluate this layout only instead of searching, e.g. `dp=2,tp=4,pp=4,cp=2,mb=1,zero=1,
    /// sp=on,recompute=selective,v=2,schedule=1f1b`.
    #[arg(long)]
    pub layout: Option<String>,
    /// Diagnose a measured step-time breakdown (TOML or JSON with workers, compute_s,
    /// comm_exposed_s, comm_hidden_s, bubble_s, data_s, optimizer_s; `[[run]]` for several).
    #[arg(long, value_name = "FILE")]
    pub diagnose: Option<String>,
    /// Measured hardware figures (TOML/JSON: matmul_gflops, memory_bandwidth_gbps,
    /// allreduce_bus_bandwidth_gbps, allreduce_latency_us, kernel_overhead_us,
    /// inter_node_bandwidth_gbps, inter_node_latency_us) replacing the cluster preset's.
    #[arg(long, value_name = "FILE")]
    pub measured: Option<String>,
    /// With --layout: a measured breakdown of that layout's run to compare with the prediction.
    #[arg(long, value_name = "FILE")]
    pub compare: Option<String>,
}

fn read(path: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {path}"))
}

fn is_file(arg: &str) -> bool {
    arg.ends_with(".toml") || arg.ends_with(".json") || Path::new(arg).is_file()
}

fn load_model(arg: &str) -> anyhow::Result<ModelSpec> {
    Ok(if is_file(arg) {
        ModelSpec::from_toml(&read(arg)?).with_context(|| format!("model file {arg}"))?
    } else {
        presets::model(arg)?
    })
}

/// `--gpus`: a positive whole number. Negative values are taken as values (not as unknown
/// options) so that `--gpus -8` says what is wrong with it.
fn parse_gpus(text: &str) -> std::result::Result<u64, String> {
    match text.trim().parse::<i128>() {
        // 0 passes on to the cluster check, which says the cluster needs a GPU.
        Ok(n) if n >= 0 => u64::try_from(n).map_err(|_| format!("{n} GPUs is too many")),
        Ok(n) => Err(format!(
            "the number of GPUs cannot be negative (got {n}); give at least one GPU"
        )),
        Err(_) => Err(format!(
            "the number of GPUs must be a whole number such as 8, got `{text}`"
        )),
    }
}

fn load_cluster(arg: &str) -> anyhow::Result<ClusterSpec> {
    Ok(if is_file(arg) {
        ClusterSpec::from_toml(&read(arg)?).with_context(|| format!("cluster file {arg}"))?
    } else {
        presets::cluster(arg)?
    })
}

/// Builds the problem the arguments describe.
pub fn problem_from_args(args: &PlanArgs) -> anyhow::Result<Problem> {
    let mut model = load_model(&args.model)?;
    if let Some(seq) = args.seq {
        model = model.with_seq_len(seq)?;
    }
    let mut cluster = load_cluster(&args.cluster)?;
    if let Some(gpus) = args.gpus {
        cluster = cluster.with_gpus(gpus)?;
    }
    if let Some(path) = &args.measured {
        cluster = Measurements::parse(&read(path)?)?.apply(&cluster)?;
    }
    let precision = match &args.precision {
        Some(p) => Precision::parse(p)?,
        None if cluster.peak_tflops.bf16 > cluster.peak_tflops.fp32 => Precision::Bf16,
        None => Precision::Fp32,
    };
    let optimizer = match args.optimizer.to_ascii_lowercase().as_str() {
        "adam" | "adamw" => Optimizer::Adam,
        "sgd" => Optimizer::Sgd,
        other => bail!("unknown optimizer `{other}`; use adam or sgd"),
    };
    let attention = AttentionKind::parse(&args.attention).map_err(anyhow::Error::msg)?;
    let cp_mode = args
        .cp_mode
        .as_deref()
        .map(CpMode::parse)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let elementwise = ElementwiseKernels::parse(&args.elementwise).map_err(anyhow::Error::msg)?;
    let grad_reduce = GradReduce::parse(&args.grad_reduce).map_err(anyhow::Error::msg)?;
    let setup = TrainingSetup {
        optimizer,
        overlap_grad_reduce: !args.no_overlap,
        attention,
        cp_mode,
        elementwise,
        grad_reduce,
        ..TrainingSetup::new(args.global_batch, precision)
    };
    Ok(Problem::new(model, cluster, setup)?)
}

#[derive(Serialize)]
struct JsonReport<'a> {
    model: &'a ModelSpec,
    cluster: &'a ClusterSpec,
    setup: &'a TrainingSetup,
    candidates: usize,
    out_of_memory: usize,
    plans: &'a [Evaluation],
}

fn table(problem: &Problem, plans: &[Evaluation]) -> String {
    let transformer = problem.model.transformer().is_some();
    let mut out = format!(
        "{:>3}  {:<72} {:<8} {:>8} {:>9} {:>12} {:>9} {:>6}  {}\n",
        "#",
        "layout",
        "cp mode",
        "mem GiB",
        "step s",
        if transformer { "tokens/s" } else { "samples/s" },
        "TFLOP/s",
        "MFU",
        "largest loss"
    );
    for (i, e) in plans.iter().enumerate() {
        let rate = if transformer {
            e.throughput.tokens_per_s
        } else {
            e.throughput.samples_per_s
        };
        let loss = losses(e)
            .first()
            .filter(|(_, s)| *s > 0.0)
            .map(|(l, s)| format!("{} {:.1}%", l.name(), 100.0 * s / e.time.step_s))
            .unwrap_or_else(|| "-".into());
        let cp_mode = if e.layout.cp > 1 {
            e.layout.cp_mode.name()
        } else {
            "-"
        };
        let _ = writeln!(
            out,
            "{:>3}  {:<72} {:<8} {:>8.1} {:>9.4} {:>12.0} {:>9.2} {:>5.1}%  {loss}",
            i + 1,
            e.layout.to_string(),
            cp_mode,
            e.memory.total() / GIB,
            e.time.step_s,
            rate,
            e.throughput.tflops_per_gpu,
            100.0 * e.throughput.mfu
        );
    }
    // The order (`search::rank`): the recommendation, then fastest first. Say so where the
    // recommendation is not the fastest row, so the step times read as intended.
    if let Some((i, fastest)) = plans
        .iter()
        .enumerate()
        .skip(1)
        .min_by(|(_, a), (_, b)| a.time.step_s.total_cmp(&b.time.step_s))
        .filter(|(_, f)| f.time.step_s < plans[0].time.step_s)
    {
        let _ = writeln!(
            out,
            "  #1 is recommended over the fastest, #{} ({:.4} s), as the simplest layout predicted \
             within {:.1}% of it (inside the time model's resolution); the others follow fastest first",
            i + 1,
            fastest.time.step_s,
            100.0 * (TIE - 1.0)
        );
    }
    out
}

/// Produces everything `meshtrain plan` prints.
pub fn render(args: &PlanArgs) -> anyhow::Result<String> {
    if let Some(path) = &args.diagnose {
        let runs = parse_measurements(&read(path)?)?;
        return Ok(diagnose(&runs));
    }
    let problem = problem_from_args(args)?;
    let (plans, candidates, out_of_memory) = match &args.layout {
        Some(spec) => {
            let layout = Layout::parse(spec)?;
            let evaluation = evaluate_layout(&problem, &layout)?;
            if args.compare.is_none() {
                // A layout that does not fit is an error with the numbers, unless the user
                // only wants to compare it with a run.
                evaluation.clone().require_fit(&problem.cluster)?;
            }
            (vec![evaluation], 1, 0)
        }
        None => {
            let result = search_feasible(&problem)?;
            let n = result.ranked.len().min(args.top.max(1));
            (
                result.ranked[..n].to_vec(),
                result.candidates,
                result.out_of_memory,
            )
        }
    };
    if args.json {
        let report = JsonReport {
            model: &problem.model,
            cluster: &problem.cluster,
            setup: &problem.setup,
            candidates,
            out_of_memory,
            plans: &plans,
        };
        return Ok(serde_json::to_string_pretty(&report)? + "\n");
    }
    let mut out = format!(
        "{} on {} × {}, global batch {}, {}: {} layouts evaluated, {} do not fit",
        problem.model.name,
        problem.cluster.gpus,
        problem.cluster.name,
        problem.setup.global_batch,
        problem.setup.precision.name(),
        candidates,
        out_of_memory
    );
    if problem.model.transformer().is_some() {
        let _ = write!(out, "; {} attention", problem.setup.attention.name());
    }
    out += "\n";
    out += &table(&problem, &plans);
    if let Some(path) = &args.compare {
        let runs = parse_measurements(&read(path)?)?;
        for run in &runs {
            out += "\n";
            out += &compare(&plans[0], run);
        }
    }
    if args.explain {
        out += "\n";
        out += &memo(&problem, &plans[0]);
    }
    Ok(out)
}

/// Entry point of `meshtrain plan`.
pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    print!("{}", render(args)?);
    Ok(())
}
