//! What a run's data is checked for before its first step writes anything: a training set
//! with something to train, and a step count that the data's epochs can give. (The checks
//! that need only the model and the recipe are made when the run is resolved: run::resolve.)

use super::run_config::RunConfig;
use super::train_data::TrainData;
use crate::data::{Dataset, IGNORE};
use crate::recipe::bounds::{MAX_EPOCHS, MAX_STEPS};
use crate::recipe::DataSection;
use anyhow::Result;

/// The training set has at least one token to predict (a label other than -100 after the
/// first position); otherwise every step's loss would be 0 over nothing.
pub(crate) fn something_to_train(d: &DataSection, data: &Dataset) -> Result<()> {
    let any = data
        .examples
        .iter()
        .any(|e| e.labels.iter().skip(1).any(|&l| l != IGNORE));
    if any {
        return Ok(());
    }
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
pub(crate) fn steps(
    run: &RunConfig,
    d: &TrainData,
    total: usize,
    start_epoch: usize,
) -> Result<()> {
    let t = &run.batch;
    let per_epoch = d.epoch_plan(start_epoch)?.len();
    if per_epoch == 0 {
        let world = d.world;
        anyhow::bail!(
            "epoch {start_epoch} has no step: the data gives {} rows and a step takes {} per rank × {world} rank(s) (micro_batch {} × grad_accum {}); add data, or lower train.micro_batch, train.grad_accum or the number of ranks",
            d.ready()?.sampler.rows(start_epoch).len(),
            t.micro_batch.saturating_mul(t.grad_accum),
            t.micro_batch,
            t.grad_accum
        );
    }
    let invalid = |key: &str, msg: String| -> anyhow::Error { run.recipe.invalid(key, msg).into() };
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
