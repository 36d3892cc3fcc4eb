//! The model transformed by the layout's parallel dimensions, and the one training step every
//! layout runs.
//!
//! [`parallelize`] applies one module per dimension, always in this order:
//!
//! ```text
//! mesh      = DeviceMesh(world, dp × pp × cp × tp)           ranks laid out (tp innermost,
//!                                                            then cp, so tensor- and
//!                                                            context-parallel ranks are
//!                                                            neighbours), groups per axis,
//!                                                            and the dp × cp group
//! model     = tensor::parallelize(model, tp group)           layers split by the model's plan
//!                                                            (the loss too: vocab-parallel)
//! model     = context::parallelize(model, cp group)          attention over the sequence
//!                                                            spread on the cp group (ring or
//!                                                            Ulysses), embedding positions
//! model     = precision::apply(model, precision)             products in bf16/f16 (f32 sums);
//! loss      = LossScaling::for_precision(loss)               fp16: the loss scaled
//! stage     = pipeline::split(model, schedule, partition)    this worker's chunk(s); the whole
//!                                                            model as one chunk when pp = 1
//!                                                            (first the partition: the memory
//!                                                            limit is checked before any
//!                                                            parameter is allocated)
//! sync      = data::grad_sync(dp × cp group)                 DDP | single master | nothing
//! ties      = tied::TiedGrads(model ties, pp group)          tied copies across stages
//! tp sync   = tensor::TpGradSync(tp group)                   replicated parameters' gradients
//!                                                            under sequence parallelism
//! optimizer = one per chunk, with the parameter groups' segments
//! ```
//!
//! (Tensor parallelism changes layers' shapes, so it runs before the stage allocates them;
//! the two commute: a pipeline cuts blocks, tensor parallelism splits inside them. Context
//! parallelism rewrites attention on tensor parallelism's share of the heads. Precision
//! comes next, on the layers tensor parallelism put in place, and before the split, so that
//! `partition = time` measures blocks as they will run.)
//!
//! A new dimension is one more module and one more line here; [`Parallel::train_step`] does
//! not branch on the layout. Its phases, for every layout:
//!
//! ```text
//! tokens        = this worker's tokens of the share (context parallelism; all of them else)
//! micro-batches = split(this worker's share, m)
//! sync.begin_step()
//! stage.run_step(schedule)  — forwards, backwards, sends, receives; hooks → sync.grads_ready
//! sync.finish()             — gradients averaged over the replicas and their context-
//!                             parallel workers (or gathered)
//! fp16: unscale, agree on inf/NaN over the world; an overflow skips the update everywhere
//! if sync.updates_parameters(): tp sync, ties.reduce(), clip (norm over one replica's
//!                             pp × tp workers), optimizer step
//! sync.after_update()       — single master: weights broadcast
//! loss and norm shared over the world
//! ```

use crate::context::{CpContext, CpMode};
pub use crate::data::DpMode;
use crate::data::{
    CommTiming, DataParallelError, DdpConfig, GradReduce, GradSync, GroupStatsReducer, ShareShape,
    SyncHooks,
};
use crate::engine::{
    MicroBatches, Partition, SendMode, Stage, StageStores, StateKind, StepOptions,
};
use crate::layout::{Layout, Recompute, ResolvedLayout};
use crate::pipeline::{partition_for, PartitionSpec, TimeProbe};
use crate::precision::{LossScaleConfig, LossScaler, LossScaling};
use crate::tensor::{TpContext, TpGradSync};
use crate::tied::TiedGrads;
use crate::timeline::{Category, Timeline};
use crate::zero::{FullState, ZeroOptions, ZeroStage, ZeroSync};
use crate::{Batch, ParallelError};
use meshtrain_comm::{BufMut, DeviceMesh, GroupHosts, MeshAxis, ProcessGroup, ReduceOp};
use meshtrain_nn::optim::{Optimizer, OptimizerConfig, ParamGroups};
use meshtrain_nn::{Loss, LossValue, Model, ParamStore, ShardSpec};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

mod state;
mod sync;

pub use sync::{grad_sync, DataParallel, DataParallelConfig};

pub use state::{StatePart, StatePiece, StateRange};

/// The settings of the parallel modules that are not part of the layout's shape.
#[derive(Clone, Debug, Default)]
pub struct ParallelOptions {
    pub dp_mode: DpMode,
    pub ddp: DdpConfig,
    /// Batch-norm statistics over the data-parallel group (SyncBatchNorm).
    pub sync_batch_norm: bool,
    pub partition: PartitionSpec,
    pub sends: SendMode,
    /// Tests only: leave out the tensor-parallel sum of replicated parameters' gradients
    /// under sequence parallelism (to show that training then goes wrong).
    pub skip_sequence_parallel_grad_sum: bool,
    /// Dynamic loss scaling under fp16 (GradScaler's defaults).
    pub loss_scale: LossScaleConfig,
    /// Tests only: (step index of this run, world rank) whose gradients are reported as
    /// overflowed, to show that every worker skips that step.
    pub inject_overflow: Option<(u64, usize)>,
    /// ZeRO's prefetching and resharding (the stage is part of the layout).
    pub zero: ZeroOptions,
    /// How attention spreads over the context-parallel group (cp > 1).
    pub cp_mode: CpMode,
    /// Refuse the layout when a worker's model states would exceed this many MiB
    /// ([`crate::memory::check_limit`]), before any parameter is allocated.
    pub memory_limit_mb: Option<f64>,
    /// Where the step runs: the CPU, or CUDA GPUs (`cuda:N`: this worker's).
    pub device: meshtrain_tensor::Device,
    /// Tests only: place every chunk's state on a stand-in device in host memory
    /// ([`crate::engine::StandIn`]), to run the device half of the step without a GPU.
    pub stand_in_device: bool,
    /// f32 products on the GPU may use TF32 tensor cores (`train.tf32`).
    pub tf32: bool,
    /// Replay the step as CUDA graphs (`train.cuda_graph`) where it can be: one worker whose
    /// one chunk is on a GPU, without fp16's loss scaling.
    pub cuda_graph: bool,
    /// Hosts of this many consecutive ranks (0: as the backend knows them): simulates hosts
    /// on the threads backend, overrides MPI's detected placement. Read by the launcher,
    /// which builds the world's `CommConfig`; parallelize goes by the world's placement.
    pub ranks_per_host: usize,
}

/// What the model is trained with (the parts of a step that are not about parallelism).
#[derive(Clone)]
pub struct Training {
    pub loss: Arc<dyn Loss>,
    pub optimizer: OptimizerConfig,
    pub groups: ParamGroups,
    /// Seed of the initial parameters.
    pub seed: u64,
}

/// Where the time of training steps went on this worker (seconds; a sum over steps when
/// accumulated with [`StepTimes::add`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepTimes {
    pub forward_s: f64,
    /// Backward compute (time spent launching communication from its hooks excluded).
    pub backward_s: f64,
    pub optimizer_s: f64,
    /// Data-parallel communication the worker waited for (gradient synchronisation after
    /// backward, the single master's scatter/gather/broadcast, ZeRO's waits for parameters
    /// and reduce-scatters inside forward and backward).
    pub comm_exposed_s: f64,
    /// Data-parallel communication that ran while forward or backward was computing: the
    /// time the communication thread was running collectives before the worker waited for
    /// them (not the compute time between issuing a collective and waiting for it).
    pub comm_hidden_s: f64,
    /// Bytes this worker put into gradient synchronisation.
    pub comm_bytes: u64,
    /// The same traffic in the ZeRO paper's units (an all-reduce counts twice): 2Ψ per step
    /// for DDP and ZeRO-1/2, 3Ψ for ZeRO-3.
    pub comm_traffic_bytes: u64,
    /// ZeRO-3: time forward and backward waited for parameters being all-gathered (part of
    /// `comm_exposed_s`; not in `forward_s` and `backward_s`).
    pub param_gather_s: f64,
    /// Pipelines: time not computing inside the pipelined part of the step (the bubble and
    /// transfers).
    pub pipeline_idle_s: f64,
    /// Tensor parallelism: time forward and backward waited in tensor-parallel collectives
    /// (included in `forward_s` and `backward_s`).
    pub tp_comm_s: f64,
    /// Tensor parallelism: elements through tensor-parallel collectives.
    pub tp_comm_elems: u64,
    /// Context parallelism: time attention waited for key/value blocks or all-to-alls
    /// (included in `forward_s` and `backward_s`).
    pub cp_comm_s: f64,
    /// Context parallelism: time the transfers ran on the communication thread (the part
    /// beyond `cp_comm_s` was hidden behind the block products).
    pub cp_comm_busy_s: f64,
    /// Context parallelism: elements this worker sent.
    pub cp_comm_elems: u64,
}

impl StepTimes {
    pub fn add(&mut self, other: &StepTimes) {
        self.forward_s += other.forward_s;
        self.backward_s += other.backward_s;
        self.optimizer_s += other.optimizer_s;
        self.comm_exposed_s += other.comm_exposed_s;
        self.comm_hidden_s += other.comm_hidden_s;
        self.comm_bytes += other.comm_bytes;
        self.comm_traffic_bytes += other.comm_traffic_bytes;
        self.param_gather_s += other.param_gather_s;
        self.pipeline_idle_s += other.pipeline_idle_s;
        self.tp_comm_s += other.tp_comm_s;
        self.tp_comm_elems += other.tp_comm_elems;
        self.cp_comm_s += other.cp_comm_s;
        self.cp_comm_busy_s += other.cp_comm_busy_s;
        self.cp_comm_elems += other.cp_comm_elems;
    }

    /// The times accumulated since `before` (an earlier copy of the same sum).
    pub fn since(&self, before: &StepTimes) -> StepTimes {
        StepTimes {
            forward_s: self.forward_s - before.forward_s,
            backward_s: self.backward_s - before.backward_s,
            optimizer_s: self.optimizer_s - before.optimizer_s,
            comm_exposed_s: self.comm_exposed_s - before.comm_exposed_s,
            comm_hidden_s: self.comm_hidden_s - before.comm_hidden_s,
            comm_bytes: self.comm_bytes - before.comm_bytes,
            comm_traffic_bytes: self.comm_traffic_bytes - before.comm_traffic_bytes,
            param_gather_s: self.param_gather_s - before.param_gather_s,
            pipeline_idle_s: self.pipeline_idle_s - before.pipeline_idle_s,
            tp_comm_s: self.tp_comm_s - before.tp_comm_s,
            tp_comm_elems: self.tp_comm_elems - before.tp_comm_elems,
            cp_comm_s: self.cp_comm_s - before.cp_comm_s,
            cp_comm_busy_s: self.cp_comm_busy_s - before.cp_comm_busy_s,
            cp_comm_elems: self.cp_comm_elems - before.cp_comm_elems,
        }
    }
}

/// What one training step did: the global loss and gradient norm (the same on every
/// worker) and this worker's times.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    pub loss: f32,
    /// Gradient norm before clipping.
    pub grad_norm: f32,
    pub times: StepTimes,
    /// Most activation bytes this worker held at once (what forward kept for backward).
    pub peak_activation_bytes: usize,
    /// fp16: the step's gradients overflowed on some worker and nobody updated.
    pub skipped: bool,
    /// fp16: the loss scale after this step.
    pub loss_scale: Option<f32>,
    /// Under `train.cuda_graph`: whether this step ran as a replay of the captured graphs
    /// (`None`: the run does not replay its steps), and what to tell the user once (the
    /// step was captured, or why it runs eagerly).
    pub graph_replayed: Option<bool>,
    pub graph_note: Option<String>,
}

/// Bytes this worker holds for its model states, measured from the allocations themselves
/// (vector capacities), not from a formula.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ModelStateMemory {
    pub parameters: usize,
    pub gradients: usize,
    /// Optimizer moments (and under ZeRO only this rank's pieces of them).
    pub optimizer: usize,
    /// ZeRO: the most bytes of gathered blocks, wire buffers and per-block gradients held at
    /// once since the last measurement (not part of the formula's states).
    pub transient_peak: usize,
}

impl ModelStateMemory {
    /// Parameters + gradients + optimizer state.
    pub fn states(&self) -> usize {
        self.parameters + self.gradients + self.optimizer
    }
}

pub use crate::engine::DeviceMemory;

/// Evaluation sums over a whole evaluation set (all replicas' shares).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EvalSums {
    /// Σ mean loss × targets.
    pub loss_sum: f64,
    /// Σ targets.
    pub count: f64,
    /// Σ correct predictions (losses that count them).
    pub correct: Option<f64>,
    /// Σ samples.
    pub samples: f64,
}

impl EvalSums {
    fn add(&mut self, v: &LossValue, samples: usize) {
        self.loss_sum += v.mean as f64 * v.count as f64;
        self.count += v.count as f64;
        self.samples += samples as f64;
        if let Some(c) = v.correct {
            *self.correct.get_or_insert(0.0) += c as f64;
        }
    }

    /// Mean loss per target.
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.count.max(1.0)
    }

    /// Correct predictions per target.
    pub fn accuracy(&self) -> Option<f64> {
        self.correct.map(|c| c / self.count.max(1.0))
    }
}

/// One worker's share of the parallelised model and everything its training step needs.
pub struct Parallel {
    pub mesh: DeviceMesh,
    pub layout: ResolvedLayout,
    pub partition: Partition,
    pub stage: Stage,
    /// One per local chunk.
    pub optimizers: Vec<Optimizer>,
    sync: Box<dyn GradSync>,
    ties: TiedGrads,
    options: StepOptions,
    /// Exact sums over the data-parallel group (evaluation, SyncBatchNorm).
    sums: Option<Arc<GroupStatsReducer>>,
    tp_sync: TpGradSync,
    tp_context: Option<TpContext>,
    cp_context: Option<CpContext>,
    /// The workers whose gradients make up one whole gradient: one replica's pp × tp, or
    /// under ZeRO every worker (each owns other pieces). Gradient norms are summed over them.
    norm_group: Arc<dyn ProcessGroup>,
    /// fp16's dynamic loss scale (`None` for fp32 and bf16).
    scaling: Option<LossScaling>,
    /// `train.memory_limit_mb`, checked with measured activations after the first step
    /// (then `None`).
    step_memory_limit_mb: Option<f64>,
    /// Replay steps as CUDA graphs where they can be (`ParallelOptions::cuda_graph`).
    cuda_graph: bool,
    /// The context-parallel sizes the model allows (for the limit's message).
    cp_sizes: Vec<usize>,
    /// The collectives of a run on several GPUs (`None`: the host's, for host buffers).
    device_collectives: Option<crate::device::DeviceCollectives>,
}

/// How far [`check_device`] goes on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceCheck {
    /// The libraries, the GPU's number, the layout and the layers' kernels, without opening
    /// the GPU: what a launcher asks before it starts workers on the GPUs (a context of its
    /// own would hold GPU memory for the whole job).
    WithoutOpening,
    /// All that, then the GPU opened (its context and compute capability): what the process
    /// that trains on it asks.
    Opening,
}

/// Whether `device` can run `model` under `layout` on this machine, asked before any work
/// (before the data loads, when a caller can: it needs the model and the layout only). The
/// CPU always can; a GPU needs the driver and the CUDA libraries, the GPU itself, a layout
/// whose pieces have a device form, and CUDA kernels for every layer
/// ([`crate::device::check`]), each refused with one message that says what to do.
pub fn check_device(
    model: &Model,
    layout: &Layout,
    device: meshtrain_tensor::Device,
    how: DeviceCheck,
) -> Result<(), ParallelError> {
    crate::device::check(model, layout, device, how)
}

/// Applies the layout's dimensions to `model` for this worker of `world`, in the documented
/// order. Every worker of `world` calls it with the same arguments. `sample` is one
/// micro-batch, needed only to measure block times for `partition = time`.
pub fn parallelize(
    model: &mut Model,
    world: Arc<dyn ProcessGroup>,
    layout: &ResolvedLayout,
    options: &ParallelOptions,
    training: &Training,
    sample: Option<&Batch>,
) -> Result<Parallel, ParallelError> {
    let l = &layout.layout;
    // The device, before any work: the GPU is there and can run the layout's precision, and
    // every layer has its kernels. Several GPUs reduce over NCCL or staged collectives.
    check_device(model, l, options.device, DeviceCheck::Opening)?;
    let (world, device_collectives) = crate::device::collectives_for(world, options)?;
    let mesh = DeviceMesh::new(
        world.clone(),
        &[
            (MeshAxis::Dp, l.dp),
            (MeshAxis::Pp, l.pp),
            (MeshAxis::Cp, l.cp),
            (MeshAxis::Tp, l.tp),
        ],
    )?;
    let (dp, pp, tp, cp) = (
        mesh.group(MeshAxis::Dp).clone(),
        mesh.group(MeshAxis::Pp).clone(),
        mesh.group(MeshAxis::Tp).clone(),
        mesh.group(MeshAxis::Cp).clone(),
    );
    // The pairs that send to each other get their channels before work: on NCCL a
    // communicator per pair, so a stage's activations and its neighbour's gradients, which
    // cross, never queue behind each other (ProcessGroup::prepare_point_to_point).
    if layout.schedule.workers > 1 {
        pp.prepare_point_to_point(&layout.schedule.point_to_point_pairs())?;
    }
    if l.cp > 1 && options.cp_mode == CpMode::Ring {
        cp.prepare_point_to_point(&crate::context::ring_hops(l.cp))?;
    }
    // Gradients are averaged over every worker that holds the same parameters on other
    // data: the replicas, and under context parallelism the sequence chunks (Megatron's
    // data-parallel × context-parallel group).
    let data = if l.cp == 1 {
        dp.clone()
    } else {
        let members = mesh
            .layout()
            .ranks_sharing(world.rank(), &[MeshAxis::Pp, MeshAxis::Tp])?;
        world.new_named_subgroup(&members, &format!("dp-cp{members:?}"))?
    };

    // Placement, before any work: tensor-parallel groups inside a host, and a hierarchical
    // reduction only over hosts holding equal numbers of the data-parallel group's ranks.
    let hosts = &world.config().hosts;
    crate::tensor::check_within_hosts(mesh.layout(), world.global_ranks(), hosts)?;
    if options.ddp.reduce == GradReduce::Hierarchical {
        if options.dp_mode != DpMode::Ddp || l.zero > 0 {
            return Err(DataParallelError::Config(
                "parallel.grad_reduce = \"hierarchical\" is DDP's bucket all-reduce; use it \
                 with dp_mode = \"ddp\" and zero = 0"
                    .into(),
            )
            .into());
        }
        crate::data::is_hierarchical(
            options.ddp.reduce,
            &GroupHosts::of(data.as_ref()),
            data.name(),
            data.follows_hosts(),
        )
        .map_err(DataParallelError::Config)?;
    }

    // Context parallelism's conditions are on the whole model (heads before the split).
    let cp_check = |cp| crate::context::check(model, cp, options.cp_mode, options.dp_mode, l.tp);
    cp_check(l.cp)?;
    // The context-parallel sizes this model allows: what a memory limit's message suggests.
    let cp_sizes: Vec<usize> = [2, 4, 8, 16]
        .into_iter()
        .filter(|&c| cp_check(c).is_ok())
        .collect();

    // 1. Tensor parallelism: the layers split by the model's plan (and the loss with them).
    let tp_context = (l.tp > 1).then(|| {
        let seq = model.input().and_then(|i| i.shape.first().copied());
        TpContext::new(tp.clone(), l.sp, seq.unwrap_or(1) / l.cp)
    });
    let mut loss = training.loss.clone();
    if let Some(ctx) = &tp_context {
        crate::tensor::check(model, l.tp, l.sp, l.cp)?;
        let whole = std::mem::replace(model, Model::new(Vec::new()));
        let (split, output) = crate::tensor::parallelize(whole, ctx);
        *model = split;
        loss = crate::tensor::parallel_loss(loss, output, ctx)?;
    }

    // 1a. Context parallelism: attention over the sequence spread on the cp group, the
    // embedding told its tokens' positions (on tensor parallelism's share of the heads).
    let cp_context = (l.cp > 1).then(|| CpContext::new(cp.clone(), options.cp_mode));
    if let Some(ctx) = &cp_context {
        let whole = std::mem::replace(model, Model::new(Vec::new()));
        *model = crate::context::parallelize(whole, ctx);
    }

    // 1b. Precision: products in bf16/f16 with f32 accumulation; fp16 scales the loss.
    crate::precision::apply(model, l.precision);
    let (scaling, loss) = LossScaling::for_precision(
        l.precision,
        options.loss_scale,
        options.inject_overflow,
        loss,
    )?;

    // 2. Pipeline: this worker's chunks (the whole model when pp = 1).
    let schedule = layout.schedule.clone();
    if schedule.num_chunks() > 1 {
        // (Checked again for library callers: `partition = time` cannot profile tensor- or
        // context-parallel layers on one worker.)
        options
            .partition
            .check(model.num_blocks(), schedule.num_chunks(), l.tp * l.cp)?;
    }
    // (Only `partition = time` runs the sample, and it is refused with cp > 1.)
    let probe = TimeProbe {
        world: world.as_ref(),
        sample: sample.map(|b| (&b.x, b.y.as_slice())),
        loss: loss.as_ref(),
    };
    // A sharded data-parallel mode keeps pieces: the stage does not materialise what it
    // shards (ZeRO-2 gradients; ZeRO-3 parameters too, initialised piece by piece).
    let zero = ZeroStage::from_level(l.zero).filter(|_| data.size() > 1);
    let stores = match zero {
        Some(ZeroStage::Parameters) => StageStores::BuffersOnly,
        Some(ZeroStage::Gradients) => StageStores::WithoutGradients,
        _ => StageStores::Full,
    };
    let partition = partition_for(model, &schedule, &options.partition, probe)?;
    // What each worker will hold is known now, before anything is allocated: a layout
    // whose model states exceed the memory limit on any worker stops here, on every worker.
    if let Some(limit) = options.memory_limit_mb {
        let mine: usize = schedule
            .chunks_of(pp.rank())
            .into_iter()
            .map(|c| {
                model
                    .blocks_param_range(partition.chunks()[c].clone())
                    .len()
            })
            .sum();
        let mut most = [mine as f32];
        world.all_reduce(BufMut::F32(&mut most), ReduceOp::Max)?;
        crate::memory::check_limit(limit, most[0] as f64, training.optimizer, l, options.device)
            .map_err(ParallelError::Memory)?;
    }
    let mut stage = Stage::new_with(
        model,
        &partition,
        schedule,
        pp.rank(),
        training.seed,
        stores,
    )?;

    // 4. Data parallelism: how the replicas (and context-parallel workers) stay equal.
    let DataParallel { mut sync, sums } = grad_sync(
        model,
        &mut stage.chunks,
        layout.schedule.workers,
        &data,
        DataParallelConfig {
            mode: options.dp_mode,
            // "auto" stays flat over NCCL, whose rings and trees already cross hosts once
            // per host (`ProcessGroup::follows_hosts`).
            ddp: options.ddp,
            zero,
            zero_options: options.zero,
            seed: training.seed,
            sync_batch_norm: options.sync_batch_norm,
        },
    )?;

    // 5. Tied parameters, across stages where the pipeline separated them.
    let mut ties = TiedGrads::new(model, &partition, &mut stage, &pp)?;

    // Replicated parameters under tensor parallelism: summed over the tp group when
    // sequence parallelism split their inputs, and counted once in gradient norms.
    let mut tp_sync = TpGradSync::new(
        model,
        &stage.chunks,
        tp_context.as_ref(),
        options.skip_sequence_parallel_grad_sum,
    );
    if tp.rank() > 0 {
        for (chunk, ranges) in stage.chunks.iter_mut().zip(tp_sync.replicated()) {
            for range in ranges {
                chunk.leave_out_of_norms(range.clone());
            }
        }
    }
    for (chunk, ranges) in stage.chunks.iter_mut().zip(tp_sync.kv_left_out_of_norms()) {
        for range in ranges {
            chunk.leave_out_of_norms(range);
        }
    }
    // ZeRO updates this rank's pieces: ties, replicated sums and norms address them.
    let sharding = crate::zero::of(sync.as_ref()).map(ZeroSync::sharding);
    if let Some(sharding) = &sharding {
        ties.remap(|j, r| sharding.update_ranges(j, r));
        tp_sync.remap(|j, r| sharding.update_ranges(j, r));
        for (j, chunk) in stage.chunks.iter_mut().enumerate() {
            let len = model.blocks_param_range(chunk.blocks.clone()).len();
            chunk.norm_skip = sharding.norm_skip(j, &chunk.norm_skip, len);
        }
    }
    let norm_group = if sharding.is_some() {
        world.clone()
    } else if l.tp == 1 {
        pp.clone()
    } else {
        let members = mesh
            .layout()
            .ranks_sharing(world.rank(), &[MeshAxis::Dp, MeshAxis::Cp])?;
        let (d, c) = (mesh.coordinate(MeshAxis::Dp), mesh.coordinate(MeshAxis::Cp));
        world.new_named_subgroup(&members, &format!("mp[dp{d},cp{c}]"))?
    };

    let segments = training.groups.resolve(model, &training.optimizer);
    let mut optimizers = match crate::zero::of_mut(sync.as_mut()) {
        Some(zero) => stage
            .chunks
            .iter()
            .enumerate()
            .map(|(j, chunk)| {
                let base = model.blocks_param_range(chunk.blocks.clone()).start;
                zero.optimizer(j, training.optimizer, &segments, base)
            })
            .collect(),
        None => stage.optimizers_with_groups(model, training.optimizer, &segments),
    };
    // 6. Placement: each chunk's state on the run's device for the whole run (the host
    // keeps no copy of it). Nothing on the CPU.
    crate::device::place(
        model,
        &mut stage,
        &mut optimizers,
        options,
        crate::precision::product_dtype(l.precision),
        sync.as_mut(),
    )?;
    Ok(Parallel {
        device_collectives,
        options: StepOptions {
            loss,
            recompute: l.recompute == Recompute::Full,
            sends: options.sends,
        },
        mesh,
        layout: layout.clone(),
        partition,
        stage,
        optimizers,
        sync,
        ties,
        sums,
        tp_sync,
        tp_context,
        cp_context,
        norm_group,
        scaling,
        step_memory_limit_mb: options.memory_limit_mb,
        cuda_graph: options.cuda_graph,
        cp_sizes,
    })
}

impl Parallel {
    pub fn world(&self) -> &Arc<dyn ProcessGroup> {
        self.mesh.world()
    }

    /// (coordinate, size) along the data-parallel axis.
    pub fn dp_rank_and_size(&self) -> (usize, usize) {
        (
            self.mesh.coordinate(MeshAxis::Dp),
            self.mesh.size(MeshAxis::Dp),
        )
    }

    /// World rank 0 (stage 0 of replica 0) prints, logs and writes files.
    pub fn is_lead(&self) -> bool {
        self.world().rank() == 0
    }

    /// What this worker's context-parallel attention communicated so far (`None` without
    /// context parallelism).
    pub fn cp_comm(&self) -> Option<crate::context::CpComm> {
        self.cp_context.as_ref().map(|c| c.stats.snapshot())
    }

    /// This worker's tokens of a replica's batch (all of them without context parallelism).
    fn own_tokens(&self, batch: Batch) -> Result<Batch, ParallelError> {
        match &self.cp_context {
            Some(ctx) => Ok(crate::context::shard_batch(batch, ctx.shard())?),
            None => Ok(batch),
        }
    }

    /// What this worker's tensor-parallel layers communicated so far (`None` without tensor
    /// parallelism).
    pub fn tp_comm(&self) -> Option<crate::tensor::TpComm> {
        self.tp_context.as_ref().map(|c| c.stats.snapshot())
    }

    /// This worker's model-state bytes, measured (call between steps: during a step ZeRO's
    /// pieces move between stores).
    pub fn model_state_memory(&mut self) -> ModelStateMemory {
        let mut m = ModelStateMemory::default();
        for (chunk, opt) in self.stage.chunks.iter().zip(&self.optimizers) {
            match &chunk.device {
                Some(d) => {
                    let (parameters, gradients, optimizer) = d.state_bytes();
                    m.parameters += parameters;
                    m.gradients += gradients;
                    m.optimizer += optimizer;
                }
                None => {
                    m.parameters += chunk.store.values.capacity() * 4;
                    m.gradients += chunk.store.grads.capacity() * 4;
                    m.optimizer += (opt.m.capacity() + opt.v.capacity()) * 4;
                }
            }
        }
        if let Some(zero) = crate::zero::of_mut(self.sync.as_mut()) {
            let (grads, values, transient) = zero.memory();
            m.gradients += grads;
            m.parameters += values;
            m.transient_peak = transient;
        }
        m
    }

    /// Model states on the device (none on the CPU): what an out-of-memory's advice leaves
    /// beside the activations, and what ZeRO-1 (the first stage, which shards the
    /// moments) would free when the replicas hold every moment.
    fn states_on_device(&self) -> crate::device::StatesOnDevice {
        let (mut bytes, mut moments) = (0, 0);
        for d in self.stage.chunks.iter().filter_map(|c| c.device.as_ref()) {
            let (p, g, o) = d.state_bytes();
            bytes += p + g + o;
            moments += o;
        }
        let ranks = self.layout.layout.dp * self.layout.layout.cp;
        let sharding = (self.zero_stage().is_none() && ranks > 1 && moments > 0).then(|| {
            crate::device::ShardingRoom {
                stage: 1,
                ranks,
                frees: moments - moments / ranks,
            }
        });
        crate::device::StatesOnDevice { bytes, sharding }
    }

    /// The ZeRO stage the replicas run (`None`: full replicas).
    pub fn zero_stage(&self) -> Option<ZeroStage> {
        crate::zero::of(self.sync.as_ref()).map(ZeroSync::stage)
    }

    /// The data-parallel mode's name (`none` for one replica).
    pub fn sync_name(&self) -> &'static str {
        self.sync.name()
    }

    /// The (rank, world) of the share of each global batch this worker loads, or `None` if
    /// it receives its share (the single master's other replicas).
    pub fn loads(&self) -> Option<(usize, usize)> {
        // The synchronisation runs over dp × cp workers; the context-parallel workers of a
        // replica load the same samples (and each keeps its tokens).
        let cp = self.mesh.size(MeshAxis::Cp);
        self.sync
            .loads()
            .map(|(rank, size)| (rank / cp, (size / cp).max(1)))
    }

    /// This replica's share of a step's batch from what this worker loaded.
    pub fn share(
        &mut self,
        loaded: Option<Batch>,
        shape: &ShareShape,
    ) -> Result<(Batch, CommTiming), ParallelError> {
        Ok(self.sync.share(loaded, shape)?)
    }

    /// One training step on this replica's `share` of the global batch at learning rate
    /// `lr`, clipping the global gradient norm to `clip`. Records into `timeline` if given
    /// (cleared first: it shows the last step).
    pub fn train_step(
        &mut self,
        model: &Model,
        share: Batch,
        lr: f32,
        clip: Option<f32>,
        timeline: Option<&mut Timeline>,
    ) -> Result<StepStats, ParallelError> {
        let samples = share.samples;
        let states = self.states_on_device();
        crate::device::guarded(samples, states, || {
            self.train_step_unguarded(model, share, lr, clip, timeline)
        })
    }

    fn train_step_unguarded(
        &mut self,
        model: &Model,
        share: Batch,
        lr: f32,
        clip: Option<f32>,
        mut timeline: Option<&mut Timeline>,
    ) -> Result<StepStats, ParallelError> {
        let share = self.own_tokens(share)?;
        let micro = MicroBatches::split_owned(share.x, share.y, self.layout.micro_batches())?;
        let pp = self.mesh.group(MeshAxis::Pp).clone();
        if let Some(t) = timeline.as_deref_mut() {
            t.clear();
        }
        let tp_before = self.tp_comm().unwrap_or_default();
        let cp_before = self.cp_comm().unwrap_or_default();
        let graphed = self.graphed();
        if graphed {
            self.graphed_chunk().begin_step_graph();
        }
        let Parallel {
            stage,
            sync,
            options,
            ..
        } = self;
        sync.begin_step();
        let report = stage.run_step(
            model,
            pp.as_ref(),
            micro,
            options,
            timeline.as_deref_mut(),
            &mut SyncHooks(sync.as_mut()),
        )?;
        let wait = Instant::now();
        let comm = self.sync.finish(&mut self.stage.chunks)?;
        let synchronised = self.mesh.size(MeshAxis::Dp) * self.mesh.size(MeshAxis::Cp) > 1;
        let buckets = self.sync.take_comm_spans();
        if let (Some(t), true) = (timeline.as_deref_mut(), synchronised) {
            // Each bucket's all-reduce where it ran (under backward when it overlapped), on
            // the communication row; then what the compute thread waited for at the end.
            for (label, span) in buckets {
                t.record(
                    label,
                    Category::Communication,
                    span.began,
                    span.finished,
                    None,
                );
            }
            t.record(
                "dp all-reduce wait",
                Category::CommWait,
                wait,
                Instant::now(),
                None,
            );
        }
        let mut times = StepTimes {
            forward_s: report.forward_s - comm.in_forward_s,
            backward_s: report.backward_s - comm.in_backward_s,
            comm_exposed_s: comm.exposed_s,
            comm_hidden_s: comm.hidden_s,
            comm_bytes: comm.bytes as u64,
            comm_traffic_bytes: comm.traffic_bytes as u64,
            param_gather_s: comm.param_gather_s,
            ..StepTimes::default()
        };
        if pp.size() > 1 {
            times.pipeline_idle_s = (report.wall_s - report.compute_s()).max(0.0);
        }
        if let Some(now) = self.tp_comm() {
            let tp = now.since(&tp_before);
            (times.tp_comm_s, times.tp_comm_elems) = (tp.wait_s, tp.elems());
        }
        if let Some(now) = self.cp_comm() {
            let cp = now.since(&cp_before);
            (times.cp_comm_s, times.cp_comm_busy_s, times.cp_comm_elems) =
                (cp.exposed_s, cp.busy_s, cp.elems);
        }

        let t = Instant::now();
        let mut norm = 0.0;
        let scaled = match &mut self.scaling {
            Some(scaling) => {
                let found_inf = self.stage.unscale_grads(1.0 / scaling.scale());
                Some(scaling.decide(found_inf, self.mesh.world().as_ref())?)
            }
            None => None,
        };
        let skipped = scaled.is_some_and(|o| o.skipped);
        if self.sync.updates_parameters() && !skipped {
            self.tp_sync.reduce(&mut self.stage.chunks)?;
            self.ties.reduce(&mut self.stage.chunks)?;
            let mp = self.norm_group.as_ref();
            norm = match clip {
                Some(c) => self.stage.clip_grad_norm(mp, c)?,
                None => self.stage.grad_norm(mp)?,
            };
            self.stage
                .optimizer_step(&mut self.optimizers, lr, timeline);
        } else {
            self.stage.zero_grads();
        }
        let graph = graphed.then(|| self.graphed_chunk().end_step_graph());
        times.optimizer_s = t.elapsed().as_secs_f64();
        let after = self.sync.after_update(&mut self.stage.chunks)?;
        times.comm_exposed_s += after.exposed_s;
        times.comm_bytes += after.bytes as u64;
        times.comm_traffic_bytes += after.traffic_bytes as u64;

        // Each replica's last stage has its replica's mean loss (every tensor-parallel rank
        // of it: the first one reports); world rank 0 (an updating worker in every mode) has
        // the norm. Every worker gets both (for logs and the divergence check).
        let t = Instant::now();
        let world = self.mesh.world().clone();
        // Context-parallel workers each have the mean over their tokens (equal counts).
        let replicas = (self.mesh.size(MeshAxis::Dp) * self.mesh.size(MeshAxis::Cp)) as f32;
        let reports = self.mesh.coordinate(MeshAxis::Tp) == 0;
        let mut shared = [
            report
                .loss
                .filter(|_| reports)
                .map_or(0.0, |l| l / replicas),
            if world.rank() == 0 { norm } else { 0.0 },
        ];
        if world.size() > 1 {
            world.all_reduce(BufMut::F32(&mut shared), ReduceOp::Sum)?;
            times.comm_exposed_s += t.elapsed().as_secs_f64();
        }
        if let Some(limit) = self.step_memory_limit_mb.take() {
            let states = self.model_state_memory();
            let mut most = [
                (states.states() + states.transient_peak) as f32,
                report.peak_activation_bytes as f32,
            ];
            // The largest worker's states and activations (a stage may have more of both).
            world.all_reduce(BufMut::F32(&mut most), ReduceOp::Max)?;
            crate::memory::check_step_limit(
                limit,
                most[0] as f64,
                most[1] as f64,
                &self.layout.layout,
                &self.cp_sizes,
            )
            .map_err(ParallelError::Memory)?;
        }
        Ok(StepStats {
            loss: shared[0],
            grad_norm: shared[1],
            times,
            peak_activation_bytes: report.peak_activation_bytes,
            skipped,
            loss_scale: scaled.map(|o| o.scale),
            graph_replayed: graph.as_ref().map(|g| g.replayed),
            graph_note: graph.and_then(|g| g.note),
        })
    }

    /// Whether the step is to run as CUDA graphs (`train.cuda_graph`): one worker, one chunk
    /// placed on a device, no fp16 loss scaling (whose overflow check decides on the host
    /// whether the update runs).
    fn graphed(&self) -> bool {
        self.cuda_graph
            && self.mesh.world().size() == 1
            && self.scaling.is_none()
            && matches!(&self.stage.chunks[..], [c] if c.device.is_some())
    }

    fn graphed_chunk(&mut self) -> &mut dyn crate::engine::DeviceState {
        self.stage.chunks[0]
            .device
            .as_deref_mut()
            .expect("a graphed step's chunk is on a device")
    }

    /// The device this worker's chunks are placed on (all of them are on the same one), if
    /// any.
    fn placed(&self) -> Option<&dyn crate::engine::DeviceState> {
        self.stage.chunks.iter().find_map(|c| c.device.as_deref())
    }

    /// Where this worker's state lives during steps: its chunks' device, or the CPU.
    pub fn device(&self) -> meshtrain_tensor::Device {
        self.placed()
            .map_or(meshtrain_tensor::Device::Cpu, |d| d.device())
    }

    /// The GPU's memory, when the run has one.
    pub fn device_memory(&self) -> Option<DeviceMemory> {
        self.placed().map(|d| d.memory())
    }

    /// On a GPU: fills the stage's host stores and optimizers with the device's parameters,
    /// buffers and optimizer state, for what needs the whole state on the host (a gathered
    /// checkpoint, the evaluation hook): the vectors of `kinds` ([`StateKind::ALL`], or the
    /// model alone: [`StateKind::MODEL`]); free it again with
    /// [`Parallel::release_host_state`]. A no-op on the CPU.
    pub fn pull_from_device(&mut self, kinds: &[StateKind]) -> Result<(), ParallelError> {
        for (chunk, opt) in self.stage.chunks.iter_mut().zip(&mut self.optimizers) {
            chunk.pull_from_device(opt, kinds)?;
        }
        Ok(())
    }

    /// On a GPU: frees the host copy [`Parallel::pull_from_device`] filled. A no-op on the
    /// CPU.
    pub fn release_host_state(&mut self) {
        for (chunk, opt) in self.stage.chunks.iter_mut().zip(&mut self.optimizers) {
            chunk.release_host_state(opt);
        }
    }

    /// Runs `f` with the state's `kinds` on the host: filled from the device first and freed
    /// after (on the CPU, `f` as it is).
    pub fn with_host_state<T>(
        &mut self,
        kinds: &[StateKind],
        f: impl FnOnce(&mut Parallel) -> T,
    ) -> Result<T, ParallelError> {
        self.pull_from_device(kinds)?;
        let out = f(self);
        self.release_host_state();
        Ok(out)
    }

    /// Whether the chunks' state lives on a device (the host holds none of it between
    /// steps: a checkpoint reads it through [`Parallel::read_state`]).
    pub fn is_placed(&self) -> bool {
        self.placed().is_some()
    }

    /// fp16's loss scaler state (for checkpoints); `None` for fp32 and bf16.
    pub fn loss_scaler(&self) -> Option<LossScaler> {
        self.scaling.as_ref().map(LossScaling::scaler)
    }

    /// Continues fp16 loss scaling from a checkpoint's state (ignored for fp32 and bf16).
    pub fn restore_loss_scaler(&mut self, scaler: LossScaler) {
        if let Some(s) = &mut self.scaling {
            s.restore(scaler);
        }
    }

    /// Evaluates one batch of this replica's evaluation share through the pipeline and adds
    /// its loss to `sums` (on the worker of the last stage; others add nothing). Every worker
    /// of a replica calls it with the same number of batches.
    pub fn eval_batch(
        &mut self,
        model: &Model,
        batch: Batch,
        sums: &mut EvalSums,
    ) -> Result<(), ParallelError> {
        let pp = self.mesh.group(MeshAxis::Pp).clone();
        // The sums run over dp × cp workers: one of a replica's context-parallel workers
        // counts its samples, each its tokens' losses.
        let samples = if self.mesh.coordinate(MeshAxis::Cp) == 0 {
            batch.samples
        } else {
            0
        };
        let batch = self.own_tokens(batch)?;
        let micro = MicroBatches {
            inputs: vec![batch.x],
            targets: vec![batch.y],
        };
        let states = self.states_on_device();
        crate::device::guarded(batch.samples, states, || {
            let values = self.stage.evaluate(
                model,
                pp.as_ref(),
                micro,
                &self.options,
                &mut SyncHooks(self.sync.as_mut()),
            );
            self.sync.check_pass()?;
            if let Some(values) = values? {
                values.iter().for_each(|v| sums.add(v, samples));
            }
            Ok(())
        })
    }

    /// The evaluation sums of every replica, exact (f64) and the same on every worker.
    pub fn reduce_eval(&mut self, sums: EvalSums) -> Result<EvalSums, ParallelError> {
        let pp = self.mesh.group(MeshAxis::Pp);
        let mut v = [
            sums.loss_sum,
            sums.count,
            sums.correct.unwrap_or(f64::NAN),
            sums.samples,
        ];
        if pp.size() > 1 {
            // The worker of the last chunk has them; it sends them to its stages as f32
            // word pairs (exact).
            let last = self
                .stage
                .schedule()
                .worker_of(self.stage.schedule().num_chunks() - 1);
            let mut words: Vec<f32> = v
                .iter()
                .flat_map(|x| {
                    let b = x.to_bits();
                    [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
                })
                .collect();
            pp.broadcast(BufMut::F32(&mut words), last)?;
            for (x, w) in v.iter_mut().zip(words.chunks(2)) {
                *x = f64::from_bits(w[0].to_bits() as u64 | ((w[1].to_bits() as u64) << 32));
            }
        }
        if let Some(s) = &self.sums {
            s.try_sum(&mut v)?;
        }
        Ok(EvalSums {
            loss_sum: v[0],
            count: v[1],
            correct: (!v[2].is_nan()).then_some(v[2]),
            samples: v[3],
        })
    }

    /// How the gradients are all-reduced across replicas: `flat`, `hierarchical`, or `None`
    /// when they are not all-reduced by DDP (ZeRO, the single master, one replica).
    pub fn all_reduce_kind(&self) -> Option<&'static str> {
        self.sync.all_reduce_kind()
    }

    /// One line on how the model is laid out, for the start of a run.
    pub fn describe(&self, model: &Model) -> String {
        let schedule = self.stage.schedule();
        let l = &self.layout.layout;
        let mut out = format!(
            "layout {l}: {} data-parallel replica(s) ({}), {} micro-batch(es) of {} per replica",
            l.dp,
            self.sync.name(),
            self.layout.micro_batches(),
            l.micro_batch_size.unwrap_or(0),
        );
        if let Some(d) = self.placed() {
            out += &format!(
                "; on GPU {}, parameters, gradients, optimizer state and activations on the \
                 device",
                d.describe()
            );
            out += match self.device_collectives {
                Some(crate::device::DeviceCollectives::Nccl) => ", gradients reduced over NCCL",
                Some(crate::device::DeviceCollectives::Staged) => {
                    ", gradients reduced through host memory (staged: ranks share a GPU, or \
                     NCCL is missing)"
                }
                None => "",
            };
            let ring = self
                .cp_context
                .as_ref()
                .is_some_and(|c| c.mode == CpMode::Ring);
            if self.device_collectives == Some(crate::device::DeviceCollectives::Nccl)
                && (l.pp > 1 || ring)
            {
                out += "; sends between stages and ring neighbours over NCCL too (a \
                        communicator per pair that sends)";
            }
        }
        if let Some(cp) = &self.cp_context {
            out += &format!(
                "; each sequence spread over {} context-parallel workers ({} attention; \
                 gradients averaged over dp × cp)",
                l.cp, cp.mode
            );
        }
        if l.pp > 1 {
            let stages: Vec<String> = self
                .partition
                .chunks()
                .iter()
                .enumerate()
                .map(|(c, blocks)| {
                    let params = model.blocks_param_range(blocks.clone()).len();
                    format!(
                        "chunk {c} on stage {}: blocks {blocks:?} ({params} parameters)",
                        schedule.worker_of(c)
                    )
                })
                .collect();
            out += &format!(
                "; pipeline schedule {} over {} stages (predicted bubble {:.0}%): {}",
                schedule.kind,
                l.pp,
                100.0
                    * schedule
                        .kind
                        .predicted_idle_fraction(schedule.workers, self.layout.micro_batches()),
                stages.join("; ")
            );
        }
        out
    }
}
