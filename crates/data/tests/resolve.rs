//! Resolution order with temporary directories. Nothing here touches the
//! network: downloads go to `file://` mirrors through the real curl path.

mod common;

use std::fs;

use common::{copy_subset_into, debian_dir, touch_files, TempDir};
use meshtrain_data::fashion::{FILE_NAMES, TEST_LABELS, TRAIN_IMAGES, TRAIN_LABELS};
use meshtrain_data::{resolve, DataError, FashionMnist, Normalization, ResolveOptions, Source};

/// Four scratch locations and options pointing at them, download off.
struct Layout {
    data: TempDir,
    system: TempDir,
    cache: TempDir,
    subset: TempDir,
}

impl Layout {
    fn new() -> Self {
        Self {
            data: TempDir::new("data"),
            system: TempDir::new("system"),
            cache: TempDir::new("cache"),
            subset: TempDir::new("subset"),
        }
    }

    fn options(&self) -> ResolveOptions {
        ResolveOptions {
            data_dir: None,
            system_dir: Some(self.system.path().to_path_buf()),
            cache_dir: Some(self.cache.path().to_path_buf()),
            download: false,
            mirrors: Vec::new(),
            subset_dir: Some(self.subset.path().to_path_buf()),
        }
    }
}

#[test]
fn explicit_dir_wins_over_everything() {
    let layout = Layout::new();
    for dir in [&layout.data, &layout.system, &layout.cache, &layout.subset] {
        touch_files(dir.path(), &FILE_NAMES);
    }
    let options = ResolveOptions {
        data_dir: Some(layout.data.path().to_path_buf()),
        ..layout.options()
    };
    assert_eq!(
        resolve(&options).unwrap(),
        Source::DataDir(layout.data.path().to_path_buf())
    );
}

#[test]
fn explicit_dir_missing_a_file_is_an_error_naming_it() {
    let layout = Layout::new();
    touch_files(layout.data.path(), &[TRAIN_IMAGES, TRAIN_LABELS]);
    touch_files(layout.system.path(), &FILE_NAMES);
    let options = ResolveOptions {
        data_dir: Some(layout.data.path().to_path_buf()),
        ..layout.options()
    };
    let error = resolve(&options).unwrap_err();
    assert!(matches!(error, DataError::MissingFile { .. }), "{error:?}");
    assert!(
        error.to_string().contains("t10k-images-idx3-ubyte.gz"),
        "{error}"
    );
}

#[test]
fn explicit_dir_with_corrupt_file_fails_to_load() {
    let layout = Layout::new();
    copy_subset_into(layout.data.path());
    fs::write(layout.data.join(TEST_LABELS), b"garbage").unwrap();
    copy_subset_into(layout.subset.path());
    let options = ResolveOptions {
        data_dir: Some(layout.data.path().to_path_buf()),
        ..layout.options()
    };
    let error = FashionMnist::load(&options, Normalization::UnitRange).unwrap_err();
    assert!(matches!(error, DataError::BadGzip { .. }), "{error:?}");
    assert!(error
        .to_string()
        .contains(&layout.data.join(TEST_LABELS).display().to_string()));
}

#[test]
fn system_package_before_cache_and_subset() {
    let layout = Layout::new();
    for dir in [&layout.system, &layout.cache, &layout.subset] {
        touch_files(dir.path(), &FILE_NAMES);
    }
    assert_eq!(
        resolve(&layout.options()).unwrap(),
        Source::SystemPackage(layout.system.path().to_path_buf())
    );
}

#[test]
fn incomplete_system_dir_falls_through_to_cache() {
    let layout = Layout::new();
    touch_files(layout.system.path(), &[TRAIN_IMAGES]);
    touch_files(layout.cache.path(), &FILE_NAMES);
    touch_files(layout.subset.path(), &FILE_NAMES);
    assert_eq!(
        resolve(&layout.options()).unwrap(),
        Source::Cache(layout.cache.path().to_path_buf())
    );
}

#[test]
fn offline_with_nothing_else_uses_the_shipped_subset() {
    let layout = Layout::new();
    touch_files(layout.cache.path(), &[TRAIN_IMAGES]);
    copy_subset_into(layout.subset.path());
    let source = resolve(&layout.options()).unwrap();
    assert_eq!(
        source,
        Source::ShippedSubset(layout.subset.path().to_path_buf())
    );
    assert!(source.is_subset());
    assert!(source.to_string().contains("SUBSET"));
    let data = FashionMnist::load(&layout.options(), Normalization::UnitRange).unwrap();
    assert_eq!((data.train.n, data.test.n), (12_000, 10_000));
    assert_eq!(data.source, source);
}

#[test]
fn nothing_anywhere_lists_what_was_tried() {
    let layout = Layout::new();
    let error = resolve(&layout.options()).unwrap_err();
    assert!(matches!(error, DataError::NotFound { .. }), "{error:?}");
    let message = error.to_string();
    for dir in [&layout.system, &layout.cache, &layout.subset] {
        assert!(
            message.contains(&dir.path().display().to_string()),
            "{message}"
        );
    }
}

fn curl_available() -> bool {
    let found = std::process::Command::new("curl")
        .arg("--version")
        .output()
        .is_ok();
    if !found {
        println!("SKIPPED: curl is not installed");
    }
    found
}

fn file_url(dir: &std::path::Path) -> String {
    format!("file://{}", dir.display())
}

#[test]
fn download_failure_falls_back_to_subset_and_leaves_no_files() {
    if !curl_available() {
        return;
    }
    let layout = Layout::new();
    copy_subset_into(layout.subset.path());
    // A "mirror" serving corrupt files, and one serving nothing at all.
    let bad_mirror = TempDir::new("badmirror");
    touch_files(bad_mirror.path(), &FILE_NAMES);
    let empty_mirror = TempDir::new("emptymirror");
    let options = ResolveOptions {
        download: true,
        mirrors: vec![file_url(bad_mirror.path()), file_url(empty_mirror.path())],
        ..layout.options()
    };
    let source = resolve(&options).unwrap();
    assert!(source.is_subset(), "{source:?}");
    let leftovers: Vec<_> = fs::read_dir(layout.cache.path()).unwrap().collect();
    assert!(leftovers.is_empty(), "cache not clean: {leftovers:?}");
}

#[test]
fn wrong_content_is_rejected_by_checksum() {
    if !curl_available() {
        return;
    }
    // The subset's training files are valid IDX gz files but not the full
    // set, so a mirror serving them must be refused.
    let mirror = TempDir::new("subsetmirror");
    copy_subset_into(mirror.path());
    let cache = TempDir::new("cache");
    let error = meshtrain_data::download::download_verified(
        &[file_url(mirror.path())],
        TRAIN_LABELS,
        meshtrain_data::fashion::FULL_SHA256.train_labels,
        cache.path(),
    )
    .unwrap_err();
    assert!(matches!(error, DataError::Download { .. }), "{error:?}");
    assert!(error.to_string().contains("SHA-256"), "{error}");
    assert!(!cache.join(TRAIN_LABELS).exists());
}

#[test]
fn download_from_a_mirror_fills_the_cache() {
    if !curl_available() {
        return;
    }
    let Some(debian) = debian_dir("download_from_a_mirror_fills_the_cache") else {
        return;
    };
    let layout = Layout::new();
    // One file already cached: only the other three are fetched.
    fs::copy(debian.join(TRAIN_LABELS), layout.cache.join(TRAIN_LABELS)).unwrap();
    let options = ResolveOptions {
        download: true,
        mirrors: vec![file_url(&debian)],
        ..layout.options()
    };
    assert_eq!(
        resolve(&options).unwrap(),
        Source::Downloaded(layout.cache.path().to_path_buf())
    );
    // Now complete: a second resolve uses it as a plain cache.
    assert_eq!(
        resolve(&options).unwrap(),
        Source::Cache(layout.cache.path().to_path_buf())
    );
    let data = FashionMnist::load(&options, Normalization::UnitRange).unwrap();
    assert_eq!((data.train.n, data.test.n), (60_000, 10_000));
}
