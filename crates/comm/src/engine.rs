//! Per-rank communication thread that runs asynchronous operations in order.
//!
//! Async operations must progress while the caller computes (no polling), so each
//! rank's group handle owns one lazily started thread fed by a channel. Jobs run
//! strictly in submission order, which keeps collective sequence numbers identical on
//! all ranks. A synchronous operation runs inline on the caller's thread when nothing
//! is queued (no hand-off latency), and otherwise is queued behind the pending work.

use crate::error::{CommError, OpContext};
use crate::group::{Completion, Operation, Work};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A backend's per-rank core: runs one operation whose sequence number is assigned.
pub(crate) trait Executor: Send + Sync + 'static {
    /// This rank's own copy of the group's name (for error contexts).
    fn group_name(&self) -> &Arc<str>;

    /// What an error of operation `op`, number `seq`, names.
    fn ctx(&self, op: &Operation, seq: u64) -> OpContext {
        OpContext::of(op, seq, Arc::clone(self.group_name()))
    }

    /// # Safety
    /// `op`'s buffers must satisfy the contract of `ProcessGroup::run_raw`.
    unsafe fn execute(&self, op: Operation, seq: u64) -> Result<(), CommError>;
}

/// Numbers one rank's operations on a group: collectives in one sequence (the same on every
/// rank, which is what the desync check and the error messages compare), and each send or
/// receive among the messages to or from its peer in that direction. Messages between two
/// ranks arrive in the order sent, so the n-th send to a rank is its n-th receive from here:
/// a receive that times out names the very message its peer never sent.
pub(crate) struct Sequencer {
    next_collective: AtomicU64,
    /// Per peer (the group's ranks): messages sent to it, and received from it, so far.
    sent: Vec<AtomicU64>,
    received: Vec<AtomicU64>,
}

impl Sequencer {
    pub(crate) fn new(group_size: usize) -> Sequencer {
        let counters = || (0..group_size).map(|_| AtomicU64::new(0)).collect();
        Sequencer {
            next_collective: AtomicU64::new(1),
            sent: counters(),
            received: counters(),
        }
    }

    /// The number of `op` (1 = the first of its sequence); 0 for a send or receive whose peer
    /// is out of range (validation refuses it next).
    pub(crate) fn assign(&self, op: &Operation) -> u64 {
        let counter = match *op {
            Operation::Send { dst, .. } => self.sent.get(dst),
            Operation::Recv { src, .. } => self.received.get(src),
            _ => return self.next_collective.fetch_add(1, Ordering::Relaxed),
        };
        counter.map_or(0, |c| c.fetch_add(1, Ordering::Relaxed) + 1)
    }
}

pub(crate) struct AsyncEngine {
    thread_name: String,
    sender: Mutex<Option<mpsc::Sender<Job>>>,
    /// Jobs submitted and not yet finished; 0 means a sync op may run inline.
    pending: Arc<AtomicUsize>,
}

impl AsyncEngine {
    pub(crate) fn new(thread_name: String) -> AsyncEngine {
        AsyncEngine {
            thread_name,
            sender: Mutex::new(None),
            pending: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// True when no async operation is queued or running.
    pub(crate) fn is_idle(&self) -> bool {
        self.pending.load(Ordering::Acquire) == 0
    }

    /// Queues `job` behind earlier jobs. Errors only if the thread cannot be started.
    pub(crate) fn submit<F>(&self, job: F) -> Result<Work, String>
    where
        F: FnOnce() -> Result<(), CommError> + Send + 'static,
    {
        let completion = Arc::new(Completion::default());
        let done = Arc::clone(&completion);
        let pending = Arc::clone(&self.pending);
        let wrapped: Job = Box::new(move || {
            done.begin();
            let result = job();
            // Decrement before completing: once a waiter sees the result, a following
            // synchronous operation may run inline.
            pending.fetch_sub(1, Ordering::AcqRel);
            done.complete(result);
        });
        let mut sender = self.sender.lock().unwrap_or_else(|e| e.into_inner());
        if sender.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(self.thread_name.clone())
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                })
                .map_err(|e| format!("cannot start communication thread: {e}"))?;
            *sender = Some(tx);
        }
        self.pending.fetch_add(1, Ordering::AcqRel);
        let tx = sender.as_ref().expect("sender was just set");
        if let Err(mpsc::SendError(job)) = tx.send(wrapped) {
            // The thread is gone (it only exits when the sender is dropped, so this
            // cannot happen while we hold it); run the job here rather than lose it.
            job();
        }
        Ok(Work::new(completion))
    }

    /// Runs `op` (with the sequence number `prepare` assigned it, or its error) inline when
    /// nothing is queued, else behind the queued operations, and waits for it.
    ///
    /// # Safety
    /// As [`Executor::execute`].
    pub(crate) unsafe fn run<E: Executor>(
        &self,
        core: &Arc<E>,
        op: Operation,
        seq: Result<u64, CommError>,
    ) -> Result<(), CommError> {
        let seq = seq?;
        if self.is_idle() {
            core.execute(op, seq)
        } else {
            self.start(core, op, Ok(seq))?.wait()
        }
    }

    /// Queues `op` and returns its handle; a `prepare` error becomes a completed handle.
    ///
    /// # Safety
    /// As [`Executor::execute`]; the buffers must stay valid until the handle completes.
    pub(crate) unsafe fn start<E: Executor>(
        &self,
        core: &Arc<E>,
        op: Operation,
        seq: Result<u64, CommError>,
    ) -> Result<Work, CommError> {
        let seq = match seq {
            Ok(seq) => seq,
            Err(err) => return Ok(Work::ready(Err(err))),
        };
        let core = Arc::clone(core);
        let ctx = core.ctx(&op, seq);
        self.submit(move || {
            // SAFETY: forwarded from the caller's contract on `op`'s buffers.
            unsafe { core.execute(op, seq) }
        })
        .map_err(|details| CommError::Backend { ctx, details })
    }

    /// Blocks until every job submitted so far has finished.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn drain(&self) {
        if !self.is_idle() {
            if let Ok(work) = self.submit(|| Ok(())) {
                let _ = work.wait();
            }
        }
    }
}
