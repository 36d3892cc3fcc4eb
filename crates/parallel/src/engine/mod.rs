//! The step's engine, which every layout runs: what a worker holds and how one training
//! step goes through it. Each parallel dimension sits above it and plugs into it; nothing
//! here knows about data, tensor, context or pipeline parallelism by name.
//!
//! * [`partition`]: which blocks each of a worker's chunks holds (one chunk, the whole model,
//!   without a pipeline).
//! * [`schedule`]: a worker's program as plain data: forward and backward of micro-batch `i`
//!   on chunk `j`, sends and receives (GPipe, 1F1B and interleaved 1F1B build them; a run
//!   without a pipeline is the one-stage schedule: forward, backward, per micro-batch),
//!   checked and simulated without a model.
//! * [`executor`]: a [`Stage`] holds its chunks' flat parameters, gradients and buffers
//!   ([`StageChunk`]) and runs its program over `ProcessGroup` send/recv, accumulating
//!   gradients over micro-batches; [`StepHooks`] is where a dimension joins the passes (a
//!   block's gradients are final; where a block's parameters are).
//!
//! * [`flat`]: a dimension's own flat buffers in the chunk's memory, and copy plans between
//!   them (ZeRO's wire buffers, written once for both devices).
//! * [`device`]: a chunk's flat state on a device ([`DeviceState`]: the CUDA one in
//!   `cuda_chunk`, and a stand-in in host memory for tests), the line below which the one
//!   step is device-specific.
//!
//! A step, per worker:
//!
//! ```text
//! let micro = MicroBatches::split(&x, &y, m)?;
//! let report = stage.run_step(&model, pp_group, micro, &options, timeline, &mut hooks)?;
//! ```

#[cfg(feature = "cuda")]
pub mod cuda_chunk;
pub mod device;
pub mod executor;
pub mod flat;
pub mod partition;
pub mod schedule;
mod transport;

pub use device::{DeviceMemory, DeviceState, StandIn, StateKind, StepGraphOutcome};
pub use executor::{
    ChunkParams, GradsReady, MicroBatches, NoHooks, Stage, StageChunk, StageStores, StepHooks,
    StepOptions, StepReport,
};
pub use flat::{Apply, CopyPlan, FlatBuf, FlatMemory, HostFlat, Run};
pub use partition::Partition;
pub use schedule::{Action, Schedule, ScheduleKind, Simulation};
pub use transport::{tensor_like, tensor_view, ActivationHome, SendMode};

use meshtrain_comm::{BufMut, BufRef, CommError, ProcessGroup};

/// Replaces `values` with their f64 sum over `group`, added in rank order on every rank (so
/// bit-identical everywhere): each f64 travels as two f32 words through an all-gather.
pub fn sum_f64(group: &dyn ProcessGroup, values: &mut [f64]) -> Result<(), CommError> {
    let world = group.size();
    if world == 1 {
        return Ok(());
    }
    let words: Vec<f32> = values
        .iter()
        .flat_map(|v| {
            let bits = v.to_bits();
            [
                f32::from_bits(bits as u32),
                f32::from_bits((bits >> 32) as u32),
            ]
        })
        .collect();
    let mut gathered = vec![0.0f32; words.len() * world];
    group.all_gather(BufRef::F32(&words), BufMut::F32(&mut gathered))?;
    for (i, v) in values.iter_mut().enumerate() {
        *v = (0..world)
            .map(|r| {
                let w = &gathered[r * words.len() + 2 * i..];
                f64::from_bits(w[0].to_bits() as u64 | ((w[1].to_bits() as u64) << 32))
            })
            .sum();
    }
    Ok(())
}

/// Why a schedule, a partition or a step cannot run (named for the pipeline, whose layouts
/// raise most of them). Layout errors are raised by [`Schedule::new`], [`Partition`] and
/// [`Stage::new`] before any work starts.
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
    /// A device could not take or give back a chunk's state (placement, checkpoints).
    #[error("{0}")]
    Device(String),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Loss(#[from] meshtrain_nn::LossError),
    /// Workers of a threads world failed (measurement runs).
    #[error("pipeline workers failed: {0}")]
    Workers(String),
}
