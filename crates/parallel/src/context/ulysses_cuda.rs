//! Ulysses' GPU arm: the same reshuffles as on the CPU, as copy plans
//! ([`UlyssesMoves`], built once per shape, their run tables uploaded once) run by the
//! device's copy kernel around an all-to-all of device buffers; the attention between them
//! is the model's own kernel on this worker's heads.

use super::{fail, CachedMoves, CpCommStats, UlyssesAttention, UlyssesMoves};
use crate::engine::flat::CopyPlan;
use crate::engine::{tensor_like, tensor_view};
use meshtrain_tensor::cuda::error::ok_or_raise as ok;
use meshtrain_tensor::cuda::{train_ops, CudaDevice, DevBuf};
use meshtrain_tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// A plan's runs as the copy kernel reads them: (source or −1, destination, length), i64.
fn run_table(plan: &CopyPlan) -> Vec<i64> {
    plan.runs()
        .iter()
        .flat_map(|r| [r.src.map_or(-1, |s| s as i64), r.dst as i64, r.len as i64])
        .collect()
}

impl CachedMoves {
    /// The pack and unpack tables in `dev`'s memory (uploaded on first use).
    fn tables(&self, dev: &Arc<CudaDevice>) -> &[DevBuf; 2] {
        self.tables.get_or_init(|| {
            let UlyssesMoves { pack, unpack } = &self.moves;
            [pack, unpack].map(|p| ok(dev.upload(&run_table(p), "Ulysses' copy plan")))
        })
    }
}

/// Runs `plan` (its table at `table`) from `src` into a new tensor of `shape` beside it.
fn moved(src: &Tensor, plan: &CopyPlan, table: &DevBuf, shape: &[usize]) -> Tensor {
    let from = src.cuda().expect("a device tensor");
    let out = tensor_like(src, shape);
    let to = out.cuda().expect("a device tensor");
    let max_len = plan.runs().iter().map(|r| r.len).max().unwrap_or(0);
    ok(train_ops::copy_runs_of(
        from.device(),
        from.dtype(),
        from.ptr(),
        to.ptr(),
        table.ptr(),
        plan.runs().len(),
        max_len,
    ));
    out
}

impl UlyssesAttention {
    /// One all-to-all of device tensor `send` (chunk j to worker j), counted.
    fn exchange_cuda(&self, mut send: Tensor) -> Tensor {
        let g = self.cp.group.as_ref();
        let mut received = tensor_like(&send, send.shape());
        let t = Instant::now();
        self.cp.stats.sent(send.numel() / g.size() * (g.size() - 1));
        // SAFETY: both tensors live here, untouched, until the operation has been waited for.
        let work =
            unsafe { g.all_to_all_async(tensor_view(&mut send), tensor_view(&mut received)) };
        if let Err(e) = work.and_then(|w| w.wait()) {
            fail("all-to-all", e)
        }
        CpCommStats::add(&self.cp.stats.exposed_ns, t.elapsed());
        CpCommStats::add(&self.cp.stats.busy_ns, t.elapsed());
        received
    }

    /// [`UlyssesAttention::to_heads`] on a GPU.
    pub(super) fn to_heads_cuda(&self, x: &Tensor, parts: usize) -> Tensor {
        let (n, b, rows) = (self.cp.group.size(), x.dim(0), x.dim(1));
        let width = x.dim(2) / parts;
        let cached = self.moves.get(true, [n, b, rows, width, parts]);
        let dev = x.cuda().expect("a device tensor").device().clone();
        let [pack, unpack] = cached.tables(&dev);
        let send = moved(x, &cached.moves.pack, pack, &[x.numel()]);
        let received = self.exchange_cuda(send);
        let shape = [b, rows * n, parts * width / n];
        moved(&received, &cached.moves.unpack, unpack, &shape)
    }

    /// [`UlyssesAttention::to_tokens`] on a GPU.
    pub(super) fn to_tokens_cuda(&self, y: &Tensor, parts: usize) -> Tensor {
        let (n, b, seq, row_len) = (self.cp.group.size(), y.dim(0), y.dim(1), y.dim(2));
        let cached = self.moves.get(false, [n, b, seq, row_len, parts]);
        let dev = y.cuda().expect("a device tensor").device().clone();
        let [pack, unpack] = cached.tables(&dev);
        let send = moved(y, &cached.moves.pack, pack, &[y.numel()]);
        let received = self.exchange_cuda(send);
        let shape = [b, seq / n, row_len * n];
        moved(&received, &cached.moves.unpack, unpack, &shape)
    }
}
