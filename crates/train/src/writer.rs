//! Checkpoints written in the background: the training thread snapshots the state in memory
//! and hands the snapshot to a writer thread, so a step waits for a memory copy instead of
//! the disk.
//!
//! One write is in flight at a time: the next checkpoint (and the end of training) first
//! waits for the previous one, so checkpoints land in order and at most one snapshot is
//! held besides the live state. A failed background write is reported at that wait, as an
//! error naming the file; the file itself is written atomically (see
//! [`crate::checkpoint::replace_atomically`]), so a crash during a background write leaves
//! the previous checkpoint loadable.

use anyhow::{anyhow, Context, Result};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The background checkpoint writer of one worker.
#[derive(Default)]
pub struct CheckpointWriter {
    in_flight: Option<InFlight>,
}

struct InFlight {
    path: PathBuf,
    /// The write's own duration, measured on the writer thread.
    handle: JoinHandle<Result<Duration>>,
}

/// What waiting for a background write found.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Waited {
    /// How long the caller waited for the write to end.
    pub wait: Duration,
    /// How long the write took on the writer thread (zero if none was in flight).
    pub write: Duration,
}

impl CheckpointWriter {
    /// Starts writing `path` with `write` on a writer thread, after waiting for the write
    /// in flight (whose outcome is returned: its error, or how long it made us wait).
    pub fn start(
        &mut self,
        path: PathBuf,
        write: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Result<Waited> {
        let waited = self.wait()?;
        let name = path.display().to_string();
        let handle = std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || {
                let t = Instant::now();
                write().map(|()| t.elapsed())
            })
            .with_context(|| format!("starting the writer thread of checkpoint {name}"))?;
        self.in_flight = Some(InFlight { path, handle });
        Ok(waited)
    }

    /// Waits for the write in flight, if any: its error names the checkpoint.
    pub fn wait(&mut self) -> Result<Waited> {
        let Some(InFlight { path, handle }) = self.in_flight.take() else {
            return Ok(Waited::default());
        };
        let t = Instant::now();
        let outcome = handle
            .join()
            .map_err(|_| anyhow!("the writer thread panicked"))
            .and_then(|written| written);
        let write = outcome.with_context(|| {
            format!(
                "writing checkpoint {} in the background failed",
                path.display()
            )
        })?;
        Ok(Waited {
            wait: t.elapsed(),
            write,
        })
    }

    /// Whether a write is in flight.
    pub fn busy(&self) -> bool {
        self.in_flight.is_some()
    }
}

impl Drop for CheckpointWriter {
    /// A run that stops with an error still finishes the write in flight: the checkpoint it
    /// snapshotted is the newest state a restart can resume from.
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            eprintln!("warning: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_in_order_and_names_the_failed_file() {
        let mut w = CheckpointWriter::default();
        let first = w
            .start("a.safetensors".into(), || {
                std::thread::sleep(Duration::from_millis(30));
                Ok(())
            })
            .unwrap();
        assert_eq!(first, Waited::default());
        // The second start waits for the first write.
        let waited = w
            .start("b.safetensors".into(), || anyhow::bail!("disk full"))
            .unwrap();
        assert!(waited.write >= Duration::from_millis(30), "{waited:?}");
        let err = format!("{:#}", w.wait().unwrap_err());
        assert!(
            err.contains("b.safetensors") && err.contains("disk full"),
            "{err}"
        );
        assert!(!w.busy());
    }
}
