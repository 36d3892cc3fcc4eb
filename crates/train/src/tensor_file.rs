//! A safetensors writer that streams each tensor from where it lives: host memory, written
//! as it is, or a worker's state on a device ([`Parallel::read_state`]), read a bounded
//! piece at a time. The safetensors crate's own writer takes whole tensors as byte slices,
//! and a whole-file checkpoint's `optimizer.m` is one tensor the size of the model: on a GPU
//! that would mean a full host copy of the model, which is what this module avoids.
//!
//! The file is the crate's, byte for byte: the header comes from the crate itself (its
//! serializer given the tensors' names, shapes and lengths but no bytes), and the data
//! follows in the order that header gives (by name, every tensor being F32). Each tensor's
//! CRC-32 is computed as its bytes pass, for the sharded index.

use anyhow::{Context, Result};
use meshtrain_parallel::engine::StateKind;
use meshtrain_parallel::parallelize::StateRange;
use meshtrain_parallel::Parallel;
use safetensors::tensor::{Dtype, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::ops::Range;
use std::path::Path;

/// Elements read from a device at a time: 64 MiB of f32, the most a write holds on the host
/// beyond the file's buffer.
pub const PIECE_ELEMENTS: usize = 16 << 20;

/// Where a tensor's elements are.
#[derive(Clone, Debug)]
pub enum TensorData<'a> {
    /// In host memory, borrowed from the training state or owned by a background writer.
    Host(Cow<'a, [f32]>),
    /// A run of a worker's state, wherever it lives ([`Parallel::read_state`]).
    State(StateRange),
    /// Elements of the chunk's full-layout parameters or moments that ZeRO cut over the
    /// ranks, gathered a window at a time ([`Parallel::gather_range`]: every rank takes part,
    /// the writing rank through [`write`], the others through [`serve`]).
    Gathered(StateKind, Range<usize>),
}

/// One tensor of a file: its name, shape and elements.
#[derive(Clone, Debug)]
pub struct OutTensor<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TensorData<'a>,
}

impl TensorData<'_> {
    pub fn len(&self) -> usize {
        match self {
            TensorData::Host(values) => values.len(),
            TensorData::State(at) => at.range.len(),
            TensorData::Gathered(_, range) => range.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements in host memory, read from `source` when they are elsewhere (a background
    /// writer's copy).
    pub fn into_owned(self, source: Option<&Parallel>) -> Result<TensorData<'static>> {
        Ok(TensorData::Host(Cow::Owned(match self {
            TensorData::Host(values) => values.into_owned(),
            TensorData::State(at) => {
                let source = source.context("a tensor of the worker's state without the worker")?;
                let mut values = vec![0.0; at.range.len()];
                source.read_state(&at, 0, &mut values)?;
                values
            }
            TensorData::Gathered(..) => {
                anyhow::bail!("a gathered tensor is written as it is gathered, never copied")
            }
        })))
    }
}

/// A tensor as the crate's header sees it: a name, a shape and a byte length, no bytes.
struct HeaderOnly {
    shape: Vec<usize>,
    bytes: usize,
}

impl View for &HeaderOnly {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&[])
    }

    fn data_len(&self) -> usize {
        self.bytes
    }
}

/// The 8-byte length and JSON header of a safetensors file of `tensors`, as the crate writes
/// them.
fn header(tensors: &[OutTensor], metadata: &Option<HashMap<String, String>>) -> Result<Vec<u8>> {
    let stubs: Vec<(String, HeaderOnly)> = (tensors.iter())
        .map(|t| {
            let stub = HeaderOnly {
                shape: t.shape.clone(),
                bytes: 4 * t.data.len(),
            };
            (t.name.clone(), stub)
        })
        .collect();
    let views = stubs.iter().map(|(name, stub)| (name.as_str(), stub));
    Ok(safetensors::serialize(views, metadata)?)
}

/// The pieces a file of `tensors` is written in: (tensor index, elements of that tensor),
/// tensors in the header's order (by name: every tensor is F32), at most `piece_elements`
/// each. The writer and the ranks serving a gather go through the same list.
fn pieces(tensors: &[OutTensor], piece_elements: usize) -> Vec<(usize, Range<usize>)> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| tensors[a].name.cmp(&tensors[b].name));
    let mut out = Vec::new();
    for i in order {
        let len = tensors[i].data.len();
        out.extend(
            (0..len)
                .step_by(piece_elements)
                .map(|at| (i, at..len.min(at + piece_elements))),
        );
    }
    out
}

/// Writes `tensors` as a safetensors file at `path` (not atomically: see
/// [`crate::checkpoint::replace_atomically`]), reading [`TensorData::State`] tensors held on
/// a device through `source`, and gathering [`TensorData::Gathered`] ones (the other ranks
/// in [`serve`]), at most `piece_elements` at a time ([`PIECE_ELEMENTS`] unless a caller
/// bounds the host memory otherwise). Returns each tensor's CRC-32, in the order of
/// `tensors`. A file that cannot be written still takes its part in every gather, so the
/// other ranks never wait for it; the error comes at the end.
pub fn write(
    path: &Path,
    tensors: &[OutTensor],
    metadata: &Option<HashMap<String, String>>,
    source: Option<&Parallel>,
    piece_elements: usize,
) -> Result<Vec<u32>> {
    anyhow::ensure!(
        piece_elements > 0,
        "writing {}: pieces of no elements",
        path.display()
    );
    let written = |e| anyhow::Error::new(e).context(format!("writing {}", path.display()));
    let mut failed: Option<anyhow::Error> = None;
    let mut out = match std::fs::File::create(path) {
        // Small tensors gather in the buffer; a larger slice (or a device piece) bypasses it.
        Ok(file) => Some(std::io::BufWriter::with_capacity(256 << 10, file)),
        Err(e) => {
            failed = Some(anyhow::Error::new(e).context(format!("creating {}", path.display())));
            None
        }
    };
    if let Some(out) = &mut out {
        if let Err(e) = out.write_all(&header(tensors, metadata)?) {
            failed = Some(written(e));
        }
    }
    let need = || source.context("a tensor of the worker's state without the worker");
    let mut crcs = vec![crc32fast::Hasher::new(); tensors.len()];
    let mut piece = Vec::new();
    for (i, part) in pieces(tensors, piece_elements) {
        let name = &tensors[i].name;
        let values: &[f32] = match &tensors[i].data {
            _ if failed.is_some() && !matches!(tensors[i].data, TensorData::Gathered(..)) => {
                continue;
            }
            TensorData::Host(values) => &values[part],
            TensorData::State(at) => match need()?.host_state(at) {
                Some(values) => &values[part],
                None => {
                    piece.resize(part.len(), 0.0);
                    need()?
                        .read_state(at, part.start, &mut piece)
                        .with_context(|| format!("reading {name} from the device"))?;
                    &piece
                }
            },
            TensorData::Gathered(kind, range) => {
                piece.resize(part.len(), 0.0);
                let window = range.start + part.start..range.start + part.end;
                (need()?.gather_range(*kind, window, Some(&mut piece)))
                    .with_context(|| format!("gathering {name} from the ranks' pieces"))?;
                &piece
            }
        };
        if failed.is_some() {
            continue;
        }
        let bytes: &[u8] = bytemuck::cast_slice(values);
        crcs[i].update(bytes);
        if let Some(out) = &mut out {
            if let Err(e) = out.write_all(bytes) {
                failed = Some(written(e));
            }
        }
    }
    if let (None, Some(out)) = (&failed, &mut out) {
        if let Err(e) = out.flush() {
            failed = Some(written(e));
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(crcs.into_iter().map(crc32fast::Hasher::finalize).collect()),
    }
}

/// A rank's part in the gathers of a file another rank [`write`]s with the same `tensors`
/// (in its own layout: the same names and lengths) and `piece_elements`: its runs of every
/// [`TensorData::Gathered`] piece, sent in the writer's order.
pub fn serve(tensors: &[OutTensor], source: &Parallel, piece_elements: usize) -> Result<()> {
    for (i, part) in pieces(tensors, piece_elements) {
        if let TensorData::Gathered(kind, range) = &tensors[i].data {
            let window = range.start + part.start..range.start + part.end;
            (source.gather_range(*kind, window, None))
                .with_context(|| format!("sending my pieces of {}", tensors[i].name))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(len: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).max(1);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as f32 / u32::MAX as f32 - 0.5
            })
            .collect()
    }

    #[test]
    fn writes_the_crates_file_byte_for_byte_with_each_tensors_checksum() {
        let dir =
            std::env::temp_dir().join(format!("meshtrain-tensor-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let shapes: [(&str, Vec<usize>); 4] = [
            ("param.b", vec![3]),
            ("optimizer.m", vec![17]),
            ("param.a", vec![2, 5]),
            ("buffer.empty", vec![0]),
        ];
        let values: Vec<Vec<f32>> = (shapes.iter().enumerate())
            .map(|(i, (_, shape))| random(shape.iter().product(), i as u32 + 1))
            .collect();
        let tensors: Vec<OutTensor> = (shapes.iter().zip(&values))
            .map(|((name, shape), v)| OutTensor {
                name: name.to_string(),
                shape: shape.clone(),
                data: TensorData::Host(Cow::Borrowed(v)),
            })
            .collect();
        let metadata: Option<HashMap<String, String>> =
            Some([("format".into(), "x".into()), ("step".into(), "7".into())].into());
        let path = dir.join("a.safetensors");
        let crcs = write(&path, &tensors, &metadata, None, PIECE_ELEMENTS).unwrap();
        let views: Vec<(&str, safetensors::tensor::TensorView)> = (shapes.iter().zip(&values))
            .map(|((name, shape), v)| {
                let view = safetensors::tensor::TensorView::new(
                    Dtype::F32,
                    shape.clone(),
                    bytemuck::cast_slice(v),
                )
                .unwrap();
                (*name, view)
            })
            .collect();
        let expected = safetensors::serialize(views, &metadata).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), expected);
        for (crc, v) in crcs.iter().zip(&values) {
            assert_eq!(*crc, crc32fast::hash(bytemuck::cast_slice(v)));
        }
        // A state tensor without the worker it belongs to is an error, not a panic.
        let orphan = [OutTensor {
            name: "param.x".into(),
            shape: vec![2],
            data: TensorData::State(StateRange {
                chunk: 0,
                kind: meshtrain_parallel::engine::StateKind::Values,
                range: 0..2,
            }),
        }];
        assert!(write(&path, &orphan, &None, None, PIECE_ELEMENTS).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
