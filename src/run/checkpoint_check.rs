//! What a run may do with the checkpoints of its output directory, and what a checkpoint must
//! be before it is used.
//!
//! Nothing is deleted or overwritten on the strength of a checkpoint we could not read: a
//! checkpoint-<step>/ directory whose trainer state, adapter or optimiser file is missing,
//! unreadable or truncated (a half-copied checkpoint) stops `resume = true` when it is the
//! newest, stops a fresh start, and stops a resume that would save over it. A fresh start
//! removes only the checkpoints of a finished run (one whose final checkpoint is there,
//! with the same run identity). A checkpoint that is resumed has its trainer state checked
//! against the recipe and the data (step, cursor, update count, schedule, seed, data
//! fingerprint) and its optimiser file against the adapters (count, shapes, dtype, finite)
//! before anything is loaded from it. Each refusal is a RecipeError (exit 2) naming the file
//! and the field; nothing is written.

use super::checkpoint::{read_state, Checkpoint, TrainerState, OPTIMIZER, STATE};
use crate::export;
use crate::recipe::{Recipe, RecipeError};
use crate::train::session::Session;
use crate::train::train_data::TrainData;
use anyhow::Result;
use candle_core::{DType, Tensor, Var};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One checkpoint-<step>/ directory of an output directory.
#[derive(Debug)]
pub(crate) struct Found {
    pub(crate) step: usize,
    pub(crate) dir: PathBuf,
    /// Its trainer state, or why the checkpoint cannot be used (a file missing, unreadable or
    /// incomplete).
    pub(crate) state: std::result::Result<TrainerState, String>,
}

/// Every checkpoint-<step>/ directory of `out_dir` (complete or not), by step.
pub(crate) fn scan(out_dir: &Path) -> Vec<Found> {
    let mut v: Vec<Found> = std::fs::read_dir(out_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step: usize = name.strip_prefix("checkpoint-")?.parse().ok()?;
            let dir = e.path();
            dir.is_dir().then(|| Found {
                step,
                state: complete(&dir),
                dir,
            })
        })
        .collect();
    v.sort_by_key(|f| f.step);
    v
}

/// The trainer state of a checkpoint whose files are all there and complete.
pub(crate) fn complete(dir: &Path) -> std::result::Result<TrainerState, String> {
    let state = read_state(dir).map_err(|e| format!("{e:#}"))?;
    for f in [export::CONFIG, export::WEIGHTS, OPTIMIZER] {
        let p = dir.join(f);
        if !p.is_file() {
            return Err(format!("{} is missing", p.display()));
        }
    }
    for f in [export::WEIGHTS, OPTIMIZER] {
        crate::model::check::read_header(&dir.join(f)).map_err(|e| format!("{e:#}"))?;
    }
    Ok(state)
}

/// Whether two checkpoints are of one run: the same recipe fields that change the numbers,
/// the same steps, seed and data.
fn same_run(a: &TrainerState, b: &TrainerState) -> bool {
    a.recipe == b.recipe
        && a.total_steps == b.total_steps
        && a.seed == b.seed
        && (a.data_examples, a.data_tokens) == (b.data_examples, b.data_tokens)
        && a.data_fingerprint == b.data_fingerprint
}

/// The checkpoints of `found` that belong to a finished run: their run's last checkpoint
/// (step = total_steps) is there too.
fn finished(found: &[Found]) -> Vec<&Found> {
    let ends: Vec<&TrainerState> = found
        .iter()
        .filter_map(|f| f.state.as_ref().ok())
        .filter(|s| s.step == s.total_steps)
        .collect();
    found
        .iter()
        .filter(|f| {
            f.state
                .as_ref()
                .is_ok_and(|s| ends.iter().any(|e| same_run(s, e) && s.step <= e.step))
        })
        .collect()
}

/// What a fresh start may remove from `out_dir`: the checkpoints of finished runs.
pub(crate) fn removable(out_dir: &Path) -> Vec<PathBuf> {
    finished(&scan(out_dir))
        .into_iter()
        .map(|f| f.dir.clone())
        .collect()
}

fn refuse(r: &Recipe, msg: String) -> anyhow::Error {
    RecipeError::Invalid {
        path: r.source.clone(),
        key: "train.resume".into(),
        msg,
    }
    .into()
}

/// `resume = false`: every checkpoint in `out_dir` is readable and of a finished run, and a
/// finished run is there only with `output.overwrite` (its checkpoints and final outputs are
/// then removed when the run starts); else a RecipeError, and nothing is touched.
pub(crate) fn fresh_start(r: &Recipe, out_dir: &Path) -> Result<()> {
    let found = scan(out_dir);
    if let Some(f) = found.iter().find(|f| f.state.is_err()) {
        let why = f.state.as_ref().err().cloned().unwrap_or_default();
        return Err(refuse(
            r,
            format!(
                "= false, but {} holds {}, which cannot be read ({why}): a fresh start removes only the checkpoints of a finished run, so nothing was changed; remove that directory if you do not need it, or set output.dir to start elsewhere",
                out_dir.display(),
                f.dir.display()
            ),
        ));
    }
    let done: Vec<&Path> = finished(&found).iter().map(|f| f.dir.as_path()).collect();
    if let Some(f) = found
        .iter()
        .rev()
        .find(|f| !done.contains(&f.dir.as_path()))
    {
        let total = f.state.as_ref().map(|s| s.total_steps).unwrap_or(0);
        return Err(refuse(
            r,
            format!(
                "= false, but {} holds an unfinished run ({} is at step {} of {total}): continue \
                 it with --set train.resume=true, or remove that directory (or set output.dir) \
                 to start over",
                out_dir.display(),
                f.dir.display(),
                f.step
            ),
        ));
    }
    let earlier = earlier_outputs(r, out_dir)?;
    if r.output.overwrite || (earlier.is_empty() && done.is_empty()) {
        return Ok(());
    }
    let mut what: Vec<String> = earlier
        .iter()
        .map(PathBuf::as_path)
        .chain(done.iter().copied())
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    what.truncate(4);
    let dir = out_dir.display().to_string();
    Err(RecipeError::Invalid {
        path: r.source.clone(),
        key: "output.dir".into(),
        msg: format!(
            "= \"{dir}\" holds a finished run ({}): nothing was changed; train into another \
             directory with --set output.dir={}-2, or replace that run with --overwrite \
             (output.overwrite = true)",
            what.join(", "),
            dir.trim_end_matches('/')
        ),
    }
    .into())
}

/// The files a finished earlier run left in `out_dir` that a fresh run must not leave beside
/// its own (its final adapter, its merged model: `PeftModel.from_pretrained` on the directory
/// would load the old weights). They are ours when the directory holds the resolved recipe and
/// metrics.jsonl a run writes at its start; a final adapter is written only when a run has
/// finished. An adapter there without those is a RecipeError naming it: not known to be ours.
pub(crate) fn earlier_outputs(r: &Recipe, out_dir: &Path) -> Result<Vec<PathBuf>> {
    let files: Vec<PathBuf> = [crate::export::WEIGHTS, crate::export::CONFIG, "merged"]
        .iter()
        .map(|f| out_dir.join(f))
        .filter(|p| p.exists())
        .collect();
    if files.is_empty() {
        return Ok(files);
    }
    let ours = out_dir.join("recipe.toml").is_file() && out_dir.join("metrics.jsonl").is_file();
    if !ours {
        let names: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
        return Err(RecipeError::Invalid {
            path: r.source.clone(),
            key: "output.dir".into(),
            msg: format!(
                "= \"{}\" holds {}, which no lora-train run there wrote (no recipe.toml and metrics.jsonl beside it): a fresh run would leave it beside its own adapter; choose another output.dir or move it away",
                out_dir.display(),
                names.join(", ")
            ),
        }
        .into());
    }
    Ok(files)
}

/// `resume = true`: the newest checkpoint of `out_dir` (None: there is none), which must be
/// complete: a damaged newest checkpoint is a RecipeError naming its file, never skipped over.
pub(crate) fn newest(r: &Recipe, out_dir: &Path) -> Result<Option<PathBuf>> {
    let found = scan(out_dir);
    let Some(last) = found.last() else {
        return Ok(None);
    };
    match &last.state {
        Ok(_) => Ok(Some(last.dir.clone())),
        Err(why) => {
            let older = found.iter().rev().find(|f| f.state.is_ok());
            let alt = match older {
                Some(o) => format!(
                    "; to continue from the one before it, move it away or set train.resume = \"{}\"",
                    o.dir.display()
                ),
                None => String::new(),
            };
            Err(refuse(
                r,
                format!(
                    "= true, but the newest checkpoint {} cannot be read ({why}): it is damaged or incomplete (a half-copied checkpoint?), and nothing was changed{alt}",
                    last.dir.display()
                ),
            ))
        }
    }
}

/// Resuming `dir` at step `step`: no damaged checkpoint of `out_dir` lies ahead of it, where
/// the run would save over it.
pub(crate) fn nothing_damaged_ahead(r: &Recipe, out_dir: &Path, step: usize) -> Result<()> {
    for f in scan(out_dir) {
        if let (true, Err(why)) = (f.step > step, &f.state) {
            return Err(refuse(
                r,
                format!(
                    "continues from step {step}, and the run would save over {}, which cannot be read ({why}); nothing was changed: move it away first",
                    f.dir.display()
                ),
            ));
        }
    }
    Ok(())
}

/// The trainer state of `ck` against this session (recipe, data, its `total` steps), before
/// anything is loaded from it.
pub(crate) fn state(s: &Session, d: &TrainData, ck: &Checkpoint, total: usize) -> Result<()> {
    let st = &ck.state;
    let r = &s.run.recipe;
    let file = ck.dir.join(STATE);
    let field = |key: &str, msg: String| -> anyhow::Error {
        refuse(
            r,
            format!(
                "resumes from {}, but in {} `{key}` {msg}; nothing was changed",
                ck.dir.display(),
                file.display()
            ),
        )
    };
    // The data first: another data set explains every other mismatch.
    let data = d.data()?;
    let tokens: usize = data.examples.iter().map(|e| e.ids.len()).sum();
    let now = (data.examples.len(), tokens, total);
    if (st.data_examples, st.data_tokens, st.total_steps) != now {
        return Err(RecipeError::Invalid {
            path: r.source.clone(),
            key: "data.train".into(),
            msg: format!(
                "{} changed since checkpoint {} was saved ({} examples, {} tokens, {} steps then; {} examples, {} tokens, {} steps now): resuming would not continue the same run",
                r.data.train.describe(), ck.dir.display(), st.data_examples, st.data_tokens, st.total_steps, now.0, now.1, now.2
            ),
        }
        .into());
    }
    let fp = crate::train::fingerprint::data(d)?;
    if st.data_fingerprint.as_ref().is_some_and(|f| *f != fp) {
        return Err(RecipeError::Invalid {
            path: r.source.clone(),
            key: "data.train".into(),
            msg: format!(
                "{} is not the data checkpoint {} was trained on (the same counts, other contents or order: data fingerprint {} then, {fp} now): resuming would train on another data order",
                r.data.train.describe(),
                ck.dir.display(),
                st.data_fingerprint.as_deref().unwrap_or_default()
            ),
        }
        .into());
    }
    if st.step > st.total_steps {
        return Err(field(
            "step",
            format!("= {} is beyond the run's {} steps", st.step, st.total_steps),
        ));
    }
    if st.optimizer_steps.checked_add(st.skipped_steps) != Some(st.step) {
        return Err(field(
            "optimizer_steps",
            format!(
                "= {} and skipped_steps = {} do not add up to step = {}",
                st.optimizer_steps, st.skipped_steps, st.step
            ),
        ));
    }
    if st.seed != r.train.seed {
        return Err(field(
            "seed",
            format!(
                "= {}, but the recipe's train.seed is {}",
                st.seed, r.train.seed
            ),
        ));
    }
    let t = &r.train;
    let sch = &st.schedule;
    let now = (t.schedule, t.lr, t.warmup_steps, total);
    if (sch.kind, sch.lr, sch.warmup_steps, sch.total_steps) != now {
        return Err(field(
            "schedule",
            format!(
                "= {:?} lr {} warmup {} over {} steps, but the recipe gives {:?} lr {} warmup {} over {total} steps",
                sch.kind, sch.lr, sch.warmup_steps, sch.total_steps, t.schedule, t.lr, t.warmup_steps
            ),
        ));
    }
    cursor(d, ck, &field)
}

/// The data cursor: inside its epoch, and (when cheap to replay) where `step` steps lead.
fn cursor(
    s: &TrainData,
    ck: &Checkpoint,
    field: &dyn Fn(&str, String) -> anyhow::Error,
) -> Result<()> {
    let st = &ck.state;
    let c = st.cursor;
    if c.epoch > st.step {
        return Err(field(
            "cursor.epoch",
            format!(
                "= {} is beyond step {}: every epoch has a step",
                c.epoch, st.step
            ),
        ));
    }
    let steps = s.epoch_plan(c.epoch)?.len();
    if c.step_in_epoch > steps {
        return Err(field(
            "cursor.step_in_epoch",
            format!(
                "= {} is beyond epoch {}, which has {steps} steps",
                c.step_in_epoch, c.epoch
            ),
        ));
    }
    // Replaying the epochs before the cursor costs a shuffle of the data each: done while that
    // stays small beside loading the data.
    let rows = s.data()?.examples.len().max(1);
    if c.epoch.saturating_mul(rows) <= 50_000_000 {
        let mut before = 0;
        for e in 0..c.epoch {
            before += s.epoch_plan(e)?.len();
        }
        if before + c.step_in_epoch != st.step {
            return Err(field(
                "cursor",
                format!(
                    "= epoch {}, step {} of it, which is step {} of the run, not step = {}",
                    c.epoch,
                    c.step_in_epoch,
                    before + c.step_in_epoch,
                    st.step
                ),
            ));
        }
    }
    Ok(())
}

/// A checkpoint's optimiser tensors (`st`, read from `path`) against the adapters: exactly
/// `<key>.exp_avg` and `<key>.exp_avg_sq` for each of `keys`, f32, the shape of its parameter,
/// finite, and exp_avg_sq ≥ 0.
pub(crate) fn optimizer(
    r: &Recipe,
    path: &Path,
    st: &HashMap<String, Tensor>,
    keys: &[String],
    params: &[Var],
) -> Result<()> {
    let bad = |msg: String| {
        refuse(
            r,
            format!(
                "resumes from a checkpoint whose {} {msg}; nothing was changed",
                path.display()
            ),
        )
    };
    let want = 2 * keys.len();
    if st.len() != want {
        let mut extra: Vec<&String> = st
            .keys()
            .filter(|k| {
                let base = k
                    .strip_suffix(".exp_avg_sq")
                    .or_else(|| k.strip_suffix(".exp_avg"));
                !base.is_some_and(|b| keys.iter().any(|x| x == b))
            })
            .collect();
        extra.sort();
        let first = extra
            .first()
            .map(|k| format!(" (e.g. `{k}`, which names no adapter)"))
            .unwrap_or_default();
        return Err(bad(format!(
            "holds {} tensors, but the adapters need {want} (exp_avg and exp_avg_sq for each of {} adapter tensors){first}",
            st.len(),
            keys.len()
        )));
    }
    for (key, p) in keys.iter().zip(params) {
        for suffix in ["exp_avg", "exp_avg_sq"] {
            let k = format!("{key}.{suffix}");
            let Some(t) = st.get(&k) else {
                return Err(bad(format!("has no tensor `{k}`")));
            };
            if t.dtype() != DType::F32 {
                return Err(bad(format!("`{k}` is {:?}, not F32", t.dtype())));
            }
            if t.dims() != p.dims() {
                return Err(bad(format!(
                    "`{k}` has shape {:?}, its adapter tensor {:?}",
                    t.dims(),
                    p.dims()
                )));
            }
            let v: Vec<f32> = t.flatten_all()?.to_vec1()?;
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(bad(format!(
                    "`{k}` holds {} at entry {i}: the checkpoint is damaged",
                    v[i]
                )));
            }
            if suffix == "exp_avg_sq" {
                if let Some(i) = v.iter().position(|&x| x < 0.0) {
                    return Err(bad(format!(
                        "`{k}` holds the negative {} at entry {i}, which a second moment cannot be",
                        v[i]
                    )));
                }
            }
        }
    }
    Ok(())
}
