//! Checkpoints and exact resume.
//!
//! `<output dir>/checkpoint-<step>/` (step = optimiser steps done) holds:
//! - `adapter_model.safetensors`, `adapter_config.json`: the PEFT adapter at that step;
//! - `optimizer.safetensors`: AdamW's m and v per parameter (f32), keyed
//!   `<PEFT key>.exp_avg` / `<PEFT key>.exp_avg_sq`;
//! - `trainer_state.json`: step, data cursor, schedule inputs, seed, the update count t of
//!   AdamW, a loss tail, and the recipe fields that change the numbers;
//! - `recipe.toml`: the resolved recipe, for people.
//!
//! Nothing else is needed for an exact continuation: the data order is a pure function of
//! (seed, epoch) and dropout masks of (seed, step, micro-batch, layer, module), so (step,
//! cursor, adapter, m, v, t) is the whole state. A checkpoint is written into a temporary
//! directory `.checkpoint-<step>.tmp-<pid>` and renamed into place once complete:
//! checkpoint-<step>/ is never partial, and killing the process mid-write leaves the earlier
//! checkpoints as they were.

use super::checkpoint_check as check;
use super::checkpoint_write::Snapshot;
use super::host_stage::Stage;
use crate::export;
use crate::recipe::{Recipe, RecipeError, Resume, Schedule};
use crate::train::fingerprint::{self, FREE_KEYS};
use crate::train::optim::AdamW;
use crate::train::session::Session;
use crate::train::train_data::Cursor;
use crate::train::train_data::TrainData;
use crate::util::fs::sync_dir;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use crate::util::TRAINER_STATE as STATE;
pub(crate) const OPTIMIZER: &str = "optimizer.safetensors";
const FORMAT: &str = "lora-train checkpoint 1";
/// How this build derives its random streams (`TrainerState::rng`): a run with dropout resumes
/// exactly only where the checkpoint's streams are these.
pub const RNG: &str = "SplitMix64 streams keyed by seed: shuffle (seed, epoch); dropout masks \
                       Philox4x32-10 keyed by (seed, step, micro-batch), counter (element / 8, \
                       layer, module)";
/// Losses kept in trainer_state.json (the full history is in metrics.jsonl).
const LOSS_TAIL: usize = 100;

/// Inputs of the learning-rate schedule (lr · schedule::lr_factor(kind, step, total, warmup)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ScheduleInputs {
    pub(crate) kind: Schedule,
    pub(crate) lr: f64,
    pub(crate) warmup_steps: usize,
    pub(crate) total_steps: usize,
}

/// trainer_state.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub(crate) format: String,
    /// Optimiser steps done (skipped non-finite steps included).
    pub step: usize,
    /// The run's planned optimiser steps.
    pub total_steps: usize,
    /// Where the data stream continues.
    pub cursor: Cursor,
    /// AdamW updates applied (its bias-correction counter t; skipped steps excluded).
    pub optimizer_steps: usize,
    /// Steps skipped for a non-finite loss or gradient (counted in `step`).
    pub skipped_steps: usize,
    /// Tokens seen so far (padding excluded).
    pub(crate) tokens: usize,
    pub(crate) seed: u64,
    /// How random streams are derived; there is no generator state to save.
    pub(crate) rng: String,
    pub(crate) schedule: ScheduleInputs,
    /// Examples and tokens of the training data: a changed data file is refused on resume.
    pub(crate) data_examples: usize,
    pub(crate) data_tokens: usize,
    /// The data sampler's fingerprint (examples, weights, seq_len, packing, shuffling, seed),
    /// hex: the same counts with other contents or another order are refused on resume.
    /// Absent in checkpoints of earlier versions.
    #[serde(default)]
    pub(crate) data_fingerprint: Option<String>,
    /// (step, loss) of the last steps; null for a non-finite loss.
    pub loss_history: Vec<(usize, Option<f64>)>,
    /// The recipe fields that change the numbers, "section.key" → TOML value.
    pub(crate) recipe: BTreeMap<String, String>,
    /// The run's --set overrides of those fields: `train.resume = true` applies them again
    /// (`with_checkpoint_sets`), so a resume needs only the recipe.
    #[serde(default)]
    pub(crate) sets: Vec<String>,
}

/// Where a run stands after its last finished step: what a checkpoint saves of the loop.
#[derive(Debug, Clone, Default)]
pub(crate) struct Progress {
    /// Optimiser steps done (skipped non-finite steps included).
    pub(crate) step: usize,
    pub(crate) cursor: Cursor,
    /// Tokens seen so far (padding excluded).
    pub(crate) tokens: usize,
    pub(crate) skipped: usize,
    /// (step, loss) of every step; None for a non-finite loss.
    pub(crate) history: Vec<(usize, Option<f64>)>,
}

impl Progress {
    /// Where a checkpoint left off.
    pub(crate) fn of(s: &TrainerState) -> Progress {
        Progress {
            step: s.step,
            cursor: s.cursor,
            tokens: s.tokens,
            skipped: s.skipped_steps,
            history: s.loss_history.clone(),
        }
    }
}

impl TrainerState {
    /// The state of a session at `at`, of `total` steps.
    pub(crate) fn new(
        s: &Session,
        d: &TrainData,
        at: &Progress,
        total: usize,
        opt: &AdamW,
    ) -> Result<TrainerState> {
        let (run, o) = (&s.run, &s.run.optim);
        let h = &at.history;
        // A streaming run's checkpoint waits for its data: the state records all of it.
        let data = d.data()?;
        Ok(TrainerState {
            format: FORMAT.into(),
            step: at.step,
            total_steps: total,
            cursor: at.cursor,
            optimizer_steps: opt.t,
            skipped_steps: at.skipped,
            tokens: at.tokens,
            seed: run.seed,
            rng: RNG.into(),
            schedule: ScheduleInputs {
                kind: o.schedule,
                lr: o.lr,
                warmup_steps: o.warmup_steps,
                total_steps: total,
            },
            data_examples: data.examples.len(),
            data_tokens: data.examples.iter().map(|e| e.ids.len()).sum(),
            data_fingerprint: Some(fingerprint::data(d)?),
            loss_history: h[h.len().saturating_sub(LOSS_TAIL)..].to_vec(),
            recipe: fingerprint::recipe(&run.recipe),
            sets: numbers_sets(&run.recipe.sets),
        })
    }
}

/// The "section.key" an override `section.key=value` sets.
pub fn set_key(set: &str) -> &str {
    set.split_once('=').map_or(set, |(k, _)| k).trim()
}

/// The overrides among `sets` that change the numbers (the keys a resume must match).
pub fn numbers_sets(sets: &[String]) -> Vec<String> {
    sets.iter()
        .filter(|s| !FREE_KEYS.contains(&set_key(s)))
        .cloned()
        .collect()
}

/// A recipe that resumes (`train.resume` true or a checkpoint) with the overrides of the run
/// it continues applied again, before its own: `lora-train --recipe X --set train.resume=true`
/// continues a run started with any --set that change the numbers. An override given now that
/// conflicts with the checkpoint's is then refused by `resume_point`, naming it.
pub(crate) fn with_checkpoint_sets(r: Recipe) -> Result<Recipe> {
    let dir = match &r.train.resume {
        Resume::Flag(false) => return Ok(r),
        Resume::Flag(true) => match list(&r.output_dir()).pop() {
            Some((_, d)) => d,
            None => return Ok(r),
        },
        Resume::Path(p) => p.clone(),
    };
    // An unreadable state is resume_point's to report.
    let Ok(state) = read_state(&dir) else {
        return Ok(r);
    };
    let given: Vec<&str> = r.sets.iter().map(|s| set_key(s)).collect();
    let again: Vec<String> = state
        .sets
        .iter()
        .filter(|s| !given.contains(&set_key(s)))
        .cloned()
        .collect();
    if again.is_empty() {
        return Ok(r);
    }
    crate::errln!(
        "resuming with the overrides of {}: --set {}",
        dir.display(),
        again.join(" --set ")
    );
    let sets: Vec<String> = again.into_iter().chain(r.sets.iter().cloned()).collect();
    super::resolve::load_recipe(&r.source, &sets)
}

/// A complete checkpoint on disk.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Its trainer_state.json.
    pub state: TrainerState,
}

/// Reads `dir/trainer_state.json`.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join(STATE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let s: TrainerState = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a lora-train trainer state", path.display()))?;
    if s.format != FORMAT {
        bail!(
            "{}: format \"{}\" is not \"{FORMAT}\"",
            path.display(),
            s.format
        );
    }
    Ok(s)
}

/// The checkpoint-<step>/ directories of `out_dir` that hold a trainer state, by step.
pub fn list(out_dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut v: Vec<(usize, PathBuf)> = std::fs::read_dir(out_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("checkpoint-")?.parse().ok()?;
            let p = e.path();
            p.join(STATE).is_file().then_some((step, p))
        })
        .collect();
    v.sort();
    v
}

/// The checkpoint `train.resume` asks for, checked against the recipe; None = start fresh.
/// A recipe that differs from the checkpoint's in anything that changes the numbers, or a
/// fresh start over an unfinished run, is a RecipeError (exit 2) and nothing is written.
pub fn resume_point(r: &Recipe, out_dir: &Path) -> Result<Option<Checkpoint>> {
    let invalid = |key: &str, msg: String| RecipeError::Invalid {
        path: r.source.clone(),
        key: key.into(),
        msg,
    };
    let dir = match &r.train.resume {
        // Starting fresh over an interrupted run would throw its checkpoints away.
        Resume::Flag(false) => return check::fresh_start(r, out_dir).map(|()| None),
        Resume::Flag(true) => match check::newest(r, out_dir)? {
            Some(dir) => dir,
            None => return Ok(None),
        },
        Resume::Path(p) => p.clone(),
    };
    let state = check::complete(&dir).map_err(|why| {
        invalid(
            "train.resume",
            format!(
                "= {}, which cannot be read ({why}): nothing was changed",
                dir.display()
            ),
        )
    })?;
    check::nothing_damaged_ahead(r, out_dir, state.step)?;
    let now = fingerprint::recipe(r);
    let mut diff: Vec<&String> = now
        .keys()
        .chain(state.recipe.keys())
        .filter(|k| now.get(*k) != state.recipe.get(*k))
        .collect();
    diff.sort();
    diff.dedup();
    if let Some(first) = diff.first() {
        let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(not set)".into());
        let mut msg = format!(
            "= {}, but checkpoint {} was trained with {}: train.resume continues a run exactly, \
             so everything that changes the numbers must match; set it back, or start a new run \
             from the checkpoint's adapter with lora.init_adapter = \"{}\"",
            show(now.get(*first)),
            dir.display(),
            show(state.recipe.get(*first)),
            dir.display()
        );
        if diff.len() > 1 {
            let rest: Vec<&str> = diff[1..].iter().map(|s| s.as_str()).collect();
            msg.push_str(&format!(" (also different: {})", rest.join(", ")));
        }
        return Err(invalid(first, msg).into());
    }
    if r.lora.dropout > 0.0 && state.rng != RNG {
        let msg = format!(
            "= {}, but checkpoint {} drew its dropout masks as \"{}\", and this build draws them \
             as \"{RNG}\": an exact resume needs the build that wrote it; or start a new run from \
             the checkpoint's adapter with lora.init_adapter = \"{}\"",
            r.lora.dropout,
            dir.display(),
            state.rng,
            dir.display()
        );
        return Err(invalid("lora.dropout", msg).into());
    }
    Ok(Some(Checkpoint { dir, state }))
}

/// Where a checkpoint of step `step` goes.
pub(crate) fn dir_of(out_dir: &Path, step: usize) -> PathBuf {
    out_dir.join(format!("checkpoint-{step}"))
}

/// The checkpoint of where the run stands (`state`), on its way to host memory (`stage`):
/// the adapter, AdamW's m and v (`keys[i]` the PEFT key of `opt.params[i]`), the recipe, and
/// the trainer state last (a directory holding it is complete).
pub(crate) fn snapshot(
    s: &Session,
    state: &TrainerState,
    opt: &AdamW,
    keys: &[String],
    stage: &Stage,
) -> Result<Snapshot> {
    let rev = s.base_revision.as_deref();
    // Paths are recorded from a checkpoint-N directory of output.dir: relative ones, from any.
    let dir = s.run.output.dir.join("checkpoint-N");
    Ok(Snapshot {
        adapter: Snapshot::adapter(&s.model, stage)?,
        config: export::adapter_config(&s.run.spec, &s.run.base_name_in(&dir), rev)?,
        optimizer: Snapshot::optimizer(opt, keys, stage)?,
        files: vec![
            ("recipe.toml", s.run.recipe.to_toml_in(&dir)?.into_bytes()),
            (
                STATE,
                (serde_json::to_string_pretty(state)? + "\n").into_bytes(),
            ),
        ],
    })
}

/// Loads a checkpoint's adapter into the model and its m, v and t into the optimiser.
pub fn restore(ck: &Checkpoint, s: &Session, opt: &mut AdamW, keys: &[String]) -> Result<()> {
    export::load_adapter_weights(&ck.dir, &s.model)?;
    let path = ck.dir.join(OPTIMIZER);
    let st = candle_core::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("cannot read {}", path.display()))?;
    check::optimizer(&s.run.recipe, &path, &st, keys, &opt.params)?;
    let mut ms = Vec::with_capacity(keys.len());
    let mut vs = Vec::with_capacity(keys.len());
    for (key, p) in keys.iter().zip(&opt.params) {
        for (suffix, out) in [("exp_avg", &mut ms), ("exp_avg_sq", &mut vs)] {
            let k = format!("{key}.{suffix}");
            let t: &Tensor = st
                .get(&k)
                .with_context(|| format!("{} has no tensor `{k}`", path.display()))?;
            out.push(t.to_device(p.device())?);
        }
    }
    opt.load_state(ms, vs, ck.state.optimizer_steps)
        .with_context(|| format!("{} does not fit this model", path.display()))?;
    Ok(())
}

/// Before a run writes into `out_dir`: removes what interrupted saves left behind
/// (.checkpoint-*.tmp-* / .old-* directories) and, on a fresh start, the checkpoints of an
/// earlier (finished) run, which `resume = true` would otherwise pick up, and its final
/// adapter and merged model (`check::earlier_outputs`).
pub(crate) fn clean(r: &Recipe, out_dir: &Path, fresh: bool) -> Result<Removed> {
    let mut removed = Vec::new();
    let mut outputs = Vec::new();
    if fresh {
        // A finished earlier run's final adapter and merged model (proven ours), moved aside
        // before they are deleted so that a crash leaves none of them half-removed.
        for p in check::earlier_outputs(r, out_dir)? {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            let name = name.unwrap_or_default();
            let aside = out_dir.join(format!(".{name}.old-{}", std::process::id()));
            std::fs::rename(&p, &aside)
                .with_context(|| format!("cannot move {} aside", p.display()))?;
            match aside.is_dir() {
                true => std::fs::remove_dir_all(&aside),
                false => std::fs::remove_file(&aside),
            }
            .with_context(|| format!("cannot remove {}", aside.display()))?;
            outputs.push(name);
        }
    }
    let finished = match fresh {
        true => check::removable(out_dir),
        false => Vec::new(),
    };
    for e in std::fs::read_dir(out_dir)
        .with_context(|| format!("cannot read {}", out_dir.display()))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let ours = [
            ".checkpoint-",
            ".merged.",
            ".adapter_model.",
            ".adapter_config.",
            ".reference_logps.",
        ];
        let leftover = ours.iter().any(|p| name.starts_with(p))
            && (name.contains(".tmp-") || name.contains(".old-"));
        let stale = finished.contains(&e.path());
        if leftover || stale {
            match e.path().is_dir() {
                true => std::fs::remove_dir_all(e.path()),
                false => std::fs::remove_file(e.path()),
            }
            .with_context(|| format!("cannot remove {}", e.path().display()))?;
            if stale {
                removed.push(name);
            }
        }
    }
    removed.sort();
    Ok(Removed {
        checkpoints: removed,
        outputs,
    })
}

/// What `clean` removed of an earlier run: checkpoint directories, and its final outputs.
#[derive(Debug, Default)]
pub(crate) struct Removed {
    pub(crate) checkpoints: Vec<String>,
    pub(crate) outputs: Vec<String>,
}

/// Keeps the newest `keep_last` checkpoints of steps ≤ `step` (0 = keep all). Each is moved
/// aside before it is deleted, so a crash never leaves a partial checkpoint-<step>/.
pub(crate) fn prune(out_dir: &Path, keep_last: usize, step: usize) -> Result<()> {
    if keep_last == 0 {
        return Ok(());
    }
    // Complete checkpoints only: one that cannot be read is not known to be ours.
    let old: Vec<(usize, PathBuf)> = check::scan(out_dir)
        .into_iter()
        .filter(|f| f.step <= step && f.state.is_ok())
        .map(|f| (f.step, f.dir))
        .collect();
    for (s, dir) in &old[..old.len().saturating_sub(keep_last)] {
        let aside = out_dir.join(format!(".checkpoint-{s}.old-{}", std::process::id()));
        std::fs::rename(dir, &aside)
            .with_context(|| format!("cannot move {} aside", dir.display()))?;
        sync_dir(out_dir);
        std::fs::remove_dir_all(&aside)
            .with_context(|| format!("cannot remove {}", aside.display()))?;
    }
    Ok(())
}
