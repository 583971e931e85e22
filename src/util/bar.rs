//! The progress of long work (downloads, tokenizing, the reference pass, the steps): one look
//! for the bars (`=> ` filling, a template of the caller's), drawn on stderr when it is a
//! terminal and hidden otherwise; and, for work whose log gets lines instead (`Shown`), when
//! the next line is due.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How often a log (not a terminal) gets a progress line.
pub(crate) const LINE_EVERY: Duration = Duration::from_secs(30);

/// A bar of `len` units (None: unknown) with indicatif's `template`, drawn on stderr when it
/// is a terminal, else hidden. A template indicatif refuses falls back to its default bar.
pub(crate) fn stderr_bar(len: Option<u64>, template: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::with_draw_target(len, ProgressDrawTarget::hidden());
    }
    let bar = ProgressBar::with_draw_target(len, ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(template)
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// Long work's display: a bar on a terminal, else a line (the caller's) at most every
/// [`LINE_EVERY`]; nothing when not shown (tests, tools).
pub(crate) struct Shown {
    /// The bar, on a terminal.
    pub(crate) bar: Option<ProgressBar>,
    /// Lines instead (shown, stderr not a terminal).
    lines: bool,
    /// When the work began.
    pub(crate) t0: Instant,
    /// When the last line was due.
    last: Instant,
}

impl Shown {
    /// The display of work of `len` units with the bar's `template`, when `show`.
    pub(crate) fn new(len: u64, template: &str, show: bool) -> Shown {
        let term = std::io::stderr().is_terminal();
        let now = Instant::now();
        Shown {
            bar: (show && term).then(|| stderr_bar(Some(len), template)),
            lines: show && !term,
            t0: now,
            last: now,
        }
    }

    /// Whether a line is due now (lines are shown and [`LINE_EVERY`] has passed since the
    /// last): true once per period.
    pub(crate) fn line_due(&mut self) -> bool {
        let due = self.lines && self.last.elapsed() >= LINE_EVERY;
        if due {
            self.last = Instant::now();
        }
        due
    }

    /// Clears the bar.
    pub(crate) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
