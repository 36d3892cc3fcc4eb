//! Fashion-MNIST (Xiao, Rasul & Vollgraf 2017): finding, verifying, loading.
//!
//! Where the data comes from is decided by [`resolve`], in this order:
//! 1. an explicit directory (`--data-dir`): must hold all four files;
//! 2. `/usr/share/datasets/fashion-mnist` (Debian's `dataset-fashion-mnist`);
//! 3. the user cache (`$MESHTRAIN_DATA/fashion-mnist`, else
//!    `$XDG_CACHE_HOME/meshtrain/fashion-mnist`, else
//!    `~/.cache/meshtrain/fashion-mnist`), filled by a download from the
//!    official mirrors unless offline (`MESHTRAIN_OFFLINE=1`);
//! 4. the balanced subset shipped in the repository
//!    (`data/fashion-mnist-subset`, 12,000 train + the full 10,000 test).
//!
//! Every source is checked the same way: SHA-256 of the *decompressed* IDX
//! payload, because Debian re-compresses the `.gz` files (so digests of the
//! compressed bytes differ between sources while the content is identical).

use std::fmt;
use std::path::{Path, PathBuf};

use crate::download::download_verified;
use crate::error::DataError;
use crate::idx::{read_images, read_labels};
use crate::images::{ImageDataset, Normalization};

pub const NUM_CLASSES: usize = 10;
pub const IMAGE_SIDE: usize = 28;

/// Class names in label order.
pub const CLASS_NAMES: [&str; NUM_CLASSES] = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
];

pub const TRAIN_IMAGES: &str = "train-images-idx3-ubyte.gz";
pub const TRAIN_LABELS: &str = "train-labels-idx1-ubyte.gz";
pub const TEST_IMAGES: &str = "t10k-images-idx3-ubyte.gz";
pub const TEST_LABELS: &str = "t10k-labels-idx1-ubyte.gz";

/// The four file names, in download order (small label files first would
/// not help: all four are needed).
pub const FILE_NAMES: [&str; 4] = [TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS];

/// One digest per file, in the order of [`FILE_NAMES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileDigests {
    pub train_images: &'static str,
    pub train_labels: &'static str,
    pub test_images: &'static str,
    pub test_labels: &'static str,
}

impl FileDigests {
    /// The digest listed for `file_name` (one of [`FILE_NAMES`]).
    pub fn for_file(&self, file_name: &str) -> Option<&'static str> {
        match file_name {
            TRAIN_IMAGES => Some(self.train_images),
            TRAIN_LABELS => Some(self.train_labels),
            TEST_IMAGES => Some(self.test_images),
            TEST_LABELS => Some(self.test_labels),
            _ => None,
        }
    }
}

/// SHA-256 of the decompressed official files (60,000 train / 10,000 test).
/// Computed from Debian's package and cross-checked: magic, counts, 6,000 /
/// 1,000 images per class, train pixel mean 0.28604 / std 0.35302.
pub const FULL_SHA256: FileDigests = FileDigests {
    train_images: "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    train_labels: "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    test_images: "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    test_labels: "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
};

/// SHA-256 of the decompressed shipped subset (first 1,200 training images
/// of each class in file order; the test files are the full official ones),
/// as printed by `crates/data/scripts/make_fashion_subset.py`.
pub const SUBSET_SHA256: FileDigests = FileDigests {
    train_images: "ded9297f1d7b567047797bb831eb9cfd84010a483a4075cb9fc0465219002cb7",
    train_labels: "11a34fec6f816dbe22c806d6de7e130fa048759622a0e6f6da8feb272e09ee1d",
    test_images: FULL_SHA256.test_images,
    test_labels: FULL_SHA256.test_labels,
};

/// MD5 of the upstream `.gz` files as Zalando publishes them (for reference
/// only: they identify upstream's compressed bytes, which Debian changed).
pub const UPSTREAM_GZ_MD5: FileDigests = FileDigests {
    train_images: "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    train_labels: "25c81989df183df01b3e8a0aad5dffbe",
    test_images: "bef4ecab320f06d8554ea6380940ec79",
    test_labels: "bb300cfdad3c16e7a12a480ee83cd310",
};

/// Zalando's download locations (GitHub repository, then the S3 site named
/// in its README). Only files matching [`FULL_SHA256`] are accepted.
pub const OFFICIAL_MIRRORS: [&str; 2] = [
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion",
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com",
];

/// Where Debian's `dataset-fashion-mnist` package installs the files.
pub const SYSTEM_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Training or test half of the dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Test,
}

impl Split {
    fn file_names(self) -> (&'static str, &'static str) {
        match self {
            Split::Train => (TRAIN_IMAGES, TRAIN_LABELS),
            Split::Test => (TEST_IMAGES, TEST_LABELS),
        }
    }
}

/// Where the data was found; print it so every run says what it trained on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The directory given explicitly (`--data-dir`).
    DataDir(PathBuf),
    /// Debian's `dataset-fashion-mnist` package.
    SystemPackage(PathBuf),
    /// A complete earlier download in the user cache.
    Cache(PathBuf),
    /// Downloaded (at least partly) by this call into the user cache.
    Downloaded(PathBuf),
    /// The subset shipped in the repository: fewer training images.
    ShippedSubset(PathBuf),
}

impl Source {
    /// Directory holding the four files.
    pub fn dir(&self) -> &Path {
        match self {
            Source::DataDir(dir)
            | Source::SystemPackage(dir)
            | Source::Cache(dir)
            | Source::Downloaded(dir)
            | Source::ShippedSubset(dir) => dir,
        }
    }

    pub fn is_subset(&self) -> bool {
        matches!(self, Source::ShippedSubset(_))
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::DataDir(dir) => write!(f, "--data-dir {}", dir.display()),
            Source::SystemPackage(dir) => {
                write!(
                    f,
                    "Debian package dataset-fashion-mnist ({})",
                    dir.display()
                )
            }
            Source::Cache(dir) => write!(f, "download cache {}", dir.display()),
            Source::Downloaded(dir) => write!(f, "fresh download into {}", dir.display()),
            Source::ShippedSubset(dir) => write!(
                f,
                "SHIPPED SUBSET {} (12,000 of 60,000 training images; full 10,000 test)",
                dir.display()
            ),
        }
    }
}

/// Inputs of [`resolve`]. Every location is explicit so tests can point
/// them at temporary directories; [`ResolveOptions::from_env`] fills in the
/// real defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolveOptions {
    /// Explicit directory; when set, nothing else is tried.
    pub data_dir: Option<PathBuf>,
    /// System package directory (normally [`SYSTEM_DIR`]).
    pub system_dir: Option<PathBuf>,
    /// Download cache directory.
    pub cache_dir: Option<PathBuf>,
    /// Whether to download into `cache_dir` when it is incomplete.
    pub download: bool,
    /// Base URLs tried in order.
    pub mirrors: Vec<String>,
    /// The shipped subset (normally [`shipped_subset_dir`]).
    pub subset_dir: Option<PathBuf>,
}

/// Root of the repository this crate was built from.
fn repo_root() -> &'static Path {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    // crates/data -> crates -> repository root
    manifest_dir.ancestors().nth(2).unwrap_or(manifest_dir)
}

/// `data/fashion-mnist-subset` in the repository this crate was built from.
pub fn shipped_subset_dir() -> PathBuf {
    repo_root().join("data/fashion-mnist-subset")
}

/// The user cache directory from environment variables (looked up through
/// `env`, so tests need not touch the process environment):
/// `$MESHTRAIN_DATA/fashion-mnist`, else
/// `$XDG_CACHE_HOME/meshtrain/fashion-mnist`, else
/// `$HOME/.cache/meshtrain/fashion-mnist`. Empty values count as unset.
pub fn cache_dir_from(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let non_empty = |name: &str| env(name).filter(|value| !value.is_empty());
    if let Some(root) = non_empty("MESHTRAIN_DATA") {
        return Some(PathBuf::from(root).join("fashion-mnist"));
    }
    let cache_root = non_empty("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| non_empty("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
    Some(cache_root.join("meshtrain/fashion-mnist"))
}

impl ResolveOptions {
    /// The standard search: `data_dir` if given, the Debian directory, the
    /// user cache with download (disabled by `MESHTRAIN_OFFLINE` set to
    /// anything but `0` or empty), the shipped subset.
    pub fn from_env(data_dir: Option<PathBuf>) -> Self {
        Self::from_lookup(data_dir, &|name| std::env::var(name).ok())
    }

    /// [`ResolveOptions::from_env`] with variables read through `env`.
    pub fn from_lookup(data_dir: Option<PathBuf>, env: &dyn Fn(&str) -> Option<String>) -> Self {
        let offline =
            env("MESHTRAIN_OFFLINE").is_some_and(|value| !value.is_empty() && value != "0");
        Self {
            data_dir,
            system_dir: Some(PathBuf::from(SYSTEM_DIR)),
            cache_dir: cache_dir_from(env),
            download: !offline,
            mirrors: OFFICIAL_MIRRORS.iter().map(|url| url.to_string()).collect(),
            subset_dir: Some(shipped_subset_dir()),
        }
    }
}

/// The names in [`FILE_NAMES`] that `dir` lacks.
fn missing_files(dir: &Path) -> Vec<&'static str> {
    FILE_NAMES
        .into_iter()
        .filter(|name| !dir.join(name).is_file())
        .collect()
}

/// Picks the directory to load from, downloading into the cache if needed.
/// Only checks that files exist; [`load_split`] verifies their content, and
/// a corrupt file in the chosen place is an error, not a reason to fall back.
pub fn resolve(options: &ResolveOptions) -> Result<Source, DataError> {
    if let Some(dir) = &options.data_dir {
        return match missing_files(dir).first() {
            Some(name) => Err(DataError::MissingFile {
                path: dir.join(name),
            }),
            None => Ok(Source::DataDir(dir.clone())),
        };
    }
    let mut tried = Vec::new();
    if let Some(dir) = &options.system_dir {
        let missing = missing_files(dir);
        if missing.is_empty() {
            return Ok(Source::SystemPackage(dir.clone()));
        }
        if missing.len() < FILE_NAMES.len() {
            tracing::warn!(
                "{} is incomplete (missing {}); skipping it",
                dir.display(),
                missing[0]
            );
        }
        tried.push(format!("{} (incomplete or absent)", dir.display()));
    }
    if let Some(dir) = &options.cache_dir {
        let missing = missing_files(dir);
        if missing.is_empty() {
            return Ok(Source::Cache(dir.clone()));
        }
        if options.download {
            match download_missing(&options.mirrors, &missing, dir) {
                Ok(()) => return Ok(Source::Downloaded(dir.clone())),
                Err(error) => {
                    tracing::warn!("Fashion-MNIST {error}");
                    tried.push(format!("download into {}: {error}", dir.display()));
                }
            }
        } else {
            tried.push(format!("{} (incomplete; download disabled)", dir.display()));
        }
    }
    if let Some(dir) = &options.subset_dir {
        if missing_files(dir).is_empty() {
            tracing::warn!(
                "using the SHIPPED SUBSET of Fashion-MNIST in {} (12,000 of 60,000 training images); \
                 install dataset-fashion-mnist or allow the download for the full set",
                dir.display()
            );
            return Ok(Source::ShippedSubset(dir.clone()));
        }
        tried.push(format!("{} (incomplete or absent)", dir.display()));
    }
    Err(DataError::NotFound {
        tried: tried.join("; "),
    })
}

fn download_missing(mirrors: &[String], missing: &[&str], dir: &Path) -> Result<(), DataError> {
    for name in missing {
        let expected = FULL_SHA256.for_file(name).unwrap_or_default();
        download_verified(mirrors, name, expected, dir)?;
    }
    Ok(())
}

/// The payload must be one of the known releases (full or shipped subset).
fn verify_digest(path: &Path, file_name: &str, actual: &str) -> Result<(), DataError> {
    let full = FULL_SHA256.for_file(file_name).unwrap_or_default();
    let subset = SUBSET_SHA256.for_file(file_name).unwrap_or_default();
    if actual == full || actual == subset {
        Ok(())
    } else {
        Err(DataError::ChecksumMismatch {
            path: path.to_path_buf(),
            actual: actual.to_string(),
            expected: if full == subset {
                full.to_string()
            } else {
                format!("{full} (full set) or {subset} (shipped subset)")
            },
        })
    }
}

/// Loads one split from `dir`, checking structure, labels, counts, image
/// size and checksums, in that order (so the most specific error wins).
pub fn load_split(
    dir: &Path,
    split: Split,
    normalization: Normalization,
) -> Result<ImageDataset, DataError> {
    let (images_name, labels_name) = split.file_names();
    let images = read_images(&dir.join(images_name))?;
    let labels = read_labels(&dir.join(labels_name), NUM_CLASSES)?;
    if images.count != labels.labels.len() {
        return Err(DataError::CountMismatch {
            images: images.path,
            images_count: images.count,
            labels: labels.path,
            labels_count: labels.labels.len(),
        });
    }
    if (images.height, images.width) != (IMAGE_SIDE, IMAGE_SIDE) {
        return Err(DataError::UnexpectedShape {
            path: images.path,
            height: images.height,
            width: images.width,
            expected_height: IMAGE_SIDE,
            expected_width: IMAGE_SIDE,
        });
    }
    verify_digest(&images.path, images_name, &images.sha256)?;
    verify_digest(&labels.path, labels_name, &labels.sha256)?;
    ImageDataset::from_u8(
        &images.pixels,
        labels.labels,
        IMAGE_SIDE,
        IMAGE_SIDE,
        NUM_CLASSES,
        normalization,
    )
}

/// Both splits plus where they came from.
#[derive(Debug, Clone)]
pub struct FashionMnist {
    pub train: ImageDataset,
    pub test: ImageDataset,
    pub source: Source,
}

impl FashionMnist {
    /// Resolves the source (see [`resolve`]) and loads both splits.
    pub fn load(options: &ResolveOptions, normalization: Normalization) -> Result<Self, DataError> {
        let source = resolve(options)?;
        let train = load_split(source.dir(), Split::Train, normalization)?;
        let test = load_split(source.dir(), Split::Test, normalization)?;
        Ok(Self {
            train,
            test,
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn cache_dir_precedence() {
        let all = lookup(&[
            ("MESHTRAIN_DATA", "/d"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(
            cache_dir_from(&all),
            Some(PathBuf::from("/d/fashion-mnist"))
        );
        let xdg = lookup(&[
            ("MESHTRAIN_DATA", ""),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(
            cache_dir_from(&xdg),
            Some(PathBuf::from("/x/meshtrain/fashion-mnist"))
        );
        let home = lookup(&[("HOME", "/h")]);
        assert_eq!(
            cache_dir_from(&home),
            Some(PathBuf::from("/h/.cache/meshtrain/fashion-mnist"))
        );
        assert_eq!(cache_dir_from(&lookup(&[])), None);
    }

    #[test]
    fn offline_switch() {
        let download =
            |vars: &[(&str, &str)]| ResolveOptions::from_lookup(None, &lookup(vars)).download;
        assert!(download(&[]));
        assert!(download(&[("MESHTRAIN_OFFLINE", "0")]));
        assert!(download(&[("MESHTRAIN_OFFLINE", "")]));
        assert!(!download(&[("MESHTRAIN_OFFLINE", "1")]));
        assert!(!download(&[("MESHTRAIN_OFFLINE", "yes")]));
    }

    #[test]
    fn default_locations() {
        let options = ResolveOptions::from_lookup(Some(PathBuf::from("/data")), &lookup(&[]));
        assert_eq!(options.data_dir, Some(PathBuf::from("/data")));
        assert_eq!(options.system_dir, Some(PathBuf::from(SYSTEM_DIR)));
        assert_eq!(options.mirrors.len(), OFFICIAL_MIRRORS.len());
        assert!(options
            .subset_dir
            .unwrap()
            .ends_with("data/fashion-mnist-subset"));
    }
}
