//! The built-in models and tasks: what `meshtrain train` builds from a config's `[model]`
//! table. They go through the library's public API like any user's model and data.

use crate::config::{Config, ModelConfig};
use anyhow::{Context, Result};
use meshtrain_data::{
    unigram_entropy_nats, FashionMnist, ImageDataset, Normalization, ResolveOptions, TextCorpus,
};
use meshtrain_nn::models::{gpt, lenet, resnet};
use meshtrain_nn::{CrossEntropy, Loss, Model};
use meshtrain_train::{Dataset, EvalPlan, EvalSpec, ImageData, Sampling, TextWindows};
use std::sync::Arc;

pub fn build_model(cfg: &ModelConfig) -> Model {
    match cfg {
        ModelConfig::Lenet { variant } => lenet::lenet(*variant),
        ModelConfig::Resnet18 { width } => resnet::resnet18(*width, 10),
        ModelConfig::Gpt(g) => gpt::gpt(g),
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
}

/// Images evaluate in batches of this many.
const EVAL_BATCH: usize = 500;
/// Text evaluates on fixed windows drawn from generators seeded from here.
const EVAL_SEED: u64 = 0xE7A1;

impl Task {
    /// Fashion-MNIST for the image models (the subset shipped in the repository if nothing
    /// better is found), the Shakespeare bytes for GPT.
    pub fn load(cfg: &Config) -> Result<Task> {
        Ok(match &cfg.model {
            ModelConfig::Gpt(g) => {
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
                    eval: Some(EvalSpec {
                        data: Arc::new(TextWindows::bytes(
                            "Shakespeare validation",
                            &corpus.val,
                            g.seq,
                        )),
                        plan: EvalPlan::Random {
                            batches: cfg.train.eval_batches.max(1),
                            batch_size: cfg.train.batch_size,
                            seed: EVAL_SEED,
                        },
                        accuracy: false,
                        perplexity: true,
                        baseline: Some(unigram_entropy_nats(&corpus.val)),
                    }),
                    loss: Arc::new(CrossEntropy::new(g.vocab)),
                    source,
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
                }
            }
        })
    }
}

fn truncate(d: &mut ImageDataset, n: usize) {
    let n = n.min(d.n);
    d.images.truncate(n * d.sample_len());
    d.labels.truncate(n);
    d.n = n;
}
