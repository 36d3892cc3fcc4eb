//! The training loop of one worker — the same loop for every layout: load this replica's
//! share of the step's batch, run the parallelised step, log, evaluate, checkpoint.
//!
//! Every step's data is a pure function of (seed, step) — shuffled epochs or random draws
//! seeded by the step — so a resumed run sees exactly the batches an uninterrupted run would,
//! and ends bit-identical. The distributed sampler deals shards so that the replicas' shares
//! of step `s` together are exactly the single worker's batch `s`. World rank 0 alone prints,
//! writes metrics and checkpoints; a checkpoint gathers the stages first, so it is the same
//! file whatever the layout.

use crate::checkpoint::{self, Restore, Snapshot, StateSource, TrainState};
use crate::dataset::{random_indices, EvalPlan, SamplerPosition, Sampling};
use crate::job::CheckpointFormat;
use crate::job::{load, Job};
use crate::memory::MemoryReport;
use crate::metrics::{
    peak_rss_mb, Breakdown, EvalRecord, MetricsFile, Stopped, Summary, TrainRecord,
};
use crate::stop::{self, StopRequest};
use crate::timeline::RecordedTimeline;
use crate::writer::{CheckpointWriter, Waited};
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meshtrain_comm::{BufMut, GroupHosts, ProcessGroup, ReduceOp};
use meshtrain_data::{eval_shard, DistributedSampler, SplitMix64, Tail};
use meshtrain_nn::schedule::{scale_lr_linearly, Schedule};
use meshtrain_nn::{InputSpec, Model, ParamStore};
use meshtrain_parallel::data::ShareShape;
use meshtrain_parallel::engine::StateKind;
use meshtrain_parallel::parallelize::Training;
use meshtrain_parallel::pipeline::PartitionSpec;
use meshtrain_parallel::zero::ZeroStage;
use meshtrain_parallel::{parallelize, Batch, EvalSums, Parallel, StepStats};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Intra-op threads for each of `workers` workers sharing this machine: the configured total
/// (default: all cores) split evenly, never oversubscribing by default.
pub fn threads_per_worker(configured: Option<usize>, workers: usize) -> usize {
    let total =
        configured.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    (total / workers.max(1)).max(1)
}

/// The (world, rank, epoch) the distributed sampler last dealt for, and its indices (one
/// permutation per epoch, not per step).
type EpochOrder = Option<((usize, usize, u64), Vec<usize>)>;

/// One worker of a run: its model share, its step, its books.
pub struct Trainer {
    pub job: Arc<Job>,
    /// This worker's model (split under tensor parallelism).
    pub model: Model,
    /// The model unsplit: the layout of checkpoints.
    pub whole: Model,
    /// The parallelised model: stage chunks, synchronisation, optimizers.
    pub parallel: Parallel,
    pub schedule: Schedule,
    /// Steps completed.
    pub step: u64,
    pub total_steps: u64,
    steps_per_epoch: u64,
    input: InputSpec,
    epoch_indices: EpochOrder,
    pool: rayon::ThreadPool,
    pub breakdown: Breakdown,
    metrics: Option<MetricsFile>,
    pub show_progress: bool,
    timeline: Option<RecordedTimeline>,
    /// fp16: steps skipped so far because some worker's gradients overflowed.
    pub skipped_steps: Option<u64>,
    /// `train.cuda_graph`: steps that ran as replays of the captured graphs.
    pub graph_replays: Option<u64>,
    /// The most activation bytes one of this worker's steps kept.
    peak_activation_bytes: usize,
    /// Background checkpoint writes, one in flight at a time.
    writer: CheckpointWriter,
    /// Read between steps: once set (a signal, or the caller), every worker stops after the
    /// same step and saves a checkpoint ([`crate::stop`]).
    pub stop: StopRequest,
    /// The command that started the run, for the resume command a stop prints.
    pub command_line: Option<Vec<String>>,
    /// Called on rank 0 with the whole model after each evaluation (a text sample); every
    /// worker must have it set or none (it makes the evaluation a gather).
    pub after_eval: Option<crate::launch::EvalHook>,
}

/// Seconds after which a first step still running is said to be running.
const FIRST_STEP_NOTICE_S: u64 = 10;

/// Below this loss scale even the largest gradient of an fp16 backward is below f16's
/// smallest subnormal (2⁻²⁴): the scaler has nothing left to try.
const MIN_LOSS_SCALE: f32 = 1.0 / 16_777_216.0;

impl Job {
    /// This worker's trainer in `world` (every worker of the world calls it; the world has
    /// `layout.world_size()` workers). `threads` overrides its intra-op thread count.
    pub fn trainer(
        self: &Arc<Self>,
        world: Arc<dyn ProcessGroup>,
        threads: Option<usize>,
    ) -> Result<Trainer> {
        Trainer::new(self.clone(), world, threads)
    }
}

impl Trainer {
    fn new(job: Arc<Job>, world: Arc<dyn ProcessGroup>, threads: Option<usize>) -> Result<Trainer> {
        let mut model = (job.model)();
        let resolved = job
            .layout
            .resolve(world.size(), job.batch_size, &model)
            .context("the layout cannot run")?;
        let workers = world.size();
        let threads = threads.unwrap_or_else(|| threads_per_worker(job.threads, workers));
        let pool = meshtrain_tensor::par::pool(threads);
        let input = job.train_data.input();
        let steps_per_epoch = job.steps_per_epoch();
        // Measured-time cuts profile one micro-batch (replica 0's first).
        let sample = match (&job.parallel.partition, resolved.layout.pp > 1) {
            (PartitionSpec::Time, true) => {
                let local = job.batch_size / resolved.layout.dp;
                let idx =
                    share_indices(&job, &mut None, steps_per_epoch, 0, 0, resolved.layout.dp)?;
                let per_micro = local / resolved.micro_batches();
                Some(load(
                    job.train_data.as_ref(),
                    &input,
                    job.loss.as_ref(),
                    &idx[..per_micro],
                )?)
            }
            _ => None,
        };
        let training = Training {
            loss: job.loss.clone(),
            optimizer: job.optimizer,
            groups: job.param_groups.clone(),
            seed: job.seed,
        };
        let parallel = pool
            .install(|| {
                parallelize(
                    &mut model,
                    world.clone(),
                    &resolved,
                    &job.parallel,
                    &training,
                    sample.as_ref(),
                )
            })
            .context("setting up the parallel layout")?;
        let l = &job.lr;
        let schedule = Schedule {
            base_lr: match l.reference_batch {
                Some(r) => scale_lr_linearly(l.lr, r, job.batch_size),
                None => l.lr,
            },
            warmup_steps: l.warmup_steps,
            total_steps: job.total_steps(),
            min_lr_fraction: l.min_lr_fraction,
        };
        let timeline = match &job.timeline {
            Some(path) => Some(RecordedTimeline::start(world.as_ref(), path)?),
            None => None,
        };
        Ok(Trainer {
            whole: (job.model)(),
            breakdown: Breakdown {
                workers,
                hosts: GroupHosts::of(world.as_ref()).num_hosts(),
                grad_reduce: parallel.all_reduce_kind(),
                stages: resolved.layout.pp,
                tensor: resolved.layout.tp,
                context: resolved.layout.cp,
                ..Breakdown::default()
            },
            total_steps: job.total_steps(),
            steps_per_epoch,
            input,
            model,
            parallel,
            schedule,
            step: 0,
            epoch_indices: None,
            pool,
            metrics: None,
            show_progress: false,
            timeline,
            skipped_steps: None,
            graph_replays: None,
            peak_activation_bytes: 0,
            writer: CheckpointWriter::default(),
            stop: StopRequest::new(),
            command_line: None,
            after_eval: None,
            job,
        })
    }

    /// This worker's model-state memory, measured, beside the planner's formula (the
    /// transient peak since the last call).
    pub fn memory_report(&mut self) -> MemoryReport {
        let measured = self.parallel.model_state_memory();
        let predicted = crate::memory::predicted(&self.parallel, &self.model, self.job.optimizer);
        MemoryReport::new(measured, predicted, self.peak_activation_bytes)
    }

    /// World rank 0 prints, logs and checkpoints for everyone.
    pub fn is_lead(&self) -> bool {
        self.parallel.is_lead()
    }

    /// This worker's parameters (its stage's chunks, in model order): the whole model
    /// without a pipeline.
    pub fn local_params(&mut self) -> Vec<f32> {
        // A GPU run's values are on the device: copied to the host for as long as this runs.
        let copied = self.parallel.with_host_state(&StateKind::MODEL, |p| {
            (p.stage.chunks.iter())
                .flat_map(|c| c.store.values.iter().copied())
                .collect()
        });
        copied.unwrap_or_else(|e| panic!("copying the parameters from the GPU: {e}"))
    }

    /// This worker's buffers (batch norm's running statistics), in model order.
    pub fn local_buffers(&mut self) -> Vec<f32> {
        let copied = self.parallel.with_host_state(&StateKind::MODEL, |p| {
            (p.stage.chunks.iter())
                .flat_map(|c| c.store.buffers.iter().copied())
                .collect()
        });
        copied.unwrap_or_else(|e| panic!("copying the buffers from the GPU: {e}"))
    }

    /// Where this run's checkpoint goes: `checkpoint.safetensors`, or the directory
    /// `checkpoint/` for sharded checkpoints.
    pub fn checkpoint_path(&self) -> PathBuf {
        if self.sharded_checkpoints() {
            self.job.out_dir.join("checkpoint")
        } else {
            self.job.out_dir.join("checkpoint.safetensors")
        }
    }

    /// Whether this run writes sharded checkpoints.
    pub fn sharded_checkpoints(&self) -> bool {
        match self.job.checkpoint_format {
            CheckpointFormat::Whole => false,
            CheckpointFormat::Sharded => true,
            CheckpointFormat::Auto => self.parallel.zero_stage().is_some(),
        }
    }

    /// Passes over the training set after `step` steps: whole shuffled passes, or, for data
    /// drawn at random (text windows), the targets seen over the targets the set holds.
    fn epoch_of(&self, step: u64) -> f64 {
        if self.steps_per_epoch > 0 {
            return step as f64 / self.steps_per_epoch as f64;
        }
        let data = &self.job.train_data;
        let seen = step as f64 * self.job.batch_size as f64 * data.targets_per_sample() as f64;
        seen / data.len().max(1) as f64
    }

    /// A throughput for the log: samples/s with three significant digits (a batch of one
    /// long sequence is well under 1 sample/s), and tokens/s for token sequences.
    fn describe_rate(&self, samples_per_s: f64) -> String {
        let tokens = self.job.train_data.targets_per_sample();
        let mut text = format!("{} samples/s", significant(samples_per_s));
        if tokens > 1 {
            text += &format!(" ({} tokens/s)", significant(samples_per_s * tokens as f64));
        }
        text
    }

    /// One training step (step number `self.step`): this worker's share of the batch, the
    /// parallelised forward/backward/synchronisation/update. Returns the global loss and
    /// gradient norm among the step's measurements.
    pub fn train_step(&mut self) -> Result<StepStats> {
        let step = self.step;
        let t = Instant::now();
        let loaded = match self.parallel.loads() {
            Some((rank, world)) => Some(self.load_share(step, rank, world)?),
            None => None,
        };
        self.breakdown.data_s += t.elapsed().as_secs_f64();
        let shape = ShareShape {
            samples: self.job.batch_size / self.parallel.layout.layout.dp,
            sample: self.input.shape.clone(),
            targets_per_sample: self.job.train_data.targets_per_sample(),
        };
        let (share, scatter) = self.parallel.share(loaded, &shape)?;
        self.breakdown.times.comm_exposed_s += scatter.exposed_s;
        let lr = self.schedule.lr(step);
        let clip = self.job.grad_clip;
        let Trainer {
            pool,
            parallel,
            model,
            timeline,
            ..
        } = self;
        let timeline = timeline.as_mut().map(|t| &mut t.timeline);
        let stats = pool
            .install(|| parallel.train_step(model, share, lr, clip, timeline))
            .with_context(|| format!("training step {step}"))?;
        self.breakdown.add(&stats);
        self.peak_activation_bytes = self.peak_activation_bytes.max(stats.peak_activation_bytes);
        if stats.loss_scale.is_some() {
            *self.skipped_steps.get_or_insert(0) += u64::from(stats.skipped);
        }
        if let Some(replayed) = stats.graph_replayed {
            *self.graph_replays.get_or_insert(0) += u64::from(replayed);
        }
        if let Some(note) = &stats.graph_note {
            eprintln!("{note}");
        }
        self.step += 1;
        // fp16: a step skipped for an overflow is the loss scaler's business, unless the
        // scale has shrunk so far that no scale could help (GradScaler would go on forever).
        if let Some(scale) = stats.loss_scale.filter(|&s| s < MIN_LOSS_SCALE) {
            anyhow::bail!(
                "training diverged at step {step}: fp16 gradients overflow at every loss scale \
                 (now {scale:e}); train in bf16 or fp32"
            );
        }
        anyhow::ensure!(
            stats.loss.is_finite() || stats.skipped,
            "training diverged at step {step}: loss is {}",
            stats.loss
        );
        Ok(stats)
    }

    /// Rank `rank`'s share (of `world`) of step `step`'s global batch.
    fn load_share(&mut self, step: u64, rank: usize, world: usize) -> Result<Batch> {
        let idx = share_indices(
            &self.job,
            &mut self.epoch_indices,
            self.steps_per_epoch,
            step,
            rank,
            world,
        )?;
        load(
            self.job.train_data.as_ref(),
            &self.input,
            self.job.loss.as_ref(),
            &idx,
        )
    }

    /// Evaluates on the job's evaluation set (`None` without one): every replica takes its
    /// share, every pipeline stage of a replica the same batches, and the sums are exact.
    pub fn evaluate(&mut self) -> Result<Option<EvalSums>> {
        let Some(eval) = self.job.eval.clone() else {
            return Ok(None);
        };
        let t = Instant::now();
        let (rank, world) = self.parallel.dp_rank_and_size();
        let data = eval.data.as_ref();
        let input = data.input();
        let batches_of = |rank: usize| -> Result<Vec<Vec<usize>>> {
            Ok(match eval.plan {
                EvalPlan::All { batch } => {
                    let shard = eval_shard(data.len(), rank, world)?;
                    shard
                        .clone()
                        .step_by(batch)
                        .map(|s| (s..(s + batch).min(shard.end)).collect())
                        .collect()
                }
                EvalPlan::Random {
                    batches,
                    batch_size,
                    seed,
                } => (rank..batches)
                    .step_by(world)
                    .map(|i| random_indices(data.len(), batch_size, seed + i as u64))
                    .collect(),
            })
        };
        let batches = batches_of(rank)?;
        // ZeRO-3 gathers parameters over the replicas in every forward: all replicas run
        // as many passes as the busiest one, the extra ones on a batch whose loss is
        // thrown away.
        let rounds = if self.parallel.zero_stage() == Some(ZeroStage::Parameters) {
            let mut most = batches.len();
            for r in 0..world {
                most = most.max(batches_of(r)?.len());
            }
            most
        } else {
            batches.len()
        };
        let mut sums = EvalSums::default();
        let mut discarded = EvalSums::default();
        for round in 0..rounds {
            let (idx, into) = match batches.get(round) {
                Some(idx) => (idx.clone(), &mut sums),
                None => (vec![0], &mut discarded),
            };
            let batch = load(data, &input, self.job.loss.as_ref(), &idx)?;
            let (pool, parallel, model) = (&self.pool, &mut self.parallel, &self.model);
            pool.install(|| parallel.eval_batch(model, batch, into))
                .context("evaluating")?;
        }
        let sums = self.parallel.reduce_eval(sums)?;
        self.breakdown.eval_s += t.elapsed().as_secs_f64();
        Ok(Some(sums))
    }

    /// Writes the checkpoint and returns once it is on disk (a collective: the stages
    /// gather on rank 0, which writes the standard file — the same as a single worker's; or
    /// every worker writes its pieces of a sharded checkpoint).
    pub fn save_checkpoint(&mut self, path: &Path) -> Result<()> {
        self.checkpoint(path, false)
    }

    fn account_wait(&mut self, waited: Waited) {
        self.breakdown.checkpoint_wait_s += waited.wait.as_secs_f64();
        self.breakdown.checkpoint_background_s += waited.write.as_secs_f64();
    }

    /// Where the data sampler stands after `step` steps of this job.
    pub fn sampler_position(&self, step: u64) -> SamplerPosition {
        let job = &self.job;
        SamplerPosition::after(
            step,
            job.sampling,
            job.seed,
            job.train_data.len(),
            job.batch_size,
            self.steps_per_epoch,
        )
    }

    /// Saves the checkpoint (a collective), after waiting for the previous background write:
    /// `background` snapshots it into memory and writes it on the writer thread. A state on a
    /// device is written in the foreground, read from the device a bounded piece at a time
    /// as the file is written (a background write would need the full host copy this
    /// avoids).
    fn checkpoint(&mut self, path: &Path, background: bool) -> Result<()> {
        let t = Instant::now();
        // Checkpoints land in order: the previous background write first.
        let waited = self.writer.wait()?;
        self.account_wait(waited);
        let background = background && !self.parallel.is_placed();
        let snapshot_started = Instant::now();
        let loss_scaler = self.parallel.loss_scaler();
        let sampler = Some(self.sampler_position(self.step));
        if self.sharded_checkpoints() {
            let meta = crate::sharded::SaveMeta {
                step: self.step,
                model_description: &self.job.model_description,
                config: &self.job.config_text,
                loss_scaler,
                sampler,
                wait_for_workers: self.job.timeout,
            };
            let failed = || format!("saving the sharded checkpoint {}", path.display());
            if background {
                let snapshot =
                    crate::sharded::snapshot(path, &self.parallel, &self.model, &self.whole, &meta)
                        .and_then(|snapshot| snapshot.into_owned(&self.parallel))
                        .with_context(failed)?;
                self.breakdown.checkpoint_snapshot_s += snapshot_started.elapsed().as_secs_f64();
                self.writer
                    .start(path.to_path_buf(), move || snapshot.write(None))?;
            } else {
                crate::sharded::save(path, &self.parallel, &self.model, &self.whole, &meta)
                    .with_context(failed)?;
            }
        } else {
            let whole_chunk = self.holds_whole_model();
            // ZeRO's pieces gathered window by window as rank 0 writes (in the foreground: a
            // collective), or the whole state gathered first (pipelines, tensor parallelism,
            // and the CPU's background writes, which copy it anyway).
            let by_range = !whole_chunk && !background && self.parallel.gathers_by_range();
            let gathered = if whole_chunk || by_range {
                None
            } else {
                self.parallel
                    .gather_state(&self.model, &self.whole)
                    .context("gathering the model for a checkpoint")?
            };
            // One whole chunk is the whole model: rank 0 writes it from where it lives, no
            // gathered copy.
            let source = match &gathered {
                Some((store, optimizer)) => StateSource::Host { store, optimizer },
                None if by_range => StateSource::Gathered(&self.parallel),
                None => StateSource::Worker(&self.parallel),
            };
            let state = TrainState {
                model: &self.whole,
                source,
                step: self.step,
                model_description: &self.job.model_description,
                config: &self.job.config_text,
                loss_scaler,
                sampler,
            };
            if self.is_lead() && (whole_chunk || by_range || gathered.is_some()) {
                let snapshot = Snapshot::of(&state)?;
                if background {
                    let snapshot = snapshot.into_owned(Some(&self.parallel))?;
                    self.breakdown.checkpoint_snapshot_s +=
                        snapshot_started.elapsed().as_secs_f64();
                    let path = path.to_path_buf();
                    self.writer
                        .start(path.clone(), move || snapshot.write(&path, None))?;
                } else {
                    snapshot.write(path, Some(&self.parallel))?;
                }
            } else if by_range {
                Snapshot::of(&state)?
                    .serve(&self.parallel)
                    .context("sending this rank's pieces for the checkpoint")?;
            }
        }
        self.breakdown.checkpoints += 1;
        self.breakdown.checkpoint_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Continues from a checkpoint written by any layout (every worker reads the file and
    /// keeps its share). The checkpoint must be of the same model and data stream (seed,
    /// dataset, global batch); see [`Trainer::resume_reshaped`] for another global batch.
    pub fn resume(&mut self, path: &Path) -> Result<()> {
        self.resume_reshaped(path, false).map(|_| ())
    }

    /// [`Trainer::resume`], and with `reshape` a global batch other than the checkpoint's
    /// (a batch ramp, or fewer workers that cannot take the old one): the optimizer state
    /// is kept and the data stream goes on at the same sample position. Returns what
    /// changed, to say so.
    ///
    /// Shuffled epochs: the step is renumbered to the new batch's count at the same place in
    /// the same epoch (step 300 of batch 8 into an epoch is step 150 of batch 16), so the
    /// epoch's remaining samples come next and the schedule and every later resume see a run
    /// that had this batch throughout; the place must be a whole number of new batches.
    /// Random draws: the step stays (each step's draw is fresh whatever its size).
    pub fn resume_reshaped(&mut self, path: &Path, reshape: bool) -> Result<Option<String>> {
        let (step, sampler, loss_scaler) = if crate::sharded::is_sharded(path) {
            let ckpt = crate::sharded::ShardedCheckpoint::open(path)?;
            let index = &ckpt.index;
            checkpoint::check_same_model(path, &index.model, &self.job.model_description)?;
            let position = (index.step, index.sampler.clone(), index.loss_scaler);
            ckpt.load_into(&mut self.parallel, &self.model, &self.whole, true)?;
            position
        } else {
            // Each worker reads its tensors from the file, one at a time.
            let restored = checkpoint::CheckpointFile::open(path)?.load_into(
                &mut self.parallel,
                &self.model,
                &self.whole,
                &self.job.model_description,
                Restore::Everything,
            )?;
            (restored.step, restored.sampler, restored.loss_scaler)
        };
        let (step, changed) = match (reshape, &sampler) {
            (true, Some(saved)) => {
                let (step, changed) = self.reshaped_step(path, step, saved)?;
                (step, Some(changed))
            }
            (true, None) => anyhow::bail!(
                "--reshape: checkpoint {} records no data sampler position (written before \
                 it was recorded), so the stream cannot be continued with another batch",
                path.display()
            ),
            (false, _) => {
                self.check_sampler(path, step, sampler.as_ref())?;
                (step, None)
            }
        };
        if let Some(scaler) = loss_scaler {
            self.parallel.restore_loss_scaler(scaler);
        }
        self.step = step;
        Ok(changed)
    }

    /// The step this job continues at from a checkpoint at `step` whose sampler stood at
    /// `saved`, under `--reshape` (see [`Trainer::resume_reshaped`]), and a line on what
    /// changed.
    fn reshaped_step(
        &self,
        path: &Path,
        step: u64,
        saved: &SamplerPosition,
    ) -> Result<(u64, String)> {
        let now = self.sampler_position(step);
        let same_stream = [
            ("sampling", &saved.sampling, &now.sampling),
            ("seed", &saved.seed.to_string(), &now.seed.to_string()),
            (
                "dataset samples",
                &saved.dataset_len.to_string(),
                &now.dataset_len.to_string(),
            ),
        ];
        for (what, was, is) in same_stream {
            anyhow::ensure!(
                was == is,
                "--reshape continues the same data stream with another batch, but the {what} \
                 differs: {was} in checkpoint {}, {is} in this run",
                path.display()
            );
        }
        let (old, new) = (saved.global_batch, self.job.batch_size);
        let continued = if self.steps_per_epoch == 0 {
            step
        } else {
            let into = saved.samples_into_epoch;
            anyhow::ensure!(
                into.is_multiple_of(new as u64),
                "--reshape: checkpoint {} stopped {into} samples into epoch {}, not a whole \
                 number of batches of {new}: choose a global batch that divides {into} \
                 (or resume from a checkpoint at an epoch's end)",
                path.display(),
                saved.epoch
            );
            saved.epoch * self.steps_per_epoch + into / new as u64
        };
        let mut changed = format!("global batch {old} → {new}");
        if continued != step {
            changed += &format!(
                ": step {step} continues as step {continued} (epoch {}, {} samples into it)",
                saved.epoch, saved.samples_into_epoch
            );
        } else {
            changed += &format!(": step {step} continues with fresh draws of {new} samples");
        }
        Ok((continued, changed))
    }

    /// A checkpoint at `step` that recorded its sampler position `saved` must be where this
    /// job's sampler stands after `step` steps (older checkpoints recorded none).
    fn check_sampler(&self, path: &Path, step: u64, saved: Option<&SamplerPosition>) -> Result<()> {
        match saved {
            Some(saved) => self.sampler_position(step).check_continues(saved, path),
            None => Ok(()),
        }
    }

    /// Starts from a checkpoint's weights (parameters and buffers), with a fresh optimizer at
    /// step 0: deliberate fine-tuning, allowed from another model configuration whose
    /// tensors match by name and shape. `path` may also be a Hugging Face model directory
    /// (`config.json` + safetensors, GPT-2 or Llama: [`crate::hf`]). Returns the model
    /// description the checkpoint holds.
    pub fn init_from(&mut self, path: &Path) -> Result<String> {
        if crate::hf::is_model_dir(path) {
            let mut full = self.empty_store();
            let from = crate::hf::load(path, &self.whole, &mut full)?;
            self.parallel
                .load_state(&self.model, &self.whole, &full, None)?;
            return Ok(from);
        }
        if crate::sharded::is_sharded(path) {
            let ckpt = crate::sharded::ShardedCheckpoint::open(path)?;
            ckpt.load_into(&mut self.parallel, &self.model, &self.whole, false)?;
            return Ok(ckpt.index.model.clone());
        }
        let restored = checkpoint::CheckpointFile::open(path)?.load_into(
            &mut self.parallel,
            &self.model,
            &self.whole,
            &self.job.model_description,
            Restore::Weights,
        )?;
        Ok(restored.model_description)
    }

    /// A store for the whole (unsplit) model, to read a checkpoint into.
    fn empty_store(&self) -> ParamStore {
        ParamStore {
            values: vec![0.0; self.whole.num_params()],
            grads: Vec::new(),
            buffers: vec![0.0; self.whole.num_buffers()],
        }
    }

    fn eval_and_log(
        &mut self,
        pb: &ProgressBar,
        last: &mut (Option<f64>, Option<f64>),
    ) -> Result<()> {
        let Some(sums) = self.evaluate()? else {
            return Ok(());
        };
        let after = self.run_after_eval()?;
        let eval = self
            .job
            .eval
            .as_ref()
            .expect("evaluated, so there is a set");
        let loss = sums.mean_loss();
        let accuracy = sums.accuracy().filter(|_| eval.accuracy);
        *last = (Some(loss), accuracy);
        if !self.is_lead() {
            return Ok(());
        }
        let perplexity = eval.perplexity.then(|| loss.exp());
        let record = EvalRecord {
            kind: "eval",
            step: self.step,
            epoch: self.epoch_of(self.step),
            loss,
            accuracy,
            perplexity,
            unigram_baseline: eval.baseline,
        };
        let mut line = format!("eval step {}: ", self.step);
        match (accuracy, perplexity) {
            (Some(a), _) => {
                line += &format!("test loss {loss:.4}, test accuracy {:.2}%", a * 100.0)
            }
            (None, Some(p)) => {
                line += &format!("val loss {loss:.4} nats/token (perplexity {p:.2})")
            }
            (None, None) => line += &format!("loss {loss:.4}"),
        }
        if let Some(b) = eval.baseline {
            line += &format!("; unigram baseline {b:.4}");
        }
        for line in std::iter::once(line).chain(after) {
            if self.show_progress {
                pb.println(line);
            } else {
                println!("{line}");
            }
        }
        self.write_metric(&record)
    }

    /// Whether every worker's one chunk is the whole model (no pipeline, tensor split or
    /// ZeRO pieces): then rank 0 has it as it is, and checkpoints and the evaluation hook need
    /// no gathered copy.
    fn holds_whole_model(&self) -> bool {
        self.parallel.stage.schedule().num_chunks() == 1
            && self.parallel.layout.layout.tp == 1
            && self.parallel.zero_stage().is_none()
    }

    /// Runs the [`Trainer::after_eval`] hook, if any, on the whole model: a collective (every
    /// worker takes part in the gather, as for a whole-file checkpoint); rank 0 returns the
    /// hook's line, or the hook's error as a line (a failed sample does not stop training).
    /// Its time counts as evaluation time.
    fn run_after_eval(&mut self) -> Result<Option<String>> {
        let Some(hook) = self.after_eval.clone() else {
            return Ok(None);
        };
        let t = Instant::now();
        let gathered = if self.holds_whole_model() {
            None
        } else {
            self.parallel
                .gather_state(&self.model, &self.whole)
                .context("gathering the model for the evaluation hook")?
        };
        if !self.is_lead() {
            return Ok(None);
        }
        let (step, whole) = (self.step, &self.whole);
        let run = |store: &ParamStore| {
            hook.0(step, whole, store)
                .unwrap_or_else(|e| Some(format!("after-evaluation hook failed: {e:#}")))
        };
        let line = match &gathered {
            Some((store, _)) => run(store),
            // A GPU run's model is copied to the host for as long as the hook runs.
            None => (self.parallel)
                .with_host_state(&StateKind::MODEL, |p| run(&p.stage.chunks[0].store))
                .context("copying the model from the GPU for the evaluation hook")?,
        };
        self.breakdown.eval_s += t.elapsed().as_secs_f64();
        Ok(line)
    }

    fn write_metric<T: serde::Serialize>(&mut self, record: &T) -> Result<()> {
        match self.metrics.as_mut() {
            Some(m) => m.write(record, self.step),
            None => Ok(()),
        }
    }

    /// Runs to the end of the schedule (or `max_steps`) from the current step, evaluating,
    /// logging and checkpointing as configured; `resumed` tells the metrics file what to
    /// keep. Every worker calls it.
    pub fn run(&mut self, resumed: bool) -> Result<Summary> {
        let stop = self.job.stop_step();
        anyhow::ensure!(
            self.step < stop,
            "nothing to train: the run is at step {} and stops at step {stop} (raise \
             train.steps or train.epochs to train further)",
            self.step
        );
        let lead = self.is_lead();
        let out = self.job.out_dir.clone();
        if lead {
            std::fs::create_dir_all(&out)
                .with_context(|| format!("creating output dir {}", out.display()))?;
            let stale = checkpoint::temporary_path(&self.checkpoint_path());
            if stale.exists() {
                std::fs::remove_file(&stale)
                    .with_context(|| format!("removing {}", stale.display()))?;
                println!(
                    "removed {}, a partial checkpoint left by an interrupted save",
                    stale.display()
                );
            }
            self.metrics = Some(MetricsFile::open(
                &out.join("metrics.jsonl"),
                resumed.then_some(self.step),
                self.job.tensorboard.as_deref(),
            )?);
        }
        let pb = if self.show_progress && lead {
            ProgressBar::new(stop)
        } else {
            ProgressBar::hidden()
        };
        pb.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("progress template"),
        );
        pb.set_position(self.step);
        // The elapsed time moves even while a long first step runs.
        pb.enable_steady_tick(std::time::Duration::from_secs(1));
        let first_step = self.step + 1;
        // A first step of minutes (a very long sequence) would leave a log silent: say once
        // that it runs, if it is still running after a while.
        let first_done = (lead && !self.show_progress).then(|| {
            let (done, wait) = std::sync::mpsc::channel::<()>();
            let tokens = self.job.batch_size * self.job.train_data.targets_per_sample();
            std::thread::spawn(move || {
                let after = std::time::Duration::from_secs(FIRST_STEP_NOTICE_S);
                if wait.recv_timeout(after) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                    println!(
                        "step {first_step} still running after {FIRST_STEP_NOTICE_S} s \
                         ({tokens} targets per step; the first step also warms up)"
                    );
                }
            });
            done
        });
        let started = Instant::now();
        let (mut window_t, mut window_samples) = (Instant::now(), 0usize);
        let mut last_eval = (None, None);
        let mut last_loss = f32::NAN;
        let mut samples_total = 0usize;
        let before = self.breakdown.clone();
        let global_samples = self.job.batch_size;
        let mut last_checkpoint = Instant::now();
        let mut stopped_by = None;
        while self.step < stop {
            let lr = self.schedule.lr(self.step);
            let stats = self.train_step()?;
            if self.step == first_step {
                if let Some(done) = &first_done {
                    let _ = done.send(());
                }
            }
            let loss = stats.loss;
            last_loss = loss;
            window_samples += global_samples;
            samples_total += global_samples;
            pb.inc(1);
            let logged = self.step.is_multiple_of(self.job.log_every) || self.step == stop;
            // The first step is printed whatever the interval: it can take long (a long
            // sequence, a cold start), and silence then looks like a hang.
            let sps = window_samples as f64 / window_t.elapsed().as_secs_f64();
            if logged || self.step == first_step {
                let rate = self.describe_rate(sps);
                pb.set_message(format!("loss {loss:.4} | {rate}"));
                if !self.show_progress && lead {
                    println!(
                        "step {:>6} epoch {:>6.3} loss {loss:.4} lr {lr:.2e} {rate}",
                        self.step,
                        self.epoch_of(self.step)
                    );
                }
            }
            if logged {
                let record = TrainRecord {
                    kind: "train",
                    step: self.step,
                    epoch: self.epoch_of(self.step),
                    loss,
                    lr,
                    grad_norm: stats.grad_norm,
                    loss_scale: stats.loss_scale,
                    skipped_steps: self.skipped_steps,
                    samples_per_s: sps,
                    elapsed_s: started.elapsed().as_secs_f64(),
                };
                self.write_metric(&record)?;
                (window_t, window_samples) = (Instant::now(), 0);
            }
            let epoch_end =
                self.steps_per_epoch > 0 && self.step.is_multiple_of(self.steps_per_epoch);
            let eval_due = match self.job.eval_every {
                Some(e) if e > 0 => self.step.is_multiple_of(e),
                _ => epoch_end,
            };
            if eval_due || self.step == self.total_steps {
                self.eval_and_log(&pb, &mut last_eval)?;
            }
            // Every worker takes the same decisions here, or some would wait in a collective
            // the others never join: the step count is the same everywhere; a signal may
            // have reached one worker only, and rank 0's clock decides the timed checkpoint.
            let by_steps = (self.job.checkpoint_every.filter(|&e| e > 0))
                .is_some_and(|every| self.step.is_multiple_of(every));
            let by_time = lead
                && stop::checkpoint_due(
                    self.job.checkpoint_every_minutes,
                    last_checkpoint.elapsed(),
                );
            let (signal, by_time) = self.agree_between_steps(self.stop.requested(), by_time)?;
            // A signal during the last step: the run ends as it would have anyway.
            if let Some(signal) = signal.filter(|_| self.step < stop) {
                stopped_by = Some(signal);
                break;
            }
            // The last step's checkpoint is the final one, below.
            if (by_steps || by_time) && self.step < stop {
                let p = self.checkpoint_path();
                self.checkpoint(&p, self.job.checkpoint_background)?;
                last_checkpoint = Instant::now();
            }
        }
        pb.finish_and_clear();
        self.breakdown.device_memory = self.parallel.device_memory();
        // The final checkpoint is on disk before the run returns.
        let p = self.checkpoint_path();
        self.save_checkpoint(&p)?;
        // Said before the collectives that end the run: under mpirun a rank that exits
        // first gets the others killed, and the message must be out by then.
        if let (Some(signal), true) = (stopped_by, lead) {
            println!(
                "stopped by {} after step {}: checkpoint saved to {}",
                stop::signal_name(signal),
                self.step,
                p.display()
            );
            let launched = std::env::var_os(stop::LAUNCHED_ENV).is_some();
            if let (Some(args), false) = (&self.command_line, launched) {
                println!("resume with: {}", stop::resume_command(args, &p));
            }
        }
        self.finish_run()?;
        // Under mpirun every worker is a process: report the largest.
        let mut rss = [peak_rss_mb().unwrap_or(0.0) as f32];
        let world = self.parallel.world().clone();
        if world.size() > 1 {
            world.all_reduce(BufMut::F32(&mut rss), ReduceOp::Max)?;
        }
        let compute = self.breakdown.step_s() - before.step_s();
        let summary = Summary {
            steps: self.step,
            final_train_loss: last_loss,
            test_accuracy: last_eval.1,
            eval_loss: last_eval.0,
            unigram_baseline: self.job.eval.as_ref().and_then(|e| e.baseline),
            samples_per_s: samples_total as f64 / compute.max(1e-9),
            peak_rss_mb: (rss[0] > 0.0).then_some(rss[0] as f64),
            memory: self.memory_report(),
            breakdown: self.breakdown.clone(),
            wall_s: started.elapsed().as_secs_f64(),
            layout: self.parallel.layout.layout.to_string(),
            rank: self.parallel.world().rank(),
            graph_replays: self.graph_replays,
            stopped: stopped_by.map(|signal| Stopped {
                signal,
                step: self.step,
                checkpoint: p.clone(),
            }),
        };
        #[derive(serde::Serialize)]
        struct Tagged<'a> {
            kind: &'static str,
            #[serde(flatten)]
            summary: &'a Summary,
        }
        self.write_metric(&Tagged {
            kind: "summary",
            summary: &summary,
        })?;
        if lead {
            let measured = self.breakdown.measured_step(self.job.batch_size);
            let path = out.join("breakdown.json");
            std::fs::write(&path, serde_json::to_string_pretty(&measured)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(summary)
    }

    /// After a step, every worker's view of whether to stop (the signal that asked, if any)
    /// and whether rank 0's clock calls for a checkpoint, made the same on every worker (one
    /// all-reduce of two numbers; nothing on a single worker).
    fn agree_between_steps(
        &self,
        stop: Option<i32>,
        checkpoint_due: bool,
    ) -> Result<(Option<i32>, bool)> {
        let world = self.parallel.world();
        if world.size() == 1 {
            return Ok((stop, checkpoint_due));
        }
        let mut views = [
            stop.unwrap_or(0) as f32,
            f32::from(u8::from(checkpoint_due)),
        ];
        world
            .all_reduce(BufMut::F32(&mut views), ReduceOp::Max)
            .with_context(|| {
                format!(
                    "agreeing after step {} whether to stop or checkpoint",
                    self.step
                )
            })?;
        Ok(((views[0] > 0.0).then_some(views[0] as i32), views[1] > 0.0))
    }

    /// End of a run (every worker): averages the step-time breakdown over all workers (they
    /// differ: pipeline stages, the single master; the mean is what a step costs), and
    /// writes the timeline of the last step on rank 0.
    fn finish_run(&mut self) -> Result<()> {
        let world = self.parallel.world().clone();
        if world.size() > 1 {
            let mut fields = self.breakdown.times_mut().map(|v| *v as f32);
            world
                .all_reduce(BufMut::F32(&mut fields), ReduceOp::Average)
                .context("averaging the step-time breakdown")?;
            for (time, mean) in self.breakdown.times_mut().into_iter().zip(fields) {
                *time = f64::from(mean);
            }
        }
        if let Some(recorded) = &self.timeline {
            let l = &self.parallel.layout;
            let schedule = &l.schedule;
            let title = format!(
                "{} (dp {} × pp {}, {} micro-batches): one training step",
                if l.layout.pp > 1 {
                    format!("{} pipeline", schedule.kind)
                } else {
                    "no pipeline".to_string()
                },
                l.layout.dp,
                l.layout.pp,
                l.micro_batches()
            );
            recorded.finish(world.as_ref(), &title, l.layout.pp)?;
        }
        Ok(())
    }
}

/// `x` with three significant digits (no decimals from 100 on).
fn significant(x: f64) -> String {
    match x.abs() {
        a if a >= 100.0 || a == 0.0 => format!("{x:.0}"),
        a if a >= 10.0 => format!("{x:.1}"),
        a if a >= 1.0 => format!("{x:.2}"),
        _ => format!("{x:.3}"),
    }
}

/// The sample indices of rank `rank`'s share (of `world`) of step `step`'s global batch.
fn share_indices(
    job: &Job,
    cache: &mut EpochOrder,
    steps_per_epoch: u64,
    step: u64,
    rank: usize,
    world: usize,
) -> Result<Vec<usize>> {
    let local = job.batch_size / world;
    let n = job.train_data.len();
    match job.sampling {
        Sampling::Epochs => {
            let epoch = step / steps_per_epoch;
            let in_epoch = (step % steps_per_epoch) as usize;
            let key = (world, rank, epoch);
            if cache.as_ref().map(|(k, _)| *k) != Some(key) {
                let mut sampler =
                    DistributedSampler::new(n, world, rank, job.seed, Tail::DropLast)?;
                sampler.set_epoch(epoch);
                *cache = Some((key, sampler.indices()));
            }
            let order = &cache.as_ref().expect("cached above").1;
            Ok(order[in_epoch * local..(in_epoch + 1) * local].to_vec())
        }
        Sampling::Random => {
            let stream = SplitMix64::derive(job.seed, step).next_u64();
            let global = random_indices(n, job.batch_size, stream);
            Ok(global[rank * local..(rank + 1) * local].to_vec())
        }
    }
}
