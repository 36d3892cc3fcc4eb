//! Optimizers over flat slices, with PyTorch's update rules, so a data-parallel replica updates
//! its whole buffer and a ZeRO shard updates just its slice with the same code.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD(momentum, weight_decay)`, no Nesterov.
    Sgd { momentum: f32, weight_decay: f32 },
    /// `torch.optim.AdamW`.
    Adamw {
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
}

/// Optimizer state for one contiguous slice of parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Optimizer {
    pub config: OptimizerConfig,
    /// Momentum buffer (SGD) or first moment (AdamW).
    pub m: Vec<f32>,
    /// Second moment (AdamW only; empty for SGD).
    pub v: Vec<f32>,
    pub step: u64,
}

impl Optimizer {
    pub fn new(config: OptimizerConfig, len: usize) -> Self {
        let v_len = match config {
            OptimizerConfig::Sgd { .. } => 0,
            OptimizerConfig::Adamw { .. } => len,
        };
        Optimizer {
            config,
            m: vec![0.0; len],
            v: vec![0.0; v_len],
            step: 0,
        }
    }

    /// Bytes of optimizer state (for memory reports).
    pub fn state_bytes(&self) -> usize {
        (self.m.len() + self.v.len()) * 4
    }

    /// One update of `params` from `grads` at learning rate `lr`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) {
        assert_eq!(params.len(), grads.len());
        assert_eq!(
            params.len(),
            self.m.len(),
            "optimizer state sized for another slice"
        );
        self.step += 1;
        match self.config {
            OptimizerConfig::Sgd {
                momentum,
                weight_decay,
            } => {
                let first = self.step == 1;
                for ((p, &g), m) in params.iter_mut().zip(grads).zip(&mut self.m) {
                    let g = g + weight_decay * *p;
                    *m = if first || momentum == 0.0 {
                        g
                    } else {
                        momentum * *m + g
                    };
                    *p -= lr * *m;
                }
            }
            OptimizerConfig::Adamw {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let t = self.step as i32;
                let c1 = 1.0 - beta1.powi(t);
                let c2 = 1.0 - beta2.powi(t);
                let decay = 1.0 - lr * weight_decay;
                // PyTorch's arrangement: one square root and one division per element, with
                // the bias corrections folded into two scalars.
                let step_size = lr / c1;
                let inv_sqrt_c2 = 1.0 / c2.sqrt();
                for (((p, &g), m), v) in params
                    .iter_mut()
                    .zip(grads)
                    .zip(&mut self.m)
                    .zip(&mut self.v)
                {
                    *p *= decay;
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    let denom = v.sqrt() * inv_sqrt_c2 + eps;
                    *p -= step_size * *m / denom;
                }
            }
        }
    }
}

/// Global L2 norm of the gradients (f64 accumulation).
pub fn grad_norm(grads: &[f32]) -> f32 {
    sum_of_squares(grads).sqrt() as f32
}

/// `Σ g²` in f64, with eight independent partial sums: one running sum is a serial chain of
/// dependent adds that LLVM may not reorder (~4 ms per step for GPT's 3.3M gradients).
pub fn sum_of_squares(grads: &[f32]) -> f64 {
    let square = |g: f32| (g as f64) * (g as f64);
    let mut lanes = [0.0f64; 8];
    let chunks = grads.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&g| square(g)).sum();
    for c in chunks {
        for i in 0..8 {
            lanes[i] += square(c[i]);
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// Scale gradients so their global norm is at most `max_norm`; returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> f32 {
    let norm = grad_norm(grads);
    if norm > max_norm && norm > 0.0 {
        let k = max_norm / (norm + 1e-6);
        grads.iter_mut().for_each(|g| *g *= k);
    }
    norm
}
