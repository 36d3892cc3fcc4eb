//! Phase 4 of the apply order: which [`GradSync`] keeps this stage's replicas equal — DDP,
//! the single master, ZeRO, or nothing for one replica — chosen here, above both `data` and
//! `zero`, so neither names the other.

use crate::data::{
    DataParallelError, DdpConfig, DdpSync, DpMode, GradSync, GroupStatsReducer, NoSync,
    SingleMasterSync,
};
use crate::engine::StageChunk;
use crate::zero::{ZeroOptions, ZeroStage, ZeroSync};
use meshtrain_comm::ProcessGroup;
use meshtrain_nn::{Model, StatsReducer};
use std::sync::Arc;

/// How the data-parallel replicas are set up: the mode, DDP's buckets, ZeRO's stage
/// (`None`: full replicas) and options, SyncBatchNorm.
#[derive(Clone, Copy, Debug, Default)]
pub struct DataParallelConfig {
    pub mode: DpMode,
    pub ddp: DdpConfig,
    pub zero: Option<ZeroStage>,
    pub zero_options: ZeroOptions,
    pub sync_batch_norm: bool,
    /// The parameters' seed: ZeRO-3 initialises each rank's pieces from it.
    pub seed: u64,
}

/// The data-parallel transform: the [`GradSync`] of this worker's `chunks` (of a pipeline of
/// `pipeline_workers` stages) over the data-parallel group `dp`, with the replicas made equal
/// (rank 0's parameters), and the exact summer over `dp` (evaluation sums; installed into
/// the model's batch norms for SyncBatchNorm when asked). One replica gets [`NoSync`] and no
/// summer.
pub fn grad_sync(
    model: &mut Model,
    chunks: &mut [StageChunk],
    pipeline_workers: usize,
    dp: &Arc<dyn ProcessGroup>,
    config: DataParallelConfig,
) -> Result<DataParallel, DataParallelError> {
    let DataParallelConfig {
        mode,
        ddp,
        zero,
        zero_options,
        sync_batch_norm,
        seed,
    } = config;
    if dp.size() == 1 {
        return Ok(DataParallel {
            sync: Box::new(NoSync),
            sums: None,
        });
    }
    let all: Vec<usize> = (0..dp.size()).collect();
    let stats = dp
        .new_named_subgroup(&all, &format!("{}-stats", dp.name()))
        .map_err(|e| DataParallelError::comm("creating the statistics group", e))?;
    let sums = Arc::new(GroupStatsReducer::new(stats));
    if sync_batch_norm {
        model.set_stats_reducer(Some(sums.clone() as Arc<dyn StatsReducer>));
    }
    let mut sync: Box<dyn GradSync> = match (mode, zero) {
        (DpMode::Ddp, Some(stage)) => Box::new(ZeroSync::new(
            model,
            chunks,
            pipeline_workers,
            dp.clone(),
            stage,
            zero_options,
            seed,
        )),
        (DpMode::SingleMaster, Some(_)) => {
            return Err(DataParallelError::Config(
                "ZeRO shards the replicas of DDP; the single-master mode has no replicas to \
                 shard (use dp_mode = \"ddp\")"
                    .into(),
            ))
        }
        (DpMode::Ddp, None) => {
            let (group, hierarchical) = crate::data::reduction_group(ddp.reduce, dp)?;
            Box::new(
                DdpSync::new(model, chunks, pipeline_workers, group, ddp)?
                    .hierarchical(hierarchical),
            )
        }
        (DpMode::SingleMaster, None) => Box::new(SingleMasterSync::new(dp.clone())),
    };
    sync.init(chunks)?;
    Ok(DataParallel {
        sync,
        sums: Some(sums),
    })
}

/// What [`grad_sync`] sets up.
pub struct DataParallel {
    pub sync: Box<dyn GradSync>,
    /// Exact f64 sums over the data-parallel group (`None` for one replica).
    pub sums: Option<Arc<GroupStatsReducer>>,
}
