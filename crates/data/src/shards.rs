//! Token shards: the binary files llm.c's data scripts write (and nanoGPT users convert to),
//! so a corpus tokenised once trains in either tool and in meshtrain.
//!
//! A shard is a 1024-byte header of 256 little-endian `i32`s — `[0]` the magic 20240520,
//! `[1]` the version (1: `u16` tokens, as llm.c writes; 2: `u32` tokens, for vocabularies
//! over 65,536 such as cl100k), `[2]` the number of tokens — then the tokens. meshtrain also
//! records the tokenizer's vocabulary size in `[3]` (0: not recorded, as in llm.c's files).
//! Shards are memory-mapped, never read whole: a corpus larger than memory trains all the
//! same, and every worker shares the page cache.

use memmap2::Mmap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// llm.c's magic number for token files.
pub const MAGIC: i32 = 20240520;
/// Header bytes before the first token.
pub const HEADER_BYTES: usize = 1024;

/// Why a shard cannot be read; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("token shard {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("token shard {path}: {why}")]
    Format { path: PathBuf, why: String },
    #[error(
        "token shard {path}: token id {token} at token {index} (byte offset {offset}) is \
         outside the vocabulary of {vocab}"
    )]
    TokenOutOfRange {
        path: PathBuf,
        token: u32,
        index: usize,
        offset: usize,
        vocab: usize,
    },
    #[error("no file matches {pattern}")]
    NoFiles { pattern: String },
    #[error("bad pattern {pattern}: {why}")]
    Pattern { pattern: String, why: String },
}

/// One memory-mapped shard.
pub struct TokenShard {
    pub path: PathBuf,
    map: Mmap,
    /// Bytes per token: 2 or 4.
    width: usize,
    len: usize,
    /// The tokenizer's vocabulary size the header records (0: not recorded).
    pub vocab: usize,
}

impl TokenShard {
    /// Maps `path` and checks its header against its length.
    pub fn open(path: &Path) -> Result<TokenShard, ShardError> {
        let io = |source| ShardError::Io {
            path: path.to_path_buf(),
            source,
        };
        let format = |why: String| ShardError::Format {
            path: path.to_path_buf(),
            why,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; a file truncated by another process while mapped
        // would fault, as with any memory-mapped reader (llm.c, numpy.memmap).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        if map.len() < HEADER_BYTES {
            return Err(format(format!(
                "{} bytes, shorter than the {HEADER_BYTES}-byte header (truncated, or not a \
                 token file)",
                map.len()
            )));
        }
        let field = |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().unwrap());
        if field(0) != MAGIC {
            return Err(format(format!(
                "magic number {} at byte offset 0, not {MAGIC} (not an llm.c/meshtrain token \
                 file)",
                field(0)
            )));
        }
        let width = match field(1) {
            1 => 2,
            2 => 4,
            v => {
                return Err(format(format!(
                    "version {v} at byte offset 4: 1 (u16 tokens) or 2 (u32 tokens) expected"
                )))
            }
        };
        let len = usize::try_from(field(2)).map_err(|_| {
            format(format!(
                "negative token count {} at byte offset 8",
                field(2)
            ))
        })?;
        let expected = HEADER_BYTES + len * width;
        if map.len() != expected {
            return Err(format(format!(
                "the header says {len} tokens ({expected} bytes in all), the file holds {} \
                 bytes ({})",
                map.len(),
                if map.len() < expected {
                    "truncated"
                } else {
                    "extra bytes after the tokens"
                }
            )));
        }
        let vocab = field(3).max(0) as usize;
        Ok(TokenShard {
            path: path.to_path_buf(),
            map,
            width,
            len,
            vocab,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Token `i`.
    pub fn token(&self, i: usize) -> u32 {
        let at = HEADER_BYTES + i * self.width;
        match self.width {
            2 => u32::from(u16::from_le_bytes([self.map[at], self.map[at + 1]])),
            _ => u32::from_le_bytes(self.map[at..at + 4].try_into().unwrap()),
        }
    }

    /// Copies tokens `start..start + out.len()` into `out`.
    pub fn read(&self, start: usize, out: &mut [u32]) {
        for (k, o) in out.iter_mut().enumerate() {
            *o = self.token(start + k);
        }
    }

    /// Checks every token against `vocab`, naming the first outside it.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), ShardError> {
        match (0..self.len).find(|&i| self.token(i) as usize >= vocab) {
            None => Ok(()),
            Some(index) => Err(ShardError::TokenOutOfRange {
                path: self.path.clone(),
                token: self.token(index),
                index,
                offset: HEADER_BYTES + index * self.width,
                vocab,
            }),
        }
    }
}

/// Writes `tokens` as a shard: `u16` tokens (version 1, llm.c's) when the vocabulary fits,
/// `u32` (version 2) otherwise.
pub fn write_shard(path: &Path, tokens: &[u32], vocab: usize) -> Result<(), ShardError> {
    let io = |source| ShardError::Io {
        path: path.to_path_buf(),
        source,
    };
    let narrow = vocab <= 1 << 16;
    let mut header = [0i32; 256];
    header[0] = MAGIC;
    header[1] = if narrow { 1 } else { 2 };
    header[2] = i32::try_from(tokens.len()).map_err(|_| ShardError::Format {
        path: path.to_path_buf(),
        why: format!(
            "{} tokens do not fit one shard (2^31 at most)",
            tokens.len()
        ),
    })?;
    header[3] = vocab as i32;
    if let Some(index) = tokens.iter().position(|&t| t as usize >= vocab) {
        return Err(ShardError::TokenOutOfRange {
            path: path.to_path_buf(),
            token: tokens[index],
            index,
            offset: HEADER_BYTES + index * if narrow { 2 } else { 4 },
            vocab,
        });
    }
    // Streamed through a buffer: a shard of 100 M tokens is never copied whole.
    let mut file =
        std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path).map_err(io)?);
    for h in header {
        file.write_all(&h.to_le_bytes()).map_err(io)?;
    }
    let mut chunk = Vec::with_capacity(1 << 16);
    for part in tokens.chunks(1 << 14) {
        chunk.clear();
        for &t in part {
            if narrow {
                chunk.extend_from_slice(&(t as u16).to_le_bytes());
            } else {
                chunk.extend_from_slice(&t.to_le_bytes());
            }
        }
        file.write_all(&chunk).map_err(io)?;
    }
    let file = file.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)
}

/// The shards a glob pattern names, opened, in the order of their names.
pub fn open_shards(pattern: &str) -> Result<Vec<TokenShard>, ShardError> {
    let paths = glob::glob(pattern).map_err(|e| ShardError::Pattern {
        pattern: pattern.into(),
        why: e.to_string(),
    })?;
    let mut paths: Vec<PathBuf> = paths.filter_map(|p| p.ok()).collect();
    paths.sort();
    if paths.is_empty() {
        return Err(ShardError::NoFiles {
            pattern: pattern.into(),
        });
    }
    paths.iter().map(|p| TokenShard::open(p)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("meshtrain-shards-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn shards_round_trip_in_both_widths() {
        for (vocab, version) in [(50257, 1), (100277, 2)] {
            let path = temp(&format!("rt-{vocab}.bin"));
            let tokens: Vec<u32> = (0..1000).map(|i| (i * 97) % vocab as u32).collect();
            write_shard(&path, &tokens, vocab).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(i32::from_le_bytes(bytes[4..8].try_into().unwrap()), version);
            let shard = TokenShard::open(&path).unwrap();
            assert_eq!((shard.len(), shard.vocab), (1000, vocab));
            let mut back = vec![0; 1000];
            shard.read(0, &mut back);
            assert_eq!(back, tokens);
            shard.check_vocab(vocab).unwrap();
        }
    }

    #[test]
    fn bad_shards_name_the_file_and_the_offset() {
        let path = temp("bad.bin");
        write_shard(&path, &[1, 2, 3, 70, 5], 256).unwrap();
        let shard = TokenShard::open(&path).unwrap();
        let err = shard.check_vocab(64).unwrap_err().to_string();
        assert!(
            err.contains("bad.bin: token id 70 at token 3 (byte offset 1030) is outside the vocabulary of 64"),
            "{err}"
        );
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.truncate(bytes.len() - 1);
        std::fs::write(&path, &bytes).unwrap();
        let err = TokenShard::open(&path).err().unwrap().to_string();
        assert!(err.contains("the header says 5 tokens (1034 bytes in all), the file holds 1033 bytes (truncated)"), "{err}");
        bytes[0] = 0;
        std::fs::write(&path, &bytes).unwrap();
        let err = TokenShard::open(&path).err().unwrap().to_string();
        assert!(
            err.contains("magic number") && err.contains("bad.bin"),
            "{err}"
        );
        let err = open_shards(&temp("none-*.bin").display().to_string())
            .err()
            .unwrap()
            .to_string();
        assert!(err.starts_with("no file matches"), "{err}");
    }
}
