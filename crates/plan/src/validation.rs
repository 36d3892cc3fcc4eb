//! Published training runs the cost model is checked against. The figures are data from the
//! papers; nothing in the cost model is fitted to them.

use serde::Serialize;

use crate::cluster::Precision;
use crate::cost::{Evaluation, Problem};
use crate::error::Result;
use crate::layout::{AttentionKind, CpMode, Layout, Optimizer, Recompute, Schedule, TrainingSetup};
use crate::model::{Architecture, ModelSpec, TransformerSpec};
use crate::presets;

/// One row of Table 1 of Narayanan et al. 2021, "Efficient Large-Scale Language Model
/// Training on GPU Clusters Using Megatron-LM" (arXiv 2104.04473): GPT models with vocabulary
/// 51200 and sequence length 2048 on DGX A100 80GB nodes (Selene), fp16, full activation
/// recomputation, TFLOP/s counted with recomputation (their eq. 3).
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
        published_tflops_per_gpu,
    }
}

/// Table 1 of Narayanan et al. 2021.
pub const NARAYANAN_TABLE1: [NarayananRow; 10] = [
    row("gpt-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137.0),
    row("gpt-3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138.0),
    row("gpt-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142.0),
    row("gpt-18b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135.0),
    row("gpt-39b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138.0),
    row("gpt-76b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140.0),
    row("gpt-146b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
    row("gpt-310b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155.0),
    row("gpt-530b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163.0),
    row("gpt-1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
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
    }
}

/// The published layout of a row with a given micro-batch size.
pub fn narayanan_layout(row: &NarayananRow, micro_batch: u64) -> Layout {
    Layout {
        dp: row.gpus / (row.tp * row.pp),
        tp: row.tp,
        pp: row.pp,
        cp: 1,
        cp_mode: CpMode::Ring,
        sp: false,
        zero: 0,
        micro_batch,
        recompute: Recompute::Full,
        interleave: 1,
        schedule: Schedule::OneFOneB,
    }
}

/// Prediction for one row: the published (t, p, d, batch), full recomputation, 1F1B without
/// interleaving, micro-batch size 1 (the size the paper's own analysis uses for its largest
/// models; Table 1 does not list it).
#[derive(Debug, Clone, Serialize)]
pub struct NarayananPrediction {
    pub row: NarayananRow,
    pub evaluation: Evaluation,
    pub error_percent: f64,
}

pub fn predict_narayanan(row: &NarayananRow, micro_batch: u64) -> Result<NarayananPrediction> {
    let model = presets::model(row.preset)?;
    let cluster = presets::cluster("a100-80gb")?.with_gpus(row.gpus)?;
    let problem = Problem::new(model, cluster, narayanan_setup(row.batch))?;
    let evaluation = problem.evaluate(&narayanan_layout(row, micro_batch))?;
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

/// Predicted MFU (percent) for a Korthikanti et al. run, micro-batch 1, no interleaving.
pub fn predict_korthikanti(run: &KorthikantiRun) -> Result<Evaluation> {
    let model = ModelSpec {
        name: run.label.to_string(),
        architecture: Architecture::Transformer(TransformerSpec {
            layers: run.layers,
            hidden: run.hidden,
            heads: run.heads,
            kv_heads: None,
            ffn_hidden: 4 * run.hidden,
            gated_mlp: false,
            vocab: 51200,
            seq_len: 2048,
            tied_embeddings: true,
        }),
    };
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
        interleave: 1,
        schedule: Schedule::OneFOneB,
    })
}
