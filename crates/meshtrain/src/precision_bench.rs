//! `meshtrain bench precision`: what mixed precision buys on this CPU. Matrix products in f32
//! against bf16 (every bf16 kernel the CPU has) on large and GPT-shaped products, then whole
//! training steps of the built-in models per precision. Variants run interleaved, round by
//! round, and the medians are compared, because this shared machine drifts by ±25% within
//! minutes.

use crate::bench::{bench_model, StepBudget};
use anyhow::Result;
use meshtrain_tensor::lowp::{gemm_bf16_with, Bf16Kernel};
use meshtrain_tensor::matmul::{gemm, Mat, MatMut};
use meshtrain_tensor::DType;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchPrecisionArgs {
    /// Intra-op threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Interleaved rounds per product shape (0: skip the products).
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// Comma-separated models for whole training steps (lenet, resnet18, gpt); empty: none.
    #[arg(long, default_value = "lenet,resnet18,gpt")]
    pub models: String,
    /// Precisions compared on the models (the first is the baseline of the ratios).
    #[arg(long, default_value = "fp32,bf16,fp16")]
    pub precisions: String,
    /// Timed steps per model, precision and round.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Interleaved rounds per model.
    #[arg(long, default_value_t = 3)]
    pub model_rounds: usize,
}

/// One product shape: `m × k` times `k × n`, either operand stored transposed.
struct Shape {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    a_transposed: bool,
    b_transposed: bool,
}

const fn shape(
    name: &'static str,
    (m, n, k): (usize, usize, usize),
    (a_t, b_t): (bool, bool),
) -> Shape {
    Shape {
        name,
        m,
        n,
        k,
        a_transposed: a_t,
        b_transposed: b_t,
    }
}

/// Square products and the GPT benchmark model's three products of fc1 (4,096 tokens of
/// width 256, MLP width 1,024): forward `x·Wᵀ`, input gradient `dz·W`, weight gradient `dzᵀ·x`.
const SHAPES: &[Shape] = &[
    shape("square 1024", (1024, 1024, 1024), (false, false)),
    shape("square 2048", (2048, 2048, 2048), (false, false)),
    shape("gpt fc1 x·Wᵀ", (4096, 1024, 256), (false, true)),
    shape("gpt fc1 dz·W", (4096, 256, 1024), (false, false)),
    shape("gpt fc1 dzᵀ·x", (1024, 256, 4096), (true, false)),
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median GFLOP/s of each variant (f32, then each bf16 kernel) for one shape.
fn product_rates(shape: &Shape, kernels: &[Bf16Kernel], rounds: usize) -> Vec<f64> {
    let (m, n, k) = (shape.m, shape.n, shape.k);
    let a: Vec<f32> = (0..m * k)
        .map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6)
        .collect();
    let b: Vec<f32> = (0..k * n)
        .map(|i| ((i * 5) % 11) as f32 * 0.1 - 0.5)
        .collect();
    let mut c = vec![0.0f32; m * n];
    let a_view = || match shape.a_transposed {
        true => Mat::new(&a, k, m).t(),
        false => Mat::new(&a, m, k),
    };
    let b_view = || match shape.b_transposed {
        true => Mat::new(&b, n, k).t(),
        false => Mat::new(&b, k, n),
    };
    let mut samples = vec![Vec::new(); kernels.len() + 1];
    let flops = 2.0 * (m * n * k) as f64;
    for round in 0..=rounds {
        for (v, times) in samples.iter_mut().enumerate() {
            let out = MatMut::new(&mut c, m, n);
            let t = Instant::now();
            match v {
                0 => gemm(out, a_view(), b_view(), false),
                _ => gemm_bf16_with(
                    kernels[v - 1],
                    out,
                    a_view(),
                    b_view(),
                    false,
                    meshtrain_tensor::par::threads(),
                ),
            }
            // Round 0 warms caches and thread pools up.
            if round > 0 {
                times.push(flops / t.elapsed().as_secs_f64() / 1e9);
            }
        }
    }
    samples.into_iter().map(median).collect()
}

pub fn run(args: &BenchPrecisionArgs) -> Result<()> {
    let kernels = Bf16Kernel::available();
    println!(
        "bf16 kernels on this CPU: {} (products use {})",
        kernels
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", "),
        meshtrain_tensor::lowp::bf16_kernel().name()
    );
    let pool = meshtrain_tensor::par::pool(args.threads);
    print!("{:<16} {:>9}", "product", "f32");
    for k in kernels {
        print!(" {:>12} {:>6}", k.name(), "ratio");
    }
    println!("   (GFLOP/s, median of {} interleaved rounds)", args.rounds);
    for shape in SHAPES.iter().filter(|_| args.rounds > 0) {
        let rates = pool.install(|| product_rates(shape, kernels, args.rounds));
        print!("{:<16} {:>9.1}", shape.name, rates[0]);
        for r in &rates[1..] {
            print!(" {:>12.1} {:>5.2}x", r, r / rates[0]);
        }
        println!();
    }
    let precisions: Vec<DType> = args
        .precisions
        .split(',')
        .map(|p| {
            DType::parse(p.trim())
                .ok_or_else(|| anyhow::anyhow!("unknown precision '{p}' (fp32, bf16, fp16)"))
        })
        .collect::<Result<_>>()?;
    let models: Vec<&str> = args
        .models
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if models.is_empty() || precisions.is_empty() {
        return Ok(());
    }
    println!(
        "\n{:<9} {:>6} {:>10} {:>8} {:>8} {:>10} {:>8} {:>9} {:>7}   (median of {} interleaved rounds of {} steps)",
        "model",
        "prec",
        "step ms",
        "fwd ms",
        "bwd ms",
        "samples/s",
        "vs first",
        "act MiB",
        "vs first",
        args.model_rounds,
        args.steps
    );
    for model in models {
        let mut steps = vec![Vec::new(); precisions.len()];
        let mut last = Vec::new();
        for _ in 0..args.model_rounds.max(1) {
            last.clear();
            for (i, &p) in precisions.iter().enumerate() {
                let r = bench_model(model, args.threads, StepBudget::Steps(args.steps), p)?;
                steps[i].push(r.step_ms_median);
                last.push(r);
            }
        }
        let base = median(steps[0].clone());
        for (i, r) in last.iter().enumerate() {
            let step = median(steps[i].clone());
            println!(
                "{:<9} {:>6} {:>10.1} {:>8.1} {:>8.1} {:>10.1} {:>7.2}x {:>9.1} {:>6.2}x",
                model,
                precisions[i].to_string(),
                step,
                r.forward_ms,
                r.backward_ms,
                r.batch as f64 / step * 1e3,
                base / step,
                r.activation_mb,
                r.activation_mb / last[0].activation_mb
            );
        }
    }
    Ok(())
}
