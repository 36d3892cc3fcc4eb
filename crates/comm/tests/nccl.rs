//! The NCCL backend on a real GPU. Every test returns early (saying why) on a machine without
//! a GPU driver or without libnccl.so.2, so `cargo test` passes on CPU-only machines; on the
//! lent GPU machine (`source ../shared/gpu/cuda-libs.sh` for the libraries) they run.
//!
//! One GPU allows only one rank per communicator (NCCL refuses two ranks on one GPU), so the
//! conformance suite runs on a world of one; with two or more GPUs it also runs on a world
//! of one rank per GPU, and a rank that never arrives must time out the others. The
//! watchdog's timeout path on one GPU is in `tests/nccl_timeout.rs` (its own process: it
//! aborts a communicator with work queued).
//!
//! Everywhere g++ and CUDA's headers are, these tests also run on the emulated CUDA device
//! with its emulated NCCL and two devices (`crates/tensor/tests/cuda_emu/device`), so the
//! backend's host side runs in CI.
#![cfg(feature = "cuda")]

#[path = "../../tensor/tests/cuda_emu/device/rerun.rs"]
mod emulated;

use meshtrain_comm::{
    conformance, nccl_available, CommConfig, CommError, CudaMemory, DType, Device, NcclGroup,
    Operation, ProcessGroup, RawBuf, ReduceOp, ThreadsWorld,
};
use meshtrain_tensor::cuda::{probe, CudaDevice};
use std::sync::Arc;
use std::time::Duration;

/// The GPU and NCCL, or `None` after saying why the test is skipped (a failure under
/// `MESHTRAIN_REQUIRE_GPU=1`).
fn gpu(test: &str) -> Option<Arc<CudaDevice>> {
    let skip = |why: String| {
        assert!(
            std::env::var("MESHTRAIN_REQUIRE_GPU").as_deref() != Ok("1"),
            "{test}: MESHTRAIN_REQUIRE_GPU=1, but {why}"
        );
        eprintln!("{test}: skipped, {why}");
        None
    };
    if !probe::gpu_available() {
        return skip("no GPU driver or device on this machine".into());
    }
    if let Err(why) = nccl_available() {
        return skip(why);
    }
    match CudaDevice::get(0) {
        Ok(device) => Some(device),
        Err(e) => skip(format!("the GPU cannot be opened: {e}")),
    }
}

/// The GPU count, when this machine has a GPU, NCCL and at least two GPUs.
fn gpus(test: &str) -> Option<usize> {
    gpu(test)?;
    let count = probe::device_count().unwrap_or(0);
    if count < 2 {
        eprintln!("{test}: skipped, {count} GPU(s)");
        return None;
    }
    Some(count)
}

/// The tests below on the emulated device with two GPUs: every operation and type over the
/// emulated NCCL at one and two ranks, the abort, a rank that never comes. Once with every
/// call done when it returns, once with each stream on a thread of its own and random delays
/// (where a missing wait between the compute and communication streams reads stale data).
#[test]
fn the_nccl_tests_pass_on_the_emulated_device() {
    let tests = [
        "device_conformance_suite_on_a_world_of_one",
        "device_conformance_suite_on_one_rank_per_gpu",
        "the_compute_stream_waits_for_started_operations_without_the_host",
        "host_buffers_and_other_devices_are_refused_by_name",
        "an_aborted_communicator_breaks_the_group",
        "a_rank_that_never_arrives_times_out_on_the_others",
    ];
    if emulated::rerun_on_the_emulated_device_with(&tests, &[("EMU_DEVICE_COUNT", "2")]) {
        emulated::rerun_on_the_emulated_device_with(
            &tests,
            &[
                ("EMU_DEVICE_COUNT", "2"),
                ("EMU_DEVICE_STREAMS", "async"),
                ("EMU_DEVICE_STREAM_DELAY_US", "200"),
            ],
        );
    }
}

fn config() -> CommConfig {
    CommConfig::default()
        .with_timeout(Duration::from_secs(60))
        .with_desync_check(true)
}

/// A one-rank NCCL group on `device`, bootstrapped by a one-rank threads world.
fn world_of_one(device: &Arc<CudaDevice>, config: CommConfig) -> Arc<NcclGroup> {
    let bootstrap = ThreadsWorld::single(config.clone());
    NcclGroup::from_bootstrap(bootstrap.as_ref(), device.clone(), config)
        .unwrap_or_else(|e| panic!("a one-rank NCCL group: {e}"))
}

#[test]
fn without_a_driver_or_nccl_the_error_names_the_library() {
    match nccl_available() {
        Ok(version) => eprintln!("NCCL {version} loads here"),
        Err(why) => assert!(
            why.contains("libcuda.so.1") || why.contains("libnccl.so.2"),
            "{why}"
        ),
    }
}

#[test]
fn device_conformance_suite_on_a_world_of_one() {
    let Some(device) = gpu("device_conformance_suite_on_a_world_of_one") else {
        return;
    };
    let memory = CudaMemory::new(device.clone());
    for check_desync in [true, false] {
        let g = world_of_one(&device, config().with_desync_check(check_desync));
        conformance::run_device_suite(g.as_ref(), memory.as_ref())
            .unwrap_or_else(|e| panic!("desync check {check_desync}: {e:#}"));
        assert!(g.broken().is_none());
    }
}

#[test]
fn device_conformance_suite_on_one_rank_per_gpu() {
    let Some(count) = gpus("device_conformance_suite_on_one_rank_per_gpu") else {
        return;
    };
    ThreadsWorld::run(count, config(), |bootstrap| {
        let device = CudaDevice::get(bootstrap.rank()).map_err(|e| e.to_string())?;
        let g = NcclGroup::from_bootstrap(bootstrap.as_ref(), device.clone(), config())
            .map_err(|e| e.to_string())?;
        conformance::run_device_suite(g.as_ref(), CudaMemory::new(device).as_ref())
            .map_err(|e| format!("{e:#}"))
    })
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The compute stream waits for an asynchronous all-reduce on the device: a read through the
/// compute stream sees its result without `Work::wait` first.
#[test]
fn the_compute_stream_waits_for_started_operations_without_the_host() {
    let Some(device) = gpu("the_compute_stream_waits_for_started_operations_without_the_host")
    else {
        return;
    };
    let g = world_of_one(&device, config());
    let values: Vec<f32> = (0..1 << 20).map(|i| (i % 97) as f32).collect();
    let buf = device.upload(&values, "all-reduce input").unwrap();
    // SAFETY: `buf` lives until the Work is waited on below.
    let work = unsafe {
        g.all_reduce_async(
            RawBuf::on_device(buf.ptr(), values.len(), DType::F32, Device::Cuda(0)),
            ReduceOp::Max,
        )
        .unwrap()
    };
    g.compute_stream_waits().unwrap();
    // A world of one: the maximum over one rank is the input, bit for bit.
    assert_eq!(
        device.download::<f32>(buf.ptr(), values.len()).unwrap(),
        values
    );
    work.wait().unwrap();
}

#[test]
fn host_buffers_and_other_devices_are_refused_by_name() {
    let Some(device) = gpu("host_buffers_and_other_devices_are_refused_by_name") else {
        return;
    };
    let g = world_of_one(&device, config());
    let mut host = vec![1f32; 8];
    match g.all_reduce((&mut host).into(), ReduceOp::Sum) {
        Err(CommError::InvalidBuffer { ctx, details }) => {
            assert_eq!(ctx.op, "all_reduce");
            assert!(details.contains("host memory"), "{details}");
        }
        other => panic!("a host buffer on NCCL gave {other:?}"),
    }
    // SAFETY: refused before anything touches the (made-up) address.
    let elsewhere = unsafe { RawBuf::on_device(0x1000, 4, DType::F32, Device::Cuda(7)) };
    let err = unsafe {
        g.run_raw(Operation::AllReduce {
            buf: elsewhere,
            op: ReduceOp::Sum,
        })
    }
    .unwrap_err();
    assert!(err.to_string().contains("cuda:7"), "{err}");
    // Still usable.
    g.barrier().unwrap();
}

/// `ncclCommAbort` of a live communicator, then every operation fails as broken, naming the
/// cause; the group is dropped cleanly afterwards.
#[test]
fn an_aborted_communicator_breaks_the_group() {
    let Some(device) = gpu("an_aborted_communicator_breaks_the_group") else {
        return;
    };
    let g = world_of_one(&device, config());
    g.barrier().unwrap();
    g.abort("the test aborts it");
    let cause = g.broken().expect("broken after an abort");
    assert!(
        cause.contains("the test aborts it") && cause.contains("ncclCommAbort"),
        "{cause}"
    );
    match g.barrier() {
        Err(CommError::Broken { ctx, cause }) => {
            assert_eq!(ctx.op, "barrier");
            assert!(cause.contains("aborted"), "{cause}");
        }
        other => panic!("a barrier after the abort gave {other:?}"),
    }
    drop(g);
    // The device is still usable.
    let buf = device.upload(&[1f32, 2.0], "after the abort").unwrap();
    assert_eq!(
        device.download::<f32>(buf.ptr(), 2).unwrap(),
        vec![1.0, 2.0]
    );
}

/// A rank that never calls the collective (crashed, or stuck elsewhere): NCCL's kernels on
/// the others wait for it forever, so their watchdog must abort the communicator after the
/// timeout and fail the operation by name and sequence number; every later operation fails
/// as broken.
#[test]
fn a_rank_that_never_arrives_times_out_on_the_others() {
    let Some(_) = gpus("a_rank_that_never_arrives_times_out_on_the_others") else {
        return;
    };
    let timeout = Duration::from_millis(300);
    let config = config().with_timeout(timeout);
    let started = std::time::Instant::now();
    ThreadsWorld::run(2, config.clone(), move |bootstrap| {
        let rank = bootstrap.rank();
        let device = CudaDevice::get(rank).map_err(|e| e.to_string())?;
        let g = NcclGroup::from_bootstrap(bootstrap.as_ref(), device.clone(), config.clone())
            .map_err(|e| e.to_string())?;
        g.barrier().map_err(|e| e.to_string())?;
        if rank == 1 {
            // Gone before the all-reduce (its communicator destroyed with it).
            return Ok(());
        }
        let data = device.upload(&[1f32; 16], "the lonely all-reduce").unwrap();
        // SAFETY: `data` outlives the call.
        let result = unsafe {
            g.run_raw(Operation::AllReduce {
                buf: RawBuf::on_device(data.ptr(), 16, DType::F32, Device::Cuda(0)),
                op: ReduceOp::Sum,
            })
        };
        match result {
            Err(CommError::Timeout {
                ctx, timeout: t, ..
            }) => {
                // The desync check's exchange is the first to wait: sequence 2 after the
                // barrier, on the bootstrap world's name.
                assert_eq!((ctx.op, ctx.seq, &*ctx.group), ("all_reduce", 2, "world"));
                assert_eq!(t, timeout);
            }
            other => return Err(format!("expected a timeout, got {other:?}")),
        }
        match g.barrier() {
            Err(CommError::Broken { ctx, cause }) => {
                assert_eq!((ctx.op, ctx.seq), ("barrier", 3));
                assert!(cause.contains("all_reduce #2"), "{cause}");
            }
            other => return Err(format!("after the timeout: {other:?}")),
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(started.elapsed() < Duration::from_secs(30));
}
