//! The recommendation memo: why the chosen layout fits, where gradients and activations are
//! synchronised (context parallelism included) and what that costs, what micro-batching buys
//! over naive layer splitting, how mixed precision saves memory and stays stable, and what
//! will stop perfect scaling.

use std::fmt::Write;

use crate::cluster::{Precision, GIB};
use crate::cost::{Evaluation, Problem};
use crate::layout::{
    AttentionKind, CpMode, GradReduce, Layout, Recompute, Schedule, TrainingSetup,
};

/// Causes of lost time in a step, as fractions of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    TensorParallelComm,
    ContextParallelComm,
    PipelineBubble,
    PipelineSends,
    DataParallelComm,
    Recomputation,
    Optimizer,
    GradientAccumulation,
    StepBookkeeping,
}

impl Loss {
    pub fn name(self) -> &'static str {
        match self {
            Loss::TensorParallelComm => "tensor-parallel all-reduces",
            Loss::ContextParallelComm => "exposed context-parallel exchanges",
            Loss::PipelineBubble => "pipeline bubble",
            Loss::PipelineSends => "pipeline point-to-point sends",
            Loss::DataParallelComm => "exposed data-parallel gradient reduction",
            Loss::Recomputation => "activation recomputation",
            Loss::Optimizer => "optimizer step",
            Loss::GradientAccumulation => "gradient accumulation over micro-batches",
            Loss::StepBookkeeping => {
                "per-step bookkeeping (gradient copy, clipping norm, embedding sync)"
            }
        }
    }

    /// [`Loss::name`], naming ZeRO-3's traffic for what it is.
    pub fn label(self, layout: &Layout) -> &'static str {
        match self {
            Loss::DataParallelComm if layout.zero >= 3 => {
                "data-parallel sharding traffic (ZeRO-3 weight gathers and gradient reduce-scatters)"
            }
            // Without recomputation what is recomputed is the memory-efficient attention
            // kernel's score tiles in its backward: not activation recomputation.
            Loss::Recomputation if layout.recompute == Recompute::None => {
                "attention backward's rescoring (the flash kernel's recomputed score tiles)"
            }
            _ => self.name(),
        }
    }

    /// Whether this loss exists because the work is spread over GPUs (communication and the
    /// pipeline's idle time), as opposed to a cost every GPU would pay on its own
    /// (recomputation, the optimizer, accumulation, bookkeeping). Only these stop scaling.
    pub fn grows_with_gpus(self) -> bool {
        matches!(
            self,
            Loss::TensorParallelComm
                | Loss::ContextParallelComm
                | Loss::PipelineBubble
                | Loss::PipelineSends
                | Loss::DataParallelComm
        )
    }

    /// The first thing to try against this loss in this layout.
    pub fn mitigation(self, layout: &Layout) -> &'static str {
        match self {
            Loss::Recomputation if layout.recompute == Recompute::None => "none needed: this is the memory-efficient attention kernel recomputing its score tiles in backward, the price of not keeping the a·s² probabilities",
            Loss::ContextParallelComm if layout.cp_mode == CpMode::Ulysses => "keep the cp group inside one node (tp·cp ≤ GPUs per node), or use ring attention, whose hops overlap the attention compute",
            Loss::ContextParallelComm => "keep the cp group inside one node (tp·cp ≤ GPUs per node) or use fewer cp ranks: each ring hop hides under the attention of one (s/cp)² block, which shrinks quadratically as cp grows while the hop shrinks only linearly",
            Loss::Recomputation if layout.recompute == Recompute::Selective => "free memory to stop recomputing (a smaller micro-batch, a higher ZeRO stage, or sequence parallelism), or accept it: selective recomputation costs only the attention core",
            Loss::TensorParallelComm => "keep the tensor-parallel group inside one node (tp ≤ GPUs per node) and shrink tp, moving the freed factor to pipeline parallelism; add sequence parallelism so the same traffic also cuts activation memory",
            Loss::PipelineBubble => "raise the number of micro-batches per step (smaller micro-batches or a larger global batch) or use the interleaved 1F1B schedule (v model chunks per GPU divide the bubble by v)",
            Loss::PipelineSends => "place consecutive pipeline stages inside a node, or use fewer, larger stages",
            Loss::DataParallelComm if layout.zero >= 3 => "keep ZeRO-3's per-micro-batch weight gathers off the slow link: shard over the GPUs of one node and move the factor that crosses nodes to pipeline parallelism (only one activation per micro-batch crosses then), or drop to ZeRO-1 if memory allows (weights gathered once per step)",
            Loss::DataParallelComm if layout.zero == 2 => "ZeRO-2 reduce-scatters the gradients of every micro-batch: drop to ZeRO-1 (one reduction per step, gradients accumulated locally) if memory allows, or use larger micro-batches so fewer reductions carry the same samples",
            Loss::DataParallelComm => "overlap the gradient all-reduce with backward (bucketed, reverse layer order), reduce in bf16, and grow the per-GPU batch with gradient accumulation so the same all-reduce is paid once for more compute; keep the data-parallel group's traffic on as many network cards as possible, and where a node has fewer cards than workers reduce hierarchically (`parallel.grad_reduce = \"hierarchical\"`: inside the node first, so each node's cards carry 2(H−1)/H of the gradients over H nodes instead of a flat ring's 2(n−1)/n)",
            Loss::Recomputation => "switch from full to selective recomputation (only the attention core) if memory allows; sequence parallelism frees the memory to do so",
            Loss::Optimizer => "shard the optimizer (ZeRO-1 / distributed optimizer) so each GPU updates only its slice",
            Loss::GradientAccumulation => "use larger micro-batches (fewer accumulation passes per step), or a weight-gradient GEMM that accumulates in place (Megatron-Core's gradient_accumulation_fusion)",
            Loss::StepBookkeeping => "shard the optimizer so the per-step passes cover only a slice; untie the embeddings or keep first and last pipeline stage in one node",
        }
    }
}

/// The exposed losses of an evaluation, largest first, as (loss, seconds).
pub fn losses(e: &Evaluation) -> Vec<(Loss, f64)> {
    let t = &e.time;
    let mut v = vec![
        (Loss::TensorParallelComm, t.tp_comm_s),
        (Loss::ContextParallelComm, t.cp_comm_s),
        (Loss::PipelineBubble, t.bubble_s),
        (Loss::PipelineSends, t.pp_p2p_s),
        (Loss::DataParallelComm, t.dp_exposed_s),
        (Loss::Recomputation, t.recompute_s),
        (Loss::Optimizer, t.optimizer_s),
        (Loss::GradientAccumulation, t.accumulate_s),
        (Loss::StepBookkeeping, t.fixed_s),
    ];
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

fn gib(bytes: f64) -> f64 {
    bytes / GIB
}

fn pct(part: f64, whole: f64) -> f64 {
    100.0 * part / whole
}

/// The single-GPU baseline: everything on one GPU, micro-batch 1, no recomputation.
fn single_gpu_need(problem: &Problem) -> Option<f64> {
    let one = problem.cluster.with_gpus(1).ok()?;
    let p = Problem::new(problem.model.clone(), one, problem.setup.clone()).ok()?;
    let mut layout = Layout::data_parallel(1, 1);
    layout.recompute = Recompute::None;
    p.evaluate(&layout).ok().map(|e| e.memory.total())
}

/// The same layout in fp32, for the mixed-precision comparison.
fn fp32_twin(problem: &Problem, layout: &Layout) -> Option<Evaluation> {
    let setup = TrainingSetup {
        precision: Precision::Fp32,
        ..problem.setup.clone()
    };
    let p = Problem::new(problem.model.clone(), problem.cluster.clone(), setup).ok()?;
    p.evaluate(layout).ok()
}

/// The losses that exist because the work is spread over GPUs (see [`Loss::grows_with_gpus`]),
/// largest exposed time first.
pub fn scaling_losses(e: &Evaluation) -> Vec<(Loss, f64)> {
    losses(e)
        .into_iter()
        .filter(|(loss, _)| loss.grows_with_gpus())
        .collect()
}

/// Share of perfect scaling: the step without the losses of [`scaling_losses`] (every GPU
/// doing only its own share of the work, nothing exposed waiting for another) over the
/// predicted step. At most 1 by construction; per-GPU costs such as recomputation or the
/// optimizer count as work, since one GPU alone would pay them too.
pub fn scaling_efficiency(e: &Evaluation) -> f64 {
    let lost: f64 = scaling_losses(e).iter().map(|(_, s)| s).sum();
    ((e.time.step_s - lost) / e.time.step_s).clamp(0.0, 1.0)
}

/// The loss that stops perfect scaling: the largest exposed one of [`scaling_losses`]; when
/// none is exposed, the data-parallel traffic if any (it grows with the replicas even while
/// compute hides it).
pub fn scaling_bottleneck(e: &Evaluation) -> Option<(Loss, f64)> {
    scaling_losses(e)
        .into_iter()
        .find(|(_, s)| *s > 0.0)
        .or_else(|| (e.time.dp_hidden_s > 0.0).then_some((Loss::DataParallelComm, 0.0)))
}

/// Layouts on the same GPUs that apply the first mitigation of `loss` to `layout`.
pub fn mitigation_variants(problem: &Problem, layout: &Layout, loss: Loss) -> Vec<Layout> {
    let l = layout;
    let mut out = Vec::new();
    match loss {
        Loss::DataParallelComm => {
            // Move the factor of the data-parallel group that crosses nodes to the pipeline.
            let group = l.dp * l.tp * l.cp;
            let per_node = problem.cluster.gpus_per_node;
            if group > per_node && group.is_multiple_of(per_node) {
                let f = group / per_node;
                if l.dp.is_multiple_of(f) {
                    let mut stages = vec![l.zero, 1, 0];
                    stages.dedup();
                    for zero in stages {
                        out.push(Layout {
                            dp: l.dp / f,
                            pp: l.pp * f,
                            zero,
                            ..l.clone()
                        });
                    }
                }
            }
            for zero in (0..l.zero).rev() {
                out.push(Layout { zero, ..l.clone() });
            }
            out.push(Layout {
                micro_batch: 2 * l.micro_batch,
                ..l.clone()
            });
        }
        Loss::PipelineBubble => {
            out.push(Layout {
                interleave: 2 * l.interleave,
                ..l.clone()
            });
            if l.micro_batch > 1 {
                out.push(Layout {
                    micro_batch: l.micro_batch / 2,
                    ..l.clone()
                });
            }
        }
        Loss::PipelineSends if l.pp.is_multiple_of(2) => out.push(Layout {
            pp: l.pp / 2,
            dp: 2 * l.dp,
            interleave: 1,
            ..l.clone()
        }),
        Loss::TensorParallelComm => {
            if !l.sp {
                out.push(Layout {
                    sp: true,
                    ..l.clone()
                });
            }
            if l.tp.is_multiple_of(2) {
                out.push(Layout {
                    tp: l.tp / 2,
                    pp: 2 * l.pp,
                    ..l.clone()
                });
            }
        }
        Loss::ContextParallelComm => {
            let other = match l.cp_mode {
                CpMode::Ring => CpMode::Ulysses,
                CpMode::Ulysses => CpMode::Ring,
            };
            out.push(Layout {
                cp_mode: other,
                ..l.clone()
            });
            if l.cp.is_multiple_of(2) {
                out.push(Layout {
                    cp: l.cp / 2,
                    dp: 2 * l.dp,
                    ..l.clone()
                });
            }
        }
        _ => {}
    }
    out
}

/// The fastest layout of [`mitigation_variants`] that can run and fits, evaluated by the
/// same model that ranked `best`. Each variant is also tried with the micro-batch sizes and
/// recomputation modes its new shape may need (a pipeline wants more, smaller micro-batches;
/// fewer shards may need recomputation to fit).
pub fn best_mitigation(problem: &Problem, best: &Evaluation, loss: Loss) -> Option<Evaluation> {
    let mut tried = Vec::new();
    for variant in mitigation_variants(problem, &best.layout, loss) {
        // A variant that only changes the micro-batch keeps its size; the others may re-pick it.
        let only_micro_batch = Layout {
            micro_batch: best.layout.micro_batch,
            ..variant.clone()
        } == best.layout;
        let mut sizes = vec![variant.micro_batch];
        if !only_micro_batch {
            sizes.extend([1, 2, 4]);
        }
        sizes.dedup();
        for micro_batch in sizes {
            for recompute in [
                variant.recompute,
                Recompute::None,
                Recompute::Selective,
                Recompute::Full,
            ] {
                let layout = Layout {
                    micro_batch,
                    recompute,
                    ..variant.clone()
                };
                // Changing only the recomputation is not the mitigation.
                let same_shape = Layout {
                    recompute: best.layout.recompute,
                    ..layout.clone()
                } == best.layout;
                if !same_shape && !tried.contains(&layout) {
                    tried.push(layout);
                }
            }
        }
    }
    tried
        .iter()
        .filter_map(|layout| problem.evaluate(layout).ok())
        .filter(|e| e.fits)
        .min_by(|a, b| a.time.step_s.total_cmp(&b.time.step_s))
}

/// The command that runs `layout` as planned: the model's config (the repository's for the
/// built-in models), the layout string plus the trainer options it cannot carry (the cp mode,
/// and the attention kernel when it is not the trainer's default, flash).
pub fn train_command(problem: &Problem, layout: &Layout) -> String {
    let config = match problem.model.name.as_str() {
        "gpt" => "configs/gpt.toml".to_string(),
        "lenet" => "configs/lenet-sigmoid.toml".to_string(),
        "resnet18" => "configs/resnet18.toml".to_string(),
        "llama" => "configs/llama.toml".to_string(),
        "llama-1b" => "configs/llama-1b.toml".to_string(),
        // A preset without a trainer config: the user's config for it (its [model] table).
        other => format!("<your config for {other}>"),
    };
    let mut command = format!("meshtrain train --config {config} --layout \"{layout}\"");
    // The trainer's default is `auto`, which over a plain-DDP group spanning nodes with
    // several ranks on each decides by its collectives (hierarchical over host ones, flat
    // over NCCL): name the planned reduction there.
    let spans = problem
        .cluster
        .hierarchical_all_reduce_time(1.0, layout.gradient_group(), layout.tp)
        .is_some();
    let chosen = problem.setup.grad_reduce;
    if chosen != GradReduce::Auto && spans && layout.zero == 0 {
        command += &format!(" --set parallel.grad_reduce=\"{}\"", chosen.name());
    }
    if layout.cp > 1 {
        command += &format!(" --set parallel.cp_mode=\"{}\"", layout.cp_mode.name());
    }
    // The planned precision (a config's own may differ); fp32 is the trainer's default.
    if problem.setup.precision != Precision::Fp32 {
        command += &format!(" --precision {}", problem.setup.precision.name());
    }
    // (Ring attention runs the memory-efficient block kernel whatever the option says.)
    if problem.model.transformer().is_some()
        && problem.attention_kernel(layout) == AttentionKind::Standard
    {
        command += " --set model.attention=\"standard\"";
    }
    command
}

/// The same layout with the other cp mode, when the planner chose the mode: its evaluation,
/// or why it cannot run.
fn other_cp_mode(
    problem: &Problem,
    best: &Evaluation,
) -> Option<(CpMode, Result<Evaluation, String>)> {
    let l = &best.layout;
    if l.cp == 1 || problem.setup.cp_mode.is_some() {
        return None;
    }
    let other = match l.cp_mode {
        CpMode::Ring => CpMode::Ulysses,
        CpMode::Ulysses => CpMode::Ring,
    };
    let layout = Layout {
        cp_mode: other,
        ..l.clone()
    };
    Some((other, problem.evaluate(&layout).map_err(|e| e.to_string())))
}

/// Writes the memo for the chosen evaluation.
pub fn memo(problem: &Problem, best: &Evaluation) -> String {
    let mut out = String::new();
    let c = &problem.cluster;
    let l = &best.layout;
    let t = &best.time;
    let m = &best.memory;
    let step = t.step_s;
    let _ = writeln!(
        out,
        "Recommendation for {} on {} × {} ({} per node), global batch {}, {}:\n  {l}\n  predicted step {:.3} s, {:.0} tokens/s, {:.3} TFLOP/s per GPU, MFU {:.1}%\n  run it: {}\n",
        problem.model.name,
        c.gpus,
        c.name,
        c.gpus_per_node,
        problem.setup.global_batch,
        problem.setup.precision.name(),
        step,
        best.throughput.tokens_per_s,
        best.throughput.tflops_per_gpu,
        100.0 * best.throughput.mfu,
        train_command(problem, l)
    );

    // 1. Memory.
    let _ = writeln!(out, "1. Fitting in memory");
    if let Some(need) = single_gpu_need(problem) {
        let verdict = if need > c.memory_gib * GIB {
            "does not fit"
        } else {
            "would fit"
        };
        let _ = writeln!(
            out,
            "   On a single GPU the model needs {:.1} GiB (weights, gradients, optimizer states and one micro-batch of activations) and {verdict} in {:.0} GiB.",
            gib(need),
            c.memory_gib
        );
    }
    let mut how = Vec::new();
    if l.tp > 1 {
        how.push(format!(
            "tensor parallelism splits every weight matrix over {} GPUs",
            l.tp
        ));
    }
    if l.pp > 1 {
        how.push(format!(
            "pipeline parallelism gives each GPU 1/{} of the layers",
            l.pp
        ));
    }
    if l.cp > 1 {
        how.push(format!(
            "context parallelism ({}) splits every sequence over {} GPUs, so each keeps 1/{} of the activations",
            l.cp_mode.name(),
            l.cp,
            l.cp
        ));
    }
    if l.zero > 0 {
        let what = match l.zero {
            1 => "the optimizer states",
            2 => "optimizer states and gradients",
            _ => "optimizer states, gradients and weights",
        };
        let group = if l.cp > 1 {
            format!("{} data- × context-parallel ranks", l.gradient_group())
        } else {
            format!("{} data-parallel ranks", l.dp)
        };
        how.push(format!("ZeRO-{} shards {what} over the {group}", l.zero));
    }
    if problem.model.transformer().is_some() && problem.attention_kernel(l) == AttentionKind::Flash
    {
        let kernel = if problem.setup.attention == AttentionKind::Flash {
            "the memory-efficient attention kernel"
        } else {
            "ring attention's blocks run the memory-efficient kernel (whatever model.attention says), which"
        };
        how.push(format!(
            "{kernel} keeps one log-sum-exp per row and head instead of the a·s² probabilities"
        ));
    }
    match l.recompute {
        Recompute::Full => how.push("full recomputation keeps only each layer's input".into()),
        Recompute::Selective => {
            how.push("selective recomputation drops the attention scores (the 5as/h term)".into())
        }
        Recompute::None => {}
    }
    if l.sp {
        how.push("sequence parallelism splits the layer-norm and dropout activations too".into());
    }
    if how.is_empty() {
        how.push("the model fits as is; every GPU holds a full replica".into());
    }
    let _ = writeln!(
        out,
        "   This layout: {}. Per GPU: weights {:.1}, gradients {:.1}, optimizer {:.1}, activations {:.1}, buffers {:.1}, reserved {:.1} = {:.1} of {:.0} GiB.\n",
        how.join("; "),
        gib(m.weights),
        gib(m.gradients),
        gib(m.optimizer),
        gib(m.activations),
        gib(m.comm_buffers),
        gib(m.reserved),
        gib(m.total()),
        c.memory_gib
    );

    // 2. Communication.
    let _ = writeln!(out, "2. Where gradients and activations are synchronised");
    if l.gradient_group() > 1 {
        let link = if best.links.dp_crosses_nodes {
            "between nodes"
        } else {
            "inside a node"
        };
        let (label, who, ranks) = match (l.dp, l.cp) {
            (_, 1) => (
                "Data parallelism",
                format!(
                    "each of the {} replicas computes gradients of its own samples",
                    l.dp
                ),
                l.dp.to_string(),
            ),
            (1, cp) => (
                "Gradient reduction",
                format!("the {cp} context-parallel ranks hold the same weights and compute gradients of different tokens of the same samples"),
                cp.to_string(),
            ),
            (dp, cp) => (
                "Data parallelism",
                format!("each of the {dp} replicas (each spread over {cp} context-parallel ranks that hold the same weights) computes gradients of its own samples' tokens"),
                format!("dp·cp = {}", l.gradient_group()),
            ),
        };
        let how = match l.zero {
            0 => "all-reduced after backward".to_string(),
            1 => "reduce-scattered after backward (each rank keeps the slice it updates) and the updated weights all-gathered".to_string(),
            2 => format!("reduce-scattered during the backward of each of the {} micro-batches (ZeRO-2 keeps only its slice of the gradients, so it cannot accumulate them whole) and the updated weights all-gathered once", t.microbatches),
            _ => {
                let weights = best.memory.weights * l.gradient_group() as f64;
                format!(
                    "reduce-scattered, and the weights ({:.2} GB for this stage) all-gathered before each forward and again before each backward, in each of the {} micro-batches, so the traffic is about three times the weights per micro-batch, not the gradient size once",
                    weights / 1e9,
                    t.microbatches
                )
            }
        };
        let _ = writeln!(
            out,
            "   {label}: {who}; gradients are {how}, across {ranks} ranks {link}: {:.2} GB through each GPU's link per step at {:.0} GB/s bus bandwidth. That takes {:.3} s per step, of which {:.3} s hide under backward compute; {:.3} s ({:.1}% of the step) are exposed, counting the memory bandwidth the hidden part takes from the compute beside it.",
            best.links.dp_bytes / 1e9,
            best.links.dp_bandwidth / 1e9,
            t.dp_exposed_s + t.dp_hidden_s,
            t.dp_hidden_s,
            t.dp_exposed_s,
            pct(t.dp_exposed_s, step)
        );
    } else {
        let _ = writeln!(
            out,
            "   No data parallelism: there is no gradient all-reduce between replicas."
        );
    }
    if l.tp > 1 {
        let link = if best.links.tp_crosses_nodes {
            "over the inter-node network (slow: keep tp within a node)"
        } else {
            "over the intra-node links (NVLink)"
        };
        let _ = writeln!(
            out,
            "   Tensor parallelism: every layer all-reduces its activations {} times per micro-batch {link}: {:.3} s per step ({:.1}%), on the critical path.",
            if l.recompute == Recompute::Full { 6 } else { 4 },
            t.tp_comm_s,
            pct(t.tp_comm_s, step)
        );
    }
    if l.cp > 1 {
        let link = if best.links.cp_crosses_nodes {
            "between nodes (tp·cp exceeds a node)"
        } else {
            "inside a node"
        };
        let how = match l.cp_mode {
            CpMode::Ring => format!(
                "ring attention: every layer passes K/V blocks {} hops around the ring in forward and K/V plus the dK/dV accumulators {} hops in backward, each hop overlapping the attention compute of one block; {:.3} s per step hide under it and {:.3} s ({:.1}% of the step) are exposed",
                l.cp - 1,
                l.cp,
                t.cp_hidden_s,
                t.cp_comm_s,
                pct(t.cp_comm_s, step)
            ),
            CpMode::Ulysses => format!(
                "Ulysses: every layer all-to-alls q/k/v (sequence shards to head shards) and its output back, in forward and again in backward, not overlapped: {:.3} s per step ({:.1}%) on the critical path",
                t.cp_comm_s,
                pct(t.cp_comm_s, step)
            ),
        };
        let _ = writeln!(
            out,
            "   Context parallelism over {} GPUs {link}, {how}.",
            l.cp
        );
        if let Some((other, evaluation)) = other_cp_mode(problem, best) {
            let verdict = match evaluation {
                Ok(e) if !e.fits => format!(
                    "would need {:.1} GiB per GPU and does not fit",
                    gib(e.memory.total())
                ),
                Ok(e) => format!(
                    "would take {:.3} s per step ({:+.1}%)",
                    e.time.step_s,
                    pct(e.time.step_s - step, step)
                ),
                Err(reason) => format!("cannot run it: {reason}"),
            };
            let _ = writeln!(
                out,
                "   The planner picked {} for this layout: {} {verdict}. Tell the trainer with --set parallel.cp_mode=\"{}\".",
                l.cp_mode.name(),
                other.name(),
                l.cp_mode.name()
            );
        }
    }
    if l.pp > 1 {
        let _ = writeln!(
            out,
            "   Pipeline parallelism: only the boundary activations travel between stages ({}): {:.3} s per step.",
            if best.links.pp_crosses_nodes { "between nodes" } else { "inside a node" },
            t.pp_p2p_s
        );
    }
    let _ = writeln!(out);

    // 3. Micro-batching.
    let _ = writeln!(out, "3. Micro-batching versus naive layer splitting");
    let mbs = t.microbatches;
    if l.pp > 1 {
        let v = if l.schedule == Schedule::OneFOneB {
            l.interleave
        } else {
            1
        } as f64;
        let bubble = (l.pp - 1) as f64 / (v * mbs as f64);
        let _ = writeln!(
            out,
            "   Naively splitting the layers over {} GPUs runs one stage at a time: each GPU is busy 1/{} = {:.0}% of the step. Cutting the batch into {mbs} micro-batches lets stage k work on micro-batch i while stage k+1 works on i−1; only the fill and drain remain idle, a bubble of {} = {:.1}% of the ideal time ({:.3} s). {}",
            l.pp,
            l.pp,
            100.0 / l.pp as f64,
            if v > 1.0 { "(p−1)/(v·m)" } else { "(p−1)/m" },
            100.0 * bubble,
            t.bubble_s,
            if l.schedule == Schedule::GPipe {
                "GPipe keeps all micro-batches' activations; 1F1B would keep at most p."
            } else {
                "The 1F1B schedule starts each backward as early as possible, so at most p micro-batches of activations are alive."
            }
        );
    } else {
        let n = c.gpus.max(2);
        let _ = writeln!(
            out,
            "   This layout needs no pipeline, so there is no bubble. Had the layers been split naively over {n} GPUs, each would idle {:.0}% of the time; with m micro-batches the idle share falls to (p−1)/(m+p−1). Here the {mbs} micro-batch(es) per replica are gradient accumulation: they bound activation memory without adding communication.",
            100.0 * (1.0 - 1.0 / n as f64),
        );
    }
    let _ = writeln!(out);

    // 4. Mixed precision.
    let _ = writeln!(out, "4. Mixed precision");
    match problem.setup.precision {
        Precision::Fp32 if c.peak_tflops.bf16 <= c.peak_tflops.fp32 => {
            let _ = writeln!(
                out,
                "   Training in fp32: this hardware has no faster 16-bit math, so bf16 would only halve weight, gradient and activation memory (and communication volume), while fp32 master weights and optimizer states keep updates exact."
            );
        }
        Precision::Fp32 => {
            let _ = writeln!(
                out,
                "   Training in fp32. bf16 would halve weight, gradient and activation memory and run matrix multiplies on tensor cores at {:.0} instead of {:.0} TFLOP/s, while fp32 master weights and optimizer states keep updates exact.",
                c.peak_tflops.bf16, c.peak_tflops.fp32
            );
        }
        Precision::Fp8 => {
            let _ = writeln!(
                out,
                "   Matrix multiplications run in fp8 ({:.0} vs {:.0} TFLOP/s bf16): each GEMM's inputs are cast to e4m3 (gradients to e5m2) with a per-tensor scale kept from the tensor's recent maxima, and the product accumulates in fp32. Everything else stays as in bf16 training: activations, element-wise work, attention and communication in bf16 (2 bytes), master weights and Adam moments in fp32. Only the GEMM share of the step gets faster, so the gain is below 2×. These figures model Transformer Engine's delayed scaling (one cast pass per tensor, weights cast once per step); meshtrain's trainer (`--precision fp8`, Ada and Hopper GPUs) scales each tensor by its own current maximum, which costs one more read of it, and casts weights per micro-batch.",
                problem.cluster.peak_flops(Precision::Fp8) / 1e12,
                c.peak_tflops.bf16,
            );
        }
        precision => {
            let twin = fp32_twin(problem, l);
            let saving = twin
                .as_ref()
                .map(|f| format!(" The same layout in fp32 would need {:.1} GiB per GPU instead of {:.1} and run at {:.1}× the step time.", gib(f.memory.total()), gib(m.total()), f.time.step_s / step))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "   Weights, activations and gradients are {} (2 bytes), so matrix multiplies run on tensor cores ({:.0} vs {:.0} TFLOP/s fp32) and activations take half the memory.{saving} What stays in fp32: the master weights and Adam moments (updates of size lr·g are far below a 16-bit weight's resolution and would be rounded away), the reductions inside layer norm, softmax and the loss (long sums lose precision in 16 bits), and gradient accumulation across micro-batches. {}",
                precision.name(),
                problem.cluster.peak_flops(precision) / 1e12,
                c.peak_tflops.fp32,
                if precision == Precision::Fp16 {
                    "fp16's narrow range needs dynamic loss scaling: the loss is multiplied by S before backward so small gradients do not flush to zero, gradients are unscaled in fp32, and a step with inf/NaN is skipped and S halved."
                } else {
                    "bf16 has fp32's exponent range, so no loss scaling is needed; its short mantissa is why the master copy stays fp32."
                }
            );
        }
    }
    let _ = writeln!(out);

    // 5. Bottleneck.
    let _ = writeln!(out, "5. What will stop perfect scaling");
    let ranked = losses(best);
    let useful = t.compute_s;
    let _ = writeln!(
        out,
        "   Useful forward/backward compute is {:.1}% of the step. Losses: {}.",
        pct(useful, step),
        ranked
            .iter()
            .filter(|(_, s)| *s > 0.0)
            .map(|(loss, s)| format!("{} {:.1}%", loss.name(), pct(*s, step)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let per_gpu: Vec<String> = ranked
        .iter()
        .filter(|(loss, s)| !loss.grows_with_gpus() && *s > 0.0)
        .map(|(loss, s)| format!("{} {:.1}%", loss.name(), pct(*s, step)))
        .collect();
    if !per_gpu.is_empty() {
        let _ = writeln!(
            out,
            "   Per-GPU costs, which one GPU alone would pay too and which do not limit scaling: {}.",
            per_gpu.join(", ")
        );
    }
    let efficiency = scaling_efficiency(best);
    let spread: Vec<String> = scaling_losses(best)
        .iter()
        .filter(|(_, s)| *s > 0.0)
        .map(|(loss, s)| format!("{} {:.3} s ({:.1}%)", loss.label(l), s, pct(*s, step)))
        .collect();
    let _ = writeln!(
        out,
        "   Costs of spreading the work over {} GPUs: {}. Without them (every GPU busy with its own share) a step would take {:.3} s; the predicted {:.3} s is {:.1}% of perfect scaling.",
        c.gpus,
        if spread.is_empty() {
            "none exposed".to_string()
        } else {
            spread.join(", ")
        },
        step * efficiency,
        step,
        100.0 * efficiency
    );
    if l.gradient_group() > 1 && t.dp_hidden_s > 0.0 {
        let busy = t.dp_exposed_s + t.dp_hidden_s;
        let _ = writeln!(
            out,
            "   The data-parallel traffic ({}) costs {:.3} s per step ({:.1}% of the step), {:.3} s of it hidden under compute: it grows with the number of replicas{}.",
            if best.links.dp_crosses_nodes { "between nodes" } else { "inside a node" },
            busy,
            pct(busy, step),
            t.dp_hidden_s,
            if l.zero >= 3 {
                ", and with ZeRO-3 it is paid again every micro-batch"
            } else {
                ""
            }
        );
    }
    let executed_share = best.throughput.tflops_per_gpu * 1e12 / problem.mfu_peak();
    if best.throughput.mfu > executed_share {
        let _ = writeln!(
            out,
            "   MFU counts the full s² attention (the published convention); the causal memory-efficient kernel skips its masked half, so MFU exceeds the {:.1}% of peak the GPUs execute.",
            100.0 * executed_share
        );
    }
    if let Some((loss, secs)) = scaling_bottleneck(best) {
        let size = if secs > 0.0 {
            format!("{:.1}% of the step exposed", pct(secs, step))
        } else {
            format!(
                "hidden under compute today, {:.1}% of the step on the link",
                pct(t.dp_hidden_s, step)
            )
        };
        let _ = writeln!(
            out,
            "   Most likely bottleneck for scaling: {} ({size}). First mitigation: {}.",
            loss.label(l),
            loss.mitigation(l)
        );
        // The first mitigation, predicted; when it does not pay, the next scaling losses'
        // mitigations in turn (at most three), so the memo ends with one that gains if any.
        let mut candidates = vec![loss];
        candidates.extend(
            scaling_losses(best)
                .into_iter()
                .filter(|(other, s)| *other != loss && *s > 0.0)
                .map(|(other, _)| other)
                .take(2),
        );
        for (i, candidate) in candidates.iter().enumerate() {
            let lead = if i == 0 {
                "Predicted by the same model: applying it,".to_string()
            } else {
                format!(
                    "   Next, against {} ({}):",
                    candidate.label(l),
                    candidate.mitigation(l)
                )
            };
            let Some(m) = best_mitigation(problem, best, *candidate) else {
                let _ = writeln!(
                    out,
                    "   {} no layout on these GPUs that applies it can run and fit.",
                    lead.trim_start()
                );
                continue;
            };
            let change = pct(m.time.step_s - step, step);
            let verdict = if change < 0.0 {
                format!("{:.1}% faster", -change)
            } else {
                format!(
                    "{change:.1}% slower: {} there",
                    losses(&m)
                        .iter()
                        .filter(|(_, s)| *s > 0.0)
                        .take(2)
                        .map(|(loss, s)| format!(
                            "{} {:.1}%",
                            loss.label(&m.layout),
                            pct(*s, m.time.step_s)
                        ))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            let _ = writeln!(
                out,
                "   {} {} would take {:.3} s per step ({verdict}), {:.1}% of perfect scaling, {:.1} GiB per GPU.",
                lead.trim_start(),
                m.layout,
                m.time.step_s,
                100.0 * scaling_efficiency(&m),
                gib(m.memory.total())
            );
            if change < 0.0 {
                break;
            }
        }
    } else {
        let _ = writeln!(
            out,
            "   Nothing grows with the GPU count here: the step is all per-GPU work."
        );
    }
    let memory_bound = best.time.compute_s > 0.0;
    if memory_bound
        && best.throughput.mfu < 0.3
        && ranked.first().is_none_or(|(_, s)| *s < 0.1 * step)
    {
        let _ = writeln!(out, "   Communication is small here; the low MFU comes from small matrix multiplies and per-op overhead: grow the micro-batch.");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;
    use crate::search::search_feasible;

    #[test]
    fn memo_covers_the_five_questions() {
        let cluster = presets::cluster("h100").unwrap().with_gpus(32).unwrap();
        let problem = Problem::new(
            presets::model("llama-70b").unwrap(),
            cluster,
            TrainingSetup::new(256, Precision::Bf16),
        )
        .unwrap();
        let result = search_feasible(&problem).unwrap();
        // With GQA's small K/V blocks two context-parallel ranks cost almost nothing, halve
        // the activations and keep all 256 micro-batches in one pipeline (half the bubble of
        // dp = 2): the best layout uses cp. The five questions are checked on the best layout
        // with data parallelism.
        let best = result.best().unwrap();
        assert!(best.layout.cp > 1, "{}", best.layout);
        let text = memo(&problem, best);
        let run = format!(
            "run it: meshtrain train --config <your config for llama-70b> --layout \"{}\"",
            best.layout
        );
        assert!(text.contains(&run), "missing `{run}` in:\n{text}");
        for needle in [
            "--set parallel.cp_mode=\"ring\"",
            "context parallelism (ring) splits every sequence over 2 GPUs",
            "Context parallelism over 2 GPUs inside a node, ring attention",
            "The planner picked ring for this layout: ulysses would",
        ] {
            assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
        }
        let replicated = result.ranked.iter().find(|e| e.layout.dp > 1).unwrap();
        let text = memo(&problem, replicated);
        for needle in [
            "run it: meshtrain train --config <your config for llama-70b> --layout \"dp=",
            "does not fit in 80 GiB",
            "Per GPU: weights",
            "What stays in fp32: the master weights",
            "Most likely bottleneck",
            "First mitigation",
            "micro-batch",
            "of perfect scaling",
        ] {
            assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
        }
    }

    /// The run line of a built-in model pastes as it is: its config exists in the
    /// repository; a recompute-free layout's rescoring is not called activation
    /// recomputation.
    #[test]
    fn the_run_line_names_a_config_that_exists() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for model in ["gpt", "lenet", "resnet18"] {
            let cluster = presets::cluster("cpu").unwrap().with_gpus(2).unwrap();
            let problem = Problem::new(
                presets::model(model).unwrap(),
                cluster,
                TrainingSetup::new(32, Precision::Fp32),
            )
            .unwrap();
            let layout = Layout::parse("dp=2,mb=16").unwrap();
            let command = train_command(&problem, &layout);
            let config = command
                .split_whitespace()
                .skip_while(|w| *w != "--config")
                .nth(1)
                .unwrap_or_else(|| panic!("no --config in {command}"));
            assert!(root.join(config).is_file(), "{command}");
        }
        let none = Layout::parse("dp=2,mb=16").unwrap();
        assert!(!Loss::Recomputation
            .label(&none)
            .contains("activation recomputation"));
        let full = Layout::parse("dp=2,mb=16,recompute=full").unwrap();
        assert_eq!(Loss::Recomputation.label(&full), "activation recomputation");
    }

    #[test]
    fn losses_are_sorted() {
        let cluster = presets::cluster("a100").unwrap().with_gpus(64).unwrap();
        let problem = Problem::new(
            presets::model("gpt-39b").unwrap(),
            cluster,
            TrainingSetup::new(512, Precision::Bf16),
        )
        .unwrap();
        let e = problem
            .evaluate(&Layout::parse("dp=2,tp=8,pp=4,mb=1,recompute=full").unwrap())
            .unwrap();
        let l = losses(&e);
        assert!(l.windows(2).all(|w| w[0].1 >= w[1].1));
        // 4 stages, 256 micro-batches: bubble = 3 micro-batch times; recompute is a third of
        // the forward+backward.
        assert!(e.time.bubble_s > 0.0 && e.time.recompute_s > 0.0);
    }
}
