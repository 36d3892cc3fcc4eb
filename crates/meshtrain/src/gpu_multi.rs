//! The `multi` part of `meshtrain bench gpu`: several ranks on this machine's GPUs.
//!
//! With one GPU (the lent machine), ranks share it through [`StagedGroup`] over the threads
//! backend, each collective staged through pinned host memory; with several, rank `r` takes
//! GPU `r % count`. The device conformance suite runs at 1, 2 and 4 ranks (every operation
//! and dtype, sync and async, DDP's buckets, sub-groups), then a staged all-reduce is timed
//! against the bus it crosses.

use anyhow::Result;
use meshtrain_comm::{
    conformance, CommConfig, CudaMemory, DType, DeviceMemory, Operation, ProcessGroup, ReduceOp,
    StagedGroup, ThreadsWorld,
};
use meshtrain_tensor::cuda::CudaDevice;
use std::time::{Duration, Instant};

fn config() -> CommConfig {
    CommConfig::default()
        .with_timeout(Duration::from_secs(60))
        .with_desync_check(true)
}

/// Rank `rank`'s GPU and its staging memory.
fn rank_memory(rank: usize, gpus: usize) -> Result<std::sync::Arc<CudaMemory>, String> {
    let device = CudaDevice::get(rank % gpus).map_err(|e| e.to_string())?;
    Ok(CudaMemory::new(device))
}

/// Runs the part and returns its failures (each also printed as a `FAIL` line).
pub fn run() -> Result<Vec<String>> {
    let gpus = meshtrain_tensor::cuda::probe::device_count().map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("\n== multi: ranks on {gpus} GPU(s), collectives on device buffers");
    let mut failed = Vec::new();
    for ranks in [1, 2, 4] {
        let start = Instant::now();
        let result = ThreadsWorld::run(ranks, config(), move |g| {
            let memory = rank_memory(g.rank(), gpus)?;
            let staged = StagedGroup::new(g, memory.clone());
            conformance::run_device_suite(staged.as_ref(), memory.as_ref())
                .map_err(|e| format!("{e:#}"))
        });
        let line = format!(
            "staged device conformance suite, {ranks} rank(s) over threads on {} GPU(s)",
            gpus.min(ranks)
        );
        match result {
            Ok(_) => println!("ok   {line} ({:.1} s)", start.elapsed().as_secs_f64()),
            Err(e) => {
                println!("FAIL {line}: {e}");
                failed.push(format!("{line}: {e}"));
            }
        }
    }
    match staged_all_reduce_rate(2, gpus, 64 << 20) {
        Ok(line) => println!("{line}"),
        Err(e) => {
            println!("FAIL staged all-reduce timing: {e}");
            failed.push(format!("staged all-reduce timing: {e}"));
        }
    }
    Ok(failed)
}

/// Times an all-reduce of `bytes` of f32 per rank, staged, at `ranks` ranks (median of 5
/// after one warm-up), with the host bus bytes it moves (down and up once per rank).
fn staged_all_reduce_rate(ranks: usize, gpus: usize, bytes: usize) -> Result<String> {
    let times = ThreadsWorld::run(ranks, config(), move |g| {
        let memory = rank_memory(g.rank(), gpus)?;
        let staged = StagedGroup::new(g, memory.clone());
        let buf = memory.alloc(bytes)?;
        let mut times = Vec::new();
        for _ in 0..6 {
            staged.barrier().map_err(|e| e.to_string())?;
            let start = Instant::now();
            // SAFETY: `buf` lives until the call returns; nothing else touches it.
            unsafe {
                let view = buf.view(DType::F32, bytes / 4);
                staged.run_raw(Operation::AllReduce {
                    buf: view,
                    op: ReduceOp::Average,
                })
            }
            .map_err(|e| e.to_string())?;
            times.push(start.elapsed().as_secs_f64());
        }
        times.remove(0);
        times.sort_by(f64::total_cmp);
        Ok::<f64, String>(times[times.len() / 2])
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let median = times[0];
    let mib = bytes as f64 / (1u64 << 20) as f64;
    Ok(format!(
        "staged all_reduce of {mib:.0} MiB f32 at {ranks} ranks: {:.2} ms ({:.1} GB/s over the \
         host bus per rank, down and up)",
        median * 1e3,
        2.0 * bytes as f64 / median / 1e9
    ))
}
