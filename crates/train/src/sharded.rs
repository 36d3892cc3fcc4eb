//! Sharded checkpoints: every worker writes only what it holds, and any layout reads them.
//!
//! ```text
//! DIR/index.json                                   what is where (written last, atomically)
//! DIR/step-00000020-<id>/shard-00001-of-00004.safetensors
//! ```
//!
//! Each worker writes its pieces ([`meshtrain_parallel::parallelize::StatePiece`]) — runs of
//! the whole model's tensors, placed by tensor-parallel shard and flat offset
//! ([`Parallel::own_pieces`]: ZeRO ranks their pieces, other layouts data-parallel rank 0) —
//! into one safetensors file of its own and a report of what it wrote beside it, then world
//! rank 0 collects every worker's report and writes `index.json`: per tensor its whole shape
//! and pieces (file, key, shard, offset, length, CRC-32), the model's parameter order (for
//! consolidation) and the run's metadata (step, loss scaler, sampler position).
//!
//! **In the background**: [`snapshot`] copies nothing and [`ShardedSnapshot::into_owned`]
//! copies this worker's pieces, so training can go on while [`ShardedSnapshot::write`]
//! runs on a writer thread (reports are files for that reason: the thread does not use
//! the process group).
//!
//! **Atomic**: shard files go into a directory no index names yet; the index is written to
//! a temporary file, flushed and renamed over the old one (the commit), and only then are
//! older step directories removed. A crash at any point leaves the previous index and the
//! files it names intact. A worker that fails to write makes the save fail (rank 0 reads
//! every worker's report before committing; a synchronous [`save`] then tells every worker,
//! a background one fails on that worker and rank 0 when they next wait for it), so no
//! index ever names a missing file.
//!
//! **Reading** parses the index and, per tensor asked for, reads only that tensor's pieces
//! (positioned reads of the byte ranges the shard files' headers give), checks each piece's
//! checksum and that the pieces cover the tensor, and joins tensor-parallel shards. A worker
//! of any layout asks only for the tensors of its pipeline stage. A missing or truncated
//! shard, a checksum mismatch, or an index that does not match the model is an error naming
//! the file.

use crate::checkpoint::{read_safetensors_header, replace_atomically, SafetensorsHeader};
use crate::dataset::SamplerPosition;
use crate::tensor_file::{OutTensor, TensorData, PIECE_ELEMENTS};
use anyhow::{anyhow, bail, ensure, Context, Result};
use meshtrain_comm::{BufMut, ProcessGroup};
use meshtrain_nn::optim::Optimizer;
use meshtrain_nn::{Model, ShardSpec};
use meshtrain_parallel::parallelize::StatePart;
use meshtrain_parallel::precision::LossScaler;
use meshtrain_parallel::Parallel;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

pub const FORMAT: &str = "meshtrain-sharded-checkpoint-v1";
pub const INDEX_FILE: &str = "index.json";

/// What `index.json` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Index {
    pub format: String,
    pub step: u64,
    pub optimizer_step: u64,
    /// The model description (compared on resume), as in whole-file checkpoints.
    pub model: String,
    pub config: String,
    pub loss_scaler: Option<LossScaler>,
    /// Where the data sampler stood (absent in checkpoints written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampler: Option<SamplerPosition>,
    /// The layout and world that wrote it.
    pub layout: String,
    pub world: usize,
    /// Optimizer moments per parameter: 1 (SGD's momentum) or 2 (AdamW).
    pub moments: usize,
    /// The model's parameters in order (what a consolidated file's flat optimizer state
    /// follows): name, whole shape, and the primary a tied copy shares.
    pub params: Vec<ParamInfo>,
    pub buffers: Vec<ParamInfo>,
    /// Shard files, relative to the checkpoint directory.
    pub files: Vec<FileEntry>,
    /// `param.NAME`, `m.NAME`, `v.NAME`, `buffer.NAME`.
    pub tensors: BTreeMap<String, TensorEntry>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ParamInfo {
    pub name: String,
    pub shape: Vec<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied_to: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub bytes: u64,
    /// The world rank that wrote it.
    pub rank: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TensorEntry {
    pub shape: Vec<usize>,
    pub pieces: Vec<PieceEntry>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PieceEntry {
    /// Index into [`Index::files`].
    pub file: usize,
    /// The tensor's key in that file.
    pub key: String,
    /// The tensor-parallel shard the piece belongs to (`None`: the whole tensor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<ShardSpec>,
    /// Flat offset within the shard (or tensor) and length, in elements.
    pub offset: usize,
    pub len: usize,
    pub crc32: u32,
}

/// The run's facts a sharded checkpoint records besides the tensors.
pub struct SaveMeta<'a> {
    pub step: u64,
    pub model_description: &'a str,
    pub config: &'a str,
    pub loss_scaler: Option<LossScaler>,
    /// Where the data sampler stands (checked on resume).
    pub sampler: Option<SamplerPosition>,
    /// How long rank 0 waits for the other workers' shards before giving up on the save
    /// (the run's collective timeout).
    pub wait_for_workers: Duration,
}

/// Whether `path` is a sharded checkpoint (a directory, or an `index.json`).
pub fn is_sharded(path: &Path) -> bool {
    path.is_dir() || path.file_name().is_some_and(|n| n == INDEX_FILE)
}

/// The checkpoint directory of a path given for a sharded checkpoint.
fn directory(path: &Path) -> &Path {
    if path.file_name().is_some_and(|n| n == INDEX_FILE) {
        path.parent().unwrap_or(Path::new("."))
    } else {
        path
    }
}

/// What a worker reports to rank 0 after writing its file: a small JSON file beside its
/// shard (`report-RRRRR.json`). A file, not a message, so the report can come from a
/// background writer thread, which must not use the process group the training thread is
/// using; sharded checkpoints already need a directory every worker sees.
#[derive(Serialize, Deserialize)]
struct Written {
    rank: usize,
    file: Option<FileEntry>,
    pieces: Vec<(String, Vec<usize>, PieceEntry)>,
    error: Option<String>,
}

/// One piece of this worker's state: where the worker holds it, or owned by a snapshot.
struct Piece<'a> {
    tensor: String,
    shape: Vec<usize>,
    split: Option<ShardSpec>,
    offset: usize,
    data: TensorData<'a>,
}

/// One worker's part of a sharded checkpoint: its pieces and, on world rank 0, the index to
/// complete once every worker has reported. [`snapshot`] takes it between steps;
/// [`ShardedSnapshot::write`] may run on another thread.
pub struct ShardedSnapshot<'a> {
    dir: PathBuf,
    /// This save's own directory inside `dir`.
    step_dir: String,
    rank: usize,
    size: usize,
    pieces: Vec<Piece<'a>>,
    /// Rank 0: the index without its files and tensors.
    index: Option<Index>,
    wait_for_workers: Duration,
}

/// This worker's part of the checkpoint `dir` (a collective over the world: rank 0 names
/// the save's directory; every worker calls it between steps). Borrows the pieces; `model`
/// is this worker's model, `whole` the unsplit model.
pub fn snapshot<'a>(
    dir: &Path,
    parallel: &'a Parallel,
    model: &Model,
    whole: &Model,
    meta: &SaveMeta<'_>,
) -> Result<ShardedSnapshot<'a>> {
    let world = parallel.world().clone();
    let (rank, size) = (world.rank(), world.size());
    // A directory of this save's own: rank 0 names it, so a re-save of the same step never
    // writes into files the current index names.
    let id = broadcast_u64(
        world.as_ref(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    )?;
    let pieces = (parallel.own_pieces(model).into_iter())
        .map(|p| Piece {
            tensor: p.tensor,
            shape: p.shape,
            split: p.split,
            offset: p.offset,
            data: TensorData::State(p.data),
        })
        .collect();
    let index = (rank == 0).then(|| {
        let moments = if parallel.optimizers.iter().any(Optimizer::has_second_moment) {
            2
        } else {
            1
        };
        Index {
            format: FORMAT.into(),
            step: meta.step,
            optimizer_step: parallel.optimizers.first().map_or(0, |o| o.step),
            model: meta.model_description.into(),
            config: meta.config.into(),
            loss_scaler: meta.loss_scaler,
            sampler: meta.sampler.clone(),
            layout: parallel.layout.layout.to_string(),
            world: size,
            moments,
            params: param_infos(whole),
            buffers: whole.buffers().iter().map(|e| info(e, None)).collect(),
            files: Vec::new(),
            tensors: BTreeMap::new(),
        }
    });
    Ok(ShardedSnapshot {
        dir: dir.to_path_buf(),
        step_dir: format!("step-{:08}-{id:016x}", meta.step),
        rank,
        size,
        pieces,
        index,
        wait_for_workers: meta.wait_for_workers,
    })
}

/// Writes this worker's pieces and, on world rank 0, the index (a collective over the
/// world; every worker calls it between steps): a [`snapshot`] written at once, then every
/// worker learns whether the index was committed.
pub fn save(
    dir: &Path,
    parallel: &Parallel,
    model: &Model,
    whole: &Model,
    meta: &SaveMeta<'_>,
) -> Result<()> {
    let outcome = snapshot(dir, parallel, model, whole, meta)?.write(Some(parallel));
    let ok = broadcast_u64(parallel.world().as_ref(), outcome.is_ok() as u64)?;
    match (outcome, ok) {
        (Err(e), _) => Err(e),
        (Ok(()), 1) => Ok(()),
        (Ok(()), _) => bail!(
            "saving the sharded checkpoint {} failed on another worker (rank 0 reports why)",
            dir.display()
        ),
    }
}

impl ShardedSnapshot<'_> {
    /// A copy that owns its pieces in host memory (read from `source`, the worker whose
    /// snapshot it is), for a background writer.
    pub fn into_owned(self, source: &Parallel) -> Result<ShardedSnapshot<'static>> {
        let source = Some(source);
        Ok(ShardedSnapshot {
            pieces: (self.pieces.into_iter())
                .map(|p| {
                    Ok(Piece {
                        data: p.data.into_owned(source)?,
                        tensor: p.tensor,
                        shape: p.shape,
                        split: p.split,
                        offset: p.offset,
                    })
                })
                .collect::<Result<_>>()?,
            dir: self.dir,
            step_dir: self.step_dir,
            rank: self.rank,
            size: self.size,
            index: self.index,
            wait_for_workers: self.wait_for_workers,
        })
    }

    /// Writes this worker's shard file and its report; on world rank 0 then waits for every
    /// worker's report and commits the index (no collective: any thread may run it).
    /// `source` is the worker whose state the pieces name (`None` for an owned snapshot):
    /// on a device they are read a bounded piece at a time as the file is written.
    pub fn write(&self, source: Option<&Parallel>) -> Result<()> {
        let written = self.write_shard(source);
        let report = match &written {
            Ok((file, pieces)) => Written {
                rank: self.rank,
                file: file.clone(),
                pieces: pieces.clone(),
                error: None,
            },
            Err(e) => Written {
                rank: self.rank,
                file: None,
                pieces: Vec::new(),
                error: Some(format!("{e:#}")),
            },
        };
        let path = self.report_path(self.rank);
        let text = serde_json::to_vec(&report)?;
        replace_atomically(&path, |tmp| {
            std::fs::write(tmp, &text).with_context(|| format!("writing {}", tmp.display()))
        })?;
        written?;
        let Some(index) = &self.index else {
            return Ok(());
        };
        let reports = self.collect_reports()?;
        let index = assemble(reports, index.clone())?;
        commit(&self.dir, &self.step_dir, &index)
    }

    fn report_path(&self, rank: usize) -> PathBuf {
        (self.dir.join(&self.step_dir)).join(format!("report-{rank:05}.json"))
    }

    /// Rank 0: every worker's report, waiting up to `wait_for_workers` for them.
    fn collect_reports(&self) -> Result<Vec<Written>> {
        let deadline = std::time::Instant::now() + self.wait_for_workers;
        let mut reports: Vec<Option<Written>> = (0..self.size).map(|_| None).collect();
        loop {
            for (rank, slot) in reports.iter_mut().enumerate() {
                if slot.is_none() {
                    let path = self.report_path(rank);
                    if let Ok(text) = std::fs::read(&path) {
                        *slot = Some(serde_json::from_slice(&text).with_context(|| {
                            format!("{} is not a checkpoint report", path.display())
                        })?);
                    }
                }
            }
            let missing: Vec<usize> = (reports.iter().enumerate())
                .filter(|(_, r)| r.is_none())
                .map(|(rank, _)| rank)
                .collect();
            if missing.is_empty() {
                return Ok(reports.into_iter().flatten().collect());
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "saving the sharded checkpoint {}: rank(s) {missing:?} did not report their \
                 shard in {} within {:?}",
                self.dir.display(),
                self.dir.join(&self.step_dir).display(),
                self.wait_for_workers
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[allow(clippy::type_complexity)]
    fn write_shard(
        &self,
        source: Option<&Parallel>,
    ) -> Result<(Option<FileEntry>, Vec<(String, Vec<usize>, PieceEntry)>)> {
        if self.pieces.is_empty() {
            return Ok((None, Vec::new()));
        }
        let (rank, size) = (self.rank, self.size);
        let relative = format!("{}/shard-{rank:05}-of-{size:05}.safetensors", self.step_dir);
        let path = self.dir.join(&relative);
        let tensors: Vec<OutTensor> = (self.pieces.iter())
            .map(|p| OutTensor {
                name: p.key(),
                shape: vec![p.data.len()],
                data: p.data.clone(),
            })
            .collect();
        // Streamed into a temporary file (no serialised copy in memory, a device's state a
        // bounded piece at a time), the checksums computed as it passes, flushed, renamed.
        let mut crcs = Vec::new();
        replace_atomically(&path, |tmp| {
            crcs = crate::tensor_file::write(tmp, &tensors, &None, source, PIECE_ELEMENTS)?;
            Ok(())
        })?;
        let bytes = std::fs::metadata(&path)
            .with_context(|| format!("reading the size of {}", path.display()))?
            .len();
        let described = (self.pieces.iter().zip(crcs))
            .map(|(p, crc32)| {
                (
                    p.tensor.clone(),
                    p.shape.clone(),
                    PieceEntry {
                        file: rank, // replaced by the file's index on rank 0
                        key: p.key(),
                        split: p.split.clone(),
                        offset: p.offset,
                        len: p.data.len(),
                        crc32,
                    },
                )
            })
            .collect();
        let file = FileEntry {
            path: relative,
            bytes,
            rank,
        };
        Ok((Some(file), described))
    }
}

impl Piece<'_> {
    /// The piece's key in its shard file.
    fn key(&self) -> String {
        match &self.split {
            Some(s) => format!("{}@tp{}@{}", self.tensor, s.index, self.offset),
            None => format!("{}@{}", self.tensor, self.offset),
        }
    }
}

fn info(e: &meshtrain_nn::ParamEntry, tied_to: Option<String>) -> ParamInfo {
    ParamInfo {
        name: e.name.clone(),
        shape: e.shape.clone(),
        tied_to,
    }
}

/// The model's parameters in order, tied copies naming their primary.
fn param_infos(whole: &Model) -> Vec<ParamInfo> {
    (whole.params().iter().enumerate())
        .map(|(i, e)| {
            let tied = (whole.tied_primary(i)).map(|p| whole.params()[p].name.clone());
            info(e, tied)
        })
        .collect()
}

/// Rank 0: the index from every worker's report (or the first worker's error) and the
/// index's other facts.
fn assemble(reports: Vec<Written>, mut index: Index) -> Result<Index> {
    if let Some(r) = reports.iter().find(|r| r.error.is_some()) {
        bail!(
            "worker {} could not write its checkpoint shard: {}",
            r.rank,
            r.error.as_deref().unwrap_or_default()
        );
    }
    for r in reports {
        let Some(file) = r.file else { continue };
        let at = index.files.len();
        index.files.push(file);
        for (tensor, shape, mut piece) in r.pieces {
            piece.file = at;
            index
                .tensors
                .entry(tensor)
                .or_insert_with(|| TensorEntry {
                    shape,
                    pieces: Vec::new(),
                })
                .pieces
                .push(piece);
        }
    }
    index.check_coverage()?;
    Ok(index)
}

/// Rank 0: writes the index (the commit) and removes step directories it does not name.
fn commit(dir: &Path, step_dir: &str, index: &Index) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let text = serde_json::to_string_pretty(index)? + "\n";
    replace_atomically(&dir.join(INDEX_FILE), |tmp| {
        std::fs::write(tmp, text.as_bytes()).with_context(|| format!("writing {}", tmp.display()))
    })?;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("step-") && name != step_dir {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    Ok(())
}

/// `value` from world rank 0 (two f32 words carrying its bits).
fn broadcast_u64(world: &dyn ProcessGroup, value: u64) -> Result<u64> {
    let mut words = [
        f32::from_bits(value as u32),
        f32::from_bits((value >> 32) as u32),
    ];
    world.broadcast(BufMut::F32(&mut words), 0)?;
    Ok(words[0].to_bits() as u64 | ((words[1].to_bits() as u64) << 32))
}

impl Index {
    /// Every tensor's pieces cover it exactly once (per tensor-parallel shard).
    fn check_coverage(&self) -> Result<()> {
        for (name, t) in &self.tensors {
            for (len, pieces) in t.parts() {
                let mut spans: Vec<(usize, usize)> = pieces
                    .iter()
                    .map(|p| (p.offset, p.offset + p.len))
                    .collect();
                spans.sort_unstable();
                let mut at = 0;
                for (start, end) in spans {
                    ensure!(
                        start == at,
                        "tensor '{name}': its pieces leave a gap or overlap at element {at}"
                    );
                    at = end;
                }
                ensure!(
                    at == len,
                    "tensor '{name}': its pieces cover {at} of {len} elements"
                );
            }
        }
        Ok(())
    }
}

impl TensorEntry {
    /// The tensor's parts (the whole tensor, or each tensor-parallel shard) with their
    /// element counts and pieces.
    fn parts(&self) -> Vec<(usize, Vec<&PieceEntry>)> {
        let whole: usize = self.shape.iter().product();
        let mut by_shard: BTreeMap<Option<usize>, (usize, Vec<&PieceEntry>)> = BTreeMap::new();
        for p in &self.pieces {
            let (key, len) = match &p.split {
                Some(s) => (Some(s.index), s.local_shape().iter().product()),
                None => (None, whole),
            };
            by_shard.entry(key).or_insert((len, Vec::new())).1.push(p);
        }
        by_shard.into_values().collect()
    }
}

/// A sharded checkpoint opened for reading.
pub struct ShardedCheckpoint {
    pub dir: PathBuf,
    pub index: Index,
    /// Per file: the open file and each key's byte range (absolute), read on first use.
    files: Vec<Mutex<Option<OpenShard>>>,
}

struct OpenShard {
    file: File,
    ranges: HashMap<String, (u64, u64)>,
}

impl ShardedCheckpoint {
    /// Reads and checks the index of the checkpoint at `path` (its directory or its
    /// `index.json`): the format, and that every shard file exists with its recorded size.
    pub fn open(path: &Path) -> Result<ShardedCheckpoint> {
        let dir = directory(path).to_path_buf();
        let index_path = dir.join(INDEX_FILE);
        let text = std::fs::read_to_string(&index_path).with_context(|| {
            format!(
                "cannot read the index of sharded checkpoint {}",
                index_path.display()
            )
        })?;
        let index: Index = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is corrupt or not a checkpoint index",
                index_path.display()
            )
        })?;
        ensure!(
            index.format == FORMAT,
            "{} is a '{}' index, not {FORMAT}",
            index_path.display(),
            index.format
        );
        for f in &index.files {
            let path = dir.join(&f.path);
            let len = std::fs::metadata(&path)
                .with_context(|| {
                    format!(
                        "checkpoint shard {} (named by {}) is missing",
                        path.display(),
                        index_path.display()
                    )
                })?
                .len();
            ensure!(
                len == f.bytes,
                "checkpoint shard {} is {len} bytes, its index says {} (truncated or replaced)",
                path.display(),
                f.bytes
            );
        }
        index
            .check_coverage()
            .with_context(|| format!("checkpoint index {}", index_path.display()))?;
        let files = index.files.iter().map(|_| Mutex::new(None)).collect();
        Ok(ShardedCheckpoint { dir, index, files })
    }

    fn file_path(&self, file: usize) -> PathBuf {
        self.dir.join(&self.index.files[file].path)
    }

    /// One piece's values, checked against its checksum.
    fn read_piece(&self, piece: &PieceEntry) -> Result<Vec<f32>> {
        let path = self.file_path(piece.file);
        let mut slot = self.files[piece.file]
            .lock()
            .map_err(|_| anyhow!("a reader of {} panicked", path.display()))?;
        if slot.is_none() {
            *slot = Some(open_shard(&path)?);
        }
        let shard = slot.as_ref().expect("opened above");
        let &(start, end) = shard.ranges.get(&piece.key).with_context(|| {
            format!(
                "checkpoint shard {} has no tensor '{}' (its index names it)",
                path.display(),
                piece.key
            )
        })?;
        ensure!(
            end - start == piece.len as u64 * 4,
            "checkpoint shard {}: '{}' holds {} bytes, its index says {} values",
            path.display(),
            piece.key,
            end - start,
            piece.len
        );
        let mut bytes = vec![0u8; (end - start) as usize];
        shard
            .file
            .read_exact_at(&mut bytes, start)
            .with_context(|| format!("reading {}", path.display()))?;
        ensure!(
            crc32fast::hash(&bytes) == piece.crc32,
            "checkpoint shard {} is corrupt: '{}' does not match its checksum",
            path.display(),
            piece.key
        );
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let bad = values.iter().filter(|v| !v.is_finite()).count();
        ensure!(
            bad == 0,
            "checkpoint shard {}: '{}' holds {bad} non-finite value(s); it was saved from a \
             diverged run",
            path.display(),
            piece.key
        );
        Ok(values)
    }

    /// The whole tensor `name` (`param.X`, `m.X`, `v.X`, `buffer.X`), which must have
    /// `shape`: its pieces read, shards joined.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let index_path = self.dir.join(INDEX_FILE);
        let entry = self.index.tensors.get(name).with_context(|| {
            format!(
                "checkpoint index {} has no tensor '{name}': it was written for another model",
                index_path.display()
            )
        })?;
        ensure!(
            entry.shape == shape,
            "checkpoint index {}: tensor '{name}' is {:?}, the model needs {:?}",
            index_path.display(),
            entry.shape,
            shape
        );
        let mut whole = vec![0.0f32; shape.iter().product()];
        for (len, pieces) in entry.parts() {
            let mut part = vec![0.0f32; len];
            for p in &pieces {
                let values = self.read_piece(p)?;
                part[p.offset..p.offset + p.len].copy_from_slice(&values);
            }
            match pieces.first().and_then(|p| p.split.as_ref()) {
                Some(split) => split.put(&part, &mut whole),
                None => whole = part,
            }
        }
        Ok(whole)
    }

    /// The bytes of all shard files.
    pub fn total_bytes(&self) -> u64 {
        self.index.files.iter().map(|f| f.bytes).sum()
    }

    /// Reads this worker's share into `parallel` (its stage's tensors only). `whole` is the
    /// unsplit model; the index must describe it (names and shapes).
    pub fn load_into(
        &self,
        parallel: &mut Parallel,
        model: &Model,
        whole: &Model,
        with_moments: bool,
    ) -> Result<()> {
        let moments = 1 + parallel.optimizers.iter().any(Optimizer::has_second_moment) as usize;
        ensure!(
            !with_moments || self.index.moments == moments,
            "checkpoint {} holds {} optimizer moment(s) per parameter; this run's optimizer \
             has {moments}",
            self.dir.display(),
            self.index.moments,
        );
        let mut read = |part: StatePart| -> Result<Vec<f32>> {
            let (kind, i) = match part {
                StatePart::Values(i) => ("param", i),
                StatePart::FirstMoment(i) => ("m", i),
                StatePart::SecondMoment(i) => ("v", i),
                StatePart::Buffer(i) => {
                    let e = &whole.buffers()[i];
                    return self.tensor(&format!("buffer.{}", e.name), &e.shape);
                }
            };
            // A tied copy is stored as its primary.
            let owner = &whole.params()[whole.tied_primary(i).unwrap_or(i)];
            self.tensor(&format!("{kind}.{}", owner.name), &whole.params()[i].shape)
        };
        let moments = with_moments.then_some(self.index.optimizer_step);
        parallel.load_state_with(model, moments, &mut read)
    }
}

/// Opens a shard file and reads its header (each key's absolute byte range).
fn open_shard(path: &Path) -> Result<OpenShard> {
    let SafetensorsHeader {
        file,
        header_len: n,
        file_len,
        entries: parsed,
    } = read_safetensors_header(path, "checkpoint shard")?;
    let mut ranges = HashMap::new();
    for (key, info) in parsed {
        if key == "__metadata__" {
            continue;
        }
        let offsets = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
            .with_context(|| {
                format!(
                    "checkpoint shard {}: '{key}' has no data offsets",
                    path.display()
                )
            })?;
        let (start, end) = (8 + n + offsets.0, 8 + n + offsets.1);
        ensure!(
            start <= end && end <= file_len,
            "checkpoint shard {} is truncated ('{key}' ends past the file)",
            path.display()
        );
        ranges.insert(key, (start, end));
    }
    Ok(OpenShard { file, ranges })
}

/// Writes the whole-model checkpoint (`checkpoint.safetensors`'s format, loadable by any
/// run and by [`crate::checkpoint::load`]) of the sharded checkpoint at `from` into `to`.
/// Streaming: the output's header is computed from the index, then every tensor is
/// assembled from its pieces and written at its offset by a pool of threads, one tensor in
/// memory per thread. `progress` is called with the bytes written so far and the total.
pub fn consolidate(
    from: &Path,
    to: &Path,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<ConsolidateReport> {
    use rayon::prelude::*;
    let started = std::time::Instant::now();
    let ckpt = ShardedCheckpoint::open(from)?;
    let index = &ckpt.index;
    // The output's tensors in order — parameters (primaries), buffers, the flat moments —
    // with their byte offsets in the data section, and the jobs that fill them.
    enum Job<'a> {
        Tensor { name: String, shape: &'a [usize] },
        Moment { kind: &'static str, param: usize },
    }
    let bytes = |shape: &[usize]| 4 * shape.iter().product::<usize>() as u64;
    let mut header = serde_json::Map::new();
    let mut jobs: Vec<(Job, u64)> = Vec::new();
    let mut at = 0u64;
    let mut add = |name: String, shape: &[usize], at: u64| {
        header.insert(
            name,
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + bytes(shape)]}),
        );
    };
    let whole = (index.params.iter().filter(|p| p.tied_to.is_none()))
        .map(|p| ("param", p))
        .chain(index.buffers.iter().map(|b| ("buffer", b)));
    for (kind, p) in whole {
        let name = format!("{kind}.{}", p.name);
        add(name.clone(), &p.shape, at);
        jobs.push((
            Job::Tensor {
                name,
                shape: &p.shape,
            },
            at,
        ));
        at += bytes(&p.shape);
    }
    let num_params: usize = index
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let kinds: &[&'static str] = if index.moments == 2 {
        &["m", "v"]
    } else {
        &["m"]
    };
    for &kind in kinds {
        add(format!("optimizer.{kind}"), &[num_params], at);
        for (param, p) in index.params.iter().enumerate() {
            jobs.push((Job::Moment { kind, param }, at));
            at += bytes(&p.shape);
        }
    }
    let data_len = at;
    let mut metadata = serde_json::Map::new();
    let mut put = |k: &str, v: String| {
        metadata.insert(k.into(), serde_json::Value::String(v));
    };
    put("format", crate::checkpoint::FORMAT.into());
    put("step", index.step.to_string());
    put("optimizer_step", index.optimizer_step.to_string());
    put("model", index.model.clone());
    put("config", index.config.clone());
    if let Some(scaler) = &index.loss_scaler {
        put("loss_scaler", serde_json::to_string(scaler)?);
    }
    header.insert("__metadata__".into(), serde_json::Value::Object(metadata));
    let mut header = serde_json::to_vec(&serde_json::Value::Object(header))?;
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let data_start = 8 + header.len() as u64;

    replace_atomically(to, |tmp| {
        let file = File::create(tmp).with_context(|| format!("creating {}", tmp.display()))?;
        file.set_len(data_start + data_len)
            .with_context(|| format!("sizing {}", tmp.display()))?;
        file.write_all_at(&(header.len() as u64).to_le_bytes(), 0)?;
        file.write_all_at(&header, 8)?;
        let done = std::sync::atomic::AtomicU64::new(0);
        jobs.par_iter().try_for_each(|(job, offset)| -> Result<()> {
            let values = match job {
                Job::Tensor { name, shape } => ckpt.tensor(name, shape)?,
                Job::Moment { kind, param } => {
                    let p = &index.params[*param];
                    let owner = p.tied_to.as_deref().unwrap_or(&p.name);
                    ckpt.tensor(&format!("{kind}.{owner}"), &p.shape)?
                }
            };
            file.write_all_at(bytemuck::cast_slice(&values), data_start + offset)
                .with_context(|| format!("writing {}", tmp.display()))?;
            let bytes = 4 * values.len() as u64;
            let so_far = done.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed) + bytes;
            progress(so_far, data_len);
            Ok(())
        })
    })?;
    Ok(ConsolidateReport {
        read_bytes: ckpt.total_bytes(),
        written_bytes: data_start + data_len,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// What [`consolidate`] did.
#[derive(Clone, Copy, Debug)]
pub struct ConsolidateReport {
    pub read_bytes: u64,
    pub written_bytes: u64,
    pub seconds: f64,
}

/// A readable summary of a sharded checkpoint (`meshtrain checkpoint info`).
pub fn describe(ckpt: &ShardedCheckpoint) -> String {
    let i = &ckpt.index;
    let elements: usize = i
        .params
        .iter()
        .filter(|p| p.tied_to.is_none())
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let mut out = format!(
        "sharded checkpoint {}\n  step {} (optimizer step {}), written by layout {} on {} \
         worker(s)\n  model: {}\n  {} parameter tensors ({} values, {} tied), {} buffers, {} \
         optimizer moment(s) per parameter\n  {} shard file(s), {:.1} MiB\n",
        ckpt.dir.display(),
        i.step,
        i.optimizer_step,
        i.layout,
        i.world,
        crate::checkpoint::one_line(&i.model),
        i.params.len(),
        elements,
        i.params.iter().filter(|p| p.tied_to.is_some()).count(),
        i.buffers.len(),
        i.moments,
        i.files.len(),
        ckpt.total_bytes() as f64 / (1024.0 * 1024.0),
    );
    if let Some(s) = &i.loss_scaler {
        out += &format!("  fp16 loss scale {}\n", s.scale);
    }
    for (k, f) in i.files.iter().enumerate() {
        let pieces = i
            .tensors
            .values()
            .flat_map(|t| &t.pieces)
            .filter(|p| p.file == k)
            .count();
        out += &format!(
            "  rank {:>4}: {} ({:.2} MiB, {pieces} pieces)\n",
            f.rank,
            f.path,
            f.bytes as f64 / (1024.0 * 1024.0)
        );
    }
    out
}
