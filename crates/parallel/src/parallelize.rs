//! The model transformed by the layout's parallel dimensions, and the one training step every
//! layout runs.
//!
//! [`parallelize`] applies one module per dimension, always in this order (torchtitan's):
//!
//! ```text
//! mesh      = DeviceMesh(world, dp × pp)                     ranks laid out, groups per axis
//! stage     = pipeline::split(model, schedule, partition)    this worker's chunk(s); the whole
//!                                                            model as one chunk when pp = 1
//! (tensor::parallelize, context::parallelize: tp = cp = 1 until those modules exist)
//! sync      = data::grad_sync(dp group)                      DDP | single master | nothing
//! ties      = tied::TiedGrads(model ties, pp group)          tied copies across stages
//! (precision::apply: fp32 until mixed precision exists)
//! optimizer = one per chunk, with the parameter groups' segments
//! ```
//!
//! A new dimension is one more module and one more line here; [`Parallel::train_step`] does
//! not branch on the layout. Its phases, for every layout:
//!
//! ```text
//! micro-batches = split(this replica's share, m)
//! sync.begin_step()
//! stage.run_step(schedule)  — forwards, backwards, sends, receives; hooks → sync.grads_ready
//! sync.finish()             — gradients averaged over the replicas (or gathered)
//! if sync.updates_parameters(): ties.reduce(), clip (norm over the pp group), optimizer step
//! sync.after_update()       — single master: weights broadcast
//! loss and norm shared over the world
//! ```

pub use crate::data::DpMode;
use crate::data::{
    grad_sync, CommTiming, DataParallel, DdpConfig, GradSync, GroupStatsReducer, ShareShape,
};
use crate::layout::{Recompute, ResolvedLayout};
use crate::pipeline::{
    split, MicroBatches, Partition, PartitionSpec, SendMode, Stage, StepOptions, TimeProbe,
};
use crate::tied::TiedGrads;
use crate::timeline::{Category, Timeline};
use crate::{Batch, ParallelError};
use meshtrain_comm::{BufMut, DeviceMesh, MeshAxis, ProcessGroup, ReduceOp};
use meshtrain_nn::optim::{Optimizer, OptimizerConfig, ParamGroups};
use meshtrain_nn::{Loss, LossValue, Model, ParamStore};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// The settings of the parallel modules that are not part of the layout's shape.
#[derive(Clone, Debug, Default)]
pub struct ParallelOptions {
    pub dp_mode: DpMode,
    pub ddp: DdpConfig,
    /// Batch-norm statistics over the data-parallel group (SyncBatchNorm).
    pub sync_batch_norm: bool,
    pub partition: PartitionSpec,
    pub sends: SendMode,
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
    /// Communication the worker waited for (gradient synchronisation after backward, the
    /// single master's scatter/gather/broadcast).
    pub comm_exposed_s: f64,
    /// Communication that ran while backward was computing.
    pub comm_hidden_s: f64,
    /// Bytes this worker put into gradient synchronisation.
    pub comm_bytes: u64,
    /// Pipelines: time not computing inside the pipelined part of the step (the bubble and
    /// transfers).
    pub pipeline_idle_s: f64,
}

impl StepTimes {
    pub fn add(&mut self, other: &StepTimes) {
        self.forward_s += other.forward_s;
        self.backward_s += other.backward_s;
        self.optimizer_s += other.optimizer_s;
        self.comm_exposed_s += other.comm_exposed_s;
        self.comm_hidden_s += other.comm_hidden_s;
        self.comm_bytes += other.comm_bytes;
        self.pipeline_idle_s += other.pipeline_idle_s;
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
            pipeline_idle_s: self.pipeline_idle_s - before.pipeline_idle_s,
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
}

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
    let mesh = DeviceMesh::new(world.clone(), &[(MeshAxis::Dp, l.dp), (MeshAxis::Pp, l.pp)])?;
    let (dp, pp) = (
        mesh.group(MeshAxis::Dp).clone(),
        mesh.group(MeshAxis::Pp).clone(),
    );

    // 1. Pipeline: this worker's chunks (the whole model when pp = 1).
    let probe = TimeProbe {
        world: world.as_ref(),
        sample: sample.map(|b| (&b.x, b.y.as_slice())),
        loss: training.loss.as_ref(),
    };
    let (partition, mut stage) = split(
        model,
        layout.schedule.clone(),
        &options.partition,
        pp.rank(),
        training.seed,
        probe,
    )?;

    // 2. Tensor and 3. context parallelism: not yet (`Layout::resolve` rejects tp, cp > 1).

    // 4. Data parallelism: how the replicas stay equal.
    let DataParallel { sync, sums } = grad_sync(
        model,
        &mut stage.chunks,
        layout.schedule.workers,
        &dp,
        options.dp_mode,
        options.ddp,
        options.sync_batch_norm,
    )?;

    // 5. Tied parameters, across stages where the pipeline separated them.
    let ties = TiedGrads::new(model, &partition, &mut stage, &pp)?;

    // 6. Precision: fp32 until mixed precision exists (`Layout::resolve` rejects others).

    let segments = training.groups.resolve(model, &training.optimizer);
    let optimizers = stage.optimizers_with_groups(model, training.optimizer, &segments);
    Ok(Parallel {
        options: StepOptions {
            loss: training.loss.clone(),
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

    /// The data-parallel mode's name (`none` for one replica).
    pub fn sync_name(&self) -> &'static str {
        self.sync.name()
    }

    /// The (rank, world) of the share of each global batch this worker loads, or `None` if
    /// it receives its share (the single master's other replicas).
    pub fn loads(&self) -> Option<(usize, usize)> {
        self.sync.loads()
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
        mut timeline: Option<&mut Timeline>,
    ) -> Result<StepStats, ParallelError> {
        let micro = MicroBatches::split_owned(share.x, share.y, self.layout.micro_batches())?;
        let pp = self.mesh.group(MeshAxis::Pp).clone();
        if let Some(t) = timeline.as_deref_mut() {
            t.clear();
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
            &mut |ready| sync.grads_ready(ready),
        )?;
        let wait = Instant::now();
        let comm = self.sync.finish(&mut self.stage.chunks)?;
        if let (Some(t), true) = (timeline.as_deref_mut(), self.mesh.size(MeshAxis::Dp) > 1) {
            t.record(
                "dp all-reduce wait",
                Category::Communication,
                wait,
                Instant::now(),
                None,
            );
        }
        let mut times = StepTimes {
            forward_s: report.forward_s,
            backward_s: report.backward_s - comm.in_backward_s,
            comm_exposed_s: comm.exposed_s,
            comm_hidden_s: comm.hidden_s,
            comm_bytes: comm.bytes as u64,
            ..StepTimes::default()
        };
        if pp.size() > 1 {
            times.pipeline_idle_s = (report.wall_s - report.compute_s()).max(0.0);
        }

        let t = Instant::now();
        let mut norm = 0.0;
        if self.sync.updates_parameters() {
            self.ties.reduce(&mut self.stage.chunks)?;
            norm = match clip {
                Some(c) => self.stage.clip_grad_norm(pp.as_ref(), c)?,
                None => self.stage.grad_norm(pp.as_ref())?,
            };
            self.stage
                .optimizer_step(&mut self.optimizers, lr, timeline);
        } else {
            self.stage.zero_grads();
        }
        times.optimizer_s = t.elapsed().as_secs_f64();
        times.comm_exposed_s += self.sync.after_update(&mut self.stage.chunks)?.exposed_s;

        // Each replica's last stage has its replica's mean loss; world rank 0 (an updating
        // worker in every mode) has the norm. Every worker gets both (for logs and the
        // divergence check).
        let t = Instant::now();
        let world = self.mesh.world();
        let replicas = self.mesh.size(MeshAxis::Dp) as f32;
        let mut shared = [
            report.loss.map_or(0.0, |l| l / replicas),
            if world.rank() == 0 { norm } else { 0.0 },
        ];
        if world.size() > 1 {
            world.all_reduce(BufMut::F32(&mut shared), ReduceOp::Sum)?;
            times.comm_exposed_s += t.elapsed().as_secs_f64();
        }
        Ok(StepStats {
            loss: shared[0],
            grad_norm: shared[1],
            times,
        })
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
        let samples = batch.samples;
        let micro = MicroBatches {
            inputs: vec![batch.x],
            targets: vec![batch.y],
        };
        if let Some(values) = self
            .stage
            .evaluate(model, pp.as_ref(), micro, &self.options)?
        {
            values.iter().for_each(|v| sums.add(v, samples));
        }
        Ok(())
    }

    /// The evaluation sums of every replica, exact (f64) and the same on every worker.
    pub fn reduce_eval(&self, sums: EvalSums) -> Result<EvalSums, ParallelError> {
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

    /// The whole model's parameters, buffers and optimizer state on world rank 0 (`None`
    /// elsewhere): the contents of a standard checkpoint, whatever the layout. Replicas are
    /// identical, so only replica 0's stages take part. Call it on every worker.
    pub fn gather_state(
        &self,
        model: &Model,
    ) -> Result<Option<(ParamStore, Optimizer)>, ParallelError> {
        if self.mesh.coordinate(MeshAxis::Dp) != 0 {
            return Ok(None);
        }
        let pp = self.mesh.group(MeshAxis::Pp);
        let gathered = self.stage.gather(model, pp.as_ref())?;
        let chunks = self.partition.len();
        // Stage::gather used the tags below 2·chunks; these follow them.
        let tag = |chunk: usize, moment: usize| (2 * chunks + 2 * chunk + moment) as u32;
        if pp.rank() != 0 {
            for (chunk, opt) in self.stage.chunks.iter().zip(&self.optimizers) {
                pp.send((&opt.m).into(), 0, tag(chunk.index, 0))?;
                if !opt.v.is_empty() {
                    pp.send((&opt.v).into(), 0, tag(chunk.index, 1))?;
                }
            }
            return Ok(None);
        }
        let first = &self.optimizers[0];
        let mut full = Optimizer::new(first.config, model.num_params());
        full.step = first.step;
        let schedule = self.stage.schedule();
        for (c, blocks) in self.partition.chunks().iter().enumerate() {
            let range = model.blocks_param_range(blocks.clone());
            let owner = schedule.worker_of(c);
            if owner == 0 {
                let opt = &self.optimizers[c / schedule.workers];
                full.m[range.clone()].copy_from_slice(&opt.m);
                if !full.v.is_empty() {
                    full.v[range].copy_from_slice(&opt.v);
                }
                continue;
            }
            pp.recv((&mut full.m[range.clone()]).into(), owner, tag(c, 0))?;
            if !full.v.is_empty() {
                pp.recv((&mut full.v[range]).into(), owner, tag(c, 1))?;
            }
        }
        Ok(gathered.map(|store| (store, full)))
    }

    /// Continues from a whole-model state (every worker reads the same checkpoint and keeps
    /// its share).
    pub fn load_state(&mut self, model: &Model, full: &ParamStore, optimizer: &Optimizer) {
        self.stage.load_from(model, full);
        for (chunk, local) in self.stage.chunks.iter().zip(&mut self.optimizers) {
            let range = model.blocks_param_range(chunk.blocks.clone());
            local.m.copy_from_slice(&optimizer.m[range.clone()]);
            if !local.v.is_empty() {
                local.v.copy_from_slice(&optimizer.v[range]);
            }
            local.step = optimizer.step;
        }
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
