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

/// The one check of an adapter against its base, before any consumer uses it (`generate
/// --adapter`, `lora.init_adapter`, resume, `export`): every tensor of the adapter file
/// `path` (PEFT key and shape) adapts a linear the base `cfg` has (a decoder layer within its
/// layer count, a module of its family, a MoE's experts where it has them), with that linear's
/// inputs and outputs (A [r, in], B [out, r], DoRA's m [out]). An error names the key, what it
/// says and what the base has: the adapter was trained on another model.
pub(crate) fn against_base<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (&'a str, &'a [usize])>,
    cfg: &crate::model::ModelConfig,
) -> Result<()> {
    let mut tensors: Vec<(&str, &[usize])> = tensors.into_iter().collect();
    tensors.sort();
    for (key, dims) in tensors {
        if let Err(what) = fits_base(key, dims, cfg) {
            bail!(
                "{}: `{key}` {what}: the adapter was trained on another model; use the base it \
                 was trained on (its adapter_config.json's base_model_name_or_path)",
                path.display()
            );
        }
    }
    Ok(())
}

/// Where PEFT key `key` [dims] does not fit `cfg`: what it says, and what the base has.
fn fits_base(key: &str, dims: &[usize], cfg: &crate::model::ModelConfig) -> Result<(), String> {
    let (module, which) = peft_module(key)
        .ok_or_else(|| "is not a LoRA A / B weight or DoRA magnitude of a linear".to_string())?;
    let base = format!(
        "the base ({}, {} layers, hidden size {})",
        cfg.family.model_type(),
        cfg.num_layers,
        cfg.hidden_size
    );
    let in_layer = module
        .strip_prefix("model.layers.")
        .and_then(|m| m.split_once('.'))
        .and_then(|(n, rest)| Some((n.parse::<usize>().ok()?, rest)));
    let Some((layer, rest)) = in_layer else {
        return Err(format!(
            "adapts `{module}`, which is no decoder layer's linear in {base}"
        ));
    };
    if layer >= cfg.num_layers {
        return Err(format!(
            "adapts layer {layer}, but {base} has layers 0 to {}",
            cfg.num_layers.saturating_sub(1)
        ));
    }
    if rest == "mlp.experts" || rest == "mlp.experts.base_layer" {
        return match cfg.arch.moe {
            Some(_) => Ok(()),
            None => Err(format!("adapts a MoE's experts, but {base} has none")),
        };
    }
    let leaf = rest.rsplit('.').next().unwrap_or(rest);
    let Some((inp, out)) = cfg.linear_shape(leaf) else {
        return Err(format!(
            "adapts `{leaf}`, which {base} does not have (its linears: {})",
            cfg.linears().join(", ")
        ));
    };
    let ok = match (which, dims) {
        ('A', [_, i]) => *i == inp,
        ('B', [o, _]) => *o == out,
        ('m', [o]) => *o == out,
        _ => false,
    };
    if ok {
        return Ok(());
    }
    let want = match which {
        'A' => format!("[r, {inp}]"),
        'B' => format!("[{out}, r]"),
        _ => format!("[{out}]"),
    };
    Err(format!(
        "has shape {dims:?}, but `{leaf}` of {base} takes {want} ({inp} inputs, {out} outputs)"
    ))
}

/// A PEFT key's module and part ('A', 'B' or the magnitude 'm'), with or without the
/// adapter's name (`.default`): `base_model.model.<module>.lora_A.weight` → (module, 'A').
fn peft_module(key: &str) -> Option<(&str, char)> {
    let m = key.strip_prefix("base_model.model.")?;
    let m = m
        .strip_suffix(".default.weight")
        .or_else(|| m.strip_suffix(".weight"))
        .unwrap_or(m);
    [
        (".lora_A", 'A'),
        (".lora_B", 'B'),
        (".lora_magnitude_vector", 'm'),
    ]
    .into_iter()
    .find_map(|(s, w)| m.strip_suffix(s).map(|m| (m, w)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_adapter_is_held_to_its_bases_layers_modules_and_shapes() {
        let cfg = crate::model::shapes::shape("tiny").unwrap();
        let (l, c) = (cfg.num_layers, cfg.hidden_size);
        let q = "base_model.model.model.layers.0.self_attn.q_proj";
        let a = format!("{q}.lora_A.weight");
        let b = format!("{q}.lora_B.default.weight");
        let m = format!("{q}.lora_magnitude_vector");
        let p = Path::new("a/adapter_model.safetensors");
        let ok = [(a.as_str(), &[8, c][..]), (&b, &[c, 8]), (&m, &[c])];
        against_base(p, ok, &cfg).unwrap();
        let extra = format!("base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight");
        let e = against_base(p, [(extra.as_str(), &[8, c][..])], &cfg).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "a/adapter_model.safetensors: `{extra}` adapts layer {l}, but the base (llama, \
                 {l} layers, hidden size {c}) has layers 0 to {}: the adapter was trained on \
                 another model; use the base it was trained on (its adapter_config.json's \
                 base_model_name_or_path)",
                l - 1
            )
        );
        let wide = [(a.as_str(), &[8, c + 1][..])];
        let e = against_base(p, wide, &cfg).unwrap_err().to_string();
        assert!(e.contains(&format!("has shape [8, {}]", c + 1)), "{e}");
        let qkv = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight";
        let e = against_base(p, [(qkv, &[8, c][..])], &cfg)
            .unwrap_err()
            .to_string();
        assert!(e.contains("adapts `qkv_proj`, which the base"), "{e}");
        let head = "base_model.model.lm_head.lora_A.weight";
        let e = against_base(p, [(head, &[8, c][..])], &cfg)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("adapts `lm_head`, which is no decoder layer's linear"),
            "{e}"
        );
        let experts = "base_model.model.model.layers.0.mlp.experts.lora_A.weight";
        let e = against_base(p, [(experts, &[8, c][..])], &cfg)
            .unwrap_err()
            .to_string();
        assert!(e.contains("adapts a MoE's experts, but the base"), "{e}");
    }
}
