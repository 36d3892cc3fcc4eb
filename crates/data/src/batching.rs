//! Seeded per-epoch shuffling and mini-batch index slices.
//!
//! The order depends only on `(seed, epoch)`, so every rank of a data-parallel
//! job computes the same permutation without communicating, and a resumed run
//! replays the same batches.

use crate::error::DataError;
use meshtrain_tensor::rng::SplitMix64;

/// Produces the sample order for each epoch of a dataset of `len` samples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochShuffler {
    len: usize,
    seed: u64,
}

impl EpochShuffler {
    pub fn new(len: usize, seed: u64) -> Self {
        Self { len, seed }
    }

    /// A permutation of `0..len`, fixed by `(seed, epoch)`.
    pub fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        SplitMix64::derive(self.seed, epoch).shuffle(&mut order);
        order
    }

    /// The epoch's permutation cut into batches of `batch_size`; with
    /// `drop_last` a short final batch is left out.
    pub fn batches(
        &self,
        epoch: u64,
        batch_size: usize,
        drop_last: bool,
    ) -> Result<EpochBatches, DataError> {
        if batch_size == 0 {
            return Err(DataError::InvalidArgument(
                "batch_size must be at least 1".into(),
            ));
        }
        Ok(EpochBatches {
            order: self.permutation(epoch),
            batch_size,
            drop_last,
        })
    }
}

/// One epoch's batches; iterate with [`EpochBatches::iter`].
#[derive(Debug, Clone)]
pub struct EpochBatches {
    order: Vec<usize>,
    batch_size: usize,
    drop_last: bool,
}

impl EpochBatches {
    /// Number of batches this epoch yields.
    pub fn len(&self) -> usize {
        if self.drop_last {
            self.order.len() / self.batch_size
        } else {
            self.order.len().div_ceil(self.batch_size)
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole epoch order (all samples, including a dropped tail).
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// Index slices, one per batch, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[usize]> + '_ {
        self.order.chunks(self.batch_size).take(self.len())
    }
}

/// The contiguous part of a global `batch` that data-parallel `rank` (of
/// `world`) processes. Sizes differ by at most one when `world` does not
/// divide the batch: the first `len % world` ranks get one extra sample.
/// Every rank shuffles identically ([`EpochShuffler`]), so this needs no
/// communication, and the union over ranks is exactly `batch`.
pub fn rank_share(batch: &[usize], rank: usize, world: usize) -> Result<&[usize], DataError> {
    if world == 0 || rank >= world {
        return Err(DataError::InvalidArgument(format!(
            "rank {rank} is not in a world of {world}"
        )));
    }
    let base = batch.len() / world;
    let extra = batch.len() % world;
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    Ok(&batch[start..start + len])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_epoch_same_order_other_epoch_other_order() {
        let shuffler = EpochShuffler::new(1000, 9);
        assert_eq!(shuffler.permutation(3), shuffler.permutation(3));
        assert_ne!(shuffler.permutation(3), shuffler.permutation(4));
        assert_ne!(
            shuffler.permutation(3),
            EpochShuffler::new(1000, 10).permutation(3)
        );
        let mut sorted = shuffler.permutation(0);
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    }

    /// Pinned against the independent Python reference
    /// (crates/data/scripts/splitmix64_reference.py): the order must not
    /// change across platforms or releases, or resumed runs would diverge.
    #[test]
    fn permutation_matches_reference() {
        assert_eq!(
            EpochShuffler::new(10, 1).permutation(0),
            [3, 6, 4, 7, 9, 5, 2, 1, 8, 0]
        );
    }

    #[test]
    fn batches_cover_the_epoch_with_and_without_tail() {
        let shuffler = EpochShuffler::new(10, 1);
        let keep = shuffler.batches(0, 4, false).unwrap();
        let sizes: Vec<usize> = keep.iter().map(<[usize]>::len).collect();
        assert_eq!(sizes, [4, 4, 2]);
        assert_eq!(keep.len(), 3);
        assert_eq!(
            keep.iter().flatten().copied().collect::<Vec<_>>(),
            keep.order()
        );

        let drop = shuffler.batches(0, 4, true).unwrap();
        let sizes: Vec<usize> = drop.iter().map(<[usize]>::len).collect();
        assert_eq!(sizes, [4, 4]);
        assert_eq!(drop.iter().len(), 2);
        assert_eq!(drop.order(), keep.order());
    }

    #[test]
    fn tiny_dataset_with_drop_last_is_empty() {
        let batches = EpochShuffler::new(3, 0).batches(0, 4, true).unwrap();
        assert!(batches.is_empty());
        assert_eq!(batches.iter().count(), 0);
    }

    #[test]
    fn rank_shares_partition_the_batch() {
        let batch: Vec<usize> = (100..110).collect();
        let shares: Vec<&[usize]> = (0..4).map(|r| rank_share(&batch, r, 4).unwrap()).collect();
        assert_eq!(
            shares.iter().map(|s| s.len()).collect::<Vec<_>>(),
            [3, 3, 2, 2]
        );
        assert_eq!(shares.concat(), batch);
        assert_eq!(rank_share(&batch, 0, 1).unwrap(), &batch[..]);
        assert!(rank_share(&batch, 4, 4).is_err());
        assert!(rank_share(&batch, 0, 0).is_err());
    }

    #[test]
    fn zero_batch_size_is_an_error() {
        assert!(matches!(
            EpochShuffler::new(3, 0).batches(0, 0, false),
            Err(DataError::InvalidArgument(_))
        ));
    }
}
