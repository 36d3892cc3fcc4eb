//! Starting a job: `layout.world_size()` worker threads of this process (the threads
//! backend), or one worker per process under `mpirun` (feature `mpi`).

use crate::checkpoint::Restore;
use crate::job::Job;
use crate::metrics::Summary;
use crate::stop::StopRequest;
use crate::trainer::{threads_per_worker, Trainer};
use anyhow::{anyhow, bail, ensure, Context, Result};
use meshtrain_comm::{CommConfig, ProcessGroup, ThreadsWorld, WorkerFailure, WorldError};
use meshtrain_nn::{Model, ParamStore};
use meshtrain_parallel::{check_device, DeviceCheck};
use meshtrain_tensor::Device;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The error of a rank whose fault was printed already (under `mpirun`, a check that failed
/// on several ranks is printed once, by the first): the command exits non-zero without a
/// message.
#[derive(Debug)]
pub struct ReportedElsewhere;

impl std::fmt::Display for ReportedElsewhere {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the job failed its checks (one rank printed why)")
    }
}

/// Prints an error for the user: its message, then its causes, never a backtrace (what
/// `meshtrain` prints for every error).
pub fn print_error(e: &anyhow::Error) {
    eprintln!("Error: {e}");
    let causes: Vec<String> = e.chain().skip(1).map(|c| c.to_string()).collect();
    if !causes.is_empty() {
        eprintln!("\nCaused by:");
        for cause in causes {
            eprintln!("    {cause}");
        }
    }
}

impl std::error::Error for ReportedElsewhere {}

/// What a run needs besides its job.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Continue from this checkpoint (same model; every worker reads it).
    pub resume: Option<PathBuf>,
    /// With `resume`: the global batch may differ from the checkpoint's; the optimizer
    /// state is kept and the data stream continues at the same sample position
    /// ([`Trainer::resume_reshaped`]).
    pub reshape: bool,
    /// Start from this checkpoint's weights with a fresh optimizer at step 0 (fine-tuning;
    /// the checkpoint may come from another model configuration with matching tensors).
    pub init_from: Option<PathBuf>,
    /// Show the progress bar (rank 0 only).
    pub show_progress: bool,
    /// Print the run's description and notices (rank 0 only).
    pub verbose: bool,
    /// Stop gracefully when this is set: the workers finish the step in flight, agree on the
    /// last step and save a checkpoint ([`crate::stop`]). [`StopRequest::on_signals`] ties it
    /// to SIGINT, SIGTERM and SIGUSR1, as `meshtrain train` does.
    pub stop: Option<StopRequest>,
    /// The command line that started this run (program first): a stopped run prints it,
    /// with `--resume` at its checkpoint, as the command that resumes it.
    pub command_line: Option<Vec<String>>,
    /// Called on world rank 0 after each evaluation with the whole model ([`EvalHook`]):
    /// `meshtrain train` sets one that prints a sample of text.
    pub after_eval: Option<EvalHook>,
}

/// What to do with the whole model after each evaluation, on world rank 0: called with the
/// step, the unsplit model and its parameters (gathered from every worker, whatever the
/// layout), it returns a line to print under the evaluation's (or `None`). An error is
/// printed and training goes on: a failed sample must not cost the run.
///
/// Why a hook: the trainer is model-agnostic, while what to do with a language model's
/// weights (decode text with its tokenizer) belongs to the program that knows the model.
/// Setting one costs every worker a gather of the whole model state at each evaluation (as a
/// whole-file checkpoint does; no gather when one worker holds the whole model).
#[derive(Clone)]
pub struct EvalHook(pub Arc<EvalFn>);

/// The function an [`EvalHook`] calls: (step, whole model, its parameters) → a line to print.
pub type EvalFn = dyn Fn(u64, &Model, &ParamStore) -> Result<Option<String>> + Send + Sync;

impl EvalHook {
    pub fn new(
        f: impl Fn(u64, &Model, &ParamStore) -> Result<Option<String>> + Send + Sync + 'static,
    ) -> Self {
        EvalHook(Arc::new(f))
    }
}

impl std::fmt::Debug for EvalHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EvalHook(..)")
    }
}

/// The environment variable that overrides a job's collective timeout, in seconds (for
/// `mpirun` runs, where every rank must agree without a command-line flag per rank).
pub const TIMEOUT_ENV: &str = "MESHTRAIN_TIMEOUT_S";

/// Whether this process was started by `mpirun`/`mpiexec` (OpenMPI or a PMI launcher).
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Whether this process is the one that prints a run's one-time lines before the workers
/// start: the only process, or world rank 0 of an `mpirun` launch (read from the launcher's
/// environment: no communicator exists yet).
pub fn lead_process() -> bool {
    !launched_by_mpi()
        || ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
            .iter()
            .any(|v| std::env::var(v).is_ok_and(|r| r == "0"))
}

/// The environment variables in which launchers give a process its rank among the processes
/// of its host, in the order they are read: Open MPI's `mpirun`, then SLURM's `srun`.
pub const LOCAL_RANK_ENV: [&str; 2] = ["OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"];

/// This process's rank among those of its host, when a launcher started it. `env` looks a
/// variable up: `|name| std::env::var(name).ok()` in a process, a table in tests.
pub fn local_rank(env: impl Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    for name in LOCAL_RANK_ENV {
        if let Some(value) = env(name) {
            let rank = value.trim().parse().map_err(|_| {
                anyhow!("{name}={value} is not a process's rank on its host (a number ≥ 0)")
            })?;
            return Ok(Some(rank));
        }
    }
    Ok(None)
}

/// How many GPUs of a host its ranks share, when a launcher starts more ranks than GPUs
/// (`meshtrain launch --gpus N --np M`, M a multiple of N): local rank r then trains on GPU
/// `r mod N`, and ranks on one GPU reduce through staged collectives.
pub const GPUS_ENV: &str = "MESHTRAIN_GPUS";

/// The device this process trains on. Several processes of a host each need a GPU, and the
/// one launch command line they share cannot name it, so under a launcher the local rank
/// picks it: `cuda` (or `cuda:B`) names the host's first GPU for the job and local rank r
/// trains on `cuda:r` (`cuda:B+r`), or on `cuda:B + r mod N` when [`GPUS_ENV`] says the ranks
/// share N GPUs. The CPU, and any device outside a launcher, stay as given. `env` as for
/// [`local_rank`].
pub fn local_device(device: Device, env: impl Fn(&str) -> Option<String>) -> Result<Device> {
    let shared = match env(GPUS_ENV) {
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Some(n),
            _ => bail!("{GPUS_ENV}={v} is not a number of GPUs (a number ≥ 1)"),
        },
        None => None,
    };
    match (device, local_rank(env)?) {
        (Device::Cuda(first), Some(rank)) => {
            Ok(Device::Cuda(first + rank % shared.unwrap_or(usize::MAX)))
        }
        _ => Ok(device),
    }
}

/// The collective timeout: `MESHTRAIN_TIMEOUT_S` if set, else the job's.
pub fn timeout_from_env(job_timeout: Duration) -> Result<Duration> {
    match std::env::var(TIMEOUT_ENV) {
        Ok(v) => {
            let s: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s > 0.0)
                .with_context(|| {
                    format!("{TIMEOUT_ENV}={v} is not a positive number of seconds")
                })?;
            Ok(Duration::from_secs_f64(s))
        }
        Err(_) => Ok(job_timeout),
    }
}

/// The data-parallel size of a job under `mpirun`: `dp × tp × pp × cp` must be the number of
/// processes; a `dp` left at 1 takes what the other dimensions leave.
pub fn mpi_data_parallel_size(dp: usize, others: usize, size: usize) -> Result<usize> {
    if dp == 1 && others > 0 {
        if !size.is_multiple_of(others) {
            bail!(
                "mpirun started {size} processes, not a multiple of the {others} workers one \
                 data-parallel replica needs (tp × pp × cp): start a multiple of {others}"
            );
        }
        return Ok(size / others);
    }
    if dp * others != size {
        let hint = if size.is_multiple_of(others) {
            format!(
                " or set the data-parallel size to {} (--dp {})",
                size / others,
                size / others
            )
        } else {
            String::new()
        };
        bail!(
            "dp={dp} × {others} worker(s) per replica = {} but mpirun started {size} processes: \
             start {} processes (mpirun -np {}){hint}",
            dp * others,
            dp * others,
            dp * others
        );
    }
    Ok(dp)
}

impl Job {
    /// Runs the job: checks it, starts its workers, trains, and returns world rank 0's
    /// summary (under `mpirun`, each process returns its own; `Summary::rank` tells which).
    pub fn run(mut self, options: &RunOptions) -> Result<Summary> {
        self.timeout = timeout_from_env(self.timeout)?;
        if launched_by_mpi() {
            return run_mpi(self, options);
        }
        let workers = self.layout.world_size();
        self.check(workers)?;
        let created = self.preflight(options)?;
        if options.verbose {
            println!("data: {}", self.describe_data());
        }
        let job = Arc::new(self);
        let options = options.clone();
        let config = CommConfig::default()
            .with_timeout(job.timeout)
            .with_ranks_per_host(job.parallel.ranks_per_host);
        let summaries = ThreadsWorld::run(workers, config, move |group| {
            run_worker(&job, group, None, &options).map_err(|e| format!("{e:#}"))
        })
        .map_err(|e| {
            created.remove_if_empty();
            training_failed(e)
        })?;
        summaries
            .into_iter()
            .next()
            .context("rank 0 returned no summary")
    }

    /// What can be found wrong before any worker starts, checked once and before anything
    /// is written: the device (the driver and CUDA libraries, the GPU, the layout, every
    /// layer's kernels: [`check_device`]), the checkpoints to resume or start from (missing,
    /// truncated, foreign, of another model, read from their headers), and last the output
    /// directory (a file, or not writable), created only once everything else passed. Every
    /// worker would otherwise find the same fault, and the user read it once per worker.
    ///
    /// Returns the directories it created, for the caller to remove
    /// ([`CreatedDirs::remove_if_empty`]) if the start fails after all: a run that never
    /// trained leaves no empty output directory behind.
    pub fn preflight(&self, options: &RunOptions) -> Result<CreatedDirs> {
        let model = (self.model)();
        check_device(
            &model,
            &self.layout,
            self.parallel.device,
            DeviceCheck::Opening,
        )?;
        if let Some(path) = &options.resume {
            crate::checkpoint::check(path, &model, &self.model_description, Restore::Everything)
                .map_err(|e| anyhow!("cannot resume: {e:#}"))?;
        }
        if let Some(path) = &options.init_from {
            let checked = if crate::hf::is_model_dir(path) {
                crate::hf::check(path, &model)
            } else {
                crate::checkpoint::check(path, &model, "", Restore::Weights)
            };
            checked.map_err(|e| anyhow!("cannot take the initial weights (--init-from): {e:#}"))?;
        }
        create_out_dir(&self.out_dir)
    }

    /// One line on the data, for the start of a run.
    pub fn describe_data(&self) -> String {
        let d = &self.train_data;
        let mut line = format!("training on {} ({} samples)", d.name(), d.len());
        if let Some(e) = &self.eval {
            line += &format!(
                ", evaluating on {} ({} samples)",
                e.data.name(),
                e.data.len()
            );
        }
        line
    }
}

/// The directories a run created for its output, the deepest first (never one that existed
/// before): a run whose start fails removes them again, so that a mistyped flag leaves no
/// empty `runs/…` behind.
#[derive(Debug, Default)]
#[must_use = "a failed start removes the directories it created"]
pub struct CreatedDirs(Vec<PathBuf>);

impl CreatedDirs {
    /// Creates `dir` and its missing parents, remembering which were missing.
    fn create(dir: &Path) -> std::io::Result<CreatedDirs> {
        let missing = dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .map(Path::to_path_buf)
            .collect();
        std::fs::create_dir_all(dir)?;
        Ok(CreatedDirs(missing))
    }

    /// Removes the directories this run created, the deepest first, each only while it is
    /// empty: one that holds a file (the run's metrics, anyone's) stays, and so do the
    /// directories above it.
    pub fn remove_if_empty(&self) {
        for dir in &self.0 {
            if std::fs::remove_dir(dir).is_err() {
                return;
            }
        }
    }
}

/// Creates the output directory if needed and checks that it is a directory that takes
/// files; returns what it created.
fn create_out_dir(dir: &Path) -> Result<CreatedDirs> {
    ensure!(
        !dir.exists() || dir.is_dir(),
        "the output directory {} (train.out_dir) is a file: metrics and checkpoints go into a \
         directory; give another path",
        dir.display()
    );
    let created = CreatedDirs::create(dir).with_context(|| {
        format!(
            "cannot create the output directory {} (train.out_dir)",
            dir.display()
        )
    })?;
    let probe = dir.join(format!(".meshtrain-write-test-{}", std::process::id()));
    if let Err(e) = std::fs::write(&probe, b"") {
        created.remove_if_empty();
        return Err(anyhow!(e).context(format!(
            "the output directory {} (train.out_dir) is not writable: metrics and checkpoints \
             could not be saved",
            dir.display()
        )));
    }
    let _ = std::fs::remove_file(&probe);
    Ok(created)
}

/// A threads world's failure as the user reads it, "failed" said once: one worker's error as
/// `training failed: …`, several workers' as the world words it (`rank 1 failed: …; then …`,
/// `every worker failed: …`), which names who.
fn training_failed(e: WorldError<String>) -> anyhow::Error {
    match e.failures.as_slice() {
        [(_, WorkerFailure::Error(cause))] if e.world_size == 1 => {
            anyhow!("training failed: {cause}")
        }
        [(_, WorkerFailure::Panic(message))] if e.world_size == 1 => {
            anyhow!("training panicked: {message}")
        }
        _ => anyhow!("training on {} workers: {e}", e.world_size),
    }
}

/// One worker: builds its trainer, restores a checkpoint if asked, runs.
fn run_worker(
    job: &Arc<Job>,
    world: Arc<dyn ProcessGroup>,
    threads: Option<usize>,
    options: &RunOptions,
) -> Result<Summary> {
    let mut trainer = prepare_worker(job, world, threads, options)?;
    train_worker(&mut trainer, options)
}

/// A worker's trainer, with its checkpoint restored: everything before the first step.
fn prepare_worker(
    job: &Arc<Job>,
    world: Arc<dyn ProcessGroup>,
    threads: Option<usize>,
    options: &RunOptions,
) -> Result<Trainer> {
    let mut trainer = job.trainer(world, threads)?;
    let lead = trainer.is_lead();
    trainer.show_progress = options.show_progress && lead;
    if let Some(stop) = &options.stop {
        trainer.stop = stop.clone();
    }
    trainer.command_line = options.command_line.clone();
    trainer.after_eval = options.after_eval.clone();
    let verbose = options.verbose && lead;
    if let Some(path) = &options.init_from {
        let from = trainer.init_from(path)?;
        if verbose {
            println!(
                "initial weights from {} (saved from: {})",
                path.display(),
                if from.is_empty() {
                    "unknown model".into()
                } else {
                    crate::checkpoint::one_line(&from)
                }
            );
        }
    }
    if let Some(path) = &options.resume {
        let changed = trainer.resume_reshaped(path, options.reshape)?;
        if verbose {
            println!("resumed from {} at step {}", path.display(), trainer.step);
            if let Some(changed) = changed {
                println!("reshaped: {changed}; optimizer state kept");
            }
        }
    }
    if verbose {
        print_start(&trainer);
    }
    Ok(trainer)
}

/// Trains a prepared worker to the end (or a stop).
fn train_worker(trainer: &mut Trainer, options: &RunOptions) -> Result<Summary> {
    let mut summary = trainer.run(options.resume.is_some())?;
    summary.rank = trainer.parallel.world().rank();
    Ok(summary)
}

fn print_start(t: &Trainer) {
    let l = &t.parallel.layout.layout;
    let world = t.parallel.world().size();
    let params = t.whole.num_unique_params();
    let tied = if params != t.whole.num_params() {
        format!(" ({} with tied copies)", t.whole.num_params())
    } else {
        String::new()
    };
    println!(
        "model: {params} parameters{tied} in {} blocks; {} steps of global batch {}{}; output in {}",
        t.model.num_blocks(),
        t.job.stop_step(),
        t.job.batch_size,
        if l.dp > 1 {
            format!(
                " over {} data-parallel workers ({})",
                l.dp,
                t.parallel.sync_name()
            )
        } else {
            String::new()
        },
        t.job.out_dir.display()
    );
    println!("{} ({world} worker(s))", t.parallel.describe(&t.model));
    let groups = &t.job.param_groups;
    if !groups.groups.is_empty() {
        let parts: Vec<String> = groups
            .summary(&t.model)
            .into_iter()
            .map(|(label, n)| format!("{label}: {n}"))
            .collect();
        println!("parameter groups (elements): {}", parts.join(", "));
    }
}

#[cfg(feature = "mpi")]
fn run_mpi(mut job: Job, options: &RunOptions) -> Result<Summary> {
    use meshtrain_comm::mpi_backend::MpiWorld;
    let config = CommConfig::default()
        .with_timeout(job.timeout)
        .with_ranks_per_host(job.parallel.ranks_per_host);
    let world = MpiWorld::init(config).context("initialising MPI")?;
    let group = world
        .world_group()
        .context("creating the MPI world group")?;
    let size = group.size();
    let rank = group.rank();
    // What this rank's preflight created: removed again, if empty, when the start fails.
    let mut created = CreatedDirs::default();
    let prepared = (|| {
        let l = &job.layout;
        job.layout.dp = mpi_data_parallel_size(l.dp, l.tp * l.pp * l.cp, size)?;
        job.check(size)?;
        created = job.preflight(options)?;
        let local: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(size);
        Ok(threads_per_worker(job.threads, local))
    })();
    // The checks fail alike on every rank (the same config) or on a few (a host's disk):
    // every rank learns which before any work, the first of them alone prints, and all end
    // without waiting for peers that will never come.
    let threads = match settle(&group, prepared) {
        Ok(threads) => threads,
        Err(e) => {
            created.remove_if_empty();
            drop(group);
            drop(world);
            return Err(e);
        }
    };
    if options.verbose && rank == 0 {
        println!("MPI: {size} ranks; data: {}", job.describe_data());
    }
    // Setting up the layout and restoring a checkpoint fail alike on every rank too (a
    // memory limit no layout meets, a checkpoint of another data stream): said once.
    let prepared = prepare_worker(&Arc::new(job), group.clone(), Some(threads), options);
    let mut trainer = match settle(&group, prepared) {
        Ok(trainer) => trainer,
        Err(e) => {
            created.remove_if_empty();
            drop(group);
            drop(world);
            return Err(e);
        }
    };
    match train_worker(&mut trainer, options) {
        Ok(summary) => {
            drop(trainer);
            drop(group);
            drop(world);
            Ok(summary)
        }
        // Prints `error: rank R: training failed: …` and tells the peers blocked on
        // this rank why they cannot go on, then ends the job.
        Err(e) => {
            created.remove_if_empty();
            world.abort_with_error(format_args!("training failed: {e:#}"), 1)
        }
    }
}

/// Every rank's `outcome`, made known to all (one all-reduce): the value when every rank
/// succeeded; otherwise the error on the first rank that failed and [`ReportedElsewhere`] on
/// the others, so that one rank prints and every rank ends.
#[cfg(feature = "mpi")]
fn settle<T>(group: &Arc<dyn ProcessGroup>, outcome: Result<T>) -> Result<T> {
    let (rank, size) = (group.rank(), group.size());
    let mut failed = vec![0.0f32; size];
    failed[rank] = f32::from(u8::from(outcome.is_err()));
    if let Err(e) = group.all_reduce(
        meshtrain_comm::BufMut::F32(&mut failed),
        meshtrain_comm::ReduceOp::Sum,
    ) {
        // A rank that failed on its own while its peers were in another collective: its
        // own error is the one to print (the peers report theirs).
        return Err(match outcome {
            Err(own) => own,
            Ok(_) => anyhow!(e).context("learning which ranks failed their checks"),
        });
    }
    match (outcome, failed.iter().position(|&f| f > 0.0)) {
        (Ok(value), None) => Ok(value),
        (outcome, Some(first)) => {
            if let (Err(e), true) = (&outcome, first == rank) {
                print_error(e);
            }
            // Nobody exits before the error is out: mpirun ends the job, printing rank
            // included, as soon as the first rank exits non-zero.
            let _ = group.barrier();
            Err(ReportedElsewhere.into())
        }
        (Err(e), None) => Err(e.context("the ranks disagree on which failed")),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_job: Job, _options: &RunOptions) -> Result<Summary> {
    let _ = threads_per_worker;
    bail!(
        "started under mpirun, but this meshtrain was built without MPI support: \
         rebuild with `cargo build --release -p meshtrain --features mpi`"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            (vars.iter())
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_local_rank_picks_the_gpu_under_a_launcher() {
        let mpirun = [("OMPI_COMM_WORLD_LOCAL_RANK", "3")];
        assert_eq!(
            local_device(Device::Cuda(0), env(&mpirun)).unwrap(),
            Device::Cuda(3)
        );
        // cuda:B names the host's first GPU for the job.
        assert_eq!(
            local_device(Device::Cuda(4), env(&mpirun)).unwrap(),
            Device::Cuda(7)
        );
        assert_eq!(
            local_device(Device::Cpu, env(&mpirun)).unwrap(),
            Device::Cpu
        );
        let slurm = [("SLURM_LOCALID", "1")];
        assert_eq!(
            local_device(Device::Cuda(0), env(&slurm)).unwrap(),
            Device::Cuda(1)
        );
        // mpirun inside a SLURM allocation: mpirun's own local rank counts.
        let both = [("SLURM_LOCALID", "0"), ("OMPI_COMM_WORLD_LOCAL_RANK", "2")];
        assert_eq!(
            local_device(Device::Cuda(0), env(&both)).unwrap(),
            Device::Cuda(2)
        );
        // No launcher: the device as given.
        assert_eq!(
            local_device(Device::Cuda(5), env(&[])).unwrap(),
            Device::Cuda(5)
        );
        // More ranks than GPUs: local ranks 0..4 over 2 GPUs from cuda:1 share them in turn.
        let on = |rank: &str| {
            let shared = [("OMPI_COMM_WORLD_LOCAL_RANK", rank), (GPUS_ENV, "2")];
            local_device(Device::Cuda(1), env(&shared)).unwrap()
        };
        assert_eq!(["0", "1", "2", "3"].map(on), [1, 2, 1, 2].map(Device::Cuda));
        let e = local_device(Device::Cuda(0), env(&[(GPUS_ENV, "0")])).unwrap_err();
        assert!(
            e.to_string()
                .contains("MESHTRAIN_GPUS=0 is not a number of GPUs"),
            "{e}"
        );
        let err = local_device(Device::Cuda(0), env(&[("SLURM_LOCALID", "x")])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "SLURM_LOCALID=x is not a process's rank on its host (a number ≥ 0)"
        );
    }

    #[test]
    fn a_failed_start_removes_only_the_directories_it_created() {
        let root = tempfile::tempdir().unwrap();
        let existing = root.path().join("runs");
        std::fs::create_dir(&existing).unwrap();
        let out = existing.join("gpt").join("today");
        let created = CreatedDirs::create(&out).unwrap();
        assert!(out.is_dir());
        created.remove_if_empty();
        assert!(!existing.join("gpt").exists(), "both new levels removed");
        assert!(existing.is_dir(), "the directory that existed before stays");
        // A directory that holds a file stays, and so does its parent.
        let created = CreatedDirs::create(&out).unwrap();
        std::fs::write(out.join("metrics.jsonl"), b"{}").unwrap();
        created.remove_if_empty();
        assert!(out.join("metrics.jsonl").is_file());
        // One that existed before is never listed.
        let again = CreatedDirs::create(&out).unwrap();
        std::fs::remove_file(out.join("metrics.jsonl")).unwrap();
        again.remove_if_empty();
        assert!(out.is_dir());
    }
}
