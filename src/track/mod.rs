//! Trackers: what a run reports as it goes to the tools users watch (`train.report_to`).
//! TensorBoard event files under `<output.dir>/runs/` (`tensorboard`, over `event` and
//! `tfrecord`), and an MLflow tracking server over its REST API (`mlflow`).
//!
//! A tracker takes (tag, value, step) scalars, whatever a metrics row carries (`Scalars::of`
//! names them), so a new metric needs no code here. Trackers run on a thread of their own: the
//! training thread only queues a row; the thread writes and flushes what is queued, once per
//! batch of rows. A tracker that fails says so once and is dropped: training goes on.

pub mod event;
pub(crate) mod mlflow;
pub mod tensorboard;
pub mod tfrecord;

use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) use crate::recipe::Tracker;

/// One logged step's scalars: (tag, value) at `step`, written at `wall` (Unix seconds).
#[derive(Debug, Clone, PartialEq)]
pub struct Scalars {
    /// The training step (metrics.jsonl's `step`).
    pub step: u64,
    /// Seconds since the Unix epoch when the row was made.
    pub wall: f64,
    /// (tag, value) pairs, tags as `tag_of` names the row's keys.
    pub values: Vec<(String, f64)>,
}

impl Scalars {
    /// A metrics.jsonl row as scalars: every number (and bool, as 0 / 1) the row carries, its
    /// key named by `tag_of`; a nested object's numbers as `<object>/<key>`. Nulls (a
    /// non-finite value in metrics.jsonl), strings and lists are left out. None without a step.
    pub fn of(row: &serde_json::Value, wall: f64) -> Option<Scalars> {
        let step = row.get("step")?.as_u64()?;
        let mut values = Vec::new();
        for (k, v) in row.as_object()? {
            match v {
                _ if k == "step" => {}
                serde_json::Value::Object(inner) => {
                    for (k2, v2) in inner {
                        if let Some(x) = number(v2) {
                            values.push((format!("{k}/{k2}"), x));
                        }
                    }
                }
                _ => {
                    if let Some(x) = number(v) {
                        values.push((tag_of(k), x));
                    }
                }
            }
        }
        Some(Scalars { step, wall, values })
    }
}

fn number(v: &serde_json::Value) -> Option<f64> {
    match v {
        serde_json::Value::Number(n) => n.as_f64(),
        serde_json::Value::Bool(b) => Some(*b as u8 as f64),
        _ => None,
    }
}

/// A metrics.jsonl key as a tracker's tag, as transformers' trackers name the same values:
/// `lr` → `train/learning_rate`; `eval_<x>` → `eval/<x>`; a key that has a `/` already (an
/// objective's `rewards/chosen`) as it is; any other → `train/<key>` (`loss` → `train/loss`).
pub(crate) fn tag_of(key: &str) -> String {
    match key {
        "lr" => "train/learning_rate".into(),
        _ if key.contains('/') => key.into(),
        _ => match key.strip_prefix("eval_") {
            Some(rest) => format!("eval/{rest}"),
            None => format!("train/{key}"),
        },
    }
}

/// The resolved recipe as flat (dotted key, text) pairs: MLflow's params. Lists as their JSON
/// text; unset (null) fields left out.
pub fn params_of(recipe: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
        let text = match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    let key = match prefix.is_empty() {
                        true => k.clone(),
                        false => format!("{prefix}.{k}"),
                    };
                    walk(&key, v, out);
                }
                return;
            }
            serde_json::Value::Null => return,
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        out.push((prefix.to_string(), text));
    }
    let mut out = Vec::new();
    walk("", recipe, &mut out);
    out
}

/// How a run ended, for trackers that record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Every step ran and the adapter was written.
    Finished,
    /// An error or an interrupt stopped the run (a resume sets it running again).
    Failed,
}

/// What the trackers need to start.
pub(crate) struct Start {
    /// The run's output directory (`runs/` beneath it holds what trackers write).
    pub(crate) out_dir: PathBuf,
    /// The run's name (the output directory's name).
    pub(crate) run_name: String,
    /// The resolved recipe, serialized: MLflow's params.
    pub(crate) recipe: serde_json::Value,
    /// The checkpoint step a resumed run continues from; None for a fresh run.
    pub(crate) resumed_at: Option<u64>,
    /// Prints a line for the user (beside the progress bar).
    pub(crate) say: Arc<dyn Fn(&str) + Send + Sync>,
}

/// A tracker opened by the worker thread.
trait Sink: Send {
    /// Records `rows` (in step order) and flushes them.
    fn rows(&mut self, rows: &[Scalars]) -> anyhow::Result<()>;
    /// The run ended with `status`: last writes.
    fn end(&mut self, status: Status) -> anyhow::Result<()>;
}

enum Msg {
    Row(Scalars),
    End(Status),
}

/// The run's trackers: a thread that owns them and the queue of rows it writes.
pub(crate) struct Trackers {
    tx: mpsc::Sender<Msg>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl Trackers {
    /// Starts the trackers `kinds` names on a thread of their own; None when it names none.
    /// A tracker that cannot start warns and is left out.
    pub(crate) fn start(kinds: &[Tracker], start: Start) -> Option<Trackers> {
        if kinds.is_empty() {
            return None;
        }
        let kinds = kinds.to_vec();
        let (tx, rx) = mpsc::channel();
        let say = start.say.clone();
        let worker = std::thread::Builder::new()
            .name("trackers".into())
            .spawn(move || work(&kinds, &start, rx));
        match worker {
            Ok(w) => Some(Trackers {
                tx,
                worker: Some(w),
            }),
            Err(e) => {
                say(&format!(
                    "warning: trackers off: cannot start their thread: {e}"
                ));
                None
            }
        }
    }

    /// Queues a metrics.jsonl row (`Scalars::of`), stamped with the time now.
    pub(crate) fn row(&self, row: &serde_json::Value) {
        if let Some(s) = Scalars::of(row, now()) {
            self.log(s);
        }
    }

    /// Queues scalars as they are.
    pub(crate) fn log(&self, s: Scalars) {
        // A send fails only once the worker is gone (it has ended): nothing left to write to.
        let _ = self.tx.send(Msg::Row(s));
    }

    /// Writes what is queued, records `status` and waits for the thread.
    pub(crate) fn finish(&mut self, status: Status) {
        let _ = self.tx.send(Msg::End(status));
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Drop for Trackers {
    /// Dropped without `finish`: the run stopped early.
    fn drop(&mut self) {
        if self.worker.is_some() {
            self.finish(Status::Failed);
        }
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The worker: opens the sinks, then writes each batch of queued rows until the run ends.
fn work(kinds: &[Tracker], start: &Start, rx: mpsc::Receiver<Msg>) {
    let say = &start.say;
    let mut sinks: Vec<(Tracker, Box<dyn Sink>)> = Vec::new();
    for &k in kinds {
        let opened: anyhow::Result<Box<dyn Sink>> = match k {
            Tracker::Tensorboard => tensorboard::TensorBoard::open(start).map(|s| Box::new(s) as _),
            Tracker::Mlflow => mlflow::Mlflow::open(start).map(|s| Box::new(s) as _),
        };
        match opened {
            Ok(s) => sinks.push((k, s)),
            Err(e) => say(&format!("warning: {}: off for this run: {e:#}", k.name())),
        }
    }
    let mut status = Status::Failed;
    while let Ok(first) = rx.recv() {
        let mut rows = Vec::new();
        let mut ended = false;
        for m in std::iter::once(first).chain(rx.try_iter()) {
            match m {
                Msg::Row(r) => rows.push(r),
                Msg::End(s) => {
                    status = s;
                    ended = true;
                }
            }
        }
        sinks.retain_mut(|(k, s)| match s.rows(&rows) {
            Ok(()) => true,
            Err(e) => {
                say(&format!(
                    "warning: {}: off for the rest of the run: {e:#}",
                    k.name()
                ));
                false
            }
        });
        if ended {
            break;
        }
    }
    for (k, s) in &mut sinks {
        if let Err(e) = s.end(status) {
            say(&format!("warning: {}: {e:#}", k.name()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_become_tagged_scalars() {
        let row = serde_json::json!({
            "step": 7, "epoch": 0, "loss": 2.5, "lr": 1e-4, "grad_norm": null,
            "skipped": true, "eval_loss": 2.25, "rewards/chosen": -0.5,
            "mem": {"rank": 0, "forward_gib": 1.5}, "note": "x", "list": [1],
        });
        let s = Scalars::of(&row, 1.0).unwrap();
        assert_eq!(s.step, 7);
        let mut got = s.values;
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let want = [
            ("eval/loss", 2.25),
            ("mem/forward_gib", 1.5),
            ("mem/rank", 0.0),
            ("rewards/chosen", -0.5),
            ("train/epoch", 0.0),
            ("train/learning_rate", 1e-4),
            ("train/loss", 2.5),
            ("train/skipped", 1.0),
        ];
        let want: Vec<(String, f64)> = want.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        assert_eq!(got, want);
        assert!(Scalars::of(&serde_json::json!({"loss": 1.0}), 0.0).is_none());
    }

    #[test]
    fn params_are_the_recipe_flattened() {
        let r = serde_json::json!({
            "train": {"lr": 0.0002, "betas": [0.9, 0.999], "max_steps": null, "resume": false},
            "model": {"path": "assets/tiny"},
        });
        let want = [
            ("model.path", "assets/tiny"),
            ("train.betas", "[0.9,0.999]"),
            ("train.lr", "0.0002"),
            ("train.resume", "false"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(params_of(&r), want);
    }
}
