//! The layer contract: explicit forward and backward over parameter slices.

use meshtrain_tensor::dtype::HalfTensor;
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::{DType, Device, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// A layer's parameters, as the model's flat buffer holds them where the step runs: host
/// values, or on a GPU the f32 masters beside their 16-bit compute copy. A layer slices it
/// the way it sliced `&[f32]` before ([`Params::split_at`], [`Params::slice`]) and reads the
/// host values with [`Params::host`] on its CPU path.
#[derive(Clone, Copy)]
pub enum Params<'a> {
    Host(&'a [f32]),
    #[cfg(feature = "cuda")]
    Device(meshtrain_tensor::cuda::DeviceParams<'a>),
}

impl<'a> Params<'a> {
    /// The host values. On a GPU this is a programming error: the layer's CPU path was
    /// reached with device parameters ([`Layer::runs_on`] should have said it has no CUDA
    /// kernels).
    pub fn host(self) -> &'a [f32] {
        match self {
            Params::Host(p) => p,
            #[cfg(feature = "cuda")]
            Params::Device(p) => panic!("{}", host_code_on_device(p.device().ordinal())),
        }
    }

    pub fn device(&self) -> Device {
        match self {
            Params::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Params::Device(p) => Device::Cuda(p.device().ordinal()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Params::Host(p) => p.len(),
            #[cfg(feature = "cuda")]
            Params::Device(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn slice(self, range: Range<usize>) -> Params<'a> {
        match self {
            Params::Host(p) => Params::Host(&p[range]),
            #[cfg(feature = "cuda")]
            Params::Device(p) => Params::Device(p.slice(range)),
        }
    }

    pub fn split_at(self, mid: usize) -> (Params<'a>, Params<'a>) {
        let len = self.len();
        (self.slice(0..mid), self.slice(mid..len))
    }
}

impl<'a> From<&'a [f32]> for Params<'a> {
    fn from(p: &'a [f32]) -> Self {
        Params::Host(p)
    }
}

impl<'a> From<&'a Vec<f32>> for Params<'a> {
    fn from(p: &'a Vec<f32>) -> Self {
        Params::Host(p)
    }
}

/// Values a layer writes: its gradients (accumulated into) or its buffers (batch-norm
/// running statistics), on the host or on a GPU (f32).
pub enum ParamsMut<'a> {
    Host(&'a mut [f32]),
    #[cfg(feature = "cuda")]
    Device(meshtrain_tensor::cuda::DeviceGrads<'a>),
}

impl<'a> ParamsMut<'a> {
    /// The host values (see [`Params::host`]).
    pub fn host(self) -> &'a mut [f32] {
        match self {
            ParamsMut::Host(p) => p,
            #[cfg(feature = "cuda")]
            ParamsMut::Device(p) => panic!("{}", host_code_on_device(p.device().ordinal())),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            ParamsMut::Host(p) => p.len(),
            #[cfg(feature = "cuda")]
            ParamsMut::Device(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A shorter-lived view of `range`.
    pub fn slice(&mut self, range: Range<usize>) -> ParamsMut<'_> {
        match self {
            ParamsMut::Host(p) => ParamsMut::Host(&mut p[range]),
            #[cfg(feature = "cuda")]
            ParamsMut::Device(p) => ParamsMut::Device(p.slice(range)),
        }
    }

    /// A shorter-lived view of all of it.
    pub fn reborrow(&mut self) -> ParamsMut<'_> {
        let len = self.len();
        self.slice(0..len)
    }

    pub fn split_at(self, mid: usize) -> (ParamsMut<'a>, ParamsMut<'a>) {
        match self {
            ParamsMut::Host(p) => {
                let (a, b) = p.split_at_mut(mid);
                (ParamsMut::Host(a), ParamsMut::Host(b))
            }
            #[cfg(feature = "cuda")]
            ParamsMut::Device(p) => {
                let (a, b) = p.split_at(mid);
                (ParamsMut::Device(a), ParamsMut::Device(b))
            }
        }
    }
}

impl<'a> From<&'a mut [f32]> for ParamsMut<'a> {
    fn from(p: &'a mut [f32]) -> Self {
        ParamsMut::Host(p)
    }
}

impl<'a> From<&'a mut Vec<f32>> for ParamsMut<'a> {
    fn from(p: &'a mut Vec<f32>) -> Self {
        ParamsMut::Host(p)
    }
}

#[cfg(feature = "cuda")]
fn host_code_on_device(ordinal: usize) -> String {
    format!(
        "parameters on cuda:{ordinal} reached a layer's host code: the layer has no CUDA \
         kernels (its Layer::runs_on should say so, and the trainer then refuses the device)"
    )
}

/// Sums small statistics across the data-parallel workers: what makes batch norm
/// SyncBatchNorm. The parallel crate implements it over a process group, so `nn` itself
/// stays free of communication.
pub trait StatsReducer: Send + Sync {
    /// Replaces `values` with their sum over all workers; every worker gets the identical
    /// result. A communication failure is fatal for the step (it panics with the error).
    fn sum(&self, values: &mut [f64]);
}

/// How a parameter is initialised (PyTorch's defaults where a layer has one).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    /// Uniform in ±bound (PyTorch's Linear/Conv default is bound = 1/√fan_in).
    Uniform(f32),
    /// Normal with this standard deviation.
    Normal(f32),
}

impl Init {
    pub fn fill(self, out: &mut [f32], rng: &mut SplitMix64) {
        match self {
            Init::Zeros => out.fill(0.0),
            Init::Ones => out.fill(1.0),
            Init::Uniform(b) => out
                .iter_mut()
                .for_each(|v| *v = (2.0 * rng.next_f32() - 1.0) * b),
            Init::Normal(s) => out.iter_mut().for_each(|v| *v = rng.normal() * s),
        }
    }
}

/// A named parameter (or buffer) of a layer, relative to the layer ("weight", "conv1.bias").
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    /// The shape this layer holds (a shard's shape under tensor parallelism).
    pub shape: Vec<usize>,
    pub init: Init,
    /// Under tensor parallelism: which part of the whole tensor this is. `None`: the whole
    /// tensor (on one worker, or replicated on every tensor-parallel rank).
    pub shard: Option<ShardSpec>,
}

impl ParamSpec {
    pub fn new(name: &str, shape: &[usize], init: Init) -> Self {
        ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
            shard: None,
        }
    }

    /// The shape of the whole tensor (what checkpoints store).
    pub fn full_shape(&self) -> Vec<usize> {
        match &self.shard {
            Some(s) => s.full_shape.clone(),
            None => self.shape.clone(),
        }
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Rank `index` of `parts`' share of a tensor of shape `full_shape`, cut along `dim`
/// (Megatron's column- or row-parallel split). The dimension holds `groups` equal groups
/// that are cut separately (a fused q/k/v weight: each of q, k, v split by heads), each
/// padded to a multiple of `parts` (a vocabulary not divisible by the tensor-parallel size;
/// padding rows belong to the last ranks and hold zeros in checkpoints' absence).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardSpec {
    pub dim: usize,
    pub parts: usize,
    pub index: usize,
    pub groups: usize,
    /// The whole (unpadded) tensor's shape.
    pub full_shape: Vec<usize>,
    /// Length of one group along `dim` after padding (a multiple of `parts`).
    pub padded_group: usize,
    /// Groups dealt to ranks instead of cut across them (see [`Deal`]); `None`: every rank
    /// holds a piece of every group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deal: Option<Deal>,
}

/// Grouped-query attention on more tensor-parallel ranks than key/value heads: the fused
/// q/k/v rows' `groups` key/value groups are dealt out, `replicas` consecutive ranks per
/// group. Each of them holds its `1/replicas` of the group's query rows (all but the last
/// `tail` rows of the group) and the group's whole key and value rows (the `tail`): those
/// are replicated, and their gradients are summed over the group's ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Deal {
    pub replicas: usize,
    pub tail: usize,
}

impl ShardSpec {
    /// The split of `full_shape` along `dim` into `parts` (`groups` groups, each padded up to
    /// a multiple of `parts`), as seen by rank `index`. The local shape is
    /// [`ShardSpec::local_shape`].
    pub fn new(
        full_shape: &[usize],
        dim: usize,
        groups: usize,
        parts: usize,
        index: usize,
    ) -> Self {
        let group = full_shape[dim] / groups;
        ShardSpec {
            dim,
            parts,
            index,
            groups,
            full_shape: full_shape.to_vec(),
            padded_group: group.div_ceil(parts) * parts,
            deal: None,
        }
    }

    /// Rank `index`'s share when `groups` groups along dimension 0 are dealt to
    /// `groups · deal.replicas` ranks ([`Deal`]). The caller checks that a group's rows less
    /// the tail divide by `replicas`.
    pub fn dealt(full_shape: &[usize], groups: usize, deal: Deal, index: usize) -> Self {
        ShardSpec {
            deal: Some(deal),
            ..ShardSpec::new(full_shape, 0, groups, groups * deal.replicas, index)
        }
    }

    /// With groups dealt: (this rank's group, its query rows per group, the tail rows).
    fn dealt_rows(&self, deal: Deal) -> (usize, usize, usize) {
        let group = self.full_shape[self.dim] / self.groups;
        (
            self.index / deal.replicas,
            (group - deal.tail) / deal.replicas,
            deal.tail,
        )
    }

    /// With groups dealt: the range of this shard's rows (along `dim`) that other ranks hold
    /// too (the replicated tail), and the group whose tail it is.
    pub fn replicated_rows(&self) -> Option<(Range<usize>, usize)> {
        let deal = self.deal?;
        let (group, rows, tail) = self.dealt_rows(deal);
        Some((rows..rows + tail, group))
    }

    /// Length of one group's share along `dim`.
    pub fn chunk(&self) -> usize {
        self.padded_group / self.parts
    }

    pub fn local_shape(&self) -> Vec<usize> {
        let mut shape = self.full_shape.clone();
        shape[self.dim] = match self.deal {
            Some(deal) => {
                let (_, rows, tail) = self.dealt_rows(deal);
                rows + tail
            }
            None => self.groups * self.chunk(),
        };
        shape
    }

    /// (outer, dim length, inner) of the whole tensor viewed around `dim`.
    fn view(&self) -> (usize, usize, usize) {
        let outer = self.full_shape[..self.dim].iter().product();
        let inner = self.full_shape[self.dim + 1..].iter().product();
        (outer, self.full_shape[self.dim], inner)
    }

    /// Visits every run of this shard: (offset in the whole tensor, offset in the shard,
    /// length), padding rows excluded (they have no place in the whole tensor).
    fn runs(&self, mut f: impl FnMut(usize, usize, usize)) {
        let (outer, len, inner) = self.view();
        if let Some(deal) = self.deal {
            let (g, rows, tail) = self.dealt_rows(deal);
            let group = len / self.groups;
            let start = g * group;
            let local_len = rows + tail;
            for o in 0..outer {
                let (whole, local) = (o * len, o * local_len);
                let q = start + (self.index % deal.replicas) * rows;
                f((whole + q) * inner, local * inner, rows * inner);
                let t = start + group - tail;
                f((whole + t) * inner, (local + rows) * inner, tail * inner);
            }
            return;
        }
        let group = len / self.groups;
        let chunk = self.chunk();
        let local_len = self.groups * chunk;
        for o in 0..outer {
            for g in 0..self.groups {
                let start = self.index * chunk;
                let real = group.saturating_sub(start).min(chunk);
                if real == 0 {
                    continue;
                }
                let whole = (o * len + g * group + start) * inner;
                let local = (o * local_len + g * chunk) * inner;
                f(whole, local, real * inner);
            }
        }
    }

    /// This rank's share of the whole tensor `whole` (padding rows zero).
    pub fn take(&self, whole: &[f32]) -> Vec<f32> {
        let mut local = vec![0.0f32; self.local_shape().iter().product()];
        self.runs(|w, l, n| local[l..l + n].copy_from_slice(&whole[w..w + n]));
        local
    }

    /// Writes this rank's share `local` into its place in the whole tensor `whole`.
    pub fn put(&self, local: &[f32], whole: &mut [f32]) {
        self.runs(|w, l, n| whole[w..w + n].copy_from_slice(&local[l..l + n]));
    }
}

/// How a tensor-parallel plan splits a layer (Megatron-LM's styles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpStyle {
    /// Output features split (`groups` equal groups split separately, e.g. 3 for a fused
    /// q/k/v projection); the input is replicated; no communication forward.
    Column { groups: usize },
    /// A fused q/k/v projection in the grouped-query layout (per key/value group: its query
    /// heads, then its key and value head, `head_dim` rows each): column-parallel by whole
    /// groups when tp divides `kv_heads`; on `r·kv_heads` ranks each group is dealt to `r`
    /// ranks that split its query heads and hold its key and value heads whole ([`Deal`]).
    GroupedQkv { kv_heads: usize, head_dim: usize },
    /// Input features split; the partial outputs are all-reduced (or reduce-scattered under
    /// sequence parallelism); the bias is replicated.
    Row,
    /// An output head split over the vocabulary: each rank computes its vocabulary's logits
    /// and the loss combines them without gathering (vocab-parallel cross-entropy).
    VocabHead,
}

/// Which layers of a model tensor parallelism splits, by layer path (`blocks.3.fc1`; block
/// names and child names joined by dots, empty names skipped) with `*` wildcards, as
/// torchtitan's `parallelize_module` plans do. Layers no rule names are replicated, except
/// the built-in attention core (split by heads) and GPT embedding (split by vocabulary).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorPlan {
    pub rules: Vec<(String, TpStyle)>,
}

/// Whether a forward pass trains (batch statistics, saved activations) and whether it may
/// update running statistics (false when a checkpointed block is recomputed in backward).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mode {
    pub train: bool,
    pub update_stats: bool,
}

impl Mode {
    pub const TRAIN: Mode = Mode {
        train: true,
        update_stats: true,
    };
    pub const EVAL: Mode = Mode {
        train: false,
        update_stats: false,
    };
    pub const RECOMPUTE: Mode = Mode {
        train: true,
        update_stats: false,
    };
}

/// What a forward pass keeps for its backward: tensors, integer indices (max-pool winners),
/// small statistics, and the saved state of sub-layers, in the order they ran.
#[derive(Default, Debug)]
pub struct Saved {
    pub tensors: Vec<Tensor>,
    pub indices: Vec<Vec<u32>>,
    pub stats: Vec<Vec<f32>>,
    pub children: Vec<Saved>,
    /// Activations kept in 16 bits under mixed precision ([`Saved::keep`]).
    pub halves: Vec<HalfTensor>,
}

impl Saved {
    /// Bytes held (for activation-memory accounting).
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(Tensor::bytes).sum::<usize>()
            + self.indices.iter().map(|i| i.len() * 4).sum::<usize>()
            + self.stats.iter().map(|s| s.len() * 4).sum::<usize>()
            + self.children.iter().map(Saved::bytes).sum::<usize>()
            + self.halves.iter().map(HalfTensor::bytes).sum::<usize>()
    }

    /// Keeps an activation for backward: as it is in f32, or rounded to `precision` (bf16,
    /// f16) under mixed precision, where the products that read it in backward round it there
    /// anyway: half the memory for the same gradients. [`Saved::take`] with the same
    /// precision gives it back.
    pub fn keep(&mut self, t: Tensor, precision: DType) {
        match precision {
            DType::F32 => self.tensors.push(t),
            _ => self.halves.push(HalfTensor::from_tensor(t, precision)),
        }
    }

    /// Replaces the activation kept at `precision` `from_end` places before the last one
    /// (0: the last) by `t` (a layer that keeps less than its inner layer did: a sequence-
    /// parallel layer keeps its own tokens, not the gathered ones).
    pub fn replace_kept(&mut self, precision: DType, from_end: usize, t: Tensor) {
        match precision {
            DType::F32 => {
                let at = self.tensors.len() - 1 - from_end;
                std::mem::replace(&mut self.tensors[at], t).recycle();
            }
            _ => {
                let at = self.halves.len() - 1 - from_end;
                self.halves[at] = HalfTensor::from_tensor(t, precision);
            }
        }
    }

    /// The last activation [`Saved::keep`] stored at `precision`, in f32.
    pub fn take(&mut self, precision: DType, what: &str) -> Tensor {
        self.take_kept(precision, what).into_tensor()
    }

    /// The last activation [`Saved::keep`] stored at `precision`, as it is stored (a product
    /// can read bf16 bits without widening them first).
    pub fn take_kept(&mut self, precision: DType, what: &str) -> Kept {
        let kept = match precision {
            DType::F32 => self.tensors.pop().map(Kept::F32),
            _ => self.halves.pop().map(Kept::Half),
        };
        kept.unwrap_or_else(|| panic!("{what}: nothing saved for backward"))
    }
}

/// An activation kept for backward, in the precision it was kept in.
pub enum Kept {
    F32(Tensor),
    Half(HalfTensor),
}

impl Kept {
    /// The values in f32 (16-bit ones widened exactly).
    pub fn into_tensor(self) -> Tensor {
        match self {
            Kept::F32(t) => t,
            Kept::Half(h) => h.into_tensor(),
        }
    }

    pub fn numel(&self) -> usize {
        match self {
            Kept::F32(t) => t.numel(),
            Kept::Half(h) => h.numel(),
        }
    }

    pub fn shape(&self) -> &[usize] {
        match self {
            Kept::F32(t) => t.shape(),
            Kept::Half(h) => h.shape(),
        }
    }

    /// Done with it: an f32 buffer goes back to the thread's pool.
    pub fn recycle(self) {
        if let Kept::F32(t) = self {
            t.recycle();
        }
    }
}

/// [`Layer::backward_add_into`]'s default: `dx += layer.backward(..)`.
pub fn add_backward_into<L: Layer + ?Sized>(
    layer: &L,
    params: Params<'_>,
    grads: ParamsMut<'_>,
    saved: Saved,
    dy: Tensor,
    dx: &mut Tensor,
) {
    let g = layer
        .backward(params, grads, saved, dy, true)
        .expect("a residual branch's first layer returns its input gradient");
    dx.add_assign(&g);
}

/// A layer's input or output where residual adds join the stream: a tensor, or an add left
/// undone (`stream + branch`) for the next layer to do first ([`Layer::forward_residual`]):
/// a transformer block's last add, taken by the next block's first norm in its kernel.
pub enum Stream {
    Ready(Tensor),
    Pending { stream: Tensor, branch: Tensor },
}

impl Stream {
    /// The tensor, doing a pending add (`stream += branch`, as the block would have).
    pub fn resolve(self) -> Tensor {
        match self {
            Stream::Ready(x) => x,
            Stream::Pending { mut stream, branch } => {
                stream.add_assign(&branch);
                stream
            }
        }
    }
}

/// [`Layer::forward_residual`]'s default: a pending add done by [`Layer::add_then_forward`]
/// (the layer's forward of the sum), a ready input by [`Layer::forward`]; never leaves an add.
pub fn forward_residual<L: Layer + ?Sized>(
    layer: &L,
    params: Params<'_>,
    buffers: ParamsMut<'_>,
    input: Stream,
    mode: Mode,
    saved: &mut Saved,
) -> Stream {
    Stream::Ready(match input {
        Stream::Ready(x) => layer.forward(params, buffers, x, mode, saved),
        Stream::Pending { mut stream, branch } => {
            layer.add_then_forward(params, buffers, &mut stream, branch, mode, saved)
        }
    })
}

/// [`Layer::add_then_forward`]'s default: `*stream += branch`, then `layer`'s forward of the
/// new stream.
pub fn add_then_forward<L: Layer + ?Sized>(
    layer: &L,
    params: Params<'_>,
    buffers: ParamsMut<'_>,
    stream: &mut Tensor,
    branch: Tensor,
    mode: Mode,
    saved: &mut Saved,
) -> Tensor {
    stream.add_assign(&branch);
    drop(branch);
    layer.forward(params, buffers, stream.clone(), mode, saved)
}

/// [`Layer::backward_into_activation`]'s default: the layer's backward, then `act`'s.
pub fn backward_then_activation<L: Layer + ?Sized>(
    layer: &L,
    params: Params<'_>,
    grads: ParamsMut<'_>,
    saved: Saved,
    dy: Tensor,
    act: &OutputActivation,
) -> Tensor {
    let dx = layer
        .backward(params, grads, saved, dy, true)
        .expect("a layer asked for its input gradient returns it");
    act.backward(dx)
}

/// The activation at the end of a layer (a linear layer's GELU), offered to the layer after
/// it ([`Layer::output_activation`]) so that the activation's gradient is taken in that
/// layer's input-gradient product: on a GPU, cuBLASLt's GELU-gradient epilogue writes the
/// gradient with respect to the pre-activation directly, where the activation's own
/// backward would write the gradient with respect to its output and read it back. `input`
/// is what the activation's backward reads (the pre-activation, or the output for sigmoid
/// and tanh), as the offering layer kept it.
pub struct OutputActivation {
    pub kind: meshtrain_tensor::activation::Activation,
    pub input: Tensor,
}

impl OutputActivation {
    /// The activation's backward on its own: `dy` (with respect to its output) into the
    /// gradient with respect to its input, on the device the tensors are on.
    pub fn backward(&self, dy: Tensor) -> Tensor {
        #[cfg(feature = "cuda")]
        if self.input.cuda().is_some() {
            return crate::device::act_backward(self.kind, self.input.clone(), dy);
        }
        let mut grad = dy.to_host();
        self.kind
            .backward_in_place(self.input.to_host().data(), grad.data_mut());
        grad
    }
}

/// A layer: parameters are given as slices of the model's flat buffers, in the order of
/// [`Layer::params`]; gradients are *accumulated* into `grads` (so micro-batches add up).
///
/// The buffers live where the step runs ([`Params`]): on the host, a layer reads
/// `params.host()`; on a GPU, its tensors are device tensors and it runs device kernels
/// (`meshtrain_tensor::cuda::ops`). A layer written only for the CPU keeps working there;
/// to run on a GPU it adds a device path and says so in [`Layer::runs_on`].
pub trait Layer: Send + Sync {
    /// Trainable parameters, in storage order.
    fn params(&self) -> Vec<ParamSpec> {
        Vec::new()
    }

    /// Non-trainable state (batch-norm running statistics), in storage order.
    fn buffers(&self) -> Vec<ParamSpec> {
        Vec::new()
    }

    fn forward(
        &self,
        params: Params<'_>,
        buffers: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        saved: &mut Saved,
    ) -> Tensor;

    /// Returns the input gradient when `need_dx` (the first layer of a model skips it).
    fn backward(
        &self,
        params: Params<'_>,
        grads: ParamsMut<'_>,
        saved: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor>;

    /// `*stream += branch` (a residual add), then this layer's [`Layer::forward`] of the
    /// stream's new value: where one residual branch ends and the next begins with this layer
    /// (a transformer block's second norm). The default adds, then runs the forward; a norm on
    /// a GPU does both in one kernel, which saves a pass over the residual stream and gives
    /// the same bits (one f32 addition either way). [`Layer::backward_add_into`] is its
    /// backward twin.
    fn add_then_forward(
        &self,
        params: Params<'_>,
        buffers: ParamsMut<'_>,
        stream: &mut Tensor,
        branch: Tensor,
        mode: Mode,
        saved: &mut Saved,
    ) -> Tensor {
        add_then_forward(self, params, buffers, stream, branch, mode, saved)
    }

    /// [`Layer::forward`] between residual adds, as a model runs its blocks: `input` may be an
    /// add the layer before left undone (done first, as [`Layer::add_then_forward`]), and
    /// with `leave_add` a layer ending in a residual add may return it undone
    /// ([`Stream::Pending`]) for the next layer to take in its first kernel. The output's
    /// value (resolved) and the saved state are [`Layer::forward`]'s of the input's value.
    /// The default never leaves an add; a transformer block does.
    fn forward_residual(
        &self,
        params: Params<'_>,
        buffers: ParamsMut<'_>,
        input: Stream,
        leave_add: bool,
        mode: Mode,
        saved: &mut Saved,
    ) -> Stream {
        let _ = leave_add;
        forward_residual(self, params, buffers, input, mode, saved)
    }

    /// Adds the input gradient into `dx` instead of returning it: where a residual branch
    /// begins (its first layer), the branch's gradient joins the stream's. The default adds
    /// what [`Layer::backward`] returns; a norm on a GPU adds inside its own kernel, which
    /// saves a pass over the residual stream per branch and gives the same bits (one f32
    /// addition either way).
    fn backward_add_into(
        &self,
        params: Params<'_>,
        grads: ParamsMut<'_>,
        saved: Saved,
        dy: Tensor,
        dx: &mut Tensor,
    ) {
        add_backward_into(self, params, grads, saved, dy, dx);
    }

    /// The activation this layer ends with, offered to the layer after it
    /// ([`OutputActivation`]): its kind and what its backward reads, from `saved` (not
    /// consumed). A block that takes the offer runs the next layer's
    /// [`Layer::backward_into_activation`] and then this one's
    /// [`Layer::backward_from_pre_activation`]. `None` (the default): the layer
    /// differentiates its own activation, if it has one.
    fn output_activation(&self, saved: &Saved) -> Option<OutputActivation> {
        let _ = saved;
        None
    }

    /// [`Layer::backward`] whose input gradient is taken on through `act`, the previous
    /// layer's output activation: returns the gradient with respect to the activation's
    /// input. The default runs the activation's backward after this layer's; a layer that
    /// can take it inside its own product (a linear layer on a GPU) overrides it.
    fn backward_into_activation(
        &self,
        params: Params<'_>,
        grads: ParamsMut<'_>,
        saved: Saved,
        dy: Tensor,
        act: &OutputActivation,
    ) -> Tensor {
        backward_then_activation(self, params, grads, saved, dy, act)
    }

    /// Backward given `dz`, the gradient with respect to the input of the activation this
    /// layer offered ([`Layer::output_activation`]), whose gradient the layer after it took.
    /// Only a layer that offers an activation is asked; the default says so.
    fn backward_from_pre_activation(
        &self,
        params: Params<'_>,
        grads: ParamsMut<'_>,
        saved: Saved,
        dz: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        let _ = (params, grads, saved, dz, need_dx);
        unreachable!("backward_from_pre_activation of a layer that offers no output activation")
    }

    /// Forward for generation with a key/value cache ([`crate::cache`]): the rows of `x` are
    /// positions `cache.start()..` of one sequence (batch 1), after the ones the cache holds.
    /// A layer that treats every position alike and alone (a linear layer, a norm, an
    /// activation) needs nothing more than its evaluation forward, which is the default; a
    /// layer that reads positions (an embedding's position table, rotary angles) or other
    /// positions (attention) overrides it, and says so in [`Layer::reads_positions`]; a
    /// composite layer runs its children's. `None`: this layer cannot run cached (it reads
    /// positions and has no cached forward), which a decoder reports by the layer's name.
    fn forward_cached(
        &self,
        params: Params<'_>,
        buffers: ParamsMut<'_>,
        x: Tensor,
        cache: &mut crate::cache::KvCache,
    ) -> Option<Tensor> {
        let _ = cache;
        if self.reads_positions() {
            return None;
        }
        Some(self.forward(params, buffers, x, Mode::EVAL, &mut Saved::default()))
    }

    /// Whether a row's output depends on its position or on other rows (attention, a position
    /// table, rotary angles): such a layer needs its own [`Layer::forward_cached`]. A
    /// composite layer reads positions when a child does.
    fn reads_positions(&self) -> bool {
        self.children()
            .is_some_and(|c| c.layers().iter().any(|(_, l)| l.reads_positions()))
    }

    /// Whether this layer has kernels for `device`. A composite layer runs where all its
    /// children run; a leaf runs on the CPU unless it says more. A trainer asks before any
    /// work, so `--device cuda` with a layer that has no CUDA kernels is a clear error naming
    /// the layer, not a failure inside it.
    fn runs_on(&self, device: Device) -> bool {
        match self.children() {
            Some(children) => children.layers().iter().all(|(_, l)| l.runs_on(device)),
            None => device.is_cpu(),
        }
    }

    /// Why this layer cannot train on `device` although it has kernels there (a shape its
    /// training kernels do not take), for the trainer's refusal before any work; `None` when
    /// it can, or when it has no kernels there at all ([`Layer::runs_on`] says that).
    /// `runs_on` stays true for such a shape where other kernels take it (generation's).
    fn refusal_on(&self, _device: Device) -> Option<String> {
        None
    }

    /// Gives every batch-norm layer inside this one the reducer that synchronises its batch
    /// statistics across workers (SyncBatchNorm), or `None` for local statistics again.
    /// Composite layers forward it to their children; other layers ignore it.
    fn set_stats_reducer(&mut self, _reducer: Option<Arc<dyn StatsReducer>>) {}

    /// Sets the precision of this layer's matrix products' inputs (mixed precision: bf16 or
    /// f16 inputs, f32 accumulation and f32 everywhere else); `DType::F32` by default. Layers
    /// with products override it; [`crate::Model::set_precision`] reaches every layer through
    /// [`Layer::children_mut`], so a composite layer only has to expose its children.
    fn set_precision(&mut self, _precision: DType) {}

    /// Runs this layer's linear products in FP8 when `on` (Hopper-class GPUs' E4M3/E5M2
    /// tensor-core products, with per-tensor current scaling; [`meshtrain_tensor::fp8`]),
    /// after [`Layer::set_precision`] set the bf16 of everything else. Layers with such
    /// products override it (a [`crate::layers::Linear`]; attention's products stay bf16, as
    /// in Transformer Engine and torchao); [`crate::Model::set_fp8_products`] reaches every
    /// layer through [`Layer::children_mut`].
    fn set_fp8_products(&mut self, _on: bool) {}

    /// The layer as `Any`, so a transform (tensor parallelism) can recognise built-in layer
    /// types. Layers that want to be recognised return `Some(self)`.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// A composite layer's children, so a transform can check them. Leaves return `None`.
    fn children(&self) -> Option<&crate::layers::Children> {
        None
    }

    /// A composite layer's children, so a transform can replace them (call
    /// [`crate::layers::Children::relayout`] after replacing). Leaves return `None`.
    fn children_mut(&mut self) -> Option<&mut crate::layers::Children> {
        None
    }
}

/// Total element count of a spec list.
pub fn spec_len(specs: &[ParamSpec]) -> usize {
    specs.iter().map(ParamSpec::len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two key/value groups of 2 query rows + 1 key + 1 value row (tail 2), dealt to 4 ranks
    /// (2 replicas a group), 3 columns: each rank holds one query row of its group and the
    /// group's key and value rows; putting every rank's share back rebuilds the whole tensor.
    #[test]
    fn dealt_groups_give_each_rank_its_query_rows_and_the_whole_tail() {
        let full = [8usize, 3];
        let whole: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let deal = Deal {
            replicas: 2,
            tail: 2,
        };
        let mut rebuilt = vec![f32::NAN; 24];
        for rank in 0..4 {
            let s = ShardSpec::dealt(&full, 2, deal, rank);
            assert_eq!(s.local_shape(), vec![3, 3]);
            let local = s.take(&whole);
            let (group, query) = (rank / 2, rank % 2);
            let row = |r: usize| whole[r * 3..r * 3 + 3].to_vec();
            let want = [
                row(group * 4 + query),
                row(group * 4 + 2),
                row(group * 4 + 3),
            ]
            .concat();
            assert_eq!(local, want, "rank {rank}");
            assert_eq!(s.replicated_rows(), Some((1..3, group)));
            s.put(&local, &mut rebuilt);
        }
        assert_eq!(rebuilt, whole);
    }
}
