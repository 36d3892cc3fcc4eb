//! Cutting a model's block list into contiguous chunks (stages).
//!
//! The slowest stage sets the pipeline's pace, so a partition minimises the largest chunk
//! cost. Cost can be the parameter count (cheap, but convolutions at high resolution cost far
//! more time per parameter than a classifier), a measured time per block
//! ([`profile_block_times`]), or the user's explicit cut points.

use super::PipelineError;
use meshtrain_comm::ProcessGroup;
use meshtrain_nn::{Mode, Model, ParamStore};
use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::Tensor;
use std::ops::Range;
use std::time::Instant;

/// Contiguous, non-empty block ranges covering the model in order; chunk `c` of a schedule
/// runs `chunks()[c]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    chunks: Vec<Range<usize>>,
}

impl Partition {
    /// Cuts before each block index in `cuts` (strictly increasing, inside `1..blocks`):
    /// `cuts = [3, 6]` on 8 blocks gives `0..3, 3..6, 6..8`.
    pub fn explicit(blocks: usize, cuts: &[usize]) -> Result<Partition, PipelineError> {
        let invalid = |reason: &str| PipelineError::InvalidBoundaries {
            cuts: cuts.to_vec(),
            blocks,
            reason: reason.to_string(),
        };
        if blocks == 0 {
            return Err(invalid("the model has no blocks"));
        }
        if cuts.iter().any(|&c| c == 0 || c >= blocks) {
            return Err(invalid("each cut must lie strictly inside the block list"));
        }
        if cuts.windows(2).any(|w| w[0] >= w[1]) {
            return Err(invalid("cuts must be strictly increasing"));
        }
        let edges: Vec<usize> = std::iter::once(0)
            .chain(cuts.iter().copied())
            .chain(std::iter::once(blocks))
            .collect();
        Ok(Partition {
            chunks: edges.windows(2).map(|w| w[0]..w[1]).collect(),
        })
    }

    /// `parts` chunks minimising the largest chunk cost (exact dynamic programme; models have
    /// tens of blocks). Ties go to the earliest cut, so every worker computes the same answer.
    pub fn balanced(costs: &[f64], parts: usize) -> Result<Partition, PipelineError> {
        let n = costs.len();
        if parts == 0 || parts > n {
            return Err(PipelineError::TooFewBlocks {
                blocks: n,
                chunks: parts,
            });
        }
        let prefix: Vec<f64> = std::iter::once(0.0)
            .chain(costs.iter().scan(0.0, |s, &c| {
                *s += c;
                Some(*s)
            }))
            .collect();
        let sum = |a: usize, b: usize| prefix[b] - prefix[a];
        // best[k][i]: smallest possible largest cost of cutting blocks 0..i into k+1 chunks;
        // cut[k][i]: where the last of those chunks starts.
        let mut best = vec![vec![f64::INFINITY; n + 1]; parts];
        let mut cut = vec![vec![0usize; n + 1]; parts];
        best[0] = prefix.clone();
        for k in 1..parts {
            for i in k + 1..=n {
                for j in k..i {
                    let value = best[k - 1][j].max(sum(j, i));
                    if value < best[k][i] {
                        best[k][i] = value;
                        cut[k][i] = j;
                    }
                }
            }
        }
        let mut cuts = Vec::with_capacity(parts - 1);
        let mut end = n;
        for k in (1..parts).rev() {
            end = cut[k][end];
            cuts.push(end);
        }
        cuts.reverse();
        Partition::explicit(n, &cuts)
    }

    /// Balanced by parameter count (each block costs at least 1, so parameter-free blocks
    /// still spread out).
    pub fn by_params(model: &Model, parts: usize) -> Result<Partition, PipelineError> {
        let costs: Vec<f64> = (0..model.num_blocks())
            .map(|i| model.block_param_range(i).len().max(1) as f64)
            .collect();
        Partition::balanced(&costs, parts)
    }

    /// Balanced by measured time, identical on every worker: rank 0 of `group` profiles the
    /// blocks on `sample` (see [`profile_block_times`]) and broadcasts the times, because
    /// independent timings differ and workers must agree on the cut.
    pub fn by_measured_time(
        group: &dyn ProcessGroup,
        model: &Model,
        sample: (&Tensor, &[u32]),
        classes: usize,
        parts: usize,
    ) -> Result<Partition, PipelineError> {
        let mut times = vec![0.0f32; model.num_blocks()];
        if group.rank() == 0 {
            let store = model.init(0);
            let measured = profile_block_times(model, &store, sample.0, sample.1, classes, 3);
            times
                .iter_mut()
                .zip(measured)
                .for_each(|(t, m)| *t = m as f32);
        }
        group.broadcast((&mut times).into(), 0)?;
        let costs: Vec<f64> = times.iter().map(|&t| t as f64).collect();
        Partition::balanced(&costs, parts)
    }

    pub fn chunks(&self) -> &[Range<usize>] {
        &self.chunks
    }

    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Total cost of each chunk under per-block `costs`.
    pub fn chunk_costs(&self, costs: &[f64]) -> Vec<f64> {
        self.chunks
            .iter()
            .map(|r| costs[r.clone()].iter().sum())
            .collect()
    }
}

/// Seconds each block takes for forward plus backward on one sample batch (the fastest of
/// `repeats` runs, which is the least disturbed by other processes). Works on a copy of
/// `store`, so running statistics and gradients of the caller are untouched.
pub fn profile_block_times(
    model: &Model,
    store: &ParamStore,
    x: &Tensor,
    y: &[u32],
    classes: usize,
    repeats: usize,
) -> Vec<f64> {
    let n = model.num_blocks();
    let mut store = store.clone();
    let mut best = vec![f64::INFINITY; n];
    for _ in 0..repeats.max(1) {
        let mut times = vec![0.0; n];
        let mut acts = Vec::with_capacity(n);
        let mut h = x.clone();
        for (i, t) in times.iter_mut().enumerate() {
            let start = Instant::now();
            let (out, a) = model.forward(&mut store, h, i..i + 1, Mode::TRAIN, &|_| false);
            *t += start.elapsed().as_secs_f64();
            acts.push(a);
            h = out;
        }
        let (_, dlogits, _) = softmax_cross_entropy(h.data(), classes, y, 1.0);
        let mut grad = Tensor::from_vec(dlogits, h.shape());
        for (i, a) in acts.into_iter().enumerate().rev() {
            let start = Instant::now();
            let dx = model.backward(&mut store, a, grad, i > 0, &mut |_, _| {});
            times[i] += start.elapsed().as_secs_f64();
            match dx {
                Some(dx) => grad = dx,
                None => break,
            }
        }
        best.iter_mut().zip(times).for_each(|(b, t)| *b = b.min(t));
    }
    best
}
