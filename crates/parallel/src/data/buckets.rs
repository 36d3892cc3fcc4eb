//! Gradient buckets: contiguous slices of the flat gradient buffer, in the order backward
//! finishes them.
//!
//! Backward runs from the last block to the first, so the buckets are cut walking the blocks
//! in reverse. The first bucket is small (PyTorch: 1 MiB) so that communication starts as
//! early as possible; the others fill up to the bucket cap (PyTorch's default 25 MiB). A block
//! is never split: its gradients all become final at the same moment. Because blocks sit in
//! the flat buffer in forward order, every bucket is one contiguous range: no copies.

use std::ops::Range;

/// One bucket: the blocks it covers and their gradients' range in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub blocks: Range<usize>,
    pub grads: Range<usize>,
}

impl Bucket {
    pub fn len(&self) -> usize {
        self.grads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }
}

/// Cuts blocks (given by their parameter ranges, in forward order) into buckets in backward
/// order: the first holds at most `first_cap` elements (unless one block alone is larger),
/// the others at most `cap`. Blocks without parameters join their neighbours' bucket.
pub fn plan_buckets(block_params: &[Range<usize>], first_cap: usize, cap: usize) -> Vec<Bucket> {
    let mut buckets = Vec::new();
    let mut hi = block_params.len(); // current bucket covers blocks lo..hi
    let mut lo = hi;
    let mut elems = 0usize;
    while lo > 0 {
        let block_len = block_params[lo - 1].len();
        let limit = if buckets.is_empty() { first_cap } else { cap };
        if elems > 0 && elems + block_len > limit {
            buckets.push(make(block_params, lo..hi));
            hi = lo;
            elems = 0;
            continue;
        }
        elems += block_len;
        lo -= 1;
    }
    if hi > 0 {
        buckets.push(make(block_params, 0..hi));
    }
    buckets.retain(|b| !b.is_empty());
    buckets
}

fn make(block_params: &[Range<usize>], blocks: Range<usize>) -> Bucket {
    let start = block_params[blocks.start].start;
    let end = block_params[blocks.end - 1].end;
    Bucket {
        blocks,
        grads: start..end,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(lens: &[usize]) -> Vec<Range<usize>> {
        let mut off = 0;
        lens.iter()
            .map(|&l| {
                off += l;
                off - l..off
            })
            .collect()
    }

    #[test]
    fn buckets_run_backward_small_first_and_cover_everything_once() {
        let blocks = ranges(&[10, 0, 30, 20, 20, 5, 50]);
        let b = plan_buckets(&blocks, 40, 60);
        // Reverse order: [50] would exceed 40 with 5 → first bucket = block 6 alone (50 > 40
        // but a block is never split), then 5+20+20=45 (+30 > 60), then 30+0+10.
        assert_eq!(
            b.iter().map(|b| b.blocks.clone()).collect::<Vec<_>>(),
            [6..7, 3..6, 0..3]
        );
        assert_eq!(b[0].grads, 85..135);
        let mut covered: Vec<usize> = b.iter().flat_map(|b| b.grads.clone()).collect();
        covered.sort_unstable();
        assert_eq!(covered, (0..135).collect::<Vec<_>>());
        // Backward order: each bucket lies before the previous one in the buffer.
        assert!(b.windows(2).all(|w| w[1].grads.end == w[0].grads.start));
    }

    #[test]
    fn a_huge_cap_gives_one_bucket_and_tiny_caps_one_per_block() {
        let blocks = ranges(&[3, 4, 5]);
        assert_eq!(plan_buckets(&blocks, 100, 100).len(), 1);
        assert_eq!(plan_buckets(&blocks, 1, 1).len(), 3);
        assert!(plan_buckets(&ranges(&[0, 0]), 1, 1).is_empty());
    }
}
