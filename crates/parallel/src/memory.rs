//! Model-state memory per worker as the planner's ZeRO formula predicts it, and the limit
//! a run refuses to exceed — checked when the layout is known and before any parameter is
//! allocated, and again with the activations the first step measured
//! ([`check_step_limit`]: activations depend on the model's code, which only a step shows).
//!
//! meshtrain keeps f32 parameters in every precision (the master weights), so a parameter
//! costs 4 bytes of weight, 4 of gradient and 8 of AdamW moments (4 for SGD's momentum): the
//! planner's `model_state_bytes` with those byte counts, sharded by the ZeRO stage over the
//! data-parallel group. On the CPU bf16/fp16 products convert their inputs on the fly; on a
//! GPU the products read a 16-bit copy of the weights kept beside the master (2 bytes more,
//! refreshed by the update), which [`model_states_on`] counts.

use crate::layout::{Layout, Precision};
use meshtrain_nn::optim::OptimizerConfig;
use meshtrain_plan::layout::ParamBytes;
use meshtrain_plan::memory::{model_state_bytes, ModelStates};
use meshtrain_tensor::Device;

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
/// sharding (its pipeline chunks, its tensor-parallel shards) under `layout`, on the CPU.
pub fn model_states(params: f64, optimizer: OptimizerConfig, layout: &Layout) -> ModelStates {
    model_states_on(params, optimizer, layout, Device::Cpu)
}

/// [`model_states`] on `device`: a GPU under mixed precision also keeps the weights' 16-bit
/// compute copy (except under ZeRO-3, where only the gathered blocks have one, for the pass
/// that reads them: working memory, not model state).
pub fn model_states_on(
    params: f64,
    optimizer: OptimizerConfig,
    layout: &Layout,
    device: Device,
) -> ModelStates {
    let mut bytes = bytes_per_param(optimizer);
    // (ZeRO needs more than one worker to shard anything: at dp × cp = 1 it is off.)
    let zero3 = layout.zero >= 3 && layout.dp * layout.cp > 1;
    if device.is_cuda() && layout.precision != Precision::Fp32 && !zero3 {
        bytes.weights += crate::precision::product_dtype(layout.precision).size_bytes() as f64;
    }
    model_state_bytes(
        params,
        bytes,
        layout.zero,
        // ZeRO shards over every worker that holds the same parameters: dp × cp.
        (layout.dp * layout.cp) as u64,
    )
}

/// Refuses `layout` when a worker holding `params` parameters (the most any worker holds)
/// needs more than `limit_mb` MiB of model states on `device`, naming both figures and the
/// ZeRO stages that would fit.
pub fn check_limit(
    limit_mb: f64,
    params: f64,
    optimizer: OptimizerConfig,
    layout: &Layout,
    device: Device,
) -> Result<(), String> {
    let states = model_states_on(params, optimizer, layout, device);
    let need = states.total() / MIB;
    if need <= limit_mb {
        return Ok(());
    }
    let stage_mib = |zero: u8| {
        let layout = Layout {
            zero,
            ..layout.clone()
        };
        model_states_on(params, optimizer, &layout, device).total() / MIB
    };
    let fits: Vec<String> = (0..=3u8)
        .filter(|&z| stage_mib(z) <= limit_mb)
        .map(|z| format!("zero={z} ({:.0} MiB)", stage_mib(z)))
        .collect();
    let hint = if fits.is_empty() {
        format!(
            "no ZeRO stage fits at dp={} × cp={}: add data-parallel workers (ZeRO-3 divides \
             everything by dp × cp), tensor or pipeline parallelism",
            layout.dp, layout.cp
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

/// Refuses to go on when the largest worker's first step held `states` bytes of model states
/// and `activations` bytes of activations (kept for backward at the step's peak) together
/// over `limit_mb` MiB, naming the figures and what divides the activations: context
/// parallelism over one of `cp_sizes` (the sizes the model allows; per-token activations
/// fall by cp, attention's too) and recomputation.
pub fn check_step_limit(
    limit_mb: f64,
    states: f64,
    activations: f64,
    layout: &Layout,
    cp_sizes: &[usize],
) -> Result<(), String> {
    let need = (states + activations) / MIB;
    if need <= limit_mb {
        return Ok(());
    }
    let fits: Vec<String> = cp_sizes
        .iter()
        .filter(|&&c| c > layout.cp)
        .map(|&c| {
            (
                c,
                (states + activations * layout.cp as f64 / c as f64) / MIB,
            )
        })
        .filter(|&(_, mib)| mib <= limit_mb)
        .take(2)
        .map(|(c, mib)| format!("cp={c} (about {mib:.0} MiB)"))
        .collect();
    let hint = if fits.is_empty() {
        "no context-parallel size the model allows fits; add recomputation \
         (train.recompute) or shard the model states (ZeRO, tensor or pipeline parallelism)"
            .to_string()
    } else {
        format!(
            "activations are per token, so context parallelism divides them: {}",
            fits.join(", ")
        )
    };
    Err(format!(
        "layout {layout}: the first step held {:.0} MiB of activations + {:.0} MiB of model \
         states = {need:.0} MiB on the largest worker, but train.memory_limit_mb allows \
         {limit_mb:.0} MiB; {hint}",
        activations / MIB,
        states / MIB,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU under mixed precision keeps a 16-bit copy of the weights (2 bytes a parameter,
    /// sharded with them under ZeRO-3); fp32 and the CPU keep none.
    #[test]
    fn a_gpu_counts_the_16_bit_compute_copy() {
        let adam = OptimizerConfig::Adamw {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let gpu = Device::Cuda(0);
        let bf16 = Layout {
            precision: Precision::Bf16,
            ..Layout::default()
        };
        assert_eq!(model_states_on(1e6, adam, &bf16, gpu).weights, 6e6);
        assert_eq!(model_states_on(1e6, adam, &bf16, gpu).total(), 18e6);
        assert_eq!(model_states_on(1e6, adam, &bf16, Device::Cpu).weights, 4e6);
        assert_eq!(
            model_states_on(1e6, adam, &Layout::default(), gpu).weights,
            4e6
        );
        // ZeRO-2 shards no weights; ZeRO-3 shards them, and only the gathered blocks have a
        // 16-bit copy (for their pass).
        let sharded = |zero| Layout {
            dp: 4,
            zero,
            ..bf16.clone()
        };
        assert_eq!(model_states_on(1e6, adam, &sharded(2), gpu).weights, 6e6);
        assert_eq!(model_states_on(1e6, adam, &sharded(3), gpu).weights, 1e6);
        // One worker under zero = 3 shards nothing: its chunk keeps the copy.
        let alone = Layout {
            dp: 1,
            ..sharded(3)
        };
        assert_eq!(model_states_on(1e6, adam, &alone, gpu).weights, 6e6);
    }

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
        assert!(check_limit(16.0, params, adam, &layout, Device::Cpu).is_ok());
        let e = check_limit(9.0, params, adam, &layout, Device::Cpu).unwrap_err();
        assert!(
            e.contains("need 16 MiB") && e.contains("allows 9 MiB"),
            "{e}"
        );
        assert!(
            e.contains("zero=2 (7 MiB), zero=3 (4 MiB)") && !e.contains("zero=1"),
            "{e}"
        );
        let e = check_limit(1.0, params, adam, &layout, Device::Cpu).unwrap_err();
        assert!(e.contains("no ZeRO stage fits at dp=4"), "{e}");
    }

    #[test]
    fn the_step_limit_names_the_activations_and_the_cp_that_fits() {
        let layout = Layout::default();
        let mib = MIB;
        let cps = [2, 4, 8, 16];
        assert!(check_step_limit(100.0, 20.0 * mib, 80.0 * mib, &layout, &cps).is_ok());
        let e = check_step_limit(50.0, 20.0 * mib, 80.0 * mib, &layout, &cps).unwrap_err();
        assert!(
            e.contains("80 MiB of activations + 20 MiB") && e.contains("allows 50 MiB"),
            "{e}"
        );
        assert!(
            e.contains("cp=2 (about 60 MiB)") || e.contains("cp=4 (about 40 MiB)"),
            "{e}"
        );
        assert!(
            !e.contains("cp=2 (") && e.contains("cp=8 (about 30 MiB)"),
            "{e}"
        );
        let e = check_step_limit(10.0, 20.0 * mib, 80.0 * mib, &layout, &cps).unwrap_err();
        assert!(e.contains("no context-parallel size"), "{e}");
        // A model that cannot spread its sequence gets no cp hint.
        let e = check_step_limit(50.0, 20.0 * mib, 80.0 * mib, &layout, &[]).unwrap_err();
        assert!(e.contains("no context-parallel size"), "{e}");
    }
}
