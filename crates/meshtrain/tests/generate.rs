//! `meshtrain generate`: text from a checkpoint, the model rebuilt from the run config it
//! holds; greedy decoding follows the model's own forward pass, sampling its seed.

mod common;

use common::{meshtrain, tiny_gpt_config};
use meshtrain_nn::Mode;
use meshtrain_tensor::Tensor;

#[test]
fn a_trained_gpt_generates_text() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_gpt_config(dir.path(), 6, &[]);
    let summary = (*common::job(&cfg))
        .clone()
        .run(&meshtrain_train::RunOptions::default())
        .unwrap();
    assert_eq!(summary.steps, 6);
    let ckpt = dir.path().join("checkpoint.safetensors");
    let ckpt_arg = ckpt.display().to_string();
    let generate = |extra: &[&str]| {
        let mut args = vec!["generate", "--checkpoint", &ckpt_arg, "--prompt", "ROMEO:"];
        args.extend(extra);
        let (ok, stdout, stderr) = meshtrain(&args);
        assert!(ok, "{stderr}");
        stdout
    };
    // Byte tokens: the prompt, then exactly --max-tokens bytes, then a newline.
    let greedy = generate(&["--max-tokens", "12", "--temperature", "0"]);
    assert!(greedy.starts_with("ROMEO:"), "{greedy:?}");
    assert_eq!(greedy.len(), "ROMEO:".len() + 12 + 1, "{greedy:?}");

    // The first greedy byte is the argmax of the model's own forward over the prompt.
    let (model, mut store) = meshtrain::generate::load_weights(&ckpt, &cfg).unwrap();
    let prompt: Vec<f32> = "ROMEO:".bytes().map(f32::from).collect();
    let (logits, _) = model.forward_all(&mut store, Tensor::from_vec(prompt, &[1, 6]), Mode::EVAL);
    let last = &logits.data()[5 * 256..];
    let argmax = (0..256)
        .max_by(|&a, &b| last[a].total_cmp(&last[b]))
        .unwrap();
    assert_eq!(greedy.as_bytes()[6], argmax as u8, "{greedy:?}");

    // Sampling: the same seed gives the same text.
    let a = generate(&["--max-tokens", "40", "--seed", "3"]);
    let b = generate(&["--max-tokens", "40", "--seed", "3"]);
    assert_eq!(a, b);
}
