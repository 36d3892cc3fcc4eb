//! The tokenizer files beside an exported model (`export --format hf`), so that
//! `AutoTokenizer.from_pretrained(dir)` and a `transformers` text-generation pipeline work on
//! the directory as it is: `tokenizer.json`, `tokenizer_config.json` and
//! `generation_config.json`.
//!
//! A model trained on GPT-2's or cl100k's BPE gets a `tokenizer.json` built from tiktoken-rs's
//! own vocabulary (no download): Hugging Face's byte-level BPE with the vocabulary written in
//! GPT-2's byte-to-character alphabet and the merges recovered from the ranks (each token
//! of two or more bytes is the merge of the two parts that byte-pair encoding with the lower
//! ranks leaves of it). `ignore_merges` mirrors tiktoken, which takes a pre-token that is
//! itself in the vocabulary whole. cl100k's pre-tokenising regex goes into a `Split` before
//! the byte-level step (GPT-2's is the byte-level step's own). The ids equal tiktoken-rs's
//! (tested through the `tokenizers` crate, the library `transformers` loads them with). A
//! byte model gets a 256-token byte-level vocabulary without merges; a user's own
//! `tokenizer.json` is copied with the `tokenizer_config.json` beside it (its special tokens
//! and chat template), if there is one.

use crate::generate::Tokenizer;
use crate::tokenize::{byte_level_char, Encoding};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

/// cl100k's pre-tokenising regex (tiktoken's), as Hugging Face's `Split` takes it.
const CL100K_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `bytes` in GPT-2's byte-to-character alphabet (what a byte-level vocabulary holds).
fn byte_level(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_level_char(b)).collect()
}

/// The merges of a rank-ordered byte-level vocabulary (`tokens[id]` = its bytes, the id its
/// rank): for each token of two or more bytes, in rank order, the two tokens byte-pair
/// encoding with only the lower ranks leaves of its bytes.
pub fn merges_of(tokens: &[Vec<u8>]) -> Result<Vec<(u32, u32)>> {
    let rank: HashMap<&[u8], u32> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.as_slice(), id as u32))
        .collect();
    let mut merges = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        if token.len() < 2 {
            continue;
        }
        // Byte-pair encoding of the token's bytes with the ranks below its own: merge the
        // lowest-ranked adjacent pair until none is left. The parts are where each starts.
        let mut starts: Vec<usize> = (0..token.len()).collect();
        let end = |starts: &[usize], i: usize| starts.get(i).copied().unwrap_or(token.len());
        loop {
            let best = (0..starts.len() - 1)
                .filter_map(|i| {
                    let joined = &token[starts[i]..end(&starts, i + 2)];
                    rank.get(joined)
                        .filter(|&&r| r < id as u32)
                        .map(|&r| (r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            starts.remove(i + 1);
        }
        match starts.as_slice() {
            &[left, right] => merges.push((rank[&token[left..right]], rank[&token[right..]])),
            _ => bail!(
                "token {id} of the vocabulary is not the merge of two lower-ranked tokens ({} \
                 parts): not a byte-pair vocabulary",
                starts.len()
            ),
        }
    }
    Ok(merges)
}

/// A byte-level BPE `tokenizer.json`: `tokens[id]` the ordinary tokens' bytes (ids = ranks),
/// `special` the special tokens, `split` a pre-tokenising regex to apply before the
/// byte-level step (`None`: the byte-level step's own, GPT-2's).
pub fn byte_level_json(
    tokens: &[Vec<u8>],
    special: &[(u32, &str)],
    split: Option<&str>,
) -> Result<Value> {
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (byte_level(t), json!(id)))
        .collect();
    let merges: Vec<Value> = merges_of(tokens)?
        .into_iter()
        .map(|(l, r)| {
            json!([
                byte_level(&tokens[l as usize]),
                byte_level(&tokens[r as usize])
            ])
        })
        .collect();
    let byte_level_step = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let pre_tokenizer = match split {
        None => byte_level_step(true),
        Some(pattern) => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                byte_level_step(false),
            ],
        }),
    };
    let added: Vec<Value> = special
        .iter()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": true,
            "vocab": vocab,
            "merges": merges,
        },
    }))
}

/// The ordinary tokens' bytes of a tiktoken BPE, by id.
fn bpe_tokens(enc: &Encoding) -> Vec<Vec<u8>> {
    (0..enc.ordinary as u32)
        .map(|id| {
            enc.bpe
                ._decode_native_and_split(vec![id])
                .next()
                .unwrap_or_default()
        })
        .collect()
}

/// The special tokens of a tiktoken BPE by id, every id from its last ordinary token to its
/// vocabulary's end: `tokenizers` numbers added tokens consecutively after the vocabulary,
/// so cl100k's unused ids (100256, 100261–100275) are held by reserved tokens.
fn bpe_specials(enc: &Encoding) -> Vec<(u32, String)> {
    let named: &[(u32, &str)] = if enc.vocab > 60_000 {
        &[
            (100_257, "<|endoftext|>"),
            (100_258, "<|fim_prefix|>"),
            (100_259, "<|fim_middle|>"),
            (100_260, "<|fim_suffix|>"),
            (100_276, "<|endofprompt|>"),
        ]
    } else {
        &[(50_256, "<|endoftext|>")]
    };
    (enc.ordinary as u32..enc.vocab as u32)
        .map(|id| match named.iter().find(|(n, _)| *n == id) {
            Some((_, text)) => (id, text.to_string()),
            None => (id, format!("<|reserved_{id}|>")),
        })
        .collect()
}

/// The `tokenizer.json` of a tiktoken BPE (GPT-2's r50k or cl100k).
pub fn bpe_json(enc: &Encoding) -> Result<Value> {
    let split = (enc.vocab > 60_000).then_some(CL100K_PATTERN);
    let specials = bpe_specials(enc);
    let specials: Vec<(u32, &str)> = specials.iter().map(|(i, t)| (*i, t.as_str())).collect();
    byte_level_json(&bpe_tokens(enc), &specials, split)
}

/// What the three files say about the special tokens: the end-of-text token's id and text.
struct EndOfText {
    id: Option<u32>,
    text: Option<String>,
}

/// Writes the tokenizer files of a model trained with `tokenizer` (from `source`, a user's
/// tokenizer.json, when it is one) into `dir`, for a model of `seq` positions; sets
/// config.json's end-of-text ids to the tokenizer's. Returns the files written.
pub fn write(
    dir: &Path,
    tokenizer: &Tokenizer,
    source: Option<&Path>,
    seq: usize,
) -> Result<Vec<String>> {
    let mut written = vec!["tokenizer.json".to_string()];
    let eot = match tokenizer {
        Tokenizer::Bytes => {
            let bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
            write_json(dir, "tokenizer.json", &byte_level_json(&bytes, &[], None)?)?;
            EndOfText {
                id: None,
                text: None,
            }
        }
        Tokenizer::Bpe(enc) => {
            write_json(dir, "tokenizer.json", &bpe_json(enc)?)?;
            EndOfText {
                id: Some(enc.end_of_text),
                text: Some("<|endoftext|>".into()),
            }
        }
        Tokenizer::Hf(hf) => {
            let source = source.context("a user's tokenizer without its file")?;
            std::fs::copy(source, dir.join("tokenizer.json"))
                .with_context(|| format!("copying {} into {}", source.display(), dir.display()))?;
            EndOfText {
                id: hf.end_of_text,
                text: hf.end_of_text.and_then(|id| hf.inner.id_to_token(id)),
            }
        }
    };
    // A user's tokenizer_config.json (special tokens, chat template) travels as it is.
    let beside = source
        .and_then(Path::parent)
        .map(|d| d.join("tokenizer_config.json"))
        .filter(|p| p.is_file());
    match beside {
        Some(config) => {
            std::fs::copy(&config, dir.join("tokenizer_config.json"))
                .with_context(|| format!("copying {}", config.display()))?;
        }
        None => write_json(
            dir,
            "tokenizer_config.json",
            &json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": seq,
                "bos_token": eot.text,
                "eos_token": eot.text,
                "unk_token": null,
                "add_bos_token": false,
                "add_prefix_space": false,
                "clean_up_tokenization_spaces": false,
            }),
        )?,
    }
    written.push("tokenizer_config.json".into());
    write_json(
        dir,
        "generation_config.json",
        &json!({
            "bos_token_id": eot.id,
            "eos_token_id": eot.id,
            "max_length": seq,
            "do_sample": false,
        }),
    )?;
    written.push("generation_config.json".into());
    // config.json's ids are the tokenizer's (GPT-2's 50256 would be wrong for cl100k).
    let config_path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(&config_path)
            .with_context(|| format!("reading {}", config_path.display()))?,
    )?;
    config["bos_token_id"] = json!(eot.id);
    config["eos_token_id"] = json!(eot.id);
    write_json(dir, "config.json", &config)?;
    Ok(written)
}

fn write_json(dir: &Path, name: &str, value: &Value) -> Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(value)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenize::encoding;

    fn text() -> String {
        let corpus = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare/input.txt"),
        )
        .unwrap();
        corpus[..30_000].to_string()
            + "\nÜnïcödé — «quotes», 中文, emoji 🎭, tabs\t\tand   spaces,\r\nnumbers 1234567 3.14159\n"
    }

    /// A user's tokenizer.json travels with the model as it is, and so does the
    /// tokenizer_config.json beside it (its special tokens and chat template); the model's
    /// end-of-text ids become the tokenizer's.
    #[test]
    fn a_users_tokenizer_and_its_chat_template_travel_with_the_model() {
        let (source, out) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let tokenizer = source.path().join("tokenizer.json");
        let json = byte_level_json(&bytes, &[(256, "<|endoftext|>")], None).unwrap();
        std::fs::write(&tokenizer, serde_json::to_string(&json).unwrap()).unwrap();
        let config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|endoftext|>",
            "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}",
        });
        let config_text = serde_json::to_string_pretty(&config).unwrap();
        std::fs::write(source.path().join("tokenizer_config.json"), &config_text).unwrap();
        std::fs::write(
            out.path().join("config.json"),
            "{\"model_type\": \"llama\"}",
        )
        .unwrap();
        let hf = crate::tokenize::HfTokenizer::open(&tokenizer).unwrap();
        assert_eq!(hf.end_of_text, Some(256));
        let written = write(
            out.path(),
            &Tokenizer::Hf(Box::new(hf)),
            Some(&tokenizer),
            64,
        )
        .unwrap();
        assert_eq!(
            written,
            [
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json"
            ]
        );
        let read = |name: &str| std::fs::read_to_string(out.path().join(name)).unwrap();
        assert_eq!(
            read("tokenizer.json"),
            std::fs::read_to_string(&tokenizer).unwrap()
        );
        assert_eq!(
            read("tokenizer_config.json"),
            config_text,
            "the chat template travels"
        );
        let generation: Value = serde_json::from_str(&read("generation_config.json")).unwrap();
        let model: Value = serde_json::from_str(&read("config.json")).unwrap();
        for (name, value) in [
            ("generation_config.json", &generation),
            ("config.json", &model),
        ] {
            assert_eq!(value["eos_token_id"], json!(256), "{name}");
            assert_eq!(value["bos_token_id"], json!(256), "{name}");
        }
        assert_eq!(
            model["model_type"],
            json!("llama"),
            "config.json keeps its own fields"
        );
    }

    /// The tokenizer.json built from tiktoken-rs's vocabulary encodes as tiktoken-rs does
    /// and decodes back, through the `tokenizers` library `transformers` uses: GPT-2's BPE
    /// and cl100k.
    #[test]
    fn the_exported_bpe_encodes_as_tiktoken() {
        let text = text();
        for name in ["gpt2", "cl100k"] {
            let enc = encoding(name).unwrap();
            let json = bpe_json(&enc).unwrap().to_string();
            let hf: tokenizers::Tokenizer = json.parse().unwrap();
            let ids = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
            assert_eq!(ids, enc.bpe.encode_ordinary(&text), "{name}");
            assert_eq!(hf.decode(&ids, false).unwrap(), text, "{name}");
            let eot = hf
                .encode("a<|endoftext|>b", false)
                .unwrap()
                .get_ids()
                .to_vec();
            assert!(eot.contains(&enc.end_of_text), "{name}: {eot:?}");
            assert_eq!(hf.get_vocab_size(true), enc.vocab, "{name}");
            assert_eq!(
                hf.token_to_id("<|endoftext|>"),
                Some(enc.end_of_text),
                "{name}"
            );
        }
    }

    /// A byte model's tokenizer.json: every byte its own id.
    #[test]
    fn a_byte_vocabulary_is_the_bytes() {
        let bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let hf: tokenizers::Tokenizer = byte_level_json(&bytes, &[], None)
            .unwrap()
            .to_string()
            .parse()
            .unwrap();
        let text = text();
        let ids = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        let want: Vec<u32> = text.bytes().map(u32::from).collect();
        assert_eq!(ids, want);
        assert_eq!(hf.decode(&ids, false).unwrap(), text);
    }

    #[test]
    fn merges_are_recovered_from_ranks() {
        // a, b, c, then "ab" (rank 3), "abc" (4: ab + c), "bc" (5), "abcbc" (6: abc + bc).
        let tokens: Vec<Vec<u8>> = ["a", "b", "c", "ab", "abc", "bc", "abcbc"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        assert_eq!(
            merges_of(&tokens).unwrap(),
            vec![(0, 1), (3, 2), (1, 2), (4, 5)]
        );
        let broken: Vec<Vec<u8>> = ["a", "b", "abc"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        assert!(merges_of(&broken).is_err());
    }
}
