//! Optimizers over flat slices, with PyTorch's update rules, so a data-parallel replica updates
//! its whole buffer and a ZeRO shard updates just its slice with the same code.
//!
//! Parameter groups (PyTorch's `param_groups`): [`ParamGroups`] assigns each named parameter a
//! weight decay and a learning-rate scale (typically no weight decay on biases and norms);
//! [`ParamGroups::resolve`] turns that into [`Segment`]s of the flat buffer, and an optimizer
//! over any slice (a pipeline chunk, a shard) takes the segments that fall inside it.

use crate::model::{Model, ParamEntry};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD(momentum, weight_decay)`, no Nesterov.
    Sgd { momentum: f32, weight_decay: f32 },
    /// `torch.optim.AdamW`.
    Adamw {
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
}

impl OptimizerConfig {
    /// The configured weight decay (the default group's).
    pub fn weight_decay(&self) -> f32 {
        match *self {
            OptimizerConfig::Sgd { weight_decay, .. }
            | OptimizerConfig::Adamw { weight_decay, .. } => weight_decay,
        }
    }
}

/// What a parameter group changes: its weight decay and a factor on the learning rate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupHyper {
    pub weight_decay: f32,
    pub lr_scale: f32,
}

/// A contiguous range of an optimizer's slice whose parameters share one group's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    pub range: Range<usize>,
    pub hyper: GroupHyper,
}

/// The segments as the CUDA optimizer kernels' segment table reads them (one row per
/// segment: where it ends, its weight decay and learning-rate scale).
#[cfg(feature = "cuda")]
pub fn segment_rows(segments: &[Segment]) -> Vec<meshtrain_tensor::cuda::train_ops::SegmentRow> {
    segments
        .iter()
        .map(|s| meshtrain_tensor::cuda::train_ops::SegmentRow {
            end: s.range.end,
            weight_decay: s.hyper.weight_decay,
            lr_scale: s.hyper.lr_scale,
        })
        .collect()
}

/// The segments of `whole` (covering a whole model's buffer) that fall inside `range`,
/// shifted so `range.start` is 0: an optimizer over a pipeline chunk or a shard.
pub fn segments_within(whole: &[Segment], range: Range<usize>) -> Vec<Segment> {
    whole
        .iter()
        .filter_map(|s| {
            let (start, end) = (s.range.start.max(range.start), s.range.end.min(range.end));
            (start < end).then(|| Segment {
                range: start - range.start..end - range.start,
                hyper: s.hyper,
            })
        })
        .collect()
}

/// Which parameters a group takes.
#[derive(Clone)]
pub enum Selector {
    /// Full parameter names with `*` wildcards (`*.bias`, `*ln*`, `blocks.0.*`), or
    /// `ndim<N` / `ndim>=N` on the parameter's number of dimensions (nanoGPT decays exactly
    /// the parameters with `ndim>=2`).
    Patterns(Vec<String>),
    /// Any rule over the parameter's name and shape.
    Predicate(Arc<dyn Fn(&ParamEntry) -> bool + Send + Sync>),
}

impl std::fmt::Debug for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selector::Patterns(p) => write!(f, "{p:?}"),
            Selector::Predicate(_) => write!(f, "<predicate>"),
        }
    }
}

impl Selector {
    /// Checks pattern syntax (so a typo fails before training).
    pub fn validate(&self) -> Result<(), String> {
        if let Selector::Patterns(patterns) = self {
            for p in patterns {
                if p.is_empty() {
                    return Err("an empty parameter pattern".into());
                }
                if let Some(rest) = p.strip_prefix("ndim") {
                    if ndim_test(rest).is_none() {
                        return Err(format!("parameter pattern '{p}': write ndim<N or ndim>=N"));
                    }
                }
            }
        }
        Ok(())
    }

    pub fn matches(&self, entry: &ParamEntry) -> bool {
        match self {
            Selector::Predicate(f) => f(entry),
            Selector::Patterns(patterns) => patterns.iter().any(|p| match p.strip_prefix("ndim") {
                Some(rest) => ndim_test(rest).is_some_and(|test| test(entry.shape.len())),
                None => glob(p, &entry.name),
            }),
        }
    }
}

/// `<N` or `>=N` as a test on a dimension count.
fn ndim_test(rest: &str) -> Option<impl Fn(usize) -> bool> {
    let (less, n) = match rest.strip_prefix(">=") {
        Some(n) => (false, n),
        None => (true, rest.strip_prefix('<')?),
    };
    let n: usize = n.trim().parse().ok()?;
    Some(move |d: usize| if less { d < n } else { d >= n })
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters.
pub fn glob(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// One parameter group: the parameters it selects and what it changes (unset: the
/// optimizer's own weight decay, the schedule's learning rate).
#[derive(Clone, Debug)]
pub struct ParamGroup {
    pub select: Selector,
    pub weight_decay: Option<f32>,
    pub lr_scale: f32,
}

/// Parameter groups; a parameter belongs to the first group that selects it, or to the
/// default group. A tied copy always belongs to its primary's group (the copies must get
/// the same updates to stay equal).
#[derive(Clone, Debug, Default)]
pub struct ParamGroups {
    pub groups: Vec<ParamGroup>,
}

impl ParamGroups {
    /// No weight decay on parameters with fewer than two dimensions (biases, norm scales and
    /// shifts), PyTorch users' usual first group.
    pub fn no_decay_on_vectors() -> Self {
        ParamGroups {
            groups: vec![ParamGroup {
                select: Selector::Patterns(vec!["ndim<2".into()]),
                weight_decay: Some(0.0),
                lr_scale: 1.0,
            }],
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        for g in &self.groups {
            g.select.validate()?;
            if !(g.lr_scale.is_finite() && g.lr_scale >= 0.0) {
                return Err(format!(
                    "parameter group {:?}: lr_scale must be ≥ 0",
                    g.select
                ));
            }
            if g.weight_decay.is_some_and(|w| !(w.is_finite() && w >= 0.0)) {
                return Err(format!(
                    "parameter group {:?}: weight_decay must be ≥ 0",
                    g.select
                ));
            }
        }
        Ok(())
    }

    /// Each parameter's settings over `model`'s whole buffer, neighbours with equal settings
    /// merged (so no groups at all is one segment, and updates stay as vectorised as before).
    pub fn resolve(&self, model: &Model, config: &OptimizerConfig) -> Vec<Segment> {
        let hyper_of = |e: &ParamEntry| {
            self.groups.iter().find(|g| g.select.matches(e)).map_or(
                GroupHyper {
                    weight_decay: config.weight_decay(),
                    lr_scale: 1.0,
                },
                |g| GroupHyper {
                    weight_decay: g.weight_decay.unwrap_or(config.weight_decay()),
                    lr_scale: g.lr_scale,
                },
            )
        };
        let params = model.params();
        let mut segments: Vec<Segment> = Vec::new();
        for (i, e) in params.iter().enumerate() {
            let owner = &params[model.tied_primary(i).unwrap_or(i)];
            let hyper = hyper_of(owner);
            match segments.last_mut() {
                Some(s) if s.hyper == hyper && s.range.end == e.range.start => {
                    s.range.end = e.range.end
                }
                _ => segments.push(Segment {
                    range: e.range.clone(),
                    hyper,
                }),
            }
        }
        segments
    }

    /// How many parameters (elements) each group got, for the run's start line: (label,
    /// elements) with the default group last.
    pub fn summary(&self, model: &Model) -> Vec<(String, usize)> {
        let mut counts = vec![0usize; self.groups.len() + 1];
        let params = model.params();
        for (i, e) in params.iter().enumerate() {
            let owner = &params[model.tied_primary(i).unwrap_or(i)];
            let g = self
                .groups
                .iter()
                .position(|g| g.select.matches(owner))
                .unwrap_or(self.groups.len());
            counts[g] += e.range.len();
        }
        let mut labels: Vec<String> = self
            .groups
            .iter()
            .map(|g| format!("{:?}", g.select))
            .collect();
        labels.push("default".into());
        labels.into_iter().zip(counts).collect()
    }
}

/// Optimizer state for one contiguous slice of parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Optimizer {
    pub config: OptimizerConfig,
    /// Momentum buffer (SGD) or first moment (AdamW).
    pub m: Vec<f32>,
    /// Second moment (AdamW only; empty for SGD).
    pub v: Vec<f32>,
    pub step: u64,
    /// The parameter groups' settings over this slice, in order, covering it.
    segments: Vec<Segment>,
    /// Where each part of the state sits in the parameters and gradients it updates
    /// ([`Optimizer::scattered`]); `None`: state element `k` is element `k` of both.
    pieces: Option<Vec<StatePiece>>,
}

/// A run of optimizer state and the parameters and gradients it belongs to: state `state`
/// updates `params[values..]` from `grads[grads..]` (same length). A ZeRO shard's state is
/// the concatenation of its pieces of every parameter, while the parameters it updates lie
/// scattered in the full buffer (stages 1 and 2) and its gradients in the full buffer
/// (stage 1) or in the shard (stage 2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatePiece {
    pub state: Range<usize>,
    pub values: usize,
    pub grads: usize,
}

impl Optimizer {
    /// One group: the configured weight decay everywhere.
    pub fn new(config: OptimizerConfig, len: usize) -> Self {
        let hyper = GroupHyper {
            weight_decay: config.weight_decay(),
            lr_scale: 1.0,
        };
        Self::with_segments(
            config,
            len,
            vec![Segment {
                range: 0..len,
                hyper,
            }],
        )
    }

    /// An optimizer whose parameter groups are `segments` (from [`ParamGroups::resolve`]
    /// and [`segments_within`]); they must cover `0..len` in order.
    pub fn with_segments(config: OptimizerConfig, len: usize, segments: Vec<Segment>) -> Self {
        assert_tiles(segments.iter().map(|s| &s.range), len, "optimizer segments");
        let v_len = match config {
            OptimizerConfig::Sgd { .. } => 0,
            OptimizerConfig::Adamw { .. } => len,
        };
        Optimizer {
            config,
            m: vec![0.0; len],
            v: vec![0.0; v_len],
            step: 0,
            segments,
            pieces: None,
        }
    }

    /// The same optimizer updating scattered elements: `pieces` cover the state in order
    /// (see [`StatePiece`]).
    pub fn scattered(mut self, pieces: Vec<StatePiece>) -> Self {
        assert_tiles(
            pieces.iter().map(|p| &p.state),
            self.m.len(),
            "state pieces",
        );
        self.pieces = Some(pieces);
        self
    }

    /// Whether the rule keeps a second moment (AdamW's `v`), whatever this optimizer's
    /// slice holds (a ZeRO rank may own no elements at all).
    pub fn has_second_moment(&self) -> bool {
        matches!(self.config, OptimizerConfig::Adamw { .. })
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Where the state's parts sit in the parameters and gradients, when scattered
    /// ([`Optimizer::scattered`]); `None`: element `k` of the state is element `k` of both.
    pub fn pieces(&self) -> Option<&[StatePiece]> {
        self.pieces.as_deref()
    }

    /// Bytes of optimizer state (for memory reports).
    pub fn state_bytes(&self) -> usize {
        (self.m.len() + self.v.len()) * 4
    }

    /// One update of `params` from `grads` at learning rate `lr` (times each group's scale).
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) {
        let whole = [StatePiece {
            state: 0..self.m.len(),
            values: 0,
            grads: 0,
        }];
        let pieces: &[StatePiece] = match &self.pieces {
            Some(p) => p,
            None => {
                assert_eq!(params.len(), grads.len());
                assert_eq!(
                    params.len(),
                    self.m.len(),
                    "optimizer state sized for another slice"
                );
                &whole
            }
        };
        self.step += 1;
        // Pieces and segments both tile the state in order: one walk through the segments.
        let mut first = 0;
        for piece in pieces.iter().filter(|p| !p.state.is_empty()) {
            while self.segments[first].range.end <= piece.state.start {
                first += 1;
            }
            for s in self.segments[first..]
                .iter()
                .take_while(|s| s.range.start < piece.state.end)
            {
                let (start, end) = (
                    s.range.start.max(piece.state.start),
                    s.range.end.min(piece.state.end),
                );
                let r = start..end;
                let shift =
                    |at: usize| at + start - piece.state.start..at + end - piece.state.start;
                let v = if self.v.is_empty() {
                    &mut self.v[..]
                } else {
                    &mut self.v[r.clone()]
                };
                let rule = Rule {
                    config: self.config,
                    step: self.step,
                    hyper: s.hyper,
                    lr: lr * s.hyper.lr_scale,
                };
                update(
                    rule,
                    &mut params[shift(piece.values)],
                    &grads[shift(piece.grads)],
                    &mut self.m[r],
                    v,
                );
            }
        }
    }
}

/// `ranges` cover `0..len` in order, each starting where the previous ended.
fn assert_tiles<'a>(ranges: impl Iterator<Item = &'a Range<usize>>, len: usize, what: &str) {
    let mut at = 0;
    for r in ranges {
        assert_eq!(r.start, at, "{what} must cover the slice in order");
        at = r.end;
    }
    assert_eq!(at, len, "{what} must cover the slice");
}

/// One segment's update settings: the rule, the step count, the group's settings and the
/// learning rate (already scaled by the group).
#[derive(Clone, Copy)]
struct Rule {
    config: OptimizerConfig,
    step: u64,
    hyper: GroupHyper,
    lr: f32,
}

/// The update rule on one segment (`v` is empty for SGD), spread over the pool's threads in
/// contiguous pieces when it is large. Every element's update depends on that element
/// alone, so the result does not depend on the split (the step was single-threaded before:
/// a tenth of a wide GPT's step on one worker).
fn update(rule: Rule, params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32]) {
    use meshtrain_tensor::par::{chunk_len, threads, PARALLEL_MIN_LEN};
    use rayon::prelude::*;
    let n = params.len();
    let chunk = chunk_len(n, PARALLEL_MIN_LEN);
    if threads() == 1 || n <= chunk {
        return update_serial(rule, params, grads, m, v);
    }
    let pieces = params
        .par_chunks_mut(chunk)
        .zip(grads.par_chunks(chunk))
        .zip(m.par_chunks_mut(chunk));
    if v.is_empty() {
        pieces.for_each(|((p, g), m)| update_serial(rule, p, g, m, &mut []));
    } else {
        pieces
            .zip(v.par_chunks_mut(chunk))
            .for_each(|(((p, g), m), v)| update_serial(rule, p, g, m, v));
    }
}

fn update_serial(rule: Rule, params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32]) {
    let Rule {
        config,
        step,
        hyper,
        lr,
    } = rule;
    let weight_decay = hyper.weight_decay;
    match config {
        OptimizerConfig::Sgd { momentum, .. } => {
            let first = step == 1;
            for ((p, &g), m) in params.iter_mut().zip(grads).zip(m) {
                let g = g + weight_decay * *p;
                *m = if first || momentum == 0.0 {
                    g
                } else {
                    momentum * *m + g
                };
                *p -= lr * *m;
            }
        }
        OptimizerConfig::Adamw {
            beta1, beta2, eps, ..
        } => {
            let t = step as i32;
            let c1 = 1.0 - beta1.powi(t);
            let c2 = 1.0 - beta2.powi(t);
            let decay = 1.0 - lr * weight_decay;
            // PyTorch's arrangement: one square root and one division per element, with
            // the bias corrections folded into two scalars.
            let step_size = lr / c1;
            let inv_sqrt_c2 = 1.0 / c2.sqrt();
            for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(m).zip(v) {
                *p *= decay;
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                let denom = v.sqrt() * inv_sqrt_c2 + eps;
                *p -= step_size * *m / denom;
            }
        }
    }
}

/// Global L2 norm of the gradients (f64 accumulation).
pub fn grad_norm(grads: &[f32]) -> f32 {
    sum_of_squares(grads).sqrt() as f32
}

/// `Σ g²` in f64, with eight independent partial sums: one running sum is a serial chain of
/// dependent adds that LLVM may not reorder (~4 ms per step for GPT's 3.3M gradients).
pub fn sum_of_squares(grads: &[f32]) -> f64 {
    let square = |g: f32| (g as f64) * (g as f64);
    let mut lanes = [0.0f64; 8];
    let chunks = grads.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&g| square(g)).sum();
    for c in chunks {
        for i in 0..8 {
            lanes[i] += square(c[i]);
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// Scale gradients so their global norm is at most `max_norm`; returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> f32 {
    let norm = grad_norm(grads);
    if norm > max_norm && norm > 0.0 {
        let k = max_norm / (norm + 1e-6);
        grads.iter_mut().for_each(|g| *g *= k);
    }
    norm
}
