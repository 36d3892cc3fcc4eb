//! Failure monitor of the MPI backend: a TCP side channel that works whatever state
//! MPI is in.
//!
//! A rank blocked in an MPI collective cannot learn which peers it waits for, and a
//! peer that panics, is killed or shuts down early simply never arrives (until
//! `mpirun` notices a dead process and ends the job with its own message, naming no
//! operation). So every rank also talks to a small hub on rank 0 over plain TCP
//! (std only: no MPI progress, no extra dependency):
//!
//! * **Position.** For each group, the last collective the rank entered (op, sequence
//!   number) and whether it has left it. The rank's monitor thread sends changes every
//!   [`REPORT_INTERVAL`]; collectives only update an uncontended mutex, because a
//!   socket write per collective would cost as much as a small MPI all-reduce.
//! * **Heartbeat.** With nothing to report a rank still sends `beat` every
//!   [`BEAT_INTERVAL`]. A stopped (SIGSTOP) or cut-off rank keeps its socket open, so it
//!   never "dies" for the hub; its silence ([`SILENT_AFTER`]) names it instead, even when it
//!   had already entered the collective the others time out in.
//! * **How it stopped.** `panicked` (from the panic hook, after sending the exact
//!   position), `failed` (an error given to `MpiWorld::abort_with_error`), `exited`
//!   (clean shutdown, acknowledged by the hub). A connection that closes without one
//!   of these is a rank that died (killed, crashed): the kernel closes a dead
//!   process's sockets, so the hub learns it at once.
//!
//! * **Shutdown agreement.** A rank that shuts down cleanly does not enter
//!   `MPI_Finalize` (which waits for every rank) until the hub says every rank has
//!   exited; if a peer fails instead, it aborts. With Open MPI 4, a rank waiting inside
//!   `MPI_Finalize` while its peers call `MPI_Abort` can leave `mpirun` hanging or
//!   crashing instead of ending the job.
//!
//! The hub tells every rank as soon as a peer stopped, so ranks blocked on that peer
//! fail fast instead of waiting for the timeout; a rank whose collective timed out
//! asks the hub which members had not reached that collective and where they were
//! last seen.
//!
//! Protocol: one message per line, fields separated by tabs (names and messages
//! have tabs and line breaks replaced by spaces, see [`field`]).
//!
//! ```text
//! rank → hub   hello TOKEN RANK | group ID KEY NAME | at ID OP SEQ DONE
//!              panicked MSG | failed MSG | exited | query QID KEY | beat
//! hub → rank   stopped RANK KIND DESCRIPTION (KEY SEQ)*    (to every rank)
//!              reply QID (RANK SEQ NOTE)* | bye | all-exited
//! ```

use crate::group::MissingMembers;
use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::panic::PanicHookInfo;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// How a timeout note begins when every member of the group entered the operation.
pub(crate) const ALL_ENTERED: &str = "all members entered it";

/// How often a rank's position changes reach the hub, so how stale the "last seen"
/// position of a killed rank may be.
const REPORT_INTERVAL: Duration = Duration::from_millis(20);
/// A rank with nothing to report still tells the hub it is alive this often. A process
/// that is stopped (SIGSTOP, a debugger) or cut off (its host's link went down) keeps its
/// socket open, so only its silence tells the hub it is gone.
const BEAT_INTERVAL: Duration = Duration::from_millis(200);
/// Silence after which the hub calls a connected rank unresponsive in its answers.
const SILENT_AFTER: Duration = Duration::from_millis(1500);
/// How the hub's note on an unresponsive rank begins.
const SILENT_NOTE: &str = "has sent nothing for";
/// Longest wait for the hub's answer to a query or to `exited`. A timed-out
/// collective spends at most this on top of its timeout before the job is aborted.
const REPLY_WAIT: Duration = Duration::from_millis(300);
/// Bound on connecting, on the hello and on every write: a stuck hub or peer must
/// not block a rank (or the hub) for long.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest line accepted; anything longer is a broken or foreign peer.
const MAX_LINE: usize = 1 << 20;
/// Name of each rank's monitor thread (the panic hook must not wait on locks this
/// thread might hold if it is the one panicking).
const MONITOR_THREAD: &str = "comm-mpi-monitor";

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes any text fit in one protocol field.
fn field(text: &str) -> String {
    text.replace(['\t', '\n', '\r'], " ")
}

/// A random token the hub requires in every hello, so that a stray connection to the
/// hub's port cannot pose as a rank.
pub(crate) fn random_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hasher.write_u128(now);
    hasher.write_u32(std::process::id());
    hasher.finish()
}

/// One rank's progress through the collectives of one group.
pub(crate) struct GroupTrack {
    /// The same on every member: sanitised name, global members, and how many groups
    /// with this name and these members the rank created before (members create
    /// sub-groups in the same order, so the count matches too).
    key: String,
    name: String,
    members: Vec<usize>,
    position: Mutex<Position>,
}

#[derive(Clone, Copy, Default)]
struct Position {
    op: &'static str,
    seq: u64,
    done: bool,
    /// Bumped on every change, so the monitor thread sends only changes.
    version: u64,
}

impl GroupTrack {
    pub(crate) fn new(name: &str, members: Vec<usize>, instance: usize) -> GroupTrack {
        let name = field(name);
        let member_list: Vec<String> = members.iter().map(|r| r.to_string()).collect();
        GroupTrack {
            key: format!("{name}|{}|{instance}", member_list.join(",")),
            name,
            members,
            position: Mutex::new(Position::default()),
        }
    }

    /// Records issuing collective `seq` of a companion engine (NCCL): entered, and left
    /// only by the next one, as the host cannot see the GPU finish it.
    pub(crate) fn issued(&self, op: &'static str, seq: u64) {
        let mut position = lock(&self.position);
        *position = Position {
            op,
            seq,
            done: false,
            version: position.version + 1,
        };
    }

    /// Records entering collective `seq`; dropping the guard records leaving it.
    pub(crate) fn enter(&self, op: &'static str, seq: u64) -> LeaveOnDrop<'_> {
        let mut position = lock(&self.position);
        *position = Position {
            op,
            seq,
            done: false,
            version: position.version + 1,
        };
        LeaveOnDrop { track: self }
    }
}

/// Marks the collective entered with [`GroupTrack::enter`] as left.
pub(crate) struct LeaveOnDrop<'a> {
    track: &'a GroupTrack,
}

impl Drop for LeaveOnDrop<'_> {
    fn drop(&mut self) {
        let mut position = lock(&self.track.position);
        position.done = true;
        position.version += 1;
    }
}

/// How a rank stopped taking part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StopKind {
    /// Shut MPI down cleanly (`MpiWorld` dropped).
    Exited,
    Panicked,
    /// Gave up after an error (`MpiWorld::abort_with_error`).
    Failed,
    /// Its connection closed without any of the above: killed or crashed.
    Died,
}

impl StopKind {
    fn as_str(self) -> &'static str {
        match self {
            StopKind::Exited => "exited",
            StopKind::Panicked => "panicked",
            StopKind::Failed => "failed",
            StopKind::Died => "died",
        }
    }

    fn parse(text: &str) -> Option<StopKind> {
        [
            StopKind::Exited,
            StopKind::Panicked,
            StopKind::Failed,
            StopKind::Died,
        ]
        .into_iter()
        .find(|kind| kind.as_str() == text)
    }
}

/// A peer that stopped, as the hub described it.
struct Stopped {
    kind: StopKind,
    /// `died (…); last seen in all_reduce #3 on group 'world'` (without "rank N").
    description: String,
    /// Last sequence number the peer entered, per group key.
    reached: HashMap<String, u64>,
}

/// What the hub knows about one rank, in answer to a query about one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerReport {
    pub(crate) rank: usize,
    /// Last sequence number of the queried group the rank entered (0: none).
    pub(crate) reached: u64,
    /// Where it was last seen, or how it stopped.
    pub(crate) note: String,
}

#[derive(Default)]
struct PeerView {
    stopped: HashMap<usize, Stopped>,
    replies: HashMap<u64, Vec<PeerReport>>,
    next_query: u64,
    bye: bool,
    /// Every rank of the job has exited cleanly (the hub's `all-exited`).
    all_exited: bool,
    hub_lost: bool,
}

/// How the wait for the other ranks' clean shutdown ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ShutdownAgreement {
    /// Every rank exited cleanly: finalising MPI is safe.
    AllExited,
    /// A peer stopped without a clean exit (`rank 3 failed: …`): the job is ending
    /// with an abort, so this rank must not finalise.
    PeerFailed(String),
    /// Neither within the wait (or the hub is unreachable): finalise as plain MPI would.
    Undecided,
}

/// A group whose position this rank reports, and the last version sent (`None`:
/// the group itself is not announced yet).
struct Reported {
    track: Arc<GroupTrack>,
    sent: Option<u64>,
}

/// One rank's connection to the hub.
pub(crate) struct Monitor {
    rank: usize,
    writer: Mutex<TcpStream>,
    tracks: Mutex<Vec<Reported>>,
    view: Mutex<PeerView>,
    answered: Condvar,
    /// Fast path of every collective: nothing to check until a peer stopped.
    any_stopped: AtomicBool,
    /// Called when a peer stopped (wakes the watchdog of blocked collectives).
    waker: OnceLock<Box<dyn Fn() + Send + Sync>>,
    panic_message: Mutex<Option<String>>,
    /// When this rank last wrote to the hub (for the heartbeat).
    last_write: Mutex<Instant>,
}

impl fmt::Debug for Monitor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Monitor")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

fn is_timeout(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Splits a TCP stream into lines, keeping a partial line across read timeouts.
struct LineReader {
    stream: TcpStream,
    pending: Vec<u8>,
}

impl LineReader {
    fn new(stream: TcpStream) -> LineReader {
        LineReader {
            stream,
            pending: Vec::new(),
        }
    }

    /// The next complete line (without the newline); `Ok(None)` at end of stream; a
    /// read timeout is an error for which [`is_timeout`] holds.
    fn next_line(&mut self) -> io::Result<Option<String>> {
        loop {
            if let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                return Ok(Some(String::from_utf8_lossy(&line[..end]).into_owned()));
            }
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk)?;
            if n == 0 {
                return Ok(None);
            }
            self.pending.extend_from_slice(&chunk[..n]);
            if self.pending.len() > MAX_LINE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "monitor line too long",
                ));
            }
        }
    }
}

fn parse<T: std::str::FromStr>(text: Option<&&str>) -> Option<T> {
    text.and_then(|t| t.parse().ok())
}

impl Monitor {
    /// Connects to the hub (the first of `addresses` that answers) and starts this
    /// rank's monitor thread.
    pub(crate) fn connect(
        rank: usize,
        addresses: &[SocketAddr],
        token: u64,
    ) -> io::Result<Arc<Monitor>> {
        let mut last_error =
            io::Error::new(io::ErrorKind::NotFound, "no address for the monitor hub");
        let mut connected = None;
        for address in addresses {
            match TcpStream::connect_timeout(address, IO_TIMEOUT) {
                Ok(stream) => {
                    connected = Some(stream);
                    break;
                }
                Err(e) => last_error = e,
            }
        }
        let mut stream = connected.ok_or(last_error)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        stream.write_all(format!("hello\t{token}\t{rank}\n").as_bytes())?;
        let reader = stream.try_clone()?;
        reader.set_read_timeout(Some(REPORT_INTERVAL))?;
        let monitor = Arc::new(Monitor {
            rank,
            writer: Mutex::new(stream),
            tracks: Mutex::new(Vec::new()),
            view: Mutex::new(PeerView::default()),
            answered: Condvar::new(),
            any_stopped: AtomicBool::new(false),
            waker: OnceLock::new(),
            panic_message: Mutex::new(None),
            last_write: Mutex::new(Instant::now()),
        });
        let weak = Arc::downgrade(&monitor);
        std::thread::Builder::new()
            .name(MONITOR_THREAD.to_string())
            .spawn(move || run_monitor_thread(&weak, LineReader::new(reader)))?;
        Ok(monitor)
    }

    /// Sets what to call when a peer stopped (once).
    pub(crate) fn set_waker(&self, waker: Box<dyn Fn() + Send + Sync>) {
        let _ = self.waker.set(waker);
    }

    /// Reports this group's position from now on.
    pub(crate) fn register(&self, track: Arc<GroupTrack>) {
        lock(&self.tracks).push(Reported { track, sent: None });
    }

    /// Sends new groups and changed positions, then `message` (may be empty). The
    /// position lock is held until written, so that a message always follows the
    /// positions it depends on (a monitor thread's flush cannot be overtaken).
    fn flush_then(&self, message: &str) {
        let mut tracks = lock(&self.tracks);
        let mut text = String::new();
        for (id, reported) in tracks.iter_mut().enumerate() {
            let track = &reported.track;
            if reported.sent.is_none() {
                text.push_str(&format!("group\t{id}\t{}\t{}\n", track.key, track.name));
                reported.sent = Some(0);
            }
            let position = *lock(&track.position);
            if reported.sent != Some(position.version) {
                text.push_str(&format!(
                    "at\t{id}\t{}\t{}\t{}\n",
                    position.op,
                    position.seq,
                    u8::from(position.done)
                ));
                reported.sent = Some(position.version);
            }
        }
        text.push_str(message);
        let mut last_write = lock(&self.last_write);
        if text.is_empty() && last_write.elapsed() >= BEAT_INTERVAL {
            text.push_str("beat\n");
        }
        if !text.is_empty() {
            // A failed write means the hub is gone; the monitor thread notices that.
            let _ = lock(&self.writer).write_all(text.as_bytes());
            *last_write = Instant::now();
        }
        drop(last_write);
        drop(tracks);
    }

    fn handle(&self, line: &str) {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields[0] {
            "stopped" => {
                let (Some(rank), Some(kind), Some(description)) = (
                    parse::<usize>(fields.get(1)),
                    fields.get(2).and_then(|k| StopKind::parse(k)),
                    fields.get(3),
                ) else {
                    return;
                };
                let reached = fields[4..]
                    .chunks_exact(2)
                    .filter_map(|pair| Some((pair[0].to_string(), pair[1].parse().ok()?)))
                    .collect();
                self.peer_stopped(
                    rank,
                    Stopped {
                        kind,
                        description: description.to_string(),
                        reached,
                    },
                );
            }
            "reply" => {
                let Some(query) = parse::<u64>(fields.get(1)) else {
                    return;
                };
                let reports = fields[2..]
                    .chunks_exact(3)
                    .filter_map(|t| {
                        Some(PeerReport {
                            rank: t[0].parse().ok()?,
                            reached: t[1].parse().ok()?,
                            note: t[2].to_string(),
                        })
                    })
                    .collect();
                lock(&self.view).replies.insert(query, reports);
                self.answered.notify_all();
            }
            "bye" => {
                lock(&self.view).bye = true;
                self.answered.notify_all();
            }
            "all-exited" => {
                lock(&self.view).all_exited = true;
                self.answered.notify_all();
            }
            _ => {}
        }
    }

    fn peer_stopped(&self, rank: usize, stopped: Stopped) {
        lock(&self.view).stopped.entry(rank).or_insert(stopped);
        self.any_stopped.store(true, Ordering::Release);
        self.answered.notify_all();
        if let Some(wake) = self.waker.get() {
            wake();
        }
    }

    /// The hub's connection closed: unless rank 0 shut down cleanly, it died.
    fn hub_lost(&self) {
        lock(&self.view).hub_lost = true;
        self.answered.notify_all();
        self.peer_stopped(
            0,
            Stopped {
                kind: StopKind::Died,
                description: "died (the failure monitor it hosts closed without a clean \
                              exit: killed or crashed)"
                    .to_string(),
                reached: HashMap::new(),
            },
        );
    }

    /// Peers of `track`'s group that stopped and will never reach collective `seq`
    /// (a rank that exited cleanly after entering it is not missing; one that
    /// panicked, failed or died is, since MPI cannot complete with a dead process).
    pub(crate) fn stopped_peers(&self, track: &GroupTrack, seq: u64) -> Option<MissingMembers> {
        self.stopped_members(track, Some(seq))
    }

    /// [`Monitor::stopped_peers`] for collective `Some(seq)`; for `None` (a send or receive,
    /// whose progress no collective number tells) the peers that panicked, failed or died,
    /// whatever they had reached: one that exited cleanly had finished its part.
    pub(crate) fn stopped_members(
        &self,
        track: &GroupTrack,
        seq: Option<u64>,
    ) -> Option<MissingMembers> {
        if !self.any_stopped.load(Ordering::Acquire) {
            return None;
        }
        let view = lock(&self.view);
        let mut missing = MissingMembers {
            ranks: Vec::new(),
            note: String::new(),
        };
        for &member in &track.members {
            let Some(stopped) = view.stopped.get(&member).filter(|_| member != self.rank) else {
                continue;
            };
            // A peer that entered a later collective of the group has done its part
            // in this one, however it stopped afterwards.
            let reached = stopped.reached.get(&track.key).copied().unwrap_or(0);
            let exited = stopped.kind == StopKind::Exited;
            let done = match seq {
                Some(seq) => reached > seq || (exited && reached >= seq),
                None => exited,
            };
            if done {
                continue;
            }
            if !missing.note.is_empty() {
                missing.note.push_str("; ");
            }
            missing
                .note
                .push_str(&format!("rank {member} {}", stopped.description));
            missing.ranks.push(member);
        }
        (!missing.ranks.is_empty()).then_some(missing)
    }

    /// How global rank `rank` stopped, if it did (`rank 3 died …`).
    pub(crate) fn stopped_rank(&self, rank: usize) -> Option<String> {
        if !self.any_stopped.load(Ordering::Acquire) {
            return None;
        }
        let view = lock(&self.view);
        view.stopped
            .get(&rank)
            .map(|s| format!("rank {rank} {}", s.description))
    }

    /// Asks the hub which members of `track`'s group have not entered collective
    /// `seq`, and where they were last seen. `None` if the hub did not answer.
    pub(crate) fn missing_ranks(&self, track: &GroupTrack, seq: u64) -> Option<MissingMembers> {
        let query = {
            let mut view = lock(&self.view);
            view.next_query += 1;
            view.next_query
        };
        self.flush_then(&format!("query\t{query}\t{}\n", track.key));
        let deadline = Instant::now() + REPLY_WAIT;
        let mut view = lock(&self.view);
        let reports = loop {
            if let Some(reports) = view.replies.remove(&query) {
                break reports;
            }
            let now = Instant::now();
            if view.hub_lost || now >= deadline {
                return None;
            }
            view = self
                .answered
                .wait_timeout(view, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        let others =
            |report: &&PeerReport| report.rank != self.rank && track.members.contains(&report.rank);
        let mut absent: Vec<&PeerReport> = reports
            .iter()
            .filter(others)
            .filter(|r| r.reached < seq)
            .collect();
        // Every member entered it, but some have gone silent since (stopped, or cut off by
        // the network): those are the ones the collective waits for.
        if absent.is_empty() {
            absent = reports
                .iter()
                .filter(others)
                .filter(|r| r.note.starts_with(SILENT_NOTE))
                .collect();
        }
        // If every member entered it, the ranks' positions are the useful part.
        let described = if absent.is_empty() {
            reports.iter().filter(others).collect()
        } else {
            absent.clone()
        };
        let notes: Vec<String> = described
            .iter()
            .map(|r| format!("rank {} {}", r.rank, r.note))
            .collect();
        let note = if absent.is_empty() {
            format!("{ALL_ENTERED}: {}", notes.join("; "))
        } else {
            notes.join("; ")
        };
        Some(MissingMembers {
            ranks: absent.iter().map(|r| r.rank).collect(),
            note,
        })
    }

    /// From the panic hook: sends this rank's exact position and the panic message.
    pub(crate) fn report_panic(&self, info: &PanicHookInfo<'_>) {
        let payload = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(non-text panic payload)".to_string());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_default();
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        let message = format!("{payload} (thread '{name}'{at})");
        lock(&self.panic_message).get_or_insert(message.clone());
        // The monitor thread may hold the locks `flush` takes if it is the one panicking.
        if name != MONITOR_THREAD {
            self.flush_then(&format!("panicked\t{}\n", field(&message)));
        }
    }

    /// The first panic message of this process, if it panicked.
    pub(crate) fn panic_message(&self) -> Option<String> {
        lock(&self.panic_message).clone()
    }

    /// Tells the hub this rank gives up after `message` (its peers then fail at once
    /// instead of waiting for it).
    pub(crate) fn report_failure(&self, message: &str) {
        self.flush_then(&format!("failed\t{}\n", field(message)));
    }

    /// Clean shutdown: sends the final position and `exited`, and waits (briefly) for
    /// the hub to acknowledge, so every peer hears of it before this process ends.
    pub(crate) fn exit(&self) {
        self.flush_then("exited\n");
        let deadline = Instant::now() + REPLY_WAIT;
        let mut view = lock(&self.view);
        while !view.bye && !view.hub_lost {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            view = self
                .answered
                .wait_timeout(view, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// After [`Monitor::exit`]: waits until every rank has exited cleanly, a peer
    /// stopped any other way, or `wait` passed.
    pub(crate) fn await_shutdown(&self, wait: Duration) -> ShutdownAgreement {
        let deadline = Instant::now() + wait;
        let mut view = lock(&self.view);
        loop {
            if view.all_exited {
                return ShutdownAgreement::AllExited;
            }
            let mut failed: Vec<(&usize, &Stopped)> = view
                .stopped
                .iter()
                .filter(|(_, stopped)| stopped.kind != StopKind::Exited)
                .collect();
            if !failed.is_empty() {
                failed.sort_by_key(|(rank, _)| **rank);
                let notes: Vec<String> = failed
                    .iter()
                    .map(|(rank, stopped)| format!("rank {rank} {}", stopped.description))
                    .collect();
                return ShutdownAgreement::PeerFailed(notes.join("; "));
            }
            let now = Instant::now();
            if view.hub_lost || now >= deadline {
                return ShutdownAgreement::Undecided;
            }
            view = self
                .answered
                .wait_timeout(view, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Cuts the connection as a killed process would (tests).
    #[cfg(test)]
    fn sever(&self) {
        let _ = lock(&self.writer).shutdown(std::net::Shutdown::Both);
    }
}

/// Reads the hub's messages and, between them, sends position changes.
fn run_monitor_thread(monitor: &Weak<Monitor>, mut lines: LineReader) {
    loop {
        let next = lines.next_line();
        let Some(monitor) = monitor.upgrade() else {
            return;
        };
        match next {
            Ok(Some(line)) => monitor.handle(&line),
            Err(e) if is_timeout(&e) => {}
            Ok(None) | Err(_) => {
                monitor.hub_lost();
                return;
            }
        }
        monitor.flush_then("");
    }
}

/// The hub's record of one rank.
#[derive(Default)]
struct RankRecord {
    writer: Option<TcpStream>,
    connected: bool,
    /// (key, name) by the rank's group id.
    groups: Vec<(String, String)>,
    /// (op, seq, done) by group id.
    positions: HashMap<usize, (String, u64, bool)>,
    /// Group id of the latest position report.
    latest: Option<usize>,
    stopped: bool,
    /// Stopped by a clean exit (the shutdown agreement waits for every rank's).
    exited: bool,
    /// The `stopped` line sent to the peers, kept for ranks that connect later (a rank can
    /// fail before a slower peer's connection reaches the hub).
    stop_notice: Option<String>,
    /// When the hub last heard from the rank (any line, heartbeats included).
    last_heard: Option<Instant>,
}

impl RankRecord {
    /// `in all_reduce #3 on group 'world'`, `after barrier #1 on group 'dp[0,2]'`.
    fn position(&self) -> String {
        let Some((id, (op, seq, done))) = self
            .latest
            .and_then(|id| self.positions.get(&id).map(|p| (id, p)))
        else {
            return "before its first collective".to_string();
        };
        let name = self.groups.get(id).map_or("?", |(_, name)| name.as_str());
        let phase = if *done { "after" } else { "in" };
        format!("{phase} {op} #{seq} on group '{name}'")
    }

    fn reached(&self, key: &str) -> u64 {
        self.groups
            .iter()
            .position(|(k, _)| k == key)
            .and_then(|id| self.positions.get(&id))
            .map_or(0, |(_, seq, _)| *seq)
    }

    fn send(&mut self, text: &str) {
        if let Some(writer) = &mut self.writer {
            if writer.write_all(text.as_bytes()).is_err() {
                self.writer = None;
            }
        }
    }
}

/// The hub on rank 0: collects every rank's reports and answers queries.
struct Hub {
    token: u64,
    ranks: Mutex<Vec<RankRecord>>,
}

/// Starts the hub on `bind` (an ephemeral port) for a job of `size` ranks and
/// returns its port. The hub's threads live as long as the process: they must keep
/// serving while rank 0 itself shuts down.
pub(crate) fn start_hub(bind: IpAddr, size: usize, token: u64) -> io::Result<u16> {
    let listener = TcpListener::bind((bind, 0))?;
    let port = listener.local_addr()?.port();
    let hub = Arc::new(Hub {
        token,
        ranks: Mutex::new((0..size).map(|_| RankRecord::default()).collect()),
    });
    std::thread::Builder::new()
        .name("comm-mpi-hub".to_string())
        .spawn(move || loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    let hub = Arc::clone(&hub);
                    let _ = std::thread::Builder::new()
                        .name("comm-mpi-hub-rank".to_string())
                        .spawn(move || hub.serve(stream));
                }
                // E.g. out of file descriptors: do not spin.
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        })?;
    Ok(port)
}

impl Hub {
    /// Serves one rank's connection until it closes.
    fn serve(&self, stream: TcpStream) {
        let Some(rank) = self.accept_rank(&stream) else {
            return;
        };
        let mut lines = LineReader::new(stream);
        while let Ok(Some(line)) = lines.next_line() {
            self.handle(rank, &line);
        }
        let mut ranks = lock(&self.ranks);
        ranks[rank].writer = None;
        Hub::stop(&mut ranks, rank, StopKind::Died, "");
    }

    /// Reads and checks the hello; registers the writer half.
    fn accept_rank(&self, stream: &TcpStream) -> Option<usize> {
        stream.set_read_timeout(Some(IO_TIMEOUT)).ok()?;
        stream.set_nodelay(true).ok()?;
        // Byte by byte, so nothing after the hello is consumed here.
        let mut hello = Vec::new();
        let mut byte = [0u8; 1];
        let mut reader = stream;
        while hello.len() < 256 {
            if reader.read(&mut byte).ok()? == 0 {
                return None;
            }
            if byte[0] == b'\n' {
                break;
            }
            hello.push(byte[0]);
        }
        let hello = String::from_utf8(hello).ok()?;
        let fields: Vec<&str> = hello.split('\t').collect();
        let (Some(token), Some(rank)) =
            (parse::<u64>(fields.get(1)), parse::<usize>(fields.get(2)))
        else {
            return None;
        };
        if fields[0] != "hello" || token != self.token {
            return None;
        }
        stream.set_read_timeout(None).ok()?;
        let writer = stream.try_clone().ok()?;
        writer.set_write_timeout(Some(IO_TIMEOUT)).ok()?;
        let mut ranks = lock(&self.ranks);
        let record: &mut RankRecord = ranks.get_mut(rank)?;
        if record.connected {
            return None;
        }
        record.connected = true;
        record.writer = Some(writer);
        let earlier: String = ranks
            .iter()
            .filter_map(|other| other.stop_notice.as_deref())
            .collect();
        if !earlier.is_empty() {
            ranks[rank].send(&earlier);
        }
        Some(rank)
    }

    fn handle(&self, rank: usize, line: &str) {
        let fields: Vec<&str> = line.split('\t').collect();
        let mut ranks = lock(&self.ranks);
        ranks[rank].last_heard = Some(Instant::now());
        match fields[0] {
            "group" => {
                let (Some(id), Some(key), Some(name)) =
                    (parse::<usize>(fields.get(1)), fields.get(2), fields.get(3))
                else {
                    return;
                };
                let groups = &mut ranks[rank].groups;
                // Ids are dense and announced in order; a gap means a broken peer.
                if id == groups.len() {
                    groups.push((key.to_string(), name.to_string()));
                }
            }
            "at" => {
                let (Some(id), Some(op), Some(seq), Some(done)) = (
                    parse::<usize>(fields.get(1)),
                    fields.get(2),
                    parse::<u64>(fields.get(3)),
                    fields.get(4),
                ) else {
                    return;
                };
                let record = &mut ranks[rank];
                record
                    .positions
                    .insert(id, (op.to_string(), seq, *done == "1"));
                record.latest = Some(id);
            }
            "panicked" | "failed" => {
                let kind = if fields[0] == "panicked" {
                    StopKind::Panicked
                } else {
                    StopKind::Failed
                };
                Hub::stop(&mut ranks, rank, kind, fields.get(1).unwrap_or(&""));
            }
            "exited" => {
                // A rank that already failed or panicked does not count as exited.
                ranks[rank].exited = !ranks[rank].stopped;
                Hub::stop(&mut ranks, rank, StopKind::Exited, "");
                ranks[rank].send("bye\n");
                if ranks.iter().all(|record| record.exited) {
                    for record in ranks.iter_mut() {
                        record.send("all-exited\n");
                    }
                }
            }
            "query" => {
                let (Some(query), Some(key)) = (parse::<u64>(fields.get(1)), fields.get(2)) else {
                    return;
                };
                let mut reply = format!("reply\t{query}");
                for (r, record) in ranks.iter().enumerate() {
                    let silent = record
                        .last_heard
                        .map(|heard| heard.elapsed())
                        .filter(|silence| *silence >= SILENT_AFTER && !record.stopped);
                    let note = if !record.connected {
                        "is not connected to the failure monitor".to_string()
                    } else if let Some(silence) = silent {
                        format!(
                            "{SILENT_NOTE} {:.1} s (stopped, stuck outside the program, or cut \
                             off from the network); last seen {}",
                            silence.as_secs_f64(),
                            record.position()
                        )
                    } else {
                        format!("last seen {}", record.position())
                    };
                    reply.push_str(&format!("\t{r}\t{}\t{}", record.reached(key), field(&note)));
                }
                reply.push('\n');
                ranks[rank].send(&reply);
            }
            _ => {}
        }
    }

    /// Marks `rank` stopped (once) and tells every other rank.
    fn stop(ranks: &mut [RankRecord], rank: usize, kind: StopKind, message: &str) {
        let record = &mut ranks[rank];
        if record.stopped {
            return;
        }
        record.stopped = true;
        let what = match kind {
            StopKind::Exited => "exited cleanly (shut MPI down)".to_string(),
            StopKind::Panicked => format!("panicked: {message}"),
            StopKind::Failed => format!("failed: {}", without_nested_reasons(message)),
            StopKind::Died => {
                "died (connection lost without a clean exit: killed or crashed)".to_string()
            }
        };
        let mut line = format!(
            "stopped\t{rank}\t{}\t{}",
            kind.as_str(),
            field(&format!("{what}; last seen {}", record.position()))
        );
        for (id, (key, _)) in record.groups.iter().enumerate() {
            if let Some((_, seq, _)) = record.positions.get(&id) {
                line.push_str(&format!("\t{key}\t{seq}"));
            }
        }
        line.push('\n');
        for (r, other) in ranks.iter_mut().enumerate() {
            if r != rank {
                other.send(&line);
            }
        }
        ranks[rank].stop_notice = Some(line);
    }
}

/// A failure caused by stopped peers (`… cannot complete: rank(s) [3] (global) stopped:
/// rank 3 exited …`) already names them; their own notices carry the reasons, so quoting
/// the reasons again would make every further rank's message nest all the earlier ones.
fn without_nested_reasons(message: &str) -> &str {
    const NESTED: &str = " (global) stopped: ";
    match message.find(NESTED) {
        Some(at) => &message[..at + NESTED.len() - 2],
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    /// A hub and one connected monitor per rank, all on loopback.
    fn job(size: usize) -> Vec<Arc<Monitor>> {
        let token = random_token();
        let port = start_hub(Ipv4Addr::LOCALHOST.into(), size, token).unwrap();
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        (0..size)
            .map(|rank| Monitor::connect(rank, &[address], token).unwrap())
            .collect()
    }

    /// Each rank's track of the same group.
    fn world(monitors: &[Arc<Monitor>]) -> Vec<Arc<GroupTrack>> {
        let members: Vec<usize> = (0..monitors.len()).collect();
        monitors
            .iter()
            .map(|m| {
                let track = Arc::new(GroupTrack::new("world", members.clone(), 0));
                m.register(Arc::clone(&track));
                track
            })
            .collect()
    }

    fn wait_for<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(value) = probe() {
                return value;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn query_names_the_ranks_that_did_not_arrive_and_where_they_are() {
        let monitors = job(3);
        let tracks = world(&monitors);
        for track in &tracks {
            drop(track.enter("barrier", 1));
        }
        let _rank0 = tracks[0].enter("all_reduce", 2);
        let _rank1 = tracks[1].enter("all_reduce", 2);
        // Rank 2 stays after the barrier. Positions reach the hub on each rank's own
        // reporting tick, so wait until it has both rank 1's and rank 2's latest ones.
        let missing = wait_for("rank 1's and rank 2's positions", || {
            let missing = monitors[0].missing_ranks(&tracks[0], 2)?;
            (missing.ranks == vec![2] && missing.note.contains("barrier")).then_some(missing)
        });
        assert_eq!(
            missing.note,
            "rank 2 last seen after barrier #1 on group 'world'"
        );
        assert!(monitors[0].stopped_peers(&tracks[0], 2).is_none());
    }

    /// What the MPI position board of an NCCL group asks: positions posted as issued (no
    /// leaving: the host cannot see the GPU finish) name the member that never issued the
    /// collective; a member that issued it and then died is named by how it stopped.
    #[test]
    fn issued_positions_name_who_never_issued_and_who_died_after() {
        let monitors = job(3);
        let tracks = world(&monitors);
        for (track, seq) in tracks.iter().zip([3, 3, 2]) {
            track.issued("all_reduce", seq);
        }
        let missing = wait_for("every rank's issued position", || {
            let missing = monitors[0].missing_ranks(&tracks[0], 3)?;
            (missing.ranks == vec![2] && missing.note.contains("#2")).then_some(missing)
        });
        assert_eq!(
            missing.note,
            "rank 2 last seen in all_reduce #2 on group 'world'"
        );
        assert!(monitors[0].stopped_peers(&tracks[0], 3).is_none());
        monitors[1].sever();
        let missing = wait_for("the death notice", || {
            monitors[0].stopped_peers(&tracks[0], 3)
        });
        assert_eq!(missing.ranks, vec![1], "{}", missing.note);
        assert!(missing.note.contains("rank 1 died"), "{}", missing.note);
    }

    #[test]
    fn a_killed_rank_is_reported_dead_to_every_peer() {
        let monitors = job(3);
        let tracks = world(&monitors);
        let _inside: Vec<_> = tracks.iter().map(|t| t.enter("all_gather", 1)).collect();
        wait_for("every rank's position", || {
            let missing = monitors[0].missing_ranks(&tracks[0], 1)?;
            missing.ranks.is_empty().then_some(())
        });
        let woken = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&woken);
        monitors[0].set_waker(Box::new(move || flag.store(true, Ordering::SeqCst)));
        monitors[2].sever();
        for rank in 0..2 {
            let missing = wait_for("the death notice", || {
                monitors[rank].stopped_peers(&tracks[rank], 1)
            });
            assert_eq!(missing.ranks, vec![2]);
            assert_eq!(
                missing.note,
                "rank 2 died (connection lost without a clean exit: killed or crashed); \
                 last seen in all_gather #1 on group 'world'"
            );
        }
        assert!(monitors[0]
            .stopped_rank(2)
            .unwrap()
            .starts_with("rank 2 died"));
        assert!(woken.load(Ordering::SeqCst), "the waker was not called");
        assert!(monitors[0].stopped_rank(1).is_none());
    }

    #[test]
    fn a_silent_rank_inside_the_collective_is_named_by_its_silence() {
        let monitors = job(3);
        let tracks = world(&monitors);
        let _inside: Vec<_> = tracks.iter().map(|t| t.enter("all_reduce", 1)).collect();
        wait_for("every rank's position", || {
            let missing = monitors[0].missing_ranks(&tracks[0], 1)?;
            missing.ranks.is_empty().then_some(())
        });
        // Rank 2 is stopped (SIGSTOP) or cut off: its socket stays open, it only says nothing
        // more (holding its writer's lock freezes its reports and heartbeats).
        let frozen = lock(&monitors[2].writer);
        let missing = wait_for("rank 2's silence", || {
            let missing = monitors[0].missing_ranks(&tracks[0], 1)?;
            (missing.ranks == vec![2]).then_some(missing)
        });
        assert!(
            missing.note.starts_with("rank 2 has sent nothing for")
                && missing
                    .note
                    .ends_with("last seen in all_reduce #1 on group 'world'"),
            "{}",
            missing.note
        );
        // Rank 1 keeps beating and is not named.
        assert!(!missing.note.contains("rank 1"), "{}", missing.note);
        drop(frozen);
    }

    #[test]
    fn a_clean_exit_stops_only_the_collectives_the_rank_never_reached() {
        let monitors = job(2);
        let tracks = world(&monitors);
        drop(tracks[1].enter("broadcast", 1));
        monitors[1].exit();
        let missing = wait_for("the exit notice", || {
            monitors[0].stopped_peers(&tracks[0], 2)
        });
        assert_eq!(missing.ranks, vec![1]);
        assert!(
            missing.note.starts_with("rank 1 exited cleanly"),
            "{}",
            missing.note
        );
        // Collective #1 was reached by rank 1 before it exited: nothing is missing.
        assert!(monitors[0].stopped_peers(&tracks[0], 1).is_none());
    }

    #[test]
    fn clean_shutdown_waits_for_every_rank_and_gives_up_on_a_failed_one() {
        let monitors = job(3);
        monitors[0].exit();
        monitors[1].exit();
        assert_eq!(
            monitors[0].await_shutdown(Duration::from_millis(50)),
            ShutdownAgreement::Undecided,
            "rank 2 has not exited yet"
        );
        monitors[2].exit();
        for monitor in &monitors {
            assert_eq!(
                monitor.await_shutdown(Duration::from_secs(10)),
                ShutdownAgreement::AllExited
            );
        }

        let monitors = job(3);
        monitors[0].exit();
        monitors[2].report_failure("out of memory");
        // Even if rank 1 exits afterwards, rank 2's failure decides.
        monitors[1].exit();
        for monitor in &monitors[..2] {
            match monitor.await_shutdown(Duration::from_secs(10)) {
                ShutdownAgreement::PeerFailed(why) => assert!(
                    why.starts_with("rank 2 failed: out of memory; last seen"),
                    "{why}"
                ),
                other => panic!("expected the failure of rank 2, got {other:?}"),
            }
        }
    }

    #[test]
    fn failures_and_panics_carry_their_message() {
        let monitors = job(3);
        let tracks = world(&monitors);
        monitors[1].report_failure("loading shard 3: file not found");
        let missing = wait_for("the failure", || monitors[0].stopped_peers(&tracks[0], 1));
        assert_eq!(
            missing.note,
            "rank 1 failed: loading shard 3: file not found; last seen before its first collective"
        );
        // A panic, raised on a thread so the test itself goes on.
        let monitor = Arc::clone(&monitors[2]);
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| monitor.report_panic(info)));
        let result = std::thread::spawn(|| panic!("boom\tline two")).join();
        std::panic::set_hook(previous);
        assert!(result.is_err());
        let missing = wait_for("the panic", || {
            let missing = monitors[0].stopped_peers(&tracks[0], 1)?;
            (missing.ranks.len() == 2).then_some(missing)
        });
        assert_eq!(missing.ranks, vec![1, 2]);
        assert!(
            missing
                .note
                .contains("rank 2 panicked: boom line two (thread 'unnamed' at"),
            "{}",
            missing.note
        );
        assert!(monitors[2]
            .panic_message()
            .unwrap()
            .starts_with("boom\tline two"));
    }

    #[test]
    fn the_hub_rejects_a_wrong_token_and_a_second_hello() {
        let token = random_token();
        let port = start_hub(Ipv4Addr::LOCALHOST.into(), 2, token).unwrap();
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let bad = Monitor::connect(0, &[address], token ^ 1).unwrap();
        let good = Monitor::connect(0, &[address], token).unwrap();
        let track = GroupTrack::new("world", vec![0, 1], 0);
        // Answered: `good` is registered as rank 0 before its twin says hello.
        let reports = good.missing_ranks(&track, 1).unwrap();
        let twin = Monitor::connect(0, &[address], token).unwrap();
        // The rejected connections are closed: they see the hub (rank 0) as lost.
        for rejected in [&bad, &twin] {
            wait_for("the rejection", || rejected.stopped_rank(0));
        }
        assert_eq!(reports.ranks, vec![1]);
        assert_eq!(
            reports.note,
            "rank 1 is not connected to the failure monitor"
        );
    }
}
