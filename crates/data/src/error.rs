//! One typed error for the whole crate. Every variant that concerns a file
//! carries its path, so the message always says *which* file is bad.

use std::path::PathBuf;

/// Errors from loading, verifying, downloading or batching data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{}: file not found", .path.display())]
    MissingFile { path: PathBuf },

    #[error("{}: cannot read: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{}: not a valid gzip stream (corrupt or truncated .gz file): {source}", .path.display())]
    BadGzip {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{}: decompresses to more than {limit} bytes; refusing to read further", .path.display())]
    TooLarge { path: PathBuf, limit: u64 },

    #[error("{}: bad IDX magic 0x{found:08x}, expected 0x{expected:08x} (unsigned-byte IDX with {} dimension(s))", .path.display(), .expected & 0xff)]
    BadMagic {
        path: PathBuf,
        found: u32,
        expected: u32,
    },

    #[error("{}: truncated: the IDX header promises {expected} bytes, the file holds {actual}", .path.display())]
    Truncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },

    #[error("{}: {extra} unexpected bytes after the IDX payload", .path.display())]
    TrailingBytes { path: PathBuf, extra: u64 },

    #[error("{}: images are {height}x{width}, expected {expected_height}x{expected_width}", .path.display())]
    UnexpectedShape {
        path: PathBuf,
        height: usize,
        width: usize,
        expected_height: usize,
        expected_width: usize,
    },

    #[error("{} holds {images_count} images but {} holds {labels_count} labels", .images.display(), .labels.display())]
    CountMismatch {
        images: PathBuf,
        images_count: usize,
        labels: PathBuf,
        labels_count: usize,
    },

    #[error("{}: label {label} at index {index} is out of range (expected 0..{num_classes})", .path.display())]
    LabelOutOfRange {
        path: PathBuf,
        index: usize,
        label: u8,
        num_classes: usize,
    },

    #[error("{}: SHA-256 of the decompressed payload is {actual}, expected {expected}", .path.display())]
    ChecksumMismatch {
        path: PathBuf,
        actual: String,
        expected: String,
    },

    #[error("download failed: {reason}")]
    Download { reason: String },

    #[error("no Fashion-MNIST data found; tried: {tried}")]
    NotFound { tried: String },

    #[error("text split has {len} bytes, a block needs at least {needed} (block size + 1)")]
    TextTooShort { len: usize, needed: usize },

    #[error("{what}: buffer holds {actual} elements, expected {expected}")]
    BufferSize {
        what: &'static str,
        expected: usize,
        actual: usize,
    },

    #[error("sample index {index} out of range for a dataset of {len} samples")]
    IndexOutOfRange { index: usize, len: usize },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}
