//! Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism
//! (Korthikanti et al. 2022).
//!
//! [`parallelize`] rewrites a model's layers by its [`TensorPlan`]: column-parallel linears
//! split their output features, row-parallel linears their input features, the attention core
//! its heads, a GPT embedding and output head the vocabulary. Every other layer is replicated.
//! Communication is the two conjugate operators, as plain functions over a `ProcessGroup`:
//!
//! * `f` before a column-parallel product: identity forward, all-reduce of the input gradient
//!   backward ([`ColumnParallel`]);
//! * `g` after a row-parallel product: all-reduce forward, identity backward
//!   ([`RowParallel`]).
//!
//! With sequence parallelism the regions between them (layer norms, residuals, dropout) hold
//! only this rank's share of the tokens: `f` becomes all-gather forward / reduce-scatter
//! backward and `g` reduce-scatter forward / all-gather backward, the same bytes as the
//! all-reduces. Tokens are split as contiguous rows of the `[batch·seq, hidden]` activations
//! (Megatron's `[seq, batch, hidden]` layout makes its sequence shards contiguous; ours is
//! `[batch, seq, hidden]`, so token shards are — the same memory and communication).
//! Replicated parameters then see only their rank's tokens, so their gradients are summed over
//! the tensor-parallel group ([`TpGradSync`]); forgetting that trains silently wrong.
//!
//! In backward a column-parallel layer starts its input gradient's all-reduce (or
//! reduce-scatter) on the communication thread and computes its weight gradient meanwhile.
//!
//! Checkpoints stay whole: every sharded parameter carries a [`ShardSpec`] (which part of the
//! whole tensor it is), and the trainer gathers and splits by it.

use crate::engine::flat::{Apply, CopyPlan, FlatBuf, FlatMemory, Run};
use crate::engine::{tensor_like, tensor_view, StageChunk};
use meshtrain_comm::{
    BufMut, BufRef, CommError, HostPlacement, MeshAxis, MeshLayout, ProcessGroup, ReduceOp, Work,
};
use meshtrain_nn::layers::{AmaxAgreement, Linear};
use meshtrain_nn::loss::{LossError, LossValue};
use meshtrain_nn::models::gpt;
use meshtrain_nn::transformer::{AttentionCore, GptEmbedding, QkNorm, Rotary, SequenceShard};
use meshtrain_nn::{
    Deal, Kept, Layer, Loss, Mode, Model, ParamSpec, Params, ParamsMut, Saved, ShardSpec, TpStyle,
};
use meshtrain_tensor::activation::fast_exp;
use meshtrain_tensor::par::take_buffer;
use meshtrain_tensor::{DType, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// `n`'s divisors above 1, for messages ("2, 4, 8").
/// The tp values a grouped-query attention of `kv_heads` key/value heads for `heads` query
/// heads can take: divisors of `kv_heads`, and multiples of it that divide `heads`.
fn kv_tp_choices(kv_heads: usize, heads: usize) -> String {
    (1..=heads)
        .filter(|&tp| kv_heads_fit(tp, kv_heads, heads))
        .map(|tp| tp.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether tp ranks can share `kv_heads` key/value heads: whole groups each, or each group
/// replicated over `tp / kv_heads` ranks that split its query heads.
fn kv_heads_fit(tp: usize, kv_heads: usize, heads: usize) -> bool {
    kv_heads.is_multiple_of(tp) || (tp.is_multiple_of(kv_heads) && heads.is_multiple_of(tp))
}

fn divisors(n: usize) -> String {
    let all: Vec<String> = (2..=n)
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect();
    if all.is_empty() {
        "none above 1".into()
    } else {
        all.join(", ")
    }
}

/// Why a model cannot be split as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    #[error("tp={tp}: the model has no tensor-parallel plan (Model::with_tensor_plan)")]
    NoPlan { tp: usize },
    #[error("tp={tp}: {what} is {n}, not divisible by tp")]
    NotDivisible { tp: usize, what: String, n: usize },
    #[error(
        "tp={tp}: '{path}' has {heads} attention heads, not divisible by tp (each \
         tensor-parallel worker computes whole heads): choose tp among {}",
        divisors(*heads)
    )]
    Heads {
        tp: usize,
        path: String,
        heads: usize,
    },
    #[error(
        "tp={tp}: '{path}' has {kv_heads} key/value heads for {heads} query heads: each \
         tensor-parallel worker holds whole key/value groups, or, on a multiple of kv_heads \
         workers, replicas of one group's key/value head; choose tp among {}",
        kv_tp_choices(*kv_heads, *heads)
    )]
    KvHeads {
        tp: usize,
        path: String,
        kv_heads: usize,
        heads: usize,
    },
    #[error("tp={tp}: '{path}' is split {style:?}, but {reason}")]
    Unsupported {
        tp: usize,
        path: String,
        style: TpStyle,
        reason: String,
    },
    #[error("sequence parallelism needs the tokens per sample (the model's declared input)")]
    NoSequence,
    #[error(
        "tp={tp} must stay inside a host (tensor parallelism exchanges activations in every \
         layer), but the hosts hold {per_host} ranks and the tensor-parallel group of ranks \
         {ranks} spans {hosts} of them: use a tp that divides the ranks per host"
    )]
    AcrossHosts {
        tp: usize,
        /// Ranks per host, e.g. `2` or `2, 2, 1` when uneven.
        per_host: String,
        ranks: String,
        hosts: usize,
    },
}

/// Checks that every tensor-parallel group of the mesh `layout` (over `world_ranks`, the
/// world ranks of the mesh's ranks) lies on one host of `hosts`. The mesh puts tp innermost,
/// so with hosts of consecutive ranks this holds exactly when tp divides the ranks per host.
pub fn check_within_hosts(
    layout: &MeshLayout,
    world_ranks: &[usize],
    hosts: &HostPlacement,
) -> Result<(), TensorError> {
    let tp = layout.size(MeshAxis::Tp);
    if tp == 1 {
        return Ok(());
    }
    let to_world =
        |members: &[usize]| -> Vec<usize> { members.iter().map(|&r| world_ranks[r]).collect() };
    for rank in 0..layout.world_size() {
        let members = layout
            .axis_ranks(rank, MeshAxis::Tp)
            .expect("rank inside the mesh");
        let spread = hosts.group_hosts(&to_world(&members));
        if spread.num_hosts() > 1 {
            let all: Vec<usize> = (0..layout.world_size()).collect();
            let per_host = hosts.group_hosts(&to_world(&all));
            let counts = match per_host.uniform_ranks_per_host() {
                Some(n) => n.to_string(),
                None => per_host
                    .members
                    .iter()
                    .map(|m| m.len().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            return Err(TensorError::AcrossHosts {
                tp,
                per_host: counts,
                ranks: format!("{:?}", to_world(&members)),
                hosts: spread.num_hosts(),
            });
        }
    }
    Ok(())
}

/// One worker's tensor-parallel setting.
#[derive(Clone)]
pub struct TpContext {
    pub group: Arc<dyn ProcessGroup>,
    /// Sequence parallelism: the non-tensor-parallel regions hold this rank's tokens only.
    pub sequence_parallel: bool,
    /// Tokens per sample, for sequence-parallel gathers (`[rows, x]` back to
    /// `[batch, seq, x]`).
    pub seq: usize,
    /// What this rank's tensor-parallel layers communicated.
    pub stats: Arc<TpCommStats>,
}

impl TpContext {
    pub fn new(group: Arc<dyn ProcessGroup>, sequence_parallel: bool, seq: usize) -> Self {
        TpContext {
            group,
            sequence_parallel,
            seq,
            stats: Arc::default(),
        }
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// `g` forward: [`all_reduce`], counted.
    fn all_reduce(&self, x: &mut [f32]) {
        let t = self.stats.begin(Kind::AllReduce, x.len());
        all_reduce(self.group.as_ref(), x);
        self.stats.waited(t);
    }

    /// [`gather_rows`], counted (by the gathered size).
    fn gather_rows(&self, local: &[f32]) -> Vec<f32> {
        let t = self.stats.begin(Kind::AllGather, local.len() * self.size());
        let full = gather_rows(self.group.as_ref(), local);
        self.stats.waited(t);
        full
    }

    /// [`scatter_rows`], counted (by the reduced size).
    fn scatter_rows(&self, full: &[f32]) -> Vec<f32> {
        let t = self.stats.begin(Kind::ReduceScatter, full.len());
        let local = scatter_rows(self.group.as_ref(), full);
        self.stats.waited(t);
        local
    }
}

/// Which collective.
#[derive(Clone, Copy)]
enum Kind {
    AllReduce,
    AllGather,
    ReduceScatter,
}

/// Counts of a rank's tensor-parallel collectives: calls and elements (the whole tensor's:
/// what is reduced, or the gathered result), and the time its compute thread waited for
/// them. Ring algorithms move `2(t−1)/t` of an all-reduce's elements per rank and `(t−1)/t`
/// of an all-gather's or reduce-scatter's, so an all-gather plus a reduce-scatter of `n`
/// cost what one all-reduce of `n` does.
#[derive(Debug, Default)]
pub struct TpCommStats {
    counts: [(std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64); 3],
    wait_ns: std::sync::atomic::AtomicU64,
}

/// A snapshot of [`TpCommStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct TpComm {
    pub all_reduces: u64,
    pub all_reduce_elems: u64,
    pub all_gathers: u64,
    pub all_gather_elems: u64,
    pub reduce_scatters: u64,
    pub reduce_scatter_elems: u64,
    /// Seconds the compute thread waited in tensor-parallel collectives.
    pub wait_s: f64,
}

impl TpComm {
    /// The counts since `before`.
    pub fn since(&self, before: &TpComm) -> TpComm {
        TpComm {
            all_reduces: self.all_reduces - before.all_reduces,
            all_reduce_elems: self.all_reduce_elems - before.all_reduce_elems,
            all_gathers: self.all_gathers - before.all_gathers,
            all_gather_elems: self.all_gather_elems - before.all_gather_elems,
            reduce_scatters: self.reduce_scatters - before.reduce_scatters,
            reduce_scatter_elems: self.reduce_scatter_elems - before.reduce_scatter_elems,
            wait_s: self.wait_s - before.wait_s,
        }
    }

    /// Elements through all three collectives.
    pub fn elems(&self) -> u64 {
        self.all_reduce_elems + self.all_gather_elems + self.reduce_scatter_elems
    }
}

impl TpCommStats {
    fn begin(&self, kind: Kind, elems: usize) -> std::time::Instant {
        use std::sync::atomic::Ordering::Relaxed;
        let (calls, n) = &self.counts[kind as usize];
        calls.fetch_add(1, Relaxed);
        n.fetch_add(elems as u64, Relaxed);
        std::time::Instant::now()
    }

    fn waited(&self, since: std::time::Instant) {
        let ns = since.elapsed().as_nanos() as u64;
        self.wait_ns
            .fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> TpComm {
        use std::sync::atomic::Ordering::Relaxed;
        let get = |k: usize| {
            (
                self.counts[k].0.load(Relaxed),
                self.counts[k].1.load(Relaxed),
            )
        };
        let ((ar, are), (ag, age), (rs, rse)) = (get(0), get(1), get(2));
        TpComm {
            all_reduces: ar,
            all_reduce_elems: are,
            all_gathers: ag,
            all_gather_elems: age,
            reduce_scatters: rs,
            reduce_scatter_elems: rse,
            wait_s: self.wait_ns.load(Relaxed) as f64 * 1e-9,
        }
    }
}

fn fail(what: &str, e: CommError) -> ! {
    // Layers cannot return errors; the worker fails with the collective's message.
    panic!("tensor parallelism: {what}: {e}")
}

/// `g` forward (and `f` backward): the sum over the group, in place.
pub fn all_reduce(group: &dyn ProcessGroup, x: &mut [f32]) {
    if let Err(e) = group.all_reduce(BufMut::F32(x), ReduceOp::Sum) {
        fail("all-reduce", e)
    }
}

/// Sequence-parallel `f` forward: every rank's rows, in rank order.
pub fn gather_rows(group: &dyn ProcessGroup, local: &[f32]) -> Vec<f32> {
    let mut full = take_buffer(local.len() * group.size());
    if let Err(e) = group.all_gather(BufRef::F32(local), BufMut::F32(&mut full)) {
        fail("all-gather", e)
    }
    full
}

/// Sequence-parallel `g` forward: the sum over the group, rank `r` keeping rows
/// `[r·n/tp, (r+1)·n/tp)`.
pub fn scatter_rows(group: &dyn ProcessGroup, full: &[f32]) -> Vec<f32> {
    let mut local = take_buffer(full.len() / group.size());
    if let Err(e) = group.reduce_scatter(BufRef::F32(full), BufMut::F32(&mut local), ReduceOp::Sum)
    {
        fail("reduce-scatter", e)
    }
    local
}

/// The shape of gathered rows: `[rows / seq, seq, width]` (what attention and the head expect).
fn gathered_shape(rows: usize, seq: usize, width: usize) -> Vec<usize> {
    vec![rows / seq, seq, width]
}

#[cfg(feature = "cuda")]
mod tp_cuda;

/// A collective running on the communication thread (a GPU's communication stream) while
/// compute goes on, with the tensors it reads and writes (kept alive until it is waited
/// for). Host and device tensors alike ([`tensor_view`]): the layers' collectives are
/// written once for both devices.
struct InFlight {
    work: Work,
    /// The tensor the result lands in.
    out: Tensor,
    stats: Arc<TpCommStats>,
}

impl InFlight {
    fn wait(self, what: &str) -> Tensor {
        let t = std::time::Instant::now();
        if let Err(e) = self.work.wait() {
            fail(what, e)
        }
        self.stats.waited(t);
        self.out
    }
}

/// Starts the in-place all-reduce of `buf`.
fn start_all_reduce(tp: &TpContext, mut buf: Tensor) -> InFlight {
    // In place: nobody else may hold a device tensor's buffer (a host one is owned).
    #[cfg(feature = "cuda")]
    debug_assert!(
        buf.cuda().is_none_or(|c| c.is_unique()),
        "an all-reduce in place of a shared tensor"
    );
    let group = tp.group.as_ref();
    tp.stats.begin(Kind::AllReduce, buf.numel());
    // SAFETY: `buf` moves into the returned value and is neither read nor written until
    // `wait`, which waits for the operation first; moving a tensor does not move its values.
    let work = unsafe { group.all_reduce_async(tensor_view(&mut buf), ReduceOp::Sum) };
    InFlight {
        work: work.unwrap_or_else(|e| fail("all-reduce", e)),
        out: buf,
        stats: tp.stats.clone(),
    }
}

/// Starts the reduce-scatter of `full` into a tensor of `local_shape` (`full` stays alive:
/// it is returned with the result, see [`InFlightPair`]).
fn start_scatter(tp: &TpContext, mut full: Tensor, local_shape: &[usize]) -> InFlightPair {
    let group = tp.group.as_ref();
    tp.stats.begin(Kind::ReduceScatter, full.numel());
    let mut out = tensor_like(&full, local_shape);
    // SAFETY: both tensors move into the returned value and are untouched until `wait`.
    let work = unsafe {
        group.reduce_scatter_async(tensor_view(&mut full), tensor_view(&mut out), ReduceOp::Sum)
    };
    InFlightPair {
        inner: InFlight {
            work: work.unwrap_or_else(|e| fail("reduce-scatter", e)),
            out,
            stats: tp.stats.clone(),
        },
        _input: full,
    }
}

/// Starts the all-gather of `local` into a tensor of `full_shape` (kept alive with the
/// result).
fn start_gather(tp: &TpContext, mut local: Tensor, full_shape: &[usize]) -> InFlightPair {
    let group = tp.group.as_ref();
    tp.stats
        .begin(Kind::AllGather, local.numel() * group.size());
    let mut out = tensor_like(&local, full_shape);
    // SAFETY: both tensors move into the returned value and are untouched until `wait`.
    let work = unsafe { group.all_gather_async(tensor_view(&mut local), tensor_view(&mut out)) };
    InFlightPair {
        inner: InFlight {
            work: work.unwrap_or_else(|e| fail("all-gather", e)),
            out,
            stats: tp.stats.clone(),
        },
        _input: local,
    }
}

/// An in-flight collective with a separate input tensor.
struct InFlightPair {
    inner: InFlight,
    _input: Tensor,
}

impl InFlightPair {
    fn wait(self, what: &str) -> Tensor {
        let InFlightPair { inner, _input } = self;
        let out = inner.wait(what);
        _input.recycle();
        out
    }
}

/// `ParamSpec`s of a layer split by `shard_of(name, shape)`.
fn shard_specs(
    specs: Vec<ParamSpec>,
    shard_of: impl Fn(&str, &[usize]) -> Option<ShardSpec>,
) -> Vec<ParamSpec> {
    specs
        .into_iter()
        .map(|mut p| {
            if let Some(s) = shard_of(&p.name, &p.shape) {
                p.shape = s.local_shape();
                p.shard = Some(s);
            }
            p
        })
        .collect()
}

/// A column-parallel linear layer: this rank's output features (`groups` groups split
/// separately), the whole input. Forward needs no communication (`f` is the identity); the
/// input gradient is all-reduced in backward, overlapped with the weight gradient. Under
/// sequence parallelism the input is this rank's tokens, all-gathered forward (and again in
/// backward rather than kept), and the input gradient is reduce-scattered.
pub struct ColumnParallel {
    /// The local product (its outputs are this rank's features).
    inner: Linear,
    specs: Vec<ParamSpec>,
    tp: TpContext,
}

impl ColumnParallel {
    /// The shard of `whole` for this rank; `vocab_head` pads the output features to a
    /// multiple of tp (Megatron's padded vocabulary).
    fn new(whole: &Linear, groups: usize, tp: TpContext) -> ColumnParallel {
        let (size, rank) = (tp.size(), tp.rank());
        Self::with_shards(whole, tp, |shape| {
            ShardSpec::new(shape, 0, groups, size, rank)
        })
    }

    /// A grouped-query q/k/v projection on `r · kv_heads` ranks: this rank's group's share
    /// of its query rows and the group's key and value rows ([`Deal`]).
    fn dealt(whole: &Linear, kv_heads: usize, head_dim: usize, tp: TpContext) -> ColumnParallel {
        let deal = Deal {
            replicas: tp.size() / kv_heads,
            tail: 2 * head_dim,
        };
        let rank = tp.rank();
        Self::with_shards(whole, tp, |shape| {
            ShardSpec::dealt(shape, kv_heads, deal, rank)
        })
    }

    fn with_shards(
        whole: &Linear,
        tp: TpContext,
        shard: impl Fn(&[usize]) -> ShardSpec,
    ) -> ColumnParallel {
        let specs = shard_specs(whole.params(), |_, shape| Some(shard(shape)));
        let local_outputs = specs[0].shape[0];
        let inner = Linear {
            outputs: local_outputs,
            fp8_shards: Some(Arc::new(ShardAmaxes(tp.clone()))),
            ..clone_linear(whole)
        };
        ColumnParallel { inner, specs, tp }
    }
}

fn clone_linear(l: &Linear) -> Linear {
    Linear {
        inputs: l.inputs,
        outputs: l.outputs,
        bias: l.bias,
        weight_init: l.weight_init,
        activation: l.activation,
        precision: l.precision,
        fp8: l.fp8,
        fp8_shards: l.fp8_shards.clone(),
    }
}

/// A tensor-parallel layer's FP8 amaxes agreed over its group: a max all-reduce of two or
/// three values per pass, on the host or the device as the amaxes are (not counted in
/// [`TpCommStats`], which counts the activations' traffic the planner predicts).
///
/// Each rank's maximum over its shard, maxed over the ranks, is the whole tensor's amax
/// wherever the shards partition the tensor: weights, row-parallel inputs, column-parallel
/// output gradients. (A grouped-query projection dealt to more ranks than key/value heads
/// holds partial gradients of its shared key/value rows: there the agreed amax is the
/// largest partial's, close to but not the whole sum's.)
struct ShardAmaxes(TpContext);

impl AmaxAgreement for ShardAmaxes {
    fn agree(&self, mut amaxes: Tensor) -> Tensor {
        let what = "all-reduce (max) of FP8 amaxes";
        let group = self.0.group.as_ref();
        // SAFETY: `amaxes` is neither read nor written until the operation is waited for.
        let work = unsafe { group.all_reduce_async(tensor_view(&mut amaxes), ReduceOp::Max) };
        if let Err(e) = work.unwrap_or_else(|e| fail(what, e)).wait() {
            fail(what, e)
        }
        amaxes
    }
}

impl Layer for ColumnParallel {
    fn runs_on(&self, device: meshtrain_tensor::Device) -> bool {
        device.is_cpu() || cfg!(feature = "cuda")
    }

    fn set_precision(&mut self, precision: DType) {
        self.inner.set_precision(precision);
    }

    fn set_fp8_products(&mut self, on: bool) {
        self.inner.set_fp8_products(on);
    }

    fn params(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }

    fn forward(
        &self,
        p: Params<'_>,
        b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if p.device().is_cuda() {
            return self.forward_cuda(p, b, x, mode, s);
        }
        let p = p.host();
        let b = b.host();
        let tp = &self.tp;
        if !tp.sequence_parallel {
            return self.inner.forward(p.into(), b.into(), x, mode, s);
        }
        let rows = x.numel() / self.inner.inputs * tp.size();
        let full = tp.gather_rows(x.data());
        let full = Tensor::from_vec(full, &gathered_shape(rows, tp.seq, self.inner.inputs));
        let y = self.inner.forward(p.into(), b.into(), full, mode, s);
        if mode.train {
            // Keep this rank's tokens, not the gathered input: backward gathers again.
            let from_end = usize::from(self.inner.activation.is_some());
            s.replace_kept(self.inner.precision, from_end, x);
        }
        y
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if p.device().is_cuda() {
            return self.backward_cuda(p, g, s, dy, need_dx);
        }
        let p = p.host();
        let g = g.host();
        let tp = &self.tp;
        let mut dz = dy;
        let x = self.inner.backward_prologue(g, &mut s, &mut dz);
        // Under sequence parallelism `x` holds this rank's tokens: their amax, agreed over
        // the group, is that of the gathered input the weight gradient reads.
        let casts = self.inner.fp8_backward_casts(p, &dz, &x);
        let casts = casts.as_ref();
        if !tp.sequence_parallel {
            let shape = x.shape().to_vec();
            let dx = need_dx.then(|| {
                let dx = self.inner.input_gradient(p, &dz, &shape, casts);
                start_all_reduce(tp, dx)
            });
            self.inner.weight_gradient(g, &dz, &x, casts);
            x.recycle();
            dz.recycle();
            return dx.map(|d| d.wait("all-reduce of the input gradient"));
        }
        // Gather the tokens again while the input gradient is computed, then reduce-scatter
        // that while the weight gradient is.
        let local_shape = x.shape().to_vec();
        let rows = x.numel() / self.inner.inputs * tp.size();
        let full_shape = gathered_shape(rows, tp.seq, self.inner.inputs);
        let gathering = start_gather(tp, x.into_tensor(), &full_shape);
        let scattering = need_dx.then(|| self.inner.input_gradient(p, &dz, &full_shape, casts));
        let x_full = Kept::F32(gathering.wait("all-gather of the input"));
        let scattering = scattering.map(|dx| start_scatter(tp, dx, &local_shape));
        self.inner.weight_gradient(g, &dz, &x_full, casts);
        x_full.recycle();
        dz.recycle();
        scattering.map(|d| d.wait("reduce-scatter of the input gradient"))
    }
}

/// A row-parallel linear layer: this rank's input features; the partial products are summed
/// over the group (`g`: all-reduce, or reduce-scatter of the tokens under sequence
/// parallelism), then the replicated bias is added. Backward needs no communication without
/// sequence parallelism (the output gradient is replicated); with it, the output gradient's
/// tokens are all-gathered.
pub struct RowParallel {
    /// The local product, without bias.
    inner: Linear,
    bias: bool,
    outputs: usize,
    specs: Vec<ParamSpec>,
    tp: TpContext,
}

impl RowParallel {
    fn new(whole: &Linear, tp: TpContext) -> RowParallel {
        let (size, rank) = (tp.size(), tp.rank());
        let specs = shard_specs(whole.params(), |name, shape| {
            (name == "weight").then(|| ShardSpec::new(shape, 1, 1, size, rank))
        });
        let inner = Linear {
            inputs: specs[0].shape[1],
            bias: false,
            fp8_shards: Some(Arc::new(ShardAmaxes(tp.clone()))),
            ..clone_linear(whole)
        };
        RowParallel {
            inner,
            bias: whole.bias,
            outputs: whole.outputs,
            specs,
            tp,
        }
    }
}

impl Layer for RowParallel {
    fn runs_on(&self, device: meshtrain_tensor::Device) -> bool {
        device.is_cpu() || cfg!(feature = "cuda")
    }

    fn set_precision(&mut self, precision: DType) {
        self.inner.set_precision(precision);
    }

    fn set_fp8_products(&mut self, on: bool) {
        self.inner.set_fp8_products(on);
    }

    fn params(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }

    fn forward(
        &self,
        p: Params<'_>,
        b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if p.device().is_cuda() {
            return self.forward_cuda(p, b, x, mode, s);
        }
        let p = p.host();
        let b = b.host();
        let tp = &self.tp;
        let nw = self.inner.inputs * self.outputs;
        let partial = self.inner.forward(p[..nw].into(), b.into(), x, mode, s);
        let rows = partial.numel() / self.outputs;
        let mut y = if tp.sequence_parallel {
            let local = tp.scatter_rows(partial.data());
            partial.recycle();
            Tensor::from_vec(local, &[rows / tp.size(), self.outputs])
        } else {
            let mut y = partial;
            tp.all_reduce(y.data_mut());
            y
        };
        if self.bias {
            let bias = &p[nw..];
            for row in y.data_mut().chunks_mut(self.outputs) {
                row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
            }
        }
        y
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if p.device().is_cuda() {
            return self.backward_cuda(p, g, s, dy, need_dx);
        }
        let p = p.host();
        let g = g.host();
        let tp = &self.tp;
        let nw = self.inner.inputs * self.outputs;
        if self.bias {
            let mut acc = vec![0.0f64; self.outputs];
            for row in dy.data().chunks(self.outputs) {
                acc.iter_mut().zip(row).for_each(|(a, v)| *a += *v as f64);
            }
            g[nw..]
                .iter_mut()
                .zip(acc)
                .for_each(|(b, a)| *b += a as f32);
        }
        let dy = if tp.sequence_parallel {
            let rows = dy.numel() / self.outputs * tp.size();
            let full = tp.gather_rows(dy.data());
            dy.recycle();
            Tensor::from_vec(full, &gathered_shape(rows, tp.seq, self.outputs))
        } else {
            dy
        };
        self.inner
            .backward(p[..nw].into(), (&mut g[..nw]).into(), s, dy, need_dx)
    }
}

/// A GPT embedding split over the vocabulary: each rank holds `padded_vocab / tp` rows of the
/// token table, looks up the ids in its range (zero elsewhere), and the ranks' partial
/// embeddings are summed (`g`; reduce-scattered over the tokens under sequence parallelism)
/// before the replicated position embedding is added.
pub struct VocabParallelEmbedding {
    whole: GptEmbedding,
    specs: Vec<ParamSpec>,
    tp: TpContext,
}

impl VocabParallelEmbedding {
    fn new(whole: &GptEmbedding, tp: TpContext) -> Self {
        let (size, rank) = (tp.size(), tp.rank());
        let specs = shard_specs(whole.params(), |name, shape| {
            (name == "tok.weight").then(|| ShardSpec::new(shape, 0, 1, size, rank))
        });
        VocabParallelEmbedding {
            whole: GptEmbedding { ..*whole },
            specs,
            tp,
        }
    }

    /// The same split embedding holding the tokens `sequence` of each sequence (context
    /// parallelism).
    pub(crate) fn with_sequence(&self, sequence: SequenceShard) -> Self {
        VocabParallelEmbedding {
            whole: GptEmbedding {
                sequence,
                ..self.whole
            },
            specs: self.specs.clone(),
            tp: self.tp.clone(),
        }
    }

    /// Panics unless `t` tokens per sample (this worker's share of the sequence) fit the
    /// model's positions. Every rank checks before any collective: only rank 0 reads the
    /// position table on a GPU, and the others would wait for it in the sum.
    fn check_sequence(&self, t: usize) {
        let whole_seq = t * self.whole.sequence.parts;
        assert!(
            whole_seq <= self.whole.max_seq,
            "sequence {whole_seq} longer than the model's {}",
            self.whole.max_seq
        );
    }

    /// This rank's vocabulary rows: `[start, start + rows)`.
    fn rows(&self) -> Range<usize> {
        let rows = self.specs[0].shape[0];
        let start = self.tp.rank() * rows;
        start..start + rows
    }
}

impl Layer for VocabParallelEmbedding {
    /// Its position table (GPT) is read by position: no cached forward (generation runs on
    /// one worker).
    fn reads_positions(&self) -> bool {
        self.whole.learned_positions
    }

    fn runs_on(&self, device: meshtrain_tensor::Device) -> bool {
        device.is_cpu() || cfg!(feature = "cuda")
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        // Context parallelism finds it to tell it its tokens' positions.
        Some(self)
    }

    fn params(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        ids: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if p.device().is_cuda() {
            return self.forward_cuda(p, ids, mode, s);
        }
        let p = p.host();
        let (b, t, d) = (ids.dim(0), ids.dim(1), self.whole.dim);
        self.check_sequence(t);
        let mine = self.rows();
        let (tok, pos) = p.split_at(mine.len() * d);
        let mut y = vec![0.0f32; b * t * d];
        for (row, &id) in y.chunks_mut(d).zip(ids.data()) {
            let id = id as usize;
            if mine.contains(&id) {
                row.copy_from_slice(&tok[(id - mine.start) * d..][..d]);
            }
        }
        let tp = &self.tp;
        let (mut y, first_row) = if tp.sequence_parallel {
            let local = tp.scatter_rows(&y);
            (local, tp.rank() * b * t / tp.size())
        } else {
            tp.all_reduce(&mut y);
            (y, 0)
        };
        if self.whole.learned_positions {
            for (i, row) in y.chunks_mut(d).enumerate() {
                let at = self.whole.sequence.position((first_row + i) % t, t);
                let pe = &pos[at * d..][..d];
                row.iter_mut().zip(pe).for_each(|(v, p)| *v += p);
            }
        }
        if mode.train {
            s.tensors.push(ids);
        }
        let rows = y.len() / d;
        let shape = if tp.sequence_parallel {
            vec![rows, d]
        } else {
            vec![b, t, d]
        };
        Tensor::from_vec(y, &shape)
    }

    fn backward(
        &self,
        _: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if !matches!(g, ParamsMut::Host(_)) {
            self.backward_cuda(g, s, dy);
            return None;
        }
        let g = g.host();
        let ids = s.tensors.pop().expect("embedding: saved ids");
        let (t, d) = (ids.dim(1), self.whole.dim);
        let mine = self.rows();
        let (gtok, gpos) = g.split_at_mut(mine.len() * d);
        let tp = &self.tp;
        let first_row = if tp.sequence_parallel {
            tp.rank() * ids.numel() / tp.size()
        } else {
            0
        };
        // Position gradients from this rank's rows (all of them without sequence
        // parallelism; summed over the group later with it).
        if self.whole.learned_positions {
            for (i, row) in dy.data().chunks(d).enumerate() {
                let at = self.whole.sequence.position((first_row + i) % t, t);
                let gp = &mut gpos[at * d..][..d];
                gp.iter_mut().zip(row).for_each(|(a, v)| *a += v);
            }
        }
        let full = if tp.sequence_parallel {
            tp.gather_rows(dy.data())
        } else {
            dy.into_vec()
        };
        for (row, &id) in full.chunks(d).zip(ids.data()) {
            let id = id as usize;
            if mine.contains(&id) {
                let gt = &mut gtok[(id - mine.start) * d..][..d];
                gt.iter_mut().zip(row).for_each(|(a, v)| *a += v);
            }
        }
        None
    }
}

/// Cross-entropy over logits split by vocabulary: each rank holds `[rows, padded / tp]`
/// logits. Per row the maximum, the sum of exponentials and the target's logit are combined
/// over the group (two all-reduces of `rows` values, not the `rows × vocab` logits); padding
/// columns (vocabulary ids ≥ `vocab`) take no part.
pub struct VocabParallelCrossEntropy {
    pub vocab: usize,
    /// Columns per rank (`padded / tp`).
    pub columns: usize,
    pub group: Arc<dyn ProcessGroup>,
}

impl VocabParallelCrossEntropy {
    /// This rank's real (unpadded) vocabulary ids.
    fn ids(&self) -> Range<usize> {
        let start = self.group.rank() * self.columns;
        start.min(self.vocab)..(start + self.columns).min(self.vocab)
    }

    /// `columns` logits per target, and targets inside the vocabulary.
    fn check_output(&self, output: &Tensor, targets: &[u32]) -> Result<(), LossError> {
        let (rows, c) = (targets.len(), self.columns);
        if output.numel() != rows * c {
            return Err(LossError::OutputSize {
                loss: self.name(),
                elements: output.numel(),
                targets: rows,
                per_target: c,
                expected: rows * c,
                shape: output.shape().to_vec(),
            });
        }
        self.check_targets(targets)
    }
}

impl Loss for VocabParallelCrossEntropy {
    fn name(&self) -> String {
        format!(
            "vocab-parallel cross-entropy over {} classes ({} ranks)",
            self.vocab,
            self.group.size()
        )
    }

    fn classes(&self) -> Option<usize> {
        Some(self.vocab)
    }

    fn check_targets(&self, targets: &[u32]) -> Result<(), LossError> {
        meshtrain_nn::CrossEntropy::new(self.vocab).check_targets(targets)
    }

    #[cfg(feature = "cuda")]
    fn forward_backward_on_device(
        &self,
        output: Tensor,
        targets: &[u32],
        targets_on_device: u64,
        grad_scale: Option<f32>,
        sums: u64,
    ) -> Result<(Option<LossValue>, Option<Tensor>), LossError> {
        self.forward_backward_cuda(output, targets, targets_on_device, grad_scale, sums)
    }

    fn forward_backward(
        &self,
        output: &Tensor,
        targets: &[u32],
        grad_scale: f32,
    ) -> Result<(LossValue, Tensor), LossError> {
        let rows = targets.len();
        let c = self.columns;
        self.check_output(output, targets)?;
        let ids = self.ids();
        let real = ids.len();
        let logits = output.data();
        let group = self.group.as_ref();
        let mut max: Vec<f32> = logits
            .chunks(c)
            .map(|l| l[..real].iter().copied().fold(f32::NEG_INFINITY, f32::max))
            .collect();
        if let Err(e) = group.all_reduce(BufMut::F32(&mut max), ReduceOp::Max) {
            fail("all-reduce of the logits' maxima", e)
        }
        let mut grad = vec![0.0f32; logits.len()];
        // Per row: Σ exp(l − max) over this rank's ids, and the target's logit if it is here.
        let mut sums = vec![0.0f32; 2 * rows];
        for (r, (l, gr)) in logits.chunks(c).zip(grad.chunks_mut(c)).enumerate() {
            let mut sum = 0.0f32;
            for (g, &v) in gr[..real].iter_mut().zip(&l[..real]) {
                *g = fast_exp(v - max[r]);
                sum += *g;
            }
            sums[r] = sum;
            let t = targets[r] as usize;
            if ids.contains(&t) {
                sums[rows + r] = l[t - ids.start];
            }
        }
        if let Err(e) = group.all_reduce(BufMut::F32(&mut sums), ReduceOp::Sum) {
            fail("all-reduce of the softmax sums", e)
        }
        let inv_rows = 1.0 / rows as f32;
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for (r, gr) in grad.chunks_mut(c).enumerate() {
            let (sum, target) = (sums[r], sums[rows + r]);
            loss += (sum.ln() + max[r] - target) as f64;
            correct += usize::from(target >= max[r]);
            let k = grad_scale * inv_rows / sum;
            gr[..real].iter_mut().for_each(|v| *v *= k);
            let t = targets[r] as usize;
            if ids.contains(&t) {
                gr[t - ids.start] -= grad_scale * inv_rows;
            }
        }
        let value = LossValue {
            mean: (loss / rows as f64) as f32,
            count: rows,
            correct: Some(correct),
        };
        Ok((value, Tensor::from_vec(grad, output.shape())))
    }
}

/// What [`parallelize`] did to the model's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpOutput {
    /// The output is whole on every rank (the loss is unchanged).
    Replicated,
    /// The output is split over the vocabulary: `columns` logits per rank, `vocab` real ids.
    VocabParallel { vocab: usize, columns: usize },
}

/// A layer's path: block and child names joined by dots, empty names skipped.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (_, true) => prefix.to_string(),
        (true, false) => name.to_string(),
        (false, false) => format!("{prefix}.{name}"),
    }
}

/// The plan's style for the layer at `path`, if a rule names it.
fn style_of(model: &Model, path: &str) -> Option<TpStyle> {
    let plan = model.tensor_plan()?;
    plan.rules
        .iter()
        .find(|(pattern, _)| meshtrain_nn::optim::glob(pattern, path))
        .map(|(_, s)| *s)
}

/// Checks, without building anything, that `model` splits over `tp` ranks: the plan exists,
/// and heads, split features and (with sequence parallelism) the tokens per sample of each of
/// `cp` context-parallel workers divide by `tp`. The errors name the layer and the number.
pub fn check(
    model: &Model,
    tp: usize,
    sequence_parallel: bool,
    cp: usize,
) -> Result<(), TensorError> {
    if tp == 1 {
        return Ok(());
    }
    if model.tensor_plan().is_none() {
        return Err(TensorError::NoPlan { tp });
    }
    if sequence_parallel {
        let seq = model
            .input()
            .and_then(|i| i.shape.first().copied())
            .ok_or(TensorError::NoSequence)?;
        if cp == 1 {
            divides(tp, "the sequence length (tokens per sample)", seq)?;
        } else {
            let what = format!("the tokens per sample on each of cp={cp} workers");
            divides(tp, &what, seq / cp)?;
        }
    }
    // Heads first: they are what tensor parallelism splits attention by, and the fused
    // projection before them only fails as their consequence (its per-group features are
    // heads × head width).
    for block in &model.blocks {
        check_heads(block.layer.as_ref(), &block.name, tp)?;
    }
    for block in &model.blocks {
        check_layer(model, block.layer.as_ref(), &block.name, tp)?;
    }
    Ok(())
}

/// Every attention core's heads, and every rotary layer's key/value heads, divide over `tp`
/// (each rank keeps whole heads and whole key/value groups).
fn check_heads(layer: &dyn Layer, path: &str, tp: usize) -> Result<(), TensorError> {
    if let Some(rotary) = layer.as_any().and_then(|a| a.downcast_ref::<Rotary>()) {
        if !kv_heads_fit(tp, rotary.kv_heads, rotary.heads) {
            return Err(TensorError::KvHeads {
                tp,
                path: path.into(),
                kv_heads: rotary.kv_heads,
                heads: rotary.heads,
            });
        }
    }
    if let Some(core) = layer
        .as_any()
        .and_then(|a| a.downcast_ref::<AttentionCore>())
    {
        if !core.heads.is_multiple_of(tp) {
            return Err(TensorError::Heads {
                tp,
                path: path.into(),
                heads: core.heads,
            });
        }
    }
    if let Some(children) = layer.children() {
        for (name, child) in children.layers() {
            check_heads(child.as_ref(), &join(path, name), tp)?;
        }
    }
    Ok(())
}

fn divides(tp: usize, what: &str, n: usize) -> Result<(), TensorError> {
    if n.is_multiple_of(tp) {
        Ok(())
    } else {
        Err(TensorError::NotDivisible {
            tp,
            what: what.to_string(),
            n,
        })
    }
}

fn check_layer(model: &Model, layer: &dyn Layer, path: &str, tp: usize) -> Result<(), TensorError> {
    if let Some(any) = layer.as_any() {
        if let Some(core) = any.downcast_ref::<AttentionCore>() {
            return divides(tp, &format!("'{path}' attention heads"), core.heads);
        }
        if any.is::<GptEmbedding>() {
            return Ok(()); // any vocabulary: padded
        }
        if let Some(linear) = any.downcast_ref::<Linear>() {
            return match style_of(model, path) {
                Some(TpStyle::Column { groups }) => {
                    if !linear.outputs.is_multiple_of(groups) {
                        return Err(TensorError::Unsupported {
                            tp,
                            path: path.into(),
                            style: TpStyle::Column { groups },
                            reason: format!(
                                "its {} outputs are not {groups} groups",
                                linear.outputs
                            ),
                        });
                    }
                    divides(
                        tp,
                        &format!("'{path}' output features per group"),
                        linear.outputs / groups,
                    )
                }
                // Whole groups, or replicated ones: the rotary layer's heads decide
                // (check_heads), and the rows follow from them.
                Some(TpStyle::GroupedQkv { .. }) => Ok(()),
                Some(TpStyle::Row) => {
                    if linear.activation.is_some() {
                        return Err(TensorError::Unsupported {
                            tp,
                            path: path.into(),
                            style: TpStyle::Row,
                            reason: "an activation cannot follow a partial sum".into(),
                        });
                    }
                    divides(tp, &format!("'{path}' input features"), linear.inputs)
                }
                Some(TpStyle::VocabHead) if linear.bias => Err(TensorError::Unsupported {
                    tp,
                    path: path.into(),
                    style: TpStyle::VocabHead,
                    reason: "a vocab-parallel head has no bias".into(),
                }),
                _ => Ok(()),
            };
        }
    }
    if let Some(children) = layer.children() {
        for (name, child) in children.layers() {
            check_layer(model, child.as_ref(), &join(path, name), tp)?;
        }
    }
    Ok(())
}

/// The tensor-parallel transform: `model`'s layers split for this rank of `tp.group` by the
/// model's plan (see the module documentation). Call [`check`] first for clear errors;
/// this panics only on what `check` rejects.
pub fn parallelize(model: Model, tp: &TpContext) -> (Model, TpOutput) {
    if tp.size() == 1 {
        return (model, TpOutput::Replicated);
    }
    let plan_model = Model::new(Vec::new()).with_tensor_plan(
        model
            .tensor_plan()
            .cloned()
            .expect("checked: the model has a tensor-parallel plan"),
    );
    let mut output = TpOutput::Replicated;
    let model = model
        .transform_blocks(|blocks| -> Result<(), std::convert::Infallible> {
            for block in blocks {
                let path = block.name.clone();
                if let Some(new) =
                    rewrite(&plan_model, block.layer.as_mut(), &path, tp, &mut output)
                {
                    block.layer = new;
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| match e {});
    (model, output)
}

/// The replacement of `layer` (at `path`), or `None` to keep it (its children rewritten).
fn rewrite(
    plan: &Model,
    layer: &mut dyn Layer,
    path: &str,
    tp: &TpContext,
    output: &mut TpOutput,
) -> Option<Box<dyn Layer>> {
    if let Some(any) = layer.as_any() {
        if let Some(core) = any.downcast_ref::<AttentionCore>() {
            return Some(Box::new(AttentionCore {
                dim: core.dim / tp.size(),
                heads: core.heads / tp.size(),
                // Whole groups per rank; fewer key/value heads than ranks are replicated.
                kv_heads: (core.kv_heads / tp.size()).max(1),
                precision: core.precision,
                kind: core.kind,
                window: core.window,
            }));
        }
        if let Some(n) = any.downcast_ref::<QkNorm>() {
            // This rank's heads: the norms' gradients are partial sums, summed over the group
            // in backward; under sequence parallelism `TpGradSync` already sums every
            // replicated parameter's gradient over the group once, these included.
            let reducer = (!tp.sequence_parallel).then(|| {
                Arc::new(crate::data::GroupStatsReducer::new(tp.group.clone()))
                    as Arc<dyn meshtrain_nn::StatsReducer>
            });
            return Some(Box::new(QkNorm {
                heads: n.heads / tp.size(),
                kv_heads: (n.kv_heads / tp.size()).max(1),
                grad_reducer: reducer,
                ..*n
            }));
        }
        if let Some(r) = any.downcast_ref::<Rotary>() {
            return Some(Box::new(Rotary {
                heads: r.heads / tp.size(),
                // On more ranks than key/value heads, one (replicated) head each.
                kv_heads: (r.kv_heads / tp.size()).max(1),
                ..*r
            }));
        }
        if let Some(e) = any.downcast_ref::<GptEmbedding>() {
            return Some(Box::new(VocabParallelEmbedding::new(e, tp.clone())));
        }
        if let Some(linear) = any.downcast_ref::<Linear>() {
            return match style_of(plan, path) {
                Some(TpStyle::Column { groups }) => {
                    Some(Box::new(ColumnParallel::new(linear, groups, tp.clone())))
                }
                Some(TpStyle::GroupedQkv { kv_heads, head_dim }) => {
                    Some(Box::new(if kv_heads.is_multiple_of(tp.size()) {
                        ColumnParallel::new(linear, 1, tp.clone())
                    } else {
                        ColumnParallel::dealt(linear, kv_heads, head_dim, tp.clone())
                    }))
                }
                Some(TpStyle::Row) => Some(Box::new(RowParallel::new(linear, tp.clone()))),
                Some(TpStyle::VocabHead) => {
                    let head = ColumnParallel::new(linear, 1, tp.clone());
                    *output = TpOutput::VocabParallel {
                        vocab: linear.outputs,
                        columns: head.inner.outputs,
                    };
                    Some(Box::new(head))
                }
                None => None,
            };
        }
    }
    if let Some(children) = layer.children_mut() {
        for (name, child) in children.layers_mut() {
            let child_path = join(path, name);
            if let Some(new) = rewrite(plan, child.as_mut(), &child_path, tp, output) {
                *child = new;
            }
        }
        children.relayout();
    }
    None
}

/// The loss for a model whose output [`parallelize`] split: the vocab-parallel form of a
/// cross-entropy (`loss` must be one), or `loss` itself.
pub fn parallel_loss(
    loss: Arc<dyn Loss>,
    output: TpOutput,
    tp: &TpContext,
) -> Result<Arc<dyn Loss>, TensorError> {
    match output {
        TpOutput::Replicated => Ok(loss),
        TpOutput::VocabParallel { vocab, columns } => match loss.classes() {
            Some(classes) if classes == vocab => Ok(Arc::new(VocabParallelCrossEntropy {
                vocab,
                columns,
                group: tp.group.clone(),
            })),
            _ => Err(TensorError::Unsupported {
                tp: tp.size(),
                path: "head".into(),
                style: TpStyle::VocabHead,
                reason: format!(
                    "the loss ({}) is not a cross-entropy over its {vocab} outputs",
                    loss.name()
                ),
            }),
        },
    }
}

/// The built-in GPT's tensor-parallel plan (re-exported for users composing GPT layers).
pub fn gpt_plan() -> meshtrain_nn::TensorPlan {
    gpt::tensor_plan()
}

/// Sums the gradients of replicated parameters over the tensor-parallel group when sequence
/// parallelism gave each rank only its tokens' share of them (layer norms, row-parallel
/// biases, position embeddings). Without sequence parallelism every rank computed the same
/// gradient and nothing is sent. And on more ranks than key/value heads ([`Deal`]), sums the
/// gradients of each replicated key/value head over the ranks that share it (each computed
/// only its query heads' part).
pub struct TpGradSync {
    group: Option<Arc<dyn ProcessGroup>>,
    /// Per local chunk: ranges of replicated parameters in its gradient buffer.
    replicated: Vec<Vec<Range<usize>>>,
    /// The group for the key/value replicas' sums (any tp with dealt groups).
    kv_group: Option<Arc<dyn ProcessGroup>>,
    /// Per local chunk: ranges of replicated key/value rows, with their group among how many.
    kv: Vec<Vec<KvRows>>,
    /// Whether this rank is not its key/value group's first replica (the rows then stay out
    /// of gradient norms, which count them once).
    kv_not_first: bool,
    /// Per local chunk, built at the first sum (after ZeRO remapped the ranges): the
    /// replicated gradients' and the key/value rows' wire buffers in the chunk's memory.
    packed: Vec<[Option<Packed>; 2]>,
}

/// Gradient runs of one chunk summed over a group through a wire buffer in the chunk's
/// memory (the host's or its device's): packed by a copy plan, all-reduced, unpacked. So the
/// sums are written once for both devices.
struct Packed {
    memory: Arc<dyn FlatMemory>,
    pack: CopyPlan,
    unpack: CopyPlan,
    wire: FlatBuf,
}

impl Packed {
    /// The wire of `len` elements that `pack`'s runs fill from the gradients (and zero);
    /// its inverse reads the sums back.
    fn new(chunk: &StageChunk, pack: Vec<Run>, len: usize) -> Packed {
        let memory = chunk.flat_memory();
        let pack = CopyPlan::new(pack);
        Packed {
            unpack: pack.inverse(),
            wire: memory.alloc(len),
            memory,
            pack,
        }
    }

    /// Packs `chunk`'s gradients, sums the wire over `group`, writes the sums back.
    fn sum(&mut self, chunk: &mut StageChunk, group: &dyn ProcessGroup) -> Result<(), CommError> {
        let memory = &self.memory;
        memory.apply(&self.pack, chunk.grads_buf(), self.wire.raw(), Apply::Copy);
        // SAFETY: the wire is this sum's alone, and the call waits for the operation.
        unsafe { group.all_reduce_async(self.wire.raw(), ReduceOp::Sum) }?.wait()?;
        memory.apply(
            &self.unpack,
            self.wire.raw(),
            chunk.grads_buf(),
            Apply::Copy,
        );
        Ok(())
    }
}

/// Replicated key/value rows of a dealt q/k/v projection, in a chunk's gradient buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
struct KvRows {
    range: Range<usize>,
    group: usize,
    groups: usize,
}

impl TpGradSync {
    /// For this worker's `chunks` of `model`, split over `tp` (`None`: one rank).
    /// `disabled` leaves the sums out (tests showing they matter).
    pub fn new(
        model: &Model,
        chunks: &[StageChunk],
        tp: Option<&TpContext>,
        disabled: bool,
    ) -> TpGradSync {
        let group = tp
            .filter(|t| t.sequence_parallel && t.size() > 1 && !disabled)
            .map(|t| t.group.clone());
        let replicated = chunks
            .iter()
            .map(|chunk| replicated_ranges(model, chunk.blocks.clone()))
            .collect();
        let kv: Vec<Vec<KvRows>> = chunks
            .iter()
            .map(|chunk| kv_replica_rows(model, chunk.blocks.clone()))
            .collect();
        let kv_not_first = model
            .params()
            .iter()
            .filter_map(|e| e.shard().filter(|s| s.deal.is_some()))
            .any(|s| s.deal.is_some_and(|d| s.index % d.replicas != 0));
        let kv_group = tp
            .filter(|t| t.size() > 1 && kv.iter().any(|c| !c.is_empty()))
            .map(|t| t.group.clone());
        TpGradSync {
            group,
            replicated,
            kv_group,
            kv,
            kv_not_first,
            packed: chunks.iter().map(|_| [None, None]).collect(),
        }
    }

    /// Per local chunk, what this rank leaves out of gradient norms that another rank of the
    /// group counts: the replicated key/value rows on all but their group's first replica.
    pub fn kv_left_out_of_norms(&self) -> Vec<Vec<Range<usize>>> {
        self.kv
            .iter()
            .map(|rows| match self.kv_not_first {
                true => rows.iter().map(|r| r.range.clone()).collect(),
                false => Vec::new(),
            })
            .collect()
    }

    /// Per local chunk, the ranges of replicated (unsharded) parameters: counted once in
    /// gradient norms (on tensor-parallel rank 0 only).
    pub fn replicated(&self) -> &[Vec<Range<usize>>] {
        &self.replicated
    }

    /// Addresses the replicated parameters in the coordinates the update works in (ZeRO:
    /// this rank's pieces, which have the same lengths on every tensor-parallel rank).
    pub fn remap(&mut self, map: impl Fn(usize, &Range<usize>) -> Vec<Range<usize>>) {
        for (j, ranges) in self.replicated.iter_mut().enumerate() {
            *ranges = ranges.iter().flat_map(|r| map(j, r)).collect();
        }
        for (j, rows) in self.kv.iter_mut().enumerate() {
            *rows = rows
                .iter()
                .flat_map(|k| {
                    map(j, &k.range)
                        .into_iter()
                        .map(|range| KvRows { range, ..k.clone() })
                })
                .collect();
        }
    }

    /// Sums the replicated parameters' gradients over the group (one all-reduce per chunk),
    /// and each replicated key/value head's over its replicas.
    pub fn reduce(&mut self, chunks: &mut [StageChunk]) -> Result<(), CommError> {
        self.reduce_kv(chunks)?;
        let Some(group) = &self.group else {
            return Ok(());
        };
        for ((chunk, ranges), packed) in chunks
            .iter_mut()
            .zip(&self.replicated)
            .zip(&mut self.packed)
        {
            let packed = packed[0].get_or_insert_with(|| {
                let mut runs = Vec::new();
                let mut at = 0;
                for r in ranges {
                    runs.push(Run {
                        src: Some(r.start),
                        dst: at,
                        len: r.len(),
                    });
                    at += r.len();
                }
                Packed::new(chunk, runs, at)
            });
            packed.sum(chunk, group.as_ref())?;
        }
        Ok(())
    }

    /// Each rank's replicated key/value gradients go into its group's slot of a buffer that
    /// is zero elsewhere; one all-reduce over the tensor-parallel group sums every group's
    /// replicas at once, and each rank reads its group's slot back. (The rows have the same
    /// places and lengths on every rank: dealt shards have equal shapes.)
    fn reduce_kv(&mut self, chunks: &mut [StageChunk]) -> Result<(), CommError> {
        let Some(group) = &self.kv_group else {
            return Ok(());
        };
        for ((chunk, rows), packed) in chunks.iter_mut().zip(&self.kv).zip(&mut self.packed) {
            if rows.is_empty() {
                continue;
            }
            let packed = packed[1].get_or_insert_with(|| {
                let mut runs = Vec::new();
                let mut at = 0;
                for k in rows {
                    let len = k.range.len();
                    for g in 0..k.groups {
                        let src = (g == k.group).then_some(k.range.start);
                        runs.push(Run {
                            src,
                            dst: at + g * len,
                            len,
                        });
                    }
                    at += k.groups * len;
                }
                Packed::new(chunk, runs, at)
            });
            packed.sum(chunk, group.as_ref())?;
        }
        Ok(())
    }
}

/// Ranges (relative to the chunk of `blocks`) of the replicated key/value rows of dealt
/// q/k/v projections, with their group.
fn kv_replica_rows(model: &Model, blocks: Range<usize>) -> Vec<KvRows> {
    let base = model.blocks_param_range(blocks.clone()).start;
    let mut out = Vec::new();
    for e in model.params().iter().filter(|e| blocks.contains(&e.block)) {
        let Some(shard) = e.shard() else { continue };
        let Some((rows, group)) = shard.replicated_rows() else {
            continue;
        };
        let inner: usize = shard.local_shape()[1..].iter().product();
        let start = e.range.start - base;
        out.push(KvRows {
            range: start + rows.start * inner..start + rows.end * inner,
            group,
            groups: shard.groups,
        });
    }
    out
}

/// Ranges (relative to the chunk of `blocks`) of the parameters without a shard.
fn replicated_ranges(model: &Model, blocks: Range<usize>) -> Vec<Range<usize>> {
    let base = model.blocks_param_range(blocks.clone()).start;
    let mut ranges: Vec<Range<usize>> = Vec::new();
    for e in model.params().iter().filter(|e| blocks.contains(&e.block)) {
        if e.shard().is_some() {
            continue;
        }
        let r = e.range.start - base..e.range.end - base;
        match ranges.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => ranges.push(r),
        }
    }
    ranges
}
