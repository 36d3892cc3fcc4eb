//! meshtrain: train neural networks across many workers.
//!
//! This crate holds the trainer, its configuration and checkpoints, and the benchmarks behind
//! the `meshtrain` command. The building blocks live in their own crates: `meshtrain-tensor`
//! (kernels), `meshtrain-nn` (layers, models, optimizers), `meshtrain-comm` (collectives),
//! `meshtrain-data` (datasets) and `meshtrain-plan` (the layout planner).

pub mod bench;
pub mod calibrate;
pub mod checkpoint;
pub mod config;
pub mod launch;
pub mod pipeline_bench;
pub mod pipeline_train;
pub mod plot;
pub mod scaling;
pub mod train;
