//! Built-in model and cluster presets, embedded from `crates/plan/presets/**.toml` so the
//! binary needs no files at run time. A preset name or a path to a TOML file is accepted
//! wherever a model or cluster is asked for.

use crate::cluster::ClusterSpec;
use crate::error::{PlanError, Result};
use crate::model::ModelSpec;

const MODELS: &[(&str, &str)] = &[
    ("lenet", include_str!("../presets/models/lenet.toml")),
    ("resnet18", include_str!("../presets/models/resnet18.toml")),
    ("gpt", include_str!("../presets/models/gpt.toml")),
    (
        "gpt2-124m",
        include_str!("../presets/models/gpt2-124m.toml"),
    ),
    ("gpt-1.7b", include_str!("../presets/models/gpt-1.7b.toml")),
    ("gpt-3.6b", include_str!("../presets/models/gpt-3.6b.toml")),
    ("gpt-7.5b", include_str!("../presets/models/gpt-7.5b.toml")),
    ("gpt-18b", include_str!("../presets/models/gpt-18b.toml")),
    ("gpt-30b", include_str!("../presets/models/gpt-30b.toml")),
    ("gpt-39b", include_str!("../presets/models/gpt-39b.toml")),
    ("gpt-76b", include_str!("../presets/models/gpt-76b.toml")),
    ("gpt-146b", include_str!("../presets/models/gpt-146b.toml")),
    (
        "gpt3-175b",
        include_str!("../presets/models/gpt3-175b.toml"),
    ),
    ("gpt-310b", include_str!("../presets/models/gpt-310b.toml")),
    ("gpt-530b", include_str!("../presets/models/gpt-530b.toml")),
    ("gpt-1t", include_str!("../presets/models/gpt-1t.toml")),
    ("llama-1b", include_str!("../presets/models/llama-1b.toml")),
    (
        "llama-70b",
        include_str!("../presets/models/llama-70b.toml"),
    ),
];

const CLUSTERS: &[(&str, &str)] = &[
    (
        "a100-40gb",
        include_str!("../presets/clusters/a100-40gb.toml"),
    ),
    (
        "a100-80gb",
        include_str!("../presets/clusters/a100-80gb.toml"),
    ),
    (
        "h100-sxm-80gb",
        include_str!("../presets/clusters/h100-sxm-80gb.toml"),
    ),
    (
        "h200-sxm-141gb",
        include_str!("../presets/clusters/h200-sxm-141gb.toml"),
    ),
    (
        "cpu-2core",
        include_str!("../presets/clusters/cpu-2core.toml"),
    ),
];

/// Aliases users are likely to type.
fn canonical(name: &str) -> &str {
    match name {
        "h100" => "h100-sxm-80gb",
        "h200" => "h200-sxm-141gb",
        "a100" => "a100-80gb",
        "cpu" => "cpu-2core",
        "resnet" | "resnet-18" => "resnet18",
        other => other,
    }
}

fn names(table: &[(&str, &str)]) -> String {
    table.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}

pub fn model_names() -> Vec<&'static str> {
    MODELS.iter().map(|(n, _)| *n).collect()
}

pub fn cluster_names() -> Vec<&'static str> {
    CLUSTERS.iter().map(|(n, _)| *n).collect()
}

/// A built-in model by name.
pub fn model(name: &str) -> Result<ModelSpec> {
    let key = canonical(&name.to_ascii_lowercase()).to_string();
    match MODELS.iter().find(|(n, _)| *n == key) {
        Some((_, text)) => ModelSpec::from_toml(text),
        None => Err(PlanError::UnknownPreset {
            kind: "model",
            name: name.to_string(),
            known: names(MODELS),
        }),
    }
}

/// A built-in cluster by name.
pub fn cluster(name: &str) -> Result<ClusterSpec> {
    let key = canonical(&name.to_ascii_lowercase()).to_string();
    match CLUSTERS.iter().find(|(n, _)| *n == key) {
        Some((_, text)) => ClusterSpec::from_toml(text),
        None => Err(PlanError::UnknownPreset {
            kind: "cluster",
            name: name.to_string(),
            known: names(CLUSTERS),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_parses_and_validates() {
        for name in model_names() {
            let m = model(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(m.name, name);
        }
        for name in cluster_names() {
            let c = cluster(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(c.name, name);
        }
    }

    #[test]
    fn preset_parameter_counts_match_their_names() {
        // Table 1 of Narayanan et al. 2021 lists the parameter counts in billions.
        let expect = [
            ("gpt-1.7b", 1.7),
            ("gpt-3.6b", 3.6),
            ("gpt-7.5b", 7.5),
            ("gpt-18b", 18.4),
            ("gpt-39b", 39.1),
            ("gpt-76b", 76.1),
            ("gpt-146b", 145.6),
            ("gpt-310b", 310.1),
            ("gpt-530b", 529.6),
            ("gpt-1t", 1008.0),
            ("gpt-30b", 29.9),
            ("llama-70b", 69.0),
        ];
        for (name, billions) in expect {
            let p = model(name).unwrap().total_params() as f64 / 1e9;
            assert!(
                (p - billions).abs() / billions < 0.035,
                "{name}: {p:.2}B vs {billions}B"
            );
        }
        assert_eq!(model("gpt").unwrap().total_params(), 3_323_392);
        // Llama 3.2 1B's own count (tied embedding counted once), which configs/llama-1b.toml
        // builds too (`meshtrain::gpu_bench`'s test).
        assert_eq!(model("llama-1b").unwrap().total_params(), 1_235_814_400);
        assert_eq!(model("lenet").unwrap().total_params(), 61_706);
    }

    #[test]
    fn unknown_preset_lists_known_ones() {
        let err = cluster("tpu-v5").unwrap_err().to_string();
        assert!(err.contains("unknown cluster preset `tpu-v5`") && err.contains("a100-80gb"));
        assert_eq!(cluster("H100").unwrap().name, "h100-sxm-80gb");
    }
}
