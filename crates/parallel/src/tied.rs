//! Tied parameters ([`meshtrain_nn::TiedParams`]): one parameter of the model held in several
//! blocks, e.g. a GPT's token embedding and output head. Each holder computes its own
//! gradient; after the data-parallel reduction [`TiedGrads::reduce`] adds them up and gives
//! every copy the sum, so identical optimizer updates keep the copies identical — as if they
//! were one tensor. When a pipeline puts the copies on different stages, the sum is an
//! all-reduce over just those stages (Megatron's embedding group); on one stage it is a
//! local addition. Norms count the parameter once: copies go into their chunk's `norm_skip`.

use crate::engine::{Partition, PipelineError, Stage, StageChunk};
use meshtrain_comm::{BufMut, CommError, ProcessGroup, ReduceOp};
use meshtrain_nn::Model;
use std::ops::Range;
use std::sync::Arc;

/// One tied group as this worker sees it.
struct LocalTie {
    /// (local chunk, range in its store) of each entry this worker holds, primary first.
    held: Vec<(usize, Range<usize>)>,
    /// The pipeline workers holding an entry, when there are several (this one among them).
    group: Option<Arc<dyn ProcessGroup>>,
}

/// Adds up the gradients of tied copies on this worker and across pipeline stages.
pub struct TiedGrads {
    ties: Vec<LocalTie>,
    scratch: Vec<f32>,
}

impl TiedGrads {
    /// For `model`'s ties on this worker's `stage` of a pipeline over `pp` (every pipeline
    /// worker calls this, in the same order). Marks copies as left out of gradient norms.
    pub fn new(
        model: &Model,
        partition: &Partition,
        stage: &mut Stage,
        pp: &Arc<dyn ProcessGroup>,
    ) -> Result<TiedGrads, CommError> {
        let schedule = stage.schedule().clone();
        let chunk_of_block = |block: usize| {
            partition
                .chunks()
                .iter()
                .position(|r| r.contains(&block))
                .expect("the partition covers every block")
        };
        let mut ties = Vec::new();
        for (t, tie) in model.ties().iter().enumerate() {
            let entries: Vec<usize> = std::iter::once(tie.primary)
                .chain(tie.copies.iter().copied())
                .collect();
            let mut workers: Vec<usize> = entries
                .iter()
                .map(|&e| schedule.worker_of(chunk_of_block(model.params()[e].block)))
                .collect();
            workers.sort_unstable();
            workers.dedup();
            let mut held = Vec::new();
            for (k, &e) in entries.iter().enumerate() {
                let entry = &model.params()[e];
                let chunk = chunk_of_block(entry.block);
                let Some(j) = stage.chunks.iter().position(|c| c.index == chunk) else {
                    continue;
                };
                let base = model
                    .blocks_param_range(stage.chunks[j].blocks.clone())
                    .start;
                let range = entry.range.start - base..entry.range.end - base;
                if k > 0 {
                    stage.chunks[j].leave_out_of_norms(range.clone());
                }
                held.push((j, range));
            }
            let group = if workers.len() > 1 && workers.contains(&pp.rank()) {
                let name = format!("tied{t}{workers:?}").replace(' ', "");
                Some(pp.new_named_subgroup(&workers, &name)?)
            } else {
                None
            };
            ties.push(LocalTie { held, group });
        }
        Ok(TiedGrads {
            ties,
            scratch: Vec::new(),
        })
    }

    /// Addresses the tied entries in the coordinates the update works in (ZeRO: this rank's
    /// pieces): `map(local chunk, range)` gives the range's new place. Tied entries have
    /// the same shape, so their pieces have the same length on every rank.
    pub fn remap(&mut self, map: impl Fn(usize, &Range<usize>) -> Vec<Range<usize>>) {
        for tie in &mut self.ties {
            for (j, range) in &mut tie.held {
                let mapped = map(*j, range);
                assert_eq!(mapped.len(), 1, "a tied entry is one parameter");
                *range = mapped[0].clone();
            }
        }
    }

    /// Whether the model has tied parameters at all.
    pub fn is_empty(&self) -> bool {
        self.ties.is_empty()
    }

    /// Gives every tied copy the sum of all copies' gradients (primary first, then the
    /// copies in order, then across stages).
    pub fn reduce(&mut self, chunks: &mut [StageChunk]) -> Result<(), PipelineError> {
        for tie in &self.ties {
            let Some(((j0, r0), rest)) = tie.held.split_first() else {
                continue;
            };
            // The copies this worker holds in one chunk (all of them without interleaving):
            // summed in place on the chunk's device, then over the tie's stages.
            if rest.iter().all(|(j, _)| j == j0) {
                let chunk = &mut chunks[*j0];
                let ranges: Vec<Range<usize>> = tie.held.iter().map(|(_, r)| r.clone()).collect();
                chunk.sum_grads(&ranges);
                if let Some(group) = &tie.group {
                    let primary = chunk.grads_buf().sub(r0.start, r0.len());
                    // SAFETY: the chunk's gradients, untouched until the wait returns.
                    unsafe { group.all_reduce_async(primary, ReduceOp::Sum)?.wait()? };
                    for (_, r) in rest {
                        chunk.copy_grads(r.clone(), r0.clone());
                    }
                }
                continue;
            }
            if chunks.iter().any(|c| c.device.is_some()) {
                return Err(PipelineError::Device(
                    "a tied parameter held in two chunks of one worker (an interleaved \
                     pipeline) is summed on the host only: run this layout with --device cpu"
                        .into(),
                ));
            }
            self.scratch.clear();
            self.scratch
                .extend_from_slice(&chunks[*j0].store.grads[r0.clone()]);
            for (j, r) in rest {
                let g = &chunks[*j].store.grads[r.clone()];
                self.scratch.iter_mut().zip(g).for_each(|(s, g)| *s += g);
            }
            if let Some(group) = &tie.group {
                group.all_reduce(BufMut::F32(&mut self.scratch), ReduceOp::Sum)?;
            }
            for (j, r) in &tie.held {
                chunks[*j].store.grads[r.clone()].copy_from_slice(&self.scratch);
            }
        }
        Ok(())
    }
}
