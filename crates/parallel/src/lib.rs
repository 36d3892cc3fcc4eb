//! meshtrain-parallel: one module per parallel dimension, each readable in one sitting, and
//! [`parallelize`], which applies them to a model in a fixed order.
//!
//! * [`layout`]: dp × tp × pp × cp and the step settings, parsed, printed and checked
//!   before any work.
//! * [`engine`]: the step every layout runs, at the bottom: a worker's chunks of flat
//!   parameters and gradients, its program as data (schedules: GPipe, 1F1B, interleaved 1F1B,
//!   or the one-stage schedule of a run without a pipeline), and the executor that runs it
//!   over point-to-point operations, with hooks where the dimensions above join in.
//! * [`pipeline`]: the pipeline dimension: cutting the model into stages (by parameters,
//!   measured time, explicit cuts), and its measurements.
//! * [`data`]: data parallelism — DDP (bucketed gradient all-reduce overlapped with backward)
//!   and the naive single-master DataParallel mode, behind one [`data::GradSync`] interface.
//! * [`tensor`]: tensor parallelism (column/row-parallel linears, heads, vocab-parallel
//!   embedding and cross-entropy) and sequence parallelism, by a model's plan.
//! * [`context`]: context parallelism — one sequence over several workers, attention by ring
//!   (key/value blocks passed around, overlapped with the block products) or Ulysses
//!   (all-to-all to whole sequences of a share of the heads).
//! * [`zero`]: ZeRO stages 1–3 (FSDP): data parallelism with sharded optimizer state,
//!   gradients and parameters, one more [`data::GradSync`].
//! * [`tied`]: parameters shared by several blocks (tied embeddings), across stages.
//! * [`parallelize`](mod@parallelize): the apply order and the one training step.
//!
//! Process groups are passed in explicitly (`Arc<dyn ProcessGroup>`); nothing here is global.

pub mod context;
pub mod data;
pub mod device;
pub mod engine;
pub mod layout;
pub mod memory;
pub mod parallelize;
pub mod pipeline;
pub mod precision;
pub mod tensor;
pub mod tied;
pub mod timeline;
pub mod zero;

pub use layout::{Layout, LayoutError, ResolvedLayout};
pub use parallelize::{
    check_device, parallelize, DeviceCheck, DeviceMemory, EvalSums, ModelStateMemory, Parallel,
    ParallelOptions, StepStats, StepTimes,
};

use meshtrain_tensor::Tensor;

/// Samples of a batch: inputs (`[samples, ...]`; token ids as exact f32 values) and integer
/// targets (the same number per sample).
#[derive(Clone, Debug)]
pub struct Batch {
    pub x: Tensor,
    pub y: Vec<u32>,
    pub samples: usize,
}

/// Why parallel training could not be set up or a step could not run.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Pipeline(#[from] engine::PipelineError),
    #[error(transparent)]
    DataParallel(#[from] data::DataParallelError),
    #[error(transparent)]
    Comm(#[from] meshtrain_comm::CommError),
    #[error(transparent)]
    Mesh(#[from] meshtrain_comm::MeshError),
    #[error(transparent)]
    Tensor(#[from] tensor::TensorError),
    #[error(transparent)]
    Context(#[from] context::ContextError),
    #[error(transparent)]
    Loss(#[from] meshtrain_nn::LossError),
    #[error("mixed precision: {0}")]
    Precision(String),
    /// The layout's model states exceed the memory limit (`crate::memory::check_limit`).
    #[error("{0}")]
    Memory(String),
    /// The GPU cannot run this (a layout, a layer, a missing library, out of memory, a
    /// failed kernel).
    #[error("{0}")]
    Device(String),
}
