//! Learning-rate schedules: linear warm-up then cosine decay, and the linear scaling rule.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    pub base_lr: f32,
    /// Steps of linear warm-up (from base/warmup to base).
    pub warmup_steps: u64,
    pub total_steps: u64,
    /// Final learning rate as a fraction of the base (cosine floor).
    pub min_lr_fraction: f32,
}

impl Schedule {
    pub fn constant(lr: f32) -> Self {
        Schedule {
            base_lr: lr,
            warmup_steps: 0,
            total_steps: 0,
            min_lr_fraction: 1.0,
        }
    }

    /// Learning rate at 0-based step `s`: `base·(s+1)/warm` during warm-up, then
    /// `min + (base − min)·½(1 + cos(π·p))` with p the fraction of the decay done.
    pub fn lr(&self, s: u64) -> f32 {
        if s < self.warmup_steps {
            return self.base_lr * (s + 1) as f32 / self.warmup_steps as f32;
        }
        let decay = self.total_steps.saturating_sub(self.warmup_steps);
        if decay == 0 {
            return self.base_lr;
        }
        let p = ((s - self.warmup_steps) as f64 / decay as f64).min(1.0);
        let min = (self.base_lr * self.min_lr_fraction) as f64;
        (min + (self.base_lr as f64 - min) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())) as f32
    }
}

/// Goyal et al.'s linear scaling rule: the learning rate grows with the global batch.
pub fn scale_lr_linearly(base_lr: f32, base_batch: usize, global_batch: usize) -> f32 {
    base_lr * global_batch as f32 / base_batch as f32
}
