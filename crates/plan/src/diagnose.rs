//! Diagnosis of measured step-time breakdowns: which loss dominates one run, and which loss
//! grew when the worker count grew (the 8 → 16 GPU regression of the background texts).

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};

/// One measured step, averaged over steps, as a meshtrain run reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredStep {
    pub workers: u64,
    pub compute_s: f64,
    #[serde(default)]
    pub comm_exposed_s: f64,
    #[serde(default)]
    pub comm_hidden_s: f64,
    #[serde(default)]
    pub bubble_s: f64,
    #[serde(default)]
    pub data_s: f64,
    #[serde(default)]
    pub optimizer_s: f64,
    /// Wall time of the step; defaults to the sum of the exposed parts. Any remainder is
    /// reported as "other".
    #[serde(default)]
    pub step_s: Option<f64>,
    /// Samples per step over all workers; defaults to a fixed per-worker batch (weak
    /// scaling), i.e. proportional to `workers`.
    #[serde(default)]
    pub samples_per_step: Option<f64>,
    /// Hosts the workers ran on (a run reports it; absent: not known).
    #[serde(default)]
    pub hosts: Option<u64>,
    /// The data-parallel all-reduce the run used: `flat` or `hierarchical`.
    #[serde(default)]
    pub grad_reduce: Option<String>,
    /// A GPU run's memory figures (peak and current bytes of its allocator): reported
    /// beside the times, not used by the planner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum DiagnoseFile {
    Runs { run: Vec<MeasuredStep> },
    Single(MeasuredStep),
}

/// Parses a TOML (`[[run]]` tables or one table) or JSON (object, `{"run": [...]}` or array)
/// breakdown file.
pub fn parse_measurements(text: &str) -> Result<Vec<MeasuredStep>> {
    let trimmed = text.trim_start();
    let runs = if trimmed.starts_with('[') && trimmed[1..].trim_start().starts_with('{') {
        serde_json::from_str::<Vec<MeasuredStep>>(text).map_err(|e| e.to_string())
    } else if trimmed.starts_with('{') {
        serde_json::from_str::<DiagnoseFile>(text)
            .map(flatten)
            .map_err(|e| e.to_string())
    } else {
        toml::from_str::<DiagnoseFile>(text)
            .map(flatten)
            .map_err(|e| e.to_string())
    }
    .map_err(|reason| PlanError::Parse {
        what: "step-time breakdown".into(),
        reason,
    })?;
    if runs.is_empty() {
        return Err(PlanError::Parse {
            what: "step-time breakdown".into(),
            reason: "no runs given".into(),
        });
    }
    for r in &runs {
        r.validate()?;
    }
    Ok(runs)
}

fn flatten(file: DiagnoseFile) -> Vec<MeasuredStep> {
    match file {
        DiagnoseFile::Runs { run } => run,
        DiagnoseFile::Single(one) => vec![one],
    }
}

impl MeasuredStep {
    fn validate(&self) -> Result<()> {
        let bad = |reason: String| PlanError::Parse {
            what: "step-time breakdown".into(),
            reason,
        };
        if self.workers == 0 {
            return Err(bad("workers must be at least 1".into()));
        }
        for (name, v) in self.parts() {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(format!(
                    "{name} must be a non-negative number, got {v}"
                )));
            }
        }
        if self.step() <= 0.0 {
            return Err(bad("the step takes no time".into()));
        }
        if let Some(hosts) = self.hosts {
            if hosts == 0 || hosts > self.workers {
                return Err(bad(format!(
                    "hosts must be between 1 and the {} workers, got {hosts}",
                    self.workers
                )));
            }
        }
        if let Some(kind) = &self.grad_reduce {
            if kind != "flat" && kind != "hierarchical" {
                return Err(bad(format!(
                    "grad_reduce must be \"flat\" or \"hierarchical\", got {kind:?}"
                )));
            }
        }
        Ok(())
    }

    /// Whether the run's workers were spread over more than one host.
    fn crosses_hosts(&self) -> bool {
        self.hosts.is_some_and(|h| h > 1)
    }

    /// The exposed parts of the step.
    fn parts(&self) -> [(&'static str, f64); 5] {
        [
            ("compute_s", self.compute_s),
            ("comm_exposed_s", self.comm_exposed_s),
            ("bubble_s", self.bubble_s),
            ("data_s", self.data_s),
            ("optimizer_s", self.optimizer_s),
        ]
    }

    pub fn step(&self) -> f64 {
        self.step_s
            .unwrap_or_else(|| self.parts().iter().map(|(_, v)| v).sum())
    }

    fn other(&self) -> f64 {
        (self.step() - self.parts().iter().map(|(_, v)| v).sum::<f64>()).max(0.0)
    }

    fn samples(&self) -> f64 {
        self.samples_per_step.unwrap_or(self.workers as f64)
    }

    fn losses(&self) -> Vec<(&'static str, f64)> {
        let mut v = vec![
            ("exposed communication", self.comm_exposed_s),
            ("pipeline bubble", self.bubble_s),
            ("data loading", self.data_s),
            ("optimizer", self.optimizer_s),
            ("other (unaccounted)", self.other()),
        ];
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }
}

fn advice(loss: &str) -> &'static str {
    match loss {
        "exposed communication" => "gradient synchronisation is not hidden: overlap the all-reduce with backward (buckets in reverse layer order), grow the per-worker batch with gradient accumulation, and check whether the group now crosses a slower link (e.g. leaving the node)",
        "pipeline bubble" => "more micro-batches per step or an interleaved schedule",
        "data loading" => "more loader workers, prefetching, or pre-decoded data",
        "optimizer" => "shard the optimizer states (ZeRO-1) or fuse the update",
        _ => "profile the step: time is going somewhere the breakdown does not name",
    }
}

/// What cuts the traffic a data-parallel run sends between hosts, most effective first for
/// this run: hierarchical reduction when it reduced flat with several workers per host, then
/// what every run can do.
fn inter_host_fixes(run: &MeasuredStep) -> String {
    let hosts = run.hosts.unwrap_or(1).max(1);
    let even = run.workers.is_multiple_of(hosts);
    let per_host = run.workers / hosts;
    let mut fixes = Vec::new();
    if even && per_host > 1 && run.grad_reduce.as_deref() != Some("hierarchical") {
        let condition = if run.grad_reduce.is_none() {
            " (if the run reduced flat; its breakdown does not say)"
        } else {
            ""
        };
        fixes.push(format!(
            "hierarchical reduction{condition} (`--set parallel.grad_reduce=\"hierarchical\"`): reduce-scatter among the {per_host} workers of each host, all-reduce only the 1/{per_host} shards across hosts, all-gather inside the host, so each host's link carries 2(H−1)/H of the gradients instead of a flat ring's 2(n−1)/n"
        ));
    }
    fixes.push("bf16 on the wire (`--set parallel.compression=\"bf16\"`): half the bytes".into());
    fixes.push("larger buckets (`parallel.bucket_cap_mb`): fewer messages, each paying the link's latency once".into());
    fixes.push("gradient accumulation (`train.accumulation_steps`) with a larger batch per worker: the same reduction for more samples".into());
    format!("Fixes, most effective first: {}.", fixes.join("; "))
}

/// The diagnosis as text.
pub fn diagnose(runs: &[MeasuredStep]) -> String {
    let mut runs = runs.to_vec();
    runs.sort_by_key(|r| r.workers);
    let mut out = String::new();
    for r in &runs {
        let step = r.step();
        let (name, secs) = r.losses()[0];
        let _ = writeln!(
            out,
            "{} workers: step {:.4} s, compute {:.1}%, exposed comm {:.1}% (hidden {:.4} s), bubble {:.1}%, data {:.1}%, optimizer {:.1}%, other {:.1}%",
            r.workers,
            step,
            100.0 * r.compute_s / step,
            100.0 * r.comm_exposed_s / step,
            r.comm_hidden_s,
            100.0 * r.bubble_s / step,
            100.0 * r.data_s / step,
            100.0 * r.optimizer_s / step,
            100.0 * r.other() / step
        );
        if secs > 0.0 {
            let _ = writeln!(
                out,
                "  dominant loss: {name} ({:.1}% of the step)",
                100.0 * secs / step
            );
        }
    }
    let base = &runs[0];
    let base_rate = base.samples() / base.step();
    for pair in runs.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let ideal = b.workers as f64 / a.workers as f64;
        let actual = (b.samples() / b.step()) / (a.samples() / a.step());
        // Speed-up in units where the smallest run counts as ×(its worker count).
        let equivalent = (b.samples() / b.step()) / base_rate * base.workers as f64;
        let _ = writeln!(
            out,
            "{} → {} workers: throughput ×{:.2} (ideal ×{:.2}, scaling efficiency {:.0}%); speed-up ×{:.1} counting the {}-worker run as ×{}",
            a.workers,
            b.workers,
            actual,
            ideal,
            100.0 * actual / ideal,
            equivalent,
            base.workers,
            base.workers
        );
        // Time per sample spent in each part, per worker: with perfect scaling it stays fixed.
        let per = |r: &MeasuredStep, v: f64| v * r.workers as f64 / r.samples();
        let growth: Vec<(&str, f64)> = vec![
            ("compute", per(b, b.compute_s) - per(a, a.compute_s)),
            (
                "exposed communication",
                per(b, b.comm_exposed_s) - per(a, a.comm_exposed_s),
            ),
            ("pipeline bubble", per(b, b.bubble_s) - per(a, a.bubble_s)),
            ("data loading", per(b, b.data_s) - per(a, a.data_s)),
            ("optimizer", per(b, b.optimizer_s) - per(a, a.optimizer_s)),
            ("other (unaccounted)", per(b, b.other()) - per(a, a.other())),
        ];
        let total: f64 = growth.iter().map(|(_, g)| g.max(0.0)).sum();
        if let Some((name, g)) = growth.iter().copied().max_by(|x, y| x.1.total_cmp(&y.1)) {
            if g > 0.0 && name == "exposed communication" && a.hosts == Some(1) && b.crosses_hosts()
            {
                let _ = writeln!(
                    out,
                    "  the regression comes mostly from the inter-host gradient reduction: the run left one host for {} (exposed communication accounts for {:.0}% of the added per-sample time; every all-reduce now crosses the slower link between hosts). {}",
                    b.hosts.unwrap_or(2),
                    100.0 * g / total,
                    inter_host_fixes(b)
                );
            } else if g > 0.0 {
                let _ = writeln!(
                    out,
                    "  the regression comes mostly from {name}: it accounts for {:.0}% of the added per-sample time. First mitigation: {}.",
                    100.0 * g / total,
                    if name == "compute" {
                        "the per-worker batch became too small for efficient kernels; keep the per-worker batch fixed (grow the global batch) or use gradient accumulation"
                    } else {
                        advice(name)
                    }
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The background texts' example: 8 GPUs give 8×, 16 GPUs only 10×. With a fixed
    /// per-GPU batch and 1 s of compute, 16 GPUs at 10× means a 1.6 s step; suppose the
    /// breakdown shows the extra 0.6 s as exposed all-reduce time (hypothetical numbers
    /// illustrating the scenario, not a measurement).
    const BACKGROUND: &str = r#"
[[run]]
workers = 8
compute_s = 1.0
comm_exposed_s = 0.0
comm_hidden_s = 0.05

[[run]]
workers = 16
compute_s = 1.0
comm_exposed_s = 0.6
comm_hidden_s = 0.1
"#;

    #[test]
    fn names_exposed_communication_for_the_8_to_16_regression() {
        let runs = parse_measurements(BACKGROUND).unwrap();
        let text = diagnose(&runs);
        assert!(text.contains("8 → 16 workers: throughput ×1.25 (ideal ×2.00, scaling efficiency 62%); speed-up ×10.0"), "{text}");
        assert!(
            text.contains(
                "the regression comes mostly from exposed communication: it accounts for 100%"
            ),
            "{text}"
        );
    }

    /// A run that leaves its host: 2 workers on one host, then 2 hosts × 2 workers reducing
    /// flat over the link between them.
    #[test]
    fn names_the_inter_host_reduction_and_hierarchical_first() {
        let runs = parse_measurements(
            r#"
[[run]]
workers = 2
hosts = 1
compute_s = 1.0
comm_exposed_s = 0.05
grad_reduce = "flat"

[[run]]
workers = 4
hosts = 2
compute_s = 1.0
comm_exposed_s = 0.9
grad_reduce = "flat"
"#,
        )
        .unwrap();
        let text = diagnose(&runs);
        assert!(
            text.contains(
                "mostly from the inter-host gradient reduction: the run left one host for 2"
            ),
            "{text}"
        );
        assert!(
            text.contains("Fixes, most effective first: hierarchical reduction"),
            "{text}"
        );
        // Already hierarchical: the advice starts with bf16 on the wire.
        let mut hier = runs.clone();
        hier[1].grad_reduce = Some("hierarchical".into());
        let text = diagnose(&hier);
        assert!(
            text.contains("Fixes, most effective first: bf16 on the wire"),
            "{text}"
        );
        // Not saying how the run reduced: hierarchical comes first, conditionally.
        let mut unsaid = runs.clone();
        unsaid[1].grad_reduce = None;
        assert!(
            diagnose(&unsaid).contains("hierarchical reduction (if the run reduced flat"),
            "{}",
            diagnose(&unsaid)
        );
        // Uneven hosts (5 workers on 2) cannot reduce hierarchically.
        let mut uneven = runs.clone();
        uneven[1].workers = 5;
        assert!(diagnose(&uneven).contains("Fixes, most effective first: bf16 on the wire"));
        // Without host counts, on either side, the generic advice stands.
        for side in 0..2 {
            let mut unknown = runs.clone();
            unknown[side].hosts = None;
            let text = diagnose(&unknown);
            assert!(text.contains("mostly from exposed communication"), "{text}");
        }
    }

    #[test]
    fn json_and_single_run_inputs() {
        let one = r#"{"workers": 4, "compute_s": 0.5, "bubble_s": 0.3, "data_s": 0.1}"#;
        let runs = parse_measurements(one).unwrap();
        assert_eq!(runs.len(), 1);
        let text = diagnose(&runs);
        assert!(
            text.contains("dominant loss: pipeline bubble (33.3% of the step)"),
            "{text}"
        );
        let arr = r#"[{"workers": 1, "compute_s": 1.0}, {"workers": 2, "compute_s": 1.0, "data_s": 0.5}]"#;
        let text = diagnose(&parse_measurements(arr).unwrap());
        assert!(text.contains("mostly from data loading"), "{text}");
    }

    #[test]
    fn rejects_bad_breakdowns() {
        assert!(parse_measurements("{\"workers\": 0, \"compute_s\": 1.0}").is_err());
        let neg = parse_measurements("{\"workers\": 2, \"compute_s\": -1.0}").unwrap_err();
        assert!(
            neg.to_string()
                .contains("compute_s must be a non-negative number"),
            "{neg}"
        );
        assert!(parse_measurements("not = [valid").is_err());
        let hosts =
            parse_measurements("{\"workers\": 2, \"hosts\": 3, \"compute_s\": 1.0}").unwrap_err();
        assert!(
            hosts
                .to_string()
                .contains("hosts must be between 1 and the 2 workers"),
            "{hosts}"
        );
        let kind =
            parse_measurements("{\"workers\": 2, \"compute_s\": 1.0, \"grad_reduce\": \"tree\"}")
                .unwrap_err();
        assert!(kind.to_string().contains("grad_reduce must be"), "{kind}");
    }
}
