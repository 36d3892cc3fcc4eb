//! `--device cuda`: what can be checked without a GPU (the flag and config, the clear error
//! when the driver is missing, layouts and models refused before any work), and with one
//! (GPU against CPU, checkpoints moving between the two), skipped with the reason printed
//! when there is none and required with `MESHTRAIN_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

mod common;

use common::{checkpoint_params, gpu, job, rel_diff, tiny_gpt_config, written_checkpoint};
use meshtrain::config::Config;
use meshtrain_tensor::Device;
use meshtrain_train::RunOptions;

fn run(cfg: &Config, options: &RunOptions) -> anyhow::Result<meshtrain_train::Summary> {
    (*job(cfg)).clone().run(options)
}

#[test]
fn the_device_is_a_config_value_and_a_flag() {
    let out = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(out.path(), 2, &["train.device=\"cuda:1\""]);
    assert_eq!(cfg.train.device, Device::Cuda(1));
    assert_eq!(cfg.parallel_options().unwrap().device, Device::Cuda(1));
    let cfg = tiny_gpt_config(out.path(), 2, &[]);
    assert_eq!(cfg.train.device, Device::Cpu, "the CPU is the default");
    let e = common::tiny_gpt_config_result(out.path(), 2, &["train.device=\"tpu\""])
        .unwrap_err()
        .to_string();
    assert!(e.contains("cpu, cuda or cuda:N"), "{e}");
    let args = meshtrain::train_cli::TrainArgs {
        device: Some("cuda".into()),
        ..clap_defaults()
    };
    assert!(args
        .overrides()
        .contains(&"train.device=\"cuda\"".to_string()));
}

fn clap_defaults() -> meshtrain::train_cli::TrainArgs {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: meshtrain::train_cli::TrainArgs,
    }
    Wrapper::parse_from(["meshtrain"]).args
}

#[test]
fn without_a_driver_the_error_names_the_library_before_any_step() {
    if meshtrain_tensor::cuda::probe::gpu_available() {
        eprintln!("skipped: this machine has a GPU");
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(out.path(), 2, &["train.device=\"cuda\""]);
    let e = format!("{:#}", run(&cfg, &RunOptions::default()).unwrap_err());
    assert!(
        e.contains("libcuda.so.1") || e.contains("NVRTC") || e.contains("no CUDA GPU"),
        "{e}"
    );
    assert!(e.contains("--device cpu") || e.contains("install"), "{e}");
    assert!(
        !out.path().join("metrics.jsonl").exists(),
        "no step ran: {e}"
    );
}

/// On a GPU, what its kernels cannot run (attention heads 8 wide: the kernels take 32, 64
/// and 128) is refused before any work, and LeNet (every layer has kernels) trains; without
/// one, the missing piece of the machine is named first, since that is what the user can act
/// on (the wordings themselves: `device.rs`'s tests).
#[test]
fn a_gpu_refuses_what_it_cannot_run_before_any_work_and_trains_lenet() {
    let usable = meshtrain_tensor::cuda::probe::require_gpu(0).is_ok();
    let names_the_missing_piece =
        |e: &str| e.contains("libcuda.so.1") || e.contains("NVRTC") || e.contains("no CUDA GPU");
    let out = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(out.path(), 2, &["train.device=\"cuda\"", "parallel.dp=2"]);
    let e = format!("{:#}", run(&cfg, &RunOptions::default()).unwrap_err());
    if usable {
        assert!(
            e.contains("cannot train on a GPU") && e.contains("heads are 8 wide"),
            "{e}"
        );
    } else {
        assert!(names_the_missing_piece(&e), "{e}");
    }
    assert!(
        !out.path().join("metrics.jsonl").exists(),
        "no step ran: {e}"
    );
    let text = std::fs::read_to_string(common::root().join("configs/lenet.toml")).unwrap();
    let lenet = Config::from_toml_with_overrides(
        &text,
        &[
            "train.device=\"cuda\"".into(),
            "parallel.dp=1".into(),
            "train.max_steps=3".into(),
            format!("train.out_dir=\"{}\"", out.path().display()),
        ],
    )
    .unwrap();
    // LeNet has CUDA kernels for every layer: it trains on a GPU, and without one the
    // missing piece is named.
    match run(&lenet, &RunOptions::default()) {
        Ok(_) => assert!(usable, "LeNet trained on cuda without a usable GPU"),
        Err(e) => {
            let e = format!("{e:#}");
            assert!(!usable, "LeNet on a usable GPU: {e}");
            assert!(names_the_missing_piece(&e), "{e}");
        }
    }
}

/// The tiny GPT with heads the CUDA attention kernels take (32 wide: its own 4 heads of 8
/// are refused on a GPU by name).
fn tiny_gpu_gpt_config(out: &std::path::Path, max_steps: u64, extra: &[&str]) -> Config {
    let mut o = vec!["model.dim=64", "model.heads=2"];
    o.extend_from_slice(extra);
    tiny_gpt_config(out, max_steps, &o)
}

/// fp32 on the GPU learns what the CPU learns; a GPU checkpoint resumes on the CPU and the
/// reverse, to the same parameters as an uninterrupted run.
#[test]
fn gpu_training_matches_the_cpu_and_checkpoints_move_between_them() {
    if !gpu() {
        return;
    }
    let steps = 6;
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let cpu_cfg = tiny_gpu_gpt_config(dirs[0].path(), steps, &[]);
    run(&cpu_cfg, &RunOptions::default()).unwrap();
    let cpu = checkpoint_params(&cpu_cfg, &written_checkpoint(dirs[0].path()));
    let gpu_cfg = tiny_gpu_gpt_config(dirs[1].path(), steps, &["train.device=\"cuda\""]);
    run(&gpu_cfg, &RunOptions::default()).unwrap();
    let gpu = checkpoint_params(&gpu_cfg, &written_checkpoint(dirs[1].path()));
    assert!(rel_diff(&gpu, &cpu) < 1e-4, "{}", rel_diff(&gpu, &cpu));
    // Half the run on the GPU, the rest on the CPU (and the reverse).
    for (first, second, dir) in [("cuda", "cpu", 2), ("cpu", "cuda", 3)] {
        let d = dirs[dir].path();
        let a = tiny_gpu_gpt_config(d, steps / 2, &[&format!("train.device=\"{first}\"")]);
        run(&a, &RunOptions::default()).unwrap();
        let b = tiny_gpu_gpt_config(d, steps, &[&format!("train.device=\"{second}\"")]);
        let resume = RunOptions {
            resume: Some(written_checkpoint(d)),
            ..RunOptions::default()
        };
        run(&b, &resume).unwrap();
        let moved = checkpoint_params(&b, &written_checkpoint(d));
        assert!(rel_diff(&moved, &cpu) < 1e-4, "{first} then {second}");
    }
}

/// The data-parallel modes beside DDP on GPUs (several ranks sharing the one GPU through
/// staged collectives, as the `multi` part of `scripts/gpu-check.sh` runs them on a card),
/// each against the same mode on the CPU: the single master gathering the replicas'
/// gradients on its device, adding them there and broadcasting the updated parameters from
/// it; and DDP's hierarchical all-reduce over 2 simulated hosts of 2 GPUs (its phases the
/// device collectives of the host and cross-host sub-groups).
#[test]
fn single_master_and_hierarchical_ddp_on_gpus_match_the_cpu() {
    if !gpu() {
        return;
    }
    let steps = 4;
    for mode in [
        &["parallel.dp=2", "parallel.dp_mode=\"single-master\""][..],
        &[
            "parallel.dp=4",
            "parallel.ranks_per_host=2",
            "parallel.grad_reduce=\"hierarchical\"",
        ],
    ] {
        let params = |device: &str| {
            let dir = tempfile::tempdir().unwrap();
            let device = format!("train.device=\"{device}\"");
            let cfg = tiny_gpu_gpt_config(dir.path(), steps, &[&[&device[..]], mode].concat());
            let summary = run(&cfg, &RunOptions::default()).unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(summary.steps, steps);
            let hierarchical = mode.iter().any(|s| s.contains("hierarchical"));
            assert_eq!(
                summary.breakdown.grad_reduce,
                hierarchical.then_some("hierarchical"),
                "{mode:?}"
            );
            checkpoint_params(&cfg, &written_checkpoint(dir.path()))
        };
        let (cpu, gpu) = (params("cpu"), params("cuda"));
        let d = rel_diff(&gpu, &cpu);
        eprintln!("{mode:?}: the GPU against the CPU {d:.2e}");
        assert!(d < 1e-4, "{mode:?}: {d:.2e}");
    }
}

/// The GPU tests above on the emulated CUDA device (`crates/tensor/tests/cuda_emu/device`):
/// the CUDA path's host code (launch shapes, arguments, buffers, the allocator, checkpoints
/// moving between devices) runs here on every machine with g++ and CUDA's headers, not only
/// on a card. Once with every call done when it returns, once with each stream on a thread
/// of its own and random delays (where a missing wait between streams reads stale data).
#[test]
fn the_gpu_tests_pass_on_the_emulated_device() {
    let tests = [
        "gpu_training_matches_the_cpu_and_checkpoints_move_between_them",
        "a_gpu_refuses_what_it_cannot_run_before_any_work_and_trains_lenet",
        "single_master_and_hierarchical_ddp_on_gpus_match_the_cpu",
    ];
    if common::rerun_on_the_emulated_device(&tests) {
        common::rerun_on_the_emulated_device_with(
            &tests,
            &[
                ("EMU_DEVICE_STREAMS", "async"),
                ("EMU_DEVICE_STREAM_DELAY_US", "50"),
            ],
        );
    }
}
