//! Text generation from a causal language model (GPT, Llama and the families built on their
//! blocks, or a model of your own whose position-reading layers have a cached forward):
//! what `meshtrain generate` and the training log's samples run, and what a program using the
//! library calls.
//!
//! A [`Decoder`] runs the model's own layers ([`Model::forward_cached`]) with a key/value
//! cache ([`KvCache`]): the prompt is one pass (a prefill), then each new token one row
//! through every layer and its attention over the cache. There is no second copy of any
//! model's arithmetic: a family's block is its layers, for training and generation, on the
//! host and on a GPU (the layers' device arms, with the weights, the cache and every
//! activation in device memory, in f32; only the logits come back).
//!
//! [`NextLogits`] says where each next token's logits come from (the cache, the cache beside
//! the CPU's to compare devices, or a forward over the whole window per token), [`sample`]
//! draws a token with temperature and top-k, and [`continue_text`] is the loop.

use crate::cache::KvCache;
use crate::layer::{Mode, Params, ParamsMut};
use crate::model::{InputKind, Model, ParamStore};
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::{Device, Tensor};

/// Why generation could not go on: a message that names what to change.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct GenerateError(pub String);

fn fail<T>(message: impl Into<String>) -> Result<T, GenerateError> {
    Err(GenerateError(message.into()))
}

/// Where the decoder's weights live.
enum Weights<'m> {
    /// The model's flat parameters, borrowed.
    Host(&'m [f32]),
    /// Uploaded to a GPU (f32).
    #[cfg(feature = "cuda")]
    Device(meshtrain_tensor::cuda::CudaTensor),
}

/// A causal language model that decodes one token at a time, keeping every attention layer's
/// keys and values of the positions so far, on the host or a GPU. [`Decoder::prefill`]
/// starts a text, [`Decoder::step`] adds a token; both return the logits of the next token.
pub struct Decoder<'m> {
    model: &'m Model,
    weights: Weights<'m>,
    vocab: usize,
    /// The model's context: positions run `0..seq`.
    seq: usize,
    /// The tokens whose keys and values the cache holds: token `i` is at position `i`.
    tokens: Vec<u32>,
    cache: KvCache,
}

impl<'m> Decoder<'m> {
    /// The decoder of `model` (a language model: its input declared as tokens) with the
    /// parameters `values` (the model's flat buffer), on the host.
    pub fn new(model: &'m Model, values: &'m [f32]) -> Result<Self, GenerateError> {
        Self::on(Device::Cpu, model, values)
    }

    /// [`Decoder::new`] on `device`: on a GPU the weights are uploaded, and the cache (room
    /// for the whole context) and every activation live in its memory; the logits come back
    /// to the host. Fails before any work when the GPU cannot be used (naming what is
    /// missing), or when this build has no CUDA backend. One token runs through the model
    /// before it returns, so the kernels are compiled and loaded (a failing one fails here,
    /// not during the first timed token).
    pub fn on(device: Device, model: &'m Model, values: &'m [f32]) -> Result<Self, GenerateError> {
        let (vocab, seq) = match model.input() {
            Some(input) => match input.kind {
                InputKind::Tokens { vocab } => (vocab, input.sample_len()),
                InputKind::Float => {
                    return fail(
                        "the decoder takes a language model (tokens in), not an image model",
                    )
                }
            },
            None => {
                return fail(
                    "the model does not declare its input: a language model says \
                     `with_input(InputSpec::tokens(seq, vocab))`",
                )
            }
        };
        if values.len() != model.num_params() {
            return fail(format!(
                "{} parameter values for a model of {}",
                values.len(),
                model.num_params()
            ));
        }
        if model.num_buffers() > 0 {
            return fail(
                "the model has buffers (batch norm's running statistics): not a language \
                 model the decoder runs",
            );
        }
        let weights = match device {
            Device::Cpu => Weights::Host(values),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                if let Some(block) = model.blocks.iter().find(|b| !b.layer.runs_on(device)) {
                    return fail(format!(
                        "block '{}' has no CUDA kernels (Layer::runs_on): generate with \
                         --device cpu",
                        block.name
                    ));
                }
                let dev = open_gpu(ordinal)?;
                check_gpu_context(model, seq)?;
                let upload = meshtrain_tensor::cuda::CudaTensor::from_host(
                    &dev,
                    values,
                    meshtrain_tensor::DType::F32,
                );
                Weights::Device(upload.map_err(|e| {
                    GenerateError(format!("uploading the weights to cuda:{ordinal}: {e}"))
                })?)
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                check_device(device)?;
                unreachable!("check_device refuses a GPU without the CUDA backend")
            }
        };
        let mut decoder = Decoder {
            model,
            weights,
            vocab,
            seq,
            tokens: Vec::new(),
            cache: KvCache::new(seq),
        };
        if !matches!(decoder.weights, Weights::Host(_)) {
            decoder
                .prefill(&[0])
                .map_err(|e| GenerateError(format!("a first token through the model: {e}")))?;
            decoder.tokens.clear();
            decoder.cache.truncate(0);
        }
        Ok(decoder)
    }

    /// Where the model runs: "cpu", or the GPU ("cuda:0 (its name)").
    pub fn device(&self) -> String {
        match &self.weights {
            Weights::Host(_) => Device::Cpu.to_string(),
            #[cfg(feature = "cuda")]
            Weights::Device(t) => format!("cuda:{} ({})", t.device().ordinal(), t.device().name()),
        }
    }

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

    /// The f32 values the cache holds: every attention layer's keys and values of every
    /// position, `2 · kv_heads · head_dim` per layer and position.
    pub fn cache_len(&self) -> usize {
        self.cache.values_held()
    }

    /// Starts a text: the cache is emptied and filled with `tokens` (at most the model's
    /// context) at positions `0..`; returns the logits of the token after the last.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>, GenerateError> {
        self.check_prefill(tokens)?;
        self.extend(tokens, false)
    }

    /// [`Decoder::prefill`] returning the logits after every token, `[tokens.len(), vocab]`
    /// (what a forward over `tokens` gives; for checking the decoder against one).
    pub fn prefill_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>, GenerateError> {
        self.check_prefill(tokens)?;
        self.extend(tokens, true)
    }

    /// Adds `token` after the cached ones and returns the logits of the token after it.
    ///
    /// When the cache already holds the model's whole context (`seq` tokens), the text goes
    /// on in a window of its last tokens, as the model's forward must see it (that forward
    /// over the window takes the last `seq` at every token): the decoder re-prefills from
    /// the last `seq/2` tokens (this one included), which are then the context until the
    /// window fills again. Why not slide by one: dropping the oldest token changes the
    /// hidden states of every later position (they attended to it), so no cached key or
    /// value stays valid, and learned positions (< `seq`) must restart at 0; recomputing
    /// half a window every `seq/2` tokens costs about one extra token's forward per token,
    /// where recomputing the whole window at every token would cost `seq`. The same for
    /// rotary positions, which could run on, so that every model sees the same contexts.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>, GenerateError> {
        self.check_tokens(&[token])?;
        if self.tokens.len() >= self.seq {
            let keep = (self.seq / 2).max(1);
            let mut window = self.tokens[self.tokens.len() + 1 - keep..].to_vec();
            window.push(token);
            return self.prefill(&window);
        }
        self.extend(&[token], false)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), GenerateError> {
        match tokens.iter().find(|&&t| t as usize >= self.vocab) {
            Some(t) => fail(format!(
                "token {t} is outside the model's vocabulary of {}",
                self.vocab
            )),
            None => Ok(()),
        }
    }

    fn check_prefill(&mut self, tokens: &[u32]) -> Result<(), GenerateError> {
        if tokens.is_empty() {
            return fail("nothing to prefill: no tokens");
        }
        if tokens.len() > self.seq {
            return fail(format!(
                "{} tokens to prefill, but the model's context is {}: give the last {}",
                tokens.len(),
                self.seq,
                self.seq
            ));
        }
        self.check_tokens(tokens)?;
        self.tokens.clear();
        self.cache.truncate(0);
        Ok(())
    }

    /// Runs `tokens` (checked: in the vocabulary, fitting the context) through the model at
    /// the positions after the cached ones; the logits of the last row, or of every row when
    /// `all`. A failure (a device's) leaves an empty cache: the next text starts afresh.
    fn extend(&mut self, tokens: &[u32], all: bool) -> Result<Vec<f32>, GenerateError> {
        debug_assert!(self.tokens.len() + tokens.len() <= self.seq);
        let x = Tensor::from_vec(
            tokens.iter().map(|&t| t as f32).collect(),
            &[1, tokens.len()],
        );
        let (model, cache) = (self.model, &mut self.cache);
        let logits = match &self.weights {
            Weights::Host(values) => model
                .forward_cached(
                    Params::Host(values),
                    ParamsMut::Host(&mut []),
                    x,
                    cache,
                    all,
                )
                .map(|y| y.data().to_vec())
                .map_err(GenerateError),
            #[cfg(feature = "cuda")]
            Weights::Device(values) => {
                let pass = || {
                    // SAFETY: the buffer holds the model's parameters and outlives the pass.
                    let params = unsafe {
                        meshtrain_tensor::cuda::DeviceParams::new(
                            values.device(),
                            values.ptr(),
                            None,
                            values.len(),
                        )
                    };
                    model
                        .forward_cached(
                            Params::Device(params),
                            ParamsMut::Host(&mut []),
                            x,
                            cache,
                            all,
                        )
                        .map(|y| y.to_host().data().to_vec())
                };
                match meshtrain_tensor::cuda::error::catch(pass) {
                    Ok(Ok(logits)) => Ok(logits),
                    Ok(Err(e)) => Err(GenerateError(e)),
                    Err(e) => Err(GenerateError(format!("decoding on {}: {e}", self.device()))),
                }
            }
        };
        match logits {
            Ok(logits) => {
                self.tokens.extend_from_slice(tokens);
                Ok(logits)
            }
            Err(e) => {
                self.tokens.clear();
                self.cache.truncate(0);
                Err(e)
            }
        }
    }
}

/// Checks that `device` can be used (a GPU's driver and libraries, or that this build has
/// the CUDA backend) before anything is read or copied, naming what is missing.
pub fn check_device(device: Device) -> Result<(), GenerateError> {
    match device {
        Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => open_gpu(ordinal).map(|_| ()),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => fail(format!(
            "--device {device}: this meshtrain was built without the CUDA backend (the `cuda` \
             feature); rebuild with default features, or generate with --device cpu"
        )),
    }
}

/// GPU `ordinal`, its libraries checked first: without a driver (or NVRTC, cuBLASLt, the
/// CUDA headers) the error names what is missing, before any weight is copied.
#[cfg(feature = "cuda")]
pub fn open_gpu(
    ordinal: usize,
) -> Result<std::sync::Arc<meshtrain_tensor::cuda::CudaDevice>, GenerateError> {
    meshtrain_tensor::cuda::CudaDevice::get(ordinal).map_err(|e| {
        GenerateError(format!(
            "generating on cuda:{ordinal} (without a GPU, generate with --device cpu): {e}"
        ))
    })
}

/// The GPU decoder's attention keeps a row's scores in shared memory: a context longer
/// than it takes at the model's head size is refused before any work.
#[cfg(feature = "cuda")]
fn check_gpu_context(model: &Model, seq: usize) -> Result<(), GenerateError> {
    fn head_dims(layer: &dyn crate::Layer, out: &mut Vec<usize>) {
        if let Some(a) = layer
            .as_any()
            .and_then(|a| a.downcast_ref::<crate::transformer::AttentionCore>())
        {
            out.push(a.dim / a.heads);
        }
        for (_, child) in layer.children().map(|c| c.layers()).unwrap_or(&[]) {
            head_dims(child.as_ref(), out);
        }
    }
    let mut dims = Vec::new();
    for block in &model.blocks {
        head_dims(block.layer.as_ref(), &mut dims);
    }
    for hd in dims {
        let most = meshtrain_tensor::cuda::decode::max_positions(hd);
        if seq > most {
            return fail(format!(
                "a context of {seq} positions at head size {hd}: the GPU decoder's attention \
                 takes at most {most} (generate with --device cpu)"
            ));
        }
    }
    Ok(())
}

/// The index of the token drawn from `logits` at `temperature` among the `top_k` likeliest
/// (`top_k` 0: all; `temperature` 0: always the likeliest).
pub fn sample(logits: &[f32], temperature: f32, top_k: usize, rng: &mut SplitMix64) -> usize {
    // Likeliest first, equal logits in index order: a total order, so the k likeliest are one
    // set however they are found. Only those k are sorted (a BPE vocabulary's 50,257 sorted
    // for every token cost more than the 4-layer model's step), with the draws of a full sort.
    let before = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    if temperature <= 0.0 {
        return (0..logits.len())
            .min_by(before)
            .expect("logits to sample from");
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    if top_k > 0 && top_k < order.len() {
        order.select_nth_unstable_by(top_k - 1, before);
        order.truncate(top_k);
    }
    order.sort_unstable_by(before);
    draw(&order, logits, temperature, rng)
}

/// One draw among `order` (indices of `logits`, likeliest first), each weighted by
/// `exp((logit − top) / temperature)`.
fn draw(order: &[usize], logits: &[f32], temperature: f32, rng: &mut SplitMix64) -> usize {
    let top = logits[order[0]];
    let weights: Vec<f64> = (order.iter())
        .map(|&i| (f64::from(logits[i] - top) / f64::from(temperature)).exp())
        .collect();
    let mut left = rng.next_f64() * weights.iter().sum::<f64>();
    for (&i, w) in order.iter().zip(&weights) {
        if left < *w {
            return i;
        }
        left -= w;
    }
    order[order.len() - 1]
}

/// How tokens are drawn (see [`sample`]).
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    pub temperature: f32,
    pub top_k: usize,
    pub seed: u64,
}

/// What generation needs of a tokenizer: which logits may be drawn, and what a drawn one is.
pub trait TokenChoice {
    /// The logits of the tokens a sample may be, in candidate order (a padded vocabulary's
    /// extra rows and unused special ids left out).
    fn candidates(&self, logits: &[f32]) -> Vec<f32>;

    /// The token candidate `index` stands for, or `None` for the end of text.
    fn token(&self, candidate: usize) -> Option<u32>;
}

/// Every id is a token; none ends the text.
pub struct AllTokens;

impl TokenChoice for AllTokens {
    fn candidates(&self, logits: &[f32]) -> Vec<f32> {
        logits.to_vec()
    }

    fn token(&self, candidate: usize) -> Option<u32> {
        Some(candidate as u32)
    }
}

/// Where each next token's logits come from.
pub enum NextLogits<'a> {
    /// The key/value cache: the prompt prefilled (its last `seq` tokens), then a step per
    /// token.
    Cached(Box<Decoder<'a>>),
    /// The key/value cache on a device (whose logits are used) and the CPU's, fed the same
    /// tokens, their logits compared.
    Compared {
        decoder: Box<Decoder<'a>>,
        cpu: Box<Decoder<'a>>,
        compared: Comparison,
    },
    /// A forward of the whole model over the last `seq` tokens for every token.
    Window {
        model: &'a Model,
        store: &'a mut ParamStore,
        vocab: usize,
        seq: usize,
    },
}

impl NextLogits<'_> {
    /// The logits of the token after `tokens`; `first`: the first call for this text (the
    /// others add one token to the previous call's).
    pub fn after(&mut self, tokens: &[u32], first: bool) -> Result<Vec<f32>, GenerateError> {
        let cached = |decoder: &mut Decoder| match (first, tokens.last()) {
            (false, Some(&last)) => decoder.step(last),
            _ => decoder.prefill(&tokens[tokens.len().saturating_sub(decoder.seq())..]),
        };
        match self {
            NextLogits::Cached(decoder) => cached(decoder),
            NextLogits::Compared {
                decoder,
                cpu,
                compared,
            } => {
                let got = cached(decoder)?;
                compared.add(&got, &cached(cpu)?);
                Ok(got)
            }
            NextLogits::Window {
                model,
                store,
                vocab,
                seq,
            } => {
                let window = &tokens[tokens.len().saturating_sub(*seq)..];
                let x = Tensor::from_vec(
                    window.iter().map(|&t| t as f32).collect(),
                    &[1, window.len()],
                );
                let (logits, _) = model.forward_all(store, x, Mode::EVAL);
                let logits = logits.data();
                Ok(logits[logits.len() - *vocab..].to_vec())
            }
        }
    }
}

/// Two devices' logits over the steps of a text.
#[derive(Clone, Copy, Debug, Default)]
pub struct Comparison {
    /// The largest relative L2 difference ‖got − want‖ / ‖want‖ of a step's logits.
    pub worst: f64,
    /// Steps compared.
    pub steps: usize,
    /// Steps whose likeliest token differs.
    pub argmax_differs: usize,
}

impl Comparison {
    pub fn add(&mut self, got: &[f32], want: &[f32]) {
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for (&g, &w) in got.iter().zip(want) {
            diff += (f64::from(g) - f64::from(w)).powi(2);
            norm += f64::from(w).powi(2);
        }
        let e = if got.len() != want.len() {
            f64::INFINITY
        } else {
            (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
        };
        // NaN counts as the worst.
        self.worst = if e.is_nan() { e } else { self.worst.max(e) };
        self.steps += 1;
        let argmax = |l: &[f32]| sample(l, 0.0, 0, &mut SplitMix64::new(0));
        if argmax(got) != argmax(want) {
            self.argmax_differs += 1;
        }
    }
}

/// Draws up to `max_tokens` tokens continuing `prompt` (non-empty, in the vocabulary) and
/// hands each one to `emit`; returns how many it drew (fewer when the end of text was
/// drawn).
pub fn continue_text<E: From<GenerateError>>(
    next: &mut NextLogits<'_>,
    choice: &dyn TokenChoice,
    prompt: &[u32],
    max_tokens: usize,
    sampling: Sampling,
    mut emit: impl FnMut(u32) -> Result<(), E>,
) -> Result<usize, E> {
    if prompt.is_empty() {
        return Err(GenerateError("the prompt is empty".into()).into());
    }
    let mut rng = SplitMix64::new(sampling.seed);
    let mut tokens = prompt.to_vec();
    for drawn in 0..max_tokens {
        let logits = next.after(&tokens, drawn == 0)?;
        let candidates = choice.candidates(&logits);
        let pick = sample(&candidates, sampling.temperature, sampling.top_k, &mut rng);
        let Some(token) = choice.token(pick) else {
            return Ok(drawn); // the end of text
        };
        tokens.push(token);
        emit(token)?;
    }
    Ok(max_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::Saved;
    use crate::layers::{Children, Seq};
    use crate::models::gpt::gpt;
    use crate::models::llama::llama;
    use crate::models::{GptConfig, LlamaConfig};
    use crate::transformer::{AttentionCore, AttentionKind};
    use crate::{Block, InputSpec, Layer};
    use meshtrain_tensor::rng::normal_values;
    use meshtrain_tensor::DType;

    /// The model's own logits after every one of `tokens`, `[T, vocab]`.
    fn forward(model: &Model, store: &mut ParamStore, tokens: &[u32]) -> Vec<f32> {
        let x = Tensor::from_vec(
            tokens.iter().map(|&t| t as f32).collect(),
            &[1, tokens.len()],
        );
        model.forward_all(store, x, Mode::EVAL).0.data().to_vec()
    }

    fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
        let (mut d, mut n) = (0.0f64, 0.0f64);
        for (&x, &y) in a.iter().zip(b) {
            d += (f64::from(x) - f64::from(y)).powi(2);
            n += f64::from(y).powi(2);
        }
        (d / n.max(f64::MIN_POSITIVE)).sqrt()
    }

    /// The library's decoder on the library's own models (GPT, tied or not; Llama with
    /// grouped-query heads, Qwen2's q/k/v biases, Qwen3's q/k norms): a prefill and then steps give the
    /// training forward's logits at every position, and the cache holds `kv_heads` heads.
    #[test]
    fn the_decoder_runs_the_models_own_layers() {
        let llama_small = LlamaConfig {
            vocab: 50,
            dim: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 48,
            seq: 12,
            rope_theta: 10_000.0,
            rope_scaling: None,
            norm_eps: 1e-5,
            tie_embeddings: false,
            attention: AttentionKind::Flash,
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        };
        let gpt_small = GptConfig {
            vocab: 40,
            dim: 16,
            layers: 2,
            heads: 2,
            seq: 12,
            ..GptConfig::default()
        };
        let models = [
            (gpt(&gpt_small), 16),
            (
                gpt(&GptConfig {
                    tie_embeddings: true,
                    ..gpt_small
                }),
                16,
            ),
            (llama(&llama_small), 16),
            (
                llama(&LlamaConfig {
                    qkv_bias: true,
                    ..llama_small
                }),
                16,
            ),
            // Qwen3's: heads of 12 over a width of 32, q/k norms (position-wise: their
            // evaluation forward is their cached one).
            (
                llama(&LlamaConfig {
                    head_dim: Some(12),
                    qk_norm: true,
                    ..llama_small
                }),
                24,
            ),
            // Mistral's sliding window: the cached pass sees the last 5 positions, as the
            // training forward's kernel does.
            (
                llama(&LlamaConfig {
                    sliding_window: Some(5),
                    ..llama_small
                }),
                16,
            ),
        ];
        // (model, values per cached position: 2 key/value heads)
        for (k, (model, kv_width)) in models.into_iter().enumerate() {
            let mut store = model.init(3);
            // Move every parameter off its initial value (zero biases, unit norms).
            for (v, n) in store.values.iter_mut().zip(normal_values(1 << 20, 9)) {
                *v += 0.1 * n;
            }
            for tie in model.ties() {
                let primary = model.params()[tie.primary].range.clone();
                for &c in &tie.copies {
                    let copy = model.params()[c].range.clone();
                    store.values.copy_within(primary.clone(), copy.start);
                }
            }
            let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + k as u32) % 40).collect();
            let want = forward(&model, &mut store, &tokens);
            let vocab = want.len() / tokens.len();
            let mut decoder = Decoder::new(&model, &store.values).unwrap();
            let got = decoder.prefill_all(&tokens[..5]).unwrap();
            assert!(
                rel_diff(&got, &want[..5 * vocab]) < 1e-5,
                "model {k}: prefill"
            );
            for i in 5..tokens.len() {
                let got = decoder.step(tokens[i]).unwrap();
                let e = rel_diff(&got, &want[i * vocab..][..vocab]);
                assert!(e < 1e-5, "model {k}, position {i}: {e:e}");
            }
            // Two layers' keys and values, `kv_width` values per position each.
            assert_eq!(decoder.cache_len(), tokens.len() * 2 * 2 * kv_width);
            // A last-row prefill gives the last row of the full one.
            let last = decoder.prefill(&tokens).unwrap();
            assert!(rel_diff(&last, &want[(tokens.len() - 1) * vocab..]) < 1e-5);
        }
    }

    /// A composite layer of a user's that holds attention but has no cached forward of its
    /// own: the decoder says which block, instead of attending over the new rows alone.
    #[test]
    fn a_layer_that_reads_positions_without_a_cached_forward_is_named() {
        struct Mine(Children);
        impl Layer for Mine {
            fn children(&self) -> Option<&Children> {
                Some(&self.0)
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
            fn backward(
                &self,
                _: Params<'_>,
                _: ParamsMut<'_>,
                _: Saved,
                dy: Tensor,
                _: bool,
            ) -> Option<Tensor> {
                Some(dy)
            }
        }
        let core = AttentionCore {
            dim: 4,
            heads: 2,
            kv_heads: 2,
            precision: DType::F32,
            kind: AttentionKind::Flash,
            window: None,
        };
        let embed = crate::transformer::GptEmbedding {
            vocab: 8,
            max_seq: 4,
            dim: 12,
            init_std: 0.02,
            learned_positions: false,
            sequence: crate::transformer::SequenceShard::default(),
        };
        let model = Model::new(vec![
            Block::new("embed", embed),
            Block::new(
                "mine",
                Mine(Children::new(vec![("".into(), Box::new(core))])),
            ),
        ])
        .with_input(InputSpec::tokens(4, 8));
        assert!(model.blocks[1].layer.reads_positions());
        let values = model.init(1).values;
        let mut decoder = Decoder::new(&model, &values).unwrap();
        let e = decoder.prefill(&[1, 2]).unwrap_err().to_string();
        assert!(
            e.contains("block 1 ('mine')") && e.contains("forward_cached"),
            "{e}"
        );
        assert!(
            decoder.context().is_empty(),
            "a failed pass leaves an empty cache"
        );
        // The built-in composite forwards its children's cached passes.
        let seq = Seq(Children::new(vec![]));
        assert!(!seq.reads_positions());
    }

    /// The sampler's partial selection picks what a full stable sort of the logits picks,
    /// draw for draw: greedy, top-k and all tokens, with ties among the logits (ties at the
    /// k-th place too).
    #[test]
    fn sampling_picks_what_a_full_sort_picks() {
        fn reference(
            logits: &[f32],
            temperature: f32,
            top_k: usize,
            rng: &mut SplitMix64,
        ) -> usize {
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            if temperature <= 0.0 {
                return order[0];
            }
            if top_k > 0 {
                order.truncate(top_k);
            }
            draw(&order, logits, temperature, rng)
        }
        let mut values = SplitMix64::new(5);
        for case in 0..200u64 {
            let n = 1 + (case as usize * 37) % 300;
            // Coarse values: many ties.
            let logits: Vec<f32> = (0..n)
                .map(|_| (values.normal() * 3.0).round() / 2.0)
                .collect();
            for (temperature, top_k) in
                [(0.0, 0), (0.8, 0), (1.0, 1), (0.7, 5), (1.3, 40), (0.5, n)]
            {
                let (mut a, mut b) = (SplitMix64::new(case), SplitMix64::new(case));
                for _ in 0..5 {
                    assert_eq!(
                        sample(&logits, temperature, top_k, &mut a),
                        reference(&logits, temperature, top_k, &mut b),
                        "n {n}, temperature {temperature}, top-k {top_k}"
                    );
                }
            }
        }
    }

    #[test]
    fn sampling_follows_temperature_and_top_k() {
        let logits = [0.0, 3.0, 1.0, 2.9];
        let mut rng = SplitMix64::new(1);
        assert_eq!(sample(&logits, 0.0, 0, &mut rng), 1, "greedy");
        let mut counts = [0; 4];
        for _ in 0..4000 {
            counts[sample(&logits, 1.0, 2, &mut rng)] += 1;
        }
        assert_eq!(
            (counts[0], counts[2]),
            (0, 0),
            "outside the top 2: {counts:?}"
        );
        // e^3 : e^2.9 ≈ 1.105 : 1.
        let ratio = counts[1] as f64 / counts[3] as f64;
        assert!((ratio - 1.105).abs() < 0.12, "{counts:?}");
    }
}
