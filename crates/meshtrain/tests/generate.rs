//! `meshtrain generate`: text from a checkpoint, the model rebuilt from the run config it
//! holds; greedy decoding follows the model's own forward pass, sampling its seed. The
//! key/value-cache decoder behind it gives the model's own logits at every position, for GPT
//! and for Llama with grouped-query attention, and keeps only the key/value heads.

mod common;

use common::{rel_diff, tiny_gpt_config, tiny_llama_config};
use meshtrain::config::Config;
use meshtrain::decode::Decoder;
use meshtrain::presets::build_model;
use meshtrain_nn::{Mode, Model, ParamStore};
use meshtrain_tensor::rng::normal_values;
use meshtrain_tensor::Tensor;
use std::path::Path;

/// The model's own logits after every token of `tokens`, `[T, vocab]`.
fn forward_logits(model: &Model, store: &mut ParamStore, tokens: &[u32]) -> Vec<f32> {
    let x = Tensor::from_vec(
        tokens.iter().map(|&t| t as f32).collect(),
        &[1, tokens.len()],
    );
    model.forward_all(store, x, Mode::EVAL).0.data().to_vec()
}

/// `cfg`'s model, initialised, then every parameter moved by N(0, 0.1): biases and norm
/// parameters that start at 0 or 1 would hide a decoder that skips or swaps them. Tied
/// copies stay equal to their primary, as training keeps them.
fn perturbed_model(cfg: &Config) -> (Model, ParamStore) {
    let model = build_model(&cfg.model);
    let mut store = model.init(7);
    let noise = normal_values(store.values.len(), 11);
    for (v, n) in store.values.iter_mut().zip(noise) {
        *v += 0.1 * n;
    }
    for tie in model.ties() {
        let primary = model.params()[tie.primary].range.clone();
        for &c in &tie.copies {
            let copy = model.params()[c].range.clone();
            store.values.copy_within(primary.clone(), copy.start);
        }
    }
    (model, store)
}

/// Prefills the first `split` tokens of a whole context, steps through the rest, then one
/// token past the context: the decoder's logits equal the model's forward at every position
/// (within 1e-5, relative), and past the context they are those of a forward over the
/// window the decoder restarts from (the last seq/2 tokens).
fn decoder_matches_the_model(cfg: &Config, split: usize) -> Decoder {
    let (model, mut store) = perturbed_model(cfg);
    let lm = cfg.model.language().unwrap();
    let (seq, vocab) = (lm.seq, lm.vocab);
    let tokens: Vec<u32> = normal_values(seq, 5)
        .iter()
        .map(|v| ((v.abs() * 1000.0) as usize % vocab) as u32)
        .collect();
    let want = forward_logits(&model, &mut store, &tokens);
    let row = |logits: &[f32], i: usize| logits[i * vocab..][..vocab].to_vec();
    let mut decoder = Decoder::new(&cfg.model, &model, &store.values).unwrap();
    let got = decoder.prefill_all(&tokens[..split]).unwrap();
    for i in 0..split {
        let e = rel_diff(&row(&got, i), &row(&want, i));
        assert!(e < 1e-5, "prefill, position {i}: relative difference {e:e}");
    }
    for (i, &t) in tokens.iter().enumerate().skip(split) {
        let got = decoder.step(t).unwrap();
        let e = rel_diff(&got, &row(&want, i));
        assert!(e < 1e-5, "step, position {i}: relative difference {e:e}");
    }
    assert_eq!(decoder.context(), &tokens[..]);
    let next = 3;
    let got = decoder.step(next).unwrap();
    let mut window = tokens[seq - (seq / 2 - 1)..].to_vec();
    window.push(next);
    assert_eq!(
        decoder.context(),
        &window[..],
        "the window past the context"
    );
    let want = forward_logits(&model, &mut store, &window);
    let e = rel_diff(&got, &row(&want, window.len() - 1));
    assert!(e < 1e-5, "past the context: relative difference {e:e}");
    decoder
}

#[test]
fn the_decoder_gives_a_gpts_own_logits_at_every_position() {
    let dir = tempfile::tempdir().unwrap();
    decoder_matches_the_model(&tiny_gpt_config(dir.path(), 1, &[]), 5);
    // The head tied to the token embedding reads the embedding.
    let tied = tiny_gpt_config(dir.path(), 1, &["model.tie_embeddings=true"]);
    decoder_matches_the_model(&tied, 5);
    // A prefill long enough for its attention rows to run in parallel.
    let long = tiny_gpt_config(dir.path(), 1, &["model.seq=128", "model.dim=64"]);
    decoder_matches_the_model(&long, 120);
}

#[test]
fn the_decoder_gives_a_llamas_own_logits_and_caches_only_its_key_value_heads() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_llama_config(dir.path(), 1, &[]);
    let meshtrain::config::ModelConfig::Llama(l) = cfg.model else {
        panic!("not a Llama: {:?}", cfg.model);
    };
    assert!(l.kv_heads < l.heads, "{l:?}");
    let decoder = decoder_matches_the_model(&cfg, 5);
    // Every layer's keys and values of the seq/2 positions of the window: H_kv heads, not
    // the H the attention kernels' rows repeat them into.
    let positions = decoder.context().len();
    assert_eq!(positions, l.seq / 2);
    assert_eq!(
        decoder.cache_len(),
        positions * l.layers * 2 * l.kv_heads * l.head_dim()
    );
}

#[test]
fn the_decoder_refuses_what_it_cannot_decode() {
    let dir = tempfile::tempdir().unwrap();
    let gpt = tiny_gpt_config(dir.path(), 1, &[]);
    let llama = tiny_llama_config(dir.path(), 1, &[]);
    let (model, store) = perturbed_model(&gpt);
    // A GPT's parameters for a Llama config: the first tensor it lacks is named.
    let err = Decoder::new(&llama.model, &model, &store.values)
        .err()
        .expect("a GPT is no Llama");
    assert!(
        err.to_string().contains("'blocks.0.attn_norm.weight'"),
        "{err:#}"
    );
    let err = Decoder::new(&gpt.model, &model, &store.values[1..])
        .err()
        .expect("one value short");
    assert!(err.to_string().contains("parameter values"), "{err:#}");
    let mut decoder = Decoder::new(&gpt.model, &model, &store.values).unwrap();
    let vocab = decoder.vocab() as u32;
    let err = decoder.prefill(&[1, vocab]).unwrap_err();
    assert!(
        err.to_string().contains("outside the model's vocabulary"),
        "{err:#}"
    );
    let too_long = vec![1; decoder.seq() + 1];
    let err = decoder.prefill(&too_long).unwrap_err();
    assert!(err.to_string().contains("context"), "{err:#}");
    assert!(decoder.prefill(&[]).is_err());
    decoder.prefill(&[1, 2]).unwrap();
    assert!(decoder.step(vocab).is_err());
    assert_eq!(
        decoder.context(),
        &[1, 2],
        "a refused token leaves the cache as it was"
    );
}

/// Runs `meshtrain generate` on `ckpt` with the prompt "ROMEO:" and `extra`: (stdout's
/// bytes, stderr). Bytes: a barely trained model may draw bytes that are no UTF-8.
fn generate(ckpt: &Path, extra: &[&str]) -> (Vec<u8>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshtrain"))
        .current_dir(common::root())
        .args(["generate", "--checkpoint"])
        .arg(ckpt)
        .args(["--prompt", "ROMEO:"])
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    (out.stdout, stderr)
}

/// Generation from a checkpoint of `cfg` trained 6 steps: exactly --max-tokens bytes; the
/// first greedy byte is the argmax of the model's own forward over the prompt; within the
/// context the cache and the whole-window forward (--no-cache) give the same text; the
/// same seed the same sample, also past the context.
fn trained_model_generates_text(cfg: &Config) {
    let summary = (*common::job(cfg))
        .clone()
        .run(&meshtrain_train::RunOptions::default())
        .unwrap();
    assert_eq!(summary.steps, 6);
    let ckpt = cfg.train.out_dir.join("checkpoint.safetensors");
    // Byte tokens: the prompt, then exactly --max-tokens bytes, then a newline. 6 + 10 = 16
    // tokens: the whole context of the tiny models, no window.
    let greedy = ["--max-tokens", "10", "--temperature", "0"];
    let (cached, stderr) = generate(&ckpt, &greedy);
    assert!(cached.starts_with(b"ROMEO:"), "{cached:?}");
    assert_eq!(cached.len(), "ROMEO:".len() + 10 + 1, "{cached:?}");
    assert!(
        stderr.contains("generated 10 tokens in") && stderr.contains("tokens/s"),
        "{stderr}"
    );
    let (window, stderr) = generate(&ckpt, &[&greedy[..], &["--no-cache"]].concat());
    assert_eq!(cached, window, "the cache against the window's forward");
    assert!(stderr.contains("no cache"), "{stderr}");

    // The first greedy byte is the argmax of the model's own forward over the prompt.
    let (model, mut store) = meshtrain::generate::load_weights(&ckpt, cfg).unwrap();
    let prompt: Vec<u32> = "ROMEO:".bytes().map(u32::from).collect();
    let logits = forward_logits(&model, &mut store, &prompt);
    let last = &logits[5 * 256..];
    let argmax = (0..256)
        .max_by(|&a, &b| last[a].total_cmp(&last[b]))
        .unwrap();
    assert_eq!(cached[6], argmax as u8, "{cached:?}");

    // Sampling: the same seed gives the same text (40 tokens: past the context).
    let a = generate(&ckpt, &["--max-tokens", "40", "--seed", "3"]).0;
    let b = generate(&ckpt, &["--max-tokens", "40", "--seed", "3"]).0;
    assert!(a.starts_with(b"ROMEO:"), "{a:?}");
    assert_eq!(a.len(), "ROMEO:".len() + 40 + 1, "{a:?}");
    assert_eq!(a, b);
}

#[test]
fn a_trained_gpt_generates_text() {
    let dir = tempfile::tempdir().unwrap();
    trained_model_generates_text(&tiny_gpt_config(dir.path(), 6, &[]));
}

#[test]
fn a_trained_llama_generates_text() {
    let dir = tempfile::tempdir().unwrap();
    trained_model_generates_text(&tiny_llama_config(dir.path(), 6, &[]));
}
