//! The progress bars of long work (downloads, tokenizing, the reference pass, the steps): one
//! look (`=> ` filling, a template of the caller's), drawn on stderr when it is a terminal and
//! hidden otherwise (a log gets the callers' own lines instead).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

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
