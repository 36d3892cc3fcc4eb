//! Model descriptions: a transformer given by its shape, or a small "generic" network
//! (LeNet, ResNet-18) given by its parameter count and measured-by-hand FLOPs per sample.
//!
//! Transformers get the full treatment (tensor, sequence and pipeline parallelism, per-layer
//! activation formulas of Korthikanti et al. 2022). Generic networks are only data-parallel in
//! this planner: they are small enough that nothing else makes sense for them.

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};

/// Shape of a decoder-only transformer (GPT / Llama style).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransformerSpec {
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    /// Key/value heads (grouped-query attention); defaults to `heads` (multi-head attention).
    #[serde(default)]
    pub kv_heads: Option<u64>,
    /// Inner size of the MLP (4·hidden for GPT).
    pub ffn_hidden: u64,
    /// The Llama family: a gated MLP (SwiGLU: three weight matrices instead of two), and with
    /// it what comes with that family: rotary positions (no position table), RMS norms (a
    /// weight, no bias) and no biases in the linear layers. Without it, GPT-2/Megatron's
    /// conventions: learned positions, layer norms, biases.
    #[serde(default)]
    pub gated_mlp: bool,
    pub vocab: u64,
    pub seq_len: u64,
    /// Input embedding and output head share one matrix.
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Biases on the q/k/v projections in a gated-MLP (Llama-family) model: Qwen2's.
    #[serde(default)]
    pub qkv_bias: bool,
    /// Values per attention head when not `hidden / heads` (Qwen3's 128): the attention's
    /// width is then `heads · head_dim`.
    #[serde(default)]
    pub head_dim: Option<u64>,
    /// RMS norms of each query and key head (Qwen3): two `head_dim` weights per layer.
    #[serde(default)]
    pub qk_norm: bool,
    /// Keys a token attends to at most (Mistral's sliding window): the scores and the
    /// weighted values cost `s · min(s, window)` per head instead of `s²`.
    #[serde(default)]
    pub sliding_window: Option<u64>,
}

/// A network the planner treats as an opaque block of compute (data parallelism only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenericSpec {
    pub params: u64,
    /// Forward + backward FLOPs for one sample.
    pub flops_per_sample: f64,
    /// Bytes of activations kept for backward per sample, in fp32.
    pub activation_bytes_per_sample: f64,
    /// Kernels (ops) launched per training step for forward + backward, independent of batch:
    /// on small models their fixed per-op cost dominates (see the background texts on LeNet).
    pub kernels_per_step: u64,
}

/// The architecture of a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    Transformer(TransformerSpec),
    Generic(GenericSpec),
}

/// A named model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub name: String,
    pub architecture: Architecture,
}

/// The TOML form: `name = ...` plus exactly one of `[transformer]` or `[generic]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    name: String,
    transformer: Option<TransformerSpec>,
    generic: Option<GenericSpec>,
}

impl TransformerSpec {
    pub fn kv_heads(&self) -> u64 {
        self.kv_heads.unwrap_or(self.heads)
    }

    pub fn head_dim(&self) -> u64 {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }

    /// Width of the K (or V) projection output: kv_heads · head_dim.
    pub fn kv_width(&self) -> u64 {
        self.kv_heads() * self.head_dim()
    }

    /// Number of weight matrices of size hidden × ffn in the MLP.
    pub fn mlp_matrices(&self) -> u64 {
        if self.gated_mlp {
            3
        } else {
            2
        }
    }

    /// Parameters of one transformer layer: QKV, output projection, MLP (with biases as in
    /// GPT-2/Megatron) and two layer norms; for the Llama family (`gated_mlp`) no biases and
    /// two RMS norms.
    pub fn params_per_layer(&self) -> u64 {
        let h = self.hidden;
        let qkv_out = h + 2 * self.kv_width();
        if self.gated_mlp {
            // Queries `heads · head_dim` wide (`hidden` unless head_dim is set).
            let width = self.heads * self.head_dim();
            let qkv_out = width + 2 * self.kv_width();
            let qkv_bias = if self.qkv_bias { qkv_out } else { 0 };
            let qk_norms = if self.qk_norm { 2 * self.head_dim() } else { 0 };
            return h * qkv_out + qkv_bias + qk_norms + width * h + 3 * h * self.ffn_hidden + 2 * h;
        }
        let attention = h * qkv_out + qkv_out + h * h + h;
        let mlp_biases = if self.gated_mlp {
            2 * self.ffn_hidden + h
        } else {
            self.ffn_hidden + h
        };
        let mlp = self.mlp_matrices() * h * self.ffn_hidden + mlp_biases;
        let layer_norms = 4 * h;
        attention + mlp + layer_norms
    }

    /// Input embedding plus learned positions (none for the Llama family: rotary).
    pub fn embedding_params(&self) -> u64 {
        let positions = if self.gated_mlp { 0 } else { self.seq_len };
        (self.vocab + positions) * self.hidden
    }

    /// Output head (zero when tied to the input embedding) plus the final layer norm.
    pub fn head_params(&self) -> u64 {
        let head = if self.tied_embeddings {
            0
        } else {
            self.vocab * self.hidden
        };
        let final_norm = if self.gated_mlp { 1 } else { 2 } * self.hidden;
        head + final_norm
    }

    pub fn total_params(&self) -> u64 {
        self.layers * self.params_per_layer() + self.embedding_params() + self.head_params()
    }

    /// Forward FLOPs of one layer for one sequence, counting multiply-adds as 2 FLOPs:
    /// QKV, scores (QKᵀ), attention over V, projection, MLP. For GPT shapes this is
    /// 24·s·h² + 4·s²·h, the per-layer term of Narayanan et al. 2021, eq. (3).
    pub fn layer_forward_flops_per_sequence(&self) -> f64 {
        let s = self.seq_len as f64;
        let h = self.hidden as f64;
        let qkv = 2.0 * s * h * (h + 2.0 * self.kv_width() as f64);
        let attended = self.sliding_window.map_or(s, |w| s.min(w as f64));
        let scores_and_values = 2.0 * 2.0 * s * attended * h;
        let projection = 2.0 * s * h * h;
        let mlp = 2.0 * s * h * self.ffn_hidden as f64 * self.mlp_matrices() as f64;
        qkv + scores_and_values + projection + mlp
    }

    /// Forward FLOPs of the output logits for one sequence: 2·s·h·V.
    pub fn logits_forward_flops_per_sequence(&self) -> f64 {
        2.0 * self.seq_len as f64 * self.hidden as f64 * self.vocab as f64
    }
}

/// A TOML error as a [`PlanError::Parse`] that points at the right place. The toml crate
/// locates a missing field at the table that lacks it, which for the top-level keys is the
/// whole file, printed as "line 1"; name the table (and its header's line) instead.
pub(crate) fn toml_error(what: &str, text: &str, e: toml::de::Error) -> PlanError {
    let reason = match e.span() {
        Some(span) if e.message().starts_with("missing field") => {
            let start = span.start.min(text.len());
            let line = text[..start].matches('\n').count() + 1;
            let header = text[start..].lines().next().unwrap_or("").trim();
            // The top-level table's span also starts at byte 0, header or not.
            if header.starts_with('[') && start > 0 {
                format!("{} in the {header} table (line {line})", e.message())
            } else if header.starts_with('[') {
                format!("{} among the top-level keys or in {header}", e.message())
            } else {
                format!("{} among the top-level keys", e.message())
            }
        }
        _ => e.to_string(),
    };
    PlanError::Parse {
        what: what.into(),
        reason,
    }
}

impl ModelSpec {
    /// Parses the TOML form, or a `meshtrain train` config (its `[model]` table of kind "gpt"
    /// or "llama"), so that `plan --model configs/llama.toml` plans the network
    /// `train --config configs/llama.toml` builds.
    pub fn from_toml(text: &str) -> Result<Self> {
        if let Some(model) = Self::from_train_config(text)? {
            return Ok(model);
        }
        let file: ModelFile =
            toml::from_str(text).map_err(|e| toml_error("model TOML", text, e))?;
        let architecture = match (file.transformer, file.generic) {
            (Some(t), None) => Architecture::Transformer(t),
            (None, Some(g)) => Architecture::Generic(g),
            _ => {
                return Err(PlanError::InvalidModel {
                    model: file.name,
                    reason: "give exactly one of a [transformer] or a [generic] table".into(),
                })
            }
        };
        let model = ModelSpec {
            name: file.name,
            architecture,
        };
        model.validate()?;
        Ok(model)
    }

    /// The transformer a training config's `[model]` table describes; `None` when `text` is
    /// not a training config.
    fn from_train_config(text: &str) -> Result<Option<Self>> {
        let Ok(value) = text.parse::<toml::Table>() else {
            return Ok(None);
        };
        let Some(table) = value.get("model").and_then(|m| m.as_table()) else {
            return Ok(None);
        };
        let Some(kind) = table.get("kind").and_then(|k| k.as_str()) else {
            return Ok(None);
        };
        let bad = |reason: String| PlanError::InvalidModel {
            model: kind.to_string(),
            reason,
        };
        let int = |key: &str| -> Result<u64> {
            table
                .get(key)
                .and_then(|v| v.as_integer())
                .and_then(|v| u64::try_from(v).ok())
                .ok_or_else(|| {
                    bad(format!(
                        "the training config's [model] has no whole number '{key}'"
                    ))
                })
        };
        let tied = table
            .get("tie_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let (dim, heads) = (int("dim")?, int("heads")?);
        let spec = match kind {
            "gpt" => TransformerSpec {
                layers: int("layers")?,
                hidden: dim,
                heads,
                kv_heads: None,
                ffn_hidden: 4 * dim,
                gated_mlp: false,
                vocab: int("vocab")?,
                seq_len: int("seq")?,
                tied_embeddings: tied,
                qkv_bias: false,
                head_dim: None,
                qk_norm: false,
                sliding_window: None,
            },
            "llama" => TransformerSpec {
                layers: int("layers")?,
                hidden: dim,
                heads,
                kv_heads: Some(int("kv_heads")?),
                ffn_hidden: int("ffn")?,
                gated_mlp: true,
                vocab: int("vocab")?,
                seq_len: int("seq")?,
                tied_embeddings: tied,
                qkv_bias: table
                    .get("qkv_bias")
                    .and_then(|v| v.as_bool())
                    .unwrap_or(false),
                head_dim: table
                    .get("head_dim")
                    .and_then(|v| v.as_integer())
                    .map(|v| v as u64),
                qk_norm: table
                    .get("qk_norm")
                    .and_then(|v| v.as_bool())
                    .unwrap_or(false),
                sliding_window: table
                    .get("sliding_window")
                    .and_then(|v| v.as_integer())
                    .map(|v| v as u64),
            },
            other => {
                return Err(bad(format!(
                    "a training config of model kind \"{other}\": the planner plans transformers \
                     (kind \"gpt\" or \"llama\") or a model file"
                )))
            }
        };
        let model = ModelSpec {
            name: format!("{kind} {}x{} (training config)", spec.layers, spec.hidden),
            architecture: Architecture::Transformer(spec),
        };
        model.validate()?;
        Ok(Some(model))
    }

    pub fn transformer(&self) -> Option<&TransformerSpec> {
        match &self.architecture {
            Architecture::Transformer(t) => Some(t),
            Architecture::Generic(_) => None,
        }
    }

    pub fn total_params(&self) -> u64 {
        match &self.architecture {
            Architecture::Transformer(t) => t.total_params(),
            Architecture::Generic(g) => g.params,
        }
    }

    /// Returns the same model with another sequence length (transformers only).
    pub fn with_seq_len(&self, seq_len: u64) -> Result<Self> {
        let mut model = self.clone();
        match &mut model.architecture {
            Architecture::Transformer(t) => t.seq_len = seq_len,
            Architecture::Generic(_) => {
                return Err(PlanError::InvalidModel {
                    model: self.name.clone(),
                    reason: "a sequence length only applies to transformer models".into(),
                })
            }
        }
        model.validate()?;
        Ok(model)
    }

    /// Checks every size for consistency, so later formulas never divide by zero.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| PlanError::InvalidModel {
            model: self.name.clone(),
            reason,
        };
        match &self.architecture {
            Architecture::Transformer(t) => {
                for (field, value) in [
                    ("layers", t.layers),
                    ("hidden", t.hidden),
                    ("heads", t.heads),
                    ("ffn_hidden", t.ffn_hidden),
                    ("vocab", t.vocab),
                    ("seq_len", t.seq_len),
                ] {
                    if value == 0 {
                        return Err(bad(format!("{field} must be positive")));
                    }
                }
                if t.hidden % t.heads != 0 {
                    return Err(bad(format!(
                        "hidden size {} is not divisible by the number of heads {}",
                        t.hidden, t.heads
                    )));
                }
                let kv = t.kv_heads();
                if kv == 0 || t.heads % kv != 0 {
                    return Err(bad(format!(
                        "heads {} must be a multiple of kv_heads {kv} (and kv_heads positive)",
                        t.heads
                    )));
                }
            }
            Architecture::Generic(g) => {
                if g.params == 0 {
                    return Err(bad("params must be positive".into()));
                }
                if !(g.flops_per_sample.is_finite() && g.flops_per_sample > 0.0) {
                    return Err(bad("flops_per_sample must be a positive number".into()));
                }
                if !(g.activation_bytes_per_sample.is_finite()
                    && g.activation_bytes_per_sample >= 0.0)
                {
                    return Err(bad("activation_bytes_per_sample must be >= 0".into()));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt_small() -> TransformerSpec {
        TransformerSpec {
            layers: 4,
            hidden: 256,
            heads: 4,
            kv_heads: None,
            ffn_hidden: 1024,
            gated_mlp: false,
            vocab: 256,
            seq_len: 128,
            tied_embeddings: false,
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        }
    }

    #[test]
    fn gpt_small_parameter_count_by_hand() {
        // Per layer: QKV 256·768 + 768, proj 256·256 + 256, fc1 256·1024 + 1024,
        // fc2 1024·256 + 256, two layer norms 4·256.
        let per_layer =
            256 * 768 + 768 + 256 * 256 + 256 + 256 * 1024 + 1024 + 1024 * 256 + 256 + 1024;
        assert_eq!(gpt_small().params_per_layer(), per_layer);
        // Embedding 256·256, positions 128·256, final LN 512, untied head 256·256.
        let total = 4 * per_layer + 256 * 256 + 128 * 256 + 512 + 256 * 256;
        assert_eq!(gpt_small().total_params(), total);
        assert_eq!(total, 3_323_392);
    }

    #[test]
    fn layer_flops_match_narayanan_per_layer_term() {
        // Narayanan et al. 2021: forward per layer = 24·s·h² (1 + s/(6h)) per sequence.
        let t = TransformerSpec {
            layers: 24,
            hidden: 2304,
            heads: 24,
            kv_heads: None,
            ffn_hidden: 4 * 2304,
            gated_mlp: false,
            vocab: 51200,
            seq_len: 2048,
            tied_embeddings: true,
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        };
        let (s, h) = (2048.0f64, 2304.0f64);
        let expected = 24.0 * s * h * h * (1.0 + s / (6.0 * h));
        let got = t.layer_forward_flops_per_sequence();
        assert!(
            (got - expected).abs() / expected < 1e-12,
            "{got} vs {expected}"
        );
        // A sliding window of 512 keys: the scores and weighted values over 512, not 2048.
        let windowed = TransformerSpec {
            sliding_window: Some(512),
            ..t.clone()
        };
        let saved = 4.0 * s * (s - 512.0) * h;
        let got = windowed.layer_forward_flops_per_sequence();
        assert!((got - (expected - saved)).abs() / expected < 1e-12);
        let wide = TransformerSpec {
            sliding_window: Some(4096),
            ..t
        };
        assert_eq!(wide.layer_forward_flops_per_sequence(), expected);
    }

    #[test]
    fn grouped_query_attention_shrinks_qkv() {
        let mut t = gpt_small();
        t.kv_heads = Some(2);
        // K and V each 256 → 128 wide.
        assert_eq!(t.kv_width(), 128);
        let mha = gpt_small().params_per_layer();
        assert_eq!(mha - t.params_per_layer(), 2 * (256 * 128 + 128));
    }

    #[test]
    fn rejects_heads_not_dividing_hidden() {
        let mut t = gpt_small();
        t.heads = 3;
        let m = ModelSpec {
            name: "bad".into(),
            architecture: Architecture::Transformer(t),
        };
        let err = m.validate().unwrap_err().to_string();
        assert!(
            err.contains("not divisible by the number of heads 3"),
            "{err}"
        );
    }

    #[test]
    fn rejects_zero_layers_and_both_tables() {
        let mut t = gpt_small();
        t.layers = 0;
        let m = ModelSpec {
            name: "bad".into(),
            architecture: Architecture::Transformer(t),
        };
        assert!(m
            .validate()
            .unwrap_err()
            .to_string()
            .contains("layers must be positive"));
        let both = "name='x'\n[transformer]\nlayers=1\nhidden=8\nheads=2\nffn_hidden=32\nvocab=10\nseq_len=4\n[generic]\nparams=1\nflops_per_sample=1.0\nactivation_bytes_per_sample=0.0\nkernels_per_step=1\n";
        assert!(ModelSpec::from_toml(both)
            .unwrap_err()
            .to_string()
            .contains("exactly one"));
    }

    #[test]
    fn a_missing_field_names_its_table_not_line_1() {
        let text = "name = 'x'\n\n[transformer]\nlayers = 2\nheads = 2\nffn_hidden = 32\nvocab = 10\nseq_len = 4\n";
        let err = ModelSpec::from_toml(text).unwrap_err().to_string();
        assert!(err.contains("missing field `hidden`"), "{err}");
        assert!(err.contains("[transformer] table (line 3)"), "{err}");
        assert!(!err.contains("line 1"), "{err}");
        let err = ModelSpec::from_toml(&text[12..]).unwrap_err().to_string();
        assert!(
            err.contains("missing field `hidden` among the top-level keys or in [transformer]"),
            "{err}"
        );
    }
}
