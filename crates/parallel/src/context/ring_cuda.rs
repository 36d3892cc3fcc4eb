//! Ring attention's GPU arm: the same ring as on the CPU ([`RingAttention::around_the_ring`],
//! the accumulators' hand-off), the block products on `cuda::ops::ring`'s kernels. The
//! forward keeps the output and log-sum-exp in f32 between blocks (each pair's result merged
//! by the log-sum-exp rule inside the kernel) and hands the layer's dtype on; the backward
//! adds every pair's gradients into f32 accumulators (dQ here, dK/dV into the held block's,
//! which travels in f32) and joins them into the fused gradient at the end.

use super::{Hop, RingAttention};
use meshtrain_nn::{Mode, Saved};
use meshtrain_tensor::cuda::error::ok_or_raise as ok;
use meshtrain_tensor::cuda::ops::{self, ring, AttnShape};
use meshtrain_tensor::cuda::CudaTensor;
use meshtrain_tensor::Tensor;

impl RingAttention {
    fn cuda_shape(&self, qkv: &Tensor) -> AttnShape {
        AttnShape {
            batch: qkv.dim(0),
            seq: qkv.dim(1),
            heads: self.heads,
            head_dim: self.dim / self.heads,
        }
    }

    /// The device block `[B, rows, 2·D]` that travels, from this worker's q/k/v.
    fn own_block_cuda(&self, q: &CudaTensor, shape: AttnShape) -> Tensor {
        let kv = ok(ring::keys_values(q, shape));
        Tensor::from_cuda(kv, &[shape.batch, shape.seq, 2 * self.dim])
    }

    pub(super) fn forward_cuda(&self, qkv: Tensor, mode: Mode, s: &mut Saved) -> Tensor {
        let shape = self.cuda_shape(&qkv);
        let q = ok(ops::to_dtype(
            qkv.cuda().expect("device q/k/v"),
            self.precision,
        ));
        let mut state = ok(ring::start(q.device(), shape));
        self.around_the_ring(self.own_block_cuda(&q, shape), |kv, pairs| {
            let kv = kv.cuda().expect("a device key/value block");
            for pair in pairs {
                ok(ring::forward_pair(&q, kv, &mut state, shape, pair));
            }
        });
        let out_shape = [shape.batch, shape.seq, self.dim];
        let out = Tensor::from_cuda(ok(ops::to_dtype(&state.out, self.precision)), &out_shape);
        if mode.train {
            s.tensors.push(Tensor::from_cuda(q, qkv.shape()));
            s.tensors.push(out.clone());
            let lse_shape = [shape.batch, shape.heads, shape.seq];
            s.tensors.push(Tensor::from_cuda(state.lse, &lse_shape));
        }
        out
    }

    pub(super) fn backward_cuda(&self, mut s: Saved, dy: Tensor) -> Tensor {
        let mut kept = |what: &str| {
            s.tensors
                .pop()
                .unwrap_or_else(|| panic!("ring attention ({what}): nothing saved for backward"))
        };
        let lse = kept("log-sum-exp");
        let out = kept("output");
        let qkv = kept("q, k, v");
        let shape = self.cuda_shape(&qkv);
        let device = |t: &Tensor, what: &str| -> CudaTensor {
            t.cuda()
                .unwrap_or_else(|| panic!("ring attention ({what}): a host tensor on a GPU run"))
                .clone()
        };
        let (q, lse, out, dy) = (
            device(&qkv, "q, k, v"),
            device(&lse, "log-sum-exp"),
            device(&out, "output"),
            device(&dy, "output gradient"),
        );
        let rows = ok(ring::backward_rows(&out, &dy, self.precision, shape));
        let n = shape.batch * shape.seq * self.dim;
        let mut dq = ok(ring::accumulator(q.device(), n));
        let mut accumulator: Option<Hop> = None;
        self.around_the_ring(self.own_block_cuda(&q, shape), |kv, pairs| {
            let kv = kv.cuda().expect("a device key/value block");
            let mut dkv = ok(ring::accumulator(q.device(), 2 * n));
            for pair in pairs {
                let upstream = (&rows.0, &rows.1);
                ok(ring::backward_pair(
                    &q, kv, upstream, &lse, &mut dq, &mut dkv, shape, pair,
                ));
            }
            self.pass_on(&mut accumulator, Tensor::from_cuda(dkv, &[2 * n]));
        });
        let own = self.home(accumulator);
        let own = own.cuda().expect("a device accumulator");
        Tensor::from_cuda(ok(ring::join(&dq, own, self.precision, shape)), qkv.shape())
    }
}
