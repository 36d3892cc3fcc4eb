//! Test support shared by the crates whose GPU tests also run on the emulated CUDA device
//! (README.md beside this file): included with `#[path]` from their `tests/`, so one copy
//! builds the device and reruns a test binary on it. Every crate lives at `crates/NAME`, so
//! the device's folder is found from the including crate's manifest.

use std::path::PathBuf;

/// The emulated CUDA device, built once into the test target's scratch folder: its folder,
/// or `None` where this machine cannot build it (no g++ or no CUDA headers, or a test binary
/// carried away from its sources, as to the GPU machine: the reason printed), which
/// `MESHTRAIN_REQUIRE_EMU_DEVICE=1` turns into a failure.
#[allow(dead_code)]
pub fn emulated_device() -> Option<PathBuf> {
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tensor/tests/cuda_emu/device/build.sh");
    if !script.exists() {
        assert!(
            std::env::var("MESHTRAIN_REQUIRE_EMU_DEVICE").as_deref() != Ok("1"),
            "MESHTRAIN_REQUIRE_EMU_DEVICE=1 but {} is missing",
            script.display()
        );
        eprintln!(
            "skipped: the emulated CUDA device's sources are not here ({})",
            script.display()
        );
        return None;
    }
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu-device");
    let built = std::process::Command::new("bash")
        .arg(&script)
        .arg(&out)
        .output()
        .expect("running bash");
    let stderr = String::from_utf8_lossy(&built.stderr);
    match built.status.code() {
        Some(0) => Some(out),
        Some(2) => {
            assert!(
                std::env::var("MESHTRAIN_REQUIRE_EMU_DEVICE").as_deref() != Ok("1"),
                "MESHTRAIN_REQUIRE_EMU_DEVICE=1 but the emulated device cannot be built: {stderr}"
            );
            eprintln!("skipped: the emulated CUDA device cannot be built here: {stderr}");
            None
        }
        _ => panic!("building the emulated CUDA device failed:\n{stderr}"),
    }
}

/// Runs this test binary again with the tests named `tests` on the emulated CUDA device
/// (`MESHTRAIN_REQUIRE_GPU=1`, so they cannot skip; `env` adds settings such as
/// `EMU_DEVICE_COUNT`), and fails with their output unless every one passes. `false` when
/// the device cannot be built here (skipped) or when this process already is such a run.
#[allow(dead_code)]
pub fn rerun_on_the_emulated_device_with(tests: &[&str], env: &[(&str, &str)]) -> bool {
    rerun_on_the_emulated_device_concurrently(&[(tests, env)])
}

/// One rerun: the tests, and the settings added to the environment.
pub type Rerun<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);

/// Several reruns ([`rerun_on_the_emulated_device_with`]'s `tests` and `env` each) as
/// processes side by side: an emulated run keeps about one core busy, and the test binary
/// around it is mostly waiting, so on CI's two cores two runs take the time of one.
#[allow(dead_code)]
pub fn rerun_on_the_emulated_device_concurrently(runs: &[Rerun]) -> bool {
    if std::env::var_os("MESHTRAIN_ON_EMULATED_DEVICE").is_some() {
        return false;
    }
    if std::path::Path::new("/proc/driver/nvidia").exists() {
        // The tests themselves ran on the real GPU; the card's minutes are not for this.
        eprintln!("skipped: this machine has an NVIDIA driver, so the tests ran on its GPU");
        return false;
    }
    // Built once, before the runs start (they would race to build it).
    let Some(device) = emulated_device() else {
        return false;
    };
    std::thread::scope(|s| {
        let runs: Vec<_> = runs
            .iter()
            .map(|&(tests, env)| s.spawn(|| rerun_one(&device, tests, env)))
            .collect();
        for run in runs {
            if let Err(failure) = run.join() {
                std::panic::resume_unwind(failure);
            }
        }
    });
    true
}

fn rerun_one(device: &std::path::Path, tests: &[&str], env: &[(&str, &str)]) {
    let start = std::time::Instant::now();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "--test-threads", "1", "--nocapture"])
        .args(tests)
        .env("LD_LIBRARY_PATH", device)
        .env("CUDA_INCLUDE_DIRS", device.join("include"))
        .env("MESHTRAIN_KERNEL_CACHE", "off")
        .env("MESHTRAIN_REQUIRE_GPU", "1")
        .env("MESHTRAIN_ON_EMULATED_DEVICE", "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let settings: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let settings = if settings.is_empty() {
        "its defaults".to_string()
    } else {
        settings.join(" ")
    };
    assert!(
        out.status.success(),
        "on the emulated CUDA device ({settings}):\n{text}"
    );
    let passed = format!("{} passed", tests.len());
    assert!(
        text.contains(&passed),
        "expected {passed} ({settings}):\n{text}"
    );
    eprintln!(
        "on the emulated CUDA device ({settings}): {} in {:.1} s",
        tests.join(", "),
        start.elapsed().as_secs_f64()
    );
}

/// [`rerun_on_the_emulated_device_with`] with the device's own settings.
#[allow(dead_code)]
pub fn rerun_on_the_emulated_device(tests: &[&str]) -> bool {
    rerun_on_the_emulated_device_with(tests, &[])
}
