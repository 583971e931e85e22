//! The TensorBoard tracker: one event file per session of a run under `<output.dir>/runs/`,
//! named as TensorBoard's writers name theirs (`events.out.tfevents.<unix time>.<host>.<pid>.
//! <n>`, with our suffix `.lora-train`): the file-version event, a SessionLog START at the first
//! step this session logs (TensorBoard then drops what an earlier file holds from that step on:
//! a resumed run's repeated steps, a fresh run's predecessor), then one event per metrics row
//! whose values are float32 `simple_value`s, as torch's and transformers' writers make them.
//! Also reads such a directory back (`read_dir`), checking every record's CRCs.

use super::event::{self, Event, What};
use super::tfrecord;
use super::{Scalars, Sink, Start, Status};
use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The folder under the output directory that holds the event files.
pub(crate) const RUNS: &str = "runs";

/// The suffix of the event files lora-train writes (what a fresh run may remove).
pub(crate) const SUFFIX: &str = ".lora-train";

/// The program named in the first event of each file.
pub(crate) const WRITER: &str = "lora-train";

/// Files this process has opened (the last part of a name, as TensorBoard's writers count).
static OPENED: AtomicU64 = AtomicU64::new(0);

/// An open event file.
pub(crate) struct TensorBoard {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
}

impl TensorBoard {
    /// Creates this session's event file in `<out_dir>/runs/` and writes its first events. A
    /// fresh run first removes the event files an earlier run wrote there (ours by name).
    pub(crate) fn open(start: &Start) -> Result<TensorBoard> {
        let dir = start.out_dir.join(RUNS);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        if start.resumed_at.is_none() {
            let n = remove_earlier(&dir)?;
            if n > 0 {
                (start.say)(&format!(
                    "removed {n} event file(s) of an earlier run from {}",
                    dir.display()
                ));
            }
        }
        let wall = super::now();
        let name = format!(
            "events.out.tfevents.{:010}.{}.{}.{}{SUFFIX}",
            wall as u64,
            hostname(),
            std::process::id(),
            OPENED.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let mut tb = TensorBoard {
            file: std::io::BufWriter::new(file),
            path,
        };
        let first = start.resumed_at.map_or(1, |s| s + 1);
        let mut bytes = Vec::new();
        for e in head(wall, first, WRITER) {
            tfrecord::push_record(&mut bytes, &event::encode(&e));
        }
        tb.write(&bytes)?;
        Ok(tb)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.file
            .write_all(bytes)
            .and_then(|()| self.file.flush())
            .with_context(|| format!("cannot write {}", self.path.display()))
    }
}

impl Sink for TensorBoard {
    fn rows(&mut self, rows: &[Scalars]) -> Result<()> {
        let mut bytes = Vec::new();
        for r in rows {
            tfrecord::push_record(&mut bytes, &event::encode(&scalar_event(r)));
        }
        self.write(&bytes)
    }

    fn end(&mut self, _: Status) -> Result<()> {
        self.write(&[])
    }
}

/// The first events of a file: its version (naming `writer`) and a session start at `step`.
pub fn head(wall: f64, step: u64, writer: &str) -> [Event; 2] {
    [
        Event {
            wall_time: wall,
            step: 0,
            what: What::FileVersion(event::FILE_VERSION.into()),
            writer: Some(writer.into()),
        },
        Event {
            wall_time: wall,
            step: step as i64,
            what: What::SessionLog(event::SESSION_START),
            writer: None,
        },
    ]
}

/// A row's scalars as one event (values rounded to float32, TensorBoard's `simple_value`).
pub fn scalar_event(r: &Scalars) -> Event {
    Event {
        wall_time: r.wall,
        step: r.step as i64,
        what: What::Scalars(
            r.values
                .iter()
                .map(|(t, v)| (t.clone(), *v as f32))
                .collect(),
        ),
        writer: None,
    }
}

/// Removes the event files of ours in `dir` (named `events.out.tfevents.*.lora-train`).
fn remove_earlier(dir: &Path) -> Result<usize> {
    let mut n = 0;
    for e in std::fs::read_dir(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("events.out.tfevents.") && name.ends_with(SUFFIX) && e.path().is_file()
        {
            std::fs::remove_file(e.path())
                .with_context(|| format!("cannot remove {}", e.path().display()))?;
            n += 1;
        }
    }
    Ok(n)
}

/// This machine's name as a file name part (letters, digits, `-`, `_`; else "localhost").
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let h: String = raw
        .trim()
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                true => c,
                false => '-',
            },
        )
        .collect();
    match h.is_empty() {
        true => "localhost".into(),
        false => h,
    }
}

/// Reads every event file in `dir` (any name with `tfevents`), in name order as TensorBoard
/// does: (file, its events), each record's CRCs checked. Files past `max_bytes` are refused.
pub fn read_dir(dir: &Path, max_bytes: u64) -> Result<Vec<(PathBuf, Vec<Event>)>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().contains("tfevents"))
        })
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for p in paths {
        let len = std::fs::metadata(&p)
            .with_context(|| format!("cannot read {}", p.display()))?
            .len();
        if len > max_bytes {
            anyhow::bail!("{}: {len} bytes, over the {max_bytes} read", p.display());
        }
        let bytes = std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?;
        let records = tfrecord::read_records(&bytes).with_context(|| format!("{}", p.display()))?;
        let events = records
            .into_iter()
            .map(event::decode)
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("{}", p.display()))?;
        out.push((p, events));
    }
    Ok(out)
}

/// The scalars TensorBoard shows for event files read in order: each SessionLog START at step
/// s drops the values held from s on; then (tag → [(step, value)]) in order.
pub fn scalars(
    files: &[(PathBuf, Vec<Event>)],
) -> std::collections::BTreeMap<String, Vec<(i64, f32)>> {
    let mut out: std::collections::BTreeMap<String, Vec<(i64, f32)>> = Default::default();
    for e in files.iter().flat_map(|(_, es)| es) {
        match &e.what {
            What::SessionLog(event::SESSION_START) => {
                for v in out.values_mut() {
                    v.retain(|(s, _)| *s < e.step);
                }
            }
            What::Scalars(values) => {
                for (tag, x) in values {
                    out.entry(tag.clone()).or_default().push((e.step, *x));
                }
            }
            _ => {}
        }
    }
    out
}
