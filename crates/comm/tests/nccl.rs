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
use std::sync::atomic::{AtomicUsize, Ordering};
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
        "a_waited_operation_returns_soon_after_it_finishes",
        "host_buffers_and_other_devices_are_refused_by_name",
        "an_aborted_communicator_breaks_the_group",
        "a_rank_that_never_arrives_times_out_on_the_others",
        "a_rank_that_fails_fails_the_others_before_the_timeout",
        "sends_that_cross_between_two_ranks_finish_on_their_lanes",
    ];
    if emulated::rerun_on_the_emulated_device_with(&tests, &[("EMU_DEVICE_COUNT", "2")]) {
        // A group larger than a pair: the missing rank comes from the position board.
        emulated::rerun_on_the_emulated_device_with(
            &[
                "a_rank_that_never_arrives_times_out_on_the_others",
                "a_rank_that_fails_fails_the_others_before_the_timeout",
            ],
            &[("EMU_DEVICE_COUNT", "3")],
        );
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

/// `Work::wait` returns soon after the operation's completion event: a tensor-parallel step
/// waits for dozens of small all-reduces, and the host queues nothing meanwhile. Measured on
/// operations of one element on a world of one (on the emulated device with synchronous
/// streams the event is complete when it is recorded, so what remains is the wait's own
/// latency); the bound catches a wait that sleeps for the watchdog's idle poll.
#[test]
fn a_waited_operation_returns_soon_after_it_finishes() {
    let Some(device) = gpu("a_waited_operation_returns_soon_after_it_finishes") else {
        return;
    };
    let g = world_of_one(&device, config().with_desync_check(false));
    let buf = device.upload(&[1f32], "one element").unwrap();
    let view = || unsafe { RawBuf::on_device(buf.ptr(), 1, DType::F32, Device::Cuda(0)) };
    let round = |count: usize| {
        let start = std::time::Instant::now();
        for _ in 0..count {
            // SAFETY: `buf` outlives every Work, each waited on at once.
            unsafe { g.all_reduce_async(view(), ReduceOp::Sum).unwrap() }
                .wait()
                .unwrap();
        }
        start.elapsed() / count as u32
    };
    round(20);
    let each = round(400);
    eprintln!(
        "a_waited_operation_returns_soon_after_it_finishes: {:.1} µs per all-reduce and wait",
        each.as_secs_f64() * 1e6
    );
    assert!(
        each < Duration::from_millis(2),
        "an all-reduce of one element and its wait took {each:?}"
    );
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

/// This rank of `bootstrap` on the GPU of its number, in an NCCL group of the bootstrap's
/// ranks, after a barrier over it (every rank got that far).
fn on_its_gpu(
    bootstrap: &dyn ProcessGroup,
    config: &CommConfig,
) -> Result<(usize, Arc<CudaDevice>, Arc<NcclGroup>), String> {
    let rank = bootstrap.rank();
    let device = CudaDevice::get(rank).map_err(|e| e.to_string())?;
    let g = NcclGroup::from_bootstrap(bootstrap, device.clone(), config.clone())
        .map_err(|e| e.to_string())?;
    g.barrier().map_err(|e| e.to_string())?;
    Ok((rank, device, g))
}

/// An all-reduce of 16 ones in `device`'s memory over `g`, as the others' timeouts and
/// failures see it.
fn all_reduce_of_ones(
    g: &NcclGroup,
    device: &Arc<CudaDevice>,
    rank: usize,
) -> Result<(), CommError> {
    let data = device.upload(&[1f32; 16], "an all-reduce of ones").unwrap();
    // SAFETY: `data` outlives the call.
    unsafe {
        g.run_raw(Operation::AllReduce {
            buf: RawBuf::on_device(data.ptr(), 16, DType::F32, Device::Cuda(rank)),
            op: ReduceOp::Sum,
        })
    }
}

/// A rank that never calls the collective (crashed, or stuck elsewhere): NCCL's kernels on
/// the others wait for it forever, so their watchdog must abort the communicator after the
/// timeout and fail the operation by name and sequence number, naming the missing rank
/// (a group of two: the other one; a larger group, one rank per GPU up to 4: whom the
/// bootstrap's position board says never issued it, as NCCL cannot tell); every later
/// operation fails as broken. On the emulated device it runs with two GPUs and with three.
#[test]
fn a_rank_that_never_arrives_times_out_on_the_others() {
    let Some(gpus) = gpus("a_rank_that_never_arrives_times_out_on_the_others") else {
        return;
    };
    let ranks = gpus.min(4);
    let timeout = Duration::from_millis(300);
    let config = config().with_timeout(timeout);
    let started = std::time::Instant::now();
    let timed_out = Arc::new(AtomicUsize::new(0));
    ThreadsWorld::run(ranks, config.clone(), move |bootstrap| {
        let (rank, device, g) = on_its_gpu(bootstrap.as_ref(), &config)?;
        let gone = ranks - 1;
        if rank == gone {
            // Alive but stuck elsewhere, never calling the all-reduce, until the others have
            // timed out (a rank known to have stopped fails them at once instead: below).
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while timed_out.load(Ordering::SeqCst) < gone && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            return Ok(());
        }
        match all_reduce_of_ones(&g, &device, rank) {
            Err(CommError::Timeout {
                ctx,
                timeout: t,
                missing,
                note,
            }) => {
                // The desync check's exchange is the first to wait: sequence 2 after the
                // barrier, on the bootstrap world's name.
                assert_eq!((ctx.op, ctx.seq, &*ctx.group), ("all_reduce", 2, "world"));
                assert_eq!(t, timeout);
                assert_eq!(missing, [gone], "{note}");
                if ranks > 2 {
                    let seen = format!("rank {gone} last issued barrier #1");
                    assert!(note.contains(&seen), "{note}");
                }
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
        timed_out.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// A rank that fails (an error, a panic, a kill under MPI) before the collective: the
/// bootstrap's position board knows at once, so the others fail long before the 60 s
/// timeout, naming it and how it stopped.
#[test]
fn a_rank_that_fails_fails_the_others_before_the_timeout() {
    let Some(gpus) = gpus("a_rank_that_fails_fails_the_others_before_the_timeout") else {
        return;
    };
    let ranks = gpus.min(4);
    let gone = ranks - 1;
    let config = config();
    let result = ThreadsWorld::run(ranks, config.clone(), move |bootstrap| {
        let (rank, device, g) = on_its_gpu(bootstrap.as_ref(), &config)?;
        if rank == gone {
            return Err("gone on purpose".to_string());
        }
        let started = std::time::Instant::now();
        match all_reduce_of_ones(&g, &device, rank) {
            Err(CommError::PeerFailed {
                ctx,
                missing,
                reason,
            }) => {
                assert_eq!((ctx.op, ctx.seq), ("all_reduce", 2), "{reason}");
                assert_eq!(missing, [gone], "{reason}");
                assert!(reason.contains("failed: gone on purpose"), "{reason}");
                assert!(started.elapsed() < Duration::from_secs(10));
                Ok(())
            }
            other => Err(format!("expected a peer failure, got {other:?}")),
        }
    });
    let failures = result.expect_err("rank {gone} failed").failures;
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].0, gone, "{failures:?}");
}

/// Two ranks send to each other at the same time, each issuing its send alone (not grouped
/// with the receive after it): a pipeline's activations one way and its gradients the other.
/// On one communicator each send waits for a receive queued behind the other rank's send,
/// and the watchdog times out; with a lane per pair ([`ProcessGroup::prepare_point_to_point`])
/// both finish, and a pair's messages arrive in the order sent. 4 Mi floats (16 MiB) is
/// more than NCCL buffers for a send (and the emulated NCCL's 1 MiB ring), so nothing
/// completes before its receiver arrives.
#[test]
fn sends_that_cross_between_two_ranks_finish_on_their_lanes() {
    let test = "sends_that_cross_between_two_ranks_finish_on_their_lanes";
    let Some(_) = gpus(test) else {
        return;
    };
    if CudaDevice::get(0).unwrap().name().starts_with("Emulated")
        && std::env::var("EMU_DEVICE_STREAMS").as_deref() != Ok("async")
    {
        // There a send runs on the calling thread when issued, so it blocks the host until
        // received: crossing sends cannot be posted as a card's are.
        eprintln!("{test}: skipped, the emulated device's streams are synchronous");
        return;
    }
    const LEN: usize = 4 << 20;
    let timeout = Duration::from_millis(1500);
    let config = config().with_timeout(timeout);
    ThreadsWorld::run(2, config.clone(), move |bootstrap| {
        let rank = bootstrap.rank();
        let peer = 1 - rank;
        let device = CudaDevice::get(rank).map_err(|e| e.to_string())?;
        let ordinal = Device::Cuda(rank);
        let view = |b: &meshtrain_tensor::cuda::DevBuf, len| unsafe {
            RawBuf::on_device(b.ptr(), len, DType::F32, ordinal)
        };
        let mine: Vec<f32> = (0..LEN).map(|i| (i % 1000) as f32 + rank as f32).collect();
        let outgoing = device.upload(&mine, "the crossing send").unwrap();
        let incoming = device.alloc(4 * LEN, "the crossing receive").unwrap();
        // Each rank's send, then (after the window in which the backend would group them)
        // its receive.
        let cross = |g: &NcclGroup| -> Result<(), CommError> {
            // SAFETY: both buffers outlive the Works, waited for below.
            let sent = unsafe { g.send_async(view(&outgoing, LEN), peer, 0) }?;
            std::thread::sleep(Duration::from_millis(20));
            let received = unsafe { g.recv_async(view(&incoming, LEN), peer, 0) }?;
            let (a, b) = (sent.wait(), received.wait());
            a.and(b)
        };

        let one = NcclGroup::from_bootstrap(bootstrap.as_ref(), device.clone(), config.clone())
            .map_err(|e| e.to_string())?;
        match cross(&one) {
            Err(CommError::Timeout { ctx, .. }) => assert_eq!(ctx.op, "send"),
            other => return Err(format!("crossing sends on one stream: {other:?}")),
        }
        drop(one);

        let g = NcclGroup::from_bootstrap(bootstrap.as_ref(), device.clone(), config.clone())
            .map_err(|e| e.to_string())?;
        // Out of range and self pairs are refused by name before anything is made.
        let e = g.prepare_point_to_point(&[(0, 2)]).unwrap_err().to_string();
        assert!(e.contains("from rank 0 to rank 2"), "{e}");
        g.prepare_point_to_point(&[(1, 0), (0, 1)])
            .map_err(|e| e.to_string())?;
        cross(&g).map_err(|e| e.to_string())?;
        let got = device.download::<f32>(incoming.ptr(), LEN).unwrap();
        let expected: Vec<f32> = (0..LEN).map(|i| (i % 1000) as f32 + peer as f32).collect();
        assert!(got == expected, "rank {rank} received other values");

        // Messages of one pair arrive in the order sent, sizes and all.
        let first = device.upload(&[7f32; 3], "the first message").unwrap();
        let second = device.upload(&[9f32; 5], "the second message").unwrap();
        if rank == 0 {
            let a = unsafe { g.send_async(view(&first, 3), 1, 1) }.map_err(|e| e.to_string())?;
            let b = unsafe { g.send_async(view(&second, 5), 1, 2) }.map_err(|e| e.to_string())?;
            a.wait().and(b.wait()).map_err(|e| e.to_string())?;
        } else {
            let into = device.alloc(4 * 8, "the two messages").unwrap();
            let a = unsafe {
                g.recv_async(RawBuf::on_device(into.ptr(), 3, DType::F32, ordinal), 0, 1)
            };
            let b = unsafe {
                g.recv_async(
                    RawBuf::on_device(into.ptr() + 12, 5, DType::F32, ordinal),
                    0,
                    2,
                )
            };
            a.map_err(|e| e.to_string())?
                .wait()
                .map_err(|e| e.to_string())?;
            b.map_err(|e| e.to_string())?
                .wait()
                .map_err(|e| e.to_string())?;
            assert_eq!(
                device.download::<f32>(into.ptr(), 8).unwrap(),
                [[7f32; 3].as_slice(), &[9f32; 5]].concat()
            );
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
}
