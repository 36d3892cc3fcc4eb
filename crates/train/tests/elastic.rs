//! What an elastic restart relies on: a run that fails mid-way resumes from its last
//! background checkpoint and ends where the uninterrupted run ends — bit-identical at the
//! same world (the same sums in the same order), within a relative L2 distance of 1e-5 on a
//! smaller world (dp 4 → 2: only the order of the gradient average's additions differs, the
//! global batch and its samples are the same) — whole and sharded (ZeRO-1, resharded from 4
//! to 2 pieces per tensor); and a checkpoint whose sampler position this run would not
//! continue is refused.

use meshtrain_train::nn::layers::Linear;
use meshtrain_train::nn::optim::Optimizer;
use meshtrain_train::nn::{Block, CrossEntropy, InputSpec, Model, ParamStore};
use meshtrain_train::tensor::activation::Activation;
use meshtrain_train::{
    checkpoint, BatchMut, Dataset, DatasetError, Inputs, Job, Layout, RunOptions,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const DIM: usize = 16;

/// 64 deterministic samples, 4 classes (8 steps of 8 per epoch: the runs cross epochs);
/// fails the `fail_at`-th fill (a worker's data loading breaks mid-run).
struct Samples {
    fills: AtomicUsize,
    fail_at: Option<usize>,
}

impl Dataset for Samples {
    fn name(&self) -> String {
        "samples".into()
    }
    fn len(&self) -> usize {
        64
    }
    fn input(&self) -> InputSpec {
        InputSpec::float(&[DIM])
    }
    fn fill(&self, indices: &[usize], batch: BatchMut<'_>) -> Result<(), DatasetError> {
        if Some(self.fills.fetch_add(1, Ordering::SeqCst)) == self.fail_at {
            return Err("the worker's disk went away".into());
        }
        let Inputs::Float(x) = batch.inputs else {
            return Err("float features".into());
        };
        for (k, (&i, row)) in indices.iter().zip(x.chunks_exact_mut(DIM)).enumerate() {
            let class = i % 4;
            for (d, v) in row.iter_mut().enumerate() {
                let centre = if d % 4 == class { 1.0 } else { 0.0 };
                *v = centre + (((i * 13 + d * 7) % 11) as f32 / 11.0 - 0.5);
            }
            batch.targets[k] = class as u32;
        }
        Ok(())
    }
}

fn model() -> Model {
    Model::new(vec![
        Block::new(
            "in",
            Linear::new(DIM, 32, true).with_activation(Activation::Gelu),
        ),
        Block::new("out", Linear::new(32, 4, true)),
    ])
    .with_input(InputSpec::float(&[DIM]))
}

/// 12 steps of global batch 8 on `layout`, a background checkpoint every 3 steps.
fn job(layout: &str, out: &Path, fail_at: Option<usize>) -> Job {
    let data = Arc::new(Samples {
        fills: AtomicUsize::new(0),
        fail_at,
    });
    let mut job = Job::new(model, data, Arc::new(CrossEntropy::new(4)))
        .batch_size(8)
        .steps(12)
        .seed(5)
        .threads(1)
        .grad_clip(1.0)
        .layout(layout.parse::<Layout>().unwrap())
        .out_dir(out);
    job.checkpoint_every = Some(3);
    job.checkpoint_background = true;
    job
}

/// The checkpoint a run in `out` wrote (sharded under ZeRO).
fn checkpoint_in(out: &Path) -> PathBuf {
    let sharded = out.join("checkpoint");
    if sharded.is_dir() {
        sharded
    } else {
        out.join("checkpoint.safetensors")
    }
}

/// Parameters and first moments of the checkpoint in `out`, read by one worker.
fn final_state(out: &Path) -> Vec<f32> {
    let path = out.join("whole.safetensors");
    let from = checkpoint_in(out);
    let whole = if from.is_dir() {
        meshtrain_train::sharded::consolidate(&from, &path, &|_, _| {}).unwrap();
        path
    } else {
        from
    };
    let m = model();
    let mut store = ParamStore {
        values: vec![0.0; m.num_params()],
        grads: Vec::new(),
        buffers: Vec::new(),
    };
    let mut opt = Optimizer::new(job("dp=1", out, None).optimizer, m.num_params());
    checkpoint::load(
        &whole,
        &m,
        "",
        &mut store,
        &mut opt,
        checkpoint::Restore::Everything,
    )
    .unwrap();
    store.values.into_iter().chain(opt.m).collect()
}

fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    norm(&mut a.iter().zip(b).map(|(x, y)| (x - y) as f64)) / norm(&mut b.iter().map(|&x| x as f64))
}

/// Runs `layout` until a worker fails at step 7 (fill 1 + 7·dp: the job's check loads one
/// sample, then every worker one share per step), leaving the step-6 checkpoint; returns
/// the output directory.
fn interrupted(layout: &str, dp: usize) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let err = job(layout, out.path(), Some(1 + 7 * dp))
        .run(&RunOptions::default())
        .unwrap_err();
    assert!(format!("{err:#}").contains("disk went away"), "{err:#}");
    out
}

fn resume(layout: &str, from: &Path) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let summary = job(layout, out.path(), None)
        .run(&RunOptions {
            resume: Some(checkpoint_in(from)),
            ..RunOptions::default()
        })
        .unwrap();
    assert_eq!(summary.steps, 12);
    out
}

fn straight(layout: &str) -> Vec<f32> {
    let out = tempfile::tempdir().unwrap();
    job(layout, out.path(), None)
        .run(&RunOptions::default())
        .unwrap();
    final_state(out.path())
}

#[test]
fn a_failed_run_resumes_from_its_background_checkpoint_as_if_uninterrupted() {
    for (layout, smaller) in [("dp=4", "dp=2"), ("dp=4,zero=1", "dp=2,zero=1")] {
        let reference = straight(layout);
        let broken = interrupted(layout, 4);
        let step = match meshtrain_train::sharded::ShardedCheckpoint::open(&checkpoint_in(
            broken.path(),
        )) {
            Ok(c) => c.index.step,
            Err(_) => 6, // whole file: its step is checked by the resumed run below
        };
        assert_eq!(step, 6, "{layout}: the last checkpoint before the failure");
        let same = final_state(resume(layout, broken.path()).path());
        assert!(
            same == reference,
            "{layout}: resumed at the same world differs"
        );
        let fewer = final_state(resume(smaller, broken.path()).path());
        let d = rel_diff(&fewer, &reference);
        assert!(d < 1e-5, "{layout} → {smaller}: relative L2 distance {d:e}");
        eprintln!("{layout}: same world bit-identical; {smaller}: relative L2 distance {d:e}");
    }
}

#[test]
fn a_checkpoint_this_run_would_not_continue_is_refused() {
    let first = tempfile::tempdir().unwrap();
    let mut j = job("dp=1", first.path(), None);
    j.max_steps = Some(3);
    j.run(&RunOptions::default()).unwrap();
    let path = checkpoint_in(first.path());
    for (change, expected) in [
        ("batch", "global batch 8 in the checkpoint, 16 in this run"),
        ("seed", "seed 5 in the checkpoint, 6 in this run"),
    ] {
        let out = tempfile::tempdir().unwrap();
        let mut j = job("dp=1", out.path(), None);
        match change {
            "batch" => j.batch_size = 16,
            _ => j.seed = 6,
        }
        let err = j
            .run(&RunOptions {
                resume: Some(path.clone()),
                ..RunOptions::default()
            })
            .unwrap_err();
        let err = format!("{err:#}");
        assert!(
            err.contains("sampler position mismatch") && err.contains(expected),
            "{change}: {err}"
        );
    }
}
