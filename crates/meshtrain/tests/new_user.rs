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
    #[cfg(feature = "cuda")]
    let present = meshtrain_tensor::cuda::probe::require_driver().is_ok();
    #[cfg(not(feature = "cuda"))]
    let present = false;
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

/// A stand-in for mpirun in `dir`: records each start (with the root switches of its
/// environment) in `dir/starts`, prints `says` on stderr as mpirun or the ranks would, and
/// exits 1.
fn fake_mpirun(dir: &std::path::Path, says: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("mpirun");
    let script = format!(
        "#!/bin/sh\n\
         echo \"${{OMPI_ALLOW_RUN_AS_ROOT-unset}} ${{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM-unset}}\" \
         >>\"$(dirname \"$0\")/starts\"\n\
         cat >&2 <<'EOF'\n{says}\nEOF\n\
         exit 1\n"
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// The starts `fake_mpirun` recorded: one line each, its root switches.
fn starts(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("starts"))
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

/// `meshtrain launch` with `options`, the tiny GPT job writing into `dir/runs/gpt` with
/// `job_extra` added, and `env` (Open MPI's root switches removed unless given there):
/// (success, stderr).
fn launch(
    dir: &std::path::Path,
    options: &[&str],
    job_extra: &[&str],
    env: &[(&str, &str)],
) -> (bool, String) {
    let job = tiny_gpt_command(&dir.join("runs").join("gpt"), &[], job_extra);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshtrain"))
        .current_dir(common::root())
        .arg("launch")
        .args(options)
        .arg("--")
        .args(&job[1..])
        .env_remove("OMPI_ALLOW_RUN_AS_ROOT")
        .env_remove("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `launch --gpus 2` (and `--np 2` of a `--device cuda` job) without the driver: the same one
/// line, before mpirun starts (never started, so nothing to restart).
#[test]
fn launch_on_gpus_without_the_driver_fails_before_mpirun() {
    if has_driver() {
        return;
    }
    for (options, job_extra) in [
        (["--gpus", "2"], &[][..]),
        (["--np", "2"], &["--device", "cuda"]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mpirun = fake_mpirun(dir.path(), "");
        let mut options = options.to_vec();
        options.extend(["--mpirun", mpirun.to_str().unwrap()]);
        let (ok, stderr) = launch(dir.path(), &options, job_extra, &[]);
        assert!(!ok);
        assert_eq!(stderr, NO_DRIVER, "{options:?}");
        assert!(starts(dir.path()).is_empty(), "mpirun was started");
        assert!(!dir.path().join("runs").exists());
    }
}

/// Only a rank that died or hung is restarted (here up to `--max-restarts 1`): mpirun's
/// refusal to run as root, a program without MPI, or a check every rank fails ends the launch
/// after one start with what it means; what mpirun and the ranks printed passes through.
#[test]
fn launch_restarts_only_a_job_whose_rank_died_or_hung() {
    let cases = [
        (
            "mpirun has detected an attempt to run as root.\nYou can override this protection \
             by adding the --allow-run-as-root option",
            1,
            "not restarted",
            "mpirun refused to run as root: set OMPI_ALLOW_RUN_AS_ROOT=1",
        ),
        (
            "Error: started under mpirun, but this meshtrain was built without MPI support: \
             rebuild with `cargo build --release -p meshtrain --features mpi`",
            1,
            "not restarted",
            "the meshtrain program was built without MPI support",
        ),
        (
            "Error: the output directory /proc/nope (train.out_dir) is not writable",
            1,
            "not restarted",
            ": the job's own error, which a restart would meet again: Error: the output",
        ),
        (
            "mpirun noticed that process rank 1 with PID 77 on node n0 exited on signal 9 \
             (Killed).",
            2,
            "failed 2 time(s) and --max-restarts 1 is used up",
            "a rank or host was lost: mpirun noticed that process rank 1",
        ),
        (
            "error: rank 0: training failed: all_reduce #3 on group 'world' timed out after \
             3s: rank(s) [1] (global) did not arrive; aborting the MPI job",
            2,
            "failed 2 time(s) and --max-restarts 1 is used up",
            "a rank died or hung: error: rank 0: training failed: all_reduce #3",
        ),
    ];
    for (says, expected_starts, ending, meaning) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mpirun = fake_mpirun(dir.path(), says);
        let (ok, stderr) = launch(
            dir.path(),
            &[
                "--np",
                "2",
                "--max-restarts",
                "1",
                "--mpirun",
                mpirun.to_str().unwrap(),
            ],
            &[],
            &[],
        );
        assert!(!ok);
        assert_eq!(
            starts(dir.path()).len(),
            expected_starts,
            "{says}\n{stderr}"
        );
        let error = stderr.lines().last().unwrap();
        assert!(
            error.starts_with("Error: ") && error.contains(ending) && error.contains(meaning),
            "{says}\n{stderr}"
        );
        assert!(stderr.contains(says), "passed through: {stderr}");
    }
}

/// As root (a container, CI), launch lets mpirun run: Open MPI's two switches go into its
/// environment, said once, but a value the user set is kept. Not as root, nothing is added.
#[test]
fn launch_lets_mpirun_run_as_root_unless_told_otherwise() {
    let id = std::process::Command::new("id").arg("-u").output().unwrap();
    let root = String::from_utf8_lossy(&id.stdout).trim() == "0";
    let said = "launch: running as root, so mpirun gets OMPI_ALLOW_RUN_AS_ROOT=1 \
                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses to run as root otherwise)";
    // The root switches mpirun started with, and what launch said: the job fails a check
    // (every start would), so launch starts it once.
    let started_with = |env: &[(&str, &str)]| {
        let dir = tempfile::tempdir().unwrap();
        let mpirun = fake_mpirun(dir.path(), "Error: a check every rank fails");
        let mpirun = mpirun.to_str().unwrap();
        let (_, stderr) = launch(dir.path(), &["--np", "2", "--mpirun", mpirun], &[], env);
        (starts(dir.path()), stderr)
    };
    let (switches, stderr) = started_with(&[]);
    if root {
        assert_eq!(switches, ["1 1"], "{stderr}");
        assert_eq!(stderr.matches(said).count(), 1, "{stderr}");
    } else {
        assert_eq!(switches, ["unset unset"], "{stderr}");
        assert!(!stderr.contains("running as root"), "{stderr}");
    }
    let (switches, stderr) = started_with(&[("OMPI_ALLOW_RUN_AS_ROOT", "0")]);
    assert_eq!(switches, [if root { "0 1" } else { "0 unset" }], "{stderr}");
}

// What a new user tripped over next (issue 40).

/// The help says what meshtrain trains today, and every bench subcommand is named.
#[test]
fn help_texts_are_current() {
    let (_, top, _) = meshtrain(&["--help"]);
    assert!(top.contains("Llama") && top.contains("GPUs"), "{top}");
    assert!(
        [
            "models",
            "collectives",
            "scaling",
            "calibrate",
            "pipeline",
            "tensor",
            "precision"
        ]
        .iter()
        .chain(&["zero", "context", "gpu"])
        .all(|b| top.contains(b)),
        "{top}"
    );
    let (_, generate, _) = meshtrain(&["generate", "--help"]);
    assert!(generate.contains("Llama"), "{generate}");
    let (_, train, _) = meshtrain(&["train", "--help"]);
    assert!(!train.contains("GPT only"), "{train}");
    // tokenize reads more than text files, export writes more than weights of two families.
    let (_, tokenize, _) = meshtrain(&["tokenize", "--help"]);
    let about = tokenize.split("Usage:").next().unwrap();
    for what in ["JSON lines", "Parquet", "--tokenizer"] {
        assert!(about.contains(what), "{what}: {about}");
    }
    let (_, export, _) = meshtrain(&["export", "--help"]);
    let about = export.split("Usage:").next().unwrap();
    for what in ["tokenizer.json", "Mistral", "Qwen2", "Qwen3", "SmolLM"] {
        assert!(about.contains(what), "{what}: {about}");
    }
    if cfg!(feature = "cuda") {
        let (_, gpu, _) = meshtrain(&["bench", "gpu", "--help"]);
        let about = gpu.split("Usage:").next().unwrap();
        for what in ["Llama", "LeNet", "layouts"] {
            assert!(about.contains(what), "{what}: {about}");
        }
    }
}

/// `checkpoint info` takes a whole checkpoint and a run directory, not only a sharded one;
/// a value at fault from the command line is said to be the command line's; `plan`'s run
/// line pastes (it names the config).
#[test]
fn checkpoints_configs_and_plans_say_what_a_user_needs() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let (ok, _, stderr) = meshtrain(&tiny_gpt_command(&run, &["train.max_steps=2"], &[]));
    assert!(ok, "{stderr}");
    for path in [run.clone(), run.join("checkpoint.safetensors")] {
        let (ok, stdout, stderr) =
            meshtrain(&["checkpoint".as_ref(), "info".as_ref(), path.as_os_str()]);
        assert!(
            ok && stdout.contains("step 2") && stdout.contains("kind = \"gpt\""),
            "{stdout}{stderr}"
        );
    }
    let (ok, _, stderr) = meshtrain(&[
        "train",
        "--config",
        "configs/gpt.toml",
        "--set",
        "train.batch_size=0",
    ]);
    assert!(
        !ok && stderr.contains("with the command line's train.batch_size=0"),
        "{stderr}"
    );
    let (ok, stdout, _) = meshtrain(&[
        "plan",
        "--model",
        "gpt",
        "--cluster",
        "cpu",
        "--gpus",
        "2",
        "--global-batch",
        "32",
        "--explain",
    ]);
    assert!(
        ok && stdout.contains("meshtrain train --config configs/gpt.toml --layout"),
        "{stdout}"
    );
}
