//! Shared by the integration tests that train small models end to end.

use std::path::PathBuf;

/// The workspace root (configs/ and data/ live there).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Overrides that shrink `configs/gpt.toml` to the tiny GPT the parallel tests train: 4
/// blocks (embedding, 2 layers, head), width 32, 2 heads, context 16.
pub const TINY_GPT: [&str; 4] = [
    "model.dim=32",
    "model.layers=2",
    "model.heads=2",
    "model.seq=16",
];
