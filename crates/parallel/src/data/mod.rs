//! Data parallelism: every worker holds a full replica, processes its share of each global
//! batch, and all replicas apply the same averaged gradient.
//!
//! * [`Ddp`]: PyTorch-DDP style — buckets over the flat gradient buffer, each all-reduced as
//!   soon as backward has finished it, overlapping communication with the rest of backward;
//!   optional bf16 gradients on the wire; `no_sync` for gradient accumulation; flat or
//!   hierarchical (inside hosts, then across) all-reduce ([`GradReduce`]).
//! * [`SingleMaster`]: the naive `nn.DataParallel` style (scatter, gather gradients to rank
//!   0, update there, broadcast weights), for comparison.
//! * [`GroupStatsReducer`]: the all-reduce behind SyncBatchNorm.
//! * [`GradSync`]: the one interface the training step sees, implemented by [`DdpSync`],
//!   [`SingleMasterSync`], [`NoSync`] and ZeRO's `crate::zero::ZeroSync`;
//!   `crate::parallelize::grad_sync` picks one for a layout.
//!
//! The distributed sampler lives with the data (`meshtrain_data::DistributedSampler`).

mod buckets;
mod ddp;
mod naive;
mod sync;
mod sync_bn;

pub use buckets::{plan_buckets, Bucket};
pub use ddp::{
    broadcast_state, is_hierarchical, reduction_group, CommTiming, Ddp, DdpConfig, GradCompression,
    GradReduce,
};
pub use naive::{SingleMaster, MASTER};
pub use sync::{DdpSync, DpMode, GradSync, NoSync, ShareShape, SingleMasterSync, SyncHooks};
pub use sync_bn::GroupStatsReducer;

use meshtrain_comm::CommError;

/// Why a data-parallel operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DataParallelError {
    /// The message includes the collective's error (not exposed as a `source`, so error
    /// chains print it once).
    #[error("{what}: {error}")]
    Comm {
        what: &'static str,
        error: CommError,
    },
    #[error("data parallelism: {0}")]
    Config(String),
}

impl DataParallelError {
    pub(crate) fn comm(what: &'static str, source: CommError) -> Self {
        DataParallelError::Comm {
            what,
            error: source,
        }
    }
}
