//! `meshtrain launch`: runs a training job under `mpirun` and, when it fails — a worker died,
//! hung or lost its link, so the survivors ended with their collective's error and `mpirun`
//! exited non-zero — starts it again from its last checkpoint, with the same world or a
//! smaller one, up to `--max-restarts` times per job.
//!
//! Like torchrun's elastic agent, it learns which workers exist before every (re)start
//! instead of trusting the first answer: the hostfile (Open MPI's `host slots=N` lines) is
//! read again and each host's probe command run (`--probe 'ssh {host} true'`, `ip netns exec
//! {host} …`); hosts that fail it are left out of that attempt's hostfile. Without a
//! hostfile, `--np` is the one host's slots. The world is the largest the layout allows
//! within the slots: a multiple of the workers of one data-parallel replica (tp × pp × cp,
//! fixed) whose data-parallel size divides the global batch (which stays the same), and at
//! least `--min-workers` (default: the first attempt's world, i.e. no shrinking).
//!
//! A restart resumes from the checkpoint the job wrote since the launch began (whole or
//! sharded; both load into any layout, so a smaller world reshards on load), and the
//! checkpoint's sampler position makes the resumed run see the samples the uninterrupted run
//! would have. Unlike torchrun, workers are not replaced while the others wait: MPI jobs are
//! all or nothing, so the whole job restarts, which costs one job start-up and the steps
//! since the checkpoint.
//!
//! Only a failure a restart can mend is restarted: a rank that died, was killed, hung or lost
//! its link ([`classify_failure`] reads mpirun's exit status and the end of what it and the
//! ranks printed, passed through as it came). Anything else — mpirun refusing to start, a
//! program built without MPI, a check every rank fails, an error of the job's own — ends the
//! launch at once with its message. What can be checked here is checked before mpirun starts:
//! the job's arguments and config, and without a hostfile (every rank on this machine) its
//! device: `--gpus N` on a machine without the NVIDIA driver fails at once.

use crate::config::Config;
use crate::presets::Task;
use crate::train_cli::TrainArgs;
use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use meshtrain_parallel::DeviceCheck;
use meshtrain_tensor::Device;
use meshtrain_train::launch::GPUS_ENV;
use meshtrain_train::stop::{resume_command, without_option, LAUNCHED_ENV};
use meshtrain_train::StopRequest;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

#[derive(clap::Args, Debug)]
pub struct LaunchArgs {
    /// The most workers (processes) to start (default: the slots of the hostfile's live
    /// hosts, or --gpus; without either this is required).
    #[arg(long)]
    pub np: Option<usize>,
    /// Start N processes on this machine, one per GPU: rank r trains on cuda:r, the GPU its
    /// local rank picks (cuda:B+r with `--device cuda:B` among the job's arguments). Sets the
    /// job's device to cuda and --np to N; with --np a multiple of N, the ranks share the N
    /// GPUs in turn (rank r on cuda:r mod N, collectives staged through host memory: for
    /// tests, and models too small to fill a GPU). Checked before mpirun starts: without the
    /// NVIDIA driver, or with a layout this build cannot run on GPUs, it fails at once.
    #[arg(long, value_name = "N", conflicts_with = "hostfile")]
    pub gpus: Option<usize>,
    /// Open MPI hostfile (`HOST slots=N` per line), read again before every (re)start: a
    /// host removed from it, or failing --probe, is left out of the next attempt.
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// A shell command that tells whether a host is up (exit status 0 within 10 s), with
    /// `{host}` replaced by its name, run for every host of the hostfile before every
    /// (re)start: e.g. "ssh {host} true" or "ip netns exec {host} ping -c1 -W1 10.0.0.254".
    #[arg(long, requires = "hostfile")]
    pub probe: Option<String>,
    /// The fewest workers to restart with (default: the first attempt's world; a smaller
    /// world keeps tp × pp × cp and the global batch, and shrinks dp).
    #[arg(long)]
    pub min_workers: Option<usize>,
    /// Restarts allowed for the whole job (not per worker), for failures a restart can mend
    /// (a rank that died, hung or lost its link); then the last failure is an error. Any other
    /// failure (mpirun refusing to start, a program without MPI, a check the job fails) ends
    /// the launch at once.
    #[arg(long, default_value_t = 3)]
    pub max_restarts: u32,
    /// One more argument for mpirun, before the program (repeatable):
    /// --mpirun-arg=--oversubscribe --mpirun-arg=--mca --mpirun-arg=btl --mpirun-arg=self,tcp
    #[arg(long = "mpirun-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub mpirun_args: Vec<String>,
    /// The mpirun program.
    #[arg(long, default_value = "mpirun")]
    pub mpirun: String,
    /// Seconds without progress (the job's metrics.jsonl and checkpoints unchanged) after
    /// which the attempt counts as failed and mpirun is killed: after a host's link is cut,
    /// the survivors fail within their collective timeout but mpirun can wait forever for the
    /// unreachable host's daemon. Keep it above the time between two metrics records
    /// (train.log_every steps) and the job's start-up. 0: wait for mpirun however long.
    #[arg(long, default_value_t = 600.0)]
    pub stall_timeout: f64,
    /// The job: `meshtrain train`'s arguments, after `--`.
    #[arg(last = true, required = true)]
    pub train: Vec<String>,
}

/// A host of the hostfile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub name: String,
    pub slots: usize,
}

/// Reads an Open MPI hostfile: `HOST [slots=N] …` per line (`#` comments; no slots = 1).
pub fn read_hostfile(path: &Path) -> Result<Vec<Host>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading hostfile {}", path.display()))?;
    let mut hosts = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        let mut words = line.split_whitespace();
        let Some(name) = words.next() else { continue };
        let mut slots = 1;
        for word in words {
            if let Some(v) = word.strip_prefix("slots=") {
                slots = v.parse().with_context(|| {
                    format!(
                        "hostfile {} line {}: bad slots '{v}'",
                        path.display(),
                        n + 1
                    )
                })?;
            }
        }
        hosts.push(Host {
            name: name.to_string(),
            slots,
        });
    }
    Ok(hosts)
}

/// The hosts whose probe succeeds within 10 s (all of them without a probe), and a line on
/// each one left out.
fn live_hosts(hosts: Vec<Host>, probe: Option<&str>) -> (Vec<Host>, Vec<String>) {
    let Some(probe) = probe else {
        return (hosts, Vec::new());
    };
    let mut live = Vec::new();
    let mut dead = Vec::new();
    for host in hosts {
        let line = probe.replace("{host}", &host.name);
        let status = Command::new("timeout")
            .args(["10", "sh", "-c", &line])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        match status {
            Ok(s) if s.success() => live.push(host),
            Ok(s) => dead.push(format!("{} (probe `{line}`: {s})", host.name)),
            Err(e) => dead.push(format!("{} (probe `{line}` did not run: {e})", host.name)),
        }
    }
    (live, dead)
}

/// The largest world of at most `available` workers and at least `min` that `fits` accepts,
/// trying multiples of `per_replica` (the workers of one data-parallel replica) downwards.
pub fn choose_world(
    available: usize,
    min: usize,
    per_replica: usize,
    fits: impl Fn(usize) -> Result<()>,
) -> Result<usize> {
    let per_replica = per_replica.max(1);
    ensure!(
        min <= available,
        "--min-workers {min} cannot be satisfied: only {available} slot(s) available"
    );
    let mut refused = Vec::new();
    let mut world = available / per_replica * per_replica;
    while world >= min.max(1) && world > 0 {
        match fits(world) {
            Ok(()) => return Ok(world),
            Err(e) => refused.push(format!("{world}: {e:#}")),
        }
        world -= per_replica;
    }
    let why = if refused.is_empty() {
        String::new()
    } else {
        format!("; refused: {}", refused.join("; "))
    };
    bail!(
        "--min-workers {min} cannot be satisfied: {available} slot(s) available, and no world \
         of {min}..={available} workers is a multiple of the {per_replica} worker(s) one \
         data-parallel replica needs (tp × pp × cp) that the layout and the global batch \
         allow{why}"
    )
}

/// How one attempt ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    /// The job failed: how, and whether a restart can mend it.
    Failed(Failure),
    /// A signal asked the launcher to stop; it forwarded the request and the job saved a
    /// checkpoint and ended. Not a failure: nothing to restart.
    Stopped(i32),
}

/// Why an attempt failed, and whether a restart can mend it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// A rank died, was killed, hung or lost its link (a survivor's error names a collective
    /// that timed out or a peer killed or crashed, mpirun a rank ended by a signal, or the
    /// job stopped making progress): the job goes on from its checkpoint.
    Restartable(String),
    /// Anything else: mpirun refused to start, the program lacks MPI, every rank failed a
    /// check before training, an error of the job's own. A restart would fail the same way,
    /// so the launch ends with this.
    Final(String),
}

/// What mpirun or the ranks print when the job cannot run at all (matched in lowercase), and
/// what that means for the user: a restart would meet the same refusal.
const CANNOT_RUN: [(&str, &str); 5] = [
    (
        "attempt to run as root",
        "mpirun refused to run as root: set OMPI_ALLOW_RUN_AS_ROOT=1 and \
         OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (launch sets both when it runs as root and they are \
         unset), or pass --mpirun-arg=--allow-run-as-root",
    ),
    (
        "built without mpi support",
        "the meshtrain program was built without MPI support: rebuild it with `cargo build \
         --release -p meshtrain --features mpi`",
    ),
    (
        "not enough slots available",
        "mpirun found fewer slots than the workers asked for: lower --np, give a --hostfile \
         with more slots, or pass --mpirun-arg=--oversubscribe",
    ),
    (
        "unable to find the specified executable",
        "mpirun could not find the meshtrain program (on every host, it must be at the same \
         path)",
    ),
    (
        "unable to launch the specified application",
        "mpirun could not start the meshtrain program",
    ),
];

/// What a rank's error says when a peer died or hung (matched in lowercase): the failure
/// monitor's words for a rank whose connection closed without a clean exit, and a
/// collective's timeout (a stopped, stuck or cut-off rank).
const PEER_LOST: [&str; 2] = ["killed or crashed", "did not arrive"];

/// What mpirun says when a rank or a host was lost (matched in lowercase): a rank ended by a
/// signal (kill -9, the OOM killer, a crash), a host's daemon unreachable.
const RANK_LOST: [&str; 2] = ["exited on signal", "lost communication with"];

/// Whether a failed attempt is worth a restart, read from mpirun's `status` and `output`, the
/// end of what mpirun and the ranks printed; `ended` says how the attempt ended, for the
/// messages (`mpirun exited with exit status: 1`; or with 0 but no final checkpoint, which
/// Open MPI does when told not to abort on a rank's non-zero status). In this order:
///
/// 1. a refusal to run at all ([`CANNOT_RUN`]: as root, without MPI, too few slots, no
///    program) is final;
/// 2. mpirun ended by a signal is restartable (something killed it, not the job);
/// 3. the first error a rank printed (`Error: …` from a check, `error: rank R: …` from
///    training; the first is the cause, later ones its knock-on effects) decides: a peer lost
///    ([`PEER_LOST`]) is restartable, any other error final (a restart would meet it again);
/// 4. without an error line, mpirun's report of a lost rank or host ([`RANK_LOST`]: mpirun
///    may end the survivors before they print) is restartable, and anything else final.
///
pub fn classify_failure(ended: &str, status: ExitStatus, output: &str) -> Failure {
    let lines: Vec<&str> = output.lines().map(str::trim).collect();
    let lower = output.to_lowercase();
    if let Some((_, meaning)) = CANNOT_RUN.iter().find(|(text, _)| lower.contains(text)) {
        return Failure::Final(format!("{meaning} ({ended})"));
    }
    if std::os::unix::process::ExitStatusExt::signal(&status).is_some() {
        return Failure::Restartable(ended.to_string());
    }
    let said = |line: &str| clipped(line, 300);
    // `Error: …` (a check, printed by `meshtrain train`) or `error: rank R: …` (training),
    // as printed or tagged by mpirun (`[1,0]<stderr>:Error: …`).
    let first_error = lines.iter().find(|line| {
        let line = line.to_lowercase();
        line.starts_with("error: ") || line.contains(">:error: ") || line.contains("error: rank ")
    });
    if let Some(line) = first_error {
        let lower = line.to_lowercase();
        return if PEER_LOST.iter().any(|text| lower.contains(text)) {
            Failure::Restartable(format!("{ended}: a rank died or hung: {}", said(line)))
        } else {
            Failure::Final(format!(
                "{ended}: the job's own error, which a restart \
                 would meet again: {}",
                said(line)
            ))
        };
    }
    if let Some(line) = (lines.iter()).find(|line| {
        let line = line.to_lowercase();
        RANK_LOST.iter().any(|text| line.contains(text))
    }) {
        return Failure::Restartable(format!("{ended}: a rank or host was lost: {}", said(line)));
    }
    Failure::Final(format!(
        "{ended}, and nothing it or the ranks printed says that a rank \
         died or hung (the output above says why it failed)"
    ))
}

/// `text`, cut after `max` characters.
fn clipped(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

/// What the supervisor asks for each attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first start.
    pub number: u32,
    pub world: usize,
}

/// Runs attempts until one succeeds, fails in a way a restart cannot mend
/// ([`Failure::Final`]), or `max_restarts` restarts are used: before each, counts
/// the available slots (`slots`) and picks the world (`world_for(available, min)`, `min` =
/// `min_workers` or the first attempt's world). Generic over how slots are counted and how an
/// attempt runs, so the policy is tested without MPI. Returns the last attempt and how it
/// ended: [`Outcome::Succeeded`] or [`Outcome::Stopped`].
pub fn supervise(
    max_restarts: u32,
    min_workers: Option<usize>,
    mut slots: impl FnMut() -> Result<usize>,
    world_for: impl Fn(usize, usize) -> Result<usize>,
    mut attempt: impl FnMut(Attempt) -> Result<Outcome>,
    mut say: impl FnMut(String),
) -> Result<(Attempt, Outcome)> {
    let mut min = min_workers.unwrap_or(1);
    let mut failures: Vec<String> = Vec::new();
    for number in 1.. {
        let available = slots()?;
        let world = world_for(available, min).with_context(|| {
            if failures.is_empty() {
                "cannot start the job".to_string()
            } else {
                format!("cannot restart the job after: {}", failures.join("; "))
            }
        })?;
        if number == 1 && min_workers.is_none() {
            min = world;
        }
        let this = Attempt { number, world };
        let started = Instant::now();
        let outcome = attempt(this)?;
        let failed = |how: &str| {
            format!(
                "attempt {number} ({world} workers) failed after {:.1} s: {how}",
                started.elapsed().as_secs_f64()
            )
        };
        match outcome {
            done @ (Outcome::Succeeded | Outcome::Stopped(_)) => return Ok((this, done)),
            Outcome::Failed(Failure::Final(how)) => {
                let earlier = if failures.is_empty() {
                    String::new()
                } else {
                    format!(" (before it: {})", failures.join("; "))
                };
                bail!(
                    "{}; not restarted: only a rank that died or hung is worth a restart, and a \
                     restart would fail the same way{earlier}",
                    failed(&how)
                );
            }
            Outcome::Failed(Failure::Restartable(how)) => {
                let line = failed(&how);
                let restarts = number - 1;
                failures.push(line.clone());
                ensure!(
                    restarts < max_restarts,
                    "the job failed {number} time(s) and --max-restarts {max_restarts} is used \
                     up: {}",
                    failures.join("; ")
                );
                say(format!(
                    "{line}; restart {} of at most {max_restarts}",
                    restarts + 1
                ));
            }
        }
    }
    unreachable!("the attempts loop returns")
}

/// The job's newest checkpoint written at or after `since` (a whole file or a sharded
/// directory's index), and its step.
pub fn newest_checkpoint(out_dir: &Path, since: SystemTime) -> Option<(PathBuf, u64)> {
    let candidates = [
        (out_dir.join("checkpoint.safetensors"), None),
        (
            out_dir.join("checkpoint"),
            Some(
                out_dir
                    .join("checkpoint")
                    .join(meshtrain_train::sharded::INDEX_FILE),
            ),
        ),
    ];
    candidates
        .into_iter()
        .filter_map(|(path, index)| {
            let modified = std::fs::metadata(index.as_ref().unwrap_or(&path))
                .and_then(|m| m.modified())
                .ok()?;
            (modified >= since).then_some((path, modified))
        })
        .max_by_key(|(_, modified)| *modified)
        .and_then(|(path, _)| {
            let step = checkpoint_step(&path)?;
            Some((path, step))
        })
}

/// The step a checkpoint records (its metadata only; `None` if unreadable).
fn checkpoint_step(path: &Path) -> Option<u64> {
    if meshtrain_train::sharded::is_sharded(path) {
        return meshtrain_train::sharded::ShardedCheckpoint::open(path)
            .ok()
            .map(|c| c.index.step);
    }
    let header = meshtrain_train::checkpoint::read_safetensors_header(path, "checkpoint").ok()?;
    header.entries.get("__metadata__")?["step"]
        .as_str()?
        .parse()
        .ok()
}

/// The newest modification time of the job's progress files: its metrics and checkpoints.
fn last_progress(out_dir: &Path) -> Option<SystemTime> {
    let checkpoint = out_dir.join("checkpoint");
    [
        out_dir.join("metrics.jsonl"),
        out_dir.join("checkpoint.safetensors"),
        checkpoint.join(meshtrain_train::sharded::INDEX_FILE),
    ]
    .iter()
    .filter_map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
    .max()
}

/// Waits for `child` (mpirun) to exit, or kills it (SIGTERM, then SIGKILL 5 s later) once the
/// job has shown no progress for `stall_timeout` seconds: `Err` says so. When `stop` is
/// requested, sends mpirun SIGUSR1 once, which Open MPI forwards to every rank (SIGINT or
/// SIGTERM would make it kill the ranks a second later, before their checkpoint), and
/// goes on waiting.
fn wait_making_progress(
    child: &mut std::process::Child,
    out_dir: &Path,
    stall_timeout: f64,
    stop: &StopRequest,
) -> Result<std::result::Result<std::process::ExitStatus, String>> {
    let started = SystemTime::now();
    let mut forwarded = false;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Ok(status));
        }
        if !forwarded && stop.requested().is_some() {
            forwarded = true;
            let _ = Command::new("kill")
                .args(["-USR1", &child.id().to_string()])
                .status();
        }
        // A second Ctrl-C: the job ends now, not after its checkpoint (mpirun kills the
        // ranks on SIGTERM), and the launcher with it.
        if stop.insisted() {
            let pid = child.id().to_string();
            let _ = Command::new("kill").args(["-TERM", &pid]).status();
            for _ in 0..100 {
                if let Some(status) = child.try_wait()? {
                    return Ok(Ok(status));
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            // mpirun did not end within 10 s: its whole process group (the ranks it
            // started locally included) is killed.
            let _ = Command::new("kill")
                .args(["-KILL", &format!("-{pid}")])
                .status();
            return Ok(Ok(child.wait()?));
        }
        let since = last_progress(out_dir)
            .filter(|t| *t > started)
            .unwrap_or(started);
        let idle = since.elapsed().map_or(0.0, |d| d.as_secs_f64());
        // A stopping job is writing its checkpoint: not a stall to restart from.
        if stall_timeout > 0.0 && idle > stall_timeout && !forwarded {
            let pid = child.id().to_string();
            let _ = Command::new("kill").args(["-TERM", &pid]).status();
            for _ in 0..50 {
                if child.try_wait()?.is_some() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            if child.try_wait()?.is_none() {
                child.kill()?;
                child.wait()?;
            }
            return Ok(Err(format!(
                "no progress for {idle:.0} s (--stall-timeout {stall_timeout}): the job's \
                 metrics and checkpoints stopped changing, so mpirun was killed"
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// `meshtrain launch`.
pub fn run(args: &LaunchArgs) -> Result<std::process::ExitCode> {
    let launched = SystemTime::now();
    let stop = StopRequest::on_signals_supervising()?;
    check_mpirun(&args.mpirun)?;
    let np = processes_to_start(args.np, args.gpus)?;
    /// `meshtrain train`'s command line, to read the job's arguments.
    #[derive(Parser)]
    struct TrainCommand {
        #[command(flatten)]
        args: TrainArgs,
    }
    let mut train = TrainCommand::try_parse_from(
        std::iter::once("meshtrain train".to_string()).chain(args.train.iter().cloned()),
    )
    .map_err(|e| anyhow::anyhow!("the job's arguments (after --): {e}"))?
    .args;
    let mut job_args = args.train.clone();
    if args.gpus.is_some() {
        train_on_gpus(&mut train, &mut job_args)?;
    }
    let cfg = Config::load(&train.config, &train.overrides())?;
    // The workers of one data-parallel replica, fixed; launch sets dp.
    let layout = cfg.layout()?;
    let per_replica = layout.tp * layout.pp * layout.cp;
    // The device before the data loads and before mpirun starts. Without a hostfile every rank
    // runs on this machine, so what it lacks (the driver, the GPUs) no rank will have, and what
    // this build cannot run on GPUs (several workers) no rank can: one error now, rather than
    // one per rank after a start.
    if let (Some(np), None) = (np, &args.hostfile) {
        let mut first_world = layout.clone();
        first_world.dp = (np / per_replica).max(1);
        cfg.check_device(&first_world, DeviceCheck::WithoutOpening)?;
        // --gpus N: the job's last GPU too (`no CUDA GPU number 7: the driver sees 2 …`).
        if let (Some(gpus), Device::Cuda(first)) = (args.gpus, cfg.train.device) {
            let mut last = cfg.clone();
            last.train.device = Device::Cuda(first + gpus - 1);
            last.check_device(&first_world, DeviceCheck::WithoutOpening)?;
        }
    }
    let run_as_root = run_as_root_env(effective_user_id(), |name| std::env::var(name).ok());
    if !run_as_root.is_empty() {
        let settings: Vec<String> = (run_as_root.iter())
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        eprintln!(
            "launch: running as root, so mpirun gets {} (Open MPI refuses to run as root \
             otherwise)",
            settings.join(" ")
        );
    }
    let task = Task::load(&cfg)?;
    let out_dir = cfg.train.out_dir.clone();
    // The job at a data-parallel size: as the `--dp` the attempts pass.
    let with_dp = |dp: usize| {
        let mut at = train.clone();
        at.dp = Some(dp);
        at.overrides()
    };
    // Whether `world` workers can run the job: dp = world / (tp × pp × cp), checked as a run
    // of that world checks itself.
    let fits = |world: usize| -> Result<()> {
        let dp = world / per_replica;
        let job = Config::load(&train.config, &with_dp(dp))?.job(&task)?;
        ensure!(
            job.layout.dp == dp,
            "the job's layout fixes dp = {}; launch sets dp from the workers it starts: leave \
             dp out of --layout",
            job.layout.dp
        );
        job.check(world).map(|_| ())
    };
    let world_for = |available: usize, min: usize| choose_world(available, min, per_replica, fits);
    let stop_step = cfg.job(&task)?.stop_step();
    let live_hostfile = out_dir.join("launch-hostfile");
    let slots = || -> Result<usize> {
        let Some(path) = &args.hostfile else {
            return np.context(
                "give --np (the most workers), --gpus (one per GPU of this machine) or \
                 --hostfile (the hosts and slots)",
            );
        };
        let (live, dead) = live_hosts(read_hostfile(path)?, args.probe.as_deref());
        for d in &dead {
            eprintln!("launch: host {d} left out");
        }
        ensure!(
            !live.is_empty(),
            "no host of {} is up{}",
            path.display(),
            if dead.is_empty() {
                String::new()
            } else {
                format!(": {}", dead.join(", "))
            }
        );
        std::fs::create_dir_all(&out_dir)
            .with_context(|| format!("creating {}", out_dir.display()))?;
        let text: String = (live.iter())
            .map(|h| format!("{} slots={}\n", h.name, h.slots))
            .collect();
        std::fs::write(&live_hostfile, text)
            .with_context(|| format!("writing {}", live_hostfile.display()))?;
        let total: usize = live.iter().map(|h| h.slots).sum();
        Ok(np.map_or(total, |np| np.min(total)))
    };
    let program = std::env::current_exe().context("locating the meshtrain program")?;
    // Launch decides dp; restarts decide what to resume from.
    let first_args = without_option(&job_args, "--dp");
    let restart_args = without_option(&first_args, "--resume");
    let attempt = |a: Attempt| -> Result<Outcome> {
        let resume = if a.number > 1 {
            newest_checkpoint(&out_dir, launched)
        } else {
            None
        };
        let dp = a.world / per_replica;
        eprintln!(
            "launch: attempt {}: {} workers (dp {dp} × {per_replica} per replica), {}",
            a.number,
            a.world,
            match &resume {
                Some((path, step)) => format!("resuming from {} at step {step}", path.display()),
                None if a.number > 1 => "from the start (no checkpoint yet)".into(),
                None => "as given".into(),
            }
        );
        let mut command = Command::new(&args.mpirun);
        // Its own process group: a Ctrl-C in the terminal reaches the launcher only, which
        // asks the ranks to stop gracefully; mpirun would kill them.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        command.env(LAUNCHED_ENV, "1").args(["-x", LAUNCHED_ENV]);
        if let Some(gpus) = args.gpus {
            // The ranks of this machine share its GPUs in turn when there are more of them.
            command
                .env(GPUS_ENV, gpus.to_string())
                .args(["-x", GPUS_ENV]);
        }
        command.envs(run_as_root.iter().copied());
        // Passed through as it comes, its end kept: what mpirun and the ranks said decides
        // whether a failure is worth a restart.
        command
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        command.arg("-np").arg(a.world.to_string());
        if args.hostfile.is_some() {
            command.arg("--hostfile").arg(&live_hostfile);
        }
        command.args(&args.mpirun_args).arg(&program).arg("train");
        command.args(if a.number > 1 {
            &restart_args
        } else {
            &first_args
        });
        command.arg("--dp").arg(dp.to_string());
        if let Some((path, _)) = &resume {
            command.arg("--resume").arg(path);
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {}", args.mpirun))?;
        let relay = Relay::start(&mut child);
        let waited = wait_making_progress(&mut child, &out_dir, args.stall_timeout, &stop)?;
        let output = relay.finish();
        let status = match waited {
            Ok(status) => status,
            Err(stalled) => return Ok(Outcome::Failed(Failure::Restartable(stalled))),
        };
        if let Some(signal) = stop.requested() {
            return Ok(Outcome::Stopped(signal));
        }
        if !status.success() {
            let ended = format!("{} exited with {status}", args.mpirun);
            return Ok(Outcome::Failed(classify_failure(&ended, status, &output)));
        }
        // mpirun's status alone is not proof (with some MCA settings it exits 0 after a
        // rank's MPI_Abort, or after every rank failed its checks): the job ends by writing
        // its final checkpoint, and what the ranks printed tells whether a restart can mend
        // its absence.
        Ok(match newest_checkpoint(&out_dir, launched) {
            Some((_, step)) if step == stop_step => Outcome::Succeeded,
            found => {
                let ended = format!(
                    "{} exited with {status}, but the job's newest checkpoint is {} of the \
                     {stop_step} steps",
                    args.mpirun,
                    found.map_or("none".into(), |(_, step)| format!("at step {step}"))
                );
                Outcome::Failed(classify_failure(&ended, status, &output))
            }
        })
    };
    let (done, outcome) = supervise(
        args.max_restarts,
        args.min_workers,
        slots,
        world_for,
        attempt,
        |line| eprintln!("launch: {line}"),
    )?;
    if let Outcome::Stopped(signal) = outcome {
        let name = meshtrain_train::stop::signal_name(signal);
        match newest_checkpoint(&out_dir, launched) {
            Some((path, step)) => {
                eprintln!(
                    "launch: stopped by {name} on attempt {}: the job saved its checkpoint at \
                     step {step} ({})",
                    done.number,
                    path.display()
                );
                let args: Vec<String> = std::env::args().collect();
                eprintln!("launch: resume with: {}", resume_command(&args, &path));
            }
            None => eprintln!(
                "launch: stopped by {name} on attempt {}: the job saved no checkpoint since the \
                 launch began",
                done.number
            ),
        }
        let status = meshtrain_train::stop::exit_status(signal);
        return Ok(std::process::ExitCode::from(status as u8));
    }
    eprintln!(
        "launch: the job finished on attempt {} with {} workers",
        done.number, done.world
    );
    Ok(std::process::ExitCode::SUCCESS)
}

/// The most processes to start: `--np`, or one per GPU with `--gpus` (or a multiple of it:
/// ranks sharing the GPUs).
fn processes_to_start(np: Option<usize>, gpus: Option<usize>) -> Result<Option<usize>> {
    match (np, gpus) {
        (_, Some(0)) => bail!("--gpus 0: give the number of GPUs to train on, one process each"),
        (Some(np), Some(gpus)) if np < gpus || !np.is_multiple_of(gpus) => bail!(
            "--np {np} and --gpus {gpus}: --gpus starts one process per GPU, or shares the GPUs \
             evenly among more; leave --np out or give a multiple of {gpus}"
        ),
        (np, gpus) => Ok(np.or(gpus)),
    }
}

/// The job on GPUs, for `--gpus`: its device is cuda, each rank on the GPU of its local rank
/// (`--device cuda` is added to its arguments when they name no device; `--device cuda:B`
/// stays, B the first GPU). `--device cpu` contradicts it.
fn train_on_gpus(train: &mut TrainArgs, job_args: &mut Vec<String>) -> Result<()> {
    match train.device.as_deref().map(str::parse::<Device>) {
        None => {
            train.device = Some("cuda".into());
            job_args.extend(["--device".to_string(), "cuda".to_string()]);
        }
        Some(Ok(Device::Cuda(_))) => {}
        Some(Ok(Device::Cpu)) => bail!(
            "--gpus trains on GPUs, but the job's arguments say --device cpu: leave --device \
             out, or give cuda:N (the first GPU of the job)"
        ),
        Some(Err(e)) => bail!("the job's --device: {e}"),
    }
    Ok(())
}

/// Open MPI's two switches that let `mpirun` run as root, which it refuses otherwise (in a
/// container, users often are root); both must be 1.
const RUN_AS_ROOT_ENV: [&str; 2] = ["OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"];

/// What mpirun's environment gets so that it runs under a launcher whose effective user id is
/// `euid`: as root, each of Open MPI's switches ([`RUN_AS_ROOT_ENV`]) set to 1 unless the user
/// set it (`env` looks a variable up); nothing for anyone else.
pub fn run_as_root_env(
    euid: u32,
    env: impl Fn(&str) -> Option<String>,
) -> Vec<(&'static str, &'static str)> {
    if euid != 0 {
        return Vec::new();
    }
    (RUN_AS_ROOT_ENV.into_iter())
        .filter(|name| env(name).is_none())
        .map(|name| (name, "1"))
        .collect()
}

fn effective_user_id() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// How much of the end of mpirun's output is kept to classify a failure: the ranks' errors
/// and mpirun's report come last.
const KEPT_OUTPUT_BYTES: usize = 64 * 1024;

/// mpirun's stdout and stderr passed through to this process's as they come (a thread each),
/// the end of both kept for [`classify_failure`].
struct Relay {
    kept: Arc<Mutex<Vec<u8>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Relay {
    fn start(child: &mut std::process::Child) -> Relay {
        let kept = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        if let Some(from) = child.stdout.take() {
            let kept = kept.clone();
            threads.push(std::thread::spawn(move || {
                pass_through(from, std::io::stdout(), &kept)
            }));
        }
        if let Some(from) = child.stderr.take() {
            let kept = kept.clone();
            threads.push(std::thread::spawn(move || {
                pass_through(from, std::io::stderr(), &kept)
            }));
        }
        Relay { kept, threads }
    }

    /// The kept output, once both streams have ended, or 2 s after mpirun exited: a rank left
    /// on an unreachable host may hold them open.
    fn finish(self) -> String {
        let deadline = Instant::now() + std::time::Duration::from_secs(2);
        while self.threads.iter().any(|t| !t.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        String::from_utf8_lossy(&kept).into_owned()
    }
}

/// Copies `from` to `to` until it ends, appending to `kept` (its last
/// [`KEPT_OUTPUT_BYTES`]). A closed `to` does not stop the reading: mpirun must not block on
/// a full pipe.
fn pass_through(mut from: impl Read, mut to: impl Write, kept: &Mutex<Vec<u8>>) {
    let mut buf = [0u8; 8192];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let _ = to.write_all(&buf[..n]).and_then(|()| to.flush());
        let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.extend_from_slice(&buf[..n]);
        let over = kept.len().saturating_sub(KEPT_OUTPUT_BYTES);
        kept.drain(..over);
    }
}

/// Refuses to start without the mpirun program, naming it and where it comes from (rather
/// than "No such file or directory" from the first attempt).
fn check_mpirun(mpirun: &str) -> Result<()> {
    let found = if mpirun.contains('/') {
        Path::new(mpirun).is_file()
    } else {
        std::env::var_os("PATH")
            .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(mpirun).is_file()))
    };
    ensure!(
        found,
        "meshtrain launch runs the job under mpirun, and '{mpirun}' was not found{}: install \
         Open MPI (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev; Fedora: dnf \
         install openmpi-devel) and build meshtrain with --features mpi, or give the program \
         with --mpirun PATH",
        if mpirun.contains('/') {
            String::new()
        } else {
            " on the PATH".to_string()
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    fn even_batch(world: usize) -> Result<()> {
        ensure!(
            12 % world == 0,
            "global batch 12 is not divisible by {world}"
        );
        Ok(())
    }

    #[test]
    fn the_world_shrinks_to_what_the_layout_allows() {
        assert_eq!(choose_world(4, 1, 1, even_batch).unwrap(), 4);
        // 5 slots: 5 does not divide the batch, 4 does.
        assert_eq!(choose_world(5, 1, 1, even_batch).unwrap(), 4);
        // tp × pp = 2 per replica: 7 slots → 6.
        assert_eq!(choose_world(7, 2, 2, even_batch).unwrap(), 6);
        let err = format!("{:#}", choose_world(3, 4, 1, even_batch).unwrap_err());
        assert!(
            err.contains("--min-workers 4 cannot be satisfied: only 3 slot(s)"),
            "{err}"
        );
        let err = format!("{:#}", choose_world(5, 5, 1, even_batch).unwrap_err());
        assert!(
            err.contains("5: global batch 12 is not divisible by 5"),
            "{err}"
        );
    }

    #[test]
    fn restarts_are_counted_per_job_and_end_with_the_failures() {
        let runs = RefCell::new(Vec::new());
        let err = supervise(
            2,
            None,
            || Ok(4),
            |a, min| choose_world(a, min, 1, even_batch),
            |a| {
                runs.borrow_mut().push(a);
                Ok(Outcome::Failed(Failure::Restartable(format!(
                    "exit {}",
                    a.number
                ))))
            },
            |_| {},
        )
        .unwrap_err();
        let err = format!("{err:#}");
        assert_eq!(runs.borrow().len(), 3, "1 start + 2 restarts");
        assert!(
            err.contains("failed 3 time(s) and --max-restarts 2 is used up")
                && err.contains("attempt 3 (4 workers) failed")
                && err.contains("exit 3"),
            "{err}"
        );
    }

    #[test]
    fn a_restart_takes_fewer_workers_down_to_min_workers() {
        let available = RefCell::new(vec![4, 3, 1]);
        let mut said = Vec::new();
        let mut worlds = Vec::new();
        let outcome = supervise(
            5,
            Some(2),
            || Ok(available.borrow_mut().remove(0)),
            |a, min| choose_world(a, min, 1, even_batch),
            |a| {
                worlds.push(a.world);
                Ok(if a.number == 2 {
                    Outcome::Succeeded
                } else {
                    Outcome::Failed(Failure::Restartable("killed".into()))
                })
            },
            |line| said.push(line),
        )
        .unwrap();
        assert_eq!((outcome.0.number, worlds), (2, vec![4, 3]));
        assert!(said[0].contains("restart 1 of at most 5"), "{said:?}");
        // Down to one slot with --min-workers 2: a clear error, not a smaller job.
        let available = RefCell::new(vec![4, 1]);
        let err = supervise(
            5,
            Some(2),
            || Ok(available.borrow_mut().remove(0)),
            |a, min| choose_world(a, min, 1, even_batch),
            |_| Ok(Outcome::Failed(Failure::Restartable("killed".into()))),
            |_| {},
        )
        .unwrap_err();
        let err = format!("{err:#}");
        assert!(
            err.contains("cannot restart the job after: attempt 1 (4 workers) failed")
                && err.contains("--min-workers 2 cannot be satisfied: only 1 slot(s)"),
            "{err}"
        );
    }

    #[test]
    fn without_min_workers_the_first_world_is_kept() {
        let available = RefCell::new(vec![4, 3]);
        let err = supervise(
            5,
            None,
            || Ok(available.borrow_mut().remove(0)),
            |a, min| choose_world(a, min, 1, even_batch),
            |_| Ok(Outcome::Failed(Failure::Restartable("killed".into()))),
            |_| {},
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("--min-workers 4 cannot be satisfied"),
            "{err:#}"
        );
    }

    #[test]
    fn a_failure_a_restart_cannot_mend_ends_the_launch_at_once() {
        let runs = RefCell::new(0);
        let err = supervise(
            3,
            None,
            || Ok(2),
            |a, min| choose_world(a, min, 1, even_batch),
            |a| {
                *runs.borrow_mut() += 1;
                Ok(Outcome::Failed(if a.number == 1 {
                    Failure::Restartable("rank 1 killed".into())
                } else {
                    Failure::Final("mpirun refused to run as root".into())
                }))
            },
            |_| {},
        )
        .unwrap_err();
        let err = format!("{err:#}");
        assert_eq!(*runs.borrow(), 2, "no restart after the final failure");
        assert!(
            err.starts_with("attempt 2 (2 workers) failed after")
                && err.contains("mpirun refused to run as root; not restarted: only a rank")
                && err.contains("(before it: attempt 1 (2 workers) failed after")
                && err.contains("rank 1 killed"),
            "{err}"
        );
    }

    /// What mpirun and the ranks print, as they print it, and what launch makes of it.
    #[test]
    fn only_a_rank_that_died_or_hung_is_worth_a_restart() {
        use std::os::unix::process::ExitStatusExt;
        let exit_1 = ExitStatus::from_raw(1 << 8);
        let ended = "mpirun exited with exit status: 1";
        let classify = |output: &str| classify_failure(ended, exit_1, output);
        let restartable = |output: &str| match classify(output) {
            Failure::Restartable(how) => how,
            Failure::Final(how) => panic!("final: {how}\n{output}"),
        };
        let fin = |output: &str| match classify(output) {
            Failure::Final(how) => how,
            Failure::Restartable(how) => panic!("restartable: {how}\n{output}"),
        };
        // Open MPI 4.1's refusal, as root without the switches.
        let root = fin(
            "--------------------------------------------------------------------------\n\
             mpirun has detected an attempt to run as root.\n\n\
             Running as root is *strongly* discouraged as any mistake (e.g., in\n\
             You can override this protection by adding the --allow-run-as-root option\n\
             to the cmd line or by setting two environment variables in the following way:\n",
        );
        assert!(
            root.starts_with("mpirun refused to run as root: set OMPI_ALLOW_RUN_AS_ROOT=1")
                && root.ends_with("(mpirun exited with exit status: 1)"),
            "{root}"
        );
        // A program without MPI: every rank says so.
        let no_mpi = fin(
            "Error: started under mpirun, but this meshtrain was built without MPI \
             support: rebuild with `cargo build --release -p meshtrain --features mpi`\n\
             Error: started under mpirun, but this meshtrain was built without MPI support: …\n\
             Primary job  terminated normally, but 1 process returned\n\
             a non-zero exit code. Per user-direction, the job has been aborted.\n",
        );
        assert!(no_mpi.contains("built without MPI support"), "{no_mpi}");
        let slots = fin("There are not enough slots available in the system to satisfy the 4\n");
        assert!(slots.contains("--oversubscribe"), "{slots}");
        // A check every rank fails before training: printed once (`Error: …`), all exit 1.
        let check = fin(
            "meshtrain: Shakespeare bytes (1042409 train / 115824 validation)\n\
             Error: the output directory /proc/nope (train.out_dir) is not writable\n\
             mpirun detected that one or more processes exited with non-zero status, thus \
             causing\nthe job to be terminated. The first process to do so was:\n",
        );
        assert!(
            check.contains(
                ": the job's own error, which a restart would meet again: \
                 Error: the output directory /proc/nope"
            ),
            "{check}"
        );
        // kill -9 of rank 2: the survivors name it.
        let killed = restartable(
            "step 25 | loss 2.1\n\
             error: rank 0: training failed: all_reduce #52 on group 'world' cannot complete: \
             rank(s) [2] (global) stopped: rank 2 died (connection lost without a clean exit: \
             killed or crashed); last seen in all_reduce #52; aborting the MPI job\n\
             error: rank 1: training failed: all_reduce #52 …\n",
        );
        assert!(
            killed.starts_with(
                "mpirun exited with exit status: 1: a rank died or hung: error: rank 0"
            ),
            "{killed}"
        );
        // SIGSTOP of rank 1: the survivors time out; tagged output too.
        restartable(
            "[1,0]<stderr>:error: rank 0: training failed: all_reduce #52 on group \
             'world' timed out after 3s: rank(s) [1] (global) did not arrive (rank 1 has sent \
             nothing for 3.0 s (stopped, stuck outside the program, or cut off from the \
             network)); aborting the MPI job\n",
        );
        // mpirun ended the job before any survivor printed.
        let signal = restartable(
            "mpirun noticed that process rank 2 with PID 0 on node n0 \
             exited on signal 9 (Killed).\n",
        );
        assert!(
            signal.contains("a rank or host was lost: mpirun noticed"),
            "{signal}"
        );
        restartable("ORTE has lost communication with a remote daemon.\n");
        // A rank's own error, and a peer's knock-on error naming it: final.
        fin(
            "error: rank 1: training failed: the loss is NaN at step 12; aborting the MPI job\n\
             error: rank 0: training failed: all_reduce #80 on group 'world' cannot complete: \
             rank(s) [1] (global) stopped: rank 1 failed: the loss is NaN at step 12\n\
             mpirun noticed that process rank 0 with PID 0 on node n0 exited on signal 15.\n",
        );
        // Nothing to go on.
        let silent = fin("");
        assert!(
            silent.contains("nothing it or the ranks printed"),
            "{silent}"
        );
        // mpirun itself killed (not by launch's stall timeout, which says so itself).
        // Told not to abort on a rank's non-zero status, mpirun exits 0 after every rank failed
        // its checks, or after a rank's MPI_Abort: no final checkpoint, and the ranks' errors
        // decide.
        let exit_0 = ExitStatus::from_raw(0);
        let no_checkpoint = "mpirun exited with exit status: 0, but the job's newest checkpoint \
                             is none of the 100 steps";
        let check = classify_failure(
            no_checkpoint,
            exit_0,
            "Error: cannot create the output directory /proc/nope (train.out_dir)\n",
        );
        assert!(matches!(check, Failure::Final(_)), "{check:?}");
        let aborted = classify_failure(
            no_checkpoint,
            exit_0,
            "error: rank 0: all_reduce #56 on group 'dp[0,1,2,3]' cannot complete: rank(s) [2] \
             (global) stopped: rank 2 died (connection lost without a clean exit: killed or \
             crashed); aborting the MPI job\n",
        );
        assert!(matches!(aborted, Failure::Restartable(_)), "{aborted:?}");
        let killed = "mpirun exited with signal: 9 (SIGKILL)";
        assert_eq!(
            classify_failure(killed, ExitStatus::from_raw(9), ""),
            Failure::Restartable(killed.into())
        );
    }

    #[test]
    fn as_root_mpirun_gets_open_mpis_switches_unless_the_user_set_them() {
        let unset = |_: &str| None;
        assert_eq!(
            run_as_root_env(0, unset),
            [
                ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
                ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            ]
        );
        assert!(run_as_root_env(1000, unset).is_empty());
        let user_set = |name: &str| (name == "OMPI_ALLOW_RUN_AS_ROOT").then(|| "0".to_string());
        assert_eq!(
            run_as_root_env(0, user_set),
            [("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")]
        );
    }

    #[test]
    fn gpus_sets_the_processes_and_the_device() {
        assert_eq!(processes_to_start(None, Some(4)).unwrap(), Some(4));
        assert_eq!(processes_to_start(Some(4), Some(4)).unwrap(), Some(4));
        assert_eq!(processes_to_start(Some(3), None).unwrap(), Some(3));
        assert!(processes_to_start(Some(2), Some(4)).is_err());
        // Ranks sharing GPUs evenly.
        assert_eq!(processes_to_start(Some(4), Some(2)).unwrap(), Some(4));
        let e = processes_to_start(Some(3), Some(2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("give a multiple of 2"), "{e}");
        assert!(processes_to_start(None, Some(0)).is_err());
        let parse = |args: &[&str]| {
            #[derive(Parser)]
            struct Wrapper {
                #[command(flatten)]
                args: TrainArgs,
            }
            Wrapper::parse_from(std::iter::once("train").chain(args.iter().copied())).args
        };
        let mut train = parse(&["--config", "configs/gpt.toml"]);
        let mut args: Vec<String> = vec!["--config".into(), "configs/gpt.toml".into()];
        train_on_gpus(&mut train, &mut args).unwrap();
        assert_eq!(train.device.as_deref(), Some("cuda"));
        assert_eq!(args[2..], ["--device", "cuda"]);
        let mut train = parse(&["--device", "cuda:2"]);
        let mut args = vec!["--device".to_string(), "cuda:2".to_string()];
        train_on_gpus(&mut train, &mut args).unwrap();
        assert_eq!(args, ["--device", "cuda:2"], "the first GPU kept");
        let mut train = parse(&["--device", "cpu"]);
        let err = train_on_gpus(&mut train, &mut Vec::new()).unwrap_err();
        assert!(
            err.to_string()
                .contains("the job's arguments say --device cpu"),
            "{err}"
        );
    }

    #[test]
    fn a_job_that_stops_making_progress_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let started = Instant::now();
        let outcome =
            wait_making_progress(&mut child, dir.path(), 0.5, &StopRequest::new()).unwrap();
        assert!(
            outcome.unwrap_err().contains("no progress for"),
            "the stalled job ended by itself"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn hostfiles_and_resume_arguments() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hosts");
        std::fs::write(
            &path,
            "# cluster\nnode0 slots=2\nnode1 slots=3 max_slots=4\nnode2\n",
        )
        .unwrap();
        let hosts = read_hostfile(&path).unwrap();
        assert_eq!(
            hosts.iter().map(|h| h.slots).collect::<Vec<_>>(),
            vec![2, 3, 1]
        );
        let (live, dead) = live_hosts(hosts, Some("test {host} != node1"));
        assert_eq!(live.len(), 2);
        assert!(dead[0].starts_with("node1"), "{dead:?}");
        let args: Vec<String> = [
            "--config",
            "a.toml",
            "--resume",
            "x",
            "--resume=y",
            "--dp",
            "2",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            without_option(&args, "--resume"),
            ["--config", "a.toml", "--dp", "2"]
        );
    }
}
