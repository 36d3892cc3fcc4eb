//! One pipeline chunk under ZeRO: this rank's shards, the collectives that build and reduce
//! whole blocks from them, and the [`BlockParams`] a forward or backward pass reads.
//!
//! Per block, in execution order:
//!
//! ```text
//! forward_view(b)   stage 3: all-gather b (if not prefetched), start b+1's, wait for b
//! forward_done(b)   stage 3 with reshard_after_forward: free b's gathered parameters
//! backward_view(b)  stage 3: all-gather b again, start b−1's; a zeroed gradient buffer
//! backward_done(b)  stages 2–3: reduce-scatter b's gradients (async), free the buffer
//! ```
//!
//! Collectives are issued in the same order on every rank of the data-parallel group (the
//! same program over the same blocks), so they match without any negotiation. A failed
//! collective is remembered, the pass goes on with zeros and no further collectives (so a
//! dead peer costs one timeout, not one per block), and the step reports the error.

use super::shards::{Coordinates, ShardLayout};
use super::ZeroStage;
use crate::engine::flat::{Apply, CopyPlan, FlatBuf, FlatMemory, HostFlat};
use crate::engine::DeviceState;
use meshtrain_comm::{CommError, OpSpan, ProcessGroup, RawBuf, ReduceOp, Work};
use meshtrain_nn::{BlockParams, Model, ParamStore, Params, ParamsMut};
use meshtrain_tensor::Device;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Reduce-scatters in flight at most: one, so the previous block's reduction overlaps the
/// current block's backward while the wire buffers held during backward stay at about two
/// blocks' worth (all of them in flight at once would be 1.5 × the model).
const MAX_REDUCES_IN_FLIGHT: usize = 1;

/// Free buffers a chunk keeps for reuse (a step uses about this many at once).
const MAX_POOLED: usize = 8;

/// Options of the sharded data-parallel mode (FSDP's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroOptions {
    /// Stage 3: start the next block's all-gather while the current block computes.
    pub prefetch: bool,
    /// Stage 3: free each block's gathered parameters after its forward and gather them
    /// again for backward (FSDP2's default); `false` keeps them from forward to backward.
    pub reshard_after_forward: bool,
}

impl Default for ZeroOptions {
    fn default() -> Self {
        ZeroOptions {
            prefetch: true,
            reshard_after_forward: true,
        }
    }
}

/// What the collectives of one chunk cost in a step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ChunkComm {
    /// Payload bytes (reduce-scatter inputs, all-gather outputs).
    pub bytes: usize,
    /// Time forward waited for parameters being gathered (stage 3).
    pub forward_gather_wait_s: f64,
    /// Time backward waited for parameters being gathered (stage 3).
    pub backward_gather_wait_s: f64,
    /// Time backward waited for earlier reduce-scatters (the in-flight bound).
    pub reduce_wait_s: f64,
    /// Time the collectives ran on the communication thread while the compute thread went
    /// on: per collective, from the moment it began running to the moment it finished or
    /// the compute thread began waiting for it, whichever came first. (The part after that
    /// is in the waits above; the collectives run one at a time on the communication
    /// thread, so these spans never overlap.)
    pub hidden_s: f64,
}

enum Gathered {
    Empty,
    InFlight {
        work: Work,
        _send: FlatBuf,
        recv: FlatBuf,
    },
    /// The block's f32 parameters, and on a device computing in 16 bits their copy.
    Ready {
        values: FlatBuf,
        half: Option<FlatBuf>,
    },
}

/// Where a finished reduce-scatter's slots go.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ReduceInto {
    /// Added to the state-coordinate gradient shard (stages 2–3, every micro-batch).
    State,
    /// Written over this rank's pieces of the full gradient buffer (stage 1, once a step).
    Full,
}

struct Reduce {
    block: usize,
    work: Work,
    _send: FlatBuf,
    recv: FlatBuf,
    into: ReduceInto,
}

/// One block's copies between its parameters (offsets within the block's full range), this
/// rank's state, this rank's slots and the wire, as plans built once.
struct BlockPlans {
    /// Block → every rank's slots (a reduce-scatter's input); its inverse: an all-gather's
    /// result into the block.
    pack_all: CopyPlan,
    unpack_all: CopyPlan,
    /// Block → this rank's slots, and back over its pieces.
    own_from_block: CopyPlan,
    own_to_block: CopyPlan,
    /// State → this rank's slots, and back.
    own_from_state: CopyPlan,
    own_to_state: CopyPlan,
}

impl BlockPlans {
    fn new(layout: &ShardLayout, b: usize) -> BlockPlans {
        let pack_all = layout.pack_all(b);
        let own_from_block = layout.pack_own(b, Coordinates::Block);
        let own_from_state = layout.pack_own(b, Coordinates::State);
        BlockPlans {
            unpack_all: pack_all.inverse(),
            own_to_block: own_from_block.inverse(),
            own_to_state: own_from_state.inverse(),
            pack_all,
            own_from_block,
            own_from_state,
        }
    }
}

/// This rank's share of one chunk and the collectives in flight for it.
pub struct ZeroChunk {
    pub layout: ShardLayout,
    stage: ZeroStage,
    group: Arc<dyn ProcessGroup>,
    options: ZeroOptions,
    /// Global index of the chunk's first block.
    first_block: usize,
    /// Per block, its buffers' range in the chunk's store.
    buffers: Vec<Range<usize>>,
    plans: Vec<BlockPlans>,
    /// Where the wire buffers and gathered blocks live: the chunk's memory (the host's, or
    /// the GPU its state is placed on).
    memory: Arc<dyn FlatMemory>,
    /// Stages 2–3: this rank's gradient pieces (state coordinates), summed over the step's
    /// micro-batches. During the update they sit in the chunk's store instead. Empty when
    /// the chunk is placed on a device, whose gradient buffer holds them ([`Self::place`]).
    pub shard_grads: Vec<f32>,
    /// Stages 2–3 on a device: the device's gradient buffer, this rank's pieces in state
    /// coordinates, where the reduce-scatters add.
    device_grads: Option<RawBuf>,
    /// Stage 3 on a device: the device's parameter buffer, this rank's pieces in state
    /// coordinates, which the all-gathers send.
    device_values: Option<RawBuf>,
    /// Stage 3: this rank's parameter pieces (state coordinates); in the store during the
    /// update.
    pub shard_values: Vec<f32>,
    gathered: Vec<Gathered>,
    /// Stages 2–3: the gradient buffer of the block in backward.
    block_grads: Option<FlatBuf>,
    reducing: VecDeque<Reduce>,
    /// Free buffers for the next blocks' collectives and parameters.
    pool: Vec<FlatBuf>,
    error: Option<CommError>,
    comm: ChunkComm,
    /// Bytes of the buffers for gathered parameters, collectives and block gradients
    /// allocated right now (in use or pooled), and the most allocated at once since
    /// [`ZeroChunk::take_transient_peak`].
    transient: usize,
    transient_peak: usize,
}

impl ZeroChunk {
    pub fn new(
        layout: ShardLayout,
        stage: ZeroStage,
        group: Arc<dyn ProcessGroup>,
        options: ZeroOptions,
        first_block: usize,
        buffers: Vec<Range<usize>>,
    ) -> ZeroChunk {
        let blocks = layout.blocks.len();
        let sharded = |on: bool| {
            if on {
                vec![0.0; layout.state_len]
            } else {
                Vec::new()
            }
        };
        ZeroChunk {
            shard_grads: sharded(stage >= ZeroStage::Gradients),
            shard_values: sharded(stage >= ZeroStage::Parameters),
            plans: (0..blocks).map(|b| BlockPlans::new(&layout, b)).collect(),
            memory: Arc::new(HostFlat {
                device: Device::Cpu,
            }),
            layout,
            stage,
            group,
            options,
            first_block,
            buffers,
            gathered: (0..blocks).map(|_| Gathered::Empty).collect(),
            block_grads: None,
            device_grads: None,
            device_values: None,
            reducing: VecDeque::new(),
            pool: Vec::new(),
            error: None,
            comm: ChunkComm::default(),
            transient: 0,
            transient_peak: 0,
        }
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// The chunk's state was placed on a device: the wire buffers and gathered blocks live
    /// in its `memory` from now on (the collectives then run on the device's buffers, as
    /// DDP's do); under stages 2–3 the reduce-scatters add into the device's gradient buffer
    /// (`grads`: this rank's pieces), and under stage 3 the all-gathers send from its
    /// parameter buffer (`values`: this rank's pieces, which [`ZeroSync`] put in the store
    /// for placement).
    ///
    /// [`ZeroSync`]: super::ZeroSync
    pub fn place(&mut self, memory: Arc<dyn FlatMemory>, grads: RawBuf, values: RawBuf) {
        self.end_pass();
        self.pool.clear();
        self.transient = 0;
        if self.stage >= ZeroStage::Gradients {
            assert_eq!(
                grads.len(),
                self.layout.state_len,
                "the device's gradient pieces"
            );
            self.device_grads = Some(grads);
            self.shard_grads = Vec::new();
        }
        if self.stage == ZeroStage::Parameters {
            assert_eq!(
                values.len(),
                self.layout.state_len,
                "the device's parameter pieces"
            );
            self.device_values = Some(values);
        }
        self.memory = memory;
    }

    /// Whether this rank's parameter pieces (stage 3) live in the device's parameter buffer
    /// (the host store holds them only while a load or a gathered checkpoint needs them).
    pub fn values_on_device(&self) -> bool {
        self.device_values.is_some()
    }

    /// Whether this rank's gradient pieces live in the device's gradient buffer (so they
    /// are where the update reads them, with nothing to swap).
    pub fn grads_on_device(&self) -> bool {
        self.device_grads.is_some()
    }

    /// This chunk as the [`BlockParams`] of a pass over `store` (its buffers, and under
    /// stage 2 its parameters), or over `device`'s views of them when placed.
    pub fn bind<'a>(
        &'a mut self,
        store: &'a mut ParamStore,
        device: Option<(&'a Model, &'a mut Box<dyn DeviceState>)>,
    ) -> BoundChunk<'a> {
        BoundChunk {
            chunk: self,
            store,
            device,
        }
    }

    /// The step's communication so far (and resets it).
    pub fn take_comm(&mut self) -> ChunkComm {
        std::mem::take(&mut self.comm)
    }

    /// The most transient bytes held at once since the last call.
    pub fn take_transient_peak(&mut self) -> usize {
        std::mem::replace(&mut self.transient_peak, self.transient)
    }

    /// Bytes of the shards this chunk holds (gradients, parameters).
    pub fn shard_bytes(&self) -> (usize, usize) {
        (
            self.shard_grads.capacity() * 4,
            self.shard_values.capacity() * 4,
        )
    }

    /// After a pass outside training (evaluation): frees every block still gathered (with
    /// `reshard_after_forward = false` a forward-only pass leaves them all) and forgets the
    /// pass's communication, so the next step neither holds them nor counts it.
    pub fn end_pass(&mut self) {
        for b in 0..self.gathered.len() {
            self.free_gathered(b);
        }
        self.comm = ChunkComm::default();
    }

    /// The first collective error of this step, if any (and clears it).
    pub fn take_error(&mut self) -> Option<CommError> {
        self.error.take()
    }

    /// A buffer of `len` elements from the chunk's pool (a free one large enough, or a new
    /// one), holding whatever it held before: every caller overwrites it whole (a
    /// collective's output, a packing, an unpacking) except the gradient buffer, which
    /// [`ZeroChunk::zeroed`] clears. Reusing the few buffers a step needs, instead of
    /// allocating and freeing multi-MiB buffers per block, keeps the process's memory at
    /// what is in use: freed blocks in the allocator's per-thread arenas are not returned to
    /// the system.
    fn buffer(&mut self, len: usize) -> FlatBuf {
        let fit = self
            .pool
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= len)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        let mut v = match fit {
            Some(i) => self.pool.swap_remove(i),
            None => {
                self.transient += len * 4;
                self.transient_peak = self.transient_peak.max(self.transient);
                self.memory.alloc(len)
            }
        };
        v.set_len(len);
        v
    }

    /// A zero-filled buffer from the pool (gradients accumulate into it).
    fn zeroed(&mut self, len: usize) -> FlatBuf {
        let mut v = self.buffer(len);
        self.memory.zero(v.raw());
        v
    }

    /// Gives a buffer back to the pool (beyond `MAX_POOLED` free ones, the smallest goes).
    fn recycle(&mut self, v: FlatBuf) {
        if v.capacity() == 0 {
            return;
        }
        self.pool.push(v);
        if self.pool.len() > MAX_POOLED {
            let (i, _) = self
                .pool
                .iter()
                .enumerate()
                .min_by_key(|(_, v)| v.capacity())
                .expect("a full pool");
            let dropped = self.pool.swap_remove(i);
            self.transient = self.transient.saturating_sub(dropped.capacity() * 4);
        }
    }

    /// This rank's state (stages 2–3: gradient or parameter pieces) as a view for plans.
    fn state_view(state: &mut [f32]) -> RawBuf {
        // SAFETY: the shard vectors live as long as the chunk and are only touched by the
        // chunk's own plans and collectives, which it waits for.
        unsafe { RawBuf::from_slice(state) }
    }

    /// Block `b`'s range of a full-layout buffer of the chunk (its gradients or parameters).
    fn block_of(&self, full: RawBuf, b: usize) -> RawBuf {
        let r = &self.layout.blocks[b].full;
        full.sub(r.start, r.len())
    }

    /// Starts block `b`'s all-gather from this rank's pieces in `source` (nothing if it is
    /// gathered or in flight, or after an error).
    fn start_gather(&mut self, b: usize) {
        if !matches!(self.gathered[b], Gathered::Empty) || self.error.is_some() {
            return;
        }
        let state = match self.device_values {
            Some(values) => values,
            None => Self::state_view(&mut self.shard_values),
        };
        match self.start_all_gather(b, |p| &p.own_from_state, state) {
            Ok((work, send, recv)) => {
                self.gathered[b] = Gathered::InFlight {
                    work,
                    _send: send,
                    recv,
                };
            }
            Err(e) => self.error = Some(e),
        }
    }

    /// Packs this rank's slots of block `b` from `source` by the block's plan `own` and
    /// starts their all-gather into a wire buffer: (work, send, receive buffers), which the
    /// caller holds until the work was waited for.
    fn start_all_gather(
        &mut self,
        b: usize,
        own: fn(&BlockPlans) -> &CopyPlan,
        source: RawBuf,
    ) -> Result<(Work, FlatBuf, FlatBuf), CommError> {
        let mut send = self.buffer(self.layout.blocks[b].slots);
        self.memory
            .apply(own(&self.plans[b]), source, send.raw(), Apply::Copy);
        let mut recv = self.buffer(self.layout.wire_len(b));
        // SAFETY: both buffers go to the caller with the work (moving a FlatBuf does not
        // move its memory), which drops them only after the work was waited for.
        match unsafe { self.group.all_gather_async(send.raw(), recv.raw()) } {
            Ok(work) => {
                self.comm.bytes += recv.len() * 4;
                Ok((work, send, recv))
            }
            Err(e) => {
                self.recycle(send);
                self.recycle(recv);
                Err(e)
            }
        }
    }

    /// Waits for block `b`'s parameters (zeros after an error); `backward`: the wait is
    /// backward's (else forward's).
    fn wait_gathered(&mut self, b: usize, backward: bool) {
        let len = self.layout.blocks[b].full.len();
        let mut values = match std::mem::replace(&mut self.gathered[b], Gathered::Empty) {
            ready @ Gathered::Ready { .. } => {
                self.gathered[b] = ready;
                return;
            }
            Gathered::InFlight {
                work,
                _send,
                mut recv,
            } => {
                let t = Instant::now();
                let result = work.wait_timed();
                let waited = t.elapsed().as_secs_f64();
                if backward {
                    self.comm.backward_gather_wait_s += waited;
                } else {
                    self.comm.forward_gather_wait_s += waited;
                }
                let mut values = self.buffer(len);
                match result {
                    Ok(span) => {
                        self.comm.hidden_s += overlapped(span, t);
                        self.memory.apply(
                            &self.plans[b].unpack_all,
                            recv.raw(),
                            values.raw(),
                            Apply::Copy,
                        );
                    }
                    Err(e) => {
                        self.memory.zero(values.raw());
                        self.error.get_or_insert(e);
                    }
                }
                self.recycle(_send);
                self.recycle(recv);
                values
            }
            Gathered::Empty => {
                // Only after an error (no collective was started): compute on zeros.
                self.zeroed(len)
            }
        };
        // The 16-bit copy the passes read on a device computing in 16 bits.
        let half = self.memory.compute_copy().map(|dtype| {
            let mut half = self.buffer(len.div_ceil(2));
            self.memory.convert(values.raw(), half.raw_as(dtype, len));
            half
        });
        self.gathered[b] = Gathered::Ready { values, half };
    }

    /// Frees block `b`'s gathered parameters.
    fn free_gathered(&mut self, b: usize) {
        if let Gathered::Ready { values, half } =
            std::mem::replace(&mut self.gathered[b], Gathered::Empty)
        {
            self.recycle(values);
            if let Some(half) = half {
                self.recycle(half);
            }
        }
    }

    /// Stage 3: makes block `b`'s parameters available, prefetching `next`'s (`backward`:
    /// for backward, else for forward).
    fn gather(&mut self, b: usize, next: Option<usize>, backward: bool) {
        self.start_gather(b);
        if let Some(n) = next.filter(|_| self.options.prefetch) {
            self.start_gather(n);
        }
        self.wait_gathered(b, backward);
    }

    /// Starts block `b`'s reduce-scatter of `grads` (its range of gradients).
    fn start_reduce(&mut self, b: usize, grads: RawBuf, into: ReduceInto) {
        if self.error.is_some() {
            return;
        }
        let mut send = self.buffer(self.layout.wire_len(b));
        self.memory
            .apply(&self.plans[b].pack_all, grads, send.raw(), Apply::Copy);
        let mut recv = self.buffer(self.layout.blocks[b].slots);
        // SAFETY: as in `start_gather`: the buffers live in the `Reduce` until waited for.
        let started = unsafe {
            self.group
                .reduce_scatter_async(send.raw(), recv.raw(), ReduceOp::Average)
        };
        match started {
            Ok(work) => {
                self.comm.bytes += send.len() * 4;
                self.reducing.push_back(Reduce {
                    block: b,
                    work,
                    _send: send,
                    recv,
                    into,
                });
            }
            Err(e) => {
                self.recycle(send);
                self.recycle(recv);
                self.error = Some(e);
            }
        }
    }

    /// Waits for the oldest reduce-scatter and applies it (`full`: the chunk's full
    /// gradient buffer, for stage 1).
    fn finish_oldest_reduce(&mut self, full: Option<RawBuf>, since: Instant) -> bool {
        let Some(mut r) = self.reducing.pop_front() else {
            return false;
        };
        match r.work.wait_timed() {
            Ok(span) => {
                self.comm.hidden_s += overlapped(span, since);
                let plans = &self.plans[r.block];
                match (r.into, full) {
                    (ReduceInto::State, _) => {
                        let state = match self.device_grads {
                            Some(grads) => grads,
                            None => Self::state_view(&mut self.shard_grads),
                        };
                        self.memory
                            .apply(&plans.own_to_state, r.recv.raw(), state, Apply::Add)
                    }
                    (ReduceInto::Full, Some(full)) => {
                        let block = self.block_of(full, r.block);
                        let plans = &self.plans[r.block];
                        self.memory
                            .apply(&plans.own_to_block, r.recv.raw(), block, Apply::Copy)
                    }
                    (ReduceInto::Full, None) => {
                        unreachable!("stage 1 reduces finish with the gradient buffer")
                    }
                }
            }
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
        self.recycle(r._send);
        self.recycle(r.recv);
        true
    }

    /// Stage 1: model block `block` has its final gradients in `grads` (the chunk's full
    /// buffer, where its state lives): start its reduce-scatter, after finishing the older
    /// ones beyond the bound (their blocks' gradients are final too, so their pieces can be
    /// written).
    pub fn block_final(&mut self, block: usize, grads: RawBuf) {
        let b = block - self.first_block;
        self.make_room_for_reduce(Some(grads));
        let block_grads = self.block_of(grads, b);
        self.start_reduce(b, block_grads, ReduceInto::Full);
    }

    /// Finishes the oldest reduce-scatters until another may start (`full`: the chunk's full
    /// gradient buffer, for stage 1), counting the wait.
    fn make_room_for_reduce(&mut self, full: Option<RawBuf>) {
        let t = Instant::now();
        while self.reducing.len() >= MAX_REDUCES_IN_FLIGHT {
            self.finish_oldest_reduce(full, t);
        }
        self.comm.reduce_wait_s += t.elapsed().as_secs_f64();
    }

    /// Waits for every reduce-scatter of the step; stage 1 writes the averaged pieces into
    /// `full_grads` (the chunk's gradient buffer). Returns the time waited.
    pub fn finish_reduces(&mut self, full_grads: Option<RawBuf>) -> f64 {
        let t = Instant::now();
        while self.finish_oldest_reduce(full_grads, t) {}
        t.elapsed().as_secs_f64()
    }

    /// Replicas of this chunk's full parameters agree again: every rank's updated pieces
    /// all-gathered into `values` (the chunk's parameter buffer, stages 1–2). At most two
    /// blocks in flight.
    pub fn all_gather_values(&mut self, values: RawBuf) -> Result<(), CommError> {
        let mut in_flight: VecDeque<(usize, Work, FlatBuf, FlatBuf)> = VecDeque::new();
        let wait_one = |z: &mut ZeroChunk,
                        (b, work, send, mut recv): (usize, Work, FlatBuf, FlatBuf)|
         -> Result<(), CommError> {
            let result = work.wait();
            if result.is_ok() {
                let block = z.block_of(values, b);
                z.memory
                    .apply(&z.plans[b].unpack_all, recv.raw(), block, Apply::Copy);
            }
            z.recycle(send);
            z.recycle(recv);
            result
        };
        for b in 0..self.layout.blocks.len() {
            let block = self.block_of(values, b);
            let (work, send, recv) = self.start_all_gather(b, |p| &p.own_from_block, block)?;
            in_flight.push_back((b, work, send, recv));
            if in_flight.len() > 1 {
                let oldest = in_flight.pop_front().expect("two in flight");
                wait_one(self, oldest)?;
            }
        }
        while let Some(last) = in_flight.pop_front() {
            wait_one(self, last)?;
        }
        Ok(())
    }

    /// A state-coordinate vector of every rank (parameters under stage 3, optimizer
    /// moments) joined into the chunk's full layout (`len` elements). Collective.
    pub fn unshard(&self, state: &[f32], len: usize) -> Result<Vec<f32>, CommError> {
        let mut full = vec![0.0; len];
        for (b, plans) in self.plans.iter().enumerate() {
            let mut send = vec![0.0; self.layout.blocks[b].slots];
            plans.own_from_state.apply_on_host(state, &mut send, false);
            let mut recv = vec![0.0; self.layout.wire_len(b)];
            self.group.all_gather((&send).into(), (&mut recv).into())?;
            let range = self.layout.blocks[b].full.clone();
            plans
                .unpack_all
                .apply_on_host(&recv, &mut full[range], false);
        }
        Ok(full)
    }

    /// This rank's pieces of a full-layout vector, in state coordinates.
    pub fn shard_of(&self, full: &[f32]) -> Vec<f32> {
        let mut state = Vec::with_capacity(self.layout.state_len);
        for piece in self.layout.pieces_full() {
            state.extend_from_slice(&full[piece]);
        }
        state
    }
}

/// Seconds of a collective that ran `span` hidden behind compute, when the compute thread
/// began waiting for it at `wait_began`: the part of the span before that moment. A
/// collective that had long finished counts its own duration, not the compute done since.
fn overlapped(span: OpSpan, wait_began: Instant) -> f64 {
    span.finished
        .min(wait_began)
        .saturating_duration_since(span.began)
        .as_secs_f64()
}

/// A [`ZeroChunk`] bound to its chunk's store for one pass.
pub struct BoundChunk<'a> {
    chunk: &'a mut ZeroChunk,
    store: &'a mut ParamStore,
    /// On a device: the model and the device's state, whose views of the chunk's parameters
    /// (stage 2) and buffers the passes read.
    device: Option<(&'a Model, &'a mut Box<dyn DeviceState>)>,
}

/// Block `block`'s buffers, and its parameters when the stage holds them whole (`full`:
/// their range in the store): the device's views, or the store's.
fn whole_views<'v>(
    store: &'v mut ParamStore,
    device: &'v mut Option<(&Model, &mut Box<dyn DeviceState>)>,
    block: usize,
    full: Option<Range<usize>>,
    buffers: Range<usize>,
) -> (Option<Params<'v>>, ParamsMut<'v>) {
    match device {
        Some((model, d)) => d.block_views(model, block),
        None => (
            full.map(|r| Params::Host(&store.values[r])),
            ParamsMut::Host(&mut store.buffers[buffers]),
        ),
    }
}

/// Block `b`'s parameters: stage 3's gathered ones (in `memory`, with their 16-bit copy),
/// or else `whole`.
fn block_params<'v>(
    stage: ZeroStage,
    gathered: &'v Gathered,
    memory: &'v dyn FlatMemory,
    whole: Option<Params<'v>>,
) -> Params<'v> {
    match gathered {
        Gathered::Ready { values, half } if stage == ZeroStage::Parameters => {
            memory.params_view(values, half.as_ref())
        }
        _ => whole.expect("stages 1-2 hold the whole parameters"),
    }
}

impl ZeroChunk {
    /// Stage 3: block `b` gathered for a pass (`next` prefetched). Then where the pass reads
    /// its parameters (the store's range, when the stage holds them whole) and buffers.
    fn prepare_block(
        &mut self,
        b: usize,
        next: Option<usize>,
        backward: bool,
    ) -> (Option<Range<usize>>, Range<usize>) {
        if self.stage == ZeroStage::Parameters {
            self.gather(b, next, backward);
            return (None, self.buffers[b].clone());
        }
        (
            Some(self.layout.blocks[b].full.clone()),
            self.buffers[b].clone(),
        )
    }
}

impl BlockParams for BoundChunk<'_> {
    fn forward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>) {
        let BoundChunk {
            chunk,
            store,
            device,
        } = self;
        let b = block - chunk.first_block;
        let next = (b + 1 < chunk.layout.blocks.len()).then_some(b + 1);
        let (full, buffers) = chunk.prepare_block(b, next, false);
        let (whole, buffers) = whole_views(store, device, block, full, buffers);
        let z: &ZeroChunk = chunk;
        let values = block_params(z.stage, &z.gathered[b], z.memory.as_ref(), whole);
        (values, buffers)
    }

    fn forward_done(&mut self, block: usize) {
        let z = &mut *self.chunk;
        let b = block - z.first_block;
        if z.stage == ZeroStage::Parameters && z.options.reshard_after_forward {
            z.free_gathered(b);
        }
    }

    fn backward_view(&mut self, block: usize) -> (Params<'_>, ParamsMut<'_>, ParamsMut<'_>) {
        let BoundChunk {
            chunk,
            store,
            device,
        } = self;
        let b = block - chunk.first_block;
        let (full, buffers) = chunk.prepare_block(b, b.checked_sub(1), true);
        if let Some(old) = chunk.block_grads.take() {
            chunk.recycle(old);
        }
        let len = chunk.layout.blocks[b].full.len();
        chunk.block_grads = Some(chunk.zeroed(len));
        let (whole, buffers) = whole_views(store, device, block, full, buffers);
        let ZeroChunk {
            stage,
            gathered,
            memory,
            block_grads,
            ..
        } = &mut **chunk;
        let memory: &Arc<dyn FlatMemory> = memory;
        let values = block_params(*stage, &gathered[b], memory.as_ref(), whole);
        let grads = memory.view_mut(block_grads.as_mut().expect("just set"));
        (values, grads, buffers)
    }

    fn backward_done(&mut self, block: usize) {
        let z = &mut *self.chunk;
        let b = block - z.first_block;
        z.make_room_for_reduce(None);
        if let Some(mut grads) = z.block_grads.take() {
            z.start_reduce(b, grads.raw(), ReduceInto::State);
            z.recycle(grads);
        }
        if z.stage == ZeroStage::Parameters {
            z.free_gathered(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshtrain_comm::{CommConfig, ThreadsWorld};
    use std::time::Duration;

    /// Issue 28: a prefetched all-gather that finished long before its block ran was counted
    /// as hidden for all the compute between its start and its wait, so ZeRO-3 reported about
    /// its whole forward and backward time as hidden communication (a compute/communication
    /// ratio of 1.0 for 40 MB per step). Hidden time is the time the collectives ran, at most.
    #[test]
    fn prefetched_gathers_count_the_time_they_ran_not_the_compute_they_waited_behind() {
        const BLOCKS: usize = 4;
        const COMPUTE: Duration = Duration::from_millis(30);
        let comms = ThreadsWorld::run(2, CommConfig::default(), |group| {
            // One parameter of 1024 elements per block.
            let blocks: Vec<Vec<Range<usize>>> = (0..BLOCKS)
                .map(|b| std::iter::once(b * 1024..(b + 1) * 1024).collect())
                .collect();
            let layout = ShardLayout::new(&blocks, group.size(), group.rank());
            let mut chunk = ZeroChunk::new(
                layout,
                ZeroStage::Parameters,
                group,
                ZeroOptions::default(),
                0,
                vec![0..0; BLOCKS],
            );
            let mut store = ParamStore {
                values: Vec::new(),
                grads: Vec::new(),
                buffers: Vec::new(),
            };
            {
                let mut bound = chunk.bind(&mut store, None);
                for b in 0..BLOCKS {
                    let _ = bound.forward_view(b);
                    std::thread::sleep(COMPUTE);
                    bound.forward_done(b);
                }
                for b in (0..BLOCKS).rev() {
                    let _ = bound.backward_view(b);
                    std::thread::sleep(COMPUTE);
                    bound.backward_done(b);
                }
            }
            chunk.finish_reduces(None);
            if let Some(e) = chunk.take_error() {
                return Err(e.to_string());
            }
            Ok::<_, String>(chunk.take_comm())
        })
        .unwrap();
        let compute = (2 * BLOCKS) as f64 * COMPUTE.as_secs_f64();
        for comm in comms {
            // 2 × 4 gathers and 4 reduce-scatters of 4 KiB: microseconds each. Before the fix
            // 6 of the gathers counted the 30 ms block they were prefetched behind: ≥ 180 ms.
            assert!(
                comm.hidden_s < 0.25 * compute,
                "{:.1} ms hidden of {:.0} ms of compute for 48 KiB of collectives",
                comm.hidden_s * 1e3,
                compute * 1e3
            );
            assert!(comm.forward_gather_wait_s < 0.25 * compute, "{comm:?}");
            assert!(comm.backward_gather_wait_s < 0.25 * compute, "{comm:?}");
        }
    }
}
