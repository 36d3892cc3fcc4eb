//! DistributedDataParallel: average the gradients of full replicas, overlapping the
//! all-reduce with backward.
//!
//! Per step: [`Ddp::prepare`] before backward; [`Ddp::block_ready`] from
//! `Model::backward`'s hook each time a block's gradients are final — when that completes a
//! bucket (and every earlier bucket has gone), the bucket's all-reduce starts asynchronously
//! while backward continues on the earlier blocks; [`Ddp::finish`] after backward starts
//! whatever has not started, waits, and leaves the averaged gradients in the flat buffer.
//!
//! Buckets are launched strictly in bucket order, so every rank issues the same collectives in
//! the same sequence even if its hooks fire in another order. A bucket whose blocks never
//! report (parameters that took no part in this step's backward) is launched by `finish`
//! with whatever its gradients hold (zeros after `zero_grads`): no hang, no graph walk.

use super::buckets::{plan_buckets, Bucket};
use super::DataParallelError;
use crate::engine::flat::{FlatBuf, FlatMemory, HostFlat};
use meshtrain_comm::{
    BufMut, CommError, GroupHosts, HierarchicalGroup, OpSpan, ProcessGroup, RawBuf, ReduceOp, Work,
};
use meshtrain_nn::{Model, ParamStore};
use std::sync::Arc;
use std::time::Instant;

/// Whether gradients travel as f32 or are rounded to bf16 on the wire (half the bytes; the
/// reduction itself still adds in f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradCompression {
    #[default]
    None,
    Bf16,
}

/// How DDP all-reduces its buckets over the data-parallel group: the planner's type, so a
/// plan and a run name the same choice (`auto`, `flat`, `hierarchical`).
pub use meshtrain_plan::layout::GradReduce;

/// Whether `reduce` reduces a group placed on `hosts` hierarchically (`auto`: when the group
/// spans several hosts, some host holds more than one of its ranks, every host the same
/// number, and the group's own all-reduce does not already follow the hosts, as NCCL's
/// does); an error (naming the group and its hosts) when hierarchical was asked for and the
/// hosts hold different numbers of the group's ranks.
pub fn is_hierarchical(
    reduce: GradReduce,
    hosts: &GroupHosts,
    group_name: &str,
    follows_hosts: bool,
) -> Result<bool, String> {
    match reduce {
        GradReduce::Flat => Ok(false),
        GradReduce::Auto => Ok(!follows_hosts
            && hosts.hierarchy_helps()
            && hosts.uniform_ranks_per_host().is_some()),
        GradReduce::Hierarchical => hosts
            .check_hierarchical(group_name)
            .map(|_| true)
            .map_err(|e| format!("parallel.grad_reduce = \"hierarchical\": {e}")),
    }
}

/// The group DDP all-reduces its buckets over under `reduce`, and whether it is
/// hierarchical: `dp` itself, or `dp` reduced inside each host first (a collective over
/// `dp`: every member calls it). On GPUs the phases are the device collectives of `dp`'s
/// sub-groups (NCCL communicators, or staged ones).
pub fn reduction_group(
    reduce: GradReduce,
    dp: &Arc<dyn ProcessGroup>,
) -> Result<(Arc<dyn ProcessGroup>, bool), DataParallelError> {
    let hosts = GroupHosts::of(dp.as_ref());
    if !is_hierarchical(reduce, &hosts, dp.name(), dp.follows_hosts())
        .map_err(DataParallelError::Config)?
    {
        return Ok((dp.clone(), false));
    }
    let group = HierarchicalGroup::new(dp.clone())
        .map_err(|e| DataParallelError::comm("creating the hierarchical reduction groups", e))?;
    Ok((Arc::new(group), true))
}

/// DDP settings (PyTorch's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpConfig {
    /// Bucket size in MiB (PyTorch: 25).
    pub bucket_cap_mb: f64,
    /// The first bucket's size in MiB (PyTorch: 1), small so communication starts early.
    pub first_bucket_mb: f64,
    pub compression: GradCompression,
    /// Start each bucket's all-reduce as soon as it is ready (true), or all of them after
    /// backward (false; shows what overlap buys).
    pub overlap: bool,
    /// Flat or hierarchical all-reduce of the buckets (applied by [`super::grad_sync`]; a
    /// [`Ddp`] built directly reduces over the group it is given).
    pub reduce: GradReduce,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            compression: GradCompression::None,
            overlap: true,
            reduce: GradReduce::Auto,
        }
    }
}

/// Where one step's communication time went (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct CommTiming {
    /// Time the compute thread spent on communication: waiting for all-reduces after
    /// backward, plus bf16 conversion.
    pub exposed_s: f64,
    /// Communication that ran while backward was still computing.
    pub hidden_s: f64,
    /// The part of `exposed_s` spent inside backward's hooks (launching, bf16 conversion,
    /// ZeRO's waits for parameters and reduce-scatters): subtract it from backward's wall
    /// time to get backward's compute.
    pub in_backward_s: f64,
    /// The part of `exposed_s` spent inside forward's hooks (ZeRO-3's waits for
    /// parameters): subtract it from forward's wall time to get forward's compute.
    pub in_forward_s: f64,
    /// Bytes this rank put into collectives (all-reduce buffers, reduce-scatter inputs,
    /// all-gather outputs).
    pub bytes: usize,
    /// The same traffic in the units of the ZeRO paper: an all-reduce counts twice (it is a
    /// reduce-scatter and an all-gather), so DDP moves 2Ψ per step, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ.
    pub traffic_bytes: usize,
    /// Time forward and backward waited for parameters being all-gathered (ZeRO-3; part of
    /// `exposed_s`, `in_forward_s` and `in_backward_s`).
    pub param_gather_s: f64,
}

impl CommTiming {
    pub fn add(&mut self, other: CommTiming) {
        self.exposed_s += other.exposed_s;
        self.hidden_s += other.hidden_s;
        self.in_backward_s += other.in_backward_s;
        self.in_forward_s += other.in_forward_s;
        self.bytes += other.bytes;
        self.traffic_bytes += other.traffic_bytes;
        self.param_gather_s += other.param_gather_s;
    }
}

/// Makes every replica of `group` start from rank 0's parameters and buffers.
pub fn broadcast_state(
    group: &dyn ProcessGroup,
    store: &mut ParamStore,
) -> Result<(), DataParallelError> {
    group
        .broadcast(BufMut::F32(&mut store.values), 0)
        .map_err(|e| DataParallelError::comm("broadcasting parameters from rank 0", e))?;
    if !store.buffers.is_empty() {
        group
            .broadcast(BufMut::F32(&mut store.buffers), 0)
            .map_err(|e| DataParallelError::comm("broadcasting buffers from rank 0", e))?;
    }
    Ok(())
}

/// One bf16 wire copy per bucket when the wire is bf16, in `memory`.
fn wire_buffers(
    buckets: &[Bucket],
    compression: GradCompression,
    memory: &dyn FlatMemory,
) -> Vec<FlatBuf> {
    match compression {
        GradCompression::None => Vec::new(),
        GradCompression::Bf16 => buckets
            .iter()
            .map(|b| memory.alloc(b.len().div_ceil(2)))
            .collect(),
    }
}

/// The DDP gradient synchroniser of one rank.
pub struct Ddp {
    group: Arc<dyn ProcessGroup>,
    config: DdpConfig,
    buckets: Vec<Bucket>,
    bucket_of_block: Vec<Option<usize>>,
    /// Blocks of each bucket that have not reported in this step.
    remaining: Vec<usize>,
    /// Buckets launched so far in this step (they go in order).
    launched: usize,
    in_flight: Vec<(usize, Work)>,
    /// bf16 wire copies, one per bucket (allocated once), in the memory of the gradients.
    wire: Vec<FlatBuf>,
    memory: Arc<dyn FlatMemory>,
    syncing: bool,
    /// Address of the gradient buffer the in-flight operations point into.
    grads_ptr: usize,
    /// Time spent launching (and converting) inside backward's hooks this step.
    hook_s: f64,
    error: Option<CommError>,
    /// When each bucket's all-reduce of the last step ran: (bucket, span).
    spans: Vec<(usize, OpSpan)>,
}

impl Ddp {
    /// DDP over a whole model's flat gradient buffer; hooks report the model's block indices.
    pub fn new(
        model: &Model,
        group: Arc<dyn ProcessGroup>,
        config: DdpConfig,
    ) -> Result<Ddp, DataParallelError> {
        let block_params: Vec<_> = (0..model.num_blocks())
            .map(|i| model.block_param_range(i))
            .collect();
        Self::over_blocks(&block_params, group, config)
    }

    /// DDP over any gradient buffer cut into consecutive blocks (`block_params[i]` is block
    /// `i`'s range, in forward order) — e.g. one pipeline chunk's stage-local store, whose
    /// hooks then report chunk-local block indices.
    pub fn over_blocks(
        block_params: &[std::ops::Range<usize>],
        group: Arc<dyn ProcessGroup>,
        config: DdpConfig,
    ) -> Result<Ddp, DataParallelError> {
        if !(config.bucket_cap_mb > 0.0 && config.first_bucket_mb > 0.0) {
            return Err(DataParallelError::Config(format!(
                "bucket sizes must be positive (bucket_cap_mb {}, first_bucket_mb {})",
                config.bucket_cap_mb, config.first_bucket_mb
            )));
        }
        let elems = |mb: f64| ((mb * 1024.0 * 1024.0 / 4.0) as usize).max(1);
        let buckets = plan_buckets(
            block_params,
            elems(config.first_bucket_mb),
            elems(config.bucket_cap_mb),
        );
        let mut bucket_of_block = vec![None; block_params.len()];
        for (bi, b) in buckets.iter().enumerate() {
            for blk in b.blocks.clone() {
                bucket_of_block[blk] = Some(bi);
            }
        }
        let memory: Arc<dyn FlatMemory> = Arc::new(HostFlat {
            device: meshtrain_tensor::Device::Cpu,
        });
        let wire = wire_buffers(&buckets, config.compression, memory.as_ref());
        Ok(Ddp {
            group,
            config,
            remaining: buckets.iter().map(|b| b.blocks.len()).collect(),
            buckets,
            bucket_of_block,
            launched: 0,
            in_flight: Vec::new(),
            wire,
            memory,
            syncing: false,
            grads_ptr: 0,
            hook_s: 0.0,
            error: None,
            spans: Vec::new(),
        })
    }

    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// The gradients live in `memory` from now on (their chunk was placed on a device): the
    /// bf16 wire copies move there too, and the conversions run there.
    pub fn use_memory(&mut self, memory: Arc<dyn FlatMemory>) {
        self.wire = wire_buffers(&self.buckets, self.config.compression, memory.as_ref());
        self.memory = memory;
    }

    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Makes every replica start from rank 0's parameters and buffers.
    pub fn broadcast_state(&self, store: &mut ParamStore) -> Result<(), DataParallelError> {
        broadcast_state(self.group.as_ref(), store)
    }

    /// Call before backward. `sync = false` is PyTorch's `no_sync()`: gradients only
    /// accumulate locally (the non-final micro-steps of gradient accumulation).
    pub fn prepare(&mut self, sync: bool) {
        debug_assert!(self.in_flight.is_empty(), "finish() was not called");
        self.syncing = sync;
        self.launched = 0;
        self.hook_s = 0.0;
        for (r, b) in self.remaining.iter_mut().zip(&self.buckets) {
            *r = b.blocks.len();
        }
    }

    /// The backward hook: block `block`'s gradients in `grads` (the whole gradient buffer
    /// DDP was planned over, on the host or on a device) are final.
    pub fn block_ready(&mut self, block: usize, grads: RawBuf) {
        if !self.syncing || !self.config.overlap {
            return;
        }
        if let Some(b) = self.bucket_of_block.get(block).copied().flatten() {
            self.remaining[b] = self.remaining[b].saturating_sub(1);
        }
        let t = Instant::now();
        while self.launched < self.buckets.len() && self.remaining[self.launched] == 0 {
            self.launch(grads);
        }
        self.hook_s += t.elapsed().as_secs_f64();
    }

    fn launch(&mut self, grads: RawBuf) {
        let b = self.launched;
        self.launched += 1;
        if self.error.is_some() {
            return;
        }
        let range = self.buckets[b].grads.clone();
        self.grads_ptr = grads.addr() as usize;
        let bucket = grads.sub(range.start, range.len());
        // SAFETY: the bucket's range of the gradient buffer (or its own wire buffer) is not
        // touched by anyone until `finish` has waited for this operation: backward only
        // writes the gradients of earlier blocks, which lie in other buckets, and `finish`
        // checks it is given the same buffer.
        let started = unsafe {
            match self.config.compression {
                GradCompression::None => self.group.all_reduce_async(bucket, ReduceOp::Average),
                GradCompression::Bf16 => {
                    let wire = self.wire[b].raw_bf16(range.len());
                    self.memory.convert(bucket, wire);
                    self.group.all_reduce_async(wire, ReduceOp::Average)
                }
            }
        };
        match started {
            Ok(work) => self.in_flight.push((b, work)),
            Err(e) => self.error = Some(e),
        }
    }

    /// Call after backward: starts the buckets not started yet, waits for all, and leaves the
    /// gradients averaged over the ranks in `grads` (the buffer the hooks were given).
    pub fn finish(&mut self, grads: RawBuf) -> Result<CommTiming, DataParallelError> {
        if !self.syncing {
            return Ok(CommTiming::default());
        }
        self.syncing = false;
        let t0 = Instant::now();
        if !self.in_flight.is_empty() {
            assert_eq!(
                self.grads_ptr,
                grads.addr() as usize,
                "Ddp::finish must get the buffer whose gradients are being reduced"
            );
        }
        while self.launched < self.buckets.len() {
            self.launch(grads);
        }
        let mut timing = CommTiming::default();
        let mut first_error = self.error.take();
        for (b, work) in std::mem::take(&mut self.in_flight) {
            let bucket = &self.buckets[b];
            match work.wait_timed() {
                Ok(span) => {
                    self.spans.push((b, span));
                    // The part of the operation that ran before backward ended was hidden.
                    let hidden_end = span.finished.min(t0);
                    timing.hidden_s += hidden_end
                        .saturating_duration_since(span.began)
                        .as_secs_f64();
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
            timing.bytes += bucket.len() * self.wire_bytes_per_elem();
            if self.config.compression == GradCompression::Bf16 {
                let range = bucket.grads.clone();
                let wire = self.wire[b].raw_bf16(range.len());
                self.memory
                    .convert(wire, grads.sub(range.start, range.len()));
            }
        }
        if let Some(e) = first_error {
            return Err(DataParallelError::comm("all-reducing gradient buckets", e));
        }
        timing.traffic_bytes = 2 * timing.bytes;
        timing.in_backward_s = self.hook_s;
        timing.exposed_s = t0.elapsed().as_secs_f64() + self.hook_s;
        Ok(timing)
    }

    /// When each bucket's all-reduce ran since the last call (for a step's timeline).
    pub fn take_spans(&mut self) -> Vec<(usize, OpSpan)> {
        std::mem::take(&mut self.spans)
    }

    fn wire_bytes_per_elem(&self) -> usize {
        match self.config.compression {
            GradCompression::None => 4,
            GradCompression::Bf16 => 2,
        }
    }
}
