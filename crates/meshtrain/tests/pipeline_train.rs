//! Pipeline parallelism end to end, through the same entry point as `meshtrain train`
//! (`Job::run`): a `pp`-stage (× `dp`-replica) run must end with the parameters of one
//! worker on the same global batches, write the standard checkpoint file, resume exactly, and
//! reject impossible layouts before any work starts.
//!
//! What "the same" means:
//! * **GPT** (no batch norm): against one worker on the full batch, only the order of the
//!   gradient sums differs (micro-batches accumulated, replicas averaged, the clipping norm
//!   summed per stage). Tolerance: relative L2 distance ≤ 2e-4 after 10 steps, as for data
//!   parallelism (`tests/data_parallel.rs`); observed ≤ 1e-6.
//! * **ResNet-18** (batch norm): statistics are per micro-batch, so the full-batch single
//!   worker is not the same computation. The fair reference runs the *same micro-batches*
//!   without a pipeline: `dp` data-parallel workers (one worker for dp = 1), each
//!   accumulating gradients over its share split into `m` micro-batches
//!   (`train.accumulation_steps = m`). The stages run the same kernels on the same data in
//!   the same order, and the DDP average is element-wise whatever the buckets, so the
//!   result must be **bit-identical**. (The distributed sampler deals samples round-robin,
//!   so with dp = 2 a replica's micro-batches are not contiguous rows of the global batch
//!   and no single worker accumulating contiguous micro-batches sees the same batch-norm
//!   statistics; `data_parallel.rs` relates dp workers to one worker, with SyncBatchNorm.)
//!
//! Parameters are read back from the checkpoint each run writes at its end, so every
//! comparison also checks that a pipeline checkpoint is a complete standard checkpoint.

use meshtrain::config::Config;
use meshtrain_train::launch::mpi_data_parallel_size;
use meshtrain_train::{RunOptions, Summary};
use std::path::{Path, PathBuf};

mod common;
use common::{job, rel_diff, root, single_trainer, TINY_GPT};

const STEPS: u64 = 10;

/// The tiny GPT (4 blocks: embedding, 2 layers, head) or ResNet-18 (width 4), 10 steps.
fn config(model: &str, out: &Path, extra: &[String]) -> Config {
    let (file, mut o): (&str, Vec<String>) = match model {
        "gpt" => (
            "configs/gpt.toml",
            TINY_GPT
                .iter()
                .map(|s| s.to_string())
                .chain([
                    "train.batch_size=8".into(),
                    "train.steps=40".into(),
                    "train.eval_every=5".into(),
                    "train.eval_batches=2".into(),
                    "schedule.warmup_steps=5".into(),
                ])
                .collect(),
        ),
        _ => (
            "configs/resnet18.toml",
            vec![
                "model.width=4".into(),
                "train.batch_size=16".into(),
                "data.train_limit=512".into(),
                "data.test_limit=64".into(),
            ],
        ),
    };
    let data = root().join("data/fashion-mnist-subset");
    o.push(format!("data.data_dir=\"{}\"", data.display()));
    o.push(format!("train.out_dir=\"{}\"", out.display()));
    o.push(format!("train.max_steps={STEPS}"));
    o.push("train.threads=1".into());
    o.push("train.log_every=1000".into());
    o.extend(extra.iter().cloned());
    let text = std::fs::read_to_string(root().join(file)).unwrap();
    Config::from_toml_with_overrides(&text, &o).unwrap_or_else(|e| panic!("{e:#}"))
}

fn strings(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

/// Runs the job like `meshtrain train` and returns the parameters of the checkpoint it
/// wrote at its end, read by a single-worker trainer.
fn train(model: &str, extra: &[String], resume: Option<&Path>) -> (Vec<f32>, PathBuf) {
    let out = tempfile::tempdir().unwrap().keep();
    let cfg = config(model, &out, extra);
    let options = RunOptions {
        resume: resume.map(Path::to_path_buf),
        ..RunOptions::default()
    };
    let summary = run(&cfg, &options).unwrap_or_else(|e| panic!("{extra:?}: {e:#}"));
    assert_eq!(summary.steps, STEPS);
    assert!(summary.final_train_loss.is_finite());
    let checkpoint = out.join("checkpoint.safetensors");
    (read_params(&cfg, &checkpoint), checkpoint)
}

/// Runs the job `cfg` describes, as `meshtrain train` does.
fn run(cfg: &Config, options: &RunOptions) -> anyhow::Result<Summary> {
    (*job(cfg)).clone().run(options)
}

fn read_params(cfg: &Config, checkpoint: &Path) -> Vec<f32> {
    let mut single = cfg.clone();
    single.parallel.dp = 1;
    single.parallel.pp = 1;
    single.parallel.micro_batches = 1;
    let mut t = single_trainer(&single);
    t.resume(checkpoint).unwrap();
    assert_eq!(t.step, STEPS);
    t.local_params()
}

fn layout(dp: usize, pp: usize, schedule: &str, m: usize) -> Vec<String> {
    strings(&[
        &format!("parallel.dp={dp}"),
        &format!("parallel.pp={pp}"),
        &format!("parallel.schedule=\"{schedule}\""),
        &format!("parallel.micro_batches={m}"),
    ])
}

const LAYOUTS: [(usize, usize, &str, usize); 5] = [
    (1, 2, "gpipe", 4),
    (1, 2, "1f1b", 4),
    (1, 2, "interleaved", 2),
    (2, 2, "1f1b", 2),
    (2, 2, "interleaved", 2),
];

#[test]
fn gpt_pipeline_matches_one_worker() {
    let (single, _) = train("gpt", &[], None);
    for (dp, pp, schedule, m) in LAYOUTS {
        let (params, _) = train("gpt", &layout(dp, pp, schedule, m), None);
        let d = rel_diff(&params, &single);
        eprintln!("gpt dp={dp} pp={pp} {schedule} m={m}: relative difference {d:.2e}");
        assert!(d <= 2e-4, "gpt dp={dp} pp={pp} {schedule} m={m}: {d:.2e}");
        assert_ne!(params, vec![0.0; params.len()]);
    }
}

#[test]
fn resnet_pipeline_matches_the_same_micro_batches_without_a_pipeline() {
    for (dp, pp, schedule, m) in LAYOUTS {
        let reference = strings(&[
            &format!("parallel.dp={dp}"),
            &format!("train.accumulation_steps={m}"),
        ]);
        let (expected, _) = train("resnet", &reference, None);
        let (params, _) = train("resnet", &layout(dp, pp, schedule, m), None);
        let d = rel_diff(&params, &expected);
        eprintln!("resnet dp={dp} pp={pp} {schedule} m={m}: relative difference {d:.2e}");
        assert!(
            params == expected,
            "resnet dp={dp} pp={pp} {schedule} m={m}: {d:.2e} from dp={dp} without a pipeline"
        );
    }
}

/// Data-parallel modes compose with a pipeline because both act per chunk: SyncBatchNorm
/// sums each stage's statistics over that stage's replicas, the single master of each stage
/// gathers and broadcasts that stage's parameters. Against the same micro-batches without a
/// pipeline both are bit-identical.
#[test]
fn sync_batch_norm_and_single_master_compose_with_a_pipeline() {
    for mode in [
        "parallel.sync_batch_norm=true",
        "parallel.dp_mode=\"single-master\"",
    ] {
        let mut reference = strings(&["parallel.dp=2", "train.accumulation_steps=2"]);
        reference.push(mode.into());
        let (expected, _) = train("resnet", &reference, None);
        let mut piped = layout(2, 2, "1f1b", 2);
        piped.push(mode.into());
        let (params, _) = train("resnet", &piped, None);
        assert!(
            params == expected,
            "{mode}: {:.2e} from dp=2 without a pipeline",
            rel_diff(&params, &expected)
        );
    }
}

#[test]
fn partitions_and_send_modes_train_the_same_model() {
    let (single, _) = train("gpt", &[], None);
    let settings = [
        "parallel.partition=\"time\"",
        "parallel.partition=\"balanced\"",
        "parallel.partition=\"explicit:1\"",
        "parallel.partition=\"explicit:3\"",
        "parallel.sends=\"inline\"",
    ];
    for setting in settings {
        let mut extra = layout(1, 2, "1f1b", 4);
        extra.push(setting.to_string());
        let (params, _) = train("gpt", &extra, None);
        let d = rel_diff(&params, &single);
        assert!(d <= 2e-4, "{setting}: {d:.2e}");
    }
}

#[test]
fn resuming_a_pipeline_checkpoint_continues_exactly() {
    let extra = layout(2, 2, "1f1b", 2);
    let (straight, _) = train("gpt", &extra, None);
    // The first half, then a second run from its checkpoint.
    let mut half = extra.clone();
    half.push("train.steps=40".into());
    let out = tempfile::tempdir().unwrap().keep();
    let mut cfg = config("gpt", &out, &half);
    cfg.train.max_steps = Some(STEPS / 2);
    run(&cfg, &RunOptions::default()).unwrap_or_else(|e| panic!("{e:#}"));
    let (resumed, _) = train("gpt", &extra, Some(&out.join("checkpoint.safetensors")));
    assert_eq!(resumed, straight, "resumed pipeline run differs");
    // The checkpoint is a standard one: another layout (here 1F1B on 2 stages without data
    // parallelism, with another micro-batch count) continues from it just as well.
    let (other, _) = train(
        "gpt",
        &layout(1, 2, "gpipe", 4),
        Some(&out.join("checkpoint.safetensors")),
    );
    let d = rel_diff(&other, &straight);
    assert!(d <= 2e-4, "resumed in another layout: {d:.2e}");
}

#[test]
fn impossible_layouts_fail_before_any_work_with_a_clear_message() {
    // The tiny GPT (4 blocks) with a global batch of 12.
    let text = std::fs::read_to_string(root().join("configs/gpt.toml")).unwrap();
    let err = |extra: &[String]| {
        let mut o = strings(&TINY_GPT);
        o.push("train.batch_size=12".into());
        o.extend(extra.iter().cloned());
        format!(
            "{:#}",
            Config::from_toml_with_overrides(&text, &o).expect_err("layout should be rejected")
        )
    };
    let rejected = [
        (
            (1, 5, "1f1b", 1),
            "5 stages, but the model has only 4 blocks",
        ),
        (
            (1, 3, "interleaved", 3),
            "6 stages, but the model has only 4 blocks",
        ),
        (
            (1, 2, "interleaved", 3),
            "number of micro-batches (3) to be a multiple of the number of pipeline workers (2)",
        ),
        (
            (2, 2, "1f1b", 4),
            "train.batch_size 12 must divide evenly over dp=2 replicas × 4 micro-batches",
        ),
        ((1, 2, "zigzag", 2), "unknown pipeline schedule 'zigzag'"),
    ];
    for ((dp, pp, schedule, m), expected) in rejected {
        let e = err(&layout(dp, pp, schedule, m));
        assert!(e.contains(expected), "{e}");
    }
    let mut cuts = layout(1, 2, "1f1b", 2);
    cuts.push("parallel.partition=\"explicit:1,2\"".into());
    let e = err(&cuts);
    assert!(e.contains("makes 3 stages, the layout needs 2"), "{e}");
    let mut accumulate = layout(1, 2, "1f1b", 2);
    accumulate.push("train.accumulation_steps=2".into());
    let e = err(&accumulate);
    assert!(
        e.contains("train.accumulation_steps=2 does not combine"),
        "{e}"
    );
    let mut both = strings(&["parallel.micro_batches=2"]);
    both.push("train.accumulation_steps=3".into());
    let e = err(&both);
    assert!(e.contains("both split each replica's batch"), "{e}");
    let mut sends = layout(1, 2, "1f1b", 2);
    sends.push("parallel.sends=\"later\"".into());
    let e = err(&sends);
    assert!(e.contains("unknown parallel.sends 'later'"), "{e}");
    // A layout string names the numbers the same way.
    let e = err(&strings(&["parallel.layout=\"dp=2,pp=2,m=4\""]));
    assert!(
        e.contains("train.batch_size 12 must divide evenly over dp=2 replicas × 4"),
        "{e}"
    );
    let e = err(&strings(&["parallel.layout=\"tp=4\""]));
    assert!(
        e.contains("has 2 attention heads, not divisible by tp"),
        "{e}"
    );
    let e = err(&strings(&["parallel.layout=\"cp=3\""]));
    assert!(
        e.contains(
            "cp=3: the sequence length is 16, not divisible by 6 (2 × cp: under a causal mask"
        ),
        "{e}"
    );
    let e = mpi_data_parallel_size(2, 2, 6).unwrap_err().to_string();
    assert!(
        e.contains("dp=2 × 2 worker(s) per replica = 4 but mpirun started 6 processes"),
        "{e}"
    );
    assert!(e.contains("(--dp 3)"), "{e}");
    // One stage is a one-chunk pipeline: micro-batches are gradient accumulation, and the
    // timeline works for every layout.
    let text = std::fs::read_to_string(root().join("configs/gpt.toml")).unwrap();
    let mut o = strings(&TINY_GPT);
    o.extend(strings(&[
        "parallel.micro_batches=2",
        "parallel.timeline=\"t.json\"",
    ]));
    Config::from_toml_with_overrides(&text, &o).unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn timeline_holds_every_forward_and_backward_of_the_last_step() {
    let dir = tempfile::tempdir().unwrap().keep();
    let trace = dir.join("step.json");
    let mut extra = layout(2, 2, "1f1b", 2);
    extra.push(format!("parallel.timeline=\"{}\"", trace.display()));
    train("gpt", &extra, None);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    for worker in 0..4u64 {
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == worker)
            .filter_map(|e| e["name"].as_str())
            .collect();
        for expected in ["F0", "F1", "B0", "B1", "opt", "dp all-reduce wait"] {
            let count = names.iter().filter(|&&n| n == expected).count();
            assert_eq!(
                count, 1,
                "worker {worker}: {expected} × {count} in {names:?}"
            );
        }
    }
    let png = std::fs::metadata(trace.with_extension("png")).unwrap();
    assert!(
        png.len() > 1000,
        "PNG of the timeline is {} bytes",
        png.len()
    );
}
