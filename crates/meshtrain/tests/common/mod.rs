//! Shared by the integration tests that train small models end to end.

#![allow(dead_code)]

use meshtrain::config::Config;
use meshtrain::presets::Task;
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_train::{Job, RunOptions, Trainer};
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;

/// The workspace root (configs/ and data/ live there).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Overrides that shrink `configs/gpt.toml` to the tiny GPT the parallel tests train: 4
/// blocks (embedding, 2 layers, head), width 32, 2 heads, context 16.
pub const TINY_GPT: [&str; 4] = [
    "model.dim=32",
    "model.layers=2",
    "model.heads=2",
    "model.seq=16",
];

/// The library job a config describes, on its built-in data.
pub fn job(cfg: &Config) -> Arc<Job> {
    let task = Task::load(cfg).unwrap_or_else(|e| panic!("{e:#}"));
    Arc::new(cfg.job(&task).unwrap_or_else(|e| panic!("{e:#}")))
}

/// A one-worker trainer for `cfg`'s model and data (on the calling thread), whatever
/// layout `cfg` names.
pub fn single_trainer(cfg: &Config) -> Trainer {
    let mut cfg = cfg.clone();
    cfg.parallel.dp = 1;
    cfg.parallel.pp = 1;
    cfg.parallel.layout = None;
    job(&cfg)
        .trainer(ThreadsWorld::single(CommConfig::default()), None)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// The checkpoint a run wrote into `out`: the sharded directory (ZeRO's default) or the
/// whole file.
pub fn written_checkpoint(out: &Path) -> PathBuf {
    let sharded = out.join("checkpoint");
    if sharded.is_dir() {
        sharded
    } else {
        out.join("checkpoint.safetensors")
    }
}

/// The whole model's parameters a checkpoint of `cfg`'s model holds (any layout wrote it),
/// read back by one worker.
pub fn checkpoint_params(cfg: &Config, checkpoint: &Path) -> Vec<f32> {
    let mut single = cfg.clone();
    single.parallel.tp = 1;
    single.parallel.cp = 1;
    single.parallel.zero = 0;
    single.parallel.sequence_parallel = false;
    let mut t = single_trainer(&single);
    t.resume(checkpoint).unwrap_or_else(|e| panic!("{e:#}"));
    t.local_params()
}

/// Relative L2 distance ‖a − b‖ / ‖b‖ (in f64).
pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let norm = |it: &mut dyn Iterator<Item = f64>| it.map(|v| v * v).sum::<f64>().sqrt();
    let diff = norm(&mut a.iter().zip(b).map(|(x, y)| (*x - *y) as f64));
    diff / norm(&mut b.iter().map(|&v| v as f64))
}

/// The tiny GPT of the tensor-parallel and mixed-precision tests: 4 heads (so tp = 4 splits
/// them), width 32, 2 layers, context 16, batch 8, AdamW with clipping at 1.0, 10 steps
/// (`max_steps`) writing into `out`; `extra` overrides come last.
pub fn tiny_gpt_config(out: &Path, max_steps: u64, extra: &[&str]) -> Config {
    tiny_gpt_config_result(out, max_steps, extra).unwrap_or_else(|e| panic!("{e:#}"))
}

/// [`tiny_gpt_config`], or the error a config check gives (tests of refused layouts).
pub fn tiny_gpt_config_result(
    out: &Path,
    max_steps: u64,
    extra: &[&str],
) -> anyhow::Result<Config> {
    let model = [
        "model.dim=32",
        "model.layers=2",
        "model.heads=4",
        "model.seq=16",
    ];
    tiny_config("configs/gpt.toml", &model, out, max_steps, extra)
}

/// The tiny Llama of the Llama tests: the tiny GPT's run (width 32, 2 layers, 4 heads,
/// context 16, batch 8, 10 steps) with 2 key/value heads and a SwiGLU MLP of 48.
pub fn tiny_llama_config(out: &Path, max_steps: u64, extra: &[&str]) -> Config {
    tiny_llama_config_result(out, max_steps, extra).unwrap_or_else(|e| panic!("{e:#}"))
}

/// [`tiny_llama_config`], or the error a config check gives.
pub fn tiny_llama_config_result(
    out: &Path,
    max_steps: u64,
    extra: &[&str],
) -> anyhow::Result<Config> {
    let model = [
        "model.dim=32",
        "model.layers=2",
        "model.heads=4",
        "model.kv_heads=2",
        "model.ffn=48",
        "model.seq=16",
    ];
    tiny_config("configs/llama.toml", &model, out, max_steps, extra)
}

/// ResNet-18 at width 4 on 512 Fashion-MNIST images, batch 16 (SGD with momentum and
/// weight decay, batch norm), `max_steps` of a 40-step schedule, then `extra`.
pub fn tiny_resnet_config(out: &Path, max_steps: u64, extra: &[&str]) -> Config {
    let text = std::fs::read_to_string(root().join("configs/resnet18.toml")).unwrap();
    let data = root().join("data/fashion-mnist-subset");
    let mut o: Vec<String> = [
        "model.width=4",
        "train.batch_size=16",
        "train.steps=40",
        "train.threads=1",
        "train.log_every=1000",
        "data.train_limit=512",
        "data.test_limit=64",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    o.push(format!("data.data_dir=\"{}\"", data.display()));
    o.push(format!("train.out_dir=\"{}\"", out.display()));
    o.push(format!("train.max_steps={max_steps}"));
    o.extend(extra.iter().map(|s| s.to_string()));
    Config::from_toml_with_overrides(&text, &o).unwrap_or_else(|e| panic!("{e:#}"))
}

/// A shipped config (`file`) made tiny by `model`'s overrides and the shared run settings
/// (batch 8, 40-step schedule stopped at `max_steps`, one thread per worker), then `extra`.
fn tiny_config(
    file: &str,
    model: &[&str],
    out: &Path,
    max_steps: u64,
    extra: &[&str],
) -> anyhow::Result<Config> {
    let run = [
        "train.batch_size=8",
        "train.steps=40",
        "train.eval_every=5",
        "train.eval_batches=2",
        "schedule.warmup_steps=5",
        "train.threads=1",
        "train.log_every=1000",
    ];
    let mut o: Vec<String> = model.iter().chain(&run).map(|s| s.to_string()).collect();
    o.push(format!("train.out_dir=\"{}\"", out.display()));
    o.push(format!("train.max_steps={max_steps}"));
    o.extend(extra.iter().map(|s| s.to_string()));
    let text = std::fs::read_to_string(root().join(file)).unwrap();
    let cfg = Config::from_toml_with_overrides(&text, &o)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Trains the tiny GPT on `extra`'s layout to step `until` (of a 40-step schedule),
/// resuming from `resume` if given; returns the output directory.
pub fn train_until(extra: &[&str], until: u64, resume: Option<&Path>) -> std::path::PathBuf {
    let out = tempfile::tempdir().unwrap().keep();
    let cfg = tiny_gpt_config(&out, until, extra);
    let options = RunOptions {
        resume: resume.map(Path::to_path_buf),
        ..RunOptions::default()
    };
    let summary = (*job(&cfg))
        .clone()
        .run(&options)
        .unwrap_or_else(|e| panic!("{extra:?}: {e:#}"));
    assert_eq!(summary.steps, until);
    out
}

/// Runs the `meshtrain` command from the workspace root: (success, stdout, stderr).
pub fn meshtrain<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshtrain"))
        .current_dir(root())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `meshtrain train`'s arguments for the tiny GPT (width 32, 2 layers, 2 heads, context 16,
/// batch 8, 2 threads) over 2 workers writing into `out`, then `extra`.
pub fn tiny_gpt_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut flags = vec!["--dp", "2"];
    flags.extend(extra);
    tiny_gpt_command(out, &["model.heads=2"], &flags)
}

/// `meshtrain train`'s arguments for the tiny GPT (width 32, 2 layers, context 16, batch 8,
/// 2 threads) writing into `out`, then `sets` as `--set` overrides, then `extra`.
pub fn tiny_gpt_command(out: &Path, sets: &[&str], extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["train", "--config", "configs/gpt.toml"]
        .map(String::from)
        .to_vec();
    let out_dir = format!("train.out_dir=\"{}\"", out.display());
    let base = [
        "model.dim=32",
        "model.layers=2",
        "model.seq=16",
        "train.batch_size=8",
        "train.threads=2",
        &out_dir,
    ];
    for set in base.iter().chain(sets) {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Whether a CUDA GPU can be used; without one the GPU tests are skipped with the reason
/// printed, unless `MESHTRAIN_REQUIRE_GPU=1` (then they fail).
pub fn gpu() -> bool {
    #[cfg(feature = "cuda")]
    let available = meshtrain_tensor::cuda::probe::gpu_available();
    #[cfg(not(feature = "cuda"))]
    let available = false;
    if !available {
        assert!(
            std::env::var("MESHTRAIN_REQUIRE_GPU").as_deref() != Ok("1"),
            "MESHTRAIN_REQUIRE_GPU=1 but no usable CUDA GPU (driver missing or no device)"
        );
        eprintln!("skipped: no CUDA GPU (the driver or a device is missing)");
    }
    available
}

// The emulated CUDA device and reruns of a test binary on it, shared with the other crates'
// GPU tests.
#[path = "../../../tensor/tests/cuda_emu/device/rerun.rs"]
mod emulated;
#[allow(unused_imports)]
pub use emulated::{
    rerun_on_the_emulated_device, rerun_on_the_emulated_device_concurrently,
    rerun_on_the_emulated_device_with,
};
