//! Streaming start: a data set tokenized on a thread of its own, into its cache file (or an
//! unlinked temporary) as [`super::cache`] builds it, while the first epoch's steps read the
//! examples that have landed, in file order, from the file being written.
//!
//! The builder's output hands each finished chunk's records (start, tokens) to a [`Tap`]
//! after flushing them; a [`View`] waits for them and reads an example with pread. The file is
//! still written whole under a temporary name and renamed into place only when complete, so a
//! run killed mid-stream leaves nothing a later run trusts. Dropping the [`Stream`] before it
//! finished stops the build at its next chunk and joins the thread (the build's own threads end
//! as they do on any error).

use super::build::Counts;
use super::cache_file::read_example;
use super::{Dataset, Example};
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

/// What the builder and the readers share.
#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    /// The run no longer wants the data: the build stops at its next chunk.
    cancel: AtomicBool,
}

#[derive(Default)]
struct State {
    /// The file being written (a handle of its own, read with pread).
    file: Option<Arc<File>>,
    /// Every landed example's record: (start, tokens), in file order.
    records: Vec<(u64, u32)>,
    /// Examples cut to seq_len and bad rows skipped, over the rows read so far.
    truncated: usize,
    skipped: usize,
    /// None while building; then Ok, or the build's error.
    end: Option<std::result::Result<(), String>>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The builder's side: where the file's records are announced.
pub(super) struct Tap(Arc<Shared>);

/// The stream was dropped: the run ended before the data was prepared.
#[derive(Debug, thiserror::Error)]
#[error("the run ended before its data was prepared")]
pub(super) struct Cancelled;

impl Tap {
    /// The file the records are written to (a second handle on it).
    pub(super) fn open(&self, file: File) {
        self.0.state().file = Some(Arc::new(file));
    }

    /// Records written and flushed (drained from `records`), with the counts so far.
    pub(super) fn publish(&self, records: &mut Vec<(u64, u32)>, c: &Counts) -> Result<()> {
        if self.0.cancel.load(Ordering::Relaxed) {
            return Err(Cancelled.into());
        }
        let mut s = self.0.state();
        s.records.append(records);
        (s.truncated, s.skipped) = (c.truncated, c.skipped);
        drop(s);
        self.0.cv.notify_all();
        Ok(())
    }
}

/// A data set being prepared on its own thread; see the module docs.
pub struct Stream {
    view: View,
    handle: Option<JoinHandle<Result<Dataset>>>,
}

impl Stream {
    /// Runs `build` on a thread of its own; it announces the file's records on the tap it is
    /// given, and returns the finished data set. A panic in it is its error. `started`: when
    /// the preparation began (hashing the files included).
    pub(super) fn spawn(
        started: Instant,
        build: impl FnOnce(&Tap) -> Result<Dataset> + Send + 'static,
    ) -> Result<Stream> {
        let shared = Arc::new(Shared::default());
        let tap = Tap(shared.clone());
        let handle = std::thread::Builder::new()
            .name("data-stream".into())
            .spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| build(&tap));
                let res = std::panic::catch_unwind(run).unwrap_or_else(|p| {
                    bail!(
                        "the data preparation panicked: {}",
                        crate::util::panic_message(&*p)
                    )
                });
                // Every example must have been announced (the steps read no other way).
                let res = res.and_then(|d| {
                    let landed = tap.0.state().records.len();
                    match landed == d.examples.len() {
                        true => Ok(d),
                        false => bail!(
                            "the data preparation announced {landed} of its {} examples",
                            d.examples.len()
                        ),
                    }
                });
                tap.0.state().end = Some(res.as_ref().map(|_| ()).map_err(|e| format!("{e:#}")));
                tap.0.cv.notify_all();
                res
            })
            .context("cannot start the data preparation thread")?;
        Ok(Stream {
            view: View { shared, started },
            handle: Some(handle),
        })
    }

    /// The examples as they land.
    pub fn view(&self) -> View {
        self.view.clone()
    }

    /// Waits for the preparation to end: the data set, as a run that does not stream gets it
    /// (mapped from the finished cache file).
    pub fn finish(mut self) -> Result<Dataset> {
        let h = self
            .handle
            .take()
            .context("the data preparation was already waited for")?;
        h.join().unwrap_or_else(|p| {
            bail!(
                "the data preparation thread panicked: {}",
                crate::util::panic_message(&*p)
            )
        })
    }
}

impl Drop for Stream {
    /// Not finished: the build is told to stop, and its thread joined (it ends at its next
    /// chunk).
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            self.view.shared.cancel.store(true, Ordering::Relaxed);
            let _ = h.join();
        }
    }
}

/// A reader's side of a [`Stream`]: the examples landed so far, read where they lie.
#[derive(Clone)]
pub struct View {
    shared: Arc<Shared>,
    /// When the preparation started.
    pub started: Instant,
}

impl View {
    /// Waits until more than `have` examples have landed, or the preparation ended: (the
    /// examples landed, whether that is all). Err: the preparation failed (its error, naming
    /// the file and row).
    pub fn wait_past(&self, have: usize) -> Result<(usize, bool)> {
        let mut s = self.shared.state();
        loop {
            match &s.end {
                Some(Err(e)) => bail!("{e}"),
                Some(Ok(())) => return Ok((s.records.len(), true)),
                None if s.records.len() > have => return Ok((s.records.len(), false)),
                None => {}
            }
            s = self
                .shared
                .cv
                .wait(s)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Tokens of landed example `i`.
    pub fn len_of(&self, i: usize) -> Result<usize> {
        let s = self.shared.state();
        let (_, len) = s.records.get(i).context("an example that has not landed")?;
        Ok(*len as usize)
    }

    /// Landed example `i`, read from the file.
    pub fn example(&self, i: usize) -> Result<Example> {
        let (file, rec) = {
            let s = self.shared.state();
            (s.file.clone(), s.records.get(i).copied())
        };
        let (Some(file), Some((start, len))) = (file, rec) else {
            bail!("example {i} has not landed");
        };
        read_example(&file, start, len as usize)
            .with_context(|| format!("cannot read example {i} of the data being prepared"))
    }

    /// Examples cut to seq_len and bad rows skipped, over the rows tokenized so far.
    pub fn counts(&self) -> (usize, usize) {
        let s = self.shared.state();
        (s.truncated, s.skipped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_or_panicking_build_ends_every_wait_with_its_error() {
        let s = Stream::spawn(Instant::now(), |_| bail!("rows.jsonl:7: bad row")).unwrap();
        let e = s.view().wait_past(0).unwrap_err().to_string();
        assert!(e.contains("rows.jsonl:7"), "{e}");
        assert!(s.finish().is_err());
        let s = Stream::spawn(Instant::now(), |_| panic!("boom")).unwrap();
        let e = s.view().wait_past(0).unwrap_err().to_string();
        assert!(e.contains("panicked: boom"), "{e}");
    }

    #[test]
    fn a_dropped_stream_stops_its_build() {
        let (tx, rx) = std::sync::mpsc::channel();
        let s = Stream::spawn(Instant::now(), move |tap| {
            let mut c = 0u64;
            loop {
                let mut r = vec![(c, 0)];
                if let Err(e) = tap.publish(&mut r, &Counts::default()) {
                    let _ = tx.send(e.is::<Cancelled>());
                    return Err(e);
                }
                c += 1;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
        .unwrap();
        let (n, ended) = s.view().wait_past(3).unwrap();
        assert!(n > 3 && !ended);
        drop(s);
        assert!(rx.recv().unwrap(), "stopped by the cancel");
    }
}
