//! Which ranks share a host, and the all-reduce that makes use of it.
//!
//! A cluster has two tiers: ranks on one host talk over shared memory (or NVLink), ranks on
//! different hosts over a network that is often ten times slower. A flat all-reduce over
//! ranks on several hosts sends every byte across that network from every rank; the
//! [`HierarchicalGroup`]'s all-reduce reduce-scatters inside each host first, so each rank
//! sends only its host's reduced shard of `1/L` of the data across (L = ranks per host), to
//! the one rank on every other host that holds the same shard, and then all-gathers inside
//! the host again. The network carries `1/L` of the flat algorithm's bytes per rank; the
//! fast tier carries the rest.

use crate::dtype::{RawBuf, ReduceOp};
use crate::engine::{AsyncEngine, Executor, Sequencer};
use crate::error::{fmt_ranks, CommError, OpContext};
use crate::group::{CommConfig, Operation, ProcessGroup, Work};
use std::sync::Arc;

/// Where the ranks of a world run: which of them share a host. Part of the world's
/// [`CommConfig`], so every group of the world sees the same placement.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum HostPlacement {
    /// Every rank on one host: the threads backend, and MPI when nothing says otherwise.
    #[default]
    OneHost,
    /// World ranks in consecutive blocks of this many per host (`mpirun --map-by slot`'s
    /// placement). The threads backend uses it to simulate hosts in tests.
    RanksPerHost(usize),
    /// The host index of every world rank (what the MPI backend detects).
    PerRank(Arc<[usize]>),
}

impl HostPlacement {
    /// The placement that gives ranks with equal labels one host (hosts numbered in order of
    /// their first rank).
    pub fn from_labels<S: AsRef<str>>(labels: &[S]) -> HostPlacement {
        let mut seen: Vec<&str> = Vec::new();
        let hosts: Vec<usize> = labels
            .iter()
            .map(|label| {
                let label = label.as_ref();
                seen.iter().position(|&s| s == label).unwrap_or_else(|| {
                    seen.push(label);
                    seen.len() - 1
                })
            })
            .collect();
        if seen.len() <= 1 {
            HostPlacement::OneHost
        } else {
            HostPlacement::PerRank(hosts.into())
        }
    }

    /// The host of world rank `global_rank`.
    pub fn host_of(&self, global_rank: usize) -> usize {
        match self {
            HostPlacement::OneHost => 0,
            HostPlacement::RanksPerHost(n) => global_rank / (*n).max(1),
            HostPlacement::PerRank(hosts) => hosts.get(global_rank).copied().unwrap_or(0),
        }
    }

    /// How the group whose members are the world ranks `global_ranks` (in group rank
    /// order) sits on the hosts.
    pub fn group_hosts(&self, global_ranks: &[usize]) -> GroupHosts {
        let mut hosts: Vec<(usize, Vec<usize>)> = Vec::new();
        for (group_rank, &global) in global_ranks.iter().enumerate() {
            let host = self.host_of(global);
            match hosts.iter_mut().find(|(h, _)| *h == host) {
                Some((_, members)) => members.push(group_rank),
                None => hosts.push((host, vec![group_rank])),
            }
        }
        GroupHosts {
            members: hosts.into_iter().map(|(_, m)| m).collect(),
        }
    }
}

/// The ranks of one group by host: `members[h]` are the group ranks on the group's `h`-th
/// host (hosts in order of their lowest group rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupHosts {
    pub members: Vec<Vec<usize>>,
}

impl GroupHosts {
    /// How `group` sits on the hosts of its world's placement.
    pub fn of(group: &dyn ProcessGroup) -> GroupHosts {
        group.config().hosts.group_hosts(group.global_ranks())
    }

    pub fn num_hosts(&self) -> usize {
        self.members.len()
    }

    /// The number of the group's ranks on each host, when it is the same on every host.
    pub fn uniform_ranks_per_host(&self) -> Option<usize> {
        let first = self.members.first()?.len();
        self.members
            .iter()
            .all(|m| m.len() == first)
            .then_some(first)
    }

    /// Whether a hierarchical all-reduce can save network traffic: the group spans more
    /// than one host and some host holds more than one of its ranks.
    pub fn hierarchy_helps(&self) -> bool {
        self.num_hosts() > 1 && self.members.iter().any(|m| m.len() > 1)
    }

    /// The ranks per host a hierarchical all-reduce over the group would use, or why it
    /// cannot: every host must hold the same number of the group's ranks (one rank per
    /// host takes part in each shard's cross-host all-reduce).
    pub fn check_hierarchical(&self, group_name: &str) -> Result<usize, String> {
        self.uniform_ranks_per_host().ok_or_else(|| {
            let counts: Vec<String> = self.members.iter().map(|m| m.len().to_string()).collect();
            format!(
                "a hierarchical all-reduce over group '{group_name}' needs the same number of \
                 its ranks on every host, but its {} hosts hold {} of them ({})",
                self.num_hosts(),
                counts.join(", "),
                self.members
                    .iter()
                    .map(|m| fmt_ranks(m))
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        })
    }
}

/// A group whose all-reduce is hierarchical: reduce-scatter inside the host, all-reduce of
/// each shard across the hosts (among the ranks holding that shard, one per host),
/// all-gather inside the host. Every other operation is the flat group's. It is a
/// [`ProcessGroup`], so DDP's buckets (or anything else that all-reduces) use it unchanged.
///
/// Results equal the flat all-reduce's up to the order of additions (and, for bf16/f16, one
/// more rounding: the host's partial sum is stored in the buffer's type before it crosses).
/// A buffer whose length is not a multiple of the ranks per host is padded in a scratch copy
/// when small, and otherwise has its few last elements reduced inside the host and then
/// across, uncopied; large host buffers go through the phases in pipelined pieces
/// ([`DEFAULT_PIECE_BYTES`]). Device buffers (GPU gradients over NCCL or staged sub-groups)
/// go through uncopied, in one piece.
pub struct HierarchicalGroup {
    core: Arc<Hierarchy>,
    sequence: Sequencer,
    /// Runs asynchronous operations in submission order, off the caller's thread. An
    /// all-reduce's reduce-scatters run on it, its cross-host all-reduces on the cross-host
    /// group's communication thread, its all-gathers on `Hierarchy::gather_stage` (with the MPI
    /// backend this needs `MPI_THREAD_MULTIPLE`, which Open MPI provides).
    engine: AsyncEngine,
}

/// The default largest piece of a buffer that goes through the three phases at once. Pieces
/// pipeline: while one crosses the network, the next is reduced inside the host and the
/// previous one gathered, so a large all-reduce costs about its slowest phase rather than the
/// sum of the three. 1 MiB is 8 ms at 1 Gbit/s, so per-piece latencies stay small; on the
/// netns cluster (2 × 2 ranks, 1 Gbit/s) it beat 4 MiB pieces at 4 and 16 MiB (0.85 and 0.79
/// of the flat time instead of 1.05 and 0.82) and tied at 64 MiB.
pub const DEFAULT_PIECE_BYTES: usize = 1 << 20;

struct Hierarchy {
    flat: Arc<dyn ProcessGroup>,
    /// This rank's host's ranks of the group: the reduce-scatters.
    local: Arc<dyn ProcessGroup>,
    /// The ranks at this rank's position on every host.
    across: Arc<dyn ProcessGroup>,
    /// The same ranks as `local`, for the all-gathers: they run on another thread than the
    /// reduce-scatters, and each group's operations must come in one order on all ranks.
    gather: Arc<dyn ProcessGroup>,
    /// Runs each piece's all-gather once its cross-host all-reduce is done.
    gather_stage: AsyncEngine,
    piece_bytes: usize,
    name: Arc<str>,
}

impl HierarchicalGroup {
    /// Builds the host and cross-host sub-groups of `flat` (called by every rank of `flat`,
    /// like a sub-group creation). Fails when the hosts hold different numbers of its ranks.
    pub fn new(flat: Arc<dyn ProcessGroup>) -> Result<HierarchicalGroup, CommError> {
        let hosts = GroupHosts::of(flat.as_ref());
        let ctx = OpContext::new("hierarchical_group", 0, Arc::from(flat.name()));
        let per_host =
            hosts
                .check_hierarchical(flat.name())
                .map_err(|details| CommError::InvalidRank {
                    ctx: ctx.clone(),
                    details,
                })?;
        let (host, position) = hosts
            .members
            .iter()
            .enumerate()
            .find_map(|(h, m)| m.iter().position(|&r| r == flat.rank()).map(|p| (h, p)))
            .expect("every rank of the group is on some host");
        debug_assert!(position < per_host);
        let globals = |members: &[usize]| -> String {
            let g: Vec<usize> = members.iter().map(|&r| flat.global_ranks()[r]).collect();
            fmt_ranks(&g).replace(' ', "")
        };
        let local_members = hosts.members[host].clone();
        let local = flat.new_named_subgroup(
            &local_members,
            &format!("{}/host{}", flat.name(), globals(&local_members)),
        )?;
        let across_members: Vec<usize> = hosts.members.iter().map(|m| m[position]).collect();
        let across = flat.new_named_subgroup(
            &across_members,
            &format!("{}/across{}", flat.name(), globals(&across_members)),
        )?;
        let gather = flat.new_named_subgroup(
            &local_members,
            &format!("{}/host-gather{}", flat.name(), globals(&local_members)),
        )?;
        let thread_name = format!("comm-{}-hier-r{}", flat.name(), flat.rank());
        Ok(HierarchicalGroup {
            sequence: Sequencer::new(flat.size()),
            core: Arc::new(Hierarchy {
                name: Arc::from(flat.name()),
                gather_stage: AsyncEngine::new(format!("{thread_name}-gather")),
                piece_bytes: DEFAULT_PIECE_BYTES,
                flat,
                local,
                across,
                gather,
            }),
            engine: AsyncEngine::new(thread_name),
        })
    }

    /// Pipelines buffers in pieces of at most `bytes` (at least one element per rank of a
    /// host) instead of [`DEFAULT_PIECE_BYTES`]. Every rank must use the same size.
    pub fn with_piece_bytes(mut self, bytes: usize) -> Self {
        Arc::get_mut(&mut self.core)
            .expect("a new group's state is not shared yet")
            .piece_bytes = bytes;
        self
    }

    /// The group of this rank's host.
    pub fn local(&self) -> &Arc<dyn ProcessGroup> {
        &self.core.local
    }

    /// The group across hosts of the ranks at this rank's position on its host.
    pub fn across(&self) -> &Arc<dyn ProcessGroup> {
        &self.core.across
    }

    /// The flat group it was built on.
    pub fn flat(&self) -> &Arc<dyn ProcessGroup> {
        &self.core.flat
    }

    fn prepare(&self, op: &Operation) -> Result<u64, CommError> {
        let seq = self.sequence.assign(op);
        let ctx = self.core.ctx(op, seq);
        // Device buffers are the sub-groups' to take or refuse (NCCL and staged groups take
        // them).
        op.validate(&ctx, self.rank(), self.size())?;
        Ok(seq)
    }
}

impl Hierarchy {
    /// The three phases on `buf` (this rank's whole buffer), whose length need not split
    /// over the host's L ranks:
    /// * a host buffer of at most one piece is padded in a scratch copy (cheaper, for a
    ///   buffer that small, than two more operations);
    /// * otherwise the last `len % L` elements are all-reduced inside the host and then
    ///   across (the same sums in the same order, with no shard to scatter) and the rest
    ///   goes through the phases in place: a large buffer is not copied, and a device buffer
    ///   goes through the sub-groups as it is.
    ///
    /// # Safety
    /// As `ProcessGroup::run_raw` for an in-place all-reduce of `buf`.
    unsafe fn all_reduce(&self, buf: RawBuf, op: ReduceOp) -> Result<(), CommError> {
        let parts = self.local.size();
        let even = buf.len() / parts * parts;
        if even == buf.len() {
            return self.phases(buf, op);
        }
        let padded = even + parts;
        let on_host = buf.device() == crate::dtype::Device::Cpu;
        if on_host && padded <= self.piece_len(buf, parts) {
            // Words of 4 bytes: aligned for every element type; zero bits are 0.0 in each.
            let elem = buf.dtype().size_bytes();
            let mut scratch = vec![0u32; (padded * elem).div_ceil(4)];
            let ptr: *mut u8 = scratch.as_mut_ptr().cast();
            // SAFETY: `buf` is valid for its bytes (caller's contract); the scratch holds more.
            std::ptr::copy_nonoverlapping(buf.ptr, ptr, buf.size_bytes());
            let whole = RawBuf {
                ptr,
                len: padded,
                dtype: buf.dtype(),
                device: crate::dtype::Device::Cpu,
            };
            self.phases(whole, op)?;
            std::ptr::copy_nonoverlapping(whole.ptr, buf.ptr, buf.size_bytes());
            return Ok(());
        }
        let tail = buf.sub(even, buf.len() - even);
        self.local.run_raw(Operation::AllReduce { buf: tail, op })?;
        self.across
            .run_raw(Operation::AllReduce { buf: tail, op })?;
        if even == 0 {
            return Ok(());
        }
        self.phases(buf.sub(0, even), op)
    }

    /// Elements of `buf`'s type that go through the phases at once (a multiple of `parts`).
    /// On a device the phases go in one piece: each is one operation on its own
    /// communicator's stream (which pipelines inside), and pieces handed between threads
    /// would start the three communicators' operations in an order that differs between
    /// ranks, which device collectives (NCCL) must not be given.
    fn piece_len(&self, buf: RawBuf, parts: usize) -> usize {
        match buf.device() {
            crate::dtype::Device::Cpu => {
                (self.piece_bytes / buf.dtype().size_bytes())
                    .div_ceil(parts)
                    .max(1)
                    * parts
            }
            _ => buf.len(),
        }
    }

    /// The three phases on `whole`, whose length is a multiple of the host's ranks.
    ///
    /// # Safety
    /// As [`Hierarchy::all_reduce`].
    unsafe fn phases(&self, whole: RawBuf, op: ReduceOp) -> Result<(), CommError> {
        let parts = self.local.size();
        let even = whole.len();
        if even == 0 {
            // Every rank has the same (empty) length: nothing to reduce anywhere.
            return Ok(());
        }
        // Average: each phase divides by its group's size, L then H: the sum over L × H.
        let piece = self.piece_len(whole, parts);
        if even <= piece {
            // One piece: nothing to overlap, so no hand-offs between threads either.
            let chunk = even / parts;
            let shard = whole.sub(self.local.rank() * chunk, chunk);
            self.local.run_raw(Operation::ReduceScatter {
                input: whole,
                output: shard,
                op,
            })?;
            self.across
                .run_raw(Operation::AllReduce { buf: shard, op })?;
            return self.gather.run_raw(Operation::AllGather {
                input: shard,
                output: whole,
            });
        }
        let mut gathers: Vec<Work> = Vec::new();
        let mut result = Ok(());
        let mut start = 0;
        while start < even && result.is_ok() {
            let segment = whole.sub(start, piece.min(even - start));
            start += segment.len();
            let shard_len = segment.len() / parts;
            let shard = segment.sub(self.local.rank() * shard_len, shard_len);
            result = self
                .local
                .run_raw(Operation::ReduceScatter {
                    input: segment,
                    output: shard,
                    op,
                })
                .and_then(|()| {
                    self.across
                        .start_raw(Operation::AllReduce { buf: shard, op })
                })
                .and_then(|crossing| {
                    let gather = Arc::clone(&self.gather);
                    self.gather_stage
                        .submit(move || {
                            crossing.wait()?;
                            // SAFETY: `all_reduce` waits for this job before it returns, so
                            // the caller's contract on the buffer still holds.
                            unsafe {
                                gather.run_raw(Operation::AllGather {
                                    input: shard,
                                    output: segment,
                                })
                            }
                        })
                        .map_err(|details| CommError::Backend {
                            ctx: OpContext::new("all_reduce", 0, Arc::clone(&self.name)),
                            details,
                        })
                })
                .map(|gathered| gathers.push(gathered));
        }
        // Every piece's phases finish before the buffer is handed back, also after an error.
        for gathered in gathers {
            let finished = gathered.wait();
            if result.is_ok() {
                result = finished;
            }
        }
        result
    }
}

impl Executor for Hierarchy {
    fn group_name(&self) -> &Arc<str> {
        &self.name
    }

    unsafe fn execute(&self, op: Operation, _seq: u64) -> Result<(), CommError> {
        match op {
            Operation::AllReduce { buf, op } => self.all_reduce(buf, op),
            other => self.flat.run_raw(other),
        }
    }
}

impl ProcessGroup for HierarchicalGroup {
    fn rank(&self) -> usize {
        self.core.flat.rank()
    }

    fn size(&self) -> usize {
        self.core.flat.size()
    }

    fn name(&self) -> &str {
        &self.core.name
    }

    fn global_ranks(&self) -> &[usize] {
        self.core.flat.global_ranks()
    }

    fn config(&self) -> &CommConfig {
        self.core.flat.config()
    }

    unsafe fn run_raw(&self, op: Operation) -> Result<(), CommError> {
        let seq = self.prepare(&op);
        self.engine.run(&self.core, op, seq)
    }

    unsafe fn start_raw(&self, op: Operation) -> Result<Work, CommError> {
        let seq = self.prepare(&op);
        self.engine.start(&self.core, op, seq)
    }

    fn new_subgroup(&self, ranks: &[usize]) -> Result<Arc<dyn ProcessGroup>, CommError> {
        self.core.flat.new_subgroup(ranks)
    }

    fn new_named_subgroup(
        &self,
        ranks: &[usize],
        name: &str,
    ) -> Result<Arc<dyn ProcessGroup>, CommError> {
        self.core.flat.new_named_subgroup(ranks, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_number_hosts_in_order_of_first_rank() {
        let p = HostPlacement::from_labels(&["b", "b", "a", "a", "b"]);
        assert_eq!(p, HostPlacement::PerRank(vec![0, 0, 1, 1, 0].into()));
        assert_eq!(
            HostPlacement::from_labels(&["x", "x"]),
            HostPlacement::OneHost
        );
        let hosts = p.group_hosts(&[0, 2, 4, 3]);
        assert_eq!(hosts.members, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(hosts.uniform_ranks_per_host(), Some(2));
        assert!(hosts.hierarchy_helps());
    }

    #[test]
    fn ranks_per_host_blocks_and_uneven_hosts_are_named() {
        let p = HostPlacement::RanksPerHost(2);
        assert_eq!(
            p.group_hosts(&[0, 1, 2, 3]).members,
            vec![vec![0, 1], vec![2, 3]]
        );
        // One rank per host, or one host: nothing to gain.
        assert!(!p.group_hosts(&[0, 2]).hierarchy_helps());
        assert!(!p.group_hosts(&[2, 3]).hierarchy_helps());
        let uneven = p.group_hosts(&[0, 1, 2]);
        let err = uneven.check_hierarchical("dp[0,1,2]").unwrap_err();
        assert_eq!(
            err,
            "a hierarchical all-reduce over group 'dp[0,1,2]' needs the same number of its \
             ranks on every host, but its 2 hosts hold 2, 1 of them ([0, 1] [2])"
        );
    }
}
