//! Per-GPU memory: model states (ZeRO 0–3), activations (Korthikanti et al. 2022, with the
//! memory-efficient attention kernel and context parallelism) and communication buffers.

use serde::Serialize;

use crate::layout::{AttentionKind, Layout, ParamBytes, Recompute, Schedule};
use crate::model::TransformerSpec;

/// Model-state bytes per GPU for `params` parameters held by this GPU before ZeRO sharding,
/// following Rajbhandari et al. 2020 (ZeRO), §5: stage 1 shards optimizer states, stage 2
/// also gradients, stage 3 also the weights, each over the `group` ranks that reduce
/// gradients together (the data-parallel ranks, times cp with context parallelism).
pub fn model_state_bytes(params: f64, bytes: ParamBytes, zero: u8, group: u64) -> ModelStates {
    let d = group as f64;
    let shard = |sharded: bool| if sharded { 1.0 / d } else { 1.0 };
    ModelStates {
        weights: params * bytes.weights * shard(zero >= 3),
        gradients: params * bytes.gradients * shard(zero >= 2),
        optimizer: params * bytes.optimizer * shard(zero >= 1),
    }
}

/// Weights, gradients and optimizer state, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ModelStates {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
}

impl ModelStates {
    pub fn total(&self) -> f64 {
        self.weights + self.gradients + self.optimizer
    }
}

/// How one layer's tensors are cut over the GPUs that compute it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSplit {
    pub tp: u64,
    /// Sequence parallelism: the tensor-parallel ranks also split the layer-norm and dropout
    /// activations by sequence position.
    pub sp: bool,
    pub cp: u64,
}

impl LayerSplit {
    /// Tensor parallelism (and sp) only, as in Korthikanti et al.
    pub fn tensor(tp: u64, sp: bool) -> Self {
        LayerSplit { tp, sp, cp: 1 }
    }

    pub fn of(layout: &Layout) -> Self {
        LayerSplit {
            tp: layout.tp,
            sp: layout.sp,
            cp: layout.cp,
        }
    }
}

/// Activation bytes of one transformer layer for one micro-batch of `b` sequences on one GPU,
/// generalising Korthikanti et al. 2022 (Table 2) to any element size `e`, MLP width,
/// key/value width, attention kernel and context parallelism. With e = 2, f = 4h, multi-head
/// attention, the standard kernel and cp = 1 it reduces to their sbh(34 + 5as/h) without
/// parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh/t·(34 + 5as/h) with
/// tensor + sequence parallelism, the 5as/h term dropped by selective recomputation, and 2sbh
/// (2sbh/t with sp) of layer input under full recomputation. The flash kernel replaces the
/// 5as/h term by 4a/h (its f32 log-sum-exps), so memory grows linearly in s instead of
/// quadratically.
///
/// Context parallelism divides every term by cp: a rank keeps the per-token tensors of its
/// s/cp tokens, and its attention state is 1/cp of the whole (ring: its queries' rows;
/// Ulysses: a/cp of the heads over the full sequence, a·s²/cp probabilities with the standard
/// kernel).
pub fn layer_activation_bytes(
    model: &TransformerSpec,
    b: f64,
    e: f64,
    split: LayerSplit,
    recompute: Recompute,
    attention: AttentionKind,
) -> f64 {
    let parts = LayerActivations::new(model, b, e, attention);
    let t = split.tp as f64;
    let whole_sequences = match recompute {
        Recompute::Full => {
            let input = e * parts.sbh;
            if split.sp {
                input / t
            } else {
                input
            }
        }
        Recompute::None | Recompute::Selective => {
            let core = if recompute == Recompute::None {
                parts.attention_core
            } else {
                0.0
            };
            let split_part = parts.split + core;
            if split.sp {
                (parts.replicated + split_part) / t
            } else {
                parts.replicated + split_part / t
            }
        }
    };
    whole_sequences / split.cp as f64
}

/// What the attention core alone keeps for backward on one GPU: the bytes selective
/// recomputation drops and rewrites.
pub fn attention_core_bytes(
    model: &TransformerSpec,
    b: f64,
    e: f64,
    split: LayerSplit,
    attention: AttentionKind,
) -> f64 {
    LayerActivations::new(model, b, e, attention).attention_core / (split.tp * split.cp) as f64
}

/// The three groups of Korthikanti et al.'s per-layer activations.
struct LayerActivations {
    /// s·b·h: one hidden-sized tensor, in elements.
    sbh: f64,
    /// Not split by tensor parallelism: two layer-norm inputs, the QKV and fc1 inputs (e·sbh
    /// each) and two dropout masks (1 byte per element): sbh(4e + 2).
    replicated: f64,
    /// Split by tensor parallelism: Q, K, V, projection input (which is also the attention
    /// output the flash kernel keeps) and the MLP's inner activations.
    split: f64,
    /// What the attention kernel keeps beyond Q, K, V and its output. Standard: softmax output
    /// (e), dropout mask (1), dropout output (e): a·s²·b·(2e+1). Flash: one f32 log-sum-exp
    /// per row and head, 4·a·s·b.
    attention_core: f64,
}

impl LayerActivations {
    fn new(model: &TransformerSpec, b: f64, e: f64, attention: AttentionKind) -> Self {
        let s = model.seq_len as f64;
        let h = model.hidden as f64;
        let a = model.heads as f64;
        let f = model.ffn_hidden as f64;
        let kv = model.kv_width() as f64;
        let sbh = s * b * h;
        let mlp_inner = if model.gated_mlp {
            3.0 * e * s * b * f
        } else {
            2.0 * e * s * b * f
        };
        LayerActivations {
            sbh,
            replicated: sbh * (4.0 * e + 2.0),
            split: e * s * b * (2.0 * h + 2.0 * kv) + mlp_inner,
            attention_core: match attention {
                AttentionKind::Standard => a * s * s * b * (2.0 * e + 1.0),
                AttentionKind::Flash => 4.0 * a * s * b,
            },
        }
    }
}

/// How many micro-batches' worth of a stage's layers the first pipeline stage keeps at its
/// peak: 1F1B holds min(p, m), scaled by (1 + (p−1)/(p·v)) when interleaved (Korthikanti et
/// al. 2022 §4.2.3); GPipe holds all m. Without a pipeline, one micro-batch.
pub fn in_flight_microbatches(layout: &Layout, microbatches: u64) -> f64 {
    let p = layout.pp as f64;
    if layout.pp == 1 {
        return 1.0;
    }
    match layout.schedule {
        Schedule::GPipe => microbatches as f64,
        Schedule::OneFOneB => {
            let base = p.min(microbatches as f64);
            if layout.interleave > 1 {
                base * (1.0 + (p - 1.0) / (p * layout.interleave as f64))
            } else {
                base
            }
        }
    }
}

/// Layers the fullest pipeline stage holds: `v` chunks of ⌈L/(p·v)⌉ layers. When the layer
/// count does not divide evenly (126 layers on 16 stages), Megatron lets the first and the
/// last stage hold fewer (`--decoder-first-pipeline-num-layers`,
/// `--decoder-last-pipeline-num-layers`); no split can give every stage fewer than this, so
/// it bounds both the memory of the fullest stage and the time of the slowest.
pub fn stage_layers(layers: u64, pp: u64, interleave: u64) -> u64 {
    layers.div_ceil(pp * interleave) * interleave
}

/// Bytes the loss holds on the last pipeline stage's GPU for `tokens` tokens of a micro-batch
/// and `vocab_per_rank` = V/tp logits per token, while `pending` micro-batches await their
/// backward there (1 with 1F1B, all m with GPipe). Megatron's vocab-parallel cross entropy
/// (and PyTorch's, under autocast) computes in fp32: each pending micro-batch keeps the
/// output GEMM's logits in compute precision (`e` bytes, alive while the loss reads them) and
/// their fp32 copy turned into the softmax it saves for backward (4 bytes); backward then
/// writes the fp32 gradient of the logits (4 bytes) for one micro-batch at a time.
pub fn loss_bytes(tokens: f64, vocab_per_rank: f64, e: f64, pending: f64) -> f64 {
    tokens * vocab_per_rank * (pending * (e + 4.0) + 4.0)
}

/// Bytes ZeRO-3 (FSDP) holds unsharded on one GPU besides its shards: the unit being
/// computed and the one prefetched behind it, in compute precision `e` (FSDP's rate limiter
/// allows two all-gathers in flight, and DeepSpeed prefetches the next bucket), and the
/// unit's full gradient (`grad_bytes` per parameter) before it is reduce-scattered. `unit`
/// is the largest wrapped unit's parameters on this GPU: a layer, or the word embedding,
/// which the root unit keeps gathered through forward.
pub fn zero3_live_bytes(unit: f64, e: f64, grad_bytes: f64) -> f64 {
    unit * (2.0 * e + grad_bytes)
}

/// Per-GPU memory in bytes, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemoryBreakdown {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub comm_buffers: f64,
    /// Runtime reservation: the cluster's fixed `reserved_memory_gib` (CUDA context, NCCL,
    /// workspaces) plus what the allocator strands, `allocator_fragmentation` times the
    /// transient bytes (activations and buffers).
    pub reserved: f64,
}

impl MemoryBreakdown {
    pub fn total(&self) -> f64 {
        self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.comm_buffers
            + self.reserved
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Precision;
    use crate::layout::TrainingSetup;

    fn gpt(h: u64, a: u64, s: u64) -> TransformerSpec {
        TransformerSpec {
            layers: 1,
            hidden: h,
            heads: a,
            kv_heads: None,
            ffn_hidden: 4 * h,
            gated_mlp: false,
            vocab: 1000,
            seq_len: s,
            tied_embeddings: true,
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        }
    }

    #[test]
    fn zero_paper_worked_example_exactly() {
        // Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12:
        // 120 GB, 31.4 GB, 16.6 GB, 1.9 GB for baseline, P_os, P_os+g, P_os+g+p.
        let psi = 7.5e9;
        let bytes = TrainingSetup::new(1, Precision::Fp16).bytes_per_param();
        let gb = |zero| model_state_bytes(psi, bytes, zero, 64).total() / 1e9;
        assert_eq!(gb(0), 120.0);
        assert_eq!((gb(1) * 10.0).round() / 10.0, 31.4);
        assert_eq!((gb(2) * 10.0).round() / 10.0, 16.6);
        assert_eq!((gb(3) * 10.0).round() / 10.0, 1.9);
        // Unrounded by hand: 30 + 90/64, 15 + 105/64, 120/64.
        assert!((gb(1) - (30.0 + 90.0 / 64.0)).abs() < 1e-9);
        assert!((gb(2) - (15.0 + 105.0 / 64.0)).abs() < 1e-9);
        assert!((gb(3) - 1.875).abs() < 1e-12);
    }

    #[test]
    fn korthikanti_table2_formulas() {
        let (h, a, s, b, t) = (4096u64, 32u64, 2048u64, 2.0f64, 8u64);
        let m = gpt(h, a, s);
        let sbh = s as f64 * b * h as f64;
        let as_h = a as f64 * s as f64 / h as f64;
        let tf = t as f64;
        let close = |x: f64, y: f64| assert!((x - y).abs() / y < 1e-12, "{x} vs {y}");
        let standard = |tp, sp, recompute| {
            let split = LayerSplit::tensor(tp, sp);
            layer_activation_bytes(&m, b, 2.0, split, recompute, AttentionKind::Standard)
        };
        // No parallelism: sbh(34 + 5as/h).
        close(
            standard(1, false, Recompute::None),
            sbh * (34.0 + 5.0 * as_h),
        );
        // Tensor parallel: sbh(10 + 24/t + 5as/(ht)).
        close(
            standard(t, false, Recompute::None),
            sbh * (10.0 + 24.0 / tf + 5.0 * as_h / tf),
        );
        // Tensor + sequence parallel: sbh/t (34 + 5as/h).
        close(
            standard(t, true, Recompute::None),
            sbh / tf * (34.0 + 5.0 * as_h),
        );
        // Tensor parallel + selective recompute: sbh(10 + 24/t).
        close(
            standard(t, false, Recompute::Selective),
            sbh * (10.0 + 24.0 / tf),
        );
        // Tensor + sequence parallel + selective: 34 sbh / t.
        close(standard(t, true, Recompute::Selective), 34.0 * sbh / tf);
        // Full recompute: 2sbh, 2sbh/t with sp.
        close(standard(t, false, Recompute::Full), 2.0 * sbh);
        close(standard(t, true, Recompute::Full), 2.0 * sbh / tf);
    }

    #[test]
    fn flash_activations_grow_linearly_standard_quadratically() {
        let (h, a, b, e) = (4096u64, 32u64, 1.0f64, 2.0f64);
        let bytes = |s: u64, attention| {
            let split = LayerSplit::tensor(1, false);
            layer_activation_bytes(&gpt(h, a, s), b, e, split, Recompute::None, attention)
        };
        let mut s = 512;
        while s < 8192 {
            // Flash: every term is per token, so doubling s doubles the bytes exactly.
            let flash = bytes(2 * s, AttentionKind::Flash) / bytes(s, AttentionKind::Flash);
            assert!((flash - 2.0).abs() < 1e-12, "s = {s}: ×{flash}");
            // Standard: the per-token part doubles, the a·s²·b·(2e+1) scores quadruple.
            let scores = |s: u64| {
                bytes(s, AttentionKind::Standard) - bytes(s, AttentionKind::Flash)
                    + 4.0 * (a * s) as f64 * b
            };
            let sf = s as f64;
            assert!((scores(s) - a as f64 * sf * sf * b * (2.0 * e + 1.0)).abs() < 1e-3);
            assert!((scores(2 * s) / scores(s) - 4.0).abs() < 1e-12);
            s *= 2;
        }
        // By hand at s = 8192: standard sbh(34 + 5as/h) = 354·sbh = 11.0625 GiB, 10 GiB of
        // it scores; flash 34·sbh plus 4·a·s·b bytes of log-sum-exps, 1.06 GiB.
        let sbh = 8192.0 * 4096.0;
        assert_eq!(
            bytes(8192, AttentionKind::Standard),
            11.0625 * (1u64 << 30) as f64
        );
        assert_eq!(
            bytes(8192, AttentionKind::Flash),
            34.0 * sbh + 4.0 * 32.0 * 8192.0
        );
    }

    #[test]
    fn context_parallelism_divides_every_kept_tensor() {
        let m = gpt(4096, 32, 8192);
        for attention in [AttentionKind::Standard, AttentionKind::Flash] {
            for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                for (tp, sp) in [(1, false), (4, false), (4, true)] {
                    let at = |cp| {
                        let split = LayerSplit { tp, sp, cp };
                        layer_activation_bytes(&m, 2.0, 2.0, split, recompute, attention)
                    };
                    for cp in [2, 4] {
                        let ratio = at(cp) / at(1);
                        assert!(
                            (ratio - 1.0 / cp as f64).abs() < 1e-12,
                            "cp = {cp}: {ratio}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn in_flight_counts() {
        let mut l = Layout::data_parallel(1, 1);
        assert_eq!(in_flight_microbatches(&l, 16), 1.0);
        l.pp = 4;
        assert_eq!(in_flight_microbatches(&l, 16), 4.0);
        assert_eq!(in_flight_microbatches(&l, 2), 2.0);
        l.interleave = 2;
        // 4 · (1 + 3/8)
        assert_eq!(in_flight_microbatches(&l, 16), 5.5);
        l.interleave = 1;
        l.schedule = Schedule::GPipe;
        assert_eq!(in_flight_microbatches(&l, 16), 16.0);
    }
}
