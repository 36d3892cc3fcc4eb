//! Point-to-point transfer of tensors between pipeline stages.
//!
//! A message is a small shape header followed by the data, both sent with the same tag, so no
//! shapes need agreeing on beforehand (messages with one tag arrive in order). The tag is
//! derived from (micro-batch, receiving chunk, direction), so a receive names exactly the
//! tensor it waits for. Sends are posted asynchronously and the buffers kept until they
//! complete, so compute goes on while the communication thread copies. Tensors on a GPU go
//! from device memory to device memory (the header, a few numbers, from host memory): the
//! header carries the dtype, and the receiver allocates where its stage's activations live
//! ([`ActivationHome`]).

use super::PipelineError;
use crate::timeline::{Category, Timeline};
use meshtrain_comm::{CommError, ProcessGroup, RawBuf, Work};
use meshtrain_tensor::{DType, Tensor};

/// A tensor's values as a collective's buffer, wherever they live: host memory, or a GPU's
/// (in the tensor's dtype), so that one code sends activations on either device.
///
/// # Safety
/// As for [`RawBuf::on_device`]: `t` must stay alive, and nobody else (kernels included) may
/// read or write its values, until every operation given the view has completed.
pub unsafe fn tensor_view(t: &mut Tensor) -> RawBuf {
    #[cfg(feature = "cuda")]
    if let Some(c) = t.cuda() {
        // SAFETY: the caller's contract; the buffer holds `len` values of its dtype.
        return unsafe {
            RawBuf::on_device(
                c.ptr(),
                c.len(),
                c.dtype(),
                meshtrain_tensor::Device::Cuda(c.device().ordinal()),
            )
        };
    }
    // SAFETY: the caller's contract.
    unsafe { RawBuf::from_slice(t.data_mut()) }
}

/// A tensor of `shape` where `like` lives and in its dtype, its values unspecified (what a
/// receive writes into).
pub fn tensor_like(like: &Tensor, shape: &[usize]) -> Tensor {
    ActivationHome::of(like)
        .tensor_for_overwrite(shape, like.dtype())
        .expect("a host tensor is f32, which host memory holds")
}

/// Where a stage's activations live, so a received tensor lands there: host memory, or the
/// stage's GPU (the chunk's [`super::DeviceState::activation_home`]).
#[derive(Clone, Default)]
pub enum ActivationHome {
    #[default]
    Host,
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<meshtrain_tensor::cuda::CudaDevice>),
}

impl ActivationHome {
    /// Where `t` lives.
    pub fn of(t: &Tensor) -> ActivationHome {
        #[cfg(feature = "cuda")]
        if let Some(c) = t.cuda() {
            return ActivationHome::Cuda(c.device().clone());
        }
        let _ = t; // a host tensor
        ActivationHome::Host
    }

    /// A tensor of `shape` and `dtype` here, its values unspecified; `None` for a dtype this
    /// home cannot hold (host activations are f32).
    fn tensor_for_overwrite(&self, shape: &[usize], dtype: DType) -> Option<Tensor> {
        match self {
            ActivationHome::Host => (dtype == DType::F32).then(|| Tensor::for_overwrite(shape)),
            #[cfg(feature = "cuda")]
            ActivationHome::Cuda(dev) => {
                let n = shape.iter().product();
                let values = meshtrain_tensor::cuda::error::ok_or_raise(
                    meshtrain_tensor::cuda::CudaTensor::alloc(dev, n, dtype, "a received tensor"),
                );
                Some(Tensor::from_cuda(values, shape))
            }
        }
    }
}

/// Tags every backend accepts (MPI guarantees 0..=32767).
pub(super) const TAG_LIMIT: usize = 32768;
/// Header: number of dimensions, then up to 6 dimensions, then the data's dtype, as exact
/// f32 integers.
const HEADER_LEN: usize = 8;
/// Where the header keeps the dtype.
const HEADER_DTYPE: usize = HEADER_LEN - 1;
/// Largest dimension an f32 header carries exactly.
const MAX_HEADER_DIM: usize = 1 << 24;

/// The dtype's number in a header.
fn dtype_code(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1.0,
        DType::BF16 => 2.0,
        DType::F16 => 3.0,
    }
}

fn dtype_of_code(code: f32) -> Option<DType> {
    [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .find(|&d| dtype_code(d) == code)
}

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

/// A posted send and the tensor it reads. Field order matters: `work` is dropped (which
/// waits for the send) before `payload` is freed.
pub(super) struct PendingSend {
    work: Work,
    _payload: Tensor,
    /// The timeline's name and micro-batch of the transfer (the data, not the header).
    transfer: Option<(String, usize)>,
}

impl PendingSend {
    /// Waits for the send; with a timeline, records when it ran, on the communication row
    /// (the compute row's `send` span is only its posting).
    pub(super) fn finish(self, timeline: &mut Option<&mut Timeline>) -> Result<(), CommError> {
        let PendingSend {
            work,
            _payload,
            transfer,
        } = self;
        let span = work.wait_timed()?;
        if let (Some(t), Some((label, micro))) = (timeline.as_deref_mut(), transfer) {
            t.record(
                label,
                Category::Communication,
                span.began,
                span.finished,
                Some(micro),
            );
        }
        Ok(())
    }
}

/// Finishes the sends of `pending` that are done (keeping their errors), so the list stays
/// short and their transfers reach the timeline.
pub(super) fn finish_done(
    pending: &mut Vec<PendingSend>,
    timeline: &mut Option<&mut Timeline>,
) -> Result<(), CommError> {
    let mut k = 0;
    while k < pending.len() {
        if pending[k].work.is_done() {
            pending.swap_remove(k).finish(timeline)?;
        } else {
            k += 1;
        }
    }
    Ok(())
}

/// Finishes every send of `pending`.
pub(super) fn finish_all(
    pending: Vec<PendingSend>,
    timeline: &mut Option<&mut Timeline>,
) -> Result<(), CommError> {
    for send in pending {
        send.finish(timeline)?;
    }
    Ok(())
}

/// Sends the header and the data of `t` (host or device memory, any dtype) to `dst` without
/// waiting for the receiver; `transfer` names the data's transfer for the timeline
/// ([`PendingSend::finish`]).
pub(super) fn post_send(
    group: &dyn ProcessGroup,
    t: Tensor,
    (dst, tag): (usize, u32),
    mode: SendMode,
    pending: &mut Vec<PendingSend>,
    transfer: Option<(String, usize)>,
) -> Result<(), PipelineError> {
    let shape = t.shape();
    if shape.len() >= HEADER_DTYPE || shape.iter().any(|&d| d >= MAX_HEADER_DIM) {
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
    header[HEADER_DTYPE] = dtype_code(t.dtype());
    // A device tensor always goes asynchronously: a GPU backend's send may complete only
    // once it is received, and waiting for that here could wait for a receive the peer
    // posts only after its own send to us.
    if mode == SendMode::Inline && t.device().is_cpu() {
        group.send((&header).into(), dst, tag)?;
        group.send(t.data().into(), dst, tag)?;
        return Ok(());
    }
    let header = Tensor::from_vec(header, &[HEADER_LEN]);
    for (mut payload, transfer) in [(header, None), (t, transfer)] {
        // SAFETY: the values of `payload` do not move when the tensor moves into the
        // PendingSend, which waits for the send (in `Drop` of `Work`, or explicitly) before
        // freeing them; nothing else reads or writes them meanwhile.
        let work = unsafe { group.send_async(tensor_view(&mut payload), dst, tag) }?;
        pending.push(PendingSend {
            work,
            _payload: payload,
            transfer,
        });
    }
    Ok(())
}

/// Receives a header and then the tensor it describes, into `home`.
pub(super) fn recv_tensor(
    group: &dyn ProcessGroup,
    src: usize,
    tag: u32,
    home: &ActivationHome,
) -> Result<Tensor, PipelineError> {
    let mut header = vec![0.0f32; HEADER_LEN];
    group.recv((&mut header).into(), src, tag)?;
    let bad = |details: String| PipelineError::BadHeader {
        rank: group.rank(),
        src,
        details,
    };
    let ndim = header[0] as usize;
    if header[0] != ndim as f32 || ndim == 0 || ndim >= HEADER_DTYPE {
        return Err(bad(format!("{header:?}")));
    }
    let dtype = dtype_of_code(header[HEADER_DTYPE])
        .ok_or_else(|| bad(format!("no dtype numbered {}", header[HEADER_DTYPE])))?;
    let shape: Vec<usize> = header[1..=ndim].iter().map(|&d| d as usize).collect();
    let mut t = home.tensor_for_overwrite(&shape, dtype).ok_or_else(|| {
        bad(format!(
            "a {dtype:?} tensor sent to a stage whose activations are host f32 (stages on \
             different devices?)"
        ))
    })?;
    if t.device().is_cpu() {
        group.recv(t.data_mut().into(), src, tag)?;
    } else {
        // SAFETY: `t` lives here, untouched, until the receive has been waited for.
        unsafe { group.recv_async(tensor_view(&mut t), src, tag) }?.wait()?;
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshtrain_comm::{CommConfig, ThreadsWorld};

    /// A tensor goes from one stage to the next with its shape and dtype, in either send mode,
    /// and a header naming a dtype the receiving stage cannot hold is refused by name.
    #[test]
    fn tensors_arrive_with_their_shape_and_dtype_and_a_foreign_dtype_is_refused() {
        let got = ThreadsWorld::run(2, CommConfig::default(), |group| {
            let values: Vec<f32> = (0..24).map(|v| v as f32 * 0.5 - 3.0).collect();
            if group.rank() == 0 {
                let mut pending = Vec::new();
                for (tag, mode) in [(1, SendMode::Async), (2, SendMode::Inline)] {
                    let t = Tensor::from_vec(values.clone(), &[2, 3, 4]);
                    post_send(group.as_ref(), t, (1, tag), mode, &mut pending, None)?;
                }
                // A header that says bf16, as a GPU stage would send.
                let mut header = vec![0.0f32; HEADER_LEN];
                header[..3].copy_from_slice(&[2.0, 3.0, 8.0]);
                header[HEADER_DTYPE] = dtype_code(DType::BF16);
                group.send((&header).into(), 1, 3)?;
                finish_all(pending, &mut None)?;
                return Ok::<_, PipelineError>(Vec::new());
            }
            let home = ActivationHome::Host;
            let mut seen = Vec::new();
            for tag in [1, 2] {
                let t = recv_tensor(group.as_ref(), 0, tag, &home)?;
                assert_eq!(t.shape(), &[2, 3, 4]);
                assert_eq!(t.data(), values.as_slice());
                seen.push(t.dtype());
            }
            let e = recv_tensor(group.as_ref(), 0, 3, &home)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("BF16 tensor sent to a stage whose activations are host f32"),
                "{e}"
            );
            Ok(seen)
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got[1], vec![DType::F32, DType::F32]);
    }

    #[test]
    fn every_dtype_has_its_own_header_number() {
        for d in [DType::F32, DType::BF16, DType::F16] {
            assert_eq!(dtype_of_code(dtype_code(d)), Some(d));
        }
        assert_eq!(dtype_of_code(0.0), None);
        assert_eq!(dtype_of_code(1.5), None);
    }
}
