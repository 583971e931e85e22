//! What decides a run's numbers, as checkpoints and the reference store record it: the
//! recipe's fields that change them (`recipe`; `FREE_KEYS` are those that do not) and the data
//! sampler's fingerprint (`data`).

use super::train_data::TrainData;
use crate::recipe::Recipe;
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Recipe keys that do not change the numbers of a run: they may differ on resume.
pub(crate) const FREE_KEYS: [&str; 19] = [
    "train.resume",
    "train.report_to",
    "train.max_memory",
    "train.log_every",
    "train.skip_nonfinite",
    // The same sums, in a fixed order or not.
    "train.deterministic",
    "train.mlp_chunk",
    "train.activation_checkpointing",
    "train.offload_activations",
    // The stored reference log-probabilities are the ones the steps would compute, bit for bit.
    "train.precompute_ref",
    "output.dir",
    "output.save_every",
    "output.keep_last",
    "output.merge",
    "output.max_shard_size",
    "output.merge_into",
    "output.overwrite",
    // ddp and fsdp over the same devices give the same numbers.
    "parallel.strategy",
    "parallel.timeout_s",
];

/// The recipe fields that change the numbers of a run, as "section.key" → TOML value, with
/// paths made absolute (the same files reached from another directory compare equal).
pub fn recipe(r: &Recipe) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    // A path that is not UTF-8 (TOML's strings are) compares as the file it reaches, its odd
    // bytes escaped; UTF-8 ones as below, as checkpoints of earlier versions recorded them.
    let mut r = r.clone();
    r.for_each_path(|_, p| {
        if p.to_str().is_none() {
            let abs = std::fs::canonicalize(&*p).unwrap_or_else(|_| p.clone());
            *p = PathBuf::from(crate::util::os_path::escaped(&abs));
        }
    });
    let Ok(toml::Value::Table(doc)) = toml::Value::try_from(&r) else {
        return out;
    };
    for (section, v) in doc {
        let toml::Value::Table(t) = v else { continue };
        for (k, v) in t {
            let key = format!("{section}.{k}");
            if FREE_KEYS.contains(&key.as_str()) {
                continue;
            }
            let v = match (&v, key.as_str()) {
                (toml::Value::String(p), "model.path" | "data.train" | "lora.init_adapter") => {
                    let abs = std::fs::canonicalize(p).unwrap_or_else(|_| PathBuf::from(p));
                    toml::Value::String(crate::util::os_path::escaped(&abs))
                }
                _ => v,
            };
            out.insert(key, v.to_string());
        }
    }
    out
}

/// The data fingerprint a trainer state records (the sampler's: examples, weights, settings).
pub(crate) fn data(s: &TrainData) -> Result<String> {
    Ok(format!("{:016x}", s.ready()?.sampler.fingerprint()))
}
