//! The decoder's model on a GPU: the host model's pieces (`HostModel`) uploaded once, the
//! key/value cache allocated for the whole context, and every token's pass through the layers
//! run by the training kernels' forward operations (`cuda::ops`: embedding, layer and RMS
//! norm, cuBLASLt products in exact f32 — no TF32 —, GELU, rotary, SwiGLU, residual adds)
//! plus the decoding kernels (`cuda::decode`: the new keys and values into the cache, the new
//! rows' attention over it). Only the logits come back to the host, where the same sampling
//! as on the CPU draws the next token.

use super::{HostModel, Layers, Linear, Mlp, Norm, Positions, LAYER_NORM_EPS};
use anyhow::{ensure, Context, Result};
use meshtrain_tensor::cuda::decode::{self as kv, DecodeShape};
use meshtrain_tensor::cuda::ops::{self, ActKind, LinearShape};
use meshtrain_tensor::cuda::{CudaDevice, CudaTensor, DeviceParams, F32Math};
use meshtrain_tensor::rotary::{rotary_tables, Rope, RotaryShape};
use meshtrain_tensor::DType;
use std::sync::Arc;

/// GPU `ordinal`, its libraries checked first: without a driver (or NVRTC, cuBLASLt, the
/// CUDA headers) the error names what is missing, before any weight is copied.
pub(super) fn open(ordinal: usize) -> Result<Arc<CudaDevice>> {
    CudaDevice::get(ordinal).with_context(|| {
        format!("generating on cuda:{ordinal} (without a GPU, generate with --device cpu)")
    })
}

/// Values in device memory, f32; a layer's parameters in the order the operations read them
/// (a linear layer's weight then bias, a layer norm's γ then β).
struct Params {
    buf: CudaTensor,
    /// How many of the buffer's values are these parameters (a head tied to the token
    /// embedding reads the first `vocab · dim` of the embedding's buffer).
    len: usize,
}

impl Params {
    fn upload(dev: &Arc<CudaDevice>, parts: &[&[f32]], what: &str) -> Result<Params> {
        let len = parts.iter().map(|p| p.len()).sum();
        let buf = CudaTensor::alloc(dev, len, DType::F32, what)?;
        let mut at = buf.ptr();
        for part in parts {
            dev.upload_to(at, part)?;
            at += std::mem::size_of_val(*part) as u64;
        }
        Ok(Params { buf, len })
    }

    fn view(&self) -> DeviceParams<'_> {
        // SAFETY: the buffer holds at least `len` f32 values and lives as long as `self`,
        // which the view borrows.
        unsafe { DeviceParams::new(self.buf.device(), self.buf.ptr(), None, self.len) }
    }
}

struct DevLinear {
    params: Params,
    shape: LinearShape,
    bias: bool,
    activation: Option<ActKind>,
}

impl DevLinear {
    fn upload(dev: &Arc<CudaDevice>, l: &Linear, what: &str) -> Result<DevLinear> {
        let mut parts = vec![&l.weight[..]];
        parts.extend(l.bias.as_deref());
        Ok(DevLinear {
            params: Params::upload(dev, &parts, what)?,
            shape: LinearShape {
                rows: 0,
                inputs: l.inputs,
                outputs: l.outputs,
            },
            bias: l.bias.is_some(),
            activation: l.activation.map(ActKind::from),
        })
    }

    /// `act(x·Wᵀ + b)` of `x`'s rows.
    fn apply(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let shape = LinearShape {
            rows: x.len() / self.shape.inputs,
            ..self.shape
        };
        let y = ops::linear_forward(
            x,
            self.params.view(),
            shape,
            self.bias,
            DType::F32,
            F32Math::Exact,
        )?;
        Ok(match self.activation {
            Some(act) => ops::activation_forward(&y, act)?,
            None => y,
        })
    }
}

enum DevNorm {
    Layer(Params),
    Rms(Params, f32),
}

impl DevNorm {
    fn upload(dev: &Arc<CudaDevice>, n: &Norm) -> Result<DevNorm> {
        Ok(match n {
            Norm::Layer { weight, bias } => {
                DevNorm::Layer(Params::upload(dev, &[weight, bias], "a layer norm")?)
            }
            Norm::Rms { weight, eps } => {
                DevNorm::Rms(Params::upload(dev, &[weight], "an RMS norm")?, *eps)
            }
        })
    }

    fn apply(&self, x: &CudaTensor, d: usize) -> Result<CudaTensor> {
        Ok(match self {
            DevNorm::Layer(p) => {
                ops::layer_norm_forward(x, p.view(), d, LAYER_NORM_EPS, DType::F32, false)?.0
            }
            DevNorm::Rms(p, eps) => {
                ops::rms_norm_forward(x, p.view(), d, *eps, DType::F32, false)?.0
            }
        })
    }
}

enum DevMlp {
    Gelu {
        fc1: DevLinear,
        fc2: DevLinear,
    },
    SwiGlu {
        gate_up: DevLinear,
        down: DevLinear,
        ffn: usize,
    },
}

struct DevLayer {
    attn_norm: DevNorm,
    qkv: DevLinear,
    proj: DevLinear,
    mlp_norm: DevNorm,
    mlp: DevMlp,
    /// `[seq, kv_heads · head_dim]` each: room for the whole context.
    keys: CudaTensor,
    values: CudaTensor,
}

pub(super) struct CudaModel {
    dev: Arc<CudaDevice>,
    vocab: usize,
    dim: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// `[tok.weight | pos.weight]` (GPT) or `tok.weight` (Llama), as the embedding reads it.
    embedding: Params,
    /// Llama's rotary frequencies; GPT's positions are the embedding's table.
    rope: Option<Rope>,
    layers: Vec<DevLayer>,
    final_norm: DevNorm,
    head: DevLinear,
}

impl CudaModel {
    /// `host`'s weights on `dev`, with a cache for `seq` positions. A head tied to the token
    /// embedding (equal values) reads the embedding's buffer. Runs one token through the model
    /// before returning, so the kernels are compiled and loaded (and a kernel that fails
    /// fails here), not during the first timed token.
    pub(super) fn upload(host: &HostModel, seq: usize, dev: Arc<CudaDevice>) -> Result<Self> {
        let (d, hd) = (host.dim, host.head_dim);
        ensure!(
            seq <= kv::max_positions(hd),
            "a context of {seq} positions at head size {hd}: the GPU decoder's attention takes \
             at most {} (generate with --device cpu)",
            kv::max_positions(hd)
        );
        let (embedding, rope) = match &host.positions {
            Positions::Learned(pos) => (
                Params::upload(&dev, &[&host.tok, pos], "the embedding tables")?,
                None,
            ),
            Positions::Rotary { rope } => (
                Params::upload(&dev, &[&host.tok], "the token embedding")?,
                Some(*rope),
            ),
        };
        let head = if host.head.weight == host.tok && host.head.bias.is_none() {
            DevLinear {
                params: Params {
                    buf: embedding.buf.clone(),
                    len: host.tok.len(),
                },
                shape: LinearShape {
                    rows: 0,
                    inputs: d,
                    outputs: host.head.outputs,
                },
                bias: false,
                activation: None,
            }
        } else {
            DevLinear::upload(&dev, &host.head, "the output head")?
        };
        let cache = seq * host.kv_heads * hd;
        let layers = (host.layers.iter())
            .map(|l| {
                Ok(DevLayer {
                    attn_norm: DevNorm::upload(&dev, &l.attn_norm)?,
                    qkv: DevLinear::upload(&dev, &l.qkv, "a q/k/v projection")?,
                    proj: DevLinear::upload(&dev, &l.proj, "an attention projection")?,
                    mlp_norm: DevNorm::upload(&dev, &l.mlp_norm)?,
                    mlp: match &l.mlp {
                        Mlp::Gelu { fc1, fc2 } => DevMlp::Gelu {
                            fc1: DevLinear::upload(&dev, fc1, "an MLP's first layer")?,
                            fc2: DevLinear::upload(&dev, fc2, "an MLP's second layer")?,
                        },
                        Mlp::SwiGlu { gate_up, down, ffn } => DevMlp::SwiGlu {
                            gate_up: DevLinear::upload(&dev, gate_up, "a gate/up projection")?,
                            down: DevLinear::upload(&dev, down, "a down projection")?,
                            ffn: *ffn,
                        },
                    },
                    keys: CudaTensor::zeros(&dev, cache, DType::F32, "the key cache")?,
                    values: CudaTensor::zeros(&dev, cache, DType::F32, "the value cache")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut model = CudaModel {
            vocab: host.head.outputs,
            dim: d,
            heads: host.heads,
            kv_heads: host.kv_heads,
            head_dim: hd,
            embedding,
            rope,
            layers,
            final_norm: DevNorm::upload(&dev, &host.final_norm)?,
            head,
            dev,
        };
        model
            .extend(&[0], 0, false)
            .context("a first token through the model on the GPU")?;
        Ok(model)
    }

    fn forward(&self, tokens: &[u32], start: usize, all: bool) -> Result<Vec<f32>> {
        let (dev, d, t) = (&self.dev, self.dim, tokens.len());
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let positions: Vec<usize> = (start..start + t).collect();
        let pos_of: Option<Vec<i32>> = match self.rope {
            None => Some(positions.iter().map(|&p| p as i32).collect()),
            Some(_) => None,
        };
        let mut x = ops::embedding_forward(
            dev,
            &ids,
            self.embedding.view(),
            self.vocab,
            d,
            pos_of.as_deref(),
        )?;
        // The host's tables of these positions (the CPU decoder's bits), as the rotary pass
        // of training takes them.
        let rotary = match &self.rope {
            Some(rope) => {
                let (cos, sin) = rotary_tables(&positions, self.head_dim, rope);
                Some((
                    CudaTensor::from_host(dev, &cos, DType::F32)?,
                    CudaTensor::from_host(dev, &sin, DType::F32)?,
                ))
            }
            None => None,
        };
        let shape = DecodeShape {
            rows: t,
            start,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        };
        for layer in &self.layers {
            let h = layer.attn_norm.apply(&x, d)?;
            let qkv = layer.qkv.apply(&h)?;
            // [Q | K | V] rows of `heads` heads each: Llama's rotated, its key/value heads
            // repeated for their groups.
            let qkv = match &rotary {
                Some((cos, sin)) => {
                    let rs = RotaryShape {
                        batch: 1,
                        seq: t,
                        heads: self.heads,
                        kv_heads: self.kv_heads,
                        head_dim: self.head_dim,
                    };
                    ops::rotary_forward(&qkv, rs, cos, sin)?
                }
                None => qkv,
            };
            kv::append_kv(&qkv, &layer.keys, &layer.values, shape)?;
            let out = kv::attention(&qkv, &layer.keys, &layer.values, shape)?;
            x = ops::add(x, &layer.proj.apply(&out)?)?;
            let h = layer.mlp_norm.apply(&x, d)?;
            let y = match &layer.mlp {
                DevMlp::Gelu { fc1, fc2 } => fc2.apply(&fc1.apply(&h)?)?,
                DevMlp::SwiGlu { gate_up, down, ffn } => {
                    down.apply(&ops::swiglu_forward(&gate_up.apply(&h)?, *ffn)?)?
                }
            };
            x = ops::add(x, &y)?;
        }
        let rows = if all || t == 1 {
            x
        } else {
            let last = CudaTensor::alloc(dev, d, DType::F32, "the last row")?;
            dev.copy(last.ptr(), x.ptr() + ((t - 1) * d * 4) as u64, d * 4)?;
            last
        };
        let h = self.final_norm.apply(&rows, d)?;
        Ok(self.head.apply(&h)?.to_host_f32()?)
    }
}

impl Layers for CudaModel {
    fn extend(&mut self, tokens: &[u32], start: usize, all: bool) -> Result<Vec<f32>> {
        self.forward(tokens, start, all)
            .with_context(|| format!("decoding on {}", self.device()))
    }

    /// The cache's room stays allocated: later positions are written before they are read.
    fn truncate(&mut self, _len: usize) {}

    fn cache_len(&self, positions: usize) -> usize {
        positions * self.layers.len() * 2 * self.kv_heads * self.head_dim
    }

    fn device(&self) -> String {
        format!("cuda:{} ({})", self.dev.ordinal(), self.dev.name())
    }
}
