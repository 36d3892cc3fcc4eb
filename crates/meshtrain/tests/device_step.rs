//! The one step's device half, without a GPU: every chunk placed on the stand-in device
//! (`parallel.stand_in_device`, host memory behind the `DeviceState` line), so the run goes
//! through what a GPU run goes through (parameters bound as the device's views, the
//! grads-ready hook raised from `backward_done`, DDP's buckets on the device's gradient
//! buffer staged through host memory as ranks sharing one GPU stage them (`StagedGroup`,
//! its asynchronous uploads included), tied sums, fp16 unscaling, norms, clipping and the
//! update behind the trait, the
//! loss summed "on the device", checkpoints read from the device) with the host's
//! arithmetic. So a run on it must equal the CPU run bit for bit: any step the fold drops,
//! repeats or reorders shows here. The CUDA implementation of the same trait is checked
//! against these on a GPU (`scripts/gpu-check.sh`, the `multi` part).

use meshtrain::config::Config;
use meshtrain_train::checkpoint::StateSource;
use meshtrain_train::{RunOptions, Summary};
use std::path::Path;

mod common;
use common::{
    checkpoint_params, job, tiny_gpt_config, tiny_llama_config, tiny_resnet_config,
    written_checkpoint,
};

const STEPS: u64 = 6;
const STAND_IN: &str = "parallel.stand_in_device=true";

fn run(cfg: &Config, resume: Option<&Path>) -> Summary {
    let options = RunOptions {
        resume: resume.map(Path::to_path_buf),
        ..RunOptions::default()
    };
    (*job(cfg))
        .clone()
        .run(&options)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// (parameters from the written checkpoint, summary) of `model`'s tiny run with `extra`.
fn train(model: &str, until: u64, extra: &[&str], resume: Option<&Path>) -> (Vec<f32>, Summary) {
    let out = tempfile::tempdir().unwrap().keep();
    let cfg = match model {
        "llama" => tiny_llama_config(&out, until, extra),
        "resnet" => tiny_resnet_config(&out, until, extra),
        _ => tiny_gpt_config(&out, until, extra),
    };
    let summary = run(&cfg, resume);
    assert_eq!(summary.steps, until, "{extra:?}");
    (checkpoint_params(&cfg, &written_checkpoint(&out)), summary)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * b.abs().max(1.0)
}

/// Each layout and setting on the stand-in device against the same run on the CPU.
fn equal_to_the_cpu(model: &str, extra: &[&str]) {
    let (host, host_summary) = train(model, STEPS, extra, None);
    let mut placed = extra.to_vec();
    placed.push(STAND_IN);
    let (device, device_summary) = train(model, STEPS, &placed, None);
    assert_ne!(
        host,
        train(model, 1, extra, None).0,
        "{extra:?}: training moved nothing"
    );
    assert!(
        host.iter()
            .zip(&device)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{model} {extra:?}: the parameters differ from the CPU run's"
    );
    // Losses are summed per target on a device (the CPU averages micro-batch means).
    assert!(
        close(
            device_summary.final_train_loss as f64,
            host_summary.final_train_loss as f64
        ),
        "{extra:?}: training loss {} on the device, {} on the CPU",
        device_summary.final_train_loss,
        host_summary.final_train_loss
    );
    let (d, h) = (
        device_summary.eval_loss.unwrap(),
        host_summary.eval_loss.unwrap(),
    );
    assert!(close(d, h), "{extra:?}: evaluation loss {d} vs {h}");
    assert_eq!(
        device_summary.test_accuracy.is_some(),
        host_summary.test_accuracy.is_some()
    );
}

#[test]
fn one_worker_on_the_device_equals_the_cpu() {
    equal_to_the_cpu("gpt", &[]);
}

/// Tied embedding and head: their gradients summed in place on the device.
#[test]
fn tied_parameters_are_summed_on_the_device() {
    equal_to_the_cpu("gpt", &["model.tie_embeddings=true"]);
}

/// DDP's buckets as views of the device's gradient buffer, several per step, with
/// gradient accumulation (the hook fires on the last micro-batch only).
#[test]
fn ddp_buckets_on_the_device_gradients_equal_the_cpu() {
    equal_to_the_cpu(
        "gpt",
        &[
            "parallel.dp=2",
            "parallel.bucket_cap_mb=0.01",
            "parallel.first_bucket_mb=0.002",
        ],
    );
    equal_to_the_cpu("gpt", &["parallel.dp=2", "train.accumulation_steps=2"]);
}

/// DDP's bf16 wire on the device: each bucket rounded into a wire copy in the device's
/// memory, all-reduced, and widened back into the device's gradients (on a GPU by the
/// conversion kernels).
#[test]
fn ddp_bf16_wire_on_the_device_equals_the_cpu() {
    equal_to_the_cpu(
        "gpt",
        &[
            "parallel.dp=2",
            "parallel.compression=\"bf16\"",
            "parallel.bucket_cap_mb=0.01",
        ],
    );
}

/// fp16: the unscale-and-check and the skip decision through the device.
#[test]
fn fp16_loss_scaling_on_the_device_equals_the_cpu() {
    equal_to_the_cpu("gpt", &["train.precision=\"fp16\"", "parallel.dp=2"]);
}

/// A Llama (RMS norms, rotary, grouped key/value heads, SwiGLU) under DDP, with a clip that
/// never bites (the update without a pending factor).
#[test]
fn llama_on_the_device_equals_the_cpu() {
    equal_to_the_cpu("llama", &["parallel.dp=2", "train.grad_clip=1e9"]);
}

/// ResNet-18 (width 4, batch 16): batch norm's running statistics live in the device's buffers (and reach the checkpoint
/// through the mirror); SGD with momentum; no clipping, so the norm is the plain one.
/// SyncBatchNorm's sums go over the data-parallel group as on the CPU.
#[test]
fn resnet_buffers_and_sgd_on_the_device_equal_the_cpu() {
    equal_to_the_cpu(
        "resnet",
        &[
            "parallel.dp=2",
            "parallel.sync_batch_norm=true",
            "train.eval_every=3",
            "train.eval_batches=2",
        ],
    );
}

/// The single master (`nn.DataParallel`) on the device: the master scatters the batch from
/// the host, the replicas send it their gradients as device buffers, it adds them there in
/// rank order, updates alone and broadcasts its device's parameters; ResNet's running
/// statistics (the master's) go through the host. With fp16, whose skip decision the
/// master alone would otherwise make.
#[test]
fn single_master_on_the_device_equals_the_cpu() {
    let master = "parallel.dp_mode=\"single-master\"";
    equal_to_the_cpu("gpt", &["parallel.dp=2", master]);
    equal_to_the_cpu(
        "gpt",
        &["parallel.dp=2", master, "train.precision=\"fp16\""],
    );
    equal_to_the_cpu("resnet", &["parallel.dp=2", master, "train.eval_every=3"]);
}

/// ZeRO over the device's buffers: each block's reduce-scatter packed into wire buffers in
/// the device's memory (copy plans), from the device's gradients (stage 1) or from the
/// block's own gradient buffer there (stage 2, whose pieces are added into the device's
/// gradient buffer, sized for this rank's pieces); this rank's pieces updated, the
/// parameters all-gathered back into the device's buffer. With accumulation, tied
/// embeddings (summed in the pieces) and a clip that bites (the norm over every rank's
/// pieces): equal to the CPU's ZeRO, and to DDP on the device, bit for bit.
fn zero_on_the_device_equals_the_cpu_and_ddp(stage: &str) {
    let zero = [
        "parallel.dp=2",
        stage,
        "model.tie_embeddings=true",
        "train.grad_clip=0.05",
    ];
    let mut accumulated = zero.to_vec();
    accumulated.push("train.accumulation_steps=2");
    equal_to_the_cpu("gpt", &accumulated);
    // Against DDP on one micro-batch a step (stage 2 averages each micro-batch's gradients
    // as it reduces them, DDP their sum once: the same up to rounding only).
    let mut ddp = zero.to_vec();
    ddp.retain(|s| *s != stage);
    ddp.push(STAND_IN);
    let mut placed = zero.to_vec();
    placed.push(STAND_IN);
    let (sharded, _) = train("gpt", STEPS, &placed, None);
    let (ddp, _) = train("gpt", STEPS, &ddp, None);
    assert!(
        sharded
            .iter()
            .zip(&ddp)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{stage} on the device differs from DDP on the device"
    );
    // AdamW's moments and SGD's momentum both over the pieces; batch norm's buffers.
    equal_to_the_cpu(
        "resnet",
        &[
            "parallel.dp=2",
            stage,
            "train.eval_every=3",
            "train.eval_batches=2",
        ],
    );
}

#[test]
fn zero1_on_the_device_equals_the_cpu_and_ddp() {
    zero_on_the_device_equals_the_cpu_and_ddp("parallel.zero=1");
}

#[test]
fn zero2_on_the_device_equals_the_cpu_and_ddp() {
    zero_on_the_device_equals_the_cpu_and_ddp("parallel.zero=2");
}

/// ZeRO-3: the device holds this rank's parameter pieces (the host keeps no copy), each
/// block is all-gathered into the device's memory for its pass (the next one prefetched),
/// and the update runs over the pieces as over any flat buffer.
#[test]
fn zero3_on_the_device_equals_the_cpu_and_ddp() {
    zero_on_the_device_equals_the_cpu_and_ddp("parallel.zero=3");
    // Blocks kept from forward to backward instead of gathered twice.
    equal_to_the_cpu(
        "gpt",
        &[
            "parallel.dp=2",
            "parallel.zero=3",
            "parallel.reshard_after_forward=false",
        ],
    );
}

/// A ZeRO run stopped on the device resumes on the device and on the CPU where the straight
/// CPU run ends (its moments, and under stage 3 its parameters, come back from the device's
/// pieces).
#[test]
fn zero_checkpoints_move_between_the_device_and_the_cpu() {
    for stage in ["parallel.zero=1", "parallel.zero=2", "parallel.zero=3"] {
        checkpoint_moves(&["parallel.dp=2", stage]);
    }
}

/// A run of `layout` stopped on the device at step 3 resumes on the device and on the CPU
/// where the straight CPU run ends.
fn checkpoint_moves(layout: &[&str]) {
    let straight = train("gpt", STEPS, layout, None).0;
    let mut placed = layout.to_vec();
    placed.push(STAND_IN);
    let out = tempfile::tempdir().unwrap().keep();
    run(&tiny_gpt_config(&out, 3, &placed), None);
    let checkpoint = written_checkpoint(&out);
    let on_device = train("gpt", STEPS, &placed, Some(&checkpoint)).0;
    let on_cpu = train("gpt", STEPS, layout, Some(&checkpoint)).0;
    for (what, got) in [("the device", &on_device), ("the CPU", &on_cpu)] {
        assert!(
            got.iter()
                .zip(&straight)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{layout:?} resumed on {what}: the parameters differ from the straight run's"
        );
    }
}

/// A placed chunk's state lives on the device only: the host keeps no parameters,
/// gradients, buffers or optimizer moments between steps (only the optimizer's settings and
/// step count), training goes on without them, and neither a checkpoint, a copy of the
/// parameters nor loading a checkpoint leaves a host copy behind.
#[test]
fn a_placed_chunk_keeps_no_state_on_the_host() {
    let out = tempfile::tempdir().unwrap().keep();
    let cfg = tiny_gpt_config(&out, 2, &[STAND_IN]);
    let mut trainer = common::single_trainer(&cfg);
    let nothing_on_the_host = |t: &meshtrain_train::Trainer, when: &str| {
        let (chunk, optimizer) = (&t.parallel.stage.chunks[0], &t.parallel.optimizers[0]);
        assert!(chunk.device.is_some(), "placed on the stand-in");
        let host = [
            &chunk.store.values,
            &chunk.store.grads,
            &chunk.store.buffers,
            &optimizer.m,
            &optimizer.v,
        ];
        assert!(
            host.iter().all(|v| v.capacity() == 0),
            "{when}: the host holds {:?} elements",
            host.map(|v| v.capacity())
        );
    };
    nothing_on_the_host(&trainer, "after placement");
    let before = trainer.local_params();
    nothing_on_the_host(&trainer, "after copying the parameters");
    for _ in 0..2 {
        trainer.train_step().unwrap_or_else(|e| panic!("{e:#}"));
    }
    assert_ne!(trainer.local_params(), before, "two steps moved nothing");
    trainer
        .save_checkpoint(&out.join("checkpoint.safetensors"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    nothing_on_the_host(&trainer, "after a checkpoint");
    assert_eq!(trainer.parallel.optimizers[0].step, 2);
    // Loading writes each tensor to the device as it is read.
    let trained = trainer.local_params();
    let mut fresh = common::single_trainer(&cfg);
    fresh
        .resume(&out.join("checkpoint.safetensors"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    nothing_on_the_host(&fresh, "after loading a checkpoint");
    assert_eq!(
        fresh.local_params(),
        trained,
        "the loaded parameters differ"
    );
    assert_eq!(fresh.parallel.optimizers[0].step, 2);
    // Read from the device in pieces of 5 elements, the file is the same.
    let state = state_at_step_2(&trainer, StateSource::Worker(&trainer.parallel));
    let snapshot = meshtrain_train::checkpoint::Snapshot::of(&state).unwrap();
    let written = |name: &str, piece: usize| {
        let path = out.join(name);
        (snapshot.write_in_pieces(&path, Some(&trainer.parallel), piece)).unwrap();
        std::fs::read(path).unwrap()
    };
    assert_eq!(
        written("a.safetensors", 5),
        written("b.safetensors", 1 << 24)
    );
}

/// The checkpoint a run on the device writes (each tensor streamed from the device, ZeRO's
/// pieces gathered window by window as rank 0 writes) holds the bytes the CPU run's holds:
/// whole files of one chunk and of ZeRO-1/2/3's gathered pieces, sharded files of replicas
/// and of ZeRO's pieces, compared tensor by tensor (whole files) and piece checksum by piece
/// checksum (sharded).
#[test]
fn device_checkpoints_hold_the_cpus_bytes() {
    const WHOLE: &str = "train.checkpoint_format=\"whole\"";
    let layouts: [&[&str]; 7] = [
        &["parallel.dp=2"],
        &["parallel.dp=2", "train.checkpoint_format=\"sharded\""],
        &["parallel.dp=2", "parallel.zero=1"],
        &["parallel.dp=2", "parallel.zero=3"],
        &["parallel.dp=2", "parallel.zero=1", WHOLE],
        &["parallel.dp=2", "parallel.zero=2", WHOLE],
        &["parallel.dp=2", "parallel.zero=3", WHOLE],
    ];
    for layout in layouts {
        let written = |extra: &[&str]| {
            let out = tempfile::tempdir().unwrap().keep();
            run(&tiny_gpt_config(&out, 3, extra), None);
            written_checkpoint(&out)
        };
        let on_cpu = written(layout);
        let on_device = written(&[layout, &[STAND_IN]].concat());
        assert_eq!(
            checkpoint_contents(&on_device),
            checkpoint_contents(&on_cpu),
            "{layout:?}: the device's checkpoint differs from the CPU's"
        );
    }
}

/// ZeRO-3's whole file gathered in windows of 5 elements (windows that cut through every
/// rank's pieces, the second rank serving them) is the file gathered in windows of 16 Mi,
/// and holds the tensors of the whole state gathered first (the CPU's background path).
#[test]
fn a_gathered_whole_file_is_the_same_in_any_window() {
    let out = tempfile::tempdir().unwrap().keep();
    let layout = ["parallel.dp=2", "parallel.zero=3", STAND_IN];
    let cfg = tiny_gpt_config(&out, 2, &layout);
    let job = job(&cfg);
    let files = meshtrain_comm::ThreadsWorld::run(2, Default::default(), move |group| {
        let mut t = job.trainer(group, Some(1))?;
        for _ in 0..2 {
            t.train_step()?;
        }
        anyhow::ensure!(
            t.parallel.gathers_by_range(),
            "ZeRO-3 at dp=2 gathers by range"
        );
        let gathered = t.parallel.gather_state(&t.model, &t.whole)?;
        let state = state_at_step_2(&t, StateSource::Gathered(&t.parallel));
        let snapshot = meshtrain_train::checkpoint::Snapshot::of(&state)?;
        let mut files = Vec::new();
        if let Some((store, optimizer)) = &gathered {
            let whole = meshtrain_train::checkpoint::TrainState {
                source: StateSource::Host { store, optimizer },
                ..state
            };
            let path = out.join("gathered.safetensors");
            meshtrain_train::checkpoint::save(&path, &whole)?;
            files.push(std::fs::read(path)?);
        }
        for (name, piece) in [("small.safetensors", 5), ("large.safetensors", 1 << 24)] {
            let path = out.join(name);
            if t.is_lead() {
                snapshot.write_in_pieces(&path, Some(&t.parallel), piece)?;
                files.push(std::fs::read(path)?);
            } else {
                snapshot.serve_in_pieces(&t.parallel, piece)?;
            }
        }
        Ok::<_, anyhow::Error>(files)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let lead = &files[0];
    assert_eq!(lead.len(), 3);
    assert_eq!(lead[1], lead[2], "the windows changed the file");
    let dir = tempfile::tempdir().unwrap();
    let contents = |bytes: &[u8]| {
        let path = dir.path().join("file.safetensors");
        std::fs::write(&path, bytes).unwrap();
        checkpoint_contents(&path)
    };
    assert_eq!(
        contents(&lead[1]),
        contents(&lead[0]),
        "gathered by range and whole differ"
    );
}

/// `trainer`'s checkpoint after its two steps, from `source`, with no description.
fn state_at_step_2<'a>(
    trainer: &'a meshtrain_train::Trainer,
    source: StateSource<'a>,
) -> meshtrain_train::checkpoint::TrainState<'a> {
    meshtrain_train::checkpoint::TrainState {
        model: &trainer.whole,
        source,
        step: 2,
        model_description: "",
        config: "",
        loss_scaler: None,
        sampler: None,
    }
}

/// What a checkpoint holds, for comparing two: a whole file's tensors (name, shape, bytes)
/// and metadata but the run's settings; a sharded one's pieces (tensor, key, offset,
/// length, CRC-32) and step.
fn checkpoint_contents(path: &Path) -> Vec<String> {
    if path.is_dir() {
        let text = std::fs::read_to_string(path.join("index.json")).unwrap();
        let index: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut out = vec![format!("step {}", index["step"])];
        for (name, entry) in index["tensors"].as_object().unwrap() {
            for piece in entry["pieces"].as_array().unwrap() {
                out.push(format!(
                    "{name} {} {} {} {}",
                    piece["key"], piece["offset"], piece["len"], piece["crc32"]
                ));
            }
        }
        assert!(out.len() > 1, "{} holds no pieces", path.display());
        return out;
    }
    let bytes = std::fs::read(path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<String> = (file.tensors().into_iter())
        .map(|(name, t)| {
            use std::hash::{Hash, Hasher};
            let mut hash = std::collections::hash_map::DefaultHasher::new();
            t.data().hash(&mut hash);
            format!("{name} {:?} {:x}", t.shape(), hash.finish())
        })
        .collect();
    let mut meta: Vec<_> = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    meta.retain(|(k, _)| k != "config");
    meta.sort();
    out.extend(meta.into_iter().map(|(k, v)| format!("{k}={v}")));
    out.sort();
    out
}

/// Checkpoints move between devices: a run stopped on the device and resumed there
/// (its state uploaded from the checkpoint) ends where the straight CPU run ends, and a
/// device checkpoint resumes on the CPU.
#[test]
fn checkpoints_move_between_the_device_and_the_cpu() {
    checkpoint_moves(&["parallel.dp=2"]);
}

/// Every layout the CPU runs, run through the device half of the step on the stand-in
/// (each pipeline stage's chunks placed, tensor parallelism's sequence-parallel and
/// key/value sums over wire buffers in the chunk's memory, context parallelism, hybrids with
/// ZeRO): bit for bit the CPU run. What a GPU still lacks for them (activations and their
/// collectives in device memory) is refused before a GPU run starts (unit tests in
/// `meshtrain_parallel::device`).
#[test]
fn every_layout_on_the_stand_in_equals_the_cpu() {
    let gpt: [&[&str]; 9] = [
        &["parallel.pp=2", "parallel.micro_batches=4"],
        &[
            "parallel.pp=2",
            "parallel.micro_batches=4",
            "parallel.schedule=\"gpipe\"",
        ],
        &[
            "parallel.pp=2",
            "parallel.micro_batches=4",
            "parallel.schedule=\"interleaved\"",
        ],
        &["parallel.tp=2"],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
        &["parallel.cp=2"],
        &["parallel.cp=2", "parallel.cp_mode=\"ulysses\""],
        &[
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.micro_batches=4",
            "parallel.zero=1",
        ],
        &[
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.zero=3",
        ],
    ];
    for layout in gpt {
        equal_to_the_cpu("gpt", layout);
    }
    // Llama's key/value heads dealt over four ranks (their replicas' sums), and a pipeline
    // of tensor-parallel stages.
    equal_to_the_cpu(
        "llama",
        &["parallel.tp=4", "parallel.sequence_parallel=true"],
    );
    equal_to_the_cpu(
        "llama",
        &["parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=2"],
    );
}

/// A pipeline of tensor-parallel stages stopped on the stand-in resumes there and on the
/// CPU where the straight CPU run ends (the gathered whole file, then each stage's shards
/// written to its placed chunks tensor by tensor).
#[test]
fn hybrid_checkpoints_move_between_the_device_and_the_cpu() {
    checkpoint_moves(&["parallel.pp=2", "parallel.tp=2", "parallel.micro_batches=2"]);
}

/// A dp = 2 step's timeline: the passes on the compute row (on a device, from the device's
/// clock), each DDP bucket's all-reduce on the communication row, and what the compute
/// thread waited for at the end on the compute row; the same on the CPU.
#[test]
fn a_data_parallel_timeline_has_the_buckets_on_the_communication_row() {
    for placed in [false, true] {
        let dir = tempfile::tempdir().unwrap().keep();
        let trace = dir.join("step.json");
        let timeline = format!("parallel.timeline=\"{}\"", trace.display());
        let mut extra = vec![
            "parallel.dp=2",
            "parallel.bucket_cap_mb=0.01",
            "parallel.first_bucket_mb=0.002",
            &timeline,
        ];
        if placed {
            extra.push(STAND_IN);
        }
        train("gpt", 2, &extra, None);
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
        let events: Vec<_> = json["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == 0)
            .collect();
        let lane = |name: &str| {
            let found: Vec<_> = events.iter().filter(|e| e["name"] == name).collect();
            assert_eq!(found.len(), 1, "placed {placed}: {name} × {}", found.len());
            found[0]["tid"].as_u64().unwrap()
        };
        for compute in ["F0", "B0", "opt", "dp all-reduce wait"] {
            assert_eq!(lane(compute), 0, "placed {placed}: {compute}");
        }
        let buckets = events
            .iter()
            .filter(|e| e["name"].as_str().unwrap().starts_with("bucket "))
            .count();
        assert!(buckets >= 3, "placed {placed}: {buckets} bucket spans");
        assert_eq!(lane("bucket 0"), 1, "placed {placed}");
    }
}
