//! `meshtrain tokenize`: documents to token shards (llm.c's format, see
//! `meshtrain_data::shards`) with GPT-2's or cl100k's BPE, so a model trains on a user's own
//! text without a line of Rust: `data.train_files = "OUT/train_*.bin"`. The documents come
//! from text files, JSON lines (gzipped or not) or Parquet ([`crate::corpus`]).
//!
//! The BPE is tiktoken-rs's, whose vocabularies ship inside the crate (no download). Text is
//! cut into pieces after lone newlines between printable characters — where the BPE's
//! pre-tokenising regex splits alike in a piece and in the whole — and the pieces are encoded
//! in parallel, so the tokens are exactly those of encoding the whole file at once (tested).
//!
//! A user's own vocabulary comes as a Hugging Face `tokenizer.json` (`--tokenizer FILE`, read
//! by the `tokenizers` crate: byte-level BPE as GPT-2 and Llama 3, or SentencePiece-style BPE
//! with byte fallback as Llama 2). Each file is encoded whole: a SentencePiece normaliser
//! marks the start of its input, so pieces would not encode as the whole.

use anyhow::{bail, ensure, Context, Result};
use meshtrain_data::write_shard;
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::Instant;
use tiktoken_rs::CoreBPE;

#[derive(clap::Args, Debug)]
pub struct TokenizeArgs {
    /// Files of documents: UTF-8 text (the file is one document), JSON lines (one document
    /// per line, see --text-field), either possibly gzip-compressed, or Parquet (one document
    /// per row, the --text-field column); the format is taken from the content and the
    /// extension (`meshtrain::corpus`). Each document is
    /// preceded by the end-of-text token, as in GPT-2's training data.
    #[arg(long = "input", required = true, num_args = 1..)]
    pub inputs: Vec<PathBuf>,
    /// The field of a JSON line (or the column of a Parquet file) that holds its document's
    /// text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Leave out malformed JSON lines (counted and reported) instead of stopping at the
    /// first, which is named by file and line.
    #[arg(long)]
    pub skip_bad: bool,
    /// Stop after this many documents (a trial run on the start of a corpus).
    #[arg(long)]
    pub max_documents: Option<usize>,
    /// The directory for the shards: train_000000.bin, …, val_000000.bin, ….
    #[arg(long)]
    pub out: PathBuf,
    /// gpt2 (50,257 tokens, llm.c's u16 shards) or cl100k (100,277, u32 shards).
    #[arg(long, default_value = "gpt2", value_parser = ["gpt2", "cl100k"])]
    pub encoding: String,
    /// A Hugging Face tokenizer.json to encode with instead (your model's own vocabulary);
    /// train with data.tokenizer set to it, so that samples and generate decode with it.
    #[arg(long, conflicts_with = "encoding")]
    pub tokenizer: Option<PathBuf>,
    /// The share of the tokens, taken from the end, that goes to validation shards.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Tokens per shard (llm.c writes 100 M).
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: usize,
}

/// A BPE and what it calls its end-of-text token and vocabulary size.
pub struct Encoding {
    pub bpe: CoreBPE,
    pub end_of_text: u32,
    /// Its ordinary (non-special) tokens are `0..ordinary`.
    pub ordinary: usize,
    /// Every id it has, special ones included: what the shards record.
    pub vocab: usize,
}

/// The encodings `tokenize` writes and `generate` reads: (name, vocabulary size, ordinary
/// tokens).
const ENCODINGS: [(&str, usize, usize); 2] =
    [("gpt2", 50_257, 50_256), ("cl100k", 100_277, 100_256)];

/// The encoding called `name` (gpt2 or cl100k).
pub fn encoding(name: &str) -> Result<Encoding> {
    let Some(&(_, vocab, ordinary)) = ENCODINGS.iter().find(|(n, ..)| *n == name) else {
        bail!("unknown encoding {name} (gpt2 or cl100k)");
    };
    let bpe = match name {
        "gpt2" => tiktoken_rs::r50k_base()?,
        _ => tiktoken_rs::cl100k_base()?,
    };
    let end_of_text = bpe.encode_with_special_tokens("<|endoftext|>");
    ensure!(
        end_of_text.len() == 1,
        "{name} has no single end-of-text token"
    );
    Ok(Encoding {
        end_of_text: end_of_text[0],
        bpe,
        ordinary,
        vocab,
    })
}

/// The name of the encoding whose vocabulary has `vocab` ids (what a shard records).
pub fn encoding_of_vocab(vocab: usize) -> Option<&'static str> {
    ENCODINGS
        .iter()
        .find(|(_, v, _)| *v == vocab)
        .map(|(n, ..)| *n)
}

/// A Hugging Face `tokenizer.json`, read with the `tokenizers` crate.
pub struct HfTokenizer {
    pub inner: tokenizers::Tokenizer,
    /// The token that separates documents, if the vocabulary has one of the usual names.
    pub end_of_text: Option<u32>,
    /// Every id, added tokens included: what the shards record.
    pub vocab: usize,
    /// The special (control) tokens: never drawn but the end of text, never printed. Byte
    /// fallback tokens (`<0xNN>`) are text, even where a vocabulary marks them special.
    pub special: Vec<u32>,
    /// For a `ByteLevel` decoder, whose tokens are strings of GPT-2's byte-to-character
    /// alphabet, the byte each character stands for; `None`: tokens are text with `▁` for
    /// spaces and `<0xNN>` byte-fallback tokens.
    byte_level: Option<std::collections::HashMap<char, u8>>,
}

/// Names of the end-of-text token in the common vocabularies (GPT-2, Llama 2, Llama 3, Gemma).
const END_OF_TEXT_NAMES: [&str; 5] = [
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "<|im_end|>",
];

impl HfTokenizer {
    pub fn open(path: &std::path::Path) -> Result<HfTokenizer> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow::anyhow!("cannot read tokenizer {}: {e}", path.display()))?;
        let decoder = inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .unwrap_or_default();
        let end_of_text = END_OF_TEXT_NAMES.iter().find_map(|n| inner.token_to_id(n));
        let mut special: Vec<u32> = (inner.get_added_tokens_decoder().iter())
            .filter(|(_, t)| t.special && byte_token(&t.content).is_none())
            .map(|(&id, _)| id)
            .collect();
        special.sort_unstable();
        Ok(HfTokenizer {
            vocab: inner.get_vocab_size(true),
            special,
            byte_level: decoder
                .contains("\"ByteLevel\"")
                .then(|| (0..=255).map(|b| (byte_level_char(b), b)).collect()),
            end_of_text,
            inner,
        })
    }

    /// The tokens of `text`, without the special tokens a template would add.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The bytes `id` stands for in running text, so that a stream of tokens prints as the
    /// text it encodes (a character's bytes may come in several tokens).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        if let Some(byte) = byte_token(&piece) {
            return vec![byte];
        }
        if let Some(bytes) = &self.byte_level {
            return piece
                .chars()
                .filter_map(|c| bytes.get(&c).copied())
                .collect();
        }
        piece.replace('\u{2581}', " ").into_bytes()
    }
}

/// A SentencePiece byte-fallback token, `<0xNN>`.
fn byte_token(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// The character GPT-2's byte-level alphabet writes byte `b` as (`bytes_to_unicode`):
/// printable Latin-1 bytes stand for themselves, the others are 256 + k in byte order.
fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let earlier = (0..b).filter(|&e| !printable(e)).count() as u32;
    char::from_u32(256 + earlier).expect("a valid code point")
}

/// Pieces of `text` of about `target` bytes, cut after a lone newline between two printable
/// characters, where both BPEs' pre-tokenisers split the same way in a piece and in the
/// whole text (the newline is one pre-token, or ends one, and never joins what follows).
pub fn pieces(text: &str, target: usize) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    while start < bytes.len() {
        let mut cut = (start + target).min(bytes.len());
        while cut < bytes.len() {
            // A lone newline between printable characters: a longer run of white space
            // before the cut would be one pre-token at a piece's end but two inside the text.
            if cut >= start + 2
                && bytes[cut - 1] == b'\n'
                && bytes[cut - 2].is_ascii_graphic()
                && bytes[cut].is_ascii_graphic()
            {
                break;
            }
            cut += 1;
        }
        out.push(&text[start..cut]);
        start = cut;
    }
    out
}

/// Text to tokens, with the encoder a run chose.
type TextEncoder = Box<dyn Fn(&str) -> Result<Vec<u32>>>;

/// `text` as tokens, encoded in parallel pieces.
fn encode(enc: &Encoding, text: &str) -> Vec<u32> {
    let parts: Vec<Vec<u32>> = pieces(text, 1 << 20)
        .par_iter()
        .map(|p| enc.bpe.encode_ordinary(p))
        .collect();
    parts.concat()
}

pub fn run(args: &TokenizeArgs) -> Result<()> {
    ensure!(
        (0.0..1.0).contains(&args.val_fraction),
        "--val-fraction must be in [0, 1), got {}",
        args.val_fraction
    );
    ensure!(args.shard_tokens > 0, "--shard-tokens must be at least 1");
    let (name, vocab, separator, encode_text): (String, usize, Option<u32>, TextEncoder) =
        match &args.tokenizer {
            Some(path) => {
                let hf = HfTokenizer::open(path)?;
                let name = format!("tokenizer {}", path.display());
                (
                    name,
                    hf.vocab,
                    hf.end_of_text,
                    Box::new(move |t| hf.encode(t)),
                )
            }
            None => {
                let enc = encoding(&args.encoding)?;
                let name = format!("{} BPE", args.encoding);
                let (vocab, eot) = (enc.vocab, enc.end_of_text);
                (
                    name,
                    vocab,
                    Some(eot),
                    Box::new(move |t| Ok(encode(&enc, t))),
                )
            }
        };
    let started = Instant::now();
    let mut tokens = Vec::new();
    let (mut bytes, mut documents, mut skipped) = (0usize, 0usize, 0usize);
    let limit = args.max_documents.unwrap_or(usize::MAX);
    for path in &args.inputs {
        if documents == limit {
            break;
        }
        skipped +=
            crate::corpus::for_each_document(path, &args.text_field, args.skip_bad, |text| {
                documents += 1;
                bytes += text.len();
                tokens.extend(separator);
                tokens.extend(
                    encode_text(&text).with_context(|| format!("encoding {}", path.display()))?,
                );
                Ok(documents < limit)
            })?;
    }
    if skipped > 0 {
        println!("left out {skipped} malformed line(s) (--skip-bad)");
    }
    let seconds = started.elapsed().as_secs_f64();
    let val = (tokens.len() as f64 * args.val_fraction) as usize;
    let (train, validation) = tokens.split_at(tokens.len() - val);
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut written = Vec::new();
    for (split, part) in [("train", train), ("val", validation)] {
        for (k, shard) in part.chunks(args.shard_tokens).enumerate() {
            let path = args.out.join(format!("{split}_{k:06}.bin"));
            write_shard(&path, shard, vocab)?;
            written.push(path);
        }
    }
    println!(
        "{} tokens of {documents} document(s) from {:.1} MB of text in {seconds:.2} s ({:.1} \
         MB/s, {:.2} M tokens/s; {}, {} tokens per byte)",
        tokens.len(),
        bytes as f64 / 1e6,
        bytes as f64 / 1e6 / seconds.max(1e-9),
        tokens.len() as f64 / 1e6 / seconds.max(1e-9),
        name,
        format_args!("{:.3}", tokens.len() as f64 / bytes.max(1) as f64)
    );
    println!(
        "wrote {} train and {} validation tokens: {}",
        train.len(),
        validation.len(),
        written
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let decode_with = match &args.tokenizer {
        Some(path) => format!(" --set 'data.tokenizer=\"{}\"'", path.display()),
        None => String::new(),
    };
    println!(
        "train with: --set 'data.train_files=\"{0}/train_*.bin\"' --set \
         'data.val_files=\"{0}/val_*.bin\"' --set model.vocab={1}{decode_with}",
        args.out.display(),
        vocab
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A corpus as Parquet rows (row groups of 2, a null row skipped) tokenizes to the same
    /// shards as its documents given as text files.
    #[test]
    fn parquet_rows_tokenize_as_their_documents() {
        let dir = tempfile::tempdir().unwrap();
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../data/shakespeare/input.txt"),
        )
        .unwrap();
        let docs = [&text[..4_000], &text[4_000..7_000], &text[7_000..12_000]];
        let mut files = Vec::new();
        for (i, doc) in docs.iter().enumerate() {
            let path = dir.path().join(format!("doc{i}.txt"));
            std::fs::write(&path, doc).unwrap();
            files.push(path);
        }
        let parquet = dir.path().join("corpus.parquet");
        let rows = [Some(docs[0]), None, Some(docs[1]), Some(docs[2])];
        crate::corpus::tests::write_parquet(&parquet, &rows, 2);
        let args = |inputs: Vec<PathBuf>, out: &str| TokenizeArgs {
            inputs,
            out: dir.path().join(out),
            encoding: "gpt2".into(),
            tokenizer: None,
            val_fraction: 0.1,
            shard_tokens: 100_000,
            text_field: "text".into(),
            skip_bad: true,
            max_documents: None,
        };
        run(&args(files, "text")).unwrap();
        run(&args(vec![parquet], "rows")).unwrap();
        for shard in ["train_000000.bin", "val_000000.bin"] {
            let a = std::fs::read(dir.path().join("text").join(shard)).unwrap();
            let b = std::fs::read(dir.path().join("rows").join(shard)).unwrap();
            assert!(a == b, "{shard} differs");
        }
    }

    #[test]
    fn pieces_encode_as_the_whole() {
        for (name, end_of_text) in [("gpt2", 50256), ("cl100k", 100257)] {
            pieces_encode_as_the_whole_with(name, end_of_text);
        }
    }

    fn pieces_encode_as_the_whole_with(name: &str, end_of_text: u32) {
        let enc = encoding(name).unwrap();
        let text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n\
                    All:\n  Speak, speak.\n\nFirst Citizen:\nYou are all resolved rather to \
                    die than to famish?\n!\n'tis 12345\r\nsaid \u{3000}\u{e9}l\u{e8}ve\n"
            .repeat(50);
        let whole = enc.bpe.encode_ordinary(&text);
        for target in [1, 7, 100, 1000] {
            let parts = pieces(&text, target);
            assert_eq!(parts.concat(), text);
            let joined: Vec<u32> = parts
                .iter()
                .flat_map(|p| enc.bpe.encode_ordinary(p))
                .collect();
            assert_eq!(joined, whole, "pieces of {target} bytes");
        }
        assert_eq!(enc.end_of_text, end_of_text);
        // And a real corpus, in pieces of 64 KiB.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/shakespeare/input.txt"
        );
        let corpus = std::fs::read_to_string(path).unwrap();
        let parts = pieces(&corpus, 1 << 16);
        assert!(parts.len() > 10);
        let joined: Vec<u32> = parts
            .iter()
            .flat_map(|p| enc.bpe.encode_ordinary(p))
            .collect();
        assert_eq!(
            joined,
            enc.bpe.encode_ordinary(&corpus),
            "{name} on the corpus"
        );
    }
}
