//! Tensor and sequence parallelism's GPU arms. The layers, their shards and their
//! collectives are the CPU's ([`super`]); here the products run on `cuda::ops` and the
//! collectives take the device tensors as they are ([`start_all_reduce`] and its siblings
//! send host or device tensors alike), on the communication stream:
//!
//! * a column-parallel layer queues its input gradient's product first and starts the
//!   all-reduce (reduce-scatter under sequence parallelism) of it before the weight
//!   gradient's product, so the two overlap ([`linear_backward_then`]);
//! * a row-parallel layer sums its partial products over the group, then adds its bias
//!   (`ops::bias_add`) once;
//! * the vocabulary-parallel embedding looks up this rank's rows (other ranks' tokens are
//!   negative ids, zero rows), rank 0 adding the positions before the sum so that they are
//!   counted once; its position gradients are grouped by position on the host, so they are
//!   summed without atomics.
//!
//! * the vocabulary-parallel cross-entropy runs on `ops::VocabParallelXent`'s kernels with
//!   two all-reduces of per-row numbers between them (the maxima, then the softmax sums and
//!   the targets' logits) on device buffers; the loss sums stay on the device.

use super::{
    fail, gathered_shape, start_all_reduce, start_gather, start_scatter, ColumnParallel,
    RowParallel, TpContext, VocabParallelCrossEntropy, VocabParallelEmbedding,
};
use crate::engine::tensor_view;
use meshtrain_comm::ReduceOp;
use meshtrain_nn::device::linear_backward_then;
use meshtrain_nn::loss::{on_the_host, LossError, LossValue};
use meshtrain_nn::{Layer, Mode, Params, ParamsMut, Saved};
use meshtrain_tensor::cuda::error::ok_or_raise as ok;
use meshtrain_tensor::cuda::{ops, DeviceGrads, DeviceParams};
use meshtrain_tensor::Tensor;

fn device_params(p: Params<'_>) -> DeviceParams<'_> {
    match p {
        Params::Device(p) => p,
        Params::Host(_) => panic!("tensor parallelism: host parameters on a GPU path"),
    }
}

fn device_grads(g: ParamsMut<'_>) -> DeviceGrads<'_> {
    match g {
        ParamsMut::Device(g) => g,
        ParamsMut::Host(_) => panic!("tensor parallelism: host gradients on a GPU path"),
    }
}

impl TpContext {
    /// Every rank's rows of `local`, in rank order, as `full_shape`.
    fn gathered(&self, local: Tensor, full_shape: &[usize], what: &str) -> Tensor {
        start_gather(self, local, full_shape).wait(what)
    }
}

impl ColumnParallel {
    /// Where the inner product's kept input sits in `s` (its activation input, if any, last).
    fn kept_input_at(&self, s: &Saved) -> usize {
        s.tensors.len() - 1 - usize::from(self.inner.activation.is_some())
    }

    pub(super) fn forward_cuda(
        &self,
        p: Params<'_>,
        b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let tp = &self.tp;
        if !tp.sequence_parallel {
            return self.inner.forward(p, b, x, mode, s);
        }
        let rows = x.numel() / self.inner.inputs * tp.size();
        let full_shape = gathered_shape(rows, tp.seq, self.inner.inputs);
        let full = tp.gathered(x.clone(), &full_shape, "all-gather of the input");
        let y = self.inner.forward(p, b, full, mode, s);
        if mode.train {
            // Keep this rank's tokens, as the product reads them, not the gathered input:
            // backward gathers again.
            let at = self.kept_input_at(s);
            let local = ok(ops::to_dtype(
                x.cuda().expect("a device input"),
                self.inner.precision,
            ));
            s.tensors[at] = Tensor::from_cuda(local, x.shape());
        }
        y
    }

    pub(super) fn backward_cuda(
        &self,
        p: Params<'_>,
        g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        let tp = &self.tp;
        let p = device_params(p);
        if !tp.sequence_parallel {
            let dx = linear_backward_then(&self.inner, p, g, s, dy, need_dx, |dx| {
                dx.map(|dx| start_all_reduce(tp, dx))
            });
            return dx.map(|d| d.wait("all-reduce of the input gradient"));
        }
        // The tokens gathered again for the weight gradient; the input gradient's
        // reduce-scatter runs while that is computed.
        let at = self.kept_input_at(&s);
        let local = s.tensors[at].clone();
        let local_shape = local.shape().to_vec();
        let rows = local.numel() / self.inner.inputs * tp.size();
        let full_shape = gathered_shape(rows, tp.seq, self.inner.inputs);
        s.tensors[at] = tp.gathered(local, &full_shape, "all-gather of the input");
        let dx = linear_backward_then(&self.inner, p, g, s, dy, need_dx, |dx| {
            dx.map(|dx| start_scatter(tp, dx, &local_shape))
        });
        dx.map(|d| d.wait("reduce-scatter of the input gradient"))
    }
}

impl RowParallel {
    pub(super) fn forward_cuda(
        &self,
        p: Params<'_>,
        b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let tp = &self.tp;
        let nw = self.inner.inputs * self.outputs;
        let (weight, bias) = p.split_at(nw);
        let partial = self.inner.forward(weight, b, x, mode, s);
        let rows = partial.numel() / self.outputs;
        let y = if tp.sequence_parallel {
            let local_shape = [rows / tp.size(), self.outputs];
            start_scatter(tp, partial, &local_shape).wait("reduce-scatter of the output")
        } else {
            start_all_reduce(tp, partial).wait("all-reduce of the output")
        };
        if !self.bias {
            return y;
        }
        let shape = y.shape().to_vec();
        let Ok((values, _)) = y.into_cuda() else {
            panic!("tensor parallelism: a host output on a GPU path")
        };
        let biased = ok(ops::bias_add(values, device_params(bias), self.outputs));
        Tensor::from_cuda(biased, &shape)
    }

    pub(super) fn backward_cuda(
        &self,
        p: Params<'_>,
        mut g: ParamsMut<'_>,
        s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        let tp = &self.tp;
        let nw = self.inner.inputs * self.outputs;
        if self.bias {
            let rows = dy.numel() / self.outputs;
            let gb = device_grads(g.slice(nw..nw + self.outputs));
            let dys = dy.cuda().expect("a device output gradient");
            ok(ops::column_sums(dys, rows, self.outputs, gb.ptr(), true));
        }
        let dy = if tp.sequence_parallel {
            let rows = dy.numel() / self.outputs * tp.size();
            let full_shape = gathered_shape(rows, tp.seq, self.outputs);
            tp.gathered(dy, &full_shape, "all-gather of the output gradient")
        } else {
            dy
        };
        self.inner
            .backward(p.slice(0..nw), g.slice(0..nw), s, dy, need_dx)
    }
}

impl VocabParallelEmbedding {
    /// The ids as rows of this rank's table: `id − start` for its own, −1 (a zero row, no
    /// gradient) for the others'.
    fn local_ids(&self, ids: &Tensor) -> Vec<i32> {
        let all = ok(ops::token_ids(ids.to_host().data(), self.whole.vocab));
        let mine = self.rows();
        all.into_iter()
            .map(|id| {
                let id = id as usize;
                if mine.contains(&id) {
                    (id - mine.start) as i32
                } else {
                    -1
                }
            })
            .collect()
    }

    /// The position in the whole sequence of each of `rows` token rows starting at row
    /// `first` of a `[B·t]` batch.
    fn row_positions(&self, first: usize, rows: usize, t: usize) -> Vec<i32> {
        (first..first + rows)
            .map(|r| self.whole.sequence.position(r % t, t) as i32)
            .collect()
    }

    pub(super) fn forward_cuda(
        &self,
        p: Params<'_>,
        ids: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let p = device_params(p);
        let (b, t, d) = (ids.dim(0), ids.dim(1), self.whole.dim);
        self.check_sequence(t);
        let tp = &self.tp;
        let local_ids = self.local_ids(&ids);
        // Rank 0 adds the positions before the sum (every rank's rows sum to the token's
        // embedding; the positions are then counted once).
        let positions =
            (self.whole.learned_positions && tp.rank() == 0).then(|| self.row_positions(0, t, t));
        let y = ok(ops::embedding_forward(
            p.device(),
            &local_ids,
            p,
            self.rows().len(),
            d,
            positions.as_deref(),
        ));
        let y = Tensor::from_cuda(y, &[b, t, d]);
        let y = if tp.sequence_parallel {
            let local_shape = [b * t / tp.size(), d];
            start_scatter(tp, y, &local_shape).wait("reduce-scatter of the embedding")
        } else {
            start_all_reduce(tp, y).wait("all-reduce of the embedding")
        };
        if mode.train {
            s.tensors.push(ids);
        }
        y
    }

    pub(super) fn backward_cuda(&self, g: ParamsMut<'_>, mut s: Saved, dy: Tensor) {
        let ids = s.tensors.pop().expect("embedding: saved ids");
        let (t, d) = (ids.dim(1), self.whole.dim);
        let tp = &self.tp;
        let rows = self.rows().len();
        let (gtok, gpos) = device_grads(g).split_at(rows * d);
        let dys = dy.cuda().expect("a device output gradient");
        // Position gradients from this rank's rows (all of them without sequence
        // parallelism; summed over the group later with it), grouped by position.
        if self.whole.learned_positions {
            let n = dy.numel() / d;
            let first = if tp.sequence_parallel {
                tp.rank() * n
            } else {
                0
            };
            let positions = self.row_positions(first, n, t);
            ok(ops::embedding_backward(
                dys,
                &positions,
                gpos,
                self.whole.max_seq,
                d,
                None,
            ));
        }
        let full = if tp.sequence_parallel {
            let full_shape = [ids.numel(), d];
            tp.gathered(dy, &full_shape, "all-gather of the embedding gradient")
        } else {
            dy
        };
        let fulls = full.cuda().expect("a device output gradient");
        ok(ops::embedding_backward(
            fulls,
            &self.local_ids(&ids),
            gtok,
            rows,
            d,
            None,
        ));
    }
}

impl VocabParallelCrossEntropy {
    /// The group's all-reduce of per-row numbers `x` (device f32), in place.
    fn all_reduce_rows(&self, x: meshtrain_tensor::cuda::CudaTensor, op: ReduceOp) -> Tensor {
        let n = x.len();
        let mut t = Tensor::from_cuda(x, &[n]);
        // SAFETY: `t` lives here, untouched, until the operation has been waited for.
        let work = unsafe { self.group.all_reduce_async(tensor_view(&mut t), op) };
        if let Err(e) = work.and_then(|w| w.wait()) {
            fail("all-reduce of the loss's per-row numbers", e)
        }
        t
    }

    pub(super) fn forward_backward_cuda(
        &self,
        output: Tensor,
        targets: &[u32],
        targets_on_device: u64,
        grad_scale: Option<f32>,
        sums: u64,
    ) -> Result<(Option<LossValue>, Option<Tensor>), LossError> {
        self.check_output(&output, targets)?;
        let Some(logits) = output.cuda().cloned() else {
            return on_the_host(self, output, targets, grad_scale);
        };
        let rows = targets.len();
        let ids = self.ids();
        let xent = ops::VocabParallelXent {
            rows,
            cols: self.columns,
            real: ids.len(),
            start: ids.start,
        };
        let shape = output.shape().to_vec();
        drop(output);
        let m = self.all_reduce_rows(ok(xent.maxima(&logits)), ReduceOp::Max);
        let m = m.cuda().expect("device maxima");
        let row_sums = ok(xent.sums(&logits, targets_on_device, m));
        let row_sums = self.all_reduce_rows(row_sums, ReduceOp::Sum);
        let row_sums = row_sums.cuda().expect("device sums");
        let grad = ok(xent.finish(
            logits,
            targets_on_device,
            (m, row_sums),
            grad_scale.map(|s| s / rows as f32),
            sums,
        ));
        Ok((None, grad.map(|g| Tensor::from_cuda(g, &shape))))
    }
}
