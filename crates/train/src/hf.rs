//! Hugging Face interop: a GPT or Llama as a `transformers` model directory
//! (`config.json` + `model.safetensors`), out ([`export`]) and in ([`load`], `--init-from DIR`).
//!
//! Why by architecture rather than by a table of names: the two layouts differ beyond names.
//! GPT-2's `Conv1D` stores its weights `[in, out]` (ours, like `nn.Linear`, `[out, in]`), and
//! our Llama fuses q/k/v in the grouped layout of [`meshtrain_tensor::rotary`] and gate/up in
//! one `[gate | up]` matrix where Hugging Face keeps `q_proj`, `k_proj`, `v_proj`,
//! `gate_proj` and `up_proj`. The rotation convention is Hugging Face's already (rotate half),
//! so no row permutation of q or k is needed.
//!
//! What a model is read from: the layers themselves ([`Architecture::of`]: the attention
//! core's heads, the rotary layer's key/value heads and θ, the RMS norm's ε, the shapes of
//! the embedding and MLP), so export needs no config and import can compare what the
//! directory says with the model it is loaded into: heads that differ with the same shapes
//! would load without complaint and compute another function.
//!
//! Weights stored in bf16 or f16 (most downloaded Llamas) are widened to f32; checkpoints
//! split over several files (`model.safetensors.index.json`) are read file by file.

use anyhow::{bail, ensure, Context, Result};
use meshtrain_nn::layers::{Linear, RmsNorm};
use meshtrain_nn::transformer::{AttentionCore, GptEmbedding, QkNorm, Rotary};
use meshtrain_nn::{Layer, Model, ParamStore};
use meshtrain_tensor::activation::Activation;
use meshtrain_tensor::rotary::RopeScaling;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Which `transformers` model class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `GPT2LMHeadModel`: learned positions, layer norms, GELU MLP, biases.
    Gpt2,
    /// `LlamaForCausalLM`: rotary positions, RMS norms, GQA, SwiGLU, no biases.
    Llama,
}

/// The f32 `x` as the decimal it was written as (its shortest round-trip form): 1e-5, not
/// the 9.999999747378752e-6 its f64 widening would put into a config.json.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// What a GPT or Llama is, as far as its function goes.
#[derive(Clone, Debug, PartialEq)]
pub struct Architecture {
    pub family: Family,
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// MLP inner width (GPT: 4·dim).
    pub ffn: usize,
    /// Positions the model was built for (GPT-2's position table; Llama's context).
    pub seq: usize,
    pub rope_theta: f64,
    /// Llama 3.1's rotary rescaling (`rope_type = "llama3"`), if the model has it.
    pub rope_scaling: Option<RopeScaling>,
    pub norm_eps: f64,
    pub tied: bool,
    /// GPT-2's MLP computes GELU's tanh approximation (`gelu_new`) rather than the exact one.
    pub gelu_tanh: bool,
    /// Mistral's sliding window (each position attends to at most this many, itself
    /// included): the same as full causal attention for a context no longer than it.
    pub sliding_window: Option<usize>,
    /// Biases on the q/k/v projections: Qwen2 (`model_type` "qwen2"), a Llama otherwise.
    pub qkv_bias: bool,
    /// Values per attention head when not `dim / heads` (Qwen3's `head_dim`).
    pub head_dim: Option<usize>,
    /// RMS norms of each query and key head: Qwen3 (`model_type` "qwen3").
    pub qk_norm: bool,
}

/// The first layer of type `T` in `model` that `wanted` accepts, depth first.
fn find_where<T: 'static>(model: &Model, wanted: impl Fn(&T) -> bool) -> Option<&T> {
    fn walk<'a, T: 'static>(layer: &'a dyn Layer, wanted: &dyn Fn(&T) -> bool) -> Option<&'a T> {
        if let Some(found) = layer.as_any().and_then(|a| a.downcast_ref::<T>()) {
            if wanted(found) {
                return Some(found);
            }
        }
        let children = layer.children()?;
        children
            .layers()
            .iter()
            .find_map(|(_, l)| walk::<T>(l.as_ref(), wanted))
    }
    model
        .blocks
        .iter()
        .find_map(|b| walk::<T>(b.layer.as_ref(), &wanted))
}

/// The first layer of type `T` in `model`, depth first.
fn find<T: 'static>(model: &Model) -> Option<&T> {
    find_where(model, |_: &T| true)
}

/// A Llama `config.json`'s rotary frequencies: transformers 5 writes them as
/// `rope_parameters` (`rope_theta`, `rope_type`, and the scaling's values beside them); older
/// files, and most downloaded ones, as a top-level `rope_theta` and `rope_scaling` (with
/// `rope_type`, or `type` in the oldest). Plain (`default`) and Llama 3.1's `llama3` are
/// read; any other scaling is refused by name rather than loaded wrong.
fn rope_of_config(v: &Value, file: &Path) -> Result<(f64, Option<RopeScaling>)> {
    let params = &v["rope_parameters"];
    let theta = params["rope_theta"]
        .as_f64()
        .or_else(|| v["rope_theta"].as_f64())
        .unwrap_or(10_000.0);
    let scaling = if params.is_object() {
        params
    } else {
        &v["rope_scaling"]
    };
    if scaling.is_null() {
        return Ok((theta, None));
    }
    let kind = scaling["rope_type"]
        .as_str()
        .or_else(|| scaling["type"].as_str())
        .unwrap_or("default");
    match kind {
        "default" => Ok((theta, None)),
        "llama3" => {
            let number = |key: &str| {
                scaling[key].as_f64().with_context(|| {
                    format!(
                        "{}: the llama3 rotary scaling has no '{key}'",
                        file.display()
                    )
                })
            };
            let s = RopeScaling {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_context: number("original_max_position_embeddings")? as usize,
            };
            if let Some(problem) = s.problem() {
                bail!("{}: {problem}", file.display());
            }
            Ok((theta, Some(s)))
        }
        other => bail!(
            "{}: rotary scaling \"{other}\"; meshtrain's Llama computes plain rotary positions \
             and Llama 3.1's \"llama3\" rescaling",
            file.display()
        ),
    }
}

impl Architecture {
    /// The architecture of a built-in GPT or Llama (`meshtrain_nn::models`), read from its
    /// layers; an error for any other model.
    pub fn of(model: &Model) -> Result<Architecture> {
        let not_lm = || {
            anyhow::anyhow!(
                "only the built-in GPT and Llama models convert to and from Hugging Face \
                 (this model has no token embedding and attention)"
            )
        };
        let embedding = find::<GptEmbedding>(model).ok_or_else(not_lm)?;
        let core = find::<AttentionCore>(model).ok_or_else(not_lm)?;
        let layers = (0..)
            .take_while(|i| model.blocks.iter().any(|b| b.name == format!("blocks.{i}")))
            .count();
        let shape = |name: &str| -> Result<Vec<usize>> {
            let i = model
                .param_index(name)
                .with_context(|| format!("the model has no tensor '{name}'"))?;
            Ok(model.params()[i].shape.clone())
        };
        let tied = model
            .param_index("head.weight")
            .is_some_and(|i| model.tied_primary(i).is_some());
        let (vocab, dim) = (embedding.vocab, embedding.dim);
        Ok(match find::<Rotary>(model) {
            Some(rotary) => Architecture {
                family: Family::Llama,
                vocab,
                dim,
                layers,
                heads: rotary.heads,
                kv_heads: rotary.kv_heads,
                ffn: shape("blocks.0.gate_up.weight")?[0] / 2,
                seq: embedding.max_seq,
                rope_theta: rotary.rope.theta,
                rope_scaling: rotary.rope.scaling,
                norm_eps: find::<RmsNorm>(model).map_or(1e-5, |n| decimal(n.eps)),
                tied,
                gelu_tanh: false,
                sliding_window: core.window,
                qkv_bias: model.param_index("blocks.0.qkv.bias").is_some(),
                head_dim: (rotary.head_dim * rotary.heads != dim).then_some(rotary.head_dim),
                qk_norm: find::<QkNorm>(model).is_some(),
            },
            None => Architecture {
                family: Family::Gpt2,
                vocab,
                dim,
                layers,
                heads: core.heads,
                kv_heads: core.heads,
                ffn: shape("blocks.0.fc1.weight")?[0],
                seq: embedding.max_seq,
                rope_theta: 0.0,
                rope_scaling: None,
                norm_eps: 1e-5,
                tied,
                gelu_tanh: find_where(model, |l: &Linear| l.activation.is_some())
                    .is_some_and(|l| l.activation == Some(Activation::GeluTanh)),
                sliding_window: None,
                qkv_bias: false,
                head_dim: None,
                qk_norm: false,
            },
        })
    }

    fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.dim / self.heads)
    }

    /// The `transformers` class this architecture exports as.
    pub fn transformers_class(&self) -> &'static str {
        match self.family {
            Family::Gpt2 => "GPT2LMHeadModel",
            Family::Llama => self.llama_class().0,
        }
    }

    /// The `transformers` class and model type of a Llama-block model.
    fn llama_class(&self) -> (&'static str, &'static str) {
        if self.qk_norm {
            ("Qwen3ForCausalLM", "qwen3")
        } else if self.qkv_bias {
            ("Qwen2ForCausalLM", "qwen2")
        } else if self.sliding_window.is_some() {
            ("MistralForCausalLM", "mistral")
        } else {
            ("LlamaForCausalLM", "llama")
        }
    }

    /// `config.json` for `transformers`.
    pub fn config_json(&self) -> Value {
        match self.family {
            Family::Gpt2 => json!({
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "vocab_size": self.vocab,
                "n_positions": self.seq,
                "n_ctx": self.seq,
                "n_embd": self.dim,
                "n_layer": self.layers,
                "n_head": self.heads,
                "n_inner": self.ffn,
                "activation_function": if self.gelu_tanh { "gelu_new" } else { "gelu" },
                "layer_norm_epsilon": self.norm_eps,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                "tie_word_embeddings": self.tied,
                "torch_dtype": "float32",
                "bos_token_id": 50256,
                "eos_token_id": 50256,
            }),
            Family::Llama => {
                let mut config = json!({
                    "architectures": [self.llama_class().0],
                    "model_type": self.llama_class().1,
                    "vocab_size": self.vocab,
                    "hidden_size": self.dim,
                    "intermediate_size": self.ffn,
                    "num_hidden_layers": self.layers,
                    "num_attention_heads": self.heads,
                    "num_key_value_heads": self.kv_heads,
                    "head_dim": self.head_dim(),
                    "max_position_embeddings": self.seq,
                    "rms_norm_eps": self.norm_eps,
                    "rope_theta": self.rope_theta,
                    "rope_scaling": self.rope_scaling.map(|s| json!({
                        "rope_type": "llama3",
                        "factor": s.factor,
                        "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor,
                        "original_max_position_embeddings": s.original_context,
                    })),
                    "hidden_act": "silu",
                    "attention_bias": false,
                    "mlp_bias": false,
                    "tie_word_embeddings": self.tied,
                    "torch_dtype": "float32",
                });
                if let Some(window) = self.sliding_window {
                    config["sliding_window"] = json!(window);
                }
                config
            }
        }
    }

    /// The architecture a `config.json` describes.
    pub fn from_config_json(v: &Value, file: &Path) -> Result<Architecture> {
        let int = |key: &str| -> Result<usize> {
            v[key]
                .as_u64()
                .map(|n| n as usize)
                .with_context(|| format!("{} has no integer '{key}'", file.display()))
        };
        let float = |key: &str, default: f64| v[key].as_f64().unwrap_or(default);
        let tied = v["tie_word_embeddings"].as_bool().unwrap_or(true);
        Ok(match v["model_type"].as_str().unwrap_or_default() {
            "gpt2" => {
                let dim = int("n_embd")?;
                let act = v["activation_function"].as_str().unwrap_or("gelu_new");
                let gelu_tanh = match act {
                    "gelu" => false,
                    "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => true,
                    other => bail!(
                        "{}: activation_function \"{other}\"; meshtrain's GPT computes the \
                         exact GELU (\"gelu\") or its tanh approximation (\"gelu_new\")",
                        file.display()
                    ),
                };
                Architecture {
                    family: Family::Gpt2,
                    vocab: int("vocab_size")?,
                    dim,
                    layers: int("n_layer")?,
                    heads: int("n_head")?,
                    kv_heads: int("n_head")?,
                    ffn: v["n_inner"].as_u64().map_or(4 * dim, |n| n as usize),
                    seq: int("n_positions")?,
                    rope_theta: 0.0,
                    rope_scaling: None,
                    norm_eps: float("layer_norm_epsilon", 1e-5),
                    tied,
                    gelu_tanh,
                    sliding_window: None,
                    qkv_bias: false,
                    head_dim: None,
                    qk_norm: false,
                }
            }
            // Mistral (and SmolLM, whose model_type is "llama") is the Llama block; Mistral's
            // sliding window, where it has one, is the model's `sliding_window`.
            // Qwen2 (and Qwen2.5) is the Llama block with biases on q, k and v.
            // Qwen3 is the Llama block with RMS norms on each query and key head and its own
            // head size (128, whatever the width).
            family @ ("llama" | "mistral" | "qwen2" | "qwen3") => {
                let heads = int("num_attention_heads")?;
                let dim = int("hidden_size")?;
                // Qwen3's configuration class defaults the head size to 128.
                let stated = v["head_dim"]
                    .as_u64()
                    .or((family == "qwen3").then_some(128));
                let head_dim = match stated {
                    Some(hd) if hd as usize * heads != dim => Some(hd as usize),
                    _ => None,
                };
                let act = v["hidden_act"].as_str().unwrap_or("silu");
                ensure!(
                    act == "silu",
                    "{}: hidden_act \"{act}\" (meshtrain's Llama has SwiGLU: \"silu\")",
                    file.display()
                );
                let (rope_theta, rope_scaling) = rope_of_config(v, file)?;
                for bias in ["attention_bias", "mlp_bias"] {
                    ensure!(
                        !v[bias].as_bool().unwrap_or(false),
                        "{}: {bias} = true, but meshtrain's Llama has no biases (but Qwen2's \
                         on q/k/v)",
                        file.display()
                    );
                }
                if family.starts_with("qwen") {
                    ensure!(
                        !v["use_sliding_window"].as_bool().unwrap_or(false),
                        "{}: use_sliding_window = true: Qwen's window (on the layers past \
                         max_window_layers) is not supported; Mistral's is",
                        file.display()
                    );
                }
                Architecture {
                    family: Family::Llama,
                    vocab: int("vocab_size")?,
                    dim,
                    layers: int("num_hidden_layers")?,
                    heads,
                    kv_heads: v["num_key_value_heads"]
                        .as_u64()
                        .map_or(heads, |n| n as usize),
                    ffn: int("intermediate_size")?,
                    seq: int("max_position_embeddings")?,
                    rope_theta,
                    rope_scaling,
                    norm_eps: float("rms_norm_eps", 1e-6),
                    tied,
                    gelu_tanh: false,
                    sliding_window: match family {
                        "mistral" => v["sliding_window"].as_u64().map(|w| w as usize),
                        _ => None,
                    },
                    qkv_bias: family == "qwen2",
                    head_dim,
                    qk_norm: family == "qwen3",
                }
            }
            other => bail!(
                "{}: model_type \"{other}\"; meshtrain reads \"gpt2\", \"llama\" (SmolLM too), \
                 \"mistral\", \"qwen2\" and \"qwen3\" models{}",
                file.display(),
                match other {
                    "mixtral" | "qwen2_moe" | "qwen3_moe" =>
                        " (mixture-of-experts layers are not \
                                                              supported)",
                    _ => "",
                }
            ),
        })
    }

    /// The `[model]` table of a meshtrain config that builds this architecture.
    pub fn model_toml(&self) -> String {
        match self.family {
            Family::Gpt2 => format!(
                "[model]\nkind = \"gpt\"\nvocab = {}\ndim = {}\nlayers = {}\nheads = {}\nseq = {}\ntie_embeddings = {}\ngelu = \"{}\"\n",
                self.vocab,
                self.dim,
                self.layers,
                self.heads,
                self.seq,
                self.tied,
                if self.gelu_tanh { "tanh" } else { "erf" }
            ),
            Family::Llama => format!(
                "[model]\nkind = \"llama\"\nvocab = {}\ndim = {}\nlayers = {}\nheads = {}\nkv_heads = {}\nffn = {}\nseq = {}\nrope_theta = {:?}\nnorm_eps = {:e}\ntie_embeddings = {}\n{}{}{}{}{}",
                self.vocab, self.dim, self.layers, self.heads, self.kv_heads, self.ffn, self.seq,
                self.rope_theta, self.norm_eps, self.tied,
                if self.qkv_bias { "qkv_bias = true\n" } else { "" },
                self.head_dim.map_or(String::new(), |hd| format!("head_dim = {hd}\n")),
                if self.qk_norm { "qk_norm = true\n" } else { "" },
                self.sliding_window.map_or(String::new(), |w| format!("sliding_window = {w}\n")),
                self.rope_scaling.map_or(String::new(), |s| format!(
                    "\n[model.rope_scaling]\nfactor = {:?}\nlow_freq_factor = {:?}\nhigh_freq_factor = {:?}\noriginal_max_position_embeddings = {}\n",
                    s.factor, s.low_freq_factor, s.high_freq_factor, s.original_context
                ))
            ),
        }
    }

    /// Why a model of architecture `self` cannot take the weights of `from`, or `None`.
    /// Fine-tuning may change the context (positions beyond a GPT's table are refused) and
    /// untie a tied head; everything else must agree.
    fn mismatch(&self, from: &Architecture) -> Option<String> {
        let mut diffs = Vec::new();
        let mut differ = |what: &str, ours: String, theirs: String| {
            if ours != theirs {
                diffs.push(format!("{what} {theirs} (the model: {ours})"));
            }
        };
        differ(
            "family",
            format!("{:?}", self.family),
            format!("{:?}", from.family),
        );
        for (what, ours, theirs) in [
            ("vocab", self.vocab, from.vocab),
            ("dim", self.dim, from.dim),
            ("layers", self.layers, from.layers),
            ("heads", self.heads, from.heads),
            ("kv_heads", self.kv_heads, from.kv_heads),
            ("head size", self.head_dim(), from.head_dim()),
            ("ffn", self.ffn, from.ffn),
        ] {
            differ(what, ours.to_string(), theirs.to_string());
        }
        if self.family == Family::Llama {
            differ(
                "rope_theta",
                format!("{:?}", self.rope_theta),
                format!("{:?}", from.rope_theta),
            );
            differ(
                "rope_scaling",
                format!("{:?}", self.rope_scaling),
                format!("{:?}", from.rope_scaling),
            );
        }
        if (self.norm_eps - from.norm_eps).abs() > 1e-3 * from.norm_eps {
            diffs.push(format!(
                "norm eps {:e} (the model: {:e})",
                from.norm_eps, self.norm_eps
            ));
        }
        if self.family == Family::Gpt2 && self.seq > from.seq {
            diffs.push(format!(
                "positions {} (the model's context {} needs more)",
                from.seq, self.seq
            ));
        }
        if self.qk_norm != from.qk_norm {
            diffs.push(format!(
                "{} q/k norms (the model: {})",
                if from.qk_norm { "with" } else { "without" },
                if self.qk_norm { "with" } else { "without" }
            ));
        }
        if self.qkv_bias != from.qkv_bias {
            diffs.push(format!(
                "{} q/k/v biases (the model: {})",
                if from.qkv_bias { "with" } else { "without" },
                if self.qkv_bias { "with" } else { "without" }
            ));
        }
        // A window no shorter than the context trained is full causal attention there.
        let binding = |w: Option<usize>| w.filter(|&w| w < self.seq);
        if binding(self.sliding_window) != binding(from.sliding_window) {
            let window = |w: Option<usize>| match w {
                Some(w) => format!("a sliding window of {w} positions"),
                None => "no sliding window".into(),
            };
            diffs.push(format!(
                "{} (the model: {} over its {} positions; model.sliding_window sets it)",
                window(from.sliding_window),
                window(self.sliding_window),
                self.seq
            ));
        }
        if self.gelu_tanh != from.gelu_tanh {
            let name = |tanh: bool| if tanh { "tanh" } else { "erf" };
            diffs.push(format!(
                "GELU {} (the model: {})",
                name(from.gelu_tanh),
                name(self.gelu_tanh)
            ));
        }
        if self.tied && !from.tied {
            diffs.push("an untied head (the model ties its head to the embedding)".into());
        }
        (!diffs.is_empty()).then(|| diffs.join(", "))
    }
}

/// `[rows, cols]` → `[cols, rows]`.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// Where a Hugging Face tensor's values sit in ours.
enum Place {
    /// The same values, in the same order.
    Whole,
    /// Its `[in, out]` (GPT-2's `Conv1D`) is our `[out, in]`.
    Transposed,
    /// Runs of its rows (`width` values each) among ours: (its first row, our first row,
    /// rows). Splits of a fused tensor (q/k/v, gate/up), and a GPT's position table cut to
    /// the model's context.
    Rows {
        width: usize,
        runs: Vec<(usize, usize, usize)>,
    },
}

/// One Hugging Face tensor (name, shape) and where it goes in ours (name, place). One table
/// of these serves export, import and the pre-run check, so the three cannot disagree.
struct Piece {
    hf: String,
    shape: Vec<usize>,
    ours: String,
    place: Place,
}

fn piece(hf: String, shape: &[usize], ours: String, place: Place) -> Piece {
    Piece {
        hf,
        shape: shape.to_vec(),
        ours,
        place,
    }
}

/// The tensors of a `transformers` model of architecture `arch` and where each goes in a
/// meshtrain model whose context is `seq` (a GPT takes the first `seq` rows of the position
/// table). A tied head's `head.weight` comes from the embedding: the same Hugging Face
/// tensor appears twice, and only an untied one has `lm_head.weight`.
fn pieces(arch: &Architecture, seq: usize) -> Vec<Piece> {
    let (d, f, v) = (arch.dim, arch.ffn, arch.vocab);
    let mut out = Vec::new();
    let embedding = match arch.family {
        Family::Gpt2 => "transformer.wte.weight",
        Family::Llama => "model.embed_tokens.weight",
    };
    out.push(piece(
        embedding.into(),
        &[v, d],
        "tok.weight".into(),
        Place::Whole,
    ));
    match arch.family {
        Family::Gpt2 => {
            let positions = Place::Rows {
                width: d,
                runs: vec![(0, 0, seq)],
            };
            out.push(piece(
                "transformer.wpe.weight".into(),
                &[arch.seq, d],
                "pos.weight".into(),
                positions,
            ));
            for i in 0..arch.layers {
                let (b, h) = (format!("blocks.{i}"), format!("transformer.h.{i}"));
                for (o, t) in [("ln1", "ln_1"), ("ln2", "ln_2")] {
                    for p in ["weight", "bias"] {
                        let (theirs, ours) = (format!("{h}.{t}.{p}"), format!("{b}.{o}.{p}"));
                        out.push(piece(theirs, &[d], ours, Place::Whole));
                    }
                }
                for (o, t, inputs, outputs) in [
                    ("qkv", "attn.c_attn", d, 3 * d),
                    ("proj", "attn.c_proj", d, d),
                    ("fc1", "mlp.c_fc", d, f),
                    ("fc2", "mlp.c_proj", f, d),
                ] {
                    let (theirs, ours) = (format!("{h}.{t}"), format!("{b}.{o}"));
                    out.push(piece(
                        format!("{theirs}.weight"),
                        &[inputs, outputs],
                        format!("{ours}.weight"),
                        Place::Transposed,
                    ));
                    out.push(piece(
                        format!("{theirs}.bias"),
                        &[outputs],
                        format!("{ours}.bias"),
                        Place::Whole,
                    ));
                }
            }
            for p in ["weight", "bias"] {
                out.push(piece(
                    format!("transformer.ln_f.{p}"),
                    &[d],
                    format!("ln_f.{p}"),
                    Place::Whole,
                ));
            }
        }
        Family::Llama => {
            let (hd, g) = (arch.head_dim(), arch.heads / arch.kv_heads);
            // The grouped q/k/v rows (see `meshtrain_tensor::rotary`): for key/value group
            // `j`, its query heads, then key head `j`, then value head `j`.
            let group_row = |j: usize| j * (g + 2) * hd;
            let q_runs: Vec<_> = (0..arch.heads)
                .map(|head| (head * hd, group_row(head / g) + (head % g) * hd, hd))
                .collect();
            let kv_runs = |offset: usize| -> Vec<(usize, usize, usize)> {
                (0..arch.kv_heads)
                    .map(|j| (j * hd, group_row(j) + offset * hd, hd))
                    .collect()
            };
            for i in 0..arch.layers {
                let (b, h) = (format!("blocks.{i}"), format!("model.layers.{i}"));
                let qkv = format!("{b}.qkv.weight");
                for (t, rows, runs) in [
                    ("q_proj", arch.heads, q_runs.clone()),
                    ("k_proj", arch.kv_heads, kv_runs(g)),
                    ("v_proj", arch.kv_heads, kv_runs(g + 1)),
                ] {
                    out.push(piece(
                        format!("{h}.self_attn.{t}.weight"),
                        &[rows * hd, d],
                        qkv.clone(),
                        Place::Rows {
                            width: d,
                            runs: runs.clone(),
                        },
                    ));
                    if arch.qkv_bias {
                        // The bias rows in the weight's grouped order.
                        out.push(piece(
                            format!("{h}.self_attn.{t}.bias"),
                            &[rows * hd],
                            format!("{b}.qkv.bias"),
                            Place::Rows { width: 1, runs },
                        ));
                    }
                }
                let gate_up = format!("{b}.gate_up.weight");
                for (t, first) in [("gate_proj", 0), ("up_proj", f)] {
                    out.push(piece(
                        format!("{h}.mlp.{t}.weight"),
                        &[f, d],
                        gate_up.clone(),
                        Place::Rows {
                            width: d,
                            runs: vec![(0, first, f)],
                        },
                    ));
                }
                let mut whole = vec![
                    ("input_layernorm", "attn_norm", vec![d]),
                    ("post_attention_layernorm", "mlp_norm", vec![d]),
                    ("self_attn.o_proj", "proj", vec![d, arch.heads * hd]),
                    ("mlp.down_proj", "down", vec![d, f]),
                ];
                if arch.qk_norm {
                    whole.push(("self_attn.q_norm", "q_norm", vec![hd]));
                    whole.push(("self_attn.k_norm", "k_norm", vec![hd]));
                }
                for (t, o, shape) in whole {
                    out.push(piece(
                        format!("{h}.{t}.weight"),
                        &shape,
                        format!("{b}.{o}.weight"),
                        Place::Whole,
                    ));
                }
            }
            out.push(piece(
                "model.norm.weight".into(),
                &[d],
                "norm.weight".into(),
                Place::Whole,
            ));
        }
    }
    let head = if arch.tied {
        embedding
    } else {
        "lm_head.weight"
    };
    out.push(piece(
        head.into(),
        &[v, d],
        "head.weight".into(),
        Place::Whole,
    ));
    out
}

impl Piece {
    /// This tensor in Hugging Face's layout, taken from our tensor `ours`.
    fn take(&self, ours: &[f32]) -> Vec<f32> {
        match &self.place {
            Place::Whole => ours.to_vec(),
            Place::Transposed => transpose(ours, self.shape[1], self.shape[0]),
            Place::Rows { width, runs } => {
                let mut out = vec![0.0; self.shape.iter().product()];
                for &(theirs, mine, rows) in runs {
                    out[theirs * width..][..rows * width]
                        .copy_from_slice(&ours[mine * width..][..rows * width]);
                }
                out
            }
        }
    }

    /// Puts this tensor's values `theirs` (Hugging Face's layout) into our tensor `ours`.
    fn put(&self, theirs: &[f32], ours: &mut [f32]) -> Result<()> {
        let fits = match &self.place {
            Place::Whole | Place::Transposed => theirs.len() == ours.len(),
            Place::Rows { width, runs } => runs.iter().all(|&(t, m, rows)| {
                (t + rows) * width <= theirs.len() && (m + rows) * width <= ours.len()
            }),
        };
        ensure!(
            fits,
            "'{}' ({} values) does not fit '{}' ({} values)",
            self.hf,
            theirs.len(),
            self.ours,
            ours.len()
        );
        match &self.place {
            Place::Whole => ours.copy_from_slice(theirs),
            Place::Transposed => {
                ours.copy_from_slice(&transpose(theirs, self.shape[0], self.shape[1]))
            }
            Place::Rows { width, runs } => {
                for &(t, m, rows) in runs {
                    ours[m * width..][..rows * width]
                        .copy_from_slice(&theirs[t * width..][..rows * width]);
                }
            }
        }
        Ok(())
    }
}

/// Writes `model` with parameters `values` (the whole model's flat store) as a `transformers`
/// directory: `config.json` and `model.safetensors` (f32, metadata `format = pt`, which
/// `transformers` requires).
pub fn export(model: &Model, values: &[f32], dir: &Path) -> Result<Architecture> {
    let arch = Architecture::of(model)?;
    if let Some(window) = arch.sliding_window.filter(|&w| w < arch.seq) {
        ensure!(
            !arch.qkv_bias && !arch.qk_norm,
            "a sliding window of {window} positions with {}: no transformers class is this \
             model (Mistral's has neither, and Qwen's window spares its first layers), so it \
             would load as another; export it without the window (model.sliding_window) or \
             without the {}",
            if arch.qk_norm {
                "q/k norms (Qwen3's)"
            } else {
                "q/k/v biases (Qwen2's)"
            },
            if arch.qk_norm { "norms" } else { "biases" }
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for p in pieces(&arch, arch.seq) {
        // A tied head's piece repeats the embedding's tensor: written once.
        if tensors.iter().all(|(name, ..)| *name != p.hf) {
            let (_, ours) = model
                .stored_param(values, &p.ours)
                .with_context(|| format!("the model has no tensor '{}'", p.ours))?;
            let values = p.take(ours);
            tensors.push((p.hf.clone(), p.shape.clone(), values));
        }
    }
    let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, shape, values)| {
            (
                name.as_str(),
                crate::checkpoint::view(values, shape.clone()),
            )
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let weights = dir.join("model.safetensors");
    crate::checkpoint::replace_atomically(&weights, |tmp| {
        safetensors::serialize_to_file(views, &Some(metadata), tmp)
            .with_context(|| format!("writing {}", tmp.display()))
    })?;
    let config = serde_json::to_string_pretty(&arch.config_json())?;
    std::fs::write(dir.join("config.json"), config + "\n")
        .with_context(|| format!("writing {}", dir.join("config.json").display()))?;
    Ok(arch)
}

/// Whether `path` is a Hugging Face model directory (it holds a `config.json`).
pub fn is_model_dir(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").is_file()
}

/// The weight files of a model directory, by tensor name.
fn weight_files(dir: &Path) -> Result<HashMap<String, PathBuf>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", index.display()))?;
        let map = v["weight_map"]
            .as_object()
            .with_context(|| format!("{} has no weight_map", index.display()))?;
        return Ok(map
            .iter()
            .filter_map(|(k, f)| Some((k.clone(), dir.join(f.as_str()?))))
            .collect());
    }
    if !single.is_file() {
        let torch = dir.join("pytorch_model.bin");
        bail!(
            "{} holds no model.safetensors{}",
            dir.display(),
            if torch.is_file() {
                " (only pytorch_model.bin, a pickle meshtrain does not read: convert it with \
                 transformers, `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, \
                 safe_serialization=True)`)"
            } else {
                ""
            }
        );
    }
    let header = crate::checkpoint::read_safetensors_header(&single, "weights")?;
    Ok(header
        .entries
        .keys()
        .filter(|k| *k != "__metadata__")
        .map(|k| (k.clone(), single.clone()))
        .collect())
}

/// Reads tensors from memory-mapped safetensors files, widening bf16/f16 to f32.
struct Reader {
    files: HashMap<String, PathBuf>,
    mapped: HashMap<PathBuf, memmap2::Mmap>,
}

impl Reader {
    fn read(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let file = self
            .files
            .get(name)
            .with_context(|| format!("the weights have no tensor '{name}'"))?
            .clone();
        if !self.mapped.contains_key(&file) {
            let f = std::fs::File::open(&file)
                .with_context(|| format!("cannot open {}", file.display()))?;
            // SAFETY: the file is only read; a concurrent writer could change what we read,
            // which would be caught as a corrupt tensor at worst, never memory unsafety in Rust
            // code that copies the bytes out at once.
            let map = unsafe { memmap2::Mmap::map(&f) }
                .with_context(|| format!("cannot map {}", file.display()))?;
            self.mapped.insert(file.clone(), map);
        }
        let st = SafeTensors::deserialize(&self.mapped[&file])
            .with_context(|| format!("{} is corrupt or not a safetensors file", file.display()))?;
        let t = st
            .tensor(name)
            .with_context(|| format!("{} has no tensor '{name}'", file.display()))?;
        ensure!(
            t.shape() == shape,
            "{}: tensor '{name}' has shape {:?}, the architecture in config.json needs {shape:?}",
            file.display(),
            t.shape()
        );
        let bytes = t.data();
        let values: Vec<f32> = match t.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => bail!(
                "{}: tensor '{name}' is {other:?}; meshtrain reads F32, BF16 and F16",
                file.display()
            ),
        };
        if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
            bail!(
                "{}: tensor '{name}' holds a non-finite value at element {bad}",
                file.display()
            );
        }
        Ok(values)
    }
}

/// The architecture of a model directory, checked against `model`'s: the error names what
/// differs and the `[model]` table that would match. Returns it with the tensors it holds
/// and where they go in `model`.
fn matching_pieces(dir: &Path, model: &Model) -> Result<(Architecture, Vec<Piece>)> {
    let config_file = dir.join("config.json");
    let text = std::fs::read_to_string(&config_file)
        .with_context(|| format!("cannot read {}", config_file.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", config_file.display()))?;
    let theirs = Architecture::from_config_json(&v, &config_file)?;
    let ours = Architecture::of(model)?;
    if let Some(diff) = ours.mismatch(&theirs) {
        bail!(
            "{} holds a different model: {diff}. A config whose model matches it:\n{}",
            dir.display(),
            theirs.model_toml()
        );
    }
    let pieces = pieces(&theirs, ours.seq);
    Ok((theirs, pieces))
}

/// Checks, without reading any weights, that the directory describes `model` and holds every
/// tensor it needs with the right shape (for the one-line check before a run starts).
pub fn check(dir: &Path, model: &Model) -> Result<()> {
    let (_, pieces) = matching_pieces(dir, model)?;
    let files = weight_files(dir)?;
    let mut headers: HashMap<PathBuf, HashMap<String, Value>> = HashMap::new();
    for p in &pieces {
        let Some(file) = files.get(&p.hf) else {
            bail!("{} lacks the tensor '{}'", dir.display(), p.hf);
        };
        if !headers.contains_key(file) {
            let h = crate::checkpoint::read_safetensors_header(file, "weights")?;
            headers.insert(file.clone(), h.entries);
        }
        let entry = headers[file]
            .get(&p.hf)
            .with_context(|| format!("{} has no tensor '{}'", file.display(), p.hf))?;
        let got: Vec<usize> = entry["shape"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|n| n.as_u64().map(|n| n as usize))
                    .collect()
            })
            .unwrap_or_default();
        ensure!(
            got == p.shape,
            "{}: tensor '{}' has shape {got:?}, config.json's architecture needs {:?}",
            file.display(),
            p.hf,
            p.shape
        );
    }
    Ok(())
}

/// Loads a model directory's weights into `store` (the whole model's), converted to our
/// names and layouts. Returns a description of what was loaded.
pub fn load(dir: &Path, model: &Model, store: &mut ParamStore) -> Result<String> {
    let (arch, pieces) = matching_pieces(dir, model)?;
    let mut reader = Reader {
        files: weight_files(dir)?,
        mapped: HashMap::new(),
    };
    let mut filled = vec![false; model.params().len()];
    for p in &pieces {
        let i = model
            .param_index(&p.ours)
            .with_context(|| format!("'{}' maps to '{}', which the model lacks", p.hf, p.ours))?;
        let theirs = reader.read(&p.hf, &p.shape)?;
        p.put(&theirs, &mut store.values[model.params()[i].range.clone()])?;
        filled[i] = true;
    }
    for (i, entry) in model.params().iter().enumerate() {
        // A tied copy holds its primary's values.
        let primary = model.tied_primary(i).unwrap_or(i);
        ensure!(
            filled[primary],
            "no Hugging Face tensor maps to '{}'",
            model.params()[primary].name
        );
        if primary != i {
            let from = store.values[model.params()[primary].range.clone()].to_vec();
            store.values[entry.range.clone()].copy_from_slice(&from);
        }
    }
    Ok(format!(
        "Hugging Face {} ({})",
        match arch.family {
            Family::Gpt2 => "GPT-2",
            Family::Llama => "Llama",
        },
        dir.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshtrain_nn::models::{gpt, llama, GptConfig, LlamaConfig};

    fn tiny_llama(tied: bool) -> Model {
        llama::llama(&LlamaConfig {
            vocab: 40,
            dim: 24,
            layers: 2,
            heads: 6,
            kv_heads: 2,
            ffn: 20,
            seq: 8,
            rope_theta: 500.0,
            rope_scaling: None,
            norm_eps: 1e-6,
            tie_embeddings: tied,
            attention: Default::default(),
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        })
    }

    fn tiny_gpt() -> Model {
        gpt::gpt(&GptConfig {
            vocab: 30,
            dim: 16,
            layers: 2,
            heads: 4,
            seq: 8,
            tie_embeddings: false,
            attention: Default::default(),
            gelu: Default::default(),
        })
    }

    fn random_store(model: &Model, seed: u64) -> ParamStore {
        ParamStore {
            values: meshtrain_tensor::rng::normal_values(model.num_params(), seed),
            grads: Vec::new(),
            buffers: vec![0.0; model.num_buffers()],
        }
    }

    /// Tied copies take their primary's values, as a model's store keeps them.
    fn sync_tied(model: &Model, values: &mut [f32]) {
        for (i, entry) in model.params().iter().enumerate() {
            if let Some(p) = model.tied_primary(i) {
                let from = values[model.params()[p].range.clone()].to_vec();
                values[entry.range.clone()].copy_from_slice(&from);
            }
        }
    }

    /// Export then import gives back every parameter bit for bit, and the files are what
    /// transformers expects: its tensor names and shapes, and the config's sizes.
    #[test]
    fn round_trips_exactly() {
        for (name, model) in [
            ("gpt", tiny_gpt()),
            ("llama", tiny_llama(false)),
            ("llama tied", tiny_llama(true)),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let mut store = random_store(&model, 5);
            sync_tied(&model, &mut store.values);
            let arch = export(&model, &store.values, dir.path()).unwrap();
            check(dir.path(), &model).unwrap();
            let mut back = random_store(&model, 6);
            load(dir.path(), &model, &mut back).unwrap();
            assert!(back.values == store.values, "{name}: values changed");
            let header = crate::checkpoint::read_safetensors_header(
                &dir.path().join("model.safetensors"),
                "w",
            )
            .unwrap();
            let names: Vec<&String> = header.entries.keys().collect();
            match arch.family {
                Family::Llama => {
                    let q = &header.entries["model.layers.1.self_attn.q_proj.weight"]["shape"];
                    assert_eq!(q, &json!([24, 24]), "{name}");
                    let k = &header.entries["model.layers.1.self_attn.k_proj.weight"]["shape"];
                    assert_eq!(k, &json!([8, 24]), "{name}");
                    assert_eq!(
                        names.iter().any(|n| *n == "lm_head.weight"),
                        !arch.tied,
                        "{name}"
                    );
                }
                Family::Gpt2 => {
                    let fc = &header.entries["transformer.h.0.mlp.c_fc.weight"]["shape"];
                    assert_eq!(fc, &json!([16, 64]), "{name}: Conv1D is [in, out]");
                }
            }
        }
    }

    /// The q/k/v split undoes the grouped layout: q head h of the fused weight is rows
    /// h·hd.. of q_proj, whatever group it sits in.
    #[test]
    fn grouped_qkv_splits_by_head() {
        let model = tiny_llama(false);
        let mut store = random_store(&model, 1);
        let i = model.param_index("blocks.0.qkv.weight").unwrap();
        let range = model.params()[i].range.clone();
        // Row r of the fused weight holds the value r everywhere.
        for (r, row) in store.values[range].chunks_mut(24).enumerate() {
            row.fill(r as f32);
        }
        let dir = tempfile::tempdir().unwrap();
        export(&model, &store.values, dir.path()).unwrap();
        let mut reader = Reader {
            files: weight_files(dir.path()).unwrap(),
            mapped: HashMap::new(),
        };
        let q = reader
            .read("model.layers.0.self_attn.q_proj.weight", &[24, 24])
            .unwrap();
        let k = reader
            .read("model.layers.0.self_attn.k_proj.weight", &[8, 24])
            .unwrap();
        // hd = 4, 3 query heads per group, group width 5 heads = 20 rows.
        assert_eq!(q[4 * 24], 4.0, "q head 1 from group 0");
        assert_eq!(q[12 * 24], 20.0, "q head 3 opens group 1");
        assert_eq!(k[0], 12.0, "k head 0 after group 0's 3 query heads");
        assert_eq!(k[4 * 24], 32.0, "k head 1 after group 1's query heads");
    }

    #[test]
    fn a_different_model_is_named_with_the_config_that_would_match() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_llama(false);
        export(&model, &random_store(&model, 2).values, dir.path()).unwrap();
        let other = llama::llama(&LlamaConfig {
            vocab: 40,
            dim: 24,
            layers: 2,
            heads: 6,
            kv_heads: 3,
            ffn: 20,
            seq: 8,
            rope_theta: 500.0,
            rope_scaling: None,
            norm_eps: 1e-6,
            tie_embeddings: false,
            attention: Default::default(),
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        });
        let err = format!("{:#}", check(dir.path(), &other).unwrap_err());
        assert!(err.contains("kv_heads 2 (the model: 3)"), "{err}");
        assert!(err.contains("kv_heads = 2"), "{err}");
        let err = format!("{:#}", check(dir.path(), &tiny_gpt()).unwrap_err());
        assert!(err.contains("family Llama (the model: Gpt2)"), "{err}");
    }

    /// A `config.json`'s rotary frequencies in both of transformers' forms (5.x's
    /// `rope_parameters`; the top-level `rope_theta` and `rope_scaling` of older files and
    /// most downloads, `type` in the oldest); another scaling refused by name.
    #[test]
    fn rotary_frequencies_are_read_in_either_form() {
        let file = Path::new("config.json");
        let llama3 = Some(RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        });
        let v5 = json!({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}});
        assert_eq!(rope_of_config(&v5, file).unwrap(), (500000.0, llama3));
        let legacy = json!({"rope_theta": 500000.0, "rope_scaling": {"type": "llama3",
            "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}});
        assert_eq!(rope_of_config(&legacy, file).unwrap(), (500000.0, llama3));
        let plain = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}});
        assert_eq!(rope_of_config(&plain, file).unwrap(), (1e6, None));
        assert_eq!(rope_of_config(&json!({}), file).unwrap(), (10_000.0, None));
        let yarn = json!({"rope_theta": 1e4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}});
        let e = rope_of_config(&yarn, file).unwrap_err().to_string();
        assert!(e.contains("\"yarn\"") && e.contains("llama3"), "{e}");
        let missing = json!({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}});
        let e = rope_of_config(&missing, file).unwrap_err().to_string();
        assert!(e.contains("'factor'"), "{e}");
    }
}
