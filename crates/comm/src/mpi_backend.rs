//! OpenMPI backend (cargo feature `mpi`): one worker per process, started by
//! `mpirun -np N`, on one machine or across machines.
//!
//! Built on rsmpi (`mpi` crate) for initialisation and on its raw `ffi` bindings for
//! the operations. Collectives call MPI's *blocking* collectives (in place for f32
//! all-reduce), which are OpenMPI's tuned algorithms: the nonblocking `MPI_I*` forms
//! with `MPI_Test` polling measured 2-5x slower than raw `MPI_Allreduce` here. A
//! blocking call cannot return on a timeout, so a per-process watchdog thread watches
//! every collective and, past the timeout, prints the timeout error (op, sequence
//! number, group, missing ranks) and aborts the job (`MPI_Abort`, exit code 3) — the
//! run ends within the timeout instead of hanging, and every process exits non-zero.
//! The missing ranks, and peers that panicked, died or exited (which fail blocked
//! collectives at once), come from the failure monitor, a TCP side channel to rank 0
//! (`mpi_monitor`).
//!
//! bf16/f16 buffers are widened to f32, reduced, and rounded back (MPI has no bf16
//! type, and reducing in f32 is what the trait promises). Point-to-point messages
//! travel as bytes: sends are buffered `MPI_Isend`s of a copy, moved along by a thread of
//! their own (MPI moves a large message only while the sender is inside MPI, and a sender
//! may go on to work that never enters it: NCCL kernels, a long computation); the receiver
//! matches the message (`MPI_Improbe`, polled against the timeout, so a receive timeout is
//! a returned error), checks its size, then receives it (`MPI_Imrecv`).
//!
//! Limits compared with the threads backend: collective timeouts and stopped peers
//! abort the job rather than return an error (unless the peer was known to have
//! stopped before the call), and tags must be at most 32767 (the MPI-guaranteed
//! minimum of `MPI_TAG_UB`).

use crate::bench::{
    bench_group, compare_hierarchical, describe_hosts, print_header, record, report,
    report_comparison, sizes_and_memcpy, time_collective, BenchCollectivesArgs, BenchOp,
    BenchRecord,
};
use crate::dtype::{with_element, DType, Element, RawBuf, ReduceOp};
use crate::engine::{AsyncEngine, Executor, Sequencer};
use crate::error::{fmt_ranks, CommError, OpContext};
use crate::group::{
    validate_subgroup, CommConfig, Fingerprint, MissingMembers, Operation, PositionBoard,
    ProcessGroup, Work,
};
use crate::mpi_monitor::{self, GroupTrack, Monitor, ShutdownAgreement, ALL_ENTERED};
use crate::topology::HostPlacement;
use anyhow::{anyhow, Result};
use mpi::environment::{Threading, Universe};
use mpi::ffi;
use mpi::traits::Communicator;
use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

// The backend targets OpenMPI (what CI installs): there `MPI_IN_PLACE` is `(void *) 1`,
// a macro that bindgen cannot export. Fail the build on another MPI implementation
// rather than pass a wrong sentinel.
const _: () = assert!(
    ffi::OMPI_MAJOR_VERSION >= 1,
    "the mpi backend supports OpenMPI only"
);
// Address 1 is OpenMPI's sentinel value, not a placeholder for an aligned pointer.
#[allow(clippy::manual_dangling_ptr)]
const MPI_IN_PLACE: *mut c_void = 1 as *mut c_void;

/// How long a receive keeps probing after the failure monitor reported its source
/// stopped, for messages still in transit.
const STOPPED_PEER_GRACE: Duration = Duration::from_millis(100);

/// Highest tag the backend accepts (MPI guarantees `MPI_TAG_UB >= 32767`).
pub const MAX_TAG: u32 = 32767;

/// An MPI handle (a pointer in OpenMPI) that may cross threads: every MPI call made
/// with it is serialised by [`MpiShared::call`] unless MPI runs `THREAD_MULTIPLE`.
#[derive(Clone, Copy)]
struct Comm(ffi::MPI_Comm);
// SAFETY: see above; MPI handles are plain identifiers valid in every thread.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

/// Process-wide MPI state shared by all groups of one [`MpiWorld`] (a value, no global).
struct MpiShared {
    /// Serialises MPI calls when the library is not `MPI_THREAD_MULTIPLE`.
    lock: Option<Mutex<()>>,
    config: CommConfig,
    watchdog: Arc<Watchdog>,
    /// The failure monitor's connection; `None` if it could not be set up (then
    /// failures are still caught by the timeout, without the missing ranks).
    monitor: Option<Arc<Monitor>>,
    /// Groups created so far per name and members: the instance number makes a
    /// group's monitor key unique and equal on all members.
    group_instances: Mutex<HashMap<String, usize>>,
    /// Every group's buffered sends until MPI has delivered them.
    sends: SendQueue,
}

/// The buffered sends of every group in flight, and whether their thread must stop.
///
/// A send returns as soon as MPI has its copy, but MPI moves a message larger than its
/// eager limit only while the sending process is inside an MPI call. A rank that sends
/// and then works outside MPI (a tensor-parallel rank sending its checkpoint shards and
/// going on to the next step's NCCL collectives) would leave the receiver waiting for the
/// rest forever; so one thread per process tests the outstanding sends until they are
/// done, which is what moves them, and no caller has to stay in MPI for its peers.
#[derive(Default)]
struct SendQueue {
    list: Mutex<SendList>,
    /// Signalled when a send is queued, the list empties, or the thread must stop.
    changed: Condvar,
    /// Set with `SendList::failure`: every operation looks, without the lock.
    failed: AtomicBool,
}

#[derive(Default)]
struct SendList {
    /// Requests of `MPI_Isend`s not yet known complete, each with the copy it reads.
    sends: Vec<(ffi::MPI_Request, Vec<u8>)>,
    /// The first `MPI_Test` failure; every later operation reports it.
    failure: Option<String>,
    stopped: bool,
}

// SAFETY: the raw MPI requests inside are identifiers; calls on them are serialised by
// `MpiShared::call` (unless MPI runs `THREAD_MULTIPLE`) and by the list's lock.
unsafe impl Send for SendList {}

/// How long the send thread sleeps between looks while sends are in flight: short enough
/// that a large message moves at MPI's speed, long enough to leave the cores to compute.
const SEND_POLL: Duration = Duration::from_micros(50);
/// The sleep once nothing has completed for [`SEND_IDLE_AFTER`] (a message nobody
/// receives yet: a pipeline's activation ahead of its consumer).
const SEND_POLL_IDLE: Duration = Duration::from_millis(1);
const SEND_IDLE_AFTER: Duration = Duration::from_millis(20);

/// How long an aborting rank waits before `MPI_Abort`, which kills every process
/// of the job at once: peers that are failing too (the same timeout, the same dead
/// rank) get to print their own error first.
const ABORT_GRACE: Duration = Duration::from_millis(300);

/// Writes one line to stderr in a single write: `mpirun` merges the ranks' output,
/// and `eprintln!` may write a line in pieces that interleave with other ranks'.
fn print_line(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// Watches blocking collectives: one that outlives its deadline, or waits for a peer
/// the failure monitor reports stopped, is reported (op, sequence number, group,
/// missing ranks) and the MPI job is aborted with exit code 3 — a blocking MPI call
/// cannot return an error, and the run must end instead of hanging.
struct Watchdog {
    inflight: Mutex<WatchList>,
    changed: Condvar,
    /// This process's rank in `MPI_COMM_WORLD` (for messages).
    rank: usize,
    monitor: Option<Arc<Monitor>>,
    /// Set once this process is aborting the job: MPI must not be finalised meanwhile.
    aborting: AtomicBool,
}

#[derive(Default)]
struct WatchList {
    next_id: u64,
    ops: HashMap<u64, Watched>,
    stopped: bool,
}

/// How late past its deadline the watchdog may see an operation before the lateness means
/// this process was not running (the watchdog itself polls every 100 ms).
const SUSPENDED_AFTER: Duration = Duration::from_secs(2);

#[derive(Clone)]
struct Watched {
    deadline: Instant,
    ctx: OpContext,
    timeout: Duration,
    track: Arc<GroupTrack>,
}

/// Unregisters a watched operation when it completes.
struct WatchGuard<'a> {
    watchdog: &'a Watchdog,
    id: u64,
}

impl Drop for WatchGuard<'_> {
    fn drop(&mut self) {
        let mut list = self
            .watchdog
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        list.ops.remove(&self.id);
    }
}

/// Exit code of a job aborted by the watchdog (timeout or stopped peer).
const WATCHDOG_EXIT_CODE: i32 = 3;

impl Watchdog {
    fn start(rank: usize, monitor: Option<Arc<Monitor>>) -> Arc<Watchdog> {
        let watchdog = Arc::new(Watchdog {
            inflight: Mutex::new(WatchList::default()),
            changed: Condvar::new(),
            rank,
            monitor,
            aborting: AtomicBool::new(false),
        });
        if let Some(monitor) = &watchdog.monitor {
            // A stopped peer wakes the watchdog at once: blocked collectives fail fast.
            let weak = Arc::downgrade(&watchdog);
            monitor.set_waker(Box::new(move || {
                if let Some(watchdog) = weak.upgrade() {
                    let _list = watchdog.inflight.lock();
                    watchdog.changed.notify_all();
                }
            }));
        }
        let watcher = Arc::clone(&watchdog);
        // If the thread cannot start, collectives still work, only without timeouts.
        let _ = std::thread::Builder::new()
            .name("comm-mpi-watchdog".to_string())
            .spawn(move || watcher.run());
        watchdog
    }

    /// Registers an operation. Cheap (one uncontended lock, no allocation, no
    /// wake-up): the watchdog polls every 100 ms instead of being notified.
    fn watch(&self, ctx: &OpContext, timeout: Duration, track: &Arc<GroupTrack>) -> WatchGuard<'_> {
        let mut list = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        list.next_id += 1;
        let id = list.next_id;
        list.ops.insert(
            id,
            Watched {
                deadline: Instant::now() + timeout,
                ctx: ctx.clone(),
                timeout,
                track: Arc::clone(track),
            },
        );
        WatchGuard { watchdog: self, id }
    }

    /// Prints `message` and ends the whole job with `code`: after a communication
    /// failure a peer may be blocked forever, so nothing short of `MPI_Abort` ends the
    /// run. Lives here because the watchdog is what every abort path shares.
    fn abort_job(&self, message: &str, code: i32) -> ! {
        self.aborting.store(true, Ordering::SeqCst);
        print_line(&format!(
            "error: rank {}: {message}; aborting the MPI job",
            self.rank
        ));
        std::thread::sleep(ABORT_GRACE);
        // SAFETY: MPI is initialised: `MpiWorld::drop` does not finalise it once
        // `aborting` is set. MPI_Abort does not return.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
        std::process::exit(code)
    }

    fn stop(&self) {
        let mut list = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        list.stopped = true;
        self.changed.notify_all();
    }

    fn run(&self) {
        let mut list = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if list.stopped {
                return;
            }
            if let Some(monitor) = &self.monitor {
                let failure = list.ops.values().find_map(|op| {
                    let missing = monitor.stopped_peers(&op.track, collective_number(&op.ctx))?;
                    Some(CommError::PeerFailed {
                        ctx: op.ctx.clone(),
                        missing: missing.ranks,
                        reason: missing.note,
                    })
                });
                if let Some(err) = failure {
                    drop(list);
                    self.abort_job(&err.to_string(), WATCHDOG_EXIT_CODE);
                }
            }
            let now = Instant::now();
            let earliest = list.ops.values().min_by_key(|op| op.deadline).cloned();
            let wait = match earliest {
                Some(op) if op.deadline <= now => {
                    // Unlocked while asking the monitor: its thread may need the lock
                    // to wake us.
                    drop(list);
                    let err = self.timeout_error(op);
                    self.abort_job(&err.to_string(), WATCHDOG_EXIT_CODE);
                }
                Some(op) => (op.deadline - now).min(Duration::from_millis(100)),
                None => Duration::from_millis(100),
            };
            list = self
                .changed
                .wait_timeout(list, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The timeout error of `op`, naming the members that had not entered it (as
    /// far as the failure monitor knows).
    fn timeout_error(&self, op: Watched) -> CommError {
        // The watchdog looks at least every 100 ms: waking up long after the deadline means
        // this process itself was not running (stopped with SIGSTOP, or starved of CPU).
        let late = Instant::now().saturating_duration_since(op.deadline);
        let (missing, mut note) = match &self.monitor {
            Some(monitor) => match monitor.missing_ranks(&op.track, collective_number(&op.ctx)) {
                Some(missing) => (missing.ranks, missing.note),
                None => (Vec::new(), "the failure monitor did not answer".to_string()),
            },
            None => (Vec::new(), "the failure monitor is not running".to_string()),
        };
        if late > SUSPENDED_AFTER {
            note = format!(
                "this rank was not running for {:.1} s past the deadline (stopped, e.g. by \
                 SIGSTOP, or starved of CPU), so the wait was its own, not its peers'; {note}",
                late.as_secs_f64()
            );
        } else if missing.is_empty() && note.starts_with(ALL_ENTERED) {
            note = format!(
                "every other member entered it, so the operation stalled in this rank's \
                 transport or its peers' progress; {note}"
            );
        }
        CommError::Timeout {
            ctx: op.ctx,
            timeout: op.timeout,
            missing,
            note: note.into(),
        }
    }
}

impl MpiShared {
    fn call<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.lock {
            Some(lock) => {
                let _guard = lock.lock().unwrap_or_else(|e| e.into_inner());
                f()
            }
            None => f(),
        }
    }

    /// Hands a started send and the copy it reads to the send thread.
    fn queue_send(&self, request: ffi::MPI_Request, bytes: Vec<u8>) {
        let mut list = self.sends.list.lock().unwrap_or_else(|e| e.into_inner());
        // The Vec's heap block does not move when the Vec is moved into the list.
        list.sends.push((request, bytes));
        self.sends.changed.notify_all();
    }

    /// Why the send thread failed, if it did.
    fn send_failure(&self) -> Option<String> {
        if !self.sends.failed.load(Ordering::Acquire) {
            return None;
        }
        let list = self.sends.list.lock().unwrap_or_else(|e| e.into_inner());
        list.failure.clone()
    }

    /// Tests every outstanding send once (which is what moves it), dropping the copies of
    /// those MPI has completed; true if any completed.
    fn progress_sends(&self, list: &mut SendList) -> bool {
        let before = list.sends.len();
        let mut failure = None;
        list.sends.retain_mut(|(request, _)| {
            let mut flag: c_int = 0;
            // SAFETY: live request of an earlier MPI_Isend, tested under the list's lock.
            let code = self
                .call(|| unsafe { ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE) });
            if code != 0 {
                failure.get_or_insert(format!("MPI_Test of a send returned MPI error code {code}"));
            }
            // A send whose test failed stays: MPI may still read its copy.
            code != 0 || flag == 0
        });
        if let Some(failure) = failure {
            list.failure.get_or_insert(failure);
            self.sends.failed.store(true, Ordering::Release);
        }
        if list.sends.is_empty() {
            self.sends.changed.notify_all();
        }
        list.sends.len() < before
    }

    /// The send thread: while sends are in flight, tests them every [`SEND_POLL`] (every
    /// [`SEND_POLL_IDLE`] once none has completed for a while); otherwise sleeps until one
    /// is queued. Ends when [`MpiShared::finish_sends`] stops it.
    fn run_sends(self: Arc<MpiShared>) {
        let mut last_completion = Instant::now();
        loop {
            let mut list = self.sends.list.lock().unwrap_or_else(|e| e.into_inner());
            while list.sends.is_empty() && !list.stopped {
                list = (self.sends.changed.wait(list)).unwrap_or_else(|e| e.into_inner());
                last_completion = Instant::now();
            }
            if list.stopped {
                return;
            }
            if self.progress_sends(&mut list) {
                last_completion = Instant::now();
            }
            drop(list);
            std::thread::sleep(if last_completion.elapsed() < SEND_IDLE_AFTER {
                SEND_POLL
            } else {
                SEND_POLL_IDLE
            });
        }
    }

    /// Waits (at most `timeout`) until MPI has delivered every send, so that finalising
    /// does not drop messages a peer still receives, then stops the send thread.
    fn finish_sends(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut list = self.sends.list.lock().unwrap_or_else(|e| e.into_inner());
        while !list.sends.is_empty() && list.failure.is_none() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            list = (self.sends.changed.wait_timeout(list, deadline - now))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        list.stopped = true;
        self.sends.changed.notify_all();
    }

    /// A progress track for a new group with these global members, reported to the
    /// failure monitor.
    fn new_track(&self, name: &str, members: Vec<usize>) -> Arc<GroupTrack> {
        let instance = {
            let mut instances = self
                .group_instances
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let count = instances
                .entry(format!("{name}{}", fmt_ranks(&members)))
                .or_insert(0);
            *count += 1;
            *count - 1
        };
        let track = Arc::new(GroupTrack::new(name, members, instance));
        if let Some(monitor) = &self.monitor {
            monitor.register(Arc::clone(&track));
        }
        track
    }

    /// `PeerFailed` if a member this collective needs is known to have stopped.
    fn peer_failure(&self, ctx: &OpContext, track: &GroupTrack) -> Option<CommError> {
        let missing = self
            .monitor
            .as_ref()?
            .stopped_peers(track, collective_number(ctx))?;
        Some(CommError::PeerFailed {
            ctx: ctx.clone(),
            missing: missing.ranks,
            reason: missing.note,
        })
    }
}

/// Where every rank runs, exchanged once at initialisation.
struct Hosts {
    /// Equal for ranks on one host: `MESHTRAIN_HOST` where set (the netns cluster sets it,
    /// since its namespaces share one host name), else the processor name and the first rank
    /// of the rank's `MPI_COMM_TYPE_SHARED` communicator (the ranks that can share memory).
    labels: Vec<String>,
    /// `MPI_Get_processor_name` of every rank (how a peer host is reached by name).
    names: Vec<String>,
}

/// Environment variable naming the host a rank runs on (overrides what MPI reports).
pub const HOST_ENV: &str = "MESHTRAIN_HOST";
/// Environment variable with an IPv4 address other hosts reach this rank's host at: where
/// rank 0's failure monitor is reached when its host name does not resolve to it.
pub const HOST_ADDR_ENV: &str = "MESHTRAIN_HOST_ADDR";

impl Hosts {
    /// Every rank's host label and processor name; a description of the MPI call that
    /// failed otherwise.
    fn discover(rank: usize, size: usize) -> Result<Hosts, String> {
        const LEN: usize = ffi::MPI_MAX_PROCESSOR_NAME as usize;
        let mut name = [0u8; LEN];
        let mut len: c_int = 0;
        // SAFETY: the buffer holds MPI_MAX_PROCESSOR_NAME bytes, as MPI requires.
        let code = unsafe { ffi::MPI_Get_processor_name(name.as_mut_ptr().cast(), &mut len) };
        if code != 0 {
            return Err(format!("MPI_Get_processor_name failed (MPI error {code})"));
        }
        let name =
            String::from_utf8_lossy(&name[..len.clamp(0, LEN as c_int) as usize]).into_owned();
        let label = match std::env::var(HOST_ENV) {
            Ok(host) if !host.is_empty() => host,
            _ => format!("{name}#{}", first_rank_sharing_memory(rank)?),
        };
        Ok(Hosts {
            labels: all_gather_strings(&label, size)?,
            names: all_gather_strings(&name, size)?,
        })
    }
}

/// The lowest world rank of this rank's `MPI_COMM_TYPE_SHARED` communicator.
fn first_rank_sharing_memory(rank: usize) -> Result<usize, String> {
    // SAFETY: reading MPI's predefined handles; out-pointers are valid; the communicator
    // created here is freed before returning.
    unsafe {
        let mut shared: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
        let code = ffi::MPI_Comm_split_type(
            ffi::RSMPI_COMM_WORLD,
            ffi::RSMPI_COMM_TYPE_SHARED,
            rank as c_int,
            ffi::RSMPI_INFO_NULL,
            &mut shared,
        );
        if code != 0 {
            return Err(format!("MPI_Comm_split_type failed (MPI error {code})"));
        }
        let mine = rank as c_int;
        let mut first: c_int = mine;
        let code = ffi::MPI_Allreduce(
            (&mine as *const c_int).cast(),
            (&mut first as *mut c_int).cast(),
            1,
            ffi::RSMPI_INT32_T,
            ffi::RSMPI_MIN,
            shared,
        );
        ffi::MPI_Comm_free(&mut shared);
        if code != 0 {
            return Err(format!(
                "MPI_Allreduce on the shared-memory communicator failed (MPI error {code})"
            ));
        }
        Ok(first as usize)
    }
}

/// Sets up the failure monitor (see `mpi_monitor`): rank 0 starts the hub, its address
/// travels by `MPI_Bcast` — at initialisation, before anything can hang — and every rank
/// connects. On any problem the job runs without it (with a warning): timeouts still end a
/// stuck run, only without naming the missing ranks.
///
/// Ranks on rank 0's host connect over loopback. Others connect to rank 0's
/// `MESHTRAIN_HOST_ADDR` if it has one, else to its processor name: network namespaces on
/// one machine share one host name, which resolves to none of their addresses.
fn start_monitor(rank: usize, size: usize, hosts: Result<&Hosts, &String>) -> Option<Arc<Monitor>> {
    let warn = |what: String| {
        print_line(&format!(
            "warning: rank {rank}: {what}; the MPI backend runs without its failure \
             monitor (timeouts cannot name the missing ranks)"
        ));
    };
    let hosts = match hosts {
        Ok(hosts) => hosts,
        Err(e) => {
            warn(format!("finding the ranks' hosts failed: {e}"));
            return None;
        }
    };
    // One host: the hub listens on loopback only; otherwise on every interface.
    let single_host = hosts.labels.iter().all(|h| *h == hosts.labels[0]);
    // [port, token, IPv4 address of rank 0's host or 0]; port 0 = no hub.
    let mut endpoint = [0u64; 3];
    if rank == 0 {
        let token = mpi_monitor::random_token();
        let bind = if single_host {
            Ipv4Addr::LOCALHOST
        } else {
            Ipv4Addr::UNSPECIFIED
        };
        let advertised = match std::env::var(HOST_ADDR_ENV) {
            Ok(text) => match text.parse::<Ipv4Addr>() {
                Ok(addr) => u64::from(u32::from(addr)),
                Err(_) => {
                    warn(format!("{HOST_ADDR_ENV}='{text}' is not an IPv4 address"));
                    0
                }
            },
            Err(_) => 0,
        };
        match mpi_monitor::start_hub(bind.into(), size, token) {
            Ok(port) => endpoint = [u64::from(port), token, advertised],
            Err(e) => warn(format!("cannot start the failure monitor on {bind}: {e}")),
        }
    }
    // SAFETY: a 3-element u64 buffer on every rank; MPI is initialised.
    let code = unsafe {
        ffi::MPI_Bcast(
            endpoint.as_mut_ptr().cast(),
            3,
            ffi::RSMPI_UINT64_T,
            0,
            ffi::RSMPI_COMM_WORLD,
        )
    };
    if code != 0 {
        warn(format!(
            "broadcasting the monitor address failed (MPI error {code})"
        ));
        return None;
    }
    let [port, token, advertised] = endpoint;
    let port = u16::try_from(port).ok().filter(|&p| p != 0)?;
    let host = if hosts.labels[rank] == hosts.labels[0] {
        "127.0.0.1".to_string()
    } else if let Some(addr) = u32::try_from(advertised).ok().filter(|&a| a != 0) {
        Ipv4Addr::from(addr).to_string()
    } else {
        hosts.names[0].clone()
    };
    let addresses: Vec<SocketAddr> = match (host.as_str(), port).to_socket_addrs() {
        Ok(addresses) => addresses.collect(),
        Err(e) => {
            warn(format!("cannot resolve rank 0's host '{host}': {e}"));
            return None;
        }
    };
    match Monitor::connect(rank, &addresses, token) {
        Ok(monitor) => Some(monitor),
        Err(e) => {
            warn(format!(
                "cannot reach the failure monitor at {host}:{port}: {e}"
            ));
            None
        }
    }
}

/// Every rank's `mine` (at most 512 bytes), by rank.
fn all_gather_strings(mine: &str, size: usize) -> Result<Vec<String>, String> {
    const LEN: usize = 512;
    let mut padded = [0u8; LEN];
    let bytes = &mine.as_bytes()[..mine.len().min(LEN)];
    padded[..bytes.len()].copy_from_slice(bytes);
    let mut all = vec![0u8; LEN * size];
    // SAFETY: LEN bytes from every rank into a buffer of size × LEN.
    let code = unsafe {
        ffi::MPI_Allgather(
            padded.as_ptr().cast(),
            LEN as c_int,
            ffi::RSMPI_UINT8_T,
            all.as_mut_ptr().cast(),
            LEN as c_int,
            ffi::RSMPI_UINT8_T,
            ffi::RSMPI_COMM_WORLD,
        )
    };
    if code != 0 {
        return Err(format!(
            "MPI_Allgather of host names failed (MPI error {code})"
        ));
    }
    Ok(all
        .chunks_exact(LEN)
        .map(|name| {
            let end = name.iter().position(|&b| b == 0).unwrap_or(LEN);
            String::from_utf8_lossy(&name[..end]).into_owned()
        })
        .collect())
}

/// Tells the failure monitor about panics: the hook sends this rank's position and
/// the message, so that peers blocked on this rank fail at once with it. A panic
/// anywhere in an MPI rank is treated as fatal for the job.
fn install_panic_hook(monitor: &Arc<Monitor>) {
    let weak = Arc::downgrade(monitor);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        if let Some(monitor) = weak.upgrade() {
            monitor.report_panic(info);
        }
    }));
}

/// An initialised MPI environment. Create one per process, first thing in `main`;
/// MPI is finalised when it is dropped, so drop every group before it.
pub struct MpiWorld {
    shared: Arc<MpiShared>,
    /// The thread that moves buffered sends ([`SendQueue`]); joined before finalising.
    send_thread: Option<std::thread::JoinHandle<()>>,
    // Declared last: finalises MPI after the fields above are gone.
    _universe: Universe,
}

impl Drop for MpiWorld {
    /// Runs before `_universe` finalises MPI.
    fn drop(&mut self) {
        let shared = &self.shared;
        if std::thread::panicking() {
            // Finalising could block on peers that wait for this rank; they were told
            // by the panic hook and fail fast, and this ends the job if they do not.
            let message = shared
                .monitor
                .as_ref()
                .and_then(|m| m.panic_message())
                .unwrap_or_else(|| "see the panic message above".to_string());
            shared
                .watchdog
                .abort_job(&format!("panicked: {message}"), 101);
        }
        if shared.watchdog.aborting.load(Ordering::SeqCst) {
            // Another thread is ending the job (within `ABORT_GRACE`): finalising now
            // would pull MPI from under its `MPI_Abort`.
            loop {
                std::thread::park();
            }
        }
        shared.finish_sends(shared.config.timeout);
        if let Some(thread) = self.send_thread.take() {
            // No MPI call of its own may follow finalisation.
            let _ = thread.join();
        }
        if let Some(monitor) = &shared.monitor {
            monitor.exit();
            // `MPI_Finalize` waits for every rank; entering it while a peer aborts can
            // leave Open MPI's `mpirun` hung, so agree on the shutdown first.
            if let ShutdownAgreement::PeerFailed(why) =
                monitor.await_shutdown(shared.config.timeout)
            {
                shared.watchdog.abort_job(
                    &format!("cannot shut MPI down cleanly: {why}"),
                    WATCHDOG_EXIT_CODE,
                );
            }
        }
        // No abort after finalisation.
        shared.watchdog.stop();
    }
}

impl fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiWorld").finish_non_exhaustive()
    }
}

fn mpi_error(ctx: &OpContext, what: &str, code: c_int) -> CommError {
    CommError::Backend {
        ctx: ctx.clone(),
        details: format!("{what} returned MPI error code {code}"),
    }
}

fn check(ctx: &OpContext, what: &str, code: c_int) -> Result<(), CommError> {
    if code == 0 {
        Ok(())
    } else {
        Err(mpi_error(ctx, what, code))
    }
}

impl MpiWorld {
    /// Initialises MPI (asking for `MPI_THREAD_MULTIPLE`, so the per-rank
    /// communication thread can run async operations; with less, MPI calls are
    /// serialised by a lock).
    pub fn init(config: CommConfig) -> Result<MpiWorld, CommError> {
        let ctx = OpContext::new("init", 0, Arc::from("world"));
        let (universe, threading) =
            mpi::initialize_with_threading(Threading::Multiple).ok_or(CommError::Backend {
                ctx,
                details: "MPI was already initialised in this process".to_string(),
            })?;
        let lock = (threading < Threading::Multiple).then(|| Mutex::new(()));
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let hosts = Hosts::discover(rank, size);
        let monitor = start_monitor(rank, size, hosts.as_ref());
        let mut config = config;
        if let (HostPlacement::OneHost, Ok(hosts)) = (&config.hosts, &hosts) {
            config.hosts = HostPlacement::from_labels(&hosts.labels);
        }
        if let Some(monitor) = &monitor {
            install_panic_hook(monitor);
        }
        let shared = Arc::new(MpiShared {
            lock,
            config,
            watchdog: Watchdog::start(rank, monitor.clone()),
            monitor,
            group_instances: Mutex::new(HashMap::new()),
            sends: SendQueue::default(),
        });
        let sender = Arc::clone(&shared);
        let send_thread = std::thread::Builder::new()
            .name("comm-mpi-sends".to_string())
            .spawn(move || sender.run_sends())
            .map_err(|e| CommError::Backend {
                ctx: OpContext::new("init", 0, Arc::from("world")),
                details: format!("cannot start the thread that moves MPI sends: {e}"),
            })?;
        Ok(MpiWorld {
            shared,
            send_thread: Some(send_thread),
            _universe: universe,
        })
    }

    /// This process's group over all ranks of `MPI_COMM_WORLD` (a duplicate, so our
    /// traffic never mixes with other users of the world communicator).
    pub fn world_group(&self) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let ctx = OpContext::new("world_group", 0, Arc::from("world"));
        // SAFETY: reading MPI's predefined null handle.
        let mut comm: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: valid out-pointer; MPI is initialised.
        let code = self
            .shared
            .call(|| unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm) });
        check(&ctx, "MPI_Comm_dup", code)?;
        let group = MpiGroup::from_comm(
            Arc::clone(&self.shared),
            Comm(comm),
            "world".to_string(),
            None,
        )?;
        Ok(Arc::new(group))
    }

    /// Prints `error` (`error: rank R: …; aborting the MPI job`), tells the failure
    /// monitor — peers blocked on this rank then fail at once, saying `rank R failed:
    /// …` — and ends every process of the job with `code`. What a rank should do with
    /// any error it cannot recover from: returning would leave peers blocked.
    pub fn abort_with_error(&self, error: impl fmt::Display, code: i32) -> ! {
        let message = error.to_string();
        if let Some(monitor) = &self.shared.monitor {
            monitor.report_failure(&message);
        }
        self.shared.watchdog.abort_job(&message, code)
    }
}

/// One rank's view of an MPI communicator; what the communication thread needs.
struct MpiCore {
    shared: Arc<MpiShared>,
    comm: Comm,
    rank: usize,
    size: usize,
    name: Arc<str>,
    global_ranks: Vec<usize>,
    /// This rank's position in the group's collectives, for the failure monitor.
    track: Arc<GroupTrack>,
    broken: Mutex<Option<String>>,
    /// Fast check of `broken` on every operation.
    is_broken: AtomicBool,
}

fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading MPI's predefined datatype handles.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::BF16 | DType::F16 => ffi::RSMPI_UINT16_T,
        }
    }
}

fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading MPI's predefined operation handles.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Average => ffi::RSMPI_SUM,
            ReduceOp::Max => ffi::RSMPI_MAX,
        }
    }
}

fn count(ctx: &OpContext, len: usize) -> Result<c_int, CommError> {
    c_int::try_from(len).map_err(|_| CommError::InvalidBuffer {
        ctx: ctx.clone(),
        details: format!("{len} elements exceed MPI's int count"),
    })
}

/// Widens a buffer to f32 for reduction.
///
/// # Safety
/// `buf` must be valid for reads.
unsafe fn widen(buf: RawBuf) -> Vec<f32> {
    with_element!(buf.dtype, T => {
        std::slice::from_raw_parts(buf.ptr.cast::<T>(), buf.len)
            .iter()
            .map(|v| v.to_f32())
            .collect()
    })
}

/// Rounds `values` (divided by the group size first for averages) into `buf`.
///
/// # Safety
/// `buf` must be valid for writes and not accessed by anyone else.
unsafe fn narrow(values: &[f32], buf: RawBuf, op: ReduceOp, size: usize) {
    with_element!(buf.dtype, T => {
        let out = std::slice::from_raw_parts_mut(buf.ptr.cast::<T>(), buf.len);
        for (o, &v) in out.iter_mut().zip(values) {
            let v = if op == ReduceOp::Average { v / size as f32 } else { v };
            *o = T::from_f32(v);
        }
    })
}

/// Divides an f32 buffer by the group size (the second half of an average).
///
/// # Safety
/// `buf` must be an f32 view valid for writes and not accessed by anyone else.
unsafe fn divide_f32(buf: RawBuf, size: usize) {
    let values = std::slice::from_raw_parts_mut(buf.ptr.cast::<f32>(), buf.len);
    values.iter_mut().for_each(|v| *v /= size as f32);
}

impl Executor for MpiCore {
    fn group_name(&self) -> &Arc<str> {
        &self.name
    }

    unsafe fn execute(&self, op: Operation, seq: u64) -> Result<(), CommError> {
        MpiCore::execute(self, op, seq)
    }
}

impl MpiCore {
    fn fail(&self, err: CommError) -> CommError {
        let mut broken = self.broken.lock().unwrap_or_else(|e| e.into_inner());
        if broken.is_none() {
            *broken = Some(err.to_string());
        }
        self.is_broken.store(true, Ordering::SeqCst);
        err
    }

    /// Polls `request` until it completes or the timeout passes.
    fn wait_request(
        &self,
        ctx: &OpContext,
        mut request: ffi::MPI_Request,
    ) -> Result<(), CommError> {
        let timeout = self.shared.config.timeout;
        let deadline = Instant::now() + timeout;
        let mut polls = 0u32;
        loop {
            let mut flag: c_int = 0;
            // SAFETY: `request` is a live request from a nonblocking call.
            let code = self.shared.call(|| unsafe {
                ffi::MPI_Test(&mut request, &mut flag, ffi::RSMPI_STATUS_IGNORE)
            });
            check(ctx, "MPI_Test", code)?;
            if flag != 0 {
                return Ok(());
            }
            polls = polls.saturating_add(1);
            if polls.is_multiple_of(64) && Instant::now() >= deadline {
                return Err(self.fail(CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout,
                    missing: Vec::new(),
                    note: Box::default(),
                }));
            }
            if polls > 1024 {
                std::thread::sleep(Duration::from_micros(50));
            } else if polls > 64 {
                std::thread::yield_now();
            }
        }
    }

    /// Runs a blocking MPI collective under the watchdog: MPI's blocking collectives
    /// are its fast, tuned ones (the nonblocking `MPI_I*` versions measured 2-5x
    /// slower here), but they cannot return on a timeout — so if the call outlives
    /// the timeout, the watchdog reports it and aborts the job.
    fn run_blocking(
        &self,
        ctx: &OpContext,
        what: &str,
        call: impl FnOnce() -> c_int,
    ) -> Result<(), CommError> {
        // A peer known to have stopped would block this call forever: fail before it.
        if let Some(err) = self.shared.peer_failure(ctx, &self.track) {
            return Err(self.fail(err));
        }
        let _guard = self
            .shared
            .watchdog
            .watch(ctx, self.shared.config.timeout, &self.track);
        let code = self.shared.call(call);
        check(ctx, what, code)
    }

    /// Exchanges fingerprints and fails on any mismatch (the optional desync check).
    fn check_fingerprint(&self, ctx: &OpContext, mine: Fingerprint) -> Result<(), CommError> {
        let words = mine.to_words();
        let mut all = vec![0u64; words.len() * self.size];
        // SAFETY: buffers sized for `size` × 5 u64 and alive until the wait returns.
        self.run_blocking(ctx, "MPI_Allgather", || unsafe {
            ffi::MPI_Allgather(
                words.as_ptr().cast(),
                words.len() as c_int,
                ffi::RSMPI_UINT64_T,
                all.as_mut_ptr().cast(),
                words.len() as c_int,
                ffi::RSMPI_UINT64_T,
                self.comm.0,
            )
        })?;
        let prints: Vec<Fingerprint> = all
            .chunks_exact(5)
            .map(|c| Fingerprint::from_words([c[0], c[1], c[2], c[3], c[4]]))
            .collect();
        if prints.iter().all(|f| *f == mine) {
            return Ok(());
        }
        let details = prints
            .iter()
            .enumerate()
            .map(|(r, f)| format!("rank {}: {}", self.global_ranks[r], f.describe()))
            .collect::<Vec<_>>()
            .join("; ");
        Err(self.fail(CommError::Desync {
            ctx: ctx.clone(),
            details,
        }))
    }

    /// Runs one operation on the calling thread.
    ///
    /// # Safety
    /// As for [`ProcessGroup::run_raw`].
    unsafe fn execute(&self, op: Operation, seq: u64) -> Result<(), CommError> {
        let ctx = self.ctx(&op, seq);
        if self.is_broken.load(Ordering::Acquire) {
            let cause = self
                .broken
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_default();
            return Err(CommError::Broken { ctx, cause });
        }
        if let Some(failure) = self.shared.send_failure() {
            return Err(self.fail(CommError::Backend {
                ctx,
                details: failure,
            }));
        }
        let _position = op.is_collective().then(|| self.track.enter(op.name(), seq));
        if op.is_collective() && self.shared.config.check_desync {
            self.check_fingerprint(&ctx, op.fingerprint(seq))?;
        }
        let comm = self.comm.0;
        match op {
            Operation::AllReduce { buf, op: reduce } => {
                let n = count(&ctx, buf.len)?;
                if buf.dtype == DType::F32 {
                    self.run_blocking(&ctx, "MPI_Allreduce", || {
                        ffi::MPI_Allreduce(
                            MPI_IN_PLACE,
                            buf.ptr.cast(),
                            n,
                            ffi::RSMPI_FLOAT,
                            mpi_op(reduce),
                            comm,
                        )
                    })?;
                    if reduce == ReduceOp::Average {
                        divide_f32(buf, self.size);
                    }
                } else {
                    let mut wide = widen(buf);
                    self.run_blocking(&ctx, "MPI_Allreduce", || {
                        ffi::MPI_Allreduce(
                            MPI_IN_PLACE,
                            wide.as_mut_ptr().cast(),
                            n,
                            ffi::RSMPI_FLOAT,
                            mpi_op(reduce),
                            comm,
                        )
                    })?;
                    narrow(&wide, buf, reduce, self.size);
                }
            }
            Operation::ReduceScatter {
                input,
                output,
                op: reduce,
            } => {
                let n = count(&ctx, output.len)?;
                // Widen halves to f32; copy f32 input only if it overlaps the output
                // (MPI forbids aliasing send and receive buffers).
                let needs_copy = input.dtype != DType::F32 || input.overlaps(&output);
                let wide_in = if needs_copy { widen(input) } else { Vec::new() };
                let send: *const c_void = if needs_copy {
                    wide_in.as_ptr().cast()
                } else {
                    input.ptr.cast_const().cast()
                };
                let mut wide_out = if output.dtype == DType::F32 {
                    Vec::new()
                } else {
                    vec![0f32; output.len]
                };
                let recv: *mut c_void = if output.dtype == DType::F32 {
                    output.ptr.cast()
                } else {
                    wide_out.as_mut_ptr().cast()
                };
                self.run_blocking(&ctx, "MPI_Reduce_scatter_block", || {
                    ffi::MPI_Reduce_scatter_block(
                        send,
                        recv,
                        n,
                        ffi::RSMPI_FLOAT,
                        mpi_op(reduce),
                        comm,
                    )
                })?;
                if output.dtype == DType::F32 {
                    if reduce == ReduceOp::Average {
                        divide_f32(output, self.size);
                    }
                } else {
                    narrow(&wide_out, output, reduce, self.size);
                }
            }
            Operation::AllGather { input, output } => {
                let n = count(&ctx, input.len)?;
                let copy = if input.overlaps(&output) {
                    std::slice::from_raw_parts(input.ptr, input.size_bytes()).to_vec()
                } else {
                    Vec::new()
                };
                let send: *const c_void = if input.overlaps(&output) {
                    copy.as_ptr().cast()
                } else {
                    input.ptr.cast_const().cast()
                };
                let dt = datatype(input.dtype);
                self.run_blocking(&ctx, "MPI_Allgather", || {
                    ffi::MPI_Allgather(send, n, dt, output.ptr.cast(), n, dt, comm)
                })?;
            }
            Operation::AllToAll { input, output } => {
                // `validate` guarantees equal lengths, a multiple of the group size, and
                // no overlap (MPI forbids aliasing send and receive buffers).
                let per_rank = count(&ctx, input.len / self.size)?;
                let dt = datatype(input.dtype);
                self.run_blocking(&ctx, "MPI_Alltoall", || {
                    ffi::MPI_Alltoall(
                        input.ptr.cast_const().cast(),
                        per_rank,
                        dt,
                        output.ptr.cast(),
                        per_rank,
                        dt,
                        comm,
                    )
                })?;
            }
            Operation::Broadcast { buf, root } => {
                let n = count(&ctx, buf.len)?;
                self.run_blocking(&ctx, "MPI_Bcast", || {
                    ffi::MPI_Bcast(buf.ptr.cast(), n, datatype(buf.dtype), root as c_int, comm)
                })?;
            }
            Operation::Barrier => {
                self.run_blocking(&ctx, "MPI_Barrier", || ffi::MPI_Barrier(comm))?;
            }
            Operation::Send { buf, dst, tag } => self.send(&ctx, buf, dst, tag)?,
            Operation::Recv { buf, src, tag } => self.recv(&ctx, buf, src, tag)?,
        }
        Ok(())
    }

    fn check_tag(&self, ctx: &OpContext, tag: u32) -> Result<c_int, CommError> {
        if tag > MAX_TAG {
            return Err(CommError::InvalidRank {
                ctx: ctx.clone(),
                details: format!("tag {tag} exceeds the MPI backend's maximum {MAX_TAG}"),
            });
        }
        Ok(tag as c_int)
    }

    /// Buffered send: copies the data and lets MPI deliver it in the background, so a
    /// send never waits for the matching receive (as in the threads backend).
    ///
    /// # Safety
    /// `buf` must be valid for reads during the call.
    unsafe fn send(
        &self,
        ctx: &OpContext,
        buf: RawBuf,
        dst: usize,
        tag: u32,
    ) -> Result<(), CommError> {
        let tag = self.check_tag(ctx, tag)?;
        let bytes = std::slice::from_raw_parts(buf.ptr, buf.size_bytes()).to_vec();
        let n = count(ctx, bytes.len())?;
        let mut request: ffi::MPI_Request = ffi::RSMPI_REQUEST_NULL;
        let code = self.shared.call(|| {
            ffi::MPI_Isend(
                bytes.as_ptr().cast(),
                n,
                ffi::RSMPI_UINT8_T,
                dst as c_int,
                tag,
                self.comm.0,
                &mut request,
            )
        });
        check(ctx, "MPI_Isend", code)?;
        self.shared.queue_send(request, bytes);
        Ok(())
    }

    /// Matched receive with a size check.
    ///
    /// # Safety
    /// `buf` must be valid for writes and not accessed by anyone else during the call.
    unsafe fn recv(
        &self,
        ctx: &OpContext,
        buf: RawBuf,
        src: usize,
        tag: u32,
    ) -> Result<(), CommError> {
        let tag = self.check_tag(ctx, tag)?;
        let timeout = self.shared.config.timeout;
        let deadline = Instant::now() + timeout;
        let mut message: ffi::MPI_Message = ffi::RSMPI_MESSAGE_NULL;
        let mut status: ffi::MPI_Status = std::mem::zeroed();
        let mut polls = 0u32;
        let mut peer_stopped_at: Option<Instant> = None;
        loop {
            let mut flag: c_int = 0;
            let code = self.shared.call(|| {
                ffi::MPI_Improbe(
                    src as c_int,
                    tag,
                    self.comm.0,
                    &mut flag,
                    &mut message,
                    &mut status,
                )
            });
            check(ctx, "MPI_Improbe", code)?;
            if flag != 0 {
                break;
            }
            polls = polls.saturating_add(1);
            if polls.is_multiple_of(64) {
                let global_src = self.global_ranks[src];
                if let Some(reason) = self
                    .shared
                    .monitor
                    .as_ref()
                    .and_then(|m| m.stopped_rank(global_src))
                {
                    // Messages the peer sent just before it stopped may still be on
                    // their way: keep probing a little before giving up on it.
                    let since = *peer_stopped_at.get_or_insert_with(Instant::now);
                    if since.elapsed() >= STOPPED_PEER_GRACE {
                        return Err(CommError::PeerFailed {
                            ctx: ctx.clone(),
                            missing: vec![global_src],
                            reason: format!("{reason} (no message with tag {tag} arrived)"),
                        });
                    }
                }
                if Instant::now() >= deadline {
                    return Err(CommError::Timeout {
                        ctx: ctx.clone(),
                        timeout,
                        missing: vec![global_src],
                        note: Box::default(),
                    });
                }
            }
            if polls > 1024 {
                std::thread::sleep(Duration::from_micros(50));
            } else if polls > 64 {
                std::thread::yield_now();
            }
        }
        let mut bytes: c_int = 0;
        let code = self
            .shared
            .call(|| ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut bytes));
        check(ctx, "MPI_Get_count", code)?;
        let expected = buf.size_bytes();
        let mismatch = bytes as usize != expected;
        // On a size mismatch, receive into a scratch buffer so that the message is
        // consumed and the caller's buffer is never overrun.
        let mut scratch = Vec::new();
        let target: *mut c_void = if mismatch {
            scratch.resize(bytes as usize, 0u8);
            scratch.as_mut_ptr().cast()
        } else {
            buf.ptr.cast()
        };
        let mut request: ffi::MPI_Request = ffi::RSMPI_REQUEST_NULL;
        let code = self.shared.call(|| {
            ffi::MPI_Imrecv(
                target,
                bytes,
                ffi::RSMPI_UINT8_T,
                &mut message,
                &mut request,
            )
        });
        check(ctx, "MPI_Imrecv", code)?;
        self.wait_request(ctx, request)?;
        if mismatch {
            return Err(CommError::InvalidBuffer {
                ctx: ctx.clone(),
                details: format!(
                    "message from rank {src} (tag {tag}) has {bytes} bytes but the receive buffer is {}×{} ({expected} bytes)",
                    buf.dtype, buf.len
                ),
            });
        }
        Ok(())
    }
}

impl Drop for MpiCore {
    fn drop(&mut self) {
        let mut finalized: c_int = 0;
        // SAFETY: MPI_Finalized may be called at any time.
        unsafe { ffi::MPI_Finalized(&mut finalized) };
        if finalized != 0 {
            return;
        }
        // Sends still in flight on this communicator complete after it is freed (MPI
        // frees it once they are done); the send thread owns their copies.
        let mut comm = self.comm.0;
        // SAFETY: the communicator was created by us and is freed once.
        self.shared
            .call(|| unsafe { ffi::MPI_Comm_free(&mut comm) });
    }
}

/// One rank's handle on an MPI group.
pub struct MpiGroup {
    core: Arc<MpiCore>,
    sequence: Sequencer,
    engine: AsyncEngine,
}

impl fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiGroup")
            .field("name", &self.core.name)
            .field("rank", &self.core.rank)
            .field("size", &self.core.size)
            .finish()
    }
}

/// A member's view, through the failure monitor, of its group's positions in a companion
/// engine's collectives (NCCL's, whose kernels cannot say who never came): the hub hears
/// every member's issued position and how each stopped, whatever state NCCL is in.
struct MonitorBoard {
    monitor: Arc<Monitor>,
    track: Arc<GroupTrack>,
}

impl PositionBoard for MonitorBoard {
    fn issued(&self, op: &'static str, seq: u64) {
        self.track.issued(op, seq);
    }

    fn missing(&self, seq: u64) -> Option<MissingMembers> {
        (self.monitor.stopped_peers(&self.track, seq))
            .or_else(|| self.monitor.missing_ranks(&self.track, seq))
    }

    fn stopped(&self, seq: Option<u64>) -> Option<MissingMembers> {
        self.monitor.stopped_members(&self.track, seq)
    }
}

impl MpiGroup {
    fn from_comm(
        shared: Arc<MpiShared>,
        comm: Comm,
        name: String,
        global_ranks: Option<Vec<usize>>,
    ) -> Result<MpiGroup, CommError> {
        let ctx = OpContext::new("new_group", 0, Arc::from(name.as_str()));
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: valid communicator and out-pointers.
        let code = shared.call(|| unsafe { ffi::MPI_Comm_rank(comm.0, &mut rank) });
        check(&ctx, "MPI_Comm_rank", code)?;
        // SAFETY: as above.
        let code = shared.call(|| unsafe { ffi::MPI_Comm_size(comm.0, &mut size) });
        check(&ctx, "MPI_Comm_size", code)?;
        let (rank, size) = (rank as usize, size as usize);
        let global_ranks = global_ranks.unwrap_or_else(|| (0..size).collect());
        let thread_name = format!("comm-{name}-r{}", global_ranks[rank]);
        let track = shared.new_track(&name, global_ranks.clone());
        Ok(MpiGroup {
            core: Arc::new(MpiCore {
                shared,
                comm,
                rank,
                size,
                name: Arc::from(name.as_str()),
                global_ranks,
                track,
                broken: Mutex::new(None),
                is_broken: AtomicBool::new(false),
            }),
            sequence: Sequencer::new(size),
            engine: AsyncEngine::new(thread_name),
        })
    }

    fn prepare(&self, op: &Operation) -> Result<u64, CommError> {
        let seq = self.sequence.assign(op);
        let ctx = self.core.ctx(op, seq);
        op.validate(&ctx, self.core.rank, self.core.size)?;
        op.require_host(&ctx)?;
        Ok(seq)
    }
}

impl ProcessGroup for MpiGroup {
    fn rank(&self) -> usize {
        self.core.rank
    }

    fn size(&self) -> usize {
        self.core.size
    }

    fn name(&self) -> &str {
        &self.core.name
    }

    fn global_ranks(&self) -> &[usize] {
        &self.core.global_ranks
    }

    fn config(&self) -> &CommConfig {
        &self.core.shared.config
    }

    unsafe fn run_raw(&self, op: Operation) -> Result<(), CommError> {
        let seq = self.prepare(&op);
        self.engine.run(&self.core, op, seq)
    }

    fn position_board(&self, name: &str) -> Option<Arc<dyn PositionBoard>> {
        let shared = &self.core.shared;
        let monitor = Arc::clone(shared.monitor.as_ref()?);
        let track = shared.new_track(name, self.core.global_ranks.clone());
        Some(Arc::new(MonitorBoard { monitor, track }))
    }

    unsafe fn start_raw(&self, op: Operation) -> Result<Work, CommError> {
        let seq = self.prepare(&op);
        self.engine.start(&self.core, op, seq)
    }

    /// Uses `MPI_Comm_create_group`, which only the members call.
    fn new_named_subgroup(
        &self,
        ranks: &[usize],
        name: &str,
    ) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let ctx = OpContext::new("new_subgroup", 0, Arc::clone(&self.core.name));
        validate_subgroup(&ctx, ranks, self.core.rank, self.core.size)?;
        // Let queued async work finish first: creation is a blocking MPI call.
        self.engine.drain();
        let members: Vec<c_int> = ranks.iter().map(|&r| r as c_int).collect();
        let shared = &self.core.shared;
        let comm = self.core.comm.0;
        // SAFETY: valid handles and out-pointers; both groups are freed below.
        let new_comm = unsafe {
            let mut parent_group: ffi::MPI_Group = std::mem::zeroed();
            let code = shared.call(|| ffi::MPI_Comm_group(comm, &mut parent_group));
            check(&ctx, "MPI_Comm_group", code)?;
            let mut sub_group: ffi::MPI_Group = std::mem::zeroed();
            let code = shared.call(|| {
                ffi::MPI_Group_incl(
                    parent_group,
                    members.len() as c_int,
                    members.as_ptr(),
                    &mut sub_group,
                )
            });
            check(&ctx, "MPI_Group_incl", code)?;
            let mut new_comm: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
            let code =
                shared.call(|| ffi::MPI_Comm_create_group(comm, sub_group, 0, &mut new_comm));
            shared.call(|| {
                ffi::MPI_Group_free(&mut sub_group);
                ffi::MPI_Group_free(&mut parent_group);
            });
            check(&ctx, "MPI_Comm_create_group", code)?;
            new_comm
        };
        let globals = ranks.iter().map(|&r| self.core.global_ranks[r]).collect();
        let group = MpiGroup::from_comm(
            Arc::clone(shared),
            Comm(new_comm),
            name.to_string(),
            Some(globals),
        )?;
        Ok(Arc::new(group))
    }
}

/// `meshtrain bench collectives --backend mpi`, under `mpirun -np N`: our MPI
/// backend's collectives and, for all-reduce, raw `MPI_Allreduce` on the same sizes.
pub fn run_bench_mpi(args: &BenchCollectivesArgs) -> Result<()> {
    let world = MpiWorld::init(
        CommConfig::default()
            .with_desync_check(false)
            .with_ranks_per_host(args.ranks_per_host),
    )?;
    let result = bench_on_world(&world, args);
    if let Err(e) = &result {
        world.abort_with_error(format_args!("{e:#}"), 1);
    }
    result
}

fn bench_on_world(world: &MpiWorld, args: &BenchCollectivesArgs) -> Result<()> {
    let group = world.world_group()?;
    let (sizes, memcpy) = sizes_and_memcpy(args)?;
    let lead = group.rank() == 0;
    if lead {
        if args.hierarchical {
            println!("{}", describe_hosts(group.as_ref()));
        }
        print_header();
    }
    if args.hierarchical {
        // Size by size, so the rows appear as they are measured.
        for (i, &bytes) in sizes.iter().enumerate() {
            let rows = compare_hierarchical(&group, "mpi", &[bytes], &memcpy[i..], args)?;
            if lead {
                report_comparison(&rows, args.rounds, args.json.as_ref())?;
            }
        }
        return Ok(());
    }
    for &op in &args.ops {
        // Size by size, our call then the raw MPI call, so both see the same load.
        for (i, &bytes) in sizes.iter().enumerate() {
            let mine = bench_group(group.as_ref(), "mpi", op, &[bytes], &memcpy[i..], args)?;
            if lead {
                report(&mine[0], args.json.as_ref())?;
            }
            if op == BenchOp::AllReduce && args.raw_mpi {
                let raw = raw_allreduce_rows(group.as_ref(), &[bytes], &memcpy[i..], args)?;
                if lead {
                    report(&raw[0], args.json.as_ref())?;
                    println!(
                        "{:>60} mpi/raw time ratio {:.3}",
                        "",
                        mine[0].time_us / raw[0].time_us
                    );
                }
            }
        }
    }
    Ok(())
}

/// Raw blocking `MPI_Allreduce` (in place, f32, sum) on the world communicator,
/// timed exactly like our backend's all-reduce.
fn raw_allreduce_rows(
    group: &dyn ProcessGroup,
    sizes: &[usize],
    memcpy: &[f64],
    args: &BenchCollectivesArgs,
) -> Result<Vec<BenchRecord>> {
    let mut rows = Vec::new();
    for (&bytes, &memcpy_gbps) in sizes.iter().zip(memcpy) {
        let elems = (bytes / 4).max(1);
        let mut buf = vec![1.0f32; elems];
        let n = c_int::try_from(elems).map_err(|_| anyhow!("size too large for MPI"))?;
        let (iters, seconds) = time_collective(group, args, &mut || {
            // SAFETY: in-place all-reduce on a live buffer of `n` floats.
            let code = unsafe {
                ffi::MPI_Allreduce(
                    MPI_IN_PLACE,
                    buf.as_mut_ptr().cast(),
                    n,
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_SUM,
                    ffi::RSMPI_COMM_WORLD,
                )
            };
            if code != 0 {
                return Err(anyhow!("MPI_Allreduce returned {code}"));
            }
            Ok(())
        })?;
        rows.push(record(
            "mpi-raw",
            BenchOp::AllReduce,
            group.size(),
            elems * 4,
            iters,
            seconds,
            memcpy_gbps,
        ));
    }
    Ok(rows)
}

/// The position in its group's collectives that the failure monitor compares with where each
/// rank was last seen: a collective's number, and 0 for a send or receive (numbered among
/// its peer's messages, not the group's collectives).
fn collective_number(ctx: &OpContext) -> u64 {
    if ctx.peer.is_some() {
        0
    } else {
        ctx.seq
    }
}
