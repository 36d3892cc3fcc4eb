//! meshtrain-parallel: one module per parallel dimension, each readable in one sitting.
//!
//! * [`data`]: data parallelism — DDP (bucketed gradient all-reduce overlapped with backward)
//!   and the naive single-master DataParallel mode, for comparison.
//! * [`pipeline`]: stage partitioning, schedules as data (GPipe, 1F1B, interleaved 1F1B) and
//!   the executor that runs them over point-to-point operations.
//!
//! Process groups are passed in explicitly (`Arc<dyn ProcessGroup>`); nothing here is global.

pub mod data;
pub mod pipeline;
pub mod timeline;
