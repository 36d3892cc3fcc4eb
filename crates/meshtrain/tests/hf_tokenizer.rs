//! A user's own vocabulary as a Hugging Face tokenizer.json: `meshtrain tokenize --tokenizer`
//! encodes exactly as Hugging Face's `tokenizers` library does (reference ids written by
//! `scripts/hf_reference.py` for two tokenizers trained on the corpus: byte-level BPE as
//! GPT-2 / Llama 3, and SentencePiece-style BPE with byte fallback as Llama 2); the tokens
//! decode back to the text; a model trained on the shards samples and generates text with
//! `data.tokenizer`.

mod common;

use common::{meshtrain, root};
use meshtrain::tokenize::HfTokenizer;
use serde_json::Value;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    root()
        .join("crates/meshtrain/tests/refs/tokenizers")
        .join(name)
}

#[test]
fn hugging_face_tokenizers_encode_as_the_library_and_decode_back() {
    for (name, leading_space) in [("bytelevel", false), ("sentencepiece", true)] {
        let dir = fixture(name);
        let tok = HfTokenizer::open(&dir.join("tokenizer.json")).unwrap();
        let refs: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("encoded.json")).unwrap())
                .unwrap();
        let text = refs["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(refs["ids"].clone()).unwrap();
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids, want, "{name}: ids");
        assert_eq!(tok.vocab as u64, refs["vocab"].as_u64().unwrap(), "{name}");
        // Streamed token by token, the bytes are the text (a SentencePiece text starts with
        // the space its normaliser prepends; the library's decoder strips it).
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
        let expected = if leading_space {
            format!(" {text}")
        } else {
            text.to_string()
        };
        assert_eq!(String::from_utf8(bytes).unwrap(), expected, "{name}: bytes");
        assert_eq!(
            refs["decoded"].as_str().unwrap(),
            text,
            "{name}: the library's decode"
        );
    }
    let bytelevel = HfTokenizer::open(&fixture("bytelevel").join("tokenizer.json")).unwrap();
    assert_eq!(
        bytelevel.end_of_text,
        bytelevel.inner.token_to_id("<|endoftext|>")
    );
    let sp = HfTokenizer::open(&fixture("sentencepiece").join("tokenizer.json")).unwrap();
    assert_eq!(sp.end_of_text, sp.inner.token_to_id("</s>"));
    let missing = HfTokenizer::open(&fixture("none").join("tokenizer.json"));
    let err = format!("{:#}", missing.err().expect("no such file"));
    assert!(
        err.contains("cannot read tokenizer") && err.contains("none"),
        "{err}"
    );
}

#[test]
fn a_llama_trains_samples_and_generates_with_its_users_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join("data/shakespeare/input.txt")).unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, &text[..30_000]).unwrap();
    let tokenizer = fixture("sentencepiece").join("tokenizer.json");
    let shards = dir.path().join("tok");
    let (ok, stdout, stderr) = meshtrain(&[
        "tokenize",
        "--input",
        corpus.to_str().unwrap(),
        "--out",
        shards.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("model.vocab=700") && stdout.contains("data.tokenizer="),
        "{stdout}"
    );
    let set = |k: &str, v: String| ["--set".to_string(), format!("{k}={v}")];
    let out = dir.path().join("run");
    let mut args: Vec<String> = ["train", "--config", "configs/llama.toml"]
        .map(String::from)
        .to_vec();
    for (k, v) in [
        (
            "data.train_files",
            format!("\"{}/train_*.bin\"", shards.display()),
        ),
        (
            "data.val_files",
            format!("\"{}/val_*.bin\"", shards.display()),
        ),
        ("data.tokenizer", format!("\"{}\"", tokenizer.display())),
        ("train.out_dir", format!("\"{}\"", out.display())),
        ("model.vocab", "700".into()),
        ("model.dim", "32".into()),
        ("model.layers", "1".into()),
        ("model.heads", "2".into()),
        ("model.kv_heads", "1".into()),
        ("model.ffn", "48".into()),
        ("model.seq", "32".into()),
        ("train.batch_size", "4".into()),
        ("train.steps", "4".into()),
        ("train.eval_every", "4".into()),
        ("train.eval_batches", "1".into()),
        ("train.sample_tokens", "12".into()),
        ("train.threads", "2".into()),
        ("schedule.warmup_steps", "1".into()),
    ] {
        args.extend(set(k, v));
    }
    let (ok, stdout, stderr) = meshtrain(&args);
    assert!(ok, "{stderr}");
    assert!(
        stdout.lines().any(|l| l.starts_with("sample: ")),
        "no sample line: {stdout}"
    );
    let (ok, generated, stderr) = meshtrain(&[
        "generate",
        "--checkpoint",
        out.to_str().unwrap(),
        "--prompt",
        "ROMEO:",
        "--max-tokens",
        "10",
        "--temperature",
        "0",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        generated.starts_with("ROMEO:") && generated.len() > 7,
        "{generated:?}"
    );
}

/// Data written in other ids than the tokenizer the run decodes with is refused before any
/// work (shards record their tokenizer's vocabulary size; the built-in text is bytes), with
/// the command that writes it in the tokenizer's ids: GPT-2 shards under a 700-token
/// tokenizer, and the built-in bytes under it.
#[test]
fn data_in_another_tokenizers_ids_is_refused_naming_the_command_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join("data/shakespeare/input.txt")).unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, &text[..20_000]).unwrap();
    let shards = dir.path().join("gpt2");
    let (ok, _, stderr) = meshtrain(&[
        "tokenize",
        "--input",
        corpus.to_str().unwrap(),
        "--out",
        shards.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let tokenizer = fixture("sentencepiece");
    let train = |extra: &[String]| {
        let mut args: Vec<String> = ["train", "--config", "configs/llama.toml", "--set"]
            .map(String::from)
            .to_vec();
        args.push(format!(
            "data.tokenizer=\"{}\"",
            tokenizer.join("tokenizer.json").display()
        ));
        args.extend(["--set".into(), "model.vocab=50304".into()]);
        args.extend_from_slice(extra);
        meshtrain(&args)
    };
    let on_shards = [
        "--set".to_string(),
        format!("data.train_files=\"{}/train_*.bin\"", shards.display()),
    ];
    for (extra, data, ids) in [
        (&on_shards[..], "train_000000.bin", "50257 ids (gpt2's BPE)"),
        (&[][..], "the built-in Shakespeare text", "256 ids (bytes)"),
    ] {
        let (ok, _, stderr) = train(extra);
        assert!(!ok, "trained on {data}");
        assert!(
            stderr.contains("(700 ids") && stderr.contains(data) && stderr.contains(ids),
            "{stderr}"
        );
        assert!(
            stderr.contains("meshtrain tokenize --tokenizer"),
            "{stderr}"
        );
        assert!(!stderr.contains("step 1"), "{stderr}");
    }
}
