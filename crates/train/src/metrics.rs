//! What a run reports: the step-time breakdown (where the time went and why scaling stops),
//! the summary, and the JSON-lines metrics file.

use anyhow::{Context, Result};
use meshtrain_parallel::{StepStats, StepTimes};
use serde::Serialize;
use std::io::{BufRead, Write};
use std::path::Path;

/// Where a run's step time went (seconds, summed over the run).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Breakdown {
    pub data_s: f64,
    /// Forward, backward, optimizer, communication exposed and hidden, pipeline idle.
    #[serde(flatten)]
    pub times: StepTimes,
    /// Pipeline stages (0 or 1 = no pipeline).
    pub stages: usize,
    /// Tensor-parallel workers per stage (0 or 1 = none).
    pub tensor: usize,
    /// Context-parallel workers per replica (0 or 1 = none).
    pub context: usize,
    pub eval_s: f64,
    /// Time the training thread spent on checkpoints (all of the write when synchronous).
    pub checkpoint_s: f64,
    /// Checkpoints saved, and of `checkpoint_s`: snapshotting the state into memory for a
    /// background write, and waiting for the previous background write to end.
    pub checkpoints: u64,
    pub checkpoint_snapshot_s: f64,
    pub checkpoint_wait_s: f64,
    /// Time the writer thread spent writing (not training time unless waited for).
    pub checkpoint_background_s: f64,
    pub steps: u64,
    /// Workers (dp × pp × cp × tp).
    pub workers: usize,
    /// Hosts the workers run on (1 for the threads backend unless it simulates hosts).
    pub hosts: usize,
    /// DDP's all-reduce, `flat` or `hierarchical`; `None` when the gradients are not
    /// all-reduced by DDP (ZeRO, the single master, one replica).
    pub grad_reduce: Option<&'static str>,
    /// On a GPU: its memory (peak and current bytes of the caching allocator).
    pub device_memory: Option<meshtrain_parallel::DeviceMemory>,
}

impl Breakdown {
    /// Adds one training step's measurements.
    pub fn add(&mut self, s: &StepStats) {
        self.times.add(&s.times);
        self.steps += 1;
    }

    /// The times accumulated since `before` (an earlier copy of the same worker's breakdown):
    /// benchmarks take one after warm-up and report only the timed steps.
    pub fn since(&self, before: &Breakdown) -> Breakdown {
        Breakdown {
            data_s: self.data_s - before.data_s,
            times: self.times.since(&before.times),
            steps: self.steps - before.steps,
            workers: self.workers,
            stages: self.stages,
            tensor: self.tensor,
            context: self.context,
            ..Breakdown::default()
        }
    }

    /// The accumulated times, in a fixed order, for element-wise reductions across workers.
    pub fn times_mut(&mut self) -> [&mut f64; 11] {
        let t = &mut self.times;
        [
            &mut self.data_s,
            &mut t.forward_s,
            &mut t.backward_s,
            &mut t.optimizer_s,
            &mut t.comm_exposed_s,
            &mut t.comm_hidden_s,
            &mut t.pipeline_idle_s,
            &mut t.tp_comm_s,
            &mut t.param_gather_s,
            &mut t.cp_comm_s,
            &mut t.cp_comm_busy_s,
        ]
    }

    pub fn compute_s(&self) -> f64 {
        self.times.forward_s + self.times.backward_s + self.times.optimizer_s
    }

    /// Time of the training steps: compute, exposed communication, pipeline idle time and
    /// data loading.
    pub fn step_s(&self) -> f64 {
        self.compute_s() + self.times.comm_exposed_s + self.times.pipeline_idle_s + self.data_s
    }

    /// Computation-to-synchronisation ratio: compute time per unit of communication time
    /// (hidden or not). Infinite for a single worker.
    pub fn compute_to_comm(&self) -> f64 {
        self.compute_s() / (self.times.comm_exposed_s + self.times.comm_hidden_s)
    }

    /// The per-step averages in the form `meshtrain plan --diagnose` / `--compare` read
    /// (`breakdown.json` of a run).
    pub fn measured_step(&self, samples_per_step: usize) -> serde_json::Value {
        let n = self.steps.max(1) as f64;
        serde_json::json!({
            "workers": self.workers.max(1),
            "compute_s": (self.times.forward_s + self.times.backward_s) / n,
            "comm_exposed_s": self.times.comm_exposed_s / n,
            "comm_hidden_s": self.times.comm_hidden_s / n,
            "bubble_s": self.times.pipeline_idle_s / n,
            "data_s": self.data_s / n,
            "optimizer_s": self.times.optimizer_s / n,
            "step_s": self.step_s() / n,
            "samples_per_step": samples_per_step as f64,
            "hosts": self.hosts.max(1),
            "grad_reduce": self.grad_reduce,
            "device_memory": self.device_memory,
        })
    }

    pub fn report(&self) -> String {
        let n = self.steps.max(1) as f64;
        let ms = |s: f64| s / n * 1e3;
        let per_replica = self.stages.max(1) * self.tensor.max(1) * self.context.max(1);
        let dp_workers = self.workers / per_replica;
        // Gradients are averaged over the replicas and their context-parallel workers.
        let sync_workers = dp_workers * self.context.max(1);
        let comm = if sync_workers <= 1 && per_replica > 1 {
            "no data-parallel communication (one replica)".to_string()
        } else if sync_workers <= 1 {
            "communication 0 (single worker)".to_string()
        } else {
            let total = self.times.comm_exposed_s + self.times.comm_hidden_s;
            format!(
                "communication {:.1} ms exposed + {:.1} ms hidden by overlap ({:.0}% hidden, {:.1} MB/step); \
                 compute/communication ratio {:.1}",
                ms(self.times.comm_exposed_s),
                ms(self.times.comm_hidden_s),
                if total > 0.0 { 100.0 * self.times.comm_hidden_s / total } else { 0.0 },
                self.times.comm_bytes as f64 / n / 1e6,
                self.compute_to_comm()
            )
        };
        // Pipeline runs report the mean over all workers (stages differ).
        // Communication that forward and backward waited in (part of the compute time).
        let in_compute = if self.times.tp_comm_elems > 0 {
            format!(
                "; tensor-parallel collectives {:.1} ms of the compute ({:.1} M elements/step)",
                ms(self.times.tp_comm_s),
                self.times.tp_comm_elems as f64 / n / 1e6
            )
        } else {
            String::new()
        };
        let in_compute = if self.times.cp_comm_elems > 0 {
            let (exposed, busy) = (self.times.cp_comm_s, self.times.cp_comm_busy_s);
            let hidden = meshtrain_parallel::context::CpComm::hidden_fraction(exposed, busy);
            format!(
                "{in_compute}; context-parallel attention waited {:.1} ms of the compute for \
                 transfers that ran {:.1} ms ({:.0}% hidden; {:.1} M elements/step sent)",
                ms(exposed),
                ms(busy),
                100.0 * hidden,
                self.times.cp_comm_elems as f64 / n / 1e6
            )
        } else {
            in_compute
        };
        let in_compute = if self.times.param_gather_s > 0.0 {
            format!(
                "{in_compute}; of the exposed communication, ZeRO-3 parameter all-gathers \
                 {:.1} ms",
                ms(self.times.param_gather_s)
            )
        } else {
            in_compute
        };
        let (layout, pipeline) = if per_replica > 1 {
            let tp = match self.tensor {
                0 | 1 => String::new(),
                t => format!(" × tp {t}"),
            };
            let tp = match self.context {
                0 | 1 => tp,
                c => format!(" × cp {c}{tp}"),
            };
            (
                format!(
                    "{} workers = dp {dp_workers} × pp {}{tp}, mean over workers",
                    self.workers,
                    self.stages.max(1)
                ),
                if self.stages > 1 {
                    format!(
                        " + pipeline idle (bubble, transfers) {:.1} ms ({:.0}% of the step)",
                        ms(self.times.pipeline_idle_s),
                        100.0 * self.times.pipeline_idle_s / self.step_s().max(1e-12)
                    )
                } else {
                    String::new()
                },
            )
        } else {
            let s = if self.workers > 1 { "s" } else { "" };
            (format!("{} worker{s}", self.workers.max(1)), String::new())
        };
        format!(
            "per step ({layout}): {:.1} ms = compute {:.1} ms (forward {:.1}, backward {:.1}, optimizer {:.1}) \
             + exposed communication {:.1} ms{pipeline} + data {:.1} ms; {comm}{in_compute}; eval {:.1} s, {}",
            ms(self.step_s()),
            ms(self.compute_s()),
            ms(self.times.forward_s),
            ms(self.times.backward_s),
            ms(self.times.optimizer_s),
            ms(self.times.comm_exposed_s),
            ms(self.data_s),
            self.eval_s,
            self.checkpoint_report()
        ) + &self
            .device_memory
            .as_ref()
            .map_or(String::new(), |m| format!("; {}", m.report()))
    }

    /// What checkpoints cost the training thread: with background writes, the snapshots and
    /// the waits for the writer, beside what the writer spent.
    pub fn checkpoint_report(&self) -> String {
        let total = format!(
            "checkpoints {:.2} s in total ({} saved",
            self.checkpoint_s, self.checkpoints
        );
        if self.checkpoint_background_s == 0.0 && self.checkpoint_snapshot_s == 0.0 {
            return total + ")";
        }
        format!(
            "{total}; snapshots {:.3} s + waiting for the writer {:.3} s on the training \
             thread, {:.2} s written in the background)",
            self.checkpoint_snapshot_s, self.checkpoint_wait_s, self.checkpoint_background_s
        )
    }
}

/// What a finished run reports.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub steps: u64,
    pub final_train_loss: f32,
    /// Correct predictions per target at the last evaluation (losses that count them).
    pub test_accuracy: Option<f64>,
    /// Last evaluation loss.
    pub eval_loss: Option<f64>,
    /// The evaluation set's reference loss, if it has one (text: the unigram entropy, the
    /// loss of a model that ignores context).
    pub unigram_baseline: Option<f64>,
    pub samples_per_s: f64,
    /// Peak resident memory of the largest process of the world (all workers are one
    /// process on the threads backend, one process each under mpirun).
    pub peak_rss_mb: Option<f64>,
    /// World rank 0's model-state memory, measured and predicted.
    pub memory: crate::memory::MemoryReport,
    pub breakdown: Breakdown,
    pub wall_s: f64,
    /// The layout the run used, in the form `meshtrain plan --layout` reads.
    pub layout: String,
    /// The world rank that returned this summary (under `mpirun` every process returns one;
    /// rank 0 is the one to print).
    #[serde(skip)]
    pub rank: usize,
    /// `train.cuda_graph`: how many steps ran as replays of the captured CUDA graphs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_replays: Option<u64>,
    /// Set when a signal (or the caller's [`crate::StopRequest`]) stopped the run before its
    /// end: it finished the step in flight and saved this checkpoint, to resume from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<Stopped>,
}

/// How a run that was asked to stop ended.
#[derive(Clone, Debug, Serialize)]
pub struct Stopped {
    /// The signal that asked (SIGINT = 2, SIGTERM = 15, SIGUSR1 = 10).
    pub signal: i32,
    /// The step every worker stopped after (the checkpoint's step).
    pub step: u64,
    /// The checkpoint written at that step.
    pub checkpoint: std::path::PathBuf,
}

#[derive(Serialize)]
pub(crate) struct TrainRecord {
    pub kind: &'static str,
    pub step: u64,
    pub epoch: f64,
    pub loss: f32,
    pub lr: f32,
    pub grad_norm: f32,
    /// fp16: the loss scale after this step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
    /// fp16: steps skipped so far for overflowed gradients.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
    pub samples_per_s: f64,
    pub elapsed_s: f64,
}

#[derive(Serialize)]
pub(crate) struct EvalRecord {
    pub kind: &'static str,
    pub step: u64,
    pub epoch: f64,
    pub loss: f64,
    pub accuracy: Option<f64>,
    pub perplexity: Option<f64>,
    pub unigram_baseline: Option<f64>,
}

/// The run's `metrics.jsonl`: a fresh run starts it anew, a resumed run keeps the records
/// up to the step it resumes from (dropping what a crashed run logged after its checkpoint,
/// and the old summary) and appends.
pub(crate) struct MetricsFile {
    file: std::fs::File,
    /// The same scalars as TensorBoard events, when the run asked for them.
    tensorboard: Option<crate::tensorboard::EventWriter>,
}

impl MetricsFile {
    /// Opens `path` (keeping the records up to `resumed_at` of a resumed run) and, with
    /// `tensorboard`, a new event file in that directory.
    pub fn open(
        path: &Path,
        resumed_at: Option<u64>,
        tensorboard: Option<&Path>,
    ) -> Result<MetricsFile> {
        let kept: Vec<String> = match (resumed_at, std::fs::File::open(path)) {
            (Some(step), Ok(f)) => std::io::BufReader::new(f)
                .lines()
                .map_while(|l| l.ok())
                .filter(|line| {
                    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
                    v["kind"] != "summary" && v["step"].as_u64().is_some_and(|s| s <= step)
                })
                .collect(),
            _ => Vec::new(),
        };
        let mut file =
            std::fs::File::create(path).with_context(|| format!("opening {}", path.display()))?;
        for line in kept {
            writeln!(file, "{line}").with_context(|| format!("writing {}", path.display()))?;
        }
        let tensorboard = tensorboard
            .map(crate::tensorboard::EventWriter::create)
            .transpose()?;
        Ok(MetricsFile { file, tensorboard })
    }

    /// Writes `record` as one JSON line, and its numbers as TensorBoard scalars at `step`.
    pub fn write<T: Serialize>(&mut self, record: &T, step: u64) -> Result<()> {
        serde_json::to_writer(&mut self.file, record)?;
        self.file.write_all(b"\n")?;
        if let Some(events) = &mut self.tensorboard {
            let scalars = crate::tensorboard::record_scalars(&serde_json::to_value(record)?);
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            events.add_scalars(step, now, &scalars)?;
        }
        Ok(())
    }
}

/// Peak resident memory of this process (Linux `VmHWM`), in MiB.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
