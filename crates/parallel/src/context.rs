//! Context parallelism: one sequence spread over the `cp` workers of a group, so that
//! activation memory and attention work per worker fall by `cp` (Liu et al. 2023, ring
//! attention; Jacobs et al. 2023, DeepSpeed-Ulysses; Megatron-LM's context parallelism).
//!
//! Every worker of the group holds `T/cp` tokens of each sample: the sequence is cut into
//! `2·cp` chunks and worker `i` keeps chunks `i` and `2·cp − 1 − i`
//! ([`SequenceShard`]), so that under the causal mask every worker has the same attention work.
//! Everything but attention acts on each token alone, so it runs unchanged on the local
//! tokens: [`shard_batch`] cuts the inputs and targets, the embedding adds the positions of
//! its tokens, and the loss is each worker's mean over its tokens. Parameters are replicated
//! over the group and their gradients are averaged over `dp × cp` workers (the data-parallel
//! synchronisation runs over that group), which is the gradient of the mean over all tokens.
//!
//! Attention is the one layer that mixes tokens, and [`parallelize`] replaces it:
//!
//! * [`RingAttention`] (`cp_mode = "ring"`): each worker keeps its queries; the key/value
//!   blocks travel around the ring by send/recv, the next block in flight while the current
//!   one is multiplied (memory-efficient block kernels, [`meshtrain_tensor::flash`]), the
//!   partial results merged by the log-sum-exp rule. Backward sends the blocks around again
//!   with their gradient accumulators, which arrive home after a full turn.
//! * [`UlyssesAttention`] (`cp_mode = "ulysses"`): an all-to-all turns "my tokens, all heads"
//!   into "all tokens, my heads" (needs the heads divisible by cp), the model's own attention
//!   kernel runs on whole sequences, and a second all-to-all turns the output back.
//!
//! Layers are rewritten after tensor parallelism, on its share of the heads.

use crate::data::DpMode;
use crate::engine::flat::{CopyPlan, Run};
use crate::engine::{tensor_like, tensor_view};
use crate::tensor::VocabParallelEmbedding;
use crate::Batch;
use meshtrain_comm::{BufMut, BufRef, CommError, ProcessGroup, Work};
use meshtrain_nn::transformer::{AttentionCore, GptEmbedding, Rotary, SequenceShard};
use meshtrain_nn::{InputKind, Layer, Mode, Model, Params, ParamsMut, Saved};
use meshtrain_tensor::attention::AttentionShape;
use meshtrain_tensor::flash::{
    empty_state, flash_backward_into, flash_forward_into, interleave_heads, BlockPair, HeadRows,
    Heads, Upstream,
};
use meshtrain_tensor::par::{filled_buffer, recycle, take_buffer};
use meshtrain_tensor::{DType, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How attention spreads over the context-parallel group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpMode {
    /// Key/value blocks passed around a ring, overlapped with the block products.
    #[default]
    Ring,
    /// All-to-all to whole sequences of a share of the heads, and back.
    Ulysses,
}

impl std::fmt::Display for CpMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CpMode::Ring => "ring",
            CpMode::Ulysses => "ulysses",
        })
    }
}

impl std::str::FromStr for CpMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ring" => Ok(CpMode::Ring),
            "ulysses" => Ok(CpMode::Ulysses),
            other => Err(format!(
                "unknown context-parallel mode '{other}' (expected ring or ulysses)"
            )),
        }
    }
}

/// Why a sequence is cut into 2·cp chunks, for the error that says it cannot be.
const BALANCED_CHUNKS: &str = " (2 × cp: under a causal mask the end of a sequence attends to \
     more tokens than its start, so each worker takes one chunk from each end, 2 × cp chunks in \
     all, and their work is equal)";

/// Why a model cannot be spread over a context-parallel group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContextError {
    #[error(
        "cp={cp}: context parallelism spreads token sequences; the model declares no tokens \
         per sample (its input is not a token sequence)"
    )]
    NoSequence { cp: usize },
    #[error("cp={cp}: {what} is {n}, not divisible by {by}{why}")]
    NotDivisible {
        cp: usize,
        what: String,
        n: usize,
        by: usize,
        /// Why that divisor (empty: it is cp).
        why: &'static str,
    },
    #[error("cp={cp}: the model has no attention layer to spread over the sequence")]
    NoAttention { cp: usize },
    #[error(
        "cp={cp}: the model has no GPT embedding (meshtrain_nn::transformer::GptEmbedding), \
         the layer that gives each worker's tokens their positions; a model placing positions \
         in a layer of its own would train a different model under context parallelism"
    )]
    NoPositions { cp: usize },
    #[error(
        "cp={cp}: the single master scatters whole samples; context parallelism needs \
         dp_mode = ddp"
    )]
    SingleMaster { cp: usize },
    #[error(
        "cp={cp}: '{path}' attends through a sliding window of {window} keys, which ring \
         attention's blocks do not cut; cp_mode = \"ulysses\" runs it (each rank then holds \
         whole sequences of some heads)"
    )]
    RingWindow {
        cp: usize,
        path: String,
        window: usize,
    },
    #[error(
        "cp={cp}: the targets are {targets} per batch of {samples} samples × {seq} tokens; \
         context parallelism needs one target per token"
    )]
    Targets {
        cp: usize,
        targets: usize,
        samples: usize,
        seq: usize,
    },
}

/// One worker's context-parallel setting.
#[derive(Clone)]
pub struct CpContext {
    pub group: Arc<dyn ProcessGroup>,
    pub mode: CpMode,
    /// What this worker's attention communicated.
    pub stats: Arc<CpCommStats>,
}

impl CpContext {
    pub fn new(group: Arc<dyn ProcessGroup>, mode: CpMode) -> Self {
        CpContext {
            group,
            mode,
            stats: Arc::default(),
        }
    }

    /// The tokens of each sequence this worker holds.
    pub fn shard(&self) -> SequenceShard {
        SequenceShard {
            parts: self.group.size(),
            index: self.group.rank(),
        }
    }
}

/// Context-parallel communication of one worker: elements it sent, the time its compute
/// thread waited for transfers (exposed) and the time the transfers took on the
/// communication thread, from starting there to completing (a receive's includes waiting
/// for the neighbour's send; the part beyond the exposed wait ran behind compute).
#[derive(Debug, Default)]
pub struct CpCommStats {
    elems: AtomicU64,
    exposed_ns: AtomicU64,
    busy_ns: AtomicU64,
}

/// A snapshot of [`CpCommStats`], in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpComm {
    pub elems: u64,
    pub exposed_s: f64,
    pub busy_s: f64,
}

impl CpComm {
    /// The share of the transfers' time that compute hid (the rest attention waited for).
    pub fn hidden_fraction(exposed_s: f64, busy_s: f64) -> f64 {
        if busy_s > 0.0 {
            (busy_s - exposed_s).max(0.0) / busy_s
        } else {
            0.0
        }
    }

    /// What happened since `before` (an earlier snapshot).
    pub fn since(&self, before: &CpComm) -> CpComm {
        CpComm {
            elems: self.elems - before.elems,
            exposed_s: self.exposed_s - before.exposed_s,
            busy_s: self.busy_s - before.busy_s,
        }
    }
}

impl CpCommStats {
    fn sent(&self, elems: usize) {
        self.elems.fetch_add(elems as u64, Ordering::Relaxed);
    }

    fn add(counter: &AtomicU64, d: Duration) {
        counter.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> CpComm {
        let s = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 * 1e-9;
        CpComm {
            elems: self.elems.load(Ordering::Relaxed),
            exposed_s: s(&self.exposed_ns),
            busy_s: s(&self.busy_ns),
        }
    }
}

fn fail(what: &str, e: CommError) -> ! {
    // Layers cannot return errors; the worker fails with the operation's message.
    panic!("context parallelism: {what}: {e}")
}

#[cfg(feature = "cuda")]
mod ring_cuda;
#[cfg(feature = "cuda")]
mod ulysses_cuda;

/// The tokens per sample of `model`'s declared input, if it takes token sequences.
fn sequence_of(model: &Model) -> Option<usize> {
    model
        .input()
        .filter(|i| matches!(i.kind, InputKind::Tokens { .. }))
        .and_then(|i| i.shape.first().copied())
}

/// Checks, without building anything, that `model` spreads over `cp` workers in `mode` after
/// tensor parallelism over `tp`, with replicas kept equal by `dp_mode`: it declares its
/// sequence length, which divides into `2·cp` chunks, it has attention and a GPT embedding
/// (which places positions), under Ulysses each tensor-parallel rank's heads divide by `cp`,
/// and the replicas synchronise by DDP (the single master scatters whole samples). Layers
/// other than attention and the embedding must act on each token alone (layer norms,
/// linears, activations do; a user's layer mixing tokens would not be rewritten).
pub fn check(
    model: &Model,
    cp: usize,
    mode: CpMode,
    dp_mode: DpMode,
    tp: usize,
) -> Result<(), ContextError> {
    if cp == 1 {
        return Ok(());
    }
    if dp_mode == DpMode::SingleMaster {
        return Err(ContextError::SingleMaster { cp });
    }
    let found = context_layers(model, cp)?;
    if mode == CpMode::Ring {
        if let Some((path, window)) = found.windows.into_iter().next() {
            return Err(ContextError::RingWindow { cp, path, window });
        }
    }
    if mode == CpMode::Ulysses {
        for (path, h) in found.heads {
            let local = h / tp.max(1);
            if !local.is_multiple_of(cp) {
                return Err(ContextError::NotDivisible {
                    cp,
                    what: format!("'{path}' attention heads per tensor-parallel rank ({h}/{tp})"),
                    n: local,
                    by: cp,
                    why: "",
                });
            }
        }
    }
    Ok(())
}

/// What every mode needs: the model declares its sequence length, which divides into `2·cp`
/// chunks, and it has attention and a GPT embedding. Returns (path, heads) of its attention
/// layers.
pub fn check_sequence(model: &Model, cp: usize) -> Result<Vec<(String, usize)>, ContextError> {
    if cp == 1 {
        return Ok(Vec::new());
    }
    Ok(context_layers(model, cp)?.heads)
}

/// [`check_sequence`]'s checks (cp > 1), returning every layer it found.
fn context_layers(model: &Model, cp: usize) -> Result<Found, ContextError> {
    let seq = sequence_of(model).ok_or(ContextError::NoSequence { cp })?;
    if !seq.is_multiple_of(2 * cp) {
        return Err(ContextError::NotDivisible {
            cp,
            what: "the sequence length".into(),
            n: seq,
            by: 2 * cp,
            why: BALANCED_CHUNKS,
        });
    }
    let mut found = Found::default();
    for block in &model.blocks {
        find_layers(block.layer.as_ref(), &block.name, &mut found);
    }
    if found.heads.is_empty() {
        return Err(ContextError::NoAttention { cp });
    }
    if found.embeddings == 0 {
        return Err(ContextError::NoPositions { cp });
    }
    Ok(found)
}

/// The layers context parallelism rewrites, found in a model.
#[derive(Default)]
struct Found {
    /// (path, heads) of every attention core.
    heads: Vec<(String, usize)>,
    /// (path, window) of every attention core with a sliding window.
    windows: Vec<(String, usize)>,
    /// GPT embeddings (whole or vocabulary-parallel): the layers that place positions.
    embeddings: usize,
}

fn find_layers(layer: &dyn Layer, path: &str, found: &mut Found) {
    if let Some(any) = layer.as_any() {
        if let Some(core) = any.downcast_ref::<AttentionCore>() {
            found.heads.push((path.to_string(), core.heads));
            found
                .windows
                .extend(core.window.map(|w| (path.to_string(), w)));
        }
        if any.is::<GptEmbedding>() || any.is::<VocabParallelEmbedding>() {
            found.embeddings += 1;
        }
    }
    if let Some(children) = layer.children() {
        for (name, child) in children.layers() {
            find_layers(child.as_ref(), &crate::tensor::join(path, name), found);
        }
    }
}

/// The context-parallel transform: attention replaced by its `cp.mode` form, embeddings told
/// which positions this worker's tokens have. Call [`check`] first.
pub fn parallelize(model: Model, cp: &CpContext) -> Model {
    if cp.group.size() == 1 {
        return model;
    }
    model
        .transform_blocks(|blocks| -> Result<(), std::convert::Infallible> {
            for block in blocks {
                if let Some(new) = rewrite(block.layer.as_mut(), cp) {
                    block.layer = new;
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| match e {})
}

/// The replacement of `layer`, or `None` to keep it (its children rewritten).
fn rewrite(layer: &mut dyn Layer, cp: &CpContext) -> Option<Box<dyn Layer>> {
    if let Some(any) = layer.as_any() {
        if let Some(core) = any.downcast_ref::<AttentionCore>() {
            return Some(match cp.mode {
                CpMode::Ring => {
                    // `check` refuses a window under ring attention before any work.
                    assert!(
                        core.window.is_none(),
                        "ring attention over a sliding window (call context::check first)"
                    );
                    Box::new(RingAttention {
                        dim: core.dim,
                        heads: core.heads,
                        precision: core.precision,
                        cp: cp.clone(),
                    })
                }
                CpMode::Ulysses => Box::new(UlyssesAttention {
                    inner: AttentionCore {
                        dim: core.dim / cp.group.size(),
                        heads: core.heads / cp.group.size(),
                        kv_heads: (core.kv_heads / cp.group.size()).max(1),
                        precision: core.precision,
                        kind: core.kind,
                        window: core.window,
                    },
                    cp: cp.clone(),
                    moves: MovesCache::default(),
                }),
            });
        }
        if let Some(e) = any.downcast_ref::<GptEmbedding>() {
            return Some(Box::new(GptEmbedding {
                sequence: cp.shard(),
                ..*e
            }));
        }
        if let Some(r) = any.downcast_ref::<Rotary>() {
            return Some(Box::new(Rotary {
                sequence: cp.shard(),
                ..*r
            }));
        }
        if let Some(e) = any.downcast_ref::<VocabParallelEmbedding>() {
            return Some(Box::new(e.with_sequence(cp.shard())));
        }
    }
    if let Some(children) = layer.children_mut() {
        for (_, child) in children.layers_mut() {
            if let Some(new) = rewrite(child.as_mut(), cp) {
                *child = new;
            }
        }
        children.relayout();
    }
    None
}

/// This worker's tokens of `batch` (inputs `[B, T]` → `[B, T/cp]`, one target per token
/// likewise), for the shard `shard`.
pub fn shard_batch(batch: Batch, shard: SequenceShard) -> Result<Batch, ContextError> {
    if shard.parts == 1 {
        return Ok(batch);
    }
    let (samples, seq) = (batch.x.dim(0), batch.x.dim(1));
    if batch.y.len() != samples * seq {
        return Err(ContextError::Targets {
            cp: shard.parts,
            targets: batch.y.len(),
            samples,
            seq,
        });
    }
    if !seq.is_multiple_of(2 * shard.parts) {
        return Err(ContextError::NotDivisible {
            cp: shard.parts,
            what: "the batch's sequence length".into(),
            n: seq,
            by: 2 * shard.parts,
            why: BALANCED_CHUNKS,
        });
    }
    let local = seq / shard.parts;
    let chunk = local / 2;
    let mut x = Vec::with_capacity(samples * local);
    let mut y = Vec::with_capacity(samples * local);
    let ids = batch.x.data();
    for b in 0..samples {
        for c in shard.chunks() {
            let at = b * seq + c * chunk;
            x.extend_from_slice(&ids[at..at + chunk]);
            y.extend_from_slice(&batch.y[at..at + chunk]);
        }
    }
    Ok(Batch {
        x: Tensor::from_vec(x, &[samples, local]),
        y,
        samples: batch.samples,
    })
}

/// The block pairs that rank `me`'s queries meet in rank `src`'s key/value block: of the two
/// chunks on each side, a query chunk meets the earlier key chunks whole and its own chunk
/// under the causal mask. `chunk` is the rows per chunk (half a worker's tokens).
pub fn ring_pairs(me: SequenceShard, src: SequenceShard, chunk: usize) -> Vec<BlockPair> {
    let mut pairs = Vec::new();
    for (qi, &qc) in me.chunks().iter().enumerate() {
        for (ki, &kc) in src.chunks().iter().enumerate() {
            if kc <= qc {
                pairs.push(BlockPair {
                    q_start: qi * chunk,
                    kv_start: ki * chunk,
                    q_len: chunk,
                    kv_len: chunk,
                    causal: kc == qc,
                    window: None,
                });
            }
        }
    }
    pairs
}

/// Tags of the ring's messages (the context-parallel group carries nothing else).
const KV_TAG: u32 = 0x7100;
const DKV_TAG: u32 = 0x7101;

/// The (sender, receiver) pairs of a ring of `n` ranks: each rank sends to the next, the
/// last to the first. What the cp group prepares its channels for (on NCCL, a communicator
/// per hop, so no rank's send waits behind its own receive).
pub fn ring_hops(n: usize) -> Vec<(usize, usize)> {
    if n < 2 {
        return Vec::new();
    }
    (0..n).map(|r| (r, (r + 1) % n)).collect()
}

/// A block on its way to the next rank while the previous rank's arrives; both tensors live
/// here until [`Hop::finish`] has waited for the two transfers. The blocks are host or
/// device tensors alike ([`tensor_view`]): the ring is written once for both devices.
struct Hop {
    sent: Work,
    arriving: Work,
    outgoing: Tensor,
    incoming: Tensor,
}

impl Hop {
    /// Sends `outgoing` to the next rank and receives a block of the same size from the
    /// previous one. The send goes first: the communication thread runs operations in order,
    /// and a receive queued before it would hold back the send the neighbour is waiting for.
    fn start(cp: &CpContext, mut outgoing: Tensor, tag: u32) -> Hop {
        let g = cp.group.as_ref();
        let (n, r) = (g.size(), g.rank());
        let mut incoming = tensor_like(&outgoing, outgoing.shape());
        cp.stats.sent(outgoing.numel());
        // SAFETY: both tensors move into the returned Hop and are neither written (outgoing)
        // nor touched (incoming) until `finish` has waited for both operations; moving a
        // tensor does not move its values. Dropping a Hop waits too (Work's drop).
        let (sent, arriving) = unsafe {
            let sent = g.send_async(tensor_view(&mut outgoing), (r + 1) % n, tag);
            let arriving = g.recv_async(tensor_view(&mut incoming), (r + n - 1) % n, tag);
            (sent, arriving)
        };
        Hop {
            sent: sent.unwrap_or_else(|e| fail("ring send", e)),
            arriving: arriving.unwrap_or_else(|e| fail("ring receive", e)),
            outgoing,
            incoming,
        }
    }

    /// The block still being sent (readable meanwhile: a send only reads it).
    fn outgoing(&self) -> &Tensor {
        &self.outgoing
    }

    /// Waits for both transfers; returns (the block sent, the block received).
    fn finish(self, stats: &CpCommStats) -> (Tensor, Tensor) {
        let t = Instant::now();
        let Hop {
            sent,
            arriving,
            outgoing,
            incoming,
        } = self;
        // Both waited for before either error panics: unwinding would free the buffers
        // (locals drop in reverse order) while the other transfer may still use them.
        let (sent, got) = (sent.wait_timed(), arriving.wait_timed());
        let sent = sent.unwrap_or_else(|e| fail("ring send", e));
        let got = got.unwrap_or_else(|e| fail("ring receive", e));
        CpCommStats::add(&stats.exposed_ns, t.elapsed());
        CpCommStats::add(&stats.busy_ns, sent.duration() + got.duration());
        (outgoing, incoming)
    }
}

/// `[B·rows, 2·D]`: the keys and values of a fused `[B·rows, 3·D]` activation, what travels.
fn keys_and_values(qkv: &[f32], dim: usize) -> Vec<f32> {
    let mut kv = take_buffer(qkv.len() / 3 * 2);
    for (dst, row) in kv.chunks_mut(2 * dim).zip(qkv.chunks(3 * dim)) {
        dst.copy_from_slice(&row[dim..]);
    }
    kv
}

/// Causal attention over a sequence spread around the context-parallel ring (see the module
/// documentation). Input: this worker's fused q/k/v `[B, T/cp, 3·D]`; output `[B, T/cp, D]`.
/// Keeps for backward what memory-efficient attention keeps: q/k/v, the output and the
/// log-sum-exps. The ring (which block is where, what travels when) is one code for both
/// devices; the block products are the CPU's [`meshtrain_tensor::flash`] kernels or, on a
/// GPU, `cuda::ops::ring`'s (`ring_cuda.rs`).
pub struct RingAttention {
    pub dim: usize,
    pub heads: usize,
    pub precision: DType,
    pub cp: CpContext,
}

impl RingAttention {
    fn heads_of(&self, qkv: &Tensor) -> Heads {
        Heads::of(AttentionShape {
            batch: qkv.dim(0),
            seq: qkv.dim(1),
            dim: self.dim,
            heads: self.heads,
        })
    }

    /// The shard of the rank whose block this worker holds at ring step `step`.
    fn source(&self, step: usize) -> SequenceShard {
        let me = self.cp.shard();
        SequenceShard {
            parts: me.parts,
            index: (me.index + me.parts - step) % me.parts,
        }
    }

    /// Walks the ring from this worker's own key/value block `[B, rows, 2·D]`: at each of
    /// its `cp` steps `visit` gets the block this worker holds and the block pairs its
    /// queries meet in it, while that block is already on its way to the next worker (the
    /// last step's block goes nowhere).
    fn around_the_ring(&self, own: Tensor, mut visit: impl FnMut(&Tensor, Vec<BlockPair>)) {
        let (rows, n) = (own.dim(1), self.cp.group.size());
        let mut block = Some(own);
        for step in 0..n {
            let hop = (step + 1 < n).then(|| {
                let outgoing = block.take().expect("the held block");
                Hop::start(&self.cp, outgoing, KV_TAG)
            });
            let kv = match &hop {
                Some(h) => h.outgoing(),
                None => block.as_ref().expect("the held block"),
            };
            visit(kv, ring_pairs(self.cp.shard(), self.source(step), rows / 2));
            if let Some(hop) = hop {
                let (sent, next) = hop.finish(&self.cp.stats);
                sent.recycle();
                block = Some(next);
            }
        }
        if let Some(last) = block {
            last.recycle();
        }
    }

    /// Backward's hand-off at each ring step: the gradient accumulator of the block held at
    /// the previous step (travelling one step behind its block) has arrived; it is added into
    /// `dkv`, this step's block's products, and the sum goes on to the next worker.
    fn pass_on(&self, accumulator: &mut Option<Hop>, mut dkv: Tensor) {
        if let Some(previous) = accumulator.take() {
            let (sent, arrived) = previous.finish(&self.cp.stats);
            sent.recycle();
            dkv.add_assign(&arrived);
            arrived.recycle();
        }
        *accumulator = Some(Hop::start(&self.cp, dkv, DKV_TAG));
    }

    /// After a whole turn this worker's own block's accumulator has come home.
    fn home(&self, accumulator: Option<Hop>) -> Tensor {
        let (sent, own) = accumulator
            .expect("cp > 1: at least one step")
            .finish(&self.cp.stats);
        sent.recycle();
        own
    }

    /// The key/value rows of a travelling `[B, rows, 2·D]` block.
    fn kv_rows<'a>(&self, kv: &'a [f32], rows: usize) -> [HeadRows<'a>; 2] {
        let d = self.dim;
        let at = |offset| HeadRows {
            data: kv,
            seq: rows,
            stride: 2 * d,
            offset,
        };
        [at(0), at(d)]
    }

    /// This worker's own key/value block, on the host.
    fn own_block(&self, qkv: &Tensor) -> Tensor {
        let kv = keys_and_values(qkv.data(), self.dim);
        Tensor::from_vec(kv, &[qkv.dim(0), qkv.dim(1), 2 * self.dim])
    }
}

impl Layer for RingAttention {
    /// Attention over the group's whole sequence: no cached forward (generation runs on
    /// one worker).
    fn reads_positions(&self) -> bool {
        true
    }

    fn set_precision(&mut self, precision: DType) {
        self.precision = precision;
    }

    fn runs_on(&self, device: meshtrain_tensor::Device) -> bool {
        device.is_cpu() || cfg!(feature = "cuda")
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
            return self.forward_cuda(qkv, mode, s);
        }
        let (g, rows, d) = (self.heads_of(&qkv), qkv.dim(1), self.dim);
        let [q, _, _] = HeadRows::fused(qkv.data(), rows, d);
        let (mut out_heads, mut lse) = empty_state(g, rows);
        self.around_the_ring(self.own_block(&qkv), |kv, pairs| {
            let [k, v] = self.kv_rows(kv.data(), rows);
            for pair in pairs {
                flash_forward_into(g, [q, k, v], pair, self.precision, &mut out_heads, &mut lse);
            }
        });
        let mut out = take_buffer(qkv.numel() / 3);
        interleave_heads(g, &out_heads, (1, 0), rows, &mut out, d, 0);
        recycle(out_heads);
        let out = Tensor::from_vec(out, &[qkv.dim(0), rows, d]);
        if mode.train {
            s.keep(qkv, self.precision);
            s.keep(out.clone(), self.precision);
            let lse_shape = [g.batch, g.heads, rows];
            s.keep(Tensor::from_vec(lse, &lse_shape), DType::F32);
        }
        out
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
            return Some(self.backward_cuda(s, dy));
        }
        let lse = s.take(DType::F32, "ring attention (log-sum-exp)");
        let out = s.take(self.precision, "ring attention (output)");
        let qkv = s.take(self.precision, "ring attention (q, k, v)");
        let (g, rows, d) = (self.heads_of(&qkv), qkv.dim(1), self.dim);
        let [q, _, _] = HeadRows::fused(qkv.data(), rows, d);
        let dout = HeadRows::dense(dy.data(), rows, d);
        let up = Upstream {
            out: HeadRows::dense(out.data(), rows, d),
            dout,
            lse: lse.data(),
        };
        let mut dq = filled_buffer(g.head_major_len(rows), 0.0);
        // The gradient accumulator of the block held at each step travels with it, one step
        // behind: it is complete for this step's block only after this step's products.
        let mut accumulator: Option<Hop> = None;
        self.around_the_ring(self.own_block(&qkv), |kv, pairs| {
            let [k, v] = self.kv_rows(kv.data(), rows);
            let dkv_len = 2 * g.head_major_len(rows);
            let mut dkv = filled_buffer(dkv_len, 0.0);
            for pair in pairs {
                flash_backward_into(g, [q, k, v], pair, self.precision, up, &mut dq, &mut dkv);
            }
            self.pass_on(&mut accumulator, Tensor::from_vec(dkv, &[dkv_len]));
        });
        let own = self.home(accumulator);
        let mut dqkv = take_buffer(qkv.numel());
        interleave_heads(g, &dq, (1, 0), rows, &mut dqkv, 3 * d, 0);
        interleave_heads(g, own.data(), (2, 0), rows, &mut dqkv, 3 * d, d);
        interleave_heads(g, own.data(), (2, 1), rows, &mut dqkv, 3 * d, 2 * d);
        own.recycle();
        recycle(dq);
        let shape = qkv.shape().to_vec();
        for dead in [qkv, out, lse, dy] {
            dead.recycle();
        }
        Some(Tensor::from_vec(dqkv, &shape))
    }
}

/// Ulysses' reshuffles around one of its all-to-alls as copy plans (plain data, the same
/// for every step of a shape): `pack` lays out what goes to each worker (chunk j for worker
/// j), `unpack` puts what came from each worker where it belongs. The CPU's loops
/// ([`UlyssesAttention::to_heads`], [`UlyssesAttention::to_tokens`]) move exactly these runs
/// (a unit test holds them to it); a GPU runs the plans.
#[derive(Clone, Debug, PartialEq)]
pub struct UlyssesMoves {
    pub pack: CopyPlan,
    pub unpack: CopyPlan,
}

impl UlyssesMoves {
    /// "My tokens, every head" → "every token, my heads": `[B, rows, parts·width]` on each of
    /// `n` workers → `[B, rows·n, parts·width/n]`.
    pub fn to_heads(n: usize, batch: usize, rows: usize, width: usize, parts: usize) -> Self {
        let share = width / n;
        let tokens = batch * rows;
        let per_rank = tokens * parts * share;
        let row_len = parts * share;
        let mut pack = Vec::with_capacity(n * tokens * parts);
        for j in 0..n {
            for row in 0..tokens {
                for p in 0..parts {
                    pack.push(Run {
                        src: Some(row * parts * width + p * width + j * share),
                        dst: j * per_rank + row * row_len + p * share,
                        len: share,
                    });
                }
            }
        }
        let mut unpack = Vec::with_capacity(n * tokens);
        for i in 0..n {
            let shard = SequenceShard { parts: n, index: i };
            for k in 0..tokens {
                unpack.push(Run {
                    src: Some(i * per_rank + k * row_len),
                    dst: shard.whole_row(k, rows) * row_len,
                    len: row_len,
                });
            }
        }
        UlyssesMoves {
            pack: CopyPlan::new(pack),
            unpack: CopyPlan::new(unpack),
        }
    }

    /// The way back: `[B, seq, row_len]` (every token, my heads of `parts` tensors) on each
    /// of `n` workers → `[B, seq/n, parts·row_len/parts·n]`.
    pub fn to_tokens(n: usize, batch: usize, seq: usize, row_len: usize, parts: usize) -> Self {
        let rows = seq / n;
        let tokens = batch * rows;
        let share = row_len / parts;
        let width = share * n;
        let per_rank = tokens * row_len;
        let mut pack = Vec::with_capacity(n * tokens);
        for j in 0..n {
            let shard = SequenceShard { parts: n, index: j };
            for k in 0..tokens {
                pack.push(Run {
                    src: Some(shard.whole_row(k, rows) * row_len),
                    dst: j * per_rank + k * row_len,
                    len: row_len,
                });
            }
        }
        let mut unpack = Vec::with_capacity(n * tokens * parts);
        for i in 0..n {
            for row in 0..tokens {
                for p in 0..parts {
                    unpack.push(Run {
                        src: Some(i * per_rank + row * row_len + p * share),
                        dst: row * parts * width + p * width + i * share,
                        len: share,
                    });
                }
            }
        }
        UlyssesMoves {
            pack: CopyPlan::new(pack),
            unpack: CopyPlan::new(unpack),
        }
    }
}

/// Causal attention with an all-to-all on either side (DeepSpeed-Ulysses): each worker runs
/// `inner` (the model's own kernel, on `heads/cp` heads) over whole sequences. Input: this
/// worker's fused q/k/v `[B, T/cp, 3·D]`; output `[B, T/cp, D]`.
pub struct UlyssesAttention {
    /// The attention of this worker's heads over whole sequences.
    pub inner: AttentionCore,
    pub cp: CpContext,
    /// The GPU arm's plans by shape (built once; their run tables uploaded once).
    pub moves: MovesCache,
}

/// Ulysses' [`UlyssesMoves`] by shape, each built once, with what a device keeps of them.
#[derive(Default)]
pub struct MovesCache {
    plans: std::sync::Mutex<std::collections::HashMap<MovesKey, Arc<CachedMoves>>>,
}

/// Which reshuffle (`to_heads` or not), and its (workers, batch, rows or seq, width or row
/// length, parts).
type MovesKey = (bool, [usize; 5]);

/// One shape's plans, and (on a GPU) their run tables in its memory, uploaded on first use.
pub struct CachedMoves {
    pub moves: UlyssesMoves,
    #[cfg(feature = "cuda")]
    tables: std::sync::OnceLock<[meshtrain_tensor::cuda::DevBuf; 2]>,
}

impl MovesCache {
    /// The plans of `to_heads` (or `to_tokens`) for (workers, batch, rows or seq, width or
    /// row length, parts), built on first use.
    pub fn get(&self, to_heads: bool, shape: [usize; 5]) -> Arc<CachedMoves> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        plans
            .entry((to_heads, shape))
            .or_insert_with(|| {
                let [n, b, rows, width, parts] = shape;
                let moves = if to_heads {
                    UlyssesMoves::to_heads(n, b, rows, width, parts)
                } else {
                    UlyssesMoves::to_tokens(n, b, rows, width, parts)
                };
                Arc::new(CachedMoves {
                    moves,
                    #[cfg(feature = "cuda")]
                    tables: std::sync::OnceLock::new(),
                })
            })
            .clone()
    }
}

impl UlyssesAttention {
    /// `[B, T/cp, parts·D]` (this worker's tokens, every head of `parts` side-by-side
    /// tensors) → `[B, T, parts·D/cp]` (every token, this worker's heads), in sequence order.
    fn to_heads(&self, x: &Tensor, parts: usize) -> Tensor {
        let (n, b, rows) = (self.cp.group.size(), x.dim(0), x.dim(1));
        let width = x.dim(2) / parts; // D
        let share = width / n;
        // Chunk j of what is sent: every token's columns of worker j's heads.
        let mut send = take_buffer(x.numel());
        let per_rank = x.numel() / n;
        for (j, dst) in send.chunks_mut(per_rank).enumerate() {
            for (row, out) in x
                .data()
                .chunks(parts * width)
                .zip(dst.chunks_mut(parts * share))
            {
                for p in 0..parts {
                    let src = &row[p * width + j * share..][..share];
                    out[p * share..][..share].copy_from_slice(src);
                }
            }
        }
        let received = self.exchange(send);
        // Chunk i received holds worker i's tokens: put them at their positions.
        let seq = rows * n;
        let row_len = parts * share;
        let mut whole = take_buffer(x.numel());
        for (i, chunk) in received.chunks(per_rank).enumerate() {
            let shard = SequenceShard { parts: n, index: i };
            for (k, row) in chunk.chunks(row_len).enumerate() {
                let at = shard.whole_row(k, rows);
                whole[at * row_len..][..row_len].copy_from_slice(row);
            }
        }
        recycle(received);
        Tensor::from_vec(whole, &[b, seq, row_len])
    }

    /// The inverse of [`UlyssesAttention::to_heads`]: `[B, T, parts·D/cp]` → `[B, T/cp,
    /// parts·D]`.
    fn to_tokens(&self, y: &Tensor, parts: usize) -> Tensor {
        let (n, b, seq) = (self.cp.group.size(), y.dim(0), y.dim(1));
        let rows = seq / n;
        let row_len = y.dim(2);
        let share = row_len / parts;
        // Chunk j of what is sent: worker j's tokens, this worker's heads.
        let per_rank = y.numel() / n;
        let mut send = take_buffer(y.numel());
        for (j, dst) in send.chunks_mut(per_rank).enumerate() {
            let shard = SequenceShard { parts: n, index: j };
            for (k, out) in dst.chunks_mut(row_len).enumerate() {
                let at = shard.whole_row(k, rows);
                out.copy_from_slice(&y.data()[at * row_len..][..row_len]);
            }
        }
        let received = self.exchange(send);
        // Chunk i received holds worker i's heads of this worker's tokens.
        let width = share * n;
        let mut local = take_buffer(y.numel());
        for (i, chunk) in received.chunks(per_rank).enumerate() {
            for (row, out) in chunk.chunks(row_len).zip(local.chunks_mut(parts * width)) {
                for p in 0..parts {
                    out[p * width + i * share..][..share]
                        .copy_from_slice(&row[p * share..][..share]);
                }
            }
        }
        recycle(received);
        Tensor::from_vec(local, &[b, rows, parts * width])
    }

    /// One all-to-all of `send` (chunk j to worker j), counted.
    fn exchange(&self, send: Vec<f32>) -> Vec<f32> {
        let g = self.cp.group.as_ref();
        let mut received = take_buffer(send.len());
        let t = Instant::now();
        self.cp.stats.sent(send.len() / g.size() * (g.size() - 1));
        if let Err(e) = g.all_to_all(BufRef::F32(&send), BufMut::F32(&mut received)) {
            fail("all-to-all", e)
        }
        CpCommStats::add(&self.cp.stats.exposed_ns, t.elapsed());
        CpCommStats::add(&self.cp.stats.busy_ns, t.elapsed());
        recycle(send);
        received
    }
}

impl Layer for UlyssesAttention {
    /// Attention over the group's whole sequence: no cached forward (generation runs on
    /// one worker).
    fn reads_positions(&self) -> bool {
        true
    }

    fn set_precision(&mut self, precision: DType) {
        self.inner.precision = precision;
    }

    fn runs_on(&self, device: meshtrain_tensor::Device) -> bool {
        device.is_cpu() || cfg!(feature = "cuda")
    }

    fn forward(
        &self,
        p: Params<'_>,
        b: ParamsMut<'_>,
        qkv: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        #[cfg(feature = "cuda")]
        if qkv.device().is_cuda() {
            let whole = self.to_heads_cuda(&qkv, 3);
            let out = self.inner.forward(p, b, whole, mode, s);
            return self.to_tokens_cuda(&out, 1);
        }
        let p = p.host();
        let b = b.host();
        let whole = self.to_heads(&qkv, 3);
        qkv.recycle();
        let out = self.inner.forward(p.into(), b.into(), whole, mode, s);
        let local = self.to_tokens(&out, 1);
        out.recycle();
        local
    }

    fn backward(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        need_input_grad: bool,
    ) -> Option<Tensor> {
        #[cfg(feature = "cuda")]
        if dy.device().is_cuda() {
            let whole = self.to_heads_cuda(&dy, 1);
            let dqkv = self
                .inner
                .backward(p, g, s, whole, need_input_grad)
                .expect("attention returns its input gradient");
            return Some(self.to_tokens_cuda(&dqkv, 3));
        }
        let p = p.host();
        let g = g.host();
        let whole = self.to_heads(&dy, 1);
        dy.recycle();
        let dqkv = self
            .inner
            .backward(p.into(), g.into(), s, whole, need_input_grad)
            .expect("attention returns its input gradient");
        let local = self.to_tokens(&dqkv, 3);
        dqkv.recycle();
        Some(local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rank sends to the next and the last to the first: the pairs the ring's group
    /// prepares, each once; none without a ring.
    #[test]
    fn the_ring_hops_go_to_the_next_rank_and_around() {
        assert!(ring_hops(1).is_empty());
        assert_eq!(ring_hops(2), [(0, 1), (1, 0)]);
        assert_eq!(ring_hops(3), [(0, 1), (1, 2), (2, 0)]);
    }

    /// The plans a GPU runs move exactly what the CPU's loops move: each worker's packed
    /// chunks, exchanged by the real all-to-all and unpacked by the plans, equal
    /// `to_heads` and `to_tokens` (3 parts: q/k/v; 1: an output or its gradient), bit for bit.
    #[test]
    fn ulysses_moves_are_the_cpus_reshuffles() {
        use meshtrain_comm::{CommConfig, ThreadsWorld};
        for n in [2, 3] {
            ThreadsWorld::run(n, CommConfig::default(), move |group| {
                let (b, rows, width) = (2, 4, 6);
                let layer = UlyssesAttention {
                    inner: AttentionCore {
                        dim: width,
                        heads: n,
                        kv_heads: n,
                        precision: DType::F32,
                        kind: meshtrain_nn::transformer::AttentionKind::Flash,
                        window: None,
                    },
                    cp: CpContext::new(group.clone(), CpMode::Ulysses),
                    moves: MovesCache::default(),
                };
                let exchange = |send: &[f32]| {
                    let mut got = vec![0.0f32; send.len()];
                    group
                        .all_to_all(BufRef::F32(send), BufMut::F32(&mut got))
                        .unwrap();
                    got
                };
                let run = |plans: &UlyssesMoves, x: &[f32]| {
                    let mut send = vec![f32::NAN; x.len()];
                    plans.pack.apply_on_host(x, &mut send, false);
                    let received = exchange(&send);
                    let mut out = vec![f32::NAN; x.len()];
                    plans.unpack.apply_on_host(&received, &mut out, false);
                    out
                };
                for parts in [3, 1] {
                    let r = group.rank();
                    let values = (0..b * rows * parts * width)
                        .map(|i| (r * 10_000 + i) as f32)
                        .collect::<Vec<f32>>();
                    let x = Tensor::from_vec(values, &[b, rows, parts * width]);
                    let whole = layer.to_heads(&x, parts);
                    let plans = UlyssesMoves::to_heads(n, b, rows, width, parts);
                    assert_eq!(
                        run(&plans, x.data()),
                        whole.data(),
                        "to_heads, {parts} parts"
                    );
                    let back = layer.to_tokens(&whole, parts);
                    let plans = UlyssesMoves::to_tokens(n, b, rows * n, whole.dim(2), parts);
                    assert_eq!(run(&plans, whole.data()), back.data(), "to_tokens");
                    assert_eq!(back.data(), x.data(), "the way back undoes the way there");
                }
                Ok::<_, String>(())
            })
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }

    #[test]
    fn every_query_chunk_meets_each_earlier_key_chunk_once() {
        for cp in [2usize, 3, 4] {
            let chunk = 5;
            // (query chunk, key chunk) over all ring steps and ranks.
            let mut met = std::collections::BTreeSet::new();
            for me in 0..cp {
                let mine = SequenceShard {
                    parts: cp,
                    index: me,
                };
                let mut work = 0;
                for src in 0..cp {
                    let theirs = SequenceShard {
                        parts: cp,
                        index: src,
                    };
                    for p in ring_pairs(mine, theirs, chunk) {
                        let q = mine.chunks()[p.q_start / chunk];
                        let k = theirs.chunks()[p.kv_start / chunk];
                        assert!(k <= q && p.causal == (k == q));
                        assert!(met.insert((q, k)), "({q}, {k}) twice");
                        work += if p.causal { 1 } else { 2 };
                    }
                }
                // Load balance: counting a causal diagonal block as 1 and a whole block as 2,
                // every worker does 2·(2·cp): the same work.
                assert_eq!(work, 2 * (2 * cp), "cp={cp} rank {me}");
            }
            let chunks = 2 * cp;
            assert_eq!(met.len(), chunks * (chunks + 1) / 2);
        }
    }

    #[test]
    fn shards_cover_the_sequence_once() {
        let (b, t, cp) = (2, 16, 4);
        let ids: Vec<f32> = (0..b * t).map(|i| i as f32).collect();
        let y: Vec<u32> = (0..(b * t) as u32).collect();
        let mut seen = vec![0; b * t];
        for index in 0..cp {
            let shard = SequenceShard { parts: cp, index };
            let batch = Batch {
                x: Tensor::from_vec(ids.clone(), &[b, t]),
                y: y.clone(),
                samples: b,
            };
            let local = shard_batch(batch, shard).unwrap();
            assert_eq!(local.x.shape(), &[b, t / cp]);
            for (k, (&x, &y)) in local.x.data().iter().zip(&local.y).enumerate() {
                let (sample, i) = (k / (t / cp), k % (t / cp));
                let at = sample * t + shard.position(i, t / cp);
                assert_eq!((x as usize, y as usize), (at, at));
                seen[at] += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
        let bad = Batch {
            x: Tensor::from_vec(ids, &[b, t]),
            y: vec![0; b],
            samples: b,
        };
        let e = shard_batch(bad, SequenceShard { parts: 2, index: 0 }).unwrap_err();
        assert!(e.to_string().contains("one target per token"), "{e}");
    }

    /// A model whose positions no known embedding places would train a different model:
    /// refused, as are models without attention or a token sequence.
    #[test]
    fn models_context_parallelism_cannot_place_are_refused() {
        use meshtrain_nn::transformer::causal_self_attention;
        use meshtrain_nn::{Block, InputSpec};
        let attention_only =
            Model::new(vec![Block::new("attn", causal_self_attention(8, 2, None))])
                .with_input(InputSpec::tokens(8, 16));
        let e = check(&attention_only, 2, CpMode::Ring, DpMode::Ddp, 1).unwrap_err();
        assert_eq!(e, ContextError::NoPositions { cp: 2 });
        let images = Model::new(vec![Block::new("attn", causal_self_attention(8, 2, None))])
            .with_input(InputSpec::float(&[8]));
        assert_eq!(
            check(&images, 2, CpMode::Ring, DpMode::Ddp, 1).unwrap_err(),
            ContextError::NoSequence { cp: 2 }
        );
        assert!(check(&images, 1, CpMode::Ring, DpMode::Ddp, 1).is_ok());
    }
}
