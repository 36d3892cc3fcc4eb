//! The communication behind SyncBatchNorm: exact f64 sums of batch statistics over a group.

use crate::engine::sum_f64;
use meshtrain_comm::{CommError, ProcessGroup};
use meshtrain_nn::StatsReducer;
use std::sync::Arc;

/// Sums per-channel statistics over the data-parallel group (SyncBatchNorm), or a layer's
/// small partial gradients over the tensor-parallel group (Qwen3's q/k norms).
///
/// The statistics are f64 (a channel of ResNet's stem sums 25k values), but collectives carry
/// f32: each f64 travels as the bit pattern of two f32 words through an all-gather (a pure
/// copy, no arithmetic) and every rank adds the gathered values in rank order. So the sum is
/// exact f64 and bit-identical on all ranks. The reducer uses its own group so its small
/// blocking collectives never queue behind DDP's in-flight gradient buckets.
pub struct GroupStatsReducer {
    group: Arc<dyn ProcessGroup>,
}

impl GroupStatsReducer {
    pub fn new(group: Arc<dyn ProcessGroup>) -> Self {
        GroupStatsReducer { group }
    }

    /// Replaces `values` with their exact sum over the group (every rank gets the same).
    pub fn try_sum(&self, values: &mut [f64]) -> Result<(), CommError> {
        sum_f64(self.group.as_ref(), values)
    }
}

impl StatsReducer for GroupStatsReducer {
    fn sum(&self, values: &mut [f64]) {
        if let Err(e) = self.try_sum(values) {
            // Layers cannot return errors; the worker fails with the collective's message.
            panic!("summing statistics over a group (SyncBatchNorm's, or q/k norm gradients) failed: {e}");
        }
    }
}
