//! `meshtrain export`: a checkpoint as a Hugging Face `transformers` model directory
//! (`config.json` + `model.safetensors`), for GPT and Llama runs. The reverse direction is
//! `meshtrain train --init-from DIR` ([`meshtrain_train::hf`]).

use crate::config::Config;
use crate::generate::load_weights;
use anyhow::{bail, Context, Result};
use meshtrain_train::checkpoint;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint of a GPT or Llama run (checkpoint.safetensors; a sharded one: consolidate
    /// it first with `meshtrain checkpoint consolidate`).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The format: "hf" (Hugging Face transformers: GPT2LMHeadModel or LlamaForCausalLM).
    #[arg(long, default_value = "hf", value_parser = ["hf"])]
    pub format: String,
    /// The directory to write (created if missing).
    #[arg(long)]
    pub out: PathBuf,
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
    let cfg = run_config(&args.checkpoint)?;
    if cfg.model.language().is_none() {
        bail!(
            "{} holds an image model; Hugging Face export covers the GPT and Llama models",
            args.checkpoint.display()
        );
    }
    let (model, store) = load_weights(&args.checkpoint, &cfg)?;
    let arch = meshtrain_train::hf::export(&model, &store.values, &args.out)?;
    println!(
        "wrote {} ({} for transformers: {:?}, {} parameters): load it with \
         AutoModelForCausalLM.from_pretrained(\"{}\")",
        args.out.display(),
        if arch.tied {
            "tied head"
        } else {
            "untied head"
        },
        arch.family,
        model.num_unique_params(),
        args.out.display()
    );
    Ok(())
}
