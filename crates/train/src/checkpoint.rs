//! Checkpoints in safetensors: parameters and buffers by name, optimizer state, the step and
//! a description of the model, whatever layout wrote them (a pipeline gathers its stages
//! first), so any layout can continue from any checkpoint.
//!
//! Writing is atomic: a temporary file in the same directory, fsync, rename, fsync of the
//! directory — a crash leaves the previous checkpoint or the new one, never a torn file (a
//! stale temporary file from a crash is removed by the next run). A [`Snapshot`] is what a
//! save writes, borrowed from the training state (a synchronous save copies nothing) or
//! owned (`into_owned`: a background writer's copy, so training goes on while it is
//! written, see [`crate::writer`]). Reading trusts nothing:
//! a truncated or foreign file, a tensor of the wrong shape, non-finite values, or a
//! checkpoint of another model are errors that name the file.

use crate::dataset::SamplerPosition;
use crate::tensor_file::{OutTensor, TensorData};
use anyhow::{bail, Context, Result};
use meshtrain_nn::optim::Optimizer;
use meshtrain_nn::{Model, ParamStore};
use meshtrain_parallel::engine::StateKind;
use meshtrain_parallel::parallelize::StateRange;
use meshtrain_parallel::precision::LossScaler;
use meshtrain_parallel::Parallel;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "meshtrain-checkpoint-v1";

/// Where a checkpoint's parameters, buffers and optimizer state are.
#[derive(Clone, Copy)]
pub enum StateSource<'a> {
    /// A store and optimizer in host memory (a gathered copy, or a CPU worker's own).
    Host {
        store: &'a ParamStore,
        optimizer: &'a Optimizer,
    },
    /// A worker whose one chunk is the whole model, read wherever its state lives (on a
    /// device a bounded piece at a time, with no host copy of the model).
    Worker(&'a Parallel),
    /// ZeRO's ranks, each holding pieces of the one chunk
    /// ([`Parallel::gathers_by_range`]): the moments (and under stage 3 the parameters)
    /// gathered a window at a time as the file is written; every rank builds the same
    /// snapshot, one writes it ([`Snapshot::write`]) and the others serve the gathers
    /// ([`Snapshot::serve`]).
    Gathered(&'a Parallel),
}

/// Everything needed to continue a run exactly where it stopped.
pub struct TrainState<'a> {
    pub model: &'a Model,
    pub source: StateSource<'a>,
    /// Steps completed.
    pub step: u64,
    /// What model this is (compared on resume); empty = not checked.
    pub model_description: &'a str,
    /// The run's settings, for reference.
    pub config: &'a str,
    /// fp16's dynamic loss scale, so a resumed run continues with the same scale.
    pub loss_scaler: Option<LossScaler>,
    /// Where the data sampler stands (checked on resume).
    pub sampler: Option<SamplerPosition>,
}

/// What [`load`] restored.
#[derive(Clone, Debug, PartialEq)]
pub struct Restored {
    /// Steps completed when the checkpoint was written.
    pub step: u64,
    /// The model description it stores (empty if none).
    pub model_description: String,
    /// The fp16 loss scaler's state, if the run that wrote it had one.
    pub loss_scaler: Option<LossScaler>,
    /// The data sampler's position it records (checkpoints before it was recorded: none).
    pub sampler: Option<SamplerPosition>,
}

/// How much of a checkpoint to restore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restore {
    /// Parameters, buffers, optimizer state and step, for the same model (resume).
    Everything,
    /// Parameters and buffers only, into any model whose tensors match by name and shape
    /// (fine-tuning from another configuration's weights).
    Weights,
}

/// A safetensors file's JSON header, read without its tensors, with the file left open for
/// reading tensors at their offsets.
pub struct SafetensorsHeader {
    pub file: std::fs::File,
    /// Bytes of the JSON header (the data section starts at `8 + header_len`).
    pub header_len: u64,
    pub file_len: u64,
    /// Every entry of the header: tensors by name, and `__metadata__`.
    pub entries: HashMap<String, serde_json::Value>,
}

/// Reads the header of the safetensors file at `path`; `what` names it in errors
/// ("checkpoint shard …"): a missing file, a truncated or corrupt header.
pub fn read_safetensors_header(path: &Path, what: &str) -> Result<SafetensorsHeader> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)
        .with_context(|| format!("cannot open {what} {}", path.display()))?;
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .with_context(|| format!("{what} {} is truncated", path.display()))?;
    let header_len = u64::from_le_bytes(n);
    let file_len = file.metadata()?.len();
    anyhow::ensure!(
        header_len + 8 <= file_len && header_len < 100 << 20,
        "{what} {} is corrupt (bad header length)",
        path.display()
    );
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .with_context(|| format!("{what} {} is truncated", path.display()))?;
    let entries = serde_json::from_slice(&header)
        .with_context(|| format!("{what} {} has a corrupt header", path.display()))?;
    Ok(SafetensorsHeader {
        file,
        header_len,
        file_len,
        entries,
    })
}

/// The JSON entry `key` of a checkpoint's metadata, if it has one; a corrupt entry is an
/// error naming the file.
fn optional_json<T: serde::de::DeserializeOwned>(
    meta: &HashMap<String, String>,
    key: &str,
    path: &Path,
) -> Result<Option<T>> {
    meta.get(key)
        .map(|text| {
            serde_json::from_str(text).with_context(|| {
                format!(
                    "checkpoint {}: its {key} entry is corrupt: {text}",
                    path.display()
                )
            })
        })
        .transpose()
}

pub(crate) fn view(data: &[f32], shape: Vec<usize>) -> TensorView<'_> {
    TensorView::new(Dtype::F32, shape, bytemuck::cast_slice(data)).expect("tensor view sizes match")
}

/// The temporary file a save writes before renaming it over `path`.
pub fn temporary_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// What a checkpoint file holds: its tensors and metadata, borrowed from the training state
/// (in host memory, or read from the device as the file is written) or owned by a
/// background writer.
pub struct Snapshot<'a> {
    tensors: Vec<OutTensor<'a>>,
    metadata: HashMap<String, String>,
}

impl<'a> Snapshot<'a> {
    /// The checkpoint of `state`, borrowing its values (or naming where the worker holds
    /// them).
    pub fn of(state: &TrainState<'a>) -> Result<Snapshot<'a>> {
        let model = state.model;
        // Each tensor's elements: `range` of `kind` in the host store or the worker's chunk.
        let data = |kind: StateKind, range: Range<usize>| -> TensorData<'a> {
            match state.source {
                StateSource::Host { store, optimizer } => {
                    let held = match kind {
                        StateKind::Values => &store.values,
                        StateKind::Buffers => &store.buffers,
                        StateKind::FirstMoment => &optimizer.m,
                        StateKind::SecondMoment => &optimizer.v,
                    };
                    TensorData::Host(Cow::Borrowed(&held[range]))
                }
                StateSource::Worker(_) => TensorData::State(StateRange {
                    chunk: 0,
                    kind,
                    range,
                }),
                StateSource::Gathered(parallel) => match kind {
                    StateKind::Buffers => TensorData::State(StateRange {
                        chunk: 0,
                        kind,
                        range,
                    }),
                    StateKind::Values if !parallel.holds_value_pieces(0) => {
                        TensorData::State(StateRange {
                            chunk: 0,
                            kind,
                            range,
                        })
                    }
                    _ => TensorData::Gathered(kind, range),
                },
            }
        };
        let mut tensors = Vec::new();
        let mut push = |name: String, shape: Vec<usize>, data: TensorData<'a>| {
            tensors.push(OutTensor { name, shape, data })
        };
        for (i, e) in model.params().iter().enumerate() {
            // A tied copy is its primary: stored once.
            if model.tied_primary(i).is_none() {
                let values = data(StateKind::Values, e.range.clone());
                push(format!("param.{}", e.name), e.shape.clone(), values);
            }
        }
        for e in model.buffers() {
            let values = data(StateKind::Buffers, e.range.clone());
            push(format!("buffer.{}", e.name), e.shape.clone(), values);
        }
        let (optimizer_step, moments) = match state.source {
            StateSource::Host { optimizer, .. } => {
                (optimizer.step, [optimizer.m.len(), optimizer.v.len()])
            }
            StateSource::Worker(parallel) => (
                parallel.optimizers[0].step,
                [StateKind::FirstMoment, StateKind::SecondMoment]
                    .map(|kind| parallel.state_len(0, kind)),
            ),
            // The moments of every parameter of the whole model, SGD without a second.
            StateSource::Gathered(parallel) => {
                let second = parallel.state_len(0, StateKind::SecondMoment) > 0;
                let n = model.num_params();
                (parallel.optimizers[0].step, [n, if second { n } else { 0 }])
            }
        };
        let kinds = [StateKind::FirstMoment, StateKind::SecondMoment];
        for ((name, kind), len) in ["optimizer.m", "optimizer.v"]
            .into_iter()
            .zip(kinds)
            .zip(moments)
        {
            // SGD has no second moment.
            if name == "optimizer.m" || len > 0 {
                push(name.into(), vec![len], data(kind, 0..len));
            }
        }
        let mut metadata: HashMap<String, String> = [
            ("format".to_string(), FORMAT.to_string()),
            ("step".to_string(), state.step.to_string()),
            ("optimizer_step".to_string(), optimizer_step.to_string()),
            ("model".to_string(), state.model_description.to_string()),
            ("config".to_string(), state.config.to_string()),
        ]
        .into();
        if let Some(scaler) = &state.loss_scaler {
            metadata.insert("loss_scaler".into(), serde_json::to_string(scaler)?);
        }
        if let Some(sampler) = &state.sampler {
            metadata.insert("sampler".into(), serde_json::to_string(sampler)?);
        }
        Ok(Snapshot { tensors, metadata })
    }

    /// A copy that owns its values in host memory, read from `source` when it names the
    /// worker's state (the copy is what a background save costs the training thread).
    pub fn into_owned(self, source: Option<&Parallel>) -> Result<Snapshot<'static>> {
        let tensors = (self.tensors.into_iter())
            .map(|t| {
                Ok(OutTensor {
                    data: t.data.into_owned(source)?,
                    name: t.name,
                    shape: t.shape,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Snapshot {
            tensors,
            metadata: self.metadata,
        })
    }

    /// Writes the checkpoint file atomically at `path`, streamed: no serialised copy, and the
    /// worker's state (`source`, for a [`StateSource::Worker`] snapshot) read a bounded piece
    /// at a time when it is on a device.
    pub fn write(&self, path: &Path, source: Option<&Parallel>) -> Result<()> {
        self.write_in_pieces(path, source, crate::tensor_file::PIECE_ELEMENTS)
    }

    /// A rank's part in the gathers of a [`StateSource::Gathered`] snapshot another rank
    /// writes (a collective over the ZeRO group; nothing to do for other snapshots).
    pub fn serve(&self, source: &Parallel) -> Result<()> {
        self.serve_in_pieces(source, crate::tensor_file::PIECE_ELEMENTS)
    }

    /// [`Snapshot::serve`] for a [`Snapshot::write_in_pieces`] of `piece_elements`.
    pub fn serve_in_pieces(&self, source: &Parallel, piece_elements: usize) -> Result<()> {
        crate::tensor_file::serve(&self.tensors, source, piece_elements)
    }

    /// [`Snapshot::write`], reading a device or gathering at most `piece_elements` at a time
    /// (the host memory a write holds beyond the file's buffer).
    pub fn write_in_pieces(
        &self,
        path: &Path,
        source: Option<&Parallel>,
        piece_elements: usize,
    ) -> Result<()> {
        let metadata = Some(self.metadata.clone());
        replace_atomically(path, |tmp| {
            let written =
                crate::tensor_file::write(tmp, &self.tensors, &metadata, source, piece_elements);
            written.map(|_| ())
        })
    }

    /// The bytes of tensor data.
    pub fn data_bytes(&self) -> usize {
        self.tensors.iter().map(|t| 4 * t.data.len()).sum()
    }
}

/// Writes `state`'s checkpoint at `path` (atomically, without copying the state).
pub fn save(path: &Path, state: &TrainState) -> Result<()> {
    let source = match state.source {
        StateSource::Worker(parallel) | StateSource::Gathered(parallel) => Some(parallel),
        StateSource::Host { .. } => None,
    };
    Snapshot::of(state)?.write(path, source)
}

/// Replaces `path` by the file `write` creates at the temporary path it is given: `write`,
/// flush, rename over `path`, flush the directory — a crash leaves the old file or the new
/// one, never a torn one; on an error the temporary file is removed and `path` untouched.
pub fn replace_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = temporary_path(path);
    let written = write(&tmp).and_then(|()| {
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("flushing {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    // The rename is durable only once the directory entry is.
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("flushing directory {}", dir.display()))
}

fn read_f32(st: &SafeTensors, name: &str, shape: &[usize], file: &Path) -> Result<Vec<f32>> {
    let t = st
        .tensor(name)
        .with_context(|| format!("checkpoint {} has no tensor '{name}'", file.display()))?;
    if t.dtype() != Dtype::F32 || t.shape() != shape {
        bail!(
            "checkpoint {}: tensor '{name}' is {:?} {:?}, the model needs F32 {:?}",
            file.display(),
            t.dtype(),
            t.shape(),
            shape
        );
    }
    let values: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let bad = values.iter().filter(|v| !v.is_finite()).count();
    if bad > 0 {
        bail!(
            "checkpoint {}: tensor '{name}' holds {bad} non-finite value(s) (NaN or infinity) \
             out of {}; it was saved from a diverged run and cannot be trained from",
            file.display(),
            values.len()
        );
    }
    Ok(values)
}

/// Checks a checkpoint before any worker starts, from its header alone (a large file is not
/// read twice): a missing, truncated or foreign file, a checkpoint of another model (for
/// [`Restore::Everything`]), or a tensor the model needs that is absent or of another shape.
/// A sharded checkpoint's index and shard sizes are checked the same way.
pub fn check(path: &Path, model: &Model, model_description: &str, restore: Restore) -> Result<()> {
    if crate::sharded::is_sharded(path) {
        let ckpt = crate::sharded::ShardedCheckpoint::open(path)?;
        if restore == Restore::Everything {
            check_same_model(path, &ckpt.index.model, model_description)?;
        }
        return Ok(());
    }
    anyhow::ensure!(
        path.exists(),
        "checkpoint {} does not exist{}",
        path.display(),
        match path.parent().filter(|p| p.is_dir()) {
            Some(dir) if dir.join("checkpoint").is_dir() => format!(
                " (this run's directory holds a sharded checkpoint: {})",
                dir.join("checkpoint").display()
            ),
            _ => String::new(),
        }
    );
    let header = read_safetensors_header(path, "checkpoint")?;
    let meta = header.entries.get("__metadata__");
    let field = |k: &str| meta.and_then(|m| m[k].as_str()).unwrap_or_default();
    if field("format") != FORMAT {
        bail!("{} is not a meshtrain checkpoint", path.display());
    }
    let data_len = header.file_len - 8 - header.header_len;
    let described = (header.entries.values())
        .filter_map(|e| e["data_offsets"][1].as_u64())
        .max()
        .unwrap_or(0);
    anyhow::ensure!(
        described <= data_len,
        "checkpoint {} is truncated: its header describes {} bytes of tensors, the file holds \
         {data_len} (an interrupted copy?)",
        path.display(),
        described
    );
    if restore == Restore::Everything {
        check_same_model(path, field("model"), model_description)?;
    }
    let mut needed: Vec<(String, Vec<usize>)> = (model.params().iter().enumerate())
        .filter(|(i, _)| model.tied_primary(*i).is_none())
        .map(|(_, p)| (format!("param.{}", p.name), p.shape.clone()))
        .collect();
    needed
        .extend((model.buffers().iter()).map(|b| (format!("buffer.{}", b.name), b.shape.clone())));
    for (name, shape) in needed {
        let entry = header.entries.get(&name).with_context(|| {
            format!(
                "checkpoint {} has no tensor '{name}' (another model?)",
                path.display()
            )
        })?;
        let saved: Vec<usize> = (entry["shape"].as_array().into_iter().flatten())
            .filter_map(|d| d.as_u64().map(|d| d as usize))
            .collect();
        anyhow::ensure!(
            saved == shape && entry["dtype"] == "F32",
            "checkpoint {}: tensor '{name}' is {} {saved:?}, the model needs F32 {shape:?}",
            path.display(),
            entry["dtype"].as_str().unwrap_or("?")
        );
    }
    Ok(())
}

/// Loads a checkpoint into `store` (and, for [`Restore::Everything`], `optimizer`). With
/// `Everything`, a checkpoint that describes another model than `model_description` is an
/// error unless the description is empty on either side.
pub fn load(
    path: &Path,
    model: &Model,
    model_description: &str,
    store: &mut ParamStore,
    optimizer: &mut Optimizer,
    restore: Restore,
) -> Result<Restored> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read checkpoint {}", path.display()))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).with_context(|| {
        format!(
            "checkpoint {} is corrupt or not a safetensors file",
            path.display()
        )
    })?;
    let st = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("checkpoint {} is corrupt or truncated", path.display()))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        bail!("{} is not a meshtrain checkpoint", path.display());
    }
    let number = |k: &str| -> Result<u64> {
        meta.get(k)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("checkpoint {} lacks '{k}'", path.display()))
    };
    let saved_model = meta.get("model").cloned().unwrap_or_default();
    if restore == Restore::Everything {
        check_same_model(path, &saved_model, model_description)?;
    }
    for (i, e) in model.params().iter().enumerate() {
        let owner = &model.params()[model.tied_primary(i).unwrap_or(i)];
        let v = read_f32(&st, &format!("param.{}", owner.name), &e.shape, path)?;
        store.values[e.range.clone()].copy_from_slice(&v);
    }
    for e in model.buffers() {
        let v = read_f32(&st, &format!("buffer.{}", e.name), &e.shape, path)?;
        store.buffers[e.range.clone()].copy_from_slice(&v);
    }
    if restore == Restore::Weights {
        return Ok(Restored {
            step: 0,
            model_description: saved_model,
            loss_scaler: None,
            sampler: None,
        });
    }
    optimizer.m = read_f32(&st, "optimizer.m", &[optimizer.m.len()], path)?;
    if !optimizer.v.is_empty() {
        optimizer.v = read_f32(&st, "optimizer.v", &[optimizer.v.len()], path)?;
    }
    optimizer.step = number("optimizer_step")?;
    let loss_scaler = optional_json(&meta, "loss_scaler", path)?;
    let sampler = optional_json(&meta, "sampler", path)?;
    Ok(Restored {
        step: number("step")?,
        model_description: saved_model,
        loss_scaler,
        sampler,
    })
}

/// Resuming continues the same model: a checkpoint (`path`) that describes another model
/// than this run's is an error, unless either description is empty.
pub fn check_same_model(path: &Path, saved_model: &str, model_description: &str) -> Result<()> {
    if !saved_model.is_empty()
        && !model_description.is_empty()
        && saved_model.trim() != model_description.trim()
    {
        bail!(
            "checkpoint {} holds another model:\n  saved:     {}\n  this run:  {}\n\
             resuming continues the same model; to start from its weights on purpose \
             (fine-tuning), load it as initial weights instead (`--init-from`)",
            path.display(),
            one_line(saved_model),
            one_line(model_description)
        );
    }
    Ok(())
}

/// A multi-line description (a checkpoint's model) on one line, for messages.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
