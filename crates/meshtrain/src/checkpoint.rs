//! Checkpoints in safetensors: parameters and buffers by name, optimizer state, and the step,
//! written atomically (temporary file, fsync, rename) so a crash never leaves a torn file.

use anyhow::{bail, Context, Result};
use meshtrain_nn::optim::Optimizer;
use meshtrain_nn::{Model, ParamStore};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

/// Everything needed to continue a run exactly where it stopped.
pub struct TrainState<'a> {
    pub model: &'a Model,
    pub store: &'a ParamStore,
    pub optimizer: &'a Optimizer,
    /// Steps completed.
    pub step: u64,
    /// The config the run was started with (stored for reference).
    pub config_toml: &'a str,
}

fn view(data: &[f32], shape: Vec<usize>) -> TensorView<'_> {
    TensorView::new(Dtype::F32, shape, bytemuck::cast_slice(data)).expect("tensor view sizes match")
}

pub fn save(path: &Path, state: &TrainState) -> Result<()> {
    let mut views: Vec<(String, TensorView)> = Vec::new();
    for e in state.model.params() {
        views.push((
            format!("param.{}", e.name),
            view(&state.store.values[e.range.clone()], e.shape.clone()),
        ));
    }
    for e in state.model.buffers() {
        views.push((
            format!("buffer.{}", e.name),
            view(&state.store.buffers[e.range.clone()], e.shape.clone()),
        ));
    }
    let opt = state.optimizer;
    views.push(("optimizer.m".into(), view(&opt.m, vec![opt.m.len()])));
    if !opt.v.is_empty() {
        views.push(("optimizer.v".into(), view(&opt.v, vec![opt.v.len()])));
    }
    let metadata: HashMap<String, String> = [
        ("format".to_string(), "meshtrain-checkpoint-v1".to_string()),
        ("step".to_string(), state.step.to_string()),
        ("optimizer_step".to_string(), opt.step.to_string()),
        ("config".to_string(), state.config_toml.to_string()),
    ]
    .into();
    let bytes = safetensors::serialize(views, &Some(metadata)).context("serialising checkpoint")?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = path.with_extension("safetensors.tmp");
    {
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(&bytes)
            .with_context(|| format!("writing {}", tmp.display()))?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
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
    Ok(t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Load a checkpoint into `store` and `optimizer`; returns the step to continue from.
pub fn load(
    path: &Path,
    model: &Model,
    store: &mut ParamStore,
    optimizer: &mut Optimizer,
) -> Result<u64> {
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
    if meta.get("format").map(String::as_str) != Some("meshtrain-checkpoint-v1") {
        bail!("{} is not a meshtrain checkpoint", path.display());
    }
    let number = |k: &str| -> Result<u64> {
        meta.get(k)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("checkpoint {} lacks '{k}'", path.display()))
    };
    for e in model.params() {
        let v = read_f32(&st, &format!("param.{}", e.name), &e.shape, path)?;
        store.values[e.range.clone()].copy_from_slice(&v);
    }
    for e in model.buffers() {
        let v = read_f32(&st, &format!("buffer.{}", e.name), &e.shape, path)?;
        store.buffers[e.range.clone()].copy_from_slice(&v);
    }
    optimizer.m = read_f32(&st, "optimizer.m", &[optimizer.m.len()], path)?;
    if !optimizer.v.is_empty() {
        optimizer.v = read_f32(&st, "optimizer.v", &[optimizer.v.len()], path)?;
    }
    optimizer.step = number("optimizer_step")?;
    number("step")
}
