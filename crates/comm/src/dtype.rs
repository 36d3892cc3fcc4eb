//! Element types, reduction operators and dtype-erased buffer views.
//!
//! Collectives work on f32, bf16 and f16 buffers. The [`ProcessGroup`](crate::ProcessGroup)
//! trait is object safe, so buffers cross it as small enums ([`BufMut`], [`BufRef`]) or,
//! for asynchronous operations, as raw views ([`RawBuf`]). Half-precision values are
//! always reduced in f32 and rounded once when stored back, so a bf16 all-reduce is as
//! accurate as the format allows regardless of the number of workers.

use half::{bf16, f16};
use std::fmt;

/// Element type of a buffer: the project's one dtype enum, from the tensor core.
pub use meshtrain_tensor::DType;
/// Where a buffer's memory is: the project's one device enum, from the tensor core.
pub use meshtrain_tensor::Device;

/// Stable small code of a dtype, used in collective fingerprints.
pub(crate) fn dtype_code(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
    }
}

pub(crate) fn dtype_from_code(code: u64) -> Option<DType> {
    match code {
        1 => Some(DType::F32),
        2 => Some(DType::BF16),
        3 => Some(DType::F16),
        _ => None,
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A floating-point element that collectives can move and reduce.
///
/// Sealed: the backends rely on the exact set of types (MPI datatypes, byte sizes).
pub trait Element:
    bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static + sealed::Sealed
{
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
    /// The dtype-erased view of a mutable slice.
    fn buf_mut(slice: &mut [Self]) -> BufMut<'_>;
    /// The dtype-erased view of a shared slice.
    fn buf_ref(slice: &[Self]) -> BufRef<'_>;
    /// Wraps an owned vector for the safe async API.
    fn owned(values: Vec<Self>) -> crate::OwnedBuf;
    /// Unwraps an owned vector; `None` if `buf` holds another dtype.
    fn from_owned(buf: crate::OwnedBuf) -> Option<Vec<Self>>;
}

macro_rules! element_buffers {
    ($variant:ident) => {
        fn buf_mut(slice: &mut [Self]) -> BufMut<'_> {
            BufMut::$variant(slice)
        }
        fn buf_ref(slice: &[Self]) -> BufRef<'_> {
            BufRef::$variant(slice)
        }
        fn owned(values: Vec<Self>) -> crate::OwnedBuf {
            crate::OwnedBuf::$variant(values)
        }
        fn from_owned(buf: crate::OwnedBuf) -> Option<Vec<Self>> {
            match buf {
                crate::OwnedBuf::$variant(v) => Some(v),
                _ => None,
            }
        }
    };
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    element_buffers!(F32);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    element_buffers!(BF16);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    element_buffers!(F16);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size (computed in f32, then rounded once).
    Average,
    Max,
}

impl ReduceOp {
    pub(crate) fn code(self) -> u64 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Average => 2,
            ReduceOp::Max => 3,
        }
    }

    /// Folds `value` into the accumulator `acc`.
    #[inline(always)]
    pub(crate) fn combine(self, acc: f32, value: f32) -> f32 {
        match self {
            ReduceOp::Sum | ReduceOp::Average => acc + value,
            ReduceOp::Max => acc.max(value),
        }
    }
}

/// A raw, dtype-tagged view of a buffer, used by asynchronous operations.
///
/// It carries no lifetime: whoever builds one promises (see the `unsafe` constructors)
/// that the memory stays valid, and is not accessed by anything else, until the
/// operation that uses it has completed.
///
/// It also says where the memory is: host memory ([`Device::Cpu`]), which every backend
/// reads and writes, or a GPU's ([`Device::Cuda`]), an address only that device's copies
/// and kernels may touch. The threads and MPI backends refuse device views; wrapped in a
/// [`StagedGroup`](crate::StagedGroup) they stage them through host memory, and NCCL takes
/// them as they are. So a parallel dimension hands the group slices of its flat buffers
/// wherever they live, and is written once for both devices.
#[derive(Debug, Clone, Copy)]
pub struct RawBuf {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
}

// SAFETY: a RawBuf is only an address; the unsafe constructors put the burden of
// exclusive access on the caller for as long as an operation uses it.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// A raw view of `slice`.
    ///
    /// # Safety
    /// Until every operation given this view has completed (its [`Work`](crate::Work)
    /// was waited on or dropped), the memory must stay allocated and must not be read
    /// or written by anyone else. Distinct views must not overlap if they are written.
    pub unsafe fn from_slice<T: Element>(slice: &mut [T]) -> RawBuf {
        RawBuf {
            ptr: slice.as_mut_ptr().cast(),
            len: slice.len(),
            dtype: T::DTYPE,
            device: Device::Cpu,
        }
    }

    /// A raw view of `len` elements of type `T` at `ptr`.
    ///
    /// # Safety
    /// As for [`RawBuf::from_slice`]; additionally `ptr` must be valid and aligned for
    /// `len` elements of `T`.
    pub unsafe fn from_raw_parts<T: Element>(ptr: *mut T, len: usize) -> RawBuf {
        RawBuf {
            ptr: ptr.cast(),
            len,
            dtype: T::DTYPE,
            device: Device::Cpu,
        }
    }

    /// A view of `len` elements of `dtype` at address `addr` in the memory of `device`
    /// (a GPU's device pointer, such as a `DevBuf`'s `ptr()` plus an offset).
    ///
    /// # Safety
    /// As for [`RawBuf::from_slice`]: the range must lie in a live allocation of `device`,
    /// aligned for `dtype`, untouched by anyone else (kernels included) until every operation
    /// given this view has completed. Work queued on the device's compute stream before the
    /// operation is started is ordered before it.
    pub unsafe fn on_device(addr: u64, len: usize, dtype: DType, device: Device) -> RawBuf {
        RawBuf {
            ptr: addr as *mut u8,
            len,
            dtype,
            device,
        }
    }

    /// Where the memory is.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The address of the first element: a host address, or a device pointer.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn size_bytes(&self) -> usize {
        self.len * self.dtype.size_bytes()
    }

    /// The view of elements `start..start + len` of this one.
    ///
    /// # Panics
    /// If the range does not lie inside the view.
    pub fn sub(&self, start: usize, len: usize) -> RawBuf {
        assert!(
            start + len <= self.len,
            "sub-view {start}+{len} of a view of {}",
            self.len
        );
        RawBuf {
            // In bounds of the same allocation: checked above.
            ptr: self.ptr.wrapping_add(start * self.dtype.size_bytes()),
            len,
            dtype: self.dtype,
            device: self.device,
        }
    }

    /// Whether the two views share any byte (an empty view shares none; views of different
    /// devices' memories share none).
    pub(crate) fn overlaps(&self, other: &RawBuf) -> bool {
        if self.device != other.device {
            return false;
        }
        let (a0, a1) = (self.ptr as usize, self.ptr as usize + self.size_bytes());
        let (b0, b1) = (other.ptr as usize, other.ptr as usize + other.size_bytes());
        a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
    }
}

/// A mutable buffer of any supported dtype, borrowed for the duration of a call.
#[derive(Debug)]
pub enum BufMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// A shared buffer of any supported dtype, borrowed for the duration of a call.
#[derive(Debug, Clone, Copy)]
pub enum BufRef<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

impl BufMut<'_> {
    /// Raw view valid while `self`'s borrow lasts.
    pub(crate) fn raw(&mut self) -> RawBuf {
        // SAFETY: the returned view is only used while the borrow behind `self` is held
        // by the (blocking) call that created it.
        unsafe {
            match self {
                BufMut::F32(s) => RawBuf::from_slice(s),
                BufMut::BF16(s) => RawBuf::from_slice(s),
                BufMut::F16(s) => RawBuf::from_slice(s),
            }
        }
    }
}

impl BufRef<'_> {
    /// Raw view valid while `self`'s borrow lasts. Operations never write an input view.
    pub(crate) fn raw(&self) -> RawBuf {
        let (ptr, len, dtype) = match self {
            BufRef::F32(s) => (s.as_ptr().cast::<u8>(), s.len(), DType::F32),
            BufRef::BF16(s) => (s.as_ptr().cast::<u8>(), s.len(), DType::BF16),
            BufRef::F16(s) => (s.as_ptr().cast::<u8>(), s.len(), DType::F16),
        };
        RawBuf {
            ptr: ptr.cast_mut(),
            len,
            dtype,
            device: Device::Cpu,
        }
    }
}

impl<'a, T: Element> From<&'a mut [T]> for BufMut<'a> {
    fn from(s: &'a mut [T]) -> Self {
        T::buf_mut(s)
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for BufMut<'a> {
    fn from(s: &'a mut Vec<T>) -> Self {
        T::buf_mut(s.as_mut_slice())
    }
}

impl<'a, T: Element> From<&'a [T]> for BufRef<'a> {
    fn from(s: &'a [T]) -> Self {
        T::buf_ref(s)
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for BufRef<'a> {
    fn from(s: &'a Vec<T>) -> Self {
        T::buf_ref(s.as_slice())
    }
}

/// Dispatches on a [`DType`] to a block generic over the matching [`Element`] type.
macro_rules! with_element {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
        }
    };
}
pub(crate) use with_element;

/// Elements per block of the reduction kernel: the f32 accumulator (16 KiB) stays in L1.
pub(crate) const REDUCE_BLOCK: usize = 4096;

/// Reduces `sources` element-wise in rank order into an f32 accumulator and writes the
/// result to every slice in `destinations`.
///
/// The fixed order (source 0, 1, 2, …) makes results bit-identical from run to run
/// and independent of which thread does the work.
///
/// # Safety
/// Every source and destination must be valid for `len` elements of `T` (their
/// `RawBuf::len` is ignored, offsets are in elements). Destinations may alias sources
/// (in-place all-reduce): each block is fully read before it is written. No other
/// thread may write these ranges meanwhile.
pub(crate) unsafe fn reduce_into<T: Element>(
    sources: &[*const T],
    destinations: &[*mut T],
    len: usize,
    op: ReduceOp,
    divisor: f32,
) {
    let mut acc = [0f32; REDUCE_BLOCK];
    let mut start = 0;
    while start < len {
        let n = REDUCE_BLOCK.min(len - start);
        let acc = &mut acc[..n];
        {
            let first = std::slice::from_raw_parts(sources[0].add(start), n);
            for (a, &v) in acc.iter_mut().zip(first) {
                *a = v.to_f32();
            }
            for src in &sources[1..] {
                let values = std::slice::from_raw_parts(src.add(start), n);
                match op {
                    ReduceOp::Sum | ReduceOp::Average => {
                        for (a, &v) in acc.iter_mut().zip(values) {
                            *a += v.to_f32();
                        }
                    }
                    ReduceOp::Max => {
                        for (a, &v) in acc.iter_mut().zip(values) {
                            *a = a.max(v.to_f32());
                        }
                    }
                }
            }
        }
        if op == ReduceOp::Average {
            for a in acc.iter_mut() {
                *a /= divisor;
            }
        }
        for dst in destinations {
            let out = std::slice::from_raw_parts_mut(dst.add(start), n);
            for (o, &a) in out.iter_mut().zip(acc.iter()) {
                *o = T::from_f32(a);
            }
        }
        start += n;
    }
}

/// Serial reference reduction used by tests and the conformance suite: folds the
/// ranks' inputs in rank order exactly like the threads backend specifies.
pub fn reference_reduce<T: Element>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let len = inputs.first().map_or(0, Vec::len);
    (0..len)
        .map(|i| {
            let mut acc = inputs[0][i].to_f32();
            for input in &inputs[1..] {
                acc = op.combine(acc, input[i].to_f32());
            }
            if op == ReduceOp::Average {
                acc /= inputs.len() as f32;
            }
            T::from_f32(acc)
        })
        .collect()
}
