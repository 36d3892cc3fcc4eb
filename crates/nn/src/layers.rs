//! The basic layers, and [`Children`], the bookkeeping composite layers share.

use crate::layer::{
    spec_len, Init, Kept, Layer, Mode, OutputActivation, ParamSpec, Params, ParamsMut, Saved,
    StatsReducer,
};
use meshtrain_tensor::activation::Activation;
use meshtrain_tensor::conv::{conv2d_backward, conv2d_forward, ConvGeometry, Spatial};
use meshtrain_tensor::fp8::{self, Fp8Format};
use meshtrain_tensor::lowp::{self, Bf16Rows};
use meshtrain_tensor::matmul::{run_pair, Mat, MatMut};
use meshtrain_tensor::norm;
use meshtrain_tensor::pool::{self, PoolGeometry};
use meshtrain_tensor::tensor::swap_leading_axes;
use meshtrain_tensor::Tensor;
use meshtrain_tensor::{DType, Device};
use std::ops::Range;
use std::sync::Arc;

/// Named sub-layers of a composite layer with the offsets of their parameters and buffers
/// inside the composite's slices. Names prefix the children's parameter names
/// ("conv1" + "weight" → "conv1.weight"); parameterless children may have an empty name.
pub struct Children {
    layers: Vec<(String, Box<dyn Layer>)>,
    params: Vec<Range<usize>>,
    buffers: Vec<Range<usize>>,
}

fn prefixed(prefix: &str, specs: Vec<ParamSpec>) -> Vec<ParamSpec> {
    specs
        .into_iter()
        .map(|mut s| {
            if !prefix.is_empty() {
                s.name = format!("{prefix}.{}", s.name);
            }
            s
        })
        .collect()
}

impl Children {
    pub fn new(layers: Vec<(String, Box<dyn Layer>)>) -> Self {
        let mut children = Children {
            layers,
            params: Vec::new(),
            buffers: Vec::new(),
        };
        children.relayout();
        children
    }

    /// Recomputes where each child's parameters and buffers sit, after children were
    /// replaced (their sizes may have changed).
    pub fn relayout(&mut self) {
        let (mut params, mut buffers) = (Vec::new(), Vec::new());
        let (mut p, mut b) = (0, 0);
        for (_, l) in &self.layers {
            let (np, nb) = (spec_len(&l.params()), spec_len(&l.buffers()));
            params.push(p..p + np);
            buffers.push(b..b + nb);
            p += np;
            b += nb;
        }
        (self.params, self.buffers) = (params, buffers);
    }

    /// The children, by name, to inspect or replace (then [`Children::relayout`]).
    pub fn layers_mut(&mut self) -> &mut [(String, Box<dyn Layer>)] {
        &mut self.layers
    }

    /// The children, by name.
    pub fn layers(&self) -> &[(String, Box<dyn Layer>)] {
        &self.layers
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    pub fn param_specs(&self) -> Vec<ParamSpec> {
        self.layers
            .iter()
            .flat_map(|(n, l)| prefixed(n, l.params()))
            .collect()
    }

    pub fn buffer_specs(&self) -> Vec<ParamSpec> {
        self.layers
            .iter()
            .flat_map(|(n, l)| prefixed(n, l.buffers()))
            .collect()
    }

    /// Forward child `i`, pushing its saved state onto `saved.children`.
    pub fn forward(
        &self,
        i: usize,
        p: Params<'_>,
        b: &mut ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        saved: &mut Saved,
    ) -> Tensor {
        let mut s = Saved::default();
        let y = self.layers[i].1.forward(
            p.slice(self.params[i].clone()),
            b.slice(self.buffers[i].clone()),
            x,
            mode,
            &mut s,
        );
        saved.children.push(s);
        y
    }

    /// Child `i`'s forward after a residual add into `stream` ([`Layer::add_then_forward`]).
    #[allow(clippy::too_many_arguments)]
    pub fn add_then_forward(
        &self,
        i: usize,
        p: Params<'_>,
        b: &mut ParamsMut<'_>,
        stream: &mut Tensor,
        branch: Tensor,
        mode: Mode,
        saved: &mut Saved,
    ) -> Tensor {
        let mut s = Saved::default();
        let y = self.layers[i].1.add_then_forward(
            p.slice(self.params[i].clone()),
            b.slice(self.buffers[i].clone()),
            stream,
            branch,
            mode,
            &mut s,
        );
        saved.children.push(s);
        y
    }

    /// Child `i`'s cached forward ([`Layer::forward_cached`]).
    pub fn forward_cached(
        &self,
        i: usize,
        p: Params<'_>,
        b: &mut ParamsMut<'_>,
        x: Tensor,
        cache: &mut crate::cache::KvCache,
    ) -> Option<Tensor> {
        self.layers[i].1.forward_cached(
            p.slice(self.params[i].clone()),
            b.slice(self.buffers[i].clone()),
            x,
            cache,
        )
    }

    /// Hands the SyncBatchNorm reducer to every child.
    pub fn set_stats_reducer(&mut self, reducer: Option<Arc<dyn StatsReducer>>) {
        for (_, layer) in &mut self.layers {
            layer.set_stats_reducer(reducer.clone());
        }
    }

    /// Child `i`, with its slices of the parameters and gradients.
    fn child<'p>(
        &self,
        i: usize,
        p: Params<'p>,
        g: &'p mut ParamsMut<'_>,
    ) -> (&dyn Layer, Params<'p>, ParamsMut<'p>) {
        let range = self.params[i].clone();
        (&*self.layers[i].1, p.slice(range.clone()), g.slice(range))
    }

    /// Backward child `i` with its saved state.
    pub fn backward(
        &self,
        i: usize,
        p: Params<'_>,
        g: &mut ParamsMut<'_>,
        saved: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        let (layer, p, g) = self.child(i, p, g);
        layer.backward(p, g, saved, dy, need_dx)
    }

    /// Backward through children `range`, last to first, from `grad` (the gradient of the
    /// last one's output), each child's saved state popped from the end of `saved`. A child
    /// ending in an activation may offer it to the child after it, when both are in `range`
    /// ([`Layer::output_activation`]): that child's input-gradient product then takes the
    /// activation's gradient too ([`Layer::backward_into_activation`]; on a GPU a linear
    /// layer's epilogue), and the offering child's backward starts from its pre-activation's
    /// gradient ([`Layer::backward_from_pre_activation`]). `need_dx(i)`: whether child `i`
    /// must return its input gradient (one that is offered to always does). Returns the
    /// first child's input gradient, if it was asked for.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_chain(
        &self,
        range: Range<usize>,
        p: Params<'_>,
        g: &mut ParamsMut<'_>,
        saved: &mut Vec<Saved>,
        grad: Tensor,
        need_dx: impl Fn(usize) -> bool,
    ) -> Option<Tensor> {
        let mut grad = Some(grad);
        // Whether `grad` is already with respect to child i's pre-activation.
        let mut pre_activation = false;
        for i in range.clone().rev() {
            let st = saved.pop().expect("backward: a child's saved state");
            let offered = (i > range.start)
                .then(|| {
                    let previous = saved.last().expect("backward: a child's saved state");
                    self.output_activation(i - 1, previous)
                })
                .flatten();
            let dy = grad
                .take()
                .expect("backward: the gradient of a child's output");
            grad = match (pre_activation, &offered) {
                (false, None) => self.backward(i, p, g, st, dy, need_dx(i)),
                (false, Some(act)) => Some(self.backward_into_activation(i, p, g, st, dy, act)),
                (true, offered) => {
                    let want = need_dx(i) || offered.is_some();
                    let dx = self.backward_from_pre_activation(i, p, g, st, dy, want);
                    match offered {
                        Some(act) => Some(act.backward(dx.expect("an input gradient"))),
                        None => dx,
                    }
                }
            };
            pre_activation = offered.is_some();
        }
        grad
    }

    /// Child `i`'s offered output activation ([`Layer::output_activation`]).
    pub fn output_activation(&self, i: usize, saved: &Saved) -> Option<OutputActivation> {
        self.layers[i].1.output_activation(saved)
    }

    /// Child `i`'s backward through the previous child's activation
    /// ([`Layer::backward_into_activation`]).
    pub fn backward_into_activation(
        &self,
        i: usize,
        p: Params<'_>,
        g: &mut ParamsMut<'_>,
        saved: Saved,
        dy: Tensor,
        act: &OutputActivation,
    ) -> Tensor {
        let (layer, p, g) = self.child(i, p, g);
        layer.backward_into_activation(p, g, saved, dy, act)
    }

    /// Child `i`'s backward from its pre-activation's gradient
    /// ([`Layer::backward_from_pre_activation`]).
    pub fn backward_from_pre_activation(
        &self,
        i: usize,
        p: Params<'_>,
        g: &mut ParamsMut<'_>,
        saved: Saved,
        dz: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        let (layer, p, g) = self.child(i, p, g);
        layer.backward_from_pre_activation(p, g, saved, dz, need_dx)
    }

    /// Child `i`'s backward with its input gradient added into `dx`
    /// ([`Layer::backward_add_into`]).
    pub fn backward_add_into(
        &self,
        i: usize,
        p: Params<'_>,
        g: &mut ParamsMut<'_>,
        saved: Saved,
        dy: Tensor,
        dx: &mut Tensor,
    ) {
        let (layer, p, g) = self.child(i, p, g);
        layer.backward_add_into(p, g, saved, dy, dx)
    }
}

/// Layers applied one after the other.
pub struct Seq(pub Children);

impl Seq {
    pub fn new(layers: Vec<(&str, Box<dyn Layer>)>) -> Self {
        Seq(Children::new(
            layers
                .into_iter()
                .map(|(n, l)| (n.to_string(), l))
                .collect(),
        ))
    }
}

impl Layer for Seq {
    fn params(&self) -> Vec<ParamSpec> {
        self.0.param_specs()
    }

    fn children(&self) -> Option<&Children> {
        Some(&self.0)
    }

    fn children_mut(&mut self) -> Option<&mut Children> {
        Some(&mut self.0)
    }
    fn buffers(&self) -> Vec<ParamSpec> {
        self.0.buffer_specs()
    }
    fn forward(
        &self,
        p: Params<'_>,
        mut b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        (0..self.0.len()).fold(x, |x, i| self.0.forward(i, p, &mut b, x, mode, s))
    }

    /// The residual add goes to the first child (a model's final norm, before its head).
    fn add_then_forward(
        &self,
        p: Params<'_>,
        mut b: ParamsMut<'_>,
        stream: &mut Tensor,
        branch: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        if self.0.is_empty() {
            return crate::layer::add_then_forward(self, p, b, stream, branch, mode, s);
        }
        let first = self
            .0
            .add_then_forward(0, p, &mut b, stream, branch, mode, s);
        (1..self.0.len()).fold(first, |x, i| self.0.forward(i, p, &mut b, x, mode, s))
    }
    fn forward_cached(
        &self,
        p: Params<'_>,
        mut b: ParamsMut<'_>,
        x: Tensor,
        cache: &mut crate::cache::KvCache,
    ) -> Option<Tensor> {
        (0..self.0.len()).try_fold(x, |x, i| self.0.forward_cached(i, p, &mut b, x, cache))
    }
    fn backward(
        &self,
        p: Params<'_>,
        mut g: ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        // Without an input gradient to return, the children before the first one with
        // parameters (a model's leading ToChannelMajor) need no gradient at all, and that
        // child need not compute its own input gradient.
        let first_needed = if need_dx {
            0
        } else {
            let has_params = |r: &Range<usize>| !r.is_empty();
            self.0
                .params
                .iter()
                .position(has_params)
                .unwrap_or(self.0.len())
        };
        let mut saved = s.children;
        let want = |i: usize| need_dx || i > first_needed;
        self.0
            .backward_chain(first_needed..self.0.len(), p, &mut g, &mut saved, dy, want)
            .filter(|_| need_dx)
    }
    fn set_stats_reducer(&mut self, reducer: Option<Arc<dyn StatsReducer>>) {
        self.0.set_stats_reducer(reducer);
    }
}

/// Fully connected layer `y = act(x·Wᵀ + b)` over the last dimension (PyTorch layout
/// W[out, in]); the activation is optional and fused so that bias and activation cost one
/// sweep over the output in each direction instead of two (a GPT block's fc1 + GELU).
pub struct Linear {
    pub inputs: usize,
    pub outputs: usize,
    pub bias: bool,
    pub weight_init: Init,
    pub activation: Option<Activation>,
    /// Inputs of the products (f32, or bf16/f16 under mixed precision); the input and
    /// pre-activation kept for backward are stored in it too.
    pub precision: DType,
    /// The three products (forward, input and weight gradients) in FP8 instead
    /// ([`meshtrain_tensor::fp8::gemm_fp8`]: the input and weight in E4M3, the output
    /// gradient in E5M2, each with its own current scale, f32 accumulation); `precision`
    /// still says how the kept input is stored.
    pub fp8: bool,
    /// The ranks holding the other shards of this layer's tensors (tensor parallelism): they
    /// agree on each FP8 cast's amax, so that every shard is cast at the whole tensor's scale,
    /// as one worker casts it. `None`: this layer's tensors are whole.
    pub fp8_shards: Option<Arc<dyn AmaxAgreement>>,
}

/// How the ranks holding shards of one layer's tensors agree on the tensors' FP8 scales: each
/// amax becomes the largest over the ranks, the amax of the whole tensor (torchao does the
/// same for a sharded tensor under tensor parallelism; Transformer Engine reduces amaxes over
/// its tensor-parallel group too). Tensor parallelism implements it with a max all-reduce.
pub trait AmaxAgreement: Send + Sync {
    /// `amaxes` (f32, on the host or on the run's device) replaced by their maxima over the
    /// ranks. Every rank calls it at the same point of its step (it is a collective).
    fn agree(&self, amaxes: Tensor) -> Tensor;
}

/// The FP8 casts of a linear layer's backward products, decided once for both (so that a
/// tensor-parallel layer agrees on them in one collective): the output gradient's (E5M2),
/// the weight's and the kept input's (E4M3).
#[derive(Clone, Copy, Debug)]
pub struct Fp8BackwardCasts {
    pub dz: fp8::Fp8Operand,
    pub weight: fp8::Fp8Operand,
    pub input: fp8::Fp8Operand,
}

impl Linear {
    /// PyTorch's default initialisation (uniform ±1/√in for weight and bias).
    pub fn new(inputs: usize, outputs: usize, bias: bool) -> Self {
        Linear {
            inputs,
            outputs,
            bias,
            weight_init: Init::Uniform(1.0 / (inputs as f32).sqrt()),
            activation: None,
            precision: DType::F32,
            fp8: false,
            fp8_shards: None,
        }
    }

    pub fn with_init(mut self, init: Init) -> Self {
        self.weight_init = init;
        self
    }

    /// Apply `act` to the output, fused with the bias add (forward) and the bias gradient
    /// (backward). Same parameters and results as `Linear` followed by [`Act`].
    pub fn with_activation(mut self, act: Activation) -> Self {
        self.activation = Some(act);
        self
    }
}

/// Rows per block in [`Linear`]'s bias/activation sweeps. Fixed, not derived from the thread
/// count, so the bias gradient's summation order (and bits) does not depend on the pool size.
const LINEAR_ROWS_PER_BLOCK: usize = 64;

impl Layer for Linear {
    fn params(&self) -> Vec<ParamSpec> {
        let mut v = vec![ParamSpec::new(
            "weight",
            &[self.outputs, self.inputs],
            self.weight_init,
        )];
        if self.bias {
            let bound = 1.0 / (self.inputs as f32).sqrt();
            let init = match self.weight_init {
                Init::Uniform(_) => Init::Uniform(bound),
                _ => Init::Zeros,
            };
            v.push(ParamSpec::new("bias", &[self.outputs], init));
        }
        v
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        assert_eq!(
            x.shape().last(),
            Some(&self.inputs),
            "Linear({} → {}) takes inputs whose last dimension is {}, got shape {:?}",
            self.inputs,
            self.outputs,
            self.inputs,
            x.shape()
        );
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::linear_forward(self, p, x, mode, s);
        }
        let p = p.host();
        let rows = x.numel() / self.inputs;
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("non-empty shape") = self.outputs;
        // Every element is written by the product (accumulate = false). The bias is added
        // after the product rather than copied into the output first and accumulated onto:
        // the `gemm` crate's accumulating path, which must load every output tile, made the
        // whole GPT step ~2% slower than this extra (parallel) sweep over the output.
        let mut y = meshtrain_tensor::par::take_buffer(rows * self.outputs);
        let x_mat = Mat::new(x.data(), rows, self.inputs);
        let w_t = Mat::new(&p[..self.inputs * self.outputs], self.outputs, self.inputs).t();
        let casts = self.fp8.then(|| {
            let amaxes = [fp8::amax_of(&x_mat), fp8::amax_of(&w_t)];
            let [x_amax, w_amax] = self.agreed(amaxes);
            [
                fp8::Fp8Operand::current(Fp8Format::E4M3, x_amax),
                fp8::Fp8Operand::current(Fp8Format::E4M3, w_amax),
            ]
        });
        self.product(
            MatMut::new(&mut y, rows, self.outputs),
            x_mat,
            w_t,
            casts,
            false,
            meshtrain_tensor::par::threads(),
        );
        let bias = self.bias.then(|| &p[self.inputs * self.outputs..]);
        let add_bias = |z: &mut [f32]| {
            if let Some(b) = bias {
                for row in z.chunks_mut(self.outputs) {
                    row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                }
            }
        };
        let block = LINEAR_ROWS_PER_BLOCK * self.outputs;
        let Some(act) = self.activation else {
            if bias.is_some() {
                meshtrain_tensor::par::for_each_chunk_mut(&mut y, block, |_, z| add_bias(z));
            }
            if mode.train {
                s.keep(x, self.precision);
            }
            return Tensor::from_vec(y, &shape);
        };
        // `y` holds the pre-activation z; one sweep per block adds the bias and writes act(z).
        let mut z = y;
        let mut y = meshtrain_tensor::par::take_buffer(z.len());
        meshtrain_tensor::par::for_each_chunk_pair_mut(&mut z, block, &mut y, block, |_, z, y| {
            add_bias(z);
            act.forward_serial(z, y);
        });
        let (z, y) = (Tensor::from_vec(z, &shape), Tensor::from_vec(y, &shape));
        if mode.train {
            s.keep(x, self.precision);
            let act_input = if act.backward_uses_output() {
                z.recycle();
                y.clone()
            } else {
                z
            };
            s.keep(act_input, self.precision);
        } else {
            z.recycle();
        }
        y
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::linear_backward(self, p, g, s, dy, need_dx);
        }
        let p = p.host();
        let g = g.host();
        let mut dz = dy;
        let x = self.backward_prologue(g, &mut s, &mut dz);
        let casts = self.fp8_backward_casts(p, &dz, &x);
        let casts = casts.as_ref();
        let shape = x.shape().to_vec();
        let dx = if need_dx {
            // Every element is written by the product (accumulate = false).
            let mut dx = meshtrain_tensor::par::take_buffer(x.numel());
            let macs = x.numel() * self.outputs;
            run_pair(
                [macs, macs],
                |threads| self.weight_gradient_on(g, &dz, &x, casts, threads),
                |threads| self.input_gradient_into(p, &dz, &mut dx, casts, threads),
            );
            Some(Tensor::from_vec(dx, &shape))
        } else {
            self.weight_gradient(g, &dz, &x, casts);
            None
        };
        x.recycle();
        dz.recycle();
        dx
    }

    /// Offered on a GPU only, where the next layer's input-gradient product takes the
    /// activation's gradient in its epilogue (`ops::gelu_epilogue`: a tanh GELU in 16 bits),
    /// not from an FP8 product. On the CPU the activation's gradient and the bias gradient
    /// share one sweep of this layer's backward, which a separate pass in the next layer's
    /// would only lengthen.
    fn output_activation(&self, saved: &Saved) -> Option<OutputActivation> {
        #[cfg(feature = "cuda")]
        {
            use meshtrain_tensor::cuda::ops::{gelu_epilogue, ActKind};
            let act = self.activation?;
            let kept = saved.tensors.last()?;
            let fusable = gelu_epilogue(ActKind::from(act), self.precision, self.outputs);
            (fusable && !self.fp8 && !kept.device().is_cpu()).then(|| OutputActivation {
                kind: act,
                input: kept.clone(),
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = saved;
            None
        }
    }

    fn backward_into_activation(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        act: &OutputActivation,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::linear_backward_through(self, p, g, s, dy, act);
        }
        crate::layer::backward_then_activation(self, p, g, s, dy, act)
    }

    /// Drops the kept activation input, then runs the backward of this layer without its
    /// activation.
    fn backward_from_pre_activation(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dz: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        assert!(
            self.activation.is_some(),
            "a linear layer without an activation has no pre-activation"
        );
        // Kept last: among the tensors on a GPU, by precision on the host.
        if p.device().is_cpu() {
            s.take(self.precision, "Linear (activation)").recycle();
        } else {
            s.tensors
                .pop()
                .expect("Linear (activation): nothing saved for backward");
        }
        self.without_activation().backward(p, g, s, dz, need_dx)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn set_precision(&mut self, precision: DType) {
        self.precision = precision;
    }

    fn set_fp8_products(&mut self, on: bool) {
        self.fp8 = on;
    }

    fn runs_on(&self, _: Device) -> bool {
        true
    }
}

impl Linear {
    /// The same layer without its activation: its backward from the pre-activation's
    /// gradient ([`Layer::backward_from_pre_activation`]).
    fn without_activation(&self) -> Linear {
        Linear {
            inputs: self.inputs,
            outputs: self.outputs,
            bias: self.bias,
            weight_init: self.weight_init,
            activation: None,
            precision: self.precision,
            fp8: self.fp8,
            fp8_shards: self.fp8_shards.clone(),
        }
    }

    /// One of the layer's products, `c = a·b` (`+=` when `accumulate`): in FP8 as `casts`
    /// says when given (`self.fp8`), else with `self.precision` inputs.
    fn product(
        &self,
        c: MatMut,
        a: Mat,
        b: Mat,
        casts: Option<[fp8::Fp8Operand; 2]>,
        accumulate: bool,
        threads: usize,
    ) {
        match casts {
            Some([a_cast, b_cast]) => {
                fp8::gemm_fp8_scaled(c, a, a_cast, b, b_cast, accumulate, threads)
            }
            None => lowp::gemm_lowp(self.precision, c, a, b, accumulate, threads),
        }
    }

    /// `amaxes` agreed with the ranks holding the other shards ([`Linear::fp8_shards`]), or
    /// as they are when this layer's tensors are whole.
    fn agreed<const N: usize>(&self, amaxes: [f32; N]) -> [f32; N] {
        let Some(shards) = &self.fp8_shards else {
            return amaxes;
        };
        let agreed = shards.agree(Tensor::from_vec(amaxes.to_vec(), &[N]));
        let agreed = agreed.to_host();
        std::array::from_fn(|i| agreed.data()[i])
    }

    /// The casts of backward's two FP8 products (`None` unless `self.fp8`), from the amaxes
    /// of the output gradient `dz`, the weight in `p` and the kept input `x` (agreed over the
    /// shards, [`Linear::fp8_shards`], in one collective).
    pub fn fp8_backward_casts(&self, p: &[f32], dz: &Tensor, x: &Kept) -> Option<Fp8BackwardCasts> {
        if !self.fp8 {
            return None;
        }
        let nw = self.inputs * self.outputs;
        let x_amax = match x {
            Kept::F32(x) => fp8::amax_parallel(x.data()),
            Kept::Half(h) => fp8::amax_bf16(h.bits()),
        };
        let amaxes = [
            fp8::amax_parallel(dz.data()),
            fp8::amax_parallel(&p[..nw]),
            x_amax,
        ];
        let [dz_amax, w_amax, x_amax] = self.agreed(amaxes);
        Some(Fp8BackwardCasts {
            dz: fp8::Fp8Operand::current(Fp8Format::E5M2, dz_amax),
            weight: fp8::Fp8Operand::current(Fp8Format::E4M3, w_amax),
            input: fp8::Fp8Operand::current(Fp8Format::E4M3, x_amax),
        })
    }

    /// The first part of backward, shared with layers that run the two products apart (a
    /// tensor-parallel layer overlaps its input gradient's reduction with the weight
    /// gradient): `dy` becomes `dz = dy·act'(z)` in place and the bias gradient is added into
    /// `g`'s bias part. Returns the saved input as it was kept: a bf16 input stays bf16, for
    /// [`Linear::weight_gradient`] reads its bits directly (an f16 one is widened here).
    pub fn backward_prologue(&self, g: &mut [f32], s: &mut Saved, dy: &mut Tensor) -> Kept {
        let act_saved = self
            .activation
            .map(|_| s.take(self.precision, "Linear (activation)"));
        let x = match s.take_kept(self.precision, "Linear") {
            Kept::Half(h) if h.dtype() != DType::BF16 => Kept::F32(h.into_tensor()),
            kept => kept,
        };
        let nw = self.inputs * self.outputs;
        let gb = &mut g[nw..];
        // One sweep per block of rows: dy becomes dz = dy·act'(z) in place, and the bias
        // gradient's column sums (in f64) are taken while the block is in cache.
        let block = LINEAR_ROWS_PER_BLOCK * self.outputs;
        let sweep = self.bias || self.activation.is_some();
        let dy_swept: &mut [f32] = if sweep { dy.data_mut() } else { &mut [] };
        let bias_partials = meshtrain_tensor::par::map_chunks_mut(dy_swept, block, |i, dz| {
            if let (Some(act), Some(saved)) = (self.activation, &act_saved) {
                act.backward_in_place_serial(&saved.data()[i * block..][..dz.len()], dz);
            }
            self.bias.then(|| {
                let mut acc = vec![0.0f64; self.outputs];
                for r in dz.chunks(self.outputs) {
                    acc.iter_mut().zip(r).for_each(|(a, v)| *a += *v as f64);
                }
                acc
            })
        });
        if let Some(saved) = act_saved {
            saved.recycle();
        }
        if self.bias {
            let mut acc = vec![0.0f64; self.outputs];
            for partial in bias_partials.into_iter().flatten() {
                acc.iter_mut().zip(partial).for_each(|(a, v)| *a += v);
            }
            gb.iter_mut().zip(acc).for_each(|(b, a)| *b += a as f32);
        }
        x
    }

    /// `dx = dz · W` for inputs of shape `input_shape` (in FP8 as `casts` says, when given:
    /// [`Linear::fp8_backward_casts`]).
    pub fn input_gradient(
        &self,
        p: &[f32],
        dz: &Tensor,
        input_shape: &[usize],
        casts: Option<&Fp8BackwardCasts>,
    ) -> Tensor {
        // Every element is written by the product (accumulate = false).
        let mut dx = meshtrain_tensor::par::take_buffer(dz.numel() / self.outputs * self.inputs);
        self.input_gradient_into(p, dz, &mut dx, casts, meshtrain_tensor::par::threads());
        Tensor::from_vec(dx, input_shape)
    }

    /// `dx = dz · W` into `dx`, on `threads` threads.
    fn input_gradient_into(
        &self,
        p: &[f32],
        dz: &Tensor,
        dx: &mut [f32],
        casts: Option<&Fp8BackwardCasts>,
        threads: usize,
    ) {
        let rows = dz.numel() / self.outputs;
        let nw = self.inputs * self.outputs;
        self.product(
            MatMut::new(dx, rows, self.inputs),
            Mat::new(dz.data(), rows, self.outputs),
            Mat::new(&p[..nw], self.outputs, self.inputs),
            casts.map(|c| [c.dz, c.weight]),
            false,
            threads,
        );
    }

    /// `dW += dzᵀ · x` (in FP8 as `casts` says, when given).
    pub fn weight_gradient(
        &self,
        g: &mut [f32],
        dz: &Tensor,
        x: &Kept,
        casts: Option<&Fp8BackwardCasts>,
    ) {
        self.weight_gradient_on(g, dz, x, casts, meshtrain_tensor::par::threads());
    }

    /// `dW += dzᵀ · x` on `threads` threads; a bf16-kept `x` is read as it is.
    fn weight_gradient_on(
        &self,
        g: &mut [f32],
        dz: &Tensor,
        x: &Kept,
        casts: Option<&Fp8BackwardCasts>,
        threads: usize,
    ) {
        let rows = x.numel() / self.inputs;
        let nw = self.inputs * self.outputs;
        let dw = MatMut::new(&mut g[..nw], self.outputs, self.inputs);
        let dz_t = Mat::new(dz.data(), rows, self.outputs).t();
        let casts = casts.map(|c| [c.dz, c.input]);
        match x {
            Kept::F32(x) => {
                let x = Mat::new(x.data(), rows, self.inputs);
                self.product(dw, dz_t, x, casts, true, threads)
            }
            Kept::Half(h) if casts.is_some() => {
                let x = h.to_f32();
                let x_mat = Mat::new(&x, rows, self.inputs);
                self.product(dw, dz_t, x_mat, casts, true, threads);
                meshtrain_tensor::par::recycle(x);
            }
            Kept::Half(h) => {
                let x = Bf16Rows::new(h.bits(), rows, self.inputs);
                lowp::gemm_bf16_rows(dw, dz_t, x, true, threads)
            }
        }
    }
}

/// 2-D convolution on CNHW activations (shape `[C, N, H, W]`), PyTorch weight layout.
pub struct Conv2d {
    pub geom: ConvGeometry,
    pub bias: bool,
    /// Inputs of the products (see [`Linear::precision`]); the input kept for backward too.
    pub precision: DType,
}

impl Conv2d {
    pub fn new(
        inputs: usize,
        outputs: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> Self {
        Conv2d {
            geom: ConvGeometry {
                in_channels: inputs,
                out_channels: outputs,
                kernel,
                stride,
                padding,
            },
            bias: true,
            precision: DType::F32,
        }
    }

    fn spatial(x: &Tensor) -> Spatial {
        Spatial {
            batch: x.dim(1),
            height: x.dim(2),
            width: x.dim(3),
        }
    }
}

impl Layer for Conv2d {
    fn set_precision(&mut self, precision: DType) {
        self.precision = precision;
    }

    fn runs_on(&self, _: Device) -> bool {
        true
    }

    fn params(&self) -> Vec<ParamSpec> {
        let g = &self.geom;
        let bound = 1.0 / (g.patch_len() as f32).sqrt();
        let mut v = vec![ParamSpec::new(
            "weight",
            &[g.out_channels, g.in_channels, g.kernel, g.kernel],
            Init::Uniform(bound),
        )];
        if self.bias {
            v.push(ParamSpec::new(
                "bias",
                &[g.out_channels],
                Init::Uniform(bound),
            ));
        }
        v
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        assert_eq!(x.dim(0), self.geom.in_channels, "Conv2d: channel mismatch");
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::convnet::conv_forward(self, p, x, mode, s);
        }
        let p = p.host();
        let sp = Self::spatial(&x);
        let nw = self.geom.out_channels * self.geom.patch_len();
        let bias = self.bias.then(|| &p[nw..]);
        let (y, columns) = conv2d_forward(
            &self.geom,
            sp,
            x.data(),
            &p[..nw],
            bias,
            mode.train,
            self.precision,
        );
        let (oh, ow) = self.geom.output_size(sp.height, sp.width);
        if mode.train {
            s.keep(x, self.precision);
            // The columns (and gathered weights) only ever feed products: under mixed
            // precision they are kept in 16 bits like the input.
            if let Some(c) = columns {
                let len = c.len();
                s.keep(Tensor::from_vec(c, &[len]), self.precision);
            }
        }
        Tensor::from_vec(y, &[self.geom.out_channels, sp.batch, oh, ow])
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::convnet::conv_backward(self, p, g, s, dy, need_dx);
        }
        let p = p.host();
        let g = g.host();
        let columns = self
            .geom
            .keeps_columns()
            .then(|| s.take(self.precision, "Conv2d (columns)").into_vec());
        let x = s.take(self.precision, "Conv2d");
        let nw = self.geom.out_channels * self.geom.patch_len();
        let (gw, gb) = g.split_at_mut(nw);
        let dbias = if self.bias { Some(gb) } else { None };
        let sp = Self::spatial(&x);
        let dx = conv2d_backward(
            &self.geom,
            sp,
            x.data(),
            columns.as_deref(),
            &p[..nw],
            dy.data(),
            gw,
            dbias,
            need_dx,
            self.precision,
        );
        // The columns came from the thread's buffer pool: hand them back for the next step.
        if let Some(c) = columns {
            meshtrain_tensor::par::recycle(c);
        }
        let dx = dx.map(|dx| Tensor::from_vec(dx, x.shape()));
        x.recycle();
        dy.recycle();
        dx
    }
}

/// Batch norm over CNHW activations (or `[C, N]`), PyTorch semantics: biased batch variance
/// to normalise, unbiased variance in the running estimate, momentum 0.1, eps 1e-5.
///
/// With a [`StatsReducer`] it is SyncBatchNorm: the per-channel sums (and counts) of the
/// forward and the gradient sums of the backward are added up over all data-parallel workers,
/// so N workers with batch B/N each normalise exactly as one worker with batch B does.
pub struct BatchNorm2d {
    pub channels: usize,
    pub eps: f32,
    pub momentum: f32,
    sync: Option<Arc<dyn StatsReducer>>,
}

impl BatchNorm2d {
    pub fn new(channels: usize) -> Self {
        BatchNorm2d {
            channels,
            eps: 1e-5,
            momentum: 0.1,
            sync: None,
        }
    }

    /// Sums `[a, b]` pairs per channel plus a trailing count over the workers (or returns
    /// them unchanged without a reducer).
    fn reduce(&self, sums: Vec<[f64; 2]>, count: usize) -> (Vec<[f64; 2]>, usize) {
        let Some(reducer) = &self.sync else {
            return (sums, count);
        };
        let mut flat: Vec<f64> = sums.iter().flatten().copied().collect();
        flat.push(count as f64);
        reducer.sum(&mut flat);
        let count = flat.pop().expect("count") as usize;
        (flat.chunks(2).map(|p| [p[0], p[1]]).collect(), count)
    }

    /// SyncBatchNorm's reducer, when one is installed.
    pub fn reducer(&self) -> Option<&Arc<dyn StatsReducer>> {
        self.sync.as_ref()
    }
}

impl Layer for BatchNorm2d {
    fn runs_on(&self, _: Device) -> bool {
        true
    }

    fn params(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("weight", &[self.channels], Init::Ones),
            ParamSpec::new("bias", &[self.channels], Init::Zeros),
        ]
    }
    fn buffers(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("running_mean", &[self.channels], Init::Zeros),
            ParamSpec::new("running_var", &[self.channels], Init::Ones),
        ]
    }

    fn forward(
        &self,
        p: Params<'_>,
        b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::convnet::batch_norm_forward(self, p, b, x, mode, s);
        }
        let p = p.host();
        let b = b.host();
        let c = self.channels;
        let (gamma, beta) = p.split_at(c);
        let mut count = x.numel() / c;
        let (mean, var) = if mode.train {
            let (sums, total) = self.reduce(norm::channel_sums(x.data(), c), count);
            count = total;
            let (mean, var) = norm::moments_from_sums(&sums, count);
            if mode.update_stats {
                let (rm, rv) = b.split_at_mut(c);
                let unbias = count as f32 / (count.max(2) - 1) as f32;
                for i in 0..c {
                    rm[i] = (1.0 - self.momentum) * rm[i] + self.momentum * mean[i];
                    rv[i] = (1.0 - self.momentum) * rv[i] + self.momentum * var[i] * unbias;
                }
            }
            (mean, var)
        } else {
            (b[..c].to_vec(), b[c..].to_vec())
        };
        let (y, xhat) = norm::batch_norm_apply(x.data(), &mean, &var, self.eps, gamma, beta);
        if mode.train {
            s.tensors.push(Tensor::from_vec(xhat, x.shape()));
            s.stats.push(var);
            s.indices.push(vec![count as u32]);
        }
        Tensor::from_vec(y, x.shape())
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::convnet::batch_norm_backward(self, p, g, s, dy, need_dx);
        }
        let p = p.host();
        let g = g.host();
        let c = self.channels;
        let xhat = s.tensors.pop().expect("BatchNorm: saved xhat");
        let var = s.stats.pop().expect("BatchNorm: saved var");
        let count = s.indices.pop().expect("BatchNorm: saved count")[0] as usize;
        let sums = norm::batch_norm_grad_sums(dy.data(), xhat.data(), c);
        // Parameter gradients use the local sums: data parallelism averages them afterwards.
        let (dgamma, dbeta) = g.split_at_mut(c);
        for i in 0..c {
            dgamma[i] += sums[i][1] as f32;
            dbeta[i] += sums[i][0] as f32;
        }
        if !need_dx {
            return None;
        }
        let (sums, _) = self.reduce(sums, 0);
        let dx = norm::batch_norm_input_grad(
            dy.data(),
            xhat.data(),
            &var,
            self.eps,
            &p[..c],
            &sums,
            count,
        );
        Some(Tensor::from_vec(dx, dy.shape()))
    }

    fn set_stats_reducer(&mut self, reducer: Option<Arc<dyn StatsReducer>>) {
        self.sync = reducer;
    }
}

/// Layer norm over the last dimension.
pub struct LayerNorm {
    pub dim: usize,
    pub eps: f32,
    /// The dtype of the output on a GPU: the mixed-precision product dtype, since what reads
    /// a norm's output is a product, which rounds its input to it anyway (on the CPU the
    /// output stays f32 and the product rounds it). Statistics are f32 either way.
    pub precision: DType,
}

impl LayerNorm {
    pub fn new(dim: usize) -> Self {
        LayerNorm {
            dim,
            eps: 1e-5,
            precision: DType::F32,
        }
    }
}

/// The device forward of a norm (`crate::device::layer_norm_forward`, `rms_norm_forward`):
/// `(the rows normalised, y)` of `x`, or of `x + add` with the add in the norm's kernel.
#[cfg(feature = "cuda")]
type DeviceNormForward<L> = fn(
    &L,
    meshtrain_tensor::cuda::DeviceParams<'_>,
    &Tensor,
    Option<&Tensor>,
    Mode,
    &mut Saved,
) -> (Tensor, Tensor);

/// A norm's [`Layer::add_then_forward`]: on a GPU the residual add runs in the norm's kernel
/// (`device_forward` given the branch), and the stream becomes the sum it wrote; on the CPU,
/// the default.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn norm_add_then_forward<L: Layer>(
    norm: &L,
    p: Params<'_>,
    b: ParamsMut<'_>,
    stream: &mut Tensor,
    branch: Tensor,
    mode: Mode,
    s: &mut Saved,
    device_forward: DeviceNormForward<L>,
) -> Tensor {
    if let Params::Device(p) = p {
        let (sum, y) = device_forward(norm, p, stream, Some(&branch), mode, s);
        *stream = sum;
        return y;
    }
    crate::layer::add_then_forward(norm, p, b, stream, branch, mode, s)
}

/// A norm's [`Layer::backward_add_into`]: on a GPU `device_backward` adds the input gradient
/// into the stream's inside its kernel (given the stream's gradient to add into); on the
/// CPU, the default.
#[cfg(feature = "cuda")]
fn norm_backward_add_into<L: Layer>(
    norm: &L,
    p: Params<'_>,
    g: ParamsMut<'_>,
    s: Saved,
    dy: Tensor,
    dx: &mut Tensor,
    device_backward: fn(
        &L,
        meshtrain_tensor::cuda::DeviceParams<'_>,
        ParamsMut<'_>,
        Saved,
        Tensor,
        Option<Tensor>,
    ) -> Tensor,
) {
    if let Params::Device(p) = p {
        let into = std::mem::replace(dx, Tensor::from_vec(Vec::new(), &[0]));
        *dx = device_backward(norm, p, g, s, dy, Some(into));
        return;
    }
    crate::layer::add_backward_into(norm, p, g, s, dy, dx);
}

impl Layer for LayerNorm {
    fn params(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("weight", &[self.dim], Init::Ones),
            ParamSpec::new("bias", &[self.dim], Init::Zeros),
        ]
    }

    fn set_precision(&mut self, precision: DType) {
        self.precision = precision;
    }

    fn runs_on(&self, _: Device) -> bool {
        true
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::layer_norm_forward(self, p, &x, None, mode, s).1;
        }
        let p = p.host();
        let (gamma, beta) = p.split_at(self.dim);
        let (y, mean, rstd) = norm::layer_norm_forward(x.data(), self.dim, gamma, beta, self.eps);
        let shape = x.shape().to_vec();
        if mode.train {
            s.tensors.push(x);
            s.stats.push(mean);
            s.stats.push(rstd);
        }
        Tensor::from_vec(y, &shape)
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _need_dx: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return Some(crate::device::layer_norm_backward(self, p, g, s, dy, None));
        }
        let p = p.host();
        let g = g.host();
        let rstd = s.stats.pop().expect("LayerNorm: rstd");
        let mean = s.stats.pop().expect("LayerNorm: mean");
        let x = s.tensors.pop().expect("LayerNorm: input");
        let (dgamma, dbeta) = g.split_at_mut(self.dim);
        let dx = norm::layer_norm_backward(
            x.data(),
            self.dim,
            &p[..self.dim],
            &mean,
            &rstd,
            dy.data(),
            dgamma,
            dbeta,
        );
        let shape = x.shape().to_vec();
        x.recycle();
        dy.recycle();
        Some(Tensor::from_vec(dx, &shape))
    }

    /// On a GPU the input gradient is added into `dx` by the backward kernel itself.
    #[cfg(feature = "cuda")]
    fn backward_add_into(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        dx: &mut Tensor,
    ) {
        norm_backward_add_into(self, p, g, s, dy, dx, crate::device::layer_norm_backward);
    }

    /// On a GPU the residual add before the norm runs in the norm's forward kernel.
    #[cfg(feature = "cuda")]
    fn add_then_forward(
        &self,
        p: Params<'_>,
        b: ParamsMut<'_>,
        stream: &mut Tensor,
        branch: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        norm_add_then_forward(
            self,
            p,
            b,
            stream,
            branch,
            mode,
            s,
            crate::device::layer_norm_forward,
        )
    }
}

/// RMS norm over the last dimension (Llama's norm): `x / √(mean(x²) + eps) · weight`, no
/// bias and no mean subtraction.
pub struct RmsNorm {
    pub dim: usize,
    pub eps: f32,
    /// The dtype of the output on a GPU, as [`LayerNorm::precision`]: the mixed-precision
    /// product dtype (what reads the norm's output is a product). The CPU keeps f32.
    pub precision: DType,
}

impl RmsNorm {
    pub fn new(dim: usize, eps: f32) -> Self {
        RmsNorm {
            dim,
            eps,
            precision: DType::F32,
        }
    }
}

impl Layer for RmsNorm {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        // Hugging Face export reads its epsilon.
        Some(self)
    }

    fn params(&self) -> Vec<ParamSpec> {
        vec![ParamSpec::new("weight", &[self.dim], Init::Ones)]
    }

    fn set_precision(&mut self, precision: DType) {
        self.precision = precision;
    }

    fn runs_on(&self, _: Device) -> bool {
        true
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::rms_norm_forward(self, p, &x, None, mode, s).1;
        }
        let (y, rstd) = norm::rms_norm_forward(x.data(), self.dim, p.host(), self.eps);
        let shape = x.shape().to_vec();
        if mode.train {
            s.tensors.push(x);
            s.stats.push(rstd);
        }
        Tensor::from_vec(y, &shape)
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _need_dx: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return Some(crate::device::rms_norm_backward(self, p, g, s, dy, None));
        }
        let rstd = s.stats.pop().expect("RmsNorm: rstd");
        let x = s.tensors.pop().expect("RmsNorm: input");
        let dx = norm::rms_norm_backward(x.data(), self.dim, p.host(), &rstd, dy.data(), g.host());
        let shape = x.shape().to_vec();
        x.recycle();
        dy.recycle();
        Some(Tensor::from_vec(dx, &shape))
    }

    /// On a GPU the input gradient is added into `dx` by the backward kernel itself.
    #[cfg(feature = "cuda")]
    fn backward_add_into(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        dx: &mut Tensor,
    ) {
        norm_backward_add_into(self, p, g, s, dy, dx, crate::device::rms_norm_backward);
    }

    /// On a GPU the residual add before the norm runs in the norm's forward kernel.
    #[cfg(feature = "cuda")]
    fn add_then_forward(
        &self,
        p: Params<'_>,
        b: ParamsMut<'_>,
        stream: &mut Tensor,
        branch: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        norm_add_then_forward(
            self,
            p,
            b,
            stream,
            branch,
            mode,
            s,
            crate::device::rms_norm_forward,
        )
    }
}

/// SwiGLU over the last dimension: `[a | b]` → `silu(a)·b`, halving the width. After a
/// column-parallel `[gate | up]` projection split in two groups, each rank's input is its own
/// `[gate | up]` pair, so the layer needs no tensor-parallel form.
pub struct SwiGlu;

impl Layer for SwiGlu {
    fn runs_on(&self, _: Device) -> bool {
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
        let mut shape = x.shape().to_vec();
        let width = *shape.last().expect("SwiGLU: a shaped input");
        assert!(width.is_multiple_of(2), "SwiGLU: odd width {width}");
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::device::swiglu_forward(x, mode, s);
        }
        *shape.last_mut().unwrap() = width / 2;
        let y = meshtrain_tensor::activation::swiglu_forward(x.data(), width / 2);
        if mode.train {
            s.tensors.push(x);
        }
        Tensor::from_vec(y, &shape)
    }

    fn backward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        let x = s.tensors.pop().expect("SwiGLU: saved input");
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return Some(crate::device::swiglu_backward(x, dy));
        }
        let half = x.shape().last().copied().unwrap_or(0) / 2;
        let dx = meshtrain_tensor::activation::swiglu_backward(x.data(), dy.data(), half);
        let shape = x.shape().to_vec();
        x.recycle();
        dy.recycle();
        Some(Tensor::from_vec(dx, &shape))
    }
}

/// An element-wise activation.
pub struct Act(pub Activation);

impl Layer for Act {
    fn runs_on(&self, _: Device) -> bool {
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
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::device::act_forward(self.0, x, mode, s);
        }
        let mut y = Tensor::for_overwrite(x.shape());
        self.0.forward(x.data(), y.data_mut());
        if mode.train {
            s.tensors.push(if self.0.backward_uses_output() {
                y.clone()
            } else {
                x
            });
        }
        y
    }

    fn backward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        let kept = s.tensors.pop().expect("Act: saved tensor");
        #[cfg(feature = "cuda")]
        if kept.device().is_cuda() {
            return Some(crate::device::act_backward(self.0, kept, dy));
        }
        let mut dx = dy;
        self.0.backward_in_place(kept.data(), dx.data_mut());
        kept.recycle();
        Some(dx)
    }
}

/// Pooling kinds over the planes of a `[C, N, H, W]` activation.
#[derive(Clone, Copy, Debug)]
pub enum PoolKind {
    Max,
    Avg,
}

pub struct Pool2d {
    pub kind: PoolKind,
    pub geom: PoolGeometry,
}

impl Pool2d {
    pub fn max(kernel: usize, stride: usize, padding: usize) -> Self {
        Pool2d {
            kind: PoolKind::Max,
            geom: PoolGeometry {
                kernel,
                stride,
                padding,
            },
        }
    }
    pub fn avg(kernel: usize, stride: usize) -> Self {
        Pool2d {
            kind: PoolKind::Avg,
            geom: PoolGeometry {
                kernel,
                stride,
                padding: 0,
            },
        }
    }
}

impl Layer for Pool2d {
    fn runs_on(&self, _: Device) -> bool {
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
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::device::convnet::pool_forward(self, x, mode, s);
        }
        let (c, n, h, w) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
        let (oh, ow) = self.geom.output_size(h, w);
        let y = match self.kind {
            PoolKind::Max => {
                let (y, arg) = pool::max_pool_forward(&self.geom, c * n, h, w, x.data());
                if mode.train {
                    s.indices.push(arg);
                }
                y
            }
            PoolKind::Avg => pool::avg_pool_forward(&self.geom, c * n, h, w, x.data()),
        };
        if mode.train {
            s.stats.push(vec![h as f32, w as f32]);
        }
        Tensor::from_vec(y, &[c, n, oh, ow])
    }

    fn backward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        // The device arm keeps the whole input shape (4 numbers), the CPU's the plane's (2):
        // backward follows what forward kept, whatever device `dy` arrives on.
        #[cfg(feature = "cuda")]
        if s.stats.last().is_some_and(|shape| shape.len() == 4) {
            return Some(crate::device::convnet::pool_backward(self, s, dy));
        }
        let hw = s.stats.pop().expect("Pool: saved size");
        let (h, w) = (hw[0] as usize, hw[1] as usize);
        let (c, n) = (dy.dim(0), dy.dim(1));
        let dx = match self.kind {
            PoolKind::Max => {
                let arg = s.indices.pop().expect("MaxPool: saved argmax");
                pool::max_pool_backward(h, w, dy.dim(2) * dy.dim(3), &arg, dy.data())
            }
            PoolKind::Avg => pool::avg_pool_backward(&self.geom, h, w, dy.data()),
        };
        Some(Tensor::from_vec(dx, &[c, n, h, w]))
    }
}

/// NCHW input → CNHW, the layout of meshtrain's convolutional layers.
pub struct ToChannelMajor;

impl Layer for ToChannelMajor {
    fn runs_on(&self, _: Device) -> bool {
        true
    }

    /// On a GPU (device parameters: the model's other layers live there) the host batch is
    /// uploaded here, the model's first layer.
    fn forward(
        &self,
        p: Params<'_>,
        _: ParamsMut<'_>,
        x: Tensor,
        _: Mode,
        _: &mut Saved,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if let Params::Device(p) = p {
            return crate::device::convnet::to_channel_major_forward(x, p.device());
        }
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let dev = x.cuda().expect("a device tensor").device().clone();
            return crate::device::convnet::to_channel_major_forward(x, &dev);
        }
        let _ = p;
        let (n, c, h, w) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
        let data = if c == 1 {
            x.into_vec()
        } else {
            swap_leading_axes(x.data(), n, c, h * w)
        };
        Tensor::from_vec(data, &[c, n, h, w])
    }
    fn backward(
        &self,
        _: Params<'_>,
        _: ParamsMut<'_>,
        _: Saved,
        dy: Tensor,
        _: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if dy.device().is_cuda() {
            return Some(crate::device::convnet::to_channel_major_backward(dy));
        }
        let (c, n, h, w) = (dy.dim(0), dy.dim(1), dy.dim(2), dy.dim(3));
        Some(Tensor::from_vec(
            swap_leading_axes(dy.data(), c, n, h * w),
            &[n, c, h, w],
        ))
    }
}

/// CNHW `[C, N, H, W]` → `[N, C·H·W]` in PyTorch's flatten order (c, h, w), optionally
/// averaging over H×W first (global average pooling → `[N, C]`).
pub struct Flatten {
    pub global_average: bool,
}

impl Layer for Flatten {
    fn runs_on(&self, _: Device) -> bool {
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
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::device::convnet::flatten_forward(self, x, mode, s);
        }
        let (c, n, h, w) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
        if mode.train {
            s.stats.push(vec![c as f32, n as f32, h as f32, w as f32]);
        }
        if self.global_average {
            let inv = 1.0 / (h * w) as f32;
            let mut y = vec![0.0f32; n * c];
            for ci in 0..c {
                for ni in 0..n {
                    let plane = &x.data()[(ci * n + ni) * h * w..][..h * w];
                    y[ni * c + ci] = plane.iter().sum::<f32>() * inv;
                }
            }
            Tensor::from_vec(y, &[n, c])
        } else {
            Tensor::from_vec(swap_leading_axes(x.data(), c, n, h * w), &[n, c * h * w])
        }
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
            return Some(crate::device::convnet::flatten_backward(self, s, dy));
        }
        let d = s.stats.pop().expect("Flatten: saved shape");
        let (c, n, h, w) = (d[0] as usize, d[1] as usize, d[2] as usize, d[3] as usize);
        let dx = if self.global_average {
            let inv = 1.0 / (h * w) as f32;
            let mut dx = vec![0.0f32; c * n * h * w];
            for ci in 0..c {
                for ni in 0..n {
                    let v = dy.data()[ni * c + ci] * inv;
                    dx[(ci * n + ni) * h * w..][..h * w].fill(v);
                }
            }
            dx
        } else {
            swap_leading_axes(dy.data(), n, c, h * w)
        };
        Some(Tensor::from_vec(dx, &[c, n, h, w]))
    }
}
