//! Pipeline parallelism: a model's blocks cut into stages on different workers.
//!
//! * [`partition`]: cut the block list into `p` stages (or `p·v` chunks for interleaving),
//!   balanced by parameter count, by measured time, or at explicit boundaries.
//! * [`schedule`]: GPipe, 1F1B and interleaved 1F1B as plain data (per worker, the ordered
//!   list of forward/backward/send/receive actions), checked and simulated without a model.
//! * [`executor`]: a [`Stage`] holds its chunks' parameters and runs one worker's program over
//!   `ProcessGroup` send/recv, accumulating gradients over micro-batches.
//! * [`bench`](mod@bench): pipelined training runs on p threads next to a single-worker reference, and
//!   synthetic equal-cost blocks; [`measure`]: the tables of `docs/pipeline.md` (bubble,
//!   activation memory, recomputation, equivalence), callable from the CLI.
//!
//! Naive layer-wise model parallelism (one batch flows stage to stage) is the `m = 1` case of
//! any schedule. A training step, per worker:
//!
//! ```text
//! let schedule = Schedule::new(kind, p, m)?;                       // same on every worker
//! let partition = Partition::by_params(&model, schedule.num_chunks())?;
//! let mut stage = Stage::new(&model, &partition, schedule, group.rank(), seed)?;
//! let mut optimizers = stage.optimizers(opt_config);
//! loop {
//!     let micro = MicroBatches::split(&x, &y, m)?;                  // only read where needed
//!     let report = stage.run_step(&model, group.as_ref(), micro, &options, None, &mut NoHooks)?;
//!     stage.optimizer_step(&mut optimizers, lr, None);
//! }
//! ```

pub mod bench;
pub mod executor;
pub mod measure;
pub mod partition;
pub mod schedule;
mod transport;

pub use executor::{
    ChunkParams, GradsReady, MicroBatches, NoHooks, Stage, StageChunk, StageStores, StepHooks,
    StepOptions, StepReport,
};
pub use partition::{
    partition_for, profile_block_times, split, Partition, PartitionSpec, TimeProbe,
};
pub use schedule::{Action, Schedule, ScheduleKind, Simulation};
pub use transport::SendMode;

use meshtrain_comm::CommError;

/// Why a pipeline layout or step cannot run. Layout errors are raised by [`Schedule::new`],
/// [`Partition`] and [`Stage::new`] before any work starts.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("a pipeline needs at least one worker")]
    NoWorkers,
    #[error("a pipeline step needs at least one micro-batch")]
    NoMicroBatches,
    #[error("interleaved 1F1B needs at least one model chunk per worker")]
    NoChunks,
    #[error(
        "unknown pipeline schedule '{0}' (expected gpipe, 1f1b, interleaved or interleaved:V)"
    )]
    UnknownSchedule(String),
    #[error(
        "cannot cut a model of {blocks} blocks into {chunks} pipeline chunks (stages × chunks \
         per stage): every chunk needs at least one block"
    )]
    TooFewBlocks { blocks: usize, chunks: usize },
    #[error(
        "interleaved 1F1B needs the number of micro-batches ({micro_batches}) to be a multiple \
         of the number of pipeline workers ({workers})"
    )]
    MicroBatchesNotMultiple {
        micro_batches: usize,
        workers: usize,
    },
    #[error("partition '{spec}': {reason}")]
    BadPartitionSpec { spec: String, reason: String },
    #[error("invalid stage boundaries {cuts:?} for a model of {blocks} blocks: {reason}")]
    InvalidBoundaries {
        cuts: Vec<usize>,
        blocks: usize,
        reason: String,
    },
    #[error("{what} has {got} entries but {expected} were expected")]
    SizeMismatch {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("stage rank {rank} is out of range for a pipeline of {workers} workers")]
    RankOutOfRange { rank: usize, workers: usize },
    #[error(
        "the pipeline group has {group_size} ranks and this is its rank {group_rank}, but the \
         stage is rank {stage_rank} of a {workers}-worker schedule"
    )]
    GroupMismatch {
        group_size: usize,
        group_rank: usize,
        workers: usize,
        stage_rank: usize,
    },
    #[error("a batch of {batch} samples cannot be split into {micro_batches} equal micro-batches")]
    BatchNotDivisible { batch: usize, micro_batches: usize },
    #[error(
        "{micro_batches} micro-batches × {chunks} chunks need {needed} message tags, more than \
         the {limit} every backend supports"
    )]
    TagSpace {
        micro_batches: usize,
        chunks: usize,
        needed: usize,
        limit: usize,
    },
    #[error("invalid schedule: {0}")]
    InvalidSchedule(String),
    #[error("worker {rank}: bad activation header from rank {src}: {details}")]
    BadHeader {
        rank: usize,
        src: usize,
        details: String,
    },
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Loss(#[from] meshtrain_nn::LossError),
    /// Workers of a threads world failed (measurement runs).
    #[error("pipeline workers failed: {0}")]
    Workers(String),
}
