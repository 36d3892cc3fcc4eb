//! The owned, contiguous f32 tensor that flows between layers.

use std::fmt;

/// An owned, contiguous, row-major buffer with a shape: f32 values in host memory, or
/// (with the `cuda` feature) values of any [`DType`] in a GPU's memory.
///
/// Deliberately simple: layers own their layouts (see the crate docs for CNHW) and kernels
/// work on slices, so a tensor never needs strides. Integer inputs such as token ids travel
/// as exact f32 values (exact below 2^24, far above any vocabulary we use). A layer's
/// kernels are chosen by where its tensors are ([`Tensor::device`]).
#[derive(Clone)]
pub struct Tensor {
    storage: Storage,
    shape: Vec<usize>,
    /// On a GPU, the same values rounded to a 16-bit type, where the kernel that produced
    /// them wrote that copy too ([`Tensor::with_rounded`]): what the next product reads,
    /// without a conversion pass. Dropped whenever the values may change ([`Tensor::into_cuda`],
    /// [`Tensor::add_assign`]), so it is never stale: writing into a device buffer in place
    /// needs its only handle, which only taking the values out of the tensor gives.
    #[cfg(feature = "cuda")]
    rounded: Option<crate::cuda::CudaTensor>,
}

#[derive(Clone)]
enum Storage {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaTensor),
}

impl PartialEq for Tensor {
    /// Host tensors compare by shape and values; device tensors are equal only to
    /// themselves (the same buffer), since comparing values would copy them to the host.
    fn eq(&self, other: &Self) -> bool {
        if self.shape != other.shape {
            return false;
        }
        match (&self.storage, &other.storage) {
            (Storage::Host(a), Storage::Host(b)) => a == b,
            #[cfg(feature = "cuda")]
            (Storage::Cuda(a), Storage::Cuda(b)) => a.same_buffer(b),
            #[cfg(feature = "cuda")]
            _ => false,
        }
    }
}

impl Tensor {
    /// A tensor from data and shape; panics only on a programming error (length mismatch).
    pub fn from_vec(data: Vec<f32>, shape: &[usize]) -> Self {
        assert_eq!(
            data.len(),
            shape.iter().product::<usize>(),
            "tensor data length does not match shape {shape:?}"
        );
        Tensor {
            storage: Storage::Host(data),
            shape: shape.to_vec(),
            #[cfg(feature = "cuda")]
            rounded: None,
        }
    }

    /// A tensor over device values (`shape`'s element count of them).
    #[cfg(feature = "cuda")]
    pub fn from_cuda(values: crate::cuda::CudaTensor, shape: &[usize]) -> Self {
        assert_eq!(
            values.len(),
            shape.iter().product::<usize>(),
            "device tensor length does not match shape {shape:?}"
        );
        Tensor {
            storage: Storage::Cuda(values),
            shape: shape.to_vec(),
            #[cfg(feature = "cuda")]
            rounded: None,
        }
    }

    /// The device values, if the tensor is on a GPU.
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> Option<&crate::cuda::CudaTensor> {
        match &self.storage {
            Storage::Cuda(c) => Some(c),
            Storage::Host(_) => None,
        }
    }

    /// `self` (device values) with `rounded`, the same values rounded to a 16-bit type by the
    /// kernel that wrote them, for [`Tensor::rounded`].
    #[cfg(feature = "cuda")]
    pub fn with_rounded(mut self, rounded: crate::cuda::CudaTensor) -> Self {
        assert!(
            self.cuda().is_some() && rounded.len() == self.numel(),
            "a rounded copy of {} device values",
            self.numel()
        );
        self.rounded = Some(rounded);
        self
    }

    /// The values rounded to `dtype`, if the kernel that produced them wrote that copy.
    #[cfg(feature = "cuda")]
    pub fn rounded(&self, dtype: crate::DType) -> Option<&crate::cuda::CudaTensor> {
        self.rounded.as_ref().filter(|r| r.dtype() == dtype)
    }

    /// Lets go of the rounded copy, if any (the values stay): for a holder that will not hand
    /// the tensor to a product, so the copy lives no longer than the one that will.
    pub fn drop_rounded(&mut self) {
        #[cfg(feature = "cuda")]
        {
            self.rounded = None;
        }
    }

    /// The device values and the shape, taken out of the tensor (so a kernel may write into
    /// a buffer no one else holds); a host tensor is handed back unchanged.
    #[cfg(feature = "cuda")]
    pub fn into_cuda(self) -> Result<(crate::cuda::CudaTensor, Vec<usize>), Tensor> {
        match self.storage {
            Storage::Cuda(c) => Ok((c, self.shape)),
            Storage::Host(_) => Err(self),
        }
    }

    /// Where the values are.
    pub fn device(&self) -> crate::Device {
        match &self.storage {
            Storage::Host(_) => crate::Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => crate::Device::Cuda(c.device().ordinal()),
        }
    }

    /// The element type: f32 on the host; on a GPU whatever the producing kernel wrote.
    pub fn dtype(&self) -> crate::DType {
        match &self.storage {
            Storage::Host(_) => crate::DType::F32,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.dtype(),
        }
    }

    /// The same values in host memory (copied from a GPU, widened to f32; the host waits
    /// for the device).
    pub fn to_host(&self) -> Tensor {
        match &self.storage {
            Storage::Host(_) => self.clone(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => Tensor::from_vec(
                crate::cuda::error::ok_or_raise(c.to_host_f32()),
                &self.shape,
            ),
        }
    }

    pub fn zeros(shape: &[usize]) -> Self {
        Tensor::from_vec(vec![0.0; shape.iter().product()], shape)
    }

    /// A tensor whose contents are unspecified (a recycled buffer, see
    /// [`crate::par::take_buffer`]): for outputs the caller overwrites completely, which
    /// saves the zero-fill of [`Tensor::zeros`].
    pub fn for_overwrite(shape: &[usize]) -> Self {
        Tensor::from_vec(crate::par::take_buffer(shape.iter().product()), shape)
    }

    /// Hand the buffer back to this thread's pool for a later [`Tensor::for_overwrite`]:
    /// called by backward passes on activations that are dead from then on.
    pub fn recycle(self) {
        match self.storage {
            Storage::Host(data) => crate::par::recycle(data),
            // A device buffer goes back to the caching allocator when its last holder drops.
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => {}
        }
    }

    pub fn scalar(value: f32) -> Self {
        Tensor::from_vec(vec![value], &[1])
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn dim(&self, axis: usize) -> usize {
        self.shape[axis]
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The host values. A device tensor reaching host code is a programming error (layers
    /// dispatch on [`Tensor::device`]; the trainer checks every layer runs on the device).
    pub fn data(&self) -> &[f32] {
        match &self.storage {
            Storage::Host(data) => data,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => panic!("{}", on_device(c)),
        }
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::Host(data) => data,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => panic!("{}", on_device(c)),
        }
    }

    pub fn into_vec(self) -> Vec<f32> {
        match self.storage {
            Storage::Host(data) => data,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => panic!("{}", on_device(&c)),
        }
    }

    /// The same data under another shape with the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> Self {
        assert_eq!(
            self.numel(),
            shape.iter().product::<usize>(),
            "cannot reshape {:?} to {shape:?}",
            self.shape
        );
        self.shape = shape.to_vec();
        self
    }

    /// `self += other` element-wise (same element count): the residual add. On a GPU the sum
    /// is f32 whatever `other`'s dtype, and a buffer another tensor shares is not written
    /// (the sum goes to a new one).
    pub fn add_assign(&mut self, other: &Tensor) {
        assert_eq!(
            self.numel(),
            other.numel(),
            "adding tensors of different sizes"
        );
        match &mut self.storage {
            Storage::Host(data) => crate::par::add_assign(data, other.data()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => {
                self.rounded = None;
                let b = other
                    .cuda()
                    .unwrap_or_else(|| panic!("adding a host tensor to one on {:?}", c.device()));
                let a = std::mem::replace(c, b.clone());
                *c = crate::cuda::error::ok_or_raise(crate::cuda::ops::add(a, b));
            }
        }
    }

    /// Bytes held by the buffer (for memory accounting).
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype().size_bytes()
    }

    /// Largest absolute element-wise difference to `other` (same shape required).
    pub fn max_abs_diff(&self, other: &Tensor) -> f32 {
        assert_eq!(self.shape, other.shape);
        self.data()
            .iter()
            .zip(other.data())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.storage {
            Storage::Host(data) => {
                let head: Vec<f32> = data.iter().take(6).copied().collect();
                write!(f, "Tensor{:?} {:?}…", self.shape, head)
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => write!(
                f,
                "Tensor{:?} {} on {:?}",
                self.shape,
                c.dtype(),
                c.device()
            ),
        }
    }
}

#[cfg(feature = "cuda")]
fn on_device(c: &crate::cuda::CudaTensor) -> String {
    format!(
        "a tensor on {:?} reached code that reads host values: the layer has no CUDA kernels \
         (Layer::runs_on should say so) or a caller forgot Tensor::to_host",
        c.device()
    )
}

/// Convert an NCHW buffer to CNHW (or back: the permutation swaps the two leading axes and is
/// its own inverse). Used at the edges of convolutional models and in tests.
pub fn swap_leading_axes(src: &[f32], a: usize, b: usize, inner: usize) -> Vec<f32> {
    assert_eq!(src.len(), a * b * inner);
    let mut dst = vec![0.0; src.len()];
    for i in 0..a {
        for j in 0..b {
            let s = (i * b + j) * inner;
            let d = (j * a + i) * inner;
            dst[d..d + inner].copy_from_slice(&src[s..s + inner]);
        }
    }
    dst
}
