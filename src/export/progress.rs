//! A merged export's progress, shard by shard: a bar on a terminal, one line per shard written
//! otherwise (a 7B model's shards take seconds each; a log shows where the export is).

use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::Path;

/// Shards written so far, of `len`.
pub(crate) struct ShardBar {
    bar: ProgressBar,
}

impl ShardBar {
    /// A bar for `shards` shards.
    pub(crate) fn new(shards: usize) -> ShardBar {
        let bar = match std::io::stderr().is_terminal() {
            true => {
                let bar = ProgressBar::with_draw_target(
                    Some(shards as u64),
                    ProgressDrawTarget::stderr(),
                );
                let style =
                    ProgressStyle::with_template("export: shard {pos}/{len} [{bar:30}] {msg}")
                        .map(|s| s.progress_chars("=> "))
                        .unwrap_or_else(|_| ProgressStyle::default_bar());
                bar.set_style(style);
                bar
            }
            false => {
                ProgressBar::with_draw_target(Some(shards as u64), ProgressDrawTarget::hidden())
            }
        };
        ShardBar { bar }
    }

    /// Shard `path` (`bytes` of tensors) is written.
    pub(crate) fn written(&self, path: &Path, bytes: u64) {
        self.bar.inc(1);
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        match self.bar.is_hidden() {
            true => crate::errln!(
                "wrote {name} ({} of {}, {})",
                self.bar.position(),
                self.bar.length().unwrap_or(0),
                HumanBytes(bytes)
            ),
            false => self.bar.set_message(name.into_owned()),
        }
    }
}

impl Drop for ShardBar {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}
