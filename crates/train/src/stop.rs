//! Stopping a run without losing it: a [`StopRequest`] that signals (SIGINT, SIGTERM,
//! SIGUSR1) or the caller set, and that the training loop reads between steps.
//!
//! Why between steps: a step half done has no consistent state to save (the gradients of some
//! replicas reduced, the optimizer of some stages stepped). So the worker finishes the step in
//! flight, every worker agrees on the same last step (one small all-reduce per step, the only
//! cost of being stoppable), writes the checkpoint and ends with
//! [`Summary::stopped`](crate::Summary) set; the command then exits with `128 + signal`, the
//! status a shell reports for a process killed by that signal (130 for Ctrl-C, 143 for
//! SIGTERM). A second SIGINT or SIGTERM exits at once: the user who presses Ctrl-C twice
//! means it. SIGUSR1 — what SLURM sends before a time limit, and what `mpirun` forwards to
//! every rank — only ever asks, so a scheduler's repeated warnings cannot abort a
//! checkpoint being written.

use anyhow::{Context, Result};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

pub use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};

/// A request to stop after the step in flight: the signal that asked (0: none), and whether
/// a second SIGINT/SIGTERM insisted. Clones share the request, so one installed handler
/// reaches every worker thread.
#[derive(Clone, Debug, Default)]
pub struct StopRequest {
    signal: Arc<AtomicUsize>,
    insisted: Arc<AtomicBool>,
}

/// What a second SIGINT or SIGTERM does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SecondSignal {
    /// Exits the process at once (a training process: nothing of its own to clean up).
    Exits,
    /// Sets [`StopRequest::insisted`] (a supervisor, which must end its child job first).
    Insists,
}

impl StopRequest {
    /// A request nothing has made yet (set it with [`StopRequest::request`]).
    pub fn new() -> StopRequest {
        StopRequest::default()
    }

    /// The request SIGINT, SIGTERM and SIGUSR1 make from now on, in this process: the first
    /// of them asks to stop after the step in flight; a later SIGINT or SIGTERM exits at once
    /// with `128 + signal`. Installed once per process (later calls return the same request).
    pub fn on_signals() -> Result<StopRequest> {
        install(SecondSignal::Exits)
    }

    /// [`StopRequest::on_signals`] for a process that supervises a job (`meshtrain
    /// launch`): a second SIGINT or SIGTERM does not exit but sets
    /// [`StopRequest::insisted`], so the supervisor can end its job before it exits rather
    /// than leave it running.
    pub fn on_signals_supervising() -> Result<StopRequest> {
        install(SecondSignal::Insists)
    }

    /// Whether a second SIGINT or SIGTERM came after the first (supervisors only).
    pub fn insisted(&self) -> bool {
        self.insisted.load(Ordering::SeqCst)
    }

    /// Asks to stop after the step in flight, as `signal` would.
    pub fn request(&self, signal: i32) {
        let _ = self.signal.compare_exchange(
            0,
            signal.max(1) as usize,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    /// The signal that asked to stop, if one has.
    pub fn requested(&self) -> Option<i32> {
        match self.signal.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s as i32),
        }
    }
}

/// Installs the process's handlers once (the first call decides what a second signal does).
fn install(second: SecondSignal) -> Result<StopRequest> {
    static INSTALLED: OnceLock<StopRequest> = OnceLock::new();
    if let Some(request) = INSTALLED.get() {
        return Ok(request.clone());
    }
    let request = StopRequest::new();
    let failed = |signal| format!("installing the {} handler", signal_name(signal));
    // One flag for SIGINT and SIGTERM: a SIGTERM after a Ctrl-C is a second signal too.
    let asked = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        match second {
            SecondSignal::Exits => {
                // Registered first, so it runs before the flag below is set: it exits only
                // on a signal after the first.
                signal_hook::flag::register_conditional_shutdown(
                    signal,
                    exit_status(signal),
                    asked.clone(),
                )
                .with_context(|| failed(signal))?;
                signal_hook::flag::register(signal, asked.clone())
                    .with_context(|| failed(signal))?;
            }
            SecondSignal::Insists => {
                let request = request.clone();
                // SAFETY: atomic loads and stores only: async-signal-safe, no allocation, no
                // lock. Registered before the first-signal handler, so it sees the request as
                // the previous signal left it.
                unsafe {
                    signal_hook::low_level::register(signal, move || {
                        if request.requested().is_some() {
                            request.insisted.store(true, Ordering::SeqCst);
                        }
                    })
                }
                .with_context(|| failed(signal))?;
            }
        }
    }
    // A supervisor also stops on SIGHUP (its terminal closed): the job it started runs in a
    // process group of its own, which the terminal's hang-up does not reach.
    let asking: &[i32] = match second {
        SecondSignal::Exits => &[SIGINT, SIGTERM, SIGUSR1],
        SecondSignal::Insists => &[SIGINT, SIGTERM, SIGUSR1, SIGHUP],
    };
    for &signal in asking {
        register_first(signal, &request).with_context(|| failed(signal))?;
    }
    Ok(INSTALLED.get_or_init(|| request).clone())
}

/// Makes `signal` ask `request` to stop ([`StopRequest::request`]: the first signal names the
/// stop), from the signal handler.
fn register_first(signal: i32, request: &StopRequest) -> std::io::Result<()> {
    let request = request.clone();
    // SAFETY: `request` is one atomic compare-exchange: async-signal-safe, no allocation,
    // no lock.
    unsafe { signal_hook::low_level::register(signal, move || request.request(signal)) }.map(|_| ())
}

/// The exit status of a run stopped by `signal`: `128 + signal`, as shells report a process
/// the signal killed (130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1).
pub fn exit_status(signal: i32) -> i32 {
    128 + signal
}

/// `SIGINT`, `SIGTERM`, ... for messages.
pub fn signal_name(signal: i32) -> String {
    match signal {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        SIGUSR1 => "SIGUSR1".into(),
        SIGHUP => "SIGHUP".into(),
        s => format!("signal {s}"),
    }
}

/// Set in the environment of the workers `meshtrain launch` starts: the launcher, not each
/// job, says how to resume.
pub const LAUNCHED_ENV: &str = "MESHTRAIN_LAUNCHED";

/// The command that resumes a stopped run from `checkpoint`: this process's command line
/// `args` (program first) without its `--resume`/`--init-from`, plus `--resume checkpoint`,
/// after `mpirun -np N` when it runs under mpirun.
pub fn resume_command(args: &[String], checkpoint: &Path) -> String {
    let mut kept = without_option(&without_option(args, "--resume"), "--init-from");
    kept.push("--resume".into());
    kept.push(checkpoint.display().to_string());
    let mpi_size = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok());
    let mut words: Vec<String> = match mpi_size {
        Some(n) => vec!["mpirun".into(), "-np".into(), n],
        None => Vec::new(),
    };
    words.extend(kept);
    words
        .iter()
        .map(|w| shell_word(w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `word` as the shell reads it back: quoted when it holds anything but plain characters.
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:,+@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// `args` without the option `name` (`--name VALUE` or `--name=VALUE`).
pub fn without_option(args: &[String], name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        if a == name {
            skip = true;
        } else if !a.starts_with(&format!("{name}=")) {
            out.push(a.clone());
        }
    }
    out
}

/// Whether a periodic checkpoint is due: `every_minutes` since the last one (or the start).
pub(crate) fn checkpoint_due(every_minutes: Option<f64>, since_last: std::time::Duration) -> bool {
    every_minutes.is_some_and(|m| m > 0.0 && since_last.as_secs_f64() >= m * 60.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_first_request_names_the_stop() {
        let stop = StopRequest::new();
        assert_eq!(stop.requested(), None);
        let shared = stop.clone();
        shared.request(SIGTERM);
        stop.request(SIGINT);
        assert_eq!(stop.requested(), Some(SIGTERM));
        assert_eq!(exit_status(SIGINT), 130);
        assert_eq!(exit_status(SIGTERM), 143);
        assert_eq!(signal_name(SIGUSR1), "SIGUSR1");
    }

    #[test]
    fn checkpoints_fall_due_by_time() {
        assert!(!checkpoint_due(None, Duration::from_secs(3600)));
        assert!(!checkpoint_due(Some(0.0), Duration::from_secs(3600)));
        assert!(!checkpoint_due(Some(10.0), Duration::from_secs(599)));
        assert!(checkpoint_due(Some(10.0), Duration::from_secs(600)));
    }
}
