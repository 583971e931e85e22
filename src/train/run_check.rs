//! What a session is checked for before it allocates adapters or writes anything: the LoRA
//! rank against the linears it adapts, a training set with something to train, and a step
//! count that the data's epochs can give.

use super::Session;
use crate::data::{Dataset, IGNORE};
use crate::hub::ModelFiles;
use crate::lora::LoraSpec;
use crate::model::{ConfigError, ModelConfig};
use crate::recipe::bounds::{MAX_EPOCHS, MAX_STEPS};
use crate::recipe::{Recipe, RecipeError};
use anyhow::Result;
use std::path::Path;

/// `spec` with its targets as the model's own linears (`ModelConfig::resolve_targets`:
/// "all-linear" becomes the family's; a name the family does not have is an error naming the
/// ones it has, against lora.targets or the init adapter's target_modules).
pub fn lora_targets(
    recipe: &Recipe,
    files: &ModelFiles,
    spec: LoraSpec,
    init: Option<&Path>,
) -> Result<LoraSpec> {
    let cfg = ModelConfig::from_file(&files.config)?;
    match cfg.resolve_targets(&spec.targets) {
        Ok(targets) => Ok(LoraSpec { targets, ..spec }),
        Err(why) => Err(match init {
            Some(dir) => ConfigError::Adapter {
                path: dir.join(crate::export::CONFIG),
                msg: format!("`target_modules` {why}"),
            }
            .into(),
            None => RecipeError::Invalid {
                path: recipe.source.clone(),
                key: "lora.targets".into(),
                msg: why,
            }
            .into(),
        }),
    }
}

/// DoRA from an init adapter: its adapter_config.json's use_dora decides, as its rank does; a
/// recipe asking for DoRA from a plain adapter is an error, and a DoRA adapter is held to the
/// recipe checks of `lora.use_dora = true`.
pub fn init_dora(recipe: &Recipe, dir: &Path, info: &crate::export::AdapterInfo) -> Result<()> {
    let cfg = dir.join(crate::export::CONFIG);
    if recipe.lora.use_dora && !info.spec.dora {
        return Err(RecipeError::Invalid {
            path: recipe.source.clone(),
            key: "lora.use_dora".into(),
            msg: format!(
                "= true, but lora.init_adapter's {} says use_dora = false (a plain LoRA \
                 adapter): remove use_dora, or continue from a DoRA adapter",
                cfg.display()
            ),
        }
        .into());
    }
    if info.spec.dora {
        let mut r = recipe.clone();
        r.lora.use_dora = true;
        r.validate_dora().map_err(|e| {
            anyhow::Error::new(e).context(format!(
                "lora.init_adapter is a DoRA adapter ({} says use_dora = true)",
                cfg.display()
            ))
        })?;
    }
    Ok(())
}

/// `spec.rank` is at most min(in, out) of every linear it adapts (a larger rank adds
/// parameters that cannot raise the adapter's rank, and sizes A and B by a number nothing
/// bounds). `init`: the adapter directory the spec came from (lora.init_adapter), if any.
pub fn lora_fits(
    recipe: &Recipe,
    files: &ModelFiles,
    spec: &LoraSpec,
    init: Option<&Path>,
) -> Result<()> {
    let cfg = ModelConfig::from_file(&files.config)?;
    let Some((module, (n_in, n_out))) = spec
        .targets
        .iter()
        .filter_map(|m| Some((m.as_str(), cfg.linear_shape(m)?)))
        .min_by_key(|(_, (a, b))| (*a).min(*b))
    else {
        return Ok(());
    };
    let max = n_in.min(n_out);
    if spec.rank <= max {
        return Ok(());
    }
    let why = format!(
        "= {} is more than the adapted linears allow: {module} maps {n_in} → {n_out} features in {}, so the rank is at most {max}",
        spec.rank,
        files.dir.display()
    );
    Err(match init {
        Some(dir) => ConfigError::Adapter {
            path: dir.join(crate::export::CONFIG),
            msg: format!("`r` {why}"),
        }
        .into(),
        None => RecipeError::Invalid {
            path: recipe.source.clone(),
            key: "lora.rank".into(),
            msg: why,
        }
        .into(),
    })
}

/// The training set has at least one token to predict (a label other than -100 after the
/// first position); otherwise every step's loss would be 0 over nothing.
pub fn something_to_train(recipe: &Recipe, data: &Dataset) -> Result<()> {
    let any = data
        .examples
        .iter()
        .any(|e| e.labels.iter().skip(1).any(|&l| l != IGNORE));
    if any {
        return Ok(());
    }
    let d = &recipe.data;
    let (train_on, hint) = match d.train_on_for(d.format) {
        crate::recipe::TrainOn::All => ("all", "give the rows labels other than -100"),
        crate::recipe::TrainOn::Completions => (
            "completions",
            "check that the rows have completions, or set data.train_on = \"all\"",
        ),
    };
    anyhow::bail!(
        "the training data {} has no token to train on: every label of its {} examples is -100 (after truncation to data.seq_len {}, with data.train_on = \"{train_on}\"), so every step's loss would be 0 over nothing: {hint}",
        d.train.describe(),
        data.examples.len(),
        d.seq_len,
    )
}

/// Before the first step writes anything: the epoch the run starts in has a step, and the
/// run's `total` steps take at most `MAX_EPOCHS` passes over the data.
pub fn steps(s: &Session, total: usize, start_epoch: usize) -> Result<()> {
    let t = &s.recipe.train;
    let per_epoch = s.epoch_plan(start_epoch).len();
    if per_epoch == 0 {
        let world = s.comm.world();
        anyhow::bail!(
            "epoch {start_epoch} has no step: the data gives {} rows and a step takes {} per rank × {world} rank(s) (micro_batch {} × grad_accum {}); add data, or lower train.micro_batch, train.grad_accum or the number of ranks",
            s.sampler.rows(start_epoch).len(),
            t.micro_batch.saturating_mul(t.grad_accum),
            t.micro_batch,
            t.grad_accum
        );
    }
    let invalid = |key: &str, msg: String| -> anyhow::Error {
        RecipeError::Invalid {
            path: s.recipe.source.clone(),
            key: key.into(),
            msg,
        }
        .into()
    };
    match t.max_steps {
        Some(n) => {
            let epochs = n.div_ceil(per_epoch);
            if epochs > MAX_EPOCHS {
                return Err(invalid(
                    "train.max_steps",
                    format!(
                        "= {n} would take {epochs} passes over the data ({per_epoch} steps each): at most {MAX_EPOCHS}; lower it, or add data"
                    ),
                ));
            }
        }
        None => {
            if total > MAX_STEPS {
                return Err(invalid(
                    "train.epochs",
                    format!(
                        "= {} gives {total} steps ({per_epoch} an epoch): at most {MAX_STEPS}",
                        t.epochs.unwrap_or(1)
                    ),
                ));
            }
        }
    }
    Ok(())
}
