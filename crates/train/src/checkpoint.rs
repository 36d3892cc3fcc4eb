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
use meshtrain_parallel::parallelize::{StatePart, StateRange};
use meshtrain_parallel::precision::LossScaler;
use meshtrain_parallel::Parallel;
use safetensors::tensor::{Dtype, TensorView};
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
        header_len < 100 << 20,
        "{what} {} is corrupt (bad header length)",
        path.display()
    );
    // A plausible length past the end: a copy cut inside its header, said as the cut it is.
    anyhow::ensure!(
        header_len + 8 <= file_len,
        "{what} {} is truncated: its header alone is {} bytes, the file holds {file_len} (an \
         interrupted copy?)",
        path.display(),
        header_len + 8
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
                    TensorData::Host(Cow::Borrowed(&kind.on_host(store, optimizer)[range]))
                }
                // ZeRO cut the moments, and under stage 3 the parameters, over the ranks.
                StateSource::Gathered(parallel)
                    if kind != StateKind::Buffers
                        && (kind != StateKind::Values || parallel.holds_value_pieces(0)) =>
                {
                    TensorData::Gathered(kind, range)
                }
                StateSource::Worker(_) | StateSource::Gathered(_) => {
                    TensorData::State(StateRange::of(0, kind, range))
                }
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
    let file = CheckpointFile::open(path)?;
    file.restored(restore, model_description)?;
    let mut needed: Vec<(String, Vec<usize>)> = (model.params().iter().enumerate())
        .filter(|(i, _)| model.tied_primary(*i).is_none())
        .map(|(_, p)| (format!("param.{}", p.name), p.shape.clone()))
        .collect();
    needed
        .extend((model.buffers().iter()).map(|b| (format!("buffer.{}", b.name), b.shape.clone())));
    for (name, shape) in needed {
        if let Err(e) = file.entry(&name, &shape) {
            bail!("{e:#} (another model?)");
        }
    }
    Ok(())
}

/// A whole-file checkpoint opened for reading tensor by tensor: positioned reads of the
/// byte ranges its header gives, so a worker reads only the tensors (and the runs of the
/// optimizer's flat moments) it holds, one at a time, never the file at once. Every tensor
/// read is checked: its type and shape, its bytes within the file, its values finite.
pub struct CheckpointFile {
    path: PathBuf,
    file: std::fs::File,
    /// Where the data section starts.
    data_start: u64,
    entries: HashMap<String, serde_json::Value>,
    metadata: HashMap<String, String>,
}

impl CheckpointFile {
    /// Opens `path`: a missing, truncated, corrupt or foreign file is an error naming it.
    pub fn open(path: &Path) -> Result<CheckpointFile> {
        let header = read_safetensors_header(path, "checkpoint")?;
        let data_start = 8 + header.header_len;
        let mut entries = header.entries;
        let metadata: HashMap<String, String> = match entries.remove("__metadata__") {
            Some(meta) => serde_json::from_value(meta).with_context(|| {
                format!("checkpoint {} has a corrupt metadata entry", path.display())
            })?,
            None => HashMap::new(),
        };
        if metadata.get("format").map(String::as_str) != Some(FORMAT) {
            let hf_dir = path.parent().filter(|d| d.join("config.json").is_file());
            match hf_dir {
                Some(dir) => bail!(
                    "{} is not a meshtrain checkpoint but a Hugging Face model's weights: give \
                     its directory, {} (train --init-from reads it with its config.json)",
                    path.display(),
                    dir.display()
                ),
                None => bail!("{} is not a meshtrain checkpoint", path.display()),
            }
        }
        let described = (entries.values())
            .filter_map(|e| e["data_offsets"][1].as_u64())
            .max()
            .unwrap_or(0);
        let data_len = header.file_len - data_start;
        anyhow::ensure!(
            described <= data_len,
            "checkpoint {} is truncated: its header describes {described} bytes of tensors, the \
             file holds {data_len} (an interrupted copy?)",
            path.display()
        );
        Ok(CheckpointFile {
            path: path.to_path_buf(),
            file: header.file,
            data_start,
            entries,
            metadata,
        })
    }

    /// The step, model and positions it records; with [`Restore::Everything`], a checkpoint
    /// of another model than `model_description` is an error (unless either is empty).
    pub fn restored(&self, restore: Restore, model_description: &str) -> Result<Restored> {
        let saved_model = self.metadata.get("model").cloned().unwrap_or_default();
        if restore == Restore::Weights {
            return Ok(Restored {
                step: 0,
                model_description: saved_model,
                loss_scaler: None,
                sampler: None,
            });
        }
        check_same_model(&self.path, &saved_model, model_description)?;
        Ok(Restored {
            step: self.number("step")?,
            model_description: saved_model,
            loss_scaler: optional_json(&self.metadata, "loss_scaler", &self.path)?,
            sampler: optional_json(&self.metadata, "sampler", &self.path)?,
        })
    }

    /// The metadata number `key` (`step`, `optimizer_step`).
    pub fn number(&self, key: &str) -> Result<u64> {
        (self.metadata.get(key))
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("checkpoint {} lacks '{key}'", self.path.display()))
    }

    /// Tensor `name`, which the model needs as F32 of `shape`.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.elements(name, shape, 0..shape.iter().product())
    }

    /// Elements `range` of tensor `name` (flat), which the model needs as F32 of `shape`:
    /// one parameter's run of the optimizer's flat moments.
    pub fn elements(&self, name: &str, shape: &[usize], range: Range<usize>) -> Result<Vec<f32>> {
        let path = self.path.display();
        let start = self.entry(name, shape)?;
        assert!(
            range.end <= shape.iter().product(),
            "elements past the tensor"
        );
        let mut bytes = vec![0u8; 4 * range.len()];
        let at = start + 4 * range.start as u64;
        use std::os::unix::fs::FileExt;
        (self.file.read_exact_at(&mut bytes, at))
            .with_context(|| format!("checkpoint {path} is truncated (reading '{name}')"))?;
        let values: Vec<f32> = (bytes.chunks_exact(4))
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let bad = values.iter().filter(|v| !v.is_finite()).count();
        anyhow::ensure!(
            bad == 0,
            "checkpoint {path}: tensor '{name}' holds {bad} non-finite value(s) (NaN or \
             infinity) out of {}; it was saved from a diverged run and cannot be trained from",
            values.len()
        );
        Ok(values)
    }

    /// Where tensor `name` starts in the file, once its header entry is checked: F32 of
    /// `shape`, its bytes as many as the shape says.
    fn entry(&self, name: &str, shape: &[usize]) -> Result<u64> {
        let path = self.path.display();
        let entry = (self.entries.get(name))
            .with_context(|| format!("checkpoint {path} has no tensor '{name}'"))?;
        let saved: Vec<usize> = (entry["shape"].as_array().into_iter().flatten())
            .filter_map(|d| d.as_u64().map(|d| d as usize))
            .collect();
        anyhow::ensure!(
            saved == shape && entry["dtype"] == "F32",
            "checkpoint {path}: tensor '{name}' is {} {saved:?}, the model needs F32 {shape:?}",
            entry["dtype"].as_str().unwrap_or("?")
        );
        let bytes = 4 * shape.iter().product::<usize>() as u64;
        let offsets = entry["data_offsets"].as_array();
        match offsets.map(|o| (o.first().and_then(|x| x.as_u64()), o.get(1))) {
            Some((Some(start), Some(end))) if end.as_u64() == Some(start + bytes) => {
                Ok(self.data_start + start)
            }
            _ => bail!("checkpoint {path}: tensor '{name}' has corrupt offsets"),
        }
    }

    /// Whole-model tensor `part` of `whole` as [`Parallel::load_state_with`] asks for it: a
    /// parameter (a tied copy is stored as its primary), a buffer, or a parameter's run of
    /// the flat moments.
    pub fn part(&self, whole: &Model, part: StatePart) -> Result<Vec<f32>> {
        let moments = |name: &str, i: usize| {
            let range = whole.params()[i].range.clone();
            self.elements(name, &[whole.num_params()], range)
        };
        match part {
            StatePart::Values(i) => {
                let owner = &whole.params()[whole.tied_primary(i).unwrap_or(i)];
                self.tensor(&format!("param.{}", owner.name), &whole.params()[i].shape)
            }
            StatePart::Buffer(i) => {
                let e = &whole.buffers()[i];
                self.tensor(&format!("buffer.{}", e.name), &e.shape)
            }
            StatePart::FirstMoment(i) => moments("optimizer.m", i),
            StatePart::SecondMoment(i) => moments("optimizer.v", i),
        }
    }

    /// Reads this worker's share into `parallel` (`model` its model, `whole` the unsplit
    /// one, the file's layout), tensor by tensor: with [`Restore::Everything`] the moments
    /// and the optimizer's step too. Returns what the file records.
    pub fn load_into(
        &self,
        parallel: &mut Parallel,
        model: &Model,
        whole: &Model,
        model_description: &str,
        restore: Restore,
    ) -> Result<Restored> {
        let restored = self.restored(restore, model_description)?;
        let moments = match restore {
            Restore::Everything => Some(self.number("optimizer_step")?),
            Restore::Weights => None,
        };
        parallel.load_state_with(model, moments, &mut |part| self.part(whole, part))?;
        Ok(restored)
    }
}

/// Loads a checkpoint into `store` (and, for [`Restore::Everything`], `optimizer`), tensor by
/// tensor. With `Everything`, a checkpoint that describes another model than
/// `model_description` is an error unless the description is empty on either side.
pub fn load(
    path: &Path,
    model: &Model,
    model_description: &str,
    store: &mut ParamStore,
    optimizer: &mut Optimizer,
    restore: Restore,
) -> Result<Restored> {
    let file = CheckpointFile::open(path)?;
    let restored = file.restored(restore, model_description)?;
    for (i, e) in model.params().iter().enumerate() {
        let values = file.part(model, StatePart::Values(i))?;
        store.values[e.range.clone()].copy_from_slice(&values);
    }
    for (i, e) in model.buffers().iter().enumerate() {
        let values = file.part(model, StatePart::Buffer(i))?;
        store.buffers[e.range.clone()].copy_from_slice(&values);
    }
    if restore == Restore::Everything {
        optimizer.m = file.tensor("optimizer.m", &[optimizer.m.len()])?;
        if !optimizer.v.is_empty() {
            optimizer.v = file.tensor("optimizer.v", &[optimizer.v.len()])?;
        }
        optimizer.step = file.number("optimizer_step")?;
    }
    Ok(restored)
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
/// A readable summary of a whole checkpoint file (`meshtrain checkpoint info`): its step,
/// model, tensors and size; opening it checks it as a resume would (truncated, foreign).
pub fn describe_file(path: &Path) -> Result<String> {
    let file = CheckpointFile::open(path)?;
    let meta = |key: &str| {
        file.metadata
            .get(key)
            .cloned()
            .unwrap_or_else(|| "?".into())
    };
    let count = |prefix: &str| {
        file.entries
            .keys()
            .filter(|k| k.starts_with(prefix))
            .count()
    };
    let bytes = file.file.metadata().map(|m| m.len()).unwrap_or(0);
    Ok(format!(
        "checkpoint {}\n  step {} (optimizer step {})\n  model: {}\n  {} parameter tensors, {} \
         buffers, {} optimizer state tensor(s); {:.1} MiB\n",
        path.display(),
        meta("step"),
        meta("optimizer_step"),
        one_line(&meta("model")),
        count("param."),
        count("buffer."),
        count("optimizer."),
        bytes as f64 / (1024.0 * 1024.0)
    ))
}

pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint file of one tensor `param.x` whose header says `entry` (dtype, shape,
    /// offsets), followed by `data`.
    fn file_with(dir: &Path, entry: &str, data: &[f32]) -> PathBuf {
        let mut header = format!(
            "{{\"__metadata__\":{{\"format\":\"{FORMAT}\",\"step\":\"3\"}},\"param.x\":{entry}}}"
        )
        .into_bytes();
        header.resize(header.len().div_ceil(8) * 8, b' ');
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(&header);
        bytes.extend(data.iter().flat_map(|v| v.to_le_bytes()));
        let path = dir.join(format!("f{}.safetensors", entry.len() + 16 * data.len()));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn a_checkpoint_file_reads_tensors_and_runs_and_names_what_is_wrong() {
        let dir = tempfile_dir();
        let ok = r#"{"dtype":"F32","shape":[3],"data_offsets":[0,12]}"#;
        let file = CheckpointFile::open(&file_with(&dir, ok, &[1.0, 2.0, 3.0])).unwrap();
        assert_eq!(file.tensor("param.x", &[3]).unwrap(), [1.0, 2.0, 3.0]);
        assert_eq!(file.elements("param.x", &[3], 1..3).unwrap(), [2.0, 3.0]);
        assert_eq!(file.number("step").unwrap(), 3);
        let err = |e: anyhow::Error| format!("{e:#}");
        assert!(err(file.tensor("param.x", &[4]).unwrap_err()).contains("needs F32 [4]"));
        assert!(err(file.tensor("param.y", &[3]).unwrap_err()).contains("no tensor 'param.y'"));
        assert!(err(file.number("optimizer_step").unwrap_err()).contains("lacks"));
        // Offsets that disagree with the shape, or none at all.
        for bad in [
            r#"{"dtype":"F32","shape":[3],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[3],"data_offsets":[]}"#,
        ] {
            let file = CheckpointFile::open(&file_with(&dir, bad, &[1.0, 2.0, 3.0])).unwrap();
            let e = err(file.tensor("param.x", &[3]).unwrap_err());
            assert!(e.contains("corrupt offsets"), "{e}");
        }
        // A non-finite value is named with its tensor.
        let nan = CheckpointFile::open(&file_with(&dir, ok, &[1.0, f32::NAN, 3.0])).unwrap();
        let e = err(nan.tensor("param.x", &[3]).unwrap_err());
        assert!(e.contains("param.x") && e.contains("non-finite"), "{e}");
        // Data shorter than the header says: truncated, found at open.
        let e = err(CheckpointFile::open(&file_with(&dir, ok, &[1.0]))
            .err()
            .unwrap());
        assert!(e.contains("truncated"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("meshtrain-ckpt-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
