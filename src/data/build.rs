//! Tokenizing a data set's files on every core. One thread reads the rows in file order and
//! hands them out in chunks; worker threads parse and tokenize the chunks; the calling thread
//! takes the results back in file order, counts them, and hands each example to an [`Out`].
//! The examples, their order, the counts and the first error are those of reading the files
//! row by row on one thread.
//!
//! Memory stays bounded whatever the data's size: at most [`IN_FLIGHT`] chunks per worker are
//! between the reader and the collector, a chunk holds at most [`CHUNK_ROWS`] rows or
//! [`CHUNK_BYTES`] of text (and one row more), a string is cut to [`hard_cut`] as it is read,
//! and the tokenizer sees at most what seq_len needs of it ([`parse_bounded`]).

use super::columns::{self, Columns};
use super::parquet::Want;
use super::progress::Progress;
use super::reader::{self, Loc};
use super::record::Field;
use super::rows::{check_ids, parse_row, Row, RowSpec};
use super::source::SourceFile;
use super::{chat, has_target, TextTokenizer};
use crate::recipe::{DataFormat, DataSection, OnBadRow};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::Mutex;

/// Rows in a chunk, at most.
pub const CHUNK_ROWS: usize = 64;
/// Bytes of text in a chunk before it is sent (the last row may go past it).
pub const CHUNK_BYTES: usize = 4 << 20;
/// Chunks per worker that may be on their way (read, not yet collected).
pub const IN_FLIGHT: usize = 2;
/// Bad rows quoted in the report when on_bad_row = "skip".
const SKIP_QUOTED: usize = 3;
/// Tokens past seq_len that a cut row must still have for its kept tokens to be trusted.
const CUT_MARGIN: usize = 64;

/// The first cut of a long string before tokenizing: 16 bytes a token of seq_len (and a
/// margin), at least 64 KiB. Strings no longer than this are tokenized whole.
pub fn soft_cut(seq_len: usize) -> usize {
    (16 * (seq_len + CUT_MARGIN)).max(64 << 10)
}

/// The cut applied as a row is read: 64 times [`soft_cut`] (over a thousand bytes a token);
/// text beyond it can never reach the first seq_len tokens of a real tokenizer.
pub fn hard_cut(seq_len: usize) -> usize {
    64 * soft_cut(seq_len)
}

/// One data.train entry (or data.eval) to read: its files and how its rows become examples.
pub struct Entry<'a> {
    /// The entry's path as the recipe gives it (errors name it).
    pub path: PathBuf,
    /// The files it reads (a Hub data set's, or the path itself).
    pub files: Vec<SourceFile>,
    /// The format of its rows.
    pub format: DataFormat,
    /// Its column mapping.
    pub columns: Columns,
    /// Only completion tokens are targets (train_on = "completions").
    pub completions_only: bool,
    /// The tokenizer (None for format "tokens").
    pub tok: Option<&'a TextTokenizer>,
    /// The chat template (format "chat").
    pub chat: Option<&'a chat::ChatTemplate>,
}

impl Entry<'_> {
    fn spec(&self) -> RowSpec<'_> {
        RowSpec {
            format: self.format,
            completions_only: self.completions_only,
            columns: &self.columns,
            tok: self.tok,
            chat: self.chat,
        }
    }

    /// The columns a parquet file is read with.
    fn want(&self) -> Vec<Want<'_>> {
        let c = &self.columns;
        c.iter()
            .map(|(ours, col, required)| Want {
                names: match ours == "messages" && c.sharegpt_fallback {
                    true => vec![col, columns::SHAREGPT],
                    false => vec![col],
                },
                required,
            })
            .collect()
    }

    /// Whether long strings are cut before tokenizing (not token rows).
    fn cuts(&self) -> bool {
        self.format != DataFormat::Tokens
    }
}

/// Takes the examples in order.
pub trait Out {
    /// Appends one example.
    fn push(&mut self, ids: &[u32], labels: &[i64]) -> Result<()>;

    /// A chunk's examples are all pushed; `c` counts every row so far (a streaming run's
    /// steps may read them now). An error stops the build.
    fn chunk_done(&mut self, _c: &Counts) -> Result<()> {
        Ok(())
    }
}

/// What building counted, kept with the examples (a cache file's meta).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    /// Rows read (good and bad).
    pub rows: usize,
    /// Bytes of the files read.
    pub bytes: u64,
    /// Examples cut to seq_len (those then dropped included).
    pub truncated: usize,
    /// Malformed rows skipped, and the first few with file:line.
    pub skipped: usize,
    pub skipped_first: Vec<String>,
    /// Examples dropped because truncation left them no target.
    pub no_targets: usize,
    /// Examples dropped for having no target at all, and the first: `file:line: what`.
    pub no_answer: usize,
    pub no_answer_first: Option<String>,
    /// Chat turns that got the EOS appended.
    pub eos_added: usize,
    /// Stop token id → assistant turns ending with it.
    pub turn_ends: BTreeMap<u32, usize>,
    /// Examples of each entry, in order (an entry's examples are contiguous).
    pub per_entry: Vec<usize>,
}

/// Rows of one file on their way to a worker, or the end of an entry.
struct Chunk {
    seq: u64,
    entry: usize,
    name: std::sync::Arc<str>,
    rows: Option<Vec<(Loc, Result<Field>)>>,
}

/// What became of one row.
enum Outcome {
    /// An example; `cut`: it was longer than seq_len.
    Example { row: Row, cut: bool },
    /// Cut to seq_len, it kept no target.
    NoTargets,
    /// It has no target at all: `file:line: what`.
    NoAnswer(String),
    /// Malformed: `file:line: why`.
    Bad(String),
}

/// A worker's result for one chunk.
struct Done {
    seq: u64,
    entry: usize,
    outcomes: Option<Vec<Outcome>>,
}

/// The reader stopped because the collector is gone (it has the error to report).
#[derive(Debug, thiserror::Error)]
#[error("stopped")]
struct Stopped;

/// Reads, tokenizes and collects every row of `entries` in order into `out`, on `workers`
/// threads besides the reader's and the caller's. Errors are the first in file order.
pub fn build(
    entries: &[Entry],
    cfg: &DataSection,
    vocab: usize,
    workers: usize,
    progress: &mut Progress,
    out: &mut dyn Out,
) -> Result<Counts> {
    let workers = workers.max(1);
    let bytes = AtomicU64::new(0);
    let slots = IN_FLIGHT * workers + 2;
    let (credit_tx, credit_rx) = sync_channel::<()>(slots);
    for _ in 0..slots {
        let _ = credit_tx.send(());
    }
    let (work_tx, work_rx) = channel::<Chunk>();
    let work_rx = Mutex::new(work_rx);
    let (done_tx, done_rx) = channel::<Done>();
    let seq_len = cfg.seq_len;
    std::thread::scope(|s| {
        let bytes = &bytes;
        let reader = std::thread::Builder::new()
            .name("data-read".into())
            .spawn_scoped(s, move || read(entries, seq_len, bytes, credit_rx, work_tx))
            .context("cannot start the data reader thread")?;
        for k in 0..workers {
            let (rx, tx) = (&work_rx, done_tx.clone());
            std::thread::Builder::new()
                .name(format!("data-tok-{k}"))
                .spawn_scoped(s, move || work(entries, seq_len, vocab, rx, tx))
                .context("cannot start a tokenizing thread")?;
        }
        drop(done_tx);
        let collected = collect(entries, cfg, done_rx, credit_tx, bytes, progress, out);
        let read = reader.join().unwrap_or_else(|p| {
            bail!(
                "the data reader panicked: {}",
                crate::util::panic_message(&*p)
            )
        });
        match (collected, read) {
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(e),
            (Ok(mut c), Ok(())) => {
                c.bytes = bytes.load(Ordering::Relaxed);
                Ok(c)
            }
        }
    })
}

/// The reader: every file of every entry in order, in chunks, each sent when a slot is free;
/// an entry's end is sent after its files.
fn read(
    entries: &[Entry],
    seq_len: usize,
    bytes: &AtomicU64,
    credits: Receiver<()>,
    work: Sender<Chunk>,
) -> Result<()> {
    let mut seq = 0u64;
    let mut send = |entry: usize, name: &std::sync::Arc<str>, rows| -> Result<()> {
        credits.recv().map_err(|_| Stopped)?;
        let c = Chunk {
            seq,
            entry,
            name: name.clone(),
            rows,
        };
        seq += 1;
        work.send(c).map_err(|_| Stopped.into())
    };
    let hard = hard_cut(seq_len);
    for (k, e) in entries.iter().enumerate() {
        let want = e.want();
        for file in &e.files {
            let name: std::sync::Arc<str> = file.name.as_str().into();
            let mut rows = Vec::new();
            let mut weight = 0;
            let mut sink = |at: Loc, rec: Result<Field>| -> Result<()> {
                let rec = rec.map(|mut f| {
                    if e.cuts() && f.longest_str() > hard {
                        f.cut(hard);
                    }
                    f
                });
                weight += 64 + rec.as_ref().map_or(0, |f| f.text_bytes());
                rows.push((at, rec));
                if rows.len() >= CHUNK_ROWS || weight >= CHUNK_BYTES {
                    send(k, &name, Some(std::mem::take(&mut rows)))?;
                    weight = 0;
                }
                Ok(())
            };
            reader::read_source(file, &want, bytes, &mut sink)?;
            if !rows.is_empty() {
                send(k, &name, Some(rows))?;
            }
        }
        send(k, &"".into(), None)?;
    }
    Ok(())
}

/// A worker: chunks in, outcomes out, until the reader or the collector is gone.
fn work(
    entries: &[Entry],
    seq_len: usize,
    vocab: usize,
    rx: &Mutex<Receiver<Chunk>>,
    tx: Sender<Done>,
) {
    loop {
        let next = match rx.lock() {
            Ok(r) => r.recv(),
            Err(_) => return,
        };
        let Ok(c) = next else { return };
        let e = &entries[c.entry];
        let outcomes = c.rows.map(|rows| {
            rows.into_iter()
                .map(|(at, rec)| outcome(e, &c.name, at, rec, seq_len, vocab))
                .collect()
        });
        let d = Done {
            seq: c.seq,
            entry: c.entry,
            outcomes,
        };
        if tx.send(d).is_err() {
            return;
        }
    }
}

/// One row → its outcome: parsed, checked, cut to seq_len, judged (as the format says).
fn outcome(
    e: &Entry,
    name: &str,
    at: Loc,
    rec: Result<Field>,
    seq_len: usize,
    vocab: usize,
) -> Outcome {
    let spec = e.spec();
    let parsed = rec
        .and_then(|r| {
            let run = std::panic::AssertUnwindSafe(|| match e.cuts() {
                true => parse_bounded(&r, &spec, seq_len),
                false => parse_row(&r, &spec),
            });
            std::panic::catch_unwind(run).unwrap_or_else(|p| {
                bail!(
                    "the tokenizer panicked: {}",
                    crate::util::panic_message(&*p)
                )
            })
        })
        .and_then(|r| check_ids(&r, vocab).map(|_| r));
    match parsed {
        Ok(row) if e.completions_only && !has_target(&row.labels) => {
            let what = match e.format {
                DataFormat::Chat => "no assistant turn",
                _ => "an empty completion",
            };
            Outcome::NoAnswer(format!("{}: {what}", at.at(name)))
        }
        Ok(mut row) => {
            let cut = row.ids.len() > seq_len;
            if cut {
                row.ids.truncate(seq_len);
                row.labels.truncate(seq_len);
            }
            match e.completions_only && !has_target(&row.labels) {
                true => Outcome::NoTargets,
                false => Outcome::Example { row, cut },
            }
        }
        Err(err) => Outcome::Bad(format!("{}: {err:#}", at.at(name))),
    }
}

/// A row parsed with its long strings cut: first to [`soft_cut`], then four times longer
/// while the tokens fall short of seq_len and a margin; whole when no string is longer than
/// the cut. The kept tokens are the ones the whole row gives (the tokens a cut changes are
/// the last few, past the margin), and the tokenizer's memory follows seq_len, not the row.
pub(super) fn parse_bounded(rec: &Field, spec: &RowSpec, seq_len: usize) -> Result<Row> {
    let longest = rec.longest_str();
    let mut cut = soft_cut(seq_len);
    while cut < longest {
        let row = parse_row(&rec.cut_copy(cut), spec)?;
        if row.ids.len() > seq_len + CUT_MARGIN {
            return Ok(row);
        }
        cut = cut.saturating_mul(4);
    }
    parse_row(rec, spec)
}

/// The collector: outcomes back in file order, counted; examples to `out`; an entry's end
/// checked (it must have examples). Returns a slot for every chunk taken.
fn collect(
    entries: &[Entry],
    cfg: &DataSection,
    done: Receiver<Done>,
    credits: SyncSender<()>,
    bytes: &AtomicU64,
    progress: &mut Progress,
    out: &mut dyn Out,
) -> Result<Counts> {
    let mut c = Counts {
        per_entry: vec![0; entries.len()],
        ..Counts::default()
    };
    let mut pending: BTreeMap<u64, Done> = BTreeMap::new();
    let mut next = 0u64;
    for d in done.iter() {
        pending.insert(d.seq, d);
        while let Some(d) = pending.remove(&next) {
            next += 1;
            match d.outcomes {
                Some(outcomes) => {
                    for o in outcomes {
                        c.rows += 1;
                        apply(&mut c, d.entry, o, cfg.on_bad_row, out)?;
                    }
                }
                None => entry_end(&c, d.entry, &entries[d.entry], cfg)?,
            }
            out.chunk_done(&c)?;
            let _ = credits.send(());
            progress.update(bytes.load(Ordering::Relaxed), c.rows);
        }
    }
    Ok(c)
}

/// Counts one row's outcome; an example goes to `out`, a bad row is the error when
/// on_bad_row = "error".
fn apply(
    c: &mut Counts,
    entry: usize,
    o: Outcome,
    on_bad: OnBadRow,
    out: &mut dyn Out,
) -> Result<()> {
    match o {
        Outcome::Example { row, cut } => {
            c.truncated += cut as usize;
            c.eos_added += row.eos_added;
            for t in row.turn_ends {
                *c.turn_ends.entry(t).or_default() += 1;
            }
            out.push(&row.ids, &row.labels)?;
            c.per_entry[entry] += 1;
        }
        Outcome::NoTargets => {
            c.truncated += 1;
            c.no_targets += 1;
        }
        Outcome::NoAnswer(first) => {
            c.no_answer += 1;
            c.no_answer_first.get_or_insert(first);
        }
        Outcome::Bad(msg) => {
            if on_bad == OnBadRow::Error {
                bail!("{msg}");
            }
            c.skipped += 1;
            if c.skipped_first.len() < SKIP_QUOTED {
                c.skipped_first.push(msg);
            }
        }
    }
    Ok(())
}

/// An entry (`k`, `e`) that gave no example is an error saying why (bad rows, nothing to
/// train on, or nothing left within seq_len; counted over the entries read so far).
fn entry_end(c: &Counts, k: usize, e: &Entry, cfg: &DataSection) -> Result<()> {
    if c.per_entry[k] > 0 {
        return Ok(());
    }
    let mut why = Vec::new();
    if c.skipped > 0 {
        why.push(format!(
            "{} bad rows skipped; first: {}",
            c.skipped,
            c.skipped_first.first().map_or("", |s| s.as_str())
        ));
    }
    if let Some(first) = &c.no_answer_first {
        why.push(format!(
            "{} examples have nothing to train on under train_on = \"completions\"; first: {first}; give each row its reply, or set data.train_on = \"all\"",
            c.no_answer
        ));
    }
    if c.no_targets > 0 {
        why.push(format!(
            "{} examples had no completion token left within seq_len {}",
            c.no_targets, cfg.seq_len
        ));
    }
    let why = match why.is_empty() {
        true => String::new(),
        false => format!(" ({})", why.join("; ")),
    };
    bail!("{} has no examples{why}", e.path.display())
}
