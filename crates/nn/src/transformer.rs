//! GPT layers: token + position embedding, causal self-attention, the pre-LN block.

use crate::cache::{KvCache, LayerKv};
use crate::layer::{Init, Layer, Mode, ParamSpec, Params, ParamsMut, Saved, Stream};
use crate::layers::{Children, LayerNorm, Linear, RmsNorm, Seq, SwiGlu};
use meshtrain_tensor::activation::Activation;
use meshtrain_tensor::attention::{
    append_cached_kv, cached_attention_forward, causal_attention_backward,
    causal_attention_forward, AttentionShape, CachedShape,
};
use meshtrain_tensor::flash::{flash_attention_backward, flash_attention_forward};
use meshtrain_tensor::norm::{rms_norm_backward, rms_norm_forward};
use meshtrain_tensor::rotary::{
    gather_qk, rotary_expand_backward, rotary_expand_forward, rotary_tables, scatter_qk, Rope,
    RotaryShape,
};
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

    /// [`SequenceShard::position`], or for a cached pass (`first`: the position of its first
    /// row) `first + i`: where embeddings and rotary angles place token `i`.
    pub fn position_from(&self, i: usize, local: usize, first: Option<usize>) -> usize {
        match first {
            Some(start) => start + i,
            None => self.position(i, local),
        }
    }

    /// Where row `k` of the `[B·local, ·]` rows this worker holds sits in the whole
    /// `[B·local·parts, ·]` batch (sample by sample, each in sequence order).
    pub fn whole_row(&self, k: usize, local: usize) -> usize {
        let (sample, i) = (k / local, k % local);
        sample * local * self.parts + self.position(i, local)
    }
}

/// Token embedding, plus a learned position embedding when `learned_positions` (GPT; Llama
/// places positions by rotating q and k instead: [`Rotary`]). Input: token ids `[B, T]`
/// carried as exact f32 values (under context parallelism `[B, T/cp]`: this worker's tokens,
/// placed by `sequence`).
pub struct GptEmbedding {
    pub vocab: usize,
    pub max_seq: usize,
    pub dim: usize,
    pub init_std: f32,
    /// A `pos.weight` table of `max_seq` rows added to the token rows.
    pub learned_positions: bool,
    /// Which tokens of each sequence the input holds (their positions).
    pub sequence: SequenceShard,
}

impl GptEmbedding {
    /// The embedding of `ids` (`[B, T]`), their positions counted from `first` when given.
    fn embed(
        &self,
        p: Params<'_>,
        ids: Tensor,
        first: Option<usize>,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let (b, t, d) = (ids.dim(0), ids.dim(1), self.dim);
        let last = self.sequence.position_from(t - 1, t, first) + 1;
        assert!(
            t * self.sequence.parts <= self.max_seq && last <= self.max_seq,
            "sequence {} longer than the model's {}",
            (t * self.sequence.parts).max(last),
            self.max_seq
        );
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::embedding_forward(self, p, ids, first, mode, s);
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
            let te = &tok[id * d..][..d];
            if self.learned_positions {
                let at = self.sequence.position_from(i % t, t, first);
                let pe = &pos[at * d..][..d];
                for k in 0..d {
                    row[k] = te[k] + pe[k];
                }
            } else {
                row.copy_from_slice(te);
            }
        }
        if mode.train {
            s.tensors.push(ids);
        }
        Tensor::from_vec(y, &[b, t, d])
    }
}

impl Layer for GptEmbedding {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn params(&self) -> Vec<ParamSpec> {
        let mut specs = vec![ParamSpec::new(
            "tok.weight",
            &[self.vocab, self.dim],
            Init::Normal(self.init_std),
        )];
        if self.learned_positions {
            specs.push(ParamSpec::new(
                "pos.weight",
                &[self.max_seq, self.dim],
                Init::Normal(self.init_std),
            ));
        }
        specs
    }

    fn runs_on(&self, _: Device) -> bool {
        // The CUDA kernel adds the position table, or (a null table) none.
        true
    }

    fn reads_positions(&self) -> bool {
        self.learned_positions
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        ids: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        self.embed(p, ids, None, mode, s)
    }

    fn forward_cached(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        ids: Tensor,
        cache: &mut KvCache,
    ) -> Option<Tensor> {
        Some(self.embed(
            p,
            ids,
            Some(cache.start()),
            Mode::EVAL,
            &mut Saved::default(),
        ))
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
            if self.learned_positions {
                let gp = &mut gpos[self.sequence.position(i % t, t) * d..][..d];
                gp.iter_mut().zip(row).for_each(|(a, v)| *a += v);
            }
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
    /// The distinct key/value heads among the `heads` the fused input repeats (grouped-query
    /// attention: [`Rotary`] expands them; `heads` for GPT): a key/value cache keeps only
    /// these.
    pub kv_heads: usize,
    /// Inputs of the attention products; under mixed precision the fused q/k/v and the
    /// probabilities kept for backward are stored in 16 bits too (the softmax stays f32).
    pub precision: DType,
    pub kind: AttentionKind,
    /// Keys a query sees at most, itself included (Mistral's sliding window); `None`: all
    /// before it. The memory-efficient kernels (CPU and GPU) and the cached passes have it;
    /// the probability-keeping CPU kernel has not.
    pub window: Option<usize>,
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

    /// A GPU's training attention kernels are written for a few head sizes (the decoder's
    /// take any).
    fn refusal_on(&self, device: Device) -> Option<String> {
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            let head = self.dim / self.heads.max(1);
            let sizes = meshtrain_tensor::cuda::ops::ATTENTION_HEAD_SIZES;
            return (!sizes.contains(&head)).then(|| {
                format!(
                    "CUDA attention handles head sizes {sizes:?}; this model's heads are \
                     {head} wide (dim {} / {} heads)",
                    self.dim, self.heads
                )
            });
        }
        let _ = device;
        None
    }

    fn reads_positions(&self) -> bool {
        true
    }

    /// The new rows' keys and values into the cache, then their queries over it (f32).
    fn forward_cached(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        qkv: Tensor,
        cache: &mut KvCache,
    ) -> Option<Tensor> {
        assert_eq!(qkv.dim(0), 1, "a cached pass runs one sequence");
        let shape = CachedShape {
            rows: qkv.dim(1),
            start: cache.start(),
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.dim / self.heads,
            window: self.window,
        };
        #[cfg(feature = "cuda")]
        if qkv.device().is_cuda() {
            return Some(crate::device::attention_cached(self, shape, qkv, cache));
        }
        let slot = cache.next_layer(shape.kv_width(), |_| LayerKv::Host {
            keys: Vec::new(),
            values: Vec::new(),
        });
        let (keys, values) = match slot {
            LayerKv::Host { keys, values } => (keys, values),
            #[cfg(feature = "cuda")]
            LayerKv::Device { .. } => panic!("a host attention pass over a device cache"),
        };
        append_cached_kv(shape, qkv.data(), keys, values);
        let out = cached_attention_forward(shape, qkv.data(), keys, values);
        Some(Tensor::from_vec(out, &[1, shape.rows, self.dim]))
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
            let (out, lse) =
                flash_attention_forward(shape, qkv.data(), self.precision, self.window);
            let out = Tensor::from_vec(out, &[shape.batch, shape.seq, self.dim]);
            if mode.train {
                s.keep(qkv, self.precision);
                s.keep(out.clone(), self.precision);
                let lse = Tensor::from_vec(lse, &[shape.batch, self.heads, shape.seq]);
                s.keep(lse, DType::F32);
            }
            return out;
        }
        assert!(
            self.window.is_none(),
            "a sliding window runs on the memory-efficient attention kernel only"
        );
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
                self.window,
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

/// Rotary positions and grouped-query heads between a fused q/k/v projection and the
/// attention core: `[B, T, (H + 2·H_kv)·hd]` in the grouped layout →
/// `[B, T, 3·H·hd]` (see [`meshtrain_tensor::rotary`]). Under tensor parallelism `heads` and
/// `kv_heads` are this rank's (whole groups); under context parallelism `sequence` places the
/// tokens, so each rotates by its position in the whole sequence.
pub struct Rotary {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope: Rope,
    pub sequence: SequenceShard,
}

impl Rotary {
    fn shape(&self, rows: usize, seq: usize) -> RotaryShape {
        RotaryShape {
            batch: rows / seq,
            seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// The cosines and sines of `seq` tokens at their places in the whole sequence, or
    /// from `first` on (a cached pass's rows); the device arm uploads these same host tables.
    pub(crate) fn tables(&self, seq: usize, first: Option<usize>) -> (Vec<f32>, Vec<f32>) {
        let positions: Vec<usize> = (0..seq)
            .map(|i| self.sequence.position_from(i, seq, first))
            .collect();
        rotary_tables(&positions, self.head_dim, &self.rope)
    }

    /// Rotary + GQA of `x` (`[B, T, input width]`), positions from `first` when given.
    fn rotate(&self, x: Tensor, first: Option<usize>, mode: Mode, s: &mut Saved) -> Tensor {
        let (b, t) = (x.dim(0), x.dim(1));
        let shape = self.shape(b * t, t);
        assert_eq!(
            x.shape().last(),
            Some(&shape.input_width()),
            "rotary: input width for {shape:?}"
        );
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::device::rotary_forward(self, shape, x, first, mode, s);
        }
        let (cos, sin) = self.tables(t, first);
        let y = rotary_expand_forward(shape, x.data(), &cos, &sin);
        if mode.train {
            s.stats.push(cos);
            s.stats.push(sin);
        }
        x.recycle();
        Tensor::from_vec(y, &[b, t, shape.output_width()])
    }
}

impl Layer for Rotary {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn runs_on(&self, _: Device) -> bool {
        true
    }

    fn reads_positions(&self) -> bool {
        true
    }

    fn forward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        self.rotate(x, None, mode, s)
    }

    fn forward_cached(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        cache: &mut KvCache,
    ) -> Option<Tensor> {
        Some(self.rotate(x, Some(cache.start()), Mode::EVAL, &mut Saved::default()))
    }

    fn backward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        let (b, t) = (dy.dim(0), dy.dim(1));
        let shape = self.shape(b * t, t);
        // A device forward kept its tables as device tensors (the CPU's as host stats).
        #[cfg(feature = "cuda")]
        if s.tensors.last().is_some_and(|k| k.device().is_cuda()) {
            return Some(crate::device::rotary_backward(shape, s, dy));
        }
        let sin = s.stats.pop().expect("rotary: saved sines");
        let cos = s.stats.pop().expect("rotary: saved cosines");
        let dx = rotary_expand_backward(shape, dy.data(), &cos, &sin);
        dy.recycle();
        Some(Tensor::from_vec(dx, &[b, t, shape.input_width()]))
    }
}

/// Qwen3's RMS norms of each query and key head (over `head_dim`: one weight vector for all
/// query heads, `q_norm.weight`, one for all key heads, `k_norm.weight`), between the fused
/// q/k/v projection and the rotary pass, on the grouped layout; value heads pass unchanged.
/// Under tensor parallelism each rank norms its own heads, so the weights' gradients are
/// partial sums: `grad_reducer` (set by the tensor-parallel rewrite) sums them over the
/// tensor-parallel group in backward.
pub struct QkNorm {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
    pub grad_reducer: Option<std::sync::Arc<dyn crate::layer::StatsReducer>>,
}

impl QkNorm {
    /// This pass's weight gradients `dw` (`[q | k]`, partial: this rank's heads) summed over
    /// the tensor-parallel group, when there is one.
    pub(crate) fn sum_over_heads(&self, dw: &mut [f32]) {
        if let Some(reducer) = &self.grad_reducer {
            let mut wide: Vec<f64> = dw.iter().map(|&v| f64::from(v)).collect();
            reducer.sum(&mut wide);
            dw.iter_mut().zip(wide).for_each(|(d, v)| *d = v as f32);
        }
    }

    fn shape(&self) -> RotaryShape {
        RotaryShape {
            batch: 1,
            seq: 1,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }
}

impl Layer for QkNorm {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn params(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("q_norm.weight", &[self.head_dim], Init::Ones),
            ParamSpec::new("k_norm.weight", &[self.head_dim], Init::Ones),
        ]
    }

    fn runs_on(&self, device: Device) -> bool {
        device.is_cpu() || cfg!(feature = "cuda")
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let (shape, hd) = (self.shape(), self.head_dim);
        assert_eq!(
            x.shape().last(),
            Some(&shape.input_width()),
            "q/k norms: input width for {shape:?}"
        );
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::qk_norm_forward(self, shape, p, x, mode, s);
        }
        let w = p.host();
        let (q, k) = gather_qk(shape, x.data());
        let (qn, rq) = rms_norm_forward(&q, hd, &w[..hd], self.eps);
        let (kn, rk) = rms_norm_forward(&k, hd, &w[hd..], self.eps);
        let mut y = x.data().to_vec();
        scatter_qk(shape, &qn, &kn, &mut y);
        if mode.train {
            s.stats.extend([q, k, rq, rk]);
        }
        Tensor::from_vec(y, x.shape())
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        let (shape, hd) = (self.shape(), self.head_dim);
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return Some(crate::device::qk_norm_backward(self, shape, p, g, s, dy));
        }
        let (w, g) = (p.host(), g.host());
        let rk = s.stats.pop().expect("q/k norms: key rstd");
        let rq = s.stats.pop().expect("q/k norms: query rstd");
        let k = s.stats.pop().expect("q/k norms: keys");
        let q = s.stats.pop().expect("q/k norms: queries");
        let (dq, dk) = gather_qk(shape, dy.data());
        let mut dw = vec![0.0f32; 2 * hd];
        let (dwq, dwk) = dw.split_at_mut(hd);
        let dqx = rms_norm_backward(&q, hd, &w[..hd], &rq, &dq, dwq);
        let dkx = rms_norm_backward(&k, hd, &w[hd..], &rk, &dk, dwk);
        self.sum_over_heads(&mut dw);
        g.iter_mut().zip(&dw).for_each(|(a, v)| *a += v);
        let mut dx = dy.data().to_vec();
        scatter_qk(shape, &dqx, &dkx, &mut dx);
        Some(Tensor::from_vec(dx, dy.shape()))
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
                kv_heads: heads,
                precision: DType::F32,
                kind: AttentionKind::Flash,
                window: None,
            }),
        ),
        ("proj".into(), lin(dim, dim)),
    ]))
}

/// A pre-norm transformer block: `x + attention(x)`, then `+ mlp(·)`, each branch a chain of
/// children beginning with its norm. GPT ([`TransformerBlock::with_attention`]): layer norms, fused q/k/v
/// with biases, GELU MLP. Llama ([`TransformerBlock::llama`]): RMS norms, rotary positions,
/// grouped-query attention, SwiGLU MLP, no biases.
pub struct TransformerBlock {
    /// The attention branch's children, then the MLP branch's.
    parts: Children,
    /// How many of `parts` the attention branch holds.
    attention_parts: usize,
}

/// The GPT form's name, kept for the code and tests that build GPT blocks.
pub type GptBlock = TransformerBlock;

/// The shape of one Llama block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaBlockShape {
    pub dim: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Inner width of the SwiGLU MLP.
    pub ffn: usize,
    pub rope: Rope,
    pub norm_eps: f32,
    /// Biases on the q/k/v projection (Qwen2).
    pub qkv_bias: bool,
    /// Values per head (`dim / heads` for Llama; Qwen3 sets its own, so the attention's
    /// width `heads · head_dim` may differ from `dim`).
    pub head_dim: usize,
    /// RMS norms of each query and key head before the rotation (Qwen3: [`QkNorm`]).
    pub qk_norm: bool,
    /// Mistral's sliding window: keys a query sees at most, itself included.
    pub window: Option<usize>,
}

impl TransformerBlock {
    pub fn new(dim: usize, heads: usize, init: Option<Init>) -> Self {
        Self::with_attention(dim, heads, init, AttentionKind::Flash)
    }

    /// A GPT block whose attention runs `kind`'s kernel.
    pub fn with_attention(
        dim: usize,
        heads: usize,
        init: Option<Init>,
        kind: AttentionKind,
    ) -> Self {
        Self::gpt(dim, heads, init, kind, Activation::Gelu)
    }

    /// A GPT block whose attention runs `kind`'s kernel and whose MLP applies `activation`
    /// (a GELU: exact, or GPT-2's tanh approximation).
    pub fn gpt(
        dim: usize,
        heads: usize,
        init: Option<Init>,
        kind: AttentionKind,
        activation: Activation,
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
        TransformerBlock {
            parts: Children::new(vec![
                ("ln1".into(), Box::new(LayerNorm::new(dim))),
                ("qkv".into(), lin(dim, 3 * dim, None)),
                (
                    String::new(),
                    Box::new(AttentionCore {
                        dim,
                        heads,
                        kv_heads: heads,
                        precision: DType::F32,
                        kind,
                        window: None,
                    }),
                ),
                ("proj".into(), lin(dim, dim, None)),
                ("ln2".into(), Box::new(LayerNorm::new(dim))),
                // GELU fused into fc1 (one sweep over the 4·dim-wide output each way).
                ("fc1".into(), lin(dim, 4 * dim, Some(activation))),
                ("fc2".into(), lin(4 * dim, dim, None)),
            ]),
            attention_parts: 4,
        }
    }

    /// A Llama block: `attn_norm`, `qkv` (grouped layout, see [`Rotary`]), rotary + GQA, the
    /// attention core, `proj`; `mlp_norm`, `gate_up` (`[gate | up]`), SwiGLU, `down`. Weights
    /// drawn from `init` (`Init::Normal(0.02)` as Hugging Face's `initializer_range`).
    pub fn llama(shape: LlamaBlockShape, init: Init, kind: AttentionKind) -> Self {
        let LlamaBlockShape {
            dim,
            heads,
            kv_heads,
            ffn,
            head_dim,
            ..
        } = shape;
        assert!(
            heads > 0 && head_dim > 0 && kv_heads > 0 && heads.is_multiple_of(kv_heads),
            "Llama block: dim {dim}, heads {heads} of {head_dim}, kv_heads {kv_heads}"
        );
        // The attention's width: `dim` for Llama, Qwen3's own `heads · head_dim` otherwise.
        let width = heads * head_dim;
        let lin = |i, o| Box::new(Linear::new(i, o, false).with_init(init)) as Box<dyn Layer>;
        let mut attention: Vec<(String, Box<dyn Layer>)> = vec![
            (
                "attn_norm".into(),
                Box::new(RmsNorm::new(dim, shape.norm_eps)),
            ),
            (
                "qkv".into(),
                Box::new(
                    Linear::new(dim, (heads + 2 * kv_heads) * head_dim, shape.qkv_bias)
                        .with_init(init),
                ),
            ),
        ];
        if shape.qk_norm {
            attention.push((
                String::new(),
                Box::new(QkNorm {
                    heads,
                    kv_heads,
                    head_dim,
                    eps: shape.norm_eps,
                    grad_reducer: None,
                }),
            ));
        }
        // The rotary pass, the core and the projection end the attention branch.
        let attention_parts = attention.len() + 3;
        let rest: Vec<(String, Box<dyn Layer>)> = vec![
            (
                String::new(),
                Box::new(Rotary {
                    heads,
                    kv_heads,
                    head_dim,
                    rope: shape.rope,
                    sequence: SequenceShard::default(),
                }),
            ),
            (
                String::new(),
                Box::new(AttentionCore {
                    dim: width,
                    heads,
                    kv_heads,
                    precision: DType::F32,
                    kind,
                    window: shape.window,
                }),
            ),
            ("proj".into(), lin(width, dim)),
            (
                "mlp_norm".into(),
                Box::new(RmsNorm::new(dim, shape.norm_eps)),
            ),
            ("gate_up".into(), lin(dim, 2 * ffn)),
            (String::new(), Box::new(SwiGlu)),
            ("down".into(), lin(ffn, dim)),
        ];
        attention.extend(rest);
        TransformerBlock {
            parts: Children::new(attention),
            attention_parts,
        }
    }
}

impl TransformerBlock {
    /// The block's arithmetic, written once for training and generation: `x + attention
    /// branch(x)`, then `+ MLP branch(·)`, each branch its children in order, child `i` run
    /// by `child(i, h, None)` (its training forward, or its cached one). Returns the stream
    /// and the MLP branch's output, whose sum is the block's output: the caller adds them, or
    /// leaves the add to the next block ([`Layer::forward_residual`]).
    ///
    /// Where the stream takes an add before a child, the child is run by
    /// `child(i, h, Some(stream))`: `h` is added into the stream first and the child runs on
    /// the sum (in training, a norm on a GPU does both in one kernel:
    /// [`Layer::add_then_forward`]). That is the MLP branch's first child (after the attention
    /// branch's add), and the first child when `x` is an add the block before left undone.
    fn residual(
        &self,
        x: Stream,
        mut child: impl FnMut(usize, Tensor, Option<&mut Tensor>) -> Option<Tensor>,
    ) -> Option<(Tensor, Tensor)> {
        let (c, split) = (&self.parts, self.attention_parts);
        debug_assert!(
            0 < split && split < c.len(),
            "a block has an attention branch and an MLP branch"
        );
        let (mut x, first) = match x {
            Stream::Ready(x) => {
                let first = child(0, x.clone(), None)?;
                (x, first)
            }
            Stream::Pending { mut stream, branch } => {
                let first = child(0, branch, Some(&mut stream))?;
                (stream, first)
            }
        };
        let h = (1..split).try_fold(first, |h, i| child(i, h, None))?;
        // Both constructors give the block an MLP branch: `split` is its first child.
        let first = child(split, h, Some(&mut x))?;
        let h = (split + 1..c.len()).try_fold(first, |h, i| child(i, h, None))?;
        Some((x, h))
    }
}

impl Layer for TransformerBlock {
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
        b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        self.forward_residual(p, b, Stream::Ready(x), false, mode, s)
            .resolve()
    }

    fn forward_residual(
        &self,
        p: Params<'_>,
        mut b: ParamsMut<'_>,
        input: Stream,
        leave_add: bool,
        mode: Mode,
        s: &mut Saved,
    ) -> Stream {
        let c = &self.parts;
        let (stream, branch) = self
            .residual(input, |i, h, stream| {
                Some(match stream {
                    None => c.forward(i, p, &mut b, h, mode, s),
                    Some(stream) => c.add_then_forward(i, p, &mut b, stream, h, mode, s),
                })
            })
            .expect("a training forward always runs");
        let pending = Stream::Pending { stream, branch };
        if leave_add {
            pending
        } else {
            Stream::Ready(pending.resolve())
        }
    }

    fn forward_cached(
        &self,
        p: Params<'_>,
        mut b: ParamsMut<'_>,
        x: Tensor,
        cache: &mut KvCache,
    ) -> Option<Tensor> {
        let c = &self.parts;
        let (stream, branch) = self.residual(Stream::Ready(x), |i, h, stream| {
            let h = match stream {
                None => h,
                Some(stream) => {
                    stream.add_assign(&h);
                    stream.clone()
                }
            };
            c.forward_cached(i, p, &mut b, h, cache)
        })?;
        Some(Stream::Pending { stream, branch }.resolve())
    }

    fn backward(
        &self,
        p: Params<'_>,
        mut g: ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        let (c, split) = (&self.parts, self.attention_parts);
        let mut saved: Vec<Saved> = s.children;
        // Each branch's layers from the last to the second; the first (the norm) adds its
        // input gradient into the stream's (`backward_add_into`: in its kernel on a GPU).
        // A layer ending in an activation may offer it to the layer after it
        // (`Layer::output_activation`: fc1's GELU on a GPU), whose input-gradient product then
        // takes the activation's gradient too; the offering layer's backward starts from its
        // pre-activation's gradient.
        let mut dx = dy;
        for branch in [split..c.len(), 0..split] {
            let grad = dx.clone();
            // The stream's gradient in 16 bits (a norm's kernel wrote it: `Tensor::rounded`)
            // is for the branch's last product, which `grad` reaches; `dx` only waits for the
            // branch's first layer to add into it.
            dx.drop_rounded();
            // The norm beginning the branch is not asked for an activation: it ends in none,
            // and its backward adds into the stream's gradient below.
            let grad = c
                .backward_chain(
                    branch.start + 1..branch.end,
                    p,
                    &mut g,
                    &mut saved,
                    grad,
                    |_| true,
                )
                .expect("a branch's gradient");
            let st = saved.pop().expect("block: saved state");
            c.backward_add_into(branch.start, p, &mut g, st, grad, &mut dx);
        }
        Some(dx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshtrain_tensor::rng::normal_values;

    /// A context-parallel worker's rotary layer, given the worker's tokens, gives exactly the
    /// rows the unsharded layer gives those tokens at their places in the whole sequence; told
    /// nothing of its shard it rotates by local positions, which is a different function.
    #[test]
    fn rotary_under_context_parallelism_rotates_by_whole_sequence_positions() {
        let (seq, parts) = (8, 2);
        let whole = Rotary {
            heads: 4,
            kv_heads: 2,
            head_dim: 6,
            rope: Rope::new(10_000.0),
            sequence: SequenceShard::default(),
        };
        let width = (4 + 2 * 2) * 6;
        let x = normal_values(seq * width, 3);
        let run = |layer: &Rotary, x: Vec<f32>, t: usize| {
            let y = layer.forward(
                Params::Host(&[]),
                ParamsMut::Host(&mut []),
                Tensor::from_vec(x, &[1, t, width]),
                Mode::EVAL,
                &mut Saved::default(),
            );
            y.data().to_vec()
        };
        let full = run(&whole, x.clone(), seq);
        let out_width = full.len() / seq;
        for index in 0..parts {
            let shard = SequenceShard { parts, index };
            let local = seq / parts;
            let mine: Vec<f32> = (0..local)
                .flat_map(|i| x[shard.position(i, local) * width..][..width].to_vec())
                .collect();
            let sharded = Rotary {
                sequence: shard,
                ..whole
            };
            let got = run(&sharded, mine.clone(), local);
            for i in 0..local {
                let at = shard.position(i, local);
                assert_eq!(
                    &got[i * out_width..][..out_width],
                    &full[at * out_width..][..out_width],
                    "worker {index}, token {i} (position {at})"
                );
            }
            let unaware = run(&whole, mine, local);
            assert_ne!(
                unaware, got,
                "worker {index}: local positions went unnoticed"
            );
        }
    }
}
