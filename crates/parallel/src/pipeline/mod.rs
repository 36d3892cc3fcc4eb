//! Pipeline parallelism: a model's blocks cut into stages on different workers.
//!
//! * [`partition`]: cut the block list into `p` stages (or `p·v` chunks for interleaving),
//!   balanced by parameter count, by measured time, or at explicit boundaries.
//! * The schedules (GPipe, 1F1B, interleaved 1F1B as plain data) and the executor that runs
//!   them are the step's engine, which every layout runs: [`crate::engine`].
//! * [`bench`](mod@bench): pipelined training runs on p threads next to a single-worker reference, and
//!   synthetic equal-cost blocks; [`measure`]: the tables of `docs/pipeline.md` (bubble,
//!   activation memory, recomputation, equivalence), callable from the CLI.
//!
//! Naive layer-wise model parallelism (one batch flows stage to stage) is the `m = 1` case of
//! any schedule. A training step, per worker:
//!
//! ```text
//! let schedule = Schedule::new(kind, p, m)?;                       // same on every worker
//! let partition = Partition::by_params(&model, schedule.num_chunks())?;
//! let mut stage = Stage::new(&model, &partition, schedule, group.rank(), seed)?;
//! let mut optimizers = stage.optimizers(opt_config);
//! loop {
//!     let micro = MicroBatches::split(&x, &y, m)?;                  // only read where needed
//!     let report = stage.run_step(&model, group.as_ref(), micro, &options, None, &mut NoHooks)?;
//!     stage.optimizer_step(&mut optimizers, lr, None);
//! }
//! ```

pub mod bench;
pub mod measure;
pub mod partition;

pub use partition::{partition_for, profile_block_times, split, PartitionSpec, TimeProbe};
