//! Starting a job: `layout.world_size()` worker threads of this process (the threads
//! backend), or one worker per process under `mpirun` (feature `mpi`).

use crate::job::Job;
use crate::metrics::Summary;
use crate::trainer::{threads_per_worker, Trainer};
use anyhow::{anyhow, bail, Context, Result};
use meshtrain_comm::{CommConfig, ProcessGroup, ThreadsWorld};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What a run needs besides its job.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Continue from this checkpoint (same model; every worker reads it).
    pub resume: Option<PathBuf>,
    /// Start from this checkpoint's weights with a fresh optimizer at step 0 (fine-tuning;
    /// the checkpoint may come from another model configuration with matching tensors).
    pub init_from: Option<PathBuf>,
    /// Show the progress bar (rank 0 only).
    pub show_progress: bool,
    /// Print the run's description and notices (rank 0 only).
    pub verbose: bool,
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
        .map_err(|e| anyhow!("training failed: {e}"))?;
        summaries
            .into_iter()
            .next()
            .context("rank 0 returned no summary")
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

/// One worker: builds its trainer, restores a checkpoint if asked, runs.
fn run_worker(
    job: &Arc<Job>,
    world: Arc<dyn ProcessGroup>,
    threads: Option<usize>,
    options: &RunOptions,
) -> Result<Summary> {
    let rank = world.rank();
    let mut trainer = job.trainer(world, threads)?;
    let lead = trainer.is_lead();
    trainer.show_progress = options.show_progress && lead;
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
        trainer.resume(path)?;
        if verbose {
            println!("resumed from {} at step {}", path.display(), trainer.step);
        }
    }
    if verbose {
        print_start(&trainer);
    }
    let mut summary = trainer.run(options.resume.is_some())?;
    summary.rank = rank;
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
    let result = (|| {
        let l = &job.layout;
        job.layout.dp = mpi_data_parallel_size(l.dp, l.tp * l.pp * l.cp, size)?;
        job.check(size)?;
        let local: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(size);
        let threads = threads_per_worker(job.threads, local);
        if options.verbose && group.rank() == 0 {
            println!("MPI: {size} ranks; data: {}", job.describe_data());
        }
        run_worker(&Arc::new(job), group, Some(threads), options)
    })();
    match result {
        Ok(summary) => {
            drop(world);
            Ok(summary)
        }
        // Prints `error: rank R: training failed: …` and tells the peers blocked on
        // this rank why they cannot go on, then ends the job.
        Err(e) => world.abort_with_error(format_args!("training failed: {e:#}"), 1),
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
