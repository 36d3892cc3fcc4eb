//! Starting a training job on one worker, on N worker threads (the threads backend), or as
//! one rank of an MPI job (`mpirun -np N meshtrain train ...`, feature `mpi`).

use crate::config::Config;
use crate::train::{Summary, Task, Trainer};
use anyhow::{anyhow, Context, Result};
use meshtrain_comm::{CommConfig, ProcessGroup, ThreadsWorld};
use std::path::PathBuf;
use std::sync::Arc;

/// What a job needs besides its config.
#[derive(Clone, Debug, Default)]
pub struct JobOptions {
    /// Resume from this checkpoint (every worker reads it).
    pub resume: Option<PathBuf>,
    /// Show the progress bar (rank 0 only).
    pub show_progress: bool,
    /// Print the configuration line and resume notice (rank 0 only).
    pub verbose: bool,
}

/// Whether this process was started by `mpirun`/`mpiexec` (OpenMPI or a PMI launcher).
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Runs the job described by `cfg` and returns rank 0's summary: a single worker when
/// `parallel.dp × parallel.pp` is 1, that many worker threads otherwise, or this process's
/// rank under MPI.
pub fn run_job(cfg: Config, options: &JobOptions) -> Result<Summary> {
    if launched_by_mpi() {
        return run_mpi(cfg, options);
    }
    let task = Arc::new(Task::load(&cfg)?);
    if options.verbose {
        println!("meshtrain: {}", task.describe());
    }
    let workers = cfg.parallel.dp * cfg.parallel.pp;
    if workers == 1 {
        let task = Arc::try_unwrap(task).map_err(|_| anyhow!("task is shared"))?;
        let mut trainer = Trainer::new(cfg, task)?;
        return run_worker(&mut trainer, options);
    }
    let options = options.clone();
    let summaries = ThreadsWorld::run(workers, CommConfig::default(), move |group| {
        worker(cfg.clone(), Arc::clone(&task), group, None, &options).map_err(|e| format!("{e:#}"))
    })
    .map_err(|e| anyhow!("parallel training failed: {e}"))?;
    summaries
        .into_iter()
        .flatten()
        .next()
        .context("rank 0 returned no summary")
}

/// One worker (data-parallel replica or pipeline stage): builds its trainer and runs it; rank
/// 0 returns the summary.
fn worker(
    cfg: Config,
    task: Arc<Task>,
    group: Arc<dyn ProcessGroup>,
    threads: Option<usize>,
    options: &JobOptions,
) -> Result<Option<Summary>> {
    let mut trainer = Trainer::with_group(cfg, task, group, threads)?;
    let summary = run_worker(&mut trainer, options)?;
    Ok(trainer.is_lead().then_some(summary))
}

fn run_worker(trainer: &mut Trainer, options: &JobOptions) -> Result<Summary> {
    let lead = trainer.is_lead();
    trainer.show_progress = options.show_progress && lead;
    let resume = options
        .resume
        .clone()
        .or_else(|| trainer.cfg.checkpoint.resume.clone());
    if let Some(path) = resume {
        trainer.resume(&path)?;
        if options.verbose && lead {
            println!("resumed from {} at step {}", path.display(), trainer.step);
        }
    }
    if options.verbose && lead {
        let (_, world) = trainer.rank_and_world();
        println!(
            "model: {} parameters in {} blocks; {} steps of global batch {}{}; output in {}",
            trainer.model.num_params(),
            trainer.model.num_blocks(),
            trainer.total_steps,
            trainer.cfg.train.batch_size,
            if world > 1 {
                format!(
                    " over {world} data-parallel workers ({:?})",
                    trainer.cfg.parallel.dp_mode
                )
            } else {
                String::new()
            },
            trainer.cfg.train.out_dir.display()
        );
        if let Some(p) = &trainer.pipeline {
            println!("{}", p.describe(&trainer.model));
        }
    }
    trainer.run()
}

#[cfg(feature = "mpi")]
fn run_mpi(mut cfg: Config, options: &JobOptions) -> Result<Summary> {
    use crate::train::threads_per_worker;
    use meshtrain_comm::mpi_backend::MpiWorld;
    let world = MpiWorld::init(CommConfig::default()).context("initialising MPI")?;
    let group = world
        .world_group()
        .context("creating the MPI world group")?;
    let size = group.size();
    cfg.parallel.dp =
        crate::pipeline_train::mpi_data_parallel_size(cfg.parallel.dp, cfg.parallel.pp, size)?;
    cfg.validate()?;
    let local: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(size);
    let threads = threads_per_worker(cfg.train.threads, local);
    let task = Arc::new(Task::load(&cfg)?);
    if options.verbose && group.rank() == 0 {
        println!("meshtrain (MPI, {size} ranks): {}", task.describe());
    }
    let result = worker(cfg, task, group, Some(threads), options);
    match result {
        Ok(Some(summary)) => Ok(summary),
        Ok(None) => {
            // Not rank 0: nothing to report.
            drop(world);
            std::process::exit(0)
        }
        // Prints `error: rank R: training failed: …` and tells the peers blocked on
        // this rank why they cannot go on, then ends the job.
        Err(e) => world.abort_with_error(format_args!("training failed: {e:#}"), 1),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_cfg: Config, _options: &JobOptions) -> Result<Summary> {
    anyhow::bail!(
        "started under mpirun, but this meshtrain was built without MPI support: \
         rebuild with `cargo build --release -p meshtrain --features mpi`"
    )
}
