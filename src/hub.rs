//! Where a checkpoint's files are: config.json, the (sharded) safetensors, the tokenizer.
//!
//! Local directories now; `[model] id` (Hub downloads into the standard HF cache) resolves to
//! the same `ModelFiles` once the Hub client lands.

use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The files of one Hugging Face checkpoint directory.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    pub dir: PathBuf,
    pub config: PathBuf,
    /// One `model.safetensors`, or every shard named by `model.safetensors.index.json`.
    pub weights: Vec<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
}

impl ModelFiles {
    pub fn local(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        }
        let config = dir.join("config.json");
        if !config.is_file() {
            bail!(
                "{} has no config.json: is it a Hugging Face checkpoint directory?",
                dir.display()
            );
        }
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let weights = if index.is_file() {
            shards_from_index(&index)?
        } else if single.is_file() {
            vec![single]
        } else {
            bail!(
                "{} has neither model.safetensors nor model.safetensors.index.json \
                 (PyTorch .bin checkpoints are not read: convert them with safetensors first)",
                dir.display()
            );
        };
        let opt = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        Ok(ModelFiles {
            dir: dir.to_owned(),
            config,
            weights,
            tokenizer: opt("tokenizer.json"),
            tokenizer_config: opt("tokenizer_config.json"),
        })
    }
}

/// The distinct shard files of `model.safetensors.index.json`'s `weight_map`, in name order.
fn shards_from_index(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index)
        .with_context(|| format!("cannot read {}", index.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{} has no `weight_map` object", index.display()))?;
    let files: BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for f in files {
        let p = dir.join(f);
        if !p.is_file() {
            bail!(
                "{} names shard {f}, which is missing from {}",
                index.display(),
                dir.display()
            );
        }
        out.push(p);
    }
    if out.is_empty() {
        bail!("{} lists no shards", index.display());
    }
    Ok(out)
}
