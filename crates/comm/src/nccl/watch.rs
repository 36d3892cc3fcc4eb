//! The NCCL backend's watchdog as a state machine: which pending operations are done, which
//! one is stuck, and what happens to the group then. No CUDA and no NCCL in here: the clock
//! is an argument of [`Watch::poll`], "is this operation done" is an [`OpSignal`] and "does
//! the communicator report an error / abort it" is a [`CommControl`], so tests drive every
//! transition with fakes (the real ones query CUDA events and NCCL, `super`).
//!
//! Why a watchdog at all: NCCL's kernels spin on the GPU until their peers arrive. A rank
//! that crashed or never calls the collective leaves every other rank's kernel spinning
//! forever, and nothing on the host returns an error. The threads and MPI backends fail such
//! an operation after `config.timeout`; here a thread polls the completion events of the
//! operations in flight, and when the oldest one outlives the timeout it aborts the
//! communicator (`ncclCommAbort` stops the spinning kernels), so the waiter gets a
//! [`CommError::Timeout`] and every later operation a [`CommError::Broken`].

use crate::error::{CommError, OpContext};
use crate::group::{Completion, MissingMembers, Work};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What NCCL cannot say, and so every timeout's note says: which peers never came.
pub(crate) const CANNOT_TELL: &str = "NCCL cannot tell which ranks did not arrive";

/// Where one operation in flight stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OpState {
    /// Not finished (or not yet handed to NCCL).
    Pending,
    Done,
    /// It can never finish: enqueueing it failed, or its completion event reports an error.
    Failed(String),
}

/// Whether one operation in flight has finished (its comm-stream event, for NCCL).
pub(crate) trait OpSignal: Send {
    fn state(&self) -> OpState;
}

/// What the watchdog asks of, and does to, a communicator.
pub(crate) trait CommControl: Send + Sync {
    /// An error NCCL found outside any call (`ncclCommGetAsyncError`), e.g. a peer's network
    /// connection failed; `None` while the communicator is healthy.
    fn async_error(&self) -> Option<String>;
    /// Aborts the communicator (`ncclCommAbort`): its kernels stop, it is unusable after.
    /// Returns what happened, for the error messages.
    fn abort(&self) -> String;
    /// The members that never issued collective `seq`, from the bootstrap's position board
    /// ([`crate::ProcessGroup::position_board`]): what NCCL itself cannot tell. `None`
    /// without a board or an answer.
    fn missing(&self, _seq: u64) -> Option<MissingMembers> {
        None
    }
    /// The members the position board already knows stopped without doing their part of
    /// collective `Some(seq)` (a send or receive: `None`); asked on every look, so it must
    /// not wait for anyone.
    fn stopped(&self, _seq: Option<u64>) -> Option<MissingMembers> {
        None
    }
}

/// One operation handed to the watchdog.
pub(crate) struct Pending {
    pub(crate) ctx: OpContext,
    /// When the operation was issued; its clock starts then, or when the operation before it
    /// finished, whichever is later (see [`Watch::poll`]).
    pub(crate) issued: Instant,
    pub(crate) signal: Box<dyn OpSignal>,
    pub(crate) completion: Arc<Completion>,
}

impl Pending {
    /// A pending operation and the [`Work`] its caller waits on; a thread that starts
    /// waiting on it calls `hurry`.
    pub(crate) fn new(
        ctx: OpContext,
        issued: Instant,
        signal: Box<dyn OpSignal>,
        hurry: Arc<dyn Fn() + Send + Sync>,
    ) -> (Self, Work) {
        let completion = Arc::new(Completion::hurried_by(hurry));
        completion.begin();
        let work = Work::new(Arc::clone(&completion));
        (
            Pending {
                ctx,
                issued,
                signal,
                completion,
            },
            work,
        )
    }
}

/// The operations of one communicator in flight, oldest first, and whether it is broken.
pub(crate) struct Watch {
    timeout: Duration,
    /// The other rank (world rank) of a group of two (a lane, a pair): the one rank its
    /// operations can be waiting for.
    peer: Option<usize>,
    queue: VecDeque<Pending>,
    /// When the head of the queue became the head (the operation before it was seen done).
    head_since: Option<Instant>,
    broken: Option<String>,
}

impl Watch {
    pub(crate) fn new(timeout: Duration, peer: Option<usize>) -> Watch {
        Watch {
            timeout,
            peer,
            queue: VecDeque::new(),
            head_since: None,
            broken: None,
        }
    }

    /// Why the group is unusable, once it is.
    pub(crate) fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// The error of an operation started on a broken group.
    pub(crate) fn broken_error(&self, ctx: &OpContext) -> Option<CommError> {
        self.broken.as_ref().map(|cause| CommError::Broken {
            ctx: ctx.clone(),
            cause: cause.clone(),
        })
    }

    /// No operation in flight.
    pub(crate) fn is_idle(&self) -> bool {
        self.queue.is_empty()
    }

    /// Since when a thread has been blocked waiting for an operation in flight (the earliest
    /// such wait), if one is.
    pub(crate) fn waited_since(&self) -> Option<Instant> {
        self.queue
            .iter()
            .filter_map(|p| p.completion.waited_since())
            .min()
    }

    /// Takes an operation in flight. On a broken group it fails at once (its caller checked
    /// before issuing; this covers a group broken in between).
    pub(crate) fn push(&mut self, pending: Pending) {
        if let Some(err) = self.broken_error(&pending.ctx) {
            pending.completion.complete(Err(err));
            return;
        }
        self.queue.push_back(pending);
    }

    /// Marks the group unusable without aborting (a desync found before anything was
    /// enqueued: every rank sees the same fingerprints and stops, the communicator is fine,
    /// but the program is not).
    pub(crate) fn mark_broken(&mut self, cause: String) {
        self.broken.get_or_insert(cause);
    }

    /// One look at the operations in flight at time `now`: completes the finished ones in
    /// order; on an asynchronous NCCL error, a failed operation or a head older than the
    /// timeout, aborts the communicator and fails every pending operation — the culprit with
    /// its own error, the others with [`CommError::Broken`] naming it.
    ///
    /// The head's clock starts when it was issued or when the operation before it was seen
    /// done, whichever is later: operations run one after another on the communication
    /// stream, so a long one ahead does not eat the timeout of those queued behind it.
    pub(crate) fn poll(&mut self, now: Instant, comm: &dyn CommControl) {
        if self.broken.is_some() {
            self.fail_all();
            return;
        }
        if let Some(error) = comm.async_error() {
            let outcome = comm.abort();
            self.fail_head(|ctx| CommError::Backend {
                ctx,
                details: format!("NCCL reported an asynchronous error: {error}; {outcome}"),
            });
            // Nothing in flight: the error still breaks the group for the next operation.
            self.broken
                .get_or_insert_with(|| format!("NCCL reported an asynchronous error: {error}"));
            return;
        }
        loop {
            let Some(head) = self.queue.front() else {
                self.head_since = None;
                return;
            };
            match head.signal.state() {
                OpState::Done => {
                    let head = self.queue.pop_front().expect("the head exists");
                    head.completion.complete(Ok(()));
                    self.head_since = Some(now);
                }
                OpState::Failed(why) => {
                    let outcome = comm.abort();
                    self.fail_head(|ctx| CommError::Backend {
                        ctx,
                        details: format!("{why}; {outcome}"),
                    });
                    return;
                }
                OpState::Pending => {
                    // A member known dead will never come: fail now, not at the timeout.
                    let collective = head.ctx.peer.is_none().then_some(head.ctx.seq);
                    if let Some(stopped) = comm.stopped(collective) {
                        let outcome = comm.abort();
                        self.fail_head(|ctx| CommError::PeerFailed {
                            ctx,
                            missing: stopped.ranks,
                            reason: format!("{}; {outcome}", stopped.note),
                        });
                        return;
                    }
                    let since = self.head_since.map_or(head.issued, |t| t.max(head.issued));
                    if now.saturating_duration_since(since) >= self.timeout {
                        // Asked before the abort, so the answer is the state at the timeout.
                        let (timeout, peer) = (self.timeout, self.peer);
                        let board = match (peer, head.ctx.peer) {
                            (None, None) => comm.missing(head.ctx.seq),
                            _ => None,
                        };
                        let outcome = comm.abort();
                        let (missing, note) = match (peer, board) {
                            (Some(peer), _) => (
                                vec![peer],
                                format!("a group of two waits for no one else; {outcome}"),
                            ),
                            (None, Some(board)) if board.ranks.is_empty() => (
                                Vec::new(),
                                format!(
                                    "every other member issued it, so it stalled inside NCCL or \
                                     on a GPU{}; {outcome}",
                                    if board.note.is_empty() {
                                        String::new()
                                    } else {
                                        format!(" ({})", board.note)
                                    }
                                ),
                            ),
                            (None, Some(board)) => {
                                (board.ranks, format!("{}; {outcome}", board.note))
                            }
                            (None, None) => (Vec::new(), format!("{CANNOT_TELL}; {outcome}")),
                        };
                        self.fail_head(|ctx| CommError::Timeout {
                            ctx,
                            timeout,
                            missing,
                            note: note.into(),
                        });
                    }
                    return;
                }
            }
        }
    }

    /// Fails the head with `error(ctx)`, breaks the group with that error's text, and fails
    /// the rest with [`CommError::Broken`].
    fn fail_head(&mut self, error: impl FnOnce(OpContext) -> CommError) {
        let Some(head) = self.queue.pop_front() else {
            return;
        };
        let err = error(head.ctx.clone());
        self.broken.get_or_insert_with(|| err.to_string());
        head.completion.complete(Err(err));
        self.fail_all();
    }

    /// Fails every pending operation with [`CommError::Broken`] (the group must be broken).
    fn fail_all(&mut self) {
        let cause = self.broken.clone().unwrap_or_default();
        for pending in self.queue.drain(..) {
            pending.completion.complete(Err(CommError::Broken {
                ctx: pending.ctx,
                cause: cause.clone(),
            }));
        }
        self.head_since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// An operation whose state the test sets.
    #[derive(Clone, Default)]
    struct FakeOp(Arc<Mutex<Option<OpState>>>);

    impl FakeOp {
        fn set(&self, state: OpState) {
            *self.0.lock().unwrap() = Some(state);
        }
    }

    impl OpSignal for FakeOp {
        fn state(&self) -> OpState {
            self.0.lock().unwrap().clone().unwrap_or(OpState::Pending)
        }
    }

    #[derive(Default)]
    struct FakeComm {
        error: Mutex<Option<String>>,
        aborts: AtomicUsize,
        /// What the position board answers, and the collectives asked about.
        board: Option<MissingMembers>,
        asked: Mutex<Vec<u64>>,
        /// What it knows already stopped, and what it was asked about.
        stopped: Option<MissingMembers>,
        asked_stopped: Mutex<Vec<Option<u64>>>,
    }

    impl CommControl for FakeComm {
        fn async_error(&self) -> Option<String> {
            self.error.lock().unwrap().clone()
        }
        fn abort(&self) -> String {
            self.aborts.fetch_add(1, Ordering::SeqCst);
            "the communicator was aborted (fake)".into()
        }
        fn missing(&self, seq: u64) -> Option<MissingMembers> {
            self.asked.lock().unwrap().push(seq);
            self.board.clone()
        }
        fn stopped(&self, seq: Option<u64>) -> Option<MissingMembers> {
            self.asked_stopped.lock().unwrap().push(seq);
            self.stopped.clone()
        }
    }

    /// A member the board knows stopped fails the operation waiting for it at the next
    /// look, long before the timeout, naming it; collectives ask with their number, sends
    /// and receives without.
    #[test]
    fn a_member_known_dead_fails_the_operation_at_once() {
        let t0 = Instant::now();
        let comm = FakeComm {
            stopped: Some(MissingMembers {
                ranks: vec![3],
                note: "rank 3 died (connection lost)".into(),
            }),
            ..FakeComm::default()
        };
        let mut watch = Watch::new(TIMEOUT, None);
        let (_stuck, stuck) = issue(&mut watch, "all_reduce", 4, t0);
        watch.poll(t0 + Duration::from_millis(1), &comm);
        match stuck.wait() {
            Err(e @ CommError::PeerFailed { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("all_reduce #4 on group 'dp[0,2]' cannot complete: rank(s) [3]")
                        && text.contains(
                            "rank 3 died (connection lost); the communicator was aborted"
                        ),
                    "{text}"
                );
            }
            other => panic!("expected a peer failure, got {other:?}"),
        }
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
        assert_eq!(*comm.asked_stopped.lock().unwrap(), [Some(4)]);
        // A receive asks without a collective number.
        let comm = FakeComm::default();
        let mut watch = Watch::new(TIMEOUT, Some(1));
        let signal = FakeOp::default();
        let recv = OpContext::new("recv", 2, Arc::from("pp[0,1]"));
        let recv = OpContext {
            peer: Some(1),
            ..recv
        };
        let (pending, work) = Pending::new(recv, t0, Box::new(signal.clone()), Arc::new(|| {}));
        watch.push(pending);
        watch.poll(t0 + Duration::from_millis(1), &comm);
        assert!(!work.is_done() && comm.aborts.load(Ordering::SeqCst) == 0);
        assert_eq!(*comm.asked_stopped.lock().unwrap(), [None]);
        signal.set(OpState::Done);
        watch.poll(t0 + Duration::from_millis(2), &comm);
        assert!(work.wait().is_ok());
    }

    /// A group of more than two asks the bootstrap's position board which members never
    /// issued the collective that timed out, and names them; when every member issued it,
    /// the note says the stall is inside NCCL; without an answer, that NCCL cannot tell.
    #[test]
    fn a_groups_timeout_names_the_members_its_position_board_says_never_came() {
        let t0 = Instant::now();
        let answers = [
            (
                Some(MissingMembers {
                    ranks: vec![2],
                    note: "rank 2 last issued all_reduce #6".into(),
                }),
                "rank(s) [2] (global) did not arrive",
                "rank 2 last issued all_reduce #6; the communicator was aborted",
            ),
            (
                Some(MissingMembers {
                    ranks: Vec::new(),
                    note: String::new(),
                }),
                "all_reduce #7",
                "every other member issued it, so it stalled inside NCCL or on a GPU;",
            ),
            (None, "all_reduce #7", CANNOT_TELL),
        ];
        for (board, names, note) in answers {
            let comm = FakeComm {
                board,
                ..FakeComm::default()
            };
            let mut watch = Watch::new(TIMEOUT, None);
            let (_stuck, stuck) = issue(&mut watch, "all_reduce", 7, t0);
            watch.poll(t0 + TIMEOUT, &comm);
            let text = stuck.wait().unwrap_err().to_string();
            assert!(text.contains(names) && text.contains(note), "{text}");
            assert_eq!(*comm.asked.lock().unwrap(), [7]);
        }
        // A lane knows its peer and asks no one.
        let comm = FakeComm::default();
        let mut watch = Watch::new(TIMEOUT, Some(1));
        let (_stuck, stuck) = issue(&mut watch, "all_reduce", 7, t0);
        watch.poll(t0 + TIMEOUT, &comm);
        assert!(stuck.wait().is_err() && comm.asked.lock().unwrap().is_empty());
    }

    fn ctx(op: &'static str, seq: u64) -> OpContext {
        OpContext::new(op, seq, Arc::from("dp[0,2]"))
    }

    /// Issues `op` #`seq` at `at` into `watch`; returns its signal and Work.
    fn issue(watch: &mut Watch, op: &'static str, seq: u64, at: Instant) -> (FakeOp, Work) {
        let signal = FakeOp::default();
        let (pending, work) =
            Pending::new(ctx(op, seq), at, Box::new(signal.clone()), Arc::new(|| {}));
        watch.push(pending);
        (signal, work)
    }

    const TIMEOUT: Duration = Duration::from_secs(10);

    #[test]
    fn finished_operations_complete_in_order() {
        let (t0, comm) = (Instant::now(), FakeComm::default());
        let mut watch = Watch::new(TIMEOUT, None);
        let (a, work_a) = issue(&mut watch, "all_reduce", 1, t0);
        let (b, work_b) = issue(&mut watch, "all_gather", 2, t0);
        // The second is done but the first is not: nothing completes out of order.
        b.set(OpState::Done);
        watch.poll(t0 + Duration::from_secs(1), &comm);
        assert!(!work_a.is_done() && !work_b.is_done());
        a.set(OpState::Done);
        watch.poll(t0 + Duration::from_secs(2), &comm);
        assert!(work_a.wait().is_ok() && work_b.wait().is_ok());
        assert!(watch.is_idle() && watch.broken().is_none());
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 0);
    }

    /// A pair's lane waits for one rank only: its timeout names that rank.
    #[test]
    fn a_lanes_timeout_names_its_other_rank() {
        let (t0, comm) = (Instant::now(), FakeComm::default());
        let mut watch = Watch::new(TIMEOUT, Some(5));
        let (_stuck, stuck) = issue(&mut watch, "send", 3, t0);
        watch.poll(t0 + TIMEOUT, &comm);
        match stuck.wait() {
            Err(e @ CommError::Timeout { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("send #3 on group 'dp[0,2]'")
                        && text.contains("rank(s) [5] (global) did not arrive")
                        && !text.contains(CANNOT_TELL),
                    "{text}"
                );
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_stuck_operation_aborts_the_communicator_and_breaks_the_group() {
        let (t0, comm) = (Instant::now(), FakeComm::default());
        let mut watch = Watch::new(TIMEOUT, None);
        let (_stuck, stuck) = issue(&mut watch, "all_reduce", 7, t0);
        let (_behind, behind) = issue(&mut watch, "broadcast", 8, t0);
        watch.poll(t0 + TIMEOUT - Duration::from_millis(1), &comm);
        assert!(!stuck.is_done());
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 0);
        watch.poll(t0 + TIMEOUT, &comm);
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1, "aborted once");
        match stuck.wait() {
            Err(CommError::Timeout {
                ctx,
                timeout,
                missing,
                note,
            }) => {
                assert_eq!((ctx.op, ctx.seq, &*ctx.group), ("all_reduce", 7, "dp[0,2]"));
                assert_eq!(timeout, TIMEOUT);
                assert!(missing.is_empty(), "NCCL cannot name the missing ranks");
                assert!(
                    note.contains(CANNOT_TELL) && note.contains("aborted"),
                    "{note}"
                );
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        // The operation queued behind it fails as broken, naming the timeout.
        match behind.wait() {
            Err(CommError::Broken { ctx, cause }) => {
                assert_eq!((ctx.op, ctx.seq), ("broadcast", 8));
                assert!(
                    cause.contains("all_reduce #7 on group 'dp[0,2]' timed out"),
                    "{cause}"
                );
            }
            other => panic!("expected broken, got {other:?}"),
        }
        // And so does every later one, without another abort.
        let (_, later) = issue(&mut watch, "barrier", 9, t0 + TIMEOUT);
        watch.poll(t0 + TIMEOUT * 3, &comm);
        assert!(matches!(later.wait(), Err(CommError::Broken { .. })));
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_clock_of_a_queued_operation_starts_when_the_one_before_finishes() {
        let (t0, comm) = (Instant::now(), FakeComm::default());
        let mut watch = Watch::new(TIMEOUT, None);
        let (long, long_work) = issue(&mut watch, "all_reduce", 1, t0);
        let (_next, next_work) = issue(&mut watch, "all_reduce", 2, t0);
        let finished = t0 + Duration::from_secs(9);
        long.set(OpState::Done);
        watch.poll(finished, &comm);
        assert!(long_work.wait().is_ok());
        // 15 s after it was issued but only 6 s after it could start: not timed out.
        watch.poll(t0 + Duration::from_secs(15), &comm);
        assert!(!next_work.is_done());
        watch.poll(finished + TIMEOUT, &comm);
        match next_work.wait() {
            Err(CommError::Timeout { ctx, .. }) => assert_eq!(ctx.seq, 2),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[test]
    fn an_asynchronous_nccl_error_fails_the_operations_in_flight() {
        let (t0, comm) = (Instant::now(), FakeComm::default());
        let mut watch = Watch::new(TIMEOUT, None);
        let (_op, work) = issue(&mut watch, "reduce_scatter", 3, t0);
        *comm.error.lock().unwrap() = Some("ncclRemoteError: a peer's connection failed".into());
        watch.poll(t0 + Duration::from_millis(5), &comm);
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
        let err = work.wait().unwrap_err();
        assert!(matches!(err, CommError::Backend { .. }));
        let text = err.to_string();
        assert!(
            text.starts_with("reduce_scatter #3 on group 'dp[0,2]': backend error: NCCL reported")
                && text.contains("ncclRemoteError"),
            "{text}"
        );
        assert!(watch.broken().unwrap().contains("ncclRemoteError"));
    }

    #[test]
    fn an_asynchronous_error_while_idle_breaks_the_next_operation() {
        let (t0, comm) = (Instant::now(), FakeComm::default());
        let mut watch = Watch::new(TIMEOUT, None);
        *comm.error.lock().unwrap() = Some("ncclSystemError".into());
        watch.poll(t0, &comm);
        assert!(watch.broken_error(&ctx("all_gather", 4)).is_some_and(|e| e
            .to_string()
            .contains("all_gather #4 on group 'dp[0,2]': group is unusable")));
    }

    #[test]
    fn an_operation_that_could_not_be_enqueued_breaks_the_group() {
        let (t0, comm) = (Instant::now(), FakeComm::default());
        let mut watch = Watch::new(TIMEOUT, None);
        let (done, done_work) = issue(&mut watch, "all_reduce", 1, t0);
        let (failed, failed_work) = issue(&mut watch, "all_to_all", 2, t0);
        let (_, behind) = issue(&mut watch, "barrier", 3, t0);
        done.set(OpState::Done);
        failed.set(OpState::Failed("ncclGroupEnd: ncclInvalidUsage".into()));
        watch.poll(t0, &comm);
        assert!(done_work.wait().is_ok(), "finished before the failure");
        let text = failed_work.wait().unwrap_err().to_string();
        assert!(
            text.contains("all_to_all #2") && text.contains("ncclInvalidUsage"),
            "{text}"
        );
        assert!(matches!(behind.wait(), Err(CommError::Broken { .. })));
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_desync_breaks_the_group_without_aborting() {
        let (t0, comm) = (Instant::now(), FakeComm::default());
        let mut watch = Watch::new(TIMEOUT, None);
        watch.mark_broken("all_reduce #2 on group 'world': collective mismatch".into());
        let (_, work) = issue(&mut watch, "all_reduce", 3, t0);
        watch.poll(t0, &comm);
        match work.wait() {
            Err(CommError::Broken { cause, .. }) => assert!(cause.contains("mismatch")),
            other => panic!("expected broken, got {other:?}"),
        }
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_timeout_message_names_op_seq_group_and_what_nccl_cannot_tell() {
        let err = CommError::Timeout {
            ctx: ctx("all_reduce", 12),
            timeout: Duration::from_secs(300),
            missing: Vec::new(),
            note: format!(
                "{CANNOT_TELL}; the communicator was aborted (ncclCommAbort: ncclSuccess)"
            )
            .into(),
        };
        assert_eq!(
            err.to_string(),
            "all_reduce #12 on group 'dp[0,2]' timed out after 300s: some rank(s) did not \
             arrive (the backend could not tell which) (NCCL cannot tell which ranks did not \
             arrive; the communicator was aborted (ncclCommAbort: ncclSuccess))"
        );
    }
}
