//! A chunk's flat state on a device: the line below which the one step is device-specific.
//!
//! On the CPU a chunk's parameters, gradients, buffers and optimizer moments are the vectors
//! of its [`ParamStore`] and its [`Optimizer`]. On a GPU they live in device memory for the
//! whole run, and the host keeps no copy of them: a checkpoint reads them a bounded piece at
//! a time ([`DeviceState::read`]) and loading writes them a tensor at a time
//! ([`DeviceState::write`]); only what needs the whole state on the host (a gather-first
//! whole file, the evaluation hook) fills the host store for as long as it runs
//! ([`DeviceState::download`], then freed). The executor, the
//! data-parallel modes, the tied sums, clipping, loss scaling and the optimizer reach that
//! state only through a [`StageChunk`](super::StageChunk)'s methods, which go to the store
//! or to this trait: nothing above the engine asks which device a run is on.
//!
//! Implementations: the CUDA one (`cuda_chunk.rs`: the kernels of
//! `meshtrain_tensor::cuda::train_ops`, events for timing, the allocator's peak for memory)
//! and [`StandIn`], a device whose memory is the host's, with which the tests run the device
//! half of the step on machines without a GPU (its arithmetic is the host's, so a run placed
//! on it must equal the host run bit for bit).
//!
//! Errors inside a step are raised as device panics (`meshtrain_tensor::cuda::error::raise`)
//! and turned into errors, with out-of-memory advice, around the whole step by the caller;
//! placement and the checkpoint copies return them.

use super::flat::{FlatMemory, HostFlat};
use super::PipelineError;
use meshtrain_comm::RawBuf;
use meshtrain_nn::optim::{sum_of_squares, Optimizer};
use meshtrain_nn::{BlockParams, Loss, LossError, LossValue, Model, ParamStore, Params, ParamsMut};
use meshtrain_tensor::{Device, Tensor};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// A GPU's memory, for reports.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct DeviceMemory {
    /// "cuda:0 (NVIDIA H100 80GB HBM3)".
    pub device: String,
    /// Bytes held by live tensors and buffers now, and at most since the run started.
    pub in_use_bytes: usize,
    pub peak_bytes: usize,
    /// Freed blocks the allocator keeps for reuse.
    pub cached_bytes: usize,
    /// Calls to the driver's allocation (flat after the first step).
    pub device_allocs: u64,
    /// Held by the device's libraries for the run's life (cuBLASLt's workspace), within
    /// `in_use_bytes`.
    pub library_bytes: usize,
    pub total_bytes: usize,
}

/// One of a chunk's state vectors, as a checkpoint reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum StateKind {
    /// The fp32 parameters (under ZeRO-3 this rank's pieces).
    Values,
    Buffers,
    /// The optimizer's first moment (SGD's momentum), and AdamW's second.
    FirstMoment,
    SecondMoment,
}

impl StateKind {
    /// Everything a checkpoint holds.
    pub const ALL: [StateKind; 4] = [
        StateKind::Values,
        StateKind::Buffers,
        StateKind::FirstMoment,
        StateKind::SecondMoment,
    ];
    /// The model alone: what evaluating or sampling from it needs.
    pub const MODEL: [StateKind; 2] = [StateKind::Values, StateKind::Buffers];

    /// The host vector holding this kind: of the store, or of the optimizer.
    pub fn on_host<'a>(self, store: &'a ParamStore, optimizer: &'a Optimizer) -> &'a Vec<f32> {
        match self {
            StateKind::Values => &store.values,
            StateKind::Buffers => &store.buffers,
            StateKind::FirstMoment => &optimizer.m,
            StateKind::SecondMoment => &optimizer.v,
        }
    }

    /// [`StateKind::on_host`], to write.
    pub fn on_host_mut<'a>(
        self,
        store: &'a mut ParamStore,
        optimizer: &'a mut Optimizer,
    ) -> &'a mut Vec<f32> {
        match self {
            StateKind::Values => &mut store.values,
            StateKind::Buffers => &mut store.buffers,
            StateKind::FirstMoment => &mut optimizer.m,
            StateKind::SecondMoment => &mut optimizer.v,
        }
    }
}

/// Which of the two loss sums a device keeps: the training step's or evaluation's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sums {
    Train,
    Eval,
}

/// One chunk's parameters, gradients, buffers and optimizer moments on a device, and the
/// arithmetic a step does over them. Ranges are chunk-local (0 is the chunk's first
/// parameter).
pub trait DeviceState: Send {
    /// The device the state lives on.
    fn device(&self) -> Device;

    /// "cuda:0 (NVIDIA H100 80GB HBM3, sm_90)", for the run's first lines.
    fn describe(&self) -> String;

    /// The device's memory now.
    fn memory(&self) -> DeviceMemory;

    /// Bytes of (parameters with their 16-bit copy, gradients, optimizer moments).
    fn state_bytes(&self) -> (usize, usize, usize);

    /// Replaces the device state by `store`'s values and buffers and `optimizer`'s moments
    /// (gradients zeroed).
    fn upload(&mut self, store: &ParamStore, optimizer: &Optimizer) -> Result<(), PipelineError>;

    /// Elements of one of the state's vectors (ZeRO's pieces count as they are held).
    fn state_len(&self, kind: StateKind) -> usize;

    /// Copies `into.len()` elements of `kind` from element `at` on into `into`: a checkpoint
    /// reads the device this way, a bounded piece at a time, with no copy of the whole state
    /// on the host.
    fn read(&self, kind: StateKind, at: usize, into: &mut [f32]) -> Result<(), PipelineError>;

    /// Writes `from` over `from.len()` elements of `kind` from element `at` on (a checkpoint
    /// being loaded, one tensor at a time); after parameters, call
    /// [`DeviceState::values_changed`].
    fn write(&mut self, kind: StateKind, at: usize, from: &[f32]) -> Result<(), PipelineError>;

    /// Copies the `kinds` of the values, buffers and moments into `store` and `optimizer`,
    /// sized to the device's (a transient host copy, for what needs the whole state on the
    /// host: a gather-first whole-file checkpoint, the model for the evaluation hook).
    fn download(
        &self,
        store: &mut ParamStore,
        optimizer: &mut Optimizer,
        kinds: &[StateKind],
    ) -> Result<(), PipelineError> {
        for &kind in kinds {
            let into = kind.on_host_mut(store, optimizer);
            into.clear();
            into.resize(self.state_len(kind), 0.0);
            self.read(kind, 0, into)?;
        }
        Ok(())
    }

    /// The chunk's blocks (of `model`) as [`BlockParams`] over the device buffers for one
    /// pass; `on_ready(block)` is called as each block's backward ends.
    fn bind<'a>(
        &'a mut self,
        model: &'a Model,
        on_ready: &'a mut dyn FnMut(usize),
    ) -> Box<dyn BlockParams + 'a>;

    /// Block `block`'s (of `model`) parameters and buffers as the device's views, for a
    /// dimension that hands the passes its own gradient or parameter buffers (ZeRO-2/3); the
    /// parameters only when the state holds the whole chunk's (not ZeRO-3's pieces).
    fn block_views(&mut self, model: &Model, block: usize) -> (Option<Params<'_>>, ParamsMut<'_>);

    /// Before a step's or an evaluation's passes: binds the device to this thread, and
    /// anchors its clock to the host's (the device is idle here: the last update waited).
    fn begin(&mut self);

    /// The loss of `output` (the last chunk's) against `targets`, with the gradient of
    /// `grad_scale × mean` when given. A value of `None` means the per-target sums were added
    /// on the device, into the training or evaluation sums (`grad_scale` given or not), for
    /// [`DeviceState::take_sums`].
    fn loss(
        &mut self,
        loss: &dyn Loss,
        output: Tensor,
        targets: &[u32],
        grad_scale: Option<f32>,
    ) -> Result<(Option<LossValue>, Option<Tensor>), LossError>;

    /// Σ loss and Σ correct added on the device since the last call (the host waits for the
    /// device), then zeroed.
    fn take_sums(&mut self, which: Sums) -> (f64, f64);

    /// Starts timing a pass on the device's own clock (the host only sees launches).
    fn begin_span(&mut self);

    /// Ends the span begun last.
    fn end_span(&mut self);

    /// When the spans ended since the last call ran on the device, in the order they ended,
    /// on the host's clock through the anchor of [`DeviceState::begin`] (the host waits for
    /// the device).
    fn take_spans(&mut self) -> Vec<(Instant, Instant)>;

    /// The whole gradient buffer, for collectives (a view of the device's memory). Its
    /// address stays the same for the state's life ([`DeviceState::upload`] writes into it),
    /// so a dimension may keep the view (ZeRO-2 adds its pieces there).
    fn grads(&mut self) -> RawBuf;

    /// The whole fp32 parameter buffer, for collectives (ZeRO's all-gather of the updated
    /// pieces). Its address stays the same for the state's life, as the gradients' does
    /// (ZeRO-3 keeps the view).
    fn values(&mut self) -> RawBuf;

    /// The parameters were written from outside ([`DeviceState::values`]): refresh what is
    /// derived from them (the 16-bit compute copy).
    fn values_changed(&mut self);

    /// The device's memory for a dimension's own flat buffers and copy plans (ZeRO's).
    fn flat_memory(&self) -> Arc<dyn FlatMemory>;

    /// Where the chunk's activations live, so that a pipeline's received tensors land there:
    /// the host's memory unless the passes run on a GPU (the stand-in's run on the host).
    fn activation_home(&self) -> super::transport::ActivationHome {
        super::transport::ActivationHome::Host
    }

    /// Gradients `a` and `b` (of equal length) both become `a + b`.
    fn tie_sum(&mut self, a: Range<usize>, b: Range<usize>);

    /// Gradients `src` copied over `dst`.
    fn copy_grads(&mut self, dst: Range<usize>, src: Range<usize>);

    /// Multiplies every gradient by `inverse`; whether any became inf or NaN.
    fn unscale_check(&mut self, inverse: f32) -> bool;

    /// `Σ g²` over the gradients outside `skip` (sorted, disjoint).
    fn grad_sum_of_squares(&mut self, skip: &[Range<usize>]) -> f64;

    /// The gradient norm outside `skip`, when this chunk alone makes up the whole gradient;
    /// with `max_norm`, the clipping factor is kept for the next [`DeviceState::step`]
    /// (gradients untouched until then: one pass fewer over them).
    fn norm_and_clip(&mut self, skip: &[Range<usize>], max_norm: Option<f32>) -> f32;

    /// Gradients times `k`.
    fn scale_grads(&mut self, k: f32);

    /// One update by `optimizer`'s rule (its step counter advanced; its moments are the
    /// device's from the last upload on) at `lr`, then the gradients zeroed.
    fn step(&mut self, optimizer: &mut Optimizer, lr: f32);

    /// Gradients set to zero.
    fn zero_grads(&mut self);

    /// Returns once the work queued on the device so far has run (so the host's clock
    /// covers it).
    fn wait(&mut self);

    /// Before a training step's work, when the run replays its steps as CUDA graphs
    /// (`train.cuda_graph`) and this chunk is the whole step of the only worker: a device
    /// that can captures this step, or compares it with the captured one
    /// (`meshtrain_tensor::cuda::graph`).
    fn begin_step_graph(&mut self) {}

    /// After the step's update: whether it ran as a replay, and what to say once.
    fn end_step_graph(&mut self) -> StepGraphOutcome {
        StepGraphOutcome {
            replayed: false,
            note: None,
        }
    }
}

/// How a step asked to run as CUDA graphs went ([`DeviceState::end_step_graph`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepGraphOutcome {
    pub replayed: bool,
    /// Said once: the step was captured, or why it runs eagerly from now on.
    pub note: Option<String>,
}

impl DeviceMemory {
    pub fn report(&self) -> String {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        format!(
            "GPU memory on {}: peak {:.0} MiB held by tensors, {:.0} MiB now ({:.0} MiB of it \
             cuBLASLt's workspace), {:.0} MiB cached for reuse, {} device allocations, of \
             {:.0} MiB",
            self.device,
            mib(self.peak_bytes),
            mib(self.in_use_bytes),
            mib(self.library_bytes),
            mib(self.cached_bytes),
            self.device_allocs,
            mib(self.total_bytes)
        )
    }
}

impl std::fmt::Debug for dyn DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Where a chunk sits in the whole model, for a device state to find its blocks' parameters
/// and buffers within the chunk's flat buffers.
#[derive(Clone, Debug, Default)]
pub struct ChunkPlace {
    params: Range<usize>,
    buffers_start: usize,
}

impl ChunkPlace {
    /// The chunk holding `blocks` of `model`.
    pub fn of(model: &Model, blocks: Range<usize>) -> ChunkPlace {
        ChunkPlace {
            params: model.blocks_param_range(blocks.clone()),
            buffers_start: model.blocks_buffer_range(blocks).start,
        }
    }

    /// Whether `values` parameters are the chunk's whole parameters (not ZeRO-3's pieces of
    /// them).
    pub fn holds_whole(&self, values: usize) -> bool {
        values == self.params.len()
    }

    /// Block `block`'s (of `model`) parameters and buffers within the chunk.
    pub fn block(&self, model: &Model, block: usize) -> (Range<usize>, Range<usize>) {
        let p = model.block_param_range(block);
        let b = model.blocks_buffer_range(block..block + 1);
        let (pb, bb) = (self.params.start, self.buffers_start);
        (p.start - pb..p.end - pb, b.start - bb..b.end - bb)
    }
}

/// Elements of a placed chunk's gradient buffer: the chunk's parameters, or, when its store
/// holds no gradients (ZeRO-2 keeps this rank's pieces of them instead), the optimizer's
/// (the pieces it updates).
pub fn gradient_len(store: &ParamStore, optimizer: &Optimizer) -> usize {
    if store.grads.is_empty() && !store.values.is_empty() {
        optimizer.m.len()
    } else {
        store.values.len()
    }
}

/// Ranges of `0..len` outside `skip` (sorted, disjoint).
pub fn kept_ranges(skip: &[Range<usize>], len: usize) -> Vec<Range<usize>> {
    let mut kept = Vec::with_capacity(skip.len() + 1);
    let mut at = 0;
    for s in skip {
        kept.push(at..s.start);
        at = s.end;
    }
    kept.push(at..len);
    kept
}

/// `Σ g²` over `grads` outside `skip` (sorted, disjoint), the kept runs added in order (the
/// host's gradient norm, tied copies counted once).
pub fn sum_of_squares_outside(grads: &[f32], skip: &[Range<usize>]) -> f64 {
    let mut sum = 0.0;
    for kept in kept_ranges(skip, grads.len()) {
        sum += sum_of_squares(&grads[kept]);
    }
    sum
}

/// Multiplies every gradient by `factor` and tells whether any is inf or NaN (one pass, over
/// the cores).
pub fn unscale(grads: &mut [f32], factor: f32) -> bool {
    let chunk = meshtrain_tensor::par::PARALLEL_MIN_LEN;
    meshtrain_tensor::par::map_chunks_mut(grads, chunk, |_, part| {
        let mut bad = false;
        for v in part.iter_mut() {
            *v *= factor;
            bad |= !v.is_finite();
        }
        bad
    })
    .into_iter()
    .any(|bad| bad)
}

/// The clipping factor for a gradient of norm `norm` under `max_norm` (as
/// `optim::clip_grad_norm`): `None` when nothing is clipped.
pub fn clip_factor(norm: f32, max_norm: f32) -> Option<f32> {
    (norm > max_norm && norm > 0.0).then(|| max_norm / (norm + 1e-6))
}

/// The device the stand-in's gradient buffers say they are in, so that collectives treat them
/// as a GPU's (the host backends refuse them; [`StandInMemory`] stages them).
pub const STAND_IN_GPU: Device = Device::Cuda(0);

/// The stand-in's memory as a `StagedGroup` sees it: [`STAND_IN_GPU`]'s addresses are host
/// addresses, so staging copies are `memcpy`s. With it, a run on the stand-in reduces DDP's
/// buckets through staging (inputs down in the hook, the host operation, outputs up on the
/// staging thread), as ranks sharing one GPU do.
pub struct StandInMemory;

impl meshtrain_comm::DeviceMemory for StandInMemory {
    fn device(&self) -> Device {
        STAND_IN_GPU
    }

    fn host_stage(&self, bytes: usize) -> Result<meshtrain_comm::HostStage, String> {
        Ok(meshtrain_comm::HostStage::heap(bytes))
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        // SAFETY: `src` is a stand-in buffer's host address, valid for `dst.len()` bytes
        // while the operation that staged it runs (the RawBuf contract).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        // SAFETY: as for `download`; the destination is the operation's output.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn alloc(&self, bytes: usize) -> Result<meshtrain_comm::DeviceAlloc, String> {
        let mut words = vec![0u64; bytes.div_ceil(8)];
        let addr = words.as_mut_ptr() as u64;
        Ok(meshtrain_comm::DeviceAlloc::new(
            addr,
            bytes,
            STAND_IN_GPU,
            Box::new(words),
        ))
    }
}

/// A device whose memory is the host's: the device half of the step (placement, bound
/// views, grads-ready from `backward_done`, loss sums kept "on the device", the mirror's
/// copies, flat arithmetic through this trait) run without a GPU. Its arithmetic is the
/// host's, in the host's order, so a run on it equals the host run bit for bit; the loss it
/// reports is summed per target as a GPU's is.
#[derive(Debug, Default)]
pub struct StandIn {
    values: Vec<f32>,
    grads: Vec<f32>,
    buffers: Vec<f32>,
    /// The optimizer's moments live on the device, as a GPU's do (the host's optimizer keeps
    /// only its settings and step count while the chunk is placed).
    moments: Option<Optimizer>,
    /// See [`gradient_len`].
    grads_len: usize,
    /// Whether `values` are the chunk's whole parameters (not ZeRO-3's pieces of them).
    whole: bool,
    place: ChunkPlace,
    /// (Σ loss, Σ correct) of training and of evaluation.
    sums: [(f64, f64); 2],
    clip: Option<f32>,
    span: Option<Instant>,
    spans: Vec<(Instant, Instant)>,
    /// Copies between the host store and this "device", for tests: (uploads, downloads).
    pub copies: (usize, usize),
}

impl StandIn {
    /// The state of a chunk holding `blocks` of `model`, from `store` and `optimizer`.
    pub fn place(
        model: &Model,
        blocks: Range<usize>,
        store: &ParamStore,
        optimizer: &Optimizer,
    ) -> Result<StandIn, PipelineError> {
        let place = ChunkPlace::of(model, blocks);
        let mut state = StandIn {
            grads_len: gradient_len(store, optimizer),
            whole: place.holds_whole(store.values.len()),
            place,
            moments: Some(optimizer.clone()),
            ..StandIn::default()
        };
        state.upload(store, optimizer)?;
        Ok(state)
    }
}

/// An access past the end of a device's state vector, as an error naming it.
pub fn out_of_range(what: &str, kind: StateKind, at: usize, len: usize) -> PipelineError {
    PipelineError::Device(format!(
        "{what} elements {at}..{} of the {kind:?}: past the end of the device's",
        at + len
    ))
}

impl StandIn {
    fn state(&self, kind: StateKind) -> &[f32] {
        let moments = self.moments.as_ref();
        match kind {
            StateKind::Values => &self.values,
            StateKind::Buffers => &self.buffers,
            StateKind::FirstMoment => moments.map_or(&[], |o| &o.m),
            StateKind::SecondMoment => moments.map_or(&[], |o| &o.v),
        }
    }
}

struct StandInBlocks<'a> {
    model: &'a Model,
    state: &'a mut StandIn,
    on_ready: &'a mut dyn FnMut(usize),
}

/// `buf` tagged as the stand-in GPU's memory, so collectives stage it as a GPU's
/// ([`StandInMemory`]).
fn stand_in_view(buf: &mut [f32]) -> RawBuf {
    // SAFETY: the stand-in's buffers live as long as the state and keep their addresses
    // (see `DeviceState::grads`); callers keep the collectives' exclusive use of them (the
    // RawBuf contract).
    unsafe {
        RawBuf::on_device(
            buf.as_mut_ptr() as u64,
            buf.len(),
            meshtrain_comm::DType::F32,
            STAND_IN_GPU,
        )
    }
}

impl BlockParams for StandInBlocks<'_> {
    fn forward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>) {
        let (p, b) = self.state.place.block(self.model, block);
        let s = &mut *self.state;
        (
            Params::Host(&s.values[p]),
            ParamsMut::Host(&mut s.buffers[b]),
        )
    }

    fn backward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>, ParamsMut<'_>) {
        let (p, b) = self.state.place.block(self.model, block);
        let s = &mut *self.state;
        (
            Params::Host(&s.values[p.clone()]),
            ParamsMut::Host(&mut s.grads[p]),
            ParamsMut::Host(&mut s.buffers[b]),
        )
    }

    fn backward_done(&mut self, block: usize) {
        (self.on_ready)(block)
    }
}

impl DeviceState for StandIn {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn describe(&self) -> String {
        "a stand-in device in host memory".into()
    }

    fn memory(&self) -> DeviceMemory {
        DeviceMemory {
            device: self.describe(),
            ..DeviceMemory::default()
        }
    }

    fn state_bytes(&self) -> (usize, usize, usize) {
        (self.values.len() * 4, self.grads.len() * 4, 0)
    }

    fn upload(&mut self, store: &ParamStore, optimizer: &Optimizer) -> Result<(), PipelineError> {
        // In place once allocated (equal lengths reuse the allocation): the buffers keep
        // their addresses for the state's life.
        self.values.clone_from(&store.values);
        self.buffers.clone_from(&store.buffers);
        self.grads.clear();
        self.grads.resize(self.grads_len, 0.0);
        // Moments of another length (none loaded: starting from weights) start at zero, as
        // a GPU's do.
        let own = self
            .moments
            .as_mut()
            .expect("a placed stand-in has moments");
        for (mine, host) in [(&mut own.m, &optimizer.m), (&mut own.v, &optimizer.v)] {
            if host.len() == mine.len() {
                mine.copy_from_slice(host);
            } else {
                mine.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        own.step = optimizer.step;
        self.copies.0 += 1;
        Ok(())
    }

    fn state_len(&self, kind: StateKind) -> usize {
        self.state(kind).len()
    }

    fn read(&self, kind: StateKind, at: usize, into: &mut [f32]) -> Result<(), PipelineError> {
        let piece = self.state(kind).get(at..at + into.len());
        into.copy_from_slice(piece.ok_or_else(|| out_of_range("reading", kind, at, into.len()))?);
        Ok(())
    }

    fn write(&mut self, kind: StateKind, at: usize, from: &[f32]) -> Result<(), PipelineError> {
        let moments = self.moments.as_mut();
        let held: &mut [f32] = match kind {
            StateKind::Values => &mut self.values,
            StateKind::Buffers => &mut self.buffers,
            StateKind::FirstMoment => moments.map_or(&mut [], |o| &mut o.m),
            StateKind::SecondMoment => moments.map_or(&mut [], |o| &mut o.v),
        };
        let piece = held.get_mut(at..at + from.len());
        piece
            .ok_or_else(|| out_of_range("writing", kind, at, from.len()))?
            .copy_from_slice(from);
        Ok(())
    }

    fn bind<'a>(
        &'a mut self,
        model: &'a Model,
        on_ready: &'a mut dyn FnMut(usize),
    ) -> Box<dyn BlockParams + 'a> {
        Box::new(StandInBlocks {
            model,
            state: self,
            on_ready,
        })
    }

    fn block_views(&mut self, model: &Model, block: usize) -> (Option<Params<'_>>, ParamsMut<'_>) {
        let (p, b) = self.place.block(model, block);
        let values = self.whole.then(|| Params::Host(&self.values[p]));
        (values, ParamsMut::Host(&mut self.buffers[b]))
    }

    fn begin(&mut self) {}

    fn loss(
        &mut self,
        loss: &dyn Loss,
        output: Tensor,
        targets: &[u32],
        grad_scale: Option<f32>,
    ) -> Result<(Option<LossValue>, Option<Tensor>), LossError> {
        let (value, grad) = match grad_scale {
            Some(s) => {
                let (v, g) = loss.forward_backward(&output, targets, s)?;
                (v, Some(g))
            }
            None => (loss.forward(&output, targets)?, None),
        };
        let sums = &mut self.sums[usize::from(grad_scale.is_none())];
        sums.0 += value.mean as f64 * value.count as f64;
        sums.1 += value.correct.unwrap_or(0) as f64;
        Ok((None, grad))
    }

    fn take_sums(&mut self, which: Sums) -> (f64, f64) {
        std::mem::take(&mut self.sums[usize::from(which == Sums::Eval)])
    }

    fn begin_span(&mut self) {
        self.span = Some(Instant::now());
    }

    fn end_span(&mut self) {
        if let Some(start) = self.span.take() {
            self.spans.push((start, Instant::now()));
        }
    }

    fn take_spans(&mut self) -> Vec<(Instant, Instant)> {
        std::mem::take(&mut self.spans)
    }

    fn grads(&mut self) -> RawBuf {
        stand_in_view(&mut self.grads)
    }

    fn values(&mut self) -> RawBuf {
        stand_in_view(&mut self.values)
    }

    fn values_changed(&mut self) {}

    fn flat_memory(&self) -> Arc<dyn FlatMemory> {
        Arc::new(HostFlat {
            device: STAND_IN_GPU,
        })
    }

    fn tie_sum(&mut self, a: Range<usize>, b: Range<usize>) {
        for (i, j) in a.zip(b) {
            let s = self.grads[i] + self.grads[j];
            self.grads[i] = s;
            self.grads[j] = s;
        }
    }

    fn copy_grads(&mut self, dst: Range<usize>, src: Range<usize>) {
        self.grads.copy_within(src, dst.start);
    }

    fn unscale_check(&mut self, inverse: f32) -> bool {
        unscale(&mut self.grads, inverse)
    }

    fn grad_sum_of_squares(&mut self, skip: &[Range<usize>]) -> f64 {
        sum_of_squares_outside(&self.grads, skip)
    }

    fn norm_and_clip(&mut self, skip: &[Range<usize>], max_norm: Option<f32>) -> f32 {
        let norm = self.grad_sum_of_squares(skip).sqrt() as f32;
        self.clip = max_norm.and_then(|m| clip_factor(norm, m));
        norm
    }

    fn scale_grads(&mut self, k: f32) {
        self.grads.iter_mut().for_each(|g| *g *= k);
    }

    fn step(&mut self, optimizer: &mut Optimizer, lr: f32) {
        if let Some(k) = self.clip.take() {
            self.scale_grads(k);
        }
        // The host's optimizer brings the step count; the moments are this device's.
        let own = self
            .moments
            .as_mut()
            .expect("a placed stand-in has moments");
        own.step = optimizer.step;
        own.step(&mut self.values, &self.grads, lr);
        optimizer.step = own.step;
        self.zero_grads();
    }

    fn zero_grads(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = 0.0);
    }

    fn wait(&mut self) {}
}
