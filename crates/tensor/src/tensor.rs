//! The owned, contiguous f32 tensor that flows between layers.

use std::fmt;

/// An owned, contiguous, row-major f32 buffer with a shape.
///
/// Deliberately simple: layers own their layouts (see the crate docs for CNHW) and kernels
/// work on slices, so a tensor never needs strides. Integer inputs such as token ids travel
/// as exact f32 values (exact below 2^24, far above any vocabulary we use).
#[derive(Clone, PartialEq)]
pub struct Tensor {
    data: Vec<f32>,
    shape: Vec<usize>,
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
            data,
            shape: shape.to_vec(),
        }
    }

    pub fn zeros(shape: &[usize]) -> Self {
        Tensor {
            data: vec![0.0; shape.iter().product()],
            shape: shape.to_vec(),
        }
    }

    /// A tensor whose contents are unspecified (a recycled buffer, see
    /// [`crate::par::take_buffer`]): for outputs the caller overwrites completely, which
    /// saves the zero-fill of [`Tensor::zeros`].
    pub fn for_overwrite(shape: &[usize]) -> Self {
        Tensor {
            data: crate::par::take_buffer(shape.iter().product()),
            shape: shape.to_vec(),
        }
    }

    /// Hand the buffer back to this thread's pool for a later [`Tensor::for_overwrite`]:
    /// called by backward passes on activations that are dead from then on.
    pub fn recycle(self) {
        crate::par::recycle(self.data);
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
        self.data.len()
    }

    pub fn data(&self) -> &[f32] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    pub fn into_vec(self) -> Vec<f32> {
        self.data
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

    /// Bytes held by the buffer (for memory accounting).
    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }

    /// Largest absolute element-wise difference to `other` (same shape required).
    pub fn max_abs_diff(&self, other: &Tensor) -> f32 {
        assert_eq!(self.shape, other.shape);
        self.data
            .iter()
            .zip(&other.data)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head: Vec<f32> = self.data.iter().take(6).copied().collect();
        write!(f, "Tensor{:?} {:?}…", self.shape, head)
    }
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
