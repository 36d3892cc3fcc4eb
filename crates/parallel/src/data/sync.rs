//! [`GradSync`]: the one interface through which data-parallel replicas stay equal. The
//! training step calls it at fixed points and never asks which implementation it has:
//!
//! ```text
//! share   = sync.share(loaded, shape)        which samples this replica trains on
//! sync.begin_step()
//! backward … sync.grads_ready(block)         as each block's gradients become final
//! sync.finish(chunks)                        the gradients this worker applies are final
//! if sync.updates_parameters() { clip, optimizer step }
//! sync.after_update(chunks)                  replicas hold the updated parameters
//! ```
//!
//! * [`DdpSync`]: every replica loads its own shard, buckets are all-reduced while backward
//!   runs, every replica updates (PyTorch DDP).
//! * [`SingleMasterSync`]: the master loads the whole batch and scatters it, gathers the
//!   gradients, updates alone and broadcasts the weights (`nn.DataParallel`).
//! * `crate::zero::ZeroSync`: ZeRO stages 1–3 — reduce-scatter, an update of
//!   this rank's pieces, all-gather (and under stage 3 parameters gathered per block).
//!
//! Both work per pipeline chunk, so they compose with any pipeline layout: each stage's
//! replicas synchronise over that stage's data-parallel group.

use super::{CommTiming, DataParallelError, Ddp, DdpConfig, SingleMaster};
use crate::engine::{ChunkParams, GradsReady, StageChunk};
use crate::Batch;
use meshtrain_comm::{OpSpan, ProcessGroup};
use meshtrain_nn::Model;
use meshtrain_tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// How the data-parallel replicas synchronise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DpMode {
    /// DistributedDataParallel: bucketed all-reduce overlapped with backward.
    #[default]
    Ddp,
    /// nn.DataParallel style: scatter, gather gradients to rank 0, update there, broadcast.
    SingleMaster,
}

/// What one replica's share of a global batch looks like (so a replica that receives its
/// share knows what to allocate).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareShape {
    /// Samples per replica.
    pub samples: usize,
    /// Shape of one sample's input.
    pub sample: Vec<usize>,
    pub targets_per_sample: usize,
}

/// How data-parallel replicas synchronise (see the module documentation for when each
/// method is called).
pub trait GradSync: Send {
    /// For logs: `ddp`, `single-master`.
    fn name(&self) -> &'static str;

    /// For step breakdowns: `flat` or `hierarchical` when the gradients are all-reduced over
    /// more than one replica, `None` when they are synchronised another way (or not at all).
    fn all_reduce_kind(&self) -> Option<&'static str> {
        None
    }

    /// Makes every replica start from the same parameters and buffers (rank 0's).
    fn init(&mut self, chunks: &mut [StageChunk]) -> Result<(), DataParallelError>;

    /// The chunks' state is about to be placed on their device (from the stores): a mode that
    /// holds state outside the stores hands it over here (ZeRO-3's parameter pieces).
    fn placing(&mut self, _chunks: &mut [StageChunk]) {}

    /// The chunks' state was placed on their device (`StageChunk::device`): a mode that
    /// keeps flat buffers of its own allocates them there from now on.
    fn placed(&mut self, _chunks: &mut [StageChunk]) {}

    /// The (rank, world) of the share of each global batch this worker loads itself, or
    /// `None` if it loads nothing and receives its share in [`GradSync::share`].
    fn loads(&self) -> Option<(usize, usize)>;

    /// This replica's share of the step's batch, from what it loaded (if anything): by
    /// default what it loaded itself.
    fn share(
        &mut self,
        loaded: Option<Batch>,
        _shape: &ShareShape,
    ) -> Result<(Batch, CommTiming), DataParallelError> {
        Ok((own_share(loaded)?, CommTiming::default()))
    }

    /// Before the step's backward passes.
    fn begin_step(&mut self);

    /// A block's gradients became final (during its chunk's last backward of the step).
    fn grads_ready(&mut self, ready: GradsReady<'_>);

    /// After the backward passes: the gradients this worker applies are final.
    fn finish(&mut self, chunks: &mut [StageChunk]) -> Result<CommTiming, DataParallelError>;

    /// Whether this worker applies the optimizer step (and so clips and ties gradients).
    fn updates_parameters(&self) -> bool {
        true
    }

    /// After the optimizer step: every replica holds the updated parameters.
    fn after_update(
        &mut self,
        _chunks: &mut [StageChunk],
    ) -> Result<CommTiming, DataParallelError> {
        Ok(CommTiming::default())
    }

    /// Where local chunk `j`'s blocks find their parameters during a pass, when not in the
    /// chunk's store (ZeRO-2/3).
    fn chunk_params(&mut self, _j: usize) -> Option<&mut dyn ChunkParams> {
        None
    }

    /// After a pass outside a training step (evaluation): a collective of it failed.
    fn check_pass(&mut self) -> Result<(), DataParallelError> {
        Ok(())
    }

    /// The collectives of the last step that ran beside compute, labelled, for its timeline
    /// (DDP's bucket all-reduces); drained by each call.
    fn take_comm_spans(&mut self) -> Vec<(String, OpSpan)> {
        Vec::new()
    }

    /// The implementation itself, for the synchronisers whose state others read (ZeRO's
    /// pieces, through `crate::zero::of`): the interface does not name the modes above it.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// As [`GradSync::as_any`], to change that state (checkpoints of the pieces).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

/// A [`GradSync`] as the hooks of a pipeline pass.
pub struct SyncHooks<'a>(pub &'a mut dyn GradSync);

impl crate::engine::StepHooks for SyncHooks<'_> {
    fn grads_ready(&mut self, ready: GradsReady<'_>) {
        self.0.grads_ready(ready)
    }

    fn chunk_params(&mut self, j: usize) -> Option<&mut dyn ChunkParams> {
        self.0.chunk_params(j)
    }
}

/// A replica's share when it loads its own.
fn own_share(loaded: Option<Batch>) -> Result<Batch, DataParallelError> {
    loaded.ok_or_else(|| {
        DataParallelError::Config("a data-parallel replica must load its own share".into())
    })
}

/// DDP over each of this worker's pipeline chunks (one chunk without a pipeline).
pub struct DdpSync {
    group: Arc<dyn ProcessGroup>,
    /// `ddps[j]` reduces local chunk `j`.
    ddps: Vec<Ddp>,
    /// First block of each local chunk (hooks report model block indices).
    first_block: Vec<usize>,
    /// Pipeline workers (global chunk `c` is local chunk `c / workers`).
    workers: usize,
    /// `group` all-reduces inside each host first (for logs).
    hierarchical: bool,
}

impl DdpSync {
    /// DDP over `group` for the chunks of a stage of a `workers`-worker pipeline.
    pub fn new(
        model: &Model,
        chunks: &[StageChunk],
        workers: usize,
        group: Arc<dyn ProcessGroup>,
        config: DdpConfig,
    ) -> Result<DdpSync, DataParallelError> {
        let mut ddps = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            let base = model.blocks_param_range(chunk.blocks.clone()).start;
            let local: Vec<_> = chunk
                .blocks
                .clone()
                .map(|b| {
                    let r = model.block_param_range(b);
                    r.start - base..r.end - base
                })
                .collect();
            ddps.push(Ddp::over_blocks(&local, group.clone(), config)?);
        }
        Ok(DdpSync {
            group,
            ddps,
            first_block: chunks.iter().map(|c| c.blocks.start).collect(),
            workers,
            hierarchical: false,
        })
    }
}

impl DdpSync {
    /// Says (for logs and breakdowns) that `group` all-reduces inside each host first.
    pub fn hierarchical(mut self, hierarchical: bool) -> DdpSync {
        self.hierarchical = hierarchical;
        self
    }
}

impl GradSync for DdpSync {
    fn name(&self) -> &'static str {
        if self.hierarchical {
            "ddp, hierarchical all-reduce"
        } else {
            "ddp"
        }
    }

    fn all_reduce_kind(&self) -> Option<&'static str> {
        match (self.group.size() > 1, self.hierarchical) {
            (false, _) => None,
            (true, false) => Some("flat"),
            (true, true) => Some("hierarchical"),
        }
    }

    fn init(&mut self, chunks: &mut [StageChunk]) -> Result<(), DataParallelError> {
        for (ddp, chunk) in self.ddps.iter().zip(chunks) {
            ddp.broadcast_state(&mut chunk.store)?;
        }
        Ok(())
    }

    fn placed(&mut self, chunks: &mut [StageChunk]) {
        for (ddp, chunk) in self.ddps.iter_mut().zip(chunks) {
            if let Some(device) = &chunk.device {
                ddp.use_memory(device.flat_memory());
            }
        }
    }

    fn loads(&self) -> Option<(usize, usize)> {
        Some((self.group.rank(), self.group.size()))
    }

    fn begin_step(&mut self) {
        self.ddps.iter_mut().for_each(|d| d.prepare(true));
    }

    fn grads_ready(&mut self, ready: GradsReady<'_>) {
        let j = ready.chunk / self.workers;
        if let Some(ddp) = self.ddps.get_mut(j) {
            ddp.block_ready(ready.block - self.first_block[j], ready.grads);
        }
    }

    fn finish(&mut self, chunks: &mut [StageChunk]) -> Result<CommTiming, DataParallelError> {
        let mut timing = CommTiming::default();
        for (ddp, chunk) in self.ddps.iter_mut().zip(chunks) {
            timing.add(ddp.finish(chunk.grads_buf())?);
        }
        Ok(timing)
    }

    fn take_comm_spans(&mut self) -> Vec<(String, OpSpan)> {
        let chunks = self.ddps.len();
        let mut spans = Vec::new();
        for (j, ddp) in self.ddps.iter_mut().enumerate() {
            for (b, span) in ddp.take_spans() {
                let label = if chunks == 1 {
                    format!("bucket {b}")
                } else {
                    format!("bucket {b}·c{j}")
                };
                spans.push((label, span));
            }
        }
        spans
    }
}

/// The single-master mode over each of this worker's chunks.
pub struct SingleMasterSync {
    master: SingleMaster,
}

impl SingleMasterSync {
    pub fn new(group: Arc<dyn ProcessGroup>) -> Self {
        SingleMasterSync {
            master: SingleMaster::new(group),
        }
    }
}

impl GradSync for SingleMasterSync {
    fn name(&self) -> &'static str {
        "single-master"
    }

    fn init(&mut self, chunks: &mut [StageChunk]) -> Result<(), DataParallelError> {
        chunks
            .iter_mut()
            .try_for_each(|c| self.master.broadcast_weights(c))
    }

    fn loads(&self) -> Option<(usize, usize)> {
        self.master.is_master().then_some((0, 1))
    }

    fn share(
        &mut self,
        loaded: Option<Batch>,
        shape: &ShareShape,
    ) -> Result<(Batch, CommTiming), DataParallelError> {
        let t = Instant::now();
        let sample_len = shape.sample.iter().product();
        let global = loaded.as_ref().map(|b| (b.x.data(), b.y.as_slice()));
        let (x, y) =
            self.master
                .scatter(global, shape.samples, sample_len, shape.targets_per_sample)?;
        let mut dims = vec![shape.samples];
        dims.extend(&shape.sample);
        let batch = Batch {
            x: Tensor::from_vec(x, &dims),
            y,
            samples: shape.samples,
        };
        let timing = CommTiming {
            exposed_s: t.elapsed().as_secs_f64(),
            ..CommTiming::default()
        };
        Ok((batch, timing))
    }

    fn begin_step(&mut self) {}

    fn grads_ready(&mut self, _: GradsReady<'_>) {}

    fn finish(&mut self, chunks: &mut [StageChunk]) -> Result<CommTiming, DataParallelError> {
        let t = Instant::now();
        let mut bytes = 0;
        for chunk in chunks {
            bytes += self.master.gather_gradients(chunk)?;
        }
        Ok(CommTiming {
            exposed_s: t.elapsed().as_secs_f64(),
            bytes,
            ..CommTiming::default()
        })
    }

    fn updates_parameters(&self) -> bool {
        self.master.is_master()
    }

    fn after_update(&mut self, chunks: &mut [StageChunk]) -> Result<CommTiming, DataParallelError> {
        let t = Instant::now();
        self.init(chunks)?;
        Ok(CommTiming {
            exposed_s: t.elapsed().as_secs_f64(),
            ..CommTiming::default()
        })
    }
}

/// One replica: nothing to synchronise (what `dp = 1` gets, so a single worker pays for no
/// collective at all).
pub struct NoSync;

impl GradSync for NoSync {
    fn name(&self) -> &'static str {
        "none"
    }

    fn init(&mut self, _: &mut [StageChunk]) -> Result<(), DataParallelError> {
        Ok(())
    }

    fn loads(&self) -> Option<(usize, usize)> {
        Some((0, 1))
    }

    fn begin_step(&mut self) {}

    fn grads_ready(&mut self, _: GradsReady<'_>) {}

    fn finish(&mut self, _: &mut [StageChunk]) -> Result<CommTiming, DataParallelError> {
        Ok(CommTiming::default())
    }
}
