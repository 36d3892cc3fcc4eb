//! Typed errors of the planner. Every message says what was wrong and, where it helps,
//! what a valid value looks like, because these errors reach users of `meshtrain plan`.

use thiserror::Error;

/// Everything that can go wrong while describing or evaluating a plan.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    /// A model description is inconsistent (zero layers, heads not dividing hidden, ...).
    #[error("invalid model `{model}`: {reason}")]
    InvalidModel { model: String, reason: String },
    /// A cluster description is inconsistent (zero GPUs, negative bandwidth, ...).
    #[error("invalid cluster `{cluster}`: {reason}")]
    InvalidCluster { cluster: String, reason: String },
    /// The training setup is inconsistent (zero batch, unknown precision, ...).
    #[error("invalid training setup: {0}")]
    InvalidSetup(String),
    /// A layout that cannot be built for this model and cluster at all
    /// (sizes do not multiply to the GPU count, heads not divisible by tp, ...).
    #[error("invalid layout {layout}: {reason}")]
    InvalidLayout { layout: String, reason: String },
    /// A layout that can be built but does not fit into GPU memory.
    #[error("layout {layout} does not fit: needs {needed_gib:.1} GiB per GPU, has {available_gib:.1} GiB ({detail})")]
    OutOfMemory {
        layout: String,
        needed_gib: f64,
        available_gib: f64,
        detail: String,
    },
    /// No layout in the search space fits; carries the closest miss.
    #[error("no feasible layout among {candidates} candidates; closest: {closest}")]
    NoFeasibleLayout { candidates: usize, closest: String },
    /// A preset name that does not exist.
    #[error("unknown {kind} preset `{name}`; known presets: {known}")]
    UnknownPreset {
        kind: &'static str,
        name: String,
        known: String,
    },
    /// A TOML/JSON input that could not be parsed.
    #[error("could not parse {what}: {reason}")]
    Parse { what: String, reason: String },
}

/// Shorthand used throughout the crate.
pub type Result<T> = std::result::Result<T, PlanError>;
