//! A crash during a background checkpoint write leaves the previous checkpoint loadable:
//! a child process (this test binary run again, told so by an environment variable) trains
//! a ~5.3 M-parameter model with a checkpoint after every step, written in the background;
//! the parent kills it with SIGKILL while a checkpoint's temporary file is being written
//! (the torn file is still there afterwards, proof of the timing), then loads the checkpoint
//! the previous write committed. Whole files (one worker) and sharded checkpoints (2
//! workers, ZeRO-1) are both killed.

use meshtrain_train::nn::layers::Linear;
use meshtrain_train::nn::optim::Optimizer;
use meshtrain_train::nn::{Block, CrossEntropy, InputSpec, Model, ParamStore};
use meshtrain_train::sharded::ShardedCheckpoint;
use meshtrain_train::tensor::activation::Activation;
use meshtrain_train::{
    checkpoint, BatchMut, CheckpointFormat, Dataset, DatasetError, Inputs, Job, Layout, RunOptions,
};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Set in the child: the output directory and the checkpoint format.
const CHILD_DIR: &str = "MESHTRAIN_CRASH_TEST_DIR";
const CHILD_FORMAT: &str = "MESHTRAIN_CRASH_TEST_FORMAT";
const DIM: usize = 256;

/// Deterministic noise, 4 classes.
struct Noise;

impl Dataset for Noise {
    fn name(&self) -> String {
        "noise".into()
    }
    fn len(&self) -> usize {
        1024
    }
    fn input(&self) -> InputSpec {
        InputSpec::float(&[DIM])
    }
    fn fill(&self, indices: &[usize], batch: BatchMut<'_>) -> Result<(), DatasetError> {
        let Inputs::Float(x) = batch.inputs else {
            return Err("float features".into());
        };
        for (k, (&i, row)) in indices.iter().zip(x.chunks_exact_mut(DIM)).enumerate() {
            for (d, v) in row.iter_mut().enumerate() {
                *v = (((i * 31 + d * 17) % 97) as f32 / 97.0) - 0.5;
            }
            batch.targets[k] = (i % 4) as u32;
        }
        Ok(())
    }
}

/// 256 → 2048 → 2048 → 4: 4.7 M parameters, ~57 MB of checkpoint with AdamW's moments.
fn model() -> Model {
    Model::new(vec![
        Block::new(
            "in",
            Linear::new(DIM, 2048, true).with_activation(Activation::Gelu),
        ),
        Block::new(
            "mid",
            Linear::new(2048, 2048, true).with_activation(Activation::Gelu),
        ),
        Block::new("out", Linear::new(2048, 4, true)),
    ])
    .with_input(InputSpec::float(&[DIM]))
}

fn job(dir: &Path, format: CheckpointFormat) -> Job {
    let layout: Layout = match format {
        CheckpointFormat::Sharded => "dp=2,zero=1".parse().unwrap(),
        _ => Layout::default(),
    };
    let mut job = Job::new(model, Arc::new(Noise), Arc::new(CrossEntropy::new(4)))
        .batch_size(8)
        .steps(10_000)
        .layout(layout)
        .out_dir(dir)
        .log_every(1_000);
    job.checkpoint_every = Some(1);
    job.checkpoint_background = true;
    job.checkpoint_format = format;
    job
}

/// The child: trains until killed.
#[test]
fn child_trains_until_killed() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return; // not the child: nothing to do
    };
    let format = match std::env::var(CHILD_FORMAT).as_deref() {
        Ok("sharded") => CheckpointFormat::Sharded,
        _ => CheckpointFormat::Whole,
    };
    job(Path::new(&dir), format)
        .run(&RunOptions::default())
        .unwrap();
    panic!("the child should have been killed before it finished");
}

/// Runs the child and SIGKILLs it once `in_write` finds a checkpoint being written after
/// `committed` found one committed. Returns the torn temporary file it left.
fn kill_mid_write(
    dir: &Path,
    format: &str,
    committed: impl Fn() -> bool,
    in_write: impl Fn() -> Option<PathBuf>,
) -> PathBuf {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_trains_until_killed", "--nocapture"])
        .env(CHILD_DIR, dir)
        .env(CHILD_FORMAT, format)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let torn = loop {
        assert!(
            Instant::now() < deadline,
            "no checkpoint write seen in 120 s"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the child ended by itself: {status}");
        }
        if committed() {
            if let Some(tmp) = in_write().filter(|t| t.metadata().is_ok_and(|m| m.len() > 0)) {
                child.kill().unwrap(); // SIGKILL
                break tmp;
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    };
    child.wait().unwrap();
    assert!(
        torn.exists(),
        "the write was not in progress when the child died"
    );
    torn
}

#[test]
fn killed_during_a_background_write_the_previous_checkpoint_loads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.safetensors");
    let tmp = checkpoint::temporary_path(&path);
    let torn = kill_mid_write(
        dir.path(),
        "whole",
        || path.exists(),
        || tmp.exists().then(|| tmp.clone()),
    );
    let torn_len = torn.metadata().unwrap().len();
    let m = model();
    let mut store = ParamStore {
        values: vec![0.0; m.num_params()],
        grads: Vec::new(),
        buffers: vec![0.0; m.num_buffers()],
    };
    let mut opt = Optimizer::new(
        job(dir.path(), CheckpointFormat::Whole).optimizer,
        m.num_params(),
    );
    let restored = checkpoint::load(
        &path,
        &m,
        "",
        &mut store,
        &mut opt,
        checkpoint::Restore::Everything,
    )
    .unwrap();
    assert!(restored.step >= 1);
    assert!(restored.sampler.is_some());
    eprintln!(
        "killed mid-write ({} bytes of the next checkpoint written); loaded the previous one \
         (step {})",
        torn_len, restored.step
    );
}

#[test]
fn killed_during_a_background_sharded_write_the_previous_index_loads() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("checkpoint");
    let index = ckpt.join(meshtrain_train::sharded::INDEX_FILE);
    // A shard being written: a temporary file in a step directory the index does not name.
    let in_write = || -> Option<PathBuf> {
        let named = std::fs::read_to_string(&index).ok()?;
        for step_dir in std::fs::read_dir(&ckpt).ok()?.flatten() {
            let name = step_dir.file_name().to_string_lossy().to_string();
            if !name.starts_with("step-") || named.contains(&name) {
                continue;
            }
            for f in std::fs::read_dir(step_dir.path()).ok()?.flatten() {
                if f.file_name()
                    .to_string_lossy()
                    .ends_with(".safetensors.tmp")
                {
                    return Some(f.path());
                }
            }
        }
        None
    };
    kill_mid_write(dir.path(), "sharded", || index.exists(), in_write);
    let opened = ShardedCheckpoint::open(&ckpt).unwrap();
    assert!(opened.index.step >= 1);
    // Every tensor reads back whole (checksums verified).
    let m = model();
    for e in m.params() {
        opened
            .tensor(&format!("param.{}", e.name), &e.shape)
            .unwrap();
        opened.tensor(&format!("m.{}", e.name), &e.shape).unwrap();
    }
    // And a run resumes from it.
    let mut resume = job(dir.path(), CheckpointFormat::Sharded);
    resume.max_steps = Some(opened.index.step + 1);
    let summary = resume
        .run(&RunOptions {
            resume: Some(ckpt.clone()),
            ..RunOptions::default()
        })
        .unwrap();
    assert_eq!(summary.steps, opened.index.step + 1);
}
