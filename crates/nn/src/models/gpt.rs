//! A decoder-only, pre-LN GPT: token + position embedding, `layers` transformer blocks, a final
//! layer norm and a linear head (no bias), untied or tied to the token embedding
//! (`tie_embeddings`, as GPT-2 does). Input token ids `[B, T]`, output logits `[B, T, vocab]`.

use crate::layer::{Init, TensorPlan, TpStyle};
use crate::layers::LayerNorm;
use crate::model::Model;
use crate::transformer::{AttentionKind, GptBlock, GptEmbedding};
use meshtrain_tensor::activation::Activation;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub seq: usize,
    /// One matrix for the token embedding and the output head (`head.weight` is a tied copy
    /// of `tok.weight`; with a pipeline the two stages add their gradients, as Megatron does).
    #[serde(default)]
    pub tie_embeddings: bool,
    /// The attention kernel: "flash" (memory-efficient, the default) or "standard" (keeps the
    /// probabilities). Both compute the same function, so it is not part of the model's
    /// identity: left out when it is the default, and model descriptions (what checkpoints
    /// recognise a model by) leave it out always.
    #[serde(default, skip_serializing_if = "AttentionKind::is_flash")]
    pub attention: AttentionKind,
    /// The MLP's GELU: "erf" (exact, PyTorch's default) or "tanh" (the approximation the
    /// original GPT-2 was trained with: Hugging Face's `gelu_new`). Part of the model's
    /// identity (the functions differ by up to ~1e-3); left out when it is the default.
    #[serde(default, skip_serializing_if = "Gelu::is_erf")]
    pub gelu: Gelu,
}

/// Which GELU a GPT's MLP computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gelu {
    #[default]
    Erf,
    Tanh,
}

impl Gelu {
    pub fn is_erf(&self) -> bool {
        *self == Gelu::Erf
    }

    pub fn activation(self) -> Activation {
        match self {
            Gelu::Erf => Activation::Gelu,
            Gelu::Tanh => Activation::GeluTanh,
        }
    }
}

impl Default for GptConfig {
    /// The benchmark model: 4 layers, d=256, 4 heads, sequence 128, byte vocabulary.
    fn default() -> Self {
        GptConfig {
            vocab: 256,
            dim: 256,
            layers: 4,
            heads: 4,
            seq: 128,
            tie_embeddings: false,
            attention: AttentionKind::Flash,
            gelu: Gelu::Erf,
        }
    }
}

impl GptConfig {
    /// Checks that the shape can be built, with a message a user can act on.
    pub fn validate(&self) -> Result<(), String> {
        if self.vocab == 0 || self.dim == 0 || self.layers == 0 || self.heads == 0 || self.seq == 0
        {
            return Err(format!("every GPT dimension must be positive: {self:?}"));
        }
        if !self.dim.is_multiple_of(self.heads) {
            return Err(format!(
                "GPT dim {} is not divisible by heads {}",
                self.dim, self.heads
            ));
        }
        Ok(())
    }

    /// Parameters, counted from the shapes the model builds: token and position tables,
    /// per block two layer norms, q/k/v, the projection and the 4·dim MLP with their biases,
    /// the final norm, and the head unless tied.
    pub fn params(&self) -> usize {
        let (d, v) = (self.dim, self.vocab);
        let block = 12 * d * d + 13 * d;
        let head = if self.tie_embeddings { 0 } else { v * d };
        v * d + self.seq * d + self.layers * block + 2 * d + head
    }

    /// Forward + backward FLOPs per sequence (matrix products only, ×3 for backward).
    pub fn train_flops_per_sequence(&self) -> f64 {
        let (t, d, v, l) = (
            self.seq as f64,
            self.dim as f64,
            self.vocab as f64,
            self.layers as f64,
        );
        let per_token = l * (24.0 * d * d + 4.0 * t * d) + 2.0 * d * v;
        3.0 * per_token * t
    }
}

/// Megatron-LM's split of a GPT: in each block q/k/v and fc1 column-parallel (q, k and v
/// split by heads), proj and fc2 row-parallel; the head split over the vocabulary. The
/// embedding (by vocabulary) and the attention core (by heads) follow from their types.
pub fn tensor_plan() -> TensorPlan {
    TensorPlan {
        rules: vec![
            ("*qkv".into(), TpStyle::Column { groups: 3 }),
            ("*proj".into(), TpStyle::Row),
            ("*fc1".into(), TpStyle::Column { groups: 1 }),
            ("*fc2".into(), TpStyle::Row),
            ("head".into(), TpStyle::VocabHead),
        ],
    }
}

/// GPT-2 style initialisation: weights N(0, 0.02), biases zero.
pub fn gpt(cfg: &GptConfig) -> Model {
    cfg.validate().expect("invalid GPT config");
    let init = Init::Normal(0.02);
    let embedding = GptEmbedding {
        vocab: cfg.vocab,
        max_seq: cfg.seq,
        dim: cfg.dim,
        init_std: 0.02,
        learned_positions: true,
        sequence: Default::default(),
    };
    let blocks = (0..cfg.layers)
        .map(|_| {
            let gelu = cfg.gelu.activation();
            GptBlock::gpt(cfg.dim, cfg.heads, Some(init), cfg.attention, gelu)
        })
        .collect();
    let norm = Box::new(LayerNorm::new(cfg.dim));
    super::decoder(
        embedding,
        blocks,
        ("ln_f", norm),
        init,
        tensor_plan(),
        cfg.tie_embeddings,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_its_parameters() {
        for tie in [false, true] {
            let cfg = GptConfig {
                vocab: 37,
                dim: 16,
                layers: 2,
                heads: 2,
                seq: 8,
                tie_embeddings: tie,
                ..GptConfig::default()
            };
            assert_eq!(gpt(&cfg).num_unique_params(), cfg.params(), "tie {tie}");
        }
    }
}
