//! The NCCL watchdog's timeout on a live communicator (its own test binary, so its own
//! process: it aborts a communicator while work is queued on the device, and a failure there
//! must not take other tests' CUDA context down with it). Skipped without a GPU and NCCL.
//!
//! With one GPU no peer can be made to stay away (NCCL refuses two ranks on one GPU), so the
//! operation is held back another way: the communication stream waits for the compute stream
//! (that is the backend's ordering), and the compute stream is kept busy with memsets far
//! longer than the timeout. The watchdog sees the operation's event not complete in time,
//! aborts the communicator and fails it with a timeout; every later operation fails as
//! broken; the device stays usable.
#![cfg(feature = "cuda")]

use meshtrain_comm::{
    nccl_available, CommConfig, CommError, DType, Device, NcclGroup, Operation, ProcessGroup,
    RawBuf, ReduceOp, ThreadsWorld,
};
use meshtrain_tensor::cuda::{probe, CudaDevice};
use std::time::{Duration, Instant};

#[test]
fn an_operation_held_past_the_timeout_aborts_and_breaks_the_group() {
    if !probe::gpu_available() {
        eprintln!("skipped: no GPU driver or device on this machine");
        return;
    }
    if let Err(why) = nccl_available() {
        eprintln!("skipped: {why}");
        return;
    }
    let device = CudaDevice::get(0).expect("GPU 0");
    if device.name().starts_with("Emulated") {
        // Its calls finish when queued, so no stream can hold the operation back; there
        // `tests/nccl.rs`'s rank that never arrives takes the watchdog through its timeout.
        eprintln!("skipped: the emulated device runs every call at once");
        return;
    }
    let timeout = Duration::from_millis(20);
    let config = CommConfig::default()
        .with_timeout(timeout)
        .with_desync_check(false);
    let bootstrap = ThreadsWorld::single(config.clone());
    let g = NcclGroup::from_bootstrap(bootstrap.as_ref(), device.clone(), config).unwrap();
    g.barrier().expect("a barrier before the stall");

    // ~400 GiB of memsets on the compute stream: 100 ms or more at any current GPU's rate.
    let block = 1usize << 30;
    let busy = device.alloc(block, "the stall").unwrap();
    for _ in 0..400 {
        device.memset_zero(busy.ptr(), block).unwrap();
    }
    let data = device.upload(&[1f32; 16], "the held operation").unwrap();
    let started = Instant::now();
    // SAFETY: `data` outlives the call.
    let result = unsafe {
        g.run_raw(Operation::AllReduce {
            buf: RawBuf::on_device(data.ptr(), 16, DType::F32, Device::Cuda(0)),
            op: ReduceOp::Sum,
        })
    };
    let waited = started.elapsed();
    match result {
        Err(CommError::Timeout {
            ctx,
            timeout: t,
            missing,
            note,
        }) => {
            assert_eq!((ctx.op, ctx.seq, &*ctx.group), ("all_reduce", 2, "world"));
            assert_eq!(t, timeout);
            assert!(missing.is_empty());
            assert!(
                note.contains("cannot tell") && note.contains("ncclCommAbort"),
                "{note}"
            );
        }
        other => panic!("expected a timeout after {waited:?}, got {other:?}"),
    }
    assert!(
        waited >= timeout && waited < Duration::from_secs(30),
        "{waited:?}"
    );
    match g.barrier() {
        Err(CommError::Broken { ctx, cause }) => {
            assert_eq!(ctx.seq, 3);
            assert!(
                cause.contains("all_reduce #2 on group 'world' timed out"),
                "{cause}"
            );
        }
        other => panic!("after the timeout: {other:?}"),
    }
    drop(g);
    // The memsets finish and the context is healthy (no fault from the aborted communicator).
    device.synchronize().expect("the device after the abort");
    let check = device.upload(&[3f32, 4.0], "after the abort").unwrap();
    assert_eq!(
        device.download::<f32>(check.ptr(), 2).unwrap(),
        vec![3.0, 4.0]
    );
}
