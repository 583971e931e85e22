//! `lora-train report DIR`: a run's curves from its metrics.jsonl as one SVG (loss and eval
//! loss, learning rate, tokens/s, peak memory per phase), and a short summary: steps, tokens,
//! time, final loss, best eval loss with its step, peak memory per rank.
//!
//! metrics.jsonl rows (train::Session::train_from) carry step, loss, lr, grad_norm, tokens
//! (cumulative), tok_per_s, elapsed_s (since this session started: a resumed run starts again
//! from 0), and optionally eval_loss and mem {rank, load_gib, forward_gib, head_gib,
//! backward_gib, optimizer_gib}. A line that is not such a row (a truncated last line of a run
//! that was killed, a hand edit) is skipped and counted, never fatal.

pub mod plot;

use anyhow::{Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The memory phases a row may report, in step order.
pub(crate) const PHASES: [&str; 5] = ["load", "forward", "head", "backward", "optimizer"];

/// One step's row.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub(crate) struct Row {
    pub(crate) step: usize,
    pub(crate) loss: Option<f64>,
    pub(crate) lr: Option<f64>,
    pub(crate) grad_norm: Option<f64>,
    pub(crate) tokens: Option<u64>,
    pub(crate) tok_per_s: Option<f64>,
    pub(crate) elapsed_s: Option<f64>,
    pub(crate) eval_loss: Option<f64>,
    pub(crate) mem: Option<Mem>,
}

/// A row's device-pool peaks (GiB) per phase since the previous row.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub(crate) struct Mem {
    #[serde(default)]
    pub(crate) rank: usize,
    pub(crate) load_gib: Option<f64>,
    pub(crate) forward_gib: Option<f64>,
    pub(crate) head_gib: Option<f64>,
    pub(crate) backward_gib: Option<f64>,
    pub(crate) optimizer_gib: Option<f64>,
}

impl Mem {
    /// (phase, GiB) for the phases the row has, in `PHASES` order.
    pub(crate) fn phases(&self) -> Vec<(&'static str, f64)> {
        let v = [
            self.load_gib,
            self.forward_gib,
            self.head_gib,
            self.backward_gib,
            self.optimizer_gib,
        ];
        PHASES
            .iter()
            .zip(v)
            .filter_map(|(p, g)| g.filter(|g| g.is_finite()).map(|g| (*p, g)))
            .collect()
    }
}

/// A metrics.jsonl as read.
#[derive(Debug, Clone, Default)]
pub(crate) struct Metrics {
    pub(crate) rows: Vec<Row>,
    /// Lines that were not rows (blank lines are not counted).
    pub(crate) bad_lines: usize,
    /// The first of them (1-based).
    pub(crate) first_bad: Option<usize>,
}

impl Metrics {
    /// Parses the text of a metrics.jsonl.
    pub(crate) fn parse(text: &str) -> Metrics {
        let mut m = Metrics::default();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<Row>(line) {
                Ok(r) => m.rows.push(r),
                Err(_) => {
                    m.bad_lines += 1;
                    m.first_bad.get_or_insert(i + 1);
                }
            }
        }
        m
    }

    pub(crate) fn read(path: &Path) -> Result<Metrics> {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        // A run killed mid-write may leave a partial UTF-8 sequence: that line is then bad.
        Ok(Self::parse(&String::from_utf8_lossy(&bytes)))
    }
}

/// What `report` prints.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The last row's step.
    pub steps: usize,
    /// Metrics rows read.
    pub rows: usize,
    /// Tokens trained on (the last row's count).
    pub tokens: Option<u64>,
    /// Wall time over every session of the run (resumes add up).
    pub elapsed_s: f64,
    /// The first row's training loss.
    pub first_loss: Option<f64>,
    /// The last row's training loss.
    pub final_loss: Option<f64>,
    /// (eval loss, step) of the lowest eval loss.
    pub best_eval: Option<(f64, usize)>,
    pub(crate) last_eval: Option<(f64, usize)>,
    /// Per rank: the highest peak (GiB) and its phase.
    pub peak_mem: BTreeMap<usize, (f64, &'static str)>,
    /// Lines of metrics.jsonl that are not a metrics row (skipped).
    pub bad_lines: usize,
    /// The first of them: its line number, 1-based.
    pub first_bad: Option<usize>,
}

pub(crate) fn summarize(m: &Metrics) -> Summary {
    let finite = |x: Option<f64>| x.filter(|v| v.is_finite());
    let mut elapsed = 0.0;
    let mut session_end = 0.0f64;
    let mut best_eval: Option<(f64, usize)> = None;
    let mut last_eval = None;
    let mut peak_mem: BTreeMap<usize, (f64, &'static str)> = BTreeMap::new();
    for r in &m.rows {
        if let Some(e) = finite(r.elapsed_s) {
            if e < session_end {
                elapsed += session_end; // a resumed session's clock starts again
            }
            session_end = e;
        }
        if let Some(e) = finite(r.eval_loss) {
            last_eval = Some((e, r.step));
            if best_eval.is_none_or(|(b, _)| e < b) {
                best_eval = Some((e, r.step));
            }
        }
        if let Some(mem) = &r.mem {
            for (phase, g) in mem.phases() {
                let e = peak_mem.entry(mem.rank).or_insert((g, phase));
                if g > e.0 {
                    *e = (g, phase);
                }
            }
        }
    }
    Summary {
        steps: m.rows.last().map_or(0, |r| r.step),
        rows: m.rows.len(),
        tokens: m.rows.iter().rev().find_map(|r| r.tokens),
        elapsed_s: elapsed + session_end,
        first_loss: m.rows.iter().find_map(|r| finite(r.loss)),
        final_loss: m.rows.iter().rev().find_map(|r| finite(r.loss)),
        best_eval,
        last_eval,
        peak_mem,
        bad_lines: m.bad_lines,
        first_bad: m.first_bad,
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let t = self.elapsed_s;
        write!(f, "{} steps ({} rows)", self.steps, self.rows)?;
        if let Some(n) = self.tokens {
            write!(f, ", {} tokens", human(n as f64))?;
        }
        write!(f, " in {}", duration(t))?;
        if let (Some(n), true) = (self.tokens, t > 0.0) {
            write!(f, " ({:.0} tok/s)", n as f64 / t)?;
        }
        writeln!(f)?;
        match (self.first_loss, self.final_loss) {
            (Some(a), Some(b)) => writeln!(f, "loss {a:.4} -> {b:.4} (final)")?,
            _ => writeln!(f, "loss: no finite value")?,
        }
        match (self.best_eval, self.last_eval) {
            (Some((b, s)), Some((l, ls))) => writeln!(
                f,
                "best eval loss {b:.4} at step {s} (last {l:.4} at step {ls})"
            )?,
            _ => writeln!(f, "eval loss: none")?,
        }
        if self.peak_mem.is_empty() {
            writeln!(f, "peak memory: not recorded (CPU run)")?;
        }
        for (rank, (g, phase)) in &self.peak_mem {
            writeln!(f, "peak memory rank {rank}: {g:.2} GiB ({phase})")?;
        }
        if self.bad_lines > 0 {
            writeln!(
                f,
                "skipped {} line(s) that are not metrics rows (first: line {})",
                self.bad_lines,
                self.first_bad.unwrap_or(0)
            )?;
        }
        Ok(())
    }
}

fn human(n: f64) -> String {
    match n {
        n if n >= 1e9 => format!("{:.2}G", n / 1e9),
        n if n >= 1e6 => format!("{:.2}M", n / 1e6),
        n if n >= 1e4 => format!("{:.1}k", n / 1e3),
        n => format!("{n:.0}"),
    }
}

fn duration(s: f64) -> String {
    let s = s.max(0.0);
    match s {
        s if s >= 3600.0 => format!(
            "{}h {:02}m",
            (s / 3600.0) as u64,
            ((s % 3600.0) / 60.0) as u64
        ),
        s if s >= 60.0 => format!("{}m {:02}s", (s / 60.0) as u64, (s % 60.0) as u64),
        s => format!("{s:.1}s"),
    }
}

/// Reads `dir`/metrics.jsonl, writes the picture to `out` (default `dir`/report.svg)
/// atomically, and returns the summary and the picture's path.
pub fn report(dir: &Path, out: Option<&Path>) -> Result<(Summary, PathBuf)> {
    let path = dir.join("metrics.jsonl");
    if !path.is_file() {
        anyhow::bail!(
            "{} does not exist: is {} the output directory of a run (output.dir)?",
            path.display(),
            dir.display()
        );
    }
    let m = Metrics::read(&path)?;
    let out = out.map_or_else(|| dir.join("report.svg"), Path::to_path_buf);
    let svg = plot::svg(&m, &dir.display().to_string())?;
    crate::util::atomic_write(&out, svg.as_bytes())?;
    Ok((summarize(&m), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resumed_clocks_add_up_and_bad_lines_are_counted() {
        let text = "{\"step\":1,\"loss\":2.0,\"elapsed_s\":10.0,\"tokens\":100}\n\
                    not json\n\n\
                    {\"step\":2,\"loss\":1.5,\"elapsed_s\":20.0,\"tokens\":200,\"eval_loss\":1.8}\n\
                    {\"step\":3,\"loss\":1.0,\"elapsed_s\":5.0,\"tokens\":300,\"eval_loss\":1.9,\
                     \"mem\":{\"rank\":0,\"forward_gib\":3.0,\"backward_gib\":4.5}}\n\
                    {\"step\":4,\"loss\":";
        let m = Metrics::parse(text);
        assert_eq!((m.rows.len(), m.bad_lines, m.first_bad), (3, 2, Some(2)));
        let s = summarize(&m);
        assert_eq!(s.steps, 3);
        assert_eq!(s.elapsed_s, 25.0);
        assert_eq!(s.tokens, Some(300));
        assert_eq!(s.best_eval, Some((1.8, 2)));
        assert_eq!(s.peak_mem[&0], (4.5, "backward"));
        let text = s.to_string();
        assert!(text.contains("skipped 2 line(s)"), "{text}");
        assert!(text.contains("best eval loss 1.8000 at step 2"), "{text}");
    }
}
