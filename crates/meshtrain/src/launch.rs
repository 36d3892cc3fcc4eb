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

use crate::config::Config;
use crate::presets::Task;
use crate::train_cli::TrainArgs;
use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use meshtrain_train::stop::{resume_command, without_option, LAUNCHED_ENV};
use meshtrain_train::StopRequest;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Instant, SystemTime};

#[derive(clap::Args, Debug)]
pub struct LaunchArgs {
    /// The most workers (processes) to start (default: the slots of the hostfile's live
    /// hosts; without a hostfile this is required).
    #[arg(long)]
    pub np: Option<usize>,
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
    /// Restarts allowed for the whole job (not per worker); then the last failure is an
    /// error.
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
    /// The job failed: how (mpirun's exit status).
    Failed(String),
    /// A signal asked the launcher to stop; it forwarded the request and the job saved a
    /// checkpoint and ended. Not a failure: nothing to restart.
    Stopped(i32),
}

/// What the supervisor asks for each attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first start.
    pub number: u32,
    pub world: usize,
}

/// Runs attempts until one succeeds or `max_restarts` restarts are used: before each, counts
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
        match attempt(this)? {
            done @ (Outcome::Succeeded | Outcome::Stopped(_)) => return Ok((this, done)),
            Outcome::Failed(how) => {
                let line = format!(
                    "attempt {number} ({world} workers) failed after {:.1} s: {how}",
                    started.elapsed().as_secs_f64()
                );
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
    /// `meshtrain train`'s command line, to read the job's arguments.
    #[derive(Parser)]
    struct TrainCommand {
        #[command(flatten)]
        args: TrainArgs,
    }
    let train = TrainCommand::try_parse_from(
        std::iter::once("meshtrain train".to_string()).chain(args.train.iter().cloned()),
    )
    .map_err(|e| anyhow::anyhow!("the job's arguments (after --): {e}"))?
    .args;
    let cfg = Config::load(&train.config, &train.overrides())?;
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
    let layout = cfg.layout()?;
    let per_replica = layout.tp * layout.pp * layout.cp;
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
            return args
                .np
                .context("give --np (the most workers) or --hostfile (the hosts and slots)");
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
        Ok(args.np.map_or(total, |np| np.min(total)))
    };
    let program = std::env::current_exe().context("locating the meshtrain program")?;
    // Launch decides dp; restarts decide what to resume from.
    let first_args = without_option(&args.train, "--dp");
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
        let status = match wait_making_progress(&mut child, &out_dir, args.stall_timeout, &stop)? {
            Ok(status) => status,
            Err(stalled) => return Ok(Outcome::Failed(stalled)),
        };
        if let Some(signal) = stop.requested() {
            return Ok(Outcome::Stopped(signal));
        }
        if !status.success() {
            return Ok(Outcome::Failed(format!(
                "{} exited with {status}",
                args.mpirun
            )));
        }
        // mpirun's status alone is not proof (with some MCA settings it exits 0 after a
        // rank's MPI_Abort): the job ends by writing its final checkpoint.
        Ok(match newest_checkpoint(&out_dir, launched) {
            Some((_, step)) if step == stop_step => Outcome::Succeeded,
            found => Outcome::Failed(format!(
                "{} exited with {status}, but the job's newest checkpoint is {} of the {stop_step} \
                 steps",
                args.mpirun,
                found.map_or("none".into(), |(_, step)| format!("at step {step}"))
            )),
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
                Ok(Outcome::Failed(format!("exit {}", a.number)))
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
                    Outcome::Failed("killed".into())
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
            |_| Ok(Outcome::Failed("killed".into())),
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
            |_| Ok(Outcome::Failed("killed".into())),
            |_| {},
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("--min-workers 4 cannot be satisfied"),
            "{err:#}"
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
