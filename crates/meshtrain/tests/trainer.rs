//! End-to-end trainer checks: learning on real data, bit-exact resume, bad input.

use meshtrain::config::Config;
use meshtrain::train::{Task, Trainer};
use std::path::PathBuf;

fn subset_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/fashion-mnist-subset")
}

fn lenet_config(out: &std::path::Path, extra: &[&str]) -> Config {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../configs/lenet.toml"),
    )
    .unwrap();
    let mut o: Vec<String> = vec![
        format!("data.data_dir=\"{}\"", subset_dir().display()),
        "data.train_limit=1024".into(),
        "data.test_limit=1000".into(),
        "train.batch_size=64".into(),
        "train.epochs=2".into(),
        "train.threads=1".into(),
        "schedule.warmup_steps=4".into(),
        format!("train.out_dir=\"{}\"", out.display()),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    Config::from_toml_with_overrides(&text, &o).unwrap()
}

fn gpt_config(out: &std::path::Path, extra: &[&str]) -> Config {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../configs/gpt.toml"),
    )
    .unwrap();
    let mut o: Vec<String> = vec![
        "model.dim=32".into(),
        "model.layers=1".into(),
        "model.seq=16".into(),
        "train.batch_size=4".into(),
        "train.steps=6".into(),
        "train.eval_every=3".into(),
        "train.eval_batches=2".into(),
        "train.threads=1".into(),
        format!("train.out_dir=\"{}\"", out.display()),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    Config::from_toml_with_overrides(&text, &o).unwrap()
}

#[test]
fn lenet_learns_fashion_mnist_from_the_shipped_subset() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lenet_config(dir.path(), &[]);
    let task = Task::load(&cfg).unwrap();
    let mut t = Trainer::new(cfg, task).unwrap();
    let s = t.run().unwrap();
    let acc = s.test_accuracy.unwrap();
    // 32 steps on 1024 images: far above the 10% of chance, well short of a full run.
    assert!(acc > 0.55, "test accuracy {acc}");
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().any(|l| l.contains("\"kind\":\"eval\"")));
    assert!(metrics
        .lines()
        .last()
        .unwrap()
        .contains("\"kind\":\"summary\""));
}

/// Train `cfg` for all its steps, or stop at `split`, save, and resume in a fresh trainer.
fn final_params(cfg: Config, split: Option<u64>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut cfg = cfg;
    if let Some(k) = split {
        let mut first = cfg.clone();
        first.train.max_steps = Some(k);
        let task = Task::load(&first).unwrap();
        let mut t = Trainer::new(first, task).unwrap();
        t.run().unwrap();
        assert_eq!(t.step, k);
        cfg.checkpoint.resume = Some(t.checkpoint_path());
    }
    let task = Task::load(&cfg).unwrap();
    let mut t = Trainer::new(cfg.clone(), task).unwrap();
    if let Some(p) = &cfg.checkpoint.resume {
        t.resume(p).unwrap();
    }
    t.run().unwrap();
    (
        t.store.values.clone(),
        t.store.buffers.clone(),
        t.optimizer.m.clone(),
    )
}

#[test]
fn resumed_runs_end_bit_identical_to_uninterrupted_ones() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = final_params(lenet_config(a.path(), &[]), None);
    let resumed = final_params(lenet_config(b.path(), &[]), Some(11));
    assert!(
        straight == resumed,
        "LeNet: resumed run differs from the uninterrupted one"
    );

    let (c, d) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = final_params(gpt_config(c.path(), &[]), None);
    let resumed = final_params(gpt_config(d.path(), &[]), Some(4));
    assert!(
        straight == resumed,
        "GPT: resumed run differs from the uninterrupted one"
    );
}

#[test]
fn activation_recomputation_changes_memory_not_results() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let plain = final_params(lenet_config(a.path(), &["train.max_steps=5"]), None);
    let recomputed = final_params(
        lenet_config(b.path(), &["train.max_steps=5", "train.recompute=true"]),
        None,
    );
    assert!(
        plain == recomputed,
        "recomputation changed the trained parameters"
    );
}

#[test]
fn corrupt_or_mismatched_checkpoints_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lenet_config(dir.path(), &["train.max_steps=2"]);
    let task = Task::load(&cfg).unwrap();
    let mut t = Trainer::new(cfg, task).unwrap();
    t.run().unwrap();
    let ckpt = t.checkpoint_path();
    let bytes = std::fs::read(&ckpt).unwrap();

    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let err = format!("{:#}", t.resume(&truncated).unwrap_err());
    assert!(err.contains("truncated.safetensors"), "{err}");

    let missing = dir.path().join("missing.safetensors");
    let err = format!("{:#}", t.resume(&missing).unwrap_err());
    assert!(err.contains("missing.safetensors"), "{err}");

    // A GPT trainer cannot load a LeNet checkpoint: the error names the missing tensor.
    let g = gpt_config(dir.path(), &[]);
    let task = Task::load(&g).unwrap();
    let mut gt = Trainer::new(g, task).unwrap();
    let err = format!("{:#}", gt.resume(&ckpt).unwrap_err());
    assert!(err.contains("tok.weight"), "{err}");
}

#[test]
fn gpt_loss_falls_below_the_unigram_baseline_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = gpt_config(
        dir.path(),
        &[
            "train.steps=150",
            "train.eval_every=150",
            "train.batch_size=8",
            "model.dim=64",
            "model.seq=32",
            "schedule.lr=3e-3",
            "schedule.warmup_steps=10",
        ],
    );
    let task = Task::load(&cfg).unwrap();
    let mut t = Trainer::new(cfg, task).unwrap();
    let s = t.run().unwrap();
    let (loss, base) = (s.eval_loss.unwrap(), s.unigram_baseline.unwrap());
    assert!(
        loss < base,
        "validation loss {loss} not below the unigram baseline {base}"
    );
}

#[test]
fn the_cli_rejects_bad_configs_with_the_reason() {
    let exe = env!("CARGO_BIN_EXE_meshtrain");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new(exe)
        .current_dir(&root)
        .args([
            "train",
            "--config",
            "configs/lenet.toml",
            "--set",
            "train.batch_size=0",
        ])
        // A user's error is a message, not a stack trace, even with backtraces switched on.
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("batch_size"), "{err}");
    assert!(!err.contains("backtrace"), "{err}");

    let out = std::process::Command::new(exe)
        .current_dir(&root)
        .args(["train", "--config", "configs/nope.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("configs/nope.toml"));

    let out = std::process::Command::new(exe)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("train"));
}
