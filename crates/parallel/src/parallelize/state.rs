//! A worker's model state as checkpoints see it: the whole model gathered on one worker
//! (a standard checkpoint), each worker's own pieces (a sharded checkpoint), and a whole
//! state read back into any layout.

use super::*;
use std::ops::Range;

/// Writes rank `rank`'s part `part` of `chunk` (in `model`'s layout, starting at `bases.0`)
/// into `joined` (the whole model's layout, starting at `bases.1`): sharded parameters into
/// their place, replicated ones from rank 0 only.
fn place_shards(
    model: &Model,
    whole: &Model,
    chunk: &crate::engine::StageChunk,
    bases: (usize, usize),
    rank: usize,
    part: &[f32],
    joined: &mut [f32],
) {
    for (i, e) in model.params().iter().enumerate() {
        if !chunk.blocks.contains(&e.block) {
            continue;
        }
        let w = &whole.params()[i];
        let src = &part[e.range.start - bases.0..e.range.end - bases.0];
        let dst = &mut joined[w.range.start - bases.1..w.range.end - bases.1];
        match e.shard() {
            Some(shard) => ShardSpec {
                index: rank,
                ..shard.clone()
            }
            .put(src, dst),
            None if rank == 0 => dst.copy_from_slice(src),
            None => {}
        }
    }
}

impl Parallel {
    /// Whether this worker is in replica 0 and its first context-parallel worker: the
    /// workers whose (identical, unsharded) copies of the parameters stand for all.
    fn holds_first_copy(&self) -> bool {
        self.mesh.coordinate(MeshAxis::Dp) == 0 && self.mesh.coordinate(MeshAxis::Cp) == 0
    }

    /// The whole model's parameters, buffers and optimizer state on world rank 0 (`None`
    /// elsewhere): the contents of a standard checkpoint, whatever the layout. `model` is
    /// this worker's (possibly tensor-parallel) model, `whole` the model unsplit, whose
    /// layout the result has. Replicas are identical, so only replica 0 takes part: each
    /// stage's tensor-parallel ranks join their shards on their rank 0, and those gather the
    /// stages on pipeline rank 0. Call it on every worker.
    pub fn gather_state(
        &mut self,
        model: &Model,
        whole: &Model,
    ) -> Result<Option<(ParamStore, Optimizer)>, ParallelError> {
        // On a device the gather reads the host copy, filled for as long as it runs.
        self.with_host_state(&StateKind::ALL, |p| p.gather_host_state(model, whole))?
    }

    fn gather_host_state(
        &mut self,
        model: &Model,
        whole: &Model,
    ) -> Result<Option<(ParamStore, Optimizer)>, ParallelError> {
        let locals = self.local_states(model)?;
        if !self.holds_first_copy() {
            return Ok(None);
        }
        // Per local chunk, on tensor-parallel rank 0: [values, buffers, m, v] in the whole
        // model's layout.
        let mut joined = Vec::with_capacity(self.stage.chunks.len());
        for (chunk, local) in self.stage.chunks.iter().zip(locals) {
            joined.push(self.join_shards(model, whole, chunk, local)?);
        }
        if self.mesh.coordinate(MeshAxis::Tp) != 0 {
            return Ok(None);
        }
        let pp = self.mesh.group(MeshAxis::Pp);
        let tag = |chunk: usize, part: usize| (4 * chunk + part) as u32;
        if pp.rank() != 0 {
            for (chunk, parts) in self.stage.chunks.iter().zip(&joined) {
                for (k, part) in parts.iter().enumerate() {
                    pp.send(part.into(), 0, tag(chunk.index, k))?;
                }
            }
            return Ok(None);
        }
        let first = &self.optimizers[0];
        let n = whole.num_params();
        let mut store = ParamStore {
            values: vec![0.0; n],
            grads: vec![0.0; n],
            buffers: vec![0.0; whole.num_buffers()],
        };
        let mut optimizer = Optimizer::new(first.config, n);
        optimizer.step = first.step;
        let schedule = self.stage.schedule();
        for (c, blocks) in self.partition.chunks().iter().enumerate() {
            let pr = whole.blocks_param_range(blocks.clone());
            let br = whole.blocks_buffer_range(blocks.clone());
            let owner = schedule.worker_of(c);
            let mut targets: Vec<&mut [f32]> = vec![
                &mut store.values[pr.clone()],
                &mut store.buffers[br],
                &mut optimizer.m[pr.clone()],
            ];
            if !optimizer.v.is_empty() {
                targets.push(&mut optimizer.v[pr]);
            }
            for (k, target) in targets.into_iter().enumerate() {
                if owner == 0 {
                    target.copy_from_slice(&joined[c / schedule.workers][k]);
                } else {
                    pp.recv(target.into(), owner, tag(c, k))?;
                }
            }
        }
        Ok(Some((store, optimizer)))
    }

    /// Per local chunk, [values, buffers, m, v] (v only for AdamW) in this worker's own
    /// (tensor-parallel) layout. Under ZeRO the pieces are all-gathered over the
    /// data-parallel group first (every data-parallel rank takes part).
    fn local_states(&mut self, model: &Model) -> Result<Vec<Vec<Vec<f32>>>, ParallelError> {
        let mut out = Vec::with_capacity(self.stage.chunks.len());
        for (j, chunk) in self.stage.chunks.iter().enumerate() {
            let optimizer = &self.optimizers[j];
            let FullState { values, m, v } = match crate::zero::of_mut(self.sync.as_mut()) {
                Some(zero) => {
                    let len = model.blocks_param_range(chunk.blocks.clone()).len();
                    zero.unshard(j, &chunk.store.values, optimizer, len)?
                }
                None => FullState {
                    values: chunk.store.values.clone(),
                    m: optimizer.m.clone(),
                    v: optimizer.v.clone(),
                },
            };
            let mut local = vec![values, chunk.store.buffers.clone(), m];
            if optimizer.has_second_moment() {
                local.push(v);
            }
            out.push(local);
        }
        Ok(out)
    }

    /// One chunk's values, buffers and optimizer moments (`local`, in this worker's layout)
    /// in the whole model's layout, on tensor-parallel rank 0 (the others send their shards
    /// and get empty vectors).
    fn join_shards(
        &self,
        model: &Model,
        whole: &Model,
        chunk: &crate::engine::StageChunk,
        local: Vec<Vec<f32>>,
    ) -> Result<Vec<Vec<f32>>, ParallelError> {
        let tp = self.mesh.group(MeshAxis::Tp);
        if tp.size() == 1 {
            return Ok(local);
        }
        let tag = |part: usize| (0x100 + 4 * chunk.index + part) as u32;
        if tp.rank() != 0 {
            for (k, part) in local.iter().enumerate() {
                tp.send(part.into(), 0, tag(k))?;
            }
            return Ok(Vec::new());
        }
        let blocks = chunk.blocks.clone();
        let (base, whole_base) = (
            model.blocks_param_range(blocks.clone()).start,
            whole.blocks_param_range(blocks.clone()).start,
        );
        let whole_len = whole.blocks_param_range(blocks).len();
        let mut joined: Vec<Vec<f32>> = local
            .iter()
            .enumerate()
            .map(|(k, v)| {
                if k == 1 {
                    v.clone()
                } else {
                    vec![0.0; whole_len]
                }
            })
            .collect();
        for r in 0..tp.size() {
            let theirs: Vec<Vec<f32>> = if r == 0 {
                local.clone()
            } else {
                local
                    .iter()
                    .enumerate()
                    .map(|(k, v)| {
                        let mut buf = vec![0.0f32; v.len()];
                        tp.recv((&mut buf).into(), r, tag(k)).map(|_| buf)
                    })
                    .collect::<Result<_, _>>()?
            };
            for (k, part) in theirs.iter().enumerate().filter(|(k, _)| *k != 1) {
                place_shards(
                    model,
                    whole,
                    chunk,
                    (base, whole_base),
                    r,
                    part,
                    &mut joined[k],
                );
            }
        }
        Ok(joined)
    }

    /// Continues from a whole-model state (every worker reads the same checkpoint and keeps
    /// its share: its stage's blocks, of a tensor-parallel parameter its shard, and under
    /// ZeRO its pieces). `model` is this worker's model, `whole` the model unsplit (the
    /// state's layout). Without an optimizer state (starting from weights) the optimizers
    /// are left as they are.
    pub fn load_state(
        &mut self,
        model: &Model,
        whole: &Model,
        full: &ParamStore,
        optimizer: Option<&Optimizer>,
    ) -> Result<(), ParallelError> {
        let mut read = |part: StatePart| -> Result<Vec<f32>, ParallelError> {
            let (src, range) = match part {
                StatePart::Values(i) => (&full.values, whole.params()[i].range.clone()),
                StatePart::FirstMoment(i) => (
                    &optimizer.expect("asked for moments").m,
                    whole.params()[i].range.clone(),
                ),
                StatePart::SecondMoment(i) => (
                    &optimizer.expect("asked for moments").v,
                    whole.params()[i].range.clone(),
                ),
                StatePart::Buffer(i) => (&full.buffers, whole.buffers()[i].range.clone()),
            };
            Ok(src[range].to_vec())
        };
        let moments = optimizer.map(|o| o.step);
        self.load_state_with(model, moments, &mut read)
    }

    /// Continues from a state read tensor by tensor: `read` returns one whole tensor of the
    /// unsplit model ([`StatePart`]; its parameters and buffers are numbered as `model`'s,
    /// which tensor parallelism splits but does not reorder), and is asked only for the tensors of this
    /// worker's chunks (a sharded checkpoint reads just those). `moments` is the optimizer's
    /// step count when the moments are restored too (`None`: weights only). Each tensor goes
    /// where this worker holds it (its tensor-parallel shard; under ZeRO its pieces) as soon
    /// as it is read: into the host store or the device, one tensor at a time, so no copy of
    /// the whole state is ever made.
    pub fn load_state_with<E: From<ParallelError>>(
        &mut self,
        model: &Model,
        moments: Option<u64>,
        read: &mut dyn FnMut(StatePart) -> Result<Vec<f32>, E>,
    ) -> Result<(), E> {
        let second = self.optimizers.iter().any(Optimizer::has_second_moment);
        if let Some(zero) = crate::zero::of_mut(self.sync.as_mut()) {
            // Blocks a pass left gathered are freed, so the next step gathers the loaded ones.
            zero.end_passes();
        }
        for j in 0..self.stage.chunks.len() {
            let blocks = self.stage.chunks[j].blocks.clone();
            let base = model.blocks_param_range(blocks.clone()).start;
            let buffer_base = model.blocks_buffer_range(blocks.clone()).start;
            for (i, e) in model.buffers().iter().enumerate() {
                if blocks.contains(&e.block) {
                    let range = e.range.start - buffer_base..e.range.end - buffer_base;
                    let at = StateRange::of(j, StateKind::Buffers, range);
                    self.write_state(&at, &read(StatePart::Buffer(i))?)?;
                }
            }
            for (i, e) in model.params().iter().enumerate() {
                if !blocks.contains(&e.block) {
                    continue;
                }
                let local = e.range.start - base..e.range.end - base;
                // This worker's (tensor-parallel) share of the tensor, in its full layout.
                let share = |whole: Vec<f32>| match e.shard() {
                    Some(shard) => shard.take(&whole),
                    None => whole,
                };
                let (values, moments_held) = self.held(j, local);
                let tensor = share(read(StatePart::Values(i))?);
                let at = StateRange::of(j, StateKind::Values, values.at);
                self.write_state(&at, &tensor[values.of])?;
                if moments.is_none() {
                    continue;
                }
                let mut kinds = vec![(StatePart::FirstMoment(i), StateKind::FirstMoment)];
                if second {
                    kinds.push((StatePart::SecondMoment(i), StateKind::SecondMoment));
                }
                for (part, kind) in kinds {
                    let tensor = share(read(part)?);
                    let at = StateRange::of(j, kind, moments_held.at.clone());
                    self.write_state(&at, &tensor[moments_held.of.clone()])?;
                }
            }
            if let Some(step) = moments {
                self.optimizers[j].step = step;
            }
            let chunk = &mut self.stage.chunks[j];
            chunk.values_changed();
            if chunk.device.is_some() || !chunk.store.grads.is_empty() {
                chunk.zero_grads();
            }
        }
        Ok(())
    }

    /// What local chunk `j` holds of its parameter at `local` (chunk-local full
    /// coordinates), (values, moments): all of it at `local`, or under ZeRO this rank's
    /// piece in state coordinates (the values whole unless stage 3 cut them too).
    fn held(&self, j: usize, local: Range<usize>) -> (Held, Held) {
        let whole = Held {
            of: 0..local.len(),
            at: local.clone(),
        };
        let Some(zero) = crate::zero::of(self.sync.as_ref()) else {
            return (whole.clone(), whole);
        };
        let p = (zero.layout(j).params.iter())
            .find(|p| p.full == local)
            .expect("every parameter has a piece");
        let piece = Held {
            of: p.piece.clone(),
            at: p.state.clone(),
        };
        let values = if zero.holds_value_pieces(j) {
            piece.clone()
        } else {
            whole
        };
        (values, piece)
    }

    /// Writes `from` over the elements `at` names, in host memory or on the device (a
    /// checkpoint being loaded, one tensor at a time). Call between steps; a device's
    /// derived state (its 16-bit copy) is refreshed by [`StageChunk::values_changed`].
    pub fn write_state(&mut self, at: &StateRange, from: &[f32]) -> Result<(), ParallelError> {
        assert_eq!(
            from.len(),
            at.range.len(),
            "one element per element of {at:?}"
        );
        let chunk = &mut self.stage.chunks[at.chunk];
        if let Some(d) = &mut chunk.device {
            return Ok(d.write(at.kind, at.range.start, from)?);
        }
        // ZeRO-3 keeps its parameter pieces beside the store on the host.
        let zero = crate::zero::of_mut(self.sync.as_mut());
        let held: &mut [f32] = match zero.and_then(|z| z.shard_values_mut(at.chunk)) {
            Some(pieces) if at.kind == StateKind::Values => pieces,
            _ => at
                .kind
                .on_host_mut(&mut chunk.store, &mut self.optimizers[at.chunk]),
        };
        held[at.range.clone()].copy_from_slice(from);
        Ok(())
    }

    /// What this worker writes into a sharded checkpoint: its pieces of the whole model's
    /// tensors, each named by tensor and placed by tensor-parallel shard and offset. Every
    /// element of every tensor is written by exactly one worker: tensor-parallel shards by
    /// their rank, replicated parameters and buffers by tensor-parallel rank 0; under ZeRO
    /// each data-parallel rank its pieces, otherwise data-parallel rank 0 everything. Tied
    /// copies are their primary (written once). Call between steps.
    pub fn own_pieces(&self, model: &Model) -> Vec<StatePiece> {
        let (first, tp) = (self.holds_first_copy(), self.mesh.coordinate(MeshAxis::Tp));
        let second = self.optimizers.iter().any(Optimizer::has_second_moment);
        let zero = crate::zero::of(self.sync.as_ref());
        let mut out = Vec::new();
        for (j, chunk) in self.stage.chunks.iter().enumerate() {
            let base = model.blocks_param_range(chunk.blocks.clone()).start;
            for (i, e) in model.params().iter().enumerate() {
                if !chunk.blocks.contains(&e.block) || model.tied_primary(i).is_some() {
                    continue;
                }
                if e.shard().is_none() && tp != 0 {
                    continue;
                }
                if zero.is_none() && !first {
                    continue;
                }
                let local = e.range.start - base..e.range.end - base;
                // This rank writes the elements of the tensor it holds moments of (under ZeRO
                // its piece, else all), from its values and moments.
                let (values, moments) = self.held(j, local);
                let (offset, values, moments) =
                    (moments.of.start, values.narrowed(&moments.of), moments.at);
                if values.is_empty() {
                    continue;
                }
                let mut push = |kind: &str, state: StateKind, range: Range<usize>| {
                    out.push(StatePiece {
                        tensor: format!("{kind}.{}", e.name),
                        shape: e.full_shape(),
                        split: e.shard().cloned(),
                        offset,
                        data: StateRange {
                            chunk: j,
                            kind: state,
                            range,
                        },
                    })
                };
                push("param", StateKind::Values, values);
                push("m", StateKind::FirstMoment, moments.clone());
                if second {
                    push("v", StateKind::SecondMoment, moments);
                }
            }
            if first && tp == 0 {
                let buffer_base = model.blocks_buffer_range(chunk.blocks.clone()).start;
                for e in model.buffers() {
                    if chunk.blocks.contains(&e.block) {
                        out.push(StatePiece {
                            tensor: format!("buffer.{}", e.name),
                            shape: e.shape.clone(),
                            split: None,
                            offset: 0,
                            data: StateRange {
                                chunk: j,
                                kind: StateKind::Buffers,
                                range: e.range.start - buffer_base..e.range.end - buffer_base,
                            },
                        });
                    }
                }
            }
        }
        out
    }

    /// Local chunk `j`'s whole `kind` vector, when it is in host memory (not placed on a
    /// device; under ZeRO-3 this rank's parameter pieces).
    fn host_vector(&self, j: usize, kind: StateKind) -> Option<&[f32]> {
        let chunk = &self.stage.chunks[j];
        if chunk.device.is_some() {
            return None;
        }
        // ZeRO-3 keeps its parameter pieces beside the store on the host.
        let zero = crate::zero::of(self.sync.as_ref());
        match zero.and_then(|z| z.shard_values(j)) {
            Some(pieces) if kind == StateKind::Values => Some(pieces),
            _ => Some(kind.on_host(&chunk.store, &self.optimizers[j])),
        }
    }

    /// The elements `at` names, when they are in host memory (not placed on a device): a
    /// checkpoint writes them as they are.
    pub fn host_state(&self, at: &StateRange) -> Option<&[f32]> {
        (self.host_vector(at.chunk, at.kind)).map(|held| &held[at.range.clone()])
    }

    /// Elements of local chunk `j`'s `kind`, wherever it lives (ZeRO's pieces as held).
    pub fn state_len(&self, j: usize, kind: StateKind) -> usize {
        match &self.stage.chunks[j].device {
            Some(d) => d.state_len(kind),
            None => self.host_vector(j, kind).map_or(0, <[f32]>::len),
        }
    }

    /// Copies `into.len()` elements of `at` from its element `offset` on into `into`, from
    /// the host or the device (a checkpoint reads a placed state a bounded piece at a time
    /// this way). Call between steps.
    pub fn read_state(
        &self,
        at: &StateRange,
        offset: usize,
        into: &mut [f32],
    ) -> Result<(), ParallelError> {
        let end = offset + into.len();
        assert!(end <= at.range.len(), "reading past {at:?}");
        if let Some(held) = self.host_state(at) {
            into.copy_from_slice(&held[offset..end]);
            return Ok(());
        }
        let chunk = &self.stage.chunks[at.chunk];
        match chunk.read_from_device(at.kind, at.range.start + offset, into) {
            Some(read) => Ok(read?),
            None => unreachable!("a chunk off the host is on a device"),
        }
    }
}

impl Parallel {
    /// Whether a whole-file checkpoint can be written tensor by tensor from the workers'
    /// ZeRO pieces ([`Parallel::gather_range`]) instead of gathering the whole state first
    /// ([`Parallel::gather_state`]): one chunk per worker and data parallelism only (the
    /// layouts that run on GPUs); with a pipeline or tensor parallelism, the gather.
    pub fn gathers_by_range(&self) -> bool {
        let l = &self.layout.layout;
        crate::zero::of(self.sync.as_ref()).is_some()
            && self.stage.schedule().num_chunks() == 1
            && l.tp == 1
            && l.cp == 1
    }

    /// Whether local chunk `j`'s parameters are held as ZeRO-3's pieces (state coordinates)
    /// rather than whole.
    pub fn holds_value_pieces(&self, j: usize) -> bool {
        crate::zero::of(self.sync.as_ref()).is_some_and(|z| z.holds_value_pieces(j))
    }

    /// Elements `window` of the chunk's full-layout `kind` vector (parameters or moments,
    /// whose elements ZeRO cut into one piece per rank), gathered on rank 0 of the ZeRO
    /// group into `into` (`window.len()` elements there; `None` on the other ranks, which
    /// send their runs of it). A collective over that group when
    /// [`Parallel::gathers_by_range`]: every rank calls it with the same windows in the same
    /// order. Each rank reads its runs from wherever its state lives (a device a run at a
    /// time), so no rank holds more than the window.
    pub fn gather_range(
        &self,
        kind: StateKind,
        window: Range<usize>,
        into: Option<&mut [f32]>,
    ) -> Result<(), ParallelError> {
        let zero = crate::zero::of(self.sync.as_ref()).expect("gathers_by_range");
        let (group, layout) = (zero.group(), zero.layout(0));
        let (me, ranks) = (group.rank(), group.size());
        const TAG: u32 = 0x7a00;
        let own = |rank: usize| layout.owned_within(rank, &window);
        let read = |state: Range<usize>, into: &mut [f32]| {
            let at = StateRange {
                chunk: 0,
                kind,
                range: state,
            };
            self.read_state(&at, 0, into)
        };
        let Some(into) = into else {
            let runs = own(me);
            let mut packed = vec![0.0; runs.iter().map(|(full, _)| full.len()).sum()];
            let mut at = 0;
            for (full, state) in runs {
                read(state, &mut packed[at..at + full.len()])?;
                at += full.len();
            }
            if !packed.is_empty() {
                group.send((&packed).into(), 0, TAG)?;
            }
            return Ok(());
        };
        assert_eq!(
            into.len(),
            window.len(),
            "one element per element of the window"
        );
        let place = |full: &Range<usize>| full.start - window.start..full.end - window.start;
        for (full, state) in own(me) {
            read(state, &mut into[place(&full)])?;
        }
        let mut packed = Vec::new();
        for rank in (0..ranks).filter(|&r| r != me) {
            let runs = own(rank);
            packed.resize(runs.iter().map(|(full, _)| full.len()).sum(), 0.0);
            if packed.is_empty() {
                continue;
            }
            group.recv((&mut packed).into(), rank, TAG)?;
            let mut at = 0;
            for (full, _) in runs {
                into[place(&full)].copy_from_slice(&packed[at..at + full.len()]);
                at += full.len();
            }
        }
        Ok(())
    }
}

/// A run of one of a worker's state vectors: local chunk `chunk`'s `kind`, elements
/// `range` (ZeRO-3's parameter pieces in their state coordinates). Plain data: a checkpoint
/// reads it through [`Parallel::read_state`] wherever it lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateRange {
    pub chunk: usize,
    pub kind: StateKind,
    pub range: Range<usize>,
}

/// Elements `of` a parameter that a worker holds, and where they sit (`at`, as long) in
/// its vector of them.
#[derive(Clone, Debug)]
struct Held {
    of: Range<usize>,
    at: Range<usize>,
}

impl Held {
    /// Where the parameter's elements `of` (within `self.of`) sit.
    fn narrowed(&self, of: &Range<usize>) -> Range<usize> {
        let start = self.at.start + (of.start - self.of.start);
        start..start + of.len()
    }
}

impl StateRange {
    pub fn of(chunk: usize, kind: StateKind, range: Range<usize>) -> StateRange {
        StateRange { chunk, kind, range }
    }
}

/// One whole tensor of the unsplit model, as [`Parallel::load_state_with`] asks for it
/// (indices into `whole.params()` / `whole.buffers()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatePart {
    Values(usize),
    FirstMoment(usize),
    SecondMoment(usize),
    Buffer(usize),
}

/// A run of one tensor that one worker holds: `data` is elements `offset..` of the tensor's
/// tensor-parallel shard `split` (of the whole tensor when `split` is `None`), flat.
#[derive(Clone, Debug, PartialEq)]
pub struct StatePiece {
    /// `param.NAME`, `m.NAME`, `v.NAME` or `buffer.NAME`.
    pub tensor: String,
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    pub split: Option<ShardSpec>,
    pub offset: usize,
    /// Where the worker holds it (read through [`Parallel::read_state`]: a save copies
    /// nothing before writing).
    pub data: StateRange,
}
