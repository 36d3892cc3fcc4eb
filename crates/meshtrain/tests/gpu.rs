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

/// The GPU, for one test at a time: a step captured as CUDA graphs owns the device's
/// stream while it is captured or compared (another thread's work makes it fall back, which
/// the graph tests would report as a failure).
fn exclusive_gpu() -> std::sync::MutexGuard<'static, ()> {
    static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GPU.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

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
    let _gpu = exclusive_gpu();
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
    let _gpu = exclusive_gpu();
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
    let _gpu = exclusive_gpu();
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

/// The Llama block's switches for the Qwen families on the GPU, each against the CPU under
/// DDP over two ranks sharing the GPU: biases on q, k and v (Qwen2, Qwen2.5), and RMS norms
/// of each query and key head with heads wider than dim / heads (Qwen3's head_dim).
#[test]
fn the_qwen_switches_train_on_the_gpu_as_on_the_cpu() {
    if !gpu() {
        return;
    }
    let _gpu = exclusive_gpu();
    let steps = 4;
    let shape = [
        "model.dim=64",
        "model.heads=2",
        "model.kv_heads=1",
        "model.ffn=96",
        "parallel.dp=2",
    ];
    for switches in [
        &["model.qkv_bias=true"][..],
        &["model.qk_norm=true", "model.head_dim=64"],
    ] {
        let params = |device: &str| {
            let dir = tempfile::tempdir().unwrap();
            let device = format!("train.device=\"{device}\"");
            let extra = [&shape[..], switches, &[&device[..]]].concat();
            let cfg = common::tiny_llama_config(dir.path(), steps, &extra);
            let summary = run(&cfg, &RunOptions::default()).unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(summary.steps, steps);
            checkpoint_params(&cfg, &written_checkpoint(dir.path()))
        };
        let (cpu, gpu) = (params("cpu"), params("cuda"));
        let d = rel_diff(&gpu, &cpu);
        eprintln!("{switches:?}: the GPU against the CPU {d:.2e}");
        assert!(d < 1e-4, "{switches:?}: {d:.2e}");
    }
}

/// A small "step" of device work: its input uploaded into a fresh buffer, a product with a
/// weight, a kernel over the product, a scratch buffer cleared and copied into: each kind of
/// work a training step queues.
fn graph_test_step(
    dev: &std::sync::Arc<meshtrain_tensor::cuda::CudaDevice>,
    x: &[f32],
    w: &meshtrain_tensor::cuda::DevBuf,
    out: &meshtrain_tensor::cuda::DevBuf,
    (m, k): (usize, usize),
) -> Result<(), meshtrain_tensor::cuda::CudaError> {
    use meshtrain_tensor::cuda::blas::{Epilogue, Gemm};
    let n = x.len() / k;
    let xb = dev.upload(x, "graph test input")?;
    dev.with_blas(|b| {
        b.gemm(&Gemm {
            m,
            n,
            k,
            transa: false,
            transb: false,
            a: w.ptr(),
            lda: m,
            b: xb.ptr(),
            ldb: k,
            input: meshtrain_tensor::DType::F32,
            d: out.ptr(),
            ldd: m,
            output: meshtrain_tensor::DType::F32,
            accumulate: false,
            epilogue: Epilogue::None,
            alpha: 1.0,
            math: meshtrain_tensor::cuda::F32Math::Exact,
            fp8: None,
        })
    })?;
    meshtrain_tensor::cuda::train_ops::scale(dev, out.ptr(), m * n, 0.5)?;
    let scratch = dev.alloc_zeroed(m * n * 4, "graph test scratch")?;
    dev.copy(scratch.ptr(), out.ptr(), 16)?;
    Ok(())
}

/// A step captured as a CUDA graph, then replayed after shadow runs of its host code: each
/// replay with new uploaded inputs gives the eager step's bits; a step of another shape, or
/// one that reads device memory where the captured one did not, falls back to eager launches
/// (saying why) with the eager step's results, and the graph replays again afterwards. A
/// step that reads in its middle is two graphs with the read between them.
#[test]
fn a_captured_step_replays_with_new_inputs_and_falls_back_where_it_differs() {
    use meshtrain_tensor::cuda::graph::StepCapture;
    use meshtrain_tensor::cuda::CudaDevice;
    if !gpu() {
        return;
    }
    let _gpu = exclusive_gpu();
    let dev = CudaDevice::get(0).unwrap();
    let (m, k, n) = (8, 16, 4);
    let mut rng = meshtrain_tensor::rng::SplitMix64::new(7);
    let mut random = |len: usize| (0..len).map(|_| rng.normal()).collect::<Vec<f32>>();
    let w = dev.upload(&random(m * k), "w").unwrap();
    let out = dev.alloc(m * n * 2 * 4, "out").unwrap();
    let inputs: Vec<Vec<f32>> = (0..3).map(|_| random(k * n)).collect();
    let wider = random(k * n * 2);
    let eager = |x: &[f32]| {
        graph_test_step(&dev, x, &w, &out, (m, k)).unwrap();
        dev.download::<f32>(out.ptr(), m * x.len() / k).unwrap()
    };
    let expected: Vec<Vec<f32>> = inputs.iter().map(|x| eager(x)).collect();
    let expected_wider = eager(&wider);
    let host_w = dev.download::<f32>(w.ptr(), m * k).unwrap();
    for (x, e) in inputs.iter().zip(&expected) {
        for (j, col) in e.chunks(m).enumerate() {
            for (i, v) in col.iter().enumerate() {
                let r: f32 = (0..k)
                    .map(|p| host_w[p * m + i] * x[j * k + p])
                    .sum::<f32>()
                    * 0.5;
                assert!((v - r).abs() < 1e-4 * (1.0 + r.abs()), "{v} vs {r}");
            }
        }
    }
    let result = |len: usize| dev.download::<f32>(out.ptr(), len).unwrap();
    dev.memset_zero(out.ptr(), m * n * 2 * 4).unwrap();

    // Captured with the first input: the graph runs the step once.
    dev.begin_step_capture().unwrap();
    graph_test_step(&dev, &inputs[0], &w, &out, (m, k)).unwrap();
    let StepCapture::Graph(mut graph) = dev.end_step_capture().unwrap() else {
        panic!("the step fell back while captured")
    };
    assert_eq!(result(m * n), expected[0]);
    // upload, product, kernel, memset, copy, in one graph
    assert_eq!(graph.pieces(), (5, 1));
    for (x, e) in inputs.iter().zip(&expected).skip(1) {
        graph.begin_step().unwrap();
        graph_test_step(&dev, x, &w, &out, (m, k)).unwrap();
        assert_eq!(graph.end_step().unwrap(), None, "the step matched");
        assert_eq!(&result(m * n), e, "a replay with new inputs");
    }
    assert_eq!(graph.replays(), 2);

    // Another shape: eager, with the eager bits, and said why.
    graph.begin_step().unwrap();
    graph_test_step(&dev, &wider, &w, &out, (m, k)).unwrap();
    let why = graph.end_step().unwrap().expect("a wider step falls back");
    assert!(why.contains("differs from the captured step"), "{why}");
    assert_eq!(result(2 * m * n), expected_wider);
    // A read where the captured step had none: it falls back there, and the read sees the
    // work queued before it.
    graph.begin_step().unwrap();
    graph_test_step(&dev, &inputs[2], &w, &out, (m, k)).unwrap();
    assert_eq!(result(m * n), expected[2]);
    dev.memset_zero(out.ptr(), 4).unwrap();
    let why = graph.end_step().unwrap().expect("a read falls back");
    assert!(why.contains("reads device memory"), "{why}");
    assert_eq!(result(1), vec![0.0]);
    // The graph still replays a step that matches it.
    graph.begin_step().unwrap();
    graph_test_step(&dev, &inputs[1], &w, &out, (m, k)).unwrap();
    assert_eq!(graph.end_step().unwrap(), None);
    assert_eq!(result(m * n), expected[1]);
    assert_eq!(graph.replays(), 3);
    // Another thread's work on the device during a shadow run: the step falls back (its
    // pieces issued first) rather than mixing that work into the graph or dropping it.
    graph.begin_step().unwrap();
    graph_test_step(&dev, &inputs[1], &w, &out, (m, k)).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            dev.bind().unwrap();
            dev.memset_zero(out.ptr(), 4).unwrap();
        });
    });
    let why = graph
        .end_step()
        .unwrap()
        .expect("another thread's work falls back");
    assert!(why.contains("another thread"), "{why}");
    assert_eq!(result(m * n)[1..], expected[1][1..]);
    assert_eq!(result(1), vec![0.0]);
    drop(graph);

    // A step that reads device memory in its middle: captured as two graphs with the read
    // between them, and replayed so, the read seeing the first graph's work.
    let read_step = |x: &[f32]| -> Vec<f32> {
        graph_test_step(&dev, x, &w, &out, (m, k)).unwrap();
        let seen = result(m * n);
        meshtrain_tensor::cuda::train_ops::scale(&dev, out.ptr(), m * n, 2.0).unwrap();
        seen
    };
    let doubled = |e: &[f32]| e.iter().map(|v| v * 2.0).collect::<Vec<f32>>();
    dev.begin_step_capture().unwrap();
    assert_eq!(read_step(&inputs[0]), expected[0]);
    let StepCapture::Graph(mut graph) = dev.end_step_capture().unwrap() else {
        panic!("a step with a read fell back while captured")
    };
    assert_eq!(graph.pieces(), (6, 2), "six pieces in two graphs");
    assert_eq!(result(m * n), doubled(&expected[0]));
    for (x, e) in inputs.iter().zip(&expected).skip(1) {
        graph.begin_step().unwrap();
        assert_eq!(&read_step(x), e, "the read between the replayed graphs");
        assert_eq!(graph.end_step().unwrap(), None);
        assert_eq!(result(m * n), doubled(e));
    }
    // Without the read, the second piece of work differs from the captured point.
    graph.begin_step().unwrap();
    graph_test_step(&dev, &inputs[1], &w, &out, (m, k)).unwrap();
    meshtrain_tensor::cuda::train_ops::scale(&dev, out.ptr(), m * n, 2.0).unwrap();
    let why = graph
        .end_step()
        .unwrap()
        .expect("a step without the read falls back");
    assert!(why.contains("reads device memory"), "{why}");
    assert_eq!(result(m * n), doubled(&expected[1]));
    drop(graph);
    // And eager work after all this gives the same bits.
    assert_eq!(eager(&inputs[2]), expected[2]);
}

/// `train.cuda_graph`: after two eager steps the step is captured as CUDA graphs and
/// replayed; the run learns the same parameters, to the bit, as the eager run on the GPU:
/// the GPT in fp32, and the Llama (rotary positions, grouped key/value heads, SwiGLU) in
/// bf16 with its 16-bit compute copy.
#[test]
fn a_run_replaying_its_steps_as_cuda_graphs_learns_the_eager_runs_parameters() {
    if !gpu() {
        return;
    }
    let _gpu = exclusive_gpu();
    let steps = 6;
    type Make = fn(&std::path::Path, u64, &[&str]) -> Config;
    let gpt: Make = tiny_gpu_gpt_config;
    let llama: Make = |out, steps, extra| {
        let mut o = vec!["model.dim=64", "model.heads=2", "model.kv_heads=1"];
        o.extend_from_slice(extra);
        common::tiny_llama_config(out, steps, &o)
    };
    for (name, make, precision) in [("gpt", gpt, "fp32"), ("llama", llama, "bf16")] {
        let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
        let precision = format!("train.precision=\"{precision}\"");
        let eager_cfg = make(
            dirs[0].path(),
            steps,
            &["train.device=\"cuda\"", &precision],
        );
        let eager_run = run(&eager_cfg, &RunOptions::default()).unwrap();
        assert_eq!(eager_run.graph_replays, None);
        let eager = checkpoint_params(&eager_cfg, &written_checkpoint(dirs[0].path()));
        let graph_cfg = make(
            dirs[1].path(),
            steps,
            &["train.device=\"cuda\"", &precision, "train.cuda_graph=true"],
        );
        let graphed = run(&graph_cfg, &RunOptions::default()).unwrap();
        // Steps 1 and 2 eager, 3 captured (and run as its graphs), the rest replayed.
        assert_eq!(graphed.graph_replays, Some(steps - 3), "{name}");
        let replayed = checkpoint_params(&graph_cfg, &written_checkpoint(dirs[1].path()));
        assert_eq!(replayed, eager, "{name}: the replayed run's parameters");
        assert_eq!(
            graphed.final_train_loss, eager_run.final_train_loss,
            "{name}"
        );
    }
}

/// A step the driver refuses to capture (on the emulated device,
/// `EMU_DEVICE_REFUSE_CAPTURED_LAUNCH` refuses the third kernel of each capture, as a real
/// driver may refuse a kernel for reasons of its own) runs eagerly: the capture ends, its
/// pieces are issued as ordinary launches, the step completes, and the run learns the eager
/// run's parameters (without the fallback, the refused launch failed the run). Runs only
/// where the device refuses.
#[test]
fn a_step_the_driver_refuses_to_capture_runs_eagerly_and_learns_the_same() {
    if !gpu() || std::env::var_os("EMU_DEVICE_REFUSE_CAPTURED_LAUNCH").is_none() {
        return;
    }
    let _gpu = exclusive_gpu();
    let steps = 4;
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let eager_cfg = tiny_gpu_gpt_config(dirs[0].path(), steps, &["train.device=\"cuda\""]);
    let eager_run = run(&eager_cfg, &RunOptions::default()).unwrap();
    let graph_cfg = tiny_gpu_gpt_config(
        dirs[1].path(),
        steps,
        &["train.device=\"cuda\"", "train.cuda_graph=true"],
    );
    let refused = run(&graph_cfg, &RunOptions::default()).unwrap();
    assert_eq!(
        refused.graph_replays,
        Some(0),
        "nothing was captured to replay"
    );
    assert_eq!(
        checkpoint_params(&graph_cfg, &written_checkpoint(dirs[1].path())),
        checkpoint_params(&eager_cfg, &written_checkpoint(dirs[0].path())),
        "the refused run's parameters"
    );
    assert_eq!(refused.final_train_loss, eager_run.final_train_loss);
}

/// The GPU tests above on the emulated CUDA device (`crates/tensor/tests/cuda_emu/device`):
/// the CUDA path's host code (launch shapes, arguments, buffers, the allocator, checkpoints
/// moving between devices) runs here on every machine with g++ and CUDA's headers, not only
/// on a card. Once with every call done when it returns, once with each stream on a thread
/// of its own and random delays (where a missing wait between streams reads stale data), side
/// by side; and the capture the driver refuses.
#[test]
fn the_gpu_tests_pass_on_the_emulated_device() {
    let tests = [
        "gpu_training_matches_the_cpu_and_checkpoints_move_between_them",
        "a_gpu_refuses_what_it_cannot_run_before_any_work_and_trains_lenet",
        "single_master_and_hierarchical_ddp_on_gpus_match_the_cpu",
        "the_qwen_switches_train_on_the_gpu_as_on_the_cpu",
        "a_captured_step_replays_with_new_inputs_and_falls_back_where_it_differs",
        "a_run_replaying_its_steps_as_cuda_graphs_learns_the_eager_runs_parameters",
    ];
    let asynchronous = [
        ("EMU_DEVICE_STREAMS", "async"),
        ("EMU_DEVICE_STREAM_DELAY_US", "50"),
    ];
    let refusing = [("EMU_DEVICE_REFUSE_CAPTURED_LAUNCH", "3")];
    common::rerun_on_the_emulated_device_concurrently(&[
        (&tests, &[]),
        (&tests, &asynchronous),
        (
            &["a_step_the_driver_refuses_to_capture_runs_eagerly_and_learns_the_same"],
            &refusing,
        ),
    ]);
}
