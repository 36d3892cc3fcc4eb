//! `RoutedGroup`: host buffers to the host group, device buffers to the device group. The
//! device group here refuses host buffers as NCCL does, and the host group (threads) refuses
//! device buffers, so each suite passes only if every operation went to the right one.

use meshtrain_comm::{
    conformance, CommConfig, CommError, Device, HostBackedDevice, Operation, ProcessGroup,
    RoutedGroup, StagedGroup, ThreadsWorld, Work,
};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Device buffers only, as NCCL: a host buffer is an error naming it. Keeps the pairs it was
/// prepared for (as NCCL would make lanes for).
struct DeviceOnly(Arc<dyn ProcessGroup>, Arc<Mutex<Vec<(usize, usize)>>>);

impl DeviceOnly {
    fn refuse(&self, op: &Operation) -> Result<(), CommError> {
        if op.device() == Device::Cpu {
            return Err(CommError::InvalidBuffer {
                ctx: meshtrain_comm::OpContext::new(op.name(), 0, Arc::from(self.0.name())),
                details: "a host buffer reached the device group".into(),
            });
        }
        Ok(())
    }
}

impl ProcessGroup for DeviceOnly {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn name(&self) -> &str {
        self.0.name()
    }
    fn global_ranks(&self) -> &[usize] {
        self.0.global_ranks()
    }
    fn config(&self) -> &CommConfig {
        self.0.config()
    }
    unsafe fn run_raw(&self, op: Operation) -> Result<(), CommError> {
        self.refuse(&op)?;
        self.0.run_raw(op)
    }
    unsafe fn start_raw(&self, op: Operation) -> Result<Work, CommError> {
        self.refuse(&op)?;
        self.0.start_raw(op)
    }
    fn new_named_subgroup(
        &self,
        ranks: &[usize],
        name: &str,
    ) -> Result<Arc<dyn ProcessGroup>, CommError> {
        Ok(Arc::new(DeviceOnly(
            self.0.new_named_subgroup(ranks, name)?,
            Arc::default(),
        )))
    }
    fn prepare_point_to_point(&self, pairs: &[(usize, usize)]) -> Result<(), CommError> {
        self.0.prepare_point_to_point(pairs)?;
        self.1.lock().unwrap().extend_from_slice(pairs);
        Ok(())
    }
}

fn config() -> CommConfig {
    CommConfig::default()
        .with_timeout(Duration::from_secs(20))
        .with_desync_check(true)
}

#[test]
fn each_operation_goes_where_its_buffers_are() {
    for n in [1, 2, 3] {
        let device = HostBackedDevice::new(Device::Cuda(0));
        ThreadsWorld::run(n, config(), move |g| {
            let all: Vec<usize> = (0..n).collect();
            let host = g
                .new_named_subgroup(&all, "host")
                .map_err(|e| e.to_string())?;
            let staged: Arc<dyn ProcessGroup> = StagedGroup::new(g, device.clone());
            let routed = RoutedGroup::new(host, Arc::new(DeviceOnly(staged, Arc::default())))
                .map_err(|e| e.to_string())?;
            conformance::run_suite(routed.as_ref()).map_err(|e| format!("host suite: {e:#}"))?;
            conformance::run_device_suite(routed.as_ref(), device.as_ref())
                .map_err(|e| format!("device suite: {e:#}"))?;
            Ok::<_, String>(())
        })
        .unwrap_or_else(|e| panic!("{n} ranks: {e}"));
    }
}

#[test]
fn groups_of_other_ranks_are_refused() {
    ThreadsWorld::run(2, config(), |g| {
        let alone = g.new_subgroup(&[g.rank()])?;
        let e = RoutedGroup::new(g.clone(), alone).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("must be the same ranks"), "{e}");
        Ok::<_, CommError>(())
    })
    .unwrap();
}

/// Preparing sends reaches the device group (where NCCL makes its lanes) through the routed
/// and staged wrappers, and a pair that is not two ranks of the group is refused by name.
#[test]
fn preparing_sends_reaches_the_device_group() {
    ThreadsWorld::run(2, config(), |g| {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let host = g.new_named_subgroup(&[0, 1], "host")?;
        let device = HostBackedDevice::new(Device::Cuda(0));
        let staged: Arc<dyn ProcessGroup> = StagedGroup::new(g.clone(), device);
        let routed = RoutedGroup::new(host, Arc::new(DeviceOnly(staged, seen.clone())))?;
        routed.prepare_point_to_point(&[(0, 1), (1, 0)])?;
        assert_eq!(*seen.lock().unwrap(), [(0, 1), (1, 0)]);
        for bad in [(0, 0), (1, 2)] {
            let e = routed
                .prepare_point_to_point(&[bad])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("from rank {} to rank {}", bad.0, bad.1)),
                "{e}"
            );
        }
        Ok::<_, CommError>(())
    })
    .unwrap();
}
