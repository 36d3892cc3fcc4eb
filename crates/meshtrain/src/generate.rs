//! `meshtrain generate`: text from a trained GPT checkpoint, tokens printed as they come.
//!
//! The checkpoint carries the run's config, so the model is rebuilt from it and its weights
//! loaded; the tokens are decoded with what the run trained on: bytes for the built-in text,
//! or the BPE whose vocabulary the run's token shards record. Each new token comes from one
//! forward pass over the last `seq` tokens (the model's context), with temperature and top-k
//! sampling from a seeded generator; there is no key/value cache yet, so a token costs a
//! whole window's forward (fine for the models this CPU trains; the cache is issue 29's
//! remaining work).

use crate::config::Config;
use crate::presets::build_model;
use crate::tokenize::{encoding, encoding_of_vocab, Encoding};
use anyhow::{bail, ensure, Context, Result};
use meshtrain_nn::optim::{Optimizer, OptimizerConfig};
use meshtrain_nn::{Mode, Model, ParamStore};
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;
use meshtrain_train::checkpoint::{self, Restore};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A checkpoint of a GPT run (checkpoint.safetensors; a sharded one: consolidate it first
    /// with `meshtrain checkpoint consolidate`).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The text to continue.
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub max_tokens: usize,
    /// Softmax temperature: below 1 sharper, above 1 flatter; 0 picks the likeliest token.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Sample among the K likeliest tokens only (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The tokens the model was trained on: bytes, gpt2 or cl100k (default: what the run's
    /// data was).
    #[arg(long, value_parser = ["bytes", "gpt2", "cl100k"])]
    pub encoding: Option<String>,
}

/// Text to tokens and back.
enum Tokenizer {
    Bytes,
    /// A BPE: generation never draws its special tokens but the end of text, and stops there.
    Bpe(Box<Encoding>),
}

impl Tokenizer {
    fn named(name: &str) -> Result<Tokenizer> {
        Ok(match name {
            "bytes" => Tokenizer::Bytes,
            name => Tokenizer::Bpe(Box::new(encoding(name)?)),
        })
    }

    /// What a run trained on: its token shards' vocabulary, or bytes.
    fn of_run(cfg: &Config) -> Result<Tokenizer> {
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
                 --encoding"
            ),
        }
    }

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
        }
    }

    /// The token a candidate index stands for, or `None` for the end of text.
    fn token(&self, candidate: usize) -> Option<u32> {
        match self {
            Tokenizer::Bpe(enc) if candidate >= enc.ordinary => None,
            _ => Some(candidate as u32),
        }
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
            Tokenizer::Bpe(enc) => enc.bpe.encode_ordinary(text),
        }
    }

    fn bytes(&self, token: u32) -> Vec<u8> {
        match self {
            Tokenizer::Bytes => vec![token as u8],
            // An ordinary token (see `candidates`): always in the decoder.
            Tokenizer::Bpe(enc) => (enc.bpe)
                ._decode_native_and_split(vec![token])
                .next()
                .unwrap_or_default(),
        }
    }
}

/// The index of the token drawn from `logits` at `temperature` among the `top_k` likeliest.
pub fn sample(logits: &[f32], temperature: f32, top_k: usize, rng: &mut SplitMix64) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if temperature <= 0.0 {
        return order[0];
    }
    if top_k > 0 {
        order.truncate(top_k);
    }
    let top = logits[order[0]];
    let weights: Vec<f64> = (order.iter())
        .map(|&i| (f64::from(logits[i] - top) / f64::from(temperature)).exp())
        .collect();
    let mut draw = rng.next_f64() * weights.iter().sum::<f64>();
    for (&i, w) in order.iter().zip(&weights) {
        if draw < *w {
            return i;
        }
        draw -= w;
    }
    order[order.len() - 1]
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

pub fn run(args: &GenerateArgs) -> Result<()> {
    let header = checkpoint::read_safetensors_header(&args.checkpoint, "checkpoint")?;
    let config_text = header
        .entries
        .get("__metadata__")
        .and_then(|m| m["config"].as_str());
    let Some(config_text) = config_text.filter(|t| !t.is_empty()) else {
        bail!(
            "checkpoint {} holds no run config to rebuild its model from",
            args.checkpoint.display()
        );
    };
    let cfg = Config::from_toml_with_overrides(config_text, &[])
        .context("the run config stored in the checkpoint")?;
    let Some(gpt) = cfg.model.language() else {
        bail!(
            "{} holds an image model: generate needs a language model (GPT or Llama)",
            args.checkpoint.display()
        );
    };
    ensure!(args.max_tokens > 0, "--max-tokens must be at least 1");
    let tokenizer = match &args.encoding {
        Some(name) => Tokenizer::named(name)?,
        None => Tokenizer::of_run(&cfg)?,
    };
    let (model, mut store) = load_weights(&args.checkpoint, &cfg)?;
    let mut tokens = tokenizer.encode(&args.prompt);
    ensure!(!tokens.is_empty(), "the prompt is empty");
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= gpt.vocab) {
        bail!(
            "the prompt's token {t} is outside the model's vocabulary of {}",
            gpt.vocab
        );
    }
    let mut rng = SplitMix64::new(args.seed);
    let mut out = std::io::stdout().lock();
    write!(out, "{}", args.prompt)?;
    // Bytes not yet printed: a character's bytes may come in several tokens.
    let mut pending: Vec<u8> = Vec::new();
    for _ in 0..args.max_tokens {
        let window = &tokens[tokens.len().saturating_sub(gpt.seq)..];
        let x = Tensor::from_vec(
            window.iter().map(|&t| t as f32).collect(),
            &[1, window.len()],
        );
        let (logits, _) = model.forward_all(&mut store, x, Mode::EVAL);
        let logits = logits.data();
        let last = &logits[logits.len() - gpt.vocab..];
        let candidates = tokenizer.candidates(last);
        let drawn = sample(&candidates, args.temperature, args.top_k, &mut rng);
        let Some(next) = tokenizer.token(drawn) else {
            break; // the end of text
        };
        tokens.push(next);
        pending.extend(tokenizer.bytes(next));
        let valid = match std::str::from_utf8(&pending) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => pending.len(),
        };
        out.write_all(&pending[..valid])?;
        out.flush()?;
        pending.drain(..valid);
    }
    out.write_all(&pending)?;
    writeln!(out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_follows_temperature_and_top_k() {
        let logits = [0.0, 3.0, 1.0, 2.9];
        let mut rng = SplitMix64::new(1);
        assert_eq!(sample(&logits, 0.0, 0, &mut rng), 1, "greedy");
        let mut counts = [0; 4];
        for _ in 0..4000 {
            counts[sample(&logits, 1.0, 2, &mut rng)] += 1;
        }
        assert_eq!(
            (counts[0], counts[2]),
            (0, 0),
            "outside the top 2: {counts:?}"
        );
        // e^3 : e^2.9 ≈ 1.105 : 1.
        let ratio = counts[1] as f64 / counts[3] as f64;
        assert!((ratio - 1.105).abs() < 0.12, "{counts:?}");
    }
}
