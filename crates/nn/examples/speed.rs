//! Quick throughput probe: `cargo run --release -p meshtrain-nn --example speed -- lenet 2`
use meshtrain_nn::models::{gpt, lenet, resnet, GptConfig, LeNetVariant};
use meshtrain_nn::{Mode, Model};
use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let which = args.get(1).map(String::as_str).unwrap_or("lenet");
    let threads: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2);
    let pool = meshtrain_tensor::par::pool(threads);
    let mut rng = SplitMix64::new(1);
    let (model, x, y, classes): (Model, Tensor, Vec<u32>, usize) = match which {
        "lenet" => {
            let b = 256;
            let x = (0..b * 784).map(|_| rng.normal()).collect();
            (
                lenet::lenet(LeNetVariant::Sigmoid),
                Tensor::from_vec(x, &[b, 1, 28, 28]),
                (0..b).map(|i| (i % 10) as u32).collect(),
                10,
            )
        }
        "resnet" => {
            let b = 128;
            let x = (0..b * 784).map(|_| rng.normal()).collect();
            (
                resnet::resnet18(64, 10),
                Tensor::from_vec(x, &[b, 1, 28, 28]),
                (0..b).map(|i| (i % 10) as u32).collect(),
                10,
            )
        }
        _ => {
            let cfg = GptConfig::default();
            let b = 32;
            let x = (0..b * cfg.seq).map(|_| rng.below(256) as f32).collect();
            (
                gpt::gpt(&cfg),
                Tensor::from_vec(x, &[b, cfg.seq]),
                (0..b * cfg.seq).map(|_| rng.below(256) as u32).collect(),
                256,
            )
        }
    };
    let mut store = model.init(0);
    pool.install(|| {
        for it in 0..8 {
            let t0 = Instant::now();
            let (out, acts) = model.forward_all(&mut store, x.clone(), Mode::TRAIN);
            let t1 = Instant::now();
            let (loss, dl, _) = softmax_cross_entropy(out.data(), classes, &y, 1.0);
            let dl = Tensor::from_vec(dl, out.shape());
            model.backward(&mut store, acts, dl, false, &mut |_, _| {});
            let t2 = Instant::now();
            println!("{which} it {it}: loss {loss:.4} fwd {:.1} ms bwd {:.1} ms total {:.1} ms, {:.0} samples/s",
                (t1 - t0).as_secs_f64() * 1e3, (t2 - t1).as_secs_f64() * 1e3, (t2 - t0).as_secs_f64() * 1e3,
                y.len() as f64 / if which == "gpt" { 128.0 } else { 1.0 } / (t2 - t0).as_secs_f64());
            store.zero_grads();
        }
    });
}
