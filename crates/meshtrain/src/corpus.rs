//! The documents in the files `meshtrain tokenize` is given. A file is plain UTF-8 text (one
//! document) or JSON lines (one document per line, its text in a field, `text` by default),
//! either of them gzip-compressed; the format comes from the content (gzip's, zstd's and
//! Parquet's magic bytes, a first `{`) and the extension (`.jsonl`, `.ndjson`, `.json`,
//! under `.gz`). A file that is none of these, or text that is not UTF-8, is refused with the
//! offset of its first bad byte, never tokenized as if it were text. A malformed line is
//! named (file and line) and stops the run, or with `skip_bad` is counted and left out.
//! Parquet and zstd are recognised and refused by name (they come with issue 40's readers).

use anyhow::{bail, Context, Result};
use std::io::Read;
use std::path::Path;

/// How a file holds its documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The whole file is one document.
    Text,
    /// One JSON object per line, the document in one of its fields.
    JsonLines,
}

/// What [`read_documents`] found in one file.
#[derive(Debug, Default, PartialEq)]
pub struct Documents {
    pub texts: Vec<String>,
    /// Lines left out under `skip_bad` (malformed, or without the text field).
    pub skipped: usize,
}

const GZIP: &[u8] = &[0x1f, 0x8b];
const ZSTD: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];
const PARQUET: &[u8] = b"PAR1";

/// The format of `bytes` (already decompressed), named `name` (its extension counts).
pub fn format_of(name: &str, bytes: &[u8]) -> Format {
    let name = name.strip_suffix(".gz").unwrap_or(name);
    if [".jsonl", ".ndjson", ".json"]
        .iter()
        .any(|ext| name.ends_with(ext))
    {
        return Format::JsonLines;
    }
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => Format::JsonLines,
        _ => Format::Text,
    }
}

/// The file's bytes, gunzipped when they are gzip's; Parquet and zstd refused by name.
fn contents(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if raw.starts_with(PARQUET) {
        bail!(
            "{}: a Parquet file, which this build does not read yet: export its text column \
             as JSON lines (e.g. pandas' to_json(orient=\"records\", lines=True)) and give that",
            path.display()
        );
    }
    if raw.starts_with(ZSTD) {
        bail!(
            "{}: zstd-compressed, which this build does not read yet: decompress it first \
             (zstd -d) or recompress it with gzip",
            path.display()
        );
    }
    if !raw.starts_with(GZIP) {
        return Ok(raw);
    }
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(&raw[..])
        .read_to_end(&mut out)
        .with_context(|| format!("{}: a damaged gzip stream", path.display()))?;
    Ok(out)
}

/// `bytes` as UTF-8, or an error naming the first byte that is not (and its offset).
fn utf8<'a>(path: &Path, bytes: &'a [u8]) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        let at = e.valid_up_to();
        anyhow::anyhow!(
            "{}: neither UTF-8 text nor a format meshtrain reads (JSON lines, gzip): byte \
             offset {at} is 0x{:02x}",
            path.display(),
            bytes[at]
        )
    })
}

/// The documents of the file at `path`: the whole text, or the `text_field` of each JSON
/// line (blank lines skipped). A malformed line stops with its file and line number, or
/// with `skip_bad` is counted in [`Documents::skipped`].
pub fn read_documents(path: &Path, text_field: &str, skip_bad: bool) -> Result<Documents> {
    let bytes = contents(path)?;
    let name = path.to_string_lossy();
    match format_of(&name, &bytes) {
        Format::Text => Ok(Documents {
            texts: vec![utf8(path, &bytes)?.to_string()],
            skipped: 0,
        }),
        Format::JsonLines => {
            let text = utf8(path, &bytes)?;
            let mut docs = Documents::default();
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                match document_of(line, text_field) {
                    Ok(doc) => docs.texts.push(doc),
                    Err(_) if skip_bad => docs.skipped += 1,
                    Err(why) => bail!(
                        "{}:{}: {why} (--skip-bad leaves such lines out and counts them)",
                        path.display(),
                        i + 1
                    ),
                }
            }
            Ok(docs)
        }
    }
}

/// The `field` of one JSON line, or why there is none.
fn document_of(line: &str, field: &str) -> Result<String, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not a JSON object: {e}"))?;
    match value.get(field) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("the field \"{field}\" is not a string but {other}")),
        None => Err(format!("no field \"{field}\" (--text-field names another)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn json_lines_plain_or_gzipped_hold_one_document_a_line() {
        let dir = tempfile::tempdir().unwrap();
        let lines = "{\"text\": \"First doc.\\nTwo lines.\", \"id\": 1}\n\n{\"id\": 2, \"text\": \"Second — ünïcode\"}\n";
        let want = vec![
            "First doc.\nTwo lines.".to_string(),
            "Second — ünïcode".to_string(),
        ];
        for (name, bytes) in [
            ("a.jsonl", lines.as_bytes().to_vec()),
            ("b.jsonl.gz", gzip(lines.as_bytes())),
            // No telling extension: the content says JSON lines (gzip's magic, then `{`).
            ("c.data", gzip(lines.as_bytes())),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            let docs = read_documents(&path, "text", false).unwrap();
            assert_eq!(docs.texts, want, "{name}");
        }
        // A plain text file, gzipped or not, is one document.
        let path = dir.path().join("t.txt.gz");
        std::fs::write(&path, gzip("Just text.\n".as_bytes())).unwrap();
        let docs = read_documents(&path, "text", false).unwrap();
        assert_eq!(docs.texts, vec!["Just text.\n".to_string()]);
    }

    #[test]
    fn a_malformed_line_is_named_or_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        let lines =
            "{\"text\": \"ok\"}\n{\"text\": 3}\n{broken\n{\"body\": \"x\"}\n{\"text\": \"last\"}\n";
        std::fs::write(&path, lines).unwrap();
        let e = format!("{:#}", read_documents(&path, "text", false).unwrap_err());
        assert!(
            e.contains("d.jsonl:2: the field \"text\" is not a string"),
            "{e}"
        );
        let docs = read_documents(&path, "text", true).unwrap();
        assert_eq!(docs.texts, vec!["ok".to_string(), "last".to_string()]);
        assert_eq!(docs.skipped, 3);
        let e = format!("{:#}", read_documents(&path, "body", false).unwrap_err());
        assert!(e.contains("d.jsonl:1: no field \"body\""), "{e}");
    }

    #[test]
    fn binary_files_are_refused_with_the_first_bad_byte() {
        let dir = tempfile::tempdir().unwrap();
        // 64 bytes of noise after some text: not UTF-8 at byte 5.
        let mut noise = b"text ".to_vec();
        noise.extend((0u8..64).map(|i| i.wrapping_mul(97).wrapping_add(200)));
        let path = dir.path().join("noise.txt");
        std::fs::write(&path, &noise).unwrap();
        let e = format!("{:#}", read_documents(&path, "text", false).unwrap_err());
        assert!(e.contains("byte offset 5 is 0xc8"), "{e}");
        for (name, magic, what) in [
            ("x.parquet", PARQUET, "a Parquet file"),
            ("x.jsonl.zst", ZSTD, "zstd-compressed"),
        ] {
            let path = dir.path().join(name);
            let mut bytes = magic.to_vec();
            bytes.extend([0u8; 16]);
            std::fs::write(&path, bytes).unwrap();
            let e = format!("{:#}", read_documents(&path, "text", false).unwrap_err());
            assert!(e.contains(what), "{e}");
        }
        let path = dir.path().join("broken.gz");
        std::fs::write(&path, [0x1f, 0x8b, 8, 0, 1, 2, 3]).unwrap();
        let e = format!("{:#}", read_documents(&path, "text", false).unwrap_err());
        assert!(e.contains("a damaged gzip stream"), "{e}");
    }
}
