//! `meshtrain generate`: text from a trained GPT or Llama checkpoint, tokens printed as they
//! come.
//!
//! The checkpoint carries the run's config, so the model is rebuilt from it and its weights
//! loaded; the tokens are decoded with what the run trained on: bytes for the built-in text,
//! or the BPE whose vocabulary the run's token shards record. Generation itself is the
//! library's ([`meshtrain_nn::generate`]): tokens drawn with temperature and top-k from a
//! seeded generator, the model's own layers decoding incrementally with a key/value cache
//! (the prompt one pass, then each new token one row through the layers and its attention
//! over the cache) instead of a forward over the whole window per token. `--no-cache` keeps
//! that window forward (the model's own [`Model::forward_all`] over the last `seq` tokens),
//! to measure the cache against; the two agree while the text fits the context and differ
//! in how they window it beyond (see [`Decoder::step`]). `--device cuda` runs the cached
//! decoder on a GPU (weights, cache and activations in its memory, f32); the logits come back
//! for the same sampling, so the same seed draws the same tokens wherever the logits agree.
//! The time and tokens/s go to stderr at the end, with the device named.

use crate::config::Config;
use crate::presets::build_model;
use crate::tokenize::{encoding, encoding_of_vocab, Encoding, HfTokenizer};
use anyhow::{bail, ensure, Context, Result};
use meshtrain_nn::generate::{
    check_device, continue_text, Comparison, Decoder, NextLogits, Sampling, TokenChoice,
};
use meshtrain_nn::optim::{Optimizer, OptimizerConfig};
use meshtrain_nn::{Model, ParamStore};
use meshtrain_tensor::Device;
use meshtrain_train::checkpoint::{self, Restore};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `--temperature`'s default (and the training log's samples').
pub const GENERATE_TEMPERATURE: f32 = 0.8;
/// `--top-k`'s default (and the training log's samples').
pub const GENERATE_TOP_K: usize = 40;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A checkpoint of a GPT or Llama run (checkpoint.safetensors; a sharded one:
    /// consolidate it first with `meshtrain checkpoint consolidate`).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The text to continue.
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub max_tokens: usize,
    /// Softmax temperature: below 1 sharper, above 1 flatter; 0 picks the likeliest token.
    /// (A negative or NaN value is refused with a message, not taken for another flag.)
    #[arg(long, default_value_t = GENERATE_TEMPERATURE, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sample among the K likeliest tokens only (0: all).
    #[arg(long, default_value_t = GENERATE_TOP_K)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The tokens the model was trained on: bytes, gpt2 or cl100k (default: what the run's
    /// data was).
    #[arg(long, value_parser = ["bytes", "gpt2", "cl100k"])]
    pub encoding: Option<String>,
    /// A Hugging Face tokenizer.json to decode with (default: the run's data.tokenizer).
    #[arg(long, conflicts_with = "encoding")]
    pub tokenizer: Option<PathBuf>,
    /// Run the whole window's forward for every token instead of the key/value cache (the
    /// path before the cache: to measure the cache's speed-up).
    #[arg(long)]
    pub no_cache: bool,
    /// Where the model decodes: cpu (default), cuda (GPU 0) or cuda:N, as `train --device`.
    /// On a GPU the weights, the key/value cache and the activations live in its memory (f32);
    /// the logits come back for sampling.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Also decode on the CPU, in lockstep (fed the same tokens), and print the largest
    /// relative difference between the two devices' logits over the steps: a check of
    /// --device cuda (the time then includes the CPU's).
    #[arg(long, conflicts_with = "no_cache")]
    pub compare_cpu: bool,
}

/// Text to tokens and back.
pub enum Tokenizer {
    Bytes,
    /// A BPE: generation never draws its special tokens but the end of text, and stops there.
    Bpe(Box<Encoding>),
    /// A Hugging Face tokenizer.json: likewise, its special tokens are never drawn but the
    /// end of text, if it has one.
    Hf(Box<HfTokenizer>),
}

/// How many ids past a tokenizer's own a model's vocabulary may have (padding to a multiple
/// of 64 or 128, as GPT-2's 50,257 becomes 50,304): more, and the model was trained on other
/// tokens.
const VOCAB_PADDING: usize = 1024;

impl Tokenizer {
    /// Ids the tokenizer has.
    pub fn vocab(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Bpe(enc) => enc.vocab,
            Tokenizer::Hf(hf) => hf.vocab,
        }
    }

    /// What it is, for messages.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Bytes => "bytes (256 ids)".into(),
            Tokenizer::Bpe(enc) => format!("a BPE of {} ids", enc.vocab),
            Tokenizer::Hf(hf) => format!("a tokenizer.json of {} ids", hf.vocab),
        }
    }

    /// Refuses a tokenizer that cannot be the one a model of `vocab` ids was trained on: its
    /// ids must fit, and the model must not have many more (then its tokens are another
    /// vocabulary's, and decoding them with this one prints garbage). Names the encodings
    /// that fit.
    pub fn check_fits(&self, vocab: usize) -> Result<()> {
        let own = self.vocab();
        if own <= vocab && vocab < own + VOCAB_PADDING {
            return Ok(());
        }
        let fitting: Vec<&str> = [("bytes", 256), ("gpt2", 50_257), ("cl100k", 100_277)]
            .iter()
            .filter(|(_, v)| *v <= vocab && vocab < v + VOCAB_PADDING)
            .map(|(n, _)| *n)
            .collect();
        let suggestion = match fitting.as_slice() {
            [] => "the tokenizer.json it was trained with (--tokenizer)".to_string(),
            names => format!("--encoding {}", names.join(" or ")),
        };
        bail!(
            "the model's vocabulary has {vocab} ids, which {} cannot be: give {suggestion} (or \
             leave both out to use what the run trained on)",
            self.describe()
        )
    }

    pub fn named(name: &str) -> Result<Tokenizer> {
        Ok(match name {
            "bytes" => Tokenizer::Bytes,
            name => Tokenizer::Bpe(Box::new(encoding(name)?)),
        })
    }

    /// What a run trained on: its `data.tokenizer`, its token shards' vocabulary, or bytes.
    pub fn of_run(cfg: &Config) -> Result<Tokenizer> {
        if let Some(path) = &cfg.data.tokenizer {
            return Ok(Tokenizer::Hf(Box::new(HfTokenizer::open(path)?)));
        }
        let Some(pattern) = &cfg.data.train_files else {
            return Ok(Tokenizer::Bytes);
        };
        let shards = meshtrain_data::open_shards(pattern)
            .context("the run's data.train_files (or give --encoding)")?;
        let vocab = shards[0].vocab;
        match encoding_of_vocab(vocab) {
            Some(name) => Tokenizer::named(name),
            None => bail!(
                "the run's shards record a vocabulary of {vocab}, not GPT-2's or cl100k's: give \
                 the tokenizer.json they were written with (data.tokenizer, or --tokenizer)"
            ),
        }
    }

    /// The start of a text: the end-of-text token for a BPE (GPT-2's documents begin after
    /// one), a newline for bytes (the built-in corpus's lines).
    pub fn start_of_text(&self) -> Vec<u32> {
        match self {
            Tokenizer::Bytes => vec![u32::from(b'\n')],
            Tokenizer::Bpe(enc) => vec![enc.end_of_text],
            Tokenizer::Hf(hf) => match hf.end_of_text {
                Some(eot) => vec![eot],
                None => hf.encode("\n").unwrap_or_default(),
            },
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(match self {
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
            Tokenizer::Bpe(enc) => enc.bpe.encode_ordinary(text),
            Tokenizer::Hf(hf) => hf.encode(text)?,
        })
    }

    /// The bytes `token` stands for (part of a character, possibly).
    pub fn bytes(&self, token: u32) -> Vec<u8> {
        match self {
            Tokenizer::Bytes => vec![token as u8],
            // An ordinary token (see `candidates`): always in the decoder.
            Tokenizer::Bpe(enc) => (enc.bpe)
                ._decode_native_and_split(vec![token])
                .next()
                .unwrap_or_default(),
            Tokenizer::Hf(hf) => hf.token_bytes(token),
        }
    }
}

/// What generation may draw: the tokenizer's tokens of the model's logits.
impl TokenChoice for Tokenizer {
    /// The tokens a sample may be: the logits of every byte, or of every ordinary token and
    /// the end of text last (a padded vocabulary's extra rows and unused special ids are
    /// never drawn).
    fn candidates(&self, logits: &[f32]) -> Vec<f32> {
        match self {
            Tokenizer::Bytes => logits[..256.min(logits.len())].to_vec(),
            Tokenizer::Bpe(enc) => {
                let mut c = logits[..enc.ordinary.min(logits.len())].to_vec();
                if let Some(&eot) = logits.get(enc.end_of_text as usize) {
                    c.push(eot);
                }
                c
            }
            Tokenizer::Hf(hf) => {
                let mut c = logits[..hf.vocab.min(logits.len())].to_vec();
                for &id in &hf.special {
                    if Some(id) != hf.end_of_text {
                        if let Some(v) = c.get_mut(id as usize) {
                            *v = f32::NEG_INFINITY;
                        }
                    }
                }
                c
            }
        }
    }

    /// The token a candidate index stands for, or `None` for the end of text.
    fn token(&self, candidate: usize) -> Option<u32> {
        match self {
            Tokenizer::Bpe(enc) if candidate >= enc.ordinary => None,
            Tokenizer::Hf(hf) if Some(candidate as u32) == hf.end_of_text => None,
            _ => Some(candidate as u32),
        }
    }
}

/// `cfg`'s model with the parameters and buffers of `checkpoint` (no optimizer state).
pub fn load_weights(checkpoint: &Path, cfg: &Config) -> Result<(Model, ParamStore)> {
    let model = build_model(&cfg.model);
    let mut store = ParamStore {
        values: vec![0.0; model.num_params()],
        grads: Vec::new(),
        buffers: vec![0.0; model.num_buffers()],
    };
    let sgd = OptimizerConfig::Sgd {
        momentum: 0.0,
        weight_decay: 0.0,
    };
    let mut unused = Optimizer::new(sgd, 0);
    checkpoint::load(
        checkpoint,
        &model,
        "",
        &mut store,
        &mut unused,
        Restore::Weights,
    )?;
    Ok((model, store))
}

/// A sample of up to `max_tokens` tokens from the start of a text
/// ([`Tokenizer::start_of_text`]) by `config`'s model with parameters `values` (laid out as
/// `model`): what the training log shows at each evaluation. Invalid UTF-8 (a character cut
/// by the last token) is replaced.
pub fn sample_text(
    model: &Model,
    values: &[f32],
    tokenizer: &Tokenizer,
    max_tokens: usize,
    sampling: Sampling,
) -> Result<String> {
    let decoder = Decoder::new(model, values)?;
    let mut next = NextLogits::Cached(Box::new(decoder));
    let mut bytes = Vec::new();
    let prompt = tokenizer.start_of_text();
    continue_text(&mut next, tokenizer, &prompt, max_tokens, sampling, |t| {
        bytes.extend_from_slice(&tokenizer.bytes(t));
        Ok::<(), anyhow::Error>(())
    })?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    ensure!(
        !(args.no_cache && args.device.is_cuda()),
        "--no-cache runs the model's forward on the CPU: drop --device {} (or --no-cache)",
        args.device
    );
    // A GPU that cannot be used is said before the checkpoint is read.
    check_device(args.device)?;
    let checkpoint = crate::export::whole_checkpoint(&args.checkpoint)?;
    let cfg = crate::export::run_config(&checkpoint)?;
    let Some(lm) = cfg.model.language() else {
        bail!(
            "{} holds an image model: generate needs a language model (GPT or Llama)",
            checkpoint.display()
        );
    };
    ensure!(args.max_tokens > 0, "--max-tokens must be at least 1");
    ensure!(
        args.temperature.is_finite() && args.temperature >= 0.0,
        "--temperature must be 0 (always the likeliest token) or positive, got {}",
        args.temperature
    );
    let tokenizer = match &args.encoding {
        Some(name) => Tokenizer::named(name)?,
        None => match &args.tokenizer {
            Some(path) => Tokenizer::Hf(Box::new(HfTokenizer::open(path)?)),
            None => Tokenizer::of_run(&cfg)?,
        },
    };
    tokenizer.check_fits(lm.vocab)?;
    let (model, mut store) = load_weights(&checkpoint, &cfg)?;
    let prompt = tokenizer.encode(&args.prompt)?;
    ensure!(!prompt.is_empty(), "the prompt is empty");
    if let Some(&t) = prompt.iter().find(|&&t| t as usize >= lm.vocab) {
        bail!(
            "the prompt's token {t} is outside the model's vocabulary of {}",
            lm.vocab
        );
    }
    let mut device = Device::Cpu.to_string();
    let mut next = if args.no_cache {
        NextLogits::Window {
            model: &model,
            store: &mut store,
            vocab: lm.vocab,
            seq: lm.seq,
        }
    } else {
        let decoder = Box::new(Decoder::on(args.device, &model, &store.values)?);
        device = decoder.device();
        let cpu = if args.compare_cpu {
            Some(Box::new(Decoder::new(&model, &store.values)?))
        } else {
            None
        };
        match cpu {
            Some(cpu) => NextLogits::Compared {
                decoder,
                cpu,
                compared: Comparison::default(),
            },
            None => NextLogits::Cached(decoder),
        }
    };
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", args.prompt)?;
    // Bytes not yet printed: a character's bytes may come in several tokens.
    let mut pending: Vec<u8> = Vec::new();
    let started = Instant::now();
    let drawn = continue_text(
        &mut next,
        &tokenizer,
        &prompt,
        args.max_tokens,
        sampling,
        |token| {
            pending.extend_from_slice(&tokenizer.bytes(token));
            let valid = match std::str::from_utf8(&pending) {
                Ok(s) => s.len(),
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                Err(_) => pending.len(),
            };
            out.write_all(&pending[..valid])?;
            out.flush()?;
            pending.drain(..valid);
            Ok::<(), anyhow::Error>(())
        },
    )?;
    let seconds = started.elapsed().as_secs_f64();
    out.write_all(&pending)?;
    writeln!(out)?;
    eprintln!(
        "generated {drawn} tokens in {seconds:.3} s ({:.0} tokens/s on {device}, {})",
        drawn as f64 / seconds.max(1e-9),
        if args.no_cache {
            "no cache: a forward over the window per token"
        } else if args.compare_cpu {
            "key/value cache, and the CPU's beside it"
        } else {
            "key/value cache"
        }
    );
    if let NextLogits::Compared { compared, .. } = &next {
        eprintln!(
            "logits on {device} against the CPU's: largest relative difference {:.2e} over {} \
             steps; the likeliest token differs at {} of them",
            compared.worst, compared.steps, compared.argmax_differs
        );
    }
    Ok(())
}
