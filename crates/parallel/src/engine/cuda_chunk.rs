//! A chunk's flat state on a CUDA GPU ([`DeviceState`]): values (and their 16-bit compute
//! copy under mixed precision), gradients, buffers and optimizer moments in device memory for
//! the whole run. Layers choose their CUDA kernels from the device views [`CudaChunk::bind`]
//! gives them; the loss adds its sums on the device; norms, clipping, fp16 unscaling, tied
//! sums and the optimizer run as the kernels of `meshtrain_tensor::cuda::train_ops`. Pass
//! times come from events on the compute stream. The host reads a few bytes per step.
//!
//! Inside a step, errors are raised as device panics and caught around the step, where an
//! out-of-memory becomes advice on what would fit.

use super::device::{
    kept_ranges, ChunkPlace, DeviceMemory, DeviceState, StateKind, StepGraphOutcome, Sums,
};
use super::flat::{Apply, CopyPlan, FlatBuf, FlatMemory, Run};
use super::PipelineError;
use meshtrain_comm::RawBuf;
use meshtrain_nn::optim::{Optimizer, OptimizerConfig, StatePiece};
use meshtrain_nn::{BlockParams, Loss, LossError, LossValue, Model, ParamStore, Params, ParamsMut};
use meshtrain_tensor::cuda::context::Event;
use meshtrain_tensor::cuda::error::ok_or_raise;
use meshtrain_tensor::cuda::graph::{StepCapture, StepGraph};
use meshtrain_tensor::cuda::train_ops::{self, AdamW, FlatState, SegmentTable, Sgd};
use meshtrain_tensor::cuda::{CudaDevice, CudaError, DevBuf, DeviceGrads, DeviceParams};
use meshtrain_tensor::{DType, Device, Tensor};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Byte offsets in the small device buffer the step's scalars live in.
const NORM: u64 = 0; // f32 norm, f32 clipping factor
const TRAIN_SUMS: u64 = 8; // f64 Σ loss, f64 Σ correct
const EVAL_SUMS: u64 = 24; // the same for evaluation
const FOUND_INF: u64 = 40; // i32
const SUM_OF_SQUARES: u64 = 48; // f64, this chunk's share of a norm over several workers
const SCHEDULE: u64 = 64; // the update's learning rate and corrections (train_ops::adamw)
const SCALARS: usize = SCHEDULE as usize + train_ops::SCHEDULE_BYTES;

fn placing(e: CudaError) -> PipelineError {
    PipelineError::Device(e.to_string())
}

/// One chunk's state on one GPU.
pub struct CudaChunk {
    dev: Arc<CudaDevice>,
    len: usize,
    values: DevBuf,
    /// The 16-bit compute copy of the values under mixed precision.
    half: Option<(DevBuf, DType)>,
    /// The 16-bit type the passes compute in (F32: none), for ZeRO-3's gathered blocks.
    compute: DType,
    /// Whether `values` are the chunk's whole parameters (not ZeRO-3's pieces of them: then
    /// the passes read gathered blocks, and the pieces need no 16-bit copy).
    whole: bool,
    /// The gradients: the chunk's `len`, or under ZeRO-2 this rank's pieces only.
    grads: DevBuf,
    grads_len: usize,
    buffers: DevBuf,
    buffers_len: usize,
    /// The optimizer's moments: `moments` elements (the chunk's, or under ZeRO this rank's
    /// pieces of every parameter).
    m: DevBuf,
    v: Option<DevBuf>,
    moments: usize,
    /// Under ZeRO, where the moments' pieces sit in the parameters and gradients.
    pieces: Option<PieceUpdate>,
    config: OptimizerConfig,
    segments: SegmentTable,
    scalars: DevBuf,
    /// The clipping factor at `NORM + 4` applies to the next update.
    clip_pending: bool,
    /// Where the chunk sits in the whole model.
    place: ChunkPlace,
    /// The event [`DeviceState::begin`] recorded on the idle device, and the host's time then.
    anchor: Option<(Event, Instant)>,
    span: Option<Event>,
    spans: Vec<(Event, Event)>,
    /// Where the run's steps stand as CUDA graphs (`train.cuda_graph`).
    graph: GraphPhase,
}

/// A step as CUDA graphs, from the run's first steps on.
enum GraphPhase {
    /// Eager steps before the capture (this many more): the first steps load modules,
    /// autotune the products and warm the allocator up, none of which a graph can hold.
    Warming(u32),
    Capturing,
    /// Replayed; how many steps in a row have fallen back.
    Replaying(StepGraph, u32),
    /// Eager from now on (said why once).
    Dropped,
}

/// Eager steps before the capture.
const GRAPH_WARMUP_STEPS: u32 = 2;
/// Steps in a row that fall back before the graph is dropped.
const GRAPH_FALLBACKS_TO_DROP: u32 = 3;

impl CudaChunk {
    /// The state of a chunk holding `blocks` of `model`, uploaded from `store` and
    /// `optimizer` to `dev`; `precision`'s 16-bit type gets a compute copy.
    pub fn place(
        dev: &Arc<CudaDevice>,
        model: &Model,
        blocks: Range<usize>,
        store: &ParamStore,
        optimizer: &Optimizer,
        precision: DType,
    ) -> Result<CudaChunk, PipelineError> {
        let len = store.values.len();
        let f = |bytes: usize, what: &str| dev.alloc(bytes.max(4), what).map_err(placing);
        let rows = meshtrain_nn::optim::segment_rows(optimizer.segments());
        let place = ChunkPlace::of(model, blocks);
        let whole = place.holds_whole(len);
        let half = match precision {
            _ if !whole => None,
            DType::F32 => None,
            d => Some((f(len * 2, "the 16-bit parameter copy")?, d)),
        };
        let moments = optimizer.m.len();
        let grads_len = super::device::gradient_len(store, optimizer);
        let pieces = match optimizer.pieces() {
            Some(pieces) => Some(PieceUpdate::new(dev, pieces).map_err(placing)?),
            None => None,
        };
        let mut chunk = CudaChunk {
            values: f(len * 4, "the parameters")?,
            half,
            compute: precision,
            whole,
            grads: f(grads_len * 4, "the gradients")?,
            grads_len,
            buffers: f(store.buffers.len() * 4, "the buffers")?,
            buffers_len: store.buffers.len(),
            m: f(moments * 4, "the optimizer's first moments")?,
            v: match optimizer.config {
                OptimizerConfig::Adamw { .. } => {
                    Some(f(moments * 4, "the optimizer's second moments")?)
                }
                OptimizerConfig::Sgd { .. } => None,
            },
            moments,
            pieces,
            config: optimizer.config,
            segments: SegmentTable::new(dev, &rows).map_err(placing)?,
            scalars: dev.alloc_zeroed(SCALARS, "step scalars").map_err(placing)?,
            clip_pending: false,
            place,
            anchor: None,
            span: None,
            spans: Vec::new(),
            graph: GraphPhase::Warming(GRAPH_WARMUP_STEPS),
            len,
            dev: dev.clone(),
        };
        chunk.upload(store, optimizer)?;
        Ok(chunk)
    }

    /// Where `kind` lives on the device and its length (`None`: SGD's second moment).
    fn state(&self, kind: StateKind) -> Option<(u64, usize)> {
        match kind {
            StateKind::Values => Some((self.values.ptr(), self.len)),
            StateKind::Buffers => Some((self.buffers.ptr(), self.buffers_len)),
            StateKind::FirstMoment => Some((self.m.ptr(), self.moments)),
            StateKind::SecondMoment => self.v.as_ref().map(|v| (v.ptr(), self.moments)),
        }
    }

    /// The device address of `len` elements of `kind` from element `at` on, checked.
    fn state_at(
        &self,
        kind: StateKind,
        at: usize,
        len: usize,
        what: &str,
    ) -> Result<u64, PipelineError> {
        match self.state(kind) {
            Some((buf, held)) if at + len <= held => Ok(buf + 4 * at as u64),
            None if len == 0 => Ok(0),
            _ => Err(super::device::out_of_range(what, kind, at, len)),
        }
    }

    fn refresh_half(&self) -> Result<(), CudaError> {
        if let Some((half, dtype)) = &self.half {
            meshtrain_tensor::cuda::ops::convert_into(
                &self.dev,
                self.values.ptr(),
                DType::F32,
                half.ptr(),
                *dtype,
                self.len,
            )?;
        }
        Ok(())
    }

    fn grad_ptr(&self, at: usize) -> u64 {
        self.grads.ptr() + (at * 4) as u64
    }

    /// The norm of the gradients outside `skip` (and its clipping factor for `max_norm`) into
    /// the step's scalars, and with `total` the f64 sum of squares there.
    fn launch_norm(&self, skip: &[Range<usize>], max_norm: Option<f32>, total: Option<u64>) {
        ok_or_raise(train_ops::grad_norm(
            &self.dev,
            self.grads.ptr(),
            &kept_ranges(skip, self.grads_len),
            max_norm,
            self.scalars.ptr() + NORM,
            total,
        ));
    }
}

/// A copy plan's runs in device memory, for `train_ops::copy_runs`.
struct DeviceRuns {
    table: DevBuf,
    count: usize,
    max_len: usize,
}

impl DeviceRuns {
    fn upload(dev: &Arc<CudaDevice>, plan: &CopyPlan) -> Result<DeviceRuns, CudaError> {
        let table: Vec<i64> = plan
            .runs()
            .iter()
            .flat_map(|r| [r.src.map_or(-1, |s| s as i64), r.dst as i64, r.len as i64])
            .collect();
        Ok(DeviceRuns {
            table: dev.upload(&table, "a copy plan")?,
            count: plan.runs().len(),
            max_len: plan.runs().iter().map(|r| r.len).max().unwrap_or(0),
        })
    }

    fn apply(&self, dev: &CudaDevice, src: u64, dst: u64, how: Apply) -> Result<(), CudaError> {
        train_ops::copy_runs(
            dev,
            src,
            dst,
            self.table.ptr(),
            self.count,
            self.max_len,
            how == Apply::Add,
        )
    }
}

/// The update over a ZeRO rank's pieces: the pieces' parameters and gradients gathered into
/// contiguous buffers beside the moments (taken from the allocator's cache for the update
/// only: working memory, like activations, not model state), the update kernels run over
/// them as over any flat buffer, the parameters scattered back (three copies of this rank's
/// share per step).
struct PieceUpdate {
    gather_values: DeviceRuns,
    /// `None` when the gradients already are the pieces in state order (ZeRO-2).
    gather_grads: Option<DeviceRuns>,
    scatter_values: DeviceRuns,
}

impl PieceUpdate {
    fn new(dev: &Arc<CudaDevice>, pieces: &[StatePiece]) -> Result<PieceUpdate, CudaError> {
        let runs = |at: fn(&StatePiece) -> usize| {
            let runs = pieces.iter().map(|p| Run {
                src: Some(at(p)),
                dst: p.state.start,
                len: p.state.len(),
            });
            CopyPlan::new(runs.collect())
        };
        let gather_values = runs(|p| p.values);
        Ok(PieceUpdate {
            scatter_values: DeviceRuns::upload(dev, &gather_values.inverse())?,
            gather_values: DeviceRuns::upload(dev, &gather_values)?,
            gather_grads: match pieces.iter().all(|p| p.grads == p.state.start) {
                true => None,
                false => Some(DeviceRuns::upload(dev, &runs(|p| p.grads))?),
            },
        })
    }

    /// The `len` pieces' parameters from `values`, and their gradients from `grads` (unless
    /// they are the pieces already), into working buffers.
    fn gather(&self, dev: &Arc<CudaDevice>, values: u64, grads: u64, len: usize) -> PieceWork {
        let bytes = len.max(1) * 4;
        let buffer = |what: &str| ok_or_raise(dev.alloc(bytes, what));
        let pieces = buffer("this rank's parameter pieces");
        ok_or_raise(
            self.gather_values
                .apply(dev, values, pieces.ptr(), Apply::Copy),
        );
        let grads = self.gather_grads.as_ref().map(|gather| {
            let pieces = buffer("this rank's gradient pieces");
            ok_or_raise(gather.apply(dev, grads, pieces.ptr(), Apply::Copy));
            pieces
        });
        PieceWork {
            values: pieces,
            grads,
        }
    }
}

/// A ZeRO update's working buffers (see [`PieceUpdate`]).
struct PieceWork {
    values: DevBuf,
    /// `None`: the chunk's gradient buffer holds the pieces.
    grads: Option<DevBuf>,
}

/// A GPU's memory for a dimension's own flat buffers (ZeRO's wire buffers), with the copy
/// plans it has been given uploaded once each.
struct CudaFlat {
    dev: Arc<CudaDevice>,
    plans: Mutex<HashMap<u64, Arc<DeviceRuns>>>,
    /// The 16-bit type the passes compute in, if any.
    compute: Option<DType>,
}

impl CudaFlat {
    fn runs(&self, plan: &CopyPlan) -> Arc<DeviceRuns> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        plans
            .entry(plan.id())
            .or_insert_with(|| Arc::new(ok_or_raise(DeviceRuns::upload(&self.dev, plan))))
            .clone()
    }

    fn check(&self, buf: &RawBuf) {
        assert!(
            buf.device() == FlatMemory::device(self) && buf.dtype() == DType::F32,
            "a copy plan on {:?} over a {} buffer of {:?}",
            FlatMemory::device(self),
            buf.dtype(),
            buf.device()
        );
    }
}

impl FlatMemory for CudaFlat {
    fn device(&self) -> Device {
        Device::Cuda(self.dev.ordinal())
    }

    fn alloc(&self, len: usize) -> FlatBuf {
        let buf = ok_or_raise(self.dev.alloc(len.max(1) * 4, "ZeRO's collective buffers"));
        // SAFETY: `buf` holds `len` f32 and is kept alive by the FlatBuf.
        unsafe { FlatBuf::from_owner(buf.ptr(), len, FlatMemory::device(self), Box::new(buf)) }
    }

    fn apply(&self, plan: &CopyPlan, src: RawBuf, dst: RawBuf, how: Apply) {
        self.check(&src);
        self.check(&dst);
        plan.assert_fits(&src, &dst);
        ok_or_raise(
            self.runs(plan)
                .apply(&self.dev, src.addr(), dst.addr(), how),
        );
    }

    fn zero(&self, dst: RawBuf) {
        self.check(&dst);
        ok_or_raise(self.dev.memset_zero(dst.addr(), dst.len() * 4));
    }

    fn view_mut<'a>(&'a self, buf: &'a mut FlatBuf) -> ParamsMut<'a> {
        let view = buf.raw();
        self.check(&view);
        // SAFETY: the buffer's memory on this GPU, borrowed with the view.
        ParamsMut::Device(unsafe { DeviceGrads::new(&self.dev, view.addr(), view.len()) })
    }

    fn compute_copy(&self) -> Option<DType> {
        self.compute
    }

    fn params_view<'a>(&'a self, values: &'a FlatBuf, half: Option<&'a FlatBuf>) -> Params<'a> {
        let half = half.zip(self.compute).map(|(h, d)| (h.addr(), d));
        // SAFETY: the buffers hold `values.len()` values (and as many 16-bit ones) on this
        // GPU and are borrowed with the view.
        Params::Device(unsafe { DeviceParams::new(&self.dev, values.addr(), half, values.len()) })
    }

    fn convert(&self, src: RawBuf, dst: RawBuf) {
        let on_this = |b: &RawBuf| b.device() == FlatMemory::device(self);
        assert!(
            on_this(&src) && on_this(&dst),
            "a conversion on another device"
        );
        assert_eq!(src.len(), dst.len(), "a conversion between unequal buffers");
        ok_or_raise(meshtrain_tensor::cuda::ops::convert_into(
            &self.dev,
            src.addr(),
            src.dtype(),
            dst.addr(),
            dst.dtype(),
            src.len(),
        ));
    }
}

/// The flat buffers as [`BlockParams`]: block `i`'s slices of them.
struct Blocks<'a> {
    model: &'a Model,
    chunk: &'a CudaChunk,
    on_ready: &'a mut dyn FnMut(usize),
}

impl CudaChunk {
    /// The parameters `r` (and their 16-bit copy) as a layer's view.
    fn params_at(&self, r: Range<usize>) -> Params<'_> {
        // SAFETY: the buffers hold the chunk's `len` values and outlive the view.
        Params::Device(unsafe {
            DeviceParams::new(
                &self.dev,
                self.values.ptr() + (r.start * 4) as u64,
                self.half
                    .as_ref()
                    .map(|(h, d)| (h.ptr() + (r.start * d.size_bytes()) as u64, *d)),
                r.len(),
            )
        })
    }

    fn f32_view(&self, buf: &DevBuf, r: Range<usize>) -> ParamsMut<'_> {
        // SAFETY: in bounds of a buffer the chunk owns; blocks are viewed one at a time.
        ParamsMut::Device(unsafe {
            DeviceGrads::new(&self.dev, buf.ptr() + (r.start * 4) as u64, r.len())
        })
    }
}

impl BlockParams for Blocks<'_> {
    fn forward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>) {
        let c = self.chunk;
        let (pr, br) = c.place.block(self.model, block);
        (c.params_at(pr), c.f32_view(&c.buffers, br))
    }

    fn backward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>, ParamsMut<'_>) {
        let c = self.chunk;
        let (pr, br) = c.place.block(self.model, block);
        (
            c.params_at(pr.clone()),
            c.f32_view(&c.grads, pr),
            c.f32_view(&c.buffers, br),
        )
    }

    fn backward_done(&mut self, block: usize) {
        (self.on_ready)(block)
    }
}

impl DeviceState for CudaChunk {
    fn device(&self) -> Device {
        Device::Cuda(self.dev.ordinal())
    }

    fn describe(&self) -> String {
        format!(
            "cuda:{} ({}, sm_{})",
            self.dev.ordinal(),
            self.dev.name(),
            self.dev.arch()
        )
    }

    fn memory(&self) -> DeviceMemory {
        let stats = self.dev.memory_stats();
        DeviceMemory {
            device: format!("cuda:{} ({})", self.dev.ordinal(), self.dev.name()),
            in_use_bytes: stats.in_use,
            peak_bytes: stats.peak_in_use,
            cached_bytes: stats.cached,
            device_allocs: stats.device_allocs,
            library_bytes: self.dev.library_bytes(),
            total_bytes: self.dev.memory_info().1,
        }
    }

    fn state_bytes(&self) -> (usize, usize, usize) {
        let half = self
            .half
            .as_ref()
            .map_or(0, |(_, d)| self.len * d.size_bytes());
        (
            self.len * 4 + half,
            self.grads_len * 4,
            self.moments * 4 * (1 + usize::from(self.v.is_some())),
        )
    }

    fn upload(&mut self, store: &ParamStore, optimizer: &Optimizer) -> Result<(), PipelineError> {
        let d = &self.dev;
        let moment = |buf: &DevBuf, host: &[f32]| {
            if host.len() == self.moments {
                d.upload_to(buf.ptr(), host)
            } else {
                d.memset_zero(buf.ptr(), self.moments * 4)
            }
        };
        let r = (|| {
            d.upload_to(self.values.ptr(), &store.values)?;
            d.upload_to(self.buffers.ptr(), &store.buffers)?;
            d.memset_zero(self.grads.ptr(), self.grads_len * 4)?;
            moment(&self.m, &optimizer.m)?;
            if let Some(v) = &self.v {
                moment(v, &optimizer.v)?;
            }
            self.refresh_half()?;
            d.synchronize()
        })();
        self.clip_pending = false;
        r.map_err(placing)
    }

    fn state_len(&self, kind: StateKind) -> usize {
        self.state(kind).map_or(0, |(_, len)| len)
    }

    fn read(&self, kind: StateKind, at: usize, into: &mut [f32]) -> Result<(), PipelineError> {
        let buf = self.state_at(kind, at, into.len(), "reading")?;
        (self.dev.download_into(into, buf)).map_err(placing)
    }

    fn write(&mut self, kind: StateKind, at: usize, from: &[f32]) -> Result<(), PipelineError> {
        let buf = self.state_at(kind, at, from.len(), "writing")?;
        (self.dev.upload_to(buf, from)).map_err(placing)
    }

    fn bind<'a>(
        &'a mut self,
        model: &'a Model,
        on_ready: &'a mut dyn FnMut(usize),
    ) -> Box<dyn BlockParams + 'a> {
        assert!(
            self.whole,
            "a chunk holding ZeRO-3's pieces binds through ZeRO's gathered blocks"
        );
        Box::new(Blocks {
            model,
            chunk: self,
            on_ready,
        })
    }

    fn block_views(&mut self, model: &Model, block: usize) -> (Option<Params<'_>>, ParamsMut<'_>) {
        let (pr, br) = self.place.block(model, block);
        let values = self.whole.then(|| self.params_at(pr));
        (values, self.f32_view(&self.buffers, br))
    }

    fn begin(&mut self) {
        ok_or_raise(self.dev.bind());
        self.anchor = Some((ok_or_raise(self.dev.record_event()), Instant::now()));
    }

    fn loss(
        &mut self,
        loss: &dyn Loss,
        output: Tensor,
        targets: &[u32],
        grad_scale: Option<f32>,
    ) -> Result<(Option<LossValue>, Option<Tensor>), LossError> {
        let sums = match grad_scale {
            Some(_) => TRAIN_SUMS,
            None => EVAL_SUMS,
        };
        let on_device: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
        let on_device = ok_or_raise(self.dev.upload(&on_device, "targets"));
        loss.forward_backward_on_device(
            output,
            targets,
            on_device.ptr(),
            grad_scale,
            self.scalars.ptr() + sums,
        )
    }

    fn take_sums(&mut self, which: Sums) -> (f64, f64) {
        let at = self.scalars.ptr()
            + match which {
                Sums::Train => TRAIN_SUMS,
                Sums::Eval => EVAL_SUMS,
            };
        let sums: Vec<f64> = ok_or_raise(self.dev.download(at, 2));
        ok_or_raise(self.dev.memset_zero(at, 16));
        (sums[0], sums[1])
    }

    fn begin_span(&mut self) {
        self.span = Some(ok_or_raise(self.dev.record_event()));
    }

    fn end_span(&mut self) {
        if let Some(start) = self.span.take() {
            let end = ok_or_raise(self.dev.record_event());
            self.spans.push((start, end));
        }
    }

    fn take_spans(&mut self) -> Vec<(Instant, Instant)> {
        let Some((anchor, host)) = &self.anchor else {
            return Vec::new();
        };
        let at = |e: &Event| {
            let ms = ok_or_raise(anchor.ms_until(e)).max(0.0);
            *host + std::time::Duration::from_secs_f64(ms as f64 / 1e3)
        };
        let spans = self.spans.drain(..).collect::<Vec<_>>();
        spans.iter().map(|(s, e)| (at(s), at(e))).collect()
    }

    fn grads(&mut self) -> RawBuf {
        // SAFETY: the chunk's gradient buffer, alive as long as the chunk; the collectives
        // given it are waited for within the step.
        unsafe { RawBuf::on_device(self.grads.ptr(), self.grads_len, DType::F32, self.device()) }
    }

    fn values(&mut self) -> RawBuf {
        // SAFETY: the chunk's parameter buffer, as for `grads`.
        unsafe { RawBuf::on_device(self.values.ptr(), self.len, DType::F32, self.device()) }
    }

    fn values_changed(&mut self) {
        ok_or_raise(self.refresh_half());
    }

    fn activation_home(&self) -> crate::engine::ActivationHome {
        crate::engine::ActivationHome::Cuda(self.dev.clone())
    }

    fn flat_memory(&self) -> Arc<dyn FlatMemory> {
        Arc::new(CudaFlat {
            dev: self.dev.clone(),
            plans: Mutex::default(),
            compute: (self.compute != DType::F32).then_some(self.compute),
        })
    }

    fn tie_sum(&mut self, a: Range<usize>, b: Range<usize>) {
        ok_or_raise(train_ops::tie_sum(
            &self.dev,
            self.grad_ptr(a.start),
            self.grad_ptr(b.start),
            a.len(),
        ));
    }

    fn copy_grads(&mut self, dst: Range<usize>, src: Range<usize>) {
        ok_or_raise(self.dev.copy(
            self.grad_ptr(dst.start),
            self.grad_ptr(src.start),
            src.len() * 4,
        ));
    }

    fn unscale_check(&mut self, inverse: f32) -> bool {
        let flag = self.scalars.ptr() + FOUND_INF;
        ok_or_raise(self.dev.memset_zero(flag, 4));
        ok_or_raise(train_ops::unscale_check(
            &self.dev,
            self.grads.ptr(),
            self.grads_len,
            inverse,
            flag,
        ));
        let found: Vec<i32> = ok_or_raise(self.dev.download(flag, 1));
        found[0] != 0
    }

    fn grad_sum_of_squares(&mut self, skip: &[Range<usize>]) -> f64 {
        // The f64 sum itself, not the f32 norm squared: the workers' shares are added in f64
        // before the one square root, as on the CPU (and as one worker's whole norm is).
        let total = self.scalars.ptr() + SUM_OF_SQUARES;
        self.launch_norm(skip, None, Some(total));
        let sum: Vec<f64> = ok_or_raise(self.dev.download(total, 1));
        sum[0]
    }

    fn norm_and_clip(&mut self, skip: &[Range<usize>], max_norm: Option<f32>) -> f32 {
        self.launch_norm(skip, max_norm, None);
        self.clip_pending = max_norm.is_some();
        let norm: Vec<f32> = ok_or_raise(self.dev.download(self.scalars.ptr() + NORM, 1));
        norm[0]
    }

    fn scale_grads(&mut self, k: f32) {
        ok_or_raise(train_ops::scale(
            &self.dev,
            self.grads.ptr(),
            self.grads_len,
            k,
        ));
    }

    fn step(&mut self, optimizer: &mut Optimizer, lr: f32) {
        optimizer.step += 1;
        let clip_factor =
            std::mem::take(&mut self.clip_pending).then(|| self.scalars.ptr() + NORM + 4);
        // Under ZeRO the update runs over this rank's pieces gathered into contiguous
        // buffers; the 16-bit copy is refreshed once every rank's pieces are back
        // (`values_changed` after the all-gather).
        let work = (self.pieces.as_ref())
            .map(|p| p.gather(&self.dev, self.values.ptr(), self.grads.ptr(), self.moments));
        let state = match &work {
            None => FlatState {
                params: self.values.ptr(),
                grads: self.grads.ptr(),
                m: self.m.ptr(),
                v: self.v.as_ref().map_or(0, |v| v.ptr()),
                half: self.half.as_ref().map(|(h, t)| (h.ptr(), *t)),
                len: self.len,
            },
            Some(w) => FlatState {
                params: w.values.ptr(),
                grads: w.grads.as_ref().map_or(self.grads.ptr(), DevBuf::ptr),
                m: self.m.ptr(),
                v: self.v.as_ref().map_or(0, |v| v.ptr()),
                half: None,
                len: self.moments,
            },
        };
        ok_or_raise(match self.config {
            OptimizerConfig::Adamw {
                beta1, beta2, eps, ..
            } => train_ops::adamw(
                &self.dev,
                state,
                &self.segments,
                AdamW {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    step: optimizer.step,
                },
                clip_factor,
                self.scalars.ptr() + SCHEDULE,
            ),
            OptimizerConfig::Sgd { momentum, .. } => train_ops::sgd(
                &self.dev,
                state,
                &self.segments,
                Sgd {
                    lr,
                    momentum,
                    step: optimizer.step,
                },
                clip_factor,
                self.scalars.ptr() + SCHEDULE,
            ),
        });
        if let (Some(p), Some(w)) = (&self.pieces, &work) {
            ok_or_raise(p.scatter_values.apply(
                &self.dev,
                w.values.ptr(),
                self.values.ptr(),
                Apply::Copy,
            ));
        }
        self.zero_grads();
    }

    fn zero_grads(&mut self) {
        ok_or_raise(self.dev.memset_zero(self.grads.ptr(), self.grads_len * 4));
    }

    fn wait(&mut self) {
        ok_or_raise(self.dev.synchronize());
    }

    fn begin_step_graph(&mut self) {
        match &mut self.graph {
            GraphPhase::Warming(0) => {
                ok_or_raise(self.dev.begin_step_capture());
                self.graph = GraphPhase::Capturing;
            }
            GraphPhase::Warming(n) => *n -= 1,
            GraphPhase::Replaying(graph, _) => ok_or_raise(graph.begin_step()),
            GraphPhase::Capturing | GraphPhase::Dropped => {}
        }
    }

    fn end_step_graph(&mut self) -> StepGraphOutcome {
        let mut outcome = StepGraphOutcome::default();
        match std::mem::replace(&mut self.graph, GraphPhase::Dropped) {
            GraphPhase::Capturing => match ok_or_raise(self.dev.end_step_capture()) {
                StepCapture::Graph(graph) => {
                    let (pieces, graphs) = graph.pieces();
                    outcome.note = Some(format!(
                        "CUDA graphs: the step is captured ({pieces} kernels, products and copies in \
                         {graphs} graphs between its reads) and replayed from now on"
                    ));
                    self.graph = GraphPhase::Replaying(graph, 0);
                }
                StepCapture::FellBack(why) => {
                    outcome.note = Some(format!(
                        "CUDA graphs: the step could not be captured, it runs eagerly: {why}"
                    ));
                }
            },
            GraphPhase::Replaying(mut graph, in_a_row) => match ok_or_raise(graph.end_step()) {
                None => {
                    outcome.replayed = true;
                    self.graph = GraphPhase::Replaying(graph, 0);
                }
                Some(_) if in_a_row + 1 < GRAPH_FALLBACKS_TO_DROP => {
                    self.graph = GraphPhase::Replaying(graph, in_a_row + 1);
                }
                Some(why) => {
                    outcome.note = Some(format!(
                        "CUDA graphs: dropped after {GRAPH_FALLBACKS_TO_DROP} steps in a row that \
                         differ from the captured one, the step runs eagerly: {why}"
                    ));
                }
            },
            other => self.graph = other,
        }
        outcome
    }
}
