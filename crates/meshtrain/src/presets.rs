//! The built-in models and tasks: what `meshtrain train` builds from a config's `[model]`
//! table. They go through the library's public API like any user's model and data.

use crate::config::{Config, LanguageShape, ModelConfig};
use crate::generate::Tokenizer;
use crate::tokenize::HfTokenizer;
use anyhow::{Context, Result};
use meshtrain_data::{
    unigram_entropy_nats, unigram_entropy_of_tokens, FashionMnist, ImageDataset, Normalization,
    ResolveOptions, TextCorpus,
};
use meshtrain_nn::models::{gpt, lenet, llama, resnet};
use meshtrain_nn::{CrossEntropy, Loss, Model};
use meshtrain_train::{Dataset, EvalPlan, EvalSpec, ImageData, Sampling, TextWindows, TokenFiles};
use std::sync::Arc;

pub fn build_model(cfg: &ModelConfig) -> Model {
    match cfg {
        ModelConfig::Lenet { variant } => lenet::lenet(*variant),
        ModelConfig::Resnet18 { width } => resnet::resnet18(*width, 10),
        ModelConfig::Gpt(g) => gpt::gpt(g),
        ModelConfig::Llama(l) => llama::llama(l),
    }
}

/// The data of a built-in run: the training set and how it is sampled, the evaluation set,
/// and the loss.
#[derive(Clone)]
pub struct Task {
    pub train: Arc<dyn Dataset>,
    pub sampling: Sampling,
    pub eval: Option<EvalSpec>,
    pub loss: Arc<dyn Loss>,
    /// Where the data came from, for the run's first line.
    pub source: String,
    /// The run's `data.tokenizer`, opened once to check the data against it and kept for the
    /// samples at evaluation (a Llama 3 `tokenizer.json` is 9 MB of JSON to parse).
    pub tokenizer: Option<Arc<Tokenizer>>,
}

/// Images evaluate in batches of this many.
const EVAL_BATCH: usize = 500;
/// Text evaluates on fixed windows drawn from generators seeded from here.
const EVAL_SEED: u64 = 0xE7A1;

impl Task {
    /// Fashion-MNIST for the image models (the subset shipped in the repository if nothing
    /// better is found); for language models the token files of `data.train_files`, else the
    /// Shakespeare bytes.
    pub fn load(cfg: &Config) -> Result<Task> {
        Ok(match cfg.model.language() {
            Some(g) if cfg.data.train_files.is_some() => token_files(cfg, g)?,
            Some(g) => {
                let tokenizer = match &cfg.data.tokenizer {
                    Some(path) => {
                        let text = ("the built-in Shakespeare text".to_string(), BYTES);
                        Some(tokenizer_fits_data(path, [text])?)
                    }
                    None => None,
                };
                let corpus = TextCorpus::shakespeare().context("loading the Shakespeare corpus")?;
                let source = format!(
                    "Shakespeare bytes ({} train / {} validation)",
                    corpus.train.len(),
                    corpus.val.len()
                );
                Task {
                    train: Arc::new(TextWindows::bytes(
                        "Shakespeare train",
                        &corpus.train,
                        g.seq,
                    )),
                    sampling: Sampling::Random,
                    eval: Some(text_eval(
                        cfg,
                        Arc::new(TextWindows::bytes(
                            "Shakespeare validation",
                            &corpus.val,
                            g.seq,
                        )),
                        unigram_entropy_nats(&corpus.val),
                    )),
                    loss: Arc::new(CrossEntropy::new(g.vocab)),
                    source,
                    tokenizer,
                }
            }
            _ => {
                let opts = ResolveOptions::from_env(cfg.data.data_dir.clone());
                let mut data = FashionMnist::load(&opts, Normalization::FASHION_MNIST)
                    .context("loading Fashion-MNIST")?;
                if let Some(n) = cfg.data.train_limit {
                    truncate(&mut data.train, n);
                }
                if let Some(n) = cfg.data.test_limit {
                    truncate(&mut data.test, n);
                }
                let source = format!(
                    "Fashion-MNIST from {} ({} train / {} test images)",
                    data.source, data.train.n, data.test.n
                );
                Task {
                    train: Arc::new(ImageData::new("Fashion-MNIST train", data.train)),
                    sampling: Sampling::Epochs,
                    eval: Some(EvalSpec {
                        data: Arc::new(ImageData::new("Fashion-MNIST test", data.test)),
                        plan: EvalPlan::All { batch: EVAL_BATCH },
                        accuracy: true,
                        perplexity: false,
                        baseline: None,
                    }),
                    loss: Arc::new(CrossEntropy::new(10)),
                    source,
                    tokenizer: None,
                }
            }
        })
    }
}

/// A language model on token shards (`data.train_files`, `data.val_files`: `meshtrain tokenize`'s or
/// llm.c's), windows drawn at random as for the built-in text.
fn token_files(cfg: &Config, g: LanguageShape) -> Result<Task> {
    let pattern = cfg.data.train_files.as_deref().unwrap_or_default();
    let train = TokenFiles::open("train shards", pattern, g.seq, g.vocab)
        .with_context(|| format!("data.train_files = \"{pattern}\""))?;
    let mut source = format!("token files {pattern} ({})", train.describe());
    let val = match cfg.data.val_files.as_deref() {
        Some(pattern) => {
            let val = TokenFiles::open("validation shards", pattern, g.seq, g.vocab)
                .with_context(|| format!("data.val_files = \"{pattern}\""))?;
            source += &format!("; validation {pattern} ({})", val.describe());
            Some(val)
        }
        None => None,
    };
    let tokenizer = match &cfg.data.tokenizer {
        Some(path) => {
            let shards = std::iter::once(&train).chain(&val);
            let recorded = shards.flat_map(|files| files.recorded_vocabularies());
            Some(tokenizer_fits_data(
                path,
                recorded.map(|(path, vocab)| (path.display().to_string(), vocab)),
            )?)
        }
        None => None,
    };
    let eval = val.map(|val| {
        let baseline = unigram_entropy_of_tokens(val.tokens());
        text_eval(cfg, Arc::new(val), baseline)
    });
    Ok(Task {
        train: Arc::new(train),
        sampling: Sampling::Random,
        eval,
        loss: Arc::new(CrossEntropy::new(g.vocab)),
        source,
        tokenizer,
    })
}

/// The vocabulary of the built-in text: its bytes.
const BYTES: usize = 256;

/// The run decodes with `tokenizer` (`data.tokenizer`, or the tokenizer.json of the
/// `--init-from` directory): the data must be written in its ids, or every id would be read
/// as another word (shards of GPT-2's BPE fine-tuning a Llama 3 that came with its own
/// tokenizer). A shard records the vocabulary size of the tokenizer that wrote it, and the
/// built-in text is bytes, so a size that differs is a refusal before any work, with the
/// command that writes the data in this tokenizer's ids. Returns the tokenizer, opened.
fn tokenizer_fits_data(
    tokenizer: &std::path::Path,
    data: impl IntoIterator<Item = (String, usize)>,
) -> Result<Arc<Tokenizer>> {
    let opened = HfTokenizer::open(tokenizer).context("data.tokenizer")?;
    let vocab = opened.vocab;
    let Some((data, data_vocab)) = data.into_iter().find(|&(_, v)| v != vocab) else {
        return Ok(Arc::new(Tokenizer::Hf(Box::new(opened))));
    };
    let written_by = match crate::tokenize::encoding_of_vocab(data_vocab) {
        _ if data_vocab == BYTES => "bytes".to_string(),
        Some(name) => format!("{name}'s BPE"),
        None => "another tokenizer".to_string(),
    };
    anyhow::bail!(
        "the run decodes with {} ({vocab} ids; data.tokenizer, or the --init-from directory's), \
         but {data} is in {data_vocab} ids ({written_by}): its ids would be read as other \
         words. Write the corpus in this tokenizer's ids with `meshtrain tokenize --tokenizer \
         {} --input YOUR_TEXT --out DIR` and train on DIR/train_*.bin, or set data.tokenizer \
         to the tokenizer that wrote the data",
        tokenizer.display(),
        tokenizer.display()
    )
}

/// Evaluation on windows of a text: fixed random windows, the loss as perplexity beside the
/// unigram `baseline`.
fn text_eval(cfg: &Config, data: Arc<dyn Dataset>, baseline: f64) -> EvalSpec {
    EvalSpec {
        data,
        plan: EvalPlan::Random {
            batches: cfg.train.eval_batches.max(1),
            batch_size: cfg.train.batch_size,
            seed: EVAL_SEED,
        },
        accuracy: false,
        perplexity: true,
        baseline: Some(baseline),
    }
}

fn truncate(d: &mut ImageDataset, n: usize) {
    let n = n.min(d.n);
    d.images.truncate(n * d.sample_len());
    d.labels.truncate(n);
    d.n = n;
}
