//! Shared-memory threads backend: N workers in one process, the embedded default.
//!
//! ## Algorithm
//! Every collective is two phases separated by per-rank sequence counters:
//! 1. *arrive*: each rank publishes its buffer addresses and the operation's
//!    fingerprint in its slot, then waits until every rank has arrived at the same
//!    sequence number. Fingerprints are compared before any data is touched.
//! 2. *work*: each rank does its share reading the peers' buffers directly, then marks
//!    itself done and waits for all ranks to be done (so no buffer is reused while a
//!    peer may still read it).
//!
//! The all-reduce is reduce-scatter and all-gather fused into one pass: rank r owns
//! chunk r, reads chunk r of every rank's buffer (in rank order, accumulating in f32)
//! and writes the result straight into chunk r of every rank's buffer. Each byte is
//! read once and written once, exactly like a memcpy of the buffer, and the N chunks
//! are processed by the N worker threads in parallel. The reduction order is fixed
//! (rank 0, 1, …), so results are bit-identical from run to run.
//!
//! ## Waiting and failure
//! Waits spin briefly, then yield, then sleep on a condition variable (so
//! oversubscribed runs do not burn the cores of the ranks they wait for). While
//! waiting, a rank checks the deadline, whether the group was marked broken and whether
//! any rank it waits for has panicked, failed or exited; each case becomes a typed
//! [`CommError`] naming the op, its sequence number, the group and the missing ranks.

use crate::dtype::{reduce_into, with_element, RawBuf};
use crate::engine::{AsyncEngine, Executor, Sequencer};
use crate::error::{CommError, OpContext};
use crate::group::{
    CommConfig, Fingerprint, MissingMembers, Operation, PositionBoard, ProcessGroup, Work,
};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const RANK_RUNNING: u8 = 0;
const RANK_FINISHED: u8 = 1;
const RANK_FAILED: u8 = 2;

/// How long [`ThreadsWorld::run`] waits for the remaining workers after the first one
/// failed, before returning and abandoning workers that are stuck outside any
/// collective. Workers inside a collective notice a failed peer within milliseconds.
pub const FAILURE_GRACE: Duration = Duration::from_secs(1);

/// State shared by every group of one threads world.
struct World {
    config: CommConfig,
    /// Per world rank: running, finished or failed.
    status: Vec<AtomicU8>,
    /// Why a rank stopped, for error messages.
    reasons: Mutex<Vec<Option<String>>>,
    /// Sub-groups being created: the first member creates the shared state, the
    /// others pick it up; removed once every member has it.
    registry: Mutex<HashMap<SubgroupKey, (Arc<GroupShared>, usize)>>,
    next_group_id: AtomicU64,
}

/// Identifies one sub-group creation: parent group, member world ranks, and how many
/// times before each member created a sub-group with exactly these ranks.
type SubgroupKey = (u64, Vec<usize>, usize);

impl World {
    fn mark(&self, rank: usize, state: u8, reason: String) {
        self.reasons.lock().unwrap_or_else(|e| e.into_inner())[rank] = Some(reason);
        self.status[rank].store(state, Ordering::SeqCst);
    }

    fn is_running(&self, rank: usize) -> bool {
        self.status[rank].load(Ordering::SeqCst) == RANK_RUNNING
    }

    fn reason(&self, rank: usize) -> String {
        self.reasons.lock().unwrap_or_else(|e| e.into_inner())[rank]
            .clone()
            .unwrap_or_else(|| "stopped".to_string())
    }
}

/// One rank's published state for the current collective. Aligned to its own cache
/// lines so ranks do not false-share.
#[repr(align(128))]
#[derive(Default)]
struct Slot {
    /// Sequence number of the last collective this rank arrived at.
    arrived: AtomicU64,
    /// Sequence number of the last collective this rank finished its part of.
    done: AtomicU64,
    fingerprint: [AtomicU64; 5],
    input: AtomicPtr<u8>,
}

#[derive(Clone, Copy)]
enum Phase {
    Arrive,
    Done,
}

/// A point-to-point message: buffered copy of the sender's elements.
struct Message {
    dtype: crate::DType,
    len: usize,
    bytes: Vec<u8>,
}

type MailboxKey = (usize, usize, u32);

/// State shared by the ranks of one group.
struct GroupShared {
    id: u64,
    name: String,
    world: Arc<World>,
    global_ranks: Vec<usize>,
    slots: Box<[Slot]>,
    broken: Mutex<Option<String>>,
    is_broken: AtomicBool,
    sleepers: AtomicUsize,
    wake_lock: Mutex<()>,
    wake: Condvar,
    mailbox: Mutex<HashMap<MailboxKey, VecDeque<Message>>>,
    mail_arrived: Condvar,
    /// Per member, the last collective it issued on the companion engine whose positions
    /// this group keeps ([`ProcessGroup::position_board`]): (op, sequence number).
    issued: Mutex<Vec<(&'static str, u64)>>,
}

impl GroupShared {
    fn new(world: Arc<World>, name: String, global_ranks: Vec<usize>) -> GroupShared {
        let id = world.next_group_id.fetch_add(1, Ordering::Relaxed);
        let n = global_ranks.len();
        GroupShared {
            id,
            name,
            world,
            slots: (0..n).map(|_| Slot::default()).collect(),
            global_ranks,
            broken: Mutex::new(None),
            is_broken: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            wake_lock: Mutex::new(()),
            wake: Condvar::new(),
            mailbox: Mutex::new(HashMap::new()),
            mail_arrived: Condvar::new(),
            issued: Mutex::new(vec![("", 0); n]),
        }
    }

    fn notify(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
    }

    fn mark_broken(&self, cause: String) {
        let mut broken = self.broken.lock().unwrap_or_else(|e| e.into_inner());
        if broken.is_none() {
            *broken = Some(cause);
        }
        self.is_broken.store(true, Ordering::SeqCst);
        drop(broken);
        let _guard = self.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.wake.notify_all();
    }

    fn broken_error(&self, ctx: &OpContext) -> Option<CommError> {
        if !self.is_broken.load(Ordering::SeqCst) {
            return None;
        }
        let cause = self
            .broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default();
        Some(CommError::Broken {
            ctx: ctx.clone(),
            cause,
        })
    }

    fn phase_reached(&self, phase: Phase, seq: u64, rank: usize) -> bool {
        let slot = &self.slots[rank];
        let value = match phase {
            Phase::Arrive => slot.arrived.load(Ordering::Acquire),
            Phase::Done => slot.done.load(Ordering::Acquire),
        };
        value >= seq
    }

    fn all_reached(&self, phase: Phase, seq: u64) -> bool {
        (0..self.slots.len()).all(|r| self.phase_reached(phase, seq, r))
    }

    /// Checks the slow-path failure conditions while waiting.
    fn wait_failure(
        &self,
        ctx: &OpContext,
        phase: Phase,
        seq: u64,
        deadline: Instant,
    ) -> Option<CommError> {
        if let Some(err) = self.broken_error(ctx) {
            return Some(err);
        }
        let missing: Vec<usize> = (0..self.slots.len())
            .filter(|&r| !self.phase_reached(phase, seq, r))
            .map(|r| self.global_ranks[r])
            .collect();
        let stopped: Vec<usize> = missing
            .iter()
            .copied()
            .filter(|&g| !self.world.is_running(g))
            .collect();
        if !stopped.is_empty() {
            let reason = stopped
                .iter()
                .map(|&g| format!("rank {g}: {}", self.world.reason(g)))
                .collect::<Vec<_>>()
                .join("; ");
            return Some(CommError::PeerFailed {
                ctx: ctx.clone(),
                missing: stopped,
                reason,
            });
        }
        if Instant::now() >= deadline {
            let err = CommError::Timeout {
                ctx: ctx.clone(),
                timeout: self.world.config.timeout,
                missing,
                note: Box::default(),
            };
            self.mark_broken(err.to_string());
            return Some(err);
        }
        None
    }

    /// Waits until every rank reached `phase` of collective `seq`.
    fn wait_phase(&self, ctx: &OpContext, phase: Phase, seq: u64) -> Result<(), CommError> {
        // One `pause` costs ~140 cycles on recent x86, so the spin phase lasts ~1 µs,
        // then each check is followed by a `yield` (a peer waiting for this core runs
        // at once), then by a sleep. Longer spins were measured to cost latency when
        // two ranks share a core: 4 KiB all-reduce on 2 busy cores took 18 µs with a
        // ~18 µs spin, 8 µs with ~4.5 µs, 6 µs with this one.
        const SPINS: u32 = 4;
        const YIELDS: u32 = 256;
        let mut attempt = 0u32;
        let mut deadline = None;
        loop {
            if self.all_reached(phase, seq) {
                return Ok(());
            }
            attempt = attempt.saturating_add(1);
            if attempt < SPINS {
                for _ in 0..4 {
                    std::hint::spin_loop();
                }
                continue;
            }
            let deadline = *deadline.get_or_insert_with(|| {
                // The spin phase is microseconds; start the clock here to keep the
                // fast path free of clock reads.
                Instant::now() + self.world.config.timeout
            });
            if let Some(err) = self.wait_failure(ctx, phase, seq, deadline) {
                return Err(err);
            }
            if attempt < SPINS + YIELDS {
                std::thread::yield_now();
                continue;
            }
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            let guard = self.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
            if !self.all_reached(phase, seq) && !self.is_broken.load(Ordering::SeqCst) {
                let nap = deadline
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(5));
                let _ = self.wake.wait_timeout(guard, nap);
            } else {
                drop(guard);
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Rank `rank`'s view of a group; what the communication thread needs.
struct RankCore {
    shared: Arc<GroupShared>,
    rank: usize,
    /// This rank's own copy of the group name: cloning it for error contexts never
    /// touches a reference count shared with other ranks' threads.
    name: Arc<str>,
}

impl Executor for RankCore {
    fn group_name(&self) -> &Arc<str> {
        &self.name
    }

    unsafe fn execute(&self, op: Operation, seq: u64) -> Result<(), CommError> {
        RankCore::execute(self, op, seq)
    }
}

impl RankCore {
    /// Runs one operation on the calling thread.
    ///
    /// # Safety
    /// As for [`ProcessGroup::run_raw`].
    unsafe fn execute(&self, op: Operation, seq: u64) -> Result<(), CommError> {
        let ctx = self.ctx(&op, seq);
        match op {
            Operation::Send { buf, dst, tag } => self.send(&ctx, buf, dst, tag),
            Operation::Recv { buf, src, tag } => self.recv(&ctx, buf, src, tag),
            _ => self.collective(&ctx, op, seq),
        }
    }

    unsafe fn collective(&self, ctx: &OpContext, op: Operation, seq: u64) -> Result<(), CommError> {
        let shared = &*self.shared;
        if let Some(err) = shared.broken_error(ctx) {
            return Err(err);
        }
        let me = &shared.slots[self.rank];
        let fingerprint = op.fingerprint(seq);
        for (word, value) in me.fingerprint.iter().zip(fingerprint.to_words()) {
            word.store(value, Ordering::Relaxed);
        }
        let input = match op {
            Operation::AllReduce { buf, .. } | Operation::Broadcast { buf, .. } => buf.ptr,
            Operation::ReduceScatter { input, .. }
            | Operation::AllGather { input, .. }
            | Operation::AllToAll { input, .. } => input.ptr,
            _ => std::ptr::null_mut(),
        };
        me.input.store(input, Ordering::Relaxed);
        me.arrived.store(seq, Ordering::SeqCst);
        shared.notify();
        shared.wait_phase(ctx, Phase::Arrive, seq)?;

        self.check_fingerprints(ctx, fingerprint)?;
        let peers: Vec<*mut u8> = shared
            .slots
            .iter()
            .map(|s| s.input.load(Ordering::Relaxed))
            .collect();
        self.do_work(op, &peers);

        me.done.store(seq, Ordering::SeqCst);
        shared.notify();
        shared.wait_phase(ctx, Phase::Done, seq)
    }

    /// Compares every rank's fingerprint with ours. All ranks see the same published
    /// fingerprints, so either all of them run the collective or all fail.
    fn check_fingerprints(&self, ctx: &OpContext, mine: Fingerprint) -> Result<(), CommError> {
        let shared = &*self.shared;
        let all: Vec<Fingerprint> = shared
            .slots
            .iter()
            .map(|s| {
                let mut words = [0u64; 5];
                for (w, a) in words.iter_mut().zip(&s.fingerprint) {
                    *w = a.load(Ordering::Relaxed);
                }
                Fingerprint::from_words(words)
            })
            .collect();
        if all.iter().all(|f| *f == mine) {
            return Ok(());
        }
        let details = all
            .iter()
            .enumerate()
            .map(|(r, f)| format!("rank {}: {}", shared.global_ranks[r], f.describe()))
            .collect::<Vec<_>>()
            .join("; ");
        let err = CommError::Desync {
            ctx: ctx.clone(),
            details,
        };
        shared.mark_broken(err.to_string());
        Err(err)
    }

    /// This rank's share of the data movement. Peers' buffers are read (and, for
    /// all-reduce, written) only within this rank's chunk.
    unsafe fn do_work(&self, op: Operation, peers: &[*mut u8]) {
        let size = peers.len();
        let rank = self.rank;
        match op {
            Operation::AllReduce { buf, op: reduce } => {
                with_element!(buf.dtype, T => {
                    let (lo, hi) = chunk_range(buf.len, size, rank);
                    if hi > lo {
                        let sources: Vec<*const T> =
                            peers.iter().map(|p| p.cast::<T>().add(lo).cast_const()).collect();
                        let destinations: Vec<*mut T> =
                            peers.iter().map(|p| p.cast::<T>().add(lo)).collect();
                        reduce_into::<T>(&sources, &destinations, hi - lo, reduce, size as f32);
                    }
                })
            }
            Operation::ReduceScatter {
                output, op: reduce, ..
            } => {
                with_element!(output.dtype, T => {
                    let chunk = output.len;
                    let sources: Vec<*const T> = peers
                        .iter()
                        .map(|p| p.cast::<T>().add(rank * chunk).cast_const())
                        .collect();
                    reduce_into::<T>(&sources, &[output.ptr.cast::<T>()], chunk, reduce, size as f32);
                })
            }
            Operation::AllGather { input, output } => {
                let bytes = input.size_bytes();
                for (k, src) in peers.iter().enumerate() {
                    // `std::ptr::copy` (memmove): an in-place all-gather passes a chunk
                    // of the output as this rank's input.
                    std::ptr::copy(*src, output.ptr.add(k * bytes), bytes);
                }
            }
            Operation::AllToAll { output, .. } => {
                // Pull, like all-gather: chunk `rank` of every peer's input into chunk
                // `src` of ours. The fingerprint check guaranteed equal lengths, so
                // every peer's input has the chunk; the done phase keeps it alive
                // until all ranks have copied; `validate` rejected overlapping views.
                let chunk_bytes = output.size_bytes() / size;
                for (src, input) in peers.iter().enumerate() {
                    std::ptr::copy_nonoverlapping(
                        input.add(rank * chunk_bytes),
                        output.ptr.add(src * chunk_bytes),
                        chunk_bytes,
                    );
                }
            }
            Operation::Broadcast { buf, root } => {
                if rank != root {
                    std::ptr::copy_nonoverlapping(peers[root], buf.ptr, buf.size_bytes());
                }
            }
            Operation::Barrier | Operation::Send { .. } | Operation::Recv { .. } => {}
        }
    }

    unsafe fn send(
        &self,
        _ctx: &OpContext,
        buf: RawBuf,
        dst: usize,
        tag: u32,
    ) -> Result<(), CommError> {
        let bytes = std::slice::from_raw_parts(buf.ptr, buf.size_bytes()).to_vec();
        let shared = &*self.shared;
        let mut mailbox = shared.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        mailbox
            .entry((self.rank, dst, tag))
            .or_default()
            .push_back(Message {
                dtype: buf.dtype,
                len: buf.len,
                bytes,
            });
        shared.mail_arrived.notify_all();
        Ok(())
    }

    unsafe fn recv(
        &self,
        ctx: &OpContext,
        buf: RawBuf,
        src: usize,
        tag: u32,
    ) -> Result<(), CommError> {
        let shared = &*self.shared;
        let deadline = Instant::now() + shared.world.config.timeout;
        let key = (src, self.rank, tag);
        let mut mailbox = shared.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        let message = loop {
            if let Some(message) = mailbox.get_mut(&key).and_then(VecDeque::pop_front) {
                break message;
            }
            let global_src = shared.global_ranks[src];
            if !shared.world.is_running(global_src) {
                return Err(CommError::PeerFailed {
                    ctx: ctx.clone(),
                    missing: vec![global_src],
                    reason: format!(
                        "rank {global_src}: {} (no message with tag {tag} was sent)",
                        shared.world.reason(global_src)
                    ),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout: shared.world.config.timeout,
                    missing: vec![global_src],
                    note: Box::default(),
                });
            }
            let nap = (deadline - now).min(Duration::from_millis(5));
            mailbox = shared
                .mail_arrived
                .wait_timeout(mailbox, nap)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        drop(mailbox);
        if message.dtype != buf.dtype || message.len != buf.len {
            return Err(CommError::InvalidBuffer {
                ctx: ctx.clone(),
                details: format!(
                    "message from rank {src} (tag {tag}) has {}×{} but the receive buffer is {}×{}",
                    message.dtype, message.len, buf.dtype, buf.len
                ),
            });
        }
        std::ptr::copy_nonoverlapping(message.bytes.as_ptr(), buf.ptr, message.bytes.len());
        Ok(())
    }
}

/// Splits `len` elements into `parts` contiguous chunks; returns chunk `index`.
/// Boundaries are multiples of 16 elements (a cache line of f32) so that two ranks
/// never write the same cache line; trailing chunks may be empty.
pub(crate) fn chunk_range(len: usize, parts: usize, index: usize) -> (usize, usize) {
    const ALIGN: usize = 16;
    let per = len.div_ceil(parts).div_ceil(ALIGN) * ALIGN;
    let lo = (per * index).min(len);
    let hi = (per * (index + 1)).min(len);
    (lo, hi)
}

/// One rank's handle on a threads-backend group.
pub struct ThreadsGroup {
    core: Arc<RankCore>,
    sequence: Sequencer,
    engine: AsyncEngine,
    subgroup_counts: Mutex<HashMap<Vec<usize>, usize>>,
}

impl fmt::Debug for ThreadsGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadsGroup")
            .field("name", &self.core.shared.name)
            .field("rank", &self.core.rank)
            .field("size", &self.core.shared.slots.len())
            .finish()
    }
}

impl ThreadsGroup {
    fn new(shared: Arc<GroupShared>, rank: usize) -> ThreadsGroup {
        let thread_name = format!("comm-{}-r{}", shared.name, shared.global_ranks[rank]);
        ThreadsGroup {
            sequence: Sequencer::new(shared.slots.len()),
            core: Arc::new(RankCore {
                name: Arc::from(shared.name.as_str()),
                shared,
                rank,
            }),
            engine: AsyncEngine::new(thread_name),
            subgroup_counts: Mutex::new(HashMap::new()),
        }
    }

    /// Validates `op` and assigns its sequence number.
    fn prepare(&self, op: &Operation) -> Result<u64, CommError> {
        let seq = self.sequence.assign(op);
        let ctx = self.core.ctx(op, seq);
        op.validate(&ctx, self.core.rank, self.size())?;
        op.require_host(&ctx)?;
        Ok(seq)
    }
}

impl ProcessGroup for ThreadsGroup {
    fn rank(&self) -> usize {
        self.core.rank
    }

    fn size(&self) -> usize {
        self.core.shared.slots.len()
    }

    fn name(&self) -> &str {
        &self.core.shared.name
    }

    fn global_ranks(&self) -> &[usize] {
        &self.core.shared.global_ranks
    }

    fn config(&self) -> &CommConfig {
        &self.core.shared.world.config
    }

    unsafe fn run_raw(&self, op: Operation) -> Result<(), CommError> {
        let seq = self.prepare(&op);
        self.engine.run(&self.core, op, seq)
    }

    unsafe fn start_raw(&self, op: Operation) -> Result<Work, CommError> {
        let seq = self.prepare(&op);
        self.engine.start(&self.core, op, seq)
    }

    fn position_board(&self, _name: &str) -> Option<Arc<dyn PositionBoard>> {
        Some(Arc::new(ThreadsBoard {
            shared: Arc::clone(&self.core.shared),
            index: self.core.rank,
        }))
    }

    fn new_named_subgroup(
        &self,
        ranks: &[usize],
        name: &str,
    ) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let ctx = OpContext::new("new_subgroup", 0, Arc::from(self.name()));
        let my_index = crate::group::validate_subgroup(&ctx, ranks, self.rank(), self.size())?;
        let globals: Vec<usize> = ranks.iter().map(|&r| self.global_ranks()[r]).collect();
        let occurrence = {
            let mut counts = self
                .subgroup_counts
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let count = counts.entry(globals.clone()).or_insert(0);
            *count += 1;
            *count
        };
        let world = &self.core.shared.world;
        let key = (self.core.shared.id, globals.clone(), occurrence);
        let shared = {
            let mut registry = world.registry.lock().unwrap_or_else(|e| e.into_inner());
            let entry = registry.entry(key.clone()).or_insert_with(|| {
                let shared = GroupShared::new(Arc::clone(world), name.to_string(), globals.clone());
                (Arc::new(shared), 0)
            });
            entry.1 += 1;
            let shared = Arc::clone(&entry.0);
            if entry.1 == globals.len() {
                registry.remove(&key);
            }
            shared
        };
        Ok(Arc::new(ThreadsGroup::new(shared, my_index)))
    }
}

/// A member's view of its group's positions on a companion engine: memory the members
/// share, so it answers at once and whatever the companion's state.
struct ThreadsBoard {
    shared: Arc<GroupShared>,
    index: usize,
}

impl ThreadsBoard {
    /// The other members for which `absent(last collective issued, status)` holds, each
    /// with where it was last seen and how it stopped.
    fn members_where(&self, absent: impl Fn(u64, u8) -> bool) -> MissingMembers {
        let issued = self.shared.issued.lock().unwrap_or_else(|e| e.into_inner());
        let world = &self.shared.world;
        let mut missing = MissingMembers {
            ranks: Vec::new(),
            note: String::new(),
        };
        for (member, &(op, reached)) in issued.iter().enumerate() {
            let global = self.shared.global_ranks[member];
            let status = world.status[global].load(Ordering::SeqCst);
            if member == self.index || !absent(reached, status) {
                continue;
            }
            let seen = match reached {
                0 => "before its first collective".to_string(),
                _ => format!("last issued {op} #{reached}"),
            };
            let how = match status {
                RANK_RUNNING => String::new(),
                _ => format!(" and stopped ({})", world.reason(global)),
            };
            if !missing.note.is_empty() {
                missing.note.push_str("; ");
            }
            missing.note += &format!("rank {global} {seen}{how}");
            missing.ranks.push(global);
        }
        missing
    }
}

/// Whether a member that issued collective `reached` last, and is in `status`, will not do
/// its part of collective `seq`: it never issued it, or issued it and then failed.
fn never_does(seq: u64, reached: u64, status: u8) -> bool {
    reached < seq || (reached == seq && status == RANK_FAILED)
}

impl PositionBoard for ThreadsBoard {
    fn issued(&self, op: &'static str, seq: u64) {
        self.shared.issued.lock().unwrap_or_else(|e| e.into_inner())[self.index] = (op, seq);
    }

    fn missing(&self, seq: u64) -> Option<MissingMembers> {
        Some(self.members_where(|reached, status| never_does(seq, reached, status)))
    }

    fn stopped(&self, seq: Option<u64>) -> Option<MissingMembers> {
        let world = &self.shared.world;
        let members = self.shared.global_ranks.iter();
        if members.clone().all(|&g| world.is_running(g)) {
            return None;
        }
        // A member that issued the collective does its part even if it failed afterwards:
        // its threads share this process, and its companion group completes what it issued
        // before it goes (an NCCL communicator waits for its operations in flight). Counting
        // it would fail a collective that is about to complete.
        let missing = self.members_where(|reached, status| match seq {
            _ if status == RANK_RUNNING => false,
            Some(seq) => reached < seq,
            None => status == RANK_FAILED,
        });
        (!missing.ranks.is_empty()).then_some(missing)
    }
}

/// Why one worker of [`ThreadsWorld::run`] did not produce a value.
#[derive(Debug)]
pub enum WorkerFailure<E> {
    /// The worker function returned an error.
    Error(E),
    /// The worker panicked (message of the panic).
    Panic(String),
    /// The worker had not finished [`FAILURE_GRACE`] after another worker failed and
    /// was left running (it is stuck outside any collective).
    Abandoned,
}

/// The failures of a [`ThreadsWorld::run`], one entry per failed rank, in the order they
/// failed: the first is the root cause, the others usually its knock-on effects (a peer's
/// collective that could not complete). `world_size == 0` (and no failures) means the run
/// was asked for zero workers.
#[derive(Debug)]
pub struct WorldError<E> {
    pub failures: Vec<(usize, WorkerFailure<E>)>,
    pub world_size: usize,
}

impl<E: fmt::Display> WorkerFailure<E> {
    fn describe(&self) -> String {
        match self {
            WorkerFailure::Error(e) => format!("failed: {e}"),
            WorkerFailure::Panic(msg) => format!("panicked: {msg}"),
            WorkerFailure::Abandoned => {
                format!("did not finish within {FAILURE_GRACE:?} of the first failure (abandoned)")
            }
        }
    }
}

/// The gist of a knock-on failure: its first clause (the operation that could not
/// complete), without the root cause it repeats.
fn gist(text: &str) -> &str {
    let text = text.split_once(": ").map_or(text, |(head, _)| head);
    match text.char_indices().nth(100) {
        Some((cut, _)) => &text[..cut],
        None => text,
    }
}

/// The root cause first and once: the first failure whole, then the ranks that failed the
/// same way, then one line per knock-on failure.
impl<E: fmt::Display> fmt::Display for WorldError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.world_size == 0 {
            return write!(f, "a threads world needs at least one worker, got 0");
        }
        let Some((first, root)) = self.failures.first() else {
            return write!(f, "no worker of {} failed", self.world_size);
        };
        let root = root.describe();
        let (same, others): (Vec<_>, Vec<_>) = (self.failures.iter())
            .map(|(rank, failure)| (*rank, failure.describe()))
            .partition(|(_, d)| *d == root);
        match same.len() {
            1 if self.world_size == 1 => write!(f, "{root}")?,
            1 => write!(f, "rank {first} {root}")?,
            n if n == self.world_size => write!(f, "every worker {root}")?,
            _ => {
                let ranks: Vec<String> = same.iter().map(|(r, _)| r.to_string()).collect();
                write!(f, "ranks {} {root}", ranks.join(", "))?
            }
        }
        if !others.is_empty() {
            let knock_on: Vec<String> = (others.iter())
                .map(|(rank, d)| {
                    let d = d.strip_prefix("failed: ").unwrap_or(d);
                    format!("rank {rank} ({})", gist(d))
                })
                .collect();
            write!(
                f,
                "; then {} other worker(s) stopped: {}",
                others.len(),
                knock_on.join(", ")
            )?;
        }
        Ok(())
    }
}

impl<E: fmt::Display + fmt::Debug> std::error::Error for WorldError<E> {}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs N workers as threads of this process, each with its rank's world group.
#[derive(Debug, Clone, Copy)]
pub struct ThreadsWorld;

impl ThreadsWorld {
    /// A world of `n` ranks and its top-level group state.
    fn world(n: usize, config: CommConfig) -> (Arc<World>, Arc<GroupShared>) {
        let world = Arc::new(World {
            config,
            status: (0..n).map(|_| AtomicU8::new(RANK_RUNNING)).collect(),
            reasons: Mutex::new(vec![None; n]),
            registry: Mutex::new(HashMap::new()),
            next_group_id: AtomicU64::new(0),
        });
        let shared = Arc::new(GroupShared::new(
            Arc::clone(&world),
            "world".to_string(),
            (0..n).collect(),
        ));
        (world, shared)
    }

    /// The group of a one-rank world, used on the calling thread: what a single worker
    /// passes where a process group is expected (every collective is then a no-op on its
    /// own data), without spawning a worker thread.
    pub fn single(config: CommConfig) -> Arc<dyn ProcessGroup> {
        let (_, shared) = Self::world(1, config);
        Arc::new(ThreadsGroup::new(shared, 0))
    }

    /// Spawns `n` worker threads running `worker(group)` with group ranks `0..n`, and
    /// returns their results in rank order.
    ///
    /// If a worker panics or returns an error, the others fail their current or next
    /// operation that involves it with [`CommError::PeerFailed`] (no waiting for the
    /// timeout), and this returns a [`WorldError`] listing every failed rank. Workers
    /// still running [`FAILURE_GRACE`] after the first failure are abandoned (left
    /// detached) so that a stuck worker can never hang the caller.
    pub fn run<T, E, F>(n: usize, config: CommConfig, worker: F) -> Result<Vec<T>, WorldError<E>>
    where
        T: Send + 'static,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<dyn ProcessGroup>) -> Result<T, E> + Send + Sync + 'static,
    {
        if n == 0 {
            // Reported as an error with no failed ranks (see `WorldError`'s Display).
            return Err(WorldError {
                failures: Vec::new(),
                world_size: 0,
            });
        }
        let (world, shared) = Self::world(n, config);
        let worker = Arc::new(worker);
        // (rank, the order it failed in, outcome): the order is taken before the failure is
        // marked, so a peer woken by the mark and failing as a consequence comes after it,
        // however the threads are scheduled.
        let (tx, rx) = mpsc::channel::<(usize, usize, Result<T, WorkerFailure<E>>)>();
        let failed_so_far = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for rank in 0..n {
            let worker_failed_so_far = Arc::clone(&failed_so_far);
            let group: Arc<dyn ProcessGroup> =
                Arc::new(ThreadsGroup::new(Arc::clone(&shared), rank));
            let worker = Arc::clone(&worker);
            let worker_world = Arc::clone(&world);
            let worker_tx = tx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("meshtrain-worker-{rank}"))
                .spawn(move || {
                    let result = catch_unwind(AssertUnwindSafe(|| worker(group)));
                    let order = match &result {
                        Ok(Ok(_)) => usize::MAX,
                        _ => worker_failed_so_far.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                    };
                    let outcome = match result {
                        Ok(Ok(value)) => {
                            worker_world.mark(rank, RANK_FINISHED, "finished".to_string());
                            Ok(value)
                        }
                        Ok(Err(e)) => {
                            worker_world.mark(rank, RANK_FAILED, format!("failed: {e}"));
                            Err(WorkerFailure::Error(e))
                        }
                        Err(payload) => {
                            let msg = panic_message(payload.as_ref());
                            worker_world.mark(rank, RANK_FAILED, format!("panicked: {msg}"));
                            Err(WorkerFailure::Panic(msg))
                        }
                    };
                    let _ = worker_tx.send((rank, order, outcome));
                });
            if let Err(e) = spawned {
                world.mark(rank, RANK_FAILED, format!("could not start: {e}"));
                let _ = tx.send((
                    rank,
                    failed_so_far.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                    Err(WorkerFailure::Panic(format!("thread spawn failed: {e}"))),
                ));
            }
        }
        drop(tx);

        let mut outcomes: Vec<Option<Result<T, WorkerFailure<E>>>> = (0..n).map(|_| None).collect();
        // The order each rank failed in: the first failure is the root cause.
        let mut order = vec![usize::MAX; n];
        let mut received = 0;
        let mut give_up_at: Option<Instant> = None;
        while received < n {
            let message = match give_up_at {
                None => rx.recv().ok(),
                Some(at) => rx
                    .recv_timeout(at.saturating_duration_since(Instant::now()))
                    .ok(),
            };
            let Some((rank, failed_as, outcome)) = message else {
                break;
            };
            if outcome.is_err() && give_up_at.is_none() {
                give_up_at = Some(Instant::now() + FAILURE_GRACE);
            }
            outcomes[rank] = Some(outcome);
            order[rank] = failed_as;
            received += 1;
        }

        // Failed ranks in the order they failed; those that never reported come last.
        let mut arrival: Vec<usize> = (0..n).collect();
        arrival.sort_by_key(|&r| order[r]);
        let mut failures = Vec::new();
        for &rank in &arrival {
            match outcomes[rank].take_if(|o| o.is_err()) {
                Some(Err(failure)) => failures.push((rank, failure)),
                Some(Ok(_)) => unreachable!("only failures are taken"),
                None if outcomes[rank].is_none() => {
                    world.mark(
                        rank,
                        RANK_FAILED,
                        "abandoned after another worker failed".to_string(),
                    );
                    failures.push((rank, WorkerFailure::Abandoned));
                }
                None => {}
            }
        }
        let values: Vec<T> = outcomes
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .collect();
        if failures.is_empty() {
            Ok(values)
        } else {
            Err(WorldError {
                failures,
                world_size: n,
            })
        }
    }
}
