//! ZeRO stages 1–3 end to end (`Job::run`, as `meshtrain train`): each stage must end where
//! DDP on the same layout ends.
//!
//! Tolerance: on the threads backend a reduce-scatter adds the ranks' gradients in the same
//! order as an all-reduce, the update of a piece is the update of those elements, and the
//! gradient norm's partial sums are added in f64; so with one micro-batch per step every
//! stage is **bit-identical** to DDP. With several micro-batches ZeRO-2/3 reduce every
//! micro-batch's gradients (as DeepSpeed and FSDP do; DDP reduces their sum once), which
//! reorders the additions: there parameters agree to a relative L2 distance of 1e-5.

use meshtrain::config::Config;
use meshtrain_train::{RunOptions, Summary};
use std::path::Path;

mod common;
use common::{
    checkpoint_params, job, rel_diff, root, single_trainer, tiny_gpt_config, tiny_resnet_config,
    train_until, written_checkpoint,
};

const STEPS: u64 = 10;

fn run(cfg: &Config) -> Summary {
    (*job(cfg))
        .clone()
        .run(&RunOptions::default())
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// The whole GPT's parameters after `STEPS` steps of `extra`'s layout, read back from the
/// checkpoint the run wrote (so ZeRO's pieces are gathered the way a checkpoint gathers
/// them).
fn train(extra: &[&str]) -> Vec<f32> {
    train_model("gpt", extra)
}

fn train_model(model: &str, extra: &[&str]) -> Vec<f32> {
    let out = tempfile::tempdir().unwrap().keep();
    let cfg = match model {
        "resnet" => {
            let synced = [&["parallel.sync_batch_norm=true"], extra].concat();
            tiny_resnet_config(&out, STEPS, &synced)
        }
        _ => tiny_gpt_config(&out, STEPS, extra),
    };
    let summary = run(&cfg);
    assert_eq!(summary.steps, STEPS);
    // ZeRO runs write sharded checkpoints (a directory), the others one file.
    checkpoint_params(&cfg, &written_checkpoint(&out))
}

/// Trains `base` with DDP and with each ZeRO stage in `stages` and checks the stages end
/// within `tol` of DDP (0: bit-identical). Returns the differences.
fn against_ddp(model: &str, base: &[&str], stages: &[u8], tol: f64) -> Vec<f64> {
    let ddp = train_model(model, base);
    stages
        .iter()
        .map(|stage| {
            let mut extra = base.to_vec();
            let zero = format!("parallel.zero={stage}");
            extra.push(&zero);
            let params = train_model(model, &extra);
            let d = rel_diff(&params, &ddp);
            eprintln!("{model} {base:?} zero={stage} vs DDP: relative difference {d:.2e}");
            if tol == 0.0 {
                assert!(params == ddp, "{model} {base:?} zero={stage}: {d:.2e}");
            } else {
                assert!(
                    d <= tol,
                    "{model} {base:?} zero={stage}: {d:.2e} > {tol:.0e}"
                );
            }
            d
        })
        .collect()
}

#[test]
fn every_stage_matches_ddp_bit_for_bit_on_gpt() {
    against_ddp("gpt", &["parallel.dp=2"], &[1, 2, 3], 0.0);
    against_ddp("gpt", &["parallel.dp=4"], &[3], 0.0);
    // Tied embedding and head: the copies' pieces line up on every rank and add locally.
    against_ddp(
        "gpt",
        &["parallel.dp=2", "model.tie_embeddings=true"],
        &[1, 2, 3],
        0.0,
    );
}

#[test]
fn every_stage_matches_ddp_bit_for_bit_on_resnet18() {
    against_ddp("resnet", &["parallel.dp=2"], &[1, 2, 3], 0.0);
}

#[test]
fn accumulation_reduces_every_micro_batch_and_stays_close() {
    let d = against_ddp(
        "gpt",
        &["parallel.dp=2", "train.accumulation_steps=2"],
        &[1, 2, 3],
        1e-5,
    );
    // Stage 1 reduces once a step, like DDP: still bit-identical.
    assert_eq!(d[0], 0.0, "zero=1 with accumulation");
}

#[test]
fn stages_compose_with_tensor_parallelism_mixed_precision_and_pipelines() {
    against_ddp("gpt", &["parallel.dp=2", "parallel.tp=2"], &[1, 2, 3], 0.0);
    against_ddp(
        "gpt",
        &[
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "model.tie_embeddings=true",
        ],
        &[2, 3],
        0.0,
    );
    against_ddp(
        "gpt",
        &["parallel.dp=2", "train.precision=\"bf16\""],
        &[1, 3],
        0.0,
    );
    against_ddp(
        "gpt",
        &["parallel.dp=2", "train.precision=\"fp16\""],
        &[2],
        0.0,
    );
    against_ddp(
        "gpt",
        &["parallel.dp=2", "parallel.pp=2", "parallel.micro_batches=2"],
        &[1],
        0.0,
    );
}

#[test]
fn prefetch_and_resharding_change_memory_and_time_not_results() {
    let base = train(&["parallel.dp=2", "parallel.zero=3"]);
    for extra in [
        "parallel.zero_prefetch=false",
        "parallel.reshard_after_forward=false",
    ] {
        let other = train(&["parallel.dp=2", "parallel.zero=3", extra]);
        assert!(other == base, "{extra} changed the result");
    }
}

#[test]
fn unsupported_combinations_fail_before_any_work() {
    for (extra, expect) in [
        (
            vec!["parallel.dp=2", "parallel.pp=2", "parallel.zero=2"],
            "zero=2 with pp=2 is not available yet",
        ),
        (
            vec![
                "parallel.dp=2",
                "parallel.zero=1",
                "parallel.dp_mode=\"single-master\"",
            ],
            "single-master mode has no replicas to shard",
        ),
    ] {
        // A bad layout is refused when the config is read; a mode that cannot shard, when
        // the workers set up, before the first step.
        let out = tempfile::tempdir().unwrap();
        let text = std::fs::read_to_string(root().join("configs/gpt.toml")).unwrap();
        let mut o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        o.push(format!("train.out_dir=\"{}\"", out.path().display()));
        o.push("model.dim=32".into());
        o.push("model.layers=2".into());
        let err = match Config::from_toml_with_overrides(&text, &o) {
            Err(e) => format!("{e:#}"),
            Ok(cfg) => (*job(&cfg))
                .clone()
                .run(&RunOptions::default())
                .err()
                .map(|e| format!("{e:#}"))
                .unwrap_or_else(|| panic!("{extra:?} ran")),
        };
        assert!(err.contains(expect), "{extra:?}: {err}");
        assert!(
            !out.path().join("checkpoint.safetensors").exists(),
            "{extra:?} wrote a checkpoint"
        );
    }
}

/// Runs `extra` for two steps and returns rank 0's memory report.
fn memory_of(extra: &[&str]) -> meshtrain_train::memory::MemoryReport {
    let out = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(out.path(), 2, extra);
    run(&cfg).memory
}

#[test]
fn measured_model_states_match_the_formula_and_a_memory_limit_refuses_ddp() {
    for dp in [2, 4] {
        let mut states = Vec::new();
        for zero in 0..=3 {
            let r = memory_of(&[
                &format!("parallel.dp={dp}"),
                &format!("parallel.zero={zero}"),
            ]);
            let ratio = r.states_mib() / r.predicted_mib;
            eprintln!(
                "dp={dp} zero={zero}: measured {:.3} MiB, formula {:.3} MiB ({ratio:.4}), \
                 transient {:.3} MiB",
                r.states_mib(),
                r.predicted_mib,
                r.transient_mib
            );
            assert!(
                (ratio - 1.0).abs() < 0.05,
                "dp={dp} zero={zero}: measured {:.3} vs formula {:.3} MiB",
                r.states_mib(),
                r.predicted_mib
            );
            states.push(r.states_mib());
        }
        assert!(
            states.windows(2).all(|w| w[1] < w[0]),
            "every stage holds less than the one before: {states:?}"
        );
    }
    // A limit between ZeRO-3's and DDP's needs at dp = 4: DDP is refused before any step,
    // with both figures; ZeRO-3 trains. The limit covers the first step's activations and
    // ZeRO's transient buffers too: an 8-layer GPT, so that model states dominate, and the
    // limit above ZeRO-3's measured total.
    let (wide, deep) = ("model.dim=128", "model.layers=8");
    let ddp = memory_of(&["parallel.dp=4", wide, deep]).predicted_mib;
    let z3 = memory_of(&["parallel.dp=4", "parallel.zero=3", wide, deep]);
    let z3_total = z3.states_mib() + z3.transient_mib + z3.activations_mib;
    eprintln!("DDP {ddp:.1} MiB of states; ZeRO-3 {z3_total:.1} MiB in all");
    assert!(z3_total < ddp, "ZeRO-3 {z3_total:.1} vs DDP {ddp:.1} MiB");
    let limit_mb = (ddp + z3_total) / 2.0;
    let limit = format!("train.memory_limit_mb={limit_mb}");
    let out = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(out.path(), 2, &["parallel.dp=4", wide, deep, &limit]);
    let err = (*job(&cfg))
        .clone()
        .run(&RunOptions::default())
        .err()
        .map(|e| format!("{e:#}"))
        .expect("DDP over the limit ran");
    assert!(
        err.contains("train.memory_limit_mb allows") && err.contains("zero=3"),
        "{err}"
    );
    assert!(!out.path().join("checkpoint.safetensors").exists());
    let r = memory_of(&["parallel.dp=4", "parallel.zero=3", wide, deep, &limit]);
    assert!(r.states_mib() < limit_mb);
    // The same limit with the activations of a long sequence: refused after the first step,
    // naming the activations.
    let out = tempfile::tempdir().unwrap();
    let long = tiny_gpt_config(
        out.path(),
        2,
        &[
            "parallel.dp=4",
            "parallel.zero=3",
            wide,
            deep,
            "model.seq=1024",
            &limit,
        ],
    );
    let err = (*job(&long))
        .clone()
        .run(&RunOptions::default())
        .err()
        .map(|e| format!("{e:#}"))
        .expect("a long sequence over the limit ran");
    assert!(
        err.contains("MiB of activations") && err.contains("train.memory_limit_mb allows"),
        "{err}"
    );
}

/// The parameters a checkpoint (sharded or whole) holds, read by one worker.
fn params_of(checkpoint: &Path) -> Vec<f32> {
    let out = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(out.path(), STEPS, &[]);
    checkpoint_params(&cfg, checkpoint)
}

/// Tolerance: the continued runs split the same global batches differently (two replicas of
/// two tensor-parallel halves, two pipeline stages, one worker), which reorders
/// floating-point sums only; after 10 further steps parameters agree to a relative L2
/// distance of 2e-4, as every layout-equivalence test here (observed ~1e-7).
#[test]
fn a_zero3_checkpoint_resumes_on_other_layouts_as_the_uninterrupted_run() {
    let z3 = ["parallel.dp=4", "parallel.zero=3"];
    let whole = train_until(&z3, 30, None);
    let reference = params_of(&whole.join("checkpoint"));
    let saved = train_until(&z3, 20, None);
    let checkpoint = saved.join("checkpoint");
    assert!(checkpoint.join("index.json").exists(), "ZeRO saves sharded");
    for layout in [
        vec!["parallel.dp=4", "parallel.zero=3"],
        vec!["parallel.dp=2", "parallel.tp=2", "parallel.zero=1"],
        vec!["parallel.pp=2", "parallel.micro_batches=2"],
        vec![],
    ] {
        let out = train_until(&layout, 30, Some(&checkpoint));
        let d = rel_diff(&params_of(&written_checkpoint(&out)), &reference);
        eprintln!("resumed on {layout:?}: {d:.2e} from the uninterrupted run");
        assert!(d <= 2e-4, "resumed on {layout:?}: {d:.2e}");
        if layout == z3 {
            assert_eq!(d, 0.0, "the same layout resumes bit for bit");
        }
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The shard files of a sharded checkpoint directory.
fn shard_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let index = meshtrain_train::sharded::ShardedCheckpoint::open(dir).unwrap();
    index
        .index
        .files
        .iter()
        .map(|f| dir.join(&f.path))
        .collect()
}

/// Resuming `checkpoint` on one worker: the error, if any.
fn resume_error(checkpoint: &Path, extra: &[&str]) -> Option<String> {
    let out = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(out.path(), STEPS, extra);
    let mut t = single_trainer(&cfg);
    t.resume(checkpoint).err().map(|e| format!("{e:#}"))
}

#[test]
fn sharded_checkpoints_consolidate_and_broken_ones_name_the_file() {
    use meshtrain_train::sharded::{consolidate, describe, ShardedCheckpoint};
    let out = train_until(
        &["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"],
        10,
        None,
    );
    let dir = out.join("checkpoint");
    let params = params_of(&dir);
    let info = describe(&ShardedCheckpoint::open(&dir).unwrap());
    assert!(
        info.contains("step 10") && info.contains("dp=2,tp=2") && info.contains("4 shard file"),
        "{info}"
    );

    // Consolidated: one file any run resumes from, with the same parameters and optimizer
    // state (continuing from either gives the same run).
    let file = out.join("consolidated.safetensors");
    consolidate(&dir, &file, &|_, _| {}).unwrap();
    assert!(
        params_of(&file) == params,
        "consolidation changed parameters"
    );
    let from_shards = train_until(&[], 12, Some(&dir));
    let from_file = train_until(&[], 12, Some(&file));
    assert!(
        params_of(&from_shards.join("checkpoint.safetensors"))
            == params_of(&from_file.join("checkpoint.safetensors")),
        "resuming from the consolidated file differs from resuming from the shards"
    );

    let broken = |name: &str, damage: &dyn Fn(&Path)| -> String {
        let copy = tempfile::tempdir().unwrap().keep().join(name);
        copy_dir(&dir, &copy);
        damage(&copy);
        resume_error(&copy, &[]).unwrap_or_else(|| panic!("{name}: resumed"))
    };
    // A missing shard.
    let err = broken("missing", &|d| {
        std::fs::remove_file(&shard_files(d)[1]).unwrap()
    });
    assert!(
        err.contains("shard-00001-of-00004") && err.contains("missing"),
        "{err}"
    );
    // A flipped bit in a shard's data.
    let err = broken("corrupt", &|d| {
        let f = &shard_files(d)[2];
        let mut bytes = std::fs::read(f).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x10;
        std::fs::write(f, bytes).unwrap();
    });
    assert!(
        err.contains("shard-00002-of-00004") && err.contains("checksum"),
        "{err}"
    );
    // A truncated shard.
    let err = broken("truncated", &|d| {
        let f = &shard_files(d)[0];
        let bytes = std::fs::read(f).unwrap();
        std::fs::write(f, &bytes[..bytes.len() / 2]).unwrap();
    });
    assert!(
        err.contains("shard-00000-of-00004") && err.contains("truncated"),
        "{err}"
    );
    // An index that does not match the model (weights into a wider GPT).
    let wide = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(wide.path(), STEPS, &["model.dim=48"]);
    let err = format!("{:#}", single_trainer(&cfg).init_from(&dir).unwrap_err());
    assert!(
        err.contains("index.json") && err.contains("the model needs"),
        "{err}"
    );
}

#[test]
fn a_save_cut_short_before_its_index_leaves_the_previous_checkpoint() {
    let out = train_until(&["parallel.dp=2", "parallel.zero=2"], 10, None);
    let dir = out.join("checkpoint");
    let params = params_of(&dir);
    // What a crash in the middle of the next save leaves: a new step directory with a
    // partial shard, and a half-written temporary index.
    let partial = dir.join("step-00000020-00000000deadbeef");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("shard-00000-of-00002.safetensors"), b"partial").unwrap();
    std::fs::write(dir.join("index.json.tmp"), b"{\"format\": \"meshtr").unwrap();
    assert!(params_of(&dir) == params, "the previous checkpoint changed");
    // The next save commits over it and clears the debris.
    let resumed = tiny_gpt_config(&out, 12, &["parallel.dp=2", "parallel.zero=2"]);
    let options = RunOptions {
        resume: Some(dir.clone()),
        ..RunOptions::default()
    };
    (*job(&resumed)).clone().run(&options).unwrap();
    assert!(
        !partial.exists(),
        "the interrupted save's directory was left behind"
    );
    let steps = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
        .count();
    assert_eq!(steps, 1, "one step directory: the index's");
}
