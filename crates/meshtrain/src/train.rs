//! The training loop of one worker: batches, forward, loss, backward, gradient
//! synchronisation, clipping, optimizer, schedule, evaluation, metrics, checkpoints and a
//! step-time breakdown.
//!
//! Every step's data is a pure function of (seed, step) — image batches come from the seeded
//! permutation of their epoch, text windows from a sampler seeded by the step — so a resumed
//! run sees exactly the batches an uninterrupted run would, and ends bit-identical.
//!
//! With data parallelism ([`Trainer::with_group`]) every worker runs this loop on its share of
//! each global batch; the distributed sampler deals shards so that the workers' shares of
//! step `s` together are exactly the single worker's batch `s`. Rank 0 alone prints, writes
//! metrics and checkpoints.
//!
//! With pipeline parallelism (`parallel.pp > 1`) the same loop runs on each of `dp × pp`
//! workers, and the model-specific parts (step, evaluation, checkpoints, resume) go through
//! the hooks into [`crate::pipeline_train`].

use crate::checkpoint::{self, TrainState};
use crate::config::DpMode;
use crate::config::{Config, ModelConfig};
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meshtrain_comm::{ProcessGroup, ReduceOp};
use meshtrain_data::{
    eval_shard, unigram_entropy_nats, DistributedSampler, FashionMnist, ImageDataset,
    Normalization, ResolveOptions, SplitMix64, Tail, TextBatchSampler, TextCorpus,
};
use meshtrain_nn::models::{gpt, lenet, resnet};
use meshtrain_nn::optim::{clip_grad_norm, Optimizer};
use meshtrain_nn::schedule::{scale_lr_linearly, Schedule};
use meshtrain_nn::{Mode, Model, ParamStore, StatsReducer};
use meshtrain_parallel::data::{
    CommTiming, Ddp, DdpConfig, GroupStatsReducer, SingleMaster, MASTER,
};
use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::Tensor;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

pub fn build_model(cfg: &ModelConfig) -> Model {
    match cfg {
        ModelConfig::Lenet { variant } => lenet::lenet(*variant),
        ModelConfig::Resnet18 { width } => resnet::resnet18(*width, 10),
        ModelConfig::Gpt(g) => gpt::gpt(g),
    }
}

/// The data a run trains on.
pub enum Task {
    Images { data: FashionMnist },
    Text { corpus: TextCorpus, seq: usize },
}

impl Task {
    pub fn load(cfg: &Config) -> Result<Task> {
        Ok(match &cfg.model {
            ModelConfig::Gpt(g) => Task::Text {
                corpus: TextCorpus::shakespeare().context("loading the Shakespeare corpus")?,
                seq: g.seq,
            },
            _ => {
                let opts = ResolveOptions::from_env(cfg.data.data_dir.clone());
                let mut data = FashionMnist::load(&opts, Normalization::FASHION_MNIST)
                    .context("loading Fashion-MNIST")?;
                if let Some(n) = cfg.data.train_limit {
                    truncate(&mut data.train, n);
                }
                if let Some(n) = cfg.data.test_limit {
                    truncate(&mut data.test, n);
                }
                Task::Images { data }
            }
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Task::Images { data } => format!(
                "Fashion-MNIST from {} ({} train / {} test images)",
                data.source, data.train.n, data.test.n
            ),
            Task::Text { corpus, .. } => format!(
                "Shakespeare bytes ({} train / {} validation)",
                corpus.train.len(),
                corpus.val.len()
            ),
        }
    }
}

fn truncate(d: &mut ImageDataset, n: usize) {
    let n = n.min(d.n);
    d.images.truncate(n * d.sample_len());
    d.labels.truncate(n);
    d.n = n;
}

/// One training batch: model input, integer targets, and the number of samples.
pub struct Batch {
    pub x: Tensor,
    pub y: Vec<u32>,
    pub samples: usize,
}

/// Where a step's time went (seconds, summed over the run).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Breakdown {
    pub data_s: f64,
    pub forward_s: f64,
    /// Backward compute (the time spent launching communication from its hooks excluded).
    pub backward_s: f64,
    pub optimizer_s: f64,
    /// Communication the worker waited for (gradient all-reduce after backward, or the
    /// single-master scatter/gather/broadcast).
    pub comm_exposed_s: f64,
    /// Communication that ran while backward was computing.
    pub comm_hidden_s: f64,
    /// Bytes this worker sent into gradient synchronisation.
    pub comm_bytes: u64,
    /// Pipeline runs: time a stage was not computing inside the pipelined step — waiting for
    /// activations or gradients (the bubble, plus transfer time) and posting sends.
    pub pipeline_idle_s: f64,
    /// Pipeline stages (0 or 1 = no pipeline).
    pub stages: usize,
    pub eval_s: f64,
    pub checkpoint_s: f64,
    pub steps: u64,
    /// Data-parallel workers (1 = single worker).
    pub workers: usize,
}

impl Breakdown {
    /// The times accumulated since `before` (an earlier copy of the same worker's breakdown):
    /// benchmarks take one after warm-up and report only the timed steps.
    pub fn since(&self, before: &Breakdown) -> Breakdown {
        Breakdown {
            data_s: self.data_s - before.data_s,
            forward_s: self.forward_s - before.forward_s,
            backward_s: self.backward_s - before.backward_s,
            optimizer_s: self.optimizer_s - before.optimizer_s,
            comm_exposed_s: self.comm_exposed_s - before.comm_exposed_s,
            comm_hidden_s: self.comm_hidden_s - before.comm_hidden_s,
            comm_bytes: self.comm_bytes - before.comm_bytes,
            pipeline_idle_s: self.pipeline_idle_s - before.pipeline_idle_s,
            steps: self.steps - before.steps,
            workers: self.workers,
            stages: self.stages,
            ..Breakdown::default()
        }
    }

    /// The accumulated times, in a fixed order, for element-wise reductions across workers.
    pub fn times_mut(&mut self) -> [&mut f64; 7] {
        [
            &mut self.data_s,
            &mut self.forward_s,
            &mut self.backward_s,
            &mut self.optimizer_s,
            &mut self.comm_exposed_s,
            &mut self.comm_hidden_s,
            &mut self.pipeline_idle_s,
        ]
    }

    pub fn compute_s(&self) -> f64 {
        self.forward_s + self.backward_s + self.optimizer_s
    }

    /// Time of the training steps: compute, exposed communication, pipeline idle time and
    /// data loading.
    pub fn step_s(&self) -> f64 {
        self.compute_s() + self.comm_exposed_s + self.pipeline_idle_s + self.data_s
    }

    /// Computation-to-synchronisation ratio: compute time per unit of communication time
    /// (hidden or not). Infinite for a single worker.
    pub fn compute_to_comm(&self) -> f64 {
        self.compute_s() / (self.comm_exposed_s + self.comm_hidden_s)
    }

    pub fn report(&self) -> String {
        let n = self.steps.max(1) as f64;
        let ms = |s: f64| s / n * 1e3;
        let dp_workers = self.workers / self.stages.max(1);
        let comm = if dp_workers <= 1 && self.stages > 1 {
            "no data-parallel communication (one replica)".to_string()
        } else if dp_workers <= 1 {
            "communication 0 (single worker)".to_string()
        } else {
            let total = self.comm_exposed_s + self.comm_hidden_s;
            format!(
                "communication {:.1} ms exposed + {:.1} ms hidden by overlap ({:.0}% hidden, {:.1} MB/step); \
                 compute/communication ratio {:.1}",
                ms(self.comm_exposed_s),
                ms(self.comm_hidden_s),
                if total > 0.0 { 100.0 * self.comm_hidden_s / total } else { 0.0 },
                self.comm_bytes as f64 / n / 1e6,
                self.compute_to_comm()
            )
        };
        // Pipeline runs report the mean over all workers (stages differ).
        let (layout, pipeline) = if self.stages > 1 {
            (
                format!(
                    "{} workers = dp {dp_workers} × pp {}, mean over workers",
                    self.workers, self.stages
                ),
                format!(
                    " + pipeline idle (bubble, transfers) {:.1} ms ({:.0}% of the step)",
                    ms(self.pipeline_idle_s),
                    100.0 * self.pipeline_idle_s / self.step_s().max(1e-12)
                ),
            )
        } else {
            let s = if self.workers > 1 { "s" } else { "" };
            (format!("{} worker{s}", self.workers.max(1)), String::new())
        };
        format!(
            "per step ({layout}): {:.1} ms = compute {:.1} ms (forward {:.1}, backward {:.1}, optimizer {:.1}) \
             + exposed communication {:.1} ms{pipeline} + data {:.1} ms; {comm}; eval {:.1} s, checkpoints {:.1} s in total",
            ms(self.step_s()),
            ms(self.compute_s()),
            ms(self.forward_s),
            ms(self.backward_s),
            ms(self.optimizer_s),
            ms(self.comm_exposed_s),
            ms(self.data_s),
            self.eval_s,
            self.checkpoint_s
        )
    }
}

/// What a finished run reports.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub steps: u64,
    pub final_train_loss: f32,
    /// Image models: test accuracy of the last evaluation.
    pub test_accuracy: Option<f64>,
    /// Last evaluation loss (test for images, validation for text).
    pub eval_loss: Option<f64>,
    /// Text: unigram entropy of the validation split, the loss of a model that ignores context.
    pub unigram_baseline: Option<f64>,
    pub samples_per_s: f64,
    pub peak_rss_mb: Option<f64>,
    pub breakdown: Breakdown,
    pub wall_s: f64,
}

/// How this worker keeps its replica in step with the others.
enum Sync {
    Ddp(Box<Ddp>),
    SingleMaster(SingleMaster),
}

/// The data-parallel side of a worker: its group, the gradient synchroniser and an exact
/// f64 summer (on its own sub-group) for SyncBatchNorm and evaluation metrics.
struct DataParallel {
    group: Arc<dyn ProcessGroup>,
    sync: Sync,
    sums: Arc<GroupStatsReducer>,
}

pub struct Trainer {
    pub cfg: Config,
    pub model: Model,
    /// The whole model's parameters. Pipeline runs keep the stages' shares in
    /// [`crate::pipeline_train::PipelineWorker`] instead; this holds the model gathered on
    /// rank 0 for evaluation and checkpoints (empty elsewhere), as does `optimizer`.
    pub store: ParamStore,
    pub optimizer: Optimizer,
    pub schedule: Schedule,
    pub task: Arc<Task>,
    pub step: u64,
    pub total_steps: u64,
    steps_per_epoch: u64,
    /// (world, rank) the image sampler deals for, and the epoch whose indices are cached.
    epoch_indices: Option<((usize, usize, u64), Vec<usize>)>,
    pub(crate) pool: rayon::ThreadPool,
    pub breakdown: Breakdown,
    metrics: Option<std::fs::File>,
    pub show_progress: bool,
    dp: Option<DataParallel>,
    /// This worker's pipeline stage (`parallel.pp > 1`).
    pub(crate) pipeline: Option<Box<crate::pipeline_train::PipelineWorker>>,
}

#[derive(Serialize)]
struct TrainRecord {
    kind: &'static str,
    step: u64,
    epoch: f64,
    loss: f32,
    lr: f32,
    grad_norm: f32,
    samples_per_s: f64,
    elapsed_s: f64,
}

#[derive(Serialize)]
struct EvalRecord {
    kind: &'static str,
    step: u64,
    epoch: f64,
    loss: f64,
    accuracy: Option<f64>,
    perplexity: Option<f64>,
    unigram_baseline: Option<f64>,
}

/// Intra-op threads for each of `workers` workers sharing this machine: the configured total
/// (default: all cores) split evenly, never oversubscribing by default.
pub fn threads_per_worker(configured: Option<usize>, workers: usize) -> usize {
    let total =
        configured.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    (total / workers.max(1)).max(1)
}

impl Trainer {
    /// A single-worker trainer.
    pub fn new(cfg: Config, task: Task) -> Result<Trainer> {
        Self::build(cfg, Arc::new(task), None, None)
    }

    /// One worker of a parallel run over `group`, the world of `parallel.dp × parallel.pp`
    /// workers: data-parallel when `pp` is 1, a pipeline stage (of a data-parallel replica)
    /// otherwise. `threads` overrides the intra-op thread count of this worker.
    pub fn with_group(
        cfg: Config,
        task: Arc<Task>,
        group: Arc<dyn ProcessGroup>,
        threads: Option<usize>,
    ) -> Result<Trainer> {
        let (dp, pp) = (cfg.parallel.dp, cfg.parallel.pp);
        anyhow::ensure!(
            group.size() == dp * pp,
            "parallel.dp={dp} × parallel.pp={pp} but the process group has {} workers",
            group.size()
        );
        if pp > 1 {
            let threads = threads.unwrap_or_else(|| threads_per_worker(cfg.train.threads, dp * pp));
            let mut trainer = Self::build(cfg, task, None, Some(threads))?;
            crate::pipeline_train::attach(&mut trainer, group)?;
            return Ok(trainer);
        }
        Self::build(cfg, task, Some(group), threads)
    }

    fn build(
        cfg: Config,
        task: Arc<Task>,
        group: Option<Arc<dyn ProcessGroup>>,
        threads: Option<usize>,
    ) -> Result<Trainer> {
        let mut model = build_model(&cfg.model);
        let mut store = model.init(cfg.train.seed);
        let optimizer = Optimizer::new(cfg.optimizer, model.num_params());
        let bs = cfg.train.batch_size as u64;
        let (steps_per_epoch, total_steps) = match task.as_ref() {
            Task::Images { data } => {
                let spe = data.train.n as u64 / bs;
                anyhow::ensure!(
                    spe > 0,
                    "batch size {bs} is larger than the {} training images",
                    data.train.n
                );
                (spe, spe * cfg.train.epochs.unwrap_or(1))
            }
            Task::Text { .. } => (0, cfg.train.steps.unwrap_or(0)),
        };
        let s = &cfg.schedule;
        let base_lr = match s.reference_batch {
            Some(r) => scale_lr_linearly(s.lr, r, cfg.train.batch_size),
            None => s.lr,
        };
        let schedule = Schedule {
            base_lr,
            warmup_steps: s.warmup_steps,
            total_steps,
            min_lr_fraction: s.min_lr_fraction,
        };
        let workers = group.as_ref().map_or(1, |g| g.size());
        let threads = threads.unwrap_or_else(|| threads_per_worker(cfg.train.threads, workers));
        let dp = match group {
            Some(group) if group.size() > 1 => {
                let p = &cfg.parallel;
                let all: Vec<usize> = (0..group.size()).collect();
                let sums = Arc::new(GroupStatsReducer::new(
                    group
                        .new_named_subgroup(&all, "dp-stats")
                        .context("creating the statistics group")?,
                ));
                if p.sync_batch_norm {
                    model.set_stats_reducer(Some(sums.clone() as Arc<dyn StatsReducer>));
                }
                let sync = match p.dp_mode {
                    DpMode::Ddp => {
                        let ddp = Ddp::new(
                            &model,
                            group.clone(),
                            DdpConfig {
                                bucket_cap_mb: p.bucket_cap_mb,
                                first_bucket_mb: p.first_bucket_mb,
                                compression: p.compression,
                                overlap: p.overlap,
                            },
                        )?;
                        ddp.broadcast_state(&mut store)?;
                        Sync::Ddp(Box::new(ddp))
                    }
                    DpMode::SingleMaster => {
                        let master = SingleMaster::new(group.clone());
                        master.broadcast_weights(&mut store)?;
                        Sync::SingleMaster(master)
                    }
                };
                Some(DataParallel { group, sync, sums })
            }
            _ => None,
        };
        Ok(Trainer {
            pool: meshtrain_tensor::par::pool(threads),
            cfg,
            model,
            store,
            optimizer,
            schedule,
            task,
            step: 0,
            total_steps,
            steps_per_epoch,
            epoch_indices: None,
            breakdown: Breakdown {
                workers,
                ..Breakdown::default()
            },
            metrics: None,
            show_progress: false,
            dp,
            pipeline: None,
        })
    }

    /// This worker's data-parallel rank and the number of data-parallel replicas (what the
    /// batches are dealt over).
    pub fn rank_and_world(&self) -> (usize, usize) {
        if let Some(p) = &self.pipeline {
            return p.data_parallel_rank_and_size();
        }
        self.dp
            .as_ref()
            .map_or((0, 1), |d| (d.group.rank(), d.group.size()))
    }

    /// Rank 0 prints, logs and checkpoints for everyone.
    pub fn is_lead(&self) -> bool {
        match &self.pipeline {
            Some(p) => p.is_lead(),
            None => self.rank_and_world().0 == 0,
        }
    }

    /// Continue from a checkpoint written by [`Trainer::save_checkpoint`] (every worker reads
    /// the same file).
    pub fn resume(&mut self, path: &std::path::Path) -> Result<()> {
        if let Some(p) = self.pipeline.as_mut() {
            self.step = p.resume(path, &self.model, self.cfg.optimizer)?;
            return Ok(());
        }
        self.step = checkpoint::load(path, &self.model, &mut self.store, &mut self.optimizer)?;
        Ok(())
    }

    /// Writes the checkpoint (rank 0 only; the replicas are identical). Pipeline stages first
    /// gather the whole model and optimizer state on rank 0, so the file is the same as a
    /// single worker's.
    pub fn save_checkpoint(&mut self, path: &std::path::Path) -> Result<()> {
        if let Some(p) = self.pipeline.as_mut() {
            let t = Instant::now();
            p.gather_state(&self.model, &mut self.store, &mut self.optimizer)?;
            self.breakdown.checkpoint_s += t.elapsed().as_secs_f64();
        }
        if !self.is_lead() {
            return Ok(());
        }
        let t = Instant::now();
        let config_toml = toml::to_string(&self.cfg).unwrap_or_default();
        checkpoint::save(
            path,
            &TrainState {
                model: &self.model,
                store: &self.store,
                optimizer: &self.optimizer,
                step: self.step,
                config_toml: &config_toml,
            },
        )?;
        self.breakdown.checkpoint_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn out_dir(&self) -> PathBuf {
        self.cfg.train.out_dir.clone()
    }

    pub fn checkpoint_path(&self) -> PathBuf {
        self.out_dir().join("checkpoint.safetensors")
    }

    fn epoch_of(&self, step: u64) -> f64 {
        if self.steps_per_epoch == 0 {
            0.0
        } else {
            step as f64 / self.steps_per_epoch as f64
        }
    }

    /// This worker's batch of global step `step` (a pure function of the seed and the step):
    /// its share of the global batch under the distributed sampler. With the single-master
    /// mode the master gets the whole global batch and the others nothing (it scatters).
    pub fn batch(&mut self, step: u64) -> Result<Batch> {
        let (rank, world) = self.rank_and_world();
        let single_master = matches!(
            self.dp,
            Some(DataParallel {
                sync: Sync::SingleMaster(_),
                ..
            })
        );
        match (single_master, rank == MASTER) {
            (true, true) => self.share_of(step, 0, 1),
            (true, false) => Ok(Batch {
                x: Tensor::zeros(&[0]),
                y: Vec::new(),
                samples: 0,
            }),
            (false, _) => self.share_of(step, rank, world),
        }
    }

    /// Rank `rank`'s share (of `world`) of step `step`'s global batch.
    fn share_of(&mut self, step: u64, rank: usize, world: usize) -> Result<Batch> {
        let local = self.cfg.train.batch_size / world;
        let seed = self.cfg.train.seed;
        let task = Arc::clone(&self.task);
        match task.as_ref() {
            Task::Images { data } => {
                let epoch = step / self.steps_per_epoch;
                let in_epoch = (step % self.steps_per_epoch) as usize;
                let key = (world, rank, epoch);
                if self.epoch_indices.as_ref().map(|(k, _)| *k) != Some(key) {
                    let mut sampler =
                        DistributedSampler::new(data.train.n, world, rank, seed, Tail::DropLast)?;
                    sampler.set_epoch(epoch);
                    self.epoch_indices = Some((key, sampler.indices()));
                }
                let order = &self.epoch_indices.as_ref().expect("epoch indices").1;
                let idx = &order[in_epoch * local..(in_epoch + 1) * local];
                image_batch(&data.train, idx)
            }
            Task::Text { corpus, seq } => {
                let stream = SplitMix64::derive(seed, step).next_u64();
                let global = text_batch(&corpus.train, self.cfg.train.batch_size, *seq, stream)?;
                Ok(rows(&global, rank * local, local))
            }
        }
    }

    /// One optimisation step on this worker's `batch` (split into `accumulation_steps`
    /// micro-batches); returns (loss averaged over all workers, gradient norm before clipping).
    pub fn train_step(&mut self, batch: &Batch) -> Result<(f32, f32)> {
        if self.pipeline.is_some() {
            return crate::pipeline_train::train_step(self, batch);
        }
        let classes = self.num_classes();
        let lr = self.schedule.lr(self.step);
        let clip = self.cfg.train.grad_clip;
        let recompute = self.cfg.train.recompute;
        let micro_steps = self.cfg.train.accumulation_steps;
        let (_, world) = self.rank_and_world();
        let local = self.cfg.train.batch_size / world;
        let sample_len = self.sample_len();
        let targets_per_sample = self.targets_per_sample();
        let (model, store, opt, bd, dp) = (
            &self.model,
            &mut self.store,
            &mut self.optimizer,
            &mut self.breakdown,
            &mut self.dp,
        );
        // The single-master mode starts by scattering the master's global batch.
        let scattered;
        let batch = match dp {
            Some(DataParallel {
                sync: Sync::SingleMaster(m),
                ..
            }) => {
                let t = Instant::now();
                let global = m.is_master().then(|| (batch.x.data(), batch.y.as_slice()));
                let (x, y) = m.scatter(global, local, sample_len, targets_per_sample)?;
                bd.comm_exposed_s += t.elapsed().as_secs_f64();
                scattered = batch_from_parts(x, y, local, &self.task);
                &scattered
            }
            _ => batch,
        };
        self.pool
            .install(|| -> Result<(f32, f32)> {
                let mut loss_sum = 0.0f32;
                let per_micro = batch.samples / micro_steps;
                for k in 0..micro_steps {
                    let last = k + 1 == micro_steps;
                    let micro = if micro_steps == 1 {
                        None
                    } else {
                        Some(rows(batch, k * per_micro, per_micro))
                    };
                    let mb = micro.as_ref().unwrap_or(batch);
                    let t0 = Instant::now();
                    let blocks = 0..model.num_blocks();
                    let (logits, acts) =
                        model.forward(store, mb.x.clone(), blocks, Mode::TRAIN, &|_| recompute);
                    let (loss, dlogits, _) = softmax_cross_entropy(
                        logits.data(),
                        classes,
                        &mb.y,
                        1.0 / micro_steps as f32,
                    );
                    loss_sum += loss;
                    let t1 = Instant::now();
                    let dy = Tensor::from_vec(dlogits, logits.shape());
                    let mut timing = CommTiming::default();
                    match dp {
                        Some(DataParallel {
                            sync: Sync::Ddp(ddp),
                            ..
                        }) => {
                            ddp.prepare(last);
                            model.backward(store, acts, dy, false, &mut |i, st| {
                                ddp.block_ready(i, st)
                            });
                            let t2 = Instant::now();
                            timing = ddp.finish(store)?;
                            bd.backward_s += (t2 - t1).as_secs_f64() - timing.in_backward_s;
                        }
                        _ => {
                            model.backward(store, acts, dy, false, &mut |_, _| {});
                            bd.backward_s += t1.elapsed().as_secs_f64();
                        }
                    }
                    bd.forward_s += (t1 - t0).as_secs_f64();
                    bd.comm_exposed_s += timing.exposed_s;
                    bd.comm_hidden_s += timing.hidden_s;
                    bd.comm_bytes += timing.bytes as u64;
                }
                // Single master: gradients to rank 0, which alone updates, then weights back.
                let mut updates = true;
                if let Some(DataParallel {
                    sync: Sync::SingleMaster(m),
                    ..
                }) = dp
                {
                    let t = Instant::now();
                    m.gather_gradients(&mut store.grads)?;
                    bd.comm_exposed_s += t.elapsed().as_secs_f64();
                    bd.comm_bytes += (store.grads.len() * 4) as u64;
                    updates = m.is_master();
                }
                let t2 = Instant::now();
                let mut norm = 0.0;
                if updates {
                    norm = match clip {
                        Some(c) => clip_grad_norm(&mut store.grads, c),
                        None => meshtrain_nn::optim::grad_norm(&store.grads),
                    };
                    opt.step(&mut store.values, &store.grads, lr);
                }
                store.zero_grads();
                bd.optimizer_s += t2.elapsed().as_secs_f64();
                if let Some(DataParallel {
                    sync: Sync::SingleMaster(m),
                    ..
                }) = dp
                {
                    let t = Instant::now();
                    m.broadcast_weights(store)?;
                    bd.comm_exposed_s += t.elapsed().as_secs_f64();
                }
                let mut loss = loss_sum;
                if let Some(d) = dp.as_ref() {
                    // Every worker reports (and checks for divergence on) the same numbers: the
                    // loss averaged over workers and the norm of the update, which rank 0 has.
                    let world = d.group.size() as f32;
                    let mut v = [loss / world, if d.group.rank() == 0 { norm } else { 0.0 }];
                    d.group
                        .all_reduce(meshtrain_comm::BufMut::F32(&mut v), ReduceOp::Sum)
                        .context("averaging the step's loss over the workers")?;
                    (loss, norm) = (v[0], v[1]);
                }
                Ok((loss, norm))
            })
            .inspect(|_| {
                self.breakdown.steps += 1;
                self.step += 1;
            })
    }

    pub(crate) fn num_classes(&self) -> usize {
        match &self.cfg.model {
            ModelConfig::Gpt(g) => g.vocab,
            _ => 10,
        }
    }

    /// Floats of model input per sample.
    fn sample_len(&self) -> usize {
        match self.task.as_ref() {
            Task::Images { data } => data.train.sample_len(),
            Task::Text { seq, .. } => *seq,
        }
    }

    fn targets_per_sample(&self) -> usize {
        match self.task.as_ref() {
            Task::Images { .. } => 1,
            Task::Text { seq, .. } => *seq,
        }
    }

    /// Evaluate: image models on the whole test set (loss, accuracy); GPT on fixed validation
    /// windows (loss, perplexity). Data-parallel workers each take a disjoint shard and the
    /// sums are added exactly, so every sample counts once.
    pub fn evaluate(&mut self) -> Result<(f64, Option<f64>)> {
        if self.pipeline.is_some() {
            return crate::pipeline_train::evaluate(self);
        }
        let (rank, world) = self.rank_and_world();
        self.evaluate_replica(rank, world)
    }

    /// [`Trainer::evaluate`] on this worker's whole-model store, as rank `rank` of `world`
    /// evaluating workers (pipeline runs: rank 0 alone, on the gathered model).
    pub(crate) fn evaluate_replica(
        &mut self,
        rank: usize,
        world: usize,
    ) -> Result<(f64, Option<f64>)> {
        let t = Instant::now();
        let classes = self.num_classes();
        let (model, store) = (&self.model, &mut self.store);
        // (loss sum, correct, samples or batches)
        let mut sums = [0.0f64; 3];
        match self.task.as_ref() {
            Task::Images { data } => {
                let d = &data.test;
                let shard = eval_shard(d.n, rank, world)?;
                let chunk = 500;
                let mut start = shard.start;
                while start < shard.end {
                    let n = chunk.min(shard.end - start);
                    let idx: Vec<usize> = (start..start + n).collect();
                    let b = image_batch(d, &idx)?;
                    let (l, c) = self.pool.install(|| {
                        let (logits, _) = model.forward_all(store, b.x, Mode::EVAL);
                        let (l, _, c) = softmax_cross_entropy(logits.data(), classes, &b.y, 1.0);
                        (l, c)
                    });
                    sums[0] += l as f64 * n as f64;
                    sums[1] += c as f64;
                    sums[2] += n as f64;
                    start += n;
                }
            }
            Task::Text { corpus, seq } => {
                let bs = self.cfg.train.batch_size;
                let batches = self.cfg.train.eval_batches.max(1);
                for i in (rank..batches).step_by(world) {
                    let b = text_batch(&corpus.val, bs, *seq, 0xE7A1 + i as u64)?;
                    let l = self.pool.install(|| {
                        let (logits, _) = model.forward_all(store, b.x, Mode::EVAL);
                        softmax_cross_entropy(logits.data(), classes, &b.y, 1.0).0
                    });
                    sums[0] += l as f64;
                    sums[2] += 1.0;
                }
            }
        }
        if let Some(d) = &self.dp {
            d.sums.sum(&mut sums);
        }
        let loss = sums[0] / sums[2].max(1.0);
        let accuracy = match self.task.as_ref() {
            Task::Images { .. } => Some(sums[1] / sums[2].max(1.0)),
            Task::Text { .. } => None,
        };
        self.breakdown.eval_s += t.elapsed().as_secs_f64();
        Ok((loss, accuracy))
    }

    fn write_metric<T: Serialize>(&mut self, record: &T) -> Result<()> {
        if let Some(f) = self.metrics.as_mut() {
            serde_json::to_writer(&mut *f, record)?;
            f.write_all(b"\n")?;
        }
        Ok(())
    }

    fn eval_and_log(
        &mut self,
        pb: &ProgressBar,
        last: &mut (Option<f64>, Option<f64>),
    ) -> Result<()> {
        let (loss, acc) = self.evaluate()?;
        let baseline = match self.task.as_ref() {
            Task::Text { corpus, .. } => Some(unigram_entropy_nats(&corpus.val)),
            _ => None,
        };
        *last = (Some(loss), acc);
        if !self.is_lead() {
            return Ok(());
        }
        let record = EvalRecord {
            kind: "eval",
            step: self.step,
            epoch: self.epoch_of(self.step),
            loss,
            accuracy: acc,
            perplexity: baseline.map(|_| loss.exp()),
            unigram_baseline: baseline,
        };
        let line = match (acc, baseline) {
            (Some(a), _) => format!("eval step {}: test loss {loss:.4}, test accuracy {:.2}%", self.step, a * 100.0),
            (_, Some(b)) => format!(
                "eval step {}: val loss {loss:.4} nats/char (perplexity {:.2}); unigram baseline {b:.4}",
                self.step,
                loss.exp()
            ),
            _ => format!("eval step {}: loss {loss:.4}", self.step),
        };
        if self.show_progress {
            pb.println(line);
        } else {
            println!("{line}");
        }
        self.write_metric(&record)?;
        Ok(())
    }

    /// Run to the end of the schedule (or `train.max_steps`), evaluating, logging and
    /// checkpointing as configured.
    pub fn run(&mut self) -> Result<Summary> {
        let out = self.out_dir();
        if self.is_lead() {
            std::fs::create_dir_all(&out)
                .with_context(|| format!("creating output dir {}", out.display()))?;
            let metrics_path = out.join("metrics.jsonl");
            self.metrics = Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&metrics_path)
                    .with_context(|| format!("opening {}", metrics_path.display()))?,
            );
        }
        let lead = self.is_lead();
        let stop = self
            .cfg
            .train
            .max_steps
            .map_or(self.total_steps, |m| m.min(self.total_steps));
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
        let started = Instant::now();
        let first_step = self.step;
        let (mut window_t, mut window_samples) = (Instant::now(), 0usize);
        let mut last_eval = (None, None);
        let mut last_loss = f32::NAN;
        let mut samples_total = 0usize;
        let compute_start = self.breakdown.clone();
        while self.step < stop {
            let t = Instant::now();
            let batch = self.batch(self.step)?;
            self.breakdown.data_s += t.elapsed().as_secs_f64();
            let lr = self.schedule.lr(self.step);
            let (loss, norm) = self.train_step(&batch)?;
            anyhow::ensure!(
                loss.is_finite(),
                "training diverged at step {}: loss is {loss}",
                self.step
            );
            last_loss = loss;
            let global_samples = self.cfg.train.batch_size;
            window_samples += global_samples;
            samples_total += global_samples;
            pb.inc(1);
            if self.step.is_multiple_of(self.cfg.train.log_every) || self.step == stop {
                let sps = window_samples as f64 / window_t.elapsed().as_secs_f64();
                pb.set_message(format!("loss {loss:.4} | {sps:.0} samples/s"));
                if !self.show_progress && lead {
                    println!(
                        "step {:>6} epoch {:>5.2} loss {loss:.4} lr {lr:.2e} {sps:.0} samples/s",
                        self.step,
                        self.epoch_of(self.step)
                    );
                }
                let rec = TrainRecord {
                    kind: "train",
                    step: self.step,
                    epoch: self.epoch_of(self.step),
                    loss,
                    lr,
                    grad_norm: norm,
                    samples_per_s: sps,
                    elapsed_s: started.elapsed().as_secs_f64(),
                };
                self.write_metric(&rec)?;
                (window_t, window_samples) = (Instant::now(), 0);
            }
            let epoch_end =
                self.steps_per_epoch > 0 && self.step.is_multiple_of(self.steps_per_epoch);
            let eval_due = match self.cfg.train.eval_every {
                Some(e) if e > 0 => self.step.is_multiple_of(e),
                _ => epoch_end,
            };
            if eval_due || self.step == self.total_steps {
                self.eval_and_log(&pb, &mut last_eval)?;
            }
            if let Some(every) = self.cfg.checkpoint.every_steps.filter(|&e| e > 0) {
                if self.step.is_multiple_of(every) {
                    let p = self.checkpoint_path();
                    self.save_checkpoint(&p)?;
                }
            }
        }
        pb.finish_and_clear();
        if self.step > first_step {
            let p = self.checkpoint_path();
            self.save_checkpoint(&p)?;
        }
        if let Some(p) = self.pipeline.as_mut() {
            p.finish_run(&mut self.breakdown)?;
        }
        let bd = &self.breakdown;
        let compute = bd.step_s() - compute_start.step_s();
        let summary = Summary {
            steps: self.step,
            final_train_loss: last_loss,
            test_accuracy: last_eval.1,
            eval_loss: last_eval.0,
            unigram_baseline: match self.task.as_ref() {
                Task::Text { corpus, .. } => Some(unigram_entropy_nats(&corpus.val)),
                _ => None,
            },
            samples_per_s: samples_total as f64 / compute.max(1e-9),
            peak_rss_mb: peak_rss_mb(),
            breakdown: self.breakdown.clone(),
            wall_s: started.elapsed().as_secs_f64(),
        };
        #[derive(Serialize)]
        struct Tagged<'a> {
            kind: &'static str,
            #[serde(flatten)]
            summary: &'a Summary,
        }
        self.write_metric(&Tagged {
            kind: "summary",
            summary: &summary,
        })?;
        Ok(summary)
    }
}

/// The images `idx` of `d` as a batch.
fn image_batch(d: &ImageDataset, idx: &[usize]) -> Result<Batch> {
    let n = idx.len();
    let mut x = vec![0.0f32; n * d.sample_len()];
    let mut y = vec![0u32; n];
    d.batch(idx, &mut x, &mut y)?;
    Ok(Batch {
        x: Tensor::from_vec(x, &[n, d.channels, d.height, d.width]),
        y,
        samples: n,
    })
}

/// Samples `start..start + n` of `batch` (inputs and targets).
fn rows(batch: &Batch, start: usize, n: usize) -> Batch {
    let per_x = batch.x.numel() / batch.samples.max(1);
    let per_y = batch.y.len() / batch.samples.max(1);
    let mut shape = batch.x.shape().to_vec();
    shape[0] = n;
    Batch {
        x: Tensor::from_vec(
            batch.x.data()[start * per_x..(start + n) * per_x].to_vec(),
            &shape,
        ),
        y: batch.y[start * per_y..(start + n) * per_y].to_vec(),
        samples: n,
    }
}

/// A batch of `samples` from flat inputs and targets (what the single master scatters).
fn batch_from_parts(x: Vec<f32>, y: Vec<u32>, samples: usize, task: &Task) -> Batch {
    let shape = match task {
        Task::Images { data } => vec![
            samples,
            data.train.channels,
            data.train.height,
            data.train.width,
        ],
        Task::Text { seq, .. } => vec![samples, *seq],
    };
    Batch {
        x: Tensor::from_vec(x, &shape),
        y,
        samples,
    }
}

/// A batch of `bs` random windows of `seq + 1` bytes from `data`, seeded by `seed`.
fn text_batch(data: &[u8], bs: usize, seq: usize, seed: u64) -> Result<Batch> {
    let mut sampler = TextBatchSampler::new(bs, seq, seed)?;
    let mut inputs = vec![0u32; bs * seq];
    let mut targets = vec![0u32; bs * seq];
    sampler.sample(data, &mut inputs, &mut targets)?;
    Ok(Batch {
        x: Tensor::from_vec(inputs.iter().map(|&v| v as f32).collect(), &[bs, seq]),
        y: targets,
        samples: bs,
    })
}

/// Peak resident memory of this process (Linux `VmHWM`), in MiB.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
