//! meshtrain-plan: a cost model and planner for parallel training layouts.
//!
//! Given a model, a cluster and a training setup (attention kernel included), it predicts
//! per-GPU memory and step time of any layout (data × tensor × pipeline × context × sequence
//! parallelism, ring or Ulysses context exchange, ZeRO stage, micro-batch size, recomputation,
//! interleaving), searches all layouts for the fastest one that fits, explains the choice, and
//! diagnoses measured step-time breakdowns. Pure computation: the only I/O is
//! in [`cli`], which reads TOML/JSON inputs.

pub mod calibrate;
pub mod cli;
pub mod cluster;
pub mod cost;
pub mod diagnose;
pub mod error;
pub mod explain;
pub mod layout;
pub mod memory;
pub mod memory_validation;
pub mod model;
pub mod presets;
pub mod search;
pub mod validation;

pub use cluster::{ClusterSpec, Precision};
pub use cost::{Evaluation, Problem, StepTime, Throughput};
pub use error::{PlanError, Result};
pub use layout::{
    AttentionKind, CpMode, ElementwiseKernels, GradReduce, Layout, Optimizer, Recompute, Schedule,
    TrainingSetup,
};
pub use model::{Architecture, ModelSpec, TransformerSpec};
