//! Progress of tokenizing a data set: a bar (bytes read of the files' total, MB/s, rows,
//! rows/s, ETA) when stderr is a terminal, otherwise a line every `util::bar::LINE_EVERY`;
//! and the line that says what it took.

use crate::util::bar::Shown;
use indicatif::DecimalBytes;

/// A preparation's progress display.
pub struct Progress {
    shown: Shown,
    total: u64,
}

impl Progress {
    /// Progress over `total` bytes of files; `show` false draws nothing (tests, tools).
    pub fn new(total: u64, show: bool) -> Progress {
        let template = "tokenizing [{bar:25}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} {msg} ETA {eta}";
        Progress {
            shown: Shown::new(total, template, show),
            total,
        }
    }

    /// `bytes` of the files read so far, `rows` rows done.
    pub fn update(&mut self, bytes: u64, rows: usize) {
        let secs = self.shown.t0.elapsed().as_secs_f64().max(1e-3);
        let rate = rows as f64 / secs;
        if let Some(bar) = &self.shown.bar {
            bar.set_position(bytes.min(self.total));
            bar.set_message(format!("{rows} rows, {rate:.0} rows/s"));
        } else if self.shown.line_due() {
            let frac = bytes as f64 / self.total.max(1) as f64;
            let eta = match frac > 0.0 {
                true => format!("{:.0}s", secs * (1.0 - frac).max(0.0) / frac),
                false => "?".into(),
            };
            crate::errln!(
                "tokenizing: {:.0}% of {}, {rows} rows ({rate:.0} rows/s, {}/s), ETA {eta}",
                100.0 * frac.min(1.0),
                DecimalBytes(self.total),
                DecimalBytes((bytes as f64 / secs) as u64)
            );
        }
    }

    /// Clears the bar.
    pub fn finish(&self) {
        self.shown.finish();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
