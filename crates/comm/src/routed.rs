//! One group over two backends: each operation goes where its buffers are. A training step
//! on GPUs reduces gradients in device memory (NCCL) and sums a few host numbers (the loss,
//! the norm of ZeRO's pieces, fp16's overflow flag, evaluation counts) in host memory; NCCL
//! moves only device memory, and a host backend only host memory. [`RoutedGroup`] gives the
//! step one group that takes both, as PyTorch's `"cpu:gloo,cuda:nccl"` backend does.
//!
//! Both groups hold the same ranks in the same order; every rank issues the same program, so
//! each backend sees its operations in the same order on every rank. A barrier (no buffers)
//! goes to the host group.

use crate::group::{CommConfig, Operation, ProcessGroup, Work};
use crate::{CommError, Device, OpContext};
use std::sync::Arc;

/// Host buffers over `host`, device buffers over `device`.
pub struct RoutedGroup {
    host: Arc<dyn ProcessGroup>,
    device: Arc<dyn ProcessGroup>,
}

impl RoutedGroup {
    /// The two groups as one; they must hold the same ranks in the same order.
    pub fn new(
        host: Arc<dyn ProcessGroup>,
        device: Arc<dyn ProcessGroup>,
    ) -> Result<Arc<RoutedGroup>, CommError> {
        if host.global_ranks() != device.global_ranks() || host.rank() != device.rank() {
            return Err(CommError::InvalidRank {
                ctx: OpContext::new("routed group", 0, Arc::from(host.name())),
                details: format!(
                    "the host group {} holds world ranks {:?} (this is its rank {}), the \
                     device group {} holds {:?} (rank {}): they must be the same ranks",
                    host.name(),
                    host.global_ranks(),
                    host.rank(),
                    device.name(),
                    device.global_ranks(),
                    device.rank()
                ),
            });
        }
        Ok(Arc::new(RoutedGroup { host, device }))
    }

    /// The group `op`'s buffers belong to.
    fn route(&self, op: &Operation) -> &dyn ProcessGroup {
        match op.device() {
            Device::Cpu => self.host.as_ref(),
            _ => self.device.as_ref(),
        }
    }
}

impl ProcessGroup for RoutedGroup {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn name(&self) -> &str {
        self.host.name()
    }

    fn global_ranks(&self) -> &[usize] {
        self.host.global_ranks()
    }

    fn config(&self) -> &CommConfig {
        self.host.config()
    }

    unsafe fn run_raw(&self, op: Operation) -> Result<(), CommError> {
        self.route(&op).run_raw(op)
    }

    unsafe fn start_raw(&self, op: Operation) -> Result<Work, CommError> {
        self.route(&op).start_raw(op)
    }

    fn new_named_subgroup(
        &self,
        ranks: &[usize],
        name: &str,
    ) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let host = self.host.new_named_subgroup(ranks, name)?;
        let device = self.device.new_named_subgroup(ranks, name)?;
        Ok(RoutedGroup::new(host, device)?)
    }

    /// Both backends carry sends (a pipeline's shape headers on the host, its tensors on
    /// the device): both get ready.
    fn prepare_point_to_point(&self, pairs: &[(usize, usize)]) -> Result<(), CommError> {
        self.host.prepare_point_to_point(pairs)?;
        self.device.prepare_point_to_point(pairs)
    }

    /// The reductions that matter (gradients) are the device's.
    fn follows_hosts(&self) -> bool {
        self.device.follows_hosts()
    }
}
