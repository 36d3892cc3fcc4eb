//! Model-state memory per worker: predicted by the planner's ZeRO formula from this
//! worker's real parameter count, measured from the allocations, and checked against
//! `train.memory_limit_mb` before the first step.
//!
//! meshtrain keeps f32 parameters in every precision (bf16/fp16 products convert their
//! inputs on the fly; the f32 parameters are the master weights), so a parameter costs 4
//! bytes of weight, 4 of gradient and 8 of AdamW moments (4 for SGD's momentum) — the
//! planner's `model_state_bytes` with those byte counts, sharded by the ZeRO stage over the
//! data-parallel group.

use anyhow::{bail, Result};
use meshtrain_nn::optim::OptimizerConfig;
use meshtrain_nn::Model;
use meshtrain_parallel::{ModelStateMemory, Parallel};
use meshtrain_plan::layout::ParamBytes;
use meshtrain_plan::memory::{model_state_bytes, ModelStates};
use serde::Serialize;

const MIB: f64 = 1024.0 * 1024.0;

/// The bytes one parameter's states take in meshtrain's trainer.
pub fn bytes_per_param(optimizer: OptimizerConfig) -> ParamBytes {
    ParamBytes {
        weights: 4.0,
        gradients: 4.0,
        optimizer: match optimizer {
            OptimizerConfig::Adamw { .. } => 8.0,
            OptimizerConfig::Sgd { .. } => 4.0,
        },
    }
}

/// The planner's model-state bytes for this worker: its parameters (its pipeline chunks, its
/// tensor-parallel shards) under its layout's ZeRO stage and data-parallel size.
pub fn predicted(parallel: &Parallel, model: &Model, optimizer: OptimizerConfig) -> ModelStates {
    let l = &parallel.layout.layout;
    model_state_bytes(
        local_params(parallel, model),
        bytes_per_param(optimizer),
        l.zero,
        l.dp as u64,
    )
}

/// Parameters this worker holds before ZeRO sharding (its chunks, its tensor-parallel
/// shards).
fn local_params(parallel: &Parallel, model: &Model) -> f64 {
    parallel
        .stage
        .chunks
        .iter()
        .map(|c| model.blocks_param_range(c.blocks.clone()).len())
        .sum::<usize>() as f64
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
}

impl MemoryReport {
    pub fn new(measured: ModelStateMemory, predicted: ModelStates) -> MemoryReport {
        MemoryReport {
            parameters_mib: measured.parameters as f64 / MIB,
            gradients_mib: measured.gradients as f64 / MIB,
            optimizer_mib: measured.optimizer as f64 / MIB,
            transient_mib: measured.transient_peak as f64 / MIB,
            predicted_mib: predicted.total() / MIB,
        }
    }

    /// Parameters + gradients + optimizer state, measured.
    pub fn states_mib(&self) -> f64 {
        self.parameters_mib + self.gradients_mib + self.optimizer_mib
    }

    pub fn report(&self) -> String {
        format!(
            "model states per worker {:.1} MiB (parameters {:.1}, gradients {:.1}, optimizer \
             {:.1}; the formula predicts {:.1}), ZeRO transient peak {:.1} MiB",
            self.states_mib(),
            self.parameters_mib,
            self.gradients_mib,
            self.optimizer_mib,
            self.predicted_mib,
            self.transient_mib
        )
    }
}

/// Refuses a layout whose predicted model states exceed `limit_mb` per worker, naming both
/// figures and the ZeRO stages that would fit.
pub fn check_limit(
    limit_mb: f64,
    parallel: &Parallel,
    model: &Model,
    optimizer: OptimizerConfig,
) -> Result<()> {
    let states = predicted(parallel, model, optimizer);
    let need = states.total() / MIB;
    if need <= limit_mb {
        return Ok(());
    }
    let l = &parallel.layout.layout;
    let params = local_params(parallel, model);
    let stage_mib = |zero: u8| {
        model_state_bytes(params, bytes_per_param(optimizer), zero, l.dp as u64).total() / MIB
    };
    let fits: Vec<String> = (0..=3u8)
        .filter(|&z| stage_mib(z) <= limit_mb)
        .map(|z| format!("zero={z} ({:.0} MiB)", stage_mib(z)))
        .collect();
    let hint = if fits.is_empty() {
        format!(
            "no ZeRO stage fits at dp={}: add data-parallel workers (ZeRO-3 divides \
             everything by dp), tensor or pipeline parallelism",
            l.dp
        )
    } else {
        format!("at dp={} these fit: {}", l.dp, fits.join(", "))
    };
    bail!(
        "layout {l}: the model states need {need:.0} MiB per worker (parameters {:.0} + \
         gradients {:.0} + optimizer state {:.0} MiB) but train.memory_limit_mb allows \
         {limit_mb:.0} MiB; {hint}",
        states.weights / MIB,
        states.gradients / MIB,
        states.optimizer / MIB,
    )
}
