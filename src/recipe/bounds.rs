//! Bounds on a recipe's numbers and paths that need no model: every count is bounded by what
//! it can mean before it sizes anything, and the output directory is usable before any
//! weight is read. The bounds that need the model or the data (lora.rank against the
//! linears, max_steps against the epochs of the data) are train::run_check's.

use super::{Recipe, RecipeError, Resume, TrainFiles};
use std::path::Path;

/// lora.rank, as `plan --rank` and `bench --rank` take it.
pub(crate) const MAX_RANK: usize = 65536;
/// data.seq_len, as `plan --seq` takes it.
pub(crate) const MAX_SEQ_LEN: usize = 1 << 22;
/// train.micro_batch, as `plan --micro-batch` takes it.
pub(crate) const MAX_MICRO_BATCH: usize = 4096;
pub(crate) const MAX_GRAD_ACCUM: usize = 65536;
/// Optimiser steps of one run (a run of 10⁹ steps at 1 ms a step takes 11 days).
pub(crate) const MAX_STEPS: usize = 1_000_000_000;
/// Passes over the data.
pub(crate) const MAX_EPOCHS: usize = 1_000_000;
/// parallel.timeout_s: a year.
pub(crate) const MAX_TIMEOUT_S: u64 = 365 * 24 * 3600;
/// Ranks of one run, as `plan --gpus` takes them.
pub(crate) const MAX_RANKS: usize = 4096;
pub(crate) const MAX_ORDINAL: usize = 65535;

/// Paths written as "" (before relative paths are resolved, which would turn "" into the
/// recipe's own directory).
pub(super) fn empty_paths(r: &Recipe) -> Result<(), RecipeError> {
    let empty = |p: &Path| p.as_os_str().is_empty();
    let mut found = Vec::new();
    if r.model.path.as_deref().is_some_and(empty) {
        found.push("model.path");
    }
    if r.lora.init_adapter.as_deref().is_some_and(empty) {
        found.push("lora.init_adapter");
    }
    let train_empty = match &r.data.train {
        TrainFiles::One(p) => empty(p),
        TrainFiles::Mix(v) => v.iter().any(|f| empty(&f.path)),
    };
    if train_empty {
        found.push("data.train");
    }
    if r.data.eval.as_deref().is_some_and(empty) {
        found.push("data.eval");
    }
    if r.data.chat_template.as_deref() == Some("") {
        found.push("data.chat_template");
    }
    if matches!(&r.train.resume, Resume::Path(p) if empty(p)) {
        found.push("train.resume");
    }
    if r.output.dir.as_deref().is_some_and(empty) {
        found.push("output.dir");
    }
    match found.first() {
        None => Ok(()),
        Some(&"output.dir") => Err(r.invalid(
            "output.dir",
            "is empty: name a directory, or leave it unset for adapters/<recipe name>",
        )),
        Some(key) => Err(r.invalid(key, "is empty: name a path, or leave the key out")),
    }
}

/// The numbers' bounds and the output directory; the last of `Recipe::validate`.
pub(super) fn check(r: &Recipe) -> Result<(), RecipeError> {
    let t = &r.train;
    let counts = [
        ("lora.rank", r.lora.rank, MAX_RANK),
        ("data.seq_len", r.data.seq_len, MAX_SEQ_LEN),
        ("train.micro_batch", t.micro_batch, MAX_MICRO_BATCH),
        ("train.grad_accum", t.grad_accum, MAX_GRAD_ACCUM),
        ("train.max_steps", t.max_steps.unwrap_or(0), MAX_STEPS),
        ("train.epochs", t.epochs.unwrap_or(0), MAX_EPOCHS),
        ("train.warmup_steps", t.warmup_steps, MAX_STEPS),
        ("parallel.devices", r.parallel.devices.len(), MAX_RANKS),
    ];
    for (key, v, max) in counts {
        if v > max {
            let what = match key {
                "parallel.devices" => format!("lists {v} devices"),
                _ => format!("= {v}"),
            };
            return Err(r.invalid(
                key,
                format!("{what} is more than it can mean: at most {max}"),
            ));
        }
    }
    if let Some(d) = r.parallel.devices.iter().find(|&&d| d > MAX_ORDINAL) {
        return Err(r.invalid(
            "parallel.devices",
            format!("lists device {d}: ordinals are at most {MAX_ORDINAL}"),
        ));
    }
    if r.parallel.timeout_s > MAX_TIMEOUT_S {
        return Err(r.invalid(
            "parallel.timeout_s",
            format!(
                "= {} is more than a year: at most {MAX_TIMEOUT_S} (seconds)",
                r.parallel.timeout_s
            ),
        ));
    }
    output_dir(r)
}

/// The output directory is a directory, or can be made one: not an existing file, and not
/// under one.
fn output_dir(r: &Recipe) -> Result<(), RecipeError> {
    let dir = r.output_dir();
    let key = "output.dir";
    let shown = dir.display();
    if dir.exists() && !dir.is_dir() {
        return Err(r.invalid(
            key,
            format!("{shown} is an existing file, not a directory: name a directory"),
        ));
    }
    let mut up = dir.parent();
    while let Some(p) = up {
        if p.as_os_str().is_empty() {
            break;
        }
        if p.exists() {
            if !p.is_dir() {
                return Err(r.invalid(
                    key,
                    format!("{shown} cannot be created: {} is a file", p.display()),
                ));
            }
            break;
        }
        up = p.parent();
    }
    Ok(())
}
