//! A Llama-family decoder (Touvron et al. 2023): token embedding (no position table),
//! `layers` pre-norm blocks with RMS norms, rotary positions, grouped-query attention and a
//! SwiGLU MLP, no biases, a final RMS norm and an untied linear head (tied on request). Input
//! token ids `[B, T]`, output logits `[B, T, vocab]`. The tensor names and layouts map one to
//! one onto Hugging Face's `LlamaForCausalLM` (q/k/v fused in the grouped layout, gate and up
//! fused), so its weights load and export without arithmetic.

use crate::layer::{Init, TensorPlan, TpStyle};
use crate::layers::RmsNorm;
use crate::model::Model;
use crate::transformer::{AttentionKind, GptEmbedding, LlamaBlockShape, TransformerBlock};
use meshtrain_tensor::rotary::{Rope, RopeScaling};
use serde::{Deserialize, Serialize};

fn default_theta() -> f64 {
    10_000.0
}

fn default_eps() -> f32 {
    1e-5
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaConfig {
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    /// Key/value heads (grouped-query attention); `heads` is multi-head attention, 1
    /// multi-query attention.
    pub kv_heads: usize,
    /// Inner width of the SwiGLU MLP (Llama-2-7B: 11008 for dim 4096).
    pub ffn: usize,
    /// Tokens per sample (the longest context trained).
    pub seq: usize,
    /// Rotary base θ.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Llama 3.1's long-context rescaling of the rotary frequencies (`[model.rope_scaling]`:
    /// factor, low_freq_factor, high_freq_factor, original_max_position_embeddings, as in
    /// Hugging Face's config); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "default_eps")]
    pub norm_eps: f32,
    #[serde(default)]
    pub tie_embeddings: bool,
    /// The attention kernel (see [`crate::models::GptConfig::attention`]).
    #[serde(default, skip_serializing_if = "AttentionKind::is_flash")]
    pub attention: AttentionKind,
    /// Biases on the query, key and value projections (Qwen2 / Qwen2.5; the output
    /// projection and the MLP stay without).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qkv_bias: bool,
    /// Values per attention head when not `dim / heads` (Qwen3: 128 for every size, so
    /// Qwen3-0.6B's 16 heads are 2,048 wide over a width of 1,024).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// RMS norms of each query and key head before the rotation (Qwen3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_norm: bool,
    /// Mistral's sliding window: each token attends to at most this many, itself included
    /// (none: to every earlier token). Runs on the CPU's memory-efficient attention, and under
    /// context parallelism with Ulysses; no window reaches past `seq` in training, but a
    /// generated text longer than it sees only the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
}

fn is_false(b: &bool) -> bool {
    !b
}

impl LlamaConfig {
    /// Checks that the shape can be built, with a message a user can act on.
    pub fn validate(&self) -> Result<(), String> {
        let sizes = [
            ("vocab", self.vocab),
            ("dim", self.dim),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn", self.ffn),
            ("seq", self.seq),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(format!("Llama {name} must be positive"));
        }
        if self.head_dim.is_none() && !self.dim.is_multiple_of(self.heads) {
            return Err(format!(
                "Llama dim {} is not divisible by heads {} (or set head_dim)",
                self.dim, self.heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) || self.head_dim() == 0 {
            return Err(format!(
                "Llama head size {} must be even and positive: rotary positions rotate pairs",
                self.head_dim()
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "Llama heads {} must be a multiple of kv_heads {} (every key/value head serves \
                 the same number of query heads)",
                self.heads, self.kv_heads
            ));
        }
        let theta_ok = self.rope_theta.partial_cmp(&1.0) == Some(std::cmp::Ordering::Greater);
        let eps_ok = self.norm_eps.partial_cmp(&0.0) == Some(std::cmp::Ordering::Greater);
        if !theta_ok || !eps_ok {
            return Err(format!(
                "Llama rope_theta must exceed 1 and norm_eps be positive (got {} and {})",
                self.rope_theta, self.norm_eps
            ));
        }
        if let Some(problem) = self.rope_scaling.and_then(|s| s.problem()) {
            return Err(format!("Llama {problem}"));
        }
        if self.sliding_window == Some(0) {
            return Err("Llama sliding_window must be at least 1 (each token sees itself)".into());
        }
        if self.sliding_window.is_some() && self.attention == AttentionKind::Standard {
            return Err(
                "Llama sliding_window runs on the memory-efficient attention kernel: leave \
                 model.attention at \"flash\""
                    .into(),
            );
        }
        Ok(())
    }

    /// The rotary frequencies the blocks use.
    pub fn rope(&self) -> Rope {
        Rope {
            theta: self.rope_theta,
            scaling: self.rope_scaling,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.dim / self.heads)
    }

    /// Keys the last token of a sample attends to: `seq`, or the window when shorter.
    pub fn attended(&self) -> usize {
        self.sliding_window.map_or(self.seq, |w| w.min(self.seq))
    }

    /// Parameters, counted from the shapes the model builds.
    pub fn params(&self) -> usize {
        let (d, v, f) = (self.dim, self.vocab, self.ffn);
        let qkv_rows = (self.heads + 2 * self.kv_heads) * self.head_dim();
        let qkv = d * qkv_rows + if self.qkv_bias { qkv_rows } else { 0 };
        let norms = if self.qk_norm { 2 * self.head_dim() } else { 0 };
        let proj = self.heads * self.head_dim() * d;
        let block = 2 * d + qkv + norms + proj + 3 * d * f;
        let head = if self.tie_embeddings { 0 } else { v * d };
        v * d + self.layers * block + d + head
    }

    /// Forward + backward FLOPs per sequence (matrix products only, ×3 for backward; the
    /// attention's counted over the keys a token sees, a window's at most).
    pub fn train_flops_per_sequence(&self) -> f64 {
        let (keys, d, v) = (self.attended() as f64, self.dim as f64, self.vocab as f64);
        let qkv = d * ((self.heads + 2 * self.kv_heads) * self.head_dim()) as f64;
        let width = (self.heads * self.head_dim()) as f64;
        let per_layer = 2.0 * (qkv + width * d + 3.0 * d * self.ffn as f64) + 4.0 * keys * width;
        let per_token = self.layers as f64 * per_layer + 2.0 * d * v;
        3.0 * per_token * self.seq as f64
    }

    fn block_shape(&self) -> LlamaBlockShape {
        LlamaBlockShape {
            dim: self.dim,
            heads: self.heads,
            kv_heads: self.kv_heads,
            ffn: self.ffn,
            rope: self.rope(),
            norm_eps: self.norm_eps,
            qkv_bias: self.qkv_bias,
            head_dim: self.head_dim(),
            qk_norm: self.qk_norm,
            window: self.sliding_window,
        }
    }
}

/// Megatron-LM's split of a Llama: q/k/v column-parallel by key/value group (the grouped
/// layout makes an even split of the rows a split by whole groups; on more ranks than
/// key/value heads each group's key and value heads are replicated over its ranks),
/// `[gate | up]` column-parallel with gate and up split separately, `proj` and `down`
/// row-parallel, the head split over the vocabulary.
pub fn tensor_plan(cfg: &LlamaConfig) -> TensorPlan {
    TensorPlan {
        rules: vec![
            (
                "*qkv".into(),
                TpStyle::GroupedQkv {
                    kv_heads: cfg.kv_heads,
                    head_dim: cfg.head_dim(),
                },
            ),
            ("*proj".into(), TpStyle::Row),
            ("*gate_up".into(), TpStyle::Column { groups: 2 }),
            ("*down".into(), TpStyle::Row),
            ("head".into(), TpStyle::VocabHead),
        ],
    }
}

/// Weights N(0, 0.02) (Hugging Face's `initializer_range`), norms one.
pub fn llama(cfg: &LlamaConfig) -> Model {
    if let Err(e) = cfg.validate() {
        panic!("invalid Llama config: {e}");
    }
    let init = Init::Normal(0.02);
    let embedding = GptEmbedding {
        vocab: cfg.vocab,
        max_seq: cfg.seq,
        dim: cfg.dim,
        init_std: 0.02,
        learned_positions: false,
        sequence: Default::default(),
    };
    let blocks = (0..cfg.layers)
        .map(|_| TransformerBlock::llama(cfg.block_shape(), init, cfg.attention))
        .collect();
    let norm = Box::new(RmsNorm::new(cfg.dim, cfg.norm_eps));
    super::decoder(
        embedding,
        blocks,
        ("norm", norm),
        init,
        tensor_plan(cfg),
        cfg.tie_embeddings,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> LlamaConfig {
        LlamaConfig {
            vocab: 50,
            dim: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 48,
            seq: 8,
            rope_theta: 10_000.0,
            rope_scaling: None,
            norm_eps: 1e-5,
            tie_embeddings: false,
            attention: AttentionKind::Flash,
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        }
    }

    #[test]
    fn counts_its_parameters() {
        for tie in [false, true] {
            let cfg = LlamaConfig {
                tie_embeddings: tie,
                ..small()
            };
            let model = llama(&cfg);
            assert_eq!(model.num_unique_params(), cfg.params(), "tie {tie}");
        }
    }

    #[test]
    fn rejects_shapes_it_cannot_build() {
        let bad = |c: LlamaConfig| c.validate().unwrap_err();
        assert!(bad(LlamaConfig {
            kv_heads: 3,
            ..small()
        })
        .contains("multiple of kv_heads"));
        assert!(bad(LlamaConfig {
            heads: 5,
            ..small()
        })
        .contains("not divisible"));
        assert!(bad(LlamaConfig {
            dim: 12,
            heads: 4,
            kv_heads: 4,
            ..small()
        })
        .contains("even"));
        assert!(bad(LlamaConfig { ffn: 0, ..small() }).contains("ffn"));
    }
}
