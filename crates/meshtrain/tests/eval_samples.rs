//! The training log of a language model shows a sample of text at each evaluation
//! (`train.sample_tokens`), drawn on rank 0 from the whole model whatever the layout: the
//! last one is exactly what `meshtrain generate` draws from the final checkpoint with the
//! same seed.

mod common;

use common::{meshtrain, tiny_gpt_command};
use std::path::Path;

/// `meshtrain train` on the tiny GPT (width 32, 2 layers, 4 heads, context 16, batch 8):
/// 6 steps, evaluating at steps 3 and 6, seed 5, writing into `out`, then `extra`.
fn train(out: &Path, extra: &[&str]) -> String {
    let sets = [
        "model.heads=4",
        "train.steps=6",
        "train.eval_every=3",
        "train.eval_batches=1",
        "train.seed=5",
        "schedule.warmup_steps=1",
    ];
    let args = tiny_gpt_command(out, &sets, extra);
    let (ok, stdout, stderr) = meshtrain(&args);
    assert!(ok, "{extra:?}: {stderr}\n{stdout}");
    stdout
}

fn sample_lines(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|l| l.starts_with("sample: "))
        .collect()
}

/// Trains with 8-token samples on `layout`'s flags: one sample line right after each of the
/// two evaluations' lines, the last equal to what `generate` draws from the checkpoint
/// with the run's seed (the sampler's defaults, the prompt a newline).
fn samples_at_evaluation(layout: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let mut extra = vec!["--set", "train.sample_tokens=8"];
    extra.extend(layout);
    let stdout = train(dir.path(), &extra);
    let lines: Vec<&str> = stdout.lines().collect();
    let samples = sample_lines(&stdout);
    assert_eq!(samples.len(), 2, "{layout:?}: {stdout}");
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("sample: ") {
            assert!(
                i > 0 && lines[i - 1].starts_with("eval step "),
                "{layout:?}: a sample follows its evaluation:\n{stdout}"
            );
        }
    }
    let ckpt = dir.path().join("checkpoint.safetensors");
    let (ok, generated, stderr) = meshtrain(&[
        "generate",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--max-tokens",
        "8",
        "--seed",
        "5",
    ]);
    assert!(ok, "{stderr}");
    // The prompt (a newline), the 8 tokens, a newline.
    let text = generated
        .strip_prefix('\n')
        .and_then(|t| t.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("{generated:?}"));
    assert_eq!(
        samples[1],
        format!("sample: {text:?}"),
        "{layout:?}: the last sample against generate"
    );
}

#[test]
fn one_worker_prints_a_sample_at_each_evaluation() {
    samples_at_evaluation(&[]);
}

#[test]
fn tensor_parallel_workers_gather_the_model_for_the_sample() {
    samples_at_evaluation(&["--tp", "2"]);
}

#[test]
fn pipeline_stages_gather_the_model_for_the_sample() {
    samples_at_evaluation(&["--pp", "2", "--micro-batches", "2"]);
}

#[test]
fn zero_3_replicas_gather_the_model_for_the_sample() {
    samples_at_evaluation(&[
        "--dp",
        "2",
        "--set",
        "parallel.zero=3",
        "--set",
        "train.checkpoint_format=\"whole\"",
    ]);
}

#[test]
fn samples_are_on_by_default_and_off_at_zero() {
    let dir = tempfile::tempdir().unwrap();
    let stdout = train(dir.path(), &[]);
    let samples = sample_lines(&stdout);
    assert_eq!(samples.len(), 2, "{stdout}");
    let off = train(dir.path(), &["--set", "train.sample_tokens=0"]);
    assert!(sample_lines(&off).is_empty(), "{off}");
    // An image model has no text to sample: refused before any data loads.
    let (ok, _, stderr) = meshtrain(&[
        "train",
        "--config",
        "configs/lenet.toml",
        "--set",
        "train.sample_tokens=8",
    ]);
    assert!(!ok && stderr.contains("train.sample_tokens"), "{stderr}");
}
