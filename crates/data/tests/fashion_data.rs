//! Real-data checks: label counts, pixel statistics and digests of the
//! shipped subset (always) and of Debian's full set (when installed).

mod common;

use std::path::Path;

use common::{debian_dir, subset_dir};
use meshtrain_data::fashion::{NUM_CLASSES, TEST_IMAGES, TRAIN_IMAGES};
use meshtrain_data::idx::read_images;
use meshtrain_data::{load_split, DataError, ImageDataset, Normalization, Split};

/// Mean and population standard deviation, accumulated in f64.
fn mean_std(values: &[f32]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = values
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, var.sqrt())
}

fn assert_shape(dataset: &ImageDataset, n: usize) {
    assert_eq!(dataset.n, n);
    assert_eq!(
        (dataset.channels, dataset.height, dataset.width),
        (1, 28, 28)
    );
    assert_eq!(dataset.images.len(), n * 784);
    assert_eq!(dataset.labels.len(), n);
}

#[test]
fn shipped_subset_is_balanced_and_verified() {
    let dir = subset_dir();
    let train = load_split(&dir, Split::Train, Normalization::UnitRange).unwrap();
    assert_shape(&train, 12_000);
    assert_eq!(train.class_counts(), vec![1_200; NUM_CLASSES]);
    let test = load_split(&dir, Split::Test, Normalization::UnitRange).unwrap();
    assert_shape(&test, 10_000);
    assert_eq!(test.class_counts(), vec![1_000; NUM_CLASSES]);
    // A class-balanced subset of the training set has nearly its statistics.
    let (mean, std) = mean_std(&train.images);
    assert!((mean - 0.2860).abs() < 0.01, "mean {mean}");
    assert!((std - 0.3530).abs() < 0.01, "std {std}");
}

#[test]
fn full_set_from_debian_matches_published_statistics() {
    let Some(dir) = debian_dir("full_set_from_debian_matches_published_statistics") else {
        return;
    };
    let train = load_split(&dir, Split::Train, Normalization::UnitRange).unwrap();
    assert_shape(&train, 60_000);
    assert_eq!(train.class_counts(), vec![6_000; NUM_CLASSES]);
    let (mean, std) = mean_std(&train.images);
    assert!((mean - 0.2860).abs() < 1e-4, "mean {mean}");
    assert!((std - 0.3530).abs() < 1e-4, "std {std}");

    let test = load_split(&dir, Split::Test, Normalization::FASHION_MNIST).unwrap();
    assert_shape(&test, 10_000);
    assert_eq!(test.class_counts(), vec![1_000; NUM_CLASSES]);
    // Standardized with the training statistics, the test set comes out
    // near zero mean and unit variance.
    let (mean, std) = mean_std(&test.images);
    assert!(mean.abs() < 0.01, "mean {mean}");
    assert!((std - 1.0).abs() < 0.01, "std {std}");
}

#[test]
fn shipped_test_split_equals_debian_test_split() {
    let Some(dir) = debian_dir("shipped_test_split_equals_debian_test_split") else {
        return;
    };
    let shipped = read_images(&subset_dir().join(TEST_IMAGES)).unwrap();
    let debian = read_images(&dir.join(TEST_IMAGES)).unwrap();
    assert_eq!(shipped.sha256, debian.sha256);
}

/// Checks `batch` against the raw bytes of the IDX file.
fn check_gather(dir: &Path) {
    let raw = read_images(&dir.join(TRAIN_IMAGES)).unwrap();
    let dataset = load_split(dir, Split::Train, Normalization::FASHION_MNIST).unwrap();
    let indices = [11_999, 0, 5, 5, 7_000];
    let mut x = vec![f32::NAN; indices.len() * 784];
    let mut y = vec![u32::MAX; indices.len()];
    dataset.batch(&indices, &mut x, &mut y).unwrap();
    for (row, &index) in indices.iter().enumerate() {
        assert_eq!(y[row], u32::from(dataset.labels[index]));
        for pixel in 0..784 {
            let byte = raw.pixels[index * 784 + pixel];
            let expected = (f32::from(byte) / 255.0 - 0.2860) / 0.3530;
            assert_eq!(x[row * 784 + pixel], expected);
        }
    }
}

#[test]
fn batch_gathers_the_requested_samples() {
    check_gather(&subset_dir());
}

#[test]
fn batch_rejects_bad_buffers_and_indices() {
    let dataset = ImageDataset::from_u8(
        &[0, 255, 10, 20],
        vec![1, 0],
        1,
        2,
        2,
        Normalization::UnitRange,
    )
    .unwrap();
    let mut x = vec![0.0; 4];
    let mut y = vec![0; 2];
    dataset.batch(&[1, 0], &mut x, &mut y).unwrap();
    assert_eq!(x, [10.0 / 255.0, 20.0 / 255.0, 0.0, 1.0]);
    assert_eq!(y, [0, 1]);

    let error = dataset.batch(&[0], &mut x, &mut y[..1]).unwrap_err();
    assert!(
        matches!(error, DataError::BufferSize { what: "out_x", .. }),
        "{error:?}"
    );
    let error = dataset.batch(&[0, 1], &mut x, &mut y[..1]).unwrap_err();
    assert!(
        matches!(error, DataError::BufferSize { what: "out_y", .. }),
        "{error:?}"
    );
    let error = dataset.batch(&[0, 2], &mut x, &mut y).unwrap_err();
    assert!(
        matches!(error, DataError::IndexOutOfRange { index: 2, len: 2 }),
        "{error:?}"
    );
}
