//! Memory-efficient (flash) attention against the probability-keeping kernel, forward +
//! backward, f32, GPT-like width 256 with 4 heads, the best of 5 interleaved rounds:
//! `cargo run --release -p meshtrain-tensor --example flash_timing`. A first look for issue 18
//! (the flash kernel is not used by the GPT layer yet); `meshtrain bench` should take it over.

use meshtrain_tensor::attention::{
    causal_attention_backward, causal_attention_forward, AttentionShape,
};
use meshtrain_tensor::flash::{flash_attention_backward, flash_attention_forward};
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::DType;
use std::time::Instant;

fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    (0..n).map(|_| r.normal()).collect()
}

fn main() {
    let (dim, heads) = (256, 4);
    for &(seq, batch) in &[(128usize, 16usize), (512, 4), (2048, 1)] {
        let s = AttentionShape {
            batch,
            seq,
            dim,
            heads,
        };
        let qkv = normal(batch * seq * 3 * dim, 1);
        let dout = normal(batch * seq * dim, 2);
        let mut best = [f64::MAX; 2];
        for _ in 0..5 {
            let t = Instant::now();
            let (o, p) = causal_attention_forward(s, &qkv, DType::F32);
            let d = causal_attention_backward(s, &qkv, &p, &dout, DType::F32);
            std::hint::black_box((o, d));
            best[0] = best[0].min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let (o, l) = flash_attention_forward(s, &qkv, DType::F32);
            let d = flash_attention_backward(s, &qkv, &o, &l, &dout, DType::F32);
            std::hint::black_box(d);
            best[1] = best[1].min(t.elapsed().as_secs_f64());
        }
        println!(
            "seq {seq} batch {batch}: probabilities kept {:.1} ms, flash {:.1} ms ({:.2}x); \
             kept for backward: {} MiB of probabilities vs {} KiB of log-sum-exps",
            best[0] * 1e3,
            best[1] * 1e3,
            best[0] / best[1],
            batch * heads * seq * seq * 4 / (1 << 20),
            batch * heads * seq * 4 / 1024
        );
    }
}
