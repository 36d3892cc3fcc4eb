//! Which blocks each chunk of a stage holds: contiguous, non-empty ranges covering the
//! model. A run without a pipeline has one chunk, the whole model; the pipeline dimension
//! chooses the cuts (`crate::pipeline::partition`: by parameters, measured time or explicit
//! boundaries).

use super::PipelineError;
use std::ops::Range;

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
