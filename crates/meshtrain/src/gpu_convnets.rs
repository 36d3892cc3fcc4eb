//! The `convnets` part of `meshtrain bench gpu`: LeNet and ResNet-18, the background's first
//! models, on the GPU.
//!
//! 1. Each net (LeNet in both variants, ResNet-18 at D2L's width) on the GPU against the CPU
//!    on the same batches: fp32 parameters and batch norm's running statistics within 1e-5
//!    relative L2 after 3 steps (the GPU's checkpoint read back on the CPU, so checkpoints
//!    move between the devices too); after 20, LeNet's parameters within 2e-4 relative L2
//!    (what the CPU suite allows a change in the order of sums over 20 steps) and ResNet-18's
//!    mean loss over the second half within 10% (it is chaotic at the rounding level:
//!    [`Net::long`]); bf16 losses within 1% of the CPU's bf16.
//! 2. Data parallelism on the GPU: dp = 2 (ranks sharing the GPU through staged collectives,
//!    or NCCL across GPUs) against one GPU on the same global batch; ResNet-18 with
//!    SyncBatchNorm, whose statistics are then those of the whole batch.
//! 3. The step time of D2L's LeNet (batch 256) and ResNet-18 (batch 128) in fp32, fp32 with
//!    TF32 products and bf16, as `RESULT` lines beside which `scripts/gpu-check.sh` prints
//!    PyTorch's (`scripts/gpu/pytorch_convnets_bench.py`, same card, same call).
//! 4. D2L's scaling experiment on the GPU: `bench scaling --device cuda` at 1, 2 and 4 workers.

use crate::gpu_bench::{train_and_read, Trained};
use crate::gpu_multi::{close_losses_within, verdict, STEPS};
use crate::scaling::{self, BenchScalingArgs};
use anyhow::Result;
use meshtrain_tensor::cuda::check::rel_l2;
use std::path::Path;
use std::time::Instant;

/// The part on the GPU; returns its failures (each also printed as a `FAIL` line).
pub fn run(root: &Path) -> Result<Vec<String>> {
    println!("\n== convnets: LeNet and ResNet-18 on the GPU against the CPU");
    let mut failed = Vec::new();
    if let Err(e) = checks(&mut failed, root, "cuda", &NETS) {
        println!("FAIL the conv nets on the GPU: {e:#}");
        failed.push(format!("the conv nets on the GPU: {e:#}"));
    }
    if let Err(e) = speed(root) {
        println!("FAIL the conv nets' step time: {e:#}");
        failed.push(format!("the conv nets' step time: {e:#}"));
    }
    if let Err(e) = scaling_on(root, "cuda") {
        println!("FAIL bench scaling --device cuda: {e:#}");
        failed.push(format!("bench scaling --device cuda: {e:#}"));
    }
    Ok(failed)
}

/// A conv net of the checks: its name, config and settings.
struct Net {
    name: &'static str,
    config: &'static str,
    settings: &'static [&'static str],
    /// How far 20 steps may drift from the CPU: the parameters' relative L2 (LeNet), or, for
    /// a net chaotic at the rounding level, the mean loss of the run's second half. Every net
    /// is held to 1e-5 (its parameters and buffers) over its first [`EXACT_STEPS`] steps,
    /// before a ReLU kink or a pooling tie can send a gradient another way. ResNet-18 is such
    /// a net: one CPU worker whose initial weights are nudged by 1e-7 ends 20 steps ~5e-2 away
    /// (`tests/data_parallel.rs`), and one CPU worker against dp = 2 with SyncBatchNorm (the
    /// same model, sums in another order) at the check's settings has equal losses to step 5,
    /// then 4.2% apart at step 7 and 17.6% at step 20; their second halves' means are 1.8%
    /// apart. LeNet's 2e-4 is what the CPU suite allows a change in the order of sums over 20
    /// steps.
    long: Drift,
}

#[derive(Clone, Copy)]
enum Drift {
    Parameters(f64),
    /// The mean loss over the second half of the run, relative.
    MeanLoss(f64),
}

/// Steps over which every net must match to 1e-5.
const EXACT_STEPS: u64 = 3;

/// Steps over which a chaotic net's bf16 losses are compared (1%): the loss at init and after
/// one update. Where bf16 rounds is itself enough to move ResNet-18's third loss by more
/// than 1%: on the CPU alone, bf16 against fp32 at the check's settings (batch 64, lr 1e-2,
/// 2e-2, 3e-2) is 2.4% apart at step 3 and 0.2% at step 2, and the GPU, which keeps every
/// activation in bf16, was 2.8% from the CPU's bf16 at step 3 on the emulated device.
const CHAOTIC_BF16_STEPS: u64 = 2;

const NETS: [Net; 3] = [
    Net {
        name: "LeNet (ReLU, max pooling)",
        config: "configs/lenet.toml",
        settings: &[],
        long: Drift::Parameters(2e-4),
    },
    Net {
        name: "LeNet (sigmoid, average pooling)",
        config: "configs/lenet.toml",
        settings: &["model.variant=\"sigmoid\""],
        long: Drift::Parameters(2e-4),
    },
    Net {
        name: "ResNet-18",
        config: "configs/resnet18.toml",
        settings: &["train.batch_size=64"],
        long: Drift::MeanLoss(0.1),
    },
];

impl Net {
    /// `steps` steps of this net on `device` with `extra` settings: one worker unless `extra`
    /// says otherwise, fp32 products exact (no TF32), a few thousand training images.
    fn train(&self, root: &Path, device: &str, steps: u64, extra: &[&str]) -> Result<Trained> {
        let mut o: Vec<String> = [
            "parallel.dp=1",
            "train.tf32=false",
            "train.threads=4",
            "data.train_limit=4096",
            "data.test_limit=256",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        o.push(format!("train.device=\"{device}\""));
        o.push(format!("train.max_steps={steps}"));
        o.extend(self.settings.iter().map(|s| s.to_string()));
        o.extend(extra.iter().map(|s| s.to_string()));
        train_and_read(root, self.config, &o, None)
    }
}

/// Whether `a` ended within `tolerance` relative L2 of `b`'s parameters (and buffers: batch
/// norm's running statistics, which the training loss never reads) after `steps` steps.
fn same_state(
    failed: &mut Vec<String>,
    what: &str,
    steps: u64,
    tolerance: f64,
    a: &Trained,
    b: &Trained,
) {
    let d = rel_l2(&a.params, &b.params);
    let buffers = if b.buffers.is_empty() {
        String::new()
    } else {
        format!(", buffers {:.2e}", rel_l2(&a.buffers, &b.buffers))
    };
    let worst = d.max(if b.buffers.is_empty() {
        0.0
    } else {
        rel_l2(&a.buffers, &b.buffers)
    });
    verdict(
        failed,
        worst <= tolerance,
        format!("{what} after {steps} steps: parameters {d:.2e}{buffers} relative L2 (≤ {tolerance:.0e})"),
    );
}

/// Whether run `a`'s mean loss over the second half of its steps is within `tolerance`
/// (relative) of `b`'s, both runs having logged the same, non-zero number of steps: for a net
/// whose single losses part at the rounding level, that it keeps learning as much.
fn close_mean_losses(
    failed: &mut Vec<String>,
    what: &str,
    a: &Trained,
    b: &Trained,
    tolerance: f64,
) {
    let second_half = |l: &[f64]| {
        let tail = &l[l.len() / 2..];
        tail.iter().sum::<f64>() / tail.len().max(1) as f64
    };
    let (mean_a, mean_b) = (second_half(&a.losses), second_half(&b.losses));
    let off = ((mean_a - mean_b) / mean_b).abs();
    let off = if off.is_finite() { off } else { f64::INFINITY };
    verdict(
        failed,
        !b.losses.is_empty() && a.losses.len() == b.losses.len() && off <= tolerance,
        format!(
            "{what}: mean loss over steps {}–{} {mean_a:.4} against {mean_b:.4}, {:.2}% apart \
             (≤ {}%; single steps part at the rounding level)",
            b.losses.len() / 2 + 1,
            b.losses.len(),
            off * 100.0,
            tolerance * 100.0
        ),
    );
}

/// Checks 1 and 2 on `device` (`cuda`; `cpu` for their own test, where every line must say
/// ok).
fn checks(failed: &mut Vec<String>, root: &Path, device: &str, nets: &[Net]) -> Result<()> {
    let start = Instant::now();
    for net in nets {
        let short = |device: &str, extra: &[&str]| net.train(root, device, EXACT_STEPS, extra);
        let cpu_short = short("cpu", &[])?;
        let here_short = short(device, &[])?;
        let what = format!("fp32 {} on {device} vs the CPU", net.name);
        same_state(failed, &what, EXACT_STEPS, 1e-5, &here_short, &cpu_short);
        let cpu = net.train(root, "cpu", STEPS, &[])?;
        let here = net.train(root, device, STEPS, &[])?;
        match net.long {
            Drift::Parameters(tolerance) => {
                same_state(failed, &what, STEPS, tolerance, &here, &cpu);
                close_losses_within(failed, &what, &here, &cpu, 1e-3);
            }
            Drift::MeanLoss(tolerance) => close_mean_losses(failed, &what, &here, &cpu, tolerance),
        }
        // bf16 rounds in more places on the GPU (it keeps every activation in bf16, the CPU
        // only the products' inputs): losses within 1%, over the first two steps for a
        // chaotic net ([`CHAOTIC_BF16_STEPS`]).
        let bf16 = ["train.precision=\"bf16\""];
        let bf16_steps = match net.long {
            Drift::Parameters(_) => STEPS,
            Drift::MeanLoss(_) => CHAOTIC_BF16_STEPS,
        };
        let cpu16 = net.train(root, "cpu", bf16_steps, &bf16)?;
        let here16 = net.train(root, device, bf16_steps, &bf16)?;
        let what = format!("bf16 {} on {device} vs bf16 on the CPU", net.name);
        close_losses_within(failed, &what, &here16, &cpu16, 1e-2);
        let two = short(device, &["parallel.dp=2", "parallel.sync_batch_norm=true"])?;
        let what = format!(
            "fp32 {} dp=2 on {device} (SyncBatchNorm where it has batch norm) vs one worker there",
            net.name
        );
        same_state(failed, &what, EXACT_STEPS, 1e-5, &two, &here_short);
        for run in [cpu_short, here_short, cpu, here, cpu16, here16, two] {
            let _ = std::fs::remove_dir_all(&run.out);
        }
    }
    println!("(conv-net checks: {:.1} s)", start.elapsed().as_secs_f64());
    Ok(())
}

/// Check 3: one worker's step time, as `RESULT` lines.
fn speed(root: &Path) -> Result<()> {
    println!("\n-- step time (one GPU; PyTorch's beside it in pytorch.log's convnets lines)");
    for (model, batch) in [("lenet", 256), ("resnet18", 128)] {
        for (precision, tf32) in [("fp32", false), ("fp32", true), ("bf16", false)] {
            let args = BenchScalingArgs {
                models: model.into(),
                workers: "1".into(),
                threads: 4,
                steps: Some(if model == "lenet" { 200 } else { 50 }),
                warmup: 10,
                overrides: vec![
                    format!("train.batch_size={batch}"),
                    format!("train.precision=\"{precision}\""),
                    format!("train.tf32={tf32}"),
                ],
                device: Some("cuda".into()),
                ..BenchScalingArgs::default()
            };
            let run = scaling::measure_one(root, model, 1, &args)?;
            let label = if tf32 { "tf32" } else { precision };
            println!(
                "RESULT meshtrain-{model} {label} batch={batch} step_ms={:.3} samples_s={:.0} \
                 data_ms={:.3}",
                run.step_ms, run.samples_per_s, run.data_ms
            );
        }
    }
    Ok(())
}

/// Check 4: D2L's experiment on `device` at 1, 2 and 4 workers.
fn scaling_on(root: &Path, device: &str) -> Result<()> {
    println!("\n-- meshtrain bench scaling --device {device} (LeNet, ResNet-18; 1, 2, 4 workers)");
    let args = BenchScalingArgs {
        models: "lenet,resnet18".into(),
        threads: 4,
        warmup: 5,
        device: Some(device.into()),
        ..BenchScalingArgs::default()
    };
    scaling::run_scaling_in(root, &args)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checks' own logic on the CPU, where the "device" is the CPU itself: every line
    /// must say ok (dp = 2 with SyncBatchNorm equals one worker there too). ResNet-18 at
    /// width 8, so the test stays short on two cores.
    #[test]
    fn the_conv_net_checks_pass_on_the_cpu() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let narrow = [
            Net {
                name: "LeNet (sigmoid, average pooling)",
                ..NETS[1]
            },
            Net {
                name: "ResNet-18 (width 8)",
                config: "configs/resnet18.toml",
                settings: &["train.batch_size=32", "model.width=8"],
                long: Drift::MeanLoss(0.1),
            },
        ];
        let mut failed = Vec::new();
        checks(&mut failed, &root, "cpu", &narrow).unwrap();
        assert!(failed.is_empty(), "{failed:#?}");
    }
}
