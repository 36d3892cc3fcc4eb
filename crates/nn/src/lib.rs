//! meshtrain-nn: layers with explicit forward/backward, models as ordered block lists, flat
//! parameter storage, optimizers and learning-rate schedules.
//!
//! The properties every parallel mode relies on live here:
//! * all parameters of a model sit in **one flat buffer** and all gradients in another
//!   ([`ParamStore`]), so data-parallel buckets and ZeRO shards are slices, not copies;
//! * [`Model::backward`] calls a hook **the moment a block's gradients are final**, so
//!   communication can overlap the rest of backward;
//! * forward and backward run over any **range of blocks**, backward starting from a given
//!   upstream gradient, which is exactly what a pipeline stage does;
//! * a block can be **recomputed** in backward instead of keeping its activations
//!   (activation checkpointing).
//!
//! Forward returns what backward needs as a [`Saved`] value instead of storing it in the layer,
//! so a pipeline stage can hold several micro-batches in flight at once.

pub mod cache;
#[cfg(feature = "cuda")]
pub mod device;
pub mod generate;
pub mod layer;
pub mod layers;
pub mod loss;
pub mod model;
pub mod models;
pub mod optim;
pub mod schedule;
pub mod transformer;

pub use cache::KvCache;
pub use layer::{
    Deal, Init, Kept, Layer, Mode, OutputActivation, ParamSpec, Params, ParamsMut, Saved,
    ShardSpec, StatsReducer, Stream, TensorPlan, TpStyle,
};
pub use loss::{CrossEntropy, Loss, LossError, LossValue};
pub use model::{
    Block, BlockParams, InputKind, InputSpec, Model, ModelError, ParamEntry, ParamStore, TiedParams,
};
