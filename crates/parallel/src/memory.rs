//! Model-state memory per worker as the planner's ZeRO formula predicts it, and the limit
//! a run refuses to exceed — checked when the layout is known and before any parameter is
//! allocated.
//!
//! meshtrain keeps f32 parameters in every precision (bf16/fp16 products convert their
//! inputs on the fly; the f32 parameters are the master weights), so a parameter costs 4
//! bytes of weight, 4 of gradient and 8 of AdamW moments (4 for SGD's momentum): the
//! planner's `model_state_bytes` with those byte counts, sharded by the ZeRO stage over the
//! data-parallel group.

use crate::layout::Layout;
use meshtrain_nn::optim::OptimizerConfig;
use meshtrain_plan::layout::ParamBytes;
use meshtrain_plan::memory::{model_state_bytes, ModelStates};

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

/// The planner's model-state bytes of a worker holding `params` parameters before ZeRO
/// sharding (its pipeline chunks, its tensor-parallel shards) under `layout`.
pub fn model_states(params: f64, optimizer: OptimizerConfig, layout: &Layout) -> ModelStates {
    model_state_bytes(
        params,
        bytes_per_param(optimizer),
        layout.zero,
        layout.dp as u64,
    )
}

/// Refuses `layout` when a worker holding `params` parameters (the most any worker holds)
/// needs more than `limit_mb` MiB of model states, naming both figures and the ZeRO stages
/// that would fit.
pub fn check_limit(
    limit_mb: f64,
    params: f64,
    optimizer: OptimizerConfig,
    layout: &Layout,
) -> Result<(), String> {
    let states = model_states(params, optimizer, layout);
    let need = states.total() / MIB;
    if need <= limit_mb {
        return Ok(());
    }
    let stage_mib = |zero: u8| {
        let layout = Layout {
            zero,
            ..layout.clone()
        };
        model_states(params, optimizer, &layout).total() / MIB
    };
    let fits: Vec<String> = (0..=3u8)
        .filter(|&z| stage_mib(z) <= limit_mb)
        .map(|z| format!("zero={z} ({:.0} MiB)", stage_mib(z)))
        .collect();
    let hint = if fits.is_empty() {
        format!(
            "no ZeRO stage fits at dp={}: add data-parallel workers (ZeRO-3 divides \
             everything by dp), tensor or pipeline parallelism",
            layout.dp
        )
    } else {
        format!("at dp={} these fit: {}", layout.dp, fits.join(", "))
    };
    Err(format!(
        "layout {layout}: the model states need {need:.0} MiB per worker (parameters {:.0} + \
         gradients {:.0} + optimizer state {:.0} MiB) but train.memory_limit_mb allows \
         {limit_mb:.0} MiB; {hint}",
        states.weights / MIB,
        states.gradients / MIB,
        states.optimizer / MIB,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_names_both_figures_and_the_stages_that_fit() {
        let adam = OptimizerConfig::Adamw {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let layout = Layout {
            dp: 4,
            ..Layout::default()
        };
        // 2²⁰ parameters: 16 MiB of states under DDP, 4 MiB under ZeRO-3 at dp = 4.
        let params = (1u64 << 20) as f64;
        assert!(check_limit(16.0, params, adam, &layout).is_ok());
        let e = check_limit(9.0, params, adam, &layout).unwrap_err();
        assert!(
            e.contains("need 16 MiB") && e.contains("allows 9 MiB"),
            "{e}"
        );
        assert!(
            e.contains("zero=2 (7 MiB), zero=3 (4 MiB)") && !e.contains("zero=1"),
            "{e}"
        );
        let e = check_limit(1.0, params, adam, &layout).unwrap_err();
        assert!(e.contains("no ZeRO stage fits at dp=4"), "{e}");
    }
}
