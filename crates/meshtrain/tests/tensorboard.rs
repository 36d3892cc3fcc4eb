//! `--tensorboard DIR`: the metrics of metrics.jsonl as TensorBoard event files, read back by
//! meshtrain's reader here and by TensorBoard's own (`scripts/check_tensorboard.py`, with the
//! `tensorboard` Python package: `MESHTRAIN_TENSORBOARD_PATH` names where pip put it, and
//! `MESHTRAIN_REQUIRE_TENSORBOARD=1` fails instead of skipping without it).

mod common;

use common::root;
use meshtrain_train::tensorboard::read_scalars;
use std::process::Command;

#[test]
fn tensorboard_events_carry_the_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("tb");
    let out_dir = format!("train.out_dir=\"{}\"", dir.path().display());
    let tb_arg = events.display().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_meshtrain"))
        .current_dir(root())
        .args([
            "train",
            "--config",
            "configs/gpt.toml",
            "--dp",
            "2",
            "--tensorboard",
            &tb_arg,
        ])
        .args(common::TINY_GPT.iter().flat_map(|o| ["--set", o]))
        .args(["--set", "train.batch_size=8", "--set", "train.steps=6"])
        .args(["--set", "train.log_every=2", "--set", "train.eval_every=3"])
        .args(["--set", "train.eval_batches=2", "--set", "train.threads=2"])
        .args(["--set", &out_dir])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let files: Vec<_> = std::fs::read_dir(&events)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let file_name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(file_name.starts_with("events.out.tfevents."), "{file_name}");

    // Every train and eval number of metrics.jsonl, at its step.
    let scalars = read_scalars(&files[0]).unwrap();
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let mut checked = 0;
    for line in metrics.lines() {
        let record: serde_json::Value = serde_json::from_str(line).unwrap();
        let kind = record["kind"].as_str().unwrap();
        if kind == "summary" {
            continue;
        }
        let step = record["step"].as_u64().unwrap();
        for field in [
            "loss",
            "lr",
            "grad_norm",
            "samples_per_s",
            "accuracy",
            "perplexity",
        ] {
            let Some(value) = record[field].as_f64() else {
                continue;
            };
            let tag = format!("{kind}/{field}");
            let logged = scalars
                .iter()
                .find(|(s, t, _)| *s == step && *t == tag)
                .unwrap_or_else(|| panic!("no {tag} at step {step}"));
            assert_eq!(logged.2, value as f32, "{tag} at step {step}");
            checked += 1;
        }
    }
    // 3 train records × 4 fields + 2 evaluations × loss and perplexity.
    assert_eq!(checked, 3 * 4 + 2 * 2, "{metrics}");
    assert!(scalars
        .iter()
        .any(|(_, t, _)| t.starts_with("summary/memory/")));

    // TensorBoard's own reader, when the package is there.
    let mut python = Command::new("python3");
    if let Some(path) = std::env::var_os("MESHTRAIN_TENSORBOARD_PATH") {
        python.env("PYTHONPATH", path);
    }
    let has_tensorboard = python
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_tensorboard {
        assert!(
            std::env::var_os("MESHTRAIN_REQUIRE_TENSORBOARD").is_none(),
            "MESHTRAIN_REQUIRE_TENSORBOARD is set but python3 cannot import tensorboard"
        );
        eprintln!("skipped TensorBoard's reader: python3 cannot import tensorboard");
        return;
    }
    let mut check = Command::new("python3");
    if let Some(path) = std::env::var_os("MESHTRAIN_TENSORBOARD_PATH") {
        check.env("PYTHONPATH", path);
    }
    let out = check
        .arg(root().join("scripts/check_tensorboard.py"))
        .arg(dir.path())
        .arg(&events)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("match metrics.jsonl"), "{said}");
}
