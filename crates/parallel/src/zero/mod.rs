//! ZeRO (Rajbhandari et al. 2020) / FSDP: data parallelism without full replicas of the
//! model states. Each data-parallel rank owns one piece of every parameter ([`shards`]) and
//! keeps only what its stage shards:
//!
//! | stage | parameters | gradients | optimizer state | per step |
//! |---|---|---|---|---|
//! | 1 | full | full | this rank's pieces | reduce-scatter (as backward finishes blocks), update the pieces, all-gather the parameters |
//! | 2 | full | this rank's pieces (+ one block during its backward) | pieces | reduce-scatter each block as its backward ends, update, all-gather |
//! | 3 | pieces (+ the blocks being computed) | pieces | pieces | all-gather each block before its forward and again before its backward (next block prefetched), reduce-scatter after its backward, update the pieces |
//!
//! [`ZeroSync`] is one more [`GradSync`]: the training step does not know which it has. The
//! update works on this rank's pieces only: when [`GradSync::finish`] returns, the chunk's
//! store holds what this rank updates (stages 2–3: the gradient pieces in *state*
//! coordinates, stage 3 also the parameter pieces), its optimizer is sized for the pieces
//! ([`ZeroSync::optimizer`]), tied copies, tensor-parallel sums and gradient norms use the
//! pieces' coordinates ([`Sharding`]), and [`GradSync::after_update`] puts the store back.
//! Gradient norms are summed over the whole world (every rank owns different pieces).
//!
//! Stage 1 composes with pipelines (Megatron's distributed optimizer); stages 2–3 gather and
//! reduce per block inside the executor's passes ([`crate::engine::ChunkParams`]), and with
//! a pipeline those passes interleave across micro-batches of several chunks: refused before
//! work starts (`Layout::resolve`).

mod chunk;
pub mod shards;

pub use chunk::{ChunkComm, ZeroChunk, ZeroOptions};
pub use shards::{merge_ranges, ShardLayout};

use crate::data::{CommTiming, DataParallelError, GradSync};
use crate::engine::{ChunkParams, DeviceState, GradsReady, StageChunk};
use meshtrain_comm::ProcessGroup;
use meshtrain_nn::optim::{Optimizer, OptimizerConfig, Segment, StatePiece};
use meshtrain_nn::{BlockParams, Model, ParamStore};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// What a ZeRO stage shards (each stage shards everything the previous one does).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ZeroStage {
    /// Stage 1: optimizer state.
    Optimizer = 1,
    /// Stage 2: and gradients.
    Gradients = 2,
    /// Stage 3: and parameters.
    Parameters = 3,
}

impl ZeroStage {
    /// The stage of a layout's `zero` number (`None` for 0: DDP).
    pub fn from_level(level: u8) -> Option<ZeroStage> {
        match level {
            1 => Some(ZeroStage::Optimizer),
            2 => Some(ZeroStage::Gradients),
            3 => Some(ZeroStage::Parameters),
            _ => None,
        }
    }
}

/// What the rest of the step needs to know about the sharding: where each rank's pieces sit,
/// to address tied copies, replicated parameters and norms in them.
#[derive(Clone, Debug)]
pub struct Sharding {
    pub stage: ZeroStage,
    /// One per local chunk.
    pub layouts: Vec<ShardLayout>,
}

impl Sharding {
    /// Where the gradients of the whole parameters in `full` (a chunk's full coordinates)
    /// sit during the update: unchanged for stage 1 (the full buffer), this rank's pieces
    /// in state coordinates for stages 2–3.
    pub fn update_ranges(&self, chunk: usize, full: &Range<usize>) -> Vec<Range<usize>> {
        match self.stage {
            ZeroStage::Optimizer => vec![full.clone()],
            _ => self.layouts[chunk].state_ranges(full),
        }
    }

    /// A chunk's `norm_skip` in update coordinates: the mapped ranges, and under stage 1
    /// everything this rank does not own (`len`: the chunk's parameter count).
    pub fn norm_skip(&self, chunk: usize, skip: &[Range<usize>], len: usize) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = skip
            .iter()
            .flat_map(|r| self.update_ranges(chunk, r))
            .collect();
        if self.stage == ZeroStage::Optimizer {
            out.extend(self.layouts[chunk].not_owned(len));
        }
        merge_ranges(out)
    }
}

/// A chunk's parameters and optimizer moments in its full layout (`v` empty for SGD).
pub struct FullState {
    pub values: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// The ZeRO synchroniser behind `sync`, if it is one (its pieces, stage and memory).
pub fn of(sync: &dyn GradSync) -> Option<&ZeroSync> {
    sync.as_any()?.downcast_ref()
}

/// As [`of`], to change the pieces (loading a checkpoint, writing the optimizer's state).
pub fn of_mut(sync: &mut dyn GradSync) -> Option<&mut ZeroSync> {
    sync.as_any_mut()?.downcast_mut()
}

/// ZeRO over each of this worker's pipeline chunks.
pub struct ZeroSync {
    group: Arc<dyn ProcessGroup>,
    stage: ZeroStage,
    chunks: Vec<ZeroChunk>,
    /// Pipeline workers (global chunk `c` is local chunk `c / workers`).
    workers: usize,
}

impl ZeroSync {
    /// ZeRO `stage` over `group` for the chunks of a stage of a `workers`-worker pipeline.
    pub fn new(
        model: &Model,
        chunks: &[StageChunk],
        workers: usize,
        group: Arc<dyn ProcessGroup>,
        stage: ZeroStage,
        options: ZeroOptions,
        seed: u64,
    ) -> ZeroSync {
        let zero_chunks = chunks
            .iter()
            .map(|chunk| {
                let base = model.blocks_param_range(chunk.blocks.clone()).start;
                let buffer_base = model.blocks_buffer_range(chunk.blocks.clone()).start;
                let mut blocks = Vec::new();
                let mut buffers = Vec::new();
                for b in chunk.blocks.clone() {
                    let params: Vec<Range<usize>> = model
                        .params()
                        .iter()
                        .filter(|e| e.block == b)
                        .map(|e| e.range.start - base..e.range.end - base)
                        .collect();
                    blocks.push(params);
                    let r = model.blocks_buffer_range(b..b + 1);
                    buffers.push(r.start - buffer_base..r.end - buffer_base);
                }
                let layout = ShardLayout::new(&blocks, group.size(), group.rank());
                let mut z = ZeroChunk::new(
                    layout,
                    stage,
                    group.clone(),
                    options,
                    chunk.blocks.start,
                    buffers,
                );
                if stage == ZeroStage::Parameters && chunk.store.values.is_empty() {
                    // Every rank initialises its pieces from the seed, one parameter at a
                    // time (the values rank 0 would broadcast: initialisation is seeded).
                    let mut shard = Vec::with_capacity(z.layout.state_len);
                    let owned = model
                        .params()
                        .iter()
                        .enumerate()
                        .filter(|(_, e)| chunk.blocks.contains(&e.block));
                    for ((i, e), p) in owned.zip(&z.layout.params) {
                        if p.piece.is_empty() {
                            continue;
                        }
                        let mut values = vec![0.0; e.range.len()];
                        model.init_param(seed, i, &mut values);
                        shard.extend_from_slice(&values[p.piece.clone()]);
                    }
                    z.shard_values = shard;
                }
                z
            })
            .collect();
        ZeroSync {
            group,
            stage,
            chunks: zero_chunks,
            workers,
        }
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Where this rank's pieces sit, for re-addressing ties, replicated sums and norms.
    pub fn sharding(&self) -> Sharding {
        Sharding {
            stage: self.stage,
            layouts: self.chunks.iter().map(|c| c.layout.clone()).collect(),
        }
    }

    /// Local chunk `j`'s optimizer, over this rank's pieces: `segments` are the parameter
    /// groups' settings over the whole model's buffer, `base` the chunk's start in it.
    pub fn optimizer(
        &self,
        j: usize,
        config: OptimizerConfig,
        segments: &[Segment],
        base: usize,
    ) -> Optimizer {
        let layout = &self.chunks[j].layout;
        let mut own = Vec::new();
        let mut pieces = Vec::new();
        for p in layout.params.iter().filter(|p| !p.state.is_empty()) {
            let at = base + p.full.start;
            let hyper = segments
                .iter()
                .find(|s| s.range.contains(&at))
                .expect("parameter groups cover every parameter")
                .hyper;
            own.push(Segment {
                range: p.state.clone(),
                hyper,
            });
            let full = p.piece_full().start;
            pieces.push(StatePiece {
                state: p.state.clone(),
                values: full,
                grads: if self.stage == ZeroStage::Optimizer {
                    full
                } else {
                    p.state.start
                },
            });
        }
        let optimizer = Optimizer::with_segments(config, layout.state_len, own);
        match self.stage {
            ZeroStage::Parameters => optimizer,
            _ => optimizer.scattered(pieces),
        }
    }

    /// Local chunk `j`'s parameters and optimizer moments in its full layout (collective
    /// over the data-parallel group; for checkpoints): `values` is the chunk's store's.
    pub fn unshard(
        &mut self,
        j: usize,
        values: &[f32],
        optimizer: &Optimizer,
        len: usize,
    ) -> Result<FullState, DataParallelError> {
        let z = &mut self.chunks[j];
        let what = "gathering ZeRO shards for a checkpoint";
        let values = if z.stage() == ZeroStage::Parameters {
            // On a device the pieces are the store's (the device's mirror).
            let pieces = if z.values_on_device() {
                values
            } else {
                &z.shard_values
            };
            z.unshard(pieces, len)
                .map_err(|e| DataParallelError::comm(what, e))?
        } else {
            values.to_vec()
        };
        let m = z
            .unshard(&optimizer.m, len)
            .map_err(|e| DataParallelError::comm(what, e))?;
        let v = if !optimizer.has_second_moment() {
            Vec::new()
        } else {
            z.unshard(&optimizer.v, len)
                .map_err(|e| DataParallelError::comm(what, e))?
        };
        Ok(FullState { values, m, v })
    }

    /// The group the pieces are cut over.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// Local chunk `j`'s cut.
    pub fn layout(&self, j: usize) -> &ShardLayout {
        &self.chunks[j].layout
    }

    /// Under stage 3 on the host, local chunk `j`'s parameter pieces to write (a checkpoint
    /// being loaded; between steps).
    pub fn shard_values_mut(&mut self, j: usize) -> Option<&mut [f32]> {
        let z = &mut self.chunks[j];
        (z.stage() == ZeroStage::Parameters && !z.values_on_device())
            .then_some(&mut z.shard_values[..])
    }

    /// Frees every block a pass left gathered (before the state is replaced).
    pub fn end_passes(&mut self) {
        self.chunks.iter_mut().for_each(ZeroChunk::end_pass);
    }

    /// Whether local chunk `j`'s parameters are this rank's pieces (stage 3, in state
    /// coordinates) rather than whole.
    pub fn holds_value_pieces(&self, j: usize) -> bool {
        self.chunks[j].stage() == ZeroStage::Parameters
    }

    /// Under stage 3 on the host, local chunk `j`'s parameter pieces (state coordinates;
    /// between steps). On a device they are the device's parameters.
    pub fn shard_values(&self, j: usize) -> Option<&[f32]> {
        let z = &self.chunks[j];
        (z.stage() == ZeroStage::Parameters && !z.values_on_device()).then_some(&z.shard_values[..])
    }

    /// Bytes this worker's chunks hold in shards (gradients, parameters) and the most
    /// transient bytes (gathered blocks, wire buffers, block gradients) held at once since
    /// the last call.
    pub fn memory(&mut self) -> (usize, usize, usize) {
        let mut out = (0, 0, 0);
        for z in &mut self.chunks {
            let (g, v) = z.shard_bytes();
            out.0 += g;
            out.1 += v;
            out.2 += z.take_transient_peak();
        }
        out
    }
}

impl GradSync for ZeroSync {
    fn name(&self) -> &'static str {
        match self.stage {
            ZeroStage::Optimizer => "zero-1",
            ZeroStage::Gradients => "zero-2",
            ZeroStage::Parameters => "zero-3",
        }
    }

    fn init(&mut self, chunks: &mut [StageChunk]) -> Result<(), DataParallelError> {
        for (z, chunk) in self.chunks.iter_mut().zip(chunks) {
            // Rank 0's parameters (when the stage holds them whole) and buffers.
            crate::data::broadcast_state(self.group.as_ref(), &mut chunk.store)?;
            if self.stage >= ZeroStage::Gradients {
                chunk.store.grads = Vec::new();
            }
            if self.stage == ZeroStage::Parameters && !chunk.store.values.is_empty() {
                z.shard_values = z.shard_of(&chunk.store.values);
                chunk.store.values = Vec::new();
            }
        }
        Ok(())
    }

    fn placing(&mut self, chunks: &mut [StageChunk]) {
        // Stage 3's pieces become the store's, so the device holds them as its parameters
        // (the store frees them once placed).
        if self.stage == ZeroStage::Parameters {
            for (z, chunk) in self.chunks.iter_mut().zip(chunks) {
                chunk.store.values = std::mem::take(&mut z.shard_values);
            }
        }
    }

    fn placed(&mut self, chunks: &mut [StageChunk]) {
        for (z, chunk) in self.chunks.iter_mut().zip(chunks) {
            if let Some(device) = &chunk.device {
                let memory = device.flat_memory();
                z.place(memory, chunk.grads_buf(), chunk.values_buf());
            }
        }
    }

    fn loads(&self) -> Option<(usize, usize)> {
        Some((self.group.rank(), self.group.size()))
    }

    fn begin_step(&mut self) {}

    fn grads_ready(&mut self, ready: GradsReady<'_>) {
        if self.stage != ZeroStage::Optimizer {
            return;
        }
        let j = ready.chunk / self.workers;
        if let Some(z) = self.chunks.get_mut(j) {
            z.block_final(ready.block, ready.grads);
        }
    }

    fn chunk_params(&mut self, j: usize) -> Option<&mut dyn ChunkParams> {
        if self.stage == ZeroStage::Optimizer {
            return None;
        }
        self.chunks.get_mut(j).map(|z| z as &mut dyn ChunkParams)
    }

    fn finish(&mut self, chunks: &mut [StageChunk]) -> Result<CommTiming, DataParallelError> {
        let mut timing = CommTiming::default();
        let mut error = None;
        for (z, chunk) in self.chunks.iter_mut().zip(chunks) {
            let full_grads = (self.stage == ZeroStage::Optimizer).then(|| chunk.grads_buf());
            timing.exposed_s += z.finish_reduces(full_grads);
            let comm = z.take_comm();
            timing.bytes += comm.bytes;
            timing.hidden_s += comm.hidden_s;
            // Forward and backward waiting in their hooks for parameters or for the
            // in-flight bound of reduce-scatters is communication the compute waited for:
            // exposed, and taken out of forward's and backward's compute.
            let gather_wait_s = comm.forward_gather_wait_s + comm.backward_gather_wait_s;
            timing.param_gather_s += gather_wait_s;
            timing.in_forward_s += comm.forward_gather_wait_s;
            timing.in_backward_s += comm.backward_gather_wait_s + comm.reduce_wait_s;
            timing.exposed_s += gather_wait_s + comm.reduce_wait_s;
            if let Some(e) = z.take_error() {
                error.get_or_insert(e);
            }
            if self.stage >= ZeroStage::Gradients && !z.grads_on_device() {
                std::mem::swap(&mut chunk.store.grads, &mut z.shard_grads);
            }
            if self.stage == ZeroStage::Parameters && !z.values_on_device() {
                std::mem::swap(&mut chunk.store.values, &mut z.shard_values);
            }
        }
        timing.traffic_bytes = timing.bytes;
        match error {
            Some(e) => Err(DataParallelError::comm("ZeRO collective", e)),
            None => Ok(timing),
        }
    }

    fn after_update(&mut self, chunks: &mut [StageChunk]) -> Result<CommTiming, DataParallelError> {
        let t = Instant::now();
        let mut timing = CommTiming::default();
        for (z, chunk) in self.chunks.iter_mut().zip(chunks) {
            if self.stage >= ZeroStage::Gradients && !z.grads_on_device() {
                std::mem::swap(&mut chunk.store.grads, &mut z.shard_grads);
            }
            if self.stage == ZeroStage::Parameters {
                if !z.values_on_device() {
                    std::mem::swap(&mut chunk.store.values, &mut z.shard_values);
                }
            } else {
                z.all_gather_values(chunk.values_buf())
                    .map_err(|e| DataParallelError::comm("all-gathering updated parameters", e))?;
                chunk.values_changed();
                let comm = z.take_comm();
                timing.bytes += comm.bytes;
            }
        }
        timing.traffic_bytes = timing.bytes;
        timing.exposed_s = t.elapsed().as_secs_f64();
        Ok(timing)
    }

    fn check_pass(&mut self) -> Result<(), DataParallelError> {
        for z in &mut self.chunks {
            z.end_pass();
            if let Some(e) = z.take_error() {
                return Err(DataParallelError::comm("ZeRO collective", e));
            }
        }
        Ok(())
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

impl ChunkParams for ZeroChunk {
    fn bind<'a>(
        &'a mut self,
        model: &'a Model,
        store: &'a mut ParamStore,
        device: Option<&'a mut Box<dyn DeviceState>>,
    ) -> Box<dyn BlockParams + 'a> {
        let device = device.map(|d| (model, d));
        Box::new(ZeroChunk::bind(self, store, device))
    }
}
