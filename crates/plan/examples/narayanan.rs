//! Prints Table 1 of Narayanan et al. 2021 beside the planner's predictions.
//! `cargo run -p meshtrain-plan --release --example narayanan`
use meshtrain_plan::validation::{predict_narayanan, NARAYANAN_TABLE1};

fn main() -> anyhow::Result<()> {
    for mb in [1u64, 2, 4] {
        println!("micro-batch {mb}");
        for row in &NARAYANAN_TABLE1 {
            let p = predict_narayanan(row, mb)?;
            let t = &p.evaluation.time;
            println!(
                "{:>9} t={} p={:>2} n={:>4} B={:>4}  published {:>5.1}  predicted {:>6.1}  ({:+.1}%)  step {:.2}s comp {:.2} rec {:.2} tp {:.2} p2p {:.3} bub {:.2} dp {:.2} opt {:.3} mem {:.1}GiB fits={}",
                row.preset, row.tp, row.pp, row.gpus, row.batch, row.published_tflops_per_gpu,
                p.evaluation.throughput.tflops_per_gpu, p.error_percent, t.step_s, t.compute_s, t.recompute_s,
                t.tp_comm_s, t.pp_p2p_s, t.bubble_s, t.dp_exposed_s, t.optimizer_s,
                p.evaluation.memory.total() / (1u64 << 30) as f64, p.evaluation.fits
            );
        }
    }
    Ok(())
}
