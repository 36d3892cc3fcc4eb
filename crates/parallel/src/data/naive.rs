//! The naive single-master data parallelism of PyTorch's `nn.DataParallel`, kept so users
//! can see why DDP wins.
//!
//! Per step the master (rank 0) scatters the batch, every rank computes forward and backward
//! on its share, the master gathers every rank's full gradient and sums it, updates the
//! weights alone, and broadcasts them back. Nothing overlaps with compute, the master moves
//! (N−1)·P floats in and P out every step while the others wait, and only the master holds
//! optimizer state — exactly the costs DDP's bucketed, overlapped all-reduce removes.

use super::DataParallelError;
use meshtrain_comm::{BufMut, BufRef, ProcessGroup};
use meshtrain_nn::ParamStore;
use std::sync::Arc;

const TAG_INPUT: u32 = 0x5CA7_0001;
const TAG_TARGET: u32 = 0x5CA7_0002;
const TAG_GRADS: u32 = 0x5CA7_0003;

/// The single-master synchroniser of one rank.
pub struct SingleMaster {
    group: Arc<dyn ProcessGroup>,
    scratch: Vec<f32>,
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
    /// divides by the world size. Afterwards only the master's `grads` hold the average.
    pub fn gather_gradients(&mut self, grads: &mut [f32]) -> Result<(), DataParallelError> {
        let err = |e| DataParallelError::comm("gathering gradients on the master", e);
        let world = self.group.size();
        if !self.is_master() {
            return self
                .group
                .send(BufRef::F32(grads), MASTER, TAG_GRADS)
                .map_err(err);
        }
        self.scratch.resize(grads.len(), 0.0);
        for r in 1..world {
            self.group
                .recv(BufMut::F32(&mut self.scratch), r, TAG_GRADS)
                .map_err(err)?;
            grads
                .iter_mut()
                .zip(&self.scratch)
                .for_each(|(g, s)| *g += s);
        }
        let inv = 1.0 / world as f32;
        grads.iter_mut().for_each(|g| *g *= inv);
        Ok(())
    }

    /// The master's updated parameters (and buffers) go to every rank.
    pub fn broadcast_weights(&self, store: &mut ParamStore) -> Result<(), DataParallelError> {
        let err = |e| DataParallelError::comm("broadcasting the master's weights", e);
        self.group
            .broadcast(BufMut::F32(&mut store.values), MASTER)
            .map_err(err)?;
        if !store.buffers.is_empty() {
            self.group
                .broadcast(BufMut::F32(&mut store.buffers), MASTER)
                .map_err(err)?;
        }
        Ok(())
    }
}
