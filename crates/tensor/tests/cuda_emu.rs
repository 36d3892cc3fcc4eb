//! The CUDA kernels (`src/cuda/kernels/*.cu`) tested on the CPU: `tests/cuda_emu/` compiles
//! them as host C++ with g++ against an emulator of the CUDA prelude (`cuda_emu.h`) and runs
//! each `*_test.cpp` (plus the emulator's own selftest) under two thread schedules. See
//! `tests/cuda_emu/run_emu_tests.sh`.
//!
//! Needs `g++` (and `bash`) on PATH; without them the test says "skipped" and passes, since
//! the Rust build itself needs neither.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// `exe` as found on PATH.
fn on_path(exe: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(exe))
        .find(|p| p.is_file())
}

#[test]
fn cuda_kernels_on_cpu_emulator() {
    for exe in ["g++", "bash"] {
        if on_path(exe).is_none() {
            println!("skipped: {exe} not found");
            eprintln!("cuda_emu: skipped: {exe} not found on PATH");
            return;
        }
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emu/run_emu_tests.sh");
    let start = Instant::now();
    let out = Command::new("bash")
        .arg(&script)
        .env_remove("EMU_SCHEDULE") // the script sets it per run
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    println!("cuda_emu: {:.1}s", start.elapsed().as_secs_f64());
    assert!(
        out.status.success(),
        "CUDA kernel tests on the CPU emulator failed ({}):\n{text}",
        out.status
    );
}
