//! A run assembled from the layers: the ranks launched (`launch`: this thread, a thread per
//! device, or a launcher's processes, each with parallel/'s communicator) and the output
//! directory owned for the run's life (`owner`).

pub(crate) mod launch;
pub(crate) mod owner;

pub use launch::run_with;

use crate::recipe::Recipe;
use crate::train::{RunOptions, RunSummary};
use anyhow::Result;

/// `lora-train train`: the whole run from a recipe, on one device, on one thread per device
/// (`[parallel] strategy = "ddp" | "fsdp"`), or as one rank of a torchrun / Slurm job.
pub fn run(recipe: Recipe) -> Result<RunSummary> {
    run_with(recipe, &RunOptions::default())
}
