//! A dimension's own flat buffers, wherever the run's state lives: ZeRO's wire buffers and
//! gathered blocks are allocated in the chunk's memory (the host's, or its GPU's) and moved
//! by copy plans, so the dimension is written once for both devices.
//!
//! A [`CopyPlan`] is plain data: runs of elements from one flat buffer to another (or zeros),
//! computed once (ZeRO: per block, when the run starts) and executed by a [`FlatMemory`]
//! many times: loops on the host, one kernel launch on a GPU (the run table uploaded once).

use meshtrain_comm::RawBuf;
use meshtrain_nn::{Params, ParamsMut};
use meshtrain_tensor::Device;
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};

/// `len` elements to `dst` (an offset into the destination) from `src` (an offset into the
/// source), or zeros when `src` is `None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub src: Option<usize>,
    pub dst: usize,
    pub len: usize,
}

/// Runs of a copy between two flat buffers, with an identity so a device can keep its
/// uploaded form (plans are built once and executed every step).
#[derive(Debug)]
pub struct CopyPlan {
    id: u64,
    runs: Vec<Run>,
}

static NEXT_PLAN: AtomicU64 = AtomicU64::new(1);

impl Clone for CopyPlan {
    /// A clone is another plan (its own identity) with the same runs.
    fn clone(&self) -> Self {
        CopyPlan::new(self.runs.clone())
    }
}

impl PartialEq for CopyPlan {
    fn eq(&self, other: &Self) -> bool {
        self.runs == other.runs
    }
}

impl CopyPlan {
    /// The plan of `runs` (empty runs dropped).
    pub fn new(mut runs: Vec<Run>) -> CopyPlan {
        runs.retain(|r| r.len > 0);
        CopyPlan {
            id: NEXT_PLAN.fetch_add(1, Ordering::Relaxed),
            runs,
        }
    }

    /// Unique per plan (clones included) for the life of the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Elements the destination must hold at least, and the source.
    pub fn extents(&self) -> (usize, usize) {
        let dst = self.runs.iter().map(|r| r.dst + r.len).max().unwrap_or(0);
        let src = self
            .runs
            .iter()
            .filter_map(|r| r.src.map(|s| s + r.len))
            .max()
            .unwrap_or(0);
        (dst, src)
    }

    /// Panics unless `src` and `dst` hold the elements the runs read and write.
    pub fn assert_fits(&self, src: &RawBuf, dst: &RawBuf) {
        let (dst_len, src_len) = self.extents();
        assert!(
            dst_len <= dst.len() && src_len <= src.len(),
            "a copy plan out of bounds: it reads {src_len} and writes {dst_len} elements, \
             buffers of {} and {}",
            src.len(),
            dst.len()
        );
    }

    /// The copy back: every run's destination to its source (zeros runs have none).
    pub fn inverse(&self) -> CopyPlan {
        let runs = self.runs.iter().filter_map(|r| {
            r.src.map(|src| Run {
                src: Some(r.dst),
                dst: src,
                len: r.len,
            })
        });
        CopyPlan::new(runs.collect())
    }

    /// The runs on the host: copies (`add`: adds, where zeros runs change nothing).
    pub fn apply_on_host(&self, src: &[f32], dst: &mut [f32], add: bool) {
        for r in &self.runs {
            let out = &mut dst[r.dst..r.dst + r.len];
            match (r.src, add) {
                (Some(s), false) => out.copy_from_slice(&src[s..s + r.len]),
                (Some(s), true) => out
                    .iter_mut()
                    .zip(&src[s..s + r.len])
                    .for_each(|(d, x)| *d += x),
                (None, false) => out.fill(0.0),
                (None, true) => {}
            }
        }
    }
}

/// Whether a plan's runs overwrite the destination or add to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Apply {
    Copy,
    Add,
}

/// A flat f32 buffer in some memory, freed when dropped. Its length may shrink below what
/// was allocated ([`FlatBuf::set_len`]), so a pool can reuse larger buffers.
pub struct FlatBuf {
    addr: u64,
    capacity: usize,
    len: usize,
    device: Device,
    _owner: Box<dyn Any + Send>,
}

impl std::fmt::Debug for FlatBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FlatBuf({} of {} on {:?})",
            self.len, self.capacity, self.device
        )
    }
}

impl FlatBuf {
    /// A host vector as a flat buffer tagged with `device` (the host's, or the stand-in
    /// GPU's whose memory is the host's).
    pub fn host(mut values: Vec<f32>, device: Device) -> FlatBuf {
        FlatBuf {
            addr: values.as_mut_ptr() as u64,
            capacity: values.len(),
            len: values.len(),
            device,
            _owner: Box::new(values),
        }
    }

    /// `capacity` elements at `addr` in `device`'s memory, kept allocated by `owner`.
    ///
    /// # Safety
    /// `addr` must hold `capacity` f32 elements in `device`'s memory for as long as `owner`
    /// lives.
    pub unsafe fn from_owner(
        addr: u64,
        capacity: usize,
        device: Device,
        owner: Box<dyn Any + Send>,
    ) -> FlatBuf {
        FlatBuf {
            addr,
            capacity,
            len: capacity,
            device,
            _owner: owner,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the memory begins (a host address, or a device pointer).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Uses the first `len` elements (at most the capacity).
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity,
            "{len} elements of a buffer of {}",
            self.capacity
        );
        self.len = len;
    }

    /// A view for collectives and copy plans.
    pub fn raw(&mut self) -> RawBuf {
        // SAFETY: `len` elements of the owned allocation; `&mut self` hands the view out
        // while the buffer is held by whoever waits for the operations given it.
        unsafe { RawBuf::on_device(self.addr, self.len, meshtrain_comm::DType::F32, self.device) }
    }

    /// A view of the first `len` bf16 values of the buffer's memory (a wire copy of `len`
    /// f32 values takes half the buffer).
    pub fn raw_bf16(&mut self, len: usize) -> RawBuf {
        self.raw_as(meshtrain_comm::DType::BF16, len)
    }

    /// A view of the first `len` values of `dtype` in the buffer's memory (a 16-bit copy
    /// takes half of it).
    pub fn raw_as(&mut self, dtype: meshtrain_comm::DType, len: usize) -> RawBuf {
        assert!(
            len * dtype.size_bytes() <= self.capacity * 4,
            "{len} {dtype} in a buffer of {} f32",
            self.capacity
        );
        // SAFETY: in bounds of the owned allocation (checked), as for `raw`.
        unsafe { RawBuf::on_device(self.addr, len, dtype, self.device) }
    }

    /// The elements, when the memory is the host's (the host, or the stand-in GPU).
    pub fn host_slice(&self) -> Option<&[f32]> {
        self._owner
            .downcast_ref::<Vec<f32>>()
            .map(|v| &v[..self.len])
    }

    /// As [`FlatBuf::host_slice`], to write.
    pub fn host_slice_mut(&mut self) -> Option<&mut [f32]> {
        let len = self.len;
        self._owner
            .downcast_mut::<Vec<f32>>()
            .map(move |v| &mut v[..len])
    }
}

/// The memory a dimension's flat buffers live in and the copies between them: the host's
/// ([`HostFlat`]), the stand-in GPU's, or a GPU's (`cuda_chunk`). Operations are queued in
/// order with the step's other device work (a GPU's compute stream), so a collective
/// started after a copy sees its result; errors on a GPU are raised as device panics, as
/// inside a step everywhere.
pub trait FlatMemory: Send + Sync {
    /// Where the buffers live.
    fn device(&self) -> Device;

    /// A buffer of `len` elements (contents unspecified).
    fn alloc(&self, len: usize) -> FlatBuf;

    /// `plan` from `src` into `dst` (both this memory's).
    fn apply(&self, plan: &CopyPlan, src: RawBuf, dst: RawBuf, how: Apply);

    /// `dst` set to zeros.
    fn zero(&self, dst: RawBuf);

    /// `buf` as the gradient view a layer's backward writes (ZeRO-2's block gradients).
    fn view_mut<'a>(&'a self, buf: &'a mut FlatBuf) -> ParamsMut<'a>;

    /// The 16-bit type the passes compute in on this device, whose copy of gathered
    /// parameters a layer reads beside the f32 values (`None`: f32 only, as on the host).
    fn compute_copy(&self) -> Option<meshtrain_comm::DType>;

    /// `values` (f32) and their 16-bit copy as the parameter view a layer reads (ZeRO-3's
    /// gathered blocks).
    fn params_view<'a>(&'a self, values: &'a FlatBuf, half: Option<&'a FlatBuf>) -> Params<'a>;

    /// `src` converted into `dst` (equal lengths): f32 to bf16 rounding to nearest even, or
    /// bf16 to f32 (DDP's bf16 wire).
    fn convert(&self, src: RawBuf, dst: RawBuf);
}

/// Memory whose addresses are the host's: the host itself, or the stand-in GPU
/// ([`super::device::STAND_IN_GPU`]), whose buffers collectives stage as a GPU's.
pub struct HostFlat {
    pub device: Device,
}

/// `buf` as a host slice (a view of host memory: the host's, or the stand-in's).
///
/// # Safety
/// The view's memory is host memory, valid and not otherwise accessed for the slice's use.
unsafe fn host_view<'a>(buf: RawBuf) -> &'a mut [f32] {
    assert_eq!(
        buf.dtype(),
        meshtrain_comm::DType::F32,
        "flat buffers are f32"
    );
    std::slice::from_raw_parts_mut(buf.addr() as *mut f32, buf.len())
}

impl FlatMemory for HostFlat {
    fn device(&self) -> Device {
        self.device
    }

    fn alloc(&self, len: usize) -> FlatBuf {
        FlatBuf::host(vec![0.0; len], self.device)
    }

    fn apply(&self, plan: &CopyPlan, src: RawBuf, dst: RawBuf, how: Apply) {
        assert!(
            src.device() == self.device && dst.device() == self.device,
            "a copy plan of {:?} memory over buffers of {:?} and {:?}",
            self.device,
            src.device(),
            dst.device()
        );
        plan.assert_fits(&src, &dst);
        // SAFETY: host memory (checked by device above: this memory's buffers are host
        // memory), in bounds (checked); the caller holds both buffers for the call, and a
        // plan never reads and writes one buffer.
        unsafe {
            let src: &[f32] = host_view(src);
            plan.apply_on_host(src, host_view(dst), how == Apply::Add);
        }
    }

    fn zero(&self, dst: RawBuf) {
        assert_eq!(dst.device(), self.device);
        // SAFETY: as in `apply`.
        unsafe { host_view(dst).fill(0.0) }
    }

    fn view_mut<'a>(&'a self, buf: &'a mut FlatBuf) -> ParamsMut<'a> {
        ParamsMut::Host(
            buf.host_slice_mut()
                .expect("host memory holds host vectors"),
        )
    }

    fn compute_copy(&self) -> Option<meshtrain_comm::DType> {
        None
    }

    fn params_view<'a>(&'a self, values: &'a FlatBuf, _: Option<&'a FlatBuf>) -> Params<'a> {
        Params::Host(values.host_slice().expect("host memory holds host vectors"))
    }

    fn convert(&self, src: RawBuf, dst: RawBuf) {
        use half::bf16;
        use meshtrain_comm::DType;
        assert!(src.device() == self.device && dst.device() == self.device);
        assert_eq!(src.len(), dst.len(), "a conversion between unequal buffers");
        let n = src.len();
        // SAFETY: host memory of this memory's device (checked), `n` elements of the checked
        // types each, held by the caller for the call; the two never overlap (a wire copy).
        unsafe {
            match (src.dtype(), dst.dtype()) {
                (DType::F32, DType::BF16) => {
                    let s = std::slice::from_raw_parts(src.addr() as *const f32, n);
                    let d = std::slice::from_raw_parts_mut(dst.addr() as *mut bf16, n);
                    d.iter_mut()
                        .zip(s)
                        .for_each(|(w, g)| *w = bf16::from_f32(*g));
                }
                (DType::BF16, DType::F32) => {
                    let s = std::slice::from_raw_parts(src.addr() as *const bf16, n);
                    let d = std::slice::from_raw_parts_mut(dst.addr() as *mut f32, n);
                    d.iter_mut().zip(s).for_each(|(g, w)| *g = w.to_f32());
                }
                (a, b) => panic!("no conversion from {a} to {b}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_copy_add_and_zero_runs() {
        let plan = CopyPlan::new(vec![
            Run {
                src: Some(2),
                dst: 0,
                len: 2,
            },
            Run {
                src: None,
                dst: 2,
                len: 1,
            },
            Run {
                src: Some(0),
                dst: 3,
                len: 0,
            },
        ]);
        assert_eq!(plan.runs().len(), 2, "empty runs dropped");
        assert_eq!(plan.extents(), (3, 4));
        let src = [1.0, 2.0, 3.0, 4.0];
        let mut dst = [9.0; 4];
        plan.apply_on_host(&src, &mut dst, false);
        assert_eq!(dst, [3.0, 4.0, 0.0, 9.0]);
        plan.apply_on_host(&src, &mut dst, true);
        assert_eq!(dst, [6.0, 8.0, 0.0, 9.0]);
        assert_ne!(plan.id(), plan.clone().id());
        assert_eq!(plan, plan.clone());
    }

    #[test]
    fn host_memory_applies_plans_to_its_buffers() {
        let memory = HostFlat {
            device: Device::Cpu,
        };
        let mut src = FlatBuf::host(vec![1.0, 2.0, 3.0], Device::Cpu);
        let mut dst = memory.alloc(5);
        dst.set_len(3);
        let plan = CopyPlan::new(vec![Run {
            src: Some(0),
            dst: 1,
            len: 2,
        }]);
        memory.zero(dst.raw());
        memory.apply(&plan, src.raw(), dst.raw(), Apply::Copy);
        memory.apply(&plan, src.raw(), dst.raw(), Apply::Add);
        assert_eq!(dst.host_slice().unwrap(), &[0.0, 2.0, 4.0]);
        assert_eq!(dst.capacity(), 5);
        // Through a bf16 wire copy and back: 1 + 2⁻⁹ rounds to even (1), 3 is exact.
        let mut values = FlatBuf::host(vec![1.0 + 1.0 / 512.0, 3.0], Device::Cpu);
        let mut wire = memory.alloc(1);
        memory.convert(values.raw(), wire.raw_bf16(2));
        memory.zero(values.raw());
        memory.convert(wire.raw_bf16(2), values.raw());
        assert_eq!(values.host_slice().unwrap(), &[1.0, 3.0]);
    }
}
