//! Datasets: anything with a length that can fill a batch from sample indices.
//!
//! The trainer decides which indices each worker loads at each step ([`Sampling`]); a
//! [`Dataset`] only copies those samples into the buffers it is given. Inputs are float
//! features or integer token ids ([`Inputs`]): token ids stay integers up to the dataset,
//! and the trainer checks them against the model's vocabulary before they reach it.
//!
//! Two adapters cover the built-in tasks and many users' data: [`ImageData`] (an in-memory
//! labelled image set) and [`TextWindows`] (next-token prediction over windows of a token
//! stream).

use meshtrain_data::{ImageDataset, SplitMix64};
use meshtrain_nn::InputSpec;
use std::sync::Arc;

/// Any error a dataset reports (it is shown with the dataset's name and the indices).
pub type DatasetError = Box<dyn std::error::Error + Send + Sync>;

/// The input buffer of a batch, in the dataset's input kind.
pub enum Inputs<'a> {
    /// `samples × sample_len` floats.
    Float(&'a mut [f32]),
    /// `samples × sample_len` token ids.
    Tokens(&'a mut [u32]),
}

/// Where a dataset writes a batch: inputs, and `samples × targets_per_sample` targets.
pub struct BatchMut<'a> {
    pub inputs: Inputs<'a>,
    pub targets: &'a mut [u32],
}

/// A dataset of samples `0..len()`, each an input (see [`Dataset::input`]) and
/// [`Dataset::targets_per_sample`] integer targets.
pub trait Dataset: Send + Sync {
    /// A name for messages and the run's first line.
    fn name(&self) -> String;

    /// Number of samples.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What one sample's input is; the trainer checks it against the model before any work.
    fn input(&self) -> InputSpec;

    /// Integer targets per sample: 1 for classification, the sequence length for
    /// next-token prediction.
    fn targets_per_sample(&self) -> usize {
        1
    }

    /// Writes samples `indices`, in order, into `batch` (whose buffers have exactly the room
    /// `indices.len()` samples need).
    fn fill(&self, indices: &[usize], batch: BatchMut<'_>) -> Result<(), DatasetError>;
}

/// How the samples of each step are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampling {
    /// Epochs of a seeded shuffle without replacement, dealt to the data-parallel replicas
    /// like PyTorch's `DistributedSampler` (incomplete last batches dropped). Image sets.
    Epochs,
    /// Each step's global batch drawn uniformly with replacement from a generator seeded by
    /// `(seed, step)`, replica `r` taking rows `[r·b, (r+1)·b)`. Windows of a long text,
    /// where an epoch means little.
    Random,
}

/// Where the training sampler stands after some steps: stored in every checkpoint and checked
/// on resume. The samples of step `s` are a pure function of the sampling, the seed, the
/// dataset's size and the global batch (not of the world: the replicas' shares of a step
/// always join to the same global batch); a resumed run whose settings changed any of them
/// would silently train on another stream, so a mismatch is an error, not a warning.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SamplerPosition {
    /// `"epochs"` or `"random"` ([`Sampling`]).
    pub sampling: String,
    pub seed: u64,
    pub dataset_len: usize,
    pub global_batch: usize,
    /// Samples drawn so far over all replicas (steps × global batch).
    pub samples_consumed: u64,
    /// The epoch the next step draws from, and how many of its samples were drawn
    /// (epochs only; 0 for random draws).
    pub epoch: u64,
    pub samples_into_epoch: u64,
}

impl SamplerPosition {
    /// The position after `steps` steps of global batch `global_batch` (`steps_per_epoch`:
    /// whole batches per epoch, unused for random draws).
    pub fn after(
        steps: u64,
        sampling: Sampling,
        seed: u64,
        dataset_len: usize,
        global_batch: usize,
        steps_per_epoch: u64,
    ) -> SamplerPosition {
        let (name, epoch, into) = match sampling {
            Sampling::Epochs if steps_per_epoch > 0 => (
                "epochs",
                steps / steps_per_epoch,
                (steps % steps_per_epoch) * global_batch as u64,
            ),
            Sampling::Epochs => ("epochs", 0, 0),
            Sampling::Random => ("random", 0, 0),
        };
        SamplerPosition {
            sampling: name.into(),
            seed,
            dataset_len,
            global_batch,
            samples_consumed: steps * global_batch as u64,
            epoch,
            samples_into_epoch: into,
        }
    }

    /// Checks that a run at `self` continues the stream of the checkpoint `file` that
    /// recorded `saved`: the error names every field that differs.
    pub fn check_continues(
        &self,
        saved: &SamplerPosition,
        file: &std::path::Path,
    ) -> anyhow::Result<()> {
        let fields = |p: &SamplerPosition| {
            [
                ("sampling", p.sampling.clone()),
                ("seed", p.seed.to_string()),
                ("dataset samples", p.dataset_len.to_string()),
                ("global batch", p.global_batch.to_string()),
                ("samples consumed", p.samples_consumed.to_string()),
                ("epoch", p.epoch.to_string()),
                ("samples into the epoch", p.samples_into_epoch.to_string()),
            ]
        };
        let differ: Vec<String> = fields(saved)
            .into_iter()
            .zip(fields(self))
            .filter(|(a, b)| a.1 != b.1)
            .map(|((name, was), (_, now))| {
                format!("{name} {was} in the checkpoint, {now} in this run")
            })
            .collect();
        anyhow::ensure!(
            differ.is_empty(),
            "sampler position mismatch: checkpoint {} was written with the data sampler at a \
             position this run does not continue from ({}); resuming would train on other \
             samples than the interrupted run: keep the seed, the dataset and the global batch \
             (train.batch_size) of the run that wrote it, or resume with --reshape to go on \
             with another global batch from the same sample position",
            file.display(),
            differ.join("; ")
        );
        Ok(())
    }
}

/// How an evaluation set is visited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvalPlan {
    /// Every sample once, in order, `batch` at a time; each replica takes a contiguous
    /// share, so every sample counts exactly once.
    All { batch: usize },
    /// `batches` batches of `batch_size` samples drawn uniformly, batch `i` from a generator
    /// seeded by `seed + i` (the same batches at every evaluation); replicas take every
    /// `dp`-th batch.
    Random {
        batches: usize,
        batch_size: usize,
        seed: u64,
    },
}

/// `n` indices below `len` drawn uniformly from a generator seeded by `seed`.
pub fn random_indices(len: usize, n: usize, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.below(len as u64) as usize).collect()
}

/// An in-memory labelled image set (N×C×H×W floats, one class per sample).
pub struct ImageData {
    pub name: String,
    pub images: Arc<ImageDataset>,
}

impl ImageData {
    pub fn new(name: &str, images: ImageDataset) -> Self {
        ImageData {
            name: name.to_string(),
            images: Arc::new(images),
        }
    }
}

impl Dataset for ImageData {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn len(&self) -> usize {
        self.images.n
    }

    fn input(&self) -> InputSpec {
        let d = &self.images;
        InputSpec::float(&[d.channels, d.height, d.width])
    }

    fn fill(&self, indices: &[usize], batch: BatchMut<'_>) -> Result<(), DatasetError> {
        match batch.inputs {
            Inputs::Float(x) => Ok(self.images.batch(indices, x, batch.targets)?),
            Inputs::Tokens(_) => Err("image data has float inputs".into()),
        }
    }
}

/// Next-token prediction over a token stream: sample `i` is the window `tokens[i..i+seq]`
/// and its targets `tokens[i+1..i+seq+1]`, so there are `len − seq` samples.
pub struct TextWindows {
    pub name: String,
    pub tokens: Arc<Vec<u32>>,
    pub seq: usize,
    pub vocab: usize,
}

impl TextWindows {
    /// Windows of `seq` bytes of `bytes` (a byte-level vocabulary of 256).
    pub fn bytes(name: &str, bytes: &[u8], seq: usize) -> Self {
        TextWindows {
            name: name.to_string(),
            tokens: Arc::new(bytes.iter().map(|&b| u32::from(b)).collect()),
            seq,
            vocab: 256,
        }
    }
}

impl Dataset for TextWindows {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn len(&self) -> usize {
        self.tokens.len().saturating_sub(self.seq)
    }

    fn input(&self) -> InputSpec {
        InputSpec::tokens(self.seq, self.vocab)
    }

    fn targets_per_sample(&self) -> usize {
        self.seq
    }

    fn fill(&self, indices: &[usize], batch: BatchMut<'_>) -> Result<(), DatasetError> {
        fill_windows(self.len(), self.seq, indices, batch, |i, window| {
            window.copy_from_slice(&self.tokens[i..i + self.seq + 1]);
        })
    }
}

/// Windows of `seq` tokens (and their next-token targets) from memory-mapped token shards
/// ([`meshtrain_data::shards`]): every position of every shard where a window and its targets
/// fit is a sample; a window never crosses from one shard into the next.
pub struct TokenFiles {
    pub name: String,
    shards: Vec<meshtrain_data::TokenShard>,
    /// Samples before each shard's first, and after the last (prefix sums).
    starts: Vec<usize>,
    pub seq: usize,
    pub vocab: usize,
}

impl TokenFiles {
    /// The shards `pattern` names, for a model of `vocab` tokens and `seq` positions: every
    /// token is checked against the vocabulary (an error names the file and the offset).
    pub fn open(name: &str, pattern: &str, seq: usize, vocab: usize) -> anyhow::Result<Self> {
        let shards = meshtrain_data::open_shards(pattern)?;
        let mut starts = vec![0];
        for shard in &shards {
            shard.check_vocab(vocab)?;
            let windows = shard.len().saturating_sub(seq);
            starts.push(starts.last().unwrap() + windows);
        }
        anyhow::ensure!(
            *starts.last().unwrap() > 0,
            "{pattern}: no shard holds more than {seq} tokens (one window and its targets)"
        );
        Ok(TokenFiles {
            name: name.to_string(),
            shards,
            starts,
            seq,
            vocab,
        })
    }

    /// The shards whose headers record the vocabulary size of the tokenizer that wrote them
    /// (meshtrain's do; llm.c's record none), each with that size.
    pub fn recorded_vocabularies(&self) -> impl Iterator<Item = (&std::path::Path, usize)> {
        (self.shards.iter())
            .filter(|shard| shard.vocab > 0)
            .map(|shard| (shard.path.as_path(), shard.vocab))
    }

    /// The tokens of every shard, in order, read from the maps as they are asked for.
    pub fn tokens(&self) -> impl Iterator<Item = u32> + '_ {
        (self.shards.iter()).flat_map(|shard| (0..shard.len()).map(|i| shard.token(i)))
    }

    /// The files and token count, for the run's first line.
    pub fn describe(&self) -> String {
        let tokens: usize = self.shards.iter().map(|s| s.len()).sum();
        format!("{} shard(s), {tokens} tokens", self.shards.len())
    }
}

impl Dataset for TokenFiles {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn len(&self) -> usize {
        *self.starts.last().unwrap()
    }

    fn input(&self) -> InputSpec {
        InputSpec::tokens(self.seq, self.vocab)
    }

    fn targets_per_sample(&self) -> usize {
        self.seq
    }

    fn fill(&self, indices: &[usize], batch: BatchMut<'_>) -> Result<(), DatasetError> {
        fill_windows(self.len(), self.seq, indices, batch, |i, window| {
            let shard = self.starts.partition_point(|&s| s <= i) - 1;
            self.shards[shard].read(i - self.starts[shard], window);
        })
    }
}

/// Fills `batch` with the windows `indices` of a token stream of `len` windows of `seq`
/// tokens: `read(i, window)` writes window `i`'s `seq + 1` tokens, the inputs and, shifted by
/// one, their next-token targets.
fn fill_windows(
    len: usize,
    seq: usize,
    indices: &[usize],
    batch: BatchMut<'_>,
    read: impl Fn(usize, &mut [u32]),
) -> Result<(), DatasetError> {
    let Inputs::Tokens(x) = batch.inputs else {
        return Err("token windows have token inputs".into());
    };
    let mut window = vec![0u32; seq + 1];
    for ((&i, xr), yr) in indices
        .iter()
        .zip(x.chunks_exact_mut(seq))
        .zip(batch.targets.chunks_exact_mut(seq))
    {
        if i >= len {
            return Err(format!("sample {i} is outside 0..{len}").into());
        }
        read(i, &mut window);
        xr.copy_from_slice(&window[..seq]);
        yr.copy_from_slice(&window[1..]);
    }
    Ok(())
}
