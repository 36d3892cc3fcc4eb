//! Per-worker timelines: what each worker did when (forward, backward, send, waiting for a
//! receive, optimizer, collective communication), as plain data and as Chrome-trace JSON
//! (open in <https://ui.perfetto.dev> or `chrome://tracing`).
//!
//! Any parallel mode records into a [`Timeline`]; the spans of all workers are merged by
//! concatenation. Workers of one process share a time origin (`Instant`) so their spans line
//! up; workers in different processes each measure from their own origin.

use serde_json::{json, Value};
use std::fmt;
use std::time::Instant;

/// What a span of time was spent on. Communication that runs beside compute (a DDP
/// all-reduce on the communication thread) gets its own lane so the two do not overlap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Category {
    Forward,
    Backward,
    /// Posting a send (the transfer itself runs in the background).
    Send,
    /// Blocked in a receive: the pipeline bubble shows up here.
    RecvWait,
    Optimizer,
    /// Collective communication (all-reduce of a gradient bucket, ...).
    Communication,
    /// The compute thread waiting for communication to finish (DDP's last buckets after
    /// backward): exposed communication, on the compute row.
    CommWait,
    Other,
}

impl Category {
    pub fn as_str(&self) -> &'static str {
        match self {
            Category::Forward => "forward",
            Category::Backward => "backward",
            Category::Send => "send",
            Category::RecvWait => "recv-wait",
            Category::Optimizer => "optimizer",
            Category::Communication => "communication",
            Category::CommWait => "comm-wait",
            Category::Other => "other",
        }
    }

    /// Whether the time is useful computation (what the bubble fraction is measured against).
    pub fn is_compute(&self) -> bool {
        matches!(
            self,
            Category::Forward | Category::Backward | Category::Optimizer
        )
    }

    /// 0 = the worker's compute thread, 1 = background communication.
    pub fn lane(&self) -> usize {
        usize::from(*self == Category::Communication)
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One interval of one worker's time, in seconds from the timeline's origin.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub worker: usize,
    /// Short text drawn on the span ("F3", "B3", "recv act 3", "bucket 2").
    pub label: String,
    pub category: Category,
    pub start_s: f64,
    pub end_s: f64,
    /// The micro-batch the span works on, if any.
    pub micro: Option<usize>,
}

impl Span {
    pub fn duration_s(&self) -> f64 {
        self.end_s - self.start_s
    }
}

/// A recorder of one worker's spans.
#[derive(Clone, Debug)]
pub struct Timeline {
    worker: usize,
    origin: Instant,
    spans: Vec<Span>,
}

impl Timeline {
    /// A timeline for `worker`, measuring from `origin` (share it between the workers of a
    /// process so their spans line up).
    pub fn new(worker: usize, origin: Instant) -> Timeline {
        Timeline {
            worker,
            origin,
            spans: Vec::new(),
        }
    }

    pub fn worker(&self) -> usize {
        self.worker
    }

    /// Records a span between two instants.
    pub fn record(
        &mut self,
        label: impl Into<String>,
        category: Category,
        start: Instant,
        end: Instant,
        micro: Option<usize>,
    ) {
        let at = |t: Instant| t.saturating_duration_since(self.origin).as_secs_f64();
        self.spans.push(Span {
            worker: self.worker,
            label: label.into(),
            category,
            start_s: at(start),
            end_s: at(end),
            micro,
        });
    }

    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    pub fn into_spans(self) -> Vec<Span> {
        self.spans
    }

    pub fn clear(&mut self) {
        self.spans.clear();
    }
}

/// Records `f`'s run time as a span when a timeline is given; the one helper executors use
/// so recording stays optional and costs nothing when off.
pub fn timed<R>(
    timeline: &mut Option<&mut Timeline>,
    label: impl FnOnce() -> String,
    category: Category,
    micro: Option<usize>,
    f: impl FnOnce() -> R,
) -> R {
    let start = Instant::now();
    let result = f();
    if let Some(t) = timeline.as_deref_mut() {
        t.record(label(), category, start, Instant::now(), micro);
    }
    result
}

/// The Chrome trace event format: one complete (`"ph": "X"`) event per span, in
/// microseconds, process = worker and thread = lane, with name metadata for each.
pub fn chrome_trace(spans: &[Span]) -> Value {
    let mut events: Vec<Value> = Vec::with_capacity(spans.len() + 8);
    let mut lanes: Vec<(usize, usize)> = spans
        .iter()
        .map(|s| (s.worker, s.category.lane()))
        .collect();
    lanes.sort_unstable();
    lanes.dedup();
    for &(worker, lane) in &lanes {
        events.push(
            json!({"name": "process_name", "ph": "M", "pid": worker, "tid": lane,
            "args": {"name": format!("worker {worker}")}}),
        );
        let lane_name = if lane == 0 {
            "compute"
        } else {
            "communication"
        };
        events.push(
            json!({"name": "thread_name", "ph": "M", "pid": worker, "tid": lane,
            "args": {"name": lane_name}}),
        );
    }
    for s in spans {
        let mut args = json!({"category": s.category.as_str()});
        if let Some(m) = s.micro {
            args["micro"] = json!(m);
        }
        events.push(json!({
            "name": s.label,
            "cat": s.category.as_str(),
            "ph": "X",
            "ts": s.start_s * 1e6,
            "dur": s.duration_s() * 1e6,
            "pid": s.worker,
            "tid": s.category.lane(),
            "args": args,
        }));
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// Writes [`chrome_trace`] to `path`.
pub fn write_chrome_trace(path: &std::path::Path, spans: &[Span]) -> std::io::Result<()> {
    std::fs::write(path, chrome_trace(spans).to_string())
}

/// Fraction of worker time not spent computing between `window` (start, end) seconds:
/// `1 − Σ compute / (workers × window length)`. Compute spans are clipped to the window.
pub fn idle_fraction(spans: &[Span], workers: usize, window: (f64, f64)) -> f64 {
    let length = window.1 - window.0;
    if workers == 0 || length <= 0.0 {
        return 0.0;
    }
    let busy: f64 = spans
        .iter()
        .filter(|s| s.category.is_compute())
        .map(|s| (s.end_s.min(window.1) - s.start_s.max(window.0)).max(0.0))
        .sum();
    1.0 - busy / (workers as f64 * length)
}
