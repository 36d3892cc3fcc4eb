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

    // A model of GPT-2's 50,257 ids decodes with GPT-2's BPE, the run's; bytes (256 ids)
    // cannot be its tokenizer and are refused, naming the one that fits (issue 40: garbage
    // with exit 0).
    let run = dir.path().join("run");
    let generate = |extra: &[&str]| {
        let mut args = vec!["generate", "--checkpoint", run.to_str().unwrap()];
        args.extend(["--prompt", "ROMEO:", "--max-tokens", "4"]);
        args.extend(extra);
        meshtrain(&args)
    };
    let (ok, stdout, stderr) = generate(&[]);
    assert!(ok && stdout.starts_with("ROMEO:"), "{stdout}{stderr}");
    let (ok, stdout, stderr) = generate(&["--encoding", "bytes"]);
    assert!(
        !ok && stderr.contains("vocabulary has 50257 ids, which bytes (256 ids) cannot be")
            && stderr.contains("--encoding gpt2")
            && !stdout.contains("ROMEO:"),
        "{stdout}{stderr}"
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

/// A corpus as JSON lines (gzipped, with other fields and a malformed line) tokenizes to the
/// same shards as its documents given as text files; a binary file is refused, naming the
/// offset of its first byte that is not UTF-8.
#[test]
fn json_lines_tokenize_as_their_documents_and_binary_input_is_refused() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join("data/shakespeare/input.txt")).unwrap();
    let docs = [&text[..6_000], &text[6_000..9_000], &text[9_000..15_000]];
    let mut inputs = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        let path = dir.path().join(format!("doc{i}.txt"));
        std::fs::write(&path, doc).unwrap();
        inputs.push(path.to_str().unwrap().to_string());
    }
    let mut lines = String::new();
    for (i, doc) in docs.iter().enumerate() {
        lines += &serde_json::json!({"id": i, "text": doc}).to_string();
        lines += "\n";
        if i == 0 {
            lines += "{not json\n";
        }
    }
    let jsonl = dir.path().join("corpus.jsonl.gz");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(lines.as_bytes()).unwrap();
    std::fs::write(&jsonl, gz.finish().unwrap()).unwrap();
    let tokenize = |inputs: &[&str], out: &str, extra: &[&str]| {
        let out = dir.path().join(out);
        let mut args = vec!["tokenize", "--input"];
        args.extend(inputs);
        args.extend(["--out", out.to_str().unwrap(), "--shard-tokens", "100000"]);
        args.extend(extra);
        (meshtrain(&args), out)
    };
    let text_inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    let ((ok, stdout, stderr), from_text) = tokenize(&text_inputs, "text", &[]);
    assert!(ok && stdout.contains("3 document(s)"), "{stdout}{stderr}");
    let ((ok, _, stderr), _) = tokenize(&[jsonl.to_str().unwrap()], "bad", &[]);
    assert!(
        !ok && stderr.contains("corpus.jsonl.gz:2: not a JSON object"),
        "{stderr}"
    );
    let ((ok, stdout, stderr), from_lines) =
        tokenize(&[jsonl.to_str().unwrap()], "lines", &["--skip-bad"]);
    assert!(
        ok && stdout.contains("left out 1 malformed line"),
        "{stdout}{stderr}"
    );
    for shard in ["train_000000.bin", "val_000000.bin"] {
        let a = std::fs::read(from_text.join(shard)).unwrap();
        let b = std::fs::read(from_lines.join(shard)).unwrap();
        assert!(
            a == b,
            "{shard} differs between the text files and the JSON lines"
        );
    }
    // A damaged gzip file beside them is left out whole and named: the same shards.
    let damaged = dir.path().join("damaged.jsonl.gz");
    let whole = std::fs::read(&jsonl).unwrap();
    std::fs::write(&damaged, &whole[..whole.len() / 2]).unwrap();
    let ((ok, stdout, stderr), with_damaged) = tokenize(
        &[jsonl.to_str().unwrap(), damaged.to_str().unwrap()],
        "damaged",
        &["--skip-bad"],
    );
    assert!(
        ok && stdout.contains("left out 1 unreadable file(s) or row group(s) (--skip-bad)")
            && stdout.contains("damaged.jsonl.gz: a damaged gzip stream"),
        "{stdout}{stderr}"
    );
    for shard in ["train_000000.bin", "val_000000.bin"] {
        let a = std::fs::read(from_lines.join(shard)).unwrap();
        let b = std::fs::read(with_damaged.join(shard)).unwrap();
        assert!(a == b, "{shard} differs with the damaged file left out");
    }
    // Two documents at most.
    let ((ok, stdout, stderr), _) = tokenize(&text_inputs, "two", &["--max-documents", "2"]);
    assert!(
        ok && stdout.contains("of 2 document(s)"),
        "{stdout}{stderr}"
    );
    // 64 bytes of noise given as text.
    let noise = dir.path().join("noise.bin");
    let bytes: Vec<u8> = (0u8..64).map(|i| i.wrapping_mul(37) | 0x80).collect();
    std::fs::write(&noise, &bytes).unwrap();
    let ((ok, _, stderr), _) = tokenize(&[noise.to_str().unwrap()], "noise", &[]);
    assert!(!ok && stderr.contains("byte offset 0 is 0x80"), "{stderr}");
}

/// What a new user tripped over (issue 40): `--val-fraction 0` printed a `data.val_files`
/// setting that, pasted, failed with "no file matches"; an empty input wrote a one-token
/// shard and exited 0.
#[test]
fn no_validation_split_prints_no_validation_setting_and_an_empty_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input.txt");
    std::fs::write(&input, "A small text.\nWith two lines.\n").unwrap();
    let out = dir.path().join("out");
    let (ok, stdout, stderr) = meshtrain(&[
        "tokenize",
        "--input",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--val-fraction",
        "0",
    ]);
    assert!(ok, "{stdout}{stderr}");
    assert!(
        !stdout.contains("data.val_files") && stdout.contains("no validation shards"),
        "{stdout}"
    );
    assert!(out.join("train_000000.bin").exists() && !out.join("val_000000.bin").exists());
    // An input without text is refused with `why`, and no shard is written.
    let out2 = dir.path().join("out2");
    let refused = |name: &str, content: &str, why: &dyn Fn(&Path) -> String| {
        let empty = dir.path().join(name);
        std::fs::write(&empty, content).unwrap();
        let (ok, stdout, stderr) = meshtrain(&[
            "tokenize",
            "--input",
            empty.to_str().unwrap(),
            "--out",
            out2.to_str().unwrap(),
        ]);
        assert!(!ok && stderr.contains(&why(&empty)), "{stdout}{stderr}");
        assert!(!out2.join("train_000000.bin").exists());
    };
    refused("empty.jsonl", "\n", &|_| "no documents in".to_string());
    // A 0-byte text file is one empty document: no text, refused naming it.
    refused("empty.txt", "", &|path| {
        format!("no text in {}", path.display())
    });
}

/// Corpora written by independent writers (`scripts/corpus_reference.py`: pyarrow's Parquet,
/// zstd and snappy, row groups of 4 and 5 with a null row; Python's gzip JSON lines; Arrow's
/// zstd JSON lines in two frames; the documents as text files in a directory) tokenize to exactly the same shards, whose ids
/// are tiktoken's for the documents, each after the end-of-text token, every tenth document
/// in validation.
#[test]
fn independent_writers_corpora_give_tiktokens_ids() {
    let refs = root().join("crates/meshtrain/tests/refs/corpus");
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(refs.join("ids.json")).unwrap()).unwrap();
    let eot = want["end_of_text"].as_u64().unwrap() as u32;
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (i, doc) in want["documents"].as_array().unwrap().iter().enumerate() {
        let to = if meshtrain::tokenize::goes_to_validation(i as u64, 0.1) {
            &mut val
        } else {
            &mut train
        };
        to.push(eot);
        to.extend(
            doc.as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32),
        );
    }
    assert!(!val.is_empty());
    let dir = tempfile::tempdir().unwrap();
    let mut shards = Vec::new();
    for input in [
        "text",
        "docs.jsonl.gz",
        "docs.jsonl.zst",
        "docs.snappy.parquet",
        "docs.zstd.parquet",
    ] {
        let out = dir.path().join(input);
        let (ok, stdout, stderr) = meshtrain(&[
            "tokenize",
            "--input",
            refs.join(input).to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--skip-bad",
            "--shard-tokens",
            "1000",
        ]);
        assert!(
            ok && stdout.contains("12 document(s)"),
            "{input}: {stdout}{stderr}"
        );
        let read = |split: &str| -> Vec<u32> {
            meshtrain_data::open_shards(&format!("{}/{split}_*.bin", out.display()))
                .unwrap()
                .iter()
                .flat_map(|s| (0..s.len()).map(|i| s.token(i)).collect::<Vec<_>>())
                .collect()
        };
        assert_eq!(read("train"), train, "{input}: train");
        assert_eq!(read("val"), val, "{input}: validation");
        let bytes: Vec<Vec<u8>> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| std::fs::read(e.unwrap().path()).unwrap())
            .collect();
        shards.push(bytes.len());
    }
    assert!(
        shards.iter().all(|&n| n == shards[0] && n > 2),
        "{shards:?}"
    );
}
