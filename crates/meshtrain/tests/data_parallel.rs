//! Data parallelism end to end: N workers (threads backend) on a global batch B must end with
//! the parameters of one worker on the same global batch B, for every model and mode.
//!
//! Tolerances: replicas of one run must be bit-identical to each other (they apply the same
//! all-reduced gradient). Against the single worker, only the order of floating-point sums
//! differs (per-worker partial gradients averaged instead of one sum over the batch), so
//! after 20 steps parameters agree to `|a − b| ≤ 2e-4·max|b|` in f32 (observed ~1e-6–1e-5;
//! ResNet-18 needs SyncBatchNorm for this); bf16 gradients on the wire round every gradient
//! to 8 bits of mantissa, so that test uses 2e-2 and also checks the run is *not* bit-equal.

use meshtrain::config::Config;
use meshtrain_comm::{CommConfig, ThreadsWorld};

mod common;
use common::{job, root, single_trainer, TINY_GPT};

const STEPS: u64 = 20;

fn config(model: &str, extra: &[&str]) -> Config {
    let file = match model {
        "lenet" => "configs/lenet.toml",
        "resnet" => "configs/resnet18.toml",
        _ => "configs/gpt.toml",
    };
    let text = std::fs::read_to_string(root().join(file)).unwrap();
    let data = root().join("data/fashion-mnist-subset");
    let mut o: Vec<String> = match model {
        "lenet" => vec!["data.train_limit=1024".into()],
        "resnet" => vec![
            "model.width=4".into(),
            "train.batch_size=16".into(),
            "data.train_limit=512".into(),
        ],
        _ => TINY_GPT
            .iter()
            .map(|s| s.to_string())
            .chain([
                "train.batch_size=8".into(),
                "train.steps=40".into(),
                "schedule.warmup_steps=5".into(),
            ])
            .collect(),
    };
    o.push(format!("data.data_dir=\"{}\"", data.display()));
    o.push("data.test_limit=200".into());
    o.extend(extra.iter().map(|s| s.to_string()));
    Config::from_toml_with_overrides(&text, &o).unwrap()
}

/// Parameters of every rank after `STEPS` steps with `dp` workers (one thread each).
fn train(cfg: &Config, dp: usize) -> Vec<Vec<f32>> {
    train_steps(cfg, dp, STEPS, 0.0)
}

/// Parameters of every rank after `steps` steps with `dp` workers; `nudge` scales every 7th
/// initial weight by (1 + nudge) (a rounding-sized perturbation, to measure sensitivity).
fn train_steps(cfg: &Config, dp: usize, steps: u64, nudge: f32) -> Vec<Vec<f32>> {
    let mut cfg = cfg.clone();
    cfg.parallel.dp = dp;
    cfg.validate().unwrap();
    let job = job(&cfg);
    ThreadsWorld::run(dp, CommConfig::default(), move |group| {
        let mut t = job.trainer(group, Some(1))?;
        // Without a pipeline the stage is one chunk: the whole model.
        t.parallel.stage.chunks[0]
            .store
            .values
            .iter_mut()
            .step_by(7)
            .for_each(|v| *v *= 1.0 + nudge);
        for step in 0..steps {
            let loss = t.train_step()?.loss;
            anyhow::ensure!(loss.is_finite(), "loss {loss} at step {step}");
        }
        Ok::<_, anyhow::Error>(t.local_params())
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Relative L2 distance ‖a − b‖ / ‖b‖ (in f64).
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let norm = |it: &mut dyn Iterator<Item = f64>| it.map(|v| v * v).sum::<f64>().sqrt();
    let diff = norm(&mut a.iter().zip(b).map(|(x, y)| (*x - *y) as f64));
    (diff / norm(&mut b.iter().map(|&v| v as f64))) as f32
}

fn assert_equivalent(model: &str, extra: &[&str], workers: &[usize], tol: f32) -> Vec<f32> {
    let cfg = config(model, extra);
    let single = train(&cfg, 1).remove(0);
    let mut diffs = Vec::new();
    for &n in workers {
        let ranks = train(&cfg, n);
        for (r, v) in ranks.iter().enumerate().skip(1) {
            assert!(
                v == &ranks[0],
                "{model} {extra:?}: rank {r} of {n} diverged from rank 0"
            );
        }
        let d = rel_diff(&ranks[0], &single);
        eprintln!("{model} {extra:?}: {n} workers vs 1: relative difference {d:.2e}");
        assert!(
            d <= tol,
            "{model} {extra:?} with {n} workers: difference {d:.2e} > {tol:.0e}"
        );
        diffs.push(d);
    }
    diffs
}

const TOL: f32 = 2e-4;

#[test]
fn lenet_ddp_matches_one_worker() {
    assert_equivalent("lenet", &[], &[2, 4], TOL);
}

#[test]
fn gpt_ddp_matches_one_worker() {
    assert_equivalent("gpt", &[], &[2, 4], TOL);
}

/// ResNet-18 (ReLU, max pooling, batch norm) is chaotic at the rounding level even on one
/// worker: where a pre-activation sits within rounding of zero, or two pooled values tie, the
/// last bit of a sum decides which way the gradient flows. A single worker whose initial
/// weights are nudged by 1e-7 ends 20 steps ~5e-2 away from the un-nudged run. So for ResNet
/// we check (1) the first steps tightly, before any such flip, and (2) after 20 steps that the
/// data-parallel run stays inside the single worker's own rounding envelope — while plain
/// (per-worker) BatchNorm is far outside both.
#[test]
fn resnet_with_sync_batch_norm_matches_one_worker_and_without_does_not() {
    let sync = config("resnet", &["parallel.sync_batch_norm=true"]);
    let plain = config("resnet", &[]);
    let single = train_steps(&sync, 1, 3, 0.0).remove(0);
    for n in [2, 4] {
        let d = rel_diff(&train_steps(&sync, n, 3, 0.0)[0], &single);
        eprintln!("resnet SyncBN, 3 steps: {n} workers vs 1: {d:.2e}");
        assert!(d < 1e-6, "SyncBN with {n} workers after 3 steps: {d:.2e}");
    }
    let d_plain = rel_diff(&train_steps(&plain, 2, 3, 0.0)[0], &single);
    eprintln!("resnet plain BN, 3 steps: 2 workers vs 1: {d_plain:.2e}");
    assert!(
        d_plain > 1e-4,
        "plain BN with 2 workers differs by only {d_plain:.2e}"
    );

    let single = train(&sync, 1).remove(0);
    let envelope = rel_diff(&train_steps(&sync, 1, STEPS, 1e-7)[0], &single);
    for n in [2, 4] {
        let d = rel_diff(&train(&sync, n)[0], &single);
        eprintln!(
            "resnet SyncBN, 20 steps: {n} workers vs 1: {d:.2e} (1-worker envelope {envelope:.2e})"
        );
        assert!(
            d < 3.0 * envelope,
            "SyncBN with {n} workers: {d:.2e}, envelope {envelope:.2e}"
        );
    }
    let d_plain = rel_diff(&train(&plain, 2)[0], &single);
    eprintln!("resnet plain BN, 20 steps: 2 workers vs 1: {d_plain:.2e}");
    assert!(
        d_plain > 3.0 * envelope,
        "plain BN: {d_plain:.2e} within envelope {envelope:.2e}"
    );
}

#[test]
fn accumulation_matches_one_worker_without_accumulation() {
    // No batch norm in LeNet/GPT, so micro-batching changes only the order of sums.
    assert_equivalent("lenet", &["train.accumulation_steps=2"], &[2], TOL);
    assert_equivalent("gpt", &["train.accumulation_steps=4"], &[2], TOL);
}

#[test]
fn bf16_gradients_on_the_wire_stay_close() {
    let d = assert_equivalent("lenet", &["parallel.compression=\"bf16\""], &[2], 2e-2);
    assert!(d[0] > 0.0, "bf16 compression had no effect at all");
}

#[test]
fn single_master_mode_matches_one_worker() {
    assert_equivalent(
        "lenet",
        &["parallel.dp_mode=\"single-master\""],
        &[2, 4],
        TOL,
    );
    let cfg = config(
        "resnet",
        &[
            "parallel.dp_mode=\"single-master\"",
            "parallel.sync_batch_norm=true",
        ],
    );
    let d = rel_diff(
        &train_steps(&cfg, 2, 3, 0.0)[0],
        &train_steps(&cfg, 1, 3, 0.0)[0],
    );
    assert!(
        d < 1e-6,
        "single-master ResNet with SyncBN after 3 steps: {d:.2e}"
    );
}

#[test]
fn overlap_off_and_tiny_buckets_give_the_same_result() {
    // Many buckets launched during backward, or all after it: same gradients.
    let a = train(
        &config(
            "gpt",
            &[
                "parallel.bucket_cap_mb=0.01",
                "parallel.first_bucket_mb=0.001",
            ],
        ),
        2,
    );
    let b = train(&config("gpt", &["parallel.overlap=false"]), 2);
    assert_eq!(a[0], b[0]);
}

#[test]
fn distributed_evaluation_counts_every_sample_once() {
    let cfg = config("lenet", &["data.test_limit=334"]);
    let expect = single_trainer(&cfg).evaluate().unwrap().unwrap();
    assert_eq!(expect.samples, 334.0);
    let mut cfg3 = cfg.clone();
    cfg3.train.batch_size = 33;
    cfg3.parallel.dp = 3;
    let job = job(&cfg3);
    let got = ThreadsWorld::run(3, CommConfig::default(), move |g| {
        let mut t = job.trainer(g, Some(1))?;
        t.evaluate()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for sums in got {
        let sums = sums.unwrap();
        assert_eq!(
            sums.accuracy(),
            expect.accuracy(),
            "accuracy over 334 test images split 112/111/111"
        );
        let (loss, want) = (sums.mean_loss(), expect.mean_loss());
        assert!((loss - want).abs() < 1e-6, "{loss} vs {want}");
    }
}

#[test]
fn layout_errors_are_clear() {
    let text = std::fs::read_to_string(root().join("configs/lenet.toml")).unwrap();
    let err = Config::from_toml_with_overrides(&text, &["parallel.dp=3".into()]).unwrap_err();
    assert!(format!("{err:#}").contains("divide evenly"), "{err:#}");
}
