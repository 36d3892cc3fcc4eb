//! Pipeline schedules as plain data: for each worker, the ordered list of actions of one
//! training step. Nothing here runs a model, so schedules are checked and simulated in
//! unit tests (every micro-batch forwarded and backwarded once per chunk, every send
//! matched by a receive, no deadlock, the bubble and memory the theory predicts).
//!
//! Layout: the model is cut into `C = p·v` chunks (`p` workers, `v` chunks per worker);
//! chunk `c` lives on worker `c % p` (Megatron's interleaved layout; `v = 1` gives one
//! contiguous stage per worker). Sends are buffered (they never wait for the receiver) and
//! receives block, as in `meshtrain-comm`; [`Schedule::simulate`] uses the same rules.

use super::PipelineError;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// Which schedule to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Fill-drain (GPipe): all forwards, then all backwards. Holds all `m` micro-batches'
    /// activations. With `m = 1` this is naive layer-wise model parallelism.
    GPipe,
    /// 1F1B (PipeDream-Flush): after a warm-up of `p − 1 − rank` forwards, alternate one
    /// forward and one backward. Same bubble as GPipe, at most `p` micro-batches in flight.
    OneFOneB,
    /// Interleaved 1F1B (Megatron-LM): `v` chunks per worker shrink the bubble by `v`, at
    /// the price of `v` times more point-to-point messages. Needs `m` to be a multiple of `p`.
    Interleaved { chunks_per_worker: usize },
}

impl ScheduleKind {
    /// Model chunks each worker holds.
    pub fn chunks_per_worker(&self) -> usize {
        match self {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => 1,
            ScheduleKind::Interleaved { chunks_per_worker } => *chunks_per_worker,
        }
    }

    /// Idle fraction of a step (idle time / (workers × step time)) with equal-cost stages and
    /// free communication: `(p−1)/(v·m + p−1)`. Megatron's "bubble fraction" is the ratio of
    /// idle to ideal time, `(p−1)/(v·m)`; both say the same.
    pub fn predicted_idle_fraction(&self, workers: usize, micro_batches: usize) -> f64 {
        let (p, v, m) = (
            workers as f64,
            self.chunks_per_worker() as f64,
            micro_batches as f64,
        );
        (p - 1.0) / (v * m + p - 1.0)
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::GPipe => write!(f, "gpipe"),
            ScheduleKind::OneFOneB => write!(f, "1f1b"),
            ScheduleKind::Interleaved { chunks_per_worker } => {
                write!(f, "interleaved(v={chunks_per_worker})")
            }
        }
    }
}

impl FromStr for ScheduleKind {
    type Err = PipelineError;

    /// `gpipe`, `1f1b`, `interleaved` (2 chunks per worker) or `interleaved:V`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" => Ok(ScheduleKind::Interleaved {
                chunks_per_worker: 2,
            }),
            _ => match s.strip_prefix("interleaved:").map(str::parse::<usize>) {
                Some(Ok(v)) => Ok(ScheduleKind::Interleaved {
                    chunks_per_worker: v,
                }),
                _ => Err(PipelineError::UnknownSchedule(s.to_string())),
            },
        }
    }
}

/// One step of a worker's program. `chunk` is the global chunk index (model order) the
/// action belongs to; the peer of a transfer follows from it (`chunk ± 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Receive chunk `chunk`'s input (chunk `chunk − 1`'s output).
    RecvActivation {
        chunk: usize,
        micro: usize,
    },
    Forward {
        chunk: usize,
        micro: usize,
    },
    /// Send chunk `chunk`'s output to the worker of chunk `chunk + 1`.
    SendActivation {
        chunk: usize,
        micro: usize,
    },
    /// Receive the gradient of chunk `chunk`'s output.
    RecvGrad {
        chunk: usize,
        micro: usize,
    },
    Backward {
        chunk: usize,
        micro: usize,
    },
    /// Send the gradient of chunk `chunk`'s input to the worker of chunk `chunk − 1`.
    SendGrad {
        chunk: usize,
        micro: usize,
    },
}

impl Action {
    pub fn chunk(&self) -> usize {
        self.parts().0
    }

    pub fn micro(&self) -> usize {
        self.parts().1
    }

    fn parts(&self) -> (usize, usize) {
        match *self {
            Action::RecvActivation { chunk, micro }
            | Action::Forward { chunk, micro }
            | Action::SendActivation { chunk, micro }
            | Action::RecvGrad { chunk, micro }
            | Action::Backward { chunk, micro }
            | Action::SendGrad { chunk, micro } => (chunk, micro),
        }
    }

    /// The message this action sends or receives, named by what it carries.
    fn message(&self) -> Option<Message> {
        match *self {
            Action::SendActivation { chunk, micro } => Some(Message::Activation {
                to_chunk: chunk + 1,
                micro,
            }),
            Action::RecvActivation { chunk, micro } => Some(Message::Activation {
                to_chunk: chunk,
                micro,
            }),
            Action::SendGrad { chunk, micro } => chunk
                .checked_sub(1)
                .map(|to_chunk| Message::Grad { to_chunk, micro }),
            Action::RecvGrad { chunk, micro } => Some(Message::Grad {
                to_chunk: chunk,
                micro,
            }),
            _ => None,
        }
    }

    fn is_send(&self) -> bool {
        matches!(
            self,
            Action::SendActivation { .. } | Action::SendGrad { .. }
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Message {
    Activation { to_chunk: usize, micro: usize },
    Grad { to_chunk: usize, micro: usize },
}

/// The programs of all workers for one training step.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub workers: usize,
    pub micro_batches: usize,
    /// `actions[w]`: worker `w`'s actions, in order.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Builds the schedule, or says why the layout is impossible (before any work starts).
    pub fn new(
        kind: ScheduleKind,
        workers: usize,
        micro_batches: usize,
    ) -> Result<Schedule, PipelineError> {
        let v = kind.chunks_per_worker();
        if workers == 0 {
            return Err(PipelineError::NoWorkers);
        }
        if micro_batches == 0 {
            return Err(PipelineError::NoMicroBatches);
        }
        if v == 0 {
            return Err(PipelineError::NoChunks);
        }
        if matches!(kind, ScheduleKind::Interleaved { .. })
            && !micro_batches.is_multiple_of(workers)
        {
            return Err(PipelineError::MicroBatchesNotMultiple {
                micro_batches,
                workers,
            });
        }
        let mut schedule = Schedule {
            kind,
            workers,
            micro_batches,
            actions: Vec::with_capacity(workers),
        };
        for w in 0..workers {
            let computes = match kind {
                ScheduleKind::GPipe => fill_drain(micro_batches, w),
                ScheduleKind::OneFOneB => interleaved(workers, 1, micro_batches, w, false),
                ScheduleKind::Interleaved { chunks_per_worker } => {
                    interleaved(workers, chunks_per_worker, micro_batches, w, true)
                }
            };
            let program = schedule.with_transfers(&computes);
            schedule.actions.push(program);
        }
        Ok(schedule)
    }

    pub fn chunks_per_worker(&self) -> usize {
        self.kind.chunks_per_worker()
    }

    /// Total model chunks, `p·v`.
    pub fn num_chunks(&self) -> usize {
        self.workers * self.chunks_per_worker()
    }

    /// The worker that holds chunk `chunk`.
    pub fn worker_of(&self, chunk: usize) -> usize {
        chunk % self.workers
    }

    /// The global chunk indices worker `worker` holds, in its local order.
    pub fn chunks_of(&self, worker: usize) -> Vec<usize> {
        (0..self.chunks_per_worker())
            .map(|j| j * self.workers + worker)
            .collect()
    }

    /// Surrounds each forward with the receive of its input and the send of its output (and
    /// each backward likewise), except where the neighbouring chunk is on the same worker.
    fn with_transfers(&self, computes: &[Action]) -> Vec<Action> {
        let last = self.num_chunks() - 1;
        let remote = |a: usize, b: usize| self.worker_of(a) != self.worker_of(b);
        let mut out = Vec::with_capacity(computes.len() * 3);
        for &a in computes {
            match a {
                Action::Forward { chunk, micro } => {
                    if chunk > 0 && remote(chunk - 1, chunk) {
                        out.push(Action::RecvActivation { chunk, micro });
                    }
                    out.push(a);
                    if chunk < last && remote(chunk, chunk + 1) {
                        out.push(Action::SendActivation { chunk, micro });
                    }
                }
                Action::Backward { chunk, micro } => {
                    if chunk < last && remote(chunk, chunk + 1) {
                        out.push(Action::RecvGrad { chunk, micro });
                    }
                    out.push(a);
                    if chunk > 0 && remote(chunk - 1, chunk) {
                        out.push(Action::SendGrad { chunk, micro });
                    }
                }
                _ => out.push(a),
            }
        }
        out
    }

    /// The worker at the other end of a transfer action (`None` for compute).
    fn peer(&self, a: &Action) -> Option<usize> {
        let c = a.chunk();
        match a {
            Action::SendActivation { .. } => Some(self.worker_of(c + 1)),
            Action::RecvGrad { .. } => Some(self.worker_of(c + 1)),
            Action::RecvActivation { .. } | Action::SendGrad { .. } => {
                c.checked_sub(1).map(|c| self.worker_of(c))
            }
            _ => None,
        }
    }

    /// Every (sender, receiver) pair of workers that a message goes between, sorted: the
    /// pairs a transport without buffering prepares channels for
    /// ([`ProcessGroup::prepare_point_to_point`](meshtrain_comm::ProcessGroup::prepare_point_to_point)).
    pub fn point_to_point_pairs(&self) -> Vec<(usize, usize)> {
        let mut pairs: Vec<(usize, usize)> = self
            .actions
            .iter()
            .enumerate()
            .flat_map(|(w, program)| {
                program
                    .iter()
                    .filter(|a| a.is_send())
                    .filter_map(move |a| Some((w, self.peer(a)?)))
            })
            .collect();
        pairs.sort_unstable();
        pairs.dedup();
        pairs
    }

    /// Whether every worker receives each peer's messages in the order that peer sends them,
    /// or the first pair and place where it does not. A transport without tags needs it:
    /// NCCL matches a pair's sends and receives by their order alone, so a message received
    /// out of turn would take another's place (same size) or hang (another size).
    pub fn check_in_order_between_pairs(&self) -> Result<(), String> {
        let p = self.workers;
        let mut sent = vec![vec![Vec::new(); p]; p];
        let mut received = vec![vec![Vec::new(); p]; p];
        for (w, program) in self.actions.iter().enumerate() {
            for a in program {
                if let (Some(m), Some(peer)) = (a.message(), self.peer(a)) {
                    if a.is_send() {
                        sent[w][peer].push(m);
                    } else {
                        received[peer][w].push(m);
                    }
                }
            }
        }
        for from in 0..p {
            for to in 0..p {
                let (s, r) = (&sent[from][to], &received[from][to]);
                if let Some(i) = (0..s.len().min(r.len())).find(|&i| s[i] != r[i]) {
                    return Err(format!(
                        "worker {to} receives {:?} from worker {from} where worker {from} \
                         sends {:?} (message {i} between them)",
                        r[i], s[i]
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks the invariants the executor relies on: each worker forwards and backwards every
    /// micro-batch exactly once on each of its chunks; every compute action finds its input
    /// (received earlier, handed over by its own neighbouring chunk, or the loss); each send
    /// goes to another worker and has exactly one matching receive; nothing deadlocks.
    pub fn check(&self) -> Result<(), PipelineError> {
        let bad = |msg: String| Err(PipelineError::InvalidSchedule(msg));
        if self.actions.len() != self.workers {
            return bad(format!(
                "{} programs for {} workers",
                self.actions.len(),
                self.workers
            ));
        }
        let last = self.num_chunks() - 1;
        let mut sends: HashMap<Message, usize> = HashMap::new();
        let mut recvs: HashMap<Message, usize> = HashMap::new();
        for (w, program) in self.actions.iter().enumerate() {
            let mut done: HashMap<Action, usize> = HashMap::new();
            let has = |done: &HashMap<Action, usize>, a: Action| done.contains_key(&a);
            for &a in program {
                let (chunk, micro) = (a.chunk(), a.micro());
                if chunk > last || micro >= self.micro_batches {
                    return bad(format!("worker {w}: {a:?} is out of range"));
                }
                if self.worker_of(chunk) != w {
                    return bad(format!("worker {w} runs {a:?} of another worker's chunk"));
                }
                let (fwd, bwd) = (
                    Action::Forward { chunk, micro },
                    Action::Backward { chunk, micro },
                );
                let ready = match a {
                    Action::Forward { .. } => {
                        chunk == 0
                            || has(&done, Action::RecvActivation { chunk, micro })
                            || has(
                                &done,
                                Action::Forward {
                                    chunk: chunk - 1,
                                    micro,
                                },
                            )
                    }
                    Action::Backward { .. } => {
                        has(&done, fwd)
                            && (chunk == last
                                || has(&done, Action::RecvGrad { chunk, micro })
                                || has(
                                    &done,
                                    Action::Backward {
                                        chunk: chunk + 1,
                                        micro,
                                    },
                                ))
                    }
                    Action::SendActivation { .. } => has(&done, fwd) && chunk < last,
                    Action::SendGrad { .. } => has(&done, bwd) && chunk > 0,
                    Action::RecvActivation { .. } => chunk > 0,
                    Action::RecvGrad { .. } => chunk < last,
                };
                if !ready {
                    return bad(format!("worker {w}: {a:?} has no input at that point"));
                }
                *done.entry(a).or_insert(0) += 1;
                if let Some(message) = a.message() {
                    // `ready` above guarantees the neighbouring chunk exists.
                    let peer = match a {
                        Action::SendActivation { .. } | Action::RecvGrad { .. } => chunk + 1,
                        _ => chunk - 1,
                    };
                    if self.worker_of(peer) == w {
                        return bad(format!("worker {w}: {a:?} talks to itself"));
                    }
                    let map = if a.is_send() { &mut sends } else { &mut recvs };
                    if map.insert(message, w).is_some() {
                        return bad(format!("worker {w}: {a:?} is repeated"));
                    }
                }
            }
            for chunk in self.chunks_of(w) {
                for micro in 0..self.micro_batches {
                    let count = |a: Action| done.get(&a).copied().unwrap_or(0);
                    let (f, b) = (
                        count(Action::Forward { chunk, micro }),
                        count(Action::Backward { chunk, micro }),
                    );
                    if (f, b) != (1, 1) {
                        return bad(format!(
                            "worker {w}: chunk {chunk} micro-batch {micro} is forwarded {f} and \
                             backwarded {b} times (once each expected)"
                        ));
                    }
                }
            }
        }
        if let Some((message, w)) = sends.iter().find(|(m, _)| !recvs.contains_key(*m)) {
            return bad(format!("{message:?} sent by worker {w} is never received"));
        }
        if let Some((message, w)) = recvs.iter().find(|(m, _)| !sends.contains_key(*m)) {
            return bad(format!(
                "worker {w} waits for {message:?}, which is never sent"
            ));
        }
        self.simulate(&|_| 1.0).map(|_| ())
    }

    /// Runs the programs in virtual time: compute actions take `cost(action)` seconds,
    /// transfers are instantaneous, sends never block, receives wait for their message.
    /// Fails with [`PipelineError::InvalidSchedule`] naming the stuck workers on deadlock.
    pub fn simulate(&self, cost: &dyn Fn(&Action) -> f64) -> Result<Simulation, PipelineError> {
        let p = self.workers;
        let mut pc = vec![0usize; p];
        let mut clock = vec![0.0f64; p];
        let mut busy = vec![0.0f64; p];
        let mut in_flight = vec![0usize; p];
        let mut peak_in_flight = vec![0usize; p];
        let mut spans = Vec::new();
        let mut mailbox: HashMap<Message, f64> = HashMap::new();
        let edge = |w: usize, a: &Action| {
            PipelineError::InvalidSchedule(format!("worker {w}: {a:?} has no neighbouring chunk"))
        };
        loop {
            let mut progressed = false;
            for w in 0..p {
                while let Some(a) = self.actions[w].get(pc[w]) {
                    match a {
                        Action::RecvActivation { .. } | Action::RecvGrad { .. } => {
                            let message = a.message().ok_or_else(|| edge(w, a))?;
                            let Some(arrival) = mailbox.remove(&message) else {
                                break;
                            };
                            clock[w] = clock[w].max(arrival);
                        }
                        Action::SendActivation { .. } | Action::SendGrad { .. } => {
                            let message = a.message().ok_or_else(|| edge(w, a))?;
                            mailbox.insert(message, clock[w]);
                        }
                        Action::Forward { .. } | Action::Backward { .. } => {
                            let (start, d) = (clock[w], cost(a));
                            clock[w] += d;
                            busy[w] += d;
                            spans.push((w, *a, start, clock[w]));
                            if matches!(a, Action::Forward { .. }) {
                                in_flight[w] += 1;
                                peak_in_flight[w] = peak_in_flight[w].max(in_flight[w]);
                            } else {
                                in_flight[w] = in_flight[w].saturating_sub(1);
                            }
                        }
                    }
                    pc[w] += 1;
                    progressed = true;
                }
            }
            if (0..p).all(|w| pc[w] == self.actions[w].len()) {
                break;
            }
            if !progressed {
                let stuck: Vec<String> = (0..p)
                    .filter(|&w| pc[w] < self.actions[w].len())
                    .map(|w| format!("worker {w} at {:?}", self.actions[w][pc[w]]))
                    .collect();
                return Err(PipelineError::InvalidSchedule(format!(
                    "deadlock: {}",
                    stuck.join(", ")
                )));
            }
        }
        let makespan = clock.iter().copied().fold(0.0, f64::max);
        Ok(Simulation {
            makespan,
            busy,
            peak_in_flight,
            spans,
        })
    }
}

/// What [`Schedule::simulate`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// Virtual time at which the last worker finishes.
    pub makespan: f64,
    /// Compute time of each worker.
    pub busy: Vec<f64>,
    /// Most (chunk, micro-batch) activations each worker held at once.
    pub peak_in_flight: Vec<usize>,
    /// (worker, compute action, start, end), for drawing the schedule.
    pub spans: Vec<(usize, Action, f64, f64)>,
}

impl Simulation {
    /// Idle time over total worker time: `1 − Σ busy / (p · makespan)`.
    pub fn idle_fraction(&self) -> f64 {
        let total = self.makespan * self.busy.len() as f64;
        if total == 0.0 {
            0.0
        } else {
            1.0 - self.busy.iter().sum::<f64>() / total
        }
    }
}

/// GPipe on worker `w` (one chunk, `c = w`): all forwards, then all backwards.
fn fill_drain(m: usize, w: usize) -> Vec<Action> {
    let forwards = (0..m).map(|micro| Action::Forward { chunk: w, micro });
    let backwards = (0..m).map(|micro| Action::Backward { chunk: w, micro });
    forwards.chain(backwards).collect()
}

/// (Interleaved) 1F1B on worker `w`: warm-up forwards, then one forward and one backward
/// in turn, then the remaining backwards. Forward step `k` of a worker's `m·v` steps works on
/// micro-batch `(k / (p·v))·p + k % p` of local chunk `(k % (p·v)) / p` (backward steps take
/// the chunks in reverse), so groups of `p` micro-batches sweep through the chunks in order.
/// Warm-up: plain 1F1B needs `p − 1 − w` forwards in flight to fill the pipe; interleaving
/// needs another `v − 1` rounds of `p` plus `p − 1 − w` for the round trip of the first chunk.
fn interleaved(p: usize, v: usize, m: usize, w: usize, interleave: bool) -> Vec<Action> {
    let total = m * v;
    let warmup = if interleave {
        (p - 1 - w) * 2 + (v - 1) * p
    } else {
        p - 1 - w
    }
    .min(total);
    let micro_of = |k: usize| (k / (p * v)) * p + k % p;
    let local_chunk = |k: usize| (k % (p * v)) / p;
    let forward = |k: usize| Action::Forward {
        chunk: local_chunk(k) * p + w,
        micro: micro_of(k),
    };
    let backward = |k: usize| Action::Backward {
        chunk: (v - 1 - local_chunk(k)) * p + w,
        micro: micro_of(k),
    };
    let mut out: Vec<Action> = (0..warmup).map(forward).collect();
    for k in 0..total - warmup {
        out.push(forward(warmup + k));
        out.push(backward(k));
    }
    out.extend((total - warmup..total).map(backward));
    out
}
