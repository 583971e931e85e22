//! What a run shows and records as it goes: the progress bar (step, loss, lr, tok/s, memory,
//! ETA; plain lines when stderr is not a terminal) and metrics.jsonl in the output directory,
//! each row also handed to the trackers `train.report_to` names (crate::track). Only rank 0
//! writes; the other ranks' `Log` is silent.

use super::checkpoint::{self, Checkpoint};
use crate::train::meter::{GIB, PHASES};
use crate::train::session::Session;
use crate::train::step::Done;
use crate::util::atomic_write;
use anyhow::{Context, Result};
use indicatif::ProgressBar;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

pub(crate) struct Log {
    bar: ProgressBar,
    metrics: Option<std::fs::File>,
    rank: usize,
    load_peak: Option<u64>,
    /// Phase peaks of the steps since the last row.
    peaks: BTreeMap<&'static str, u64>,
    start: Instant,
    /// Tokens of the steps this process ran (tok/s counts them only).
    session_tokens: usize,
    /// Seconds from the run's start to its first step (the first row carries them).
    startup_s: Option<f64>,
    /// `train.report_to`'s trackers (rank 0; None when it names none).
    trackers: Option<crate::track::Trackers>,
}

/// One logged step's figures beyond `Done`.
pub(crate) struct Row {
    pub(crate) step: usize,
    pub(crate) epoch: usize,
    pub(crate) lr: f64,
    pub(crate) tokens: usize,
    pub(crate) eval: Option<(f64, usize)>,
    pub(crate) skipped: usize,
}

impl Log {
    /// Rank 0: the output directory prepared (`open_outputs`) and the bar at `step` of
    /// `total`. Other ranks: nothing shown or written.
    pub(crate) fn open(
        s: &Session,
        out_dir: &Path,
        resume: Option<&Checkpoint>,
        total: usize,
        step: usize,
    ) -> Result<Log> {
        let lead = s.comm.rank() == 0;
        let metrics = match lead {
            true => Some(open_outputs(s, out_dir, resume)?),
            false => None,
        };
        let bar = match lead {
            true => progress_bar(total as u64),
            false => ProgressBar::hidden(),
        };
        bar.set_position(step as u64);
        let trackers = match lead {
            true => start_trackers(s, out_dir, resume, &bar),
            false => None,
        };
        Ok(Log {
            bar,
            metrics,
            rank: s.memory.rank,
            load_peak: s.memory.load_peak,
            peaks: BTreeMap::new(),
            start: Instant::now(),
            session_tokens: 0,
            startup_s: Some(s.memory.load_s),
            trackers,
        })
    }

    /// A step finished: counts its tokens and peaks (every step, logged or not).
    pub(crate) fn count(&mut self, d: &Done) {
        self.session_tokens += d.tokens;
        for (&k, &v) in &d.peaks {
            let e = self.peaks.entry(k).or_insert(0);
            *e = (*e).max(v);
        }
    }

    /// Tokens per second of the steps this process ran, and the seconds since it started.
    pub(crate) fn rate(&self) -> (f64, f64) {
        let secs = self.start.elapsed().as_secs_f64();
        (self.session_tokens as f64 / secs.max(1e-9), secs)
    }

    pub(crate) fn session_tokens(&self) -> usize {
        self.session_tokens
    }

    /// Writes step `r.step`'s metrics row and the progress line.
    pub(crate) fn row(
        &mut self,
        d: &Done,
        r: &Row,
        truncated: usize,
        skipped_rows: usize,
    ) -> Result<()> {
        let (tok_s, secs) = self.rate();
        let loss = d.loss;
        let mut row = serde_json::json!({
            "step": r.step, "epoch": r.epoch, "loss": loss, "lr": r.lr,
            "grad_norm": d.grad_norm, "tokens": r.tokens, "target_tokens": d.denom,
            "tok_per_s": tok_s, "elapsed_s": secs, "skipped": !d.finite,
            "truncated": truncated, "skipped_rows": skipped_rows,
        });
        if let Some(t) = self.startup_s.take() {
            row["load_s"] = t.into();
        }
        let mut msg = format!("loss {loss:.4}  ");
        // A preference objective's metrics, under TRL's names; the bar shows the margin and
        // accuracy (ORPO: its NLL too).
        for &(name, v) in &d.metrics {
            row[name] = v.into();
        }
        for (name, short) in [
            ("rewards/margins", "margin"),
            ("rewards/accuracies", "acc"),
            ("nll_loss", "nll"),
        ] {
            if let Some(&(_, v)) = d.metrics.iter().find(|m| m.0 == name) {
                msg.push_str(&format!("{short} {v:.4}  "));
            }
        }
        // Per-phase peaks of the device pool since the last row (CUDA only).
        let peaks = std::mem::take(&mut self.peaks);
        if !peaks.is_empty() {
            // 1e-4 GiB (~0.1 MiB) resolution: small models are not rounded to 0.
            let g = |x: u64| (x as f64 / GIB * 1e4).round() / 1e4;
            let mut mem = serde_json::json!({ "rank": self.rank });
            if let Some(l) = self.load_peak {
                mem["load_gib"] = g(l).into();
            }
            let mut short = Vec::new();
            for phase in PHASES {
                if let Some(v) = peaks.get(phase) {
                    mem[format!("{phase}_gib")] = g(*v).into();
                    short.push(format!("{} {:.1}", &phase[..3], g(*v)));
                }
            }
            row["mem"] = mem;
            msg.push_str(&format!("peak GiB {}  ", short.join(" ")));
        }
        if let Some((l, n)) = r.eval {
            row["eval_loss"] = l.into();
            row["eval_tokens"] = n.into();
            msg.push_str(&format!("eval {l:.4}  "));
        }
        if let Some(m) = self.metrics.as_mut() {
            writeln!(m, "{row}").context("cannot write metrics.jsonl")?;
        }
        if let Some(t) = &self.trackers {
            t.row(&row);
        }
        let mut msg = format!("{msg}lr {:.2e}  {tok_s:.0} tok/s", r.lr);
        if !d.finite {
            msg.push_str(&format!(
                "  (non-finite: update skipped, {} so far)",
                r.skipped
            ));
        }
        if self.metrics.is_some() && self.bar.is_hidden() {
            crate::errln!("step {}/{}  {msg}", r.step, self.bar.length().unwrap_or(0));
        }
        self.bar.set_message(msg);
        Ok(())
    }

    /// A line above the bar (or on stderr when the bar is hidden), on rank 0 only.
    pub(crate) fn say(&self, line: &str) {
        if self.metrics.is_none() {
            return;
        }
        match self.bar.is_hidden() {
            true => crate::errln!("{line}"),
            false => self.bar.println(line),
        }
    }

    /// The bar moves on by one step.
    pub(crate) fn inc(&self) {
        self.bar.inc(1);
    }

    /// The run ended well: the trackers write what is queued and record it finished. (A `Log`
    /// dropped without this records the run failed.)
    pub(crate) fn finish(&mut self) {
        if let Some(t) = self.trackers.as_mut() {
            t.finish(crate::track::Status::Finished);
        }
    }
}

/// `train.report_to`'s trackers for this run, their lines printed above the bar.
fn start_trackers(
    s: &Session,
    out_dir: &Path,
    resume: Option<&Checkpoint>,
    bar: &ProgressBar,
) -> Option<crate::track::Trackers> {
    let bar = bar.clone();
    let start = crate::track::Start {
        out_dir: out_dir.to_owned(),
        run_name: out_dir
            .file_name()
            .map_or("lora-train".into(), |n| n.to_string_lossy().into_owned()),
        recipe: serde_json::to_value(&s.run.recipe).unwrap_or_default(),
        resumed_at: resume.map(|ck| ck.state.step as u64),
        say: std::sync::Arc::new(
            move |line: &str| match bar.is_hidden() || bar.is_finished() {
                true => crate::errln!("{line}"),
                false => bar.println(line),
            },
        ),
    };
    crate::track::Trackers::start(&s.run.hooks.report_to, start)
}

impl Drop for Log {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

fn progress_bar(total: u64) -> ProgressBar {
    crate::util::bar::stderr_bar(
        Some(total),
        "{spinner} step {pos}/{len} [{bar:30}] {msg}  ({elapsed} < {eta})",
    )
}

/// Rank 0 before the first step: creates `out_dir`, removes what an earlier run or an
/// interrupted save left there, writes the resolved recipe, and opens metrics.jsonl (a
/// resumed run keeps the rows up to its checkpoint and appends to them).
fn open_outputs(s: &Session, out_dir: &Path, resume: Option<&Checkpoint>) -> Result<std::fs::File> {
    let r = &s.run.recipe;
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let removed = checkpoint::clean(r, out_dir, resume.is_none())?;
    for names in [removed.outputs, removed.checkpoints] {
        if !names.is_empty() {
            crate::errln!(
                "removed {} of an earlier run from {}",
                names.join(", "),
                out_dir.display()
            );
        }
    }
    atomic_write(
        &out_dir.join("recipe.toml"),
        r.to_toml_in(out_dir)?.as_bytes(),
    )?;
    let upto = resume.map(|ck| ck.state.step);
    // samples.jsonl (train.sample_every) is appended to by the loop itself.
    let samples = out_dir.join("samples.jsonl");
    if s.run.hooks.sample_every > 0 || samples.is_file() {
        rows_upto(&samples, upto)?;
    }
    let metrics = out_dir.join("metrics.jsonl");
    rows_upto(&metrics, upto)?;
    std::fs::OpenOptions::new()
        .append(true)
        .open(&metrics)
        .with_context(|| format!("cannot open {}", metrics.display()))
}

/// A run's jsonl of per-step rows made ready for appending: a resumed run (`upto` = its
/// checkpoint's step) keeps the rows up to its checkpoint; a fresh one starts it empty.
fn rows_upto(path: &Path, upto: Option<usize>) -> Result<()> {
    let kept: String = match upto {
        Some(step) => std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                    .is_some_and(|s| s as usize <= step)
            })
            .map(|l| format!("{l}\n"))
            .collect(),
        None => String::new(),
    };
    atomic_write(path, kept.as_bytes())
}
