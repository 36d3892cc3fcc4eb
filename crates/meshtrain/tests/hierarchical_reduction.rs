//! Data parallelism across simulated hosts (`parallel.ranks_per_host` on the threads backend):
//! DDP with the hierarchical all-reduce (inside each host, then across hosts) trains like one
//! worker on the same global batch, and placements that cannot work are refused before any
//! step, naming the numbers.
//!
//! Tolerance: as in `data_parallel.rs`, only the order of floating-point sums differs from the
//! single worker (the hierarchical all-reduce adds a host's ranks first, then the hosts), so
//! after 20 steps the relative L2 distance of the parameters stays within 2e-4 (observed
//! ~1e-6); the replicas are bit-identical to each other.

use meshtrain::config::Config;
use meshtrain_comm::{CommConfig, ProcessGroup, ThreadsWorld};
use meshtrain_train::Job;
use std::sync::Arc;

mod common;
use common::{job, root, TINY_GPT};

const STEPS: u64 = 20;
const TOL: f64 = 2e-4;

fn config(model: &str, extra: &[&str]) -> Config {
    let (file, mut overrides): (&str, Vec<String>) = match model {
        "lenet" => ("configs/lenet.toml", vec!["data.train_limit=1024".into()]),
        _ => (
            "configs/gpt.toml",
            TINY_GPT
                .iter()
                .map(|s| s.to_string())
                .chain([
                    "train.batch_size=12".into(),
                    "schedule.warmup_steps=5".into(),
                ])
                .collect(),
        ),
    };
    let data = root().join("data/fashion-mnist-subset");
    overrides.push(format!("data.data_dir=\"{}\"", data.display()));
    overrides.push("data.test_limit=200".into());
    overrides.extend(extra.iter().map(|s| s.to_string()));
    let text = std::fs::read_to_string(root().join(file)).unwrap();
    Config::from_toml_with_overrides(&text, &overrides).unwrap()
}

/// Every rank's parameters after `STEPS` steps of `cfg` on `dp` workers placed `ranks_per_host`
/// to a host, with the data-parallel mode's name, or the first worker's error.
fn train(
    cfg: &Config,
    dp: usize,
    ranks_per_host: usize,
) -> Result<Vec<(String, Vec<f32>)>, String> {
    let mut cfg = cfg.clone();
    cfg.parallel.dp = dp / cfg.parallel.tp;
    cfg.parallel.ranks_per_host = ranks_per_host;
    cfg.validate().map_err(|e| format!("{e:#}"))?;
    let job = job(&cfg);
    let comm = CommConfig::default().with_ranks_per_host(ranks_per_host);
    ThreadsWorld::run(dp, comm, move |group| {
        train_worker(&job, group).map_err(|e| format!("{e:#}"))
    })
    .map_err(|e| e.to_string())
}

/// One worker's part of [`train`]: its data-parallel mode's name and final parameters.
fn train_worker(
    job: &Arc<Job>,
    group: Arc<dyn ProcessGroup>,
) -> anyhow::Result<(String, Vec<f32>)> {
    let mut t = job.trainer(group, Some(1))?;
    for _ in 0..STEPS {
        t.train_step()?;
    }
    Ok((t.parallel.sync_name().to_string(), t.local_params()))
}

fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let norm = |it: &mut dyn Iterator<Item = f64>| it.map(|v| v * v).sum::<f64>().sqrt();
    norm(&mut a.iter().zip(b).map(|(x, y)| f64::from(*x - *y)))
        / norm(&mut b.iter().map(|&v| f64::from(v)))
}

/// `dp` workers on hosts of `per_host` with `grad_reduce` against one worker.
fn matches_one_worker(model: &str, dp: usize, per_host: usize, grad_reduce: &str) {
    let cfg = config(model, &[&format!("parallel.grad_reduce=\"{grad_reduce}\"")]);
    let single = train(&cfg, 1, 0).unwrap().remove(0).1;
    let ranks = train(&cfg, dp, per_host).unwrap_or_else(|e| panic!("{e}"));
    let (mode, first) = &ranks[0];
    if grad_reduce != "flat" {
        assert_eq!(
            mode, "ddp, hierarchical all-reduce",
            "{model} {dp}/{per_host}"
        );
    }
    for (r, (_, params)) in ranks.iter().enumerate() {
        assert!(params == first, "{model}: rank {r} diverged from rank 0");
    }
    let d = rel_diff(first, &single);
    eprintln!("{model} dp={dp} on hosts of {per_host} ({grad_reduce}): vs one worker {d:.2e}");
    assert!(
        d <= TOL,
        "{model} dp={dp} hosts of {per_host}: {d:.2e} > {TOL:.0e}"
    );
}

#[test]
fn hierarchical_ddp_matches_one_worker_on_2x2_and_2x3_hosts() {
    // "auto" picks hierarchical: 2 hosts with 2 (or 3) ranks each.
    matches_one_worker("gpt", 4, 2, "auto");
    matches_one_worker("gpt", 6, 3, "hierarchical");
    matches_one_worker("lenet", 4, 2, "hierarchical");
}

/// On GPUs the phases are the device collectives of the data-parallel group's sub-groups
/// (NCCL communicators, or staged ones where ranks share a GPU). Here the stand-in device:
/// gradients in device memory, every phase staged through host memory as ranks sharing one
/// GPU stage them, buckets whose lengths do not split evenly over a host's 3 ranks. Each
/// replica must equal the CPU's hierarchical run bit for bit (the same additions in the same
/// order), with and without DDP's bf16 wire; the CPU's run against one worker is the test
/// above.
#[test]
fn hierarchical_ddp_on_the_device_equals_the_cpus() {
    for wire in ["none", "bf16"] {
        let settings = [
            "parallel.grad_reduce=\"hierarchical\"".to_string(),
            "parallel.bucket_cap_mb=0.01".into(),
            format!("parallel.compression=\"{wire}\""),
        ];
        let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
        let host = train(&config("gpt", &settings), 6, 3).unwrap_or_else(|e| panic!("{e}"));
        let on_device = [&settings[..], &["parallel.stand_in_device=true"]].concat();
        let device = train(&config("gpt", &on_device), 6, 3).unwrap_or_else(|e| panic!("{e}"));
        for (r, ((_, host), (mode, device))) in host.iter().zip(&device).enumerate() {
            assert_eq!(mode, "ddp, hierarchical all-reduce");
            assert!(
                host.iter()
                    .zip(device)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{wire}: rank {r}'s parameters differ from the CPU's hierarchical run"
            );
        }
    }
}

#[test]
fn auto_stays_flat_where_hierarchy_cannot_help() {
    // One rank per host: nothing to reduce inside a host first.
    let cfg = config("lenet", &[]);
    let ranks = train(&cfg, 2, 1).unwrap();
    assert_eq!(ranks[0].0, "ddp");
    // Flat on request, on hosts where auto would be hierarchical.
    let cfg = config("lenet", &["parallel.grad_reduce=\"flat\""]);
    assert_eq!(train(&cfg, 4, 2).unwrap()[0].0, "ddp");
}

#[test]
fn hierarchical_over_uneven_hosts_is_refused_before_work() {
    // 6 workers on hosts of 4: hosts hold 4 and 2 of them.
    let cfg = config("gpt", &["parallel.grad_reduce=\"hierarchical\""]);
    let err = train(&cfg, 6, 4).unwrap_err();
    assert!(
        err.contains(
            "parallel.grad_reduce = \"hierarchical\": a hierarchical all-reduce over group \
             'dp[0,1,2,3,4,5]' needs the same number of its ranks on every host, but its 2 \
             hosts hold 4, 2 of them"
        ),
        "{err}"
    );
    // "auto" falls back to the flat all-reduce there.
    let cfg = config("gpt", &[]);
    assert_eq!(train(&cfg, 6, 4).unwrap()[0].0, "ddp");
}

#[test]
fn tensor_parallel_groups_must_stay_inside_a_host() {
    // The mesh puts tp innermost: tp=2 on hosts of 2 keeps each pair on its host.
    let cfg = config("gpt", &["parallel.tp=2"]);
    let ranks = train(&cfg, 4, 2).unwrap();
    assert_eq!(ranks.len(), 4);
    // tp=4 on hosts of 2 would send every layer's activations across hosts.
    let cfg = config("gpt", &["parallel.tp=4", "model.heads=4"]);
    let err = train(&cfg, 4, 2).unwrap_err();
    assert!(
        err.contains(
            "tp=4 must stay inside a host (tensor parallelism exchanges activations in every \
             layer), but the hosts hold 2 ranks and the tensor-parallel group of ranks \
             [0, 1, 2, 3] spans 2 of them: use a tp that divides the ranks per host"
        ),
        "{err}"
    );
}
