//! Calibration on our own machine: replace a preset's assumed figures with measured ones
//! (`meshtrain bench` output), then compare predictions with measured step breakdowns.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::cluster::{ClusterSpec, Precision};
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
    /// The precision `matmul_gflops` was measured in (default fp32, a CPU's products; a GPU's
    /// are bf16): the GEMM efficiency is the rate over that precision's peak.
    pub matmul_precision: Option<Precision>,
    /// Achieved rate of the trainer's attention kernel, TFLOP/s (see
    /// [`ClusterSpec::attention_tflops`]).
    pub attention_tflops: Option<f64>,
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
    /// becomes measured rate / the peak of the precision it was measured in (fp32 unless
    /// `matmul_precision` says otherwise: our CPU runs fp32, a GPU's products bf16).
    pub fn apply(&self, cluster: &ClusterSpec) -> Result<ClusterSpec> {
        let mut c = cluster.clone();
        let positive = |what: &str, x: f64, name: &str| {
            if x > 0.0 && x.is_finite() {
                Ok(())
            } else {
                Err(PlanError::InvalidCluster {
                    cluster: name.to_string(),
                    reason: format!("measured {x} {what} is not a positive rate"),
                })
            }
        };
        if let Some(g) = self.matmul_gflops {
            positive("GFLOP/s", g, &c.name)?;
            let precision = self.matmul_precision.unwrap_or(Precision::Fp32);
            c.supports(precision)?;
            let peak_gflops = c.peak_flops(precision) / 1e9;
            if g > peak_gflops {
                // The preset's peak is nominal; a machine measured faster than it has a
                // higher peak (the other precisions' rates keep their ratio to this one).
                let scale = g / peak_gflops;
                c.peak_tflops.fp32 *= scale;
                c.peak_tflops.bf16 *= scale;
                c.peak_tflops.fp16 *= scale;
                if let Some(fp8) = c.peak_tflops.fp8.as_mut() {
                    *fp8 *= scale;
                }
            }
            // (min: the rescaled peak can round a hair below the measured rate.)
            c.gemm_efficiency = (g / (c.peak_flops(precision) / 1e9)).min(1.0);
        }
        if let Some(a) = self.attention_tflops {
            positive("attention TFLOP/s", a, &c.name)?;
            c.attention_tflops = Some(a);
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
    use crate::cost::Problem;
    use crate::layout::{Layout, TrainingSetup};
    use crate::presets;

    /// A GPU's products are measured in bf16: the efficiency is over the bf16 peak (an
    /// H100's 691 of 989 TFLOP/s), not over fp32's 67, which would make the card ten times
    /// faster than it is; a measured attention rate lands in the cluster.
    #[test]
    fn a_gpus_bf16_rates_are_read_against_the_bf16_peak() {
        let h100 = presets::cluster("h100").unwrap();
        let m = Measurements::parse(
            "matmul_precision = \"bf16\"\nmatmul_gflops = 691000.0\nattention_tflops = 111.5\n",
        )
        .unwrap();
        let c = m.apply(&h100).unwrap();
        assert_eq!(c.peak_tflops, h100.peak_tflops);
        assert!((c.gemm_efficiency - 691.0 / 989.0).abs() < 1e-9);
        assert_eq!(c.attention_tflops, Some(111.5));
        // Read as fp32 (the CPU's convention) the same number rescales every peak: the reason
        // the precision is part of the measurement.
        let as_fp32 = Measurements {
            matmul_precision: None,
            ..m.clone()
        };
        assert!(as_fp32.apply(&h100).unwrap().peak_tflops.bf16 > 5.0 * 989.0);
        let bad = Measurements {
            attention_tflops: Some(0.0),
            ..Measurements::default()
        };
        assert!(bad.apply(&h100).is_err());
    }

    /// The planner with the rates measured on the lent H100 in one call predicts meshtrain's
    /// own GPT-2 124M step measured in that call (40.03 ms, batch 16 × 1024, bf16, AdamW,
    /// one micro-batch) within 15% (42.7 ms, +6.6%), closer than the preset's assumed rates
    /// do (34.1 ms, -14.8%: attention charged at a GEMM's efficiency).
    #[test]
    fn the_measured_h100_predicts_meshtrains_gpt2_step_within_15_percent() {
        let measured_ms = 40.03;
        let predict = |cluster: ClusterSpec| {
            // The trainer's attention is the memory-efficient kernel.
            let setup = TrainingSetup {
                attention: crate::layout::AttentionKind::Flash,
                ..TrainingSetup::new(16, Precision::Bf16)
            };
            let problem = Problem::new(
                presets::model("gpt2-124m").unwrap(),
                cluster.with_gpus(1).unwrap(),
                setup,
            )
            .unwrap();
            let layout = Layout::parse("dp=1,mb=16").unwrap();
            problem.evaluate(&layout).unwrap().time.step_s * 1e3
        };
        let h100 = presets::cluster("h100").unwrap();
        let rates = Measurements::parse(include_str!(
            "../presets/measured/h100-2026-11-27-call-d.toml"
        ))
        .unwrap();
        let calibrated = predict(rates.apply(&h100).unwrap());
        let error = (calibrated - measured_ms) / measured_ms;
        assert!(
            error.abs() < 0.15,
            "predicted {calibrated:.2} ms against {measured_ms} ms measured ({:+.1}%)",
            100.0 * error
        );
        // The preset's assumed rates (attention at a GEMM's efficiency) land further off.
        let assumed = predict(h100);
        assert!(
            (assumed - measured_ms).abs() > (calibrated - measured_ms).abs(),
            "the preset alone predicted {assumed:.2} ms, the measured rates {calibrated:.2} ms"
        );
    }

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
