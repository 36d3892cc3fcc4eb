//! The documents in the files `meshtrain tokenize` is given. A file is plain UTF-8 text (one
//! document), JSON lines (one document per line, its text in a field, `text` by default),
//! either of them gzip- or zstd-compressed, or Parquet (one document per row, its text in a column).
//! Every format is streamed: JSON lines a line at a time through the decompressor, Parquet a
//! row group at a time (only the text column), and a text file, when the caller can take it
//! in parts ([`Document::continues`]), in pieces of about a given size cut where the BPE's
//! pre-tokeniser splits alike in a piece and in the whole. So memory does not grow with a
//! file's size. The format comes from the content (Parquet's, gzip's and zstd's magic bytes,
//! a first `{`) and the extension (`.jsonl`, `.ndjson`, `.json`, under `.gz` or `.zst`). A file that is
//! none of these, or text that is not UTF-8, is refused with the offset of its first bad byte,
//! never tokenized as if it were text. A malformed line (not JSON, not UTF-8, without the text
//! field) or a row without text is named (file and line, or row group and row) and stops the
//! run, or with `skip_bad` is counted and left out. A file that cannot be read to its end (a
//! damaged compressed stream, a text file that is not UTF-8, a Parquet file without a readable
//! footer or without the text column; a Parquet row group that cannot be decoded) stops the
//! run too, or with `skip_bad` is left out whole and named ([`LeftOut`]).
//!
//! Inputs may be files, directories (every file under them, in name order, hidden ones left
//! out) and glob patterns ([`expand_inputs`]).

use anyhow::{bail, Context, Result};
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How a file holds its documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The whole file is one document.
    Text,
    /// One JSON object per line, the document in one of its fields.
    JsonLines,
    /// One row per document, its text in one column.
    Parquet,
}

/// What [`read_documents`] found in one file.
#[derive(Debug, Default, PartialEq)]
pub struct Documents {
    pub texts: Vec<String>,
    /// Lines left out under `skip_bad` (malformed, or without the text field).
    pub skipped: usize,
}

/// What `skip_bad` left out of a corpus.
#[derive(Debug, Default, PartialEq)]
pub struct LeftOut {
    /// Malformed lines and rows (each file's other documents kept).
    pub lines: usize,
    /// The files (or Parquet row groups) left out whole, each with why: a file is left out
    /// whole rather than up to its damage, so the output does not depend on where a stream
    /// happened to break, and equals that of the corpus without the file.
    pub parts: Vec<String>,
}

/// A document, or a piece of one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    pub text: String,
    /// This text continues the previous document (a later piece of a large text file): no
    /// separator before it.
    pub continues: bool,
}

const GZIP: &[u8] = &[0x1f, 0x8b];
const ZSTD: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];
const PARQUET: &[u8] = b"PAR1";

/// The format of a file named `name` whose (decompressed) contents start with `start`.
pub fn format_of(name: &str, start: &[u8]) -> Format {
    let name = [".gz", ".zst", ".zstd"]
        .iter()
        .find_map(|ext| name.strip_suffix(ext))
        .unwrap_or(name);
    if [".jsonl", ".ndjson", ".json"]
        .iter()
        .any(|ext| name.ends_with(ext))
    {
        return Format::JsonLines;
    }
    match start.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => Format::JsonLines,
        _ => Format::Text,
    }
}

fn has_glob_characters(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

/// The files `inputs` name, in order: a file as it is, a directory as every file under it
/// (recursively, in name order, names starting with `.` left out), a glob pattern as its
/// matches in name order. A missing file, an empty directory or a pattern that matches
/// nothing is an error naming it.
pub fn expand_inputs(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        let text = input.to_string_lossy();
        if !input.exists() && has_glob_characters(&text) {
            let mut matched: Vec<PathBuf> = glob::glob(&text)
                .with_context(|| format!("--input {text}: not a valid glob pattern"))?
                .filter_map(|p| p.ok())
                .filter(|p| p.is_file())
                .collect();
            matched.sort();
            if matched.is_empty() {
                bail!("--input {text}: no file matches the pattern");
            }
            files.extend(matched);
        } else if input.is_dir() {
            let before = files.len();
            files_under(input, &mut files)?;
            if files.len() == before {
                bail!("--input {}: the directory holds no files", input.display());
            }
        } else if input.is_file() {
            files.push(input.clone());
        } else {
            bail!("--input {}: no such file or directory", input.display());
        }
    }
    Ok(files)
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            files_under(&path, out)?;
        } else if path.is_file() {
            out.push(path);
        }
    }
    Ok(())
}

/// Whether the file starts with Parquet's magic bytes.
fn is_parquet(path: &Path) -> Result<bool> {
    let mut magic = [0u8; 4];
    let mut file =
        std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let n = file
        .read(&mut magic)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(n == 4 && magic == PARQUET)
}

/// The file's contents as a stream, decompressed when they are gzip's or zstd's (by their
/// magic bytes; a file of several gzip members or zstd frames is read whole, as the
/// command-line tools do).
fn open_stream(path: &Path) -> Result<Box<dyn BufRead>> {
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut raw = BufReader::with_capacity(1 << 20, file);
    let start = raw
        .fill_buf()
        .with_context(|| format!("reading {}", path.display()))?;
    let decompressed: Box<dyn Read> = if start.starts_with(GZIP) {
        Box::new(flate2::bufread::MultiGzDecoder::new(raw))
    } else if start.starts_with(ZSTD) {
        Box::new(
            zstd::stream::read::Decoder::with_buffer(raw)
                .with_context(|| format!("{}: starting a zstd stream", path.display()))?,
        )
    } else {
        return Ok(Box::new(raw));
    };
    Ok(Box::new(BufReader::with_capacity(1 << 20, decompressed)))
}

/// A read error of the (decompressed) stream, named: a plain file's reads fail only for
/// the disk's reasons, so bad or missing data in a compressed file is the decompressor's.
fn stream_error(path: &Path, e: std::io::Error) -> anyhow::Error {
    use std::io::ErrorKind::{InvalidData, InvalidInput, Other, UnexpectedEof};
    match compression_of(path) {
        Some(compression)
            if matches!(e.kind(), InvalidInput | InvalidData | UnexpectedEof | Other) =>
        {
            anyhow::anyhow!("{}: a damaged {compression} stream: {e}", path.display())
        }
        _ => anyhow::anyhow!("reading {}: {e}", path.display()),
    }
}

/// The compression the file's magic bytes name, if any.
fn compression_of(path: &Path) -> Option<&'static str> {
    let mut magic = [0u8; 4];
    let mut file = std::fs::File::open(path).ok()?;
    let n = file.read(&mut magic).ok()?;
    if magic[..n].starts_with(GZIP) {
        Some("gzip")
    } else if magic[..n].starts_with(ZSTD) {
        Some("zstd")
    } else {
        None
    }
}

/// `bytes` (which start at byte `offset` of the file's text) as UTF-8, or an error naming the
/// first byte that is not (and its offset in the file).
fn utf8(path: &Path, bytes: Vec<u8>, offset: u64) -> Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: neither UTF-8 text nor a format meshtrain reads (JSON lines, gzip, Parquet): {}",
            path.display(),
            first_bad_byte(&e, offset)
        )
    })
}

/// `byte offset N is 0xNN`: where bytes that begin at `offset` in their file stop being UTF-8.
fn first_bad_byte(e: &std::string::FromUtf8Error, offset: u64) -> String {
    let at = e.utf8_error().valid_up_to();
    format!(
        "byte offset {} is 0x{:02x}",
        offset + at as u64,
        e.as_bytes()[at]
    )
}

/// The documents of the file at `path`: the whole text, or the `text_field` of each JSON
/// line (blank lines skipped) or Parquet row. A malformed line or row stops with where it
/// is, or with `skip_bad` is counted in [`Documents::skipped`].
pub fn read_documents(path: &Path, text_field: &str, skip_bad: bool) -> Result<Documents> {
    let mut texts = Vec::new();
    let skipped = for_each_document(path, text_field, skip_bad, None, |doc| {
        texts.push(doc.text);
        Ok(true)
    })?;
    Ok(Documents { texts, skipped })
}

/// [`read_documents`] a document at a time: `f` gets each one in order and returns whether
/// to go on. With `text_pieces`, a text file comes in pieces of about that many bytes (the
/// later ones [`Document::continues`]), cut after a lone newline between printable ASCII
/// characters, where GPT-2's and cl100k's pre-tokenisers split alike in a piece and in the
/// whole (`tokenize::pieces`' rule); without, whole. Returns the number left out under
/// `skip_bad`.
pub fn for_each_document(
    path: &Path,
    text_field: &str,
    skip_bad: bool,
    text_pieces: Option<usize>,
    mut f: impl FnMut(Document) -> Result<bool>,
) -> Result<usize> {
    if is_parquet(path)? {
        return parquet_documents(path, text_field, skip_bad, None, None, |text| {
            f(Document {
                text,
                continues: false,
            })
        });
    }
    let mut stream = open_stream(path)?;
    let start = stream.fill_buf().map_err(|e| stream_error(path, e))?;
    match format_of(&path.to_string_lossy(), start) {
        Format::Text | Format::Parquet => {
            text_documents(path, stream, text_pieces.unwrap_or(usize::MAX), f)?;
            Ok(0)
        }
        Format::JsonLines => json_lines(path, stream, text_field, skip_bad, f),
    }
}

/// A share of the corpus that one reader takes: a whole file, or one row group of a Parquet
/// file (whose row groups are read independently, so a large Parquet file is read by as many
/// threads as a directory of small ones).
#[derive(Clone, Debug)]
pub struct Part {
    pub path: PathBuf,
    pub row_group: Option<usize>,
    /// The Parquet file's footer, read once by [`parts_of`] for all its row groups (a file
    /// of G row groups would otherwise have its footer, which lists them all, parsed G + 1
    /// times).
    footer: Option<Arc<ParquetMetaData>>,
}

impl PartialEq for Part {
    fn eq(&self, other: &Part) -> bool {
        (&self.path, self.row_group) == (&other.path, other.row_group)
    }
}

impl Eq for Part {}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.row_group {
            Some(g) => write!(f, "{}, row group {g}", self.path.display()),
            None => write!(f, "{}", self.path.display()),
        }
    }
}

/// The parts of `files`, in corpus order: a Parquet file's row groups (from its footer,
/// the only part of it read here, which must have the `text_field` column), every other file
/// whole. A Parquet file whose footer or column is missing is an error naming it, or with
/// `skip_bad` is left out: returned second, with why.
pub fn parts_of(
    files: &[PathBuf],
    text_field: &str,
    skip_bad: bool,
) -> Result<(Vec<Part>, Vec<String>)> {
    let (mut parts, mut left_out) = (Vec::new(), Vec::new());
    for path in files {
        let file_parts = || -> Result<Vec<Part>> {
            if !is_parquet(path)? {
                return Ok(vec![Part {
                    path: path.clone(),
                    row_group: None,
                    footer: None,
                }]);
            }
            let footer = parquet_footer(path)?;
            text_column(path, &footer, text_field)?;
            Ok((0..footer.num_row_groups())
                .map(|g| Part {
                    path: path.clone(),
                    row_group: Some(g),
                    footer: Some(footer.clone()),
                })
                .collect())
        };
        match file_parts() {
            Ok(file_parts) => parts.extend(file_parts),
            Err(e) if skip_bad => left_out.push(format!("{e:#}")),
            Err(e) => bail!("{e:#} (--skip-bad leaves such files out and names them)"),
        }
    }
    Ok((parts, left_out))
}

/// The `text_field` column of a Parquet file's schema, or an error naming the columns it has.
fn text_column(
    path: &Path,
    footer: &ParquetMetaData,
    text_field: &str,
) -> Result<parquet::schema::types::TypePtr> {
    let root = footer.file_metadata().schema_descr_ptr();
    let root = root.root_schema();
    let Some(column) = root.get_fields().iter().find(|c| c.name() == text_field) else {
        let names: Vec<&str> = root.get_fields().iter().map(|c| c.name()).collect();
        bail!(
            "{}: no column \"{text_field}\" (it has {}; --text-field names another)",
            path.display(),
            names.join(", ")
        );
    };
    Ok(column.clone())
}

/// A Parquet file's footer (its schema and row groups), or the error naming the file.
fn parquet_footer(path: &Path) -> Result<Arc<ParquetMetaData>> {
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    footer_of(path, &file)
}

/// The footer of the Parquet file `path`, open as `file`.
fn footer_of(path: &Path, file: &std::fs::File) -> Result<Arc<ParquetMetaData>> {
    let footer = ParquetMetaDataReader::new()
        .parse_and_finish(file)
        .with_context(|| format!("{}: not a readable Parquet file", path.display()))?;
    Ok(Arc::new(footer))
}

/// How [`read_in_order`] reads.
#[derive(Clone, Debug)]
pub struct ReadOptions {
    /// The JSON field or Parquet column that holds a document's text.
    pub text_field: String,
    /// Count and leave out malformed lines and rows, and leave out unreadable files whole,
    /// instead of stopping at the first.
    pub skip_bad: bool,
    /// Hand text files over in pieces of about this many bytes ([`for_each_document`]).
    pub text_pieces: Option<usize>,
    /// A batch is handed over when it holds at least this many bytes of text.
    pub batch_bytes: usize,
    /// Reader threads, each on its own part.
    pub readers: usize,
    /// Stop after this many documents (the last one with all its pieces).
    pub max_documents: Option<usize>,
}

/// What a reader tells the consumer about its part, in order.
enum Sent {
    Batch(Vec<Document>),
    /// The part is read (or its reader was told to stop); the lines or rows it left out
    /// under `skip_bad`.
    Done(usize),
    /// Under `skip_bad`: the part cannot be read to its end (why), and none of it was sent.
    LeftOut(String),
    Failed(anyhow::Error),
}

/// Reads `parts` with `options.readers` threads and hands their documents to `consume` in
/// corpus order, in batches, whichever thread read them. Each thread takes the next unread
/// part; its batches wait in that part's own queue (one batch deep) until the consumer
/// reaches the part, so the output does not depend on the number of readers, and memory
/// holds at most two batches a reader. The first error in corpus order is returned, as a
/// single reader would meet it. After `max_documents` nothing more is handed over or waited
/// for (a later part's error is not met), and the part being read stops at its next
/// document. Returns what was left out under `skip_bad`.
///
/// Under `skip_bad` each part is read twice, first to its end without handing anything over:
/// a part that fails is left out whole (named in [`LeftOut::parts`]) before any of its
/// documents reached `consume`, whose shards cannot take them back. That costs a second
/// decompression and parse of the corpus (a few percent of the BPE's time), and with
/// `max_documents` the part the limit ends in is read to its end once first.
pub fn read_in_order(
    parts: &[Part],
    options: &ReadOptions,
    mut consume: impl FnMut(Vec<Document>) -> Result<()>,
) -> Result<LeftOut> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::mpsc::{sync_channel, SyncSender};
    use std::sync::Mutex;
    let (senders, receivers): (Vec<_>, Vec<_>) =
        parts.iter().map(|_| sync_channel::<Sent>(1)).unzip();
    let senders: Vec<Mutex<Option<SyncSender<Sent>>>> =
        senders.into_iter().map(|s| Mutex::new(Some(s))).collect();
    let (next, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    let limit = options.max_documents.unwrap_or(usize::MAX);
    std::thread::scope(|scope| {
        for _ in 0..options.readers.clamp(1, parts.len().max(1)) {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(part) = parts.get(i) else { break };
                    let sender = senders[i].lock().ok().and_then(|mut s| s.take());
                    let Some(sender) = sender else { break };
                    read_part(part, options, &sender, &stop);
                }
            });
        }
        // The receivers are consumed here, so an early return drops the rest and a reader
        // waiting to hand over a batch nobody will take stops.
        let consumed = (|| {
            let (mut left_out, mut documents) = (LeftOut::default(), 0usize);
            for (part, receiver) in parts.iter().zip(receivers) {
                if documents == limit {
                    // A document never spans parts: the limit's last one is whole.
                    break;
                }
                loop {
                    match receiver.recv() {
                        Ok(Sent::Batch(mut batch)) => {
                            // The batch up to the first document past the limit.
                            let past = batch.iter().position(|d| {
                                documents += usize::from(!d.continues);
                                documents > limit
                            });
                            if let Some(end) = past {
                                batch.truncate(end);
                                documents = limit;
                            }
                            consume(batch)?;
                            if past.is_some() {
                                // Stop the part's reader and take its count of what it left
                                // out; what it met past the limit does not matter.
                                stop.store(true, Ordering::Relaxed);
                                while let Ok(sent) = receiver.recv() {
                                    if let Sent::Done(lines) = sent {
                                        left_out.lines += lines;
                                    }
                                }
                                return Ok(left_out);
                            }
                        }
                        Ok(Sent::Done(lines)) => {
                            left_out.lines += lines;
                            break;
                        }
                        Ok(Sent::LeftOut(why)) => {
                            left_out.parts.push(why);
                            break;
                        }
                        Ok(Sent::Failed(e)) => return Err(e),
                        Err(_) => bail!("the reader of {part} stopped before its end"),
                    }
                }
            }
            Ok(left_out)
        })();
        stop.store(true, Ordering::Relaxed);
        consumed
    })
}

/// One part's documents into `sender` in batches, then how it ended; stops at its next
/// document once `stop` is set, and without a word once the consumer has gone. Under
/// `skip_bad` the part is first read through without sending: one that fails is reported
/// as [`Sent::LeftOut`] alone.
fn read_part(
    part: &Part,
    options: &ReadOptions,
    sender: &std::sync::mpsc::SyncSender<Sent>,
    stop: &std::sync::atomic::AtomicBool,
) {
    let stopped = || stop.load(std::sync::atomic::Ordering::Relaxed);
    if options.skip_bad {
        match part_documents(part, options, |_| Ok(!stopped())) {
            Err(e) => {
                let _ = sender.send(Sent::LeftOut(format!("{e:#}")));
                return;
            }
            // The consumer has finished: whatever the rest holds does not matter.
            Ok(_) if stopped() => return,
            Ok(_) => {}
        }
    }
    let mut batch = Vec::new();
    let mut batch_bytes = 0;
    let mut consumer_gone = false;
    let mut hand_over = |doc: Document| -> Result<bool> {
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(false);
        }
        batch_bytes += doc.text.len();
        batch.push(doc);
        if batch_bytes >= options.batch_bytes {
            batch_bytes = 0;
            consumer_gone = sender
                .send(Sent::Batch(std::mem::take(&mut batch)))
                .is_err();
        }
        Ok(!consumer_gone)
    };
    let read = part_documents(part, options, &mut hand_over);
    if consumer_gone {
        return;
    }
    let end = match read {
        Ok(skipped) => {
            if !batch.is_empty() && sender.send(Sent::Batch(batch)).is_err() {
                return;
            }
            Sent::Done(skipped)
        }
        Err(e) => Sent::Failed(e),
    };
    let _ = sender.send(end);
}

/// [`for_each_document`] on one part: a whole file, or one row group of a Parquet file.
fn part_documents(
    part: &Part,
    options: &ReadOptions,
    mut f: impl FnMut(Document) -> Result<bool>,
) -> Result<usize> {
    match part.row_group {
        Some(g) => parquet_documents(
            &part.path,
            &options.text_field,
            options.skip_bad,
            Some(g),
            part.footer.clone(),
            |text| {
                f(Document {
                    text,
                    continues: false,
                })
            },
        ),
        None => for_each_document(
            &part.path,
            &options.text_field,
            options.skip_bad,
            options.text_pieces,
            f,
        ),
    }
}

/// A text file as one document, in pieces of about `target` bytes.
fn text_documents(
    path: &Path,
    mut stream: Box<dyn BufRead>,
    target: usize,
    mut f: impl FnMut(Document) -> Result<bool>,
) -> Result<()> {
    let mut pending: Vec<u8> = Vec::new();
    let (mut offset, mut first, mut searched) = (0u64, true, 0usize);
    let mut emit = |bytes: Vec<u8>, offset: u64, first: &mut bool| -> Result<bool> {
        let text = utf8(path, bytes, offset)?;
        let go_on = f(Document {
            text,
            continues: !*first,
        })?;
        *first = false;
        Ok(go_on)
    };
    loop {
        let chunk = stream.fill_buf().map_err(|e| stream_error(path, e))?;
        if chunk.is_empty() {
            break;
        }
        let n = chunk.len();
        pending.extend_from_slice(chunk);
        stream.consume(n);
        while pending.len() > target {
            // Resume the search where the last one stopped (a long line without a cut).
            let Some(cut) = piece_end(&pending, target.max(searched)) else {
                searched = pending.len();
                break;
            };
            searched = 0;
            let rest = pending.split_off(cut);
            let piece = std::mem::replace(&mut pending, rest);
            let len = piece.len() as u64;
            if !emit(piece, offset, &mut first)? {
                return Ok(());
            }
            offset += len;
        }
    }
    if !pending.is_empty() || first {
        emit(pending, offset, &mut first)?;
    }
    Ok(())
}

/// Where a piece of `bytes` may end, at `from` or later: after a lone newline between two
/// printable ASCII characters (the byte after it must be there to tell).
fn piece_end(bytes: &[u8], from: usize) -> Option<usize> {
    (from.max(2)..bytes.len()).find(|&cut| {
        bytes[cut - 1] == b'\n'
            && bytes[cut - 2].is_ascii_graphic()
            && bytes[cut].is_ascii_graphic()
    })
}

/// JSON lines, one at a time.
fn json_lines(
    path: &Path,
    mut stream: Box<dyn BufRead>,
    text_field: &str,
    skip_bad: bool,
    mut f: impl FnMut(Document) -> Result<bool>,
) -> Result<usize> {
    let (mut skipped, mut offset) = (0, 0u64);
    let mut raw = Vec::new();
    for number in 1.. {
        raw.clear();
        let n = stream
            .read_until(b'\n', &mut raw)
            .map_err(|e| stream_error(path, e))?;
        if n == 0 {
            break;
        }
        let line = String::from_utf8(std::mem::take(&mut raw));
        let line_offset = offset;
        offset += n as u64;
        let line = match line {
            Ok(line) => line,
            Err(_) if skip_bad => {
                skipped += 1;
                continue;
            }
            Err(e) => bail!(
                "{}:{number}: not UTF-8 text: {} (--skip-bad leaves such lines out and counts \
                 them)",
                path.display(),
                first_bad_byte(&e, line_offset)
            ),
        };
        if line.trim().is_empty() {
            continue;
        }
        match document_of(&line, text_field) {
            Ok(text) => {
                if !f(Document {
                    text,
                    continues: false,
                })? {
                    break;
                }
            }
            Err(_) if skip_bad => skipped += 1,
            Err(why) => bail!(
                "{}:{number}: {why} (--skip-bad leaves such lines out and counts them)",
                path.display()
            ),
        }
    }
    Ok(skipped)
}

/// The `text_field` column of a Parquet file, a row group at a time (only that column is
/// read), or of its row group `only_group`; `footer` is the file's footer when the caller
/// has read it. A row whose text is null stops with its row group and row, or is skipped.
fn parquet_documents(
    path: &Path,
    text_field: &str,
    skip_bad: bool,
    only_group: Option<usize>,
    footer: Option<Arc<ParquetMetaData>>,
    mut f: impl FnMut(String) -> Result<bool>,
) -> Result<usize> {
    use parquet::file::properties::ReaderProperties;
    use parquet::file::reader::RowGroupReader;
    use parquet::file::serialized_reader::SerializedRowGroupReader;
    use parquet::record::RowAccessor;
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let footer = match footer {
        Some(footer) => footer,
        None => footer_of(path, &file)?,
    };
    let file = Arc::new(file);
    let properties = Arc::new(ReaderProperties::builder().build());
    let column = text_column(path, &footer, text_field)?;
    let root = footer.file_metadata().schema_descr_ptr();
    let only_text = parquet::schema::types::Type::group_type_builder(root.root_schema().name())
        .with_fields(vec![column])
        .build()?;
    let mut skipped = 0;
    let groups = match only_group {
        Some(g) => g..g + 1,
        None => 0..footer.num_row_groups(),
    };
    for g in groups {
        let at = |r: usize| format!("{}: row group {g}, row {r}", path.display());
        let group = SerializedRowGroupReader::new(
            file.clone(),
            footer.row_group(g),
            footer.page_index_for_row_group(g),
            properties.clone(),
        )
        .with_context(|| at(0))?;
        let rows = group
            .get_row_iter(Some(only_text.clone()))
            .with_context(|| at(0))?;
        for (r, row) in rows.enumerate() {
            let text = row.with_context(|| at(r)).and_then(|row| {
                Ok(row
                    .get_string(0)
                    .map_err(|e| anyhow::anyhow!("{e}"))?
                    .clone())
            });
            match text {
                Ok(doc) => {
                    if !f(doc)? {
                        return Ok(skipped);
                    }
                }
                Err(_) if skip_bad => skipped += 1,
                Err(e) => bail!(
                    "{}: the column \"{text_field}\" holds no text here: {e:#} (--skip-bad \
                     leaves such rows out and counts them)",
                    at(r)
                ),
            }
        }
    }
    Ok(skipped)
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
pub(crate) mod tests {
    use super::*;
    use std::io::Write;

    /// A Parquet file of `rows` (an id and a text that may be null), in row groups of
    /// `group` rows, snappy-compressed.
    pub(crate) fn write_parquet(path: &Path, rows: &[Option<&str>], group: usize) {
        use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        let schema = parquet::schema::parser::parse_message_type(
            "message doc { REQUIRED INT64 id; OPTIONAL BYTE_ARRAY text (UTF8); }",
        )
        .unwrap();
        let props = WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build();
        let file = std::fs::File::create(path).unwrap();
        let mut w =
            SerializedFileWriter::new(file, std::sync::Arc::new(schema), props.into()).unwrap();
        for (k, chunk) in rows.chunks(group).enumerate() {
            let mut rg = w.next_row_group().unwrap();
            let ids: Vec<i64> = (0..chunk.len()).map(|i| (k * group + i) as i64).collect();
            let mut col = rg.next_column().unwrap().unwrap();
            col.typed::<Int64Type>()
                .write_batch(&ids, None, None)
                .unwrap();
            col.close().unwrap();
            let values: Vec<ByteArray> = chunk
                .iter()
                .flatten()
                .map(|t| ByteArray::from(*t))
                .collect();
            let defs: Vec<i16> = chunk.iter().map(|t| i16::from(t.is_some())).collect();
            let mut col = rg.next_column().unwrap().unwrap();
            col.typed::<ByteArrayType>()
                .write_batch(&values, Some(&defs), None)
                .unwrap();
            col.close().unwrap();
            rg.close().unwrap();
        }
        w.close().unwrap();
    }

    #[test]
    fn parquet_rows_are_documents_read_a_row_group_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("corpus.parquet");
        let rows = [
            Some("one"),
            Some("two — ü"),
            None,
            Some("four"),
            Some("five"),
        ];
        write_parquet(&path, &rows, 2);
        let e = format!("{:#}", read_documents(&path, "text", false).unwrap_err());
        assert!(
            e.contains("row group 1, row 0") && e.contains("holds no text"),
            "{e}"
        );
        let docs = read_documents(&path, "text", true).unwrap();
        let want: Vec<String> = rows.iter().flatten().map(|t| t.to_string()).collect();
        assert_eq!((docs.texts, docs.skipped), (want, 1));
        let e = format!("{:#}", read_documents(&path, "body", false).unwrap_err());
        assert!(e.contains("no column \"body\" (it has id, text"), "{e}");
        // Stopping early reads no further.
        let mut seen = Vec::new();
        for_each_document(&path, "text", true, None, |d| {
            seen.push(d.text);
            Ok(seen.len() < 2)
        })
        .unwrap();
        assert_eq!(seen, vec!["one".to_string(), "two — ü".to_string()]);
    }

    /// Every reader count and batch size hands over the documents a single reader reads,
    /// in the same order; stopping early stops; the first bad part in corpus order is named
    /// whichever reader met an error first.
    #[test]
    fn parallel_readers_keep_corpus_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut files = Vec::new();
        let mut want = Vec::new();
        for f in 0..4 {
            let rows: Vec<String> = (0..9)
                .map(|r| format!("file {f} row {r} {}", "x".repeat(r * 7)))
                .collect();
            let path = dir.path().join(format!("{f}a.parquet"));
            write_parquet(
                &path,
                &rows.iter().map(|r| Some(r.as_str())).collect::<Vec<_>>(),
                2,
            );
            want.extend(rows);
            files.push(path);
            let lines: Vec<String> = (0..5).map(|l| format!("line {l} of {f}")).collect();
            let json: String = lines
                .iter()
                .map(|l| format!("{{\"text\": \"{l}\"}}\n"))
                .collect();
            let path = dir.path().join(format!("{f}b.jsonl.gz"));
            std::fs::write(&path, gzip(json.as_bytes())).unwrap();
            want.extend(lines);
            files.push(path);
        }
        let (parts, _) = parts_of(&files, "text", false).unwrap();
        assert_eq!(
            parts.len(),
            4 * (5 + 1),
            "a part per row group and per other file"
        );
        assert_eq!(
            parts[1].to_string(),
            format!("{}, row group 1", files[0].display())
        );
        let options = |readers, batch_bytes| ReadOptions {
            text_field: "text".into(),
            skip_bad: false,
            text_pieces: None,
            batch_bytes,
            readers,
            max_documents: None,
        };
        for readers in [1, 2, 3, 8] {
            for batch_bytes in [1, 40, 1 << 20] {
                let mut got = Vec::new();
                read_in_order(&parts, &options(readers, batch_bytes), |batch| {
                    got.extend(batch.into_iter().map(|d| d.text));
                    Ok(())
                })
                .unwrap();
                assert_eq!(
                    got, want,
                    "{readers} readers, batches of {batch_bytes} bytes"
                );
                // At most 17 documents (inside a row group) or 14 (the first two files whole).
                for limit in [17, 14] {
                    let mut seen = Vec::new();
                    let stop = ReadOptions {
                        max_documents: Some(limit),
                        ..options(readers, batch_bytes)
                    };
                    read_in_order(&parts, &stop, |batch| {
                        seen.extend(batch.into_iter().map(|d| d.text));
                        Ok(())
                    })
                    .unwrap();
                    assert_eq!(seen, want[..limit], "{limit} of them, {readers} readers");
                }
            }
        }
        // Past the limit a bad file is never met; what the last part read left out is
        // counted.
        let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
        std::fs::write(&a, "{\"text\": 1}\n{\"text\": \"x\"}\n{\"text\": \"y\"}\n").unwrap();
        std::fs::write(&b, "{broken\n").unwrap();
        let mut short = parts[..1].to_vec(); // 2 documents (row group 0)
        short.extend(parts_of(&[a, b], "text", false).unwrap().0);
        let limited = |max, skip_bad| ReadOptions {
            max_documents: Some(max),
            skip_bad,
            ..options(2, 1)
        };
        let mut texts = Vec::new();
        let skipped = read_in_order(&short, &limited(3, true), |batch| {
            texts.extend(batch.into_iter().map(|d| d.text));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            (texts.len(), skipped.lines),
            (3, 1),
            "a.jsonl's bad first line counted"
        );
        read_in_order(&short, &limited(4, false), |_| Ok(()))
            .expect_err("a.jsonl's first line is before the limit");
        let e = read_in_order(&short, &limited(4, true), |_| Ok(()));
        assert_eq!(
            e.ok().map(|e| e.lines),
            Some(1),
            "b.jsonl lies past the limit of 4"
        );
        // Two bad files: the earlier one is named, even when a later reader fails first.
        std::fs::write(&files[3], gzip(b"{\"text\": 1}\n")).unwrap();
        std::fs::write(&files[7], b"{\"text\": 2}\n").unwrap();
        for readers in [1, 4, 8] {
            let e = read_in_order(&parts, &options(readers, 1), |_| Ok(())).unwrap_err();
            let e = format!("{e:#}");
            assert!(
                e.contains("1b.jsonl.gz:1: the field"),
                "{readers} readers: {e}"
            );
        }
    }

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

    /// Under `skip_bad` a JSON line that is not UTF-8 is a malformed line (counted); a
    /// Parquet file without the text column is left out by [`parts_of`], a damaged gzip
    /// stream by [`read_in_order`], each named; without it each stops, named.
    #[test]
    fn skip_bad_counts_bad_lines_and_names_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let lines = dir.path().join("a.jsonl");
        std::fs::write(
            &lines,
            b"{\"text\": \"one\"}\n{\"text\": \"\xff\"}\n{\"text\": \"three\"}\n",
        )
        .unwrap();
        let e = format!("{:#}", read_documents(&lines, "text", false).unwrap_err());
        assert!(
            e.contains("a.jsonl:2: not UTF-8 text: byte offset 26 is 0xff"),
            "{e}"
        );
        let docs = read_documents(&lines, "text", true).unwrap();
        assert_eq!(
            (docs.texts, docs.skipped),
            (vec!["one".into(), "three".into()], 1)
        );

        let parquet = dir.path().join("p.parquet");
        write_parquet(&parquet, &[Some("row")], 1);
        let e = format!(
            "{:#}",
            parts_of(std::slice::from_ref(&parquet), "body", false).unwrap_err()
        );
        assert!(
            e.contains("no column \"body\"") && e.contains("--skip-bad"),
            "{e}"
        );
        let (parts, left_out) = parts_of(&[parquet, lines.clone()], "body", true).unwrap();
        assert_eq!(parts.len(), 1);
        assert!(
            left_out.len() == 1 && left_out[0].contains("p.parquet: no column \"body\""),
            "{left_out:?}"
        );

        let damaged = dir.path().join("b.jsonl.gz");
        let whole = gzip("{\"text\": \"lost\"}\n".repeat(1000).as_bytes());
        std::fs::write(&damaged, &whole[..whole.len() - 12]).unwrap();
        let (parts, _) = parts_of(&[lines.clone(), damaged, lines], "text", true).unwrap();
        for readers in [1, 3] {
            for skip_bad in [false, true] {
                let options = ReadOptions {
                    text_field: "text".into(),
                    skip_bad,
                    text_pieces: None,
                    batch_bytes: 1,
                    readers,
                    max_documents: None,
                };
                let mut texts = Vec::new();
                let read = read_in_order(&parts, &options, |batch| {
                    texts.extend(batch.into_iter().map(|d| d.text));
                    Ok(())
                });
                if !skip_bad {
                    let e = format!("{:#}", read.unwrap_err());
                    assert!(e.contains("a.jsonl:2: not UTF-8"), "{e}");
                    continue;
                }
                let left_out = read.unwrap();
                assert_eq!(texts, ["one", "three", "one", "three"], "{readers} readers");
                assert_eq!(left_out.lines, 2);
                assert!(
                    left_out.parts.len() == 1
                        && left_out.parts[0].contains("b.jsonl.gz: a damaged gzip stream"),
                    "{left_out:?}"
                );
            }
        }
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
            ("x.parquet", PARQUET, "not a readable Parquet file"),
            ("x.jsonl.zst", ZSTD, "a damaged zstd stream"),
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
