//! A download's progress: a bar on a terminal, one line per file otherwise.

use indicatif::{HumanBytes, ProgressBar};
use std::time::Instant;

/// Progress of one file: a bar (bytes, rate, ETA) when stderr is a terminal, else one line
/// when the file is done.
pub(super) struct FileBar {
    bar: ProgressBar,
    file: String,
    t0: Instant,
}

impl FileBar {
    pub(super) fn new(file: &str, size: Option<u64>, have: u64) -> FileBar {
        let bar = crate::util::bar::stderr_bar(
            size,
            "{msg:34!} [{bar:25}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
        );
        bar.set_message(file.to_string());
        bar.set_position(have);
        bar.reset_eta();
        FileBar {
            bar,
            file: file.to_string(),
            t0: Instant::now(),
        }
    }

    pub(super) fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    pub(super) fn set_position(&self, p: u64) {
        self.bar.set_position(p);
    }

    pub(super) fn note(&self, msg: &str) {
        if self.bar.is_hidden() {
            crate::errln!("{msg}");
        } else {
            self.bar.println(msg);
        }
    }

    pub(super) fn abandon(&self) {
        self.bar.abandon();
    }

    pub(super) fn finish(&self, fetched: u64) {
        let secs = self.t0.elapsed().as_secs_f64();
        if self.bar.is_hidden() {
            crate::errln!(
                "downloaded {} ({} in {secs:.1}s, {}/s)",
                self.file,
                HumanBytes(fetched),
                HumanBytes((fetched as f64 / secs.max(1e-3)) as u64)
            );
        } else {
            self.bar.finish();
        }
    }
}
