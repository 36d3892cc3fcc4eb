//! `meshtrain tokenize`: documents to token shards (llm.c's format, see
//! `meshtrain_data::shards`) with GPT-2's or cl100k's BPE, so a model trains on a user's own
//! text without a line of Rust: `data.train_files = "OUT/train_*.bin"`. The documents come
//! from text files, JSON lines (gzipped or not) or Parquet ([`crate::corpus`]).
//!
//! The corpus streams: reader threads take a file or a Parquet row group each and read its
//! documents into batches, which reach the encoders in corpus order
//! ([`crate::corpus::read_in_order`]); every core encodes a batch, shards are written as
//! they fill into `OUT/.tokenize-partial/` and moved into `OUT` only when the run has
//! finished. The validation split is by documents
//! ([`goes_to_validation`]).
//!
//! The BPE is tiktoken-rs's, whose vocabularies ship inside the crate (no download). Text is
//! cut into pieces after lone newlines between printable characters — where the BPE's
//! pre-tokenising regex splits alike in a piece and in the whole — and the pieces are encoded
//! in parallel, so the tokens are exactly those of encoding the whole file at once (tested).
//!
//! A user's own vocabulary comes as a Hugging Face `tokenizer.json` (`--tokenizer FILE`, read
//! by the `tokenizers` crate: byte-level BPE as GPT-2 and Llama 3, or SentencePiece-style BPE
//! with byte fallback as Llama 2). A byte-level BPE's text streams in pieces as above when
//! its pieces encode as the whole ([`HfTokenizer::pieces_encode_as_whole`]); a SentencePiece
//! normaliser marks the start of its input, so pieces would not, and such a tokenizer takes
//! each file whole.

use anyhow::{bail, ensure, Context, Result};
use meshtrain_data::write_shard;
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::Instant;
use tiktoken_rs::CoreBPE;

#[derive(clap::Args, Debug)]
pub struct TokenizeArgs {
    /// Files of documents: UTF-8 text (the file is one document), JSON lines (one document
    /// per line, see --text-field), either possibly gzip- or zstd-compressed, or Parquet (one document
    /// per row, the --text-field column); the format is taken from the content and the
    /// extension (`meshtrain::corpus`). A directory means every file under it, a quoted
    /// glob pattern ('corpus/*.jsonl.gz') its matches, both in name order. Each document is
    /// preceded by the end-of-text token, as in GPT-2's training data.
    #[arg(long = "input", required = true, num_args = 1..)]
    pub inputs: Vec<PathBuf>,
    /// The field of a JSON line (or the column of a Parquet file) that holds its document's
    /// text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Leave out malformed JSON lines and Parquet rows (counted), and files that cannot be
    /// read to their end (a damaged gzip or zstd stream, text that is not UTF-8, a Parquet
    /// file without a readable footer or the --text-field column: named), instead of stopping
    /// at the first, which is named by file and line or row. A bad file is left out whole, so
    /// the shards are those of the corpus without it.
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
    /// A Hugging Face tokenizer.json to encode with instead (your model's own vocabulary),
    /// or a model directory that has one (the one you will --init-from); train with
    /// data.tokenizer set to it, so that samples and generate decode with it.
    #[arg(long, conflicts_with = "encoding")]
    pub tokenizer: Option<PathBuf>,
    /// The share of the documents that goes to validation shards: every (1/f)-th document,
    /// spread over the corpus. A corpus of fewer documents (one text file) gives the last f
    /// of its tokens instead. 0: no validation shards.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Tokens per shard (llm.c writes 100 M).
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: usize,
    /// Threads that read (decompress, parse) the input, each a file or a Parquet row group
    /// at a time; the documents keep their corpus order whatever the number. Default: one
    /// per 16 cores, at most 8 (reading takes about 3% of the CPU the BPE takes, so one
    /// reader keeps some 30 cores encoding; each holds up to 32 MB of text in flight).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub readers: Option<u16>,
}

/// Reader threads when `--readers` is not given: one per 16 cores, at most 8. `perf` on
/// gzip JSON lines and snappy Parquet: decompressing and parsing take ~3% of the samples,
/// the BPE the rest; more readers than needed only compete with the encoders for cores.
fn default_readers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().div_ceil(16).min(8))
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

/// The tokenizer file `path` names: itself, or for a model directory (an export, a Hugging
/// Face download) the `tokenizer.json` in it.
pub fn tokenizer_file(path: &std::path::Path) -> PathBuf {
    if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    }
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

    /// Whether a text cut where [`pieces`] cuts encodes piece by piece exactly as the whole,
    /// so a large file can stream through every core as with GPT-2's BPE. True of byte-level
    /// BPEs whose pre-tokeniser splits at a lone newline (GPT-2's, Llama 3's, Qwen's regex);
    /// false where the normaliser or pre-tokeniser marks the start of its input (a
    /// SentencePiece `▁` or a byte-level prefix space: a piece would begin a word the whole
    /// text does not) or where there is no pre-tokeniser (the BPE runs over the whole text).
    /// Decided by the definition and then by encoding [`PIECE_PROBE`] cut at every such
    /// point: a tokenizer for which any cut differs takes its files whole.
    pub fn pieces_encode_as_whole(&self) -> bool {
        // As tokenizer.json writes them: `null` where there is none.
        let normalizer = serde_json::to_string(&self.inner.get_normalizer()).unwrap_or_default();
        let pre = serde_json::to_string(&self.inner.get_pre_tokenizer()).unwrap_or_default();
        if pre == "null" || normalizer.contains("\"Prepend\"") || pre.contains("\"Metaspace\"") {
            return false;
        }
        let Ok(whole) = self.encode(PIECE_PROBE) else {
            return false;
        };
        let mut joined = Vec::with_capacity(whole.len());
        for piece in pieces(PIECE_PROBE, 1) {
            match self.encode(piece) {
                Ok(ids) => joined.extend(ids),
                Err(_) => return false,
            }
        }
        joined == whole
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
pub(crate) fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let earlier = (0..b).filter(|&e| !printable(e)).count() as u32;
    char::from_u32(256 + earlier).expect("a valid code point")
}

/// Text that tries a tokenizer's cuts ([`HfTokenizer::pieces_encode_as_whole`]): words,
/// contractions, numbers, punctuation and non-ASCII letters on both sides of lone newlines,
/// blank lines, indentation and a CRLF, each kind of line starting and ending a piece.
pub const PIECE_PROBE: &str = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n\
    All:\n  Speak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to \
    famish?\n!\n'tis 12345\r\nsaid \u{3000}\u{e9}l\u{e8}ve\n'S'\n123\n4.5%\n(x)\n\
    don't\n--\n#include <a.h>\nint main() { return 0; }\n\"q\"\nna\u{ef}ve caf\u{e9} \
    \u{6771}\u{4eac} \u{1f600}\nZ\ny\n...\n?!\nend\n";

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

/// Text to tokens, with the encoder a run chose (called from every core at once).
type TextEncoder = Box<dyn Fn(&str) -> Result<Vec<u32>> + Send + Sync>;

/// `text` as tokens, encoded in parallel pieces.
fn encode(enc: &Encoding, text: &str) -> Vec<u32> {
    let parts: Vec<Vec<u32>> = pieces(text, 1 << 20)
        .par_iter()
        .map(|p| enc.bpe.encode_ordinary(p))
        .collect();
    parts.concat()
}

/// Text read ahead of the encoders, per batch: enough documents for every core, few enough
/// that memory does not grow with the corpus (two batches in flight).
const BATCH_BYTES: usize = 16 << 20;
/// A text file (one document) comes in pieces of about this size with GPT-2's or cl100k's
/// BPE, whose pieces encode as the whole, and with a `tokenizer.json` whose pieces do
/// ([`HfTokenizer::pieces_encode_as_whole`]); another takes a document whole.
const TEXT_PIECE_BYTES: usize = 256 << 10;
/// Where a run writes its shards until it has finished.
const PARTIAL_DIR: &str = ".tokenize-partial";

/// Whether document `i` (from 0) goes to validation: when ⌊(i+1)·f⌋ > ⌊i·f⌋, i.e. every
/// (1/f)-th document, spread over the whole corpus, the same on every run.
pub fn goes_to_validation(i: u64, fraction: f64) -> bool {
    ((i + 1) as f64 * fraction).floor() > (i as f64 * fraction).floor()
}

/// One split's shards, written as they fill (each file complete before it has its name).
struct Shards {
    dir: PathBuf,
    split: &'static str,
    shard_tokens: usize,
    vocab: usize,
    buffer: Vec<u32>,
    written: Vec<String>,
    tokens: u64,
}

impl Shards {
    fn new(dir: &std::path::Path, split: &'static str, shard_tokens: usize, vocab: usize) -> Self {
        Shards {
            dir: dir.to_path_buf(),
            split,
            shard_tokens,
            vocab,
            buffer: Vec::new(),
            written: Vec::new(),
            tokens: 0,
        }
    }

    fn push(&mut self, tokens: &[u32]) -> Result<()> {
        self.tokens += tokens.len() as u64;
        self.buffer.extend_from_slice(tokens);
        while self.buffer.len() >= self.shard_tokens {
            let rest = self.buffer.split_off(self.shard_tokens);
            let full = std::mem::replace(&mut self.buffer, rest);
            self.write(&full)?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        if !self.buffer.is_empty() {
            let last = std::mem::take(&mut self.buffer);
            self.write(&last)?;
        }
        Ok(())
    }

    fn write(&mut self, tokens: &[u32]) -> Result<()> {
        let name = format!("{}_{:06}.bin", self.split, self.written.len());
        let tmp = self.dir.join(format!("{name}.tmp"));
        write_shard(&tmp, tokens, self.vocab)?;
        std::fs::rename(&tmp, self.dir.join(&name))
            .with_context(|| format!("naming {}", self.dir.join(&name).display()))?;
        self.written.push(name);
        Ok(())
    }
}

/// The split of a stream of documents into training and validation shards by documents
/// ([`goes_to_validation`]). Until the first validation document is drawn the documents are
/// held back ([`Held`]): a corpus that ends before one is (fewer than 1/f documents, such as
/// one text file) is split by tokens instead, its last f of them to validation.
struct Split {
    fraction: f64,
    documents: u64,
    current_is_validation: bool,
    /// The tokens of the documents so far while no validation document has been drawn: all
    /// of them training's if one is.
    held: Option<Held>,
    train: Shards,
    val: Shards,
}

/// Tokens held back in memory before they go to a spill file: 64 MB.
const HELD_TOKENS_IN_MEMORY: usize = 16 << 20;

/// Tokens whose split is not known yet, in memory up to [`HELD_TOKENS_IN_MEMORY`] and then
/// in a file beside the shards, so that one large text file (split by tokens at the end)
/// does not hold its tokens in memory.
struct Held {
    spill_path: PathBuf,
    spill: Option<std::io::BufWriter<std::fs::File>>,
    spilled: usize,
    tokens: Vec<u32>,
    /// Tokens kept in memory before they are spilled ([`HELD_TOKENS_IN_MEMORY`]).
    in_memory: usize,
}

impl Held {
    fn new(dir: &std::path::Path) -> Self {
        Held {
            spill_path: dir.join("held.tmp"),
            spill: None,
            spilled: 0,
            tokens: Vec::new(),
            in_memory: HELD_TOKENS_IN_MEMORY,
        }
    }

    fn len(&self) -> usize {
        self.spilled + self.tokens.len()
    }

    fn push(&mut self, tokens: &[u32]) -> Result<()> {
        use std::io::Write;
        self.tokens.extend_from_slice(tokens);
        if self.tokens.len() < self.in_memory {
            return Ok(());
        }
        let path = &self.spill_path;
        let spill = match &mut self.spill {
            Some(spill) => spill,
            None => self.spill.insert(std::io::BufWriter::new(
                std::fs::File::create(path)
                    .with_context(|| format!("creating {}", path.display()))?,
            )),
        };
        let bytes: Vec<u8> = self.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        spill
            .write_all(&bytes)
            .with_context(|| format!("writing {}", path.display()))?;
        self.spilled += self.tokens.len();
        self.tokens.clear();
        Ok(())
    }

    /// Every token in order, a bounded run at a time; the spill file removed.
    fn drain(mut self, mut f: impl FnMut(&[u32]) -> Result<()>) -> Result<()> {
        use std::io::{Read, Write};
        if let Some(mut spill) = self.spill.take() {
            let path = &self.spill_path;
            spill
                .flush()
                .with_context(|| format!("writing {}", path.display()))?;
            drop(spill);
            let mut file = std::io::BufReader::new(
                std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?,
            );
            let mut bytes = vec![0u8; 4 << 20];
            let mut left = self.spilled;
            while left > 0 {
                let n = left.min(bytes.len() / 4);
                file.read_exact(&mut bytes[..4 * n])
                    .with_context(|| format!("reading {}", path.display()))?;
                let run: Vec<u32> = (bytes[..4 * n].chunks_exact(4))
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                f(&run)?;
                left -= n;
            }
            std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
        }
        f(&self.tokens)
    }
}

impl Split {
    fn new(fraction: f64, train: Shards, val: Shards) -> Self {
        Split {
            fraction,
            documents: 0,
            current_is_validation: false,
            held: (fraction > 0.0).then(|| Held::new(&train.dir)),
            train,
            val,
        }
    }

    /// The tokens of a new document (its separator first), or with `continues` more of the
    /// current one.
    fn add(&mut self, continues: bool, tokens: Vec<u32>) -> Result<()> {
        if !continues {
            self.current_is_validation = goes_to_validation(self.documents, self.fraction);
            self.documents += 1;
        }
        if self.current_is_validation {
            // The first validation document: everything held was training's.
            if let Some(held) = self.held.take() {
                held.drain(|tokens| self.train.push(tokens))?;
            }
        }
        match &mut self.held {
            Some(held) => held.push(&tokens),
            None => self.write_to(self.current_is_validation, &tokens),
        }
    }

    fn write_to(&mut self, validation: bool, tokens: &[u32]) -> Result<()> {
        if validation {
            self.val.push(tokens)
        } else {
            self.train.push(tokens)
        }
    }

    /// Writes what is left; says how the split was made.
    fn finish(&mut self) -> Result<&'static str> {
        let how = match self.held.take() {
            Some(held) => {
                let total = held.len();
                let mut to_train = total - (total as f64 * self.fraction) as usize;
                held.drain(|tokens| {
                    let cut = to_train.min(tokens.len());
                    to_train -= cut;
                    self.train.push(&tokens[..cut])?;
                    self.val.push(&tokens[cut..])
                })?;
                "by tokens (fewer documents than 1/--val-fraction): the last tokens"
            }
            None if self.fraction > 0.0 => "by documents: every (1/--val-fraction)-th document",
            None => "none (--val-fraction 0)",
        };
        self.train.finish()?;
        self.val.finish()?;
        Ok(how)
    }
}

/// The progress line: documents, tokens and the rate (drawn only on a terminal).
fn progress_bar() -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new_spinner();
    if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} {elapsed} {msg}") {
        bar.set_style(style);
    }
    bar
}

pub fn run(args: &TokenizeArgs) -> Result<()> {
    ensure!(
        (0.0..1.0).contains(&args.val_fraction),
        "--val-fraction must be in [0, 1), got {}",
        args.val_fraction
    );
    ensure!(args.shard_tokens > 0, "--shard-tokens must be at least 1");
    let files = crate::corpus::expand_inputs(&args.inputs)?;
    // Parquet footers are read here, before anything in `args.out` is touched.
    let (parts, unreadable) = crate::corpus::parts_of(&files, &args.text_field, args.skip_bad)?;
    let (name, vocab, separator, pieces_encode_as_whole, encode_text): (
        String,
        usize,
        Option<u32>,
        bool,
        TextEncoder,
    ) = match &args.tokenizer {
        Some(path) => {
            let path = tokenizer_file(path);
            let hf = HfTokenizer::open(&path)?;
            let name = format!("tokenizer {}", path.display());
            let whole = hf.pieces_encode_as_whole();
            let (vocab, eot) = (hf.vocab, hf.end_of_text);
            (name, vocab, eot, whole, Box::new(move |t| hf.encode(t)))
        }
        None => {
            let enc = encoding(&args.encoding)?;
            let name = format!("{} BPE", args.encoding);
            let (vocab, eot) = (enc.vocab, enc.end_of_text);
            (
                name,
                vocab,
                Some(eot),
                true,
                Box::new(move |t| Ok(encode(&enc, t))),
            )
        }
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let partial = args.out.join(PARTIAL_DIR);
    if partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("removing an earlier run's {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let mut split = Split::new(
        args.val_fraction,
        Shards::new(&partial, "train", args.shard_tokens, vocab),
        Shards::new(&partial, "val", args.shard_tokens, vocab),
    );
    let started = Instant::now();
    let bar = progress_bar();
    let options = crate::corpus::ReadOptions {
        text_field: args.text_field.clone(),
        skip_bad: args.skip_bad,
        text_pieces: pieces_encode_as_whole.then_some(TEXT_PIECE_BYTES),
        batch_bytes: BATCH_BYTES,
        readers: args.readers.map_or_else(default_readers, usize::from),
        max_documents: args.max_documents,
    };
    let (mut documents, mut bytes) = (0usize, 0usize);
    let read = crate::corpus::read_in_order(&parts, &options, |batch| {
        let tokens: Vec<Result<Vec<u32>>> =
            batch.par_iter().map(|d| encode_text(&d.text)).collect();
        for (doc, tokens) in batch.iter().zip(tokens) {
            let mut all = Vec::new();
            if !doc.continues {
                all.extend(separator);
                documents += 1;
            }
            all.extend(tokens.context("encoding a document")?);
            bytes += doc.text.len();
            split.add(doc.continues, all)?;
        }
        let seconds = started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "{documents} documents, {} tokens, {:.1} MB/s",
            split.train.tokens + split.val.tokens,
            bytes as f64 / 1e6 / seconds
        ));
        bar.tick();
        Ok(())
    });
    bar.finish_and_clear();
    let outcome = read.and_then(|mut left_out| {
        left_out.parts.splice(0..0, unreadable);
        // Separators alone are no corpus: a model would learn nothing from them, and a shard
        // of them looks like a finished run.
        ensure!(bytes > 0, "{}", no_text(&files, documents, &left_out));
        let how = split.finish()?;
        Ok((documents, bytes, left_out, how))
    });
    let (documents, bytes, left_out, how) = match outcome {
        Ok(done) => done,
        Err(e) => {
            let kept = split.train.written.len() + split.val.written.len();
            let _ = std::fs::remove_dir_all(&partial);
            return Err(e.context(format!(
                "nothing in {} changed ({kept} shard(s) written before the error were removed)",
                args.out.display()
            )));
        }
    };
    let replaced = finish_shards(&args.out, &partial)?;
    if left_out.lines > 0 {
        println!("left out {} malformed line(s) (--skip-bad)", left_out.lines);
    }
    if !left_out.parts.is_empty() {
        println!(
            "left out {} unreadable file(s) or row group(s) (--skip-bad):",
            left_out.parts.len()
        );
        for why in &left_out.parts {
            println!("  {why}");
        }
    }
    if replaced > 0 {
        println!(
            "replaced {replaced} shard(s) of an earlier run in {}",
            args.out.display()
        );
    }
    let seconds = started.elapsed().as_secs_f64();
    let tokens = split.train.tokens + split.val.tokens;
    println!(
        "{tokens} tokens of {documents} document(s) from {} file(s), {:.1} MB of text in \
         {seconds:.2} s ({:.1} MB/s, {:.2} M tokens/s; {name}, {:.3} tokens per byte)",
        files.len(),
        bytes as f64 / 1e6,
        bytes as f64 / 1e6 / seconds.max(1e-9),
        tokens as f64 / 1e6 / seconds.max(1e-9),
        tokens as f64 / bytes.max(1) as f64
    );
    let shards = |s: &Shards| match s.written.len() {
        0 => "none".to_string(),
        1 => s.written[0].clone(),
        n => format!("{} … {} ({n} shards)", s.written[0], s.written[n - 1]),
    };
    println!(
        "wrote {} train tokens ({}) and {} validation tokens ({}) to {}; validation split: {how}",
        split.train.tokens,
        shards(&split.train),
        split.val.tokens,
        shards(&split.val),
        args.out.display()
    );
    let decode_with = match &args.tokenizer {
        Some(path) => format!(
            " --set 'data.tokenizer=\"{}\"'",
            tokenizer_file(path).display()
        ),
        None => String::new(),
    };
    let val_files = if split.val.written.is_empty() {
        String::new()
    } else {
        format!(
            " --set 'data.val_files=\"{}/val_*.bin\"'",
            args.out.display()
        )
    };
    println!(
        "train with: --set 'data.train_files=\"{}/train_*.bin\"'{val_files} --set \
         model.vocab={vocab}{decode_with}",
        args.out.display(),
    );
    if split.val.written.is_empty() {
        println!(
            "(no validation shards, so no validation loss: --val-fraction above 0 makes them)"
        );
    }
    Ok(())
}

/// Why a corpus gave nothing to tokenize: its inputs (the first few named) and what
/// `--skip-bad` left out of them.
fn no_text(files: &[PathBuf], documents: usize, left_out: &crate::corpus::LeftOut) -> String {
    const NAMED: usize = 5;
    let mut names: Vec<String> = (files.iter().take(NAMED))
        .map(|f| f.display().to_string())
        .collect();
    if files.len() > NAMED {
        names.push(format!("{} more file(s)", files.len() - NAMED));
    }
    let names = names.join(", ");
    let mut why = match documents {
        0 => format!("no documents in {names} (blank files"),
        n => format!("no text in {names}: {n} document(s), every one empty (empty files"),
    };
    if left_out.lines > 0 {
        why += &format!(", {} malformed line(s) left out", left_out.lines);
    }
    if !left_out.parts.is_empty() {
        why += &format!(
            ", {} unreadable file(s) or row group(s) left out: {}",
            left_out.parts.len(),
            left_out.parts.join("; ")
        );
    }
    why + "): nothing to tokenize"
}

/// Moves a finished run's shards from `partial` into `out`, after removing an earlier run's
/// (`train_*.bin`, `val_*.bin`) there; returns how many were removed.
fn finish_shards(out: &std::path::Path, partial: &std::path::Path) -> Result<usize> {
    let is_shard = |name: &str| {
        (name.starts_with("train_") || name.starts_with("val_")) && name.ends_with(".bin")
    };
    let mut replaced = 0;
    for entry in std::fs::read_dir(out).with_context(|| format!("reading {}", out.display()))? {
        let path = entry?.path();
        if path.is_file()
            && path
                .file_name()
                .is_some_and(|n| is_shard(&n.to_string_lossy()))
        {
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
            replaced += 1;
        }
    }
    for entry in std::fs::read_dir(partial)? {
        let path = entry?.path();
        let name = path.file_name().expect("a file name").to_owned();
        std::fs::rename(&path, out.join(&name))
            .with_context(|| format!("moving {} into {}", path.display(), out.display()))?;
    }
    std::fs::remove_dir(partial).with_context(|| format!("removing {}", partial.display()))?;
    Ok(replaced)
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
            readers: None,
        };
        run(&args(files, "text")).unwrap();
        run(&args(vec![parquet], "rows")).unwrap();
        for shard in ["train_000000.bin", "val_000000.bin"] {
            let a = std::fs::read(dir.path().join("text").join(shard)).unwrap();
            let b = std::fs::read(dir.path().join("rows").join(shard)).unwrap();
            assert!(a == b, "{shard} differs");
        }
    }

    fn args_for(inputs: Vec<PathBuf>, out: PathBuf) -> TokenizeArgs {
        TokenizeArgs {
            inputs,
            out,
            encoding: "gpt2".into(),
            tokenizer: None,
            val_fraction: 0.2,
            shard_tokens: 1000,
            text_field: "text".into(),
            skip_bad: false,
            max_documents: None,
            readers: None,
        }
    }

    /// Every token of a split's shards, in shard order.
    fn split_tokens(dir: &std::path::Path, split: &str) -> Vec<u32> {
        let pattern = format!("{}/{split}_*.bin", dir.display());
        meshtrain_data::shards::open_shards(&pattern)
            .map(|shards| {
                shards
                    .iter()
                    .flat_map(|s| (0..s.len()).map(|i| s.token(i)).collect::<Vec<_>>())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn shakespeare() -> String {
        std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../data/shakespeare/input.txt"),
        )
        .unwrap()
    }

    /// Every (1/f)-th document goes to validation; shards are written as they fill (1000
    /// tokens each here), and together hold exactly each split's documents in order.
    #[test]
    fn validation_is_every_fifth_document_and_shards_fill_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let text = shakespeare();
        let docs: Vec<&str> = (0..25).map(|i| &text[i * 1_500..(i + 1) * 1_500]).collect();
        let lines: String = docs
            .iter()
            .map(|d| serde_json::json!({ "text": d }).to_string() + "\n")
            .collect();
        let corpus = dir.path().join("corpus.jsonl");
        std::fs::write(&corpus, lines).unwrap();
        run(&args_for(vec![corpus], dir.path().join("out"))).unwrap();
        let enc = encoding("gpt2").unwrap();
        let (mut train, mut val) = (Vec::new(), Vec::new());
        for (i, d) in docs.iter().enumerate() {
            let to = if goes_to_validation(i as u64, 0.2) {
                &mut val
            } else {
                &mut train
            };
            to.push(enc.end_of_text);
            to.extend(enc.bpe.encode_ordinary(d));
        }
        assert_eq!(
            (0..25u64)
                .filter(|&i| goes_to_validation(i, 0.2))
                .collect::<Vec<_>>(),
            vec![4, 9, 14, 19, 24]
        );
        let out = dir.path().join("out");
        assert!(out.join("train_000001.bin").exists(), "several shards");
        assert_eq!(split_tokens(&out, "train"), train);
        assert_eq!(split_tokens(&out, "val"), val);
        assert!(!out.join(PARTIAL_DIR).exists());
    }

    /// A corpus split by tokens (one document) whose held tokens went to a spill file gives
    /// the shards of one held in memory, and leaves no spill file; a validation document
    /// drawn after a spill sends everything held to training first.
    #[test]
    fn held_tokens_spill_to_a_file_and_come_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let shards = |dir: &std::path::Path, fraction: f64, in_memory: usize, docs: usize| {
            std::fs::create_dir_all(dir).unwrap();
            let mut split = Split::new(
                fraction,
                Shards::new(dir, "train", 3_000, 50_000),
                Shards::new(dir, "val", 3_000, 50_000),
            );
            split.held.as_mut().unwrap().in_memory = in_memory;
            let mut next = 0u32;
            for _ in 0..docs {
                for piece in 0..10 {
                    let tokens: Vec<u32> = (next..next + 1_000).collect();
                    next += 1_000;
                    split.add(piece > 0, tokens).unwrap();
                }
            }
            split.finish().unwrap();
            assert!(!dir.join("held.tmp").exists());
            (split_tokens(dir, "train"), split_tokens(dir, "val"))
        };
        let all: Vec<u32> = (0..10_000).collect();
        for in_memory in [2_500, 1 << 30] {
            let (train, val) = shards(
                &dir.path().join(format!("one{in_memory}")),
                0.1,
                in_memory,
                1,
            );
            assert_eq!((&train[..], &val[..]), (&all[..9_000], &all[9_000..]));
        }
        // Two documents at 1/2: the second is validation, the first (spilled) is training's.
        let (train, val) = shards(&dir.path().join("two"), 0.5, 2_500, 2);
        assert_eq!(train, all);
        assert_eq!(val, (10_000..20_000).collect::<Vec<u32>>());
    }

    /// A text file comes in pieces (the later ones continue its document) that encode as
    /// the whole file does.
    #[test]
    fn a_large_text_file_streams_in_pieces_that_encode_as_the_whole() {
        let dir = tempfile::tempdir().unwrap();
        let text = shakespeare();
        let path = dir.path().join("input.txt");
        std::fs::write(&path, &text).unwrap();
        let mut parts = Vec::new();
        crate::corpus::for_each_document(&path, "text", false, Some(10_000), |d| {
            assert_eq!(d.continues, !parts.is_empty());
            parts.push(d.text);
            Ok(true)
        })
        .unwrap();
        assert!(parts.len() > 50, "{} pieces", parts.len());
        assert_eq!(parts.concat(), text);
        let enc = encoding("gpt2").unwrap();
        let joined: Vec<u32> = parts
            .iter()
            .flat_map(|p| enc.bpe.encode_ordinary(p))
            .collect();
        assert_eq!(joined, enc.bpe.encode_ordinary(&text));
    }

    /// One text file (fewer documents than 1/f) is split by tokens, as before: its last f
    /// of them; with --val-fraction 0 there are no validation shards at all.
    #[test]
    fn a_single_document_is_split_by_tokens_and_zero_means_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("input.txt");
        std::fs::write(&path, &shakespeare()[..50_000]).unwrap();
        let out = dir.path().join("out");
        run(&TokenizeArgs {
            shard_tokens: 1 << 20,
            ..args_for(vec![path.clone()], out.clone())
        })
        .unwrap();
        let (train, val) = (split_tokens(&out, "train"), split_tokens(&out, "val"));
        let all = train.len() + val.len();
        assert_eq!(val.len(), (all as f64 * 0.2) as usize);
        run(&TokenizeArgs {
            val_fraction: 0.0,
            ..args_for(vec![path], out.clone())
        })
        .unwrap();
        assert!(
            split_tokens(&out, "val").is_empty(),
            "the earlier run's val shards replaced"
        );
        assert_eq!(split_tokens(&out, "train").len(), all);
    }

    /// A run that fails (a malformed line in the second file) leaves the output directory as
    /// it was; an empty input (no documents, or only empty ones) is an error naming it, not a
    /// shard of separators.
    #[test]
    fn a_failed_or_empty_run_leaves_nothing_looking_finished() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("a.jsonl");
        let bad = dir.path().join("b.jsonl");
        let long = shakespeare()[..20_000].to_string();
        std::fs::write(
            &good,
            serde_json::json!({ "text": long }).to_string() + "\n",
        )
        .unwrap();
        std::fs::write(&bad, "{\"text\": \"fine\"}\n{broken\n").unwrap();
        let out = dir.path().join("out");
        let e = run(&args_for(vec![good.clone(), bad], out.clone())).unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("b.jsonl:2: not a JSON object") && e.contains("nothing in"),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "{e}");
        let empty = dir.path().join("empty.txt");
        std::fs::write(&empty, "").unwrap();
        let blank = dir.path().join("blank.jsonl");
        std::fs::write(&blank, "\n\n").unwrap();
        let e = format!(
            "{:#}",
            run(&args_for(vec![blank], out.clone())).unwrap_err()
        );
        assert!(
            e.contains("no documents in") && e.contains("blank.jsonl"),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
        // An empty text file is one empty document, JSON lines may hold empty texts: only
        // separators, no corpus.
        let empty_texts = dir.path().join("empty-texts.jsonl");
        std::fs::write(&empty_texts, "{\"text\": \"\"}\n{\"text\": \"\"}\n").unwrap();
        for (input, documents) in [(&empty, 1), (&empty_texts, 2)] {
            let e = format!(
                "{:#}",
                run(&args_for(vec![input.clone()], out.clone())).unwrap_err()
            );
            let name = input.display().to_string();
            assert!(
                e.contains(&format!(
                    "no text in {name}: {documents} document(s), every one empty"
                )),
                "{e}"
            );
            assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "{e}");
        }
        // Beside a document with text, an empty one is a document as before.
        run(&args_for(vec![empty, good], out.clone())).unwrap();
        assert!(!split_tokens(&out, "train").is_empty());
    }

    /// `--skip-bad` leaves out whole, and names, a file that cannot be read to its end: a
    /// damaged gzip stream whose first documents decode, a text file that turns out not to be
    /// UTF-8 after its first pieces, a Parquet file without a footer. The shards are exactly
    /// those of the corpus without them, whatever the number of readers (no document of a bad
    /// file gets in before its damage is met). Without `--skip-bad` the first one stops the
    /// run and nothing is written.
    #[test]
    fn skip_bad_leaves_out_a_bad_file_whole() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let text = shakespeare();
        let lines = |docs: std::ops::Range<usize>| -> String {
            docs.map(|i| {
                serde_json::json!({ "text": &text[i * 2_000..(i + 1) * 2_000] }).to_string() + "\n"
            })
            .collect()
        };
        let gzip = |s: &str| {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(s.as_bytes()).unwrap();
            e.finish().unwrap()
        };
        let good_gz = dir.path().join("a.jsonl.gz");
        std::fs::write(&good_gz, gzip(&lines(0..10))).unwrap();
        let damaged = dir.path().join("b.jsonl.gz");
        let whole = gzip(&lines(10..60));
        std::fs::write(&damaged, &whole[..whole.len() / 2]).unwrap();
        let good_text = dir.path().join("c.txt");
        std::fs::write(&good_text, &text[150_000..160_000]).unwrap();
        let not_utf8 = dir.path().join("d.txt");
        let mut bytes = text.as_bytes()[..600_000].to_vec();
        bytes.push(0xff);
        std::fs::write(&not_utf8, bytes).unwrap();
        let no_footer = dir.path().join("e.parquet");
        std::fs::write(&no_footer, b"PAR1 no row groups, no footer").unwrap();
        // Each bad file has documents that read before its damage.
        for (bad, what) in [
            (&damaged, "a damaged gzip stream"),
            (&not_utf8, "byte offset 600000 is 0xff"),
        ] {
            let mut read = 0;
            let e = crate::corpus::for_each_document(
                bad,
                "text",
                false,
                Some(TEXT_PIECE_BYTES),
                |_| {
                    read += 1;
                    Ok(true)
                },
            )
            .unwrap_err();
            assert!(read > 0 && format!("{e:#}").contains(what), "{read}: {e:#}");
        }
        let good = vec![good_gz.clone(), good_text.clone()];
        let all = vec![
            good_gz.clone(),
            damaged.clone(),
            good_text.clone(),
            not_utf8,
            no_footer,
        ];
        let tokenize = |inputs: &[PathBuf], out: &str, skip_bad: bool, readers: u16| {
            let out = dir.path().join(out);
            let result = run(&TokenizeArgs {
                skip_bad,
                readers: Some(readers),
                shard_tokens: 5_000,
                ..args_for(inputs.to_vec(), out.clone())
            });
            (result, out)
        };
        let (result, want) = tokenize(&good, "good", false, 1);
        result.unwrap();
        assert!(want.join("train_000001.bin").exists(), "several shards");
        for readers in [1, 4] {
            let (result, out) = tokenize(&all, &format!("skipped-{readers}"), true, readers);
            result.unwrap();
            for split in ["train", "val"] {
                assert_eq!(
                    split_tokens(&out, split),
                    split_tokens(&want, split),
                    "{split}, {readers} readers"
                );
            }
        }
        let (result, out) = tokenize(&[good_gz, damaged, good_text], "stopped", false, 4);
        let e = format!("{:#}", result.unwrap_err());
        assert!(
            e.contains("b.jsonl.gz: a damaged gzip stream") && e.contains("nothing in"),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "{e}");
    }

    /// A directory is every file under it, a glob its matches, both in name order.
    #[test]
    fn directories_and_globs_expand_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = dir.path().join("corpus");
        std::fs::create_dir_all(corpus.join("sub")).unwrap();
        for name in ["b.txt", "a.txt", "sub/c.txt", ".hidden"] {
            std::fs::write(corpus.join(name), name).unwrap();
        }
        let files = crate::corpus::expand_inputs(std::slice::from_ref(&corpus)).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|f| f.strip_prefix(&corpus).unwrap().display().to_string())
            .collect();
        assert_eq!(names, ["a.txt", "b.txt", "sub/c.txt"]);
        let pattern = PathBuf::from(format!("{}/*.txt", corpus.display()));
        assert_eq!(crate::corpus::expand_inputs(&[pattern]).unwrap().len(), 2);
        let none = PathBuf::from(format!("{}/*.parquet", corpus.display()));
        let e = crate::corpus::expand_inputs(&[none])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no file matches"), "{e}");
        let missing = dir.path().join("missing.txt");
        let e = crate::corpus::expand_inputs(&[missing])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such file"), "{e}");
    }

    fn fixture_tokenizer(name: &str) -> PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/refs/tokenizers")
            .join(name)
            .join("tokenizer.json")
    }

    /// `tokenizer.json` with its pre-tokeniser (and normaliser) replaced, in `dir`.
    fn variant(dir: &std::path::Path, name: &str, pre: serde_json::Value) -> HfTokenizer {
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture_tokenizer("bytelevel")).unwrap())
                .unwrap();
        json["pre_tokenizer"] = pre;
        let path = dir.join(format!("{name}.json"));
        std::fs::write(&path, json.to_string()).unwrap();
        HfTokenizer::open(&path).unwrap()
    }

    /// A byte-level BPE (GPT-2's pre-tokeniser, or Llama 3's split regex before a byte-level
    /// map) streams a large text file in pieces that encode as the whole, through every
    /// core; one that marks the start of its input (SentencePiece's `▁`, a byte-level prefix
    /// space) takes each file whole, and its shards are still the whole file's encoding.
    #[test]
    fn a_users_tokenizer_streams_where_its_pieces_encode_as_the_whole() {
        let dir = tempfile::tempdir().unwrap();
        let llama3_split = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex":
                "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
        let prefix_space = serde_json::json!(
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
        let cases = [
            (
                HfTokenizer::open(&fixture_tokenizer("bytelevel")).unwrap(),
                true,
                "byte-level",
            ),
            (
                variant(dir.path(), "llama3", llama3_split),
                true,
                "Llama 3's split",
            ),
            (
                variant(dir.path(), "prefix", prefix_space),
                false,
                "a prefix space",
            ),
            (
                HfTokenizer::open(&fixture_tokenizer("sentencepiece")).unwrap(),
                false,
                "SentencePiece",
            ),
        ];
        let text = &shakespeare()[..400_000];
        let path = dir.path().join("input.txt");
        std::fs::write(&path, text).unwrap();
        for (tok, streams, what) in cases {
            assert_eq!(tok.pieces_encode_as_whole(), streams, "{what}");
            let whole = tok.encode(text).unwrap();
            if streams {
                let mut joined = Vec::new();
                crate::corpus::for_each_document(&path, "text", false, Some(5_000), |d| {
                    joined.extend(tok.encode(&d.text).unwrap());
                    Ok(true)
                })
                .unwrap();
                assert!(joined == whole, "{what}: pieces of 5 KB");
            }
        }
        // End to end: the shards of a streamed run are the whole file's tokens.
        for name in ["bytelevel", "sentencepiece"] {
            let out = dir.path().join(name);
            run(&TokenizeArgs {
                tokenizer: Some(fixture_tokenizer(name).parent().unwrap().to_path_buf()),
                val_fraction: 0.0,
                shard_tokens: 1 << 20,
                ..args_for(vec![path.clone()], out.clone())
            })
            .unwrap();
            let tok = HfTokenizer::open(&fixture_tokenizer(name)).unwrap();
            let mut want = vec![tok.end_of_text.unwrap()];
            want.extend(tok.encode(text).unwrap());
            assert!(split_tokens(&out, "train") == want, "{name}: shards");
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
        let text = PIECE_PROBE.repeat(50);
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
