//! Device buffers on the host backends: the threads backend wrapped in a `StagedGroup` over a
//! stand-in device whose addresses fault on the host (`HostBackedDevice`), so any backend
//! code that read a device address instead of its staged copy would crash these tests.

use meshtrain_comm::{
    conformance, CommConfig, CommError, DType, Device, DeviceMemory, HostBackedDevice, Operation,
    ProcessGroup, RawBuf, ReduceOp, StagedGroup, ThreadsWorld,
};
use std::sync::Arc;
use std::time::Duration;

fn config() -> CommConfig {
    CommConfig::default()
        .with_timeout(Duration::from_secs(20))
        .with_desync_check(true)
}

/// Every rank of `n` stages through one shared stand-in GPU, as several ranks share the one
/// GPU of a test machine.
fn staged_world<T: Send + 'static>(
    n: usize,
    worker: impl Fn(Arc<StagedGroup>, Arc<HostBackedDevice>) -> anyhow::Result<T>
        + Send
        + Sync
        + 'static,
) -> Vec<T> {
    let device = HostBackedDevice::new(Device::Cuda(0));
    ThreadsWorld::run(n, config(), move |g| {
        let staged = StagedGroup::new(g, device.clone());
        worker(staged, device.clone()).map_err(|e| format!("{e:#}"))
    })
    .unwrap_or_else(|e| panic!("{n} ranks: {e}"))
}

#[test]
fn device_conformance_suite_through_staging_for_1_to_4_ranks() {
    for n in 1..=4 {
        staged_world(n, |g, device| {
            conformance::run_device_suite(g.as_ref(), device.as_ref())
        });
    }
}

#[test]
fn host_buffers_pass_through_a_staged_group_unchanged() {
    staged_world(3, |g, device| {
        conformance::run_suite(g.as_ref())?;
        assert_eq!(device.copied(), (0, 0), "host buffers were staged");
        Ok(())
    });
}

/// Each operation copies what it reads to the host and what it writes back, no more:
/// a broadcast's receivers download nothing, its root uploads nothing, a reduce-scatter
/// uploads only its output chunk. (Each rank has a stand-in device of its own here, so its
/// counts are its own.)
#[test]
fn staging_copies_inputs_down_and_outputs_up_only() {
    let copies = ThreadsWorld::run(2, config(), |g| {
        let device = HostBackedDevice::new(Device::Cuda(g.rank()));
        let g = StagedGroup::new(g, device.clone());
        let n = g.size();
        let mut counts = Vec::new();
        let mut measure = |op: &dyn Fn(&F32OnDevice) -> Operation, len: usize| {
            let buf = F32OnDevice::new(device.as_ref(), len);
            let before = device.copied();
            // SAFETY: `buf` lives until the call returns.
            unsafe { g.run_raw(op(&buf)) }.unwrap();
            let after = device.copied();
            counts.push((after.0 - before.0, after.1 - before.1));
        };
        // 100 f32 all-reduced.
        measure(
            &|b| Operation::AllReduce {
                buf: b.view(0, 100),
                op: ReduceOp::Sum,
            },
            100,
        );
        // Broadcast from rank 0.
        measure(
            &|b| Operation::Broadcast {
                buf: b.view(0, 100),
                root: 0,
            },
            100,
        );
        // Reduce-scatter of 2 × 50 into a 50-element output after the input.
        measure(
            &|b| Operation::ReduceScatter {
                input: b.view(0, 50 * n),
                output: b.view(50 * n, 50),
                op: ReduceOp::Sum,
            },
            50 * n + 50,
        );
        Ok::<_, String>(counts)
    })
    .unwrap();
    assert_eq!(copies[0], vec![(400, 400), (400, 0), (400, 200)]);
    assert_eq!(copies[1], vec![(400, 400), (0, 400), (400, 200)]);
}

/// A device allocation of f32s for the copy-count test.
struct F32OnDevice(meshtrain_comm::DeviceAlloc);

impl F32OnDevice {
    fn new(device: &HostBackedDevice, len: usize) -> Self {
        F32OnDevice(device.alloc(4 * len).unwrap())
    }

    fn view(&self, start: usize, len: usize) -> RawBuf {
        // SAFETY: inside the allocation, which outlives the operation.
        unsafe {
            RawBuf::on_device(
                self.0.addr() + 4 * start as u64,
                len,
                DType::F32,
                self.0.device(),
            )
        }
    }
}

/// A host backend given a device buffer directly refuses it by name instead of reading the
/// address (which, on this stand-in, would crash the test).
#[test]
fn host_backends_refuse_device_buffers_by_name() {
    let errors = ThreadsWorld::run(2, config(), |g| {
        let device = HostBackedDevice::new(Device::Cuda(1));
        let buf = device.alloc(64).unwrap();
        // SAFETY: refused before any access.
        let op = Operation::AllReduce {
            buf: unsafe { buf.view(DType::F32, 16) },
            op: ReduceOp::Sum,
        };
        let err = unsafe { g.run_raw(op) }.unwrap_err();
        // The group stays usable.
        g.barrier().map_err(|e| e.to_string())?;
        Ok::<_, String>(err)
    })
    .unwrap();
    for err in errors {
        let CommError::InvalidBuffer { details, .. } = &err else {
            panic!("expected InvalidBuffer, got {err:?}");
        };
        assert!(
            details.contains("cuda:1") && details.contains("StagedGroup"),
            "{err}"
        );
    }
}

/// A staged group takes only its own device's buffers.
#[test]
fn a_staged_group_refuses_another_devices_buffers() {
    staged_world(1, |g, _device| {
        let other = HostBackedDevice::new(Device::Cuda(3));
        let buf = other.alloc(16).unwrap();
        // SAFETY: refused before any access.
        let op = Operation::AllReduce {
            buf: unsafe { buf.view(DType::F32, 4) },
            op: ReduceOp::Sum,
        };
        let err = unsafe { g.run_raw(op) }.unwrap_err();
        assert!(
            err.to_string().contains("cuda:3") && err.to_string().contains("cuda:0"),
            "{err}"
        );
        Ok(())
    });
}

/// A rank that never reaches a staged collective: the others fail within the timeout, naming
/// the operation, its sequence number and the missing rank, as on host buffers (the wrapped
/// backend's own failure handling, unchanged by staging).
#[test]
fn a_missing_rank_times_out_with_the_operation_and_its_rank_named() {
    let config = CommConfig::default()
        .with_timeout(Duration::from_millis(800))
        .with_desync_check(true);
    let device = HostBackedDevice::new(Device::Cuda(0));
    let outcomes = ThreadsWorld::run(2, config, move |g| {
        let staged = StagedGroup::new(g, device.clone());
        if staged.rank() == 1 {
            // Stuck elsewhere past the timeout.
            std::thread::sleep(Duration::from_millis(2000));
            return Ok::<_, String>(String::new());
        }
        let buf = device.alloc(4 * 8).map_err(|e| e.to_string())?;
        let started = std::time::Instant::now();
        // SAFETY: `buf` outlives the call.
        let err = unsafe {
            staged.run_raw(Operation::AllReduce {
                buf: buf.view(DType::F32, 8),
                op: ReduceOp::Sum,
            })
        }
        .expect_err("rank 1 never came");
        assert!(
            started.elapsed() < Duration::from_millis(1900),
            "waited too long"
        );
        Ok(err.to_string())
    })
    .unwrap();
    let message = &outcomes[0];
    assert!(
        message.contains("all_reduce #1") && message.contains("[1]"),
        "{message}"
    );
}
