//! A model is an ordered list of named blocks over one flat parameter buffer.

use crate::layer::{spec_len, Layer, Mode, ParamSpec, Saved, StatsReducer};
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;
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

/// Where a named parameter (or buffer) lives in the flat buffer.
#[derive(Clone, Debug)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
    pub block: usize,
    spec: ParamSpec,
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
        }
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

    /// Fresh parameters: each tensor drawn from its own stream forked from `seed`, so adding a
    /// layer never changes the initial values of the others.
    pub fn init(&self, seed: u64) -> ParamStore {
        let mut values = vec![0.0f32; self.num_params()];
        for (i, e) in self.params.iter().enumerate() {
            let mut rng = SplitMix64::derive(seed, i as u64);
            e.spec.init.fill(&mut values[e.range.clone()], &mut rng);
        }
        let mut buffers = vec![0.0f32; self.num_buffers()];
        for e in &self.buffers {
            e.spec
                .init
                .fill(&mut buffers[e.range.clone()], &mut SplitMix64::new(0));
        }
        ParamStore {
            grads: vec![0.0; values.len()],
            values,
            buffers,
        }
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
        let mut saved = Vec::with_capacity(range.len());
        let mut x = x;
        for i in range.clone() {
            let p = &store.values[self.block_params[i].clone()];
            let b = &mut store.buffers[self.block_buffers[i].clone()];
            let layer = &self.blocks[i].layer;
            if mode.train && recompute(i) {
                // Run normally (batch norm updates its running statistics once, here), keep
                // only the input, and rebuild the saved state in backward.
                let input = x.clone();
                x = layer.forward(p, b, x, mode, &mut Saved::default());
                saved.push(BlockSaved::Recompute(input));
            } else {
                let mut s = Saved::default();
                x = layer.forward(p, b, x, mode, &mut s);
                saved.push(BlockSaved::Full(s));
            }
        }
        (
            x,
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
        let Activations { range, blocks } = acts;
        let mut grad = Some(dy);
        for (i, saved) in range.clone().zip(blocks).rev() {
            let saved = match saved {
                BlockSaved::Full(s) => s,
                BlockSaved::Recompute(input) => {
                    let mut s = Saved::default();
                    let p = &store.values[self.block_params[i].clone()];
                    let b = &mut store.buffers[self.block_buffers[i].clone()];
                    self.blocks[i]
                        .layer
                        .forward(p, b, input, Mode::RECOMPUTE, &mut s);
                    s
                }
            };
            let want_dx = need_dx || i > range.start;
            let pr = self.block_params[i].clone();
            let (values, grads) = (&store.values[pr.clone()], &mut store.grads[pr]);
            grad = self.blocks[i].layer.backward(
                values,
                grads,
                saved,
                grad.expect("upstream gradient"),
                want_dx,
            );
            on_block_ready(i, store);
        }
        grad
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
