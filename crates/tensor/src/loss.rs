//! Softmax cross-entropy, fused so the backward is `softmax − onehot` without storing a
//! separate probability tensor.

use crate::activation::{fast_exp, lane_sum};

/// Mean cross-entropy of `logits` (`rows × classes`) against integer `targets`.
/// Per-row losses are summed in row order, so the reported loss is bit-identical on any pool.
/// Returns (loss, dlogits of the mean loss scaled by `grad_scale`, correct-prediction count).
pub fn softmax_cross_entropy(
    logits: &[f32],
    classes: usize,
    targets: &[u32],
    grad_scale: f32,
) -> (f32, Vec<f32>, usize) {
    let rows = targets.len();
    assert_eq!(logits.len(), rows * classes, "logits/targets size mismatch");
    let mut grad = vec![0.0f32; logits.len()];
    let inv_rows = 1.0 / rows as f32;
    let row = |r: usize, g: &mut [f32]| -> (f64, usize) {
        let l = &logits[r * classes..][..classes];
        let tgt = targets[r] as usize;
        assert!(
            tgt < classes,
            "target {tgt} out of range for {classes} classes"
        );
        let (mut max, mut arg) = (f32::NEG_INFINITY, 0);
        for (i, &v) in l.iter().enumerate() {
            if v > max {
                max = v;
                arg = i;
            }
        }
        for (gi, &v) in g.iter_mut().zip(l) {
            *gi = fast_exp(v - max);
        }
        let sum = lane_sum(g);
        let log_sum = sum.ln() + max;
        let k = grad_scale * inv_rows / sum;
        g.iter_mut().for_each(|v| *v *= k);
        g[tgt] -= grad_scale * inv_rows;
        ((log_sum - l[tgt]) as f64, usize::from(arg == tgt))
    };
    let (loss, correct) = crate::par::map_chunks_mut(&mut grad, classes, row)
        .into_iter()
        .fold((0.0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    ((loss / rows as f64) as f32, grad, correct)
}
