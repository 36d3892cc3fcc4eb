//! Mixed precision: the last dimension [`crate::parallelize`] applies to a model and its step.
//!
//! What runs in which precision (the policy, like `torch.autocast`'s op lists; the table is in
//! docs/precision.md):
//! * **matrix products** (linear layers, im2col convolutions) take bf16 or f16 inputs and
//!   accumulate in f32 ([`meshtrain_tensor::lowp`]); the inputs they keep for backward are
//!   stored in 16 bits, since backward's products round them there anyway;
//! * **everything else stays f32**: softmax, layer/batch-norm statistics, losses, reductions,
//!   the gradient all-reduce (bf16 on the wire only when asked), gradient accumulation, the
//!   optimizer and its state. The parameters themselves are the f32 **master weights**; the
//!   16-bit copy a product reads is made while it packs them, so it is always the current
//!   step's weights;
//! * **fp16** has 5 exponent bits: gradients below 2⁻²⁴ vanish and values above 65,504
//!   overflow. The loss is multiplied by a **dynamic loss scale** ([`LossScaler`], PyTorch
//!   `GradScaler`'s rules) before backward and the gradients divided by it before clipping
//!   and the optimizer; a step whose gradients hold an inf or NaN on *any* worker is skipped
//!   by *every* worker (the flag is agreed over the whole world: data, pipeline and tensor
//!   parallel ranks) and the scale halves. bf16 has f32's exponent range and needs no scale;
//! * **fp8** is bf16 with the linear layers' three products (forward, input and weight
//!   gradients) of every block but the first and last in FP8: inputs and weights in E4M3,
//!   output gradients in E5M2, each tensor multiplied by its own current scale before the
//!   cast and the f32 sums unscaled ([`meshtrain_tensor::fp8`]). Attention and the model's
//!   ends stay bf16; no loss scale (the per-tensor scales do that work).

use crate::ParallelError;
use meshtrain_comm::{BufMut, ProcessGroup, ReduceOp};
use meshtrain_nn::{Loss, LossError, LossValue, Model};
use meshtrain_tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

pub use meshtrain_plan::cluster::Precision;

/// A precision the trainer runs: fp32, bf16, fp16 or fp8.
pub fn parse_trainer_precision(text: &str) -> Result<Precision, String> {
    Precision::parse(text).map_err(|e| e.to_string())
}

/// The input type of a precision's matrix products; under fp8 that of the products left in
/// bf16 (attention, the model's first and last blocks) and the storage of what layers keep
/// for backward.
pub fn product_dtype(precision: Precision) -> DType {
    match precision {
        Precision::Fp32 => DType::F32,
        Precision::Bf16 | Precision::Fp8 => DType::BF16,
        Precision::Fp16 => DType::F16,
    }
}

/// Runs `model`'s products in `precision` (every layer, including ones tensor parallelism
/// put in place). fp8 is bf16 mixed precision with the linear products of the model's
/// inner blocks in FP8 ([`meshtrain_nn::Model::set_fp8_products`]).
pub fn apply(model: &mut Model, precision: Precision) {
    model.set_precision(product_dtype(precision));
    model.set_fp8_products(precision == Precision::Fp8);
}

/// Dynamic loss scaling's settings: PyTorch `torch.amp.GradScaler`'s defaults.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossScaleConfig {
    /// The first scale (2¹⁶).
    pub init_scale: f32,
    /// Factor the scale grows by after `growth_interval` steps in a row without overflow.
    pub growth_factor: f32,
    /// Factor the scale shrinks by at a step with an overflow (that step is skipped).
    pub backoff_factor: f32,
    pub growth_interval: u32,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScaleConfig {
    /// Rejects settings under which the scale could not recover or would not move.
    pub fn check(&self) -> Result<(), String> {
        let ok = self.init_scale.is_finite()
            && self.init_scale > 0.0
            && self.growth_factor > 1.0
            && self.growth_factor.is_finite()
            && self.backoff_factor > 0.0
            && self.backoff_factor < 1.0
            && self.growth_interval > 0;
        if ok {
            Ok(())
        } else {
            Err(format!(
                "loss scaling needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 \
                 and growth_interval ≥ 1; got {self:?}"
            ))
        }
    }
}

/// The dynamic loss scale and its state machine (GradScaler's `update`): every step without
/// an inf/NaN gradient counts towards growth; after `growth_interval` of them in a row the
/// scale grows by `growth_factor`; a step with one is skipped, the scale is multiplied by
/// `backoff_factor` and the count starts again.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f32,
    /// Clean steps in a row since the scale last changed.
    pub growth_tracker: u32,
    pub config: LossScaleConfig,
}

impl LossScaler {
    pub fn new(config: LossScaleConfig) -> Self {
        LossScaler {
            scale: config.init_scale,
            growth_tracker: 0,
            config,
        }
    }

    /// After a step: `found_inf` says whether its gradients overflowed (it was skipped).
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
            return;
        }
        self.growth_tracker += 1;
        if self.growth_tracker >= self.config.growth_interval {
            let grown = self.scale * self.config.growth_factor;
            // GradScaler keeps the scale when growing it would overflow f32.
            if grown.is_finite() {
                self.scale = grown;
            }
            self.growth_tracker = 0;
        }
    }
}

/// A loss whose gradient is multiplied by the current loss scale (the value it reports is
/// not): backward then carries `scale ×` the gradients through the fp16 products.
pub struct ScaledLoss {
    inner: Arc<dyn Loss>,
    scale: Arc<AtomicU32>,
}

impl Loss for ScaledLoss {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn forward_backward(
        &self,
        output: &Tensor,
        targets: &[u32],
        grad_scale: f32,
    ) -> Result<(LossValue, Tensor), LossError> {
        let scale = f32::from_bits(self.scale.load(Ordering::Relaxed));
        self.inner
            .forward_backward(output, targets, grad_scale * scale)
    }

    fn forward(&self, output: &Tensor, targets: &[u32]) -> Result<LossValue, LossError> {
        self.inner.forward(output, targets)
    }

    fn classes(&self) -> Option<usize> {
        self.inner.classes()
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
        let scale = f32::from_bits(self.scale.load(Ordering::Relaxed));
        self.inner.forward_backward_on_device(
            output,
            targets,
            targets_on_device,
            grad_scale.map(|s| s * scale),
            sums,
        )
    }

    fn check_targets(&self, targets: &[u32]) -> Result<(), LossError> {
        self.inner.check_targets(targets)
    }
}

/// What a step's loss scaling decided.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleOutcome {
    /// Some worker's gradients held an inf or NaN: nobody updates this step.
    pub skipped: bool,
    /// The scale after the update.
    pub scale: f32,
}

/// The loss scaling of one worker's step: the scaler, the scale the loss reads, and (tests
/// only) an overflow to inject.
pub struct LossScaling {
    scaler: LossScaler,
    shared_scale: Arc<AtomicU32>,
    /// Tests: (step index counted by this object, world rank) whose gradients get an inf.
    inject_overflow: Option<(u64, usize)>,
    steps: u64,
}

impl LossScaling {
    /// The scaling for `precision` (fp16 only: `None` for fp32 and bf16), and `loss` wrapped
    /// so that its gradient carries the scale.
    pub fn for_precision(
        precision: Precision,
        config: LossScaleConfig,
        inject_overflow: Option<(u64, usize)>,
        loss: Arc<dyn Loss>,
    ) -> Result<(Option<LossScaling>, Arc<dyn Loss>), ParallelError> {
        if precision != Precision::Fp16 {
            return Ok((None, loss));
        }
        config.check().map_err(ParallelError::Precision)?;
        let scaler = LossScaler::new(config);
        let shared_scale = Arc::new(AtomicU32::new(scaler.scale.to_bits()));
        let scaled: Arc<dyn Loss> = Arc::new(ScaledLoss {
            inner: loss,
            scale: shared_scale.clone(),
        });
        let scaling = LossScaling {
            scaler,
            shared_scale,
            inject_overflow,
            steps: 0,
        };
        Ok((Some(scaling), scaled))
    }

    pub fn scaler(&self) -> LossScaler {
        self.scaler
    }

    /// Continues from a checkpoint's scale and growth count; the settings stay this run's.
    pub fn restore(&mut self, scaler: LossScaler) {
        self.scaler.scale = scaler.scale;
        self.scaler.growth_tracker = scaler.growth_tracker;
        self.shared_scale
            .store(scaler.scale.to_bits(), Ordering::Relaxed);
    }

    /// The scale gradients are divided by this step.
    pub fn scale(&self) -> f32 {
        self.scaler.scale
    }

    /// After this worker's gradients were unscaled (`found_inf`: one overflowed, from
    /// `Stage::unscale_grads` by [`LossScaling::scale`]): agrees with every worker of `world`
    /// whether to skip, and updates the scale. Every worker of `world` calls it once per
    /// step.
    pub fn decide(
        &mut self,
        mut found_inf: bool,
        world: &dyn ProcessGroup,
    ) -> Result<ScaleOutcome, ParallelError> {
        if self.inject_overflow == Some((self.steps, world.rank())) {
            found_inf = true;
        }
        self.steps += 1;
        let mut flag = [if found_inf { 1.0f32 } else { 0.0 }];
        if world.size() > 1 {
            world.all_reduce(BufMut::F32(&mut flag), ReduceOp::Max)?;
        }
        let skipped = flag[0] > 0.0;
        self.scaler.update(skipped);
        self.shared_scale
            .store(self.scaler.scale.to_bits(), Ordering::Relaxed);
        Ok(ScaleOutcome {
            skipped,
            scale: self.scaler.scale,
        })
    }
}

/// Multiplies every gradient by `factor`, telling whether any is inf or NaN (the host arm of
/// a chunk's unscaling; the step reaches it through `StageChunk::unscale_grads`).
pub use crate::engine::device::unscale;

#[cfg(test)]
mod tests {
    use super::*;

    fn config(interval: u32) -> LossScaleConfig {
        LossScaleConfig {
            growth_interval: interval,
            ..LossScaleConfig::default()
        }
    }

    /// GradScaler's rules, step by step: grow ×2 after `interval` clean steps in a row, halve
    /// and restart the count at an overflow, never grow past f32.
    #[test]
    fn the_scale_follows_grad_scalers_state_machine() {
        let mut s = LossScaler::new(config(3));
        assert_eq!(s.scale, 65536.0);
        s.update(false);
        s.update(false);
        assert_eq!((s.scale, s.growth_tracker), (65536.0, 2));
        s.update(false);
        assert_eq!((s.scale, s.growth_tracker), (131072.0, 0));
        s.update(false);
        s.update(true);
        assert_eq!((s.scale, s.growth_tracker), (65536.0, 0));
        // Two clean steps, an overflow: the count restarts, so three more are needed.
        s.update(false);
        s.update(false);
        s.update(true);
        assert_eq!(s.scale, 32768.0);
        for _ in 0..2 {
            s.update(false);
        }
        assert_eq!(s.scale, 32768.0);
        s.update(false);
        assert_eq!(s.scale, 65536.0);
        // Overflows in a row keep halving.
        for _ in 0..4 {
            s.update(true);
        }
        assert_eq!(s.scale, 4096.0);
        let mut top = LossScaler::new(LossScaleConfig {
            init_scale: f32::MAX,
            growth_interval: 1,
            ..LossScaleConfig::default()
        });
        top.update(false);
        assert_eq!(top.scale, f32::MAX);
    }

    #[test]
    fn unscaling_divides_and_finds_every_kind_of_overflow() {
        let mut g = vec![4.0f32; 100_000];
        assert!(!unscale(&mut g, 0.25));
        assert!(g.iter().all(|&v| v == 1.0));
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut g = vec![1.0f32; 100_000];
            g[77_777] = bad;
            assert!(unscale(&mut g, 0.5));
        }
    }

    #[test]
    fn bad_settings_are_rejected() {
        assert!(LossScaleConfig::default().check().is_ok());
        for bad in [
            LossScaleConfig {
                backoff_factor: 1.0,
                ..LossScaleConfig::default()
            },
            LossScaleConfig {
                growth_factor: 0.5,
                ..LossScaleConfig::default()
            },
            LossScaleConfig {
                init_scale: 0.0,
                ..LossScaleConfig::default()
            },
            LossScaleConfig {
                growth_interval: 0,
                ..LossScaleConfig::default()
            },
        ] {
            assert!(bad.check().unwrap_err().contains("loss scaling"));
        }
    }

    #[test]
    fn the_scaled_loss_scales_the_gradient_only() {
        let inner: Arc<dyn Loss> = Arc::new(meshtrain_nn::loss::CrossEntropy::new(3));
        let (scaling, loss) = LossScaling::for_precision(
            Precision::Fp16,
            LossScaleConfig::default(),
            None,
            inner.clone(),
        )
        .unwrap();
        assert!(scaling.is_some());
        let out = Tensor::from_vec(vec![0.1, 0.5, -0.3, 1.0, 0.0, 0.2], &[2, 3]);
        let (v0, g0) = inner.forward_backward(&out, &[1, 2], 0.5).unwrap();
        let (v1, g1) = loss.forward_backward(&out, &[1, 2], 0.5).unwrap();
        assert_eq!(v0, v1);
        for (a, b) in g0.data().iter().zip(g1.data()) {
            assert_eq!(a * 65536.0, *b);
        }
        let (none, same) =
            LossScaling::for_precision(Precision::Bf16, LossScaleConfig::default(), None, inner)
                .unwrap();
        assert!(none.is_none());
        assert_eq!(
            same.forward_backward(&out, &[1, 2], 0.5).unwrap().1.data(),
            g0.data()
        );
    }
}
