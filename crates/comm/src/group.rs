//! The [`ProcessGroup`] trait every backend implements, the operation descriptions
//! that cross it, and the [`Work`] handle of asynchronous operations.

use crate::dtype::{BufMut, BufRef, Device, RawBuf, ReduceOp};
use crate::error::{CommError, OpContext};
use crate::topology::HostPlacement;
use half::{bf16, f16};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Default time a collective waits for the other ranks before failing.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Settings shared by all groups of a world. Passed by value; there is no global state.
#[derive(Debug, Clone, PartialEq)]
pub struct CommConfig {
    /// How long one operation may wait for its peers before failing with
    /// [`CommError::Timeout`].
    pub timeout: Duration,
    /// Compare every collective's fingerprint (op, dtype, element count, sequence
    /// number) across ranks before running it. The threads backend always checks
    /// (it needs the check for memory safety and it costs a few loads); for MPI it costs
    /// one small extra all-gather per collective. On by default in debug builds.
    pub check_desync: bool,
    /// Which ranks share a host ([`HostPlacement`]): what hierarchical collectives and the
    /// placement checks of tensor parallelism go by. The threads backend takes it as given
    /// (`RanksPerHost` simulates hosts); the MPI backend replaces `OneHost` by the placement
    /// it detects (`MESHTRAIN_HOST`, else `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`).
    pub hosts: HostPlacement,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout: DEFAULT_TIMEOUT,
            check_desync: cfg!(debug_assertions),
            hosts: HostPlacement::OneHost,
        }
    }
}

impl CommConfig {
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn with_desync_check(mut self, on: bool) -> Self {
        self.check_desync = on;
        self
    }

    /// Simulated (threads) or asserted hosts of `n` consecutive ranks each; `n = 0` is one host.
    pub fn with_ranks_per_host(mut self, n: usize) -> Self {
        self.hosts = if n == 0 {
            HostPlacement::OneHost
        } else {
            HostPlacement::RanksPerHost(n)
        };
        self
    }
}

/// One communication operation with raw buffers, as handed to a backend.
///
/// Ranks (`root`, `dst`, `src`) are ranks *within the group*.
#[derive(Debug, Clone, Copy)]
pub enum Operation {
    /// In place: every rank ends with the reduction of all ranks' `buf`.
    AllReduce { buf: RawBuf, op: ReduceOp },
    /// `input` has `size × output.len()` elements; rank r receives the reduction of
    /// every rank's r-th chunk in `output`.
    ReduceScatter {
        input: RawBuf,
        output: RawBuf,
        op: ReduceOp,
    },
    /// `output` has `size × input.len()` elements; chunk r is rank r's `input`.
    AllGather { input: RawBuf, output: RawBuf },
    /// `input` and `output` have the same length, `size` equal chunks each: chunk j of
    /// `input` goes to rank j, and chunk i of `output` is what rank i sent here (its
    /// input chunk `rank`). The exchange behind expert and sequence parallelism, where
    /// every rank holds a different piece for every other rank.
    AllToAll { input: RawBuf, output: RawBuf },
    /// In place: every rank ends with `root`'s `buf`.
    Broadcast { buf: RawBuf, root: usize },
    /// Point-to-point: deliver `buf` to `dst`, matched by `tag`. Buffered: completes
    /// without waiting for the receiver.
    Send { buf: RawBuf, dst: usize, tag: u32 },
    /// Point-to-point: receive the message from `src` with `tag` into `buf`, whose
    /// length and dtype must equal the message's.
    Recv { buf: RawBuf, src: usize, tag: u32 },
    /// Returns once every rank of the group has arrived.
    Barrier,
}

/// Kind codes used in fingerprints.
pub(crate) const OP_ALL_REDUCE: u64 = 1;
pub(crate) const OP_REDUCE_SCATTER: u64 = 2;
pub(crate) const OP_ALL_GATHER: u64 = 3;
pub(crate) const OP_BROADCAST: u64 = 4;
pub(crate) const OP_BARRIER: u64 = 5;
pub(crate) const OP_ALL_TO_ALL: u64 = 6;

/// What all ranks must agree on for a collective: compared across ranks before data
/// is touched, so a desynchronised program fails with a clear message instead of
/// corrupting memory or deadlocking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    /// Operation kind code (see `OP_*`), with the reduce op or root folded in.
    pub kind: u64,
    /// Reduce op code or broadcast root (+1), 0 if unused.
    pub detail: u64,
    pub dtype: u64,
    /// Element count of the per-rank buffer that must match across ranks.
    pub count: u64,
    pub seq: u64,
}

impl Fingerprint {
    pub(crate) fn to_words(self) -> [u64; 5] {
        [self.kind, self.detail, self.dtype, self.count, self.seq]
    }

    pub(crate) fn from_words(w: [u64; 5]) -> Fingerprint {
        Fingerprint {
            kind: w[0],
            detail: w[1],
            dtype: w[2],
            count: w[3],
            seq: w[4],
        }
    }

    /// Human-readable form for desync messages.
    pub fn describe(&self) -> String {
        let op = match self.kind {
            OP_ALL_REDUCE => "all_reduce",
            OP_REDUCE_SCATTER => "reduce_scatter",
            OP_ALL_GATHER => "all_gather",
            OP_BROADCAST => "broadcast",
            OP_BARRIER => "barrier",
            OP_ALL_TO_ALL => "all_to_all",
            _ => "unknown",
        };
        let dtype =
            crate::dtype::dtype_from_code(self.dtype).map_or("none".to_string(), |d| d.to_string());
        let detail = match self.kind {
            OP_ALL_REDUCE | OP_REDUCE_SCATTER => match self.detail {
                1 => " sum",
                2 => " avg",
                3 => " max",
                _ => "",
            }
            .to_string(),
            OP_BROADCAST => format!(" root={}", self.detail.saturating_sub(1)),
            _ => String::new(),
        };
        format!("{op}{detail} #{} {dtype}×{}", self.seq, self.count)
    }
}

impl Operation {
    /// Name used in error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Operation::AllReduce { .. } => "all_reduce",
            Operation::ReduceScatter { .. } => "reduce_scatter",
            Operation::AllGather { .. } => "all_gather",
            Operation::AllToAll { .. } => "all_to_all",
            Operation::Broadcast { .. } => "broadcast",
            Operation::Send { .. } => "send",
            Operation::Recv { .. } => "recv",
            Operation::Barrier => "barrier",
        }
    }

    /// The buffers the operation reads or writes (none for a barrier). Allocation-free: every
    /// host backend asks it of every operation.
    pub fn buffers(&self) -> impl Iterator<Item = RawBuf> {
        let pair = match *self {
            Operation::AllReduce { buf, .. }
            | Operation::Broadcast { buf, .. }
            | Operation::Send { buf, .. }
            | Operation::Recv { buf, .. } => [Some(buf), None],
            Operation::ReduceScatter { input, output, .. }
            | Operation::AllGather { input, output }
            | Operation::AllToAll { input, output } => [Some(input), Some(output)],
            Operation::Barrier => [None, None],
        };
        pair.into_iter().flatten()
    }

    /// Where the operation's memory is: the device of its buffers (the host for a barrier).
    /// [`Operation::validate`] checks they agree.
    pub fn device(&self) -> Device {
        self.buffers().next().map_or(Device::Cpu, |b| b.device())
    }

    /// For backends that move host memory (threads, MPI, the hierarchical all-reduce): a
    /// device pointer is an address the host must never dereference, so a device buffer is
    /// an error naming the way to pass it, not a crash.
    pub(crate) fn require_host(&self, ctx: &OpContext) -> Result<(), CommError> {
        match self.device() {
            Device::Cpu => Ok(()),
            device => Err(CommError::InvalidBuffer {
                ctx: ctx.clone(),
                details: format!(
                    "the buffer is in {device}'s memory, and this backend moves host memory: \
                     wrap the group in a StagedGroup (copies through pinned host memory) or \
                     use the NCCL backend"
                ),
            }),
        }
    }

    /// The other rank of a send or receive (in the group); `None` for a collective.
    pub fn peer(&self) -> Option<usize> {
        match *self {
            Operation::Send { dst, .. } => Some(dst),
            Operation::Recv { src, .. } => Some(src),
            _ => None,
        }
    }

    /// True for operations that all ranks of the group take part in (and that are
    /// therefore numbered in the group and fingerprinted; a send or receive is numbered
    /// among the messages to or from its peer, [`crate::engine::Sequencer`]).
    pub fn is_collective(&self) -> bool {
        !matches!(self, Operation::Send { .. } | Operation::Recv { .. })
    }

    /// The cross-rank fingerprint of a collective at sequence number `seq`.
    pub(crate) fn fingerprint(&self, seq: u64) -> Fingerprint {
        let (kind, detail, buf) = match *self {
            Operation::AllReduce { buf, op } => (OP_ALL_REDUCE, op.code(), Some(buf)),
            Operation::ReduceScatter { output, op, .. } => {
                (OP_REDUCE_SCATTER, op.code(), Some(output))
            }
            Operation::AllGather { input, .. } => (OP_ALL_GATHER, 0, Some(input)),
            // The whole send buffer: with equal splits, equal totals mean equal chunks,
            // which is what lets a rank read its chunk of a peer's input.
            Operation::AllToAll { input, .. } => (OP_ALL_TO_ALL, 0, Some(input)),
            Operation::Broadcast { buf, root } => (OP_BROADCAST, root as u64 + 1, Some(buf)),
            Operation::Barrier | Operation::Send { .. } | Operation::Recv { .. } => {
                (OP_BARRIER, 0, None)
            }
        };
        Fingerprint {
            kind,
            detail,
            dtype: buf.map_or(0, |b| crate::dtype::dtype_code(b.dtype)),
            count: buf.map_or(0, |b| b.len as u64),
            seq,
        }
    }

    /// Checks what one rank can check alone: buffer length relations, matching dtypes
    /// and ranks in range. Backends call this before anything else.
    pub(crate) fn validate(
        &self,
        ctx: &OpContext,
        rank: usize,
        size: usize,
    ) -> Result<(), CommError> {
        let invalid_buffer = |details: String| CommError::InvalidBuffer {
            ctx: ctx.clone(),
            details,
        };
        let check_rank = |what: &str, r: usize| {
            if r >= size {
                Err(CommError::InvalidRank {
                    ctx: ctx.clone(),
                    details: format!("{what} {r} is out of range for a group of {size} ranks"),
                })
            } else {
                Ok(())
            }
        };
        // Reduce-scatter and all-gather: the `whole` side holds one `part`-sized block per
        // rank, in the same element type.
        let check_blocks = |input: RawBuf, output: RawBuf, input_is_whole: bool| {
            if input.dtype != output.dtype {
                return Err(invalid_buffer(format!(
                    "input is {} but output is {}",
                    input.dtype, output.dtype
                )));
            }
            let ((whole, whole_name), (part, part_name)) = if input_is_whole {
                ((input, "input"), (output, "output"))
            } else {
                ((output, "output"), (input, "input"))
            };
            if whole.len != part.len * size {
                return Err(invalid_buffer(format!(
                    "{whole_name} has {} elements but must have group size {size} × {part_name} length {} = {}",
                    whole.len,
                    part.len,
                    part.len * size
                )));
            }
            Ok(())
        };
        let device = self.device();
        if let Some(other) = self.buffers().find(|b| b.device() != device) {
            return Err(invalid_buffer(format!(
                "the input is in {device}'s memory but the output in {}'s: both must be on one \
                 device",
                other.device()
            )));
        }
        match *self {
            Operation::ReduceScatter { input, output, .. } => check_blocks(input, output, true)?,
            Operation::AllGather { input, output } => check_blocks(input, output, false)?,
            Operation::AllToAll { input, output } => {
                if input.dtype != output.dtype {
                    return Err(invalid_buffer(format!(
                        "input is {} but output is {}",
                        input.dtype, output.dtype
                    )));
                }
                if input.len != output.len {
                    return Err(invalid_buffer(format!(
                        "input has {} elements but output has {}; all_to_all needs equal lengths",
                        input.len, output.len
                    )));
                }
                if !input.len.is_multiple_of(size) {
                    return Err(invalid_buffer(format!(
                        "length {} is not a multiple of the group size {size} (one equal chunk per rank)",
                        input.len
                    )));
                }
                // Unlike all-gather there is no in-place form: peers still read this
                // rank's input chunks while it writes its output chunks.
                if input.overlaps(&output) {
                    return Err(invalid_buffer(
                        "input and output overlap; all_to_all cannot run in place".to_string(),
                    ));
                }
            }
            Operation::Broadcast { root, .. } => check_rank("root", root)?,
            Operation::Send { dst, .. } => {
                check_rank("destination", dst)?;
                if dst == rank {
                    return Err(CommError::InvalidRank {
                        ctx: ctx.clone(),
                        details: format!("rank {rank} cannot send to itself"),
                    });
                }
            }
            Operation::Recv { src, .. } => {
                check_rank("source", src)?;
                if src == rank {
                    return Err(CommError::InvalidRank {
                        ctx: ctx.clone(),
                        details: format!("rank {rank} cannot receive from itself"),
                    });
                }
            }
            Operation::AllReduce { .. } | Operation::Barrier => {}
        }
        Ok(())
    }
}

/// Checks a sub-group rank list (ranks of a group of `size`) and returns the
/// caller's index in it.
pub(crate) fn validate_subgroup(
    ctx: &OpContext,
    ranks: &[usize],
    my_rank: usize,
    size: usize,
) -> Result<usize, CommError> {
    let invalid = |details: String| CommError::InvalidRank {
        ctx: ctx.clone(),
        details,
    };
    if ranks.is_empty() {
        return Err(invalid("a sub-group needs at least one rank".to_string()));
    }
    let mut seen = vec![false; size];
    for &r in ranks {
        if r >= size {
            return Err(invalid(format!(
                "sub-group rank {r} is out of range for a group of {size} ranks"
            )));
        }
        if std::mem::replace(&mut seen[r], true) {
            return Err(invalid(format!("sub-group lists rank {r} twice")));
        }
    }
    ranks.iter().position(|&r| r == my_rank).ok_or_else(|| {
        invalid(format!(
            "rank {my_rank} called new_subgroup for {} but is not a member",
            crate::error::fmt_ranks(ranks)
        ))
    })
}

/// Checks the `(sender, receiver)` pairs given to
/// [`ProcessGroup::prepare_point_to_point`]: ranks of a group of `size`, two different ones.
pub(crate) fn validate_pairs(
    ctx: &OpContext,
    pairs: &[(usize, usize)],
    size: usize,
) -> Result<(), CommError> {
    match pairs
        .iter()
        .find(|&&(from, to)| from >= size || to >= size || from == to)
    {
        None => Ok(()),
        Some(&(from, to)) => Err(CommError::InvalidRank {
            ctx: ctx.clone(),
            details: format!(
                "sends from rank {from} to rank {to}: a pair needs two different ranks of \
                 the group's {size}"
            ),
        }),
    }
}

/// When an asynchronous operation ran on the communication thread: from the moment it
/// started executing (after the operations queued before it) to its completion. DDP uses it
/// to split communication time into the part hidden behind backward and the part exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpSpan {
    pub began: Instant,
    pub finished: Instant,
}

impl OpSpan {
    pub fn duration(&self) -> Duration {
        self.finished.saturating_duration_since(self.began)
    }
}

/// Shared completion state of an asynchronous operation.
#[derive(Default)]
pub(crate) struct Completion {
    result: Mutex<Option<Result<(), CommError>>>,
    done: Condvar,
    span: Mutex<(Option<Instant>, Option<Instant>)>,
    /// When a thread first blocked in [`Completion::wait`]; it stays blocked until the
    /// operation completes, so a backend whose completions are found by polling (NCCL's
    /// events) polls faster while this is set and the operation is not done.
    waited_since: Mutex<Option<Instant>>,
    /// Told when a thread starts waiting, so such a poller looks at once (one per group,
    /// shared by its operations).
    on_wait: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("done", &self.is_done())
            .finish_non_exhaustive()
    }
}

impl Completion {
    /// A completion whose waiters call `on_wait` as they start waiting.
    pub(crate) fn hurried_by(on_wait: Arc<dyn Fn() + Send + Sync>) -> Completion {
        Completion {
            on_wait: Some(on_wait),
            ..Completion::default()
        }
    }

    /// Since when a thread has been blocked waiting for this operation, if one has (it
    /// waits until the operation completes).
    pub(crate) fn waited_since(&self) -> Option<Instant> {
        *self.waited_since.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the moment the operation starts executing.
    pub(crate) fn begin(&self) {
        self.span.lock().unwrap_or_else(|e| e.into_inner()).0 = Some(Instant::now());
    }

    pub(crate) fn complete(&self, result: Result<(), CommError>) {
        {
            let mut span = self.span.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            span.0.get_or_insert(now);
            span.1 = Some(now);
        }
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
        self.done.notify_all();
    }

    fn span(&self) -> OpSpan {
        let span = self.span.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        OpSpan {
            began: span.0.unwrap_or(now),
            finished: span.1.unwrap_or(now),
        }
    }

    fn is_done(&self) -> bool {
        self.result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn wait(&self) -> Result<(), CommError> {
        (self.waited_since.lock().unwrap_or_else(|e| e.into_inner()))
            .get_or_insert_with(Instant::now);
        if let Some(on_wait) = &self.on_wait {
            on_wait();
        }
        let mut guard = self.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(result) = guard.take() {
                return result;
            }
            guard = self.done.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Handle of an asynchronous operation.
///
/// The operation progresses on the rank's communication thread without being polled.
/// [`Work::wait`] blocks until it completes and returns its result. Dropping a `Work`
/// without waiting also blocks until completion (the error, if any, is lost), so the
/// buffers it uses are never released while the operation still touches them.
#[must_use = "an async operation's buffer is in use until the Work is waited on"]
#[derive(Debug)]
pub struct Work {
    completion: Option<Arc<Completion>>,
}

impl Work {
    pub(crate) fn new(completion: Arc<Completion>) -> Work {
        Work {
            completion: Some(completion),
        }
    }

    /// A handle that is already complete with `result`.
    pub(crate) fn ready(result: Result<(), CommError>) -> Work {
        let completion = Arc::new(Completion::default());
        completion.complete(result);
        Work::new(completion)
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_done(&self) -> bool {
        match &self.completion {
            Some(c) => c.is_done(),
            None => true,
        }
    }

    /// Blocks until the operation has completed and returns its result.
    pub fn wait(mut self) -> Result<(), CommError> {
        match self.completion.take() {
            Some(c) => c.wait(),
            None => Ok(()),
        }
    }

    /// As [`Work::wait`], also returning when the operation ran (see [`OpSpan`]).
    pub fn wait_timed(mut self) -> Result<OpSpan, CommError> {
        match self.completion.take() {
            Some(c) => c.wait().map(|()| c.span()),
            None => {
                let now = Instant::now();
                Ok(OpSpan {
                    began: now,
                    finished: now,
                })
            }
        }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if let Some(c) = self.completion.take() {
            let _ = c.wait();
        }
    }
}

/// An owned buffer of any supported dtype, for the safe asynchronous API: the group
/// keeps the buffer while the operation runs and hands it back from [`OwnedWork::wait`].
#[derive(Debug, Clone, PartialEq)]
pub enum OwnedBuf {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl OwnedBuf {
    fn raw(&mut self) -> RawBuf {
        // SAFETY: the Vec's heap block does not move when the OwnedBuf is moved into
        // the OwnedWork, and OwnedWork only releases it after the operation completed.
        unsafe {
            match self {
                OwnedBuf::F32(v) => RawBuf::from_slice(v.as_mut_slice()),
                OwnedBuf::BF16(v) => RawBuf::from_slice(v.as_mut_slice()),
                OwnedBuf::F16(v) => RawBuf::from_slice(v.as_mut_slice()),
            }
        }
    }
}

/// Handle of an asynchronous operation on an [`OwnedBuf`]; yields the buffer back.
#[must_use = "the buffer comes back from OwnedWork::wait"]
#[derive(Debug)]
pub struct OwnedWork {
    // Field order matters: `work` is dropped (and so waited on) before `buf` is freed.
    work: Work,
    buf: OwnedBuf,
}

impl OwnedWork {
    pub fn is_done(&self) -> bool {
        self.work.is_done()
    }

    /// Waits for completion and returns the buffer with the result.
    pub fn wait(self) -> Result<OwnedBuf, CommError> {
        let OwnedWork { work, buf } = self;
        work.wait()?;
        Ok(buf)
    }
}

impl std::fmt::Debug for dyn ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("name", &self.name())
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish()
    }
}

/// Where the members of a group stand in a companion engine's collectives
/// ([`ProcessGroup::position_board`]).
pub trait PositionBoard: Send + Sync {
    /// This member issued collective `seq` (`op`) of the companion group.
    fn issued(&self, op: &'static str, seq: u64);
    /// The members (world ranks) that will not take part in collective `seq`: those that
    /// have not issued it, or stopped (died, failed) having issued it but not later ones;
    /// with a note on where each was last seen or how it stopped. `None` when the board
    /// cannot tell (its channel did not answer in time).
    fn missing(&self, seq: u64) -> Option<MissingMembers>;
    /// The members known to have stopped without doing their part of collective
    /// `Some(seq)`: that never issued it, or, in another process, issued it and then died
    /// (its GPU work dies with it; a member in this process completes what it issued before
    /// its group goes). For a send or receive (`None`): that died or failed at all. From what
    /// this member already holds, without asking anyone: cheap enough for a watchdog's every
    /// look, so an operation waiting for a dead member fails at once rather than at the
    /// timeout. `None` while no such member is known.
    fn stopped(&self, seq: Option<u64>) -> Option<MissingMembers>;
}

/// Ranks (global) an operation cannot complete without, and why: the answer of
/// [`PositionBoard::missing`] and [`PositionBoard::stopped`], and of MPI's failure monitor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingMembers {
    pub ranks: Vec<usize>,
    /// `rank 3 last seen after barrier #1 on group 'world'; …`
    pub note: String,
}

/// A group of ranks that run collectives together.
///
/// Each rank holds its own handle (a value, no global state). All ranks of a group
/// must issue the same collectives in the same order; point-to-point operations are
/// matched by (source, destination, tag). A handle must not be used from two threads
/// at the same time for operations that depend on order.
///
/// Synchronous methods return when this rank's part is complete and its buffers may be
/// reused. `*_async` methods return a [`Work`] immediately; the operation runs on the
/// rank's communication thread in submission order, before any later synchronous
/// operation, and produces bit-identical results to the synchronous form.
pub trait ProcessGroup: Send + Sync {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Name used in errors and logs, e.g. `world` or `tp[2,3]`.
    fn name(&self) -> &str;
    /// The world rank of each group rank.
    fn global_ranks(&self) -> &[usize];
    /// Settings the group was created with.
    fn config(&self) -> &CommConfig;

    /// Runs `op` to completion on the calling thread (after any pending async ops).
    ///
    /// # Safety
    /// The buffers in `op` must be valid for the duration of the call, output buffers
    /// must not be accessed by anyone else meanwhile, and input buffers not written.
    unsafe fn run_raw(&self, op: Operation) -> Result<(), CommError>;

    /// Starts `op` asynchronously and returns a handle to wait on.
    ///
    /// # Safety
    /// Same as [`RawBuf::from_slice`]: until the returned [`Work`] has been waited on
    /// or dropped, the buffers in `op` must stay allocated, output buffers must not be
    /// read or written by anyone else and input buffers must not be written. Leaking
    /// the `Work` (`mem::forget`) while the buffers are freed is undefined behaviour.
    unsafe fn start_raw(&self, op: Operation) -> Result<Work, CommError>;

    /// A group of the given ranks (ranks of *this* group, listed in the order that
    /// defines the new group's ranks). Must be called by every listed rank, in the same
    /// order relative to other sub-group creations with the same rank list; ranks not
    /// listed need not call it. The caller must be listed. Named after this group and the
    /// members' world ranks (`world/sub[0,2]`).
    fn new_subgroup(&self, ranks: &[usize]) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let globals: Vec<usize> = ranks
            .iter()
            .filter_map(|&r| self.global_ranks().get(r).copied())
            .collect();
        let name = format!(
            "{}/sub{}",
            self.name(),
            crate::error::fmt_ranks(&globals).replace(' ', "")
        );
        self.new_named_subgroup(ranks, &name)
    }

    /// [`ProcessGroup::new_subgroup`] with an explicit name for errors and logs
    /// (e.g. `dp[0,2]` from a [`DeviceMesh`](crate::DeviceMesh)).
    fn new_named_subgroup(
        &self,
        ranks: &[usize],
        name: &str,
    ) -> Result<Arc<dyn ProcessGroup>, CommError>;

    /// Prepares the group for sends and receives between the ordered pairs `(sender,
    /// receiver)` of `pairs` (ranks of this group). Every rank of the group calls it with the
    /// same list, before the first such send; nothing else may run on the group meanwhile.
    ///
    /// Why: the host backends buffer sends and match them by tag, so any order of sends and
    /// receives that completes on paper completes on them. NCCL does neither: a send finishes
    /// only once received, and operations run in issue order on a stream, so two ranks whose
    /// sends cross (a pipeline's activations one way, its gradients the other) would each
    /// wait for a receive queued behind the other's send. A backend like that gives each
    /// pair a channel of its own here ([`NcclGroup`](crate::NcclGroup): a communicator and
    /// stream per pair), after which the only order that matters is each pair's: messages
    /// received in the order they are sent. The host backends need nothing (the default).
    fn prepare_point_to_point(&self, pairs: &[(usize, usize)]) -> Result<(), CommError> {
        let ctx = OpContext::new("prepare_point_to_point", 0, Arc::from(self.name()));
        validate_pairs(&ctx, pairs, self.size())
    }

    /// A board where this group's members post how far they have got in the collectives of
    /// a companion engine that cannot say who is missing (NCCL's kernels wait on the GPU
    /// and know nothing of their peers), so a member whose operation timed out can name
    /// the members that never issued it. The board is this backend's side channel, which
    /// keeps working whatever state the companion is in (MPI's failure monitor, the threads'
    /// shared memory). Every member asks for it once, in the same order as they create
    /// sub-groups; `name` is the companion group's, for the notes on where members were last
    /// seen. `None` (the default) where the backend has no such channel.
    fn position_board(&self, _name: &str) -> Option<Arc<dyn PositionBoard>> {
        None
    }

    /// Whether the group's own all-reduce already follows the hosts, crossing the network
    /// once per host rather than once per rank (NCCL's rings and trees do): a hierarchical
    /// all-reduce built over it on the user's behalf (`grad_reduce = "auto"`) would only add
    /// steps. The host backends' collectives see ranks, not hosts (the default).
    fn follows_hosts(&self) -> bool {
        false
    }

    /// In-place all-reduce.
    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        // SAFETY: `buf` is exclusively borrowed for this blocking call.
        unsafe { self.run_raw(Operation::AllReduce { buf: buf.raw(), op }) }
    }

    /// Reduce-scatter: `input.len() == size() × output.len()`.
    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        // SAFETY: borrows held for this blocking call.
        unsafe {
            self.run_raw(Operation::ReduceScatter {
                input: input.raw(),
                output: output.raw(),
                op,
            })
        }
    }

    /// All-gather: `output.len() == size() × input.len()`, rank-ordered chunks.
    fn all_gather(&self, input: BufRef<'_>, mut output: BufMut<'_>) -> Result<(), CommError> {
        // SAFETY: borrows held for this blocking call.
        unsafe {
            self.run_raw(Operation::AllGather {
                input: input.raw(),
                output: output.raw(),
            })
        }
    }

    /// All-to-all with equal splits: `input.len() == output.len()`, a multiple of
    /// `size()`; chunk j of `input` goes to rank j and chunk i of `output` comes from
    /// rank i.
    fn all_to_all(&self, input: BufRef<'_>, mut output: BufMut<'_>) -> Result<(), CommError> {
        // SAFETY: borrows held for this blocking call; a shared and an exclusive borrow
        // cannot overlap.
        unsafe {
            self.run_raw(Operation::AllToAll {
                input: input.raw(),
                output: output.raw(),
            })
        }
    }

    /// In-place broadcast from group rank `root`.
    fn broadcast(&self, mut buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        // SAFETY: `buf` is exclusively borrowed for this blocking call.
        unsafe {
            self.run_raw(Operation::Broadcast {
                buf: buf.raw(),
                root,
            })
        }
    }

    /// Sends `buf` to group rank `dst` with `tag`. Buffered: does not wait for the receiver.
    fn send(&self, buf: BufRef<'_>, dst: usize, tag: u32) -> Result<(), CommError> {
        // SAFETY: `buf` is borrowed for this blocking call and only read.
        unsafe {
            self.run_raw(Operation::Send {
                buf: buf.raw(),
                dst,
                tag,
            })
        }
    }

    /// Receives the next message from group rank `src` with `tag` into `buf`.
    /// The message must have exactly `buf.len()` elements of `buf`'s dtype.
    fn recv(&self, mut buf: BufMut<'_>, src: usize, tag: u32) -> Result<(), CommError> {
        // SAFETY: `buf` is exclusively borrowed for this blocking call.
        unsafe {
            self.run_raw(Operation::Recv {
                buf: buf.raw(),
                src,
                tag,
            })
        }
    }

    /// Waits until every rank of the group has arrived.
    fn barrier(&self) -> Result<(), CommError> {
        // SAFETY: no buffers.
        unsafe { self.run_raw(Operation::Barrier) }
    }

    /// Asynchronous in-place all-reduce on a raw view (e.g. a DDP bucket: a sub-slice
    /// of a flat gradient buffer whose other parts are still being written).
    ///
    /// # Safety
    /// See [`ProcessGroup::start_raw`].
    unsafe fn all_reduce_async(&self, buf: RawBuf, op: ReduceOp) -> Result<Work, CommError> {
        self.start_raw(Operation::AllReduce { buf, op })
    }

    /// Asynchronous reduce-scatter on raw views.
    ///
    /// # Safety
    /// See [`ProcessGroup::start_raw`].
    unsafe fn reduce_scatter_async(
        &self,
        input: RawBuf,
        output: RawBuf,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        self.start_raw(Operation::ReduceScatter { input, output, op })
    }

    /// Asynchronous all-gather on raw views.
    ///
    /// # Safety
    /// See [`ProcessGroup::start_raw`].
    unsafe fn all_gather_async(&self, input: RawBuf, output: RawBuf) -> Result<Work, CommError> {
        self.start_raw(Operation::AllGather { input, output })
    }

    /// Asynchronous all-to-all on raw views (which must not overlap).
    ///
    /// # Safety
    /// See [`ProcessGroup::start_raw`].
    unsafe fn all_to_all_async(&self, input: RawBuf, output: RawBuf) -> Result<Work, CommError> {
        self.start_raw(Operation::AllToAll { input, output })
    }

    /// Asynchronous broadcast on a raw view.
    ///
    /// # Safety
    /// See [`ProcessGroup::start_raw`].
    unsafe fn broadcast_async(&self, buf: RawBuf, root: usize) -> Result<Work, CommError> {
        self.start_raw(Operation::Broadcast { buf, root })
    }

    /// Asynchronous send of a raw view.
    ///
    /// # Safety
    /// See [`ProcessGroup::start_raw`].
    unsafe fn send_async(&self, buf: RawBuf, dst: usize, tag: u32) -> Result<Work, CommError> {
        self.start_raw(Operation::Send { buf, dst, tag })
    }

    /// Asynchronous receive into a raw view.
    ///
    /// # Safety
    /// See [`ProcessGroup::start_raw`].
    unsafe fn recv_async(&self, buf: RawBuf, src: usize, tag: u32) -> Result<Work, CommError> {
        self.start_raw(Operation::Recv { buf, src, tag })
    }

    /// Asynchronous barrier.
    fn barrier_async(&self) -> Result<Work, CommError> {
        // SAFETY: no buffers.
        unsafe { self.start_raw(Operation::Barrier) }
    }

    /// Safe asynchronous all-reduce: the group owns `buf` until [`OwnedWork::wait`]
    /// hands it back.
    fn all_reduce_owned(&self, mut buf: OwnedBuf, op: ReduceOp) -> Result<OwnedWork, CommError> {
        let raw = buf.raw();
        // SAFETY: the heap block of `buf` lives inside the returned OwnedWork, which
        // waits for completion before releasing it; leaking the OwnedWork leaks the
        // buffer too, so no use-after-free is possible.
        let work = unsafe { self.start_raw(Operation::AllReduce { buf: raw, op })? };
        Ok(OwnedWork { work, buf })
    }
}
