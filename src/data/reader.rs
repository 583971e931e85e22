//! A data file's rows as [`Field`] records, read as its name says: `.parquet` (see
//! [`super::parquet`]), `.json` (a JSON array, streamed element by element, or JSON lines),
//! anything else JSON lines. Nothing reads a whole file into memory.

use super::record::Field;
use super::source::SourceFile;
use anyhow::{Context, Result};
use serde::de::{Deserializer, SeqAccess, Visitor};
use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where a record is in its file: a line of JSON lines, or a row (1-based) of a JSON array or
/// a parquet file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loc {
    /// A line (1-based) of a JSON lines file.
    Line(usize),
    /// A row (1-based) of a JSON array or a parquet file.
    Row(usize),
}

impl Loc {
    /// `file:line` or `file: row n`, as errors and skip reports write it.
    pub fn at(self, name: &str) -> String {
        match self {
            Loc::Line(n) => format!("{name}:{n}"),
            Loc::Row(n) => format!("{name}: row {n}"),
        }
    }
}

/// Takes each record (or the reason it is not one); an error stops the file.
pub(crate) type Sink<'a> = dyn FnMut(Loc, Result<Field>) -> Result<()> + 'a;

/// How a file is read, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Parquet,
    Json,
    JsonLines,
}

pub(crate) fn kind_of(path: &str) -> Kind {
    let lower = path.to_ascii_lowercase();
    if lower.ends_with(".parquet") {
        Kind::Parquet
    } else if lower.ends_with(".json") {
        Kind::Json
    } else {
        Kind::JsonLines
    }
}

/// Every record of `file` in order (parquet projected on `want`), adding the bytes read to
/// `read` as it goes.
pub(crate) fn read_source(
    file: &SourceFile,
    want: &[super::parquet::Want],
    read: &AtomicU64,
    sink: &mut Sink,
) -> Result<()> {
    let (path, name) = (file.path.as_path(), file.name.as_str());
    match kind_of(name) {
        Kind::Parquet => super::parquet::read(path, name, want, read, sink),
        Kind::Json => read_json_counted(path, name, read, sink),
        Kind::JsonLines => read_jsonl_counted(path, name, read, sink),
    }
}

/// A reader that adds the bytes it reads to a counter.
struct Counting<'a, R> {
    inner: R,
    read: &'a AtomicU64,
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// `path` opened for reading, counted into `read`.
fn open<'a>(path: &Path, name: &str, read: &'a AtomicU64) -> Result<impl BufRead + 'a> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {name}"))?;
    Ok(BufReader::with_capacity(
        1 << 20,
        Counting { inner: file, read },
    ))
}

/// JSON lines: one record a line; blank lines are skipped, a line that is not UTF-8 or not
/// JSON goes to `sink` as a bad record (on_bad_row decides), and the next line is read.
pub fn read_jsonl(path: &Path, name: &str, sink: &mut Sink) -> Result<()> {
    read_jsonl_counted(path, name, &AtomicU64::new(0), sink)
}

fn read_jsonl_counted(path: &Path, name: &str, read: &AtomicU64, sink: &mut Sink) -> Result<()> {
    lines(open(path, name, read)?, name, sink)
}

fn lines(mut r: impl BufRead, name: &str, sink: &mut Sink) -> Result<()> {
    let mut buf = Vec::new();
    for n in 1.. {
        buf.clear();
        if buf.capacity() > 16 << 20 {
            buf = Vec::new(); // a huge line's buffer is not kept for the rest of the file
        }
        let got = r
            .read_until(b'\n', &mut buf)
            .with_context(|| format!("{name}:{n}: cannot read line"))?;
        if got == 0 {
            break;
        }
        let line = match std::str::from_utf8(&buf) {
            Ok(line) => line.trim_end_matches(['\n', '\r']),
            Err(e) => {
                let why = anyhow::anyhow!(
                    "not valid UTF-8 (byte {} of the line); re-encode the file as UTF-8",
                    e.valid_up_to() + 1
                );
                sink(Loc::Line(n), Err(why))?;
                continue;
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let rec = serde_json::from_str::<Field>(line)
            .map_err(|e| anyhow::Error::new(e).context("not valid JSON"));
        sink(Loc::Line(n), rec)?;
    }
    Ok(())
}

/// A `.json` file: a JSON array of records (as `datasets` reads one), streamed, or else JSON
/// lines. Bad JSON inside an array ends the file (its position is named): there is no next
/// line to resume at.
pub fn read_json(path: &Path, name: &str, sink: &mut Sink) -> Result<()> {
    read_json_counted(path, name, &AtomicU64::new(0), sink)
}

fn read_json_counted(path: &Path, name: &str, read: &AtomicU64, sink: &mut Sink) -> Result<()> {
    let mut r = open(path, name, read)?;
    let first = loop {
        let buf = r
            .fill_buf()
            .with_context(|| format!("cannot read {name}"))?;
        match buf.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(i) => {
                let b = buf[i];
                r.consume(i);
                break Some(b);
            }
            None if buf.is_empty() => break None,
            None => {
                let n = buf.len();
                r.consume(n);
            }
        }
    };
    if first != Some(b'[') {
        return lines(r, name, sink);
    }
    let mut stop: Option<anyhow::Error> = None;
    let mut de = serde_json::Deserializer::from_reader(r);
    let res = de.deserialize_seq(Elements {
        sink,
        stop: &mut stop,
    });
    if let Some(e) = stop {
        return Err(e);
    }
    res.with_context(|| format!("{name} is not a valid JSON array of records"))?;
    de.end()
        .with_context(|| format!("{name} has more after its JSON array"))
}

/// Visits a JSON array's elements one at a time, handing each to the sink.
struct Elements<'s, 'a> {
    sink: &'s mut Sink<'a>,
    /// The sink's error, which stops the array (serde's error type cannot carry it).
    stop: &'s mut Option<anyhow::Error>,
}

impl<'de> Visitor<'de> for Elements<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON array of records")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut n = 0;
        while let Some(rec) = seq.next_element::<Field>()? {
            n += 1;
            if let Err(e) = (self.sink)(Loc::Row(n), Ok(rec)) {
                *self.stop = Some(e);
                return Err(serde::de::Error::custom("stopped"));
            }
        }
        Ok(())
    }
}

/// Every record of `path` (of any kind) in order, all columns when `want` is empty: for
/// tests and tools (training streams through [`Sink`]s instead).
pub fn read_all(path: &Path, want: &[super::parquet::Want]) -> Result<Vec<(Loc, Field)>> {
    let mut out = Vec::new();
    let name = path.display().to_string();
    let mut sink = |at: Loc, rec: Result<Field>| -> Result<()> {
        out.push((at, rec.with_context(|| at.at(&name))?));
        Ok(())
    };
    let file = SourceFile {
        path: path.to_path_buf(),
        name: name.clone(),
    };
    read_source(&file, want, &AtomicU64::new(0), &mut sink)?;
    Ok(out)
}
