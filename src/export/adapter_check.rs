//! What a PEFT adapter must be before it is used (`lora.init_adapter`, `export --adapter`,
//! a checkpoint's adapter): every key of adapter_config.json we read has the type and range
//! PEFT gives it (a wrong one is an error naming the key, never a silent default), and every
//! tensor is floating point and finite.

use crate::model::ConfigError;
use crate::recipe::bounds::MAX_RANK;
use anyhow::{bail, Result};
use candle_core::Tensor;
use serde_json::Value;
use std::path::Path;

/// The type each key must have when present (null counts as absent, as PEFT writes it).
#[derive(Clone, Copy)]
enum Kind {
    Str,
    Bool,
    /// A positive integer.
    Count,
    /// A finite number.
    Number,
    StrOrList,
    Map,
}

const KEYS: [(&str, Kind); 13] = [
    ("peft_type", Kind::Str),
    ("r", Kind::Count),
    ("lora_alpha", Kind::Number),
    ("lora_dropout", Kind::Number),
    ("use_rslora", Kind::Bool),
    ("use_dora", Kind::Bool),
    ("bias", Kind::Str),
    ("target_modules", Kind::StrOrList),
    ("target_parameters", Kind::StrOrList),
    ("rank_pattern", Kind::Map),
    ("alpha_pattern", Kind::Map),
    ("base_model_name_or_path", Kind::Str),
    ("fan_in_fan_out", Kind::Bool),
];

/// adapter_config.json's keys (`v`, read from `path`) before any is used.
pub(crate) fn config(v: &Value, path: &Path) -> Result<(), ConfigError> {
    let err = |key: &str, msg: String| ConfigError::Adapter {
        path: path.to_owned(),
        msg: format!("`{key}` {msg}"),
    };
    if !v.is_object() {
        return Err(ConfigError::Adapter {
            path: path.to_owned(),
            msg: "is not a JSON object".into(),
        });
    }
    for (key, kind) in KEYS {
        let Some(x) = v.get(key).filter(|x| !x.is_null()) else {
            continue;
        };
        let ok = match kind {
            Kind::Str => x.is_string(),
            Kind::Bool => x.is_boolean(),
            Kind::Count => x.as_u64().is_some_and(|n| n >= 1),
            Kind::Number => x.as_f64().is_some_and(f64::is_finite),
            Kind::StrOrList => {
                x.is_string()
                    || x.as_array()
                        .is_some_and(|a| a.iter().all(|e| e.is_string() || e.is_u64()))
            }
            Kind::Map => x.is_object(),
        };
        if !ok {
            let want = match kind {
                Kind::Str => "a string",
                Kind::Bool => "true or false",
                Kind::Count => "a positive integer",
                Kind::Number => "a number",
                Kind::StrOrList => "a string or a list",
                Kind::Map => "an object",
            };
            return Err(err(key, format!("= {x} must be {want}")));
        }
    }
    for key in ["r", "target_modules"] {
        if v.get(key).is_none_or(Value::is_null) {
            return Err(err(key, "is missing: is this a PEFT LoRA adapter?".into()));
        }
    }
    let num = |k: &str| v.get(k).and_then(Value::as_f64);
    if let Some(r) = v.get("r").and_then(Value::as_u64) {
        if r > MAX_RANK as u64 {
            return Err(err(
                "r",
                format!("= {r} is more than it can mean: at most {MAX_RANK}"),
            ));
        }
    }
    if let Some(a) = num("lora_alpha") {
        if a <= 0.0 {
            return Err(err(
                "lora_alpha",
                format!("= {a} must be a positive number"),
            ));
        }
    }
    if let Some(p) = num("lora_dropout") {
        if !(0.0..1.0).contains(&p) {
            return Err(err("lora_dropout", format!("= {p} must be in [0, 1)")));
        }
    }
    if v.get("fan_in_fan_out").and_then(Value::as_bool) == Some(true) {
        return Err(err(
            "fan_in_fan_out",
            "= true (weights stored transposed, GPT-2 style) is not supported for Llama-family linears".into(),
        ));
    }
    if v.get("layers_to_transform").is_some_and(|x| !x.is_null()) {
        return Err(err(
            "layers_to_transform",
            "is set: adapters on some layers only are not supported".into(),
        ));
    }
    let params = v
        .get("target_parameters")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty());
    match v.get("target_modules") {
        Some(Value::Array(a)) if a.is_empty() && !params => Err(err(
            "target_modules",
            "is an empty list: name at least one module".into(),
        )),
        Some(Value::Array(a)) if a.iter().any(|e| !e.is_string()) => Err(err(
            "target_modules",
            "must list module names (strings)".into(),
        )),
        _ => Ok(()),
    }
}

/// An adapter tensor `key` of `path`: floating point, finite.
pub(crate) fn tensor(path: &Path, key: &str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        bail!(
            "{}: `{key}` has dtype {:?}: adapter weights are floating point",
            path.display(),
            t.dtype()
        );
    }
    if let Some(i) = crate::model::check::first_non_finite(t)? {
        bail!(
            "{}: `{key}` holds NaN or infinite values (entry {i}): the adapter is damaged",
            path.display()
        );
    }
    Ok(())
}
