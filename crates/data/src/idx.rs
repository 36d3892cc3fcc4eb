//! Reading gzip-compressed IDX files (the format of MNIST and Fashion-MNIST).
//!
//! An IDX file is a 4-byte magic `00 00 <type> <ndims>`, then `ndims`
//! big-endian u32 dimensions, then the payload in row-major order. We only
//! accept type 0x08 (unsigned byte), which is all the MNIST family uses.

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use sha2::{Digest, Sha256};

use crate::error::DataError;

/// Upper bound on a decompressed file: the largest real file (Fashion-MNIST
/// train images) is 47 MB, so anything far beyond is corrupt or a gzip bomb.
pub const MAX_DECOMPRESSED_BYTES: u64 = 256 << 20;

const IDX_UNSIGNED_BYTE: u32 = 0x08;

/// Decompressed payload of one `.gz` file, kept with its path for messages.
#[derive(Debug, Clone)]
pub struct GzFile {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

/// Images from an IDX3 file: `count` images of `height`×`width` raw bytes.
#[derive(Debug, Clone)]
pub struct IdxImages {
    pub path: PathBuf,
    pub count: usize,
    pub height: usize,
    pub width: usize,
    /// `count * height * width` pixel bytes, image after image.
    pub pixels: Vec<u8>,
    /// SHA-256 (hex) of the whole decompressed file, header included.
    pub sha256: String,
}

/// Labels from an IDX1 file.
#[derive(Debug, Clone)]
pub struct IdxLabels {
    pub path: PathBuf,
    pub labels: Vec<u8>,
    /// SHA-256 (hex) of the whole decompressed file, header included.
    pub sha256: String,
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Reads and gunzips `path`, mapping every failure to an error naming it.
/// Concatenated gzip members are joined (as `gunzip` does); bytes after the
/// last member that are not gzip make the file invalid.
pub fn read_gz(path: &Path) -> Result<GzFile, DataError> {
    let file = File::open(path).map_err(|source| match source.kind() {
        ErrorKind::NotFound => DataError::MissingFile {
            path: path.to_path_buf(),
        },
        _ => DataError::Io {
            path: path.to_path_buf(),
            source,
        },
    })?;
    let mut bytes = Vec::new();
    MultiGzDecoder::new(file)
        .take(MAX_DECOMPRESSED_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| DataError::BadGzip {
            path: path.to_path_buf(),
            source,
        })?;
    if bytes.len() as u64 > MAX_DECOMPRESSED_BYTES {
        return Err(DataError::TooLarge {
            path: path.to_path_buf(),
            limit: MAX_DECOMPRESSED_BYTES,
        });
    }
    Ok(GzFile {
        path: path.to_path_buf(),
        bytes,
    })
}

/// Checks the magic and the exact payload length; returns the dimensions and
/// the header length in bytes.
fn parse_idx(file: &GzFile, ndims: usize) -> Result<(Vec<usize>, usize), DataError> {
    let header_len = 4 + 4 * ndims;
    let expected_magic = (IDX_UNSIGNED_BYTE << 8) | ndims as u32;
    let bytes = &file.bytes;
    if bytes.len() < 4 {
        return Err(DataError::Truncated {
            path: file.path.clone(),
            expected: header_len as u64,
            actual: bytes.len() as u64,
        });
    }
    let magic = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    if magic != expected_magic {
        return Err(DataError::BadMagic {
            path: file.path.clone(),
            found: magic,
            expected: expected_magic,
        });
    }
    if bytes.len() < header_len {
        return Err(DataError::Truncated {
            path: file.path.clone(),
            expected: header_len as u64,
            actual: bytes.len() as u64,
        });
    }
    let dims: Vec<usize> = bytes[4..header_len]
        .chunks_exact(4)
        .map(|word| u32::from_be_bytes([word[0], word[1], word[2], word[3]]) as usize)
        .collect();
    // u64 arithmetic: three u32 dimensions cannot overflow it by much, and a
    // product beyond the file size is reported as truncation anyway.
    let payload_len = dims
        .iter()
        .fold(1u64, |acc, &dim| acc.saturating_mul(dim as u64));
    let expected_total = payload_len.saturating_add(header_len as u64);
    let actual_total = bytes.len() as u64;
    if actual_total < expected_total {
        return Err(DataError::Truncated {
            path: file.path.clone(),
            expected: expected_total,
            actual: actual_total,
        });
    }
    if actual_total > expected_total {
        return Err(DataError::TrailingBytes {
            path: file.path.clone(),
            extra: actual_total - expected_total,
        });
    }
    Ok((dims, header_len))
}

/// Parses a decompressed IDX3 (images) file.
pub fn parse_images(file: GzFile) -> Result<IdxImages, DataError> {
    let (dims, header_len) = parse_idx(&file, 3)?;
    let sha256 = sha256_hex(&file.bytes);
    let mut pixels = file.bytes;
    pixels.drain(..header_len);
    Ok(IdxImages {
        path: file.path,
        count: dims[0],
        height: dims[1],
        width: dims[2],
        pixels,
        sha256,
    })
}

/// Parses a decompressed IDX1 (labels) file and checks every label is below
/// `num_classes`.
pub fn parse_labels(file: GzFile, num_classes: usize) -> Result<IdxLabels, DataError> {
    let (_dims, header_len) = parse_idx(&file, 1)?;
    let payload = &file.bytes[header_len..];
    if let Some((index, &label)) = payload
        .iter()
        .enumerate()
        .find(|(_, &label)| label as usize >= num_classes)
    {
        return Err(DataError::LabelOutOfRange {
            path: file.path.clone(),
            index,
            label,
            num_classes,
        });
    }
    let sha256 = sha256_hex(&file.bytes);
    let mut labels = file.bytes;
    labels.drain(..header_len);
    Ok(IdxLabels {
        path: file.path,
        labels,
        sha256,
    })
}

/// Reads and parses a gzip-compressed IDX3 image file.
pub fn read_images(path: &Path) -> Result<IdxImages, DataError> {
    parse_images(read_gz(path)?)
}

/// Reads and parses a gzip-compressed IDX1 label file.
pub fn read_labels(path: &Path, num_classes: usize) -> Result<IdxLabels, DataError> {
    parse_labels(read_gz(path)?, num_classes)
}
