//! A model is an ordered list of named blocks over one flat parameter buffer.
//!
//! Two optional facts make a model usable by a trainer without further glue: the input it
//! takes ([`InputSpec`], checked against a dataset before any work), and parameters tied
//! across blocks ([`TiedParams`], e.g. a GPT's token embedding and output head).

use crate::layer::{
    spec_len, Layer, Mode, ParamSpec, Params, ParamsMut, Saved, ShardSpec, StatsReducer, Stream,
    TensorPlan,
};
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::{DType, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// One cut point of a model: pipeline stages take contiguous ranges of blocks.
pub struct Block {
    /// Prefix of the block's parameter names ("stage1.0", "blocks.3"; empty for none).
    pub name: String,
    pub layer: Box<dyn Layer>,
}

impl Block {
    pub fn new(name: &str, layer: impl Layer + 'static) -> Self {
        Block {
            name: name.to_string(),
            layer: Box::new(layer),
        }
    }
}

/// What one sample of a model's input is: float features of a shape, or integer token ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputSpec {
    pub kind: InputKind,
    /// Shape of one sample (`[1, 28, 28]` for an image, `[seq]` for a token sequence).
    pub shape: Vec<usize>,
}

/// Float features, or integer ids below `vocab` (carried to the model as exact f32 values,
/// so at most 2²⁴).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    Float,
    Tokens { vocab: usize },
}

impl InputSpec {
    pub fn float(shape: &[usize]) -> Self {
        InputSpec {
            kind: InputKind::Float,
            shape: shape.to_vec(),
        }
    }

    pub fn tokens(seq: usize, vocab: usize) -> Self {
        InputSpec {
            kind: InputKind::Tokens { vocab },
            shape: vec![seq],
        }
    }

    /// Values per sample.
    pub fn sample_len(&self) -> usize {
        self.shape.iter().product()
    }
}

impl std::fmt::Display for InputSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            InputKind::Float => write!(f, "float features of shape {:?}", self.shape),
            InputKind::Tokens { vocab } => {
                write!(f, "token ids below {vocab} of shape {:?}", self.shape)
            }
        }
    }
}

/// One parameter of the model held in several places (Megatron's tied embeddings): entry
/// `primary` of [`Model::params`] and its `copies`, each in its own block so a pipeline can
/// put them on different stages. Copies start equal to the primary; a trainer adds their
/// gradients up (across stages if need be) and gives every copy the sum, so all stay equal.
/// Checkpoints store the primary only, and norms count it once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TiedParams {
    pub primary: usize,
    pub copies: Vec<usize>,
}

/// A model that cannot be put together as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("the model has no parameter named '{0}'")]
    UnknownParam(String),
    #[error(
        "cannot tie '{copy}' {copy_shape:?} to '{primary}' {primary_shape:?}: the shapes differ"
    )]
    TieShape {
        copy: String,
        copy_shape: Vec<usize>,
        primary: String,
        primary_shape: Vec<usize>,
    },
    #[error("cannot tie '{0}': it is already tied")]
    AlreadyTied(String),
    #[error("cannot tie '{0}' to itself")]
    SelfTie(String),
}

/// Where a named parameter (or buffer) lives in the flat buffer.
#[derive(Clone, Debug)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
    pub block: usize,
    spec: ParamSpec,
}

impl ParamEntry {
    /// Which part of the whole tensor this worker holds (tensor parallelism), if a part.
    pub fn shard(&self) -> Option<&ShardSpec> {
        self.spec.shard.as_ref()
    }

    /// The whole tensor's shape (what checkpoints store).
    pub fn full_shape(&self) -> Vec<usize> {
        self.spec.full_shape()
    }
}

/// Parameters, their gradients and the non-trainable buffers, each one contiguous vector.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamStore {
    pub values: Vec<f32>,
    pub grads: Vec<f32>,
    pub buffers: Vec<f32>,
}

impl ParamStore {
    pub fn zero_grads(&mut self) {
        self.grads.fill(0.0);
    }
}

/// What backward keeps per block: the full saved state, or only the block's input when the
/// block is recomputed in backward (activation checkpointing).
pub enum BlockSaved {
    Full(Saved),
    Recompute(Tensor),
}

impl BlockSaved {
    pub fn bytes(&self) -> usize {
        match self {
            BlockSaved::Full(s) => s.bytes(),
            BlockSaved::Recompute(t) => t.bytes(),
        }
    }
}

/// The activations a forward pass over a range of blocks keeps for its backward.
pub struct Activations {
    pub range: Range<usize>,
    pub blocks: Vec<BlockSaved>,
}

impl Activations {
    pub fn bytes(&self) -> usize {
        self.blocks.iter().map(BlockSaved::bytes).sum()
    }
}

pub struct Model {
    pub blocks: Vec<Block>,
    params: Vec<ParamEntry>,
    buffers: Vec<ParamEntry>,
    block_params: Vec<Range<usize>>,
    block_buffers: Vec<Range<usize>>,
    input: Option<InputSpec>,
    ties: Vec<TiedParams>,
    tensor_plan: Option<TensorPlan>,
}

fn layout(
    blocks: &[Block],
    specs_of: impl Fn(&dyn Layer) -> Vec<ParamSpec>,
) -> (Vec<ParamEntry>, Vec<Range<usize>>) {
    let (mut entries, mut ranges, mut off) = (Vec::new(), Vec::new(), 0);
    for (bi, b) in blocks.iter().enumerate() {
        let start = off;
        for spec in specs_of(b.layer.as_ref()) {
            let len = spec.len();
            let name = if b.name.is_empty() {
                spec.name.clone()
            } else {
                format!("{}.{}", b.name, spec.name)
            };
            entries.push(ParamEntry {
                name,
                shape: spec.shape.clone(),
                range: off..off + len,
                block: bi,
                spec,
            });
            off += len;
        }
        ranges.push(start..off);
    }
    (entries, ranges)
}

impl Model {
    pub fn new(blocks: Vec<Block>) -> Self {
        let (params, block_params) = layout(&blocks, |l| l.params());
        let (buffers, block_buffers) = layout(&blocks, |l| l.buffers());
        debug_assert!(blocks
            .iter()
            .zip(&block_params)
            .all(|(b, r)| spec_len(&b.layer.params()) == r.len()));
        Model {
            blocks,
            params,
            buffers,
            block_params,
            block_buffers,
            input: None,
            ties: Vec::new(),
            tensor_plan: None,
        }
    }

    /// Declares how tensor parallelism splits this model's layers ([`TensorPlan`]).
    pub fn with_tensor_plan(mut self, plan: TensorPlan) -> Self {
        self.tensor_plan = Some(plan);
        self
    }

    pub fn tensor_plan(&self) -> Option<&TensorPlan> {
        self.tensor_plan.as_ref()
    }

    /// The same model with its blocks' layers changed in place by `f` (a transform such as
    /// tensor parallelism replaces layers inside the blocks); the flat-buffer layout is
    /// recomputed, the input, ties and plan are kept (ties are found again by name).
    pub fn transform_blocks<E>(
        self,
        f: impl FnOnce(&mut [Block]) -> Result<(), E>,
    ) -> Result<Model, E> {
        let Model {
            mut blocks,
            params,
            input,
            ties,
            tensor_plan,
            ..
        } = self;
        f(&mut blocks)?;
        let mut model = Model::new(blocks);
        model.input = input;
        model.tensor_plan = tensor_plan;
        for t in ties {
            let name = |i: usize| params[i].name.clone();
            for c in t.copies {
                model = model
                    .tie(&name(c), &name(t.primary))
                    .expect("a transform keeps tied parameters' names and shapes alike");
            }
        }
        Ok(model)
    }

    /// Declares what one input sample is, so a trainer can check a dataset against the model
    /// before any work starts.
    pub fn with_input(mut self, input: InputSpec) -> Self {
        self.input = Some(input);
        self
    }

    /// The declared input, if any.
    pub fn input(&self) -> Option<&InputSpec> {
        self.input.as_ref()
    }

    /// Ties parameter `copy` to `primary` (full names, e.g. `head.weight` to `tok.weight`):
    /// from then on they are one parameter of the model (see [`TiedParams`]).
    pub fn tie(mut self, copy: &str, primary: &str) -> Result<Self, ModelError> {
        let index = |name: &str| {
            self.param_index(name)
                .ok_or_else(|| ModelError::UnknownParam(name.to_string()))
        };
        let (c, p) = (index(copy)?, index(primary)?);
        if c == p {
            return Err(ModelError::SelfTie(copy.to_string()));
        }
        if self.params[c].shape != self.params[p].shape {
            return Err(ModelError::TieShape {
                copy: copy.to_string(),
                copy_shape: self.params[c].shape.clone(),
                primary: primary.to_string(),
                primary_shape: self.params[p].shape.clone(),
            });
        }
        if self.tied_primary(c).is_some() || self.ties.iter().any(|t| t.primary == c) {
            return Err(ModelError::AlreadyTied(copy.to_string()));
        }
        if self.tied_primary(p).is_some() {
            return Err(ModelError::AlreadyTied(primary.to_string()));
        }
        match self.ties.iter_mut().find(|t| t.primary == p) {
            Some(t) => t.copies.push(c),
            None => self.ties.push(TiedParams {
                primary: p,
                copies: vec![c],
            }),
        }
        Ok(self)
    }

    /// The tied parameter groups (see [`Model::tie`]).
    pub fn ties(&self) -> &[TiedParams] {
        &self.ties
    }

    /// If parameter `i` is a tied copy, the index of its primary.
    pub fn tied_primary(&self, i: usize) -> Option<usize> {
        self.ties
            .iter()
            .find(|t| t.copies.contains(&i))
            .map(|t| t.primary)
    }

    /// Index in [`Model::params`] of the parameter called `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|e| e.name == name)
    }

    /// The parameter called `name` as stored (a tied copy's primary: the one a checkpoint
    /// holds) and its values in the whole model's flat `values`.
    pub fn stored_param<'v>(
        &self,
        values: &'v [f32],
        name: &str,
    ) -> Option<(&ParamEntry, &'v [f32])> {
        let i = self.param_index(name)?;
        let entry = &self.params[self.tied_primary(i).unwrap_or(i)];
        Some((entry, &values[entry.range.clone()]))
    }

    /// Parameters counting each tied group once (what PyTorch's `numel` sum reports).
    pub fn num_unique_params(&self) -> usize {
        let copies: usize = self
            .ties
            .iter()
            .flat_map(|t| &t.copies)
            .map(|&c| self.params[c].range.len())
            .sum();
        self.num_params() - copies
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_params(&self) -> usize {
        self.block_params.last().map_or(0, |r| r.end)
    }

    pub fn num_buffers(&self) -> usize {
        self.block_buffers.last().map_or(0, |r| r.end)
    }

    /// Named parameters with their ranges in the flat buffer, in storage order.
    pub fn params(&self) -> &[ParamEntry] {
        &self.params
    }

    pub fn buffers(&self) -> &[ParamEntry] {
        &self.buffers
    }

    /// The flat-buffer range holding block `i`'s parameters (gradients use the same range).
    pub fn block_param_range(&self, i: usize) -> Range<usize> {
        self.block_params[i].clone()
    }

    /// Turns every batch norm of the model into SyncBatchNorm over `reducer` (or back into
    /// local batch norm with `None`), like PyTorch's `convert_sync_batchnorm`.
    pub fn set_stats_reducer(&mut self, reducer: Option<Arc<dyn StatsReducer>>) {
        for block in &mut self.blocks {
            block.layer.set_stats_reducer(reducer.clone());
        }
    }

    /// Runs every matrix product of the model with `precision` inputs (bf16/f16 mixed
    /// precision, or f32), like `torch.autocast` does for its op list: each layer that has
    /// products is told through [`Layer::set_precision`], composites via their children.
    pub fn set_precision(&mut self, precision: DType) {
        let all = 0..self.blocks.len();
        self.each_layer_of(all, &mut |layer| layer.set_precision(precision));
    }

    /// `f` on every layer of blocks `blocks`, composites and their children alike.
    fn each_layer_of(&mut self, blocks: Range<usize>, f: &mut dyn FnMut(&mut dyn Layer)) {
        fn visit(layer: &mut dyn Layer, f: &mut dyn FnMut(&mut dyn Layer)) {
            f(layer);
            if let Some(children) = layer.children_mut() {
                for (_, child) in children.layers_mut() {
                    visit(child.as_mut(), f);
                }
            }
        }
        for block in self.blocks.get_mut(blocks).unwrap_or_default() {
            visit(block.layer.as_mut(), f);
        }
    }

    /// Runs the linear products of every block but the first and the last in FP8 when `on`
    /// ([`Layer::set_fp8_products`], composites via their children). The first block (a
    /// transformer's embedding) and the last (its final norm and output head) keep bf16, as
    /// the FP8 recipes advise (Transformer Engine's guidance; torchtitan leaves the output
    /// layer out of float8): the logits' product is the most sensitive to rounding, and a
    /// model's ends are a small share of its products.
    pub fn set_fp8_products(&mut self, on: bool) {
        let inner = 1..self.blocks.len().saturating_sub(1);
        self.each_layer_of(inner, &mut |layer| layer.set_fp8_products(on));
    }

    /// Fresh parameters: each tensor drawn from its own stream forked from `seed`, so adding a
    /// layer never changes the initial values of the others.
    pub fn init(&self, seed: u64) -> ParamStore {
        self.init_blocks(seed, 0..self.num_blocks())
    }

    /// Fresh parameters of blocks `blocks` only (a pipeline stage's share): the same values as
    /// the matching slices of [`Model::init`], without allocating the rest of the model.
    pub fn init_blocks(&self, seed: u64, blocks: Range<usize>) -> ParamStore {
        let pr = self.blocks_param_range(blocks.clone());
        let mut values = vec![0.0f32; pr.len()];
        for (i, e) in self.params.iter().enumerate() {
            if blocks.contains(&e.block) {
                let local = e.range.start - pr.start..e.range.end - pr.start;
                self.init_param(seed, i, &mut values[local]);
            }
        }
        let buffers = self.init_buffers(blocks);
        ParamStore {
            grads: vec![0.0; values.len()],
            values,
            buffers,
        }
    }

    /// Parameter `i`'s initial values (what [`Model::init`] gives it) into `out`, without
    /// initialising anything else: a sharded store (ZeRO-3) keeps its pieces of one
    /// parameter at a time instead of materialising the whole model.
    pub fn init_param(&self, seed: u64, i: usize, out: &mut [f32]) {
        let e = &self.params[i];
        // A tied copy draws exactly its primary's values.
        let source = self.tied_primary(i).unwrap_or(i);
        let mut rng = SplitMix64::derive(seed, source as u64);
        let init = self.params[source].spec.init;
        match &e.spec.shard {
            // A shard draws the whole tensor's values (those one worker would have) and
            // keeps its part.
            Some(shard) => {
                let mut whole = vec![0.0f32; shard.full_shape.iter().product()];
                init.fill(&mut whole, &mut rng);
                out.copy_from_slice(&shard.take(&whole));
            }
            None => init.fill(out, &mut rng),
        }
    }

    /// The initial non-trainable buffers of blocks `blocks`.
    pub fn init_buffers(&self, blocks: Range<usize>) -> Vec<f32> {
        let br = self.blocks_buffer_range(blocks.clone());
        let mut buffers = vec![0.0f32; br.len()];
        for e in self.buffers.iter().filter(|e| blocks.contains(&e.block)) {
            let local = e.range.start - br.start..e.range.end - br.start;
            e.spec
                .init
                .fill(&mut buffers[local], &mut SplitMix64::new(0));
        }
        buffers
    }

    /// The flat-buffer range holding the parameters of the contiguous blocks `blocks`.
    pub fn blocks_param_range(&self, blocks: Range<usize>) -> Range<usize> {
        span_of(&self.block_params, blocks)
    }

    /// The flat-buffer range holding the non-trainable buffers of the blocks `blocks`.
    pub fn blocks_buffer_range(&self, blocks: Range<usize>) -> Range<usize> {
        span_of(&self.block_buffers, blocks)
    }

    /// The share of a whole-model store that blocks `blocks` own (values, gradients and
    /// buffers), as a store for [`Model::forward_local`] / [`Model::backward_local`].
    pub fn slice_store(&self, full: &ParamStore, blocks: Range<usize>) -> ParamStore {
        let (pr, br) = (
            self.blocks_param_range(blocks.clone()),
            self.blocks_buffer_range(blocks),
        );
        ParamStore {
            values: full.values[pr.clone()].to_vec(),
            grads: full.grads[pr].to_vec(),
            buffers: full.buffers[br].to_vec(),
        }
    }

    /// Where a store holding exactly the blocks `range` starts in the whole-model buffers.
    /// Panics (a programming error, not bad input) if the store has another size.
    fn local_base(&self, store: &ParamStore, range: &Range<usize>) -> Base {
        let (pr, br) = (
            self.blocks_param_range(range.clone()),
            self.blocks_buffer_range(range.clone()),
        );
        assert!(
            store.values.len() == pr.len()
                && store.grads.len() == pr.len()
                && store.buffers.len() == br.len(),
            "a local store for blocks {range:?} needs {} parameters and {} buffer values, \
             this one has {} values, {} gradients and {} buffer values",
            pr.len(),
            br.len(),
            store.values.len(),
            store.grads.len(),
            store.buffers.len()
        );
        Base {
            params: pr.start,
            buffers: br.start,
        }
    }

    fn param_slot(&self, i: usize, base: Base) -> Range<usize> {
        let r = &self.block_params[i];
        r.start - base.params..r.end - base.params
    }

    fn buffer_slot(&self, i: usize, base: Base) -> Range<usize> {
        let r = &self.block_buffers[i];
        r.start - base.buffers..r.end - base.buffers
    }

    /// Forward through blocks `range`; blocks listed in `recompute` keep only their input.
    pub fn forward(
        &self,
        store: &mut ParamStore,
        x: Tensor,
        range: Range<usize>,
        mode: Mode,
        recompute: &dyn Fn(usize) -> bool,
    ) -> (Tensor, Activations) {
        self.forward_at(store, Base::WHOLE, x, range, mode, recompute)
    }

    /// [`Model::forward`] on a store that holds only the blocks `range` (from
    /// [`Model::init_blocks`] or [`Model::slice_store`]): a pipeline stage keeps just its
    /// own parameters and optimizer state.
    pub fn forward_local(
        &self,
        store: &mut ParamStore,
        x: Tensor,
        range: Range<usize>,
        mode: Mode,
        recompute: &dyn Fn(usize) -> bool,
    ) -> (Tensor, Activations) {
        let base = self.local_base(store, &range);
        self.forward_at(store, base, x, range, mode, recompute)
    }

    fn forward_at(
        &self,
        store: &mut ParamStore,
        base: Base,
        x: Tensor,
        range: Range<usize>,
        mode: Mode,
        recompute: &dyn Fn(usize) -> bool,
    ) -> (Tensor, Activations) {
        let mut params = StoreParams {
            model: self,
            store,
            base,
        };
        self.forward_with(&mut params, x, range, mode, recompute)
    }

    /// Forward through blocks `range`, each block's parameters taken from `params` just
    /// before it runs (a sharded store gathers them there, [`BlockParams`]).
    pub fn forward_with(
        &self,
        params: &mut dyn BlockParams,
        x: Tensor,
        range: Range<usize>,
        mode: Mode,
        recompute: &dyn Fn(usize) -> bool,
    ) -> (Tensor, Activations) {
        let mut saved = Vec::with_capacity(range.len());
        let recomputed = |i: usize| mode.train && recompute(i);
        // A block ending in a residual add may leave it to the next block's first kernel
        // (`Layer::forward_residual`: a transformer block's last add, in the next norm's
        // forward on a GPU), unless the next block is recomputed (it keeps its input as a
        // tensor) or there is none in this range (the output leaves).
        let mut x = Stream::Ready(x);
        for i in range.clone() {
            let (p, b) = params.forward_view(i);
            let layer = &self.blocks[i].layer;
            let leave_add = i + 1 < range.end && !recomputed(i + 1);
            if recomputed(i) {
                // Run normally (batch norm updates its running statistics once, here), keep
                // only the input, and rebuild the saved state in backward.
                let input = x.resolve();
                x = Stream::Ready(layer.forward(p, b, input.clone(), mode, &mut Saved::default()));
                saved.push(BlockSaved::Recompute(input));
            } else {
                let mut s = Saved::default();
                x = layer.forward_residual(p, b, x, leave_add, mode, &mut s);
                saved.push(BlockSaved::Full(s));
            }
            params.forward_done(i);
        }
        (
            x.resolve(),
            Activations {
                range,
                blocks: saved,
            },
        )
    }

    /// Backward from the upstream gradient `dy` through the blocks of `acts`, last to first.
    /// `on_block_ready(i)` runs as soon as block `i`'s gradients are final (for overlapping
    /// their all-reduce with the rest of backward). Returns the input gradient if `need_dx`.
    pub fn backward(
        &self,
        store: &mut ParamStore,
        acts: Activations,
        dy: Tensor,
        need_dx: bool,
        on_block_ready: &mut dyn FnMut(usize, &mut ParamStore),
    ) -> Option<Tensor> {
        self.backward_at(store, Base::WHOLE, acts, dy, need_dx, on_block_ready)
    }

    /// [`Model::backward`] on a store that holds only the blocks `acts.range` (see
    /// [`Model::forward_local`]). `on_block_ready` gets the global block index; the block's
    /// gradients sit at `block_param_range(i)` shifted by `blocks_param_range(acts.range).start`.
    pub fn backward_local(
        &self,
        store: &mut ParamStore,
        acts: Activations,
        dy: Tensor,
        need_dx: bool,
        on_block_ready: &mut dyn FnMut(usize, &mut ParamStore),
    ) -> Option<Tensor> {
        let base = self.local_base(store, &acts.range);
        self.backward_at(store, base, acts, dy, need_dx, on_block_ready)
    }

    fn backward_at(
        &self,
        store: &mut ParamStore,
        base: Base,
        acts: Activations,
        dy: Tensor,
        need_dx: bool,
        on_block_ready: &mut dyn FnMut(usize, &mut ParamStore),
    ) -> Option<Tensor> {
        struct Hooked<'a, 'b> {
            inner: StoreParams<'a>,
            hook: &'b mut dyn FnMut(usize, &mut ParamStore),
        }
        impl BlockParams for Hooked<'_, '_> {
            fn forward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>) {
                self.inner.forward_view(block)
            }
            fn backward_view(
                &mut self,
                block: usize,
            ) -> (Params<'_>, ParamsMut<'_>, ParamsMut<'_>) {
                self.inner.backward_view(block)
            }
            fn backward_done(&mut self, block: usize) {
                (self.hook)(block, self.inner.store)
            }
        }
        let mut params = Hooked {
            inner: StoreParams {
                model: self,
                store,
                base,
            },
            hook: on_block_ready,
        };
        self.backward_with(&mut params, acts, dy, need_dx)
    }

    /// Backward through the blocks of `acts`, last to first, each block's parameters and
    /// gradient buffer taken from `params` just before it runs; [`BlockParams::backward_done`]
    /// tells `params` as soon as a block's gradients for this pass are complete.
    pub fn backward_with(
        &self,
        params: &mut dyn BlockParams,
        acts: Activations,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        let Activations { range, blocks } = acts;
        let mut grad = Some(dy);
        for (i, saved) in range.clone().zip(blocks).rev() {
            let (values, grads, buffers) = params.backward_view(i);
            let saved = match saved {
                BlockSaved::Full(s) => s,
                BlockSaved::Recompute(input) => {
                    let mut s = Saved::default();
                    self.blocks[i]
                        .layer
                        .forward(values, buffers, input, Mode::RECOMPUTE, &mut s);
                    s
                }
            };
            let want_dx = need_dx || i > range.start;
            grad = self.blocks[i].layer.backward(
                values,
                grads,
                saved,
                grad.expect("upstream gradient"),
                want_dx,
            );
            params.backward_done(i);
        }
        grad
    }

    /// Generation's forward ([`Layer::forward_cached`]): the token rows `x` (`[1, rows]`, one
    /// sequence at positions `cache.start()..`) through every block with the whole model's
    /// `params` and `buffers` (host or device), each attention layer reading and extending
    /// its keys and values in `cache`. Returns the output rows (the logits), or only the
    /// last row's when not `all`: the rows are cut to the last one right after the last
    /// block that reads positions, so the final norm and the head run once per pass. Fails,
    /// naming the block, when a block reads positions without a cached forward, or when the
    /// rows do not fit the cache's context; the cache is then left mid-pass (truncate it).
    pub fn forward_cached(
        &self,
        params: Params<'_>,
        mut buffers: ParamsMut<'_>,
        x: Tensor,
        cache: &mut crate::cache::KvCache,
        all: bool,
    ) -> Result<Tensor, String> {
        let rows = x.dim(1);
        cache.begin(rows)?;
        let cut = self.blocks.iter().rposition(|b| b.layer.reads_positions());
        let mut x = x;
        for (i, block) in self.blocks.iter().enumerate() {
            let p = params.slice(self.block_params[i].clone());
            let b = buffers.slice(self.block_buffers[i].clone());
            x = block.layer.forward_cached(p, b, x, cache).ok_or_else(|| {
                format!(
                    "block {i} ('{}') reads positions (attention, a position table or rotary \
                     angles) and has no cached forward (Layer::forward_cached)",
                    block.name
                )
            })?;
            if !all && rows > 1 && (cut == Some(i) || cut.is_none() && i + 1 == self.blocks.len()) {
                x = last_row(x);
            }
        }
        cache.end();
        Ok(x)
    }

    /// Whole-model convenience: forward all blocks.
    pub fn forward_all(
        &self,
        store: &mut ParamStore,
        x: Tensor,
        mode: Mode,
    ) -> (Tensor, Activations) {
        self.forward(store, x, 0..self.num_blocks(), mode, &|_| false)
    }
}

/// The last row of `x` (`[1, rows, width]` → `[1, 1, width]`), where it lives.
fn last_row(x: Tensor) -> Tensor {
    let (rows, width) = (x.dim(1), x.numel() / x.dim(1).max(1));
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return crate::device::last_row(x, rows, width);
    }
    Tensor::from_vec(x.data()[(rows - 1) * width..].to_vec(), &[1, 1, width])
}

/// Where a forward or backward pass finds each block's parameters, buffers and gradient
/// buffer. A [`ParamStore`] holds them all the time; a sharded store (ZeRO-3, FSDP) gathers a
/// block's parameters just before the block runs and frees them after, and reduces a block's
/// gradients as soon as its backward is done — so the views are asked for per block, in
/// execution order, and every `*_view` is followed by the matching `*_done`.
pub trait BlockParams {
    /// Block `block`'s parameters and buffers, for its forward.
    fn forward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>);

    /// Block `block`'s forward is done (its gathered parameters may go).
    fn forward_done(&mut self, _block: usize) {}

    /// Block `block`'s parameters, gradient buffer (gradients are accumulated into it) and
    /// buffers, for its backward (and a recomputed forward before it).
    fn backward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>, ParamsMut<'_>);

    /// Block `block`'s backward is done: its gradients of this pass are complete.
    fn backward_done(&mut self, _block: usize) {}
}

/// A [`ParamStore`] (whole-model or stage-local, starting at `base`) as [`BlockParams`].
struct StoreParams<'a> {
    model: &'a Model,
    store: &'a mut ParamStore,
    base: Base,
}

impl BlockParams for StoreParams<'_> {
    fn forward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>) {
        let (p, b) = (
            self.model.param_slot(block, self.base),
            self.model.buffer_slot(block, self.base),
        );
        (
            Params::Host(&self.store.values[p]),
            ParamsMut::Host(&mut self.store.buffers[b]),
        )
    }

    fn backward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>, ParamsMut<'_>) {
        let (p, b) = (
            self.model.param_slot(block, self.base),
            self.model.buffer_slot(block, self.base),
        );
        let store = &mut *self.store;
        (
            Params::Host(&store.values[p.clone()]),
            ParamsMut::Host(&mut store.grads[p]),
            ParamsMut::Host(&mut store.buffers[b]),
        )
    }
}

/// Where the store a forward/backward runs on starts in the whole-model buffers: 0 for a
/// whole-model store, the first held block's offset for a stage-local one.
#[derive(Clone, Copy)]
struct Base {
    params: usize,
    buffers: usize,
}

impl Base {
    const WHOLE: Base = Base {
        params: 0,
        buffers: 0,
    };
}

/// The union of the contiguous per-block ranges `per_block[blocks]` (empty at the right
/// offset for an empty block range).
fn span_of(per_block: &[Range<usize>], blocks: Range<usize>) -> Range<usize> {
    assert!(
        blocks.start <= blocks.end && blocks.end <= per_block.len(),
        "block range {blocks:?} is outside the model's {} blocks",
        per_block.len()
    );
    let at = |b: usize| {
        per_block
            .get(b)
            .map_or_else(|| per_block.last().map_or(0, |r| r.end), |r| r.start)
    };
    at(blocks.start)..at(blocks.end)
}
