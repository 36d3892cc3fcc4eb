//! Context parallelism (one sequence spread over `cp` workers) against one worker holding the
//! whole sequence: 10 GPT steps on the same global batch end at the same parameters up to
//! the order of floating-point sums (ring attention merges key blocks in another order;
//! relative L2 ≤ 2e-4, as every layout-equivalence test), alone and composed with data,
//! tensor (with and without sequence parallelism) and pipeline parallelism and ZeRO. Layouts
//! that cannot run are refused before work with the numbers; a worker keeps about `1/cp` of
//! the activations.

use meshtrain::config::Config;
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_nn::{Params, ParamsMut};
use meshtrain_train::RunOptions;

mod common;
use common::{
    checkpoint_params, job, rel_diff, root, tiny_gpt_config, tiny_gpt_config_result, train_until,
    written_checkpoint,
};

const STEPS: u64 = 10;

/// Parameters after 10 steps and the last evaluation loss.
fn train(extra: &[&str]) -> (Vec<f32>, f64) {
    let out = tempfile::tempdir().unwrap().keep();
    let cfg = tiny_gpt_config(&out, STEPS, extra);
    let summary = (*job(&cfg))
        .clone()
        .run(&RunOptions::default())
        .unwrap_or_else(|e| panic!("{extra:?}: {e:#}"));
    let eval = summary.eval_loss.expect("evaluated");
    (checkpoint_params(&cfg, &written_checkpoint(&out)), eval)
}

#[test]
fn ring_and_ulysses_train_like_one_worker_on_every_layout() {
    let (single, single_eval) = train(&[]);
    for layout in [
        vec!["parallel.cp=2"],
        vec!["parallel.cp=4"],
        vec!["parallel.cp=2", "parallel.cp_mode=\"ulysses\""],
        vec!["parallel.cp=4", "parallel.cp_mode=\"ulysses\""],
        vec!["parallel.cp=2", "parallel.dp=2"],
        vec![
            "parallel.cp=2",
            "parallel.dp=2",
            "parallel.cp_mode=\"ulysses\"",
        ],
        vec!["parallel.cp=2", "parallel.tp=2"],
        vec![
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.cp_mode=\"ulysses\"",
        ],
        vec!["parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2"],
        vec!["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"],
        // Ulysses runs the model's own kernel on whole sequences: here the standard one.
        vec![
            "parallel.cp=2",
            "model.attention=\"standard\"",
            "parallel.cp_mode=\"ulysses\"",
        ],
    ] {
        let (params, eval) = train(&layout);
        let d = rel_diff(&params, &single);
        let de = (eval - single_eval).abs() / single_eval;
        eprintln!("{layout:?}: parameters {d:.2e}, eval loss {de:.2e}");
        assert!(d <= 2e-4, "{layout:?}: parameters {d:.2e}");
        assert!(de <= 1e-5, "{layout:?}: eval loss {eval} vs {single_eval}");
    }
}

fn config_error(extra: &[&str]) -> String {
    let out = tempfile::tempdir().unwrap();
    let e = tiny_gpt_config_result(out.path(), STEPS, extra)
        .err()
        .unwrap_or_else(|| panic!("{extra:?} should be refused"));
    format!("{e:#}")
}

#[test]
fn layouts_that_cannot_run_are_refused_with_the_numbers() {
    let e = config_error(&["parallel.cp=3"]);
    assert!(
        e.contains("sequence length is 16, not divisible by 6"),
        "{e}"
    );
    let e = config_error(&["parallel.cp=8", "parallel.cp_mode=\"ulysses\""]);
    assert!(
        e.contains("attention heads") && e.contains("not divisible by 8"),
        "{e}"
    );
    let e = config_error(&[
        "parallel.cp=2",
        "parallel.tp=4",
        "parallel.cp_mode=\"ulysses\"",
    ]);
    assert!(
        e.contains("(4/4)") && e.contains("not divisible by 2"),
        "{e}"
    );
    let e = config_error(&[
        "parallel.cp=2",
        "parallel.dp=2",
        "parallel.dp_mode=\"single-master\"",
    ]);
    assert!(
        e.contains("cp=2: the single master scatters whole samples"),
        "{e}"
    );
    let e = config_error(&["parallel.cp=0"]);
    assert!(e.contains("parallel.cp must be at least 1"), "{e}");
    let e = config_error(&["parallel.cp_mode=\"spiral\""]);
    assert!(e.contains("spiral"), "{e}");
    let lenet = std::fs::read_to_string(root().join("configs/lenet.toml")).unwrap();
    let e = Config::from_toml_with_overrides(&lenet, &["parallel.cp=2".to_string()])
        .and_then(|c| c.validate())
        .unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains("cp=2") && e.contains("tokens per sample"), "{e}");
}

#[test]
fn a_context_parallel_worker_keeps_about_one_cpth_of_the_activations() {
    let peak = |cp: usize| {
        let out = tempfile::tempdir().unwrap();
        let cfg = tiny_gpt_config(
            out.path(),
            STEPS,
            &[
                "model.seq=128",
                "model.attention=\"flash\"",
                &format!("parallel.cp={cp}"),
            ],
        );
        let j = job(&cfg);
        let peaks = ThreadsWorld::run(cp, CommConfig::default(), move |group| {
            let mut t = j.trainer(group, Some(1))?;
            Ok::<_, anyhow::Error>(t.train_step()?.peak_activation_bytes)
        })
        .unwrap_or_else(|e| panic!("{e}"));
        *peaks.iter().max().unwrap() as f64
    };
    let one = peak(1);
    for cp in [2, 4] {
        let ratio = peak(cp) / one;
        eprintln!("cp={cp}: {ratio:.3} of one worker's activation bytes");
        assert!(
            (ratio - 1.0 / cp as f64).abs() < 0.1 / cp as f64,
            "cp={cp}: {ratio:.3}"
        );
    }
}

/// Checkpoints written under context parallelism (whole, and sharded under ZeRO over dp × cp)
/// resume on other layouts as the uninterrupted one-worker run.
#[test]
fn context_parallel_checkpoints_resume_on_any_layout() {
    let cfg = tiny_gpt_config(std::path::Path::new("/unused"), 10, &[]);
    let uninterrupted = checkpoint_params(&cfg, &written_checkpoint(&train_until(&[], 10, None)));
    for (writer, reader) in [
        (
            vec!["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"],
            vec!["parallel.cp=4", "parallel.cp_mode=\"ulysses\""],
        ),
        (vec!["parallel.cp=4"], vec![]),
        (vec![], vec!["parallel.cp=2", "parallel.tp=2"]),
    ] {
        let first = train_until(&writer, 5, None);
        let resumed = train_until(&reader, 10, Some(&written_checkpoint(&first)));
        let d = rel_diff(
            &checkpoint_params(&cfg, &written_checkpoint(&resumed)),
            &uninterrupted,
        );
        eprintln!("{writer:?} → {reader:?}: {d:.2e}");
        assert!(d <= 2e-4, "{writer:?} → {reader:?}: {d:.2e}");
    }
}

/// A worker that stops answering in the middle of the ring (its model sleeps in forward):
/// the other fails within the timeout, naming the operation and the missing rank.
#[test]
fn a_stuck_context_parallel_worker_fails_the_other_within_the_timeout() {
    use meshtrain_nn::{Block, Layer, Mode, Saved};
    use meshtrain_tensor::Tensor;
    use std::time::{Duration, Instant};

    /// Passes its input through, after sleeping past the timeout if `stuck` (worker 1's).
    struct Sleepy {
        stuck: bool,
    }
    impl Layer for Sleepy {
        fn forward(
            &self,
            _: Params<'_>,
            _: ParamsMut<'_>,
            x: Tensor,
            _: Mode,
            _: &mut Saved,
        ) -> Tensor {
            if self.stuck {
                std::thread::sleep(Duration::from_secs(6));
            }
            x
        }
        fn backward(
            &self,
            _: Params<'_>,
            _: ParamsMut<'_>,
            _: Saved,
            dy: Tensor,
            _: bool,
        ) -> Option<Tensor> {
            Some(dy)
        }
    }

    for mode in ["ring", "ulysses"] {
        let out = tempfile::tempdir().unwrap();
        let mode_set = format!("parallel.cp_mode=\"{mode}\"");
        let cfg = tiny_gpt_config(out.path(), 2, &["parallel.cp=2", &mode_set]);
        let mut job = (*job(&cfg)).clone();
        let build = job.model.clone();
        // The sleep sits between the embedding and the first block, so worker 0 waits in the
        // first attention's transfer.
        job.model = std::sync::Arc::new(move || {
            let model = build();
            let input = model.input().cloned().expect("a GPT declares its input");
            let mut blocks = model.blocks;
            // Each worker builds its model on its own thread.
            let stuck = std::thread::current().name() == Some("meshtrain-worker-1");
            blocks.insert(1, Block::new("sleepy", Sleepy { stuck }));
            meshtrain_nn::Model::new(blocks).with_input(input)
        });
        let job = job.timeout(Duration::from_secs(1));
        let started = Instant::now();
        let err = format!("{:#}", job.run(&RunOptions::default()).unwrap_err());
        let elapsed = started.elapsed();
        eprintln!("{mode}: after {elapsed:?}: {err}");
        assert!(err.contains("rank 0"), "{mode}: {err}");
        assert!(err.contains("timed out"), "{mode}: {err}");
        assert!(
            err.contains("[1]"),
            "{mode}: the missing rank is named: {err}"
        );
        let op = if mode == "ring" { "recv" } else { "all_to_all" };
        assert!(err.contains(op), "{mode}: the operation is named: {err}");
        assert!(elapsed < Duration::from_secs(5), "{mode}: took {elapsed:?}");
    }
}
