//! In-memory image classification datasets and allocation-free batch gather.

use crate::error::DataError;

/// How raw 0..=255 pixels become `f32` model inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Normalization {
    /// `x / 255`, values in `[0, 1]`.
    UnitRange,
    /// `(x / 255 - mean) / std`: zero mean, unit variance when the statistics
    /// are the training set's (see [`Normalization::FASHION_MNIST`]).
    Standardize { mean: f32, std: f32 },
}

impl Normalization {
    /// Fashion-MNIST training-set pixel statistics (published values, which
    /// the tests re-derive from the data: mean 0.28604, std 0.35302).
    pub const FASHION_MNIST: Normalization = Normalization::Standardize {
        mean: 0.2860,
        std: 0.3530,
    };

    /// The 256 possible output values, so conversion is one table lookup per
    /// pixel and bit-identical everywhere.
    fn lookup_table(self) -> [f32; 256] {
        let mut table = [0.0f32; 256];
        for (value, slot) in table.iter_mut().enumerate() {
            let unit = value as f32 / 255.0;
            *slot = match self {
                Normalization::UnitRange => unit,
                Normalization::Standardize { mean, std } => (unit - mean) / std,
            };
        }
        table
    }
}

/// A labelled image set held as normalized `f32`, layout N×C×H×W.
#[derive(Debug, Clone)]
pub struct ImageDataset {
    /// `n * channels * height * width` values, sample after sample.
    pub images: Vec<f32>,
    /// One class id per sample, each `< num_classes`.
    pub labels: Vec<u8>,
    pub n: usize,
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub num_classes: usize,
}

impl ImageDataset {
    /// Builds a one-channel dataset from raw bytes. Callers validate shapes
    /// (the IDX reader does); this only checks they are consistent.
    pub fn from_u8(
        pixels: &[u8],
        labels: Vec<u8>,
        height: usize,
        width: usize,
        num_classes: usize,
        normalization: Normalization,
    ) -> Result<Self, DataError> {
        if height == 0 || width == 0 {
            return Err(DataError::InvalidArgument(format!(
                "image size {height}x{width} must be non-zero"
            )));
        }
        let n = labels.len();
        let expected = n * height * width;
        if pixels.len() != expected {
            return Err(DataError::BufferSize {
                what: "pixels",
                expected,
                actual: pixels.len(),
            });
        }
        if let Some(&label) = labels.iter().find(|&&l| l as usize >= num_classes) {
            return Err(DataError::InvalidArgument(format!(
                "label {label} >= num_classes {num_classes}"
            )));
        }
        let table = normalization.lookup_table();
        let images = pixels.iter().map(|&p| table[p as usize]).collect();
        Ok(Self {
            images,
            labels,
            n,
            channels: 1,
            height,
            width,
            num_classes,
        })
    }

    /// Number of `f32` values in one sample (`channels * height * width`).
    pub fn sample_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    /// Number of samples of each class, indexed by class id.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0usize; self.num_classes];
        for &label in &self.labels {
            counts[label as usize] += 1;
        }
        counts
    }

    /// Copies the samples `indices` into caller-owned buffers: `out_x` gets
    /// `indices.len() * sample_len()` values (N×C×H×W), `out_y` one class id
    /// per index. Reusing the buffers keeps the training loop allocation-free.
    pub fn batch(
        &self,
        indices: &[usize],
        out_x: &mut [f32],
        out_y: &mut [u32],
    ) -> Result<(), DataError> {
        let sample_len = self.sample_len();
        if out_x.len() != indices.len() * sample_len {
            return Err(DataError::BufferSize {
                what: "out_x",
                expected: indices.len() * sample_len,
                actual: out_x.len(),
            });
        }
        if out_y.len() != indices.len() {
            return Err(DataError::BufferSize {
                what: "out_y",
                expected: indices.len(),
                actual: out_y.len(),
            });
        }
        if let Some(&index) = indices.iter().find(|&&i| i >= self.n) {
            return Err(DataError::IndexOutOfRange { index, len: self.n });
        }
        for ((&index, x), y) in indices
            .iter()
            .zip(out_x.chunks_exact_mut(sample_len))
            .zip(out_y.iter_mut())
        {
            x.copy_from_slice(&self.images[index * sample_len..(index + 1) * sample_len]);
            *y = u32::from(self.labels[index]);
        }
        Ok(())
    }
}
