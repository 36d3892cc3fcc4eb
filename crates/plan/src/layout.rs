//! The training setup (what the user wants to train) and a parallel layout (how to split it).
//! Both are plain data so the planner can enumerate, compare and print them.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::cluster::Precision;
use crate::error::{PlanError, Result};

/// Optimizer, which fixes the bytes of optimizer state per parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// Adam/AdamW: two moments.
    Adam,
    /// SGD with momentum: one buffer.
    Sgd,
}

/// What is trained, independent of how it is split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingSetup {
    /// Sequences (or samples) per optimizer step, over all data-parallel replicas.
    pub global_batch: u64,
    pub precision: Precision,
    pub optimizer: Optimizer,
    /// Whether the data-parallel gradient reduction may start during the backward pass of
    /// the last micro-batch (PyTorch DDP, Megatron-Core `overlap_grad_reduce`). Megatron-LM as
    /// used by Narayanan et al. 2021 reduced after the backward pass.
    pub overlap_grad_reduce: bool,
    /// Accumulate and reduce gradients in fp32 (Megatron `--accumulate-allreduce-grads-in-fp32`)
    /// instead of the compute precision.
    pub fp32_gradients: bool,
    /// The attention kernel the trainer runs (`model.attention`): it decides whether a layer
    /// keeps the a·s² probabilities for backward or recomputes them.
    pub attention: AttentionKind,
    /// The trainer's `parallel.cp_mode` when the user fixed it; `None` lets the planner try
    /// both modes for every layout with cp > 1 and report the better one.
    pub cp_mode: Option<CpMode>,
    /// How the layers' element-wise work runs: fused kernels (Megatron, compiled graphs) or
    /// one kernel per operation (PyTorch eager).
    pub elementwise: ElementwiseKernels,
    /// How the data-parallel all-reduce crosses nodes (the trainer's `parallel.grad_reduce`).
    pub grad_reduce: GradReduce,
}

/// How the data-parallel gradient all-reduce (ZeRO-0) is organised when its group spans nodes:
/// the planner's input and the trainer's `parallel.grad_reduce` (one type for both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradReduce {
    /// The trainer's default rule: hierarchical when the group spans nodes with more than one
    /// of its ranks on each (and every node the same number), flat otherwise (and always flat
    /// under ZeRO, and over NCCL, whose rings and trees follow the nodes themselves).
    #[default]
    Auto,
    /// One ring over all ranks (NCCL's rings, one per network card; MPI_Allreduce).
    Flat,
    /// Reduce-scatter inside each node, all-reduce of the shards across nodes, all-gather
    /// inside the node (`meshtrain`'s hierarchical DDP).
    Hierarchical,
}

impl GradReduce {
    /// `auto`, `flat` or `hierarchical`.
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        match value.to_ascii_lowercase().as_str() {
            "auto" => Ok(GradReduce::Auto),
            "flat" => Ok(GradReduce::Flat),
            "hierarchical" => Ok(GradReduce::Hierarchical),
            _ => Err(format!(
                "gradient reduction `{value}`: auto, flat or hierarchical"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GradReduce::Auto => "auto",
            GradReduce::Flat => "flat",
            GradReduce::Hierarchical => "hierarchical",
        }
    }
}

/// How a framework runs a layer's element-wise work (norms, activations, rotary embeddings,
/// residual adds). It decides the memory traffic, which for small hidden sizes and long
/// sequences is a large share of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ElementwiseKernels {
    /// Fused kernels that read each stored activation once and write it once (Megatron-LM's
    /// fused layer norm, bias-GELU, bias-dropout-add and softmax; `torch.compile`).
    Fused,
    /// One kernel per PyTorch operation, with norms and rotary embeddings computed in fp32
    /// (torchtitan's published runs without `torch.compile`).
    Eager,
}

impl ElementwiseKernels {
    /// `fused` or `eager`.
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        match value.to_ascii_lowercase().as_str() {
            "fused" | "compiled" => Ok(ElementwiseKernels::Fused),
            "eager" => Ok(ElementwiseKernels::Eager),
            _ => Err(format!("element-wise kernels `{value}`: fused or eager")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ElementwiseKernels::Fused => "fused",
            ElementwiseKernels::Eager => "eager",
        }
    }
}

impl TrainingSetup {
    /// Adam, overlapped gradient reduction, the standard attention kernel (the trainer's
    /// default `model.attention`, so library callers that model a default training run, such
    /// as `meshtrain bench calibrate`, keep their numbers; `meshtrain plan` defaults to flash),
    /// and the cp mode left to the planner.
    pub fn new(global_batch: u64, precision: Precision) -> Self {
        TrainingSetup {
            global_batch,
            precision,
            optimizer: Optimizer::Adam,
            overlap_grad_reduce: true,
            fp32_gradients: false,
            attention: AttentionKind::Standard,
            cp_mode: None,
            elementwise: ElementwiseKernels::Fused,
            grad_reduce: GradReduce::Flat,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.global_batch == 0 {
            return Err(PlanError::InvalidSetup(
                "global batch must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// Bytes per parameter of weights, gradients and optimizer state (the ZeRO paper's 2, 2
    /// and K for mixed-precision Adam, K = 12: fp32 master copy, momentum and variance).
    pub fn bytes_per_param(&self) -> ParamBytes {
        let weights = self.precision.compute_bytes();
        let gradients = if self.fp32_gradients { 4.0 } else { weights };
        // Mixed precision keeps an fp32 master copy in the optimizer state; fp32 training
        // updates the weights themselves.
        let master = if self.precision.is_mixed() { 4.0 } else { 0.0 };
        let moments = match self.optimizer {
            Optimizer::Adam => 8.0,
            Optimizer::Sgd => 4.0,
        };
        ParamBytes {
            weights,
            gradients,
            optimizer: master + moments,
        }
    }
}

/// Bytes per parameter of each kind of model state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamBytes {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
}

/// Activation recomputation (Korthikanti et al. 2022).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Recompute only the attention core (softmax, dropout, scores·V): drops the 5as²b term.
    Selective,
    /// Keep only each layer's input; recompute the whole layer in backward.
    Full,
}

/// The attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// Materialises the scores and keeps the softmax output, dropout mask and dropout output
    /// (a·s² elements each) for backward, as Megatron did in 2021–22.
    Standard,
    /// Memory-efficient attention (FlashAttention, Dao et al. 2022): tiles with an online
    /// softmax keep only the output and each row's log-sum-exp, skip the tiles above the
    /// causal diagonal, and recompute the score tiles in backward.
    Flash,
}

impl AttentionKind {
    /// `standard` or `flash` (the trainer's `model.attention` values).
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        match value.to_ascii_lowercase().as_str() {
            "standard" => Ok(AttentionKind::Standard),
            "flash" => Ok(AttentionKind::Flash),
            _ => Err(format!("attention `{value}`: standard or flash")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Standard => "standard",
            AttentionKind::Flash => "flash",
        }
    }
}

/// How context parallelism exchanges what attention needs across the ranks that each hold a
/// slice of every sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpMode {
    /// Ring attention, load-balanced (rank i holds chunks i and 2cp−1−i): K/V blocks travel
    /// around the ring while the rank computes on the block it has, so only what a hop takes
    /// beyond that compute is exposed. Every block runs the memory-efficient kernel.
    Ring,
    /// DeepSpeed-Ulysses: all-to-alls turn sequence shards into head shards for attention and
    /// back; not overlapped. Needs heads/tp divisible by cp.
    Ulysses,
}

impl CpMode {
    /// `ring` or `ulysses` (the trainer's `parallel.cp_mode` values).
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        match value.to_ascii_lowercase().as_str() {
            "ring" => Ok(CpMode::Ring),
            "ulysses" => Ok(CpMode::Ulysses),
            _ => Err(format!("cp mode `{value}`: ring or ulysses")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CpMode::Ring => "ring",
            CpMode::Ulysses => "ulysses",
        }
    }
}

/// Pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Schedule {
    /// All forwards, then all backwards: m micro-batches of activations in flight.
    GPipe,
    /// One-forward-one-backward (PipeDream-Flush): at most p micro-batches in flight.
    #[serde(rename = "1F1B")]
    OneFOneB,
}

/// One way of laying a training run out over the cluster. Ranks are numbered with tensor
/// parallelism innermost, then context, then data, then pipeline (Megatron's order), so
/// tensor-parallel groups sit inside a node whenever `tp ≤ gpus_per_node` and context-parallel
/// groups whenever `tp·cp ≤ gpus_per_node`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
    /// Context parallelism: every sequence is split over `cp` ranks, which hold the same
    /// parameters and reduce their gradients together with the data-parallel ranks.
    pub cp: u64,
    /// How the cp ranks exchange attention inputs; meaningless when cp = 1. Not part of the
    /// layout string: the trainer takes it as `parallel.cp_mode` (the memo's run line says so).
    pub cp_mode: CpMode,
    /// Sequence parallelism in the tensor-parallel regions (Korthikanti et al. 2022).
    pub sp: bool,
    /// ZeRO stage 0–3 over the gradient group (the dp·cp ranks, see [`Layout::gradient_group`]).
    pub zero: u8,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    pub recompute: Recompute,
    /// Model chunks per pipeline device (interleaved 1F1B when > 1).
    pub interleave: u64,
    pub schedule: Schedule,
}

impl Layout {
    /// A plain data-parallel layout.
    pub fn data_parallel(dp: u64, micro_batch: u64) -> Self {
        Layout {
            dp,
            tp: 1,
            pp: 1,
            cp: 1,
            cp_mode: CpMode::Ring,
            sp: false,
            zero: 0,
            micro_batch,
            recompute: Recompute::None,
            interleave: 1,
            schedule: Schedule::OneFOneB,
        }
    }

    pub fn gpus(&self) -> u64 {
        self.dp * self.tp * self.pp * self.cp
    }

    /// Ranks that hold the same parameters and reduce their gradients together (Megatron's
    /// dp-cp group): context-parallel ranks see different tokens of the same samples, so their
    /// gradients are partial sums just like those of data-parallel replicas. ZeRO shards over
    /// this group too, since its reduce-scatter leaves each member a 1/(dp·cp) slice.
    pub fn gradient_group(&self) -> u64 {
        self.dp * self.cp
    }

    /// Parses `dp=4,tp=8,pp=1,cp=2,mb=1,zero=1,sp=on,recompute=full,v=2,schedule=1f1b`, or
    /// the form this type prints (`dp=4 tp=8 pp=2 cp=2 sp zero=1 mb=2 recompute=selective
    /// 1f1b-interleaved(v=3)`), see [`layout_terms`]; omitted keys take the defaults of
    /// [`Layout::data_parallel`] with dp=1, mb=1. The cp mode is not a key (the trainer reads
    /// it from `parallel.cp_mode`), so it starts as ring.
    pub fn parse(text: &str) -> Result<Self> {
        let mut layout = Layout::data_parallel(1, 1);
        let bad = |reason: String| PlanError::InvalidLayout {
            layout: text.to_string(),
            reason,
        };
        for (key, value) in layout_terms(text).map_err(bad)? {
            let number = || {
                value
                    .parse::<u64>()
                    .map_err(|_| bad(format!("`{key}` needs a whole number, got `{value}`")))
            };
            match key.as_str() {
                "dp" => layout.dp = number()?,
                "tp" => layout.tp = number()?,
                "pp" => layout.pp = number()?,
                "cp" => layout.cp = number()?,
                "mb" | "micro_batch" => layout.micro_batch = number()?,
                "v" | "interleave" => layout.interleave = number()?,
                "zero" => {
                    layout.zero =
                        u8::try_from(number()?).map_err(|_| bad("zero must be 0..3".into()))?
                }
                "sp" => layout.sp = parse_flag(&value).map_err(bad)?,
                "recompute" => layout.recompute = Recompute::parse(&value).map_err(bad)?,
                "schedule" => {
                    layout.schedule = match value.as_str() {
                        "1f1b" => Schedule::OneFOneB,
                        "gpipe" => Schedule::GPipe,
                        _ => return Err(bad(format!("schedule `{value}`: 1f1b or gpipe"))),
                    }
                }
                // Accepted (a training run prints them) but not planned yet.
                "precision" | "m" | "micro_batches" => {}
                other => return Err(bad(format!("unknown key `{other}`"))),
            }
        }
        Ok(layout)
    }
}

impl Recompute {
    /// `none` (or `off`), `selective` or `full`.
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        match value {
            "none" | "off" => Ok(Recompute::None),
            "selective" => Ok(Recompute::Selective),
            "full" => Ok(Recompute::Full),
            _ => Err(format!("recompute `{value}`: none, selective or full")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

/// `on`/`off` style values (`1`, `true`, `yes`; `0`, `false`, `no`).
pub fn parse_flag(value: &str) -> std::result::Result<bool, String> {
    match value {
        "1" | "on" | "true" | "yes" => Ok(true),
        "0" | "off" | "false" | "no" => Ok(false),
        _ => Err(format!("`{value}` is not on or off")),
    }
}

/// The grammar every layout string shares — the planner's `--layout`, what it prints, and
/// `meshtrain train --layout` — as (key, value) terms with lower-case keys. Terms are
/// separated by commas or spaces and are `key=value`, or one of the bare words the planner
/// prints: `sp` (sp=on), `gpipe` and `1f1b` (schedule=…), `interleaved`, `interleaved:V` and
/// `1f1b-interleaved(v=V)` (schedule=1f1b and v=V, V defaulting to 2). `schedule=interleaved:V`
/// is normalised the same way, so a consumer sees only `schedule` ∈ {gpipe, 1f1b} and `v`.
pub fn layout_terms(text: &str) -> std::result::Result<Vec<(String, String)>, String> {
    let mut terms = Vec::new();
    let interleaved =
        |spec: &str, terms: &mut Vec<(String, String)>| -> std::result::Result<(), String> {
            let v = match spec {
                "" => "2".to_string(),
                v => v.to_string(),
            };
            terms.push(("schedule".into(), "1f1b".into()));
            terms.push(("v".into(), v));
            Ok(())
        };
    for part in text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
    {
        let lower = part.to_ascii_lowercase();
        if let Some(v) = lower
            .strip_prefix("1f1b-interleaved(v=")
            .and_then(|r| r.strip_suffix(')'))
        {
            interleaved(v, &mut terms)?;
            continue;
        }
        match lower.split_once('=') {
            Some((key, value)) => {
                let (key, value) = (key.trim(), value.trim());
                if key == "schedule" {
                    if let Some(v) = value.strip_prefix("interleaved") {
                        interleaved(v.trim_start_matches(':'), &mut terms)?;
                        continue;
                    }
                }
                terms.push((key.to_string(), value.to_string()));
            }
            None => match lower.as_str() {
                "sp" => terms.push(("sp".into(), "on".into())),
                "gpipe" | "1f1b" => terms.push(("schedule".into(), lower.clone())),
                w if w.starts_with("interleaved") => {
                    interleaved(w["interleaved".len()..].trim_start_matches(':'), &mut terms)?
                }
                _ => return Err(format!("`{part}` is not key=value")),
            },
        }
    }
    Ok(terms)
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={} tp={} pp={}", self.dp, self.tp, self.pp)?;
        if self.cp > 1 {
            write!(f, " cp={}", self.cp)?;
        }
        write!(
            f,
            "{} zero={} mb={} recompute={}",
            if self.sp { " sp" } else { "" },
            self.zero,
            self.micro_batch,
            self.recompute.name()
        )?;
        if self.pp > 1 {
            match self.schedule {
                Schedule::GPipe => write!(f, " gpipe")?,
                Schedule::OneFOneB if self.interleave > 1 => {
                    write!(f, " 1f1b-interleaved(v={})", self.interleave)?
                }
                Schedule::OneFOneB => write!(f, " 1f1b")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trip() {
        let l = Layout::parse("dp=4, tp=8, pp=2, mb=2, zero=1, sp=on, recompute=selective, v=3")
            .unwrap();
        assert_eq!(
            (l.dp, l.tp, l.pp, l.micro_batch, l.zero, l.interleave),
            (4, 8, 2, 2, 1, 3)
        );
        assert!(l.sp);
        assert_eq!(l.recompute, Recompute::Selective);
        assert_eq!(l.gpus(), 64);
        assert_eq!(
            l.to_string(),
            "dp=4 tp=8 pp=2 sp zero=1 mb=2 recompute=selective 1f1b-interleaved(v=3)"
        );
        assert!(Layout::parse("dp=two")
            .unwrap_err()
            .to_string()
            .contains("whole number"));
        assert!(Layout::parse("foo=1")
            .unwrap_err()
            .to_string()
            .contains("unknown key"));
        // What the planner prints parses back to the same layout.
        assert_eq!(Layout::parse(&l.to_string()).unwrap(), l);
        let g = Layout::parse("dp=2 tp=1 pp=2 zero=0 mb=4 recompute=none gpipe").unwrap();
        assert_eq!((g.pp, g.schedule, g.interleave), (2, Schedule::GPipe, 1));
        assert_eq!(Layout::parse(&g.to_string()).unwrap(), g);
        let i = Layout::parse("pp=2,schedule=interleaved:3").unwrap();
        assert_eq!((i.schedule, i.interleave), (Schedule::OneFOneB, 3));
        assert!(Layout::parse("dp=2 bogus")
            .unwrap_err()
            .to_string()
            .contains("`bogus` is not key=value"));
    }

    #[test]
    fn context_parallel_layouts_parse_and_print() {
        let l = Layout::parse("dp=2,tp=2,cp=4,mb=1,zero=1").unwrap();
        assert_eq!(
            (l.cp, l.cp_mode, l.gpus(), l.gradient_group()),
            (4, CpMode::Ring, 16, 8)
        );
        assert_eq!(
            l.to_string(),
            "dp=2 tp=2 pp=1 cp=4 zero=1 mb=1 recompute=none"
        );
        assert_eq!(Layout::parse(&l.to_string()).unwrap(), l);
        // cp = 1 prints as before, so older layout strings and tools see no change.
        let plain = Layout::parse("dp=2,cp=1").unwrap();
        assert_eq!(
            plain.to_string(),
            "dp=2 tp=1 pp=1 zero=0 mb=1 recompute=none"
        );
        assert!(Layout::parse("cp=two")
            .unwrap_err()
            .to_string()
            .contains("`cp` needs a whole number"));
        assert_eq!(CpMode::parse("Ulysses"), Ok(CpMode::Ulysses));
        assert!(CpMode::parse("tree")
            .unwrap_err()
            .contains("ring or ulysses"));
        assert_eq!(AttentionKind::parse("flash"), Ok(AttentionKind::Flash));
        assert!(AttentionKind::parse("sparse")
            .unwrap_err()
            .contains("standard or flash"));
    }

    #[test]
    fn zero_paper_bytes_per_param() {
        // Rajbhandari et al. 2020, §3.1: mixed-precision Adam keeps 2 + 2 + K bytes, K = 12.
        let b = TrainingSetup::new(1, Precision::Fp16).bytes_per_param();
        assert_eq!((b.weights, b.gradients, b.optimizer), (2.0, 2.0, 12.0));
        let f = TrainingSetup::new(1, Precision::Fp32).bytes_per_param();
        assert_eq!((f.weights, f.gradients, f.optimizer), (4.0, 4.0, 8.0));
        let mut sgd = TrainingSetup::new(1, Precision::Bf16);
        sgd.optimizer = Optimizer::Sgd;
        assert_eq!(sgd.bytes_per_param().optimizer, 8.0);
    }
}
