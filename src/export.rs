//! PEFT-format adapters: `adapter_model.safetensors` + `adapter_config.json`.
//!
//! Keys are PEFT's: `base_model.model.<module>.lora_A.weight` (A [r, in]) and `.lora_B.weight`
//! (B [out, r]), f32, with safetensors metadata {"format": "pt"}, so that
//! `PeftModel.from_pretrained(base, dir)` loads them as-is; a DoRA adapter's magnitude m [out]
//! is `base_model.model.<module>.lora_magnitude_vector` (no `.weight`: PEFT 0.21's file key)
//! and its config says `"use_dora": true`.

pub(crate) mod adapter_check;
pub mod gguf;
pub mod merge;
mod progress;

use crate::lora::LoraSpec;
use crate::model::Model;
use crate::model::{Lora, EXPERT_PARAMS};
use crate::recipe::KNOWN_LINEAR;
use crate::util::atomic_write;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

// safetensors files are little-endian, and we write values as their bytes in memory.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "lora-train writes safetensors from memory as is: build for a little-endian target"
);

pub use crate::util::{CONFIG, WEIGHTS};

/// PEFT's file key of `module`'s adapter matrix `which` ('A' or 'B').
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
    /// The adapter's rank, scale, dropout and targets.
    pub spec: LoraSpec,
    /// `base_model_name_or_path`, when written.
    pub base_model: Option<String>,
    /// The base's Hub revision, when it came from the Hub.
    pub(crate) revision: Option<String>,
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

/// The model's adapter tensors as PEFT keys them, where they are (the device's): A [r, in],
/// B [out, r] (and m [out]), in the model's order.
pub(crate) fn adapter_parts(model: &Model) -> Vec<(String, Tensor)> {
    model
        .adapters()
        .flat_map(|(module, lora)| adapter_keys(module, lora))
        .map(|(key, var)| (key, var.as_tensor().clone()))
        .collect()
}

/// The model's adapters as PEFT keys them: A [r, in], B [out, r] (and m [out]), f32 host copies that
/// training no longer changes (the optimiser updates the device tensors in place).
pub(crate) fn adapter_tensors(model: &Model) -> Result<Vec<(String, Tensor)>> {
    let mut keys = Vec::new();
    let mut parts = Vec::new();
    for (key, t) in adapter_parts(model) {
        keys.push((key, t.shape().clone()));
        parts.push(t.to_dtype(DType::F32)?.flatten_all()?);
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
pub(crate) fn host_copy(t: &Tensor) -> candle_core::Result<Tensor> {
    match t.device() {
        Device::Cpu => t.copy(),
        _ => t.to_device(&Device::Cpu),
    }
}

/// `tensors` (host) as one safetensors file of f32 at `path`, written atomically, with the
/// metadata {"format": "pt"} that PEFT's loader expects. One metadata entry only: safetensors
/// writes a map's entries in hash order, and files of equal runs must be equal bytes.
pub fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let values = tensors
        .iter()
        .map(|(_, t)| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let parts: Vec<_> = tensors
        .iter()
        .zip(&values)
        .map(|((k, t), xs)| (k.as_str(), t.dims(), xs.as_slice()))
        .collect();
    write_f32(path, &parts)
}

/// A named f32 tensor's dims and values, borrowed.
pub type F32Part<'a> = (&'a str, &'a [usize], &'a [f32]);

/// safetensors' metadata for PEFT: {"format": "pt"}.
fn pt_metadata() -> HashMap<String, String> {
    HashMap::from([("format".to_string(), "pt".to_string())])
}

/// Named f32 values of the given shapes as one safetensors file at `path` (safetensors'
/// `serialize` bytes: names sorted, {"format": "pt"}), streamed from `parts` without a copy of
/// the values (a 7B checkpoint's 480 MB) and fsynced; `path` appears complete or not at all.
pub fn write_f32(path: &Path, parts: &[F32Part]) -> Result<()> {
    let views = parts
        .iter()
        .map(|&(name, shape, xs)| {
            let bytes: &[u8] = bytemuck::cast_slice(xs);
            let v = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                shape.to_vec(),
                bytes,
            )?;
            Ok((name, v))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .with_context(|| format!("cannot write {}", path.display()))?;
    // Written to a temporary file beside `path`, then renamed over it.
    safetensors::serialize_to_file(views, Some(pt_metadata()), path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot fsync {}", path.display()))
}

/// adapter_config.json's bytes: PEFT's LoRA config for `spec`.
pub(crate) fn adapter_config(
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
    let source = crate::hub::Source::Hub {
        id: name.clone(),
        revision: (info.revision.clone()).unwrap_or_else(|| crate::hub::DEFAULT_REVISION.into()),
    };
    let files = crate::hub::model_files(&source)
        .with_context(|| format!("{}: cannot get the Hub model \"{name}\"", cfg.display()))?;
    Ok(files.dir)
}

/// Loads adapter_model.safetensors into the model's adapters; every adapter must be present
/// with the right shape (a DoRA model's with its magnitudes).
pub fn load_adapter_weights(dir: &Path, model: &Model) -> Result<()> {
    let path = dir.join(WEIGHTS);
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let shapes = tensors.iter().map(|(k, t)| (k.as_str(), t.dims()));
    adapter_check::against_base(&path, shapes, &model.cfg)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed writer's file is safetensors' `serialize` byte for byte (names sorted, the
    /// same header and offsets), and `write_tensors` (f32 from any float dtype) writes the same.
    #[test]
    fn streamed_f32_files_equal_serialized_tensors() {
        let dir = std::env::temp_dir().join(format!("lt-write-f32-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        let b = vec![f32::MIN_POSITIVE, -0.0, 3.25];
        let parts: [F32Part; 2] = [
            ("z.lora_B.weight", &[2, 3], &a),
            ("a.lora_A.weight", &[3], &b),
        ];
        let views = parts.iter().map(|&(n, s, xs)| {
            let bytes: &[u8] = bytemuck::cast_slice(xs);
            let v =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.to_vec(), bytes);
            (n, v.unwrap())
        });
        let want = safetensors::serialize(views, Some(pt_metadata())).unwrap();
        let tensors: Vec<(String, Tensor)> = parts
            .iter()
            .map(|&(n, s, xs)| {
                let t = Tensor::from_slice(xs, s, &Device::Cpu).unwrap();
                (n.to_string(), t.to_dtype(DType::F64).unwrap())
            })
            .collect();
        let (p1, p2) = (
            dir.join("streamed.safetensors"),
            dir.join("written.safetensors"),
        );
        write_f32(&p1, &parts).unwrap();
        write_tensors(&p2, &tensors).unwrap();
        let (f1, f2) = (std::fs::read(&p1).unwrap(), std::fs::read(&p2).unwrap());
        assert_eq!(f1, want);
        assert_eq!(f2, want);
        let st = safetensors::SafeTensors::deserialize(&f1).unwrap();
        let z = st.tensor("z.lora_B.weight").unwrap();
        assert_eq!(z.shape(), [2, 3]);
        assert_eq!(z.data(), bytemuck::cast_slice::<f32, u8>(&a));
        // Nothing but the file itself is left beside it.
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["streamed.safetensors", "written.safetensors"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
