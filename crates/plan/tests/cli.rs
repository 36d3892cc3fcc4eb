//! End-to-end tests of the `meshtrain plan` code path (argument parsing → output text).

use clap::Parser;
use meshtrain_plan::cli::{render, PlanArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: PlanArgs,
}

fn args(line: &[&str]) -> PlanArgs {
    let mut argv = vec!["plan"];
    argv.extend_from_slice(line);
    Cli::try_parse_from(argv).expect("arguments parse").args
}

fn temp_file(name: &str, text: &str) -> String {
    let path = std::env::temp_dir().join(format!("meshtrain-plan-{}-{name}", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn table_for_gpt_on_the_cpu_machine() {
    let out = render(&args(&[
        "--model",
        "gpt",
        "--cluster",
        "cpu",
        "--global-batch",
        "32",
        "--top",
        "3",
    ]))
    .unwrap();
    assert!(
        out.starts_with("gpt on 2 × cpu-2core, global batch 32, fp32:"),
        "{out}"
    );
    assert_eq!(
        out.lines()
            .filter(|l| l.trim_start().starts_with(char::is_numeric))
            .count(),
        3,
        "{out}"
    );
}

#[test]
fn json_output_parses_and_ranks() {
    let out = render(&args(&[
        "--model",
        "gpt-30b",
        "--cluster",
        "h100",
        "--gpus",
        "32",
        "--global-batch",
        "256",
        "--json",
        "--top",
        "4",
    ]))
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let plans = v["plans"].as_array().unwrap();
    assert_eq!(plans.len(), 4);
    let rates: Vec<f64> = plans
        .iter()
        .map(|p| p["throughput"]["samples_per_s"].as_f64().unwrap())
        .collect();
    // The recommendation (at most 0.5% slower than the fastest), then fastest first.
    assert!(rates.windows(2).all(|w| w[1] <= 1.005 * w[0]), "{rates:?}");
    assert!(rates[1..].windows(2).all(|w| w[1] <= w[0]), "{rates:?}");
    assert!(plans.iter().all(|p| p["fits"].as_bool().unwrap()));
}

#[test]
fn explain_writes_the_memo() {
    let out = render(&args(&[
        "--model",
        "gpt-30b",
        "--cluster",
        "h100",
        "--gpus",
        "32",
        "--global-batch",
        "256",
        "--explain",
    ]))
    .unwrap();
    assert!(
        out.contains("1. Fitting in memory") && out.contains("5. What will stop perfect scaling"),
        "{out}"
    );
}

#[test]
fn a_layout_that_does_not_fit_is_a_clear_error() {
    let err = render(&args(&[
        "--model",
        "gpt-30b",
        "--cluster",
        "h100",
        "--gpus",
        "8",
        "--global-batch",
        "64",
        "--layout",
        "dp=8,mb=1",
    ]))
    .unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("does not fit: needs") && text.contains("has 80.0 GiB"),
        "{text}"
    );
}

#[test]
fn bad_inputs_give_clear_errors() {
    let zero = render(&args(&["--cluster", "h100", "--gpus", "0"])).unwrap_err();
    assert!(format!("{zero:#}").contains("at least one GPU"), "{zero:#}");
    let negative = Cli::try_parse_from(["plan", "--gpus", "-8"])
        .err()
        .unwrap()
        .to_string();
    assert!(
        negative.contains("cannot be negative (got -8)"),
        "{negative}"
    );
    let maybe = render(&args(&["--cluster", "h100", "--layout", "tp=2,sp=maybe"]));
    assert!(
        format!("{:#}", maybe.unwrap_err()).contains("`maybe` is not on or off"),
        "sp=maybe must be an error"
    );
    let heads = temp_file("heads.toml", "name='odd'\n[transformer]\nlayers=2\nhidden=100\nheads=3\nffn_hidden=400\nvocab=10\nseq_len=8\n");
    let err = render(&args(&["--model", &heads])).unwrap_err();
    assert!(
        format!("{err:#}").contains("not divisible by the number of heads"),
        "{err:#}"
    );
    let neg = temp_file(
        "neg.toml",
        &include_str!("../presets/clusters/h100-sxm-80gb.toml")
            .replace("bandwidth_gbps = 45.0", "bandwidth_gbps = -45.0"),
    );
    let err = render(&args(&["--cluster", &neg])).unwrap_err();
    assert!(
        format!("{err:#}").contains("inter_node.bandwidth_gbps must be a positive number"),
        "{err:#}"
    );
    let tp = render(&args(&[
        "--model",
        "gpt",
        "--cluster",
        "h100",
        "--gpus",
        "8",
        "--layout",
        "dp=1,tp=8",
    ]))
    .unwrap_err();
    assert!(
        format!("{tp:#}").contains("4 attention heads are not divisible by tp = 8"),
        "{tp:#}"
    );
}

#[test]
fn diagnose_names_the_regression() {
    let file = temp_file(
        "diag.json",
        r#"{"run": [{"workers": 8, "compute_s": 1.0}, {"workers": 16, "compute_s": 1.0, "comm_exposed_s": 0.6}]}"#,
    );
    let out = render(&args(&["--diagnose", &file])).unwrap();
    assert!(out.contains("mostly from exposed communication"), "{out}");
}

#[test]
fn calibration_and_comparison_path() {
    let measured = temp_file(
        "measured.toml",
        "matmul_gflops = 100.0\nallreduce_bus_bandwidth_gbps = 4.0\n",
    );
    let run = temp_file(
        "run.toml",
        "workers = 2\ncompute_s = 0.5\ncomm_exposed_s = 0.05\n",
    );
    let out = render(&args(&[
        "--model",
        "resnet18",
        "--cluster",
        "cpu",
        "--global-batch",
        "64",
        "--measured",
        &measured,
        "--layout",
        "dp=2,mb=32",
        "--compare",
        &run,
    ]))
    .unwrap();
    assert!(
        out.contains("cpu-2core (calibrated)") && out.contains("predicted vs measured"),
        "{out}"
    );
}

#[test]
fn shipped_examples_work() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/presets/examples");
    let out = render(&args(&[
        "--diagnose",
        &format!("{dir}/scaling-8-to-16.toml"),
    ]))
    .unwrap();
    assert!(
        out.contains("speed-up ×10.0 counting the 8-worker run as ×8"),
        "{out}"
    );
    // With one network card per node, the planner keeps data-parallel and tensor-parallel
    // traffic inside nodes and lets only pipeline boundaries cross them.
    let cluster = format!("{dir}/h100-slow-inter-node.toml");
    let out = render(&args(&[
        "--model",
        "gpt-30b",
        "--cluster",
        &cluster,
        "--global-batch",
        "256",
        "--json",
        "--top",
        "1",
    ]))
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let best = &v["plans"][0];
    assert_eq!(best["links"]["dp_crosses_nodes"], false, "{best}");
    assert_eq!(best["links"]["tp_crosses_nodes"], false, "{best}");
    assert_eq!(best["links"]["pp_crosses_nodes"], true, "{best}");
}

#[test]
fn attention_and_cp_mode_flags() {
    let base = [
        "--model",
        "gpt-30b",
        "--cluster",
        "h100",
        "--gpus",
        "8",
        "--seq",
        "32768",
        "--global-batch",
        "8",
    ];
    let with = |extra: &[&str]| {
        let mut line = base.to_vec();
        line.extend_from_slice(extra);
        render(&args(&line))
    };
    // Flash is the default, and the run line tells the trainer (whose default is standard).
    let out = with(&[
        "--layout",
        "dp=2,cp=4,zero=3,mb=1,recompute=full",
        "--explain",
    ])
    .unwrap();
    assert!(out.contains("do not fit; flash attention"), "{out}");
    let row = out.lines().nth(2).unwrap();
    assert!(
        row.contains("dp=2 tp=1 pp=1 cp=4 zero=3 mb=1 recompute=full") && row.contains("ring"),
        "{out}"
    );
    // Flash is the trainer's default too: the run line names only the cp mode.
    assert!(
        out.contains("--set parallel.cp_mode=\"ring\"") && !out.contains("model.attention"),
        "{out}"
    );
    assert!(
        out.contains("The planner picked ring for this layout"),
        "{out}"
    );
    // A fixed mode is used as given, and no alternative is offered.
    let fixed = [
        "--layout",
        "dp=2,cp=4,zero=3,mb=1,recompute=full",
        "--explain",
        "--cp-mode",
    ];
    let out = with(&[&fixed[..], &["ulysses"]].concat()).unwrap();
    assert!(out.lines().nth(2).unwrap().contains("ulysses"), "{out}");
    assert!(!out.contains("The planner picked"), "{out}");
    // With the standard kernel Ulysses keeps a·s²/cp probabilities per layer (too many
    // here); ring's blocks run the memory-efficient kernel regardless, and the trainer needs
    // no attention option.
    let out = with(&[&fixed[..], &["ring", "--attention", "standard"]].concat()).unwrap();
    assert!(out.contains("do not fit; standard attention"), "{out}");
    assert!(
        out.contains("ring attention's blocks run the memory-efficient kernel"),
        "{out}"
    );
    assert!(!out.contains("model.attention=\""), "{out}");
    let err = with(&[&fixed[..], &["ulysses", "--attention", "standard"]].concat()).unwrap_err();
    assert!(format!("{err:#}").contains("does not fit"), "{err:#}");
    // Ulysses cannot give gpt-30b's 28 heads per tensor-parallel rank to 8 cp ranks.
    let err = render(&args(&[
        "--model",
        "gpt-30b",
        "--cluster",
        "h100",
        "--gpus",
        "16",
        "--layout",
        "tp=2,cp=8,zero=3",
        "--cp-mode",
        "ulysses",
    ]))
    .unwrap_err();
    assert!(
        format!("{err:#}")
            .contains("28 heads per tensor-parallel rank are not divisible by cp = 8"),
        "{err:#}"
    );
    for (flag, value, message) in [
        ("--cp-mode", "tree", "cp mode `tree`: ring or ulysses"),
        (
            "--attention",
            "sparse",
            "attention `sparse`: standard or flash",
        ),
    ] {
        let err = with(&[flag, value]).unwrap_err();
        assert!(format!("{err:#}").contains(message), "{err:#}");
    }
}

/// Every "N% of perfect scaling" in a memo.
fn scaling_claims(memo: &str) -> Vec<f64> {
    memo.split("% of perfect scaling")
        .filter_map(|before| {
            let number: String = before
                .chars()
                .rev()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            number.parse().ok()
        })
        .collect()
}

/// Issue 19: the memo of a ZeRO-3 layout over a slow inter-node link quoted the gradient size
/// as the traffic, claimed 104.7% of perfect scaling and named recomputation the bottleneck.
#[test]
fn zero3_memo_counts_the_gathers_stays_under_perfect_scaling_and_names_the_sharding_traffic() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/presets/examples");
    let cluster = format!("{dir}/h100-slow-inter-node.toml");
    let out = render(&args(&[
        "--model",
        "gpt-30b",
        "--cluster",
        &cluster,
        "--global-batch",
        "256",
        "--layout",
        "dp=32,zero=3,mb=8,recompute=full",
        "--explain",
    ]))
    .unwrap();
    // 30B parameters in bf16 (~60 GB): gathered for forward and for backward and reduced
    // once, in the one micro-batch: ~180 GB, not the 60 GB of gradients.
    assert!(
        out.contains("179.89 GB through each GPU's link per step"),
        "{out}"
    );
    assert!(out.contains("all-gathered before each forward and again before each backward"));
    let claims = scaling_claims(&out);
    assert!(!claims.is_empty(), "{out}");
    assert!(claims.iter().all(|&c| c <= 100.0), "{claims:?}\n{out}");
    assert!(
        out.contains("Most likely bottleneck for scaling: data-parallel sharding traffic"),
        "{out}"
    );
    assert!(!out.contains("bottleneck for scaling: activation recomputation"));
    // Recomputation is named as what it is: a per-GPU cost.
    assert!(out.contains("which do not limit scaling: activation recomputation"));
    assert!(out.contains("Predicted by the same model"), "{out}");
}

/// The background scenario (a model that does not fit one GPU, 32 GPUs, fast links inside
/// nodes and slow between): the memo's numbers are the layout table's, it names what stops
/// 32× scaling and predicts the first mitigation with the same model.
#[test]
fn background_memo_agrees_with_the_table_and_predicts_its_mitigation() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/presets/examples");
    let cluster = format!("{dir}/h100-slow-inter-node.toml");
    let line = [
        "--model",
        "gpt-30b",
        "--cluster",
        &cluster,
        "--global-batch",
        "256",
        "--top",
        "1",
    ];
    let json = render(&args(&[&line[..], &["--json"]].concat())).unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let best = &v["plans"][0];
    let step = best["time"]["step_s"].as_f64().unwrap();
    let out = render(&args(&[&line[..], &["--explain"]].concat())).unwrap();
    assert!(out.contains("does not fit in 80 GiB"), "{out}");
    assert!(
        out.contains(&format!("predicted step {step:.3} s")),
        "{out}"
    );
    let exposed = best["time"]["dp_exposed_s"].as_f64().unwrap();
    assert!(
        out.contains(&format!(
            "{exposed:.3} s ({:.1}% of the step) are exposed",
            100.0 * exposed / step
        )),
        "{out}"
    );
    for needle in [
        "Costs of spreading the work over 32 GPUs",
        "of perfect scaling",
        "Most likely bottleneck for scaling",
        "First mitigation",
        "Predicted by the same model: applying it,",
    ] {
        assert!(out.contains(needle), "missing `{needle}` in:\n{out}");
    }
    assert!(scaling_claims(&out).iter().all(|&c| c <= 100.0));
}

/// Issue 28: the table promised fastest first but listed longer predicted steps above shorter
/// ones. Now the recommendation leads (the simplest layout within 0.5% of the fastest, and a
/// note says so when it is not the fastest row) and every other row is fastest first.
#[test]
fn the_table_lists_layouts_after_the_recommendation_fastest_first() {
    let out = render(&args(&[
        "--model",
        "gpt",
        "--cluster",
        "cpu",
        "--top",
        "40",
        "--explain",
    ]))
    .unwrap();
    // Fixed-width columns: a row's step time ends where the header's `step s` ends.
    let header = out.lines().find(|l| l.contains("step s")).expect("a table");
    let end = header.find("step s").unwrap() + "step s".len();
    let steps: Vec<f64> = out
        .lines()
        .skip_while(|l| !l.contains("step s"))
        .skip(1)
        .take_while(|l| l.trim_start().starts_with(char::is_numeric))
        .map(|l| l[end - 9..end].trim().parse().expect("a step time"))
        .collect();
    assert_eq!(steps.len(), 40, "{out}");
    assert!(
        steps[1..].windows(2).all(|w| w[0] <= w[1]),
        "step times after #1 not ascending: {steps:?}\n{out}"
    );
    let fastest = steps.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(steps[0] <= 1.005 * fastest + 1e-4, "{steps:?}");
    assert_eq!(
        out.contains("#1 is recommended over the fastest"),
        steps[0] > fastest,
        "{out}"
    );
    assert!(out.contains("Recommendation for gpt"), "{out}");
}
