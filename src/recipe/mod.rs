//! Recipes: one TOML file per run, `--set section.key=value` overrides on top. Plain data: this
//! module knows TOML and the recipe's own rules, and imports nothing of the crate but util.
//!
//! Every field is documented in its section's file with its default; `recipes/reference.toml`
//! spells them all out and a test keeps it in step. Unknown keys are errors. Relative paths
//! written in a recipe are relative to the recipe file's directory (so recipes work from any
//! working directory); paths given with `--set` are relative to the current directory.
//!
//! defines: `Recipe` and `RecipeError` (here), the sections (`model`, `lora`, `data`, `train`,
//! `parallel`, `output`), `load` (the file, `--set`, paths), `validate` (what the recipe alone
//! can check), `bounds` (numbers bounded before they size anything), `text` (the recipe written
//! back as TOML).

pub(crate) mod bounds;
mod data;
mod load;
mod lora;
mod model;
mod output;
mod parallel;
#[cfg(test)]
mod tests;
mod text;
mod train;
mod validate;

pub(crate) use data::{DataFormat, OnBadRow, TrainFiles, TrainOn};
pub use data::{DataSection, TrainFile};
pub(crate) use lora::{LoraSection, Targets, KNOWN_LINEAR};
pub(crate) use model::ModelSection;
pub use model::{DeviceKind, Dtype, Quantize};
pub use output::{MergeInto, OutputSection, DEFAULT_MAX_SHARD_SIZE};
pub(crate) use parallel::ParallelSection;
pub use parallel::Strategy;
pub use train::Checkpointing;
pub(crate) use train::{
    Resume, Schedule, Tracker, TrainSection, MLP_CHUNK_MAX, OFFLOAD_ACTIVATIONS_DEFAULT,
};

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A recipe that cannot be used as written. Exit code 2; nothing has been written yet.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    /// The file could not be read.
    #[error("cannot read recipe {path}")]
    Read {
        /// The recipe file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid TOML, or a key or value the schema does not know.
    #[error("recipe {path}: {msg}")]
    Parse {
        /// The recipe file.
        path: PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// A value the schema takes but the run cannot use.
    #[error("recipe {path}: `{key}` {msg}")]
    Invalid {
        /// The recipe file.
        path: PathBuf,
        /// The field, `section.key`.
        key: String,
        /// What is wrong with it, and the fix.
        msg: String,
    },
    /// A `--set` argument that is malformed or names no field.
    #[error("--set {arg}: {msg}")]
    Override {
        /// The argument as given.
        arg: String,
        /// What is wrong with it.
        msg: String,
    },
}

/// A run's recipe: its TOML sections as read (recipes/reference.toml documents every field).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// `[model]`: the base checkpoint and how it is loaded.
    pub model: ModelSection,
    #[serde(default)]
    pub(crate) lora: LoraSection,
    /// `[data]`: the training (and eval) data and how it becomes rows.
    pub data: DataSection,
    /// `[train]`: steps, optimiser, schedule, and what the layers keep.
    #[serde(default)]
    pub train: TrainSection,
    /// `[parallel]`: the strategy and its ranks.
    #[serde(default)]
    pub parallel: ParallelSection,
    #[serde(default)]
    pub(crate) output: OutputSection,
    /// The recipe file this came from (not a TOML key).
    #[serde(skip)]
    pub(crate) source: PathBuf,
    /// The --set overrides it was loaded with, in order (not a TOML key).
    #[serde(skip)]
    pub(crate) sets: Vec<String>,
}

/// serde's default for fields that default to true.
fn d_true() -> bool {
    true
}

impl Recipe {
    /// A `RecipeError::Invalid` for `key` of this recipe.
    pub fn invalid(&self, key: &str, msg: impl Into<String>) -> RecipeError {
        RecipeError::Invalid {
            path: self.source.clone(),
            key: key.into(),
            msg: msg.into(),
        }
    }

    /// `train.mlp_chunk` as the model takes it (None: 0, never chunked).
    pub(crate) fn mlp_chunk(&self) -> Option<usize> {
        (self.train.mlp_chunk > 0).then_some(self.train.mlp_chunk)
    }

    /// `train.max_memory` in bytes (validated at load).
    pub(crate) fn max_memory(&self) -> Option<u64> {
        self.train
            .max_memory
            .as_deref()
            .and_then(|s| crate::util::parse_size(s).ok())
    }

    /// The output directory: `output.dir`, or adapters/<recipe stem>.
    pub fn output_dir(&self) -> PathBuf {
        self.output.dir.clone().unwrap_or_else(|| {
            let stem = self
                .source
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned());
            Path::new("adapters").join(stem.unwrap_or_else(|| "run".into()))
        })
    }
}
