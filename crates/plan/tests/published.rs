//! Validation against published runs: Table 1 of Narayanan et al. 2021 within ±15%.
//! The cost model has no per-row constants; the A100 preset's figures are datasheet and
//! nccl-tests-style numbers (see presets/clusters/a100-80gb.toml).

use meshtrain_plan::validation::{predict_narayanan, NARAYANAN_TABLE1};

#[test]
fn narayanan_table1_within_15_percent() {
    let mut worst: f64 = 0.0;
    for row in &NARAYANAN_TABLE1 {
        let p = predict_narayanan(row, 1).unwrap();
        assert!(
            p.evaluation.fits,
            "{}: published layout predicted not to fit",
            row.preset
        );
        assert!(
            p.error_percent.abs() <= 15.0,
            "{}: predicted {:.1} vs published {:.1} TFLOP/s ({:+.1}%)",
            row.preset,
            p.evaluation.throughput.tflops_per_gpu,
            row.published_tflops_per_gpu,
            p.error_percent
        );
        worst = worst.max(p.error_percent.abs());
    }
    eprintln!("worst error {worst:.1}%");
}

#[test]
fn hardware_flops_follow_narayanan_equation_3() {
    // With full recomputation the executed FLOPs are 96·B·s·l·h²(1 + s/(6h) + V/(16·l·h)).
    for row in &NARAYANAN_TABLE1 {
        let p = predict_narayanan(row, 1).unwrap();
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
fn korthikanti_530b_mfu_within_15_percent() {
    use meshtrain_plan::validation::{predict_korthikanti, KORTHIKANTI_530B};
    for run in &KORTHIKANTI_530B {
        let e = predict_korthikanti(run).unwrap();
        assert!(e.fits, "{}", run.label);
        let mfu = 100.0 * e.throughput.mfu;
        let err = (mfu - run.published_mfu_percent) / run.published_mfu_percent;
        assert!(
            err.abs() <= 0.15,
            "{}: predicted MFU {mfu:.1}% vs {}%",
            run.label,
            run.published_mfu_percent
        );
    }
}
