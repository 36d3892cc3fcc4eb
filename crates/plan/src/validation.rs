//! Published training runs the cost model is checked against. The figures are data from the
//! papers; nothing in the cost model is fitted to them.

use serde::Serialize;

use crate::cluster::Precision;
use crate::cost::{Evaluation, Problem};
use crate::error::Result;
use crate::layout::{
    AttentionKind, CpMode, ElementwiseKernels, GradReduce, Layout, Optimizer, Recompute, Schedule,
    TrainingSetup,
};
use crate::model::{Architecture, ModelSpec, TransformerSpec};
use crate::presets;

/// One row of Table 1 of Narayanan et al. 2021, "Efficient Large-Scale Language Model
/// Training on GPU Clusters Using Megatron-LM" (arXiv 2104.04473): GPT models with vocabulary
/// 51200 and sequence length 2048 on DGX A100 80GB nodes (Selene), fp16, full activation
/// recomputation, TFLOP/s counted with recomputation (their eq. 3). The micro-batch size,
/// the interleaving and the data-parallel implementation are not printed in the table; they
/// are those of the paper's artifact, `examples/sc21/run_table_1.sh` in NVIDIA/Megatron-LM
/// (`MBS`, `--num-layers-per-virtual-pipeline-stage`, `DDP`).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct NarayananRow {
    pub preset: &'static str,
    pub billions: f64,
    pub heads: u64,
    pub hidden: u64,
    pub layers: u64,
    pub tp: u64,
    pub pp: u64,
    pub gpus: u64,
    pub batch: u64,
    /// `MBS` of the artifact script.
    pub micro_batch: u64,
    /// Model chunks per pipeline stage: layers / (pp · layers per virtual stage).
    pub interleave: u64,
    /// `DDP=torch` (PyTorch DDP, which all-reduces gradient buckets while the backward pass
    /// runs) rather than `DDP=local` (Megatron's own, which all-reduces after it).
    pub torch_ddp: bool,
    pub published_tflops_per_gpu: f64,
}

// One positional argument per column keeps the table below readable as the paper prints it.
#[allow(clippy::too_many_arguments)]
const fn row(
    preset: &'static str,
    billions: f64,
    heads: u64,
    hidden: u64,
    layers: u64,
    tp: u64,
    pp: u64,
    gpus: u64,
    batch: u64,
    micro_batch: u64,
    interleave: u64,
    torch_ddp: bool,
    published_tflops_per_gpu: f64,
) -> NarayananRow {
    NarayananRow {
        preset,
        billions,
        heads,
        hidden,
        layers,
        tp,
        pp,
        gpus,
        batch,
        micro_batch,
        interleave,
        torch_ddp,
        published_tflops_per_gpu,
    }
}

/// Table 1 of Narayanan et al. 2021: preset, billions, heads, hidden, layers, t, p, GPUs,
/// batch, micro-batch, interleaving, torch DDP, TFLOP/s per GPU.
#[rustfmt::skip]
pub const NARAYANAN_TABLE1: [NarayananRow; 10] = [
    row("gpt-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, true, 137.0),
    row("gpt-3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, true, 138.0),
    row("gpt-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, true, 142.0),
    row("gpt-18b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, true, 135.0),
    row("gpt-39b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, false, 138.0),
    row("gpt-76b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, false, 140.0),
    row("gpt-146b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, false, 148.0),
    row("gpt-310b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, false, 155.0),
    row("gpt-530b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, false, 163.0),
    row("gpt-1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, false, 163.0),
];

/// The software of 2021 Megatron-LM as the paper describes it: fp16 with fp32 master weights,
/// Adam, gradients reduced after the backward pass (no overlap), no distributed optimizer,
/// no sequence parallelism, full recomputation, attention that materialises the scores.
pub fn narayanan_setup(batch: u64) -> TrainingSetup {
    TrainingSetup {
        global_batch: batch,
        precision: Precision::Fp16,
        optimizer: Optimizer::Adam,
        overlap_grad_reduce: false,
        fp32_gradients: false,
        attention: AttentionKind::Standard,
        cp_mode: None,
        elementwise: ElementwiseKernels::Fused,
        grad_reduce: GradReduce::Flat,
    }
}

/// The published layout of a row: the artifact's micro-batch size and interleaving.
pub fn narayanan_layout(row: &NarayananRow) -> Layout {
    Layout {
        dp: row.gpus / (row.tp * row.pp),
        tp: row.tp,
        pp: row.pp,
        cp: 1,
        cp_mode: CpMode::Ring,
        sp: false,
        zero: 0,
        micro_batch: row.micro_batch,
        recompute: Recompute::Full,
        interleave: row.interleave,
        schedule: Schedule::OneFOneB,
    }
}

/// Prediction for one row with its published layout (see [`narayanan_layout`]).
#[derive(Debug, Clone, Serialize)]
pub struct NarayananPrediction {
    pub row: NarayananRow,
    pub evaluation: Evaluation,
    pub error_percent: f64,
}

/// Predicts a row with its published layout and setup.
pub fn predict_narayanan(row: &NarayananRow) -> Result<NarayananPrediction> {
    predict_narayanan_with(row, &narayanan_layout(row))
}

/// Predicts a row with another layout of the same GPUs (e.g. to show what the micro-batch
/// size or interleaving changes).
pub fn predict_narayanan_with(row: &NarayananRow, layout: &Layout) -> Result<NarayananPrediction> {
    let model = presets::model(row.preset)?;
    let cluster = presets::cluster("a100-80gb")?.with_gpus(row.gpus)?;
    let setup = TrainingSetup {
        overlap_grad_reduce: row.torch_ddp,
        ..narayanan_setup(row.batch)
    };
    let problem = Problem::new(model, cluster, setup)?;
    let evaluation = problem.evaluate(layout)?;
    let predicted = evaluation.throughput.tflops_per_gpu;
    Ok(NarayananPrediction {
        row: *row,
        error_percent: 100.0 * (predicted - row.published_tflops_per_gpu)
            / row.published_tflops_per_gpu,
        evaluation,
    })
}

/// A run from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
/// Transformer Models", arXiv 2205.05198): A100 80GB, bf16, sequence 2048, vocabulary 51200.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct KorthikantiRun {
    pub label: &'static str,
    pub heads: u64,
    pub hidden: u64,
    pub layers: u64,
    pub tp: u64,
    pub pp: u64,
    pub gpus: u64,
    /// Not stated next to the figure; we assume one sequence per GPU (batch = GPUs), as in
    /// the paper's configuration table and Table 1 of Narayanan et al. for the 530B model.
    pub batch: u64,
    /// Sequence parallelism + selective recomputation (true) or full recomputation (false).
    pub selective: bool,
    pub published_mfu_percent: f64,
}

/// The abstract's headline: 530B on 2240 A100s reaches 54.2% MFU with sequence parallelism
/// and selective recomputation, 42.1% with full recomputation.
pub const KORTHIKANTI_530B: [KorthikantiRun; 2] = [
    KorthikantiRun {
        label: "530B, 2240 GPUs, sp + selective",
        heads: 128,
        hidden: 20480,
        layers: 105,
        tp: 8,
        pp: 35,
        gpus: 2240,
        batch: 2240,
        selective: true,
        published_mfu_percent: 54.2,
    },
    KorthikantiRun {
        label: "530B, 2240 GPUs, full recompute",
        heads: 128,
        hidden: 20480,
        layers: 105,
        tp: 8,
        pp: 35,
        gpus: 2240,
        batch: 2240,
        selective: false,
        published_mfu_percent: 42.1,
    },
];

/// The GPT of the Megatron-LM papers (Narayanan et al. 2021, Korthikanti et al. 2022):
/// `layers` pre-LN blocks of width `hidden` with a 4·hidden MLP, vocabulary 51200, sequence
/// 2048, the head tied to the embedding.
pub fn megatron_gpt(name: &str, layers: u64, hidden: u64, heads: u64) -> ModelSpec {
    ModelSpec {
        name: name.to_string(),
        architecture: Architecture::Transformer(TransformerSpec {
            layers,
            hidden,
            heads,
            kv_heads: None,
            ffn_hidden: 4 * hidden,
            gated_mlp: false,
            vocab: 51200,
            seq_len: 2048,
            tied_embeddings: true,
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        }),
    }
}

/// Predicted MFU (percent) for a Korthikanti et al. run: micro-batch 1 and, as the paper does
/// not print its schedule, the interleaving the same team ran the same 530B model with in
/// Table 1 of Narayanan et al. (three model chunks per stage, `run_table_1.sh`).
pub fn predict_korthikanti(run: &KorthikantiRun) -> Result<Evaluation> {
    let model = megatron_gpt(run.label, run.layers, run.hidden, run.heads);
    let cluster = presets::cluster("a100-80gb")?.with_gpus(run.gpus)?;
    let setup = TrainingSetup {
        precision: Precision::Bf16,
        ..narayanan_setup(run.batch)
    };
    let problem = Problem::new(model, cluster, setup)?;
    problem.evaluate(&Layout {
        dp: run.gpus / (run.tp * run.pp),
        tp: run.tp,
        pp: run.pp,
        cp: 1,
        cp_mode: CpMode::Ring,
        sp: run.selective,
        zero: 0,
        micro_batch: 1,
        recompute: if run.selective {
            Recompute::Selective
        } else {
            Recompute::Full
        },
        interleave: 3,
        schedule: Schedule::OneFOneB,
    })
}

/// A published training run with its model, hardware, layout and measured throughput, for
/// side-by-side comparison (docs/planner.md, "Further published runs"). Nothing in the cost
/// model is fitted to them.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PublishedRun {
    pub label: &'static str,
    /// Where the numbers are printed.
    pub source: &'static str,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub ffn_hidden: u64,
    pub gated_mlp: bool,
    pub vocab: u64,
    pub seq_len: u64,
    /// Cluster preset (the run's GPU and, where the source does not say, a typical node).
    pub cluster: &'static str,
    pub gpus: u64,
    pub global_batch: u64,
    /// Layout in `meshtrain plan` syntax.
    pub layout: &'static str,
    pub attention: AttentionKind,
    /// Tokens per second per GPU as published.
    pub published_tokens_per_gpu: f64,
}

/// torchtitan's published FSDP2 (ZeRO-3) runs on 64 A100 80GB GPUs, bf16, memory-efficient
/// attention (PyTorch SDPA), AdamW, local batch 1 or 2: `docs/performance.md` of
/// github.com/pytorch/torchtitan (Liang et al., "TorchTitan", arXiv 2410.06511). The source
/// does not describe the network; the A100 preset's (one 200 Gb/s card per GPU, as on DGX
/// A100) is assumed. "Selective op" activation checkpointing saves the matmul outputs and
/// recomputes the rest, which the planner's selective recomputation approximates.
pub const PUBLISHED_RUNS: [PublishedRun; 4] = [
    PublishedRun {
        label: "Llama 3 8B, 64 A100, FSDP, selective op AC, seq 8192",
        source: "github.com/pytorch/torchtitan docs/performance.md (Llama 3 table)",
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        ffn_hidden: 14336,
        gated_mlp: true,
        vocab: 128256,
        seq_len: 8192,
        cluster: "a100-80gb",
        gpus: 64,
        global_batch: 64,
        layout: "dp=64,zero=3,mb=1,recompute=selective",
        attention: AttentionKind::Flash,
        published_tokens_per_gpu: 2973.0,
    },
    PublishedRun {
        label: "Llama 3 70B, 64 A100, FSDP, full AC, seq 8192",
        source: "github.com/pytorch/torchtitan docs/performance.md (Llama 3 table)",
        layers: 80,
        hidden: 8192,
        heads: 64,
        kv_heads: 8,
        ffn_hidden: 28672,
        gated_mlp: true,
        vocab: 128256,
        seq_len: 8192,
        cluster: "a100-80gb",
        gpus: 64,
        global_batch: 64,
        layout: "dp=64,zero=3,mb=1,recompute=full",
        attention: AttentionKind::Flash,
        published_tokens_per_gpu: 331.0,
    },
    PublishedRun {
        label: "Llama 2 13B, 64 A100, FSDP, no AC, local batch 2, seq 4096",
        source: "github.com/pytorch/torchtitan docs/performance.md (Llama 2 table)",
        layers: 40,
        hidden: 5120,
        heads: 40,
        kv_heads: 40,
        ffn_hidden: 13824,
        gated_mlp: true,
        vocab: 32000,
        seq_len: 4096,
        cluster: "a100-80gb",
        gpus: 64,
        global_batch: 128,
        layout: "dp=64,zero=3,mb=2,recompute=none",
        attention: AttentionKind::Flash,
        published_tokens_per_gpu: 2162.0,
    },
    PublishedRun {
        label: "Llama 2 70B, 64 A100, FSDP, full AC, local batch 2, seq 4096",
        source: "github.com/pytorch/torchtitan docs/performance.md (Llama 2 table)",
        layers: 80,
        hidden: 8192,
        heads: 64,
        kv_heads: 8,
        ffn_hidden: 28672,
        gated_mlp: true,
        vocab: 32000,
        seq_len: 4096,
        cluster: "a100-80gb",
        gpus: 64,
        global_batch: 128,
        layout: "dp=64,zero=3,mb=2,recompute=full",
        attention: AttentionKind::Flash,
        published_tokens_per_gpu: 353.0,
    },
];

/// Prediction for a published run: bf16, AdamW, eager element-wise kernels (the published
/// tables were measured without `torch.compile`), gradients reduced while backward runs, in
/// fp32 (torchtitan's default `training.mixed_precision_reduce = "float32"`: FSDP2 casts the
/// gradients up before the reduce-scatter, 4 bytes per parameter on the wire).
pub fn predict_published(run: &PublishedRun) -> Result<Evaluation> {
    let model = ModelSpec {
        name: run.label.to_string(),
        architecture: Architecture::Transformer(TransformerSpec {
            layers: run.layers,
            hidden: run.hidden,
            heads: run.heads,
            kv_heads: Some(run.kv_heads),
            ffn_hidden: run.ffn_hidden,
            gated_mlp: run.gated_mlp,
            vocab: run.vocab,
            seq_len: run.seq_len,
            tied_embeddings: false,
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        }),
    };
    let cluster = presets::cluster(run.cluster)?.with_gpus(run.gpus)?;
    let setup = TrainingSetup {
        attention: run.attention,
        fp32_gradients: true,
        elementwise: ElementwiseKernels::Eager,
        ..TrainingSetup::new(run.global_batch, Precision::Bf16)
    };
    let problem = Problem::new(model, cluster, setup)?;
    problem.evaluate(&Layout::parse(run.layout)?)
}
