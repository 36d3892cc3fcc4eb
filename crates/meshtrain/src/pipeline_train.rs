//! Pipeline-parallel training from the command line (`meshtrain train --pp P ...`): the
//! trainer's hooks for a worker that holds one pipeline stage of one data-parallel replica.
//!
//! Layout: `dp × pp` workers on a [`DeviceMesh`] with axes (dp, pp), pp varying fastest, so a
//! replica's stages are neighbouring ranks and world rank 0 is stage 0 of replica 0. Each
//! worker runs the pipeline executor ([`Stage::run_step`]) on its chunks; with `dp > 1` each
//! chunk has its own [`Ddp`] over the dp group, fed from the executor's `GradsReady` callback
//! during the chunk's last backward, so the all-reduce of a stage's gradients overlaps the
//! backward of the last micro-batches. Loss, gradient norm and clipping are global (the
//! loss is averaged over the replicas, the norm is taken over all stages).
//!
//! Everything a single worker writes stays the same: evaluation runs on rank 0 on the model
//! gathered from the stages ([`Stage::gather`]), and checkpoints gather the parameters *and*
//! the per-chunk optimizer state, so a pipeline checkpoint is the standard checkpoint file
//! (resumable by any layout, including a single worker).

use crate::checkpoint;
use crate::config::{Config, DpMode};
use crate::train::{build_model, Batch, Breakdown, Trainer};
use anyhow::{anyhow, bail, Context, Result};
use meshtrain_chart::{Color, Span as ChartSpan, Timeline as Chart, TimelineRow};
use meshtrain_comm::{BufMut, DeviceMesh, MeshAxis, ProcessGroup, ReduceOp};
use meshtrain_nn::optim::{Optimizer, OptimizerConfig};
use meshtrain_nn::{Model, ParamStore};
use meshtrain_parallel::data::{CommTiming, Ddp, DdpConfig};
use meshtrain_parallel::pipeline::{
    MicroBatches, Partition, Schedule, ScheduleKind, SendMode, Stage, StepOptions,
};
use meshtrain_parallel::timeline::{chrome_trace, Category, Timeline};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

/// How the model's blocks are cut into stages (`parallel.partition`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartitionSpec {
    /// Equal parameter counts (cheap; ignores that compute per parameter varies).
    Params,
    /// Equal numbers of blocks.
    Balanced,
    /// Equal measured forward + backward time per stage (rank 0 profiles, all agree).
    Time,
    /// Cut before these block indices.
    Explicit(Vec<usize>),
}

impl FromStr for PartitionSpec {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "params" => PartitionSpec::Params,
            "balanced" => PartitionSpec::Balanced,
            "time" => PartitionSpec::Time,
            _ => match s.strip_prefix("explicit:") {
                Some(cuts) => PartitionSpec::Explicit(
                    cuts.split(',')
                        .map(|c| c.trim().parse::<usize>())
                        .collect::<Result<_, _>>()
                        .map_err(|_| {
                            anyhow!(
                                "parallel.partition '{s}': cuts must be block indices, \
                                 e.g. explicit:3,6"
                            )
                        })?,
                ),
                None => bail!(
                    "unknown parallel.partition '{s}' \
                     (expected params, balanced, time or explicit:CUT,CUT,...)"
                ),
            },
        })
    }
}

/// A config's pipeline layout, checked without doing any work.
struct Layout {
    schedule: Schedule,
    partition: PartitionSpec,
    sends: SendMode,
}

/// Checks the pipeline settings of `cfg` (called by `Config::validate`, so impossible layouts
/// fail before any worker starts): schedule and partition names, stages ≤ blocks,
/// interleaving's `m` a multiple of `pp`, the batch split over `dp × m`, and settings that do
/// not combine with a pipeline.
pub fn validate_layout(cfg: &Config) -> Result<()> {
    let p = &cfg.parallel;
    if p.pp == 0 {
        bail!("parallel.pp must be at least 1");
    }
    if p.micro_batches == 0 {
        bail!("parallel.micro_batches must be at least 1");
    }
    if p.pp == 1 {
        if p.timeline.is_some() {
            bail!("parallel.timeline records pipeline steps: it needs parallel.pp > 1");
        }
        if p.micro_batches > 1 {
            bail!(
                "parallel.micro_batches={} needs a pipeline (parallel.pp > 1); \
                 without one use train.accumulation_steps",
                p.micro_batches
            );
        }
        return Ok(());
    }
    layout(cfg).map(|_| ())
}

fn layout(cfg: &Config) -> Result<Layout> {
    let (p, t) = (&cfg.parallel, &cfg.train);
    let kind: ScheduleKind = p
        .schedule
        .parse()
        .map_err(|e| anyhow!("parallel.schedule: {e}"))?;
    let partition: PartitionSpec = p.partition.parse()?;
    let sends = match p.sends.as_str() {
        "async" => SendMode::Async,
        "inline" => SendMode::Inline,
        other => bail!("unknown parallel.sends '{other}' (expected async or inline)"),
    };
    if t.accumulation_steps != 1 {
        bail!(
            "train.accumulation_steps={} does not combine with a pipeline: \
             parallel.micro_batches already splits each replica's batch",
            t.accumulation_steps
        );
    }
    if p.dp_mode != DpMode::Ddp {
        bail!("pipeline runs synchronise their data-parallel replicas with DDP only (parallel.dp_mode)");
    }
    if p.sync_batch_norm {
        bail!("parallel.sync_batch_norm is not supported with a pipeline (parallel.pp > 1)");
    }
    crate::config::check_batch_split(t.batch_size, p.dp, p.micro_batches, "micro-batches")?;
    let schedule = Schedule::new(kind, p.pp, p.micro_batches)
        .map_err(|e| anyhow!("pipeline layout pp={} m={}: {e}", p.pp, p.micro_batches))?;
    let blocks = build_model(&cfg.model).num_blocks();
    let stages = schedule.num_chunks();
    if stages > blocks {
        bail!(
            "parallel.pp={} × {} chunk(s) per worker = {stages} stages, but the model has only \
             {blocks} blocks to cut",
            p.pp,
            kind.chunks_per_worker()
        );
    }
    if let PartitionSpec::Explicit(cuts) = &partition {
        if cuts.len() + 1 != stages {
            bail!(
                "parallel.partition {:?} makes {} stages, the layout needs {stages} \
                 (pp × chunks per worker)",
                p.partition,
                cuts.len() + 1
            );
        }
        Partition::explicit(blocks, cuts).map_err(|e| anyhow!("parallel.partition: {e}"))?;
    }
    Ok(Layout {
        schedule,
        partition,
        sends,
    })
}

/// The data-parallel size a job under `mpirun` runs with: `dp × pp` must be the world; a `dp`
/// left at 1 takes what the pipeline leaves (`size / pp`).
pub fn mpi_data_parallel_size(dp: usize, pp: usize, size: usize) -> Result<usize> {
    if dp == 1 && pp > 0 {
        if !size.is_multiple_of(pp) {
            bail!(
                "mpirun started {size} processes, not a multiple of parallel.pp={pp}: \
                 start dp × pp processes"
            );
        }
        return Ok(size / pp);
    }
    if dp * pp != size {
        bail!(
            "parallel.dp={dp} × parallel.pp={pp} = {} but mpirun started {size} processes; \
             start dp × pp processes (or leave --dp out to use all of them)",
            dp * pp
        );
    }
    Ok(dp)
}

/// A worker's timeline, where it goes, and its origin on the system clock (Unix seconds):
/// workers in other processes have other `Instant` origins, and the system clock — shared by
/// the processes of one machine, NTP-close across machines — puts their spans on one axis.
struct RecordedTimeline {
    timeline: Timeline,
    path: PathBuf,
    origin_unix_s: f64,
}

/// One worker's pipeline state: its stage (parameters of its chunks), one optimizer and (with
/// `dp > 1`) one DDP per chunk, and the step's timeline when one is recorded.
pub struct PipelineWorker {
    mesh: DeviceMesh,
    partition: Partition,
    stage: Stage,
    optimizers: Vec<Optimizer>,
    /// `ddps[j]` all-reduces local chunk `j`'s gradients over the dp group (empty if dp = 1).
    ddps: Vec<Ddp>,
    options: StepOptions,
    micro_batches: usize,
    timeline: Option<RecordedTimeline>,
}

/// Makes `trainer` (built as a single worker) one pipeline worker of the world `world`
/// (`dp × pp` workers): cuts the model, keeps this worker's share of the initial parameters,
/// and frees the whole-model copies (rank 0 gets them back when gathering).
pub(crate) fn attach(trainer: &mut Trainer, world: Arc<dyn ProcessGroup>) -> Result<()> {
    let cfg = trainer.cfg.clone();
    let p = &cfg.parallel;
    let Layout {
        schedule,
        partition: spec,
        sends,
    } = layout(&cfg)?;
    let mesh = DeviceMesh::new(world.clone(), &[(MeshAxis::Dp, p.dp), (MeshAxis::Pp, p.pp)])
        .context("laying out the dp × pp mesh")?;
    let (blocks, stages) = (trainer.model.num_blocks(), schedule.num_chunks());
    let partition = match spec {
        PartitionSpec::Params => Partition::by_params(&trainer.model, stages)?,
        PartitionSpec::Balanced => Partition::balanced(&vec![1.0; blocks], stages)?,
        PartitionSpec::Explicit(cuts) => Partition::explicit(blocks, &cuts)?,
        PartitionSpec::Time => {
            // Profile on one micro-batch of the run's size; the world shares rank 0's times
            // so every replica cuts the same way.
            let batch = trainer.batch(0)?;
            let sample = MicroBatches::split(&batch.x, &batch.y, p.dp * p.micro_batches)?;
            let classes = trainer.num_classes();
            let sample = (&sample.inputs[0], sample.targets[0].as_slice());
            let model = &trainer.model;
            trainer.pool.install(|| {
                Partition::by_measured_time(world.as_ref(), model, sample, classes, stages)
            })?
        }
    };
    let model = &trainer.model;
    let pp_rank = mesh.coordinate(MeshAxis::Pp);
    let mut stage = Stage::from_store(model, &partition, schedule, pp_rank, &trainer.store)?;
    let optimizers = stage.optimizers(cfg.optimizer);
    let mut ddps = Vec::new();
    if p.dp > 1 {
        for chunk in &mut stage.chunks {
            let base = model.blocks_param_range(chunk.blocks.clone()).start;
            let local: Vec<_> = chunk
                .blocks
                .clone()
                .map(|b| {
                    let r = model.block_param_range(b);
                    r.start - base..r.end - base
                })
                .collect();
            let config = DdpConfig {
                bucket_cap_mb: p.bucket_cap_mb,
                first_bucket_mb: p.first_bucket_mb,
                compression: p.compression,
                overlap: p.overlap,
            };
            let ddp = Ddp::over_blocks(&local, mesh.group(MeshAxis::Dp).clone(), config)?;
            ddp.broadcast_state(&mut chunk.store)?;
            ddps.push(ddp);
        }
    }
    let timeline = match &p.timeline {
        Some(path) => {
            // Origins close together (only to keep the numbers small; alignment comes from
            // the system clock, since a barrier's release is seen late by a descheduled rank).
            world
                .barrier()
                .context("synchronising the timeline origin")?;
            let origin = Instant::now();
            let origin_unix_s = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            Some(RecordedTimeline {
                timeline: Timeline::new(world.rank(), origin),
                path: path.clone(),
                origin_unix_s,
            })
        }
        None => None,
    };
    trainer.store = ParamStore {
        values: Vec::new(),
        grads: Vec::new(),
        buffers: Vec::new(),
    };
    trainer.optimizer = Optimizer::new(cfg.optimizer, 0);
    trainer.breakdown.workers = p.dp * p.pp;
    trainer.breakdown.stages = p.pp;
    trainer.pipeline = Some(Box::new(PipelineWorker {
        mesh,
        partition,
        stage,
        optimizers,
        ddps,
        options: StepOptions {
            classes: trainer.num_classes(),
            recompute: cfg.train.recompute,
            sends,
        },
        micro_batches: p.micro_batches,
        timeline,
    }));
    Ok(())
}

/// One training step of a pipeline worker (the trainer's `train_step` hook): returns the
/// global loss and gradient norm, the same on every worker.
pub(crate) fn train_step(trainer: &mut Trainer, batch: &Batch) -> Result<(f32, f32)> {
    let lr = trainer.schedule.lr(trainer.step);
    let clip = trainer.cfg.train.grad_clip;
    let (model, pool, breakdown) = (&trainer.model, &trainer.pool, &mut trainer.breakdown);
    let worker = trainer.pipeline.as_mut().context("not a pipeline worker")?;
    let result = pool.install(|| worker.step(model, batch, lr, clip, breakdown))?;
    trainer.breakdown.steps += 1;
    trainer.step += 1;
    Ok(result)
}

/// Evaluation (the trainer's `evaluate` hook): the stages gather the model on rank 0, which
/// evaluates it like a single worker; the result is shared with every worker.
pub(crate) fn evaluate(trainer: &mut Trainer) -> Result<(f64, Option<f64>)> {
    let t = Instant::now();
    let worker = trainer.pipeline.as_ref().context("not a pipeline worker")?;
    let gathered = worker.gather_model(&trainer.model)?;
    let world = worker.mesh.world().clone();
    trainer.breakdown.eval_s += t.elapsed().as_secs_f64();
    let mut shared = [f32::NAN; 2];
    let mut exact = None;
    if let Some(full) = gathered {
        trainer.store = full;
        let (loss, accuracy) = trainer.evaluate_replica(0, 1)?;
        shared = [loss as f32, accuracy.map_or(f32::NAN, |a| a as f32)];
        exact = Some((loss, accuracy));
    }
    world
        .broadcast(BufMut::F32(&mut shared), 0)
        .context("sharing the evaluation result")?;
    let accuracy = (!shared[1].is_nan()).then_some(shared[1] as f64);
    Ok(exact.unwrap_or((shared[0] as f64, accuracy)))
}

impl PipelineWorker {
    /// (coordinate, size) along the data-parallel axis: what the batches are dealt over.
    pub fn data_parallel_rank_and_size(&self) -> (usize, usize) {
        (
            self.mesh.coordinate(MeshAxis::Dp),
            self.mesh.size(MeshAxis::Dp),
        )
    }

    /// World rank 0 (stage 0 of replica 0) prints, logs and writes files.
    pub fn is_lead(&self) -> bool {
        self.mesh.world().rank() == 0
    }

    /// One line on the layout, for the start of a run.
    pub fn describe(&self, model: &Model) -> String {
        let schedule = self.stage.schedule();
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
        format!(
            "pipeline: dp {} × pp {} workers, schedule {}, {} micro-batches per replica \
             (predicted bubble {:.0}%); {}",
            self.mesh.size(MeshAxis::Dp),
            self.mesh.size(MeshAxis::Pp),
            schedule.kind,
            self.micro_batches,
            100.0
                * schedule
                    .kind
                    .predicted_idle_fraction(schedule.workers, self.micro_batches),
            stages.join("; ")
        )
    }

    fn step(
        &mut self,
        model: &Model,
        batch: &Batch,
        lr: f32,
        clip: Option<f32>,
        bd: &mut Breakdown,
    ) -> Result<(f32, f32)> {
        let micro = MicroBatches::split(&batch.x, &batch.y, self.micro_batches)?;
        let PipelineWorker {
            mesh,
            stage,
            optimizers,
            ddps,
            options,
            timeline,
            ..
        } = self;
        let pp = mesh.group(MeshAxis::Pp).clone();
        let p = pp.size();
        let mut timeline = timeline.as_mut().map(|r| &mut r.timeline);
        if let Some(t) = timeline.as_deref_mut() {
            t.clear(); // the trace shows the last step
        }
        ddps.iter_mut().for_each(|d| d.prepare(true));
        // GradsReady names global chunks and blocks; each DDP counts its chunk's blocks.
        let first_block: Vec<usize> = stage.chunks.iter().map(|c| c.blocks.start).collect();
        let report = stage.run_step(
            model,
            pp.as_ref(),
            &micro,
            options,
            timeline.as_deref_mut(),
            &mut |ready| {
                let j = ready.chunk / p;
                if let Some(ddp) = ddps.get_mut(j) {
                    ddp.block_ready(ready.block - first_block[j], ready.store);
                }
            },
        )?;
        let mut comm = CommTiming::default();
        let wait = Instant::now();
        for (ddp, chunk) in ddps.iter_mut().zip(&mut stage.chunks) {
            comm.add(ddp.finish(&mut chunk.store)?);
        }
        if let (Some(t), false) = (timeline.as_deref_mut(), ddps.is_empty()) {
            t.record(
                "dp all-reduce wait",
                Category::Communication,
                wait,
                Instant::now(),
                None,
            );
        }
        bd.forward_s += report.forward_s;
        bd.backward_s += report.backward_s - comm.in_backward_s;
        bd.pipeline_idle_s += (report.wall_s - report.compute_s()).max(0.0);
        bd.comm_exposed_s += comm.exposed_s;
        bd.comm_hidden_s += comm.hidden_s;
        bd.comm_bytes += comm.bytes as u64;

        let t = Instant::now();
        let norm = match clip {
            Some(c) => stage.clip_grad_norm(pp.as_ref(), c)?,
            None => stage.grad_norm(pp.as_ref())?,
        };
        stage.optimizer_step(optimizers, lr, timeline);
        bd.optimizer_s += t.elapsed().as_secs_f64();

        // Each replica's last stage has its replica's mean loss; the mean over replicas is the
        // global batch's, and every worker gets it (for logging and the divergence check).
        let t = Instant::now();
        let replicas = mesh.size(MeshAxis::Dp) as f32;
        let mut loss = [report.loss.map_or(0.0, |l| l / replicas)];
        mesh.world()
            .all_reduce(BufMut::F32(&mut loss), ReduceOp::Sum)
            .context("sharing the step's loss")?;
        bd.comm_exposed_s += t.elapsed().as_secs_f64();
        Ok((loss[0], norm))
    }

    /// The whole model's parameters and buffers on world rank 0 (`None` elsewhere). Replicas
    /// are identical, so only replica 0's stages take part.
    fn gather_model(&self, model: &Model) -> Result<Option<ParamStore>> {
        if self.mesh.coordinate(MeshAxis::Dp) != 0 {
            return Ok(None);
        }
        let pp = self.mesh.group(MeshAxis::Pp);
        Ok(self.stage.gather(model, pp.as_ref())?)
    }

    /// Gathers parameters, buffers and optimizer state into `store` and `optimizer` on world
    /// rank 0 (the standard checkpoint's contents); other workers only send.
    pub(crate) fn gather_state(
        &self,
        model: &Model,
        store: &mut ParamStore,
        optimizer: &mut Optimizer,
    ) -> Result<()> {
        let gathered = self.gather_model(model)?;
        if self.mesh.coordinate(MeshAxis::Dp) != 0 {
            return Ok(());
        }
        let pp = self.mesh.group(MeshAxis::Pp);
        let chunks = self.partition.len();
        // Stage::gather used the tags below 2·chunks; these follow them.
        let tag = |chunk: usize, moment: usize| (2 * chunks + 2 * chunk + moment) as u32;
        let send_failed = |e| anyhow!("sending optimizer state to rank 0: {e}");
        if pp.rank() != 0 {
            for (chunk, opt) in self.stage.chunks.iter().zip(&self.optimizers) {
                pp.send((&opt.m).into(), 0, tag(chunk.index, 0))
                    .map_err(send_failed)?;
                if !opt.v.is_empty() {
                    pp.send((&opt.v).into(), 0, tag(chunk.index, 1))
                        .map_err(send_failed)?;
                }
            }
            return Ok(());
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
            let received = |e| anyhow!("receiving optimizer state of chunk {c}: {e}");
            pp.recv((&mut full.m[range.clone()]).into(), owner, tag(c, 0))
                .map_err(received)?;
            if !full.v.is_empty() {
                pp.recv((&mut full.v[range]).into(), owner, tag(c, 1))
                    .map_err(received)?;
            }
        }
        *store = gathered.context("pipeline rank 0 gathers the model")?;
        *optimizer = full;
        Ok(())
    }

    /// Continues from a standard checkpoint (every worker reads the file and keeps its
    /// share); returns the step to continue from.
    pub(crate) fn resume(
        &mut self,
        path: &Path,
        model: &Model,
        optimizer: OptimizerConfig,
    ) -> Result<u64> {
        let n = model.num_params();
        let mut full = ParamStore {
            values: vec![0.0; n],
            grads: vec![0.0; n],
            buffers: vec![0.0; model.num_buffers()],
        };
        let mut opt = Optimizer::new(optimizer, n);
        let step = checkpoint::load(path, model, &mut full, &mut opt)?;
        let schedule = self.stage.schedule().clone();
        let rank = self.stage.rank();
        self.stage = Stage::from_store(model, &self.partition, schedule, rank, &full)?;
        for (chunk, local) in self.stage.chunks.iter().zip(&mut self.optimizers) {
            let range = model.blocks_param_range(chunk.blocks.clone());
            local.m.copy_from_slice(&opt.m[range.clone()]);
            if !local.v.is_empty() {
                local.v.copy_from_slice(&opt.v[range]);
            }
            local.step = opt.step;
        }
        Ok(step)
    }

    /// End of a run (every worker): averages the step-time breakdown over all workers (the
    /// stages differ; the mean is what the step costs), and writes the timeline of the last
    /// step on rank 0.
    pub(crate) fn finish_run(&mut self, bd: &mut Breakdown) -> Result<()> {
        let world = self.mesh.world().clone();
        let mut fields = bd.times_mut().map(|v| *v as f32);
        world
            .all_reduce(BufMut::F32(&mut fields), ReduceOp::Average)
            .context("averaging the step-time breakdown")?;
        for (time, mean) in bd.times_mut().into_iter().zip(fields) {
            *time = f64::from(mean);
        }
        if let Some(recorded) = &self.timeline {
            let path = &recorded.path;
            let events = collect_trace_events(world.as_ref(), recorded)?;
            if let Some(events) = events {
                let trace = json!({ "traceEvents": events, "displayTimeUnit": "ms" });
                let schedule = self.stage.schedule();
                let title = format!(
                    "{} pipeline, dp {} × pp {}, {} micro-batches: one training step",
                    schedule.kind,
                    self.mesh.size(MeshAxis::Dp),
                    schedule.workers,
                    self.micro_batches
                );
                write_trace_and_chart(path, &trace, &title, schedule.workers)?;
            }
        }
        Ok(())
    }
}

/// Every worker's Chrome-trace events on world rank 0 (`None` elsewhere), shifted onto rank
/// 0's time axis. The events travel as JSON text, one byte per f32 (exact), so this works on
/// any backend.
fn collect_trace_events(
    world: &dyn ProcessGroup,
    recorded: &RecordedTimeline,
) -> Result<Option<Vec<Value>>> {
    const TAG: u32 = 1;
    let events = |trace: Value| match trace {
        Value::Object(mut o) => match o.remove("traceEvents") {
            Some(Value::Array(a)) => a,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    };
    let mine = events(chrome_trace(recorded.timeline.spans()));
    if world.rank() != 0 {
        let message = json!({ "origin_unix_s": recorded.origin_unix_s, "events": mine });
        let bytes: Vec<f32> = serde_json::to_vec(&message)?
            .into_iter()
            .map(f32::from)
            .collect();
        anyhow::ensure!(
            bytes.len() < 1 << 24,
            "timeline of rank {} too large to send",
            world.rank()
        );
        world.send((&[bytes.len() as f32][..]).into(), 0, TAG)?;
        world.send((&bytes).into(), 0, TAG)?;
        return Ok(None);
    }
    let mut all = mine;
    for src in 1..world.size() {
        let mut len = [0.0f32];
        world.recv(BufMut::F32(&mut len), src, TAG)?;
        let mut bytes = vec![0.0f32; len[0] as usize];
        world.recv(BufMut::F32(&mut bytes), src, TAG)?;
        let text: Vec<u8> = bytes.into_iter().map(|b| b as u8).collect();
        let mut theirs: Value = serde_json::from_slice(&text)
            .with_context(|| format!("timeline from rank {src} is not valid JSON"))?;
        let shift_us =
            (theirs["origin_unix_s"].as_f64().unwrap_or(0.0) - recorded.origin_unix_s) * 1e6;
        if let Value::Array(events) = theirs["events"].take() {
            for mut e in events {
                if let Some(ts) = e["ts"].as_f64() {
                    e["ts"] = json!(ts + shift_us);
                }
                all.push(e);
            }
        }
    }
    Ok(Some(all))
}

/// Writes the Chrome trace to `path` and a Gantt chart of it next to it (`.png`).
pub fn write_trace_and_chart(path: &Path, trace: &Value, title: &str, pp: usize) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, trace.to_string())
        .with_context(|| format!("writing the timeline {}", path.display()))?;
    let png = path.with_extension("png");
    meshtrain_chart::timeline(&png, &trace_chart(trace, title, pp)?)
        .with_context(|| format!("drawing {}", png.display()))?;
    Ok(())
}

/// A Gantt chart of a Chrome trace written by [`chrome_trace`]: one row per (worker, lane),
/// spans coloured by category (receive waits — the bubble — in grey), time from the first
/// span. Worker `w` is stage `w % pp` of replica `w / pp`.
pub fn trace_chart(trace: &Value, title: &str, pp: usize) -> Result<Chart> {
    let events = trace["traceEvents"]
        .as_array()
        .context("not a Chrome trace: no traceEvents")?;
    let spans: Vec<(u64, u64, ChartSpan)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            let us = |k: &str| e[k].as_f64().unwrap_or(0.0);
            let span = ChartSpan {
                start_s: us("ts") * 1e-6,
                end_s: (us("ts") + us("dur")) * 1e-6,
                category: e["cat"].as_str().unwrap_or("other").to_string(),
                label: e["name"].as_str().map(str::to_string),
            };
            let id = |k: &str| e[k].as_u64().unwrap_or(0);
            (id("pid"), id("tid"), span)
        })
        .collect();
    let t0 = spans
        .iter()
        .map(|s| s.2.start_s)
        .fold(f64::INFINITY, f64::min);
    let mut lanes: Vec<(u64, u64)> = spans.iter().map(|s| (s.0, s.1)).collect();
    lanes.sort_unstable();
    lanes.dedup();
    let pp = pp.max(1) as u64;
    let rows = lanes
        .into_iter()
        .map(|(pid, tid)| TimelineRow {
            label: match tid {
                0 => format!("rank {pid} (dp {}, stage {})", pid / pp, pid % pp),
                _ => format!("rank {pid} dp comm"),
            },
            spans: spans
                .iter()
                .filter(|s| (s.0, s.1) == (pid, tid))
                .map(|s| ChartSpan {
                    start_s: s.2.start_s - t0,
                    end_s: s.2.end_s - t0,
                    ..s.2.clone()
                })
                .collect(),
        })
        .collect();
    Ok(Chart {
        title: title.to_string(),
        rows,
        category_colors: vec![(Category::RecvWait.as_str().to_string(), Color::IDLE_GREY)],
        ..Chart::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_specs_parse() {
        assert_eq!(
            "params".parse::<PartitionSpec>().unwrap(),
            PartitionSpec::Params
        );
        assert_eq!(
            "time".parse::<PartitionSpec>().unwrap(),
            PartitionSpec::Time
        );
        assert_eq!(
            "explicit:3, 6".parse::<PartitionSpec>().unwrap(),
            PartitionSpec::Explicit(vec![3, 6])
        );
        let err = "explicit:3,x".parse::<PartitionSpec>().unwrap_err();
        assert!(err.to_string().contains("block indices"), "{err}");
        let err = "even".parse::<PartitionSpec>().unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown parallel.partition 'even'"),
            "{err}"
        );
    }

    #[test]
    fn mpi_world_must_be_dp_times_pp() {
        assert_eq!(mpi_data_parallel_size(1, 2, 4).unwrap(), 2);
        assert_eq!(mpi_data_parallel_size(2, 2, 4).unwrap(), 2);
        assert_eq!(mpi_data_parallel_size(1, 1, 3).unwrap(), 3);
        let err = mpi_data_parallel_size(2, 2, 6).unwrap_err().to_string();
        assert!(
            err.contains("parallel.dp=2 × parallel.pp=2 = 4 but mpirun started 6 processes"),
            "{err}"
        );
        let err = mpi_data_parallel_size(1, 4, 6).unwrap_err().to_string();
        assert!(
            err.contains("mpirun started 6 processes, not a multiple of parallel.pp=4"),
            "{err}"
        );
    }
}
