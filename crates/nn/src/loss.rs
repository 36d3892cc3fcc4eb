//! Losses: what the worker holding a model's last block computes from its output and the
//! targets. A trainer takes any [`Loss`], so a user's model is not tied to classification.
//!
//! A loss returns the *mean* over its targets and the gradient of `grad_scale × mean`: with
//! `m` micro-batches (gradient accumulation, pipeline micro-batches) each uses
//! `grad_scale = 1/m`, and the accumulated gradients are those of the whole batch's mean.
//! Bad targets (a class id past the last class, a target count that does not match the
//! output) are errors that name the numbers, never a panic inside a kernel.

use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::Tensor;

/// One batch's loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossValue {
    /// Mean loss over the targets.
    pub mean: f32,
    /// Targets the mean is over, so means of unequal batches combine exactly.
    pub count: usize,
    /// Correct predictions, for losses where that means something (classification).
    pub correct: Option<usize>,
}

/// Why a loss cannot be computed on a batch.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LossError {
    #[error(
        "{loss}: the model's output has {elements} values, but {targets} targets × {per_target} \
         values per target = {expected} were expected (output shape {shape:?})"
    )]
    OutputSize {
        loss: String,
        elements: usize,
        targets: usize,
        per_target: usize,
        expected: usize,
        shape: Vec<usize>,
    },
    #[error("{loss}: target {index} is {target}, outside 0..{classes}")]
    TargetOutOfRange {
        loss: String,
        index: usize,
        target: u32,
        classes: usize,
    },
}

/// A loss over integer targets (class ids, next-token ids).
pub trait Loss: Send + Sync {
    /// A name for messages ("cross-entropy over 10 classes").
    fn name(&self) -> String;

    /// The mean loss over `targets` and the gradient of `grad_scale × mean` with respect to
    /// `output`, in `output`'s shape.
    fn forward_backward(
        &self,
        output: &Tensor,
        targets: &[u32],
        grad_scale: f32,
    ) -> Result<(LossValue, Tensor), LossError>;

    /// The loss alone (evaluation). The default computes and drops the gradient.
    fn forward(&self, output: &Tensor, targets: &[u32]) -> Result<LossValue, LossError> {
        Ok(self.forward_backward(output, targets, 1.0)?.0)
    }

    /// The number of classes, for losses over class scores (tensor parallelism replaces a
    /// cross-entropy by its vocab-parallel form and needs to know it is one).
    fn classes(&self) -> Option<usize> {
        None
    }

    /// Checks targets before any work (a trainer calls it on every batch it loads), so a bad
    /// dataset fails with the sample's position instead of deep inside a pipeline step.
    fn check_targets(&self, _targets: &[u32]) -> Result<(), LossError> {
        Ok(())
    }

    /// The loss of a model output on a GPU. A loss with device kernels adds Σ per-target
    /// loss and Σ correct into the two f64 at `sums` (device memory: the host reads them
    /// once per step) and returns `None` as the value; the default computes on the host
    /// (the output copied over, the gradient copied back) and returns the value.
    /// `targets_on_device` holds the targets as i32. With `grad_scale`, also returns the
    /// gradient of `grad_scale × mean`, on the output's device.
    #[cfg(feature = "cuda")]
    fn forward_backward_on_device(
        &self,
        output: Tensor,
        targets: &[u32],
        targets_on_device: u64,
        grad_scale: Option<f32>,
        sums: u64,
    ) -> Result<(Option<LossValue>, Option<Tensor>), LossError> {
        let _ = (targets_on_device, sums);
        on_the_host(self, output, targets, grad_scale)
    }
}

/// A loss computed on the host for an output that may be on a GPU: the output copied over,
/// the gradient (with `grad_scale`) copied back to the output's device. What
/// [`Loss::forward_backward_on_device`] does for a loss without device kernels.
#[cfg(feature = "cuda")]
pub fn on_the_host<L: Loss + ?Sized>(
    loss: &L,
    output: Tensor,
    targets: &[u32],
    grad_scale: Option<f32>,
) -> Result<(Option<LossValue>, Option<Tensor>), LossError> {
    let (value, grad) =
        loss.forward_backward(&output.to_host(), targets, grad_scale.unwrap_or(1.0))?;
    let grad = grad_scale.map(|_| match output.cuda() {
        Some(out) => Tensor::from_cuda(
            meshtrain_tensor::cuda::error::ok_or_raise(
                meshtrain_tensor::cuda::CudaTensor::from_host(
                    out.device(),
                    grad.data(),
                    meshtrain_tensor::DType::F32,
                ),
            ),
            output.shape(),
        ),
        None => grad,
    });
    Ok((Some(value), grad))
}

/// Softmax cross-entropy over `classes` classes, PyTorch's `nn.CrossEntropyLoss` with mean
/// reduction: the output holds `classes` logits per target (`[N, classes]` for images,
/// `[B, T, vocab]` for a language model), and `correct` counts arg-max hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrossEntropy {
    pub classes: usize,
}

impl CrossEntropy {
    pub fn new(classes: usize) -> Self {
        CrossEntropy { classes }
    }

    fn check_output(&self, output: &Tensor, targets: &[u32]) -> Result<(), LossError> {
        let expected = targets.len() * self.classes;
        if output.numel() != expected {
            return Err(LossError::OutputSize {
                loss: self.name(),
                elements: output.numel(),
                targets: targets.len(),
                per_target: self.classes,
                expected,
                shape: output.shape().to_vec(),
            });
        }
        self.check_targets(targets)
    }
}

impl Loss for CrossEntropy {
    fn name(&self) -> String {
        format!("cross-entropy over {} classes", self.classes)
    }

    fn classes(&self) -> Option<usize> {
        Some(self.classes)
    }

    fn forward_backward(
        &self,
        output: &Tensor,
        targets: &[u32],
        grad_scale: f32,
    ) -> Result<(LossValue, Tensor), LossError> {
        self.check_output(output, targets)?;
        let (mean, grad, correct) =
            softmax_cross_entropy(output.data(), self.classes, targets, grad_scale);
        let value = LossValue {
            mean,
            count: targets.len(),
            correct: Some(correct),
        };
        Ok((value, Tensor::from_vec(grad, output.shape())))
    }

    #[cfg(feature = "cuda")]
    fn forward_backward_on_device(
        &self,
        output: Tensor,
        targets: &[u32],
        targets_on_device: u64,
        grad_scale: Option<f32>,
        sums: u64,
    ) -> Result<(Option<LossValue>, Option<Tensor>), LossError> {
        self.check_output(&output, targets)?;
        let Some(logits) = output.cuda().cloned() else {
            return on_the_host(self, output, targets, grad_scale);
        };
        let rows = targets.len();
        let shape = output.shape().to_vec();
        drop(output);
        let grad =
            meshtrain_tensor::cuda::error::ok_or_raise(meshtrain_tensor::cuda::ops::cross_entropy(
                logits,
                targets_on_device,
                rows,
                self.classes,
                grad_scale.map(|s| s / rows as f32),
                sums,
            ));
        Ok((None, grad.map(|g| Tensor::from_cuda(g, &shape))))
    }

    fn check_targets(&self, targets: &[u32]) -> Result<(), LossError> {
        match targets.iter().position(|&t| t as usize >= self.classes) {
            None => Ok(()),
            Some(index) => Err(LossError::TargetOutOfRange {
                loss: self.name(),
                index,
                target: targets[index],
                classes: self.classes,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_entropy_checks_sizes_and_targets_before_the_kernel() {
        let ce = CrossEntropy::new(3);
        let logits = Tensor::from_vec(vec![0.0; 6], &[2, 3]);
        let (v, g) = ce.forward_backward(&logits, &[0, 2], 0.5).unwrap();
        assert_eq!((v.count, g.shape()), (2, &[2usize, 3][..]));
        assert!((v.mean - 3f32.ln()).abs() < 1e-6);
        // d(0.5·mean)/dlogit of the target entry of row 0: 0.5·(1/3 − 1)/2.
        assert!((g.data()[0] - 0.5 * (1.0 / 3.0 - 1.0) / 2.0).abs() < 1e-6);
        let e = ce.forward(&logits, &[0, 3]).unwrap_err().to_string();
        assert!(e.contains("target 1 is 3, outside 0..3"), "{e}");
        let e = ce.forward(&logits, &[0]).unwrap_err().to_string();
        assert!(e.contains("6 values, but 1 targets × 3"), "{e}");
    }
}
