//! Fetching files with the system's `curl` or `wget`.
//!
//! Running an external tool instead of linking an HTTP/TLS stack keeps the
//! dependency tree small and reuses the system's certificates and proxy
//! settings. The payload is checked before it becomes visible: each file is
//! written to a temporary name in the destination directory, verified, then
//! renamed (atomic on one filesystem), so a crash or a concurrent rank never
//! sees a half-written file.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::DataError;
use crate::idx::{read_gz, sha256_hex};

/// Seconds allowed to connect before giving up on a mirror.
const CONNECT_TIMEOUT_S: &str = "20";
/// Seconds allowed for one whole file (the largest is 26 MB).
const MAX_TIME_S: &str = "900";

/// Downloads `url` to `tmp` with curl, or wget when curl is not installed.
fn fetch_with_tool(url: &str, tmp: &Path) -> Result<(), String> {
    let curl = Command::new("curl")
        .args(["--fail", "--silent", "--show-error", "--location"])
        .args([
            "--connect-timeout",
            CONNECT_TIMEOUT_S,
            "--max-time",
            MAX_TIME_S,
        ])
        .arg("--output")
        .arg(tmp)
        .arg(url)
        .output();
    let output = match curl {
        Err(error) if error.kind() == ErrorKind::NotFound => Command::new("wget")
            .args(["--quiet", "--tries=2"])
            .arg(format!("--timeout={CONNECT_TIMEOUT_S}"))
            .arg("--output-document")
            .arg(tmp)
            .arg(url)
            .output()
            .map_err(|error| match error.kind() {
                ErrorKind::NotFound => {
                    "neither `curl` nor `wget` is installed; install one, or pass --data-dir"
                        .to_string()
                }
                _ => format!("cannot run wget: {error}"),
            })?,
        Err(error) => return Err(format!("cannot run curl: {error}")),
        Ok(output) => output,
    };
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{url}: {} ({})",
            String::from_utf8_lossy(&output.stderr).trim(),
            output.status
        ))
    }
}

/// Downloads `file_name` from the first of `base_urls` that serves a file
/// whose *decompressed* SHA-256 is `expected_sha256`, into `dest_dir`.
/// Returns the final path. Nothing is left behind on failure.
pub fn download_verified(
    base_urls: &[String],
    file_name: &str,
    expected_sha256: &str,
    dest_dir: &Path,
) -> Result<PathBuf, DataError> {
    fs::create_dir_all(dest_dir).map_err(|source| DataError::Io {
        path: dest_dir.to_path_buf(),
        source,
    })?;
    if base_urls.is_empty() {
        return Err(DataError::Download {
            reason: "no download mirrors configured".into(),
        });
    }
    let final_path = dest_dir.join(file_name);
    let tmp = dest_dir.join(format!("{file_name}.part-{}", std::process::id()));
    let mut failures = Vec::new();
    for base in base_urls {
        let url = format!("{}/{file_name}", base.trim_end_matches('/'));
        tracing::info!("downloading {url}");
        let attempt = fetch_with_tool(&url, &tmp).and_then(|()| {
            let payload = read_gz(&tmp).map_err(|error| format!("{url}: {error}"))?;
            let actual = sha256_hex(&payload.bytes);
            if actual == expected_sha256 {
                Ok(())
            } else {
                Err(format!(
                    "{url}: SHA-256 of the decompressed payload is {actual}, expected {expected_sha256}"
                ))
            }
        });
        match attempt {
            Ok(()) => {
                return fs::rename(&tmp, &final_path)
                    .map(|()| final_path.clone())
                    .map_err(|source| DataError::Io {
                        path: final_path.clone(),
                        source,
                    });
            }
            Err(reason) => {
                // The temporary file may not exist (tool failed early).
                let _ = fs::remove_file(&tmp);
                failures.push(reason);
            }
        }
    }
    Err(DataError::Download {
        reason: failures.join("; "),
    })
}
