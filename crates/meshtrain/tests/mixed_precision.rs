//! Mixed precision end to end (`Job::run`, as `meshtrain train --precision`): bf16 runs on
//! every layout against one bf16 worker, fp16's loss scaler skipping an overflowed step on
//! every worker at once, and the scaler's state surviving a checkpoint.
//!
//! Tolerance for bf16 layouts against one bf16 worker: a layout changes the order of f32 sums
//! (as in fp32, ~1e-7), and a value that then lands on the other side of a bf16 rounding
//! boundary moves by up to 2⁻⁹ of itself in the next product; after 10 steps the parameters
//! of the tiny GPT agree to a relative L2 distance below 2e-3 (observed 6e-5 to 1e-3), while
//! bf16 and fp32 differ by 1.3e-3 and fp32 layouts by ~1e-7 from each other.

use meshtrain_train::{RunOptions, Summary};
use std::path::{Path, PathBuf};

mod common;
use common::{job, rel_diff, single_trainer, tiny_gpt_config};

const STEPS: u64 = 10;

struct Run {
    params: Vec<f32>,
    /// (loss scale, skipped steps so far) per step, from metrics.jsonl.
    scales: Vec<(f32, u64)>,
    /// The training loss per step, from metrics.jsonl.
    losses: Vec<f64>,
    checkpoint: PathBuf,
    summary: Summary,
}

/// Trains `extra`'s settings (with an overflow injected at `(step, world rank)` if given) and
/// reads back the parameters of the checkpoint it wrote, whole, on one worker.
fn train(extra: &[&str], inject: Option<(u64, usize)>, resume: Option<&Path>) -> Run {
    let out = tempfile::tempdir().unwrap().keep();
    let mut settings = vec!["train.log_every=1"];
    settings.extend_from_slice(extra);
    let cfg = tiny_gpt_config(&out, STEPS, &settings);
    let mut job = (*job(&cfg)).clone();
    job.parallel.inject_overflow = inject;
    let options = RunOptions {
        resume: resume.map(Path::to_path_buf),
        ..RunOptions::default()
    };
    let summary = job.run(&options).unwrap_or_else(|e| panic!("{e:#}"));
    let checkpoint = out.join("checkpoint.safetensors");
    let mut single = cfg.clone();
    single.parallel.tp = 1;
    let mut t = single_trainer(&single);
    t.resume(&checkpoint).unwrap_or_else(|e| panic!("{e:#}"));
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .collect();
    let losses = records.iter().filter_map(|v| v["loss"].as_f64()).collect();
    let scales = records
        .iter()
        .filter_map(|v| {
            Some((
                v["loss_scale"].as_f64()? as f32,
                v["skipped_steps"].as_u64()?,
            ))
        })
        .collect();
    Run {
        params: t.local_params(),
        scales,
        losses,
        checkpoint,
        summary,
    }
}

#[test]
fn bf16_runs_on_every_layout_match_one_bf16_worker() {
    let fp32 = train(&[], None, None);
    let single = train(&["train.precision=\"bf16\""], None, None);
    assert_eq!(single.summary.steps, STEPS);
    let bf16_vs_fp32 = rel_diff(&single.params, &fp32.params);
    eprintln!("bf16 vs fp32 after {STEPS} steps: {bf16_vs_fp32:.2e}");
    for layout in [
        "dp=2",
        "tp=2",
        "tp=4,sp=on",
        "pp=2,m=2",
        "dp=2,tp=2,pp=2,m=2",
    ] {
        let setting = format!("parallel.layout=\"{layout},precision=bf16\"");
        let run = train(&[&setting], None, None);
        let d = rel_diff(&run.params, &single.params);
        eprintln!("bf16 {layout}: relative difference to one bf16 worker {d:.2e}");
        assert!(d <= 2e-3, "{layout}: {d:.2e}");
        // A layout that ran in fp32 would sit ~1e-7 from the fp32 run (tensor_parallel.rs).
        let from_fp32 = rel_diff(&run.params, &fp32.params);
        assert!(from_fp32 > 1e-4, "{layout}: ran in fp32? {from_fp32:.2e}");
    }
    // DDP reduces gradients in f32 unless asked for bf16 on the wire: that rounds each
    // bucket's gradients once more, so allow more.
    let wire = train(
        &[
            "train.precision=\"bf16\"",
            "parallel.dp=2",
            "parallel.compression=\"bf16\"",
        ],
        None,
        None,
    );
    let d = rel_diff(&wire.params, &single.params);
    eprintln!("bf16 dp=2 with bf16 gradients on the wire: {d:.2e}");
    assert!(d <= 5e-3, "bf16 wire: {d:.2e}");
}

/// fp8 (bf16 with the inner blocks' linear products in FP8 at per-tensor current scales) on
/// every layout against one fp8 worker.
///
/// Each cast's scale comes from the tensor it casts, so one worker matches a layout only when
/// it casts the same tensors. A data-parallel replica and a pipeline micro-batch cast their
/// micro-batch's activations: one worker running micro-batches of the same size casts the
/// same ones. A tensor-parallel rank casts a shard (of a weight, of a row-parallel input, of
/// a column-parallel output gradient) at the scale its group agreed on, the whole tensor's
/// (`Linear::fp8_shards`). So the first step's loss, before any update, is one worker's on
/// every layout (observed equal; without the agreement tensor parallelism's was 4e-5 to 1e-4
/// away, a shard's values landing on other FP8 grid points). After that the runs part as
/// bf16 layouts do (f32 sums in another order; a value on the other side of a rounding
/// boundary, which FP8's coarse grid moves further): observed 7e-5 (dp = 2), 0 (pp = 2) and
/// 1.0e-3 to 2.2e-3 with tensor parallelism (4.4e-3 to 5.1e-3 without the agreement) after
/// 10 steps, against 4.3e-3 between fp8 and bf16.
#[test]
fn fp8_runs_on_every_layout_match_one_fp8_worker() {
    let bf16 = train(&["train.precision=\"bf16\""], None, None);
    let whole = train(&["train.precision=\"fp8\""], None, None);
    let fp8_vs_bf16 = rel_diff(&whole.params, &bf16.params);
    eprintln!("fp8 vs bf16 after {STEPS} steps: {fp8_vs_bf16:.2e}");
    assert!(fp8_vs_bf16 > 1e-3, "fp8 ran as bf16? {fp8_vs_bf16:.2e}");
    assert_eq!(whole.summary.steps, STEPS);
    // One worker in micro-batches of a half and of a quarter of the batch.
    let halves = train(&["parallel.layout=\"dp=1,m=2,precision=fp8\""], None, None);
    let quarters = train(&["parallel.layout=\"dp=1,m=4,precision=fp8\""], None, None);
    for (layout, one) in [
        ("dp=2", &halves),
        ("pp=2,m=2", &halves),
        ("tp=2", &whole),
        ("tp=4,sp=on", &whole),
        ("dp=2,tp=2,pp=2,m=2", &quarters),
    ] {
        let setting = format!("parallel.layout=\"{layout},precision=fp8\"");
        let run = train(&[&setting], None, None);
        let first = ((run.losses[0] - one.losses[0]) / one.losses[0]).abs();
        let d = rel_diff(&run.params, &one.params);
        eprintln!(
            "fp8 {layout}: first loss {first:.1e} from one fp8 worker's, parameters {d:.2e} \
             after {STEPS} steps"
        );
        assert!(first <= 1e-6, "{layout}: first loss {first:.2e} apart");
        assert!(d <= 3e-3, "{layout}: {d:.2e}");
        let worst = run
            .losses
            .iter()
            .zip(&one.losses)
            .map(|(a, b)| ((a - b) / b).abs())
            .fold(0.0f64, f64::max);
        assert!(worst <= 0.01, "{layout}: losses {worst:.2e} apart");
    }
}

/// An overflow reported by one worker at step 3: every worker skips that step (their
/// parameters stay equal to one worker that skipped it too), the scale halves, and training
/// goes on to the end. One worker that did not skip ends elsewhere.
#[test]
fn fp16_overflow_on_one_worker_skips_the_step_on_every_worker() {
    let fp16 = "train.precision=\"fp16\"";
    let clean = train(&[fp16], None, None);
    assert_eq!(clean.scales.len(), STEPS as usize);
    assert!(clean.scales.iter().all(|&s| s == (65536.0, 0)));
    let skipped = train(&[fp16], Some((3, 0)), None);
    assert_eq!(skipped.summary.steps, STEPS);
    assert_eq!(skipped.scales[2], (65536.0, 0));
    assert_eq!(skipped.scales[3], (32768.0, 1), "step 4 was skipped");
    assert_eq!(skipped.scales[9], (32768.0, 1));
    let skip_effect = rel_diff(&skipped.params, &clean.params);
    eprintln!("one skipped step moves the parameters by {skip_effect:.2e}");
    assert!(skip_effect > 1e-3);
    for layout in ["dp=2", "pp=2,m=2", "tp=2"] {
        let setting = format!("parallel.layout=\"{layout}\"");
        let run = train(&[fp16, &setting], Some((3, 1)), None);
        assert_eq!(run.scales[3], (32768.0, 1), "{layout}");
        let d = rel_diff(&run.params, &skipped.params);
        eprintln!("fp16 {layout}, overflow on rank 1: {d:.2e} from one worker that skipped");
        assert!(d < skip_effect / 10.0, "{layout}: {d:.2e}");
    }
}

/// The scaler's state is part of the checkpoint: 5 steps, save, 5 more equals 10 in one go,
/// with the scale growing every 3 clean steps (so a scaler started afresh would differ).
#[test]
fn fp16_loss_scaler_state_survives_a_checkpoint() {
    let settings = [
        "train.precision=\"fp16\"",
        "train.loss_scale.growth_interval=3",
    ];
    let whole = train(&settings, None, None);
    let scales: Vec<f32> = whole.scales.iter().map(|s| s.0).collect();
    assert_eq!(scales[2], 131072.0);
    assert_eq!(scales[9], 524288.0);
    let mut first: Vec<&str> = settings.to_vec();
    first.push("train.max_steps=5");
    let half = train(&first, None, None);
    let resumed = train(&settings, None, Some(&half.checkpoint));
    assert_eq!(resumed.summary.steps, STEPS);
    assert_eq!(resumed.scales.last(), whole.scales.last());
    assert_eq!(resumed.params, whole.params, "resumed fp16 run differs");
}
