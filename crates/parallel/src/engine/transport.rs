//! Point-to-point transfer of tensors between pipeline stages.
//!
//! A message is a small shape header followed by the data, both sent with the same tag, so no
//! shapes need agreeing on beforehand (messages with one tag arrive in order). The tag is
//! derived from (micro-batch, receiving chunk, direction), so a receive names exactly the
//! tensor it waits for. Sends are posted asynchronously and the buffers kept until they
//! complete, so compute goes on while the communication thread copies.

use super::PipelineError;
use meshtrain_comm::{ProcessGroup, RawBuf, Work};
use meshtrain_tensor::Tensor;

/// Tags every backend accepts (MPI guarantees 0..=32767).
pub(super) const TAG_LIMIT: usize = 32768;
/// Header: number of dimensions, then up to 7 dimensions, as exact f32 integers.
const HEADER_LEN: usize = 8;
/// Largest dimension an f32 header carries exactly.
const MAX_HEADER_DIM: usize = 1 << 24;

/// How a stage sends its tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SendMode {
    /// Posted to the rank's communication thread; compute goes on at once. Overlaps the
    /// transfer with compute when a core is free for that thread.
    #[default]
    Async,
    /// Done on the compute thread before it goes on (a buffered send is one copy). Better when
    /// the workers already occupy every core: a hand-off to the communication thread then
    /// waits to be scheduled, and the receiver waits with it (see docs/pipeline.md).
    Inline,
}

#[derive(Clone, Copy)]
pub(super) enum Direction {
    Activation = 0,
    Grad = 1,
}

/// The tag of the message carrying `dir` data of micro-batch `micro` to chunk `chunk`.
pub(super) fn tag(chunk: usize, micro: usize, dir: Direction, num_chunks: usize) -> u32 {
    ((micro * num_chunks + chunk) * 2 + dir as usize) as u32
}

/// A posted send and the buffer it reads. Field order matters: `work` is dropped (which
/// waits for the send) before `payload` is freed.
pub(super) struct PendingSend {
    pub(super) work: Work,
    _payload: Vec<f32>,
}

/// Sends the header and the data of `t` to `dst` without waiting for the receiver.
pub(super) fn post_send(
    group: &dyn ProcessGroup,
    t: Tensor,
    dst: usize,
    tag: u32,
    mode: SendMode,
    pending: &mut Vec<PendingSend>,
) -> Result<(), PipelineError> {
    let shape = t.shape();
    if shape.len() >= HEADER_LEN || shape.iter().any(|&d| d >= MAX_HEADER_DIM) {
        return Err(PipelineError::BadHeader {
            rank: group.rank(),
            src: group.rank(),
            details: format!("cannot describe shape {shape:?} in a header"),
        });
    }
    let mut header = vec![0.0f32; HEADER_LEN];
    header[0] = shape.len() as f32;
    header[1..=shape.len()]
        .iter_mut()
        .zip(shape)
        .for_each(|(h, &d)| *h = d as f32);
    if mode == SendMode::Inline {
        group.send((&header).into(), dst, tag)?;
        group.send((&t.into_vec()).into(), dst, tag)?;
        return Ok(());
    }
    // Finished sends are collected as we go (keeping their errors), so the list stays short.
    let mut k = 0;
    while k < pending.len() {
        if pending[k].work.is_done() {
            pending.swap_remove(k).work.wait()?;
        } else {
            k += 1;
        }
    }
    for mut payload in [header, t.into_vec()] {
        // SAFETY: the heap block of `payload` does not move when the Vec moves into the
        // PendingSend, which waits for the send (in `Drop` of `Work`, or explicitly) before
        // freeing it; nothing else reads or writes it meanwhile.
        let work =
            unsafe { group.send_async(RawBuf::from_slice(payload.as_mut_slice()), dst, tag) }?;
        pending.push(PendingSend {
            work,
            _payload: payload,
        });
    }
    Ok(())
}

/// Receives a header and then the tensor it describes.
pub(super) fn recv_tensor(
    group: &dyn ProcessGroup,
    src: usize,
    tag: u32,
) -> Result<Tensor, PipelineError> {
    let mut header = vec![0.0f32; HEADER_LEN];
    group.recv((&mut header).into(), src, tag)?;
    let bad = |details: String| PipelineError::BadHeader {
        rank: group.rank(),
        src,
        details,
    };
    let ndim = header[0] as usize;
    if header[0] != ndim as f32 || ndim == 0 || ndim >= HEADER_LEN {
        return Err(bad(format!("{header:?}")));
    }
    let shape: Vec<usize> = header[1..=ndim].iter().map(|&d| d as usize).collect();
    let mut data = vec![0.0f32; shape.iter().product()];
    group.recv((&mut data).into(), src, tag)?;
    Ok(Tensor::from_vec(data, &shape))
}
