//! Which elements of a chunk's parameters each data-parallel rank owns under ZeRO: plain
//! data, tested without a model or a collective.
//!
//! Every parameter is cut into `ranks` equal pieces (the last ones shorter or empty), and
//! rank `r` owns piece `r` of *every* parameter — FSDP2's per-parameter sharding rather than
//! one cut through the flat buffer. That choice makes everything that works per parameter
//! work on shards unchanged: tied copies have the same shape, so their pieces line up on
//! every rank and are added locally; a replicated parameter of tensor parallelism has the
//! same pieces on every tensor-parallel rank; weight-decay groups are per parameter; and a
//! checkpoint names each piece by parameter and offset.
//!
//! Three coordinate systems:
//! * **full**: the chunk's flat buffer (`ParamStore::values`), parameter after parameter;
//! * **state**: this rank's pieces, concatenated in parameter order (the optimizer state,
//!   and ZeRO-2/3's gradients and ZeRO-3's parameters);
//! * **slots**: the wire format of one block's collectives — per rank, one slot of
//!   `ceil(len / ranks)` elements per parameter (pieces padded with zeros), ranks one after
//!   the other, so reduce-scatter and all-gather move equal counts.

use crate::engine::flat::{CopyPlan, Run};
use std::ops::Range;

/// One parameter's cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamShard {
    /// The whole (tensor-parallel local) parameter in full coordinates.
    pub full: Range<usize>,
    /// Elements per rank's slot (`ceil(len / ranks)`).
    pub slot: usize,
    /// Where the slot starts within its block's per-rank slots.
    pub slot_at: usize,
    /// This rank's piece: offsets within the parameter.
    pub piece: Range<usize>,
    /// This rank's piece in state coordinates.
    pub state: Range<usize>,
}

impl ParamShard {
    /// Rank `rank`'s piece, as offsets within the parameter.
    fn piece_of(&self, rank: usize) -> Range<usize> {
        let len = self.full.len();
        (rank * self.slot).min(len)..((rank + 1) * self.slot).min(len)
    }

    /// This rank's piece in full coordinates.
    pub fn piece_full(&self) -> Range<usize> {
        self.full.start + self.piece.start..self.full.start + self.piece.end
    }
}

/// One block's parameters and the size of its collectives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockShard {
    /// Indices into [`ShardLayout::params`].
    pub params: Range<usize>,
    /// The block's parameters in full coordinates.
    pub full: Range<usize>,
    /// Elements of one rank's slots (the reduce-scatter output, the all-gather input).
    pub slots: usize,
}

/// The cut of one chunk's parameters over `ranks` data-parallel ranks, seen from `rank`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    pub ranks: usize,
    pub rank: usize,
    pub params: Vec<ParamShard>,
    /// In block order (the chunk's first block first).
    pub blocks: Vec<BlockShard>,
    /// Elements of this rank's state.
    pub state_len: usize,
}

impl ShardLayout {
    /// `blocks[b]` lists block `b`'s parameter ranges (full coordinates, consecutive).
    pub fn new(blocks: &[Vec<Range<usize>>], ranks: usize, rank: usize) -> ShardLayout {
        assert!(ranks > 0 && rank < ranks, "rank {rank} of {ranks}");
        let (mut params, mut out, mut state) = (Vec::new(), Vec::new(), 0);
        let mut at_full = 0;
        for ranges in blocks {
            let first = params.len();
            let start = ranges.first().map_or(at_full, |r| r.start);
            let mut slot_at = 0;
            for r in ranges {
                let slot = r.len().div_ceil(ranks);
                let mut p = ParamShard {
                    full: r.clone(),
                    slot,
                    slot_at,
                    piece: 0..0,
                    state: 0..0,
                };
                p.piece = p.piece_of(rank);
                p.state = state..state + p.piece.len();
                state += p.piece.len();
                slot_at += slot;
                params.push(p);
            }
            at_full = ranges.last().map_or(start, |r| r.end);
            out.push(BlockShard {
                params: first..params.len(),
                full: start..at_full,
                slots: slot_at,
            });
        }
        ShardLayout {
            ranks,
            rank,
            params,
            blocks: out,
            state_len: state,
        }
    }

    /// Elements of one block's collective over all ranks (the reduce-scatter input).
    pub fn wire_len(&self, block: usize) -> usize {
        self.blocks[block].slots * self.ranks
    }

    fn block_params(&self, block: usize) -> &[ParamShard] {
        &self.params[self.blocks[block].params.clone()]
    }

    /// Block `block`'s parameters (offsets within the block's full range) into the slots of
    /// every rank ([`ShardLayout::wire_len`] elements), padded with zeros: a reduce-scatter's
    /// input. Its [`CopyPlan::inverse`] is the all-gather's result back into parameters.
    pub fn pack_all(&self, block: usize) -> CopyPlan {
        let b = &self.blocks[block];
        let mut runs = Vec::new();
        for k in 0..self.ranks {
            for p in self.block_params(block) {
                let piece = p.piece_of(k);
                let dst = k * b.slots + p.slot_at;
                let src = p.full.start - b.full.start + piece.start;
                runs.extend(slot_runs(Some(src), dst, piece.len(), p.slot));
            }
        }
        CopyPlan::new(runs)
    }

    /// This rank's slots of block `block` ([`BlockShard::slots`] elements, padded with zeros)
    /// from its pieces in `from`: state coordinates, or offsets within the block's full
    /// range. Its [`CopyPlan::inverse`] writes the slots back over the pieces.
    pub fn pack_own(&self, block: usize, from: Coordinates) -> CopyPlan {
        let b = &self.blocks[block];
        let runs = self.block_params(block).iter().flat_map(|p| {
            let src = match from {
                Coordinates::State => p.state.start,
                Coordinates::Block => p.piece_full().start - b.full.start,
            };
            slot_runs(Some(src), p.slot_at, p.piece.len(), p.slot)
        });
        CopyPlan::new(runs.collect())
    }

    /// The state ranges of the parameters lying inside `full` (a range made of whole
    /// parameters: a tied copy, a run of replicated parameters), in order.
    pub fn state_ranges(&self, full: &Range<usize>) -> Vec<Range<usize>> {
        self.params
            .iter()
            .filter(|p| full.start <= p.full.start && p.full.end <= full.end)
            .filter(|p| !p.full.is_empty())
            .map(|p| p.state.clone())
            .collect()
    }

    /// The runs of `window` (full coordinates) that rank `rank` owns, in parameter order,
    /// each as (full range, the same elements in that rank's state coordinates): what a
    /// rank contributes when one range of a full-layout vector is gathered, and where the
    /// gathering rank puts it.
    pub fn owned_within(
        &self,
        rank: usize,
        window: &Range<usize>,
    ) -> Vec<(Range<usize>, Range<usize>)> {
        let mut out = Vec::new();
        let mut state = 0;
        for p in &self.params {
            let piece = p.piece_of(rank);
            let (start, end) = (p.full.start + piece.start, p.full.start + piece.end);
            let (a, b) = (start.max(window.start), end.min(window.end));
            if a < b {
                let at = state + (a - start);
                out.push((a..b, at..at + (b - a)));
            }
            state += piece.len();
        }
        out
    }

    /// This rank's pieces in full coordinates, in order.
    pub fn pieces_full(&self) -> Vec<Range<usize>> {
        self.params.iter().map(ParamShard::piece_full).collect()
    }

    /// The parts of the full buffer (`len` elements) this rank does not own.
    pub fn not_owned(&self, len: usize) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut at = 0;
        for piece in self.pieces_full().into_iter().filter(|p| !p.is_empty()) {
            if piece.start > at {
                out.push(at..piece.start);
            }
            at = at.max(piece.end);
        }
        if at < len {
            out.push(at..len);
        }
        out
    }
}

/// Where [`ShardLayout::pack_own`] finds this rank's pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coordinates {
    /// State coordinates (the pieces one after the other).
    State,
    /// Offsets within the block's range of the full buffer.
    Block,
}

/// One slot of `slot` elements at `dst`: `len` from `src`, then zeros.
fn slot_runs(src: Option<usize>, dst: usize, len: usize, slot: usize) -> [Run; 2] {
    [
        Run { src, dst, len },
        Run {
            src: None,
            dst: dst + len,
            len: slot - len,
        },
    ]
}

/// Sorted, non-overlapping ranges covering the union of `ranges`.
pub fn merge_ranges(mut ranges: Vec<Range<usize>>) -> Vec<Range<usize>> {
    ranges.retain(|r| !r.is_empty());
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {

    /// Every element of any window is owned by exactly one rank, and a rank's own runs
    /// sit where its state coordinates say.
    #[test]
    fn every_window_is_owned_once_and_in_state_coordinates() {
        let blocks = vec![vec![0..7, 7..8], vec![8..8, 8..21], vec![21..24]];
        for ranks in 1..=4 {
            for window in [0..24, 3..19, 7..8, 20..23, 5..5] {
                let mut owner = [0; 24];
                for rank in 0..ranks {
                    let layout = ShardLayout::new(&blocks, ranks, rank);
                    let mut state_at = None;
                    for (full, state) in layout.owned_within(rank, &window) {
                        assert_eq!(full.len(), state.len());
                        assert!(state_at.is_none_or(|at| state.start >= at), "in order");
                        state_at = Some(state.end);
                        for (f, s) in full.clone().zip(state) {
                            owner[f] += 1;
                            let p = (layout.params.iter())
                                .find(|p| p.piece_full().contains(&f))
                                .expect("a rank's own element is in one of its pieces");
                            assert_eq!(s, p.state.start + (f - p.piece_full().start));
                        }
                    }
                    // Seen from another rank, the same runs.
                    let other = ShardLayout::new(&blocks, ranks, (rank + 1) % ranks);
                    assert_eq!(
                        other.owned_within(rank, &window),
                        layout.owned_within(rank, &window)
                    );
                }
                for (f, n) in owner.iter().enumerate() {
                    assert_eq!(*n, usize::from(window.contains(&f)), "element {f}");
                }
            }
        }
    }

    use super::*;

    /// Two blocks: [0..5, 5..6] and [6..13]; three ranks.
    fn blocks() -> Vec<Vec<Range<usize>>> {
        vec![vec![0..5, 5..6], vec![6..13]]
    }

    #[test]
    fn pieces_cover_every_parameter_once_across_ranks() {
        let layouts: Vec<_> = (0..3).map(|r| ShardLayout::new(&blocks(), 3, r)).collect();
        let mut owned: Vec<usize> = layouts
            .iter()
            .flat_map(|l| l.pieces_full().into_iter().flatten())
            .collect();
        owned.sort_unstable();
        assert_eq!(owned, (0..13).collect::<Vec<_>>());
        // Slots: ceil(5/3)=2, ceil(1/3)=1 → 3 per rank in block 0; ceil(7/3)=3 in block 1.
        assert_eq!(layouts[0].blocks[0].slots, 3);
        assert_eq!(layouts[0].blocks[1].slots, 3);
        // Rank 2 owns element 4 of the first parameter, nothing of the second, 6+6..13.
        assert_eq!(layouts[2].pieces_full(), vec![4..5, 6..6, 12..13]);
        assert_eq!(layouts[2].state_len, 2);
        let lens: usize = layouts.iter().map(|l| l.state_len).sum();
        assert_eq!(lens, 13);
    }

    #[test]
    fn pack_all_then_own_slots_then_unpack_all_round_trips() {
        let full: Vec<f32> = (0..13).map(|i| i as f32 + 1.0).collect();
        let layouts: Vec<_> = (0..3).map(|r| ShardLayout::new(&blocks(), 3, r)).collect();
        for b in 0..2 {
            let range = layouts[0].blocks[b].full.clone();
            let block = &full[range.clone()];
            let mut wire = vec![f32::NAN; layouts[0].wire_len(b)];
            let pack_all = layouts[0].pack_all(b);
            assert_eq!(pack_all.extents(), (wire.len(), range.len()));
            pack_all.apply_on_host(block, &mut wire, false);
            // What a reduce-scatter leaves on rank k is slice k of the wire; each rank's
            // own packing of its pieces is exactly that slice.
            let slots = layouts[0].blocks[b].slots;
            let mut gathered = Vec::new();
            for (k, l) in layouts.iter().enumerate() {
                let mut own = vec![f32::NAN; slots];
                l.pack_own(b, Coordinates::Block)
                    .apply_on_host(block, &mut own, false);
                assert_eq!(own, wire[k * slots..(k + 1) * slots].to_vec(), "rank {k}");
                gathered.extend(own);
            }
            let mut back = vec![0.0; range.len()];
            layouts[1]
                .pack_all(b)
                .inverse()
                .apply_on_host(&gathered, &mut back, false);
            assert_eq!(back, full[range].to_vec());
        }
    }

    #[test]
    fn state_and_full_coordinates_agree() {
        let full: Vec<f32> = (0..13).map(|i| i as f32).collect();
        let l = ShardLayout::new(&blocks(), 3, 1);
        let mut state = vec![0.0; l.state_len];
        let mut slots = vec![0.0; 3];
        for b in 0..2 {
            let block = &full[l.blocks[b].full.clone()];
            l.pack_own(b, Coordinates::Block)
                .apply_on_host(block, &mut slots, false);
            l.pack_own(b, Coordinates::State)
                .inverse()
                .apply_on_host(&slots, &mut state, false);
        }
        // Rank 1: elements 2..4 of the first parameter, 5..6 (the 1-element parameter's
        // piece 1 is empty), 9..12 of the third.
        assert_eq!(state, vec![2.0, 3.0, 9.0, 10.0, 11.0]);
        let mut twice = state.clone();
        let own = l.pack_own(1, Coordinates::State);
        own.apply_on_host(&state, &mut slots, false);
        own.inverse().apply_on_host(&slots, &mut twice, true);
        assert_eq!(twice, vec![2.0, 3.0, 18.0, 20.0, 22.0]);
        // Back over the pieces of the full buffer, nothing else touched.
        let mut again = vec![-1.0; 7];
        l.pack_own(1, Coordinates::Block)
            .inverse()
            .apply_on_host(&slots, &mut again, false);
        assert_eq!(again, vec![-1.0, -1.0, -1.0, 9.0, 10.0, 11.0, -1.0]);
        assert_eq!(l.state_ranges(&(6..13)), vec![2..5]);
        assert_eq!(l.state_ranges(&(0..6)), vec![0..2, 2..2]);
        assert_eq!(l.not_owned(13), vec![0..2, 4..9, 12..13]);
    }

    #[test]
    fn merge_joins_overlaps_and_neighbours() {
        assert_eq!(
            merge_ranges(vec![5..7, 0..2, 1..3, 3..4, 9..9]),
            vec![0..4, 5..7]
        );
    }
}
