//! One worker's side of a pipeline step: run its program from the [`Schedule`] over
//! point-to-point messages, calling `Model::forward_local` / `backward_local` on its chunks.
//!
//! * A [`Stage`] owns only its chunks' parameters (stage-local [`ParamStore`]s), so memory
//!   per worker shrinks with the pipeline; each chunk gets its own optimizer state.
//! * Sends are asynchronous by default (posted on the communication thread, compute goes on;
//!   [`SendMode`]); receives block where the schedule needs the data, and that wait is the
//!   bubble.
//! * Messages carry their shape and a tag naming (micro-batch, chunk, direction); see
//!   `transport`.
//! * The last chunk computes the step's [`Loss`] with gradient scale `1/m`, so the gradients
//!   accumulated over `m` equal micro-batches equal those of the full batch's mean loss.
//! * One worker with one chunk (`p = 1`) is plain training: 1F1B on one worker is forward,
//!   backward, forward, backward… — gradient accumulation over `m` micro-batches, or a
//!   single forward and backward when `m = 1`. Every layout runs through here.
//! * [`GradsReady`] fires for each block during a chunk's *last* backward of the step: from
//!   then on that block's gradients are final and a data-parallel all-reduce may start.

use super::device::{DeviceState, StateKind};
use super::partition::Partition;
use super::schedule::{Action, Schedule};
use super::transport::{
    finish_all, finish_done, post_send, recv_tensor, tag, Direction, PendingSend, SendMode,
    TAG_LIMIT,
};
use super::PipelineError;
use crate::timeline::{timed, Category, Timeline};
use meshtrain_comm::{ProcessGroup, RawBuf};
use meshtrain_nn::model::Activations;
use meshtrain_nn::optim::{segments_within, Optimizer, OptimizerConfig, Segment};
use meshtrain_nn::{BlockParams, Loss, LossValue, Mode, Model, ParamStore};
use meshtrain_tensor::Tensor;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// One contiguous range of blocks held by a worker, with its parameters.
#[derive(Debug)]
pub struct StageChunk {
    /// Global chunk index (model order).
    pub index: usize,
    pub blocks: Range<usize>,
    /// Parameters, gradients and buffers of `blocks` only; with `device`, empty but while
    /// something needs the whole state on the host (filled by [`DeviceState::download`]).
    pub store: ParamStore,
    /// Ranges of `store.grads` that gradient norms leave out (tied copies, whose primary
    /// counts for them).
    pub norm_skip: Vec<Range<usize>>,
    /// Where the chunk's state lives during steps when not in `store`: a GPU's memory. Every
    /// method below goes to it or to the store; nothing above the engine asks which.
    pub device: Option<Box<dyn DeviceState>>,
}

impl StageChunk {
    /// Where this chunk's activations live (a pipeline's receives land there).
    pub fn activation_home(&self) -> super::transport::ActivationHome {
        self.device
            .as_ref()
            .map(|d| d.activation_home())
            .unwrap_or_default()
    }

    /// Leaves `range` of the gradients out of norms (`norm_skip` stays sorted).
    pub fn leave_out_of_norms(&mut self, range: Range<usize>) {
        self.norm_skip.push(range);
        self.norm_skip.sort_by_key(|r| r.start);
    }

    /// The chunk's whole gradient buffer, for collectives: the store's, or the device's.
    pub fn grads_buf(&mut self) -> RawBuf {
        match &mut self.device {
            Some(d) => d.grads(),
            // SAFETY: the store's gradients outlive the operations a step starts on them (the
            // step waits for them before the store is touched again).
            None => unsafe { RawBuf::from_slice(&mut self.store.grads) },
        }
    }

    /// The chunk's whole parameter buffer (fp32), for collectives: the store's, or the
    /// device's. After writing it, call [`StageChunk::values_changed`].
    pub fn values_buf(&mut self) -> RawBuf {
        match &mut self.device {
            Some(d) => d.values(),
            // SAFETY: as for `grads_buf`.
            None => unsafe { RawBuf::from_slice(&mut self.store.values) },
        }
    }

    /// The memory a dimension's own flat buffers for this chunk live in: the device's, or
    /// the host's.
    pub fn flat_memory(&self) -> Arc<dyn super::flat::FlatMemory> {
        match &self.device {
            Some(d) => d.flat_memory(),
            None => Arc::new(super::flat::HostFlat {
                device: meshtrain_tensor::Device::Cpu,
            }),
        }
    }

    /// The parameters were written through [`StageChunk::values_buf`]: a device refreshes
    /// what it derives from them (the 16-bit compute copy).
    pub fn values_changed(&mut self) {
        if let Some(d) = &mut self.device {
            d.values_changed();
        }
    }

    /// Every range of `held` (chunk-local, equal lengths) becomes their sum, added in order
    /// (a tied parameter's copies within this chunk).
    pub fn sum_grads(&mut self, held: &[Range<usize>]) {
        let Some((first, rest)) = held.split_first() else {
            return;
        };
        match &mut self.device {
            Some(d) => {
                for r in rest {
                    d.tie_sum(first.clone(), r.clone());
                }
                for r in rest.iter().take(rest.len().saturating_sub(1)) {
                    d.copy_grads(r.clone(), first.clone());
                }
            }
            None => {
                let grads = &mut self.store.grads;
                for r in rest {
                    for (i, k) in first.clone().zip(r.clone()) {
                        grads[i] += grads[k];
                    }
                }
                for r in rest {
                    grads.copy_within(first.clone(), r.start);
                }
            }
        }
    }

    /// The gradients of `src` copied over `dst` (chunk-local ranges of equal length).
    pub fn copy_grads(&mut self, dst: Range<usize>, src: Range<usize>) {
        match &mut self.device {
            Some(d) => d.copy_grads(dst, src),
            None => self.store.grads.copy_within(src, dst.start),
        }
    }

    /// Multiplies the gradients by `inverse` (fp16's unscaling); whether any became inf or
    /// NaN.
    pub fn unscale_grads(&mut self, inverse: f32) -> bool {
        match &mut self.device {
            Some(d) => d.unscale_check(inverse),
            None => super::device::unscale(&mut self.store.grads, inverse),
        }
    }

    /// Gradients set to zero.
    pub fn zero_grads(&mut self) {
        match &mut self.device {
            Some(d) => d.zero_grads(),
            None => self.store.zero_grads(),
        }
    }

    /// Fills the store and `optimizer`'s moments (those of `kinds`) from the device (a
    /// transient host copy, for what needs the state on the host); nothing on the host.
    pub fn pull_from_device(
        &mut self,
        optimizer: &mut Optimizer,
        kinds: &[StateKind],
    ) -> Result<(), PipelineError> {
        match &self.device {
            Some(d) => d.download(&mut self.store, optimizer, kinds),
            None => Ok(()),
        }
    }

    /// A placed chunk's host copy freed: its state lives on the device, and a checkpoint
    /// reads it from there ([`DeviceState::read`]). Nothing on the host.
    pub fn release_host_state(&mut self, optimizer: &mut Optimizer) {
        if self.device.is_some() {
            for host in [
                &mut self.store.values,
                &mut self.store.grads,
                &mut self.store.buffers,
                &mut optimizer.m,
                &mut optimizer.v,
            ] {
                *host = Vec::new();
            }
        }
    }

    /// Copies `into.len()` elements of `kind` from element `at` on from the device, when
    /// the chunk is placed (`None`: the state is the store's and the optimizer's).
    pub fn read_from_device(
        &self,
        kind: StateKind,
        at: usize,
        into: &mut [f32],
    ) -> Option<Result<(), PipelineError>> {
        self.device.as_ref().map(|d| d.read(kind, at, into))
    }

    /// `Σ g²` over this chunk's gradients, without `norm_skip`.
    fn grad_sum_of_squares(&mut self) -> f64 {
        match &mut self.device {
            Some(d) => d.grad_sum_of_squares(&self.norm_skip),
            None => super::device::sum_of_squares_outside(&self.store.grads, &self.norm_skip),
        }
    }
}

/// What a new [`Stage`] allocates for each chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StageStores {
    /// Initialised parameters, zeroed gradients, buffers.
    #[default]
    Full,
    /// No gradient buffer (ZeRO-2: gradients live in pieces).
    WithoutGradients,
    /// Buffers only (ZeRO-3: parameters and gradients live in pieces).
    BuffersOnly,
}

/// A worker's share of a pipelined model and the program it runs each step.
#[derive(Debug)]
pub struct Stage {
    rank: usize,
    schedule: Schedule,
    /// This worker's chunks in local order (global index `j·p + rank`).
    pub chunks: Vec<StageChunk>,
    /// Position in this worker's program of each chunk's last backward (keyed by chunk).
    final_backward: HashMap<usize, usize>,
    /// Every chunk's blocks (also the other workers'), for gathering the whole model.
    partition: Partition,
}

/// The micro-batches of one step. Only the worker of the first chunk reads `inputs` and only
/// the worker of the last chunk reads `targets`; other workers may pass them empty.
#[derive(Clone, Debug, Default)]
pub struct MicroBatches {
    pub inputs: Vec<Tensor>,
    pub targets: Vec<Vec<u32>>,
}

impl MicroBatches {
    /// [`MicroBatches::split`] of a batch this call owns: one micro-batch is the batch itself,
    /// moved, not copied.
    pub fn split_owned(x: Tensor, y: Vec<u32>, m: usize) -> Result<MicroBatches, PipelineError> {
        if m == 1
            && x.shape()
                .first()
                .is_some_and(|&b| b > 0 && y.len().is_multiple_of(b))
        {
            return Ok(MicroBatches {
                inputs: vec![x],
                targets: vec![y],
            });
        }
        MicroBatches::split(&x, &y, m)
    }

    /// Splits a batch into `m` equal micro-batches along its first axis (`y` holds the same
    /// number of targets per sample: one for images, `seq` for a language model).
    pub fn split(x: &Tensor, y: &[u32], m: usize) -> Result<MicroBatches, PipelineError> {
        let batch = x.shape().first().copied().unwrap_or(0);
        if m == 0 {
            return Err(PipelineError::NoMicroBatches);
        }
        if batch == 0 || !batch.is_multiple_of(m) {
            return Err(PipelineError::BatchNotDivisible {
                batch,
                micro_batches: m,
            });
        }
        if !y.len().is_multiple_of(batch) {
            return Err(PipelineError::SizeMismatch {
                what: "targets (a multiple of the batch size)",
                got: y.len(),
                expected: batch * (y.len() / batch).max(1),
            });
        }
        let rows = batch / m;
        let (x_len, y_len) = (x.numel() / batch * rows, y.len() / batch * rows);
        let mut shape = x.shape().to_vec();
        shape[0] = rows;
        Ok(MicroBatches {
            inputs: x
                .data()
                .chunks(x_len)
                .map(|c| Tensor::from_vec(c.to_vec(), &shape))
                .collect(),
            targets: y.chunks(y_len).map(<[u32]>::to_vec).collect(),
        })
    }
}

/// Per-step settings.
#[derive(Clone)]
pub struct StepOptions {
    /// What the last chunk computes from the model's output and the targets.
    pub loss: Arc<dyn Loss>,
    /// Keep only each block's input and recompute it in backward (activation checkpointing).
    pub recompute: bool,
    pub sends: SendMode,
}

impl StepOptions {
    /// No recomputation, asynchronous sends.
    pub fn new(loss: Arc<dyn Loss>) -> StepOptions {
        StepOptions {
            loss,
            recompute: false,
            sends: SendMode::Async,
        }
    }
}

impl std::fmt::Debug for StepOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepOptions")
            .field("loss", &self.loss.name())
            .field("recompute", &self.recompute)
            .field("sends", &self.sends)
            .finish()
    }
}

/// What one worker's step did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    /// Mean loss over the batch (workers holding the last chunk only).
    pub loss: Option<f32>,
    /// Correct predictions over the batch (last chunk, losses that count them).
    pub correct: Option<usize>,
    /// Most activation bytes held at once (what forward keeps for backward), counted from
    /// the kept tensors alike on every device: the figure the planner's formula predicts.
    /// A GPU's own peak (these, plus a pass's transients: gathers, logits, scratch) is in
    /// its [`DeviceMemory`](super::DeviceMemory).
    pub peak_activation_bytes: usize,
    /// Time in forward (including the loss on the last stage).
    pub forward_s: f64,
    /// Time in backward (including recomputation).
    pub backward_s: f64,
    /// Time blocked in receives (the bubble, plus transfer time).
    pub recv_wait_s: f64,
    pub wall_s: f64,
}

impl StepReport {
    pub fn compute_s(&self) -> f64 {
        self.forward_s + self.backward_s
    }
}

/// A block's gradients just became final for this step (during its chunk's last backward):
/// `grads` (the chunk's whole gradient buffer, on the chunk's device) holds them at `range`.
/// The place to start a data-parallel all-reduce.
pub struct GradsReady<'a> {
    pub chunk: usize,
    pub block: usize,
    /// The block's range within the chunk (stage-local).
    pub range: Range<usize>,
    /// The chunk's gradient buffer: `store.grads`, or the device's.
    pub grads: RawBuf,
    /// The chunk's host store (its gradients are `grads` only on the CPU).
    pub store: &'a mut ParamStore,
}

/// Where a chunk's blocks find their parameters during a pass when they are not all in the
/// chunk's store: ZeRO-3 gathers each block's just in time, ZeRO-2 reduces each block's
/// gradients as its backward ends ([`BlockParams`]).
pub trait ChunkParams {
    /// The chunk's parameters for one pass over `store` (which holds its buffers), or over
    /// `device` when the chunk's state is placed on one (its views of the parameters and
    /// buffers of `model`'s blocks).
    fn bind<'a>(
        &'a mut self,
        model: &'a Model,
        store: &'a mut ParamStore,
        device: Option<&'a mut Box<dyn DeviceState>>,
    ) -> Box<dyn BlockParams + 'a>;
}

/// What a pipeline pass tells the data-parallel mode and asks of it: any
/// `FnMut(GradsReady)` is one (gradients ready, parameters in the stores).
pub trait StepHooks {
    /// A block's gradients became final ([`GradsReady`]).
    fn grads_ready(&mut self, ready: GradsReady<'_>);

    /// Local chunk `j`'s parameters when not (all) in its store.
    fn chunk_params(&mut self, _j: usize) -> Option<&mut dyn ChunkParams> {
        None
    }
}

/// No data-parallel mode: nothing to tell, parameters in the stores.
pub struct NoHooks;

impl StepHooks for NoHooks {
    fn grads_ready(&mut self, _: GradsReady<'_>) {}
}

impl<F: FnMut(GradsReady<'_>)> StepHooks for F {
    fn grads_ready(&mut self, ready: GradsReady<'_>) {
        self(ready)
    }
}

/// A forward pass over `chunk`'s blocks, with its parameters from `params`, its device or
/// its store.
fn forward_chunk(
    model: &Model,
    chunk: &mut StageChunk,
    params: Option<&mut dyn ChunkParams>,
    x: Tensor,
    mode: Mode,
    recompute: bool,
) -> (Tensor, Activations) {
    let blocks = chunk.blocks.clone();
    let keep = |_| recompute;
    match (params, &mut chunk.device) {
        (Some(p), device) => {
            let mut bound = p.bind(model, &mut chunk.store, device.as_mut());
            model.forward_with(bound.as_mut(), x, blocks, mode, &keep)
        }
        (None, Some(d)) => {
            let mut nothing = |_| {};
            let mut bound = d.bind(model, &mut nothing);
            model.forward_with(bound.as_mut(), x, blocks, mode, &keep)
        }
        (None, None) => model.forward_local(&mut chunk.store, x, blocks, mode, &keep),
    }
}

/// A pass a chunk on a device timed on its own clock: what it was (forward or backward), its
/// micro-batch, and its timeline label when the step records one.
type DevicePass = (Category, usize, Option<String>);

/// Starts timing a pass of a chunk: on a device, on the device's clock (the host's would show
/// only launches), so the host records it in `timeline` only on the CPU (the timeline it
/// returns for [`timed`]).
fn begin_pass<'t>(
    device: &mut Option<Box<dyn DeviceState>>,
    timeline: &'t mut Option<&mut Timeline>,
) -> Option<&'t mut Timeline> {
    match device {
        Some(d) => {
            d.begin_span();
            None
        }
        None => timeline.as_deref_mut(),
    }
}

/// Ends the pass [`begin_pass`] began: on a device, its span is kept with what it was
/// (`label` when the step records a timeline), to be read after the passes.
fn end_pass(
    device: &mut Option<Box<dyn DeviceState>>,
    passes: &mut Vec<DevicePass>,
    category: Category,
    micro: usize,
    label: impl FnOnce() -> Option<String>,
) {
    if let Some(d) = device {
        d.end_span();
        passes.push((category, micro, label()));
    }
}

/// What a chunk's forward produced: the loss (its value, or `None` when its sums stayed on
/// the device) and the gradient of the output, or the output for the next chunk.
enum Produced {
    Loss(Option<LossValue>, Tensor),
    Output(Tensor),
}

/// The loss of the last chunk's output: on the chunk's device when it has one (a value of
/// `None`: the sums stay there), else on the host.
fn chunk_loss(
    chunk: &mut StageChunk,
    loss: &dyn Loss,
    y: Tensor,
    targets: &[u32],
    grad_scale: f32,
) -> Result<(Option<LossValue>, Tensor), PipelineError> {
    match &mut chunk.device {
        Some(d) => {
            let (value, grad) = d.loss(loss, y, targets, Some(grad_scale))?;
            let grad = grad.ok_or_else(|| {
                PipelineError::InvalidSchedule("the loss gave no gradient".into())
            })?;
            Ok((value, grad))
        }
        None => {
            let (value, grad) = loss.forward_backward(&y, targets, grad_scale)?;
            Ok((Some(value), grad))
        }
    }
}

impl Stage {
    /// Worker `rank`'s stage with fresh parameters (the same values the whole model's
    /// `init(seed)` gives these blocks). Checks the layout before any work starts.
    pub fn new(
        model: &Model,
        partition: &Partition,
        schedule: Schedule,
        rank: usize,
        seed: u64,
    ) -> Result<Stage, PipelineError> {
        Stage::new_with(model, partition, schedule, rank, seed, StageStores::Full)
    }

    /// Worker `rank`'s stage allocating only what `stores` says: a sharded data-parallel
    /// mode keeps its own pieces and must not materialise the whole chunk first.
    pub fn new_with(
        model: &Model,
        partition: &Partition,
        schedule: Schedule,
        rank: usize,
        seed: u64,
        stores: StageStores,
    ) -> Result<Stage, PipelineError> {
        Stage::build(model, partition, schedule, rank, |blocks| match stores {
            StageStores::Full => model.init_blocks(seed, blocks),
            StageStores::WithoutGradients => ParamStore {
                grads: Vec::new(),
                ..model.init_blocks(seed, blocks)
            },
            StageStores::BuffersOnly => ParamStore {
                values: Vec::new(),
                grads: Vec::new(),
                buffers: model.init_buffers(blocks),
            },
        })
    }

    /// Worker `rank`'s stage holding its share of a whole-model store (from a checkpoint, or
    /// to compare with a single-worker run).
    pub fn from_store(
        model: &Model,
        partition: &Partition,
        schedule: Schedule,
        rank: usize,
        full: &ParamStore,
    ) -> Result<Stage, PipelineError> {
        if full.values.len() != model.num_params() || full.buffers.len() != model.num_buffers() {
            return Err(PipelineError::SizeMismatch {
                what: "whole-model parameter store",
                got: full.values.len(),
                expected: model.num_params(),
            });
        }
        Stage::build(model, partition, schedule, rank, |blocks| {
            model.slice_store(full, blocks)
        })
    }

    fn build(
        model: &Model,
        partition: &Partition,
        schedule: Schedule,
        rank: usize,
        store_of: impl Fn(Range<usize>) -> ParamStore,
    ) -> Result<Stage, PipelineError> {
        let chunks = schedule.num_chunks();
        if model.num_blocks() < chunks {
            return Err(PipelineError::TooFewBlocks {
                blocks: model.num_blocks(),
                chunks,
            });
        }
        if partition.len() != chunks {
            return Err(PipelineError::SizeMismatch {
                what: "partition (chunks)",
                got: partition.len(),
                expected: chunks,
            });
        }
        let covered = partition.chunks().last().map_or(0, |r| r.end);
        if covered != model.num_blocks() {
            return Err(PipelineError::SizeMismatch {
                what: "partition (blocks covered)",
                got: covered,
                expected: model.num_blocks(),
            });
        }
        if rank >= schedule.workers {
            return Err(PipelineError::RankOutOfRange {
                rank,
                workers: schedule.workers,
            });
        }
        schedule.check()?;
        let mut final_backward = HashMap::new();
        for (pos, a) in schedule.actions[rank].iter().enumerate() {
            if let Action::Backward { chunk, .. } = a {
                final_backward.insert(*chunk, pos);
            }
        }
        let chunks = schedule
            .chunks_of(rank)
            .into_iter()
            .map(|index| {
                let blocks = partition.chunks()[index].clone();
                StageChunk {
                    index,
                    store: store_of(blocks.clone()),
                    blocks,
                    norm_skip: Vec::new(),
                    device: None,
                }
            })
            .collect();
        Ok(Stage {
            rank,
            schedule,
            chunks,
            final_backward,
            partition: partition.clone(),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Parameters this worker holds.
    pub fn num_params(&self) -> usize {
        self.chunks.iter().map(|c| c.store.values.len()).sum()
    }

    /// One optimizer per chunk, sized for that chunk's parameters only.
    pub fn optimizers(&self, config: OptimizerConfig) -> Vec<Optimizer> {
        self.chunks
            .iter()
            .map(|c| Optimizer::new(config, c.store.values.len()))
            .collect()
    }

    /// One optimizer per chunk with the parameter groups' settings: `segments` cover the
    /// whole model's buffer ([`meshtrain_nn::optim::ParamGroups::resolve`]).
    pub fn optimizers_with_groups(
        &self,
        model: &Model,
        config: OptimizerConfig,
        segments: &[Segment],
    ) -> Vec<Optimizer> {
        self.chunks
            .iter()
            .map(|c| {
                let range = model.blocks_param_range(c.blocks.clone());
                let len = range.len();
                Optimizer::with_segments(config, len, segments_within(segments, range))
            })
            .collect()
    }

    /// Updates every chunk with its optimizer, then zeroes the gradients for the next step.
    /// Chunks on a device wait for their update, so the host's clock (and the timeline)
    /// covers it rather than its launches.
    pub fn optimizer_step(
        &mut self,
        optimizers: &mut [Optimizer],
        lr: f32,
        mut timeline: Option<&mut Timeline>,
    ) {
        assert_eq!(
            optimizers.len(),
            self.chunks.len(),
            "one optimizer per chunk"
        );
        timed(
            &mut timeline,
            || "opt".into(),
            Category::Optimizer,
            None,
            || {
                for (chunk, opt) in self.chunks.iter_mut().zip(optimizers) {
                    match &mut chunk.device {
                        Some(d) => {
                            d.step(opt, lr);
                            d.wait();
                        }
                        None => {
                            opt.step(&mut chunk.store.values, &chunk.store.grads, lr);
                            chunk.store.zero_grads();
                        }
                    }
                }
            },
        );
    }

    /// Writes this stage's parameters, gradients and buffers into their places in a
    /// whole-model store (to gather a checkpoint, or compare with a single-worker run).
    pub fn copy_into(&self, model: &Model, full: &mut ParamStore) {
        for c in &self.chunks {
            let pr = model.blocks_param_range(c.blocks.clone());
            let br = model.blocks_buffer_range(c.blocks.clone());
            full.values[pr.clone()].copy_from_slice(&c.store.values);
            full.grads[pr].copy_from_slice(&c.store.grads);
            full.buffers[br].copy_from_slice(&c.store.buffers);
        }
    }

    /// Collects the whole model's parameters and buffers on rank 0 of the pipeline group (for
    /// a checkpoint or a single-worker evaluation); other ranks get `None`. Call it on every
    /// stage between steps. Gradients come back zero.
    pub fn gather(
        &self,
        model: &Model,
        group: &dyn ProcessGroup,
    ) -> Result<Option<ParamStore>, PipelineError> {
        let chunks = self.schedule.num_chunks();
        // Between steps no pipeline message is outstanding, so these tags cannot collide.
        let tags = |c: usize| {
            (
                tag(c, 0, Direction::Activation, chunks),
                tag(c, 0, Direction::Grad, chunks),
            )
        };
        if self.rank != 0 {
            for c in &self.chunks {
                let (values_tag, buffers_tag) = tags(c.index);
                group.send((&c.store.values).into(), 0, values_tag)?;
                group.send((&c.store.buffers).into(), 0, buffers_tag)?;
            }
            return Ok(None);
        }
        let mut full = ParamStore {
            values: vec![0.0; model.num_params()],
            grads: vec![0.0; model.num_params()],
            buffers: vec![0.0; model.num_buffers()],
        };
        for c in 0..chunks {
            let owner = self.schedule.worker_of(c);
            if owner == 0 {
                continue;
            }
            let blocks = self.partition.chunks()[c].clone();
            let (values_tag, buffers_tag) = tags(c);
            let pr = model.blocks_param_range(blocks.clone());
            let br = model.blocks_buffer_range(blocks);
            group.recv((&mut full.values[pr]).into(), owner, values_tag)?;
            group.recv((&mut full.buffers[br]).into(), owner, buffers_tag)?;
        }
        self.copy_into(model, &mut full);
        full.zero_grads();
        Ok(Some(full))
    }

    pub fn zero_grads(&mut self) {
        self.chunks.iter_mut().for_each(StageChunk::zero_grads);
    }

    /// Multiplies every chunk's gradients by `inverse`; whether any became inf or NaN.
    pub fn unscale_grads(&mut self, inverse: f32) -> bool {
        self.chunks
            .iter_mut()
            .fold(false, |found, c| c.unscale_grads(inverse) | found)
    }

    /// Global gradient L2 norm over the workers of `group` (the pipeline stages, a
    /// replica's tensor-parallel ranks, or under ZeRO everyone), for clipping: every worker
    /// gets the same value. Tied copies count once. The partial sums of squares are added in
    /// f64, so the norm is the single worker's to within f64 rounding (in practice the same
    /// f32).
    pub fn grad_norm(&mut self, group: &dyn ProcessGroup) -> Result<f32, PipelineError> {
        let mut sum = [self
            .chunks
            .iter_mut()
            .map(StageChunk::grad_sum_of_squares)
            .sum::<f64>()];
        super::sum_f64(group, &mut sum)?;
        Ok(sum[0].sqrt() as f32)
    }

    /// Scales all stages' gradients so their global norm is at most `max_norm` (as
    /// `optim::clip_grad_norm` does for one worker); returns the norm before clipping.
    pub fn clip_grad_norm(
        &mut self,
        group: &dyn ProcessGroup,
        max_norm: f32,
    ) -> Result<f32, PipelineError> {
        // One chunk on a device that alone holds the whole gradient: the norm and the factor
        // stay on the device, and the update applies the factor (one pass fewer).
        if let ([chunk], 1) = (&mut self.chunks[..], group.size()) {
            if let Some(d) = &mut chunk.device {
                return Ok(d.norm_and_clip(&chunk.norm_skip, Some(max_norm)));
            }
        }
        let norm = self.grad_norm(group)?;
        if let Some(k) = super::device::clip_factor(norm, max_norm) {
            for c in &mut self.chunks {
                match &mut c.device {
                    Some(d) => d.scale_grads(k),
                    None => c.store.grads.iter_mut().for_each(|g| *g *= k),
                }
            }
        }
        Ok(norm)
    }

    /// Runs this worker's program for one training step: gradients of all micro-batches are
    /// accumulated into the chunks' stores (not applied; call [`Stage::optimizer_step`]).
    /// `group` is the pipeline group (rank `r` runs stage `r`). `on_grads_ready` is called for
    /// each block as its gradients become final (see [`GradsReady`]).
    pub fn run_step(
        &mut self,
        model: &Model,
        group: &dyn ProcessGroup,
        batches: MicroBatches,
        options: &StepOptions,
        mut timeline: Option<&mut Timeline>,
        hooks: &mut dyn StepHooks,
    ) -> Result<StepReport, PipelineError> {
        self.check_step(group, &batches, self.schedule.micro_batches)?;
        // The first chunk's forward consumes each micro-batch's input (no copy).
        let MicroBatches {
            inputs: first_inputs,
            targets,
        } = batches;
        let mut first_inputs: Vec<Option<Tensor>> = first_inputs.into_iter().map(Some).collect();
        let started = Instant::now();
        let Stage {
            schedule,
            chunks,
            final_backward,
            ..
        } = self;
        let (p, m) = (schedule.workers, schedule.micro_batches);
        let last = schedule.num_chunks() - 1;
        let interleaved = schedule.chunks_per_worker() > 1;
        let name = |kind: &str, c: usize, i: usize| {
            if interleaved {
                format!("{kind}{i}·c{c}")
            } else {
                format!("{kind}{i}")
            }
        };
        let tag_for = |chunk: usize, micro: usize, dir: Direction| tag(chunk, micro, dir, last + 1);

        // Tensors waiting for the action that consumes them, keyed by (chunk, micro).
        let mut inputs: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut upstream: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut outputs: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut input_grads: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut stash: HashMap<(usize, usize), Activations> = HashMap::new();
        let mut pending: Vec<PendingSend> = Vec::new();
        let mut report = StepReport::default();
        let (mut in_flight, mut loss_sum, mut correct) = (0usize, 0.0f64, None::<usize>);
        // Micro-batches whose loss summed on the device, and their targets.
        let (mut on_device, mut device_targets) = (0usize, 0usize);
        // Per local chunk on a device, what each of its timed passes was (in order).
        let mut device_spans: Vec<Vec<DevicePass>> = vec![Vec::new(); chunks.len()];
        let grad_scale = 1.0 / m as f32;
        for chunk in chunks.iter_mut() {
            if let Some(d) = &mut chunk.device {
                d.begin();
            }
        }

        for (pos, &action) in schedule.actions[self.rank].iter().enumerate() {
            let (c, i) = (action.chunk(), action.micro());
            let j = c / p;
            let chunk = &mut chunks[j];
            match action {
                Action::RecvActivation { .. } | Action::RecvGrad { .. } => {
                    // An activation comes from chunk c − 1, a gradient from chunk c + 1.
                    let (dir, peer, into, label) = match action {
                        Action::RecvActivation { .. } => {
                            (Direction::Activation, c - 1, &mut inputs, "recv act ")
                        }
                        _ => (Direction::Grad, c + 1, &mut upstream, "recv grad "),
                    };
                    let t = Instant::now();
                    let home = chunk.activation_home();
                    let received = timed(
                        &mut timeline,
                        || name(label, c, i),
                        Category::RecvWait,
                        Some(i),
                        || recv_tensor(group, peer % p, tag_for(c, i, dir), &home),
                    )?;
                    report.recv_wait_s += t.elapsed().as_secs_f64();
                    into.insert((c, i), received);
                }
                Action::SendActivation { .. } | Action::SendGrad { .. } => {
                    // The output goes to chunk c + 1, the input gradient to chunk c − 1.
                    let (dir, peer, from, label) = match action {
                        Action::SendActivation { .. } => {
                            (Direction::Activation, c + 1, &mut outputs, "send act ")
                        }
                        _ => (Direction::Grad, c - 1, &mut input_grads, "send grad "),
                    };
                    let tensor = take(from, (c, i), action)?;
                    finish_done(&mut pending, &mut timeline)?;
                    let transfer = timeline.is_some().then(|| {
                        let kind = label.replacen("send", "xfer", 1);
                        (name(&kind, c, i), i)
                    });
                    timed(
                        &mut timeline,
                        || name(label, c, i),
                        Category::Send,
                        Some(i),
                        || {
                            let to = (peer % p, tag_for(peer, i, dir));
                            post_send(group, tensor, to, options.sends, &mut pending, transfer)
                        },
                    )?;
                }
                Action::Forward { .. } => {
                    let x = if c == 0 {
                        first_inputs[i].take().ok_or_else(|| {
                            PipelineError::InvalidSchedule(format!("{action:?} runs twice"))
                        })?
                    } else {
                        take(&mut inputs, (c, i), action)?
                    };
                    let targets = (c == last).then(|| targets[i].as_slice());
                    let t = Instant::now();
                    let mut host_timeline = begin_pass(&mut chunk.device, &mut timeline);
                    let (acts, out) = timed(
                        &mut host_timeline,
                        || name("F", c, i),
                        Category::Forward,
                        Some(i),
                        || {
                            let (y, acts) = forward_chunk(
                                model,
                                chunk,
                                hooks.chunk_params(j),
                                x,
                                Mode::TRAIN,
                                options.recompute,
                            );
                            let out = match targets {
                                Some(t) => {
                                    chunk_loss(chunk, options.loss.as_ref(), y, t, grad_scale)
                                        .map(|(value, dlogits)| Produced::Loss(value, dlogits))
                                }
                                None => Ok(Produced::Output(y)),
                            };
                            (acts, out)
                        },
                    );
                    end_pass(
                        &mut chunk.device,
                        &mut device_spans[j],
                        Category::Forward,
                        i,
                        || timeline.is_some().then(|| name("F", c, i)),
                    );
                    report.forward_s += t.elapsed().as_secs_f64();
                    in_flight += acts.bytes();
                    report.peak_activation_bytes = report.peak_activation_bytes.max(in_flight);
                    stash.insert((c, i), acts);
                    match out? {
                        Produced::Loss(value, dlogits) => {
                            match value {
                                Some(value) => {
                                    loss_sum += value.mean as f64;
                                    if let Some(ok) = value.correct {
                                        *correct.get_or_insert(0) += ok;
                                    }
                                }
                                None => {
                                    on_device += 1;
                                    device_targets += targets.map_or(0, <[u32]>::len);
                                }
                            }
                            upstream.insert((c, i), dlogits);
                        }
                        Produced::Output(y) if p == 1 => {
                            inputs.insert((c + 1, i), y);
                        }
                        Produced::Output(y) => {
                            outputs.insert((c, i), y);
                        }
                    }
                }
                Action::Backward { .. } => {
                    let dy = take(&mut upstream, (c, i), action)?;
                    let acts = take(&mut stash, (c, i), action)?;
                    in_flight -= acts.bytes();
                    let is_final = final_backward.get(&c) == Some(&pos);
                    let base = model.blocks_param_range(chunk.blocks.clone()).start;
                    let t = Instant::now();
                    let mut host_timeline = begin_pass(&mut chunk.device, &mut timeline);
                    let dx = timed(
                        &mut host_timeline,
                        || name("B", c, i),
                        Category::Backward,
                        Some(i),
                        || {
                            if let Some(params) = hooks.chunk_params(j) {
                                let mut bound =
                                    params.bind(model, &mut chunk.store, chunk.device.as_mut());
                                return model.backward_with(bound.as_mut(), acts, dy, c > 0);
                            }
                            let grads = chunk.grads_buf();
                            let StageChunk { store, device, .. } = chunk;
                            let mut ready = |block: usize, store: &mut ParamStore| {
                                if is_final {
                                    let r = model.block_param_range(block);
                                    hooks.grads_ready(GradsReady {
                                        chunk: c,
                                        block,
                                        range: r.start - base..r.end - base,
                                        grads,
                                        store,
                                    });
                                }
                            };
                            match device {
                                Some(d) => {
                                    let mut on_device = |block: usize| ready(block, store);
                                    let mut bound = d.bind(model, &mut on_device);
                                    model.backward_with(bound.as_mut(), acts, dy, c > 0)
                                }
                                None => model.backward_local(store, acts, dy, c > 0, &mut ready),
                            }
                        },
                    );
                    end_pass(
                        &mut chunk.device,
                        &mut device_spans[j],
                        Category::Backward,
                        i,
                        || timeline.is_some().then(|| name("B", c, i)),
                    );
                    report.backward_s += t.elapsed().as_secs_f64();
                    if c > 0 {
                        let dx = dx.ok_or_else(|| {
                            PipelineError::InvalidSchedule(format!(
                                "chunk {c} produced no input gradient"
                            ))
                        })?;
                        if p == 1 {
                            upstream.insert((c - 1, i), dx);
                        } else {
                            input_grads.insert((c, i), dx);
                        }
                    }
                }
            }
        }
        finish_all(pending, &mut timeline)?;
        // On a device the host saw launches: the passes' times (and their spans in the
        // timeline), the peak and the loss sums are the device's (the host waits for it here).
        let mut device_times = None::<(f64, f64)>;
        for (chunk, labels) in chunks.iter_mut().zip(&mut device_spans) {
            let Some(d) = &mut chunk.device else {
                continue;
            };
            let t = device_times.get_or_insert((0.0, 0.0));
            for ((start, end), (category, micro, label)) in
                d.take_spans().into_iter().zip(labels.drain(..))
            {
                let seconds = end.saturating_duration_since(start).as_secs_f64();
                match category {
                    Category::Forward => t.0 += seconds,
                    _ => t.1 += seconds,
                }
                if let (Some(timeline), Some(label)) = (timeline.as_deref_mut(), label) {
                    timeline.record(label, category, start, end, Some(micro));
                }
            }
            if chunk.index == last && on_device > 0 {
                let (sum, right) = d.take_sums(super::device::Sums::Train);
                // The per-target sums as the mean of each micro-batch's mean (equal sizes).
                loss_sum += sum * on_device as f64 / device_targets.max(1) as f64;
                *correct.get_or_insert(0) += right as usize;
            }
        }
        if let Some((f, b)) = device_times {
            (report.forward_s, report.backward_s) = (f, b);
        }
        if schedule.worker_of(last) == self.rank {
            report.loss = Some((loss_sum / m as f64) as f32);
            report.correct = correct;
        }
        report.wall_s = started.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Forward-only pass in evaluation mode (validation): each of `batches`' micro-batches
    /// (any number of them) flows through the chunks in model order, no activations are
    /// kept. Returns each micro-batch's loss on the worker of the last chunk, `None`
    /// elsewhere. Every worker visits its (micro-batch, chunk) pairs in the same global
    /// order, so the blocking receives cannot deadlock.
    pub fn evaluate(
        &mut self,
        model: &Model,
        group: &dyn ProcessGroup,
        batches: MicroBatches,
        options: &StepOptions,
        hooks: &mut dyn StepHooks,
    ) -> Result<Option<Vec<LossValue>>, PipelineError> {
        let m = batches.inputs.len().max(batches.targets.len());
        self.check_step(group, &batches, m)?;
        let MicroBatches { inputs, targets } = batches;
        let mut first_inputs = inputs.into_iter();
        let p = self.schedule.workers;
        let last = self.schedule.num_chunks() - 1;
        let tag_for =
            |chunk: usize, micro: usize| tag(chunk, micro, Direction::Activation, last + 1);
        let mut pending = Vec::new();
        let mut losses = Vec::new();
        for chunk in self.chunks.iter_mut() {
            if let Some(d) = &mut chunk.device {
                d.begin();
            }
        }
        for i in 0..m {
            let mut carried: Option<Tensor> = None;
            for (j, chunk) in self.chunks.iter_mut().enumerate() {
                let c = chunk.index;
                let x = match (c, carried.take()) {
                    (0, _) => first_inputs.next().ok_or_else(|| {
                        PipelineError::InvalidSchedule(format!("no input for micro-batch {i}"))
                    })?,
                    (_, Some(x)) => x, // p = 1: the previous chunk is ours
                    (_, None) => {
                        let home = chunk.activation_home();
                        recv_tensor(group, (c - 1) % p, tag_for(c, i), &home)?
                    }
                };
                let (y, _) =
                    forward_chunk(model, chunk, hooks.chunk_params(j), x, Mode::EVAL, false);
                if c == last {
                    let t = targets.get(i).ok_or_else(|| {
                        PipelineError::InvalidSchedule(format!("no targets for micro-batch {i}"))
                    })?;
                    losses.push(match &mut chunk.device {
                        Some(d) => match d.loss(options.loss.as_ref(), y, t, None)?.0 {
                            Some(value) => value,
                            None => {
                                let (sum, right) = d.take_sums(super::device::Sums::Eval);
                                LossValue {
                                    mean: (sum / t.len().max(1) as f64) as f32,
                                    count: t.len(),
                                    correct: Some(right as usize),
                                }
                            }
                        },
                        None => options.loss.forward(&y, t)?,
                    });
                } else if p == 1 {
                    carried = Some(y);
                } else {
                    finish_done(&mut pending, &mut None)?;
                    let to = ((c + 1) % p, tag_for(c + 1, i));
                    post_send(group, y, to, options.sends, &mut pending, None)?;
                }
            }
        }
        finish_all(pending, &mut None)?;
        let holds_last = self.schedule.worker_of(last) == self.rank;
        Ok(holds_last.then_some(losses))
    }

    /// Checks the group and that `batches` holds `m` micro-batches where they are read.
    fn check_step(
        &self,
        group: &dyn ProcessGroup,
        batches: &MicroBatches,
        m: usize,
    ) -> Result<(), PipelineError> {
        let s = &self.schedule;
        let chunks = s.num_chunks();
        if group.size() != s.workers || group.rank() != self.rank {
            return Err(PipelineError::GroupMismatch {
                group_size: group.size(),
                group_rank: group.rank(),
                workers: s.workers,
                stage_rank: self.rank,
            });
        }
        if self.chunks.iter().any(|c| c.index == 0) && batches.inputs.len() != m {
            return Err(PipelineError::SizeMismatch {
                what: "micro-batch inputs on the first stage",
                got: batches.inputs.len(),
                expected: m,
            });
        }
        if self.chunks.iter().any(|c| c.index == chunks - 1) && batches.targets.len() != m {
            return Err(PipelineError::SizeMismatch {
                what: "micro-batch targets on the last stage",
                got: batches.targets.len(),
                expected: m,
            });
        }
        let needed = m * chunks * 2;
        if needed > TAG_LIMIT {
            return Err(PipelineError::TagSpace {
                micro_batches: m,
                chunks,
                needed,
                limit: TAG_LIMIT,
            });
        }
        Ok(())
    }
}

/// Removes the tensor an action needs; a missing one means the program is out of order.
fn take<T>(
    map: &mut HashMap<(usize, usize), T>,
    key: (usize, usize),
    action: Action,
) -> Result<T, PipelineError> {
    map.remove(&key).ok_or_else(|| {
        PipelineError::InvalidSchedule(format!("{action:?} found nothing to work on"))
    })
}
