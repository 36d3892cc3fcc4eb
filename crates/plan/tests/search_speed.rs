//! The requirement: searching 30B and 70B models on 32 H100s takes under a second.
//! The strict bound is asserted in optimised builds (`cargo test --release`); debug builds
//! (opt-level 1 in this workspace) get a looser bound so CI on a loaded machine stays green.

use std::time::Instant;

use meshtrain_plan::presets;
use meshtrain_plan::search::search_feasible;
use meshtrain_plan::{Precision, Problem, TrainingSetup};

#[test]
fn search_30b_and_70b_on_32_h100_under_a_second() {
    let cluster = presets::cluster("h100").unwrap().with_gpus(32).unwrap();
    let start = Instant::now();
    let mut evaluated = 0;
    for model in ["gpt-30b", "llama-70b"] {
        let problem = Problem::new(
            presets::model(model).unwrap(),
            cluster.clone(),
            TrainingSetup::new(512, Precision::Bf16),
        )
        .unwrap();
        let result = search_feasible(&problem).unwrap();
        assert!(!result.ranked.is_empty());
        evaluated += result.candidates;
    }
    let elapsed = start.elapsed().as_secs_f64();
    eprintln!("searched {evaluated} layouts in {elapsed:.3} s");
    let limit = if cfg!(debug_assertions) { 5.0 } else { 1.0 };
    assert!(
        elapsed < limit,
        "{elapsed:.3} s for {evaluated} layouts (limit {limit} s)"
    );
}
