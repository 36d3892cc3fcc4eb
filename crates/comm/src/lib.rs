//! meshtrain-comm: collective communication for meshtrain.
//!
//! * [`ProcessGroup`]: the one trait every parallel mode talks to — all-reduce (sum,
//!   average, max), reduce-scatter, all-gather, all-to-all, broadcast, send/recv, barrier
//!   on f32, bf16 and f16 buffers; synchronous and asynchronous (a [`Work`] handle);
//!   sub-groups.
//! * [`ThreadsWorld`]: the embedded shared-memory backend (N worker threads).
//! * `mpi` (cargo feature `mpi`): OpenMPI backend, one worker per process.
//! * [`NcclGroup`] (cargo feature `cuda`): NCCL on device buffers, one GPU per rank,
//!   bootstrapped through a host group.
//! * [`DeviceMesh`]: ranks on named axes (dp, pp, tp, cp) with a group per axis.
//! * [`HostPlacement`]: which ranks share a host; [`HierarchicalGroup`]: an all-reduce in
//!   two tiers (inside each host, then across hosts) behind the same trait.
//! * Every operation has a timeout and names the op, sequence number, group and
//!   missing ranks when it fails; mismatched collectives are detected (desync check).
//!
//! Design notes and the safety contract of the async API: `docs/comm.md`.

pub mod bench;
pub mod conformance;
mod dtype;
mod engine;
mod error;
mod group;
mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi_backend;
#[cfg(any(feature = "mpi", test))]
mod mpi_monitor;
#[cfg(feature = "cuda")]
mod nccl;
mod routed;
mod staged;
mod threads;
mod topology;

pub use dtype::{reference_reduce, BufMut, BufRef, DType, Device, Element, RawBuf, ReduceOp};
pub use error::{CommError, OpContext};
pub use group::{
    CommConfig, Fingerprint, MissingMembers, OpSpan, Operation, OwnedBuf, OwnedWork, PositionBoard,
    ProcessGroup, Work, DEFAULT_TIMEOUT,
};
pub use half::{bf16, f16};
pub use mesh::{DeviceMesh, MeshAxis, MeshError, MeshLayout};
#[cfg(feature = "cuda")]
pub use nccl::{nccl_available, NcclGroup, NcclVersion};
pub use routed::RoutedGroup;
#[cfg(feature = "cuda")]
pub use staged::CudaMemory;
pub use staged::{DeviceAlloc, DeviceMemory, HostBackedDevice, HostStage, StagedGroup};
pub use threads::{ThreadsGroup, ThreadsWorld, WorkerFailure, WorldError, FAILURE_GRACE};
pub use topology::{GroupHosts, HierarchicalGroup, HostPlacement, DEFAULT_PIECE_BYTES};
