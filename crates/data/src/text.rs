//! Byte-level text corpus for character-level language models (GPT).
//!
//! The vocabulary is the 256 byte values, so there is no tokenizer to ship
//! and the shipped corpus (plain ASCII Shakespeare) needs no preprocessing.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use crate::error::DataError;
use crate::idx::sha256_hex;
use meshtrain_tensor::rng::SplitMix64;

/// Vocabulary size of the byte-level model.
pub const VOCAB_SIZE: usize = 256;

/// Share of the corpus used for training; the rest (the end) is validation.
pub const TRAIN_FRACTION_PERCENT: usize = 90;

/// SHA-256 of `data/shakespeare/input.txt` (1,158,233 bytes), as printed by
/// `crates/data/scripts/make_shakespeare_corpus.py`.
pub const SHAKESPEARE_SHA256: &str =
    "5eeac424fe97e5faeb837f21eb40540cb87fdce41c28ecd7ed24d54c54457d55";

/// Path of the corpus shipped in the repository (`data/shakespeare/input.txt`).
pub fn shipped_shakespeare_path() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    // crates/data -> crates -> repository root
    manifest_dir
        .ancestors()
        .nth(2)
        .unwrap_or(manifest_dir)
        .join("data/shakespeare/input.txt")
}

/// A corpus split into a training prefix and a validation suffix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextCorpus {
    pub train: Vec<u8>,
    pub val: Vec<u8>,
}

impl TextCorpus {
    /// Splits `bytes`: the first 90% (rounded down) train, the rest validate.
    /// A contiguous split (not random lines) keeps validation text unseen.
    pub fn from_bytes(mut bytes: Vec<u8>) -> Self {
        let split = bytes.len() * TRAIN_FRACTION_PERCENT / 100;
        let val = bytes.split_off(split);
        Self { train: bytes, val }
    }

    /// Reads any file as a byte corpus. With `expected_sha256` the content
    /// must match it exactly (used for the shipped corpus).
    pub fn load(path: &Path, expected_sha256: Option<&str>) -> Result<Self, DataError> {
        let bytes = fs::read(path).map_err(|source| match source.kind() {
            ErrorKind::NotFound => DataError::MissingFile {
                path: path.to_path_buf(),
            },
            _ => DataError::Io {
                path: path.to_path_buf(),
                source,
            },
        })?;
        if let Some(expected) = expected_sha256 {
            let actual = sha256_hex(&bytes);
            if actual != expected {
                return Err(DataError::ChecksumMismatch {
                    path: path.to_path_buf(),
                    actual,
                    expected: expected.to_string(),
                });
            }
        }
        Ok(Self::from_bytes(bytes))
    }

    /// The shipped Shakespeare corpus, checksum-verified.
    pub fn shakespeare() -> Result<Self, DataError> {
        Self::load(&shipped_shakespeare_path(), Some(SHAKESPEARE_SHA256))
    }
}

/// Entropy in nats of the byte-frequency (unigram) distribution of `bytes`:
/// the cross-entropy a model that ignores context could at best reach on
/// this text, so GPT's loss is reported against it. 0 for empty input.
pub fn unigram_entropy_nats(bytes: &[u8]) -> f64 {
    unigram_entropy_of_tokens(bytes.iter().map(|&b| u32::from(b)))
}

/// The same for any token ids: the entropy of their frequencies, in nats. Counts are kept
/// per id and summed in id order, so the result is the same bits on every run.
pub fn unigram_entropy_of_tokens(tokens: impl IntoIterator<Item = u32>) -> f64 {
    let mut counts: Vec<u64> = vec![0; VOCAB_SIZE];
    let mut total = 0u64;
    for t in tokens {
        let t = t as usize;
        if t >= counts.len() {
            counts.resize(t + 1, 0);
        }
        counts[t] += 1;
        total += 1;
    }
    let total = total as f64;
    counts
        .iter()
        .filter(|&&count| count > 0)
        .map(|&count| {
            let p = count as f64 / total;
            -p * p.ln()
        })
        .sum()
}

/// Draws `batch_size` windows of `block_size` bytes at random offsets; the
/// target of each input byte is the byte after it.
#[derive(Debug, Clone)]
pub struct TextBatchSampler {
    batch_size: usize,
    block_size: usize,
    rng: SplitMix64,
}

impl TextBatchSampler {
    /// Give each data-parallel rank a different `seed` (e.g. via
    /// [`SplitMix64::derive`]-style mixing of base seed and rank).
    pub fn new(batch_size: usize, block_size: usize, seed: u64) -> Result<Self, DataError> {
        if batch_size == 0 || block_size == 0 {
            return Err(DataError::InvalidArgument(format!(
                "batch_size ({batch_size}) and block_size ({block_size}) must be at least 1"
            )));
        }
        Ok(Self {
            batch_size,
            block_size,
            rng: SplitMix64::new(seed),
        })
    }

    /// Elements per output buffer: `batch_size * block_size`.
    pub fn tokens_per_batch(&self) -> usize {
        self.batch_size * self.block_size
    }

    /// Fills `inputs` and `targets` (each B×T, row-major) from `data`:
    /// row b is `data[s..s+T]` and `data[s+1..s+T+1]` for a random start s.
    pub fn sample(
        &mut self,
        data: &[u8],
        inputs: &mut [u32],
        targets: &mut [u32],
    ) -> Result<(), DataError> {
        let expected = self.tokens_per_batch();
        for (what, buffer) in [("inputs", &*inputs), ("targets", &*targets)] {
            if buffer.len() != expected {
                return Err(DataError::BufferSize {
                    what,
                    expected,
                    actual: buffer.len(),
                });
            }
        }
        let block = self.block_size;
        if data.len() <= block {
            return Err(DataError::TextTooShort {
                len: data.len(),
                needed: block + 1,
            });
        }
        let starts = (data.len() - block) as u64;
        for (x_row, y_row) in inputs
            .chunks_exact_mut(block)
            .zip(targets.chunks_exact_mut(block))
        {
            let start = self.rng.below(starts) as usize;
            let window = &data[start..start + block + 1];
            for (slot, &byte) in x_row.iter_mut().zip(&window[..block]) {
                *slot = u32::from(byte);
            }
            for (slot, &byte) in y_row.iter_mut().zip(&window[1..]) {
                *slot = u32::from(byte);
            }
        }
        Ok(())
    }
}
