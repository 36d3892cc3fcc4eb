//! The NCCL backend: collectives on buffers in a GPU's memory, run by NVIDIA's library on a
//! communication stream of their own.
//!
//! ## Streams and ordering
//! Each [`NcclGroup`] owns a communicator and a CUDA stream of its own (not the device's
//! compute stream), so its collectives overlap the kernels of the compute stream (DDP's
//! buckets under backward). Before an operation the group records an event on the compute
//! stream and makes its stream wait on it: the kernels that produced the inputs, queued
//! before the call, run first. After the operation it records an event on its stream; the
//! [`Work`] completes when that event has. Nothing synchronises the whole device.
//! [`NcclGroup::compute_stream_waits`] makes the compute stream wait for the operations
//! started so far without blocking the host (how a consumer reads an asynchronous result
//! in a kernel without `Work::wait`).
//!
//! ## Failure
//! A per-group watchdog thread polls the completion events and `ncclCommGetAsyncError`
//! ([`watch`]). An operation not complete within `config.timeout` aborts the communicator
//! (`ncclCommAbort`), its waiter gets [`CommError::Timeout`] (op, sequence number, group, and
//! the missing ranks: NCCL cannot tell them, so a group of two names the other rank, and a
//! larger one asks the position board of its bootstrap group,
//! [`ProcessGroup::position_board`], where every member posts the collectives it issued:
//! MPI's failure monitor, the threads' shared memory), and the group is broken:
//! every later operation fails with [`CommError::Broken`].
//!
//! ## What differs from the host backends
//! * Buffers must be in this group's GPU's memory ([`RawBuf::on_device`]); host buffers are
//!   refused by name (the bootstrap group moves host memory, and a host buffer on a GPU group
//!   is usually a bug worth hearing about, not something to copy silently).
//! * Point-to-point: NCCL matches sends and receives between two ranks in issue order and
//!   carries no tags (tags are accepted and ignored: a program must post receives in the
//!   order the peer sends), and a send completes only once the receiver has received (it is
//!   not buffered). So two ranks whose sends cross on one stream (a pipeline's activations
//!   one way, its gradients the other) would each wait for a receive queued behind the
//!   other's send. [`ProcessGroup::prepare_point_to_point`] gives each (sender, receiver)
//!   pair it names a communicator and stream of its own (a *lane*): a send then waits only
//!   for its own receive, and a program is safe when each pair's messages are received in
//!   the order they are sent (the pipeline schedules check it). Without lanes, consecutive
//!   asynchronous sends and receives are issued together as one NCCL group (after a short
//!   window, or at the next collective), so a ring of `send_async` + `recv_async` does not
//!   deadlock; synchronous ones are issued at once. A rank cannot send to itself outside an
//!   all-to-all.
//! * Average is NCCL's `ncclAvg` (for floats, each input is multiplied by 1/n before the sum
//!   on recent versions): results may round differently from the host backends' "sum, then
//!   divide once" for group sizes that are not powers of two.
//!
//! Everything here that calls NCCL or CUDA has only run where a GPU and libnccl.so.2 are
//! present (docs/comm.md says what ran where).

mod watch;

use crate::dtype::{DType, Device, RawBuf, ReduceOp};
use crate::engine::Sequencer;
use crate::error::{CommError, OpContext};
use crate::group::{CommConfig, MissingMembers, Operation, PositionBoard, ProcessGroup, Work};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;
use cudarc::driver::CudaStream;
use cudarc::nccl::sys as nccl;
use meshtrain_tensor::cuda::{probe, CudaDevice, DevBuf, PinnedBuf};
use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use watch::{CommControl, OpSignal, OpState, Pending, Watch};

/// How long asynchronous sends and receives wait for company before they are issued as one
/// NCCL group: long enough for the `send_async`, `recv_async` pairs of one exchange to
/// arrive together, short against any transfer worth making asynchronous.
const P2P_WINDOW: Duration = Duration::from_micros(200);

/// How often the watchdog looks at operations in flight that nobody waits for yet (about what
/// a 50 µs sleep lasted under Linux's default timer slack, before the watchdog asked for
/// precise timers), and how often it checks an idle communicator for asynchronous errors.
const BUSY_POLL: Duration = Duration::from_micros(100);
const IDLE_POLL: Duration = Duration::from_millis(50);
/// How often it looks at first while a thread is blocked in `Work::wait` on one of them: the
/// host queues nothing meanwhile (a tensor-parallel layer waits for its all-reduce), so the
/// watchdog's latency is the GPU's idle time. The interval grows with the wait (a quarter of
/// it, up to [`BUSY_POLL`]): a wait ends at most a quarter late, and a long one takes no more
/// wake-ups from the CPU's other threads than operations nobody waits for.
const HURRIED_POLL: Duration = Duration::from_micros(2);

/// NCCL's version, as `ncclGetVersion` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `ncclGetVersion`'s integer (`major × 10000 + minor × 100 + patch` since 2.9,
    /// `major × 1000 + minor × 100 + patch` before).
    pub fn from_code(code: i32) -> NcclVersion {
        let code = code.max(0) as u32;
        if code >= 10_000 {
            NcclVersion {
                major: code / 10_000,
                minor: code / 100 % 100,
                patch: code % 100,
            }
        } else {
            NcclVersion {
                major: code / 1000,
                minor: code / 100 % 10,
                patch: code % 100,
            }
        }
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// What to tell a user whose driver or NCCL cannot be loaded; `None` when both can.
fn missing_library_text(driver: bool, nccl: bool) -> Option<String> {
    if !driver {
        return Some(
            "the NCCL backend needs the NVIDIA driver (libcuda.so.1), which could not be \
             loaded: install the NVIDIA driver for your GPU (nvidia-smi must list it) or put \
             its folder on LD_LIBRARY_PATH; without a GPU, use the threads or MPI backend"
                .into(),
        );
    }
    if !nccl {
        return Some(
            "the NCCL backend needs NCCL (libnccl.so.2), which could not be loaded: \
             `pip install nvidia-nccl-cu13` and put its lib folder \
             (site-packages/nvidia/nccl/lib) on LD_LIBRARY_PATH, or install your system's \
             NCCL (e.g. the libnccl2 package from NVIDIA's CUDA repository)"
                .into(),
        );
    }
    None
}

/// Checks that the NVIDIA driver and NCCL can be loaded, and returns NCCL's version; the
/// error names the missing library and how to get it. Never panics.
pub fn nccl_available() -> Result<NcclVersion, String> {
    let driver = probe::present(cusys::is_culib_present);
    let library = driver && probe::present(nccl::is_culib_present);
    if let Some(text) = missing_library_text(driver, library) {
        return Err(text);
    }
    let mut code = 0;
    // SAFETY: writes one int; the library is loaded (checked above).
    let result = catch_unwind(AssertUnwindSafe(|| unsafe {
        nccl::ncclGetVersion(&mut code)
    }))
    .map_err(|_| "libnccl.so.2 loaded but has no ncclGetVersion: not an NCCL 2 library")?;
    if result != nccl::ncclResult_t::ncclSuccess {
        return Err(format!("ncclGetVersion failed: {}", result_text(result)));
    }
    Ok(NcclVersion::from_code(code))
}

/// NCCL's element type for a dtype.
pub(crate) fn nccl_dtype(dtype: DType) -> nccl::ncclDataType_t {
    match dtype {
        DType::F32 => nccl::ncclDataType_t::ncclFloat32,
        DType::BF16 => nccl::ncclDataType_t::ncclBfloat16,
        DType::F16 => nccl::ncclDataType_t::ncclFloat16,
    }
}

/// NCCL's reduction for a reduce op.
pub(crate) fn nccl_op(op: ReduceOp) -> nccl::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nccl::ncclRedOp_t::ncclSum,
        ReduceOp::Average => nccl::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => nccl::ncclRedOp_t::ncclMax,
    }
}

/// A result code as a user can act on it.
pub(crate) fn result_text(result: nccl::ncclResult_t) -> &'static str {
    use nccl::ncclResult_t::*;
    match result {
        ncclSuccess => "ncclSuccess",
        ncclUnhandledCudaError => "ncclUnhandledCudaError (a CUDA call inside NCCL failed)",
        ncclSystemError => "ncclSystemError (a system call failed: network, shared memory, files)",
        ncclInternalError => "ncclInternalError (an NCCL bug or memory corruption)",
        ncclInvalidArgument => "ncclInvalidArgument (a bad pointer, count or rank)",
        ncclInvalidUsage => "ncclInvalidUsage (calls in the wrong order or a misconfiguration)",
        ncclRemoteError => "ncclRemoteError (a peer failed or its connection broke)",
        ncclInProgress => "ncclInProgress",
        ncclTimeout => "ncclTimeout",
        ncclNumResults => "an NCCL result code this build does not know",
    }
}

/// `result` with NCCL's own last message about `comm` (empty when it has none).
fn describe_result(result: nccl::ncclResult_t, comm: nccl::ncclComm_t) -> String {
    let text = result_text(result);
    // SAFETY: NCCL returns a NUL-terminated string it owns (or null).
    let last = catch_unwind(AssertUnwindSafe(|| unsafe {
        let ptr = nccl::ncclGetLastError(comm);
        (!ptr.is_null()).then(|| std::ffi::CStr::from_ptr(ptr).to_string_lossy().into_owned())
    }))
    .ok()
    .flatten()
    .unwrap_or_default();
    if last.trim().is_empty() {
        text.to_string()
    } else {
        format!("{text}: {}", last.trim())
    }
}

/// The 128 bytes of a unique id as f32 values 0..=255, exact in any float a host backend
/// moves (no bit pattern can be a NaN that a conversion would change).
fn unique_id_to_values(id: &nccl::ncclUniqueId) -> Vec<f32> {
    id.internal.iter().map(|&b| b as u8 as f32).collect()
}

fn unique_id_from_values(values: &[f32]) -> Option<nccl::ncclUniqueId> {
    let mut id = nccl::ncclUniqueId { internal: [0; 128] };
    if values.len() != id.internal.len() {
        return None;
    }
    for (byte, &v) in id.internal.iter_mut().zip(values) {
        if !(0.0..=255.0).contains(&v) || v.fract() != 0.0 {
            return None;
        }
        *byte = v as u8 as std::ffi::c_char;
    }
    Some(id)
}

/// A CUDA event, destroyed when the last holder lets go.
struct Event(cusys::CUevent);

// SAFETY: event handles may be used from any thread of their context.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    fn new() -> Result<Event, String> {
        cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Event)
            .map_err(|e| format!("creating a CUDA event: {e}"))
    }

    fn record(&self, stream: cusys::CUstream) -> Result<(), String> {
        // SAFETY: a live event and stream of the current context.
        unsafe { cu::event::record(self.0, stream) }
            .map_err(|e| format!("recording a CUDA event: {e}"))
    }

    /// Makes `stream` wait (on the device) until the work recorded in this event has run.
    fn wait_on(&self, stream: cusys::CUstream) -> Result<(), String> {
        // SAFETY: a live event and stream.
        unsafe {
            cu::stream::wait_event(
                stream,
                self.0,
                cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| format!("making a stream wait on an event: {e}"))
    }

    fn state(&self) -> OpState {
        // SAFETY: a live event.
        match unsafe { cu::event::query(self.0) } {
            Ok(()) => OpState::Done,
            Err(e) if e.0 == cusys::cudaError_enum::CUDA_ERROR_NOT_READY => OpState::Pending,
            Err(e) => OpState::Failed(format!("the operation's completion event: {e}")),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once. A stream still waiting on it keeps what it
        // needs (the driver releases the event when the wait is done).
        let _ = unsafe { cu::event::destroy(self.0) };
    }
}

/// Where one operation stands between issue and completion.
enum Issued {
    /// Not yet handed to NCCL (a deferred send or receive, or a call in progress).
    Waiting,
    /// Enqueued; done when the event is.
    Recorded(Arc<Event>),
    /// Enqueueing failed: it will never run.
    Failed(String),
}

/// The [`OpSignal`] of a real operation.
#[derive(Clone)]
struct IssueSignal(Arc<Mutex<Issued>>);

impl IssueSignal {
    fn new() -> IssueSignal {
        IssueSignal(Arc::new(Mutex::new(Issued::Waiting)))
    }

    fn set(&self, state: Issued) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = state;
    }
}

impl OpSignal for IssueSignal {
    fn state(&self) -> OpState {
        match &*self.0.lock().unwrap_or_else(|e| e.into_inner()) {
            Issued::Waiting => OpState::Pending,
            Issued::Recorded(event) => event.state(),
            Issued::Failed(why) => OpState::Failed(why.clone()),
        }
    }
}

/// A communicator handle (a pointer NCCL owns).
struct Comm {
    raw: nccl::ncclComm_t,
    device: Arc<CudaDevice>,
    aborted: AtomicBool,
    /// Where the members stand, on the bootstrap's side channel: who never issued a
    /// collective that timed out (NCCL cannot say), and who is already known dead (so an
    /// operation waiting for it fails at once).
    board: Option<Arc<dyn PositionBoard>>,
}

// SAFETY: calls on the communicator are serialised by the group's issue lock; the watchdog's
// `ncclCommGetAsyncError` and `ncclCommAbort` are the calls NCCL allows from another thread.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl CommControl for Comm {
    fn async_error(&self) -> Option<String> {
        if self.aborted.load(Ordering::SeqCst) {
            return None;
        }
        let mut state = nccl::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator; writes one result.
        let result = unsafe { nccl::ncclCommGetAsyncError(self.raw, &mut state) };
        if result != nccl::ncclResult_t::ncclSuccess {
            return Some(format!(
                "ncclCommGetAsyncError failed: {}",
                describe_result(result, self.raw)
            ));
        }
        match state {
            nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => None,
            error => Some(describe_result(error, self.raw)),
        }
    }

    fn abort(&self) -> String {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return "the communicator was aborted earlier".into();
        }
        let _ = self.device.bind();
        // SAFETY: a live communicator, aborted once (`aborted` guards); never used after.
        let result = unsafe { nccl::ncclCommAbort(self.raw) };
        format!(
            "the communicator was aborted (ncclCommAbort: {})",
            result_text(result)
        )
    }

    fn missing(&self, seq: u64) -> Option<MissingMembers> {
        self.board.as_ref()?.missing(seq)
    }

    fn stopped(&self, seq: Option<u64>) -> Option<MissingMembers> {
        self.board.as_ref()?.stopped(seq)
    }
}

/// A send or receive waiting to be issued with its neighbours as one NCCL group.
struct Deferred {
    op: Operation,
    signal: IssueSignal,
}

/// What issuing operations needs, under one lock (so sequence numbers, NCCL calls and stream
/// order agree).
struct IssueState {
    /// Recorded on the compute stream before each operation; the comm stream waits on it.
    before: Event,
    /// The completion event of the newest operation issued.
    last: Option<Arc<Event>>,
    /// Device scratch: this rank's fingerprint (5 words), everyone's (5 × size words), and
    /// the barrier's one f32.
    scratch: DevBuf,
    /// Host side of the fingerprint exchange (pinned: the copies are asynchronous).
    pinned: PinnedBuf,
    deferred: Vec<Deferred>,
    deferred_since: Option<Instant>,
}

const FINGERPRINT_WORDS: usize = 5;

/// The state of one group shared with its watchdog thread.
struct Shared {
    device: Arc<CudaDevice>,
    comm: Comm,
    /// The communication stream (created on the device's context; owned, destroyed with us).
    stream: Arc<CudaStream>,
    name: Arc<str>,
    rank: usize,
    size: usize,
    global_ranks: Vec<usize>,
    /// For a pair's lane, the other rank's world rank.
    lane_peer: Option<usize>,
    watch: Mutex<Watch>,
    wake: Condvar,
    issue: Mutex<IssueState>,
    /// Wakes the watchdog when a thread starts waiting on one of the group's operations
    /// (each operation's `Completion` holds it; it holds this state weakly, since the
    /// operations live inside it).
    hurry: Arc<dyn Fn() + Send + Sync>,
}

impl Shared {
    fn watch(&self) -> MutexGuard<'_, Watch> {
        self.watch.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn issue_state(&self) -> MutexGuard<'_, IssueState> {
        self.issue.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ctx(&self, op: &'static str, seq: u64) -> OpContext {
        OpContext::new(op, seq, Arc::clone(&self.name))
    }

    /// Registers an operation with the watchdog; the returned Work completes with it. A
    /// thread that starts waiting for it wakes the watchdog, which then looks every
    /// [`HURRIED_POLL`] (less often as the wait goes on) until nobody waits.
    fn track(&self, ctx: OpContext, signal: IssueSignal) -> Work {
        if let (Some(board), None) = (&self.comm.board, ctx.peer) {
            board.issued(ctx.op, ctx.seq);
        }
        let hurry = Arc::clone(&self.hurry);
        let (pending, work) = Pending::new(ctx, Instant::now(), Box::new(signal), hurry);
        self.watch().push(pending);
        self.wake.notify_all();
        work
    }

    /// Orders the comm stream after the work queued on the compute stream so far.
    fn after_compute(&self, state: &IssueState) -> Result<(), String> {
        state.before.record(self.device.cu_stream())?;
        state.before.wait_on(self.stream.cu_stream())
    }

    /// Records the completion event of what was just enqueued on the comm stream.
    fn record_done(&self, state: &mut IssueState) -> Result<Arc<Event>, String> {
        let event = Arc::new(Event::new()?);
        event.record(self.stream.cu_stream())?;
        state.last = Some(Arc::clone(&event));
        Ok(event)
    }

    fn check(&self, what: &str, result: nccl::ncclResult_t) -> Result<(), String> {
        match result {
            nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => Ok(()),
            error => Err(format!("{what}: {}", describe_result(error, self.comm.raw))),
        }
    }

    fn cu_stream(&self) -> nccl::cudaStream_t {
        self.stream.cu_stream() as nccl::cudaStream_t
    }

    /// Enqueues one operation's NCCL calls on the comm stream (no ordering, no event).
    ///
    /// # Safety
    /// The buffers of `op` are live device memory of this group's device (validated), and
    /// stay untouched by others until the operation's event completes.
    unsafe fn enqueue(&self, op: &Operation, scratch: u64) -> Result<(), String> {
        let (comm, stream) = (self.comm.raw, self.cu_stream());
        let ptr = |b: &RawBuf| b.addr() as *mut c_void;
        match *op {
            Operation::AllReduce { buf, op } if !buf.is_empty() => self.check(
                "ncclAllReduce",
                nccl::ncclAllReduce(
                    ptr(&buf),
                    ptr(&buf),
                    buf.len(),
                    nccl_dtype(buf.dtype()),
                    nccl_op(op),
                    comm,
                    stream,
                ),
            ),
            Operation::ReduceScatter { input, output, op } if !output.is_empty() => self.check(
                "ncclReduceScatter",
                nccl::ncclReduceScatter(
                    ptr(&input),
                    ptr(&output),
                    output.len(),
                    nccl_dtype(output.dtype()),
                    nccl_op(op),
                    comm,
                    stream,
                ),
            ),
            Operation::AllGather { input, output } if !input.is_empty() => self.check(
                "ncclAllGather",
                nccl::ncclAllGather(
                    ptr(&input),
                    ptr(&output),
                    input.len(),
                    nccl_dtype(input.dtype()),
                    comm,
                    stream,
                ),
            ),
            Operation::Broadcast { buf, root } if !buf.is_empty() => self.check(
                "ncclBroadcast",
                nccl::ncclBroadcast(
                    ptr(&buf),
                    ptr(&buf),
                    buf.len(),
                    nccl_dtype(buf.dtype()),
                    root as i32,
                    comm,
                    stream,
                ),
            ),
            Operation::AllToAll { input, output } if !input.is_empty() => {
                let chunk = input.len() / self.size;
                self.check("ncclGroupStart", nccl::ncclGroupStart())?;
                let mut result = Ok(());
                for peer in 0..self.size {
                    let (send, recv) = (
                        input.sub(peer * chunk, chunk),
                        output.sub(peer * chunk, chunk),
                    );
                    let dtype = nccl_dtype(input.dtype());
                    result = result
                        .and_then(|()| {
                            self.check(
                                "ncclSend",
                                nccl::ncclSend(ptr(&send), chunk, dtype, peer as i32, comm, stream),
                            )
                        })
                        .and_then(|()| {
                            self.check(
                                "ncclRecv",
                                nccl::ncclRecv(ptr(&recv), chunk, dtype, peer as i32, comm, stream),
                            )
                        });
                }
                // The group must be closed even after a failed call.
                let end = self.check("ncclGroupEnd", nccl::ncclGroupEnd());
                result.and(end)
            }
            Operation::Barrier => self.check(
                "ncclAllReduce (barrier)",
                nccl::ncclAllReduce(
                    scratch as *mut c_void,
                    scratch as *mut c_void,
                    1,
                    nccl::ncclDataType_t::ncclFloat32,
                    nccl::ncclRedOp_t::ncclSum,
                    comm,
                    stream,
                ),
            ),
            Operation::Send { buf, dst, .. } if !buf.is_empty() => self.check(
                "ncclSend",
                nccl::ncclSend(
                    ptr(&buf),
                    buf.len(),
                    nccl_dtype(buf.dtype()),
                    dst as i32,
                    comm,
                    stream,
                ),
            ),
            Operation::Recv { buf, src, .. } if !buf.is_empty() => self.check(
                "ncclRecv",
                nccl::ncclRecv(
                    ptr(&buf),
                    buf.len(),
                    nccl_dtype(buf.dtype()),
                    src as i32,
                    comm,
                    stream,
                ),
            ),
            // Empty buffers: nothing to move (every rank's count is 0 in a correct program).
            _ => Ok(()),
        }
    }

    /// Issues the deferred sends and receives as one NCCL group with one completion event.
    fn flush_deferred(&self, state: &mut IssueState) {
        if state.deferred.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut state.deferred);
        state.deferred_since = None;
        let scratch = state.scratch.ptr();
        let issued = (|| -> Result<Arc<Event>, String> {
            self.after_compute(state)?;
            // SAFETY: group calls around enqueues; the buffers were validated when deferred
            // and their callers keep them until the Works complete.
            unsafe {
                self.check("ncclGroupStart", nccl::ncclGroupStart())?;
                let mut result = Ok(());
                for d in &batch {
                    result = result.and_then(|()| self.enqueue(&d.op, scratch));
                }
                let end = self.check("ncclGroupEnd", nccl::ncclGroupEnd());
                result.and(end)?;
            }
            self.record_done(state)
        })();
        for d in batch {
            d.signal.set(match &issued {
                Ok(event) => Issued::Recorded(Arc::clone(event)),
                Err(why) => Issued::Failed(why.clone()),
            });
        }
    }

    /// The watchdog's part in point-to-point: issues a batch older than [`P2P_WINDOW`]
    /// (unless an issuing thread holds the lock; it flushes or the next look does).
    fn flush_aged(&self) {
        if let Ok(mut state) = self.issue.try_lock() {
            if state
                .deferred_since
                .is_some_and(|since| since.elapsed() >= P2P_WINDOW)
            {
                let _ = self.device.bind();
                self.flush_deferred(&mut state);
            }
        }
    }

    /// Exchanges fingerprints with a small device all-gather and compares them on the host.
    fn check_fingerprint(
        &self,
        state: &mut IssueState,
        ctx: &OpContext,
        op: &Operation,
    ) -> Result<(), CommError> {
        let mine = op.fingerprint(ctx.seq).to_words();
        let words = FINGERPRINT_WORDS * (1 + self.size);
        let scratch = state.scratch.ptr();
        let signal = IssueSignal::new();
        let work = self.track(ctx.clone(), signal.clone());
        let issued = (|| -> Result<Arc<Event>, String> {
            // SAFETY: the pinned buffer holds `words` u64s, the scratch buffer too; nothing
            // else uses either while the issue lock is held, and the lock is held until the
            // exchange's event completed (the Work below).
            unsafe {
                let host =
                    std::slice::from_raw_parts_mut(state.pinned.as_mut_ptr().cast::<u64>(), words);
                host[..FINGERPRINT_WORDS].copy_from_slice(&mine);
                cu::memcpy_htod_async(scratch, &host[..FINGERPRINT_WORDS], self.stream.cu_stream())
                    .map_err(|e| format!("copying the fingerprint to the device: {e}"))?;
                self.check(
                    "ncclAllGather (fingerprints)",
                    nccl::ncclAllGather(
                        scratch as *const c_void,
                        (scratch + 8 * FINGERPRINT_WORDS as u64) as *mut c_void,
                        FINGERPRINT_WORDS,
                        nccl::ncclDataType_t::ncclUint64,
                        self.comm.raw,
                        self.cu_stream(),
                    ),
                )?;
                cu::memcpy_dtoh_async(
                    &mut host[FINGERPRINT_WORDS..],
                    scratch + 8 * FINGERPRINT_WORDS as u64,
                    self.stream.cu_stream(),
                )
                .map_err(|e| format!("copying the fingerprints to the host: {e}"))?;
            }
            self.record_done(state)
        })();
        signal.set(match issued {
            Ok(event) => Issued::Recorded(event),
            Err(why) => Issued::Failed(format!("the desync check: {why}")),
        });
        work.wait()?;
        // SAFETY: the exchange completed (its event), so the host copy is written.
        let all =
            unsafe { std::slice::from_raw_parts(state.pinned.as_mut_ptr().cast::<u64>(), words) }
                [FINGERPRINT_WORDS..]
                .to_vec();
        let prints: Vec<crate::Fingerprint> = all
            .chunks_exact(FINGERPRINT_WORDS)
            .map(|w| crate::Fingerprint::from_words([w[0], w[1], w[2], w[3], w[4]]))
            .collect();
        match desync_details(&prints, self.rank, &self.global_ranks) {
            None => Ok(()),
            Some(details) => {
                let err = CommError::Desync {
                    ctx: ctx.clone(),
                    details,
                };
                self.watch().mark_broken(err.to_string());
                Err(err)
            }
        }
    }
}

/// The desync message for fingerprints that differ: this rank's call and every other one,
/// by global rank; `None` when all agree.
fn desync_details(
    prints: &[crate::Fingerprint],
    rank: usize,
    global_ranks: &[usize],
) -> Option<String> {
    let mine = prints[rank];
    if prints.iter().all(|f| *f == mine) {
        return None;
    }
    let others: Vec<String> = prints
        .iter()
        .enumerate()
        .filter(|&(r, f)| r != rank && *f != mine)
        .map(|(r, f)| format!("rank {} called {}", global_ranks[r], f.describe()))
        .collect();
    Some(format!(
        "rank {} called {} but {}",
        global_ranks[rank],
        mine.describe(),
        others.join("; ")
    ))
}

impl Drop for Shared {
    fn drop(&mut self) {
        let _ = self.device.bind();
        {
            let mut state = self.issue_state();
            self.flush_deferred(&mut state);
        }
        // Every Work must complete before the communicator goes: wait for the operations in
        // flight (the timeout still applies: a stuck one aborts the communicator).
        loop {
            let mut watch = self.watch();
            watch.poll(Instant::now(), &self.comm);
            if watch.is_idle() {
                break;
            }
            drop(watch);
            std::thread::sleep(BUSY_POLL);
        }
        if !self.comm.aborted.load(Ordering::SeqCst) {
            // SAFETY: a live communicator with nothing in flight, destroyed once.
            unsafe {
                let _ = nccl::ncclCommDestroy(self.comm.raw);
            }
        }
    }
}

/// The watchdog: polls the operations in flight until the group is gone.
fn watchdog(shared: Weak<Shared>) {
    if let Some(s) = shared.upgrade() {
        // Events are queried in the device's context.
        let _ = s.device.bind();
    }
    precise_timers();
    loop {
        let Some(s) = shared.upgrade() else {
            return;
        };
        s.flush_aged();
        let mut watch = s.watch();
        watch.poll(Instant::now(), &s.comm);
        let idle = watch.is_idle() && s.issue_state_has_no_deferred();
        let poll = match watch.waited_since() {
            _ if idle => IDLE_POLL,
            Some(since) => (since.elapsed() / 4).clamp(HURRIED_POLL, BUSY_POLL),
            None => BUSY_POLL,
        };
        let _ = s.wake.wait_timeout(watch, poll);
    }
}

/// Asks Linux to wake this thread within 1 µs of the time it asked for, instead of the 50 µs
/// of slack a thread gets by default: a [`HURRIED_POLL`] would otherwise last ~60 µs.
fn precise_timers() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK takes a value in nanoseconds and affects this thread only.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong);
    }
}

impl Shared {
    fn issue_state_has_no_deferred(&self) -> bool {
        match self.issue.try_lock() {
            Ok(state) => state.deferred.is_empty(),
            Err(_) => false,
        }
    }
}

/// One rank's handle on an NCCL communicator: a [`ProcessGroup`] on device buffers.
pub struct NcclGroup {
    shared: Arc<Shared>,
    /// A host group of the same ranks: sub-groups get their unique ids through it.
    bootstrap: Arc<dyn ProcessGroup>,
    config: CommConfig,
    sequence: Sequencer,
    /// Each prepared pair's channel, by (sender, receiver): a communicator of the two ranks
    /// (lower group rank first) with a stream of its own, carrying only that pair's sends
    /// in that direction ([`ProcessGroup::prepare_point_to_point`]).
    lanes: Mutex<HashMap<(usize, usize), Arc<NcclGroup>>>,
}

impl fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclGroup")
            .field("name", &self.shared.name)
            .field("rank", &self.shared.rank)
            .field("size", &self.shared.size)
            .field("device", &self.shared.device)
            .finish()
    }
}

impl NcclGroup {
    /// A communicator over the ranks of `bootstrap` (a host group: threads or MPI), one GPU
    /// per rank: rank 0 makes NCCL's unique id, the bootstrap group broadcasts it, every rank
    /// joins with `ncclCommInitRank` on `device`. Every rank of `bootstrap` must call this.
    ///
    /// Fails with an error naming the library when the driver or libnccl.so.2 cannot be loaded
    /// ([`nccl_available`]). `ncclCommInitRank` itself cannot time out (it is NCCL's blocking
    /// call); a barrier on the bootstrap group before it (which has the timeout) makes sure
    /// every rank got that far.
    pub fn from_bootstrap(
        bootstrap: &dyn ProcessGroup,
        device: Arc<CudaDevice>,
        config: CommConfig,
    ) -> Result<Arc<NcclGroup>, CommError> {
        let all: Vec<usize> = (0..bootstrap.size()).collect();
        // A private copy of the bootstrap group: ours to keep for sub-groups, and its traffic
        // never interleaves with the caller's use of `bootstrap`.
        let private =
            bootstrap.new_named_subgroup(&all, &format!("{}/nccl-bootstrap", bootstrap.name()))?;
        Self::init(private, bootstrap.name(), device, config, None)
    }

    /// Joins the communicator of `bootstrap`'s ranks, named `name`; for a pair's lane,
    /// `lane_peer` is the other rank's world rank (the only one its operations wait for).
    fn init(
        bootstrap: Arc<dyn ProcessGroup>,
        name: &str,
        device: Arc<CudaDevice>,
        config: CommConfig,
        lane_peer: Option<usize>,
    ) -> Result<Arc<NcclGroup>, CommError> {
        let name: Arc<str> = Arc::from(name);
        let ctx = OpContext::new("nccl_init", 0, Arc::clone(&name));
        let backend = |details: String| CommError::Backend {
            ctx: ctx.clone(),
            details,
        };
        let (rank, size) = (bootstrap.rank(), bootstrap.size());
        // Every rank learns whether rank 0 could make an id: a rank without NCCL fails here
        // with its own message, and the others at the broadcast (or its timeout).
        let local = nccl_available();
        let mut values = vec![-1f32; 128];
        if rank == 0 && local.is_ok() {
            let mut id = nccl::ncclUniqueId { internal: [0; 128] };
            // SAFETY: writes the id; the library is loaded (`local`).
            if unsafe { nccl::ncclGetUniqueId(&mut id) } == nccl::ncclResult_t::ncclSuccess {
                values = unique_id_to_values(&id);
            }
        }
        // Every rank takes part, with or without NCCL: a rank without it fails below with its
        // own message, and the others learn at once that rank 0 had no id to send.
        bootstrap.broadcast((&mut values).into(), 0)?;
        local.map_err(&backend)?;
        let id = unique_id_from_values(&values).ok_or_else(|| {
            backend(
                "rank 0 could not make an NCCL unique id (NCCL or ncclGetUniqueId failed there)"
                    .into(),
            )
        })?;
        bootstrap.barrier()?;
        device
            .bind()
            .map_err(|e| backend(format!("binding {device:?}: {e}")))?;
        let mut raw: nccl::ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes the communicator handle; the device's context is current.
        let result = unsafe { nccl::ncclCommInitRank(&mut raw, size as i32, id, rank as i32) };
        if result != nccl::ncclResult_t::ncclSuccess {
            return Err(backend(format!(
                "ncclCommInitRank (rank {rank} of {size} on {device:?}): {}",
                describe_result(result, raw)
            )));
        }
        let global_ranks = bootstrap.global_ranks().to_vec();
        // Whom a timed-out operation waited for, where that is known: in a group of two
        // (a lane, a tp or dp pair, a host's pair of GPUs) the other rank, as NCCL itself
        // cannot say; in a larger group, whom the bootstrap's position board names.
        let waits_for = lane_peer.or(match global_ranks[..] {
            [a, b] => Some(if rank == 0 { b } else { a }),
            _ => None,
        });
        let comm = Comm {
            raw,
            device: Arc::clone(&device),
            aborted: AtomicBool::new(false),
            board: bootstrap.position_board(&name),
        };
        // From here on `comm` must be destroyed on failure.
        let destroy = |comm: Comm, e: String| {
            // SAFETY: a live communicator, never used again.
            unsafe {
                let _ = nccl::ncclCommDestroy(comm.raw);
            }
            backend(e)
        };
        let parts = (|| -> Result<_, String> {
            let stream = device
                .stream()
                .context()
                .new_stream()
                .map_err(|e| format!("creating the communication stream: {e}"))?;
            let words = FINGERPRINT_WORDS * (1 + size);
            let scratch = device
                .alloc(8 * words + 8, "NCCL's desync and barrier scratch")
                .map_err(|e| e.to_string())?;
            device
                .memset_zero(scratch.ptr(), 8 * words + 8)
                .map_err(|e| e.to_string())?;
            // The clearing ran on the compute stream, and the first desync check writes the
            // scratch on the communication stream without waiting for it: finish it now.
            device.synchronize().map_err(|e| e.to_string())?;
            let pinned = device.alloc_pinned(8 * words).map_err(|e| e.to_string())?;
            Ok((stream, scratch, pinned, Event::new()?))
        })();
        let (stream, scratch, pinned, before) = match parts {
            Ok(parts) => parts,
            Err(e) => return Err(destroy(comm, e)),
        };
        let shared = Arc::new_cyclic(|me: &Weak<Shared>| Shared {
            hurry: {
                let me = Weak::clone(me);
                Arc::new(move || {
                    if let Some(shared) = me.upgrade() {
                        // Under the lock: the watchdog is either before its look (and sees
                        // the waiter) or in its wait (and is woken).
                        let _watch = shared.watch();
                        shared.wake.notify_all();
                    }
                })
            },
            device,
            comm,
            stream,
            name,
            rank,
            size,
            global_ranks,
            lane_peer,
            watch: Mutex::new(Watch::new(config.timeout, waits_for)),
            wake: Condvar::new(),
            issue: Mutex::new(IssueState {
                before,
                last: None,
                scratch,
                pinned,
                deferred: Vec::new(),
                deferred_since: None,
            }),
        });
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name(format!("nccl-watchdog-{}-r{rank}", shared.name))
            .spawn(move || watchdog(weak))
            .map_err(|e| backend(format!("cannot start the watchdog thread: {e}")))?;
        Ok(Arc::new(NcclGroup {
            shared,
            bootstrap,
            config,
            sequence: Sequencer::new(size),
            lanes: Mutex::new(HashMap::new()),
        }))
    }

    /// The GPU this rank's communicator runs on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.shared.device
    }

    /// The communication stream the group's operations run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.shared.stream
    }

    /// Makes the device's compute stream wait, on the device, until every operation this
    /// group has started so far has finished; the host does not wait. Operations run in
    /// start order on the group's stream, so after `start_raw(op)` this orders the kernels
    /// queued next after `op` (and everything before it): a consumer reads an asynchronous
    /// result in a kernel without blocking on [`Work::wait`]. Errors of those operations
    /// still come from their `Work`s.
    pub fn compute_stream_waits(&self) -> Result<(), CommError> {
        let ctx = self.shared.ctx("compute_stream_waits", 0);
        let backend = |details: String| CommError::Backend {
            ctx: ctx.clone(),
            details,
        };
        self.shared
            .device
            .bind()
            .map_err(|e| backend(e.to_string()))?;
        {
            let mut state = self.shared.issue_state();
            self.shared.flush_deferred(&mut state);
            if let Some(event) = &state.last {
                event
                    .wait_on(self.shared.device.cu_stream())
                    .map_err(backend)?;
            }
        }
        for lane in self.lanes().values().cloned().collect::<Vec<_>>() {
            lane.compute_stream_waits()?;
        }
        Ok(())
    }

    fn lanes(&self) -> MutexGuard<'_, HashMap<(usize, usize), Arc<NcclGroup>>> {
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The prepared channel a send or receive goes over, with the operation addressed to the
    /// peer's rank there; `None` for collectives and unprepared pairs.
    fn lane_for(&self, op: &Operation) -> Option<(Arc<NcclGroup>, Operation)> {
        let me = self.shared.rank;
        let (pair, peer) = match *op {
            Operation::Send { dst, .. } => ((me, dst), dst),
            Operation::Recv { src, .. } => ((src, me), src),
            _ => return None,
        };
        let lane = self.lanes().get(&pair).cloned()?;
        // A lane's ranks are the pair's in group order.
        let there = usize::from(peer > me);
        let op = match *op {
            Operation::Send { buf, tag, .. } => Operation::Send {
                buf,
                dst: there,
                tag,
            },
            Operation::Recv { buf, tag, .. } => Operation::Recv {
                buf,
                src: there,
                tag,
            },
            _ => unreachable!("only sends and receives have lanes"),
        };
        Some((lane, op))
    }

    /// Why the group is unusable (a timeout, an NCCL error, a desync, an abort), once it is.
    pub fn broken(&self) -> Option<String> {
        self.shared.watch().broken().map(str::to_string)
    }

    /// NCCL's version (the library this process loaded).
    pub fn nccl_version(&self) -> Result<NcclVersion, String> {
        nccl_available()
    }

    /// Aborts the communicator now (`ncclCommAbort`), as the watchdog does on a timeout:
    /// operations in flight fail, the group is broken and every later operation fails with
    /// [`CommError::Broken`]. For a program that knows a peer is gone.
    pub fn abort(&self, reason: &str) {
        let outcome = self.shared.comm.abort();
        {
            let mut watch = self.shared.watch();
            watch.mark_broken(format!("aborted: {reason} ({outcome})"));
            watch.poll(Instant::now(), &self.shared.comm);
        }
        for lane in self.lanes().values().cloned().collect::<Vec<_>>() {
            lane.abort(reason);
        }
    }

    /// Validates `op`, assigns its sequence number and checks it may run here. A send or
    /// receive is numbered among the messages to or from its peer: the pair's n-th message is
    /// #n on both sides (a lane's name says the direction already, so it names no peer).
    fn prepare(&self, op: &Operation) -> Result<OpContext, CommError> {
        let seq = self.sequence.assign(op);
        let mut ctx = self.shared.ctx(op.name(), seq);
        if self.shared.lane_peer.is_none() {
            ctx = ctx.naming_the_peer_of(op);
        }
        op.validate(&ctx, self.shared.rank, self.shared.size)?;
        let mine = Device::Cuda(self.shared.device.ordinal());
        let here = op.device();
        if !matches!(op, Operation::Barrier) && here != mine {
            let details = if here == Device::Cpu {
                format!(
                    "the buffer is in host memory, and the NCCL backend moves {mine}'s memory: \
                     pass a device buffer (RawBuf::on_device), or use a host group (the \
                     bootstrap group) for host buffers"
                )
            } else {
                format!("the buffer is in {here}'s memory, but this NCCL group runs on {mine}")
            };
            return Err(CommError::InvalidBuffer { ctx, details });
        }
        match *op {
            Operation::Send { dst: peer, .. } | Operation::Recv { src: peer, .. }
                if peer == self.shared.rank =>
            {
                return Err(CommError::InvalidRank {
                    ctx,
                    details: format!(
                        "rank {peer} cannot send to or receive from itself on NCCL (a send \
                         completes only when received)"
                    ),
                });
            }
            _ => {}
        }
        if let Some(err) = self.shared.watch().broken_error(&ctx) {
            return Err(err);
        }
        Ok(ctx)
    }

    /// Issues `op`: the desync check, ordering after the compute stream, the NCCL calls and
    /// the completion event; deferred into the point-to-point batch when `defer`.
    ///
    /// # Safety
    /// As [`ProcessGroup::start_raw`].
    unsafe fn issue(&self, op: Operation, defer: bool) -> Result<Work, CommError> {
        let ctx = self.prepare(&op)?;
        if let Some((lane, op)) = self.lane_for(&op) {
            // Alone on its pair's stream, a send waits for nothing but its own receive:
            // issued at once, nothing to group it with.
            return lane.issue(op, false);
        }
        let shared = &self.shared;
        shared.device.bind().map_err(|e| CommError::Backend {
            ctx: ctx.clone(),
            details: e.to_string(),
        })?;
        let mut state = shared.issue_state();
        if op.is_collective() {
            shared.flush_deferred(&mut state);
            if self.config.check_desync {
                shared.check_fingerprint(&mut state, &ctx, &op)?;
            }
        }
        let signal = IssueSignal::new();
        let work = shared.track(ctx, signal.clone());
        if !op.is_collective() {
            state.deferred.push(Deferred { op, signal });
            // The window counts from the last deferred operation, so that a send and the
            // receive posted right after it go out as one NCCL group.
            state.deferred_since = Some(Instant::now());
            if !defer {
                shared.flush_deferred(&mut state);
            }
            return Ok(work);
        }
        let scratch = state.scratch.ptr() + 8 * (FINGERPRINT_WORDS * (1 + shared.size)) as u64;
        let issued = (|| -> Result<Arc<Event>, String> {
            shared.after_compute(&state)?;
            shared.enqueue(&op, scratch)?;
            shared.record_done(&mut state)
        })();
        signal.set(match issued {
            Ok(event) => Issued::Recorded(event),
            Err(why) => Issued::Failed(why),
        });
        Ok(work)
    }

    /// Creates the sub-group of `ranks` named `name`: a bootstrap sub-group of the same ranks
    /// carries a fresh unique id, and the members make a new communicator with it.
    fn subgroup(&self, ranks: &[usize], name: &str) -> Result<Arc<NcclGroup>, CommError> {
        let ctx = self.shared.ctx("new_subgroup", 0);
        crate::group::validate_subgroup(&ctx, ranks, self.shared.rank, self.shared.size)?;
        let bootstrap = self
            .bootstrap
            .new_named_subgroup(ranks, &format!("{name}/nccl-bootstrap"))?;
        Self::init(
            bootstrap,
            name,
            Arc::clone(&self.shared.device),
            self.config.clone(),
            None,
        )
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn global_ranks(&self) -> &[usize] {
        &self.shared.global_ranks
    }

    fn config(&self) -> &CommConfig {
        &self.config
    }

    unsafe fn run_raw(&self, op: Operation) -> Result<(), CommError> {
        self.issue(op, false)?.wait()
    }

    unsafe fn start_raw(&self, op: Operation) -> Result<Work, CommError> {
        match self.issue(op, true) {
            Ok(work) => Ok(work),
            // As the other backends: a refused operation is a completed handle.
            Err(err) => Ok(Work::ready(Err(err))),
        }
    }

    /// Sub-groups are new communicators, made with a fresh unique id sent through a bootstrap
    /// sub-group of the same ranks: only the listed ranks call (the trait's contract), unlike
    /// `ncclCommSplit`, which every rank of the parent would have to call.
    fn new_named_subgroup(
        &self,
        ranks: &[usize],
        name: &str,
    ) -> Result<Arc<dyn ProcessGroup>, CommError> {
        Ok(self.subgroup(ranks, name)?)
    }

    /// Makes a communicator (and stream) for each pair this rank is in, named after the
    /// group and the pair's world ranks (`pp[0,1]:0→1`), unless it has one. Every rank makes
    /// its pairs' in the one order (sorted), so the two-rank meetings cannot wait on each
    /// other in a circle: the first pair not yet made has both its ranks waiting for it.
    fn prepare_point_to_point(&self, pairs: &[(usize, usize)]) -> Result<(), CommError> {
        let ctx = self.shared.ctx("prepare_point_to_point", 0);
        crate::group::validate_pairs(&ctx, pairs, self.shared.size)?;
        let mut pairs = pairs.to_vec();
        pairs.sort_unstable();
        pairs.dedup();
        let me = self.shared.rank;
        for (from, to) in pairs {
            if (from != me && to != me) || self.lanes().contains_key(&(from, to)) {
                continue;
            }
            let globals = &self.shared.global_ranks;
            let name = format!("{}:{}→{}", self.shared.name, globals[from], globals[to]);
            let bootstrap = self.bootstrap.new_named_subgroup(
                &[from.min(to), from.max(to)],
                &format!("{name}/nccl-bootstrap"),
            )?;
            let peer = globals[if from == me { to } else { from }];
            let lane = Self::init(
                bootstrap,
                &name,
                Arc::clone(&self.shared.device),
                self.config.clone(),
                Some(peer),
            )?;
            self.lanes().insert((from, to), lane);
        }
        Ok(())
    }

    /// NCCL reads the topology (NVLink, PCIe, the network cards) and builds rings and trees
    /// that cross between hosts once per host.
    fn follows_hosts(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Fingerprint;

    #[test]
    fn dtypes_and_reductions_map_to_nccls() {
        assert_eq!(nccl_dtype(DType::F32), nccl::ncclDataType_t::ncclFloat32);
        assert_eq!(nccl_dtype(DType::BF16), nccl::ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_dtype(DType::F16), nccl::ncclDataType_t::ncclFloat16);
        // The numbers NCCL's header gives them (nccl.h): the ABI the library reads.
        assert_eq!(nccl_dtype(DType::F32) as u32, 7);
        assert_eq!(nccl_dtype(DType::F16) as u32, 6);
        assert_eq!(nccl_dtype(DType::BF16) as u32, 9);
        assert_eq!(nccl_op(ReduceOp::Sum) as u32, 0);
        assert_eq!(nccl_op(ReduceOp::Max) as u32, 2);
        assert_eq!(nccl_op(ReduceOp::Average) as u32, 4);
        assert_eq!(nccl::ncclDataType_t::ncclUint64 as u32, 5);
    }

    #[test]
    fn unique_ids_cross_a_host_group_as_exact_small_floats() {
        let mut id = nccl::ncclUniqueId { internal: [0; 128] };
        for (i, b) in id.internal.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(200) as std::ffi::c_char;
        }
        let values = unique_id_to_values(&id);
        assert!(values.iter().all(|v| (0.0..=255.0).contains(v)));
        // bf16 and f16 hold every integer up to 255 exactly too.
        assert!(values.iter().all(
            |&v| half::bf16::from_f32(v).to_f32() == v && half::f16::from_f32(v).to_f32() == v
        ));
        assert_eq!(unique_id_from_values(&values).unwrap(), id);
        // What non-root ranks hold before the broadcast (and what rank 0 sends when it could
        // not make an id) is refused, not used.
        assert!(unique_id_from_values(&vec![-1.0; 128]).is_none());
        assert!(unique_id_from_values(&values[..127]).is_none());
    }

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(NcclVersion::from_code(22809).to_string(), "2.28.9");
        assert_eq!(NcclVersion::from_code(2708).to_string(), "2.7.8");
    }

    #[test]
    fn missing_libraries_are_named_with_the_way_to_get_them() {
        let driver = missing_library_text(false, false).unwrap();
        assert!(
            driver.contains("libcuda.so.1") && driver.contains("NVIDIA driver"),
            "{driver}"
        );
        let library = missing_library_text(true, false).unwrap();
        assert!(
            library.contains("libnccl.so.2")
                && library.contains("pip install nvidia-nccl-cu13")
                && library.contains("LD_LIBRARY_PATH"),
            "{library}"
        );
        assert!(missing_library_text(true, true).is_none());
    }

    /// On a machine without a driver (this project's CPU machines) the probe says so instead
    /// of panicking in cudarc's loader; with a driver and no NCCL it names libnccl.so.2.
    #[test]
    fn the_probe_never_panics_and_names_what_is_missing() {
        let driver = probe::present(cusys::is_culib_present);
        match nccl_available() {
            Ok(version) => assert!(driver && version.major >= 2, "{version}"),
            // No driver (as here): the driver is named, not NCCL.
            Err(text) if !driver => assert!(text.contains("libcuda.so.1"), "{text}"),
            Err(text) => assert!(text.contains("libnccl.so.2"), "{text}"),
        }
    }

    #[test]
    fn result_codes_say_what_they_mean() {
        assert!(result_text(nccl::ncclResult_t::ncclRemoteError).contains("peer"));
        assert!(result_text(nccl::ncclResult_t::ncclUnhandledCudaError).contains("CUDA"));
    }

    #[test]
    fn a_desync_names_both_sides() {
        let op = |seq, count| Fingerprint {
            kind: crate::group::OP_ALL_REDUCE,
            detail: 1,
            dtype: 1,
            count,
            seq,
        };
        let prints = [op(4, 10), op(4, 10), op(4, 12)];
        let details = desync_details(&prints, 0, &[4, 6, 8]).unwrap();
        assert_eq!(
            details,
            "rank 4 called all_reduce sum #4 f32×10 but rank 8 called all_reduce sum #4 f32×12"
        );
        assert!(desync_details(&[op(1, 3), op(1, 3)], 1, &[0, 1]).is_none());
    }
}
