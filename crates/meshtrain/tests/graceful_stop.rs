//! A run is never lost: a signal makes every worker finish the step in flight, agree on the
//! same last step, save a checkpoint and exit 130/143; resuming it ends bit-identical to the
//! run nobody stopped. Timed checkpoints fall due on rank 0's clock for everyone.
//! (Under `mpirun` and `meshtrain launch`: scripts/stop-test.sh.)

mod common;

use common::{job, root, tiny_gpt_config};
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_train::stop::{SIGINT, SIGTERM};
use meshtrain_train::{RunOptions, StopRequest};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `meshtrain train` on the tiny GPT over 2 workers, long enough that it is mid-run when
/// signalled, logging every step into `out`.
fn start_tiny_gpt(out: &Path, extra: &[&str]) -> Child {
    let mut args = vec![
        "--set",
        "train.steps=100000",
        "--set",
        "train.eval_every=100000",
        "--set",
        "train.log_every=1",
    ];
    args.extend(extra);
    Command::new(env!("CARGO_BIN_EXE_meshtrain"))
        .current_dir(root())
        .args(common::tiny_gpt_args(out, &args))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting meshtrain")
}

/// Waits until the run in `out` has logged `steps` training steps.
fn wait_for_steps(out: &Path, steps: usize, child: &mut Child) {
    let started = Instant::now();
    loop {
        let logged = std::fs::read_to_string(out.join("metrics.jsonl"))
            .map(|t| t.lines().filter(|l| l.contains("\"train\"")).count())
            .unwrap_or(0);
        if logged >= steps {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended before step {steps}: {status}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no step {steps} within 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, name: &str) {
    let sent = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// The step a whole or sharded checkpoint records.
fn checkpoint_step(path: &Path) -> u64 {
    if meshtrain_train::sharded::is_sharded(path) {
        return meshtrain_train::sharded::ShardedCheckpoint::open(path)
            .unwrap()
            .index
            .step;
    }
    let header = meshtrain_train::checkpoint::read_safetensors_header(path, "checkpoint").unwrap();
    header.entries["__metadata__"]["step"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// Every tensor of a checkpoint (parameters and optimizer state), consolidated if sharded.
fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let whole = if meshtrain_train::sharded::is_sharded(path) {
        let out = path.with_extension("whole.safetensors");
        meshtrain_train::sharded::consolidate(path, &out, &|_, _| {}).unwrap();
        out
    } else {
        path.to_path_buf()
    };
    let bytes = std::fs::read(&whole).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut all: Vec<(String, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

/// Signals a 2-worker run mid-training with `sig`, checks that it exits `128 + sig` after
/// saving a checkpoint and saying how to resume, then resumes it two more steps and compares
/// with a run that went there without stopping.
fn stop_and_resume(sig_name: &str, status: i32, extra: &[&str]) {
    let stopped = tempfile::tempdir().unwrap();
    let mut child = start_tiny_gpt(stopped.path(), extra);
    wait_for_steps(stopped.path(), 2, &mut child);
    signal(&child, sig_name);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(status), "{stdout}\n{stderr}");
    let checkpoint = common::written_checkpoint(stopped.path());
    let step = checkpoint_step(&checkpoint);
    assert!(
        stdout.contains(&format!(
            "stopped by SIG{sig_name} after step {step}: checkpoint saved"
        )),
        "{stdout}"
    );
    let resume_line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("resume with: "))
        .unwrap_or_else(|| panic!("no resume command: {stdout}"));
    assert!(
        resume_line.ends_with(&format!("--resume {}", checkpoint.display())),
        "{resume_line}"
    );
    // The metrics end where the checkpoint is.
    let metrics = std::fs::read_to_string(stopped.path().join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"stopped\""), "{metrics}");

    let until = format!("train.max_steps={}", step + 2);
    let resumed = {
        let mut args: Vec<&str> = extra.to_vec();
        let resume = checkpoint.display().to_string();
        args.extend(["--set", &until, "--resume", &resume]);
        let out = start_tiny_gpt(stopped.path(), &args)
            .wait_with_output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        tensors(&common::written_checkpoint(stopped.path()))
    };
    let straight = tempfile::tempdir().unwrap();
    let mut args: Vec<&str> = extra.to_vec();
    args.extend(["--set", &until]);
    let out = start_tiny_gpt(straight.path(), &args)
        .wait_with_output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let uninterrupted = tensors(&common::written_checkpoint(straight.path()));
    assert_eq!(resumed.len(), uninterrupted.len());
    for ((name, a), (_, b)) in resumed.iter().zip(&uninterrupted) {
        assert!(a == b, "{name} differs after resuming the stopped run");
    }
}

#[test]
fn ctrl_c_stops_two_workers_at_one_step_and_the_resumed_run_is_bit_identical() {
    stop_and_resume("INT", 130, &[]);
}

#[test]
fn sigterm_stops_a_sharded_run_on_every_rank_and_it_resumes_bit_identically() {
    // ZeRO-1 writes sharded checkpoints: every worker its pieces, at the same step.
    stop_and_resume("TERM", 143, &["--set", "parallel.zero=1"]);
}

#[test]
fn a_second_ctrl_c_aborts_at_once() {
    let dir = tempfile::tempdir().unwrap();
    // A wide model: a step and a checkpoint take long enough for the second signal to land
    // before the graceful stop ends.
    let mut child = start_tiny_gpt(
        dir.path(),
        &[
            "--set",
            "model.dim=256",
            "--set",
            "model.layers=6",
            "--set",
            "model.heads=4",
            "--set",
            "model.seq=128",
            "--set",
            "train.batch_size=16",
        ],
    );
    wait_for_steps(dir.path(), 1, &mut child);
    signal(&child, "INT");
    std::thread::sleep(Duration::from_millis(5));
    signal(&child, "INT");
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("stopped by"),
        "the second Ctrl-C waited for the graceful stop"
    );
}

/// One worker alone sees the request (a signal delivered to one process of an MPI job):
/// both stop after the same step, pipeline stages included.
#[test]
fn workers_agree_on_the_last_step_when_one_alone_is_asked() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(
        dir.path(),
        30,
        &["parallel.pp=2", "parallel.micro_batches=2"],
    );
    let job = job(&cfg);
    let summaries = ThreadsWorld::run(2, CommConfig::default(), move |world| {
        let rank = world.rank();
        let mut trainer = job.trainer(world, None).map_err(|e| format!("{e:#}"))?;
        if rank == 1 {
            trainer.stop.request(SIGTERM);
        }
        trainer.run(false).map_err(|e| format!("{e:#}"))
    })
    .unwrap();
    for s in &summaries {
        let stopped = s.stopped.as_ref().expect("every worker stopped");
        assert_eq!((stopped.signal, stopped.step, s.steps), (SIGTERM, 1, 1));
    }
    assert_eq!(
        checkpoint_step(&dir.path().join("checkpoint.safetensors")),
        1
    );
}

/// A stop asked through the library (no signal): the run ends with `Summary::stopped`.
#[test]
fn a_library_caller_can_stop_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(dir.path(), 30, &["parallel.dp=2"]);
    let stop = StopRequest::new();
    stop.request(SIGINT);
    let options = RunOptions {
        stop: Some(stop),
        ..RunOptions::default()
    };
    let summary = (*job(&cfg)).clone().run(&options).unwrap();
    let stopped = summary.stopped.unwrap();
    assert_eq!((stopped.signal, stopped.step), (SIGINT, 1));
    assert_eq!(
        stopped.checkpoint,
        PathBuf::from(dir.path()).join("checkpoint.safetensors")
    );
}

/// `checkpoint.every_minutes` saves without being asked, on rank 0's clock for all.
#[test]
fn checkpoints_fall_due_by_time() {
    let dir = tempfile::tempdir().unwrap();
    // 60 ns: due after every step.
    let cfg = tiny_gpt_config(
        dir.path(),
        6,
        &["parallel.dp=2", "checkpoint.every_minutes=0.000000001"],
    );
    let summary = (*job(&cfg)).clone().run(&RunOptions::default()).unwrap();
    assert_eq!(summary.breakdown.checkpoints, 6, "5 timed + the final one");
    let cfg = tiny_gpt_config(dir.path(), 6, &["checkpoint.every_minutes=0"]);
    let summary = (*job(&cfg)).clone().run(&RunOptions::default()).unwrap();
    assert_eq!(summary.breakdown.checkpoints, 1, "only the final one");
}
