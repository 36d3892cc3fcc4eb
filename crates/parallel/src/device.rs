//! A training step on a CUDA GPU: the model's flat parameter, gradient, buffer and
//! optimizer buffers live on the device for the whole run; forward and backward run the same
//! [`Model`] code (each layer choosing its CUDA kernels from its device parameters), the loss
//! accumulates its sums on the device, and the gradient norm, clipping, fp16 unscaling and
//! the optimizer update run there too. The host reads eight bytes of results per step.
//!
//! Today the GPU runs one worker (dp = tp = pp = cp = 1); the layout is checked before any
//! work ([`check`], through [`crate::check_device`]). The host copy of the state in the [`crate::Parallel`]'s stage is the
//! checkpoint mirror: [`DeviceStep::download`] fills it before a checkpoint,
//! [`DeviceStep::upload`] after one is loaded, so checkpoints keep their one format and a
//! GPU run resumes on the CPU and the reverse.

use crate::engine::{MicroBatches, StepOptions};
use crate::layout::Layout;
use crate::precision::LossScaling;
use crate::{Batch, DeviceCheck, EvalSums, ParallelError, StepStats, StepTimes};
use meshtrain_comm::ProcessGroup;
use meshtrain_nn::optim::{Optimizer, OptimizerConfig};
use meshtrain_nn::{BlockParams, Mode, Model, ParamStore, Params, ParamsMut};
use meshtrain_tensor::cuda::error::catch;
use meshtrain_tensor::cuda::train_ops::{self, AdamW, FlatState, SegmentRow, SegmentTable};
use meshtrain_tensor::cuda::{CudaDevice, CudaError, DevBuf, DeviceGrads, DeviceParams, F32Math};
use meshtrain_tensor::{DType, Device};
use std::ops::Range;
use std::sync::Arc;

fn device_error(e: CudaError) -> ParallelError {
    ParallelError::Device(e.to_string())
}

/// Refuses, before any work, what this machine's GPU cannot run, in the order a user can act
/// on it: a missing driver or library and a GPU that does not exist first (the machine), then
/// a layout of several workers (this build), then a model with a layer that has no CUDA
/// kernels (named). With [`DeviceCheck::Opening`] it then opens the GPU (its context; a
/// compute capability below 8.0 is refused there).
pub fn check(
    model: &Model,
    layout: &Layout,
    device: Device,
    how: DeviceCheck,
) -> Result<(), ParallelError> {
    let Device::Cuda(ordinal) = device else {
        return Ok(());
    };
    meshtrain_tensor::cuda::probe::require_gpu(ordinal).map_err(device_error)?;
    refuse_what_one_gpu_cannot_run(model, layout, ordinal)?;
    if how == DeviceCheck::Opening {
        CudaDevice::get(ordinal).map_err(device_error)?;
    }
    Ok(())
}

/// What this build's GPU step cannot run on any machine: a layout of several workers (or
/// ZeRO), and a model with a layer that has no CUDA kernels (named, with the way out).
fn refuse_what_one_gpu_cannot_run(
    model: &Model,
    layout: &Layout,
    ordinal: usize,
) -> Result<(), ParallelError> {
    let device = Device::Cuda(ordinal);
    if layout.world_size() > 1 || layout.zero > 0 {
        let spread = if layout.world_size() > 1 {
            format!("spreads the model over {} workers", layout.world_size())
        } else {
            format!("shards the model states (ZeRO stage {})", layout.zero)
        };
        return Err(ParallelError::Device(format!(
            "multi-GPU layouts (data, tensor, pipeline or context parallelism, ZeRO) are not yet \
             available in this build of meshtrain: --device cuda trains one worker on one GPU, \
             and the layout {layout} {spread}. Train with the default layout on cuda:{ordinal}, \
             or with this layout on --device cpu"
        )));
    }
    for (i, block) in model.blocks.iter().enumerate() {
        if !block.layer.runs_on(device) {
            let name = if block.name.is_empty() {
                format!("block {i}")
            } else {
                format!("block {i} ({})", block.name)
            };
            let leaf = first_cpu_only_leaf(block.layer.as_ref(), &block.name, device);
            return Err(ParallelError::Device(format!(
                "{name} has a layer without CUDA kernels ({leaf}; GPU kernels exist today for \
                 linear layers, layer and RMS norm, activations and SwiGLU, token embeddings, \
                 rotary positions and attention; convolutions, pooling and batch norm come \
                 with the conv-net wave): train this model with --device cpu"
            )));
        }
    }
    Ok(())
}

/// The path of the first leaf layer under `layer` (at `path`) without kernels for `device`,
/// children named by their names or, unnamed, by their place (`blocks.0.#2`).
fn first_cpu_only_leaf(layer: &dyn meshtrain_nn::Layer, path: &str, device: Device) -> String {
    let Some(children) = layer.children() else {
        return if path.is_empty() {
            "the block's own layer".into()
        } else {
            format!("'{path}'")
        };
    };
    for (i, (name, child)) in children.layers().iter().enumerate() {
        if !child.runs_on(device) {
            let part = if name.is_empty() {
                format!("#{i}")
            } else {
                name.clone()
            };
            let child_path = if path.is_empty() {
                part
            } else {
                format!("{path}.{part}")
            };
            return first_cpu_only_leaf(child.as_ref(), &child_path, device);
        }
    }
    format!("'{path}'")
}

/// An allocation that failed in a step, with what would fit: the step's activations grow
/// with the samples per step, so a batch scaled by the room left over what the step held
/// when it failed (a lower bound on its need) is the largest that could fit.
fn out_of_memory(
    oom: &meshtrain_tensor::cuda::alloc::OutOfMemory,
    samples: usize,
    states: usize,
) -> String {
    let limit = oom.limit.unwrap_or(oom.in_use + oom.free);
    let room = limit.saturating_sub(states) as f64;
    let needed = (oom.in_use + oom.bytes).saturating_sub(states).max(1) as f64;
    let fits = ((samples as f64) * room / needed).floor() as usize;
    let advice = if fits >= 1 {
        format!(
            "at most about {fits} samples per step (of {samples}) would fit: lower \
             train.batch_size, or keep the batch and split it with train.accumulation_steps, \
             or recompute activations (train.recompute = true)"
        )
    } else {
        "not even one sample per step fits beside the model states (parameters, gradients, \
         optimizer moments): the model is too large for this GPU alone"
            .to_string()
    };
    format!("{}; {advice}", CudaError::OutOfMemory { oom: oom.clone() })
}

/// Byte offsets in the small device buffer the step's scalars live in.
const NORM: u64 = 0; // f32 norm, f32 clipping factor
const LOSS_SUMS: u64 = 8; // f64 Σ loss, f64 Σ correct
const EVAL_SUMS: u64 = 24; // the same for evaluation
const FOUND_INF: u64 = 40; // i32
const SCALARS: usize = 64;

/// The model's state on one GPU, and its step.
pub struct DeviceStep {
    dev: Arc<CudaDevice>,
    len: usize,
    values: DevBuf,
    /// The 16-bit compute copy of the values under mixed precision.
    half: Option<(DevBuf, DType)>,
    grads: DevBuf,
    buffers: DevBuf,
    buffers_len: usize,
    m: DevBuf,
    v: Option<DevBuf>,
    steps: u64,
    config: OptimizerConfig,
    segments: SegmentTable,
    /// Tied parameters: (primary, copies) ranges of the flat buffer.
    ties: Vec<(Range<usize>, Vec<Range<usize>>)>,
    /// What gradient norms count (tied copies once).
    norm_ranges: Vec<Range<usize>>,
    scalars: DevBuf,
    /// Evaluation counts the host knows (targets, and losses computed on the host).
    eval_host: EvalSums,
    /// Whether a loss added evaluation sums on the device since the last read.
    eval_on_device: bool,
}

/// The flat buffers as [`BlockParams`]: block `i`'s slices of them.
struct Blocks<'a> {
    model: &'a Model,
    step: &'a DeviceStep,
}

impl Blocks<'_> {
    fn params(&self, block: usize) -> Params<'_> {
        let r = self.model.block_param_range(block);
        let s = self.step;
        // SAFETY: the buffers hold the whole model's `len` values and outlive the view.
        Params::Device(unsafe {
            DeviceParams::new(
                &s.dev,
                s.values.ptr() + (r.start * 4) as u64,
                s.half
                    .as_ref()
                    .map(|(h, d)| (h.ptr() + (r.start * d.size_bytes()) as u64, *d)),
                r.len(),
            )
        })
    }

    fn f32_view(&self, buf: &DevBuf, r: Range<usize>) -> ParamsMut<'_> {
        // SAFETY: in bounds of a buffer the step owns; blocks are viewed one at a time.
        ParamsMut::Device(unsafe {
            DeviceGrads::new(&self.step.dev, buf.ptr() + (r.start * 4) as u64, r.len())
        })
    }
}

impl BlockParams for Blocks<'_> {
    fn forward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>) {
        let br = self.model.blocks_buffer_range(block..block + 1);
        (self.params(block), self.f32_view(&self.step.buffers, br))
    }

    fn backward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>, ParamsMut<'_>) {
        let pr = self.model.block_param_range(block);
        let br = self.model.blocks_buffer_range(block..block + 1);
        (
            self.params(block),
            self.f32_view(&self.step.grads, pr),
            self.f32_view(&self.step.buffers, br),
        )
    }
}

impl DeviceStep {
    /// The state of `store` and `optimizer` (a whole model's) uploaded to GPU `ordinal`;
    /// `precision`'s 16-bit type gets a compute copy.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ordinal: usize,
        model: &Model,
        store: &ParamStore,
        optimizer: &Optimizer,
        norm_skip: &[Range<usize>],
        precision: DType,
        tf32: bool,
        memory_limit_mb: Option<f64>,
    ) -> Result<DeviceStep, ParallelError> {
        let dev = CudaDevice::get(ordinal).map_err(device_error)?;
        dev.set_f32_math(if tf32 { F32Math::Tf32 } else { F32Math::Exact });
        dev.set_memory_limit(memory_limit_mb.map(|mb| (mb * 1024.0 * 1024.0) as usize));
        dev.load_all_kernels().map_err(device_error)?;
        let len = store.values.len();
        let f = |bytes: usize, what: &str| dev.alloc(bytes.max(4), what).map_err(device_error);
        let rows: Vec<SegmentRow> = optimizer
            .segments()
            .iter()
            .map(|s| SegmentRow {
                end: s.range.end,
                weight_decay: s.hyper.weight_decay,
                lr_scale: s.hyper.lr_scale,
            })
            .collect();
        let half = match precision {
            DType::F32 => None,
            d => Some((f(len * 2, "the 16-bit parameter copy")?, d)),
        };
        let mut ties = Vec::new();
        for t in model.ties() {
            let params = model.params();
            ties.push((
                params[t.primary].range.clone(),
                t.copies.iter().map(|&c| params[c].range.clone()).collect(),
            ));
        }
        let mut norm_ranges = Vec::new();
        let mut at = 0;
        for skip in norm_skip {
            norm_ranges.push(at..skip.start);
            at = skip.end;
        }
        norm_ranges.push(at..len);
        let mut step = DeviceStep {
            values: f(len * 4, "the parameters")?,
            half,
            grads: f(len * 4, "the gradients")?,
            buffers: f(store.buffers.len() * 4, "the buffers")?,
            buffers_len: store.buffers.len(),
            m: f(len * 4, "the optimizer's first moments")?,
            v: match optimizer.config {
                OptimizerConfig::Adamw { .. } => {
                    Some(f(len * 4, "the optimizer's second moments")?)
                }
                OptimizerConfig::Sgd { .. } => None,
            },
            steps: optimizer.step,
            config: optimizer.config,
            segments: SegmentTable::new(&dev, &rows).map_err(device_error)?,
            ties,
            norm_ranges,
            scalars: dev
                .alloc_zeroed(SCALARS, "step scalars")
                .map_err(device_error)?,
            eval_host: EvalSums::default(),
            eval_on_device: false,
            len,
            dev,
        };
        step.upload(store, optimizer)?;
        Ok(step)
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Replaces the device state by `store`'s values and buffers and `optimizer`'s moments
    /// and step (after a checkpoint was loaded into them).
    pub fn upload(
        &mut self,
        store: &ParamStore,
        optimizer: &Optimizer,
    ) -> Result<(), ParallelError> {
        let d = &self.dev;
        let r = (|| {
            d.upload_to(self.values.ptr(), &store.values)?;
            d.upload_to(self.buffers.ptr(), &store.buffers)?;
            d.memset_zero(self.grads.ptr(), self.len * 4)?;
            if optimizer.m.len() == self.len {
                d.upload_to(self.m.ptr(), &optimizer.m)?;
            } else {
                d.memset_zero(self.m.ptr(), self.len * 4)?;
            }
            if let Some(v) = &self.v {
                if optimizer.v.len() == self.len {
                    d.upload_to(v.ptr(), &optimizer.v)?;
                } else {
                    d.memset_zero(v.ptr(), self.len * 4)?;
                }
            }
            self.refresh_half()?;
            d.synchronize()
        })();
        self.steps = optimizer.step;
        r.map_err(device_error)
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

    /// Copies the device state into `store` and `optimizer` (for a checkpoint).
    pub fn download(
        &self,
        store: &mut ParamStore,
        optimizer: &mut Optimizer,
    ) -> Result<(), ParallelError> {
        let d = &self.dev;
        let r = (|| {
            d.download_into(&mut store.values, self.values.ptr())?;
            d.download_into(&mut store.buffers[..self.buffers_len], self.buffers.ptr())?;
            if optimizer.m.len() == self.len {
                d.download_into(&mut optimizer.m, self.m.ptr())?;
            }
            if let Some(v) = &self.v {
                if optimizer.v.len() == self.len {
                    d.download_into(&mut optimizer.v, v.ptr())?;
                }
            }
            Ok(())
        })();
        optimizer.step = self.steps;
        r.map_err(device_error)
    }

    /// One training step on `share`; see the module docs.
    #[allow(clippy::too_many_arguments)]
    pub fn train_step(
        &mut self,
        model: &Model,
        share: Batch,
        micro_batches: usize,
        lr: f32,
        clip: Option<f32>,
        options: &StepOptions,
        scaling: Option<&mut LossScaling>,
        world: &dyn ProcessGroup,
    ) -> Result<StepStats, ParallelError> {
        let samples = share.samples;
        let micro = MicroBatches::split_owned(share.x, share.y, micro_batches)?;
        let states = self.states_total();
        match catch(|| self.step_inner(model, micro, lr, clip, options, scaling, world)) {
            Ok(r) => r,
            Err(CudaError::OutOfMemory { oom }) => {
                Err(ParallelError::Device(out_of_memory(&oom, samples, states)))
            }
            Err(e) => Err(device_error(e)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn step_inner(
        &mut self,
        model: &Model,
        micro: MicroBatches,
        lr: f32,
        clip: Option<f32>,
        options: &StepOptions,
        scaling: Option<&mut LossScaling>,
        world: &dyn ProcessGroup,
    ) -> Result<StepStats, ParallelError> {
        let d = self.dev.clone();
        let e = |r: Result<(), CudaError>| r.map_err(device_error);
        d.bind().map_err(device_error)?;
        e(d.memset_zero(self.grads.ptr(), self.len * 4))?;
        e(d.memset_zero(self.scalars.ptr() + LOSS_SUMS, 16))?;
        let m = micro.inputs.len();
        let grad_scale = 1.0 / m as f32;
        let (mut host_loss, mut count) = (0.0f64, 0usize);
        let mut marks = Vec::with_capacity(m);
        let recompute = options.recompute;
        let blocks = 0..model.num_blocks();
        for (x, y) in micro.inputs.into_iter().zip(micro.targets) {
            let t0 = d.record_event().map_err(device_error)?;
            let targets: Vec<i32> = y.iter().map(|&t| t as i32).collect();
            let targets_dev = d.upload(&targets, "targets").map_err(device_error)?;
            let mut views = Blocks { model, step: self };
            let (out, acts) =
                model.forward_with(&mut views, x, blocks.clone(), Mode::TRAIN, &|_| recompute);
            let (value, grad) = options.loss.forward_backward_on_device(
                out,
                &y,
                targets_dev.ptr(),
                Some(grad_scale),
                self.scalars.ptr() + LOSS_SUMS,
            )?;
            if let Some(v) = value {
                host_loss += v.mean as f64 * v.count as f64;
            }
            count += y.len();
            let t1 = d.record_event().map_err(device_error)?;
            let mut views = Blocks { model, step: self };
            model.backward_with(
                &mut views,
                acts,
                grad.expect("asked for the gradient"),
                false,
            );
            let t2 = d.record_event().map_err(device_error)?;
            // Read after the step's one wait below: reading now would stop the host here.
            marks.push([t0, t1, t2]);
        }
        let opt_start = d.record_event().map_err(device_error)?;
        for (primary, copies) in &self.ties {
            for c in copies {
                e(train_ops::tie_sum(
                    &d,
                    self.grads.ptr() + (primary.start * 4) as u64,
                    self.grads.ptr() + (c.start * 4) as u64,
                    primary.len(),
                ))?;
            }
            for c in copies.iter().take(copies.len().saturating_sub(1)) {
                e(d.copy(
                    self.grads.ptr() + (c.start * 4) as u64,
                    self.grads.ptr() + (primary.start * 4) as u64,
                    primary.len() * 4,
                ))?;
            }
        }
        let mut outcome = None;
        if let Some(scaling) = scaling {
            e(d.memset_zero(self.scalars.ptr() + FOUND_INF, 4))?;
            e(train_ops::unscale_check(
                &d,
                self.grads.ptr(),
                self.len,
                1.0 / scaling.scale(),
                self.scalars.ptr() + FOUND_INF,
            ))?;
            let found: Vec<i32> = d
                .download(self.scalars.ptr() + FOUND_INF, 1)
                .map_err(device_error)?;
            outcome = Some(scaling.decide(found[0] != 0, world)?);
        }
        let skipped = outcome.is_some_and(|o| o.skipped);
        if !skipped {
            e(train_ops::grad_norm(
                &d,
                self.grads.ptr(),
                &self.norm_ranges,
                clip,
                self.scalars.ptr() + NORM,
            ))?;
            self.steps += 1;
            let clip_factor = clip.map(|_| self.scalars.ptr() + NORM + 4);
            let state = FlatState {
                params: self.values.ptr(),
                grads: self.grads.ptr(),
                m: self.m.ptr(),
                v: self.v.as_ref().map_or(0, |v| v.ptr()),
                half: self.half.as_ref().map(|(h, t)| (h.ptr(), *t)),
                len: self.len,
            };
            match self.config {
                OptimizerConfig::Adamw {
                    beta1, beta2, eps, ..
                } => e(train_ops::adamw(
                    &d,
                    state,
                    &self.segments,
                    AdamW {
                        lr,
                        beta1,
                        beta2,
                        eps,
                        step: self.steps,
                    },
                    clip_factor,
                ))?,
                OptimizerConfig::Sgd { momentum, .. } => e(train_ops::sgd(
                    &d,
                    state,
                    &self.segments,
                    lr,
                    momentum,
                    self.steps,
                    clip_factor,
                ))?,
            }
        }
        let end = d.record_event().map_err(device_error)?;
        // The step's only wait: eight bytes of results.
        let results: Vec<u8> = d
            .download(self.scalars.ptr(), (EVAL_SUMS) as usize)
            .map_err(device_error)?;
        let norm = f32::from_le_bytes(results[0..4].try_into().expect("4 bytes"));
        let loss_sum = f64::from_le_bytes(results[8..16].try_into().expect("8 bytes")) + host_loss;
        let optimizer_ms = opt_start.ms_until(&end).map_err(device_error)?;
        let (mut forward_ms, mut backward_ms) = (0.0f32, 0.0f32);
        for [t0, t1, t2] in &marks {
            forward_ms += t0.ms_until(t1).map_err(device_error)?;
            backward_ms += t1.ms_until(t2).map_err(device_error)?;
        }
        let states = self.states_total();
        Ok(StepStats {
            loss: (loss_sum / count.max(1) as f64) as f32,
            grad_norm: if skipped { 0.0 } else { norm },
            times: StepTimes {
                forward_s: forward_ms as f64 / 1e3,
                backward_s: backward_ms as f64 / 1e3,
                optimizer_s: optimizer_ms as f64 / 1e3,
                ..StepTimes::default()
            },
            // What the step held beyond the model states: activations, logits, scratch.
            peak_activation_bytes: d.memory_stats().peak_in_use.saturating_sub(states),
            skipped,
            loss_scale: outcome.map(|o| o.scale),
        })
    }

    /// Evaluates one batch: its loss sums stay on the device until [`DeviceStep::eval_sums`].
    pub fn eval_batch(
        &mut self,
        model: &Model,
        batch: Batch,
        options: &StepOptions,
    ) -> Result<(), ParallelError> {
        let d = self.dev.clone();
        let samples = batch.samples;
        let r = catch(|| -> Result<(), ParallelError> {
            d.bind().map_err(device_error)?;
            let targets: Vec<i32> = batch.y.iter().map(|&t| t as i32).collect();
            let targets_dev = d.upload(&targets, "targets").map_err(device_error)?;
            let mut views = Blocks { model, step: self };
            let (out, _) = model.forward_with(
                &mut views,
                batch.x,
                0..model.num_blocks(),
                Mode::EVAL,
                &|_| false,
            );
            let (value, _) = options.loss.forward_backward_on_device(
                out,
                &batch.y,
                targets_dev.ptr(),
                None,
                self.scalars.ptr() + EVAL_SUMS,
            )?;
            let host = &mut self.eval_host;
            host.count += batch.y.len() as f64;
            host.samples += samples as f64;
            match value {
                Some(v) => {
                    host.loss_sum += v.mean as f64 * v.count as f64;
                    if let Some(c) = v.correct {
                        *host.correct.get_or_insert(0.0) += c as f64;
                    }
                }
                None => self.eval_on_device = true,
            }
            Ok(())
        });
        r.map_err(device_error)?
    }

    /// The evaluation sums since the last call (the host waits for the device).
    pub fn eval_sums(&mut self) -> Result<EvalSums, ParallelError> {
        let dev: Vec<f64> = self
            .dev
            .download(self.scalars.ptr() + EVAL_SUMS, 2)
            .map_err(device_error)?;
        self.dev
            .memset_zero(self.scalars.ptr() + EVAL_SUMS, 16)
            .map_err(device_error)?;
        let mut sums = std::mem::take(&mut self.eval_host);
        if std::mem::take(&mut self.eval_on_device) {
            sums.loss_sum += dev[0];
            *sums.correct.get_or_insert(0.0) += dev[1];
        }
        Ok(sums)
    }

    /// Bytes of the model states on the device, all together.
    fn states_total(&self) -> usize {
        let (p, g, o) = self.state_bytes();
        p + g + o
    }

    /// Bytes of the model states on the device.
    pub fn state_bytes(&self) -> (usize, usize, usize) {
        let half = self
            .half
            .as_ref()
            .map_or(0, |(_, d)| self.len * d.size_bytes());
        (
            self.len * 4 + half,
            self.len * 4,
            self.len * 4 * (1 + usize::from(self.v.is_some())),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshtrain_nn::models::gpt::gpt;
    use meshtrain_nn::models::lenet::lenet;
    use meshtrain_nn::models::{GptConfig, LeNetVariant};
    use meshtrain_tensor::cuda::alloc::OutOfMemory;

    #[test]
    fn a_gpu_runs_one_worker_and_says_so_before_any_work() {
        let model = gpt(&GptConfig::default());
        let layout = Layout {
            dp: 2,
            ..Layout::default()
        };
        let e = refuse_what_one_gpu_cannot_run(&model, &layout, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "multi-GPU layouts (data, tensor, pipeline or context parallelism, ZeRO) are not \
                 yet available in this build of meshtrain"
            ) && e.contains("spreads the model over 2 workers")
                && e.ends_with("or with this layout on --device cpu"),
            "{e}"
        );
        let zero = Layout {
            zero: 1,
            ..Layout::default()
        };
        let e = refuse_what_one_gpu_cannot_run(&model, &zero, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("shards the model states (ZeRO stage 1)"), "{e}");
        assert!(refuse_what_one_gpu_cannot_run(&model, &Layout::default(), 0).is_ok());
        // The CPU takes any layout here (parallelize checks the rest).
        assert!(check(&model, &layout, Device::Cpu, DeviceCheck::Opening).is_ok());
    }

    /// Without the driver, that is said first, whatever else the GPU could not run: it is
    /// what the user can act on (a layout of two workers, a model without kernels come after).
    #[test]
    fn a_missing_driver_is_named_first() {
        if meshtrain_tensor::cuda::probe::require_driver().is_ok() {
            eprintln!("skipped: this machine has the NVIDIA driver");
            return;
        }
        let layout = Layout {
            dp: 2,
            ..Layout::default()
        };
        for model in [gpt(&GptConfig::default()), lenet(LeNetVariant::Relu)] {
            for how in [DeviceCheck::WithoutOpening, DeviceCheck::Opening] {
                let e = check(&model, &layout, Device::Cuda(0), how)
                    .unwrap_err()
                    .to_string();
                assert!(
                    e.starts_with("--device cuda needs the NVIDIA driver (libcuda.so.1)")
                        && e.ends_with("without a GPU, train with --device cpu"),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn a_layer_without_cuda_kernels_is_named() {
        let model = lenet(LeNetVariant::Relu);
        let e = refuse_what_one_gpu_cannot_run(&model, &Layout::default(), 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("block 0") && e.contains("without CUDA kernels"),
            "{e}"
        );
        assert!(e.contains("--device cpu"), "{e}");
    }

    /// A Llama has CUDA kernels for every layer (token-only embedding, RMS norms, rotary +
    /// GQA, attention, SwiGLU, linears): the per-layer check passes.
    #[test]
    fn a_llama_passes_the_per_layer_check() {
        let cfg = meshtrain_nn::models::LlamaConfig {
            vocab: 64,
            dim: 32,
            layers: 1,
            heads: 4,
            kv_heads: 2,
            ffn: 48,
            seq: 8,
            rope_theta: 1e4,
            rope_scaling: None,
            norm_eps: 1e-5,
            tie_embeddings: false,
            attention: Default::default(),
        };
        let model = meshtrain_nn::models::llama::llama(&cfg);
        assert!(model
            .blocks
            .iter()
            .all(|b| b.layer.runs_on(Device::Cuda(0))));
        assert!(model.blocks.iter().all(|b| b.layer.runs_on(Device::Cpu)));
        assert!(refuse_what_one_gpu_cannot_run(&model, &Layout::default(), 0).is_ok());
    }

    #[test]
    fn the_gpt_runs_on_a_gpu_layer_by_layer() {
        let model = gpt(&GptConfig::default());
        assert!(model
            .blocks
            .iter()
            .all(|b| b.layer.runs_on(Device::Cuda(0))));
        assert!(model.blocks.iter().all(|b| b.layer.runs_on(Device::Cpu)));
    }

    #[test]
    fn out_of_memory_says_what_batch_would_fit() {
        let gib = 1usize << 30;
        let oom = OutOfMemory {
            what: "a linear layer's output".into(),
            bytes: 2 * gib,
            in_use: 30 * gib,
            free: gib,
            total: 80 * gib,
            limit: None,
        };
        // 10 GiB of states; the step held 20 GiB of activations and wanted 2 more for 32
        // samples; 21 GiB of room beside the states → about 30 samples.
        let text = out_of_memory(&oom, 32, 10 * gib);
        assert!(
            text.contains("a linear layer's output needs 2048.0 MiB"),
            "{text}"
        );
        assert!(
            text.contains("at most about 30 samples per step (of 32)"),
            "{text}"
        );
        let tiny = OutOfMemory {
            in_use: 10 * gib,
            free: 0,
            ..oom
        };
        let text = out_of_memory(&tiny, 32, 10 * gib);
        assert!(text.contains("not even one sample"), "{text}");
    }
}
