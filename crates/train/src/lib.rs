//! meshtrain as a library: train your own model on your own data with every parallel layout
//! meshtrain has — data parallelism (DDP or the single-master mode), pipelines (GPipe, 1F1B,
//! interleaved), tensor, sequence and context parallelism, ZeRO 1–3, combined — with
//! checkpoints that resume exactly in any layout, a graceful stop on signals
//! ([`StopRequest`]), metrics, TensorBoard events, a progress bar, a step-time breakdown and
//! a timeline.
//!
//! You give:
//! * a model: [`nn::Model`], blocks with explicit forward and backward over one flat
//!   parameter buffer (built from [`nn::layers`] or your own [`nn::Layer`]s);
//! * data: anything implementing [`Dataset`] (a length, and filling a batch from sample
//!   indices; token ids stay integers);
//! * a [`nn::Loss`], an optimizer ([`nn::optim::OptimizerConfig`]) with parameter groups
//!   ([`nn::optim::ParamGroups`]), an [`LrSchedule`];
//! * a [`Layout`]: `"dp=2"`, `"pp=2,mb=8,schedule=1f1b"`, or what `meshtrain plan` printed.
//!
//! ```no_run
//! use meshtrain_train::{Job, RunOptions, nn, Dataset};
//! use std::sync::Arc;
//! # fn my_model() -> nn::Model { unimplemented!() }
//! # fn my_data() -> Arc<dyn Dataset> { unimplemented!() }
//! let summary = Job::new(my_model, my_data(), Arc::new(nn::CrossEntropy::new(10)))
//!     .batch_size(64)
//!     .epochs(3)
//!     .layout("dp=2".parse()?)
//!     .run(&RunOptions::default())?;
//! println!("{:.4}", summary.final_train_loss);
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! `examples/custom_model.rs` defines a model and a dataset of its own and trains them
//! data-parallel and pipelined through this API alone.

pub mod checkpoint;
pub mod dataset;
pub mod hf;
pub mod job;
pub mod launch;
pub mod memory;
pub mod metrics;
pub mod sharded;
pub mod stop;
pub mod tensor_file;
pub mod tensorboard;
pub mod timeline;
pub mod trainer;
pub mod writer;

pub use dataset::{
    BatchMut, Dataset, DatasetError, EvalPlan, ImageData, Inputs, SamplerPosition, Sampling,
    TextWindows, TokenFiles,
};
pub use job::{
    CheckpointFormat, EvalSpec, Job, Length, LrSchedule, ModelFn, DEFAULT_CHECKPOINT_MINUTES,
    DEFAULT_TIMEOUT,
};
pub use launch::{
    launched_by_mpi, lead_process, local_device, local_rank, print_error, CreatedDirs,
    ReportedElsewhere, RunOptions, LOCAL_RANK_ENV, TIMEOUT_ENV,
};
pub use metrics::{peak_rss_mb, Breakdown, Stopped, Summary};
pub use stop::StopRequest;
pub use trainer::{threads_per_worker, Trainer};

pub use meshtrain_parallel::data::{DdpConfig, GradCompression};
pub use meshtrain_parallel::engine::{ScheduleKind, SendMode};
pub use meshtrain_parallel::parallelize::DpMode;
pub use meshtrain_parallel::pipeline::PartitionSpec;
pub use meshtrain_parallel::{Layout, ParallelOptions};

/// Collectives and process groups (`meshtrain-comm`).
pub use meshtrain_comm as comm;
/// Built-in datasets and samplers (`meshtrain-data`).
pub use meshtrain_data as data;
/// The layers, models, losses and optimizers (`meshtrain-nn`).
pub use meshtrain_nn as nn;
/// The parallel dimensions (`meshtrain-parallel`).
pub use meshtrain_parallel as parallel;
/// Kernels and the tensor type (`meshtrain-tensor`).
pub use meshtrain_tensor as tensor;
