//! Training on your own text: `meshtrain tokenize` writes token shards (GPT-2 BPE, llm.c's
//! format) and `data.train_files` trains a GPT from them; a bad shard is an error naming the
//! file and the offset, before any work.

mod common;

use common::{meshtrain, root};
use std::path::Path;

fn train_on(shards: &Path, out: &Path, vocab: usize) -> (bool, String, String) {
    let train = format!("data.train_files=\"{}/train_*.bin\"", shards.display());
    let val = format!("data.val_files=\"{}/val_*.bin\"", shards.display());
    let out_dir = format!("train.out_dir=\"{}\"", out.display());
    let vocab = format!("model.vocab={vocab}");
    let mut args = vec!["train", "--config", "configs/gpt.toml", "--dp", "2"];
    for set in [
        train.as_str(),
        &val,
        &vocab,
        &out_dir,
        "model.dim=32",
        "model.layers=1",
        "model.heads=2",
        "model.seq=32",
        "train.batch_size=4",
        "train.steps=3",
        "train.eval_every=3",
        "train.eval_batches=1",
        "schedule.warmup_steps=1",
        "train.threads=2",
    ] {
        args.extend(["--set", set]);
    }
    meshtrain(&args)
}

#[test]
fn a_gpt_trains_on_its_users_text() {
    let dir = tempfile::tempdir().unwrap();
    // 40 kB of the corpus stands for the user's text.
    let text = std::fs::read_to_string(root().join("data/shakespeare/input.txt")).unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, &text[..40_000]).unwrap();
    let shards = dir.path().join("tok");
    let (ok, stdout, stderr) = meshtrain(&[
        "tokenize",
        "--input",
        corpus.to_str().unwrap(),
        "--out",
        shards.to_str().unwrap(),
        "--shard-tokens",
        "5000",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("MB/s") && stdout.contains("gpt2 BPE"),
        "{stdout}"
    );
    assert!(shards.join("train_000001.bin").exists(), "{stdout}");
    assert!(shards.join("val_000000.bin").exists(), "{stdout}");

    let (ok, stdout, stderr) = train_on(&shards, &dir.path().join("run"), 50257);
    assert!(ok, "{stderr}");
    assert!(
        stdout.lines().next().unwrap().contains("token files"),
        "{stdout}"
    );
    assert!(
        stdout.contains("val loss") && stdout.contains("unigram baseline"),
        "{stdout}"
    );

    // GPT-2's ids do not fit a vocabulary of 1000: the file and the offset are named.
    let (ok, _, stderr) = train_on(&shards, &dir.path().join("run2"), 1000);
    assert!(!ok);
    assert!(
        stderr.contains("train_000000.bin: token id") && stderr.contains("(byte offset 10"),
        "{stderr}"
    );
    assert!(
        stderr.contains("is outside the vocabulary of 1000"),
        "{stderr}"
    );
    // A truncated shard.
    let bytes = std::fs::read(shards.join("val_000000.bin")).unwrap();
    std::fs::write(shards.join("val_000000.bin"), &bytes[..bytes.len() - 3]).unwrap();
    let (ok, _, stderr) = train_on(&shards, &dir.path().join("run3"), 50257);
    assert!(!ok);
    assert!(
        stderr.contains("val_000000.bin: the header says") && stderr.contains("(truncated)"),
        "{stderr}"
    );
}
