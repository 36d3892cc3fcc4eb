//! `meshtrain generate`: text from a checkpoint, the model rebuilt from the run config it
//! holds; greedy decoding follows the model's own forward pass, sampling its seed. The
//! key/value-cache decoder behind it gives the model's own logits at every position, for GPT
//! and for Llama with grouped-query attention, and keeps only the key/value heads. On a GPU
//! (`--device cuda`) it gives the CPU's logits and tokens; without one, `--device cuda` says
//! which library is missing (the GPU tests are skipped with the reason printed, and required
//! with `MESHTRAIN_REQUIRE_GPU=1`).

mod common;

use common::{gpu, rel_diff, tiny_gpt_config, tiny_llama_config};
use meshtrain::config::Config;
use meshtrain::generate::Tokenizer;
use meshtrain::presets::build_model;
use meshtrain_nn::generate::{continue_text, sample, Decoder, NextLogits, Sampling};
use meshtrain_nn::{Mode, Model, ParamStore};
use meshtrain_tensor::rng::{normal_values, SplitMix64};
use meshtrain_tensor::{Device, Tensor};
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
/// window the decoder restarts from (the last seq/2 tokens). Returns the decoder's context
/// and the f32 values its cache holds then.
fn decoder_matches_the_model(cfg: &Config, split: usize) -> (Vec<u32>, usize) {
    let (model, mut store) = perturbed_model(cfg);
    let lm = cfg.model.language().unwrap();
    let (seq, vocab) = (lm.seq, lm.vocab);
    let tokens: Vec<u32> = normal_values(seq, 5)
        .iter()
        .map(|v| ((v.abs() * 1000.0) as usize % vocab) as u32)
        .collect();
    let want = forward_logits(&model, &mut store, &tokens);
    let row = |logits: &[f32], i: usize| logits[i * vocab..][..vocab].to_vec();
    let values = store.values.clone();
    let mut decoder = Decoder::new(&model, &values).unwrap();
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
    (decoder.context().to_vec(), decoder.cache_len())
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
    let (context, cache_len) = decoder_matches_the_model(&cfg, 5);
    // Every layer's keys and values of the seq/2 positions of the window: H_kv heads, not
    // the H the attention kernels' rows repeat them into.
    let positions = context.len();
    assert_eq!(positions, l.seq / 2);
    assert_eq!(
        cache_len,
        positions * l.layers * 2 * l.kv_heads * l.head_dim()
    );
}

#[test]
fn the_decoder_refuses_what_it_cannot_decode() {
    let dir = tempfile::tempdir().unwrap();
    let gpt = tiny_gpt_config(dir.path(), 1, &[]);
    let llama = tiny_llama_config(dir.path(), 1, &[]);
    let (model, store) = perturbed_model(&gpt);
    // A GPT's parameters for a Llama: their count is not the model's.
    let (llama_model, _) = perturbed_model(&llama);
    let err = Decoder::new(&llama_model, &store.values)
        .err()
        .expect("a GPT is no Llama");
    assert!(err.to_string().contains("parameter values"), "{err:#}");
    let err = Decoder::new(&model, &store.values[1..])
        .err()
        .expect("one value short");
    assert!(err.to_string().contains("parameter values"), "{err:#}");
    // An image model is not decoded.
    let lenet = meshtrain::presets::build_model(&meshtrain::config::ModelConfig::Lenet {
        variant: Default::default(),
    });
    let values = vec![0.0; lenet.num_params()];
    let err = Decoder::new(&lenet, &values).err().expect("LeNet");
    assert!(err.to_string().contains("language model"), "{err:#}");
    let mut decoder = Decoder::new(&model, &store.values).unwrap();
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

/// The CPU decoder and the GPU's on the same perturbed model of `cfg`: a prefill of the first
/// `split` tokens (every row's logits), a step per token to the end of the context and past
/// it (the window restart), every logits row within 1e-4 (relative L2, f32 on both); then
/// greedy generation of `2·seq` byte tokens from a prompt draws the same tokens on both
/// (near-ties aside).
fn gpu_decoder_matches_the_cpu(cfg: &Config, split: usize) {
    let (model, store) = perturbed_model(cfg);
    let lm = cfg.model.language().unwrap();
    let (seq, vocab) = (lm.seq, lm.vocab);
    let mut cpu = Decoder::new(&model, &store.values).unwrap();
    let mut gpu = Decoder::on(Device::Cuda(0), &model, &store.values).unwrap();
    assert!(gpu.device().starts_with("cuda:0"), "{}", gpu.device());
    assert_eq!(cpu.device(), "cpu");
    let tokens: Vec<u32> = normal_values(seq + 5, 9)
        .iter()
        .map(|v| ((v.abs() * 1000.0) as usize % vocab) as u32)
        .collect();
    let close = |got: &[f32], want: &[f32], what: String| {
        let e = rel_diff(got, want);
        assert!(e <= 1e-4, "{what}: relative difference {e:e}");
    };
    let (want, got) = (
        cpu.prefill_all(&tokens[..split]).unwrap(),
        gpu.prefill_all(&tokens[..split]).unwrap(),
    );
    assert_eq!(got.len(), split * vocab);
    for i in 0..split {
        let row = |l: &[f32]| l[i * vocab..][..vocab].to_vec();
        close(&row(&got), &row(&want), format!("prefill, position {i}"));
    }
    for (i, &t) in tokens.iter().enumerate().skip(split) {
        let want = cpu.step(t).unwrap();
        let got = gpu.step(t).unwrap();
        close(&got, &want, format!("step {i}"));
        assert_eq!(gpu.context(), cpu.context(), "step {i}");
    }
    assert_eq!(gpu.cache_len(), cpu.cache_len());
    // A new text on the same decoders: the prefill overwrites the cache.
    let prompt = &tokens[3..9];
    close(
        &gpu.prefill(prompt).unwrap(),
        &cpu.prefill(prompt).unwrap(),
        "a second prefill".into(),
    );

    // Greedy decoding, both fed the CPU's choice: the same token at every step but where
    // the CPU's two best logits are closer than the devices' difference (a near-tie, which
    // either may break).
    let prompt: Vec<u32> = b"ROMEO:"
        .iter()
        .map(|&b| u32::from(b) % vocab as u32)
        .collect();
    let (mut want, mut got) = (cpu.prefill(&prompt).unwrap(), gpu.prefill(&prompt).unwrap());
    let mut rng = SplitMix64::new(1);
    let mut near_ties = 0;
    for i in 0..2 * seq {
        close(&got, &want, format!("greedy step {i}"));
        let bytes = 256.min(vocab);
        let a = sample(&want[..bytes], 0.0, 0, &mut rng);
        let b = sample(&got[..bytes], 0.0, 0, &mut rng);
        if a != b {
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let gap = (want[a] - want[b]).abs();
            assert!(
                gap <= 1e-4 * scale,
                "greedy step {i}: the CPU picks {a}, the GPU {b}, {gap} apart"
            );
            near_ties += 1;
        }
        want = cpu.step(a as u32).unwrap();
        got = gpu.step(a as u32).unwrap();
    }
    // Through the loop `meshtrain generate` runs: the same text (unless a near-tie above
    // let the GPU choose otherwise).
    let greedy = Sampling {
        temperature: 0.0,
        top_k: 0,
        seed: 1,
    };
    let mut texts = Vec::new();
    for decoder in [cpu, gpu] {
        let mut next = NextLogits::Cached(Box::new(decoder));
        let mut bytes = Vec::new();
        let drawn = continue_text(
            &mut next,
            &Tokenizer::Bytes,
            &prompt,
            2 * seq,
            greedy,
            |t| {
                bytes.extend_from_slice(&Tokenizer::Bytes.bytes(t));
                Ok::<(), meshtrain_nn::generate::GenerateError>(())
            },
        )
        .unwrap();
        assert_eq!(drawn, 2 * seq);
        texts.push(bytes);
    }
    if near_ties == 0 {
        assert_eq!(texts[0], texts[1], "greedy tokens, CPU against GPU");
    }
}

#[test]
fn the_gpu_decoder_gives_the_cpus_logits_and_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // (config, tokens prefilled): heads of 8 values (the tiny GPT), a tied head, heads of 32
    // and 64 with long prefills; Llama's grouped-query heads (4 over 2 of 8 values, 2 over 1
    // of 128), rotary positions, SwiGLU, RMS norms. Built before the GPU check: without a GPU
    // the configs are still checked.
    let wide = ["model.dim=128", "model.heads=4", "model.seq=64"];
    let wider = ["model.dim=128", "model.heads=2", "model.seq=160"];
    let llama = [
        "model.dim=256",
        "model.heads=2",
        "model.kv_heads=1",
        "model.ffn=384",
        "model.seq=140",
    ];
    let cases = [
        (tiny_gpt_config(d, 1, &[]), 5),
        (tiny_gpt_config(d, 1, &["model.tie_embeddings=true"]), 5),
        (tiny_gpt_config(d, 1, &wide), 50),
        (tiny_gpt_config(d, 1, &wider), 150),
        (tiny_llama_config(d, 1, &[]), 5),
        (tiny_llama_config(d, 1, &llama), 130),
    ];
    if !gpu() {
        return;
    }
    for (cfg, split) in &cases {
        gpu_decoder_matches_the_cpu(cfg, *split);
    }
}

/// Runs `meshtrain generate` on `ckpt` with the prompt "ROMEO:" and `extra`: (success,
/// stdout's bytes, stderr). Bytes: a barely trained model may draw bytes that are no UTF-8.
fn try_generate(ckpt: &Path, extra: &[&str]) -> (bool, Vec<u8>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshtrain"))
        .current_dir(common::root())
        .args(["generate", "--checkpoint"])
        .arg(ckpt)
        .args(["--prompt", "ROMEO:"])
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), out.stdout, stderr)
}

/// [`try_generate`], which must succeed: (stdout's bytes, stderr).
fn generate(ckpt: &Path, extra: &[&str]) -> (Vec<u8>, String) {
    let (ok, stdout, stderr) = try_generate(ckpt, extra);
    assert!(ok, "{stderr}");
    (stdout, stderr)
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
        stderr.contains("generated 10 tokens in") && stderr.contains("tokens/s on cpu"),
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

    // What a new user tripped over (issue 40): a negative or NaN temperature was taken
    // silently (or as another flag), and a tokenizer whose ids are not the model's printed
    // garbage with exit 0.
    for temperature in ["--temperature=-1", "--temperature=nan"] {
        let (ok, _, stderr) = try_generate(&ckpt, &[temperature]);
        assert!(
            !ok && stderr.contains("--temperature must be 0"),
            "{stderr}"
        );
    }
    let (ok, _, stderr) = try_generate(&ckpt, &["--temperature", "-1"]);
    assert!(
        !ok && stderr.contains("--temperature must be 0"),
        "{stderr}"
    );
    let (ok, _, stderr) = try_generate(&ckpt, &["--encoding", "gpt2"]);
    assert!(
        !ok && stderr.contains("vocabulary has 256 ids") && stderr.contains("--encoding bytes"),
        "{stderr}"
    );

    // Sampling: the same seed gives the same text (40 tokens: past the context).
    let a = generate(&ckpt, &["--max-tokens", "40", "--seed", "3"]).0;
    let b = generate(&ckpt, &["--max-tokens", "40", "--seed", "3"]).0;
    assert!(a.starts_with(b"ROMEO:"), "{a:?}");
    assert_eq!(a.len(), "ROMEO:".len() + 40 + 1, "{a:?}");
    assert_eq!(a, b);

    // On a GPU: the same greedy text, the device named with the speed; without one, the
    // missing library named (no panic), before any text.
    // --compare-cpu on the CPU: the same decoder twice, no difference.
    let (text, stderr) = generate(&ckpt, &[&greedy[..], &["--compare-cpu"]].concat());
    assert_eq!(text, cached);
    assert_eq!(largest_difference(&stderr), 0.0, "{stderr}");
    let on_gpu = try_generate(
        &ckpt,
        &[&greedy[..], &["--device", "cuda", "--compare-cpu"]].concat(),
    );
    if gpu() {
        let (ok, text, stderr) = on_gpu;
        assert!(ok, "{stderr}");
        assert!(stderr.contains("tokens/s on cuda:0"), "{stderr}");
        let worst = largest_difference(&stderr);
        assert!(worst <= 1e-4, "{stderr}");
        if stderr.contains("differs at 0 of them") {
            assert_eq!(text, cached, "greedy text on the GPU against the CPU");
        }
    } else {
        no_gpu_is_said_clearly(on_gpu);
    }
}

/// The largest relative difference `generate --compare-cpu` reports.
fn largest_difference(stderr: &str) -> f64 {
    let after = stderr
        .split("largest relative difference ")
        .nth(1)
        .unwrap_or_else(|| panic!("no comparison reported: {stderr}"));
    after.split_whitespace().next().unwrap().parse().unwrap()
}

/// `generate --device cuda` where no GPU can be used: a failure naming what is missing and
/// the way out, no panic, no text.
fn no_gpu_is_said_clearly((ok, stdout, stderr): (bool, Vec<u8>, String)) {
    assert!(!ok, "generated without a GPU: {stderr}");
    assert!(
        stderr.contains("libcuda.so.1") || stderr.contains("NVRTC") || stderr.contains("GPU"),
        "{stderr}"
    );
    assert!(stderr.contains("--device cpu"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stdout.is_empty(), "{stdout:?}");
}

#[test]
fn generate_takes_the_devices_train_takes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(dir.path(), 1, &[]);
    (*common::job(&cfg))
        .clone()
        .run(&meshtrain_train::RunOptions::default())
        .unwrap();
    let ckpt = cfg.train.out_dir.join("checkpoint.safetensors");
    let (ok, _, stderr) = try_generate(&ckpt, &["--device", "tpu"]);
    assert!(!ok && stderr.contains("cpu, cuda or cuda:N"), "{stderr}");
    let (ok, _, stderr) = try_generate(&ckpt, &["--device", "cuda", "--no-cache"]);
    assert!(!ok && stderr.contains("--no-cache"), "{stderr}");
    let (text, stderr) = generate(&ckpt, &["--device", "cpu", "--max-tokens", "3"]);
    assert_eq!(text.len(), "ROMEO:".len() + 3 + 1, "{stderr}");
    // A GPU number the machine does not have (or no GPU at all): said, no panic.
    no_gpu_is_said_clearly(try_generate(&ckpt, &["--device", "cuda:99"]));
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

/// The GPU tests above on the emulated CUDA device (`crates/tensor/tests/cuda_emu/device`):
/// the GPU decoder's host code and `generate --device cuda` run on every machine with g++ and
/// CUDA's headers, not only on a card.
#[cfg(feature = "cuda")]
#[test]
fn the_gpu_tests_pass_on_the_emulated_device() {
    common::rerun_on_the_emulated_device(&[
        "the_gpu_decoder_gives_the_cpus_logits_and_tokens",
        "a_trained_gpt_generates_text",
        "a_trained_llama_generates_text",
    ]);
}
