//! NCCL itself with two ranks on one GPU: refused up to NCCL 2.29 ("Duplicate GPU detected"),
//! allowed from 2.30 with `NCCL_MULTI_RANK_GPU_ENABLE=1` (experimental, at most two ranks per
//! GPU). Its own test binary, so the variable is set before NCCL reads its settings (once per
//! process). Skipped without a GPU, without NCCL, and below 2.30 (the lent machine had
//! 2.28.9), saying which.
#![cfg(feature = "cuda")]

use meshtrain_comm::{
    conformance, nccl_available, CommConfig, CudaMemory, NcclGroup, ProcessGroup, ThreadsWorld,
};
use meshtrain_tensor::cuda::{probe, CudaDevice};
use std::time::Duration;

#[test]
fn device_conformance_suite_with_two_ranks_on_one_gpu() {
    if !probe::gpu_available() {
        eprintln!("skipped: no GPU driver or device on this machine");
        return;
    }
    let version = match nccl_available() {
        Ok(version) => version,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    if (version.major, version.minor) < (2, 30) {
        eprintln!("skipped: NCCL {version} refuses two ranks on one GPU (2.30 allows two)");
        return;
    }
    std::env::set_var("NCCL_MULTI_RANK_GPU_ENABLE", "1");
    let config = CommConfig::default()
        .with_timeout(Duration::from_secs(60))
        .with_desync_check(true);
    ThreadsWorld::run(2, config.clone(), move |bootstrap| {
        let device = CudaDevice::get(0).map_err(|e| e.to_string())?;
        let g = NcclGroup::from_bootstrap(bootstrap.as_ref(), device.clone(), config.clone())
            .map_err(|e| e.to_string())?;
        conformance::run_device_suite(g.as_ref(), CudaMemory::new(device).as_ref())
            .map_err(|e| format!("rank {}: {e:#}", g.rank()))
    })
    .unwrap_or_else(|e| panic!("{e}"));
}
