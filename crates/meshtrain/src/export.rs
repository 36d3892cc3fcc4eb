//! `meshtrain export`: a checkpoint as a Hugging Face `transformers` model directory
//! (`config.json` + `model.safetensors`), for GPT and Llama runs. The reverse direction is
//! `meshtrain train --init-from DIR` ([`meshtrain_train::hf`]).

use crate::config::Config;
use crate::generate::load_weights;
use crate::generate::Tokenizer;
use anyhow::{bail, Context, Result};
use meshtrain_train::checkpoint;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint of a GPT or Llama run: its checkpoint.safetensors or the run directory (a
    /// sharded one: consolidate it first with `meshtrain checkpoint consolidate`).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The format: "hf" (Hugging Face transformers: GPT2LMHeadModel, LlamaForCausalLM,
    /// MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM).
    #[arg(long, default_value = "hf", value_parser = ["hf"])]
    pub format: String,
    /// The directory to write (created if missing).
    #[arg(long)]
    pub out: PathBuf,
}

/// The whole checkpoint file `path` names: the file itself, or a run directory's
/// `checkpoint.safetensors`; a sharded checkpoint is an error that says how to join it.
pub fn whole_checkpoint(path: &Path) -> Result<PathBuf> {
    let sharded = |dir: &Path| -> anyhow::Error {
        anyhow::anyhow!(
            "{} is a sharded checkpoint: join it first with `meshtrain checkpoint consolidate \
             {} checkpoint.safetensors`",
            dir.display(),
            dir.display()
        )
    };
    if path.file_name().is_some_and(|n| n == "index.json") {
        return Err(sharded(path.parent().unwrap_or(Path::new("."))));
    }
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let file = path.join("checkpoint.safetensors");
    if file.is_file() {
        return Ok(file);
    }
    for dir in [path.to_path_buf(), path.join("checkpoint")] {
        if dir.join("index.json").is_file() {
            return Err(sharded(&dir));
        }
    }
    bail!(
        "{} is a directory without a checkpoint (checkpoint.safetensors)",
        path.display()
    )
}

/// The run config a checkpoint stores (what rebuilds its model).
pub fn run_config(checkpoint: &Path) -> Result<Config> {
    let header = checkpoint::read_safetensors_header(checkpoint, "checkpoint")?;
    let config_text = header
        .entries
        .get("__metadata__")
        .and_then(|m| m["config"].as_str());
    let Some(config_text) = config_text.filter(|t| !t.is_empty()) else {
        bail!(
            "checkpoint {} holds no run config to rebuild its model from",
            checkpoint.display()
        );
    };
    Config::from_toml_with_overrides(config_text, &[])
        .context("the run config stored in the checkpoint")
}

pub fn run(args: &ExportArgs) -> Result<()> {
    let checkpoint = whole_checkpoint(&args.checkpoint)?;
    let cfg = run_config(&checkpoint)?;
    if cfg.model.language().is_none() {
        bail!(
            "{} holds an image model; Hugging Face export covers the GPT and Llama models",
            checkpoint.display()
        );
    }
    let (model, store) = load_weights(&checkpoint, &cfg)?;
    let arch = meshtrain_train::hf::export(&model, &store.values, &args.out)?;
    let lm = cfg.model.language().expect("checked above");
    match run_tokenizer(&cfg, lm.vocab) {
        Ok(tokenizer) => {
            let files = crate::tokenizer_export::write(
                &args.out,
                &tokenizer,
                cfg.data.tokenizer.as_deref(),
                lm.seq,
            )?;
            println!(
                "with its tokenizer ({}): {}",
                tokenizer.describe(),
                files.join(", ")
            );
        }
        Err(e) => println!("without tokenizer files: {e:#}"),
    }
    println!(
        "wrote {} ({} for transformers: {}, {} parameters): load it with \
         AutoModelForCausalLM.from_pretrained(\"{}\") and AutoTokenizer.from_pretrained(\"{}\")",
        args.out.display(),
        if arch.tied {
            "tied head"
        } else {
            "untied head"
        },
        arch.transformers_class(),
        model.num_unique_params(),
        args.out.display(),
        args.out.display()
    );
    Ok(())
}

/// The tokenizer the run trained with: its data.tokenizer, its shards' BPE, bytes; when the
/// shards are gone, the encoding the model's vocabulary fits.
fn run_tokenizer(cfg: &crate::config::Config, vocab: usize) -> Result<Tokenizer> {
    Tokenizer::of_run(cfg).or_else(|e| {
        ["bytes", "gpt2", "cl100k"]
            .iter()
            .filter_map(|name| Tokenizer::named(name).ok())
            .find(|t| t.check_fits(vocab).is_ok())
            .ok_or(e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_is_found_in_a_run_directory_and_a_sharded_one_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!("{:#}", whole_checkpoint(dir.path()).unwrap_err());
        assert!(err.contains("without a checkpoint"), "{err}");
        let file = dir.path().join("checkpoint.safetensors");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(whole_checkpoint(dir.path()).unwrap(), file);
        assert_eq!(whole_checkpoint(&file).unwrap(), file);
        std::fs::remove_file(&file).unwrap();
        let shards = dir.path().join("checkpoint");
        std::fs::create_dir(&shards).unwrap();
        std::fs::write(shards.join("index.json"), b"{}").unwrap();
        for given in [
            dir.path().to_path_buf(),
            shards.clone(),
            shards.join("index.json"),
        ] {
            let err = format!("{:#}", whole_checkpoint(&given).unwrap_err());
            assert!(
                err.contains("sharded checkpoint") && err.contains("consolidate"),
                "{}: {err}",
                given.display()
            );
        }
    }
}
