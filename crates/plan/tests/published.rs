//! Validation against published runs: Table 1 of Narayanan et al. 2021 within ±10% with no
//! systematic sign. The cost model has no per-row constants; the A100 preset's compute rates
//! are measured (a published GEMM and streaming benchmark) and its links are nccl-tests-style
//! numbers (see presets/clusters/a100-80gb.toml).

use meshtrain_plan::validation::{predict_narayanan, NARAYANAN_TABLE1};

/// Table 1 with the paper's own micro-batch sizes, interleaving and DDP implementation (from
/// its artifact, `examples/sc21/run_table_1.sh`): every row within ±10%, and the errors do not
/// all lean one way (at least one row under and one over).
#[test]
fn narayanan_table1_with_published_micro_batches() {
    let mut errors = Vec::new();
    for row in &NARAYANAN_TABLE1 {
        let p = predict_narayanan(row).unwrap();
        assert!(
            p.evaluation.fits,
            "{}: published layout predicted not to fit",
            row.preset
        );
        eprintln!(
            "{:>9} mb={:<2} v={} predicted {:6.1} vs published {:5.1} TFLOP/s ({:+.1}%)",
            row.preset,
            row.micro_batch,
            row.interleave,
            p.evaluation.throughput.tflops_per_gpu,
            row.published_tflops_per_gpu,
            p.error_percent
        );
        assert!(
            p.error_percent.abs() <= 10.0,
            "{}: predicted {:.1} vs published {:.1} TFLOP/s ({:+.1}%)",
            row.preset,
            p.evaluation.throughput.tflops_per_gpu,
            row.published_tflops_per_gpu,
            p.error_percent
        );
        errors.push(p.error_percent);
    }
    let under = errors.iter().filter(|e| **e < 0.0).count();
    let over = errors.iter().filter(|e| **e > 0.0).count();
    let mean = errors.iter().sum::<f64>() / errors.len() as f64;
    eprintln!("{under} rows under, {over} over, mean error {mean:+.1}%");
    assert!(
        under >= 1 && over >= 1,
        "errors all of one sign: {errors:?}"
    );
    assert!(mean.abs() <= 5.0, "mean error {mean:+.1}%");
}

#[test]
fn hardware_flops_follow_narayanan_equation_3() {
    // With full recomputation the executed FLOPs are 96·B·s·l·h²(1 + s/(6h) + V/(16·l·h)).
    for row in &NARAYANAN_TABLE1 {
        let p = predict_narayanan(row).unwrap();
        let (b, s, l, h, v) = (
            row.batch as f64,
            2048.0,
            row.layers as f64,
            row.hidden as f64,
            51200.0,
        );
        let expected = 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h));
        let got = p.evaluation.throughput.hardware_flops;
        assert!(
            (got - expected).abs() / expected < 1e-9,
            "{}: {got:e} vs {expected:e}",
            row.preset
        );
        // Model FLOPs (no recomputation) are 72·B·s·l·h²(1 + s/(6h) + V/(12·l·h)).
        let model = 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h));
        let got = p.evaluation.throughput.model_flops;
        assert!((got - model).abs() / model < 1e-9);
    }
}

#[test]
fn korthikanti_530b_mfu_within_10_percent() {
    use meshtrain_plan::validation::{predict_korthikanti, KORTHIKANTI_530B};
    for run in &KORTHIKANTI_530B {
        let e = predict_korthikanti(run).unwrap();
        assert!(e.fits, "{}", run.label);
        let mfu = 100.0 * e.throughput.mfu;
        let err = (mfu - run.published_mfu_percent) / run.published_mfu_percent;
        assert!(
            err.abs() <= 0.10,
            "{}: predicted MFU {mfu:.1}% vs {}%",
            run.label,
            run.published_mfu_percent
        );
    }
}

/// torchtitan's FSDP2 runs (flash attention, ZeRO-3) side by side with the prediction.
#[test]
fn further_published_runs_side_by_side() {
    use meshtrain_plan::validation::{predict_published, PUBLISHED_RUNS};
    for run in &PUBLISHED_RUNS {
        let e = predict_published(run).unwrap();
        let predicted = e.throughput.tokens_per_s / run.gpus as f64;
        let err = 100.0 * (predicted - run.published_tokens_per_gpu) / run.published_tokens_per_gpu;
        eprintln!(
            "{}: predicted {predicted:.0} vs published {:.0} tokens/s/GPU ({err:+.1}%), fits {}, {:.1} GiB, dp exposed {:.0}% of step [{}]",
            run.label,
            run.published_tokens_per_gpu,
            e.fits,
            e.memory.total() / (1u64 << 30) as f64,
            100.0 * e.time.dp_exposed_s / e.time.step_s,
            run.source
        );
        // With eager element-wise kernels modelled, three runs are within ±4%; the 8B run's
        // selective-op checkpointing (every other matmul output recomputed) is modelled as
        // attention-core recomputation and stays optimistic (docs/planner.md).
        assert!(e.fits, "{}", run.label);
        assert!(err.abs() <= 20.0, "{}: {err:+.1}%", run.label);
    }
}
