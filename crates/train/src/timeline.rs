//! The step timeline of a run (`timeline = "step.json"`): every worker records the last
//! training step (forward, backward, sends, receive waits — the pipeline bubble —, the
//! data-parallel wait, the optimizer), rank 0 merges them into one Chrome trace and draws a
//! Gantt chart of it next to it.

use anyhow::{Context, Result};
use meshtrain_chart::{Color, Span as ChartSpan, Timeline as Chart, TimelineRow};
use meshtrain_comm::{BufMut, ProcessGroup};
use meshtrain_parallel::timeline::{chrome_trace, Category, Timeline};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A worker's timeline, where it goes, and its origin on the system clock (Unix seconds):
/// workers in other processes have other `Instant` origins, and the system clock — shared by
/// the processes of one machine, NTP-close across machines — puts their spans on one axis.
pub(crate) struct RecordedTimeline {
    pub timeline: Timeline,
    pub path: PathBuf,
    origin_unix_s: f64,
}

impl RecordedTimeline {
    /// Starts recording on every worker of `world` (a collective: origins are taken right
    /// after a barrier, only to keep the numbers small).
    pub fn start(world: &dyn ProcessGroup, path: &Path) -> Result<RecordedTimeline> {
        world
            .barrier()
            .context("synchronising the timeline origin")?;
        let origin = Instant::now();
        let origin_unix_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Ok(RecordedTimeline {
            timeline: Timeline::new(world.rank(), origin),
            path: path.to_path_buf(),
            origin_unix_s,
        })
    }

    /// Merges every worker's spans on rank 0 and writes the trace and its chart there.
    pub fn finish(&self, world: &dyn ProcessGroup, title: &str, pp: usize) -> Result<()> {
        if let Some(events) = collect_trace_events(world, self)? {
            let trace = json!({ "traceEvents": events, "displayTimeUnit": "ms" });
            write_trace_and_chart(&self.path, &trace, title, pp)?;
        }
        Ok(())
    }
}

/// Every worker's Chrome-trace events on world rank 0 (`None` elsewhere), shifted onto rank
/// 0's time axis. The events travel as JSON text, one byte per f32 (exact), so this works on
/// any backend.
fn collect_trace_events(
    world: &dyn ProcessGroup,
    recorded: &RecordedTimeline,
) -> Result<Option<Vec<Value>>> {
    const TAG: u32 = 1;
    let events = |trace: Value| match trace {
        Value::Object(mut o) => match o.remove("traceEvents") {
            Some(Value::Array(a)) => a,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    };
    let mine = events(chrome_trace(recorded.timeline.spans()));
    if world.rank() != 0 {
        let message = json!({ "origin_unix_s": recorded.origin_unix_s, "events": mine });
        let bytes: Vec<f32> = serde_json::to_vec(&message)?
            .into_iter()
            .map(f32::from)
            .collect();
        anyhow::ensure!(
            bytes.len() < 1 << 24,
            "timeline of rank {} too large to send",
            world.rank()
        );
        world.send((&[bytes.len() as f32][..]).into(), 0, TAG)?;
        world.send((&bytes).into(), 0, TAG)?;
        return Ok(None);
    }
    let mut all = mine;
    for src in 1..world.size() {
        let mut len = [0.0f32];
        world.recv(BufMut::F32(&mut len), src, TAG)?;
        let mut bytes = vec![0.0f32; len[0] as usize];
        world.recv(BufMut::F32(&mut bytes), src, TAG)?;
        let text: Vec<u8> = bytes.into_iter().map(|b| b as u8).collect();
        let mut theirs: Value = serde_json::from_slice(&text)
            .with_context(|| format!("timeline from rank {src} is not valid JSON"))?;
        let shift_us =
            (theirs["origin_unix_s"].as_f64().unwrap_or(0.0) - recorded.origin_unix_s) * 1e6;
        if let Value::Array(events) = theirs["events"].take() {
            for mut e in events {
                if let Some(ts) = e["ts"].as_f64() {
                    e["ts"] = json!(ts + shift_us);
                }
                all.push(e);
            }
        }
    }
    Ok(Some(all))
}

/// Writes the Chrome trace to `path` and a Gantt chart of it next to it (`.png`).
pub fn write_trace_and_chart(path: &Path, trace: &Value, title: &str, pp: usize) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, trace.to_string())
        .with_context(|| format!("writing the timeline {}", path.display()))?;
    let png = path.with_extension("png");
    meshtrain_chart::timeline(&png, &trace_chart(trace, title, pp)?)
        .with_context(|| format!("drawing {}", png.display()))?;
    Ok(())
}

/// A Gantt chart of a Chrome trace written by [`chrome_trace`]: one row per (worker, lane),
/// spans coloured by category (receive waits — the bubble — in grey), time from the first
/// span. Worker `w` is stage `w % pp` of replica `w / pp`.
pub fn trace_chart(trace: &Value, title: &str, pp: usize) -> Result<Chart> {
    let events = trace["traceEvents"]
        .as_array()
        .context("not a Chrome trace: no traceEvents")?;
    let spans: Vec<(u64, u64, ChartSpan)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            let us = |k: &str| e[k].as_f64().unwrap_or(0.0);
            let span = ChartSpan {
                start_s: us("ts") * 1e-6,
                end_s: (us("ts") + us("dur")) * 1e-6,
                category: e["cat"].as_str().unwrap_or("other").to_string(),
                label: e["name"].as_str().map(str::to_string),
            };
            let id = |k: &str| e[k].as_u64().unwrap_or(0);
            (id("pid"), id("tid"), span)
        })
        .collect();
    let t0 = spans
        .iter()
        .map(|s| s.2.start_s)
        .fold(f64::INFINITY, f64::min);
    let mut lanes: Vec<(u64, u64)> = spans.iter().map(|s| (s.0, s.1)).collect();
    lanes.sort_unstable();
    lanes.dedup();
    let pp = pp.max(1) as u64;
    let rows = lanes
        .into_iter()
        .map(|(pid, tid)| TimelineRow {
            label: match tid {
                0 => format!("rank {pid} (dp {}, stage {})", pid / pp, pid % pp),
                _ => format!("rank {pid} dp comm"),
            },
            spans: spans
                .iter()
                .filter(|s| (s.0, s.1) == (pid, tid))
                .map(|s| ChartSpan {
                    start_s: s.2.start_s - t0,
                    end_s: s.2.end_s - t0,
                    ..s.2.clone()
                })
                .collect(),
        })
        .collect();
    Ok(Chart {
        title: title.to_string(),
        rows,
        category_colors: vec![(Category::RecvWait.as_str().to_string(), Color::IDLE_GREY)],
        ..Chart::default()
    })
}
