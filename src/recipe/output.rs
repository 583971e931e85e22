//! `[output]`: where the adapter goes, and the merged model.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// `output.max_shard_size` (and `export --max-shard-size`) when unset: transformers' default.
pub const DEFAULT_MAX_SHARD_SIZE: &str = "5GB";

/// What the adapter is merged into (`export --merge-into`, `[output] merge_into`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MergeInto {
    /// The base checkpoint's weights (a bitsandbytes 4-bit checkpoint's dequantized: its
    /// weights are NF4).
    #[default]
    Base,
    /// Each decoder-layer linear of the base quantized to NF4 and dequantized: the weights an
    /// adapter trained with `model.quantize = "nf4"` computed with.
    Dequantized,
}

/// `[output]`: where the adapter goes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// Output directory. Default: "adapters/<recipe file name without .toml>", relative to the
    /// current directory.
    pub(crate) dir: Option<PathBuf>,
    /// Save checkpoint-<step>/ (adapter, optimiser state, trainer state) every this many
    /// steps and at the last step; 0 = none, the final adapter alone (SIGINT / SIGTERM still
    /// save one). Default: 0.
    #[serde(default)]
    pub(crate) save_every: usize,
    /// Also write merged full weights (W + scale·B·A, in the base checkpoint's dtype) to
    /// <dir>/merged/ at the end of the run. Default: false.
    #[serde(default)]
    pub(crate) merge: bool,
    /// Keep only the newest this many checkpoint-<step>/ directories (0 = keep all).
    /// Default: 0.
    #[serde(default)]
    pub(crate) keep_last: usize,
    /// Largest safetensors shard of the merged model, e.g. "5GB", "500MB", "2GiB".
    /// Default: "5GB".
    #[serde(default, deserialize_with = "super::train::size_text")]
    pub(crate) max_shard_size: Option<String>,
    /// What `merge` merges the adapter into: "base" (the base checkpoint's weights; a
    /// bitsandbytes 4-bit checkpoint's dequantized) or "dequantized" (each decoder linear
    /// of the base through NF4 as training quantized it, for model.quantize = "nf4").
    /// Default: "base".
    #[serde(default)]
    pub(crate) merge_into: MergeInto,
    /// A fresh run into a directory that holds a finished run replaces that run (its final
    /// adapter, merged model and checkpoints are removed as the new run starts); false refuses,
    /// naming the ways on. `train --overwrite` sets it. Default: false.
    #[serde(default)]
    pub(crate) overwrite: bool,
}
