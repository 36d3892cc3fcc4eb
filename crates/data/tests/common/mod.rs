//! Helpers shared by the integration tests: scratch directories and
//! hand-built IDX `.gz` files.
#![allow(dead_code)] // each test binary uses a different part of this module

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use flate2::write::GzEncoder;
use flate2::Compression;
use meshtrain_data::fashion::{FILE_NAMES, SYSTEM_DIR};

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "meshtrain-data-{label}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

pub fn write_gz(path: &Path, bytes: &[u8]) {
    fs::write(path, gzip(bytes)).unwrap();
}

/// An unsigned-byte IDX file: header for `dims`, then `payload` as given
/// (which may deliberately disagree with `dims`).
pub fn idx_bytes(dims: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut bytes = vec![0, 0, 0x08, dims.len() as u8];
    for dim in dims {
        bytes.extend_from_slice(&dim.to_be_bytes());
    }
    bytes.extend_from_slice(payload);
    bytes
}

/// The shipped subset directory of this repository.
pub fn subset_dir() -> PathBuf {
    meshtrain_data::fashion::shipped_subset_dir()
}

/// Debian's directory if the package is installed, else prints why the
/// caller skips.
pub fn debian_dir(test: &str) -> Option<PathBuf> {
    let dir = PathBuf::from(SYSTEM_DIR);
    if FILE_NAMES.iter().all(|name| dir.join(name).is_file()) {
        Some(dir)
    } else {
        println!(
            "SKIPPED {test}: {SYSTEM_DIR} absent (apt-get install dataset-fashion-mnist to run it)"
        );
        None
    }
}

/// Copies the four shipped-subset files into `dir`.
pub fn copy_subset_into(dir: &Path) {
    for name in FILE_NAMES {
        fs::copy(subset_dir().join(name), dir.join(name)).unwrap();
    }
}

/// Creates empty placeholder files (enough for `resolve`, which only looks
/// at presence).
pub fn touch_files(dir: &Path, names: &[&str]) {
    for name in names {
        fs::write(dir.join(name), b"").unwrap();
    }
}
