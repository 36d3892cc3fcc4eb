//! Calibration on our own machine: replace a preset's assumed figures with measured ones
//! (`meshtrain bench` output), then compare predictions with measured step breakdowns.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::cluster::ClusterSpec;
use crate::cost::Evaluation;
use crate::diagnose::MeasuredStep;
use crate::error::{PlanError, Result};

/// Measured hardware figures. Every field is optional: only what was measured replaces the
/// preset's value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measurements {
    /// Achieved matrix-multiply rate of one worker, GFLOP/s (e.g. `meshtrain bench gemm`).
    pub matmul_gflops: Option<f64>,
    /// Achieved streaming memory bandwidth, GB/s.
    pub memory_bandwidth_gbps: Option<f64>,
    /// All-reduce bus bandwidth between workers, GB/s (`meshtrain bench collectives`).
    pub allreduce_bus_bandwidth_gbps: Option<f64>,
    /// All-reduce latency per ring step, µs (small-message time / (2(n−1))).
    pub allreduce_latency_us: Option<f64>,
    /// Fixed cost of one framework op, µs.
    pub kernel_overhead_us: Option<f64>,
    /// Bandwidth of one host's link to the others, GB/s (a point-to-point transfer between
    /// two hosts, e.g. `meshtrain bench collectives` across the shaped link of
    /// `scripts/netns-cluster.sh`). Replaces the cluster's `inter_node` bandwidth.
    pub inter_node_bandwidth_gbps: Option<f64>,
    /// One-way latency between hosts, µs. Replaces the cluster's `inter_node` latency.
    pub inter_node_latency_us: Option<f64>,
}

impl Measurements {
    pub fn parse(text: &str) -> Result<Self> {
        let parsed = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| e.to_string())
        } else {
            toml::from_str(text).map_err(|e| e.to_string())
        };
        parsed.map_err(|reason| PlanError::Parse {
            what: "measurements".into(),
            reason,
        })
    }

    /// The cluster with measured figures in place of assumed ones. The GEMM efficiency
    /// becomes measured rate / fp32 peak (our CPU runs fp32).
    pub fn apply(&self, cluster: &ClusterSpec) -> Result<ClusterSpec> {
        let mut c = cluster.clone();
        if let Some(g) = self.matmul_gflops {
            if !(g > 0.0 && g.is_finite()) {
                return Err(PlanError::InvalidCluster {
                    cluster: c.name,
                    reason: format!("measured {g} GFLOP/s is not a positive rate"),
                });
            }
            let peak_gflops = c.peak_tflops.fp32 * 1e3;
            if g > peak_gflops {
                // The preset's peak is nominal; a machine measured faster than it has a
                // higher peak (the 16-bit rates keep their ratio to fp32).
                let scale = g / peak_gflops;
                c.peak_tflops.fp32 *= scale;
                c.peak_tflops.bf16 *= scale;
                c.peak_tflops.fp16 *= scale;
            }
            // (min: the rescaled peak can round a hair below the measured rate.)
            c.gemm_efficiency = (g / (c.peak_tflops.fp32 * 1e3)).min(1.0);
        }
        if let Some(bw) = self.memory_bandwidth_gbps {
            c.memory_bandwidth_gbps = bw;
        }
        if let Some(bw) = self.allreduce_bus_bandwidth_gbps {
            c.intra_node.bandwidth_gbps = bw;
            if c.gpus <= c.gpus_per_node {
                c.inter_node.bandwidth_gbps = bw;
            }
        }
        if let Some(lat) = self.allreduce_latency_us {
            c.intra_node.latency_us = lat;
        }
        if let Some(k) = self.kernel_overhead_us {
            c.kernel_overhead_us = k;
        }
        if let Some(bw) = self.inter_node_bandwidth_gbps {
            c.inter_node.bandwidth_gbps = bw;
        }
        if let Some(lat) = self.inter_node_latency_us {
            c.inter_node.latency_us = lat;
        }
        c.name = format!("{} (calibrated)", c.name);
        c.validate()?;
        Ok(c)
    }
}

/// Predicted versus measured, component by component.
pub fn compare(predicted: &Evaluation, measured: &MeasuredStep) -> String {
    let t = &predicted.time;
    let rows = [
        (
            "compute (incl. recompute, tp comm)",
            t.compute_s + t.recompute_s + t.tp_comm_s,
            measured.compute_s,
        ),
        (
            "exposed communication",
            t.dp_exposed_s + t.cp_comm_s + t.pp_p2p_s,
            measured.comm_exposed_s,
        ),
        (
            "hidden communication",
            t.dp_hidden_s + t.cp_hidden_s,
            measured.comm_hidden_s,
        ),
        ("pipeline bubble", t.bubble_s, measured.bubble_s),
        ("optimizer", t.optimizer_s, measured.optimizer_s),
        ("step", t.step_s, measured.step()),
    ];
    let mut out = format!(
        "predicted vs measured for {} ({} workers)\n{:<36} {:>12} {:>12} {:>9}\n",
        predicted.layout, measured.workers, "component", "predicted s", "measured s", "error"
    );
    for (name, p, m) in rows {
        let err = if m > 0.0 {
            format!("{:+.0}%", 100.0 * (p - m) / m)
        } else {
            "-".into()
        };
        let _ = writeln!(out, "{name:<36} {p:>12.4} {m:>12.4} {err:>9}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;

    #[test]
    fn measured_figures_replace_assumed_ones() {
        let cpu = presets::cluster("cpu").unwrap();
        let m = Measurements::parse(
            "matmul_gflops = 65.0\nallreduce_bus_bandwidth_gbps = 5.5\nkernel_overhead_us = 12.0\n",
        )
        .unwrap();
        let c = m.apply(&cpu).unwrap();
        assert!((c.gemm_efficiency - 0.5).abs() < 1e-12);
        assert_eq!(c.intra_node.bandwidth_gbps, 5.5);
        assert_eq!(c.kernel_overhead_us, 12.0);
        assert_eq!(c.memory_bandwidth_gbps, cpu.memory_bandwidth_gbps);
        // The link between hosts, measured across a shaped link, replaces the inter-node one.
        let link = Measurements::parse(
            "inter_node_bandwidth_gbps = 0.117\ninter_node_latency_us = 640.0\n",
        )
        .unwrap()
        .apply(&cpu)
        .unwrap();
        assert_eq!(link.inter_node.bandwidth_gbps, 0.117);
        assert_eq!(link.inter_node.latency_us, 640.0);
        assert_eq!(link.intra_node, cpu.intra_node);
        // A machine measured faster than the preset's nominal peak has a higher peak.
        let faster = Measurements {
            matmul_gflops: Some(195.0),
            ..Measurements::default()
        };
        let c = faster.apply(&cpu).unwrap();
        assert!((c.peak_tflops.fp32 - 0.195).abs() < 1e-12);
        assert_eq!(c.gemm_efficiency, 1.0);
        let nonsense = Measurements {
            matmul_gflops: Some(-1.0),
            ..Measurements::default()
        };
        assert!(nonsense.apply(&cpu).is_err());
        let negative = Measurements {
            allreduce_bus_bandwidth_gbps: Some(-1.0),
            ..Measurements::default()
        };
        assert!(negative
            .apply(&cpu)
            .unwrap_err()
            .to_string()
            .contains("bandwidth"));
    }
}
