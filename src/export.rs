//! PEFT-format adapters: `adapter_model.safetensors` + `adapter_config.json`.
//!
//! Keys are PEFT's: `base_model.model.<module>.lora_A.weight` (A [r, in]) and `.lora_B.weight`
//! (B [out, r]), f32, with safetensors metadata {"format": "pt"}, so that
//! `PeftModel.from_pretrained(base, dir)` loads them as-is; a DoRA adapter's magnitude m [out]
//! is `base_model.model.<module>.lora_magnitude_vector` (no `.weight`: PEFT 0.21's file key)
//! and its config says `"use_dora": true`.

pub mod adapter_check;
pub mod merge;

use crate::lora::{Lora, LoraSpec, EXPERT_PARAMS, KNOWN_LINEAR};
use crate::model::Model;
use crate::util::atomic_write;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

pub const WEIGHTS: &str = "adapter_model.safetensors";
pub const CONFIG: &str = "adapter_config.json";

pub fn peft_key(module: &str, which: char) -> String {
    format!("base_model.model.{module}.lora_{which}.weight")
}

/// PEFT's file key of a DoRA magnitude.
pub fn magnitude_key(module: &str) -> String {
    format!("base_model.model.{module}.lora_magnitude_vector")
}

/// An adapter's tensors with their PEFT keys, in `Lora::vars` order (A, B, then m).
pub fn adapter_keys<'a>(module: &str, lora: &'a Lora) -> Vec<(String, &'a Var)> {
    let mut v = vec![
        (peft_key(module, 'A'), &lora.a),
        (peft_key(module, 'B'), &lora.b),
    ];
    v.extend(lora.m.as_ref().map(|m| (magnitude_key(module), m)));
    v
}

/// The keys PEFT may have written `key` under: as is, with the adapter's name (`.default`,
/// for non-default adapters), and a magnitude's parameter name (`.weight`, older PEFT).
fn key_variants(key: &str) -> [String; 3] {
    match key.strip_suffix(".weight") {
        Some(k) => [key.into(), format!("{k}.default.weight"), key.into()],
        None => [
            key.into(),
            format!("{key}.default.weight"),
            format!("{key}.weight"),
        ],
    }
}

/// What a saved adapter says about itself (adapter_config.json).
#[derive(Debug, Clone)]
pub struct AdapterInfo {
    pub spec: LoraSpec,
    pub base_model: Option<String>,
    /// The base's Hub revision, when it came from the Hub.
    pub revision: Option<String>,
}

/// Writes the model's adapters into `dir` (created if needed), each file atomically.
/// `revision`: the base's Hub commit (None for a local directory), as PEFT records it.
pub fn save_adapter(
    dir: &Path,
    model: &Model,
    spec: &LoraSpec,
    base_model: &str,
    revision: Option<&str>,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_tensors(&dir.join(WEIGHTS), &adapter_tensors(model)?)?;
    atomic_write(
        &dir.join(CONFIG),
        &adapter_config(spec, base_model, revision)?,
    )
}

/// The model's adapters as PEFT keys them: A [r, in], B [out, r] (and m [out]), f32 host copies that
/// training no longer changes (the optimiser updates the device tensors in place).
pub fn adapter_tensors(model: &Model) -> Result<Vec<(String, Tensor)>> {
    let mut keys = Vec::new();
    let mut parts = Vec::new();
    for (module, lora) in model.adapters() {
        for (key, var) in adapter_keys(module, lora) {
            keys.push((key, var.as_tensor().shape().clone()));
            parts.push(var.as_tensor().to_dtype(DType::F32)?.flatten_all()?);
        }
    }
    if parts.is_empty() {
        return Ok(Vec::new());
    }
    // One copy to the host, not one per tensor: each device-to-host copy waits for the stream,
    // and a 7B model has some 450 adapter tensors.
    let flat = host_copy(&Tensor::cat(&parts, 0)?)?;
    let mut out = Vec::with_capacity(keys.len());
    let mut at = 0;
    for (key, shape) in keys {
        let n = shape.elem_count();
        out.push((key, flat.narrow(0, at, n)?.reshape(shape)?));
        at += n;
    }
    Ok(out)
}

/// A host tensor with storage of its own: a CPU tensor is copied, not shared, so that a later
/// in-place update does not reach it.
pub fn host_copy(t: &Tensor) -> candle_core::Result<Tensor> {
    match t.device() {
        Device::Cpu => t.copy(),
        _ => t.to_device(&Device::Cpu),
    }
}

/// `tensors` (host, f32) as one safetensors file at `path`, written atomically, with the
/// metadata {"format": "pt"} that PEFT's loader expects. One metadata entry only: safetensors
/// writes a map's entries in hash order, and files of equal runs must be equal bytes.
pub fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let raw = tensors
        .iter()
        .map(|(k, t)| Ok((k.as_str(), t.dims().to_vec(), merge::tensor_bytes(t)?)))
        .collect::<Result<Vec<_>>>()?;
    let views = raw
        .iter()
        .map(|(k, shape, bytes)| {
            let v = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                shape.clone(),
                bytes,
            )?;
            Ok((*k, v))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    atomic_write(path, &safetensors::serialize(views, Some(meta))?)
}

/// adapter_config.json's bytes: PEFT's LoRA config for `spec`.
pub fn adapter_config(
    spec: &LoraSpec,
    base_model: &str,
    revision: Option<&str>,
) -> Result<Vec<u8>> {
    // A MoE's experts are 3-D parameters: PEFT adapts those through `target_parameters`.
    let (params, modules): (Vec<&String>, Vec<&String>) = spec
        .targets
        .iter()
        .partition(|t| EXPERT_PARAMS.contains(&t.as_str()));
    let mut cfg = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": revision,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        // The recipe's number (0.05), not the f32's widened digits (0.05000000074505806).
        "lora_dropout": decimal(spec.dropout),
        "target_modules": modules,
        "bias": "none",
        "use_rslora": spec.rslora,
        "use_dora": spec.dora,
        "init_lora_weights": true,
        "fan_in_fan_out": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": true,
    });
    if !params.is_empty() {
        cfg["target_parameters"] = json!(params);
    }
    Ok(serde_json::to_string_pretty(&cfg)?.into_bytes())
}

/// An f32 as the shortest decimal that reads back as it (0.05f32 → 0.05).
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// Reads adapter_config.json; features we do not implement are errors, not silent changes.
pub fn read_adapter_config(dir: &Path) -> Result<AdapterInfo> {
    let path = dir.join(CONFIG);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    adapter_check::config(&v, &path)?;
    let err = |msg: String| anyhow::anyhow!("{}: {msg}", path.display());
    if let Some(t) = v.get("peft_type").and_then(Value::as_str) {
        if t != "LORA" {
            return Err(err(format!("peft_type \"{t}\" is not LORA")));
        }
    }
    let rank = v
        .get("r")
        .and_then(Value::as_u64)
        .filter(|&r| r > 0)
        .ok_or_else(|| err("`r` is missing".into()))? as usize;
    let alpha = v.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
    let dropout = v.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0) as f32;
    let rslora = v
        .get("use_rslora")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let dora = v.get("use_dora").and_then(Value::as_bool).unwrap_or(false);
    for k in ["rank_pattern", "alpha_pattern"] {
        if v.get(k)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(err(format!("`{k}` is not supported (per-module ranks)")));
        }
    }
    if let Some(b) = v.get("bias").and_then(Value::as_str) {
        if b != "none" {
            return Err(err(format!(
                "bias = \"{b}\" is not supported (only \"none\")"
            )));
        }
    }
    let mut targets: Vec<String> = match v.get("target_modules") {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect(),
        Some(Value::String(s)) if s == "all-linear" => {
            KNOWN_LINEAR.iter().map(|s| s.to_string()).collect()
        }
        Some(Value::String(s)) => {
            return Err(err(format!(
                "target_modules \"{s}\" (a regex) is not supported; list module names"
            )))
        }
        _ => return Err(err("`target_modules` is missing".into())),
    };
    // a MoE's expert parameters (PEFT's `target_parameters`, "mlp.experts.gate_up_proj")
    if let Some(Value::Array(a)) = v.get("target_parameters") {
        targets.extend(a.iter().filter_map(Value::as_str).map(String::from));
    }
    if let Some(bad) = targets.iter().find(|t| !KNOWN_LINEAR.contains(&t.as_str())) {
        return Err(err(format!(
            "target module \"{bad}\" is not one of {}",
            KNOWN_LINEAR.join(", ")
        )));
    }
    let targets = KNOWN_LINEAR
        .iter()
        .filter(|m| targets.iter().any(|t| t == *m))
        .map(|s| s.to_string())
        .collect();
    Ok(AdapterInfo {
        spec: LoraSpec {
            rank,
            alpha,
            dropout,
            rslora,
            dora,
            targets,
        },
        base_model: v
            .get("base_model_name_or_path")
            .and_then(Value::as_str)
            .map(String::from),
        revision: v.get("revision").and_then(Value::as_str).map(String::from),
    })
}

/// The base checkpoint an adapter names (`base_model_name_or_path`): a directory (absolute,
/// or relative to the working directory or to the adapter's own directory), else a Hub id
/// read from the Hugging Face cache (downloaded if the cache lacks it) at the adapter's
/// revision.
pub fn base_of(adapter: &Path, info: &AdapterInfo) -> Result<std::path::PathBuf> {
    let name = info.base_model.clone().unwrap_or_default();
    let cfg = adapter.join(CONFIG);
    let p = Path::new(&name);
    let dirs = match p.is_absolute() {
        true => vec![p.to_path_buf()],
        false => vec![p.to_path_buf(), adapter.join(p)],
    };
    if let Some(d) = dirs.iter().find(|d| d.join("config.json").is_file()) {
        return Ok(d.clone());
    }
    if name.is_empty() || p.is_absolute() || crate::util::check_repo_id(&name).is_err() {
        bail!(
            "{}: base_model_name_or_path = \"{name}\" is not a local checkpoint directory: pass --base DIR",
            cfg.display()
        );
    }
    let section = crate::recipe::ModelSection {
        path: None,
        id: Some(name.clone()),
        revision: info.revision.clone(),
        dtype: None,
        device: crate::recipe::DeviceKind::Cpu,
        quantize: Default::default(),
        double_quant: true,
    };
    let files = crate::hub::model_files(&section)
        .with_context(|| format!("{}: cannot get the Hub model \"{name}\"", cfg.display()))?;
    Ok(files.dir)
}

/// Loads adapter_model.safetensors into the model's adapters; every adapter must be present
/// with the right shape (a DoRA model's with its magnitudes).
pub fn load_adapter_weights(dir: &Path, model: &Model) -> Result<()> {
    let path = dir.join(WEIGHTS);
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("cannot read {}", path.display()))?;
    for (module, lora) in model.adapters() {
        for (key, var) in adapter_keys(module, lora) {
            let t = key_variants(&key)
                .iter()
                .find_map(|k| tensors.get(k))
                .with_context(|| format!("{} has no tensor `{key}`", path.display()))?;
            if t.dims() != var.dims() {
                bail!(
                    "{}: `{key}` has shape {:?}, the model needs {:?}",
                    path.display(),
                    t.dims(),
                    var.dims()
                );
            }
            adapter_check::tensor(&path, &key, t)?;
            var.set(&t.to_dtype(DType::F32)?.to_device(var.device())?)?;
        }
    }
    Ok(())
}
