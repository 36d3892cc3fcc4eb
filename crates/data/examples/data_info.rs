//! Resolves and loads every dataset, printing source, sizes, class counts,
//! the GPT unigram baseline and load times. Doubles as the load benchmark:
//!
//!     cargo run --release -p meshtrain-data --example data_info [DATA_DIR]
//!
//! `MESHTRAIN_OFFLINE=1` disables the download step.

use std::path::PathBuf;
use std::time::Instant;

use meshtrain_data::{
    unigram_entropy_nats, EpochShuffler, FashionMnist, Normalization, ResolveOptions,
    TextBatchSampler, TextCorpus,
};

fn main() {
    tracing_subscriber::fmt().with_target(false).init();
    if let Err(error) = run() {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let data_dir = std::env::args().nth(1).map(PathBuf::from);
    let options = ResolveOptions::from_env(data_dir);

    let start = Instant::now();
    let fashion = FashionMnist::load(&options, Normalization::FASHION_MNIST)?;
    let load_s = start.elapsed().as_secs_f64();
    println!("Fashion-MNIST source: {}", fashion.source);
    println!(
        "  train {} (per class {:?}), test {} (per class {:?}); loaded+verified in {load_s:.3} s",
        fashion.train.n,
        fashion.train.class_counts(),
        fashion.test.n,
        fashion.test.class_counts()
    );

    // One epoch of batch gathers into reused buffers.
    let batch_size = 256;
    let mut x = vec![0f32; batch_size * fashion.train.sample_len()];
    let mut y = vec![0u32; batch_size];
    let start = Instant::now();
    let batches = EpochShuffler::new(fashion.train.n, 0).batches(0, batch_size, true)?;
    for indices in batches.iter() {
        fashion.train.batch(indices, &mut x, &mut y)?;
    }
    let epoch_s = start.elapsed().as_secs_f64();
    println!(
        "  shuffle + gather of {} batches of {batch_size}: {:.1} ms ({:.2} us/batch)",
        batches.len(),
        epoch_s * 1e3,
        epoch_s * 1e6 / batches.len() as f64
    );

    let start = Instant::now();
    let corpus = TextCorpus::shakespeare()?;
    println!(
        "Shakespeare: train {} B, val {} B, val unigram entropy {:.4} nats/char; loaded+verified in {:.3} s",
        corpus.train.len(),
        corpus.val.len(),
        unigram_entropy_nats(&corpus.val),
        start.elapsed().as_secs_f64()
    );
    let (b, t) = (32, 128);
    let mut sampler = TextBatchSampler::new(b, t, 0)?;
    let (mut inputs, mut targets) = (vec![0u32; b * t], vec![0u32; b * t]);
    let start = Instant::now();
    for _ in 0..1000 {
        sampler.sample(&corpus.train, &mut inputs, &mut targets)?;
    }
    println!(
        "  1000 text batches of {b}x{t}: {:.2} us/batch",
        start.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
