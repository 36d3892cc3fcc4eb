//! The naive single-master data parallelism of PyTorch's `nn.DataParallel`, kept so users
//! can see why DDP wins.
//!
//! Per step the master (rank 0) scatters the batch, every rank computes forward and backward
//! on its share, the master gathers every rank's full gradient and sums it, updates the
//! weights alone, and broadcasts them back. Nothing overlaps with compute, the master moves
//! (N−1)·P floats in and P out every step while the others wait, and only the master holds
//! optimizer state — exactly the costs DDP's bucketed, overlapped all-reduce removes.

use super::DataParallelError;
use crate::engine::{Apply, CopyPlan, FlatBuf, Run, StageChunk, StateKind};
use meshtrain_comm::{BufMut, BufRef, Operation, ProcessGroup};
use std::sync::Arc;

// Tags at most 32767, the most MPI guarantees (`MPI_TAG_UB`).
const TAG_INPUT: u32 = 0x5CA1;
const TAG_TARGET: u32 = 0x5CA2;
const TAG_GRADS: u32 = 0x5CA3;

/// The single-master synchroniser of one rank.
pub struct SingleMaster {
    group: Arc<dyn ProcessGroup>,
    /// Per chunk (by global index), in the chunk's memory.
    scratch: Vec<Scratch>,
}

/// The master rank.
pub const MASTER: usize = 0;

impl SingleMaster {
    pub fn new(group: Arc<dyn ProcessGroup>) -> Self {
        SingleMaster {
            group,
            scratch: Vec::new(),
        }
    }

    pub fn is_master(&self) -> bool {
        self.group.rank() == MASTER
    }

    /// The master splits a global batch (inputs of `sample_len` floats per sample, one target
    /// per sample) into equal contiguous shares and sends rank r its share; every rank
    /// returns its own. Non-masters pass `None` and the share size.
    pub fn scatter(
        &self,
        global: Option<(&[f32], &[u32])>,
        local_samples: usize,
        sample_len: usize,
        targets_per_sample: usize,
    ) -> Result<(Vec<f32>, Vec<u32>), DataParallelError> {
        let (xl, yl) = (
            local_samples * sample_len,
            local_samples * targets_per_sample,
        );
        let err = |e| DataParallelError::comm("scattering the batch from the master", e);
        if self.is_master() {
            let (x, y) = global.ok_or_else(|| {
                DataParallelError::Config("the master must be given the global batch".into())
            })?;
            let world = self.group.size();
            if x.len() != xl * world || y.len() != yl * world {
                return Err(DataParallelError::Config(format!(
                    "global batch of {} inputs / {} targets does not split into {world} shares of {xl} / {yl}",
                    x.len(),
                    y.len()
                )));
            }
            for r in 1..world {
                let targets: Vec<f32> = y[r * yl..(r + 1) * yl].iter().map(|&t| t as f32).collect();
                self.group
                    .send(BufRef::F32(&x[r * xl..(r + 1) * xl]), r, TAG_INPUT)
                    .map_err(err)?;
                self.group
                    .send(BufRef::F32(&targets), r, TAG_TARGET)
                    .map_err(err)?;
            }
            Ok((x[..xl].to_vec(), y[..yl].to_vec()))
        } else {
            let mut x = vec![0.0f32; xl];
            let mut t = vec![0.0f32; yl];
            self.group
                .recv(BufMut::F32(&mut x), MASTER, TAG_INPUT)
                .map_err(err)?;
            self.group
                .recv(BufMut::F32(&mut t), MASTER, TAG_TARGET)
                .map_err(err)?;
            Ok((x, t.iter().map(|&v| v as u32).collect()))
        }
    }

    /// Every rank sends its gradients to the master, which adds them in rank order and
    /// divides by the world size. Afterwards only the master's hold the average. The
    /// gradients stay where the chunk's state lives: on a GPU they are sent and received as
    /// device buffers and added by the device, in the order the host adds them, so a GPU
    /// run equals the CPU's. Returns the bytes of this rank's gradients (what it put in).
    pub fn gather_gradients(&mut self, chunk: &mut StageChunk) -> Result<usize, DataParallelError> {
        let err = |e| DataParallelError::comm("gathering gradients on the master", e);
        let world = self.group.size();
        let grads = chunk.grads_buf();
        if !self.is_master() {
            // SAFETY: the chunk's gradients, untouched until the send returns.
            unsafe {
                self.group.run_raw(Operation::Send {
                    buf: grads,
                    dst: MASTER,
                    tag: TAG_GRADS,
                })
            }
            .map_err(err)?;
            return Ok(grads.size_bytes());
        }
        let memory = chunk.flat_memory();
        let fits = |s: &Scratch| {
            s.index == chunk.index
                && s.buf.device() == memory.device()
                && s.buf.len() == grads.len()
        };
        // A chunk's buffer is made once (again only if it moved to a device or resized).
        let scratch = match self.scratch.iter().position(fits) {
            Some(at) => &mut self.scratch[at],
            None => {
                self.scratch.retain(|s| s.index != chunk.index);
                self.scratch.push(Scratch {
                    index: chunk.index,
                    buf: memory.alloc(grads.len()),
                    add: CopyPlan::new(vec![Run {
                        src: Some(0),
                        dst: 0,
                        len: grads.len(),
                    }]),
                });
                self.scratch.last_mut().expect("just pushed")
            }
        };
        for r in 1..world {
            let received = scratch.buf.raw();
            // SAFETY: the scratch buffer, read only by the addition after the receive.
            unsafe {
                self.group.run_raw(Operation::Recv {
                    buf: received,
                    src: r,
                    tag: TAG_GRADS,
                })
            }
            .map_err(err)?;
            memory.apply(&scratch.add, received, grads, Apply::Add);
        }
        chunk.unscale_grads(1.0 / world as f32);
        Ok(grads.size_bytes())
    }

    /// The master's updated parameters (and buffers) go to every rank, from wherever the
    /// chunk's state lives (a device's buffers on a GPU; its few buffers, the running
    /// statistics of batch norms, through the host).
    pub fn broadcast_weights(&self, chunk: &mut StageChunk) -> Result<(), DataParallelError> {
        let err = |e| DataParallelError::comm("broadcasting the master's weights", e);
        let values = chunk.values_buf();
        // SAFETY: the chunk's parameters, untouched until the broadcast returns.
        unsafe {
            self.group.run_raw(Operation::Broadcast {
                buf: values,
                root: MASTER,
            })
        }
        .map_err(err)?;
        chunk.values_changed();
        let device = match chunk.device.as_mut() {
            Some(device) if device.state_len(StateKind::Buffers) > 0 => device,
            Some(_) => return Ok(()),
            None if chunk.store.buffers.is_empty() => return Ok(()),
            None => {
                return self
                    .group
                    .broadcast(BufMut::F32(&mut chunk.store.buffers), MASTER)
                    .map_err(err)
            }
        };
        let mut buffers = vec![0.0f32; device.state_len(StateKind::Buffers)];
        let device_err = |e: crate::engine::PipelineError| {
            DataParallelError::Config(format!("the master's buffers on the device: {e}"))
        };
        if self.is_master() {
            device
                .read(StateKind::Buffers, 0, &mut buffers)
                .map_err(device_err)?;
        }
        self.group
            .broadcast(BufMut::F32(&mut buffers), MASTER)
            .map_err(err)?;
        device
            .write(StateKind::Buffers, 0, &buffers)
            .map_err(device_err)
    }
}

/// The master's buffer for one chunk's received gradients, and the plan that adds it.
struct Scratch {
    index: usize,
    buf: FlatBuf,
    add: CopyPlan,
}
