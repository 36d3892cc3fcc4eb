//! Tensor and sequence parallelism end to end (`Job::run`, as `meshtrain train`): GPT split
//! Megatron-style over tp workers — alone, with sequence parallelism, with data parallelism
//! and with a pipeline — must end with the parameters of one worker on the same global
//! batches, and its checkpoints must stay whole (resumable at any tp).
//!
//! Tolerance: the split changes only the order of floating-point sums (partial products
//! all-reduced, the softmax's sums split over the vocabulary, layer-norm gradients summed
//! over token shards), so after 10 steps parameters agree to a relative L2 distance of
//! 2e-4, as for data parallelism; observed ~1e-8–1e-7. Leaving out the sequence-parallel
//! sum of the replicated parameters' gradients moves them by orders of magnitude more.

use meshtrain::config::Config;
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_train::{RunOptions, Summary};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod common;
use common::{checkpoint_params, job, rel_diff, root, tiny_gpt_config};

const STEPS: u64 = 10;

fn config(out: &Path, extra: &[&str]) -> Config {
    tiny_gpt_config(out, STEPS, extra)
}

fn run(cfg: &Config, options: &RunOptions) -> Summary {
    (*job(cfg))
        .clone()
        .run(options)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// Trains `extra`'s layout and returns the parameters of the checkpoint it wrote (whole
/// tensors, read by one worker) and the checkpoint's path.
fn train(extra: &[&str], resume: Option<&Path>) -> (Vec<f32>, PathBuf) {
    let out = tempfile::tempdir().unwrap().keep();
    let cfg = config(&out, extra);
    let options = RunOptions {
        resume: resume.map(Path::to_path_buf),
        ..RunOptions::default()
    };
    let summary = run(&cfg, &options);
    assert_eq!(summary.steps, STEPS);
    let checkpoint = out.join("checkpoint.safetensors");
    (checkpoint_params(&cfg, &checkpoint), checkpoint)
}

#[test]
fn tensor_and_sequence_parallel_gpt_matches_one_worker() {
    let (single, _) = train(&[], None);
    for layout in [
        "tp=2",
        "tp=4",
        "tp=2,sp=on",
        "tp=4,sp=on",
        "dp=2,tp=2",
        "tp=2,pp=2,m=2",
        "dp=2,tp=2,pp=2,m=2,sp=on",
    ] {
        let setting = format!("parallel.layout=\"{layout}\"");
        let (params, _) = train(&[&setting], None);
        let d = rel_diff(&params, &single);
        eprintln!("{layout}: relative difference {d:.2e}");
        assert!(d <= 2e-4, "{layout}: {d:.2e}");
        assert!(
            params != single,
            "{layout}: not even a rounding difference?"
        );
    }
    // The single-master mode synchronises each (stage, tensor rank)'s replicas the same way.
    let (params, _) = train(
        &[
            "parallel.layout=\"dp=2,tp=2\"",
            "parallel.dp_mode=\"single-master\"",
        ],
        None,
    );
    let d = rel_diff(&params, &single);
    eprintln!("single master × tp=2: relative difference {d:.2e}");
    assert!(d <= 2e-4, "single master × tp=2: {d:.2e}");
}

/// A vocabulary that tp does not divide is padded; the padding takes no part in the loss.
/// Tied embeddings stay tied: both copies are split the same way.
#[test]
fn padded_vocabulary_and_tied_embeddings() {
    for extra in [
        ["model.vocab=258", "model.tie_embeddings=false"],
        ["model.vocab=256", "model.tie_embeddings=true"],
    ] {
        let (single, _) = train(&extra, None);
        let mut split = extra.to_vec();
        split.push("parallel.layout=\"tp=4,pp=2,m=2\"");
        let (params, _) = train(&split, None);
        let d = rel_diff(&params, &single);
        eprintln!("{extra:?} tp=4 × pp=2: relative difference {d:.2e}");
        assert!(d <= 2e-4, "{extra:?}: {d:.2e}");
    }
}

/// Under sequence parallelism each rank sees its tokens only, so layer norms', row-parallel
/// biases' and position embeddings' gradients are partial and must be summed over the
/// tensor-parallel group. Without that sum nothing errors; the model just trains wrong.
#[test]
fn sequence_parallel_without_the_replicated_gradient_sum_goes_wrong() {
    let out = tempfile::tempdir().unwrap().keep();
    let single = {
        let (params, _) = train(&[], None);
        params
    };
    let cfg = config(&out, &["parallel.layout=\"tp=2,sp=on\""]);
    let mut job = (*job(&cfg)).clone();
    job.parallel.skip_sequence_parallel_grad_sum = true;
    let job = Arc::new(job);
    let whole = ThreadsWorld::run(2, CommConfig::default(), move |group| {
        let mut t = job.trainer(group, Some(1))?;
        for _ in 0..STEPS {
            t.train_step()?;
        }
        let state = t.parallel.gather_state(&t.model, &t.whole)?;
        Ok::<_, anyhow::Error>(state.map(|(store, _)| store.values))
    })
    .unwrap_or_else(|e| panic!("{e}"))
    .remove(0)
    .unwrap();
    let d = rel_diff(&whole, &single);
    eprintln!("tp=2 + SP without the replicated-gradient sum: relative difference {d:.2e}");
    assert!(d > 1e-3, "only {d:.2e}: the sum would not be missed");
}

/// Checkpoints hold whole tensors: a tp = 2 checkpoint resumes at tp = 1 and tp = 4, and a
/// tp = 1 checkpoint at tp = 2, all continuing to the same parameters.
#[test]
fn checkpoints_resume_at_any_tensor_parallel_size() {
    let half = |layout: &str| {
        let out = tempfile::tempdir().unwrap().keep();
        let setting = format!("parallel.layout=\"{layout}\"");
        let mut cfg = config(&out, &[&setting]);
        cfg.train.max_steps = Some(STEPS / 2);
        run(&cfg, &RunOptions::default());
        out.join("checkpoint.safetensors")
    };
    let (straight, _) = train(&[], None);
    let from_tp2 = half("tp=2");
    let from_tp1 = half("dp=1");
    for (checkpoint, layout) in [
        (&from_tp2, "dp=1"),
        (&from_tp2, "tp=4,sp=on"),
        (&from_tp1, "tp=2"),
    ] {
        let setting = format!("parallel.layout=\"{layout}\"");
        let (params, _) = train(&[&setting], Some(checkpoint));
        let d = rel_diff(&params, &straight);
        eprintln!("resumed at {layout}: relative difference {d:.2e}");
        assert!(d <= 2e-4, "resumed at {layout}: {d:.2e}");
    }
}

#[test]
fn layouts_the_model_cannot_split_fail_before_any_work() {
    let text = std::fs::read_to_string(root().join("configs/gpt.toml")).unwrap();
    let err = |o: &[&str]| {
        let mut all: Vec<String> = ["model.dim=32", "model.heads=4", "model.seq=18"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        all.extend(o.iter().map(|s| s.to_string()));
        format!(
            "{:#}",
            Config::from_toml_with_overrides(&text, &all).expect_err("should be rejected")
        )
    };
    let e = err(&["parallel.tp=8"]);
    assert!(
        e.contains("has 4 attention heads, not divisible by tp (each tensor-parallel worker computes whole heads): choose tp among 2, 4"),
        "{e}"
    );
    let e = err(&["parallel.tp=4", "parallel.sequence_parallel=true"]);
    assert!(
        e.contains("sequence length (tokens per sample) is 18"),
        "{e}"
    );
    let e = err(&["parallel.sequence_parallel=true"]);
    assert!(e.contains("needs tp > 1"), "{e}");
    let e = err(&[
        "parallel.tp=2",
        "parallel.partition=\"time\"",
        "parallel.pp=2",
    ]);
    assert!(
        e.contains("partition 'time': it profiles the blocks on one worker"),
        "{e}"
    );
}
