//! GPT layers: token + position embedding, causal self-attention, the pre-LN block.

use crate::layer::{Init, Layer, Mode, ParamSpec, Params, ParamsMut, Saved};
use crate::layers::{Children, LayerNorm, Linear, Seq};
use meshtrain_tensor::activation::Activation;
use meshtrain_tensor::attention::{
    causal_attention_backward, causal_attention_forward, AttentionShape,
};
use meshtrain_tensor::flash::{flash_attention_backward, flash_attention_forward};
use meshtrain_tensor::{DType, Device, Tensor};

/// Which tokens of every sequence a worker holds. Under context parallelism the sequence is
/// cut into `2·parts` equal chunks and worker `index` holds chunks `index` and
/// `2·parts − 1 − index`, in that order: under a causal mask the early chunks attend to few
/// keys and the late ones to many, so pairing them gives every worker the same attention
/// work (Megatron-LM's and ring attention's load balancing). `parts = 1`: the whole sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequenceShard {
    pub parts: usize,
    pub index: usize,
}

impl Default for SequenceShard {
    fn default() -> Self {
        SequenceShard { parts: 1, index: 0 }
    }
}

impl SequenceShard {
    /// The two chunks this worker holds (their indices among the `2·parts`).
    pub fn chunks(&self) -> [usize; 2] {
        [self.index, 2 * self.parts - 1 - self.index]
    }

    /// The position in the whole sequence of token `i` of the `local` tokens held.
    pub fn position(&self, i: usize, local: usize) -> usize {
        if self.parts == 1 {
            return i;
        }
        let chunk = local / 2;
        self.chunks()[i / chunk] * chunk + i % chunk
    }

    /// Where row `k` of the `[B·local, ·]` rows this worker holds sits in the whole
    /// `[B·local·parts, ·]` batch (sample by sample, each in sequence order).
    pub fn whole_row(&self, k: usize, local: usize) -> usize {
        let (sample, i) = (k / local, k % local);
        sample * local * self.parts + self.position(i, local)
    }
}

/// Token + learned position embedding. Input: token ids `[B, T]` carried as exact f32 values
/// (under context parallelism `[B, T/cp]`: this worker's tokens, placed by `sequence`).
pub struct GptEmbedding {
    pub vocab: usize,
    pub max_seq: usize,
    pub dim: usize,
    pub init_std: f32,
    /// Which tokens of each sequence the input holds (their positions).
    pub sequence: SequenceShard,
}

impl Layer for GptEmbedding {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn params(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec::new(
                "tok.weight",
                &[self.vocab, self.dim],
                Init::Normal(self.init_std),
            ),
            ParamSpec::new(
                "pos.weight",
                &[self.max_seq, self.dim],
                Init::Normal(self.init_std),
            ),
        ]
    }

    fn runs_on(&self, _: Device) -> bool {
        true
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        ids: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let (b, t, d) = (ids.dim(0), ids.dim(1), self.dim);
        assert!(
            t * self.sequence.parts <= self.max_seq,
            "sequence {} longer than the model's {}",
            t * self.sequence.parts,
            self.max_seq
        );
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::embedding_forward(self, p, ids, mode, s);
        }
        let p = p.host();
        let (tok, pos) = p.split_at(self.vocab * d);
        let mut y = vec![0.0f32; b * t * d];
        for (i, (row, &id)) in y.chunks_mut(d).zip(ids.data()).enumerate() {
            let id = id as usize;
            assert!(
                id < self.vocab,
                "token id {id} outside vocabulary of {}",
                self.vocab
            );
            let at = self.sequence.position(i % t, t);
            let (te, pe) = (&tok[id * d..][..d], &pos[at * d..][..d]);
            for k in 0..d {
                row[k] = te[k] + pe[k];
            }
        }
        if mode.train {
            s.tensors.push(ids);
        }
        Tensor::from_vec(y, &[b, t, d])
    }

    fn backward(
        &self,
        _: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if let ParamsMut::Device(g) = g {
            crate::device::embedding_backward(self, g, s, dy);
            return None;
        }
        let g = g.host();
        let ids = s.tensors.pop().expect("embedding: saved ids");
        let (t, d) = (ids.dim(1), self.dim);
        let (gtok, gpos) = g.split_at_mut(self.vocab * d);
        for (i, (row, &id)) in dy.data().chunks(d).zip(ids.data()).enumerate() {
            let gt = &mut gtok[id as usize * d..][..d];
            gt.iter_mut().zip(row).for_each(|(a, v)| *a += v);
            let gp = &mut gpos[self.sequence.position(i % t, t) * d..][..d];
            gp.iter_mut().zip(row).for_each(|(a, v)| *a += v);
        }
        None
    }
}

/// Which attention kernel a model runs. Both compute the same function; they differ in what
/// they keep for backward and in speed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// Memory-efficient: keeps the output and `H·T` log-sum-exps, recomputes score tiles in
    /// backward ([`meshtrain_tensor::flash`]); products in the layer's precision (the kept
    /// q/k/v and output are stored in it, the log-sum-exps in f32). The default: at least as
    /// fast as the probability-keeping kernel from 128 tokens on (1.5–2.3x from 512), measured
    /// by `meshtrain bench context --parts kernels`.
    #[default]
    Flash,
    /// Keeps the `H·T²` probabilities for backward ([`meshtrain_tensor::attention`]); its
    /// products run in the layer's precision.
    Standard,
}

impl AttentionKind {
    pub fn is_flash(&self) -> bool {
        *self == AttentionKind::Flash
    }
}

/// The parameter-free core: fused QKV `[B, T, 3D]` → attention output `[B, T, D]`.
pub struct AttentionCore {
    pub dim: usize,
    pub heads: usize,
    /// Inputs of the attention products; under mixed precision the fused q/k/v and the
    /// probabilities kept for backward are stored in 16 bits too (the softmax stays f32).
    pub precision: DType,
    pub kind: AttentionKind,
}

impl AttentionCore {
    fn shape(&self, x: &Tensor) -> AttentionShape {
        AttentionShape {
            batch: x.dim(0),
            seq: x.dim(1),
            dim: self.dim,
            heads: self.heads,
        }
    }
}

impl Layer for AttentionCore {
    fn set_precision(&mut self, precision: DType) {
        self.precision = precision;
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn runs_on(&self, _: Device) -> bool {
        true
    }

    fn forward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        qkv: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if qkv.device().is_cuda() {
            return crate::device::attention_forward(self, qkv, mode, s);
        }
        let shape = self.shape(&qkv);
        if self.kind == AttentionKind::Flash {
            let (out, lse) = flash_attention_forward(shape, qkv.data(), self.precision);
            let out = Tensor::from_vec(out, &[shape.batch, shape.seq, self.dim]);
            if mode.train {
                s.keep(qkv, self.precision);
                s.keep(out.clone(), self.precision);
                let lse = Tensor::from_vec(lse, &[shape.batch, self.heads, shape.seq]);
                s.keep(lse, DType::F32);
            }
            return out;
        }
        let (out, probs) = causal_attention_forward(shape, qkv.data(), self.precision);
        if mode.train {
            s.keep(qkv, self.precision);
            let probs = Tensor::from_vec(probs, &[shape.batch, self.heads, shape.seq, shape.seq]);
            s.keep(probs, self.precision);
        }
        Tensor::from_vec(out, &[shape.batch, shape.seq, self.dim])
    }

    fn backward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if dy.device().is_cuda() {
            return Some(crate::device::attention_backward(self, s, dy));
        }
        if self.kind == AttentionKind::Flash {
            let lse = s.take(DType::F32, "attention (log-sum-exp)");
            let out = s.take(self.precision, "attention (output)");
            let qkv = s.take(self.precision, "attention (q, k, v)");
            let dqkv = flash_attention_backward(
                self.shape(&qkv),
                qkv.data(),
                out.data(),
                lse.data(),
                dy.data(),
                self.precision,
            );
            let shape = qkv.shape().to_vec();
            for dead in [qkv, out, lse, dy] {
                dead.recycle();
            }
            return Some(Tensor::from_vec(dqkv, &shape));
        }
        let probs = s.take(self.precision, "attention (probabilities)");
        let qkv = s.take(self.precision, "attention (q, k, v)");
        let dqkv = causal_attention_backward(
            self.shape(&qkv),
            qkv.data(),
            probs.data(),
            dy.data(),
            self.precision,
        );
        let shape = qkv.shape().to_vec();
        // All three are dead now; their buffers serve the next step's forward.
        for dead in [qkv, probs, dy] {
            dead.recycle();
        }
        Some(Tensor::from_vec(dqkv, &shape))
    }
}

/// Causal multi-head self-attention: `proj(attention(qkv(x)))`; parameters `qkv.*`, `proj.*`.
pub fn causal_self_attention(dim: usize, heads: usize, init: Option<Init>) -> Seq {
    let lin = |i, o| {
        let l = Linear::new(i, o, true);
        match init {
            Some(init) => Box::new(l.with_init(init)) as Box<dyn Layer>,
            None => Box::new(l),
        }
    };
    Seq(Children::new(vec![
        ("qkv".into(), lin(dim, 3 * dim)),
        (
            String::new(),
            Box::new(AttentionCore {
                dim,
                heads,
                precision: DType::F32,
                kind: AttentionKind::Flash,
            }),
        ),
        ("proj".into(), lin(dim, dim)),
    ]))
}

/// Pre-LN transformer block: `x + attn(ln1(x))`, then `+ fc2(gelu(fc1(ln2(·))))`.
pub struct GptBlock {
    /// ln1, qkv, core, proj, ln2, fc1 (with GELU), fc2 — in this order.
    parts: Children,
}

impl GptBlock {
    pub fn new(dim: usize, heads: usize, init: Option<Init>) -> Self {
        Self::with_attention(dim, heads, init, AttentionKind::Flash)
    }

    /// A block whose attention runs `kind`'s kernel.
    pub fn with_attention(
        dim: usize,
        heads: usize,
        init: Option<Init>,
        kind: AttentionKind,
    ) -> Self {
        assert!(
            heads > 0 && dim.is_multiple_of(heads),
            "dim {dim} not divisible by {heads} heads"
        );
        let lin = |i, o, act: Option<Activation>| {
            let mut l = Linear::new(i, o, true);
            l.activation = act;
            match init {
                Some(init) => Box::new(l.with_init(init)) as Box<dyn Layer>,
                None => Box::new(l),
            }
        };
        GptBlock {
            parts: Children::new(vec![
                ("ln1".into(), Box::new(LayerNorm::new(dim))),
                ("qkv".into(), lin(dim, 3 * dim, None)),
                (
                    String::new(),
                    Box::new(AttentionCore {
                        dim,
                        heads,
                        precision: DType::F32,
                        kind,
                    }),
                ),
                ("proj".into(), lin(dim, dim, None)),
                ("ln2".into(), Box::new(LayerNorm::new(dim))),
                // GELU fused into fc1 (one sweep over the 4·dim-wide output each way).
                ("fc1".into(), lin(dim, 4 * dim, Some(Activation::Gelu))),
                ("fc2".into(), lin(4 * dim, dim, None)),
            ]),
        }
    }
}

impl Layer for GptBlock {
    fn params(&self) -> Vec<ParamSpec> {
        self.parts.param_specs()
    }

    fn children(&self) -> Option<&Children> {
        Some(&self.parts)
    }

    fn children_mut(&mut self) -> Option<&mut Children> {
        Some(&mut self.parts)
    }

    fn forward(
        &self,
        p: Params<'_>,
        mut b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let c = &self.parts;
        let h = c.forward(0, p, &mut b, x.clone(), mode, s);
        let h = (1..4).fold(h, |h, i| c.forward(i, p, &mut b, h, mode, s));
        let mut x1 = x;
        x1.add_assign(&h);
        let h = (4..7).fold(x1.clone(), |h, i| c.forward(i, p, &mut b, h, mode, s));
        x1.add_assign(&h);
        x1
    }

    fn backward(
        &self,
        p: Params<'_>,
        mut g: ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        let c = &self.parts;
        let mut saved: Vec<Saved> = s.children;
        let mut grad = dy.clone();
        for i in (4..7).rev() {
            let st = saved.pop().expect("block: saved state");
            grad = c.backward(i, p, &mut g, st, grad, true).expect("gradient");
        }
        let mut dx1 = dy;
        dx1.add_assign(&grad);
        let mut grad = dx1.clone();
        for i in (0..4).rev() {
            let st = saved.pop().expect("block: saved state");
            grad = c.backward(i, p, &mut g, st, grad, true).expect("gradient");
        }
        dx1.add_assign(&grad);
        Some(dx1)
    }
}
