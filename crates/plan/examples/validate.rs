//! Prints the validation tables of docs/benchmarks.md (section "Planner"):
//! `cargo run -p meshtrain-plan --release --example validate`
use std::time::Instant;

use meshtrain_plan::layout::TrainingSetup;
use meshtrain_plan::memory::model_state_bytes;
use meshtrain_plan::search::search_feasible;
use meshtrain_plan::validation::{
    predict_korthikanti, predict_narayanan, predict_published, KORTHIKANTI_530B, NARAYANAN_TABLE1,
    PUBLISHED_RUNS,
};
use meshtrain_plan::{presets, Precision, Problem};

fn main() -> anyhow::Result<()> {
    println!("## Narayanan et al. 2021, Table 1 (A100 80GB, fp16, full recomputation; micro-batch and interleaving of the paper's artifact)\n");
    println!("| params | t | p | GPUs | batch | mb | v | published TFLOP/s/GPU | predicted | error | bubble | TP comm | PP p2p | DP comm | fixed | mem GiB |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for row in &NARAYANAN_TABLE1 {
        let p = predict_narayanan(row)?;
        let t = &p.evaluation.time;
        let share = |x: f64| 100.0 * x / t.step_s;
        println!(
            "| {}B | {} | {} | {} | {} | {} | {} | {:.0} | {:.1} | {:+.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1} |",
            row.billions, row.tp, row.pp, row.gpus, row.batch, row.micro_batch, row.interleave,
            row.published_tflops_per_gpu,
            p.evaluation.throughput.tflops_per_gpu, p.error_percent,
            share(t.bubble_s), share(t.tp_comm_s), share(t.pp_p2p_s), share(t.dp_exposed_s),
            share(t.optimizer_s),
            p.evaluation.memory.total() / (1u64 << 30) as f64,
        );
    }
    println!("\n## Korthikanti et al. 2022 (530B on 2240 A100s, abstract)\n");
    println!("| run | published MFU | predicted MFU | error |");
    println!("|---|---|---|---|");
    for run in &KORTHIKANTI_530B {
        let e = predict_korthikanti(run)?;
        let mfu = 100.0 * e.throughput.mfu;
        println!(
            "| {} | {:.1}% | {:.1}% | {:+.1}% |",
            run.label,
            run.published_mfu_percent,
            mfu,
            100.0 * (mfu - run.published_mfu_percent) / run.published_mfu_percent
        );
    }
    println!(
        "\n## Further published runs (torchtitan FSDP2 on 64 A100 80GB, docs/performance.md)\n"
    );
    println!("| run | layout | published tokens/s/GPU | predicted | error | dp exposed |");
    println!("|---|---|---|---|---|---|");
    for run in &PUBLISHED_RUNS {
        let e = predict_published(run)?;
        let predicted = e.throughput.tokens_per_s / run.gpus as f64;
        println!(
            "| {} | {} | {:.0} | {:.0} | {:+.1}% | {:.1}% |",
            run.label,
            run.layout,
            run.published_tokens_per_gpu,
            predicted,
            100.0 * (predicted - run.published_tokens_per_gpu) / run.published_tokens_per_gpu,
            100.0 * e.time.dp_exposed_s / e.time.step_s
        );
    }
    println!("\n## ZeRO (Rajbhandari et al. 2020): 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12)\n");
    println!("| stage | paper GB | predicted GB |");
    println!("|---|---|---|");
    let bytes = TrainingSetup::new(1, Precision::Fp16).bytes_per_param();
    for (zero, paper) in [(0u8, "120"), (1, "31.4"), (2, "16.6"), (3, "1.9")] {
        let gb = model_state_bytes(7.5e9, bytes, zero, 64).total() / 1e9;
        println!("| {zero} | {paper} | {gb:.3} |");
    }
    println!("\n## Search time: 30B and 70B on 32 H100 (8 per node), global batch 512\n");
    println!(
        "| model | layouts evaluated | fit | best layout | tokens/s | TFLOP/s/GPU | MFU | time |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let cluster = presets::cluster("h100")?.with_gpus(32)?;
    for name in ["gpt-30b", "llama-70b"] {
        let problem = Problem::new(
            presets::model(name)?,
            cluster.clone(),
            TrainingSetup::new(512, Precision::Bf16),
        )?;
        let start = Instant::now();
        let result = search_feasible(&problem)?;
        let elapsed = start.elapsed();
        let best = result.best().expect("feasible");
        println!(
            "| {name} | {} | {} | `{}` | {:.0} | {:.0} | {:.1}% | {:.1} ms |",
            result.candidates,
            result.ranked.len(),
            best.layout,
            best.throughput.tokens_per_s,
            best.throughput.tflops_per_gpu,
            100.0 * best.throughput.mfu,
            elapsed.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
