//! Cutting a model's block list into contiguous chunks (stages).
//!
//! The slowest stage sets the pipeline's pace, so a partition minimises the largest chunk
//! cost. Cost can be the parameter count (cheap, but convolutions at high resolution cost far
//! more time per parameter than a classifier), a measured time per block
//! ([`profile_block_times`]), or the user's explicit cut points.

use crate::engine::{Partition, PipelineError, Schedule, Stage, StageStores};
use meshtrain_comm::ProcessGroup;
use meshtrain_nn::{Loss, Mode, Model, ParamStore};
use meshtrain_tensor::Tensor;
use std::str::FromStr;
use std::time::Instant;

/// How a model's blocks are cut into stages (`parallel.partition`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PartitionSpec {
    /// Equal parameter counts (cheap; ignores that compute per parameter varies).
    #[default]
    Params,
    /// Equal numbers of blocks.
    Balanced,
    /// Equal measured forward + backward time per stage (rank 0 profiles, all agree).
    Time,
    /// Cut before these block indices.
    Explicit(Vec<usize>),
}

impl FromStr for PartitionSpec {
    type Err = PipelineError;

    /// `params`, `balanced`, `time` or `explicit:3,6`.
    fn from_str(s: &str) -> Result<Self, PipelineError> {
        let bad = |reason: &str| PipelineError::BadPartitionSpec {
            spec: s.to_string(),
            reason: reason.to_string(),
        };
        Ok(match s {
            "params" => PartitionSpec::Params,
            "balanced" => PartitionSpec::Balanced,
            "time" => PartitionSpec::Time,
            _ => match s.strip_prefix("explicit:") {
                Some(cuts) => PartitionSpec::Explicit(
                    cuts.split(',')
                        .map(|c| c.trim().parse::<usize>())
                        .collect::<Result<_, _>>()
                        .map_err(|_| bad("cuts must be block indices, e.g. explicit:3,6"))?,
                ),
                None => {
                    return Err(bad(
                        "expected params, balanced, time or explicit:CUT,CUT,...",
                    ))
                }
            },
        })
    }
}

impl PartitionSpec {
    /// Checks the spec against a model of `blocks` blocks cut into `chunks` chunks, each
    /// block spread over `spread` workers (tensor × context parallelism), before any work.
    pub fn check(&self, blocks: usize, chunks: usize, spread: usize) -> Result<(), PipelineError> {
        if *self == PartitionSpec::Time && spread > 1 && chunks > 1 {
            return Err(PipelineError::BadPartitionSpec {
                spec: "time".into(),
                reason: "it profiles the blocks on one worker, which tensor and context \
                         parallelism do not allow (their layers talk to their group): use \
                         params, balanced or explicit cuts with tp or cp > 1"
                    .into(),
            });
        }
        if let PartitionSpec::Explicit(cuts) = self {
            if cuts.len() + 1 != chunks {
                return Err(PipelineError::BadPartitionSpec {
                    spec: format!("explicit:{cuts:?}"),
                    reason: format!(
                        "makes {} stages, the layout needs {chunks} (pp × chunks per worker)",
                        cuts.len() + 1
                    ),
                });
            }
            Partition::explicit(blocks, cuts)?;
        }
        Ok(())
    }
}

/// What measured-time cuts profile: one micro-batch (`sample`) and its `loss`, on rank 0
/// of `world`, which shares its times so every replica cuts the same way.
pub struct TimeProbe<'a> {
    pub world: &'a dyn ProcessGroup,
    pub sample: Option<(&'a Tensor, &'a [u32])>,
    pub loss: &'a dyn Loss,
}

/// The pipeline transform, first in the apply order: cuts `model` into the schedule's chunks
/// and gives pipeline worker `rank` its [`Stage`] with freshly initialised parameters (the
/// values `model.init(seed)` gives those blocks). With one worker and one chunk the stage is
/// the whole model.
pub fn split(
    model: &Model,
    schedule: Schedule,
    spec: &PartitionSpec,
    rank: usize,
    seed: u64,
    probe: TimeProbe<'_>,
    stores: StageStores,
) -> Result<(Partition, Stage), PipelineError> {
    let partition = partition_for(model, &schedule, spec, probe)?;
    let stage = Stage::new_with(model, &partition, schedule, rank, seed, stores)?;
    Ok((partition, stage))
}

/// The cut of `model` into `schedule`'s chunks by `spec` (the first half of [`split`]: what
/// each worker will hold, known before anything is allocated).
pub fn partition_for(
    model: &Model,
    schedule: &Schedule,
    spec: &PartitionSpec,
    probe: TimeProbe<'_>,
) -> Result<Partition, PipelineError> {
    let (blocks, chunks) = (model.num_blocks(), schedule.num_chunks());
    let partition = match spec {
        _ if chunks == 1 => Partition::explicit(blocks, &[])?,
        PartitionSpec::Params => Partition::by_params(model, chunks)?,
        PartitionSpec::Balanced => Partition::balanced(&vec![1.0; blocks], chunks)?,
        PartitionSpec::Explicit(cuts) => Partition::explicit(blocks, cuts)?,
        PartitionSpec::Time => {
            let sample = probe
                .sample
                .ok_or_else(|| PipelineError::BadPartitionSpec {
                    spec: "time".into(),
                    reason: "needs a sample micro-batch to profile".into(),
                })?;
            Partition::by_measured_time(probe.world, model, sample, probe.loss, chunks)?
        }
    };
    Ok(partition)
}

/// The pipeline's ways of choosing a [`Partition`] from a model.
impl Partition {
    /// Balanced by parameter count (each block costs at least 1, so parameter-free blocks
    /// still spread out).
    pub fn by_params(model: &Model, parts: usize) -> Result<Partition, PipelineError> {
        let costs: Vec<f64> = (0..model.num_blocks())
            .map(|i| model.block_param_range(i).len().max(1) as f64)
            .collect();
        Partition::balanced(&costs, parts)
    }

    /// Balanced by measured time, identical on every worker: rank 0 of `group` profiles the
    /// blocks on `sample` (see [`profile_block_times`]) and broadcasts the times, because
    /// independent timings differ and workers must agree on the cut.
    pub fn by_measured_time(
        group: &dyn ProcessGroup,
        model: &Model,
        sample: (&Tensor, &[u32]),
        loss: &dyn Loss,
        parts: usize,
    ) -> Result<Partition, PipelineError> {
        let mut times = vec![0.0f32; model.num_blocks()];
        if group.rank() == 0 {
            let store = model.init(0);
            let measured = profile_block_times(model, &store, sample.0, sample.1, loss, 3)?;
            times
                .iter_mut()
                .zip(measured)
                .for_each(|(t, m)| *t = m as f32);
        }
        group.broadcast((&mut times).into(), 0)?;
        let costs: Vec<f64> = times.iter().map(|&t| t as f64).collect();
        Partition::balanced(&costs, parts)
    }
}

/// Seconds each block takes for forward plus backward on one sample batch (the fastest of
/// `repeats` runs, which is the least disturbed by other processes). Works on a copy of
/// `store`, so running statistics and gradients of the caller are untouched.
pub fn profile_block_times(
    model: &Model,
    store: &ParamStore,
    x: &Tensor,
    y: &[u32],
    loss: &dyn Loss,
    repeats: usize,
) -> Result<Vec<f64>, PipelineError> {
    let n = model.num_blocks();
    let mut store = store.clone();
    let mut best = vec![f64::INFINITY; n];
    for _ in 0..repeats.max(1) {
        let mut times = vec![0.0; n];
        let mut acts = Vec::with_capacity(n);
        let mut h = x.clone();
        for (i, t) in times.iter_mut().enumerate() {
            let start = Instant::now();
            let (out, a) = model.forward(&mut store, h, i..i + 1, Mode::TRAIN, &|_| false);
            *t += start.elapsed().as_secs_f64();
            acts.push(a);
            h = out;
        }
        let (_, mut grad) = loss.forward_backward(&h, y, 1.0)?;
        for (i, a) in acts.into_iter().enumerate().rev() {
            let start = Instant::now();
            let dx = model.backward(&mut store, a, grad, i > 0, &mut |_, _| {});
            times[i] += start.elapsed().as_secs_f64();
            match dx {
                Some(dx) => grad = dx,
                None => break,
            }
        }
        best.iter_mut().zip(times).for_each(|(b, t)| *b = b.min(t));
    }
    Ok(best)
}
