//! The Llama model (RMS norms, rotary positions, grouped-query attention, SwiGLU) on every
//! parallel dimension against one worker on the same global batches, as the GPT's layout
//! tests do: 10 steps of the tiny Llama (4 query heads sharing 2 key/value heads) must end at
//! the parameters of one worker up to the order of floating-point sums (relative L2 ≤ 2e-4
//! in fp32, ≤ 2e-3 in bf16 against one bf16 worker; see tensor_parallel.rs and
//! mixed_precision.rs for why those bounds). Under context parallelism the parameters only
//! agree if every worker rotates its tokens by their places in the whole sequence: a worker
//! rotating by its local positions trains a different model (checked below).

use meshtrain_train::RunOptions;

mod common;
use common::{
    checkpoint_params, job, rel_diff, tiny_llama_config, tiny_llama_config_result,
    written_checkpoint,
};

const STEPS: u64 = 10;

/// Parameters after 10 steps and the last evaluation loss.
fn train(extra: &[&str]) -> (Vec<f32>, f64) {
    let out = tempfile::tempdir().unwrap().keep();
    let cfg = tiny_llama_config(&out, STEPS, extra);
    let summary = (*job(&cfg))
        .clone()
        .run(&RunOptions::default())
        .unwrap_or_else(|e| panic!("{extra:?}: {e:#}"));
    assert_eq!(summary.steps, STEPS);
    let eval = summary.eval_loss.expect("evaluated");
    (checkpoint_params(&cfg, &written_checkpoint(&out)), eval)
}

/// The settings of a layout written as the tests list them: `"cp=2 ulysses"` is the grid
/// `cp=2` with Ulysses' all-to-all, any other the grid with ring attention.
fn layout_settings(layout: &str) -> [String; 2] {
    let (grid, mode) = match layout.strip_suffix(" ulysses") {
        Some(grid) => (grid, "ulysses"),
        None => (layout, "ring"),
    };
    [
        format!("parallel.layout=\"{grid}\""),
        format!("parallel.cp_mode=\"{mode}\""),
    ]
}

#[test]
fn llama_on_every_parallel_dimension_matches_one_worker() {
    let (single, single_eval) = train(&[]);
    for layout in [
        "tp=2",
        "tp=2,sp=on",
        // More ranks than key/value heads: each head replicated over 2 ranks.
        "tp=4",
        "tp=4,sp=on",
        "dp=2,tp=4,zero=1",
        "cp=2",
        "cp=2 ulysses",
        "pp=2,m=2",
        "dp=2,zero=3",
        "dp=2,tp=2,pp=2,m=2,sp=on",
        "cp=2,tp=2",
    ] {
        let [setting, cp_mode] = layout_settings(layout);
        let (params, eval) = train(&[&setting, &cp_mode]);
        let d = rel_diff(&params, &single);
        let de = (eval - single_eval).abs() / single_eval;
        eprintln!("llama {layout}: parameters {d:.2e}, eval loss {de:.2e}");
        assert!(d <= 2e-4, "{layout}: parameters {d:.2e}");
        assert!(de <= 1e-5, "{layout}: eval loss {eval} vs {single_eval}");
    }
    // Multi-query attention (one key/value head for all) and tied embeddings.
    let mqa = ["model.kv_heads=1", "model.tie_embeddings=true"];
    let (single, _) = train(&mqa);
    for layout in ["pp=2,m=2,dp=2", "tp=2", "tp=4,pp=2,m=2"] {
        let setting = format!("parallel.layout=\"{layout}\"");
        let (split, _) = train(&[mqa[0], mqa[1], &setting]);
        let d = rel_diff(&split, &single);
        eprintln!("llama MQA, tied, {layout}: {d:.2e}");
        assert!(d <= 2e-4, "MQA {layout}: {d:.2e}");
    }
    // Qwen2's q/k/v biases: split with their rows (by key/value group, dealt on more ranks
    // than groups, their replicated key/value part summed over the ranks sharing it).
    let qwen2 = ["model.qkv_bias=true", "model.tie_embeddings=true"];
    let (single, _) = train(&qwen2);
    for layout in ["dp=2", "tp=2", "tp=4", "tp=2,sp=on", "dp=2,tp=2,pp=2,m=2"] {
        let setting = format!("parallel.layout=\"{layout}\"");
        let (split, _) = train(&[qwen2[0], qwen2[1], &setting]);
        let d = rel_diff(&split, &single);
        eprintln!("llama with q/k/v biases (Qwen2), {layout}: {d:.2e}");
        assert!(d <= 2e-4, "Qwen2 {layout}: {d:.2e}");
    }
    // Qwen3's block: heads wider than dim / heads and RMS norms on each query and key head,
    // whose weights' gradients are partial on each tensor-parallel rank (its heads) and are
    // summed over the group (also on more ranks than key/value heads, where each key head's
    // gradient is split among its replicas).
    // SGD with momentum, whose steps scale with the gradients (AdamW's hardly do): a norm
    // gradient summed twice would show.
    let qwen3 = [
        "model.qk_norm=true",
        "model.head_dim=12",
        "model.tie_embeddings=true",
        "optimizer={kind=\"sgd\",momentum=0.9,weight_decay=0.0}",
        "schedule.lr=0.05",
    ];
    let (single, _) = train(&qwen3);
    for layout in [
        "dp=2",
        "tp=2",
        "tp=4",
        "tp=2,sp=on",
        "tp=4,sp=on",
        "cp=2",
        "dp=2,tp=2,pp=2,m=2",
    ] {
        let setting = format!("parallel.layout=\"{layout}\"");
        let mut extra = qwen3.to_vec();
        extra.push(&setting);
        let (split, _) = train(&extra);
        let d = rel_diff(&split, &single);
        eprintln!("llama with q/k norms and head size 12 (Qwen3), {layout}: {d:.2e}");
        // f32 sums in other orders: ~2e-8 (the norms' gradients summed twice under sequence
        // parallelism read 1.4e-4).
        assert!(d <= 1e-6, "Qwen3 {layout}: {d:.2e}");
    }
    // Mistral's sliding window: each of the 16 tokens sees at most the last 5. Every layout
    // that keeps whole sequences of some heads on a rank runs it (Ulysses among them); ring
    // attention's blocks would cut the window and are refused by name.
    let mistral = ["model.sliding_window=5"];
    let (single, _) = train(&mistral);
    let (full, _) = train(&[]);
    assert!(
        rel_diff(&single, &full) > 1e-3,
        "a window of 5 over 16 tokens trains another model"
    );
    for layout in [
        "dp=2",
        "tp=2",
        "tp=2,sp=on",
        "cp=2 ulysses",
        "dp=2,tp=2,pp=2,m=2",
    ] {
        let [setting, cp_mode] = layout_settings(layout);
        let (split, _) = train(&[mistral[0], &setting, &cp_mode]);
        let d = rel_diff(&split, &single);
        eprintln!("llama with a sliding window of 5 (Mistral), {layout}: {d:.2e}");
        assert!(d <= 2e-4, "Mistral {layout}: {d:.2e}");
    }
    let out = tempfile::tempdir().unwrap();
    let ring = [
        mistral[0],
        "parallel.layout=\"cp=2\"",
        "parallel.cp_mode=\"ring\"",
    ];
    let e = format!(
        "{:#}",
        tiny_llama_config_result(out.path(), STEPS, &ring).unwrap_err()
    );
    assert!(
        e.contains("sliding window of 5 keys, which ring attention's blocks do not cut"),
        "{e}"
    );
}

#[test]
fn llama_in_bf16_matches_one_bf16_worker() {
    let (fp32, _) = train(&[]);
    let (single, _) = train(&["train.precision=\"bf16\""]);
    for layout in ["tp=2,sp=on", "cp=2", "pp=2,m=2"] {
        let setting = format!("parallel.layout=\"{layout},precision=bf16\"");
        let (params, _) = train(&[&setting]);
        let d = rel_diff(&params, &single);
        eprintln!("llama bf16 {layout}: {d:.2e}");
        assert!(d <= 2e-3, "{layout}: {d:.2e}");
        let from_fp32 = rel_diff(&params, &fp32);
        assert!(from_fp32 > 1e-4, "{layout}: ran in fp32? {from_fp32:.2e}");
    }
}

/// tp must give each rank whole key/value groups, or replicas of one: 4 key/value heads for
/// 12 query heads over tp = 6 (neither) is refused before any work, naming the layer and the
/// tp values that work.
#[test]
fn tensor_parallelism_that_splits_a_key_value_head_is_refused() {
    let out = tempfile::tempdir().unwrap().keep();
    let err = tiny_llama_config_result(
        &out,
        STEPS,
        &[
            "model.dim=48",
            "model.heads=12",
            "model.kv_heads=4",
            "parallel.layout=\"tp=6\"",
        ],
    )
    .expect_err("tp=6 over 4 key/value heads must be refused");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("4 key/value heads for 12 query heads")
            && msg.contains("choose tp among 1, 2, 4, 12"),
        "{msg}"
    );
}

/// `meshtrain plan --model configs/X.toml` plans the network `meshtrain train --config
/// configs/X.toml` builds: the planner reads the training config's `[model]` table and counts
/// the parameters the trainer allocates.
#[test]
fn the_planner_and_the_trainer_read_one_model_description() {
    for file in [
        "configs/llama.toml",
        "configs/llama-bpe.toml",
        "configs/gpt.toml",
    ] {
        let text = std::fs::read_to_string(common::root().join(file)).unwrap();
        let planned = meshtrain_plan::model::ModelSpec::from_toml(&text)
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let cfg = meshtrain::config::Config::from_toml_with_overrides(&text, &[]).unwrap();
        let built = meshtrain::presets::build_model(&cfg.model);
        assert_eq!(
            planned.total_params(),
            built.num_unique_params() as u64,
            "{file}"
        );
    }
    // The 1B shape, counted without building it (5 GB): the planner's count, the config's own
    // (`LlamaConfig::params`, checked against built models), and Llama 3.2 1B's.
    let text = std::fs::read_to_string(common::root().join("configs/llama-1b.toml")).unwrap();
    let planned = meshtrain_plan::model::ModelSpec::from_toml(&text).unwrap();
    let cfg = meshtrain::config::Config::from_toml_with_overrides(&text, &[]).unwrap();
    cfg.validate().unwrap();
    let meshtrain::config::ModelConfig::Llama(llama) = &cfg.model else {
        panic!("configs/llama-1b.toml is a Llama")
    };
    assert_eq!(planned.total_params(), llama.params() as u64);
    assert_eq!(llama.params(), 1_235_814_400);
    // Qwen3's switches (its own head size, the q/k norms) are counted by both.
    let text = std::fs::read_to_string(common::root().join("configs/llama.toml")).unwrap();
    let text = text.replacen("[model]\n", "[model]\nhead_dim = 96\nqk_norm = true\n", 1);
    let planned = meshtrain_plan::model::ModelSpec::from_toml(&text).unwrap();
    let cfg = meshtrain::config::Config::from_toml_with_overrides(&text, &[]).unwrap();
    let built = meshtrain::presets::build_model(&cfg.model);
    assert_eq!(planned.total_params(), built.num_unique_params() as u64);
    // The switch Qwen2 needs is counted by both.
    let text = std::fs::read_to_string(common::root().join("configs/llama.toml")).unwrap();
    let text = text.replacen("[model]\n", "[model]\nqkv_bias = true\n", 1);
    let planned = meshtrain_plan::model::ModelSpec::from_toml(&text).unwrap();
    let cfg = meshtrain::config::Config::from_toml_with_overrides(&text, &[]).unwrap();
    let built = meshtrain::presets::build_model(&cfg.model);
    assert_eq!(planned.total_params(), built.num_unique_params() as u64);
    let plain = meshtrain::presets::build_model(
        &meshtrain::config::Config::from_toml_with_overrides(
            &std::fs::read_to_string(common::root().join("configs/llama.toml")).unwrap(),
            &[],
        )
        .unwrap()
        .model,
    );
    assert!(built.num_unique_params() > plain.num_unique_params());
}

/// Checkpoints written with key/value heads replicated over tensor-parallel ranks (tp=4 over
/// 2 heads; whole, and sharded with every rank's replica in its piece) resume on other
/// layouts as the uninterrupted one-worker run.
#[test]
fn replicated_key_value_heads_checkpoint_and_resume_on_any_layout() {
    fn until(extra: &[&str], steps: u64, resume: Option<&std::path::Path>) -> std::path::PathBuf {
        let out = tempfile::tempdir().unwrap().keep();
        let cfg = tiny_llama_config(&out, steps, extra);
        let options = RunOptions {
            resume: resume.map(std::path::Path::to_path_buf),
            ..RunOptions::default()
        };
        let summary = (*job(&cfg))
            .clone()
            .run(&options)
            .unwrap_or_else(|e| panic!("{extra:?}: {e:#}"));
        assert_eq!(summary.steps, steps);
        out
    }
    let cfg = tiny_llama_config(std::path::Path::new("/unused"), STEPS, &[]);
    let uninterrupted = checkpoint_params(&cfg, &written_checkpoint(&until(&[], STEPS, None)));
    for (writer, reader) in [
        (
            vec![
                "parallel.layout=\"tp=4\"",
                "train.checkpoint_format=\"sharded\"",
            ],
            vec!["parallel.layout=\"tp=2\""],
        ),
        (vec!["parallel.layout=\"tp=4\""], vec![]),
        (vec![], vec!["parallel.layout=\"tp=4,sp=on\""]),
    ] {
        let first = until(&writer, 5, None);
        let resumed = until(&reader, STEPS, Some(&written_checkpoint(&first)));
        let d = rel_diff(
            &checkpoint_params(&cfg, &written_checkpoint(&resumed)),
            &uninterrupted,
        );
        eprintln!("llama {writer:?} → {reader:?}: {d:.2e}");
        assert!(d <= 2e-4, "{writer:?} → {reader:?}: {d:.2e}");
    }
}
