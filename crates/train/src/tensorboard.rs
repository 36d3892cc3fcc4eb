//! TensorBoard event files for the run's scalars, written without TensorFlow or a protobuf
//! crate: the format is small enough to encode by hand (TFRecord framing around hand-encoded
//! `Event` messages), and `read_scalars` reads it back so tests need no TensorBoard either.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The `file_version` TensorBoard expects in the first event of every file.
const FILE_VERSION: &str = "brain.Event:2";

/// Writes TensorBoard event files: `tensorboard --logdir DIR` shows the scalars as they are
/// written, since every call flushes (a killed run keeps the events it logged).
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir` if needed and a new file in it,
    /// `events.out.tfevents.{unix_secs}.{hostname}.{pid}.meshtrain` (TensorBoard reads the
    /// files whose names hold `tfevents`).
    ///
    /// Never overwrites: should that name exist already (two writers of one process within a
    /// second), a suffix `.1`, `.2`, ... is added (TensorBoard reads any name containing
    /// `tfevents`).
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let now = unix_time();
        let base = format!(
            "events.out.tfevents.{}.{}.{}.meshtrain",
            now as u64,
            hostname(),
            std::process::id()
        );
        let mut n = 0;
        let (path, file) = loop {
            let name = if n == 0 {
                base.clone()
            } else {
                format!("{base}.{n}")
            };
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => n += 1,
                Err(e) => {
                    return Err(e).with_context(|| format!("creating {}", path.display()));
                }
            }
        };
        let mut writer = EventWriter {
            path,
            out: BufWriter::new(file),
        };
        let mut event = event_header(now, 0);
        put_bytes(&mut event, 3, FILE_VERSION.as_bytes());
        writer.write_record(&event)?;
        writer.flush()?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event with several scalars at one step.
    ///
    /// TensorBoard stores scalars as `f32` (`simple_value`), so values are rounded to it.
    /// Flushes, so the event is on disk (in the OS cache) when this returns.
    pub fn add_scalars(
        &mut self,
        step: u64,
        wall_time: f64,
        scalars: &[(String, f64)],
    ) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::with_capacity(tag.len() + 8);
            put_bytes(&mut v, 1, tag.as_bytes());
            put_key(&mut v, 2, WIRE_FIXED32);
            v.extend_from_slice(&(*value as f32).to_le_bytes());
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = event_header(wall_time, step);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)?;
        self.flush()
    }

    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// TFRecord framing: length, its masked CRC, the data, its masked CRC.
    fn write_record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(data);
        record.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.out
            .write_all(&record)
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// The scalars a metrics.jsonl record carries, so TensorBoard shows what the file holds:
/// every finite number at the top level but "step" (the event's step), named
/// "{kind}/{field}" (kind: the record's "kind", e.g. train, eval, summary), and those of
/// objects one level down as "{kind}/{object}/{field}" (the summary's breakdown and memory).
/// Booleans and strings are skipped.
///
/// Nulls (a NaN serializes as null), arrays and deeper objects are skipped too, and a record
/// without a string "kind" gives no scalars.
pub fn record_scalars(record: &serde_json::Value) -> Vec<(String, f64)> {
    let Some(kind) = record.get("kind").and_then(|k| k.as_str()) else {
        return Vec::new();
    };
    let Some(fields) = record.as_object() else {
        return Vec::new();
    };
    let finite = |v: &serde_json::Value| v.as_f64().filter(|x| x.is_finite());
    let mut scalars = Vec::new();
    for (name, value) in fields {
        if name == "step" {
            continue;
        }
        if let Some(x) = finite(value) {
            scalars.push((format!("{kind}/{name}"), x));
        } else if let Some(object) = value.as_object() {
            for (field, value) in object {
                if let Some(x) = finite(value) {
                    scalars.push((format!("{kind}/{name}/{field}"), x));
                }
            }
        }
    }
    scalars
}

/// Reads back an event file: (step, tag, value) of every scalar, in order. Both CRCs of
/// every record are checked; a truncated last record is an error naming its offset.
///
/// Only `simple_value` scalars are returned (what `EventWriter` writes); other events and
/// values (images, tensors, ...) are skipped.
pub fn read_scalars(path: &Path) -> Result<Vec<(u64, String, f32)>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut scalars = Vec::new();
    let mut offset = 0;
    while offset < bytes.len() {
        let record = read_record(&bytes, offset)
            .with_context(|| format!("{}: record at byte offset {offset}", path.display()))?;
        parse_event(record, &mut scalars)
            .with_context(|| format!("{}: event at byte offset {offset}", path.display()))?;
        offset += record.len() + 16;
    }
    Ok(scalars)
}

/// The data of the TFRecord at `offset`, both CRCs checked.
fn read_record(bytes: &[u8], offset: usize) -> Result<&[u8]> {
    let rest = &bytes[offset..];
    if rest.len() < 12 {
        bail!("truncated: {} bytes of a 12-byte header", rest.len());
    }
    let (len_bytes, len_crc) = (&rest[..8], le_u32(&rest[8..12]));
    if masked_crc(len_bytes) != len_crc {
        bail!("length CRC mismatch");
    }
    let len = u64::from_le_bytes(len_bytes.try_into().unwrap());
    let body = &rest[12..];
    if (body.len() as u64) < len.saturating_add(4) {
        bail!(
            "truncated: {} bytes of a {len}-byte record and its CRC",
            body.len()
        );
    }
    let len = len as usize;
    let data = &body[..len];
    if masked_crc(data) != le_u32(&body[len..len + 4]) {
        bail!("data CRC mismatch");
    }
    Ok(data)
}

/// Appends the scalars of one `Event` message.
fn parse_event(event: &[u8], scalars: &mut Vec<(u64, String, f32)>) -> Result<()> {
    let mut step = 0;
    let mut values = Vec::new();
    for field in Fields(event) {
        match field? {
            (2, Field::Varint(s)) => step = s,
            (5, Field::Bytes(summary)) => {
                for field in Fields(summary) {
                    if let (1, Field::Bytes(value)) = field? {
                        values.push(value);
                    }
                }
            }
            _ => {}
        }
    }
    for value in values {
        let (mut tag, mut simple) = (None, None);
        for field in Fields(value) {
            match field? {
                (1, Field::Bytes(t)) => {
                    tag = Some(String::from_utf8(t.to_vec()).context("tag is not UTF-8")?)
                }
                (2, Field::Fixed32(bits)) => simple = Some(f32::from_bits(bits)),
                _ => {}
            }
        }
        if let Some(x) = simple {
            scalars.push((step, tag.unwrap_or_default(), x));
        }
    }
    Ok(())
}

const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_BYTES: u8 = 2;
const WIRE_FIXED32: u8 = 5;

/// The fields `wall_time` (1) and `step` (2) every event starts with.
fn event_header(wall_time: f64, step: u64) -> Vec<u8> {
    let mut event = Vec::with_capacity(64);
    put_key(&mut event, 1, WIRE_FIXED64);
    event.extend_from_slice(&wall_time.to_le_bytes());
    put_key(&mut event, 2, WIRE_VARINT);
    put_varint(&mut event, step);
    event
}

fn put_varint(out: &mut Vec<u8>, mut x: u64) {
    while x >= 0x80 {
        out.push(x as u8 | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, u64::from(field) << 3 | u64::from(wire));
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, WIRE_BYTES);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A decoded protobuf field value.
enum Field<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32(u32),
}

/// The (field number, value) pairs of a protobuf message.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Result<u64> {
        let mut x = 0u64;
        for shift in (0..64).step_by(7) {
            let Some((&b, rest)) = self.0.split_first() else {
                bail!("truncated varint");
            };
            self.0 = rest;
            x |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(x);
            }
        }
        bail!("varint longer than 10 bytes")
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8]> {
        if (self.0.len() as u64) < n {
            bail!("field of {n} bytes runs past the end of its message");
        }
        let (head, rest) = self.0.split_at(n as usize);
        self.0 = rest;
        Ok(head)
    }

    fn field(&mut self) -> Result<(u64, Field<'a>)> {
        let key = self.varint()?;
        let value = match (key & 7) as u8 {
            WIRE_VARINT => Field::Varint(self.varint()?),
            WIRE_FIXED64 => {
                self.take(8)?;
                Field::Fixed64
            }
            WIRE_BYTES => {
                let n = self.varint()?;
                Field::Bytes(self.take(n)?)
            }
            WIRE_FIXED32 => Field::Fixed32(le_u32(self.take(4)?)),
            wire => bail!("unsupported protobuf wire type {wire}"),
        };
        Ok((key >> 3, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Field<'a>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = self.field();
        if field.is_err() {
            self.0 = &[]; // no resynchronizing after a malformed field
        }
        Some(field)
    }
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().unwrap())
}

/// TFRecord's masked CRC32C (masking keeps a CRC of data that contains CRCs well-behaved).
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name for the file name (so runs of several hosts into one directory don't
/// collide), reduced to characters safe in a file name.
fn hostname() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string());
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<(u64, Vec<(String, f64)>)> {
        vec![
            (
                1,
                vec![("train/loss".into(), 2.5), ("train/lr".into(), 1e-3)],
            ),
            (
                300,
                vec![("train/loss".into(), 0.125), ("eval/accuracy".into(), 0.9)],
            ),
        ]
    }

    fn write_sample(dir: &Path) -> EventWriter {
        let mut w = EventWriter::create(dir).unwrap();
        for (step, scalars) in sample() {
            w.add_scalars(step, 1.7e9 + step as f64, &scalars).unwrap();
        }
        w
    }

    #[test]
    fn crc32c_known_vectors() {
        // RFC 3720 (iSCSI), appendix B.4, and the usual check value.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c::crc32c(b""), 0);
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c::crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c::crc32c(&ascending), 0x46DD_794E);
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let w = write_sample(&dir.path().join("tb"));
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        assert!(
            name.ends_with(&format!(".{}.meshtrain", std::process::id())),
            "{name}"
        );
        let expected: Vec<(u64, String, f32)> = sample()
            .into_iter()
            .flat_map(|(step, s)| s.into_iter().map(move |(t, v)| (step, t, v as f32)))
            .collect();
        assert_eq!(read_scalars(w.path()).unwrap(), expected);
    }

    #[test]
    fn never_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let a = write_sample(dir.path());
        let b = EventWriter::create(dir.path()).unwrap();
        assert_ne!(a.path(), b.path());
        assert_eq!(read_scalars(a.path()).unwrap().len(), 4);
        assert!(read_scalars(b.path()).unwrap().is_empty());
    }

    #[test]
    fn any_corrupted_byte_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let w = write_sample(dir.path());
        let good = std::fs::read(w.path()).unwrap();
        let bad = dir.path().join("bad.tfevents");
        for i in 0..good.len() {
            let mut bytes = good.clone();
            bytes[i] ^= 0x10;
            std::fs::write(&bad, &bytes).unwrap();
            assert!(read_scalars(&bad).is_err(), "flipped byte {i} not detected");
        }
    }

    #[test]
    fn truncated_last_record_names_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.add_scalars(1, 0.0, &[("a".into(), 1.0)]).unwrap();
        let last = std::fs::metadata(w.path()).unwrap().len() as usize;
        w.add_scalars(2, 0.0, &[("a".into(), 2.0)]).unwrap();
        let full = std::fs::read(w.path()).unwrap();
        for cut in [last + 3, last + 12, full.len() - 1] {
            std::fs::write(w.path(), &full[..cut]).unwrap();
            let err = format!("{:#}", read_scalars(w.path()).unwrap_err());
            assert!(err.contains(&format!("offset {last}")), "{err}");
            assert!(err.contains("truncated"), "{err}");
        }
    }

    #[test]
    fn scalars_of_a_train_record() {
        let record = serde_json::json!({"kind":"train","step":5,"epoch":0.1,"loss":2.5,"lr":0.001,
            "grad_norm":null,"samples_per_s":100.0});
        let mut scalars = record_scalars(&record);
        scalars.sort_by(|a, b| a.0.cmp(&b.0));
        let expected = [
            ("train/epoch", 0.1),
            ("train/loss", 2.5),
            ("train/lr", 0.001),
            ("train/samples_per_s", 100.0),
        ];
        assert_eq!(scalars, expected.map(|(t, v)| (t.to_string(), v)).to_vec());
    }

    #[test]
    fn scalars_of_a_summary_record() {
        let record = serde_json::json!({"kind":"summary","steps":10,"layout":"dp=2",
            "test_accuracy":null,"breakdown":{"data_s":0.5,"grad_reduce":"flat",
            "device_memory":{"peak":1}},"memory":{"params_mb":3.0},"done":true,"list":[1,2]});
        let mut scalars = record_scalars(&record);
        scalars.sort_by(|a, b| a.0.cmp(&b.0));
        let tags: Vec<&str> = scalars.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(
            tags,
            [
                "summary/breakdown/data_s",
                "summary/memory/params_mb",
                "summary/steps"
            ]
        );
        assert!(record_scalars(&serde_json::json!({"loss": 1.0})).is_empty());
    }
}
