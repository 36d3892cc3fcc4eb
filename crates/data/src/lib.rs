//! meshtrain-data: the datasets meshtrain trains on, with no network needed.
//!
//! * [`fashion`]: Fashion-MNIST from its IDX `.gz` files, found in an
//!   explicit directory, Debian's package, a download cache (downloading with
//!   `curl`/`wget` if allowed) or the subset shipped in the repository, and
//!   always SHA-256 verified.
//! * [`text`]: a byte-level Shakespeare corpus with a seeded batch sampler
//!   and its unigram-entropy baseline.
//! * [`batching`] and [`rng`]: deterministic epoch shuffling on a tiny
//!   platform-independent RNG that other crates may reuse.
//!
//! Sources, checksums and licences: `docs/data.md`.

pub mod batching;
pub mod download;
pub mod error;
pub mod fashion;
pub mod idx;
pub mod images;
pub mod sampler;
pub mod shards;
pub mod text;

pub use batching::{rank_share, EpochBatches, EpochShuffler};
pub use error::DataError;
pub use fashion::{load_split, resolve, FashionMnist, ResolveOptions, Source, Split};
pub use images::{ImageDataset, Normalization};
pub use meshtrain_tensor::rng::SplitMix64;
pub use sampler::{eval_shard, DistributedSampler, Tail};
pub use shards::{open_shards, write_shard, ShardError, TokenShard};
pub use text::{
    unigram_entropy_nats, unigram_entropy_of_tokens, TextBatchSampler, TextCorpus, VOCAB_SIZE,
};
