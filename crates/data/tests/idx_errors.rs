//! Every corrupt-input case yields its own error variant, and the message
//! names the offending file.

mod common;

use std::fs;
use std::path::Path;

use common::{copy_subset_into, gzip, idx_bytes, write_gz, TempDir};
use meshtrain_data::fashion::{TEST_IMAGES, TEST_LABELS};
use meshtrain_data::idx::{read_images, read_labels};
use meshtrain_data::{load_split, DataError, Normalization, Split};

fn assert_names(error: &DataError, path: &Path) {
    let message = error.to_string();
    assert!(
        message.contains(&path.display().to_string()),
        "message does not name {}: {message}",
        path.display()
    );
}

#[test]
fn missing_file() {
    let dir = TempDir::new("missing");
    let path = dir.join("nope.gz");
    let error = read_labels(&path, 10).unwrap_err();
    assert!(matches!(error, DataError::MissingFile { .. }), "{error:?}");
    assert_names(&error, &path);
}

#[test]
fn not_gzip_at_all() {
    let dir = TempDir::new("badgz");
    let path = dir.join("labels.gz");
    fs::write(&path, b"this is plain text, not gzip").unwrap();
    let error = read_labels(&path, 10).unwrap_err();
    assert!(matches!(error, DataError::BadGzip { .. }), "{error:?}");
    assert_names(&error, &path);
}

#[test]
fn truncated_gzip_stream() {
    let dir = TempDir::new("truncgz");
    let path = dir.join("images.gz");
    let compressed = gzip(&idx_bytes(&[2, 28, 28], &[7u8; 2 * 784]));
    fs::write(&path, &compressed[..compressed.len() / 2]).unwrap();
    let error = read_images(&path).unwrap_err();
    assert!(matches!(error, DataError::BadGzip { .. }), "{error:?}");
    assert_names(&error, &path);
}

#[test]
fn bad_magic() {
    let dir = TempDir::new("magic");
    let path = dir.join("images.gz");
    // A labels file (1 dimension) where images (3 dimensions) are expected.
    write_gz(&path, &idx_bytes(&[3], &[1, 2, 3]));
    let error = read_images(&path).unwrap_err();
    match &error {
        DataError::BadMagic {
            found, expected, ..
        } => {
            assert_eq!(*found, 0x0000_0801);
            assert_eq!(*expected, 0x0000_0803);
        }
        other => panic!("expected BadMagic, got {other:?}"),
    }
    assert_names(&error, &path);
}

#[test]
fn truncated_payload() {
    let dir = TempDir::new("truncidx");
    let path = dir.join("images.gz");
    write_gz(&path, &idx_bytes(&[3, 28, 28], &[0u8; 2 * 784 + 5]));
    let error = read_images(&path).unwrap_err();
    match &error {
        DataError::Truncated {
            expected, actual, ..
        } => {
            assert_eq!(*expected, 16 + 3 * 784);
            assert_eq!(*actual, 16 + 2 * 784 + 5);
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    assert_names(&error, &path);
}

#[test]
fn truncated_header() {
    let dir = TempDir::new("trunchdr");
    let path = dir.join("images.gz");
    write_gz(&path, &[0, 0, 8, 3, 0, 0]);
    let error = read_images(&path).unwrap_err();
    assert!(matches!(error, DataError::Truncated { .. }), "{error:?}");
    assert_names(&error, &path);
}

#[test]
fn trailing_bytes() {
    let dir = TempDir::new("trailing");
    let path = dir.join("labels.gz");
    write_gz(&path, &idx_bytes(&[2], &[1, 2, 3]));
    let error = read_labels(&path, 10).unwrap_err();
    assert!(
        matches!(error, DataError::TrailingBytes { extra: 1, .. }),
        "{error:?}"
    );
    assert_names(&error, &path);
}

#[test]
fn label_out_of_range() {
    let dir = TempDir::new("label");
    let path = dir.join("labels.gz");
    write_gz(&path, &idx_bytes(&[4], &[0, 9, 10, 3]));
    let error = read_labels(&path, 10).unwrap_err();
    assert!(
        matches!(
            error,
            DataError::LabelOutOfRange {
                index: 2,
                label: 10,
                ..
            }
        ),
        "{error:?}"
    );
    assert_names(&error, &path);
}

#[test]
fn valid_small_files_parse() {
    let dir = TempDir::new("valid");
    let images_path = dir.join("images.gz");
    let pixels: Vec<u8> = (0..2 * 3 * 4).map(|i| i as u8).collect();
    write_gz(&images_path, &idx_bytes(&[2, 3, 4], &pixels));
    let images = read_images(&images_path).unwrap();
    assert_eq!((images.count, images.height, images.width), (2, 3, 4));
    assert_eq!(images.pixels, pixels);
    let labels_path = dir.join("labels.gz");
    write_gz(&labels_path, &idx_bytes(&[2], &[4, 1]));
    assert_eq!(read_labels(&labels_path, 10).unwrap().labels, [4, 1]);
}

/// A test-split directory holding the real shipped files, with one of them
/// replaced by `replacement` (gzip-compressed IDX bytes).
fn split_dir_with(label: &str, file: &str, replacement: &[u8]) -> TempDir {
    let dir = TempDir::new(label);
    copy_subset_into(dir.path());
    write_gz(&dir.join(file), replacement);
    dir
}

#[test]
fn count_mismatch_between_images_and_labels() {
    let dir = split_dir_with("count", TEST_LABELS, &idx_bytes(&[3], &[1, 2, 3]));
    let error = load_split(dir.path(), Split::Test, Normalization::UnitRange).unwrap_err();
    match &error {
        DataError::CountMismatch {
            images_count,
            labels_count,
            ..
        } => assert_eq!((*images_count, *labels_count), (10_000, 3)),
        other => panic!("expected CountMismatch, got {other:?}"),
    }
    assert_names(&error, &dir.join(TEST_IMAGES));
    assert_names(&error, &dir.join(TEST_LABELS));
}

#[test]
fn wrong_image_size() {
    let dir = split_dir_with(
        "shape",
        TEST_IMAGES,
        &idx_bytes(&[10_000, 1, 1], &[0u8; 10_000]),
    );
    let error = load_split(dir.path(), Split::Test, Normalization::UnitRange).unwrap_err();
    assert!(
        matches!(
            error,
            DataError::UnexpectedShape {
                height: 1,
                width: 1,
                ..
            }
        ),
        "{error:?}"
    );
    assert_names(&error, &dir.join(TEST_IMAGES));
}

#[test]
fn one_flipped_label_fails_the_checksum() {
    let dir = TempDir::new("checksum");
    copy_subset_into(dir.path());
    let path = dir.join(TEST_LABELS);
    let mut payload = meshtrain_data::idx::read_gz(&path).unwrap().bytes;
    // Swap a label for another valid one: structure stays perfect, so only
    // the digest can notice.
    payload[8] = (payload[8] + 1) % 10;
    write_gz(&path, &payload);
    let error = load_split(dir.path(), Split::Test, Normalization::UnitRange).unwrap_err();
    match &error {
        DataError::ChecksumMismatch {
            expected, actual, ..
        } => {
            assert_eq!(expected, meshtrain_data::fashion::FULL_SHA256.test_labels);
            assert_ne!(actual, expected);
        }
        other => panic!("expected ChecksumMismatch, got {other:?}"),
    }
    assert_names(&error, &path);
}
