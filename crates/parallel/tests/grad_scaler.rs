//! meshtrain's `LossScaler` against PyTorch's `torch.amp.GradScaler`, step by step: the
//! reference (`refs/gradscaler.json`, written by `tools/gradscaler_refs.py` with torch 2.15)
//! drove GradScaler through clean and overflowed steps and recorded whether the optimizer
//! stepped, the scale and the growth tracker after each `update()`.

use meshtrain_parallel::precision::{LossScaleConfig, LossScaler};
use serde::Deserialize;

#[derive(Deserialize)]
struct Step {
    overflow: bool,
    stepped: bool,
    scale: f32,
    growth_tracker: u32,
}

#[derive(Deserialize)]
struct Case {
    init_scale: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
    steps: Vec<Step>,
}

#[derive(Deserialize)]
struct Refs {
    cases: Vec<Case>,
}

#[test]
fn the_loss_scaler_replays_grad_scaler() {
    let text = include_str!("refs/gradscaler.json");
    let refs: Refs = serde_json::from_str(text).expect("refs/gradscaler.json parses");
    assert!(refs.cases.len() >= 3);
    for (c, case) in refs.cases.iter().enumerate() {
        let mut scaler = LossScaler::new(LossScaleConfig {
            init_scale: case.init_scale,
            growth_factor: case.growth_factor,
            backoff_factor: case.backoff_factor,
            growth_interval: case.growth_interval,
        });
        for (i, step) in case.steps.iter().enumerate() {
            // GradScaler steps the optimizer exactly when no gradient overflowed; we skip the
            // same steps (every worker agreeing on the flag is tested end to end).
            assert_eq!(
                step.stepped, !step.overflow,
                "case {c} step {i}: torch's own record"
            );
            scaler.update(step.overflow);
            assert_eq!(
                (scaler.scale, scaler.growth_tracker),
                (step.scale, step.growth_tracker),
                "case {c} step {i} (overflow: {})",
                step.overflow
            );
        }
    }
}
