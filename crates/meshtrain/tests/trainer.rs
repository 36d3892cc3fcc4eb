//! End-to-end trainer checks: learning on real data, bit-exact resume, bad input.

use meshtrain::config::Config;
use meshtrain_train::{RunOptions, Summary};
use std::path::{Path, PathBuf};

mod common;
use common::{job, single_trainer};

/// Runs the job `cfg` describes, as `meshtrain train` does.
fn run(cfg: &Config) -> anyhow::Result<Summary> {
    run_with(cfg, &RunOptions::default())
}

fn run_with(cfg: &Config, options: &RunOptions) -> anyhow::Result<Summary> {
    (*job(cfg)).clone().run(options)
}

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
    let s = run(&cfg).unwrap();
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

/// Train `cfg` for all its steps, or stop at `split`, save, and resume in a fresh run.
/// Returns the final parameters, buffers and momentum (read back from the checkpoint).
fn final_params(cfg: Config, split: Option<u64>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut options = RunOptions::default();
    let checkpoint = cfg.train.out_dir.join("checkpoint.safetensors");
    if let Some(k) = split {
        let mut first = cfg.clone();
        first.train.max_steps = Some(k);
        assert_eq!(run(&first).unwrap().steps, k);
        options.resume = Some(checkpoint.clone());
    }
    run_with(&cfg, &options).unwrap();
    read_state(&cfg, &checkpoint)
}

/// Parameters, buffers and momentum of a checkpoint, as a one-worker trainer resumes them.
fn read_state(cfg: &Config, checkpoint: &Path) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut t = single_trainer(cfg);
    t.resume(checkpoint).unwrap();
    let chunk = &t.parallel.stage.chunks[0];
    (
        chunk.store.values.clone(),
        chunk.store.buffers.clone(),
        t.parallel.optimizers[0].m.clone(),
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
    run(&cfg).unwrap();
    let ckpt = dir.path().join("checkpoint.safetensors");
    let bytes = std::fs::read(&ckpt).unwrap();
    let mut t = single_trainer(&cfg);

    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let err = format!("{:#}", t.resume(&truncated).unwrap_err());
    assert!(err.contains("truncated.safetensors"), "{err}");

    let missing = dir.path().join("missing.safetensors");
    let err = format!("{:#}", t.resume(&missing).unwrap_err());
    assert!(err.contains("missing.safetensors"), "{err}");

    // A GPT trainer cannot resume a LeNet checkpoint: the error says which models they are.
    let g = gpt_config(dir.path(), &[]);
    let mut gt = single_trainer(&g);
    let err = format!("{:#}", gt.resume(&ckpt).unwrap_err());
    assert!(err.contains("holds another model"), "{err}");
    assert!(
        err.contains("kind = \"lenet\"") && err.contains("kind = \"gpt\""),
        "{err}"
    );
    // Nor start from its weights: the error names the missing tensor.
    let err = format!("{:#}", gt.init_from(&ckpt).unwrap_err());
    assert!(err.contains("tok.weight"), "{err}");

    // LeNet ReLU and sigmoid have the same tensors: only the stored model tells them apart.
    let sigmoid = lenet_config(dir.path(), &["model.variant=\"sigmoid\""]);
    let mut st = single_trainer(&sigmoid);
    let err = format!("{:#}", st.resume(&ckpt).unwrap_err());
    assert!(
        err.contains("variant = \"relu\"") && err.contains("--init-from"),
        "{err}"
    );
    // Fine-tuning from it on purpose is allowed: the weights arrive, the step stays 0.
    st.init_from(&ckpt).unwrap();
    assert_eq!(st.step, 0);
    t.resume(&ckpt).unwrap();
    assert_eq!(st.local_params(), t.local_params());

    // A checkpoint with a NaN is refused, naming the tensor.
    let nan = dir.path().join("nan.safetensors");
    std::fs::write(&nan, poison_first_value(&bytes, "param.conv1.weight")).unwrap();
    let err = format!("{:#}", t.resume(&nan).unwrap_err());
    assert!(
        err.contains("nan.safetensors")
            && err.contains("param.conv1.weight")
            && err.contains("non-finite"),
        "{err}"
    );
}

/// `bytes` (a safetensors file) with the first f32 of tensor `name` set to NaN.
fn poison_first_value(bytes: &[u8], name: &str) -> Vec<u8> {
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    let mut out = bytes.to_vec();
    let at = 8 + header_len + start;
    out[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    out
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
    let s = run(&cfg).unwrap();
    let (loss, base) = (s.eval_loss.unwrap(), s.unigram_baseline.unwrap());
    assert!(
        loss < base,
        "validation loss {loss} not below the unigram baseline {base}"
    );
}

#[test]
fn output_directories_hold_one_run_and_no_partial_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lenet_config(dir.path(), &["train.max_steps=4", "train.log_every=1"]);
    let summaries = |path: &Path| {
        let text = std::fs::read_to_string(path.join("metrics.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        lines
    };
    run(&cfg).unwrap();
    // A crash during a save leaves the temporary file: the next run removes it.
    let stale = dir.path().join("checkpoint.safetensors.tmp");
    std::fs::write(&stale, b"half a checkpoint").unwrap();
    // A fresh run into the same directory starts its metrics anew.
    run(&cfg).unwrap();
    assert!(
        !stale.exists(),
        "the stale temporary checkpoint is still there"
    );
    let records = summaries(dir.path());
    assert_eq!(records.iter().filter(|r| r["kind"] == "summary").count(), 1);
    assert_eq!(records.iter().filter(|r| r["kind"] == "train").count(), 4);
    // A resumed run keeps the records up to its checkpoint and appends the rest.
    let mut longer = cfg.clone();
    longer.train.max_steps = Some(6);
    let options = RunOptions {
        resume: Some(dir.path().join("checkpoint.safetensors")),
        ..RunOptions::default()
    };
    run_with(&longer, &options).unwrap();
    let records = summaries(dir.path());
    let steps: Vec<u64> = records
        .iter()
        .filter(|r| r["kind"] == "train")
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    assert_eq!(records.iter().filter(|r| r["kind"] == "summary").count(), 1);
    assert!(dir.path().join("breakdown.json").exists());
}

/// A run's `breakdown.json` and the layout it printed are what `meshtrain plan --compare`
/// reads: the planner's prediction beside the measurement.
#[test]
fn the_planner_reads_a_runs_breakdown() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lenet_config(
        dir.path(),
        &["train.max_steps=4", "parallel.layout=\"dp=2,mb=16\""],
    );
    let summary = run(&cfg).unwrap();
    assert_eq!(summary.layout, "dp=2,mb=16");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshtrain"))
        .args([
            "plan",
            "--model",
            "lenet",
            "--cluster",
            "cpu",
            "--gpus",
            "2",
        ])
        .args([
            "--global-batch",
            "64",
            "--layout",
            &summary.layout,
            "--compare",
        ])
        .arg(dir.path().join("breakdown.json"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("predicted vs measured for dp=2"), "{text}");
}

#[test]
fn run_lengths_are_explicit() {
    let dir = tempfile::tempdir().unwrap();
    // Resuming a finished run is an error, not a NaN summary.
    let cfg = lenet_config(dir.path(), &["train.max_steps=2"]);
    run(&cfg).unwrap();
    let options = RunOptions {
        resume: Some(dir.path().join("checkpoint.safetensors")),
        ..RunOptions::default()
    };
    let err = format!("{:#}", run_with(&cfg, &options).unwrap_err());
    assert!(
        err.contains("nothing to train: the run is at step 2"),
        "{err}"
    );
    // steps=0 is rejected before any work.
    let text = std::fs::read_to_string(common::root().join("configs/lenet.toml")).unwrap();
    let err = format!(
        "{:#}",
        Config::from_toml_with_overrides(&text, &["train.steps=0".into()]).unwrap_err()
    );
    assert!(err.contains("train.steps must be at least 1"), "{err}");
    // Steps on an epoch-based config win, and the run says so.
    let cfg = lenet_config(dir.path(), &["train.steps=3"]);
    assert_eq!(
        cfg.notices(),
        ["train.steps=3 sets the run's length; train.epochs=2 is not used"]
    );
    assert_eq!(run(&cfg).unwrap().steps, 3);
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

    // A layout the model cannot take, named with its numbers.
    let out = std::process::Command::new(exe)
        .current_dir(&root)
        .args(["train", "--layout", "dp=1,pp=9"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("9 stages, but the model has only 5 blocks"),
        "{err}"
    );

    let out = std::process::Command::new(exe)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("train"));
}
