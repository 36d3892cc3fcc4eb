//! The CUDA backend: device tensors, the kernels a GPT step needs, and cuBLASLt products.
//!
//! Everything here is reached through `cudarc` with dynamic loading: building needs no CUDA
//! toolkit, and a process that never asks for a GPU never loads a CUDA library. The pieces:
//!
//! * [`probe`]: which libraries are missing, said before any work;
//! * [`context`]: one GPU (context, stream, caching allocator, kernel modules, staging);
//! * [`alloc`]: the caching allocator's bookkeeping (host code, unit-tested);
//! * [`compile`]: NVRTC compilation of `kernels/*.cu` for the device, cached on disk;
//! * [`blas`]: matrix products on cuBLASLt;
//! * [`ops`]: the operations layers call on device tensors (shape and dtype checks, then
//!   launches), each the twin of a CPU kernel it is tested against ([`check`]);
//! * [`train_ops`]: what a training step does over flat buffers (optimizers, norms);
//! * [`decode`]: incremental decoding's key/value cache and attention over it;
//! * [`graph`]: a training step captured as a CUDA graph and replayed.
//!
//! A device tensor ([`CudaTensor`]) holds a reference-counted buffer, so cloning one (a
//! layer keeping its input for backward) copies nothing; operations write new buffers.

pub mod alloc;
pub mod blas;
pub mod check;
pub mod compile;
pub mod context;
pub mod convnet;
pub mod decode;
pub mod error;
pub mod fp8_linear;
pub mod graph;
pub mod ops;
pub mod probe;
pub mod train_ops;

pub use blas::F32Math;
pub use context::{CudaDevice, DevBuf, PinnedBuf};
pub use error::CudaError;

use crate::DType;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

/// Values of one dtype in a device buffer.
#[derive(Clone)]
pub struct CudaTensor {
    buf: Arc<DevBuf>,
    dtype: DType,
    len: usize,
}

impl CudaTensor {
    /// `len` values of `dtype`, contents undefined (every kernel that makes one writes it
    /// whole).
    pub fn alloc(
        device: &Arc<CudaDevice>,
        len: usize,
        dtype: DType,
        what: &str,
    ) -> Result<CudaTensor, CudaError> {
        Ok(CudaTensor {
            buf: Arc::new(device.alloc(len * dtype.size_bytes(), what)?),
            dtype,
            len,
        })
    }

    /// `len` zeros of `dtype`.
    pub fn zeros(
        device: &Arc<CudaDevice>,
        len: usize,
        dtype: DType,
        what: &str,
    ) -> Result<CudaTensor, CudaError> {
        let t = Self::alloc(device, len, dtype, what)?;
        device.memset_zero(t.ptr(), t.bytes())?;
        Ok(t)
    }

    /// Host values uploaded as `dtype` (rounded to nearest even for 16 bits).
    pub fn from_host(
        device: &Arc<CudaDevice>,
        values: &[f32],
        dtype: DType,
    ) -> Result<CudaTensor, CudaError> {
        let t = Self::alloc(device, values.len(), dtype, "an uploaded tensor")?;
        match dtype {
            DType::F32 => device.upload_to(t.ptr(), values)?,
            DType::BF16 => device.upload_to(t.ptr(), &crate::dtype::to_bf16(values))?,
            DType::F16 => device.upload_to(t.ptr(), &crate::dtype::to_f16(values))?,
        }
        Ok(t)
    }

    pub fn ptr(&self) -> u64 {
        self.buf.ptr()
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        self.buf.device()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size_bytes()
    }

    pub fn same_buffer(&self, other: &CudaTensor) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }

    /// Whether no other tensor shares the buffer (so it may be written in place).
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.buf) == 1
    }

    /// The values in f32 on the host (the host waits for the device).
    pub fn to_host_f32(&self) -> Result<Vec<f32>, CudaError> {
        let dev = self.device();
        Ok(match self.dtype {
            DType::F32 => dev.download::<f32>(self.ptr(), self.len)?,
            DType::BF16 => dev
                .download::<u16>(self.ptr(), self.len)?
                .into_iter()
                .map(|b| half::bf16::from_bits(b).to_f32())
                .collect(),
            DType::F16 => dev
                .download::<u16>(self.ptr(), self.len)?
                .into_iter()
                .map(|b| half::f16::from_bits(b).to_f32())
                .collect(),
        })
    }
}

/// A layer's parameters on a GPU: the f32 masters (what the optimizer updates, what norms and
/// biases of f32 products read) and, under mixed precision, their 16-bit compute copy (what
/// bf16/f16 products read), both slices of the model's flat device buffers.
#[derive(Clone, Copy)]
pub struct DeviceParams<'a> {
    device: &'a Arc<CudaDevice>,
    master: u64,
    half: Option<(u64, DType)>,
    len: usize,
}

impl<'a> DeviceParams<'a> {
    /// Views `len` f32 values at `master` (and their 16-bit copy at `half`).
    ///
    /// # Safety
    /// The buffers must hold `len` values and outlive `'a`.
    pub unsafe fn new(
        device: &'a Arc<CudaDevice>,
        master: u64,
        half: Option<(u64, DType)>,
        len: usize,
    ) -> Self {
        DeviceParams {
            device,
            master,
            half,
            len,
        }
    }

    pub fn device(&self) -> &'a Arc<CudaDevice> {
        self.device
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The f32 values' address.
    pub fn master(&self) -> u64 {
        self.master
    }

    /// The address of the values in `dtype`: the masters for f32, the compute copy for its
    /// 16-bit type (`None` when there is no such copy).
    pub fn in_dtype(&self, dtype: DType) -> Option<u64> {
        match (dtype, self.half) {
            (DType::F32, _) => Some(self.master),
            (d, Some((ptr, h))) if d == h => Some(ptr),
            _ => None,
        }
    }

    pub fn slice(&self, range: Range<usize>) -> Self {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "parameter range {range:?} outside {} values",
            self.len
        );
        let at = |ptr: u64, size: usize| ptr + (range.start * size) as u64;
        DeviceParams {
            device: self.device,
            master: at(self.master, 4),
            half: self.half.map(|(p, d)| (at(p, d.size_bytes()), d)),
            len: range.len(),
        }
    }

    pub fn split_at(&self, mid: usize) -> (Self, Self) {
        (self.slice(0..mid), self.slice(mid..self.len))
    }
}

/// A layer's gradient (or buffer) slice on a GPU: f32 values it accumulates into.
pub struct DeviceGrads<'a> {
    device: &'a Arc<CudaDevice>,
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

impl<'a> DeviceGrads<'a> {
    /// Views `len` f32 values at `ptr`.
    ///
    /// # Safety
    /// The buffer must hold `len` values, outlive `'a` and not be written through another
    /// view meanwhile.
    pub unsafe fn new(device: &'a Arc<CudaDevice>, ptr: u64, len: usize) -> Self {
        DeviceGrads {
            device,
            ptr,
            len,
            _borrow: PhantomData,
        }
    }

    pub fn device(&self) -> &'a Arc<CudaDevice> {
        self.device
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A shorter-lived view of part of it.
    pub fn slice(&mut self, range: Range<usize>) -> DeviceGrads<'_> {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "gradient range {range:?} outside {} values",
            self.len
        );
        DeviceGrads {
            device: self.device,
            ptr: self.ptr + (range.start * 4) as u64,
            len: range.len(),
            _borrow: PhantomData,
        }
    }

    pub fn split_at(self, mid: usize) -> (DeviceGrads<'a>, DeviceGrads<'a>) {
        assert!(mid <= self.len);
        let tail = DeviceGrads {
            device: self.device,
            ptr: self.ptr + (mid * 4) as u64,
            len: self.len - mid,
            _borrow: PhantomData,
        };
        (
            DeviceGrads {
                device: self.device,
                ptr: self.ptr,
                len: mid,
                _borrow: PhantomData,
            },
            tail,
        )
    }
}
