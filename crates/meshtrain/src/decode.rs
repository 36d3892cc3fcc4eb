//! Incremental decoding of a GPT or a Llama with a key/value cache: what `meshtrain generate`
//! and the training log's samples run.
//!
//! Why a decoder beside [`Model::forward`]: a causal model's hidden states at a position
//! depend only on the tokens up to it, so the keys and values every layer computed for
//! earlier positions never change while text grows. Keeping them makes a new token cost one
//! row through every layer plus its attention over the cache — `O(params + t·dim)` — where a
//! forward over the window costs `O(t · params + t²·dim)`. The layers' training forward has
//! no such state (it takes whole sequences), hence this separate, forward-only path: the
//! same kernels (`gemm`, layer/RMS norm, rotary tables and expansion, GELU, SwiGLU) over the
//! same flat parameters, looked up by tensor name, so its logits equal the model's.
//!
//! Llama's cache keeps the `H_kv` key/value heads (keys already rotated), not the `H` heads
//! the attention kernels' `[Q | K | V]` row repeats them into: grouped-query attention's
//! memory saving is the cache's.
//!
//! The model runs on the host (`HostModel`) or on a GPU (`cuda`: the same pieces with the
//! weights, the cache and the activations in device memory, in f32); [`Decoder`] keeps what
//! does not depend on where (the tokens cached, the checks, the window past the context), so
//! both give `meshtrain generate` the same `prefill`/`step`.

use crate::config::ModelConfig;
use anyhow::{bail, ensure, Result};
use meshtrain_nn::Model;
use meshtrain_tensor::activation::{swiglu_forward, Activation};
use meshtrain_tensor::matmul::{gemm, Mat, MatMut};
use meshtrain_tensor::norm::{layer_norm_forward, rms_norm_forward};
use meshtrain_tensor::rotary::{rotary_expand_forward, rotary_tables, Rope, RotaryShape};
use meshtrain_tensor::Device;
use rayon::prelude::*;

#[cfg(feature = "cuda")]
mod cuda;

/// Below this many multiply-adds attention runs its rows on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 18;

/// The epsilon of GPT's layer norms (`LayerNorm::new`, PyTorch's default).
const LAYER_NORM_EPS: f32 = 1e-5;

/// A GPT or Llama that decodes one token at a time, keeping every layer's keys and values of
/// the positions so far, on the host or a GPU. [`Decoder::prefill`] starts a text,
/// [`Decoder::step`] adds a token; both return the logits of the next token.
pub struct Decoder {
    vocab: usize,
    /// The model's context: positions run `0..seq`.
    seq: usize,
    /// The tokens whose keys and values the cache holds: token `i` is at position `i`.
    tokens: Vec<u32>,
    model: Box<dyn Layers>,
}

/// Where a decoder's model runs: its weights and cache, and the pass of new tokens through
/// every layer.
trait Layers: Send {
    /// Runs `tokens` (checked: in the vocabulary, fitting the context after `start`) through
    /// every layer at positions `start..`, writing their keys and values into the cache at
    /// those positions; the logits of the last row, or of every row when `all`.
    fn extend(&mut self, tokens: &[u32], start: usize, all: bool) -> Result<Vec<f32>>;

    /// Drops the cached positions from `len` on (the host frees them; a device's cache keeps
    /// its room).
    fn truncate(&mut self, len: usize);

    /// The f32 values the cache holds for `positions` positions.
    fn cache_len(&self, positions: usize) -> usize;

    /// Where it runs: "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)".
    fn device(&self) -> String;
}

/// The model on the host: the layers' tensors as the model's flat parameters hold them.
struct HostModel {
    dim: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// `tok.weight`, `[vocab, dim]`.
    tok: Vec<f32>,
    positions: Positions,
    layers: Vec<Layer>,
    final_norm: Norm,
    head: Linear,
}

enum Positions {
    /// GPT: `pos.weight`, `[seq, dim]`, added to the token rows.
    Learned(Vec<f32>),
    /// Llama: q and k rotated by their position (rotary base θ).
    Rotary { rope: Rope },
}

enum Norm {
    Layer { weight: Vec<f32>, bias: Vec<f32> },
    Rms { weight: Vec<f32>, eps: f32 },
}

impl Norm {
    fn apply(&self, x: &[f32], d: usize) -> Vec<f32> {
        match self {
            Norm::Layer { weight, bias } => {
                layer_norm_forward(x, d, weight, bias, LAYER_NORM_EPS).0
            }
            Norm::Rms { weight, eps } => rms_norm_forward(x, d, weight, *eps).0,
        }
    }
}

/// `y = act(x·Wᵀ + b)`, `W` `[outputs, inputs]` as the model's `Linear` stores it.
struct Linear {
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    inputs: usize,
    outputs: usize,
    activation: Option<Activation>,
}

impl Linear {
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        let rows = x.len() / self.inputs;
        let mut y = vec![0.0f32; rows * self.outputs];
        gemm(
            MatMut::new(&mut y, rows, self.outputs),
            Mat::new(x, rows, self.inputs),
            Mat::new(&self.weight, self.outputs, self.inputs).t(),
            false,
        );
        if let Some(b) = &self.bias {
            for row in y.chunks_mut(self.outputs) {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
        match self.activation {
            Some(act) => {
                let mut out = vec![0.0f32; y.len()];
                act.forward(&y, &mut out);
                out
            }
            None => y,
        }
    }
}

enum Mlp {
    /// GPT: `fc2(gelu(fc1(x)))` (the GELU fused into `fc1`).
    Gelu { fc1: Linear, fc2: Linear },
    /// Llama: `down(silu(gate) · up)`, `gate_up` = `[gate | up]`.
    SwiGlu {
        gate_up: Linear,
        down: Linear,
        ffn: usize,
    },
}

struct Layer {
    attn_norm: Norm,
    qkv: Linear,
    proj: Linear,
    mlp_norm: Norm,
    mlp: Mlp,
    /// `[position, kv_heads · head_dim]` each.
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// The flat parameters, looked up by name with the shape the config implies.
struct Lookup<'a> {
    model: &'a Model,
    values: &'a [f32],
    kind: &'static str,
}

impl Lookup<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        // A tied copy (the head tied to the token embedding) reads its primary: copies are
        // kept equal to it, but the primary is the one a checkpoint stores.
        let Some((entry, values)) = self.model.stored_param(self.values, name) else {
            bail!(
                "the parameters hold no tensor '{name}', which a {} of this config needs",
                self.kind
            );
        };
        ensure!(
            entry.shape == shape,
            "tensor '{name}' is {:?}, but a {} of this config needs {shape:?} (a model split \
             over workers? the decoder takes the whole model)",
            entry.shape,
            self.kind
        );
        Ok(values.to_vec())
    }

    fn linear(
        &self,
        name: &str,
        inputs: usize,
        outputs: usize,
        bias: bool,
        activation: Option<Activation>,
    ) -> Result<Linear> {
        Ok(Linear {
            weight: self.get(&format!("{name}.weight"), &[outputs, inputs])?,
            bias: if bias {
                Some(self.get(&format!("{name}.bias"), &[outputs])?)
            } else {
                None
            },
            inputs,
            outputs,
            activation,
        })
    }

    fn layer_norm(&self, name: &str, dim: usize) -> Result<Norm> {
        Ok(Norm::Layer {
            weight: self.get(&format!("{name}.weight"), &[dim])?,
            bias: self.get(&format!("{name}.bias"), &[dim])?,
        })
    }

    fn rms_norm(&self, name: &str, dim: usize, eps: f32) -> Result<Norm> {
        Ok(Norm::Rms {
            weight: self.get(&format!("{name}.weight"), &[dim])?,
            eps,
        })
    }
}

/// Opens `device` (nothing for the CPU): a GPU that cannot be used fails here, naming what is
/// missing, so a command can say so before reading a checkpoint.
pub fn open_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => cuda::open(ordinal).map(|_| ()),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => bail!(
            "--device {device}: this meshtrain was built without the CUDA backend (the `cuda` \
             feature); rebuild with default features, or generate with --device cpu"
        ),
    }
}

impl Decoder {
    /// The decoder of `config`'s model with the parameters `values`, laid out as `model`
    /// (the whole model `config` builds) lays them out, on the host; the tensors are copied,
    /// so `values` may go. Fails, naming the tensor, if one is missing or of another shape.
    pub fn new(config: &ModelConfig, model: &Model, values: &[f32]) -> Result<Decoder> {
        Self::on(Device::Cpu, config, model, values)
    }

    /// [`Decoder::new`] on `device`: on a GPU the weights, the cache (sized for the whole
    /// context) and every activation live in its memory, the logits come back to the host.
    /// Fails before any work when the GPU cannot be used (which library is missing), or when
    /// this build has no CUDA backend.
    pub fn on(
        device: Device,
        config: &ModelConfig,
        model: &Model,
        values: &[f32],
    ) -> Result<Decoder> {
        let Some(lm) = config.language() else {
            bail!("the decoder takes a language model (GPT or Llama), not an image model");
        };
        let layers: Box<dyn Layers> = match device {
            Device::Cpu => Box::new(HostModel::new(config, model, values)?),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                // The GPU first: without one, say so before copying any weights.
                let dev = cuda::open(ordinal)?;
                let host = HostModel::new(config, model, values)?;
                Box::new(cuda::CudaModel::upload(&host, lm.seq, dev)?)
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                open_device(device)?;
                unreachable!("open_device refuses a GPU without the CUDA backend")
            }
        };
        Ok(Decoder {
            vocab: lm.vocab,
            seq: lm.seq,
            tokens: Vec::new(),
            model: layers,
        })
    }

    /// Where the model runs: "cpu", or the GPU ("cuda:0 (its name)").
    pub fn device(&self) -> String {
        self.model.device()
    }
}

impl HostModel {
    fn new(config: &ModelConfig, model: &Model, values: &[f32]) -> Result<HostModel> {
        ensure!(
            values.len() == model.num_params(),
            "{} parameter values for a model of {}",
            values.len(),
            model.num_params()
        );
        match config {
            ModelConfig::Gpt(g) => {
                let p = Lookup {
                    model,
                    values,
                    kind: "GPT",
                };
                let d = g.dim;
                let layers = (0..g.layers)
                    .map(|i| {
                        let b = format!("blocks.{i}");
                        let act = Some(g.gelu.activation());
                        Ok(Layer {
                            attn_norm: p.layer_norm(&format!("{b}.ln1"), d)?,
                            qkv: p.linear(&format!("{b}.qkv"), d, 3 * d, true, None)?,
                            proj: p.linear(&format!("{b}.proj"), d, d, true, None)?,
                            mlp_norm: p.layer_norm(&format!("{b}.ln2"), d)?,
                            mlp: Mlp::Gelu {
                                fc1: p.linear(&format!("{b}.fc1"), d, 4 * d, true, act)?,
                                fc2: p.linear(&format!("{b}.fc2"), 4 * d, d, true, None)?,
                            },
                            keys: Vec::new(),
                            values: Vec::new(),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(HostModel {
                    dim: d,
                    heads: g.heads,
                    kv_heads: g.heads,
                    head_dim: d / g.heads,
                    tok: p.get("tok.weight", &[g.vocab, d])?,
                    positions: Positions::Learned(p.get("pos.weight", &[g.seq, d])?),
                    layers,
                    final_norm: p.layer_norm("ln_f", d)?,
                    head: p.linear("head", d, g.vocab, false, None)?,
                })
            }
            ModelConfig::Llama(l) => {
                let p = Lookup {
                    model,
                    values,
                    kind: "Llama",
                };
                let (d, hd) = (l.dim, l.head_dim());
                let layers = (0..l.layers)
                    .map(|i| {
                        let b = format!("blocks.{i}");
                        let qkv_rows = (l.heads + 2 * l.kv_heads) * hd;
                        Ok(Layer {
                            attn_norm: p.rms_norm(&format!("{b}.attn_norm"), d, l.norm_eps)?,
                            qkv: p.linear(&format!("{b}.qkv"), d, qkv_rows, false, None)?,
                            proj: p.linear(&format!("{b}.proj"), d, d, false, None)?,
                            mlp_norm: p.rms_norm(&format!("{b}.mlp_norm"), d, l.norm_eps)?,
                            mlp: Mlp::SwiGlu {
                                gate_up: p.linear(
                                    &format!("{b}.gate_up"),
                                    d,
                                    2 * l.ffn,
                                    false,
                                    None,
                                )?,
                                down: p.linear(&format!("{b}.down"), l.ffn, d, false, None)?,
                                ffn: l.ffn,
                            },
                            keys: Vec::new(),
                            values: Vec::new(),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(HostModel {
                    dim: d,
                    heads: l.heads,
                    kv_heads: l.kv_heads,
                    head_dim: hd,
                    tok: p.get("tok.weight", &[l.vocab, d])?,
                    positions: Positions::Rotary { rope: l.rope() },
                    layers,
                    final_norm: p.rms_norm("norm", d, l.norm_eps)?,
                    head: p.linear("head", d, l.vocab, false, None)?,
                })
            }
            _ => bail!("the decoder takes a language model (GPT or Llama), not an image model"),
        }
    }
}

impl Decoder {
    /// The vocabulary: every logits row has this many values.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The model's context (positions `0..seq`).
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// The tokens the cache holds, oldest first (the context of the next token).
    pub fn context(&self) -> &[u32] {
        &self.tokens
    }

    /// The f32 values the cache holds: every layer's keys and values of every position,
    /// `2 · layers · kv_heads · head_dim` per position.
    pub fn cache_len(&self) -> usize {
        self.model.cache_len(self.tokens.len())
    }

    /// Starts a text: the cache is emptied and filled with `tokens` (at most the model's
    /// context) at positions `0..`; returns the logits of the token after the last.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_prefill(tokens)?;
        self.extend(tokens, false)
    }

    /// [`Decoder::prefill`] returning the logits after every token, `[tokens.len(), vocab]`
    /// (what a forward over `tokens` gives; for checking the decoder against one).
    pub fn prefill_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_prefill(tokens)?;
        self.extend(tokens, true)
    }

    /// Adds `token` after the cached ones and returns the logits of the token after it.
    ///
    /// When the cache already holds the model's whole context (`seq` tokens), the text goes
    /// on in a window of its last tokens, as the model's forward must see it (that forward
    /// over the window takes the last `seq` at every token): the decoder re-prefills from
    /// the last `seq/2` tokens (this one included), which are then the context until the
    /// window fills again. Why not slide by one: dropping the
    /// oldest token changes the hidden states of every later position (they attended to it),
    /// so no cached key or value stays valid, and GPT's learned positions (< `seq`) must
    /// restart at 0; recomputing half a window every `seq/2` tokens costs about one extra
    /// token's forward per token, where recomputing the whole window at every token would
    /// cost `seq`. The same for Llama, whose rotary positions could run on, so that both
    /// models see the same contexts.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        self.check_tokens(&[token])?;
        if self.tokens.len() >= self.seq {
            let keep = (self.seq / 2).max(1);
            let mut window = self.tokens[self.tokens.len() + 1 - keep..].to_vec();
            window.push(token);
            return self.prefill(&window);
        }
        self.extend(&[token], false)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            bail!(
                "token {t} is outside the model's vocabulary of {}",
                self.vocab
            );
        }
        Ok(())
    }

    fn check_prefill(&mut self, tokens: &[u32]) -> Result<()> {
        ensure!(!tokens.is_empty(), "nothing to prefill: no tokens");
        ensure!(
            tokens.len() <= self.seq,
            "{} tokens to prefill, but the model's context is {}: give the last {}",
            tokens.len(),
            self.seq,
            self.seq
        );
        self.check_tokens(tokens)?;
        self.tokens.clear();
        self.model.truncate(0);
        Ok(())
    }

    /// Runs `tokens` (checked: in the vocabulary, fitting the context) through the model at
    /// the positions after the cached ones; the logits of the last row, or of every row when
    /// `all`. A failure (a device's) leaves an empty cache: the next text starts afresh.
    fn extend(&mut self, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        let start = self.tokens.len();
        debug_assert!(start + tokens.len() <= self.seq);
        match self.model.extend(tokens, start, all) {
            Ok(logits) => {
                self.tokens.extend_from_slice(tokens);
                Ok(logits)
            }
            Err(e) => {
                self.tokens.clear();
                self.model.truncate(0);
                Err(e)
            }
        }
    }
}

impl Layers for HostModel {
    fn truncate(&mut self, len: usize) {
        let kv = len * self.kv_heads * self.head_dim;
        for layer in &mut self.layers {
            layer.keys.truncate(kv);
            layer.values.truncate(kv);
        }
    }

    fn cache_len(&self, _positions: usize) -> usize {
        self.layers
            .iter()
            .map(|l| l.keys.len() + l.values.len())
            .sum()
    }

    fn device(&self) -> String {
        Device::Cpu.to_string()
    }

    fn extend(&mut self, tokens: &[u32], start: usize, all: bool) -> Result<Vec<f32>> {
        let (d, t) = (self.dim, tokens.len());
        // Positions from `start` on are this text's: the cache's earlier contents past it go.
        self.truncate(start);
        let mut x = vec![0.0f32; t * d];
        for (i, (row, &id)) in x.chunks_mut(d).zip(tokens).enumerate() {
            row.copy_from_slice(&self.tok[id as usize * d..][..d]);
            if let Positions::Learned(pos) = &self.positions {
                let pe = &pos[(start + i) * d..][..d];
                row.iter_mut().zip(pe).for_each(|(v, p)| *v += p);
            }
        }
        let rotary = match self.positions {
            Positions::Rotary { rope } => {
                let positions: Vec<usize> = (start..start + t).collect();
                Some(rotary_tables(&positions, self.head_dim, &rope))
            }
            Positions::Learned(_) => None,
        };
        let shape = Shape {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        };
        for layer in &mut self.layers {
            let h = layer.attn_norm.apply(&x, d);
            let qkv = layer.qkv.apply(&h);
            // [Q | K | V] rows of `heads` heads each.
            let qkv = match &rotary {
                None => {
                    for row in qkv.chunks(3 * d) {
                        layer.keys.extend_from_slice(&row[d..2 * d]);
                        layer.values.extend_from_slice(&row[2 * d..]);
                    }
                    qkv
                }
                Some((cos, sin)) => {
                    let rs = RotaryShape {
                        batch: 1,
                        seq: t,
                        heads: self.heads,
                        kv_heads: self.kv_heads,
                        head_dim: self.head_dim,
                    };
                    // The model's own rotation and expansion (same bits); the cache keeps
                    // the first copy of each key/value head.
                    let expanded = rotary_expand_forward(rs, &qkv, cos, sin);
                    let (hd, g) = (self.head_dim, self.heads / self.kv_heads);
                    for row in expanded.chunks(3 * d) {
                        for j in 0..self.kv_heads {
                            layer.keys.extend_from_slice(&row[d + j * g * hd..][..hd]);
                            layer
                                .values
                                .extend_from_slice(&row[2 * d + j * g * hd..][..hd]);
                        }
                    }
                    expanded
                }
            };
            let out = attend(shape, &qkv, &layer.keys, &layer.values, start);
            let y = layer.proj.apply(&out);
            x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
            let h = layer.mlp_norm.apply(&x, d);
            let y = match &layer.mlp {
                Mlp::Gelu { fc1, fc2 } => fc2.apply(&fc1.apply(&h)),
                Mlp::SwiGlu { gate_up, down, ffn } => {
                    down.apply(&swiglu_forward(&gate_up.apply(&h), *ffn))
                }
            };
            x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        }
        let rows = if all { &x[..] } else { &x[(t - 1) * d..] };
        let h = self.final_norm.apply(rows, d);
        Ok(self.head.apply(&h))
    }
}

#[derive(Clone, Copy)]
struct Shape {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Causal attention of the new rows' queries over the cache: row `i` (position
/// `start + i`) meets the keys of positions `0..=start + i`. `qkv` holds the rows' `[Q | K |
/// V]` (the queries are the first `heads · head_dim` values of each row); `keys`/`values`
/// `[positions, kv_heads · head_dim]`, query head `h` reading key/value head
/// `h / (heads / kv_heads)`. Softmax with the maximum subtracted, the weighted sums in f64.
/// A long prefill's rows in parallel (they are independent).
fn attend(s: Shape, qkv: &[f32], keys: &[f32], values: &[f32], start: usize) -> Vec<f32> {
    let (hd, h) = (s.head_dim, s.heads);
    let (d, kv_width, group) = (h * hd, s.kv_heads * hd, h / s.kv_heads);
    let stride = 3 * d;
    let rows = qkv.len() / stride;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; rows * d];
    let row = |(i, out_row): (usize, &mut [f32])| {
        let len = start + i + 1;
        let mut scores = vec![0.0f32; len];
        let mut acc = vec![0.0f64; hd];
        for head in 0..h {
            let qh = &qkv[i * stride + head * hd..][..hd];
            let kv = (head / group) * hd;
            let mut max = f32::NEG_INFINITY;
            for (j, s) in scores.iter_mut().enumerate() {
                let k = &keys[j * kv_width + kv..][..hd];
                *s = qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                max = max.max(*s);
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            let mut total = 0.0f64;
            for (j, &s) in scores.iter().enumerate() {
                let w = f64::from((s - max).exp());
                total += w;
                let v = &values[j * kv_width + kv..][..hd];
                acc.iter_mut()
                    .zip(v)
                    .for_each(|(a, &v)| *a += w * f64::from(v));
            }
            let o = &mut out_row[head * hd..][..hd];
            o.iter_mut()
                .zip(&acc)
                .for_each(|(o, a)| *o = (a / total) as f32);
        }
    };
    // A step's one row, or a short prefill: less work than a task hand-out costs.
    if rows * (start + rows) * d < PARALLEL_MIN_MACS {
        out.chunks_mut(d).enumerate().for_each(row);
    } else {
        out.par_chunks_mut(d).enumerate().for_each(row);
    }
    out
}
