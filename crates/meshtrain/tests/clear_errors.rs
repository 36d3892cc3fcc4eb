//! What can be found wrong before the workers start is said once, in one line, before any
//! work: the output directory, the checkpoint to resume or start from. A worker that fails
//! mid-run is named first, its peers' knock-on failures after it.

mod common;

use std::path::Path;

/// `meshtrain train` on the tiny GPT over 2 workers into `out` for 3 steps, with `extra`
/// arguments: (success, stdout, stderr).
fn train(out: &Path, extra: &[&str]) -> (bool, String, String) {
    let mut args = vec!["--set", "train.steps=3"];
    args.extend(extra);
    common::meshtrain(&common::tiny_gpt_args(out, &args))
}

/// The run failed before any step, saying `what` once, on one line, and nothing of workers.
fn refused_once(result: (bool, String, String), what: &str) {
    let (ok, stdout, stderr) = result;
    assert!(!ok, "{stdout}");
    assert_eq!(stderr.matches(what).count(), 1, "{stderr}");
    let line = stderr.lines().find(|l| l.contains(what)).unwrap();
    assert!(line.starts_with("Error: "), "{stderr}");
    assert!(!stderr.contains("Caused by"), "{stderr}");
    assert!(!stderr.contains("worker"), "{stderr}");
    assert!(!stdout.contains("step "), "it trained: {stdout}");
}

#[test]
fn a_bad_output_directory_is_one_error_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    refused_once(
        train(&file, &[]),
        &format!(
            "the output directory {} (train.out_dir) is a file",
            file.display()
        ),
    );
}

#[test]
fn a_bad_checkpoint_is_one_error_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.safetensors");
    let missing_arg = missing.display().to_string();
    refused_once(
        train(dir.path(), &["--resume", &missing_arg]),
        &format!(
            "cannot resume: checkpoint {} does not exist",
            missing.display()
        ),
    );
    refused_once(
        train(dir.path(), &["--init-from", &missing_arg]),
        "cannot take the initial weights (--init-from): checkpoint",
    );
    // A real checkpoint, then cut short as an interrupted copy leaves it.
    let run = dir.path().join("run");
    let (ok, _, stderr) = train(&run, &[]);
    assert!(ok, "{stderr}");
    let checkpoint = run.join("checkpoint.safetensors");
    let bytes = std::fs::read(&checkpoint).unwrap();
    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let truncated_arg = truncated.display().to_string();
    refused_once(
        train(&run, &["--resume", &truncated_arg]),
        &format!(
            "cannot resume: checkpoint {} is truncated",
            truncated.display()
        ),
    );
    // Cut inside its header, and given to generate and export: the same words (issue 40:
    // they printed the safetensors crate's MetadataIncompleteBuffer).
    let cut_header = dir.path().join("cut-header.safetensors");
    std::fs::write(&cut_header, &bytes[..200]).unwrap();
    let cut_header_arg = cut_header.display().to_string();
    refused_once(
        train(&run, &["--resume", &cut_header_arg]),
        &format!(
            "cannot resume: checkpoint {} is truncated",
            cut_header.display()
        ),
    );
    let hf = dir.path().join("hf").display().to_string();
    for path in [&truncated_arg, &cut_header_arg] {
        for command in [
            ["generate", "--checkpoint", path, "--prompt", "ROMEO:"],
            ["export", "--checkpoint", path, "--out", &hf],
        ] {
            let (ok, stdout, stderr) = common::meshtrain(&command);
            assert!(
                !ok && stderr.contains(&format!("checkpoint {path} is truncated"))
                    && !stderr.contains("MetadataIncompleteBuffer"),
                "{command:?}: {stdout}{stderr}"
            );
        }
    }
    // Another model: resuming refuses it (fine-tuning would take matching tensors).
    let checkpoint_arg = checkpoint.display().to_string();
    refused_once(
        train(
            &run,
            &["--resume", &checkpoint_arg, "--set", "model.dim=64"],
        ),
        "holds another model",
    );
    refused_once(
        train(
            &run,
            &["--init-from", &checkpoint_arg, "--set", "model.dim=64"],
        ),
        "the model needs F32",
    );
}
