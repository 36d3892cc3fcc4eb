//! The cost model: for one (model, cluster, setup, layout) it predicts per-GPU memory and the
//! time of one optimizer step, broken down by cause. Pure arithmetic, no I/O.
//!
//! Time per micro-batch on the slowest pipeline stage is built bottom-up from
//! * matrix multiplications, each at `max(FLOPs / (peak · gemm_efficiency), bytes / HBM
//!   bandwidth)` (a roofline: small-head attention GEMMs are memory-bound) plus a launch cost;
//! * memory-bound element-wise work (layer norm, GELU, softmax, dropout): each stored
//!   activation byte (Korthikanti et al. 2022's count) is accessed twice in forward (written
//!   by its producer, read by its consumer) and three times in backward;
//! * tensor-parallel all-reduces (2 forward, 2 backward, 2 more under full recomputation) on
//!   the link the tensor-parallel group sits on;
//! * pipeline point-to-point sends.
//!
//! Then the pipeline adds its bubble, (p−1)/v micro-batch times; the data-parallel gradient
//! reduction adds what the backward pass does not hide; the optimizer adds a memory-bound
//! sweep over its shard of the states.

use serde::Serialize;

use crate::cluster::{
    all_reduce_time, reduce_scatter_time, send_time, ClusterSpec, GroupLink, GIB,
};
use crate::error::{PlanError, Result};
use crate::layout::{Layout, Recompute, Schedule, TrainingSetup};
use crate::memory::{
    in_flight_microbatches, layer_activation_bytes, model_state_bytes, LayerActivations,
    MemoryBreakdown,
};
use crate::model::{Architecture, GenericSpec, ModelSpec, TransformerSpec};

/// Element-wise kernels per transformer layer forward (2 layer norms, bias+GELU, 2 dropouts,
/// 2 residual adds, softmax, scale/mask, attention dropout): used only for launch overhead.
const ELEMENTWISE_KERNELS_PER_LAYER: f64 = 10.0;
/// Memory accesses per stored activation byte: in forward an element-wise kernel reads its
/// input and writes its output (2); in backward it reads the saved tensor and the incoming
/// gradient and writes the outgoing gradient (3).
const FORWARD_ACCESSES: f64 = 2.0;
const BACKWARD_ACCESSES: f64 = 3.0;
/// Output tile edge of a GPU GEMM kernel (cuBLAS/CUTLASS 128×128 tiles).
const GEMM_TILE: f64 = 128.0;
/// Data-parallel gradient bucket (PyTorch DDP default 25 MB, in elements of 4 bytes); two are
/// alive at once (one filling, one reducing).
const DP_BUCKET_BYTES: f64 = 25.0 * 1024.0 * 1024.0 * 4.0;

/// Everything the model predicts for one layout.
#[derive(Debug, Clone, Serialize)]
pub struct Evaluation {
    pub layout: Layout,
    pub memory: MemoryBreakdown,
    /// Whether `memory.total()` fits into the GPU.
    pub fits: bool,
    pub time: StepTime,
    pub throughput: Throughput,
    pub links: Links,
}

/// Seconds per optimizer step, by cause. `step_s` is the sum of the exposed parts.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct StepTime {
    pub microbatches: u64,
    /// Forward + backward math (GEMMs and element-wise kernels) of all micro-batches.
    pub compute_s: f64,
    /// Extra forward work for activation recomputation.
    pub recompute_s: f64,
    /// Tensor-parallel all-reduces / all-gathers / reduce-scatters (not overlapped).
    pub tp_comm_s: f64,
    /// Pipeline point-to-point sends on the critical path.
    pub pp_p2p_s: f64,
    /// Pipeline fill and drain.
    pub bubble_s: f64,
    /// Data-parallel gradient (and ZeRO parameter) communication not hidden by backward.
    pub dp_exposed_s: f64,
    /// Data-parallel communication hidden under backward.
    pub dp_hidden_s: f64,
    /// Optimizer update.
    pub optimizer_s: f64,
    pub step_s: f64,
}

/// Rates derived from the step time.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Throughput {
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    /// FLOPs the hardware executes per step, recomputation included (the convention of
    /// Narayanan et al. 2021, whose TFLOP/s count recomputation).
    pub hardware_flops: f64,
    /// FLOPs of forward + backward without recomputation (the MFU convention).
    pub model_flops: f64,
    /// Hardware TFLOP/s per GPU.
    pub tflops_per_gpu: f64,
    /// Model FLOPs utilisation: model FLOP/s over peak.
    pub mfu: f64,
}

/// Which link each communication runs on.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Links {
    pub tp_crosses_nodes: bool,
    pub dp_crosses_nodes: bool,
    pub pp_crosses_nodes: bool,
    /// Bus bandwidth of the data-parallel group, bytes/s.
    pub dp_bandwidth: f64,
    /// Bytes each GPU reduces across data-parallel ranks per step.
    pub dp_bytes: f64,
}

/// The inputs of every evaluation.
#[derive(Debug, Clone)]
pub struct Problem {
    pub model: ModelSpec,
    pub cluster: ClusterSpec,
    pub setup: TrainingSetup,
}

impl Problem {
    pub fn new(model: ModelSpec, cluster: ClusterSpec, setup: TrainingSetup) -> Result<Self> {
        model.validate()?;
        cluster.validate()?;
        setup.validate()?;
        Ok(Problem {
            model,
            cluster,
            setup,
        })
    }

    /// Checks that `layout` can be built at all (sizes, divisibility); memory is checked by
    /// [`Problem::evaluate`] and [`Evaluation::fits`].
    pub fn check_layout(&self, layout: &Layout) -> Result<()> {
        let bad = |reason: String| PlanError::InvalidLayout {
            layout: layout.to_string(),
            reason,
        };
        if layout.dp == 0 || layout.tp == 0 || layout.pp == 0 {
            return Err(bad("dp, tp and pp must all be at least 1".into()));
        }
        if layout.micro_batch == 0 || layout.interleave == 0 {
            return Err(bad(
                "micro-batch size and interleave must be at least 1".into()
            ));
        }
        if layout.gpus() != self.cluster.gpus {
            return Err(bad(format!(
                "dp·tp·pp = {} but the cluster has {} GPUs",
                layout.gpus(),
                self.cluster.gpus
            )));
        }
        if layout.zero > 3 {
            return Err(bad(format!(
                "ZeRO stage {} does not exist (0–3)",
                layout.zero
            )));
        }
        let per_step = layout.dp * layout.micro_batch;
        if !self.setup.global_batch.is_multiple_of(per_step) {
            return Err(bad(format!(
                "global batch {} is not a multiple of dp·micro_batch = {per_step}",
                self.setup.global_batch
            )));
        }
        if layout.sp && layout.tp == 1 {
            return Err(bad("sequence parallelism needs tp > 1".into()));
        }
        if layout.pp > 1 && layout.zero > 1 {
            return Err(bad(
                "ZeRO-2/3 shard gradients that pipeline micro-batches keep accumulating; with pp > 1 use ZeRO-1 (the distributed optimizer), as DeepSpeed and Megatron do".into(),
            ));
        }
        let microbatches = self.setup.global_batch / per_step;
        if layout.interleave > 1 {
            if layout.pp == 1 || layout.schedule != Schedule::OneFOneB {
                return Err(bad("interleaving needs a 1F1B pipeline (pp > 1)".into()));
            }
            if !microbatches.is_multiple_of(layout.pp) {
                return Err(bad(format!(
                    "interleaved 1F1B needs the {microbatches} micro-batches to be a multiple of pp"
                )));
            }
        }
        match &self.model.architecture {
            Architecture::Transformer(t) => {
                if t.heads % layout.tp != 0 {
                    return Err(bad(format!(
                        "{} attention heads are not divisible by tp = {}",
                        t.heads, layout.tp
                    )));
                }
                let kv = t.kv_heads();
                if kv % layout.tp != 0 && !layout.tp.is_multiple_of(kv) {
                    return Err(bad(format!(
                        "{kv} key/value heads do not split over tp = {}",
                        layout.tp
                    )));
                }
                if t.ffn_hidden % layout.tp != 0 {
                    return Err(bad(format!(
                        "ffn size {} is not divisible by tp",
                        t.ffn_hidden
                    )));
                }
                if layout.sp && t.seq_len % layout.tp != 0 {
                    return Err(bad(format!(
                        "sequence length {} is not divisible by tp for sequence parallelism",
                        t.seq_len
                    )));
                }
                let chunks = layout.pp * layout.interleave;
                if t.layers % chunks != 0 {
                    return Err(bad(format!(
                        "{} layers do not split into pp·v = {chunks} equal stages",
                        t.layers
                    )));
                }
            }
            Architecture::Generic(_) => {
                if layout.tp > 1 || layout.pp > 1 || layout.sp {
                    return Err(bad(format!(
                        "`{}` is planned with data parallelism only (tp = pp = 1)",
                        self.model.name
                    )));
                }
                if layout.recompute != Recompute::None {
                    return Err(bad("recomputation is modelled for transformers only".into()));
                }
            }
        }
        Ok(())
    }

    /// Predicts memory and step time. Errors only for layouts that cannot be built; a layout
    /// that is too big comes back with `fits == false` (see [`Evaluation::require_fit`]).
    pub fn evaluate(&self, layout: &Layout) -> Result<Evaluation> {
        self.check_layout(layout)?;
        Ok(match &self.model.architecture {
            Architecture::Transformer(t) => self.evaluate_transformer(t, layout),
            Architecture::Generic(g) => self.evaluate_generic(g, layout),
        })
    }

    fn peak(&self) -> f64 {
        self.cluster.peak_flops(self.setup.precision)
    }

    fn memory_bandwidth(&self) -> f64 {
        self.cluster.memory_bandwidth_gbps * 1e9
    }

    fn kernel_overhead(&self) -> f64 {
        self.cluster.kernel_overhead_us * 1e-6
    }

    /// Fraction of the last wave of output tiles that does useful work, averaged over waves.
    fn wave_efficiency(&self, batch: f64, m: f64, n: f64) -> f64 {
        match self.cluster.sm_count {
            None => 1.0,
            Some(sms) => {
                let tiles = batch * (m / GEMM_TILE).ceil() * (n / GEMM_TILE).ceil();
                let waves = (tiles / sms as f64).ceil();
                tiles / (waves * sms as f64)
            }
        }
    }

    /// Roofline time of `batch` GEMMs of m×k by k×n, plus one launch.
    fn gemm_time(&self, batch: f64, m: f64, n: f64, k: f64) -> f64 {
        let e = self.setup.precision.compute_bytes();
        let flops = 2.0 * batch * m * n * k;
        let bytes = e * batch * (m * k + k * n + m * n);
        let compute = flops
            / (self.peak() * self.cluster.gemm_efficiency)
            / self.wave_efficiency(batch, m, n);
        compute.max(bytes / self.memory_bandwidth()) + self.kernel_overhead()
    }

    fn evaluate_transformer(&self, t: &TransformerSpec, layout: &Layout) -> Evaluation {
        let e = self.setup.precision.compute_bytes();
        let b = layout.micro_batch as f64;
        let (s, h, a) = (t.seq_len as f64, t.hidden as f64, t.heads as f64);
        let (f, v_size) = (t.ffn_hidden as f64, t.vocab as f64);
        let tp = layout.tp as f64;
        let tokens = b * s;
        let head_dim = t.head_dim() as f64;
        let microbatches = self.setup.global_batch / (layout.dp * layout.micro_batch);
        let m = microbatches as f64;
        let layers_per_gpu = (t.layers / layout.pp) as f64;

        // --- one layer, one micro-batch, this GPU ---
        let qkv = self.gemm_time(1.0, tokens, (h + 2.0 * t.kv_width() as f64) / tp, h);
        let attention_core =
            self.gemm_time(b * a / tp, s, s, head_dim) + self.gemm_time(b * a / tp, s, head_dim, s);
        let projection = self.gemm_time(1.0, tokens, h, h / tp);
        let mlp_in = self.gemm_time(1.0, tokens, f * (t.mlp_matrices() - 1) as f64 / tp, h);
        let mlp_out = self.gemm_time(1.0, tokens, h, f / tp);
        let gemm_forward = qkv + attention_core + projection + mlp_in + mlp_out;
        let stored = layer_activation_bytes(t, b, e, layout.tp, layout.sp, Recompute::None);
        let launches = ELEMENTWISE_KERNELS_PER_LAYER * self.kernel_overhead();
        let elementwise_forward = FORWARD_ACCESSES * stored / self.memory_bandwidth() + launches;
        let elementwise_backward =
            BACKWARD_ACCESSES * stored / self.memory_bandwidth() + 2.0 * launches;
        let layer_forward = gemm_forward + elementwise_forward;
        // Backward: a data-gradient and a weight-gradient GEMM per forward GEMM.
        let layer_backward = 2.0 * gemm_forward + elementwise_backward;
        let layer_recompute = match layout.recompute {
            Recompute::None => 0.0,
            Recompute::Full => layer_forward,
            Recompute::Selective => {
                let scores = LayerActivations::new(t, b, e).attention_scores / tp;
                attention_core + FORWARD_ACCESSES * scores / self.memory_bandwidth()
            }
        };
        let tp_link = self.cluster.group_link(layout.tp, 1);
        let tp_collectives = match layout.recompute {
            Recompute::Full => 6.0,
            _ => 4.0,
        };
        // With sequence parallelism each all-reduce becomes a reduce-scatter plus an
        // all-gather of the same total volume (Korthikanti et al. 2022 §4.2.2).
        let layer_tp = tp_collectives * all_reduce_time(tokens * h * e, layout.tp, tp_link);

        // --- the last stage also computes the logits and the loss ---
        let logits_forward = self.gemm_time(1.0, tokens, v_size / tp, h)
            + 4.0 * tokens * v_size / tp / self.memory_bandwidth();
        let logits = 3.0 * logits_forward;

        let pp_link = self.cluster.group_link(layout.pp, layout.tp * layout.dp);
        // Megatron's scatter/gather optimisation: each tensor-parallel rank sends 1/t of the
        // boundary activation over its own network card.
        let p2p = if layout.pp > 1 {
            2.0 * layout.interleave as f64 * send_time(tokens * h * e / tp, pp_link)
        } else {
            0.0
        };

        let mb_compute = layers_per_gpu * (layer_forward + layer_backward) + logits;
        let mb_recompute = layers_per_gpu * layer_recompute;
        let mb_tp = layers_per_gpu * layer_tp;
        let mb_total = mb_compute + mb_recompute + mb_tp + p2p;
        let bubble_microbatches = match layout.schedule {
            Schedule::GPipe => (layout.pp - 1) as f64,
            Schedule::OneFOneB => (layout.pp - 1) as f64 / layout.interleave as f64,
        };

        let params = self.transformer_params_per_gpu(t, layout);
        let per_mb_backward =
            layers_per_gpu * (layer_backward + layer_recompute) + 2.0 * logits / 3.0;
        let (dp_exposed, dp_hidden, dp_bytes, dp_link) = self.data_parallel_comm(
            params.max(),
            layout,
            microbatches,
            per_mb_backward,
            mb_compute,
        );

        let mut time = StepTime {
            microbatches,
            compute_s: m * mb_compute,
            recompute_s: m * mb_recompute,
            tp_comm_s: m * mb_tp,
            pp_p2p_s: m * p2p,
            bubble_s: bubble_microbatches * mb_total,
            dp_exposed_s: dp_exposed,
            dp_hidden_s: dp_hidden,
            optimizer_s: self.optimizer_time(params.max(), layout),
            step_s: 0.0,
        };
        time.step_s = time.compute_s
            + time.recompute_s
            + time.tp_comm_s
            + time.pp_p2p_s
            + time.bubble_s
            + time.dp_exposed_s
            + time.optimizer_s;

        // --- FLOPs ---
        let batch = self.setup.global_batch as f64;
        let layer_flops = t.layer_forward_flops_per_sequence();
        let logits_flops = t.logits_forward_flops_per_sequence();
        let recompute_flops = match layout.recompute {
            Recompute::None => 0.0,
            Recompute::Selective => 4.0 * s * s * h,
            Recompute::Full => layer_flops,
        };
        let model_flops = batch * 3.0 * (t.layers as f64 * layer_flops + logits_flops);
        let hardware_flops = model_flops + batch * t.layers as f64 * recompute_flops;

        // --- memory: the first stage holds the most in-flight activations, the last the
        // logits; report whichever is larger ---
        let per_layer = layer_activation_bytes(t, b, e, layout.tp, layout.sp, layout.recompute);
        let working_set = if layout.recompute == Recompute::None {
            0.0
        } else {
            // The layer being recomputed briefly holds all its activations.
            stored
        };
        let in_flight_first = in_flight_microbatches(layout, microbatches);
        let in_flight_last = if layout.schedule == Schedule::GPipe && layout.pp > 1 {
            m
        } else {
            1.0
        };
        let logits_memory = tokens * v_size / tp * (4.0 + e);
        let first_acts = in_flight_first * layers_per_gpu * per_layer + working_set;
        let last_acts = in_flight_last * layers_per_gpu * per_layer + working_set + logits_memory;
        let comm = self.comm_buffer_bytes(params.max(), layout, tokens * h * e / tp)
            + if layout.zero >= 3 {
                2.0 * t.params_per_layer() as f64 / tp * e
            } else {
                0.0
            };
        let bytes = self.setup.bytes_per_param();
        let build = |params: f64, activations: f64| {
            let states = model_state_bytes(params, bytes, layout.zero, layout.dp);
            MemoryBreakdown {
                weights: states.weights,
                gradients: states.gradients,
                optimizer: states.optimizer,
                activations,
                comm_buffers: comm,
                reserved: self.cluster.reserved_memory_gib * GIB,
            }
        };
        let first = build(params.first, first_acts);
        let last = build(params.last, last_acts);
        let memory = if first.total() >= last.total() {
            first
        } else {
            last
        };

        self.finish(
            layout,
            memory,
            time,
            hardware_flops,
            model_flops,
            Links {
                tp_crosses_nodes: layout.tp > 1 && tp_link.crosses_nodes,
                dp_crosses_nodes: layout.dp > 1 && dp_link.crosses_nodes,
                pp_crosses_nodes: layout.pp > 1 && pp_link.crosses_nodes,
                dp_bandwidth: dp_link.bandwidth,
                dp_bytes,
            },
        )
    }

    fn evaluate_generic(&self, g: &GenericSpec, layout: &Layout) -> Evaluation {
        let e = self.setup.precision.compute_bytes();
        let b = layout.micro_batch as f64;
        let microbatches = self.setup.global_batch / (layout.dp * layout.micro_batch);
        let m = microbatches as f64;
        let activations = g.activation_bytes_per_sample * b * e / 4.0;
        let math = g.flops_per_sample * b / (self.peak() * self.cluster.gemm_efficiency);
        // Activations are written in forward and read (plus gradients written) in backward.
        let traffic = 3.0 * activations / self.memory_bandwidth();
        let launches = g.kernels_per_step as f64 * self.kernel_overhead();
        let mb_compute = math + traffic + launches;
        // Backward is about two thirds of the work.
        let per_mb_backward = 2.0 * mb_compute / 3.0;
        let params = g.params as f64;
        let (dp_exposed, dp_hidden, dp_bytes, dp_link) =
            self.data_parallel_comm(params, layout, microbatches, per_mb_backward, mb_compute);
        let mut time = StepTime {
            microbatches,
            compute_s: m * mb_compute,
            dp_exposed_s: dp_exposed,
            dp_hidden_s: dp_hidden,
            optimizer_s: self.optimizer_time(params, layout),
            ..StepTime::default()
        };
        time.step_s = time.compute_s + time.dp_exposed_s + time.optimizer_s;
        let flops = g.flops_per_sample * self.setup.global_batch as f64;
        let states =
            model_state_bytes(params, self.setup.bytes_per_param(), layout.zero, layout.dp);
        let memory = MemoryBreakdown {
            weights: states.weights,
            gradients: states.gradients,
            optimizer: states.optimizer,
            activations,
            comm_buffers: self.comm_buffer_bytes(params, layout, 0.0),
            reserved: self.cluster.reserved_memory_gib * GIB,
        };
        self.finish(
            layout,
            memory,
            time,
            flops,
            flops,
            Links {
                tp_crosses_nodes: false,
                dp_crosses_nodes: layout.dp > 1 && dp_link.crosses_nodes,
                pp_crosses_nodes: false,
                dp_bandwidth: dp_link.bandwidth,
                dp_bytes,
            },
        )
    }

    fn finish(
        &self,
        layout: &Layout,
        memory: MemoryBreakdown,
        time: StepTime,
        hardware_flops: f64,
        model_flops: f64,
        links: Links,
    ) -> Evaluation {
        let gpus = self.cluster.gpus as f64;
        let samples = self.setup.global_batch as f64;
        let seq = self.model.transformer().map_or(1.0, |t| t.seq_len as f64);
        let throughput = Throughput {
            tokens_per_s: samples * seq / time.step_s,
            samples_per_s: samples / time.step_s,
            hardware_flops,
            model_flops,
            tflops_per_gpu: hardware_flops / (gpus * time.step_s) / 1e12,
            mfu: model_flops / (gpus * time.step_s * self.peak()),
        };
        Evaluation {
            layout: layout.clone(),
            fits: memory.total() <= self.cluster.memory_gib * GIB,
            memory,
            time,
            throughput,
            links,
        }
    }

    /// Parameters held by the first and by the last pipeline stage's GPUs (before ZeRO).
    fn transformer_params_per_gpu(&self, t: &TransformerSpec, layout: &Layout) -> StageParams {
        let tp = layout.tp as f64;
        if layout.pp == 1 {
            let all = t.total_params() as f64 / tp;
            return StageParams {
                first: all,
                last: all,
            };
        }
        let layers = (t.layers / layout.pp * t.params_per_layer()) as f64;
        // With tied embeddings the last stage keeps its own copy of the word embedding for
        // the output layer (Megatron), synchronised by an extra all-reduce.
        let output = if t.tied_embeddings {
            (t.vocab * t.hidden + 2 * t.hidden) as f64
        } else {
            t.head_params() as f64
        };
        StageParams {
            first: (layers + t.embedding_params() as f64) / tp,
            last: (layers + output) / tp,
        }
    }

    /// Exposed and hidden data-parallel communication per step, bytes reduced per GPU, link.
    fn data_parallel_comm(
        &self,
        params: f64,
        layout: &Layout,
        microbatches: u64,
        last_backward: f64,
        mb_compute: f64,
    ) -> (f64, f64, f64, GroupLink) {
        let link = self.cluster.group_link(layout.dp, layout.tp);
        let bytes = self.setup.bytes_per_param();
        let grad_bytes = params * bytes.gradients;
        let weight_bytes = params * bytes.weights;
        if layout.dp == 1 {
            return (0.0, 0.0, grad_bytes, link);
        }
        let d = layout.dp;
        match layout.zero {
            0..=2 => {
                let (reduce, gather) = if layout.zero == 0 {
                    (all_reduce_time(grad_bytes, d, link), 0.0)
                } else {
                    (
                        reduce_scatter_time(grad_bytes, d, link),
                        reduce_scatter_time(weight_bytes, d, link),
                    )
                };
                let hidden = if self.setup.overlap_grad_reduce {
                    reduce.min(last_backward)
                } else {
                    0.0
                };
                (reduce + gather - hidden, hidden, grad_bytes, link)
            }
            _ => {
                // ZeRO-3 gathers the weights for forward and again for backward, and
                // reduce-scatters gradients, every micro-batch; prefetching overlaps this
                // with the micro-batch's compute.
                let per_mb = 2.0 * reduce_scatter_time(weight_bytes, d, link)
                    + reduce_scatter_time(grad_bytes, d, link);
                let exposed_per_mb = (per_mb - mb_compute).max(0.0);
                let m = microbatches as f64;
                (
                    m * exposed_per_mb,
                    m * (per_mb - exposed_per_mb),
                    grad_bytes,
                    link,
                )
            }
        }
    }

    /// A memory-bound sweep: read and write every optimizer state, read the gradient, write
    /// the compute-precision weights, over this GPU's shard.
    fn optimizer_time(&self, params: f64, layout: &Layout) -> f64 {
        let bytes = self.setup.bytes_per_param();
        let local = if layout.zero >= 1 {
            params / layout.dp as f64
        } else {
            params
        };
        let touched = 2.0 * bytes.optimizer + bytes.gradients + bytes.weights;
        local * touched / self.memory_bandwidth() + 4.0 * self.kernel_overhead()
    }

    fn comm_buffer_bytes(&self, params: f64, layout: &Layout, boundary_bytes: f64) -> f64 {
        let mut total = 0.0;
        if layout.dp > 1 && layout.zero < 3 {
            let grads = params * self.setup.bytes_per_param().gradients;
            total += 2.0 * grads.min(DP_BUCKET_BYTES);
        }
        if layout.pp > 1 {
            // A send and a receive buffer in each direction.
            total += 4.0 * boundary_bytes;
        }
        if layout.tp > 1 {
            total += boundary_bytes * layout.tp as f64;
        }
        total
    }
}

#[derive(Debug, Clone, Copy)]
struct StageParams {
    first: f64,
    last: f64,
}

impl StageParams {
    fn max(&self) -> f64 {
        self.first.max(self.last)
    }
}

impl Evaluation {
    /// Turns a layout that does not fit into an error naming the numbers.
    pub fn require_fit(self, cluster: &ClusterSpec) -> Result<Self> {
        if self.fits {
            return Ok(self);
        }
        let m = &self.memory;
        Err(PlanError::OutOfMemory {
            layout: self.layout.to_string(),
            needed_gib: m.total() / GIB,
            available_gib: cluster.memory_gib,
            detail: format!(
                "weights {:.1}, gradients {:.1}, optimizer {:.1}, activations {:.1}, buffers {:.1}, reserved {:.1} GiB",
                m.weights / GIB,
                m.gradients / GIB,
                m.optimizer / GIB,
                m.activations / GIB,
                m.comm_buffers / GIB,
                m.reserved / GIB
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Precision;
    use crate::presets;

    fn problem(model: &str, cluster: &str, gpus: u64, batch: u64) -> Problem {
        Problem::new(
            presets::model(model).unwrap(),
            presets::cluster(cluster).unwrap().with_gpus(gpus).unwrap(),
            TrainingSetup::new(batch, Precision::Bf16),
        )
        .unwrap()
    }

    fn per_microbatch(e: &Evaluation) -> f64 {
        let t = &e.time;
        (t.compute_s + t.recompute_s + t.tp_comm_s + t.pp_p2p_s) / t.microbatches as f64
    }

    #[test]
    fn bubble_is_p_minus_1_over_v_microbatch_times() {
        let p = problem("gpt-39b", "a100", 64, 64);
        let plain = p
            .evaluate(&Layout::parse("dp=2,tp=8,pp=4,mb=1,recompute=full").unwrap())
            .unwrap();
        // 32 micro-batches; bubble = 3 micro-batch times, i.e. (p−1)/m = 3/32 of the ideal.
        assert_eq!(plain.time.microbatches, 32);
        let ratio = plain.time.bubble_s / (plain.time.microbatches as f64 * per_microbatch(&plain));
        assert!((ratio - 3.0 / 32.0).abs() < 1e-12, "{ratio}");
        let inter = p
            .evaluate(&Layout::parse("dp=2,tp=8,pp=4,mb=1,recompute=full,v=3").unwrap())
            .unwrap();
        let ratio = inter.time.bubble_s / (inter.time.microbatches as f64 * per_microbatch(&inter));
        assert!((ratio - 3.0 / (3.0 * 32.0)).abs() < 1e-12, "{ratio}");
        let gpipe = p
            .evaluate(&Layout::parse("dp=2,tp=8,pp=4,mb=1,recompute=full,schedule=gpipe").unwrap())
            .unwrap();
        assert!((gpipe.time.bubble_s - plain.time.bubble_s).abs() < 1e-12);
        // Without recomputation GPipe keeps all 32 micro-batches of activations, 1F1B at most 4.
        let keep = |schedule: &str| {
            let spec = format!("dp=2,tp=8,pp=4,mb=1,recompute=none,schedule={schedule}");
            p.evaluate(&Layout::parse(&spec).unwrap())
                .unwrap()
                .memory
                .activations
        };
        let ratio = keep("gpipe") / keep("1f1b");
        // 32/4 = 8, up to the logits the last stage holds once in both.
        assert!((ratio - 8.0).abs() < 0.1, "{ratio}");
    }

    #[test]
    fn data_parallel_all_reduce_by_hand_and_its_overlap() {
        let mut p = problem("gpt-1.7b", "a100", 16, 64);
        p.setup.overlap_grad_reduce = false;
        let layout = Layout::parse("dp=16,mb=1").unwrap();
        let e = p.evaluate(&layout).unwrap();
        // 16 ranks over 2 nodes, 8 per node: min(230, 8·23) = 184 GB/s bus bandwidth.
        let bytes = presets::model("gpt-1.7b").unwrap().total_params() as f64 * 2.0;
        let expected = 2.0 * 15.0 / 16.0 * bytes / 184e9 + 2.0 * 15.0 * 8e-6;
        assert!(
            (e.time.dp_exposed_s - expected).abs() < 1e-12,
            "{} vs {expected}",
            e.time.dp_exposed_s
        );
        assert_eq!(e.time.dp_hidden_s, 0.0);
        assert!(e.links.dp_crosses_nodes);
        p.setup.overlap_grad_reduce = true;
        let o = p.evaluate(&layout).unwrap();
        assert!((o.time.dp_exposed_s + o.time.dp_hidden_s - expected).abs() < 1e-12);
        assert!(o.time.dp_hidden_s > 0.0 && o.time.step_s < e.time.step_s);
    }

    #[test]
    fn tensor_parallel_across_nodes_is_slower() {
        let p = problem("gpt-18b", "a100", 16, 16);
        let inside = p
            .evaluate(&Layout::parse("dp=2,tp=8,mb=1,recompute=full").unwrap())
            .unwrap();
        let across = p
            .evaluate(&Layout::parse("dp=1,tp=16,mb=1,recompute=full").unwrap())
            .unwrap();
        assert!(!inside.links.tp_crosses_nodes && across.links.tp_crosses_nodes);
        assert!(across.time.tp_comm_s > 3.0 * inside.time.tp_comm_s);
    }

    #[test]
    fn throughput_metrics_are_consistent() {
        let p = problem("gpt-7.5b", "h100", 32, 128);
        let e = p
            .evaluate(&Layout::parse("dp=8,tp=4,mb=2,recompute=selective,sp=on,zero=1").unwrap())
            .unwrap();
        let t = &e.throughput;
        assert!((t.tokens_per_s - 128.0 * 2048.0 / e.time.step_s).abs() < 1e-6);
        assert!(
            (t.tflops_per_gpu * 1e12 * 32.0 * e.time.step_s - t.hardware_flops).abs()
                / t.hardware_flops
                < 1e-12
        );
        assert!((t.mfu - t.model_flops / (32.0 * e.time.step_s * 989e12)).abs() < 1e-12);
        assert!(t.hardware_flops > t.model_flops);
        let sum = e.time.compute_s
            + e.time.recompute_s
            + e.time.tp_comm_s
            + e.time.pp_p2p_s
            + e.time.bubble_s
            + e.time.dp_exposed_s
            + e.time.optimizer_s;
        assert!((sum - e.time.step_s).abs() < 1e-12);
    }

    #[test]
    fn roofline_gemm_by_hand() {
        let p = problem("gpt", "h100", 8, 8);
        // 4096³ GEMM: compute-bound. 2·4096³ / (989e12 · 0.72), wave efficiency: 32·32 = 1024
        // tiles over 132 SMs = 8 waves of which the last is 10/132 full → 1024/1056.
        let n = 4096.0;
        let expected = 2.0 * n * n * n / (989e12 * 0.72) / (1024.0 / 1056.0) + 3e-6;
        assert!((p.gemm_time(1.0, n, n, n) - expected).abs() < 1e-12);
        // 4096×4096 by 4096×16 (k=4096, n=16): memory-bound, bytes 2·(4096² + 2·4096·16);
        // its compute time even at 32/132 wave efficiency is 3.1 µs < 11.2 µs.
        let bytes = 2.0 * (n * n + n * 16.0 + n * 16.0);
        let t = p.gemm_time(1.0, n, 16.0, n);
        assert!((t - (bytes / 3000e9 + 3e-6)).abs() < 1e-12, "{t}");
    }

    #[test]
    fn stage_parameters_optimizer_and_sends_by_hand() {
        let mut p = problem("gpt-39b", "a100", 64, 64);
        p.setup.overlap_grad_reduce = false;
        let e = p
            .evaluate(&Layout::parse("dp=4,tp=8,pp=2,mb=1,zero=1,recompute=full").unwrap())
            .unwrap();
        let t = presets::model("gpt-39b").unwrap();
        let t = t.transformer().unwrap();
        // Both stages hold 24 layers; the first adds the embedding and positions, the last its
        // copy of the tied word embedding and the final layer norm. Split over tp = 8.
        let layers = 24.0 * t.params_per_layer() as f64;
        let first = (layers + (51200.0 + 2048.0) * 8192.0) / 8.0;
        let last = (layers + 51200.0 * 8192.0 + 2.0 * 8192.0) / 8.0;
        let params = first.max(last);
        assert!((e.memory.weights - 2.0 * params).abs() < 1.0);
        assert!((e.memory.optimizer - 12.0 * params / 4.0).abs() < 1.0);
        // Optimizer sweep over a quarter of the states: 2·12 + 2 + 2 bytes per parameter.
        let sweep = params / 4.0 * 28.0 / 1800e9 + 4.0 * 3e-6;
        assert!((e.time.optimizer_s - sweep).abs() < 1e-12);
        // 16 micro-batches, each sends s·b·h·2/t bytes forward and backward between nodes
        // (pipeline neighbours are 32 ranks apart) over one 23 GB/s card.
        let send = 2048.0 * 8192.0 * 2.0 / 8.0 / 23e9 + 8e-6;
        assert!(e.links.pp_crosses_nodes);
        assert!((e.time.pp_p2p_s - 16.0 * 2.0 * send).abs() < 1e-12);
    }

    #[test]
    fn invalid_layouts_are_rejected_with_reasons() {
        let p = problem("gpt-30b", "h100", 32, 64);
        let cases = [
            (
                "dp=4,tp=4,pp=1",
                "dp·tp·pp = 16 but the cluster has 32 GPUs",
            ),
            (
                "dp=2,tp=16,pp=1",
                "56 attention heads are not divisible by tp = 16",
            ),
            ("dp=32,mb=3", "not a multiple of dp·micro_batch"),
            ("dp=32,sp=on", "sequence parallelism needs tp > 1"),
            (
                "dp=1,tp=8,pp=4,v=5",
                "48 layers do not split into pp·v = 20",
            ),
            ("dp=4,tp=8,zero=4", "ZeRO stage 4 does not exist"),
            ("dp=4,tp=4,pp=2,zero=3", "with pp > 1 use ZeRO-1"),
        ];
        for (spec, message) in cases {
            let err = p
                .evaluate(&Layout::parse(spec).unwrap())
                .unwrap_err()
                .to_string();
            assert!(err.contains(message), "{spec}: {err}");
        }
    }
}
