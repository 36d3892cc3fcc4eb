//! What a new user tripped over (issue 28), each checked through the command they ran.

mod common;

use common::meshtrain;

/// `--data-dir` is a flag, as the run's first line, the README and docs/data.md say.
#[test]
fn data_dir_is_a_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = format!("train.out_dir=\"{}\"", dir.path().display());
    let (ok, stdout, stderr) = meshtrain(&[
        "train",
        "--data-dir",
        "data/fashion-mnist-subset",
        "--dp",
        "1",
        "--set",
        "train.max_steps=1",
        "--set",
        "data.train_limit=512",
        "--set",
        "data.test_limit=256",
        "--set",
        &out_dir,
    ]);
    assert!(ok, "{stderr}");
    let first = stdout.lines().next().unwrap();
    assert!(
        first.contains("--data-dir data/fashion-mnist-subset"),
        "{first}"
    );
}

/// A GPT run on batch 1 with a warm-up longer than the run: the warm-up is pointed out, the
/// first step is printed at once, the epoch moves, rates keep their digits, and the loss
/// has one unit throughout.
#[test]
fn gpt_logs_say_what_they_mean() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = format!("train.out_dir=\"{}\"", dir.path().display());
    let (ok, stdout, stderr) = meshtrain(&[
        "train",
        "--config",
        "configs/gpt.toml",
        "--set",
        "train.steps=4",
        "--set",
        "train.batch_size=1",
        "--set",
        "train.log_every=2",
        "--set",
        "train.eval_every=4",
        "--set",
        "train.eval_batches=1",
        "--set",
        "model.dim=32",
        "--set",
        "model.layers=1",
        "--set",
        "model.heads=2",
        "--set",
        "model.seq=1024",
        "--set",
        &out_dir,
    ]);
    assert!(ok, "{stderr}");
    // configs/gpt.toml warms up for 100 steps.
    assert!(
        stdout.contains(
            "note: schedule.warmup_steps=100 but the run trains 4 steps: the learning rate \
             never leaves warm-up (it reaches 4% of schedule.lr at the last step)"
        ),
        "{stdout}"
    );
    let steps: Vec<&str> = stdout.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(steps.len(), 3, "steps 1 (the first), 2 and 4: {stdout}");
    assert!(steps[0].starts_with("step      1 "), "{stdout}");
    // 4 × 1 × 1024 tokens of Shakespeare's 1.04 M: 0.004 epochs, not 0.00.
    assert!(steps[2].contains("epoch  0.004"), "{}", steps[2]);
    assert!(!stdout.contains(" 0 samples/s"), "{stdout}");
    assert!(steps[2].contains("tokens/s)"), "{}", steps[2]);
    assert!(!stdout.contains("nats/char"), "{stdout}");
    assert!(stdout.contains("nats/token"), "{stdout}");
}

/// `meshtrain launch` without Open MPI names mpirun and the package, before any work.
#[test]
fn launch_without_mpirun_names_it() {
    let (ok, _, stderr) = meshtrain(&[
        "launch",
        "--np",
        "2",
        "--mpirun",
        "mpirun-that-is-not-installed",
        "--",
        "--config",
        "configs/lenet.toml",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "'mpirun-that-is-not-installed' was not found on the PATH: install Open MPI \
             (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev"
        ),
        "{stderr}"
    );
}
