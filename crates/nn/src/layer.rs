//! The layer contract: explicit forward and backward over parameter slices.

use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;
use std::sync::Arc;

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
    pub shape: Vec<usize>,
    pub init: Init,
}

impl ParamSpec {
    pub fn new(name: &str, shape: &[usize], init: Init) -> Self {
        ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
        }
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
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
}

impl Saved {
    /// Bytes held (for activation-memory accounting).
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(Tensor::bytes).sum::<usize>()
            + self.indices.iter().map(|i| i.len() * 4).sum::<usize>()
            + self.stats.iter().map(|s| s.len() * 4).sum::<usize>()
            + self.children.iter().map(Saved::bytes).sum::<usize>()
    }
}

/// A layer: parameters are given as slices of the model's flat buffers, in the order of
/// [`Layer::params`]; gradients are *accumulated* into `grads` (so micro-batches add up).
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
        params: &[f32],
        buffers: &mut [f32],
        x: Tensor,
        mode: Mode,
        saved: &mut Saved,
    ) -> Tensor;

    /// Returns the input gradient when `need_dx` (the first layer of a model skips it).
    fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        saved: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor>;

    /// Gives every batch-norm layer inside this one the reducer that synchronises its batch
    /// statistics across workers (SyncBatchNorm), or `None` for local statistics again.
    /// Composite layers forward it to their children; other layers ignore it.
    fn set_stats_reducer(&mut self, _reducer: Option<Arc<dyn StatsReducer>>) {}
}

/// Total element count of a spec list.
pub fn spec_len(specs: &[ParamSpec]) -> usize {
    specs.iter().map(ParamSpec::len).sum()
}
