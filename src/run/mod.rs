//! A run assembled from the layers (issue 62's hallway): the recipe read and resolved into a
//! `train::RunConfig` (`resolve`: reads memory's plan and export's adapter config), the memory
//! plan checked before loading (`preflight`), a rank's `Session` opened from a recipe with its
//! init adapter (`session`), the ranks launched (`launch`: this thread, a thread per device, or
//! a launcher's processes, each with parallel/'s communicator), the output directory owned for
//! the run's life (`owner`), train's hooks over the loop (`trainer`: `log`, eval, samples,
//! `checkpoint`s written through `checkpoint_write` and `host_stage`, checked by
//! `checkpoint_check`, stops).

pub mod checkpoint;
pub(crate) mod checkpoint_check;
pub(crate) mod checkpoint_write;
pub mod host_stage;
pub(crate) mod launch;
pub(crate) mod log;
pub(crate) mod owner;
#[cfg(test)]
mod pref_tree;
pub(crate) mod preflight;
pub(crate) mod resolve;
pub(crate) mod session;
pub(crate) mod trainer;

pub use launch::run_with;
pub use preflight::DoesNotFit;
pub use resolve::{load_recipe, Machine};

use crate::recipe::Recipe;
use anyhow::Result;
use std::path::PathBuf;

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// The step the run ended at (a resumed run counts its earlier steps).
    pub steps: usize,
    /// The training loss of each step this process ran, in order.
    pub losses: Vec<f64>,
    /// The run's output directory.
    pub out_dir: PathBuf,
    /// Tokens this process trained on (the count the logged rate divides).
    pub tokens: usize,
    /// Seconds since this process's training log started.
    pub seconds: f64,
    /// Training examples cut to seq_len.
    pub truncated: usize,
    /// The last eval loss (at the end), when there is an eval set.
    pub eval_loss: Option<f64>,
    /// Bad rows skipped (data.on_bad_row = "skip").
    pub skipped: usize,
}

/// How `run_with` may deviate from the recipe.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Start even when the memory plan says the run does not fit.
    pub force: bool,
}

/// `lora-train train`: the whole run from a recipe, on one device, on one thread per device
/// (`[parallel] strategy = "ddp" | "fsdp"`), or as one rank of a torchrun / Slurm job.
pub fn run(recipe: Recipe) -> Result<RunSummary> {
    run_with(recipe, &RunOptions::default())
}
