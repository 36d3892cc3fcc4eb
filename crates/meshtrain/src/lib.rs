//! The `meshtrain` command: a thin client of the `meshtrain-train` library. It reads TOML
//! configs into library jobs on the built-in models and datasets ([`presets`]), and holds the
//! benchmarks behind `meshtrain bench`. The trainer itself — one loop for every layout, for
//! any model and dataset — is `meshtrain-train`; the building blocks live in their own crates:
//! `meshtrain-tensor` (kernels), `meshtrain-nn` (layers, models, optimizers),
//! `meshtrain-comm` (collectives), `meshtrain-data` (datasets), `meshtrain-parallel` (the
//! parallel dimensions) and `meshtrain-plan` (the layout planner).

pub mod bench;
pub mod calibrate;
pub mod config;
pub mod context_bench;
pub mod corpus;
pub mod export;
pub mod generate;
#[cfg(feature = "cuda")]
pub mod gpu_bench;
#[cfg(feature = "cuda")]
pub mod gpu_convnets;
#[cfg(feature = "cuda")]
pub mod gpu_multi;
pub mod launch;
pub mod pipeline_bench;
pub mod plot;
pub mod precision_bench;
pub mod presets;
pub mod scaling;
pub mod tensor_bench;
pub mod tokenize;
pub mod tokenizer_export;
pub mod train_cli;
pub mod zero_bench;
