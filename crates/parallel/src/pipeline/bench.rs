//! Pipelined training runs for measurements and equivalence checks: p workers as threads
//! (`ThreadsWorld`), each running a [`Stage`], next to a single-worker reference.
//!
//! Measuring a pipeline's bubble on a 2-core machine needs care: with p = 4 worker threads
//! on 2 cores, real compute runs at half speed whenever more than two workers are busy,
//! and busy workers are exactly what a good schedule produces, so timings would measure the
//! CPU shortage, not the schedule. [`BenchModel::Sleep`] blocks take a fixed time without
//! using a core (they sleep), which gives honestly equal-cost stages for any p. Real models
//! are measured at p = 2 (one core per worker).

use super::partition::profile_block_times;
use crate::engine::{
    Action, MicroBatches, NoHooks, Partition, PipelineError, Schedule, ScheduleKind, SendMode,
    Stage, StepOptions, StepReport,
};
use crate::timeline::{idle_fraction, Category, Span, Timeline};
use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_nn::models::{gpt, resnet, GptConfig};
use meshtrain_nn::optim::{Optimizer, OptimizerConfig};
use meshtrain_nn::{
    Block, CrossEntropy, Layer, Loss, Mode, Model, ParamStore, Params, ParamsMut, Saved,
};
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::{par, Tensor};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A block that only takes time: forward sleeps `forward`, backward sleeps `backward`, and
/// the tensor passes through unchanged (so real messages still cross the pipe).
pub struct SleepBlock {
    pub forward: Duration,
    pub backward: Duration,
}

impl Layer for SleepBlock {
    fn forward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        _: Mode,
        _: &mut Saved,
    ) -> Tensor {
        std::thread::sleep(self.forward);
        x
    }

    fn backward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        _: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        std::thread::sleep(self.backward);
        Some(dy)
    }
}

/// The models measurements run on, each with a deterministic batch per step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BenchModel {
    Gpt(GptConfig),
    /// ResNet-18 of the given width, 10 classes, 1×28×28 images.
    Resnet {
        width: usize,
    },
    /// `blocks` [`SleepBlock`]s on `[batch, 10]` inputs.
    Sleep {
        blocks: usize,
        forward: Duration,
        backward: Duration,
    },
}

impl BenchModel {
    pub fn build(&self) -> Model {
        match *self {
            BenchModel::Gpt(cfg) => gpt::gpt(&cfg),
            BenchModel::Resnet { width } => resnet::resnet18(width, 10),
            BenchModel::Sleep {
                blocks,
                forward,
                backward,
            } => Model::new(
                (0..blocks)
                    .map(|i| Block::new(&format!("sleep{i}"), SleepBlock { forward, backward }))
                    .collect(),
            ),
        }
    }

    pub fn classes(&self) -> usize {
        match self {
            BenchModel::Gpt(cfg) => cfg.vocab,
            BenchModel::Resnet { .. } | BenchModel::Sleep { .. } => 10,
        }
    }

    /// Cross-entropy over the model's classes.
    pub fn loss(&self) -> Arc<dyn Loss> {
        Arc::new(CrossEntropy::new(self.classes()))
    }

    /// Random inputs and targets for `step` (a pure function of `(seed, step)`).
    pub fn batch(&self, batch: usize, seed: u64, step: u64) -> (Tensor, Vec<u32>) {
        let mut rng = SplitMix64::derive(seed, step);
        let classes = self.classes() as u64;
        match self {
            BenchModel::Gpt(cfg) => {
                let n = batch * cfg.seq;
                let x = (0..n).map(|_| rng.below(cfg.vocab as u64) as f32).collect();
                let y = (0..n).map(|_| rng.below(classes) as u32).collect();
                (Tensor::from_vec(x, &[batch, cfg.seq]), y)
            }
            BenchModel::Resnet { .. } | BenchModel::Sleep { .. } => {
                let shape: &[usize] = match self {
                    BenchModel::Resnet { .. } => &[batch, 1, 28, 28],
                    _ => &[batch, 10],
                };
                let x = (0..shape.iter().product()).map(|_| rng.normal()).collect();
                let y = (0..batch).map(|_| rng.below(classes) as u32).collect();
                (Tensor::from_vec(x, shape), y)
            }
        }
    }
}

/// How to cut the model into chunks.
#[derive(Clone, Debug, PartialEq)]
pub enum PartitionChoice {
    Params,
    /// Profile each block's forward + backward on the first batch (single worker, before
    /// the run) and balance the times.
    MeasuredTime,
    Explicit(Vec<usize>),
}

/// One pipelined training run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    pub model: BenchModel,
    pub kind: ScheduleKind,
    pub workers: usize,
    pub micro_batches: usize,
    pub batch: usize,
    pub steps: usize,
    pub recompute: bool,
    pub optimizer: OptimizerConfig,
    pub lr: f32,
    pub seed: u64,
    /// Rayon threads per worker (1 keeps p = 2 on 2 cores honest, and runs bit-reproducible).
    pub threads_per_worker: usize,
    pub partition: PartitionChoice,
    pub sends: SendMode,
}

impl RunConfig {
    fn partition(&self, model: &Model) -> Result<Partition, PipelineError> {
        let chunks = self.workers * self.kind.chunks_per_worker();
        match &self.partition {
            PartitionChoice::Params => Partition::by_params(model, chunks),
            PartitionChoice::Explicit(cuts) => Partition::explicit(model.num_blocks(), cuts),
            PartitionChoice::MeasuredTime => {
                let (x, y) = self
                    .model
                    .batch(self.batch / self.micro_batches, self.seed, 0);
                let store = model.init(self.seed);
                let times = par::pool(self.threads_per_worker).install(|| {
                    profile_block_times(model, &store, &x, &y, self.model.loss().as_ref(), 3)
                })?;
                Partition::balanced(&times, chunks)
            }
        }
    }
}

/// What a pipelined run produced.
#[derive(Clone, Debug)]
pub struct PipelineRun {
    /// The whole model's parameters after the last step, gathered from the stages.
    pub params: ParamStore,
    /// Loss of each step (from the last stage).
    pub losses: Vec<f32>,
    /// `reports[worker][step]`.
    pub reports: Vec<Vec<StepReport>>,
    /// `spans[step]`: every worker's spans of that step (forward, backward, transfers).
    pub spans: Vec<Vec<Span>>,
    pub partition: Partition,
    pub schedule: Schedule,
}

impl PipelineRun {
    /// Idle fraction of each step from `skip` on (the first steps warm caches and
    /// allocators): the window runs from the first compute span's start to the last one's end
    /// over all workers, and idle = 1 − Σ compute / (p × window).
    pub fn idle_fractions(&self, workers: usize, skip: usize) -> Vec<f64> {
        self.spans
            .iter()
            .skip(skip)
            .map(|spans| {
                let compute = spans.iter().filter(|s| s.category.is_compute());
                let (start, end) = compute.clone().fold((f64::MAX, f64::MIN), |(a, b), s| {
                    (a.min(s.start_s), b.max(s.end_s))
                });
                idle_fraction(spans, workers, (start, end))
            })
            .collect()
    }

    /// The median of [`PipelineRun::idle_fractions`] (robust to a step disturbed by other
    /// processes).
    pub fn idle_fraction(&self, workers: usize, skip: usize) -> f64 {
        median(self.idle_fractions(workers, skip))
    }

    /// The idle fraction the schedule would have with this run's measured compute costs
    /// (median forward and backward time of each chunk over steps `skip..`) and free
    /// communication: what stage imbalance alone explains, without scheduling noise.
    pub fn simulated_idle_fraction(&self, skip: usize) -> Result<f64, PipelineError> {
        let mut durations: HashMap<(bool, usize), Vec<f64>> = HashMap::new();
        for spans in self.spans.iter().skip(skip) {
            for (w, program) in self.schedule.actions.iter().enumerate() {
                // A worker's compute spans come in the order of its compute actions.
                let computes = program
                    .iter()
                    .filter(|a| matches!(a, Action::Forward { .. } | Action::Backward { .. }));
                let mine = spans.iter().filter(|s| {
                    s.worker == w && matches!(s.category, Category::Forward | Category::Backward)
                });
                for (a, s) in computes.zip(mine) {
                    let key = (matches!(a, Action::Forward { .. }), a.chunk());
                    durations.entry(key).or_default().push(s.duration_s());
                }
            }
        }
        let cost: HashMap<(bool, usize), f64> =
            durations.into_iter().map(|(k, v)| (k, median(v))).collect();
        let sim = self.schedule.simulate(&|a| {
            let key = (matches!(a, Action::Forward { .. }), a.chunk());
            cost.get(&key).copied().unwrap_or(0.0)
        })?;
        Ok(sim.idle_fraction())
    }

    /// Largest activation memory each worker held in any step.
    pub fn peak_activation_bytes(&self) -> Vec<usize> {
        let peak = |r: &Vec<StepReport>| r.iter().map(|s| s.peak_activation_bytes).max();
        self.reports.iter().map(|r| peak(r).unwrap_or(0)).collect()
    }

    /// Median over steps `skip..` of the slowest worker's step time.
    pub fn step_seconds(&self, skip: usize) -> f64 {
        self.median_over_steps(skip, |r| r.iter().map(|s| s.wall_s).fold(0.0, f64::max))
    }

    /// Median over steps `skip..` of `f` applied to all workers' reports of a step.
    pub fn median_over_steps(&self, skip: usize, f: impl Fn(&[&StepReport]) -> f64) -> f64 {
        let steps = self.reports.first().map_or(0, Vec::len);
        median(
            (skip..steps)
                .map(|s| f(&self.reports.iter().map(|r| &r[s]).collect::<Vec<_>>()))
                .collect(),
        )
    }
}

/// Runs `cfg.steps` pipelined training steps with `cfg.workers` threads.
pub fn run_pipeline(cfg: &RunConfig) -> Result<PipelineRun, PipelineError> {
    let model = cfg.model.build();
    let schedule = Schedule::new(cfg.kind, cfg.workers, cfg.micro_batches)?;
    let partition = cfg.partition(&model)?;
    // Fail on the layout and the batch split here, before threads start.
    Stage::new(&model, &partition, schedule.clone(), 0, cfg.seed)?;
    let (x, y) = cfg.model.batch(cfg.batch, cfg.seed, 0);
    MicroBatches::split(&x, &y, cfg.micro_batches)?;
    let origin = Instant::now();
    let (worker_cfg, worker_partition) = (cfg.clone(), partition.clone());
    let worker_schedule = schedule.clone();
    let results = ThreadsWorld::run(cfg.workers, CommConfig::default(), move |group| {
        let cfg = &worker_cfg;
        let model = cfg.model.build();
        let rank = group.rank();
        let mut stage = Stage::new(
            &model,
            &worker_partition,
            worker_schedule.clone(),
            rank,
            cfg.seed,
        )?;
        let mut optimizers = stage.optimizers(cfg.optimizer);
        let options = StepOptions {
            loss: cfg.model.loss(),
            recompute: cfg.recompute,
            sends: cfg.sends,
        };
        let mut timeline = Timeline::new(rank, origin);
        let (mut reports, mut spans) = (Vec::new(), Vec::new());
        par::pool(cfg.threads_per_worker).install(|| {
            for step in 0..cfg.steps {
                let (x, y) = cfg.model.batch(cfg.batch, cfg.seed, step as u64);
                let micro = MicroBatches::split(&x, &y, cfg.micro_batches)?;
                group.barrier()?;
                timeline.clear();
                let report = stage.run_step(
                    &model,
                    group.as_ref(),
                    micro,
                    &options,
                    Some(&mut timeline),
                    &mut NoHooks,
                )?;
                stage.optimizer_step(&mut optimizers, cfg.lr, Some(&mut timeline));
                reports.push(report);
                spans.push(timeline.spans().to_vec());
            }
            Ok::<_, PipelineError>(())
        })?;
        Ok::<_, PipelineError>((stage, reports, spans))
    })
    .map_err(|e| PipelineError::Workers(e.to_string()))?;

    let mut params = model.init(cfg.seed);
    let (mut losses, mut reports) = (Vec::new(), Vec::new());
    let mut spans = vec![Vec::new(); cfg.steps];
    for (stage, worker_reports, worker_spans) in results {
        stage.copy_into(&model, &mut params);
        if let Some(l) = worker_reports
            .iter()
            .map(|r| r.loss)
            .collect::<Option<Vec<f32>>>()
        {
            losses = l;
        }
        reports.push(worker_reports);
        for (all, mine) in spans.iter_mut().zip(worker_spans) {
            all.extend(
                mine.into_iter()
                    .filter(|s| s.category != Category::Optimizer),
            );
        }
    }
    Ok(PipelineRun {
        params,
        losses,
        reports,
        spans,
        partition,
        schedule,
    })
}

/// The single-worker run on the same batches. With `micro_batches > 1` it accumulates
/// gradients over the same micro-batches as the pipeline (the fair reference when batch norm
/// makes statistics per micro-batch); with 1 it takes the full batch at once.
pub fn run_reference(
    cfg: &RunConfig,
    micro_batches: usize,
) -> Result<(ParamStore, Vec<f32>), PipelineError> {
    let model = cfg.model.build();
    let mut store = model.init(cfg.seed);
    let mut optimizer = Optimizer::new(cfg.optimizer, store.values.len());
    let loss_fn = cfg.model.loss();
    let mut losses = Vec::with_capacity(cfg.steps);
    par::pool(cfg.threads_per_worker).install(|| {
        for step in 0..cfg.steps {
            let (x, y) = cfg.model.batch(cfg.batch, cfg.seed, step as u64);
            let micro = MicroBatches::split(&x, &y, micro_batches)?;
            let mut loss = 0.0f64;
            for (x, y) in micro.inputs.into_iter().zip(&micro.targets) {
                let blocks = 0..model.num_blocks();
                let recompute = cfg.recompute;
                let (logits, acts) =
                    model.forward(&mut store, x, blocks, Mode::TRAIN, &|_| recompute);
                let scale = 1.0 / micro_batches as f32;
                let (l, dy) = loss_fn.forward_backward(&logits, y, scale)?;
                loss += l.mean as f64;
                model.backward(&mut store, acts, dy, false, &mut |_, _| {});
            }
            optimizer.step(&mut store.values, &store.grads, cfg.lr);
            store.zero_grads();
            losses.push((loss / micro_batches as f64) as f32);
        }
        Ok::<_, PipelineError>(())
    })?;
    Ok((store, losses))
}

/// The median (upper middle for an even count; 0 for none).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Largest absolute difference between two stores' parameters and buffers.
pub fn max_abs_diff(a: &ParamStore, b: &ParamStore) -> f32 {
    let diff = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0f32, f32::max)
    };
    diff(&a.values, &b.values).max(diff(&a.buffers, &b.buffers))
}
