//! Cluster descriptions: how many GPUs, how they are grouped into nodes, how fast each GPU
//! computes and how fast the links between them are.
//!
//! Bandwidths are *achievable bus bandwidths* in the nccl-tests sense (what a ring all-reduce
//! really reaches per GPU), not the marketing numbers; the preset files cite both.

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};

/// Numeric precision of a training run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in fp32.
    Fp32,
    /// bf16 compute with fp32 master weights and optimizer states.
    Bf16,
    /// fp16 compute with fp32 master weights, optimizer states and dynamic loss scaling.
    Fp16,
    /// fp8 matrix multiplications (NVIDIA Transformer Engine's recipe: inputs cast to e4m3,
    /// gradients to e5m2, each tensor with its own scale) inside bf16 layers: activations,
    /// element-wise work and communication stay bf16, master weights and optimizer states
    /// fp32. Only GEMMs run at the fp8 peak; the cluster must state one.
    Fp8,
}

impl Precision {
    pub fn parse(text: &str) -> Result<Self> {
        match text.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(Precision::Fp32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(Precision::Fp16),
            "fp8" | "float8" | "e4m3" => Ok(Precision::Fp8),
            other => Err(PlanError::InvalidSetup(format!(
                "unknown precision `{other}`; use fp32, bf16, fp16 or fp8"
            ))),
        }
    }

    /// Bytes of one weight, activation or gradient element in compute precision (fp8 layers
    /// keep bf16 activations and weights; only the GEMM operands are cast).
    pub fn compute_bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 4.0,
            Precision::Bf16 | Precision::Fp16 | Precision::Fp8 => 2.0,
        }
    }

    pub fn is_mixed(self) -> bool {
        !matches!(self, Precision::Fp32)
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Fp8 => "fp8",
        }
    }
}

/// Peak dense FLOP/s of one GPU per precision (TFLOP/s in files).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakTflops {
    pub fp32: f64,
    pub bf16: f64,
    pub fp16: f64,
    /// Dense fp8 tensor-core peak; absent on GPUs without fp8 tensor cores (A100, CPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<f64>,
}

/// One class of link (inside a node, or between nodes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Achievable bus bandwidth per GPU, GB/s (10⁹ bytes/s).
    pub bandwidth_gbps: f64,
    /// Latency of one message / one ring step, microseconds.
    pub latency_us: f64,
}

/// Share of a step's transient bytes that PyTorch's CUDA caching allocator strands, when a
/// cluster file does not say. The allocator splits cached segments and can only return a
/// segment whose blocks are all free, so memory reserved exceeds memory allocated; the
/// irregular lifetimes of activations under recomputation, pipelining and ZeRO make it worse.
/// Published measurements: GMLake (Guo et al., ASPLOS 2024, arXiv 2401.08156) reports 15%
/// fragmentation (reserved − allocated, over reserved) on average and up to 33% over eight LLM
/// trainings on A100-80GB; a TorchRec study (github.com/meta-pytorch/torchrec pull 4584)
/// measured 77 GiB peak allocated against 93 GiB reserved (17% stranded); PyTorch issue
/// 35901 shows the extreme of half the card unusable. Model states are allocated once into
/// contiguous buffers (Megatron's grad buffer, DeepSpeed's flat partitions) and do not
/// fragment, so the fraction applies to the transient bytes only.
pub const DEFAULT_ALLOCATOR_FRAGMENTATION: f64 = 0.15;

fn default_allocator_fragmentation() -> f64 {
    DEFAULT_ALLOCATOR_FRAGMENTATION
}

/// A homogeneous cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub name: String,
    /// Total accelerators (or CPU workers). May be overridden with `--gpus`.
    pub gpus: u64,
    pub gpus_per_node: u64,
    /// Memory per GPU in GiB.
    pub memory_gib: f64,
    /// Memory the framework and runtime keep for themselves (CUDA context, NCCL, cuBLAS
    /// workspaces): a fixed amount, whatever the layout.
    #[serde(default)]
    pub reserved_memory_gib: f64,
    /// Bytes the allocator holds but cannot hand out, as a fraction of the transient bytes of a
    /// step (activations, logits, communication buffers); see [`DEFAULT_ALLOCATOR_FRAGMENTATION`].
    /// 0 for CPU workers, whose system allocator returns freed pages.
    #[serde(default = "default_allocator_fragmentation")]
    pub allocator_fragmentation: f64,
    pub peak_tflops: PeakTflops,
    /// Fraction of peak that large matrix multiplications reach (cuBLAS / `gemm` measured).
    pub gemm_efficiency: f64,
    /// Achievable device-memory bandwidth, GB/s; bounds memory-bound kernels.
    pub memory_bandwidth_gbps: f64,
    /// Fixed cost of launching one kernel / op, microseconds.
    pub kernel_overhead_us: f64,
    /// The achieved rate of the trainer's memory-efficient attention kernel, TFLOP/s
    /// (counting the causal half of the score products; backward at 2.5× the forward's
    /// FLOPs), when measured (`meshtrain bench gpu --parts kernels`). Hand-written attention
    /// kernels run far below a GEMM's rate (meshtrain's: ~110 TFLOP/s against cuBLASLt's ~680
    /// on an H100); without a measurement attention is charged at `peak · gemm_efficiency`.
    #[serde(default)]
    pub attention_tflops: Option<f64>,
    /// Streaming multiprocessors. When given, GEMMs pay for wave quantisation: 128×128
    /// output tiles run in waves of `sm_count`, and a last, partly filled wave costs a full
    /// one. Leave out for CPUs.
    #[serde(default)]
    pub sm_count: Option<u64>,
    pub intra_node: LinkSpec,
    /// One network card's link between nodes (per GPU on DGX-style nodes).
    pub inter_node: LinkSpec,
    /// Network cards per node, each at `inter_node`'s bandwidth. Left out: one per GPU (DGX
    /// A100/H100). A node with one shared card (our namespace "hosts", most Ethernet
    /// clusters) gives all its ranks' cross-node traffic one link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nics_per_node: Option<u64>,
    /// Whether communication can run beside compute without taking its processor. GPUs move
    /// data with copy engines, NICs and a few SMs, so a collective hides under backward
    /// (default true). CPU workers with no core to spare (as many ranks as cores, or more) run
    /// the transport's progress, the copies and the reductions on the cores that compute:
    /// whatever a collective takes is added to the step, overlapped or not.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub comm_overlaps_compute: bool,
}

fn yes() -> bool {
    true
}

fn is_true(value: &bool) -> bool {
    *value
}

impl ClusterSpec {
    pub fn from_toml(text: &str) -> Result<Self> {
        let cluster: ClusterSpec =
            toml::from_str(text).map_err(|e| crate::model::toml_error("cluster TOML", text, e))?;
        cluster.validate()?;
        Ok(cluster)
    }

    /// Same cluster with another GPU count.
    pub fn with_gpus(&self, gpus: u64) -> Result<Self> {
        let mut c = self.clone();
        c.gpus = gpus;
        c.validate()?;
        Ok(c)
    }

    /// Peak FLOP/s of the matrix multiplications in `precision` (0 for fp8 on a cluster
    /// without an fp8 peak, which [`ClusterSpec::supports`] refuses first).
    pub fn peak_flops(&self, precision: Precision) -> f64 {
        1e12 * match precision {
            Precision::Fp32 => self.peak_tflops.fp32,
            Precision::Bf16 => self.peak_tflops.bf16,
            Precision::Fp16 => self.peak_tflops.fp16,
            Precision::Fp8 => self.peak_tflops.fp8.unwrap_or(0.0),
        }
    }

    /// Whether the cluster can run `precision`: fp8 needs an `fp8` entry in `peak_tflops`.
    pub fn supports(&self, precision: Precision) -> Result<()> {
        if precision == Precision::Fp8 && self.peak_tflops.fp8.is_none() {
            return Err(PlanError::InvalidSetup(format!(
                "cluster `{}` has no fp8 peak (peak_tflops.fp8): its GPUs have no fp8 tensor \
                 cores, or the cluster file does not say; use bf16 or add the peak",
                self.name
            )));
        }
        Ok(())
    }

    pub fn usable_memory_bytes(&self) -> f64 {
        (self.memory_gib - self.reserved_memory_gib) * GIB
    }

    pub fn nodes(&self) -> u64 {
        self.gpus.div_ceil(self.gpus_per_node)
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| PlanError::InvalidCluster {
            cluster: self.name.clone(),
            reason,
        };
        if self.gpus == 0 {
            return Err(bad("the cluster needs at least one GPU (gpus = 0)".into()));
        }
        if self.gpus_per_node == 0 {
            return Err(bad("gpus_per_node must be positive".into()));
        }
        if self.gpus > self.gpus_per_node && !self.gpus.is_multiple_of(self.gpus_per_node) {
            return Err(bad(format!(
                "{} GPUs do not fill whole nodes of {} GPUs",
                self.gpus, self.gpus_per_node
            )));
        }
        let positive = [
            ("memory_gib", self.memory_gib),
            ("peak_tflops.fp32", self.peak_tflops.fp32),
            ("peak_tflops.bf16", self.peak_tflops.bf16),
            ("peak_tflops.fp16", self.peak_tflops.fp16),
            ("peak_tflops.fp8", self.peak_tflops.fp8.unwrap_or(1.0)),
            ("memory_bandwidth_gbps", self.memory_bandwidth_gbps),
            ("intra_node.bandwidth_gbps", self.intra_node.bandwidth_gbps),
            ("inter_node.bandwidth_gbps", self.inter_node.bandwidth_gbps),
        ];
        for (field, value) in positive {
            if !(value.is_finite() && value > 0.0) {
                return Err(bad(format!(
                    "{field} must be a positive number, got {value}"
                )));
            }
        }
        if self.nics_per_node == Some(0) {
            return Err(bad(
                "nics_per_node must be at least 1 (leave it out for one card per GPU)".into(),
            ));
        }
        if !(0.0..1.0).contains(&self.allocator_fragmentation) {
            return Err(bad(format!(
                "allocator_fragmentation must be in [0, 1), got {}",
                self.allocator_fragmentation
            )));
        }
        let non_negative = [
            ("reserved_memory_gib", self.reserved_memory_gib),
            ("kernel_overhead_us", self.kernel_overhead_us),
            ("intra_node.latency_us", self.intra_node.latency_us),
            ("inter_node.latency_us", self.inter_node.latency_us),
        ];
        for (field, value) in non_negative {
            if !(value.is_finite() && value >= 0.0) {
                return Err(bad(format!("{field} must be >= 0, got {value}")));
            }
        }
        if !(self.gemm_efficiency > 0.0 && self.gemm_efficiency <= 1.0) {
            return Err(bad(format!(
                "gemm_efficiency is a fraction of peak in (0, 1], got {}",
                self.gemm_efficiency
            )));
        }
        if self.sm_count == Some(0) {
            return Err(bad("sm_count must be positive when given".into()));
        }
        if self.reserved_memory_gib >= self.memory_gib {
            return Err(bad(
                "reserved_memory_gib leaves no memory for training".into()
            ));
        }
        Ok(())
    }
}

/// Bytes in a GiB.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Bandwidth and latency a collective over one process group sees.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupLink {
    /// Bus bandwidth per GPU, bytes/s.
    pub bandwidth: f64,
    /// Per-step latency, seconds.
    pub latency: f64,
    /// Whether the group spans more than one node.
    pub crosses_nodes: bool,
}

impl ClusterSpec {
    /// The link a group of `size` ranks whose members are `stride` ranks apart sees, with
    /// ranks numbered node by node. Inside one node it is the intra-node link. Across nodes
    /// each node contributes `k` members whose rings run over `k` network cards in parallel,
    /// so the bus bandwidth is `min(intra, k · inter)` (why an 8-GPU data-parallel group per
    /// node all-reduces almost at NVLink speed, but a group with one GPU per node only gets
    /// one network card).
    pub fn group_link(&self, size: u64, stride: u64) -> GroupLink {
        let members_per_node = self.members_per_node(size, stride);
        let spans_nodes = size > members_per_node;
        if !spans_nodes {
            GroupLink {
                bandwidth: self.intra_node.bandwidth_gbps * 1e9,
                latency: self.intra_node.latency_us * 1e-6,
                crosses_nodes: false,
            }
        } else {
            let inter = members_per_node as f64 * self.network_share_gbps();
            GroupLink {
                bandwidth: inter.min(self.intra_node.bandwidth_gbps) * 1e9,
                latency: self.inter_node.latency_us * 1e-6,
                crosses_nodes: true,
            }
        }
    }
}

impl ClusterSpec {
    /// Network cards per node (one per GPU unless the file says otherwise).
    pub fn nics_per_node(&self) -> u64 {
        self.nics_per_node.unwrap_or(self.gpus_per_node).max(1)
    }

    /// One GPU's share of its node's network, GB/s: every GPU of a node runs its own group's
    /// collective at the same time, so with fewer cards than GPUs they split the cards.
    pub fn network_share_gbps(&self) -> f64 {
        let cards_per_gpu = (self.nics_per_node() as f64 / self.gpus_per_node as f64).min(1.0);
        self.inter_node.bandwidth_gbps * cards_per_gpu
    }

    /// Hierarchical all-reduce of `bytes` over a group of `size` ranks, `stride` apart, that
    /// spans nodes: reduce-scatter among the group's `k` members on each node (intra-node
    /// link), all-reduce of each `1/k` shard among the nodes (the `k` shards' all-reduces run at
    /// once and share the node's cards), all-gather inside the node. Across `H` nodes each
    /// node's cards carry `2(H−1)/H · bytes` instead of a flat ring's `2(n−1)/n · bytes`; the
    /// price is the two intra-node phases. `None` when the group stays inside one node or has
    /// one member per node (nothing to gather locally).
    pub fn hierarchical_all_reduce_time(&self, bytes: f64, size: u64, stride: u64) -> Option<f64> {
        let k = self.members_per_node(size, stride);
        if k <= 1 || size <= k || !size.is_multiple_of(k) {
            return None;
        }
        let nodes = size / k;
        let intra = self.group_link(k, stride);
        // The group's k members on a node own k GPUs' share of the node's cards.
        let cards = k as f64 * self.network_share_gbps() * 1e9;
        let across = GroupLink {
            bandwidth: cards / k as f64,
            latency: self.inter_node.latency_us * 1e-6,
            crosses_nodes: true,
        };
        Some(
            2.0 * reduce_scatter_time(bytes, k, intra)
                + all_reduce_time(bytes / k as f64, nodes, across),
        )
    }

    /// Members of a group of `size` ranks, `stride` apart, that share a node.
    fn members_per_node(&self, size: u64, stride: u64) -> u64 {
        let gpn = self.gpus_per_node;
        if stride >= gpn {
            1
        } else {
            (gpn / stride.max(1)).min(size).max(1)
        }
    }

    /// The link of one hop between neighbours of a ring over a group (ring attention's
    /// point-to-point sends). Unlike a ring all-reduce, whose k rings per node use k network
    /// cards at once, every rank sends its one block per step, and the step waits for the
    /// hops that leave a node, each over one GPU's share of the network.
    pub fn ring_hop_link(&self, size: u64, stride: u64) -> GroupLink {
        let group = self.group_link(size, stride);
        if group.crosses_nodes {
            GroupLink {
                bandwidth: self.network_share_gbps() * 1e9,
                ..group
            }
        } else {
            group
        }
    }

    /// All-to-all over a group of `size` ranks, `stride` apart, in which each rank holds a
    /// `bytes` buffer and keeps 1/size of it. The share bound for the k−1 other members of its
    /// node travels over the intra-node link, the share bound for other nodes over the rank's
    /// share of the network, both at once; nccl-tests reports all-to-all bus bandwidth with
    /// the same (n−1)/n factor, so inside a node this is (n−1)/n · bytes / intra.
    pub fn all_to_all_time(&self, bytes: f64, size: u64, stride: u64) -> f64 {
        if size <= 1 {
            return 0.0;
        }
        let n = size as f64;
        let k = self.members_per_node(size, stride) as f64;
        let on_node = (k - 1.0) / n * bytes / (self.intra_node.bandwidth_gbps * 1e9);
        let off_node = (n - k) / n * bytes / (self.network_share_gbps() * 1e9);
        let latency = self.group_link(size, stride).latency;
        on_node.max(off_node) + (n - 1.0) * latency
    }
}

/// Ring all-reduce time of `bytes` over `n` ranks: 2(n−1)/n · bytes / bw + 2(n−1) · latency.
pub fn all_reduce_time(bytes: f64, n: u64, link: GroupLink) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n_f = n as f64;
    2.0 * (n_f - 1.0) / n_f * bytes / link.bandwidth + 2.0 * (n_f - 1.0) * link.latency
}

/// Ring reduce-scatter or all-gather of a `bytes` buffer (the full, unsharded size):
/// half an all-reduce.
pub fn reduce_scatter_time(bytes: f64, n: u64, link: GroupLink) -> f64 {
    all_reduce_time(bytes, n, link) / 2.0
}

/// Point-to-point message.
pub fn send_time(bytes: f64, link: GroupLink) -> f64 {
    bytes / link.bandwidth + link.latency
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;

    #[test]
    fn ring_all_reduce_by_hand() {
        let link = GroupLink {
            bandwidth: 100e9,
            latency: 1e-6,
            crosses_nodes: false,
        };
        // 4 ranks, 1 GB: 2·3/4·1e9/1e11 = 0.015 s, plus 6 µs.
        let t = all_reduce_time(1e9, 4, link);
        assert!((t - (0.015 + 6e-6)).abs() < 1e-12, "{t}");
        assert_eq!(all_reduce_time(1e9, 1, link), 0.0);
        assert!((reduce_scatter_time(1e9, 4, link) - t / 2.0).abs() < 1e-15);
        assert!((send_time(1e6, link) - (1e-5 + 1e-6)).abs() < 1e-15);
    }

    #[test]
    fn hierarchical_all_reduce_by_hand_on_hosts_with_one_card() {
        let c =
            ClusterSpec::from_toml(include_str!("../presets/examples/cpu-2-hosts.toml")).unwrap();
        let (intra, inter) = (8e9, 0.125e9);
        let (lat_intra, lat_inter) = (5e-6, 500e-6);
        let bytes = 44e6;
        // Flat ring over 4 ranks, 2 per host, one card per host: the card carries the ring's
        // 2·3/4 of the bytes, 6 steps of the inter-host latency.
        let flat = all_reduce_time(bytes, 4, c.group_link(4, 1));
        assert!((flat - (1.5 * bytes / inter + 6.0 * lat_inter)).abs() < 1e-12);
        // Hierarchical: reduce-scatter and all-gather between the host's 2 ranks (half the
        // bytes each, one step), and the two half-size all-reduces across 2 hosts sharing the
        // card: 2·1/2·(bytes/2) / (inter/2) each, 2 steps.
        let hierarchical = c.hierarchical_all_reduce_time(bytes, 4, 1).unwrap();
        let expected = 2.0 * (0.5 * bytes / intra + lat_intra) + (bytes / inter + 2.0 * lat_inter);
        assert!(
            (hierarchical - expected).abs() < 1e-12,
            "{hierarchical} vs {expected}"
        );
        assert!(flat / hierarchical > 1.4, "{}", flat / hierarchical);
        // One rank per host, or a group inside one host: nothing to do hierarchically.
        assert_eq!(c.hierarchical_all_reduce_time(bytes, 2, 2), None);
        assert_eq!(c.hierarchical_all_reduce_time(bytes, 2, 1), None);
        // tp = 2 inside each host, dp = 2 across: each host's two data-parallel groups (one
        // per tensor-parallel rank) run at once and split the host's one card.
        let across = c.group_link(2, 2);
        assert!(across.crosses_nodes);
        assert_eq!(across.bandwidth, inter / 2.0);
        assert_eq!(c.ring_hop_link(2, 2).bandwidth, inter / 2.0);
        let mut zero = c.clone();
        zero.nics_per_node = Some(0);
        assert!(zero
            .validate()
            .unwrap_err()
            .to_string()
            .contains("nics_per_node"));
        // Four ranks on two cores: nothing hides (the flag is read from the file).
        assert!(!c.comm_overlaps_compute);
        assert!(
            presets::cluster("h100-sxm-80gb")
                .unwrap()
                .comm_overlaps_compute
        );
        // With a card per GPU (DGX), NCCL's flat rings already use every card: hierarchical
        // only adds the intra-node phases.
        let dgx = presets::cluster("h100-sxm-80gb")
            .unwrap()
            .with_gpus(32)
            .unwrap();
        let flat = all_reduce_time(1e9, 32, dgx.group_link(32, 1));
        assert!(dgx.hierarchical_all_reduce_time(1e9, 32, 1).unwrap() > flat);
    }

    #[test]
    fn group_link_placement() {
        let c = presets::cluster("h100-sxm-80gb")
            .unwrap()
            .with_gpus(32)
            .unwrap();
        // Tensor-parallel group of 8 consecutive ranks: one node, NVLink.
        let tp = c.group_link(8, 1);
        assert!(!tp.crosses_nodes);
        assert_eq!(tp.bandwidth, c.intra_node.bandwidth_gbps * 1e9);
        // Data-parallel group of 4 with stride 8: one GPU per node, one NIC.
        let dp = c.group_link(4, 8);
        assert!(dp.crosses_nodes);
        assert_eq!(dp.bandwidth, c.inter_node.bandwidth_gbps * 1e9);
        // Data-parallel group of 32 with stride 1: 8 per node, 8 NICs, capped by NVLink.
        let dp32 = c.group_link(32, 1);
        let expected = (8.0 * c.inter_node.bandwidth_gbps).min(c.intra_node.bandwidth_gbps);
        assert_eq!(dp32.bandwidth, expected * 1e9);
        // Group of 16 with stride 2: 4 members per node.
        let g = c.group_link(16, 2);
        assert_eq!(g.bandwidth, (4.0 * c.inter_node.bandwidth_gbps) * 1e9);
        // A ring of 16 with stride 1 spans two nodes: its hops wait for the two that leave a
        // node, each over one GPU's card, not over the 8 cards an all-reduce ring set uses.
        let hop = c.ring_hop_link(16, 1);
        assert!(hop.crosses_nodes);
        assert_eq!(hop.bandwidth, c.inter_node.bandwidth_gbps * 1e9);
        assert_eq!(c.ring_hop_link(8, 1), c.group_link(8, 1));
    }

    #[test]
    fn all_to_all_by_hand() {
        let c = presets::cluster("h100-sxm-80gb")
            .unwrap()
            .with_gpus(32)
            .unwrap();
        // 4 ranks in one node: 3/4 of 1 GB leaves each rank over NVLink (360 GB/s), plus
        // 3 steps of 3 µs.
        let inside = c.all_to_all_time(1e9, 4, 1);
        assert!((inside - (0.75e9 / 360e9 + 9e-6)).abs() < 1e-12, "{inside}");
        // 16 ranks, 8 per node: 7/16 stays on NVLink, 8/16 leaves over the rank's 45 GB/s
        // card and takes longer; 15 steps of 8 µs.
        let across = c.all_to_all_time(1e9, 16, 1);
        assert!(
            (across - (0.5e9 / 45e9 + 15.0 * 8e-6)).abs() < 1e-12,
            "{across}"
        );
        assert_eq!(c.all_to_all_time(1e9, 1, 1), 0.0);
    }

    #[test]
    fn rejects_bad_clusters() {
        let base = presets::cluster("a100-80gb").unwrap();
        let err = base.with_gpus(0).unwrap_err().to_string();
        assert!(err.contains("at least one GPU"), "{err}");
        let mut neg = base.clone();
        neg.inter_node.bandwidth_gbps = -5.0;
        let err = neg.validate().unwrap_err().to_string();
        assert!(
            err.contains("inter_node.bandwidth_gbps must be a positive number"),
            "{err}"
        );
        let err = base.with_gpus(12).unwrap_err().to_string();
        assert!(err.contains("do not fill whole nodes"), "{err}");
        assert!(Precision::parse("int4").is_err());
    }
}
