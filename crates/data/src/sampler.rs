//! The distributed sampler: each data-parallel rank gets a disjoint shard of every epoch.
//!
//! PyTorch's `DistributedSampler` semantics: one seeded permutation per epoch (the same on every
//! rank, so no communication), made a multiple of the world size by padding with its own first
//! samples or by dropping its tail, then dealt out round-robin: rank `r` takes positions
//! `r, r + W, r + 2W, ...`. Round-robin matters for equivalence with a single worker: the
//! `s`-th local batch of `b` samples on every rank together form positions `[s·b·W, (s+1)·b·W)`
//! of the epoch order — exactly the single worker's `s`-th batch of `B = b·W` samples.

use crate::batching::EpochShuffler;
use crate::error::DataError;
use std::ops::Range;

/// What to do with the samples that do not divide evenly among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    /// Repeat the epoch's first samples so every rank gets the same count (PyTorch's default).
    Pad,
    /// Leave the last `len % world` samples of the epoch out.
    DropLast,
}

/// Gives rank `rank` of `world` its shard of each epoch; call [`DistributedSampler::set_epoch`]
/// at the start of every epoch, as with PyTorch, or every epoch repeats the same order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    world: usize,
    rank: usize,
    shuffler: Option<EpochShuffler>,
    tail: Tail,
    epoch: u64,
}

impl DistributedSampler {
    /// A shuffling sampler over `len` samples with `tail` handling. Errors on an empty dataset,
    /// a zero world or a rank outside it.
    pub fn new(
        len: usize,
        world: usize,
        rank: usize,
        seed: u64,
        tail: Tail,
    ) -> Result<Self, DataError> {
        if world == 0 || rank >= world {
            return Err(DataError::InvalidArgument(format!(
                "rank {rank} is not in a world of {world}"
            )));
        }
        if len == 0 || (tail == Tail::DropLast && len < world) {
            return Err(DataError::InvalidArgument(format!(
                "cannot shard {len} samples over {world} ranks ({tail:?})"
            )));
        }
        Ok(DistributedSampler {
            len,
            world,
            rank,
            shuffler: Some(EpochShuffler::new(len, seed)),
            tail,
            epoch: 0,
        })
    }

    /// Keep the dataset order (evaluation).
    pub fn without_shuffle(mut self) -> Self {
        self.shuffler = None;
        self
    }

    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Samples every rank gets per epoch (the same on all ranks).
    pub fn num_samples(&self) -> usize {
        match self.tail {
            Tail::Pad => self.len.div_ceil(self.world),
            Tail::DropLast => self.len / self.world,
        }
    }

    /// This rank's indices for the current epoch, in the order to visit them.
    pub fn indices(&self) -> Vec<usize> {
        let mut order = match &self.shuffler {
            Some(s) => s.permutation(self.epoch),
            None => (0..self.len).collect(),
        };
        let total = self.num_samples() * self.world;
        if total > order.len() {
            let missing = total - order.len();
            // Padding may need more than one copy when the dataset is smaller than the world.
            let extra: Vec<usize> = order.iter().copied().cycle().take(missing).collect();
            order.extend(extra);
        }
        order.truncate(total);
        order
            .into_iter()
            .skip(self.rank)
            .step_by(self.world)
            .collect()
    }
}

/// The contiguous part of `0..len` that `rank` evaluates: shards differ by at most one sample
/// and together cover every sample exactly once (no padding, so metrics are exact).
pub fn eval_shard(len: usize, rank: usize, world: usize) -> Result<Range<usize>, DataError> {
    if world == 0 || rank >= world {
        return Err(DataError::InvalidArgument(format!(
            "rank {rank} is not in a world of {world}"
        )));
    }
    let (base, extra) = (len / world, len % world);
    let start = rank * base + rank.min(extra);
    Ok(start..start + base + usize::from(rank < extra))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shards(len: usize, world: usize, tail: Tail, epoch: u64) -> Vec<Vec<usize>> {
        (0..world)
            .map(|r| {
                let mut s = DistributedSampler::new(len, world, r, 7, tail).unwrap();
                s.set_epoch(epoch);
                s.indices()
            })
            .collect()
    }

    #[test]
    fn shards_are_disjoint_and_cover_the_epoch_when_dropping() {
        let parts = shards(103, 4, Tail::DropLast, 2);
        assert!(parts.iter().all(|p| p.len() == 25));
        let mut all: Vec<usize> = parts.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 100, "disjoint");
        let order = EpochShuffler::new(103, 7).permutation(2);
        let mut expect = order[..100].to_vec();
        expect.sort_unstable();
        assert_eq!(all, expect, "the first 100 of the epoch order");
    }

    #[test]
    fn padding_repeats_the_first_samples_and_covers_everything() {
        let parts = shards(10, 4, Tail::Pad, 0);
        assert!(parts.iter().all(|p| p.len() == 3));
        let order = EpochShuffler::new(10, 7).permutation(0);
        let mut all: Vec<usize> = parts.concat();
        all.sort_unstable();
        let mut expect: Vec<usize> = order.iter().chain(&order[..2]).copied().collect();
        expect.sort_unstable();
        assert_eq!(all, expect);
        // Fewer samples than ranks still gives every rank one sample.
        assert!(shards(2, 4, Tail::Pad, 0).iter().all(|p| p.len() == 1));
    }

    #[test]
    fn local_batches_together_form_the_single_worker_batch() {
        let (len, world, b) = (64, 4, 3);
        let single = EpochShuffler::new(len, 7).permutation(1);
        let parts = shards(len, world, Tail::DropLast, 1);
        for step in 0..len / (b * world) {
            let mut global: Vec<usize> = parts
                .iter()
                .flat_map(|p| p[step * b..(step + 1) * b].iter().copied())
                .collect();
            global.sort_unstable();
            let mut expect = single[step * b * world..(step + 1) * b * world].to_vec();
            expect.sort_unstable();
            assert_eq!(global, expect, "step {step}");
        }
    }

    #[test]
    fn set_epoch_changes_the_order_and_no_shuffle_keeps_it() {
        let mut s = DistributedSampler::new(50, 2, 1, 3, Tail::Pad).unwrap();
        let e0 = s.indices();
        s.set_epoch(1);
        assert_ne!(e0, s.indices());
        let plain = DistributedSampler::new(5, 2, 1, 3, Tail::Pad)
            .unwrap()
            .without_shuffle();
        assert_eq!(plain.indices(), [1, 3, 0]);
    }

    #[test]
    fn eval_shards_count_every_sample_once() {
        for world in 1..6 {
            let parts: Vec<Range<usize>> = (0..world)
                .map(|r| eval_shard(10, r, world).unwrap())
                .collect();
            assert_eq!(parts.iter().map(|r| r.len()).sum::<usize>(), 10);
            assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
        }
        assert!(eval_shard(10, 3, 3).is_err());
    }

    #[test]
    fn bad_worlds_are_errors() {
        assert!(DistributedSampler::new(10, 0, 0, 1, Tail::Pad).is_err());
        assert!(DistributedSampler::new(10, 2, 2, 1, Tail::Pad).is_err());
        assert!(DistributedSampler::new(0, 2, 0, 1, Tail::Pad).is_err());
        assert!(DistributedSampler::new(1, 2, 0, 1, Tail::DropLast).is_err());
    }
}
