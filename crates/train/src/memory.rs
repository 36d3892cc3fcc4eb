//! Model-state memory per worker for a run's summary: measured from the allocations, beside
//! the planner's formula for this worker's real parameter count
//! ([`meshtrain_parallel::memory`], which also enforces `train.memory_limit_mb`).

use meshtrain_nn::optim::OptimizerConfig;
use meshtrain_nn::Model;
use meshtrain_parallel::memory::model_states_on;
use meshtrain_parallel::{ModelStateMemory, Parallel};
use meshtrain_plan::memory::ModelStates;
use serde::Serialize;

const MIB: f64 = 1024.0 * 1024.0;

/// The planner's model-state bytes for this worker: its parameters (its pipeline chunks, its
/// tensor-parallel shards) under its layout's ZeRO stage and data-parallel size.
pub fn predicted(parallel: &Parallel, model: &Model, optimizer: OptimizerConfig) -> ModelStates {
    let params: usize = parallel
        .stage
        .chunks
        .iter()
        .map(|c| model.blocks_param_range(c.blocks.clone()).len())
        .sum();
    model_states_on(
        params as f64,
        optimizer,
        &parallel.layout.layout,
        parallel.device(),
    )
}

/// Measured and predicted model-state memory of one worker (MiB), for the run's summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MemoryReport {
    pub parameters_mib: f64,
    pub gradients_mib: f64,
    pub optimizer_mib: f64,
    /// ZeRO: gathered blocks, wire buffers and per-block gradients held at once (peak).
    pub transient_mib: f64,
    /// The planner's formula for parameters + gradients + optimizer state.
    pub predicted_mib: f64,
    /// The most activation bytes a step of this worker kept for backward so far.
    pub activations_mib: f64,
}

impl MemoryReport {
    pub fn new(
        measured: ModelStateMemory,
        predicted: ModelStates,
        activation_bytes: usize,
    ) -> MemoryReport {
        MemoryReport {
            parameters_mib: measured.parameters as f64 / MIB,
            gradients_mib: measured.gradients as f64 / MIB,
            optimizer_mib: measured.optimizer as f64 / MIB,
            transient_mib: measured.transient_peak as f64 / MIB,
            predicted_mib: predicted.total() / MIB,
            activations_mib: activation_bytes as f64 / MIB,
        }
    }

    /// Parameters + gradients + optimizer state, measured.
    pub fn states_mib(&self) -> f64 {
        self.parameters_mib + self.gradients_mib + self.optimizer_mib
    }

    pub fn report(&self) -> String {
        format!(
            "model states per worker {:.1} MiB (parameters {:.1}, gradients {:.1}, optimizer \
             {:.1}; the formula predicts {:.1}), ZeRO transient peak {:.1} MiB, activations \
             {:.1} MiB at the peak of a step",
            self.states_mib(),
            self.parameters_mib,
            self.gradients_mib,
            self.optimizer_mib,
            self.predicted_mib,
            self.transient_mib,
            self.activations_mib
        )
    }
}
