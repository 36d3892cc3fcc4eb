//! What a new user tripped over (issues 28 and 36), each checked through the command they
//! ran.

mod common;

use common::{meshtrain, tiny_gpt_command};

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

// What a new user tripped over next (issue 36).

/// Whether this machine has the NVIDIA driver. The tests of what a machine without it says
/// skip themselves there, saying so.
fn has_driver() -> bool {
    let present = meshtrain_tensor::cuda::probe::require_driver().is_ok();
    if present {
        eprintln!("skipped: this machine has the NVIDIA driver (libcuda.so.1)");
    }
    present
}

/// All that a machine without the driver answers `--device cuda` with: one line.
const NO_DRIVER: &str = "Error: --device cuda needs the NVIDIA driver (libcuda.so.1), which \
                         could not be loaded: install the NVIDIA driver for your GPU (nvidia-smi \
                         must list it) or make its folder visible on LD_LIBRARY_PATH; without a \
                         GPU, train with --device cpu\n";

/// `--device cuda`, `cuda:7`, and `cuda` over two workers, without the driver: the one line
/// naming it (before the layout the GPU could not run either), said before the data loads
/// (no `meshtrain:` or `data:` line) and before the output directory is made.
#[test]
fn a_missing_driver_is_said_at_once_in_one_line() {
    if has_driver() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("runs").join("gpt");
    for extra in [
        &["--device", "cuda"][..],
        &["--device", "cuda:7"],
        &["--device", "cuda", "--dp", "2"],
    ] {
        let (ok, stdout, stderr) = meshtrain(&tiny_gpt_command(&out, &[], extra));
        assert!(!ok, "{extra:?}");
        assert_eq!(stderr, NO_DRIVER, "{extra:?}");
        assert_eq!(stdout, "", "nothing loaded or printed first: {extra:?}");
        assert!(!dir.path().join("runs").exists(), "{extra:?}");
    }
}

/// A start that fails leaves no new run directory behind: a checkpoint to resume or start
/// from that is not there (checked before the directory is made), and a layout over the
/// memory limit (found after: the directory this run made is removed again, its parent too;
/// the error says "failed" once). A directory that existed before stays.
#[test]
fn a_failed_start_leaves_no_new_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("runs").join("gpt");
    let missing = dir.path().join("missing.safetensors");
    let missing = missing.to_str().unwrap();
    let cases = [
        (
            vec!["--resume", missing],
            "Error: cannot resume: checkpoint ",
        ),
        (
            vec!["--init-from", missing],
            "Error: cannot take the initial weights (--init-from): checkpoint ",
        ),
        (
            vec!["--set", "train.memory_limit_mb=0.01"],
            "Error: training failed: setting up the parallel layout: layout dp=1",
        ),
    ];
    for (extra, says) in &cases {
        let (ok, _, stderr) = meshtrain(&tiny_gpt_command(&out, &[], extra));
        assert!(!ok, "{extra:?}");
        assert!(stderr.starts_with(says), "{extra:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(!stderr.contains("failed: failed"), "{stderr}");
        assert!(!dir.path().join("runs").exists(), "{extra:?}");
    }
    std::fs::create_dir_all(&out).unwrap();
    let (ok, _, _) = meshtrain(&tiny_gpt_command(&out, &[], &cases[2].0));
    assert!(!ok);
    assert!(
        out.is_dir(),
        "the directory that existed before the run stays"
    );
}
