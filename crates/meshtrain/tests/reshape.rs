//! `--resume … --reshape`: another global batch (and world) than the checkpoint's, the
//! optimizer state kept, the data stream continued at the same sample position.

mod common;

use common::{job, root, tiny_gpt_config};
use meshtrain::config::Config;
use meshtrain_train::RunOptions;
use std::path::{Path, PathBuf};

fn metadata(checkpoint: &Path) -> serde_json::Value {
    let header =
        meshtrain_train::checkpoint::read_safetensors_header(checkpoint, "checkpoint").unwrap();
    header.entries["__metadata__"].clone()
}

fn sampler(checkpoint: &Path) -> serde_json::Value {
    serde_json::from_str(metadata(checkpoint)["sampler"].as_str().unwrap()).unwrap()
}

fn resume(
    cfg: &Config,
    checkpoint: &Path,
    reshape: bool,
) -> anyhow::Result<meshtrain_train::Summary> {
    (*job(cfg)).clone().run(&RunOptions {
        resume: Some(checkpoint.to_path_buf()),
        reshape,
        ..RunOptions::default()
    })
}

/// Text windows drawn at random: the step goes on, each new step draws the new batch.
#[test]
fn a_gpt_run_goes_on_with_another_batch_and_world() {
    let dir = tempfile::tempdir().unwrap();
    let first = tiny_gpt_config(dir.path(), 4, &["parallel.dp=2"]);
    (*job(&first)).clone().run(&RunOptions::default()).unwrap();
    let checkpoint = dir.path().join("checkpoint.safetensors");
    let wider = tiny_gpt_config(dir.path(), 6, &["train.batch_size=16"]);
    let err = format!("{:#}", resume(&wider, &checkpoint, false).unwrap_err());
    assert!(
        err.contains("global batch 8 in the checkpoint, 16 in this run")
            && err.contains("--reshape"),
        "{err}"
    );
    let summary = resume(&wider, &checkpoint, true).unwrap();
    assert_eq!(summary.steps, 6);
    // The optimizer went on (its step counts the 4 steps before), the sampler records the
    // new batch.
    assert_eq!(metadata(&checkpoint)["optimizer_step"], "6");
    assert_eq!(sampler(&checkpoint)["global_batch"], 16);
    // And a plain resume of the reshaped run continues it.
    let longer = tiny_gpt_config(dir.path(), 7, &["train.batch_size=16"]);
    assert_eq!(resume(&longer, &checkpoint, false).unwrap().steps, 7);
}

fn lenet(out: &Path, extra: &[&str]) -> Config {
    let text = std::fs::read_to_string(root().join("configs/lenet.toml")).unwrap();
    let subset = root().join("data/fashion-mnist-subset");
    let mut o: Vec<String> = vec![
        format!("data.data_dir=\"{}\"", subset.display()),
        "data.train_limit=1024".into(),
        "data.test_limit=256".into(),
        "train.epochs=2".into(),
        "train.threads=1".into(),
        "parallel.dp=1".into(),
        format!("train.out_dir=\"{}\"", out.display()),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    Config::from_toml_with_overrides(&text, &o).unwrap()
}

/// Shuffled epochs: the step is renumbered so the epoch's next samples come next.
#[test]
fn an_epoch_run_continues_at_the_same_sample_with_a_larger_batch() {
    let dir = tempfile::tempdir().unwrap();
    // 4 steps of 64: 256 samples into epoch 0 (16 steps of 64 per epoch).
    let first = lenet(dir.path(), &["train.batch_size=64", "train.max_steps=4"]);
    (*job(&first)).clone().run(&RunOptions::default()).unwrap();
    let checkpoint: PathBuf = dir.path().join("checkpoint.safetensors");
    assert_eq!(sampler(&checkpoint)["samples_into_epoch"], 256);
    let saved = std::fs::read(&checkpoint).unwrap();

    // 256 is not a whole number of batches of 96.
    let odd = lenet(dir.path(), &["train.batch_size=96", "train.max_steps=4"]);
    let err = format!("{:#}", resume(&odd, &checkpoint, true).unwrap_err());
    assert!(
        err.contains("stopped 256 samples into epoch 0, not a whole number of batches of 96"),
        "{err}"
    );

    // Batch 128: step 4 of 64 is step 2 of 128; one more step ends 384 samples in.
    let wider = lenet(dir.path(), &["train.batch_size=128", "train.max_steps=3"]);
    let summary = resume(&wider, &checkpoint, true).unwrap();
    assert_eq!(summary.steps, 3);
    let position = sampler(&checkpoint);
    assert_eq!(
        (&position["epoch"], &position["samples_into_epoch"]),
        (&serde_json::json!(0), &serde_json::json!(384))
    );
    assert_eq!(metadata(&checkpoint)["optimizer_step"], "5");

    // Through the command line: what changed is said.
    std::fs::write(&checkpoint, &saved).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshtrain"))
        .current_dir(root())
        .args(["train", "--dp", "2", "--resume"])
        .arg(&checkpoint)
        .arg("--reshape")
        .args([
            "--set",
            "train.batch_size=128",
            "--set",
            "train.max_steps=3",
        ])
        .args(["--set", "train.epochs=2", "--set", "data.train_limit=1024"])
        .args(["--set", "data.test_limit=256", "--set", "train.threads=2"])
        .arg("--set")
        .arg(format!(
            "data.data_dir=\"{}\"",
            root().join("data/fashion-mnist-subset").display()
        ))
        .arg("--set")
        .arg(format!("train.out_dir=\"{}\"", dir.path().display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "reshaped: global batch 64 → 128: step 4 continues as step 2 (epoch 0, 256 samples \
             into it); optimizer state kept"
        ),
        "{stdout}"
    );
}
